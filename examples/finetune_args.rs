//! `finetune_llama`'s flags ([`Args`]) and what they build: the layout, the data source.
//! Included by `finetune_llama.rs` with `#[path]`.

use anyhow::{bail, Context, Result};
use candle_cp_llama::train::{DataSource, KvRecall, PackedStream, PreferenceSet, TokenStream};
use candle_cp_llama::chat::ChatTemplate;
use candle_cp_llama::{CpKind, HeadLayout, Layout, RowSums};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    about = "Fine-tune a Llama-style model with context parallelism (thread ranks on CPU, or GPUs)"
)]
pub(crate) struct Args {
    /// Global sequence length T (tokens per row, split over the CP ranks).
    #[arg(long, default_value_t = 512)]
    pub(crate) seq_len: usize,
    /// Context-parallel degree.
    #[arg(long, default_value_t = 4)]
    pub(crate) cp: usize,
    /// CP algorithm: ring, zigzag, striped, allgather, ulysses, 2d.
    #[arg(long, default_value = "zigzag")]
    pub(crate) cp_kind: String,
    /// Ulysses degree for --cp-kind 2d (cp = ulysses · ring).
    #[arg(long, default_value_t = 2)]
    pub(crate) ulysses: usize,
    /// With --cp-kind ulysses or 2d: keep only the sequence layout of q, k, v and the
    /// attention output for the backward, which all-to-alls them to heads again (less
    /// activation memory, 50% more all-to-all volume). Same training, bit for bit.
    #[arg(long)]
    pub(crate) regather_heads: bool,
    /// bf16 / f16: where the attention backward's row sums take the output from. f32: the f32
    /// output (its bf16 rounding residual kept, 2 bytes per attention output element; dq and
    /// dk as accurate as with f32 outputs); output: the returned 16-bit output (nothing kept,
    /// FlashAttention's choice). [default: f32 for the ring kinds and 2d, output on one device
    /// and for ulysses]
    #[arg(long)]
    pub(crate) row_sums: Option<String>,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub(crate) tp: usize,
    /// Megatron sequence parallelism inside the TP group.
    #[arg(long)]
    pub(crate) sp: bool,
    /// Data-parallel degree (gradients all-reduced over DP × CP).
    #[arg(long, default_value_t = 1)]
    pub(crate) dp: usize,
    /// Expert-parallel degree (a mixture of experts, --moe or an MoE checkpoint): each sparse
    /// layer's experts split over `ep` of the DP × CP ranks, the routed tokens sent to their
    /// experts' ranks and back. Must divide dp · cp and the experts.
    #[arg(long, default_value_t = 1)]
    pub(crate) ep: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 400)]
    pub(crate) steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-2)]
    pub(crate) lr: f64,
    /// Warmup steps (linear), then cosine decay.
    #[arg(long, default_value_t = 10)]
    pub(crate) warmup: usize,
    /// Final learning rate as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) min_lr_ratio: f64,
    /// AdamW weight decay (matrices only).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) weight_decay: f64,
    /// Clip the global gradient norm (0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) clip: f64,
    /// Global rows per micro-batch (default: 4 for the synthetic task, else dp; must be a
    /// multiple of dp).
    #[arg(long)]
    pub(crate) batch: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub(crate) grad_accum: usize,
    /// Run seed (initial weights, data).
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Text file to fine-tune on (byte-level tokens unless --tokenizer).
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// HF tokenizer.json for --data (also written beside each checkpoint's weights, unless
    /// --model's own tokenizer is carried there).
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Pack documents: split --data into documents on --doc-separator (blank lines) and fill
    /// each sequence with consecutive documents (the last one cut). Attention stays inside a
    /// document, RoPE positions restart per document, and no document's last token is trained
    /// to predict the next document; the CP shards cut documents anywhere (no padding).
    /// Needs --data (the synthetic task is one sequence per row).
    #[arg(long)]
    pub(crate) pack_docs: bool,
    /// --data (and --eval-data) is supervised JSON lines in TRL's forms: prompt / completion
    /// (`{"prompt": ..., "completion": ...}`, each completion ended by --eos, default: --model's
    /// first `eos_token_id`, with --tokenizer) or conversations (`{"messages": [{"role": ...,
    /// "content": ...}, ...]}`, or prompt and completion as lists of messages) rendered through
    /// --chat-template; each example one packed document (attention and RoPE per example, no
    /// padding), the loss on the completion tokens or the assistant turns (default --loss-on
    /// completion).
    #[arg(long)]
    pub(crate) sft: bool,
    /// Train by DPO: --data is preference JSON lines in TRL's forms (`{"prompt": ...,
    /// "chosen": ..., "rejected": ...}`, strings or lists of messages through --chat-template;
    /// or conversations `{"chosen": [...], "rejected": [...]}` sharing their leading turns), each
    /// pair packed whole; the reference is the model as the run starts.
    #[arg(long)]
    pub(crate) dpo: bool,
    /// DPO's β (how far the policy may move from the reference).
    #[arg(long, default_value_t = 0.1)]
    pub(crate) beta: f64,
    /// DPO's label smoothing ε (conservative DPO, robust DPO and EXO: the chance a pair's labels
    /// are flipped).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) dpo_label_smoothing: f64,
    /// DPO's loss of a pair (TRL's loss_type names): sigmoid (DPO's), robust, exo_pair (needs
    /// --dpo-label-smoothing > 0), ipo (per-token log-ratios), hinge, nca_pair, sppo_hard,
    /// apo_zero, apo_down, discopop (--discopop-tau), bco_pair (each answer's reward against a
    /// running mean reward), aot_pair / aot (sorted over the batch), sft (the chosen answers'
    /// cross-entropy), simpo (reference-free, the answers' mean log-probabilities, margin
    /// --simpo-gamma) or orpo (reference-free, the log odds ratio of the answers' mean
    /// probabilities, times --beta, plus the chosen answers' cross-entropy). Several, comma
    /// separated, mix (TRL's loss_type list; MPO: sigmoid,bco_pair,sft with --dpo-loss-weights
    /// 0.8,0.2,1).
    #[arg(long, default_value = "sigmoid")]
    pub(crate) dpo_loss: String,
    /// f-DPO's divergence (TRL's f_divergence_type): reverse_kl (DPO's), js_divergence or
    /// alpha_divergence (--f-alpha-divergence-coef); the sigmoid, robust, exo_pair, hinge and
    /// discopop losses take it.
    #[arg(long, default_value = "reverse_kl")]
    pub(crate) f_divergence: String,
    /// The α-divergence's coefficient α (--f-divergence alpha_divergence).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) f_alpha_divergence_coef: f64,
    /// LD-DPO's α (TRL's ld_alpha): the policy's log-probability of an answer weighs the
    /// tokens past the shorter answer of its pair by α (0..=1; none: plain DPO). Pair losses
    /// other than orpo.
    #[arg(long, value_name = "A")]
    pub(crate) ld_alpha: Option<f64>,
    /// WPO (TRL's use_weighting): each pair's loss weighed by how likely the policy is to
    /// produce its answers, min(1, exp(m_chosen + m_rejected)), m an answer's mean of log p −
    /// log Σ p² over its tokens. Pair losses other than orpo and aot.
    #[arg(long)]
    pub(crate) use_weighting: bool,
    /// TR-DPO (TRL's sync_ref_model): every --ref-model-sync-steps steps the reference's
    /// weights move to α·policy + (1 − α)·reference (--ref-model-mixup-alpha) and its
    /// log-probabilities are computed anew. Not with --lora or a reference-free loss.
    #[arg(long)]
    pub(crate) sync_ref_model: bool,
    /// TR-DPO's steps between reference updates (--sync-ref-model).
    #[arg(long, default_value_t = 512)]
    pub(crate) ref_model_sync_steps: usize,
    /// TR-DPO's α, the policy's share of the updated reference (--sync-ref-model; 1: a copy).
    #[arg(long, default_value_t = 0.6)]
    pub(crate) ref_model_mixup_alpha: f64,
    /// The weights of a --dpo-loss mix, comma separated (default: 1 each).
    #[arg(long, value_name = "W,..")]
    pub(crate) dpo_loss_weights: Option<String>,
    /// SimPO's target margin γ (--dpo-loss simpo).
    #[arg(long, default_value_t = 0.5)]
    pub(crate) simpo_gamma: f64,
    /// DPO's reference model, a Hugging Face checkpoint directory (default: the model as the
    /// run starts), loaded for the reference pass before step 1 only.
    #[arg(long, value_name = "DIR")]
    pub(crate) ref_model: Option<PathBuf>,
    /// RPO's α: α × the chosen answers' mean cross-entropy added to the DPO loss.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) rpo_alpha: f64,
    /// DiscoPOP's temperature τ (--dpo-loss discopop).
    #[arg(long, default_value_t = 0.05)]
    pub(crate) discopop_tau: f64,
    /// DPO without a reference (TRL's reference_free): the reference log-probabilities taken
    /// as 0, no reference pass; with --rpo-alpha 1, CPO's objective.
    #[arg(long)]
    pub(crate) reference_free: bool,
    /// Train by KTO on unpaired examples: --data is JSON lines `{"prompt": ..., "completion":
    /// ..., "label": true | false}` (strings, or lists of messages through --chat-template), or
    /// preference pairs (each gives a desirable and an undesirable example); each example is
    /// packed beside its KL document (its prompt with another example's completion). --beta,
    /// --ref-model as DPO's; with --dpo-loss apo_zero_unpaired, TRL's KTOTrainer's APO-zero for
    /// unpaired examples instead (no KL documents).
    #[arg(long)]
    pub(crate) kto: bool,
    /// Train by BCO (TRL's BCOTrainer) on unpaired examples: --data as --kto's, without KL
    /// documents; each reward against a running mean reward δ (kept in the checkpoints). --beta,
    /// --ref-model as DPO's.
    #[arg(long)]
    pub(crate) bco: bool,
    /// Train a reward model (TRL's RewardTrainer) on preference pairs (--data as --dpo's): the
    /// model gets a score head (a causal LM's drawn, its LM head left unread) read at each
    /// answer's last token, the loss −log σ(r_chosen − r_rejected − margin) (a line's `margin`,
    /// TRL's column, where every line has one; else 0); checkpoints are
    /// `*ForSequenceClassification` models.
    #[arg(long)]
    pub(crate) reward_model: bool,
    /// --reward-model's centring term: this times the mean squared sum of each pair's rewards
    /// (TRL's center_rewards_coefficient; 0: none).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) center_rewards_coefficient: f64,
    /// KTO's weight of a desirable example's loss (λ_D).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) desirable_weight: f64,
    /// KTO's weight of an undesirable example's loss (λ_U).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) undesirable_weight: f64,
    /// The chat template of --sft / --dpo / --kto / --bco conversations: llama3, chatml, qwen3, qwen3-thinking, qwen3-no-think, gemma, phi3, phi4, granite,
    /// deepseek, harmony (gpt-oss), glm4, glm4.5, olmo2, tulu (Llama-3.1-Tulu-3), exaone4, exaone3.5, mistral-v1, mistral-v3 or mistral-v7 (default: the family of --model's own template, from its chat_template.jinja or
    /// tokenizer_config.json).
    #[arg(long, value_name = "NAME")]
    pub(crate) chat_template: Option<String>,
    /// The token id appended to every --sft completion (overrides --model's end-of-sequence id).
    #[arg(long)]
    pub(crate) eos: Option<u32>,
    /// Document separator for --pack-docs (`\n` means a newline).
    #[arg(long, default_value = "\\n\\n")]
    pub(crate) doc_separator: String,
    /// HF Llama checkpoint directory to start from (default: random init).
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Output directory: metrics.jsonl, loss.png, checkpoints/.
    #[arg(long, default_value = "runs/finetune")]
    pub(crate) out: PathBuf,
    /// Checkpoint every N steps (0 = only at the end).
    #[arg(long, default_value_t = 100)]
    pub(crate) save_every: usize,
    /// Keep the newest N checkpoints (0 = all).
    #[arg(long, default_value_t = 2)]
    pub(crate) keep: usize,
    /// Continue from the newest checkpoint in --out.
    #[arg(long)]
    pub(crate) resume: bool,
    /// Stop after this step without the final checkpoint (simulates a killed run).
    #[arg(long)]
    pub(crate) stop_after: Option<usize>,
    /// Causal sliding-window attention (Mistral `sliding_window`): each token attends to
    /// itself and the N - 1 tokens before it, on every layout (and within each document with
    /// --pack-docs). Overrides the `sliding_window` of a --model checkpoint's config.json,
    /// which is used otherwise; default: none (full causal attention).
    #[arg(long)]
    pub(crate) sliding_window: Option<usize>,
    /// Random-init model width.
    #[arg(long, default_value_t = 64)]
    pub(crate) hidden: usize,
    /// Random-init model depth.
    #[arg(long, default_value_t = 2)]
    pub(crate) layers: usize,
    /// Random-init query heads.
    #[arg(long, default_value_t = 4)]
    pub(crate) heads: usize,
    /// Random-init KV heads.
    #[arg(long, default_value_t = 2)]
    pub(crate) kv_heads: usize,
    /// Random-init model with biases on the q, k, v projections (Qwen2; saved as
    /// `Qwen2ForCausalLM`). A --model checkpoint's config.json says for itself.
    #[arg(long)]
    pub(crate) qkv_bias: bool,
    /// Random-init model with RMSNorms over each q and k head before RoPE (Qwen3; saved as
    /// `Qwen3ForCausalLM`). A --model checkpoint's config.json says for itself.
    #[arg(long)]
    pub(crate) qk_norm: bool,
    /// Random-init Gemma 3 model (`Gemma3ForCausalLM`: `1 + w` norms, norms after attention and
    /// MLP, GELU MLP, scaled embedding, tied head; with --sliding-window, the window on all
    /// but every sixth layer, which rotate by a RoPE of their own).
    #[arg(long)]
    pub(crate) gemma3: bool,
    /// Random-init model shaped as Gemma 2: Gemma 3's norms, MLP and embedding factor without
    /// the q, k head norms, logits soft-capped in attention (50) and at the output (30), and
    /// with --sliding-window, the window on every other layer (0, 2, 4, ...). On CUDA the capped
    /// attention runs the pipelined kernels' capped entries (CUDA-core ones for f32).
    #[arg(long)]
    pub(crate) gemma2: bool,
    /// Random-init Phi-3 (`Phi3ForCausalLM`: checkpoints with fused `qkv_proj` /
    /// `gate_up_proj`) with LongRoPE over an original length of half --seq-len (so the long
    /// factors act; `max_position_embeddings` 16 times that), the window of --sliding-window on
    /// every layer.
    #[arg(long)]
    pub(crate) phi3: bool,
    /// Random-init SmolLM3 (`SmolLM3ForCausalLM`): every fourth layer (3, 7, ...; the last one
    /// with fewer than four) attends without RoPE (NoPE), a tied head; the window of
    /// --sliding-window on the NoPE layers.
    #[arg(long)]
    pub(crate) smollm3: bool,
    /// Random-init Granite (`GraniteForCausalLM`) with granite-3.x's multipliers: the embedding
    /// times 12, the softmax scale 1/head_dim, each residual branch times 0.22, the logits / 16.
    /// With --moe E,K: GraniteMoE (`GraniteMoeForCausalLM`), those multipliers over E experts
    /// --hidden wide on every layer, the top K renormalised.
    #[arg(long)]
    pub(crate) granite: bool,
    /// Random-init OLMo 3 (`Olmo3ForCausalLM`): norms after the attention and the MLP (none
    /// before), q and k norms over the whole projections (their statistic all-reduced over
    /// --tp); the window of --sliding-window on three layers of four (all but 3, 7, ...), none
    /// without it.
    #[arg(long)]
    pub(crate) olmo3: bool,
    /// Random-init EXAONE 4 (`Exaone4ForCausalLM`): norms after the attention and the MLP (none
    /// before), q and k head norms; with --sliding-window, the window on three layers of four
    /// (all but 3, 7, ...; the last layer always global), the global layers without RoPE.
    #[arg(long)]
    pub(crate) exaone4: bool,
    /// Random-init GLM-4 (`Glm4ForCausalLM`): norms before and after the attention and the MLP,
    /// q, k, v biases, RoPE on half of each head (interleaved in its checkpoints).
    #[arg(long)]
    pub(crate) glm4: bool,
    /// Random-init GLM (`GlmForCausalLM`, GLM-4-9B-chat-hf's): GLM-4's q, k, v biases and
    /// interleaved RoPE on half of each head with a Llama's norms.
    #[arg(long)]
    pub(crate) glm: bool,
    /// With --moe: an OLMoE (`OlmoeForCausalLM`) instead of a Qwen3-MoE: OLMo's q and k norms over
    /// the whole projections in place of the head norms, the top-K not renormalised.
    #[arg(long)]
    pub(crate) olmoe: bool,
    /// With --moe: a GLM-4.5 (`Glm4MoeForCausalLM`) instead of a Qwen3-MoE: sigmoid router
    /// scores chosen with a correction bias, scaled by 2.5, one shared expert, the first layer
    /// dense, q, k, v biases with the head norms, RoPE on half of each head; no load-balancing
    /// loss.
    #[arg(long)]
    pub(crate) glm4_moe: bool,
    /// With --moe: a DeepSeek-V3 (`DeepseekV3ForCausalLM`): GLM-4.5's experts (without its
    /// biases and head norms) under multi-head latent attention — q rank hidden/2, KV rank
    /// hidden/4, per head 64 dimensions without RoPE, 32 with (interleaved), values 64 wide.
    #[arg(long)]
    pub(crate) deepseek: bool,
    /// With --deepseek: DeepSeek-V2 (`DeepseekV2ForCausalLM`) instead: its softmax router
    /// (scaled by 2.5, not renormalised) in place of the sigmoid one, the same attention.
    #[arg(long)]
    pub(crate) deepseek_v2: bool,
    /// Loss-free load balancing of a sigmoid router (GLM-4.5's correction bias): after each step
    /// every sparse layer's bias moves by RATE · sign(mean − count) of the step's global expert
    /// counts (Megatron-Core's moe_router_bias_update_rate, 1e-3 there). Without it the bias stays
    /// as loaded.
    #[arg(long, value_name = "RATE")]
    pub(crate) expert_bias_update: Option<f64>,
    /// With --phi3: RoPE on this share of each head only (`partial_rotary_factor`; Phi-4-mini:
    /// 0.75), the other dimensions passed through.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) partial_rotary: f64,
    /// A Qwen3-MoE model (random init): `E,K` — every layer's MLP a mixture of E experts, K
    /// per token (renormalised), each --hidden wide, with the load-balancing loss (coefficient
    /// 0.01); q, k head norms as Qwen3. Experts are split over --tp (each rank holds every
    /// expert's slice); each CP rank routes its own tokens.
    #[arg(long, value_name = "E,K")]
    pub(crate) moe: Option<String>,
    /// A gpt-oss model (random init): `E,K` — every layer's MLP E experts, K per token, each
    /// --hidden wide, with biases on the router and the experts and the clamped SwiGLU; biases
    /// on q, k, v and o; attention sinks (one logit per head, applied once to each row on every
    /// CP layout); with --sliding-window, the window on every other layer (0, 2, 4, ...).
    #[arg(long, value_name = "E,K")]
    pub(crate) gpt_oss: Option<String>,
    /// LoRA fine-tuning: `R,ALPHA` — adapters of rank R (scale ALPHA/R) on --lora-targets,
    /// every other weight frozen (no gradient, no optimizer state); checkpoints hold a PEFT
    /// adapter (adapter_model.safetensors, adapter_config.json) naming the base model: --model,
    /// or OUT/base written once (a random init, a changed --sliding-window).
    #[arg(long, value_name = "R,ALPHA")]
    pub(crate) lora: Option<String>,
    /// Dropout on the LoRA adapters' inputs while training (PEFT's lora_dropout; with
    /// --lora-from, the adapter file's unless given).
    #[arg(long, value_name = "P")]
    pub(crate) lora_dropout: Option<f64>,
    /// rsLoRA: scale the --lora update by ALPHA/√R instead of ALPHA/R (PEFT's use_rslora).
    #[arg(long, requires = "lora")]
    pub(crate) rslora: bool,
    /// DoRA (PEFT's use_dora): each adapted weight m/‖W + s·B·A‖ ⊙ (W + s·B·A), a magnitude m
    /// per output row trained beside the --lora factors (started at the rows' norms).
    #[arg(long, requires = "lora")]
    pub(crate) dora: bool,
    /// Modules trained whole beside the --lora adapters and saved in the adapter file (PEFT's
    /// modules_to_save): embed_tokens, lm_head (e.g. for tokens added to the vocabulary).
    #[arg(long, value_name = "M,..", requires = "lora")]
    pub(crate) lora_modules_to_save: Option<String>,
    /// Start the LoRA adapters from this PEFT adapter directory (adapter_config.json,
    /// adapter_model.safetensors; e.g. one published for --model) instead of drawing them; its
    /// rank, alpha and targets are the run's (with --lora too, they must agree). A transformers 5
    /// adapter on a mixture (experts as parameters: target_parameters, or target modules that
    /// reach no expert) trains as transformers 5's model and is written in its layout.
    #[arg(long, value_name = "DIR")]
    pub(crate) lora_from: Option<PathBuf>,
    /// Hold the LoRA run's frozen base quantized (QLoRA-style): `int8` or `nf4`, optionally
    /// with the group width (inputs per scale, default 64), e.g. `nf4,32`, and `,dq` to
    /// quantize the scales too (u8 per scale, blocks of 16 rows; `,dqROWS` another block), e.g.
    /// `nf4,64,dq`. The decoder layers' projections are dequantized layer by layer in each
    /// forward (add --recompute to keep one layer's at a time).
    #[arg(long, value_name = "KIND[,GROUP[,dq]]")]
    pub(crate) quantize_base: Option<String>,
    /// Evaluate the held-out loss every N optimizer steps (and after the last); 0: never. A
    /// corpus (--data) keeps its last --eval-fraction out of training for it; the synthetic
    /// task draws fresh samples.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub(crate) eval_every: usize,
    /// Held-out batches (of --batch rows) per evaluation; the same rows every time.
    #[arg(long, default_value_t = 4)]
    pub(crate) eval_batches: usize,
    /// The share of a --data corpus held out (its end: tokens, or documents with --pack-docs).
    #[arg(long, default_value_t = 0.05)]
    pub(crate) eval_fraction: f64,
    /// Held-out text of its own for --eval-every (read as --data is: the same --tokenizer,
    /// --pack-docs and separator); the whole --data corpus then trains (no --eval-fraction).
    #[arg(long, value_name = "FILE")]
    pub(crate) eval_data: Option<PathBuf>,
    /// The projections --lora adapts (PEFT names, comma-separated; `all-linear`: all seven, and
    /// a mixture's routers `gate` / `shared_expert_gate` as PEFT's all-linear adapts them).
    #[arg(long, default_value = "q_proj,k_proj,v_proj,o_proj")]
    pub(crate) lora_targets: String,
    /// Expert parameters --lora adapts beside --lora-targets (PEFT's target_parameters,
    /// comma-separated): gpt-oss's `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, or one
    /// layer's (`7.mlp.experts.down_proj`); rank R per expert, no dropout or DoRA.
    #[arg(long, value_name = "P,..", requires = "lora")]
    pub(crate) lora_target_parameters: Option<String>,
    /// Random-init vocabulary size: at least what the data needs (the default); larger
    /// leaves unused tokens, as fine-tuning does when it adds special tokens. A size --tp does
    /// not divide (e.g. 99 at --tp 4) pads the vocabulary-parallel tables.
    #[arg(long)]
    pub(crate) vocab: Option<usize>,
    /// Recall task: number of keys (each sequence draws a random key→value map).
    #[arg(long, default_value_t = 8)]
    pub(crate) keys: usize,
    /// Recall task: number of values (chance long-range loss is ln(values)).
    #[arg(long, default_value_t = 8)]
    pub(crate) values: usize,
    /// Recall task: queries (distinct keys) per sequence; default min(keys, T/8).
    #[arg(long)]
    pub(crate) queries: Option<usize>,
    /// Recall task: store a pair as two tokens `k v` (needs an induction circuit: learns
    /// much more slowly) instead of one fused token.
    #[arg(long)]
    pub(crate) unfused: bool,
    /// Training objective: `all` next-token targets, or the marked targets only: `long-range`
    /// (the synthetic task's answers) or `completion` (--sft's completion tokens or assistant turns; the same
    /// selection). Default: long-range for the synthetic task, completion with --sft, all for
    /// --data. With a selection, the progress line also shows the (untrained) all-target loss
    /// as `all`.
    #[arg(long)]
    pub(crate) loss_on: Option<String>,
    /// Compute device of the ranks: cpu, or cuda (build with `--features cuda`; with --comm
    /// threads rank r uses GPU r % --gpus, several ranks may share one GPU).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// GPUs to spread the ranks over with --device cuda (--comm nccl: one rank per GPU, so at
    /// least as many as the layout has ranks).
    #[arg(long, default_value_t = 1)]
    pub(crate) gpus: usize,
    /// Collectives: `threads` (ranks are threads of this process; tensors cross devices
    /// through the host) or `nccl` (GPUs only, build with `--features nccl`): one thread per
    /// GPU in this process, or, when RANK and WORLD_SIZE are set (a launcher started one
    /// process per GPU), this process's rank (LOCAL_RANK = its GPU, the NCCL id through
    /// MASTER_ADDR:MASTER_PORT or CANDLE_CP_NCCL_ID_FILE).
    #[arg(long, default_value = "threads")]
    pub(crate) comm: String,
    /// Weight dtype: f32, bf16 or f16 (low precision is meant for GPUs).
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// ZeRO-1: split the optimizer state over the DP x CP replicas (1/(dp·cp) of it per rank;
    /// same training, same checkpoints).
    #[arg(long)]
    pub(crate) zero1: bool,
    /// ZeRO-2: --zero1, and the replicas' gradients reduce-scattered into f32 slices after
    /// every micro-batch instead of accumulated whole (less memory with --grad-accum > 1).
    #[arg(long)]
    pub(crate) zero2: bool,
    /// Recompute every decoder layer in backward instead of keeping its activations (less
    /// memory at long context, about one more forward of the layers).
    #[arg(long)]
    pub(crate) recompute: bool,
    /// With --recompute: start each layer's gradient reduction over the DP x CP replicas as
    /// soon as its backward is done (on a communicator of its own), overlapping the rest of
    /// the backward. Same training, bit for bit.
    #[arg(long, requires = "recompute")]
    pub(crate) overlap_grad_sync: bool,
    /// With --zero1 or --zero2: start the all-gathers of the updated parameters after the
    /// optimizer step and wait for each layer's only when the next forward reaches it (the
    /// later layers' parameters travel while the earlier ones compute). Same training.
    #[arg(long)]
    pub(crate) overlap_param_gather: bool,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 600)]
    pub(crate) timeout: u64,
    #[command(flatten)]
    pub(crate) grpo: super::grpo_args::GrpoArgs,
    #[command(flatten)]
    pub(crate) prm: super::prm_args::PrmArgs,
}

