//! [`LlamaConfig`]: the Hugging Face `config.json` of a Llama-style model.
//!
//! Both RoPE spellings are read: the legacy top-level `rope_theta` + `rope_scaling`, and the
//! newer `rope_parameters` object (`rope_type`, `rope_theta`, scaling keys). Written back in
//! both forms so old and new transformers versions load it. Scalings: `linear`, `llama3`,
//! `yarn` (as current transformers computes it: `factor` as configured; some 4.x releases
//! replaced it by `max_position_embeddings / original_max_position_embeddings` when the
//! config names the original length); others are refused by name.

pub use crate::arch::Arch;
#[path = "gemma.rs"]
pub mod gemma;
pub use gemma::Gemma3;
#[path = "gemma2.rs"]
pub mod gemma2;
pub use gemma2::Gemma2;
#[path = "qwen3_moe.rs"]
pub mod qwen3_moe;
#[path = "phi3.rs"]
pub mod phi3;
#[path = "gpt_oss.rs"]
pub mod gpt_oss;
#[path = "smollm3.rs"]
pub mod smollm3;
#[path = "granite.rs"]
pub mod granite;
#[path = "granite_moe.rs"]
pub mod granite_moe;
#[path = "glm4.rs"]
pub mod glm4;
#[path = "glm4_moe.rs"]
pub mod glm4_moe;
#[path = "deepseek.rs"]
pub mod deepseek;
#[path = "multimodal.rs"]
pub mod multimodal;
pub use granite::Granite;
#[path = "olmo.rs"]
pub mod olmo;
#[path = "exaone4.rs"]
pub mod exaone4;
pub use olmo::Olmo;
pub use glm4::Glm;
#[path = "rope_scaling.rs"]
mod rope_scaling;
#[path = "config_json.rs"]
mod to_json;
#[path = "config_validate.rs"]
mod validate;
pub use rope_scaling::RopeScaling;
use rope_scaling::{parse_scaling, rope_by_layer_type};
pub use qwen3_moe::{MoeConfig, MoeStyle};
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};
use std::path::Path;

