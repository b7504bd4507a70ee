use super::*;

fn conv() -> Vec<Message> {
    vec![
        Message::new("system", "Be brief."),
        Message::new("user", " Hi? "),
        Message::new("assistant", "Hello."),
        Message::new("user", "Name?"),
        Message::new("assistant", "Bob"),
    ]
}

/// The targets of a render: the concatenated target text.
fn targets(s: &Segments) -> String {
    s.iter().filter(|(_, t)| *t).map(|(s, _)| s.as_str()).collect()
}

/// Each family's text, written out from its Jinja template by hand, and its targets: the
/// assistant turns' contents and end-of-turn markers, the first one left out when `train`
/// says so; the generation prompt appended.
#[test]
fn every_family_renders_its_text_and_targets() -> Result<()> {
    let want = [
        (
            ChatTemplate::Llama3,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nName?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nBob<|eot_id|>",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            ChatTemplate::ChatMl,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi? <|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nName?<|im_end|>\n<|im_start|>assistant\nBob<|im_end|>\n",
            "<|im_start|>assistant\n",
        ),
        (
            ChatTemplate::Qwen3,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi? <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n<|im_start|>user\nName?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nBob<|im_end|>\n",
            "<|im_start|>assistant\n",
        ),
        (
            ChatTemplate::Qwen3Thinking,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi? <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n<|im_start|>user\nName?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nBob<|im_end|>\n",
            "<|im_start|>assistant\n<think>\n",
        ),
        (
            ChatTemplate::Qwen3NoThink,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi? <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n<|im_start|>user\nName?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nBob<|im_end|>\n",
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        ),
        (
            ChatTemplate::Exaone35,
            "[|system|]Be brief.[|endofturn|]\n[|user|] Hi? \n[|assistant|]Hello.[|endofturn|]\n[|user|]Name?\n[|assistant|]Bob[|endofturn|]\n",
            "[|assistant|]",
        ),
        (
            ChatTemplate::Gemma,
            "<bos><start_of_turn>user\nBe brief.\n\nHi?<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nName?<end_of_turn>\n<start_of_turn>model\nBob<end_of_turn>\n",
            "<start_of_turn>model\n",
        ),
        (
            ChatTemplate::Phi3,
            "<|system|>\nBe brief.<|end|>\n<|user|>\n Hi? <|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\nName?<|end|>\n<|assistant|>\nBob<|end|>\n<|endoftext|>",
            "<|assistant|>\n",
        ),
        (
            ChatTemplate::Phi4,
            "<|system|>Be brief.<|end|><|user|> Hi? <|end|><|assistant|>Hello.<|end|><|user|>Name?<|end|><|assistant|>Bob<|end|><|endoftext|>",
            "<|assistant|>",
        ),
        (
            ChatTemplate::Granite,
            "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n<|start_of_role|>user<|end_of_role|> Hi? <|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hello.<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Name?<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Bob<|end_of_text|>\n",
            "<|start_of_role|>assistant<|end_of_role|>",
        ),
        (
            ChatTemplate::DeepSeek,
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜> Hi? <｜Assistant｜>Hello.<｜end▁of▁sentence｜><｜User｜>Name?<｜Assistant｜>Bob<｜end▁of▁sentence｜>",
            "<｜Assistant｜>",
        ),
        (
            ChatTemplate::Glm4,
            "[gMASK]<sop><|system|>\nBe brief.<|user|>\n Hi? <|assistant|>\nHello.<|user|>\nName?<|assistant|>\nBob<|endoftext|>",
            "<|assistant|>",
        ),
        (
            ChatTemplate::Exaone4,
            "[|system|]\nBe brief.[|endofturn|]\n[|user|]\nHi?[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nHello.[|endofturn|]\n[|user|]\nName?[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nBob[|endofturn|]\n",
            "[|assistant|]\n<think>\n\n</think>\n\n",
        ),
        (
            ChatTemplate::Glm45,
            "[gMASK]<sop><|system|>\nBe brief.<|user|>\n Hi? <|assistant|>\n<think></think>\nHello.<|user|>\nName?<|assistant|>\n<think></think>\nBob<|endoftext|>",
            "<|assistant|>\n<think></think>",
        ),
        (
            ChatTemplate::Olmo2,
            "<|endoftext|><|system|>\nBe brief.\n<|user|>\n Hi? \n<|assistant|>\nHello.<|endoftext|>\n<|user|>\nName?\n<|assistant|>\nBob<|endoftext|>",
            "<|assistant|>\n",
        ),
        (
            ChatTemplate::Tulu,
            "<|system|>\nBe brief.\n<|user|>\n Hi? \n<|assistant|>\nHello.<|end_of_text|>\n<|user|>\nName?\n<|assistant|>\nBob<|end_of_text|>",
            "<|assistant|>\n",
        ),
        (
            ChatTemplate::MistralV1,
            "<s> [INST] Be brief.\n\n Hi?  [/INST] Hello.</s> [INST] Name? [/INST] Bob</s>",
            "",
        ),
        (
            ChatTemplate::MistralV3,
            "<s>[INST]  Hi? [/INST] Hello.</s>[INST] Be brief.\n\nName?[/INST] Bob</s>",
            "",
        ),
        (
            ChatTemplate::MistralV7,
            "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST] Hi? [/INST]Hello.</s>[INST]Name?[/INST]Bob</s>",
            "",
        ),
    ];
    // (gpt-oss's harmony carries today's date)
    let harmony = format!(
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: {}\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|><|start|>developer<|message|># Instructions\n\nBe brief.<|end|><|start|>user<|message|> Hi? <|end|><|start|>assistant<|channel|>final<|message|>Hello.<|end|><|start|>user<|message|>Name?<|end|><|start|>assistant<|channel|>final<|message|>Bob<|return|>",
        today()
    );
    let want: Vec<(ChatTemplate, &str, &str)> = want.into_iter().chain([(ChatTemplate::Harmony, harmony.as_str(), "<|start|>assistant")]).collect();
    for (t, text, gen) in want {
        assert_eq!(ChatTemplate::from_name(t.name())?, t);
        let all = t.render(&conv(), &|_| true, false)?;
        let joined: String = all.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(joined, text, "{}", t.name());
        let eot = t.end_of_turn();
        let sp = if matches!(t, ChatTemplate::MistralV1 | ChatTemplate::MistralV3) { " " } else { "" };
        // (GLM: the newline after the marker, and the last answer ended by <|endoftext|>)
        let (sp, last_eot) = if matches!(t, ChatTemplate::Glm4 | ChatTemplate::Glm45) { ("\n", "<|endoftext|>") } else { (sp, eot) };
        // (Qwen3: the think block a target, but Thinking-2507's `<think>\n`)
        let sp = match t {
            ChatTemplate::Qwen3 => "<think>\n\n</think>\n\n",
            ChatTemplate::Qwen3Thinking => "\n</think>\n\n",
            _ => sp,
        };
        // (harmony: an answer before the last ends with <|end|>)
        let mid = if t == ChatTemplate::Harmony { "<|end|>" } else { eot };
        assert_eq!(targets(&all), format!("{sp}Hello.{mid}{sp}Bob{last_eot}"), "{}", t.name());
        // neighbours differ in kind (merged)
        assert!(all.windows(2).all(|w| w[0].1 != w[1].1), "{}: {all:?}", t.name());
        let last = t.render(&conv(), &|i| i == 4, false)?;
        assert_eq!(targets(&last), format!("{sp}Bob{last_eot}"), "{}", t.name());
        let joined: String = last.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(joined, text, "{}", t.name());
        // a generation prompt after the user's turn
        let p = t.render_text(&conv()[..4], true)?;
        assert!(p.ends_with(gen), "{}: {p:?}", t.name());
        let upto = t.render_text(&conv()[..4], false)?;
        let upto = upto.strip_suffix("<|endoftext|>").unwrap_or(&upto);
        assert!(!p.ends_with("<|endoftext|>"), "{}: a generation prompt ends open", t.name());
        assert_eq!(p, format!("{upto}{gen}"), "{}", t.name());
        assert!(text.starts_with(&p), "{}: the prompt is the conversation's prefix", t.name());
    }
    Ok(())
}