impl Args {
    /// Whether the run trains on preference data (--dpo, --kto, --bco or --reward-model).
    pub(crate) fn preference(&self) -> bool {
        self.dpo || self.unpaired() || self.reward_model
    }

    /// Whether the run trains on unpaired examples (--kto or --bco).
    pub(crate) fn unpaired(&self) -> bool {
        self.kto || self.bco
    }

    /// The preference objective's flag.
    pub(crate) fn objective_flag(&self) -> &'static str {
        if self.kto {
            "--kto"
        } else if self.bco {
            "--bco"
        } else if self.reward_model {
            "--reward-model"
        } else {
            "--dpo"
        }
    }
}

/// `--dpo-loss A,B,..` with `--dpo-loss-weights`: the losses mixed and their weights (empty for
/// one loss without weights).
pub(crate) fn dpo_mix(a: &Args) -> Result<Vec<(candle_cp_llama::train::DpoLoss, f64)>> {
    let names: Vec<&str> = a.dpo_loss.split(',').map(str::trim).collect();
    if names.len() == 1 && a.dpo_loss_weights.is_none() {
        return Ok(Vec::new());
    }
    if !a.dpo {
        bail!("--dpo-loss {} / --dpo-loss-weights mix DPO's pair losses: add --dpo", a.dpo_loss)
    }
    let weights: Vec<f64> = match &a.dpo_loss_weights {
        None => vec![1.0; names.len()],
        Some(w) => w.split(',').map(|x| x.trim().parse::<f64>().map_err(|e| anyhow::anyhow!("--dpo-loss-weights {w}: {x:?}: {e}"))).collect::<Result<_>>()?,
    };
    if weights.len() != names.len() {
        bail!("--dpo-loss {} names {} losses, --dpo-loss-weights gives {} weights", a.dpo_loss, names.len(), weights.len())
    }
    names.iter().zip(weights).map(|(n, w)| Ok((n.parse::<candle_cp_llama::train::DpoLoss>()?, w))).collect()
}

