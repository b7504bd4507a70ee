//! `attention_slow`: the reference attention from plain candle ops (materialises T×S).

use super::Scores;
use super::{check_qkv, Band, Mask};
use crate::packing::Documents;
use candle_core::{DType, Device, Result, Tensor, D};

/// Reference attention from plain candle ops (matmul, masked softmax), differentiable through
/// candle autograd. Same contract as [`super::attention`]: q `[B, T, H, D]`, k/v
/// `[B, S, Hkv, D]` -> out `[B, T, H, D]` (q's dtype), lse f32 `[B, H, T]` (detached). Computes
/// in f32 and builds the full `[B, H, T, S]` score matrix: for tests only.
pub fn attention_slow(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: impl Into<Scores>) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    check_qkv("attention_slow", q, k, v, mask)?;
    slow_with(q, k, v, scale, None, |i, j| mask.visible(i, j))
}

/// [`attention_slow`] with the document mask of a packed sequence (query `i` sees key `j` iff
/// both are in the same document and, when `causal`, `j <= i`): the reference for
/// [`super::attention_docs`] and the packed context-parallel ops. q `[B, T, H, D]`, k/v
/// `[B, T, Hkv, D]`, `docs` covering `T`. For tests only.
pub fn attention_docs_slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    docs: &Documents,
    causal: bool,
    scale: impl Into<Scores>,
) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    super::check_docs("attention_docs_slow", q, k, v, docs)?;
    slow_with(q, k, v, scale, None, |i, j| docs.visible(i, j, causal))
}

/// [`attention_docs_slow`] with any mask inside each document, in positions relative to the
/// document's start (the reference for [`super::attention_docs_mask`]). For tests only.
pub fn attention_docs_mask_slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    docs: &Documents,
    mask: &Mask,
    scale: impl Into<Scores>,
) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    super::check_docs("attention_docs_mask_slow", q, k, v, docs)?;
    slow_with(q, k, v, scale, None, |i, j| match (docs.doc_of(i), docs.doc_of(j)) {
        (Some(a), Some(b)) if a == b => {
            let start = docs.range(a).0;
            mask.visible(i - start, j - start)
        }
        _ => false,
    })
}

/// [`attention_slow`] under a [`Band`] (the reference for [`super::attention_band`]); a band
/// with one row per batch row is applied row by row. For tests only.
pub fn attention_band_slow(q: &Tensor, k: &Tensor, v: &Tensor, band: &Band, scale: impl Into<Scores>) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    let dims = check_qkv("attention_band_slow", q, k, v, &Mask::Full)?;
    band.check("attention_band_slow", dims.b, dims.t, dims.s)?;
    if band.batch() == 1 {
        return slow_with(q, k, v, scale, None, |i, j| band.visible(0, i, j));
    }
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for b in 0..dims.b {
        let r = |x: &Tensor| x.narrow(0, b, 1);
        let (o, l) = slow_with(&r(q)?, &r(k)?, &r(v)?, scale, None, |i, j| band.visible(b, i, j))?;
        outs.push(o);
        lses.push(l);
    }
    Ok((Tensor::cat(&outs, 0)?, Tensor::cat(&lses, 0)?))
}

/// [`attention_slow`] with attention sinks (`sinks [H]`, one logit per query head, see
/// [`super::sinks`]): the sink is one more column of every row's softmax, dropped before the
/// product with V, as Hugging Face's gpt-oss eager attention computes it; differentiable
/// w.r.t. q, k, v and `sinks`. The lse includes the sink. For tests only.
pub fn attention_sinks_slow(q: &Tensor, k: &Tensor, v: &Tensor, sinks: &Tensor, mask: &Mask, scale: impl Into<Scores>) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    check_qkv("attention_sinks_slow", q, k, v, mask)?;
    slow_with(q, k, v, scale, Some(sinks), |i, j| mask.visible(i, j))
}

