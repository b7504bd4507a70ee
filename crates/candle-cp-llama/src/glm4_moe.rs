//! GLM-4.5 (`model_type` `glm4_moe`, `Glm4MoeForCausalLM`: Zhipu's GLM-4.5, GLM-4.5-Air,
//! GLM-4.6): a Llama (norms before each branch, RoPE on the first half of each head in the
//! usual half form, q, k, v biases with `attention_bias`, Qwen3's head norms with
//! `use_qk_norm`) whose MLPs from layer `first_k_dense_replace` on are mixtures of experts
//! ([`MoeStyle::Glm4Moe`]):
//!
//! ```text
//!  s = sigmoid(x·Wrᵀ)  [N, E] (x, Wr cast to f32, as transformers does)   scores
//!  c = s + b                                   b: mlp.gate.e_score_correction_bias [E] (f32)
//!  groups: c split into n_group groups of E/n_group; a group's score the sum of its two best;
//!          the topk_group best groups kept, the others' c set to 0
//!  chosen = top K of c;  w_k = s_k / Σ s_k (norm_topk_prob) · routed_scaling_factor
//!  y = Σ_k w_k · expert_k(x)  +  shared(x)     shared: one SwiGLU n_shared_experts · Ie wide, no gate
//! ```
//!
//! The correction bias only chooses: `y` does not depend on it where the choice does not
//! change, so its gradient is zero (the model gives it a zero gradient; transformers keeps it a
//! buffer), and training leaves it as loaded. It is read, held and written in f32 whatever the
//! model's dtype (transformers' `_keep_in_fp32_modules_strict`): rounded to bf16 it would move
//! the choice of near-tied experts. There is no load-balancing term (transformers computes none
//! for this model; `output_router_logits: true` is refused by name).
//!
//! Checkpoints name the experts as Qwen3-MoE's (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
//! or transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj`), the router
//! `mlp.gate.weight`, the shared experts `mlp.shared_experts.{gate,up,down}_proj.weight`. The
//! multi-token-prediction layers published after the last decoder layer
//! (`num_nextn_predict_layers`, `model.layers.{L}.*`) are not read, as transformers does not
//! read them, and a saved checkpoint has none (`num_nextn_predict_layers: 0`).

use super::qwen3_moe::{MoeConfig, MoeStyle};
use super::{get_bool, get_f64, get_usize, Arch, LlamaConfig};
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// A `glm4_moe` config with `Glm4MoeConfig`'s defaults where it leaves them out; `None` for
/// another architecture.
pub(crate) fn with_defaults(m: &Map<String, Value>) -> Option<Map<String, Value>> {
    if Arch::of_config(m).ok() != Some(Arch::Glm4Moe) {
        return None;
    }
    let mut t = m.clone();
    for (k, v) in [
        ("partial_rotary_factor", json!(0.5)),
        ("attention_bias", json!(false)),
        ("rms_norm_eps", json!(1e-5)),
        ("use_qk_norm", json!(false)),
    ] {
        t.entry(k).or_insert(v);
    }
    Some(t)
}

/// The mixture's keys of a `glm4_moe` config (`Glm4MoeConfig`'s defaults: 128 experts
/// (`n_routed_experts`), 8 per token, 1408 wide, one shared expert, scale 1, one group, the
/// first layer dense, renormalised).
pub(super) fn parse(m: &Map<String, Value>, layers: usize) -> Result<MoeConfig> {
    let e = match get_usize(m, "n_routed_experts")? {
        Some(e) => e,
        None => get_usize(m, "num_experts")?.unwrap_or(128),
    };
    let width = get_usize(m, "moe_intermediate_size")?.unwrap_or(1408);
    let scale = get_f64(m, "routed_scaling_factor")?.unwrap_or(1.0);
    let mut c = MoeConfig::glm4_moe(e, get_usize(m, "num_experts_per_tok")?.unwrap_or(8), width, get_usize(m, "n_shared_experts")?.unwrap_or(1), scale);
    c.groups = (get_usize(m, "n_group")?.unwrap_or(1), get_usize(m, "topk_group")?.unwrap_or(1));
    let dense = get_usize(m, "first_k_dense_replace")?.unwrap_or(1);
    c.mlp_only_layers = (0..dense.min(layers)).collect();
    if let Some(b) = get_bool(m, "norm_topk_prob")? {
        c.norm_topk_prob = b;
    }
    if get_bool(m, "output_router_logits")? == Some(true) {
        bail!("config.json: `output_router_logits: true` on a glm4_moe model: transformers computes no load-balancing loss for its sigmoid router, nor does this model")
    }
    Ok(c)
}

/// Whether the config's `use_qk_norm` is on.
pub(super) fn qk_norm(m: &Map<String, Value>) -> Result<bool> {
    Ok(get_bool(m, "use_qk_norm")?.unwrap_or(false))
}

