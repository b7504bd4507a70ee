//! One optimizer step's gradients in [`super::train_rank`]: accumulated over the micro-batches,
//! then summed over the layout's groups ([`crate::grads`]).
//!
//! | mode | gradients summed over exactly the replicas (`dp_cp`) | when |
//! |------|--------------------------------------------------------|------|
//! | plain | all-reduced, whole | after the last backward |
//! | ZeRO-1 | reduce-scattered into this rank's slices | after the last backward |
//! | ZeRO-2 | reduce-scattered into f32 slices, summed over the micro-batches | after every backward |
//! | any, `overlap_grad_sync` | as above, started layer by layer ([`super::overlap`]) | during the (last, or every under ZeRO-2) backward |
//!
//! The gradients summed over more ranks (norm weights under SP, KV heads held by several TP
//! ranks) are accumulated whole and all-reduced after the last backward in every mode. Under
//! expert parallelism with ZeRO splitting the experts' state ([`AdamW::splits_experts`]) the
//! stacked experts' gradients are reduce-scattered over the ranks holding them (`ep_dp`), after
//! the replicas': after the last backward (ZeRO-1), after every backward (ZeRO-2); otherwise
//! they are all-reduced over `ep_dp` with the others.
//! ZeRO-2 keeps no whole gradient of the replicas' parameters from one micro-batch to the
//! next (only the f32 slices: `4/R` bytes per parameter instead of `e`), at the price of one
//! reduce-scatter per micro-batch instead of one per step. Its sums are the micro-batches'
//! reduced slices added in f32, not the reduced sum of the micro-batches: equal up to
//! rounding (the other modes are bit-identical to each other).

use super::optim::AdamW;
use super::overlap::GradOverlap;
use crate::config::LlamaConfig;
use crate::grads::{named_grads, reduce_gradients, reduce_gradients_for_zero, Skip};
use crate::layout::ParallelCtx;
use crate::Llama;
use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor};
use candle_nn::VarMap;
use std::collections::HashMap;

/// How a run's gradients are accumulated and summed (built once per run).
pub(crate) struct GradSteps {
    varmap: VarMap,
    cfg: LlamaConfig,
    ctx: ParallelCtx,
    /// Every parameter (name, variable), for the accumulation.
    vars: Vec<(String, Tensor)>,
    /// The parameters whose gradient is summed over exactly `dp_cp`.
    replica: Vec<(String, Tensor)>,
    /// ZeRO-2 splitting the experts' state ([`AdamW::splits_experts`]): the experts, whose
    /// gradients are reduce-scattered over the ranks holding them after every backward too.
    experts: Vec<(String, Tensor)>,
    overlap: Option<GradOverlap>,
    zero2: bool,
}

/// One step's gradients so far.
#[derive(Default)]
pub(crate) struct StepGrads {
    acc: Option<GradStore>,
    /// ZeRO-2: this rank's f32 slices, summed over the micro-batches.
    slices: HashMap<String, Tensor>,
}

/// A step's summed gradients: whole ones, and this rank's ZeRO slices (`[len]`).
pub(crate) struct Summed {
    pub whole: HashMap<String, Tensor>,
    pub slices: HashMap<String, Tensor>,
}

impl GradSteps {
    /// `overlap`: start the replicas' sums layer by layer during the backward (needs the
    /// model's recompute; a collective split of `ctx.dp_cp`). `zero2`: reduce-scatter every
    /// micro-batch (needs `opt` sharded).
    pub fn new(model: &Llama, varmap: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx, opt: &AdamW, overlap: bool, zero2: bool) -> Result<Self> {
        if zero2 && !opt.is_sharded() && ctx.dp_cp.size() > 1 {
            bail!("train: zero2 needs the optimizer state split over the replicas (AdamW::new_zero1)")
        }
        let all = crate::params::lock_vars(varmap)?.clone();
        let mut vars = Vec::new();
        let mut replica = Vec::new();
        let mut experts = Vec::new();
        for s in crate::params::trainable_specs(cfg) {
            let Some(v) = all.get(&s.name) else { bail!("train: parameter {} is not in the VarMap", s.name) };
            if ctx.param_grad_group_is_dp_cp(&s) {
                replica.push((s.name.clone(), v.as_tensor().clone()));
            } else if zero2 && opt.splits_experts() && s.is_expert() && ctx.ep.is_some() {
                experts.push((s.name.clone(), v.as_tensor().clone()));
            }
            vars.push((s.name, v.as_tensor().clone()));
        }
        let overlap = match (overlap, model.recompute_store()) {
            (false, _) => None,
            (true, None) => bail!("train: overlap_grad_sync needs recompute"),
            (true, Some(_)) if ctx.dp_cp.size() == 1 => None,
            (true, Some(rc)) => {
                let group = ctx.dp_cp.split(0, ctx.dp_cp.rank())?;
                let ov = GradOverlap::new(replica.clone(), group, opt.zero().cloned())?.with_f32_slices(zero2)?;
                rc.set_block_hook(Some(ov.hook()))?;
                Some(ov)
            }
        };
        let zero2 = zero2 && ctx.dp_cp.size() > 1;
        Ok(Self { varmap: varmap.clone(), cfg: cfg.clone(), ctx: ctx.clone(), vars, replica, experts, overlap, zero2 })
    }

