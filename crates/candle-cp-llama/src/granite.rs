//! Granite (`model_type` `granite`, `GraniteForCausalLM`, IBM's Granite 3.x dense models): a
//! Llama with four scalars ([`Granite`]): the embedding output times `embedding_multiplier`,
//! the attention's softmax scale `attention_multiplier` (for `head_dim^-1/2`), each residual
//! branch times `residual_multiplier` (`x + r·attn(..)`, `x + r·mlp(..)`: inside the
//! row-parallel projection's node, `RowParallelLinear::forward_residual_scaled`), and the
//! logits divided by `logits_scaling` (the final norm's output times `1 / logits_scaling`
//! before the head: the same logits, and the chunked loss needs no other path).

use crate::LlamaConfig;
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// Granite's multipliers (`GraniteConfig`; 1 where config.json leaves one out).
#[derive(Clone, Debug, PartialEq)]
pub struct Granite {
    /// Factor on the embedding output.
    pub embedding_multiplier: f64,
    /// The attention's softmax scale (instead of `head_dim^-1/2`).
    pub attention_multiplier: f64,
    /// Factor on each residual branch (attention, MLP) before its add.
    pub residual_multiplier: f64,
    /// Divisor of the output logits.
    pub logits_scaling: f64,
}

impl Default for Granite {
    fn default() -> Self {
        Self { embedding_multiplier: 1.0, attention_multiplier: 1.0, residual_multiplier: 1.0, logits_scaling: 1.0 }
    }
}

/// [`LlamaConfig::features`]' name of Granite's.
pub(crate) const GRANITE: &str = "Granite's multipliers";

const KEYS: [&str; 4] = ["embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"];

impl Granite {
    fn values(&self) -> [f64; 4] {
        [self.embedding_multiplier, self.attention_multiplier, self.residual_multiplier, self.logits_scaling]
    }
}

/// Granite's multipliers from config `m` (each a number; absent or null: 1). Errors name a
/// value that is not a number.
pub(crate) fn parse(m: &Map<String, Value>) -> Result<Granite> {
    let mut v = [1.0; 4];
    for (k, x) in KEYS.iter().zip(v.iter_mut()) {
        match m.get(*k) {
            None | Some(Value::Null) => {}
            Some(n) => match n.as_f64() {
                Some(f) => *x = f,
                None => bail!("config.json: `{k}` must be a number, got {n}"),
            },
        }
    }
    Ok(Granite { embedding_multiplier: v[0], attention_multiplier: v[1], residual_multiplier: v[2], logits_scaling: v[3] })
}

/// Granite's keys of config.json.
pub(crate) fn write(m: &mut Map<String, Value>, g: &Granite) {
    for (k, x) in KEYS.iter().zip(g.values()) {
        m.insert((*k).into(), json!(x));
    }
    m.remove("pretraining_tp");
}

/// The multipliers finite and positive; Granite with no other architecture's features (biases,
/// head norms, Gemma, a mixture, Phi-3, gpt-oss, NoPE layers, a sliding window).
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    let Some(g) = &cfg.granite else { return Ok(()) };
    for (k, x) in KEYS.iter().zip(g.values()) {
        if !(x.is_finite() && x > 0.0) {
            bail!("LlamaConfig: Granite {k} must be finite and > 0, got {x}")
        }
    }
    // (GraniteMoE: Granite's multipliers with its own mixture, crate::config::granite_moe)
    let granite_moe = cfg.moe.as_ref().is_some_and(|m| m.style == crate::MoeStyle::GraniteMoe);
    if let Some((what, _)) = cfg.features().into_iter().find(|(w, on)| *on && *w != GRANITE && !(granite_moe && *w == crate::config::qwen3_moe::MOE)) {
        bail!("LlamaConfig: Granite with {what}: no architecture this model writes has both")
    }
    super::granite_moe::validate(cfg)?;
    // (GraniteConfig has no window: a checkpoint would load without it)
    if let Some(w) = cfg.sliding_window {
        bail!("LlamaConfig: Granite with a sliding window ({w}): GraniteConfig has none, so a saved checkpoint would load as another model")
    }
    Ok(())
}

impl LlamaConfig {
    /// The same config as Granite with multipliers `g` (or not).
    pub fn with_granite(mut self, g: Option<Granite>) -> Self {
        self.granite = g;
        self
    }

    /// The factor on each residual branch (Granite's `residual_multiplier`; 1 otherwise).
    pub fn residual_scale(&self) -> f64 {
        self.granite.as_ref().map_or(1.0, |g| g.residual_multiplier)
    }

    /// The factor on the final norm's output before the head (`1 / logits_scaling` for
    /// Granite), if any.
    pub fn head_input_scale(&self) -> Option<f64> {
        self.granite.as_ref().filter(|g| g.logits_scaling != 1.0).map(|g| 1.0 / g.logits_scaling)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Arch;

    /// granite-3.x's keys read, written back and read again as the same config; defaults 1;
    /// refusals by name.
    #[test]
    fn granite_configs() -> Result<()> {
        let base = r#""model_type": "granite", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2"#;
        let c = LlamaConfig::from_json(&format!(r#"{{{base}, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
            "residual_multiplier": 0.22, "logits_scaling": 16.0, "tie_word_embeddings": true}}"#))?;
        assert_eq!(c.arch(), Arch::Granite);
        assert_eq!(c.granite, Some(Granite { embedding_multiplier: 12.0, attention_multiplier: 0.0078125, residual_multiplier: 0.22, logits_scaling: 16.0 }));
        assert_eq!((c.attn_scale(), c.residual_scale(), c.head_input_scale()), (0.0078125, 0.22, Some(1.0 / 16.0)));
        assert_eq!(c.embed_scale(candle_core::DType::BF16)?, Some(12.0));
        let text = c.to_hf_json("bfloat16");
        let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some("granite"), Some("GraniteForCausalLM")));
        assert_eq!(LlamaConfig::from_json(&text)?, c);
        let d = LlamaConfig::from_json(&format!("{{{base}}}"))?;
        assert_eq!((d.granite.clone(), d.arch()), (Some(Granite::default()), Arch::Granite));
        for (extra, want) in [(r#", "logits_scaling": 0"#, "logits_scaling must be finite and > 0"), (r#", "residual_multiplier": "x""#, "must be a number"), (r#", "attention_bias": true"#, "attention_bias")] {
            let e = LlamaConfig::from_json(&format!("{{{base}{extra}}}")).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(want), "{extra}: {e}");
        }
        let e = LlamaConfig::tiny(64, 32, 2, 4, 2).with_granite(Some(Granite::default())).with_qkv_bias(true).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("Granite with q, k, v biases"), "{e}");
        let e = LlamaConfig::tiny(64, 32, 2, 4, 2).with_granite(Some(Granite::default())).with_sliding_window(Some(8)).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("Granite with a sliding window (8)"), "{e}");
        Ok(())
    }
}
