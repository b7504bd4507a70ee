//! Tests of `config` (included by `config.rs`).

use super::*;

const BASE: &str = r#""vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
    "num_hidden_layers": 2, "num_attention_heads": 8"#;

#[test]
fn legacy_and_new_rope_forms() -> Result<()> {
    let legacy = format!(
        r#"{{{BASE}, "rope_theta": 500000.0, "rope_scaling": {{"rope_type": "llama3",
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}}}"#
    );
    let new = format!(
        r#"{{{BASE}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 500000.0,
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}}}"#
    );
    let a = LlamaConfig::from_json(&legacy)?;
    let b = LlamaConfig::from_json(&new)?;
    assert_eq!(a, b);
    assert_eq!(a.rope_theta, 500000.0);
    assert_eq!(a.num_key_value_heads, 8);
    assert_eq!(a.head_dim, 16);
    assert!(matches!(a.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    // round trip through our writer
    let c = LlamaConfig::from_json(&a.to_hf_json("float32"))?;
    assert_eq!(a, c);
    Ok(())
}

#[test]
fn oracle_config() -> Result<()> {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/oracle/tiny-llama/config.json"
    );
    let c = LlamaConfig::from_file(p)?;
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers),
        (512, 128, 352, 2)
    );
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (8, 2, 16));
    assert_eq!(
        (c.rope_theta, c.rope_scaling.clone(), c.tie_word_embeddings),
        (500000.0, RopeScaling::Default, false)
    );
    Ok(())
}

#[test]
fn defaults_and_errors() -> Result<()> {
    let c = LlamaConfig::from_json(&format!(
        r#"{{{BASE}, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": true, "eos_token_id": [5, 9]}}"#
    ))?;
    assert_eq!(c.eos_token_id, Some(serde_json::json!([5, 9])));
    assert_eq!((c.num_key_value_heads, c.head_dim, c.rope_theta), (2, 32, 10000.0));
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rope_scaling, RopeScaling::Default);
    assert!(LlamaConfig::from_json(&format!(r#"{{{BASE}, "num_key_value_heads": 3}}"#)).is_err());
    assert!(LlamaConfig::from_json(&format!(
        r#"{{{BASE}, "rope_scaling": {{"type": "dynamic", "factor": 2.0}}}}"#
    ))
    .is_err());
    assert!(LlamaConfig::from_json(r#"{"hidden_size": 4}"#).is_err());
    // default RoPE: no `rope_scaling` key (transformers 5 aliases it to rope_parameters)
    let v: Value =
        serde_json::from_str(&c.to_hf_json("float32")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert!(v.get("rope_scaling").is_none());
    assert_eq!(v["rope_parameters"]["rope_type"], "default");
    assert_eq!(LlamaConfig::from_json(&c.to_hf_json("bfloat16"))?, c);
    Ok(())
}
#[test]
fn sliding_window_parse_and_round_trip() -> Result<()> {
    let mistral = format!(
        r#"{{{BASE}, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
        "num_key_value_heads": 2, "sliding_window": 4096}}"#
    );
    let c = LlamaConfig::from_json(&mistral)?;
    assert_eq!(c.sliding_window, Some(4096));
    assert_eq!((c.num_key_value_heads, c.head_dim), (2, 16));
    // null and absent: no window
    assert_eq!(LlamaConfig::from_json(&format!(r#"{{{BASE}, "sliding_window": null}}"#))?.sliding_window, None);
    assert_eq!(LlamaConfig::from_json(&format!("{{{BASE}}}"))?.sliding_window, None);
    // a window the config says it does not use (Qwen2 style)
    let unused = format!(r#"{{{BASE}, "sliding_window": 32768, "use_sliding_window": false}}"#);
    assert_eq!(LlamaConfig::from_json(&unused)?.sliding_window, None);
    // 0, negative, non-integer: errors naming the key
    for bad in ["0", "-3", "1.5", "\"big\""] {
        let e = LlamaConfig::from_json(&format!(r#"{{{BASE}, "sliding_window": {bad}}}"#))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("sliding_window"), "sliding_window {bad}: {e:?}");
    }
    assert!(c.clone().with_sliding_window(Some(0)).validate().is_err());
    assert!(c.validate().is_ok());
    // values that give NaN angles or norms are refused, naming the key
    for (key, bad) in [("rope_theta", "0"), ("rope_theta", "-10000.0"), ("rms_norm_eps", "-1e-5"), ("vocab_size", "0")] {
        let e = LlamaConfig::from_json(&format!(r#"{{{BASE}, "{key}": {bad}}}"#)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(key), "{key} {bad}: {e:?}");
    }
    for scaling in [
        r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0, "high_freq_factor": 4.0}"#,
        r#"{"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 0}"#,
    ] {
        let e = LlamaConfig::from_json(&format!(r#"{{{BASE}, "rope_scaling": {scaling}}}"#)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("rope scaling"), "{scaling}: {e:?}");
    }
    let mut nan = c.clone();
    nan.rope_theta = f64::NAN;
    assert!(nan.validate().is_err());
    // round trip keeps the window; the written config is a Mistral one (HF applies it)
    let text = c.to_hf_json("float32");
    let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((v["sliding_window"].as_u64(), v["model_type"].as_str()), (Some(4096), Some("mistral")));
    assert_eq!(v["architectures"][0], "MistralForCausalLM");
    assert_eq!(LlamaConfig::from_json(&text)?, c);
    // no window: written as null, still a Llama config, round trip keeps None
    let n = c.clone().with_sliding_window(None);
    let v: Value =
        serde_json::from_str(&n.to_hf_json("float32")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert!(v["sliding_window"].is_null() && v.get("sliding_window").is_some());
    assert_eq!(v["model_type"], "llama");
    assert_eq!(LlamaConfig::from_json(&n.to_hf_json("float32"))?, n);
    let t = LlamaConfig::tiny(64, 32, 2, 4, 2).with_sliding_window(Some(7));
    assert_eq!(t.sliding_window, Some(7));
    assert_eq!(LlamaConfig::from_json(&t.to_hf_json("bfloat16"))?, t);
    Ok(())
}
