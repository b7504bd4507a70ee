//! Chat templates: a conversation (`[{"role": .., "content": ..}, ..]`, the `messages` of
//! TRL's conversational data) rendered as the text a model family was instruction-tuned on,
//! cut into segments that say which text is a target of the supervised loss (each trained
//! assistant turn's content and its end-of-turn marker; never the role headers, the user's
//! or the system's text).
//!
//! The families' templates are written here in Rust (candle-cp has no Jinja engine): the
//! plain conversation form of each — system, user and assistant turns; no tool calls, no
//! default system prompt (Qwen 2.5's "You are Qwen..." and Granite's dated one are not
//! inserted: give a system turn to have one), no date lines (but in harmony's structural
//! system block), no reasoning (GLM-4.5's and EXAONE 4.0's empty think blocks, thinking off, are written)
//! but Qwen3's (`qwen3`, `qwen3-thinking`: [`crate::chat_reasoning`]), whose assistant turns
//! carry their reasoning (`reasoning_content`, or a `<think>…</think>` block in the content).
//! [`ChatTemplate::detect`] recognises the family from the model's own Jinja source
//! (`tokenizer_config.json`'s `chat_template`, or `chat_template.jinja` / `.json`:
//! [`ChatTemplate::of_model_dir`]); a template it does not know is an error naming the
//! choices, never a silent guess.
//!
//! ```text
//! llama3    <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{u}<|eot_id|>
//!           <|start_header_id|>assistant<|end_header_id|>\n\n[{a}<|eot_id|>]
//! chatml    <|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n[{a}<|im_end|>]\n
//! qwen3     <|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n[<think>\n{r}\n</think>\n\n{a}<|im_end|>]\n
//! qwen3-thinking  ..<|im_start|>assistant\n<think>\n[{r}\n</think>\n\n{a}<|im_end|>]\n
//! qwen3-no-think  ..<|im_start|>assistant\n<think>\n\n</think>\n\n[{a}<|im_end|>]\n
//! gemma     <bos><start_of_turn>user\n{u}<end_of_turn>\n<start_of_turn>model\n[{a}<end_of_turn>]\n
//! phi3      <|user|>\n{u}<|end|>\n<|assistant|>\n[{a}<|end|>]\n<|endoftext|>
//! phi4      <|user|>{u}<|end|><|assistant|>[{a}<|end|>]<|endoftext|>
//! granite   <|start_of_role|>user<|end_of_role|>{u}<|end_of_text|>\n
//!           <|start_of_role|>assistant<|end_of_role|>[{a}<|end_of_text|>]\n
//! deepseek  <｜begin▁of▁sentence｜>{system}<｜User｜>{u}<｜Assistant｜>[{a}<｜end▁of▁sentence｜>]
//! harmony   <|start|>system<|message|>{gpt-oss's system block}<|end|><|start|>developer<|message|># Instructions\n\n{system}<|end|>
//!           <|start|>user<|message|>{u}<|end|><|start|>assistant<|channel|>final<|message|>[{a}<|end|>]..[{a_last}<|return|>]
//! glm4      [gMASK]<sop><|system|>\n{system}<|user|>\n{u}<|assistant|>[\n{a}<|user|>]\n{u₂}..[<|endoftext|>]
//! glm4.5    [gMASK]<sop><|system|>\n{system}<|user|>\n{u}<|assistant|>\n<think></think>[\n{a}<|user|>]\n{u₂}..[<|endoftext|>]
//! olmo2     <|endoftext|><|user|>\n{u}\n<|assistant|>\n[{a}<|endoftext|>]\n<|user|>..
//! tulu      <|user|>\n{u}\n<|assistant|>\n[{a}<|end_of_text|>]\n<|user|>..
//! exaone4   [|user|]\n{u}[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\n[{a}[|endofturn|]]\n
//! mistral-v1  <s> [INST] {system}\n\n{u₁} [/INST][ {a}</s>] [INST] {u₂} [/INST]..
//! mistral-v3  <s>[INST] {u₁}[/INST][ {a}</s>][INST] {system}\n\n{u_last}[/INST]..
//! mistral-v7  <s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{u}[/INST][{a}</s>]
//! ```
//!
//! The trainer tokenises the rendered text whole (`train::sft`), so a SentencePiece
//! tokenizer's word-start markers (Mistral's, Phi-3's) come out as at inference. Mistral's
//! first template (`[INST] ` without the leading space) and Nemo's (`[INST]` without the
//! trailing one) are refused by name.
//! (`[..]`: the targets of a trained assistant turn.)

