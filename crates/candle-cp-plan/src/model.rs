//! Model shapes: presets and Hugging Face `config.json` parsing (`model_hf.rs`); parameter
//! counts.

use crate::{plan_bail, Result};
use serde::Serialize;

#[path = "model_hf.rs"]
mod hf;

/// Shape of a Llama-style decoder (pre-norm RMSNorm, GQA attention, SwiGLU MLP).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelConfig {
    /// Preset name or the path the config was read from.
    pub name: String,
    /// Hidden size `h`.
    pub hidden: usize,
    /// Number of decoder layers `L`.
    pub layers: usize,
    /// Query heads `a`.
    pub heads: usize,
    /// Key/value heads `a_kv` (GQA groups; equals `heads` for plain MHA).
    pub kv_heads: usize,
    /// Head dimension `d` (usually `h / a`).
    pub head_dim: usize,
    /// MLP intermediate size `f` (SwiGLU: gate and up are `[h, f]`, down is `[f, h]`).
    pub ffn: usize,
    /// Vocabulary size `v`.
    pub vocab: usize,
    /// Whether the output projection shares the embedding matrix.
    pub tie_embeddings: bool,
    /// Causal sliding window `w` (Mistral `sliding_window`): query `i` sees keys `j` with
    /// `i - w < j <= i`. `None`: plain causal attention. A window of at least the sequence
    /// length is the same as none. Presets have none; `candle-cp plan --sliding-window W`
    /// overrides it.
    pub sliding_window: Option<usize>,
    /// Biases on the q, k, v projections (Qwen2: `model_type` `qwen2`); `q_dim + 2·kv_dim`
    /// more parameters per layer. The Llama presets have none, the Qwen2.5 ones have them.
    pub qkv_bias: bool,
    /// RMSNorms over each q and k head before RoPE (Qwen3: `model_type` `qwen3`): two weights
    /// `[d]` per layer, and what the layer keeps grows (`memory::candle_cp_extra_per_gpu`).
    pub qk_norm: bool,
    /// A window a config puts on some layers only, `(w, n)`: window `w` on `n` of the
    /// `layers` (Qwen `max_window_layers`, `layer_types`). The planner then plans every layer
    /// as full causal attention (`sliding_window` is `None`: an upper bound on the attention
    /// FLOPs and the ring bytes) and says so in its notes.
    pub partial_window: Option<(usize, usize)>,
    /// Gemma 2 and 3 (`model_type` `gemma2`, `gemma3_text`): two more norms per layer, after
    /// the attention and after the MLP (`2h` parameters; what the layer keeps:
    /// [`crate::memory::candle_cp_extra_per_gpu`]); Gemma 3's head norms are
    /// [`ModelConfig::qk_norm`], the windows [`ModelConfig::partial_window`]. (GELU or SiLU,
    /// Gemma 2's logit soft caps: the same parameters and activations.)
    pub sandwich_norms: bool,
    /// Mixtures of experts (Qwen3-MoE, `model_type` `qwen3_moe`): the sparse layers' MLPs;
    /// `None`: every MLP dense.
    pub moe: Option<MoeShape>,
    /// Phi-3 (`model_type` `phi3`): q, k, v fused into `qkv_proj` and gate, up into
    /// `gate_up_proj`. The same weights; a LoRA adapter on a fused module has one `A` for its
    /// parts ([`crate::memory::layer_lora_params_per_gpu`]).
    pub fused_proj: bool,
    /// gpt-oss (`model_type` `gpt_oss`): per layer an o_proj bias `[h]` and a sink per head
    /// `[a]` (besides [`ModelConfig::qkv_bias`]); its mixture of experts' router and experts
    /// carry biases (`E` and `E·(2·f_e + h)` per sparse layer).
    pub gpt_oss: bool,
    /// OLMo 2 and 3 (`model_type` `olmo2`, `olmo3`) and EXAONE 4 (`exaone4`): the norms after
    /// the attention and the MLP ([`ModelConfig::sandwich_norms`]) and none before them; what
    /// the layer keeps:
    /// [`crate::memory::candle_cp_extra_per_gpu`].
    pub post_norms: bool,
    /// OLMo 2, 3 and OLMoE (`olmoe`): q and k RMSNorms over the whole projection (weights
    /// `[a·d]`, `[a_kv·d]`, split as the projections' rows) instead of per head.
    pub qk_norm_flat: bool,
    /// DeepSeek-V3's multi-head latent attention (`model_type` `deepseek_v3`) instead of q, k,
    /// v, o projections; [`ModelConfig::head_dim`] is then the width the attention runs at on
    /// a GPU, [`MlaShape::cuda_attn_dim`] (candle-cp pads the narrower of `nope + rope` and `v`
    /// with zeros, then up to a width its CUDA kernels take: DeepSeek-V3's 192 at 256), with as
    /// many KV heads as heads.
    pub mla: Option<MlaShape>,
    /// A reward model's score head in place of the output projection (transformers'
    /// `*ForSequenceClassification`, or `*ForTokenClassification` with a bias: a process
    /// reward model): `labels·h` parameters replicated over TP (and `labels` more with the
    /// bias), `labels` scores per token instead of the vocabulary's logits. `None`: a causal LM.
    pub score_head: Option<ScoreHead>,
}

