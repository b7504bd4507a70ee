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
    candle_cp_comm::ensure_nonempty("merge", "out_a", out_a)?;
    if out_a.device().is_cpu() {
        return merge_cpu(out_a, lse_a, out_b, lse_b);
    }
    #[cfg(feature = "cuda")]
    if out_a.device().is_cuda() {
        return super::cuda::merge(out_a, lse_a, out_b, lse_b);
    }
    merge_ops(out_a, lse_a, out_b, lse_b)
}

/// CPU: one pass over host f32 copies.
fn merge_cpu(out_a: &Tensor, lse_a: &Tensor, out_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, t, h, d) = out_a.dims4()?;
    let (oa, ob) = (super::host_f32(out_a)?, super::host_f32(out_b)?);
    let (la, lb) = (super::host_f32(lse_a)?, super::host_f32(lse_b)?);
    let mut out = vec![0f32; oa.len()];
    let mut lse = vec![f32::NEG_INFINITY; la.len()];
    for bi in 0..b {
        for ti in 0..t {
            for hi in 0..h {
                let r = (bi * h + hi) * t + ti;
                let (x, y) = (la[r], lb[r]);
                let m = if x > y { x } else { y };
                if m == f32::NEG_INFINITY && !x.is_nan() && !y.is_nan() {
                    continue; // no visible key in either part: out 0, lse -inf
                }
                let (ea, eb) = ((x - m).exp(), (y - m).exp());
                let sum = ea + eb;
                lse[r] = m + sum.ln();
                let (wa, wb) = (ea / sum, eb / sum);
                let o = ((bi * t + ti) * h + hi) * d;
                for j in o..o + d {
                    out[j] = wa * oa[j] + wb * ob[j];
                }
            }
        }
    }
    let dev = out_a.device();
    Ok((Tensor::from_vec(out, (b, t, h, d), dev)?, Tensor::from_vec(lse, (b, h, t), dev)?))
}

/// Any device: the same formula from candle tensor ops.
pub(crate) fn merge_ops(out_a: &Tensor, lse_a: &Tensor, out_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cpu_pass_equals_tensor_ops() -> Result<()> {
        let dev = Device::Cpu;
        let oa = Tensor::randn(0f32, 1.0, (2, 5, 3, 4), &dev)?;
        let ob = Tensor::randn(0f32, 1.0, (2, 5, 3, 4), &dev)?;
        let mut la = Tensor::randn(0f32, 3.0, (2, 3, 5), &dev)?.flatten_all()?.to_vec1::<f32>()?;
        let lb = Tensor::randn(0f32, 3.0, (2, 3, 5), &dev)?.flatten_all()?.to_vec1::<f32>()?;
        let mut lb2 = lb.clone();
        la[0] = f32::NEG_INFINITY; // one side empty
        la[1] = f32::NEG_INFINITY; // both empty
        lb2[1] = f32::NEG_INFINITY;
        let la = Tensor::from_vec(la, (2, 3, 5), &dev)?;
        let lb = Tensor::from_vec(lb2, (2, 3, 5), &dev)?;
        let (o1, l1) = merge_cpu(&oa, &la, &ob, &lb)?;
        let (o2, l2) = merge_ops(&oa, &la, &ob, &lb)?;
        let d = (o1 - o2)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-6, "out differs by {d}");
        let (l1, l2) = (l1.flatten_all()?.to_vec1::<f32>()?, l2.flatten_all()?.to_vec1::<f32>()?);
        for (x, y) in l1.iter().zip(&l2) {
            assert!(x == y || (x - y).abs() < 1e-6, "{x} vs {y}");
        }
        assert_eq!(l1[1], f32::NEG_INFINITY);
        Ok(())
    }
}
