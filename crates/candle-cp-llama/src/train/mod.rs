//! Training utilities for the fine-tuning example and for users' own training loops:
//! seedable RNG ([`rng`]), synthetic long-range data and text streams ([`data`]), packed
//! documents ([`packed_data`]), supervised and preference data ([`sft`], [`preference`]) and DPO and its variants ([`dpo`], KTO: [`kto`], BCO: [`bco`]), reward models ([`reward`]), AdamW with ZeRO-1 (bucketed reduce-scatter and all-gather) and
//! saveable state ([`optim`]), warmup + cosine schedule ([`schedule`]), global-norm gradient
//! clipping across ranks ([`clip`]), metrics log and peak memory ([`metrics`]), PNG loss plots
//! ([`plot`]) and atomic checkpoints ([`checkpoint`]).

pub mod checkpoint;
pub mod clip;
mod config;
mod expert_bias;
pub mod bco;
pub mod data;
pub mod dpo;
mod dpo_config;
mod dpo_run;
pub mod dpo_loss;
pub mod eval;
pub mod grpo;
pub mod grpo_run;
pub(crate) mod grpo_sample;
pub mod kto;
pub mod ld_dpo;
mod grad_step;
pub(crate) mod lora;
pub mod metrics;
pub mod optim;
pub mod packed_data;
mod param_gather;
pub mod plot;
pub mod preference;
pub mod reward;
mod batches;
mod run_save;
pub mod prm;
mod classifier;
pub mod reward_command;
pub mod rng;
pub mod schedule;
pub mod sft;
pub mod tr_dpo;
pub mod trainer;
pub mod wpo;
mod overlap;
mod zero;

pub use checkpoint::{optimizer_tp_degree, reshard_optimizer_state, TrainState};
pub use clip::{clip_factor, global_norm, global_norm_zero1};
pub use data::{DataSource, KvRecall, Sample, TokenStream};
pub use eval::EvalConfig;
pub use metrics::{peak_rss_bytes, MetricsLog, StepMetrics};
pub use optim::{AdamW, AdamWConfig};
pub use zero::PendingParams;
pub use packed_data::PackedStream;
pub use dpo::{DpoConfig, DpoLoss};
pub use reward::RewardConfig;
pub use prm::{PrmConfig, StepSet};
pub use preference::PreferenceSet;
pub use rng::Rng;
pub use schedule::WarmupCosine;
pub use trainer::{plot_metrics, train_rank, ModelSource, TrainConfig, TrainOutcome};
