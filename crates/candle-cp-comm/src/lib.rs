//! candle-cp-comm: process groups for candle-cp.
//!
//! - [`ProcessGroup`]: the raw collectives (all-gather, reduce-scatter, all-reduce,
//!   all-to-all, broadcast, barrier, non-blocking ring send/recv, sub-groups).

mod group;

pub use group::{Group, PendingRecv, ProcessGroup};
