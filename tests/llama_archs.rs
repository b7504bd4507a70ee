//! The architectures beside Llama: Qwen2 (biases on the q, k, v projections,
//! `LlamaConfig::qkv_bias`, `model_type` `qwen2`), Qwen3 (RMSNorms over each q and k head
//! before RoPE, `LlamaConfig::qk_norm`, `model_type` `qwen3`) and Gemma 3 (`gemma3_text`,
//! `LlamaConfig::gemma3`).
//!
//! - A plain-candle float64 reference of the whole model (`dense_llama.rs`: embedding,
//!   RMSNorm, biased projections, RoPE by `rotate_half`, dense causal softmax attention with
//!   GQA, SwiGLU, head, next-token cross-entropy; autograd for every gradient) first reproduces the PyTorch
//!   oracle (`tests/data/oracle/tiny-llama`, no biases) within its tolerances, so it is a
//!   reference; with random biases added it is the Qwen2 reference.
//! - The tiny-llama weights plus seeded biases (std 0.5, so they move the logits) on every
//!   kind of layout — one device, ring, zigzag, Ulysses with replicated KV heads, 2-D, TP with
//!   SP, TP 4 replicating the 2 KV heads (and their biases), TP × CP, DP — give the
//!   reference's logits, loss and every gradient, the biases' included, within the oracle's
//!   float32 tolerances.
//! - Qwen3: the same weights with seeded q / k norm weights (1 ± 0.5) on every kind of layout,
//!   TP with and without SP among them (the norms' gradients are partial on each TP rank:
//!   summed over TP in the backward without SP, by `reduce_gradients` with it; with the KV
//!   heads replicated over TP 4, each copy's share), against the reference.
//! - YaRN (Qwen2.5's 128k RoPE scaling), its ramp acting at this length: every kind of layout
//!   gives the reference's results.
//! - Windows on some layers only (Qwen's `max_window_layers` / `layer_types`,
//!   `LlamaConfig::sliding_layers`), either layer windowed: every kind of layout gives the
//!   reference's results (the reference masks each layer by `LlamaConfig::layer_window`).
//! - Generation: cached decode equals the full forward, and CP / TP layouts decode the
//!   single device's tokens (per-layer windows too: the windowed layer's cache evicts, the
//!   other's keeps every row).
//! - Gemma 3: the tiny-llama weights with seeded norm weights (all entering as `1 + w`), the
//!   two extra norms per layer, a tied head, a window on the first layer only (local RoPE
//!   base 10000 there, the global one scaled linearly by 4), `query_pre_attn_scalar` 24 on
//!   `D` = 16: every kind of layout gives the reference's results; cached generation equals the
//!   full forward and CP / TP decode the same tokens.
//! - Checkpoints: a Qwen2, a Qwen3 and a Gemma 3 checkpoint save as `Qwen2ForCausalLM` /
//!   `Qwen3ForCausalLM` / `Gemma3ForCausalLM` and load back bit for bit, whole or sharded over
//!   TP 1, 2, 4; their biases / head norms under a config without them are refused, naming
//!   the tensors (before: loaded and ignored, a silently different model).

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_tests::dense_llama::{max_abs, on_layouts, reference, reference_rows};
use candle_cp_comm::run_ranks;
use candle_cp_llama::hf::{load_safetensors_dir, save_hf_tensors};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{compare, load_reference, run_layout, Reference, Tolerances};
use candle_cp_llama::{load_hf, load_hf_sharded, save_hf, shard_tensors, LlamaConfig, ParallelCtx};
use std::collections::HashMap;

const T: usize = 256;

fn oracle() -> Result<(LlamaConfig, HashMap<String, Tensor>, Reference)> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    Ok((
        LlamaConfig::from_file(dir.join("config.json"))?,
        load_safetensors_dir(&dir, &Device::Cpu)?,
        load_reference(dir.join("reference.safetensors"))?,
    ))
}

