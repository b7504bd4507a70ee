//! BCO (Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment")
//! on every layout, and TRL's `bco_pair` DPO loss: each answer's reward `β·r`, `r = log π(y|x)
//! − log π_ref(y|x)`, classified against δ, a running mean of the rewards:
//!
//! ```text
//! x̄   = mean over the micro-batch's answers (every DP rank's) of β·r
//! δ   ← δ + (x̄ − δ)/(n + 1),  n ← n + 1        (before the loss: δ includes this micro-batch)
//! BCO (unpaired):  desirable softplus(−(β·r − δ)), undesirable softplus(β·r − δ);
//!                  loss = mean over the examples
//! bco_pair:        softplus(−(β·a − δ)) + softplus(β·b − δ); loss = mean over the pairs
//! ```
//!
//! as TRL's `BCOTrainer` (without its underlying-distribution matching, which needs an
//! embedding model) and `DPOTrainer(loss_type="bco_pair")`: δ is TRL's `RunningMoments` mean
//! ([`RunningMean`], from 0 with a count of 1e-24), updated once per micro-batch by the
//! micro-batch's mean reward (δ is detached). TRL on `P` processes adds each process's mean
//! with a count of `P`; over equal per-process batches the running mean is the same as here,
//! where the micro-batch's mean is over every DP rank's rows at once (DP = one device).
//!
//! δ is the run's state: the trainer carries it in its `DpoRun`, writes it into each
//! checkpoint's `train_state.json` ([`super::TrainState::bco_mean`]) and a resumed run reads
//! it back. Held-out evaluation scores against δ as it is, without updating it (as TRL's
//! BCO evaluation; its DPO `bco_pair` updates δ in evaluation too).

use super::dpo::{DpoConfig, DpoLoss, DpoTerms};
use super::dpo_loss::{sigmoid, softplus};
use candle_core::{bail, Result};
use serde::{Deserialize, Serialize};

/// TRL's `RunningMoments` mean: δ and the count of values it averages.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RunningMean {
    /// δ, the running mean reward.
    pub mean: f64,
    /// How many micro-batch means δ averages (starts at 1e-24, as TRL's).
    pub count: f64,
}

impl Default for RunningMean {
    fn default() -> Self {
        Self { mean: 0.0, count: 1e-24 }
    }
}

impl RunningMean {
    /// Adds one value (a micro-batch's mean reward) with a count of 1.
    pub fn update(&mut self, x: f64) {
        let total = self.count + 1.0;
        self.mean += (x - self.mean) / total;
        self.count = total;
    }
}

/// How the loss treats δ: update it by this micro-batch's mean reward first (training), or
/// hold it (held-out evaluation).
#[derive(Debug)]
pub enum Delta<'a> {
    /// Training: δ updated by the micro-batch's mean reward, then used.
    Update(&'a mut RunningMean),
    /// Evaluation: δ as given.
    Hold(f64),
}

