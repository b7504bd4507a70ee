//! The mixture-of-experts MLP of a Qwen3-MoE sparse layer ([`crate::config::qwen3_moe`]), on
//! the TP group, with or without sequence parallelism, and its load-balancing loss.
//!
//! ```text
//!  x [B, Ts, h] ─gather (SP) / copy (TP)─► xf [B, Tc, h] ─► router logits x·Wrᵀ [N, E]
//!     probs = softmax (f32) ─► top K per token (host) ─► pairs grouped by expert
//!     xs = xf rows of the pairs [N·K, h] ─► grouped matmuls: act(xs·Wgᵀ)·(xs·Wuᵀ) ·Wdᵀ
//!     y = Σ_k w_k · (its expert's row)  [B, Tc, h] ─reduce-scatter (SP) / all-reduce (TP)─►
//! ```
//!
//! Each TP rank holds every expert's `Ie/tp` slice (`[E, Ie/tp, h]`, `[E, h, Ie/tp]`: expert
//! tensor parallelism), routes the whole region the same way (the router is replicated) and
//! sums partial outputs as the dense MLP does. Context parallelism needs nothing more: each
//! CP rank routes its own tokens. The router's gradient is partial on each TP rank (it
//! weights partial expert outputs): summed over TP in the graph without SP (as the q, k
//! norms), by [`crate::reduce_gradients`] with SP.
//!
//! Expert parallelism (`ep > 1`, [`crate::Layout::ep`]): each rank of the EP group (DP × CP
//! ranks of one TP rank) holds `E/ep` experts; the pairs grouped by expert go to the ranks
//! holding their experts and come back ([`candle_cp_ops::moe_ep`]) around the grouped
//! matmuls. With TP too, the EP group's ranks share a TP rank, so they exchange rows for the
//! same `1/tp` slice of their experts; every TP rank routes alike, so the exchanges agree.
//!
//! LoRA / DoRA adapters on the experts and the shared expert (PEFT's `gate_proj`, `up_proj`,
//! `down_proj` targets, or the experts as parameters, `target_parameters`: `expert_params.rs`)
//! run beside their grouped matmuls, and LoRA on the routers (`gate`, `shared_expert_gate`)
//! inside the logits' node: `moe_lora.rs`.
//!
//! GLM-4.5's router ([`Scoring::Sigmoid`], [`crate::config::glm4_moe`]) scores by sigmoid, chooses
//! by the scores plus a correction bias (within the best expert groups), and weights the chosen
//! experts by their scores renormalised and scaled; its shared experts have no gate.
//!
//! The load-balancing loss (transformers' `load_balancing_loss_func`, with
//! `output_router_logits`) is `E · Σ_e f_e · P_e` over every token of the global batch and
//! every sparse layer (`f_e` the fraction of (token, slot) choices of expert `e` per token,
//! `P_e` the mean probability of `e`). Its statistics are global (summed over the DP × CP
//! ranks), so it cannot be one rank's graph: the layers log their counts and probability
//! sums ([`RouterLog`]), [`crate::Llama::router_aux_loss`] sums them over the ranks and sets
//! the loss's derivative w.r.t. each probability (`coef · E · C_e / R²`, the same for every
//! token), which the layers' probabilities add to their gradient in the backward (a
//! recomputed layer too).

use crate::fused::Activation;
use candle_core::{bail, DType, Result, Tensor, D};
use candle_cp_nn::Tp;
use candle_cp_ops::autograd::{attach1, BackwardFn};
use candle_cp_ops::mappings::{self, SEQ_DIM};
use candle_cp_comm::Group;
use candle_cp_ops::moe::{combine, grouped_matmul, grouped_matmul_bias, Routing};
use candle_cp_ops::moe_ep::{dispatch_to_experts, return_from_experts, ExpertExchange};
use crate::moe_lora::MoeLora;
use std::sync::{Arc, Mutex};

/// The router statistics of one forward, over its sparse layers, and the load-balancing
/// loss's derivative for the backward. Shared by a model's sparse layers.
#[derive(Clone, Default)]
pub(crate) struct RouterLog(Arc<Mutex<LogState>>);

