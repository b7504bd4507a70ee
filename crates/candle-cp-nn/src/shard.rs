//! How a parameter is split over the TP group, and slicing a full (checkpoint) tensor into
//! this rank's shard.
//!
//! The layers of this crate take their *local shard* from a `VarBuilder` (so that with
//! `VarBuilder::from_varmap` the shard is a `Var` of the caller's `VarMap`). To fill such a
//! `VarMap` from a full checkpoint, slice each tensor with [`Shard::slice`] (or
//! [`shard_for_tp`]) using the layer's split: [`crate::ColumnParallelLinear::WEIGHT_SHARD`]
//! (rows), [`crate::RowParallelLinear::WEIGHT_SHARD`] (columns), norms replicated.
//!
//! [`Shard::RowBlocks`] splits rows by blocks (attention heads) and, when there are fewer
//! blocks than ranks, replicates each block over several ranks: the K/V projections of a
//! GQA model with fewer KV heads than the TP size. For 2 KV heads over `P = 4`:
//!
//! ```text
//! full k_proj [2·D, in]      TP rank:   0      1      2      3
//!   block 0 (KV head 0)  ──────────▶  [D,in] [D,in]
//!   block 1 (KV head 1)  ──────────▶                [D,in] [D,in]
//! copies = P / blocks = 2 (a block's gradient shares are summed over its copies)
//! ```
//!
//! [`Shard::RowsPadded`] splits a vocabulary that `P` does not divide, as Megatron does, by
//! padding it: every rank holds `⌈V/P⌉` rows, the rows past `V` are zeros that no token id
//! reaches and that the loss masks out. For `V = 5` over `P = 4` (2 rows each):
//!
//! ```text
//! full [5, h]     TP rank:  0          1          2           3
//!                         rows 0,1   rows 2,3   row 4, pad   pad, pad
//! ```

use crate::Tp;
use candle_core::{bail, Result, Shape, Tensor};
use candle_cp_comm::Group;

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
    /// Dim 0 is `n` equal blocks (e.g. `n` attention heads of `D` rows each). When `P`
    /// divides `n` this is [`Shard::Rows`] (rank `r` holds blocks `[r·n/P, (r+1)·n/P)`).
    /// When `n` divides `P` (fewer blocks than ranks) rank `r` holds the single block
    /// `⌊r·n/P⌋`, so each block is held by `P/n` adjacent ranks ([`Shard::copies`]): the
    /// K/V projection of a GQA model with fewer KV heads than the TP size.
    RowBlocks(usize),
    /// Dim 0 of length `n` split into `P` slices of `⌈n/P⌉` rows: rank `r` holds rows
    /// `[r·⌈n/P⌉, (r+1)·⌈n/P⌉)`, zero rows where that passes `n` (the vocabulary-parallel
    /// embedding and LM head; Megatron pads the vocabulary likewise). [`Shard::Rows`] when `P`
    /// divides `n`; [`Shard::Replicated`] when `n < P`.
    RowsPadded(usize),
    /// Split along dim `d`: rank `r` holds `[r·n/P, (r+1)·n/P)` of it (the stacked expert
    /// weights of a mixture of experts, `[E, I/P, h]` and `[E, h, I/P]`).
    /// [`Shard::Rows`] for `d = 0`, [`Shard::Cols`] for `d = 1`.
    Dim(usize),
}

/// `⌈n/p⌉`: the rows each of `p` ranks holds of a [`Shard::RowsPadded`]`(n)` tensor.
pub fn padded_rows(n: usize, p: usize) -> usize {
    n.div_ceil(p.max(1))
}

impl Shard {
    /// The split dimension, if any (for [`Shard::RowsPadded`]: when it splits).
    pub fn dim(&self) -> Option<usize> {
        match self {
            Shard::Replicated => None,
            Shard::Rows | Shard::RowBlocks(_) | Shard::RowsPadded(_) => Some(0),
            Shard::Cols => Some(1),
            Shard::Dim(d) => Some(*d),
        }
    }

