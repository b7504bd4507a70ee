//! Gradient reduction overlapped with the backward ([`super::TrainConfig::overlap_grad_sync`]).
//!
//! Without it the trainer sums the gradients over the data- and context-parallel replicas
//! (`R = DP × CP` ranks) after the last micro-batch's backward has finished: the link idles
//! during the backward, the compute idles during the reduction. With recomputed layers
//! ([`crate::Llama::with_recompute`]) the backward finishes one decoder layer at a time, last
//! layer first. [`GradOverlap`] starts each layer's reduction the moment its backward is done
//! (one all-reduce, or under ZeRO-1 one reduce-scatter, of the layer's gradients packed in
//! f32) on a communicator of its own, so it runs beside the backward of the layers below and
//! beside the ring and TP collectives on the other communicators. Everything is waited for
//! once the backward is over:
//!
//! ```text
//! backward : [layer L-1][layer L-2][layer L-3] ... [layer 0][embeddings, head]
//! gradients:            [sum L-1  ][sum L-2  ] ...  [sum 1 ][sum 0][rest] → wait
//! ```
//!
//! Which gradients: those summed over exactly the replicas (every TP-sharded weight, and the
//! replicated ones without sequence parallelism), i.e. nearly all bytes. Norm weights under
//! SP and KV heads held by several TP ranks are summed over TP ranks too; they stay in the
//! synchronous path after the backward (they are small). The sums are the ones the
//! synchronous path computes (same ranks, f32; on thread groups in rank order, so a run with
//! overlap is the run without it, bit for bit). With gradient accumulation only the last
//! micro-batch starts reductions; each layer's gradient is first added to the sum of the
//! earlier micro-batches, as the synchronous path adds them.
//!
//! Memory: a started sum holds its f32 input until it completes. At most [`MAX_INFLIGHT`]
//! elements (1 GiB of f32) are in flight: starting more first waits for the oldest sums (whose
//! results are kept: the reduced gradient, or under ZeRO-1 only this rank's slice). When the
//! link keeps up with the backward the oldest sum is already done and nothing waits; when it
//! does not, the link stays busy either way.
//!
//! Every rank must run the same blocks in the same order (they do: the model is the same on
//! every rank), and each parameter must be used by one recomputed block only (else its
//! gradient is not complete when the block's backward ends; a second block is refused).

use super::zero::{pack_rows, span, unpack_slices, Zero, BUCKET};
use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Result, Shape, Tensor, TensorId};
use candle_cp_comm::{Group, PendingRecv};
use candle_cp_ops::recompute::BlockGradsHook;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// Elements of f32 gradient buffers in flight at most (2^28: 1 GiB), besides the newest bucket.
pub(crate) const MAX_INFLIGHT: usize = 1 << 28;

/// One parameter whose gradient is reduced early: its order (the same on every rank), name
/// and variable.
struct Param {
    order: usize,
    name: String,
    var: Tensor,
}

/// A started bucket: the gradients' names, shapes and dtypes, and the pending sum.
struct Inflight {
    items: Vec<(String, Shape, DType)>,
    pending: Box<dyn PendingRecv>,
    elems: usize,
}

struct State {
    params: HashMap<TensorId, Param>,
    /// How sums travel: `Some` = reduce-scatter into this rank's ZeRO-1 slices.
    zero: Option<Zero>,
    group: Group,
    armed: bool,
    /// Sum of the earlier micro-batches' gradients, by name (the early-reduced ones only).
    prev: HashMap<String, Tensor>,
    started: HashSet<String>,
    inflight: Vec<Inflight>,
    /// Elements in flight (f32 input buffers of `inflight`), and the bound.
    inflight_elems: usize,
    max_inflight: usize,
    /// Results of the sums already waited for.
    done: HashMap<String, Tensor>,
    /// ZeRO slices in f32 instead of the gradients' dtype (ZeRO-2 adds them up).
    f32_slices: bool,
}

/// Starts the reduction of each recomputed block's gradients as soon as the backward is done
/// with it (see the module docs). One per rank; [`GradOverlap::hook`] goes to the model's
/// [`candle_cp_ops::recompute::Recompute`].
#[derive(Clone)]
pub(crate) struct GradOverlap {
    st: Arc<Mutex<State>>,
}

