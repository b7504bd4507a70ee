//! Generation (greedy decoding) with a KV cache sharded over the CP ranks, and over the TP
//! ranks by head.
//!
//! ```text
//! prompt [B, T] (global ids, the same on every rank)
//!   │ sharded like shard_batch: this rank's tokens [B, Tc] at global positions (cp_positions)
//!   ▼ prefill = the training forward on the CP layout (ring / zigzag / striped / all-gather /
//!     Ulysses / 2-D attention, sliding window honoured), each layer's k, v after RoPE
//!     [B, Tc, Hkv, D] kept in this rank's KvCache (one KvShard per layer)
//!   ▼ logits of position T-1 [B, V]: computed on the rank holding T-1, summed over the CP
//!     group with zeros from the others (exact), so every rank picks the same token
//!   ▼ decode step at position p (every rank computes the one new token, replicated):
//!     embed → per layer: norm → q, k, v → RoPE(p) → append k, v on rank decode_owner(p, P)
//!       → sharded_decode_attention over the CP group (one small all-gather + LSE merge)
//!       → o_proj, residual, MLP → final norm → head → logits [B, V] (bitwise the same on
//!     every rank) → argmax
//! ```
//!
//! Tensor parallelism: each TP rank computes its `H/tp` query heads and caches its KV heads
//! (`Hkv/tp`, or the one KV head it holds when `tp > Hkv`); o_proj and down_proj all-reduce
//! over the TP group, so hidden states and logits are the same on every TP rank. A layout
//! trained with sequence parallelism generates with it off (the same weights): a decode step's
//! one token cannot be split along the sequence.
//!
//! DeepSeek's latent attention caches its latent rows (`rkv + rope` values per token, shared by
//! the heads and the TP ranks) and decodes in the absorbed form ([`crate::mla`]): DeepSeek-V3's
//! 576 values per token and layer (held once, keys and values at once) instead of k and v's
//! `2 · 128 · 192`. The prefill computes the rows from the projection it runs anyway and the
//! absorbed weights once for the whole generation.
//!
//! Memory: each rank's cache holds `~(T + generated) / P` tokens (`P` = CP degree), i.e.
//! `2 · L · B · Hkv_local · D · dtype bytes` per token ([`KvCache::bytes`]); the cache is
//! never gathered. Inference only (no autograd graph is kept: cached k, v and hidden states
//! are detached). Every layout works: any CP kind, with or without TP; with DP each replica
//! generates its `B / dp` rows against its own cache, and [`Llama::generate`] shares the
//! logits over the DP group so every rank returns all rows.

use crate::attn::attend_sinks;
use candle_cp_ops::attention::Sinks;
use crate::layout::shard_tokens;
use crate::model::{linear, Block, Llama};
use crate::rope::{apply_rope, rope_tables_at};
use crate::sampling::{Sampler, Sampling};
use candle_core::{bail, DType, Module, Result, Tensor};
use candle_cp_nn::vocab_parallel_embedding;
use candle_cp_ops::cp::{decode_owner, sharded_decode_attention_sinks, KvShard};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// This rank's KV cache: one [`KvShard`] per decoder layer, each `k, v [B, S_r, Hkv_local, D]`
/// (DeepSeek's latent attention: its latent rows `[B, S_r, 1, rkv + rope]`, one buffer that is
/// keys and values, [`KvShard::append_shared`], `crate::mla`)
/// (this TP rank's KV heads, in the weights' dtype) with the global position of each of its `S_r` rows. After a CP
/// prefill of `T` prompt tokens `S_r = T / P` (the rank's CP shard), then decoded tokens are
/// added round-robin ([`decode_owner`]). Per-rank bytes: [`KvCache::bytes`].
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    layers: Vec<KvShard>,
    /// Per layer, a latent attention's absorbed weights (`crate::mla`), made by the prefill
    /// from the weights it ran with; `None` for other layers.
    absorbed: Vec<Option<crate::mla::Absorbed>>,
    /// Batch rows `B` (fixed by the prefill).
    batch: usize,
    /// Global position (slot) of the next token to decode (`T` after the prefill).
    next: usize,
    /// Per batch row (this replica's), the slot of its first token when prompts of different
    /// lengths were padded on the left ([`Llama::generate_ragged`]): row `b`'s token at slot
    /// `s` has RoPE position `s - starts[b]`. Empty: no padding.
    pub(crate) starts: Vec<usize>,
}

