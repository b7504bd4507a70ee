//! DoRA (weight-decomposed LoRA, PEFT's `use_dora`): an adapted weight is
//! `W' = g ⊙ (W + s·B·A)` with `g = m / ‖W + s·B·A‖` per output row, `m` the trained magnitude
//! (`lora_magnitude_vector`, `[out]`, initialised to the rows' norms `‖W‖`) and the norm
//! treated as a constant (detached, as the paper and PEFT do).
//!
//! The layer computes with `W'` in place of `W` (one `[out, in]` tensor per adapted weight and
//! forward, as PEFT's DoRA builds `W + s·B·A` for its norm), so every forward path — fused parts,
//! output maps, the re-gathered SP input, the lean row-parallel nodes — is the plain layer's;
//! the gradient of `W'` flows on to `A`, `B` and `m`. Over a frozen `W` (a LoRA run's base) `W'`
//! is one graph node over `A`, `B`, `m` whose backward rebuilds `W + s·B·A`: the graph keeps `W'`
//! alone (the layer's product needs it), `e` bytes per adapted weight until the backward.
//!
//! Over TP each rank builds its slice of `W'`:
//!
//! | layer | `W` | `m` | the rows' norms |
//! |-------|-----|-----|-----------------|
//! | [`crate::ColumnParallelLinear`] | rows | rows, as the weight | local (whole rows) |
//! | [`crate::RowParallelLinear`] | columns | replicated | the squares' sums all-reduced over TP |
//!
//! A replicated tensor (the column layer's `A`; the row layer's `B` and `m`) gets on each TP rank
//! the share of its gradient that rank's slice of `W'` gives: summed over TP in the backward
//! without SP (`copy_to_tp_region`), by the caller with SP, as the LoRA factors' (see
//! [`crate::lora`]).
//!
//! Training with dropout on the adapter's input (PEFT's `lora_dropout` with `use_dora`): PEFT
//! then runs the base weight a second time, on the dropped input `x̃`, and the layer is
//! `y = W·x + (g - 1) ⊙ W·x̃ + g ⊙ s·B·A·x̃ = W·x + (W' - W)·x̃`. The layer computes exactly
//! that: the plain layer with `W` on `x`, and inside the same node the update `(W' - W)·x̃`
//! with [`dora_update`] (`W' - W`, formed in f32) in place of LoRA's `s·B·A` (a column part's
//! from the input it gathers anyway, the mask drawn on the gathered shape; a row layer's partial
//! products summed before its one reduction). The graph keeps `W' - W` (as it keeps `W'`
//! without dropout), neither the dropped input nor its mask (drawn again in the backward) nor
//! any `[T, out]` tensor; the price is a third `[out, in]`-sized product in the backward (the
//! gradient of `W' - W`, which PEFT forms from its kept `W·x̃` `[T, out]` instead): 5 products
//! of the base's size per step against the frozen base's 2 (forward, input gradient) and
//! PEFT's 4 (`docs/benchmarks.md`, `bench_lora`).

use candle_core::{bail, DType, Result, Tensor, D};
use candle_cp_ops::mappings;

use crate::Tp;

/// How the weight an adapter is on is split over TP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightSplit {
    /// Rows (output features): [`crate::ColumnParallelLinear`], a stacked expert's gate / up.
    Rows,
    /// Columns (input features): [`crate::RowParallelLinear`], a stacked expert's down.
    Cols,
}

/// `W' = g ⊙ (W + s·B·A)`, `g = m / ‖W + s·B·A‖` (the norm over the input features, detached):
/// this rank's slice. `w` `[.., out, in]` (2-D, or stacked `[E, out, in]`), `a` `[.., r, in]`,
/// `b` `[.., out, r]`, `m` `[.., out]`, each this rank's as the module doc's table splits them;
/// `sum_replicated`: sum the replicated tensors' gradients over TP in the backward (without SP).
/// The result has `w`'s dtype; the norms are taken in f32. Errors name the shapes.
#[allow(clippy::too_many_arguments)]
pub fn dora_weight(w: &Tensor, a: &Tensor, b: &Tensor, m: &Tensor, scale: f64, split: WeightSplit, tp: &Tp, sum_replicated: bool) -> Result<Tensor> {
    check_fit(w, a, b, m)?;
    let (a, b, m) = in_graph(a, b, m, split, tp, sum_replicated)?;
    if !w.track_op() {
        return dora_weight_lean(w, &a, &b, &m, scale, split, tp, false);
    }
    let v = (w + (b.matmul(&a)? * scale)?.to_dtype(w.dtype())?)?;
    let norm = row_norms(&v.detach(), split, tp)?;
    let g = m.to_dtype(DType::F32)?.unsqueeze(D::Minus1)?.broadcast_div(&norm)?;
    v.broadcast_mul(&g.to_dtype(w.dtype())?)
}

