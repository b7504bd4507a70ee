//! The experts' product with an adapter's update inside the same node:
//!
//! ```text
//!   y = grouped(x, W) + U(x ⊙ M)        U: LoRA's s·grouped(grouped(·, A), B), or grouped(·, Δ)
//! ```
//!
//! for rows `x` `[M, in]` grouped by expert, stacked weights `W` `[E, out, in]`, an optional
//! elementwise mask `M` `[M, in]` (a dropout's, drawn again in the backward). The graph keeps
//! `x` and the weights only: not the `[M, out]` base product and update that an add after two
//! [`grouped_matmul`](crate::moe::grouped_matmul)s would keep alive, nor the mask or the
//! masked rows (a mixture of experts' LoRA, `candle_cp_llama`'s `moe_lora`).
//!
//! [`grouped_matmul_update_slow`] is the same from candle's ops: the reference of the tests.

use crate::autograd::{apply_mask_opt, attach_n, BackwardFn, MaskFn};
use crate::moe::grouped_matmul_slow;
use crate::moe_gemm::{gmm, gmm_dbias, gmm_dw, gmm_dx};
use candle_core::{bail, Result, Tensor};
use std::sync::Arc;

/// The update a [`grouped_matmul_update`] adds.
#[derive(Clone)]
pub enum GroupedUpdate {
    /// LoRA's `s·((x·A[e]ᵀ)·B[e]ᵀ)` per expert: `A` `[E, r, in]`, `B` `[E, out, r]`.
    LowRank {
        /// `A` `[E, r, in]`.
        a: Tensor,
        /// `B` `[E, out, r]`.
        b: Tensor,
        /// The scale `s`.
        scale: f64,
    },
    /// `x·Δ[e]ᵀ` per expert, `Δ` `[E, out, in]` (DoRA's `W' - W` while its dropout draws masks).
    Full {
        /// `Δ` `[E, out, in]`.
        w: Tensor,
    },
}

impl GroupedUpdate {
    fn inputs(&self) -> Vec<&Tensor> {
        match self {
            GroupedUpdate::LowRank { a, b, .. } => vec![a, b],
            GroupedUpdate::Full { w } => vec![w],
        }
    }

    fn detached(&self) -> Self {
        match self {
            GroupedUpdate::LowRank { a, b, scale } => GroupedUpdate::LowRank { a: a.detach(), b: b.detach(), scale: *scale },
            GroupedUpdate::Full { w } => GroupedUpdate::Full { w: w.detach() },
        }
    }
}

/// Refuse an update whose shapes do not fit `W` `[E, out, in]`, naming them.
fn check(w: &Tensor, up: &GroupedUpdate) -> Result<()> {
    let (e, o, i) = w.dims3()?;
    let fits = match up {
        GroupedUpdate::LowRank { a, b, .. } => match (a.dims(), b.dims()) {
            (&[ea, r, ia], &[eb, ob, rb]) => ea == e && eb == e && ia == i && ob == o && rb == r,
            _ => false,
        },
        GroupedUpdate::Full { w: d } => d.dims() == w.dims(),
    };
    if !fits {
        let dims: Vec<Vec<usize>> = up.inputs().iter().map(|t| t.dims().to_vec()).collect();
        bail!("grouped_matmul_update: update {dims:?} does not fit W {:?} (A [E, r, in], B [E, out, r], or Δ [E, out, in])", w.dims())
    }
    Ok(())
}

/// `grouped(x, W) + U(x ⊙ mask())` (see the module doc) as one node over `x`, `W` and the
/// update's weights; `counts` the rows per expert, `mask` `[M, in]` or none. Errors name the
/// shapes.
pub fn grouped_matmul_update(x: &Tensor, w: &Tensor, counts: &[usize], update: &GroupedUpdate, mask: Option<&MaskFn>) -> Result<Tensor> {
    update_node(x, w, None, counts, update, mask)
}

/// [`grouped_matmul_update`] plus each row's expert's bias (gpt-oss's experts with LoRA):
/// `bias` `[E, nb]` added to columns `[col0, col0 + nb)` of its expert's rows, as
/// [`crate::moe::grouped_matmul_bias`] adds it, inside the same node (its backward adds
/// `dbias[e]`, the sum of expert `e`'s rows of the output's gradient over those columns).
/// Errors name the shapes. Reference: [`grouped_matmul_update_bias_slow`].
pub fn grouped_matmul_update_bias(x: &Tensor, w: &Tensor, bias: &Tensor, col0: usize, counts: &[usize], update: &GroupedUpdate, mask: Option<&MaskFn>) -> Result<Tensor> {
    update_node(x, w, Some((bias, col0)), counts, update, mask)
}

