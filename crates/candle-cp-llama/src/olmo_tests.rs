use super::*;
use crate::Arch;
use candle_cp_nn::NormWeight;

const BASE: &str = r#""vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2"#;

fn parse(extra: &str) -> Result<LlamaConfig> {
    LlamaConfig::from_json(&format!("{{{BASE}{extra}}}"))
}

/// OLMo 2 and 3 configs as transformers reads them: defaults (eps 1e-5; OLMo 3's window 4096
/// on three layers of four), `layer_types`, refusals; written back and read again as the same
/// config.
#[test]
fn olmo_configs() -> Result<()> {
    let err = |r: Result<LlamaConfig>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let o2 = parse(r#", "model_type": "olmo2", "rope_theta": 500000"#)?;
    assert_eq!((o2.olmo, o2.arch(), o2.rms_norm_eps, o2.sliding_window), (Some(Olmo::Olmo2), Arch::Olmo2, 1e-5, None));
    assert_eq!(o2.norm_weight(), candle_cp_nn::NormWeight::ScaleF32);
    // Olmo2Config has no window: the key is ignored, as transformers does
    assert_eq!(parse(r#", "model_type": "olmo2", "sliding_window": 64"#)?.sliding_window, None);
    let o3 = parse(r#", "architectures": ["Olmo3ForCausalLM"], "rms_norm_eps": 1e-6"#)?;
    assert_eq!((o3.olmo, o3.rms_norm_eps, o3.sliding_window), (Some(Olmo::Olmo3), 1e-6, Some(OLMO3_WINDOW)));
    assert_eq!((0..8).map(|i| o3.layer_window(i).is_some()).collect::<Vec<_>>(), [true, true, true, false, true, true, true, false]);
    // no scaling: one RoPE for every layer
    assert!(o3.local_rope().is_none());
    let types = r#", "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "sliding_attention"], "sliding_window": 16"#;
    let yarn = r#", "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}"#;
    let o3y = parse(&format!(r#", "model_type": "olmo3"{types}{yarn}"#))?;
    assert_eq!((o3y.sliding_window, o3y.layer_window(1), o3y.layer_window(0)), (Some(16), Some(16), None));
    // YaRN: the sliding layers rotate unscaled, the full ones scaled
    assert!(o3y.layer_rope_is_local(1) && !o3y.layer_rope_is_local(0));
    let local = o3y.local_rope().ok_or_else(|| candle_core::Error::Msg("no local RoPE".into()))?;
    assert_eq!((local.rope_scaling.clone(), local.rope_theta), (crate::RopeScaling::Default, o3y.rope_theta));
    for (c, class) in [(&o2, "Olmo2ForCausalLM"), (&o3, "Olmo3ForCausalLM"), (&o3y, "Olmo3ForCausalLM")] {
        let text = c.to_hf_json("float32");
        assert!(text.contains(class) && !text.contains("mlp_bias"), "{text}");
        assert_eq!(&LlamaConfig::from_json(&text)?, c);
    }
    // transformers 5's form: rope_parameters by layer type (a legacy rope_scaling merged into
    // the full layers'); the written config has it, and reads back the same
    let v5 = format!(
        r#", "model_type": "olmo3"{types}, "rope_parameters": {{"full_attention": {{"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 500000}}, "sliding_attention": {{"rope_type": "default", "rope_theta": 500000}}}}"#
    );
    let c5 = parse(&v5)?;
    assert!(matches!(c5.rope_scaling, crate::RopeScaling::Yarn { factor: 8.0, original_max_position_embeddings: 8192, .. }) && c5.rope_theta == 500000.0, "{:?}", c5.rope_scaling);
    assert!(c5.layer_rope_is_local(1) && !c5.layer_rope_is_local(0));
    let text = c5.to_hf_json("float32");
    let written: serde_json::Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!(written["rope_parameters"]["full_attention"]["rope_type"], "yarn");
    assert_eq!(written["rope_parameters"]["sliding_attention"]["rope_type"], "default");
    assert_eq!(LlamaConfig::from_json(&text)?, c5);
    // Olmo3Config's default base where the config names none
    assert_eq!(parse(r#", "model_type": "olmo3""#)?.rope_theta, OLMO3_THETA);
    let e = err(parse(&v5.replace(r#""sliding_attention": {"rope_type": "default", "rope_theta": 500000}"#, r#""sliding_attention": {"rope_type": "default", "rope_theta": 10000}"#)));
    assert!(e.contains("sliding_attention"), "{e}");
    // OLMo 3 with no sliding layer writes its layer types (the default would bring three back)
    let full = o3.clone().with_sliding_window(None).with_sliding_layers(None);
    assert_eq!(LlamaConfig::from_json(&full.to_hf_json("float32"))?, full);
    // refusals, by name
    assert!(err(parse(r#", "model_type": "olmo2", "attention_bias": true"#)).contains("attention_bias"));
    let e = o2.clone().with_qk_norm(true).validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("q, k head norms"), "{e}");
    let e = o2.clone().with_sliding_window(Some(8)).validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("Olmo2 with a sliding window"), "{e}");
    Ok(())
}

/// The whole-projection norm on one rank equals the plain RMSNorm over the last dim (with
/// OLMo's f32 weight product) and refuses a weight of another width.
#[test]
fn flat_norm_is_rms_over_the_projection() -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let x = Tensor::randn(0f32, 2.0, (2, 5, 24), &dev)?;
    let w = Tensor::randn(1f32, 0.2, 24, &dev)?;
    let diff = |a: &Tensor, b: &Tensor| -> Result<f32> { (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>() };
    let mut bf16 = vec![];
    for form in [NormWeight::ScaleF32, NormWeight::Scale] {
        // (f32: the same up to the statistic's rounding; bf16: within a rounding of
        // candle-cp-nn's norm of that form)
        for (dt, tol) in [(DType::F32, 1e-6), (DType::BF16, 2e-2)] {
            let (x, w) = (x.to_dtype(dt)?, w.to_dtype(dt)?);
            let y = flat_rms(&x, &w, 24, (1e-6, form), None)?;
            let e = diff(&y, &candle_cp_nn::rms_norm_slow_with(&x, &w, 1e-6, form)?)?;
            assert!(e < tol, "{form:?} {dt:?}: {e}");
            if dt == DType::BF16 {
                bf16.push(y);
            }
        }
    }
    // in bf16 the forms round differently (the product in f32, or x̂ rounded first)
    assert!(diff(&bf16[0], &bf16[1])? > 0.0);
    let e = flat_rms(&x, &w.narrow(0, 0, 16)?, 24, (1e-6, NormWeight::Scale), None).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("[16]") && e.contains("24 features"), "{e}");
    Ok(())
}

/// The fused norm + RoPE node equals the plain ops (`flat_rms`, then `apply_rope_slow`) in
/// values and both gradients (both weight forms), on one rank and with the features split over 2 TP ranks (each
/// rank's slice of the output and of the gradients), tables shared or per row; bad shapes
/// are refused by name.
#[test]
fn flat_norm_rope_matches_the_plain_ops_on_tp_ranks() -> Result<()> {
    use candle_core::{Device, Var};
    let dev = Device::Cpu;
    let (b, t, heads, d) = (2, 5, 4, 8);
    let n = heads * d;
    let x = Tensor::randn(0f32, 1.5, (b, t, n), &dev)?;
    let w = Tensor::randn(1f32, 0.3, n, &dev)?;
    let dy = Tensor::randn(0f32, 1.0, (b, t, heads, d), &dev)?;
    let cfg = LlamaConfig::tiny(16, 32, 1, 4, 2);
    let (c1, s1) = crate::rope::rope_tables(&cfg, &[3, 9, 17, 40, 0], DType::F32, &dev)?;
    let (c2, s2) = crate::rope::rope_tables(&cfg, &[0, 1, 2, 3, 4], DType::F32, &dev)?;
    let rows = (Tensor::stack(&[&c1, &c2], 0)?, Tensor::stack(&[&s1, &s2], 0)?);
    for ((cos, sin), form) in [((c1.clone(), s1.clone()), NormWeight::ScaleF32), (rows.clone(), NormWeight::ScaleF32), (rows, NormWeight::Scale)] {
        // the reference on one rank, plain ops
        let (xv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
        let want = crate::fused::apply_rope_slow(&flat_rms(xv.as_tensor(), wv.as_tensor(), n, (1e-6, form), None)?.reshape((b, t, heads, d))?, &cos, &sin)?;
        let g = (&want * &dy)?.sum_all()?.backward()?;
        let (gx, gw) = (g.get(xv.as_tensor()).cloned(), g.get(wv.as_tensor()).cloned());
        let (Some(gx), Some(gw)) = (gx, gw) else { candle_core::bail!("no reference gradient") };
        for ranks in [1usize, 2] {
            let part = n / ranks;
            let out = candle_cp_comm::run_ranks(ranks, |grp| {
                let r = grp.rank();
                let xv = Var::from_tensor(&x.narrow(2, r * part, part)?)?;
                let wv = Var::from_tensor(&w.narrow(0, r * part, part)?)?;
                let y = flat_norm_rope(xv.as_tensor(), wv.as_tensor(), n, (1e-6, form), (d, &cos, &sin), Some(&grp))?;
                let hp = part / d;
                let gs = (&y * dy.narrow(2, r * hp, hp)?)?.sum_all()?.backward()?;
                let diff = |a: &Tensor, b: &Tensor| -> Result<f32> { (a - b)?.abs()?.max_all()?.to_scalar::<f32>() };
                let e_y = diff(&y, &want.narrow(2, r * hp, hp)?)?;
                let e_x = diff(gs.get(xv.as_tensor()).ok_or_else(|| candle_core::Error::Msg("no dx".into()))?, &gx.narrow(2, r * part, part)?)?;
                let e_w = diff(gs.get(wv.as_tensor()).ok_or_else(|| candle_core::Error::Msg("no dw".into()))?, &gw.narrow(0, r * part, part)?)?;
                Ok([e_y, e_x, e_w])
            });
            for e in out {
                let e = e?;
                assert!(e.iter().all(|&v| v < 1e-5), "{ranks} ranks: |Δy|, |Δdx|, |Δdw| = {e:?}");
            }
        }
    }
    let e = flat_norm_rope(&x, &w, n, (1e-6, NormWeight::Scale), (d, &c1.narrow(0, 0, 3)?, &s1.narrow(0, 0, 3)?), None).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("[3, 8]"), "{e}");
    let e = flat_norm_rope(&x, &w, n, (1e-6, NormWeight::Scale), (6, &c1, &s1), None).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("heads of 6"), "{e}");
    Ok(())
}

/// allenai/OLMoE-1B-7B-0924's config.json as published: 64 experts 1024 wide, 8 per token
/// (not renormalised), the loss coefficient 0.01, OLMo's q / k norms with a Llama's norms
/// (`x̂` cast before the weight); written back as `OlmoeForCausalLM` and read again as the
/// same config; `clip_qkv` refused by name.
#[test]
fn olmoe_config() -> Result<()> {
    let published = r#"{"architectures": ["OlmoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "clip_qkv": null,
        "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 1024,
        "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": false, "num_attention_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16, "output_router_logits": false, "pad_token_id": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16", "vocab_size": 50304}"#;
    let c = LlamaConfig::from_json(published)?;
    assert_eq!((c.arch(), c.olmo, c.qk_norm, c.post_norms_only(), c.norm_weight()), (Arch::Olmoe, Some(Olmo::Olmoe), false, false, NormWeight::Scale));
    let m = c.moe.clone().ok_or_else(|| candle_core::Error::Msg("no experts".into()))?;
    assert_eq!((m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob, m.router_aux_loss_coef, c.moe_layers()), (64, 8, 1024, false, 0.01, 16));
    let text = c.to_hf_json("bfloat16");
    assert!(text.contains("OlmoeForCausalLM") && !text.contains("moe_intermediate_size"), "{text}");
    assert_eq!(LlamaConfig::from_json(&text)?, c);
    let e = LlamaConfig::from_json(&published.replace(r#""clip_qkv": null"#, r#""clip_qkv": 8.0"#)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("clip_qkv"), "{e}");
    // OLMoE without experts, or with a dense layer, is no OLMoE
    let e = c.clone().with_moe(None).validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("every layer"), "{e}");
    Ok(())
}
