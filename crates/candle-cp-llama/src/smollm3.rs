//! SmolLM3 (`model_type` `smollm3`, `SmolLM3ForCausalLM`): a Llama whose every
//! `no_rope_layer_interval`-th layer (4: layers 3, 7, 11, ...) attends without RoPE (NoPE), its q
//! and k as projected ([`LlamaConfig::nope_layers`]); with `use_sliding_window`, a window on the
//! NoPE layers (transformers' `layer_types` when absent); `rope_theta` 2,000,000 and a tied head
//! by default.
//!
//! `no_rope_layers` in config.json lists one entry per layer, `1` rotating and `0` NoPE (at least
//! as many entries as layers; the first ones count); without it, `no_rope_layer_interval`
//! decides. Everything else — sharding, every CP method, packed documents, generation — is the
//! Llama's: a NoPE layer leaves out the rotation inside its Q and K projections
//! ([`crate::model`]) and its decode steps ([`crate::generate`]).

use crate::LlamaConfig;
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// Whether config `m` is a SmolLM3's (`model_type` or `architectures`).
fn is_smollm3(m: &Map<String, Value>) -> bool {
    let classes: Vec<&str> = m.get("architectures").and_then(|a| a.as_array()).map(|a| a.iter().filter_map(|c| c.as_str()).collect()).unwrap_or_default();
    m.get("model_type").and_then(|v| v.as_str()) == Some("smollm3") || classes.contains(&"SmolLM3ForCausalLM")
}

/// A SmolLM3 config with transformers' defaults filled in where it leaves them out (a tied head,
/// `rope_theta` 2,000,000, `layer_types`: a window on the NoPE layers when
/// `use_sliding_window`); `None` for another architecture. Errors as [`parse`].
pub(crate) fn with_defaults(m: &Map<String, Value>) -> Result<Option<Map<String, Value>>> {
    if !is_smollm3(m) {
        return Ok(None);
    }
    let mut t = m.clone();
    let absent = |t: &Map<String, Value>, k: &str| t.get(k).is_none_or(|x| x.is_null());
    if absent(&t, "tie_word_embeddings") {
        t.insert("tie_word_embeddings".into(), json!(true));
    }
    let theta_given = !absent(&t, "rope_theta") || t.get("rope_parameters").and_then(|p| p.get("rope_theta")).is_some_and(|x| !x.is_null());
    if !theta_given {
        t.insert("rope_theta".into(), json!(2_000_000.0));
    }
    if absent(&t, "layer_types") {
        let layers = t.get("num_hidden_layers").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
        let nope = parse(&t, layers)?;
        let slides = t.get("use_sliding_window").and_then(|v| v.as_bool()) == Some(true) && !absent(&t, "sliding_window");
        let types: Vec<&str> = nope.iter().map(|&n| if slides && n { "sliding_attention" } else { "full_attention" }).collect();
        t.insert("layer_types".into(), json!(types));
    }
    Ok(Some(t))
}

/// The NoPE layers of a SmolLM3 config of `layers` layers (`true`: no RoPE): from
/// `no_rope_layers` (its first `layers` entries, each `1` or `0`), else every
/// `no_rope_layer_interval`-th layer (default 4). Errors name a list too short, an entry other
/// than 0 / 1, an interval of 0.
pub(crate) fn parse(m: &Map<String, Value>, layers: usize) -> Result<Vec<bool>> {
    match m.get("no_rope_layers") {
        None | Some(Value::Null) => {
            let every = match m.get("no_rope_layer_interval") {
                None | Some(Value::Null) => 4,
                Some(v) => match v.as_u64() {
                    Some(x) if x > 0 => x as usize,
                    _ => bail!("config.json: `no_rope_layer_interval` must be a positive integer, got {v}"),
                },
            };
            Ok((0..layers).map(|i| (i + 1).is_multiple_of(every)).collect())
        }
        Some(Value::Array(a)) => {
            if a.len() < layers {
                bail!("config.json: `no_rope_layers` has {} entries for {layers} layers", a.len())
            }
            a.iter()
                .take(layers)
                .map(|x| match (x.as_u64(), x.as_bool()) {
                    (Some(1), _) | (_, Some(true)) => Ok(false),
                    (Some(0), _) | (_, Some(false)) => Ok(true),
                    _ => bail!("config.json: `no_rope_layers` entry {x} must be 1 (RoPE) or 0 (NoPE)"),
                })
                .collect()
        }
        Some(other) => bail!("config.json: `no_rope_layers` must be a list, got {other}"),
    }
}

/// SmolLM3's keys of config.json: `no_rope_layers` (1 rotating, 0 NoPE), `use_sliding_window`
/// and, with a window, `layer_types`; no `pretraining_tp`.
pub(crate) fn write(m: &mut Map<String, Value>, cfg: &LlamaConfig, nope: &[bool]) {
    m.insert("no_rope_layers".into(), json!(nope.iter().map(|&n| u8::from(!n)).collect::<Vec<_>>()));
    m.insert("use_sliding_window".into(), json!(cfg.sliding_window.is_some()));
    if cfg.sliding_window.is_some() {
        let types: Vec<&str> = (0..cfg.num_hidden_layers).map(|i| if cfg.layer_window(i).is_some() { "sliding_attention" } else { "full_attention" }).collect();
        m.insert("layer_types".into(), json!(types));
    }
    m.remove("pretraining_tp");
}

