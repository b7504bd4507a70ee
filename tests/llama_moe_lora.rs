//! LoRA adapters on a mixture of experts' experts and shared expert (the targets `gate_proj`,
//! `up_proj`, `down_proj` adapt every expert's projections, as PEFT does), on parallel layouts,
//! against references they must equal:
//!
//! - The adapted model is the model with merged weights `W_e + s·B_e·A_e` (every expert's, the
//!   shared expert's, the dense ones', the routers' — PEFT's `all-linear` adapts `gate` and
//!   `shared_expert_gate` too —): its logits and loss are the float64 reference's of the
//!   merged weights, the adapters' gradients follow from its weight gradients by the chain rule
//!   (`dA_e = s·B_eᵀ·dW_e`, `dB_e = s·dW_e·A_eᵀ`), on one device, TP with and without SP, TP ×
//!   CP, and expert parallelism (alone, with TP + SP, across DP replicas); the three styles
//!   (Qwen3-MoE, Mixtral's `block_sparse_moe` names, Qwen2-MoE's shared expert, GLM-4.5's
//!   sigmoid router and ungated shared experts).
//! - PEFT files hold one factor per expert (`mlp.experts.{e}.gate_proj.lora_A.weight`, Mixtral's
//!   `block_sparse_moe.experts.{e}.w1`, with target modules `w1`, `w3`, `w2`): written and read
//!   back stacked bit for bit (DoRA's magnitudes too, one per expert); an expert missing from
//!   the file is refused by name.
//! - DoRA (`use_dora`): the same against the merged model `m / ‖W + s·B·A‖ ⊙ (W + s·B·A)`, the
//!   magnitudes' gradients by DoRA's chain rule (Qwen3-MoE, Qwen2-MoE, eight layouts each; the
//!   routers too, with all-linear).
//! - Generation: the cached decode equals the full forward; CP, TP and EP decode alike.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::lora::{is_lora_name, load_peft_adapter, merge_adapter, save_peft_adapter, ALL_LINEAR, TARGETS};
use candle_cp_llama::verify::{load_reference, run_layout_recompute, LayoutRun};
use candle_cp_llama::{param_specs, LlamaConfig, LoraSpec, MoeStyle};
use candle_cp_tests::dense_llama::{reference_rows, reference_routed};
use candle_cp_tests::moe_model::moe_model;
use std::collections::HashMap;

const RANK: usize = 4;
const ALPHA: f64 = 6.0;
const T: usize = 128;

fn ids(t: usize) -> Result<Tensor> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, t)?.contiguous()
}

/// The model of `style` with adapters on all seven projections (config, full weights with
/// seeded factors, `B ≠ 0`).
/// With `dora`, DoRA's magnitudes off the rows' norms ([`candle_cp_tests::lora_ref::set_magnitudes`]).
fn adapted(style: MoeStyle, dora: bool) -> Result<(LlamaConfig, LlamaConfig, HashMap<String, Tensor>)> {
    let (base, mut full) = moe_model(style, None)?;
    // (PEFT's all-linear: the routers too, with DoRA's magnitudes when `dora`)
    let cfg = base.clone().with_lora(Some(LoraSpec::new(RANK, ALPHA, &ALL_LINEAR)?.with_dora(dora)));
    for (i, s) in param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        let sd = if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 };
        full.insert(s.name.clone(), candle_cp_ops::oracle::randn(1300 + i as u64, &s.shape, sd)?.to_dtype(DType::F32)?);
    }
    if dora {
        candle_cp_tests::lora_ref::set_magnitudes(&cfg, &mut full, 1700)?;
    }
    Ok((base, cfg, full))
}

use candle_cp_tests::lora_ref::{f64s, rel};