/// Whether checkpoint tensor `name` belongs to a GLM-4.5 model's multi-token-prediction layers
/// (`model.layers.{i}.*` from `i = num_hidden_layers` on), which the model does not read.
pub(crate) fn is_next_token_layer(cfg: &LlamaConfig, name: &str) -> bool {
    matches!(cfg.arch(), Arch::Glm4Moe | Arch::DeepseekV3)
        && name.strip_prefix("model.layers.").and_then(|r| r.split_once('.')).and_then(|(i, _)| i.parse::<usize>().ok()).is_some_and(|i| i >= cfg.num_hidden_layers)
}

/// GLM-4.5's keys of config.json.
pub(crate) fn write(m: &mut Map<String, Value>, cfg: &LlamaConfig, c: &MoeConfig) {
    for k in ["mlp_bias", "pretraining_tp", "use_sliding_window", "sliding_window", "num_experts", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"] {
        m.remove(k);
    }
    let shared = c.shared_expert_intermediate_size / c.moe_intermediate_size.max(1);
    for (k, v) in [
        ("partial_rotary_factor", json!(cfg.partial_rotary_factor)),
        ("attention_bias", json!(cfg.qkv_bias)),
        ("use_qk_norm", json!(cfg.qk_norm)),
        ("n_routed_experts", json!(c.num_experts)),
        ("num_experts_per_tok", json!(c.num_experts_per_tok)),
        ("moe_intermediate_size", json!(c.moe_intermediate_size)),
        ("n_shared_experts", json!(shared)),
        ("routed_scaling_factor", json!(c.routed_scaling_factor)),
        ("n_group", json!(c.groups.0)),
        ("topk_group", json!(c.groups.1)),
        ("first_k_dense_replace", json!(c.mlp_only_layers.len())),
        ("norm_topk_prob", json!(c.norm_topk_prob)),
        ("num_nextn_predict_layers", json!(0)),
    ] {
        m.insert(k.into(), v);
    }
}

/// A GLM-4.5 config's invariants: its mixture from layer `k` on (the first `k` dense), shared
/// experts a whole number of experts wide, groups that divide the experts and leave `K` to
/// choose from, no window, no load-balancing term, nothing of another architecture.
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    // (DeepSeek-V2's mixture: the same keys and checks, a softmax router never renormalised)
    let Some(m) = cfg.moe.as_ref().filter(|m| matches!(m.style, MoeStyle::Glm4Moe | MoeStyle::DeepseekV2)) else { return Ok(()) };
    if m.style == MoeStyle::DeepseekV2 && m.norm_topk_prob {
        bail!("LlamaConfig: DeepSeek-V2's chosen scores are not renormalised (norm_topk_prob), as transformers runs it")
    }
    // (DeepSeek-V3: this mixture beside the latent attention; the errors name the model)
    let who = match cfg.arch() {
        Arch::DeepseekV3 => "DeepSeek-V3",
        Arch::DeepseekV2 => "DeepSeek-V2",
        _ => "GLM-4.5",
    };
    let own = [super::qwen3_moe::MOE, "q, k, v biases", "q, k head norms", super::deepseek::MLA];
    if let Some((what, _)) = cfg.features().into_iter().find(|(w, on)| *on && !own.contains(w)) {
        bail!("LlamaConfig: {who} with {what}: no architecture this model writes has both")
    }
    if let Some(w) = cfg.sliding_window {
        bail!("LlamaConfig: {who} with a sliding window ({w}): its config has none, so a saved checkpoint would load as another model")
    }
    let k = m.mlp_only_layers.len();
    if m.decoder_sparse_step != 1 || m.mlp_only_layers != (0..k).collect::<Vec<_>>() || k >= cfg.num_hidden_layers.max(1) {
        bail!(
            "LlamaConfig: {who}'s dense layers are its first first_k_dense_replace ones, fewer than its {} layers, every later one sparse (mlp_only_layers {:?}, decoder_sparse_step {})",
            cfg.num_hidden_layers,
            m.mlp_only_layers,
            m.decoder_sparse_step
        )
    }
    let (is, ie) = (m.shared_expert_intermediate_size, m.moe_intermediate_size);
    if ie == 0 || !is.is_multiple_of(ie) {
        bail!("LlamaConfig: {who}'s shared experts are n_shared_experts · moe_intermediate_size wide: {is} is not a multiple of {ie}")
    }
    let ((g, tg), e, kk) = (m.groups, m.num_experts, m.num_experts_per_tok);
    if g == 0 || tg == 0 || tg > g || !e.is_multiple_of(g) || (g > 1 && e / g < 2) || kk > tg * (e / g) {
        bail!("LlamaConfig: {who}'s expert groups: n_group {g} must divide the {e} experts (two or more per group with several), 1 <= topk_group {tg} <= n_group, and the kept groups hold num_experts_per_tok {kk}")
    }
    if !(m.routed_scaling_factor.is_finite() && m.routed_scaling_factor > 0.0) {
        bail!("LlamaConfig: routed_scaling_factor must be finite and > 0, got {}", m.routed_scaling_factor)
    }
    if m.output_router_logits {
        bail!("LlamaConfig: {who} with the load-balancing loss (output_router_logits): its router has none")
    }
    super::qwen3_moe::validate(m, cfg.num_hidden_layers)
}

#[cfg(test)]
#[path = "glm4_moe_tests.rs"]
mod tests;
