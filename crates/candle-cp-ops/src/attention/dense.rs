//! The unmasked forward from candle ops on the tensors' own device: what [`super::attention_fwd`]
//! runs on a device without a kernel for the head dim when the score matrix is small (a decode
//! step: `T` of 1 or a few rows), instead of copying q, k, v to the host for the CPU kernel.
//! DeepSeek's absorbed decode (head dim `rkv + rope` = 576, no CUDA kernel) stays on the GPU:
//! two batched matrix products (cuBLAS) and a softmax over `[B, Hkv, G·T, S]` in f32.
//!
//! ```text
//!  q [B, T, H, D] → [B, Hkv, G·T, D]      (query head h = kv head h / G, G = H / Hkv)
//!  s = scale · q kᵀ  [B, Hkv, G·T, S] f32  (soft cap: cap · tanh(s / cap))
//!  lse = m + ln Σ exp(s − m),  out = exp(s − lse) · v  → [B, T, H, D], lse [B, H, T]
//! ```
//!
//! Its CPU reference is the CPU kernel (`kernel::forward`); the tests compare the two on the CPU.

use super::{AttnDims, Scores};
use candle_core::{DType, Result, Tensor, D};

/// Most score entries (`B·H·T·S`) the dense path materialises: 2^26 (256 MiB of f32), a
/// decode step of 128 heads over a 512k-row cache shard. Larger calls take the host copies.
pub(crate) const MAX_SCORES: usize = 1 << 26;

/// Does a call of these sizes fit the dense path?
pub(crate) fn fits(dims: AttnDims) -> bool {
    dims.b.saturating_mul(dims.h).saturating_mul(dims.t).saturating_mul(dims.s) <= MAX_SCORES
}

/// Unmasked attention of checked inputs (`dims` from `check_qkv`): out f32 `[B, T, H, D]`,
/// lse f32 `[B, H, T]` on q's device. Every row sees every key (`S ≥ 1`), so no row is empty.
pub(crate) fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, scale: Scores, dims: AttnDims) -> Result<(Tensor, Tensor)> {
    let AttnDims { b, t, h, hkv, d, .. } = dims;
    let g = h / hkv;
    let f32c = |x: &Tensor| x.to_dtype(DType::F32)?.contiguous();
    // [B, T, H, D] → [B, H, T, D] → [B, Hkv, G·T, D]
    let qh = f32c(&q.transpose(1, 2)?)?.reshape((b, hkv, g * t, d))?;
    let kh = f32c(&k.transpose(1, 2)?)?; // [B, Hkv, S, D]
    let vh = f32c(&v.transpose(1, 2)?)?;
    let mut sc = (qh.matmul(&kh.t()?)? * scale.scale)?;
    if let Some(cap) = scale.softcap {
        sc = ((sc / cap)?.tanh()? * cap)?;
    }
    let m = sc.max_keepdim(D::Minus1)?;
    let lse = (sc.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?;
    let p = sc.broadcast_sub(&lse)?.exp()?;
    let out = p.matmul(&vh)?.reshape((b, h, t, d))?.transpose(1, 2)?.contiguous()?;
    Ok((out, lse.reshape((b, h, t))?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{check_qkv, kernel, Band, Mask};
    use crate::oracle::randn;

    /// The dense forward equals the CPU kernel's (GQA, MQA, one and several query rows, a
    /// soft cap, a head dim of 576 as DeepSeek's absorbed decode has, bf16 inputs).
    #[test]
    fn dense_equals_the_kernel() -> Result<()> {
        for (i, &(b, t, s, h, hkv, d, cap)) in [
            (2usize, 1usize, 37usize, 4usize, 2usize, 16usize, None),
            (1, 3, 130, 6, 1, 576, None),
            (2, 5, 9, 4, 4, 24, Some(7.0)),
            (1, 1, 1, 2, 1, 8, None),
        ]
        .iter()
        .enumerate()
        {
            for dt in [DType::F32, DType::BF16] {
                let (q, k, v) = (randn(3 * i as u64, &[b, t, h, d], 1.0)?, randn(3 * i as u64 + 1, &[b, s, hkv, d], 1.0)?, randn(3 * i as u64 + 2, &[b, s, hkv, d], 1.0)?);
                let (q, k, v) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
                let scale = Scores::new(0.7 / (d as f64).sqrt()).with_softcap(cap);
                let dims = check_qkv("test", &q, &k, &v, &Mask::Full)?;
                assert!(fits(dims));
                let (o, l) = fwd(&q, &k, &v, scale, dims)?;
                let host = |x: &Tensor| x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
                let (ko, kl) = kernel::forward(&host(&q)?, &host(&k)?, &host(&v)?, dims, &Band::from_mask(&Mask::Full, t, s), scale.f32s());
                let err = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                let (eo, el) = (err(&host(&o)?, &ko), err(&host(&l)?, &kl));
                assert!(eo < 2e-5 && el < 2e-5, "case {i} {dt:?}: out {eo:.1e}, lse {el:.1e}");
                assert_eq!((o.dims(), l.dims()), ([b, t, h, d].as_slice(), [b, h, t].as_slice()));
            }
        }
        let big = AttnDims { b: 1, t: 1, s: MAX_SCORES / 128 + 1, h: 128, hkv: 1, d: 576 };
        assert!(!fits(big) && fits(AttnDims { s: MAX_SCORES / 128, ..big }));
        Ok(())
    }
}
