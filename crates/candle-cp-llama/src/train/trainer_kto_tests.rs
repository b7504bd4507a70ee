//! Trainer tests of KTO ([`crate::train::kto`]) on unpaired examples.
use super::tests::{assert_same_curve, run, tiny_cfg, tmpdir};
use super::*;
use crate::train::{DpoConfig, DpoLoss, PreferenceSet};
use crate::{CpKind, Layout, LlamaConfig};
use candle_core::DType;

/// The unpaired examples of 12 byte-level pairs (`dpo_tests::pairs_text`: each pair's chosen
/// answer desirable, its rejected one not).
fn kto_set() -> Result<PreferenceSet> {
    PreferenceSet::read_unpaired(&crate::train::dpo::tests::pairs_text(12, 11), &crate::train::sft::bytes_of, Some(2), None)
}

/// A KTO run of `steps` on `layout`: rows of 96 tokens, batch 2, β 0.5, λ_U `undesirable`.
fn kto_cfg(layout: Layout, steps: usize, undesirable: f64) -> Result<TrainConfig> {
    let mut c = tiny_cfg(None, layout, 2, 1);
    (c.data, c.model, c.seq_len, c.steps) = (DataSource::Preference(kto_set()?), ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1)), 96, steps);
    c.schedule.total = steps;
    c.dpo = Some(DpoConfig { beta: 0.5, loss: DpoLoss::Kto, undesirable_weight: undesirable, ..DpoConfig::default() });
    Ok(c)
}

/// Step 1 compares the policy with itself: every example's loss is λ/2 (0.5 with weights 1),
/// the KL estimate 0; the run learns (loss below 0.5, examples on their label's side); zigzag
/// CP 2, ring CP 2 × DP 2 (the KL estimate over both DP ranks' rows) and TP 2 + SP follow the
/// single-device curve, objective and KL estimate included; held-out examples evaluate the
/// same on zigzag CP 2 as on one device; a pair loss on unpaired data and the kto loss on
/// pairs are refused.
#[test]
fn kto_starts_at_one_half_learns_and_matches_on_every_layout() -> Result<()> {
    let one = run(&kto_cfg(Layout::single(), 12, 1.0)?)?;
    let m = &one[0].metrics;
    assert!((m[0].train_loss - 0.5).abs() < 1e-5, "step 1: {}", m[0].train_loss);
    assert!(m[0].kto_kl.is_some_and(|k| k.abs() < 1e-4) && m[0].dpo_margin.is_some_and(|x| x.abs() < 1e-4), "{:?}", m[0]);
    let last = m.last().expect("steps");
    assert!(last.train_loss < 0.45, "step 12: {:?}", m.iter().map(|x| x.train_loss).collect::<Vec<_>>());
    assert!(last.dpo_accuracy.is_some_and(|a| a > 0.5) && last.dpo_margin.is_some_and(|x| x > 0.0), "{last:?}");
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::single().with_tp(2, true)] {
        let other = run(&kto_cfg(layout, 12, 1.0).map(|mut c| {
            c.stop_after = Some(4);
            c
        })?)?;
        assert_same_curve(&layout.to_string(), &want, &other[0].metrics);
        for (a, b) in want.iter().zip(&other[0].metrics) {
            assert!((a.train_loss - b.train_loss).abs() < 1e-5, "{layout} step {}: KTO loss {} vs {}", a.step, a.train_loss, b.train_loss);
            let (ka, kb) = (a.kto_kl.expect("kl"), b.kto_kl.expect("kl"));
            assert!((ka - kb).abs() < 1e-4, "{layout} step {}: KL estimate {ka} vs {kb}", a.step);
        }
    }
    // held-out examples: the starting model's held-out loss is 0.5; zigzag CP 2 = one device
    let with_eval = |layout: Layout, steps: usize| crate::train::trainer::dpo_tests::with_held_out(kto_cfg(layout, steps, 1.0)?);
    let mut frozen = with_eval(Layout::single(), 2)?;
    frozen.schedule.peak = 0.0;
    let e = run(&frozen)?[0].metrics[1].eval_loss.expect("evaluated at step 2");
    assert!((e - 0.5).abs() < 1e-5, "held-out KTO loss of the reference itself: {e}");
    let (a, b) = (run(&with_eval(Layout::single(), 4)?)?, run(&with_eval(Layout::cp(CpKind::Zigzag, 2), 4)?)?);
    let (x, y) = (a[0].metrics[3].eval_loss.expect("step 4"), b[0].metrics[3].eval_loss.expect("step 4"));
    assert!((x - y).abs() < 1e-5 && (x - 0.5).abs() > 1e-4, "held-out {x} vs {y}");
    // the loss and the data must agree
    let mut bad = kto_cfg(Layout::single(), 2, 1.0)?;
    bad.dpo = Some(DpoConfig::default());
    assert!(run(&bad).unwrap_err().to_string().contains("train them by the kto, bco or apo_zero_unpaired loss"));
    let mut bad = kto_cfg(Layout::single(), 2, 1.0)?;
    bad.data = DataSource::Preference(PreferenceSet::read(&crate::train::dpo::tests::pairs_text(4, 1), &crate::train::sft::bytes_of, Some(2), None)?);
    assert!(run(&bad).unwrap_err().to_string().contains("are preference pairs"));
    Ok(())
}

