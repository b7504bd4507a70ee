//! Tests of the losses over a whole batch (aot_pair, aot, sft, a mix) and of f-DPO's
//! divergences, against TRL's formulas written out and central differences.
use crate::train::dpo::{dpo_terms, mixed_terms, DpoConfig, DpoTerms};
use crate::train::dpo_loss::{assert_central_differences, softplus, DpoLoss};
use candle_core::Result;

/// The losses over the whole batch against TRL's formulas written out — aot_pair and aot
/// (each of the two sequences sorted on its own, with label smoothing), sft (the chosen answers'
/// mean cross-entropy, rewards 0) — and a mix (MPO's sigmoid 0.8 + bco_pair 0.2 + sft 1, with
/// RPO's α once) as the weighted sum of its losses; derivatives against central differences
/// (bco_pair's δ held); the mix's refusals.
#[test]
fn batch_losses_match_trls_formulas() -> Result<()> {
    use crate::train::bco::{Delta, RunningMean};
    let policy = [-3.0, -5.5, -2.0, -1.0, -7.0, -7.6, -4.0, -4.2];
    let reference = [-4.0, -4.0, -2.5, -0.5, -7.0, -7.0, -3.0, -5.0];
    let lengths = [3.0, 5.0, 2.0, 2.0, 6.0, 4.0, 3.0, 1.0];
    let pairs = [(0, 1), (2, 3), (4, 5), (6, 7)];
    let ls = |z: f64| -softplus(-z);
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let a: Vec<f64> = pairs.iter().map(|&(c, _)| policy[c] - reference[c]).collect();
    let b: Vec<f64> = pairs.iter().map(|&(_, r)| policy[r] - reference[r]).collect();
    let chosen_ce = -(policy[0] + policy[2] + policy[4] + policy[6]) / (lengths[0] + lengths[2] + lengths[4] + lengths[6]);
    let fd_check = |cfg: &DpoConfig, t: &DpoTerms, held: f64| -> Result<()> {
        let at = |p: &[f64]| -> Result<f64> {
            Ok(match cfg.mix.is_empty() {
                true => dpo_terms(p, &reference, &lengths, &pairs, cfg)?.loss,
                false => mixed_terms(p, &reference, &lengths, &pairs, cfg, Some(Delta::Hold(held)))?.loss,
            })
        };
        let all: Vec<usize> = (0..policy.len()).collect();
        assert_central_differences(&at, &policy, &t.d_logp, &all, (1e-6, 1e-8), &format!("{cfg:?}"))
    };
    for eps in [0.0, 0.2] {
        for loss in [DpoLoss::AotPair, DpoLoss::Aot] {
            let cfg = DpoConfig { beta: 0.5, label_smoothing: eps, loss, ..DpoConfig::default() };
            cfg.validate()?;
            let delta: Vec<f64> = match loss {
                DpoLoss::AotPair => sorted(a.clone()).iter().zip(sorted(b.clone())).map(|(x, y)| x - y).collect(),
                _ => {
                    let l = sorted(pairs.iter().map(|&(c, r)| policy[c] - policy[r]).collect());
                    let lr = sorted(pairs.iter().map(|&(c, r)| reference[c] - reference[r]).collect());
                    l.iter().zip(lr).map(|(x, y)| x - y).collect()
                }
            };
            let want = delta.iter().map(|&d| -ls(0.5 * d) * (1.0 - eps) - ls(-0.5 * d) * eps).sum::<f64>() / 4.0;
            let t = dpo_terms(&policy, &reference, &lengths, &pairs, &cfg)?;
            assert!((t.loss - want).abs() < 1e-12, "{loss:?} eps {eps}: {} vs {want}", t.loss);
            let hs: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
            assert_eq!(t.accuracy, hs.iter().filter(|&&h| h > 0.0).count() as f64 / 4.0);
            assert!((t.margin - 0.5 * hs.iter().sum::<f64>() / 4.0).abs() < 1e-12);
            fd_check(&cfg, &t, 0.0)?;
        }
    }
    // (the sorted order differs from the pairs' order here, so sorting is what is checked)
    assert_ne!(sorted(a.clone()), a);
    let sft = DpoConfig { loss: DpoLoss::Sft, ..DpoConfig::default() };
    sft.validate()?;
    assert!(sft.without_reference());
    let t = dpo_terms(&policy, &reference, &lengths, &pairs, &sft)?;
    assert!((t.loss - chosen_ce).abs() < 1e-12 && t.accuracy == 0.0 && t.margin == 0.0, "{t:?}");
    fd_check(&sft, &t, 0.0)?;
    // MPO: 0.8 sigmoid + 0.2 bco_pair + 1 sft, RPO's α 0.3 once
    let mpo = DpoConfig { beta: 0.5, loss: DpoLoss::Sigmoid, rpo_alpha: 0.3, mix: vec![(DpoLoss::Sigmoid, 0.8), (DpoLoss::BcoPair, 0.2), (DpoLoss::Sft, 1.0)], ..DpoConfig::default() };
    mpo.validate()?;
    assert!(mpo.keeps_running_mean() && !mpo.without_reference());
    let mut running = RunningMean::default();
    running.update(0.25);
    let t = mixed_terms(&policy, &reference, &lengths, &pairs, &mpo, Some(Delta::Update(&mut running)))?;
    let d = (0.25 + 0.5 * (a.iter().sum::<f64>() + b.iter().sum::<f64>()) / 8.0) / 2.0;
    assert!((t.delta.expect("delta") - d).abs() < 1e-12 && running.mean == t.delta.expect("delta"));
    let sig = a.iter().zip(&b).map(|(x, y)| -ls(0.5 * (x - y))).sum::<f64>() / 4.0;
    let bco = a.iter().zip(&b).map(|(x, y)| -ls(0.5 * x - d) - ls(-(0.5 * y - d))).sum::<f64>() / 4.0;
    let want = 0.8 * sig + 0.2 * bco + chosen_ce + 0.3 * chosen_ce;
    assert!((t.loss - want).abs() < 1e-12, "MPO {} vs {want}", t.loss);
    assert_eq!(t.accuracy, a.iter().zip(&b).filter(|(x, y)| x > y).count() as f64 / 4.0);
    fd_check(&mpo, &t, d)?;
    // the mix's rules
    let mix = |mix: Vec<(DpoLoss, f64)>| DpoConfig { loss: mix[0].0, mix, ..DpoConfig::default() };
    for (bad, why) in [
        (DpoConfig { loss: DpoLoss::Hinge, ..mpo.clone() }, "starts with sigmoid"),
        (mix(vec![(DpoLoss::Sigmoid, 1.0), (DpoLoss::Kto, 1.0)]), "does not mix"),
        (mix(vec![(DpoLoss::Simpo, 1.0), (DpoLoss::Sigmoid, 1.0)]), "does not mix"),
        (mix(vec![(DpoLoss::Sigmoid, 1.0), (DpoLoss::Sigmoid, 0.5)]), "twice"),
        (mix(vec![(DpoLoss::Sigmoid, 1.0), (DpoLoss::Hinge, 0.0)]), "positive number"),
        (DpoConfig { label_smoothing: 0.1, ..mix(vec![(DpoLoss::Hinge, 1.0), (DpoLoss::Sft, 1.0)]) }, "none is in the mix"),
        (mix(vec![(DpoLoss::Sigmoid, 1.0), (DpoLoss::ExoPair, 1.0)]), "exo_pair loss needs label_smoothing"),
    ] {
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
    // label smoothing reaches the entries that take it only
    let smoothed = DpoConfig { label_smoothing: 0.1, ..mix(vec![(DpoLoss::Hinge, 1.0), (DpoLoss::Sigmoid, 0.5)]) };
    smoothed.validate()?;
    let t = mixed_terms(&policy, &reference, &lengths, &pairs, &smoothed, None)?;
    let one = |l: DpoLoss, e: f64| dpo_terms(&policy, &reference, &lengths, &pairs, &DpoConfig { loss: l, label_smoothing: e, ..DpoConfig::default() }).map(|t| t.loss);
    assert!((t.loss - one(DpoLoss::Hinge, 0.0)? - 0.5 * one(DpoLoss::Sigmoid, 0.1)?).abs() < 1e-12);
    // bco_pair in a mix needs δ
    assert!(mixed_terms(&policy, &reference, &lengths, &pairs, &mpo, None).unwrap_err().to_string().contains("running mean"));
    Ok(())
}

/// f-DPO: the Jensen–Shannon and α-divergences' `h` as TRL computes its `logits` (written out
/// with softplus and exp), through the sigmoid (with label smoothing), hinge, robust, exo_pair
/// and discopop losses; the derivatives against central differences; the losses that do not
/// take one refuse it, a mix takes it for its entries that do; α far out saturates as TRL's
/// `cap_exp` instead of overflowing.
#[test]
fn f_divergences_match_trls_formulas() -> Result<()> {
    use crate::train::dpo_loss::FDivergence;
    let policy = [-3.0, -5.5, -2.0, -1.0, -7.0, -7.6];
    let reference = [-4.0, -4.0, -2.5, -0.5, -7.0, -7.0];
    let lengths = [3.0, 5.0, 2.0, 2.0, 6.0, 4.0];
    let pairs = [(0, 1), (2, 3), (4, 5)];
    let sp = |x: f64| (1.0 + x.exp()).ln();
    for f in [FDivergence::JsDivergence, FDivergence::Alpha(1.0), FDivergence::Alpha(0.3)] {
        for (loss, eps) in [(DpoLoss::Sigmoid, 0.0), (DpoLoss::Sigmoid, 0.2), (DpoLoss::Hinge, 0.0), (DpoLoss::Robust, 0.1), (DpoLoss::ExoPair, 0.1), (DpoLoss::DiscoPop, 0.0)] {
            let cfg = DpoConfig { beta: 0.5, label_smoothing: eps, loss, f_divergence: f, ..DpoConfig::default() };
            cfg.validate()?;
            let t = dpo_terms(&policy, &reference, &lengths, &pairs, &cfg)?;
            // TRL's logits: JS `logratios − ref_logratios − (softplus(a) − softplus(b))`, α
            // `(cap_exp(−α·b) − cap_exp(−α·a))/α`
            let hf: Vec<f64> = pairs
                .iter()
                .map(|&(c, r)| {
                    let (a, b) = (policy[c] - reference[c], policy[r] - reference[r]);
                    match f {
                        FDivergence::Alpha(al) => ((-al * b).exp() - (-al * a).exp()) / al,
                        _ => (policy[c] - policy[r]) - (reference[c] - reference[r]) - (sp(a) - sp(b)),
                    }
                })
                .collect();
            // the loss of each with DPO's h replaced: the reverse-KL loss at the same h
            let plain = DpoConfig { f_divergence: FDivergence::ReverseKl, ..cfg.clone() };
            let want: f64 = hf.iter().map(|&h| Ok(dpo_terms(&[h, 0.0], &[0.0, 0.0], &[1.0, 1.0], &[(0, 1)], &plain)?.loss)).sum::<Result<f64>>()? / 3.0;
            assert!((t.loss - want).abs() < 1e-12, "{f:?} {loss:?}: {} vs {want}", t.loss);
            assert_eq!(t.accuracy, hf.iter().filter(|&&h| h > 0.0).count() as f64 / 3.0, "{f:?}: h's sign is the log-ratios'");
            let rewards = pairs.iter().map(|&(c, r)| 0.5 * ((policy[c] - reference[c]) - (policy[r] - reference[r]))).sum::<f64>() / 3.0;
            assert!((t.margin - rewards).abs() < 1e-12, "{f:?}: the margin is the rewards' (TRL's)");
            let at = |p: &[f64]| Ok(dpo_terms(p, &reference, &lengths, &pairs, &cfg)?.loss);
            assert_central_differences(&at, &policy, &t.d_logp, &[0, 1, 2, 3, 4, 5], (1e-6, 1e-8), &format!("{f:?} {loss:?}"))?;
        }
    }
    // the losses that do not take one refuse it; a mix takes it for the entries that do
    let js = FDivergence::JsDivergence;
    for loss in [DpoLoss::Ipo, DpoLoss::NcaPair, DpoLoss::AotPair, DpoLoss::BcoPair, DpoLoss::Simpo] {
        let e = DpoConfig { loss, f_divergence: js, ..DpoConfig::default() }.validate().unwrap_err().to_string();
        assert!(e.contains("js_divergence") && e.contains(loss.name()), "{e}");
    }
    let mix = DpoConfig { f_divergence: js, mix: vec![(DpoLoss::Sigmoid, 1.0), (DpoLoss::Sft, 0.5)], ..DpoConfig::default() };
    mix.validate()?;
    let got = mixed_terms(&policy, &reference, &lengths, &pairs, &mix, None)?.loss;
    let one = |l: DpoLoss, f: FDivergence| dpo_terms(&policy, &reference, &lengths, &pairs, &DpoConfig { loss: l, f_divergence: f, ..DpoConfig::default() }).map(|t| t.loss);
    assert!((got - one(DpoLoss::Sigmoid, js)? - 0.5 * one(DpoLoss::Sft, FDivergence::ReverseKl)?).abs() < 1e-12);
    assert!(DpoConfig { f_divergence: FDivergence::Alpha(0.0), ..DpoConfig::default() }.validate().is_err());
    assert_eq!((FDivergence::parse("js_divergence", 1.0)?, FDivergence::parse("alpha_divergence", 0.5)?.name()), (js, "alpha_divergence"));
    assert!(FDivergence::parse("kl", 1.0).is_err());
    // α far out: e^(−α·b) saturates instead of overflowing, the loss stays a number
    let far = dpo_terms(&[-3000.0, 0.0], &[0.0, 0.0], &[1.0, 1.0], &[(0, 1)], &DpoConfig { f_divergence: FDivergence::Alpha(1.0), ..DpoConfig::default() })?;
    assert!(far.loss.is_finite() && far.d_logp.iter().all(|x| x.is_finite()), "{far:?}");
    Ok(())
}