    /// The plainest split this is over `size` ranks: [`Shard::RowsPadded`]`(n)` becomes
    /// [`Shard::Rows`] when `size | n` and [`Shard::Replicated`] when `n < size`,
    /// [`Shard::RowBlocks`]`(n)` with `size | n` becomes [`Shard::Rows`]; the others stay as
    /// they are.
    pub fn resolve(&self, size: usize) -> Shard {
        match *self {
            Shard::RowsPadded(n) if size > 0 && n.is_multiple_of(size) => Shard::Rows,
            Shard::RowsPadded(n) if n < size => Shard::Replicated,
            Shard::RowBlocks(n) if size > 0 && n.is_multiple_of(size) => Shard::Rows,
            Shard::Dim(0) => Shard::Rows,
            Shard::Dim(1) => Shard::Cols,
            s => s,
        }
    }

    /// How many of `size` ranks hold each slice: `size` for [`Shard::Replicated`], `size/n`
    /// for [`Shard::RowBlocks`]`(n)` with `n < size`, else 1. A gradient computed on one copy
    /// is that copy's share: the true gradient is the sum over the copies.
    pub fn copies(&self, size: usize) -> usize {
        match self.resolve(size) {
            Shard::Replicated => size,
            Shard::RowBlocks(n) if n > 0 && n < size && size.is_multiple_of(n) => size / n,
            _ => 1,
        }
    }

    /// Which copy group rank `rank` of `size` belongs to: ranks holding the same slice get the
    /// same index (`0..size/copies`). Rank `r` of a [`Shard::RowBlocks`]`(n)` with `n < size`
    /// holds block `r·n/size`.
    pub fn slice_index(&self, size: usize, rank: usize) -> usize {
        rank / self.copies(size).max(1)
    }

    /// The shape one of `size` ranks holds for a full tensor of shape `full`. Errors (naming
    /// the shape) if `size` does not divide the split dim or the tensor has no such dim.
    pub fn local_shape(&self, full: &[usize], size: usize) -> Result<Shape> {
        let mut s = full.to_vec();
        if let Shard::RowsPadded(n) = *self {
            if full.first() != Some(&n) {
                bail!("{self:?} shard of a tensor {full:?}: dim 0 is not {n}")
            }
            if self.resolve(size) != *self {
                return self.resolve(size).local_shape(full, size);
            }
            s[0] = padded_rows(n, size);
            return Ok(Shape::from(s));
        }
        if let Shard::RowBlocks(n) = *self {
            if s.is_empty() || n == 0 || size == 0 || !s[0].is_multiple_of(n) {
                bail!("{self:?} shard of a tensor {full:?}: dim 0 is not {n} equal blocks")
            }
            if n.is_multiple_of(size) {
                s[0] /= size;
            } else if size.is_multiple_of(n) {
                s[0] /= n;
            } else {
                bail!("{self:?} shard of a tensor {full:?}: {n} blocks neither divisible by nor dividing the TP size {size}")
            }
            return Ok(Shape::from(s));
        }
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
        match self.resolve(size).dim() {
            None => Ok(full.clone()),
            Some(_) if matches!(self.resolve(size), Shard::RowsPadded(_)) => {
                // rows [r·k, (r+1)·k) of the n, then zero rows up to k
                let (n, k) = (full.dim(0)?, local.dims()[0]);
                let start = (rank * k).min(n);
                let take = k.min(n - start);
                let mut pad_shape = local.dims().to_vec();
                pad_shape[0] = k - take;
                let pad = Tensor::zeros(pad_shape, full.dtype(), full.device())?;
                match (take, k - take) {
                    (0, _) => Ok(pad),
                    (_, 0) => full.detach().narrow(0, start, take)?.contiguous(),
                    _ => Tensor::cat(&[full.detach().narrow(0, start, take)?, pad], 0)?.contiguous(),
                }
            }
            Some(d) => {
                let n = local.dims()[d];
                full.detach().narrow(d, self.slice_index(size, rank) * n, n)?.contiguous()
            }
        }
    }

