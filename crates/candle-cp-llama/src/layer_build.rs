//! How a decoder layer is built from a `VarBuilder`: names, local shapes and inits from the
//! parameter specs, the TP / SP layers, the LoRA adapters. [`crate::Llama::new`] builds every
//! layer once; a model over a quantized base ([`crate::quant`]) builds each layer anew in every
//! forward (and recomputation) from weights dequantized on the fly.

use crate::config::LlamaConfig;
use crate::layout::ParallelCtx;
use crate::model::{Block, Mlp, QkNorm};
use crate::moe::{RouterLog, SparseMoe};
use crate::params::{param_specs, ParamSpec};
use candle_core::{bail, Result, Tensor};
use candle_cp_nn::{ColumnParallelLinear, GradSync, LinearConfig, RmsNorm, RowParallelLinear, Shard, Tp};
use candle_nn::{Init, VarBuilder};
use std::collections::HashMap;

/// What a layer is built from: the weights (`vb`), the config, the ranks, the specs.
#[derive(Clone)]
pub(crate) struct LayerBuilder<'a> {
    vb: VarBuilder<'a>,
    cfg: LlamaConfig,
    ctx: ParallelCtx,
    specs: HashMap<String, ParamSpec>,
    pub(crate) tp: Tp,
    router_log: RouterLog,
    /// The token indices the adapters' dropout masks are drawn for (shared by the model).
    pub(crate) lora_rows: candle_cp_nn::DropoutRows,
}

/// HF init: matrices N(0, 0.02²) (norms: ones, by RmsNorm).
const INIT: Init = Init::Randn { mean: 0.0, stdev: 0.02 };

impl<'a> LayerBuilder<'a> {
    /// A builder over `vb` (the sparse layers log their routing into `router_log`).
    pub(crate) fn new(vb: VarBuilder<'a>, cfg: &LlamaConfig, ctx: &ParallelCtx, router_log: RouterLog) -> Self {
        let specs = param_specs(cfg).into_iter().map(|s| (s.name.clone(), s)).collect();
        let tp = Tp::new(ctx.tp.clone(), ctx.layout.seq_parallel());
        Self { vb, cfg: cfg.clone(), ctx: ctx.clone(), specs, tp, router_log, lora_rows: Default::default() }
    }

    /// Parameter `name` with this rank's local shape (a fresh `VarMap`: the HF init).
    pub(crate) fn get(&self, name: &str) -> Result<Tensor> {
        let Some(s) = self.specs.get(name) else {
            bail!("Llama::new: no parameter spec for {name}")
        };
        self.vb.get_with_hints(s.local_shape_in(&self.ctx)?, name, INIT)
    }

    /// Parameter `name` in f32 ([`crate::ParamSpec::keeps_f32`]), this rank's local shape.
    fn get_f32(&self, name: &str) -> Result<Tensor> {
        let Some(s) = self.specs.get(name) else {
            bail!("Llama::new: no parameter spec for {name}")
        };
        self.vb.get_with_hints_dtype(s.local_shape_in(&self.ctx)?, name, Init::Const(0.0), candle_core::DType::F32)
    }

    /// Parameter `name` with this rank's local shape, `init` in a fresh `VarMap`.
    fn get_init(&self, name: &str, init: Init) -> Result<Tensor> {
        let Some(s) = self.specs.get(name) else {
            bail!("Llama::new: no parameter spec for {name}")
        };
        self.vb.get_with_hints(s.local_shape_in(&self.ctx)?, name, init)
    }

    /// The RMSNorm whose weight is under `vb` (weights: ones in a fresh VarMap, or Gemma's
    /// zeros, which its `1 + w` makes ones).
    pub(crate) fn norm(&self, vb: VarBuilder) -> Result<RmsNorm> {
        let w = vb.get_with_hints(self.cfg.hidden_size, "weight", self.norm_init())?;
        Ok(RmsNorm::from_weight(&w, self.cfg.rms_norm_eps, &self.tp)?.with_grad_sync(GradSync::Deferred).with_form(self.cfg.norm_weight()))
    }

