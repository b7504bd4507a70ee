//! GraniteMoE (`model_type` `granitemoe`): Granite's multipliers over a mixture of experts on
//! every layer, its checkpoints' fused experts.
//!
//! - The tiny-llama weights as GraniteMoE (both layers 8 experts, 2 per token, 48 wide; the
//!   multipliers 3, 1/8, 0.5 and 4; the load-balancing loss at 0.5) against the float64
//!   reference (`dense_llama.rs`, routing by the softmax of the top-K logits as
//!   `GraniteMoeTopKGating`, the routing far from a tie): one device, ring, zigzag, striped,
//!   Ulysses, 2-D, TP with and without SP, TP × CP, DP, recomputed layers and expert
//!   parallelism (over all or part of the CP group, with TP + SP, across DP replicas): logits,
//!   loss and every gradient within the oracle's tolerances. The multipliers and the
//!   load-balancing loss each bind.
//! - Generation: cached decoding equals the full forward; CP, TP and EP decode the single
//!   device's tokens.
//! - Checkpoints: written as GraniteMoE's (`block_sparse_moe.router.layer.weight`,
//!   `input_linear.weight` `[E, 2·I, h]` gate rows then up rows, `output_linear.weight`), a
//!   file built by hand in that layout reads to the same model, whole, over TP 2 and over EP 2;
//!   the sharded writer writes save_hf's bytes; a per-expert (Mixtral) checkpoint under a
//!   GraniteMoE config is refused by name.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{compare, load_reference, run_layout_recompute, Tolerances};
use candle_cp_llama::{load_hf, save_hf, Arch, Granite, MoeStyle};
use candle_cp_tests::dense_llama::{cached_generation_agrees, max_abs, reference, reference_routed, reference_rows, sharded_load_and_save};
use candle_cp_tests::moe_model::moe_model;
use std::collections::HashMap;

const T: usize = 64;

fn ids(t: usize) -> Result<Tensor> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, t)?.contiguous()
}

fn io<E: std::fmt::Display>(e: E) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Every kind of layout, DP, recomputed layers and expert parallelism give the reference's
/// results; each multiplier and the load-balancing loss move them.
#[test]
fn granite_moe_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full) = moe_model(MoeStyle::GraniteMoe, Some(0.5))?;
    assert_eq!((cfg.arch(), cfg.moe_layers()), (Arch::GraniteMoe, 2));
    let ids = ids(T)?;
    let (want, margin) = reference_routed(&full, &cfg, &ids)?;
    println!("granitemoe: smallest top-2 margin of the router probabilities: {margin:.2e}");
    assert!(margin > 1e-5, "a near tie in the routing ({margin:.1e}): float32 could route otherwise");
    // each multiplier, and the load-balancing loss, binds
    let g = cfg.granite.clone().unwrap_or_default();
    let r = "model.layers.0.block_sparse_moe.gate.weight";
    for (what, other) in [
        ("embedding_multiplier", cfg.clone().with_granite(Some(Granite { embedding_multiplier: 1.0, ..g.clone() }))),
        ("attention_multiplier", cfg.clone().with_granite(Some(Granite { attention_multiplier: 0.5, ..g.clone() }))),
        ("residual_multiplier", cfg.clone().with_granite(Some(Granite { residual_multiplier: 1.0, ..g.clone() }))),
        ("logits_scaling", cfg.clone().with_granite(Some(Granite { logits_scaling: 1.0, ..g.clone() }))),
        ("router_aux_loss_coef", moe_model(MoeStyle::GraniteMoe, None)?.0),
    ] {
        let o = reference(&full, &other, &ids)?;
        let moved = max_abs(&o.logits, &want.logits)?.max(max_abs(&o.grads[r], &want.grads[r])? / max_abs(&want.grads[r], &want.grads[r].zeros_like()?)?);
        assert!(moved > 0.05, "{what} moves the logits and the router's gradient by only {moved:.1e}");
    }
    let experts = |k: &str| k.contains("block_sparse_moe.");
    let layouts = [
        (Layout::single(), false),
        (Layout::cp(CpKind::Ring, 4), false),
        (Layout::cp(CpKind::Zigzag, 4), false),
        (Layout::cp(CpKind::Striped, 2), false),
        (Layout::cp(CpKind::Ulysses, 2), false),
        (Layout::two_d(2, 2), false),
        (Layout::single().with_tp(2, false), false),
        (Layout::single().with_tp(4, true), false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true),
        (Layout::cp(CpKind::Zigzag, 4).with_ep(4), false),
        (Layout::cp(CpKind::AllGather, 2).with_tp(2, false).with_ep(2), false),
        (Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2), true),
    ];
    let two = Tensor::cat(&[&ids, &ids], 0)?;
    let rows_want = reference_rows(&want)?;
    let dp = [(Layout::cp(CpKind::Ring, 2).with_dp(2), false), (Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_ep(2), true)];
    for (layout, recompute, input, want) in layouts.iter().map(|&(l, r)| (l, r, &ids, &want)).chain(dp.iter().map(|&(l, r)| (l, r, &two, &rows_want))) {
        let rep = compare(&run_layout_recompute(&full, &cfg, input, layout, &Device::Cpu, recompute)?, want, Tolerances::default())?;
        println!("granitemoe {layout} (recompute {recompute}): logits {:.1e} loss {:.1e} grad rel {:.1e} ({})", rep.logits_abs, rep.loss_abs, rep.grad_rel_max, rep.worst_param);
        assert_eq!(rep.grad_rel.len(), want.grads.len(), "{layout}: every parameter compared");
        assert_eq!(rep.grad_rel.iter().filter(|(k, _)| experts(k)).count(), 4 * 2, "{layout}: the routers and the experts");
        assert!(rep.pass(), "granitemoe {layout}: {rep:?}");
    }
    Ok(())
}