/// A reward model's score head ([`ModelConfig::score_head`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ScoreHead {
    /// Its labels `n` (the rows of `score.weight`).
    pub labels: usize,
    /// A bias `score.bias` `[n]` (a token classifier's).
    pub bias: bool,
}

impl ScoreHead {
    /// Its parameters: `n·h`, and `n` with the bias.
    pub fn params(&self, hidden: usize) -> u64 {
        (self.labels * hidden + if self.bias { self.labels } else { 0 }) as u64
    }
}

/// The head dims candle-cp's CUDA attention kernels take (`candle_cp_kernels::flash`'s
/// `HEAD_DIMS` and `PARTIAL_HEAD_DIMS`; the planner does not depend on the kernel crate).
pub const CUDA_HEAD_DIMS: [usize; 6] = [16, 32, 64, 96, 128, 256];

/// The smallest of [`CUDA_HEAD_DIMS`] at least `d` (`d` itself above 256).
pub fn cuda_head_dim(d: usize) -> usize {
    CUDA_HEAD_DIMS.iter().copied().find(|&w| w >= d).unwrap_or(d)
}

/// DeepSeek's multi-head latent attention ([`ModelConfig::mla`]): replicated down-projections
/// `q_a_proj` `[rq, h]` (none with `q_lora_rank` null), `kv_a_proj_with_mqa` `[rkv + rope, h]`
/// and their norms; up-projections `q_b_proj` `[a·(nope + rope), rq]` (or `q_proj` from `h`),
/// `kv_b_proj` `[a·(nope + v), rkv]` and `o_proj` `[h, a·v]` split over TP by heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MlaShape {
    /// Rank of the compressed query (`None`: one `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// Rank of the compressed key and value.
    pub kv_lora_rank: usize,
    /// Each q, k head's dimensions without RoPE.
    pub qk_nope_head_dim: usize,
    /// Each q, k head's rotated dimensions (the key's shared by the heads).
    pub qk_rope_head_dim: usize,
    /// Each value head's dimensions.
    pub v_head_dim: usize,
    /// The rotated dimensions arrive interleaved (`rope_interleave`, the default): reordered
    /// once more on the key's shared part (one more `[c, rope]` the layer keeps).
    pub rope_interleave: bool,
}

impl MlaShape {
    /// DeepSeek-V3's: rq 1536, rkv 512, nope 128, rope 64, v 128.
    pub const DEEPSEEK_V3: MlaShape = MlaShape { q_lora_rank: Some(1536), kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64, v_head_dim: 128, rope_interleave: true };

    /// The width the attention runs at on the CPU, `max(nope + rope, v)` (the narrower side
    /// padded with zeros).
    pub fn attn_dim(&self) -> usize {
        (self.qk_nope_head_dim + self.qk_rope_head_dim).max(self.v_head_dim)
    }

    /// The width the attention runs at on a GPU, what the planner plans with
    /// ([`ModelConfig::head_dim`]): [`MlaShape::attn_dim`] rounded up to the next head dim
    /// candle-cp's CUDA kernels take ([`CUDA_HEAD_DIMS`]; DeepSeek's 192 runs at 256, as
    /// `candle_cp_ops::attention::kernel_head_dim` pads it), itself above 256.
    pub fn cuda_attn_dim(&self) -> usize {
        cuda_head_dim(self.attn_dim())
    }

    /// The replicated matrices of one layer: `h·rq + h·(rkv + rope)`.
    pub fn down_params(&self, h: usize) -> u64 {
        (h * self.q_lora_rank.unwrap_or(0) + h * (self.kv_lora_rank + self.qk_rope_head_dim)) as u64
    }

    /// The matrices split over TP by heads, of one layer with `a` heads: the query's
    /// up-projection `(rq or h)·a·(nope + rope)`, `rkv·a·(nope + v)` and o_proj's `a·v·h`.
    pub fn up_params(&self, h: usize, a: usize) -> u64 {
        let q_in = self.q_lora_rank.unwrap_or(h);
        (q_in * a * (self.qk_nope_head_dim + self.qk_rope_head_dim) + self.kv_lora_rank * a * (self.qk_nope_head_dim + self.v_head_dim) + a * self.v_head_dim * h) as u64
    }

