//! Shared ring helper: send to the next rank, receive from the previous one, with timing.
//!
//! ```text
//!   rank 0 ──▶ rank 1 ──▶ rank 2 ──▶ … ──▶ rank P-1 ──┐
//!     ▲                                              │
//!     └──────────────────────────────────────────────┘
//! ```
//!
//! [`Ring::start`] posts the exchange and returns at once ([`InFlight`]); compute issued before
//! [`InFlight::wait`] overlaps the transfer (double buffering: the current chunk is computed
//! while the next one travels). The time spent blocked in `wait` is the *exposed*
//! communication and is recorded in [`RingStats`].

use crate::Group;
use candle_core::{Result, Tensor};
use candle_cp_comm::PendingRecv;
use std::time::{Duration, Instant};

/// Timing of one ring step on one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Time spent computing attention blocks in this step.
    pub compute: Duration,
    /// Time blocked waiting for the step's transfers (exposed communication).
    pub wait: Duration,
    /// Number of (query segment × key segment) blocks computed (skipped ones excluded).
    pub blocks: usize,
    /// Dense area (query rows × key rows) of the attention calls made (a fused causal call
    /// counts its masked part too; the kernels skip fully masked tiles).
    pub area: u64,
    /// Visible (query, key) pairs computed: the work, independent of how blocks were fused.
    pub pairs: u64,
}

/// Per-step statistics of one ring pass on one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RingStats {
    /// One entry per ring step (`P` steps; a final dK/dV hop of the backward is added to the
    /// last step's wait).
    pub steps: Vec<StepStats>,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
}

impl RingStats {
    /// Total compute time.
    pub fn compute(&self) -> Duration {
        self.steps.iter().map(|s| s.compute).sum()
    }
    /// Total exposed communication time.
    pub fn wait(&self) -> Duration {
        self.steps.iter().map(|s| s.wait).sum()
    }
    /// Total dense block area computed.
    pub fn area(&self) -> u64 {
        self.steps.iter().map(|s| s.area).sum()
    }
    /// Total visible (query, key) pairs computed.
    pub fn pairs(&self) -> u64 {
        self.steps.iter().map(|s| s.pairs).sum()
    }
}

/// A ring over a process group: rank `r` sends to `r+1 mod P` and receives from `r-1 mod P`.
pub struct Ring {
    group: Group,
    next: usize,
    prev: usize,
}

/// A transfer in flight; [`InFlight::wait`] returns the tensor received from the previous rank.
pub struct InFlight {
    pending: Option<Box<dyn PendingRecv>>,
    local: Option<Tensor>,
}

impl Ring {
    /// The ring of `group` in rank order.
    pub fn new(group: &Group) -> Self {
        let p = group.size();
        let r = group.rank();
        Self {
            group: group.clone(),
            next: (r + 1) % p,
            prev: (r + p - 1) % p,
        }
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Send `t` to the next rank and start receiving from the previous one. Collective: every
    /// rank must call it in the same order. With one rank, `t` comes back as is.
    pub fn start(&self, t: &Tensor, stats: &mut RingStats) -> Result<InFlight> {
        if self.group.size() == 1 {
            return Ok(InFlight {
                pending: None,
                local: Some(t.clone()),
            });
        }
        stats.bytes_sent += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        let t = t.contiguous()?;
        let pending = self.group.send_recv(&t, self.next, self.prev)?;
        Ok(InFlight {
            pending: Some(pending),
            local: None,
        })
    }

    /// Send `t` to the rank `back` places before this one (`r - back mod P`) and start
    /// receiving from the rank `back` places after it: how the backward ring returns dK/dV
    /// accumulators to their owners when it stops early. `back ≡ 0 (mod P)`: `t` comes back as
    /// is. Collective like [`Ring::start`].
    pub fn shift_back(&self, t: &Tensor, back: usize, stats: &mut RingStats) -> Result<InFlight> {
        let p = self.group.size();
        if back.is_multiple_of(p) {
            return Ok(InFlight { pending: None, local: Some(t.clone()) });
        }
        let r = self.group.rank();
        let (dst, src) = ((r + p - back % p) % p, (r + back) % p);
        stats.bytes_sent += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        let pending = self.group.send_recv(&t.contiguous()?, dst, src)?;
        Ok(InFlight { pending: Some(pending), local: None })
    }

    /// Describe the group for error messages.
    pub fn describe(&self) -> String {
        self.group.describe()
    }
}

impl InFlight {
    /// A transfer that already completed (used when overlap is off).
    pub fn ready(t: Tensor) -> Self {
        Self {
            pending: None,
            local: Some(t),
        }
    }

    /// Block until the tensor from the previous rank has arrived; the blocked time is added
    /// to `wait`.
    pub fn wait(self, wait: &mut Duration) -> Result<Tensor> {
        let t0 = Instant::now();
        let r = match (self.pending, self.local) {
            (Some(p), _) => p.wait(),
            (None, Some(t)) => Ok(t),
            (None, None) => {
                candle_core::bail!("ring transfer has neither a pending receive nor a local tensor")
            }
        };
        *wait += t0.elapsed();
        r
    }
}