/// The oracle's weights with seeded q, k, v biases of std `std`, and the config with them.
fn qwen2(std: f64) -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let (cfg, mut full, _) = oracle()?;
    let cfg = cfg.with_qkv_bias(true);
    for spec in candle_cp_llama::param_specs(&cfg) {
        if spec.name.ends_with(".bias") {
            let b = (candle_cp_tests::rand_t(17, &spec.name, &spec.shape)? * std)?;
            full.insert(spec.name.clone(), b);
        }
    }
    Ok((cfg, full))
}

/// The oracle's weights with seeded q / k norm weights `1 + 0.5·u`, `u` in [-1, 1), and the
/// config with them (Qwen3).
fn qwen3() -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let (cfg, mut full, _) = oracle()?;
    let cfg = cfg.with_qk_norm(true);
    for spec in candle_cp_llama::param_specs(&cfg) {
        if spec.name.contains("_norm.weight") && spec.name.contains("self_attn") {
            full.insert(spec.name.clone(), ((candle_cp_tests::rand_t(23, &spec.name, &spec.shape)? * 0.5)? + 1.0)?);
        }
    }
    Ok((cfg, full))
}

/// The oracle's weights as a Gemma 3 model (see the module doc): every 1-D weight redrawn as
/// `0.3·u` (a Gemma norm multiplies by `1 + w`), the extra norms drawn alike, the head tied.
fn gemma3() -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let (cfg, mut full, _) = oracle()?;
    let mut cfg = cfg.with_gemma3(true).with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false]));
    cfg.rope_scaling = candle_cp_llama::RopeScaling::Linear { factor: 4.0 };
    if let Some(g) = cfg.gemma3.as_mut() {
        g.query_pre_attn_scalar = 24.0;
    }
    cfg.validate()?;
    full.remove("lm_head.weight");
    for spec in candle_cp_llama::param_specs(&cfg) {
        if spec.shape.len() == 1 {
            full.insert(spec.name.clone(), (candle_cp_tests::rand_t(29, &spec.name, &spec.shape)? * 0.3)?);
        }
    }
    Ok((cfg, full))
}

/// The attention soft cap of [`gemma2`]: the tiny model's attention logits are small.
const ATTN_CAP: f64 = 0.1;

/// The oracle's weights as a Gemma 2 model: as [`gemma3`] without the head norms, a window
/// on layer 0, soft caps small enough to bind on these logits (attention [`ATTN_CAP`],
/// output 0.5).
fn gemma2() -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let (cfg, mut full, _) = oracle()?;
    let mut cfg = cfg.with_gemma2(true).with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false]));
    if let Some(g) = cfg.gemma2.as_mut() {
        g.query_pre_attn_scalar = 24.0;
        g.attn_logit_softcapping = Some(ATTN_CAP);
        g.final_logit_softcapping = Some(0.5);
    }
    cfg.validate()?;
    full.remove("lm_head.weight");
    for spec in candle_cp_llama::param_specs(&cfg) {
        if spec.shape.len() == 1 {
            full.insert(spec.name.clone(), (candle_cp_tests::rand_t(31, &spec.name, &spec.shape)? * 0.3)?);
        }
    }
    Ok((cfg, full))
}

