//! What the Ulysses-style backward keeps of the head layout ([`super::HeadLayout`]): the
//! forward's head-layout q, k, v and output, or only the sequence-layout tensors the graph
//! keeps anyway, all-to-alled to heads again when the backward runs.

use super::{kv_seq_to_head_raw, seq_to_head_raw, HeadLayout, KvSpread};
use candle_core::{Result, Tensor};
use candle_cp_comm::Group;

/// q, k, v in the head layout (`[B, T, H/P, D]`, KV heads as [`KvSpread`] spreads them),
/// rows in the order the attention sees them.
#[derive(Clone)]
pub(crate) struct HeadQkv {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
}

impl HeadQkv {
    /// All-to-all the sequence-layout `q`, `k`, `v` to heads and apply `nat` (row order).
    pub(crate) fn gather(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        spread: KvSpread,
        group: &Group,
        nat: &dyn Fn(Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            q: nat(seq_to_head_raw(&q.detach(), group)?)?,
            k: nat(kv_seq_to_head_raw(k, spread, group)?)?,
            v: nat(kv_seq_to_head_raw(v, spread, group)?)?,
        })
    }
}

/// What a Ulysses-style backward keeps for its head-layout inputs ([`HeadLayout`]).
pub(crate) enum Kept {
    /// The forward's head-layout q, k, v and output (in the layout the attention saw).
    Heads(HeadQkv, Tensor),
    /// The sequence-layout q, k, v (the graph's own inputs) and the op's returned output.
    Seq { q: Tensor, k: Tensor, v: Tensor, out: crate::autograd::OutputSlot },
}

impl Kept {
    /// Keep `heads` and `out_h` ([`HeadLayout::Kept`]) or only references to `q`, `k`, `v`
    /// ([`HeadLayout::Regathered`]; record the returned output in [`Kept::slot`]).
    pub(crate) fn new(mode: HeadLayout, heads: HeadQkv, out_h: Tensor, q: &Tensor, k: &Tensor, v: &Tensor) -> Self {
        match mode {
            HeadLayout::Kept => Kept::Heads(heads, out_h),
            HeadLayout::Regathered => {
                Kept::Seq { q: q.detach(), k: k.detach(), v: v.detach(), out: Default::default() }
            }
        }
    }

    /// Where the returned sequence-layout output goes ([`HeadLayout::Regathered`] only).
    pub(crate) fn slot(&self) -> Option<crate::autograd::OutputSlot> {
        match self {
            Kept::Heads(..) => None,
            Kept::Seq { out, .. } => Some(out.clone()),
        }
    }

    /// The head-layout q, k, v and output for the backward: the kept ones, or all-to-alled
    /// again from the sequence layout (the same values: the all-to-alls only move rows).
    pub(crate) fn heads(
        &self,
        spread: KvSpread,
        group: &Group,
        nat: &dyn Fn(Tensor) -> Result<Tensor>,
    ) -> Result<(HeadQkv, Tensor)> {
        match self {
            Kept::Heads(h, o) => Ok((h.clone(), o.clone())),
            Kept::Seq { q, k, v, out } => {
                let h = HeadQkv::gather(q, k, v, spread, group, nat)?;
                Ok((h, nat(seq_to_head_raw(out.get()?, group)?)?))
            }
        }
    }
}
