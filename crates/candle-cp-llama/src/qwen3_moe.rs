//! Qwen3-MoE (`model_type` `qwen3_moe`, `Qwen3MoeForCausalLM`): a Qwen3 (q, k head norms)
//! whose MLPs are mixtures of experts ([`MoeConfig`], [`super::LlamaConfig::moe`]); and
//! Mixtral (`model_type` `mixtral`, `MixtralForCausalLM`): a Mistral (no head norms, the window
//! on every layer) whose every MLP is one, `num_local_experts` experts `intermediate_size`
//! wide, the top-K probabilities always renormalised ([`MoeStyle`]); and Qwen2-MoE
//! (`model_type` `qwen2_moe`, `Qwen2MoeForCausalLM`: Qwen1.5-MoE, Qwen2-57B-A14B): a Qwen2 (q, k,
//! v biases) whose sparse layers add a **shared expert** — a SwiGLU `shared_expert_intermediate_size`
//! wide that every token goes through, weighted by `sigmoid(x·w_g)` (`shared_expert_gate`).
//!
//! A sparse layer's MLP routes each token to `K = num_experts_per_tok` of `E = num_experts`
//! SwiGLU experts of width `moe_intermediate_size`: router probabilities `softmax(x·Wrᵀ)`
//! (in f32), the top `K` (renormalised to sum 1 when `norm_topk_prob`), the output the
//! probability-weighted sum of the chosen experts' outputs (`moe.rs`). Layer `i` is sparse
//! unless it is in `mlp_only_layers`, when `(i + 1) % decoder_sparse_step == 0`; the others are
//! dense MLPs of width `intermediate_size`.
//!
//! With `output_router_logits: true` the training loss adds `router_aux_loss_coef` times the
//! load-balancing loss of transformers' `load_balancing_loss_func` over every token of the
//! global batch and every sparse layer ([`crate::Llama::loss`]).

use super::{get_bool, get_f64, get_usize, LlamaConfig};
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// [`LlamaConfig::features`]' name of a mixture's.
pub(crate) const MOE: &str = "a mixture of experts";

/// Whose mixture of experts: the checkpoint names and config keys differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeStyle {
    /// Qwen3-MoE: `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`.
    Qwen3Moe,
    /// Mixtral: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.{w1,w3,w2}` (gate, up,
    /// down).
    Mixtral,
    /// Qwen2-MoE: Qwen3-MoE's names, and a shared expert (`mlp.shared_expert.{gate,up,down}_proj`,
    /// `mlp.shared_expert_gate`).
    Qwen2Moe,
    /// gpt-oss: `mlp.router` (with a bias), the experts with biases and the clamped SwiGLU,
    /// stored fused (`mlp.experts.gate_up_proj`, see [`crate::config::gpt_oss`]).
    GptOss,
    /// GraniteMoE: Mixtral's routing (the top-`K` logits' softmax) under Granite's
    /// multipliers, stored as `block_sparse_moe.router.layer` and the experts fused
    /// (`block_sparse_moe.input_linear`, `output_linear`; see [`crate::config::granite_moe`]).
    GraniteMoe,
    /// GLM-4.5 (`Glm4MoeForCausalLM`): sigmoid scores chosen with a correction bias
    /// (`mlp.gate.e_score_correction_bias`), scaled by `routed_scaling_factor`, and shared experts
    /// without a gate (`mlp.shared_experts.{gate,up,down}_proj`; see [`crate::config::glm4_moe`]).
    Glm4Moe,
    /// DeepSeek-V2 (`DeepseekV2ForCausalLM`): softmax scores (f32), the top `K` within the best
    /// `topk_group` of `n_group` expert groups (a group's score its best expert's:
    /// `group_limited_greedy`; `greedy`: one group), weighted by the scores times
    /// `routed_scaling_factor` (not renormalised), and shared experts without a gate
    /// (`mlp.shared_experts.*`; see [`crate::config::deepseek`]).
    DeepseekV2,
}