    /// The full tensor from the slices of all `parts.len()` ranks, in rank order (host-side
    /// counterpart of [`Shard::gather`], e.g. for state saved per rank): concatenated along the
    /// split dim, one copy of each replicated block kept; a replicated tensor is `parts[0]`.
    pub fn assemble(&self, parts: &[Tensor]) -> Result<Tensor> {
        let size = parts.len();
        let Some(first) = parts.first() else { bail!("{self:?}: no parts to assemble") };
        let resolved = self.resolve(size);
        let Some(d) = resolved.dim() else { return Ok(first.clone()) };
        let copies = resolved.copies(size);
        let keep: Vec<Tensor> = parts.iter().step_by(copies.max(1)).cloned().collect();
        if keep.iter().any(|t| t.dims() != first.dims()) {
            bail!("{self:?}: parts of different shapes {:?}", parts.iter().map(|t| t.dims().to_vec()).collect::<Vec<_>>())
        }
        let all = Tensor::cat(&keep, d)?;
        match resolved {
            Shard::RowsPadded(n) if all.dim(0)? >= n => all.narrow(0, 0, n),
            Shard::RowsPadded(n) => bail!("{self:?}: parts {:?} hold fewer than {n} rows", parts.iter().map(|t| t.dims().to_vec()).collect::<Vec<_>>()),
            _ => Ok(all),
        }
    }

    /// The full tensor from each rank's `local` slice: all-gather over `group` (the TP group;
    /// collective, every rank calls it), dropping the extra copies of replicated blocks.
    /// Replicated tensors are returned as they are, without communication.
    pub fn gather(&self, local: &Tensor, group: &Group) -> Result<Tensor> {
        let size = group.size();
        let Some(d) = self.resolve(size).dim() else { return Ok(local.clone()) };
        if size == 1 {
            return Ok(local.clone());
        }
        let all = group.all_gather(&local.contiguous()?, d)?;
        if let Shard::RowsPadded(n) = self.resolve(size) {
            if all.dim(0)? < n {
                bail!("{self:?}: the {size} slices {:?} hold fewer than {n} rows", local.dims())
            }
            return all.narrow(0, 0, n);
        }
        if self.copies(size) == 1 {
            return Ok(all);
        }
        self.assemble(&all.chunk(size, d)?)
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
        // along dim 2 of a stack of matrices (expert weights [E, h, I])
        let e3 = Tensor::arange(0f32, 48., &Device::Cpu)?.reshape((2, 4, 6))?;
        assert_eq!(Shard::Dim(2).local_shape(e3.dims(), 3)?.dims(), [2, 4, 2]);
        let s = Shard::Dim(2).slice(&e3, 3, 1)?;
        assert_eq!(s.to_vec3::<f32>()?, e3.narrow(2, 2, 2)?.to_vec3::<f32>()?);
        let parts: Vec<Tensor> = (0..3).map(|r| Shard::Dim(2).slice(&e3, 3, r)).collect::<Result<_>>()?;
        assert_eq!(Shard::Dim(2).assemble(&parts)?.to_vec3::<f32>()?, e3.to_vec3::<f32>()?);
        assert_eq!((Shard::Dim(0).resolve(2), Shard::Dim(1).resolve(2), Shard::Dim(2).copies(2)), (Shard::Rows, Shard::Cols, 1));
        let e = Shard::Dim(2).local_shape(e3.dims(), 4).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[2, 4, 6]") && e.contains("dim 2"), "{e}");
        assert!(Shard::Dim(3).local_shape(e3.dims(), 2).is_err());
        Ok(())
    }

