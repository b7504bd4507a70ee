//! Chat templates that write an assistant turn's reasoning: Qwen3's ([`ChatTemplate::Qwen3`],
//! [`ChatTemplate::Qwen3Thinking`], [`ChatTemplate::Qwen3NoThink`]).
//!
//! ```text
//! <|im_start|>user\n{u}<|im_end|>\n
//! <|im_start|>assistant\n[<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>]\n     qwen3
//! <|im_start|>assistant\n<think>\n[{reasoning}\n</think>\n\n{answer}<|im_end|>]\n     qwen3-thinking
//! <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n[{answer}<|im_end|>]\n     qwen3-no-think
//! ```
//!
//! A turn's reasoning is its `reasoning_content` ([`Message::reasoning`]), else the text of a
//! `<think>…</think>` block in its content (both tags present: TRL's training variant of the
//! template checks both), the answer what follows the block; the reasoning loses its leading
//! and trailing newlines, the answer its leading ones, as the Jinja source strips them. Every
//! answer has its block, empty without reasoning (TRL's prefix-preserving training variant; the
//! released template writes it only after the last user turn).

use crate::chat::{ChatTemplate, Message};

/// A turn's reasoning and answer ([module docs](self)).
pub fn split_reasoning(m: &Message) -> (String, String) {
    let c = m.content.as_str();
    let (reasoning, answer) = match (&m.reasoning, c.find("<think>"), c.find("</think>")) {
        (Some(r), _, _) => (r.as_str(), c),
        (None, Some(_), Some(close)) => {
            let before = c[..close].trim_end_matches('\n');
            let r = before.rsplit("<think>").next().unwrap_or(before).trim_start_matches('\n');
            let a = c.rsplit("</think>").next().unwrap_or("");
            (r, a)
        }
        _ => ("", c),
    };
    (reasoning.trim_matches('\n').to_string(), answer.trim_start_matches('\n').to_string())
}

/// `messages` as Qwen3's template `t` writes them into `push` (text, whether a target): each
/// assistant turn `i` with `train(i)` a target from its think block to its `<|im_end|>` (from
/// after `<think>\n` for Thinking-2507's, from after the block with thinking off); with
/// `generation_prompt` the next assistant turn's header (and `<think>\n` for Thinking-2507's,
/// the empty block with thinking off).
pub(crate) fn render_qwen3(t: ChatTemplate, messages: &[Message], train: &dyn Fn(usize) -> bool, generation_prompt: bool, push: &mut dyn FnMut(String, bool)) {
    let eot = ChatTemplate::Qwen3.end_of_turn();
    for (i, m) in messages.iter().enumerate() {
        push(format!("<|im_start|>{}\n", m.role), false);
        match m.role.as_str() {
            "assistant" => {
                let (reasoning, answer) = split_reasoning(m);
                let target = crate::chat::is_target(m, i, train);
                match t {
                    ChatTemplate::Qwen3Thinking => {
                        push("<think>\n".into(), false);
                        push(format!("{reasoning}\n</think>\n\n{answer}{eot}"), target);
                    }
                    ChatTemplate::Qwen3NoThink => {
                        push(format!("<think>\n{reasoning}\n</think>\n\n"), false);
                        push(format!("{answer}{eot}"), target);
                    }
                    _ => push(format!("<think>\n{reasoning}\n</think>\n\n{answer}{eot}"), target),
                }
            }
            _ => push(format!("{}{eot}", m.content), false),
        }
        push("\n".into(), false);
    }
    if generation_prompt {
        let opened = match t {
            ChatTemplate::Qwen3Thinking => "<think>\n",
            ChatTemplate::Qwen3NoThink => "<think>\n\n</think>\n\n",
            _ => "",
        };
        push(format!("<|im_start|>assistant\n{opened}"), false);
    }
}
