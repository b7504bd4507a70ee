use super::*;

#[test]
fn presets_have_published_sizes() -> Result<()> {
    // Llama 3.1 model cards: 8.03B, 70.6B, 405.9B parameters.
    let b =
        |n: &str| -> Result<f64> { Ok(ModelConfig::preset(n)?.total_params() as f64 / 1e9) };
    assert!((b("llama3-8b")? - 8.03).abs() < 0.01, "{}", b("llama3-8b")?);
    assert!(
        (b("llama3-70b")? - 70.55).abs() < 0.05,
        "{}",
        b("llama3-70b")?
    );
    assert!(
        (b("llama3-405b")? - 405.85).abs() < 0.1,
        "{}",
        b("llama3-405b")?
    );
    let m = ModelConfig::preset("llama3-405b")?;
    assert_eq!((m.head_dim, m.q_dim(), m.kv_dim()), (128, 16384, 1024));
    // Qwen2.5 model cards: 7.61B and 72.7B parameters (with the q, k, v biases)
    let q7 = ModelConfig::preset("qwen2.5-7b")?;
    assert_eq!(q7.total_params(), 7_615_616_512);
    assert!((b("qwen2.5-72b")? - 72.7).abs() < 0.05, "{}", b("qwen2.5-72b")?);
    assert!(q7.qkv_bias && q7.head_dim == 128 && !m.qkv_bias);
    // Qwen3 model cards: 8.2B and 32.8B parameters (with the head norms)
    let (q8, q32) = (ModelConfig::preset("qwen3-8b")?, ModelConfig::preset("qwen3-32b")?);
    assert_eq!((q8.total_params(), q32.total_params()), (8_190_735_360, 32_762_123_264));
    assert!(q32.qk_norm && q32.q_dim() == 8192 && q32.hidden == 5120);
    // Gemma 3: google/gemma-3-1b-pt has 999,885,952 parameters (tied head, four norms and
    // the head norms per layer); the 27B's text model 27.0B (its checkpoint's 27.4B holds
    // the vision tower too)
    assert_eq!(ModelConfig::preset("gemma3-1b")?.total_params(), 999_885_952);
    // Phi-3 as published (microsoft/Phi-3-{mini, medium}-128k-instruct: 3,821,079,552 and
    // 13,960,238,080 parameters)
    let (p3, p14) = (ModelConfig::preset("phi3-mini")?, ModelConfig::preset("phi3-medium")?);
    assert_eq!((p3.total_params(), p14.total_params()), (3_821_079_552, 13_960_238_080));
    assert_eq!((p3.head_dim, p14.head_dim, p14.kv_heads), (96, 128, 10));
    // SmolLM3-3B (HuggingFaceTB/SmolLM3-3B, "3B"): 3,075,098,624 from its config.json
    // arithmetic (tied head); its config.json reads to the preset's shape, and with
    // use_sliding_window its window sits on the NoPE layers (9 of 36)
    let sm = ModelConfig::preset("smollm3-3b")?;
    assert_eq!((sm.total_params(), sm.head_dim, sm.kv_heads, sm.tie_embeddings), (3_075_098_624, 128, 4, true));
    let cfg = r#"{"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008,
        "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 128256, "sliding_window": 4096"#;
    assert_eq!(ModelConfig { name: "smollm3-3b".into(), ..ModelConfig::from_hf_json(&format!("{cfg}}}"), "x")? }, sm);
    let w = ModelConfig::from_hf_json(&format!(r#"{cfg}, "use_sliding_window": true}}"#), "x")?;
    assert_eq!((w.sliding_window, w.partial_window), (None, Some((4096, 9))));
    // Mistral Small 3.1's text model ("24B" with its vision tower): 23,572,403,200 from its
    // config.json arithmetic; the multimodal config.json reads to the preset's shape
    let ms = ModelConfig::preset("mistral-small-24b")?;
    assert_eq!((ms.total_params(), ms.head_dim, ms.kv_heads, ms.tie_embeddings), (23_572_403_200, 128, 8, false));
    let cfg = r#"{"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": {"head_dim": 128,
        "hidden_size": 5120, "intermediate_size": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
        "num_key_value_heads": 8, "sliding_window": null, "vocab_size": 131072}, "vision_config": {"model_type": "pixtral"}}"#;
    assert_eq!(ModelConfig { name: "mistral-small-24b".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, ms);
    assert!(ModelConfig::from_hf_json(r#"{"model_type": "mistral3"}"#, "x").is_err());
    // OLMo 3 (allenai/Olmo-3-1025-7B "7B", Olmo-3-1125-32B "32B"): 7,298,011,136 and
    // 32,233,522,176 from their config.json arithmetic (untied head; q / k norms [a·d],
    // [a_kv·d] and the two norms after the branches per layer); the 32B's config.json reads to
    // the preset's shape (window 4096 on 48 of its 64 layers: 3 of every 4)
    let (o7, o32) = (ModelConfig::preset("olmo3-7b")?, ModelConfig::preset("olmo3-32b")?);
    assert_eq!((o7.total_params(), o32.total_params()), (7_298_011_136, 32_233_522_176));
    assert_eq!((o32.kv_heads, o32.head_dim, o32.partial_window, o32.post_norms, o32.qk_norm_flat, o32.sandwich_norms, o32.qk_norm), (8, 128, Some((4096, 48)), true, true, true, false));
    let cfg = r#"{"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 100278, "sliding_window": 4096}"#;
    assert_eq!(ModelConfig { name: "olmo3-32b".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, o32);
    // OLMo 2 7B (allenai/OLMo-2-1124-7B): 7,298,617,344; no window whatever the config says
    let o2 = ModelConfig::preset("olmo2-7b")?;
    assert_eq!((o2.total_params(), o2.partial_window, o2.sliding_window), (7_298_617_344, None, None));
    let cfg = r#"{"model_type": "olmo2", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "vocab_size": 100352, "sliding_window": 4096}"#;
    assert_eq!(ModelConfig { name: "olmo2-7b".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, o2);
    // OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924, "6.9B total, 1.3B active"): 6,919,161,856 from its
    // config.json arithmetic; its config.json reads to the preset's shape
    let oe = ModelConfig::preset("olmoe-1b-7b")?;
    assert_eq!((oe.total_params(), oe.post_norms, oe.qk_norm_flat, oe.sandwich_norms), (6_919_161_856, false, true, false));
    let cfg = r#"{"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "norm_topk_prob": false, "vocab_size": 50304, "clip_qkv": null}"#;
    assert_eq!(ModelConfig { name: "olmoe-1b-7b".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, oe);
    // EXAONE 4.0 (a 32B-shaped config.json, "LLLG"): OLMo 2's norms with head norms, the
    // window on 48 of 64 layers
    let cfg = r#"{"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "hidden_size": 5120, "intermediate_size": 27392,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 102400,
        "sliding_window": 4096, "sliding_window_pattern": "LLLG"}"#;
    let ex = ModelConfig::from_hf_json(cfg, "x")?;
    assert_eq!((ex.post_norms, ex.qk_norm, ex.qk_norm_flat, ex.sandwich_norms, ex.partial_window), (true, true, false, true, Some((4096, 48))));
    assert_eq!(ex.layer_norm_params() + ex.qk_norm_params(), 2 * 5120 + 2 * 128);
    // ... which is the preset's (LGAI-EXAONE/EXAONE-4.0-32B, "30.95B without embeddings"):
    // 32,003,216,384 from its config.json arithmetic, 30,954,640,384 without the embedding and
    // the untied head
    let e32 = ModelConfig::preset("exaone4-32b")?;
    assert_eq!(ModelConfig { name: "exaone4-32b".into(), ..ex }, e32);
    assert_eq!((e32.total_params(), e32.total_params() - 2 * 102_400 * 5120), (32_003_216_384, 30_954_640_384));
    // GraniteMoE (ibm-granite/granite-3.1-1b-a400m, -3b-a800m: "1.3B" and "3.3B" total, "400M"
    // and "800M" active): 1,334,628,352 and 3,298,793,472 from their config.json arithmetic
    // (tied head), 378M and 807M active without the embedding; the 3B's config.json reads to
    // the preset's shape
    let (g1, g3) = (ModelConfig::preset("granite3-1b-a400m")?, ModelConfig::preset("granite3-3b-a800m")?);
    assert_eq!((g1.total_params(), g3.total_params()), (1_334_628_352, 3_298_793_472));
    let active = |m: &ModelConfig| ((m.active_params() - m.embedding_params()) as f64 / 1e6).round();
    assert_eq!((active(&g1), active(&g3)), (378.0, 807.0));
    let cfg = r#"{"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", "hidden_size": 1536, "intermediate_size": 512,
        "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "num_local_experts": 40, "num_experts_per_tok": 8,
        "vocab_size": 49155, "tie_word_embeddings": true, "embedding_multiplier": 12.0}"#;
    assert_eq!(ModelConfig { name: "granite3-3b-a800m".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, g3);
    for t in ["granitemoeshared", "granitemoehybrid"] {
        let e = ModelConfig::from_hf_json(&format!(r#"{{"model_type": "{t}", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}}"#), "x").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("not planned"), "{t}: {e}");
    }
    // GLM-4-9B-0414 ("9.4B" on its model page): 9,400,279,040 from its config.json arithmetic
    // (q, k, v biases, four norms per layer, untied head); its config.json reads to the preset
    let g4 = ModelConfig::preset("glm4-9b")?;
    assert_eq!(g4.total_params(), 9_400_279_040);
    let cfg = r#"{"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "attention_bias": true, "head_dim": 128, "hidden_size": 4096,
        "intermediate_size": 13696, "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
        "tie_word_embeddings": false, "vocab_size": 151552}"#;
    assert_eq!(ModelConfig { name: "glm4-9b".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, g4);
    assert_eq!((g4.qkv_bias, g4.sandwich_norms, g4.post_norms, g4.kv_heads), (true, true, false, 2));
    // GLM-4-9B-chat-hf (model_type glm): the same shapes with a Llama's two norms per layer,
    // 2 · 40 · 4096 = 327,680 fewer parameters; its biases default on
    let glm = ModelConfig::from_hf_json(&cfg.replace("Glm4ForCausalLM", "GlmForCausalLM").replace("\"glm4\"", "\"glm\"").replace(r#""attention_bias": true, "#, ""), "x")?;
    assert_eq!((glm.total_params(), glm.qkv_bias, glm.sandwich_norms, glm.sliding_window), (9_400_279_040 - 327_680, true, false, None));
    // GLM-4.5-Air ("106B total, 12B active"): 106,852,251,264 from its config.json arithmetic
    // (layer 0 dense, 45 layers of 128 experts 1408 wide with one shared, each router's [E, h]
    // and correction bias [E], q, k, v biases, untied head; the multi-token-prediction layer
    // not counted); its config.json reads to the preset. GLM-4.5 ("355B", 32B active, with that
    // layer): 352,797,829,024 (3 dense layers, 160 experts 1536 wide, head norms)
    let air = ModelConfig::preset("glm4.5-air")?;
    assert_eq!((air.total_params(), air.qkv_bias, air.qk_norm, air.sandwich_norms), (106_852_251_264, true, false, false));
    let cfg = r#"{"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": true, "head_dim": 128, "hidden_size": 4096,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "norm_topk_prob": true, "num_attention_heads": 96, "n_group": 1, "topk_group": 1,
        "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "num_hidden_layers": 46, "num_key_value_heads": 8, "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1, "tie_word_embeddings": false,
        "use_qk_norm": false, "vocab_size": 151552}"#;
    assert_eq!(ModelConfig { name: "glm4.5-air".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, air);
    let g45 = ModelConfig::preset("glm4.5")?;
    assert_eq!((g45.total_params(), g45.qk_norm, g45.moe.as_ref().map(|m| m.sparse_layers)), (352_797_829_024, true, Some(89)));
    // DeepSeek-V3 ("671B", 37B active; its multi-token-prediction layer not counted):
    // 671,026,419,200 from its config.json arithmetic (per layer the latent attention's
    // 187,105,280 matrix parameters and 2,048 latent norm weights; 3 dense layers, 58 of 256
    // experts 2048 wide with one shared, the routers' correction biases); the attention runs at
    // head dim 192 (256 on a GPU, the planner's) over 128 KV heads; its config.json (defaults
    // for what it leaves out) reads to the preset
    let ds = ModelConfig::preset("deepseek-v3")?;
    assert_eq!((ds.total_params(), ds.head_dim, ds.kv_heads, ds.qkv_bias, ds.moe.as_ref().map(|m| m.sparse_layers)), (671_026_419_200, 256, 128, false, Some(58)));
    assert_eq!(ds.mla.map(|a| (a.attn_dim(), a.cuda_attn_dim())), Some((192, 256)));
    // (its model FLOPs: QKᵀ at 192 and PV at 128 of the kernels' 2 × 256)
    assert_eq!((ds.attn_model_fraction(), ModelConfig::preset("llama3-8b")?.attn_model_fraction()), (0.625, 1.0));
    assert_eq!([15, 16, 33, 80, 96, 100, 192, 257, 576].map(crate::model::cuda_head_dim), [16, 16, 64, 96, 96, 128, 256, 257, 576]);
    assert_eq!(ds.mla.map(|a| a.down_params(7168) + a.up_params(7168, 128)), Some(187_105_280));
    assert_eq!(ds.active_params(), 37_552_297_472);
    let cfg = r#"{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_attention_heads": 128,
        "num_key_value_heads": 128, "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "vocab_size": 129280, "tie_word_embeddings": false}"#;
    assert_eq!(ModelConfig { name: "deepseek-v3".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, ds);
    assert_eq!(ModelConfig { name: "deepseek-v3".into(), ..ModelConfig::from_hf_json(r#"{"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 128, "num_hidden_layers": 61, "vocab_size": 129280}"#, "x")? }, ds);
    // Phi-4-mini (microsoft/Phi-4-mini-instruct, "3.8B"): 3,836,021,760 from its config.json
    // arithmetic (tied head)
    let p4 = ModelConfig::preset("phi4-mini")?;
    assert_eq!((p4.total_params(), p4.head_dim, p4.kv_heads, p4.tie_embeddings, p4.fused_proj), (3_836_021_760, 128, 8, true, true));
    // Phi-4 (microsoft/phi-4, "14.7B"): Phi-3-medium with a 100352-token vocabulary, untied
    let p14b = ModelConfig::preset("phi4")?;
    assert_eq!((p14b.total_params(), p14b.kv_heads, p14b.tie_embeddings, p14b.fused_proj), (14_659_507_200, 10, false, true));
    // gpt-oss as published (openai/gpt-oss-{20b, 120b}: 20,914,757,184 and 116,829,156,672
    // parameters: sinks, o_proj and q, k, v biases, the router's and the experts' biases); a
    // token goes through 4 experts of 32 / 128
    let (o20, o120) = (ModelConfig::preset("gpt-oss-20b")?, ModelConfig::preset("gpt-oss-120b")?);
    assert_eq!((o20.total_params(), o120.total_params()), (20_914_757_184, 116_829_156_672));
    assert_eq!((o20.head_dim, o20.kv_heads, o20.partial_window, o20.qkv_bias), (64, 8, Some((128, 12)), true));
    // active: the published 3.61B and 5.13B leave the embedding matrix out (the head counts)
    let active = |m: &ModelConfig| ((m.active_params() - m.embedding_params()) as f64 / 1e7).round();
    assert_eq!((active(&o20), active(&o120)), (361.0, 513.0));
    // openai/gpt-oss-20b's config.json reads to the preset's shape
    let cfg = r#"{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "experts_per_token": 4, "num_experts_per_tok": 4, "sliding_window": 128, "vocab_size": 201088, "tie_word_embeddings": false}"#;
    assert_eq!(ModelConfig { name: "gpt-oss-20b".into(), ..ModelConfig::from_hf_json(cfg, "x")? }, o20);
    // Gemma 2 as published (google/gemma-2-{2b, 9b, 27b}: 2,614,341,888, 9,241,705,984 and
    // 27,227,128,320 parameters)
    let g2: Vec<u64> = ["gemma2-2b", "gemma2-9b", "gemma2-27b"].iter().map(|n| ModelConfig::preset(n).map(|m| m.total_params())).collect::<Result<_>>()?;
    assert_eq!(g2, vec![2_614_341_888, 9_241_705_984, 27_227_128_320]);
    let g9 = ModelConfig::preset("gemma2-9b")?;
    assert_eq!((g9.head_dim, g9.partial_window, g9.sandwich_norms, g9.qk_norm), (256, Some((4096, 21)), true, false));
    assert!((b("gemma3-27b")? - 27.01).abs() < 0.01, "{}", b("gemma3-27b")?);
    // Qwen3-MoE: Qwen/Qwen3-30B-A3B's 30,532,122,624 parameters (3.3B activated), the
    // 235B-A22B's 235.09B (22.2B activated), from their config.json arithmetic
    let (a3, a22) = (ModelConfig::preset("qwen3-30b-a3b")?, ModelConfig::preset("qwen3-235b-a22b")?);
    assert_eq!((a3.total_params(), a3.active_params()), (30_532_122_624, 3_353_032_704));
    assert_eq!((a22.total_params(), a22.active_params()), (235_093_634_560, 22_190_763_520));
    assert!(a3.qk_norm && a3.head_dim == 128 && a3.sparse_fraction() == 1.0);
    // the published config reads as the preset
    let text = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe","hidden_size":2048,"num_hidden_layers":48,
        "num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"intermediate_size":6144,"vocab_size":151936,
        "moe_intermediate_size":768,"num_experts":128,"norm_topk_prob":true,"num_experts_per_tok":8,"decoder_sparse_step":1,"mlp_only_layers":[],
        "tie_word_embeddings":false,"use_sliding_window":false,"sliding_window":null,"max_window_layers":48}"#;
    assert_eq!(ModelConfig::from_hf_json(text, "qwen3-30b-a3b")?, a3);
    // two of its 48 layers dense: 2 · (3·h·f − router − experts) fewer parameters
    let some = ModelConfig::from_hf_json(&text.replace(r#""mlp_only_layers":[]"#, r#""mlp_only_layers":[0, 47]"#), "m")?;
    assert_eq!(some.moe.as_ref().map(|m| m.sparse_layers), Some(46));
    assert_eq!(a3.total_params() - some.total_params(), 2 * (128 * 2048 + 3 * 2048 * 768 * 128 - 3 * 2048 * 6144));
    // Qwen/Qwen1.5-MoE-A2.7B (q, k, v biases, a shared expert 5632 wide): 14.3B, 2.7B active
    let q15 = ModelConfig::from_hf_json(
        r#"{"architectures":["Qwen2MoeForCausalLM"],"model_type":"qwen2_moe","hidden_size":2048,"intermediate_size":5632,
            "num_attention_heads":16,"num_hidden_layers":24,"num_key_value_heads":16,"vocab_size":151936,"moe_intermediate_size":1408,
            "num_experts":60,"num_experts_per_tok":4,"shared_expert_intermediate_size":5632,"tie_word_embeddings":false}"#,
        "q15",
    )?;
    assert_eq!((q15.total_params(), q15.active_params()), (14_315_784_192, 2_689_173_504));
    assert!(q15.qkv_bias && !q15.qk_norm && q15.moe.as_ref().is_some_and(|m| m.shared_ffn == 5632));
    let e = ModelConfig::from_hf_json(&text.replace("qwen3_moe", "llama4"), "m").unwrap_err();
    assert!(e.0.contains("'llama4'"), "{e}");
    // Kimi K2 ("1T" total, "32B" activated on its card; moonshotai/Kimi-K2-Instruct's config.json
    // arithmetic, its MTP layer not counted as DeepSeek-V3's): DeepSeek-V3's attention with 64
    // heads, 60 sparse layers of 384 experts 2048 wide and one shared, vocabulary 163840
    let k2 = ModelConfig::preset("kimi-k2")?;
    assert_eq!((k2.total_params(), k2.active_params(), k2.head_dim, k2.kv_heads), (1_026_408_232_448, 32_861_500_928, 256, 64));
    let k2_json = r#"{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_intermediate_size": 2048,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_attention_heads": 64,
        "num_key_value_heads": 64, "num_hidden_layers": 61, "n_group": 1, "topk_group": 1, "vocab_size": 163840, "tie_word_embeddings": false}"#;
    assert_eq!(ModelConfig { name: "kimi-k2".into(), ..ModelConfig::from_hf_json(k2_json, "x")? }, k2);
    // DeepSeek-V2-Lite ("16B", 2.4B active): 15,706,484,224 from its config.json arithmetic (one
    // q_proj; layer 0 dense, 26 of 64 experts 1408 wide, 6 per token, two shared, no correction
    // bias)
    let lite = ModelConfig::from_hf_json(
        r#"{"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "first_k_dense_replace": 1, "hidden_size": 2048,
            "intermediate_size": 10944, "kv_lora_rank": 512, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64,
            "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
            "num_key_value_heads": 16, "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "tie_word_embeddings": false,
            "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400}"#,
        "v2-lite",
    )?;
    assert_eq!((lite.total_params(), lite.head_dim, lite.mla.map(|a| a.q_lora_rank)), (15_706_484_224, 256, Some(None)));
    assert!(lite.moe.as_ref().is_some_and(|m| m.sigmoid_router && !m.correction_bias && !m.norm_topk && m.shared_ffn == 2816 && m.sparse_layers == 26));
    // Mixtral 8x7B: 46.7B parameters, 12.9B active (its config.json's arithmetic)
    let mx = ModelConfig::preset("mixtral-8x7b")?;
    assert_eq!((mx.total_params(), mx.active_params()), (46_702_792_704, 12_879_925_248));
    let text = r#"{"architectures":["MixtralForCausalLM"],"model_type":"mixtral","hidden_size":4096,"intermediate_size":14336,
        "num_attention_heads":32,"num_experts_per_tok":2,"num_hidden_layers":32,"num_key_value_heads":8,"num_local_experts":8,
        "sliding_window":null,"tie_word_embeddings":false,"vocab_size":32000}"#;
    assert_eq!(ModelConfig::from_hf_json(text, "mixtral-8x7b")?, mx);
    Ok(())
}

#[test]
fn unknown_preset_is_an_error() {
    let e = ModelConfig::from_name_or_path("llama3-7b").unwrap_err();
    assert!(e.0.contains("unknown model preset 'llama3-7b'"), "{e}");
}

#[test]
fn hf_config_parses_and_matches_preset() -> Result<()> {
    let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,
        "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
        "intermediate_size":14336,"vocab_size":128256,"tie_word_embeddings":false}"#;
    let m = ModelConfig::from_hf_json(text, "cfg")?;
    let p = ModelConfig::preset("llama3-8b")?;
    assert_eq!(m.total_params(), p.total_params());
    assert_eq!((m.kv_heads, m.head_dim), (8, 128));
    Ok(())
}

#[test]
fn bad_hf_configs_are_errors() {
    let e = ModelConfig::from_hf_json("{not json", "x.json").unwrap_err();
    assert!(e.0.contains("not valid JSON"), "{e}");
    let e = ModelConfig::from_hf_json(r#"{"hidden_size":64}"#, "x.json").unwrap_err();
    assert!(e.0.contains("missing field 'num_hidden_layers'"), "{e}");
    let t = r#"{"hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":3,"intermediate_size":128,"vocab_size":10}"#;
    let e = ModelConfig::from_hf_json(t, "x.json").unwrap_err();
    assert!(
        e.0.contains("num_key_value_heads 3 must divide num_attention_heads 4"),
        "{e}"
    );
    let t = r#"{"hidden_size":-1}"#;
    assert!(ModelConfig::from_hf_json(t, "x.json")
        .unwrap_err()
        .0
        .contains("positive integer"));
    let e = ModelConfig::from_name_or_path("/nonexistent/config.json").unwrap_err();
    assert!(e.0.contains("cannot read model config"), "{e}");
}

#[test]
fn hf_sliding_window() -> Result<()> {
    let base = r#""hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,
        "num_key_value_heads":8,"intermediate_size":14336,"vocab_size":32000"#;
    let parse = |extra: &str| ModelConfig::from_hf_json(&format!("{{{base}{extra}}}"), "m");
    assert_eq!(parse("")?.sliding_window, None);
    assert_eq!(parse(r#","sliding_window":null"#)?.sliding_window, None);
    assert_eq!(
        parse(r#","sliding_window":4096"#)?.sliding_window,
        Some(4096)
    );
    // Qwen2 style: the window is off unless use_sliding_window is true.
    let off = r#","use_sliding_window":false,"sliding_window":4096"#;
    assert_eq!(parse(off)?.sliding_window, None);
    let on = r#","use_sliding_window":true,"sliding_window":4096"#;
    assert_eq!(parse(on)?.sliding_window, Some(4096));
    let e = parse(r#","sliding_window":0"#).unwrap_err();
    assert!(
        e.0.contains("'sliding_window' must be a positive integer, got 0"),
        "{e}"
    );
    let e = parse(r#","sliding_window":"4k""#).unwrap_err();
    assert!(
        e.0.contains("'sliding_window' must be a positive integer"),
        "{e}"
    );
    // Qwen2: q, k, v biases; use_sliding_window false when absent; the window on the
    // layers from max_window_layers (default 28) on: all (0), none (>= 32), else some
    // (`partial_window`, planned as full attention)
    let q = |extra: &str| parse(&format!(r#","model_type":"qwen2","sliding_window":4096{extra}"#));
    assert!(q("")?.qkv_bias && !parse("")?.qkv_bias);
    assert_eq!(q("")?.sliding_window, None);
    assert_eq!(q(r#","use_sliding_window":true,"max_window_layers":0"#)?.sliding_window, Some(4096));
    assert_eq!(q(r#","use_sliding_window":true,"max_window_layers":32"#)?.sliding_window, None);
    let some = q(r#","use_sliding_window":true"#)?;
    assert_eq!((some.sliding_window, some.partial_window), (None, Some((4096, 4))));
    // layer_types decide when given (any architecture): all, none, some
    let types = |t: &[&str]| format!(r#","sliding_window":64,"num_hidden_layers":{},"layer_types":{}"#, t.len(), serde_json::json!(t));
    let short = |t: &[&str]| ModelConfig::from_hf_json(&format!("{{{}{}}}", base.replace(r#""num_hidden_layers":32,"#, ""), types(t)), "m");
    let (s, f) = ("sliding_attention", "full_attention");
    assert_eq!((short(&[s, s])?.sliding_window, short(&[s, s])?.partial_window), (Some(64), None));
    assert_eq!((short(&[f, f])?.sliding_window, short(&[f, f])?.partial_window), (None, None));
    assert_eq!((short(&[f, s, s])?.sliding_window, short(&[f, s, s])?.partial_window), (None, Some((64, 2))));
    assert!(short(&[s, "chunked_attention"]).unwrap_err().0.contains("chunked_attention"));
    let e = ModelConfig::from_hf_json(&format!("{{{base}{}}}", r#","sliding_window":64,"layer_types":["full_attention"]"#), "m").unwrap_err();
    assert!(e.0.contains("a list of 32 entries"), "{e}");
    // Gemma 3 (text): head norms, a tied head, head dim 256, five sliding layers of six
    // (window 4096 unless given)
    let g = ModelConfig::from_hf_json(
        r#"{"model_type":"gemma3_text","hidden_size":1152,"num_hidden_layers":26,"num_attention_heads":4,
            "num_key_value_heads":1,"intermediate_size":6912,"vocab_size":262144,"sliding_window":512}"#,
        "g",
    )?;
    assert!(g.qk_norm && g.tie_embeddings && !g.qkv_bias && g.sandwich_norms);
    assert_eq!(g.layer_norm_params(), 4 * 1152);
    assert_eq!((g.head_dim, g.sliding_window, g.partial_window), (256, None, Some((512, 22))));
    assert_eq!(g, ModelConfig { name: "g".into(), ..ModelConfig::preset("gemma3-1b")? });
    // the 12B's and 27B's published text_config (google/gemma-3-{12b,27b}-it)
    let mm = |t: &str| ModelConfig::from_hf_json(&format!(r#"{{"model_type":"gemma3","text_config":{{"model_type":"gemma3_text",{t}}}}}"#), "g");
    let g12 = mm(r#""hidden_size":3840,"intermediate_size":15360,"num_attention_heads":16,"num_hidden_layers":48,"num_key_value_heads":8,"sliding_window":1024"#)?;
    assert_eq!(g12, ModelConfig { name: "g".into(), ..ModelConfig::preset("gemma3-12b")? });
    let g27 = mm(r#""head_dim":128,"hidden_size":5376,"intermediate_size":21504,"num_attention_heads":32,"num_hidden_layers":62,"num_key_value_heads":16,"query_pre_attn_scalar":168,"sliding_window":1024"#)?;
    assert_eq!(g27, ModelConfig { name: "g".into(), ..ModelConfig::preset("gemma3-27b")? });
    assert_eq!(g27.partial_window, Some((1024, 52)));
    let g = ModelConfig::from_hf_json(
        r#"{"architectures":["Gemma3ForCausalLM"],"hidden_size":1152,"num_hidden_layers":26,"num_attention_heads":4,
            "num_key_value_heads":1,"intermediate_size":6912,"vocab_size":262144,"sliding_window_pattern":2}"#,
        "g",
    )?;
    assert_eq!(g.partial_window, Some((4096, 13)));
    // Gemma 2 (google/gemma-2-27b's config.json, its shape keys): the window on every
    // other layer, no head norms, the two extra norms
    let g = ModelConfig::from_hf_json(
        r#"{"architectures":["Gemma2ForCausalLM"],"model_type":"gemma2","head_dim":128,"hidden_size":4608,"intermediate_size":36864,
            "num_attention_heads":32,"num_hidden_layers":46,"num_key_value_heads":16,"vocab_size":256000,"sliding_window":4096,
            "attn_logit_softcapping":50.0,"final_logit_softcapping":30.0,"query_pre_attn_scalar":144}"#,
        "g",
    )?;
    assert_eq!(g, ModelConfig { name: "g".into(), ..ModelConfig::preset("gemma2-27b")? });
    assert!(g.sandwich_norms && !g.qk_norm && g.tie_embeddings && g.partial_window == Some((4096, 23)));
    // a multimodal one (google/gemma-3-4b-it's text_config): its text model, defaults filled
    let g = ModelConfig::from_hf_json(
        r#"{"architectures":["Gemma3ForConditionalGeneration"],"model_type":"gemma3","text_config":{"hidden_size":2560,
            "intermediate_size":10240,"model_type":"gemma3_text","num_hidden_layers":34,"sliding_window":1024},
            "vision_config":{"hidden_size":1152}}"#,
        "g",
    )?;
    assert!(g.sandwich_norms && g.qk_norm && g.tie_embeddings);
    assert_eq!((g.hidden, g.layers, g.heads, g.kv_heads, g.head_dim, g.vocab), (2560, 34, 8, 4, 256, 262208));
    assert_eq!(g.partial_window, Some((1024, 29)));
    assert_eq!(g, ModelConfig { name: "g".into(), ..ModelConfig::preset("gemma3-4b")? });
    let e = ModelConfig::from_hf_json(r#"{"model_type":"gemma3"}"#, "g").unwrap_err();
    assert!(e.0.contains("text_config"), "{e}");
    // the biases: a·d + 2·a_kv·d = 4096 + 2·1024 more per layer
    assert_eq!(q("")?.layer_params() - parse("")?.layer_params(), 6144);
    let e = parse(r#","use_sliding_window":"yes""#).unwrap_err();
    assert!(
        e.0.contains("'use_sliding_window' must be true or false"),
        "{e}"
    );
    assert_eq!(ModelConfig::preset("llama3-8b")?.sliding_window, None);
    let mut m = ModelConfig::preset("llama3-8b")?;
    m.sliding_window = Some(0);
    assert!(m
        .validate()
        .unwrap_err()
        .0
        .contains("sliding window must be at least 1"));
    Ok(())
}

/// A reward model's config (`*ForSequenceClassification`, `*ForTokenClassification`) plans a
/// score head in place of the output projection: `n·h` parameters (`+ n` with a token
/// classifier's bias), `n` scores per token in the head's FLOPs and memory.
#[test]
fn classifiers_plan_their_score_heads() -> Result<()> {
    let base = r#""hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "model_type": "llama""#;
    let lm = ModelConfig::from_hf_json(&format!("{{{base}}}"), "lm")?;
    let seq = ModelConfig::from_hf_json(&format!(r#"{{{base}, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}}"#), "rm")?;
    let tok = ModelConfig::from_hf_json(&format!(r#"{{{base}, "architectures": ["LlamaForTokenClassification"]}}"#), "prm")?;
    assert_eq!((lm.score_head, seq.score_head, tok.score_head), (None, Some(ScoreHead { labels: 1, bias: false }), Some(ScoreHead { labels: 2, bias: true })));
    let (v, h) = (128_256u64, 4096u64);
    assert_eq!(seq.total_params(), lm.total_params() - v * h + h);
    assert_eq!(tok.total_params(), lm.total_params() - v * h + 2 * h + 2);
    assert_eq!((seq.output_width(), tok.output_width(), lm.output_width()), (1, 2, 128_256));
    // (id2label counts the labels)
    let three = ModelConfig::from_hf_json(&format!(r#"{{{base}, "architectures": ["LlamaForTokenClassification"], "id2label": {{"0": "a", "1": "b", "2": "c"}}}}"#), "prm3")?;
    assert_eq!(three.score_head.map(|s| s.labels), Some(3));
    let unbiased = ModelConfig::from_hf_json(&format!(r#"{{{base}, "architectures": ["LlamaForTokenClassification"], "token_classification_bias": false}}"#), "prm0")?;
    assert_eq!(unbiased.score_head, Some(ScoreHead { labels: 2, bias: false }));
    let e = ModelConfig::from_hf_json(&format!(r#"{{{base}, "architectures": ["LlamaForSequenceClassification"], "num_labels": 0}}"#), "none").unwrap_err();
    assert!(format!("{e:?}").contains("no label"), "{e:?}");
    // the head's memory: f32 scores of its labels per token, not the vocabulary's logits
    let l = crate::Layout { tp: 8, cp: 2, ..crate::Layout::default() };
    let am = crate::layout::ActivationModel::Llama;
    let (a, b) = (crate::memory::activation_totals(am, &lm, &l, 8192, 1, 2, 1), crate::memory::activation_totals(am, &tok, &l, 8192, 1, 2, 1));
    assert_eq!((a.logits, b.logits), (4096.0 * 128_256.0 / 8.0 * 4.0, 4096.0 * 2.0 * 4.0));
    Ok(())
}