    /// The latents' norm weights of one layer: `rq + rkv`.
    pub fn norm_params(&self) -> u64 {
        (self.q_lora_rank.unwrap_or(0) + self.kv_lora_rank) as u64
    }
}

/// The mixture-of-experts MLPs of a model ([`ModelConfig::moe`]): on each of
/// `sparse_layers` layers a router `[E, h]` and `E` SwiGLU experts of width `expert_ffn`, `K`
/// of them per token; the other layers' MLPs are dense ([`ModelConfig::ffn`] wide). Each TP
/// rank holds every expert's `1/t` slice; the planner counts a layer as the average over the
/// layers (`sparse_layers / L` of each sparse layer's terms).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MoeShape {
    /// Experts per sparse layer `E`.
    pub experts: usize,
    /// Experts per token `K`.
    pub top_k: usize,
    /// Each expert's MLP width `f_e`.
    pub expert_ffn: usize,
    /// Layers whose MLP is a mixture of experts.
    pub sparse_layers: usize,
    /// The top `K` probabilities renormalised to sum 1 (`norm_topk_prob`).
    pub norm_topk: bool,
    /// Qwen2-MoE's shared expert's width `f_s` (`shared_expert_intermediate_size`; 0: none): a
    /// SwiGLU every token goes through, weighted by a sigmoid gate `[1, h]`; GLM-4.5's
    /// `n_shared_experts · moe_intermediate_size`, ungated).
    pub shared_ffn: usize,
    /// GLM-4.5's and the DeepSeek routers: logits in f32, the chosen weights scaled
    /// (`routed_scaling_factor`), the shared experts without a gate (GLM-4.5's and DeepSeek-V3's
    /// scores by sigmoid, DeepSeek-V2's by softmax: the same bytes).
    pub sigmoid_router: bool,
    /// A correction bias `[E]` per sparse layer choosing the experts (GLM-4.5's and
    /// DeepSeek-V3's `e_score_correction_bias`; not DeepSeek-V2's).
    pub correction_bias: bool,
}

/// Names accepted by [`ModelConfig::preset`].
pub const MODEL_PRESETS: [&str; 37] = [
    "llama3-8b", "llama3-70b", "llama3-405b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-8b", "qwen3-32b", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b",
    "gemma2-2b", "gemma2-9b", "gemma2-27b", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "phi3-mini", "phi3-medium",
    "phi4-mini", "phi4", "gpt-oss-20b", "gpt-oss-120b", "smollm3-3b", "mistral-small-24b", "olmo2-7b", "olmo3-7b", "olmo3-32b", "olmoe-1b-7b",
    "exaone4-32b", "granite3-1b-a400m", "granite3-3b-a800m", "glm4-9b", "glm4.5-air", "glm4.5", "deepseek-v3", "kimi-k2",
];