/// `run` against the merged model: logits, loss, every adapter gradient; the ranks agree.
fn check(what: &str, run: &LayoutRun, logits: &Tensor, loss: f64, want: &HashMap<String, Tensor>) -> Result<()> {
    let e_logits = (f64s(&run.logits)? - f64s(logits)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    let got: HashMap<&String, &Tensor> = run.grads.iter().map(|(n, g)| (n, g)).collect();
    let (mut worst, mut at) = (0f64, String::new());
    for (n, w) in want {
        let Some(g) = got.get(n) else { candle_core::bail!("{what}: no gradient for {n}") };
        let e = rel(g, w)?;
        if e > worst {
            (worst, at) = (e, n.clone());
        }
    }
    println!("{what}: logits {e_logits:.2e}, loss {:.1e}, adapter gradients {worst:.2e} ({at}), rank spread {:.1e}", (run.loss - loss).abs(), run.grad_spread);
    assert!(e_logits < 2e-5, "{what}: logits off by {e_logits}");
    assert!((run.loss - loss).abs() < 5e-6, "{what}: loss {} vs {loss}", run.loss);
    assert!(run.grad_spread < 1e-6, "{what}: the ranks' adapter gradients differ by {}", run.grad_spread);
    assert_eq!(run.grads.len(), want.len(), "{what}: the adapters' gradients, and only theirs");
    assert!(worst < 2e-4, "{what}: {at} off by {worst} (relative)");
    Ok(())
}

/// Every style on TP (with and without SP), TP × CP and expert-parallel layouts equals the
/// merged model's float64 reference, adapter gradients by the chain rule; the expert and
/// shared-expert factors move the logits (they are not left out).
#[test]
fn expert_adapters_equal_the_merged_model_on_every_layout() -> Result<()> {
    let ids = ids(T)?;
    let two = Tensor::cat(&[&ids, &ids], 0)?;
    // (weights merged: q, k, v, o, and the MLP's or the experts' gate, up, down on 2 layers; the
    // routers, with DoRA too: Qwen3-MoE's 1, Mixtral's 2, Qwen2-MoE's router and shared gate)
    // (GLM-4.5: its router and ungated shared experts, 18)
    let runs = [(MoeStyle::Qwen3Moe, 15, false), (MoeStyle::Mixtral, 16, false), (MoeStyle::Qwen2Moe, 19, false), (MoeStyle::Glm4Moe, 18, false), (MoeStyle::Qwen3Moe, 15, true), (MoeStyle::Qwen2Moe, 19, true)];
    for (style, merged_n, dora) in runs {
        let (base, cfg, full) = adapted(style, dora)?;
        let specs = param_specs(&cfg);
        let stacked: Vec<&str> = specs.iter().filter(|s| s.is_lora() && s.is_expert()).map(|s| s.name.as_str()).collect();
        let per = if dora { 9 } else { 6 };
        assert_eq!(stacked.len(), per * cfg.moe_layers(), "{style:?}: A and B (and DoRA's m) of gate, up, down per sparse layer: {stacked:?}");
        let (adapters, weights): (HashMap<String, Tensor>, HashMap<String, Tensor>) = full.clone().into_iter().partition(|(n, _)| is_lora_name(n));
        let spec = cfg.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
        let mut merged = weights.clone();
        assert_eq!(merge_adapter(&mut merged, &spec, &adapters)?, merged_n, "{style:?}: weights merged");
        let (want, margin) = reference_routed(&merged, &base, &ids)?;
        assert!(margin > 1e-5, "{style:?}: a near tie in the routing ({margin:.1e})");
        // the experts' adapters bind: merging the others alone gives other logits
        let moe_factor = |n: &str| n.contains("experts.") || n.contains("shared_expert.");
        let dense: HashMap<String, Tensor> = adapters.iter().filter(|(n, _)| !moe_factor(n)).map(|(n, t)| (n.clone(), t.clone())).collect();
        let mut no_experts = weights.clone();
        merge_adapter(&mut no_experts, &spec, &dense)?;
        let without = reference_routed(&no_experts, &base, &ids)?.0;
        let moved = (f64s(&without.logits)? - f64s(&want.logits)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        assert!(moved > 1e-3, "{style:?}: the expert adapters move the logits by only {moved:.1e}");
        let rows_want = reference_rows(&want)?;
        let want_g = candle_cp_tests::lora_ref::adapter_grads(&cfg, &full, &want.grads)?;
        let layouts = [
            (Layout::single(), false, false),
            (Layout::single().with_tp(2, false), false, false),
            (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), false, false),
            (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true, false),
            (Layout::cp(CpKind::Zigzag, 2).with_ep(2), false, false),
            (Layout::cp(CpKind::AllGather, 2).with_tp(2, false).with_ep(2), false, false),
            (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), false, false),
            (Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(4), false, true),
        ];
        for (layout, recompute, dp) in layouts {
            let (input, r) = if dp { (&two, &rows_want) } else { (&ids, &want) };
            let run = run_layout_recompute(&full, &cfg, input, layout, &Device::Cpu, recompute)?;
            check(&format!("{style:?}{} {layout}{}", if dora { " DoRA" } else { "" }, if recompute { " (recomputed)" } else { "" }), &run, &r.logits, r.loss, &want_g)?;
        }
    }
    Ok(())
}

