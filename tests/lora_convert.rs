//! `candle_cp_llama::lora_convert::per_expert_adapter`: an adapter on a mixture's experts held
//! as parameters (transformers 5, PEFT's `target_parameters`) as the same adapter on
//! transformers 4's per-expert modules, for serving stacks that read only those.
//!
//! - Qwen3-MoE (a dense layer 0), Mixtral and Qwen2-MoE (a dense layer 0 and a shared expert),
//!   with the attention, the routers, rank and alpha patterns, rsLoRA and a dense layer's MLP
//!   adapted beside the experts: the converted adapter merges into the same weights, gives the
//!   same logits and loss on one device, zigzag 2 × TP 2 + SP and ring 2 × EP 2, adapts no other
//!   module (a regular expression where a list of target modules would adapt more), and is
//!   written as a PEFT file with per-expert names (`….experts.{e}.gate_proj`, a Mixtral's
//!   `w1`) and no `target_parameters`, which reads back as the same spec and tensors.
//! - PEFT's conversion of a transformers 4 adapter (gate_up_proj at rank `2r`, `B`
//!   block-diagonal) converts back to the transformers 4 adapter: its spec and its tensors bit
//!   for bit (the zero columns left out, rank `r` again).
//! - Refused by name: gpt-oss (its experts are parameters in every transformers version), an
//!   adapter whose experts are modules already.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::lora::{is_lora_name, load_peft_adapter, merge_adapter, model_adapters, save_peft_adapter};
use candle_cp_llama::lora_convert::per_expert_adapter;
use candle_cp_llama::verify::{load_reference, run_layout_recompute};
use candle_cp_llama::{param_specs, LlamaConfig, LoraSpec, MoeStyle};
use candle_cp_tests::lora_ref::f64s;
use candle_cp_tests::moe_model::moe_model;
use candle_cp_tests::peft_files::{peft_converted, write_adapter};
use std::collections::HashMap;

fn ids(t: usize) -> Result<Tensor> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, t)?.contiguous()
}

/// `cfg`'s adapters drawn from `seed` (`B ≠ 0`).
fn seeded(cfg: &LlamaConfig, seed: u64) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (i, s) in param_specs(cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        let sd = if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 };
        out.insert(s.name.clone(), candle_cp_ops::oracle::randn(seed + i as u64, &s.shape, sd)?.to_dtype(DType::F32)?);
    }
    Ok(out)
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (f64s(a)? - f64s(b)?)?.abs()?.max_all()?.to_scalar::<f64>()
}

fn tmp(what: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("candle-cp-lora-convert-{what}-{}", std::process::id()))
}