impl ModelConfig {
    /// A built-in shape: Llama 3 (3.1) `llama3-8b`, `llama3-70b` or `llama3-405b`
    /// (vocabulary 128256), Qwen2.5 `qwen2.5-7b` or `qwen2.5-72b` (vocabulary 152064, q, k, v
    /// biases; the 7B has 28 query and 4 KV heads), or Qwen3 `qwen3-8b` or `qwen3-32b`
    /// (vocabulary 151936, q / k head norms, head dim 128: the 32B's 64 heads are 8192 wide
    /// on a 5120-wide model), or Gemma 3's text models `gemma3-1b`, `gemma3-4b`, `gemma3-12b`
    /// or `gemma3-27b` as published (head dim 256, 128 for the 27B; vocabulary 262208, 262144
    /// for the 1B; tied head; head norms and the two norms after attention and MLP; a window of
    /// 1024 keys, 512 for the 1B, on five layers of six: [`ModelConfig::partial_window`]), or
    /// Gemma 2's `gemma2-2b`, `gemma2-9b` or `gemma2-27b` (head dim 256, 128 for the 27B;
    /// vocabulary 256000; tied head; the two norms after attention and MLP; a window of 4096
    /// keys on every other layer), or Qwen3-MoE's `qwen3-30b-a3b` or `qwen3-235b-a22b` (as
    /// Qwen3, every layer a mixture of 128 experts, 8 per token, 768 / 1536 wide:
    /// [`ModelConfig::moe`]), or Mixtral's `mixtral-8x7b` (a Mistral 7B whose every MLP is 8
    /// experts 14336 wide, 2 per token; vocabulary 32000), or Phi-3's 128k-context
    /// `phi3-mini` or `phi3-medium` (vocabulary 32064; head dim 96 for the mini, whose 32 KV
    /// heads are all its heads; 10 KV heads of 128 for the medium), or Phi-4's `phi4-mini`
    /// (`Phi3ForCausalLM` too: vocabulary 200064, tied head, 24 heads of 128 over 8 KV heads;
    /// its partial RoPE changes no count) or `phi4` (Phi-4 14B: Phi-3-medium's shape,
    /// vocabulary 100352; its 10 KV heads fit TP 4 or 8 by copies, see
    /// [`crate::Layout::kv_heads_per_tp_rank`]), or gpt-oss's `gpt-oss-20b` or `gpt-oss-120b`
    /// (2880 wide, 64 heads of 64 over 8 KV heads, vocabulary 201088; every layer a mixture of
    /// 32 / 128 experts 2880 wide, 4 per token; a window of 128 keys on every other layer;
    /// [`ModelConfig::gpt_oss`]'s sinks and biases), or `smollm3-3b` (SmolLM3-3B: 36 layers
    /// 2048 wide, 16 heads of 128 over 4 KV heads, vocabulary 128256, tied head), or
    /// `mistral-small-24b` (Mistral Small 3.1 / 3.2's text model: 40 layers 5120 wide, 32 heads
    /// of 128 over 8 KV heads, MLP 32768, vocabulary 131072), or OLMo's `olmo2-7b` (32 layers
    /// 4096 wide, 32 heads of 128 and as many KV heads, MLP 11008, vocabulary 100352),
    /// `olmo3-7b` (its shape, vocabulary 100278, a window of 4096 keys on three layers of
    /// four) or `olmo3-32b` (64 layers 5120 wide, 40 heads of 128 over 8 KV heads, MLP
    /// 27648, vocabulary 100278, the window as the 7B's) — [`ModelConfig::post_norms`] — or
    /// `olmoe-1b-7b` (OLMoE-1B-7B: 16 layers 2048 wide, 16 heads of 128, every layer 64
    /// experts 1024 wide, 8 per token, vocabulary 50304; [`ModelConfig::qk_norm_flat`]), or
    /// `exaone4-32b` (EXAONE 4.0 32B: 64 layers 5120 wide, 40 heads of 128 over 8 KV heads,
    /// MLP 27392, vocabulary 102400, untied; OLMo 2's norms after the branches with per-head q
    /// / k norms, a window of 4096 keys on three layers of four; its NoPE global layers change
    /// no count), or GraniteMoE's `granite3-1b-a400m` (24 layers 1024 wide, 16 heads of 64 over
    /// 8 KV heads, every layer 32 experts 512 wide, 8 per token) or `granite3-3b-a800m` (32
    /// layers 1536 wide, 24 heads of 64 over 8 KV heads, 40 experts 512 wide, 8 per token; both
    /// vocabulary 49155, tied head; Granite's multipliers change no count), or `glm4-9b`
    /// (GLM-4-9B-0414: 40 layers 4096 wide, 32 heads of 128 over 2 KV heads, MLP 13696, q, k,
    /// v biases, norms before and after each branch, vocabulary 151552, untied; its partial,
    /// interleaved RoPE changes no count).
    pub fn preset(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        // Gemma 3: the published configs (google/gemma-3-{1b-pt, 4b-it, 12b-it, 27b-it} with
        // `Gemma3TextConfig`'s defaults)
        let (hidden, layers, heads, kv_heads, ffn) = match lower.as_str() {
            "llama3-8b" => (4096, 32, 32, 8, 14336),
            "llama3-70b" => (8192, 80, 64, 8, 28672),
            "llama3-405b" => (16384, 126, 128, 8, 53248),
            "qwen2.5-7b" => (3584, 28, 28, 4, 18944),
            "qwen2.5-72b" => (8192, 80, 64, 8, 29568),
            "qwen3-8b" => (4096, 36, 32, 8, 12288),
            "qwen3-32b" => (5120, 64, 64, 8, 25600),
            "gemma3-1b" => (1152, 26, 4, 1, 6912),
            "gemma3-4b" => (2560, 34, 8, 4, 10240),
            "gemma3-12b" => (3840, 48, 16, 8, 15360),
            "gemma3-27b" => (5376, 62, 32, 16, 21504),
            // google/gemma-2-{2b, 9b, 27b}
            "gemma2-2b" => (2304, 26, 8, 4, 9216),
            "gemma2-9b" => (3584, 42, 16, 8, 14336),
            "gemma2-27b" => (4608, 46, 32, 16, 36864),
            // Qwen/Qwen3-{30B-A3B, 235B-A22B} (intermediate_size of their configs; no layer
            // is dense)
            "qwen3-30b-a3b" => (2048, 48, 32, 4, 6144),
            "qwen3-235b-a22b" => (4096, 94, 64, 4, 12288),
            // mistralai/Mixtral-8x7B-v0.1
            "mixtral-8x7b" => (4096, 32, 32, 8, 14336),
            // microsoft/Phi-3-{mini, medium}-128k-instruct
            "phi3-mini" => (3072, 32, 32, 32, 8192),
            "phi3-medium" => (5120, 40, 40, 10, 17920),
            // microsoft/Phi-4-mini-instruct, microsoft/phi-4 (16k context; Phi-3-medium's shape)
            "phi4-mini" => (3072, 32, 24, 8, 8192),
            "phi4" => (5120, 40, 40, 10, 17920),
            // openai/gpt-oss-{20b, 120b}
            "gpt-oss-20b" => (2880, 24, 64, 8, 2880),
            "gpt-oss-120b" => (2880, 36, 64, 8, 2880),
            // HuggingFaceTB/SmolLM3-3B (its NoPE layers change no count)
            "smollm3-3b" => (2048, 36, 16, 4, 11008),
            // mistralai/Mistral-Small-3.1-24B-Instruct-2503's text model (head dim 128)
            "mistral-small-24b" => (5120, 40, 32, 8, 32768),
            // allenai/OLMo-2-1124-7B, allenai/Olmo-3-1025-7B, allenai/Olmo-3-1125-32B
            "olmo2-7b" | "olmo3-7b" => (4096, 32, 32, 32, 11008),
            "olmo3-32b" => (5120, 64, 40, 8, 27648),
            // allenai/OLMoE-1B-7B-0924 (intermediate_size: each expert's width)
            "olmoe-1b-7b" => (2048, 16, 16, 16, 1024),
            // LGAI-EXAONE/EXAONE-4.0-32B
            "exaone4-32b" => (5120, 64, 40, 8, 27392),
            // ibm-granite/granite-3.1-{1b-a400m, 3b-a800m} (intermediate_size: each expert's
            // width)
            "granite3-1b-a400m" => (1024, 24, 16, 8, 512),
            "granite3-3b-a800m" => (1536, 32, 24, 8, 512),
            // THUDM/GLM-4-9B-0414
            "glm4-9b" => (4096, 40, 32, 2, 13696),
            // zai-org/GLM-4.5-Air, zai-org/GLM-4.5 (intermediate_size: the dense first layers')
            "glm4.5-air" => (4096, 46, 96, 8, 10944),
            "glm4.5" => (5120, 92, 96, 8, 12288),
            // deepseek-ai/DeepSeek-V3 (V3.1, R1: the same shape; intermediate_size: the dense
            // first layers'; its KV heads: the latent attention's 128)
            "deepseek-v3" => (7168, 61, 128, 128, 18432),
            // moonshotai/Kimi-K2-Instruct (K2-Base, K2-Thinking: the same shape; DeepSeek-V3's
            // with 64 heads, 384 experts and one dense layer)
            "kimi-k2" => (7168, 61, 64, 64, 18432),
            _ => plan_bail!(
                "unknown model preset '{name}' (known: {}; or pass the path of a Hugging Face config.json)",
                MODEL_PRESETS.join(", ")
            ),
        };
        let (qwen2, qwen3, gemma3) = (lower.starts_with("qwen2"), lower.starts_with("qwen3"), lower.starts_with("gemma3"));
        let gemma2 = lower.starts_with("gemma2");
        let one_b = lower == "gemma3-1b";
        let phi = lower.starts_with("phi3") || lower.starts_with("phi4");
        let gpt_oss = lower.starts_with("gpt-oss");
        let (olmoe, olmo3) = (lower.starts_with("olmoe"), lower.starts_with("olmo3"));
        let olmo = lower.starts_with("olmo") && !olmoe;
        let exaone4 = lower.starts_with("exaone4");
        let granite_moe = lower.starts_with("granite3-");
        let (glm4, glm45) = (lower == "glm4-9b", lower.starts_with("glm4.5"));
        let (kimi, deepseek) = (lower == "kimi-k2", lower == "deepseek-v3" || lower == "kimi-k2");
        let cfg = Self {
            name: lower.clone(),
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim: match () {
                _ if qwen3 || lower == "gemma3-27b" || lower == "gemma2-27b" || lower == "mistral-small-24b" || olmo || olmoe || exaone4 || glm4 || glm45 => 128,
                _ if gpt_oss => 64,
                _ if gemma3 || gemma2 => 256,
                _ if deepseek => MlaShape::DEEPSEEK_V3.cuda_attn_dim(),
                _ => hidden / heads,
            },
            ffn,
            vocab: match () {
                _ if qwen2 => 152064,
                _ if qwen3 => 151936,
                _ if one_b => 262_144,
                _ if gemma3 => 262_208,
                _ if gemma2 => 256_000,
                _ if lower == "mixtral-8x7b" => 32000,
                _ if lower == "mistral-small-24b" => 131_072,
                _ if lower.starts_with("phi3") => 32064,
                _ if lower == "phi4" => 100_352,
                _ if lower.starts_with("phi4") => 200_064,
                _ if gpt_oss => 201_088,
                _ if olmo3 => 100_278,
                _ if olmo => 100_352,
                _ if olmoe => 50_304,
                _ if exaone4 => 102_400,
                _ if granite_moe => 49_155,
                _ if glm4 || glm45 => 151_552,
                _ if kimi => 163_840,
                _ if deepseek => 129_280,
                _ => 128256,
            },
            tie_embeddings: gemma3 || gemma2 || lower == "phi4-mini" || lower == "smollm3-3b" || granite_moe,
            sliding_window: None,
            qkv_bias: qwen2 || gpt_oss || glm4 || glm45,
            // (GLM-4.5's head norms; the Air has none)
            qk_norm: qwen3 || gemma3 || exaone4 || lower == "glm4.5",
            // a window of 1024 keys (512 for the 1B) on all but every sixth layer
            partial_window: match () {
                _ if gemma3 => Some((if one_b { 512 } else { 1024 }, layers - layers / 6)),
                // 4096 keys on layers 0, 2, 4, ...
                _ if gemma2 => Some((4096, layers.div_ceil(2))),
                // 128 keys on layers 0, 2, 4, ...
                _ if gpt_oss => Some((128, layers.div_ceil(2))),
                // 4096 keys on all but every fourth layer
                _ if olmo3 || exaone4 => Some((4096, layers - layers / 4)),
                _ => None,
            },
            sandwich_norms: gemma3 || gemma2 || olmo || exaone4 || glm4,
            fused_proj: phi,
            gpt_oss,
            post_norms: olmo || exaone4,
            qk_norm_flat: olmo || olmoe,
            mla: deepseek.then_some(MlaShape::DEEPSEEK_V3),
            score_head: None,
            moe: match lower.as_str() {
                "qwen3-30b-a3b" => Some(MoeShape { experts: 128, top_k: 8, expert_ffn: 768, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false }),
                "qwen3-235b-a22b" => Some(MoeShape { experts: 128, top_k: 8, expert_ffn: 1536, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false }),
                "mixtral-8x7b" => Some(MoeShape { experts: 8, top_k: 2, expert_ffn: ffn, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false }),
                "gpt-oss-20b" => Some(MoeShape { experts: 32, top_k: 4, expert_ffn: ffn, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false }),
                "gpt-oss-120b" => Some(MoeShape { experts: 128, top_k: 4, expert_ffn: ffn, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false }),
                "olmoe-1b-7b" => Some(MoeShape { experts: 64, top_k: 8, expert_ffn: ffn, sparse_layers: layers, norm_topk: false, shared_ffn: 0, sigmoid_router: false, correction_bias: false }),
                "granite3-1b-a400m" => Some(MoeShape { experts: 32, top_k: 8, expert_ffn: ffn, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false }),
                "granite3-3b-a800m" => Some(MoeShape { experts: 40, top_k: 8, expert_ffn: ffn, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false }),
                // (the first layer dense, the 4.5's first three; one shared expert as wide)
                "glm4.5-air" => Some(MoeShape { experts: 128, top_k: 8, expert_ffn: 1408, sparse_layers: layers - 1, norm_topk: true, shared_ffn: 1408, sigmoid_router: true, correction_bias: true }),
                "glm4.5" => Some(MoeShape { experts: 160, top_k: 8, expert_ffn: 1536, sparse_layers: layers - 3, norm_topk: true, shared_ffn: 1536, sigmoid_router: true, correction_bias: true }),
                // (GLM-4.5's router; the first three layers dense, one shared expert)
                "deepseek-v3" => Some(MoeShape { experts: 256, top_k: 8, expert_ffn: 2048, sparse_layers: layers - 3, norm_topk: true, shared_ffn: 2048, sigmoid_router: true, correction_bias: true }),
                // (the first layer dense)
                "kimi-k2" => Some(MoeShape { experts: 384, top_k: 8, expert_ffn: 2048, sparse_layers: layers - 1, norm_topk: true, shared_ffn: 2048, sigmoid_router: true, correction_bias: true }),
                _ => None,
            },
        };
        Ok(cfg)
    }