/// Gemma 2 (its logit soft caps inside attention and on the output) on every kind of layout,
/// TP with and without SP, and DP: the reference; the caps bind (without them the reference's
/// loss moves).
#[test]
fn gemma2_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full) = gemma2()?;
    let ids = oracle()?.2.input_ids.narrow(1, 0, T)?.contiguous()?;
    let want = reference(&full, &cfg, &ids)?;
    for (which, off) in [("attention", (None, Some(0.5))), ("output", (Some(ATTN_CAP), None))] {
        let mut plain = cfg.clone();
        if let Some(g) = plain.gemma2.as_mut() {
            (g.attn_logit_softcapping, g.final_logit_softcapping) = off;
        }
        let other = reference(&full, &plain, &ids)?;
        // the query projection's gradient (attention) and the loss (output) move without it
        let q = "model.layers.0.self_attn.q_proj.weight";
        let rel = max_abs(&other.grads[q], &want.grads[q])? / max_abs(&want.grads[q], &want.grads[q].zeros_like()?)?;
        let e = (other.loss - want.loss).abs();
        assert!(if which == "attention" { rel > 0.05 } else { e > 1e-3 }, "the {which} cap does not bind: without it dq_proj moves {rel:.1e} (relative), the loss {e:.1e}");
    }
    let layouts = [
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::AllGather, 2),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
    ];
    let extra = |k: &str| k.ends_with("feedforward_layernorm.weight");
    on_layouts("gemma2", (&full, &cfg, &ids, &want), &layouts, (&extra, 2 * cfg.num_hidden_layers))?;
    on_layouts("gemma2", (&full, &cfg, &Tensor::cat(&[&ids, &ids], 0)?, &reference_rows(&want)?), &[Layout::cp(CpKind::Ring, 2).with_dp(2)], (&extra, 2 * cfg.num_hidden_layers))
}

/// Cached decoding of Gemma 2 (capped logits) equals its full forward; CP and TP decode the
/// same tokens.
#[test]
fn gemma2_generation() -> Result<()> {
    let (cfg, full) = gemma2()?;
    generation((cfg.with_sliding_window(Some(12)), full))
}

/// Gemma 3 on every kind of layout, TP with and without SP, and DP: the reference.
#[test]
fn gemma3_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full) = gemma3()?;
    let ids = oracle()?.2.input_ids.narrow(1, 0, T)?.contiguous()?;
    let want = reference(&full, &cfg, &ids)?;
    let layouts = [
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(2, true),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
    ];
    let extra = |k: &str| k.ends_with("feedforward_layernorm.weight");
    on_layouts("gemma3", (&full, &cfg, &ids, &want), &layouts, (&extra, 2 * cfg.num_hidden_layers))?;
    on_layouts("gemma3", (&full, &cfg, &Tensor::cat(&[&ids, &ids], 0)?, &reference_rows(&want)?), &[Layout::cp(CpKind::Ring, 2).with_dp(2)], (&extra, 2 * cfg.num_hidden_layers))
}

/// Cached decoding of Gemma 3 equals its full forward; CP and TP decode the same tokens.
#[test]
fn gemma3_generation() -> Result<()> {
    let (cfg, full) = gemma3()?;
    // a window of 12 on the first layer binds within the 32 + 6 tokens
    generation((cfg.with_sliding_window(Some(12)), full))
}

/// A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`: the text model's
/// config under `text_config`, its tensors under `language_model.model.*` or, transformers
/// 4.52 on, `model.language_model.*`, beside a vision tower and projector): the text model
/// loads whole and sharded over TP 2 bit for bit as from its own checkpoint, and saves as
/// `Gemma3ForCausalLM`; a tensor of the text model it would not read is still refused
/// (`candle_cp_tests::multimodal`).
#[test]
fn gemma3_text_model_of_a_multimodal_checkpoint() -> Result<()> {
    let (cfg, full) = gemma3()?;
    let text: serde_json::Value = serde_json::from_str(&cfg.to_hf_json("float32")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let config = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8},
        "mm_tokens_per_image": 256,
    });
    candle_cp_tests::multimodal::text_model_loads(&cfg, &full, &config, ("Gemma3ForCausalLM", "gemma3_text"))
}

