//! The Llama decoder: embeddings, RMSNorm, RoPE on global positions, GQA attention through
//! the layout's (context-parallel) attention, SiLU- (GELU-, Gemma 3) gated MLP, tied or untied head, and the
//! globally reduced next-token loss.
//!
//! Shapes on one rank (`B` local batch, `Ts` tokens this rank embeds, `Tc` tokens of its CP
//! shard: `Ts = Tc / tp` under sequence parallelism, else `Ts = Tc`; `Hl = H / tp`,
//! `Hkvl = Hkv / tp` heads of its TP shard):
//! ids `[B, Ts]` → hidden `[B, Ts, h]` → (TP region `[B, Tc, ·]`) → logits `[B, Ts, V]`.

use crate::attn::attend_sinks;
use candle_cp_ops::attention::Sinks;
use crate::layer_build::LayerBuilder;
use crate::config::LlamaConfig;
use crate::layout::ParallelCtx;
use crate::fused::{rope_post, Activation};
use crate::rope::rope_tables_at;
use candle_core::{bail, DType, Module, Result, Tensor};
use candle_cp_nn::{vocab_parallel_embedding, ColumnParallelLinear, RmsNorm, RowParallelLinear, Shard, Tp};
use candle_cp_ops::mappings;
use crate::layout::IGNORE;
use crate::moe::{RouterLog, SparseMoe};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::recompute::Recompute;
use candle_nn::VarBuilder;
use std::sync::{Arc, Mutex};

/// `x @ w^T` for `x` `[B, T, in]`, `w` `[out, in]` → `[B, T, out]`.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (b, t, i) = x.dims3()?;
    let (o, wi) = w.dims2()?;
    if wi != i {
        bail!(
            "linear: input {:?} does not match weight {:?} ([out, in])",
            x.dims(),
            w.dims()
        )
    }
    x.reshape((b * t, i))?.matmul(&w.t()?)?.reshape((b, t, o))
}

/// The labels `[B, Ts]` of every SP rank of the TP group, `[B, Ts·P]` u32 ([`IGNORE`]
/// included; they travel as f32, exact for labels below 2^24).
fn gather_labels(labels: &Tensor, g: &candle_cp_comm::Group) -> Result<Tensor> {
    let (b, ts) = labels.dims2()?;
    let v: Vec<f32> = labels.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?.iter().map(|&l| if l == IGNORE { -1.0 } else { l as f32 }).collect();
    let all = g.all_gather(&Tensor::from_vec(v, (b, ts), labels.device())?, 1)?;
    let (b2, t2) = all.dims2()?;
    let back: Vec<u32> = all.flatten_all()?.to_vec1::<f32>()?.iter().map(|&l| if l < 0.0 { IGNORE } else { l as u32 }).collect();
    Tensor::from_vec(back, (b2, t2), labels.device())
}

pub use crate::fused::rms_norm;
pub(crate) use crate::qk_norm::QkNorm;
pub use crate::loss::{global_mean, local_nll};

#[path = "block.rs"]
mod block;
pub(crate) use block::{Block, BlockEnv, Mlp};

