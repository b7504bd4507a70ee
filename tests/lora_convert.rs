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
//! - Drawn adapters (`random_adapters_convert_to_the_same_model`): the mixture, target modules
//!   (none, attention, MLP, all-linear, a regular expression), target parameters (the experts',
//!   one layer's, the router's, bare keys), rank, alpha, rsLoRA, `layers_to_transform`, rank and
//!   alpha patterns, the head trained whole, and zero columns in gate's and up's `B`: the same
//!   merged weights and logits, the PEFT file read back bit for bit.
//!   `CANDLE_CP_RANDOM_SEEDS=A..B` draws configurations `A..B`.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::lora::{is_lora_name, load_peft_adapter, merge_adapter, model_adapters, save_peft_adapter};
use candle_cp_llama::lora_convert::per_expert_adapter;
use candle_cp_llama::verify::{load_reference, run_layout_recompute};
use candle_cp_llama::{param_specs, LlamaConfig, LoraSpec, MoeStyle};
use candle_cp_llama::lora::ALL_LINEAR;
use candle_cp_llama::train::Rng;
use candle_cp_tests::draws::{pick, rng, seeds};
use candle_cp_tests::lora_ref::f64s;
use candle_cp_tests::moe_model::moe_model;
use candle_cp_tests::peft_files::{peft_converted, write_adapter};
use std::collections::HashMap;

fn ids(t: usize) -> Result<Tensor> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, t)?.contiguous()
}

/// `cfg`'s adapters (and the modules it trains whole) drawn from `seed` (`B ≠ 0`).
fn seeded(cfg: &LlamaConfig, seed: u64) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    let saved = |n: &str| cfg.lora.as_ref().is_some_and(|l| l.saved_param(n));
    for (i, s) in param_specs(cfg).into_iter().filter(|s| s.is_lora() || saved(&s.name)).enumerate() {
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
        let read = candle_cp_llama::expert_params::transformers_5_spec(&base, read, tensors.keys());
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

/// A transformers 5 adapter spec on a mixture (see the module doc).
fn draw_spec(d: &mut Rng) -> Result<LoraSpec> {
    let attention: &[&str] = &["q_proj", "k_proj", "v_proj", "o_proj"];
    let targets: &[&str] = pick(d, &[&[][..], &["q_proj"], &["q_proj", "v_proj"], attention, &["gate_proj", "up_proj", "down_proj"], &["o_proj", "down_proj"], &ALL_LINEAR]);
    let keys = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "gate.weight", "1.mlp.experts.down_proj", "gate_up_proj", "mlp.gate.weight"];
    let mut params: Vec<&str> = keys.iter().copied().filter(|_| d.below(3) == 0).collect();
    if params.is_empty() {
        params.push(pick(d, &keys));
    }
    let (rank, alpha) = (pick(d, &[1, 2, 4]), pick(d, &[1.0, 4.0, 8.0]));
    let mut spec = match targets.is_empty() {
        true => LoraSpec::on_parameters(rank, alpha, &params)?,
        false => LoraSpec::new(rank, alpha, targets)?.with_target_parameters(&params)?,
    };
    spec = spec.with_rslora(d.below(4) == 0);
    if !targets.is_empty() && d.below(4) == 0 {
        spec = spec.with_layers(Some(vec![d.below(2)]));
    }
    if !targets.is_empty() && d.below(6) == 0 {
        spec = spec.with_target_regex(Some(pick(d, &[r".*\.layers\.1\..*(q_proj|v_proj)", r".*(o_proj|down_proj)", r".*\.mlp\..*"]).to_string()))?;
    }
    let pattern_keys = ["mlp.experts.down_proj", "gate_up_proj", "q_proj", "mlp.gate.weight", "down_proj", r".*\.experts\..*"];
    if d.below(3) == 0 {
        spec = spec.with_rank_pattern(vec![(pick(d, &pattern_keys).to_string(), 2 * rank)])?;
    }
    if d.below(3) == 0 {
        spec = spec.with_alpha_pattern(vec![(pick(d, &pattern_keys).to_string(), alpha + 3.0)])?;
    }
    if d.below(8) == 0 {
        spec = spec.with_modules_to_save(&["lm_head"])?;
    }
    Ok(spec)
}