    /// A preset name, or else a path to a Hugging Face `config.json`.
    pub fn from_name_or_path(s: &str) -> Result<Self> {
        if MODEL_PRESETS.contains(&s.to_ascii_lowercase().as_str()) {
            return Self::preset(s);
        }
        let p = std::path::Path::new(s);
        if p.exists() || s.contains('/') || s.ends_with(".json") {
            return Self::from_hf_file(p);
        }
        Self::preset(s)
    }

    /// Checks the internal consistency of the shape (KV heads divide query heads; a sliding
    /// window, if any, is at least 1).
    pub fn validate(&self) -> Result<()> {
        if self.sliding_window == Some(0) {
            plan_bail!(
                "model {}: sliding window must be at least 1 token, got 0",
                self.name
            )
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            plan_bail!(
                "model {}: num_key_value_heads {} must divide num_attention_heads {}",
                self.name,
                self.kv_heads,
                self.heads
            )
        }
        Ok(())
    }

    /// The share of the attention's FLOPs (at [`ModelConfig::head_dim`], what the kernels
    /// compute) that the model asks for: 1, but for a latent attention, whose `QKᵀ` is
    /// `nope + rope` wide and `PV` `v` wide where the kernels run both at the padded width,
    /// `(nope + rope + v) / (2·d)` (DeepSeek-V3 on a GPU: 320 / 512). Model FLOPs (MFU) count
    /// this share; the step's time counts them all.
    pub fn attn_model_fraction(&self) -> f64 {
        match &self.mla {
            Some(a) if self.head_dim > 0 => (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) as f64 / (2 * self.head_dim) as f64,
            _ => 1.0,
        }
    }

