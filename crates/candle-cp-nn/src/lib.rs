//! candle-cp-nn: tensor-parallel (TP) and sequence-parallel (SP) layers after Megatron-LM.
//!
//! - [`ColumnParallelLinear`] / [`RowParallelLinear`]: the weight is sharded over the TP group
//!   on load (from a `candle_nn::VarBuilder` holding the *full* weight), so a model built
//!   from them can be compared with the single-device model parameter by parameter.
//! - [`RmsNorm`] / [`LayerNorm`]: on sequence shards `[B, T/P, C]` when SP is on; their
//!   (replicated) weights get the gradient summed over the TP group.
//! - [`Dropout`] with named, seeded, counter-based random streams ([`RngStreams`]): the mask
//!   of an element depends only on the seed, the stream name, the step and the element's
//!   *global* index, so it differs across sequence shards, is identical on TP ranks that hold
//!   the same activation, and equals the single-device mask.
//!
//! ## Where activations live (Megatron SP, TP group of size `P`)
//!
//! ```text
//!  SP region  [B, T/P, C]   norm, dropout, residual add           (sequence sharded)
//!     │ ColumnParallelLinear: all-gather seq (bwd reduce-scatter)
//!  TP region  [B, T, C/P]   attention heads / MLP hidden units     (feature sharded)
//!     │ RowParallelLinear: reduce-scatter seq (bwd all-gather)
//!  SP region  [B, T/P, C]
//! ```
//!
//! Without SP the two boundaries are `copy_to_tp_region` (identity, bwd all-reduce) and
//! `reduce_from_tp_region` (all-reduce, bwd identity) and the activations outside the TP
//! region are replicated `[B, T, C]`.

mod dropout;
mod linear;
mod norm;

pub use dropout::{Dropout, Region, RngStreams};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use norm::{LayerNorm, RmsNorm};

use candle_cp_comm::Group;

/// A tensor-parallel group and whether sequence parallelism is on.
///
/// With `sequence_parallel`, activations outside TP regions are sequence shards
/// `[B, T/P, C]` (rank `r` holds rows `[r·T/P, (r+1)·T/P)`); without, they are replicated
/// `[B, T, C]` on every rank of the group.
#[derive(Clone)]
pub struct Tp {
    /// The tensor-parallel group (size `P`).
    pub group: Group,
    /// Sequence parallelism on or off.
    pub sequence_parallel: bool,
}

impl Tp {
    /// TP over `group`, with or without sequence parallelism.
    pub fn new(group: Group, sequence_parallel: bool) -> Self {
        Self { group, sequence_parallel }
    }
    /// Size `P` of the TP group.
    pub fn size(&self) -> usize {
        self.group.size()
    }
    /// This rank's index in the TP group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }
    /// The dropout [`Region`] of activations outside TP regions: sequence shards along dim 1
    /// with SP, replicated without.
    pub fn activation_region(&self) -> Region {
        if self.sequence_parallel {
            Region::Sharded { dim: candle_cp_ops::mappings::SEQ_DIM, rank: self.rank(), world: self.size() }
        } else {
            Region::Replicated
        }
    }
}
