//! OLMo 2, OLMo 3 and OLMoE (`model_type` `olmo2`, `olmo3`, `olmoe`; AllenAI's fully open
//! models, whose training data and code are public too). OLMo 2 and 3 are a Llama with three
//! differences ([`Olmo`]):
//!
//! - **Norms after the branches, none before**: `x + norm(attn(x))`, then `x + norm(mlp(x))`
//!   (`post_attention_layernorm`, `post_feedforward_layernorm`); the attention and the MLP read
//!   the residual stream as it is (no `input_layernorm`, no norm before the MLP). Every RMSNorm
//!   multiplies by its weight in f32 and casts last ([`candle_cp_nn::NormWeight::ScaleF32`]).
//! - **q and k norms over the whole projection**: `q = rms(q_proj(x))·w_q` over all `H·D`
//!   features of a token (weights `[H·D]`, `[Hkv·D]`), before the split into heads and RoPE —
//!   not per head as Qwen3's. Under tensor parallelism each rank holds its heads' features:
//!   the weights split as the heads ([`crate::params`]) and each token's sum of squares is
//!   all-reduced over the TP group in the forward, its gradient in the backward
//!   (`FlatQkNorm`, `flat_norm_rope`). KV heads replicated over TP ranks (TP beyond the KV
//!   heads) or copied (neither dividing the other) are counted once per copy, and every KV head
//!   has as many copies: the mean over all the features the ranks hold, copies included, is the
//!   mean over the distinct ones, and the copies' gradients, summed as their weights' are, give
//!   each head's. Under Ulysses, ring or zigzag CP the norm runs on the rank's tokens before any
//!   exchange, so those layouts need nothing more.
//! - OLMo 3 only: a **sliding window** (`sliding_window`, default 4096) on the layers
//!   `layer_types` names (by default three of every four, all but layers 3, 7, ...); when the
//!   config scales RoPE (OLMo 3's long-context models: YaRN) the sliding layers rotate by the
//!   unscaled frequencies and the full-attention layers by the scaled ones, as OLMo-core
//!   trains them and transformers computes them since its fix of the per-layer-type rotary
//!   embedding (some 4.x releases scaled every layer) — [`crate::LlamaConfig::local_rope`].
//!
//! OLMoE (`model_type` `olmoe`, `OlmoeForCausalLM`: OLMoE-1B-7B) is a Llama with the norms
//! before the branches as usual (transformers' `LlamaRMSNorm`), the same whole-projection q and k
//! norms, and a mixture of experts on every layer, named as Qwen3-MoE's (`mlp.gate`,
//! `mlp.experts.{e}.{gate,up,down}_proj`, or transformers 5's fused experts) with the experts
//! `intermediate_size` wide ([`Olmo::Olmoe`]).
//!
//! `attention_bias: true` (biases on q, k, v and o) and OLMoE's `clip_qkv` (a clamp of q, k, v,
//! null in the published configs) are refused by name.

use super::{get_f64, parse_scaling, rope_by_layer_type, LlamaConfig, RopeScaling};
use candle_core::{bail, DType, Result, Tensor, D};
use candle_cp_comm::Group;
use candle_cp_nn::NormWeight;
use serde_json::{json, Map, Value};

/// Which OLMo ([`crate::LlamaConfig::olmo`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Olmo {
    /// `Olmo2ForCausalLM`: post-branch norms, whole-projection q, k norms.
    Olmo2,
    /// `Olmo3ForCausalLM`: OLMo 2 with sliding-window layers.
    Olmo3,
    /// `OlmoeForCausalLM`: a pre-norm Llama with whole-projection q, k norms and a mixture of
    /// experts on every layer.
    Olmoe,
}

impl Olmo {
    /// Whether the layers normalise after each branch and not before (OLMo 2 and 3; OLMoE
    /// normalises before, as a Llama).
    pub fn post_norms(self) -> bool {
        matches!(self, Olmo::Olmo2 | Olmo::Olmo3)
    }
}

/// [`LlamaConfig::features`]' name of OLMo's.
pub(crate) const OLMO: &str = "OLMo's norms";

/// `sliding_window` of an `Olmo3Config` that leaves it out.
pub const OLMO3_WINDOW: usize = 4096;