/// Architecture hyper-parameters of a Llama-style decoder (`LlamaForCausalLM`).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size `V` (rows of the embedding and of `lm_head`).
    pub vocab_size: usize,
    /// Model width `h`.
    pub hidden_size: usize,
    /// MLP width (gate/up output, down input).
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads `H`.
    pub num_attention_heads: usize,
    /// Key/value heads `Hkv` (GQA; `H % Hkv == 0`).
    pub num_key_value_heads: usize,
    /// Per-head width `D` (`hidden_size / H` when absent from config.json).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Share of each head that RoPE rotates (`partial_rotary_factor`; Phi-4-mini: 0.75): the
    /// first [`LlamaConfig::rope_dim`] dimensions, in the `rotate_half` form over those alone,
    /// the rest pass through unrotated; 1 (every other architecture): the whole head.
    pub partial_rotary_factor: f64,
    /// `lm_head` shares the embedding matrix (no `lm_head.weight` tensor).
    pub tie_word_embeddings: bool,
    /// Longest position the checkpoint was configured for (kept for config.json round trips).
    pub max_position_embeddings: usize,
    /// Optional special token id(s) as written in config.json (a number or, e.g. for
    /// Llama 3, a list), kept for round trips.
    pub bos_token_id: Option<Value>,
    /// See `bos_token_id`.
    pub eos_token_id: Option<Value>,
    /// Causal sliding-window attention (Mistral `sliding_window`): a query at position `p`
    /// sees the keys at `p - w < kp <= p` (itself and the `w - 1` before; inside its document
    /// when packed). `None` (absent or `null` in config.json): plain causal attention.
    /// Which layers use it: [`LlamaConfig::sliding_layers`].
    pub sliding_window: Option<usize>,
    /// The layers that use [`LlamaConfig::sliding_window`] when only some do (one entry per
    /// layer, `true`: sliding; HF `layer_types`, or Qwen2 / Qwen3 `max_window_layers`); `None`:
    /// every layer. Only Qwen2, Qwen3 and Gemma 3 configs carry per-layer windows
    /// ([`LlamaConfig::validate`]). See [`LlamaConfig::layer_window`].
    pub sliding_layers: Option<Vec<bool>>,
    /// Biases on the q, k and v projections (`self_attn.{q,k,v}_proj.bias`): Qwen2
    /// (`model_type` `qwen2`). See [`crate::arch`] for the architectures a config may name.
    pub qkv_bias: bool,
    /// RMSNorms over each q and k head (`self_attn.{q,k}_norm.weight`, `[head_dim]`) between
    /// the projection and RoPE: Qwen3 (`model_type` `qwen3`), Gemma 3.
    pub qk_norm: bool,
    /// Gemma 3 (`model_type` `gemma3_text`): its numbers, and everything the architecture
    /// changes besides ([`gemma`]); `None` for the other architectures.
    pub gemma3: Option<Gemma3>,
    /// Gemma 2 (`model_type` `gemma2`): its numbers (the scale, the logit soft caps), and
    /// everything the architecture changes besides ([`gemma2`]); `None` for the others.
    pub gemma2: Option<Gemma2>,
    /// Qwen3-MoE (`model_type` `qwen3_moe`): the mixture-of-experts MLPs ([`qwen3_moe`]);
    /// `None`: every MLP is dense.
    pub moe: Option<MoeConfig>,
    /// Phi-3 (`model_type` `phi3`): a Llama whose checkpoints fuse `qkv_proj` and
    /// `gate_up_proj` ([`phi3`]: split on load, fused on save).
    pub phi3: bool,
    /// gpt-oss (`model_type` `gpt_oss`): attention sinks and an o_proj bias in every layer,
    /// and its mixture of experts ([`MoeStyle::GptOss`]); see [`gpt_oss`].
    pub gpt_oss: bool,
    /// SmolLM3 (`model_type` `smollm3`): the layers that attend without RoPE (NoPE; one entry per
    /// layer, `true`: no rotation), see [`smollm3`]; `None` for the other architectures (every
    /// layer rotates). [`LlamaConfig::layer_rotates`].
    pub nope_layers: Option<Vec<bool>>,
    /// Granite (`model_type` `granite`): its embedding, attention, residual and logit
    /// multipliers ([`granite`]); `None` for the other architectures.
    pub granite: Option<Granite>,
    /// OLMo 2, 3 or OLMoE (`model_type` `olmo2`, `olmo3`, `olmoe`): q and k norms over the whole
    /// projection; OLMo 2 and 3 normalise after the attention and the MLP instead of before,
    /// OLMoE's MLPs are experts ([`olmo`]); `None` for the other architectures.
    pub olmo: Option<Olmo>,
    /// EXAONE 4 (`model_type` `exaone4`): OLMo 2's norms after the branches with Qwen3's head
    /// norms, and NoPE on the global layers of a windowed model ([`exaone4`]).
    pub exaone4: bool,
    /// GLM or GLM-4 (`model_type` `glm`, `glm4`): q, k, v biases, interleaved partial RoPE in
    /// its checkpoints, GLM-4's norms before and after each branch ([`glm4`]); `None` for the
    /// other architectures.
    pub glm: Option<glm4::Glm>,
    /// DeepSeek-V3 (`model_type` `deepseek_v3`): multi-head latent attention in every layer
    /// ([`deepseek`], the layer [`crate::mla`]); `None` for the other architectures.
    pub mla: Option<deepseek::Mla>,
    /// LoRA adapters for fine-tuning ([`crate::lora`]; not part of `config.json`): the
    /// listed projections gain adapters, which a LoRA run trains alone.
    pub lora: Option<crate::lora::LoraSpec>,
    /// A reward model's (sequence classifier's) labels: `Some(n)` puts transformers'
    /// `*ForSequenceClassification` head `score.weight` `[n, h]` (no bias, replicated over TP)
    /// in place of the LM head, read at each sequence's (document's) last token
    /// ([`crate::reward`]); `None`: a causal LM. From `config.json` when its `architectures`
    /// names a `*ForSequenceClassification` class (`id2label`'s entries, else `num_labels`,
    /// else transformers' default 2) or a `*ForTokenClassification` class
    /// ([`LlamaConfig::token_classifier`]).
    pub num_labels: Option<usize>,
    /// With [`LlamaConfig::num_labels`]: a token classifier (transformers'
    /// `*ForTokenClassification`, a process reward model: [`crate::prm`]) — every token
    /// scored, the head with a bias `score.bias` `[n]` and dropout on its input while training
    /// — in place of a sequence classifier. `None`: a sequence classifier (or a causal LM).
    pub token_classifier: Option<crate::prm::TokenClassifier>,
}