/// The node of [`grouped_matmul_update`] and [`grouped_matmul_update_bias`].
fn update_node(x: &Tensor, w: &Tensor, bias: Option<(&Tensor, usize)>, counts: &[usize], update: &GroupedUpdate, mask: Option<&MaskFn>) -> Result<Tensor> {
    let y0 = match bias {
        Some((b, col0)) => crate::moe::grouped_matmul_bias(&x.detach(), &w.detach(), &b.detach(), col0, counts)?,
        None => crate::moe::grouped_matmul(&x.detach(), &w.detach(), counts)?,
    };
    check(w, update)?;
    let (xd, wd, ud) = (x.detach(), w.detach(), update.detached());
    let bias_d = bias.map(|(b, c)| (b.detach(), c));
    let op = if bias.is_some() { "grouped_matmul_update_bias" } else { "grouped_matmul_update" };
    let (xm, _) = apply_mask_opt(op, &xd, mask)?;
    let y = (y0 + term(&xm, &ud, counts)?)?;
    drop(xm);
    let (counts, mask) = (counts.to_vec(), mask.cloned());
    let bwd: BackwardFn = Arc::new(move |g: &Tensor| {
        let g = g.detach();
        let (xm, m) = apply_mask_opt(op, &xd, mask.as_ref())?;
        let c = &counts;
        // the update's input gradient (before the mask) and its weights' gradients
        let (dxu, du) = match &ud {
            GroupedUpdate::LowRank { a, b, scale } => {
                let gb = gmm_dx(&g, b, c)?.affine(*scale, 0.0)?;
                let u = gmm(&xm, a, None, c)?;
                let da = gmm_dw(&gb, &xm, c)?;
                let db = gmm_dw(&g, &u, c)?.affine(*scale, 0.0)?;
                (gmm_dx(&gb, a, c)?, vec![da, db])
            }
            GroupedUpdate::Full { w: d } => (gmm_dx(&g, d, c)?, vec![gmm_dw(&g, &xm, c)?]),
        };
        let dxu = match m {
            Some(m) => (dxu * m)?,
            None => dxu,
        };
        let mut grads = vec![Some((gmm_dx(&g, &wd, c)? + dxu)?), Some(gmm_dw(&g, &xd, c)?)];
        grads.extend(du.into_iter().map(Some));
        if let Some((bd, col0)) = &bias_d {
            grads.push(Some(gmm_dbias(&g, bd, *col0, c)?));
        }
        Ok(grads)
    });
    let mut inputs = vec![x, w];
    inputs.extend(update.inputs());
    if let Some((b, _)) = bias {
        inputs.push(b);
    }
    attach_n(op, &inputs, y, bwd)
}

/// [`grouped_matmul_update_bias`] from candle's ops ([`crate::moe::grouped_matmul_bias_slow`]
/// and [`grouped_matmul_update_slow`]'s update): the reference.
pub fn grouped_matmul_update_bias_slow(x: &Tensor, w: &Tensor, bias: &Tensor, col0: usize, counts: &[usize], update: &GroupedUpdate, mask: Option<&Tensor>) -> Result<Tensor> {
    let base = crate::moe::grouped_matmul_slow(x, w, counts)?;
    let with_bias = crate::moe::grouped_matmul_bias_slow(x, w, bias, col0, counts)?;
    grouped_matmul_update_slow(x, w, counts, update, mask)? + (with_bias - base)?
}

/// The update's term `[M, out]` of the masked rows `xm` (detached weights).
fn term(xm: &Tensor, up: &GroupedUpdate, counts: &[usize]) -> Result<Tensor> {
    match up {
        GroupedUpdate::LowRank { a, b, scale } => {
            let u = gmm(xm, a, None, counts)?;
            gmm(&u, b, None, counts)?.affine(*scale, 0.0)
        }
        GroupedUpdate::Full { w } => gmm(xm, w, None, counts),
    }
}