#[derive(Default)]
struct LogState {
    /// `Σ` over layers of each expert's (token, slot) choices.
    counts: Vec<f64>,
    /// `Σ` over layers and tokens of each expert's probability.
    prob_sums: Vec<f64>,
    /// Router rows `Σ_layers N` (each sparse layer's tokens).
    rows: usize,
    /// Each sparse layer's counts, in the order the layers ran.
    layer_counts: Vec<Vec<f64>>,
    /// The routing balance [`crate::Llama::router_aux_loss`] computed from the global counts.
    load: Option<f64>,
    /// `d loss / d prob[n, e]` for every token and layer (`[E]`), once the loss is known.
    grad: Option<Tensor>,
}

impl RouterLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forget the last forward (statistics and derivative): called as a forward starts.
    pub(crate) fn clear(&self) {
        *self.lock() = LogState::default();
    }

    /// Log a sparse layer's routing: each expert's (token, slot) choices `[E]`, the
    /// probability sums `[E]` (with the load-balancing term) and the rows routed.
    fn record(&self, counts: &[usize], prob_sums: Option<&[f32]>, rows: usize) {
        let mut s = self.lock();
        if s.counts.len() != counts.len() {
            s.counts = vec![0.0; counts.len()];
            s.prob_sums = vec![0.0; counts.len()];
        }
        for (a, &c) in s.counts.iter_mut().zip(counts) {
            *a += c as f64;
        }
        s.layer_counts.push(counts.iter().map(|&c| c as f64).collect());
        for (a, &p) in s.prob_sums.iter_mut().zip(prob_sums.unwrap_or_default()) {
            *a += p as f64;
        }
        s.rows += rows;
    }

    /// `(counts, probability sums, rows)` logged since the forward started.
    pub(crate) fn stats(&self) -> (Vec<f64>, Vec<f64>, usize) {
        let s = self.lock();
        (s.counts.clone(), s.prob_sums.clone(), s.rows)
    }

    /// Each sparse layer's counts logged since the forward started (`[E]` each, run order).
    pub(crate) fn layer_counts(&self) -> Vec<Vec<f64>> {
        self.lock().layer_counts.clone()
    }

    /// Record the routing balance of the forward (see [`crate::Llama::expert_load`]).
    pub(crate) fn set_load(&self, load: f64) {
        self.lock().load = Some(load);
    }

    /// The routing balance recorded for the forward, if any.
    pub(crate) fn load(&self) -> Option<f64> {
        self.lock().load
    }

    /// Set the derivative `[E]` (f32) the probabilities add to their gradient.
    pub(crate) fn set_grad(&self, g: Tensor) {
        self.lock().grad = Some(g);
    }

    fn grad(&self) -> Option<Tensor> {
        self.lock().grad.clone()
    }
}

/// The routing balance of sparse layers from their global counts (`[E]` each): each layer's
/// most-chosen expert's count over the mean count, averaged over the layers (1 when balanced;
/// at most `E/K` for top `K`, every token choosing the same experts).
pub(crate) fn load_balance(layers: &[Vec<f64>]) -> Option<f64> {
    let per: Vec<f64> = layers
        .iter()
        .filter_map(|c| {
            let (sum, max) = (c.iter().sum::<f64>(), c.iter().copied().fold(0.0, f64::max));
            (sum > 0.0).then(|| max * c.len() as f64 / sum)
        })
        .collect();
    (!per.is_empty()).then(|| per.iter().sum::<f64>() / per.len() as f64)
}

