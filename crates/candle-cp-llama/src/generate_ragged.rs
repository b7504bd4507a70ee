//! Generation of prompts of different lengths in one batch: left padding, each row's
//! padding a document of its own.
//!
//! ```text
//! prompts  a a a a a            slot 0 1 2 3 4 5 6 7 | 8 9 …   (T = 8: the longest prompt
//!          b b b b b b b             · · · a a a a a | a' a''    rounded up to the layout's
//!          c c                       · b b b b b b b | b' b''    prompt multiple)
//!                                    · · · · · · c c | c' c''
//! prefill: the packed forward over [B, T] (any CP layout), row r's documents
//!          [start_r, T - start_r]: the padding attends to itself only, the prompt to itself;
//!          RoPE positions restart at each prompt's first token (slot s ↦ s - start_r)
//! cache:   every row holds T slots; KvShard::set_row_starts hides slots < start_r from row r
//! decode:  slot p for every row (one owner rank per slot, as for one prompt), RoPE position
//!          p - start_r per row, the padding's keys masked in sharded_decode_attention
//! ```
//!
//! Each row then follows the tokens and logits its prompt alone gives
//! ([`Llama::generate_until`] of that prompt), up to rounding; the batch costs one prefill and
//! one decode step per token for all rows, where prompt by prompt each costs its own.

use crate::layout::shard_tokens;
use crate::model::Llama;
use crate::rope::rope_tables_at;
use crate::sampling::{Sampler, Sampling};
use crate::Generation;
use candle_core::{bail, DType, Result, Tensor};
use candle_cp_ops::packing::Documents;
use std::time::Instant;

/// The token written in the padding slots (never seen by a prompt's tokens).
const PAD: u32 = 0;

impl Llama {
    /// [`Llama::generate_until`] of `prompts` of any lengths (each `≥ 1` token, the same list
    /// on every rank) in one batch: row `r` of the result is prompt `r`'s generation, the
    /// tokens (and logits, up to rounding) it gets alone. The prompts are padded on the left to
    /// the longest one's length rounded up to [`Llama::prompt_multiple`] (so the whole batch
    /// is one prefill on any layout); the padding is masked in the prefill (a document of its
    /// own) and in every decode step ([`candle_cp_ops::cp::KvShard::set_row_starts`]).
    /// Prompts of one length that suits the layout run exactly as [`Llama::generate_until`]
    /// of their `[B, T]` tensor. With DP, `dp` must divide the number of prompts (each replica
    /// generates its rows). Collective over the world.
    pub fn generate_ragged(&self, prompts: &[Vec<u32>], max_new_tokens: usize, sampling: Sampling, stop: &[u32]) -> Result<Generation> {
        let n = prompts.len();
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            bail!("Llama::generate_ragged: prompt {i} of {n} is empty (every prompt needs at least 1 token)")
        }
        let Some(longest) = prompts.iter().map(Vec::len).max() else {
            bail!("Llama::generate_ragged: no prompt")
        };
        let dp = self.ctx.dp.size();
        if !n.is_multiple_of(dp) {
            bail!("Llama::generate_ragged: {n} prompts not divisible by dp = {dp}")
        }
        let t = longest.div_ceil(self.prompt_multiple()) * self.prompt_multiple();
        let dev = self.embed.device();
        if prompts.iter().all(|p| p.len() == t) {
            let ids = Tensor::from_vec(prompts.concat(), (n, t), dev)?;
            return self.generate_until(&ids, max_new_tokens, sampling, stop);
        }
        if let Some(&bad) = stop.iter().find(|&&s| s as usize >= self.cfg.vocab_size) {
            bail!("Llama::generate_ragged: stop token {bad} out of range for vocab {} (stop {stop:?})", self.cfg.vocab_size)
        }
        let sampler = Sampler::new(sampling)?;
        let t0 = Instant::now();
        let starts: Vec<usize> = prompts.iter().map(|p| t - p.len()).collect();
        let ids: Vec<u32> = prompts.iter().zip(&starts).flat_map(|(p, &s)| std::iter::repeat_n(PAD, s).chain(p.iter().copied())).collect();
        let (cache, local) = self.prefill_padded(&Tensor::from_vec(ids, (n, t), dev)?, &starts)?;
        self.decode_rows(cache, local, t0, (max_new_tokens, sampler), stop)
    }

    /// The prefill of a left-padded batch `ids [B, T]` (global, the same on every rank) whose
    /// row `r` starts at slot `starts[r]`: [`Llama::prefill`] with each row's padding and
    /// prompt as two documents, RoPE positions counted from each prompt's first token (the
    /// padding's at 0), and the cache told the rows' starts.
    pub(crate) fn prefill_padded(&self, ids: &Tensor, starts: &[usize]) -> Result<(crate::KvCache, Tensor)> {
        let (b, t) = ids.dims2()?;
        if starts.len() != b || starts.iter().any(|&s| s >= t) {
            bail!("Llama::prefill_padded: starts {starts:?} for ids [{b}, {t}]: one per row, each before T")
        }
        let ids = self.checked_ids(ids, "Llama::generate_ragged")?;
        let dev = ids.device().clone();
        let positions: Vec<u32> = starts.iter().flat_map(|&s| (0..t).map(move |j| j.saturating_sub(s) as u32)).collect();
        let positions = Tensor::from_vec(positions, (b, t), &dev)?;
        let slots = Tensor::arange(0u32, t as u32, &dev)?;
        // SP off, as for any prefill
        let mut whole = self.ctx.clone();
        whole.layout.sp = false;
        let parts = shard_tokens(&[ids, positions], &slots, b, t, &whole)
            .map_err(|e| candle_core::Error::Msg(format!("Llama::generate_ragged: prompts padded to [{b}, {t}] do not suit layout {}: {e}", self.ctx.layout)))?;
        let [ids, positions, slots] = parts.as_slice() else {
            bail!("Llama::generate_ragged: internal error (shards)")
        };
        // this DP replica's rows
        let bd = ids.dim(0)?;
        let mine = &starts[self.ctx.coords.0 * bd..(self.ctx.coords.0 + 1) * bd];
        let positions = positions.to_vec2::<u32>()?;
        // per row, the tables of its positions at its prompt's length (a LongRoPE's choice)
        let tables_of = |cfg: &crate::LlamaConfig| -> Result<(Tensor, Tensor)> {
            let rows = positions.iter().zip(mine).map(|(p, &s)| rope_tables_at(cfg, p, t - s, DType::F32, &dev)).collect::<Result<Vec<_>>>()?;
            let (c, s): (Vec<Tensor>, Vec<Tensor>) = rows.into_iter().unzip();
            Ok((Tensor::stack(&c, 0)?, Tensor::stack(&s, 0)?))
        };
        let local = match self.cfg.local_rope() {
            Some(l) => Some(tables_of(&l)?),
            None => None,
        };
        let tables = (tables_of(&self.cfg)?, local);
        let docs = mine
            .iter()
            .map(|&s| match s {
                0 => Documents::from_lengths(&[t]),
                s => Documents::from_lengths(&[s, t - s]),
            })
            .collect::<Result<Vec<_>>>()?;
        let rows: Vec<usize> = slots.to_vec1::<u32>()?.into_iter().map(|s| s as usize).collect();
        self.prefill_shard(ids, &rows, t, tables, Some(&docs), mine.to_vec())
    }
}
