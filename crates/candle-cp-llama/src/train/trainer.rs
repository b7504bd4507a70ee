//! The training loop of one rank: data → shard → loss → backward (with gradient
//! accumulation) → gradient reduction → global-norm clipping → AdamW, plus metrics,
//! loss plot and atomic, resumable checkpoints.
//!
//! Every rank runs [`train_rank`] with the same [`TrainConfig`] (e.g. inside
//! `candle_cp_comm::run_ranks`). Batches are regenerated from (seed, step, micro-batch), so a
//! resumed run sees exactly the batches the uninterrupted run would have seen.
//!
//! Samples that carry packed documents ([`super::data::DataSource::Packed`]) are sharded with
//! [`crate::shard_batch_packed`] and trained with [`Llama::token_nll_packed`]: attention
//! inside documents, RoPE positions per document, no target across a boundary; the loss is
//! the mean over the remaining targets of all ranks, as for plain rows.

use super::batches::{global_batch, nll_terms, rows_batch};
// (for the trainer's tests, which see this module's names)
#[cfg(test)]
use {super::batches::batch_of, super::data::DataSource};
use super::checkpoint::{latest_checkpoint, TrainState};
use super::clip::clip_factor;
pub use super::metrics::plot_metrics;
use super::metrics::{peak_rss_bytes, MetricsLog, StepMetrics};
use super::optim::AdamW;
use crate::{
    global_mean, init_params_sharded, load_hf_sharded, param_specs, shard_batch, shard_batch_packed, Llama, ParallelCtx, IGNORE,
};
use candle_core::{bail, Device, Result, Tensor};
use candle_cp_comm::Group;
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

pub use super::config::{ModelSource, TrainConfig, TrainOutcome};

pub(super) fn ioe(what: &str, p: &Path, e: std::io::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what} {}: {e}", p.display()))
}

