//! Attention sinks: one learned logit per query head that joins every query row's softmax and
//! attends to nothing (gpt-oss's `self_attn.sinks`; all zeros is the "off-by-one" softmax).
//!
//! For query row `i` of head `h`, with logits `s_ij` over its visible keys and sink `z_h`:
//!
//! ```text
//!   L'_i = log(Σ_j exp(s_ij) + exp(z_h))     the row's log-sum-exp, sink included
//!   O'_i = Σ_j exp(s_ij − L'_i) · v_j        = O_i · exp(L_i − L'_i)
//! ```
//!
//! with `(O_i, L_i)` the attention without the sink. So the sink is applied ONCE, to a row's
//! finished result ([`apply_sinks`]): after a ring has merged every K/V chunk, after
//! all-gather KV, after Ulysses' head-layout attention, after a decode step's LSE merge; never
//! to a partial result (each partial would count `exp(z_h)` again). Applied per partial, or
//! dropped, the error is invisible while the sinks are near their zero initialisation (`exp(0)`
//! against a denominator of order `T`), which is why the tests draw sinks comparable to the
//! row's log-sum-exp.
//!
//! Backward: the sink is one more key whose value is zero, so the ordinary attention backward
//! run with `(O', L')` in place of `(O, L)` gives the exact dq, dk, dv (every engine's backward
//! takes the finished output and LSE), and
//!
//! ```text
//!   dz_h = − Σ_{b, i} exp(z_h − L'_{b,h,i}) · Σ_d (dO' ∘ O')_{b,i,h,d}
//! ```
//!
//! over the rows this rank holds ([`sinks_grad`]). Like any weight replicated over a CP group,
//! the ranks' gradients add up to the whole one (the model sums replicated weights' gradients
//! over DP × CP); a Ulysses rank holds a slice of the heads and its `dz` is zero outside it.

use super::{attention_bwd, attention_bwd_band, attention_fwd, attention_fwd_band, check_qkv, Band, Mask, RowSums, Scores};
use crate::autograd::{attach_n_from_f32, BackwardFromF32};
use candle_core::{bail, DType, Result, Tensor, D};

/// The sink logits `[H]` of an attention call: one per query head of the q it is given (the
/// local heads: a TP rank's slice of the model's heads). Any float dtype; finite values.
///
/// Two `Sinks` are equal when they hold the same tensor (so options holding them compare by
/// which parameter they name, not by value).
#[derive(Clone, Debug)]
pub struct Sinks(Tensor);

impl PartialEq for Sinks {
    fn eq(&self, other: &Self) -> bool {
        self.0.id() == other.0.id()
    }
}

impl Sinks {
    /// Sinks from a `[H]` float tensor (a `Var` for training: the attention functions return
    /// its gradient). Errors name the shape and dtype.
    pub fn new(sinks: &Tensor) -> Result<Self> {
        match sinks.dims() {
            [h] if *h > 0 => {}
            _ => bail!("attention sinks must be [H] (one logit per query head), got {:?}", sinks.shape()),
        }
        if !sinks.dtype().is_float() {
            bail!("attention sinks must be a float tensor, got {:?} {:?}", sinks.dtype(), sinks.shape())
        }
        Ok(Self(sinks.clone()))
    }

    /// The `[H]` tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.0
    }

    /// Number of query heads `H`.
    pub fn heads(&self) -> usize {
        self.0.elem_count()
    }

    /// The sinks of heads `[h0, h0 + n)`, detached (the heads a Ulysses rank attends to; the
    /// caller routes the gradient).
    pub fn narrow(&self, h0: usize, n: usize) -> Result<Sinks> {
        if h0 + n > self.heads() || n == 0 {
            bail!("attention sinks: heads [{h0}, {}) outside the {} sinks", h0 + n, self.heads())
        }
        Ok(Sinks(self.0.detach().narrow(0, h0, n)?))
    }

    /// Errors unless there is one sink per query head of `q [B, T, H, D]` on q's device.
    pub fn check(&self, op: &str, q: &Tensor) -> Result<()> {
        let h = q.dim(2)?;
        if self.heads() != h {
            bail!("{op}: {} sink logits {:?} for q {:?}: one per query head (H = {h})", self.heads(), self.0.shape(), q.shape())
        }
        if !self.0.device().same_device(q.device()) {
            bail!("{op}: sinks {:?} and q {:?} are on different devices", self.0.shape(), q.shape())
        }
        Ok(())
    }
}