impl KvCache {
    /// The shards, one per decoder layer.
    pub fn layers(&self) -> &[KvShard] {
        &self.layers
    }

    /// Cached rows `S_r` on this rank: the most any layer holds (the same for every layer
    /// unless some layers have a sliding window, whose caches drop the rows it no longer
    /// reaches).
    pub fn len(&self) -> usize {
        self.layers.iter().map(|l| l.len()).max().unwrap_or(0)
    }

    /// No cached row on this rank.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Global position of the next token [`Llama::decode_step`] decodes (`T` after a prefill
    /// of `T` tokens, then one more per step). In a left-padded batch
    /// ([`Llama::generate_ragged`]) this is the slot; row `b`'s position is the slot minus
    /// [`KvCache::row_starts`]`[b]`.
    pub fn next_position(&self) -> usize {
        self.next
    }

    /// Per batch row, the slot of its first prompt token in a left-padded batch (empty when
    /// no row is padded).
    pub fn row_starts(&self) -> &[usize] {
        &self.starts
    }

    /// Batch rows `B` of the cache.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Bytes of this rank's cache: `Σ_layers 2 · B · S_r · Hkv_local · D · dtype size`
    /// (DeepSeek's latent rows, keys and values at once: `B · S_r · (rkv + rope) · dtype
    /// size`). Rows in use; the absorbed weights are not counted.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KvShard::bytes).sum()
    }
}

/// Result of [`Llama::generate`] / [`Llama::generate_greedy`] on one rank (every rank gets the same tokens and
/// bitwise the same logits).
#[derive(Clone, Debug)]
pub struct Generation {
    /// `B` rows of `new_tokens` generated ids each (the prompt is not repeated).
    pub tokens: Vec<Vec<u32>>,
    /// One f32 `[B, V]` per generated token: the logits it was chosen from (the first
    /// from the prompt's last position, then one per decode step).
    pub logits: Vec<Tensor>,
    /// Bytes of this rank's KV cache at the end ([`KvCache::bytes`]).
    pub cache_bytes: usize,
    /// Rows of this rank's KV cache at the end ([`KvCache::len`]: the most any layer holds).
    pub cache_rows: usize,
    /// Wall time of the prefill (prompt forward, cache fill, first token's logits).
    pub prefill_time: Duration,
    /// Wall time of all decode steps (`new_tokens - 1` of them, fewer when every row stopped).
    pub decode_time: Duration,
    /// Per row: did it end at one of [`Llama::generate_until`]'s stop tokens (its last token),
    /// rather than at the token limit.
    pub stopped: Vec<bool>,
}

impl Block {
    /// Input norm, fused q/k/v projection and RoPE (tables `cos`, `sin`) of `x [B, T, h]` (whole sequence,
    /// SP off): q `[B, T, H_local, D]`, k, v `[B, T, Hkv_local, D]` (this TP rank's heads).
    fn qkv_rope(
        &self,
        x: &Tensor,
        heads: (usize, usize, usize),
        tables: (&Tensor, &Tensor),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let rope = |x: &Tensor| apply_rope(x, tables.0, tables.1);
        let (b, t, _) = x.dims3()?;
        let (h, hkv, d) = heads;
        let xn = self.normed_input(x)?;
        // DeepSeek-V3: from the latents (crate::mla), RoPE on the rotated parts
        if let Some(m) = &self.mla {
            return m.qkv(&xn, &self.qkv, h, tables, false);
        }
        let qkv = self.qkv.forward_parts(&xn)?;
        let [q, k, v] = qkv.as_slice() else {
            bail!(
                "generate: fused qkv gave {} parts for x {:?}",
                qkv.len(),
                x.dims()
            )
        };
        // OLMo: the norms over the whole projection (the statistic summed over TP)
        let (q, k) = match &self.flat_qk_norm {
            Some(n) => n.apply(q, k)?,
            None => (q.clone(), k.clone()),
        };
        let (q, k) = (q.reshape((b, t, h, d))?, k.reshape((b, t, hkv, d))?);
        // Qwen3: the head norms before RoPE (no backward here: the weights as they are)
        let (q, k) = match &self.qk_norm {
            Some(n) => n.apply(&q, &k)?,
            None => (q, k),
        };
        // (SmolLM3's NoPE layers: q and k as projected)
        match self.rotates {
            true => Ok((rope(&q)?, rope(&k)?, v.reshape((b, t, hkv, d))?)),
            false => Ok((q, k, v.reshape((b, t, hkv, d))?)),
        }
    }

