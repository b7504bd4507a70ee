//! ZeRO's parameter all-gathers overlapped with the next forward
//! ([`super::TrainConfig::overlap_param_gather`]).
//!
//! After the optimizer step each replica rank holds the updated slices of every parameter;
//! the all-gathers that rebuild the parameters start at once, one group per layer in forward
//! order, and the next forward waits for a group only when it reaches it
//! ([`crate::Llama::set_param_hook`]):
//!
//! ```text
//! link:     [embed][layer 0][layer 1][layer 2] … [norm, head]
//! compute:  step ─►  embed ─► layer 0 ─► layer 1 ─► …
//!                 (waits)  (waits)   (layer 1 arrived while layer 0 ran)
//! ```
//!
//! Without it the gathers are waited for inside the step (`AdamW::step`).

use candle_core::{bail, Result, Tensor};
use candle_cp_comm::Group;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{AdamW, PendingParams};
use crate::{param_group, Llama, ParallelCtx};

/// The trainer's side of `overlap_param_gather`: the pending all-gathers, shared with the
/// model's parameter hook.
pub(crate) struct ParamGather {
    /// The gathers' communicator (a split of `ctx.dp_cp`); `None`: the option is off.
    comm: Option<Group>,
    /// The experts' gathers' under expert parallelism (a split of `ctx.ep_dp`).
    expert_comm: Option<Group>,
    pending: Arc<Mutex<PendingParams>>,
}

fn lock(p: &Mutex<PendingParams>) -> MutexGuard<'_, PendingParams> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl ParamGather {
    /// `on`: install the hook on `model` and split a communicator off `ctx.dp_cp` (and off
    /// `ctx.ep_dp` under expert parallelism; collective over them). Off:
    /// [`ParamGather::step`] is [`AdamW::step`].
    pub fn new(model: &Llama, ctx: &ParallelCtx, on: bool) -> Result<Self> {
        let pending = Arc::new(Mutex::new(PendingParams::none()));
        let (comm, expert_comm) = if on {
            let p = pending.clone();
            model.set_param_hook(Some(Arc::new(move |k| lock(&p).wait_through(k))));
            let experts = match ctx.ep {
                Some(_) if ctx.ep_dp.size() > 1 => Some(ctx.ep_dp.split(0, ctx.ep_dp.rank())?),
                _ => None,
            };
            (Some(ctx.dp_cp.split(0, ctx.dp_cp.rank())?), experts)
        } else {
            (None, None)
        };
        Ok(Self { comm, expert_comm, pending })
    }

    /// The optimizer step: on, with the all-gathers left pending for the next forward
    /// (groups by [`crate::param_group`] of a model of `layers` layers).
    pub fn step(&self, opt: &mut AdamW, grads: &HashMap<String, Tensor>, lr: f64, scale: f64, layers: usize) -> Result<()> {
        let Some(comm) = &self.comm else {
            return opt.step(grads, lr, scale);
        };
        let mut p = lock(&self.pending);
        // (nothing is pending here: the forward has waited for every group)
        p.finish()?;
        *p = opt.step_start(grads, lr, scale, comm, self.expert_comm.as_ref(), &|name| param_group(name, layers).unwrap_or(0))?;
        Ok(())
    }

    /// After a forward: every gather must have been waited for (a forward that read a
    /// parameter without its hook call would have used the old value).
    pub fn check_forward_done(&self) -> Result<()> {
        if self.comm.is_some() && !lock(&self.pending).is_done() {
            bail!("train: the forward finished with parameter all-gathers still pending (a parameter was read without Llama::set_param_hook's wait)")
        }
        Ok(())
    }

    /// Wait for every pending gather (before a checkpoint, and at the end).
    pub fn finish(&self) -> Result<()> {
        lock(&self.pending).finish()
    }
}