/// Three mixtures, each with a transformers 5 adapter (see the module doc): the per-expert
/// adapter is the same model, adapts the same modules, and round-trips through its PEFT file.
#[test]
fn a_transformers_5_adapter_is_the_same_model_on_per_expert_modules() -> Result<()> {
    let params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];
    let cases: Vec<(MoeStyle, LoraSpec, bool)> = vec![
        // the dense layer 0's MLP is not adapted: target_modules becomes a regular expression
        (MoeStyle::Qwen3Moe, LoraSpec::new(2, 6.0, &["q_proj"])?.with_target_parameters(&[params[0], params[1], "gate.weight"])?.with_rank_pattern(vec![("mlp.experts.down_proj".into(), 3)])?, true),
        // every layer sparse: a list of target modules (w1, w3, w2 in the file); rsLoRA
        (MoeStyle::Mixtral, LoraSpec::new(4, 8.0, &["v_proj"])?.with_target_parameters(&params)?.with_alpha_pattern(vec![("gate_up_proj".into(), 5.0)])?.with_rslora(true), false),
        // the dense MLP and the shared expert by target modules, one layer's gate_up_proj
        (MoeStyle::Qwen2Moe, LoraSpec::new(2, 4.0, &["gate_proj", "up_proj", "down_proj", "k_proj"])?.with_target_parameters(&["1.mlp.experts.gate_up_proj"])?, true),
    ];
    let ids = ids(64)?;
    for (k, (style, spec5, regex)) in cases.into_iter().enumerate() {
        let (base, weights) = moe_model(style, None)?;
        let cfg5 = base.clone().with_lora(Some(spec5));
        cfg5.validate()?;
        let adapters5 = seeded(&cfg5, 5100 + 100 * k as u64)?;
        let (spec4, adapters4) = per_expert_adapter(&cfg5, &adapters5)?;
        let cfg4 = base.clone().with_lora(Some(spec4.clone()));
        assert!(spec4.expert_params.is_none() && spec4.target_parameters.is_empty(), "{style:?}: {spec4}");
        assert_eq!(spec4.target_regex.is_some(), regex, "{style:?}: {spec4}");
        println!("{style:?}: {spec4}");
        // the same modules adapted, the same weights merged
        let spec5 = cfg5.lora.clone().ok_or_else(|| candle_core::Error::Msg("a spec".into()))?;
        let (mut m5, mut m4) = (weights.clone(), weights.clone());
        let (n5, n4) = (merge_adapter(&mut m5, &spec5, &adapters5)?, merge_adapter(&mut m4, &spec4, &adapters4)?);
        assert_eq!(n5, n4, "{style:?}: merged weights");
        let mut worst = 0f64;
        for (n, t) in &m5 {
            let d = max_diff(t, &m4[n])?;
            assert!(d < 1e-7, "{style:?}: {n} merges {d} apart");
            worst = worst.max(max_diff(t, &weights[n])?);
        }
        assert!(worst > 1e-3, "{style:?}: the adapters move the weights by only {worst}");
        // the same logits and loss
        let (mut full5, mut full4) = (weights.clone(), weights.clone());
        full5.extend(adapters5.clone());
        full4.extend(adapters4.clone());
        for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Layout::cp(CpKind::Ring, 2).with_ep(2)] {
            let a = run_layout_recompute(&full5, &cfg5, &ids, layout, &Device::Cpu, false)?;
            let b = run_layout_recompute(&full4, &cfg4, &ids, layout, &Device::Cpu, false)?;
            let d = max_diff(&a.logits, &b.logits)?;
            println!("{style:?} {layout}: per-expert vs expert parameters: logits {d:.1e}, loss {:.1e}", (a.loss - b.loss).abs());
            assert!(d < 1e-5 && (a.loss - b.loss).abs() < 1e-6, "{style:?} {layout}: logits {d}, loss {} vs {}", a.loss, b.loss);
        }
        // the PEFT file: per-expert names, no target_parameters; read back as it was written
        let dir = tmp(&format!("{style:?}"));
        save_peft_adapter(&dir, &spec4, &adapters4, "base")?;
        let text = std::fs::read_to_string(dir.join("adapter_config.json")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert!(!text.contains("target_parameters"), "{style:?}: {text}");
        let file = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)?;
        let (m, up) = if style == MoeStyle::Mixtral { ("block_sparse_moe", "w3") } else { ("mlp", "up_proj") };
        let name = format!("base_model.model.model.layers.1.{m}.experts.7.{up}.lora_A.weight");
        assert!(file.contains_key(&name), "{style:?}: no {name} in {:?}", file.keys().take(8).collect::<Vec<_>>());
        let (read, tensors) = load_peft_adapter(&dir)?;
        let read = candle_cp_llama::expert_params::transformers_5_spec(&base, read, &tensors);
        let rcfg = base.clone().with_lora(Some(read));
        assert_eq!(rcfg.lora, cfg4.lora, "{style:?}: the spec read back");
        let tensors = model_adapters(&rcfg, tensors)?;
        assert_eq!(tensors.len(), adapters4.len(), "{style:?}");
        for (n, t) in &adapters4 {
            assert_eq!(max_diff(t, &tensors[n])?, 0.0, "{style:?}: {n} read back");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
    Ok(())
}

