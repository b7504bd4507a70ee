//! The Llama decoder: embeddings, RMSNorm, RoPE on global positions, GQA attention through
//! the layout's (context-parallel) attention, SiLU-gated MLP, tied or untied head, and the
//! globally reduced next-token loss.
//!
//! Shapes on one rank (`B` local batch, `Ts` tokens this rank embeds, `Tc` tokens of its CP
//! shard: `Ts = Tc / tp` under sequence parallelism, else `Ts = Tc`; `Hl = H / tp`,
//! `Hkvl = Hkv / tp` heads of its TP shard):
//! ids `[B, Ts]` → hidden `[B, Ts, h]` → (TP region `[B, Tc, ·]`) → logits `[B, Ts, V]`.

use crate::attn::attend_window;
use crate::config::LlamaConfig;
use crate::layout::ParallelCtx;
use crate::params::param_specs;
use crate::rope::{apply_rope, rope_tables};
use candle_core::{bail, DType, Module, Result, Tensor};
use candle_cp_nn::{ColumnParallelLinear, GradSync, LinearConfig, RmsNorm, RowParallelLinear, Tp};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::recompute::Recompute;
use candle_nn::{Init, VarBuilder};
use std::sync::Arc;

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

pub use crate::fused::rms_norm;
pub use crate::loss::{global_mean, local_nll};

/// One decoder layer from candle-cp-nn layers (they hold the TP/SP logic: input gathers,
/// output reductions, norm weights on sequence shards).
pub(crate) struct Block {
    pub(crate) input_norm: RmsNorm,
    pub(crate) post_norm: RmsNorm,
    /// `q_proj`, `k_proj`, `v_proj` fused: one input gather (SP) for the three.
    pub(crate) qkv: ColumnParallelLinear,
    pub(crate) o: RowParallelLinear,
    /// `gate_proj`, `up_proj` fused: one input gather.
    pub(crate) gate_up: ColumnParallelLinear,
    pub(crate) down: RowParallelLinear,
}

/// What every layer of one forward shares: the parallel context, RoPE tables `(cos, sin)`
/// `[Tc, D]` of the CP shard's positions (one pair shared by every row, or one per row),
/// `[B, Tc, Hl, Hkvl, D]`, the softmax scale, the packed documents (one shared or one per
/// row; `None`: each row is one sequence) and the sliding window (`None`: plain causal).
struct BlockEnv {
    ctx: ParallelCtx,
    rope: Vec<(Tensor, Tensor)>,
    dims: [usize; 5],
    scale: f64,
    docs: Option<Vec<Documents>>,
    window: Option<usize>,
}

impl BlockEnv {
    /// RoPE of `x` `[B, Tc, H, D]` with the shared tables, or row by row.
    fn rope(&self, x: &Tensor) -> Result<Tensor> {
        match self.rope.as_slice() {
            [(cos, sin)] => apply_rope(x, cos, sin),
            rows => {
                let parts = rows
                    .iter()
                    .enumerate()
                    .map(|(i, (cos, sin))| apply_rope(&x.narrow(0, i, 1)?, cos, sin))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)
            }
        }
    }
}

impl Block {
    /// One decoder layer: `x` `[B, Ts, h]` → `[B, Ts, h]`.
    fn forward(&self, x: &Tensor, env: &BlockEnv) -> Result<Tensor> {
        let [b, tc, hl, hkvl, d] = env.dims;
        // TP region [B, Tc, ·] between the column- and row-parallel layers
        let qkv = self.qkv.forward_parts(&self.input_norm.forward(x)?)?;
        let q = qkv[0].reshape((b, tc, hl, d))?;
        let k = qkv[1].reshape((b, tc, hkvl, d))?;
        let v = qkv[2].reshape((b, tc, hkvl, d))?;
        let q = env.rope(&q)?;
        let k = env.rope(&k)?;
        let a = attend_window(&q, &k, &v, &env.ctx, env.scale, env.docs.as_deref(), env.window)?.reshape((b, tc, hl * d))?;
        let x = (x + self.o.forward(&a)?)?;
        let gu = self.gate_up.forward_parts(&self.post_norm.forward(&x)?)?;
        let m = (gu[0].silu()? * &gu[1])?;
        x + self.down.forward(&m)?
    }
}

