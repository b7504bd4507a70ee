//! ZeRO-1 collectives of [`super::AdamW`]: each of the `R` replica ranks owns slice `r` of
//! every parameter, flattened and cut into `R` slices of `⌈n/R⌉` elements (the last ones
//! shorter or empty).
//!
//! Both directions are bucketed: the slices of many parameters travel in one collective.
//!
//! ```text
//! reduce-scatter (gradients, f32)            all-gather (updated parameters)
//!   rank r: [ a0 a1 | b0 b1 ]                  rank r: [ a_r | b_r ]
//!   rows = slices, columns = parameters        ──► all ranks: [ a0 b0 | a1 b1 ]
//!   ──► rank r: Σ_ranks [ a_r | b_r ]              ──► a = [a0 a1], b = [b0 b1]
//! ```
//!
//! The gradient sum is the one an all-reduce computes (same ranks, same order on the thread
//! group), so a ZeRO-1 run matches a plain one; it sends `(R-1)/R` of the gradient bytes
//! where an all-reduce sends twice that.

use candle_core::{DType, Result, Tensor, Var};
use candle_cp_comm::{Group, PendingRecv};
use std::collections::VecDeque;

/// ZeRO-1: the optimizer state is split over `group`, the ranks that hold the same weights
/// (data- and context-parallel replicas); rank `r` owns slice `r` of every parameter.
#[derive(Clone)]
pub(crate) struct Zero {
    pub group: Group,
    pub rank: usize,
    pub size: usize,
}

/// Elements per bucket, padding included (256 MiB of f32): the flat buffer of one collective.
pub(crate) const BUCKET: usize = 1 << 26;

/// Slice `r` of `n` elements split into `size` slices of `ceil(n / size)` (the last ones
/// shorter or empty): `(offset, length, slice capacity)`.
pub(crate) fn span(n: usize, r: usize, size: usize) -> (usize, usize, usize) {
    let chunk = n.div_ceil(size.max(1));
    let off = (r * chunk).min(n);
    (off, (off + chunk).min(n) - off, chunk)
}

/// `t` (1-D) followed by zeros up to `len` elements.
fn pad_to(t: &Tensor, len: usize) -> Result<Tensor> {
    let have = t.elem_count();
    if have >= len {
        return Ok(t.clone());
    }
    let pad = Tensor::zeros(len - have, t.dtype(), t.device())?;
    Tensor::cat(&[t, &pad], 0)
}

/// All replica ranks' slices of one parameter (`[len]` each) → the flat `[n]` tensor.
pub(crate) fn gather(z: &Zero, slice: &Tensor, n: usize) -> Result<Tensor> {
    let mut one = gather_many(z, &[(slice.clone(), n)], BUCKET)?;
    one.pop().ok_or_else(|| candle_core::Error::Msg("ZeRO gather: no result".into()))
}

/// Bucketed [`gather`]: `items` are this rank's slices (`[len]`) of parameters of `n`
/// elements; returns the flat `[n]` parameters in order. One all-gather per bucket of
/// slices of one dtype (a bucket closes once it holds `bucket` elements, padding included). Collective: every replica rank passes the same `n`s and dtypes.
pub(crate) fn gather_many(z: &Zero, items: &[(Tensor, usize)], bucket: usize) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(items.len());
    let mut start = 0;
    while start < items.len() {
        let end = bucket_end(start, items.len(), z.size, bucket, |i| items[i].0.dtype(), |i| items[i].1);
        let params: Vec<(usize, usize)> = items[start..end].iter().map(|(_, n)| (*n, span(*n, 0, z.size).2)).collect();
        let packed = pack_bucket(items[start..end].iter().map(|(s, _)| s), &params)?;
        out.extend(unpack_bucket(z.group.all_gather(&packed, 0)?, z.size, &params)?);
        start = end;
    }
    Ok(out)
}

/// End (exclusive) of the bucket of items `start..` of `len`: the items after `start` with
/// its `key`, while the bucket holds fewer than `bucket` elements, padding to `size` slices
/// included (`n(i)`: item `i`'s elements); at least one item.
fn bucket_end<K: PartialEq>(start: usize, len: usize, size: usize, bucket: usize, key: impl Fn(usize) -> K, n: impl Fn(usize) -> usize) -> usize {
    let (k, mut end, mut elems) = (key(start), start, 0);
    while end < len && key(end) == k && (end == start || elems < bucket) {
        elems += span(n(end), 0, size).2 * size;
        end += 1;
    }
    end
}