/// Which OLMo `m` is a config of (by `model_type` or `architectures`).
fn model_type(m: &Map<String, Value>) -> Option<Olmo> {
    let class = m.get("architectures").and_then(|a| a.as_array()).and_then(|a| a.first()).and_then(|c| c.as_str());
    match (m.get("model_type").and_then(|t| t.as_str()), class) {
        (Some("olmo2"), _) | (None, Some("Olmo2ForCausalLM")) => Some(Olmo::Olmo2),
        (Some("olmo3"), _) | (None, Some("Olmo3ForCausalLM")) => Some(Olmo::Olmo3),
        (Some("olmoe"), _) | (None, Some("OlmoeForCausalLM")) => Some(Olmo::Olmoe),
        _ => None,
    }
}

/// `rope_theta` of an `Olmo3Config` that names none (transformers 5's; some 4.x releases had
/// 10000, but every published OLMo 3 config names its 500000).
pub const OLMO3_THETA: f64 = 500_000.0;

/// An OLMo config with transformers' defaults filled in where it leaves them out: `rms_norm_eps`
/// 1e-5 (all three), `sliding_window` 4096 and `rope_theta` 500000 (OLMo 3; its `layer_types`
/// default is [`crate::Arch::window`]'s). `None` for other configs.
pub(crate) fn with_defaults(m: &Map<String, Value>) -> Option<Map<String, Value>> {
    let o = model_type(m)?;
    let mut m = m.clone();
    m.entry("rms_norm_eps").or_insert(json!(1e-5));
    if o == Olmo::Olmo3 {
        m.entry("sliding_window").or_insert(json!(OLMO3_WINDOW));
        m.entry("rope_theta").or_insert(json!(OLMO3_THETA));
    }
    Some(m)
}

/// OLMoE's keys this model does not compute, refused by name: `clip_qkv` (a clamp of q, k, v).
pub(crate) fn refuse_unsupported(m: &Map<String, Value>) -> Result<()> {
    match m.get("clip_qkv") {
        None | Some(Value::Null) => Ok(()),
        Some(v) => bail!("config.json: OLMoE `clip_qkv: {v}` not supported (a clamp of q, k and v; null in the published configs)"),
    }
}

/// OLMoE's mixture of experts: `num_experts` (64), `num_experts_per_tok` (8), each expert
/// `intermediate_size` (`width`) wide, `norm_topk_prob` (false), the load-balancing loss's keys
/// (`router_aux_loss_coef` 0.01), every layer sparse (Qwen3-MoE's keys otherwise).
pub(crate) fn parse_moe(m: &Map<String, Value>, width: usize) -> Result<crate::MoeConfig> {
    super::qwen3_moe::parse_with(m, crate::MoeConfig { router_aux_loss_coef: 0.01, ..crate::MoeConfig::new(64, 8, width) })
}

/// OLMo 3's RoPE from `rope_parameters` keyed by layer type (transformers 5's form:
/// `full_attention` the full layers' base and scaling, a legacy `rope_scaling` merged into it as
/// transformers does; `sliding_attention` unscaled, of the same base), or `None` when the config
/// has the other forms (read as every other config's: the scaling is the full layers'). Errors
/// for a scaled or differently based RoPE on the sliding layers, which this model does not
/// compute.
pub(crate) fn layer_type_rope(m: &Map<String, Value>, max_pos: usize, orig: Option<usize>) -> Result<Option<(f64, RopeScaling)>> {
    let Some(Value::Object(p)) = m.get("rope_parameters") else { return Ok(None) };
    let Some((mut full, sliding)) = rope_by_layer_type(p)? else { return Ok(None) };
    if let Some(Value::Object(legacy)) = m.get("rope_scaling") {
        full.extend(legacy.clone());
    }
    let theta = get_f64(&full, "rope_theta")?.or(get_f64(m, "rope_theta")?).unwrap_or(OLMO3_THETA);
    let local = get_f64(&sliding, "rope_theta")?.unwrap_or(theta);
    if parse_scaling(&sliding, max_pos, orig)? != RopeScaling::Default || local != theta {
        bail!("config.json: OLMo 3's sliding layers rotate unscaled by the full layers' base ({theta}); `rope_parameters.sliding_attention` {sliding:?} not supported")
    }
    Ok(Some((theta, parse_scaling(&full, max_pos, orig)?)))
}