pub(crate) fn layout(a: &Args) -> Result<Layout> {
    let kind: CpKind = a.cp_kind.parse()?;
    let l = match kind {
        CpKind::TwoD => {
            if !a.cp.is_multiple_of(a.ulysses) {
                bail!(
                    "--cp {} must be a multiple of --ulysses {}",
                    a.cp,
                    a.ulysses
                )
            }
            Layout::two_d(a.ulysses, a.cp / a.ulysses)
        }
        k => Layout::cp(k, a.cp),
    };
    if a.regather_heads && !matches!(kind, CpKind::Ulysses | CpKind::TwoD) {
        bail!("--regather-heads applies to --cp-kind ulysses or 2d, not {kind}")
    }
    let heads = if a.regather_heads { HeadLayout::Regathered } else { HeadLayout::Kept };
    let mut l = l.with_tp(a.tp, a.sp).with_dp(a.dp).with_ep(a.ep).with_head_layout(heads);
    match a.row_sums.as_deref() {
        None => {}
        Some("f32") => l = l.with_row_sums(RowSums::F32),
        Some("output") => l = l.with_row_sums(RowSums::Output),
        Some(x) => bail!("--row-sums {x}: expected f32 or output"),
    }
    l.check_degrees()?;
    Ok(l)
}

pub(crate) fn data_source(a: &Args) -> Result<(DataSource, String)> {
    if a.sft && a.data.is_none() {
        bail!("--sft reads prompt / completion examples or conversations: give them as --data FILE.jsonl")
    }
    if a.grpo.grpo && (a.data.is_none() || a.sft || a.preference() || a.pack_docs) {
        bail!("--grpo samples completions of the prompts of --data FILE.jsonl (prompt / completion examples): without --sft, --dpo, --kto, --bco or --pack-docs")
    }
    // (--step-separator is also a process reward model's as GRPO's reward)
    a.prm.check(a.grpo.grpo && a.grpo.reward_model_dir.is_some())?;
    if a.prm.prm && (a.data.is_none() || a.sft || a.preference() || a.grpo.grpo || a.pack_docs) {
        bail!("--prm trains on the stepwise examples of --data FILE.jsonl: without --sft, --dpo, --kto, --bco, --reward-model, --grpo or --pack-docs")
    }
    if [a.dpo, a.kto, a.bco, a.reward_model].iter().filter(|&&x| x).count() > 1 {
        bail!("--dpo, --kto, --bco and --reward-model are objectives: give one")
    }
    if !a.reward_model && a.center_rewards_coefficient != 0.0 {
        bail!("--center-rewards-coefficient is --reward-model's: add it")
    }
    let flag = a.objective_flag();
    if a.preference() && (a.sft || a.pack_docs) {
        bail!("{flag} reads preference data: without --sft or --pack-docs")
    }
    if a.preference() && a.data.is_none() {
        bail!("{flag} trains on preference data: give it as --data FILE.jsonl")
    }
    if !a.kto && (a.desirable_weight != 1.0 || a.undesirable_weight != 1.0) {
        bail!("--desirable-weight / --undesirable-weight are KTO's: add --kto")
    }
    if a.chat_template.is_some() && !(a.sft || a.preference()) {
        bail!("--chat-template renders --sft / --dpo / --kto / --bco conversations: add one of them")
    }
    if a.pack_docs && a.data.is_none() {
        bail!("--pack-docs packs the documents of a text corpus: give --data FILE (documents separated by blank lines, or --doc-separator)")
    }
    let Some(path) = &a.data else {
        let mut t = KvRecall::new(a.seq_len)?;
        t.n_keys = a.keys;
        t.n_values = a.values;
        t.n_queries = a.queries.unwrap_or(a.keys.min(a.seq_len / 8));
        t.fused = !a.unfused;
        t.validate()?;
        let desc = format!(
            "synthetic key→value recall: {} keys stored in [T/4, T/2), {} queries in the last quarter (chance long-range loss ln {} = {:.2})",
            t.n_keys,
            t.long_range_targets(),
            t.n_values,
            (t.n_values as f64).ln()
        );
        return Ok((DataSource::Recall(t), desc));
    };
    corpus_source(a, path, "--data")
}