/// [`attention_sinks_slow`] under a [`Band`] (a band with one row per batch row applied row by
/// row). For tests only.
pub fn attention_band_sinks_slow(q: &Tensor, k: &Tensor, v: &Tensor, sinks: &Tensor, band: &Band, scale: impl Into<Scores>) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    let dims = check_qkv("attention_band_sinks_slow", q, k, v, &Mask::Full)?;
    band.check("attention_band_sinks_slow", dims.b, dims.t, dims.s)?;
    if band.batch() == 1 {
        return slow_with(q, k, v, scale, Some(sinks), |i, j| band.visible(0, i, j));
    }
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for b in 0..dims.b {
        let r = |x: &Tensor| x.narrow(0, b, 1);
        let (o, l) = slow_with(&r(q)?, &r(k)?, &r(v)?, scale, Some(sinks), |i, j| band.visible(b, i, j))?;
        outs.push(o);
        lses.push(l);
    }
    Ok((Tensor::cat(&outs, 0)?, Tensor::cat(&lses, 0)?))
}

/// The reference computation with visibility `visible(query row, key row)` and, with `sinks`
/// `[H]`, a sink column appended to every row's logits (its value zero).
fn slow_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: Scores,
    sinks: Option<&Tensor>,
    visible: impl Fn(usize, usize) -> bool,
) -> Result<(Tensor, Tensor)> {
    let dims = check_qkv("attention_slow", q, k, v, &Mask::Full)?;
    scale.check("attention_slow")?;
    let (b, t, s, h, hkv, d) = (dims.b, dims.t, dims.s, dims.h, dims.hkv, dims.d);
    let g = h / hkv;
    let dev = q.device();
    let qf = q.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?; // [B, H, T, D]
    let rep = |x: &Tensor| -> Result<Tensor> {
        // [B, S, Hkv, D] -> [B, Hkv, S, D] -> [B, Hkv, G, S, D] -> [B, H, S, D]
        x.to_dtype(DType::F32)?
            .transpose(1, 2)?
            .unsqueeze(2)?
            .broadcast_as((b, hkv, g, s, d))?
            .contiguous()?
            .reshape((b, h, s, d))
    };
    let (kf, vf) = (rep(k)?, rep(v)?);
    let scores = (qf.matmul(&kf.t()?.contiguous()?)? * scale.scale)?; // [B, H, T, S]
    let scores = match scale.softcap {
        Some(c) => ((scores / c)?.tanh()? * c)?,
        None => scores,
    };
    let vis: Vec<u8> = (0..t).flat_map(|i| (0..s).map(|j| visible(i, j) as u8).collect::<Vec<_>>()).collect();
    let vis = Tensor::from_vec(vis, (t, s), &Device::Cpu)?.to_device(dev)?.broadcast_as((b, h, t, s))?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, (b, h, t, s), dev)?;
    let masked = vis.where_cond(&scores, &neg_inf)?;
    let masked = match sinks {
        None => masked,
        Some(z) => {
            if z.dims() != [h] {
                candle_core::bail!("attention_sinks_slow: sinks {:?} must be [H] = [{h}]", z.shape())
            }
            let col = z.to_dtype(DType::F32)?.reshape((1, h, 1, 1))?.broadcast_as((b, h, t, 1))?;
            Tensor::cat(&[&masked, &col], 3)?
        }
    };
    // Row max as a constant; rows with no visible key use 0 so that exp gives exact zeros.
    let m = masked.detach().max_keepdim(D::Minus1)?;
    let finite = m.ge(f32::MIN)?;
    let m = finite.where_cond(&m, &m.zeros_like()?)?;
    let e = masked.broadcast_sub(&m)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let empty = sum.detach().eq(0f32)?.to_dtype(DType::F32)?;
    let p = e.broadcast_div(&(&sum + empty)?)?.narrow(3, 0, s)?; // (the sink column dropped)
    let out = p.matmul(&vf)?.transpose(1, 2)?.contiguous()?.to_dtype(q.dtype())?; // [B, T, H, D]
    let lse = (m + sum.detach().log()?)?.squeeze(D::Minus1)?; // [B, H, T]
    Ok((out, lse))
}
