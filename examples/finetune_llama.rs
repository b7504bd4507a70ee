//! Fine-tune (or train from scratch) a Llama-style model with context parallelism.
//!
//! ```text
//! cargo run --release --example finetune_llama                     # CPU, 4 thread ranks, zigzag CP
//! cargo run --release --example finetune_llama -- --data book.txt --seq-len 1024
//! cargo run --release --example finetune_llama -- --model tests/data/oracle/tiny-llama --data notes.txt
//! # documents (separated by blank lines) packed into each sequence, masked from each other:
//! cargo run --release --example finetune_llama -- --data notes.txt --pack-docs --seq-len 1024
//! cargo run --release --example finetune_llama -- --data sft.jsonl --sft --tokenizer tok.json --model DIR  # prompt / completion
//! cargo run --release --example finetune_llama -- --data pairs.jsonl --dpo --beta 0.1 --model DIR --lora 16,32  # preference pairs
//! cargo run --release --example finetune_llama -- --data pairs.jsonl --reward-model --model DIR --cp 2  # a reward model on the same pairs
//! cargo run --release --example finetune_llama -- --data examples.jsonl --kto --beta 0.1 --model DIR  # unpaired examples, labelled
//! cargo run --release --example finetune_llama -- --data examples.jsonl --bco --model DIR     # the same by BCO
//! cargo run --release --example finetune_llama -- --sliding-window 128   # Mistral-style window
//! cargo run --release --example finetune_llama -- --qkv-bias    # Qwen2-style q, k, v biases
//! cargo run --release --example finetune_llama -- --qk-norm     # Qwen3-style q / k head norms
//! cargo run --release --example finetune_llama -- --moe 8,2      # Qwen3-MoE: 8 experts, 2 per token
//! cargo run --release --example finetune_llama -- --gpt-oss 8,2  # gpt-oss: sinks, biases, 8 experts
//! cargo run --release --example finetune_llama -- --resume         # continue runs/finetune
//! # 4 GPUs, NCCL, one process (a thread per GPU):
//! cargo run --release --features nccl --example finetune_llama -- --device cuda --comm nccl --gpus 4
//! # 4 GPUs, NCCL, one process per GPU (any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK,
//! # MASTER_ADDR, MASTER_PORT; every process gets the same flags):
//! RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//!   target/release/examples/finetune_llama --device cuda --comm nccl
//! ```
//!
//! Default data: a synthetic key→value recall task whose targets can only be predicted by
//! attending to tokens held by other CP ranks (see `candle_cp_llama::train::data::KvRecall`);
//! the loss on those targets is reported separately (`lr-loss`). See examples/README.md.

#[path = "finetune_args.rs"]
mod args;
#[path = "finetune_grpo.rs"]
mod grpo_args;
#[path = "finetune_launch.rs"]
mod launch;
#[path = "finetune_prm.rs"]
mod prm_args;

use anyhow::{bail, Result};
use candle_core::DType;
use candle_cp_comm::Group;
use candle_cp_llama::train::{
    AdamWConfig, DataSource, ModelSource, StepMetrics, TrainConfig, WarmupCosine,
};
use candle_cp_llama::{CpKind, LlamaConfig, RowSums};
use clap::Parser;
use args::{corpus_source, data_source, dpo_mix, layout, Args};
use launch::Launch;
use std::time::{Duration, Instant};