    /// Query width `a·d` (equals `h` for Llama).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Key (or value) width `a_kv·d`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The sparse layers' share of the layers, `sparse_layers / L` (0 without experts).
    pub fn sparse_fraction(&self) -> f64 {
        match &self.moe {
            Some(m) if self.layers > 0 => m.sparse_layers as f64 / self.layers as f64,
            _ => 0.0,
        }
    }

    /// Parameters of a sparse layer's MLP beyond a dense one's: the router `E·h` and the
    /// experts `3·h·f_e·E`, less the dense `3·h·f` (0 without experts).
    fn sparse_mlp_extra(&self) -> f64 {
        let Some(m) = &self.moe else { return 0.0 };
        let h = self.hidden as f64;
        (m.experts as f64) * h + 3.0 * h * (m.expert_ffn * m.experts) as f64 - 3.0 * h * self.ffn as f64 + Self::shared_params(m, h) + self.moe_bias_params()
    }

    /// gpt-oss's biases of a sparse layer: the router's `E` and the experts' `E·(2·f_e + h)`
    /// (0 otherwise).
    pub fn moe_bias_params(&self) -> f64 {
        match &self.moe {
            Some(m) if self.gpt_oss => (m.experts * (1 + 2 * m.expert_ffn + self.hidden)) as f64,
            _ => 0.0,
        }
    }

