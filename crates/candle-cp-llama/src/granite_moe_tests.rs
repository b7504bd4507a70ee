use super::*;
use crate::{Arch, Granite, LoraSpec};
use candle_core::Device;

/// ibm-granite/granite-3.1-3b-a800m's shape (its config.json's keys; the multipliers are
/// granite-3.x's kind of values).
const GRANITE_3B_A800M: &str = r#"{
  "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", "hidden_act": "silu",
  "hidden_size": 1536, "intermediate_size": 512, "max_position_embeddings": 131072,
  "num_attention_heads": 24, "num_key_value_heads": 8, "num_hidden_layers": 32,
  "num_local_experts": 40, "num_experts_per_tok": 8, "rope_theta": 10000000.0,
  "tie_word_embeddings": true, "vocab_size": 49155, "attention_bias": false,
  "embedding_multiplier": 12.0, "attention_multiplier": 0.015625, "residual_multiplier": 0.22,
  "logits_scaling": 6.0, "output_router_logits": false, "router_aux_loss_coef": 0.001
}"#;

/// The config reads as GraniteMoE (Granite's multipliers, 40 experts 512 wide, 8 per token,
/// renormalised), writes back as `GraniteMoeForCausalLM` and reads again the same; defaults and
/// refusals by name.
#[test]
fn granite_moe_configs() -> Result<()> {
    let c = LlamaConfig::from_json(GRANITE_3B_A800M)?;
    assert_eq!(c.arch(), Arch::GraniteMoe);
    assert_eq!(c.moe, Some(MoeConfig::granite_moe(40, 8, 512)));
    assert_eq!(c.granite, Some(Granite { embedding_multiplier: 12.0, attention_multiplier: 0.015625, residual_multiplier: 0.22, logits_scaling: 6.0 }));
    assert!(c.tie_word_embeddings && !c.qk_norm && !c.qkv_bias && c.sliding_window.is_none() && c.moe_layers() == 32);
    let text = c.to_hf_json("bfloat16");
    let v: Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str(), v["num_local_experts"].as_u64()), (Some("granitemoe"), Some("GraniteMoeForCausalLM"), Some(40)));
    assert_eq!(LlamaConfig::from_json(&text)?, c);
    // GraniteMoeConfig's defaults: 8 experts, 2 per token, multipliers 1; no window
    let base = r#""model_type": "granitemoe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4"#;
    let d = LlamaConfig::from_json(&format!(r#"{{{base}, "sliding_window": 8}}"#))?;
    assert_eq!((d.moe.clone(), d.granite.clone(), d.sliding_window), (Some(MoeConfig::granite_moe(8, 2, 16)), Some(Granite::default()), None));
    // a random-init one: the mixture and Granite's multipliers together
    let tiny = LlamaConfig::tiny(64, 32, 2, 4, 2).with_moe(Some(MoeConfig::granite_moe(4, 2, 16)));
    assert_eq!((tiny.arch(), tiny.granite.clone(), tiny.intermediate_size), (Arch::GraniteMoe, Some(Granite::default()), 16));
    tiny.validate()?;
    for (extra, want) in [
        (r#", "attention_bias": true"#, "attention_bias"),
        (r#", "shared_intermediate_size": 64"#, "GraniteMoeShared"),
        (r#", "output_router_logits": 1"#, "true or false"),
    ] {
        let e = LlamaConfig::from_json(&format!("{{{base}{extra}}}")).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(want), "{extra}: {e}");
    }
    let e = LlamaConfig::from_json(r#"{"model_type": "granitemoeshared", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4}"#).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("granitemoeshared") && e.contains("not supported"), "{e}");
    // LoRA on the attention projections; the router and the experts refused by name
    tiny.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["q_proj", "v_proj"])?)).validate()?;
    for t in ["gate", "up_proj"] {
        let e = tiny.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["q_proj", t])?)).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("LoRA on GraniteMoE's") && e.contains("block_sparse_moe"), "{t}: {e}");
    }
    let mut other = tiny.clone();
    if let Some(m) = other.moe.as_mut() {
        m.norm_topk_prob = false;
    }
    let e = other.validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("renormalised"), "{e}");
    let e = tiny.with_qk_norm(true).validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("Granite with q, k head norms") || e.contains("GraniteMoE"), "{e}");
    Ok(())
}