use candle_core::{bail, Result};
use serde_json::Value;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The turn's text.
    pub content: String,
    /// An assistant turn's reasoning (`reasoning_content`), written by the templates that
    /// write reasoning (Qwen3's), left out by the others as their Jinja sources do.
    pub reasoning: Option<String>,
}

impl Message {
    /// A turn of `role` saying `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.to_string(), content: content.to_string(), reasoning: None }
    }

    /// This turn with its reasoning `reasoning` (`reasoning_content`).
    pub fn with_reasoning(mut self, reasoning: &str) -> Self {
        self.reasoning = Some(reasoning.to_string());
        self
    }
}

/// The roles a conversation may hold.
pub const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// A model family's chat template ([module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatTemplate {
    /// Llama 3 / 3.1 / 3.2 / 3.3 Instruct.
    Llama3,
    /// ChatML: Qwen 2 / 2.5, Qwen3-Instruct-2507, SmolLM, many fine-tunes.
    ChatMl,
    /// Qwen3's (the hybrid thinking models, thinking on): ChatML with each answer after its
    /// think block, `<think>\n{reasoning}\n</think>\n\n` (empty without reasoning) — the
    /// block a target, as the model writes it. As TRL's prefix-preserving training variant,
    /// every answer has its block, not only those after the last user turn.
    Qwen3,
    /// Qwen3-Thinking-2507's: [`ChatTemplate::Qwen3`] with the generation prompt ending in
    /// `<think>\n` (the model always reasons), so each answer's `<think>\n` is prompt.
    Qwen3Thinking,
    /// Qwen3's hybrid template with thinking off (`enable_thinking=False`): the generation
    /// prompt ends in an empty think block, `<think>\n\n</think>\n\n`, so each answer's block
    /// is prompt and only what follows it a target (its reasoning, if any, written in the block
    /// as [`ChatTemplate::Qwen3`] does). By name only: the Jinja source is the hybrid's.
    Qwen3NoThink,
    /// Gemma 2 / 3 (the assistant is `model`; a system turn's text and a blank line are put
    /// before the first user turn's text, as Gemma 3's template does).
    Gemma,
    /// Phi-3 / Phi-3.5 (a newline after each role marker and turn).
    Phi3,
    /// Phi-4-mini (Phi-3's markers, no newlines).
    Phi4,
    /// Granite 3.
    Granite,
    /// DeepSeek-V3 (and Kimi K2's predecessor form): system text first, then `<｜User｜>` /
    /// `<｜Assistant｜>` turns.
    DeepSeek,
    /// gpt-oss's harmony format, its released template's plain conversation: the system block
    /// (model identity, knowledge cutoff, `Current date:` today's UTC date as the template's
    /// `strftime_now`, reasoning effort medium, the valid channels), a system turn as the
    /// developer's instructions, answers on the `final` channel, each ended by `<|end|>` but a
    /// closing one by `<|return|>` (the token the model learns to stop with). No analysis
    /// channel (reasoning), no tools.
    Harmony,
    /// GLM-4-9B-chat's and GLM-4-0414's (`[gMASK]<sop>`, `<|role|>\n` before each turn, no
    /// end-of-turn marker: an answer ends where the next turn's marker starts). As GLM's own
    /// fine-tuning code does, the targets are what follows `<|assistant|>` — the newline, the
    /// answer — and the token after it: the next turn's marker (`<|user|>`, a stop token of
    /// the model), or after the last turn an `<|endoftext|>` the rendered text ends with.
    /// Reasoning templates (GLM-4.5's: [`ChatTemplate::Glm45`]; GLM-Z1's) are not this one.
    Glm4,
    /// GLM-4.5's / GLM-4.6's (`glm4_moe` models) with thinking off (`enable_thinking` false): GLM-4's
    /// turns, each answer after an empty `<think></think>` block — part of the prompt, as the
    /// template's generation prompt writes it with thinking off — its text trimmed; the
    /// targets as GLM-4's (the newline and answer, then the next turn's marker or a final
    /// `<|endoftext|>`). No reasoning content, no tools.
    Glm45,
    /// OLMo 2 Instruct's (Tulu 3's template with OLMo's `<|endoftext|>` as BOS and EOS): a
    /// newline after each turn but the last.
    Olmo2,
    /// Llama-3.1-Tulu-3's: OLMo 2's form without a BOS (its template writes none, and the
    /// rendered text is tokenised without special tokens, as transformers'
    /// `apply_chat_template` does) and Llama 3.1's `<|end_of_text|>` as EOS.
    Tulu,
    /// EXAONE 4.0's (`exaone4` models) with thinking off: `[|role|]\n` before each turn's
    /// trimmed text and `[|endofturn|]\n` after it, each answer after an empty `<think>`
    /// block — part of the prompt, as the generation prompt writes it with thinking off. No
    /// BOS (the template writes none), no reasoning content, no tools.
    Exaone4,
    /// EXAONE 3.5's (`exaone` models; EXAONE-3.5-*-Instruct): `[|role|]` before each turn's
    /// text as written, a user's turn ended by `\n`, the others by `[|endofturn|]\n`, an empty
    /// system turn first when the conversation opens without one; the generation prompt
    /// `[|assistant|]`.
    Exaone35,
    /// Mistral's updated V1 template: Mistral-7B-Instruct v0.1 / v0.2, Mixtral-8x7B-Instruct (a
    /// system turn's text before the FIRST user turn's; turns alternate user / assistant).
    MistralV1,
    /// Mistral's V3 template: Mistral-7B-Instruct v0.3, Mixtral-8x22B-Instruct, Codestral (a
    /// system turn's text before the LAST user turn's, as mistral-common encodes it; answers
    /// trimmed; turns alternate user / assistant).
    MistralV3,
    /// Mistral's V7 (tekken) template: Mistral Small 3 / 3.1 / 3.2, Magistral, Devstral. A
    /// system turn anywhere, in `[SYSTEM_PROMPT]` markers where it stands (the released
    /// template's dated default system prompt is not inserted); no generation header (the
    /// answer follows `[/INST]`).
    MistralV7,
}

