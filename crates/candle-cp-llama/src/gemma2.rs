//! Gemma 2 (`model_type` `gemma2`, `Gemma2ForCausalLM`): what its `config.json` says beyond a
//! Llama's, read and written back ([`Gemma2`], [`super::LlamaConfig::gemma2`]).
//!
//! A Gemma 2 layer is Gemma 3's ([`super::gemma`]: the `√h` embedding factor, `x̂ · (1 + w)`
//! norms, norms after attention and MLP, the GELU-gated MLP, the softmax scale
//! `query_pre_attn_scalar^-1/2`) without the q, k head norms and with one RoPE for every layer,
//! plus **logit soft-capping**:
//! - attention logits `c · tanh(s / c)` with `c = attn_logit_softcapping` (default 50), inside
//!   the attention kernels ([`candle_cp_ops::attention::Scores`]), on every CP layout;
//! - output logits `c · tanh(l / c)` with `c = final_logit_softcapping` (default 30), in the
//!   chunked head + cross-entropy ([`crate::head_loss`]) and in [`crate::Llama::forward`]'s
//!   logits (generation included).
//!
//! The window (`sliding_window`, default 4096) is on every other layer, the first included
//! (`layer_types`, else layers `0, 2, 4, …`, as `Gemma2Config` builds them).

use super::{get_f64, LlamaConfig};
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// What a Gemma 2 config adds to the Llama shape (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma2 {
    /// The softmax scale is `query_pre_attn_scalar^-1/2` (default 256; 144 for the 27B).
    pub query_pre_attn_scalar: f64,
    /// Attention logit soft cap (`attn_logit_softcapping`, default 50; `None`: `null`).
    pub attn_logit_softcapping: Option<f64>,
    /// Output logit soft cap (`final_logit_softcapping`, default 30; `None`: `null`).
    pub final_logit_softcapping: Option<f64>,
}

impl Gemma2 {
    /// transformers' defaults (`Gemma2Config`).
    pub fn new() -> Self {
        Self { query_pre_attn_scalar: 256.0, attn_logit_softcapping: Some(50.0), final_logit_softcapping: Some(30.0) }
    }
}

impl Default for Gemma2 {
    fn default() -> Self {
        Self::new()
    }
}

/// A Gemma 2 config with `Gemma2Config`'s defaults for the keys it leaves out (the 2B's shape,
/// head dim 256, 8192 positions, RoPE base 10000, window 4096, tied head); `None` for other
/// architectures.
pub(super) fn with_defaults(m: &Map<String, Value>) -> Option<Map<String, Value>> {
    let classes: Vec<&str> = m.get("architectures").and_then(|a| a.as_array()).map(|a| a.iter().filter_map(|c| c.as_str()).collect()).unwrap_or_default();
    if m.get("model_type").and_then(|v| v.as_str()) != Some("gemma2") && !classes.contains(&"Gemma2ForCausalLM") {
        return None;
    }
    let mut t = m.clone();
    super::gemma::fill_defaults(&mut t, 256_000, 8192);
    Some(t)
}

/// The Gemma 2 keys of a `gemma2` config. Errors name what this model would not compute.
pub(super) fn parse(m: &Map<String, Value>) -> Result<Gemma2> {
    for k in ["hidden_activation", "hidden_act"] {
        match m.get(k).and_then(|v| v.as_str()) {
            None | Some("gelu_pytorch_tanh") => {}
            Some(a) => bail!("config.json: Gemma 2 `{k}` `{a}` not supported (only gelu_pytorch_tanh)"),
        }
    }
    if m.get("use_bidirectional_attention").and_then(|v| v.as_bool()) == Some(true) {
        bail!("config.json: `use_bidirectional_attention: true` not supported (causal language models only)")
    }
    let mut g = Gemma2::new();
    if let Some(s) = get_f64(m, "query_pre_attn_scalar")? {
        g.query_pre_attn_scalar = s;
    }
    for (k, slot) in [("attn_logit_softcapping", &mut g.attn_logit_softcapping), ("final_logit_softcapping", &mut g.final_logit_softcapping)] {
        match m.get(k) {
            None => {}
            Some(Value::Null) => *slot = None,
            Some(_) => *slot = get_f64(m, k)?,
        }
    }
    Ok(g)
}

/// Errors for numbers that would give NaN or no model (scalar and caps finite and > 0).
pub(super) fn validate(g: &Gemma2) -> Result<()> {
    let caps = [("attn_logit_softcapping", g.attn_logit_softcapping), ("final_logit_softcapping", g.final_logit_softcapping)];
    for (k, v) in [("query_pre_attn_scalar", Some(g.query_pre_attn_scalar))].into_iter().chain(caps) {
        if let Some(v) = v {
            if !(v.is_finite() && v > 0.0) {
                bail!("LlamaConfig: Gemma 2 {k} must be finite and > 0, got {v}")
            }
        }
    }
    Ok(())
}

