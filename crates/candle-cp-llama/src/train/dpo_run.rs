//! A DPO run's state beside the trainer ([`DpoRun`]): its settings, every answer's reference
//! log-probability and scored tokens, the held-out pairs', BCO's running mean; [`prepare`]
//! computes the reference before step 1 (or reads it back on resume: [`write_reference`],
//! [`read_reference`]).

use super::bco::{Delta, RunningMean};
use super::dpo::{policy_logps, answer_logps, Answers, DpoBatch, DpoConfig, DpoLoss, DpoTerms, KlLogps};
use super::ld_dpo::shaped_terms;
use super::preference::PreferenceSet;
use super::tr_dpo::RefModel;
use crate::{Llama, ParallelCtx};
use candle_core::{bail, Device, Result};

/// A DPO run's settings and its answers', and its held-out pairs' (with
/// [`super::TrainConfig::eval`]).
#[derive(Debug, Clone)]
pub(crate) struct DpoRun {
    pub cfg: DpoConfig,
    pub answers: Answers,
    /// The held-out pairs and their answers'.
    pub eval: Option<(PreferenceSet, Answers)>,
    /// BCO's running mean reward δ ([`super::bco`]; unused by the other losses): from a
    /// resumed checkpoint's [`super::TrainState::bco_mean`], else from 0.
    pub running: RunningMean,
    /// TR-DPO's reference weights ([`super::tr_dpo`]; `None` without
    /// [`DpoConfig::sync_ref_model`]).
    pub reference_weights: Option<RefModel>,
}

impl DpoRun {
    /// TR-DPO: after optimizer step `done` (from 1), when it is due, the reference's weights
    /// mixed with the policy's `policy` (whole on this rank: ZeRO's gathers done) and every
    /// answer's reference log-probability computed anew, the held-out pairs' too; returns
    /// whether it was due. Collective over the world.
    pub(crate) fn sync_reference(&mut self, done: usize, policy: &candle_nn::VarMap, cfg: &super::TrainConfig, ctx: &ParallelCtx, dev: &Device) -> Result<bool> {
        let (Some(sync), Some(r)) = (self.cfg.sync_ref_model, &self.reference_weights) else { return Ok(false) };
        if !done.is_multiple_of(sync.every) {
            return Ok(false);
        }
        let super::DataSource::Preference(set) = &cfg.data else { bail!("tr-dpo: the run's data are not preference pairs") };
        r.mix(policy, sync.alpha)?;
        let m = r.model(cfg.dtype, dev, ctx)?;
        self.answers.reference = answer_logps(&m, set, cfg.batch, cfg.seq_len, ctx, dev)?;
        if let Some((s, a)) = &mut self.eval {
            a.reference = answer_logps(&m, s, cfg.batch, cfg.seq_len, ctx, dev)?;
        }
        Ok(true)
    }

    /// KTO: the policy's log-probabilities of the KL documents of micro-batch `micro` of
    /// `step` ([`super::DataSource::kl_rows`]), a forward of their rows without a backward (as
    /// TRL scores them); `None` for the other losses. Collective over the world.
    pub(crate) fn kl_logps(&self, model: &Llama, cfg: &super::TrainConfig, step: usize, micro: usize, ctx: &ParallelCtx, dev: &Device) -> Result<Option<KlLogps>> {
        if self.cfg.loss != DpoLoss::Kto {
            return Ok(None);
        }
        let rows = cfg.data.kl_rows(cfg.seed, step, micro * cfg.batch, cfg.batch, cfg.seq_len)?;
        let b = DpoBatch::new(&rows, cfg.seq_len)?;
        let logps = b.forward_logps(model, ctx, dev)?;
        Ok(Some(KlLogps { answers: b.answers, logps }))
    }

    /// DPO's terms over every held-out pair under `model` as it is now (its log-probabilities
    /// of the answers by [`answer_logps`], against the held-out reference; BCO's against δ as it
    /// is, not updated); `None` without held-out pairs. Collective over the world.
    pub(crate) fn evaluate(&self, model: &Llama, batch: usize, seq_len: usize, ctx: &ParallelCtx, dev: &Device) -> Result<Option<DpoTerms>> {
        let Some((set, answers)) = &self.eval else { return Ok(None) };
        let p = policy_logps(model, set, batch, seq_len, &self.cfg, ctx, dev)?;
        let pairs: Vec<(usize, usize)> = (0..set.len()).map(|p| (2 * p, 2 * p + 1)).collect();
        let all: Vec<usize> = (0..2 * set.len()).collect();
        let weights = p.wpo.map(|m| super::wpo::pair_weights(&m, &pairs));
        Ok(Some(shaped_terms(&p.plain, p.ld.as_deref(), weights.as_deref(), answers, &all, &pairs, &self.cfg, Some(Delta::Hold(self.running.mean)))?.0))
    }
}

