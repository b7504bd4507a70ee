//! Attention of one layer on the layout's CP group.
//!
//! Inputs are this rank's CP shard after RoPE: `q [B, Tc, Hl, D]`, `k, v [B, Tc, Hkvl, D]`
//! (`Tc = T / cp` tokens in the CP layout's order, `Hl`, `Hkvl` heads of the TP shard);
//! output `[B, Tc, Hl, D]` in q's dtype, differentiable w.r.t. q, k, v. Every call is
//! collective over the CP group (and its 2-D sub-groups).
//!
//! With packed documents ([`attend_docs`]) a query sees only the keys of its own document
//! (causal inside it); the documents cover the GLOBAL sequence of `T = Tc · cp` tokens and cut
//! the CP shards anywhere (no padding).
//!
//! With a sliding window ([`attend_window`], Mistral `sliding_window`) a query at global
//! position `p` sees only the keys at `p - w < kp <= p` (inside its document when packed), on
//! every layout: the window is passed to the single-device op ([`Mask::sliding_window`]),
//! the ring / all-gather ([`CpOpts::with_window`]), Ulysses ([`UlyssesOpts::with_window`]) and
//! the 2-D op ([`candle_cp_ops::usp::UspOpts::with_window`]), all on global positions.

use crate::layout::{CpKind, ParallelCtx};
use candle_core::{bail, Result, Tensor};
use candle_cp_ops::attention::{attention_band_sinks, attention_band_with, attention_docs_mask_with, attention_sinks, attention_with, Band, Mask, Scores, Sinks};
use candle_cp_ops::cp::{allgather_attention, ring_attention, CpOpts};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::ulysses::{ulysses_attention, UlyssesOpts};

/// Causal attention of the CP shard `q, k, v` with softmax `scale` (and the soft cap a
/// [`Scores`] may carry; see the module doc).
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, ctx: &ParallelCtx, scale: impl Into<Scores>) -> Result<Tensor> {
    let scale: Scores = scale.into();
    attend_one(q, k, v, ctx, scale, None, None, None)
}

/// [`attend`] inside packed documents: `docs` `None` (each row one sequence, as [`attend`]),
/// one [`Documents`] shared by every row, or one per row (`B` entries: one band per row in
/// the same call / ring pass, every layout). Each covers the global length `T = Tc · cp`;
/// errors name the shapes otherwise.
pub fn attend_docs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ctx: &ParallelCtx,
    scale: impl Into<Scores>,
    docs: Option<&[Documents]>,
) -> Result<Tensor> {
    let scale: Scores = scale.into();
    attend_window(q, k, v, ctx, scale, docs, None)
}

/// [`attend_docs`] with an optional causal sliding window of `window` keys (global
/// positions, inside each document when `docs` is given; `None`: exactly [`attend_docs`]).
/// `Some(0)` is an error naming the shapes.
pub fn attend_window(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ctx: &ParallelCtx,
    scale: impl Into<Scores>,
    docs: Option<&[Documents]>,
    window: Option<usize>,
) -> Result<Tensor> {
    attend_sinks(q, k, v, ctx, scale, docs, window, None)
}

/// [`attend_window`] with attention sinks (gpt-oss: one logit per query head of this TP rank,
/// `[Hl]`, [`Sinks`]) when given: every layout applies them once to each finished row and
/// returns their gradient ([`candle_cp_ops::attention::sinks`]).
#[allow(clippy::too_many_arguments)]
pub fn attend_sinks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ctx: &ParallelCtx,
    scale: impl Into<Scores>,
    docs: Option<&[Documents]>,
    window: Option<usize>,
    sinks: Option<&Sinks>,
) -> Result<Tensor> {
    let scale: Scores = scale.into();
    if window == Some(0) {
        bail!("attend: a sliding window must hold at least 1 key (q {:?})", q.dims())
    }
    let Some(docs) = docs else {
        return attend_one(q, k, v, ctx, scale, None, window, sinks);
    };
    let b = q.dim(0)?;
    match docs {
        [_] => attend_one(q, k, v, ctx, scale, Some(docs), window, sinks),
        rows if rows.len() == b && b > 1 => attend_one(q, k, v, ctx, scale, Some(rows), window, sinks),
        _ => bail!(
            "attend: {} Documents for q {:?}: pass one shared by every row or one per row ({b})",
            docs.len(),
            q.dims()
        ),
    }
}

/// One attention call for the whole batch: `docs` none, one [`Documents`] shared by every
/// row, or one per row (`B` entries: one band per row inside the same call / ring pass),
/// within the sliding `window` when given, with `sinks` when given.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ctx: &ParallelCtx,
    scale: Scores,
    docs: Option<&[Documents]>,
    window: Option<usize>,
    sinks: Option<&Sinks>,
) -> Result<Tensor> {
    let l = &ctx.layout;
    for d in docs.unwrap_or_default() {
        d.check_len(&format!("attend: q {:?} on {l} (T = Tc · cp)", q.dims()), q.dim(1)? * l.cp)?;
    }
    // (shared documents, documents per row)
    let (shared, rows) = match docs {
        Some([d]) => (Some(d.clone()), None),
        Some(r) if !r.is_empty() => (None, Some(r.to_vec())),
        _ => (None, None),
    };
    if l.cp == 1 {
        let mask = window.map_or(Mask::causal(), Mask::sliding_window);
        let rs = l.effective_row_sums();
        if let Some(z) = sinks {
            // one band for documents (shared or per row) and the window
            let t = q.dim(1)?;
            return Ok(match (shared, rows) {
                (Some(d), _) => attention_band_sinks(q, k, v, z, &Band::documents(t, &[d], true, window)?, scale, rs)?.0,
                (None, Some(rows)) => attention_band_sinks(q, k, v, z, &Band::documents(t, &rows, true, window)?, scale, rs)?.0,
                (None, None) => attention_sinks(q, k, v, z, &mask, scale, rs)?.0,
            });
        }
        return Ok(match (&shared, &rows) {
            (Some(d), _) => attention_docs_mask_with(q, k, v, d, &mask, scale, rs)?.0,
            (None, Some(rows)) => attention_band_with(q, k, v, &Band::documents(q.dim(1)?, rows, true, window)?, scale, rs)?.0,
            (None, None) => attention_with(q, k, v, &mask, scale, rs)?.0,
        });
    }
    let opts = CpOpts {
        documents: shared.clone(),
        row_documents: rows.clone(),
        window,
        ..CpOpts::new(l.cp_kind.seq_layout(), true).with_scale(scale.scale).with_softcap(scale.softcap).with_row_sums(l.effective_row_sums())
    }
    .with_sinks(sinks.cloned());
    let (out, _lse) = match l.cp_kind {
        CpKind::Ring | CpKind::Zigzag | CpKind::Striped => ring_attention(q, k, v, &ctx.cp, &opts)?,
        CpKind::AllGather => allgather_attention(q, k, v, &ctx.cp, &opts)?,
        CpKind::Ulysses => {
            let uo = UlyssesOpts {
                documents: shared,
                row_documents: rows,
                window,
                ..UlyssesOpts::new(true, scale.scale).with_softcap(scale.softcap).with_head_layout(l.head_layout).with_row_sums(l.effective_row_sums())
            }
            .with_sinks(sinks.cloned());
            ulysses_attention(q, k, v, &ctx.cp, &uo)?
        }
        CpKind::TwoD => return crate::attn2d::attend_2d(q, k, v, ctx, scale, shared, rows, window, sinks),
    };
    Ok(out)
}