/// Turn the Llama keys `to_hf_json` wrote into a Gemma 2 config: the activation (both keys, as
/// the published configs), the scale, the caps, `layer_types`.
pub(super) fn write(m: &mut Map<String, Value>, cfg: &LlamaConfig, g: &Gemma2) {
    for k in ["mlp_bias", "pretraining_tp", "rope_parameters"] {
        m.remove(k);
    }
    m.insert("hidden_act".into(), json!("gelu_pytorch_tanh"));
    m.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    m.insert("query_pre_attn_scalar".into(), json!(g.query_pre_attn_scalar));
    m.insert("attn_logit_softcapping".into(), json!(g.attn_logit_softcapping));
    m.insert("final_logit_softcapping".into(), json!(g.final_logit_softcapping));
    let types: Vec<&str> = (0..cfg.num_hidden_layers).map(|i| if cfg.layer_window(i).is_some() { "sliding_attention" } else { "full_attention" }).collect();
    m.insert("layer_types".into(), json!(types));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Arch, LlamaConfig, RopeScaling};

    /// google/gemma-2-9b's config.json as published (transformers 4.42).
    const GEMMA2_9B: &str = r#"{
      "architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
      "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
      "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
      "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
      "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
      "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
      "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
      "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
      "transformers_version": "4.42.0.dev0", "use_cache": true, "vocab_size": 256000
    }"#;

    #[test]
    fn published_config_reads_and_round_trips() -> Result<()> {
        let c = LlamaConfig::from_json(GEMMA2_9B)?;
        assert_eq!(c.arch(), Arch::Gemma2);
        assert_eq!((c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim), (3584, 42, 16, 8, 256));
        assert!(c.tie_word_embeddings && !c.qk_norm && !c.qkv_bias && c.gemma3.is_none());
        assert_eq!((c.rope_theta, c.rope_scaling.clone()), (10000.0, RopeScaling::Default));
        assert_eq!(c.gemma2, Some(Gemma2 { query_pre_attn_scalar: 256.0, attn_logit_softcapping: Some(50.0), final_logit_softcapping: Some(30.0) }));
        assert_eq!(c.attn_scores().scale, 1.0 / 16.0);
        assert_eq!((c.attn_scores().softcap, c.final_logit_softcap()), (Some(50.0), Some(30.0)));
        assert_eq!(c.activation(), crate::fused::Activation::GeluTanh);
        assert_eq!(c.norm_weight(), candle_cp_nn::NormWeight::UnitOffset);
        assert_eq!(c.embed_scale(candle_core::DType::BF16)?, Some(59.75)); // √3584 = 59.87 in bf16
        // the window on layers 0, 2, 4, ...: every layer rotates by the one RoPE
        let sliding: Vec<usize> = (0..42).filter(|&i| c.layer_window(i).is_some()).collect();
        assert_eq!(sliding, (0..42).step_by(2).collect::<Vec<_>>());
        assert_eq!(c.layer_window(0), Some(4096));
        assert!(!c.layer_rope_is_local(0) && c.local_rope().is_none());
        let text = c.to_hf_json("bfloat16");
        let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some("gemma2"), Some("Gemma2ForCausalLM")));
        assert_eq!((v["attn_logit_softcapping"].as_f64(), v["final_logit_softcapping"].as_f64()), (Some(50.0), Some(30.0)));
        assert_eq!(v["layer_types"].as_array().map(|a| a.len()), Some(42));
        assert_eq!(LlamaConfig::from_json(&text)?, c);
        Ok(())
    }

    #[test]
    fn defaults_nulls_and_refusals() -> Result<()> {
        // null caps: none; absent: the defaults
        let c = LlamaConfig::from_json(&GEMMA2_9B.replace(r#""attn_logit_softcapping": 50.0"#, r#""attn_logit_softcapping": null"#))?;
        assert_eq!((c.attn_scores().softcap, c.final_logit_softcap()), (None, Some(30.0)));
        let c = LlamaConfig::from_json(r#"{"model_type": "gemma2"}"#)?;
        assert_eq!((c.hidden_size, c.num_hidden_layers, c.head_dim, c.sliding_window), (2304, 26, 256, Some(4096)));
        assert_eq!((c.attn_scores().softcap, c.final_logit_softcap(), c.tie_word_embeddings), (Some(50.0), Some(30.0), true));
        // the 27B's scalar
        let c = LlamaConfig::from_json(&GEMMA2_9B.replace(r#""query_pre_attn_scalar": 256"#, r#""query_pre_attn_scalar": 144"#))?;
        assert_eq!(c.attn_scores().scale, 1.0 / 12.0);
        let err = |text: &str| LlamaConfig::from_json(text).err().map(|e| e.to_string()).unwrap_or_default();
        for (text, want) in [
            (GEMMA2_9B.replace(r#""hidden_activation": "gelu_pytorch_tanh""#, r#""hidden_activation": "gelu""#), "`gelu` not supported"),
            (GEMMA2_9B.replace(r#""attn_logit_softcapping": 50.0"#, r#""attn_logit_softcapping": -1.0"#), "attn_logit_softcapping must be finite and > 0"),
            (GEMMA2_9B.replace(r#""final_logit_softcapping": 30.0"#, r#""final_logit_softcapping": 0"#), "final_logit_softcapping must be finite and > 0"),
        ] {
            let e = err(&text);
            assert!(e.contains(want), "{want}: {e:?}");
        }
        let mut c = LlamaConfig::tiny(64, 32, 2, 4, 2).with_gemma2(true);
        assert!(c.validate().is_ok());
        c.qk_norm = true;
        assert!(c.validate().err().map(|e| e.to_string()).unwrap_or_default().contains("Gemma 2"));
        Ok(())
    }
}