/// Run (or resume) training on this rank. Collective over `world`; every rank gets the same
/// metrics. `on_step` is called on world rank 0 after every optimizer step.
pub fn train_rank(
    world: Group,
    cfg: &TrainConfig,
    on_step: &(dyn Fn(&StepMetrics) + Sync),
) -> Result<TrainOutcome> {
    let rank = world.rank();
    // a group bound to a device (an NCCL rank: its GPU) fixes where this rank computes
    let dev = match (world.home_device(), cfg.cuda) {
        (Some(d), true) if d.is_cuda() => d,
        (Some(d), _) => bail!(
            "train: {} computes on {d:?}, but the config says cuda = {}",
            world.describe(),
            cfg.cuda
        ),
        (None, true) => Device::new_cuda(rank % cfg.gpus.max(1))?,
        (None, false) => Device::Cpu,
    };
    let host = Device::Cpu;
    if cfg.grad_accum == 0 || cfg.batch == 0 || cfg.steps == 0 {
        bail!(
            "train: grad_accum ({}), batch ({}) and steps ({}) must be > 0",
            cfg.grad_accum,
            cfg.batch,
            cfg.steps
        )
    }
    cfg.schedule.validate()?;
    cfg.adamw.validate()?;
    if cfg.clip.is_nan() {
        bail!("train: clip must be a number (<= 0: no clipping), got NaN")
    }
    if cfg.overlap_grad_sync && !cfg.recompute {
        bail!("train: overlap_grad_sync needs recompute (a layer's gradients are known before the end of the backward only when the layer is recomputed)")
    }
    if cfg.overlap_param_gather && !(cfg.zero1 || cfg.zero2) {
        bail!("train: overlap_param_gather needs zero1 or zero2 (without ZeRO every rank updates whole parameters and nothing is gathered)")
    }
    if !cfg.batch.is_multiple_of(cfg.layout.dp) {
        bail!(
            "train: batch {} must be divisible by dp = {}",
            cfg.batch,
            cfg.layout.dp
        )
    }
    let ctx = ParallelCtx::new(world.clone(), cfg.layout)?;
    let ckpt_root = cfg.out.as_ref().map(|o| o.join("checkpoints"));

    // Initial state: a checkpoint to resume, a HF checkpoint, or a random init.
    let resume_from = match (&ckpt_root, cfg.resume) {
        (Some(root), true) => latest_checkpoint(root).map_err(|e| ioe("reading", root, e))?,
        _ => None,
    };
    // Each rank reads or draws only its own shards, one full tensor at a time on the host.
    // (`base_dir`: the model directory the weights came from, when it is not the checkpoint's)
    let (varmap, mut mcfg, state, base_dir) = match (&resume_from, &cfg.model) {
        (Some(dir), _) => {
            // (written by another layout: the weights are full HF tensors; the optimizer
            // state is resharded below; a LoRA checkpoint's base model is where it says)
            let st = TrainState::load(dir.join("train_state.json"))
                .map_err(|e| ioe("reading", dir, e))?;
            let base = crate::lora::base_model_dir(dir)?;
            let (vm, c) = load_hf_sharded(&base, &ctx, &dev, cfg.dtype)?;
            (vm, c, Some(st), (base != *dir).then_some(base))
        }
        (None, ModelSource::Hf(dir)) => {
            // (a reward model or a PRM: a causal LM's score head drawn, its LM head not read)
            let (vm, c) = match super::classifier::load_new_head(cfg, dir, &ctx, &dev)? {
                Some(loaded) => loaded,
                None => load_hf_sharded(dir, &ctx, &dev, cfg.dtype)?,
            };
            (vm, c, None, Some(dir.clone()))
        }
        (None, ModelSource::Init(c)) => {
            cfg.layout.validate(c.num_attention_heads, c.num_key_value_heads)?;
            let c = super::classifier::init_config(cfg, c)?;
            (init_params_sharded(&c, cfg.seed, cfg.dtype, &ctx, &dev)?, c, None, None)
        }
    };
    super::classifier::check_run(cfg, &mcfg)?;
    let window_changed = cfg.sliding_window.is_some() && cfg.sliding_window != mcfg.sliding_window;
    if cfg.sliding_window.is_some() {
        mcfg.sliding_window = cfg.sliding_window;
        mcfg.validate()?;
    }
    // LoRA: the adapters beside the base weights (from the checkpoint being resumed, or drawn)
    let lora_saved = resume_from.as_ref().filter(|d| d.join("adapter_config.json").exists());
    match (&cfg.lora, lora_saved, &resume_from) {
        (Some(l), _, _) => {
            if let (Some(dir), None) = (&resume_from, lora_saved) {
                bail!("resume: {} holds no LoRA adapter (a run that trained every weight): resume it without lora", dir.display())
            }
            let from = lora_saved.or(cfg.lora_init.as_ref());
            // (a transformers 5 adapter holding no expert tensor, its target modules naming MLP
            // projections: read as transformers 5's model, its experts parameters no target module
            // reaches — expert_params::transformers_5_spec; a run started from one writes such
            // checkpoints, read alike when resumed)
            let l = match from.filter(|d| crate::lora::has_adapter(d)) {
                Some(dir) => crate::expert_params::transformers_5_spec(&mcfg, l.clone(), crate::lora::adapter_tensor_names(dir)?),
                None => l.clone(),
            };
            // (a Phi-3's modules named as its fused ones)
            mcfg = mcfg.with_lora(Some(l));
            mcfg.validate()?;
            super::lora::add_adapters(&varmap, &mcfg, &ctx, cfg.seed, cfg.dtype, &dev, from.map(|d| d.as_path()))?;
            if from.is_none() {
                // DoRA's magnitudes from the base weights the model computes with
                super::lora::set_dora_magnitudes(&varmap, &mcfg, &ctx, cfg.quantize_base)?;
            }
        }
        (None, Some(dir), _) => bail!("resume: {} holds LoRA adapters: resume it with the same lora settings", dir.display()),
        (None, None, _) if cfg.lora_init.is_some() => bail!("train: lora_init without lora (the adapters' rank, alpha and targets)"),
        (None, None, _) => {}
    }
    // a LoRA run's checkpoints name the frozen base (written once when there is no model
    // directory to name)
    // (a causal LM read as a reward model changed too: its base is the reward model, score
    // head drawn, written once)
    let head_changed = match (&resume_from, &cfg.model) {
        (None, ModelSource::Hf(d)) => super::classifier::head_changed(cfg, d)?,
        _ => false,
    };
    let lora_base = match (&cfg.lora, &cfg.out) {
        (Some(_), Some(out)) => Some(super::lora::BaseModel::new(out, base_dir.as_deref(), window_changed || head_changed)?.with_tokenizer(cfg.tokenizer.clone())),
        _ => None,
    };
    if let Some(rate) = cfg.expert_bias_update {
        super::expert_bias::check(rate, &mcfg, cfg.lora.is_some())?;
    }
    cfg.layout
        .validate(mcfg.num_attention_heads, mcfg.num_key_value_heads)?;
    if let Some(e) = &cfg.eval {
        e.check(mcfg.vocab_size)?;
    }
    if cfg.data.vocab_needed() > mcfg.vocab_size {
        bail!(
            "train: data uses {} token ids, model vocabulary is {}",
            cfg.data.vocab_needed(),
            mcfg.vocab_size
        )
    }
    let n_params: usize = param_specs(&mcfg)
        .iter()
        .map(|s| s.shape.iter().product::<usize>())
        .sum();
    // (a LoRA run: the base weights frozen, plain tensors or quantized)
    let (model, frozen_weight_bytes) = match &mcfg.lora {
        Some(_) => super::lora::frozen_model(&varmap, &mcfg, &ctx, cfg.quantize_base, cfg.dtype, &dev, lora_base.as_ref(), &world)?,
        None if cfg.quantize_base.is_some() => bail!("train: quantize_base quantizes a LoRA run's frozen base: set lora"),
        None => (Llama::new(VarBuilder::from_varmap(&varmap, cfg.dtype, &dev), &mcfg, &ctx)?, 0),
    };
    let model = model.with_recompute(cfg.recompute);
    let trainable_params: usize = crate::params::trainable_specs(&mcfg).iter().map(|s| s.shape.iter().product::<usize>()).sum();
    let trainable: std::collections::HashSet<String> = crate::params::trainable_specs(&mcfg).into_iter().map(|s| s.name).collect();
    let named_vars: Vec<(String, candle_core::Var)> = {
        let data = crate::params::lock_vars(&varmap)?;
        data.iter().filter(|(k, _)| trainable.contains(*k)).map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    // each parameter's split over TP: how many TP ranks hold its gradient (for the global norm)
    let shards: HashMap<String, crate::params::Shard> = param_specs(&mcfg).into_iter().map(|s| (s.name, s.shard)).collect();
    // DP and CP replicas hold identical optimizer states (same reduced gradients, same
    // updates): one file per TP rank, written by the replica with dp = cp = 0. With ZeRO-1
    // each replica keeps 1/(dp·cp) of it; the file is gathered and identical.
    let mut opt = if cfg.zero1 || cfg.zero2 {
        AdamW::new_zero1(named_vars, cfg.adamw, ctx.dp_cp.clone())?
    } else {
        AdamW::new(named_vars, cfg.adamw)?
    };
    // the experts' state: with ZeRO split over the ranks holding the same experts (ep_dp), not
    // over all the replicas; gathered over the EP group when saved (the file holds every expert)
    let experts: std::collections::HashSet<String> =
        crate::params::trainable_specs(&mcfg).into_iter().filter(|s| s.is_expert() && ctx.ep.is_some()).map(|s| s.name).collect();
    if let Some(ep) = &ctx.ep {
        opt = opt.with_expert_parallel(ep.clone(), ctx.ep_dp.clone(), experts.iter().cloned())?;
    }
    // accumulation and sums of the gradients (overlapped, ZeRO-1 / ZeRO-2: train/grad_step.rs)
    let grad_steps = super::grad_step::GradSteps::new(&model, &varmap, &mcfg, &ctx, &opt, cfg.overlap_grad_sync, cfg.zero2)?;
    // ZeRO's parameter all-gathers left running into the next forward (overlap_param_gather)
    let param_gather = super::param_gather::ParamGather::new(&model, &ctx, cfg.overlap_param_gather)?;
    let tp_i = ctx.coords.2;
    let opt_file = |dir: &Path| super::run_save::optimizer_file(dir, tp_i);
    let mut resharded_from = None;
    let (start_step, mut tokens_seen, prev_elapsed) = match (&resume_from, &state) {
        (Some(dir), Some(st)) => {
            // The files are per TP rank and identical across DP and CP replicas (and ZeRO
            // slices them on load), so the same TP degree reads its own file whatever else
            // changed (CP kind or degree, DP, SP, the head layout); another degree reshards.
            let old_tp = super::checkpoint::optimizer_tp_degree(dir);
            if old_tp == ctx.layout.tp && ctx.ep.is_none() {
                opt.load(opt_file(dir))?;
            } else {
                resharded_from = Some(old_tp);
                let state = super::checkpoint::reshard_optimizer_state(dir, &mcfg, &ctx)?;
                opt.load_tensors(&state, dir)?;
            }
            if opt.step != st.step {
                bail!(
                    "resume: optimizer state at step {} but train_state at step {}",
                    opt.step,
                    st.step
                )
            }
            (st.step, st.tokens_seen, st.elapsed_s)
        }
        _ => (0, 0, 0.0),
    };

    let is_main = rank == 0;
    // DPO: the reference log-probabilities of the model as the run starts (read back on resume)
    let mut dpo = super::dpo::prepare(cfg, &model, (&varmap, &mcfg), &ctx, &dev, resume_from.as_deref().filter(|_| start_step > 0), is_main)?;
    // GRPO: the prompts whose completions each micro-batch samples (and, with a KL term, the
    // reference: the model as the run started, read back from the checkpoint on resume)
    let mut grpo = super::grpo_run::prepare(cfg, &mcfg, (&varmap, &model, &ctx, &dev), resume_from.as_deref().filter(|_| start_step > 0))?;
    // BCO: the running mean reward as the resumed checkpoint left it
    if let (Some(d), Some(m)) = (dpo.as_mut(), state.as_ref().and_then(|s| s.bco_mean)) {
        d.running = m;
    }
    let metrics_path = cfg.out.as_ref().map(|o| o.join("metrics.jsonl"));
    let log = match (&metrics_path, is_main) {
        (Some(p), true) => {
            if let Some(o) = &cfg.out {
                std::fs::create_dir_all(o).map_err(|e| ioe("creating", o, e))?;
            }
            let resume_step = resume_from.as_ref().map(|_| start_step);
            Some(MetricsLog::open(p, resume_step).map_err(|e| ioe("opening", p, e))?)
        }
        _ => None,
    };

    // (each checkpoint: the weights or adapters, the optimizer's state, the run's state)
    let saver = super::run_save::RunSaver { cfg, root: ckpt_root.as_deref(), world: &world, ctx: &ctx, varmap: &varmap, mcfg: &mcfg, lora_base: lora_base.as_ref(), carry_from: base_dir.as_deref().or(resume_from.as_deref()), is_main };

    let t_start = Instant::now();
    let mut out = Vec::new();
    let tokens_per_step = (cfg.batch * cfg.seq_len * cfg.grad_accum) as u64;
    let token_group = ctx.token_group().clone();
    for step in start_step..cfg.steps {
        let t0 = Instant::now();
        let lr = cfg.schedule.lr(step);
        let mut acc = super::grad_step::StepGrads::default();
        let mut terms = [0f64; 4];
        let mut objective = 0f64;
        let mut dpo_sums = [0f64; 3];
        // GRPO: the step's rewards, completion tokens and completions
        // (GRPO: Σ rewards, Σ lengths, completions, groups with one reward, groups)
        let mut grpo_sums = [0f64; 5];
        let mut grpo_kl = 0f64;
        let mut grpo_clip: Option<f64> = None;
        let mut aux_sum: Option<f64> = None;
        let mut load_sum: Option<f64> = None;
        // each sparse layer's expert counts over this rank's tokens, summed over micro-batches
        let mut counts: Vec<Vec<usize>> = Vec::new();
        // GRPO: the step's completions sampled from the policy as it is (its parameters whole
        // first), rewarded, packed and weighed, before its first micro-batch trains — every
        // steps_per_generation · num_iterations steps; the steps between train on the kept ones
        if let Some(g) = grpo.as_mut() {
            if g.samples_at(step)? {
                param_gather.finish()?;
                g.sample(&model, cfg, step, (&ctx, &dev))?;
            }
        }
        for micro in 0..cfg.grad_accum {
            let rollout = grpo.as_ref().map(|g| g.rollout(step, (micro, cfg.grad_accum))).transpose()?;
            let (ids, mask, docs) = match rollout {
                Some(r) => {
                    grpo_sums[0] += r.rewards.iter().sum::<f64>();
                    grpo_sums[1] += r.lengths.iter().sum::<usize>() as f64;
                    grpo_sums[2] += r.rewards.len() as f64;
                    if let Some(g) = &grpo {
                        for group in r.rewards.chunks(g.cfg.num_generations) {
                            grpo_sums[3] += group.iter().all(|x| x.to_bits() == group[0].to_bits()) as u8 as f64;
                            grpo_sums[4] += 1.0;
                        }
                    }
                    rows_batch(&r.rows, cfg, (step, micro), &host)?
                }
                None => global_batch(cfg, step, micro, &host)?,
            };
            // LoRA dropout: this forward's masks (keyed on the micro-batch's global number)
            model.set_lora_dropout(Some((candle_cp_nn::RngStreams::new(cfg.seed), (step * cfg.grad_accum + micro) as u64, cfg.batch, cfg.seq_len)))?;
            // KTO: the KL documents' forward first, without a backward
            let kl = dpo.as_ref().map(|d| d.kl_logps(&model, cfg, step, micro, &ctx, &dev)).transpose()?.flatten();
            // packed rows: labels IGNORE at document ends, RoPE positions per document,
            // attention inside documents
            let sb = match &docs {
                Some(d) => shard_batch_packed(&ids, d, &ctx)?,
                None => shard_batch(&ids, &ctx)?,
            };
            let mb = shard_batch(&mask, &ctx)?;
            // per-token losses of every target through the chunked head (no [B, Ts, V]
            // logits); the objective takes all targets, or the long-range ones
            let (ids_d, labels_d, pos_d) = (
                sb.input_ids.to_device(&dev)?,
                sb.labels.to_device(&dev)?,
                sb.positions.to_device(&dev)?,
            );
            // (WPO: each token's log Σ p² from the head beside its loss; GRPO's high-entropy
            // tokens: each token's entropy)
            let stat = match (&dpo, &grpo) {
                (Some(d), _) if d.cfg.use_weighting => Some(crate::head_loss::HeadStat::SumSq),
                (_, Some(g)) if g.cfg.top_entropy_quantile < 1.0 => Some(crate::head_loss::HeadStat::Entropy),
                _ => None,
            };
            // (a reward model or a PRM: its score head's loss; it has no LM head, so no per-token
            // losses)
            let head_loss = super::classifier::micro_loss(&model, cfg, (step, micro), (&sb, &ids_d, &pos_d), &ctx, &token_group)?;
            let (nll, sq) = match (&docs, stat) {
                _ if head_loss.is_some() => (Tensor::zeros(ids_d.dims(), candle_core::DType::F32, &dev)?, None),
                (Some(_), Some(st)) => {
                    let (n, q) = model.token_nll_packed_stat(&ids_d, &labels_d, &pos_d, &sb.documents, st)?;
                    (n, Some(q))
                }
                (Some(_), None) => (model.token_nll_packed(&ids_d, &labels_d, &pos_d, &sb.documents)?, None),
                (None, _) => (model.token_nll(&ids_d, &labels_d, &pos_d)?, None),
            };
            param_gather.check_forward_done()?;
            // (read before the backward, which routes recomputed layers again)
            for (i, l) in model.expert_counts().into_iter().enumerate() {
                match counts.get_mut(i) {
                    Some(a) => a.iter_mut().zip(&l).for_each(|(a, c)| *a += c),
                    None => counts.push(l),
                }
            }
            let labels: Vec<u32> = sb.labels.flatten_all()?.to_vec1()?;
            let lr_mask: Vec<u32> = mb.labels.flatten_all()?.to_vec1()?;
            let nll = nll.flatten_all()?;
            let values: Vec<f32> = nll.detach().to_device(&host)?.to_vec1()?;
            // (DPO: the objective in f64 from its terms, not the node's f32 value, which carries
            // the linearised sum `Σ w_t·nll_t` — far larger than the loss where the weights are,
            // as under an α-divergence without a reference — to float32's precision)
            let (loss, mut exact) = match (&mut dpo, &grpo) {
                _ if head_loss.is_some() => match head_loss {
                    Some(h) => {
                        (dpo_sums[0], dpo_sums[1]) = (dpo_sums[0] + h.accuracy, dpo_sums[1] + h.margin.unwrap_or(0.0));
                        (h.node, Some(h.loss))
                    }
                    None => bail!("train: internal error (score head's loss)"),
                },
                // (GRPO: the completions' tokens, marked, weighted by their advantages and
                // clipped ratios)
                (None, Some(g)) => {
                    // (the KL term: the reference's per-token losses of the same rows)
                    let ref_nll = g.reference_nll(&sb, &dev)?;
                    let entropy: Option<Vec<f32>> = sq.as_ref().map(|e| e.flatten_all()?.to_device(&host)?.to_vec1()).transpose()?;
                    let t = g.rollout(step, (micro, cfg.grad_accum))?.loss((&nll, &values), (ref_nll.as_deref(), entropy.as_deref()), &g.cfg, (&labels, &lr_mask), &ctx, &token_group)?;
                    grpo_kl += t.kl;
                    if let Some(c) = t.clipped {
                        *grpo_clip.get_or_insert(0.0) += c;
                    }
                    (t.node, Some(t.value))
                }
                // (the marks sharded above: DPO's answers are the marked tokens)
                (Some(d), _) => {
                    let rows = cfg.data.preference_rows(cfg.seed, step, micro * cfg.batch, cfg.batch, cfg.seq_len)?;
                    let (l, t) = super::dpo::DpoBatch::new(&rows, cfg.seq_len)?.loss((&nll, sq.as_ref()), &labels, &lr_mask, &d.answers, &d.cfg, &ctx, &token_group, kl.as_ref(), &mut d.running)?;
                    (dpo_sums[0], dpo_sums[1], dpo_sums[2]) = (dpo_sums[0] + t.accuracy, dpo_sums[1] + t.margin, dpo_sums[2] + t.kl.unwrap_or(0.0));
                    (l, Some(t.loss))
                }
                (None, None) => {
                    let train: Vec<f32> = labels
                        .iter()
                        .zip(&lr_mask)
                        .map(|(&l, &m)| (l != IGNORE && (!cfg.long_range_only || m == 1)) as u8 as f32)
                        .collect();
                    let n_train = train.iter().filter(|&&x| x > 0.0).count();
                    let selected = (&nll * Tensor::from_vec(train, nll.shape(), &dev)?)?;
                    (global_mean(&selected, n_train, &token_group)?, None)
                }
            };
            // Qwen3-MoE's load-balancing term (a constant here; its derivative reaches the
            // routers through the sparse layers' backward)
            let loss = match model.router_aux_loss()? {
                Some(aux) => {
                    let a = aux.to_scalar::<f32>()? as f64;
                    *aux_sum.get_or_insert(0.0) += a;
                    exact = exact.map(|e| e + a);
                    if let Some(l) = model.expert_load() {
                        *load_sum.get_or_insert(0.0) += l;
                    }
                    (loss + aux.to_device(&dev)?)?
                }
                None => loss,
            };
            objective += match exact {
                Some(e) => e,
                None => loss.to_scalar::<f32>()? as f64,
            };
            // (GRPO with num_iterations > 1: this forward's losses are π_old's for the
            // generation's later steps)
            if let (Some(g), true) = (grpo.as_mut(), dpo.is_none()) {
                g.record_old(step, (micro, cfg.grad_accum), &values, &ctx, &token_group)?;
            }
            for (acc, x) in terms
                .iter_mut()
                .zip(nll_terms(&values, &labels, &lr_mask))
            {
                *acc += x;
            }
            grad_steps.before_backward(&mut acc, micro + 1 == cfg.grad_accum)?;
            let g = model.backward(&loss)?;
            grad_steps.after_backward(&mut acc, g, &opt)?;
        }
        let super::grad_step::Summed { whole: mut named, slices } = grad_steps.finish(acc, &opt)?;
        let inv_accum = 1.0 / cfg.grad_accum as f64;
        let norm = super::clip::step_norm((&named, &slices), (&shards, &experts), &opt, &ctx)? * inv_accum;
        named.extend(slices);
        let factor = clip_factor(norm, cfg.clip);
        // the losses and expert counts over the ranks holding distinct tokens (TP ranks under
        // SP route the same tokens: the first one's counts)
        let own = !ctx.layout.seq_parallel() || ctx.tp.rank() == 0;
        let (tot, expert_counts) = super::metrics::step_sums(terms, &counts, own, &token_group, &host)?;
        // (GLM-4.5's correction biases moved by the step's counts, before the optimizer reads them)
        if let (Some(rate), Some(c)) = (cfg.expert_bias_update, &expert_counts) {
            super::expert_bias::update(&varmap, &mcfg, c, rate)?;
        }
        param_gather.step(&mut opt, &named, lr, factor * inv_accum, mcfg.num_hidden_layers)?;
        tokens_seen += tokens_per_step;
        let dt = t0.elapsed().as_secs_f64();
        // TR-DPO: the reference moved towards the updated policy when due (whole weights: ZeRO's
        // gathers finished first; its time, like the evaluation's, not in the step's tokens/s)
        if let Some(d) = dpo.as_mut().filter(|d| d.cfg.sync_ref_model.is_some_and(|r| (step + 1).is_multiple_of(r.every))) {
            param_gather.finish()?;
            d.sync_reference(step + 1, &varmap, cfg, &ctx, &dev)?;
        }
        // held-out loss after this update (its time not in the step's tokens/s)
        let mut eval_reward = None;
        let (eval_loss, eval_long_range_loss, eval_dpo_accuracy) = match &cfg.eval {
            // (GRPO: the held-out prompts' greedy completions' mean reward)
            Some(e) if e.due(step + 1, cfg.steps) && grpo.is_some() => {
                param_gather.finish()?;
                eval_reward = grpo.as_ref().map(|g| g.evaluate(&model, &ctx)).transpose()?.flatten();
                (None, None, None)
            }
            Some(e) if e.due(step + 1, cfg.steps) && super::classifier::trains_head(cfg) => {
                param_gather.finish()?;
                let t = super::classifier::evaluate(&model, cfg, e, &ctx, &dev)?;
                (t.map(|t| t.0), None, t.map(|t| t.1))
            }
            Some(e) if e.due(step + 1, cfg.steps) => {
                param_gather.finish()?;
                model.set_lora_dropout(None)?;
                super::eval::evaluate_run(&model, cfg, e, dpo.as_ref(), &ctx, &dev)?
            }
            _ => (None, None, None),
        };
        let row = StepMetrics {
            step: step + 1,
            train_loss: objective * inv_accum,
            // (a reward model's or a PRM's: its head's loss; no per-token loss)
            loss: if super::classifier::trains_head(cfg) { objective * inv_accum } else { tot[0] / tot[1].max(1.0) },
            long_range_loss: if tot[3] > 0.0 && !super::classifier::trains_head(cfg) {
                Some(tot[2] / tot[3])
            } else {
                None
            },
            lr,
            grad_norm: norm,
            tokens_per_s: tokens_per_step as f64 / dt.max(1e-9),
            elapsed_s: prev_elapsed + t_start.elapsed().as_secs_f64(),
            peak_rss_mib: peak_rss_bytes().map(|b| b as f64 / (1 << 20) as f64),
            router_aux_loss: aux_sum.map(|a| a * inv_accum),
            expert_load: load_sum.map(|a| a * inv_accum),
            expert_counts,
            eval_loss,
            eval_long_range_loss,
            dpo_accuracy: (dpo.is_some() || super::classifier::trains_head(cfg)).then(|| dpo_sums[0] * inv_accum),
            dpo_margin: (dpo.is_some() || cfg.reward.is_some()).then(|| dpo_sums[1] * inv_accum),
            kto_kl: dpo.as_ref().filter(|d| d.cfg.loss == super::DpoLoss::Kto).map(|_| dpo_sums[2] * inv_accum),
            bco_delta: dpo.as_ref().filter(|d| d.cfg.keeps_running_mean()).map(|d| d.running.mean),
            grpo_reward: grpo.as_ref().map(|_| grpo_sums[0] / grpo_sums[2].max(1.0)),
            completion_length: grpo.as_ref().map(|_| grpo_sums[1] / grpo_sums[2].max(1.0)),
            grpo_kl: grpo.as_ref().filter(|g| g.cfg.beta > 0.0).map(|_| grpo_kl * inv_accum),
            grpo_clip_ratio: grpo_clip.map(|c| c * inv_accum),
            grpo_zero_std: grpo.as_ref().map(|_| grpo_sums[3] / grpo_sums[4].max(1.0)),
            eval_reward,
            eval_dpo_accuracy,
        };
        if let Some(log) = &log {
            log.append(&row)
                .map_err(|e| ioe("writing", log.path(), e))?;
        }
        if is_main {
            on_step(&row);
        }
        out.push(row);
        let done = step + 1;
        if cfg.stop_after == Some(done) {
            param_gather.finish()?;
            return Ok(TrainOutcome {
                metrics: out,
                start_step,
                optimizer_resharded_from: resharded_from,
                config: mcfg,
                n_params,
                trainable_params,
                optimizer_state_bytes: opt.state_bytes(),
                frozen_weight_bytes,
            });
        }
        let last = done == cfg.steps;
        if last || (cfg.save_every > 0 && done % cfg.save_every == 0) {
            param_gather.finish()?;
            saver.save(
                done,
                &opt,
                tokens_seen,
                prev_elapsed + t_start.elapsed().as_secs_f64(),
                (dpo.as_ref().filter(|d| d.cfg.keeps_running_mean()).map(|d| d.running), dpo.as_ref().and_then(|d| d.reference_weights.as_ref()).or(grpo.as_ref().and_then(|g| g.reference.as_ref().and_then(|r| r.0.as_ref()))), grpo.as_ref()),
            )?;
            if let (Some(p), Some(o), true) = (&metrics_path, &cfg.out, is_main) {
                plot_metrics(p, &o.join("loss.png"))?;
            }
        }
    }
    param_gather.finish()?;
    Ok(TrainOutcome {
        metrics: out,
        start_step,
        optimizer_resharded_from: resharded_from,
        config: mcfg,
        n_params,
        trainable_params,
        optimizer_state_bytes: opt.state_bytes(),
        frozen_weight_bytes,
    })
}

#[cfg(test)]
#[path = "trainer_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "trainer_moe_tests.rs"]
mod moe_tests;

#[cfg(test)]
#[path = "trainer_lora_tests.rs"]
mod lora_tests;

#[cfg(test)]
#[path = "trainer_eval_tests.rs"]
mod eval_tests;

#[cfg(test)]
#[path = "trainer_sft_tests.rs"]
mod sft_tests;

#[cfg(test)]
#[path = "trainer_dpo_tests.rs"]
mod dpo_tests;

#[cfg(test)]
#[path = "trainer_kto_tests.rs"]
mod kto_tests;

#[cfg(test)]
#[path = "trainer_bco_tests.rs"]
mod bco_tests;

#[cfg(test)]
#[path = "trainer_reward_tests.rs"]
mod reward_tests;

#[cfg(test)]
#[path = "trainer_prm_tests.rs"]
mod prm_tests;
