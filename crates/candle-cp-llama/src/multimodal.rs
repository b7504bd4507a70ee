//! The text model of a multimodal checkpoint: Mistral 3 (`model_type` `mistral3`,
//! `Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2, a Mistral text model beside a
//! Pixtral vision tower) reads as its `text_config`, a Mistral; its tensors under
//! `language_model.*` or `model.language_model.*` (transformers 4.52 on, the head then the
//! top-level `lm_head.weight`) read as the causal LM's, the vision tower and projector left
//! unread (`hf.rs`). Gemma 3's multimodal config is `gemma::text_config`'s. Saved, the text
//! model is a causal LM checkpoint (`MistralForCausalLM` with a window, else `LlamaForCausalLM`:
//! the same parameters).

use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// Mistral 3's text model's config: its `text_config` (`model_type` `mistral` where it names
/// none, `tie_word_embeddings` the top level's where it says none); `None` for another config.
/// Errors for a Mistral 3 config without a `text_config` object.
pub(crate) fn text_config(m: &Map<String, Value>) -> Result<Option<Map<String, Value>>> {
    let classes: Vec<&str> = m.get("architectures").and_then(|a| a.as_array()).map(|a| a.iter().filter_map(|c| c.as_str()).collect()).unwrap_or_default();
    if m.get("model_type").and_then(|v| v.as_str()) != Some("mistral3") && !classes.contains(&"Mistral3ForConditionalGeneration") {
        return Ok(None);
    }
    let Some(Value::Object(t)) = m.get("text_config") else {
        bail!("config.json: a Mistral 3 config (model_type `mistral3`) without a `text_config` object")
    };
    let mut t = t.clone();
    t.remove("architectures");
    if t.get("model_type").is_none_or(|v| v.is_null()) {
        t.insert("model_type".into(), json!("mistral"));
    }
    if let (None, Some(tie)) = (t.get("tie_word_embeddings"), m.get("tie_word_embeddings")) {
        t.insert("tie_word_embeddings".into(), tie.clone());
    }
    Ok(Some(t))
}

#[cfg(test)]
mod tests {
    use crate::{Arch, LlamaConfig};

    /// Mistral Small 3.1's config.json (its text_config as published, the vision config cut
    /// short) reads as its Mistral text model; a Mistral 3 config without a text_config is
    /// refused by name.
    #[test]
    fn mistral_small_3_1() -> candle_core::Result<()> {
        let c = LlamaConfig::from_json(
            r#"{"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 10,
            "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": null, "vocab_size": 131072},
            "vision_config": {"model_type": "pixtral", "hidden_size": 1024}, "tie_word_embeddings": false}"#,
        )?;
        // (a Mistral without a window is a Llama here: LlamaForCausalLM when saved, the same model)
        assert_eq!((c.arch(), c.hidden_size, c.num_hidden_layers, c.head_dim, c.num_key_value_heads), (Arch::Llama, 5120, 40, 128, 8));
        assert_eq!((c.vocab_size, c.rope_theta, c.sliding_window, c.tie_word_embeddings), (131072, 1e9, None, false));
        let e = LlamaConfig::from_json(r#"{"model_type": "mistral3", "vision_config": {}}"#).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("without a `text_config`"), "{e}");
        Ok(())
    }
}
