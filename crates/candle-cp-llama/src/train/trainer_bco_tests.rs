//! Trainer tests of BCO ([`crate::train::bco`]): unpaired examples without KL documents, and
//! the `bco_pair` loss on preference pairs, both against a running mean reward δ.
use super::tests::{assert_same_curve, run, tiny_cfg, tmpdir};
use super::*;
use crate::train::bco::{bco_terms, Delta, RunningMean};
use crate::train::{DpoConfig, DpoLoss, PreferenceSet};
use crate::{CpKind, Layout, LlamaConfig};
use candle_core::DType;
use std::f64::consts::LN_2;
use std::path::PathBuf;

/// 12 byte-level pairs (`dpo_tests::pairs_text`): as pairs (`bco_pair`), or unpaired without
/// KL documents (BCO: each pair's chosen answer desirable, its rejected one not).
fn bco_set(loss: DpoLoss) -> Result<PreferenceSet> {
    let text = crate::train::dpo::tests::pairs_text(12, 11);
    match loss {
        DpoLoss::Bco => PreferenceSet::read_unpaired(&text, &crate::train::sft::bytes_of, Some(2), None)?.without_kl_documents(),
        _ => PreferenceSet::read(&text, &crate::train::sft::bytes_of, Some(2), None),
    }
}

/// A run of `loss` (BCO or bco_pair) for `steps` on `layout`: rows of 96 tokens, batch 2, β 0.5.
fn bco_cfg(out: Option<PathBuf>, layout: Layout, steps: usize, loss: DpoLoss) -> Result<TrainConfig> {
    let mut c = tiny_cfg(out, layout, 2, 1);
    (c.data, c.model, c.seq_len, c.steps) = (DataSource::Preference(bco_set(loss)?), ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1)), 96, steps);
    c.schedule.total = steps;
    c.dpo = Some(DpoConfig { beta: 0.5, loss, ..DpoConfig::default() });
    Ok(c)
}

