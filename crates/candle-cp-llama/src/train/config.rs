//! What a training run is given ([`TrainConfig`], [`ModelSource`]) and what it returns
//! ([`TrainOutcome`]).

use super::data::DataSource;
use super::metrics::StepMetrics;
use super::optim::AdamWConfig;
use super::schedule::WarmupCosine;
use crate::{Layout, LlamaConfig};
use candle_core::DType;
use std::path::PathBuf;

/// Where the initial weights come from.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per run: a boxed config would buy nothing
pub enum ModelSource {
    /// Random init of this architecture ([`crate::init_params`] with the run seed).
    Init(LlamaConfig),
    /// A Hugging Face Llama checkpoint directory (`config.json` + safetensors).
    Hf(PathBuf),
}

/// Everything a run needs; identical on every rank.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Parallel layout (world size `dp · cp · tp`).
    pub layout: Layout,
    /// Initial weights.
    pub model: ModelSource,
    /// Training sequences (packed documents when the source's samples carry them).
    pub data: DataSource,
    /// Global sequence length `T`.
    pub seq_len: usize,
    /// Global rows per micro-batch (split over DP; must be divisible by `layout.dp`).
    pub batch: usize,
    /// Micro-batches per optimizer step (gradients are averaged over them).
    pub grad_accum: usize,
    /// Optimizer steps of the whole run (also the schedule's length).
    pub steps: usize,
    /// Learning-rate schedule.
    pub schedule: WarmupCosine,
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
    /// Clip the global gradient norm to this (≤ 0: no clipping).
    pub clip: f64,
    /// Run seed (weights of a random init, data).
    pub seed: u64,
    /// Output directory (metrics.jsonl, loss.png, checkpoints/); `None`: nothing written.
    pub out: Option<PathBuf>,
    /// Checkpoint every this many steps (0: only at the end of the run).
    pub save_every: usize,
    /// Keep the newest `keep` checkpoints (0: all).
    pub keep: usize,
    /// Continue from the newest checkpoint in `out/checkpoints` if there is one.
    pub resume: bool,
    /// Stop (as if killed) after this step, without the end-of-run checkpoint — for testing
    /// resume. `None`: run to `steps`.
    pub stop_after: Option<usize>,
    /// Weight dtype (F32 for training on CPU).
    pub dtype: DType,
    /// Compute on CUDA instead of the CPU (needs the `cuda` feature; data, sharding, optimizer
    /// bookkeeping and checkpoints stay on the host): on the group's own GPU when it has one
    /// (`ProcessGroup::home_device`, e.g. an `NcclGroup`), else on device `world rank % gpus`.
    pub cuda: bool,
    /// Number of GPUs thread ranks are spread over (with `cuda` and a group without a home
    /// device).
    pub gpus: usize,
    /// ZeRO-2: ZeRO-1, and the gradients of the replicas' parameters reduce-scattered into
    /// f32 slices after every micro-batch instead of accumulated whole (less memory with
    /// `grad_accum > 1`, one reduce-scatter per micro-batch; see `train::grad_step`). Implies
    /// the ZeRO-1 optimizer split.
    pub zero2: bool,
    /// ZeRO-1: split the optimizer state (f32 moments, master copies) over the DP × CP ranks
    /// that hold the same weights, 1/(dp·cp) each; training is bit-identical, checkpoints are
    /// the same files (a run may resume with or without it).
    pub zero1: bool,
    /// Recompute every decoder layer in backward instead of keeping its activations
    /// ([`crate::Llama::with_recompute`]): less memory, one more forward of the layers.
    pub recompute: bool,
    /// Start each recomputed layer's gradient reduction over the DP × CP replicas as soon as
    /// its backward is done, on a communicator of its own, instead of after the whole
    /// backward (see `train::overlap`); needs `recompute`. Training is bit-identical.
    pub overlap_grad_sync: bool,
    /// ZeRO (`zero1` / `zero2`): start the all-gathers of the updated parameters after the
    /// optimizer step, on a communicator of their own, and wait for each layer's only when
    /// the next forward reaches the layer ([`crate::Llama::set_param_hook`],
    /// [`super::PendingParams`]): the later layers' parameters travel while the earlier
    /// layers compute. Training is bit-identical.
    pub overlap_param_gather: bool,
    /// Train on the long-range targets only (the other labels are set to [`crate::IGNORE`], like an
    /// answer-only SFT loss). The reported `loss` is still the mean over ALL targets.
    pub long_range_only: bool,
    /// Train by DPO on preference pairs ([`super::DataSource::Preference`], [`super::dpo`]):
    /// the objective is DPO's loss against the model as the run starts (its reference
    /// log-probabilities computed before the first step and kept in `out/dpo_reference.json`
    /// for a resumed run). `None`: next-token cross-entropy.
    pub dpo: Option<super::dpo::DpoConfig>,
    /// GRPO ([`super::grpo`]): the data are prompts ([`super::DataSource::Prompts`]) whose
    /// completions each micro-batch samples from the policy and rewards. `None`: offline data.
    pub grpo: Option<super::grpo::GrpoConfig>,
    /// Train a reward model on preference pairs ([`super::DataSource::Preference`],
    /// [`super::reward`]): the model gets a score head ([`crate::reward`]: a causal LM's is
    /// drawn, its LM head left unread) and the objective is the pairs' Bradley–Terry loss;
    /// checkpoints are `*ForSequenceClassification` models. `None`: a causal LM's objectives.
    pub reward: Option<super::reward::RewardConfig>,
    /// Train a process reward model on stepwise examples ([`super::DataSource::Steps`],
    /// [`super::prm`]): the model is a token classifier ([`crate::prm`]: a causal LM's head is
    /// drawn, its LM head unread), each step's last token classified. `None`: not one.
    pub prm: Option<super::prm::PrmConfig>,
    /// Loss-free load balancing of a sigmoid router (GLM-4.5's correction bias; Megatron-Core's
    /// `moe_router_bias_update_rate`, 1e-3 there): after each step every sparse layer's bias
    /// moves by `rate · sign(mean − count)` of the step's global expert counts
    /// (`crate::train::expert_bias`). `None`: the bias stays as loaded.
    pub expert_bias_update: Option<f64>,
    /// A `tokenizer.json` (the one the data was tokenised with) written into each full
    /// checkpoint and a LoRA run's written base, unless the model's own directory gave one
    /// ([`crate::hf_files::carry_model_files`]): a run from random weights saves checkpoints that
    /// generate from text.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Free-form arguments stored in every checkpoint's `train_state.json`.
    pub args: serde_json::Value,
    /// Causal sliding window (keys per query) overriding the model config's own
    /// [`LlamaConfig::sliding_window`] (of the HF checkpoint, the init config, or the resumed
    /// checkpoint); `None`: keep the model's. Checkpoints are written with the window used.
    pub sliding_window: Option<usize>,
    /// LoRA fine-tuning ([`crate::lora`]): adapters on these projections are trained, every
    /// other parameter frozen (no gradient, no optimizer state); each checkpoint holds the
    /// adapters as a PEFT adapter naming the base model. `None`: train every parameter.
    pub lora: Option<crate::LoraSpec>,
    /// A PEFT adapter directory (e.g. one published for the base model) the adapters start
    /// from instead of being drawn; its rank, alpha and targets must be [`TrainConfig::lora`]'s.
    /// A resumed run takes its checkpoint's adapters instead.
    pub lora_init: Option<PathBuf>,
    /// A LoRA run's frozen base held quantized (QLoRA-style, [`crate::quant`]): the decoder
    /// layers' projections as int8 or NF4 codes, dequantized layer by layer in each forward
    /// (with [`TrainConfig::recompute`], one layer's at a time). `None`: as loaded.
    pub quantize_base: Option<candle_cp_nn::QuantConfig>,
    /// Held-out evaluation every few steps ([`super::eval`]): `eval_loss` in the metrics of
    /// the steps that evaluate. `None`: none.
    pub eval: Option<super::EvalConfig>,
}

