//! [`Llama`]'s head and losses (a child module of `model.rs`: the model's fields are its own):
//! the logits (the vocabulary-parallel head over TP, Gemma 2's final soft cap), the per-token
//! loss through the head in chunks, the global mean loss, and the mixtures of experts'
//! load-balancing term.

use super::*;

impl Llama {
    /// Logits of this rank's tokens.
    ///
    /// `input_ids` `[B, Ts]` (u32), `positions` `[Ts]` their global positions (as returned by
    /// [`crate::shard_batch`]). Returns `[B, Ts, V]` in the weights' dtype.
    pub fn forward(&self, input_ids: &Tensor, positions: &Tensor) -> Result<Tensor> {
        self.forward_with(input_ids, positions, None)
    }

    /// [`Llama::forward`] with optional packed documents.
    pub(crate) fn forward_with(&self, input_ids: &Tensor, positions: &Tensor, docs: Option<&[Documents]>) -> Result<Tensor> {
        let h = self.head_input(self.hidden_with(input_ids, positions, docs)?)?;
        self.cap_logits(self.logits_of(&h)?)
    }

    /// The output logits soft-capped (Gemma 2's `final_logit_softcapping`), or as they are.
    pub(crate) fn cap_logits(&self, l: Tensor) -> Result<Tensor> {
        match self.cfg.final_logit_softcap() {
            Some(c) => crate::head_loss::cap_logits(&l, c),
            None => Ok(l),
        }
    }

    /// The uncapped logits `[B, Ts, V]` of final hidden states `h` `[B, Ts, h]`.
    fn logits_of(&self, h: &Tensor) -> Result<Tensor> {
        let h = h.clone();
        if !self.vocab_parallel() {
            return linear(&h, self.lm_head()?);
        }
        // this rank's vocabulary slice of the logits of the whole TP region, then all of them
        let (g, sp) = (&self.ctx.tp, self.ctx.layout.seq_parallel());
        let l = linear(&self.head_region(&h)?, self.lm_head()?)?.contiguous()?; // [B, Tc, ⌈V/P⌉]
        let all = if sp {
            // backward: reduce-scatter (each rank's loss saw only its own rows)
            let ts = h.dim(1)?;
            mappings::gather_from_sp_region(&l, g, 2)?.narrow(1, g.rank() * ts, ts)?
        } else {
            // backward: keep the own slice (every rank's loss saw every row)
            mappings::gather_from_sp_region_replicated_grad(&l, g, 2)?
        };
        // the padding columns of a vocabulary TP does not divide go (zero gradient)
        all.narrow(2, 0, self.cfg.vocab_size)
    }

    /// The LM head `[V, h]` (this rank's vocabulary rows, or the tied embedding); an error for a
    /// reward model, which has a score head instead ([`crate::reward`]).
    pub(crate) fn lm_head(&self) -> Result<&Tensor> {
        match self.cfg.num_labels {
            Some(n) => bail!("a reward model ({}, {n} label(s)) has no LM head: it scores sequences (Llama::scores_packed), it does not predict tokens", self.cfg.hf_class()),
            None => Ok(&self.lm_head),
        }
    }

    /// Whether the embedding and the LM head are split by vocabulary rows over TP
    /// ([`Shard::RowsPadded`]: `tp > 1` and at least `tp` tokens; padded to `tp·⌈V/tp⌉` rows
    /// when `tp` does not divide `V`; else they are replicated).
    pub(crate) fn vocab_parallel(&self) -> bool {
        Shard::RowsPadded(self.cfg.vocab_size).resolve(self.ctx.layout.tp) != Shard::Replicated
    }

    /// The embedding output times the config's factor (Gemma 3's `√h` in the weights' dtype).
    pub(crate) fn embed_scaled(&self, x: Tensor) -> Result<Tensor> {
        match self.cfg.embed_scale(self.embed.dtype())? {
            Some(s) => x.affine(s, 0.0),
            None => Ok(x),
        }
    }

    /// The head's input from final hidden states `h` `[B, T, h]`: times Granite's
    /// `1 / logits_scaling` (its logits divided, [`LlamaConfig::head_input_scale`]), else `h`.
    pub(crate) fn head_input(&self, h: Tensor) -> Result<Tensor> {
        match self.cfg.head_input_scale() {
            Some(s) => h.affine(s, 0.0),
            None => Ok(h),
        }
    }

