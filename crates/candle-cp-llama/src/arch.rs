//! Which Hugging Face architectures a `config.json` may name, and what each one implies for
//! the parameters and the attention of [`crate::Llama`]:
//!
//! | `model_type` (`architectures`)     | q, k, v biases | q, k norms | sliding window                          |
//! |------------------------------------|----------------|------------|-----------------------------------------|
//! | `llama` (`LlamaForCausalLM`)       | no             | no         | `sliding_window` if the config has one  |
//! | `mistral` (`MistralForCausalLM`)   | no             | no         | `sliding_window` (every layer)          |
//! | `qwen2` (`Qwen2ForCausalLM`)       | yes            | no         | only with `use_sliding_window`, on the layers from `max_window_layers` on, or those `layer_types` names |
//! | `qwen3` (`Qwen3ForCausalLM`)       | no             | yes        | as Qwen2                                |
//! | `qwen3_moe` (`Qwen3MoeForCausalLM`) | no            | yes        | as Qwen2 (its MLPs: [`crate::config::qwen3_moe`]) |
//! | `mixtral` (`MixtralForCausalLM`)   | no             | no         | as Mistral (its MLPs: [`crate::config::qwen3_moe`]) |
//! | `qwen2_moe` (`Qwen2MoeForCausalLM`) | yes           | no         | as Qwen2 (its MLPs: [`crate::config::qwen3_moe`]) |
//! | `gemma2` (`Gemma2ForCausalLM`)     | no             | no         | the layers `layer_types` names, else every other one from layer 0 |
//! | `gemma3_text` (`Gemma3ForCausalLM`) | no            | yes (`1 + w`) | the layers `layer_types` names, else all but every `sliding_window_pattern`-th (default 6) |
//! | `phi3` (`Phi3ForCausalLM`)         | no             | no         | as Mistral                              |
//! | `gpt_oss` (`GptOssForCausalLM`)    | yes, and o_proj's | no      | the layers `layer_types` names, else every other one from layer 0 (sinks, MLPs: [`crate::config::gpt_oss`]) |
//! | `olmo2` (`Olmo2ForCausalLM`)       | no             | over the whole projection, norms after the branches ([`crate::config::olmo`]) | none |
//! | `olmo3` (`Olmo3ForCausalLM`)       | no             | as OLMo 2  | the layers `layer_types` names, else all but every fourth (window default 4096) |
//! | `exaone4` (`Exaone4ForCausalLM`)   | no             | yes (norms after the branches, as OLMo 2) | the layers `layer_types` names, else by `sliding_window_pattern` (NoPE on the others: [`crate::config::exaone4`]) |
//! | `olmoe` (`OlmoeForCausalLM`)       | no             | over the whole projection (norms before the branches, as a Llama) | none (MLPs: experts on every layer, [`crate::config::olmo`]) |
//! | `granitemoe` (`GraniteMoeForCausalLM`) | no         | no         | none (Granite's multipliers; MLPs: experts on every layer, [`crate::config::granite_moe`]) |
//! | `glm4` (`Glm4ForCausalLM`)         | `attention_bias` (default on) | no | none (norms before and after each branch, interleaved partial RoPE: [`crate::config::glm4`]) |
//! | `glm4_moe` (`Glm4MoeForCausalLM`)  | `attention_bias` | `use_qk_norm` | none (its MLPs: experts with sigmoid scores from layer `first_k_dense_replace` on, [`crate::config::glm4_moe`]) |
//! | `glm` (`GlmForCausalLM`)           | `attention_bias` (default on) | no | none (GLM-4's RoPE and fused MLP with a Llama's norms: [`crate::config::glm4`]) |
//! | `deepseek_v3` (`DeepseekV3ForCausalLM`) | no (latent attention: [`crate::config::deepseek`]) | the latents' norms | none (GLM-4.5's experts from layer `first_k_dense_replace` on) |
//! | `deepseek_v2` (`DeepseekV2ForCausalLM`) | no (the same attention) | the latents' norms | none (a softmax router, [`crate::MoeStyle::DeepseekV2`]) |
//!
//! Phi-3 is a Llama whose checkpoints fuse q, k, v into `qkv_proj` and gate, up into
//! `gate_up_proj` (split on load, fused on save: [`crate::config::phi3`]); its long-context
//! models scale RoPE by LongRoPE ([`crate::RopeScaling::LongRope`]).
//!
//! Gemma 2 and 3 differ from a Llama in more than these columns: see [`crate::gemma2`] (its
//! logit soft-capping) and [`crate::gemma`].
//!
//! Qwen's and Gemma's window may sit on some layers only ([`crate::LlamaConfig::sliding_layers`]; each
//! layer attends within [`crate::LlamaConfig::layer_window`], on every layout, in training and
//! in generation).
//!
//! Qwen3's q and k norms are RMSNorms over each head's `D` features (weights `[D]`, shared by
//! the heads), applied after the projection and before RoPE ([`crate::LlamaConfig::qk_norm`]).
//!
//! Anything else is refused by name. Without the check a config of another architecture
//! would load and train silently as a different model: a shared expert (Qwen2-MoE), a Llama with `attention_bias: true` (its o_proj bias) or `mlp_bias: true` would be
//! parameters or arithmetic the model never applies. For the same reason [`crate::load_hf`] refuses checkpoint tensors the model
//! does not use. A Llama or Mistral config with a window on some layers only (`layer_types`
//! mixing `full_attention` and `sliding_attention`) is refused too: transformers gives those
//! one window for every layer, so the checkpoint saved back would load as a different model.