impl TrainConfig {
    /// A run of `steps` optimizer steps of `seq_len` tokens on `layout`, everything else at its
    /// plain setting: one row per step, no accumulation, AdamW defaults at lr 1e-3 (no warmup,
    /// cosine to 10%), clipping at 1.0, seed 0, f32 on the CPU, no checkpoints, no ZeRO, no
    /// recompute, no overlap, the loss on every target, the model's own window. Set the
    /// other fields with struct update syntax (`TrainConfig { batch: 4, ..TrainConfig::new(..) }`).
    pub fn new(layout: Layout, model: ModelSource, data: DataSource, seq_len: usize, steps: usize) -> Self {
        Self {
            layout,
            model,
            data,
            seq_len,
            batch: 1,
            grad_accum: 1,
            steps,
            schedule: WarmupCosine { peak: 1e-3, warmup: 0, total: steps, min_ratio: 0.1 },
            adamw: AdamWConfig::default(),
            clip: 1.0,
            seed: 0,
            out: None,
            save_every: 0,
            keep: 0,
            resume: false,
            stop_after: None,
            dtype: DType::F32,
            cuda: false,
            gpus: 1,
            zero2: false,
            zero1: false,
            recompute: false,
            overlap_grad_sync: false,
            overlap_param_gather: false,
            long_range_only: false,
            dpo: None,
            grpo: None,
            reward: None,
            prm: None,
            expert_bias_update: None,
            tokenizer: None,
            args: serde_json::Value::Null,
            sliding_window: None,
            lora: None,
            lora_init: None,
            quantize_base: None,
            eval: None,
        }
    }
}

/// What [`crate::train::train_rank`] returns.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Metrics of the steps run by THIS call (not the ones before a resume).
    pub metrics: Vec<StepMetrics>,
    /// Step the run started from (0, or the resumed checkpoint's step).
    pub start_step: usize,
    /// On a resume whose TP degree differs from the checkpoint's, or under expert parallelism
    /// (each EP rank takes its experts' slice of the files): the checkpoint's TP degree (the
    /// optimizer state was resharded from its files). `None` when the run read its own TP
    /// rank's file, or did not resume.
    pub optimizer_resharded_from: Option<usize>,
    /// Model config used.
    pub config: LlamaConfig,
    /// Number of parameters of the full model (a LoRA run's adapters included).
    pub n_params: usize,
    /// Number of those the run trains (a LoRA run: the adapters).
    pub trainable_params: usize,
    /// Bytes of Adam state on this rank ([`super::AdamW::state_bytes`]: ZeRO's slices, the
    /// experts this rank holds under expert parallelism).
    pub optimizer_state_bytes: usize,
    /// Bytes of frozen weights on this rank (a LoRA run's base: its codes and scales with
    /// [`TrainConfig::quantize_base`], and the weights left unquantized); 0 for a full
    /// fine-tune.
    pub frozen_weight_bytes: usize,
}
