//! WPO (Zhou et al. 2024, "Weighted Preference Optimization"; TRL's `use_weighting`,
//! [`super::DpoConfig::use_weighting`]): each pair's loss weighed by how likely the policy
//! itself is to produce its two answers, so that off-policy pairs count less:
//!
//! ```text
//! m(y) = mean over y's scored tokens t of ( log p(y_t) − log Σ_v p_v(t)² )     (no gradient)
//! w    = min(1, exp(m(chosen) + m(rejected)))
//! loss = mean over pairs of w · (Σ_l w_l · loss_l(pair) + CE)     (CE: RPO's α and sft's weight
//!                                                                   × the chosen answers' CE)
//! ```
//!
//! `log Σ_v p_v²` is the head's statistic beside each token's loss (one more pass over each
//! chunk of logits; over a vocabulary split by TP, merged by a small all-gather:
//! [`crate::Llama::token_nll_packed_stat`], [`crate::head_loss::HeadStat::SumSq`]); the per-answer sums are added over the ranks with
//! the log-probabilities' in the same all-gather. The weights are constants of the step, as
//! TRL's (computed under `no_grad`): the pair losses' derivatives are scaled by them and
//! nothing else changes. Batch-wide terms stay batch-wide — bco_pair's running mean δ is the
//! batch's, and the cross-entropy terms (a scalar over the batch in TRL, multiplied by each
//! pair's weight) count the weights' mean. The AOT losses, whose terms belong to sorted
//! positions rather than pairs, the unpaired losses and ORPO take no weights
//! ([`super::DpoConfig::validate`]).

use super::bco::Delta;
use super::dpo::{terms, Answers, DpoTerms};
use super::DpoConfig;
use candle_core::Result;

/// Per pair `(chosen, rejected)` (indices into `means`, each answer's mean adjusted
/// log-probability), WPO's weight `min(1, exp(m_c + m_r))`.
pub(crate) fn pair_weights(means: &[f64], pairs: &[(usize, usize)]) -> Vec<f64> {
    pairs.iter().map(|&(c, r)| (means[c] + means[r]).exp().min(1.0)).collect()
}

/// The terms of `cfg`'s objective (without its cross-entropy terms: the caller's) over
/// `pairs`, each pair's loss and derivatives times its weight; accuracy, margin and δ those of
/// the whole batch (δ updated once, by every pair's rewards, then held for each pair's term).
pub(crate) fn weighted_terms(policy: &[f64], answers: &Answers, of: &[usize], pairs: &[(usize, usize)], cfg: &DpoConfig, delta: Option<Delta<'_>>, weights: &[f64]) -> Result<DpoTerms> {
    if weights.len() != pairs.len() {
        candle_core::bail!("wpo: {} weights for {} pairs", weights.len(), pairs.len())
    }
    let whole = terms(policy, answers, of, pairs, cfg, delta)?;
    let n = pairs.len().max(1) as f64;
    let mut out = DpoTerms { loss: 0.0, d_logp: vec![0.0; policy.len()], ..whole.clone() };
    for (&p, &w) in pairs.iter().zip(weights) {
        let t = terms(policy, answers, of, &[p], cfg, whole.delta.map(Delta::Hold))?;
        out.loss += w * t.loss / n;
        out.d_logp.iter_mut().zip(&t.d_logp).for_each(|(a, b)| *a += w * b / n);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::DpoLoss;

    /// Weights 1 give the unweighted objective (sigmoid with label smoothing, and a mix with
    /// bco_pair against a held δ); other weights give `mean w_p · loss_p` and its derivatives
    /// (each pair's terms alone); the weights are capped at 1.
    #[test]
    fn weighted_terms_are_the_pairs_losses_weighed() -> Result<()> {
        let policy = [-3.0, -5.5, -2.0, -1.0, -7.0, -7.5];
        let answers = Answers { reference: vec![-4.0, -4.0, -2.5, -0.5, -7.0, -7.0], lengths: vec![3.0, 5.0, 2.0, 2.0, 6.0, 4.0], desirable: None };
        let (of, pairs) = ([0, 1, 2, 3, 4, 5], [(0, 1), (2, 3), (4, 5)]);
        let smoothed = DpoConfig { label_smoothing: 0.1, ..DpoConfig::default() };
        let mix = DpoConfig { mix: vec![(DpoLoss::Sigmoid, 0.8), (DpoLoss::BcoPair, 0.2)], ..DpoConfig::default() };
        for cfg in [smoothed, mix] {
            let held = || Some(Delta::Hold(0.3));
            let plain = terms(&policy, &answers, &of, &pairs, &cfg, held())?;
            let ones = weighted_terms(&policy, &answers, &of, &pairs, &cfg, held(), &[1.0; 3])?;
            assert!((ones.loss - plain.loss).abs() < 1e-12 && ones.accuracy == plain.accuracy && ones.delta == plain.delta, "{ones:?} vs {plain:?}");
            ones.d_logp.iter().zip(&plain.d_logp).for_each(|(a, b)| assert!((a - b).abs() < 1e-12));
            let w = [0.5, 1.0, 0.1];
            let got = weighted_terms(&policy, &answers, &of, &pairs, &cfg, held(), &w)?;
            let alone: Vec<DpoTerms> = pairs.iter().map(|&p| terms(&policy, &answers, &of, &[p], &cfg, held())).collect::<Result<_>>()?;
            let want: f64 = alone.iter().zip(&w).map(|(t, w)| w * t.loss).sum::<f64>() / 3.0;
            assert!((got.loss - want).abs() < 1e-12, "{} vs {want}", got.loss);
            for (i, d) in got.d_logp.iter().enumerate() {
                let want: f64 = alone.iter().zip(&w).map(|(t, w)| w * t.d_logp[i]).sum::<f64>() / 3.0;
                assert!((d - want).abs() < 1e-12, "answer {i}: {d} vs {want}");
            }
            assert!(weighted_terms(&policy, &answers, &of, &pairs, &cfg, held(), &w[..2]).is_err());
        }
        assert_eq!(pair_weights(&[-0.5, -0.25, 0.5, 0.25], &[(0, 1), (2, 3)]), vec![(-0.75f64).exp(), 1.0]);
        Ok(())
    }
}