    /// The rest of the layer after attention `a [B, T, H·D]`: o_proj, residual, MLP, residual
    /// (Gemma 3: each branch normalised before its residual add).
    fn finish(&self, x: &Tensor, a: &Tensor) -> Result<Tensor> {
        let branch = |i: usize, y: Tensor| -> Result<Tensor> {
            match &self.sandwich {
                Some(n) => if i == 0 { n.0.forward(&y) } else { n.1.forward(&y) },
                // (Granite: each branch times its residual multiplier)
                None if self.residual_scale != 1.0 => y.affine(self.residual_scale, 0.0),
                None => Ok(y),
            }
        };
        // (DeepSeek-V3: each head's first v dimensions)
        let a = match &self.mla {
            Some(m) => m.attn_out(a, m.heads)?,
            None => a.clone(),
        };
        let x = (x + branch(0, self.o.forward(&a)?)?)?;
        let xn = self.normed_mlp_input(&x)?;
        let y = match &self.mlp {
            crate::model::Mlp::Dense { gate_up, down } => {
                let gu = gate_up.forward_parts(&xn)?;
                let [g, u] = gu.as_slice() else {
                    bail!("generate: fused gate/up gave {} parts for x {:?}", gu.len(), x.dims())
                };
                down.forward(&self.act.gated_plain(g, u)?)?
            }
            crate::model::Mlp::Sparse(moe) => moe.forward(&xn)?,
        };
        x + branch(1, y)?
    }
}

impl Llama {
    /// The decoder layers as generation runs them: sequence parallelism off (same weights).
    fn generation_blocks(&self) -> Result<Vec<Arc<Block>>> {
        // (a quantized base's layers: built from the dequantized weights, held for the call)
        let blocks = self.layer_blocks()?;
        Ok(if self.ctx.layout.seq_parallel() {
            blocks.iter().map(|b| Arc::new(b.without_sp())).collect()
        } else {
            blocks
        })
    }

    /// Embedding of ids `[B, T]` (the whole sequence, SP off) → `[B, T, h]`, the same on
    /// every TP rank (vocabulary-parallel: each rank looks up its slice, summed over TP).
    fn embed_whole(&self, ids: &Tensor) -> Result<Tensor> {
        self.embed_scaled(vocab_parallel_embedding(ids, &self.embed, self.cfg.vocab_size, &self.tp_of(false))?)
    }

    /// RoPE tables `(cos, sin)` `[T, D]` f32 of `positions` in a sequence of `seq_len`
    /// tokens (the frequencies of a LongRoPE depend on it: transformers takes the largest
    /// position of the call + 1, the prompt's length in a prefill, `p + 1` at decode step
    /// `p`; the keys already cached keep their rotation), and those of the local RoPE when
    /// some layer uses it (Gemma 3's sliding layers).
    #[allow(clippy::type_complexity)]
    pub(crate) fn rope_pair(&self, positions: &[u32], seq_len: usize, dev: &candle_core::Device) -> Result<((Tensor, Tensor), Option<(Tensor, Tensor)>)> {
        let c = &self.cfg;
        let local = match c.local_rope() {
            Some(local) => Some(rope_tables_at(&local, positions, seq_len, DType::F32, dev)?),
            None => None,
        };
        Ok((rope_tables_at(c, positions, seq_len, DType::F32, dev)?, local))
    }