/// The mixture-of-experts keys of a Qwen3-MoE or Mixtral config (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Qwen3-MoE or Mixtral.
    pub style: MoeStyle,
    /// Experts per sparse layer `E` (`num_experts`, default 128).
    pub num_experts: usize,
    /// Experts per token `K` (`num_experts_per_tok`, default 8).
    pub num_experts_per_tok: usize,
    /// Each expert's MLP width (`moe_intermediate_size`, default 768).
    pub moe_intermediate_size: usize,
    /// Renormalise the top-`K` probabilities to sum 1 (`norm_topk_prob`, default false).
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is sparse (default 1: all).
    pub decoder_sparse_step: usize,
    /// Layers with a dense MLP whatever the step (`mlp_only_layers`, default none).
    pub mlp_only_layers: Vec<usize>,
    /// Weight of the load-balancing loss (`router_aux_loss_coef`, default 0.001).
    pub router_aux_loss_coef: f64,
    /// Whether the training loss includes the load-balancing loss (`output_router_logits`,
    /// default false, as in transformers).
    pub output_router_logits: bool,
    /// The shared expert's width (Qwen2-MoE's `shared_expert_intermediate_size`; GLM-4.5's
    /// `n_shared_experts · moe_intermediate_size`); 0: none.
    pub shared_expert_intermediate_size: usize,
    /// The chosen experts' weights' factor (GLM-4.5's `routed_scaling_factor`; 1 for the others).
    pub routed_scaling_factor: f64,
    /// GLM-4.5's expert groups `(n_group, topk_group)`: a token chooses among the experts of the
    /// `topk_group` groups whose two best scores sum highest; `(1, 1)`: no limit.
    pub groups: (usize, usize),
}

impl MoeConfig {
    /// `E` experts, `K` per token, each `width` wide; the other keys at transformers'
    /// defaults (every layer sparse, no renormalisation, no load-balancing loss).
    pub fn new(num_experts: usize, top_k: usize, width: usize) -> Self {
        Self {
            style: MoeStyle::Qwen3Moe,
            num_experts,
            num_experts_per_tok: top_k,
            moe_intermediate_size: width,
            norm_topk_prob: false,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![],
            router_aux_loss_coef: 0.001,
            output_router_logits: false,
            shared_expert_intermediate_size: 0,
            routed_scaling_factor: 1.0,
            groups: (1, 1),
        }
    }

    /// A Qwen2-MoE of `E` experts, `K` per token, each `width` wide, with a shared expert
    /// `shared` wide; transformers' defaults otherwise (no renormalisation).
    pub fn qwen2_moe(num_experts: usize, top_k: usize, width: usize, shared: usize) -> Self {
        Self { style: MoeStyle::Qwen2Moe, shared_expert_intermediate_size: shared, ..Self::new(num_experts, top_k, width) }
    }

    /// A Mixtral of `E` experts, `K` per token, each `width` wide (= the config's
    /// `intermediate_size`), renormalised, transformers' defaults otherwise.
    pub fn mixtral(num_experts: usize, top_k: usize, width: usize) -> Self {
        Self { style: MoeStyle::Mixtral, norm_topk_prob: true, ..Self::new(num_experts, top_k, width) }
    }

    /// A gpt-oss mixture of `E` experts, `K` per token, each `width` wide (= the config's
    /// `intermediate_size`): the top-`K` logits' softmax (renormalised), biases, the clamped
    /// SwiGLU ([`crate::config::gpt_oss`]).
    pub fn gpt_oss(num_experts: usize, top_k: usize, width: usize) -> Self {
        Self { style: MoeStyle::GptOss, norm_topk_prob: true, router_aux_loss_coef: 0.9, ..Self::new(num_experts, top_k, width) }
    }

    /// A GraniteMoE mixture of `E` experts, `K` per token, each `width` wide (= the config's
    /// `intermediate_size`), renormalised, `GraniteMoeConfig`'s defaults otherwise.
    pub fn granite_moe(num_experts: usize, top_k: usize, width: usize) -> Self {
        Self { style: MoeStyle::GraniteMoe, norm_topk_prob: true, ..Self::new(num_experts, top_k, width) }
    }