    /// gpt-oss's o_proj bias and sinks of one layer: `h + a` (0 otherwise).
    pub fn sink_and_o_bias_params(&self) -> u64 {
        if self.gpt_oss {
            (self.hidden + self.heads) as u64
        } else {
            0
        }
    }

    /// The shared expert and its gate, `3·h·f_s + h` (0 without one); GLM-4.5's: `3·h·f_s` and
    /// the router's correction bias `E` (DeepSeek-V2: no bias).
    fn shared_params(m: &MoeShape, h: f64) -> f64 {
        let bias = if m.correction_bias { m.experts as f64 } else { 0.0 };
        match (m.shared_ffn, m.sigmoid_router) {
            (0, false) => 0.0,
            (_, true) => 3.0 * h * m.shared_ffn as f64 + bias,
            (_, false) => 3.0 * h * m.shared_ffn as f64 + h,
        }
    }

    /// The matrix parameters one token goes through in a layer, averaged over the layers
    /// (what the linear FLOPs count): [`ModelConfig::layer_matrix_params`], a sparse layer's
    /// MLP counting the router and the `K` experts a token uses (`E·h + 3·h·f_e·K`).
    pub fn layer_active_matrix_params(&self) -> f64 {
        let dense = self.layer_matrix_params() as f64;
        let Some(m) = &self.moe else { return dense };
        let h = self.hidden as f64;
        let sparse = m.experts as f64 * h + 3.0 * h * (m.expert_ffn * m.top_k) as f64 - 3.0 * h * self.ffn as f64 + Self::shared_params(m, h);
        dense + self.sparse_fraction() * sparse
    }