/// The finished attention of some query rows without sinks, `out [B, T, H, D]` (any float
/// dtype) and `lse [B, H, T]`, turned into the attention with sinks `[H]`: out f32
/// `O · exp(L − L')`, lse `L' = log(exp(L) + exp(z_h))`. A row with no visible key (lse `-inf`)
/// gets out 0 and lse `z_h`. Plain tensor ops: any device. Only for finished rows (module
/// docs).
pub fn apply_sinks(out: &Tensor, lse: &Tensor, sinks: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, t, h, _) = out.dims4()?;
    if lse.dims() != [b, h, t] || sinks.dims() != [h] {
        bail!("apply_sinks: expected out [B, T, H, D], lse [B, H, T] and sinks [H], got out {:?}, lse {:?}, sinks {:?}", out.shape(), lse.shape(), sinks.shape())
    }
    let z = sinks.detach().to_dtype(DType::F32)?.reshape((1, h, 1))?.broadcast_as((b, h, t))?;
    let lse = lse.to_dtype(DType::F32)?;
    let m = lse.maximum(&z)?;
    let with = (&m + ((&lse - &m)?.exp()? + (&z - &m)?.exp()?)?.log()?)?;
    let w = (&lse - &with)?.exp()?.transpose(1, 2)?.unsqueeze(3)?; // [B, T, H, 1]
    Ok((out.to_dtype(DType::F32)?.broadcast_mul(&w)?, with))
}

/// The sinks' gradient `[H]` (f32) from the finished attention with sinks of this rank's rows:
/// `out`, `dout` `[B, T, H, D]`, `lse [B, H, T]` (sinks included, as [`apply_sinks`] returns
/// it): `dz_h = −Σ exp(z_h − L') · rowsum(dO ∘ O)`.
pub fn sinks_grad(out: &Tensor, lse: &Tensor, dout: &Tensor, sinks: &Tensor) -> Result<Tensor> {
    let (b, t, h, _) = out.dims4()?;
    if dout.dims() != out.dims() || lse.dims() != [b, h, t] || sinks.dims() != [h] {
        bail!("sinks_grad: expected out, dout [B, T, H, D], lse [B, H, T], sinks [H], got out {:?}, dout {:?}, lse {:?}, sinks {:?}", out.shape(), dout.shape(), lse.shape(), sinks.shape())
    }
    let delta = (out.to_dtype(DType::F32)? * dout.to_dtype(DType::F32)?)?.sum(D::Minus1)?; // [B, T, H]
    let z = sinks.detach().to_dtype(DType::F32)?.reshape((1, 1, h))?;
    let p = z.broadcast_sub(&lse.to_dtype(DType::F32)?.transpose(1, 2)?)?.exp()?; // the sink's share
    (p * delta)?.sum((0, 1))?.neg()
}

/// The gradient `dz [n]` of the sinks of heads `[h0, h0 + n)` (a Ulysses rank's) as the
/// gradient of all `h` sinks (zeros elsewhere), in `dtype`.
pub(crate) fn pad_heads(dz: &Tensor, h0: usize, h: usize, dtype: DType) -> Result<Tensor> {
    let n = dz.dim(0)?;
    if h0 + n > h {
        bail!("attention sinks: gradient of heads [{h0}, {}) outside the {h} sinks", h0 + n)
    }
    dz.pad_with_zeros(0, h0, h - h0 - n)?.to_dtype(dtype)
}

/// Raw backward of an attention engine: `(out f32, lse, dout)` of the finished rows (sinks
/// applied) to f32 `(dq, dk, dv)`.
pub(crate) type RawBwd = Box<dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor, Tensor)> + Send + Sync>;

/// Attach an engine's raw result (f32 `out32`, `lse`, computed from detached q, k, v) to the
/// graph: `sinks` applied (if any), out returned in q's dtype, differentiable w.r.t. q, k, v
/// (and the sinks) through `bwd(out32', lse', dout)` and [`sinks_grad`]. The backward's row sums
/// take the output as `row_sums` says. Returns (out, lse').
#[allow(clippy::too_many_arguments)]
pub(crate) fn attach(
    name: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Sinks>,
    out32: Tensor,
    lse: Tensor,
    row_sums: RowSums,
    bwd: RawBwd,
) -> Result<(Tensor, Tensor)> {
    let (out32, lse) = match sinks {
        Some(s) => apply_sinks(&out32, &lse, s.tensor())?,
        None => (out32, lse),
    };
    let (qdt, kdt, l) = (q.dtype(), k.dtype(), lse.clone());
    let z = sinks.map(|s| s.tensor().detach());
    let f: BackwardFromF32 = Box::new(move |o: &Tensor, dout: &Tensor| {
        let (dq, dk, dv) = bwd(o, &l, dout)?;
        let mut g = vec![Some(dq.to_dtype(qdt)?), Some(dk.to_dtype(kdt)?), Some(dv.to_dtype(kdt)?)];
        if let Some(z) = &z {
            g.push(Some(sinks_grad(o, &l, dout, z)?.to_dtype(z.dtype())?));
        }
        Ok(g)
    });
    let keep = row_sums == RowSums::F32;
    let out = match sinks {
        Some(s) => attach_n_from_f32(name, &[q, k, v, s.tensor()], out32, qdt, keep, f)?,
        None => attach_n_from_f32(name, &[q, k, v], out32, qdt, keep, f)?,
    };
    Ok((out, lse))
}

