//! What a Hugging Face model directory holds beside its weights and `config.json`: the
//! tokenizer, the generation defaults, the chat template. A checkpoint written from a model
//! (the trainer's full checkpoints, `candle-cp merge-lora`) carries them over from the
//! directory the model came from, so that it loads in transformers / a serving stack as the
//! original did, and its `config.json` keeps the original's special token ids
//! ([`crate::LlamaConfig`] holds `bos_token_id` / `eos_token_id`, not `pad_token_id`) and
//! `model_type` where the original's is an alias of the same architecture (Kimi K2's
//! `kimi_k2` for `deepseek_v3`). [`stop_tokens`] reads a directory's end-of-sequence ids.

use candle_core::{bail, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// The files [`carry_model_files`] copies when the source has them: tokenizers (fast, and
/// SentencePiece / BPE / tiktoken sources), their configs, the chat template, the generation
/// defaults.
pub const MODEL_SIDE_FILES: [&str; 12] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
];

/// `config.json` keys [`carry_model_files`] copies into the written config when it lacks them
/// (or holds `null`): [`crate::LlamaConfig`] keeps the first two, not `pad_token_id`.
pub const CONFIG_TOKEN_KEYS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

/// `model_type` values that name the same architecture as the one the writer writes
/// (`(alias, written)`): the alias is kept when the source has it.
pub const MODEL_TYPE_ALIASES: [(&str, &str); 1] = [("kimi_k2", "deepseek_v3")];

/// Carry `from`'s side files ([`MODEL_SIDE_FILES`]) into `to` (those `to` does not hold yet),
/// and into `to/config.json` (when both directories have one) `from`'s special token ids
/// ([`CONFIG_TOKEN_KEYS`], those the written config lacks or holds as `null`) and its `model_type` when it is an
/// alias of the written one ([`MODEL_TYPE_ALIASES`]). Returns the names of what was carried
/// (files, then `config.json:key`). Errors name the file that could not be read or written.
pub fn carry_model_files(from: &Path, to: &Path) -> Result<Vec<String>> {
    let io = |what: &str, p: &Path, e: std::io::Error| candle_core::Error::Msg(format!("carrying model files: {what} {}: {e}", p.display()));
    let mut carried = Vec::new();
    if from == to {
        return Ok(carried);
    }
    for name in MODEL_SIDE_FILES {
        let (src, dst) = (from.join(name), to.join(name));
        if src.is_file() && !dst.exists() {
            std::fs::copy(&src, &dst).map_err(|e| io("copying", &src, e))?;
            carried.push(name.to_string());
        }
    }
    let (src, dst) = (from.join("config.json"), to.join("config.json"));
    if !(src.is_file() && dst.is_file()) {
        return Ok(carried);
    }
    let read = |p: &Path| -> Result<Map<String, Value>> {
        let text = std::fs::read_to_string(p).map_err(|e| io("reading", p, e))?;
        match serde_json::from_str(&text) {
            Ok(Value::Object(m)) => Ok(m),
            Ok(_) => bail!("carrying model files: {} is not a JSON object", p.display()),
            Err(e) => bail!("carrying model files: {}: {e}", p.display()),
        }
    };
    let (theirs, mut ours) = (read(&src)?, read(&dst)?);
    for key in CONFIG_TOKEN_KEYS {
        match theirs.get(key) {
            Some(v) if !v.is_null() && ours.get(key).is_none_or(Value::is_null) => {
                ours.insert(key.to_string(), v.clone());
                carried.push(format!("config.json:{key}"));
            }
            _ => {}
        }
    }
    let alias = MODEL_TYPE_ALIASES.iter().find(|(alias, written)| {
        theirs.get("model_type").and_then(Value::as_str) == Some(alias) && ours.get("model_type").and_then(Value::as_str) == Some(written)
    });
    if let Some((alias, _)) = alias {
        ours.insert("model_type".into(), Value::String(alias.to_string()));
        carried.push("config.json:model_type".into());
    }
    if carried.iter().any(|c| c.starts_with("config.json:")) {
        let text = serde_json::to_string_pretty(&Value::Object(ours)).map_err(|e| candle_core::Error::Msg(format!("carrying model files: {e}")))?;
        crate::hf::write_atomic(&dst, text.as_bytes())?;
    }
    Ok(carried)
}

/// Copy `tokenizer` (a `tokenizer.json`) into `to` as `tokenizer.json` unless `to` holds one
/// already (carried from the model's directory). Returns whether it was copied; errors name the
/// file.
pub fn write_tokenizer(tokenizer: &Path, to: &Path) -> Result<bool> {
    let dst = to.join("tokenizer.json");
    if dst.exists() {
        return Ok(false);
    }
    std::fs::copy(tokenizer, &dst).map_err(|e| candle_core::Error::Msg(format!("copying the tokenizer {} into {}: {e}", tokenizer.display(), to.display())))?;
    Ok(true)
}

