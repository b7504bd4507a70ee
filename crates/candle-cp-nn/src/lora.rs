//! LoRA adapters on the tensor-parallel linears: `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`, `A` `[r, in]`,
//! `B` `[out, r]`, `s = alpha / r` or rsLoRA's `alpha / √r` (PEFT's `lora_A` / `lora_B`),
//! optionally with dropout on the adapter's input ([`Lora::with_dropout`],
//! [`crate::lora_dropout`]).
//!
//! The factors are split over TP as the weight they adapt, so that no collective is added
//! beyond the adapter's own `r`-wide activations:
//!
//! | layer | `A` `[r, in]` | `B` `[out, r]` | the adapter's activations |
//! |-------|---------------|----------------|---------------------------|
//! | [`crate::ColumnParallelLinear`] (weight rows split) | replicated ([`crate::Shard::Replicated`]) | rows, as the part's weight ([`crate::Shard::Rows`] / `RowBlocks`) | `u = x·Aᵀ` of the layer's own gathered input, inside the part's node (none kept: formed again in the backward); on the plain paths `u` all-gathered along the sequence (SP) or from the input copied into the TP region (no SP) |
//! | [`crate::RowParallelLinear`] (weight columns split) | columns, as the weight ([`crate::Shard::Cols`]) | replicated | `v = x·Aᵀ` partial, reduce-scattered (SP) or all-reduced (no SP), `[.., r]` |
//!
//! The replicated factors' gradients follow the rule of the other replicated parameters
//! (norm weights): complete and equal on every TP rank without SP (the column's `A` enters
//! through `copy_to_tp_region`, whose backward sums it over TP), each rank's share with SP
//! (the rank's rows, or on the column's training path its `B` rows' share; sum it over TP, as
//! `candle_cp_llama::reduce_gradients` does for replicated parameters under SP). A split
//! factor's gradient is complete for its slice.
//!
//! On the training paths the update is added inside the layer's own node (in each part's node
//! before its output map, e.g. RoPE, from the input it gathers anyway, in
//! [`ColumnParallelLinear::forward_parts_regathered`]; after the reduction in
//! [`RowParallelLinear::forward_lean`] / [`RowParallelLinear::forward_residual`]): no `[T, out]`
//! update, no base output kept alive by an add, no dropout mask or dropped input (drawn again
//! in the backward), so an adapted layer keeps what the plain layer keeps plus `r`-wide tensors
//! (`tests/plan_activations.rs` bounds it). `Module::forward` and `forward_parts` add the update
//! with candle's ops.
//!
//! [`ColumnParallelLinear::forward_parts_regathered`]: crate::ColumnParallelLinear::forward_parts_regathered
//! [`RowParallelLinear::forward_lean`]: crate::RowParallelLinear::forward_lean
//! [`RowParallelLinear::forward_residual`]: crate::RowParallelLinear::forward_residual
//!
//! The CPU reference is the dense layer with the adapter on full tensors (`tests`:
//! [`crate::lora`] on TP 2 and 4, with and without SP, every forward path, against it).

use candle_core::{bail, Result, Tensor};
use candle_cp_ops::mappings::{self, SEQ_DIM};
use candle_nn::{Init, VarBuilder};

use crate::Tp;

/// Rank and scaling of LoRA adapters (PEFT's `r`, `lora_alpha` and `use_rslora`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraConfig {
    /// The adapters' rank `r` (> 0).
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (`alpha / √r` with `rslora`).
    pub alpha: f64,
    /// Rank-stabilised scaling (rsLoRA, PEFT's `use_rslora`): `alpha / √r`, so that the update's
    /// size does not shrink as the rank grows.
    pub rslora: bool,
}

impl LoraConfig {
    /// Rank `rank`, `lora_alpha` = `alpha`, the scale `alpha / r`.
    pub fn new(rank: usize, alpha: f64) -> Result<Self> {
        if rank == 0 || !alpha.is_finite() {
            bail!("LoRA: rank must be > 0 and alpha finite, got rank {rank}, alpha {alpha}")
        }
        Ok(Self { rank, alpha, rslora: false })
    }

    /// The same adapters with rsLoRA's scale `alpha / √r` (`on`) or the plain `alpha / r`.
    pub fn with_rslora(mut self, on: bool) -> Self {
        self.rslora = on;
        self
    }

    /// The update's scale: `alpha / r`, or `alpha / √r` with [`LoraConfig::rslora`].
    pub fn scale(&self) -> f64 {
        let r = self.rank as f64;
        self.alpha / if self.rslora { r.sqrt() } else { r }
    }
}

