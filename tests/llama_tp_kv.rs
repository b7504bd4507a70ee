//! Tensor parallelism over KV heads that neither divide nor are divided by the TP degree
//! (Phi-3-medium and Phi-4: 40 query heads, 10 KV heads, at TP 4 or 8). Each KV head is copied
//! `lcm(Hkv, tp)/Hkv` times and each TP rank holds the `lcm(Hkv, tp)/tp` copies its query heads
//! use (`Shard::RowBlocks`); a KV head's weight gradient is the sum over its copies, on one
//! rank or two (`Shard::fold_copies`). Logits, loss and every parameter gradient on each layout
//! equal the single-device run of the same weights, and the ranks agree.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::params::varmap_tensors;
use candle_cp_llama::verify::{compare, run_layout, LayoutRun, Reference, Tolerances};
use candle_cp_llama::{init_params, param_specs, LlamaConfig, LoraSpec};
use std::collections::HashMap;

fn ids(b: usize, t: usize, vocab: usize) -> Result<Tensor> {
    let v: Vec<u32> = (0..b * t).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu)
}

fn reference(run: &LayoutRun, ids: &Tensor) -> Reference {
    Reference { input_ids: ids.clone(), logits: run.logits.clone(), loss: run.loss, grads: run.grads.iter().cloned().collect() }
}

/// Every layout of `layouts` on `cfg` equals the single-device run: logits 2e-5, loss 2e-5,
/// gradients 1e-4 relative to each tensor's largest entry, ranks within 1e-6.
fn check(cfg: &LlamaConfig, layouts: &[Layout], seed: u64) -> Result<()> {
    let mut full: HashMap<String, Tensor> = varmap_tensors(&init_params(cfg, seed, DType::F32, &Device::Cpu)?)?;
    // LoRA: B drawn too (not zero), so that every adapter has a gradient and moves the logits
    for (i, s) in param_specs(cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        full.insert(s.name, candle_cp_ops::oracle::randn(seed * 100 + i as u64, &s.shape, 0.2)?.to_dtype(DType::F32)?);
    }
    let ids = ids(2, 32, cfg.vocab_size)?;
    let want = reference(&run_layout(&full, cfg, &ids, Layout::single(), &Device::Cpu)?, &ids);
    let tol = Tolerances { logits_abs: 2e-5, loss_abs: 2e-5, grad_rel: 1e-4 };
    for &layout in layouts {
        let run = run_layout(&full, cfg, &ids, layout, &Device::Cpu)?;
        let rep = compare(&run, &want, tol)?;
        println!(
            "heads {}/{} {layout}: logits {:.1e} loss {:.1e} grad {:.1e} ({}) ranks {:.1e}",
            cfg.num_attention_heads, cfg.num_key_value_heads, rep.logits_abs, rep.loss_abs, rep.grad_rel_max, rep.worst_param, rep.rank_spread
        );
        assert_eq!(rep.grad_rel.len(), want.grads.len(), "{layout}: every parameter compared");
        assert!(rep.pass() && rep.rank_spread <= 1e-6, "{layout}: {rep:?}");
    }
    Ok(())
}

/// 12 query heads over 3 KV heads (Phi-3-medium's group of 4): TP 2 holds KV heads
/// {0, 0, 1} and {1, 2, 2} (copies of 6), TP 4 {0, 0, 0}, {0, 1, 1}, {1, 1, 2}, {2, 2, 2} (of
/// 12); with SP, under zigzag and ring CP, Ulysses inside the TP rank (its 3 KV copies
/// replicated again over Ulysses 2) and DP.
#[test]
fn three_kv_heads_over_tp_2_and_4_equal_one_device() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 48, 2, 12, 3);
    check(
        &cfg,
        &[
            Layout::single().with_tp(2, true),
            Layout::single().with_tp(4, false),
            Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
            Layout::cp(CpKind::Ring, 2).with_tp(4, true),
            Layout::cp(CpKind::Ulysses, 2).with_tp(2, true),
            Layout::single().with_tp(2, false).with_dp(2),
        ],
        7,
    )
}

/// Phi-3-medium's 10 KV heads (here of 20 query heads, with Qwen2's q, k, v biases, whose k / v
/// biases are copied like the weights) over TP 4 (5 copies of 20 each, KV heads 2 and 7 on two
/// ranks) and 40 query heads over TP 8 (5 of 40 each, every head on four copies, two ranks).
#[test]
fn ten_kv_heads_over_tp_4_and_8_equal_one_device() -> Result<()> {
    check(&LlamaConfig::tiny(64, 80, 1, 20, 10).with_qkv_bias(true), &[Layout::single().with_tp(4, true), Layout::cp(CpKind::Zigzag, 2).with_tp(4, true)], 8)?;
    check(&LlamaConfig::tiny(64, 160, 1, 40, 10), &[Layout::single().with_tp(8, false)], 9)
}