    /// Before a micro-batch's backward (`last`: the step's last one): arm the overlap.
    pub fn before_backward(&self, st: &mut StepGrads, last: bool) -> Result<()> {
        match &self.overlap {
            Some(ov) if self.zero2 => ov.arm(HashMap::new()),
            Some(ov) if last => ov.arm(ov.take_prev(st.acc.as_mut())?),
            _ => Ok(()),
        }
    }

    /// After a micro-batch's backward: file its gradients `g` (ZeRO-2: sum the replicas'
    /// into the slices now).
    pub fn after_backward(&self, st: &mut StepGrads, mut g: GradStore, opt: &AdamW) -> Result<()> {
        if self.zero2 {
            let mut slices = match &self.overlap {
                Some(ov) => ov.finish(&mut g)?,
                None => {
                    let mut whole = HashMap::new();
                    for (name, var) in &self.replica {
                        let t = match g.remove(var) {
                            Some(t) => t,
                            None => var.zeros_like()?,
                        };
                        whole.insert(name.clone(), t);
                    }
                    opt.reduce_scatter_grads_f32(&whole)?
                }
            };
            // the experts' (split over the ranks holding them), after the replicas'
            if !self.experts.is_empty() {
                let mut whole = HashMap::new();
                for (name, var) in &self.experts {
                    whole.insert(name.clone(), g.remove(var).map_or_else(|| var.zeros_like(), Ok)?);
                }
                slices.extend(opt.reduce_scatter_grads_f32(&whole)?);
            }
            for (name, s) in slices {
                let sum = match st.slices.remove(&name) {
                    Some(a) => (a + s)?,
                    None => s,
                };
                st.slices.insert(name, sum);
            }
        }
        st.acc = Some(match st.acc.take() {
            None => g,
            Some(mut a) => {
                for (_, var) in &self.vars {
                    if let Some(gi) = g.get(var) {
                        let sum = match a.get(var) {
                            Some(ai) => (ai + gi)?,
                            None => gi.clone(),
                        };
                        a.insert(var, sum);
                    }
                }
                a
            }
        });
        Ok(())
    }