/// A sparse layer's MLP (see the module doc): this TP rank's slices of the experts.
#[derive(Clone)]
pub(crate) struct SparseMoe {
    /// `[E, h]`, replicated.
    pub(crate) router: Tensor,
    /// `[E, Ie/tp, h]`.
    pub(crate) gate: Tensor,
    /// `[E, Ie/tp, h]`.
    pub(crate) up: Tensor,
    /// `[E, h, Ie/tp]`.
    pub(crate) down: Tensor,
    pub(crate) top_k: usize,
    pub(crate) norm_topk: bool,
    pub(crate) tp: Tp,
    pub(crate) act: Activation,
    /// The model's router statistics: every forward logs its expert counts; the probability
    /// sums and the term's derivative only with `load_balancing`.
    pub(crate) log: RouterLog,
    /// Whether the model's loss has the load-balancing term (`output_router_logits`): the
    /// probability sums are copied down and the term's derivative reaches the router.
    pub(crate) load_balancing: bool,
    /// Qwen2-MoE's shared expert.
    pub(crate) shared: Option<SharedExpert>,
    /// The expert-parallel group (`ep > 1`): `gate`, `up`, `down` hold this EP rank's
    /// `E/ep` experts, the routed rows travel to their experts' ranks and back.
    pub(crate) ep: Option<Group>,
    /// LoRA adapters on the experts and the shared expert ([`crate::moe_lora`]).
    pub(crate) lora: Option<Box<MoeLora>>,
    /// gpt-oss's router and expert biases.
    pub(crate) biases: Option<MoeBiases>,
    /// How the router scores the experts: a softmax, or GLM-4.5's sigmoid.
    pub(crate) scoring: Scoring,
}

/// How a router scores and chooses the experts.
#[derive(Clone)]
pub(crate) enum Scoring {
    /// `softmax(logits)`, the top `K` (renormalised with `norm_topk`).
    Softmax,
    /// GLM-4.5's: `s = sigmoid(logits)`, the top `K` of `s + bias` within the best `groups.1`
    /// of `groups.0` expert groups, weighted by `s` (renormalised with `norm_topk`) · `scale`.
    Sigmoid {
        /// `[E]` f32, replicated: chooses, no more (its gradient is zero).
        bias: Tensor,
        scale: f64,
        groups: (usize, usize),
    },
    /// DeepSeek-V2's: `p = softmax(logits)` (f32 logits), the top `K` of `p` within the best
    /// `groups.1` of `groups.0` expert groups (a group's score its best expert's), weighted by
    /// `p · scale` (not renormalised).
    SoftmaxGroups { scale: f64, groups: (usize, usize) },
}

/// gpt-oss's biases of a sparse layer (this rank's slices; under expert parallelism its
/// experts').
#[derive(Clone)]
pub(crate) struct MoeBiases {
    /// `[E]`, replicated (its gradient summed over TP as the router's).
    pub(crate) router: Tensor,
    /// `[E, Ie/tp]`, added to the gate projection's rows.
    pub(crate) gate: Tensor,
    /// `[E, Ie/tp]`, added to the up projection's rows.
    pub(crate) up: Tensor,
    /// `[E, h/tp]`: TP rank `r` adds it to columns `[r·h/tp, (r+1)·h/tp)` of its partial sums,
    /// so the TP sum adds each column once.
    pub(crate) down: Tensor,
}

/// Qwen2-MoE's shared expert: a SwiGLU every token goes through (this TP rank's slice, as a
/// dense MLP's), weighted by `sigmoid(x·wᵀ)` (`w` `[1, h]`, replicated; its gradient summed
/// over TP like the router's); GLM-4.5's shared experts: the same without the weight.
#[derive(Clone)]
pub(crate) struct SharedExpert {
    /// `[Is/tp, h]`.
    pub(crate) gate: Tensor,
    /// `[Is/tp, h]`.
    pub(crate) up: Tensor,
    /// `[h, Is/tp]`.
    pub(crate) down: Tensor,
    /// `[1, h]`; `None`: no gate (GLM-4.5).
    pub(crate) weight: Option<Tensor>,
}

impl SparseMoe {
    /// The same layer with sequence parallelism off (generation).
    pub(crate) fn without_sp(&self) -> SparseMoe {
        SparseMoe { tp: Tp::new(self.tp.group.clone(), false), ..self.clone() }
    }