    /// Logits `[B, T, V]` of hidden states `[B, T, h]` replicated on the TP ranks (the
    /// vocabulary slices all-gathered when the head is split).
    fn logits_whole(&self, h: &Tensor) -> Result<Tensor> {
        let l = linear(h, self.lm_head()?)?;
        let l = if self.vocab_parallel() {
            // without the padding columns of a vocabulary TP does not divide
            self.ctx.tp.all_gather(&l.contiguous()?, 2)?.narrow(2, 0, self.cfg.vocab_size)?
        } else {
            l
        };
        self.cap_logits(l)
    }

    /// This TP rank's `(H_local, Hkv_local, D)` and the softmax scale.
    fn heads(&self) -> ((usize, usize, usize), candle_cp_ops::attention::Scores) {
        let c = &self.cfg;
        let tp = self.ctx.layout.tp;
        (
            (c.num_attention_heads / tp, candle_cp_nn::blocks_per_rank(c.num_key_value_heads, tp), c.head_dim),
            c.attn_scores(),
        )
    }

    /// Token ids `[..]` as u32, checked against the vocabulary.
    pub(crate) fn checked_ids(&self, ids: &Tensor, what: &str) -> Result<Tensor> {
        // ids may come from the host: they go where the embedding lives
        let ids = ids.to_dtype(DType::U32)?.to_device(self.embed.device())?;
        if ids.elem_count() > 0 {
            let max = ids.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize;
            if max >= self.cfg.vocab_size {
                bail!(
                    "{what}: token id {max} out of range for vocab {} (ids {:?})",
                    self.cfg.vocab_size,
                    ids.dims()
                )
            }
        }
        Ok(ids)
    }

    /// Prefill: run this rank's CP shard of `prompt` (global u32 ids `[B, T]`, the same on
    /// every rank, sharded like [`crate::shard_batch`]: this DP replica's `Bd = B / dp` rows)
    /// through the model exactly as the training forward does (the layout's CP attention,
    /// sliding window included), keeping each layer's k, v after RoPE
    /// (`[Bd, Tc, Hkv_local, D]`, `Tc = T / cp`) in a new [`KvCache`] of `Bd` rows.
    ///
    /// Returns the cache and the f32 logits `[Bd, V]` of global position `T - 1` (the next
    /// token's distribution of this replica's rows), identical on every rank of the replica.
    /// Collective over the CP and TP groups. Errors (on every rank) when `T` does not suit the
    /// layout (naming `T`) or `dp` does not divide `B`.
    pub fn prefill(&self, prompt: &Tensor) -> Result<(KvCache, Tensor)> {
        let ctx = &self.ctx;
        let (b, t) = match prompt.dims() {
            &[b, t] if b > 0 && t > 0 => (b, t),
            _ => bail!(
                "Llama::prefill: prompt must be [B, T] token ids with B, T >= 1, got {:?}",
                prompt.dims()
            ),
        };
        let ids = self.checked_ids(prompt, "Llama::prefill")?;
        let pos = Tensor::arange(0u32, t as u32, ids.device())?;
        // SP off (generation_blocks): the whole CP shard, replicated on the TP ranks
        let mut whole = ctx.clone();
        whole.layout.sp = false;
        let parts = shard_tokens(&[ids], &pos, b, t, &whole).map_err(|e| {
            candle_core::Error::Msg(format!(
                "Llama::prefill: prompt {:?} (T = {t}) does not suit layout {}: {e}",
                prompt.dims(),
                ctx.layout
            ))
        })?;
        let [ids, pos] = parts.as_slice() else {
            bail!("Llama::prefill: internal error (shards)")
        };
        let positions = pos.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        let tables = self.rope_pair(&positions, t, ids.device())?;
        let rows: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
        self.prefill_shard(ids, &rows, t, tables, None, Vec::new())
    }