fn lock(st: &Mutex<State>) -> Result<MutexGuard<'_, State>> {
    st.lock().map_err(|_| candle_core::Error::Msg("GradOverlap: state lock poisoned".into()))
}

impl GradOverlap {
    /// `params`: `(name, variable)` of the gradients summed over exactly the replicas, in an
    /// order that is the same on every rank. `group`: a communicator over the replicas of
    /// its own (a split of `dp_cp`). `zero`: reduce-scatter into ZeRO-1 slices (its group is
    /// replaced by `group`) instead of all-reducing.
    pub fn new(params: Vec<(String, Tensor)>, group: Group, zero: Option<Zero>) -> Result<Self> {
        if let Some(z) = &zero {
            if (z.rank, z.size) != (group.rank(), group.size()) {
                bail!("GradOverlap: ZeRO rank {} of {} but the group's rank {} of {}", z.rank, z.size, group.rank(), group.size())
            }
        }
        let zero = zero.map(|z| Zero { group: group.clone(), ..z });
        let params = params
            .into_iter()
            .enumerate()
            .map(|(order, (name, var))| (var.id(), Param { order, name, var }))
            .collect();
        let st = State {
            params,
            zero,
            group,
            armed: false,
            prev: HashMap::new(),
            started: HashSet::new(),
            inflight: Vec::new(),
            inflight_elems: 0,
            max_inflight: MAX_INFLIGHT,
            done: HashMap::new(),
            f32_slices: false,
        };
        Ok(Self { st: Arc::new(Mutex::new(st)) })
    }

    /// With `on`, ZeRO slices come back in f32 (for ZeRO-2, which sums them over the
    /// micro-batches) instead of in the gradients' dtype.
    pub fn with_f32_slices(self, on: bool) -> Result<Self> {
        lock(&self.st)?.f32_slices = on;
        Ok(self)
    }

    /// Bound the f32 elements in flight (besides the newest bucket) to `n` instead of
    /// [`MAX_INFLIGHT`].
    #[cfg(test)]
    fn with_max_inflight(self, n: usize) -> Result<Self> {
        lock(&self.st)?.max_inflight = n;
        Ok(self)
    }

    /// The hook for [`candle_cp_ops::recompute::Recompute::set_block_hook`].
    pub fn hook(&self) -> BlockGradsHook {
        let st = self.st.clone();
        Arc::new(move |g: &mut GradStore| {
            let mut st = lock(&st)?;
            if !st.armed {
                return Ok(());
            }
            // taken out of the store: the local gradient goes once its sum has started
            let mut found: Vec<(usize, String, Tensor)> =
                st.params.values().filter_map(|p| g.remove(&p.var).map(|t| (p.order, p.name.clone(), t))).collect();
            found.sort_by_key(|f| f.0);
            let mut items = Vec::with_capacity(found.len());
            for (_, name, grad) in found {
                if st.started.contains(&name) {
                    bail!("overlap_grad_sync: parameter {name} is used by two recomputed blocks: its gradient is not complete after the first")
                }
                let total = match st.prev.remove(&name) {
                    Some(p) => (p + grad)?,
                    None => grad,
                };
                items.push((name, total));
            }
            start(&mut st, items)
        })
    }

    /// Arm for the last micro-batch of a step: `prev` holds the sum of the earlier
    /// micro-batches' gradients (empty without accumulation). The gradients of the blocks
    /// the backward reruns from now on are taken from the backward's store (they are not in
    /// the store [`crate::Llama::backward`] returns); [`GradOverlap::finish`] returns their sums.
    pub fn arm(&self, prev: HashMap<String, Tensor>) -> Result<()> {
        let mut st = lock(&self.st)?;
        st.armed = true;
        st.prev = prev;
        st.started.clear();
        st.inflight.clear();
        st.inflight_elems = 0;
        st.done.clear();
        Ok(())
    }