/// A PEFT adapter of a mixture of experts holds each expert's factors under its own name (and
/// Mixtral's module names, `w1`, `w3`, `w2`, in its target modules; its router's as
/// `block_sparse_moe.gate`); reading it gives the
/// stacked factors back bit for bit and the same model; an expert missing is refused by name;
/// with DoRA the routers take magnitudes too.
#[test]
fn expert_adapters_round_trip_through_peft_files() -> Result<()> {
    let root = std::env::temp_dir().join(format!("candle-cp-moe-lora-{}", std::process::id()));
    for style in [MoeStyle::Qwen2Moe, MoeStyle::Mixtral] {
        // (Qwen2-MoE's as DoRA: a magnitude per expert too)
        let (_, cfg, full) = adapted(style, style == MoeStyle::Qwen2Moe)?;
        let spec = cfg.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
        let adapters: HashMap<String, Tensor> = full.iter().filter(|(n, _)| is_lora_name(n)).map(|(n, t)| (n.clone(), t.clone())).collect();
        let dir = root.join(format!("{style:?}"));
        save_peft_adapter(&dir, &spec, &adapters, "base")?;
        let file = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)?;
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let targets: Vec<&str> = json["target_modules"].as_array().map(|a| a.iter().filter_map(|v| v.as_str()).collect()).unwrap_or_default();
        let (module, gate, expected_targets) = match style {
            MoeStyle::Mixtral => ("block_sparse_moe", "w1", vec!["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2", "gate", "shared_expert_gate", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]),
            _ => ("mlp", "gate_proj", ALL_LINEAR.to_vec()),
        };
        assert_eq!(targets, expected_targets, "{style:?}: PEFT's target modules");
        let per_expert = format!("base_model.model.model.layers.1.{module}.experts.7.{gate}.lora_A.weight");
        assert_eq!(file.get(&per_expert).map(|t| t.dims().to_vec()), Some(vec![RANK, cfg.hidden_size]), "{style:?}: {per_expert}");
        assert!(file.keys().all(|n| !n.contains("experts.gate_proj")), "{style:?}: no stacked tensor on disk");
        if style == MoeStyle::Mixtral {
            // the router's adapter (PEFT's all-linear adapts `block_sparse_moe.gate`) under its name
            let router = "base_model.model.model.layers.1.block_sparse_moe.gate.lora_B.weight";
            assert_eq!(file.get(router).map(|t| t.dims().to_vec()), Some(vec![8, RANK]), "{router}");
        }
        if spec.dora {
            let m = format!("base_model.model.model.layers.1.{module}.experts.7.down_proj.lora_magnitude_vector");
            assert_eq!(file.get(&m).map(|t| t.dims().to_vec()), Some(vec![cfg.hidden_size]), "{style:?}: {m}");
            assert_eq!(json["use_dora"], serde_json::json!(true));
        }
        let (read_spec, read) = load_peft_adapter(&dir)?;
        assert_eq!(read_spec, spec, "{style:?}: the spec read back");
        assert_eq!(read.len(), adapters.len(), "{style:?}: the stacked factors");
        for (n, t) in &adapters {
            let got = read.get(n).ok_or_else(|| candle_core::Error::Msg(format!("{style:?}: {n} not read back")))?;
            assert_eq!(got.dims(), t.dims(), "{n}");
            assert_eq!((got - t)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?, 0.0, "{n}");
        }
        // an expert's factor missing from the file is refused by name
        let mut short: HashMap<String, Tensor> = file.clone();
        short.remove(&format!("base_model.model.model.layers.1.{module}.experts.3.{gate}.lora_B.weight"));
        candle_core::safetensors::save(&short, dir.join("adapter_model.safetensors"))?;
        let e = load_peft_adapter(&dir).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("experts") && e.contains("expert 4 where expert 3"), "{style:?}: {e}");
    }
    let _ = std::fs::remove_dir_all(&root);
    // DoRA with all-linear: the routers take magnitudes too (PEFT's `gate` [E, h]: one per expert)
    let (base, _) = moe_model(MoeStyle::Qwen3Moe, None)?;
    let cfg = base.with_lora(Some(LoraSpec::new(RANK, ALPHA, &ALL_LINEAR)?.with_dora(true)));
    cfg.validate()?;
    let gate_m = param_specs(&cfg).into_iter().find(|s| s.name == "model.layers.1.mlp.gate.lora_magnitude_vector");
    assert_eq!(gate_m.map(|s| s.shape), Some(vec![cfg.moe.as_ref().map_or(0, |m| m.num_experts)]), "the router's DoRA magnitude");
    Ok(())
}

