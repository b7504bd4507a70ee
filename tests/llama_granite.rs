//! Granite (`model_type` `granite`): a Llama with embedding, attention, residual and logit
//! multipliers (`LlamaConfig::granite`; the tests' values: `multipliers()`).
//!
//! - The tiny-llama weights with Granite's multipliers on every kind of layout — ring,
//!   zigzag, striped, Ulysses, 2-D, TP with and without SP, TP × CP, DP — give the float64
//!   reference's logits, loss and every gradient (`dense_llama.rs`) within the oracle's
//!   tolerances; each multiplier moves the logits from the Llama's.
//! - Generation: cached decode equals the full forward, and CP / TP decode the same tokens.
//! - A checkpoint saves as `GraniteForCausalLM` (its multipliers) and loads back as the same
//!   config.

use candle_core::{Device, Result, Tensor};
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{load_reference, Tolerances};
use candle_cp_llama::{Arch, Granite, LlamaConfig};
use candle_cp_tests::dense_llama::{max_abs, on_layouts, reference, reference_rows};
use std::collections::HashMap;

const T: usize = 256;

/// Granite's multipliers for the tiny model (granite-3.x's: 12, 1/128 on head dim 128, 0.22, 16;
/// here milder, so that each one moves the tiny model's logits): the embedding times 3, the
/// softmax scale 1/8 on head dim 16 (against 16^-1/2), each branch times 0.5, the logits / 4.
fn multipliers() -> Granite {
    Granite { embedding_multiplier: 3.0, attention_multiplier: 0.125, residual_multiplier: 0.5, logits_scaling: 4.0 }
}

/// The oracle's weights and config as Granite; its input ids.
fn granite() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?.with_granite(Some(multipliers()));
    cfg.validate()?;
    let ids = load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, T)?.contiguous()?;
    Ok((cfg, load_safetensors_dir(&dir, &Device::Cpu)?, ids))
}

/// Every kind of layout gives the reference's results; each multiplier binds.
#[test]
fn granite_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = granite()?;
    assert_eq!(cfg.arch(), Arch::Granite);
    let want = reference(&full, &cfg, &ids)?;
    let g = multipliers();
    for (what, one) in [
        ("embedding_multiplier", Granite { embedding_multiplier: 1.0, ..g.clone() }),
        ("attention_multiplier", Granite { attention_multiplier: 0.5, ..g.clone() }),
        ("residual_multiplier", Granite { residual_multiplier: 1.0, ..g.clone() }),
        ("logits_scaling", Granite { logits_scaling: 1.0, ..g.clone() }),
    ] {
        let other = reference(&full, &cfg.clone().with_granite(Some(one)), &ids)?;
        let moved = max_abs(&other.logits, &want.logits)?;
        assert!(moved > 100.0 * Tolerances::default().logits_abs, "{what} moves the logits by only {moved:.1e}");
    }
    let layouts = [
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Striped, 2),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(2, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
    ];
    let nothing = |_: &str| false;
    let none: (&dyn Fn(&str) -> bool, usize) = (&nothing, 0);
    on_layouts("granite", (&full, &cfg, &ids, &want), &layouts, none)?;
    on_layouts("granite", (&full, &cfg, &Tensor::cat(&[&ids, &ids], 0)?, &reference_rows(&want)?), &[Layout::cp(CpKind::Ring, 2).with_dp(2)], none)
}

/// Cached decoding equals the full forward; CP and TP decode the same tokens.
#[test]
fn granite_generation() -> Result<()> {
    let (cfg, full, ids) = granite()?;
    let ids = ids.narrow(1, 0, 32)?.contiguous()?;
    candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(4, false)])
}

/// A Granite checkpoint: `GraniteForCausalLM` with its multipliers, read back as the same config.
#[test]
fn granite_checkpoint_round_trips() -> Result<()> {
    let (cfg, full, _) = granite()?;
    let dir = std::env::temp_dir().join(format!("candle-cp-granite-{}", std::process::id()));
    let vm = candle_nn::VarMap::new();
    for (k, t) in &full {
        vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.insert(k.clone(), candle_core::Var::from_tensor(t)?);
    }
    candle_cp_llama::save_hf(&dir, &vm, &cfg)?;
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    assert!(text.contains("GraniteForCausalLM") && text.contains("residual_multiplier"), "{text}");
    let (_, back) = candle_cp_llama::load_hf(&dir, &Device::Cpu, candle_core::DType::F32)?;
    assert_eq!(back, cfg);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
