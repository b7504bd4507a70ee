use super::*;
use crate::LoraSpec;
use candle_core::Device;

/// GLM-4-9B-0414's shape (its config.json's keys).
const GLM4_9B: &str = r#"{
  "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "attention_bias": true, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 13696, "max_position_embeddings": 32768,
  "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false, "vocab_size": 151552
}"#;

/// The config reads as GLM-4 (q, k, v biases, RoPE on 64 of 128 dimensions, norms before and
/// after each branch), writes back as `Glm4ForCausalLM` and reads again the same; Glm4Config's
/// defaults; refusals by name.
#[test]
fn glm4_configs() -> Result<()> {
    let c = LlamaConfig::from_json(GLM4_9B)?;
    assert_eq!((c.arch(), c.glm, c.qkv_bias, c.qk_norm, c.rope_dim(), c.pre_and_post_norms()), (Arch::Glm4, Some(Glm::Glm4), true, false, 64, true));
    assert_eq!((c.interleaved_rope(), c.norm_weight(), c.sliding_window), (Some((128, 64)), candle_cp_nn::NormWeight::Scale, None));
    let text = c.to_hf_json("bfloat16");
    let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str(), v["partial_rotary_factor"].as_f64(), v["attention_bias"].as_bool()), (Some("glm4"), Some("Glm4ForCausalLM"), Some(0.5), Some(true)));
    assert_eq!(LlamaConfig::from_json(&text)?, c);
    // Glm4Config's defaults: partial 0.5, biases on; attention_bias false: none; no window
    let base = r#""model_type": "glm4", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2"#;
    let d = LlamaConfig::from_json(&format!(r#"{{{base}, "sliding_window": 8}}"#))?;
    assert_eq!((d.partial_rotary_factor, d.qkv_bias, d.sliding_window, d.rms_norm_eps), (0.5, true, None, 1.5625e-7));
    let nb = LlamaConfig::from_json(&format!(r#"{{{base}, "attention_bias": false, "partial_rotary_factor": 1.0}}"#))?;
    assert_eq!((nb.qkv_bias, nb.rope_dim(), nb.interleaved_rope()), (false, 8, Some((8, 8))));
    assert_eq!(LlamaConfig::from_json(&nb.to_hf_json("float32"))?, nb);
    // a random-init one
    let tiny = LlamaConfig::tiny(64, 32, 2, 4, 2).with_glm4(true);
    assert_eq!((tiny.arch(), tiny.qkv_bias, tiny.rope_dim()), (Arch::Glm4, true, 4));
    tiny.validate()?;
    for (c, want) in [
        (tiny.clone().with_qk_norm(true), "GLM-4 with q, k head norms"),
        (tiny.clone().with_sliding_window(Some(8)), "GLM-4 with a sliding window"),
        (tiny.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["q_proj", "gate_proj", "up_proj"])?)), "gate_up_proj"),
        (tiny.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["gate_up_proj"])?)), "gate_up_proj"),
    ] {
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(want), "{want}: {e}");
    }
    tiny.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])?)).validate()?;
    let e = LlamaConfig::from_json(&format!(r#"{{{base}, "partial_rotary_factor": 0.5, "model_type": "llama"}}"#)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("partial_rotary_factor"), "{e}");
    Ok(())
}

/// GLM-4-9B-chat-hf's config (`GlmForCausalLM`).
const GLM_9B_CHAT: &str = r#"{
  "architectures": ["GlmForCausalLM"], "model_type": "glm", "attention_bias": true, "attention_dropout": 0.0,
  "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 13696, "max_position_embeddings": 131072,
  "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
  "partial_rotary_factor": 0.5, "rms_norm_eps": 1.5625e-07, "rope_theta": 10000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 151552
}"#;