/// One adapter: this rank's factors `a` `[r, in_local]`, `b` `[out_local, r]` and the scale.
#[derive(Clone)]
pub struct Lora {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: Option<crate::lora_dropout::AdapterDropout>,
    /// DoRA's magnitude `m` (this rank's, `[out_local]` or replicated `[out]`; [`Lora::with_dora`]).
    magnitude: Option<Tensor>,
}

impl Lora {
    /// From this rank's factors (split as the module doc's table says): `a` `[r, in]`, `b`
    /// `[out, r]`, the same `r`. Errors name the shapes.
    pub fn new(a: Tensor, b: Tensor, scale: f64) -> Result<Self> {
        let (ra, _) = a.dims2().map_err(|_| candle_core::Error::Msg(format!("LoRA: A {:?} must be [r, in]", a.dims())))?;
        let (_, rb) = b.dims2().map_err(|_| candle_core::Error::Msg(format!("LoRA: B {:?} must be [out, r]", b.dims())))?;
        if ra != rb || ra == 0 {
            bail!("LoRA: A {:?} and B {:?} must share a rank r > 0 (A [r, in], B [out, r])", a.dims(), b.dims())
        }
        if a.dtype() != b.dtype() || !a.device().same_device(b.device()) {
            bail!("LoRA: A ({:?}) and B ({:?}) must share a dtype and a device", a.dtype(), b.dtype())
        }
        Ok(Self { a, b, scale, dropout: None, magnitude: None })
    }

