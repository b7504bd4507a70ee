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
//! When the blocks neither divide nor are divided by `P` (10 KV heads over `P = 4`: Phi-3-medium,
//! Phi-4), each block is copied `f = lcm(n, P)/n` times and rank `r` holds copies
//! `[r·L/P, (r+1)·L/P)` of the `L = lcm(n, P)`, in order ([`Shard::row_blocks`]); no two ranks
//! hold the same slice, a rank may hold a block twice, and a block's gradient shares are summed
//! by [`Shard::fold_copies`] over the whole TP group. For 3 blocks over `P = 2`:
//!
//! ```text
//! full k_proj [3·D, in]     copies (f = 2)        TP rank 0        TP rank 1
//!   blocks 0, 1, 2   ──▶   0 0 1 1 2 2   ──▶   blocks 0, 0, 1   blocks 1, 2, 2
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
    /// K/V projection of a GQA model with fewer KV heads than the TP size. Otherwise each
    /// block is copied `lcm(n, P)/n` times and rank `r` holds `lcm(n, P)/P` consecutive copies
    /// ([`Shard::row_blocks`], [`Shard::mixed_copies`]).
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

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// `lcm(n, p) / p`: the blocks (copies counted) each of `p` ranks holds of a
/// [`Shard::RowBlocks`]`(n)` tensor — a TP rank's KV heads for `n` KV heads (`n/p` when `p`
/// divides `n`, 1 when `n` divides `p`, 5 for 10 KV heads over `p = 4`: 3 distinct heads, two
/// of them twice). 0 when `n` or `p` is.
pub fn blocks_per_rank(n: usize, p: usize) -> usize {
    if n == 0 || p == 0 { 0 } else { n / gcd(n, p) }
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

    /// How many copies of each slice (of each block, for [`Shard::RowBlocks`]) the `size`
    /// ranks hold: `size` for [`Shard::Replicated`], `lcm(n, size)/n` for
    /// [`Shard::RowBlocks`]`(n)` (`size/n` when `n` divides `size`; 1 when `size` divides `n`),
    /// else 1. A gradient computed on one copy is that copy's share: the true gradient is the
    /// sum over the copies.
    pub fn copies(&self, size: usize) -> usize {
        match self.resolve(size) {
            Shard::Replicated => size,
            Shard::RowBlocks(n) if n > 0 => size / gcd(n, size),
            _ => 1,
        }
    }

    /// Whether this is a [`Shard::RowBlocks`]`(n)` whose `n` neither divides nor is divided by
    /// `size` (10 KV heads over 4 TP ranks): the ranks then hold different mixes of blocks
    /// and copies ([`Shard::row_blocks`]), no two the same slice, so the copies' gradient
    /// shares are summed by [`Shard::fold_copies`] over the whole group rather than by an
    /// all-reduce over the ranks holding a slice.
    pub fn mixed_copies(&self, size: usize) -> bool {
        matches!(*self, Shard::RowBlocks(n) if n > 0 && size > 0 && !n.is_multiple_of(size) && !size.is_multiple_of(n))
    }

    /// The blocks rank `rank` of `size` holds of a [`Shard::RowBlocks`]`(n)` tensor, in order:
    /// copies `[rank·b, (rank+1)·b)` of the `lcm(n, size)`, `b = lcm(n, size)/size`, copy `c`
    /// being block `c / copies` (`None` for the other splits, or `rank >= size`).
    pub fn row_blocks(&self, size: usize, rank: usize) -> Option<Vec<usize>> {
        match *self {
            Shard::RowBlocks(n) if n > 0 && rank < size => {
                let (f, b) = (self.copies(size), blocks_per_rank(n, size));
                Some((rank * b..(rank + 1) * b).map(|c| c / f).collect())
            }
            _ => None,
        }
    }

    /// Which copy group rank `rank` of `size` belongs to: ranks holding the same slice get the
    /// same index (`0..size/copies`). Rank `r` of a [`Shard::RowBlocks`]`(n)` with `n < size`
    /// holds block `r·n/size`. With [`Shard::mixed_copies`] no two ranks hold the same slice:
    /// `rank` itself.
    pub fn slice_index(&self, size: usize, rank: usize) -> usize {
        if self.mixed_copies(size) {
            return rank;
        }
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
            s[0] = s[0] / n * blocks_per_rank(n, size);
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
        // copied blocks (fewer than the ranks, or mixed): the rank's blocks, in order
        if let (Shard::RowBlocks(n), Some(blocks)) = (self.resolve(size), self.row_blocks(size, rank)) {
            let blk = full.dim(0)? / n;
            let parts = blocks.iter().map(|&j| full.detach().narrow(0, j * blk, blk)).collect::<Result<Vec<_>>>()?;
            return Tensor::cat(&parts, 0)?.contiguous();
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
        if parts.iter().any(|t| t.dims() != first.dims()) {
            bail!("{self:?}: parts of different shapes {:?}", parts.iter().map(|t| t.dims().to_vec()).collect::<Vec<_>>())
        }
        let all = Tensor::cat(parts, d)?;
        match resolved {
            // lcm(n, size) copies in order, `copies` of each block: keep each block's first
            Shard::RowBlocks(n) => {
                let (f, rows) = (resolved.copies(size), all.dim(0)?);
                if n == 0 || !rows.is_multiple_of(n * f) {
                    bail!("{self:?}: the {size} parts {:?} are not {} copies of {n} equal blocks", first.dims(), n * f)
                }
                let blk = rows / (n * f);
                let keep = (0..n).map(|j| all.narrow(0, j * f * blk, blk)).collect::<Result<Vec<_>>>()?;
                Tensor::cat(&keep, 0)
            }
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

    /// Sum the gradient shares of a block's copies: `local` is this rank's share of its
    /// [`Shard::row_blocks`] (`[lcm(n, P)/P · rows, ...]`); returns the same blocks, each the
    /// sum of all its copies' shares over `group` (the TP group; collective: every rank calls
    /// it). Summed in f32 (one all-gather of the f32 shares), returned in `local`'s dtype.
    /// Without copies (`P` divides `n`, or not [`Shard::RowBlocks`]) `local` as it is.
    pub fn fold_copies(&self, local: &Tensor, group: &Group) -> Result<Tensor> {
        let size = group.size();
        let Shard::RowBlocks(n) = self.resolve(size) else { return Ok(local.clone()) };
        let f = self.copies(size);
        if f == 1 {
            return Ok(local.clone());
        }
        let b = blocks_per_rank(n, size);
        let dims = local.dims().to_vec();
        if dims.is_empty() || !dims[0].is_multiple_of(b) {
            bail!("{self:?}::fold_copies: local {dims:?} is not {b} equal blocks (the rank's share over {size} ranks)")
        }
        let all = group.all_gather(&local.to_dtype(candle_core::DType::F32)?.contiguous()?, 0)?;
        let mut full = dims.clone();
        full[0] = dims[0] / b * n;
        let per_block = all.elem_count() / (n * f);
        let summed = all.reshape((n, f, per_block))?.sum(1)?.reshape(full)?;
        self.slice(&summed, size, group.rank())?.to_dtype(local.dtype())
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
        let e = Shard::RowBlocks(3).local_shape(&[4, 6], 3).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[4, 6]") && e.contains("3 equal blocks"), "{e}");
        assert!(Shard::RowBlocks(2).slice(&full, 4, 4).is_err());
        Ok(())
    }

    /// Blocks that neither divide nor are divided by the ranks: 2 over 3 (copies 0 0 | 0 1 |
    /// 1 1), 3 over 2 (0 0 1 | 1 2 2), 10 over 4 (Phi-3-medium's KV heads: 0 0 1 1 2 | 2 3 3 4
    /// 4 | ...), 6 over 4.
    #[test]
    fn mixed_row_blocks_copy_each_block_lcm_over_n_times() -> Result<()> {
        let b = Shard::RowBlocks(3);
        assert!(b.mixed_copies(2) && !b.mixed_copies(3) && !b.mixed_copies(6) && !Shard::Rows.mixed_copies(2));
        assert_eq!((b.copies(2), blocks_per_rank(3, 2), b.slice_index(2, 1)), (2, 3, 1));
        assert_eq!((b.row_blocks(2, 0), b.row_blocks(2, 1)), (Some(vec![0, 0, 1]), Some(vec![1, 2, 2])));
        assert_eq!(Shard::RowBlocks(2).row_blocks(3, 1), Some(vec![0, 1]));
        assert_eq!(Shard::RowBlocks(10).row_blocks(4, 1), Some(vec![2, 3, 3, 4, 4]));
        assert_eq!((Shard::RowBlocks(10).copies(4), Shard::RowBlocks(10).copies(8), blocks_per_rank(10, 8)), (2, 4, 5));
        assert_eq!((Shard::Rows.row_blocks(2, 0), b.row_blocks(2, 2)), (None, None));
        // 3 blocks of 2 rows over 2 ranks
        let full = Tensor::arange(0f32, 36., &Device::Cpu)?.reshape((6, 6))?;
        assert_eq!(b.local_shape(&[6, 6], 2)?.dims(), [6, 6]);
        let rows = |js: &[usize]| -> Result<Vec<Vec<f32>>> {
            Tensor::cat(&js.iter().map(|&j| full.narrow(0, 2 * j, 2)).collect::<Result<Vec<_>>>()?, 0)?.to_vec2::<f32>()
        };
        assert_eq!(b.slice(&full, 2, 0)?.to_vec2::<f32>()?, rows(&[0, 0, 1])?);
        assert_eq!(b.slice(&full, 2, 1)?.to_vec2::<f32>()?, rows(&[1, 2, 2])?);
        for (blocks, p, n_rows) in [(3usize, 2usize, 6usize), (2, 3, 4), (6, 4, 12), (10, 4, 20), (10, 8, 10)] {
            let full = Tensor::arange(0f32, (n_rows * 3) as f32, &Device::Cpu)?.reshape((n_rows, 3))?;
            let s = Shard::RowBlocks(blocks);
            let parts = (0..p).map(|r| s.slice(&full, p, r)).collect::<Result<Vec<_>>>()?;
            assert_eq!(s.assemble(&parts)?.to_vec2::<f32>()?, full.to_vec2::<f32>()?, "assemble {blocks} over {p}");
            // gather drops the copies; fold sums each block's copies (here shares of ones:
            // each block's copy count, wherever the copies are)
            type Rows = Vec<Vec<f32>>;
            for r in candle_cp_comm::run_ranks(p, |g| -> Result<(Rows, Rows)> {
                let local = s.slice(&full, p, g.rank())?;
                let folded = s.fold_copies(&local.ones_like()?.to_dtype(candle_core::DType::BF16)?, &g)?;
                Ok((s.gather(&local, &g)?.to_vec2::<f32>()?, folded.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?))
            }) {
                let (gathered, folded) = r?;
                assert_eq!(gathered, full.to_vec2::<f32>()?, "gather {blocks} over {p}");
                assert!(folded.iter().flatten().all(|&x| x == s.copies(p) as f32), "fold {blocks} over {p}: {folded:?}");
            }
        }
        // parts that are not the copies of 3 blocks over 2 ranks are refused, not cut
        let odd = Tensor::zeros((5, 6), candle_core::DType::F32, &Device::Cpu)?;
        let e = b.assemble(&[odd.clone(), odd]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[5, 6]") && e.contains("6 copies of 3 equal blocks"), "{e}");
        // a share of distinct values: each block's copies summed, then sliced back
        let got = candle_cp_comm::run_ranks(2, |g| -> Result<Vec<Vec<f32>>> {
            let local = (b.slice(&full, 2, g.rank())? * (g.rank() + 1) as f64)?;
            b.fold_copies(&local, &g)?.to_vec2::<f32>()
        });
        // block 0: copies on rank 0 twice (1 + 1); block 1: one on each (1 + 2); block 2: rank 1 twice (2 + 2)
        let want = |r: usize| -> Result<Vec<Vec<f32>>> {
            let scale = [2.0, 3.0, 4.0];
            let blocks = b.row_blocks(2, r).unwrap_or_default();
            Tensor::cat(&blocks.iter().map(|&j| full.narrow(0, 2 * j, 2)? * scale[j]).collect::<Result<Vec<_>>>()?, 0)?.to_vec2::<f32>()
        };
        for (r, got) in got.into_iter().enumerate() {
            assert_eq!(got?, want(r)?, "rank {r}");
        }
        for r in candle_cp_comm::run_ranks(2, |g| b.fold_copies(&Tensor::zeros((5, 6), candle_core::DType::F32, &Device::Cpu)?, &g).map(|_| ())) {
            let e = r.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("[5, 6]") && e.contains("3 equal blocks"), "{e}");
        }
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