    /// The same layer for inference with its adapters merged into the experts' and the shared
    /// expert's weights (crate::moe_lora); itself without adapters.
    pub(crate) fn with_adapters_merged(&self) -> Result<SparseMoe> {
        let Some(l) = &self.lora else { return Ok(self.clone()) };
        let m = |i: usize, shared: bool, w: &Tensor| -> Result<Tensor> { Ok(l.merged(i, shared, w, &self.tp)?.unwrap_or_else(|| w.clone())) };
        // (the routers: replicated, merged whole)
        let r = |i: usize, w: &Tensor| -> Result<Tensor> { Ok(l.merged_router(i, w, &self.tp)?.unwrap_or_else(|| w.clone())) };
        let shared = match &self.shared {
            Some(s) => Some(SharedExpert { gate: m(0, true, &s.gate)?, up: m(1, true, &s.up)?, down: m(2, true, &s.down)?, weight: s.weight.as_ref().map(|w| r(1, w)).transpose()? }),
            None => None,
        };
        Ok(SparseMoe { gate: m(0, false, &self.gate)?, up: m(1, false, &self.up)?, down: m(2, false, &self.down)?, router: r(0, &self.router)?, shared, lora: None, ..self.clone() })
    }

    /// `x` `[B, Ts, h]` (the post-attention norm's output; the sequence shard under SP) →
    /// the MLP's output, same shape (no residual).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = &self.tp.group;
        let p = g.size();
        let sp = self.tp.sequence_parallel && p > 1;
        let xf = if sp {
            mappings::gather_from_sp_region(x, g, SEQ_DIM)?
        } else if p > 1 {
            mappings::copy_to_tp_region(x, g)?
        } else {
            x.clone()
        };
        let (b, t, h) = xf.dims3()?;
        let hr = self.router.dim(1)?;
        if hr != h {
            bail!("SparseMoe: input {:?} does not match the router {:?} ([E, h])", x.dims(), self.router.dims())
        }
        let n = b * t;
        let x2 = xf.reshape((n, h))?;
        // without SP the router's TP shares are summed here (with SP: reduce_gradients)
        let router = if p > 1 && !sp { mappings::copy_to_tp_region(&self.router, g)? } else { self.router.clone() };
        // (the region's token indices when an adapter on the routers or the shared expert drops)
        let tokens = match &self.lora {
            Some(l) => l.region_tokens(n)?,
            None => None,
        };
        // (GLM-4.5's sigmoid router takes its logits in f32, as transformers' Glm4MoeTopkRouter
        // does: in bf16 they would move near-tied choices; an adapter on it adds its update to
        // the model dtype's logits)
        let f32_logits = matches!(self.scoring, Scoring::Sigmoid { .. } | Scoring::SoftmaxGroups { .. }) && x2.dtype() != DType::F32;
        let mut logits = match &self.lora {
            Some(l) => l.router_logits(0, &x2, &router, tokens.as_ref().map(|t| t.as_slice()), &self.tp)?,
            None if f32_logits => logits_f32(&x2, &router)?,
            None => x2.matmul(&router.t()?)?,
        };
        if let Some(b) = &self.biases {
            let rb = if p > 1 && !sp { mappings::copy_to_tp_region(&b.router, g)? } else { b.router.clone() };
            logits = logits.broadcast_add(&rb)?;
        }
        let (probs, routing) = match &self.scoring {
            Scoring::Softmax => {
                let probs = router_probs(&logits, self.load_balancing.then_some(&self.log))?;
                let routing = Routing::top_k(&probs, self.top_k)?;
                (probs, routing)
            }
            Scoring::Sigmoid { bias, groups, .. } => {
                let s = router_sigmoid(&logits, bias)?;
                let choice = s.detach().broadcast_add(&bias.detach())?;
                (s, Routing::top_k(&within_groups(&choice, *groups, 2)?, self.top_k)?)
            }
            Scoring::SoftmaxGroups { groups, .. } => {
                let probs = router_probs(&logits, None)?;
                let routing = Routing::top_k(&within_groups(&probs.detach(), *groups, 1)?, self.top_k)?;
                (probs, routing)
            }
        };
        let sums: Option<Vec<f32>> = match self.load_balancing {
            true => Some(probs.detach().sum(0)?.to_vec1()?),
            false => None,
        };
        self.log.record(&routing.counts, sums.as_deref(), n);
        let dev = x.device();
        let k = self.top_k;
        let chosen = Tensor::from_vec(routing.experts.clone(), (n, k), dev)?;
        let mut w = probs.gather(&chosen, 1)?;
        if self.norm_topk {
            w = w.broadcast_div(&w.sum_keepdim(1)?)?;
        }
        if let Scoring::Sigmoid { scale, .. } | Scoring::SoftmaxGroups { scale, .. } = &self.scoring {
            w = (w * *scale)?;
        }
        let w = w.to_dtype(x.dtype())?;
        let sorted = routing.sorted_tokens();
        // the adapters' dropout keys of the rows grouped by expert (LoRA dropout while training)
        let keys = match &self.lora {
            Some(l) => l.expert_keys(&sorted, &routing.counts, n)?,
            None => None,
        };
        let rows = Tensor::from_vec(sorted, n * k, dev)?;
        let xs = x2.index_select(&rows, 0)?;
        let ys = match &self.ep {
            None => self.experts(&xs, &routing.counts, keys.as_deref())?,
            Some(ep) => {
                // to the ranks holding the experts, through this rank's E/ep, and back
                let ex = ExpertExchange::new(&routing.counts, ep)?;
                let keys = keys.map(|k| ex.dispatch_keys(&k, dev)).transpose()?;
                let yl = self.experts(&dispatch_to_experts(&xs, &ex)?, ex.local_counts(), keys.as_deref())?;
                return_from_experts(&yl, &ex)?
            }
        };
        // back to (token, slot) order, weighted, summed over the slots
        let mut y = combine(&ys, &w, &routing.inverse)?;
        if let Some(s) = &self.shared {
            // sigmoid(x·wᵀ) from elementwise ops (every backend), times this rank's partial sums
            let gate = match &s.weight {
                None => None,
                Some(weight) => {
                    let sw = if p > 1 && !sp { mappings::copy_to_tp_region(weight, g)? } else { weight.clone() };
                    let gate_logits = match &self.lora {
                        Some(l) => l.router_logits(1, &x2, &sw, tokens.as_ref().map(|t| t.as_slice()), &self.tp)?,
                        None => x2.matmul(&sw.t()?)?,
                    };
                    Some((gate_logits.neg()?.exp()? + 1.0)?.recip()?)
                }
            };
            // (with the adapters' updates on this rank's slices, crate::moe_lora)
            let proj = |i: usize, x: &Tensor, w: &Tensor| -> Result<Tensor> {
                match &self.lora {
                    Some(l) => l.shared_proj(i, x, w, tokens.as_ref().map(|t| t.as_slice()), &self.tp),
                    None => x.matmul(&w.t()?),
                }
            };
            let m = self.act.gated(&proj(0, &x2, &s.gate)?, &proj(1, &x2, &s.up)?)?;
            let out = proj(2, &m, &s.down)?;
            y = match gate {
                Some(gate) => (y + out.broadcast_mul(&gate)?)?,
                None => (y + out)?,
            };
        }
        let y = y.reshape((b, t, h))?;
        if sp {
            mappings::reduce_scatter_to_sp_region(&y, g, SEQ_DIM)
        } else if p > 1 {
            mappings::reduce_from_tp_region(&y, g)
        } else {
            Ok(y)
        }
    }
}

