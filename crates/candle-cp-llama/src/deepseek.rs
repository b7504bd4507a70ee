//! DeepSeek-V3 (`model_type` `deepseek_v3`, `DeepseekV3ForCausalLM`: DeepSeek-V3, V3.1, R1,
//! Kimi K2 and Moonlight in its format): multi-head latent attention ([`Mla`], the layer in
//! [`crate::mla`]) in every layer, GLM-4.5's mixture of experts ([`MoeStyle::Glm4Moe`]: sigmoid
//! scores, a correction bias choosing within the best expert groups, renormalised and scaled
//! weights, shared experts) from layer `first_k_dense_replace` on.
//!
//! ```text
//!  q  = q_b_proj(rms(q_a_proj(x)))            [H, nope + rope]   (q_lora_rank null: q_proj(x))
//!  c, kr = kv_a_proj_with_mqa(x)               [kv_lora_rank], [rope]: one RoPE key for every head
//!  k_nope, v = kv_b_proj(rms(c))               [H, nope], [H, v_head_dim]
//!  k  = [k_nope, RoPE(kr)] per head,  q = [q_nope, RoPE(q_rot)]
//!  attention scale (nope + rope)^-1/2 · mscale²  (YaRN with `mscale_all_dim`)
//! ```
//!
//! `rope_interleave` (the default): the RoPE dimensions arrive in pairs `(2i, 2i + 1)` and
//! are reordered to `rotate_half`'s halves before the rotation, as transformers does. The
//! config's `head_dim` is transformers' (the RoPE width, `qk_rope_head_dim`); the model's
//! [`LlamaConfig::head_dim`] is the width the attention runs at, `max(nope + rope, v)`.
//! The multi-token-prediction layers (`num_nextn_predict_layers`) are skipped on load, as for
//! GLM-4.5.

use super::qwen3_moe::MoeStyle;
use super::{get_bool, get_usize, Arch, LlamaConfig, RopeScaling};
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// The feature name of multi-head latent attention in errors.
pub(crate) const MLA: &str = "multi-head latent attention";

/// DeepSeek's multi-head latent attention: the ranks of the compressed query and key/value and
/// the widths of each head's parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mla {
    /// Rank of the compressed query (`q_a_proj` `[rq, h]`, `q_b_proj` `[H·(nope + rope), rq]`);
    /// `None`: one `q_proj` `[H·(nope + rope), h]` (DeepSeek-V2-Lite's form).
    pub q_lora_rank: Option<usize>,
    /// Rank of the compressed key/value (`kv_a_proj_with_mqa` `[rkv + rope, h]`, `kv_b_proj`
    /// `[H·(nope + v), rkv]`).
    pub kv_lora_rank: usize,
    /// Each query and key head's dimensions without RoPE.
    pub qk_nope_head_dim: usize,
    /// Each query and key head's rotated dimensions (the key's shared by every head).
    pub qk_rope_head_dim: usize,
    /// Each value head's dimensions.
    pub v_head_dim: usize,
    /// The rotated dimensions arrive interleaved (pairs `(2i, 2i + 1)`), transformers' default.
    pub rope_interleave: bool,
}

impl Mla {
    /// DeepSeek-V3's: rq 1536, rkv 512, nope 128, rope 64, v 128, interleaved.
    pub fn deepseek_v3() -> Self {
        Self { q_lora_rank: Some(1536), kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64, v_head_dim: 128, rope_interleave: true }
    }

    /// A query's or key's head width, `nope + rope`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The head width the attention runs at: `max(nope + rope, v)` (the narrower side padded
    /// with zeros, which change neither the scores nor the output).
    pub fn attn_dim(&self) -> usize {
        self.qk_head_dim().max(self.v_head_dim)
    }

