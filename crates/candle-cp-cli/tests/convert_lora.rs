//! The `candle-cp convert-lora` binary: a Qwen3-MoE adapter on its expert parameters
//! (transformers 5's `target_parameters`, with the router and the attention) becomes an adapter
//! on per-expert modules — no `target_parameters`, every expert's `gate_proj` / `up_proj` /
//! `down_proj` by name, `target_modules` a regular expression since the dense layer 0's MLP is not
//! adapted — that `merge-lora` merges into the same checkpoint, tensor for tensor. Converting it
//! again, or a directory without an adapter, is refused (exit 2).

use candle_core::{DType, Device, Result};
use candle_cp_llama::lora::save_peft_adapter;
use candle_cp_llama::{LlamaConfig, LoraSpec, MoeConfig};

mod common;
use common::candle_cp;

fn s(p: &std::path::Path) -> &str {
    p.to_str().unwrap_or("")
}

#[test]
fn a_converted_adapter_merges_into_the_same_model() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("candle-cp-convert-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut moe = MoeConfig::new(4, 2, 16);
    moe.mlp_only_layers = vec![0];
    let base_cfg = LlamaConfig::tiny(64, 32, 2, 4, 2).with_moe(Some(moe));
    candle_cp_llama::save_hf(&dir, &candle_cp_llama::init_params(&base_cfg, 7, DType::F32, &Device::Cpu)?, &base_cfg)?;
    let spec = LoraSpec::new(2, 4.0, &["q_proj"])?.with_target_parameters(&["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "gate.weight"])?;
    let cfg = base_cfg.clone().with_lora(Some(spec.clone()));
    let mut adapters = std::collections::HashMap::new();
    for (i, s) in candle_cp_llama::param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        adapters.insert(s.name.clone(), candle_cp_ops::oracle::randn(470 + i as u64, &s.shape, 0.3)?);
    }
    save_peft_adapter(&dir, cfg.lora.as_ref().unwrap_or(&spec), &adapters, "tiny-moe")?;
    let v4 = dir.join("v4");
    let o = candle_cp(&["convert-lora", "--checkpoint", s(&dir), "--out", s(&v4), "--to", "per-expert"]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&o.stderr));
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(v4.join("adapter_config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert!(config.get("target_parameters").is_none(), "{config}");
    assert_eq!(config["base_model_name_or_path"], "tiny-moe");
    assert_eq!(config["target_modules"], r"model\.layers\.(?:0|1)\.self_attn\.q_proj|model\.layers\.1\.mlp\.gate|model\.layers\.1\.mlp\.experts\.\d+\.(?:down_proj|gate_proj|up_proj)", "{config}");
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(v4.join("adapter_model.safetensors"))? };
    assert!(st.get("base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight").is_ok(), "per-expert names in the converted file");
    // both merge into the same checkpoint
    let (m5, m4) = (dir.join("merged5"), dir.join("merged4"));
    for (ckpt, out) in [(&dir, &m5), (&v4, &m4)] {
        let o = candle_cp(&["merge-lora", "--checkpoint", s(ckpt), "--out", s(out), "--base", s(&dir)]);
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let (a, b) = (candle_core::safetensors::load(m5.join("model.safetensors"), &Device::Cpu)?, candle_core::safetensors::load(m4.join("model.safetensors"), &Device::Cpu)?);
    assert_eq!(a.len(), b.len());
    let base = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    let mut moved = 0;
    for (n, t) in &a {
        assert_eq!((t - &b[n])?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?, 0.0, "{n}");
        moved += usize::from((t - &base[n])?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? > 0.0);
    }
    // q_proj twice, the router, every expert's gate, up and down (4 experts)
    assert_eq!(moved, 2 + 1 + 3 * 4, "weights the adapter moves");
    // converted again, or no adapter: refused
    let o = candle_cp(&["convert-lora", "--checkpoint", s(&v4), "--out", s(&dir.join("again")), "--base", s(&dir)]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.code() == Some(2) && err.contains("per-expert layout already"), "{err}");
    let o = candle_cp(&["convert-lora", "--checkpoint", s(&m4), "--out", s(&dir.join("again"))]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.code() == Some(2) && err.contains("no adapter_config.json"), "{err}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
