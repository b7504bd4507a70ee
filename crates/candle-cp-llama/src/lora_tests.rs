//! PEFT adapter files: rsLoRA round trip and scale, `all-linear`, the options that change what
//! an adapter computes refused by name, stray tensors refused.

use super::*;
use crate::{layout::Layout, LlamaConfig, ParallelCtx};
use candle_core::DType;
use candle_nn::{VarBuilder, VarMap};

fn tmp(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("cp-lora-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The adapters of `cfg` (B off zero), drawn from `seed`.
fn adapters(cfg: &LlamaConfig, seed: u64) -> Result<HashMap<String, Tensor>> {
    crate::param_specs(cfg)
        .into_iter()
        .filter(|s| s.is_lora())
        .enumerate()
        .map(|(i, s)| Ok((s.name.clone(), candle_cp_ops::oracle::randn(seed + i as u64, &s.shape, 0.2)?)))
        .collect()
}

/// Edit `dir`'s adapter_config.json.
fn edit(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) -> Result<()> {
    let mut v = read_adapter_config(dir)?;
    f(&mut v);
    std::fs::write(dir.join("adapter_config.json"), v.to_string()).map_err(candle_core::Error::wrap)
}

/// rsLoRA: saved as `use_rslora`, read back, and the model built from the file computes
/// `W + (alpha / √r)·B·A` (its logits equal the merged model's; with the plain `alpha / r` they
/// would not). An alpha that is no short decimal (`convert-lora`'s `s·√r'`) reads back to the
/// bit (serde_json's default parser was one unit in the last place off on 3.7416573867739418).
#[test]
fn rslora_round_trips_and_scales_by_the_root_of_the_rank() -> Result<()> {
    let base = LlamaConfig::tiny(64, 32, 1, 2, 1);
    let spec = LoraSpec::new(4, 8.0, &["q_proj", "down_proj"])?.with_rslora(true).with_alpha_pattern(vec![("down_proj".into(), 8.0)])?;
    assert_eq!(spec.config.scale(), 4.0);
    let cfg = base.clone().with_lora(Some(spec.clone()));
    let ad = adapters(&cfg, 11)?;
    let dir = tmp("rslora");
    save_peft_adapter(&dir, &spec, &ad, "base")?;
    assert_eq!(read_adapter_config(&dir)?["use_rslora"], serde_json::json!(true));
    let (got, _) = load_peft_adapter(&dir)?;
    assert_eq!(got, spec);
    let odd = spec.clone().with_alpha_pattern(vec![("down_proj".into(), 3.7416573867739418)])?;
    save_peft_adapter(&dir.join("odd"), &odd, &ad, "base")?;
    assert_eq!(load_peft_adapter(&dir.join("odd"))?.0, odd, "an alpha read back to the bit");
    let weights = crate::params::varmap_tensors(&crate::init_params(&base, 5, DType::F32, &Device::Cpu)?)?;
    let mut merged = weights.clone();
    assert_eq!(merge_adapter(&mut merged, &spec, &ad)?, 2);
    let mut plain = weights.clone();
    merge_adapter(&mut plain, &spec.clone().with_rslora(false), &ad)?;
    let ids = Tensor::new(&[[3u32, 9, 27, 1, 14, 5]], &Device::Cpu)?;
    let pos = Tensor::arange(0u32, 6, &Device::Cpu)?;
    let diffs = candle_cp_comm::run_ranks(1, |g| {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        let vm = VarMap::new();
        for (n, t) in &weights {
            crate::params::lock_vars(&vm)?.insert(n.clone(), candle_core::Var::from_tensor(t)?);
        }
        let Some(lcfg) = load_adapter_sharded(&dir, &base, &vm, &ctx, DType::F32, &Device::Cpu)? else { bail!("no adapter") };
        let adapted = crate::Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &lcfg, &ctx)?.forward(&ids, &pos)?;
        let dense = |w: &HashMap<String, Tensor>| -> Result<Tensor> {
            crate::Llama::new(VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu), &base, &ctx)?.forward(&ids, &pos)
        };
        let d = |x: &Tensor| -> Result<f32> { (&adapted - x)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
        Ok((d(&dense(&merged)?)?, d(&dense(&plain)?)?))
    });
    for r in diffs {
        let (rs, plain) = r?;
        assert!(rs < 1e-5, "rsLoRA adapter vs its merged model: {rs}");
        assert!(plain > 1e-3, "the plain scale gives other logits: {plain}");
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// `all-linear` adapts the seven projections and a mixture's routers; `lora_dropout` is read; a pattern, and each option that would change the
/// adapter's computation, is refused naming the key; a tensor the spec does not give the model
/// is refused naming it.
#[test]
fn peft_options_the_model_does_not_implement_are_refused() -> Result<()> {
    let base = LlamaConfig::tiny(64, 32, 1, 2, 1);
    let spec = LoraSpec::new(2, 4.0, &["q_proj"])?;
    let ad = adapters(&base.clone().with_lora(Some(spec.clone())), 3)?;
    let dir = tmp("options");
    save_peft_adapter(&dir, &spec, &ad, "base")?;
    edit(&dir, |v| v["target_modules"] = serde_json::json!("all-linear"))?;
    assert_eq!(load_peft_adapter(&dir)?.0.targets, crate::lora::ALL_LINEAR.to_vec());
    // a regular expression over whole names (crate::lora_select), written back as it is
    edit(&dir, |v| v["target_modules"] = serde_json::json!(".*layers\\.0\\..*q_proj"))?;
    let s = load_peft_adapter(&dir)?.0;
    assert!(s.adapts_weight("model.layers.0.self_attn.q_proj") && !s.adapts_weight("model.layers.1.self_attn.q_proj") && !s.adapts_weight("model.layers.0.self_attn.k_proj"));
    assert_eq!(s.peft_config_json("base")["target_modules"], serde_json::json!(".*layers\\.0\\..*q_proj"));
    edit(&dir, |v| v["target_modules"] = serde_json::json!(7))?;
    let e = load_peft_adapter(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("'target_modules'"), "{e}");
    let cases = [
        ("bias", serde_json::json!("lora_only")),
        ("lora_bias", serde_json::json!(true)),
        ("layers_pattern", serde_json::json!("h")),
        ("fan_in_fan_out", serde_json::json!(true)),
        ("layer_replication", serde_json::json!([[0, 1]])),
        ("exclude_modules", serde_json::json!(["k_proj"])),
    ];
    for (key, val) in cases {
        save_peft_adapter(&dir, &spec, &ad, "base")?;
        edit(&dir, |v| v[key] = val.clone())?;
        let e = load_peft_adapter(&dir).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(&format!("'{key}'")) && e.contains("not supported"), "{key}: {e}");
    }
    // per-module ranks and alphas, some layers only: read (crate::lora_select)
    save_peft_adapter(&dir, &spec, &ad, "base")?;
    edit(&dir, |v| {
        (v["rank_pattern"], v["alpha_pattern"], v["layers_to_transform"]) = (serde_json::json!({"q_proj": 8}), serde_json::json!({"v_proj": 2.5}), serde_json::json!(0));
    })?;
    let s = load_peft_adapter(&dir)?.0;
    assert_eq!((s.rank_pattern, s.alpha_pattern, s.layers), (vec![("q_proj".to_string(), 8)], vec![("v_proj".to_string(), 2.5)], Some(vec![0])));
    edit(&dir, |v| v["rank_pattern"] = serde_json::json!({"q_proj": "eight"}))?;
    let e = load_peft_adapter(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("'rank_pattern'") && e.contains("\"eight\""), "{e}");
    // modules trained whole: the embedding and the head read (a reward model's score head, and
    // PEFT's SEQ_CLS task's `classifier` / `score` as the score), another module refused by name
    save_peft_adapter(&dir, &spec, &ad, "base")?;
    edit(&dir, |v| v["modules_to_save"] = serde_json::json!(["lm_head"]))?;
    assert_eq!(load_peft_adapter(&dir)?.0.modules_to_save, ["lm_head"]);
    edit(&dir, |v| v["modules_to_save"] = serde_json::json!(["score"]))?;
    assert_eq!(load_peft_adapter(&dir)?.0.modules_to_save, ["score"]);
    edit(&dir, |v| (v["modules_to_save"], v["task_type"]) = (serde_json::json!(["classifier", "score"]), serde_json::json!("SEQ_CLS")))?;
    assert_eq!(load_peft_adapter(&dir)?.0.modules_to_save, ["score"]);
    edit(&dir, |v| (v["modules_to_save"], v["task_type"]) = (serde_json::json!(["classifier"]), serde_json::json!("TOKEN_CLS")))?;
    assert_eq!(load_peft_adapter(&dir)?.0.modules_to_save, ["score"]);
    edit(&dir, |v| (v["modules_to_save"], v["task_type"]) = (serde_json::json!(["classifier"]), serde_json::json!("CAUSAL_LM")))?;
    let e = load_peft_adapter(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("'classifier'") && e.contains("modules_to_save"), "{e}");
    // the defaults PEFT writes are accepted (bias "none", empty patterns, dropout)
    save_peft_adapter(&dir, &spec, &ad, "base")?;
    edit(&dir, |v| {
        (v["rank_pattern"], v["alpha_pattern"], v["modules_to_save"], v["lora_dropout"]) =
            (serde_json::json!({}), serde_json::json!({}), serde_json::Value::Null, serde_json::json!(0.05));
    })?;
    assert_eq!(load_peft_adapter(&dir)?.0, spec.clone().with_dropout(0.05)?, "lora_dropout read");
    // a stray tensor (an adapter on a layer the model does not have)
    let mut more = ad.clone();
    more.insert("model.layers.1.self_attn.q_proj.lora_A.weight".into(), Tensor::zeros((2, 32), DType::F32, &Device::Cpu)?);
    save_peft_adapter(&dir, &spec, &more, "base")?;
    let e = candle_cp_comm::run_ranks(1, |g| {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        load_adapter_sharded(&dir, &base, &VarMap::new(), &ctx, DType::F32, &Device::Cpu).map(|_| ())
    });
    let e = e.into_iter().next().and_then(|r| r.err()).map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("model.layers.1.self_attn.q_proj.lora_A.weight"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
