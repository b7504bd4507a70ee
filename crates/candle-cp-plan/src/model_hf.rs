//! [`ModelConfig`] from a Hugging Face `config.json`: the text model of a multimodal config,
//! each architecture's defaults, its mixture of experts and its sliding-window layers.

use super::{MlaShape, ModelConfig, MoeShape};
use crate::{plan_bail, PlanError, Result};

/// The text model's config of a Gemma 3 `config.json` with `Gemma3TextConfig`'s defaults for
/// the shape keys it leaves out: a multimodal one's (`model_type` `gemma3`, as the 4B, 12B and
/// 27B are published) `text_config`, or a `gemma3_text` config itself; other configs as they
/// are.
fn gemma3_text(v: serde_json::Value, name: &str) -> Result<serde_json::Value> {
    let is = |k: &str, t: &str| v.get(k).and_then(|x| x.as_str()) == Some(t);
    let class = |c: &str| v.get("architectures").and_then(|a| a.as_array()).is_some_and(|a| a.iter().any(|x| x.as_str() == Some(c)));
    let mut t = if is("model_type", "gemma3") || class("Gemma3ForConditionalGeneration") {
        match v.get("text_config") {
            Some(serde_json::Value::Object(t)) => {
                let mut t = t.clone();
                t.insert("model_type".into(), "gemma3_text".into());
                t.remove("architectures");
                t
            }
            _ => plan_bail!("model config {name}: a multimodal Gemma 3 config (model_type 'gemma3') without a 'text_config' object"),
        }
    } else if is("model_type", "gemma3_text") || class("Gemma3ForCausalLM") {
        match v {
            serde_json::Value::Object(m) => m,
            _ => return Ok(v),
        }
    } else {
        return Ok(v);
    };
    for (k, d) in [
        ("vocab_size", 262_208),
        ("hidden_size", 2304),
        ("intermediate_size", 9216),
        ("num_hidden_layers", 26),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("head_dim", 256),
    ] {
        t.entry(k).or_insert(d.into());
    }
    Ok(serde_json::Value::Object(t))
}

/// The text model's config of a Mistral 3 `config.json` (`model_type` `mistral3`,
/// `Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2): its `text_config`, a Mistral;
/// other configs as they are.
fn mistral3_text(v: serde_json::Value, name: &str) -> Result<serde_json::Value> {
    let is = v.get("model_type").and_then(|x| x.as_str()) == Some("mistral3")
        || v.get("architectures").and_then(|a| a.as_array()).is_some_and(|a| a.iter().any(|x| x.as_str() == Some("Mistral3ForConditionalGeneration")));
    if !is {
        return Ok(v);
    }
    match v.get("text_config") {
        Some(serde_json::Value::Object(t)) => {
            let mut t = t.clone();
            t.entry("model_type").or_insert("mistral".into());
            t.remove("architectures");
            Ok(serde_json::Value::Object(t))
        }
        _ => plan_bail!("model config {name}: a Mistral 3 config (model_type 'mistral3') without a 'text_config' object"),
    }
}

/// A gpt-oss config (`model_type` `gpt_oss` or `GptOssForCausalLM`) with `GptOssConfig`'s
/// defaults for the shape keys it leaves out (the 120B's); other configs as they are.
fn gpt_oss_defaults(v: serde_json::Value) -> serde_json::Value {
    let is = v.get("model_type").and_then(|x| x.as_str()) == Some("gpt_oss")
        || v.get("architectures").and_then(|a| a.as_array()).is_some_and(|a| a.iter().any(|x| x.as_str() == Some("GptOssForCausalLM")));
    let serde_json::Value::Object(mut t) = v else { return v };
    if is {
        for (k, d) in [
            ("num_hidden_layers", 36),
            ("num_local_experts", 128),
            ("vocab_size", 201_088),
            ("hidden_size", 2880),
            ("intermediate_size", 2880),
            ("head_dim", 64),
            ("num_attention_heads", 64),
            ("num_key_value_heads", 8),
            ("sliding_window", 128),
        ] {
            if t.get(k).is_none_or(|x| x.is_null()) {
                t.insert(k.into(), d.into());
            }
        }
    }
    serde_json::Value::Object(t)
}