/// The end-of-sequence ids of the checkpoint in `dir`, for [`crate::Llama::generate_until`]:
/// `eos_token_id` (one id or a list) of its `generation_config.json` if it has one (what
/// transformers' `generate` stops at), else of its `config.json`; empty when neither names one.
/// Errors name the file and the value when it is not an id or a list of ids.
pub fn stop_tokens(dir: &std::path::Path) -> Result<Vec<u32>> {
    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
        let ids = match v.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::Array(a)) => a.iter().map(|x| x.as_u64()).collect::<Option<Vec<_>>>(),
            Some(x) => x.as_u64().map(|x| vec![x]),
        };
        match ids {
            Some(ids) if ids.iter().all(|&x| x <= u32::MAX as u64) => return Ok(ids.into_iter().map(|x| x as u32).collect()),
            _ => bail!("{}: eos_token_id {} is not a token id or a list of them", path.display(), v["eos_token_id"]),
        }
    }
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Side files copied (not over the destination's own), token ids and an alias `model_type`
    /// carried into the written config, nothing else of the source's config; a directory
    /// carried onto itself is left as it is; an unreadable config is an error naming it.
    #[test]
    fn carries_tokenizer_generation_config_and_token_ids() -> Result<()> {
        let root = std::env::temp_dir().join(format!("candle-cp-carry-{}", std::process::id()));
        let (from, to) = (root.join("from"), root.join("to"));
        std::fs::create_dir_all(&from)?;
        std::fs::create_dir_all(&to)?;
        std::fs::write(from.join("tokenizer.json"), "{\"tok\": 1}")?;
        std::fs::write(from.join("generation_config.json"), "{\"eos_token_id\": 7}")?;
        std::fs::write(from.join("chat_template.jinja"), "theirs")?;
        std::fs::write(to.join("chat_template.jinja"), "ours")?;
        std::fs::write(from.join("model.safetensors"), "weights")?;
        std::fs::write(
            from.join("config.json"),
            r#"{"model_type": "kimi_k2", "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": null, "auto_map": {"AutoConfig": "x"}, "hidden_size": 8}"#,
        )?;
        std::fs::write(to.join("config.json"), r#"{"model_type": "deepseek_v3", "hidden_size": 16}"#)?;
        let got = carry_model_files(&from, &to)?;
        assert_eq!(got, ["tokenizer.json", "generation_config.json", "config.json:bos_token_id", "config.json:eos_token_id", "config.json:model_type"]);
        assert_eq!(std::fs::read_to_string(to.join("chat_template.jinja"))?, "ours");
        assert!(!to.join("model.safetensors").exists());
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(to.join("config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!((cfg["model_type"].as_str(), cfg["hidden_size"].as_u64(), cfg["bos_token_id"].as_u64()), (Some("kimi_k2"), Some(16), Some(1)));
        assert_eq!(cfg["eos_token_id"], serde_json::json!([2, 3]));
        assert!(cfg.get("pad_token_id").is_none() && cfg.get("auto_map").is_none());
        // once more: nothing left to carry; onto itself: nothing
        assert!(carry_model_files(&from, &to)?.is_empty());
        assert!(carry_model_files(&from, &from)?.is_empty());
        std::fs::write(from.join("config.json"), "[1]")?;
        std::fs::write(to.join("config.json"), "{}")?;
        let e = carry_model_files(&from, &to).unwrap_err().to_string();
        assert!(e.contains("not a JSON object") && e.contains("config.json"), "{e}");
        std::fs::remove_dir_all(&root)?;
        Ok(())
    }

    /// The checkpoint's end-of-sequence ids: generation_config.json's first (one id or a list),
    /// then config.json's; none; a value that is not an id is an error naming the file.
    #[test]
    fn stop_tokens_of_a_checkpoint() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("candle-cp-stop-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        assert!(stop_tokens(&dir)?.is_empty());
        std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 2}"#)?;
        assert_eq!(stop_tokens(&dir)?, vec![2]);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [128001, 128008, 128009]}"#)?;
        assert_eq!(stop_tokens(&dir)?, vec![128001, 128008, 128009]);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": null}"#)?;
        assert_eq!(stop_tokens(&dir)?, vec![2]);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": "</s>"}"#)?;
        let e = stop_tokens(&dir).unwrap_err().to_string();
        assert!(e.contains("generation_config.json") && e.contains("</s>"), "{e}");
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