    /// A GLM-4.5 mixture of `E` experts, `K` per token, each `width` wide, with `shared` shared
    /// experts as wide (one SwiGLU `shared · width` wide), the top-`K` sigmoid scores
    /// renormalised and scaled by `scale`; no load-balancing loss ([`crate::config::glm4_moe`]).
    pub fn glm4_moe(num_experts: usize, top_k: usize, width: usize, shared: usize, scale: f64) -> Self {
        Self { style: MoeStyle::Glm4Moe, norm_topk_prob: true, shared_expert_intermediate_size: shared * width, routed_scaling_factor: scale, router_aux_loss_coef: 0.0, ..Self::new(num_experts, top_k, width) }
    }

    /// A DeepSeek-V2 mixture of `E` experts, `K` per token, each `width` wide, with `shared`
    /// shared experts as wide, the top-`K` softmax scores (within the expert groups,
    /// [`MoeConfig::groups`]) times `scale`; no load-balancing loss
    /// ([`crate::config::deepseek`]).
    pub fn deepseek_v2(num_experts: usize, top_k: usize, width: usize, shared: usize, scale: f64) -> Self {
        Self { style: MoeStyle::DeepseekV2, norm_topk_prob: false, shared_expert_intermediate_size: shared * width, routed_scaling_factor: scale, router_aux_loss_coef: 0.0, ..Self::new(num_experts, top_k, width) }
    }

    /// The module of a sparse layer's MLP in checkpoint names: `mlp` or `block_sparse_moe`.
    pub fn module(&self) -> &'static str {
        match self.style {
            MoeStyle::Qwen3Moe | MoeStyle::Qwen2Moe | MoeStyle::GptOss | MoeStyle::Glm4Moe | MoeStyle::DeepseekV2 => "mlp",
            MoeStyle::Mixtral | MoeStyle::GraniteMoe => "block_sparse_moe",
        }
    }

    /// The router's name in the module: `gate` (`{module}.gate.weight`), gpt-oss's `router`
    /// (`mlp.router.weight`, `mlp.router.bias`).
    pub fn router(&self) -> &'static str {
        match self.style {
            MoeStyle::GptOss => "router",
            _ => "gate",
        }
    }

    /// Whether the router and the experts carry biases (gpt-oss).
    pub fn biases(&self) -> bool {
        self.style == MoeStyle::GptOss
    }

    /// The shared expert's module in the sparse layer's: Qwen2-MoE's `shared_expert` (gated by
    /// `shared_expert_gate`), GLM-4.5's `shared_experts` (no gate).
    pub fn shared_module(&self) -> &'static str {
        match self.style {
            MoeStyle::Glm4Moe | MoeStyle::DeepseekV2 => "shared_experts",
            _ => "shared_expert",
        }
    }

    /// Whether the shared expert's output is weighted by `sigmoid(x·w)` (Qwen2-MoE's
    /// `shared_expert_gate`).
    pub fn shared_gate(&self) -> bool {
        !matches!(self.style, MoeStyle::Glm4Moe | MoeStyle::DeepseekV2)
    }

    /// Whether the router's logits are taken in f32 from 16-bit inputs (GLM-4.5's and the
    /// DeepSeek routers, as transformers casts them).
    pub fn f32_logits(&self) -> bool {
        matches!(self.style, MoeStyle::Glm4Moe | MoeStyle::DeepseekV2)
    }

    /// Whether the router scores by sigmoid with a correction bias choosing the experts
    /// (GLM-4.5's `mlp.gate.e_score_correction_bias`) instead of a softmax.
    pub fn sigmoid_scores(&self) -> bool {
        self.style == MoeStyle::Glm4Moe
    }
}

/// The keys of a `mixtral` config (`MixtralConfig`'s defaults: 8 experts, 2 per token; the
/// expert width is `intermediate_size`). A router jitter is refused (noise this model does not
/// draw).
pub(super) fn parse_mixtral(m: &Map<String, Value>, width: usize) -> Result<MoeConfig> {
    let mut c = MoeConfig::mixtral(get_usize(m, "num_local_experts")?.unwrap_or(8), get_usize(m, "num_experts_per_tok")?.unwrap_or(2), width);
    if let Some(b) = get_bool(m, "output_router_logits")? {
        c.output_router_logits = b;
    }
    if let Some(x) = get_f64(m, "router_aux_loss_coef")? {
        c.router_aux_loss_coef = x;
    }
    if get_f64(m, "router_jitter_noise")?.is_some_and(|j| j != 0.0) {
        bail!("config.json: `router_jitter_noise` other than 0 not supported (the router's training noise)")
    }
    Ok(c)
}