    /// The same adapter with dropout `p` in `[0, 1)` on its input (PEFT's `lora_dropout`;
    /// [`crate::lora_dropout`]): masks on stream `name` for the token indices `rows` holds
    /// (none while it holds no key: no dropout).
    pub fn with_dropout(mut self, p: f64, name: impl Into<String>, rows: &crate::DropoutRows) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            bail!("LoRA: dropout {p} must be in [0, 1)")
        }
        self.dropout = (p > 0.0).then(|| crate::lora_dropout::AdapterDropout { p, name: name.into(), rows: rows.clone() });
        Ok(self)
    }

    /// The same adapter as DoRA ([`crate::dora`]): the layer computes with
    /// `m / ‖W + s·B·A‖ ⊙ (W + s·B·A)`, `magnitude` `m` this rank's (`[out_local]` on a
    /// column-parallel layer, the whole `[out]` replicated on a row-parallel one).
    pub fn with_dora(mut self, magnitude: Tensor) -> Result<Self> {
        if magnitude.rank() != 1 || magnitude.dim(0)? != self.b.dims()[0] {
            bail!("DoRA: magnitude {:?} must be [out] of B {:?} ([out, r])", magnitude.dims(), self.b.dims())
        }
        self.magnitude = Some(magnitude);
        Ok(self)
    }

    /// DoRA's magnitude, if this is a DoRA adapter.
    pub fn magnitude(&self) -> Option<&Tensor> {
        self.magnitude.as_ref()
    }

    /// This rank's slice of the DoRA weight `m / ‖W + s·B·A‖ ⊙ (W + s·B·A)` of its weight slice
    /// `w` split as `split` ([`crate::dora::dora_weight`]), the weight the layer computes with;
    /// `None` for a plain LoRA adapter and while a DoRA adapter's input dropout draws masks (the
    /// layer then computes with `w` and adds [`Lora::dora_update`]'s term, see [`crate::dora`]).
    pub(crate) fn dora_weight(&self, w: &Tensor, split: crate::WeightSplit, tp: &Tp) -> Result<Option<Tensor>> {
        let Some(m) = self.magnitude.as_ref().filter(|_| !self.dora_drops()) else { return Ok(None) };
        // (the replicated tensors' gradients: summed over TP here without SP, by the caller with it)
        Ok(Some(crate::dora::dora_weight(w, &self.a, &self.b, m, self.scale, split, tp, !tp.sequence_parallel)?))
    }

    /// Whether this is a DoRA adapter whose input dropout draws masks now (a training forward):
    /// the layer adds `(W' - W)·drop(x)` beside its base weight ([`crate::dora`]).
    pub(crate) fn dora_drops(&self) -> bool {
        self.magnitude.is_some() && self.dropout.as_ref().is_some_and(|d| d.active())
    }

    /// A DoRA adapter's update weight `W' - W` of this rank's slice `w` ([`crate::dora::dora_update`]);
    /// `None` for a plain LoRA adapter.
    fn dora_update(&self, w: &Tensor, split: crate::WeightSplit, tp: &Tp) -> Result<Option<Tensor>> {
        let Some(m) = &self.magnitude else { return Ok(None) };
        Ok(Some(crate::dora::dora_update(w, &self.a, &self.b, m, self.scale, split, tp, !tp.sequence_parallel)?))
    }

    /// This rank's slice of the adapted weight, detached, for inference: DoRA's weight, or
    /// `W + s·B·A` of this rank's factors (`B` `[out_local, r]`, `A` `[r, in_local]`: a column
    /// layer's rows, a row layer's columns). Collective over TP for a DoRA weight split by
    /// columns (its rows' norms).
    pub(crate) fn merged(&self, w: &Tensor, split: crate::WeightSplit, tp: &Tp) -> Result<Tensor> {
        merged_weight(w, &self.a, &self.b, self.magnitude.as_ref(), self.scale, split, tp)
    }

    /// The keep mask of this adapter's dropout on `x` (drawn again on each call), `None` without
    /// dropout or while no key is set.
    fn mask(&self, x: &Tensor, input: crate::lora_dropout::Input, tp: &Tp) -> Result<Option<candle_cp_ops::autograd::MaskFn>> {
        match &self.dropout {
            Some(d) => d.mask(x, input, tp),
            None => Ok(None),
        }
    }

    /// The keep mask of this adapter's dropout on a column layer's whole input (the gathered
    /// sequence under SP, `[B, P·T, in]` for a shard `x` `[B, T, in]`; `x`'s shape without),
    /// drawn again on each call; `None` without dropout or while no key is set.
    fn full_column_mask(&self, x: &Tensor, tp: &Tp) -> Result<Option<candle_cp_ops::autograd::MaskFn>> {
        let Some(d) = &self.dropout else { return Ok(None) };
        let (b, t, f) = x.dims3()?;
        let sp = tp.size() > 1 && tp.sequence_parallel;
        let whole = Tp { sequence_parallel: false, ..tp.clone() };
        d.mask_of((b, if sp { t * tp.size() } else { t }, f), x.dtype(), x.device(), crate::lora_dropout::Input::Column, &whole)
    }

    /// `drop(x)·wᵀ` (`w` `[n, in]`, e.g. `A`): one node that keeps `x` and `w`, not the mask or
    /// the dropped input ([`crate::masked_matmul`]).
    fn dropped_matmul(&self, x: &Tensor, w: &Tensor, input: crate::lora_dropout::Input, tp: &Tp) -> Result<Tensor> {
        crate::masked_matmul(x, w, self.mask(x, input, tp)?.as_ref())
    }

    /// This rank's factors from `vb`: `lora_A.weight` `[r, in_local]` and `lora_B.weight`
    /// `[out_local, r]`. A fresh `VarMap` draws `A` uniform in `±1/√in_dim` (PEFT's Kaiming
    /// init over the whole input, `in_dim`) and sets `B` to zero, so the adapted layer starts
    /// as the base layer.
    pub fn load(vb: &VarBuilder, in_local: usize, in_dim: usize, out_local: usize, cfg: &LoraConfig) -> Result<Self> {
        Self::load_named(vb, ("lora_A.weight", "lora_B.weight"), in_local, in_dim, out_local, cfg)
    }

    /// [`Lora::load`] with the factors under `names` `(A, B)` in `vb` (e.g. an `A` that several
    /// layers share: a Phi-3's `qkv_proj.lora_A.weight` for its q, k and v projections).
    pub fn load_named(vb: &VarBuilder, (a_name, b_name): (&str, &str), in_local: usize, in_dim: usize, out_local: usize, cfg: &LoraConfig) -> Result<Self> {
        let bound = 1.0 / (in_dim.max(1) as f64).sqrt();
        let a = vb.get_with_hints((cfg.rank, in_local), a_name, Init::Uniform { lo: -bound, up: bound })?;
        let b = vb.get_with_hints((out_local, cfg.rank), b_name, Init::Const(0.0))?;
        Self::new(a, b, cfg.scale())
    }

    /// `A` `[r, in_local]`.
    pub fn a(&self) -> &Tensor {
        &self.a
    }
    /// `B` `[out_local, r]`.
    pub fn b(&self) -> &Tensor {
        &self.b
    }
    /// The update's scale ([`LoraConfig::scale`]).
    pub fn scale(&self) -> f64 {
        self.scale
    }
    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.a.dims()[0]
    }

    /// Check the factors against a layer of input `in_local` and output `out_local` features
    /// (`what` names the layer in errors).
    pub(crate) fn check(&self, what: &str, in_local: usize, out_local: usize) -> Result<()> {
        if self.a.dims()[1] != in_local || self.b.dims()[0] != out_local {
            bail!(
                "{what}: LoRA A {:?} / B {:?} do not fit this rank's weight [{out_local}, {in_local}] (A [r, {in_local}], B [{out_local}, r])",
                self.a.dims(),
                self.b.dims()
            )
        }
        Ok(())
    }
}