/// A Mistral 3 checkpoint (`Mistral3ForConditionalGeneration`, Mistral Small 3.1 / 3.2: a
/// Mistral text model under `text_config` beside a Pixtral vision tower, its head untied —
/// `language_model.lm_head.weight`, or transformers 4.52 on the top-level `lm_head.weight`): the
/// same as Gemma 3's, saved as `MistralForCausalLM`.
#[test]
fn mistral3_text_model_of_a_multimodal_checkpoint() -> Result<()> {
    let (cfg, full, _) = oracle()?;
    let cfg = cfg.with_sliding_window(Some(40));
    assert!(full.contains_key("lm_head.weight"), "an untied head");
    let mut text: serde_json::Value = serde_json::from_str(&cfg.to_hf_json("float32")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    // (Mistral Small 3.1's text_config names no architectures)
    text.as_object_mut().map(|t| t.remove("architectures"));
    let config = serde_json::json!({
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
        "text_config": text, "vision_config": {"model_type": "pixtral", "hidden_size": 8},
        "image_token_index": 10, "spatial_merge_size": 2, "projector_hidden_act": "gelu",
    });
    candle_cp_tests::multimodal::text_model_loads(&cfg, &full, &config, ("MistralForCausalLM", "mistral"))
}

/// The reference itself: the PyTorch oracle's logits, loss and gradients (no biases),
/// within the oracle README's tolerances. A planted fault (RoPE's halves not rotated) fails.
#[test]
fn the_reference_reproduces_the_oracle() -> Result<()> {
    let (cfg, full, want) = oracle()?;
    let got = reference(&full, &cfg, &want.input_ids)?;
    let tol = Tolerances::default();
    let logits = max_abs(&got.logits, &want.logits)?;
    let loss = (got.loss - want.loss).abs();
    let mut worst = 0f64;
    for (k, w) in &want.grads {
        let scale = w.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
        worst = worst.max(max_abs(&got.grads[k], w)? / scale);
    }
    println!("f64 reference vs oracle: logits {logits:.1e}, loss {loss:.1e}, grad rel {worst:.1e}");
    assert_eq!(got.grads.len(), want.grads.len());
    assert!(logits < tol.logits_abs && loss < tol.loss_abs && worst < tol.grad_rel, "{logits} {loss} {worst}");
    Ok(())
}

/// Every kind of layout with the biases: the f64 reference's logits, loss and gradients.
#[test]
fn qwen2_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full) = qwen2(0.5)?;
    let (_, _, o) = oracle()?;
    let ids = o.input_ids.narrow(1, 0, T)?.contiguous()?;
    let want = reference(&full, &cfg, &ids)?;
    // the biases matter: without them the logits move by far more than the tolerance
    let (plain_cfg, mut plain) = (cfg.clone().with_qkv_bias(false), full.clone());
    plain.retain(|k, _| !k.ends_with(".bias"));
    let moved = max_abs(&reference(&plain, &plain_cfg, &ids)?.logits, &want.logits)?;
    assert!(moved > 1e-2, "the biases moved the logits by only {moved:.1e}");
    let two_rows = Tensor::cat(&[&ids, &ids], 0)?;
    let two_ref = reference_rows(&want)?;
    let layouts = [
        Layout::single(),
        Layout::cp(CpKind::Ring, 2),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Ulysses, 4),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, true),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
    ];
    let biases = |k: &str| k.ends_with(".bias");
    on_layouts("qwen2", (&full, &cfg, &ids, &want), &layouts, (&biases, 3 * cfg.num_hidden_layers))?;
    on_layouts("qwen2", (&full, &cfg, &two_rows, &two_ref), &[Layout::cp(CpKind::Zigzag, 2).with_dp(2)], (&biases, 3 * cfg.num_hidden_layers))
}

/// Qwen3's head norms on every kind of layout, TP with and without SP: the reference.
#[test]
fn qwen3_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full) = qwen3()?;
    let ids = oracle()?.2.input_ids.narrow(1, 0, T)?.contiguous()?;
    let want = reference(&full, &cfg, &ids)?;
    let (plain_cfg, mut plain) = (cfg.clone().with_qk_norm(false), full.clone());
    plain.retain(|k, _| !(k.contains("self_attn") && k.contains("_norm")));
    let moved = max_abs(&reference(&plain, &plain_cfg, &ids)?.logits, &want.logits)?;
    assert!(moved > 100.0 * Tolerances::default().logits_abs, "the q / k norms moved the logits by only {moved:.1e}");
    let layouts = [
        Layout::single(),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::AllGather, 2),
        Layout::cp(CpKind::Ulysses, 4),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(2, true),
        Layout::single().with_tp(4, false),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Ring, 2).with_tp(2, false),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
    ];
    let head_norms = |k: &str| k.contains("_norm.weight") && k.contains("self_attn");
    on_layouts("qwen3", (&full, &cfg, &ids, &want), &layouts, (&head_norms, 2 * cfg.num_hidden_layers))?;
    let two = (&full, &cfg, &Tensor::cat(&[&ids, &ids], 0)?, &reference_rows(&want)?);
    on_layouts("qwen3", two, &[Layout::single().with_tp(2, false).with_dp(2)], (&head_norms, 2 * cfg.num_hidden_layers))
}