/// One all-gather's input: the slices, each zero-padded to its capacity, end to end;
/// `params` = (elements, slice capacity) of each.
fn pack_bucket<'a>(slices: impl Iterator<Item = &'a Tensor>, params: &[(usize, usize)]) -> Result<Tensor> {
    let padded = slices.zip(params).map(|(s, &(_, chunk))| pad_to(s, chunk)).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&padded, 0)
}

/// An all-gather of [`pack_bucket`] (`[size · cols]`, rank-major) → each parameter's flat
/// `[n]`.
fn unpack_bucket(all: Tensor, size: usize, params: &[(usize, usize)]) -> Result<Vec<Tensor>> {
    let cols: usize = params.iter().map(|p| p.1).sum();
    // [size, cols]; parameter i is a band of columns
    let all = all.reshape((size, cols))?;
    let mut col = 0;
    let mut out = Vec::with_capacity(params.len());
    for &(n, chunk) in params {
        out.push(all.narrow(1, col, chunk)?.flatten_all()?.narrow(0, 0, n)?);
        col += chunk;
    }
    Ok(out)
}

/// ZeRO's all-gathers of updated parameters, started by [`super::AdamW::step_start`] and
/// waited for group by group: [`PendingParams::wait_through`]`(k)` writes the parameters of
/// groups `0..=k` (each bucket into its `Var`s as it arrives); [`PendingParams::finish`] all.
///
/// ```text
/// step_start:  update slices ─► start gather(group 0) gather(group 1) … gather(group L+1)
/// forward:     wait(0) embed ─► wait(1) layer 0 ─► wait(2) layer 1 ─► …
///              (group k+1 travels while layer k computes)
/// ```
///
/// Dropped unwaited, the gathers are abandoned (the group's collectives still complete) and
/// the parameters keep their old values.
pub struct PendingParams {
    /// In the order started.
    buckets: VecDeque<GatherBucket>,
}

/// A parameter to rebuild: (its group, the parameter, this rank's updated slice `[len]`).
pub(crate) type GatherItem = (usize, Var, Tensor);

/// One started all-gather: its group, the ranks it gathers over, the pending result, and the
/// parameters it rebuilds with their (elements, slice capacity).
struct GatherBucket {
    group: usize,
    size: usize,
    pending: Box<dyn PendingRecv>,
    vars: Vec<Var>,
    params: Vec<(usize, usize)>,
}

impl PendingParams {
    /// Nothing pending.
    pub(crate) fn none() -> Self {
        Self { buckets: VecDeque::new() }
    }

    /// Start the all-gathers of `items` = (group, parameter, this rank's updated slice
    /// `[len]`): sorted by group (stable), one all-gather per bucket of one group and dtype
    /// (a bucket closes once it holds `bucket` elements, padding included). Collective over
    /// `z.group`: every replica rank passes the same groups, parameters and dtypes.
    #[cfg(test)]
    pub(crate) fn start(z: &Zero, items: Vec<GatherItem>, bucket: usize) -> Result<Self> {
        Self::start_many(vec![(z.clone(), items)], bucket)
    }

    /// [`PendingParams::start`] of several splits at once (`parts` = the ranks of a split and
    /// its items: the dense parameters over the replicas, the experts over the ranks holding
    /// them): the buckets of every split sorted by group, within a group by split, so that
    /// waiting for a group waits for its parameters of every split. Collective over each
    /// split's group.
    pub(crate) fn start_many(parts: Vec<(Zero, Vec<GatherItem>)>, bucket: usize) -> Result<Self> {
        // (group, split, parameter, slice)
        let mut items: Vec<(usize, usize, Var, Tensor)> =
            parts.iter().enumerate().flat_map(|(j, (_, it))| it.iter().map(move |(k, v, t)| (*k, j, v.clone(), t.clone()))).collect();
        items.sort_by_key(|(k, j, _, _)| (*k, *j));
        let mut buckets = VecDeque::new();
        let mut start = 0;
        while start < items.len() {
            let z = &parts[items[start].1].0;
            let end = bucket_end(start, items.len(), z.size, bucket, |i| (items[i].0, items[i].1, items[i].3.dtype()), |i| items[i].2.elem_count());
            let part = &items[start..end];
            let params: Vec<(usize, usize)> = part.iter().map(|(_, _, v, _)| (v.elem_count(), span(v.elem_count(), 0, z.size).2)).collect();
            let packed = pack_bucket(part.iter().map(|(_, _, _, s)| s), &params)?;
            let pending = z.group.all_gather_start(&packed, 0)?;
            let vars = part.iter().map(|(_, _, v, _)| v.clone()).collect();
            buckets.push_back(GatherBucket { group: part[0].0, size: z.size, pending, vars, params });
            start = end;
        }
        Ok(Self { buckets })
    }