/// The keys of a `gpt_oss` config (its defaults filled by `gpt_oss::with_defaults`; the expert
/// width is `intermediate_size`; `experts_per_token`, openai's spelling, read when
/// `num_experts_per_tok` is absent).
pub(super) fn parse_gpt_oss(m: &Map<String, Value>, width: usize) -> Result<MoeConfig> {
    let k = match get_usize(m, "num_experts_per_tok")? {
        Some(k) => k,
        None => get_usize(m, "experts_per_token")?.unwrap_or(4),
    };
    let mut c = MoeConfig::gpt_oss(get_usize(m, "num_local_experts")?.unwrap_or(128), k, width);
    if let Some(x) = get_f64(m, "router_aux_loss_coef")? {
        c.router_aux_loss_coef = x;
    }
    Ok(c)
}

/// The Qwen3-MoE keys of a `qwen3_moe` config, defaults filled as `Qwen3MoeConfig` does.
pub(super) fn parse(m: &Map<String, Value>) -> Result<MoeConfig> {
    if m.get("shared_expert_intermediate_size").and_then(|v| v.as_u64()).is_some_and(|s| s > 0) {
        bail!("config.json: `shared_expert_intermediate_size` (a shared expert: Qwen2-MoE, model_type qwen2_moe) in a qwen3_moe config")
    }
    parse_with(m, MoeConfig::new(128, 8, 768))
}

/// The keys of a `qwen2_moe` config, defaults filled as `Qwen2MoeConfig` does (60 experts, 4 per
/// token, 1408 wide, a shared expert 5632 wide).
pub(super) fn parse_qwen2(m: &Map<String, Value>) -> Result<MoeConfig> {
    let mut c = parse_with(m, MoeConfig::qwen2_moe(60, 4, 1408, 5632))?;
    if let Some(s) = get_usize(m, "shared_expert_intermediate_size")? {
        c.shared_expert_intermediate_size = s;
    }
    Ok(c)
}

/// The keys Qwen2-MoE, Qwen3-MoE and OLMoE share, over the defaults `c`.
pub(super) fn parse_with(m: &Map<String, Value>, mut c: MoeConfig) -> Result<MoeConfig> {
    for (k, slot) in [
        ("num_experts", &mut c.num_experts),
        ("num_experts_per_tok", &mut c.num_experts_per_tok),
        ("moe_intermediate_size", &mut c.moe_intermediate_size),
        ("decoder_sparse_step", &mut c.decoder_sparse_step),
    ] {
        if let Some(v) = get_usize(m, k)? {
            *slot = v;
        }
    }
    for (k, slot) in [("norm_topk_prob", &mut c.norm_topk_prob), ("output_router_logits", &mut c.output_router_logits)] {
        if let Some(b) = get_bool(m, k)? {
            *slot = b;
        }
    }
    if let Some(x) = get_f64(m, "router_aux_loss_coef")? {
        c.router_aux_loss_coef = x;
    }
    match m.get("mlp_only_layers") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for v in a {
                match v.as_u64() {
                    Some(i) => c.mlp_only_layers.push(i as usize),
                    None => bail!("config.json: `mlp_only_layers` entries must be layer indices, got {v}"),
                }
            }
        }
        Some(v) => bail!("config.json: `mlp_only_layers` must be a list of layer indices, got {v}"),
    }
    Ok(c)
}

/// Errors for numbers that give no model (`1 <= K <= E`, widths > 0, step >= 1, layers that
/// exist, a finite coefficient >= 0).
pub(super) fn validate(c: &MoeConfig, layers: usize) -> Result<()> {
    if c.num_experts == 0 || c.num_experts_per_tok == 0 || c.num_experts_per_tok > c.num_experts {
        bail!(
            "LlamaConfig: a mixture of experts needs 1 <= num_experts_per_tok ({}) <= num_experts ({})",
            c.num_experts_per_tok,
            c.num_experts
        )
    }
    if c.moe_intermediate_size == 0 || c.decoder_sparse_step == 0 {
        bail!(
            "LlamaConfig: moe_intermediate_size ({}) and decoder_sparse_step ({}) must be > 0",
            c.moe_intermediate_size,
            c.decoder_sparse_step
        )
    }
    if let Some(i) = c.mlp_only_layers.iter().find(|&&i| i >= layers) {
        bail!("LlamaConfig: mlp_only_layers names layer {i} of a model with {layers} layers")
    }
    if !(c.router_aux_loss_coef.is_finite() && c.router_aux_loss_coef >= 0.0) {
        bail!("LlamaConfig: router_aux_loss_coef must be finite and >= 0, got {}", c.router_aux_loss_coef)
    }
    Ok(())
}

