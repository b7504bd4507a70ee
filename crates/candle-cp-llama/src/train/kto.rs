//! KTO (Ethayarajh et al. 2024, "Model Alignment as Prospect Theoretic Optimization") on
//! every layout: unpaired examples, each a prompt with ONE completion labelled desirable or
//! undesirable ([`super::PreferenceSet::from_unpaired`]), trained through the same per-answer
//! log-probability sums and linearised loss node as DPO ([`super::dpo`]):
//!
//! ```text
//! r   = log π(y|x) − log π_ref(y|x)                       (the example's log-ratio)
//! z₀  = max(0, mean over the batch's KL documents of (log π(y'|x) − log π_ref(y'|x)))
//! loss(desirable)   = λ_D · (1 − σ(β·(r − z₀)))
//! loss(undesirable) = λ_U · (1 − σ(β·(z₀ − r)))
//! loss = mean over the batch's examples
//! ```
//!
//! as TRL's `KTOTrainer` (`loss_type="kto"`): `y'` is another example's completion (each
//! example's KL document, [`super::PreferenceSet::sample_split`]'s second row), `z₀` is
//! detached and taken over the whole micro-batch — over every data-parallel rank, as TRL
//! gathers it across processes, so DP = one device. λ_D, λ_U: [`super::DpoConfig::desirable_weight`],
//! [`super::DpoConfig::undesirable_weight`] (the paper advises `λ_D·n_D / (λ_U·n_U)` in
//! `[1, 4/3]`).
//!
//! The KL documents lie in rows of their own, scored by a forward without a backward before
//! the examples' forward (the trainer's `DpoRun::kl_logps`), as TRL scores them under
//! `no_grad`: a micro-batch costs one more forward, and its activations are freed before the
//! examples' forward starts.

use super::dpo::{DpoConfig, DpoLoss, DpoTerms};
use super::dpo_loss::sigmoid;
use candle_core::{bail, Result};

/// KTO over `pairs` (indices of each example's document and of its KL document into `policy`
/// and `reference`, the answers' summed log-probabilities), `desirable[i]` pair `i`'s label.
///
/// [`DpoTerms`] here: `loss` the mean loss; `accuracy` the fraction of examples on their
/// label's side of the KL baseline (`r > z₀` desirable, `r < z₀` undesirable); `margin` the
/// mean of `±β·(r − z₀)` (+ desirable, − undesirable); `kl` = `z₀`; `d_logp` the derivatives in
/// the examples' log-probabilities (zero for the KL documents: `z₀` is detached). Errors
/// unless `cfg.loss` is [`DpoLoss::Kto`] and there is one label per pair.
pub fn kto_terms(policy: &[f64], reference: &[f64], pairs: &[(usize, usize)], desirable: &[bool], cfg: &DpoConfig) -> Result<DpoTerms> {
    if cfg.loss != DpoLoss::Kto {
        bail!("kto_terms: the {} loss scores preference pairs (dpo_terms)", cfg.loss.name())
    }
    check_examples("kto_terms", policy, reference, pairs, desirable, true)?;
    let n = pairs.len().max(1) as f64;
    let kl = (pairs.iter().map(|&(_, k)| policy[k] - reference[k]).sum::<f64>() / n).max(0.0);
    Ok(DpoTerms { kl: Some(kl), ..against_baseline(policy, reference, pairs, desirable, kl, cfg) })
}

/// Errors unless there is one label per example and every index used (`with_kl`: both of each
/// pair, else the example's) is in range of `policy` and `reference`.
fn check_examples(op: &str, policy: &[f64], reference: &[f64], pairs: &[(usize, usize)], desirable: &[bool], with_kl: bool) -> Result<()> {
    if desirable.len() != pairs.len() {
        bail!("{op}: {} labels for {} examples", desirable.len(), pairs.len())
    }
    let used = |&(e, k): &(usize, usize)| if with_kl { e.max(k) } else { e };
    if let Some(i) = pairs.iter().map(used).find(|&i| i >= policy.len().min(reference.len())) {
        bail!("{op}: answer {i} of {} log-probabilities ({} reference)", policy.len(), reference.len())
    }
    Ok(())
}