    #[test]
    fn row_blocks_split_or_replicate() -> Result<()> {
        let full = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((4, 6))?;
        // 2 blocks of 2 rows over 4 ranks: ranks 0, 1 hold block 0, ranks 2, 3 block 1
        let b = Shard::RowBlocks(2);
        assert_eq!(b.local_shape(&[4, 6], 4)?.dims(), [2, 6]);
        assert_eq!((b.copies(4), b.copies(2), b.copies(1)), (2, 1, 1));
        for (r, block) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
            assert_eq!(b.slice_index(4, r), block);
            assert_eq!(b.slice(&full, 4, r)?.to_vec2::<f32>()?, full.narrow(0, 2 * block, 2)?.to_vec2::<f32>()?);
        }
        // P divides the blocks: plain rows
        for r in 0..2 {
            assert_eq!(b.slice(&full, 2, r)?.to_vec2::<f32>()?, Shard::Rows.slice(&full, 2, r)?.to_vec2::<f32>()?);
        }
        // 4 blocks over 8 ranks: each 1-row block twice
        assert_eq!(Shard::RowBlocks(4).slice(&full, 8, 5)?.to_vec2::<f32>()?, full.narrow(0, 2, 1)?.to_vec2::<f32>()?);
        let e = Shard::RowBlocks(2).slice(&full, 3, 0).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[4, 6]") && e.contains("TP size 3"), "{e}");
        assert!(Shard::RowBlocks(3).local_shape(&[4, 6], 3).is_err());
        assert!(Shard::RowBlocks(2).slice(&full, 4, 4).is_err());
        Ok(())
    }

    #[test]
    fn rows_padded_split_pad_or_replicate() -> Result<()> {
        let full = Tensor::arange(0f32, 30., &Device::Cpu)?.reshape((5, 6))?;
        let v = Shard::RowsPadded(5);
        assert_eq!((v.resolve(4), v.resolve(5), v.resolve(6)), (v, Shard::Rows, Shard::Replicated));
        assert_eq!(Shard::RowsPadded(4).resolve(2), Shard::Rows);
        assert_eq!((v.copies(4), v.copies(6)), (1, 6));
        assert_eq!(v.local_shape(&[5, 6], 4)?.dims(), [2, 6]);
        assert_eq!(v.local_shape(&[5, 6], 2)?.dims(), [3, 6]);
        assert_eq!(v.local_shape(&[5, 6], 6)?.dims(), [5, 6]);
        // 5 rows over 4 ranks: [0, 1] [2, 3] [4, pad] [pad, pad]
        let zeros = vec![0f32; 6];
        let row = |i: usize| full.get(i).and_then(|r| r.to_vec1::<f32>());
        assert_eq!(v.slice(&full, 4, 1)?.to_vec2::<f32>()?, vec![row(2)?, row(3)?]);
        assert_eq!(v.slice(&full, 4, 2)?.to_vec2::<f32>()?, vec![row(4)?, zeros.clone()]);
        assert_eq!(v.slice(&full, 4, 3)?.to_vec2::<f32>()?, vec![zeros.clone(), zeros]);
        assert_eq!(v.slice(&full, 6, 5)?.to_vec2::<f32>()?, full.to_vec2::<f32>()?);
        assert!(Shard::RowsPadded(4).local_shape(&[5, 6], 2).is_err());
        for p in [2usize, 3, 4, 6] {
            let parts = (0..p).map(|r| v.slice(&full, p, r)).collect::<Result<Vec<_>>>()?;
            assert_eq!(v.assemble(&parts)?.to_vec2::<f32>()?, full.to_vec2::<f32>()?, "assemble over {p}");
            for r in candle_cp_comm::run_ranks(p, |g| v.gather(&v.slice(&full, p, g.rank())?, &g)?.to_vec2::<f32>()) {
                assert_eq!(r?, full.to_vec2::<f32>()?, "gather over {p} ranks");
            }
        }
        Ok(())
    }

    #[test]
    fn assemble_inverts_slice() -> Result<()> {
        let full = Tensor::arange(0f32, 48., &Device::Cpu)?.reshape((8, 6))?;
        for (s, p) in [
            (Shard::Rows, 4usize),
            (Shard::Cols, 2),
            (Shard::Replicated, 3),
            (Shard::RowBlocks(2), 4),
            (Shard::RowBlocks(4), 2),
            (Shard::RowsPadded(8), 4),
            (Shard::RowsPadded(8), 3),
            (Shard::RowsPadded(8), 16),
        ] {
            let parts = (0..p).map(|r| s.slice(&full, p, r)).collect::<Result<Vec<_>>>()?;
            assert_eq!(s.assemble(&parts)?.to_vec2::<f32>()?, full.to_vec2::<f32>()?, "{s:?} over {p}");
        }
        assert!(Shard::Rows.assemble(&[]).is_err());
        Ok(())
    }

    #[test]
    fn row_blocks_gather_drops_the_copies() -> Result<()> {
        let full = Tensor::arange(0f32, 48., &Device::Cpu)?.reshape((8, 6))?;
        for (blocks, p) in [(2usize, 4usize), (2, 2), (4, 8), (1, 4), (8, 4)] {
            let got = candle_cp_comm::run_ranks(p, |g| {
                let s = Shard::RowBlocks(blocks);
                let local = s.slice(&full, p, g.rank())?;
                s.gather(&local, &g)?.to_vec2::<f32>()
            });
            for r in got {
                assert_eq!(r?, full.to_vec2::<f32>()?, "{blocks} blocks over {p} ranks");
            }
        }
        Ok(())
    }
}