/// A transformers 4 adapter (rank 2, alpha 6 on q_proj, the router and every expert's
/// projections; Qwen3-MoE's layer 1 only) as PEFT converts it for transformers 5 comes back from
/// the converted file as it was: the same spec, every tensor bit for bit.
#[test]
fn peft_conversion_of_a_transformers_4_adapter_comes_back() -> Result<()> {
    for style in [MoeStyle::Qwen3Moe, MoeStyle::Mixtral] {
        let (base, _) = moe_model(style, None)?;
        let layers = (style == MoeStyle::Qwen3Moe).then(|| vec![1]);
        let spec4 = LoraSpec::new(2, 6.0, &["q_proj", "gate", "gate_proj", "up_proj", "down_proj"])?.with_layers(layers.clone());
        let cfg4 = base.clone().with_lora(Some(spec4));
        let adapters4 = seeded(&cfg4, 6100)?;
        let dir = tmp(&format!("peft-{style:?}"));
        let config = serde_json::json!({
            "peft_type": "LORA", "r": 2, "lora_alpha": 6, "target_modules": ["q_proj"],
            "target_parameters": ["down_proj", "gate.weight", "gate_up_proj"],
            "rank_pattern": {".*\\.gate_up_proj": 4}, "alpha_pattern": {".*\\.gate_up_proj": 12},
            "layers_to_transform": layers, "base_model_name_or_path": "base",
        });
        write_adapter(&dir, peft_converted(&base, &adapters4, 2)?, &config)?;
        let (spec5, tensors) = load_peft_adapter(&dir)?;
        let cfg5 = base.clone().with_lora(Some(spec5));
        let adapters5 = model_adapters(&cfg5, tensors)?;
        let (spec, back) = per_expert_adapter(&cfg5, &adapters5)?;
        assert_eq!(base.clone().with_lora(Some(spec)).lora, cfg4.lora, "{style:?}: the spec");
        let mut names: Vec<&String> = back.keys().collect();
        names.sort();
        let mut want: Vec<&String> = adapters4.keys().collect();
        want.sort();
        assert_eq!(names, want, "{style:?}: the tensors");
        for (n, t) in &adapters4 {
            assert_eq!(max_diff(t, &back[n])?, 0.0, "{style:?}: {n}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
    Ok(())
}

/// gpt-oss, an adapter on per-expert modules and a model without adapters are refused by name.
#[test]
fn refusals() -> Result<()> {
    let err = |cfg: &LlamaConfig| -> String {
        let a: HashMap<String, Tensor> = HashMap::new();
        per_expert_adapter(cfg, &a).err().map(|e| e.to_string()).unwrap_or_default()
    };
    let (oss, _) = moe_model(MoeStyle::GptOss, None)?;
    let e = err(&oss.clone().with_lora(Some(LoraSpec::on_parameters(2, 4.0, &["mlp.experts.down_proj"])?)));
    assert!(e.contains("gpt-oss"), "{e}");
    let (qwen, w) = moe_model(MoeStyle::Qwen3Moe, None)?;
    let e = err(&qwen.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["gate_proj"])?)));
    assert!(e.contains("per-expert layout already"), "{e}");
    assert!(err(&qwen).contains("no LoRA spec"));
    // tensors that do not fit the spec
    let cfg = qwen.with_lora(Some(LoraSpec::on_parameters(2, 4.0, &["mlp.experts.down_proj"])?));
    let mut a = seeded(&cfg, 1)?;
    a.insert("model.layers.1.mlp.experts.down_proj.lora_B.weight".into(), Tensor::zeros((8, 128, 3), DType::F32, &Device::Cpu)?);
    let e = per_expert_adapter(&cfg, &a).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("down_proj.lora_B.weight") && e.contains("[8, 128, 3]"), "{e}");
    assert!(w.keys().all(|n| !is_lora_name(n)));
    Ok(())
}
