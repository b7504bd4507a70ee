//! Vocabulary-parallel embedding (Megatron's `VocabParallelEmbedding`): the table
//! `[V, h]` split by rows over the TP group, each rank looking up only the ids of its own
//! slice, the partial results summed.
//!
//! ```text
//! TP rank r holds rows [r·k, (r+1)·k) of the table, k = ⌈V/P⌉ (zero rows past V; Shard::RowsPadded)
//! ids [B, T/P] (SP) ──all-gather T──▶ [B, T]   (without SP: ids [B, T], replicated)
//!   lookup: e[i] = W_r[id - r·k] if id is in the slice, else 0          [B, T, h] partial
//!   SP: reduce-scatter T ──▶ [B, T/P, h]     without SP: all-reduce ──▶ [B, T, h]
//! ```
//!
//! Exactly one rank contributes each row, so the sum is exact: the output equals the
//! replicated table's lookup bit for bit. The backward of the reduction hands every rank
//! the gradient of all `T` rows of the TP region, so each rank's table slice gets the full
//! gradient of its rows (sum it over data / context parallel replicas only).
//! [`vocab_parallel_embedding_slow`] is the replicated reference.

use crate::Tp;
use candle_core::{bail, DType, Result, Tensor};
use candle_cp_ops::mappings::{self, SEQ_DIM};

/// Largest vocabulary whose ids travel exactly through the f32 all-gather of SP (2^24).
const MAX_VOCAB: usize = 1 << 24;

/// Rows of `ids` `[B, T_in]` (u32) looked up in the table `weight` of a `vocab`-token
/// vocabulary, over `tp`'s group: `[B, T_in, h]`, the layout of the input (SP: this rank's
/// sequence shard; else the whole sequence, replicated).
///
/// `weight` is this rank's slice `[⌈V/P⌉, h]` of [`crate::Shard::RowsPadded`]`(V)` (vocabulary
/// parallel: rows `[r·⌈V/P⌉, (r+1)·⌈V/P⌉)`, zero padding past `V`, which no id reaches), or the
/// whole table `[V, h]` (replicated, also what `RowsPadded` gives when `V < P`: a plain lookup,
/// no communication).
/// Collective over the TP group in the first case (every rank calls it). Errors name the
/// shapes for a table that is neither, non-u32 or out-of-range ids, and empty input.
pub fn vocab_parallel_embedding(ids: &Tensor, weight: &Tensor, vocab: usize, tp: &Tp) -> Result<Tensor> {
    const WHAT: &str = "vocab_parallel_embedding";
    candle_cp_comm::ensure_nonempty(WHAT, "ids", ids)?;
    let (b, t_in) = ids.dims2()?;
    let (rows, h) = weight.dims2()?;
    let p = tp.size();
    if ids.dtype() != DType::U32 {
        bail!("{WHAT}: ids {:?} must be u32, got {:?}", ids.dims(), ids.dtype())
    }
    check_ids(ids, vocab, WHAT)?;
    if rows == vocab {
        // replicated table (or one rank): the plain lookup
        return weight.index_select(&ids.flatten_all()?, 0)?.reshape((b, t_in, h));
    }
    if p < 2 || rows != crate::padded_rows(vocab, p) {
        bail!(
            "{WHAT}: table {:?} is neither the whole vocabulary {vocab} nor a slice of ⌈{vocab}/{p}⌉ = {} rows",
            weight.dims(),
            crate::padded_rows(vocab, p)
        )
    }
    if vocab > MAX_VOCAB {
        bail!("{WHAT}: vocabulary {vocab} above 2^24 cannot be split over TP (ids travel as f32)")
    }
    let group = &tp.group;
    let ids_region = if tp.sequence_parallel {
        // ids < 2^24 are exact in f32 (collectives take a float dtype everywhere)
        group.all_gather(&ids.to_dtype(DType::F32)?.contiguous()?, SEQ_DIM)?.to_dtype(DType::U32)?
    } else {
        ids.clone()
    };
    let t = ids_region.dim(1)?;
    let off = (tp.rank() * rows) as u32;
    let all: Vec<u32> = ids_region.flatten_all()?.to_vec1()?;
    let mut local = Vec::with_capacity(all.len());
    let mut mask = Vec::with_capacity(all.len());
    for &id in &all {
        let mine = id >= off && ((id - off) as usize) < rows;
        local.push(if mine { id - off } else { 0 });
        mask.push(if mine { 1f32 } else { 0f32 });
    }
    let dev = weight.device();
    let local = Tensor::from_vec(local, all.len(), dev)?;
    let mask = Tensor::from_vec(mask, (all.len(), 1), dev)?.to_dtype(weight.dtype())?;
    let partial = weight.index_select(&local, 0)?.broadcast_mul(&mask)?.reshape((b, t, h))?;
    if tp.sequence_parallel {
        mappings::reduce_scatter_to_sp_region(&partial, group, SEQ_DIM)
    } else {
        mappings::reduce_from_tp_region(&partial, group)
    }
}