    /// The softmax scale: `(nope + rope)^-1/2`, times `mscale²` under YaRN with
    /// `mscale_all_dim` (`0.1·mscale_all_dim·ln(factor) + 1`), as `DeepseekV3Attention`.
    pub fn softmax_scale(&self, scaling: &RopeScaling) -> f64 {
        let s = 1.0 / (self.qk_head_dim() as f64).sqrt();
        match scaling {
            RopeScaling::Yarn { factor, mscale_all_dim: Some(m), .. } if *m != 0.0 && *factor > 1.0 => {
                let ms = 0.1 * m * factor.ln() + 1.0;
                s * ms * ms
            }
            _ => s,
        }
    }
}

/// A `deepseek_v3` or `deepseek_v2` config with `DeepseekV3Config`'s / `DeepseekV2Config`'s
/// defaults where it leaves them out (its `head_dim` is the RoPE width); `None` for another
/// architecture.
pub(crate) fn with_defaults(m: &Map<String, Value>) -> Option<Map<String, Value>> {
    let arch = Arch::of_config(m).ok().filter(|a| matches!(a, Arch::DeepseekV3 | Arch::DeepseekV2))?;
    let mut t = m.clone();
    let v2 = [
        ("vocab_size", json!(32000)),
        ("hidden_size", json!(4096)),
        ("intermediate_size", json!(11008)),
        ("num_hidden_layers", json!(32)),
        ("num_attention_heads", json!(32)),
        ("moe_intermediate_size", json!(1407)),
        ("n_routed_experts", json!(64)),
        ("n_shared_experts", json!(2)),
        ("first_k_dense_replace", json!(0)),
        ("kv_lora_rank", json!(512)),
        ("q_lora_rank", json!(1536)),
        ("qk_nope_head_dim", json!(128)),
        ("qk_rope_head_dim", json!(64)),
        ("v_head_dim", json!(128)),
        ("routed_scaling_factor", json!(1.0)),
        ("topk_method", json!("greedy")),
        ("norm_topk_prob", json!(false)),
        ("rms_norm_eps", json!(1e-6)),
        ("attention_bias", json!(false)),
    ];
    let v3 = [
        ("vocab_size", json!(129280)),
        ("hidden_size", json!(7168)),
        ("intermediate_size", json!(18432)),
        ("moe_intermediate_size", json!(2048)),
        ("num_hidden_layers", json!(61)),
        ("num_attention_heads", json!(128)),
        ("n_shared_experts", json!(1)),
        ("n_routed_experts", json!(256)),
        ("routed_scaling_factor", json!(2.5)),
        ("kv_lora_rank", json!(512)),
        ("q_lora_rank", json!(1536)),
        ("qk_rope_head_dim", json!(64)),
        ("v_head_dim", json!(128)),
        ("qk_nope_head_dim", json!(128)),
        ("n_group", json!(8)),
        ("topk_group", json!(4)),
        ("num_experts_per_tok", json!(8)),
        ("first_k_dense_replace", json!(3)),
        ("norm_topk_prob", json!(true)),
        ("rms_norm_eps", json!(1e-6)),
        ("rope_interleave", json!(true)),
        ("attention_bias", json!(false)),
    ];
    let defaults: &[(&str, Value)] = if arch == Arch::DeepseekV2 { &v2 } else { &v3 };
    for (k, v) in defaults {
        t.entry(*k).or_insert(v.clone());
    }
    // DeepseekV3Config: num_key_value_heads defaults to num_attention_heads
    let heads = t.get("num_attention_heads").cloned().unwrap_or(json!(128));
    t.entry("num_key_value_heads").or_insert(heads);
    // transformers' head_dim is the RoPE width (the model's is set from the parts)
    let rope = t.get("qk_rope_head_dim").cloned().unwrap_or(json!(64));
    t.insert("head_dim".into(), rope);
    Some(t)
}