/// The mixture-of-experts keys of a `qwen3_moe` config (`Qwen3MoeConfig`'s defaults: 128
/// experts, 8 per token, 768 wide, every layer sparse unless `mlp_only_layers` /
/// `decoder_sparse_step` say otherwise).
fn moe_shape(v: &serde_json::Value, layers: usize, name: &str, qwen2: bool) -> Result<MoeShape> {
    let get = |k: &str, d: usize| -> Result<usize> {
        match v.get(k) {
            None | Some(serde_json::Value::Null) => Ok(d),
            Some(x) => match x.as_u64() {
                Some(n) if n > 0 => Ok(n as usize),
                _ => plan_bail!("model config {name}: '{k}' must be a positive integer, got {x}"),
            },
        }
    };
    // (Qwen2MoeConfig's defaults: 60 experts, 4 per token, 1408 wide, a shared expert 5632)
    let d = if qwen2 { [60, 4, 1408] } else { [128, 8, 768] };
    let (experts, top_k, expert_ffn, step) = (get("num_experts", d[0])?, get("num_experts_per_tok", d[1])?, get("moe_intermediate_size", d[2])?, get("decoder_sparse_step", 1)?);
    let shared_ffn = if qwen2 { get("shared_expert_intermediate_size", 5632)? } else { 0 };
    if top_k > experts {
        plan_bail!("model config {name}: num_experts_per_tok {top_k} > num_experts {experts}")
    }
    let dense: Vec<u64> = v.get("mlp_only_layers").and_then(|x| x.as_array()).map(|a| a.iter().filter_map(|i| i.as_u64()).collect()).unwrap_or_default();
    let sparse_layers = (0..layers).filter(|&i| !dense.contains(&(i as u64)) && (i + 1).is_multiple_of(step)).count();
    let norm_topk = v.get("norm_topk_prob").and_then(|x| x.as_bool()).unwrap_or(false);
    Ok(MoeShape { experts, top_k, expert_ffn, sparse_layers, norm_topk, shared_ffn, sigmoid_router: false, correction_bias: false })
}


/// A reward model's score head from `architectures`: a `*ForSequenceClassification` (no bias)
/// or `*ForTokenClassification` (a bias) class, its labels `id2label`'s entries, else
/// `num_labels`, else transformers' 2; `None` for a causal LM.
fn score_head(v: &serde_json::Value, name: &str) -> Result<Option<crate::model::ScoreHead>> {
    let classes: Vec<&str> = v.get("architectures").and_then(|a| a.as_array()).map(|a| a.iter().filter_map(|c| c.as_str()).collect()).unwrap_or_default();
    let bias = match (classes.iter().any(|c| c.ends_with("ForSequenceClassification")), classes.iter().any(|c| c.ends_with("ForTokenClassification"))) {
        (false, false) => return Ok(None),
        (true, true) => plan_bail!("model config {name}: `architectures` {classes:?} names a sequence and a token classifier"),
        // (a token classifier's head has a bias unless token_classification_bias says false)
        (seq, _) => !seq && v.get("token_classification_bias").and_then(|b| b.as_bool()).unwrap_or(true),
    };
    let labels = match (v.get("id2label"), v.get("num_labels")) {
        (Some(serde_json::Value::Object(o)), _) => o.len(),
        (_, Some(n)) if !n.is_null() => n.as_u64().ok_or_else(|| PlanError(format!("model config {name}: 'num_labels' must be a non-negative integer, got {n}")))? as usize,
        _ => 2,
    };
    if labels == 0 {
        plan_bail!("model config {name}: a classifier with no label")
    }
    Ok(Some(crate::model::ScoreHead { labels, bias }))
}

