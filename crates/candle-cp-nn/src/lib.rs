//! candle-cp-nn: tensor-parallel (TP) and sequence-parallel (SP) layers after Megatron-LM.
//!
//! - [`ColumnParallelLinear`] / [`RowParallelLinear`]: each rank holds only its shard of the
//!   weight, taken from a `candle_nn::VarBuilder` with the *local* shape (`[out/P, in]`,
//!   `[out, in/P]`) under the usual names (`weight`, `bias`). With
//!   `VarBuilder::from_varmap` the shards are `Var`s of the caller's `VarMap`: trainable,
//!   saveable, seen by any optimizer built on the `VarMap`. Fill that `VarMap` from a full
//!   checkpoint with [`shard_for_tp`] and the layers' `WEIGHT_SHARD` ([`Shard`]).
//! - [`RmsNorm`] / [`LayerNorm`]: on sequence shards `[B, T/P, C]` when SP is on; their
//!   (replicated) weights get the gradient summed over the TP group, in backward or by the
//!   caller ([`GradSync`]). [`rms_norm`] is the fused RMSNorm (hand-written backward).
//! - [`Dropout`] with named, seeded, counter-based random streams ([`RngStreams`]): the mask
//!   of an element depends only on the seed, the stream name, the step and the element's
//!   *global* index, so it differs across sequence shards, is identical on TP ranks that hold
//!   the same activation, and equals the single-device mask.
//!
//! ```no_run
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_cp_comm::run_ranks;
//! use candle_cp_nn::{shard_for_tp, ColumnParallelLinear, LinearConfig, RowParallelLinear, Tp};
//! use candle_nn::{VarBuilder, VarMap};
//!
//! let (w1, w2) = (Tensor::zeros((64, 32), DType::F32, &Device::Cpu)?, Tensor::zeros((32, 64), DType::F32, &Device::Cpu)?);
//! run_ranks(2, |g| {
//!     let tp = Tp::new(g, true);
//!     let mut vm = VarMap::new(); // will hold this rank's shards (trainable)
//!     let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
//!     let up = ColumnParallelLinear::new(vb.pp("up"), 32, 64, LinearConfig::new(false), &tp)?;
//!     let down = RowParallelLinear::new(vb.pp("down"), 64, 32, LinearConfig::new(false), &tp)?;
//!     // from a full checkpoint: slice each tensor as the layer shards it
//!     vm.set_one("up.weight", shard_for_tp(&w1, ColumnParallelLinear::WEIGHT_SHARD, &tp)?)?;
//!     vm.set_one("down.weight", shard_for_tp(&w2, RowParallelLinear::WEIGHT_SHARD, &tp)?)?;
//!     let x = Tensor::zeros((1, 8, 32), DType::F32, &Device::Cpu)?; // [B, T/P, C]
//!     down.forward(&up.forward(&x)?.gelu()?) // [B, T/P, C]
//! });
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! ## Gradients: who sums what (TP group of size `P`)
//!
//! | parameter                                   | after `backward()` on a TP rank          |
//! |---------------------------------------------|------------------------------------------|
//! | column-parallel weight / bias, row-parallel weight (sharded) | full gradient of its slice: no TP sum |
//! | norm weights, row-parallel bias, no SP      | full gradient, identical on TP ranks     |
//! | same, SP, [`GradSync::InBackward`] (default)| full gradient (all-reduced over TP in backward) |
//! | same, SP, [`GradSync::Deferred`]            | its rows' share: the caller sums over TP |
//!
//! Data- and context-parallel sums (ranks holding other tokens) are always the caller's.
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

#![warn(missing_docs)]

pub mod dora;
mod dropout;
mod embedding;
mod linear;
pub mod lora;
pub mod lora_dropout;
mod norm;
pub mod quant;
mod regather;
mod shard;
#[cfg(test)]
mod tests;

pub use dora::{dora_magnitude, dora_merge, dora_update, dora_weight, WeightSplit};
pub use dropout::{Dropout, Region, RngStreams};
pub use embedding::{vocab_parallel_embedding, vocab_parallel_embedding_slow};
pub use linear::{ColumnParallelLinear, LinearConfig, RowParallelLinear};
pub use lora::{replicated_forward, Lora, LoraConfig};
pub use lora_dropout::{masked_matmul, DropoutKey, DropoutRows};
pub use quant::{QuantConfig, QuantKind, QuantWeight};
pub use norm::{
    rms_norm, rms_norm_add, rms_norm_bwd, rms_norm_bwd_with, rms_norm_fwd, rms_norm_fwd_with, rms_norm_slow, rms_norm_slow_with, rms_norm_with, LayerNorm, NormWeight, RmsNorm,
};
pub use regather::{PartMap, PartPost};
pub use shard::{blocks_per_rank, padded_rows, shard_for_tp, Shard};

/// Who sums, over the TP group, the gradient of a replicated parameter that each rank
/// applies to its own sequence shard (norm weights, row-parallel bias; SP on only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GradSync {
    /// The layer: it uses the parameter through `copy_to_tp_region` (identity forward,
    /// all-reduce backward), so after `backward()` every TP rank holds the full gradient.
    #[default]
    InBackward,
    /// The caller: no collective in backward; each rank holds the gradient of its own rows
    /// and the caller sums it over the TP group (e.g. in one bucketed all-reduce together
    /// with the data/context-parallel sums, as `candle_cp_llama::reduce_gradients` does).
    Deferred,
}

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