/// Step 1 compares the policy with itself: every reward is 0, so δ = 0 and the loss is ln 2 per
/// example (BCO) or 2 ln 2 per pair (bco_pair); the run learns and δ moves; zigzag CP 2, ring
/// CP 2 × DP 2 (δ from both DP ranks' rows) and TP 2 + SP follow the single-device curve, δ
/// included; a run killed after step 4 and resumed from its step-3 checkpoint reads δ back and
/// reproduces the uninterrupted run; the data must suit the loss.
#[test]
fn bco_starts_at_ln2_learns_matches_on_every_layout_and_resumes() -> Result<()> {
    for (loss, start) in [(DpoLoss::Bco, LN_2), (DpoLoss::BcoPair, 2.0 * LN_2)] {
        let one = run(&bco_cfg(None, Layout::single(), 12, loss)?)?;
        let m = &one[0].metrics;
        assert!((m[0].train_loss - start).abs() < 1e-5, "{loss:?} step 1: {}", m[0].train_loss);
        assert!(m[0].bco_delta.is_some_and(|d| d.abs() < 1e-5) && m[0].kto_kl.is_none(), "{:?}", m[0]);
        let last = m.last().expect("steps");
        assert!(last.train_loss < start - 0.05, "{loss:?}: {:?}", m.iter().map(|x| x.train_loss).collect::<Vec<_>>());
        assert!(last.dpo_accuracy.is_some_and(|a| a > 0.5) && last.bco_delta.is_some_and(|d| d.abs() > 1e-3), "{loss:?}: {last:?}");
        let want: Vec<&StepMetrics> = m[..4].iter().collect();
        for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::single().with_tp(2, true)] {
            let mut c = bco_cfg(None, layout, 12, loss)?;
            c.stop_after = Some(4);
            let other = run(&c)?;
            assert_same_curve(&format!("{loss:?} {layout}"), &want, &other[0].metrics);
            for (a, b) in want.iter().zip(&other[0].metrics) {
                let (da, db) = (a.bco_delta.expect("delta"), b.bco_delta.expect("delta"));
                assert!((a.train_loss - b.train_loss).abs() < 1e-5 && (da - db).abs() < 1e-5, "{loss:?} {layout} step {}: {} / δ {da} vs {} / δ {db}", a.step, a.train_loss, b.train_loss);
            }
        }
    }
    // resumed: δ from the step-3 checkpoint (from 0 it would be step 4's mean alone)
    let layout = Layout::cp(CpKind::Zigzag, 2);
    let (da, db) = (tmpdir("bco-a"), tmpdir("bco-b"));
    let a = run(&bco_cfg(Some(da.clone()), layout, 6, DpoLoss::Bco)?)?;
    let mut cb = bco_cfg(Some(db.clone()), layout, 6, DpoLoss::Bco)?;
    cb.stop_after = Some(4);
    run(&cb)?;
    let st = TrainState::load(db.join("checkpoints").join(super::super::checkpoint::checkpoint_name(3)).join("train_state.json"))?;
    let at3 = st.bco_mean.expect("δ in the checkpoint");
    assert!((at3.mean - a[0].metrics[2].bco_delta.expect("delta")).abs() < 1e-15 && (at3.count - 3.0).abs() < 1e-9, "{at3:?}");
    (cb.stop_after, cb.resume) = (None, true);
    let b = run(&cb)?;
    assert_eq!(b[0].start_step, 3);
    let tail = |m: &[StepMetrics]| -> Vec<(usize, f64, Option<f64>)> { m.iter().map(|m| (m.step, m.train_loss, m.bco_delta)).collect() };
    assert_eq!(tail(&a[0].metrics[3..]), tail(&b[0].metrics));
    std::fs::remove_dir_all(&da)?;
    std::fs::remove_dir_all(&db)?;
    // the data must suit the loss
    let err = |c: &TrainConfig| run(c).map(|_| ()).unwrap_err().to_string();
    let mut bad = bco_cfg(None, Layout::single(), 2, DpoLoss::Bco)?;
    bad.data = DataSource::Preference(PreferenceSet::read_unpaired(&crate::train::dpo::tests::pairs_text(4, 1), &crate::train::sft::bytes_of, Some(2), None)?);
    assert!(err(&bad).contains("without_kl_documents"), "{}", err(&bad));
    bad.dpo = Some(DpoConfig { loss: DpoLoss::Kto, ..DpoConfig::default() });
    bad.data = DataSource::Preference(bco_set(DpoLoss::Bco)?);
    assert!(err(&bad).contains("the kto loss needs"), "{}", err(&bad));
    let mut bad = bco_cfg(None, Layout::single(), 2, DpoLoss::BcoPair)?;
    bad.data = DataSource::Preference(bco_set(DpoLoss::Bco)?);
    assert!(err(&bad).contains("train them by the kto, bco or apo_zero_unpaired loss"), "{}", err(&bad));
    Ok(())
}