    /// The prefill of this rank's shard `ids [Bd, Tc]` (global slots `rows`, `t` in all) with
    /// RoPE `tables` (`[Tc, D]`, or `[Bd, Tc, D]` per row), documents `docs` (a left-padded
    /// batch: per row its padding and its prompt) and the rows' `starts` (empty: no padding).
    #[allow(clippy::type_complexity)]
    pub(crate) fn prefill_shard(&self, ids: &Tensor, rows: &[usize], t: usize, tables: ((Tensor, Tensor), Option<(Tensor, Tensor)>), docs: Option<&[candle_cp_ops::packing::Documents]>, starts: Vec<usize>) -> Result<(KvCache, Tensor)> {
        let ctx = &self.ctx;
        let b = ids.dim(0)?; // this DP replica's rows
        let (heads, scale) = self.heads();
        let ((cos, sin), local) = tables;
        let mut cache = KvCache {
            layers: Vec::with_capacity(self.cfg.num_hidden_layers),
            absorbed: Vec::with_capacity(self.cfg.num_hidden_layers),
            batch: b,
            next: t,
            starts: starts.clone(),
        };
        self.router_log.clear();
        let mut x = self.embed_whole(ids)?;
        for blk in &self.generation_blocks()? {
            let (c, s) = match (&local, blk.local_rope) {
                (Some((c, s)), true) => (c, s),
                _ => (&cos, &sin),
            };
            let mut shard = KvShard::new();
            shard.set_row_starts(starts.clone());
            let (q, k, v) = match &blk.mla {
                // DeepSeek: the latent rows, keys and values of one KV head, cached once, and
                // the absorbed decode's weights (crate::mla)
                Some(m) => {
                    let (q, k, v, latent) = m.qkv_rows(&blk.normed_input(&x)?, &blk.qkv, heads.0, (c, s))?;
                    shard.append_shared(&latent.detach(), rows)?;
                    cache.absorbed.push(Some(m.absorbed_weights(heads.0)?));
                    (q, k, v)
                }
                None => {
                    let (q, k, v) = blk.qkv_rope(&x, heads, (c, s))?;
                    shard.append(&k.detach(), &v.detach(), rows)?;
                    cache.absorbed.push(None);
                    (q, k, v)
                }
            };
            cache.layers.push(shard);
            let sinks = blk.sinks.as_ref().map(Sinks::new).transpose()?;
            let a = attend_sinks(&q, &k, &v, ctx, scale, docs, blk.window, sinks.as_ref())?;
            x = blk
                .finish(&x, &a.flatten_from(2)?)?
                .detach();
        }
        // the next token's logits: on the rank holding position T-1, zeros elsewhere, summed
        let v = self.cfg.vocab_size;
        let local = match rows.iter().position(|&p| p == t - 1) {
            Some(i) => {
                let h = self.final_norm(&x.narrow(1, i, 1)?)?;
                self.logits_whole(&h)?.reshape((b, v))?.to_dtype(DType::F32)?
            }
            None => Tensor::zeros((b, v), DType::F32, x.device())?,
        };
        let logits = ctx.cp.all_reduce(&local.contiguous()?)?;
        Ok((cache, logits.detach()))
    }

