//! candle-cp-plan: the arithmetic of sequence and context parallelism.
//!
//! Answers "what does this layout cost, and does it fit?" for a decoder-only transformer
//! (Llama family) trained with tensor parallelism (TP, optionally with Megatron sequence
//! parallelism SP), context parallelism (CP: ring, all-gather-KV, Ulysses, 2-D
//! Ulysses×ring), pipeline parallelism (PP) and data parallelism (DP, optionally ZeRO).
//!
//! Every number is a closed-form formula; each is written out in `docs/arithmetic.md`
//! and pinned by a unit test. Lengths: `seq` is the *global* sequence length `s`; the
//! tokens a GPU holds under CP are `s / cp` (the "chunk" `c`).
//!
//! Entry point: [`plan`](fn@plan) takes [`PlanInput`] and returns a [`Plan`] (serialisable to
//! JSON); [`report::render`] prints it as tables for people.
//!
//! A causal sliding window (the model's `sliding_window`) changes the attention FLOPs and the
//! ring (a halo exchange on contiguous shards): see [`window`]; a window on some layers only
//! (Gemma 3, Qwen `max_window_layers`): see [`partial`]. Packed documents
//! ([`PlanInput::doc_len`]) do the same inside each document: see [`packed`]. The gradient
//! synchronisation over the `dp·cp` replicas, once per optimizer step, per ZeRO stage: see
//! [`grad_sync`].

#![warn(missing_docs)]

pub mod comm;
pub mod compute;
pub mod grad_sync;
pub mod hardware;
pub mod layout;
pub mod memory;
pub mod model;
pub mod packed;
pub mod partial;
pub mod plan;
pub mod rates;
pub mod report;
pub mod search;
pub mod step;
pub mod window;

pub use hardware::Hardware;
pub use layout::{ActivationModel, CpKind, Dtype, Layout, Recompute};
pub use model::{MlaShape, ModelConfig, ScoreHead};
pub use plan::{plan, Plan, PlanInput};
pub use rates::{AttnRates, RatePoint};
pub use search::{search, SearchInput, SearchResult};
pub use step::{Overlap, StepTime};

/// Error for bad planner input (unknown preset, degrees that do not divide, bad config).
/// The message names the offending values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanError(pub String);

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PlanError {}

/// Result type of the planner.
pub type Result<T> = std::result::Result<T, PlanError>;

/// Returns early with a [`PlanError`] built from a format string.
#[macro_export]
macro_rules! plan_bail {
    ($($arg:tt)*) => {
        return Err($crate::PlanError(format!($($arg)*)))
    };
}

/// Decimal gigabyte (10^9 bytes), the unit memory is reported in.
pub const GB: f64 = 1e9;
/// Mebibyte (2^20 bytes), the unit transfer sizes are reported in.
pub const MIB: f64 = 1024.0 * 1024.0;
/// 10^12 FLOP.
pub const TFLOP: f64 = 1e12;
