//! AdamW with an inspectable, serialisable state (candle-nn's `AdamW` keeps its moments
//! private, so a run using it could not be resumed without losing them).

use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_cp_comm::Group;
use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::zero::{reduce_scatter_many_as, span, PendingParams, Zero, BUCKET};

/// AdamW hyper-parameters (the learning rate is passed to every [`AdamW::step`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay, applied to parameters of rank ≥ 2 only (not norms / biases).
    pub weight_decay: f64,
}

impl AdamWConfig {
    /// Check the hyperparameters: `beta1`, `beta2` in `[0, 1)` (a decay of 1 divides the bias
    /// correction by zero), `eps` finite and > 0, `weight_decay` finite and >= 0. Errors name
    /// the value.
    pub fn validate(&self) -> Result<()> {
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                bail!("AdamW: {name} must be in [0, 1), got {b}")
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            bail!("AdamW: eps must be finite and > 0, got {}", self.eps)
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            bail!("AdamW: weight_decay must be finite and >= 0, got {}", self.weight_decay)
        }
        Ok(())
    }
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

struct Slot {
    name: String,
    var: Var,
    /// This rank's slice of the flattened parameter: `[off, off + len)` of `n` elements
    /// (the whole parameter without ZeRO).
    off: usize,
    len: usize,
    /// f32 moments of the slice (`[len]` with ZeRO, the parameter's shape without).
    m: Tensor,
    v: Tensor,
    /// f32 master copy (of the slice) of a low-precision (bf16/f16) parameter: updates
    /// accumulate here and the parameter is its rounding (an update below the parameter's
    /// resolution, e.g. 1e-5 on a bf16 weight of 0.02, would otherwise be lost every step).
    master: Option<Tensor>,
    decay: bool,
    /// The ranks this slot's state is split over (`None`: whole): the replicas with ZeRO, the
    /// ranks holding the same experts for the experts under expert parallelism
    /// ([`AdamW::with_expert_parallel`]).
    zero: Option<Zero>,
}

/// AdamW over named parameters (names are the checkpoint keys, e.g. HF names).
///
/// Moments are f32 of the parameter's (local) shape; a bf16/f16 parameter also gets an f32
/// master copy (mixed precision: 12 bytes of state per parameter, 8 for f32 parameters).
/// With ZeRO-1 ([`AdamW::new_zero1`]) each of the `R` replica ranks keeps that state for
/// `1/R` of every parameter, updates its slice and all-gathers the parameter: the same
/// values as without, bit for bit, for `1/R` of the state memory.
/// Parameters are kept sorted by name so the update order — and the saved state — is
/// deterministic.
pub struct AdamW {
    /// Hyper-parameters.
    pub cfg: AdamWConfig,
    /// Number of optimizer steps taken (bias correction uses `step` after increment).
    pub step: usize,
    slots: Vec<Slot>,
    zero: Option<Zero>,
    /// Parameters split over an expert-parallel group along dim 0
    /// ([`AdamW::with_expert_parallel`]).
    experts: Option<Experts>,
}

/// The experts under expert parallelism ([`AdamW::with_expert_parallel`]).
struct Experts {
    /// The EP group: their state is gathered over it when saved.
    group: Group,
    names: HashSet<String>,
    /// With ZeRO: the ranks holding the same experts, over which their state is split.
    zero: Option<Zero>,
}

impl AdamW {
    /// An optimizer over `params` (name, variable). Duplicate names are an error.
    pub fn new(params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        Self::build(params, cfg, None)
    }

    /// ZeRO-1 over `replicas`: the ranks holding identical copies of `params` (same names and
    /// shapes, e.g. `ParallelCtx::dp_cp`). Collective: [`AdamW::step`] and
    /// [`AdamW::save_from`] must be called by every rank of `replicas` with the same
    /// gradients' names. A group of one rank is the plain optimizer.
    pub fn new_zero1(params: Vec<(String, Var)>, cfg: AdamWConfig, replicas: Group) -> Result<Self> {
        let (rank, size) = (replicas.rank(), replicas.size());
        let zero = (size > 1).then_some(Zero { group: replicas, rank, size });
        Self::build(params, cfg, zero)
    }

