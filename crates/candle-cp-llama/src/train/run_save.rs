//! A run's checkpoints as the trainer writes them ([`RunSaver::save`]): begun in a temporary
//! directory, the weights (a LoRA run: its adapters, as a PEFT adapter naming the frozen base)
//! gathered over TP one parameter at a time and streamed to disk by the main rank, the model
//! files the run started from carried over, TR-DPO's reference and GRPO's kept completions, the
//! optimizer's state (one file per TP rank) and the run's state, then published atomically.

use super::checkpoint::{begin_checkpoint, commit_checkpoint, TrainState};
use super::optim::AdamW;
use super::trainer::ioe;
use super::TrainConfig;
use crate::{save_hf_sharded, LlamaConfig, ParallelCtx};
use candle_core::Result;
use candle_cp_comm::Group;
use candle_nn::VarMap;
use std::path::{Path, PathBuf};

/// The optimizer-state file of TP rank `tp_i` in checkpoint `dir`.
pub(super) fn optimizer_file(dir: &Path, tp_i: usize) -> PathBuf {
    dir.join(format!("optimizer-tp{tp_i}.safetensors"))
}

/// What a rank needs to write the run's checkpoints.
pub(super) struct RunSaver<'a> {
    /// The run.
    pub cfg: &'a TrainConfig,
    /// `<out>/checkpoints` (`None`: the run writes none).
    pub root: Option<&'a Path>,
    /// Every rank of the run.
    pub world: &'a Group,
    /// This rank's layout.
    pub ctx: &'a ParallelCtx,
    /// This rank's weights.
    pub varmap: &'a VarMap,
    /// The model's config.
    pub mcfg: &'a LlamaConfig,
    /// A LoRA run's frozen base (its checkpoints are adapters naming it).
    pub lora_base: Option<&'a super::lora::BaseModel>,
    /// The model directory whose tokenizer and generation files each checkpoint carries.
    pub carry_from: Option<&'a Path>,
    /// Whether this is world rank 0, which writes the files.
    pub is_main: bool,
}

impl RunSaver<'_> {
    /// Write step `step`'s checkpoint (nothing without a root): the optimizer `opt`, the
    /// tokens seen and seconds elapsed so far, BCO's running mean, TR-DPO's reference and
    /// GRPO's run where the run has them. Collective over the world.
    pub(super) fn save(&self, step: usize, opt: &AdamW, tokens_seen: u64, elapsed: f64, (bco_mean, reference, grpo): (Option<super::bco::RunningMean>, Option<&super::tr_dpo::RefModel>, Option<&super::grpo_run::GrpoRun>)) -> Result<()> {
        let (cfg, world, ctx, is_main) = (self.cfg, self.world, self.ctx, self.is_main);
        let Some(root) = self.root else {
            return Ok(());
        };
        if is_main {
            begin_checkpoint(root, step).map_err(|e| ioe("creating checkpoint in", root, e))?;
        }
        world.barrier()?;
        let tmp = root.join(format!(".tmp-{}", super::checkpoint::checkpoint_name(step)));
        // gathered one parameter at a time and streamed into the file by the main rank
        // (a LoRA run: only the adapters, as a PEFT adapter naming the base model)
        match self.lora_base {
            Some(base) => {
                base.write_once(self.varmap, self.mcfg, ctx, world, is_main)?;
                super::lora::save_adapters(&tmp, self.varmap, self.mcfg, ctx, is_main, &base.path.display().to_string())?;
            }
            None => {
                save_hf_sharded(&tmp, &crate::params::varmap_tensors(self.varmap)?, self.mcfg, ctx, is_main)?;
                // the tokenizer, generation defaults and special token ids of the model the run
                // started from (or of the checkpoint it resumed, which carried them)
                if let (Some(from), true) = (self.carry_from, is_main) {
                    crate::hf_files::carry_model_files(from, &tmp)?;
                }
                // (the tokenizer the data was tokenised with, where the model gave none)
                if let (Some(tk), true) = (&cfg.tokenizer, is_main) {
                    crate::hf_files::write_tokenizer(tk, &tmp)?;
                }
            }
        }
        // (TR-DPO: the reference as it is, for a resumed run to go on with)
        if let Some(r) = reference {
            r.save(&tmp.join("reference"), ctx, is_main)?;
        }
        // (GRPO: the completions the next steps still train on)
        if let Some(g) = grpo {
            g.save(&tmp, step, is_main)?;
        }
        // (DP and CP replicas hold the same state: the replica with dp = cp = 0 writes it)
        let (dp_i, cp_i, tp_i) = ctx.coords;
        opt.save_from(optimizer_file(&tmp, tp_i), dp_i == 0 && cp_i == 0)?;
        world.barrier()?;
        if is_main {
            let st = TrainState {
                step,
                seed: cfg.seed,
                micro_batches_done: step * cfg.grad_accum,
                tokens_seen,
                elapsed_s: elapsed,
                world_size: world.size(),
                layout: cfg.layout.to_string(),
                args: cfg.args.clone(),
                bco_mean,
            };
            st.save(tmp.join("train_state.json")).map_err(|e| ioe("writing", &tmp, e))?;
            commit_checkpoint(root, step, cfg.keep).map_err(|e| ioe("publishing checkpoint in", root, e))?;
        }
        world.barrier()
    }
}
