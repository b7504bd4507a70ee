//! Supervised fine-tuning data: prompt / completion examples and conversations (TRL's
//! "prompt-completion" and "conversational" forms, one JSON object per line:
//! `{"prompt": "...", "completion": "..."}`, `{"messages": [{"role": .., "content": ..}, ..]}`),
//! each tokenised into one document whose completion tokens, or assistant turns rendered
//! through the model's chat template ([`crate::chat`]), are the loss's targets. The examples
//! are packed into the training sequences ([`PackedStream::from_marked`]: attention and RoPE
//! per document, the CP shards cutting them anywhere) and a run with
//! [`super::TrainConfig::long_range_only`] trains on the targets alone — a long-context SFT
//! run without padding.

use super::PackedStream;
use crate::chat::{parse_messages, ChatTemplate, Message};
use candle_core::{bail, Result};
use serde_json::Value;

/// One supervised example: its tokens and, per token, whether it is a target of the loss.
pub type MarkedTokens = (Vec<u32>, Vec<bool>);

/// A tokeniser: the tokens of a text, with the tokenizer's special tokens added (a BOS, as a
/// Hugging Face tokenizer's `add_special_tokens`) when the flag says the text starts a document.
pub type Tokenize<'a> = &'a dyn Fn(&str, bool) -> Result<Vec<u32>>;

/// The supervised examples of JSON lines `text` (blank lines skipped), each line one of TRL's
/// dataset forms:
///
/// - `{"prompt": "...", "completion": "..."}`: the prompt, then the completion, tokenised
///   apart by `tokenize` (the completion's first token starts its own word), `eos` appended
///   to the completion when given (the model then learns to stop); the targets are the
///   completion's tokens.
/// - `{"messages": [{"role": .., "content": ..}, ..]}` (conversational): rendered through
///   `chat` ([`ChatTemplate::render`]) and tokenised whole, each token marked as its segment
///   is; the targets are every assistant turn's content and end-of-turn
///   marker (TRL's `assistant_only_loss`).
/// - `{"prompt": [messages], "completion": [messages]}` (conversational prompt /
///   completion): the two lists as one conversation; the targets are the completion's
///   assistant turns.
///
/// Errors name the line: not a JSON object, a field missing or of the wrong type, a
/// conversation without `chat` or without a trained assistant turn, a template's or the
/// tokeniser's error.
pub fn read_sft(text: &str, tokenize: Tokenize, eos: Option<u32>, chat: Option<ChatTemplate>) -> Result<Vec<MarkedTokens>> {
    let out = json_lines(text, "supervised data", |v| read_line(v, tokenize, eos, chat))?;
    if out.is_empty() {
        bail!("supervised data: no example")
    }
    Ok(out)
}

/// `read` of every non-blank line of JSON lines `text`, parsed; errors (a line that is not
/// JSON, or `read`'s) name `what` and the line.
pub(crate) fn json_lines<T>(text: &str, what: &str, read: impl Fn(&Value) -> Result<T>) -> Result<Vec<T>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let v: Value = serde_json::from_str(line).map_err(|e| candle_core::Error::Msg(format!("{what}, line {}: {e}", i + 1)))?;
            read(&v).map_err(|e| candle_core::Error::Msg(format!("{what}, line {}: {e}", i + 1)))
        })
        .collect()
}

/// One line of [`read_sft`] (errors without the line number).
fn read_line(v: &Value, tokenize: Tokenize, eos: Option<u32>, chat: Option<ChatTemplate>) -> Result<MarkedTokens> {
    if !v.is_object() {
        bail!("expected a JSON object, got {v}")
    }
    match (v.get("messages"), v.get("prompt"), v.get("completion")) {
        (Some(m), None, None) => conversation_tokens(&parse_messages(m, "`messages`")?, 0, tokenize, chat),
        (Some(_), _, _) => bail!("`messages` and `prompt` / `completion` in one example; give one form"),
        (None, Some(p), Some(c)) => completion_tokens(p, c, "completion", tokenize, eos, chat),
        (None, _, _) => {
            let missing = if v.get("prompt").is_none() { "prompt" } else { "completion" };
            bail!("no `{missing}` (expected {{\"prompt\": .., \"completion\": ..}} or {{\"messages\": [..]}})")
        }
    }
}