use candle_core::{bail, Result};
use serde_json::{Map, Value};

/// The architecture a config names (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM`: a Llama with a sliding window.
    Mistral,
    /// `Qwen2ForCausalLM`: a Llama with biases on the q, k and v projections.
    Qwen2,
    /// `Qwen3ForCausalLM`: a Llama with RMSNorms over each q and k head before RoPE.
    Qwen3,
    /// `Qwen3MoeForCausalLM`: a Qwen3 whose MLPs are mixtures of experts (see
    /// [`crate::config::qwen3_moe`]).
    Qwen3Moe,
    /// `MixtralForCausalLM`: a Mistral whose MLPs are mixtures of experts.
    Mixtral,
    /// `Qwen2MoeForCausalLM`: a Qwen2 whose MLPs are mixtures of experts with a shared expert.
    Qwen2Moe,
    /// `Gemma3ForCausalLM` (`model_type` `gemma3_text`, the text model): see [`crate::gemma`].
    Gemma3,
    /// `Gemma2ForCausalLM`: see [`crate::gemma2`].
    Gemma2,
    /// `Phi3ForCausalLM`: a Llama with fused checkpoint projections, see [`crate::config::phi3`].
    Phi3,
    /// `GptOssForCausalLM`: attention sinks, biases, a mixture of experts on every layer, see
    /// [`crate::config::gpt_oss`].
    GptOss,
    /// `SmolLM3ForCausalLM`: a Llama with layers that attend without RoPE, see
    /// [`crate::config::smollm3`].
    SmolLM3,
    /// `GraniteForCausalLM`: a Llama with embedding, attention, residual and logit multipliers,
    /// see [`crate::config::granite`].
    Granite,
    /// `Olmo2ForCausalLM`: norms after the branches, q and k norms over the whole projection,
    /// see [`crate::config::olmo`].
    Olmo2,
    /// `Olmo3ForCausalLM`: OLMo 2 with sliding-window layers, see [`crate::config::olmo`].
    Olmo3,
    /// `OlmoeForCausalLM`: a Llama with OLMo's q and k norms and a mixture of experts on every
    /// layer, see [`crate::config::olmo`].
    Olmoe,
    /// `Exaone4ForCausalLM`: OLMo 2's norms with Qwen3's head norms, a window on most layers and
    /// NoPE on the others, see [`crate::config::exaone4`].
    Exaone4,
    /// `GraniteMoeForCausalLM`: Granite's multipliers and a mixture of experts on every layer,
    /// see [`crate::config::granite_moe`].
    GraniteMoe,
    /// `Glm4ForCausalLM`: norms before and after each branch, q, k, v biases, interleaved
    /// partial RoPE, see [`crate::config::glm4`].
    Glm4,
    /// `GlmForCausalLM`: GLM-4's q, k, v biases and interleaved partial RoPE with a Llama's
    /// norms, see [`crate::config::glm4`].
    Glm,
    /// `Glm4MoeForCausalLM` (GLM-4.5): a mixture of experts with sigmoid scores and shared
    /// experts, see [`crate::config::glm4_moe`].
    Glm4Moe,
    /// `DeepseekV3ForCausalLM`: multi-head latent attention and GLM-4.5's mixture of experts,
    /// see [`crate::config::deepseek`].
    DeepseekV3,
    /// `DeepseekV2ForCausalLM`: DeepSeek-V3's latent attention with a softmax router, see
    /// [`crate::config::deepseek`].
    DeepseekV2,
}

impl Arch {
    /// The supported `model_type` values, as listed in errors.
    pub const SUPPORTED: &'static str = "llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, qwen2_moe, gemma3_text, gemma2, phi3, gpt_oss, smollm3, granite, olmo2, olmo3, olmoe, exaone4, granitemoe, glm4, glm, glm4_moe, deepseek_v3, deepseek_v2";

