//! candle-cp-comm: process groups for candle-cp.
//!
//! - [`ProcessGroup`]: the raw collectives (all-gather, reduce-scatter, all-reduce,
//!   all-to-all, broadcast, barrier, non-blocking ring send/recv, sub-groups).
//! - [`ThreadGroup`]: P ranks as threads of one process, on any candle `Device`;
//!   [`run_ranks`] / [`run_ranks_with`] launch a closure on every rank.
//! - [`Mesh`]: named sub-groups (e.g. dp × cp × tp) with a documented rank order.
//! - [`rendezvous`]: rank 0 hands a small blob (the NCCL unique id) to every rank, over a TCP
//!   store on `MASTER_ADDR:MASTER_PORT` or a shared file, with bounded waits.
//! - [`watchdog`]: bounded waits on enqueued work ([`watchdog::Watchdog`], [`watchdog::Poison`]),
//!   used by `nccl::NcclGroup` (feature `nccl`) so that a dead peer becomes an `Err`, not a hang.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_cp_comm::{run_ranks, Mesh, ProcessGroup};
//!
//! // 4 ranks as threads: a 2-D mesh (ring × ulysses, ulysses ranks adjacent)
//! let results = run_ranks(4, |world| {
//!     let r = world.rank();
//!     let mesh = Mesh::new(world, &[("ring", 2), ("ulysses", 2)])?;
//!     let x = Tensor::new(&[r as f32], &Device::Cpu)?;
//!     let ulysses = mesh.group("ulysses")?.all_gather(&x, 0)?; // ranks {0,1} or {2,3}
//!     let total = mesh.world().all_reduce(&x)?; // 0 + 1 + 2 + 3
//!     Ok((ulysses.to_vec1::<f32>()?, total.to_vec1::<f32>()?[0]))
//! });
//! let (u, total) = results[3].as_ref().unwrap();
//! assert_eq!(u, &vec![2.0, 3.0]);
//! assert_eq!(*total, 6.0);
//! ```

#![warn(missing_docs)]

mod collect;
mod group;
pub mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod rendezvous;
pub mod thread;
pub mod watchdog;
mod world;

pub use group::{ensure_nonempty, Group, PendingRecv, ProcessGroup};
pub use mesh::Mesh;
pub use thread::{run_ranks, run_ranks_with, ThreadGroup, ThreadGroupOptions, WorldHandle};