    /// The earlier micro-batches' sums that [`GradOverlap::arm`] needs, taken out of the
    /// accumulated gradients (what a block's sum starts from; the other parameters' stay).
    pub fn take_prev(&self, acc: Option<&mut GradStore>) -> Result<HashMap<String, Tensor>> {
        let st = lock(&self.st)?;
        let Some(acc) = acc else { return Ok(HashMap::new()) };
        Ok(st.params.values().filter_map(|p| acc.remove(&p.var).map(|t| (p.name.clone(), t))).collect())
    }

    /// After the last backward: start the parameters no block reported (embeddings, head,
    /// final norm; taken from `grads`, the accumulated gradients, zeros where a rank has
    /// none; with the earlier micro-batches' sum from [`GradOverlap::arm`] added first), wait
    /// for every sum and return them by name: whole gradients, or this rank's ZeRO-1 slices
    /// (`[len]`), in each gradient's dtype. Every early-reduced gradient leaves `grads`.
    pub fn finish(&self, grads: &mut GradStore) -> Result<HashMap<String, Tensor>> {
        let mut st = lock(&self.st)?;
        if !st.armed {
            bail!("GradOverlap::finish without arm (internal error)")
        }
        st.armed = false;
        let mut rest: Vec<(usize, String, Tensor)> = Vec::new();
        let mut prev = std::mem::take(&mut st.prev);
        for p in st.params.values() {
            let g = grads.remove(&p.var);
            if st.started.contains(&p.name) {
                continue;
            }
            let g = match (prev.remove(&p.name), g) {
                (Some(a), Some(g)) => (a + g)?,
                (Some(a), None) => a,
                (None, Some(g)) => g,
                (None, None) => p.var.zeros_like()?,
            };
            rest.push((p.order, p.name.clone(), g));
        }
        rest.sort_by_key(|r| r.0);
        start(&mut st, rest.into_iter().map(|(_, n, g)| (n, g)).collect())?;
        while !st.inflight.is_empty() {
            complete_oldest(&mut st)?;
        }
        st.started.clear();
        st.prev.clear();
        Ok(std::mem::take(&mut st.done))
    }
}

/// Wait for the oldest started sum and file its results in `st.done`.
fn complete_oldest(st: &mut State) -> Result<()> {
    if st.inflight.is_empty() {
        return Ok(());
    }
    let f = st.inflight.remove(0);
    st.inflight_elems -= f.elems;
    let sum = f.pending.wait()?;
    match &st.zero {
        Some(z) => {
            let f32s = st.f32_slices;
            let meta: Vec<(usize, DType)> = f.items.iter().map(|(_, s, d)| (s.elem_count(), if f32s { DType::F32 } else { *d })).collect();
            for ((name, _, _), s) in f.items.iter().zip(unpack_slices(z, &meta, &sum)?) {
                st.done.insert(name.clone(), s);
            }
        }
        None => {
            let mut off = 0;
            for (name, shape, dtype) in f.items {
                let n = shape.elem_count();
                st.done.insert(name, sum.narrow(0, off, n)?.reshape(shape)?.to_dtype(dtype)?);
                off += n;
            }
        }
    }
    Ok(())
}

