//! EXAONE 4.0 (`model_type` `exaone4`, `Exaone4ForCausalLM`, LG AI Research's 1.2B and 32B, the
//! 32B trained to 128k tokens): OLMo 2's layer (norms after the attention and the MLP, none
//! before: [`LlamaConfig::post_norms_only`], in a Llama's norm form) with Qwen3's q and k norms
//! over each head ([`LlamaConfig::qk_norm`]) and a hybrid attention: a window (`sliding_window`,
//! 4096) on the layers `layer_types` names, by default all but every `sliding_window_pattern`-th
//! (4: "LLLG"; a string of `L` and `G` repeats, the last layer global), and the global layers
//! attend without RoPE (NoPE, [`LlamaConfig::nope_layers`]) whenever the model has a window — a
//! model without one rotates every layer.
//!
//! A NoPE layer with head norms normalises q and k and leaves the rotation out
//! ([`crate::model`]'s `QkNorm::apply_with_rope` without tables); everything else is the
//! architectures' it combines, on every layout.

use super::{Arch, LlamaConfig};
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// [`LlamaConfig::features`]' name of EXAONE 4's.
pub(crate) const EXAONE4: &str = "EXAONE 4's hybrid attention";

/// Which layers of an `exaone4` config of `layers` layers slide (`true`), from `layer_types`
/// (read by [`Arch::window`]) or `sliding_window_pattern` (an integer `p`: all but every `p`-th
/// layer, default 4; or a string of `L` / `G` repeated from layer 0, the last layer global);
/// every layer full without a window. Errors name a pattern of another kind.
pub(crate) fn layer_types(m: &Map<String, Value>, layers: usize) -> Result<Option<Vec<bool>>> {
    if m.get("layer_types").is_some_and(|t| !t.is_null()) || m.get("sliding_window").is_none_or(|w| w.is_null()) {
        return Ok(None);
    }
    let slides: Vec<bool> = match m.get("sliding_window_pattern") {
        None | Some(Value::Null) => (0..layers).map(|i| !(i + 1).is_multiple_of(4)).collect(),
        Some(Value::String(p)) if !p.is_empty() && p.chars().all(|c| c == 'L' || c == 'G') => {
            let p: Vec<char> = p.chars().collect();
            (0..layers).map(|i| p[i % p.len()] == 'L' && i + 1 != layers).collect()
        }
        Some(v) => match v.as_u64() {
            Some(p) if p > 0 => (0..layers).map(|i| !(i + 1).is_multiple_of(p as usize)).collect(),
            _ => bail!("config.json: `sliding_window_pattern` must be a positive integer or a string of L and G, got {v}"),
        },
    };
    Ok(Some(slides))
}

/// An `exaone4` config with its `layer_types` filled in from `sliding_window_pattern` where it
/// leaves them out (see [`layer_types`]) and `rms_norm_eps` 1e-5; `None` for another
/// architecture.
pub(crate) fn with_defaults(m: &Map<String, Value>) -> Result<Option<Map<String, Value>>> {
    if Arch::of_config(m).ok() != Some(Arch::Exaone4) {
        return Ok(None);
    }
    let mut t = m.clone();
    t.entry("rms_norm_eps").or_insert(json!(1e-5));
    let layers = t.get("num_hidden_layers").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    if let Some(slides) = layer_types(&t, layers)? {
        let types: Vec<&str> = slides.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
        t.insert("layer_types".into(), json!(types));
    }
    Ok(Some(t))
}

/// The NoPE layers of an EXAONE 4 model: its global layers when it has a window (`None`
/// without one: every layer rotates).
pub(crate) fn nope_layers(cfg: &LlamaConfig) -> Option<Vec<bool>> {
    cfg.sliding_window?;
    Some((0..cfg.num_hidden_layers).map(|i| cfg.layer_window(i).is_none()).collect())
}