/// The attention's keys of a `deepseek_v3` or `deepseek_v2` config (defaults filled by
/// [`with_defaults`]); DeepSeek-V2's RoPE is always on interleaved pairs (its complex form).
pub(super) fn parse(m: &Map<String, Value>) -> Result<Mla> {
    let v2 = Arch::of_config(m)? == Arch::DeepseekV2;
    let t = if v2 { "deepseek_v2" } else { "deepseek_v3" };
    let need = |k: &str| -> Result<usize> { get_usize(m, k)?.ok_or_else(|| candle_core::Error::Msg(format!("config.json: {t} needs `{k}`"))) };
    if get_bool(m, "attention_bias")? == Some(true) {
        bail!("config.json: `attention_bias: true` on a {t} model (biases on q_a_proj, kv_a_proj_with_mqa and o_proj) not supported")
    }
    let (heads, kv) = (get_usize(m, "num_attention_heads")?, get_usize(m, "num_key_value_heads")?);
    if kv != heads {
        bail!("config.json: {t} with num_key_value_heads {kv:?} and num_attention_heads {heads:?}: latent attention has as many KV heads as heads (kv_b_proj's)")
    }
    // DeepSeek's original keys: the router transformers implements, on every layer from
    // first_k_dense_replace on
    let routers: &[(&str, &[&str])] = if v2 { &[("scoring_func", &["softmax"]), ("topk_method", &["greedy", "group_limited_greedy"])] } else { &[("scoring_func", &["sigmoid"]), ("topk_method", &["noaux_tc"])] };
    for (k, want) in routers {
        if let Some(v) = m.get(*k).filter(|v| !v.is_null() && !v.as_str().is_some_and(|s| want.contains(&s))) {
            bail!("config.json: {t} with `{k}` {v}: only {} (transformers' {t} router) is supported", want.join(" or "))
        }
    }
    if let Some(f) = get_usize(m, "moe_layer_freq")?.filter(|&f| f != 1) {
        bail!("config.json: {t} with `moe_layer_freq` {f}: transformers puts experts on every layer from first_k_dense_replace on (1)")
    }
    // DeepSeek-V3's published weights are FP8 with per-block scales (`weight_scale_inv`)
    if let Some(q) = m.get("quantization_config").filter(|q| !q.is_null()) {
        bail!("config.json: a quantized {t} checkpoint ({q}): convert it to bf16 first (its FP8 weights times their `weight_scale_inv` blocks) and drop `quantization_config`")
    }
    Ok(Mla {
        // (null: one q_proj)
        q_lora_rank: get_usize(m, "q_lora_rank")?,
        kv_lora_rank: need("kv_lora_rank")?,
        qk_nope_head_dim: need("qk_nope_head_dim")?,
        qk_rope_head_dim: need("qk_rope_head_dim")?,
        v_head_dim: need("v_head_dim")?,
        rope_interleave: v2 || get_bool(m, "rope_interleave")?.unwrap_or(true),
    })
}

/// The mixture of a `deepseek_v2` config ([`MoeStyle::DeepseekV2`]; defaults filled by
/// [`with_defaults`]): `num_experts_per_tok` (DeepseekV2Config has no default), the groups of
/// `group_limited_greedy` (`greedy`: one), the first `first_k_dense_replace` layers dense.
/// `norm_topk_prob: true` is refused: transformers' DeepSeek-V2 does not renormalise (the
/// original code does), so the two would differ.
pub(super) fn parse_v2_moe(m: &Map<String, Value>, layers: usize) -> Result<super::qwen3_moe::MoeConfig> {
    let need = |k: &str| -> Result<usize> { get_usize(m, k)?.ok_or_else(|| candle_core::Error::Msg(format!("config.json: deepseek_v2 needs `{k}`"))) };
    let shared = match m.get("n_shared_experts") {
        Some(Value::Null) => bail!("config.json: deepseek_v2 with `n_shared_experts` null: transformers' DeepseekV2Moe always adds its shared experts"),
        _ => need("n_shared_experts")?,
    };
    let scale = super::get_f64(m, "routed_scaling_factor")?.unwrap_or(1.0);
    let mut c = super::qwen3_moe::MoeConfig::deepseek_v2(need("n_routed_experts")?, need("num_experts_per_tok")?, need("moe_intermediate_size")?, shared, scale);
    c.groups = match m.get("topk_method").and_then(|v| v.as_str()) {
        Some("group_limited_greedy") => (need("n_group")?, need("topk_group")?),
        _ => (1, 1),
    };
    c.mlp_only_layers = (0..need("first_k_dense_replace")?.min(layers)).collect();
    if get_bool(m, "norm_topk_prob")? == Some(true) {
        bail!("config.json: deepseek_v2 with `norm_topk_prob: true`: transformers' DeepSeek-V2 does not renormalise the chosen scores (DeepSeek's own code does); refused rather than run either")
    }
    if get_bool(m, "output_router_logits")? == Some(true) {
        bail!("config.json: `output_router_logits: true` on a deepseek_v2 model: transformers computes no load-balancing loss for it, nor does this model")
    }
    Ok(c)
}