/// LoRA on every projection (`B` drawn): the k / v adapters' `B` rows are KV-head copies
/// like their weights, their gradients summed over the copies; logits and every adapter
/// gradient equal the single device's on TP 2 + SP, TP 4 × ring CP 2 and TP 2 × Ulysses 2.
/// DoRA too: the k / v magnitudes (one per row) are copied and folded like `B`.
#[test]
fn lora_and_dora_on_mixed_kv_copies_equal_one_device() -> Result<()> {
    let layouts = [
        Layout::single().with_tp(2, true),
        Layout::cp(CpKind::Ring, 2).with_tp(4, true),
        Layout::cp(CpKind::Ulysses, 2).with_tp(2, false),
    ];
    for dora in [false, true] {
        let spec = LoraSpec::new(4, 6.0, &candle_cp_llama::lora::TARGETS)?.with_dora(dora);
        let cfg = LlamaConfig::tiny(64, 48, 2, 12, 3).with_lora(Some(spec));
        assert_eq!(param_specs(&cfg).iter().any(|s| s.name.ends_with("k_proj.lora_magnitude_vector")), dora);
        check(&cfg, &layouts, 12)?;
    }
    Ok(())
}

/// QLoRA: the frozen base quantized (NF4, blocks of 4) by each rank from its shards, KV-head
/// copies included, equals the one-device quantized run on TP 2 + SP and TP 4 × zigzag CP 2
/// (each copy quantizes to the same codes as its head on one device).
#[test]
fn qlora_on_mixed_kv_copies_equals_one_device() -> Result<()> {
    use candle_cp_llama::verify::run_layout_quantized;
    use candle_cp_nn::{QuantConfig, QuantKind};
    let cfg = LlamaConfig::tiny(64, 48, 1, 12, 3).with_lora(Some(LoraSpec::new(4, 6.0, &candle_cp_llama::lora::TARGETS)?));
    let mut full: HashMap<String, Tensor> = varmap_tensors(&init_params(&cfg, 4, DType::F32, &Device::Cpu)?)?;
    for (i, s) in param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        full.insert(s.name, candle_cp_ops::oracle::randn(400 + i as u64, &s.shape, 0.2)?.to_dtype(DType::F32)?);
    }
    let ids = ids(2, 32, cfg.vocab_size)?;
    let q = QuantConfig::new(QuantKind::Nf4, 4)?;
    let want = reference(&run_layout_quantized(&full, &cfg, &ids, Layout::single(), &Device::Cpu, false, q)?, &ids);
    let tol = Tolerances { logits_abs: 2e-5, loss_abs: 2e-5, grad_rel: 1e-4 };
    for layout in [Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_tp(4, true)] {
        let rep = compare(&run_layout_quantized(&full, &cfg, &ids, layout, &Device::Cpu, false, q)?, &want, tol)?;
        println!("QLoRA {layout}: logits {:.1e} grad {:.1e} ({})", rep.logits_abs, rep.grad_rel_max, rep.worst_param);
        assert!(rep.pass() && rep.rank_spread <= 1e-6 && rep.grad_rel.len() == want.grads.len(), "{layout}: {rep:?}");
    }
    Ok(())
}

/// The layouts the model cannot split are refused by name: TP not dividing the query heads,
/// KV heads not dividing them.
#[test]
fn indivisible_heads_are_refused() -> Result<()> {
    let e = Layout::single().with_tp(8, true).validate(12, 3).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("must divide heads (12)"), "{e}");
    let e = Layout::single().with_tp(2, true).validate(12, 5).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("kv heads (5) must divide heads (12)"), "{e}");
    assert!(Layout::single().with_tp(4, true).validate(40, 10).is_ok());
    Ok(())
}

mod training {
    use super::*;
    use candle_cp_comm::run_ranks;
    use candle_cp_llama::load_hf;
    use candle_cp_llama::train::{train_rank, AdamWConfig, DataSource, KvRecall, ModelSource, TrainConfig, TrainOutcome, WarmupCosine};
    use std::path::PathBuf;

    const STEPS: usize = 4;

