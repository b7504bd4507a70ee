//! A model directory's chat template: its Jinja source found in the files transformers
//! reads, and the family [`ChatTemplate::detect`] recognises in it.

use crate::chat::{names, ChatTemplate};
use candle_core::{bail, Result};
use serde_json::Value;
use std::path::Path;

impl ChatTemplate {
    /// The template of the model in `dir`: its Jinja source from `chat_template.jinja`, else
    /// `chat_template.json`'s or `tokenizer_config.json`'s `chat_template` (a string, or a
    /// list of `{name, template}` whose `default` one is taken), recognised by
    /// [`ChatTemplate::detect`]. Errors name the file, or say that the directory has no
    /// template or one of an unknown family (pass a name instead).
    pub fn of_model_dir(dir: &Path) -> Result<Self> {
        let (src, jinja) = template_source(dir)?;
        match Self::detect(&jinja) {
            // (Tulu 3's form writes `eos_token`: Llama 3.1's, or another model's of the form)
            Some(Self::Tulu) => match eos_token(dir) {
                Some(e) if e != Self::Tulu.end_of_turn() => bail!(
                    "the chat template of {src} is Tulu 3's form, but the tokenizer's EOS is {e:?}, not Llama-3.1-Tulu-3's {:?}: candle-cp's tulu template writes the latter",
                    Self::Tulu.end_of_turn()
                ),
                _ => Ok(Self::Tulu),
            },
            Some(t) => Ok(t),
            None if jinja.contains("[INST]") => bail!(
                "the chat template of {src} is a Mistral [INST] template of none of the known forms (Mistral's first template, or Nemo's `[INST]` without a space); name one of mistral-v1, mistral-v3 or mistral-v7 if the model was tuned on it"
            ),
            None => bail!(
                "the chat template of {} is of a family candle-cp does not know (none of its markers); name one of {} instead",
                src,
                names()
            ),
        }
    }
}

/// `tokenizer_config.json`'s `eos_token` in `dir` (a string, or an added token's `content`),
/// if it says one.
fn eos_token(dir: &Path) -> Option<String> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?).ok()?;
    match v.get("eos_token")? {
        Value::String(s) => Some(s.clone()),
        t => t.get("content").and_then(Value::as_str).map(str::to_string),
    }
}

/// The Jinja source of the chat template in `dir` and the file it came from.
fn template_source(dir: &Path) -> Result<(String, String)> {
    let jinja = dir.join("chat_template.jinja");
    if let Ok(s) = std::fs::read_to_string(&jinja) {
        return Ok((jinja.display().to_string(), s));
    }
    for name in ["chat_template.json", "tokenizer_config.json"] {
        let path = dir.join(name);
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
        match v.get("chat_template") {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => return Ok((path.display().to_string(), s.clone())),
            Some(Value::Array(list)) => {
                let default = list.iter().find(|t| t.get("name").and_then(Value::as_str) == Some("default"));
                match default.and_then(|t| t.get("template")).and_then(Value::as_str) {
                    Some(s) => return Ok((path.display().to_string(), s.to_string())),
                    None => bail!("{}: chat_template is a list without a `default` {{name, template}} entry", path.display()),
                }
            }
            Some(other) => bail!("{}: chat_template must be a string or a list of {{name, template}}, got {other}", path.display()),
        }
    }
    bail!(
        "{} has no chat template (chat_template.jinja, or `chat_template` in chat_template.json / tokenizer_config.json); name one of {}",
        dir.display(),
        names()
    )
}