/// EXAONE 4's keys of config.json: `layer_types` for every layer and `sliding_window_pattern`
/// (0 without a window), no `mlp_bias` / `pretraining_tp` / SmolLM3's keys.
pub(crate) fn write(m: &mut Map<String, Value>, cfg: &LlamaConfig) {
    for k in ["mlp_bias", "pretraining_tp", "no_rope_layers", "no_rope_layer_interval", "use_sliding_window"] {
        m.remove(k);
    }
    let types: Vec<&str> = (0..cfg.num_hidden_layers).map(|i| if cfg.layer_window(i).is_some() { "sliding_attention" } else { "full_attention" }).collect();
    m.insert("layer_types".into(), json!(types));
    let p = match cfg.sliding_window {
        None => json!(0),
        Some(_) => {
            let p: String = (0..cfg.num_hidden_layers).map(|i| if cfg.layer_window(i).is_some() { 'L' } else { 'G' }).collect();
            json!(p)
        }
    };
    m.insert("sliding_window_pattern".into(), p);
}

/// EXAONE 4 with its own features only (head norms, NoPE on the global layers of a windowed
/// model) and no other architecture's; the NoPE layers exactly [`nope_layers`].
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    if !cfg.exaone4 {
        return Ok(());
    }
    let own = [EXAONE4, "q, k head norms", crate::config::smollm3::NOPE];
    if let Some((what, _)) = cfg.features().into_iter().find(|(w, on)| *on && !own.contains(w)) {
        bail!("LlamaConfig: EXAONE 4 with {what}: no architecture this model writes has both")
    }
    if !cfg.qk_norm {
        bail!("LlamaConfig: EXAONE 4 has q, k head norms (qk_norm false)")
    }
    if cfg.nope_layers != nope_layers(cfg) {
        bail!(
            "LlamaConfig: EXAONE 4's NoPE layers are the global layers of a windowed model (nope_layers {:?}, expected {:?})",
            cfg.nope_layers,
            nope_layers(cfg)
        )
    }
    Ok(())
}

impl LlamaConfig {
    /// The same config as EXAONE 4 (`on`: head norms, norms after the branches, NoPE on the
    /// global layers when a window is set; set the window first) or not.
    pub fn with_exaone4(mut self, on: bool) -> Self {
        self.exaone4 = on;
        if on {
            self.qk_norm = true;
            self.nope_layers = nope_layers(&self);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#""model_type": "exaone4", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2"#;

    fn parse(extra: &str) -> Result<LlamaConfig> {
        LlamaConfig::from_json(&format!("{{{BASE}{extra}}}"))
    }

    /// EXAONE 4 configs: the window pattern (integer, string, `layer_types`), NoPE on the global
    /// layers of a windowed model only, the norms; written back and read again as the same
    /// config; refusals.
    #[test]
    fn exaone4_configs() -> Result<()> {
        let c = parse(r#", "sliding_window": 64, "sliding_window_pattern": "LLLG""#)?;
        assert_eq!((c.arch(), c.exaone4, c.qk_norm, c.post_norms_only(), c.norm_weight()), (Arch::Exaone4, true, true, true, candle_cp_nn::NormWeight::Scale));
        let slides: Vec<bool> = (0..8).map(|i| c.layer_window(i).is_some()).collect();
        assert_eq!(slides, [true, true, true, false, true, true, true, false]);
        assert_eq!((0..8).map(|i| c.layer_rotates(i)).collect::<Vec<_>>(), slides);
        assert_eq!(parse(r#", "sliding_window": 64, "sliding_window_pattern": 4"#)?, c);
        // the last layer global whatever the pattern; layer_types when given
        let l = parse(r#", "sliding_window": 64, "sliding_window_pattern": "L""#)?;
        assert_eq!((0..8).filter(|&i| l.layer_window(i).is_none()).collect::<Vec<_>>(), [7]);
        // no window (the 1.2B): every layer full and rotating
        let n = parse(r#", "sliding_window": null"#)?;
        assert!(n.sliding_window.is_none() && n.nope_layers.is_none() && n.layer_rotates(3));
        for cfg in [&c, &l, &n] {
            let text = cfg.to_hf_json("float32");
            assert!(text.contains("Exaone4ForCausalLM") && !text.contains("no_rope_layers"), "{text}");
            assert_eq!(&LlamaConfig::from_json(&text)?, cfg);
        }
        let err = |r: Result<LlamaConfig>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(parse(r#", "sliding_window": 64, "sliding_window_pattern": "LX""#)).contains("sliding_window_pattern"));
        assert!(err(parse(r#", "attention_bias": true"#)).contains("attention_bias"));
        let e = c.clone().with_qkv_bias(true).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("biases"), "{e}");
        let e = c.clone().with_nope_layers(None).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("NoPE"), "{e}");
        Ok(())
    }
}