/// A prompt and its completion (`name`: the completion's field, in errors) as one example:
/// two strings (`prompt ++ completion` tokenised whole with the tokenizer's special tokens, as
/// TRL's SFT and KTO trainers tokenise it; the targets the ids after those the prompt
/// tokenised alone shares with it — a token straddling the boundary a target —, `eos` appended
/// and a target), or two lists of messages (one conversation through `chat`; the completion's
/// assistant turns the targets).
pub(crate) fn completion_tokens(
    prompt: &Value,
    completion: &Value,
    name: &str,
    tokenize: Tokenize,
    eos: Option<u32>,
    chat: Option<ChatTemplate>,
) -> Result<MarkedTokens> {
    match (prompt, completion) {
        (Value::String(p), Value::String(c)) => {
            // (the whole text, as inference continues the prompt: a SentencePiece tokenizer's
            // word-start marker is not put before the completion as tokenising it alone would)
            let prompt = tokenize(p, true)?;
            let mut tokens = tokenize(&format!("{p}{c}"), true)?;
            let split = prompt.iter().zip(&tokens).take_while(|(a, b)| a == b).count();
            tokens.extend(eos);
            let marks = (0..tokens.len()).map(|i| i >= split).collect();
            Ok((tokens, marks))
        }
        (p @ Value::Array(_), c @ Value::Array(_)) => {
            let mut messages = parse_messages(p, "`prompt`")?;
            let first = messages.len();
            messages.extend(parse_messages(c, &format!("`{name}`"))?);
            conversation_tokens(&messages, first, tokenize, chat)
        }
        (p, c) => bail!("`prompt` and `{name}` must both be strings or both lists of messages, got {p} and {c}"),
    }
}

/// A conversation rendered through `chat`; the targets are the assistant turns from message
/// `first_trained` on. The rendered text is tokenised whole, as inference (`generate --chat`)
/// and TRL tokenise it — a SentencePiece tokenizer's word-start marker before each piece
/// between special tokens comes out as there, which tokenising the segments apart would add
/// at every segment's start —, and each token takes the mark of its segment: the tokens of
/// the text up to a segment's end (tokenised alone) that the whole text's ids start with
/// belong to it and the segments before; a token straddling a boundary, to the later segment.
/// Errors without `chat`, or when no turn is trained.
pub(crate) fn conversation_tokens(messages: &[Message], first_trained: usize, tokenize: Tokenize, chat: Option<ChatTemplate>) -> Result<MarkedTokens> {
    let Some(t) = chat else {
        bail!("a conversation needs a chat template (name one, or take the model's own)")
    };
    let segments = t.render(messages, &|i| i >= first_trained, false)?;
    if !segments.iter().any(|(_, target)| *target) {
        bail!("the conversation has no assistant turn to train on")
    }
    let text: String = segments.iter().map(|(s, _)| s.as_str()).collect();
    // (the template writes its own BOS)
    let tokens = tokenize(&text, false)?;
    let mut marks = vec![false; tokens.len()];
    let (mut end, mut done) = (0, 0);
    for (k, (s, target)) in segments.iter().enumerate() {
        end += s.len();
        let upto = match k + 1 == segments.len() {
            true => tokens.len(),
            false => tokenize(&text[..end], false)?.iter().zip(&tokens).take_while(|(a, b)| a == b).count(),
        };
        if upto > done {
            marks[done..upto].iter_mut().for_each(|m| *m = *target);
            done = upto;
        }
    }
    Ok((tokens, marks))
}

/// [`read_sft`] packed into a stream ([`PackedStream::from_marked`]).
pub fn sft_stream(text: &str, tokenize: Tokenize, eos: Option<u32>, chat: Option<ChatTemplate>) -> Result<PackedStream> {
    PackedStream::from_marked(read_sft(text, tokenize, eos, chat)?)
}