    /// Every architecture, in [`Arch::SUPPORTED`]'s order.
    pub const ALL: [Arch; 23] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Mixtral,
        Arch::Qwen2Moe,
        Arch::Gemma3,
        Arch::Gemma2,
        Arch::Phi3,
        Arch::GptOss,
        Arch::SmolLM3,
        Arch::Granite,
        Arch::Olmo2,
        Arch::Olmo3,
        Arch::Olmoe,
        Arch::Exaone4,
        Arch::GraniteMoe,
        Arch::Glm4,
        Arch::Glm,
        Arch::Glm4Moe,
        Arch::DeepseekV3,
        Arch::DeepseekV2,
    ];

    /// The architecture a `model_type` names: [`Arch::hf_names`]' own, or an alias
    /// ([`crate::hf_files::MODEL_TYPE_ALIASES`]: Kimi K2's `kimi_k2`, a DeepSeek-V3, kept
    /// when its checkpoints are written).
    fn of_model_type(t: &str) -> Option<Arch> {
        let t = crate::hf_files::MODEL_TYPE_ALIASES.iter().find(|(alias, _)| *alias == t).map_or(t, |(_, written)| *written);
        Arch::ALL.into_iter().find(|a| a.hf_names().1 == t)
    }

    /// The architecture of class `c`: its causal LM (`LlamaForCausalLM`), its sequence
    /// classifier (`LlamaForSequenceClassification`, a reward model: [`num_labels`]) or its
    /// token classifier (`LlamaForTokenClassification`, a process reward model).
    fn of_class(c: &str) -> Option<Arch> {
        // (Gemma 3's text model's is Gemma3TextForSequenceClassification)
        let c = if c == GEMMA3_TEXT_CLASSIFIER { "Gemma3ForSequenceClassification" } else { c };
        let causal = c.strip_suffix(SEQUENCE_CLASSIFICATION).or_else(|| c.strip_suffix(TOKEN_CLASSIFICATION)).map(|stem| format!("{stem}ForCausalLM"));
        let c = causal.as_deref().unwrap_or(c);
        Arch::ALL.into_iter().find(|a| a.hf_names().0 == c)
    }

    /// The class transformers names a model of this architecture by: the causal LM
    /// ([`Arch::hf_names`]), or with a score head of `num_labels` its sequence classifier.
    pub fn hf_class(self, num_labels: Option<usize>) -> String {
        let causal = self.hf_names().0;
        match (num_labels, causal.strip_suffix("ForCausalLM")) {
            (Some(_), _) if self == Arch::Gemma3 => GEMMA3_TEXT_CLASSIFIER.to_string(),
            (Some(_), Some(stem)) => format!("{stem}{SEQUENCE_CLASSIFICATION}"),
            _ => causal.to_string(),
        }
    }

    /// The class transformers names this architecture's token classifier by
    /// (`LlamaForTokenClassification`: a process reward model, [`crate::prm`]).
    pub fn hf_token_class(self) -> String {
        let causal = self.hf_names().0;
        format!("{}{TOKEN_CLASSIFICATION}", causal.strip_suffix("ForCausalLM").unwrap_or(causal))
    }

    /// `(architectures[0], model_type)` as transformers writes them.
    pub fn hf_names(self) -> (&'static str, &'static str) {
        match self {
            Arch::Llama => ("LlamaForCausalLM", "llama"),
            Arch::Mistral => ("MistralForCausalLM", "mistral"),
            Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
            Arch::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            Arch::Mixtral => ("MixtralForCausalLM", "mixtral"),
            Arch::Qwen2Moe => ("Qwen2MoeForCausalLM", "qwen2_moe"),
            Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
            Arch::Gemma2 => ("Gemma2ForCausalLM", "gemma2"),
            Arch::Phi3 => ("Phi3ForCausalLM", "phi3"),
            Arch::GptOss => ("GptOssForCausalLM", "gpt_oss"),
            Arch::SmolLM3 => ("SmolLM3ForCausalLM", "smollm3"),
            Arch::Granite => ("GraniteForCausalLM", "granite"),
            Arch::Olmo2 => ("Olmo2ForCausalLM", "olmo2"),
            Arch::Olmo3 => ("Olmo3ForCausalLM", "olmo3"),
            Arch::Olmoe => ("OlmoeForCausalLM", "olmoe"),
            Arch::Exaone4 => ("Exaone4ForCausalLM", "exaone4"),
            Arch::GraniteMoe => ("GraniteMoeForCausalLM", "granitemoe"),
            Arch::Glm4 => ("Glm4ForCausalLM", "glm4"),
            Arch::Glm => ("GlmForCausalLM", "glm"),
            Arch::Glm4Moe => ("Glm4MoeForCausalLM", "glm4_moe"),
            Arch::DeepseekV3 => ("DeepseekV3ForCausalLM", "deepseek_v3"),
            Arch::DeepseekV2 => ("DeepseekV2ForCausalLM", "deepseek_v2"),
        }
    }

    /// The architecture of a parsed `config.json`: from `model_type`, else from the first of
    /// `architectures`, else [`Arch::Llama`]. Errors name an unsupported value, or the two
    /// keys naming different architectures.
    pub fn of_config(m: &Map<String, Value>) -> Result<Arch> {
        let by_type = match m.get("model_type") {
            None | Some(Value::Null) => None,
            Some(Value::String(t)) => match Arch::of_model_type(t) {
                Some(a) => Some(a),
                None if t == "gemma3" => bail!(
                    "config.json: model_type `gemma3` (Gemma3ForConditionalGeneration, text and vision): its text model's config is its `text_config` (model_type `gemma3_text`, which `LlamaConfig::from_json` reads)"
                ),
                None => bail!("config.json: model_type `{t}` not supported (supported: {})", Arch::SUPPORTED),
            },
            Some(other) => bail!("config.json: `model_type` must be a string, got {other}"),
        };
        let classes: Vec<&str> = match m.get("architectures") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(a)) => a.iter().filter_map(|v| v.as_str()).collect(),
            Some(other) => bail!("config.json: `architectures` must be a list of strings, got {other}"),
        };
        let mut by_class = None;
        for c in classes {
            match (Arch::of_class(c), by_class) {
                (None, _) => bail!(
                    "config.json: architecture `{c}` not supported (supported: {})",
                    Arch::ALL.map(|a| a.hf_names().0).join(", ")
                ),
                (Some(a), Some(b)) if a != b => bail!("config.json: `architectures` names both {} and {}", b.hf_names().0, a.hf_names().0),
                (Some(a), _) => by_class = Some(a),
            }
        }
        match (by_type, by_class) {
            (Some(a), Some(b)) if a != b => bail!(
                "config.json: model_type `{}` but architectures `{}`",
                a.hf_names().1,
                b.hf_names().0
            ),
            (Some(a), _) | (None, Some(a)) => Ok(a),
            (None, None) => Ok(Arch::Llama),
        }
    }

    /// Whether the q, k, v projections carry biases; errors for the biases this model does
    /// not have (`attention_bias` of a Llama or Mistral config, which includes o_proj's;
    /// `mlp_bias`).
    pub(crate) fn qkv_bias(self, m: &Map<String, Value>) -> Result<bool> {
        if m.get("mlp_bias").and_then(|v| v.as_bool()) == Some(true) {
            bail!("config.json: `mlp_bias: true` not supported (the MLP projections have no biases)")
        }
        match self {
            // Qwen2Attention: bias=True on q/k/v, False on o_proj, whatever attention_bias says
            Arch::Qwen2 | Arch::Qwen2Moe => Ok(true),
            // GptOssConfig forces attention_bias on (q, k, v and o_proj)
            Arch::GptOss => Ok(true),
            // Glm4Attention, GlmAttention: attention_bias on q, k, v (default true:
            // glm4::with_defaults), none on o_proj
            Arch::Glm | Arch::Glm4 => Ok(m.get("attention_bias").and_then(|v| v.as_bool()).unwrap_or(true)),
            // Glm4MoeAttention: attention_bias on q, k, v (default false), none on o_proj
            Arch::Glm4Moe => Ok(m.get("attention_bias").and_then(|v| v.as_bool()).unwrap_or(false)),
            // DeepseekV3Attention: no q, k, v projections (attention_bias refused by
            // config::deepseek::parse)
            Arch::DeepseekV3 | Arch::DeepseekV2 => Ok(false),
            Arch::Llama | Arch::Mistral | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Mixtral | Arch::Gemma3 | Arch::Gemma2 | Arch::Phi3 | Arch::SmolLM3 | Arch::Granite | Arch::Olmo2 | Arch::Olmo3 | Arch::Olmoe | Arch::Exaone4 | Arch::GraniteMoe => {
                if m.get("attention_bias").and_then(|v| v.as_bool()) == Some(true) {
                    bail!(
                        "config.json: `attention_bias: true` not supported (biases on q, k, v and o_proj; the q, k, v biases alone are Qwen2's, model_type `qwen2`)"
                    )
                }
                Ok(false)
            }
        }
    }

    /// Whether each q and k head is RMS-normalised before RoPE (Qwen3).
    pub(crate) fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::Exaone4)
    }

    /// The window and the layers that use it (`None`: every layer; see
    /// [`crate::LlamaConfig::sliding_layers`]), from `sliding_window` (already parsed,
    /// `window`), `use_sliding_window`, Qwen2's `max_window_layers` and `layer_types`. A window
    /// no layer uses is `None`. Errors for windows on some layers only of a Llama or Mistral
    /// (transformers gives those one window for every layer).
    #[allow(clippy::type_complexity)]
    pub(crate) fn window(self, m: &Map<String, Value>, window: Option<usize>, layers: usize) -> Result<(Option<usize>, Option<Vec<bool>>)> {
        let use_key = m.get("use_sliding_window").and_then(|v| v.as_bool());
        let w = match (self, use_key) {
            (_, Some(false)) => None,
            // Qwen2Config / Qwen3Config: use_sliding_window defaults to false
            (Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe, None) => None,
            // SmolLM3Config: use_sliding_window defaults to false too
            (Arch::SmolLM3, None) => None,
            // Olmo2Config and OlmoeConfig have no window (transformers ignores the keys)
            (Arch::Olmo2 | Arch::Olmoe, _) => None,
            // GraniteMoeConfig has no window either
            (Arch::GraniteMoe | Arch::Glm | Arch::Glm4 | Arch::Glm4Moe | Arch::DeepseekV3 | Arch::DeepseekV2, _) => None,
            _ => window,
        };
        let per_layer: Vec<bool> = match m.get("layer_types") {
            None | Some(Value::Null) => match self {
                Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe => {
                    // transformers: layer i slides iff sliding_window and i >= max_window_layers
                    // (Qwen2Config's default is 28)
                    let from = match m.get("max_window_layers") {
                        None | Some(Value::Null) => 28,
                        Some(v) => match v.as_u64() {
                            Some(x) => x as usize,
                            None => bail!("config.json: `max_window_layers` must be a non-negative integer, got {v}"),
                        },
                    };
                    (0..layers).map(|i| w.is_some() && i >= from).collect()
                }
                // Gemma2Config, GptOssConfig: layer i slides iff (i + 1) % 2 != 0 (layers 0, 2, 4, ...)
                Arch::Gemma2 | Arch::GptOss => (0..layers).map(|i| w.is_some() && i % 2 == 0).collect(),
                Arch::Gemma3 => {
                    // transformers before `layer_types`: layer i slides iff (i + 1) % pattern
                    let p = match m.get("sliding_window_pattern") {
                        None | Some(Value::Null) => 6,
                        Some(v) => match v.as_u64() {
                            Some(x) if x > 0 => x as usize,
                            _ => bail!("config.json: `sliding_window_pattern` must be a positive integer, got {v}"),
                        },
                    };
                    (0..layers).map(|i| w.is_some() && !(i + 1).is_multiple_of(p)).collect()
                }
                // Olmo3Config: layer i slides iff (i + 1) % 4 != 0
                Arch::Olmo3 => (0..layers).map(|i| w.is_some() && !(i + 1).is_multiple_of(4)).collect(),
                Arch::Llama | Arch::Mistral | Arch::Mixtral | Arch::Phi3 | Arch::Granite | Arch::Olmo2 | Arch::Olmoe | Arch::Exaone4 | Arch::GraniteMoe | Arch::Glm | Arch::Glm4 | Arch::Glm4Moe | Arch::DeepseekV3 | Arch::DeepseekV2 => vec![w.is_some(); layers],
                // (smollm3::with_defaults writes `layer_types`: the window on the NoPE layers)
                Arch::SmolLM3 => vec![false; layers],
            },
            Some(Value::Array(a)) => {
                if a.len() != layers {
                    bail!("config.json: `layer_types` has {} entries for {layers} layers", a.len())
                }
                let mut v = Vec::with_capacity(layers);
                for t in a {
                    match t.as_str() {
                        Some("full_attention") => v.push(false),
                        Some("sliding_attention") => v.push(w.is_some()),
                        _ => bail!("config.json: `layer_types` entry {t} not supported (full_attention, sliding_attention)"),
                    }
                }
                v
            }
            Some(other) => bail!("config.json: `layer_types` must be a list, got {other}"),
        };
        let windowed = per_layer.iter().filter(|&&s| s).count();
        if windowed == 0 {
            return Ok((None, None));
        }
        if windowed == layers {
            return Ok((w, None));
        }
        if matches!(self, Arch::Llama | Arch::Mistral | Arch::Mixtral | Arch::Phi3 | Arch::Granite) {
            bail!(
                "config.json: a sliding window ({}) on {windowed} of {layers} layers (layers {:?} attend fully): a {self:?} model has one window for every layer (per-layer windows: Qwen2, Qwen3, Gemma 3)",
                w.unwrap_or(0),
                per_layer.iter().enumerate().filter(|(_, &s)| !s).map(|(i, _)| i).collect::<Vec<_>>()
            )
        }
        Ok((w, Some(per_layer)))
    }
}