/// A Llama-style causal LM on one rank of a [`ParallelCtx`]. Weights are this rank's
/// shards (see [`crate::params`]), held by the `VarBuilder`'s `VarMap` under HF names.
///
/// The decoder layers are candle-cp-nn layers on the TP group (`ctx.tp`, sequence parallel
/// when [`crate::Layout::seq_parallel`]): q/k/v and gate/up are fused
/// [`ColumnParallelLinear`]s, o/down [`RowParallelLinear`]s, the norms [`RmsNorm`] with
/// [`candle_cp_nn::GradSync::Deferred`] (their TP share of the gradient is summed by
/// [`crate::reduce_gradients`] with the DP/CP sums, in one bucketed all-reduce).
pub struct Llama {
    pub(crate) cfg: LlamaConfig,
    pub(crate) ctx: ParallelCtx,
    pub(crate) embed: Tensor,
    pub(crate) blocks: Vec<Arc<Block>>,
    /// A quantized base's layers, built in each forward ([`Llama::new_quantized`]; `blocks`
    /// is then empty).
    lazy: Option<Arc<LayerBuilder<'static>>>,
    /// `Some`: layers are checkpointed (recomputed in backward), see [`Llama::with_recompute`].
    recompute: Option<Recompute>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Tensor,
    /// A reward model's score head `[n, h]` ([`LlamaConfig::num_labels`], [`crate::reward`]).
    pub(crate) score: Option<Tensor>,
    /// A token classifier's score bias `[n]` ([`LlamaConfig::token_classifier`], [`crate::prm`]).
    pub(crate) score_bias: Option<Tensor>,
    /// See [`Llama::set_param_hook`].
    param_hook: Mutex<Option<ParamHook>>,
    /// The sparse layers' router statistics of the last forward ([`Llama::router_aux_loss`]).
    pub(crate) router_log: RouterLog,
    /// The token indices the LoRA adapters' dropout masks are drawn for
    /// ([`Llama::set_lora_dropout`]).
    lora_rows: candle_cp_nn::DropoutRows,
}

/// Called by the forward with group `k` ([`crate::param_group`]) before it first uses the
/// parameters of that group; an error stops the forward. See [`Llama::set_param_hook`].
pub type ParamHook = Arc<dyn Fn(usize) -> Result<()> + Send + Sync>;