/// A text file as --data reads it (`flag` names the option in errors): byte-level or through
/// --tokenizer, packed documents with --pack-docs; and its description.
pub(crate) fn corpus_source(a: &Args, path: &std::path::Path, flag: &str) -> Result<(DataSource, String)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {flag} {}", path.display()))?;
    if a.prm.prm {
        return match &a.tokenizer {
            None => a.prm.read(path, &bytes, flag, &candle_cp_llama::train::sft::bytes_of),
            Some(tp) => {
                let tok = load_tokenizer(tp)?;
                let encode = |s: &str, special: bool| -> candle_core::Result<Vec<u32>> {
                    tok.encode(s, special).map(|e| e.get_ids().to_vec()).map_err(|e| candle_core::Error::Msg(format!("tokenizing: {e}")))
                };
                a.prm.read(path, &bytes, flag, &encode)
            }
        };
    }
    if a.sft || a.preference() || a.grpo.grpo {
        return sft_source(a, path, &bytes, flag);
    }
    if a.pack_docs {
        return packed_source(a, path, &bytes);
    }
    let stream = match &a.tokenizer {
        None => TokenStream::from_bytes(&bytes),
        Some(tp) => {
            let tok = load_tokenizer(tp)?;
            let text = String::from_utf8_lossy(&bytes);
            let enc = tok
                .encode(text.as_ref(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
            TokenStream {
                tokens: enc.get_ids().to_vec(),
            }
        }
    };
    let desc = format!(
        "{} ({} tokens, {})",
        path.display(),
        stream.tokens.len(),
        if a.tokenizer.is_some() { "tokenizer.json" } else { "byte-level" }
    );
    Ok((DataSource::Text(stream), desc))
}

/// The --tokenizer at `tp`; the error names the file.
fn load_tokenizer(tp: &std::path::Path) -> Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_file(tp).map_err(|e| anyhow::anyhow!("loading --tokenizer {}: {e}", tp.display()))
}