/// A Llama-style causal LM on one rank of a [`ParallelCtx`]. Weights are this rank's
/// shards (see [`crate::params`]), held by the `VarBuilder`'s `VarMap` under HF names.
///
/// The decoder layers are candle-cp-nn layers on the TP group (`ctx.tp`, sequence parallel
/// when [`crate::Layout::seq_parallel`]): q/k/v and gate/up are fused
/// [`ColumnParallelLinear`]s, o/down [`RowParallelLinear`]s, the norms [`RmsNorm`] with
/// [`GradSync::Deferred`] (their TP share of the gradient is summed by
/// [`crate::reduce_gradients`] with the DP/CP sums, in one bucketed all-reduce).
pub struct Llama {
    pub(crate) cfg: LlamaConfig,
    pub(crate) ctx: ParallelCtx,
    pub(crate) embed: Tensor,
    pub(crate) blocks: Vec<Arc<Block>>,
    /// `Some`: layers are checkpointed (recomputed in backward), see [`Llama::with_recompute`].
    recompute: Option<Recompute>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Tensor,
}

impl Llama {
    /// Build (or fetch from a `VarMap`-backed `vb`) this rank's weights, HF names, local
    /// shapes from [`crate::params::param_specs`]. With a fresh `VarMap` the weights are
    /// initialised per rank by candle (matrices `N(0, 0.02²)`, norms 1): use
    /// [`crate::init_params`] + [`crate::shard_params`] for replicated weights that agree
    /// across ranks.
    pub fn new(vb: VarBuilder, cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<Self> {
        cfg.validate()?;
        ctx.layout
            .validate(cfg.num_attention_heads, cfg.num_key_value_heads)?;
        let tp_size = ctx.layout.tp;
        if ctx.tp.size() != tp_size {
            bail!(
                "Llama::new: TP group of {} ranks, layout {} has tp = {tp_size}",
                ctx.tp.size(),
                ctx.layout
            )
        }
        let tp = Tp::new(ctx.tp.clone(), ctx.layout.seq_parallel());
        let mut specs = std::collections::HashMap::new();
        for s in param_specs(cfg) {
            specs.insert(s.name.clone(), s);
        }
        // HF init: matrices N(0, 0.02²) (norms: ones, by RmsNorm)
        let init = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let get = |name: &str| -> Result<Tensor> {
            let Some(s) = specs.get(name) else {
                bail!("Llama::new: no parameter spec for {name}")
            };
            vb.get_with_hints(s.local_shape(tp_size)?, name, init)
        };
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let (qd, kd) = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        );
        let lin = LinearConfig::new(false).with_init(init);
        let norm = |vb: VarBuilder| -> Result<RmsNorm> {
            Ok(RmsNorm::new(vb, h, eps, &tp)?.with_grad_sync(GradSync::Deferred))
        };
        let embed = get("model.embed_tokens.weight")?;
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let vl = vb.pp(format!("model.layers.{i}"));
            let (va, vm) = (vl.pp("self_attn"), vl.pp("mlp"));
            let qkv = [
                (va.pp("q_proj"), qd),
                (va.pp("k_proj"), kd),
                (va.pp("v_proj"), kd),
            ];
            let gate_up = [
                (vm.pp("gate_proj"), cfg.intermediate_size),
                (vm.pp("up_proj"), cfg.intermediate_size),
            ];
            blocks.push(Arc::new(Block {
                input_norm: norm(vl.pp("input_layernorm"))?,
                qkv: ColumnParallelLinear::new_fused(&qkv, h, lin, &tp)?,
                o: RowParallelLinear::new(va.pp("o_proj"), qd, h, lin, &tp)?,
                post_norm: norm(vl.pp("post_attention_layernorm"))?,
                gate_up: ColumnParallelLinear::new_fused(&gate_up, h, lin, &tp)?,
                down: RowParallelLinear::new(
                    vm.pp("down_proj"),
                    cfg.intermediate_size,
                    h,
                    lin,
                    &tp,
                )?,
            }));
        }
        let norm = norm(vb.pp("model.norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            get("lm_head.weight")?
        };
        Ok(Self {
            cfg: cfg.clone(),
            ctx: ctx.clone(),
            embed,
            blocks,
            recompute: None,
            norm,
            lm_head,
        })
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

    /// Whether layers are recomputed in backward.
    pub fn recomputes(&self) -> bool {
        self.recompute.is_some()
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

    /// Final hidden states of this rank's tokens (after the last norm, before the head):
    /// `[B, Ts, h]` in the weights' dtype. `input_ids`, `positions` as for [`Llama::forward`].
    pub fn hidden(&self, input_ids: &Tensor, positions: &Tensor) -> Result<Tensor> {
        self.hidden_with(input_ids, positions, None)
    }

    /// [`Llama::hidden`] with optional packed documents (see [`Llama::hidden_packed`]):
    /// `positions` `[Ts]`, or `[B, Ts]` with documents.
    pub(crate) fn hidden_with(&self, input_ids: &Tensor, positions: &Tensor, docs: Option<&[Documents]>) -> Result<Tensor> {
        let (b, ts) = input_ids.dims2()?;
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
        let (hl, hkvl) = (cfg.num_attention_heads / tp, cfg.num_key_value_heads / tp);
        let mut pos = self.cp_positions(positions)?;
        if pos.is_empty() {
            bail!("Llama::hidden_packed: empty batch (input_ids {:?})", input_ids.dims())
        }
        if pos.iter().all(|p| *p == pos[0]) {
            pos.truncate(1);
        }
        let rope = pos
            .iter()
            .map(|p| rope_tables(cfg, p, DType::F32, input_ids.device()))
            .collect::<Result<Vec<_>>>()?;
        let tc = pos[0].len();
        let docs = match docs {
            None => None,
            Some(docs) => Some(crate::packed::check_docs(docs, b, tc * self.ctx.layout.cp, input_ids)?),
        };
        let scale = 1.0 / (d as f64).sqrt();
        let ids = input_ids.to_dtype(DType::U32)?.flatten_all()?;
        if ids.elem_count() > 0 {
            let max = ids.max(0)?.to_scalar::<u32>()? as usize;
            if max >= cfg.vocab_size {
                bail!(
                    "Llama::hidden: token id {max} out of range for vocab {} (input_ids {:?})",
                    cfg.vocab_size,
                    input_ids.dims()
                )
            }
        }
        let mut x = self
            .embed
            .index_select(&ids, 0)?
            .reshape((b, ts, cfg.hidden_size))?;
        let env = Arc::new(BlockEnv {
            ctx: self.ctx.clone(),
            rope,
            dims: [b, tc, hl, hkvl, d],
            scale,
            docs,
            window: cfg.sliding_window,
        });
        if let Some(rc) = &self.recompute {
            if !rc.is_empty() {
                bail!("Llama::hidden: the previous backward's gradients of recomputed layers were never collected: use Llama::backward(&loss), not loss.backward(), when recompute is on")
            }
        }
        for blk in &self.blocks {
            x = match &self.recompute {
                Some(rc) => {
                    let (blk, env) = (blk.clone(), env.clone());
                    rc.checkpoint(
                        "llama_layer",
                        &x,
                        Arc::new(move |x: &Tensor| blk.forward(x, &env)),
                    )?
                }
                None => blk.forward(&x, &env)?,
            };
        }
        self.norm.forward(&x)
    }

    /// Logits of this rank's tokens.
    ///
    /// `input_ids` `[B, Ts]` (u32), `positions` `[Ts]` their global positions (as returned by
    /// [`crate::shard_batch`]). Returns `[B, Ts, V]` in the weights' dtype.
    pub fn forward(&self, input_ids: &Tensor, positions: &Tensor) -> Result<Tensor> {
        self.forward_with(input_ids, positions, None)
    }

    /// [`Llama::forward`] with optional packed documents.
    pub(crate) fn forward_with(&self, input_ids: &Tensor, positions: &Tensor, docs: Option<&[Documents]>) -> Result<Tensor> {
        linear(&self.hidden_with(input_ids, positions, docs)?, &self.lm_head)
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
        let h = self.hidden_with(input_ids, positions, docs)?;
        let (b, ts, hd) = h.dims3()?;
        if labels.dims() != [b, ts] {
            bail!(
                "Llama::token_nll: labels {:?} must be [{b}, {ts}] for input_ids {:?}",
                labels.dims(),
                input_ids.dims()
            )
        }
        let chunk = crate::head_loss::default_chunk_rows(self.cfg.vocab_size);
        crate::head_loss::token_nll(
            &h.reshape((b * ts, hd))?,
            &self.lm_head,
            &labels.flatten_all()?,
            chunk,
        )?
        .reshape((b, ts))
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
        Ok((loss, logits))
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{shard_batch, Layout, IGNORE};
    use crate::params::{init_params, shard_params};
    use candle_core::Device;
    use candle_cp_comm::run_ranks;

    /// fused cross-entropy = candle-nn's cross_entropy (values and gradients), IGNORE skipped
    #[test]
    fn local_nll_matches_candle_nn() -> Result<()> {
        let dev = Device::Cpu;
        let x = candle_core::Var::randn(0f32, 3.0, (2, 5, 11), &dev)?;
        let lab = Tensor::new(&[[1u32, 4, IGNORE, 10, 0], [IGNORE, IGNORE, 7, 7, 3]], &dev)?;
        let (terms, n) = local_nll(x.as_tensor(), &lab)?;
        assert_eq!(n, 7);
        let sum = terms.sum_all()?;
        let keep: Vec<u32> = vec![0, 1, 3, 4, 7, 8, 9];
        let rows = x
            .as_tensor()
            .reshape((10, 11))?
            .index_select(&Tensor::new(keep, &dev)?, 0)?;
        let tg = Tensor::new(&[1u32, 4, 10, 0, 7, 7, 3], &dev)?;
        let want = (candle_nn::loss::cross_entropy(&rows, &tg)? * 7.0)?;
        let d = (sum.to_scalar::<f32>()? - want.to_scalar::<f32>()?).abs();
        assert!(d < 1e-5, "{d}");
        let (g, gw) = (sum.backward()?, want.backward()?);
        let (a, b) = (
            g.get(x.as_tensor()).unwrap(),
            gw.get(x.as_tensor()).unwrap(),
        );
        assert!((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
        // no target at all: one zero term, still connected
        let (t0, n0) = local_nll(x.as_tensor(), &Tensor::full(IGNORE, (2, 5), &dev)?)?;
        assert_eq!((n0, t0.to_vec1::<f32>()?), (0, vec![0.0]));
        Ok(())
    }

    /// With a fresh `VarMap` the model's layers create exactly the HF-named parameters of
    /// [`param_specs`] with their TP-local shapes (nothing outside the `VarMap`), and every
    /// one of them gets a gradient.
    #[test]
    fn fresh_varmap_holds_every_parameter_with_local_shapes() -> Result<()> {
        let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
        let layout = Layout::single().with_tp(2, true);
        let ids = Tensor::arange(0u32, 16, &Device::Cpu)?.reshape((1, 16))?;
        for r in run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = candle_nn::VarMap::new();
            let m = Llama::new(
                VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu),
                &cfg,
                &ctx,
            )?;
            let mut got: Vec<(String, Vec<usize>)> = crate::params::varmap_tensors(&vm)?
                .into_iter()
                .map(|(k, t)| (k, t.dims().to_vec()))
                .collect();
            got.sort();
            let mut want = param_specs(&cfg)
                .into_iter()
                .map(|s| Ok((s.name.clone(), s.local_shape(2)?.dims().to_vec())))
                .collect::<Result<Vec<_>>>()?;
            want.sort();
            let b = shard_batch(&ids, &ctx)?;
            let grads = m
                .loss(&b.input_ids, &b.labels, &b.positions)?
                .0
                .backward()?;
            Ok((got, want, crate::grads::named_grads(&grads, &vm)?.len()))
        }) {
            let (got, want, n_grads) = r?;
            assert_eq!(got, want);
            assert_eq!(n_grads, want.len());
        }
        Ok(())
    }

    /// With recompute on, `loss.backward()` alone misses the layers' parameters (they are
    /// outside candle's graph), `Llama::backward` has every one, and a forward after an
    /// uncollected backward is refused.
    #[test]
    fn recompute_needs_llama_backward() -> Result<()> {
        let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
        let ids = Tensor::arange(0u32, 32, &Device::Cpu)?.reshape((1, 32))?;
        for r in run_ranks(2, |g| {
            let layout = Layout::cp(crate::layout::CpKind::Zigzag, 2);
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_params(&init_params(&cfg, 3, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
            let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?
                .with_recompute(true);
            assert!(m.recomputes());
            let b = shard_batch(&ids, &ctx)?;
            let n = param_specs(&cfg).len();
            let (loss, _) = m.loss(&b.input_ids, &b.labels, &b.positions)?;
            let full = crate::grads::named_grads(&m.backward(&loss)?, &vm)?.len();
            let (loss, _) = m.loss(&b.input_ids, &b.labels, &b.positions)?;
            let plain = crate::grads::named_grads(&loss.backward()?, &vm)?;
            let refused = m.loss(&b.input_ids, &b.labels, &b.positions).err().map(|e| e.to_string());
            Ok((n, full, plain.len(), refused))
        }) {
            let (n, full, plain, refused) = r?;
            assert_eq!(full, n, "Llama::backward: every parameter");
            // embeddings, final norm, head only: 2 layers x 9 parameters are missing
            assert_eq!(plain, n - 2 * 9, "loss.backward() sees no layer parameter");
            let msg = refused.expect("forward after an uncollected backward must fail");
            assert!(msg.contains("Llama::backward"), "{msg}");
        }
        Ok(())
    }

    /// The chunked head + loss gives the logits path's loss and gradients (every parameter),
    /// with a rank holding ignored labels, on CP and TP + SP layouts.
    #[test]
    fn token_nll_equals_the_logits_path() -> Result<()> {
        let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
        let ids = Tensor::arange(0u32, 64, &Device::Cpu)?.reshape((2, 32))?;
        for layout in [Layout::cp(crate::layout::CpKind::Zigzag, 2), Layout::single().with_tp(2, true)] {
            for r in run_ranks(layout.world_size(), |g| {
                let ctx = ParallelCtx::new(g, layout)?;
                let vm = shard_params(&init_params(&cfg, 3, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
                let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
                let b = shard_batch(&ids, &ctx)?;
                // ignore every third label
                let lab: Vec<u32> = b.labels.flatten_all()?.to_vec1()?;
                let lab: Vec<u32> = lab.iter().enumerate().map(|(i, &l)| if i % 3 == 0 { IGNORE } else { l }).collect();
                let labels = Tensor::from_vec(lab.clone(), b.labels.shape(), &Device::Cpu)?;
                let (loss_a, _) = m.loss(&b.input_ids, &labels, &b.positions)?;
                let ga = crate::grads::named_grads(&loss_a.backward()?, &vm)?;
                let nll = m.token_nll(&b.input_ids, &labels, &b.positions)?;
                let n = lab.iter().filter(|&&l| l != IGNORE).count();
                let loss_b = global_mean(&nll.flatten_all()?, n, m.ctx().token_group())?;
                let gb = crate::grads::named_grads(&loss_b.backward()?, &vm)?;
                let dl = (loss_a.to_scalar::<f32>()? - loss_b.to_scalar::<f32>()?).abs();
                let mut dg = 0f32;
                for (name, a) in &ga {
                    let Some(b) = gb.get(name) else { bail!("token_nll path: no gradient for {name}") };
                    dg = dg.max((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?);
                }
                Ok((dl, dg, ga.len()))
            }) {
                let (dl, dg, n) = r?;
                assert_eq!(n, param_specs(&cfg).len());
                assert!(dl <= 1e-6 && dg <= 1e-6, "{layout}: loss differs by {dl}, gradients by {dg}");
            }
        }
        Ok(())
    }

    /// bf16 weights run forward and backward and stay close to f32 (loose bf16 bound).
    #[test]
    fn bf16_close_to_f32() -> Result<()> {
        let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
        let ids = Tensor::arange(0u32, 64, &Device::Cpu)?.reshape((1, 64))?;
        let mut losses = Vec::new();
        for dt in [DType::F32, DType::BF16] {
            let r = run_ranks(1, |g| {
                let ctx = ParallelCtx::new(g, Layout::single())?;
                let vm = shard_params(&init_params(&cfg, 3, dt, &Device::Cpu)?, &cfg, &ctx)?;
                let m = Llama::new(VarBuilder::from_varmap(&vm, dt, &Device::Cpu), &cfg, &ctx)?;
                let b = shard_batch(&ids, &ctx)?;
                let (loss, logits) = m.loss(&b.input_ids, &b.labels, &b.positions)?;
                assert_eq!(logits.dtype(), dt);
                let grads = loss.backward()?;
                assert_eq!(
                    crate::grads::named_grads(&grads, &vm)?.len(),
                    crate::params::param_specs(&cfg).len()
                );
                loss.to_scalar::<f32>()
            });
            losses.push(
                r.into_iter()
                    .next()
                    .unwrap_or_else(|| Err(candle_core::Error::Msg("no rank".into())))?,
            );
        }
        assert!(
            losses[0].is_finite() && (losses[0] - (64f32).ln()).abs() < 0.1,
            "{losses:?}"
        );
        assert!((losses[0] - losses[1]).abs() < 2e-2, "{losses:?}");
        Ok(())
    }
}