fn get_usize(m: &Map<String, Value>, k: &str) -> Result<Option<usize>> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) => Ok(Some(x as usize)),
            None => bail!("config.json: `{k}` must be a non-negative integer, got {v}"),
        },
    }
}

fn get_f64(m: &Map<String, Value>, k: &str) -> Result<Option<f64>> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) => Ok(Some(x)),
            None => bail!("config.json: `{k}` must be a number, got {v}"),
        },
    }
}

fn get_bool(m: &Map<String, Value>, k: &str) -> Result<Option<bool>> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => bail!("config.json: `{k}` must be true or false, got {v}"),
    }
}

fn need_usize(m: &Map<String, Value>, k: &str) -> Result<usize> {
    match get_usize(m, k)? {
        Some(x) => Ok(x),
        None => bail!("config.json: missing required key `{k}`"),
    }
}

/// `sliding_window` of config.json: an integer >= 1 or `null`/absent (`None`). Whether the
/// layers use it is [`Arch::window`]'s answer (`use_sliding_window`, `layer_types`, ...).
fn parse_window(m: &Map<String, Value>) -> Result<Option<usize>> {
    Ok(match m.get("sliding_window") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(0) => bail!("config.json: `sliding_window` must be >= 1 or null, got 0"),
            Some(x) => Some(x as usize),
            None => bail!("config.json: `sliding_window` must be a positive integer or null, got {v}"),
        },
    })
}

fn token_id(m: &Map<String, Value>, k: &str) -> Option<Value> {
    match m.get(k) {
        Some(v @ (Value::Number(_) | Value::Array(_))) => Some(v.clone()),
        _ => None,
    }
}