fn main() -> Result<()> {
    let a = Args::parse();
    let layout = layout(&a)?;
    let (data, data_desc) = data_source(&a)?;
    // held-out evaluation: a file of its own (--eval-data), or the end of a corpus kept out of
    // training (the synthetic task draws fresh samples)
    let (data, eval) = match (a.eval_every, &a.eval_data) {
        (0, Some(_)) => bail!("--eval-data is read by the held-out evaluation: give --eval-every N too"),
        (_, Some(_)) if a.data.is_none() => bail!("--eval-data holds out text: give the training corpus as --data (the synthetic task draws its own held-out samples)"),
        (0, None) => (data, None),
        (every, Some(path)) => {
            let (held, _) = corpus_source(&a, path, "--eval-data")?;
            (data, Some(candle_cp_llama::train::EvalConfig { data: held, every, batches: a.eval_batches }))
        }
        (every, None) => {
            let (train, held) = data.split_held_out(a.eval_fraction, a.seq_len)?;
            (train, Some(candle_cp_llama::train::EvalConfig { data: held, every, batches: a.eval_batches }))
        }
    };
    // (--train-on-last-step-only: the training examples' last steps; the held-out ones whole)
    let data = a.prm.training_data(data);
    let model = match &a.model {
        Some(_) if a.vocab.is_some() => bail!("--vocab sizes a random-init model; a --model checkpoint has its own"),
        Some(_) if a.qkv_bias || a.qk_norm || a.gemma3 || a.gemma2 || a.phi3 || a.smollm3 || a.granite || a.olmo3 || a.olmoe || a.exaone4 || a.glm4 || a.glm || a.glm4_moe || a.deepseek || a.partial_rotary != 1.0 || a.moe.is_some() || a.gpt_oss.is_some() => bail!("--qkv-bias, --qk-norm, --gemma3, --gemma2, --phi3, --smollm3, --granite, --olmo3, --olmoe, --exaone4, --glm4, --glm, --glm4-moe, --deepseek, --partial-rotary, --moe and --gpt-oss shape a random-init model; a --model checkpoint's config.json says what it has"),
        Some(dir) => ModelSource::Hf(dir.clone()),
        None => {
            let needed = data
                .vocab_needed()
                .max(eval.as_ref().map_or(0, |e| e.data.vocab_needed()))
                .max(if a.data.is_some() { 256 } else { 0 });
            let vocab = match a.vocab {
                Some(v) if v < needed => bail!("--vocab {v}: the data needs {needed} tokens"),
                Some(v) => v,
                None => needed,
            };
            let mut cfg = LlamaConfig::tiny(vocab, a.hidden, a.layers, a.heads, a.kv_heads).with_qkv_bias(a.qkv_bias).with_qk_norm(a.qk_norm);
            // (--granite with --moe: a GraniteMoE)
            if [a.qkv_bias, a.qk_norm, a.gemma3, a.gemma2, a.phi3, a.smollm3, a.granite && a.moe.is_none(), a.olmo3, a.exaone4, a.glm4, a.glm, a.moe.is_some(), a.gpt_oss.is_some()].iter().filter(|&&x| x).count() > 1 {
                bail!("--qkv-bias (Qwen2), --qk-norm (Qwen3), --gemma3, --gemma2, --phi3, --smollm3, --granite, --olmo3, --exaone4, --glm4, --glm, --moe (Qwen3-MoE; with --granite GraniteMoE) and --gpt-oss: pick one")
            }
            if a.granite && a.olmoe {
                bail!("--granite with --moe is a GraniteMoE, --olmoe an OLMoE: pick one")
            }
            if a.glm4 || a.glm {
                cfg = cfg.with_glm(Some(if a.glm4 { candle_cp_llama::Glm::Glm4 } else { candle_cp_llama::Glm::Glm }));
                cfg.validate()?;
            }
            if a.exaone4 {
                // EXAONE 4's window on all but every fourth layer and the last
                let sliding: Vec<bool> = (0..a.layers).map(|i| (i + 1) % 4 != 0 && i + 1 != a.layers).collect();
                cfg = cfg.with_sliding_window(a.sliding_window).with_sliding_layers(a.sliding_window.map(|_| sliding)).with_exaone4(true);
                cfg.validate()?;
            }
            if a.olmo3 {
                // OLMo 3's window on all but every fourth layer
                let sliding: Vec<bool> = (0..a.layers).map(|i| (i + 1) % 4 != 0).collect();
                cfg = cfg.with_olmo(Some(candle_cp_llama::Olmo::Olmo3)).with_sliding_window(a.sliding_window).with_sliding_layers(a.sliding_window.map(|_| sliding));
                cfg.validate()?;
            }
            if a.granite {
                // granite-3.x's multipliers (its attention_multiplier 1/128 is 1/head_dim)
                let g = candle_cp_llama::Granite { embedding_multiplier: 12.0, attention_multiplier: 1.0 / cfg.head_dim as f64, residual_multiplier: 0.22, logits_scaling: 16.0 };
                cfg = cfg.with_granite(Some(g));
                cfg.validate()?;
            }
            if a.smollm3 {
                // SmolLM3's NoPE layers: every fourth (the last one of a shallower model)
                let nope: Vec<bool> = (0..a.layers).map(|i| (i + 1) % 4 == 0 || (a.layers < 4 && i + 1 == a.layers)).collect();
                cfg = cfg.with_nope_layers(Some(nope.clone())).with_sliding_window(a.sliding_window).with_sliding_layers(a.sliding_window.map(|_| nope));
                cfg.tie_word_embeddings = true;
                cfg.validate()?;
            }
            if (a.olmoe || a.glm4_moe || a.deepseek) && a.moe.is_none() {
                bail!("--olmoe, --glm4-moe and --deepseek shape the experts of --moe E,K: add --moe")
            }
            if [a.granite, a.olmoe, a.glm4_moe, a.deepseek].iter().filter(|&&x| x).count() > 1 && a.moe.is_some() {
                bail!("--granite, --olmoe, --glm4-moe and --deepseek with --moe are four models: pick one")
            }
            if a.partial_rotary != 1.0 && !a.phi3 {
                bail!("--partial-rotary {} needs --phi3 (only a Phi-3's RoPE is partial here)", a.partial_rotary)
            }
            if a.phi3 {
                // short factors near 1, long ones growing with the wavelength, as Phi-3's
                cfg = cfg.with_phi3(true).with_sliding_window(a.sliding_window).with_partial_rotary_factor(a.partial_rotary);
                let (n, original) = (cfg.rope_dim() / 2, (a.seq_len / 2).max(1));
                cfg.max_position_embeddings = 16 * original;
                cfg.rope_scaling = candle_cp_llama::RopeScaling::LongRope {
                    short_factor: (0..n).map(|i| 1.0 + 0.5 * i as f64 / n as f64).collect(),
                    long_factor: (0..n).map(|i| (1.0 + 4.0 * i as f64 / n as f64).powi(2)).collect(),
                    original_max_position_embeddings: original,
                    factor: 16.0,
                    attention_factor: None,
                };
                cfg.validate()?;
            }
            if let Some(spec) = &a.moe {
                let parts: Vec<usize> = spec.split(',').map(|x| x.trim().parse::<usize>()).collect::<std::result::Result<_, _>>().map_err(|e| anyhow::anyhow!("--moe {spec}: expected E,K ({e})"))?;
                let [e, k] = parts.as_slice() else { bail!("--moe {spec}: expected E,K (experts, experts per token)") };
                let mut moe = match a.granite {
                    true => candle_cp_llama::MoeConfig::granite_moe(*e, *k, a.hidden),
                    false => candle_cp_llama::MoeConfig::new(*e, *k, a.hidden),
                };
                moe.norm_topk_prob = !a.olmoe;
                moe.output_router_logits = true;
                moe.router_aux_loss_coef = 0.01;
                if a.glm4_moe || a.deepseek {
                    // (GLM-4.5, DeepSeek-V3: layer 0 dense; the router has no load-balancing loss)
                    moe = candle_cp_llama::MoeConfig { mlp_only_layers: vec![0], ..candle_cp_llama::MoeConfig::glm4_moe(*e, *k, a.hidden, 1, 2.5) };
                }
                cfg = cfg.with_moe(Some(moe));
                if a.glm4_moe {
                    cfg = cfg.with_qkv_bias(true).with_qk_norm(true);
                }
                if a.olmoe {
                    cfg = cfg.with_olmo(Some(candle_cp_llama::Olmo::Olmoe));
                }
                if a.deepseek {
                    let mla = candle_cp_llama::config::deepseek::Mla { q_lora_rank: Some(a.hidden / 2), kv_lora_rank: a.hidden / 4, qk_nope_head_dim: 64, qk_rope_head_dim: 32, v_head_dim: 64, rope_interleave: true };
                    cfg = cfg.with_mla(Some(mla));
                    if a.deepseek_v2 {
                        // (DeepSeek-V2's router over the same experts: softmax, scaled, layer 0 dense)
                        let m = candle_cp_llama::MoeConfig { mlp_only_layers: vec![0], ..candle_cp_llama::MoeConfig::deepseek_v2(*e, *k, a.hidden, 1, 2.5) };
                        cfg = cfg.with_moe(Some(m));
                    }
                }
                if a.deepseek_v2 && !a.deepseek {
                    bail!("--deepseek-v2 goes with --deepseek (DeepSeek-V2's router under the latent attention)")
                }
                cfg.validate()?;
            }
            if let Some(spec) = &a.gpt_oss {
                let parts: Vec<usize> = spec.split(',').map(|x| x.trim().parse::<usize>()).collect::<std::result::Result<_, _>>().map_err(|e| anyhow::anyhow!("--gpt-oss {spec}: expected E,K ({e})"))?;
                let [e, k] = parts.as_slice() else { bail!("--gpt-oss {spec}: expected E,K (experts, experts per token)") };
                let every_other = (0..a.layers).map(|i| i % 2 == 0).collect();
                cfg = cfg.with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(*e, *k, a.hidden))).with_sliding_window(a.sliding_window).with_sliding_layers(a.sliding_window.map(|_| every_other));
                cfg.validate()?;
            }
            if a.gemma2 {
                let every_other = (0..a.layers).map(|i| i % 2 == 0).collect();
                cfg = cfg.with_gemma2(true).with_sliding_window(a.sliding_window).with_sliding_layers(a.sliding_window.map(|_| every_other));
            }
            if a.gemma3 {
                let every_sixth_full = (0..a.layers).map(|i| (i + 1) % 6 != 0).collect();
                cfg = cfg.with_gemma3(true).with_sliding_window(a.sliding_window).with_sliding_layers(a.sliding_window.map(|_| every_sixth_full));
            }
            ModelSource::Init(cfg)
        }
    };
    let cuda = match a.device.as_str() {
        "cpu" => false,
        "cuda" => true,
        d => bail!("--device {d}: expected cpu or cuda"),
    };
    let dtype = match a.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        d => bail!("--dtype {d}: expected f32, bf16 or f16"),
    };
    let batch = a
        .batch
        .unwrap_or(if a.data.is_none() { 4 * a.dp } else { a.dp });
    let long_range_only = match a.loss_on.as_deref() {
        None => a.data.is_none() || a.sft || a.preference(),
        Some("all") => false,
        Some("long-range" | "completion") => true,
        Some(o) => bail!("--loss-on {o}: expected all, long-range or completion"),
    };
    if a.sliding_window == Some(0) {
        bail!("--sliding-window 0: a window holds at least 1 token (the query itself)")
    }
    if a.lora_dropout.is_some() && a.lora.is_none() && a.lora_from.is_none() {
        bail!("--lora-dropout drops the LoRA adapters' inputs: add --lora R,ALPHA or --lora-from DIR")
    }
    if a.quantize_base.is_some() && a.lora.is_none() && a.lora_from.is_none() {
        bail!("--quantize-base quantizes a LoRA run's frozen base: add --lora R,ALPHA or --lora-from DIR")
    }
    if a.overlap_param_gather && !(a.zero1 || a.zero2) {
        bail!("--overlap-param-gather overlaps ZeRO's all-gather of the updated parameters: add --zero1 or --zero2")
    }
    let mix = dpo_mix(&a)?;
    let cfg = TrainConfig {
        layout,
        model,
        data,
        seq_len: a.seq_len,
        batch,
        grad_accum: a.grad_accum,
        steps: a.steps,
        schedule: WarmupCosine {
            peak: a.lr,
            warmup: a.warmup,
            total: a.steps,
            min_ratio: a.min_lr_ratio,
        },
        adamw: AdamWConfig {
            weight_decay: a.weight_decay,
            ..AdamWConfig::default()
        },
        clip: a.clip,
        seed: a.seed,
        out: Some(a.out.clone()),
        save_every: a.save_every,
        keep: a.keep,
        resume: a.resume,
        stop_after: a.stop_after,
        dtype,
        cuda,
        gpus: a.gpus,
        recompute: a.recompute,
        overlap_grad_sync: a.overlap_grad_sync,
        overlap_param_gather: a.overlap_param_gather,
        zero1: a.zero1,
        zero2: a.zero2,
        long_range_only,
        prm: a.prm.config()?,
        reward: a.reward_model.then_some(candle_cp_llama::train::RewardConfig { center_rewards_coefficient: a.center_rewards_coefficient }),
        dpo: match a.preference() && !a.reward_model {
            true => Some(candle_cp_llama::train::DpoConfig {
                beta: a.beta,
                label_smoothing: a.dpo_label_smoothing,
                loss: match mix.first() {
                    Some(&(l, _)) => l,
                    None => match (a.unpaired(), a.dpo_loss.as_str()) {
                        (true, "sigmoid") if a.bco => candle_cp_llama::train::DpoLoss::Bco,
                        (true, "sigmoid") => candle_cp_llama::train::DpoLoss::Kto,
                        (true, "apo_zero_unpaired") if a.kto => candle_cp_llama::train::DpoLoss::ApoZeroUnpaired,
                        (true, l) => bail!("{} takes no --dpo-loss ({l})", a.objective_flag()),
                        (false, l @ ("kto" | "bco")) => bail!("--dpo-loss {l}: train by --{l} (unpaired examples)"),
                        (false, "apo_zero_unpaired") => bail!("--dpo-loss apo_zero_unpaired: train by --kto --dpo-loss apo_zero_unpaired (unpaired examples)"),
                        (false, l) => l.parse()?,
                    },
                },
                mix: mix.clone(),
                f_divergence: candle_cp_llama::train::dpo_loss::FDivergence::parse(&a.f_divergence, a.f_alpha_divergence_coef)?,
                simpo_gamma: a.simpo_gamma,
                rpo_alpha: a.rpo_alpha,
                reference_model: a.ref_model.clone(),
                desirable_weight: a.desirable_weight,
                undesirable_weight: a.undesirable_weight,
                reference_free: a.reference_free,
                discopop_tau: a.discopop_tau,
                ld_alpha: a.ld_alpha,
                use_weighting: a.use_weighting,
                sync_ref_model: a.sync_ref_model.then_some(candle_cp_llama::train::dpo::RefSync { every: a.ref_model_sync_steps, alpha: a.ref_model_mixup_alpha }),
            }),
            false => None,
        },
        grpo: {
            // (completions end at the end-of-sequence id: --eos, else the model's)
            let eos = match (a.eos, &a.model) {
                (Some(id), _) => Some(id),
                (None, Some(dir)) => candle_cp_llama::stop_tokens(dir)?.first().copied(),
                (None, None) => None,
            };
            a.grpo.config(eos, a.seed, a.tokenizer.as_deref(), &a.prm.step_separator)?
        },
        expert_bias_update: a.expert_bias_update,
        // (the --tokenizer the data went through, beside each checkpoint's weights)
        tokenizer: a.tokenizer.clone(),
        args: serde_json::json!(format!("{a:?}")),
        sliding_window: a.sliding_window,
        lora_init: a.lora_from.clone(),
        eval: eval.clone(),
        quantize_base: match &a.quantize_base {
            None => None,
            Some(q) => Some(q.parse::<candle_cp_nn::QuantConfig>().map_err(|e| anyhow::anyhow!("--quantize-base {q}: {e}"))?),
        },
        lora: match &a.lora {
            // the adapter's own rank, alpha and targets
            None if a.lora_from.is_some() => a.lora_from.as_deref().map(|d| candle_cp_llama::lora::load_peft_adapter(d).map(|(s, _)| s)).transpose()?,
            None => None,
            Some(spec) => {
                let (r, alpha) = spec.split_once(',').ok_or_else(|| anyhow::anyhow!("--lora {spec}: expected R,ALPHA"))?;
                let r: usize = r.trim().parse().map_err(|e| anyhow::anyhow!("--lora {spec}: rank ({e})"))?;
                let alpha: f64 = alpha.trim().parse().map_err(|e| anyhow::anyhow!("--lora {spec}: alpha ({e})"))?;
                // (PEFT's "all-linear": the seven projections)
                let targets: Vec<&str> = match a.lora_targets.trim() {
                    "all-linear" => candle_cp_llama::lora::ALL_LINEAR.to_vec(),
                    t => t.split(',').map(|t| t.trim()).collect(),
                };
                let mut saved: Vec<&str> = a.lora_modules_to_save.as_deref().map(|m| m.split(',').map(|m| m.trim()).collect()).unwrap_or_default();
                // (a reward model's new score head trains whole, as PEFT's SEQ_CLS task has it; a
                // PRM's with its bias, as the TOKEN_CLS task)
                if (a.reward_model || a.prm.prm) && !saved.contains(&"score") {
                    saved.push("score");
                }
                let params: Vec<&str> = a.lora_target_parameters.as_deref().map(|p| p.split(',').map(|p| p.trim()).collect()).unwrap_or_default();
                Some(candle_cp_llama::LoraSpec::new(r, alpha, &targets)?.with_target_parameters(&params)?.with_rslora(a.rslora).with_dora(a.dora).with_modules_to_save(&saved)?)
            }
        }
        .map(|l| match a.lora_dropout {
            Some(p) => l.with_dropout(p),
            None => Ok(l),
        })
        .transpose()?,
    };
    // (the preference objective's rules checked before any rank starts)
    if let Some(d) = &cfg.dpo {
        d.validate()?;
    }
    if let Some(r) = &cfg.reward {
        r.validate()?;
    }
    let world = layout.world_size();
    let launch = Launch::from_args(&a, world, cuda)?;
    let quiet = launch.quiet();
    // launched processes other than world rank 0 only train; rank 0 reports
    macro_rules! say { ($($t:tt)*) => { if !quiet { println!($($t)*) } } }
    say!(
        "layout   : {layout} ({})",
        launch.describe(world, &a, cuda, dtype)
    );
    say!("data     : {data_desc}");
    if let Some(e) = &eval {
        let what = match &e.data {
            DataSource::Text(s) if a.eval_data.is_some() => format!("{} tokens of --eval-data", s.tokens.len()),
            DataSource::Packed(s) if a.eval_data.is_some() => format!("{} documents of --eval-data", s.count()),
            DataSource::Text(s) => format!("the corpus's last {} tokens, kept out of training", s.tokens.len()),
            DataSource::Packed(s) => format!("the corpus's last {} documents, kept out of training", s.count()),
            DataSource::Recall(_) => "fresh samples of the task".to_string(),
            DataSource::Steps(s) => format!("{} stepwise examples{}", s.len(), if a.eval_data.is_some() { " of --eval-data" } else { ", the last of --data, kept out of training" }),
            DataSource::Prompts(s) => format!("{} prompts{}", s.len(), if a.eval_data.is_some() { " of --eval-data" } else { ", the last of --data, kept out of training" }),
            DataSource::Preference(s) => format!(
                "{} {}{}",
                s.len(),
                if a.unpaired() { "unpaired examples" } else { "preference pairs" },
                if a.eval_data.is_some() { " of --eval-data" } else { ", the last of --data, kept out of training" }
            ),
        };
        match &e.data {
            DataSource::Preference(_) => say!("eval     : every {} steps, {} loss and reward accuracy over all {what}", e.every, if a.kto { "KTO" } else if a.bco { "BCO" } else if a.reward_model { "pair" } else { "DPO" }),
            DataSource::Steps(_) => say!("eval     : every {} steps, the step labels' loss and accuracy over all {what}", e.every),
            DataSource::Prompts(_) => say!("eval     : every {} steps, the mean reward of a greedy completion of each of the {what}", e.every),
            _ => say!("eval     : every {} steps, {} batches of {} rows: {what}", e.every, e.batches, cfg.batch),
        }
    }
    if let DataSource::Packed(_) | DataSource::Preference(_) | DataSource::Steps(_) = &cfg.data {
        // the first step's rows (batches are a pure function of (seed, step, row))
        let rows = cfg.data.rows(cfg.seed, 0, 0, batch, a.seq_len)?;
        let counts: Vec<usize> = rows
            .iter()
            .map(|r| r.documents.as_ref().map_or(1, |d| d.count()))
            .collect();
        say!(
            "packing  : documents per sequence at step 1: {counts:?} (attention inside documents, RoPE positions per document, no target across a boundary)"
        );
    }
    say!(
        "batch    : {batch} rows x {} tokens x {} micro-batches per step",
        a.seq_len,
        a.grad_accum
    );
    if let (Some(d), DataSource::Preference(set)) = (cfg.dpo.as_ref().filter(|d| d.loss.takes_example_weights()), &cfg.data) {
        let good = set.desirable().map_or(0, |d| d.iter().filter(|&&x| x).count()) as f64;
        let ratio = d.desirable_weight * good / (d.undesirable_weight * (set.len() as f64 - good));
        let (name, baseline) = match d.loss {
            candle_cp_llama::train::DpoLoss::Kto => ("KTO", "KL estimate from each micro-batch's KL documents"),
            _ => ("APO-zero on unpaired examples", "no KL term"),
        };
        say!(
            "objective: {name}, beta {}, weights {} desirable / {} undesirable (weighted ratio {ratio:.2}{}), {baseline}, against {}",
            d.beta,
            d.desirable_weight,
            d.undesirable_weight,
            if (1.0..=4.0 / 3.0).contains(&ratio) { "" } else { "; the KTO paper advises 1 to 4/3: set --desirable-weight / --undesirable-weight" },
            d.reference_model.as_ref().map_or("the model as the run starts".to_string(), |r| format!("--ref-model {}", r.display())),
        );
    } else if let Some(d) = cfg.dpo.as_ref().filter(|d| d.loss == candle_cp_llama::train::DpoLoss::Bco) {
        say!(
            "objective: BCO, beta {}, each example's reward against the running mean reward (updated by every micro-batch, kept in the checkpoints), against {}",
            d.beta,
            d.reference_model.as_ref().map_or("the model as the run starts".to_string(), |r| format!("--ref-model {}", r.display())),
        );
    } else if let Some(g) = &cfg.grpo {
        say!(
            "objective: GRPO ({} loss, advantages scaled by {:?}{}{}), {} completions of {} prompts per micro-batch sampled from the model as it is ({:?}), at most {} tokens{}, reward --reward {}",
            g.loss_type.name(),
            g.scale_rewards,
            if g.beta > 0.0 { format!(", KL to the starting model x {}", g.beta) } else { String::new() },
            match g.num_iterations {
                1 => String::new(),
                n => format!(", each generation trained {n} steps with the ratio to its sampler clipped to [{}, {}] per {:?}", 1.0 - g.epsilon, 1.0 + g.epsilon_high, g.importance_sampling_level),
            },
            g.num_generations,
            g.prompts,
            g.sampling,
            g.max_completion_length,
            g.stop.first().map_or(String::new(), |e| format!(" (ending at {e})")),
            a.grpo.reward
        );
    } else if let Some(p) = &cfg.prm {
        say!(
            "objective: process reward model (token classifier, {} labels for a new head, dropout {}), cross-entropy at each step's last token{}",
            p.num_labels,
            p.dropout.map_or("the checkpoint's (0.1 for a new head)".to_string(), |d| d.to_string()),
            if a.prm.train_on_last_step_only { " (each example's last step only)" } else { "" }
        );
    } else if let Some(r) = &cfg.reward {
        say!("objective: reward model (score head at each answer's last token), -log sigmoid(r_chosen - r_rejected){}", if r.center_rewards_coefficient > 0.0 { format!(" + {} x (r_chosen + r_rejected)^2", r.center_rewards_coefficient) } else { String::new() });
    } else if let Some(d) = &cfg.dpo {
        say!(
            "objective: DPO ({}), beta {}{}{}{}, {}",
            match d.mix.is_empty() {
                true => format!("{} loss", d.loss.name()),
                false => d.mix.iter().map(|(l, w)| format!("{w} x {}", l.name())).collect::<Vec<_>>().join(" + "),
            },
            d.beta,
            if d.label_smoothing > 0.0 { format!(", label smoothing {}", d.label_smoothing) } else { String::new() }
                + &match d.f_divergence {
                    candle_cp_llama::train::dpo_loss::FDivergence::ReverseKl => String::new(),
                    candle_cp_llama::train::dpo_loss::FDivergence::Alpha(al) => format!(", f-divergence alpha_divergence (alpha {al})"),
                    f => format!(", f-divergence {}", f.name()),
                }
                + &d.ld_alpha.map_or(String::new(), |al| format!(", LD-DPO (the policy's tokens past the shorter answer weighed {al})")),
            if d.use_weighting { ", each pair weighed by WPO's policy weight" } else { "" }.to_string()
                + &d.sync_ref_model.map_or(String::new(), |r| format!(", the reference moved to {} x policy + {} x reference every {} steps (TR-DPO)", r.alpha, 1.0 - r.alpha, r.every)),
            if d.rpo_alpha > 0.0 { format!(", + {} x the chosen answers' cross-entropy (RPO)", d.rpo_alpha) } else { String::new() },
            match d.loss {
                candle_cp_llama::train::DpoLoss::Simpo => format!("gamma {}, no reference (the answers' mean log-probabilities)", d.simpo_gamma),
                candle_cp_llama::train::DpoLoss::Orpo => "no reference (the log odds ratio of the answers' mean probabilities, plus the chosen answers' cross-entropy)".to_string(),
                _ if d.reference_free => "no reference (--reference-free: the reference log-probabilities taken as 0)".to_string(),
                _ if d.without_reference() => "no reference (the chosen answers' cross-entropy alone)".to_string(),
                _ => format!(
                    "against {} (its log-probabilities of every answer computed before step 1, kept in {})",
                    d.reference_model.as_ref().map_or("the model as the run starts".to_string(), |r| format!("--ref-model {}", r.display())),
                    a.out.join("dpo_reference.json").display()
                ),
            }
        );
    } else {
    say!(
        "objective: mean cross-entropy over {} targets",
        if long_range_only && a.sft {
            "the completion"
        } else if long_range_only {
            "the long-range"
        } else {
            "all next-token"
        }
    );
    }
    let replicas = layout.dp * layout.cp;
    say!(
        "memory   : layers {}; loss through the chunked head (no logits); optimizer state {}",
        if a.recompute {
            "recomputed in backward (--recompute)"
        } else {
            "keep their activations (--recompute to trade compute for memory)"
        },
        if (a.zero1 || a.zero2) && replicas > 1 {
            let experts = match replicas / layout.ep {
                _ if layout.ep == 1 => String::new(),
                1 => ", the experts' whole on their EP rank (no other rank holds them)".to_string(),
                n => format!(", the experts' over the {n} ranks holding the same experts"),
            };
            format!("split over {replicas} DP x CP replicas{experts} (--zero{})", if a.zero2 { 2 } else { 1 })
        } else {
            "replicated".to_string()
        }
    );
    if matches!(layout.cp_kind, CpKind::Ulysses | CpKind::TwoD) && layout.cp > 1 {
        say!(
            "attention: {}",
            if a.regather_heads {
                "q, k, v and the output all-to-alled to heads again in the backward (--regather-heads)"
            } else {
                "q, k, v and the output kept in the head layout for the backward (--regather-heads keeps less and sends 50% more all-to-all bytes)"
            }
        );
    }
    if a.dtype != "f32" {
        let rs = layout.effective_row_sums();
        let how = if layout.row_sums.is_some() { "--row-sums" } else { "this CP kind's default" };
        let what = match rs {
            RowSums::F32 => "a bf16 residual kept per attention output element; --row-sums output keeps none",
            RowSums::Output => "nothing kept; --row-sums f32 keeps a bf16 residual per output element for more accurate dq, dk",
        };
        say!("row sums : the attention backward takes them {rs} ({how}: {what})");
    }
    if replicas > 1 {
        let how = if a.zero2 {
            "reduce-scattered into f32 ZeRO-2 slices"
        } else if a.zero1 {
            "reduce-scattered into the ZeRO-1 slices"
        } else {
            "all-reduced"
        };
        let when = match (a.overlap_grad_sync, a.zero2) {
            (true, true) => "layer by layer during every micro-batch's backward (--overlap-grad-sync)",
            (true, false) => "layer by layer during the last micro-batch's backward (--overlap-grad-sync)",
            (false, true) => "after every micro-batch's backward",
            (false, false) => "after the last micro-batch's backward",
        };
        say!("gradients: {how} over the {replicas} DP x CP replicas, {when}");
        if a.zero1 || a.zero2 {
            let when = if a.overlap_param_gather { "layer by layer during the next forward (--overlap-param-gather)" } else { "in the optimizer step" };
            say!("params   : the updated ZeRO slices all-gathered {when}");
        }
    }
    if let Some(l) = &cfg.lora {
        say!(
            "lora     : rank {}, alpha {} (scale {:.3}{}) on {} of every layer{}{}{}; every other weight frozen; checkpoints hold a PEFT adapter naming the base",
            l.config.rank,
            l.config.alpha,
            l.config.scale(),
            if l.config.rslora { ", rsLoRA" } else { "" }.to_string() + if l.dora { ", DoRA" } else { "" } + &if l.dropout > 0.0 { format!(", dropout {}", l.dropout) } else { String::new() },
            l.targets.join(", "),
            // (a sparse layer's MLP projections are its experts': each adapted, as PEFT does)
            match match &cfg.model {
                ModelSource::Init(c) => c.moe.clone(),
                ModelSource::Hf(dir) => candle_cp_llama::LlamaConfig::from_file(dir.join("config.json")).ok().and_then(|c| c.moe),
            } {
                Some(m) if ["gate_proj", "up_proj", "down_proj"].iter().any(|t| l.adapts(t)) => format!(" (in a sparse layer each of the {} experts' too)", m.num_experts),
                _ => String::new(),
            },
            if l.target_parameters.is_empty() { String::new() } else { format!(", and the expert parameters {} (rank {} per expert)", l.target_parameters.join(", "), l.config.rank) },
            if l.modules_to_save.is_empty() { String::new() } else { format!("; {} trained whole (modules_to_save)", l.modules_to_save.join(", ")) }
        );
    }
    say!("out      : {}", a.out.display());
    if a.resume {
        let root = a.out.join("checkpoints");
        match candle_cp_llama::train::checkpoint::latest_checkpoint(&root)? {
            Some(p) => {
                let old_tp = candle_cp_llama::train::checkpoint::optimizer_tp_degree(&p);
                let how = if old_tp == a.tp {
                    "optimizer state read as saved (same TP degree)".to_string()
                } else {
                    format!("optimizer state resharded from TP {old_tp} to TP {}", a.tp)
                };
                say!("resume   : from {} ({how})", p.display())
            }
            None => say!(
                "resume   : no checkpoint in {}, starting from step 0",
                root.display()
            ),
        }
    }
    let t0 = Instant::now();
    let steps = a.steps;
    let ranks_here = launch.ranks_here(world);
    // (the marked targets: the synthetic task's long-range answers, or --sft's completions)
    let marked = if a.preference() { "answers' CE" } else if a.sft || a.grpo.grpo { "completion" } else { "long-range" };
    let on_step = move |m: &StepMetrics| {
        let width = 20;
        let filled = (m.step * width).div_ceil(steps.max(1)).min(width);
        let bar: String = "#".repeat(filled) + &".".repeat(width - filled);
        let lr_loss = m
            .long_range_loss
            .map_or(String::new(), |x| format!("  {marked} {x:.3}"));
        let aux = m.router_aux_loss.map_or(String::new(), |x| format!("  aux {x:.4}"));
        let aux = aux + &m.dpo_accuracy.map_or(String::new(), |acc| format!("  acc {acc:.2}")) + &m.dpo_margin.map_or(String::new(), |mg| format!("  margin {mg:.3}"));
        let aux = aux + &m.kto_kl.map_or(String::new(), |k| format!("  kl {k:.3}"));
        let aux = aux + &m.bco_delta.map_or(String::new(), |d| format!("  delta {d:.3}"));
        let aux = aux + &m.grpo_reward.zip(m.completion_length).map_or(String::new(), |(r, l)| format!("  reward {r:.3}  len {l:.1}"));
        let aux = aux + &m.grpo_kl.map_or(String::new(), |k| format!("  kl {k:.4}"));
        let aux = aux + &m.grpo_clip_ratio.map_or(String::new(), |c| format!("  clipped {c:.3}"));
        let aux = aux + &m.grpo_zero_std.filter(|&z| z > 0.0).map_or(String::new(), |z| format!("  flat groups {z:.2}"));
        let aux = aux + &m.expert_load.map_or(String::new(), |x| format!(" (load {x:.2})"));
        // (experts no token chose this step, over every sparse layer)
        let idle = m.expert_counts.as_ref().map_or((0, 0), |c| (c.iter().flatten().filter(|&&x| x == 0).count(), c.iter().map(Vec::len).sum()));
        let aux = aux + &if idle.0 > 0 { format!("  idle experts {} of {}", idle.0, idle.1) } else { String::new() };
        let all = if (m.train_loss - m.loss).abs() > 1e-6 {
            format!("  all {:.3}", m.loss)
        } else {
            String::new()
        };
        let all = all + &m.eval_loss.map_or(String::new(), |x| format!("  held-out {x:.3}"));
        let all = all + &m.eval_long_range_loss.map_or(String::new(), |x| format!(" ({marked} {x:.3})"));
        let all = all + &m.eval_dpo_accuracy.map_or(String::new(), |x| format!(" (acc {x:.2})"));
        let all = all + &m.eval_reward.map_or(String::new(), |x| format!("  held-out reward {x:.3}"));
        let mem = m.peak_rss_mib.map_or("n/a".to_string(), |x| {
            format!(
                "{:.0} MiB/rank ({:.0} MiB process)",
                x / ranks_here as f64,
                x
            )
        });
        println!(
            "[{bar}] step {:>4}/{steps}  loss {:.4}{aux}{lr_loss}{all}  lr {:.2e}  |g| {:.3}  {:.0} tok/s  peak {mem}  {:.1}s",
            m.step, m.train_loss, m.lr, m.grad_norm, m.tokens_per_s, m.elapsed_s
        );
    };
    let timeout = Duration::from_secs(a.timeout);
    let train = |g: Group| candle_cp_llama::train::train_rank(g, &cfg, &on_step);
    let Some(o) = launch.run(world, timeout, train)? else {
        // a launched process other than world rank 0: rank 0 reports
        return Ok(());
    };

    let c = &o.config;
    let window = match (c.sliding_window, &c.sliding_layers) {
        (None, _) => String::new(),
        (Some(w), None) => format!(", sliding window {w}"),
        (Some(w), Some(l)) => format!(", sliding window {w} on {} of {} layers", l.iter().filter(|&&s| s).count(), l.len()),
    };
    // (SmolLM3's NoPE layers)
    let window = match &c.nope_layers {
        Some(n) => format!("{window}, no RoPE on layers {:?}", (0..n.len()).filter(|&i| n[i]).collect::<Vec<_>>()),
        None => window,
    };
    println!(
        "model    : {} {} params (hidden {}, {} layers, {} heads / {} kv heads, vocab {}{window})",
        c.hf_class(),
        o.n_params,
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size
    );
    let cfg_lora = a.lora.is_some() || a.lora_from.is_some();
    println!(
        "optimizer: {:.2} MiB of Adam state on rank 0 ({} of the {} parameters trained{})",
        o.optimizer_state_bytes as f64 / (1u64 << 20) as f64,
        o.trainable_params,
        o.n_params,
        match (cfg_lora, &a.lora_modules_to_save) {
            (true, Some(m)) => format!(": the LoRA adapters and {m}"),
            (true, None) => ": the LoRA adapters".to_string(),
            _ => String::new(),
        }
    );
    if cfg_lora {
        println!(
            "base     : {:.2} MiB of frozen weights on rank 0{}",
            o.frozen_weight_bytes as f64 / (1u64 << 20) as f64,
            a.quantize_base.as_deref().map(|q| format!(" (projections quantized: {q})")).unwrap_or_default()
        );
    }
    if let (Some(first), Some(last), true) = (o.metrics.first(), o.metrics.last(), a.reward_model || a.prm.prm) {
        // (a reward model: its pairs' loss and accuracy, no per-token loss; a PRM: its steps')
        let acc = |m: &candle_cp_llama::train::StepMetrics| m.dpo_accuracy.map_or("-".to_string(), |x| format!("{x:.2}"));
        let what = if a.prm.prm { "step" } else { "pair" };
        println!("summary  : steps {}..{}  {what} loss {:.3} -> {:.3}  accuracy {} -> {}", first.step, last.step, first.train_loss, last.train_loss, acc(first), acc(last));
    } else if let (Some(first), Some(last)) = (o.metrics.first(), o.metrics.last()) {
        let fmt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.3}"));
        println!(
            "summary  : steps {}..{}  loss {:.3} -> {:.3}  {marked} loss {} -> {}  (all-target loss {:.3} -> {:.3})",
            first.step,
            last.step,
            first.train_loss,
            last.train_loss,
            fmt(first.long_range_loss),
            fmt(last.long_range_loss),
            first.loss,
            last.loss
        );
    }
    println!("wall     : {:.1}s", t0.elapsed().as_secs_f64());
    println!(
        "wrote    : {}/metrics.jsonl, {}/loss.png, {}/checkpoints/",
        a.out.display(),
        a.out.display(),
        a.out.display()
    );
    Ok(())
}
