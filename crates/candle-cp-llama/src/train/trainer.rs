//! The training loop of one rank: data → shard → loss → backward (with gradient
//! accumulation) → gradient reduction → global-norm clipping → AdamW, plus metrics,
//! loss plot and atomic, resumable checkpoints.
//!
//! Every rank runs [`train_rank`] with the same [`TrainConfig`] (e.g. inside
//! `candle_cp_comm::run_ranks`). Batches are regenerated from (seed, step, micro-batch), so a
//! resumed run sees exactly the batches the uninterrupted run would have seen.

use super::checkpoint::{begin_checkpoint, commit_checkpoint, latest_checkpoint, TrainState};
use super::clip::{clip_factor, global_norm};
use super::data::DataSource;
use super::metrics::{peak_rss_bytes, MetricsLog, StepMetrics};
use super::optim::{AdamW, AdamWConfig};
use super::plot::{write_line_plot, Series};
use super::schedule::WarmupCosine;
use crate::{
    gather_full, init_params, load_hf, named_grads, param_specs, reduce_gradients, save_hf_tensors, shard_batch,
    shard_params, Layout, Llama, LlamaConfig, ParallelCtx, Shard, IGNORE,
};
use candle_core::{bail, DType, Device, Result, Tensor, D};
use candle_cp_comm::Group;
use candle_nn::{VarBuilder, VarMap};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where the initial weights come from.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// Random init of this architecture ([`crate::init_params`] with the run seed).
    Init(LlamaConfig),
    /// A Hugging Face Llama checkpoint directory (`config.json` + safetensors).
    Hf(PathBuf),
}

/// Everything a run needs; identical on every rank.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Parallel layout (world size `dp · cp · tp`).
    pub layout: Layout,
    /// Initial weights.
    pub model: ModelSource,
    /// Training sequences.
    pub data: DataSource,
    /// Global sequence length `T`.
    pub seq_len: usize,
    /// Global rows per micro-batch (split over DP; must be divisible by `layout.dp`).
    pub batch: usize,
    /// Micro-batches per optimizer step (gradients are averaged over them).
    pub grad_accum: usize,
    /// Optimizer steps of the whole run (also the schedule's length).
    pub steps: usize,
    /// Learning-rate schedule.
    pub schedule: WarmupCosine,
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
    /// Clip the global gradient norm to this (≤ 0: no clipping).
    pub clip: f64,
    /// Run seed (weights of a random init, data).
    pub seed: u64,
    /// Output directory (metrics.jsonl, loss.png, checkpoints/); `None`: nothing written.
    pub out: Option<PathBuf>,
    /// Checkpoint every this many steps (0: only at the end of the run).
    pub save_every: usize,
    /// Keep the newest `keep` checkpoints (0: all).
    pub keep: usize,
    /// Continue from the newest checkpoint in `out/checkpoints` if there is one.
    pub resume: bool,
    /// Stop (as if killed) after this step, without the end-of-run checkpoint — for testing
    /// resume. `None`: run to `steps`.
    pub stop_after: Option<usize>,
    /// Weight dtype (F32 for training on CPU).
    pub dtype: DType,
    /// Compute on CUDA device `world rank % gpus` instead of the CPU (needs the `cuda`
    /// feature; data, sharding, optimizer bookkeeping and checkpoints stay on the host).
    pub cuda: bool,
    /// Number of GPUs the ranks are spread over (with `cuda`).
    pub gpus: usize,
    /// Train on the long-range targets only (the other labels are set to [`IGNORE`], like an
    /// answer-only SFT loss). The reported `loss` is still the mean over ALL targets.
    pub long_range_only: bool,
    /// Free-form arguments stored in every checkpoint's `train_state.json`.
    pub args: serde_json::Value,
}

/// What [`train_rank`] returns.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Metrics of the steps run by THIS call (not the ones before a resume).
    pub metrics: Vec<StepMetrics>,
    /// Step the run started from (0, or the resumed checkpoint's step).
    pub start_step: usize,
    /// Model config used.
    pub config: LlamaConfig,
    /// Number of parameters of the full model.
    pub n_params: usize,
}

fn ioe(what: &str, p: &Path, e: std::io::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what} {}: {e}", p.display()))
}