impl Llama {
    /// Build (or fetch from a `VarMap`-backed `vb`) this rank's weights, HF names, local
    /// shapes from [`crate::params::param_specs`]. With a fresh `VarMap` the weights are
    /// initialised per rank by candle (matrices `N(0, 0.02²)`, norms 1): use
    /// [`crate::init_params`] + [`crate::shard_params`] for replicated weights that agree
    /// across ranks.
    pub fn new(vb: VarBuilder, cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<Self> {
        Self::check_layout(cfg, ctx)?;
        let router_log = RouterLog::default();
        let lb = LayerBuilder::new(vb, cfg, ctx, router_log.clone());
        let blocks = (0..cfg.num_hidden_layers).map(|i| lb.block(i).map(Arc::new)).collect::<Result<Vec<_>>>()?;
        Self::assemble(&lb, cfg, ctx, blocks, None, router_log)
    }

    /// A LoRA model over a quantized frozen base ([`crate::quant`]): its decoder layers are
    /// built anew in every forward (and recomputation) from weights dequantized to `dtype` on
    /// `device`, so between steps only the codes are held; with [`Llama::with_recompute`] at
    /// most one layer's dequantized weights are alive at a time. Computes as
    /// [`Llama::new`] over the dequantized weights.
    pub fn new_quantized(base: &crate::quant::QuantBase, dtype: DType, device: &candle_core::Device, cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<Self> {
        Self::check_layout(cfg, ctx)?;
        if cfg.lora.is_none() {
            bail!("Llama::new_quantized: the config has no LoRA adapters (a quantized base is frozen)")
        }
        let router_log = RouterLog::default();
        let lb = LayerBuilder::new(VarBuilder::from_backend(base.backend(), dtype, device.clone()), cfg, ctx, router_log.clone());
        // every layer built once here: the shapes and names checked now, not in a forward
        for i in 0..cfg.num_hidden_layers {
            lb.block(i)?;
        }
        Self::assemble(&lb, cfg, ctx, Vec::new(), Some(Arc::new(lb.clone())), router_log)
    }

    /// A model over a quantized base ([`Llama::new_quantized`]) read without its adapters: the
    /// same codes, nothing copied (PEFT's disabled adapters; GRPO's KL reference of a QLoRA
    /// run; with DoRA, the base weights unscaled, as PEFT's). `None` for any other model, and
    /// for one whose embedding or head are trained whole (`modules_to_save`: the base's copies
    /// are not kept).
    pub fn quantized_base(&self) -> Result<Option<Self>> {
        let (Some(lb), Some(lora)) = (&self.lazy, &self.cfg.lora) else { return Ok(None) };
        if !lora.modules_to_save.is_empty() {
            return Ok(None);
        }
        let cfg = LlamaConfig { lora: None, ..self.cfg.clone() };
        let router_log = RouterLog::default();
        let base = LayerBuilder::new(lb.vb().clone(), &cfg, &self.ctx, router_log.clone());
        for i in 0..cfg.num_hidden_layers {
            base.block(i)?;
        }
        Ok(Some(Self::assemble(&base, &cfg, &self.ctx, Vec::new(), Some(Arc::new(base.clone())), router_log)?))
    }

    /// The embedding, final norm and head from `lb`, with the layers `blocks` (or built by
    /// `lazy` in each forward).
    fn assemble(lb: &LayerBuilder, cfg: &LlamaConfig, ctx: &ParallelCtx, blocks: Vec<Arc<Block>>, lazy: Option<Arc<LayerBuilder<'static>>>, router_log: RouterLog) -> Result<Self> {
        let embed = lb.get("model.embed_tokens.weight")?;
        let norm = lb.norm(lb.vb().pp("model.norm"))?;
        // (a reward model has no LM head: its score head instead, and `lm_head` is never read —
        // Llama::lm_head refuses)
        let score = cfg.num_labels.map(|_| lb.get(crate::reward::SCORE)).transpose()?;
        let score_bias = cfg.token_classifier.filter(|t| t.bias).map(|_| lb.get(crate::prm::SCORE_BIAS)).transpose()?;
        let lm_head = if cfg.tie_word_embeddings || score.is_some() {
            embed.clone()
        } else {
            lb.get("lm_head.weight")?
        };
        Ok(Self {
            cfg: cfg.clone(),
            ctx: ctx.clone(),
            embed,
            blocks,
            lazy,
            recompute: None,
            norm,
            lm_head,
            score,
            score_bias,
            param_hook: Mutex::new(None),
            router_log,
            lora_rows: lb.lora_rows.clone(),
        })
    }

    /// Dropout on the LoRA adapters' inputs ([`crate::LoraSpec::dropout`]) in the next
    /// forwards (and their recomputations): `Some((streams, step, b, t))` draws the masks of
    /// forward `step` (e.g. the optimizer step's micro-batch, numbered consecutively) for this
    /// rank's tokens of a global batch `[b, t]` ([`crate::layout::token_indices`]: every layout
    /// drops what one device drops); `None` (the default): no dropout, as evaluation and
    /// generation want. Nothing happens for a model without LoRA dropout.
    pub fn set_lora_dropout(&self, key: Option<(candle_cp_nn::RngStreams, u64, usize, usize)>) -> Result<()> {
        let key = match key {
            Some((streams, step, b, t)) if self.cfg.lora.as_ref().is_some_and(|l| l.dropout > 0.0) => {
                let rows = crate::layout::token_indices(b, t, &self.ctx)?;
                let batch = b / self.ctx.layout.dp;
                Some(candle_cp_nn::DropoutKey { streams, step, tc: rows.len() / batch.max(1), rows: Arc::new(rows), batch })
            }
            _ => None,
        };
        self.lora_rows.set(key)
    }

    /// The decoder layers (a quantized base's built now from its dequantized weights).
    pub(crate) fn layer_blocks(&self) -> Result<Vec<Arc<Block>>> {
        match &self.lazy {
            None => Ok(self.blocks.clone()),
            Some(lb) => (0..self.cfg.num_hidden_layers).map(|i| lb.block(i).map(Arc::new)).collect(),
        }
    }

    /// The config's and the layout's checks, before any weight is read.
    fn check_layout(cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<()> {
        cfg.validate()?;
        ctx.layout
            .validate(cfg.num_attention_heads, cfg.num_key_value_heads)?;
        if ctx.layout.ep > 1 {
            match &cfg.moe {
                None => bail!("Llama::new: layout {} has ep = {}, the model has no experts (a dense config)", ctx.layout, ctx.layout.ep),
                Some(m) if !m.num_experts.is_multiple_of(ctx.layout.ep) => {
                    bail!("Llama::new: ep = {} does not divide the {} experts (layout {})", ctx.layout.ep, m.num_experts, ctx.layout)
                }
                _ => {}
            }
        }
        let tp_size = ctx.layout.tp;
        if ctx.tp.size() != tp_size {
            bail!(
                "Llama::new: TP group of {} ranks, layout {} has tp = {tp_size}",
                ctx.tp.size(),
                ctx.layout
            )
        }
        Ok(())
    }

    /// Call `hook(k)` in every training forward ([`Llama::forward`], [`Llama::hidden`],
    /// [`Llama::token_nll`], [`Llama::loss`] and their packed forms; not generation's prefill
    /// and decode) before the parameters of group `k` are first used ([`crate::param_group`]:
    /// 0 before the embedding, `1 + i` before layer `i`, `L + 1` before the final norm; in
    /// that order); `None` removes it. The trainer waits there for
    /// each layer's ZeRO all-gather ([`crate::train::PendingParams`]), so that the later
    /// layers' parameters travel while the earlier layers compute. The backward's
    /// recomputation of a layer does not call it (its forward did).
    pub fn set_param_hook(&self, hook: Option<ParamHook>) {
        *self.param_hook.lock().unwrap_or_else(|e| e.into_inner()) = hook;
    }

    /// Activation recomputation of every decoder layer (`on`), or none (default).
    ///
    /// On: the forward keeps only each layer's input `[B, Ts, h]` instead of all its
    /// intermediate tensors, and the backward reruns each layer (one more forward of the
    /// layers, collectives included). Take gradients with [`Llama::backward`], which adds
    /// the layers' parameter gradients that `loss.backward()` alone cannot see (the next
    /// forward refuses to run if they were left uncollected). Gradients equal the plain
    /// run's (test `recompute_matches_plain_on_every_layout`).
    pub fn with_recompute(mut self, on: bool) -> Self {
        self.recompute = on.then(Recompute::new);
        self
    }

    /// The same model for inference with every LoRA / DoRA adapter merged into its weight on each
    /// rank (`W + s·B·A`, DoRA's `m / ‖W + s·B·A‖ ⊙ (W + s·B·A)`; detached: nothing left to
    /// train): the same logits without the adapters' work in every forward — DoRA builds its
    /// weights once here instead of in every decode step. Collective over TP (DoRA's row norms
    /// of a row-parallel weight). A model over a quantized base (its layers built in every
    /// forward) is returned as it is.
    pub fn with_adapters_merged(mut self) -> Result<Self> {
        if self.lazy.is_some() || self.cfg.lora.is_none() {
            return Ok(self);
        }
        self.blocks = self.blocks.iter().map(|b| Ok(Arc::new(b.with_adapters_merged()?))).collect::<Result<_>>()?;
        Ok(self)
    }

    /// Whether layers are recomputed in backward.
    pub fn recomputes(&self) -> bool {
        self.recompute.is_some()
    }

    /// The store of the recomputed layers' gradients (`None` without recompute): set a
    /// [`candle_cp_ops::recompute::Recompute::set_block_hook`] on it to see each layer's
    /// gradients as soon as the backward is done with the layer.
    pub fn recompute_store(&self) -> Option<&Recompute> {
        self.recompute.as_ref()
    }

    /// Gradients of `loss` (from [`Llama::loss`] or anything built on [`Llama::forward`]):
    /// `loss.backward()`, plus the parameter gradients of recomputed layers.
    pub fn backward(&self, loss: &Tensor) -> Result<candle_core::backprop::GradStore> {
        match &self.recompute {
            Some(rc) => rc.backward(loss),
            None => loss.backward(),
        }
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The parallel context.
    pub fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    /// RoPE positions of the CP shard, host, one row (`positions` `[Ts]`) or one per batch
    /// row (`[B, Ts]`), each `[Tc]`, gathering the SP shards if needed.
    pub(crate) fn cp_positions(&self, positions: &Tensor) -> Result<Vec<Vec<u32>>> {
        let l = &self.ctx.layout;
        let pos = positions.to_dtype(DType::U32)?;
        let pos = if pos.rank() == 1 { pos.unsqueeze(0)? } else { pos };
        if l.seq_parallel() {
            // positions < 2^24 are exact in f32 (collectives need a float dtype everywhere)
            let all = self.ctx.tp.all_gather(&pos.to_dtype(DType::F32)?.contiguous()?, 1)?;
            all.to_dtype(DType::U32)?.to_vec2::<u32>()
        } else {
            pos.to_vec2::<u32>()
        }
    }

    /// The sequence length RoPE's frequencies follow, per row of `pos` (transformers: the
    /// largest position id + 1 of the forward's batch): over the whole CP group under
    /// LongRoPE, whose factors switch at the original length — a shard's own largest position
    /// would give rank 0 of a contiguous ring the short factors while the others use the long
    /// ones. Per row, not per batch: unpacked rows share their positions (the batch's value),
    /// and a packed row's choice (its longest document's) does not depend on the rows beside
    /// it, so splitting the batch over DP replicas or micro-batches changes nothing. No
    /// collective for the other scalings, which do not depend on it.
    fn rope_seq_lens(&self, pos: &[Vec<u32>], dev: &candle_core::Device) -> Result<Vec<usize>> {
        let local: Vec<usize> = pos.iter().map(|p| p.iter().max().map_or(0, |&m| m as usize + 1)).collect();
        if !matches!(self.cfg.rope_scaling, crate::config::RopeScaling::LongRope { .. }) || self.ctx.cp.size() == 1 {
            return Ok(local);
        }
        // (lengths < 2^24 are exact in f32; every CP rank holds the same rows)
        let mine: Vec<f32> = local.iter().map(|&l| l as f32).collect();
        let all = self.ctx.cp.all_gather(&Tensor::from_vec(mine, (1, local.len()), dev)?, 0)?;
        Ok(all.max(0)?.to_vec1::<f32>()?.into_iter().map(|l| l as usize).collect())
    }

    /// Final hidden states of this rank's tokens (after the last norm, before the head):
    /// `[B, Ts, h]` in the weights' dtype. `input_ids`, `positions` as for [`Llama::forward`].
    pub fn hidden(&self, input_ids: &Tensor, positions: &Tensor) -> Result<Tensor> {
        self.hidden_with(input_ids, positions, None)
    }

    /// [`Llama::hidden`] with optional packed documents (see [`Llama::hidden_packed`]):
    /// `positions` `[Ts]`, or `[B, Ts]` with documents.
    pub(crate) fn hidden_with(&self, input_ids: &Tensor, positions: &Tensor, docs: Option<&[Documents]>) -> Result<Tensor> {
        let (b, ts) = input_ids.dims2()?;
        candle_cp_comm::ensure_nonempty("Llama::hidden", "input_ids", input_ids)?;
        let per_row = docs.is_some() && positions.dims() == [b, ts];
        if positions.dims() != [ts] && !per_row {
            let what = if docs.is_some() { "Llama::hidden_packed" } else { "Llama::hidden" };
            let alt = if docs.is_some() { format!(" or [{b}, {ts}]") } else { String::new() };
            bail!(
                "{what}: positions {:?} must be [{ts}]{alt} for input_ids {:?}",
                positions.dims(),
                input_ids.dims()
            )
        }
        let cfg = &self.cfg;
        let (tp, d) = (self.ctx.layout.tp, cfg.head_dim);
        // the KV heads (copies) this TP rank's query heads use: lcm(Hkv, tp) / tp
        let (hl, hkvl) = (cfg.num_attention_heads / tp, candle_cp_nn::blocks_per_rank(cfg.num_key_value_heads, tp));
        let mut pos = self.cp_positions(positions)?;
        if pos.is_empty() {
            bail!("Llama::hidden_packed: empty batch (input_ids {:?})", input_ids.dims())
        }
        // (each row's length over the CP group before rows are merged: the ranks hold the same rows)
        let mut seq_lens = self.rope_seq_lens(&pos, input_ids.device())?;
        if pos.iter().zip(&seq_lens).all(|(p, l)| *p == pos[0] && *l == seq_lens[0]) {
            pos.truncate(1);
            seq_lens.truncate(1);
        }
        // one pair of tables in the activations' dtype for every layer: [Tc, D], or [B, Tc, D]
        // with a table per row
        let act = self.embed.dtype();
        let tables_of = |cfg: &LlamaConfig| -> Result<(Tensor, Tensor)> {
            let tables = pos
                .iter()
                .zip(&seq_lens)
                .map(|(p, &seq_len)| rope_tables_at(cfg, p, seq_len, DType::F32, input_ids.device()))
                .collect::<Result<Vec<_>>>()?;
            Ok(match tables.as_slice() {
                [(cos, sin)] => (cos.to_dtype(act)?, sin.to_dtype(act)?),
                rows => {
                    let (c, s): (Vec<Tensor>, Vec<Tensor>) = rows.iter().cloned().unzip();
                    (Tensor::stack(&c, 0)?.to_dtype(act)?, Tensor::stack(&s, 0)?.to_dtype(act)?)
                }
            })
        };
        let rope = tables_of(cfg)?;
        // Gemma 3's sliding layers: their own base, unscaled
        let rope_local = match cfg.local_rope() {
            Some(local) => Some(tables_of(&local)?),
            None => None,
        };
        let tc = pos[0].len();
        let docs = match docs {
            None => None,
            Some(docs) => Some(crate::packed::check_docs(docs, b, tc * self.ctx.layout.cp, input_ids)?),
        };
        let scale = cfg.attn_scores();
        // vocabulary-parallel lookup (a plain one when the table is replicated); it refuses
        // ids outside the vocabulary, naming them
        let ids = input_ids.to_dtype(DType::U32)?;
        let hook = self.param_hook.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let params_ready = |k: usize| hook.as_ref().map_or(Ok(()), |h| h(k));
        params_ready(0)?;
        self.router_log.clear();
        let mut x = self.embed_scaled(vocab_parallel_embedding(&ids, &self.embed, cfg.vocab_size, &self.tp_of(self.ctx.layout.seq_parallel()))?)?;
        let env = Arc::new(BlockEnv {
            ctx: self.ctx.clone(),
            rope,
            rope_local,
            dims: [b, tc, hl, hkvl, d],
            scale,
            docs,
        });
        if let Some(rc) = &self.recompute {
            if !rc.is_empty() {
                bail!("Llama::hidden: the previous backward's gradients of recomputed layers were never collected: use Llama::backward(&loss), not loss.backward(), when recompute is on")
            }
        }
        let n = self.cfg.num_hidden_layers;
        for i in 0..n {
            params_ready(1 + i)?;
            x = match (&self.recompute, &self.lazy) {
                (Some(rc), None) => {
                    let (blk, env) = (self.blocks[i].clone(), env.clone());
                    rc.checkpoint("llama_layer", &x, Arc::new(move |x: &Tensor| blk.forward(x, &env)))?
                }
                // built inside the checkpoint: its dequantized weights live while it runs
                (Some(rc), Some(lb)) => {
                    let (lb, env) = (lb.clone(), env.clone());
                    rc.checkpoint("llama_layer", &x, Arc::new(move |x: &Tensor| lb.block(i)?.forward(x, &env)))?
                }
                (None, None) => self.blocks[i].forward(&x, &env)?,
                (None, Some(lb)) => lb.block(i)?.forward(&x, &env)?,
            };
        }
        params_ready(1 + n)?;
        self.norm.forward(&x)
    }
}

#[path = "model_head.rs"]
mod head;


#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