/// [`grouped_matmul_update`] from candle's ops ([`grouped_matmul_slow`], `mul`, `add`): the
/// reference.
pub fn grouped_matmul_update_slow(x: &Tensor, w: &Tensor, counts: &[usize], update: &GroupedUpdate, mask: Option<&Tensor>) -> Result<Tensor> {
    check(w, update)?;
    let xm = match mask {
        Some(m) => x.mul(m)?,
        None => x.clone(),
    };
    let t = match update {
        GroupedUpdate::LowRank { a, b, scale } => (grouped_matmul_slow(&grouped_matmul_slow(&xm, a, counts)?, b, counts)? * *scale)?,
        GroupedUpdate::Full { w: d } => grouped_matmul_slow(&xm, d, counts)?,
    };
    grouped_matmul_slow(x, w, counts)? + t
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn t(shape: &[usize], seed: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.43 + seed).sin() * 0.5) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }

    /// LoRA and full updates, with and without a mask, an expert without rows: the output and
    /// the gradients of x, W and the update's weights equal the slow reference's; bad shapes are
    /// refused by name.
    #[test]
    fn update_matches_the_slow_reference() -> Result<()> {
        let (e, i, o, r) = (3, 5, 4, 2);
        let counts = [3usize, 0, 4];
        let m = counts.iter().sum::<usize>();
        let mask_t = t(&[m, i], 7.0)?.ge(0.0)?.to_dtype(candle_core::DType::F32)?.affine(1.0 / 0.7, 0.0)?;
        for (low, masked) in [(true, false), (true, true), (false, true)] {
            let vars: Vec<Var> = [vec![m, i], vec![e, o, i], if low { vec![e, r, i] } else { vec![e, o, i] }, vec![e, o, r]]
                .iter()
                .enumerate()
                .map(|(k, s)| Var::from_tensor(&t(s, k as f64 + 0.3)?))
                .collect::<Result<_>>()?;
            let up = if low {
                GroupedUpdate::LowRank { a: vars[2].as_tensor().clone(), b: vars[3].as_tensor().clone(), scale: 0.75 }
            } else {
                GroupedUpdate::Full { w: vars[2].as_tensor().clone() }
            };
            let mk = mask_t.clone();
            let mask: MaskFn = Arc::new(move || Ok(mk.clone()));
            let c = t(&[m, o], 9.1)?;
            let y = grouped_matmul_update(vars[0].as_tensor(), vars[1].as_tensor(), &counts, &up, masked.then_some(&mask))?;
            let want = grouped_matmul_update_slow(vars[0].as_tensor(), vars[1].as_tensor(), &counts, &up, masked.then_some(&mask_t))?;
            let diff = |a: &Tensor, b: &Tensor| -> Result<f32> { (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
            assert!(diff(&y, &want)? < 1e-6, "low {low} masked {masked}: output");
            let (gy, gw) = ((&y * &c)?.sum_all()?.backward()?, (&want * &c)?.sum_all()?.backward()?);
            let n = if low { 4 } else { 3 };
            for (k, v) in vars.iter().take(n).enumerate() {
                let (a, b) = (gy.get(v.as_tensor()), gw.get(v.as_tensor()));
                let (Some(a), Some(b)) = (a, b) else { candle_core::bail!("low {low} masked {masked}: input {k} has no gradient") };
                assert!(diff(a, b)? < 1e-5, "low {low} masked {masked}: gradient of input {k} off by {}", diff(a, b)?);
            }
        }
        let bad = GroupedUpdate::LowRank { a: t(&[e, r, i + 1], 0.0)?, b: t(&[e, o, r], 0.0)?, scale: 1.0 };
        let err = grouped_matmul_update(&t(&[m, i], 0.0)?, &t(&[e, o, i], 0.0)?, &counts, &bad, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("[3, 2, 6]") && err.contains("[3, 4, 5]"), "{err}");
        Ok(())
    }

    /// With the experts' biases (a whole row's and a TP rank's column slice), a LoRA update,
    /// an expert without rows: the output and the gradients of x, W, A, B and the bias equal
    /// the slow reference's; the bias's gradient is not zero (it is computed, not dropped).
    #[test]
    fn update_with_bias_matches_the_slow_reference() -> Result<()> {
        let (e, i, o, r) = (3, 5, 6, 2);
        let counts = [2usize, 0, 4];
        let m = counts.iter().sum::<usize>();
        for (col0, nb) in [(0, o), (2, 3)] {
            let vars: Vec<Var> = [vec![m, i], vec![e, o, i], vec![e, r, i], vec![e, o, r], vec![e, nb]]
                .iter()
                .enumerate()
                .map(|(k, s)| Var::from_tensor(&t(s, k as f64 + 1.7)?))
                .collect::<Result<_>>()?;
            let up = GroupedUpdate::LowRank { a: vars[2].as_tensor().clone(), b: vars[3].as_tensor().clone(), scale: 1.5 };
            let c = t(&[m, o], 3.3)?;
            let (x, w, b) = (vars[0].as_tensor(), vars[1].as_tensor(), vars[4].as_tensor());
            let y = grouped_matmul_update_bias(x, w, b, col0, &counts, &up, None)?;
            let want = grouped_matmul_update_bias_slow(x, w, b, col0, &counts, &up, None)?;
            let diff = |a: &Tensor, b: &Tensor| -> Result<f32> { (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
            assert!(diff(&y, &want)? < 1e-6, "col0 {col0}: output");
            let (gy, gw) = ((&y * &c)?.sum_all()?.backward()?, (&want * &c)?.sum_all()?.backward()?);
            for (k, v) in vars.iter().enumerate() {
                let (Some(a), Some(b)) = (gy.get(v.as_tensor()), gw.get(v.as_tensor())) else { candle_core::bail!("col0 {col0}: input {k} has no gradient") };
                assert!(diff(a, b)? < 1e-5, "col0 {col0}: gradient of input {k} off by {}", diff(a, b)?);
            }
            let db = gy.get(b).map(|g| g.abs()?.sum_all()?.to_scalar::<f32>()).transpose()?.unwrap_or(0.0);
            assert!(db > 1e-3, "col0 {col0}: the bias's gradient is {db}");
        }
        let err = grouped_matmul_update_bias(&t(&[m, i], 0.0)?, &t(&[e, o, i], 0.0)?, &t(&[e, o + 1], 0.0)?, 0, &counts, &GroupedUpdate::Full { w: t(&[e, o, i], 0.0)? }, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("[3, 7]"), "{err}");
        Ok(())
    }
}