/// Every template by its name (`--chat-template NAME`).
pub const CHAT_TEMPLATES: [(&str, ChatTemplate); 20] = [
    ("llama3", ChatTemplate::Llama3),
    ("chatml", ChatTemplate::ChatMl),
    ("qwen3", ChatTemplate::Qwen3),
    ("qwen3-thinking", ChatTemplate::Qwen3Thinking),
    ("qwen3-no-think", ChatTemplate::Qwen3NoThink),
    ("gemma", ChatTemplate::Gemma),
    ("phi3", ChatTemplate::Phi3),
    ("phi4", ChatTemplate::Phi4),
    ("granite", ChatTemplate::Granite),
    ("deepseek", ChatTemplate::DeepSeek),
    ("harmony", ChatTemplate::Harmony),
    ("glm4", ChatTemplate::Glm4),
    ("glm4.5", ChatTemplate::Glm45),
    ("olmo2", ChatTemplate::Olmo2),
    ("tulu", ChatTemplate::Tulu),
    ("exaone4", ChatTemplate::Exaone4),
    ("exaone3.5", ChatTemplate::Exaone35),
    ("mistral-v1", ChatTemplate::MistralV1),
    ("mistral-v3", ChatTemplate::MistralV3),
    ("mistral-v7", ChatTemplate::MistralV7),
];

/// A rendered conversation: its text in order, each piece with whether it is a target.
pub type Segments = Vec<(String, bool)>;

impl ChatTemplate {
    /// The template named `name` ([`CHAT_TEMPLATES`]); the error lists the names.
    pub fn from_name(name: &str) -> Result<Self> {
        match CHAT_TEMPLATES.iter().find(|(n, _)| *n == name) {
            Some((_, t)) => Ok(*t),
            None => bail!("unknown chat template {name:?}: expected one of {}", names()),
        }
    }