/// OLMo's keys of config.json: no `mlp_bias` / `pretraining_tp`; OLMo 2 and OLMoE without
/// `sliding_window` (OLMoE's experts `intermediate_size` wide, `clip_qkv` null); OLMo 3 with `layer_types` for every layer (written even when none slides,
/// so that the default three-in-four does not come back), its window and `rope_parameters` by
/// layer type ([`layer_type_rope`]).
pub(crate) fn write(m: &mut Map<String, Value>, cfg: &LlamaConfig, o: Olmo) {
    m.remove("mlp_bias");
    m.remove("pretraining_tp");
    match o {
        Olmo::Olmo2 => {
            m.remove("sliding_window");
        }
        Olmo::Olmoe => {
            // (OlmoeConfig: the experts `intermediate_size` wide, every layer sparse)
            for k in ["sliding_window", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"] {
                m.remove(k);
            }
            if let Some(moe) = &cfg.moe {
                m.insert("intermediate_size".into(), json!(moe.moe_intermediate_size));
            }
            m.insert("clip_qkv".into(), Value::Null);
        }
        Olmo::Olmo3 => {
            // transformers 5 reads `rope_parameters` by layer type (a flat one would leave the
            // full layers unscaled); the legacy `rope_theta` / `rope_scaling` stay for 4.x
            if let Some(Value::Object(full)) = m.get("rope_parameters").cloned() {
                let sliding = json!({"rope_type": "default", "rope_theta": cfg.rope_theta});
                m.insert("rope_parameters".into(), json!({"full_attention": full, "sliding_attention": sliding}));
            }
            let types: Vec<&str> = (0..cfg.num_hidden_layers)
                .map(|i| if cfg.layer_window(i).is_some() { "sliding_attention" } else { "full_attention" })
                .collect();
            m.insert("layer_types".into(), json!(types));
            m.insert("sliding_window".into(), json!(cfg.sliding_window.unwrap_or(OLMO3_WINDOW)));
        }
    }
}

/// OLMo with no other architecture's features (biases, per-head norms, Gemma, a mixture
/// (OLMoE: its own, below), Phi-3, gpt-oss, NoPE layers, Granite's multipliers); OLMo 2 and
/// OLMoE without a window (their configs have none: a checkpoint would load without it); OLMoE
/// with a Qwen3-MoE-style mixture on every layer, its experts `intermediate_size` wide.
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    let Some(o) = cfg.olmo else { return Ok(()) };
    let moe = crate::config::qwen3_moe::MOE;
    if let Some((what, _)) = cfg.features().into_iter().find(|(w, on)| *on && *w != OLMO && !(o == Olmo::Olmoe && *w == moe)) {
        bail!("LlamaConfig: {o:?} with {what}: no architecture this model writes has both")
    }
    if let (Olmo::Olmo2 | Olmo::Olmoe, Some(w)) = (o, cfg.sliding_window) {
        bail!("LlamaConfig: {o:?} with a sliding window ({w}): its config has none (OLMo 3's has: Olmo::Olmo3)")
    }
    if o == Olmo::Olmoe {
        match &cfg.moe {
            Some(m) if m.style == crate::MoeStyle::Qwen3Moe && m.mlp_only_layers.is_empty() && m.decoder_sparse_step == 1 && m.moe_intermediate_size == cfg.intermediate_size => {}
            m => bail!(
                "LlamaConfig: OLMoE has a mixture of experts on every layer, named as Qwen3-MoE's, each intermediate_size ({}) wide (got {:?})",
                cfg.intermediate_size,
                m.as_ref().map(|m| (m.style, m.mlp_only_layers.clone(), m.decoder_sparse_step, m.moe_intermediate_size))
            ),
        }
    }
    Ok(())
}

impl LlamaConfig {
    /// The same config as OLMo 2, 3 or OLMoE (or not): its q and k norms replace a Qwen3's per-head
    /// ones. OLMo 3's window is set apart ([`LlamaConfig::with_sliding_window`],
    /// [`LlamaConfig::with_sliding_layers`]), OLMoE's experts too ([`LlamaConfig::with_moe`]
    /// first).
    pub fn with_olmo(mut self, o: Option<Olmo>) -> Self {
        if o.is_some() {
            self.qk_norm = false;
        }
        // (OLMoE's experts are intermediate_size wide)
        if let (Some(Olmo::Olmoe), Some(m)) = (o, &self.moe) {
            self.intermediate_size = m.moe_intermediate_size;
        }
        self.olmo = o;
        self
    }

    /// Whether the layers normalise after each branch only ([`Olmo::post_norms`], and EXAONE 4:
    /// [`crate::config::exaone4`]).
    pub fn post_norms_only(&self) -> bool {
        self.olmo.is_some_and(Olmo::post_norms) || self.exaone4
    }
}