/// Cached decoding equals the full forward; CP, TP and EP decode the single device's tokens.
#[test]
fn granite_moe_generation() -> Result<()> {
    let (cfg, full) = moe_model(MoeStyle::GraniteMoe, None)?;
    let layouts = [Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true), Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2)];
    cached_generation_agrees(&cfg, &full, &ids(32)?, &layouts)
}

/// Checkpoints in GraniteMoE's layout: written, read back bit for bit, built by hand and read
/// the same (whole, TP 2, EP 2), the sharded writer's bytes; per-expert tensors refused.
#[test]
fn granite_moe_checkpoints() -> Result<()> {
    let (cfg, full) = moe_model(MoeStyle::GraniteMoe, None)?;
    let (e, i, h) = (8usize, 48usize, cfg.hidden_size);
    let tmp = |tag: &str| std::env::temp_dir().join(format!("candle-cp-granite-moe-{tag}-{}", std::process::id()));
    let dir = tmp("saved");
    save_hf(&dir, &candle_cp_tests::varmap_of(&full)?, &cfg)?;
    let names = load_safetensors_dir(&dir, &Device::Cpu)?;
    let p = "model.layers.1.block_sparse_moe.";
    for (k, shape) in [("router.layer.weight", vec![e, h]), ("input_linear.weight", vec![e, 2 * i, h]), ("output_linear.weight", vec![e, h, i])] {
        assert_eq!(names.get(&format!("{p}{k}")).map(|t| t.dims().to_vec()), Some(shape), "{k}");
    }
    assert!(!names.keys().any(|k| k.contains(".experts.") || k.contains(".gate.weight")), "only GraniteMoE's names");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).map_err(io)?).map_err(io)?;
    assert_eq!((config["architectures"][0].as_str(), config["residual_multiplier"].as_f64()), (Some("GraniteMoeForCausalLM"), Some(0.5)));
    // by hand: the router under its name, gate rows then up rows, the down projections whole
    let hand_dir = tmp("by-hand");
    std::fs::create_dir_all(&hand_dir).map_err(io)?;
    let mut hand: HashMap<String, Tensor> = HashMap::new();
    for (k, t) in &full {
        if let Some(q) = k.strip_suffix("block_sparse_moe.gate.weight") {
            hand.insert(format!("{q}block_sparse_moe.router.layer.weight"), t.clone());
        } else if let Some(q) = k.strip_suffix("block_sparse_moe.experts.gate_proj") {
            hand.insert(format!("{q}block_sparse_moe.input_linear.weight"), Tensor::cat(&[t, &full[&format!("{q}block_sparse_moe.experts.up_proj")]], 1)?);
        } else if let Some(q) = k.strip_suffix("block_sparse_moe.experts.down_proj") {
            hand.insert(format!("{q}block_sparse_moe.output_linear.weight"), t.clone());
        } else if !k.ends_with("experts.up_proj") {
            hand.insert(k.clone(), t.clone());
        }
    }
    candle_core::safetensors::save(&hand, hand_dir.join("model.safetensors"))?;
    std::fs::copy(dir.join("config.json"), hand_dir.join("config.json")).map_err(io)?;
    for d in [&dir, &hand_dir] {
        let (back, back_cfg) = load_hf(d, &Device::Cpu, DType::F32)?;
        assert_eq!(back_cfg, cfg);
        let got = candle_cp_llama::params::varmap_tensors(&back)?;
        assert_eq!(got.len(), full.len());
        for (k, t) in &full {
            assert_eq!(max_abs(&got[k], t)?, 0.0, "{}: {k}", d.display());
        }
    }
    let bytes = std::fs::read(dir.join("model.safetensors")).map_err(io)?;
    for layout in [Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_ep(2)] {
        let out = tmp(&format!("sharded-{}", layout.world_size()));
        sharded_load_and_save(&hand_dir, &full, &cfg, layout, &out, &bytes)?;
        let _ = std::fs::remove_dir_all(&out);
    }
    // Mixtral's per-expert names under a GraniteMoE config: refused by name
    let mixtral_dir = tmp("per-expert");
    std::fs::create_dir_all(&mixtral_dir).map_err(io)?;
    let mut per_expert = hand.clone();
    per_expert.insert("model.layers.0.block_sparse_moe.experts.0.w1.weight".into(), Tensor::zeros((i, h), DType::F32, &Device::Cpu)?);
    candle_core::safetensors::save(&per_expert, mixtral_dir.join("model.safetensors"))?;
    std::fs::copy(dir.join("config.json"), mixtral_dir.join("config.json")).map_err(io)?;
    let err = load_hf(&mixtral_dir, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("experts.0.w1.weight") && err.contains("GraniteMoeForCausalLM"), "{err}");
    for d in [dir, hand_dir, mixtral_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
    Ok(())
}