impl SparseMoe {
    /// The experts' SwiGLU on rows grouped by expert (`counts`, one per expert held), with
    /// their adapters' updates (`keys`: the rows' dropout keys, crate::moe_lora).
    fn experts(&self, xs: &Tensor, counts: &[usize], keys: Option<&[u64]>) -> Result<Tensor> {
        let ep = self.ep.is_some();
        // gpt-oss: each row's expert's biases inside the grouped matmuls' nodes (no [rows, ·]
        // bias tensor kept); the down bias: this TP rank's columns of h
        let bias = |i: usize| -> Result<Option<(&Tensor, usize)>> {
            let Some(b) = &self.biases else { return Ok(None) };
            Ok(Some(match i {
                0 => (&b.gate, 0),
                1 => (&b.up, 0),
                _ => (&b.down, self.tp.group.rank() * b.down.dim(1)?),
            }))
        };
        let proj = |i: usize, x: &Tensor, w: &Tensor| -> Result<Tensor> {
            match (&self.lora, bias(i)?) {
                (Some(l), b) => l.expert_proj(i, x, w, b, counts, keys, &self.tp, ep),
                (None, Some((b, col0))) => grouped_matmul_bias(x, w, b, col0, counts),
                (None, None) => grouped_matmul(x, w, counts),
            }
        };
        let gate = proj(0, xs, &self.gate)?;
        let up = proj(1, xs, &self.up)?;
        proj(2, &self.act.gated(&gate, &up)?, &self.down)
    }
}

