//! The runs that train a score head instead of predicting tokens — reward models
//! ([`super::reward`], [`super::TrainConfig::reward`]) and process reward models
//! ([`super::prm`], [`super::TrainConfig::prm`]) —, as the trainer sees them: the model they
//! load, their checks, each micro-batch's loss and the held-out evaluation.

use super::{DataSource, TrainConfig};
use crate::{LlamaConfig, Llama, ParallelCtx, ShardedBatch};
use candle_core::{bail, Device, Result, Tensor};
use candle_cp_comm::Group;
use candle_nn::VarMap;
use std::path::Path;

/// A micro-batch's loss of a score head: the node to back-propagate and what it reports.
pub(crate) struct HeadLoss {
    /// This rank's share of the loss (its gradients summed over the ranks are the loss's).
    pub node: Tensor,
    /// The loss over the whole micro-batch.
    pub loss: f64,
    /// Pairs ordered right (a reward model), labelled tokens classified right (a PRM).
    pub accuracy: f64,
    /// A reward model's mean margin `r_chosen − r_rejected` (`None` for a PRM).
    pub margin: Option<f64>,
}

/// Whether the run trains a score head.
pub(crate) fn trains_head(cfg: &TrainConfig) -> bool {
    cfg.reward.is_some() || cfg.prm.is_some()
}

/// A run that starts from a causal LM `dir` and trains a score head: the weights with the head
/// drawn from the seed (the LM head not read) and the model's config; `None` for other runs.
pub(crate) fn load_new_head(cfg: &TrainConfig, dir: &Path, ctx: &ParallelCtx, dev: &Device) -> Result<Option<(VarMap, LlamaConfig)>> {
    match (&cfg.reward, &cfg.prm) {
        (Some(_), Some(_)) => bail!("train: reward and prm are two runs: set one"),
        (Some(_), None) => crate::reward::load_hf_sharded_reward(dir, 1, cfg.seed, ctx, dev, cfg.dtype).map(Some),
        (None, Some(p)) => crate::prm::load_hf_sharded_token_classifier(dir, p.num_labels, p.classifier()?, cfg.seed, ctx, dev, cfg.dtype).map(Some),
        (None, None) => Ok(None),
    }
}

/// A random init's config for the run: a causal LM given to a reward or PRM run gets its head.
pub(crate) fn init_config(cfg: &TrainConfig, c: &LlamaConfig) -> Result<LlamaConfig> {
    Ok(match (&cfg.reward, &cfg.prm, c.num_labels) {
        (Some(_), _, None) => c.clone().with_num_labels(Some(1)),
        (_, Some(p), None) => {
            let t = p.classifier()?.unwrap_or(crate::prm::TokenClassifier { dropout: crate::prm::TokenClassifier::HF_DROPOUT, bias: true });
            c.clone().with_num_labels(Some(p.num_labels)).with_token_classifier(Some(t))
        }
        _ => c.clone(),
    })
}

/// Whether the run's model changed its head from the causal LM in `dir` (a LoRA run then writes
/// its base once).
pub(crate) fn head_changed(cfg: &TrainConfig, dir: &Path) -> Result<bool> {
    Ok(trains_head(cfg) && LlamaConfig::from_file(dir.join("config.json"))?.num_labels.is_none())
}

/// The run's checks before its first step: a reward run's ([`super::reward::check_run`]), a
/// PRM run's (stepwise examples, a token classifier whose labels hold the data's, nothing
/// else trained), and a model with a score head trains by nothing else.
pub(crate) fn check_run(cfg: &TrainConfig, mcfg: &LlamaConfig) -> Result<()> {
    let Some(p) = &cfg.prm else {
        return super::reward::check_run(cfg, mcfg);
    };
    p.classifier()?;
    if cfg.reward.is_some() || cfg.dpo.is_some() || cfg.grpo.is_some() {
        bail!("train: a process reward model trains by its own loss: not with reward, dpo or grpo")
    }
    let DataSource::Steps(set) = &cfg.data else { bail!("train: a process reward model trains on stepwise examples (DataSource::Steps)") };
    if let Some(e) = &cfg.eval {
        if !matches!(&e.data, DataSource::Steps(_)) {
            bail!("train: a process reward model's held-out data must be stepwise examples")
        }
    }
    match (mcfg.num_labels, mcfg.token_classifier) {
        (Some(n), Some(_)) if n >= set.classes_needed() => Ok(()),
        (Some(n), Some(_)) => bail!("train: the data labels {} classes, the token classifier has {n}", set.classes_needed()),
        _ => bail!("train: a process reward model is a token classifier: {} is not", mcfg.hf_class()),
    }
}

/// Micro-batch `micro` of step `step`'s loss for a run that trains a score head (`None` for
/// other runs): `sb` the rows' shard, `ids` and `pos` its ids and positions on the device.
/// Collective over the world.
pub(crate) fn micro_loss(model: &Llama, cfg: &TrainConfig, (step, micro): (usize, usize), (sb, ids, pos): (&ShardedBatch, &Tensor, &Tensor), ctx: &ParallelCtx, group: &Group) -> Result<Option<HeadLoss>> {
    if !trains_head(cfg) {
        return Ok(None);
    }
    let first = micro * cfg.batch;
    if let Some(r) = &cfg.reward {
        // (a reward model: its scores of the rows' answers and their pairs' loss)
        let rows = cfg.data.preference_rows(cfg.seed, step, first, cfg.batch, cfg.seq_len)?;
        let scores = model.scores_packed(ids, pos, &sb.documents)?;
        let margins = match &cfg.data {
            DataSource::Preference(s) => s.margins(),
            _ => None,
        };
        let (node, t) = super::reward::RewardBatch::new(&rows, cfg.seq_len)?.loss(&scores, margins, r, ctx, group)?;
        return Ok(Some(HeadLoss { node, loss: t.loss, accuracy: t.accuracy, margin: Some(t.margin) }));
    }
    // (a PRM: every token's logits, dropout keyed on the micro-batch's number)
    let rows = cfg.data.step_rows(cfg.seed, step, first, cfg.batch, cfg.seq_len)?;
    let drop = crate::prm::ClassifierDropout { streams: candle_cp_nn::RngStreams::new(cfg.seed), step: (step * cfg.grad_accum + micro) as u64, batch: cfg.batch, seq_len: cfg.seq_len };
    let scores = model.token_scores_packed(ids, pos, &sb.documents, Some(drop))?;
    let (node, t) = super::prm::rows_loss(&rows, &scores, ctx, group)?;
    Ok(Some(HeadLoss { node, loss: t.loss, accuracy: t.accuracy, margin: None }))
}

/// A score-head run's held-out loss and accuracy (`None` for other runs). Collective over the
/// world.
pub(crate) fn evaluate(model: &Llama, cfg: &TrainConfig, eval: &super::EvalConfig, ctx: &ParallelCtx, dev: &Device) -> Result<Option<(f64, f64)>> {
    match (&cfg.prm, &eval.data) {
        (Some(_), DataSource::Steps(set)) => {
            let t = super::prm::evaluate_steps(model, set, cfg.batch, cfg.seq_len, ctx, dev)?;
            Ok(Some((t.loss, t.accuracy)))
        }
        (Some(_), _) => bail!("train: a process reward model evaluates on held-out stepwise examples"),
        (None, _) if cfg.reward.is_some() => {
            let t = super::reward::evaluate_run(model, cfg, eval, ctx, dev)?;
            Ok(Some((t.loss, t.accuracy)))
        }
        _ => Ok(None),
    }
}