/// NoPE layers are SmolLM3's, a Llama otherwise: refused beside another architecture's
/// features (biases, head norms, Gemma, a mixture, Phi-3, gpt-oss), and their list must have
/// one entry per layer.
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    // (EXAONE 4's NoPE layers: crate::config::exaone4::validate)
    let Some(n) = cfg.nope_layers.as_ref().filter(|_| !cfg.exaone4) else { return Ok(()) };
    if n.len() != cfg.num_hidden_layers {
        bail!("LlamaConfig: nope_layers has {} entries for {} layers", n.len(), cfg.num_hidden_layers)
    }
    if let Some(what) = cfg.features().into_iter().find(|(w, on)| *on && *w != NOPE).map(|(w, _)| w) {
        bail!("LlamaConfig: NoPE layers (SmolLM3) with {what}: no architecture this model writes has both")
    }
    Ok(())
}

/// [`LlamaConfig::features`]' name of SmolLM3's.
pub(crate) const NOPE: &str = "NoPE layers";

impl LlamaConfig {
    /// What the config has beyond a Llama, by name, each on or off: q, k, v biases, head norms,
    /// Gemma 3, Gemma 2, a mixture, Phi-3, gpt-oss, NoPE layers, Granite's multipliers, OLMo's
    /// norms, EXAONE 4's attention, GLM-4's norms and RoPE (the architectures that exclude the
    /// others refuse them by these names).
    pub(crate) fn features(&self) -> [(&'static str, bool); 13] {
        [
            ("q, k, v biases", self.qkv_bias),
            ("q, k head norms", self.qk_norm),
            ("Gemma 3", self.gemma3.is_some()),
            ("Gemma 2", self.gemma2.is_some()),
            (crate::config::qwen3_moe::MOE, self.moe.is_some()),
            ("Phi-3", self.phi3),
            ("gpt-oss", self.gpt_oss),
            (NOPE, self.nope_layers.is_some()),
            (crate::config::granite::GRANITE, self.granite.is_some()),
            (crate::config::olmo::OLMO, self.olmo.is_some()),
            (crate::config::exaone4::EXAONE4, self.exaone4),
            (crate::config::glm4::GLM4, self.glm.is_some()),
            (crate::config::deepseek::MLA, self.mla.is_some()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Arch;

    const BASE: &str = r#""model_type": "smollm3", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2"#;

    fn parse_cfg(extra: &str) -> Result<LlamaConfig> {
        LlamaConfig::from_json(&format!("{{{BASE}{extra}}}"))
    }

    /// Defaults (every 4th layer NoPE, theta 2e6, tied head), an explicit list, the window on
    /// the NoPE layers with use_sliding_window, the round trip through `to_hf_json`, refusals.
    #[test]
    fn smollm3_configs() -> Result<()> {
        let c = parse_cfg("")?;
        assert_eq!(c.arch(), Arch::SmolLM3);
        assert_eq!(c.nope_layers, Some(vec![false, false, false, true, false, false, false, true]));
        assert_eq!((c.rope_theta, c.tie_word_embeddings, c.sliding_window), (2e6, true, None));
        assert!(!c.layer_rotates(3) && c.layer_rotates(4));
        let c = parse_cfg(r#", "no_rope_layers": [1, 0, 1, 1, 1, 1, 1, 0, 1], "rope_theta": 5e6, "tie_word_embeddings": false"#)?;
        assert_eq!(c.nope_layers, Some(vec![false, true, false, false, false, false, false, true]));
        assert_eq!((c.rope_theta, c.tie_word_embeddings), (5e6, false));
        assert_eq!(parse_cfg(r#", "no_rope_layer_interval": 2"#)?.nope_layers, Some((0..8).map(|i| i % 2 == 1).collect()));
        // a window on the NoPE layers, with use_sliding_window only
        let w = parse_cfg(r#", "use_sliding_window": true, "sliding_window": 16"#)?;
        assert_eq!((w.layer_window(3), w.layer_window(2)), (Some(16), None));
        assert_eq!(parse_cfg(r#", "sliding_window": 16"#)?.sliding_window, None);
        for c in [parse_cfg("")?, parse_cfg(r#", "no_rope_layers": [0, 1, 1, 1, 1, 1, 1, 1]"#)?, w] {
            let text = c.to_hf_json("bfloat16");
            let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some("smollm3"), Some("SmolLM3ForCausalLM")));
            assert_eq!(LlamaConfig::from_json(&text)?, c, "{text}");
        }
        for (extra, want) in [
            (r#", "no_rope_layers": [1, 0]"#, "2 entries for 8 layers"),
            (r#", "no_rope_layers": [1, 0, 1, 1, 2, 1, 1, 1]"#, "entry 2"),
            (r#", "no_rope_layer_interval": 0"#, "positive integer"),
            (r#", "attention_bias": true"#, "attention_bias"),
        ] {
            let e = parse_cfg(extra).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(want), "{extra}: {e}");
        }
        let e = LlamaConfig::tiny(64, 32, 2, 4, 2).with_nope_layers(Some(vec![false, true])).with_qk_norm(true).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("NoPE") && e.contains("head norms"), "{e}");
        let e = LlamaConfig::tiny(64, 32, 2, 4, 2).with_nope_layers(Some(vec![true])).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("1 entries for 2 layers"), "{e}");
        Ok(())
    }
}