    /// The final norm of `x` `[B, T, h]` as the head reads it ([`Llama::head_input`]).
    pub(crate) fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.head_input(self.norm.forward(x)?)
    }

    /// The TP group with sequence parallelism `sp`.
    pub(crate) fn tp_of(&self, sp: bool) -> Tp {
        Tp::new(self.ctx.tp.clone(), sp)
    }

    /// Final hidden states `[B, Ts, h]` → the TP region `[B, Tc, h]` the vocabulary-parallel
    /// head reads: all-gathered along T under SP (backward reduce-scatter), else through
    /// `copy_to_tp_region` (backward all-reduce). Either way the backward sums the head's
    /// partial input gradients over the TP ranks.
    fn head_region(&self, h: &Tensor) -> Result<Tensor> {
        if self.ctx.layout.seq_parallel() {
            mappings::gather_from_sp_region(h, &self.ctx.tp, 1)
        } else {
            mappings::copy_to_tp_region(h, &self.ctx.tp)
        }
    }

    /// Per-token next-token loss `-log p(label)` of this rank's tokens, f32 `[B, Ts]` (0 where
    /// the label is [`crate::IGNORE`]), differentiable, computed through the head in chunks of rows
    /// without materialising the logits ([`crate::head_loss::token_nll`]): the memory-lean
    /// path for long sequences and large vocabularies. The values equal those from
    /// [`Llama::forward`]'s logits (test `token_nll_equals_the_logits_path`).
    pub fn token_nll(&self, input_ids: &Tensor, labels: &Tensor, positions: &Tensor) -> Result<Tensor> {
        self.token_nll_with(input_ids, labels, positions, None)
    }

    /// [`Llama::token_nll`] with optional packed documents.
    pub(crate) fn token_nll_with(
        &self,
        input_ids: &Tensor,
        labels: &Tensor,
        positions: &Tensor,
        docs: Option<&[Documents]>,
    ) -> Result<Tensor> {
        Ok(self.token_nll_stats_with(input_ids, labels, positions, docs, None)?.0)
    }

    /// [`Llama::token_nll_with`] and, with `stat`, each token's statistic of the softmax
    /// ([`crate::head_loss::HeadStat`]), f32 `[B, Ts]`, detached.
    pub(crate) fn token_nll_stats_with(
        &self,
        input_ids: &Tensor,
        labels: &Tensor,
        positions: &Tensor,
        docs: Option<&[Documents]>,
        stat: Option<crate::head_loss::HeadStat>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let h = self.head_input(self.hidden_with(input_ids, positions, docs)?)?;
        let (b, ts, hd) = h.dims3()?;
        if labels.dims() != [b, ts] {
            bail!(
                "Llama::token_nll: labels {:?} must be [{b}, {ts}] for input_ids {:?}",
                labels.dims(),
                input_ids.dims()
            )
        }
        if self.vocab_parallel() {
            let (g, sp) = (&self.ctx.tp, self.ctx.layout.seq_parallel());
            let labels_region = if sp { gather_labels(labels, g)? } else { labels.to_dtype(DType::U32)? };
            let v = self.cfg.vocab_size;
            let chunk = crate::head_loss::default_chunk_rows(candle_cp_nn::padded_rows(v, g.size()));
            let (x, cap) = (self.head_region(&h)?, self.cfg.final_logit_softcap());
            return match stat {
                Some(st) => crate::head_loss::token_nll_vocab_parallel_stat(&x, self.lm_head()?, &labels_region, v, chunk, g, (sp, cap), st).map(|(n, q)| (n, Some(q))),
                None => Ok((crate::head_loss::token_nll_vocab_parallel(&x, self.lm_head()?, &labels_region, v, chunk, g, sp, cap)?, None)),
            };
        }
        let chunk = crate::head_loss::default_chunk_rows(self.cfg.vocab_size);
        let (x, labels) = (h.reshape((b * ts, hd))?, labels.flatten_all()?);
        let (nll, sq) = match stat {
            Some(st) => crate::head_loss::token_nll_stat(&x, self.lm_head()?, &labels, chunk, self.cfg.final_logit_softcap(), st).map(|(n, q)| (n, Some(q)))?,
            None => (crate::head_loss::token_nll(&x, self.lm_head()?, &labels, chunk, self.cfg.final_logit_softcap())?, None),
        };
        Ok((nll.reshape((b, ts))?, sq.map(|q| q.reshape((b, ts))).transpose()?))
    }

    /// Global mean next-token cross-entropy (differentiable), identical on every rank.
    ///
    /// `input_ids`, `labels` `[B, Ts]` and `positions` `[Ts]` from [`crate::shard_batch`].
    /// Returns `(loss, logits)`: `loss` is a scalar f32 `Σ_all ranks nll / #targets`; its
    /// backward on each rank yields this rank's share of the gradient (sum the shares with
    /// [`crate::reduce_gradients`]). A rank without targets contributes 0; if no rank has
    /// any target the loss is 0 (never 0/0).
    pub fn loss(
        &self,
        input_ids: &Tensor,
        labels: &Tensor,
        positions: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.loss_with(input_ids, labels, positions, None)
    }

    /// [`Llama::loss`] with optional packed documents.
    pub(crate) fn loss_with(
        &self,
        input_ids: &Tensor,
        labels: &Tensor,
        positions: &Tensor,
        docs: Option<&[Documents]>,
    ) -> Result<(Tensor, Tensor)> {
        let logits = self.forward_with(input_ids, positions, docs)?;
        let (terms, n) = local_nll(&logits, labels)?;
        let loss = global_mean(&terms, n, self.ctx.token_group())?;
        let loss = match self.router_aux_loss()? {
            Some(aux) => (loss + aux)?,
            None => loss,
        };
        Ok((loss, logits))
    }

    /// The routing balance of the last training forward's sparse layers, from the global
    /// batch's choices (summed over the DP × CP ranks): each layer's most-chosen expert's
    /// (token, slot) count over the mean count, averaged over the layers. 1 is balanced; `E/K`
    /// (top `K` of `E` experts) when every token chooses the same experts. Under expert
    /// parallelism the busiest expert's rank receives about that multiple of the mean rows in
    /// the all-to-all. Computed by [`Llama::router_aux_loss`] (same conditions, no
    /// communication of its own); `None` before it, or without the load-balancing term.
    pub fn expert_load(&self) -> Option<f64> {
        self.router_log.load()
    }

    /// How the last forward (training forward, [`Llama::prefill`] or [`Llama::decode_step`])
    /// routed this rank's tokens: for each sparse layer in run order, each expert's number of
    /// (token, slot) choices `[E]` (all `E` experts, whichever EP rank holds them; a layer's
    /// counts sum to its tokens times `K`). No communication: sum over the DP × CP ranks for
    /// the global batch (TP ranks route the same tokens). Read it after the forward and before
    /// the backward: a recomputing model routes its layers again in the backward and logs them
    /// again. Empty for a dense model.
    pub fn expert_counts(&self) -> Vec<Vec<usize>> {
        self.router_log.layer_counts().iter().map(|l| l.iter().map(|&c| c as usize).collect()).collect()
    }

    /// Qwen3-MoE's load-balancing term of the last training forward (`output_router_logits`):
    /// `router_aux_loss_coef · E · Σ_e f_e P_e` over every token of the global batch and every
    /// sparse layer (see `moe.rs`), a scalar f32 equal on every rank; `None` without
    /// experts or with `output_router_logits: false`. [`Llama::loss`] adds it; add it to a loss
    /// built from [`Llama::token_nll`] (the trainer does). Collective over the DP × CP ranks
    /// (every rank calls it after the forward, before the backward). It also hands the
    /// term's derivative to the sparse layers, whose backward adds it: the returned tensor is
    /// a constant, so the backward of `loss + aux` is right whether or not `aux` is in it,
    /// once this has been called.
    pub fn router_aux_loss(&self) -> Result<Option<Tensor>> {
        let Some(m) = &self.cfg.moe else { return Ok(None) };
        if !m.output_router_logits {
            return Ok(None);
        }
        let e = m.num_experts;
        let (counts, sums, rows) = self.router_log.stats();
        if counts.len() != e {
            bail!("Llama::router_aux_loss: no sparse layer logged its router since the last forward started (call it after a forward)")
        }
        // TP ranks route the same tokens: sum over the ranks of other tokens, DP × CP (each
        // layer's counts too, for the routing balance)
        let layers = self.router_log.layer_counts();
        let mut v: Vec<f32> = counts.iter().chain(&sums).map(|&x| x as f32).collect();
        v.push(rows as f32);
        v.extend(layers.iter().flatten().map(|&x| x as f32));
        let dev = self.embed.device();
        let n = v.len();
        let all: Vec<f32> = self.ctx.dp_cp.all_reduce(&Tensor::from_vec(v, n, dev)?)?.to_vec1()?;
        let (c, p, r) = (&all[..e], &all[e..2 * e], all[2 * e] as f64);
        let per_layer: Vec<Vec<f64>> = all[2 * e + 1..].chunks(e).map(|l| l.iter().map(|&x| x as f64).collect()).collect();
        if let Some(load) = crate::moe::load_balance(&per_layer) {
            self.router_log.set_load(load);
        }
        let coef = m.router_aux_loss_coef;
        let aux = e as f64 * c.iter().zip(p).map(|(&c, &p)| c as f64 * p as f64).sum::<f64>() / (r * r);
        // d(coef · aux) / d prob[n, e], shared out over the TP ranks (their sums add up)
        let tp = self.ctx.layout.tp as f64;
        let grad: Vec<f32> = c.iter().map(|&c| (coef * e as f64 * c as f64 / (r * r) / tp) as f32).collect();
        self.router_log.set_grad(Tensor::from_vec(grad, e, dev)?);
        Ok(Some(Tensor::new((coef * aux) as f32, dev)?))
    }
}