    /// Parameters a token goes through (embedding and head once): the "active" parameters of
    /// a mixture of experts; [`ModelConfig::total_params`] for a dense model.
    pub fn active_params(&self) -> u64 {
        let extra = self.layers as f64 * (self.layer_active_matrix_params() - self.layer_matrix_params() as f64);
        (self.total_params() as f64 - self.layers as f64 * self.sparse_fraction() * self.sparse_mlp_extra() + extra).round() as u64
    }

    /// Parameters in one layer's matrices: `h·a·d` (Q) + `2·h·a_kv·d` (K, V) + `a·d·h` (O)
    /// + `3·h·f` (gate, up, down).
    pub fn layer_matrix_params(&self) -> u64 {
        let h = self.hidden as u64;
        let q = self.q_dim() as u64;
        let kv = self.kv_dim() as u64;
        let f = self.ffn as u64;
        // (DeepSeek-V3: the latent attention's down- and up-projections and o_proj)
        let attn = match &self.mla {
            Some(a) => a.down_params(self.hidden) + a.up_params(self.hidden, self.heads),
            None => h * q + 2 * h * kv + q * h,
        };
        attn + 3 * h * f
    }

    /// Parameters in one layer: matrices plus the two RMSNorm weights (`2·h`), with
    /// [`ModelConfig::qkv_bias`] the q, k, v biases (`a·d + 2·a_kv·d`) and with
    /// [`ModelConfig::qk_norm`] the head norms (`2·d`).
    pub fn layer_params(&self) -> u64 {
        self.layer_matrix_params() + self.layer_norm_params() + self.qkv_bias_params() + self.qk_norm_params() + self.sink_and_o_bias_params()
    }

    /// The norm weights of one layer: `2h` (before the attention and the MLP; OLMo's after
    /// them), Gemma's `4h` (before and after each).
    pub fn layer_norm_params(&self) -> u64 {
        // (DeepSeek-V3: the latents' norms too)
        (if self.sandwich_norms && !self.post_norms { 4 } else { 2 }) * self.hidden as u64 + self.mla.map_or(0, |a| a.norm_params())
    }

    /// The q and k norm weights of one layer: Qwen3's head norms `2·d`, OLMo's whole-projection
    /// ones `a·d + a_kv·d`, or 0 without them.
    pub fn qk_norm_params(&self) -> u64 {
        match (self.qk_norm, self.qk_norm_flat) {
            (true, _) => 2 * self.head_dim as u64,
            (false, true) => (self.q_dim() + self.kv_dim()) as u64,
            (false, false) => 0,
        }
    }

    /// The q, k, v biases of one layer: `a·d + 2·a_kv·d`, or 0 without them.
    pub fn qkv_bias_params(&self) -> u64 {
        if self.qkv_bias {
            (self.q_dim() + 2 * self.kv_dim()) as u64
        } else {
            0
        }
    }

    /// Embedding parameters `v·h` (and as many again for an untied output projection).
    pub fn embedding_params(&self) -> u64 {
        (self.vocab * self.hidden) as u64
    }

    /// The output projection's parameters: `v·h` untied, 0 tied, a reward model's score head's
    /// ([`ModelConfig::score_head`]).
    pub fn output_params(&self) -> u64 {
        match (&self.score_head, self.tie_embeddings) {
            (Some(s), _) => s.params(self.hidden),
            (None, true) => 0,
            (None, false) => self.embedding_params(),
        }
    }

    /// The output's columns per token: the vocabulary, or a score head's labels.
    pub fn output_width(&self) -> usize {
        self.score_head.map_or(self.vocab, |s| s.labels)
    }

    /// All parameters: `L·layer + v·h + output + h` (final norm; [`ModelConfig::output_params`]).
    pub fn total_params(&self) -> u64 {
        let out = self.output_params();
        let sparse = match &self.moe {
            Some(m) => (m.sparse_layers as f64 * self.sparse_mlp_extra()) as i64,
            None => 0,
        };
        (self.layers as u64 * self.layer_params() + self.embedding_params() + out + self.hidden as u64).saturating_add_signed(sparse)
    }

    /// [`ModelConfig::layer_params`] averaged over the layers (a sparse layer's MLP holds the
    /// router and every expert).
    pub fn mean_layer_params(&self) -> f64 {
        self.layer_params() as f64 + self.sparse_fraction() * self.sparse_mlp_extra()
    }
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
