//! The trainer's side of LoRA ([`super::TrainConfig::lora`], [`crate::lora`]): the adapters
//! added to a rank's `VarMap` beside the base weights, the model built with the base frozen,
//! and the adapters written into each checkpoint as a PEFT adapter.
//!
//! ```text
//! checkpoints/step-N/  model.safetensors, config.json   the base model (unchanged by training)
//!                      adapter_model.safetensors,        the adapters (PEFT: peft.PeftModel.
//!                      adapter_config.json               from_pretrained(base, this dir))
//!                      optimizer-tp*.safetensors, train_state.json   (the adapters' state)
//! ```

use crate::lora::{insert_adapter_shards, is_lora_name, load_adapter_sharded, save_peft_adapter};
use crate::params::{init_tensor, lock_vars, param_specs};
use crate::{LlamaConfig, ParallelCtx};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::collections::HashMap;
use std::path::Path;

/// Add this rank's shards of `cfg`'s adapters (`cfg.lora` set) to `varmap`: from the PEFT
/// adapter in `from` (a checkpoint being resumed; its rank and targets must be `cfg`'s), or
/// drawn from `seed` (`A` uniform in `±1/√in`, `B` zero).
pub(crate) fn add_adapters(varmap: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx, seed: u64, dtype: DType, device: &Device, from: Option<&Path>) -> Result<()> {
    let Some(spec) = &cfg.lora else { bail!("train: add_adapters without a LoRA spec (internal error)") };
    let Some(dir) = from else {
        return insert_adapter_shards(varmap, cfg, ctx, dtype, device, |s| init_tensor(s, seed, cfg));
    };
    let saved = load_adapter_sharded(dir, cfg, varmap, ctx, dtype, device)?.and_then(|c| c.lora);
    match saved {
        Some(s) if s == *spec => Ok(()),
        s => bail!("resume: {} holds LoRA adapters {s:?}, this run asks for {spec:?}", dir.display()),
    }
}

/// A builder of the model over `varmap` whose base weights are frozen: plain tensors (no
/// gradient is computed or kept for them), the adapters the `VarMap`'s variables.
pub(crate) fn frozen_builder(varmap: &VarMap, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    let tensors: HashMap<String, Tensor> =
        lock_vars(varmap)?.iter().map(|(n, v)| (n.clone(), if is_lora_name(n) { v.as_tensor().clone() } else { v.as_tensor().detach() })).collect();
    Ok(VarBuilder::from_tensors(tensors, dtype, device))
}

/// Gather the adapters over TP (collective over the world: every rank calls it) and, on the
/// ranks with `write`, write them into `dir` as a PEFT adapter on the model `base`.
pub(crate) fn save_adapters(dir: &Path, varmap: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx, write: bool, base: &str) -> Result<()> {
    let Some(spec) = &cfg.lora else { return Ok(()) };
    let local = crate::params::varmap_tensors(varmap)?;
    let mut full = HashMap::new();
    for s in param_specs(cfg).into_iter().filter(|s| s.is_lora()) {
        let Some(t) = local.get(&s.name) else { bail!("save: missing adapter {} {:?}", s.name, s.shape) };
        full.insert(s.name.clone(), s.gather(t, ctx)?.to_dtype(DType::F32)?);
    }
    if write {
        save_peft_adapter(dir, spec, &full, base)?;
    }
    Ok(())
}