/// The suffix of transformers' sequence-classification classes (`LlamaForSequenceClassification`).
const SEQUENCE_CLASSIFICATION: &str = "ForSequenceClassification";

/// The suffix of transformers' token-classification classes (`LlamaForTokenClassification`: a
/// process reward model, [`crate::prm`]).
const TOKEN_CLASSIFICATION: &str = "ForTokenClassification";

/// Gemma 3's text model as a sequence classifier (`model_type` `gemma3_text`; transformers'
/// `Gemma3ForSequenceClassification` is the multimodal model's).
const GEMMA3_TEXT_CLASSIFIER: &str = "Gemma3TextForSequenceClassification";

/// A reward model's labels from `config.json`: `Some(n)` when `architectures` names a
/// `*ForSequenceClassification` or a `*ForTokenClassification` class — `n` the entries of
/// `id2label`, else `num_labels`, else transformers' default 2 — `None` for a causal LM; and
/// for a token classifier its dropout (`classifier_dropout`, else `hidden_dropout`, else
/// transformers' 0.1). Errors name a config that names two kinds of class, or an `id2label` /
/// `num_labels` / dropout out of range.
pub(crate) fn num_labels(m: &Map<String, Value>) -> Result<(Option<usize>, Option<crate::prm::TokenClassifier>)> {
    let classes: Vec<&str> = m.get("architectures").and_then(|v| v.as_array()).map(|a| a.iter().filter_map(|v| v.as_str()).collect()).unwrap_or_default();
    let seq = classes.iter().filter(|c| c.ends_with(SEQUENCE_CLASSIFICATION)).count();
    let tok = classes.iter().filter(|c| c.ends_with(TOKEN_CLASSIFICATION)).count();
    if seq + tok == 0 {
        return Ok((None, None));
    }
    if seq + tok != classes.len() || seq.min(tok) > 0 {
        bail!("config.json: `architectures` {classes:?} names a classifier and another class")
    }
    let n = match (m.get("id2label"), m.get("num_labels")) {
        (Some(Value::Object(o)), _) => o.len(),
        (Some(other), _) if !other.is_null() => bail!("config.json: `id2label` must be an object, got {other}"),
        (_, Some(v)) if !v.is_null() => v.as_u64().ok_or_else(|| candle_core::Error::Msg(format!("config.json: `num_labels` must be a non-negative integer, got {v}")))? as usize,
        _ => 2,
    };
    if n == 0 {
        bail!("config.json: a classifier ({}) with no label", classes[0])
    }
    if tok == 0 {
        return Ok((Some(n), None));
    }
    // (transformers' token classifiers: classifier_dropout, else hidden_dropout, else 0.1)
    let p = match ["classifier_dropout", "hidden_dropout"].iter().find_map(|k| m.get(*k).filter(|v| !v.is_null()).map(|v| (k, v))) {
        Some((k, v)) => v.as_f64().ok_or_else(|| candle_core::Error::Msg(format!("config.json: `{k}` must be a number, got {v}")))?,
        None => crate::prm::TokenClassifier::HF_DROPOUT,
    };
    let bias = match m.get("token_classification_bias") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => bail!("config.json: `token_classification_bias` must be a bool, got {other}"),
    };
    Ok((Some(n), Some(crate::prm::TokenClassifier::new(p)?.with_bias(bias))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LlamaConfig;

    const BASE: &str = r#""vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2"#;

    fn parse(extra: &str) -> Result<LlamaConfig> {
        LlamaConfig::from_json(&format!("{{{BASE}{extra}}}"))
    }

    fn err(extra: &str) -> String {
        parse(extra).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn sequence_classifiers_are_reward_models() -> Result<()> {
        // the causal LM's architecture with a score head: labels from id2label, num_labels or 2
        for (extra, arch, n) in [
            (r#", "architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}"#, Arch::Llama, 1),
            (r#", "architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2", "num_labels": 3"#, Arch::Qwen2, 3),
            (r#", "architectures": ["Qwen3ForSequenceClassification"]"#, Arch::Qwen3, 2),
        ] {
            let c = parse(extra)?;
            assert_eq!((c.arch(), c.num_labels), (arch, Some(n)), "{extra}");
            assert_eq!(arch.hf_class(c.num_labels), arch.hf_names().0.replace("ForCausalLM", "ForSequenceClassification"));
        }
        assert_eq!(parse("")?.num_labels, None);
        assert_eq!(Arch::Gemma3.hf_class(Some(1)), "Gemma3TextForSequenceClassification");
        assert_eq!(Arch::of_class("Gemma3TextForSequenceClassification"), Some(Arch::Gemma3));
        assert_eq!(Arch::Qwen3.hf_class(None), "Qwen3ForCausalLM");
        // token classifiers (process reward models): labels alike, the dropout before the head
        for (extra, arch, n, p) in [
            (r#", "architectures": ["LlamaForTokenClassification"]"#, Arch::Llama, 2, 0.1),
            (r#", "architectures": ["Qwen2ForTokenClassification"], "model_type": "qwen2", "num_labels": 3, "classifier_dropout": 0.0"#, Arch::Qwen2, 3, 0.0),
            (r#", "architectures": ["Qwen3ForTokenClassification"], "model_type": "qwen3", "hidden_dropout": 0.25"#, Arch::Qwen3, 2, 0.25),
        ] {
            let c = parse(extra)?;
            assert_eq!((c.arch(), c.num_labels, c.token_classifier.map(|t| t.dropout)), (arch, Some(n), Some(p)), "{extra}");
            assert_eq!(c.hf_class(), arch.hf_names().0.replace("ForCausalLM", "ForTokenClassification"));
        }
        assert_eq!(parse(r#", "architectures": ["LlamaForSequenceClassification"]"#)?.token_classifier, None);
        // (transformers' token_classification_bias: a head without its bias)
        let c = parse(r#", "architectures": ["LlamaForTokenClassification"], "token_classification_bias": false"#)?;
        assert_eq!(c.token_classifier, Some(crate::prm::TokenClassifier { dropout: 0.1, bias: false }));
        assert!(!crate::param_specs(&c).iter().any(|s| s.name == crate::prm::SCORE_BIAS));
        assert!(c.to_hf_json("float32").contains("\"token_classification_bias\": false"));
        assert!(err(r#", "architectures": ["LlamaForTokenClassification", "LlamaForSequenceClassification"]"#).contains("a classifier and another class"));
        assert!(err(r#", "architectures": ["LlamaForTokenClassification"], "classifier_dropout": 1.0"#).contains("dropout"));
        assert!(err(r#", "architectures": ["LlamaForTokenClassification"], "classifier_dropout": "x""#).contains("`classifier_dropout` must be a number"));
        Ok(())
    }

    #[test]
    fn architectures_and_their_biases() -> Result<()> {
        assert_eq!(Arch::ALL.map(|a| a.hf_names().1).join(", "), Arch::SUPPORTED);
        // no key, Llama, Mistral: no biases; Qwen2 (by either key): q, k, v biases
        for extra in ["", r#", "model_type": "llama""#, r#", "architectures": ["MistralForCausalLM"]"#] {
            assert!(!parse(extra)?.qkv_bias, "{extra}");
        }
        for extra in [
            r#", "model_type": "qwen2""#,
            r#", "architectures": ["Qwen2ForCausalLM"]"#,
            r#", "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "attention_bias": false"#,
        ] {
            let c = parse(extra)?;
            assert!(c.qkv_bias, "{extra}");
            assert_eq!(c.arch(), Arch::Qwen2);
        }
        // Qwen3 (by either key): q / k head norms, no biases
        for extra in [r#", "model_type": "qwen3", "attention_bias": false"#, r#", "architectures": ["Qwen3ForCausalLM"]"#] {
            let c = parse(extra)?;
            assert!(c.qk_norm && !c.qkv_bias, "{extra}");
            assert_eq!(c.arch(), Arch::Qwen3);
        }
        assert!(!parse("")?.qk_norm);
        assert!(LlamaConfig::tiny(64, 32, 1, 4, 2).with_qk_norm(true).with_qkv_bias(true).validate().is_err());
        // refused by name: other architectures, disagreeing keys, biases the model lacks
        for (extra, want) in [
            (r#", "model_type": "deepseek_vl_v2""#, "model_type `deepseek_vl_v2` not supported"),
            (r#", "architectures": ["DeepseekVLV2ForCausalLM"]"#, "architecture `DeepseekVLV2ForCausalLM` not supported"),
            (r#", "architectures": ["LlamaForSequenceClassification", "LlamaForCausalLM"]"#, "names a classifier and another class"),
            (r#", "architectures": ["LlamaForSequenceClassification"], "id2label": {}"#, "with no label"),
            (r#", "architectures": ["LlamaForQuestionAnswering"]"#, "LlamaForQuestionAnswering"),
            (r#", "model_type": "llama", "architectures": ["Qwen2ForCausalLM"]"#, "model_type `llama` but architectures `Qwen2ForCausalLM`"),
            (r#", "model_type": 3"#, "`model_type` must be a string"),
            (r#", "attention_bias": true"#, "`attention_bias: true` not supported"),
            (r#", "model_type": "qwen2", "mlp_bias": true"#, "`mlp_bias: true` not supported"),
            (r#", "model_type": "qwen3", "attention_bias": true"#, "`attention_bias: true` not supported"),
        ] {
            let e = err(extra);
            assert!(e.contains(want), "{extra}: {e:?}");
        }
        Ok(())
    }

    #[test]
    fn which_layers_slide() -> Result<()> {
        let w = |extra: &str| -> Result<Option<usize>> { Ok(parse(extra)?.sliding_window) };
        // Qwen2: off unless use_sliding_window; then layers >= max_window_layers (default 28)
        assert_eq!(w(r#", "model_type": "qwen2", "sliding_window": 4096"#)?, None);
        assert_eq!(w(r#", "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": true"#)?, None);
        assert_eq!(w(r#", "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": true, "max_window_layers": 0"#)?, Some(64));
        assert_eq!(w(r#", "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": true, "max_window_layers": 2"#)?, None);
        // ... on some layers only: per layer
        let c = parse(r#", "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": true, "max_window_layers": 1"#)?;
        assert_eq!((c.sliding_window, c.sliding_layers.clone()), (Some(64), Some(vec![false, true])));
        assert_eq!((c.layer_window(0), c.layer_window(1)), (None, Some(64)));
        let c = parse(r#", "model_type": "qwen3", "sliding_window": 64, "use_sliding_window": true, "layer_types": ["sliding_attention", "full_attention"]"#)?;
        assert_eq!(c.sliding_layers, Some(vec![true, false]));
        // layer_types without use_sliding_window: Qwen's window is off
        let c = parse(r#", "model_type": "qwen3", "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]"#)?;
        assert_eq!((c.sliding_window, c.sliding_layers), (None, None));
        // Mistral: every layer; layer_types (newer transformers) decide when present
        assert_eq!(w(r#", "model_type": "mistral", "sliding_window": 64"#)?, Some(64));
        assert_eq!(w(r#", "sliding_window": 64, "layer_types": ["full_attention", "full_attention"]"#)?, None);
        assert_eq!(w(r#", "sliding_window": 64, "layer_types": ["sliding_attention", "sliding_attention"]"#)?, Some(64));
        assert_eq!(w(r#", "layer_types": ["sliding_attention", "sliding_attention"]"#)?, None);
        let e = err(r#", "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]"#);
        assert!(e.contains("on 1 of 2 layers") && e.contains("[1]") && e.contains("one window for every layer"), "{e}");
        assert!(err(r#", "layer_types": ["full_attention"]"#).contains("1 entries for 2 layers"));
        assert!(err(r#", "layer_types": ["chunked_attention", "full_attention"]"#).contains("chunked_attention"));
        Ok(())
    }

    /// What `to_hf_json` writes for a Qwen2 or Qwen3 config reads back as the same config,
    /// with the keys transformers' Qwen2Config / Qwen3Config read (Qwen2: no bias keys; Qwen3:
    /// `attention_bias: false`; the window on every layer, or `layer_types` when only some
    /// layers slide).
    #[test]
    fn qwen_round_trip() -> Result<()> {
        for (window, qwen3) in [(None, false), (Some(32), false), (None, true), (Some(32), true)] {
            let c = LlamaConfig::tiny(64, 32, 3, 4, 2).with_qkv_bias(!qwen3).with_qk_norm(qwen3).with_sliding_window(window);
            let text = c.to_hf_json("bfloat16");
            let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            let want = if qwen3 { ("qwen3", "Qwen3ForCausalLM") } else { ("qwen2", "Qwen2ForCausalLM") };
            assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some(want.0), Some(want.1)));
            assert_eq!(v.get("attention_bias").and_then(|b| b.as_bool()), qwen3.then_some(false), "{text}");
            assert!(v.get("mlp_bias").is_none(), "{text}");
            assert_eq!(v["use_sliding_window"].as_bool(), Some(window.is_some()));
            assert_eq!(v["max_window_layers"].as_u64(), Some(if window.is_some() { 0 } else { 3 }));
            assert!(v.get("layer_types").is_none(), "{text}");
            assert_eq!(LlamaConfig::from_json(&text)?, c);
        }
        // some layers slide: layer_types, and max_window_layers where they are the last ones
        for (layers, from) in [(vec![false, true, true], 1), (vec![true, false, true], 0)] {
            for qwen3 in [false, true] {
                let c = LlamaConfig::tiny(64, 32, 3, 4, 2)
                    .with_qkv_bias(!qwen3)
                    .with_qk_norm(qwen3)
                    .with_sliding_window(Some(32))
                    .with_sliding_layers(Some(layers.clone()));
                c.validate()?;
                let text = c.to_hf_json("bfloat16");
                let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                assert_eq!(v["max_window_layers"].as_u64(), Some(from));
                let types: Vec<&str> = v["layer_types"].as_array().into_iter().flatten().filter_map(|t| t.as_str()).collect();
                let want: Vec<&str> = layers.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
                assert_eq!(types, want);
                assert_eq!(LlamaConfig::from_json(&text)?, c);
            }
        }
        Ok(())
    }

    /// `sliding_layers` needs a window, one entry per layer, and a Qwen architecture (a Llama
    /// or Mistral config.json cannot say which layers slide); all `true` is every layer.
    #[test]
    fn sliding_layers_are_checked() {
        let base = LlamaConfig::tiny(64, 32, 3, 4, 2).with_qk_norm(true);
        let msg = |c: LlamaConfig| c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg(base.clone().with_sliding_layers(Some(vec![true, false, true]))).contains("without a sliding_window"));
        let w = base.clone().with_sliding_window(Some(8));
        assert!(msg(w.clone().with_sliding_layers(Some(vec![true, false]))).contains("2 entries for 3 layers"));
        let plain = w.clone().with_qk_norm(false).with_sliding_layers(Some(vec![true, false, true]));
        assert!(msg(plain).contains("Qwen2 or Qwen3"));
        assert_eq!(w.clone().with_sliding_layers(Some(vec![true; 3])).sliding_layers, None);
        let none = w.clone().with_sliding_layers(Some(vec![false; 3]));
        assert_eq!((none.sliding_window, none.sliding_layers), (None, None));
        assert_eq!(w.with_sliding_layers(Some(vec![false, true, false])).layer_window(1), Some(8));
    }
}
