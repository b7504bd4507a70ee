//! RMSNorm and RoPE with hand-written backward passes ([`candle_cp_ops::autograd::attach2`] /
//! `attach1`), beside their plain-candle references (`*_slow`, differentiated by candle's
//! autograd). The fused versions record one graph node instead of a dozen broadcast ops;
//! tests compare values and gradients of the two. The RMSNorm pair is candle-cp-nn's
//! (re-exported here; tested there), RoPE is here.

use candle_core::{bail, Result, Tensor, D};
use candle_cp_ops::autograd::{attach1, BackwardFn};
use std::sync::Arc;

/// RMSNorm with a hand-written backward and its plain-candle reference: they live in
/// candle-cp-nn (used by its [`candle_cp_nn::RmsNorm`] layer, which the model uses).
pub use candle_cp_nn::{rms_norm, rms_norm_slow};

fn check_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(usize, usize)> {
    let (_b, t, _h, d) = x.dims4()?;
    if cos.dims() != [t, d] || sin.dims() != [t, d] || d % 2 != 0 {
        bail!(
            "apply_rope: x {:?} [B, T, H, D] needs cos/sin [{t}, {d}] and even D, got {:?} / {:?}",
            x.dims(),
            cos.dims(),
            sin.dims()
        )
    }
    Ok((t, d))
}

/// `rotate_half(z) = cat(-z[.., D/2..], z[.., ..D/2])` (`transpose = false`) or its transpose
/// `cat(z[.., D/2..], -z[.., ..D/2])`.
fn rotate_half(z: &Tensor, transpose: bool) -> Result<Tensor> {
    let d = z.dim(D::Minus1)?;
    let (a, b) = (
        z.narrow(D::Minus1, 0, d / 2)?,
        z.narrow(D::Minus1, d / 2, d / 2)?,
    );
    if transpose {
        Tensor::cat(&[&b, &a.neg()?], D::Minus1)
    } else {
        Tensor::cat(&[&b.neg()?, &a], D::Minus1)
    }
}

/// RoPE in the HF `rotate_half` form, `x·cos + rotate_half(x)·sin`, for `x` `[B, T, H, D]`
/// and tables `[T, D]` (from [`crate::rope::rope_tables`]). Differentiable w.r.t. `x`
/// (backward: `dy·cos + rotate_halfᵀ(dy·sin)`).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (t, d) = check_rope(x, cos, sin)?;
    let cos = cos.reshape((1, t, 1, d))?.to_dtype(x.dtype())?;
    let sin = sin.reshape((1, t, 1, d))?.to_dtype(x.dtype())?;
    let xd = x.detach();
    let out = (xd.broadcast_mul(&cos)? + rotate_half(&xd, false)?.broadcast_mul(&sin)?)?;
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let dx = (dy.broadcast_mul(&cos)? + rotate_half(&dy.broadcast_mul(&sin)?, true)?)?;
        Ok(vec![Some(dx)])
    });
    attach1("apply_rope", x, out, bwd)
}

/// Reference RoPE from plain candle ops (same math as [`apply_rope`]).
pub fn apply_rope_slow(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (t, d) = check_rope(x, cos, sin)?;
    let cos = cos.reshape((1, t, 1, d))?.to_dtype(x.dtype())?;
    let sin = sin.reshape((1, t, 1, d))?.to_dtype(x.dtype())?;
    x.broadcast_mul(&cos)? + rotate_half(x, false)?.broadcast_mul(&sin)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn max_rel(a: &Tensor, b: &Tensor) -> Result<f32> {
        let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok(d / b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30))
    }

    #[test]
    fn rope_matches_slow_values_and_grads() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = crate::config::LlamaConfig::tiny(16, 32, 1, 2, 1);
        let pos: Vec<u32> = vec![3, 900, 17, 4096, 0];
        let (cos, sin) = crate::rope::rope_tables(&cfg, &pos, DType::F32, &dev)?;
        let x = Var::randn(0f32, 1.0, (2, 5, 2, 16), &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (2, 5, 2, 16), &dev)?;
        let y = apply_rope(x.as_tensor(), &cos, &sin)?;
        let ys = apply_rope_slow(x.as_tensor(), &cos, &sin)?;
        assert!(max_rel(&y, &ys)? < 1e-6);
        let g = (&y * &dy)?.sum_all()?.backward()?;
        let gs = (&ys * &dy)?.sum_all()?.backward()?;
        let (a, b) = (
            g.get(x.as_tensor()).unwrap(),
            gs.get(x.as_tensor()).unwrap(),
        );
        assert!(max_rel(a, b)? < 1e-6);
        assert!(apply_rope(x.as_tensor(), &cos.narrow(0, 0, 4)?, &sin).is_err());
        Ok(())
    }
}
