//! GraniteMoE (`model_type` `granitemoe`, `GraniteMoeForCausalLM`: IBM's Granite 3.x MoE models,
//! granite-3.1-1b-a400m and 3b-a800m): a Granite ([`crate::config::granite`]: embedding,
//! attention, residual and logit multipliers) whose every MLP is a mixture of
//! `num_local_experts` SwiGLU experts `intermediate_size` wide, `num_experts_per_tok` per token.
//!
//! Its router (`GraniteMoeTopKGating`) takes each token's top `K` logits and their softmax: the
//! full softmax's top `K` renormalised, Mixtral's routing ([`MoeStyle::GraniteMoe`] runs as
//! [`MoeConfig::norm_topk_prob`]). The load-balancing term (`output_router_logits`) is Mixtral's.
//! Its checkpoints hold the experts fused, which this module converts on load and save (the
//! model keeps Mixtral's stacked parameters):
//!
//! | the model's parameter                               | GraniteMoE's checkpoint tensor                               |
//! |-----------------------------------------------------|--------------------------------------------------------------|
//! | `block_sparse_moe.gate.weight` `[E, h]`             | `block_sparse_moe.router.layer.weight` `[E, h]`              |
//! | `block_sparse_moe.experts.gate_proj` `[E, I, h]`    | rows `0..I` of `block_sparse_moe.input_linear.weight` `[E, 2·I, h]` |
//! | `block_sparse_moe.experts.up_proj` `[E, I, h]`      | rows `I..2·I` of it (`chunk(2)`: the gate first)             |
//! | `block_sparse_moe.experts.down_proj` `[E, h, I]`    | `block_sparse_moe.output_linear.weight` `[E, h, I]`          |
//!
//! LoRA adapts its attention projections only: PEFT's `target_modules` cannot name the fused
//! experts (no linear modules), and its router `router.layer` is refused rather than trained
//! under another name.

use super::qwen3_moe::{MoeConfig, MoeStyle};
use super::{get_usize, LlamaConfig};
use candle_core::{bail, Result, Tensor};
use serde_json::{Map, Value};

/// The model's parameters (suffixes) and the checkpoint tensor each is part of: (suffix,
/// checkpoint suffix, part); part 0 / 1 of `input_linear` the gate / up rows.
const PARTS: [(&str, &str, usize); 4] = [
    ("block_sparse_moe.gate.weight", "block_sparse_moe.router.layer.weight", 0),
    ("block_sparse_moe.experts.gate_proj", "block_sparse_moe.input_linear.weight", 0),
    ("block_sparse_moe.experts.up_proj", "block_sparse_moe.input_linear.weight", 1),
    ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight", 0),
];

/// The keys of a `granitemoe` config: Mixtral's (`GraniteMoeConfig`'s defaults are
/// `MixtralConfig`'s: 8 experts, 2 per token, the expert width `intermediate_size`).
pub(super) fn parse(m: &Map<String, Value>, width: usize) -> Result<MoeConfig> {
    // (granitemoeshared's shared MLP: another model_type, refused by name before this)
    if get_usize(m, "shared_intermediate_size")?.is_some_and(|s| s > 0) {
        bail!("config.json: `shared_intermediate_size` (GraniteMoeShared's shared MLP) not supported")
    }
    Ok(MoeConfig { style: MoeStyle::GraniteMoe, ..super::qwen3_moe::parse_mixtral(m, width)? })
}