/// Qwen2 with YaRN (factor 4 over an original length of 64, so that the ramp and the
/// attention factor act at T = 256): every kind of layout gives the reference's results.
#[test]
fn qwen2_with_yarn_matches_the_reference() -> Result<()> {
    let (mut cfg, full) = qwen2(0.5)?;
    cfg.rope_scaling = candle_cp_llama::RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 64,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: None,
        mscale: None,
        mscale_all_dim: None,
        truncate: true,
    };
    let ids = oracle()?.2.input_ids.narrow(1, 0, T)?.contiguous()?;
    let want = reference(&full, &cfg, &ids)?;
    let plain = reference(&full, &qwen2(0.5)?.0, &ids)?;
    let moved = max_abs(&plain.logits, &want.logits)?;
    // (the model's logits must be within 1e-5 of the reference: a run without YaRN is not)
    assert!(moved > 100.0 * Tolerances::default().logits_abs, "YaRN moved the logits by only {moved:.1e}");
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 4), Layout::cp(CpKind::Ulysses, 2), Layout::cp(CpKind::Ring, 2).with_tp(2, true)] {
        let rep = compare(&run_layout(&full, &cfg, &ids, layout, &Device::Cpu)?, &want, Tolerances::default())?;
        println!("qwen2 + yarn {layout}: logits {:.1e} loss {:.1e} grad rel {:.1e}", rep.logits_abs, rep.loss_abs, rep.grad_rel_max);
        assert!(rep.pass(), "{layout}: {rep:?}");
    }
    Ok(())
}

/// Cached decoding with the biases (and with Qwen3's head norms) equals the full forward; CP and TP decode the same tokens.
#[test]
fn qwen2_and_qwen3_generation() -> Result<()> {
    generation(qwen2(0.5)?)?;
    generation(qwen3()?)?;
    // a window of 12 on the second layer only binds within the 32 + 6 tokens
    let (cfg, full) = qwen3()?;
    generation((cfg.with_sliding_window(Some(12)).with_sliding_layers(Some(vec![false, true])), full))
}

/// A window on one of the two layers (either one): every kind of layout gives the
/// reference's results, which differ from both the window on every layer and none.
#[test]
fn per_layer_windows_match_the_reference() -> Result<()> {
    let (cfg, full) = qwen3()?;
    let ids = oracle()?.2.input_ids.narrow(1, 0, T)?.contiguous()?;
    let w = cfg.clone().with_sliding_window(Some(40));
    let (every, none) = (reference(&full, &w, &ids)?, reference(&full, &cfg, &ids)?);
    for layers in [vec![false, true], vec![true, false]] {
        let cfg = w.clone().with_sliding_layers(Some(layers.clone()));
        cfg.validate()?;
        let want = reference(&full, &cfg, &ids)?;
        for (what, other) in [("every layer", &every), ("no layer", &none)] {
            let moved = max_abs(&other.logits, &want.logits)?;
            assert!(moved > 100.0 * Tolerances::default().logits_abs, "{layers:?} vs the window on {what}: {moved:.1e}");
        }
        let layouts = [
            Layout::single(),
            Layout::cp(CpKind::Ring, 4),
            Layout::cp(CpKind::Zigzag, 4),
            Layout::cp(CpKind::Ulysses, 2),
            Layout::two_d(2, 2),
            Layout::single().with_tp(2, true),
            Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
        ];
        on_layouts(&format!("window 40 on layers {layers:?}"), (&full, &cfg, &ids, &want), &layouts, (&|_: &str| false, 0))?;
    }
    Ok(())
}