    /// Wait for the all-gathers of groups `0..=k` (in the order started) and write their
    /// parameters. Cheap when they are done already.
    pub fn wait_through(&mut self, k: usize) -> Result<()> {
        while self.buckets.front().is_some_and(|b| b.group <= k) {
            let Some(b) = self.buckets.pop_front() else { break };
            for (var, full) in b.vars.iter().zip(unpack_bucket(b.pending.wait()?, b.size, &b.params)?) {
                var.set(&full.reshape(var.shape())?)?;
            }
        }
        Ok(())
    }

    /// Wait for every group.
    pub fn finish(&mut self) -> Result<()> {
        self.wait_through(usize::MAX)
    }

    /// Whether every started all-gather has been waited for.
    pub fn is_done(&self) -> bool {
        self.buckets.is_empty()
    }
}

/// Sum full gradients over the replica ranks and keep this rank's slice of each: `grads`
/// are whole gradients (any shape, `n` elements each) in the same order and shapes on every
/// rank; returns `[len]` slices (rank `z.rank`'s span of each), in each gradient's dtype.
/// The sum runs in f32, one reduce-scatter per bucket of `bucket` elements (padding included).
#[cfg(test)]
pub(crate) fn reduce_scatter_many(z: &Zero, grads: &[Tensor], bucket: usize) -> Result<Vec<Tensor>> {
    reduce_scatter_many_as(z, grads, bucket, None)
}

/// [`reduce_scatter_many`] with the slices in `dtype` (`None`: each gradient's own).
pub(crate) fn reduce_scatter_many_as(z: &Zero, grads: &[Tensor], bucket: usize, dtype: Option<DType>) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(grads.len());
    let mut start = 0;
    while start < grads.len() {
        let end = bucket_end(start, grads.len(), z.size, bucket, |_| (), |i| grads[i].elem_count());
        let mine = z.group.reduce_scatter(&pack_rows(z, &grads[start..end])?, 0)?;
        let meta: Vec<(usize, DType)> = grads[start..end].iter().map(|g| (g.elem_count(), dtype.unwrap_or(g.dtype()))).collect();
        out.extend(unpack_slices(z, &meta, &mine)?);
        start = end;
    }
    Ok(out)
}