/// Start the sums of `items` (in this order on every rank), in buckets of at most
/// [`BUCKET`] elements (a bucket closes once it reaches it).
fn start(st: &mut State, items: Vec<(String, Tensor)>) -> Result<()> {
    let mut i = 0;
    while i < items.len() {
        let mut end = i;
        let mut elems = 0;
        while end < items.len() && (end == i || elems < BUCKET) {
            let n = items[end].1.elem_count();
            elems += match &st.zero {
                Some(z) => span(n, 0, z.size).2 * z.size,
                None => n,
            };
            end += 1;
        }
        let bucket = &items[i..end];
        let grads: Vec<Tensor> = bucket.iter().map(|(_, g)| g.clone()).collect();
        let pending = match &st.zero {
            Some(z) => st.group.reduce_scatter_start(&pack_rows(z, &grads)?, 0)?,
            None => {
                let flat = grads.iter().map(|g| g.to_dtype(DType::F32)?.flatten_all()).collect::<Result<Vec<_>>>()?;
                st.group.all_reduce_start(&Tensor::cat(&flat, 0)?)?
            }
        };
        for (name, _) in bucket {
            st.started.insert(name.clone());
        }
        let items = bucket.iter().map(|(n, g)| (n.clone(), g.shape().clone(), g.dtype())).collect();
        st.inflight.push(Inflight { items, pending, elems });
        st.inflight_elems += elems;
        // bounded memory: the oldest sums complete before more start (the newest stays)
        while st.inflight.len() > 1 && st.inflight_elems - elems > st.max_inflight {
            complete_oldest(st)?;
        }
        i = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{CpKind, Layout, ParallelCtx};
    use crate::{init_params, named_grads, param_specs, reduce_gradients, shard_batch, shard_params, Llama, LlamaConfig};
    use candle_core::Device;
    use candle_cp_comm::run_ranks;
    use candle_nn::VarBuilder;

    fn f32s(t: &Tensor) -> Result<Vec<f32>> {
        t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
    }

    /// Two micro-batches, the second armed: each of the 3 recomputed layers starts its sum
    /// during the backward (3 buckets in flight when it returns, before `finish`; 1 when the
    /// in-flight bound is 0: each new bucket first completes the older ones); `finish`
    /// returns what `reduce_gradients` computes from the accumulated gradients, bit for bit
    /// (whole gradients, or their ZeRO-1 slices), on CP 2 and on TP 2 + SP × DP 2 (where the
    /// norm weights are left to the synchronous path).
    #[test]
    fn layers_start_during_the_backward_and_sum_like_the_synchronous_path() -> Result<()> {
        let cfg = LlamaConfig::tiny(64, 32, 3, 4, 2);
        let ids = Tensor::arange(0u32, 64, &Device::Cpu)?.reshape((2, 32))?;
        let layouts = [Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true).with_dp(2)];
        let cases = layouts.into_iter().flat_map(|l| [(l, false, MAX_INFLIGHT), (l, true, MAX_INFLIGHT), (l, false, 0), (l, true, 0)]);
        for (layout, zero1, bound) in cases {
            for r in run_ranks(layout.world_size(), |g| {
                let ctx = ParallelCtx::new(g, layout)?;
                let vm = shard_params(&init_params(&cfg, 5, DType::BF16, &Device::Cpu)?, &cfg, &ctx)?;
                let m = Llama::new(VarBuilder::from_varmap(&vm, DType::BF16, &Device::Cpu), &cfg, &ctx)?.with_recompute(true);
                let vars = crate::params::lock_vars(&vm)?.clone();
                let early: Vec<(String, Tensor)> = param_specs(&cfg)
                    .into_iter()
                    .filter(|s| ctx.param_grad_group_is_dp_cp(s))
                    .map(|s| (s.name.clone(), vars[&s.name].as_tensor().clone()))
                    .collect();
                let n_early = early.len();
                let z = Zero { group: ctx.dp_cp.clone(), rank: ctx.dp_cp.rank(), size: ctx.dp_cp.size() };
                let ov = GradOverlap::new(early, ctx.dp_cp.split(0, ctx.dp_cp.rank())?, zero1.then(|| z.clone()))?.with_max_inflight(bound)?;
                m.recompute_store().expect("recompute").set_block_hook(Some(ov.hook()))?;
                let b = shard_batch(&ids, &ctx)?;
                let loss = |scale: f64| -> Result<Tensor> { m.loss(&b.input_ids, &b.labels, &b.positions)?.0 * scale };
                // micro-batch 1: not armed, nothing starts
                let merge = |a: &mut GradStore, g: &GradStore| -> Result<()> {
                    for v in vars.values() {
                        if let Some(gi) = g.get(v.as_tensor()) {
                            let s = match a.get(v.as_tensor()) {
                                Some(ai) => (ai + gi)?,
                                None => gi.clone(),
                            };
                            a.insert(v.as_tensor(), s);
                        }
                    }
                    Ok(())
                };
                // the synchronous path: two unarmed backwards, accumulated (a + g)
                let mut acc = m.backward(&loss(1.0)?)?;
                merge(&mut acc, &m.backward(&loss(0.5)?)?)?;
                assert!(lock(&ov.st)?.inflight.is_empty(), "unarmed: nothing started");
                // the overlapped path: the second backward armed with the first one's sums
                let mut mine = m.backward(&loss(1.0)?)?;
                ov.arm(ov.take_prev(Some(&mut mine))?)?;
                let g2 = m.backward(&loss(0.5)?)?;
                let in_flight = lock(&ov.st)?.inflight.len();
                let layer0 = vars["model.layers.0.mlp.down_proj.weight"].as_tensor();
                assert!(g2.get(layer0).is_none(), "a block's early-reduced gradient leaves the store");
                merge(&mut mine, &g2)?;
                let got = ov.finish(&mut mine)?;
                reduce_gradients(&mut acc, &vm, &cfg, &ctx)?;
                let want = named_grads(&acc, &vm)?;
                assert_eq!(got.len(), n_early);
                for (name, gt) in &got {
                    let w = &want[name];
                    let w = if zero1 {
                        let (off, len, _) = span(w.elem_count(), z.rank, z.size);
                        w.flatten_all()?.narrow(0, off, len)?
                    } else {
                        w.clone()
                    };
                    assert_eq!((gt.dims(), gt.dtype()), (w.dims(), w.dtype()), "{name}");
                    assert_eq!(f32s(gt)?, f32s(&w)?, "{name} ({layout}, zero1 {zero1})");
                }
                Ok(in_flight)
            }) {
                let want = if bound == 0 { 1 } else { 3 };
                assert_eq!(r?, want, "buckets in flight after the backward ({layout}, bound {bound})");
            }
        }
        Ok(())
    }

    /// A rank that fails before its backward: the others, whose sums are in flight, get an
    /// error from `finish` naming the failure, within the group's timeout (no hang).
    #[test]
    fn a_failed_rank_fails_the_others_sums() {
        let t0 = std::time::Instant::now();
        let res = run_ranks(2, |g| {
            let w = candle_core::Var::from_tensor(&Tensor::ones((2, 2), DType::F32, &Device::Cpu)?)?;
            let ov = GradOverlap::new(vec![("w".into(), w.as_tensor().clone())], g.split(0, g.rank())?, None)?;
            let rc = candle_cp_ops::recompute::Recompute::new();
            rc.set_block_hook(Some(ov.hook()))?;
            ov.arm(HashMap::new())?;
            if g.rank() == 1 {
                candle_core::bail!("injected failure before the backward")
            }
            let wt = w.as_tensor().clone();
            let h = rc.checkpoint("block", &Tensor::ones((1, 2), DType::F32, &Device::Cpu)?, Arc::new(move |x: &Tensor| x.matmul(&wt)))?;
            let mut grads = rc.backward(&h.sum_all()?)?;
            assert_eq!(lock(&ov.st)?.inflight.len(), 1, "the block's sum started");
            ov.finish(&mut grads).map(|_| ())
        });
        let e = res[0].as_ref().expect_err("rank 0 must fail").to_string();
        assert!(e.contains("injected failure"), "{e}");
        assert!(t0.elapsed().as_secs() < 30, "took {:?}", t0.elapsed());
    }

    /// A parameter reported by two blocks is refused (its first gradient was incomplete).
    #[test]
    fn a_parameter_in_two_blocks_is_refused() -> Result<()> {
        for r in run_ranks(2, |g| {
            let w = candle_core::Var::from_tensor(&Tensor::ones((2, 2), DType::F32, &Device::Cpu)?)?;
            let ov = GradOverlap::new(vec![("w".into(), w.as_tensor().clone())], g.clone(), None)?;
            let rc = candle_cp_ops::recompute::Recompute::new();
            rc.set_block_hook(Some(ov.hook()))?;
            ov.arm(HashMap::new())?;
            let mut h = Tensor::ones((1, 2), DType::F32, &Device::Cpu)?;
            for _ in 0..2 {
                let wt = w.as_tensor().clone();
                h = rc.checkpoint("shared", &h, Arc::new(move |x: &Tensor| x.matmul(&wt)))?;
            }
            Ok(rc.backward(&h.sum_all()?).err().map(|e| e.to_string()))
        }) {
            let msg = r?.expect("a shared parameter must fail the backward");
            assert!(msg.contains("two recomputed blocks"), "{msg}");
        }
        Ok(())
    }
}
