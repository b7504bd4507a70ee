//! Gemma 3 (`model_type` `gemma3_text`, `Gemma3ForCausalLM`): what its `config.json` says
//! beyond a Llama's, read and written back ([`Gemma3`], [`super::LlamaConfig::gemma3`]).
//!
//! A Gemma 3 layer is the Llama layer with:
//! - the embedding output times `√h` (the factor rounded to the weights' dtype first, as
//!   transformers' `Gemma3TextScaledWordEmbedding` does);
//! - every RMSNorm `x̂ · (1 + w)` in f32 ([`candle_cp_nn::NormWeight::UnitOffset`]; weights
//!   start at zeros), the head norms of Qwen 3 ([`super::LlamaConfig::qk_norm`]) included;
//! - norms after the attention and after the MLP too (`post_attention_layernorm`,
//!   `post_feedforward_layernorm`, each before its residual add; the norm before the MLP is
//!   `pre_feedforward_layernorm`);
//! - the GELU-gated MLP (`gelu_pytorch_tanh`, [`crate::fused::geglu`]);
//! - the softmax scale `query_pre_attn_scalar^-1/2`;
//! - the sliding window on most layers (`layer_types`, or every layer but each
//!   `sliding_window_pattern`-th: five of six), those layers rotating by RoPE of base
//!   `rope_local_base_freq` unscaled, the others by `rope_theta` with `rope_scaling`.
//!
//! The multimodal checkpoints (`model_type` `gemma3`, `Gemma3ForConditionalGeneration`: the
//! 4B, 12B and 27B as published) give their text model: the config's `text_config`
//! (with `Gemma3TextConfig`'s defaults filled in), the tensors under
//! `language_model.model.*` / `model.language_model.*` (`crate::hf` maps the names and skips
//! the vision tower and projector); it saves back as the text model, `Gemma3ForCausalLM`.
//!
//! Refused by name: logit soft-capping (`final_logit_softcapping`, `attn_logit_softcapping`;
//! Gemma 2's), bidirectional attention, another activation.

use super::{get_f64, parse_scaling, rope_by_layer_type, Gemma2, LlamaConfig, RopeScaling};
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// What a Gemma 3 config adds to the Llama shape (see the module doc for what the
/// architecture implies beyond these numbers).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3 {
    /// The softmax scale is `query_pre_attn_scalar^-1/2` (transformers' default 256).
    pub query_pre_attn_scalar: f64,
    /// RoPE base of the sliding-window layers, unscaled (`rope_local_base_freq`, default
    /// 10000); the full-attention layers use `rope_theta` and `rope_scaling`.
    pub rope_local_base_freq: f64,
}

impl Gemma3 {
    /// transformers' defaults.
    pub fn new() -> Self {
        Self { query_pre_attn_scalar: 256.0, rope_local_base_freq: 10000.0 }
    }
}

impl Default for Gemma3 {
    fn default() -> Self {
        Self::new()
    }
}

/// The text model's config of a Gemma 3 `config.json`, with transformers' `Gemma3TextConfig`
/// defaults for the keys it leaves out (shape, head dim 256, 131072 positions, window 4096
/// (an explicit `null` stays), tied head) (the published 4B's `text_config` names only its
/// width, depth, MLP width, window and RoPE scaling): for the multimodal `gemma3`
/// (`Gemma3ForConditionalGeneration`) its `text_config`, for `gemma3_text` the config itself;
/// `None` for other architectures. A `gemma3` config without a `text_config` object is an
/// error.
pub(super) fn text_config(m: &Map<String, Value>) -> Result<Option<Map<String, Value>>> {
    let model_type = m.get("model_type").and_then(|v| v.as_str());
    let classes: Vec<&str> = m.get("architectures").and_then(|a| a.as_array()).map(|a| a.iter().filter_map(|c| c.as_str()).collect()).unwrap_or_default();
    let multimodal = model_type == Some("gemma3") || classes.contains(&"Gemma3ForConditionalGeneration");
    let mut t = if multimodal {
        match m.get("text_config") {
            Some(Value::Object(t)) => {
                let mut t = t.clone();
                t.insert("model_type".into(), json!("gemma3_text"));
                t.remove("architectures");
                t
            }
            _ => bail!("config.json: a multimodal Gemma 3 config (model_type `gemma3`) without a `text_config` object"),
        }
    } else if model_type == Some("gemma3_text") || classes.contains(&"Gemma3ForCausalLM") {
        m.clone()
    } else {
        return Ok(None);
    };
    fill_defaults(&mut t, 262_208, 131_072);
    Ok(Some(t))
}