/// Byte-level tokens of `s` (vocabulary 256), the tokeniser without a tokenizer.json (no
/// special tokens: the flag is ignored).
pub fn bytes_of(s: &str, _special: bool) -> Result<Vec<u32>> {
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
        let ex = read_sft(text, &bytes_of, Some(1), None)?;
        assert_eq!(ex.len(), 3);
        assert_eq!(ex[0], (vec![97, 98, 88, 89, 90, 1], vec![false, false, true, true, true, true]));
        let s = PackedStream::from_marked(ex)?;
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
            ("\n{\"prompt\": 3, \"completion\": \"b\"}", "line 2: `prompt` and `completion` must both be strings or both lists"),
            ("[1, 2]", "line 1: expected a JSON object"),
            ("{\"prompt\": \"a\", \"completion\": \"b\"", "line 1:"),
            ("\n\n", "no example"),
        ] {
            let e = read_sft(bad, &bytes_of, None, None).unwrap_err().to_string();
            assert!(e.contains(want), "{bad:?}: {e}");
        }
        let fails = |_: &str, _: bool| -> Result<Vec<u32>> { bail!("no such token") };
        let e = read_sft("{\"prompt\": \"a\", \"completion\": \"b\"}", &fails, None, None).unwrap_err().to_string();
        assert!(e.contains("line 1: no such token"), "{e}");
        Ok(())
    }

    /// Conversations (`messages`, and prompt / completion lists of messages) beside plain
    /// examples in one file: the marks are exactly the trained assistant turns' contents and
    /// end-of-turn markers, through every family's template; no EOS added to a conversation;
    /// the errors name the line.
    #[test]
    fn conversations_train_on_the_assistant_turns() -> Result<()> {
        let text = concat!(
            r#"{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "u2"}, {"role": "assistant", "content": "A2"}]}"#,
            "\n",
            r#"{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "u2"}], "completion": [{"role": "assistant", "content": "A2"}]}"#,
            "\n",
            r#"{"prompt": "p", "completion": "C"}"#,
        );
        let text_of = |ids: &[u32]| String::from_utf8(ids.iter().map(|&t| t as u8).collect()).map_err(|e| candle_core::Error::Msg(e.to_string()));
        for (_, t) in crate::chat::CHAT_TEMPLATES {
            let ex = read_sft(text, &bytes_of, Some(7), Some(t))?;
            let eot = t.end_of_turn();
            let marked = |(ids, marks): &MarkedTokens| -> Result<String> {
                let kept: Vec<u32> = ids.iter().zip(marks).filter(|(_, m)| **m).map(|(i, _)| *i).collect();
                text_of(&kept)
            };
            // (Mistral V1 / V3 put a space before each answer)
            let sp = if matches!(t, ChatTemplate::MistralV1 | ChatTemplate::MistralV3) { " " } else { "" };
            // (GLM: the newline after the marker, the last answer ended by <|endoftext|>)
            let (sp, last) = if matches!(t, ChatTemplate::Glm4 | ChatTemplate::Glm45) { ("\n", "<|endoftext|>") } else { (sp, eot) };
            // (Qwen3: each answer's think block a target, but Thinking-2507's `<think>\n`)
            let sp = match t {
                ChatTemplate::Qwen3 => "<think>\n\n</think>\n\n",
                ChatTemplate::Qwen3Thinking => "\n</think>\n\n",
                _ => sp,
            };
            // (harmony: an answer before the last ends with <|end|>)
            let mid = if t == ChatTemplate::Harmony { "<|end|>" } else { eot };
            assert_eq!(marked(&ex[0])?, format!("{sp}A1{mid}{sp}A2{last}"), "{}", t.name());
            assert_eq!(marked(&ex[1])?, format!("{sp}A2{last}"), "{}", t.name());
            assert_eq!(ex[2], (vec![112, 67, 7], vec![false, true, true]));
            // the whole text is the template's, with no EOS appended
            let m = crate::chat::parse_messages(&serde_json::from_str::<Value>(text.lines().next().unwrap_or_default()).map_err(|e| candle_core::Error::Msg(e.to_string()))?["messages"], "m")?;
            assert_eq!(text_of(&ex[0].0)?, t.render_text(&m, false)?, "{}", t.name());
            assert_eq!(ex[0].0, ex[1].0, "{}: the two forms render the same text", t.name());
            let s = sft_stream(text, &bytes_of, Some(7), Some(t))?;
            assert_eq!((s.count(), s.target_count()), (3, 3 * (sp.len() + 2) + mid.len() + 2 * last.len() + 2), "{}", t.name());
        }
        for (bad, chat, want) in [
            (r#"{"messages": [{"role": "user", "content": "u"}]}"#, Some(ChatTemplate::ChatMl), "line 1: the conversation has no assistant turn"),
            (r#"{"prompt": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "completion": []}"#, Some(ChatTemplate::ChatMl), "no assistant turn"),
            (r#"{"messages": [{"role": "assistant", "content": "a"}]}"#, None, "line 1: a conversation needs a chat template"),
            (r#"{"messages": [], "prompt": "p"}"#, Some(ChatTemplate::ChatMl), "give one form"),
            (r#"{"prompt": "p", "completion": [{"role": "assistant", "content": "a"}]}"#, Some(ChatTemplate::ChatMl), "must both be strings or both lists"),
            (r#"{"messages": [{"role": "bot", "content": "a"}]}"#, Some(ChatTemplate::ChatMl), "has role \"bot\""),
            (r#"{"messages": [{"role": "user"}]}"#, Some(ChatTemplate::ChatMl), "`messages`[0]: no `content`"),
            (r#"{"text": "t"}"#, None, "line 1: no `prompt`"),
        ] {
            let e = read_sft(bad, &bytes_of, None, chat).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
        Ok(())
    }
}
