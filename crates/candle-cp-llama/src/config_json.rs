//! [`LlamaConfig::to_hf_json`]: a config written back as Hugging Face `config.json` text, of
//! the architecture it is ([`LlamaConfig::arch`]).

use super::*;

impl LlamaConfig {
    /// HF `config.json` text (both RoPE spellings), for `dtype` in `"float32"` /
    /// `"bfloat16"` / `"float16"`, of the architecture [`LlamaConfig::arch`] names.
    /// `sliding_window` is always written (`null` when `None`); with a window and no biases
    /// the architecture is `MistralForCausalLM` (`model_type` `"mistral"`: the same
    /// parameters, and transformers applies the window), since `LlamaForCausalLM` would
    /// ignore it. With q, k, v biases it is `Qwen2ForCausalLM` (with q, k norms
    /// `Qwen3ForCausalLM`), the window (if any) on every layer (`use_sliding_window`,
    /// `max_window_layers: 0`) or on [`LlamaConfig::sliding_layers`] (`layer_types`, and
    /// `max_window_layers` the first sliding layer).
    pub fn to_hf_json(&self, dtype: &str) -> String {
        // `rope_parameters` (transformers >= 5) plus the legacy top-level `rope_theta` and, only
        // when scaled, `rope_scaling` holding the same object (transformers 4 reads it; 5 treats
        // it as an alias of `rope_parameters`, so the two must agree and a `null` must not be
        // written).
        let mut rope = Map::new();
        rope.insert("rope_theta".into(), json!(self.rope_theta));
        match &self.rope_scaling {
            RopeScaling::Default => {
                rope.insert("rope_type".into(), json!("default"));
            }
            RopeScaling::Linear { factor } => {
                rope.insert("rope_type".into(), json!("linear"));
                rope.insert("factor".into(), json!(factor));
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                rope.insert("rope_type".into(), json!("llama3"));
                rope.insert("factor".into(), json!(factor));
                rope.insert("low_freq_factor".into(), json!(low_freq_factor));
                rope.insert("high_freq_factor".into(), json!(high_freq_factor));
                rope.insert(
                    "original_max_position_embeddings".into(),
                    json!(original_max_position_embeddings),
                );
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                rope.insert("rope_type".into(), json!("yarn"));
                rope.insert("factor".into(), json!(factor));
                rope.insert("original_max_position_embeddings".into(), json!(original_max_position_embeddings));
                rope.insert("beta_fast".into(), json!(beta_fast));
                rope.insert("beta_slow".into(), json!(beta_slow));
                for (k, v) in [("attention_factor", attention_factor), ("mscale", mscale), ("mscale_all_dim", mscale_all_dim)] {
                    if let Some(v) = v {
                        rope.insert(k.into(), json!(v));
                    }
                }
                if !truncate {
                    rope.insert("truncate".into(), json!(false));
                }
            }
            RopeScaling::LongRope { .. } => phi3::write_longrope(&mut rope, &self.rope_scaling, self.max_position_embeddings),
        }
        let (arch, model_type) = (self.hf_class(), self.arch().hf_names().1);
        let v = json!({
            "architectures": [arch],
            "model_type": model_type,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "mlp_bias": false,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": Value::Object(rope.clone()),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "sliding_window": self.sliding_window,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": true,
            "torch_dtype": dtype,
            "dtype": dtype,
        });
        let mut v = v;
        if let Some(m) = v.as_object_mut() {
            // a reward model: transformers' labels of its score head
            if let Some(n) = self.num_labels {
                m.insert("id2label".into(), Value::Object((0..n).map(|i| (i.to_string(), json!(format!("LABEL_{i}")))).collect()));
                m.insert("label2id".into(), Value::Object((0..n).map(|i| (format!("LABEL_{i}"), json!(i))).collect()));
            }
            // (a token classifier's dropout on the head's input)
            if let Some(t) = &self.token_classifier {
                m.insert("classifier_dropout".into(), json!(t.dropout));
                if !t.bias {
                    m.insert("token_classification_bias".into(), json!(false));
                }
            }
            if self.rope_scaling != RopeScaling::Default {
                m.insert("rope_scaling".into(), Value::Object(rope));
            }
            if let Some(g) = &self.gemma3 {
                gemma::write(m, self, g);
            }
            if let Some(g) = &self.gemma2 {
                gemma2::write(m, self, g);
            }
            if let Some(moe) = &self.moe {
                match moe.style {
                    MoeStyle::Glm4Moe | MoeStyle::DeepseekV2 => glm4_moe::write(m, self, moe),
                    _ => qwen3_moe::write(m, moe),
                }
            }
            if let Some(a) = &self.mla {
                deepseek::write(m, a, self.moe.as_ref());
            }
            if self.phi3 {
                phi3::write(m, self);
            }
            if self.gpt_oss {
                gpt_oss::write(m, self);
            }
            if let Some(n) = self.nope_layers.as_ref().filter(|_| !self.exaone4) {
                smollm3::write(m, self, n);
            }
            if self.exaone4 {
                exaone4::write(m, self);
            }
            if self.glm.is_some() {
                glm4::write(m, self);
            }
            if let Some(g) = &self.granite {
                granite::write(m, g);
            }
            if let Some(o) = self.olmo {
                olmo::write(m, self, o);
            }
            if matches!(self.arch(), Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe) {
                // Qwen2Config has no bias keys (q, k, v always biased), Qwen3Config no mlp_bias
                // (attention_bias false); the window on every layer
                if matches!(self.arch(), Arch::Qwen2 | Arch::Qwen2Moe) {
                    m.remove("attention_bias");
                }
                m.remove("mlp_bias");
                // (the first sliding layer: exact when the sliding layers are the last ones, as
                // transformers builds `layer_types` without the key; written when only some slide)
                m.insert("use_sliding_window".into(), json!(self.sliding_window.is_some()));
                let n = self.num_hidden_layers;
                let from = match (&self.sliding_layers, self.sliding_window) {
                    (_, None) => n,
                    (None, Some(_)) => 0,
                    (Some(l), Some(_)) => {
                        let types: Vec<&str> =
                            l.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
                        m.insert("layer_types".into(), json!(types));
                        l.iter().position(|&s| s).unwrap_or(n)
                    }
                };
                m.insert("max_window_layers".into(), json!(from));
            }
        }
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }
}