impl ModelConfig {
    /// Reads a Hugging Face `config.json` (fields `hidden_size`, `num_hidden_layers`,
    /// `num_attention_heads`, `intermediate_size`, `vocab_size`; optional
    /// `num_key_value_heads`, `head_dim`, `tie_word_embeddings`, `sliding_window` (an
    /// integer or null; ignored when `use_sliding_window` is false; 0 is an error)). A Qwen2
    /// config (`model_type` `qwen2` or `Qwen2ForCausalLM`) has q, k, v biases and a window
    /// only with `use_sliding_window: true` on the layers from `max_window_layers` on (the
    /// model's rule, `candle_cp_llama::arch`); `layer_types` (a list of `full_attention` /
    /// `sliding_attention`) says which layers slide when present. A window on some layers
    /// only is [`ModelConfig::partial_window`].
    pub fn from_hf_file(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| PlanError(format!("cannot read model config {}: {e}", path.display())))?;
        Self::from_hf_json(&text, &path.display().to_string())
    }

    /// Parses the text of a Hugging Face `config.json`; `name` labels the result.
    pub fn from_hf_json(text: &str, name: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| PlanError(format!("model config {name} is not valid JSON: {e}")))?;
        let v = gemma3_text(v, name)?;
        let v = mistral3_text(v, name)?;
        let v = gpt_oss_defaults(v);
        let get = |key: &str| -> Result<Option<usize>> {
            match v.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => match x.as_u64() {
                    Some(n) if n > 0 => Ok(Some(n as usize)),
                    _ => plan_bail!(
                        "model config {name}: '{key}' must be a positive integer, got {x}"
                    ),
                },
            }
        };
        let need = |key: &str| -> Result<usize> {
            get(key)?
                .ok_or_else(|| PlanError(format!("model config {name}: missing field '{key}'")))
        };
        let hidden = need("hidden_size")?;
        let layers = need("num_hidden_layers")?;
        let heads = need("num_attention_heads")?;
        let ffn = need("intermediate_size")?;
        let vocab = need("vocab_size")?;
        let kv_heads = get("num_key_value_heads")?.unwrap_or(heads);
        let names = |t: &str, class: &str| {
            v.get("model_type").and_then(|x| x.as_str()) == Some(t)
                || v.get("architectures").and_then(|a| a.as_array()).is_some_and(|a| a.iter().any(|c| c.as_str() == Some(class)))
        };
        // Gemma 3 (text): head dim 256, a tied head and a window of 4096 unless the config says
        // otherwise; the window on all but every `sliding_window_pattern`-th layer (default 6)
        let gemma3 = names("gemma3_text", "Gemma3ForCausalLM");
        // Gemma 2: as Gemma 3's defaults, the window on every other layer from layer 0
        let gemma2 = names("gemma2", "Gemma2ForCausalLM");
        let head_dim = match get("head_dim")? {
            Some(d) => d,
            None if gemma3 || gemma2 => 256,
            None => {
                if hidden % heads != 0 {
                    plan_bail!(
                        "model config {name}: hidden_size {hidden} not divisible by num_attention_heads {heads} and no head_dim given"
                    )
                }
                hidden / heads
            }
        };
        // SmolLM3: a tied head by default, the window (with use_sliding_window) on its NoPE
        // layers, every `no_rope_layer_interval`-th (4) unless `no_rope_layers` lists them
        let smollm3 = names("smollm3", "SmolLM3ForCausalLM");
        let tie_embeddings = v
            .get("tie_word_embeddings")
            .and_then(|x| x.as_bool())
            .unwrap_or(gemma3 || gemma2 || smollm3);
        let qwen3_moe = names("qwen3_moe", "Qwen3MoeForCausalLM");
        let qwen2_moe = names("qwen2_moe", "Qwen2MoeForCausalLM");
        let (qwen2, qwen3) = (names("qwen2", "Qwen2ForCausalLM") || qwen2_moe, names("qwen3", "Qwen3ForCausalLM") || qwen3_moe);
        for other in ["llama4", "granitemoeshared", "granitemoehybrid"] {
            if v.get("model_type").and_then(|x| x.as_str()) == Some(other) {
                plan_bail!("model config {name}: model_type '{other}' (a mixture of experts of another kind) is not planned (qwen3_moe, qwen2_moe, mixtral, gpt_oss, olmoe, granitemoe, glm4_moe, deepseek_v3 and deepseek_v2 are)")
            }
        }
        // DeepSeek-V3: latent attention (DeepseekV3Config's defaults), GLM-4.5's experts with
        // DeepSeek's defaults (256 experts 2048 wide, the first 3 layers dense); DeepSeek-V2: the
        // same attention, its softmax router (no correction bias, never renormalised) over
        // DeepseekV2Config's defaults (64 experts 1407 wide, 2 shared, every layer sparse)
        let deepseek_v2 = names("deepseek_v2", "DeepseekV2ForCausalLM");
        let deepseek = names("deepseek_v3", "DeepseekV3ForCausalLM") || deepseek_v2;
        let mla = match deepseek {
            false => None,
            true => Some(MlaShape {
                // (null: one q_proj)
                q_lora_rank: match v.get("q_lora_rank") {
                    Some(serde_json::Value::Null) => None,
                    _ => Some(get("q_lora_rank")?.unwrap_or(1536)),
                },
                kv_lora_rank: get("kv_lora_rank")?.unwrap_or(512),
                qk_nope_head_dim: get("qk_nope_head_dim")?.unwrap_or(128),
                qk_rope_head_dim: get("qk_rope_head_dim")?.unwrap_or(64),
                v_head_dim: get("v_head_dim")?.unwrap_or(128),
                rope_interleave: deepseek_v2 || v.get("rope_interleave").and_then(|x| x.as_bool()).unwrap_or(true),
            }),
        };
        let (head_dim, kv_heads) = match &mla {
            // (the width on a GPU: DeepSeek's 192 at 256)
            Some(a) => (a.cuda_attn_dim(), heads),
            None => (head_dim, kv_heads),
        };
        let gpt_oss = names("gpt_oss", "GptOssForCausalLM");
        // OLMo 2 (no window) and 3 (4096 keys by default on all but every fourth layer)
        let (olmo2, olmo3) = (names("olmo2", "Olmo2ForCausalLM"), names("olmo3", "Olmo3ForCausalLM"));
        // GLM-4: norms before and after each branch, q, k, v biases unless attention_bias is
        // false, no window (its partial, interleaved RoPE changes no count)
        let glm4 = names("glm4", "Glm4ForCausalLM");
        // GLM (GLM-4-9B-chat-hf): GLM-4's q, k, v biases with a Llama's norms, no window
        let glm = names("glm", "GlmForCausalLM");
        // GLM-4.5: experts from layer 'first_k_dense_replace' (1) on, 'n_routed_experts' (128)
        // 'moe_intermediate_size' (1408) wide, 8 per token, 'n_shared_experts' (1) as wide;
        // q, k, v biases with 'attention_bias' (false), head norms with 'use_qk_norm' (false)
        let glm45 = names("glm4_moe", "Glm4MoeForCausalLM");
        // OLMoE: every layer 'num_experts' (64) experts 'intermediate_size' wide, 8 per token
        let olmoe = names("olmoe", "OlmoeForCausalLM");
        // EXAONE 4: OLMo 2's norms with head norms; the window on all but every
        // 'sliding_window_pattern'-th layer (4, or a string of L and G, the last layer global)
        let exaone4 = names("exaone4", "Exaone4ForCausalLM");
        // Mixtral and GraniteMoE: every MLP 'num_local_experts' experts 'intermediate_size'
        // wide (8, 2 per token by default; GraniteMoE's multipliers change no count)
        let mixtral = names("mixtral", "MixtralForCausalLM") || names("granitemoe", "GraniteMoeForCausalLM");
        let moe = if gpt_oss {
            let experts = get("num_local_experts")?.unwrap_or(128);
            let top_k = get("num_experts_per_tok")?.or(get("experts_per_token")?).unwrap_or(4);
            if top_k > experts {
                plan_bail!("model config {name}: num_experts_per_tok {top_k} > num_local_experts {experts}")
            }
            Some(MoeShape { experts, top_k, expert_ffn: ffn, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false })
        } else if qwen3_moe || qwen2_moe {
            Some(moe_shape(&v, layers, name, qwen2_moe)?)
        } else if olmoe {
            let experts = get("num_experts")?.unwrap_or(64);
            let top_k = get("num_experts_per_tok")?.unwrap_or(8);
            if top_k > experts {
                plan_bail!("model config {name}: num_experts_per_tok {top_k} > num_experts {experts}")
            }
            let norm_topk = v.get("norm_topk_prob").and_then(|x| x.as_bool()).unwrap_or(false);
            Some(MoeShape { experts, top_k, expert_ffn: ffn, sparse_layers: layers, norm_topk, shared_ffn: 0, sigmoid_router: false, correction_bias: false })
        } else if glm45 || deepseek {
            let experts = get("n_routed_experts")?.or(get("num_experts")?).unwrap_or(if deepseek_v2 { 64 } else if deepseek { 256 } else { 128 });
            let top_k = match (get("num_experts_per_tok")?, deepseek_v2) {
                (Some(k), _) => k,
                (None, false) => 8,
                (None, true) => plan_bail!("model config {name}: deepseek_v2 needs 'num_experts_per_tok' (DeepseekV2Config has no default)"),
            };
            let width = get("moe_intermediate_size")?.unwrap_or(if deepseek_v2 { 1407 } else if deepseek { 2048 } else { 1408 });
            // (0: every layer sparse)
            let dense = match v.get("first_k_dense_replace") {
                None | Some(serde_json::Value::Null) => if deepseek_v2 { 0 } else if deepseek { 3 } else { 1 },
                Some(x) => match x.as_u64() {
                    Some(n) => n as usize,
                    None => plan_bail!("model config {name}: 'first_k_dense_replace' must be a non-negative integer, got {x}"),
                },
            };
            if top_k > experts || dense >= layers {
                plan_bail!("model config {name}: num_experts_per_tok {top_k} > n_routed_experts {experts}, or first_k_dense_replace {dense} >= num_hidden_layers {layers}")
            }
            let norm_topk = !deepseek_v2 && v.get("norm_topk_prob").and_then(|x| x.as_bool()).unwrap_or(true);
            let shared_ffn = get("n_shared_experts")?.unwrap_or(if deepseek_v2 { 2 } else { 1 }) * width;
            Some(MoeShape { experts, top_k, expert_ffn: width, sparse_layers: layers - dense, norm_topk, shared_ffn, sigmoid_router: true, correction_bias: !deepseek_v2 })
        } else if mixtral {
            let experts = get("num_local_experts")?.unwrap_or(8);
            let top_k = get("num_experts_per_tok")?.unwrap_or(2);
            if top_k > experts {
                plan_bail!("model config {name}: num_experts_per_tok {top_k} > num_local_experts {experts}")
            }
            Some(MoeShape { experts, top_k, expert_ffn: ffn, sparse_layers: layers, norm_topk: true, shared_ffn: 0, sigmoid_router: false, correction_bias: false })
        } else {
            None
        };
        let use_window = match v.get("use_sliding_window") {
            // Qwen2Config / Qwen3Config: use_sliding_window defaults to false
            None | Some(serde_json::Value::Null) => !(qwen2 || qwen3 || smollm3),
            Some(x) => match x.as_bool() {
                Some(b) => b,
                None => plan_bail!(
                    "model config {name}: 'use_sliding_window' must be true or false, got {x}"
                ),
            },
        };
        let mut sliding_window = match (use_window, v.get("sliding_window")) {
            (_, _) if olmo2 || olmoe || glm4 || glm || glm45 || deepseek => None,
            (true, None) if gemma3 || gemma2 || olmo3 => Some(4096),
            (true, _) => get("sliding_window")?,
            (false, _) => None,
        };
        // which layers slide: layer_types when given, else Qwen's max_window_layers, else all
        let sliding: Vec<bool> = match v.get("layer_types") {
            None | Some(serde_json::Value::Null) if qwen2 || qwen3 => {
                // layer i slides iff i >= max_window_layers (Qwen2Config's default 28)
                let from = match v.get("max_window_layers") {
                    None | Some(serde_json::Value::Null) => 28,
                    Some(x) => match x.as_u64() {
                        Some(n) => n as usize,
                        None => plan_bail!("model config {name}: 'max_window_layers' must be a non-negative integer, got {x}"),
                    },
                };
                (0..layers).map(|i| i >= from).collect()
            }
            None | Some(serde_json::Value::Null) if gemma3 => {
                let p = get("sliding_window_pattern")?.unwrap_or(6);
                (0..layers).map(|i| !(i + 1).is_multiple_of(p)).collect()
            }
            None | Some(serde_json::Value::Null) if gemma2 || gpt_oss => (0..layers).map(|i| i % 2 == 0).collect(),
            None | Some(serde_json::Value::Null) if olmo3 => (0..layers).map(|i| !(i + 1).is_multiple_of(4)).collect(),
            None | Some(serde_json::Value::Null) if exaone4 => match v.get("sliding_window_pattern") {
                Some(serde_json::Value::String(p)) if !p.is_empty() => {
                    let p: Vec<char> = p.chars().collect();
                    (0..layers).map(|i| p[i % p.len()] == 'L' && i + 1 != layers).collect()
                }
                _ => {
                    let every = get("sliding_window_pattern")?.unwrap_or(4);
                    (0..layers).map(|i| !(i + 1).is_multiple_of(every)).collect()
                }
            },
            None | Some(serde_json::Value::Null) if smollm3 => match v.get("no_rope_layers").and_then(|x| x.as_array()) {
                Some(a) => (0..layers).map(|i| a.get(i).and_then(|x| x.as_u64()) == Some(0)).collect(),
                None => {
                    let every = get("no_rope_layer_interval")?.unwrap_or(4);
                    (0..layers).map(|i| (i + 1).is_multiple_of(every)).collect()
                }
            },
            None | Some(serde_json::Value::Null) => vec![true; layers],
            Some(serde_json::Value::Array(a)) if a.len() == layers => {
                let mut out = Vec::with_capacity(layers);
                for t in a {
                    match t.as_str() {
                        Some("sliding_attention") => out.push(true),
                        Some("full_attention") => out.push(false),
                        _ => plan_bail!("model config {name}: 'layer_types' entry {t} not supported (full_attention, sliding_attention)"),
                    }
                }
                out
            }
            Some(x) => plan_bail!("model config {name}: 'layer_types' must be a list of {layers} entries, got {x}"),
        };
        let slides = sliding.iter().filter(|&&s| s).count();
        let mut partial_window = None;
        if let Some(w) = sliding_window {
            if slides == 0 {
                sliding_window = None;
            } else if slides < layers {
                (sliding_window, partial_window) = (None, Some((w, slides)));
            }
        }
        let cfg = Self {
            name: name.to_string(),
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            ffn,
            vocab,
            tie_embeddings,
            sliding_window,
            qkv_bias: qwen2 || gpt_oss || ((glm4 || glm) && v.get("attention_bias").and_then(|x| x.as_bool()).unwrap_or(true)) || (glm45 && v.get("attention_bias").and_then(|x| x.as_bool()).unwrap_or(false)),
            qk_norm: qwen3 || gemma3 || exaone4 || (glm45 && v.get("use_qk_norm").and_then(|x| x.as_bool()).unwrap_or(false)),
            partial_window,
            sandwich_norms: gemma3 || gemma2 || olmo2 || olmo3 || exaone4 || glm4,
            moe,
            fused_proj: names("phi3", "Phi3ForCausalLM"),
            gpt_oss,
            post_norms: olmo2 || olmo3 || exaone4,
            qk_norm_flat: olmo2 || olmo3 || olmoe,
            mla,
            score_head: score_head(&v, name)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