/// Generation with the experts adapted: the cached decode equals the full forward, and zigzag
/// 2, TP 2 and EP 2 over zigzag 2 decode the single device's tokens (Qwen2-MoE, as DoRA: a
/// shared expert; Mixtral: `block_sparse_moe`); with the adapters merged into the weights
/// (`Llama::with_adapters_merged`) one device, TP 2 + SP and EP 2 decode the same tokens.
#[test]
fn expert_adapters_generate_alike_on_every_layout() -> Result<()> {
    let ids = ids(32)?;
    for style in [MoeStyle::Qwen2Moe, MoeStyle::Mixtral] {
        let (_, cfg, full) = adapted(style, style == MoeStyle::Qwen2Moe)?;
        let layouts = [Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_ep(2)];
        candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids, &layouts)?;
        // the adapters merged into the weights (what generation runs): the same tokens
        let e = candle_cp_tests::lora_ref::merged_generation_agrees(&cfg, &full, &ids, &[Layout::single(), Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_ep(2)])?;
        println!("{style:?}: merged adapters' logits within {e:.1e}");
    }
    Ok(())
}

/// PEFT's per-module selection (`crate::lora_select`): adapters on the sparse layer only
/// (`layers_to_transform`), q_proj at rank 2, every expert's down_proj at rank 6 (one regular
/// expression for all of them), the shared expert's up_proj at rank 3, o_proj's alpha 2: the
/// model equals the merged model's float64 reference (each adapter merged with its own scale),
/// the gradients its chain rule's, on one device, TP 2 + SP × zigzag 2 and EP 2 over zigzag 2;
/// the selection round-trips through a PEFT file.
#[test]
fn per_module_ranks_and_layers_equal_the_merged_model() -> Result<()> {
    let ids = ids(T)?;
    let (base, weights) = moe_model(MoeStyle::Qwen2Moe, None)?;
    let spec = LoraSpec::new(RANK, ALPHA, &TARGETS)?
        .with_rank_pattern(vec![("q_proj".into(), 2), ("mlp\\.experts\\.\\d+\\.down_proj".into(), 6), ("shared_expert.up_proj".into(), 3)])?
        .with_alpha_pattern(vec![("o_proj".into(), 2.0)])?
        .with_layers(Some(vec![1]));
    let cfg = base.clone().with_lora(Some(spec.clone()));
    let specs: std::collections::BTreeMap<String, Vec<usize>> = param_specs(&cfg).into_iter().filter(|s| s.is_lora()).map(|s| (s.name, s.shape)).collect();
    assert!(specs.keys().all(|n| n.starts_with("model.layers.1.")), "layer 1 only");
    assert_eq!(specs["model.layers.1.self_attn.q_proj.lora_A.weight"][0], 2);
    assert_eq!(specs["model.layers.1.mlp.experts.down_proj.lora_A.weight"][..2], [8, 6]);
    assert_eq!(specs["model.layers.1.mlp.experts.up_proj.lora_A.weight"][..2], [8, RANK]);
    assert_eq!(specs["model.layers.1.mlp.shared_expert.up_proj.lora_B.weight"][1], 3);
    let mut full = weights.clone();
    // (in name order: each adapter its own seed whatever the hash order)
    for (i, (n, shape)) in specs.iter().enumerate() {
        let sd = if n.ends_with("lora_B.weight") { 0.05 } else { 0.2 };
        full.insert(n.clone(), candle_cp_ops::oracle::randn(2100 + i as u64, shape, sd)?.to_dtype(DType::F32)?);
    }
    let adapters: HashMap<String, Tensor> = full.iter().filter(|(n, _)| is_lora_name(n)).map(|(n, t)| (n.clone(), t.clone())).collect();
    let mut merged = weights.clone();
    assert_eq!(merge_adapter(&mut merged, &spec, &adapters)?, 10, "q, k, v, o, three experts' and three shared projections of layer 1");
    let (want, margin) = reference_routed(&merged, &base, &ids)?;
    assert!(margin > 1e-5, "a near tie in the routing ({margin:.1e})");
    let want_g = candle_cp_tests::lora_ref::adapter_grads(&cfg, &full, &want.grads)?;
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_ep(2)] {
        let run = run_layout_recompute(&full, &cfg, &ids, layout, &Device::Cpu, false)?;
        check(&format!("per-module ranks, layer 1 only, {layout}"), &run, &want.logits, want.loss, &want_g)?;
    }
    let dir = std::env::temp_dir().join(format!("candle-cp-lora-select-{}", std::process::id()));
    save_peft_adapter(&dir, &spec, &adapters, "base")?;
    let (read, tensors) = load_peft_adapter(&dir)?;
    assert_eq!(read, spec, "the selection read back");
    assert_eq!(tensors.len(), adapters.len());
    std::fs::remove_dir_all(&dir).ok();
    // layers the model does not have, or none, are refused by name
    for layers in [vec![2], vec![]] {
        let e = base.clone().with_lora(Some(spec.clone().with_layers(Some(layers)))).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("layers_to_transform") && e.contains("2 decoder layers"), "{e}");
    }
    Ok(())
}