/// One reduce-scatter's input: each gradient (f32) as `[size, chunk]`, row `r` = slice `r`
/// zero-padded, side by side: `[size, Σ chunk]`.
pub(crate) fn pack_rows(z: &Zero, grads: &[Tensor]) -> Result<Tensor> {
    let blocks = grads
        .iter()
        .map(|g| {
            let chunk = span(g.elem_count(), 0, z.size).2;
            pad_to(&g.to_dtype(DType::F32)?.flatten_all()?, chunk * z.size)?.reshape((z.size, chunk))
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&blocks, 1)
}

/// This rank's row of a reduce-scatter of [`pack_rows`]`(grads)` → its `[len]` slice of each
/// gradient; `grads` = (elements, dtype) of each gradient, the slice's dtype.
pub(crate) fn unpack_slices(z: &Zero, grads: &[(usize, DType)], mine: &Tensor) -> Result<Vec<Tensor>> {
    let mine = mine.flatten_all()?;
    let mut col = 0;
    let mut out = Vec::with_capacity(grads.len());
    for &(n, dtype) in grads {
        let (_, len, chunk) = span(n, z.rank, z.size);
        out.push(mine.narrow(0, col, len)?.to_dtype(dtype)?);
        col += chunk;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_cp_comm::run_ranks;

    /// Three ranks, parameters of 10, 2 (a rank owns nothing), 1 and 7 elements, a bf16 one;
    /// one bucket, and buckets of a parameter each: the slices of the sum equal the slices of
    /// `reduce_gradients`' all-reduce, and gathering them rebuilds its result, bit for bit.
    #[test]
    fn bucketed_pairs_match_the_all_reduce() -> Result<()> {
        let shapes: [&[usize]; 4] = [&[2, 5], &[2], &[1], &[7]];
        for bucket in [BUCKET, 1] {
            let res = run_ranks(3, |g| {
                let z = Zero { group: g.clone(), rank: g.rank(), size: g.size() };
                let grads = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let t = candle_cp_ops::oracle::randn(10 * i as u64 + g.rank() as u64, s, 1.0)?;
                        if i == 3 { t.to_dtype(DType::BF16) } else { Ok(t) }
                    })
                    .collect::<Result<Vec<_>>>()?;
                let slices = reduce_scatter_many(&z, &grads, bucket)?;
                let items: Vec<(Tensor, usize)> = slices.iter().zip(&grads).map(|(s, g)| (s.clone(), g.elem_count())).collect();
                let full = gather_many(&z, &items, bucket)?;
                for ((s, grad), f) in slices.iter().zip(&grads).zip(&full) {
                    let n = grad.elem_count();
                    // what reduce_gradients computes: the f32 sum, back in the gradient's dtype
                    let want = g.all_reduce(&grad.to_dtype(DType::F32)?)?.to_dtype(grad.dtype())?.flatten_all()?;
                    let (off, len, _) = span(n, z.rank, z.size);
                    assert_eq!((s.dims(), s.dtype()), (&[len][..], grad.dtype()));
                    let f32s = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec1::<f32>();
                    assert_eq!(f32s(s)?, f32s(&want.narrow(0, off, len)?)?, "slice of a gradient of {n}");
                    assert_eq!((f.dims(), f.dtype()), (&[n][..], grad.dtype()));
                    assert_eq!(f32s(f)?, f32s(&want)?, "gathered parameter of {n}");
                }
                Ok(())
            });
            for r in res {
                r?;
            }
        }
        Ok(())
    }

    /// Parameters in groups 2, 0, 1, 1 (one bf16), buckets of one parameter or all of a
    /// group: waiting for group 1 writes groups 0 and 1 and leaves group 2 untouched;
    /// `finish` writes the rest; every parameter ends as the full tensor whose slices the
    /// ranks passed, bit for bit.
    #[test]
    fn pending_params_write_each_group_when_waited() -> Result<()> {
        use candle_core::Device;
        let spec: [(usize, &[usize], DType); 4] = [(2, &[7], DType::F32), (0, &[2, 5], DType::F32), (1, &[4], DType::BF16), (1, &[3], DType::F32)];
        for bucket in [1, BUCKET] {
            let res = run_ranks(3, |g| {
                let z = Zero { group: g.clone(), rank: g.rank(), size: g.size() };
                let mut items = Vec::new();
                let mut want = Vec::new();
                for (i, (k, shape, dtype)) in spec.iter().enumerate() {
                    let full = candle_cp_ops::oracle::randn(40 + i as u64, shape, 1.0)?.to_dtype(*dtype)?;
                    let var = Var::zeros(*shape, *dtype, &Device::Cpu)?;
                    let (off, len, _) = span(full.elem_count(), z.rank, z.size);
                    items.push((*k, var.clone(), full.flatten_all()?.narrow(0, off, len)?));
                    want.push((*k, var, full));
                }
                let f32s = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
                let mut p = PendingParams::start(&z, items, bucket)?;
                assert!(!p.is_done());
                p.wait_through(1)?;
                for (k, var, full) in &want {
                    let expect = if *k <= 1 { f32s(full)? } else { vec![0.0; full.elem_count()] };
                    assert_eq!(f32s(var.as_tensor())?, expect, "group {k} after wait_through(1)");
                }
                p.finish()?;
                assert!(p.is_done());
                for (k, var, full) in &want {
                    assert_eq!(f32s(var.as_tensor())?, f32s(full)?, "group {k} after finish");
                }
                Ok(())
            });
            for r in res {
                r?;
            }
        }
        Ok(())
    }

    #[test]
    fn spans_cover_the_parameter() {
        for (n, size) in [(10, 3), (2, 3), (1, 4), (12, 4), (7, 1)] {
            let mut next = 0;
            for r in 0..size {
                let (off, len, chunk) = span(n, r, size);
                assert!(len <= chunk);
                if len > 0 {
                    assert_eq!(off, next);
                }
                next = off + len;
            }
            assert_eq!(next, n, "n {n} size {size}");
        }
    }
}
