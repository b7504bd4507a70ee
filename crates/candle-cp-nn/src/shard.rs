//! How a parameter is split over the TP group, and slicing a full (checkpoint) tensor into
//! this rank's shard.
//!
//! The layers of this crate take their *local shard* from a `VarBuilder` (so that with
//! `VarBuilder::from_varmap` the shard is a `Var` of the caller's `VarMap`). To fill such a
//! `VarMap` from a full checkpoint, slice each tensor with [`Shard::slice`] (or
//! [`shard_for_tp`]) using the layer's split: [`crate::ColumnParallelLinear::WEIGHT_SHARD`]
//! (rows), [`crate::RowParallelLinear::WEIGHT_SHARD`] (columns), norms replicated.

use crate::Tp;
use candle_core::{bail, Result, Shape, Tensor};

/// How a parameter is split over a TP group of size `P`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shard {
    /// Every TP rank holds the whole tensor (norm weights, row-parallel bias, embeddings).
    Replicated,
    /// Split along dim 0: rank `r` holds rows `[r·n/P, (r+1)·n/P)` (column-parallel weight
    /// `[out/P, in]` and bias `[out/P]`).
    Rows,
    /// Split along dim 1: rank `r` holds columns `[r·n/P, (r+1)·n/P)` (row-parallel weight
    /// `[out, in/P]`).
    Cols,
}

impl Shard {
    /// The split dimension, if any.
    pub fn dim(&self) -> Option<usize> {
        match self {
            Shard::Replicated => None,
            Shard::Rows => Some(0),
            Shard::Cols => Some(1),
        }
    }

    /// The shape one of `size` ranks holds for a full tensor of shape `full`. Errors (naming
    /// the shape) if `size` does not divide the split dim or the tensor has no such dim.
    pub fn local_shape(&self, full: &[usize], size: usize) -> Result<Shape> {
        let mut s = full.to_vec();
        if let Some(d) = self.dim() {
            if d >= s.len() || size == 0 || !s[d].is_multiple_of(size) {
                bail!("{self:?} shard of a tensor {full:?}: dim {d} is not divisible by the TP size {size}")
            }
            s[d] /= size;
        }
        Ok(Shape::from(s))
    }

    /// Rank `rank`'s slice (contiguous, detached from any graph) of the full tensor `full`
    /// over a TP group of `size` ranks. Replicated tensors are returned as they are.
    pub fn slice(&self, full: &Tensor, size: usize, rank: usize) -> Result<Tensor> {
        let local = self.local_shape(full.dims(), size)?;
        if rank >= size {
            bail!("{self:?} shard of a tensor {:?}: rank {rank} out of range for TP size {size}", full.dims())
        }
        match self.dim() {
            None => Ok(full.clone()),
            Some(d) => {
                let n = local.dims()[d];
                full.detach().narrow(d, rank * n, n)?.contiguous()
            }
        }
    }
}

/// This rank's slice of the full tensor `full` split as `shard` over `tp`'s group
/// ([`Shard::slice`] with `tp.size()`, `tp.rank()`).
pub fn shard_for_tp(full: &Tensor, shard: Shard, tp: &Tp) -> Result<Tensor> {
    shard.slice(full, tp.size(), tp.rank())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn slices_and_errors() -> Result<()> {
        let full = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((4, 6))?;
        let r = Shard::Rows.slice(&full, 2, 1)?;
        assert_eq!(r.to_vec2::<f32>()?, full.narrow(0, 2, 2)?.to_vec2::<f32>()?);
        let c = Shard::Cols.slice(&full, 3, 2)?;
        assert_eq!(c.to_vec2::<f32>()?, full.narrow(1, 4, 2)?.to_vec2::<f32>()?);
        assert_eq!(Shard::Replicated.slice(&full, 4, 3)?.dims(), [4, 6]);
        let e = Shard::Rows.slice(&full, 3, 0).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[4, 6]") && e.contains("TP size 3"), "{e}");
        assert!(Shard::Cols.slice(&Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu)?, 2, 0).is_err());
        assert!(Shard::Rows.slice(&full, 2, 2).is_err());
        Ok(())
    }
}