/// The keys `Gemma3TextConfig` and `Gemma2Config` default alike where `t` leaves them out (the
/// 2B-class shape: width 2304, 26 layers, 8 heads / 4 KV heads of 256, MLP 9216; a window of
/// 4096; a tied head), with the vocabulary and positions that differ.
pub(super) fn fill_defaults(t: &mut Map<String, Value>, vocab: u64, max_positions: u64) {
    for (k, v) in [
        ("vocab_size", json!(vocab)),
        ("hidden_size", json!(2304)),
        ("intermediate_size", json!(9216)),
        ("num_hidden_layers", json!(26)),
        ("num_attention_heads", json!(8)),
        ("num_key_value_heads", json!(4)),
        ("head_dim", json!(256)),
        ("max_position_embeddings", json!(max_positions)),
        ("sliding_window", json!(4096)),
        ("tie_word_embeddings", json!(true)),
    ] {
        t.entry(k).or_insert(v);
    }
}

/// The Gemma 3 keys of a `gemma3_text` config: `(gemma3, rope_theta, rope_scaling)` (the
/// full-attention layers' RoPE; legacy `rope_theta` / `rope_scaling` / `rope_local_base_freq`,
/// or `rope_parameters` keyed by layer type). Errors name what this model would not compute.
pub(super) fn parse(m: &Map<String, Value>, max_pos: usize) -> Result<(Gemma3, f64, RopeScaling)> {
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        match m.get(k) {
            None | Some(Value::Null) => {}
            Some(v) => bail!("config.json: `{k}: {v}` not supported (Gemma 3 has no logit soft-capping; Gemma 2 does)"),
        }
    }
    if m.get("use_bidirectional_attention").and_then(|v| v.as_bool()) == Some(true) {
        bail!("config.json: `use_bidirectional_attention: true` not supported (causal language models only)")
    }
    for k in ["hidden_activation", "hidden_act"] {
        match m.get(k).and_then(|v| v.as_str()) {
            None | Some("gelu_pytorch_tanh") => {}
            Some(a) => bail!("config.json: Gemma 3 `{k}` `{a}` not supported (only gelu_pytorch_tanh)"),
        }
    }
    let mut g = Gemma3::new();
    if let Some(s) = get_f64(m, "query_pre_attn_scalar")? {
        g.query_pre_attn_scalar = s;
    }
    let by_type = match m.get("rope_parameters") {
        Some(Value::Object(p)) => rope_by_layer_type(p)?,
        _ => None,
    };
    let (theta, scaling) = match (by_type, m.get("rope_parameters")) {
        // transformers 5: one RoPE per layer type
        (Some((full, local)), _) => {
            if parse_scaling(&local, max_pos, None)? != RopeScaling::Default {
                bail!("config.json: a scaled RoPE on Gemma 3's sliding layers (`rope_parameters.sliding_attention`) not supported")
            }
            if let Some(t) = get_f64(&local, "rope_theta")? {
                g.rope_local_base_freq = t;
            }
            (get_f64(&full, "rope_theta")?.unwrap_or(1_000_000.0), parse_scaling(&full, max_pos, None)?)
        }
        (None, Some(Value::Object(p))) => {
            if let Some(t) = get_f64(m, "rope_local_base_freq")? {
                g.rope_local_base_freq = t;
            }
            (get_f64(p, "rope_theta")?.or(get_f64(m, "rope_theta")?).unwrap_or(1_000_000.0), parse_scaling(p, max_pos, None)?)
        }
        (None, _) => {
            if let Some(t) = get_f64(m, "rope_local_base_freq")? {
                g.rope_local_base_freq = t;
            }
            let scaling = match m.get("rope_scaling") {
                Some(Value::Object(s)) => parse_scaling(s, max_pos, None)?,
                None | Some(Value::Null) => RopeScaling::Default,
                Some(other) => bail!("config.json: `rope_scaling` must be an object or null, got {other}"),
            };
            (get_f64(m, "rope_theta")?.unwrap_or(1_000_000.0), scaling)
        }
    };
    Ok((g, theta, scaling))
}