/// KTO's loss of each example against a baseline `z₀` (its KL estimate; 0 for APO-zero):
/// `x = ±β·(r − z₀)` (+ desirable, − undesirable), loss `λ·σ(−x)` averaged, the accuracy the
/// fraction with `x > 0`, the margin the mean `x`, the derivatives in the examples'
/// log-probabilities (`z₀` detached). `kl` and `delta` left `None`.
fn against_baseline(policy: &[f64], reference: &[f64], pairs: &[(usize, usize)], desirable: &[bool], z0: f64, cfg: &DpoConfig) -> DpoTerms {
    let n = pairs.len().max(1) as f64;
    let (mut loss, mut right, mut margin) = (0.0, 0.0, 0.0);
    let mut d_logp = vec![0.0; policy.len()];
    let beta = cfg.beta;
    for (&(e, _), &good) in pairs.iter().zip(desirable) {
        // loss λ·(1 − σ(x)) = λ·σ(−x), ∂/∂r = ∓ λ·β·σ(x)·σ(−x)
        let (sign, weight) = if good { (1.0, cfg.desirable_weight) } else { (-1.0, cfg.undesirable_weight) };
        let x = sign * beta * (policy[e] - reference[e] - z0);
        loss += weight * sigmoid(-x) / n;
        d_logp[e] -= sign * weight * beta * sigmoid(x) * sigmoid(-x) / n;
        right += (x > 0.0) as u8 as f64;
        margin += x;
    }
    DpoTerms { loss, accuracy: right / n, margin: margin / n, kl: None, delta: None, d_logp }
}