    fn build(mut params: Vec<(String, Var)>, cfg: AdamWConfig, zero: Option<Zero>) -> Result<Self> {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        for w in params.windows(2) {
            if w[0].0 == w[1].0 {
                bail!("AdamW: parameter name '{}' appears twice", w[0].0)
            }
        }
        let slots = params
            .into_iter()
            .map(|(name, var)| {
                let n = var.elem_count();
                let (off, len) = match &zero {
                    Some(z) => {
                        let (o, l, _) = span(n, z.rank, z.size);
                        (o, l)
                    }
                    None => (0, n),
                };
                let sharded = zero.is_some();
                let z = Tensor::zeros(slice(var.as_tensor(), off, len, sharded)?.shape(), DType::F32, var.device())?;
                let master = master_of(&var)?.map(|m| slice(&m, off, len, sharded)).transpose()?;
                let decay = var.rank() >= 2;
                Ok(Slot { name, var, off, len, m: z.clone(), v: z, master, decay, zero: zero.clone() })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { cfg, step: 0, slots, zero, experts: None })
    }

    /// Parameter names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.slots.iter().map(|s| s.name.as_str()).collect()
    }

    /// (name, variable) pairs, sorted by name.
    pub fn params(&self) -> Vec<(&str, &Var)> {
        self.slots
            .iter()
            .map(|s| (s.name.as_str(), &s.var))
            .collect()
    }

    /// Whether the state is split over replica ranks (ZeRO-1 over more than one rank).
    pub fn is_sharded(&self) -> bool {
        self.zero.is_some()
    }

    /// Bytes of optimizer state on this rank: the f32 moments and master copies of its
    /// slices (what the planner's `optimizer` figure counts per GPU).
    pub fn state_bytes(&self) -> usize {
        let slot = |s: &Slot| s.m.elem_count() + s.v.elem_count() + s.master.as_ref().map_or(0, |w| w.elem_count());
        4 * self.slots.iter().map(slot).sum::<usize>()
    }

    /// The ZeRO-1 split (`None` without ZeRO-1).
    pub(crate) fn zero(&self) -> Option<&Zero> {
        self.zero.as_ref()
    }

    /// One update with learning rate `lr`. Each gradient is multiplied by `grad_scale` first
    /// (gradient clipping, 1/accumulation). A parameter absent from `grads` is left untouched
    /// (its moments too). Gradient shapes must match the parameters.
    ///
    /// With ZeRO-1 every replica rank must call this with gradients for the same parameters;
    /// a gradient is then either the whole (summed) gradient, of which this rank uses its
    /// slice, or that slice alone (`[len]`, from [`AdamW::reduce_scatter_grads`]). The
    /// updated slices are all-gathered in buckets (one collective per 256 MiB).
    pub fn step(
        &mut self,
        grads: &HashMap<String, Tensor>,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        let (zero, experts) = (self.zero.clone(), self.expert_zero().cloned());
        self.update_and_gather(grads, lr, grad_scale, zero, experts, &|_| 0)?.finish()
    }