/// OLMo's q and k norms over this TP rank's part of each token's projection: weights
/// `[H_local·D]`, `[Hkv_local·D]` (the full `[H·D]`, `[Hkv·D]` split as the heads, KV heads
/// with their copies), the statistic over every rank's features (`tp`: the group whose ranks
/// hold the other heads; `None` on one rank).
#[derive(Clone)]
pub(crate) struct FlatQkNorm {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    /// The full widths `H·D`, `Hkv·D` (each rank's features times the ranks must be a
    /// multiple: the KV heads' copies).
    pub(crate) widths: (usize, usize),
    pub(crate) eps: f64,
    /// How the weights apply: OLMo 2 and 3's `x̂ · w` in f32 ([`NormWeight::ScaleF32`]),
    /// OLMoE's `x̂` cast first ([`NormWeight::Scale`]).
    pub(crate) form: NormWeight,
    pub(crate) tp: Option<Group>,
}

/// The normalised `x̂ = x·r` (f32) times `w` as `form` says, in `dtype`.
fn scaled(xhat: &Tensor, w: &Tensor, form: NormWeight, dtype: DType) -> Result<Tensor> {
    match form {
        NormWeight::ScaleF32 => xhat.broadcast_mul(&w.to_dtype(DType::F32)?)?.to_dtype(dtype),
        NormWeight::Scale => xhat.to_dtype(dtype)?.broadcast_mul(&w.to_dtype(dtype)?),
        NormWeight::UnitOffset => bail!("OLMo q/k norm: weight form {form:?} not supported (Scale, ScaleF32)"),
    }
}

/// The features summed over the ranks, `n · ranks`, checked against the weight `[n]` and the
/// full width (`n · ranks` a multiple of it: every head held the same number of times).
fn held_features(op: &str, x: &Tensor, w: &Tensor, width: usize, tp: Option<&Group>) -> Result<(usize, usize)> {
    let n = x.dim(D::Minus1)?;
    let ranks = tp.map_or(1, |g| g.size());
    if w.dims() != [n] || width == 0 || !(n * ranks).is_multiple_of(width) {
        bail!("{op}: input {:?} and weight {:?} on {ranks} TP ranks must hold each of the {width} features of a token as often", x.dims(), w.dims())
    }
    Ok((n, n * ranks))
}

impl FlatQkNorm {
    /// `q [B, T, H_local·D]`, `k [B, T, Hkv_local·D]` normalised (plain ops, as
    /// [`flat_rms`]; generation's decode steps).
    pub(crate) fn apply(&self, q: &Tensor, k: &Tensor) -> Result<(Tensor, Tensor)> {
        let f = |x: &Tensor, w: &Tensor, width: usize| flat_rms(x, w, width, (self.eps, self.form), self.tp.as_ref());
        Ok((f(q, &self.q, self.widths.0)?, f(k, &self.k, self.widths.1)?))
    }

    /// `q [B, T, H_local·D]`, `k [B, T, Hkv_local·D]` normalised and rotated by `cos`, `sin`
    /// into `[B, T, H_local, D]`, `[B, T, Hkv_local, D]`, each one graph node
    /// ([`flat_norm_rope`]).
    pub(crate) fn apply_with_rope(&self, q: &Tensor, k: &Tensor, cos: &Tensor, sin: &Tensor, d: usize) -> Result<(Tensor, Tensor)> {
        let f = |x: &Tensor, w: &Tensor, width: usize| flat_norm_rope(x, w, width, (self.eps, self.form), (d, cos, sin), self.tp.as_ref());
        Ok((f(q, &self.q, self.widths.0)?, f(k, &self.k, self.widths.1)?))
    }
}