/// BCO over `pairs` (indices into `policy` and `reference`, the answers' summed
/// log-probabilities): [`DpoLoss::BcoPair`] over (chosen, rejected) pairs (`labels` `None`), or
/// [`DpoLoss::Bco`] over unpaired examples (the first index of each, `labels[i]` whether
/// example `i` is desirable; the second index is unused). `lengths`: the answers' scored tokens
/// (RPO's term with `bco_pair`, [`DpoConfig::rpo_alpha`]).
///
/// [`DpoTerms`] here: `loss`; `accuracy` BCO's fraction of examples on their label's side of δ
/// (bco_pair: of pairs with the chosen reward above the rejected one, as DPO's); `margin` BCO's
/// mean of `±(β·r − δ)` (+ desirable, − undesirable; bco_pair: the mean `β·(a − b)`); `delta` δ
/// as used; `d_logp` the derivatives in the answers' log-probabilities (δ detached). Errors for
/// another loss, labels that do not match the loss, or an index out of range.
pub fn bco_terms(policy: &[f64], reference: &[f64], lengths: &[f64], pairs: &[(usize, usize)], labels: Option<&[bool]>, delta: Delta<'_>, cfg: &DpoConfig) -> Result<DpoTerms> {
    match (cfg.loss, labels) {
        (DpoLoss::Bco, Some(l)) if l.len() != pairs.len() => bail!("bco_terms: {} labels for {} examples", l.len(), pairs.len()),
        (DpoLoss::Bco, None) => bail!("bco_terms: the bco loss scores labelled unpaired examples: give their labels"),
        (DpoLoss::BcoPair, Some(_)) => bail!("bco_terms: the bco_pair loss scores preference pairs, which have no labels"),
        (DpoLoss::Bco | DpoLoss::BcoPair, _) => {}
        (l, _) => bail!("bco_terms: the {} loss keeps no running mean reward", l.name()),
    }
    let bound = policy.len().min(reference.len()).min(lengths.len());
    if let Some(&(c, r)) = pairs.iter().find(|&&(c, r)| c.max(r) >= bound) {
        bail!("bco_terms: answer {} of {} log-probabilities ({} reference, {} lengths)", c.max(r), policy.len(), reference.len(), lengths.len())
    }
    let beta = cfg.beta;
    let reward = |i: usize| beta * (policy[i] - reference[i]);
    // the micro-batch's scored answers: both of a pair, an example's own
    let scored: Vec<usize> = match labels {
        Some(_) => pairs.iter().map(|&(e, _)| e).collect(),
        None => pairs.iter().flat_map(|&(c, r)| [c, r]).collect(),
    };
    let delta = match delta {
        Delta::Update(running) => {
            if !scored.is_empty() {
                running.update(scored.iter().map(|&i| reward(i)).sum::<f64>() / scored.len() as f64);
            }
            running.mean
        }
        Delta::Hold(d) => d,
    };
    let n = pairs.len().max(1) as f64;
    let (mut loss, mut right, mut margin) = (0.0, 0.0, 0.0);
    let mut d_logp = vec![0.0; policy.len()];
    match labels {
        Some(labels) => {
            for (&(e, _), &good) in pairs.iter().zip(labels) {
                // x = ±(β·r − δ): loss softplus(−x), ∂/∂log π = ∓β·σ(−x)
                let sign = if good { 1.0 } else { -1.0 };
                let x = sign * (reward(e) - delta);
                loss += softplus(-x) / n;
                d_logp[e] -= sign * beta * sigmoid(-x) / n;
                right += (x > 0.0) as u8 as f64;
                margin += x;
            }
        }
        None => {
            for &(c, r) in pairs {
                let (x, y) = (reward(c) - delta, reward(r) - delta);
                loss += (softplus(-x) + softplus(y)) / n;
                d_logp[c] -= beta * sigmoid(-x) / n;
                d_logp[r] += beta * sigmoid(y) / n;
                right += (x > y) as u8 as f64;
                margin += x - y;
            }
            super::dpo::add_rpo(policy, lengths, pairs, super::dpo::chosen_ce_weight(cfg), &mut loss, &mut d_logp);
        }
    }
    Ok(DpoTerms { loss, accuracy: right / n, margin: margin / n, kl: None, delta: Some(delta), d_logp })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::dpo_loss::assert_central_differences;

    /// TRL's `RunningMoments.update` on one value at a time, written out (its mean; the
    /// variance it also keeps is never read by the losses).
    fn trl_running_mean(xs: &[f64]) -> f64 {
        let (mut mean, mut count) = (0.0, 1e-24);
        for &x in xs {
            let delta = x - mean;
            let tot = count + 1.0;
            mean += delta * 1.0 / tot;
            count = tot;
        }
        mean
    }

    /// The running mean is TRL's, and the mean of the values it saw (to within its 1e-24 start).
    #[test]
    fn running_mean_is_trls() {
        let xs = [0.3, -1.2, 2.5, 0.0, 7.25];
        let mut r = RunningMean::default();
        for (i, &x) in xs.iter().enumerate() {
            r.update(x);
            let seen = &xs[..=i];
            assert!((r.mean - trl_running_mean(seen)).abs() < 1e-15);
            assert!((r.mean - seen.iter().sum::<f64>() / seen.len() as f64).abs() < 1e-12);
        }
        assert!((r.count - 5.0).abs() < 1e-12);
    }

    /// BCO and bco_pair in closed form (TRL's formulas written out), δ updated first by the
    /// batch's mean reward or held, the derivatives against central differences with δ held
    /// (detached), and the refusals.
    #[test]
    fn terms_match_trls_formulas_and_finite_differences() -> Result<()> {
        let s = |x: f64| 1.0 / (1.0 + (-x).exp());
        let logsig = |x: f64| s(x).ln();
        let policy = [-3.0, -5.0, -2.0, -3.5, -7.5, -4.0];
        let reference = [-4.0, -6.0, -2.5, -3.0, -7.0, -5.0];
        let lengths = [3.0, 4.0, 2.0, 5.0, 6.0, 2.0];
        let beta = 0.5;
        let rw = |i: usize| beta * (policy[i] - reference[i]);
        // bco_pair over three pairs, after two earlier micro-batches' means 0.2 and -0.4
        let pairs = [(0, 1), (2, 3), (4, 5)];
        let cfg = DpoConfig { beta, loss: DpoLoss::BcoPair, ..DpoConfig::default() };
        cfg.validate()?;
        let mut running = RunningMean::default();
        running.update(0.2);
        running.update(-0.4);
        let batch_mean = (0..6).map(rw).sum::<f64>() / 6.0;
        let delta = trl_running_mean(&[0.2, -0.4, batch_mean]);
        let t = bco_terms(&policy, &reference, &lengths, &pairs, None, Delta::Update(&mut running), &cfg)?;
        assert!((t.delta.expect("delta") - delta).abs() < 1e-12 && (running.mean - delta).abs() < 1e-15);
        let want: f64 = pairs.iter().map(|&(c, r)| -logsig(rw(c) - delta) - logsig(-(rw(r) - delta))).sum::<f64>() / 3.0;
        assert!((t.loss - want).abs() < 1e-12, "{} vs {want}", t.loss);
        assert!((t.margin - pairs.iter().map(|&(c, r)| rw(c) - rw(r)).sum::<f64>() / 3.0).abs() < 1e-12);
        assert_eq!(t.accuracy, pairs.iter().filter(|&&(c, r)| rw(c) > rw(r)).count() as f64 / 3.0);
        let at = |p: &[f64], c: &DpoConfig| bco_terms(p, &reference, &lengths, &pairs, None, Delta::Hold(delta), c);
        for c in [cfg.clone(), DpoConfig { rpo_alpha: 0.7, ..cfg.clone() }] {
            let t = at(&policy, &c)?;
            assert_central_differences(&|p| Ok(at(p, &c)?.loss), &policy, &t.d_logp, &[0, 1, 2, 3, 4, 5], (1e-6, 1e-9), "bco_pair")?;
            // RPO: α × the chosen answers' mean cross-entropy per scored token
            let rpo = -c.rpo_alpha * (policy[0] + policy[2] + policy[4]) / (lengths[0] + lengths[2] + lengths[4]);
            assert!((t.loss - want - rpo).abs() < 1e-12);
        }

        // BCO over three unpaired examples (slots 0, 2, 4; their second index unused)
        let examples = [(0, 1), (2, 3), (4, 5)];
        let labels = [true, false, true];
        let cfg = DpoConfig { beta, loss: DpoLoss::Bco, ..DpoConfig::default() };
        cfg.validate()?;
        let mut running = RunningMean::default();
        let t = bco_terms(&policy, &reference, &lengths, &examples, Some(&labels), Delta::Update(&mut running), &cfg)?;
        let delta = (rw(0) + rw(2) + rw(4)) / 3.0;
        assert!((t.delta.expect("delta") - delta).abs() < 1e-12);
        let xs: Vec<f64> = examples.iter().zip(labels).map(|(&(e, _), d)| if d { rw(e) - delta } else { -(rw(e) - delta) }).collect();
        let want = (-logsig(xs[0]) - logsig(xs[1]) - logsig(xs[2])) / 3.0;
        assert!((t.loss - want).abs() < 1e-12, "{} vs {want}", t.loss);
        assert!((t.margin - xs.iter().sum::<f64>() / 3.0).abs() < 1e-12);
        assert_eq!(t.accuracy, xs.iter().filter(|&&x| x > 0.0).count() as f64 / 3.0);
        let at = |p: &[f64]| bco_terms(p, &reference, &lengths, &examples, Some(&labels), Delta::Hold(delta), &cfg);
        assert_central_differences(&|p| Ok(at(p)?.loss), &policy, &t.d_logp, &[0, 1, 2, 3, 4, 5], (1e-6, 1e-9), "bco example")?;
        for i in 0..6 {
            assert_eq!(t.d_logp[i] == 0.0, i % 2 == 1, "slot {i}");
        }
        // held: δ as given, the running mean untouched
        let before = running;
        let held = bco_terms(&policy, &reference, &lengths, &examples, Some(&labels), Delta::Hold(1.5), &cfg)?;
        assert_eq!((held.delta, running), (Some(1.5), before));
        // at the start (policy = reference, δ = 0): every example's loss ln 2
        let t = bco_terms(&reference, &reference, &lengths, &examples, Some(&labels), Delta::Update(&mut RunningMean::default()), &cfg)?;
        assert!((t.loss - std::f64::consts::LN_2).abs() < 1e-12 && t.delta == Some(0.0));

        // refusals
        let mut r = RunningMean::default();
        let err = |e: Result<DpoTerms>| e.unwrap_err().to_string();
        assert!(err(bco_terms(&policy, &reference, &lengths, &examples, Some(&labels[..2]), Delta::Update(&mut r), &cfg)).contains("2 labels for 3 examples"));
        assert!(err(bco_terms(&policy, &reference, &lengths, &examples, None, Delta::Hold(0.0), &cfg)).contains("labels"));
        assert!(err(bco_terms(&policy, &reference, &lengths, &pairs, Some(&labels), Delta::Hold(0.0), &DpoConfig { loss: DpoLoss::BcoPair, ..cfg.clone() })).contains("no labels"));
        assert!(err(bco_terms(&policy, &reference, &lengths, &[(0, 6)], None, Delta::Hold(0.0), &DpoConfig { loss: DpoLoss::BcoPair, ..cfg.clone() })).contains("answer 6"));
        assert!(err(bco_terms(&policy, &reference, &lengths, &pairs, None, Delta::Hold(0.0), &DpoConfig::default())).contains("sigmoid"));
        assert_eq!(r, RunningMean::default(), "a refused call leaves δ as it was");
        for bad in [
            DpoConfig { loss: DpoLoss::Bco, rpo_alpha: 0.5, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::Bco, reference_free: true, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::Bco, label_smoothing: 0.1, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::BcoPair, label_smoothing: 0.1, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::Bco, desirable_weight: 2.0, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::BcoPair, undesirable_weight: 2.0, ..DpoConfig::default() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert_eq!(("bco".parse::<DpoLoss>()?, "bco_pair".parse::<DpoLoss>()?), (DpoLoss::Bco, DpoLoss::BcoPair));
        Ok(())
    }
}