    /// The norms' init in a fresh VarMap.
    fn norm_init(&self) -> Init {
        Init::Const(if self.cfg.is_gemma() { 0.0 } else { 1.0 })
    }

    /// The weights' root (`model.`, `lm_head.` below it).
    pub(crate) fn vb(&self) -> &VarBuilder<'a> {
        &self.vb
    }

    /// The LoRA adapter of projection `module` under `prefix` (crate::lora), if a target
    /// (its local shapes from the specs; in a fresh VarMap A uniform in ±1/√in, B zero).
    fn lora_for(&self, prefix: &str, module: &str) -> Result<Option<candle_cp_nn::Lora>> {
        let stem = format!("{prefix}.{module}");
        // (a target on an adapted layer; its rank and alpha the patterns': crate::lora_select)
        let Some(l) = self.cfg.lora.as_ref().filter(|l| l.adapts_weight(&stem)) else { return Ok(None) };
        // (a Phi-3's q, k, v / gate, up: its fused module's one A, and its dropout's mask)
        let module = l.module_name(&stem);
        let (an, bn) = (format!("{module}.lora_A.weight"), format!("{stem}.lora_B.weight"));
        let (Some(sa), Some(sb)) = (self.specs.get(&an), self.specs.get(&bn)) else { bail!("Llama::new: no LoRA parameter spec for {an}") };
        let (a, b) = (sa.local_shape_in(&self.ctx)?, sb.local_shape_in(&self.ctx)?);
        let lora = candle_cp_nn::Lora::load_named(&self.vb, (&an, &bn), a.dims()[1], sa.shape[1], b.dims()[0], &l.config_for(&stem))?;
        let lora = lora.with_dropout(l.dropout, format!("{module}.lora_dropout"), &self.lora_rows)?;
        Ok(Some(match self.magnitude(&stem)? {
            Some(m) => lora.with_dora(m)?,
            None => lora,
        }))
    }

    /// DoRA's magnitude of the weight `stem` (`….lora_magnitude_vector`, this rank's), `None`
    /// without DoRA (in a fresh VarMap: ones; the trainer sets the weight's norms).
    fn magnitude(&self, stem: &str) -> Result<Option<Tensor>> {
        let name = format!("{stem}{}", crate::lora::MAGNITUDE);
        match self.specs.get(&name) {
            Some(s) => Ok(Some(self.vb.get_with_hints(s.local_shape_in(&self.ctx)?, &name, Init::Const(1.0))?)),
            None => Ok(None),
        }
    }

    /// The adapters of a sparse layer whose MLP is under `module` (`model.layers.{i}.mlp.`,
    /// with the dot): its experts' stacked factors, its shared expert's and its routers'
    /// (crate::moe_lora), `None` when none of them is a target.
    fn moe_lora(&self, module: &str) -> Result<Option<Box<crate::moe_lora::MoeLora>>> {
        let Some(l) = self.cfg.lora.as_ref() else { return Ok(None) };
        let factors = |stem: String| -> Result<Option<crate::moe_lora::Factors>> {
            // (gpt-oss's gate and up: gate_up_proj's one A, the same Var for both)
            let a_of = l.shared_a(&stem).map_or_else(|| stem.clone(), |(m, _)| m);
            let (an, bn) = (format!("{a_of}.lora_A.weight"), format!("{stem}.lora_B.weight"));
            let (Some(sa), Some(sb)) = (self.specs.get(&an), self.specs.get(&bn)) else { return Ok(None) };
            // a fresh VarMap: A uniform in ±1/√in (PEFT's init), B zero
            let bound = 1.0 / (sa.shape.last().copied().unwrap_or(1).max(1) as f64).sqrt();
            let a = self.vb.get_with_hints(sa.local_shape_in(&self.ctx)?, &an, Init::Uniform { lo: -bound, up: bound })?;
            let b = self.vb.get_with_hints(sb.local_shape_in(&self.ctx)?, &bn, Init::Const(0.0))?;
            Ok(Some(crate::moe_lora::Factors { a, b, m: self.magnitude(&stem)?, stream: format!("{stem}.lora_dropout"), scale: l.config_for(&stem).scale() }))
        };
        let of = |part: &str| -> Result<[Option<crate::moe_lora::Factors>; 3]> {
            Ok([factors(format!("{module}{part}.gate_proj"))?, factors(format!("{module}{part}.up_proj"))?, factors(format!("{module}{part}.down_proj"))?])
        };
        let moe = self.cfg.moe.as_ref();
        let (experts, shared) = (of("experts")?, of(moe.map_or("shared_expert", |m| m.shared_module()))?);
        // the routers (transformers 4's linear `gate` / `shared_expert_gate`)
        let router = moe.map_or("gate", |m| m.router());
        let routers = [factors(format!("{module}{router}"))?, factors(format!("{module}shared_expert_gate"))?];
        if experts.iter().chain(&shared).chain(&routers).all(|f| f.is_none()) {
            return Ok(None);
        }
        Ok(Some(Box::new(crate::moe_lora::MoeLora { experts, shared, routers, dropout: l.dropout, rows: self.lora_rows.clone() })))
    }

    /// Decoder layer `i`.
    pub(crate) fn block(&self, i: usize) -> Result<Block> {
        let cfg = &self.cfg;
        let (h, eps, init) = (cfg.hidden_size, cfg.rms_norm_eps, INIT);
        let (qd, kd) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim);
        let lin = LinearConfig::new(false).with_init(init);
        // (Gemma 2 / 3 and GLM-4: a norm before and one after each branch)
        let (form, gemma, norm_init) = (cfg.norm_weight(), cfg.pre_and_post_norms(), self.norm_init());
        let vl = self.vb.pp(format!("model.layers.{i}"));
        let (va, vm) = (vl.pp("self_attn"), vl.pp("mlp"));
        let kv = Shard::RowBlocks(cfg.num_key_value_heads);
        let qkv = [
            (va.pp("q_proj"), qd, Shard::Rows),
            (va.pp("k_proj"), kd, kv),
            (va.pp("v_proj"), kd, kv),
        ];
        let mlp = match &cfg.moe {
            Some(m) if cfg.is_moe_layer(i) => {
                let p = |s: &str| format!("model.layers.{i}.{}.{s}", m.module());
                Mlp::Sparse(SparseMoe {
                    router: self.get(&p(&format!("{}.weight", m.router())))?,
                    gate: self.get(&p("experts.gate_proj"))?,
                    up: self.get(&p("experts.up_proj"))?,
                    down: self.get(&p("experts.down_proj"))?,
                    biases: match m.biases() {
                        false => None,
                        true => Some(crate::moe::MoeBiases {
                            router: self.get(&p(&format!("{}.bias", m.router())))?,
                            gate: self.get(&p("experts.gate_proj.bias"))?,
                            up: self.get(&p("experts.up_proj.bias"))?,
                            down: self.get(&p("experts.down_proj.bias"))?,
                        }),
                    },
                    top_k: m.num_experts_per_tok,
                    norm_topk: m.norm_topk_prob,
                    tp: self.tp.clone(),
                    act: cfg.activation(),
                    log: self.router_log.clone(),
                    load_balancing: m.output_router_logits,
                    shared: match m.shared_expert_intermediate_size {
                        0 => None,
                        _ => Some(crate::moe::SharedExpert {
                            gate: self.get(&p(&format!("{}.gate_proj.weight", m.shared_module())))?,
                            up: self.get(&p(&format!("{}.up_proj.weight", m.shared_module())))?,
                            down: self.get(&p(&format!("{}.down_proj.weight", m.shared_module())))?,
                            weight: m.shared_gate().then(|| self.get(&p("shared_expert_gate.weight"))).transpose()?,
                        }),
                    },
                    // (GLM-4.5: sigmoid scores, the experts chosen with the correction bias, f32)
                    scoring: match m.sigmoid_scores() {
                        // (DeepSeek-V2: softmax scores chosen within groups, scaled)
                        false if m.style == crate::MoeStyle::DeepseekV2 => crate::moe::Scoring::SoftmaxGroups { scale: m.routed_scaling_factor, groups: m.groups },
                        false => crate::moe::Scoring::Softmax,
                        true => crate::moe::Scoring::Sigmoid {
                            bias: self.get_f32(&p(&format!("{}.{}", m.router(), crate::params::CORRECTION_BIAS)))?,
                            scale: m.routed_scaling_factor,
                            groups: m.groups,
                        },
                    },
                    ep: self.ctx.ep.clone(),
                    lora: self.moe_lora(&p(""))?,
                })
            }
            _ => {
                let gate_up = [(vm.pp("gate_proj"), cfg.intermediate_size), (vm.pp("up_proj"), cfg.intermediate_size)];
                let mp = format!("model.layers.{i}.mlp");
                let mut down = RowParallelLinear::new(vm.pp("down_proj"), cfg.intermediate_size, h, lin, &self.tp)?;
                if let Some(l) = self.lora_for(&mp, "down_proj")? {
                    down = down.with_lora(l)?;
                }
                Mlp::Dense {
                    gate_up: ColumnParallelLinear::new_fused(&gate_up, h, lin, &self.tp)?.with_lora(vec![self.lora_for(&mp, "gate_proj")?, self.lora_for(&mp, "up_proj")?])?,
                    down,
                }
            }
        };
        let ap = format!("model.layers.{i}.self_attn");
        // DeepSeek-V3: the query's up-projection in place of q, k, v; o_proj H·v wide
        let (qkv, o_in, mla) = match &cfg.mla {
            Some(a) => self.mla(i, a)?,
            None => {
                let qkv_lora = vec![self.lora_for(&ap, "q_proj")?, self.lora_for(&ap, "k_proj")?, self.lora_for(&ap, "v_proj")?];
                (ColumnParallelLinear::new_fused_sharded(&qkv, h, LinearConfig::new(cfg.qkv_bias).with_init(init), &self.tp)?.with_lora(qkv_lora)?, qd, None)
            }
        };
        // gpt-oss: an o_proj bias, replicated, its TP shares summed by reduce_gradients (as a norm's)
        let mut o = match cfg.gpt_oss {
            false => RowParallelLinear::new(va.pp("o_proj"), o_in, h, lin, &self.tp)?,
            true => RowParallelLinear::new(va.pp("o_proj"), o_in, h, LinearConfig::new(true).with_init(init), &self.tp)?.with_grad_sync(GradSync::Deferred),
        };
        if let Some(l) = self.lora_for(&ap, "o_proj")? {
            o = o.with_lora(l)?;
        }
        // (OLMo 2 and 3: norms after the branches only; every OLMo: whole-projection q, k norms)
        let (olmo, flat) = (cfg.post_norms_only(), cfg.olmo.is_some());
        Ok(Block {
            // OLMo: no norm before the attention or the MLP (its norms follow each branch)
            input_norm: if olmo { None } else { Some(self.norm(vl.pp("input_layernorm"))?) },
            qkv,
            o,
            // the norm before the MLP: Gemma 3's `pre_feedforward_layernorm` (its
            // `post_attention_layernorm` is the one after the attention)
            post_norm: match olmo {
                true => None,
                false => Some(self.norm(vl.pp(if gemma { "pre_feedforward_layernorm" } else { "post_attention_layernorm" }))?),
            },
            mlp,
            qk_norm: match cfg.qk_norm {
                false => None,
                // (`norm_init` in a fresh VarMap, as the other norms' weights)
                true => Some(QkNorm {
                    q: va.pp("q_norm").get_with_hints(cfg.head_dim, "weight", norm_init)?,
                    k: va.pp("k_norm").get_with_hints(cfg.head_dim, "weight", norm_init)?,
                    eps,
                    form,
                }),
            },
            flat_qk_norm: match flat {
                false => None,
                // (ones in a fresh VarMap)
                true => Some(crate::config::olmo::FlatQkNorm {
                    q: self.get_init(&format!("{ap}.q_norm.weight"), Init::Const(1.0))?,
                    k: self.get_init(&format!("{ap}.k_norm.weight"), Init::Const(1.0))?,
                    widths: (qd, kd),
                    eps,
                    form,
                    tp: (self.ctx.tp.size() > 1).then(|| self.ctx.tp.clone()),
                }),
            },
            window: cfg.layer_window(i),
            sandwich: match gemma || olmo {
                false => None,
                true => Some((self.norm(vl.pp("post_attention_layernorm"))?, self.norm(vl.pp("post_feedforward_layernorm"))?)),
            },
            act: cfg.activation(),
            local_rope: cfg.layer_rope_is_local(i),
            rotates: cfg.layer_rotates(i),
            residual_scale: cfg.residual_scale(),
            sinks: match cfg.gpt_oss {
                false => None,
                true => Some(self.get(&format!("{ap}.sinks"))?),
            },
            mla,
        })
    }

    /// DeepSeek-V3's latent attention of layer `i`: the query's up-projection (`q_b_proj`, or
    /// `q_proj`), o_proj's input width `H·v` and the layer's [`crate::mla::MlaAttn`].
    fn mla(&self, i: usize, a: &crate::config::deepseek::Mla) -> Result<(ColumnParallelLinear, usize, Option<Box<crate::mla::MlaAttn>>)> {
        let cfg = &self.cfg;
        let (h, heads, eps) = (cfg.hidden_size, cfg.num_attention_heads, cfg.rms_norm_eps);
        let ap = format!("model.layers.{i}.self_attn");
        let va = self.vb.pp(&ap);
        let lin = LinearConfig::new(false).with_init(INIT);
        // (the latents' norms: ones in a fresh VarMap; their TP shares summed as a norm's)
        let norm = |name: &str| -> Result<RmsNorm> {
            let w = self.get_init(&format!("{ap}.{name}.weight"), Init::Const(1.0))?;
            Ok(RmsNorm::from_weight(&w, eps, &self.tp)?.with_grad_sync(GradSync::Deferred).with_form(cfg.norm_weight()))
        };
        let (q_name, q_in, q_down) = match a.q_lora_rank {
            Some(rq) => ("q_b_proj", rq, Some((self.get(&format!("{ap}.q_a_proj.weight"))?, self.lora_for(&ap, "q_a_proj")?, norm("q_a_layernorm")?))),
            None => ("q_proj", h, None),
        };
        let q_up = ColumnParallelLinear::new(va.pp(q_name), q_in, heads * a.qk_head_dim(), lin, &self.tp)?.with_lora(vec![self.lora_for(&ap, q_name)?])?;
        let kv_up = ColumnParallelLinear::new(va.pp("kv_b_proj"), a.kv_lora_rank, heads * (a.qk_nope_head_dim + a.v_head_dim), lin, &self.tp)?.with_lora(vec![self.lora_for(&ap, "kv_b_proj")?])?;
        let m = crate::mla::MlaAttn { q_down, kv_down: self.get(&format!("{ap}.kv_a_proj_with_mqa.weight"))?, kv_down_lora: self.lora_for(&ap, "kv_a_proj_with_mqa")?, kv_norm: norm("kv_a_layernorm")?, kv_up, dims: *a, heads: heads / self.tp.size().max(1), tp: self.tp.clone() };
        Ok((q_up, heads * a.v_head_dim, Some(Box::new(m))))
    }
}