/// Dates as harmony's system block writes them.
#[test]
fn civil_dates() {
    assert_eq!((civil_date(0), civil_date(-1), civil_date(11_016), civil_date(20_794)), ((1970, 1, 1), (1969, 12, 31), (2000, 2, 29), (2026, 12, 7)));
    let t = today();
    assert!(t.len() == 10 && t.as_bytes()[4] == b'-' && t.as_bytes()[7] == b'-' && t.as_str() >= "2026-01-01", "{t}");
}

/// The errors: empty conversation, unknown role, a late system turn where the family puts it
/// first, Gemma's alternation; unknown names list the choices.
#[test]
fn bad_conversations_are_errors_naming_the_turn() {
    let e = |t: ChatTemplate, m: &[Message]| t.render(m, &|_| true, false).unwrap_err().to_string();
    assert!(e(ChatTemplate::ChatMl, &[]).contains("no message"));
    let tool = [Message::new("user", "a"), Message::new("tool", "b")];
    assert!(e(ChatTemplate::Llama3, &tool).contains("message 1 has role \"tool\""));
    let late = [Message::new("user", "a"), Message::new("system", "b")];
    assert!(e(ChatTemplate::Gemma, &late).contains("message 1 is a system turn"));
    assert!(e(ChatTemplate::MistralV3, &late).contains("message 1 is a system turn"));
    let twice_v1 = [Message::new("user", "a"), Message::new("user", "b")];
    assert!(e(ChatTemplate::MistralV1, &twice_v1).contains("mistral-v1: message 1 is a user turn"));
    assert!(e(ChatTemplate::DeepSeek, &late).contains("message 1 is a system turn"));
    assert!(ChatTemplate::ChatMl.render(&late, &|_| true, false).is_ok());
    // Mistral V7 writes a later system turn where it stands
    assert_eq!(ChatTemplate::MistralV7.render_text(&late, false).expect("renders"), "<s>[INST]a[/INST][SYSTEM_PROMPT]b[/SYSTEM_PROMPT]");
    let twice = [Message::new("system", "s"), Message::new("user", "a"), Message::new("user", "b")];
    assert!(e(ChatTemplate::Gemma, &twice).contains("message 2 is a user turn"), "{}", e(ChatTemplate::Gemma, &twice));
    let first = [Message::new("assistant", "a")];
    assert!(e(ChatTemplate::Gemma, &first).contains("message 0 is a assistant turn"));
    let n = ChatTemplate::from_name("vicuna").unwrap_err().to_string();
    assert!(n.contains("\"vicuna\"") && n.contains("llama3, chatml, qwen3, qwen3-thinking, qwen3-no-think, gemma, phi3, phi4, granite, deepseek, harmony, glm4, glm4.5, olmo2, tulu, exaone4, exaone3.5, mistral-v1, mistral-v3, mistral-v7"), "{n}");
}

