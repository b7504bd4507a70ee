#![warn(missing_docs)]
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
//! Packed documents (many documents in one row, masked from each other, RoPE positions per
//! document, shards cutting them anywhere): [`packed`] — `shard_batch_packed(ids, &docs, &ctx)`
//! then `llama.loss_packed(ids, labels, positions, &documents)`.
//!
//! Sliding-window attention (Mistral `sliding_window`, read from and written to config.json):
//! set [`LlamaConfig::sliding_window`] (e.g. `LlamaConfig::tiny(..).with_sliding_window(Some(w))`)
//! and every layout keeps each query to itself and the `w - 1` tokens before it ([`attn`]);
//! Qwen2 / Qwen3 configs may put it on some layers only ([`LlamaConfig::sliding_layers`]).
//!
//! Architectures: Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (`model_type` `llama`, `mistral`,
//! `qwen2`, `qwen3`, `gemma3_text`; Qwen2's biases on the q, k, v projections,
//! [`LlamaConfig::qkv_bias`]; Qwen3's q, k head norms, [`LlamaConfig::qk_norm`]; Gemma 3,
//! [`LlamaConfig::gemma3`] and [`gemma`]; OLMo 2, 3 and OLMoE, [`LlamaConfig::olmo`] and [`olmo`];
//! EXAONE 4, [`LlamaConfig::exaone4`];
//! and the others [`arch`] lists); any other config, and any
//! checkpoint tensor the model would not use, is refused by name ([`arch`]).
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use candle_cp_comm::run_ranks;
//! use candle_cp_llama::*;
//! use candle_nn::VarBuilder;
//!
//! let cfg = LlamaConfig::tiny(256, 64, 2, 4, 2);
//! let layout = Layout::cp(CpKind::Zigzag, 4); // or .with_tp(2, true), Layout::two_d(2, 2), ...
//! let ids = Tensor::zeros((1, 1024), DType::U32, &Device::Cpu)?;
//! let losses = run_ranks(layout.world_size(), |world| {
//!     let ctx = ParallelCtx::new(world, layout)?;
//!     let full = init_params(&cfg, 42, DType::F32, &Device::Cpu)?; // or load_hf(dir, ..)
//!     let vm = shard_params(&full, &cfg, &ctx)?;
//!     let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
//!     let b = shard_batch(&ids, &ctx)?;
//!     let (loss, _logits) = model.loss(&b.input_ids, &b.labels, &b.positions)?;
//!     let mut grads = loss.backward()?;
//!     reduce_gradients(&mut grads, &vm, &cfg, &ctx)?; // now the full-batch gradient
//!     loss.to_scalar::<f32>()
//! });
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! Generation (greedy decoding) with the KV cache sharded over the CP ranks: [`generate`] —
//! `llama.generate_greedy(&prompt, new_tokens)` on every rank (`tp = dp = 1`).
//!
//! Parallel results equal the single-device ones: see `tests/llama_parity.rs` and
//! [`verify::verify_reference`] (also `candle-cp verify llama`).

pub mod arch;
pub mod attn;
pub mod chat;
mod chat_files;
pub mod chat_reasoning;
mod attn2d;
pub mod config;
pub mod expert_params;
pub mod fused;
pub mod generate;
mod generate_loop;
mod generate_ragged;
pub mod grads;
pub mod head_loss;
pub mod hf;
pub mod hf_files;
pub mod layout;
mod layer_build;
pub mod lora;
pub mod lora_convert;
mod lora_merge;
pub mod loss;
pub mod model;
pub mod mla;
mod moe;
mod moe_lora;
pub mod lora_select;
pub mod packed;
pub mod params;
pub mod prm;
pub mod quant;
pub mod reward;
mod qk_norm;
pub mod rope;
pub mod sampling;
pub mod train;
pub mod verify;

pub use config::{exaone4, gemma, gemma2, olmo, phi3, qwen3_moe, Arch, Gemma2, Gemma3, Glm, Granite, LlamaConfig, MoeConfig, MoeStyle, Olmo, RopeScaling};
pub use generate::{Generation, KvCache};
pub use hf_files::stop_tokens;
pub use sampling::Sampling;
pub use grads::{named_grads, reduce_gradients, reduce_gradients_except_dp_cp};
pub use hf::{load_hf, load_hf_sharded, save_hf, save_hf_sharded, save_hf_tensors};
pub use layout::{shard_batch, CpKind, HeadLayout, Layout, ParallelCtx, RowSums, ShardedBatch, IGNORE};
pub use model::{global_mean, local_nll, rms_norm, Llama, ParamHook};
pub use packed::shard_batch_packed;
pub use candle_cp_ops::packing::Documents;
pub use params::{gather_full, gather_full_to_host, init_params, init_params_sharded, param_group, param_specs, shard_params, shard_tensors, trainable_specs, ParamSpec, Shard};
pub use lora::LoraSpec;
pub use reward::load_hf_sharded_reward;