    /// [`AdamW::step`] that does not wait for ZeRO's all-gathers of the updated parameters:
    /// they are started on `comm` (the replica ranks, as [`AdamW::new_zero1`]'s group: a
    /// communicator of their own lets them run beside the model's collectives), one per
    /// bucket of parameters of one group, groups in ascending order, and the returned
    /// [`PendingParams`] writes each group's parameters when waited for. `group_of(name)`
    /// gives a parameter's group: with [`crate::param_group`] and
    /// [`crate::Llama::set_param_hook`] the next forward waits for a layer's parameters only
    /// when it reaches the layer, while the later layers' gathers run. Until then the
    /// parameters hold their old values: wait for every group
    /// ([`PendingParams::finish`]) before anything else reads them.
    ///
    /// The parameters end up with the same bits as after [`AdamW::step`]. Without ZeRO the
    /// update is written at once and nothing is pending.
    ///
    /// Under expert parallelism with ZeRO ([`AdamW::with_expert_parallel`]) the experts'
    /// slices are gathered over the ranks holding the same experts, on `expert_comm` (a
    /// communicator of those ranks, in the same order); it is not used otherwise.
    pub fn step_start(
        &mut self,
        grads: &HashMap<String, Tensor>,
        lr: f64,
        grad_scale: f64,
        comm: &Group,
        expert_comm: Option<&Group>,
        group_of: &dyn Fn(&str) -> usize,
    ) -> Result<PendingParams> {
        // (checked before the update: a rank that errors here has changed nothing)
        let on = |z: &Zero, c: Option<&Group>, what: &str| -> Result<Zero> {
            match c {
                Some(c) if c.size() == z.size && c.rank() == z.rank => Ok(Zero { group: c.clone(), ..z.clone() }),
                Some(c) => bail!("AdamW::step_start: {what} is rank {} of {}, the optimizer's group of it rank {} of {}", c.rank(), c.size(), z.rank, z.size),
                None => bail!("AdamW::step_start: the experts' state is split over {} ranks (ZeRO with expert parallelism): pass {what}, a communicator of them", z.size),
            }
        };
        let zero = self.zero.as_ref().map(|z| on(z, Some(comm), "comm")).transpose()?;
        let experts = self.expert_zero().map(|z| on(z, expert_comm, "expert_comm")).transpose()?;
        self.update_and_gather(grads, lr, grad_scale, zero, experts, group_of)
    }

    /// The experts' ZeRO split (ZeRO with expert parallelism over more than one rank holding
    /// the same experts).
    fn expert_zero(&self) -> Option<&Zero> {
        self.experts.as_ref().and_then(|e| e.zero.as_ref())
    }

    /// Whether `name` is an expert under expert parallelism.
    fn is_expert(&self, name: &str) -> bool {
        self.experts.as_ref().is_some_and(|e| e.names.contains(name))
    }

    /// [`AdamW::update`], then with ZeRO the all-gathers of the updated slices started, by
    /// `group_of` groups: over `zero` (the replica ranks and the communicator of the gathers),
    /// the experts' over `experts` (the ranks holding the same experts).
    fn update_and_gather(
        &mut self,
        grads: &HashMap<String, Tensor>,
        lr: f64,
        grad_scale: f64,
        zero: Option<Zero>,
        experts: Option<Zero>,
        group_of: &dyn Fn(&str) -> usize,
    ) -> Result<PendingParams> {
        let updated = self.update(grads, lr, grad_scale)?;
        let (mut dense, mut expert) = (Vec::new(), Vec::new());
        for (i, t) in updated {
            let s = &self.slots[i];
            let item = (group_of(&s.name), s.var.clone(), t);
            if self.is_expert(&s.name) { expert.push(item) } else { dense.push(item) }
        }
        let mut parts = Vec::new();
        for (z, items) in [(zero, dense), (experts, expert)] {
            match z {
                Some(z) => parts.push((z, items)),
                None if items.is_empty() => {}
                None => bail!("AdamW: {} updated slices without a group to gather them over (internal error)", items.len()),
            }
        }
        PendingParams::start_many(parts, BUCKET)
    }

