//! Conversations through a Hugging Face tokenizer: each chat template's markers are the
//! tokenizer's special tokens, one id each, recognised inside the rendered text as the
//! trainer and `generate --chat` encode it (`encode(text, false)`: the template writes its own
//! BOS); the supervised marks are exactly the assistant turns' ids and end-of-turn ids. A
//! prompt / completion pair's prompt gets the tokenizer's BOS, its completion none.

use anyhow::{anyhow, Result};
use candle_cp_llama::chat::{ChatTemplate, Message, CHAT_TEMPLATES};
use candle_cp_llama::train::sft::read_sft;
use tokenizers::Tokenizer;

/// Every template's markers (the special tokens of the families' tokenizers).
const MARKERS: [&str; 38] = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>",
    "<bos>", "<start_of_turn>", "<end_of_turn>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>",
    "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>",
    "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<s>", "</s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]",
    "[gMASK]", "<sop>", "<think>", "</think>",
    "[|system|]", "[|user|]", "[|assistant|]", "[|endofturn|]",
    "<|start|>", "<|message|>", "<|channel|>", "<|return|>",
];

/// Gemma's `<bos>`, [`MARKERS`]' id 6: the BOS the tokenizer adds with its special tokens.
const BOS: u32 = 6;

/// A character-level tokenizer (printable ASCII and `\n`, one id per character) whose added
/// special tokens are [`MARKERS`] and DeepSeek's end of sentence, ids 0.. in order, and which
/// adds [`BOS`] before a text encoded with special tokens. `legacy`: with the normalizer of
/// Llama 2's SentencePiece tokenizers (Phi-3's, Mistral 7B's): spaces as `▁` and a `▁` put
/// before each piece of text between special tokens.
fn tokenizer(legacy: bool) -> Result<Tokenizer> {
    let mut specials: Vec<&str> = MARKERS.to_vec();
    specials.push("<｜end▁of▁sentence｜>");
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let mut vocab = serde_json::Map::new();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert(s.to_string(), i.into());
    }
    vocab.insert("<unk>".into(), specials.len().into());
    for c in (b' '..=b'~').chain([b'\n']) {
        let id = vocab.len();
        vocab.insert((c as char).to_string(), id.into());
    }
    let id = vocab.len();
    vocab.insert("\u{2581}".into(), id.into());
    let normalizer = match legacy {
        true => serde_json::json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]}),
        false => serde_json::Value::Null,
    };
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(?s)."}, "behavior": "Isolated", "invert": false},
        // a BOS before every encoded text with special tokens, as Llama's and Gemma's tokenizers
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [BOS], "tokens": ["<bos>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    Tokenizer::from_bytes(serde_json::to_vec(&json)?).map_err(|e| anyhow!("{e}"))
}

#[test]
fn templates_tokenise_their_markers_as_special_tokens() -> Result<()> {
    for legacy in [false, true] {
        check_templates(legacy)?;
    }
    Ok(())
}