/// DeepSeek-V3's or -V2's keys of config.json (after GLM-4.5's mixture keys,
/// [`super::glm4_moe::write`]).
pub(crate) fn write(m: &mut Map<String, Value>, a: &Mla, moe: Option<&super::qwen3_moe::MoeConfig>) {
    // (GLM-4.5's attention keys, which DeepseekV3Config does not have)
    for k in ["partial_rotary_factor", "use_qk_norm"] {
        m.remove(k);
    }
    if let Some(c) = moe.filter(|c| c.style == MoeStyle::DeepseekV2) {
        // (DeepseekV2Config: no interleave key or prediction layers; its router's method)
        for k in ["rope_interleave", "num_nextn_predict_layers"] {
            m.remove(k);
        }
        let method = if c.groups.0 > 1 { "group_limited_greedy" } else { "greedy" };
        m.insert("topk_method".into(), json!(method));
        m.insert("norm_topk_prob".into(), json!(false));
        for (k, v) in [("q_lora_rank", json!(a.q_lora_rank)), ("kv_lora_rank", json!(a.kv_lora_rank)), ("qk_nope_head_dim", json!(a.qk_nope_head_dim)), ("qk_rope_head_dim", json!(a.qk_rope_head_dim)), ("v_head_dim", json!(a.v_head_dim)), ("head_dim", json!(a.qk_rope_head_dim)), ("attention_bias", json!(false))] {
            m.insert(k.into(), v);
        }
        return;
    }
    for (k, v) in [
        ("q_lora_rank", json!(a.q_lora_rank)),
        ("kv_lora_rank", json!(a.kv_lora_rank)),
        ("qk_nope_head_dim", json!(a.qk_nope_head_dim)),
        ("qk_rope_head_dim", json!(a.qk_rope_head_dim)),
        ("v_head_dim", json!(a.v_head_dim)),
        ("rope_interleave", json!(a.rope_interleave)),
        ("head_dim", json!(a.qk_rope_head_dim)),
        ("attention_bias", json!(false)),
    ] {
        m.insert(k.into(), v);
    }
}

