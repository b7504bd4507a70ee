//! Held-out evaluation during training ([`super::TrainConfig::eval`]): every `every` optimizer
//! steps (and after the last) the model's mean next-token loss over a fixed set of held-out
//! sequences, on the run's layout, without a backward.
//!
//! The held-out rows are drawn from [`EvalConfig::data`] with the run's seed salted
//! ([`EVAL_SALT`]): the same rows at every evaluation (so the curve compares steps), never the
//! training rows' streams. For a corpus, give the held-out part of it as `data` (finetune_llama
//! keeps the end of the file out of training: `--eval-fraction`); the synthetic recall task
//! draws fresh samples. A DPO run evaluates its held-out preference pairs: their DPO loss and
//! reward accuracy against their own reference log-probabilities ([`super::dpo`]).

use super::data::DataSource;
use super::batches::{batch_of, nll_terms};
use super::TrainConfig;
use crate::{shard_batch, shard_batch_packed, Llama, ParallelCtx};
use candle_core::{bail, Device, Result, Tensor};

/// Salt of the held-out rows' seed (`seed ^ EVAL_SALT`): their streams are not the training
/// rows'.
pub const EVAL_SALT: u64 = 0x6576_616c_5f68_6f6c;

/// What to evaluate and how often.
#[derive(Debug, Clone)]
pub struct EvalConfig {
    /// Where the held-out sequences come from (rows of [`super::TrainConfig::seq_len`] tokens).
    pub data: DataSource,
    /// Evaluate after every `every` optimizer steps (> 0) and after the last.
    pub every: usize,
    /// Batches of [`super::TrainConfig::batch`] rows each (> 0); the same at every evaluation.
    pub batches: usize,
}

impl EvalConfig {
    /// Whether step `done` (1-based) of `steps` evaluates.
    pub(crate) fn due(&self, done: usize, steps: usize) -> bool {
        done == steps || done.is_multiple_of(self.every)
    }

    /// The checks [`super::train_rank`] makes before the run starts.
    pub(crate) fn check(&self, vocab: usize) -> Result<()> {
        if self.every == 0 || self.batches == 0 {
            bail!("eval: every = {} and batches = {} must be > 0", self.every, self.batches)
        }
        if self.data.vocab_needed() > vocab {
            bail!("eval: the held-out data uses {} token ids, the model's vocabulary is {vocab}", self.data.vocab_needed())
        }
        Ok(())
    }
}

/// A run's held-out evaluation: (loss, long-range loss, DPO reward accuracy) — [`evaluate`]'s
/// losses, or a DPO run's held-out DPO loss and reward accuracy over all its held-out pairs
/// ([`super::dpo`]).
pub(crate) fn evaluate_run(
    model: &Llama,
    cfg: &TrainConfig,
    eval: &EvalConfig,
    dpo: Option<&super::dpo::DpoRun>,
    ctx: &ParallelCtx,
    dev: &Device,
) -> Result<(Option<f64>, Option<f64>, Option<f64>)> {
    match dpo {
        Some(d) => match d.evaluate(model, cfg.batch, cfg.seq_len, ctx, dev)? {
            Some(t) => Ok((Some(t.loss), None, Some(t.accuracy))),
            None => bail!("train: a DPO run's evaluation without held-out pairs"),
        },
        None => {
            let (all, lr) = evaluate(model, cfg, eval, ctx, dev)?;
            Ok((Some(all), lr, None))
        }
    }
}

/// Mean held-out loss over all targets and over the long-range ones (`None` when the data has
/// none), the same on every rank. Collective over the world (the forward's, and an all-gather
/// of the sums over the ranks holding distinct tokens, added in rank order as the training
/// losses are).
pub(crate) fn evaluate(model: &Llama, cfg: &TrainConfig, eval: &EvalConfig, ctx: &ParallelCtx, dev: &Device) -> Result<(f64, Option<f64>)> {
    let host = Device::Cpu;
    let mut terms = [0f64; 4];
    for k in 0..eval.batches {
        let (ids, mask, docs) = batch_of(&eval.data, cfg.seed ^ EVAL_SALT, cfg, 0, k, &host)?;
        let sb = match &docs {
            Some(d) => shard_batch_packed(&ids, d, ctx)?,
            None => shard_batch(&ids, ctx)?,
        };
        let mb = shard_batch(&mask, ctx)?;
        let (ids_d, labels_d, pos_d) = (sb.input_ids.to_device(dev)?, sb.labels.to_device(dev)?, sb.positions.to_device(dev)?);
        let nll = match &docs {
            Some(_) => model.token_nll_packed(&ids_d, &labels_d, &pos_d, &sb.documents)?,
            None => model.token_nll(&ids_d, &labels_d, &pos_d)?,
        };
        let values: Vec<f32> = nll.flatten_all()?.detach().to_device(&host)?.to_vec1()?;
        let (labels, lr_mask): (Vec<u32>, Vec<u32>) = (sb.labels.flatten_all()?.to_vec1()?, mb.labels.flatten_all()?.to_vec1()?);
        for (a, x) in terms.iter_mut().zip(nll_terms(&values, &labels, &lr_mask)) {
            *a += x;
        }
    }
    let group = ctx.token_group();
    let row = Tensor::new(&[terms.map(|x| x as f32)], &host)?;
    let rows = if group.size() > 1 { group.all_gather(&row, 0)? } else { row };
    let mut tot = [0f64; 4];
    for r in rows.to_vec2::<f32>()? {
        for (a, x) in tot.iter_mut().zip(r) {
            *a += x as f64;
        }
    }
    Ok((tot[0] / tot[1].max(1.0), (tot[3] > 0.0).then(|| tot[2] / tot[3])))
}