/// The mixture-of-experts keys `to_hf_json` adds (Qwen3-MoE's, or Mixtral's).
pub(super) fn write(m: &mut Map<String, Value>, c: &MoeConfig) {
    if c.style == MoeStyle::GptOss {
        m.insert("num_local_experts".into(), json!(c.num_experts));
        m.insert("num_experts_per_tok".into(), json!(c.num_experts_per_tok));
        m.insert("experts_per_token".into(), json!(c.num_experts_per_tok));
        m.insert("router_aux_loss_coef".into(), json!(c.router_aux_loss_coef));
        m.insert("output_router_logits".into(), json!(false));
        return;
    }
    if c.style == MoeStyle::GraniteMoe {
        m.insert("num_local_experts".into(), json!(c.num_experts));
        m.insert("num_experts_per_tok".into(), json!(c.num_experts_per_tok));
        m.insert("router_aux_loss_coef".into(), json!(c.router_aux_loss_coef));
        m.insert("output_router_logits".into(), json!(c.output_router_logits));
        return;
    }
    if c.style == MoeStyle::Mixtral {
        m.insert("num_local_experts".into(), json!(c.num_experts));
        m.insert("num_experts_per_tok".into(), json!(c.num_experts_per_tok));
        m.insert("router_aux_loss_coef".into(), json!(c.router_aux_loss_coef));
        m.insert("output_router_logits".into(), json!(c.output_router_logits));
        m.insert("router_jitter_noise".into(), json!(0.0));
        return;
    }
    m.insert("num_experts".into(), json!(c.num_experts));
    m.insert("num_experts_per_tok".into(), json!(c.num_experts_per_tok));
    m.insert("moe_intermediate_size".into(), json!(c.moe_intermediate_size));
    m.insert("norm_topk_prob".into(), json!(c.norm_topk_prob));
    m.insert("decoder_sparse_step".into(), json!(c.decoder_sparse_step));
    m.insert("mlp_only_layers".into(), json!(c.mlp_only_layers));
    m.insert("router_aux_loss_coef".into(), json!(c.router_aux_loss_coef));
    m.insert("output_router_logits".into(), json!(c.output_router_logits));
    if c.style == MoeStyle::Qwen2Moe {
        m.insert("shared_expert_intermediate_size".into(), json!(c.shared_expert_intermediate_size));
    }
}

impl LlamaConfig {
    /// The same config as a Qwen3-MoE model with `moe` (q, k head norms on), or a Mixtral
    /// (head norms off, `intermediate_size` the experts' width; see [`LlamaConfig::moe`]), or
    /// without experts (`None`).
    pub fn with_moe(mut self, moe: Option<MoeConfig>) -> Self {
        match moe.as_ref().map(|m| (m.style, m.moe_intermediate_size)) {
            Some((MoeStyle::Qwen3Moe, _)) => self.qk_norm = true,
            Some((MoeStyle::Qwen2Moe, _)) => (self.qk_norm, self.qkv_bias) = (false, true),
            Some((MoeStyle::Mixtral, w)) => (self.qk_norm, self.intermediate_size) = (false, w),
            Some((MoeStyle::GptOss, w)) => (self.qk_norm, self.qkv_bias, self.intermediate_size, self.gpt_oss) = (false, true, w, true),
            // (Granite's multipliers, 1 unless set)
            Some((MoeStyle::GraniteMoe, w)) => {
                (self.qk_norm, self.qkv_bias, self.intermediate_size) = (false, false, w);
                self.granite.get_or_insert_with(Default::default);
            }
            // (GLM-4.5: q, k, v biases and head norms as its config says; RoPE on half of each
            // head by default, in the half form)
            // (DeepSeek-V3's latent attention: its own RoPE width)
            Some((MoeStyle::Glm4Moe, _)) if self.mla.is_none() => self.partial_rotary_factor = 0.5,
            Some((MoeStyle::Glm4Moe, _)) => {}
            Some((MoeStyle::DeepseekV2, _)) => {}
            None => {}
        }
        self.moe = moe;
        self
    }