/// Turn the Llama keys `to_hf_json` wrote into a Gemma 3 config: the activation, the scale,
/// both RoPE bases in the legacy keys (what the published checkpoints carry, and what
/// transformers 4 and 5 both read), `layer_types` (plus `sliding_window_pattern` when the
/// layers follow one), no soft-capping.
pub(super) fn write(m: &mut Map<String, Value>, cfg: &LlamaConfig, g: &Gemma3) {
    for k in ["hidden_act", "mlp_bias", "pretraining_tp", "rope_parameters"] {
        m.remove(k);
    }
    m.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    m.insert("query_pre_attn_scalar".into(), json!(g.query_pre_attn_scalar));
    m.insert("rope_local_base_freq".into(), json!(g.rope_local_base_freq));
    m.insert("final_logit_softcapping".into(), Value::Null);
    m.insert("attn_logit_softcapping".into(), Value::Null);
    let n = cfg.num_hidden_layers;
    let slides: Vec<bool> = (0..n).map(|i| cfg.layer_window(i).is_some()).collect();
    let types: Vec<&str> = slides.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
    m.insert("layer_types".into(), json!(types));
    // transformers before `layer_types`: layer i slides iff (i + 1) % pattern != 0
    if let Some(p) = (1..=n + 1).find(|&p| slides.iter().enumerate().all(|(i, &s)| s != (i + 1).is_multiple_of(p))) {
        m.insert("sliding_window_pattern".into(), json!(p));
    }
}

/// What Gemma 2 and 3 change in the accessors every layer reads (the architecture-dependent
/// numbers of a [`LlamaConfig`]; the other architectures' are the Llama ones).
impl LlamaConfig {
    /// The same config as a Gemma 3 model (`on`: the softmax scale `head_dim^-1/2`
    /// (`query_pre_attn_scalar = head_dim`), [`Gemma3::new`]'s local RoPE base, the q, k head
    /// norms on, tied embeddings; see [`crate::gemma`]), or not (`false`: the numbers go, the rest
    /// stays).
    pub fn with_gemma3(mut self, on: bool) -> Self {
        self.gemma3 = on.then(|| Gemma3 { query_pre_attn_scalar: self.head_dim as f64, ..Gemma3::new() });
        if on {
            self.qk_norm = true;
            self.tie_word_embeddings = true;
        }
        self
    }

    /// The same config as a Gemma 2 model (`on`: the softmax scale `head_dim^-1/2`
    /// (`query_pre_attn_scalar = head_dim`), [`super::Gemma2::new`]'s soft caps (attention 50, output
    /// 30), no q, k head norms, tied embeddings; see [`super::gemma2`]), or not (`false`: the numbers
    /// go, the rest stays).
    pub fn with_gemma2(mut self, on: bool) -> Self {
        self.gemma2 = on.then(|| Gemma2 { query_pre_attn_scalar: self.head_dim as f64, ..Gemma2::new() });
        if on {
            self.qk_norm = false;
            self.tie_word_embeddings = true;
        }
        self
    }

    /// Whether this is a Gemma 2 or Gemma 3 model (the GELU-gated MLP, `1 + w` norms, the
    /// norms after attention and MLP, the `√h` embedding factor).
    pub fn is_gemma(&self) -> bool {
        self.gemma3.is_some() || self.gemma2.is_some()
    }

    /// The activation of the gated MLP (GELU-tanh for Gemma 2 and 3, gpt-oss's clamped SwiGLU,
    /// else SiLU).
    pub fn activation(&self) -> crate::fused::Activation {
        match (self.is_gemma(), self.gpt_oss) {
            (true, _) => crate::fused::Activation::GeluTanh,
            (false, true) => crate::fused::Activation::ClampedSwiglu,
            (false, false) => crate::fused::Activation::Silu,
        }
    }