/// The family from each model's own Jinja source (abridged from the released templates),
/// and from a model directory: `chat_template.jinja` first, `tokenizer_config.json`'s string
/// or named list; no template, an unknown family and a bad value are errors.
#[test]
fn detects_the_family_from_the_models_template() -> Result<()> {
    let sources = [
        ("{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' %}", Some(ChatTemplate::Llama3)),
        ("{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}", Some(ChatTemplate::ChatMl)),
        // (Qwen3's hybrid: reasoning_content, the think block, enable_thinking; Thinking-2507's
        // without enable_thinking, its generation prompt opening the block)
        ("{%- if message.reasoning_content is string %}{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}{%- if enable_thinking is defined and enable_thinking is false %}", Some(ChatTemplate::Qwen3)),
        ("{%- if message.reasoning_content is string %}{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}{{- '<|im_start|>assistant\\n<think>\\n' }}", Some(ChatTemplate::Qwen3Thinking)),
        ("{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}", Some(ChatTemplate::Gemma)),
        ("{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}", Some(ChatTemplate::Phi3)),
        ("{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}", Some(ChatTemplate::Phi3)),
        ("{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% if add_generation_prompt %}{{ '<|assistant|>' }}", Some(ChatTemplate::Phi4)),
        ("{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' }}", Some(ChatTemplate::Granite)),
        ("{{'<｜User｜>' + message['content']}}", Some(ChatTemplate::DeepSeek)),
        ("{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{%- for message in loop_messages %}{{- '[INST]' + message['content'] + '[/INST]' }}", Some(ChatTemplate::MistralV7)),
        ("{% for message in messages %}[INST] {{ message['content'] }} [/INST]{% endfor %}", None),
        ("{{- \"<|start|>assistant<|channel|>final<|message|>\" + message.content + \"<|return|>\" }}", Some(ChatTemplate::Harmony)),
        ("[gMASK]<sop>{% for item in messages %}{% if item['content'] %}<|{{ item['role'] }}|>{{ item['metadata'] }}\n{{ item['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}", Some(ChatTemplate::Glm4)),
        ("[gMASK]<sop>{%- set visible = content.split('</think>')[-1].strip() %}{% if add_generation_prompt %}<|assistant|>\n<think>{% endif %}", None),
        // (EXAONE 4.0's, and 3.5's without a think block)
        ("{%- if role == 'assistant' %}{{- '[|assistant|]\\n' }}{{- '<think>\\n\\n</think>\\n\\n' }}{{- content }}{{- '[|endofturn|]\\n' }}", Some(ChatTemplate::Exaone4)),
        ("{{ '[|system|][|endofturn|]\\n' }}{{ '[|' + message['role'] + '|]' + message['content'] }}{% if message['role'] == 'user' %}{{ '\\n' }}{% else %}{{ '[|endofturn|]\\n' }}{% endif %}{{ '[|assistant|]' }}", Some(ChatTemplate::Exaone35)),
        // (GLM-4.5's: the empty think block of an answer without reasoning)
        ("[gMASK]<sop>{%- if loop.index0 > ns.last_user_index and reasoning_content -%}{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}{%- else -%}{{ '\\n<think></think>' }}{%- endif -%}", Some(ChatTemplate::Glm45)),
        ("{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}{{- ' ' + message['content'] + eos_token}}", Some(ChatTemplate::MistralV1)),
        ("{{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}{{- \" \" + message[\"content\"]|trim + eos_token}}", Some(ChatTemplate::MistralV3)),
        ("{{ '[INST] ' + message['content'] + ' [/INST]' }}{{ message['content'] + eos_token}}", None),
        ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}", Some(ChatTemplate::Olmo2)),
        ("{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}", Some(ChatTemplate::Tulu)),
        // (Zephyr's: EOS after a user turn too)
        ("{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + eos_token + '\\n' }}{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}", None),
        ("{{- \"[INST]\" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}", None),
        ("{{ '<|user|>\\n' + message['content'] + eos_token }}", None),
    ];
    for (src, want) in sources {
        assert_eq!(ChatTemplate::detect(src), want, "{src}");
    }
    let dir = std::env::temp_dir().join(format!("candle-cp-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let e = ChatTemplate::of_model_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("has no chat template") && e.contains("llama3"), "{e}");
    let cfg = dir.join("tokenizer_config.json");
    std::fs::write(&cfg, r#"{"bos_token": "<s>", "chat_template": "{{'<|im_start|>'}}"}"#)?;
    assert_eq!(ChatTemplate::of_model_dir(&dir)?, ChatTemplate::ChatMl);
    std::fs::write(&cfg, r#"{"chat_template": [{"name": "tool_use", "template": "<|im_start|>"}, {"name": "default", "template": "<start_of_turn>"}]}"#)?;
    assert_eq!(ChatTemplate::of_model_dir(&dir)?, ChatTemplate::Gemma);
    std::fs::write(&cfg, r#"{"chat_template": [{"name": "tool_use", "template": "<|im_start|>"}]}"#)?;
    assert!(ChatTemplate::of_model_dir(&dir).unwrap_err().to_string().contains("without a `default`"));
    std::fs::write(&cfg, r#"{"chat_template": 3}"#)?;
    assert!(ChatTemplate::of_model_dir(&dir).unwrap_err().to_string().contains("must be a string"));
    std::fs::write(&cfg, r#"{"chat_template": "[INST]"}"#)?;
    let e = ChatTemplate::of_model_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json") && e.contains("Mistral [INST] template of none") && e.contains("mistral-v3"), "{e}");
    std::fs::write(&cfg, r#"{"chat_template": "{{ '<|user|>' + eos_token }}"}"#)?;
    let e = ChatTemplate::of_model_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json") && e.contains("does not know"), "{e}");
    // Tulu 3's form: with Llama 3.1's EOS (or none said), not with another's
    let tulu = "{% if message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + eos_token }}";
    for (eos, ok) in [(r#""eos_token": "<|end_of_text|>","#, true), (r#""eos_token": {"content": "<|end_of_text|>"},"#, true), ("", true), (r#""eos_token": "</s>","#, false)] {
        std::fs::write(&cfg, format!("{{{eos} \"chat_template\": {}}}", serde_json::to_string(tulu).map_err(|e| candle_core::Error::Msg(e.to_string()))?))?;
        match ok {
            true => assert_eq!(ChatTemplate::of_model_dir(&dir)?, ChatTemplate::Tulu, "{eos}"),
            false => assert!(ChatTemplate::of_model_dir(&dir).unwrap_err().to_string().contains("EOS is \"</s>\""), "{eos}"),
        }
    }
    std::fs::write(dir.join("chat_template.jinja"), "{{ '<|start_header_id|>' }}")?;
    assert_eq!(ChatTemplate::of_model_dir(&dir)?, ChatTemplate::Llama3);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Messages from JSON; the errors name the message and the field.
#[test]
fn parses_messages_and_names_the_bad_one() -> Result<()> {
    let json = |s: &str| serde_json::from_str::<Value>(s).map_err(|e| candle_core::Error::Msg(e.to_string()));
    let v = json(r#"[{"role": "user", "content": "a", "name": "x"}, {"role": "assistant", "content": "b"}]"#)?;
    assert_eq!(parse_messages(&v, "`messages`")?, vec![Message::new("user", "a"), Message::new("assistant", "b")]);
    for (bad, want) in [
        (r#"{"role": "user"}"#, "`messages` must be a list"),
        (r#"[{"role": "user"}]"#, "`messages`[0]: no `content`"),
        (r#"[{"role": "user", "content": "a"}, {"role": 1, "content": "b"}]"#, "`messages`[1]: `role` must be a string"),
    ] {
        let e = parse_messages(&json(bad)?, "`messages`").unwrap_err().to_string();
        assert!(e.contains(want), "{bad}: {e}");
    }
    Ok(())
}

/// Qwen3's: every answer after its think block — empty without reasoning (the text TRL's
/// docs give for "What color is the sky?"), the reasoning of `reasoning_content` or of a
/// `<think>…</think>` block in the content (its newlines stripped, the answer's leading ones
/// too) —, the block and the answer the targets; Thinking-2507's with `<think>\n` in the prompt
/// and the generation prompt; `reasoning_content` read from JSON, other templates leave it out.
#[test]
fn qwen3_writes_each_answers_reasoning() -> Result<()> {
    let sky = [Message::new("user", "What color is the sky?"), Message::new("assistant", "It is blue.")];
    assert_eq!(ChatTemplate::Qwen3.render_text(&sky, false)?, "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nIt is blue.<|im_end|>\n");
    let conv = [
        Message::new("system", "S"),
        Message::new("user", "a"),
        Message::new("assistant", "\n<think>\nfirst\n\n</think>\n\nA1"),
        Message::new("user", "b"),
        Message::new("assistant", "A2").with_reasoning("\nsecond\n"),
    ];
    let s = ChatTemplate::Qwen3.render(&conv, &|i| i == 4, true)?;
    let text: String = s.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(
        text,
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\nfirst\n</think>\n\nA1<|im_end|>\n<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n<think>\nsecond\n</think>\n\nA2<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(targets(&s), "<think>\nsecond\n</think>\n\nA2<|im_end|>");
    let s = ChatTemplate::Qwen3Thinking.render(&conv, &|_| true, true)?;
    assert_eq!(targets(&s), "first\n</think>\n\nA1<|im_end|>second\n</think>\n\nA2<|im_end|>");
    assert!(s.iter().map(|(t, _)| t.as_str()).collect::<String>().ends_with("<|im_start|>assistant\n<think>\n"));
    // (thinking off: the blocks prompt, the answers the targets; the generation prompt's block
    // empty, as `enable_thinking=False` writes it)
    let s = ChatTemplate::Qwen3NoThink.render(&conv, &|_| true, true)?;
    assert_eq!(targets(&s), "A1<|im_end|>A2<|im_end|>");
    assert!(s.iter().map(|(t, _)| t.as_str()).collect::<String>().ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    // (one tag alone is no block: the content is the answer)
    assert_eq!(crate::chat_reasoning::split_reasoning(&Message::new("assistant", "x</think>y")), (String::new(), "x</think>y".to_string()));
    let v: Value = serde_json::from_str(r#"[{"role": "user", "content": "q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]"#).expect("json");
    let m = parse_messages(&v, "`messages`")?;
    assert_eq!(m[1].reasoning.as_deref(), Some("R"));
    assert!(ChatTemplate::Qwen3.render_text(&m, false)?.contains("<think>\nR\n</think>\n\nA<|im_end|>"));
    assert_eq!(ChatTemplate::ChatMl.render_text(&m, false)?, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n");
    let bad: Value = serde_json::from_str(r#"[{"role": "assistant", "content": "A", "reasoning_content": 3}]"#).expect("json");
    assert!(parse_messages(&bad, "`messages`").unwrap_err().to_string().contains("`reasoning_content` must be a string"));
    Ok(())
}

/// EXAONE 3.5's: an empty system turn first when the conversation opens without one, every
/// content as written (no trim), the answer and its end of turn the target.
#[test]
fn exaone35_opens_with_an_empty_system_turn() -> Result<()> {
    let c = [Message::new("user", "Hi"), Message::new("assistant", " Hello ")];
    assert_eq!(ChatTemplate::Exaone35.render_text(&c, true)?, "[|system|][|endofturn|]\n[|user|]Hi\n[|assistant|] Hello [|endofturn|]\n[|assistant|]");
    assert_eq!(targets(&ChatTemplate::Exaone35.render(&c, &|_| true, false)?), " Hello [|endofturn|]");
    Ok(())
}