/// A GraniteMoE config's invariants: its mixture on every layer, `intermediate_size` wide,
/// with Granite's multipliers and nothing of another architecture; LoRA on no sparse-layer
/// module (see the module doc).
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    let Some(m) = cfg.moe.as_ref().filter(|m| m.style == MoeStyle::GraniteMoe) else { return Ok(()) };
    if cfg.granite.is_none() || cfg.qkv_bias || cfg.qk_norm || cfg.is_gemma() || cfg.phi3 || cfg.gpt_oss || cfg.olmo.is_some() || cfg.exaone4 || cfg.nope_layers.is_some() {
        bail!("LlamaConfig: a GraniteMoE mixture goes with Granite's multipliers and no other architecture's features ({:?})", cfg.features().iter().filter(|(_, on)| *on).map(|(w, _)| *w).collect::<Vec<_>>())
    }
    if m.moe_intermediate_size != cfg.intermediate_size || !m.mlp_only_layers.is_empty() || m.decoder_sparse_step != 1 || !m.norm_topk_prob || m.shared_expert_intermediate_size > 0 {
        bail!(
            "LlamaConfig: GraniteMoE's experts are intermediate_size ({}) wide ({} given) on every layer (mlp_only_layers {:?}, decoder_sparse_step {}), renormalised (norm_topk_prob {}), without a shared expert",
            cfg.intermediate_size,
            m.moe_intermediate_size,
            m.mlp_only_layers,
            m.decoder_sparse_step,
            m.norm_topk_prob
        )
    }
    if let Some(w) = cfg.sliding_window {
        bail!("LlamaConfig: GraniteMoE with a sliding window ({w}): GraniteMoeConfig has none, so a saved checkpoint would load as another model")
    }
    if let Some(l) = &cfg.lora {
        let adapted = (0..cfg.num_hidden_layers).flat_map(|i| {
            ["gate", "experts.gate_proj", "experts.up_proj", "experts.down_proj"].map(move |p| format!("model.layers.{i}.block_sparse_moe.{p}"))
        });
        if let Some(stem) = adapted.into_iter().find(|s| l.adapts_weight(s)) {
            bail!("LlamaConfig: LoRA on GraniteMoE's {stem}: its sparse layers take no adapters (PEFT's target_modules reach its attention projections only; name them: q_proj, k_proj, v_proj, o_proj)")
        }
        if !l.target_parameters.is_empty() {
            bail!("LlamaConfig: LoRA target_parameters {:?} on GraniteMoE: its experts take no adapters", l.target_parameters)
        }
    }
    Ok(())
}

/// The checkpoint tensor GraniteMoE parameter `name` is part of, and which part (see the
/// module doc); `None` for a parameter held under its own name.
pub fn checkpoint_part(name: &str) -> Option<(String, usize)> {
    super::phi3::part_by_suffix(&PARTS, name)
}

/// The checkpoint's tensors of the model's `tensors` (by the model's names): the parts of each
/// [`checkpoint_part`] grouped under its checkpoint name in part order, every other tensor
/// alone under its own. Errors name a group missing a part.
pub fn group<T>(tensors: Vec<(String, T)>) -> Result<Vec<(String, Vec<T>)>> {
    super::phi3::group_parts(tensors, checkpoint_part, |ck| if ck.ends_with("input_linear.weight") { 2 } else { 1 })
}

/// The checkpoint tensor `ck` from the model's `parts` (full tensors, in part order): gate and
/// up `[E, I, h]` stacked by rows into `input_linear` `[E, 2·I, h]`; any other as it is.
pub fn combine(ck: &str, parts: &[Tensor]) -> Result<Tensor> {
    match parts {
        [g, u] if ck.ends_with("input_linear.weight") => Tensor::cat(&[g, u], 1),
        [x] => Ok(x.clone()),
        _ => bail!("GraniteMoE checkpoint tensor {ck}: {} parts", parts.len()),
    }
}

/// The shape [`combine`] gives from parts of shapes `parts`.
pub fn combined_shape(ck: &str, parts: &[Vec<usize>]) -> Vec<usize> {
    match parts {
        [g, _] if ck.ends_with("input_linear.weight") && g.len() == 3 => vec![g[0], 2 * g[1], g[2]],
        [x, ..] => x.clone(),
        [] => vec![],
    }
}

/// Parameter `name` (full shape `shape`) of a GraniteMoE model from its checkpoint, whose
/// tensor `n` `get(n)` returns (`None`: absent): its rows of `input_linear`, the router, the
/// down projection; `Ok(None)` for a parameter held under its own name. `cache` keeps the last
/// `input_linear` read, for the up projection after the gate. Errors name a missing or
/// mis-shaped tensor.
pub fn from_checkpoint_cached(name: &str, shape: &[usize], get: &mut dyn FnMut(&str) -> Result<Option<Tensor>>, cache: &mut Option<(String, Tensor)>) -> Result<Option<Tensor>> {
    let Some((ck, part)) = checkpoint_part(name) else { return Ok(None) };
    let t = match cache.as_ref().filter(|(c, _)| *c == ck) {
        Some((_, t)) => t.clone(),
        None => match get(&ck)? {
            Some(t) => t,
            None => bail!("GraniteMoE checkpoint has no tensor {ck} (for {name} {shape:?})"),
        },
    };
    let fused = ck.ends_with("input_linear.weight");
    let mut want = shape.to_vec();
    if fused && want.len() == 3 {
        want[1] *= 2;
    }
    if t.dims() != want.as_slice() {
        bail!("GraniteMoE checkpoint tensor {ck} has shape {:?}, the config implies {want:?} (for {name} {shape:?})", t.dims())
    }
    if !fused {
        return Ok(Some(t));
    }
    *cache = Some((ck, t.clone()));
    Ok(Some(t.narrow(1, part * shape[1], shape[1])?.contiguous()?))
}

#[cfg(test)]
#[path = "granite_moe_tests.rs"]
mod tests;