/// `W' - W`, the update a DoRA layer adds beside its base weight when it trains with dropout
/// (see the module doc): [`dora_weight`]'s arguments and splits, the difference formed in f32
/// (not from a rounded `W'`) and cast to `w`'s dtype. Its gradient flows to `A`, `B`, `m` (and
/// to `w` when `w` is in a graph: `g - 1` per row). Errors name the shapes.
#[allow(clippy::too_many_arguments)]
pub fn dora_update(w: &Tensor, a: &Tensor, b: &Tensor, m: &Tensor, scale: f64, split: WeightSplit, tp: &Tp, sum_replicated: bool) -> Result<Tensor> {
    check_fit(w, a, b, m)?;
    let (a, b, m) = in_graph(a, b, m, split, tp, sum_replicated)?;
    if !w.track_op() {
        return dora_weight_lean(w, &a, &b, &m, scale, split, tp, true);
    }
    let f = DType::F32;
    let wf = w.to_dtype(f)?;
    let v = (&wf + (b.to_dtype(f)?.matmul(&a.to_dtype(f)?)? * scale)?)?;
    let norm = row_norms(&v.detach(), split, tp)?;
    let g = m.to_dtype(f)?.unsqueeze(D::Minus1)?.broadcast_div(&norm)?;
    (v.broadcast_mul(&g)? - wf)?.to_dtype(w.dtype())
}

/// `(A, B, m)` as the graph uses them: the replicated ones (a column split's `A`; a row
/// split's `B` and `m`) copied into the TP region when `sum_replicated` (their gradients summed
/// over TP in the backward).
fn in_graph(a: &Tensor, b: &Tensor, m: &Tensor, split: WeightSplit, tp: &Tp, sum_replicated: bool) -> Result<(Tensor, Tensor, Tensor)> {
    let copy = |t: &Tensor| if tp.size() > 1 && sum_replicated { mappings::copy_to_tp_region(t, &tp.group) } else { Ok(t.clone()) };
    Ok(match split {
        WeightSplit::Rows => (copy(a)?, b.clone(), m.clone()),
        WeightSplit::Cols => (a.clone(), copy(b)?, copy(m)?),
    })
}

/// Refuse `W` `[.., out, in]`, `A` `[.., r, in]`, `B` `[.., out, r]`, `m` `[.., out]` that do
/// not fit, naming the shapes.
fn check_fit(w: &Tensor, a: &Tensor, b: &Tensor, m: &Tensor) -> Result<()> {
    let (wd, ad, bd, md) = (w.dims(), a.dims(), b.dims(), m.dims());
    let n = wd.len();
    let fits = n >= 2
        && ad.len() == n
        && bd.len() == n
        && md.len() == n - 1
        && wd[..n - 2] == ad[..n - 2]
        && wd[..n - 2] == bd[..n - 2]
        && wd[..n - 1] == *md
        && ad[n - 1] == wd[n - 1]
        && bd[n - 2] == wd[n - 2]
        && ad[n - 2] == bd[n - 1];
    if !fits {
        bail!("DoRA: W {wd:?}, A {ad:?}, B {bd:?}, m {md:?} do not fit (W [.., out, in], A [.., r, in], B [.., out, r], m [.., out])")
    }
    Ok(())
}

/// `‖V‖` per output row `[.., out, 1]` in f32: over the whole row (the squares' sums
/// all-reduced over TP for a column split).
fn row_norms(v: &Tensor, split: WeightSplit, tp: &Tp) -> Result<Tensor> {
    let sq = v.to_dtype(DType::F32)?.sqr()?.sum_keepdim(D::Minus1)?;
    let sq = if split == WeightSplit::Cols && tp.size() > 1 { tp.group.all_reduce(&sq)? } else { sq };
    sq.sqrt()
}