/// GLM reads as GLM-4's attention and MLP with a Llama's norms, writes back as `GlmForCausalLM`
/// and reads again the same; GlmConfig's defaults; its refusals name GLM; its checkpoint names
/// the fused MLP only (no norm renamed).
#[test]
fn glm_configs() -> Result<()> {
    let c = LlamaConfig::from_json(GLM_9B_CHAT)?;
    assert_eq!((c.arch(), c.glm, c.qkv_bias, c.rope_dim(), c.pre_and_post_norms(), c.interleaved_rope()), (Arch::Glm, Some(Glm::Glm), true, 64, false, Some((128, 64))));
    assert!(!c.is_glm4() && c.gemma3.is_none() && c.olmo.is_none());
    let text = c.to_hf_json("bfloat16");
    let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str(), v["partial_rotary_factor"].as_f64()), (Some("glm"), Some("GlmForCausalLM"), Some(0.5)));
    assert_eq!(LlamaConfig::from_json(&text)?, c);
    let d = LlamaConfig::from_json(r#"{"model_type": "glm", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 8}"#)?;
    assert_eq!((d.partial_rotary_factor, d.qkv_bias, d.sliding_window, d.rms_norm_eps), (0.5, true, None, 1.5625e-7));
    let tiny = LlamaConfig::tiny(64, 32, 2, 4, 2).with_glm(Some(Glm::Glm));
    assert_eq!((tiny.arch(), tiny.qkv_bias, tiny.rope_dim()), (Arch::Glm, true, 4));
    tiny.validate()?;
    let e = tiny.clone().with_qk_norm(true).validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("GLM with q, k head norms"), "{e}");
    let e = tiny.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["up_proj"])?)).validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("GLM's fused gate_up_proj"), "{e}");
    // names: GLM renames no norm; GLM-4 does
    let norm = "model.layers.0.post_attention_layernorm.weight";
    assert_eq!((checkpoint_part(Glm::Glm, norm), checkpoint_part(Glm::Glm4, norm).map(|p| p.0)), (None, Some("model.layers.0.post_self_attn_layernorm.weight".to_string())));
    for g in [Glm::Glm, Glm::Glm4] {
        assert_eq!(checkpoint_part(g, "model.layers.3.mlp.up_proj.weight"), Some(("model.layers.3.mlp.gate_up_proj.weight".to_string(), 1)));
    }
    // a GLM checkpoint is no GLM-4 one: the same tensor names, the other architecture refused
    let e = LlamaConfig::from_json(r#"{"model_type": "glm", "architectures": ["Glm4ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4}"#).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("model_type `glm` but architectures `Glm4ForCausalLM`"), "{e}");
    Ok(())
}

/// The rows of a head: the model's row `i < R/2` is the checkpoint's `2i`, row `R/2 + i` its
/// `2i + 1`, rows from `R` on as they are; there and back is the identity; a pair rotated
/// interleaved equals the model's half-form rotation of the permuted vector.
#[test]
fn q_k_rows_permute_as_the_module_doc_says() -> Result<()> {
    let (heads, d, r) = (2usize, 8usize, 4usize);
    let ck = Tensor::arange(0u32, (heads * d) as u32, &Device::Cpu)?;
    let model = permute_rows(&ck, (d, r), false)?.to_vec1::<u32>()?;
    assert_eq!(model, [0, 2, 1, 3, 4, 5, 6, 7, 8, 10, 9, 11, 12, 13, 14, 15]);
    let back = permute_rows(&Tensor::new(model.as_slice(), &Device::Cpu)?, (d, r), true)?.to_vec1::<u32>()?;
    assert_eq!(back, ck.to_vec1::<u32>()?);
    // a 2-D tensor (a lora_B [rows, rank]) moves whole rows
    let b = Tensor::arange(0f32, 32.0, &Device::Cpu)?.reshape((16, 2))?;
    assert_eq!(permute_rows(&b, (d, r), false)?.get(1)?.to_vec1::<f32>()?, b.get(2)?.to_vec1::<f32>()?);
    assert!(permute_rows(&b, (5, 4), false).is_err(), "16 rows are not heads of 5");
    // interleaved RoPE at angles θ0, θ1 on [x0..x3] (pairs (0,1), (2,3)) = the half form on
    // the permuted [x0, x2, x1, x3] (pairs (0,2), (1,3)), permuted back
    let (x, th) = ([0.3f64, -1.2, 0.7, 2.0], [0.4f64, 1.1]);
    let inter: Vec<f64> = (0..4).map(|j| { let (i, even) = (j / 2, j % 2 == 0); if even { x[j] * th[i].cos() - x[j + 1] * th[i].sin() } else { x[j] * th[i].cos() + x[j - 1] * th[i].sin() } }).collect();
    let p = [x[0], x[2], x[1], x[3]];
    let half: Vec<f64> = (0..4).map(|j| { let i = j % 2; if j < 2 { p[j] * th[i].cos() - p[j + 2] * th[i].sin() } else { p[j] * th[i].cos() + p[j - 2] * th[i].sin() } }).collect();
    let back = [half[0], half[2], half[1], half[3]];
    for (a, b) in inter.iter().zip(back) {
        assert!((a - b).abs() < 1e-12, "{inter:?} vs {back:?}");
    }
    Ok(())
}