/// `(Σ nll, count)` over this rank's targets (labels ≠ [`IGNORE`]) and over its long-range
/// targets (`mask` = 1): `[all_sum, all_n, lr_sum, lr_n]`. `logits` `[B, Ts, V]`,
/// `labels`, `mask` `[B, Ts]` u32. No graph.
fn nll_terms(logits: &Tensor, labels: &Tensor, mask: &Tensor) -> Result<[f64; 4]> {
    let (b, t, v) = logits.dims3()?;
    let lab: Vec<u32> = labels.flatten_all()?.to_vec1()?;
    let m: Vec<u32> = mask.flatten_all()?.to_vec1()?;
    let (mut idx, mut tgt, mut is_lr) = (vec![], vec![], vec![]);
    for (i, (&l, &mk)) in lab.iter().zip(m.iter()).enumerate() {
        if l != IGNORE {
            idx.push(i as u32);
            tgt.push(l);
            is_lr.push(mk == 1);
        }
    }
    let n = idx.len();
    if n == 0 {
        return Ok([0.0; 4]);
    }
    let dev = logits.device();
    let rows = logits.detach().reshape((b * t, v))?.index_select(&Tensor::new(idx, dev)?, 0)?.to_dtype(DType::F32)?;
    let lsm = candle_nn::ops::log_softmax(&rows, D::Minus1)?;
    let picked: Vec<f32> = lsm.gather(&Tensor::new(tgt, dev)?.reshape((n, 1))?, 1)?.flatten_all()?.to_vec1()?;
    let mut out = [0.0; 4];
    for (p, lr) in picked.iter().zip(is_lr.iter()) {
        out[0] -= *p as f64;
        out[1] += 1.0;
        if *lr {
            out[2] -= *p as f64;
            out[3] += 1.0;
        }
    }
    Ok(out)
}

/// Global batch `[B, T]` of token ids and of long-range flags for one micro-batch.
fn global_batch(cfg: &TrainConfig, step: usize, micro: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let rows = cfg.data.rows(cfg.seed, step, micro * cfg.batch, cfg.batch, cfg.seq_len)?;
    let ids: Vec<u32> = rows.iter().flat_map(|s| s.tokens.iter().copied()).collect();
    let mask: Vec<u32> = rows.iter().flat_map(|s| s.long_range.iter().map(|&b| b as u32)).collect();
    let shape = (cfg.batch, cfg.seq_len);
    Ok((Tensor::from_vec(ids, shape, dev)?, Tensor::from_vec(mask, shape, dev)?))
}

fn local_tensors(varmap: &VarMap) -> Result<HashMap<String, Tensor>> {
    let data = varmap.data().lock().map_err(|_| candle_core::Error::Msg("varmap lock poisoned".into()))?;
    Ok(data.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect())
}

/// Write `loss.png` (training loss, all-target loss if different, long-range loss per step)
/// from the metrics file.
pub fn plot_metrics(metrics_path: &Path, png_path: &Path) -> Result<()> {
    let rows = MetricsLog::read(metrics_path).map_err(|e| ioe("reading", metrics_path, e))?;
    let train: Vec<(f64, f64)> = rows.iter().map(|r| (r.step as f64, r.train_loss)).collect();
    let all: Vec<(f64, f64)> = rows.iter().map(|r| (r.step as f64, r.loss)).collect();
    let lr: Vec<(f64, f64)> = rows.iter().map(|r| (r.step as f64, r.long_range_loss.unwrap_or(f64::NAN))).collect();
    let same = rows.iter().all(|r| (r.train_loss - r.loss).abs() < 1e-6);
    let lr_only = rows.iter().all(|r| r.long_range_loss.is_some_and(|x| (x - r.train_loss).abs() < 1e-4));
    let mut series = vec![];
    if !lr_only {
        series.push(Series { label: "train loss", color: [31, 119, 180], points: &train });
    }
    if !same {
        series.push(Series { label: "all-target loss", color: [150, 150, 150], points: &all });
    }
    if lr.iter().any(|p| p.1.is_finite()) {
        let label = if lr_only { "long-range loss (trained)" } else { "long-range loss" };
        series.push(Series { label, color: [214, 39, 40], points: &lr });
    }
    write_line_plot(png_path, 800, 480, &series).map_err(|e| ioe("writing", png_path, e))
}