    /// Its name in [`CHAT_TEMPLATES`].
    pub fn name(self) -> &'static str {
        CHAT_TEMPLATES.iter().find(|(_, t)| *t == self).map_or("?", |(n, _)| n)
    }

    /// The family of a Jinja chat template's source, from the markers it writes; `None` when it
    /// writes none of the known families' markers.
    pub fn detect(jinja: &str) -> Option<Self> {
        let has = |m: &str| jinja.contains(m);
        if has("[SYSTEM_PROMPT]") && has("[INST]") {
            Some(Self::MistralV7)
        } else if has("<|channel|>") && has("<|return|>") && has("<|start|>") {
            Some(Self::Harmony)
        } else if has("[|endofturn|]") && has("[|assistant|]") && has("<think>") {
            // EXAONE 4.0's
            Some(Self::Exaone4)
        } else if has("[|endofturn|]") && has("[|assistant|]") {
            // EXAONE 3.5's, without a think block
            Some(Self::Exaone35)
        } else if has("[gMASK]<sop>") && has("<think></think>") {
            // GLM-4.5 / 4.6: the empty think block written for an answer without reasoning
            Some(Self::Glm45)
        } else if has("[gMASK]<sop>") && !has("think") {
            Some(Self::Glm4)
        } else if has("' [INST] '") || has("\" [INST] \"") {
            Some(Self::MistralV1)
        } else if (has("\"[INST] \"") || has("'[INST] '")) && !has(" [/INST]") {
            Some(Self::MistralV3)
        } else if has("<|start_header_id|>") {
            Some(Self::Llama3)
        } else if has("<|im_start|>") && has("reasoning_content") && has("<think>") {
            // Qwen3's: the hybrid's generation prompt says `enable_thinking`, Thinking-2507's
            // opens the think block
            Some(if has("enable_thinking") { Self::Qwen3 } else { Self::Qwen3Thinking })
        } else if has("<|im_start|>") {
            Some(Self::ChatMl)
        } else if has("<start_of_turn>") {
            Some(Self::Gemma)
        } else if has("<|start_of_role|>") {
            Some(Self::Granite)
        } else if has("<｜User｜>") {
            Some(Self::DeepSeek)
        } else if has("<|assistant|>") && has("<|end|>") {
            // Phi-3 writes `'<|user|>\n'` (or `'|>' + '\n'`), Phi-4-mini no newline
            Some(if has("|>\\n") || has("|>' + '\\n'") { Self::Phi3 } else { Self::Phi4 })
        } else if has("<|user|>\\n") && has("<|assistant|>\\n") && has("eos_token") && has("bos_token") {
            // Tulu 3's form with the BOS written: OLMo 2's
            Some(Self::Olmo2)
        } else if has("<|user|>\\n' + message['content'] + '\\n'") && has("<|assistant|>\\n") && has("eos_token") {
            // Tulu 3's form without it (a user turn ends with a newline, not EOS as Zephyr's):
            // Llama-3.1-Tulu-3's, EOS <|end_of_text|> (ChatTemplate::of_model_dir checks it)
            Some(Self::Tulu)
        } else {
            None
        }
    }

    /// The text a turn ends with (its end-of-turn token when the tokenizer has it as a special
    /// token: the stop token of a chat generation).
    pub fn end_of_turn(self) -> &'static str {
        match self {
            Self::Llama3 => "<|eot_id|>",
            Self::ChatMl | Self::Qwen3 | Self::Qwen3Thinking | Self::Qwen3NoThink => "<|im_end|>",
            Self::Gemma => "<end_of_turn>",
            Self::Phi3 | Self::Phi4 => "<|end|>",
            Self::Granite => "<|end_of_text|>",
            Self::DeepSeek => "<｜end▁of▁sentence｜>",
            Self::MistralV1 | Self::MistralV3 | Self::MistralV7 => "</s>",
            Self::Olmo2 => "<|endoftext|>",
            Self::Tulu => "<|end_of_text|>",
            Self::Exaone4 | Self::Exaone35 => "[|endofturn|]",
            Self::Glm4 | Self::Glm45 => "<|user|>",
            Self::Harmony => "<|return|>",
        }
    }

    /// `messages` rendered as segments: targets are the content and end-of-turn marker of each
    /// assistant turn `i` with `train(i)`. With `generation_prompt`, the header of a next
    /// assistant turn is appended (the prompt of a chat generation). Errors (naming the turn):
    /// an empty conversation, a role not in [`ROLES`], a system turn after the first (Gemma,
    /// DeepSeek put it first), Gemma's roles not alternating user / assistant.
    pub fn render(self, messages: &[Message], train: &dyn Fn(usize) -> bool, generation_prompt: bool) -> Result<Segments> {
        if messages.is_empty() {
            bail!("chat template {}: the conversation has no message", self.name())
        }
        for (i, m) in messages.iter().enumerate() {
            if !ROLES.contains(&m.role.as_str()) {
                bail!("chat template {}: message {i} has role {:?}, expected one of {ROLES:?}", self.name(), m.role)
            }
            if m.role == "system" && i > 0 && matches!(self, Self::Gemma | Self::DeepSeek | Self::MistralV1 | Self::MistralV3 | Self::Glm4 | Self::Harmony) {
                bail!("chat template {}: message {i} is a system turn; only the first message may be one", self.name())
            }
        }
        let mut out: Segments = Vec::new();
        let mut push = |s: String, target: bool| {
            if s.is_empty() {
                return;
            }
            match out.last_mut() {
                Some((last, t)) if *t == target => last.push_str(&s),
                _ => out.push((s, target)),
            }
        };
        let eot = self.end_of_turn();
        match self {
            Self::Llama3 => {
                push("<|begin_of_text|>".into(), false);
                for (i, m) in messages.iter().enumerate() {
                    push(format!("<|start_header_id|>{}<|end_header_id|>\n\n", m.role), false);
                    push(format!("{}{eot}", m.content.trim()), is_target(m, i, train));
                }
                if generation_prompt {
                    push("<|start_header_id|>assistant<|end_header_id|>\n\n".into(), false);
                }
            }
            Self::ChatMl | Self::Phi3 | Self::Phi4 | Self::Granite => {
                let (open, close, after) = match self {
                    Self::ChatMl => ("<|im_start|>", "\n", "\n"),
                    Self::Phi3 => ("<|", "|>\n", "\n"),
                    Self::Phi4 => ("<|", "|>", ""),
                    _ => ("<|start_of_role|>", "<|end_of_role|>", "\n"),
                };
                for (i, m) in messages.iter().enumerate() {
                    push(format!("{open}{}{close}", m.role), false);
                    push(format!("{}{eot}", m.content), is_target(m, i, train));
                    push(after.into(), false);
                }
                if generation_prompt {
                    push(format!("{open}assistant{close}"), false);
                } else if matches!(self, Self::Phi3 | Self::Phi4) {
                    push("<|endoftext|>".into(), false);
                }
            }
            Self::Qwen3 | Self::Qwen3Thinking | Self::Qwen3NoThink => crate::chat_reasoning::render_qwen3(self, messages, train, generation_prompt, &mut push),
            Self::Gemma => {
                push("<bos>".into(), false);
                let (system, rest) = match messages.split_first() {
                    Some((m, rest)) if m.role == "system" => (Some(m.content.as_str()), rest),
                    _ => (None, messages),
                };
                let offset = messages.len() - rest.len();
                self.check_alternation(rest, offset)?;
                for (j, m) in rest.iter().enumerate() {
                    let role = if m.role == "assistant" { "model" } else { "user" };
                    push(format!("<start_of_turn>{role}\n"), false);
                    let text = match (j, system) {
                        (0, Some(s)) => format!("{s}\n\n{}", m.content.trim()),
                        _ => m.content.trim().to_string(),
                    };
                    push(format!("{text}{eot}"), is_target(m, j + offset, train));
                    push("\n".into(), false);
                }
                if generation_prompt {
                    push("<start_of_turn>model\n".into(), false);
                }
            }
            Self::DeepSeek => {
                push("<｜begin▁of▁sentence｜>".into(), false);
                for (i, m) in messages.iter().enumerate() {
                    match m.role.as_str() {
                        "system" => push(m.content.clone(), false),
                        "user" => push(format!("<｜User｜>{}", m.content), false),
                        _ => {
                            push("<｜Assistant｜>".into(), false);
                            push(format!("{}{eot}", m.content), is_target(m, i, train));
                        }
                    }
                }
                if generation_prompt {
                    push("<｜Assistant｜>".into(), false);
                }
            }
            Self::Harmony => {
                push(
                    format!(
                        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: {}\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>",
                        today()
                    ),
                    false,
                );
                for (i, m) in messages.iter().enumerate() {
                    match m.role.as_str() {
                        "system" if !m.content.is_empty() => push(format!("<|start|>developer<|message|># Instructions\n\n{}<|end|>", m.content), false),
                        "system" => {}
                        "user" => push(format!("<|start|>user<|message|>{}<|end|>", m.content), false),
                        _ => {
                            push("<|start|>assistant<|channel|>final<|message|>".into(), false);
                            let end = if i + 1 == messages.len() && !generation_prompt { eot } else { "<|end|>" };
                            push(format!("{}{end}", m.content), is_target(m, i, train));
                        }
                    }
                }
                if generation_prompt {
                    push("<|start|>assistant".into(), false);
                }
            }
            Self::Glm4 | Self::Glm45 => {
                push("[gMASK]<sop>".into(), false);
                // (GLM-4.5 with thinking off: an empty think block before each answer, trimmed)
                let think = if self == Self::Glm45 { "\n<think></think>" } else { "" };
                // (whether the turn before was a trained answer: the marker after it is a target)
                let mut after_answer = false;
                for (i, m) in messages.iter().enumerate() {
                    push(format!("<|{}|>", m.role), after_answer);
                    after_answer = is_target(m, i, train);
                    match m.role.as_str() {
                        "assistant" if self == Self::Glm45 => {
                            push(think.into(), false);
                            let text = m.content.trim();
                            // (an empty answer writes nothing after the block; its marker still ends it)
                            if !text.is_empty() {
                                push(format!("\n{text}"), after_answer);
                            }
                        }
                        _ => push(format!("\n{}", m.content), after_answer),
                    }
                }
                if generation_prompt {
                    push(format!("<|assistant|>{think}"), false);
                } else {
                    push("<|endoftext|>".into(), after_answer);
                }
            }
            Self::Exaone4 => {
                for (i, m) in messages.iter().enumerate() {
                    push(format!("[|{}|]\n", m.role), false);
                    let text = m.content.trim();
                    match m.role.as_str() {
                        "assistant" => {
                            if !text.is_empty() {
                                push("<think>\n\n</think>\n\n".into(), false);
                            }
                            push(format!("{text}{eot}"), is_target(m, i, train));
                        }
                        _ => push(format!("{text}{eot}"), false),
                    }
                    push("\n".into(), false);
                }
                if generation_prompt {
                    push("[|assistant|]\n<think>\n\n</think>\n\n".into(), false);
                }
            }
            Self::Exaone35 => {
                // (an empty system turn when the conversation opens without one)
                if messages.first().is_some_and(|m| m.role != "system") {
                    push(format!("[|system|]{eot}\n"), false);
                }
                for (i, m) in messages.iter().enumerate() {
                    push(format!("[|{}|]", m.role), false);
                    match m.role.as_str() {
                        "user" => push(format!("{}\n", m.content), false),
                        "assistant" => {
                            push(format!("{}{eot}", m.content), is_target(m, i, train));
                            push("\n".into(), false);
                        }
                        _ => push(format!("{}{eot}\n", m.content), false),
                    }
                }
                if generation_prompt {
                    push("[|assistant|]".into(), false);
                }
            }
            Self::Olmo2 | Self::Tulu => {
                if self == Self::Olmo2 {
                    push(eot.into(), false);
                }
                for (i, m) in messages.iter().enumerate() {
                    push(format!("<|{}|>\n", m.role), false);
                    match m.role.as_str() {
                        "assistant" => {
                            push(format!("{}{eot}", m.content), is_target(m, i, train));
                            if i + 1 < messages.len() {
                                push("\n".into(), false);
                            }
                        }
                        _ => push(format!("{}\n", m.content), false),
                    }
                }
                if generation_prompt {
                    push("<|assistant|>\n".into(), false);
                }
            }
            Self::MistralV1 | Self::MistralV3 => {
                let (system, rest) = match messages.split_first() {
                    Some((m, rest)) if m.role == "system" => (Some(m.content.as_str()), rest),
                    _ => (None, messages),
                };
                let offset = messages.len() - rest.len();
                self.check_alternation(rest, offset)?;
                let last_user = rest.iter().rposition(|m| m.role == "user");
                push("<s>".into(), false);
                for (j, m) in rest.iter().enumerate() {
                    if m.role == "user" {
                        let here = if self == Self::MistralV1 { j == 0 } else { Some(j) == last_user };
                        let text = match (here, system) {
                            (true, Some(s)) => format!("{s}\n\n{}", m.content),
                            _ => m.content.clone(),
                        };
                        push(if self == Self::MistralV1 { format!(" [INST] {text} [/INST]") } else { format!("[INST] {text}[/INST]") }, false);
                    } else {
                        let answer = if self == Self::MistralV1 { m.content.as_str() } else { m.content.trim() };
                        push(format!(" {answer}{eot}"), is_target(m, j + offset, train));
                    }
                }
            }
            Self::MistralV7 => {
                push("<s>".into(), false);
                for (i, m) in messages.iter().enumerate() {
                    match m.role.as_str() {
                        "system" => push(format!("[SYSTEM_PROMPT]{}[/SYSTEM_PROMPT]", m.content), false),
                        "user" => push(format!("[INST]{}[/INST]", m.content), false),
                        _ => push(format!("{}{eot}", m.content), is_target(m, i, train)),
                    }
                }
            }
        }
        Ok(out)
    }

    /// Errors unless `rest` (messages `offset..`) alternate user / assistant from a user turn.
    fn check_alternation(self, rest: &[Message], offset: usize) -> Result<()> {
        for (j, m) in rest.iter().enumerate() {
            let want = if j % 2 == 0 { "user" } else { "assistant" };
            if m.role != want {
                bail!(
                    "chat template {}: message {} is a {} turn; its turns alternate user / assistant, starting with user (after an optional system turn)",
                    self.name(),
                    j + offset,
                    m.role
                )
            }
        }
        Ok(())
    }

    /// The whole text of [`ChatTemplate::render`] (no targets), e.g. a chat generation's prompt.
    pub fn render_text(self, messages: &[Message], generation_prompt: bool) -> Result<String> {
        Ok(self.render(messages, &|_| false, generation_prompt)?.into_iter().map(|(s, _)| s).collect())
    }
}

