use super::*;
use crate::Arch;

/// DeepSeek-V3's config.json (its keys as published, without `quantization_config`: a bf16
/// conversion's).
const DEEPSEEK_V3: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
  "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
  "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
  "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
  "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
}"#;

fn err(text: &str) -> String {
    LlamaConfig::from_json(text).err().map(|e| e.to_string()).unwrap_or_default()
}

/// The config reads as DeepSeek-V3 (latent attention at 192 = 128 + 64, RoPE on 64, scale
/// 192^-1/2 · (0.1·ln 40 + 1)², 3 dense layers then 58 sparse of 256 experts in 8 groups),
/// writes back as `DeepseekV3ForCausalLM` and reads again the same.
#[test]
fn deepseek_v3_configs() -> Result<()> {
    let c = LlamaConfig::from_json(DEEPSEEK_V3)?;
    assert_eq!((c.arch(), c.head_dim, c.rope_dim(), c.num_key_value_heads, c.qkv_bias, c.qk_norm), (Arch::DeepseekV3, 192, 64, 128, false, false));
    assert_eq!(c.mla, Some(Mla::deepseek_v3()));
    let ms = 0.1 * 40f64.ln() + 1.0;
    assert!((c.attn_scale() - ms * ms / 192f64.sqrt()).abs() < 1e-15, "{}", c.attn_scale());
    // (YaRN's attention factor on cos, sin: mscale / mscale_all_dim = 1)
    assert_eq!(c.rope_scaling.attention_factor(), 1.0);
    let m = c.moe.clone().ok_or_else(|| candle_core::Error::Msg("no experts".into()))?;
    assert_eq!(
        (m.style, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size, m.routed_scaling_factor, m.groups, m.mlp_only_layers.clone()),
        (MoeStyle::Glm4Moe, 256, 8, 2048, 2048, 2.5, (8, 4), vec![0, 1, 2])
    );
    assert_eq!(c.moe_layers(), 58);
    let text = c.to_hf_json("bfloat16");
    let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str(), v["head_dim"].as_u64(), v["q_lora_rank"].as_u64(), v["num_nextn_predict_layers"].as_u64()), (Some("deepseek_v3"), Some("DeepseekV3ForCausalLM"), Some(64), Some(1536), Some(0)));
    assert!(v.get("use_qk_norm").is_none() && v.get("partial_rotary_factor").is_none());
    assert_eq!(LlamaConfig::from_json(&text)?, c);
    // DeepSeek-V2-Lite's attention form: one q_proj (q_lora_rank null), wider values
    let lite = DEEPSEEK_V3.replace(r#""q_lora_rank": 1536"#, r#""q_lora_rank": null"#).replace(r#""v_head_dim": 128"#, r#""v_head_dim": 256"#);
    let l = LlamaConfig::from_json(&lite)?;
    assert_eq!((l.mla.map(|a| a.q_lora_rank), l.head_dim), (Some(None), 256));
    assert_eq!(LlamaConfig::from_json(&l.to_hf_json("bfloat16"))?, l);
    Ok(())
}