/// A run's DPO settings and reference log-probabilities (`None` without
/// [`super::TrainConfig::dpo`]): computed by `model` (or [`DpoConfig::reference_model`]) before
/// the first step (written to
/// `out/dpo_reference.json`, and the held-out pairs' to `out/dpo_reference_eval.json`, by the
/// main rank), read back from there by a resumed run. Errors: DPO without preference data
/// (training or held-out) or the reverse, a pair longer than a row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare(cfg: &super::TrainConfig, model: &Llama, (policy, mcfg): (&candle_nn::VarMap, &crate::LlamaConfig), ctx: &ParallelCtx, dev: &Device, resume_dir: Option<&std::path::Path>, is_main: bool) -> Result<Option<DpoRun>> {
    let resumed = resume_dir.is_some();
    let (dc, set) = match (&cfg.dpo, &cfg.data) {
        (None, super::DataSource::Preference(_)) if cfg.reward.is_some() => return Ok(None),
        (None, super::DataSource::Preference(_)) => bail!("train: preference pairs train by DPO (set dpo) or a reward model (set reward)"),
        (None, _) => return Ok(None),
        (Some(dc), super::DataSource::Preference(set)) => (dc, set),
        (Some(_), _) => bail!("train: dpo trains on preference pairs (DataSource::Preference)"),
    };
    dc.validate()?;
    let agree = |s: &PreferenceSet, what: &str| -> Result<()> {
        match (s.desirable().is_some(), dc.loss) {
            (true, l) if !l.unpaired() => bail!("train: the {what} are unpaired examples: train them by the kto, bco or apo_zero_unpaired loss, not {}", l.name()),
            (false, l) if l.unpaired() => bail!("train: the {} loss trains on unpaired examples (PreferenceSet::from_unpaired); the {what} are preference pairs", l.name()),
            (true, DpoLoss::Kto) if !s.has_kl_documents() => bail!("train: the kto loss needs the {what}'s KL documents (PreferenceSet::from_unpaired keeps them; not without_kl_documents)"),
            (true, l @ (DpoLoss::Bco | DpoLoss::ApoZeroUnpaired)) if s.has_kl_documents() => bail!("train: the {} loss has no KL term: drop the {what}'s KL documents (PreferenceSet::without_kl_documents), which would take room in every row and a reference pass", l.name()),
            _ => Ok(()),
        }
    };
    agree(set, "training data")?;
    let eval_set = match &cfg.eval {
        None => None,
        Some(e) => match &e.data {
            super::DataSource::Preference(s) => {
                agree(s, "held-out data")?;
                Some(s)
            }
            _ => bail!("train: a DPO run's held-out data must be preference pairs too"),
        },
    };
    // TR-DPO: the reference's weights kept beside the policy's (a resumed run's from its
    // checkpoint)
    let reference_weights = match dc.sync_ref_model {
        None => None,
        Some(_) if cfg.lora.is_some() => bail!("train: sync_ref_model (TR-DPO) mixes the reference with the policy's weights; a LoRA run's reference is the frozen base its adapters sit on (train the model whole)"),
        Some(_) => {
            let r = match (resume_dir, &dc.reference_model) {
                (Some(d), _) => RefModel::resumed(d, "TR-DPO", ctx, dev, cfg.dtype, cfg.sliding_window)?,
                (None, Some(dir)) => RefModel::load(dir, ctx, dev, cfg.dtype, cfg.sliding_window)?,
                (None, None) => RefModel::copy_of(policy, mcfg)?,
            };
            r.check_matches(policy)?;
            Some(r)
        }
    };
    // a reference model of its own, for the reference pass only (not on resume: the file)
    let reference_model = match (&dc.reference_model, resumed && cfg.out.is_some()) {
        _ if reference_weights.is_some() => None,
        (Some(dir), false) => {
            let (vm, mut rc) = crate::load_hf_sharded(dir, ctx, dev, cfg.dtype)?;
            if set.vocab_needed() > rc.vocab_size {
                bail!("dpo: the data uses {} token ids, the reference model {} has a vocabulary of {}", set.vocab_needed(), dir.display(), rc.vocab_size)
            }
            if cfg.sliding_window.is_some() {
                rc.sliding_window = cfg.sliding_window;
            }
            Some(Llama::new(candle_nn::VarBuilder::from_varmap(&vm, cfg.dtype, dev), &rc, ctx)?)
        }
        _ => None,
    };
    let reference = |set: &PreferenceSet, name: &str| -> Result<Vec<f64>> {
        let path = cfg.out.as_ref().map(|o| o.join(name));
        match (&path, resumed) {
            _ if dc.without_reference() => Ok(vec![0.0; 2 * set.len()]),
            // (TR-DPO: always from its reference as it is, the file being the first one's)
            _ if reference_weights.is_some() => {
                let m = reference_weights.as_ref().map(|r| r.model(cfg.dtype, dev, ctx)).transpose()?;
                answer_logps(m.as_ref().unwrap_or(model), set, cfg.batch, cfg.seq_len, ctx, dev)
            }
            (Some(p), true) => read_reference(p, set),
            _ => {
                let r = match &reference_model {
                    Some(m) => answer_logps(m, set, cfg.batch, cfg.seq_len, ctx, dev)?,
                    None => answer_logps(model, set, cfg.batch, cfg.seq_len, ctx, dev)?,
                };
                if let (Some(p), true) = (&path, is_main) {
                    if let Some(dir) = p.parent() {
                        std::fs::create_dir_all(dir).map_err(|e| candle_core::Error::Msg(format!("creating {}: {e}", dir.display())))?;
                    }
                    write_reference(p, set, &r)?;
                }
                Ok(r)
            }
        }
    };
    let answers = |set: &PreferenceSet, name: &str| -> Result<Answers> {
        set.check_fits(cfg.seq_len)?;
        Ok(Answers { reference: reference(set, name)?, lengths: set.scored_lengths(), desirable: set.desirable().map(<[bool]>::to_vec) })
    };
    let run = DpoRun {
        cfg: dc.clone(),
        answers: answers(set, "dpo_reference.json")?,
        eval: match eval_set {
            Some(s) => Some((s.clone(), answers(s, "dpo_reference_eval.json")?)),
            None => None,
        },
        running: RunningMean::default(),
        reference_weights,
    };
    Ok(Some(run))
}

