//! SmolLM3 (`model_type` `smollm3`): a Llama whose NoPE layers attend without RoPE
//! (`LlamaConfig::nope_layers`, every fourth layer in the released model).
//!
//! - The tiny-llama weights with layer 1 NoPE on every kind of layout — ring, zigzag, striped,
//!   Ulysses, 2-D, TP with and without SP, TP × CP, DP, packed documents — give the float64
//!   reference's logits, loss and every gradient (`dense_llama.rs`: no rotation on a NoPE
//!   layer) within the oracle's tolerances; the NoPE layer moves them from the Llama's.
//! - A window on the NoPE layer (`use_sliding_window`: transformers' `layer_types`) on layouts.
//! - Generation: cached decode equals the full forward, and CP / TP decode the same tokens.
//! - A checkpoint saves as `SmolLM3ForCausalLM` (its `no_rope_layers`) and loads back bit for
//!   bit, whole and sharded over TP 2.

use candle_core::{Device, Result, Tensor};
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{load_reference, Tolerances};
use candle_cp_llama::{load_hf, save_hf, Arch, LlamaConfig};
use candle_cp_tests::dense_llama::{max_abs, on_layouts, reference, reference_rows};
use std::collections::HashMap;

const T: usize = 256;

/// The oracle's weights and config with layer 1 NoPE; its input ids.
fn smollm3() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?.with_nope_layers(Some(vec![false, true]));
    cfg.validate()?;
    let ids = load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, T)?.contiguous()?;
    Ok((cfg, load_safetensors_dir(&dir, &Device::Cpu)?, ids))
}

/// Every kind of layout gives the reference's results (see the module doc).
#[test]
fn smollm3_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = smollm3()?;
    assert_eq!(cfg.arch(), Arch::SmolLM3);
    let want = reference(&full, &cfg, &ids)?;
    let llama = reference(&full, &cfg.clone().with_nope_layers(None), &ids)?;
    let moved = max_abs(&llama.logits, &want.logits)?;
    assert!(moved > 100.0 * Tolerances::default().logits_abs, "the NoPE layer moves the logits by only {moved:.1e}");
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
    on_layouts("smollm3", (&full, &cfg, &ids, &want), &layouts, none)?;
    on_layouts("smollm3", (&full, &cfg, &Tensor::cat(&[&ids, &ids], 0)?, &reference_rows(&want)?), &[Layout::cp(CpKind::Ring, 2).with_dp(2)], none)?;
    // a window on the NoPE layer (transformers' layout with use_sliding_window)
    let w = cfg.clone().with_sliding_window(Some(40)).with_sliding_layers(Some(vec![false, true]));
    w.validate()?;
    let want = reference(&full, &w, &ids)?;
    on_layouts("smollm3 window 40 on layer 1", (&full, &w, &ids, &want), &[Layout::cp(CpKind::Zigzag, 4), Layout::cp(CpKind::Ulysses, 2).with_tp(2, true)], none)
}

/// Cached decoding equals the full forward; CP and TP decode the same tokens.
#[test]
fn smollm3_generation() -> Result<()> {
    let (cfg, full, ids) = smollm3()?;
    let ids = ids.narrow(1, 0, 32)?.contiguous()?;
    candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(4, false)])
}

/// A SmolLM3 checkpoint: `SmolLM3ForCausalLM` with its `no_rope_layers`, read back as the same
/// config and weights.
#[test]
fn smollm3_checkpoint_round_trips() -> Result<()> {
    let (cfg, full, _) = smollm3()?;
    let dir = std::env::temp_dir().join(format!("candle-cp-smollm3-{}", std::process::id()));
    let vm = candle_nn::VarMap::new();
    for (k, t) in &full {
        vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.insert(k.clone(), candle_core::Var::from_tensor(t)?);
    }
    save_hf(&dir, &vm, &cfg)?;
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    assert!(text.contains("SmolLM3ForCausalLM") && text.contains("no_rope_layers"), "{text}");
    let (back, bcfg) = load_hf(&dir, &Device::Cpu, candle_core::DType::F32)?;
    assert_eq!(bcfg, cfg);
    for (k, t) in &full {
        let got = back.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.get(k).map(|v| v.as_tensor().clone());
        let Some(got) = got else { candle_core::bail!("{k} not loaded") };
        assert_eq!(max_abs(&got, t)?, 0.0, "{k}");
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