    /// After the last micro-batch: the summed gradients (collective over the world group).
    pub fn finish(&self, st: StepGrads, opt: &AdamW) -> Result<Summed> {
        let Some(mut grads) = st.acc else { bail!("train: no micro-batch ran") };
        let (vm, cfg, ctx) = (&self.varmap, &self.cfg, &self.ctx);
        // the replicas' sums: done (ZeRO-2), started during the backward (overlap), or to do
        let early = match (&self.overlap, self.zero2) {
            (_, true) => Some(st.slices),
            (Some(ov), false) => Some(ov.finish(&mut grads)?),
            (None, false) => None,
        };
        // (ZeRO with expert parallelism: the experts' gradients reduce-scattered over the ranks
        // holding them, after the others; ZeRO-2 has summed them into its slices already)
        let experts = match (opt.splits_experts(), self.experts.is_empty()) {
            (false, _) => Skip::No,
            (true, true) => Skip::Fill,
            (true, false) => Skip::NoFill,
        };
        let (sliced, expert_names) = if early.is_some() {
            reduce_gradients_for_zero(&mut grads, vm, cfg, ctx, Skip::NoFill, experts)?
        } else if opt.is_sharded() {
            reduce_gradients_for_zero(&mut grads, vm, cfg, ctx, Skip::Fill, experts)?
        } else {
            reduce_gradients(&mut grads, vm, cfg, ctx)?;
            (Vec::new(), Vec::new())
        };
        let mut whole = named_grads(&grads, vm)?;
        drop(grads);
        let replicas: HashMap<String, Tensor> = sliced.iter().filter_map(|n| whole.remove_entry(n)).collect();
        let expert_grads: HashMap<String, Tensor> = expert_names.iter().filter_map(|n| whole.remove_entry(n)).collect();
        let mut slices = match early {
            Some(e) => {
                let early_experts: &[String] = if self.experts.is_empty() { &[] } else { &expert_names };
                if e.len() != sliced.len() + early_experts.len() || sliced.iter().chain(early_experts).any(|n| !e.contains_key(n)) {
                    bail!("train: the early-summed gradients ({}) are not the replicas' ({}) and experts' ({}) (internal error)", e.len(), sliced.len(), early_experts.len())
                }
                if opt.is_sharded() {
                    e
                } else {
                    whole.extend(e);
                    HashMap::new()
                }
            }
            None => opt.reduce_scatter_grads(&replicas)?,
        };
        if !expert_grads.is_empty() {
            slices.extend(opt.reduce_scatter_grads(&expert_grads)?);
        }
        Ok(Summed { whole, slices })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{CpKind, Layout};
    use crate::{init_params, shard_batch, shard_params};
    use candle_core::{DType, Device};
    use candle_cp_comm::run_ranks;
    use candle_nn::VarBuilder;

    /// ZeRO-2 on CP 2 × DP 2, 2 micro-batches, with and without the overlap: between the
    /// micro-batches no whole gradient of a replicas' parameter is kept, only f32 slices of
    /// `ceil(n/4)` elements; the step's slices are the same with and without the overlap
    /// (bit for bit), and equal ZeRO-1's (which sums the micro-batches first) to rounding.
    #[test]
    fn zero2_keeps_only_slices_between_micro_batches() -> Result<()> {
        let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
        let ids = Tensor::arange(0u32, 64, &Device::Cpu)?.reshape((2, 32))?;
        let layout = Layout::cp(CpKind::Zigzag, 2).with_dp(2);
        for r in run_ranks(4, |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_params(&init_params(&cfg, 5, DType::BF16, &Device::Cpu)?, &cfg, &ctx)?;
            let m = Llama::new(VarBuilder::from_varmap(&vm, DType::BF16, &Device::Cpu), &cfg, &ctx)?.with_recompute(true);
            let named: Vec<(String, candle_core::Var)> = crate::params::lock_vars(&vm)?.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            let opt = AdamW::new_zero1(named, Default::default(), ctx.dp_cp.clone())?;
            let b = shard_batch(&ids, &ctx)?;
            let mut out = Vec::new();
            for (overlap, zero2) in [(false, true), (true, true), (false, false)] {
                let gs = GradSteps::new(&m, &vm, &cfg, &ctx, &opt, overlap, zero2)?;
                let mut st = StepGrads::default();
                for micro in 0..2 {
                    gs.before_backward(&mut st, micro == 1)?;
                    let loss = (m.loss(&b.input_ids, &b.labels, &b.positions)?.0 * (1.0 + micro as f64))?;
                    gs.after_backward(&mut st, m.backward(&loss)?, &opt)?;
                    if zero2 {
                        let acc = st.acc.as_ref().expect("accumulated");
                        for (name, var) in &gs.replica {
                            assert!(acc.get(var).is_none(), "{name}: whole gradient kept between micro-batches");
                            let s = &st.slices[name];
                            assert_eq!((s.dims(), s.dtype()), (&[var.elem_count().div_ceil(4).min(var.elem_count())][..], DType::F32), "{name}");
                        }
                    }
                }
                let summed = gs.finish(st, &opt)?;
                m.recompute_store().expect("recompute").set_block_hook(None)?;
                let mut slices: Vec<(String, Vec<f32>)> = summed
                    .slices
                    .iter()
                    .map(|(n, t)| Ok((n.clone(), t.to_dtype(DType::F32)?.to_vec1()?)))
                    .collect::<Result<_>>()?;
                slices.sort_by(|a, b| a.0.cmp(&b.0));
                out.push(slices);
            }
            Ok(out)
        }) {
            let out = r?;
            assert_eq!(out[0], out[1], "ZeRO-2 with and without the overlap");
            for ((n, a), (_, b)) in out[0].iter().zip(&out[2]) {
                // (ZeRO-1 adds the micro-batches in bf16 and rounds the sum to bf16: 2^-8)
                let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
                let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale.max(1e-30);
                assert!(d < 1e-2, "{n}: ZeRO-2 vs ZeRO-1, max |diff| / max |x| = {d}");
            }
        }
        Ok(())
    }
}
