//! `candle-cp merge-lora`: a LoRA run's checkpoint (a PEFT adapter naming its base model, or
//! with the base beside it) as one Hugging Face model, `W + s·B·A` in every adapted weight, for a serving stack that
//! loads no adapter.

use candle_core::{DType, Device};
use candle_cp_llama::lora::{base_model_dir, has_adapter, load_peft_adapter, merge_adapter};
use std::path::PathBuf;

/// Flags of `candle-cp merge-lora`.
#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// The checkpoint: a directory with adapter_model.safetensors and adapter_config.json
    /// (finetune_llama --lora writes them), the base model (config.json, model.safetensors)
    /// beside them or where adapter_config.json's base_model_name_or_path says.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Where to write the merged model (model.safetensors, config.json).
    #[arg(long)]
    pub out: PathBuf,
    /// The base model directory (config.json, model.safetensors), when it is not the one the
    /// adapter names (e.g. an adapter downloaded apart from its base).
    #[arg(long)]
    pub base: Option<PathBuf>,
}

/// Load, merge, write; prints what it merged.
pub fn run(a: MergeArgs) -> crate::Outcome {
    if !has_adapter(&a.checkpoint) {
        anyhow::bail!("{}: no adapter_config.json (not a LoRA checkpoint)", a.checkpoint.display())
    }
    // the base model: beside the adapter, or where the adapter config says (a LoRA run's
    // checkpoints name their base); merged in f32, written in its dtype (its first tensor's)
    let base = match &a.base {
        Some(b) => b.clone(),
        None => base_model_dir(&a.checkpoint)?,
    };
    let file = base.join("model.safetensors");
    let dtype = if file.exists() {
        // SAFETY: mapped read-only for this block; checkpoints are not rewritten in place
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&file)? };
        match st.tensors().first() {
            Some((name, _)) => st.load(name, &Device::Cpu)?.dtype(),
            None => DType::F32,
        }
    } else {
        DType::F32
    };
    let (vm, cfg) = candle_cp_llama::load_hf(&base, &Device::Cpu, DType::F32)?;
    let mut weights = candle_cp_llama::params::varmap_tensors(&vm)?;
    let (spec, adapters) = load_peft_adapter(&a.checkpoint)?;
    // (experts held as parameters — gpt-oss's, or named by target_parameters —: PEFT's wrappers
    // as the model's factors)
    let acfg = cfg.clone().with_lora(Some(candle_cp_llama::expert_params::transformers_5_spec(&cfg, spec, adapters.keys())));
    let Some(spec) = acfg.lora.clone() else { anyhow::bail!("merge-lora: no LoRA spec (internal error)") };
    let adapters = candle_cp_llama::lora::model_adapters(&acfg, adapters)?;
    let n = merge_adapter(&mut weights, &spec, &adapters)?;
    let mut named: Vec<(String, candle_core::Tensor)> = Vec::new();
    for s in candle_cp_llama::param_specs(&cfg) {
        let Some(t) = weights.remove(&s.name) else { anyhow::bail!("merge-lora: the checkpoint has no {}", s.name) };
        let t = t.to_dtype(dtype)?;
        // a sparse layer's stacked experts written per expert, as checkpoints hold them (gpt-oss:
        // by the model's names, fused and interleaved by save_hf_tensors)
        let parts = if candle_cp_llama::hf::converts_checkpoint(&cfg) { vec![(s.name.clone(), None)] } else { candle_cp_llama::params::checkpoint_tensors(&s) };
        for (name, expert) in parts {
            named.push((name, match expert {
                Some(e) => t.get(e)?,
                None => t.clone(),
            }));
        }
    }
    candle_cp_llama::save_hf_tensors(&a.out, &named, &cfg)?;
    // the base's tokenizer, generation defaults and special token ids beside the weights
    let carried = candle_cp_llama::hf_files::carry_model_files(&base, &a.out)?;
    println!("merged {n} weights (LoRA {spec}) into {}", a.out.display());
    if !carried.is_empty() {
        println!("carried from {}: {}", base.display(), carried.join(", "));
    }
    Ok(true)
}
