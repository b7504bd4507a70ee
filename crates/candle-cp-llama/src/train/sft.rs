//! Supervised fine-tuning data: prompt / completion examples (TRL's "prompt-completion"
//! form, one JSON object per line: `{"prompt": "...", "completion": "..."}`), each tokenised
//! into one document whose completion tokens are the loss's targets. The examples are packed
//! into the training sequences ([`PackedStream::from_examples`]: attention and RoPE per
//! document, the CP shards cutting them anywhere) and a run with
//! [`super::TrainConfig::long_range_only`] trains on the completions alone — a long-context
//! SFT run without padding.

use super::PackedStream;
use candle_core::{bail, Result};
use serde_json::Value;

/// The prompt / completion examples of JSON lines `text` (blank lines skipped), each part
/// tokenised by `tokenize` (the prompt, then the completion, apart: the completion's first
/// token starts its own word), `eos` appended to every completion when given (the model then
/// learns to stop). Errors name the line: not a JSON object, `prompt` or `completion` missing or
/// not a string, a tokeniser error.
pub fn read_prompt_completion(text: &str, tokenize: &dyn Fn(&str) -> Result<Vec<u32>>, eos: Option<u32>) -> Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let n = i + 1;
        let v: Value = serde_json::from_str(line).map_err(|e| candle_core::Error::Msg(format!("prompt / completion data, line {n}: {e}")))?;
        let field = |k: &str| -> Result<&str> {
            match v.get(k) {
                Some(Value::String(s)) => Ok(s),
                Some(other) => bail!("prompt / completion data, line {n}: `{k}` must be a string, got {other}"),
                None if v.is_object() => bail!("prompt / completion data, line {n}: no `{k}` (expected {{\"prompt\": ..., \"completion\": ...}})"),
                None => bail!("prompt / completion data, line {n}: expected a JSON object, got {v}"),
            }
        };
        let (p, c) = (field("prompt")?, field("completion")?);
        let wrap = |e: candle_core::Error| candle_core::Error::Msg(format!("prompt / completion data, line {n}: {e}"));
        let prompt = tokenize(p).map_err(wrap)?;
        let mut completion = tokenize(c).map_err(wrap)?;
        completion.extend(eos);
        out.push((prompt, completion));
    }
    if out.is_empty() {
        bail!("prompt / completion data: no example")
    }
    Ok(out)
}

/// [`read_prompt_completion`] packed into a stream ([`PackedStream::from_examples`]).
pub fn prompt_completion_stream(text: &str, tokenize: &dyn Fn(&str) -> Result<Vec<u32>>, eos: Option<u32>) -> Result<PackedStream> {
    PackedStream::from_examples(read_prompt_completion(text, tokenize, eos)?)
}

/// Byte-level tokens of `s` (vocabulary 256), the tokeniser without a tokenizer.json.
pub fn bytes_of(s: &str) -> Result<Vec<u32>> {
    Ok(s.bytes().map(u32::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::Rng;

    /// Examples read and packed: every sample's marks are exactly its completion tokens (and
    /// the EOS appended to each), whatever document it starts in and wherever it is cut;
    /// a held-out split keeps the marks; bad lines are errors naming the line.
    #[test]
    fn completions_are_the_marked_targets() -> Result<()> {
        let text = "{\"prompt\": \"ab\", \"completion\": \"XYZ\"}\n\n{\"prompt\": \"cde\", \"completion\": \"W\", \"id\": 3}\n{\"prompt\": \"\", \"completion\": \"QR\"}\n";
        let ex = read_prompt_completion(text, &bytes_of, Some(1))?;
        assert_eq!(ex.len(), 3);
        assert_eq!(ex[0], (b"ab".iter().map(|&b| b as u32).collect(), vec![88, 89, 90, 1]));
        let s = PackedStream::from_examples(ex)?;
        assert_eq!((s.count(), s.len(), s.target_count(), s.has_targets()), (3, 6 + 5 + 3, 4 + 2 + 3, true));
        let upper = |t: u32| t == 1 || (65..=90).contains(&t);
        for seed in 0..30 {
            let smp = s.sample(9, &mut Rng::new(seed))?;
            for (t, m) in smp.tokens.iter().zip(&smp.long_range) {
                assert_eq!(upper(*t), *m, "seed {seed}: {:?} {:?}", smp.tokens, smp.long_range);
            }
        }
        let tail = s.subset(1..3)?;
        assert_eq!((tail.count(), tail.len(), tail.target_count()), (2, 8, 5));
        assert_eq!(tail.document(0), &[99, 100, 101, 87, 1]);
        assert!(s.subset(2..2).is_err() && s.subset(1..4).is_err());
        // the errors, by line
        for (bad, want) in [
            ("{\"prompt\": \"a\"}", "line 1: no `completion`"),
            ("\n{\"prompt\": 3, \"completion\": \"b\"}", "line 2: `prompt` must be a string"),
            ("[1, 2]", "line 1: expected a JSON object"),
            ("{\"prompt\": \"a\", \"completion\": \"b\"", "line 1:"),
            ("\n\n", "no example"),
        ] {
            let e = read_prompt_completion(bad, &bytes_of, None).unwrap_err().to_string();
            assert!(e.contains(want), "{bad:?}: {e}");
        }
        let fails = |_: &str| -> Result<Vec<u32>> { bail!("no such token") };
        let e = read_prompt_completion("{\"prompt\": \"a\", \"completion\": \"b\"}", &fails, None).unwrap_err().to_string();
        assert!(e.contains("line 1: no such token"), "{e}");
        Ok(())
    }
}