    fn config(layout: Layout, out: Option<PathBuf>) -> Result<TrainConfig> {
        let mut task = KvRecall::new(64)?;
        (task.n_keys, task.n_values, task.n_queries, task.fused) = (8, 8, 8, true);
        let vocab = task.vocab_needed();
        Ok(TrainConfig {
            batch: 2,
            grad_accum: 1,
            schedule: WarmupCosine { peak: 1e-2, warmup: 1, total: STEPS, min_ratio: 0.1 },
            adamw: AdamWConfig { weight_decay: 0.01, ..AdamWConfig::default() },
            clip: 0.5,
            seed: 11,
            out,
            save_every: 2,
            ..TrainConfig::new(layout, ModelSource::Init(LlamaConfig::tiny(vocab, 48, 1, 12, 3)), DataSource::Recall(task), 64, STEPS)
        })
    }

    fn run(cfg: &TrainConfig) -> Result<Vec<TrainOutcome>> {
        run_ranks(cfg.layout.world_size(), |g| train_rank(g, cfg, &|_| {})).into_iter().collect()
    }

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cp-tp-kv-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn weights(dir: &std::path::Path) -> Result<HashMap<String, Tensor>> {
        varmap_tensors(&load_hf(dir.join(format!("checkpoints/step-{STEPS:06}")), &Device::Cpu, DType::F32)?.0)
    }

    /// 4 clipped AdamW steps of a model with 12 query / 3 KV heads on TP 2 + SP × zigzag CP 2,
    /// TP 4 × DP 2 with ZeRO-1, TP 2 stopped after step 3 and resumed on one device, and TP 4
    /// (3 copies of 12 per rank) resumed on TP 2 × zigzag CP 2 (3 of 6: the per-TP-rank
    /// optimizer files resharded from one set of copies to another), and TP 2 × zigzag CP 2 ×
    /// DP 2 with ZeRO-2, recompute and both overlaps follow the one-device run: losses to 1e-5,
    /// gradient norms to 1e-4 (the norm counts each KV head once, however many copies), and
    /// the final checkpoints hold the same weights (each KV head's copies stayed equal).
    #[test]
    fn mixed_kv_copies_train_and_resume_like_one_device() -> Result<()> {
        let d1 = tmp("one");
        let one = run(&config(Layout::single(), Some(d1.clone()))?)?;
        let want = weights(&d1)?;
        for (i, layout, zero, resume_on) in [
            (0, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), 0, None),
            (1, Layout::single().with_tp(4, false).with_dp(2), 1, None),
            (2, Layout::single().with_tp(2, true), 0, Some(Layout::single())),
            (3, Layout::single().with_tp(4, true), 0, Some(Layout::cp(CpKind::Zigzag, 2).with_tp(2, true))),
            (4, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_dp(2), 2, None),
        ] {
            let d = tmp(&format!("l{i}"));
            let mut c = config(layout, Some(d.clone()))?;
            c.zero1 = zero == 1;
            if zero == 2 {
                // ZeRO-2 with recompute and both overlaps: the copies' fold beside the
                // replicas' layer-by-layer sums and the parameter gathers
                (c.zero2, c.recompute, c.overlap_grad_sync, c.overlap_param_gather) = (true, true, true, true);
            }
            let mut got = if let Some(next) = resume_on {
                c.stop_after = Some(3);
                let first = run(&c)?;
                (c.layout, c.resume, c.stop_after) = (next, true, None);
                let rest = run(&c)?;
                assert!(rest.iter().all(|r| (r.start_step, r.optimizer_resharded_from) == (2, Some(layout.tp))), "{layout} -> {next}");
                first[0].metrics[..2].iter().chain(&rest[0].metrics).cloned().collect::<Vec<_>>()
            } else {
                let out = run(&c)?;
                assert!(out.iter().all(|r| r.metrics.len() == STEPS), "{layout}");
                out[0].metrics.clone()
            };
            assert_eq!(got.len(), STEPS, "{layout}");
            for (x, y) in one[0].metrics.iter().zip(got.drain(..)) {
                assert!((x.loss - y.loss).abs() < 1e-5, "{layout} step {}: loss {} vs {}", x.step, x.loss, y.loss);
                assert!((x.grad_norm - y.grad_norm).abs() < 1e-4 * x.grad_norm.max(1.0), "{layout} step {}: norm {} vs {}", x.step, x.grad_norm, y.grad_norm);
            }
            let w = weights(&d)?;
            assert_eq!(w.len(), want.len(), "{layout}");
            for (name, t) in &want {
                let e = (&w[name] - t)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(e < 1e-4, "{layout}: {name} differs by {e}");
            }
            std::fs::remove_dir_all(&d).ok();
        }
        std::fs::remove_dir_all(&d1).ok();
        Ok(())
    }
}