    /// One decode step: the tokens `[Bd]` (u32, this DP replica's rows, the same on every rank
    /// of the replica; `Bd = B` without DP) at global position
    /// `p = cache.next_position()` go through the model on every rank (replicated compute);
    /// each layer appends their k, v to the cache of rank [`decode_owner`]`(p, P)` first, then
    /// attends over the whole sharded cache ([`sharded_decode_attention_sinks`], sliding window
    /// honoured). Returns f32 logits `[B, V]` of position `p`, bitwise the same on every rank.
    /// Collective over the CP and TP groups.
    pub fn decode_step(&self, cache: &mut KvCache, tokens: &Tensor) -> Result<Tensor> {
        let ctx = &self.ctx;
        let b = cache.batch;
        if tokens.dims() != [b] || cache.layers.len() != self.cfg.num_hidden_layers || cache.absorbed.len() != cache.layers.len() {
            bail!(
                "Llama::decode_step: tokens {:?} must be [{b}] for a cache of B = {b} and {} layers ({} in the model)",
                tokens.dims(),
                cache.layers.len(),
                self.cfg.num_hidden_layers
            )
        }
        let ids = self.checked_ids(tokens, "Llama::decode_step")?;
        let p = cache.next;
        let owner = decode_owner(p, ctx.cp.size()) == ctx.cp.rank();
        let (heads, scale) = self.heads();
        let ((cos, sin), local) = self.decode_tables(p, &cache.starts, ids.device())?;
        // (the router log holds this step's routing only)
        self.router_log.clear();
        let mut x = self.embed_whole(&ids.reshape((b, 1))?)?;
        for ((blk, shard), absorbed) in self.generation_blocks()?.iter().zip(cache.layers.iter_mut()).zip(&cache.absorbed) {
            let (c, s) = match (&local, blk.local_rope) {
                (Some((c, s)), true) => (c, s),
                _ => (&cos, &sin),
            };
            if let Some(m) = &blk.mla {
                // DeepSeek: the latent row appended, the absorbed query over the latent cache
                let xn = blk.normed_input(&x)?;
                let Some(w) = absorbed else {
                    bail!("Llama::decode_step: layer of latent attention without its absorbed weights (a cache from another model?)")
                };
                if owner {
                    let row = m.latent_rows(&xn, (c, s))?.detach();
                    shard.append_shared(&row, &[p])?;
                }
                let qa = m.absorbed_query(&xn, &blk.qkv, heads.0, (c, s), w)?;
                let (a, _lse) = sharded_decode_attention_sinks(&qa, &[p], shard, &ctx.cp, scale, None, None)?;
                x = blk.finish(&x, &m.absorbed_out(&a, w)?)?.detach();
                continue;
            }
            let (q, k, v) = blk.qkv_rope(&x, heads, (c, s))?;
            if owner {
                shard.append(&k.detach(), &v.detach(), &[p])?;
            }
            let sinks = blk.sinks.as_ref().map(Sinks::new).transpose()?;
            let (a, _lse) = sharded_decode_attention_sinks(&q, &[p], shard, &ctx.cp, scale, blk.window, sinks.as_ref())?;
            // a sliding window never looks back past p + 2 - w again: drop those rows once
            // they are half of the shard (amortised: each row is copied O(1) times)
            if let Some(w) = blk.window {
                let dead = (p + 2).saturating_sub(w);
                if shard.count_before(dead) * 2 >= shard.len().max(2) {
                    shard.evict_before(dead)?;
                }
            }
            x = blk
                .finish(&x, &a.flatten_from(2)?)?
                .detach();
        }
        cache.next += 1;
        let h = self.final_norm(&x)?;
        Ok(self
            .logits_whole(&h)?
            .reshape((b, self.cfg.vocab_size))?
            .to_dtype(DType::F32)?
            .detach())
    }

    /// Greedy decoding of `new_tokens` tokens after `prompt` (global u32 ids `[B, T]`, the
    /// same on every rank; any `T ≥ 1`: see [`Llama::generate_until`]): [`Llama::prefill`],
    /// then `new_tokens - 1` [`Llama::decode_step`]s, each token the argmax of its logits. Every rank returns the same tokens. Collective over the world
    /// (CP, TP and DP groups).
    ///
    /// With DP each replica prefills and decodes its `B / dp` rows (its own KV cache); the
    /// logits are all-gathered over the DP group each step (`B · V` floats) so that every rank
    /// chooses all `B` tokens from the same `[B, V]` logits, in row order. Sampled tokens are
    /// therefore the single device's with the same seed, and every rank returns all `B` rows.
    pub fn generate_greedy(&self, prompt: &Tensor, new_tokens: usize) -> Result<Generation> {
        self.generate(prompt, new_tokens, Sampling::Greedy)
    }

    /// [`Llama::generate_greedy`] with the tokens chosen by `sampling` (greedy, or sampled
    /// with temperature / top-k / top-p from a seeded generator, module [`crate::sampling`]).
    /// Every rank holds the same logits and the same generator, so every rank draws the same
    /// tokens, and a single device with the same seed draws them too.
    pub fn generate(&self, prompt: &Tensor, new_tokens: usize, sampling: Sampling) -> Result<Generation> {
        self.generate_until(prompt, new_tokens, sampling, &[])
    }