/// [`dora_weight`] of a frozen `w` (not in a graph, as a LoRA run's base) as one graph node over
/// `A`, `B`, `m` that keeps none of the `[out, in]` temporaries: its backward rebuilds
/// `V = W + s·B·A` from `w` (kept anyway, as the layer's weight) and the factors. With
/// `dW'` the output's gradient and `g = m / ‖V‖`: `dV = g ⊙ dW'`, `dA = s·Bᵀ·dV`,
/// `dB = s·dV·Aᵀ`, `dm = Σ_in dW' ⊙ V / ‖V‖`. With `minus_base` the node is `W' - W`
/// ([`dora_update`], formed in f32), whose gradients over `A`, `B`, `m` are the same.
#[allow(clippy::too_many_arguments)]
fn dora_weight_lean(w: &Tensor, a: &Tensor, b: &Tensor, m: &Tensor, scale: f64, split: WeightSplit, tp: &Tp, minus_base: bool) -> Result<Tensor> {
    let (wd, ad, bd, md) = (w.detach(), a.detach(), b.detach(), m.detach());
    let dt = w.dtype();
    let v_of = move |w: &Tensor, a: &Tensor, b: &Tensor| -> Result<Tensor> { w + (b.matmul(a)? * scale)?.to_dtype(dt)? };
    let (norm, g, out) = if minus_base {
        let f = DType::F32;
        let wf = wd.to_dtype(f)?;
        let v = (&wf + (bd.to_dtype(f)?.matmul(&ad.to_dtype(f)?)? * scale)?)?;
        let norm = row_norms(&v, split, tp)?;
        let g = md.to_dtype(f)?.unsqueeze(D::Minus1)?.broadcast_div(&norm)?;
        let out = (v.broadcast_mul(&g)? - wf)?.to_dtype(dt)?;
        (norm, g, out)
    } else {
        let v = v_of(&wd, &ad, &bd)?;
        let norm = row_norms(&v, split, tp)?;
        let g = md.to_dtype(DType::F32)?.unsqueeze(D::Minus1)?.broadcast_div(&norm)?;
        let out = v.broadcast_mul(&g.to_dtype(dt)?)?;
        (norm, g, out)
    };
    let (fa, fb, fm) = (ad.dtype(), bd.dtype(), md.dtype());
    let bwd: candle_cp_ops::autograd::BackwardFn = std::sync::Arc::new(move |dw: &Tensor| {
        let f = DType::F32;
        // (V as the forward formed it: in f32 for `W' - W`)
        let v = if minus_base { (wd.to_dtype(f)? + (bd.to_dtype(f)?.matmul(&ad.to_dtype(f)?)? * scale)?)? } else { v_of(&wd, &ad, &bd)?.to_dtype(f)? };
        let dw = dw.to_dtype(f)?;
        let dm = (&dw * &v)?.sum_keepdim(D::Minus1)?.broadcast_div(&norm)?.squeeze(D::Minus1)?;
        let dv = dw.broadcast_mul(&g)?;
        let da = (bd.to_dtype(f)?.t()?.matmul(&dv)? * scale)?;
        let db = (dv.matmul(&ad.to_dtype(f)?.t()?)? * scale)?;
        Ok(vec![Some(da.to_dtype(fa)?), Some(db.to_dtype(fb)?), Some(dm.to_dtype(fm)?)])
    });
    candle_cp_ops::autograd::attach3(if minus_base { "DoRA update" } else { "DoRA weight" }, a, b, m, out, bwd)
}

/// The magnitude `m` DoRA starts from: this rank's rows' norms `‖W‖` (`[.., out]`, f32) of its
/// slice `w` `[.., out, in]`, all-reduced over TP for a column split (collective over the TP
/// group then: every rank calls it).
pub fn dora_magnitude(w: &Tensor, split: WeightSplit, tp: &Tp) -> Result<Tensor> {
    if w.rank() < 2 {
        bail!("DoRA: weight {:?} must be [.., out, in]", w.dims())
    }
    let sq = w.to_dtype(DType::F32)?.sqr()?.sum(D::Minus1)?;
    let sq = if split == WeightSplit::Cols && tp.size() > 1 { tp.group.all_reduce(&sq)? } else { sq };
    sq.sqrt()
}

/// The merged weight of a DoRA adapter on full tensors: `W' = m / ‖W + s·B·A‖ ⊙ (W + s·B·A)`
/// in f32, back in `W`'s dtype (2-D or stacked `[E, out, in]`).
pub fn dora_merge(w: &Tensor, a: &Tensor, b: &Tensor, m: &Tensor, scale: f64) -> Result<Tensor> {
    let f = DType::F32;
    let v = (w.to_dtype(f)? + (b.to_dtype(f)?.matmul(&a.to_dtype(f)?)? * scale)?)?;
    if v.dims() != w.dims() || m.dims() != &w.dims()[..w.rank() - 1] {
        bail!("DoRA merge: W {:?}, A {:?}, B {:?}, m {:?} do not fit", w.dims(), a.dims(), b.dims(), m.dims())
    }
    let g = m.to_dtype(f)?.unsqueeze(D::Minus1)?.broadcast_div(&v.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?)?;
    v.broadcast_mul(&g)?.to_dtype(w.dtype())
}