/// Drawn transformers 5 adapters convert to per-expert adapters that are the same model (see
/// the module doc).
#[test]
fn random_adapters_convert_to_the_same_model() -> Result<()> {
    let range = seeds(24)?;
    let n = range.end - range.start;
    let (mut checked, mut refused, mut compacted, mut regex, mut patterns) = (0, 0, 0, 0, 0);
    let ids = ids(32)?;
    for seed in range {
        let mut d = rng(47_000 + seed);
        let style = pick(&mut d, &[MoeStyle::Qwen3Moe, MoeStyle::Mixtral, MoeStyle::Qwen2Moe]);
        let spec5 = draw_spec(&mut d)?;
        let what = format!("config {seed}: {style:?}, LoRA {spec5}");
        let (base, weights) = moe_model(style, None)?;
        let cfg5 = base.clone().with_lora(Some(spec5));
        if let Err(e) = cfg5.validate() {
            // (a key naming no parameter of this mixture, the router as a target module beside
            // expert parameters)
            let e = e.to_string();
            assert!(e.contains("target_parameters key") || e.contains("router"), "{what}: refused for {e}");
            refused += 1;
            continue;
        }
        let mut adapters5 = seeded(&cfg5, 7000 + 100 * seed)?;
        // zero columns in gate's and up's B (every expert's): left out by the conversion
        let zeroing = d.below(2) == 0;
        // (in the names' order: the draws reproducible)
        let mut parts: Vec<String> = adapters5.keys().filter(|n| zeroing && (n.ends_with("experts.gate_proj.lora_B.weight") || n.ends_with("experts.up_proj.lora_B.weight"))).cloned().collect();
        parts.sort();
        for name in parts {
            let Some(t) = adapters5.get_mut(&name) else { continue };
            let r = t.dim(2)?;
            let keep: Vec<f32> = (0..r).map(|_| if d.below(2) == 0 { 0.0 } else { 1.0 }).collect();
            *t = t.broadcast_mul(&Tensor::new(keep.as_slice(), &Device::Cpu)?.reshape((1, 1, r))?)?;
        }
        let (spec4, adapters4) = per_expert_adapter(&cfg5, &adapters5).map_err(|e| candle_core::Error::Msg(format!("{what}: {e}")))?;
        let cfg4 = base.clone().with_lora(Some(spec4.clone()));
        let spec5 = cfg5.lora.clone().ok_or_else(|| candle_core::Error::Msg("a spec".into()))?;
        let (mut m5, mut m4) = (weights.clone(), weights.clone());
        let (n5, n4) = (merge_adapter(&mut m5, &spec5, &adapters5)?, merge_adapter(&mut m4, &spec4, &adapters4)?);
        assert_eq!(n5, n4, "{what}: merged weights ({spec4})");
        for (name, t) in &m5 {
            let e = max_diff(t, &m4[name])?;
            assert!(e < 1e-7, "{what}: {name} merges {e} apart ({spec4})");
        }
        let (mut full5, mut full4) = (weights.clone(), weights.clone());
        full5.extend(adapters5.clone());
        full4.extend(adapters4.clone());
        let a = run_layout_recompute(&full5, &cfg5, &ids, Layout::single(), &Device::Cpu, false)?;
        let b = run_layout_recompute(&full4, &cfg4, &ids, Layout::single(), &Device::Cpu, false)?;
        let e = max_diff(&a.logits, &b.logits)?;
        assert!(e < 1e-5, "{what}: logits {e} apart ({spec4})");
        // the file read back
        let dir = tmp(&format!("random-{seed}"));
        save_peft_adapter(&dir, &spec4, &adapters4, "base")?;
        let (read, tensors) = load_peft_adapter(&dir)?;
        let rcfg = base.clone().with_lora(Some(candle_cp_llama::expert_params::transformers_5_spec(&base, read, tensors.keys())));
        assert_eq!(rcfg.lora, cfg4.lora, "{what}: the spec read back");
        let tensors = model_adapters(&rcfg, tensors)?;
        assert_eq!(tensors.len(), adapters4.len(), "{what}: the tensors read back");
        for (name, t) in &adapters4 {
            assert_eq!(max_diff(t, &tensors[name])?, 0.0, "{what}: {name} read back");
        }
        std::fs::remove_dir_all(&dir).ok();
        checked += 1;
        compacted += zeroing as usize;
        regex += spec4.target_regex.is_some() as usize;
        patterns += (!spec4.rank_pattern.is_empty() || !spec4.alpha_pattern.is_empty()) as usize;
    }
    println!("{checked} adapters converted ({compacted} with zero B columns, {regex} as a regular expression, {patterns} with patterns), {refused} refused");
    assert!(checked >= n as usize / 2, "{checked} of {n} checked");
    Ok(())
}