/// APO-zero unpaired (the examples without KL documents, λ_U 1.5): step 1 costs 1/2 per
/// desirable example and 3/4 per undesirable one (the policy its own reference); the run
/// learns; zigzag CP 2 and ring CP 2 × DP 2 follow one device; the examples with their KL
/// documents are refused for it.
#[test]
fn apo_zero_unpaired_learns_and_matches_on_every_layout() -> Result<()> {
    let cfg = |layout: Layout, steps: usize| -> Result<TrainConfig> {
        let mut c = kto_cfg(layout, steps, 1.5)?;
        c.data = DataSource::Preference(kto_set()?.without_kl_documents()?);
        c.dpo = Some(DpoConfig { beta: 0.5, loss: DpoLoss::ApoZeroUnpaired, undesirable_weight: 1.5, ..DpoConfig::default() });
        Ok(c)
    };
    let c0 = cfg(Layout::single(), 12)?;
    let one = run(&c0)?;
    let m = &one[0].metrics;
    let DataSource::Preference(set) = &c0.data else { bail!("examples") };
    let rows = c0.data.preference_rows(c0.seed, 0, 0, c0.batch, c0.seq_len)?;
    let labels: Vec<bool> = rows.iter().flat_map(|(_, ids)| ids.iter().flatten().map(|&a| set.desirable().expect("labels")[a / 2])).collect();
    let want = labels.iter().map(|&d| if d { 0.5 } else { 0.75 }).sum::<f64>() / labels.len() as f64;
    assert!((m[0].train_loss - want).abs() < 1e-5 && m[0].kto_kl.is_none(), "step 1: {:?} vs {want}", m[0]);
    assert!(m.last().expect("steps").train_loss < m[0].train_loss - 0.05, "{:?}", m.iter().map(|x| x.train_loss).collect::<Vec<_>>());
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2)] {
        let mut c = cfg(layout, 12)?;
        c.stop_after = Some(4);
        let other = run(&c)?;
        assert_same_curve(&layout.to_string(), &want, &other[0].metrics);
        for (a, b) in want.iter().zip(&other[0].metrics) {
            assert!((a.train_loss - b.train_loss).abs() < 1e-5, "{layout} step {}: {} vs {}", a.step, a.train_loss, b.train_loss);
        }
    }
    let mut bad = cfg(Layout::single(), 2)?;
    bad.data = DataSource::Preference(kto_set()?);
    assert!(run(&bad).unwrap_err().to_string().contains("apo_zero_unpaired loss has no KL term"));
    Ok(())
}

/// Against a reference model of its own (another checkpoint) and λ_U = 1.5: step 1's loss and
/// KL estimate are KTO's over step 1's examples, computed by hand from the two models'
/// log-probabilities of every example and KL document (the KL estimate over the whole
/// micro-batch, positive here, so the clamp is not what makes them agree), on one device,
/// zigzag CP 2 and ring CP 2 × DP 2.
#[test]
fn kto_step1_by_hand_against_a_reference_model() -> Result<()> {
    use crate::train::kto::kto_terms;
    use crate::train::trainer::dpo_tests::logps_of;
    let dir = tmpdir("kto-ref-model");
    let c0 = kto_cfg(Layout::single(), 2, 1.5)?;
    let ModelSource::Init(mcfg) = &c0.model else { bail!("init model") };
    crate::save_hf(&dir, &crate::init_params(mcfg, 6, DType::F32, &Device::Cpu)?, mcfg)?;
    let DataSource::Preference(set) = &c0.data else { bail!("examples") };
    let (policy, reference) = (logps_of(mcfg, c0.seed, set, &c0)?, logps_of(mcfg, 6, set, &c0)?);
    let mut d = c0.dpo.clone().expect("kto");
    d.reference_model = Some(dir.clone());
    let step1 = crate::train::trainer::dpo_tests::step1_pairs(&c0)?;
    let labels: Vec<bool> = step1.iter().map(|&(e, _)| set.desirable().expect("labels")[e / 2]).collect();
    assert!(labels.contains(&true) && labels.contains(&false), "{labels:?}");
    let want = kto_terms(&policy, &reference, &step1, &labels, &d)?;
    let kl = want.kl.expect("kl");
    assert!(kl > 0.01, "the KL estimate of step 1 is clamped ({kl}): choose other seeds");
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2)] {
        let mut c = kto_cfg(layout, 2, 1.5)?;
        c.dpo = Some(d.clone());
        let got = &run(&c)?[0].metrics[0];
        assert!((got.train_loss - want.loss).abs() < 1e-5, "{layout}: step 1 {} vs by hand {}", got.train_loss, want.loss);
        assert!(got.kto_kl.is_some_and(|k| (k - kl).abs() < 1e-3 * kl.max(1.0)), "{layout}: KL {:?} vs by hand {kl}", got.kto_kl);
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