/// The router's probabilities `softmax(logits)` `[N, E]` in f32, one node that keeps only
/// `logits` (the backward recomputes the softmax). Their gradient gains the load-balancing
/// loss's derivative `[E]` (broadcast over the tokens) when a log has one at backward time.
fn router_probs(logits: &Tensor, log: Option<&RouterLog>) -> Result<Tensor> {
    // (from candle's elementwise ops and reductions, which every backend has)
    let softmax = |l: &Tensor| -> Result<Tensor> {
        let l = l.to_dtype(DType::F32)?;
        let e = l.broadcast_sub(&l.max_keepdim(D::Minus1)?)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
    };
    let probs = softmax(&logits.detach())?;
    let (log, kept) = (log.cloned(), logits.detach());
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let dy = match log.as_ref().and_then(|l| l.grad()) {
            Some(g) => dy.broadcast_add(&g.to_device(dy.device())?.to_dtype(dy.dtype())?.unsqueeze(0)?)?,
            None => dy.clone(),
        };
        let p = softmax(&kept)?;
        let dl = (&p * dy.broadcast_sub(&(&p * &dy)?.sum_keepdim(D::Minus1)?)?)?;
        Ok(vec![Some(dl.to_dtype(kept.dtype())?)])
    });
    attach1("router_probs", logits, probs, bwd)
}

/// `x·wᵀ` in f32 (`x` `[N, h]`, `w` `[E, h]` in a 16-bit dtype), one node keeping `x` and `w`
/// as they are (the backward casts them again), not f32 copies of them.
fn logits_f32(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let out = f(&x.detach())?.matmul(&f(&w.detach())?.t()?)?;
    let (xk, wk) = (x.detach(), w.detach());
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let dy = dy.to_dtype(DType::F32)?;
        let dx = dy.matmul(&f(&wk)?)?.to_dtype(xk.dtype())?;
        let dw = dy.t()?.matmul(&f(&xk)?)?.to_dtype(wk.dtype())?;
        Ok(vec![Some(dx), Some(dw)])
    });
    candle_cp_ops::autograd::attach2("router_logits_f32", x, w, out, bwd)
}

/// GLM-4.5's scores `sigmoid(logits)` `[N, E]` in f32, one node that keeps only `logits`;
/// `bias` (`[E]`, which chooses the experts from the scores and nothing else) gets a zero
/// gradient through it.
fn router_sigmoid(logits: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let sig = |l: &Tensor| -> Result<Tensor> { (l.to_dtype(DType::F32)?.neg()?.exp()? + 1.0)?.recip() };
    let s = sig(&logits.detach())?;
    let (kept, b) = (logits.detach(), bias.detach());
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let s = sig(&kept)?;
        let dl = (dy * (&s * (1.0 - &s)?)?)?;
        Ok(vec![Some(dl.to_dtype(kept.dtype())?), Some(b.zeros_like()?)])
    });
    candle_cp_ops::autograd::attach2("router_sigmoid", logits, bias, s, bwd)
}

