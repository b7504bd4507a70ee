//! `candle-cp convert-lora`: a PEFT adapter on a mixture's experts held as parameters
//! (transformers 5, `target_parameters`) rewritten as the same adapter on transformers 4's
//! per-expert modules (`….experts.{e}.gate_proj`, a Mixtral's `w1`), for a serving stack that
//! reads only those ([`candle_cp_llama::lora_convert`]).

use candle_cp_llama::lora::{has_adapter, load_peft_adapter, model_adapters, save_peft_adapter};
use candle_cp_llama::lora_convert::per_expert_adapter;
use candle_cp_llama::LlamaConfig;
use std::path::PathBuf;

/// The layouts `convert-lora` writes.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Target {
    /// transformers 4's per-expert modules (PEFT `target_modules`, no `target_parameters`).
    PerExpert,
}

/// Flags of `candle-cp convert-lora`.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// The adapter directory (adapter_model.safetensors, adapter_config.json).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Where to write the converted adapter.
    #[arg(long)]
    pub out: PathBuf,
    /// The layout to write.
    #[arg(long, value_enum, default_value = "per-expert")]
    pub to: Target,
    /// A directory with the base model's config.json, when it is neither beside the adapter nor
    /// where adapter_config.json's base_model_name_or_path says (only the config is read).
    #[arg(long)]
    pub base: Option<PathBuf>,
}

/// Read, convert, write; prints the converted spec.
pub fn run(a: ConvertArgs) -> crate::Outcome {
    if !has_adapter(&a.checkpoint) {
        anyhow::bail!("{}: no adapter_config.json (not a PEFT adapter)", a.checkpoint.display())
    }
    let base = match &a.base {
        Some(b) => b.clone(),
        None => candle_cp_llama::lora::base_model_dir(&a.checkpoint)?,
    };
    let cfg = LlamaConfig::from_file(base.join("config.json"))?;
    let (spec, tensors) = load_peft_adapter(&a.checkpoint)?;
    let acfg = cfg.clone().with_lora(Some(candle_cp_llama::expert_params::transformers_5_spec(&cfg, spec, tensors.keys())));
    acfg.validate()?;
    let adapters = model_adapters(&acfg, tensors)?;
    let (spec, adapters) = match a.to {
        Target::PerExpert => per_expert_adapter(&acfg, &adapters)?,
    };
    // (the same base model named)
    let json = candle_cp_llama::lora::read_adapter_config(&a.checkpoint)?;
    let name = json.get("base_model_name_or_path").and_then(|b| b.as_str()).unwrap_or_default();
    save_peft_adapter(&a.out, &spec, &adapters, name)?;
    println!("wrote the adapter on per-expert modules (LoRA {spec}) into {}", a.out.display());
    Ok(true)
}
