//! `merge`: combine two partial attention results over disjoint key sets.

use candle_core::{DType, Result, Tensor};

/// Merge partial results `(out_a, lse_a)` and `(out_b, lse_b)` computed over disjoint key sets
/// for the same queries: out `[B, T, H, D]`, lse `[B, H, T]` -> the attention over the union.
///
/// `lse = log(exp(lse_a) + exp(lse_b))`, `out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b`,
/// evaluated in f32 relative to the row max; a row with both lse `-inf` (no visible key in
/// either part) gives out 0 and lse `-inf`, never NaN. Inputs of any float dtype; outputs f32.
pub fn merge(out_a: &Tensor, lse_a: &Tensor, out_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
    let od = out_a.dims();
    if od.len() != 4 || out_b.dims() != od || lse_a.dims() != [od[0], od[2], od[1]] || lse_b.dims() != lse_a.dims() {
        candle_core::bail!(
            "merge: expected out_a/out_b [B, T, H, D] and lse_a/lse_b [B, H, T], got out_a {:?}, lse_a {:?}, out_b {:?}, lse_b {:?}",
            out_a.shape(), lse_a.shape(), out_b.shape(), lse_b.shape()
        )
    }
    let f = |x: &Tensor| x.to_dtype(DType::F32);
    let (oa, la, ob, lb) = (f(out_a)?, f(lse_a)?, f(out_b)?, f(lse_b)?);
    let m = la.maximum(&lb)?;
    let finite = m.ge(f32::MIN)?;
    let m = finite.where_cond(&m, &m.zeros_like()?)?;
    let ea = (&la - &m)?.exp()?;
    let eb = (&lb - &m)?.exp()?;
    let sum = (&ea + &eb)?;
    let lse = (&m + sum.log()?)?;
    let safe = (&sum + sum.eq(0f32)?.to_dtype(DType::F32)?)?;
    // weights [B, H, T] -> [B, T, H, 1]
    let w = |e: &Tensor| -> Result<Tensor> { (e / &safe)?.transpose(1, 2)?.unsqueeze(3) };
    let out = (oa.broadcast_mul(&w(&ea)?)? + ob.broadcast_mul(&w(&eb)?)?)?;
    Ok((out, lse))
}
