//! The trainer's side of LoRA ([`super::TrainConfig::lora`], [`crate::lora`]): the adapters
//! added to a rank's `VarMap` beside the base weights, the model built with the base frozen,
//! and the adapters written into each checkpoint as a PEFT adapter.
//!
//! The frozen base is not written into every checkpoint (an 8B base is 16 GB in bf16, its
//! adapters tens of MB): the checkpoints name it in `adapter_config.json`, as PEFT does. It is
//! the Hugging Face model the run started from, or, when the run drew its weights or changed
//! the model's config (the sliding window), `<out>/base`, written once before the first
//! checkpoint ([`BaseModel`]); a resumed run keeps its checkpoint's base.
//!
//! ```text
//! <out>/base/                  model.safetensors, config.json   (only when there is no model
//!                              directory to name: drawn weights, a changed config)
//! <out>/checkpoints/step-N/    adapter_model.safetensors,  the adapters (PEFT: peft.PeftModel.
//!                              adapter_config.json         from_pretrained(base, this dir))
//!                              optimizer-tp*.safetensors, train_state.json   (their state)
//! ```

use crate::lora::insert_adapter_shards;
use crate::params::{init_tensor, lock_vars, param_specs};
use crate::{LlamaConfig, ParallelCtx};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_comm::Group;
use candle_nn::{VarBuilder, VarMap};
use std::cell::Cell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Add this rank's shards of `cfg`'s adapters (`cfg.lora` set) to `varmap`: from the PEFT
/// adapter in `from` (a checkpoint being resumed, or [`super::TrainConfig::lora_init`]; its
/// rank, alpha, scaling and targets must be `cfg`'s — its dropout, a training setting, may
/// differ), or drawn from `seed` (`A` uniform in `±1/√in`, `B` zero).
pub(crate) fn add_adapters(varmap: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx, seed: u64, dtype: DType, device: &Device, from: Option<&Path>) -> Result<()> {
    let Some(spec) = &cfg.lora else { bail!("train: add_adapters without a LoRA spec (internal error)") };
    let Some(dir) = from else {
        return insert_adapter_shards(varmap, cfg, ctx, dtype, device, |s| init_tensor(s, seed, cfg));
    };
    // (read once; the spec checked before the tensors: another rank or targets gives other names)
    if !crate::lora::has_adapter(dir) {
        bail!("{} holds no LoRA adapter (adapter_config.json), this run asks for {spec}", dir.display())
    }
    let (saved, tensors) = crate::lora::load_peft_adapter(dir)?;
    // (a Phi-3's file names its fused modules, as the run's spec does: LoraSpec::with_fused;
    // gpt-oss's experts are parameters: LoraSpec::with_expert_params)
    if saved.clone().with_dropout(spec.dropout)?.with_fused(spec.fused).with_expert_params(spec.expert_params).with_interleaved_rope(spec.interleaved_rope) != *spec {
        bail!("{} holds LoRA adapters of {saved}, this run asks for {spec}", dir.display())
    }
    crate::lora::insert_loaded_adapter(dir, cfg, &tensors, varmap, ctx, dtype, device)
}