/// The checks of [`templates_tokenise_their_markers_as_special_tokens`] through
/// [`tokenizer`]`(legacy)`.
fn check_templates(legacy: bool) -> Result<()> {
    let tok = tokenizer(legacy)?;
    let encode = |s: &str, special: bool| -> candle_core::Result<Vec<u32>> { tok.encode(s, special).map(|e| e.get_ids().to_vec()).map_err(|e| candle_core::Error::Msg(e.to_string())) };
    let text = |s: &str| encode(s, false);
    let unk = MARKERS.len() as u32 + 1;
    let line = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name?"}, {"role": "assistant", "content": "Bob"}]}"#;
    for (_, t) in CHAT_TEMPLATES {
        // the end-of-turn marker is one token: generate --chat's stop token
        let eot = text(t.end_of_turn())?;
        assert!(eot.len() == 1 && eot[0] < unk, "{}: {eot:?}", t.name());
        let ex = read_sft(line, &encode, None, Some(t))?;
        let (ids, marks) = &ex[0];
        assert!(!ids.contains(&unk), "{}: an unknown token in {ids:?}", t.name());
        // the whole rendered text's ids, as generation encodes it
        let m: Vec<Message> = ["system:Be brief.", "user:Hi?", "assistant:Hello.", "user:Name?", "assistant:Bob"]
            .iter()
            .map(|s| s.split_once(':').map(|(r, c)| Message::new(r, c)).ok_or_else(|| anyhow!("turn")))
            .collect::<Result<_>>()?;
        assert_eq!(ids, &text(&t.render_text(&m, false)?)?, "{}", t.name());
        // the marked ids spell the assistant turns, each ended by its end-of-turn id
        let marked: String = ids.iter().zip(marks).filter(|(_, m)| **m).filter_map(|(i, _)| tok.id_to_token(*i)).collect();
        // (spaces and markers left out: Mistral V1 / V3's answers start with a space, a `▁` with the normalizer)
        let spelled = |s: &str| s.replace([' ', '\u{2581}'], "");
        let want = match t {
            // (GLM: the newline after the marker, the last answer ended by <|endoftext|>)
            ChatTemplate::Glm4 | ChatTemplate::Glm45 => "\nHello.<|user|>\nBob<|endoftext|>".to_string(),
            ChatTemplate::Harmony => "Hello.<|end|>Bob<|return|>".to_string(),
            // (Qwen3: each answer's think block; Thinking-2507's opened in the prompt)
            ChatTemplate::Qwen3 => "<think>\n\n</think>\n\nHello.<|im_end|><think>\n\n</think>\n\nBob<|im_end|>".to_string(),
            ChatTemplate::Qwen3Thinking => "\n</think>\n\nHello.<|im_end|>\n</think>\n\nBob<|im_end|>".to_string(),
            _ => format!("Hello.{0}Bob{0}", t.end_of_turn()),
        };
        assert_eq!(spelled(&marked), spelled(&want), "{} (legacy {legacy})", t.name());
        if legacy && t == ChatTemplate::Phi3 {
            // (the segments tokenised apart would put a marker before each: not the text's ids)
            let apart: Vec<u32> = t.render(&m, &|_| true, false)?.iter().map(|(s, _)| text(s)).collect::<candle_core::Result<Vec<_>>>()?.concat();
            assert_ne!(&apart, ids);
        }
        // every special token of the text is one id below the characters'
        let specials = ids.iter().filter(|&&i| i < unk).count();
        assert!(specials >= 4, "{}: {specials} special ids in {ids:?}", t.name());
        // a chat generation's prompt is the training text's prefix, ids and all
        let prompt = text(&t.render_text(&m[..4], true)?)?;
        assert!(ids.starts_with(&prompt), "{}", t.name());
        assert_eq!(ChatTemplate::from_name(t.name())?, t);
        // (the template's text carries its own BOS: none added, none doubled)
        assert!(ids.iter().filter(|&&i| i == BOS).count() == (t == ChatTemplate::Gemma) as usize, "{}: {ids:?}", t.name());
    }
    // a prompt / completion pair: tokenised whole, with the tokenizer's BOS; the completion's
    // ids (and the EOS appended) the targets
    let (ids, marks) = read_sft(r#"{"prompt": "ab", "completion": " C"}"#, &encode, Some(1), None)?.remove(0);
    assert_eq!(ids, [encode("ab C", true)?, vec![1]].concat());
    let n = ids.len();
    assert_eq!(ids[0], BOS);
    match legacy {
        // (BOS ▁ a b | ▁ C EOS: tokenised alone, " C" would be ▁ ▁ C)
        true => {
            assert_eq!(marks, [false, false, false, false, true, true, true]);
            assert_eq!(encode(" C", false)?.len(), 3);
        }
        false => assert_eq!(marks, [vec![false; 3], vec![true; n - 3]].concat()),
    }
    Ok(())
}