    /// How every RMSNorm applies its weight (Gemma 2 and 3: `x̂ · (1 + w)`; OLMo 2 and 3: `x̂ · w`
    /// in f32).
    pub fn norm_weight(&self) -> candle_cp_nn::NormWeight {
        match (self.is_gemma(), self.olmo.is_some_and(super::Olmo::post_norms)) {
            (true, _) => candle_cp_nn::NormWeight::UnitOffset,
            // OLMo: x̂ · w in f32, cast last
            (false, true) => candle_cp_nn::NormWeight::ScaleF32,
            (false, false) => candle_cp_nn::NormWeight::Scale,
        }
    }

    /// The softmax scale: `head_dim^-1/2`, Gemma's `query_pre_attn_scalar^-1/2`, Granite's
    /// `attention_multiplier`.
    pub fn attn_scale(&self) -> f64 {
        // Granite: its attention_multiplier
        if let Some(g) = &self.granite {
            return g.attention_multiplier;
        }
        // DeepSeek-V3: (nope + rope)^-1/2, YaRN's mscale² on it
        // (DeepSeek-V2's as transformers writes it: no mscale)
        if let Some(a) = &self.mla {
            let v2 = self.moe.as_ref().is_some_and(|m| m.style == crate::MoeStyle::DeepseekV2);
            return a.softmax_scale(if v2 { &RopeScaling::Default } else { &self.rope_scaling });
        }
        match (&self.gemma3, &self.gemma2) {
            (Some(g), _) => 1.0 / g.query_pre_attn_scalar.sqrt(),
            (None, Some(g)) => 1.0 / g.query_pre_attn_scalar.sqrt(),
            (None, None) => 1.0 / (self.head_dim as f64).sqrt(),
        }
    }

    /// The attention logits: [`LlamaConfig::attn_scale`] and Gemma 2's
    /// `attn_logit_softcapping`.
    pub fn attn_scores(&self) -> candle_cp_ops::attention::Scores {
        let cap = self.gemma2.as_ref().and_then(|g| g.attn_logit_softcapping);
        candle_cp_ops::attention::Scores::new(self.attn_scale()).with_softcap(cap)
    }

    /// The soft cap on the output logits (Gemma 2's `final_logit_softcapping`), if any.
    pub fn final_logit_softcap(&self) -> Option<f64> {
        self.gemma2.as_ref().and_then(|g| g.final_logit_softcapping)
    }

    /// The factor on the embedding output for weights of `dtype` (Gemma 2 and 3: `√h` rounded
    /// to `dtype`, as transformers casts it; Granite's `embedding_multiplier`; `None`: none).
    pub fn embed_scale(&self, dtype: candle_core::DType) -> Result<Option<f64>> {
        // Granite: its embedding_multiplier, a Python float on the embedding (not rounded)
        if let Some(g) = self.granite.as_ref().filter(|g| g.embedding_multiplier != 1.0) {
            return Ok(Some(g.embedding_multiplier));
        }
        if !self.is_gemma() {
            return Ok(None);
        }
        let s = (self.hidden_size as f64).sqrt();
        let t = candle_core::Tensor::new(&[s], &candle_core::Device::Cpu)?.to_dtype(dtype)?.to_dtype(candle_core::DType::F64)?;
        Ok(Some(t.to_vec1::<f64>()?[0]))
    }

