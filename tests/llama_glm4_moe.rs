//! GLM-4.5 (`model_type` `glm4_moe`): sigmoid router scores, the experts chosen by the scores
//! plus a correction bias within the best expert groups, the chosen weights renormalised and
//! scaled, shared experts without a gate, a dense first layer; q, k, v biases with head norms
//! and RoPE on half of each head.
//!
//! - The tiny-llama weights as GLM-4.5 (layer 1: 8 experts in 4 groups, 2 groups kept, top 2,
//!   48 wide, scale 2.5, a shared expert 48 wide; correction biases of std 0.3) against the
//!   float64 reference (`dense_llama.rs`, which chooses and weights as `Glm4MoeMoE` does): one
//!   device, ring, zigzag, Ulysses, 2-D, TP with and without SP, TP × CP, expert parallelism,
//!   DP, recomputed layers — logits, loss and every gradient within the oracle's tolerances;
//!   the correction bias's gradient exactly zero on every layout. The correction bias, the
//!   groups, the scale and the shared expert each bind.
//! - Generation: cached decoding equals the full forward; CP, TP and EP decode the single
//!   device's tokens.
//! - Checkpoints: GLM-4.5's names (per-expert `mlp.experts.{e}.*`, `mlp.shared_experts.*`,
//!   `mlp.gate.e_score_correction_bias`) written and read back bit for bit, whole and over TP 2
//!   and EP 2; the correction bias kept in f32 in a bf16 model; the published
//!   multi-token-prediction layer (`model.layers.{L}.*`) skipped on load.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::params::CORRECTION_BIAS;
use candle_cp_llama::verify::{compare, load_reference, run_layout_recompute, Tolerances};
use candle_cp_llama::{load_hf, save_hf, Arch, MoeStyle};
use candle_cp_tests::dense_llama::{cached_generation_agrees, max_abs, reference, reference_routed, reference_rows, sharded_load_and_save};
use candle_cp_tests::moe_model::moe_model;

const T: usize = 64;

fn ids(t: usize) -> Result<Tensor> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, t)?.contiguous()
}

fn io<E: std::fmt::Display>(e: E) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Every kind of layout, DP, recomputed layers and expert parallelism give the reference's
/// results, the correction bias a zero gradient; the bias, the groups, the scale and the shared
/// expert each move the results.
#[test]
fn glm4_moe_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full) = moe_model(MoeStyle::Glm4Moe, None)?;
    assert_eq!((cfg.arch(), cfg.moe_layers(), cfg.rope_dim(), cfg.qkv_bias, cfg.qk_norm), (Arch::Glm4Moe, 1, 8, true, true));
    let ids = ids(T)?;
    let (want, margin) = reference_routed(&full, &cfg, &ids)?;
    println!("glm4_moe: smallest top-2 margin of the choice scores: {margin:.2e}");
    assert!(margin > 1e-5, "a near tie in the routing ({margin:.1e}): float32 could route otherwise");
    let bias = format!("model.layers.1.mlp.gate.{CORRECTION_BIAS}");
    assert_eq!(max_abs(&want.grads[&bias], &want.grads[&bias].zeros_like()?)?, 0.0);
    let m = cfg.moe.clone().ok_or_else(|| io("no experts"))?;
    let with = |f: &dyn Fn(&mut candle_cp_llama::MoeConfig)| {
        let mut m = m.clone();
        f(&mut m);
        cfg.clone().with_moe(Some(m))
    };
    let mut no_bias = full.clone();
    no_bias.insert(bias.clone(), full[&bias].zeros_like()?);
    let mut no_shared = full.clone();
    let sd = "model.layers.1.mlp.shared_experts.down_proj.weight";
    no_shared.insert(sd.into(), full[sd].zeros_like()?);
    let router = "model.layers.1.mlp.gate.weight";
    for (what, c, f) in [
        ("the correction bias", cfg.clone(), &no_bias),
        ("the groups", with(&|m| m.groups = (1, 1)), &full),
        ("routed_scaling_factor", with(&|m| m.routed_scaling_factor = 1.0), &full),
        ("the shared expert", cfg.clone(), &no_shared),
    ] {
        let o = reference(f, &c, &ids)?;
        let moved = max_abs(&o.logits, &want.logits)?.max(max_abs(&o.grads[router], &want.grads[router])? / max_abs(&want.grads[router], &want.grads[router].zeros_like()?)?);
        assert!(moved > 0.01, "{what} moves the logits and the router's gradient by only {moved:.1e}");
    }
    let experts = |k: &str| k.contains(".mlp.") && k.starts_with("model.layers.1.");
    let layouts = [
        (Layout::single(), false),
        (Layout::cp(CpKind::Ring, 4), false),
        (Layout::cp(CpKind::Zigzag, 4), false),
        (Layout::cp(CpKind::Ulysses, 2), false),
        (Layout::two_d(2, 2), false),
        (Layout::single().with_tp(2, false), false),
        (Layout::single().with_tp(4, true), false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true),
        (Layout::cp(CpKind::Zigzag, 4).with_ep(4), false),
        (Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2), true),
    ];
    let two = Tensor::cat(&[&ids, &ids], 0)?;
    let rows_want = reference_rows(&want)?;
    let dp = [(Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_ep(2), false)];
    for (layout, recompute, input, want) in layouts.iter().map(|&(l, r)| (l, r, &ids, &want)).chain(dp.iter().map(|&(l, r)| (l, r, &two, &rows_want))) {
        let rep = compare(&run_layout_recompute(&full, &cfg, input, layout, &Device::Cpu, recompute)?, want, Tolerances::default())?;
        println!("glm4_moe {layout} (recompute {recompute}): logits {:.1e} loss {:.1e} grad rel {:.1e} ({})", rep.logits_abs, rep.loss_abs, rep.grad_rel_max, rep.worst_param);
        assert_eq!(rep.grad_rel.len(), want.grads.len(), "{layout}: every parameter compared");
        // the router, its correction bias, 3 stacked experts, 3 shared projections
        assert_eq!(rep.grad_rel.iter().filter(|(k, _)| experts(k)).count(), 8, "{layout}: the sparse layer's parameters");
        assert_eq!(rep.grad_rel.iter().find(|(k, _)| *k == bias).map(|(_, r)| *r), Some(0.0), "{layout}: the correction bias's gradient is zero");
        assert!(rep.pass(), "glm4_moe {layout}: {rep:?}");
    }
    Ok(())
}