/// The checkpoint's names and layout: the norms renamed, gate and up one tensor (read once), q /
/// k rows interleaved; `combine` gives the checkpoint's tensors back.
#[test]
fn checkpoint_round_trip() -> Result<()> {
    let (i, h, d, r) = (3usize, 4usize, 4usize, 2usize);
    let dev = Device::Cpu;
    let gate_up = Tensor::arange(0f32, (2 * i * h) as f32, &dev)?.reshape((2 * i, h))?;
    let q = Tensor::arange(0f32, (2 * d * h) as f32, &dev)?.reshape((2 * d, h))?;
    let qb = Tensor::arange(0f32, (2 * d) as f32, &dev)?;
    let norm = Tensor::ones(h, candle_core::DType::F32, &dev)?;
    let p = "model.layers.0.";
    let mut reads = 0;
    let mut get = |n: &str| -> Result<Option<Tensor>> {
        reads += 1;
        Ok(match n.strip_prefix(p) {
            Some("mlp.gate_up_proj.weight") => Some(gate_up.clone()),
            Some("self_attn.q_proj.weight") => Some(q.clone()),
            Some("self_attn.q_proj.bias") => Some(qb.clone()),
            Some("post_self_attn_layernorm.weight") => Some((&norm * 2.0)?),
            Some("post_attention_layernorm.weight") => Some((&norm * 3.0)?),
            Some("post_mlp_layernorm.weight") => Some((&norm * 4.0)?),
            _ => None,
        })
    };
    let mut cache = None;
    let mut read = |n: &str, shape: &[usize]| read_param(Glm::Glm4, &format!("{p}{n}"), shape, (d, r), &mut get, &mut cache);
    let g = read("mlp.gate_proj.weight", &[i, h])?.expect("gate");
    let u = read("mlp.up_proj.weight", &[i, h])?.expect("up");
    let qm = read("self_attn.q_proj.weight", &[2 * d, h])?.expect("q");
    let qbm = read("self_attn.q_proj.bias", &[2 * d])?.expect("q bias");
    let after_attn = read("post_attention_layernorm.weight", &[h])?.expect("after the attention");
    let before_mlp = read("pre_feedforward_layernorm.weight", &[h])?.expect("before the MLP");
    let after_mlp = read("post_feedforward_layernorm.weight", &[h])?.expect("after the MLP");
    assert!(read("self_attn.v_proj.weight", &[2 * d, h])?.is_none());
    assert_eq!(reads, 6, "gate_up_proj read once for the gate and the up projection");
    assert_eq!((g.to_vec2::<f32>()?, u.to_vec2::<f32>()?), (gate_up.narrow(0, 0, i)?.to_vec2::<f32>()?, gate_up.narrow(0, i, i)?.to_vec2::<f32>()?));
    // (R = 2: one pair, rows 0 and 1 in both orders; the permutation itself: the test above)
    assert_eq!(qbm.to_vec1::<f32>()?, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert_eq!((after_attn.to_vec1::<f32>()?[0], before_mlp.to_vec1::<f32>()?[0], after_mlp.to_vec1::<f32>()?[0]), (2.0, 3.0, 4.0));
    let ck = format!("{p}mlp.gate_up_proj.weight");
    assert_eq!(combine(&ck, &[g.clone(), u.clone()], (d, r))?.to_vec2::<f32>()?, gate_up.to_vec2::<f32>()?);
    assert_eq!(combined_shape(&ck, &[g.dims().to_vec(), u.dims().to_vec()]), gate_up.dims());
    assert_eq!(combine(&format!("{p}self_attn.q_proj.weight"), &[qm], (d, r))?.to_vec2::<f32>()?, q.to_vec2::<f32>()?);
    let groups = group(Glm::Glm4, vec![(format!("{p}post_attention_layernorm.weight"), 0), (format!("{p}pre_feedforward_layernorm.weight"), 1), (format!("{p}mlp.gate_proj.weight"), 2), (format!("{p}mlp.up_proj.weight"), 3)])?;
    let names: Vec<(String, Vec<i32>)> = groups.into_iter().map(|(n, v)| (n.strip_prefix(p).unwrap_or(&n).to_string(), v)).collect();
    assert_eq!(names, vec![("post_self_attn_layernorm.weight".to_string(), vec![0]), ("post_attention_layernorm.weight".to_string(), vec![1]), ("mlp.gate_up_proj.weight".to_string(), vec![2, 3])]);
    Ok(())
}