    /// Whether layer `layer`'s MLP is a mixture of experts (see the module doc).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match &self.moe {
            None => false,
            Some(c) => !c.mlp_only_layers.contains(&layer) && (layer + 1).is_multiple_of(c.decoder_sparse_step.max(1)),
        }
    }

    /// The sparse layers' count.
    pub fn moe_layers(&self) -> usize {
        (0..self.num_hidden_layers).filter(|&i| self.is_moe_layer(i)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Arch;

    /// Qwen/Qwen3-30B-A3B's config.json as published.
    pub(crate) const QWEN3_30B_A3B: &str = r#"{
      "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
      "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
      "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
      "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
      "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
      "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
      "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
      "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
      "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
    }"#;

    #[test]
    fn published_config_reads_and_round_trips() -> Result<()> {
        let c = LlamaConfig::from_json(QWEN3_30B_A3B)?;
        assert_eq!(c.arch(), Arch::Qwen3Moe);
        assert!(c.qk_norm && !c.qkv_bias);
        let m = c.moe.clone().expect("moe");
        assert_eq!((m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob), (128, 8, 768, true));
        assert_eq!((c.moe_layers(), c.intermediate_size, c.sliding_window), (48, 6144, None));
        let text = c.to_hf_json("bfloat16");
        let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some("qwen3_moe"), Some("Qwen3MoeForCausalLM")));
        assert_eq!((v["num_experts"].as_u64(), v["norm_topk_prob"].as_bool()), (Some(128), Some(true)));
        assert_eq!(LlamaConfig::from_json(&text)?, c);
        Ok(())
    }

    #[test]
    fn sparse_layers_defaults_and_refusals() -> Result<()> {
        let base = QWEN3_30B_A3B.replace(r#""num_hidden_layers": 48"#, r#""num_hidden_layers": 6"#);
        let c = LlamaConfig::from_json(&base.replace(r#""decoder_sparse_step": 1"#, r#""decoder_sparse_step": 2"#).replace(r#""mlp_only_layers": []"#, r#""mlp_only_layers": [3]"#))?;
        let sparse: Vec<usize> = (0..6).filter(|&i| c.is_moe_layer(i)).collect();
        assert_eq!(sparse, vec![1, 5]);
        // absent keys: Qwen3MoeConfig's defaults
        let c = LlamaConfig::from_json(r#"{"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#)?;
        assert_eq!(c.moe, Some(MoeConfig::new(128, 8, 768)));
        let err = |text: &str| LlamaConfig::from_json(text).err().map(|e| e.to_string()).unwrap_or_default();
        for (text, want) in [
            (base.replace(r#""num_experts_per_tok": 8"#, r#""num_experts_per_tok": 129"#), "num_experts_per_tok (129) <= num_experts (128)"),
            (base.replace(r#""mlp_only_layers": []"#, r#""mlp_only_layers": [6]"#), "layer 6 of a model with 6 layers"),
            (base.replace(r#""decoder_sparse_step": 1"#, r#""decoder_sparse_step": 0"#), "decoder_sparse_step (0)"),
            (base.replace(r#""norm_topk_prob": true"#, r#""norm_topk_prob": 1"#), "`norm_topk_prob` must be true or false"),
            (base.replace(r#""router_aux_loss_coef": 0.001"#, r#""router_aux_loss_coef": -1"#), "router_aux_loss_coef must be finite"),
            (base.replace(r#""decoder_sparse_step": 1"#, r#""decoder_sparse_step": 1, "shared_expert_intermediate_size": 512"#), "shared expert"),
        ] {
            let e = err(&text);
            assert!(e.contains(want), "{want}: {e:?}");
        }
        // a mixture of experts is Qwen3-MoE: q, k norms, no biases, no Gemma
        let mut c = LlamaConfig::tiny(64, 32, 2, 4, 2).with_moe(Some(MoeConfig::new(4, 2, 16)));
        assert!(c.validate().is_ok() && c.arch() == Arch::Qwen3Moe);
        c.qk_norm = false;
        assert!(c.validate().err().map(|e| e.to_string()).unwrap_or_default().contains("Qwen3-MoE"));
        Ok(())
    }

    /// Qwen/Qwen1.5-MoE-A2.7B's config.json as published.
    const QWEN15_MOE: &str = r#"{
      "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
      "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
      "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
      "norm_topk_prob": false, "num_attention_heads": 16, "num_experts": 60,
      "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
      "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
      "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 5632,
      "sliding_window": 32768, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.40.0.dev0", "use_cache": true, "use_sliding_window": false,
      "vocab_size": 151936
    }"#;

    #[test]
    fn qwen2_moe_config_reads_and_round_trips() -> Result<()> {
        let c = LlamaConfig::from_json(QWEN15_MOE)?;
        assert_eq!(c.arch(), Arch::Qwen2Moe);
        assert!(c.qkv_bias && !c.qk_norm && c.sliding_window.is_none());
        let m = c.moe.clone().expect("moe");
        assert_eq!((m.style, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size), (MoeStyle::Qwen2Moe, 60, 4, 1408, 5632));
        assert!(!m.norm_topk_prob && c.moe_layers() == 24);
        let text = c.to_hf_json("bfloat16");
        let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some("qwen2_moe"), Some("Qwen2MoeForCausalLM")));
        assert_eq!(v["shared_expert_intermediate_size"].as_u64(), Some(5632));
        assert_eq!(LlamaConfig::from_json(&text)?, c);
        // a shared expert in a qwen3_moe config is not Qwen3-MoE's
        let e = LlamaConfig::from_json(&QWEN15_MOE.replace("qwen2_moe", "qwen3_moe").replace("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("shared_expert_intermediate_size"), "{e}");
        Ok(())
    }

    /// mistralai/Mixtral-8x7B-v0.1's config.json as published.
    const MIXTRAL_8X7B: &str = r#"{
      "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
      "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
      "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
      "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
      "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000
    }"#;

    #[test]
    fn mixtral_config_reads_and_round_trips() -> Result<()> {
        let c = LlamaConfig::from_json(MIXTRAL_8X7B)?;
        assert_eq!(c.arch(), Arch::Mixtral);
        assert!(!c.qk_norm && !c.qkv_bias && c.sliding_window.is_none());
        let m = c.moe.clone().expect("moe");
        assert_eq!((m.style, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob), (MoeStyle::Mixtral, 8, 2, 14336, true));
        assert_eq!((m.router_aux_loss_coef, m.module(), c.moe_layers()), (0.02, "block_sparse_moe", 32));
        let text = c.to_hf_json("bfloat16");
        let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some("mixtral"), Some("MixtralForCausalLM")));
        assert_eq!((v["num_local_experts"].as_u64(), v["intermediate_size"].as_u64()), (Some(8), Some(14336)));
        assert_eq!(LlamaConfig::from_json(&text)?, c);
        // a window on every layer (Mistral's rule); a router jitter refused
        let w = LlamaConfig::from_json(&MIXTRAL_8X7B.replace(r#""sliding_window": null"#, r#""sliding_window": 4096"#))?;
        assert_eq!((w.layer_window(0), w.layer_window(31)), (Some(4096), Some(4096)));
        let e = LlamaConfig::from_json(&MIXTRAL_8X7B.replace(r#""use_cache": true"#, r#""router_jitter_noise": 0.1"#)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("router_jitter_noise"), "{e}");
        // Mixtral has no head norms, and its experts are intermediate_size wide
        let mut c = LlamaConfig::tiny(64, 32, 2, 4, 2).with_moe(Some(MoeConfig::mixtral(4, 2, 16)));
        assert!(c.validate().is_ok() && c.arch() == Arch::Mixtral && c.intermediate_size == 16);
        c.intermediate_size = 20;
        assert!(c.validate().err().map(|e| e.to_string()).unwrap_or_default().contains("intermediate_size"));
        Ok(())
    }
}