/// A rank's slice `w` of an adapted weight with its adapter merged, detached (for inference):
/// `W + s·B·A`, or with a DoRA magnitude `m` DoRA's weight ([`crate::dora::dora_weight`]; its
/// rows' norms over TP for a `Cols` split: collective). `w` `[.., out, in]` with factors
/// `[.., r, in]`, `[.., out, r]` as this rank holds them (2-D, or stacked experts `[E, ·, ·]`).
pub fn merged_weight(w: &Tensor, a: &Tensor, b: &Tensor, m: Option<&Tensor>, scale: f64, split: crate::WeightSplit, tp: &Tp) -> Result<Tensor> {
    let (w, a, b) = (w.detach(), a.detach(), b.detach());
    let merged = match m {
        Some(m) => crate::dora::dora_weight(&w, &a, &b, &m.detach(), scale, split, tp, false)?,
        None => (&w + (b.matmul(&a)? * scale)?.to_dtype(w.dtype())?)?,
    };
    Ok(merged.detach())
}

/// A column-parallel part's update `s·(x·Aᵀ)·Bᵀ` `[.., T, out_local]` from the layer's input
/// `x` as given (the sequence shard under SP, replicated without).
pub(crate) fn column_delta(x: &Tensor, l: &Lora, tp: &Tp) -> Result<Tensor> {
    // (the scale on the r-wide activations: one pass over `[T, out]` fewer, each way)
    (column_u(x, l, tp)? * l.scale)?.broadcast_matmul(&l.b.t()?)
}

/// `u = x·Aᵀ` `[.., T, r]` over the whole sequence: all-gathered along it (SP), or from the
/// input copied into the TP region with `A` copied too (no SP: `A`'s gradient summed over TP
/// in the backward).
pub(crate) fn column_u(x: &Tensor, l: &Lora, tp: &Tp) -> Result<Tensor> {
    let p = tp.size();
    let col = crate::lora_dropout::Input::Column;
    let u = if p > 1 && tp.sequence_parallel {
        mappings::gather_from_sp_region(&l.dropped_matmul(x, &l.a, col, tp)?, &tp.group, SEQ_DIM)?
    } else if p > 1 {
        let a = mappings::copy_to_tp_region(&l.a, &tp.group)?;
        l.dropped_matmul(&mappings::copy_to_tp_region(x, &tp.group)?, &a, col, tp)?
    } else {
        l.dropped_matmul(x, &l.a, col, tp)?
    };
    Ok(u)
}

/// A replicated linear `x·Wᵀ` `[.., T, out]` with its adapter, on the rows this rank holds (`x`
/// its sequence shard under SP, replicated without; the dropout's mask drawn for those rows),
/// without a collective: `W`, `A`, `B` (and DoRA's `m`) replicated, their gradients those of
/// this rank's rows (under SP the caller sums them over TP, as a norm's). LoRA adds
/// `s·(drop(x)·Aᵀ)·Bᵀ`; DoRA computes with its weight `W'` (each row's norm is this rank's:
/// the weight is whole), or adds `drop(x)·(W' − W)ᵀ` while its dropout draws masks.
pub fn replicated_forward(x: &Tensor, w: &Tensor, l: &Lora, tp: &Tp) -> Result<Tensor> {
    let base = |w: &Tensor| crate::linear::affine(x, w, None);
    match &l.magnitude {
        None => base(w)? + (l.dropped_matmul(x, &l.a, crate::lora_dropout::Input::Column, tp)? * l.scale)?.broadcast_matmul(&l.b.t()?)?,
        Some(m) if l.dora_drops() => {
            let dw = crate::dora::dora_update(w, &l.a, &l.b, m, l.scale, crate::WeightSplit::Rows, tp, false)?;
            base(w)? + crate::masked_matmul(x, &dw, l.mask(x, crate::lora_dropout::Input::Column, tp)?.as_ref())?
        }
        Some(m) => base(&crate::dora::dora_weight(w, &l.a, &l.b, m, l.scale, crate::WeightSplit::Rows, tp, false)?),
    }
}