/// Against a reference model of its own (another checkpoint): step 1's loss and δ are BCO's
/// (and bco_pair's) over step 1's micro-batch, computed by hand from the two models'
/// log-probabilities of every answer (δ the micro-batch's mean reward, away from 0 here), on
/// one device, zigzag CP 2 and ring CP 2 × DP 2 (δ over both DP ranks' rows).
#[test]
fn bco_step1_by_hand_against_a_reference_model() -> Result<()> {
    use crate::train::trainer::dpo_tests::logps_of;
    let dir = tmpdir("bco-ref-model");
    for loss in [DpoLoss::Bco, DpoLoss::BcoPair] {
        let c0 = bco_cfg(None, Layout::single(), 2, loss)?;
        let ModelSource::Init(mcfg) = &c0.model else { bail!("init model") };
        crate::save_hf(&dir, &crate::init_params(mcfg, 6, DType::F32, &Device::Cpu)?, mcfg)?;
        let DataSource::Preference(set) = &c0.data else { bail!("examples") };
        let (policy, reference) = (logps_of(mcfg, c0.seed, set, &c0)?, logps_of(mcfg, 6, set, &c0)?);
        let mut d = c0.dpo.clone().expect("bco");
        d.reference_model = Some(dir.clone());
        let rows = c0.data.preference_rows(c0.seed, 0, 0, c0.batch, c0.seq_len)?;
        let ids: Vec<usize> = rows.iter().flat_map(|(_, ids)| ids.iter().flatten().copied()).collect();
        let (step1, labels): (Vec<(usize, usize)>, Option<Vec<bool>>) = match loss {
            DpoLoss::Bco => (ids.iter().map(|&a| (a, a)).collect(), Some(ids.iter().map(|&a| set.desirable().expect("labels")[a / 2]).collect())),
            _ => (ids.iter().filter(|&&a| a % 2 == 0).map(|&a| (a, a + 1)).collect(), None),
        };
        let want = bco_terms(&policy, &reference, &set.scored_lengths(), &step1, labels.as_deref(), Delta::Update(&mut RunningMean::default()), &d)?;
        let delta = want.delta.expect("delta");
        assert!(delta.abs() > 0.01, "{loss:?}: δ of step 1 is {delta}: choose other seeds");
        for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2)] {
            let mut c = bco_cfg(None, layout, 2, loss)?;
            c.dpo = Some(d.clone());
            let got = &run(&c)?[0].metrics[0];
            assert!((got.train_loss - want.loss).abs() < 1e-5, "{loss:?} {layout}: step 1 {} vs by hand {}", got.train_loss, want.loss);
            assert!(got.bco_delta.is_some_and(|x| (x - delta).abs() < 1e-4 * delta.abs().max(1.0)), "{loss:?} {layout}: δ {:?} vs by hand {delta}", got.bco_delta);
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// MPO's mix (sigmoid 0.8 + bco_pair 0.2 + sft 1) and aot_pair: step 1's objective is the mix
/// over step 1's pairs by hand (the policy its own reference: `1.2·ln 2` plus the chosen
/// answers' cross-entropy), δ included; zigzag CP 2, ring CP 2 × DP 2 (aot_pair sorts over
/// both DP ranks' pairs) and TP 2 + SP follow the single-device curve.
#[test]
fn mixed_losses_and_aot_match_on_every_layout() -> Result<()> {
    use crate::train::dpo::mixed_terms;
    use crate::train::trainer::dpo_tests::logps_of;
    let mpo = vec![(DpoLoss::Sigmoid, 0.8), (DpoLoss::BcoPair, 0.2), (DpoLoss::Sft, 1.0)];
    for (loss, mix) in [(DpoLoss::Sigmoid, mpo), (DpoLoss::AotPair, Vec::new())] {
        let cfg = |layout: Layout| -> Result<TrainConfig> {
            let mut c = bco_cfg(None, layout, 4, DpoLoss::BcoPair)?;
            c.dpo = Some(DpoConfig { beta: 0.5, loss, mix: mix.clone(), ..DpoConfig::default() });
            Ok(c)
        };
        let c0 = cfg(Layout::single())?;
        let one = run(&c0)?;
        let m = &one[0].metrics;
        if !mix.is_empty() {
            let ModelSource::Init(mcfg) = &c0.model else { bail!("init model") };
            let DataSource::Preference(set) = &c0.data else { bail!("pairs") };
            let policy = logps_of(mcfg, c0.seed, set, &c0)?;
            let step1 = crate::train::trainer::dpo_tests::step1_pairs(&c0)?;
            let want = mixed_terms(&policy, &policy, &set.scored_lengths(), &step1, c0.dpo.as_ref().expect("dpo"), Some(Delta::Update(&mut RunningMean::default())))?;
            let tokens: f64 = step1.iter().map(|&(c, _)| set.scored_lengths()[c]).sum();
            let chosen_ce = -step1.iter().map(|&(c, _)| policy[c]).sum::<f64>() / tokens;
            assert!((want.loss - 1.2 * LN_2 - chosen_ce).abs() < 1e-9, "{want:?}");
            assert!((m[0].train_loss - want.loss).abs() < 1e-5 && m[0].bco_delta.is_some_and(|d| d.abs() < 1e-5), "step 1 {:?} vs by hand {}", m[0], want.loss);
        } else {
            assert!((m[0].train_loss - LN_2).abs() < 1e-5 && m[0].bco_delta.is_none(), "{:?}", m[0]);
        }
        assert!(m[3].train_loss < m[0].train_loss, "{loss:?} {mix:?}: {:?}", m.iter().map(|x| x.train_loss).collect::<Vec<_>>());
        let want: Vec<&StepMetrics> = m.iter().collect();
        for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::single().with_tp(2, true)] {
            let other = run(&cfg(layout)?)?;
            assert_same_curve(&format!("{loss:?} {mix:?} {layout}"), &want, &other[0].metrics);
            for (a, b) in want.iter().zip(&other[0].metrics) {
                assert!((a.train_loss - b.train_loss).abs() < 1e-5, "{loss:?} {layout} step {}: {} vs {}", a.step, a.train_loss, b.train_loss);
            }
        }
    }
    Ok(())
}
