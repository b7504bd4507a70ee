//! candle-cp-ops: the operations of sequence and context parallelism for candle.
//!
//! - [`attention`]: single-device blockwise attention with LSE, its backward, `merge`,
//!   `attention_slow` (reference from plain candle ops).
//! - [`cp`]: context parallelism — sharding layouts (contiguous, zigzag, striped), ring
//!   attention, all-gather-KV attention, load-balance report.
//! - [`ulysses`]: all-to-all sequence↔head conjugate ops and Ulysses attention.
//! - [`usp`]: 2-D Ulysses × ring attention.
//! - [`mappings`]: Megatron tensor/sequence-parallel conjugate collectives.
//! - [`autograd`]: attach a hand-written backward to a precomputed tensor.
//! - [`oracle`]: load reference attention cases (safetensors) and compare results to them.
//! - [`moe`]: mixture of experts — the experts' grouped matmul, top-k routing.
//! - [`moe_ep`]: expert parallelism — routed rows to the ranks holding their experts and back.
//! - [`recompute`]: activation recomputation of a block (keep its input, rerun it in backward).

#![warn(missing_docs)]

pub mod attention;
pub mod autograd;
pub mod cp;
pub mod mappings;
pub mod moe;
pub mod moe_ep;
pub mod moe_gemm;
pub mod moe_update;
pub mod oracle;
pub mod packing;
pub mod recompute;
pub mod ulysses;
pub mod usp;

pub use candle_cp_comm::{Group, ProcessGroup};