/// The reference log-probabilities as the run's output directory keeps them (JSON: the pairs'
/// count and the answers' values), so that a resumed run compares with the same reference.
pub fn write_reference(path: &std::path::Path, set: &PreferenceSet, logps: &[f64]) -> Result<()> {
    let v = serde_json::json!({"pairs": set.len(), "tokens": set.token_count(), "logps": logps});
    std::fs::write(path, v.to_string()).map_err(|e| candle_core::Error::Msg(format!("writing {}: {e}", path.display())))
}

/// [`write_reference`]'s file read back; errors name the file, or say that it was written for
/// other data.
pub fn read_reference(path: &std::path::Path, set: &PreferenceSet) -> Result<Vec<f64>> {
    let text = std::fs::read_to_string(path).map_err(|e| candle_core::Error::Msg(format!("reading the DPO reference {}: {e} (a resumed DPO run reads the reference log-probabilities its first start wrote)", path.display())))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
    let (pairs, tokens) = (v["pairs"].as_u64(), v["tokens"].as_u64());
    if pairs != Some(set.len() as u64) || tokens != Some(set.token_count() as u64) {
        bail!(
            "{}: written for {pairs:?} pairs of {tokens:?} tokens, the data has {} pairs of {} tokens: resume with the data the run started with",
            path.display(),
            set.len(),
            set.token_count()
        )
    }
    let logps: Option<Vec<f64>> = v["logps"].as_array().and_then(|a| a.iter().map(|x| x.as_f64()).collect());
    match logps {
        Some(l) if l.len() == 2 * set.len() => Ok(l),
        _ => bail!("{}: `logps` must be {} numbers", path.display(), 2 * set.len()),
    }
}
