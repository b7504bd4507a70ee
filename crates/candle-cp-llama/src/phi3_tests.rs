use super::*;
use crate::lora::LoraSpec;
use crate::rope::{inv_freq, inv_freq_at};

/// A Phi-3-mini-128k config.json shrunk to heads of 16 (8 frequencies), original length 64
/// and 1024 positions (factor 16); `rope` is its `rope_scaling` object's inside.
fn phi3_json(rope: &str, extra: &str) -> String {
    format!(
        r#"{{"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 1024, "original_max_position_embeddings": 64, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 262144, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attention_dropout": 0.0, "hidden_act": "silu", "tie_word_embeddings": false, "bos_token_id": 1,
        "eos_token_id": 32000, "pad_token_id": 32000, "rope_scaling": {{{rope}}}{extra}}}"#
    )
}

const SHORT: &str = "[1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0]";
const LONG: &str = "[1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0]";

fn longrope(kind: &str) -> String {
    format!(r#""type": "{kind}", "short_factor": {SHORT}, "long_factor": {LONG}"#)
}

fn err(text: &str) -> String {
    LlamaConfig::from_json(text).err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn a_phi3_config_and_its_longrope() -> Result<()> {
    let c = LlamaConfig::from_json(&phi3_json(&longrope("longrope"), ""))?;
    assert!(c.phi3 && c.arch() == Arch::Phi3 && !c.qkv_bias && !c.qk_norm);
    assert_eq!(c.sliding_window, Some(262144));
    let RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, factor, attention_factor } = &c.rope_scaling else {
        panic!("{:?}", c.rope_scaling)
    };
    assert_eq!((short_factor[7], long_factor[7], *original_max_position_embeddings, *factor, *attention_factor), (4.0, 32.0, 64, 16.0, None));
    // sqrt(1 + ln 16 / ln 64) = sqrt(1 + 4/6)
    assert!((c.rope_scaling.attention_factor() - (5.0f64 / 3.0).sqrt()).abs() < 1e-15);
    // Microsoft's first name of it, and transformers 5's spelling (the original length inside)
    assert_eq!(LlamaConfig::from_json(&phi3_json(&longrope("su"), ""))?, c);
    let v5 = format!(
        r#"{{"model_type": "phi3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 1024, "rms_norm_eps": 1e-05, "sliding_window": 262144,
        "bos_token_id": 1, "eos_token_id": 32000, "rope_parameters": {{"rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": {SHORT}, "long_factor": {LONG}, "original_max_position_embeddings": 64}}}}"#
    );
    assert_eq!(LlamaConfig::from_json(&v5)?, c);
    // written and read again; the same for a Phi-3 without scaling (the 4k models)
    assert_eq!(LlamaConfig::from_json(&c.to_hf_json("bfloat16"))?, c);
    let plain = LlamaConfig::from_json(&phi3_json("", "").replace(r#""rope_scaling": {}"#, r#""rope_scaling": null"#))?;
    assert!(plain.phi3 && plain.rope_scaling == RopeScaling::Default);
    assert_eq!(LlamaConfig::from_json(&plain.to_hf_json("float32"))?, plain);
    // an explicit factor and attention factor survive the round trip
    let own = LlamaConfig::from_json(&phi3_json(&format!(r#"{}, "factor": 8.0, "attention_factor": 1.25"#, longrope("longrope")), ""))?;
    assert!((own.rope_scaling.attention_factor() - 1.25).abs() < 1e-15);
    assert_eq!(LlamaConfig::from_json(&own.to_hf_json("float32"))?, own);
    Ok(())
}

#[test]
fn longrope_frequencies_follow_the_sequence_length() -> Result<()> {
    let c = LlamaConfig::from_json(&phi3_json(&longrope("longrope"), ""))?;
    let plain = inv_freq(&LlamaConfig { rope_scaling: RopeScaling::Default, ..c.clone() });
    let (short, long): (Vec<f64>, Vec<f64>) = (serde_json::from_str(SHORT).unwrap_or_default(), serde_json::from_str(LONG).unwrap_or_default());
    for (seq_len, ext) in [(0, &short), (1, &short), (64, &short), (65, &long), (100_000, &long)] {
        let got = inv_freq_at(&c, seq_len);
        for i in 0..8 {
            assert!((got[i] - plain[i] / ext[i]).abs() <= 1e-15 * plain[i], "T = {seq_len}, frequency {i}");
        }
    }
    assert_eq!(inv_freq(&c), inv_freq_at(&c, 64));
    // a table of positions below the original length alone: the short factors
    let (cos, _) = crate::rope::rope_tables(&c, &[0, 5, 63], candle_core::DType::F64, &candle_core::Device::Cpu)?;
    let (cos_long, _) = crate::rope::rope_tables_at(&c, &[0, 5, 63], 256, candle_core::DType::F64, &candle_core::Device::Cpu)?;
    let a = (5.0 * plain[7] / short[7]).cos() * c.rope_scaling.attention_factor();
    let b = (5.0 * plain[7] / long[7]).cos() * c.rope_scaling.attention_factor();
    assert!((cos.to_vec2::<f64>()?[1][7] - a).abs() < 1e-12 && (cos_long.to_vec2::<f64>()?[1][7] - b).abs() < 1e-12);
    Ok(())
}

/// Phi-4-mini's partial RoPE (`partial_rotary_factor` 0.75 of heads of 16: 12 dimensions, 6
/// frequencies `theta^(-2i / 12)` divided by LongRoPE's 6 factors); read, written back, and
/// the tables 12 wide.
#[test]
fn a_partial_rotary_phi3_config() -> Result<()> {
    let (short6, long6) = ("[1.0, 1.0, 1.1, 1.2, 1.5, 2.0]", "[1.0, 1.5, 2.0, 4.0, 8.0, 16.0]");
    let rope = format!(r#""type": "longrope", "short_factor": {short6}, "long_factor": {long6}"#);
    let c = LlamaConfig::from_json(&phi3_json(&rope, r#", "partial_rotary_factor": 0.75"#))?;
    assert_eq!((c.partial_rotary_factor, c.rope_dim(), c.head_dim), (0.75, 12, 16));
    let back = LlamaConfig::from_json(&c.to_hf_json("float32"))?;
    assert_eq!(back, c);
    assert!(c.to_hf_json("float32").contains(r#""partial_rotary_factor": 0.75"#));
    assert!(!LlamaConfig::from_json(&phi3_json(&longrope("longrope"), ""))?.to_hf_json("float32").contains("partial_rotary_factor"));
    let long = [1.0, 1.5, 2.0, 4.0, 8.0, 16.0];
    let got = inv_freq_at(&c, 65);
    assert_eq!(got.len(), 6);
    for (i, (g, l)) in got.iter().zip(long).enumerate() {
        let want = 1.0 / 10000f64.powf(2.0 * i as f64 / 12.0) / l;
        assert!((g - want).abs() <= 1e-15 * want, "frequency {i}: {g} vs {want}");
    }
    let (cos, sin) = crate::rope::rope_tables(&c, &[0, 5, 70], candle_core::DType::F64, &candle_core::Device::Cpu)?;
    assert_eq!((cos.dims(), sin.dims()), (&[3, 12][..], &[3, 12][..]));
    // a partial factor on a Phi-3 only (the builder's config validated too)
    assert!(LlamaConfig::tiny(32, 64, 1, 4, 2).with_partial_rotary_factor(0.5).validate().is_err());
    assert!(LlamaConfig::tiny(32, 64, 1, 4, 2).with_phi3(true).with_partial_rotary_factor(0.5).validate().is_ok());
    Ok(())
}

/// Phi-4-mini-instruct's config.json as released (its keys; the 48 factors of each kind
/// stand-ins of the same count): a tied Phi-3 with heads of 128, 96 of them rotated.
#[test]
fn phi4_mini_instruct_config_json() -> Result<()> {
    let f = |top: f64| format!("[{}]", (0..48).map(|i| format!("{}", 1.0 + top * i as f64 / 47.0)).collect::<Vec<_>>().join(", "));
    let text = format!(
        r#"{{"architectures": ["Phi3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "auto_map": {{"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
        "AutoTokenizer": "Xenova/gpt-4o"}}, "bos_token_id": 199999, "embd_pdrop": 0.0, "eos_token_id": 199999,
        "full_attn_mod": 1, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
        "interpolate_factor": 1, "lm_head_bias": false, "max_position_embeddings": 131072, "mlp_bias": false,
        "model_type": "phi3", "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "original_max_position_embeddings": 4096, "pad_token_id": 199999, "partial_rotary_factor": 0.75,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": {{"long_factor": {}, "short_factor": {}, "type": "longrope"}},
        "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0", "use_cache": true, "vocab_size": 200064}}"#,
        f(30.0),
        f(0.2)
    );
    let c = LlamaConfig::from_json(&text)?;
    assert_eq!((c.arch(), c.head_dim, c.rope_dim(), c.partial_rotary_factor), (Arch::Phi3, 128, 96, 0.75));
    assert!(c.phi3 && c.tie_word_embeddings && !c.qkv_bias);
    let RopeScaling::LongRope { long_factor, original_max_position_embeddings, factor, .. } = &c.rope_scaling else { panic!("{:?}", c.rope_scaling) };
    assert_eq!((long_factor.len(), *original_max_position_embeddings, *factor), (48, 4096, 32.0));
    assert_eq!(LlamaConfig::from_json(&c.to_hf_json("bfloat16"))?, c);
    Ok(())
}

#[test]
fn what_phi3_configs_cannot_say_is_refused() -> Result<()> {
    let lr = longrope("longrope");
    for (text, want) in [
        // (a partial RoPE's factors: one per pair of the rotated dimensions, 12 of the 16)
        (phi3_json(&lr, r#", "partial_rotary_factor": 0.75"#), "short_factor has 8 entries, RoPE over 12 dimensions of a head rotates 6"),
        (phi3_json(&lr, r#", "partial_rotary_factor": 0.1"#), "rotate an even number (>= 2) of a head's 16 dimensions, got 1"),
        (phi3_json(&lr, r#", "partial_rotary_factor": 1.5"#), "must be in (0, 1]"),
        (phi3_json(&lr, "").replace("Phi3ForCausalLM", "LlamaForCausalLM").replace(r#""phi3""#, r#""llama""#).replace(r#", "rope_scaling": {"#, r#", "partial_rotary_factor": 0.5, "rope_scaling": {"#), "partial_rotary_factor 0.5 not supported on a LlamaForCausalLM"),
        (phi3_json(&lr, r#", "resid_pdrop": 0.1"#).replace(r#""resid_pdrop": 0.0, "#, ""), "`resid_pdrop` 0.1"),
        (phi3_json(&lr.replace(SHORT, "[1.0, 2.0]"), ""), "short_factor has 2 entries, RoPE over 16 dimensions of a head rotates 8"),
        (phi3_json(&lr.replace(LONG, "[1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 24.0, -1.0]"), ""), "long_factor[7] = -1"),
        (phi3_json(r#""type": "longrope", "short_factor": [1.0]"#, ""), "needs `long_factor`"),
        (phi3_json(&lr, "").replace(r#""original_max_position_embeddings": 64"#, r#""original_max_position_embeddings": 0"#), "original_max_position_embeddings > 0"),
    ] {
        let e = err(&text);
        assert!(e.contains(want), "{want}: {e}");
    }
    // LoRA: the fused modules, named as such or by all of their parts; some parts alone refused
    let c = LlamaConfig::from_json(&phi3_json(&lr, ""))?;
    for (ts, fused) in [(&["q_proj", "v_proj"][..], "qkv_proj"), (&["up_proj", "o_proj"][..], "gate_up_proj"), (&["gate_proj"][..], "gate_up_proj")] {
        let e = c.clone().with_lora(Some(LoraSpec::new(4, 8.0, ts)?)).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("fuses it into") && e.contains(fused), "{ts:?}: {e}");
    }
    let all = c.clone().with_lora(Some(LoraSpec::new(4, 8.0, &crate::lora::TARGETS)?));
    all.validate()?;
    assert_eq!(all.lora.as_ref().map(|l| l.targets.clone()).unwrap_or_default(), ["o_proj", "down_proj", "qkv_proj", "gate_up_proj"]);
    let named = c.clone().with_lora(Some(LoraSpec::new(4, 8.0, &["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])?));
    assert_eq!(named, all);
    // (the parts' adapters: one A per fused module, listed after its first part; B per part)
    let names: Vec<String> = crate::param_specs(&all).into_iter().map(|s| s.name).filter(|n| n.starts_with("model.layers.0.") && n.contains("lora")).collect();
    assert_eq!(names, [
        "model.layers.0.self_attn.qkv_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight", "model.layers.0.self_attn.k_proj.lora_B.weight",
        "model.layers.0.self_attn.v_proj.lora_B.weight", "model.layers.0.self_attn.o_proj.lora_A.weight", "model.layers.0.self_attn.o_proj.lora_B.weight",
        "model.layers.0.mlp.gate_up_proj.lora_A.weight", "model.layers.0.mlp.gate_proj.lora_B.weight", "model.layers.0.mlp.up_proj.lora_B.weight",
        "model.layers.0.mlp.down_proj.lora_A.weight", "model.layers.0.mlp.down_proj.lora_B.weight",
    ]);
    // another model: the fused modules are not its
    let e = LlamaConfig::tiny(64, 64, 2, 4, 2).with_lora(Some(LoraSpec::new(4, 8.0, &["qkv_proj"])?)).validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("qkv_proj is a Phi-3's fused module"), "{e}");
    // nor another architecture's features
    assert!(c.clone().with_qkv_bias(true).validate().is_err() && c.with_qk_norm(true).validate().is_err());
    Ok(())
}

#[test]
fn fused_names_and_rows() -> Result<()> {
    let c = LlamaConfig::tiny(64, 64, 2, 4, 2).with_phi3(true);
    let fused = |c: &LlamaConfig| c.phi3;
    assert_eq!(fused_checkpoint_name("model.layers.3.self_attn.k_proj.weight"), Some(("model.layers.3.self_attn.qkv_proj.weight".into(), 1)));
    assert_eq!(fused_checkpoint_name("model.layers.0.mlp.up_proj.weight"), Some(("model.layers.0.mlp.gate_up_proj.weight".into(), 1)));
    assert_eq!(fused_checkpoint_name("model.layers.0.mlp.up_proj.lora_B.weight"), Some(("model.layers.0.mlp.gate_up_proj.lora_B.weight".into(), 1)));
    assert_eq!(fused_checkpoint_name("model.layers.2.self_attn.v_proj.lora_magnitude_vector"), Some(("model.layers.2.self_attn.qkv_proj.lora_magnitude_vector".into(), 2)));
    assert_eq!(fused_parts("model.layers.2.mlp.gate_up_proj"), Some(vec!["model.layers.2.mlp.gate_proj".to_string(), "model.layers.2.mlp.up_proj".to_string()]));
    for other in ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.experts.up_proj.weight", "x.q_proj.weight", "model.layers.0.self_attn.q_proj.lora_A.weight"] {
        assert_eq!(fused_checkpoint_name(other), None, "{other}");
    }
    // q 4·16, k and v 2·16; gate and up 176 each
    assert_eq!(fused_rows(&c, "model.layers.1.self_attn.v_proj.weight"), Some((96, 32, 128)));
    assert_eq!(fused_rows(&c, "model.layers.1.mlp.up_proj.weight"), Some((176, 176, 352)));
    let names = ["model.layers.0.self_attn.v_proj.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"];
    let fused = fuse_checkpoint_tensors(fused(&c), names.iter().map(|n| (n.to_string(), *n)).collect())?;
    assert_eq!(fused, vec![
        ("model.layers.0.self_attn.qkv_proj.weight".to_string(), vec![names[2], names[3], names[0]]),
        ("model.norm.weight".to_string(), vec![names[1]]),
    ]);
    // not a Phi-3: nothing fused; a part missing: refused
    assert_eq!(fuse_checkpoint_tensors(false, names.iter().map(|n| (n.to_string(), 0)).collect())?.len(), 4);
    let e = fuse_checkpoint_tensors(true, vec![(names[0].to_string(), 0)]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("qkv_proj.weight: 1 of its 3 parts"), "{e}");
    Ok(())
}