/// `--sft` / `--dpo`: the supervised examples or preference pairs of `bytes` (JSON lines),
/// byte-level or through --tokenizer: prompts with completions or answers, each ended by --eos
/// or the model's end-of-sequence id, and conversations through --chat-template or the model's
/// own.
fn sft_source(a: &Args, path: &std::path::Path, bytes: &[u8], flag: &str) -> Result<(DataSource, String)> {
    let text = std::str::from_utf8(bytes).with_context(|| format!("{flag} {}: not UTF-8 text", path.display()))?;
    let eos = match (a.eos, &a.model, &a.tokenizer) {
        (Some(id), _, _) => Some(id),
        (None, Some(dir), Some(_)) => candle_cp_llama::stop_tokens(dir)?.first().copied(),
        _ => None,
    };
    // the template: named, else the model's own (its error kept for a conversation's)
    let (chat, chat_err) = match (&a.chat_template, &a.model) {
        (Some(name), _) => (Some(ChatTemplate::from_name(name)?), None),
        (None, Some(dir)) => match ChatTemplate::of_model_dir(dir) {
            Ok(t) => (Some(t), None),
            Err(e) => (None, Some(e)),
        },
        (None, None) => (None, None),
    };
    let read = |tokenize: candle_cp_llama::train::sft::Tokenize| -> Result<DataSource> {
        let r = match (a.unpaired(), a.dpo) {
            (true, _) if a.bco || a.dpo_loss == "apo_zero_unpaired" => PreferenceSet::read_unpaired(text, tokenize, eos, chat).and_then(PreferenceSet::without_kl_documents).map(DataSource::Preference),
            (true, _) => PreferenceSet::read_unpaired(text, tokenize, eos, chat).map(DataSource::Preference),
            (false, true) => PreferenceSet::read(text, tokenize, eos, chat).map(DataSource::Preference),
            (false, false) if a.reward_model => PreferenceSet::read(text, tokenize, eos, chat).map(DataSource::Preference),
            (false, false) if a.grpo.grpo => candle_cp_llama::train::sft::read_sft(text, tokenize, eos, chat).and_then(candle_cp_llama::train::grpo::PromptSet::from_marked).map(DataSource::Prompts),
            (false, false) => candle_cp_llama::train::sft::sft_stream(text, tokenize, eos, chat).map(DataSource::Packed),
        };
        match r {
            Err(e) if chat.is_none() && e.to_string().contains("needs a chat template") => {
                let why = chat_err.as_ref().map_or("no --model to take one from".to_string(), |w| w.to_string());
                bail!("{flag} {}: {e}: give --chat-template NAME ({why})", path.display())
            }
            r => r.with_context(|| format!("{flag} {}", path.display())),
        }
    };
    let stream = match &a.tokenizer {
        None => read(&candle_cp_llama::train::sft::bytes_of)?,
        Some(tp) => {
            let tok = load_tokenizer(tp)?;
            let encode = |s: &str, special: bool| -> candle_core::Result<Vec<u32>> {
                tok.encode(s, special).map(|e| e.get_ids().to_vec()).map_err(|e| candle_core::Error::Msg(format!("tokenizing: {e}")))
            };
            read(&encode)?
        }
    };
    let (what, count, tokens, targets) = match &stream {
        DataSource::Preference(p) => match p.desirable() {
            Some(d) => {
                let good = d.iter().filter(|&&x| x).count();
                let kl = if p.has_kl_documents() { " with their KL documents" } else { "" };
                (format!("unpaired examples ({good} desirable, {} not){kl}", d.len() - good), p.len(), p.token_count(), p.target_count())
            }
            None => ("preference pairs".to_string(), p.len(), p.token_count(), p.target_count()),
        },
        DataSource::Packed(p) => ("supervised examples".to_string(), p.count(), p.len(), p.target_count()),
        DataSource::Prompts(p) => {
            let (prompt, answer) = (0..p.len()).filter_map(|i| p.get(i)).fold((0, 0), |(a, b), (x, y)| (a + x.len(), b + y.len()));
            ("prompts with reference completions".to_string(), p.len(), prompt + answer, answer)
        }
        _ => bail!("{flag}: supervised data expected"),
    };
    let desc = format!(
        "{} ({count} {what}, {tokens} tokens, {targets} of them targets, EOS {}, chat template {}, {}), packed",
        path.display(),
        eos.map_or("none".to_string(), |e| e.to_string()),
        chat.map_or("none", |t| t.name()),
        if a.tokenizer.is_some() { "tokenizer.json" } else { "byte-level" }
    );
    Ok((stream, desc))
}