/// Kimi K2's config.json (`model_type` `kimi_k2` over `DeepseekV3ForCausalLM`, its keys as
/// published, without `quantization_config`: a bf16 conversion's) reads as DeepSeek-V3 at its
/// shape (64 heads, 384 experts in one group, one dense layer, YaRN 32 over 4096); its FP8
/// release's `quantization_config` is refused by name.
#[test]
fn kimi_k2_configs() -> Result<()> {
    let k2 = DEEPSEEK_V3
        .replace(r#""model_type": "deepseek_v3""#, r#""model_type": "kimi_k2""#)
        .replace(r#""num_attention_heads": 128"#, r#""num_attention_heads": 64"#)
        .replace(r#""num_key_value_heads": 128"#, r#""num_key_value_heads": 64"#)
        .replace(r#""n_routed_experts": 256"#, r#""n_routed_experts": 384"#)
        .replace(r#""n_group": 8"#, r#""n_group": 1"#)
        .replace(r#""topk_group": 4"#, r#""topk_group": 1"#)
        .replace(r#""first_k_dense_replace": 3"#, r#""first_k_dense_replace": 1"#)
        .replace(r#""routed_scaling_factor": 2.5"#, r#""routed_scaling_factor": 2.827"#)
        .replace(r#""vocab_size": 129280"#, r#""vocab_size": 163840"#)
        .replace(r#""factor": 40"#, r#""factor": 32"#)
        .replace(r#""rope_theta": 10000"#, r#""rope_theta": 50000.0"#)
        .replace(r#""bos_token_id": 0, "eos_token_id": 1"#, r#""bos_token_id": 163584, "eos_token_id": 163585"#);
    assert!(k2.contains("kimi_k2") && k2.contains("384") && k2.contains("163585"));
    let c = LlamaConfig::from_json(&k2)?;
    assert_eq!((c.arch(), c.num_attention_heads, c.head_dim, c.vocab_size), (Arch::DeepseekV3, 64, 192, 163840));
    let m = c.moe.clone().ok_or_else(|| candle_core::Error::Msg("no experts".into()))?;
    assert_eq!((m.num_experts, m.groups, m.routed_scaling_factor, m.mlp_only_layers.clone()), (384, (1, 1), 2.827, vec![0]));
    assert_eq!(c.moe_layers(), 60);
    let fp8 = k2.replacen('{', r#"{"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},"#, 1);
    assert!(err(&fp8).contains("fp8"), "{}", err(&fp8));
    // (a model_type that names another architecture than `architectures` still disagrees)
    let e = err(&k2.replace("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"));
    assert!(e.contains("but architectures"), "{e}");
    Ok(())
}

/// DeepseekV3Config's defaults where the keys are absent; the refusals, by name.
#[test]
fn deepseek_v3_defaults_and_refusals() -> Result<()> {
    let base = r#""model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2"#;
    let d = LlamaConfig::from_json(&format!("{{{base}}}"))?;
    assert_eq!((d.mla, d.num_key_value_heads, d.head_dim, d.rms_norm_eps), (Some(Mla::deepseek_v3()), 4, 192, 1e-6));
    let m = d.moe.clone().ok_or_else(|| candle_core::Error::Msg("no experts".into()))?;
    assert_eq!((m.moe_intermediate_size, m.routed_scaling_factor, m.mlp_only_layers.clone(), m.norm_topk_prob), (2048, 2.5, vec![0, 1, 2], true));
    for (extra, want) in [
        (r#""attention_bias": true"#, "attention_bias"),
        (r#""scoring_func": "softmax""#, "scoring_func"),
        (r#""topk_method": "greedy""#, "topk_method"),
        (r#""moe_layer_freq": 2"#, "moe_layer_freq"),
        (r#""quantization_config": {"quant_method": "fp8"}"#, "weight_scale_inv"),
        (r#""qk_rope_head_dim": 7"#, "must be even for RoPE"),
        (r#""kv_lora_rank": 0"#, "kv_lora_rank"),
        (r#""num_key_value_heads": 2"#, "as many KV heads"),
        (r#""first_k_dense_replace": 4"#, "first_k_dense_replace"),
    ] {
        let e = err(&format!("{{{base}, {extra}}}"));
        assert!(e.contains(want), "{extra}: {e}");
    }
    // LoRA and DoRA on every projection
    let lora = |targets: &[&str], dora: bool| -> Result<LlamaConfig> { Ok(d.clone().with_lora(Some(crate::LoraSpec::new(4, 8.0, targets)?.with_dora(dora)))) };
    lora(&crate::lora::MLA_TARGETS, false)?.validate()?;
    lora(&crate::lora::MLA_TARGETS, true)?.validate()?;
    Ok(())
}

/// DeepSeek-V2-Lite's config.json (its keys as published).
const DEEPSEEK_V2_LITE: &str = r#"{
  "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
  "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
  "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16, "num_experts_per_tok": 6,
  "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": null,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
  "transformers_version": "4.39.3", "use_cache": true, "v_head_dim": 128, "vocab_size": 102400
}"#;

/// DeepSeek-V2-Lite reads as DeepSeek-V2 (one q_proj, interleaved RoPE, the scale 192^-1/2
/// without YaRN's mscale as transformers' DeepseekV2Attention, 64 experts 6 per token, 2 shared,
/// greedy, unscaled, layer 0 dense), writes back and reads again the same; the refusals by name.
#[test]
fn deepseek_v2_configs() -> Result<()> {
    let c = LlamaConfig::from_json(DEEPSEEK_V2_LITE)?;
    assert_eq!((c.arch(), c.head_dim, c.rope_dim(), c.num_key_value_heads), (Arch::DeepseekV2, 192, 64, 16));
    assert_eq!(c.mla, Some(Mla { q_lora_rank: None, ..Mla::deepseek_v3() }));
    assert!((c.attn_scale() - 1.0 / 192f64.sqrt()).abs() < 1e-15, "{}", c.attn_scale());
    let m = c.moe.clone().ok_or_else(|| candle_core::Error::Msg("no experts".into()))?;
    assert_eq!(
        (m.style, m.num_experts, m.num_experts_per_tok, m.shared_expert_intermediate_size, m.routed_scaling_factor, m.groups, m.mlp_only_layers.clone(), m.norm_topk_prob),
        (MoeStyle::DeepseekV2, 64, 6, 2816, 1.0, (1, 1), vec![0], false)
    );
    let text = c.to_hf_json("bfloat16");
    let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((v["model_type"].as_str(), v["topk_method"].as_str(), v["q_lora_rank"].is_null()), (Some("deepseek_v2"), Some("greedy"), true));
    assert_eq!(LlamaConfig::from_json(&text)?, c);
    let grouped = DEEPSEEK_V2_LITE.replace(r#""topk_method": "greedy""#, r#""topk_method": "group_limited_greedy""#).replace(r#""n_group": 1"#, r#""n_group": 8"#).replace(r#""topk_group": 1"#, r#""topk_group": 3"#);
    let g = LlamaConfig::from_json(&grouped)?;
    assert_eq!(g.moe.as_ref().map(|m| m.groups), Some((8, 3)));
    assert_eq!(LlamaConfig::from_json(&g.to_hf_json("bfloat16"))?, g);
    for (from, to, want) in [
        (r#""norm_topk_prob": false"#, r#""norm_topk_prob": true"#, "norm_topk_prob"),
        (r#""scoring_func": "softmax""#, r#""scoring_func": "sigmoid""#, "scoring_func"),
        (r#""topk_method": "greedy""#, r#""topk_method": "noaux_tc""#, "topk_method"),
        (r#""num_experts_per_tok": 6,"#, "", "num_experts_per_tok"),
        (r#""n_shared_experts": 2"#, r#""n_shared_experts": null"#, "n_shared_experts"),
    ] {
        let e = err(&DEEPSEEK_V2_LITE.replace(from, to));
        assert!(e.contains(want), "{to}: {e}");
    }
    Ok(())
}