/// DoRA's magnitudes of drawn adapters (`cfg.lora` DoRA): each adapted weight's rows' norms
/// `‖W‖` (PEFT's init, `B` being zero), of the weights the model computes with — this rank's
/// base shards in `varmap`, dequantized from `quant` as the quantized base holds them — the
/// norms of a column-split weight's rows summed over TP (collective over the TP group).
pub(crate) fn set_dora_magnitudes(varmap: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx, quant: Option<candle_cp_nn::QuantConfig>) -> Result<()> {
    if !cfg.lora.as_ref().is_some_and(|l| l.dora) {
        return Ok(());
    }
    let tp = candle_cp_nn::Tp::new(ctx.tp.clone(), false);
    let specs = param_specs(cfg);
    for s in specs.iter().filter(|s| s.name.ends_with(crate::lora::MAGNITUDE)) {
        let stem = &s.name[..s.name.len() - crate::lora::MAGNITUDE.len()];
        let (w, var) = {
            let vars = lock_vars(varmap)?;
            let Some(w) = vars.get(&format!("{stem}.weight")).or_else(|| vars.get(stem)) else { bail!("DoRA: no weight for {}", s.name) };
            let Some(var) = vars.get(&s.name) else { bail!("DoRA: no {} in the VarMap", s.name) };
            (w.as_tensor().detach(), var.clone())
        };
        let w = match quant {
            Some(q) if crate::quant::is_quantized_weight(&format!("{stem}.weight")) || crate::quant::is_quantized_weight(stem) => crate::quant::as_dequantized(&w, q)?,
            _ => w,
        };
        // a replicated magnitude beside a column-split weight (a row-parallel projection): its
        // rows' norms summed over TP; a weight held whole on every rank (a mixture's router) or
        // split by rows: its local rows' norms
        let whole = specs.iter().find(|w| w.name == format!("{stem}.weight") || w.name == stem).is_some_and(|w| w.shard == candle_cp_nn::Shard::Replicated);
        let split = if s.shard == candle_cp_nn::Shard::Replicated && !whole { candle_cp_nn::WeightSplit::Cols } else { candle_cp_nn::WeightSplit::Rows };
        var.set(&candle_cp_nn::dora_magnitude(&w, split, &tp)?.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

/// A builder of the model over `varmap` whose base weights are frozen: plain tensors (no
/// gradient is computed or kept for them), the adapters the `VarMap`'s variables.
pub(crate) fn frozen_builder(varmap: &VarMap, cfg: &LlamaConfig, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    let trains = |n: &str| cfg.lora.as_ref().is_some_and(|l| l.trains(n));
    let tensors: HashMap<String, Tensor> =
        lock_vars(varmap)?.iter().map(|(n, v)| (n.clone(), if trains(n) { v.as_tensor().clone() } else { v.as_tensor().detach() })).collect();
    Ok(VarBuilder::from_tensors(tensors, dtype, device))
}

/// The model of a LoRA run over `varmap` (its base weights and adapters) with the base frozen:
/// plain tensors, or quantized by `quant` ([`crate::quant::QuantBase`]; the base first written
/// to `base` when the checkpoints need it there, as its dense shards are dropped, or as modules
/// trained whole will move). Returns the
/// model and the bytes of frozen weights this rank holds. Collective over `world` when the base
/// is written.
#[allow(clippy::too_many_arguments)]
pub(crate) fn frozen_model(
    varmap: &VarMap,
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
    quant: Option<candle_cp_nn::QuantConfig>,
    dtype: DType,
    device: &Device,
    base: Option<&BaseModel>,
    world: &Group,
) -> Result<(crate::Llama, usize)> {
    // the base written before training when training changes what it would hold: quantization
    // drops its dense shards, modules trained whole (modules_to_save) move
    let saves = cfg.lora.as_ref().is_some_and(|l| !l.modules_to_save.is_empty());
    if let Some(b) = base.filter(|_| quant.is_some() || saves) {
        b.write_once(varmap, cfg, ctx, world, world.rank() == 0)?;
    }
    match quant {
        Some(q) => {
            let qb = crate::quant::QuantBase::from_varmap(varmap, cfg, q)?;
            let (codes, plain) = qb.frozen_bytes();
            Ok((crate::Llama::new_quantized(&qb, dtype, device, cfg, ctx)?, codes + plain))
        }
        None => {
            let trains = |n: &str| cfg.lora.as_ref().is_some_and(|l| l.trains(n));
            let frozen = lock_vars(varmap)?.iter().filter(|(n, _)| !trains(n)).map(|(_, v)| v.as_tensor().elem_count() * v.as_tensor().dtype().size_in_bytes()).sum();
            Ok((crate::Llama::new(frozen_builder(varmap, cfg, dtype, device)?, cfg, ctx)?, frozen))
        }
    }
}

/// Gather the adapters over TP (collective over the world: every rank calls it) and, on the
/// ranks with `write`, write them into `dir` as a PEFT adapter on the model `base`.
pub(crate) fn save_adapters(dir: &Path, varmap: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx, write: bool, base: &str) -> Result<()> {
    let Some(spec) = &cfg.lora else { return Ok(()) };
    let local = crate::params::varmap_tensors(varmap)?;
    let mut full = HashMap::new();
    for s in param_specs(cfg).into_iter().filter(|s| spec.trains(&s.name)) {
        let Some(t) = local.get(&s.name) else { bail!("save: missing adapter {} {:?}", s.name, s.shape) };
        full.insert(s.name.clone(), s.gather(t, ctx)?.to_dtype(DType::F32)?);
    }
    if write {
        // (a token classifier's adapters, its head with or without a bias: PEFT's TOKEN_CLS)
        let task = cfg.token_classifier.map(|_| "TOKEN_CLS");
        crate::lora::save_peft_adapter_as(dir, spec, &full, base, task)?;
    }
    Ok(())
}

/// Where a LoRA run's checkpoints find their frozen base model (each adapter config names
/// it), and whether the run still has to write it there.
pub(crate) struct BaseModel {
    /// The base model's directory (absolute: `base_model_name_or_path`).
    pub(crate) path: PathBuf,
    /// Written by [`BaseModel::write_once`] before the first checkpoint.
    pending: Cell<bool>,
    /// The model directory the base weights came from, whose tokenizer and generation files
    /// a written base carries ([`crate::hf_files::carry_model_files`]).
    source: Option<PathBuf>,
    /// A `tokenizer.json` a written base holds where its source gave none
    /// ([`crate::train::TrainConfig::tokenizer`]).
    tokenizer: Option<PathBuf>,
}

impl BaseModel {
    /// The base of a run writing into `out`: `source` (the model directory the base weights
    /// were read from: a Hugging Face model, a resumed checkpoint's base) when there is one and
    /// the run kept its config (`config_changed` false), else `<out>/base`, to be written.
    pub(crate) fn new(out: &Path, source: Option<&Path>, config_changed: bool) -> Result<Self> {
        let abs = |p: &Path| std::path::absolute(p).map_err(|e| candle_core::Error::Msg(format!("LoRA base: {}: {e}", p.display())));
        let source_dir = source.map(Path::to_path_buf);
        match source {
            Some(src) if !config_changed => Ok(Self { path: abs(src)?, pending: Cell::new(false), source: source_dir, tokenizer: None }),
            _ => Ok(Self { path: abs(&out.join("base"))?, pending: Cell::new(true), source: source_dir, tokenizer: None }),
        }
    }

    /// The same base, writing `tokenizer` (a `tokenizer.json`) beside its weights when it
    /// writes them and its source gave none.
    pub(crate) fn with_tokenizer(self, tokenizer: Option<PathBuf>) -> Self {
        Self { tokenizer, ..self }
    }

    /// Write the frozen base (the varmap's weights other than the adapters, as `cfg` without
    /// LoRA) into [`BaseModel::path`] unless it is there already: into a temporary directory,
    /// then renamed (replacing an older base of the same run directory). Collective over
    /// `world` (the parameters are gathered over TP); the rank with `write` writes.
    pub(crate) fn write_once(&self, varmap: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx, world: &Group, write: bool) -> Result<()> {
        if !self.pending.get() {
            return Ok(());
        }
        let io = |what: &str, p: &Path, e: std::io::Error| candle_core::Error::Msg(format!("LoRA base: {what} {}: {e}", p.display()));
        let tmp = self.path.with_file_name(".tmp-base");
        if write {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(|e| io("removing", &tmp, e))?;
            }
            std::fs::create_dir_all(&tmp).map_err(|e| io("creating", &tmp, e))?;
        }
        world.barrier()?;
        let base_cfg = LlamaConfig { lora: None, ..cfg.clone() };
        crate::save_hf_sharded(&tmp, &crate::params::varmap_tensors(varmap)?, &base_cfg, ctx, write)?;
        if write {
            if let Some(src) = &self.source {
                crate::hf_files::carry_model_files(src, &tmp)?;
            }
            if let Some(tk) = &self.tokenizer {
                crate::hf_files::write_tokenizer(tk, &tmp)?;
            }
            if self.path.exists() {
                std::fs::remove_dir_all(&self.path).map_err(|e| io("replacing", &self.path, e))?;
            }
            std::fs::rename(&tmp, &self.path).map_err(|e| io("publishing", &self.path, e))?;
        }
        self.pending.set(false);
        Ok(())
    }
}