/// Reference for [`vocab_parallel_embedding`]: the whole table `[V, h]`, a plain lookup of
/// `ids` `[B, T_in]` → `[B, T_in, h]`.
pub fn vocab_parallel_embedding_slow(ids: &Tensor, full_weight: &Tensor) -> Result<Tensor> {
    let (b, t) = ids.dims2()?;
    let (_, h) = full_weight.dims2()?;
    full_weight.index_select(&ids.flatten_all()?, 0)?.reshape((b, t, h))
}

fn check_ids(ids: &Tensor, vocab: usize, what: &str) -> Result<()> {
    let max = ids.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize;
    if max >= vocab {
        bail!("{what}: token id {max} out of range for vocab {vocab} (ids {:?})", ids.dims())
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shard;
    use candle_core::{Device, Var};
    use candle_cp_comm::{run_ranks, Group};

    /// Over TP 2 and 4, with and without SP, a 12-token vocabulary (split evenly) and a
    /// 10-token one (padded: 3 rows per rank, the last rank with 1 real row on P 4): outputs
    /// equal the replicated lookup bit for bit, and each rank's table-slice gradient (its rows
    /// of the TP region) equals its slice of the replicated table's gradient (zero on padding).
    #[test]
    fn matches_the_replicated_table() -> Result<()> {
        for vocab in [12usize, 10] {
            matches_the_replicated_table_of(vocab)?;
        }
        Ok(())
    }

    fn matches_the_replicated_table_of(vocab: usize) -> Result<()> {
        let (h, b, t) = (3usize, 2usize, 8usize);
        let w = Tensor::arange(0f32, (vocab * h) as f32, &Device::Cpu)?.reshape((vocab, h))?.affine(0.1, -1.0)?;
        let ids: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 3) % vocab) as u32).collect();
        let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu)?;
        let dy = Tensor::arange(0f32, (b * t * h) as f32, &Device::Cpu)?.reshape((b, t, h))?.sin()?;
        let wv = Var::from_tensor(&w)?;
        let want = vocab_parallel_embedding_slow(&ids, wv.as_tensor())?;
        let gw = (&want * &dy)?.sum_all()?.backward()?.get(wv.as_tensor()).cloned().unwrap_or(w.zeros_like()?);
        for p in [2usize, 4] {
            for sp in [false, true] {
                for res in run_ranks(p, |g: Group| {
                    let tp = Tp::new(g.clone(), sp);
                    let shard = Shard::RowsPadded(vocab);
                    let wl = Var::from_tensor(&shard.slice(&w, p, g.rank())?)?;
                    let (idl, dyl, wantl) = if sp {
                        let n = t / p;
                        (ids.narrow(1, g.rank() * n, n)?, dy.narrow(1, g.rank() * n, n)?, want.narrow(1, g.rank() * n, n)?)
                    } else {
                        (ids.clone(), dy.clone(), want.clone())
                    };
                    let got = vocab_parallel_embedding(&idl, wl.as_tensor(), vocab, &tp)?;
                    let same = got.flatten_all()?.to_vec1::<f32>()? == wantl.flatten_all()?.to_vec1::<f32>()?;
                    let g_local = (&got * &dyl)?.sum_all()?.backward()?.get(wl.as_tensor()).cloned();
                    let g_local = g_local.unwrap_or(wl.as_tensor().zeros_like()?);
                    let g_want = shard.slice(&gw, p, g.rank())?;
                    Ok((same, (g_local - g_want)?.abs()?.max_all()?.to_scalar::<f32>()?))
                }) {
                    let (same, e) = res?;
                    assert!(same, "V {vocab} P {p} sp {sp}: output differs from the replicated lookup");
                    assert!(e < 1e-5, "V {vocab} P {p} sp {sp}: table gradient differs by {e}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn bad_tables_and_ids_are_errors() -> Result<()> {
        for res in run_ranks(2, |g: Group| {
            let tp = Tp::new(g, false);
            let w = Tensor::zeros((5, 3), DType::F32, &Device::Cpu)?;
            let ids = Tensor::new(&[[1u32, 2]], &Device::Cpu)?;
            let err = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
            let e1 = err(vocab_parallel_embedding(&ids, &w, 12, &tp));
            let e2 = err(vocab_parallel_embedding(&Tensor::new(&[[1u32, 12]], &Device::Cpu)?, &w, 10, &tp));
            let e3 = err(vocab_parallel_embedding(&ids.to_dtype(DType::F32)?, &w, 10, &tp));
            Ok((e1, e2, e3))
        }) {
            let (e1, e2, e3) = res?;
            assert!(e1.contains("[5, 3]") && e1.contains("12"), "{e1}");
            assert!(e2.contains("token id 12") && e2.contains("vocab 10"), "{e2}");
            assert!(e3.contains("u32"), "{e3}");
        }
        Ok(())
    }
}