/// Single-device attention with sinks: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`, `sinks` `[H]` ->
/// out `[B, T, H, D]` in q's dtype (differentiable w.r.t. q, k, v and the sinks), lse f32
/// `[B, H, T]` including the sinks (not differentiable). `mask` and `scale` as
/// [`super::attention`]; the backward's row sums as `row_sums` says. The kernels are the
/// attention's own (CPU or CUDA); the sinks are two tensor ops on their result.
pub fn attention_sinks(q: &Tensor, k: &Tensor, v: &Tensor, sinks: &Sinks, mask: &Mask, scale: impl Into<Scores>, row_sums: RowSums) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_sinks")?;
    check_qkv("attention_sinks", q, k, v, mask)?;
    sinks.check("attention_sinks", q)?;
    attach_mask("attention_sinks", q, k, v, Some(sinks), mask, scale, row_sums)
}

/// The raw single-device forward under `mask` on detached q, k, v, attached through
/// [`attach`] with its raw backward (the sinks, if any, applied): what [`attention_sinks`] and
/// the f32-row-sums attention (`row_sums::attention_f32`) run, shapes checked by the caller.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attach_mask(name: &'static str, q: &Tensor, k: &Tensor, v: &Tensor, sinks: Option<&Sinks>, mask: &Mask, scale: Scores, row_sums: RowSums) -> Result<(Tensor, Tensor)> {
    // (contiguous as the op's inputs are; views of q, k, v, which the graph keeps anyway)
    let (qd, kd, vd) = (q.detach().contiguous()?, k.detach().contiguous()?, v.detach().contiguous()?);
    let (out32, lse) = attention_fwd(&qd, &kd, &vd, mask, scale)?;
    let m = *mask;
    let bwd: RawBwd = Box::new(move |o: &Tensor, l: &Tensor, dout: &Tensor| attention_bwd(&qd, &kd, &vd, o, l, dout, &m, scale));
    attach(name, q, k, v, sinks, out32, lse, row_sums, bwd)
}

/// [`attach_mask`] under a [`Band`] (checked, holding its device copy where the kernels want
/// one).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attach_band(name: &'static str, q: &Tensor, k: &Tensor, v: &Tensor, sinks: Option<&Sinks>, band: Band, scale: Scores, row_sums: RowSums) -> Result<(Tensor, Tensor)> {
    let (qd, kd, vd) = (q.detach().contiguous()?, k.detach().contiguous()?, v.detach().contiguous()?);
    let (out32, lse) = attention_fwd_band(&qd, &kd, &vd, &band, scale)?;
    let bwd: RawBwd = Box::new(move |o: &Tensor, l: &Tensor, dout: &Tensor| attention_bwd_band(&qd, &kd, &vd, o, l, dout, &band, scale));
    attach(name, q, k, v, sinks, out32, lse, row_sums, bwd)
}

/// [`attention_sinks`] under a [`Band`] (per-row key intervals: packed documents, windows).
pub fn attention_band_sinks(q: &Tensor, k: &Tensor, v: &Tensor, sinks: &Sinks, band: &Band, scale: impl Into<Scores>, row_sums: RowSums) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_band_sinks")?;
    let dims = check_qkv("attention_band_sinks", q, k, v, &Mask::Full)?;
    band.check("attention_band_sinks", dims.b, dims.t, dims.s)?;
    sinks.check("attention_band_sinks", q)?;
    let mut band = band.clone();
    if band.device_bounds(q.device()).is_none() {
        Band::upload_all([&mut band], q.device())?;
    }
    attach_band("attention_band_sinks", q, k, v, Some(sinks), band, scale, row_sums)
}

#[cfg(test)]
#[path = "sinks_tests.rs"]
mod tests;
