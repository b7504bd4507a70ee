//! Two Llamas with a difference each:
//!
//! - SmolLM3 (`model_type` `smollm3`): NoPE layers attend without RoPE
//!   (`LlamaConfig::nope_layers`, every fourth layer in the released model); here the tiny-llama
//!   weights with layer 1 NoPE, and a window on that layer (`use_sliding_window`: transformers'
//!   `layer_types`).
//! - Granite (`model_type` `granite`): embedding, attention, residual and logit multipliers
//!   (`LlamaConfig::granite`; the tests' values: `multipliers()`), each of which moves the logits.
//!
//! Each on every kind of layout — ring, zigzag, striped, Ulysses, 2-D, TP with and without SP,
//! TP × CP, DP — gives the float64 reference's logits, loss and every gradient (`dense_llama.rs`)
//! within the oracle's tolerances; cached decode equals the full forward and CP / TP decode the
//! same tokens; a checkpoint saves as `SmolLM3ForCausalLM` (its `no_rope_layers`) /
//! `GraniteForCausalLM` (its multipliers) and loads back as the same config and weights.

use candle_core::{Device, Result, Tensor};
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{load_reference, Reference, Tolerances};
use candle_cp_llama::{load_hf, save_hf, Arch, Granite, LlamaConfig};
use candle_cp_tests::dense_llama::{max_abs, on_layouts, reference};
use std::collections::HashMap;

const T: usize = 256;

/// The oracle's weights and config as `f` makes it; its input ids.
fn oracle(f: impl Fn(LlamaConfig) -> LlamaConfig) -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    let cfg = f(LlamaConfig::from_file(dir.join("config.json"))?);
    cfg.validate()?;
    let ids = load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, T)?.contiguous()?;
    Ok((cfg, load_safetensors_dir(&dir, &Device::Cpu)?, ids))
}

/// The oracle with layer 1 NoPE (SmolLM3).
fn smollm3() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    oracle(|c| c.with_nope_layers(Some(vec![false, true])))
}

/// Granite's multipliers for the tiny model (granite-3.x's: 12, 1/128 on head dim 128, 0.22, 16;
/// here milder, so that each one moves the tiny model's logits): the embedding times 3, the
/// softmax scale 1/8 on head dim 16 (against 16^-1/2), each branch times 0.5, the logits / 4.
fn multipliers() -> Granite {
    Granite { embedding_multiplier: 3.0, attention_multiplier: 0.125, residual_multiplier: 0.5, logits_scaling: 4.0 }
}

/// The oracle as Granite.
fn granite() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    oracle(|c| c.with_granite(Some(multipliers())))
}

/// `label`'s model on every kind of layout, and DP on two rows, against `want`.
fn on_every_layout(label: &str, full: &HashMap<String, Tensor>, cfg: &LlamaConfig, ids: &Tensor, want: &Reference) -> Result<()> {
    let nothing = |_: &str| false;
    candle_cp_tests::dense_llama::on_every_layout(label, (full, cfg, ids, want), &[], (&nothing, 0))
}

/// A checkpoint of `(cfg, full)` names `class` and `key` in its config.json and reads back as
/// the same config and weights.
fn round_trips(cfg: &LlamaConfig, full: &HashMap<String, Tensor>, class: &str, key: &str) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("candle-cp-{class}-{}", std::process::id()));
    let vm = candle_nn::VarMap::new();
    for (k, t) in full {
        vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.insert(k.clone(), candle_core::Var::from_tensor(t)?);
    }
    save_hf(&dir, &vm, cfg)?;
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    assert!(text.contains(class) && text.contains(key), "{text}");
    let (back, bcfg) = load_hf(&dir, &Device::Cpu, candle_core::DType::F32)?;
    assert_eq!(&bcfg, cfg);
    for (k, t) in full {
        let got = back.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.get(k).map(|v| v.as_tensor().clone());
        let Some(got) = got else { candle_core::bail!("{k} not loaded") };
        assert_eq!(max_abs(&got, t)?, 0.0, "{k}");
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// SmolLM3 on every kind of layout, and with a window on its NoPE layer: the reference.
#[test]
fn smollm3_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = smollm3()?;
    assert_eq!(cfg.arch(), Arch::SmolLM3);
    let want = reference(&full, &cfg, &ids)?;
    let llama = reference(&full, &cfg.clone().with_nope_layers(None), &ids)?;
    let moved = max_abs(&llama.logits, &want.logits)?;
    assert!(moved > 100.0 * Tolerances::default().logits_abs, "the NoPE layer moves the logits by only {moved:.1e}");
    on_every_layout("smollm3", &full, &cfg, &ids, &want)?;
    // a window on the NoPE layer (transformers' layout with use_sliding_window)
    let w = cfg.clone().with_sliding_window(Some(40)).with_sliding_layers(Some(vec![false, true]));
    w.validate()?;
    let want = reference(&full, &w, &ids)?;
    let nothing = |_: &str| false;
    on_layouts("smollm3 window 40 on layer 1", (&full, &w, &ids, &want), &[Layout::cp(CpKind::Zigzag, 4), Layout::cp(CpKind::Ulysses, 2).with_tp(2, true)], (&nothing, 0))
}

/// Granite on every kind of layout: the reference; each multiplier binds.
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
    on_every_layout("granite", &full, &cfg, &ids, &want)
}

/// Cached decoding equals the full forward; CP and TP decode the same tokens.
#[test]
fn smollm3_and_granite_generation() -> Result<()> {
    for (cfg, full, ids) in [smollm3()?, granite()?] {
        let ids = ids.narrow(1, 0, 32)?.contiguous()?;
        candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(4, false)])?;
    }
    Ok(())
}

/// Checkpoints: `SmolLM3ForCausalLM` with its `no_rope_layers`, `GraniteForCausalLM` with its
/// multipliers.
#[test]
fn smollm3_and_granite_checkpoints_round_trip() -> Result<()> {
    let (cfg, full, _) = smollm3()?;
    round_trips(&cfg, &full, "SmolLM3ForCausalLM", "no_rope_layers")?;
    let (cfg, full, _) = granite()?;
    round_trips(&cfg, &full, "GraniteForCausalLM", "residual_multiplier")
}

/// Granite's `Llama::hidden` is the final norm's output, as for every model (the logits'
/// division is the head's): its logits are `hidden · lm_headᵀ / logits_scaling`.
#[test]
fn granite_hidden_states_are_the_final_norms() -> Result<()> {
    let (cfg, full, ids) = granite()?;
    let ids = ids.narrow(1, 0, 16)?.contiguous()?;
    let pos = Tensor::arange(0u32, 16, &Device::Cpu)?;
    let mut out = candle_cp_comm::run_ranks(1, |g| {
        let ctx = candle_cp_llama::ParallelCtx::new(g, Layout::single())?;
        let model = candle_cp_llama::Llama::new(candle_nn::VarBuilder::from_tensors(full.clone(), candle_core::DType::F32, &Device::Cpu), &cfg, &ctx)?;
        let h = model.hidden(&ids, &pos)?;
        let want = (h.broadcast_matmul(&full["lm_head.weight"].t()?)? / multipliers().logits_scaling)?;
        max_abs(&model.forward(&ids, &pos)?, &want)
    });
    let d = out.pop().unwrap_or_else(|| candle_core::bail!("no rank"))?;
    assert!(d < 1e-5, "logits vs hidden · lm_headᵀ / logits_scaling: {d}");
    Ok(())
}
