//! Multimodal checkpoints whose text model the Llama reads (`llama_archs.rs`): the text model's
//! config under `text_config`, its tensors under `language_model.*` (transformers before 4.52)
//! or `model.language_model.*` (the head then top-level `lm_head.weight`), beside a vision tower
//! and a projector the model does not read.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::Layout;
use candle_cp_llama::{load_hf, load_hf_sharded, save_hf, shard_tensors, LlamaConfig, ParallelCtx};
use std::collections::HashMap;

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// The text model `(cfg, full)` written as a multimodal checkpoint of config `config` in both
/// layouts loads whole and sharded over TP 2 bit for bit as from its own checkpoint, as `cfg`;
/// saved, it is the causal LM `saved` (`architectures[0]`, `model_type`); a text-model tensor
/// it would not read is refused by its checkpoint name.
pub fn text_model_loads(cfg: &LlamaConfig, full: &HashMap<String, Tensor>, config: &serde_json::Value, saved: (&str, &str)) -> Result<()> {
    let class = config["architectures"][0].as_str().unwrap_or("multimodal").to_string();
    let root = std::env::temp_dir().join(format!("candle-cp-{class}-{}", std::process::id()));
    for (layout, towers) in [("old", "vision_tower.vision_model.embeddings.patch_embedding.weight"), ("new", "model.vision_tower.vision_model.embeddings.patch_embedding.weight")] {
        let text_prefix = |n: &str| if layout == "old" { format!("language_model.{n}") } else { n.replacen("model.", "model.language_model.", 1) };
        let dir = root.join(layout);
        std::fs::create_dir_all(&dir)?;
        let mut tensors: HashMap<String, Tensor> = full.iter().map(|(k, t)| (text_prefix(k), t.clone())).collect();
        tensors.insert(towers.to_string(), Tensor::ones((4, 4), DType::F32, &Device::Cpu)?);
        tensors.insert(towers.replace("vision_tower.vision_model.embeddings.patch_embedding", "multi_modal_projector.mm_input_projection"), Tensor::ones((2, 2), DType::F32, &Device::Cpu)?);
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
        std::fs::write(dir.join("config.json"), config.to_string())?;
        let (vm, back) = load_hf(&dir, &Device::Cpu, DType::F32)?;
        assert_eq!(&back, cfg, "{class} {layout}");
        let got = candle_cp_llama::params::varmap_tensors(&vm)?;
        assert_eq!(got.len(), full.len(), "{class} {layout}");
        for (k, t) in full {
            assert_eq!(max_abs(&got[k], t)?, 0.0, "{class} {layout}: {k}");
        }
        for r in run_ranks(2, |g| {
            let ctx = ParallelCtx::new(g, Layout::single().with_tp(2, true))?;
            let want = candle_cp_llama::params::varmap_tensors(&shard_tensors(full, cfg, &ctx)?)?;
            let got = candle_cp_llama::params::varmap_tensors(&load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32)?.0)?;
            let mut same = want.len() == got.len();
            for (k, w) in &want {
                same &= got.get(k).map(|g| max_abs(g, w).map(|e| e == 0.0)).transpose()? == Some(true);
            }
            Ok(same)
        }) {
            assert!(r?, "{class} {layout}: the sharded load differs");
        }
        // saved back: the text model as a causal LM
        let out = root.join(format!("{layout}-saved"));
        save_hf(&out, &vm, &back)?;
        let text = std::fs::read_to_string(out.join("config.json"))?;
        assert!(text.contains(saved.0) && text.contains(&format!("\"{}\"", saved.1)), "{text}");
        // a text-model tensor the model would not read: refused, by its checkpoint name
        let extra = text_prefix("model.layers.0.self_attn.o_proj.bias");
        tensors.insert(extra.clone(), Tensor::ones(cfg.hidden_size, DType::F32, &Device::Cpu)?);
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
        let e = load_hf(&dir, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(&extra) && e.contains("1 tensor(s)"), "{class} {layout}: {e}");
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