/// A transformers 5 adapter on a mixture: its routed experts and routers are parameters, so
/// PEFT's `target_modules` (here `all-linear`'s list as PEFT writes it) adapt the attention, a
/// dense layer's MLP and a shared expert only, and the file holds no expert's tensor. Read by
/// [`candle_cp_llama::lora::load_adapter_sharded`] (generation) and `merge-lora`'s path
/// (`expert_params::transformers_5_spec`), it is that model (Qwen2-MoE: layer 0 dense, a shared
/// expert and its gate; Qwen3-MoE: layer 0 dense): the same logits as the model built with its
/// experts as parameters, the adapters moving them; the same file read as a transformers 4
/// adapter (`load_peft_adapter`'s spec as it is) is refused for the experts' missing tensors.
#[test]
fn a_transformers_5_adapter_without_expert_tensors_reads() -> Result<()> {
    use candle_cp_llama::lora::GateUp;
    let root = std::env::temp_dir().join(format!("candle-cp-moe-lora-v5-{}", std::process::id()));
    for style in [MoeStyle::Qwen2Moe, MoeStyle::Qwen3Moe] {
        let (base, mut full) = moe_model(style, None)?;
        let spec = LoraSpec::new(RANK, ALPHA, &ALL_LINEAR)?;
        let cfg5 = base.clone().with_lora(Some(spec.clone().with_expert_params(Some(GateUp::Concatenated))));
        cfg5.validate()?;
        let specs: Vec<_> = param_specs(&cfg5).into_iter().filter(|s| s.is_lora()).collect();
        assert!(specs.iter().all(|s| !s.name.contains(".experts.") && !s.name.contains("mlp.gate.")), "{style:?}: no expert or router adapter");
        assert!(specs.iter().any(|s| s.name.starts_with("model.layers.0.mlp.down_proj")), "{style:?}: the dense layer's MLP");
        for (i, s) in specs.iter().enumerate() {
            full.insert(s.name.clone(), candle_cp_ops::oracle::randn(5300 + i as u64, &s.shape, if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 })?.to_dtype(DType::F32)?);
        }
        let adapters: HashMap<String, Tensor> = full.iter().filter(|(n, _)| is_lora_name(n)).map(|(n, t)| (n.clone(), t.clone())).collect();
        let dir = root.join(format!("{style:?}"));
        candle_cp_llama::save_hf(&dir, &candle_cp_tests::varmap_of(full.iter().filter(|(n, _)| !is_lora_name(n)))?, &base)?;
        save_peft_adapter(&dir, cfg5.lora.as_ref().unwrap_or(&spec), &adapters, "base")?;
        // read as a transformers 4 adapter: the experts' tensors are missing
        let (read, tensors) = load_peft_adapter(&dir)?;
        assert_eq!(read.expert_params, None);
        let missing: Vec<String> = param_specs(&base.clone().with_lora(Some(read.clone()))).into_iter().filter(|s| s.is_lora() && !tensors.contains_key(&s.name)).map(|s| s.name).collect();
        assert!(missing.iter().any(|n| n.contains(".experts.")), "{style:?}: {missing:?}");
        // read for generation: transformers 5's model
        let ids = ids(64)?;
        let want = run_layout_recompute(&full, &cfg5, &ids, Layout::single(), &Device::Cpu, false)?;
        let plain = run_layout_recompute(&full, &base, &ids, Layout::single(), &Device::Cpu, false)?;
        let mut got = candle_cp_comm::run_ranks(1, |g| {
            let ctx = candle_cp_llama::ParallelCtx::new(g, Layout::single())?;
            let (vm, bcfg) = candle_cp_llama::load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32)?;
            let Some(lcfg) = candle_cp_llama::lora::load_adapter_sharded(&dir, &bcfg, &vm, &ctx, DType::F32, &Device::Cpu)? else { candle_core::bail!("no adapter") };
            assert_eq!(lcfg.lora, cfg5.lora, "{style:?}: the spec read for generation");
            let model = candle_cp_llama::Llama::new(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &lcfg, &ctx)?;
            model.forward(&ids, &Tensor::arange(0u32, 64, &Device::Cpu)?)?.to_dtype(DType::F32)
        });
        let logits = got.pop().unwrap_or_else(|| candle_core::bail!("no rank"))?;
        let d = (f64s(&logits)? - f64s(&want.logits.reshape(logits.dims())?)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        let moved = (f64s(&want.logits)? - f64s(&plain.logits)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        println!("{style:?}: a transformers 5 adapter read for generation: logits {d:.1e} (the adapters move them {moved:.1e})");
        assert!(d < 1e-5 && moved > 1e-3, "{style:?}: logits {d}, moved {moved}");
        // a fine-tune started from it (finetune_llama's --lora-from: the trainer's lora_init with
        // the file's own spec) reads it alike: at learning rate 0 its step-1 checkpoint is the
        // file, tensor for tensor (refused before for the experts' missing tensors)
        let out = root.join(format!("{style:?}-run"));
        let mut c = candle_cp_llama::train::TrainConfig::new(Layout::single().with_tp(2, true), candle_cp_llama::train::ModelSource::Hf(dir.clone()), candle_cp_llama::train::DataSource::Recall(candle_cp_llama::train::KvRecall::new(64)?), 64, 1);
        (c.lora, c.lora_init, c.out, c.save_every) = (Some(read), Some(dir.clone()), Some(out.clone()), 1);
        c.schedule.peak = 0.0;
        candle_cp_tests::train_draws::run(&c)?;
        let (a, b) = (candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)?, candle_core::safetensors::load(out.join("checkpoints/step-000001/adapter_model.safetensors"), &Device::Cpu)?);
        assert_eq!(a.len(), b.len(), "{style:?}: the run's adapter file");
        for (n, t) in &a {
            assert_eq!((t - &b[n])?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?, 0.0, "{style:?}: {n} after a step at learning rate 0");
        }
    }
    // (a transformers 4 adapter whose layers hold no expert it adapts — layer 0 of Qwen3-MoE is
    // dense — stays one; a regular expression over transformers 4's names that reaches the
    // experts, with no expert tensor in the file, reads as transformers 5's model)
    let (base, _) = moe_model(MoeStyle::Qwen3Moe, None)?;
    let none: [&str; 0] = [];
    let dense = LoraSpec::new(RANK, ALPHA, &ALL_LINEAR)?.with_layers(Some(vec![0]));
    assert_eq!(candle_cp_llama::expert_params::transformers_5_spec(&base, dense.clone(), none), dense);
    let regex = LoraSpec::new(RANK, ALPHA, &["q_proj"])?.with_target_regex(Some(r".*\.(q_proj|down_proj)".into()))?;
    assert_eq!(candle_cp_llama::expert_params::transformers_5_spec(&base, regex, none).expert_params, Some(candle_cp_llama::lora::GateUp::Concatenated));
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