/// Today's UTC date, `YYYY-MM-DD` (harmony's `Current date`, as its template's `strftime_now`).
fn today() -> String {
    let days = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86_400);
    let (y, m, d) = civil_date(days as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The proleptic Gregorian date `days` after 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_date(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let (d, m) = (doy - (153 * mp + 2) / 5 + 1, if mp < 10 { mp + 3 } else { mp - 9 });
    (yoe + era * 400 + (m <= 2) as i64, m, d)
}

/// Is turn `i` a target: an assistant turn that `train` selects.
pub(crate) fn is_target(m: &Message, i: usize, train: &dyn Fn(usize) -> bool) -> bool {
    m.role == "assistant" && train(i)
}

/// The template names, for errors.
pub(crate) fn names() -> String {
    CHAT_TEMPLATES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

/// The conversation of a JSON array of `{"role": .., "content": ..}` objects; errors say what
/// is wrong with which message (`what` names the array, e.g. "`messages`").
pub fn parse_messages(v: &Value, what: &str) -> Result<Vec<Message>> {
    let Some(list) = v.as_array() else { bail!("{what} must be a list of {{\"role\": .., \"content\": ..}} messages, got {v}") };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |k: &str| match m.get(k) {
                Some(Value::String(s)) => Ok(s.clone()),
                Some(other) => bail!("{what}[{i}]: `{k}` must be a string, got {other}"),
                None => bail!("{what}[{i}]: no `{k}` (a message is {{\"role\": .., \"content\": ..}})"),
            };
            let reasoning = match m.get("reasoning_content") {
                None | Some(Value::Null) => None,
                Some(Value::String(r)) => Some(r.clone()),
                Some(other) => bail!("{what}[{i}]: `reasoning_content` must be a string, got {other}"),
            };
            Ok(Message { role: field("role")?, content: field("content")?, reasoning })
        })
        .collect()
}

#[cfg(test)]
#[path = "chat_tests.rs"]
mod tests;