/// Cached decoding equals the full forward; CP, TP and EP decode the single device's tokens.
#[test]
fn glm4_moe_generation() -> Result<()> {
    let (cfg, full) = moe_model(MoeStyle::Glm4Moe, None)?;
    let layouts = [Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true), Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2)];
    cached_generation_agrees(&cfg, &full, &ids(32)?, &layouts)
}

/// Checkpoints in GLM-4.5's names: written, read back bit for bit (the correction bias f32 in
/// a bf16 model), with a multi-token-prediction layer beside them skipped, whole, over TP 2 and
/// over EP 2; the sharded writer writes save_hf's bytes.
#[test]
fn glm4_moe_checkpoints() -> Result<()> {
    let (cfg, full) = moe_model(MoeStyle::Glm4Moe, None)?;
    let (e, i, h) = (8usize, 48usize, cfg.hidden_size);
    let tmp = |tag: &str| std::env::temp_dir().join(format!("candle-cp-glm4-moe-{tag}-{}", std::process::id()));
    let dir = tmp("saved");
    save_hf(&dir, &candle_cp_tests::varmap_of(&full)?, &cfg)?;
    let mut names = load_safetensors_dir(&dir, &Device::Cpu)?;
    let p = "model.layers.1.mlp.";
    for (k, shape) in [("gate.weight", vec![e, h]), (&format!("gate.{CORRECTION_BIAS}"), vec![e]), ("experts.7.down_proj.weight", vec![h, i]), ("shared_experts.gate_proj.weight", vec![i, h])] {
        assert_eq!(names.get(&format!("{p}{k}")).map(|t| t.dims().to_vec()), Some(shape), "{k}");
    }
    assert!(!names.keys().any(|k| k.contains("shared_expert_gate") || k.contains("shared_expert.")), "no Qwen2-MoE names");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).map_err(io)?).map_err(io)?;
    assert_eq!(
        (config["architectures"][0].as_str(), config["first_k_dense_replace"].as_u64(), config["n_group"].as_u64(), config["routed_scaling_factor"].as_f64(), config["use_qk_norm"].as_bool(), config["n_shared_experts"].as_u64()),
        (Some("Glm4MoeForCausalLM"), Some(1), Some(4), Some(2.5), Some(true), Some(1))
    );
    let (back, back_cfg) = load_hf(&dir, &Device::Cpu, DType::F32)?;
    assert_eq!(back_cfg, cfg);
    let got = candle_cp_llama::params::varmap_tensors(&back)?;
    assert_eq!(got.len(), full.len());
    for (k, t) in &full {
        assert_eq!(max_abs(&got[k], t)?, 0.0, "{k}");
    }
    // bf16: the correction bias stays f32 (its values as saved), the rest bf16
    let (b16, _) = load_hf(&dir, &Device::Cpu, DType::BF16)?;
    let b16 = candle_cp_llama::params::varmap_tensors(&b16)?;
    let key = format!("{p}gate.{CORRECTION_BIAS}");
    assert_eq!((b16[&key].dtype(), b16[&format!("{p}gate.weight")].dtype()), (DType::F32, DType::BF16));
    assert_eq!(max_abs(&b16[&key], &full[&key])?, 0.0);
    // a multi-token-prediction layer after the last one (layer 2 of 2): skipped, as transformers does
    let mtp = tmp("mtp");
    std::fs::create_dir_all(&mtp).map_err(io)?;
    names.insert("model.layers.2.eh_proj.weight".into(), Tensor::zeros((h, 2 * h), DType::F32, &Device::Cpu)?);
    names.insert("model.layers.2.mlp.gate.weight".into(), Tensor::zeros((e, h), DType::F32, &Device::Cpu)?);
    candle_core::safetensors::save(&names, mtp.join("model.safetensors"))?;
    std::fs::copy(dir.join("config.json"), mtp.join("config.json")).map_err(io)?;
    let (back, _) = load_hf(&mtp, &Device::Cpu, DType::F32)?;
    assert_eq!(candle_cp_llama::params::varmap_tensors(&back)?.len(), full.len());
    let bytes = std::fs::read(dir.join("model.safetensors")).map_err(io)?;
    for layout in [Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_ep(2)] {
        let out = tmp(&format!("sharded-{}", layout.world_size()));
        sharded_load_and_save(&mtp, &full, &cfg, layout, &out, &bytes)?;
        let _ = std::fs::remove_dir_all(&out);
    }
    for d in [dir, mtp] {
        let _ = std::fs::remove_dir_all(d);
    }
    Ok(())
}