    /// The RoPE config of layer `layer`'s rotation: the config itself, or for a Gemma 3
    /// sliding layer one of base `rope_local_base_freq`, unscaled.
    pub fn layer_rope(&self, layer: usize) -> std::borrow::Cow<'_, LlamaConfig> {
        match self.layer_rope_is_local(layer).then(|| self.local_rope()).flatten() {
            Some(local) => std::borrow::Cow::Owned(local),
            None => std::borrow::Cow::Borrowed(self),
        }
    }

    /// The RoPE config of the layers that rotate by the local RoPE (Gemma 3's sliding layers:
    /// base `rope_local_base_freq`, unscaled; OLMo 3's with a scaled RoPE: `rope_theta`,
    /// unscaled), when some layer does.
    pub fn local_rope(&self) -> Option<LlamaConfig> {
        let theta = match (&self.gemma3, self.olmo) {
            (Some(g), _) => g.rope_local_base_freq,
            (None, Some(super::Olmo::Olmo3)) => self.rope_theta,
            _ => return None,
        };
        (0..self.num_hidden_layers).any(|i| self.layer_rope_is_local(i)).then(|| LlamaConfig {
            rope_theta: theta,
            rope_scaling: RopeScaling::Default,
            gemma3: None,
            gemma2: None,
            ..self.clone()
        })
    }

    /// Whether layer `layer` rotates by the local RoPE ([`LlamaConfig::layer_rope`]).
    pub fn layer_rope_is_local(&self, layer: usize) -> bool {
        let olmo3_scaled = self.olmo == Some(super::Olmo::Olmo3) && self.rope_scaling != RopeScaling::Default;
        (self.gemma3.is_some() || olmo3_scaled) && self.layer_window(layer).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Arch, LlamaConfig};

    /// google/gemma-3-1b-pt's config.json as published (transformers 4.50).
    const GEMMA3_1B: &str = r#"{
      "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid",
      "eos_token_id": 1, "final_logit_softcapping": null, "head_dim": 256,
      "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
      "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
      "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
      "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
      "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000,
      "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
      "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144
    }"#;

    fn with(extra: &str) -> String {
        GEMMA3_1B.replacen('{', &format!("{{{extra}"), 1)
    }

    #[test]
    fn published_config_reads_and_round_trips() -> Result<()> {
        let c = LlamaConfig::from_json(GEMMA3_1B)?;
        assert_eq!(c.arch(), Arch::Gemma3);
        assert_eq!((c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.vocab_size), (256, 4, 1, 262144));
        assert!(c.tie_word_embeddings && c.qk_norm && !c.qkv_bias);
        assert_eq!((c.rope_theta, c.rope_scaling.clone()), (1e6, RopeScaling::Default));
        assert_eq!(c.gemma3, Some(Gemma3 { query_pre_attn_scalar: 256.0, rope_local_base_freq: 10000.0 }));
        assert_eq!(c.attn_scale(), 1.0 / 16.0);
        assert_eq!(c.activation(), crate::fused::Activation::GeluTanh);
        // five sliding layers of every six: layers 5, 11, 17, 23 attend fully, with the global RoPE
        let full: Vec<usize> = (0..26).filter(|&i| c.layer_window(i).is_none()).collect();
        assert_eq!(full, vec![5, 11, 17, 23]);
        assert!(c.layer_rope_is_local(0) && !c.layer_rope_is_local(5));
        assert_eq!(c.layer_rope(0).rope_theta, 10000.0);
        assert_eq!(c.layer_rope(5).rope_theta, 1e6);
        // √1152 = 33.94 in bf16: 34.0 (transformers casts the factor to the weights' dtype)
        assert_eq!(c.embed_scale(candle_core::DType::BF16)?, Some(34.0));
        assert!((c.embed_scale(candle_core::DType::F32)?.unwrap_or(0.0) - 1152f64.sqrt()).abs() < 1e-5);
        let text = c.to_hf_json("bfloat16");
        let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some("gemma3_text"), Some("Gemma3ForCausalLM")));
        assert_eq!(v["hidden_activation"].as_str(), Some("gelu_pytorch_tanh"));
        assert_eq!(v["sliding_window_pattern"].as_u64(), Some(6));
        assert_eq!(v["layer_types"].as_array().map(|a| a.len()), Some(26));
        assert!(v.get("hidden_act").is_none() && v.get("rope_parameters").is_none(), "{text}");
        assert!(v["final_logit_softcapping"].is_null());
        assert_eq!(LlamaConfig::from_json(&text)?, c);
        Ok(())
    }

    #[test]
    fn other_spellings_and_defaults() -> Result<()> {
        // gemma-3-4b's linear scaling of the global RoPE
        let c = LlamaConfig::from_json(&with(r#""rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "#).replace(r#""rope_scaling": null,"#, ""))?;
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(c.layer_rope(0).rope_scaling, RopeScaling::Default);
        assert_eq!(LlamaConfig::from_json(&c.to_hf_json("bfloat16"))?, c);
        // transformers 5: one RoPE per layer type
        let v5 = GEMMA3_1B.replace(r#""rope_scaling": null, "rope_theta": 1000000,"#, "").replace(r#""rope_local_base_freq": 10000,"#, "");
        let v5 = v5.replacen('{', r#"{"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, "#, 1);
        let c5 = LlamaConfig::from_json(&v5)?;
        assert_eq!((c5.rope_theta, c5.rope_scaling.clone(), c5.gemma3.clone()), (1e6, RopeScaling::Linear { factor: 8.0 }, c.gemma3.clone()));
        // layer_types wins over the pattern; an absent window is 4096; absent ties are tied
        let types: Vec<&str> = (0..26).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
        let c = LlamaConfig::from_json(&with(&format!(r#""layer_types": {}, "#, serde_json::json!(types))))?;
        assert_eq!((c.layer_window(0), c.layer_window(1)), (Some(512), None));
        let c = LlamaConfig::from_json(&GEMMA3_1B.replace(r#""sliding_window": 512,"#, ""))?;
        assert_eq!(c.sliding_window, Some(4096));
        let c = LlamaConfig::from_json(&GEMMA3_1B.replace(r#""head_dim": 256,"#, "").replace(r#""query_pre_attn_scalar": 256,"#, ""))?;
        assert_eq!((c.head_dim, c.attn_scale()), (256, 1.0 / 16.0));
        Ok(())
    }

    /// google/gemma-3-4b-it's config.json (multimodal): its `text_config` names only what
    /// differs from `Gemma3TextConfig`'s defaults, which fill the rest (8 heads, 4 KV heads of
    /// 256, vocabulary 262208).
    #[test]
    fn multimodal_config_gives_its_text_model() -> Result<()> {
        let mm = r#"{"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
            "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
            "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
            "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14}}"#;
        let c = LlamaConfig::from_json(mm)?;
        assert_eq!(c.arch(), Arch::Gemma3);
        assert_eq!((c.hidden_size, c.intermediate_size, c.num_hidden_layers), (2560, 10240, 34));
        assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size), (8, 4, 256, 262208));
        assert_eq!((c.sliding_window, c.rope_scaling.clone(), c.attn_scale()), (Some(1024), RopeScaling::Linear { factor: 8.0 }, 1.0 / 16.0));
        let full: Vec<usize> = (0..34).filter(|&i| c.layer_window(i).is_none()).collect();
        assert_eq!(full, vec![5, 11, 17, 23, 29]);
        assert!(c.tie_word_embeddings);
        // saved as the text model, read back the same
        assert_eq!(LlamaConfig::from_json(&c.to_hf_json("bfloat16"))?, c);
        Ok(())
    }

    #[test]
    fn what_gemma3_does_not_compute_is_refused() {
        let err = |text: &str| LlamaConfig::from_json(text).err().map(|e| e.to_string()).unwrap_or_default();
        for (text, want) in [
            (GEMMA3_1B.replace(r#""final_logit_softcapping": null"#, r#""final_logit_softcapping": 30.0"#), "final_logit_softcapping: 30.0"),
            (GEMMA3_1B.replace(r#""attn_logit_softcapping": null"#, r#""attn_logit_softcapping": 50.0"#), "attn_logit_softcapping"),
            (GEMMA3_1B.replace("gelu_pytorch_tanh", "gelu"), "`gelu` not supported"),
            (with(r#""use_bidirectional_attention": true, "#), "use_bidirectional_attention"),
            (GEMMA3_1B.replace(r#""model_type": "gemma3_text""#, r#""model_type": "gemma3""#).replace("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), "without a `text_config` object"),
            (GEMMA3_1B.replace(r#""sliding_window_pattern": 6"#, r#""sliding_window_pattern": 0"#), "sliding_window_pattern"),
            (with(r#""rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}, "#), "sliding layers"),
        ] {
            let e = err(&text);
            assert!(e.contains(want), "{want}: {e:?}");
        }
        let mut c = LlamaConfig::tiny(64, 32, 2, 4, 2).with_gemma3(true);
        assert!(c.validate().is_ok());
        c.qk_norm = false;
        assert!(c.validate().err().map(|e| e.to_string()).unwrap_or_default().contains("head norms"));
        let mut c = LlamaConfig::tiny(64, 32, 2, 4, 2).with_gemma3(true);
        if let Some(g) = c.gemma3.as_mut() {
            g.query_pre_attn_scalar = 0.0;
        }
        assert!(c.validate().err().map(|e| e.to_string()).unwrap_or_default().contains("query_pre_attn_scalar"));
    }
}