    /// The multiple of which a prompt's length `T` suits this layout's prefill (sequence
    /// parallelism off): `2·cp` for zigzag, all-gather and 2-D (whose ring shards split over
    /// Ulysses: `2·ring·ulysses`), `cp` for ring, striped and Ulysses, 1 without CP.
    /// [`Llama::generate_until`] takes any `T`: it prefills the longest prefix of such a length
    /// and feeds the rest through decode steps.
    pub fn prompt_multiple(&self) -> usize {
        let l = &self.ctx.layout;
        let (outer, inner) = if l.cp_kind == crate::CpKind::TwoD { (l.ring, l.ulysses) } else { (l.cp, 1) };
        if outer <= 1 {
            return inner.max(1);
        }
        l.cp_kind.seq_layout().divisor(outer) * inner
    }

    /// An empty cache of `bd` rows (this DP replica's) for decoding from position 0, with the
    /// latent attention's absorbed weights.
    fn empty_cache(&self, bd: usize) -> Result<KvCache> {
        let (heads, _) = self.heads();
        let blocks = self.generation_blocks()?;
        let absorbed = blocks.iter().map(|b| b.mla.as_ref().map(|m| m.absorbed_weights(heads.0)).transpose()).collect::<Result<Vec<_>>>()?;
        Ok(KvCache { layers: vec![KvShard::new(); blocks.len()], absorbed, batch: bd, next: 0, starts: Vec::new() })
    }

    /// [`Llama::generate`] that ends each row at its first token in `stop` (kept as the row's
    /// last token; an end-of-sequence id, [`crate::stop_tokens`] reads a checkpoint's), at most
    /// `max_new_tokens` per row. Rows that stopped go on through the decode steps with their
    /// stop token (their cache rows are never read for them again) until every row has
    /// stopped, then generation ends: `logits` holds one `[B, V]` per step taken, as many as the
    /// longest row's tokens. Every rank holds all rows' tokens, so every rank stops at the same
    /// step (no collective). The prompt may have any length `T ≥ 1`: the longest prefix whose
    /// length suits the layout ([`Llama::prompt_multiple`]) is prefilled on it, the rest goes
    /// through decode steps (its predictions unused; the cache then holds every prompt token,
    /// the same as a whole prefill up to rounding). Errors name a stop id outside the
    /// vocabulary.
    pub fn generate_until(&self, prompt: &Tensor, max_new_tokens: usize, sampling: Sampling, stop: &[u32]) -> Result<Generation> {
        if let Some(&bad) = stop.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            bail!("Llama::generate_until: stop token {bad} out of range for vocab {} (stop {stop:?})", self.cfg.vocab_size)
        }
        let (bp, t) = match prompt.dims() {
            &[b, t] if b > 0 && t > 0 => (b, t),
            _ => bail!("Llama::generate_until: prompt must be [B, T] token ids with B, T >= 1, got {:?}", prompt.dims()),
        };
        let sampler = Sampler::new(sampling)?;
        let t0 = Instant::now();
        let whole = t - t % self.prompt_multiple();
        let dp = &self.ctx.dp;
        let (mut cache, mut local) = match whole {
            0 => {
                if !bp.is_multiple_of(dp.size()) {
                    bail!("Llama::generate_until: batch {bp} (prompt {:?}) not divisible by dp = {}", prompt.dims(), dp.size())
                }
                (self.empty_cache(bp / dp.size())?, None)
            }
            _ => {
                let (c, l) = self.prefill(&prompt.narrow(1, 0, whole)?)?;
                (c, Some(l))
            }
        };
        // the prompt's tail, one token per decode step (this replica's rows)
        let rows = prompt.narrow(0, dp.rank() * cache.batch, cache.batch)?;
        for i in whole..t {
            local = Some(self.decode_step(&mut cache, &rows.narrow(1, i, 1)?.squeeze(1)?.contiguous()?)?);
        }
        let Some(local) = local else { bail!("Llama::generate_until: internal error (no logits for prompt {:?})", prompt.dims()) };
        self.decode_rows(cache, local, t0, (max_new_tokens, sampler), stop)
    }
}

#[cfg(test)]
#[path = "generate_tests.rs"]
mod tests;