/// A DeepSeek-V3 config's invariants: every head's parts non-empty, an even RoPE width,
/// `head_dim` the attention's width, as many KV heads as query heads, GLM-4.5's mixture (its
/// own checks, [`super::glm4_moe::validate`]) or every layer dense, nothing of another
/// architecture.
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    if cfg.mla.is_none() && cfg.moe.as_ref().is_some_and(|m| m.style == MoeStyle::DeepseekV2) {
        bail!("LlamaConfig: DeepSeek-V2's experts without its latent attention (with_mla): no architecture this model writes")
    }
    let Some(a) = cfg.mla else { return Ok(()) };
    let own = [super::qwen3_moe::MOE, MLA];
    if let Some((what, _)) = cfg.features().into_iter().find(|(w, on)| *on && !own.contains(w)) {
        bail!("LlamaConfig: DeepSeek-V3's latent attention with {what}: no architecture this model writes has both")
    }
    if a.kv_lora_rank == 0 || a.qk_nope_head_dim == 0 || a.v_head_dim == 0 || a.qk_rope_head_dim == 0 || !a.qk_rope_head_dim.is_multiple_of(2) || a.q_lora_rank == Some(0) {
        bail!("LlamaConfig: latent attention needs kv_lora_rank, qk_nope_head_dim, v_head_dim > 0, q_lora_rank > 0 or null and an even qk_rope_head_dim > 0 (got {a:?})")
    }
    if cfg.head_dim != a.attn_dim() || cfg.num_key_value_heads != cfg.num_attention_heads || cfg.partial_rotary_factor != 1.0 {
        bail!(
            "LlamaConfig: latent attention runs at head_dim = max(qk_nope_head_dim + qk_rope_head_dim, v_head_dim) = {} with as many KV heads as heads and no partial_rotary_factor (head_dim {}, heads {}, KV heads {}, factor {})",
            a.attn_dim(),
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.partial_rotary_factor
        )
    }
    if let Some(w) = cfg.sliding_window {
        bail!("LlamaConfig: DeepSeek-V3 with a sliding window ({w}): DeepseekV3Config has none")
    }
    if let Some(m) = cfg.moe.as_ref().filter(|m| !matches!(m.style, MoeStyle::Glm4Moe | MoeStyle::DeepseekV2)) {
        bail!("LlamaConfig: DeepSeek-V3's experts are GLM-4.5's (sigmoid scores, correction bias), DeepSeek-V2's its own, got {:?}", m.style)
    }
    if cfg.moe.as_ref().is_some_and(|m| m.style == MoeStyle::DeepseekV2) && !a.rope_interleave {
        bail!("LlamaConfig: DeepSeek-V2 rotates interleaved pairs (its config has no rope_interleave key)")
    }
    Ok(())
}

/// The attention parameters of layer `l` (`model.layers.{l}.self_attn.*`): name, full shape,
/// TP split. The down-projections and their norms are replicated (each TP rank applies them to
/// its sequence shard under SP, their gradient summed over TP as a norm's), the up-projections
/// split by heads, o_proj by its columns.
pub(crate) fn attention_specs(cfg: &LlamaConfig, a: &Mla, l: usize) -> Vec<(String, Vec<usize>, candle_cp_nn::Shard)> {
    use candle_cp_nn::{ColumnParallelLinear, RmsNorm, RowParallelLinear};
    let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
    let (col, row, rep) = (ColumnParallelLinear::WEIGHT_SHARD, RowParallelLinear::WEIGHT_SHARD, RmsNorm::WEIGHT_SHARD);
    let p = |s: &str| format!("model.layers.{l}.self_attn.{s}.weight");
    let mut out = Vec::new();
    match a.q_lora_rank {
        Some(rq) => {
            out.push((p("q_a_proj"), vec![rq, h], rep));
            out.push((p("q_a_layernorm"), vec![rq], rep));
            out.push((p("q_b_proj"), vec![heads * a.qk_head_dim(), rq], col));
        }
        None => out.push((p("q_proj"), vec![heads * a.qk_head_dim(), h], col)),
    }
    out.push((p("kv_a_proj_with_mqa"), vec![a.kv_lora_rank + a.qk_rope_head_dim, h], rep));
    out.push((p("kv_a_layernorm"), vec![a.kv_lora_rank], rep));
    out.push((p("kv_b_proj"), vec![heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank], col));
    out.push((p("o_proj"), vec![h, heads * a.v_head_dim], row));
    out
}

impl LlamaConfig {
    /// The same config with DeepSeek's latent attention `a` (`head_dim` set to its
    /// [`Mla::attn_dim`], KV heads to the heads, RoPE on `qk_rope_head_dim` alone), or without
    /// (`None`: `head_dim` left as it is).
    pub fn with_mla(mut self, a: Option<Mla>) -> Self {
        if let Some(a) = &a {
            self.head_dim = a.attn_dim();
            self.num_key_value_heads = self.num_attention_heads;
            self.partial_rotary_factor = 1.0;
        }
        self.mla = a;
        self
    }
}

#[cfg(test)]
#[path = "deepseek_tests.rs"]
mod tests;
