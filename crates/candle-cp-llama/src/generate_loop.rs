//! The decode loop every generation shares ([`Llama::generate_until`],
//! [`Llama::generate_ragged`]): each step's tokens chosen from every row's logits (gathered over
//! DP), rows ended at their stop tokens, and the per-row RoPE tables of a left-padded batch's
//! decode steps.

use crate::generate::{Generation, KvCache};
use crate::model::Llama;
use crate::sampling::Sampler;
use candle_core::{Result, Tensor};
use std::time::{Duration, Instant};

impl Llama {
    /// RoPE tables of decode step `p` (a slot): `[1, D]` at position `p` (`p - s` when every
    /// row starts at slot `s`), or `[B, 1, D]` with row `b` at `p - starts[b]` (each with the
    /// sequence length its own position implies, as [`Llama::rope_pair`]).
    #[allow(clippy::type_complexity)]
    pub(crate) fn decode_tables(&self, p: usize, starts: &[usize], dev: &candle_core::Device) -> Result<((Tensor, Tensor), Option<(Tensor, Tensor)>)> {
        let at = |s: usize| -> Result<_> {
            let q = p.checked_sub(s).ok_or_else(|| candle_core::Error::Msg(format!("Llama::decode_step: slot {p} before a row's start {s}")))?;
            self.rope_pair(&[q as u32], q + 1, dev)
        };
        match starts.first() {
            None => at(0),
            Some(&s) if starts.iter().all(|&x| x == s) => at(s),
            Some(_) => {
                let stack = |parts: Vec<(Tensor, Tensor)>| -> Result<(Tensor, Tensor)> {
                    let (c, s): (Vec<Tensor>, Vec<Tensor>) = parts.into_iter().unzip();
                    Ok((Tensor::stack(&c, 0)?, Tensor::stack(&s, 0)?))
                };
                let (global, local): (Vec<_>, Vec<_>) = starts.iter().map(|&s| at(s)).collect::<Result<Vec<_>>>()?.into_iter().unzip();
                let local = local.into_iter().collect::<Option<Vec<_>>>().map(stack).transpose()?;
                Ok((stack(global)?, local))
            }
        }
    }

    /// Generation from a filled `cache` and its replica's first logits `local [Bd, V]` (made
    /// from `t0` on): up to `max_new_tokens` tokens per row chosen by `sampler`, rows ending at
    /// a token of `stop`.
    pub(crate) fn decode_rows(&self, mut cache: KvCache, local: Tensor, t0: Instant, (max_new_tokens, mut sampler): (usize, Sampler), stop: &[u32]) -> Result<Generation> {
        let dp = &self.ctx.dp;
        // every row's logits on every rank: [B, V]
        let all_rows = |l: Tensor| -> Result<Tensor> {
            if dp.size() > 1 {
                dp.all_gather(&l.contiguous()?, 0)
            } else {
                Ok(l)
            }
        };
        let mut logits = all_rows(local)?;
        let prefill_time = t0.elapsed();
        let (b, bd) = (logits.dim(0)?, cache.batch());
        let first_row = dp.rank() * bd;
        let mut out = Generation {
            tokens: vec![Vec::with_capacity(max_new_tokens); b],
            logits: Vec::with_capacity(max_new_tokens),
            cache_bytes: 0,
            cache_rows: 0,
            prefill_time,
            decode_time: Duration::ZERO,
            stopped: vec![false; b],
        };
        let t1 = Instant::now();
        for i in 0..max_new_tokens {
            let next = sampler.next(&logits)?;
            let mut feed = next.to_vec1::<u32>()?;
            for ((row, done), tok) in out.tokens.iter_mut().zip(out.stopped.iter_mut()).zip(feed.iter_mut()) {
                match (*done, row.last()) {
                    // (a stopped row: its stop token again, its draw discarded)
                    (true, Some(&last)) => *tok = last,
                    _ => {
                        row.push(*tok);
                        *done = stop.contains(tok);
                    }
                }
            }
            out.logits.push(logits);
            if i + 1 == max_new_tokens || out.stopped.iter().all(|&d| d) {
                break;
            }
            let feed = Tensor::from_vec(feed, b, next.device())?;
            logits = all_rows(self.decode_step(&mut cache, &feed.narrow(0, first_row, bd)?)?)?;
        }
        out.decode_time = t1.elapsed();
        out.cache_bytes = cache.bytes();
        out.cache_rows = cache.len();
        Ok(out)
    }
}