impl LlamaConfig {
    /// Parse the text of a HF `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
        let Some(m) = v.as_object() else {
            bail!("config.json: top level is not an object")
        };
        // Gemma 3: the text model's config (a multimodal one's `text_config`), defaults filled
        let smol = smollm3::with_defaults(m)?;
        let exa = exaone4::with_defaults(m)?;
        let text = match (gemma::text_config(m)?, multimodal::text_config(m)?) {
            (Some(t), _) | (None, Some(t)) => Some(t),
            (None, None) => gemma2::with_defaults(m).or_else(|| gpt_oss::with_defaults(m)).or_else(|| olmo::with_defaults(m)).or_else(|| glm4::with_defaults(m)).or_else(|| glm4_moe::with_defaults(m)).or_else(|| deepseek::with_defaults(m)).or(smol).or(exa),
        };
        let m = text.as_ref().unwrap_or(m);
        let hidden_size = need_usize(m, "hidden_size")?;
        let heads = need_usize(m, "num_attention_heads")?;
        let kv = get_usize(m, "num_key_value_heads")?.unwrap_or(heads);
        if heads == 0 || kv == 0 || heads % kv != 0 {
            bail!(
                "config.json: num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv})"
            )
        }
        let arch = Arch::of_config(m)?;
        let head_dim = match get_usize(m, "head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % heads != 0 {
                    bail!("config.json: hidden_size ({hidden_size}) not divisible by num_attention_heads ({heads}) and no head_dim")
                }
                hidden_size / heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            bail!("config.json: head_dim ({head_dim}) must be even for RoPE")
        }
        let max_pos = get_usize(m, "max_position_embeddings")?.unwrap_or(4096);
        // Gemma 3: RoPE per layer type, activation (its defaults are in `m` already)
        let gemma3 = match arch {
            Arch::Gemma3 => Some(gemma::parse(m, max_pos)?),
            _ => None,
        };
        let gemma2 = match arch {
            Arch::Gemma2 => Some(gemma2::parse(m)?),
            _ => None,
        };
        let moe = match arch {
            Arch::Qwen3Moe => Some(qwen3_moe::parse(m)?),
            Arch::Mixtral => Some(qwen3_moe::parse_mixtral(m, need_usize(m, "intermediate_size")?)?),
            Arch::Qwen2Moe => Some(qwen3_moe::parse_qwen2(m)?),
            Arch::GptOss => Some(qwen3_moe::parse_gpt_oss(m, need_usize(m, "intermediate_size")?)?),
            Arch::Olmoe => Some(olmo::parse_moe(m, need_usize(m, "intermediate_size")?)?),
            Arch::GraniteMoe => Some(granite_moe::parse(m, need_usize(m, "intermediate_size")?)?),
            Arch::Glm4Moe | Arch::DeepseekV3 => Some(glm4_moe::parse(m, need_usize(m, "num_hidden_layers")?)?),
            Arch::DeepseekV2 => Some(deepseek::parse_v2_moe(m, need_usize(m, "num_hidden_layers")?)?),
            _ => None,
        };
        // rope: `rope_parameters` (new) wins over legacy `rope_theta` / `rope_scaling`.
        let olmo3_rope = match arch {
            Arch::Olmo3 => olmo::layer_type_rope(m, max_pos, get_usize(m, "original_max_position_embeddings")?)?,
            _ => None,
        };
        let (rope_theta, rope_scaling) = match (&gemma3, olmo3_rope, m.get("rope_parameters")) {
            (Some((_, theta, scaling)), _, _) => (*theta, scaling.clone()),
            // OLMo 3 in transformers 5's form: one RoPE per layer type
            (None, Some(rope), _) => rope,
            (None, None, Some(Value::Object(p))) => {
                let theta = get_f64(p, "rope_theta")?
                    .or(get_f64(m, "rope_theta")?)
                    .unwrap_or(10000.0);
                (theta, parse_scaling(p, max_pos, get_usize(m, "original_max_position_embeddings")?)?)
            }
            (None, None, _) => {
                let theta = get_f64(m, "rope_theta")?.unwrap_or(10000.0);
                let scaling = match m.get("rope_scaling") {
                    Some(Value::Object(s)) => parse_scaling(s, max_pos, get_usize(m, "original_max_position_embeddings")?)?,
                    None | Some(Value::Null) => RopeScaling::Default,
                    Some(other) => bail!("config.json: `rope_scaling` must be an object or null, got {other}"),
                };
                (theta, scaling)
            }
        };
        if let (None, None, Some(act)) = (&gemma3, &gemma2, m.get("hidden_act").and_then(|v| v.as_str())) {
            if act != "silu" {
                bail!("config.json: hidden_act `{act}` not supported (only silu)")
            }
        }
        phi3::refuse_unsupported(m, arch)?;
        if arch == Arch::GptOss {
            gpt_oss::refuse_unsupported(m)?;
        }
        if arch == Arch::Olmoe {
            olmo::refuse_unsupported(m)?;
        }
        let partial_rotary_factor = phi3::partial_rotary_factor(m, arch)?;
        let layers = need_usize(m, "num_hidden_layers")?;
        let (sliding_window, sliding_layers) = arch.window(m, parse_window(m)?, layers)?;
        let nope_layers = match arch {
            Arch::SmolLM3 => Some(smollm3::parse(m, layers)?),
            _ => None,
        };
        let granite = match arch {
            Arch::Granite | Arch::GraniteMoe => Some(granite::parse(m)?),
            _ => None,
        };
        let (num_labels, token_classifier) = crate::arch::num_labels(m)?;
        let cfg = Self {
            vocab_size: need_usize(m, "vocab_size")?,
            hidden_size,
            intermediate_size: need_usize(m, "intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            rms_norm_eps: get_f64(m, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            partial_rotary_factor,
            tie_word_embeddings: m.get("tie_word_embeddings").and_then(|v| v.as_bool()).unwrap_or(false),
            max_position_embeddings: max_pos,
            bos_token_id: token_id(m, "bos_token_id"),
            eos_token_id: token_id(m, "eos_token_id"),
            sliding_window,
            sliding_layers,
            qkv_bias: arch.qkv_bias(m)?,
            qk_norm: arch.qk_norm() || (arch == Arch::Glm4Moe && glm4_moe::qk_norm(m)?),
            gemma3: gemma3.map(|g| g.0),
            gemma2,
            moe,
            phi3: arch == Arch::Phi3,
            gpt_oss: arch == Arch::GptOss,
            nope_layers,
            granite,
            olmo: match arch {
                Arch::Olmo2 => Some(Olmo::Olmo2),
                Arch::Olmo3 => Some(Olmo::Olmo3),
                Arch::Olmoe => Some(Olmo::Olmoe),
                _ => None,
            },
            exaone4: arch == Arch::Exaone4,
            glm: match arch {
                Arch::Glm => Some(glm4::Glm::Glm),
                Arch::Glm4 => Some(glm4::Glm::Glm4),
                _ => None,
            },
            mla: None,
            lora: None,
            num_labels,
            token_classifier,
        };
        // DeepSeek-V3: the latent attention sets the head width the attention runs at
        let cfg = match arch {
            Arch::DeepseekV3 | Arch::DeepseekV2 => cfg.with_mla(Some(deepseek::parse(m)?)),
            _ => cfg,
        };
        // EXAONE 4: NoPE on the global layers of a windowed model
        let cfg = if cfg.exaone4 { Self { nope_layers: exaone4::nope_layers(&cfg), ..cfg } } else { cfg };
        // every invariant the model needs, named (vocab 0, theta 0, a negative epsilon, ...)
        cfg.validate().map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
        Ok(cfg)
    }

    /// Read and parse `config.json` (pass the file path).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let p = path.as_ref();
        let text =
            std::fs::read_to_string(p).map_err(|e| candle_core::Error::Msg(format!("reading {}: {e}", p.display())))?;
        Self::from_json(&text)
    }

    /// A small model shape for examples and tests (pair it with [`crate::init_params`]):
    /// `hidden` wide, `layers` deep, `heads` query heads of width `hidden / heads`,
    /// `kv_heads` KV heads, MLP width `2.75·hidden` rounded up to a multiple of 16,
    /// RoPE theta 10000, untied head, rms eps 1e-5.
    pub fn tiny(vocab: usize, hidden: usize, layers: usize, heads: usize, kv_heads: usize) -> Self {
        let inter = (hidden * 11 / 4).div_ceil(16) * 16;
        Self {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: hidden / heads.max(1),
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            partial_rotary_factor: 1.0,
            tie_word_embeddings: false,
            max_position_embeddings: 131072,
            bos_token_id: None,
            eos_token_id: None,
            sliding_window: None,
            sliding_layers: None,
            qkv_bias: false,
            qk_norm: false,
            gemma3: None,
            gemma2: None,
            moe: None,
            phi3: false,
            gpt_oss: false,
            nope_layers: None,
            granite: None,
            olmo: None,
            exaone4: false,
            glm: None,
            mla: None,
            lora: None,
            num_labels: None,
            token_classifier: None,
        }
    }

    /// Dimensions of a head that RoPE rotates: `head_dim · partial_rotary_factor`, truncated
    /// (transformers' `int(head_dim * partial_rotary_factor)`); `head_dim` unless partial.
    pub fn rope_dim(&self) -> usize {
        // (DeepSeek-V3: the RoPE part of each q, k head)
        if let Some(a) = &self.mla {
            return a.qk_rope_head_dim;
        }
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// The same config with RoPE on the first `head_dim · factor` dimensions of each head
    /// ([`LlamaConfig::partial_rotary_factor`]; a Phi-3 config only, see [`phi3`]).
    pub fn with_partial_rotary_factor(mut self, factor: f64) -> Self {
        self.partial_rotary_factor = factor;
        self
    }

    /// The same config as a Phi-3 (`true`: its checkpoints fuse `qkv_proj` / `gate_up_proj`,
    /// see [`phi3`]) or not.
    pub fn with_phi3(mut self, on: bool) -> Self {
        self.phi3 = on;
        self
    }

    /// The same config with (`true`) or without biases on the q, k, v projections (a Qwen2
    /// model, see [`LlamaConfig::qkv_bias`]).
    pub fn with_qkv_bias(mut self, on: bool) -> Self {
        self.qkv_bias = on;
        self
    }

    /// The same config with (`true`) or without RMSNorms over each q and k head (a Qwen3
    /// model, see [`LlamaConfig::qk_norm`]).
    pub fn with_qk_norm(mut self, on: bool) -> Self {
        self.qk_norm = on;
        self
    }

    /// The same config with the layers `nope` attending without RoPE (SmolLM3's NoPE layers,
    /// one entry per layer; `None`: every layer rotates). See [`smollm3`].
    pub fn with_nope_layers(mut self, nope: Option<Vec<bool>>) -> Self {
        self.nope_layers = nope;
        self
    }

    /// Whether layer `layer` rotates its q and k by RoPE (all but SmolLM3's NoPE layers).
    pub fn layer_rotates(&self, layer: usize) -> bool {
        !self.nope_layers.as_ref().is_some_and(|n| n.get(layer).copied().unwrap_or(false))
    }

    /// The architecture [`LlamaConfig::to_hf_json`] writes: Qwen3 with q, k norms, Qwen2
    /// with q, k, v biases, else Mistral with a sliding window, else Llama.
    pub fn arch(&self) -> Arch {
        if self.gemma3.is_some() {
            return Arch::Gemma3;
        }
        if self.gemma2.is_some() {
            return Arch::Gemma2;
        }
        if self.phi3 {
            return Arch::Phi3;
        }
        if self.gpt_oss {
            return Arch::GptOss;
        }
        if self.exaone4 {
            return Arch::Exaone4;
        }
        if let Some(g) = self.glm {
            return g.arch();
        }
        if self.mla.is_some() {
            return match self.moe.as_ref().map(|m| m.style) {
                Some(MoeStyle::DeepseekV2) => Arch::DeepseekV2,
                _ => Arch::DeepseekV3,
            };
        }
        if let Some(o) = self.olmo {
            return match o {
                Olmo::Olmo2 => Arch::Olmo2,
                Olmo::Olmo3 => Arch::Olmo3,
                Olmo::Olmoe => Arch::Olmoe,
            };
        }
        if let Some(m) = &self.moe {
            return match m.style {
                MoeStyle::Qwen3Moe => Arch::Qwen3Moe,
                MoeStyle::Mixtral => Arch::Mixtral,
                MoeStyle::Qwen2Moe => Arch::Qwen2Moe,
                MoeStyle::GptOss => Arch::GptOss,
                MoeStyle::GraniteMoe => Arch::GraniteMoe,
                MoeStyle::Glm4Moe => Arch::Glm4Moe,
                MoeStyle::DeepseekV2 => Arch::DeepseekV2,
            };
        }
        if self.nope_layers.is_some() {
            return Arch::SmolLM3;
        }
        if self.granite.is_some() {
            return Arch::Granite;
        }
        match (self.qk_norm, self.qkv_bias, self.sliding_window) {
            (true, _, _) => Arch::Qwen3,
            (false, true, _) => Arch::Qwen2,
            (false, false, Some(_)) => Arch::Mistral,
            (false, false, None) => Arch::Llama,
        }
    }

    /// The same config with a causal sliding window of `window` keys (`None`: plain causal;
    /// see [`LlamaConfig::sliding_window`]). [`LlamaConfig::validate`] rejects `Some(0)`.
    pub fn with_sliding_window(mut self, window: Option<usize>) -> Self {
        self.sliding_window = window;
        self
    }

    /// The same config with the window on the layers `layers` marks `true` only (one entry
    /// per layer; `None`: every layer; see [`LlamaConfig::sliding_layers`]). A mask that is all
    /// `true` is stored as `None`; one that is all `false` removes the window (as config.json
    /// parsing reads it); [`LlamaConfig::validate`] checks the length and that a window is set.
    pub fn with_sliding_layers(mut self, layers: Option<Vec<bool>>) -> Self {
        if layers.as_ref().is_some_and(|l| !l.is_empty() && l.iter().all(|&s| !s)) {
            self.sliding_window = None;
        }
        self.sliding_layers = layers.filter(|l| l.iter().any(|&s| !s) && l.iter().any(|&s| s));
        self
    }

    /// The window layer `layer` attends within (`None`: plain causal attention).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match &self.sliding_layers {
            Some(l) if !l.get(layer).copied().unwrap_or(false) => None,
            _ => self.sliding_window,
        }
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