/// Run (or resume) training on this rank. Collective over `world`; every rank gets the same
/// metrics. `on_step` is called on world rank 0 after every optimizer step.
pub fn train_rank(world: Group, cfg: &TrainConfig, on_step: &(dyn Fn(&StepMetrics) + Sync)) -> Result<TrainOutcome> {
    let rank = world.rank();
    let dev = if cfg.cuda { Device::new_cuda(rank % cfg.gpus.max(1))? } else { Device::Cpu };
    let host = Device::Cpu;
    if cfg.grad_accum == 0 || cfg.batch == 0 || cfg.steps == 0 {
        bail!("train: grad_accum ({}), batch ({}) and steps ({}) must be > 0", cfg.grad_accum, cfg.batch, cfg.steps)
    }
    if !cfg.batch.is_multiple_of(cfg.layout.dp) {
        bail!("train: batch {} must be divisible by dp = {}", cfg.batch, cfg.layout.dp)
    }
    let ctx = ParallelCtx::new(world.clone(), cfg.layout)?;
    let ckpt_root = cfg.out.as_ref().map(|o| o.join("checkpoints"));

    // Initial state: a checkpoint to resume, a HF checkpoint, or a random init.
    let resume_from = match (&ckpt_root, cfg.resume) {
        (Some(root), true) => latest_checkpoint(root).map_err(|e| ioe("reading", root, e))?,
        _ => None,
    };
    let (full, mcfg, state) = match (&resume_from, &cfg.model) {
        (Some(dir), _) => {
            let st = TrainState::load(dir.join("train_state.json")).map_err(|e| ioe("reading", dir, e))?;
            if st.world_size != world.size() || st.layout != cfg.layout.to_string() {
                bail!(
                    "resume: checkpoint {} was written by layout '{}' on {} ranks, this run is '{}' on {}",
                    dir.display(),
                    st.layout,
                    st.world_size,
                    cfg.layout,
                    world.size()
                )
            }
            let (vm, c) = load_hf(dir, &dev, cfg.dtype)?;
            (vm, c, Some(st))
        }
        (None, ModelSource::Hf(dir)) => {
            let (vm, c) = load_hf(dir, &dev, cfg.dtype)?;
            (vm, c, None)
        }
        (None, ModelSource::Init(c)) => (init_params(c, cfg.seed, cfg.dtype, &dev)?, c.clone(), None),
    };
    cfg.layout.validate(mcfg.num_attention_heads, mcfg.num_key_value_heads)?;
    if cfg.data.vocab_needed() > mcfg.vocab_size {
        bail!("train: data uses {} token ids, model vocabulary is {}", cfg.data.vocab_needed(), mcfg.vocab_size)
    }
    let n_params: usize = param_specs(&mcfg).iter().map(|s| s.shape.iter().product::<usize>()).sum();
    let varmap = shard_params(&full, &mcfg, &ctx)?;
    drop(full);
    let model = Llama::new(VarBuilder::from_varmap(&varmap, cfg.dtype, &dev), &mcfg, &ctx)?;
    let named_vars: Vec<(String, candle_core::Var)> = {
        let data = varmap.data().lock().map_err(|_| candle_core::Error::Msg("varmap lock poisoned".into()))?;
        data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    let sharded: HashMap<String, bool> =
        param_specs(&mcfg).into_iter().map(|s| (s.name, !matches!(s.shard, Shard::Replicated))).collect();
    let mut opt = AdamW::new(named_vars, cfg.adamw)?;
    // DP and CP replicas hold identical optimizer states (same reduced gradients, same
    // updates): one file per TP rank, written by the replica with dp = cp = 0.
    let (dp_i, cp_i, tp_i) = ctx.coords;
    let opt_writer = dp_i == 0 && cp_i == 0;
    let opt_file = |dir: &Path| dir.join(format!("optimizer-tp{tp_i}.safetensors"));
    let (start_step, mut tokens_seen, prev_elapsed) = match (&resume_from, &state) {
        (Some(dir), Some(st)) => {
            opt.load(opt_file(dir))?;
            if opt.step != st.step {
                bail!("resume: optimizer state at step {} but train_state at step {}", opt.step, st.step)
            }
            (st.step, st.tokens_seen, st.elapsed_s)
        }
        _ => (0, 0, 0.0),
    };

    let is_main = rank == 0;
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

    let save = |step: usize, opt: &AdamW, tokens_seen: u64, elapsed: f64| -> Result<()> {
        let Some(root) = &ckpt_root else { return Ok(()) };
        if is_main {
            begin_checkpoint(root, step).map_err(|e| ioe("creating checkpoint in", root, e))?;
        }
        world.barrier()?;
        let tmp = root.join(format!(".tmp-{}", super::checkpoint::checkpoint_name(step)));
        let full = gather_full(&local_tensors(&varmap)?, &mcfg, &ctx)?;
        if is_main {
            save_hf_tensors(&tmp, &full, &mcfg)?;
        }
        if opt_writer {
            opt.save(opt_file(&tmp))?;
        }
        world.barrier()?;
        if is_main {
            let st = TrainState {
                step,
                seed: cfg.seed,
                micro_batches_done: step * cfg.grad_accum,
                tokens_seen,
                elapsed_s: elapsed,
                world_size: world.size(),
                layout: cfg.layout.to_string(),
                args: cfg.args.clone(),
            };
            st.save(tmp.join("train_state.json")).map_err(|e| ioe("writing", &tmp, e))?;
            commit_checkpoint(root, step, cfg.keep).map_err(|e| ioe("publishing checkpoint in", root, e))?;
        }
        world.barrier()
    };

    let t_start = Instant::now();
    let mut out = Vec::new();
    let tokens_per_step = (cfg.batch * cfg.seq_len * cfg.grad_accum) as u64;
    let token_group = ctx.token_group().clone();
    for step in start_step..cfg.steps {
        let t0 = Instant::now();
        let lr = cfg.schedule.lr(step);
        let mut acc: Option<candle_core::backprop::GradStore> = None;
        let mut terms = [0f64; 4];
        let mut objective = 0f64;
        for micro in 0..cfg.grad_accum {
            let (ids, mask) = global_batch(cfg, step, micro, &host)?;
            let sb = shard_batch(&ids, &ctx)?;
            let mb = shard_batch(&mask, &ctx)?;
            let train_labels = if cfg.long_range_only {
                let ignore = Tensor::full(IGNORE, sb.labels.shape(), &host)?;
                mb.labels.eq(1u32)?.where_cond(&sb.labels, &ignore)?
            } else {
                sb.labels.clone()
            };
            let (loss, logits) = model.loss(
                &sb.input_ids.to_device(&dev)?,
                &train_labels.to_device(&dev)?,
                &sb.positions.to_device(&dev)?,
            )?;
            objective += loss.to_scalar::<f32>()? as f64;
            for (acc, x) in terms.iter_mut().zip(nll_terms(&logits, &sb.labels, &mb.labels)?) {
                *acc += x;
            }
            let g = loss.backward()?;
            acc = Some(match acc {
                None => g,
                Some(mut a) => {
                    for (_, var) in opt.params() {
                        if let Some(gi) = g.get(var.as_tensor()) {
                            let sum = match a.get(var.as_tensor()) {
                                Some(ai) => (ai + gi)?,
                                None => gi.clone(),
                            };
                            a.insert(var.as_tensor(), sum);
                        }
                    }
                    a
                }
            });
        }
        let Some(mut grads) = acc else { bail!("train: no micro-batch ran") };
        reduce_gradients(&mut grads, &varmap, &mcfg, &ctx)?;
        let named = named_grads(&grads, &varmap)?;
        let mut items: Vec<(Tensor, bool)> = Vec::with_capacity(named.len());
        let mut names: Vec<&String> = named.keys().collect();
        names.sort();
        for n in names {
            items.push((named[n].clone(), sharded.get(n).copied().unwrap_or(false)));
        }
        let inv_accum = 1.0 / cfg.grad_accum as f64;
        let norm = global_norm(&items, Some(&ctx.tp))? * inv_accum;
        let factor = clip_factor(norm, cfg.clip);
        opt.step(&named, lr, factor * inv_accum)?;
        // Losses over all ranks holding distinct tokens (f64 sums gathered, added in rank order).
        let row_t = Tensor::new(&[terms.map(|x| x as f32)], &host)?;
        let rows = if token_group.size() > 1 { token_group.all_gather(&row_t, 0)? } else { row_t };
        let mut tot = [0f64; 4];
        for r in rows.to_vec2::<f32>()? {
            for (a, x) in tot.iter_mut().zip(r) {
                *a += x as f64;
            }
        }
        tokens_seen += tokens_per_step;
        let dt = t0.elapsed().as_secs_f64();
        let row = StepMetrics {
            step: step + 1,
            train_loss: objective * inv_accum,
            loss: tot[0] / tot[1].max(1.0),
            long_range_loss: if tot[3] > 0.0 { Some(tot[2] / tot[3]) } else { None },
            lr,
            grad_norm: norm,
            tokens_per_s: tokens_per_step as f64 / dt.max(1e-9),
            elapsed_s: prev_elapsed + t_start.elapsed().as_secs_f64(),
            peak_rss_mib: peak_rss_bytes().map(|b| b as f64 / (1 << 20) as f64),
        };
        if let Some(log) = &log {
            log.append(&row).map_err(|e| ioe("writing", log.path(), e))?;
        }
        if is_main {
            on_step(&row);
        }
        out.push(row);
        let done = step + 1;
        if cfg.stop_after == Some(done) {
            return Ok(TrainOutcome { metrics: out, start_step, config: mcfg, n_params });
        }
        let last = done == cfg.steps;
        if last || (cfg.save_every > 0 && done % cfg.save_every == 0) {
            save(done, &opt, tokens_seen, prev_elapsed + t_start.elapsed().as_secs_f64())?;
            if let (Some(p), Some(o), true) = (&metrics_path, &cfg.out, is_main) {
                plot_metrics(p, &o.join("loss.png"))?;
            }
        }
    }
    Ok(TrainOutcome { metrics: out, start_step, config: mcfg, n_params })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::data::KvRecall;
    use crate::CpKind;
    use candle_cp_comm::run_ranks;

    fn tiny_cfg(out: Option<PathBuf>, layout: Layout, batch: usize, grad_accum: usize) -> TrainConfig {
        let mut task = KvRecall::new(64).unwrap();
        task.n_keys = 8;
        task.n_values = 8;
        task.n_queries = 8;
        task.fused = true;
        let vocab = task.vocab_needed();
        TrainConfig {
            layout,
            model: ModelSource::Init(LlamaConfig::tiny(vocab, 32, 1, 2, 1)),
            data: DataSource::Recall(task),
            seq_len: 64,
            batch,
            grad_accum,
            steps: 6,
            schedule: WarmupCosine { peak: 1e-2, warmup: 2, total: 6, min_ratio: 0.1 },
            adamw: AdamWConfig { weight_decay: 0.01, ..AdamWConfig::default() },
            clip: 0.5,
            seed: 3,
            out,
            save_every: 3,
            keep: 0,
            resume: false,
            stop_after: None,
            dtype: DType::F32,
            cuda: false,
            gpus: 1,
            long_range_only: false,
            args: serde_json::Value::Null,
        }
    }

    fn run(cfg: &TrainConfig) -> Result<Vec<TrainOutcome>> {
        run_ranks(cfg.layout.world_size(), |g| train_rank(g, cfg, &|_| {})).into_iter().collect()
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cp-train-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// 6 steps straight vs 4 steps (checkpoint at 3, "killed" after 4) + resume: the same
    /// loss curve bit for bit, the same final weights, and a metrics file without the lost
    /// step 4 duplicated.
    #[test]
    fn resume_reproduces_the_uninterrupted_run() -> Result<()> {
        let layout = Layout::cp(CpKind::Zigzag, 2);
        let (da, db) = (tmpdir("a"), tmpdir("b"));
        let a = run(&tiny_cfg(Some(da.clone()), layout, 1, 2))?;
        let mut cb = tiny_cfg(Some(db.clone()), layout, 1, 2);
        cb.stop_after = Some(4);
        let b1 = run(&cb)?;
        assert_eq!(b1[0].metrics.len(), 4);
        cb.stop_after = None;
        cb.resume = true;
        let b2 = run(&cb)?;
        assert_eq!(b2[0].start_step, 3);
        let la: Vec<(usize, f64, f64)> = a[0].metrics.iter().map(|m| (m.step, m.loss, m.grad_norm)).collect();
        let lb: Vec<(usize, f64, f64)> = b1[0].metrics[..3]
            .iter()
            .chain(b2[0].metrics.iter())
            .map(|m| (m.step, m.loss, m.grad_norm))
            .collect();
        assert_eq!(la, lb);
        // The lost step 4 of the killed run was recomputed identically.
        assert_eq!(b1[0].metrics[3].loss, b2[0].metrics[0].loss);
        // Both ranks report the same numbers.
        assert_eq!(a[0].metrics.iter().map(|m| m.loss).collect::<Vec<_>>(), a[1].metrics.iter().map(|m| m.loss).collect::<Vec<_>>());
        // Metrics file of the resumed run: steps 1..=6 once each, equal to the straight run's.
        let ma = MetricsLog::read(da.join("metrics.jsonl")).unwrap();
        let mb = MetricsLog::read(db.join("metrics.jsonl")).unwrap();
        assert_eq!(mb.iter().map(|r| r.step).collect::<Vec<_>>(), (1..=6).collect::<Vec<_>>());
        assert_eq!(ma.iter().map(|r| r.loss).collect::<Vec<_>>(), mb.iter().map(|r| r.loss).collect::<Vec<_>>());
        // Byte-identical apart from the timing columns.
        let strip = |p: PathBuf| -> Vec<(usize, u64, u64, u64, u64)> {
            MetricsLog::read(p)
                .unwrap()
                .iter()
                .map(|r| (r.step, r.train_loss.to_bits(), r.loss.to_bits(), r.grad_norm.to_bits(), r.lr.to_bits()))
                .collect()
        };
        assert_eq!(strip(da.join("metrics.jsonl")), strip(db.join("metrics.jsonl")));
        // Final checkpoints hold identical weights.
        let wa = std::fs::read(da.join("checkpoints/step-000006/model.safetensors")).unwrap();
        let wb = std::fs::read(db.join("checkpoints/step-000006/model.safetensors")).unwrap();
        assert!(wa == wb, "final weights differ");
        assert!(da.join("loss.png").exists());
        // The final checkpoint loads back as a HF model.
        let (_, c) = load_hf(da.join("checkpoints/step-000006"), &Device::Cpu, DType::F32)?;
        assert_eq!(c.vocab_size, a[0].config.vocab_size);
        // Resuming under another layout is refused.
        let mut cc = tiny_cfg(Some(da.clone()), Layout::single(), 1, 2);
        cc.resume = true;
        assert!(run(&cc).is_err());
        std::fs::remove_dir_all(&da).ok();
        std::fs::remove_dir_all(&db).ok();
        Ok(())
    }

    /// Long-range-only objective under zigzag CP = 2 with T = 64: every long-range target
    /// lies in the last chunk (rank 0), rank 1 has none — training must neither hang nor
    /// produce a non-finite loss, and must match the single-device run.
    #[test]
    fn long_range_objective_with_a_rank_without_targets() -> Result<()> {
        let mut c2 = tiny_cfg(None, Layout::cp(CpKind::Zigzag, 2), 1, 1);
        c2.long_range_only = true;
        c2.steps = 3;
        let mut c1 = c2.clone();
        c1.layout = Layout::single();
        let two = run(&c2)?;
        let one = run(&c1)?;
        for (x, y) in one[0].metrics.iter().zip(two[0].metrics.iter()) {
            assert!(x.train_loss.is_finite() && x.long_range_loss.is_some());
            assert!((x.train_loss - x.long_range_loss.unwrap_or(f64::NAN)).abs() < 1e-4);
            assert!((x.train_loss - y.train_loss).abs() < 1e-5, "step {}: {} vs {}", x.step, x.train_loss, y.train_loss);
        }
        assert_eq!(two[0].metrics.len(), 3);
        assert_eq!(two[1].metrics.iter().map(|m| m.train_loss).collect::<Vec<_>>(), two[0].metrics.iter().map(|m| m.train_loss).collect::<Vec<_>>());
        Ok(())
    }

    /// The same rows trained as (dp 1, one 2-row batch), (dp 2, one 2-row batch split over
    /// DP) and (dp 1, two 1-row micro-batches): the same losses and gradient norms to f32
    /// rounding — DP all-reduce and gradient accumulation average exactly like one batch.
    #[test]
    fn data_parallel_and_accumulation_match_one_batch() -> Result<()> {
        let zz = Layout::cp(CpKind::Zigzag, 2);
        let one = run(&tiny_cfg(None, zz, 2, 1))?;
        let dp2 = run(&tiny_cfg(None, zz.with_dp(2), 2, 1))?;
        let acc = run(&tiny_cfg(None, zz, 1, 2))?;
        for other in [&dp2, &acc] {
            for (x, y) in one[0].metrics.iter().zip(other[0].metrics.iter()) {
                assert!((x.loss - y.loss).abs() < 1e-5, "step {}: loss {} vs {}", x.step, x.loss, y.loss);
                assert!((x.grad_norm - y.grad_norm).abs() < 1e-4 * x.grad_norm.max(1.0), "step {}", x.step);
            }
        }
        Ok(())
    }
}