/// `y + d` for an update `d` (none: `y`).
pub(crate) fn plus(y: Tensor, d: Option<Tensor>) -> Result<Tensor> {
    match d {
        Some(d) => y + d,
        None => Ok(y),
    }
}

/// A column-parallel DoRA part's update while its dropout draws masks, on the plain graph:
/// `(W' - W)·x̃` ([`crate::dora`]), `x̃` the dropped input gathered along the sequence (SP) or
/// copied into the TP region. `w` this rank's rows of the part's base weight. `None` for a
/// plain LoRA adapter. (The training path adds it inside the part's node: [`column_update`].)
pub(crate) fn column_dora_delta(x: &Tensor, l: &Lora, w: &Tensor, tp: &Tp) -> Result<Option<Tensor>> {
    let Some(dw) = l.dora_update(w, crate::WeightSplit::Rows, tp)? else { return Ok(None) };
    let xg = if tp.size() > 1 && tp.sequence_parallel {
        mappings::gather_from_sp_region(x, &tp.group, SEQ_DIM)?
    } else {
        mappings::copy_to_tp_region(x, &tp.group)?
    };
    let mask = l.full_column_mask(x, tp)?;
    Ok(Some(crate::masked_matmul(&xg, &dw, mask.as_ref())?))
}

/// A column-parallel part's adapter as an update inside the part's node
/// ([`crate::regather::PartUpdate`], from the gathered input, its dropout's mask drawn on the
/// gathered shape): LoRA's `s·(x̃·Aᵀ)·Bᵀ` (`A` copied into the TP region without SP, so that its
/// gradient is summed over TP), DoRA's `(W' - W)·x̃` while it drops ([`crate::dora`]), none for
/// DoRA otherwise (in the weight). `w` this rank's rows of the part's base weight.
pub(crate) fn column_update(x: &Tensor, l: &Lora, w: &Tensor, tp: &Tp) -> Result<Option<crate::regather::PartUpdate>> {
    use crate::regather::{PartUpdate, UpdateKind};
    let kind = if l.magnitude.is_none() {
        let a = if tp.size() > 1 && !tp.sequence_parallel { mappings::copy_to_tp_region(&l.a, &tp.group)? } else { l.a.clone() };
        UpdateKind::LowRank { a, b: l.b.clone(), scale: l.scale }
    } else if l.dora_drops() {
        let Some(dw) = l.dora_update(w, crate::WeightSplit::Rows, tp)? else { return Ok(None) };
        UpdateKind::Full { w: dw }
    } else {
        return Ok(None);
    };
    Ok(Some(PartUpdate { kind, mask: l.full_column_mask(x, tp)? }))
}

/// A row-parallel DoRA layer's `W' - W` (in the graph; `w` this rank's columns of the base
/// weight) and its dropout's mask of `x` (this rank's features): the partial product
/// `x̃·(W' - W)ᵀ` is added to the base's before the layer's one reduction. `None` for a plain
/// LoRA adapter.
#[allow(clippy::type_complexity)]
pub(crate) fn row_dora_update(x: &Tensor, l: &Lora, w: &Tensor, tp: &Tp) -> Result<Option<(Tensor, Option<candle_cp_ops::autograd::MaskFn>)>> {
    let Some(dw) = l.dora_update(w, crate::WeightSplit::Cols, tp)? else { return Ok(None) };
    Ok(Some((dw, l.mask(x, crate::lora_dropout::Input::Row, tp)?)))
}

/// A row-parallel layer's update `s·(Σ_TP x·Aᵀ)·Bᵀ` in the layer's output layout (the
/// sequence shard under SP, replicated without), from its feature-sharded input `x`.
pub(crate) fn row_delta(x: &Tensor, l: &Lora, tp: &Tp) -> Result<Tensor> {
    (row_v(x, l, tp)? * l.scale)?.broadcast_matmul(&l.b.t()?)
}

/// A row-parallel layer's adapter activations `v = Σ_TP drop(x)·Aᵀ` `[.., r]` in the layer's
/// output layout (reduce-scattered along the sequence under SP, all-reduced without).
pub(crate) fn row_v(x: &Tensor, l: &Lora, tp: &Tp) -> Result<Tensor> {
    let p = tp.size();
    let v = l.dropped_matmul(x, &l.a, crate::lora_dropout::Input::Row, tp)?;
    if p == 1 {
        Ok(v)
    } else if tp.sequence_parallel {
        mappings::reduce_scatter_to_sp_region(&v, &tp.group, SEQ_DIM)
    } else {
        mappings::reduce_from_tp_region(&v, &tp.group)
    }
}

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