/// `choice` `[N, E]` (f32) with the experts outside each row's best `topk_group` of `n_group`
/// groups (a group's score: the sum of its `best` best experts — two for GLM-4.5's router and
/// DeepSeek-V3's, one for DeepSeek-V2's `group_limited_greedy`) set to 0, as those routers mask
/// them; itself with one group or every group kept.
pub(crate) fn within_groups(choice: &Tensor, (groups, keep): (usize, usize), best: usize) -> Result<Tensor> {
    if groups <= 1 || keep >= groups {
        return Ok(choice.clone());
    }
    let (n, e) = choice.dims2()?;
    if !e.is_multiple_of(groups) || e / groups < 2 {
        bail!("expert groups: {groups} groups of the {e} experts of scores {:?} (each needs two or more)", choice.dims())
    }
    let per = e / groups;
    let mut c: Vec<f32> = choice.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    for row in c.chunks_mut(e) {
        let score = |g: usize| -> f32 {
            let mut v: Vec<f32> = row[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            v.iter().take(best).sum::<f32>()
        };
        let mut order: Vec<(usize, f32)> = (0..groups).map(|g| (g, score(g))).collect();
        // (best first; ties: the lower group)
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for &(g, _) in &order[keep..] {
            row[g * per..(g + 1) * per].fill(0.0);
        }
    }
    Tensor::from_vec(c, (n, e), choice.device())
}

#[cfg(test)]
mod tests {
    /// The f32 router logits of bf16 inputs: the product of the inputs cast to f32, and the
    /// gradients of the same product taken through casts by candle's autograd.
    #[test]
    fn f32_logits_of_bf16_inputs() -> candle_core::Result<()> {
        use candle_core::{DType, Device, Tensor, Var};
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 8), &dev)?.to_dtype(DType::BF16)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 8), &dev)?.to_dtype(DType::BF16)?)?;
        let dy = Tensor::randn(0f32, 1.0, (5, 3), &dev)?;
        let got = super::logits_f32(x.as_tensor(), w.as_tensor())?;
        let want = x.as_tensor().to_dtype(DType::F32)?.matmul(&w.as_tensor().to_dtype(DType::F32)?.t()?)?;
        assert_eq!((got.dtype(), (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?), (DType::F32, 0.0));
        let g = (got * &dy)?.sum_all()?.backward()?;
        let h = (want * &dy)?.sum_all()?.backward()?;
        for v in [&x, &w] {
            let (a, b) = (g.get(v.as_tensor()).expect("grad"), h.get(v.as_tensor()).expect("grad"));
            assert_eq!(a.dtype(), DType::BF16);
            assert_eq!((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
        }
        Ok(())
    }

    /// Groups of two: a row keeps the experts of its best groups (a group's score the sum of its
    /// two), the others at 0; one group, or every group kept, leaves the row as it is.
    #[test]
    fn within_groups_by_hand() -> candle_core::Result<()> {
        let c = candle_core::Tensor::new(&[[0.9f32, 0.1, 0.5, 0.4, 0.3, 0.3], [0.0, 1.0, 0.6, 0.6, 0.2, 0.1]], &candle_core::Device::Cpu)?;
        let got = super::within_groups(&c, (3, 1), 2)?.to_vec2::<f32>()?;
        assert_eq!(got, vec![vec![0.9, 0.1, 0.0, 0.0, 0.0, 0.0], vec![0.0, 0.0, 0.6, 0.6, 0.0, 0.0]]);
        let two = super::within_groups(&c, (3, 2), 2)?.to_vec2::<f32>()?;
        assert_eq!(two[0], vec![0.9, 0.1, 0.5, 0.4, 0.0, 0.0]);
        assert_eq!(super::within_groups(&c, (1, 1), 2)?.to_vec2::<f32>()?, c.to_vec2::<f32>()?);
        assert!(super::within_groups(&c, (6, 1), 2).is_err());
        Ok(())
    }

    /// Balanced counts give 1, a layer whose busiest expert has twice the mean 2: their mean
    /// 1.5; a layer that routed nothing is left out; no layers, no figure.
    #[test]
    fn load_balance_by_hand() {
        let layers = vec![vec![2.0, 2.0, 2.0, 2.0], vec![4.0, 0.0, 2.0, 2.0], vec![0.0; 4]];
        assert_eq!(super::load_balance(&layers), Some(1.5));
        assert_eq!(super::load_balance(&[]), None);
    }
}
