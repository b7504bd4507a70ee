//! Attention of one layer on the layout's CP group.
//!
//! Inputs are this rank's CP shard after RoPE: `q [B, Tc, Hl, D]`, `k, v [B, Tc, Hkvl, D]`
//! (`Tc = T / cp` tokens in the CP layout's order, `Hl`, `Hkvl` heads of the TP shard);
//! output `[B, Tc, Hl, D]` in q's dtype, differentiable w.r.t. q, k, v. Every call is
//! collective over the CP group (and its 2-D sub-groups).

use crate::layout::{CpKind, ParallelCtx};
use candle_core::{Result, Tensor};
use candle_cp_ops::attention::{attention, Mask};
use candle_cp_ops::cp::{allgather_attention, ring_attention, CpOpts};
use candle_cp_ops::ulysses::{ulysses_attention, UlyssesOpts};

/// Causal attention of the CP shard `q, k, v` with softmax `scale` (see the module doc).
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, ctx: &ParallelCtx, scale: f64) -> Result<Tensor> {
    let l = &ctx.layout;
    if l.cp == 1 {
        return Ok(attention(q, k, v, &Mask::causal(), scale)?.0);
    }
    let opts = CpOpts::new(l.cp_kind.seq_layout(), true).with_scale(scale);
    let (out, _lse) = match l.cp_kind {
        CpKind::Ring | CpKind::Zigzag | CpKind::Striped => ring_attention(q, k, v, &ctx.cp, &opts)?,
        CpKind::AllGather => allgather_attention(q, k, v, &ctx.cp, &opts)?,
        CpKind::Ulysses => ulysses_attention(q, k, v, &ctx.cp, &UlyssesOpts::new(true, scale))?,
        CpKind::TwoD => return crate::attn2d::attend_2d(q, k, v, ctx, scale),
    };
    Ok(out)
}