/// `--pack-docs`: the documents of `bytes`, byte-level or through --tokenizer (each
/// document tokenised on its own, with the tokenizer's special tokens: a BOS per document where
/// the tokenizer adds one).
fn packed_source(a: &Args, path: &std::path::Path, bytes: &[u8]) -> Result<(DataSource, String)> {
    let sep = a.doc_separator.replace("\\n", "\n");
    let stream = match &a.tokenizer {
        None => PackedStream::from_bytes(bytes, sep.as_bytes())?,
        Some(tp) => {
            let tok = load_tokenizer(tp)?;
            let docs = candle_cp_llama::train::packed_data::split_documents(bytes, sep.as_bytes())?
                .into_iter()
                .map(|d| {
                    let enc = tok
                        .encode(String::from_utf8_lossy(d).as_ref(), true)
                        .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
                    Ok(enc.get_ids().to_vec())
                })
                .collect::<Result<Vec<_>>>()?;
            PackedStream::from_documents(docs)?
        }
    };
    let desc = format!(
        "{} ({} tokens in {} documents of {:.1} tokens on average, split on {:?}, {}), packed",
        path.display(),
        stream.len(),
        stream.count(),
        stream.mean_doc_len(),
        sep,
        if a.tokenizer.is_some() { "tokenizer.json" } else { "byte-level" }
    );
    Ok((DataSource::Packed(stream), desc))
}
