//! 2-D (Ulysses × ring) attention through [`candle_cp_ops::usp`].

use crate::layout::ParallelCtx;
use candle_core::{Result, Tensor};
use candle_cp_ops::attention::{Scores, Sinks};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::usp::{usp_attention, UspGroups, UspOpts};

/// 2-D attention of the CP shard: Ulysses all-to-all inside `ctx.ulysses`, zigzag ring over
/// `ctx.ring` (rank `cp_i = ring_i · U + uly_i`, as [`UspGroups`] orders them), kept inside
/// the packed `docs` (global length `T`; or `row_docs`, one per batch row) when given, within
/// the causal sliding `window` (global positions) when given, with attention `sinks` (this
/// rank's heads, [`Sinks`]) when given.
/// `q [B, T/(R·U), Hl, D]`, `k, v [B, T/(R·U), Hkvl, D]` → `[B, T/(R·U), Hl, D]`.
#[allow(clippy::too_many_arguments)]
pub fn attend_2d(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ctx: &ParallelCtx,
    scale: Scores,
    docs: Option<Documents>,
    row_docs: Option<Vec<Documents>>,
    window: Option<usize>,
    sinks: Option<&Sinks>,
) -> Result<Tensor> {
    let groups = UspGroups {
        ulysses: ctx.ulysses.clone(),
        ring: ctx.ring.clone(),
    };
    let opts = UspOpts {
        documents: docs,
        row_documents: row_docs,
        window,
        ..UspOpts::new(true, scale.scale).with_softcap(scale.softcap).with_head_layout(ctx.layout.head_layout).with_row_sums(ctx.layout.effective_row_sums())
    }
    .with_sinks(sinks.cloned());
    Ok(usp_attention(q, k, v, &groups, &opts)?.0)
}