    /// The AdamW update of every parameter in `grads`: written into the parameters without
    /// ZeRO; with ZeRO the new slices, (slot, `[len]`), for the all-gather.
    fn update(&mut self, grads: &HashMap<String, Tensor>, lr: f64, grad_scale: f64) -> Result<Vec<(usize, Tensor)>> {
        // shapes first: a rank that errors here has taken part in no collective
        for s in &self.slots {
            if let Some(g) = grads.get(&s.name) {
                s.check_grad(g, s.zero.is_some())?;
            }
        }
        self.step += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        // (slot, new slice) of the parameters to all-gather with ZeRO-1
        let mut updated: Vec<(usize, Tensor)> = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            let Some(g) = grads.get(&s.name) else {
                continue;
            };
            let sharded = s.zero.is_some();
            let g = if g.shape() == s.var.shape() { s.own(g, sharded)? } else { g.clone() };
            let g = (g.to_dtype(DType::F32)? * grad_scale)?;
            s.m = ((&s.m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            s.v = ((&s.v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let denom = ((&s.v / bc2)?.sqrt()? + c.eps)?;
            let upd = ((&s.m / bc1)? / denom)?;
            let p = match &s.master {
                Some(m) => m.clone(),
                None => s.own(s.var.as_tensor(), sharded)?.to_dtype(DType::F32)?,
            };
            let p = if s.decay && c.weight_decay > 0.0 {
                (p * (1.0 - lr * c.weight_decay))?
            } else {
                p
            };
            let p = (p - (upd * lr)?)?;
            let new = p.to_dtype(s.var.dtype())?;
            if sharded {
                updated.push((i, new));
            } else {
                s.var.set(&new)?;
            }
            if s.master.is_some() {
                s.master = Some(p);
            }
        }
        Ok(updated)
    }

    /// ZeRO-1: sum whole gradients over the replica ranks and keep this rank's slice of each
    /// (`[len]`, the gradient's dtype; summed in f32, one reduce-scatter per 256 MiB bucket),
    /// ready for [`AdamW::step`]. This replaces the all-reduce over the replicas: it sends
    /// half the bytes, and the slices hold the same values as the all-reduce's result.
    /// The experts under expert parallelism ([`AdamW::with_expert_parallel`]) are summed
    /// over the ranks holding them instead (after the other parameters).
    ///
    /// Collective over the replica group (and the experts' group when `grads` holds experts):
    /// every rank passes the same names, with gradients of the parameters' shapes. Without
    /// ZeRO-1 (a group of one rank) it returns `grads`.
    pub fn reduce_scatter_grads(&self, grads: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
        self.reduce_scatter_grads_as(grads, None)
    }

    /// [`AdamW::reduce_scatter_grads`] with the slices kept in f32 (ZeRO-2 sums them over the
    /// micro-batches).
    pub fn reduce_scatter_grads_f32(&self, grads: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
        self.reduce_scatter_grads_as(grads, Some(DType::F32))
    }

    fn reduce_scatter_grads_as(&self, grads: &HashMap<String, Tensor>, dtype: Option<DType>) -> Result<HashMap<String, Tensor>> {
        let Some(z) = &self.zero else {
            return match dtype {
                Some(d) => grads.iter().map(|(n, g)| Ok((n.clone(), g.to_dtype(d)?))).collect(),
                None => Ok(grads.clone()),
            };
        };
        let mut names: Vec<&String> = grads.keys().collect();
        names.sort();
        // (the other parameters', the experts')
        let (mut dense, mut experts) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
        for n in names {
            let Some(s) = self.slots.iter().find(|s| &s.name == n) else {
                bail!("AdamW::reduce_scatter_grads: '{n}' is not a parameter of this optimizer")
            };
            let g = &grads[n];
            if g.shape() != s.var.shape() {
                bail!("AdamW::reduce_scatter_grads: gradient of '{n}' has shape {:?}, parameter {:?}", g.dims(), s.var.dims())
            }
            let list = match (self.is_expert(n), &s.zero) {
                (false, _) => &mut dense,
                (true, Some(_)) => &mut experts,
                (true, None) => bail!("AdamW::reduce_scatter_grads: '{n}' is an expert under expert parallelism whose state is not split (one rank holds it): sum its gradient over the ranks holding it and pass it whole"),
            };
            list.0.push(n.clone());
            list.1.push(g.clone());
        }
        let mut out = HashMap::new();
        for (z, (names, list)) in [(Some(z), dense), (self.expert_zero(), experts)] {
            if let (Some(z), false) = (z, list.is_empty()) {
                out.extend(names.into_iter().zip(reduce_scatter_many_as(z, &list, BUCKET, dtype)?));
            }
        }
        Ok(out)
    }

    /// Whether the experts' state is split over the ranks holding them (ZeRO with expert
    /// parallelism, more than one rank per expert): their gradients then go through
    /// [`AdamW::reduce_scatter_grads`] too.
    pub fn splits_experts(&self) -> bool {
        self.expert_zero().is_some()
    }

    /// The same optimizer, told that the parameters `names` are this rank's slice (along dim 0)
    /// of tensors split over `group` (the stacked experts under expert parallelism,
    /// `ParallelCtx::ep`); `replicas` are the ranks holding the same slice
    /// (`ParallelCtx::ep_dp`). With ZeRO ([`AdamW::new_zero1`] over the replicas of the other
    /// parameters, `group.size() · replicas.size()` ranks) the experts' state is split over
    /// `replicas` instead (as Megatron's distributed optimizer splits it over the expert
    /// data-parallel ranks): their gradients are summed over those ranks and passed whole
    /// (not through [`AdamW::reduce_scatter_grads`]), each rank updates its slice and
    /// [`AdamW::step`] all-gathers it over `replicas`. [`AdamW::save_from`] gathers the state
    /// over `group` too, so the file holds every expert, as a run without expert parallelism
    /// writes it (every rank of `group` must then call it). Call it before the first step. A
    /// `group` of one rank changes nothing.
    pub fn with_expert_parallel(mut self, group: Group, replicas: Group, names: impl IntoIterator<Item = String>) -> Result<Self> {
        if group.size() == 1 {
            return Ok(self);
        }
        if self.step > 0 {
            bail!("AdamW::with_expert_parallel: called after {} steps (before the first, while the state is zero)", self.step)
        }
        let zero = match &self.zero {
            Some(z) if group.size() * replicas.size() != z.size => bail!(
                "AdamW::with_expert_parallel: {} EP ranks × {} ranks holding the same experts is not the {} replicas the state is split over",
                group.size(),
                replicas.size(),
                z.size
            ),
            Some(_) if replicas.size() > 1 => Some(Zero { rank: replicas.rank(), size: replicas.size(), group: replicas }),
            _ => None,
        };
        let names: HashSet<String> = names.into_iter().collect();
        for s in self.slots.iter_mut().filter(|s| names.contains(&s.name)) {
            let n = s.var.elem_count();
            (s.off, s.len) = match &zero {
                Some(z) => {
                    let (o, l, _) = span(n, z.rank, z.size);
                    (o, l)
                }
                None => (0, n),
            };
            s.zero = zero.clone();
            let sharded = zero.is_some();
            s.m = Tensor::zeros(s.own(s.var.as_tensor(), sharded)?.shape(), DType::F32, s.var.device())?;
            s.v = s.m.clone();
            s.master = s.master_init(sharded)?;
        }
        self.experts = Some(Experts { group, names, zero });
        Ok(self)
    }
}

impl Slot {
    /// A gradient [`AdamW::step`] accepts: the parameter's shape, or (ZeRO-1) this rank's
    /// slice `[len]`.
    fn check_grad(&self, g: &Tensor, sharded: bool) -> Result<()> {
        if g.shape() == self.var.shape() || (sharded && g.dims() == [self.len]) {
            return Ok(());
        }
        if sharded {
            bail!(
                "AdamW: gradient of '{}' has shape {:?}, parameter {:?} (or its ZeRO-1 slice [{}])",
                self.name,
                g.dims(),
                self.var.dims(),
                self.len
            )
        }
        bail!("AdamW: gradient of '{}' has shape {:?}, parameter {:?}", self.name, g.dims(), self.var.dims())
    }

    /// This rank's part of a full-shape tensor (all of it without ZeRO).
    fn own(&self, t: &Tensor, sharded: bool) -> Result<Tensor> {
        slice(t, self.off, self.len, sharded)
    }

    /// The f32 master copy (of the slice) a low-precision parameter needs.
    fn master_init(&self, sharded: bool) -> Result<Option<Tensor>> {
        master_of(&self.var)?.map(|m| self.own(&m, sharded)).transpose()
    }
}

/// Elements `[off, off + len)` of `t` flattened when `sharded` (a copy: a view would keep the
/// whole tensor alive), else `t` itself.
fn slice(t: &Tensor, off: usize, len: usize, sharded: bool) -> Result<Tensor> {
    if sharded {
        t.flatten_all()?.narrow(0, off, len)?.copy()
    } else {
        Ok(t.clone())
    }
}

/// The f32 master copy a parameter needs: `Some` for bf16/f16 (low-precision) parameters.
fn master_of(var: &Var) -> Result<Option<Tensor>> {
    match var.dtype() {
        DType::BF16 | DType::F16 => Ok(Some(var.as_tensor().to_dtype(DType::F32)?)),
        _ => Ok(None),
    }
}

#[path = "optim_state.rs"]
mod state;

#[cfg(test)]
#[path = "optim_tests.rs"]
mod tests;
