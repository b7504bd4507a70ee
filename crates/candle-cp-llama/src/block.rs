//! One decoder layer of [`crate::Llama`] ([`Block`]): its candle-cp-nn layers, its forward
//! (attention through the layout's CP attention — q, k, v projections or DeepSeek's latent
//! attention, [`crate::mla`] — then the MLP, dense or a mixture of experts), and the environment
//! every layer of one forward shares ([`BlockEnv`]).

use super::*;
/// One decoder layer from candle-cp-nn layers (they hold the TP/SP logic: input gathers,
/// output reductions, norm weights on sequence shards).
#[derive(Clone)]
pub(crate) struct Block {
    /// The norm before the attention (`input_layernorm`; OLMo has none).
    pub(crate) input_norm: Option<RmsNorm>,
    /// The norm before the MLP (`post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`; OLMo has none).
    pub(crate) post_norm: Option<RmsNorm>,
    /// `q_proj`, `k_proj`, `v_proj` fused: one input gather (SP) for the three.
    pub(crate) qkv: ColumnParallelLinear,
    pub(crate) o: RowParallelLinear,
    /// The MLP: dense, or a mixture of experts (Qwen3-MoE's sparse layers).
    pub(crate) mlp: Mlp,
    /// Qwen3's q and k head norms: weights `[D]` and epsilon ([`LlamaConfig::qk_norm`]).
    pub(crate) qk_norm: Option<QkNorm>,
    /// OLMo's q and k norms over the whole projection ([`crate::config::olmo`]).
    pub(crate) flat_qk_norm: Option<crate::config::olmo::FlatQkNorm>,
    /// The sliding window this layer attends within ([`LlamaConfig::layer_window`]).
    pub(crate) window: Option<usize>,
    /// Gemma's and OLMo's norms after the attention and after the MLP
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`), each on its branch before
    /// the residual add.
    pub(crate) sandwich: Option<(RmsNorm, RmsNorm)>,
    /// The gated MLP's activation.
    pub(crate) act: Activation,
    /// Whether the layer rotates by the local RoPE tables ([`LlamaConfig::layer_rope_is_local`]).
    pub(crate) local_rope: bool,
    /// Whether the layer rotates q and k at all (SmolLM3's NoPE layers do not,
    /// [`LlamaConfig::layer_rotates`]).
    pub(crate) rotates: bool,
    /// The factor on each residual branch ([`LlamaConfig::residual_scale`]: Granite's).
    pub(crate) residual_scale: f64,
    /// gpt-oss's attention sinks, this TP rank's heads `[Hl]` ([`LlamaConfig::gpt_oss`]).
    pub(crate) sinks: Option<Tensor>,
    /// DeepSeek-V3's latent attention ([`crate::mla`]; `qkv` is then its query's
    /// up-projection alone).
    pub(crate) mla: Option<Box<crate::mla::MlaAttn>>,
}

/// A layer's MLP.
#[derive(Clone)]
pub(crate) enum Mlp {
    /// `gate_proj`, `up_proj` fused (one input gather), `down_proj`.
    Dense { gate_up: ColumnParallelLinear, down: RowParallelLinear },
    /// A mixture of experts ([`crate::moe`]).
    Sparse(SparseMoe),
}

impl Block {
    /// The same layer for inference with every adapter merged into its weight.
    pub(super) fn with_adapters_merged(&self) -> Result<Block> {
        let mlp = match &self.mlp {
            Mlp::Dense { gate_up, down } => Mlp::Dense { gate_up: gate_up.with_adapters_merged()?, down: down.with_adapters_merged()? },
            Mlp::Sparse(s) => Mlp::Sparse(s.with_adapters_merged()?),
        };
        let mla = self.mla.as_ref().map(|m| m.with_adapters_merged().map(Box::new)).transpose()?;
        Ok(Block { qkv: self.qkv.with_adapters_merged()?, o: self.o.with_adapters_merged()?, mlp, mla, ..self.clone() })
    }
}

impl Mlp {
    fn without_sp(&self) -> Mlp {
        match self {
            Mlp::Dense { gate_up, down } => Mlp::Dense {
                gate_up: gate_up.clone().with_sequence_parallel(false),
                down: down.clone().with_sequence_parallel(false),
            },
            Mlp::Sparse(m) => Mlp::Sparse(m.without_sp()),
        }
    }
}

/// What every layer of one forward shares: the parallel context, RoPE tables `(cos, sin)`
/// of the CP shard's positions in the activations' dtype (and the local ones of Gemma 3's
/// sliding layers), `[Tc, D]` (shared by every row) or
/// `[B, Tc, D]` (one per row), `[B, Tc, Hl, Hkvl, D]`, the softmax scale and the packed
/// documents (one shared or one per row; `None`: each row is one sequence).
pub(crate) struct BlockEnv {
    pub(super) ctx: ParallelCtx,
    pub(super) rope: (Tensor, Tensor),
    pub(super) rope_local: Option<(Tensor, Tensor)>,
    pub(super) dims: [usize; 5],
    pub(super) scale: candle_cp_ops::attention::Scores,
    pub(super) docs: Option<Vec<Documents>>,
}

impl Block {
    /// The attention's input: `x` through the norm before it (`x` itself where the layer has
    /// none: OLMo 2 / 3, EXAONE 4).
    pub(crate) fn normed_input(&self, x: &Tensor) -> Result<Tensor> {
        match &self.input_norm {
            Some(n) => n.forward(x),
            None => Ok(x.clone()),
        }
    }

    /// The MLP's input: `x` through the norm before it (or `x`, as [`Block::normed_input`]).
    pub(crate) fn normed_mlp_input(&self, x: &Tensor) -> Result<Tensor> {
        match &self.post_norm {
            Some(n) => n.forward(x),
            None => Ok(x.clone()),
        }
    }

    /// The same layer (same weights) with sequence parallelism off: its input and output are
    /// the whole sequence, replicated on the TP ranks (generation, whose one-token decode
    /// steps cannot be split along the sequence).
    pub(crate) fn without_sp(&self) -> Block {
        Block {
            input_norm: self.input_norm.clone(),
            post_norm: self.post_norm.clone(),
            qkv: self.qkv.clone().with_sequence_parallel(false),
            o: self.o.clone().with_sequence_parallel(false),
            mlp: self.mlp.without_sp(),
            qk_norm: self.qk_norm.clone(),
            flat_qk_norm: self.flat_qk_norm.clone(),
            window: self.window,
            sandwich: self.sandwich.clone(),
            act: self.act,
            local_rope: self.local_rope,
            rotates: self.rotates,
            residual_scale: self.residual_scale,
            sinks: self.sinks.clone(),
            mla: self.mla.as_ref().map(|m| Box::new(m.without_sp())),
        }
    }

    /// One decoder layer: `x` `[B, Ts, h]` → `[B, Ts, h]`.
    ///
    /// Written so that the graph keeps what the backward needs and little more (a candle
    /// node keeps its inputs alive until the backward): the column-parallel projections keep
    /// only their input's sequence shard and gather it again in the backward
    /// (`forward_parts_regathered`), RoPE is applied inside the Q and K projections' nodes
    /// ([`rope_post`]; with head norms, norm and RoPE are one node), the gate is one node
    /// ([`Activation::gated`]) and each residual add is fused into its row-parallel
    /// projection ([`RowParallelLinear::forward_residual`]; Gemma 3: into the norm after it,
    /// [`RmsNorm::forward_add`], the projection keeping no partial sums,
    /// [`RowParallelLinear::forward_lean`]). `tests/plan_activations.rs` compares what stays
    /// alive with the planner's count.
    pub(super) fn forward(&self, x: &Tensor, env: &BlockEnv) -> Result<Tensor> {
        let hl = env.dims[2];
        let (cos, sin) = match (&env.rope_local, self.local_rope) {
            (Some(local), true) => local,
            _ => &env.rope,
        };
        let a = match &self.mla {
            // DeepSeek-V3: q, k, v from the latents (crate::mla), RoPE on their rotated parts
            Some(m) => {
                let (q, k, v) = m.qkv(&self.normed_input(x)?, &self.qkv, hl, (cos, sin), true)?;
                m.attn_out(&attend_sinks(&q, &k, &v, &env.ctx, env.scale, env.docs.as_deref(), self.window, None)?, hl)?
            }
            None => self.attention(x, env, cos, sin)?,
        };
        self.finish_train(x, &a)
    }

    /// The attention branch of [`Block::forward`] for q, k, v projections: `x` `[B, Ts, h]` →
    /// the attention's output `[B, Tc, Hl·D]` (o_proj's input).
    fn attention(&self, x: &Tensor, env: &BlockEnv, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let [b, tc, hl, hkvl, d] = env.dims;
        // TP region [B, Tc, ·] between the column- and row-parallel layers
        let posts = match (&self.qk_norm, &self.flat_qk_norm) {
            (None, None) if self.rotates => [Some(rope_post(hl, cos, sin)?), Some(rope_post(hkvl, cos, sin)?), None],
            // Qwen3, OLMo: the norms come between the projection and RoPE; SmolLM3's NoPE
            // layers keep q and k as projected
            _ => [None, None, None],
        };
        let xn = self.normed_input(x)?;
        let qkv = self.qkv.forward_parts_regathered(&xn, &posts)?;
        let (q, k) = match (&self.qk_norm, &self.flat_qk_norm) {
            // OLMo: the norms over the whole projection (this TP rank's heads, the statistic
            // over all), then RoPE
            (None, Some(n)) => n.apply_with_rope(&qkv[0], &qkv[1], cos, sin, d)?,
            // (rope_post gave [B, Tc, H, D]; a NoPE layer's are as projected)
            (None, None) if !self.rotates => (qkv[0].reshape((b, tc, hl, d))?, qkv[1].reshape((b, tc, hkvl, d))?),
            (None, None) => (qkv[0].clone(), qkv[1].clone()),
            (Some(_), Some(_)) => bail!("Block: head norms and whole-projection q, k norms together (no architecture has both)"),
            // (EXAONE 4's NoPE layers: the head norms without the rotation)
            (Some(n), None) => {
                let l = env.ctx.layout;
                let tp = (l.tp > 1 && !l.seq_parallel()).then_some(&env.ctx.tp);
                let rope = self.rotates.then_some((cos, sin));
                n.apply_with_rope(&qkv[0].reshape((b, tc, hl, d))?, &qkv[1].reshape((b, tc, hkvl, d))?, rope, tp)?
            }
        };
        let v = qkv[2].reshape((b, tc, hkvl, d))?;
        let sinks = self.sinks.as_ref().map(Sinks::new).transpose()?;
        attend_sinks(&q, &k, &v, &env.ctx, env.scale, env.docs.as_deref(), self.window, sinks.as_ref())?.reshape((b, tc, hl * d))
    }

    /// The rest of [`Block::forward`] after the attention's output `a` `[B, Tc, ·]`: o_proj and
    /// the residual, the MLP and its residual.
    fn finish_train(&self, x: &Tensor, a: &Tensor) -> Result<Tensor> {
        let a = a.clone();
        let r = self.residual_scale;
        let x = match &self.sandwich {
            None => self.o.forward_residual_scaled(&a, x, r)?,
            // Gemma 3, OLMo: x + norm(o(a)), one node keeping o(a) and the statistic
            Some((after_attn, _)) => after_attn.forward_add(x, &self.o.forward_lean(&a)?)?,
        };
        let xn = self.normed_mlp_input(&x)?;
        match &self.mlp {
            Mlp::Dense { gate_up, down } => {
                let gu = gate_up.forward_parts_regathered(&xn, &[])?;
                let m = self.act.gated(&gu[0], &gu[1])?;
                match &self.sandwich {
                    None => down.forward_residual_scaled(&m, &x, r),
                    Some((_, after_mlp)) => after_mlp.forward_add(&x, &down.forward_lean(&m)?),
                }
            }
            Mlp::Sparse(moe) => {
                let y = moe.forward(&xn)?;
                match &self.sandwich {
                    None if r != 1.0 => add_scaled(&x, &y, r),
                    None => x + y,
                    Some((_, after_mlp)) => after_mlp.forward_add(&x, &y),
                }
            }
        }
    }
}

/// `x + r·y` as one graph node (GraniteMoE's residual add after its mixture): the memory of
/// `x + y`, where `x + y.affine(r)` would keep `r·y` as well (one more `[B, T, h]` per layer).
fn add_scaled(x: &Tensor, y: &Tensor, r: f64) -> Result<Tensor> {
    let out = (x.detach() + y.detach().affine(r, 0.0)?)?;
    let bwd: candle_cp_ops::autograd::BackwardFn = Arc::new(move |dy: &Tensor| Ok(vec![Some(dy.clone()), Some(dy.affine(r, 0.0)?)]));
    candle_cp_ops::autograd::attach2("residual_add_scaled", x, y, out, bwd)
}

