//! CUDA path of [`shard`](super::shard), [`unshard`](super::unshard) and
//! [`gather`](super::gather) for the zigzag and striped layouts: one
//! `candle_cp_kernels::layout` launch (`kernels/layout.cu`, `seq_permute_*`) instead of the
//! 2P narrow/cat copies of the candle formulation.
//!
//! Taken only for tensors on a CUDA device that carry no autograd graph (`track_op()` false):
//! inputs being sharded, and the raw tensors inside the CP ops. A graph-carrying tensor takes
//! the candle formulation, whose backward candle derives. Same results bit for bit (a pure
//! permutation); `examples/gpu_check.rs` compares both paths on a GPU.

use super::Layout;
use candle_core::{DType, Result, Tensor};
use candle_cp_kernels::layout::{self, SeqLayout};

/// The kernel layout for `t`, or `None` when `t` must take the candle formulation.
fn eligible(t: &Tensor, layout: Layout) -> Option<SeqLayout> {
    if !t.device().is_cuda() || t.track_op() {
        return None;
    }
    if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16 | DType::U32 | DType::U8) {
        return None;
    }
    match layout {
        Layout::Zigzag => Some(SeqLayout::Zigzag),
        Layout::Striped => Some(SeqLayout::Striped),
        Layout::Contiguous => None,
    }
}

/// Rank `rank`'s shard of `global` `[.., T, ..]` along `dim` (shapes already checked).
pub(super) fn shard(global: &Tensor, layout: Layout, rank: usize, p: usize, dim: usize) -> Result<Option<Tensor>> {
    match eligible(global, layout) {
        Some(kl) => layout::shard(global, dim, kl, p, rank).map(Some),
        None => Ok(None),
    }
}

/// Global order from the `P` shards concatenated along `dim` in rank order (shapes checked).
pub(super) fn unshard_cat(cat: &Tensor, layout: Layout, p: usize, dim: usize) -> Result<Option<Tensor>> {
    match eligible(cat, layout) {
        Some(kl) => layout::unshard(cat, dim, kl, p).map(Some),
        None => Ok(None),
    }
}

/// [`unshard_cat`] for separate shards: one `cat`, one permutation launch.
pub(super) fn unshard(shards: &[Tensor], layout: Layout, dim: usize) -> Result<Option<Tensor>> {
    if shards.iter().any(|s| eligible(s, layout).is_none()) {
        return Ok(None);
    }
    unshard_cat(&Tensor::cat(shards, dim)?, layout, shards.len(), dim)
}
