use super::*;
use crate::Arch;

/// GLM-4.5-Air's shape (its config.json's keys).
const GLM45_AIR: &str = r#"{
  "architectures": ["Glm4MoeForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
  "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02,
  "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
  "moe_intermediate_size": 1408, "norm_topk_prob": true, "num_attention_heads": 96, "n_group": 1,
  "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
  "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 1000000,
  "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "use_cache": true, "use_qk_norm": false, "vocab_size": 151552
}"#;

/// The config reads as GLM-4.5 (biases, RoPE on 64 of 128 dimensions in the half form, layer 0
/// dense, 45 sparse layers of 128 experts with one shared), writes back as `Glm4MoeForCausalLM`
/// and reads again the same; GLM-4.5's own keys (head norms, 3 dense layers, scale 2.5).
#[test]
fn glm4_moe_configs() -> Result<()> {
    let c = LlamaConfig::from_json(GLM45_AIR)?;
    assert_eq!((c.arch(), c.qkv_bias, c.qk_norm, c.rope_dim(), c.interleaved_rope(), c.pre_and_post_norms()), (Arch::Glm4Moe, true, false, 64, None, false));
    let m = c.moe.clone().ok_or_else(|| candle_core::Error::Msg("no experts".into()))?;
    assert_eq!(
        (m.style, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size, m.routed_scaling_factor, m.groups, m.norm_topk_prob),
        (MoeStyle::Glm4Moe, 128, 8, 1408, 1408, 1.0, (1, 1), true)
    );
    assert_eq!((c.moe_layers(), c.is_moe_layer(0), c.is_moe_layer(1), m.output_router_logits), (45, false, true, false));
    let text = c.to_hf_json("bfloat16");
    let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str(), v["n_routed_experts"].as_u64(), v["first_k_dense_replace"].as_u64(), v["num_nextn_predict_layers"].as_u64()), (Some("glm4_moe"), Some("Glm4MoeForCausalLM"), Some(128), Some(1), Some(0)));
    assert!(v.get("num_experts").is_none() && v.get("mlp_only_layers").is_none());
    assert_eq!(LlamaConfig::from_json(&text)?, c);
    // GLM-4.5: head norms with the biases, 3 dense layers, 160 experts scaled by 2.5
    let big = GLM45_AIR
        .replace(r#""use_qk_norm": false"#, r#""use_qk_norm": true"#)
        .replace(r#""first_k_dense_replace": 1"#, r#""first_k_dense_replace": 3"#)
        .replace(r#""n_routed_experts": 128"#, r#""n_routed_experts": 160"#)
        .replace(r#""routed_scaling_factor": 1.0"#, r#""routed_scaling_factor": 2.5"#)
        .replace(r#""num_hidden_layers": 46"#, r#""num_hidden_layers": 92"#);
    let b = LlamaConfig::from_json(&big)?;
    let bm = b.moe.clone().ok_or_else(|| candle_core::Error::Msg("no experts".into()))?;
    assert_eq!((b.qk_norm, b.qkv_bias, b.moe_layers(), bm.mlp_only_layers.clone(), bm.routed_scaling_factor), (true, true, 89, vec![0, 1, 2], 2.5));
    assert_eq!(LlamaConfig::from_json(&b.to_hf_json("bfloat16"))?, b);
    Ok(())
}

/// Glm4MoeConfig's defaults where the keys are absent; the refusals, by name.
#[test]
fn glm4_moe_defaults_and_refusals() -> Result<()> {
    let base = r#""model_type": "glm4_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8"#;
    let d = LlamaConfig::from_json(&format!("{{{base}}}"))?;
    let m = d.moe.clone().ok_or_else(|| candle_core::Error::Msg("no experts".into()))?;
    assert_eq!((d.partial_rotary_factor, d.qkv_bias, d.qk_norm, d.rms_norm_eps), (0.5, false, false, 1e-5));
    assert_eq!((m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size, m.routed_scaling_factor, m.groups, m.mlp_only_layers.clone()), (128, 8, 1408, 1408, 1.0, (1, 1), vec![0]));
    let err = |extra: &str| LlamaConfig::from_json(&format!("{{{base}, {extra}}}")).err().map(|e| e.to_string()).unwrap_or_default();
    for (extra, want) in [
        (r#""output_router_logits": true"#, "output_router_logits"),
        (r#""n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 3"#, "n_group 3"),
        (r#""n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 3"#, "topk_group 3"),
        (r#""n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 1"#, "num_experts_per_tok 4"),
        (r#""first_k_dense_replace": 3"#, "first_k_dense_replace"),
        (r#""routed_scaling_factor": 0"#, "routed_scaling_factor"),
        (r#""use_qk_norm": 1"#, "use_qk_norm"),
    ] {
        let e = err(extra);
        assert!(e.contains(want), "{extra}: {e}");
    }
    // a window is no GLM-4.5's; nor another architecture's features
    let tiny = LlamaConfig::tiny(64, 32, 2, 4, 2).with_moe(Some(MoeConfig { mlp_only_layers: vec![0], ..MoeConfig::glm4_moe(4, 2, 16, 1, 1.0) }));
    tiny.validate()?;
    assert_eq!((tiny.arch(), tiny.rope_dim()), (Arch::Glm4Moe, 4));
    for (c, want) in [(tiny.clone().with_sliding_window(Some(8)), "GLM-4.5 with a sliding window"), (tiny.clone().with_gemma3(true), "GLM-4.5 with Gemma 3")] {
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(want), "{want}: {e}");
    }
    Ok(())
}

/// The multi-token-prediction layers are those from `num_hidden_layers` on, on GLM-4.5 only.
#[test]
fn next_token_layers_by_index() -> Result<()> {
    let c = LlamaConfig::from_json(GLM45_AIR)?;
    assert!(is_next_token_layer(&c, "model.layers.46.eh_proj.weight") && !is_next_token_layer(&c, "model.layers.45.mlp.gate.weight"));
    assert!(!is_next_token_layer(&LlamaConfig::tiny(64, 32, 2, 4, 2), "model.layers.2.mlp.gate.weight"));
    Ok(())
}