fn generation((cfg, full): (LlamaConfig, HashMap<String, Tensor>)) -> Result<()> {
    let ids = oracle()?.2.input_ids.narrow(1, 0, 32)?.contiguous()?;
    candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(4, false)])
}

/// A Qwen2 and a Qwen3 checkpoint each round trip bit for bit (whole, and sharded over TP 1,
/// 2, 4: the KV biases replicated like their weights at 4, the head norms whole on every
/// rank); their biases / head norms under a Llama config are refused by both loaders.
#[test]
fn qwen2_qwen3_and_gemma3_checkpoints() -> Result<()> {
    checkpoint_round_trip(qwen2(0.5)?, 6, "model.layers.0.self_attn.k_proj.bias")?;
    checkpoint_round_trip(qwen3()?, 4, "model.layers.0.self_attn.k_norm.weight")?;
    // Gemma 3 read as a Llama: its head norms and extra norms are unused
    checkpoint_round_trip(gemma3()?, 8, "model.layers.0.pre_feedforward_layernorm.weight")?;
    // Gemma 2 read as a Llama: its extra norms are unused
    checkpoint_round_trip(gemma2()?, 4, "model.layers.0.pre_feedforward_layernorm.weight")
}

/// `(cfg, full)` saved, read back (whole and sharded) and written again; the same tensors
/// under the config without the architecture's extra parameters: refused, naming `unused`
/// tensors, `name` among them.
fn checkpoint_round_trip((cfg, full): (LlamaConfig, HashMap<String, Tensor>), unused: usize, name: &str) -> Result<()> {
    let (class, model_type) = cfg.arch().hf_names();
    let root = std::env::temp_dir().join(format!("candle-cp-{model_type}-{}", std::process::id()));
    let mut tensors: Vec<(String, Tensor)> = full.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let dir = root.join(model_type);
    save_hf_tensors(&dir, &tensors, &cfg)?;
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    assert!(text.contains(class) && text.contains(&format!("\"{model_type}\"")), "{text}");
    let (vm, back) = load_hf(&dir, &Device::Cpu, DType::F32)?;
    assert_eq!(back, cfg);
    let again = root.join("again");
    save_hf(&again, &vm, &back)?;
    assert!(std::fs::read(dir.join("model.safetensors"))? == std::fs::read(again.join("model.safetensors"))?, "{class}: written again, the bytes differ");
    for tp in [1usize, 2, 4] {
        for r in run_ranks(tp, |g| {
            let ctx = ParallelCtx::new(g, Layout::single().with_tp(tp, true))?;
            let want = shard_tensors(&full, &cfg, &ctx)?;
            let (got, _) = load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32)?;
            let lock = |vm: &candle_nn::VarMap| vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into())).map(|d| d.clone());
            let (want, got) = (lock(&want)?, lock(&got)?);
            let mut same = want.len() == got.len();
            for (k, w) in &want {
                same &= got.get(k).map(|g| max_abs(g.as_tensor(), w.as_tensor()).map(|e| e == 0.0)).transpose()? == Some(true);
            }
            Ok(same)
        }) {
            assert!(r?, "{class} tp {tp}: the sharded load differs from sharding the whole model");
        }
    }
    let llama = root.join("llama");
    save_hf_tensors(&llama, &tensors, &cfg.clone().with_gemma3(false).with_gemma2(false).with_qkv_bias(false).with_qk_norm(false).with_sliding_window(None).with_sliding_layers(None))?;
    let e = load_hf(&llama, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains(&format!("{unused} tensor(s)")) && e.contains(name) && e.contains("LlamaForCausalLM"), "{e}");
    for r in run_ranks(2, |g| {
        let ctx = ParallelCtx::new(g, Layout::single().with_tp(2, true))?;
        Ok(load_hf_sharded(&llama, &ctx, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default())
    }) {
        let e = r?;
        assert!(e.contains(name), "{e}");
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
