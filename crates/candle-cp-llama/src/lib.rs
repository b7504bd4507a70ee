//! candle-cp-llama: a trainable Llama-style decoder on every candle-cp parallel layout, with
//! Hugging Face checkpoint loading and saving.
//!
//! ```text
//! full weights (load_hf / init_params) ──shard_params──▶ VarMap of this rank
//! Llama::new(VarBuilder::from_varmap(..), &cfg, &ParallelCtx::new(world, layout))
//! shard_batch(global_ids [B, T]) ─▶ ids, labels [B/dp, T_local], positions [T_local]
//! llama.loss(ids, labels, positions) ─▶ global mean loss (same on every rank)
//! loss.backward() ─▶ reduce_gradients(&mut grads, &varmap, &cfg, &ctx) ─▶ optimizer step
//! ```
//!
//! Parallel results equal the single-device ones: see `tests/llama_parity.rs` and
//! [`verify::verify_reference`] (also `candle-cp verify llama`).

pub mod attn;
mod attn2d;
pub mod config;
pub mod grads;
pub mod hf;
pub mod layout;
pub mod model;
pub mod params;
pub mod rope;
pub mod train;
pub mod verify;

pub use config::{LlamaConfig, RopeScaling};
pub use grads::{named_grads, reduce_gradients};
pub use hf::{load_hf, save_hf, save_hf_tensors};
pub use layout::{shard_batch, CpKind, Layout, ParallelCtx, ShardedBatch, IGNORE};
pub use model::{global_mean, local_nll, rms_norm, Llama};
pub use params::{gather_full, init_params, param_specs, shard_params, shard_tensors, ParamSpec, Shard};
