//! Attention over a packed sequence of documents on one device: one band call where the
//! kernels take bands, else one [`super::attention_with`] call per document.

use super::{attention_band_with, attention_with, band_kernels, check_qkv, Band, Mask, RowSums, Scores};
use crate::packing::Documents;
use candle_core::{Result, Tensor};

/// Check that q `[B, T, H, D]` and k/v `[B, T, Hkv, D]` have the same length `T` and that
/// `docs` covers it; errors name the shapes.
pub(crate) fn check_docs(op: &str, q: &Tensor, k: &Tensor, v: &Tensor, docs: &Documents) -> Result<usize> {
    check_qkv(op, q, k, v, &Mask::Full)?;
    let (t, s) = (q.dim(1)?, k.dim(1)?);
    if t != s {
        candle_core::bail!(
            "{op}: a packed sequence attends to itself: q {:?} and k {:?} must have the same length T",
            q.shape(),
            k.shape()
        )
    }
    docs.check_len(&format!("{op} (q {:?})", q.shape()), t)?;
    Ok(t)
}

/// Autograd attention over a packed sequence of documents (single device): q `[B, T, H, D]`,
/// k/v `[B, T, Hkv, D]`, `docs` covering `T` (the same for every batch row). A query sees
/// only the keys of its own document (causal within it when `causal`). Returns out
/// `[B, T, H, D]` in q's dtype (differentiable w.r.t. q, k, v) and lse f32 `[B, H, T]`.
/// One [`super::attention`] call per document: no pair across documents is ever computed.
pub fn attention_docs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    docs: &Documents,
    causal: bool,
    scale: impl Into<Scores>,
) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_docs")?;
    let mask = if causal { Mask::causal() } else { Mask::Full };
    attention_docs_mask(q, k, v, docs, &mask, scale)
}

/// [`attention_docs`] with any mask applied inside each document, in positions relative to
/// the document's start: `Mask::Full`, `Mask::causal()` or `Mask::sliding_window(w)` (a
/// sliding window within each document).
pub fn attention_docs_mask(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    docs: &Documents,
    mask: &Mask,
    scale: impl Into<Scores>,
) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_docs_mask")?;
    attention_docs_mask_with(q, k, v, docs, mask, scale, RowSums::Output)
}

/// [`attention_docs_mask`] with the backward's row sums taken as `row_sums` says
/// ([`super::attention_with`]).
pub fn attention_docs_mask_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    docs: &Documents,
    mask: &Mask,
    scale: impl Into<Scores>,
    row_sums: RowSums,
) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_docs_mask_with")?;
    let t = check_docs("attention_docs", q, k, v, docs)?;
    if docs.count() == 1 {
        return attention_with(q, k, v, mask, scale, row_sums);
    }
    if band_kernels(q) {
        let (causal, window) = match *mask {
            Mask::Full => (false, None),
            Mask::Causal { .. } if *mask == Mask::causal() => (true, None),
            Mask::Window { window, .. } if *mask == Mask::sliding_window(window) => (true, Some(window)),
            _ => candle_core::bail!("attention_docs: the mask inside documents must be Full, Mask::causal() or Mask::sliding_window(w), got {mask:?} (q {:?})", q.shape()),
        };
        let band = Band::documents(t, std::slice::from_ref(docs), causal, window)?;
        return attention_band_with(q, k, v, &band, scale, row_sums);
    }
    let mut outs = Vec::with_capacity(docs.count());
    let mut lses = Vec::with_capacity(docs.count());
    for d in 0..docs.count() {
        let (a, b) = docs.range(d);
        let r = |x: &Tensor| x.narrow(1, a, b - a);
        let (o, l) = attention_with(&r(q)?, &r(k)?, &r(v)?, mask, scale, row_sums)?;
        outs.push(o);
        lses.push(l);
    }
    Ok((Tensor::cat(&outs, 1)?, Tensor::cat(&lses, 2)?))
}