/// APO-zero over unpaired examples (TRL's `KTOTrainer` `loss_type="apo_zero_unpaired"`): the
/// first index of each of `pairs` into `policy` and `reference` is example `i`'s answer (the
/// second unused), `desirable[i]` its label; a desirable example costs `λ_D·(1 − σ(β·r))`, an
/// undesirable one `λ_U·σ(β·r)`, averaged over the examples. [`DpoTerms`] as
/// [`kto_terms`]'s with `z₀ = 0` and no `kl`. Errors unless `cfg.loss` is
/// [`DpoLoss::ApoZeroUnpaired`] and there is one label per example.
pub fn apo_zero_unpaired_terms(policy: &[f64], reference: &[f64], pairs: &[(usize, usize)], desirable: &[bool], cfg: &DpoConfig) -> Result<DpoTerms> {
    if cfg.loss != DpoLoss::ApoZeroUnpaired {
        bail!("apo_zero_unpaired_terms: the loss is {}", cfg.loss.name())
    }
    check_examples("apo_zero_unpaired_terms", policy, reference, pairs, desirable, false)?;
    Ok(against_baseline(policy, reference, pairs, desirable, 0.0, cfg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::dpo_loss::assert_central_differences;

    /// The loss, accuracy, margin and KL estimate in closed form (with the clamp at 0 taken
    /// and not), the derivatives against central differences in the examples' log-probabilities
    /// (z₀ held: detached), and the KL documents' derivatives zero.
    #[test]
    fn terms_match_the_formula_and_finite_differences() -> Result<()> {
        let reference = [-4.0, -6.0, -2.5, -3.0, -7.0, -5.0];
        let pairs = [(0, 1), (2, 3), (4, 5)];
        let desirable = [true, false, true];
        let cfg = DpoConfig { beta: 0.5, loss: DpoLoss::Kto, desirable_weight: 1.0, undesirable_weight: 1.5, ..DpoConfig::default() };
        cfg.validate()?;
        // KL documents above and below their reference: z₀ = 0.5, and clamped to 0
        for (kl_docs, z0) in [([-5.0, -2.0, -5.5], 0.5), ([-7.0, -4.0, -5.5], 0.0)] {
            let policy = [-3.0, kl_docs[0], -2.0, kl_docs[1], -7.5, kl_docs[2]];
            let t = kto_terms(&policy, &reference, &pairs, &desirable, &cfg)?;
            assert!((t.kl.expect("kl") - z0).abs() < 1e-12, "{:?}", t.kl);
            let s = |x: f64| 1.0 / (1.0 + (-x).exp());
            let xs: Vec<f64> = pairs.iter().zip(desirable).map(|(&(e, _), d)| if d { 0.5 * (policy[e] - reference[e] - z0) } else { 0.5 * (z0 - policy[e] + reference[e]) }).collect();
            let want = (1.0 - s(xs[0]) + 1.5 * (1.0 - s(xs[1])) + 1.0 - s(xs[2])) / 3.0;
            assert!((t.loss - want).abs() < 1e-12, "{} vs {want}", t.loss);
            assert!((t.margin - xs.iter().sum::<f64>() / 3.0).abs() < 1e-12);
            assert_eq!(t.accuracy, xs.iter().filter(|&&x| x > 0.0).count() as f64 / 3.0);
            assert_central_differences(&|p| Ok(kto_terms(p, &reference, &pairs, &desirable, &cfg)?.loss), &policy, &t.d_logp, &[0, 2, 4], (1e-6, 1e-9), "kto")?;
            for &(e, k) in &pairs {
                assert!(t.d_logp[e] != 0.0 && t.d_logp[k] == 0.0);
                // a desirable example's loss falls as its log-probability rises, an undesirable one's rises
                assert_eq!(t.d_logp[e] < 0.0, desirable[e / 2]);
            }
        }
        // at the start (policy = reference): z₀ = 0, every example's loss λ/2
        let t = kto_terms(&reference, &reference, &pairs, &desirable, &cfg)?;
        assert!((t.loss - (0.5 + 0.75 + 0.5) / 3.0).abs() < 1e-12 && t.kl == Some(0.0) && t.accuracy == 0.0);
        // refusals
        assert!(kto_terms(&reference, &reference, &pairs, &desirable[..2], &cfg).unwrap_err().to_string().contains("2 labels for 3 examples"));
        assert!(kto_terms(&reference, &reference, &[(0, 6)], &[true], &cfg).is_err());
        assert!(kto_terms(&reference, &reference, &pairs, &desirable, &DpoConfig::default()).unwrap_err().to_string().contains("sigmoid"));
        for bad in [
            DpoConfig { loss: DpoLoss::Kto, desirable_weight: 0.0, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::Kto, undesirable_weight: f64::NAN, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::Kto, rpo_alpha: 0.5, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::Kto, label_smoothing: 0.1, ..DpoConfig::default() },
            DpoConfig { loss: DpoLoss::Kto, reference_free: true, ..DpoConfig::default() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert_eq!("kto".parse::<DpoLoss>()?, DpoLoss::Kto);
        Ok(())
    }

    /// APO-zero unpaired (TRL's KTOTrainer formula written out: `1 − σ(β·r)` desirable,
    /// `σ(β·r)` undesirable, each weighted) in closed form, its derivatives against central
    /// differences, 1/2 per example at the start, and the refusals.
    #[test]
    fn apo_zero_unpaired_matches_trls_formula() -> Result<()> {
        let policy = [-3.0, 0.0, -2.0, 0.0, -7.5, 0.0];
        let reference = [-4.0, 0.0, -2.5, 0.0, -7.0, 0.0];
        let pairs = [(0, 0), (2, 2), (4, 4)];
        let desirable = [true, false, false];
        let cfg = DpoConfig { beta: 0.5, loss: DpoLoss::ApoZeroUnpaired, desirable_weight: 1.2, undesirable_weight: 0.8, ..DpoConfig::default() };
        cfg.validate()?;
        let s = |x: f64| 1.0 / (1.0 + (-x).exp());
        let r = |i: usize| 0.5 * (policy[i] - reference[i]);
        let want = (1.2 * (1.0 - s(r(0))) + 0.8 * s(r(2)) + 0.8 * s(r(4))) / 3.0;
        let t = apo_zero_unpaired_terms(&policy, &reference, &pairs, &desirable, &cfg)?;
        assert!((t.loss - want).abs() < 1e-12 && t.kl.is_none(), "{} vs {want}", t.loss);
        assert_eq!(t.accuracy, [r(0) > 0.0, r(2) < 0.0, r(4) < 0.0].iter().filter(|&&x| x).count() as f64 / 3.0);
        assert_central_differences(&|p| Ok(apo_zero_unpaired_terms(p, &reference, &pairs, &desirable, &cfg)?.loss), &policy, &t.d_logp, &[0, 2, 4], (1e-6, 1e-9), "apo_zero_unpaired")?;
        let start = apo_zero_unpaired_terms(&reference, &reference, &pairs, &desirable, &cfg)?;
        assert!((start.loss - (0.6 + 0.4 + 0.4) / 3.0).abs() < 1e-12);
        assert!(apo_zero_unpaired_terms(&policy, &reference, &pairs, &desirable[..1], &cfg).unwrap_err().to_string().contains("1 labels for 3"));
        assert!(apo_zero_unpaired_terms(&policy, &reference, &pairs, &desirable, &DpoConfig::default()).is_err());
        assert!(DpoConfig { loss: DpoLoss::ApoZeroUnpaired, rpo_alpha: 0.1, ..DpoConfig::default() }.validate().is_err());
        assert!(DpoConfig { loss: DpoLoss::ApoZeroUnpaired, reference_free: true, ..DpoConfig::default() }.validate().is_err());
        assert!(DpoConfig { loss: DpoLoss::Bco, desirable_weight: 2.0, ..DpoConfig::default() }.validate().is_err());
        Ok(())
    }
}