/// OLMo's whole-projection norm then RoPE as one graph node: `x [B, T, n]` (this TP rank's
/// `n = H_local·D` features of each token's `width`), weight `w [n]`, heads of `d` rotated by
/// `cos`, `sin` (as [`crate::fused::apply_rope`]'s) → `[B, T, n/d, d]`. The same values as
/// [`flat_rms`] then `apply_rope` (reference: those two, differentiated by candle), but the
/// node keeps only `x` and the f32 statistic `[B, T, 1]`. Under TP (`tp` of more than one rank)
/// the sum of squares is all-reduced in the forward and, in the backward, the sum
/// `Σ dŷ·w·x̂` over the features, which every rank's input gradient needs; both are means over
/// the `n · ranks` features the ranks hold (copied heads as often as each other).
pub(crate) fn flat_norm_rope(x: &Tensor, w: &Tensor, width: usize, (eps, form): (f64, NormWeight), (d, cos, sin): (usize, &Tensor, &Tensor), tp: Option<&Group>) -> Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let (n, held) = held_features("OLMo q/k norm", x, w, width, tp)?;
    if d == 0 || n % d != 0 {
        bail!("OLMo q/k norm: input {:?} is not in heads of {d}", x.dims())
    }
    let heads = n / d;
    let r = cos.dims().last().copied().unwrap_or(0);
    if !(cos.dims() == [t, r] || cos.dims() == [b, t, r]) || cos.dims() != sin.dims() || r == 0 || r % 2 != 0 || r > d {
        bail!("OLMo q/k norm: x {:?} in heads of {d} needs cos/sin [{t}, R] or [{b}, {t}, R], R even, 0 < R <= {d}, got {:?} / {:?}", x.dims(), cos.dims(), sin.dims())
    }
    let (c4, s4) = crate::fused::tables4(cos, sin, t, r, x.dtype())?;
    let tp = tp.filter(|g| g.size() > 1).cloned();
    let (xd, wd) = (x.detach(), w.detach());
    let x32 = xd.to_dtype(DType::F32)?;
    let mut ss = x32.sqr()?.sum_keepdim(D::Minus1)?;
    if let Some(g) = &tp {
        ss = g.all_reduce(&ss)?;
    }
    let rs = ((ss / held as f64)? + eps)?.sqrt()?.recip()?;
    let z = scaled(&x32.broadcast_mul(&rs)?, &wd, form, x.dtype())?;
    drop(x32);
    let out = crate::fused::rope4(&z.reshape((b, t, heads, d))?, &c4, &s4)?;
    drop(z);
    let bwd: candle_cp_ops::autograd::BackwardFn = std::sync::Arc::new(move |dy: &Tensor| {
        // RoPE's transpose gives the norm's output gradient; then the norm's backward with
        // the statistic over every rank's features
        let dz = crate::fused::rope4_t(dy, &c4, &s4)?.reshape((b, t, n))?.to_dtype(DType::F32)?;
        let xhat = xd.to_dtype(DType::F32)?.broadcast_mul(&rs)?;
        // (the weight multiplies x̂ as the forward rounded it: cast first in the Scale form)
        let xw = match form {
            NormWeight::Scale => xhat.to_dtype(xd.dtype())?.to_dtype(DType::F32)?,
            _ => xhat.clone(),
        };
        let dw = (&dz * &xw)?.reshape((b * t, n))?.sum(0)?.to_dtype(wd.dtype())?;
        let g = dz.broadcast_mul(&wd.to_dtype(DType::F32)?)?;
        let mut m = (&g * &xhat)?.sum_keepdim(D::Minus1)?;
        if let Some(grp) = &tp {
            m = grp.all_reduce(&m)?;
        }
        let dx = (g - xhat.broadcast_mul(&(m / held as f64)?)?)?.broadcast_mul(&rs)?.to_dtype(xd.dtype())?;
        Ok(vec![Some(dx), Some(dw)])
    });
    candle_cp_ops::autograd::attach2("olmo_qk_norm_rope", x, w, out, bwd)
}

/// `x · rsqrt(mean(x²) + eps) · w` (in f32, cast last, or cast before `w`: `form`), the mean over the last dim of `x`
/// `[.., n]` and, with `tp`, over the TP group's ranks (`n · ranks` features, a multiple of the
/// token's `width`: copied heads count as often as each other). The sum goes through
/// `reduce_from_tp_region` (all-reduce forward) and `copy_to_tp_region` (all-reduce backward):
/// every rank's statistic depends on every rank's features.
pub(crate) fn flat_rms(x: &Tensor, w: &Tensor, width: usize, (eps, form): (f64, NormWeight), tp: Option<&Group>) -> Result<Tensor> {
    let (_, held) = held_features("OLMo q/k norm", x, w, width, tp)?;
    let x32 = x.to_dtype(DType::F32)?;
    let mut ss = x32.sqr()?.sum_keepdim(D::Minus1)?;
    if let Some(g) = tp.filter(|g| g.size() > 1) {
        ss = candle_cp_ops::mappings::copy_to_tp_region(&candle_cp_ops::mappings::reduce_from_tp_region(&ss, g)?, g)?;
    }
    let r = ((ss / held as f64)? + eps)?.sqrt()?.recip()?;
    scaled(&x32.broadcast_mul(&r)?, w, form, x.dtype())
}

#[cfg(test)]
#[path = "olmo_tests.rs"]
mod tests;