/// A checkpoint's `input_linear` `[E, 2·I, h]` gives the gate (rows `0..I`) and the up
/// projection (rows `I..2·I`), read once for both; `output_linear` and the router as they are;
/// `combine` puts them back, and the grouping names every checkpoint tensor once.
#[test]
fn checkpoint_round_trip() -> Result<()> {
    let (e, i, h) = (2usize, 3usize, 4usize);
    let dev = Device::Cpu;
    let input = Tensor::arange(0f32, (e * 2 * i * h) as f32, &dev)?.reshape((e, 2 * i, h))?;
    let output = Tensor::arange(0f32, (e * h * i) as f32, &dev)?.reshape((e, h, i))?;
    let router = Tensor::arange(0f32, (e * h) as f32, &dev)?.reshape((e, h))?;
    let p = "model.layers.1.";
    let mut reads = 0;
    let mut get = |n: &str| -> Result<Option<Tensor>> {
        reads += 1;
        Ok(match n.strip_prefix(p) {
            Some("block_sparse_moe.input_linear.weight") => Some(input.clone()),
            Some("block_sparse_moe.output_linear.weight") => Some(output.clone()),
            Some("block_sparse_moe.router.layer.weight") => Some(router.clone()),
            _ => None,
        })
    };
    let mut cache = None;
    let mut read = |n: &str, shape: &[usize]| from_checkpoint_cached(&format!("{p}{n}"), shape, &mut get, &mut cache);
    let g = read("block_sparse_moe.experts.gate_proj", &[e, i, h])?.expect("gate");
    let u = read("block_sparse_moe.experts.up_proj", &[e, i, h])?.expect("up");
    let d = read("block_sparse_moe.experts.down_proj", &[e, h, i])?.expect("down");
    let r = read("block_sparse_moe.gate.weight", &[e, h])?.expect("router");
    assert!(read("self_attn.q_proj.weight", &[h, h])?.is_none());
    let e_bad = read("block_sparse_moe.experts.down_proj", &[e, i, h]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e_bad.contains("output_linear.weight has shape [2, 4, 3]"), "{e_bad}");
    assert_eq!(reads, 4, "input_linear read once for the gate and the up projection");
    // expert 1's gate row 2 is input_linear's row 2, its up row 2 row I + 2
    assert_eq!(g.get(1)?.get(2)?.to_vec1::<f32>()?, input.get(1)?.get(2)?.to_vec1::<f32>()?);
    assert_eq!(u.get(1)?.get(2)?.to_vec1::<f32>()?, input.get(1)?.get(i + 2)?.to_vec1::<f32>()?);
    assert_eq!((d.to_vec3::<f32>()?, r.to_vec2::<f32>()?), (output.to_vec3::<f32>()?, router.to_vec2::<f32>()?));
    let names = ["block_sparse_moe.gate.weight", "block_sparse_moe.experts.gate_proj", "block_sparse_moe.experts.up_proj", "block_sparse_moe.experts.down_proj", "post_attention_layernorm.weight"];
    let groups = group(names.iter().map(|n| (format!("{p}{n}"), *n)).collect())?;
    let got: Vec<(String, Vec<&str>)> = groups.into_iter().map(|(n, v)| (n.strip_prefix(p).unwrap_or(&n).to_string(), v)).collect();
    assert_eq!(got, vec![
        ("block_sparse_moe.router.layer.weight".to_string(), vec![names[0]]),
        ("block_sparse_moe.input_linear.weight".to_string(), vec![names[1], names[2]]),
        ("block_sparse_moe.output_linear.weight".to_string(), vec![names[3]]),
        (names[4].to_string(), vec![names[4]]),
    ]);
    let ck = format!("{p}block_sparse_moe.input_linear.weight");
    assert_eq!(combine(&ck, &[g.clone(), u.clone()])?.to_vec3::<f32>()?, input.to_vec3::<f32>()?);
    assert_eq!(combined_shape(&ck, &[g.dims().to_vec(), u.dims().to_vec()]), input.dims());
    assert!(group(vec![(format!("{p}block_sparse_moe.experts.gate_proj"), 0)]).is_err(), "input_linear without its up rows");
    Ok(())
}
