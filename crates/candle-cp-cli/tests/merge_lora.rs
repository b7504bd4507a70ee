//! The `candle-cp merge-lora` binary: a checkpoint with a PEFT adapter beside the base model, or
//! naming it, becomes one model whose logits equal the adapted model's (its head trained whole,
//! `modules_to_save`, replacing the base's); a directory without an
//! adapter, or whose adapter names a base that is not there, is refused (exit 2). A Mixtral's
//! DoRA adapter (every expert's projections adapted, `block_sparse_moe.experts.{e}.w1` in the
//! file) merges into each expert's weights, and so does a transformers 5 Mixtral's adapter on its
//! expert parameters (`mlp.experts.gate_up_proj`, its base in transformers 5's layout too). A
//! Phi-3's merged model is written with its fused `qkv_proj` / `gate_up_proj` again.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::lora::{save_peft_adapter, TARGETS};
use candle_cp_llama::{layout::Layout, LoraSpec, ParallelCtx};
use candle_nn::VarBuilder;
use std::path::Path;

mod common;
use common::candle_cp;

#[test]
fn merged_model_equals_the_adapted_one() -> Result<()> {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle/tiny-llama");
    let dir = std::env::temp_dir().join(format!("candle-cp-merge-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(tiny.join(f), dir.join(f))?;
    }
    // adapters on every projection, B off zero (as after training)
    let (_, base_cfg) = candle_cp_llama::load_hf(&dir, &Device::Cpu, DType::F32)?;
    // (and the head trained whole: modules_to_save)
    let spec = LoraSpec::new(4, 8.0, &TARGETS)?.with_modules_to_save(&["lm_head"])?;
    let cfg = base_cfg.clone().with_lora(Some(spec.clone()));
    let mut adapters = std::collections::HashMap::new();
    for (i, s) in candle_cp_llama::param_specs(&cfg).into_iter().filter(|s| spec.trains(&s.name)).enumerate() {
        adapters.insert(s.name.clone(), candle_cp_ops::oracle::randn(70 + i as u64, &s.shape, 0.1)?);
    }
    save_peft_adapter(&dir, &spec, &adapters, "tiny-llama")?;
    let out = dir.join("merged");
    let o = candle_cp(&["merge-lora", "--checkpoint", dir.to_str().unwrap_or(""), "--out", out.to_str().unwrap_or("")]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("merged 15 weights"), "{text}");
    let ids = Tensor::new(&[[5u32, 17, 200, 3, 99, 41, 7, 300]], &Device::Cpu)?;
    let pos = Tensor::arange(0u32, 8, &Device::Cpu)?;
    let logits = candle_cp_comm::run_ranks(1, |g| {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        let (vm, base) = candle_cp_llama::load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32)?;
        let Some(lcfg) = candle_cp_llama::lora::load_adapter_sharded(&dir, &base, &vm, &ctx, DType::F32, &Device::Cpu)? else {
            candle_core::bail!("no adapter")
        };
        let adapted = candle_cp_llama::Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &lcfg, &ctx)?;
        let (mvm, mcfg) = candle_cp_llama::load_hf_sharded(&out, &ctx, &Device::Cpu, DType::F32)?;
        assert!(mcfg.lora.is_none() && !candle_cp_llama::lora::has_adapter(&out), "a plain model");
        let merged = candle_cp_llama::Llama::new(VarBuilder::from_varmap(&mvm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
        (adapted.forward(&ids, &pos)? - merged.forward(&ids, &pos)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    });
    for e in logits {
        let e = e?;
        assert!(e < 1e-5, "merged logits differ from the adapted model's by {e}");
    }
    // a checkpoint holding the adapter alone, naming its base (as a LoRA run writes them):
    // the same merged model, byte for byte; a base that is not there is refused by name
    let ck = dir.join("ck");
    save_peft_adapter(&ck, &spec, &adapters, dir.to_str().unwrap_or(""))?;
    let out2 = dir.join("merged2");
    let o = candle_cp(&["merge-lora", "--checkpoint", ck.to_str().unwrap_or(""), "--out", out2.to_str().unwrap_or("")]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(out.join("model.safetensors"))? == std::fs::read(out2.join("model.safetensors"))?, "merged through the named base");
    let lost = dir.join("lost");
    save_peft_adapter(&lost, &spec, &adapters, "/nonexistent/base")?;
    let o = candle_cp(&["merge-lora", "--checkpoint", lost.to_str().unwrap_or(""), "--out", dir.join("x").to_str().unwrap_or("")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("'/nonexistent/base' was not found"), "{}", String::from_utf8_lossy(&o.stderr));
    // ... unless given with --base (an adapter apart from its base)
    let out3 = dir.join("merged3");
    let o = candle_cp(&["merge-lora", "--checkpoint", lost.to_str().unwrap_or(""), "--base", dir.to_str().unwrap_or(""), "--out", out3.to_str().unwrap_or("")]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(out.join("model.safetensors"))? == std::fs::read(out3.join("model.safetensors"))?, "merged over --base");
    // a plain model directory is refused
    let o = candle_cp(&["merge-lora", "--checkpoint", out.to_str().unwrap_or(""), "--out", dir.join("again").to_str().unwrap_or("")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a LoRA checkpoint"));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A Mixtral (4 experts, top 2) with DoRA adapters on every projection, every expert's among
/// them (per expert in the PEFT file, `w1` / `w3` / `w2`, each with its magnitude): the merged
/// checkpoint, written per expert, gives the adapted model's logits.
#[test]
fn merged_mixtral_equals_the_adapted_one() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("candle-cp-merge-mixtral-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base_cfg = candle_cp_llama::LlamaConfig::tiny(64, 32, 2, 4, 2).with_moe(Some(candle_cp_llama::MoeConfig::mixtral(4, 2, 16)));
    candle_cp_llama::save_hf(&dir, &candle_cp_llama::init_params(&base_cfg, 3, DType::F32, &Device::Cpu)?, &base_cfg)?;
    let spec = LoraSpec::new(4, 8.0, &TARGETS)?.with_dora(true);
    let cfg = base_cfg.clone().with_lora(Some(spec.clone()));
    let mut adapters = std::collections::HashMap::new();
    for (i, s) in candle_cp_llama::param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        let t = candle_cp_ops::oracle::randn(170 + i as u64, &s.shape, 0.3)?;
        // (magnitudes about 1: the drawn rows' norms are about 0.1)
        let t = if s.name.ends_with(candle_cp_llama::lora::MAGNITUDE) { (t + 1.0)? } else { t };
        adapters.insert(s.name.clone(), t);
    }
    save_peft_adapter(&dir, &spec, &adapters, "tiny-mixtral")?;
    let out = dir.join("merged");
    let o = candle_cp(&["merge-lora", "--checkpoint", dir.to_str().unwrap_or(""), "--out", out.to_str().unwrap_or("")]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&o.stderr));
    // 2 layers: q, k, v, o and the stacked gate, up, down of the experts
    assert!(text.contains("merged 14 weights") && text.contains("gate_proj"), "{text}");
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(out.join("model.safetensors"))? };
    assert!(st.get("model.layers.1.block_sparse_moe.experts.3.w1.weight").is_ok(), "per-expert names in the merged checkpoint");
    let (merged, plain) = merged_and_other_logits(&dir, &out, |_, base| Ok(base.clone()))?;
    assert!(merged < 1e-5, "merged logits differ from the adapted model's by {merged}");
    assert!(plain > 1e-3, "the adapters move the logits by only {plain}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A Phi-3 base (fused `qkv_proj` / `gate_up_proj` in its file) with PEFT's adapters on its
/// four linear modules (the fused ones' `A` shared by their parts): the merged model is a
/// Phi-3 checkpoint again, fused, whose logits are the adapted model's.
#[test]
fn a_phi3_merges_into_a_fused_checkpoint() -> Result<()> {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle/tiny-llama");
    let dir = std::env::temp_dir().join(format!("candle-cp-merge-phi3-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (vm, cfg) = candle_cp_llama::load_hf(&tiny, &Device::Cpu, DType::F32)?;
    let cfg = cfg.with_phi3(true);
    let mut named: Vec<(String, Tensor)> = candle_cp_llama::params::varmap_tensors(&vm)?.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    candle_cp_llama::save_hf_tensors(&dir, &named, &cfg)?;
    // every linear layer: PEFT's qkv_proj, o_proj, gate_up_proj, down_proj
    let lcfg = cfg.clone().with_lora(Some(LoraSpec::new(4, 8.0, &TARGETS)?));
    let Some(spec) = lcfg.lora.clone() else { candle_core::bail!("a LoRA spec") };
    let mut adapters = std::collections::HashMap::new();
    for (i, s) in candle_cp_llama::param_specs(&lcfg).into_iter().filter(|s| spec.trains(&s.name)).enumerate() {
        adapters.insert(s.name.clone(), candle_cp_ops::oracle::randn(90 + i as u64, &s.shape, 0.1)?);
    }
    save_peft_adapter(&dir, &spec, &adapters, "tiny-phi3")?;
    let out = dir.join("merged");
    let o = candle_cp(&["merge-lora", "--checkpoint", dir.to_str().unwrap_or(""), "--out", out.to_str().unwrap_or("")]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("merged 8 weights"), "{}", String::from_utf8_lossy(&o.stdout));
    let merged_file = candle_cp_llama::hf::load_safetensors_dir(&out, &Device::Cpu)?;
    assert!(merged_file.contains_key("model.layers.1.self_attn.qkv_proj.weight") && !merged_file.contains_key("model.layers.1.self_attn.q_proj.weight"));
    let ids = Tensor::new(&[[5u32, 17, 200, 3, 99, 41, 7, 300]], &Device::Cpu)?;
    let pos = Tensor::arange(0u32, 8, &Device::Cpu)?;
    for e in candle_cp_comm::run_ranks(1, |g| {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        let (vm, base) = candle_cp_llama::load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32)?;
        let Some(acfg) = candle_cp_llama::lora::load_adapter_sharded(&dir, &base, &vm, &ctx, DType::F32, &Device::Cpu)? else {
            candle_core::bail!("no adapter")
        };
        let adapted = candle_cp_llama::Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &acfg, &ctx)?;
        let (mvm, mcfg) = candle_cp_llama::load_hf_sharded(&out, &ctx, &Device::Cpu, DType::F32)?;
        assert!(mcfg.phi3 && mcfg.lora.is_none(), "{mcfg:?}");
        let merged = candle_cp_llama::Llama::new(VarBuilder::from_varmap(&mvm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
        let base_only = candle_cp_llama::Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &base, &ctx)?;
        let a = adapted.forward(&ids, &pos)?;
        let moved = (&a - base_only.forward(&ids, &pos)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        Ok(((a - merged.forward(&ids, &pos)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?, moved))
    }) {
        let (e, moved) = e?;
        assert!(e < 1e-5 && moved > 1e-3, "merged logits differ from the adapted model's by {e} (the adapter moved them by {moved})");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A gpt-oss (4 experts, top 2) with adapters on q_proj and on its expert parameters (PEFT's
/// `target_parameters`: `lora_A` `[r·E, in]`, `lora_B` `[out, r·E]` wrappers in the file): the
/// merged checkpoint, the experts fused and interleaved again (`mlp.experts.gate_up_proj`), gives
/// the adapted model's logits; the expert adapters move them.
#[test]
fn a_gpt_oss_merges_its_expert_parameter_adapters() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("candle-cp-merge-gpt-oss-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base_cfg = candle_cp_llama::LlamaConfig::tiny(64, 32, 2, 4, 2).with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(4, 2, 16)));
    candle_cp_llama::save_hf(&dir, &candle_cp_llama::init_params(&base_cfg, 5, DType::F32, &Device::Cpu)?, &base_cfg)?;
    let spec = LoraSpec::new(2, 4.0, &["q_proj"])?.with_target_parameters(&["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])?;
    let cfg = base_cfg.clone().with_lora(Some(spec.clone()));
    let mut adapters = std::collections::HashMap::new();
    for (i, s) in candle_cp_llama::param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        adapters.insert(s.name.clone(), candle_cp_ops::oracle::randn(270 + i as u64, &s.shape, 0.3)?);
    }
    save_peft_adapter(&dir, cfg.lora.as_ref().unwrap_or(&spec), &adapters, "tiny-gpt-oss")?;
    let out = dir.join("merged");
    let o = candle_cp(&["merge-lora", "--checkpoint", dir.to_str().unwrap_or(""), "--out", out.to_str().unwrap_or("")]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&o.stderr));
    // 2 layers: q and the experts' gate, up, down
    assert!(text.contains("merged 8 weights") && text.contains("mlp.experts.gate_up_proj"), "{text}");
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(out.join("model.safetensors"))? };
    let names: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).filter(|n| n.starts_with("model.layers.1.mlp.")).collect();
    assert!(st.get("model.layers.1.mlp.experts.gate_up_proj").is_ok(), "the fused experts in the merged checkpoint: {names:?}");
    let (merged, q_only) = merged_and_other_logits(&dir, &out, |adapted, _| Ok(adapted.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["q_proj"])?))))?;
    assert!(merged < 1e-5, "merged logits differ from the adapted model's by {merged}");
    assert!(q_only > 1e-3, "the expert adapters move the logits by only {q_only}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A Mixtral as transformers 5 writes it with `save_original_format=False` (the sparse layer
/// `mlp`: `mlp.gate.weight`, `mlp.experts.gate_up_proj` `[E, 2·I, h]` w1's rows then w3's,
/// `mlp.experts.down_proj`) with PEFT's adapters on those expert parameters (`target_parameters`,
/// wrappers under `mlp.experts` in the file): the merged checkpoint, written in the published
/// layout (`block_sparse_moe.experts.{e}.w1`), gives the adapted model's logits; the expert
/// adapters move them.
#[test]
fn a_transformers_5_mixtral_merges_its_expert_parameter_adapters() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("candle-cp-merge-mixtral-v5-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base_cfg = candle_cp_llama::LlamaConfig::tiny(64, 32, 2, 4, 2).with_moe(Some(candle_cp_llama::MoeConfig::mixtral(4, 2, 16)));
    candle_cp_llama::save_hf(&dir, &candle_cp_llama::init_params(&base_cfg, 7, DType::F32, &Device::Cpu)?, &base_cfg)?;
    // the published layout rewritten as transformers 5's
    let file = dir.join("model.safetensors");
    let published = candle_core::safetensors::load(&file, &Device::Cpu)?;
    let mut v5 = std::collections::HashMap::new();
    for l in 0..2 {
        let p = format!("model.layers.{l}.block_sparse_moe.");
        let experts = |w: &str| -> Result<Tensor> { Tensor::stack(&(0..4).map(|e| published[&format!("{p}experts.{e}.{w}.weight")].clone()).collect::<Vec<_>>(), 0) };
        v5.insert(format!("model.layers.{l}.mlp.experts.gate_up_proj"), Tensor::cat(&[experts("w1")?, experts("w3")?], 1)?);
        v5.insert(format!("model.layers.{l}.mlp.experts.down_proj"), experts("w2")?);
        v5.insert(format!("model.layers.{l}.mlp.gate.weight"), published[&format!("{p}gate.weight")].clone());
    }
    v5.extend(published.iter().filter(|(n, _)| !n.contains("block_sparse_moe")).map(|(n, t)| (n.clone(), t.clone())));
    candle_core::safetensors::save(&v5, &file)?;
    let spec = LoraSpec::new(2, 4.0, &["v_proj"])?.with_target_parameters(&["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])?;
    let cfg = base_cfg.clone().with_lora(Some(spec.clone()));
    let mut adapters = std::collections::HashMap::new();
    for (i, s) in candle_cp_llama::param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        adapters.insert(s.name.clone(), candle_cp_ops::oracle::randn(370 + i as u64, &s.shape, 0.3)?);
    }
    assert!(adapters.contains_key("model.layers.1.block_sparse_moe.experts.gate_up_proj.lora_A.weight"), "{:?}", adapters.keys());
    save_peft_adapter(&dir, cfg.lora.as_ref().unwrap_or(&spec), &adapters, "tiny-mixtral-v5")?;
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(dir.join("adapter_model.safetensors"))? };
    assert!(st.get("base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight").is_ok(), "transformers 5's names in the adapter file");
    let out = dir.join("merged");
    let o = candle_cp(&["merge-lora", "--checkpoint", dir.to_str().unwrap_or(""), "--out", out.to_str().unwrap_or("")]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&o.stderr));
    // 2 layers: v and the experts' gate, up, down
    assert!(text.contains("merged 8 weights") && text.contains("mlp.experts.gate_up_proj"), "{text}");
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(out.join("model.safetensors"))? };
    assert!(st.get("model.layers.1.block_sparse_moe.experts.3.w3.weight").is_ok(), "the published layout in the merged checkpoint");
    let (merged, v_only) = merged_and_other_logits(&dir, &out, |adapted, _| Ok(adapted.clone().with_lora(Some(LoraSpec::new(2, 4.0, &["v_proj"])?))))?;
    assert!(merged < 1e-5, "merged logits differ from the adapted model's by {merged}");
    assert!(v_only > 1e-3, "the expert adapters move the logits by only {v_only}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The adapted model of checkpoint `dir` (its base and adapter) on one device: how far the merged
/// model in `out` and the model `other(adapted config, base config)` builds over the same weights
/// are from its logits on a fixed 10-token sequence.
fn merged_and_other_logits(
    dir: &Path,
    out: &Path,
    other: impl Fn(&candle_cp_llama::LlamaConfig, &candle_cp_llama::LlamaConfig) -> Result<candle_cp_llama::LlamaConfig> + Sync,
) -> Result<(f32, f32)> {
    let ids = Tensor::new(&[[5u32, 17, 60, 3, 9, 41, 7, 30, 11, 2]], &Device::Cpu)?;
    let pos = Tensor::arange(0u32, 10, &Device::Cpu)?;
    let mut diffs = candle_cp_comm::run_ranks(1, |g| {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        let (vm, base) = candle_cp_llama::load_hf_sharded(dir, &ctx, &Device::Cpu, DType::F32)?;
        let Some(lcfg) = candle_cp_llama::lora::load_adapter_sharded(dir, &base, &vm, &ctx, DType::F32, &Device::Cpu)? else {
            candle_core::bail!("no adapter")
        };
        let build = |c: &candle_cp_llama::LlamaConfig| candle_cp_llama::Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), c, &ctx);
        let a = build(&lcfg)?.forward(&ids, &pos)?;
        let (mvm, mcfg) = candle_cp_llama::load_hf_sharded(out, &ctx, &Device::Cpu, DType::F32)?;
        let merged = candle_cp_llama::Llama::new(VarBuilder::from_varmap(&mvm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
        let d = |x: &Tensor| -> Result<f32> { (&a - x)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
        Ok((d(&merged.forward(&ids, &pos)?)?, d(&build(&other(&lcfg, &base)?)?.forward(&ids, &pos)?)?))
    });
    diffs.pop().unwrap_or_else(|| candle_core::bail!("no rank ran"))
}