/// Cached greedy generation on TP 2 and TP 4 (with zigzag CP 2 and SP) over 3 KV heads gives the
/// single device's tokens and logits (1e-4) on every rank; a TP rank caches its
/// `lcm(3, tp)/tp = 3` KV copies: one device's bytes per token, over CP its share of them.
#[test]
fn mixed_kv_copies_generate_like_one_device() -> Result<()> {
    use candle_cp_comm::run_ranks;
    use candle_cp_llama::layout::ParallelCtx;
    use candle_cp_llama::{shard_tensors, Generation, Llama};
    use candle_nn::VarBuilder;
    let cfg = LlamaConfig::tiny(64, 48, 2, 12, 3);
    let full: HashMap<String, Tensor> = varmap_tensors(&init_params(&cfg, 5, DType::F32, &Device::Cpu)?)?;
    let prompt = ids(2, 24, cfg.vocab_size)?;
    let generate = |layout: Layout| -> Result<Vec<Generation>> {
        run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_tensors(&full, &cfg, &ctx)?;
            Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?.generate_greedy(&prompt, 6)
        })
        .into_iter()
        .collect()
    };
    let want = generate(Layout::single())?.remove(0);
    for layout in [Layout::single().with_tp(2, false), Layout::cp(CpKind::Zigzag, 2).with_tp(4, true)] {
        for (r, g) in generate(layout)?.iter().enumerate() {
            assert_eq!(g.tokens, want.tokens, "{layout} rank {r}");
            for (a, b) in g.logits.iter().zip(&want.logits) {
                let e = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(e < 1e-4, "{layout} rank {r}: logits differ by {e}");
            }
            // one token's k, v: 2 · 2 layers · B 2 · 3 copies · D 4 · 4 bytes
            assert!(g.cache_bytes <= want.cache_bytes / layout.cp + 2 * 2 * 2 * 3 * 4 * 4, "{layout} rank {r}: {} vs {}", g.cache_bytes, want.cache_bytes);
        }
    }
    Ok(())
}

/// Checkpoints: a Phi-3 with 12 / 3 heads (fused `qkv_proj` in the file) loaded sharded at TP 2
/// and 4 (each rank reading its KV-head copies from the file) equals sharding the whole model,
/// and streamed back from the shards (`save_hf_sharded`: one copy of each KV head) gives the
/// same bytes as the whole model's file.
#[test]
fn mixed_kv_copies_load_and_save_checkpoints_sharded() -> Result<()> {
    use candle_cp_comm::run_ranks;
    use candle_cp_llama::hf::{load_hf_sharded, save_hf_sharded, save_hf_tensors};
    use candle_cp_llama::layout::ParallelCtx;
    use candle_cp_llama::shard_tensors;
    let cfg = LlamaConfig::tiny(64, 48, 2, 12, 3).with_phi3(true);
    let full: HashMap<String, Tensor> = varmap_tensors(&init_params(&cfg, 3, DType::F32, &Device::Cpu)?)?;
    let root = std::env::temp_dir().join(format!("candle-cp-tp-kv-ckpt-{}", std::process::id()));
    let dir = root.join("whole");
    let mut tensors: Vec<(String, Tensor)> = full.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    save_hf_tensors(&dir, &tensors, &cfg)?;
    let bytes = std::fs::read(dir.join("model.safetensors"))?;
    for tp in [2usize, 4] {
        let streamed = root.join(format!("tp{tp}"));
        for r in run_ranks(tp, |g| -> Result<f32> {
            let ctx = ParallelCtx::new(g, Layout::single().with_tp(tp, true))?;
            let want = varmap_tensors(&shard_tensors(&full, &cfg, &ctx)?)?;
            let got = varmap_tensors(&load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32)?.0)?;
            save_hf_sharded(&streamed, &got, &cfg, &ctx, ctx.tp.rank() == 0)?;
            assert_eq!(got.len(), want.len(), "tp {tp}");
            let mut worst = 0f32;
            for (k, w) in &want {
                worst = worst.max((&got[k] - w)?.abs()?.max_all()?.to_scalar::<f32>()?);
            }
            Ok(worst)
        }) {
            assert_eq!(r?, 0.0, "tp {tp}: the sharded load differs from sharding the whole model");
        }
        assert!(bytes == std::fs::read(streamed.join("model.safetensors"))?, "tp {tp}: the streamed checkpoint differs");
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
