//! Trainer tests of DPO ([`crate::train::dpo`]) on preference pairs.
use super::tests::{assert_same_curve, run, tiny_cfg, tmpdir};
use super::*;
use crate::train::{DpoConfig, PreferenceSet};
use crate::{CpKind, Layout, LlamaConfig};
use candle_core::DType;
use std::path::PathBuf;

/// A DPO run of `steps` on `layout`: 16 byte-level pairs (`dpo_tests::pairs_text`), rows of
/// 96 tokens, β 0.5.
pub(super) fn dpo_cfg(out: Option<PathBuf>, layout: Layout, steps: usize) -> Result<TrainConfig> {
    let set = PreferenceSet::read(&crate::train::dpo::tests::pairs_text(16, 11), &crate::train::sft::bytes_of, Some(2), None)?;
    let mut c = tiny_cfg(out, layout, 2, 1);
    (c.data, c.model, c.seq_len, c.steps) = (DataSource::Preference(set), ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1)), 96, steps);
    c.schedule.total = steps;
    c.dpo = Some(DpoConfig { beta: 0.5, ..DpoConfig::default() });
    Ok(c)
}

/// Step 1 compares the policy with itself (the reference is the starting model): loss ln 2,
/// margin 0; the run learns (the loss falls below ln 2, most pairs ranked right); zigzag CP 2,
/// ring CP 2 × DP 2 and TP 2 + SP follow the single-device curve, objective included.
#[test]
fn dpo_starts_at_ln2_learns_and_matches_on_every_layout() -> Result<()> {
    let one = run(&dpo_cfg(None, Layout::single(), 12)?)?;
    let m = &one[0].metrics;
    assert!((m[0].train_loss - std::f64::consts::LN_2).abs() < 1e-5, "step 1: {}", m[0].train_loss);
    assert!(m[0].dpo_margin.is_some_and(|x| x.abs() < 1e-4), "{:?}", m[0].dpo_margin);
    let last = m.last().expect("steps");
    assert!(last.train_loss < std::f64::consts::LN_2 - 0.05, "step 12: {}", last.train_loss);
    assert!(last.dpo_accuracy.is_some_and(|a| a > 0.5) && last.dpo_margin.is_some_and(|x| x > 0.0), "{last:?}");
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    follows_on_layouts("DPO", &want, |layout| {
        let mut c = dpo_cfg(None, layout, 12)?;
        c.stop_after = Some(4);
        Ok(c)
    })?;
    // the settings' errors
    let mut bad = dpo_cfg(None, Layout::single(), 2)?;
    bad.seq_len = 8;
    assert!(run(&bad).unwrap_err().to_string().contains("never cut"));
    let mut bad = dpo_cfg(None, Layout::single(), 2)?;
    bad.dpo = None;
    assert!(run(&bad).unwrap_err().to_string().contains("train by DPO"));
    Ok(())
}

/// `want` (a single-device run's steps) against the same run on zigzag CP 2, ring CP 2 × DP 2
/// and TP 2 + SP (`cfg` of each layout): the curve ([`assert_same_curve`]), the objective to
/// 1e-5 and the held-out loss where evaluated.
pub(super) fn follows_on_layouts(what: &str, want: &[&StepMetrics], cfg: impl Fn(Layout) -> Result<TrainConfig>) -> Result<()> {
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::single().with_tp(2, true)] {
        let other = run(&cfg(layout)?)?;
        assert_same_curve(&layout.to_string(), want, &other[0].metrics);
        for (a, b) in want.iter().zip(&other[0].metrics) {
            assert!((a.train_loss - b.train_loss).abs() < 1e-5, "{layout} step {}: {what} loss {} vs {}", a.step, a.train_loss, b.train_loss);
            assert_eq!(a.eval_loss.is_some(), b.eval_loss.is_some(), "{layout} step {}", a.step);
            if let (Some(x), Some(y)) = (a.eval_loss, b.eval_loss) {
                assert!((x - y).abs() < 1e-5, "{layout} step {}: {what} held-out {x} vs {y}", a.step);
            }
        }
    }
    Ok(())
}

/// `c` with the last quarter of its preference data held out, evaluated every 2 steps.
pub(super) fn with_held_out(mut c: TrainConfig) -> Result<TrainConfig> {
    let (train, held) = c.data.split_held_out(0.25, c.seq_len)?;
    c.data = train;
    c.eval = Some(crate::train::EvalConfig { data: held, every: 2, batches: 1 });
    Ok(c)
}

/// A DPO run killed after step 4 and resumed from its step-3 checkpoint reads the reference
/// its first start wrote and reproduces the uninterrupted run.
#[test]
fn resumed_dpo_reads_its_reference() -> Result<()> {
    let layout = Layout::cp(CpKind::Zigzag, 2);
    let (da, db) = (tmpdir("dpo-a"), tmpdir("dpo-b"));
    let a = run(&dpo_cfg(Some(da.clone()), layout, 6)?)?;
    let mut cb = dpo_cfg(Some(db.clone()), layout, 6)?;
    cb.stop_after = Some(4);
    run(&cb)?;
    assert!(db.join("dpo_reference.json").exists());
    (cb.stop_after, cb.resume) = (None, true);
    let b = run(&cb)?;
    assert_eq!(b[0].start_step, 3);
    let tail: Vec<(usize, f64)> = a[0].metrics[3..].iter().map(|m| (m.step, m.train_loss)).collect();
    assert_eq!(tail, b[0].metrics.iter().map(|m| (m.step, m.train_loss)).collect::<Vec<_>>());
    std::fs::remove_dir_all(&da)?;
    std::fs::remove_dir_all(&db)?;
    Ok(())
}

/// Held-out pairs: every evaluation reports their DPO loss (ln 2 for the starting model,
/// whose log-probabilities are the reference) and reward accuracy, the same on zigzag CP 2 as
/// on one device; held-out data that is not preference pairs is refused.
#[test]
fn held_out_pairs_are_evaluated_on_every_layout() -> Result<()> {
    let with_eval = |layout: Layout, steps: usize| with_held_out(dpo_cfg(None, layout, steps)?);
    // (zero steps of learning: the evaluation of the starting model)
    let mut frozen = with_eval(Layout::single(), 2)?;
    frozen.schedule.peak = 0.0;
    let f = run(&frozen)?;
    let e = f[0].metrics[1].eval_loss.expect("evaluated at step 2");
    assert!((e - std::f64::consts::LN_2).abs() < 1e-5, "held-out DPO loss of the reference itself: {e}");
    let one = run(&with_eval(Layout::single(), 6)?)?;
    let cp = run(&with_eval(Layout::cp(CpKind::Zigzag, 2), 6)?)?;
    for (a, b) in one[0].metrics.iter().zip(&cp[0].metrics) {
        assert_eq!(a.eval_loss.is_some(), a.step % 2 == 0, "step {}", a.step);
        assert_eq!(a.eval_loss.is_some(), a.eval_dpo_accuracy.is_some());
        if let (Some(x), Some(y)) = (a.eval_loss, b.eval_loss) {
            assert!((x - y).abs() < 1e-5, "step {}: held-out {x} vs {y}", a.step);
            assert_eq!(a.eval_dpo_accuracy, b.eval_dpo_accuracy);
        }
    }
    assert!(one[0].metrics[5].eval_loss.is_some_and(|x| x.is_finite() && (x - std::f64::consts::LN_2).abs() > 1e-4));
    let mut bad = with_eval(Layout::single(), 2)?;
    bad.eval = Some(crate::train::EvalConfig { data: DataSource::Recall(crate::train::KvRecall::new(96)?), every: 1, batches: 1 });
    assert!(run(&bad).unwrap_err().to_string().contains("held-out data must be preference pairs"));
    Ok(())
}

/// SimPO with RPO's term: no reference pass (no reference file written), step 1's loss is
/// `softplus(γ − β·h̄) + α·CE(chosen)` of the starting model, not ln 2; zigzag CP 2 follows the
/// single-device curve.
#[test]
fn simpo_with_rpo_needs_no_reference_and_matches_on_cp() -> Result<()> {
    let cfg = |out: Option<PathBuf>, layout: Layout| -> Result<TrainConfig> {
        let mut c = dpo_cfg(out, layout, 4)?;
        c.dpo = Some(DpoConfig { beta: 2.0, loss: crate::train::DpoLoss::Simpo, simpo_gamma: 0.5, rpo_alpha: 0.5, ..DpoConfig::default() });
        Ok(c)
    };
    let dir = tmpdir("simpo");
    let one = run(&cfg(Some(dir.clone()), Layout::single())?)?;
    assert!(!dir.join("dpo_reference.json").exists());
    let m = &one[0].metrics;
    assert!((m[0].train_loss - std::f64::consts::LN_2).abs() > 0.1 && m[3].train_loss < m[0].train_loss, "{:?}", m.iter().map(|x| x.train_loss).collect::<Vec<_>>());
    let cp = run(&cfg(None, Layout::cp(CpKind::Zigzag, 2))?)?;
    for (a, b) in m.iter().zip(&cp[0].metrics) {
        assert!((a.train_loss - b.train_loss).abs() < 1e-5, "step {}: {} vs {}", a.step, a.train_loss, b.train_loss);
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Every answer's log-probability of `set` under the model `mcfg` drawn from `seed`, on one
/// device, in rows of `c`'s batch and sequence length ([`crate::train::dpo::answer_logps`]).
pub(super) fn logps_of(mcfg: &LlamaConfig, seed: u64, set: &PreferenceSet, c: &TrainConfig) -> Result<Vec<f64>> {
    Ok(policy_of(mcfg, seed, set, c, &DpoConfig::default())?.plain)
}

/// [`logps_of`] with what `d` reads of the policy besides ([`crate::train::dpo::policy_logps`]).
pub(super) fn policy_of(mcfg: &LlamaConfig, seed: u64, set: &PreferenceSet, c: &TrainConfig, d: &DpoConfig) -> Result<crate::train::dpo::PolicyLogps> {
    let out = candle_cp_comm::run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = crate::shard_params(&crate::init_params(mcfg, seed, DType::F32, &Device::Cpu)?, mcfg, &ctx)?;
        let m = Llama::new(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), mcfg, &ctx)?;
        crate::train::dpo::policy_logps(&m, set, c.batch, c.seq_len, d, &ctx, &Device::Cpu)
    });
    out.into_iter().next().expect("one rank")
}

/// The pairs of step 1's rows of `c` (its first micro-batch), as (chosen, rejected) answers.
pub(super) fn step1_pairs(c: &TrainConfig) -> Result<Vec<(usize, usize)>> {
    let rows = c.data.preference_rows(c.seed, 0, 0, c.batch, c.seq_len)?;
    Ok(rows.iter().flat_map(|(_, ids)| ids.iter().flatten().filter(|&&a| a % 2 == 0).map(|&a| (a, a + 1))).collect())
}

/// A reference model of its own (another checkpoint): step 1's loss is DPO's between the
/// starting policy and that model, computed from the two models' answer log-probabilities by
/// hand, on one device and on zigzag CP 2; a reference-free loss refuses one. Reference-free
/// DPO with RPO's α 1 (CPO): no reference file, step 1 by hand from the policy's alone.
#[test]
fn a_reference_model_of_its_own() -> Result<()> {
    use crate::train::dpo::dpo_terms;
    let dir = tmpdir("dpo-ref-model");
    let c0 = dpo_cfg(None, Layout::single(), 2)?;
    let ModelSource::Init(mcfg) = &c0.model else { bail!("init model") };
    crate::save_hf(&dir, &crate::init_params(mcfg, 99, DType::F32, &Device::Cpu)?, mcfg)?;
    let DataSource::Preference(set) = &c0.data else { bail!("pairs") };
    // the answers' log-probabilities under the policy (seed c0.seed) and the reference (seed 99)
    let (policy, reference) = (logps_of(mcfg, c0.seed, set, &c0)?, logps_of(mcfg, 99, set, &c0)?);
    let d = DpoConfig { beta: 0.5, reference_model: Some(dir.clone()), ..DpoConfig::default() };
    let pairs: Vec<(usize, usize)> = (0..set.len()).map(|p| (2 * p, 2 * p + 1)).collect();
    let all = dpo_terms(&policy, &reference, &set.scored_lengths(), &pairs, &d)?;
    assert!((all.loss - std::f64::consts::LN_2).abs() > 1e-3, "{}", all.loss);
    // step 1's rows: the pairs of its batch
    let step1 = step1_pairs(&c0)?;
    let want = dpo_terms(&policy, &reference, &set.scored_lengths(), &step1, &d)?.loss;
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2)] {
        let mut c = dpo_cfg(None, layout, 2)?;
        c.dpo = Some(d.clone());
        let got = run(&c)?[0].metrics[0].train_loss;
        assert!((got - want).abs() < 1e-5, "{layout}: step 1 {got} vs by hand {want}");
    }
    let mut bad = dpo_cfg(None, Layout::single(), 2)?;
    bad.dpo = Some(DpoConfig { loss: crate::train::DpoLoss::Simpo, ..d.clone() });
    assert!(run(&bad).unwrap_err().to_string().contains("takes no reference model"));
    bad.dpo = Some(DpoConfig { reference_free: true, ..d.clone() });
    assert!(run(&bad).unwrap_err().to_string().contains("reference_free and a reference model"));
    // reference-free with RPO's α 1 (CPO): no reference pass; step 1 by hand from the policy's
    // log-probabilities against zeros, plus the chosen answers' mean cross-entropy
    let cpo = DpoConfig { beta: 0.5, reference_free: true, rpo_alpha: 1.0, ..DpoConfig::default() };
    let want = dpo_terms(&policy, &vec![0.0; policy.len()], &set.scored_lengths(), &step1, &cpo)?.loss;
    let by_formula: f64 = step1.iter().map(|&(c, r)| (1.0 + (-0.5 * (policy[c] - policy[r])).exp()).ln()).sum::<f64>() / step1.len() as f64
        - step1.iter().map(|&(c, _)| policy[c]).sum::<f64>() / step1.iter().map(|&(c, _)| set.scored_lengths()[c]).sum::<f64>();
    assert!((want - by_formula).abs() < 1e-9, "{want} vs {by_formula}");
    let out = tmpdir("cpo");
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2)] {
        let mut c = dpo_cfg(Some(out.clone()), layout, 2)?;
        c.dpo = Some(cpo.clone());
        let got = run(&c)?[0].metrics[0].train_loss;
        assert!((got - want).abs() < 1e-5, "{layout}: CPO step 1 {got} vs by hand {want}");
        assert!(!out.join("dpo_reference.json").exists());
    }
    std::fs::remove_dir_all(&out)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// LD-DPO (α 0.3, pairs of unequal lengths): step 1's loss is DPO's between the starting
/// policy's weighted sums and its plain sums (the reference, unweighted), computed by hand from
/// [`crate::train::dpo::policy_logps`]; zigzag CP 2, ring CP 2 × DP 2 and TP 2 + SP follow
/// the single-device curve, held-out evaluations (weighted the same) included; the run learns.
#[test]
fn ld_dpo_matches_by_hand_and_on_every_layout() -> Result<()> {
    use crate::train::dpo::dpo_terms;
    let set = PreferenceSet::read(&crate::train::dpo::tests::ld_dpo_tests::unequal_pairs_text(16, 11), &crate::train::sft::bytes_of, Some(2), None)?;
    let d = DpoConfig { beta: 0.5, ld_alpha: Some(0.3), ..DpoConfig::default() };
    let cfg = |layout: Layout, steps: usize| -> Result<TrainConfig> {
        let mut c = dpo_cfg(None, layout, steps)?;
        (c.data, c.dpo) = (DataSource::Preference(set.clone()), Some(d.clone()));
        Ok(c)
    };
    let c0 = with_held_out(cfg(Layout::single(), 8)?)?;
    let ModelSource::Init(mcfg) = &c0.model else { bail!("init model") };
    let DataSource::Preference(train) = &c0.data else { bail!("pairs") };
    let crate::train::dpo::PolicyLogps { plain, ld: weighted, .. } = policy_of(mcfg, c0.seed, train, &c0, &d)?;
    let step1 = step1_pairs(&c0)?;
    let want = dpo_terms(&weighted.expect("weighted sums"), &plain, &train.scored_lengths(), &step1, &DpoConfig { ld_alpha: None, ..d.clone() })?.loss;
    assert!((want - std::f64::consts::LN_2).abs() > 1e-3, "{want}");
    let one = run(&c0)?;
    let m = &one[0].metrics;
    assert!((m[0].train_loss - want).abs() < 1e-5, "step 1 {} vs by hand {want}", m[0].train_loss);
    assert!(m[7].train_loss < m[0].train_loss - 0.05, "{:?}", m.iter().map(|x| x.train_loss).collect::<Vec<_>>());
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    follows_on_layouts("LD-DPO", &want, |layout| {
        let mut c = with_held_out(cfg(layout, 8)?)?;
        c.stop_after = Some(4);
        Ok(c)
    })
}

/// WPO (with RPO's α 0.3): step 1's loss is `mean(w)·(ln 2 + α·CE)` — the policy is its
/// reference — with the weights from [`crate::train::dpo::policy_logps`]'s means by hand; zigzag
/// CP 2, ring CP 2 × DP 2 and TP 2 + SP (the head split by vocabulary: its `log Σ p²` merged
/// over TP) follow the single-device curve, held-out evaluations (weighted the same) included.
#[test]
fn wpo_matches_by_hand_and_on_every_layout() -> Result<()> {
    let d = DpoConfig { beta: 0.5, rpo_alpha: 0.3, use_weighting: true, ..DpoConfig::default() };
    let cfg = |layout: Layout, steps: usize| -> Result<TrainConfig> {
        let mut c = dpo_cfg(None, layout, steps)?;
        c.dpo = Some(d.clone());
        with_held_out(c)
    };
    let c0 = cfg(Layout::single(), 8)?;
    let ModelSource::Init(mcfg) = &c0.model else { bail!("init model") };
    let DataSource::Preference(train) = &c0.data else { bail!("pairs") };
    let p = policy_of(mcfg, c0.seed, train, &c0, &d)?;
    let means = p.wpo.expect("WPO's means");
    let step1 = step1_pairs(&c0)?;
    let w: Vec<f64> = step1.iter().map(|&(c, r)| (means[c] + means[r]).exp().min(1.0)).collect();
    let w_mean = w.iter().sum::<f64>() / w.len() as f64;
    let lengths = train.scored_lengths();
    let ce = -step1.iter().map(|&(c, _)| p.plain[c]).sum::<f64>() / step1.iter().map(|&(c, _)| lengths[c]).sum::<f64>();
    let want = w_mean * (std::f64::consts::LN_2 + 0.3 * ce);
    assert!(w_mean < 0.99, "{w:?}");
    let one = run(&c0)?;
    let m = &one[0].metrics;
    assert!((m[0].train_loss - want).abs() < 1e-5, "step 1 {} vs by hand {want}", m[0].train_loss);
    assert!(m[7].train_loss < m[0].train_loss, "{:?}", m.iter().map(|x| x.train_loss).collect::<Vec<_>>());
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    follows_on_layouts("WPO", &want, |layout| {
        let mut c = cfg(layout, 8)?;
        c.stop_after = Some(4);
        Ok(c)
    })
}

/// TR-DPO: with α 1 every 2 steps the reference is the policy after steps 2 and 4, so steps 3
/// and 5 start from DPO's ln 2 with margin 0 while the others do not; with α 0.5 zigzag CP 2,
/// ring CP 2 × DP 2 with ZeRO-1 (the update after the step's gathers) and TP 2 + SP follow the
/// single-device curve, held-out evaluations (against the updated reference) included; a run
/// killed after step 4 and resumed from its step-3 checkpoint (the reference of step 2 read
/// back from it) reproduces the straight run; LoRA and a reference-free loss are refused.
#[test]
fn tr_dpo_syncs_its_reference_on_every_layout_and_resumes() -> Result<()> {
    use crate::train::dpo_config::RefSync;
    let with = |out: Option<PathBuf>, layout: Layout, alpha: f64| -> Result<TrainConfig> {
        let mut c = dpo_cfg(out, layout, 6)?;
        c.dpo = Some(DpoConfig { beta: 0.5, sync_ref_model: Some(RefSync { every: 2, alpha }), ..DpoConfig::default() });
        with_held_out(c)
    };
    let hard = run(&with(None, Layout::single(), 1.0)?)?;
    for m in &hard[0].metrics {
        let synced = m.step > 1 && (m.step - 1) % 2 == 0;
        let at_ln2 = (m.train_loss - std::f64::consts::LN_2).abs() < 1e-5 && m.dpo_margin.is_some_and(|x| x.abs() < 1e-5);
        assert_eq!(at_ln2, m.step == 1 || synced, "step {}: {} margin {:?}", m.step, m.train_loss, m.dpo_margin);
        // (the held-out pairs against the reference just synced: the policy itself)
        if m.step % 2 == 0 {
            assert!(m.eval_loss.is_some_and(|x| (x - std::f64::consts::LN_2).abs() < 1e-5), "step {}: held-out {:?}", m.step, m.eval_loss);
        }
    }
    let one = run(&with(None, Layout::single(), 0.5)?)?;
    let m = &one[0].metrics;
    assert!((m[2].train_loss - std::f64::consts::LN_2).abs() > 1e-4, "α 0.5: step 3 {}", m[2].train_loss);
    let want: Vec<&StepMetrics> = m.iter().collect();
    follows_on_layouts("TR-DPO", &want, |layout| {
        let mut c = with(None, layout, 0.5)?;
        c.zero1 = layout.dp > 1;
        Ok(c)
    })?;
    // killed after step 4, resumed from step 3's checkpoint
    let layout = Layout::cp(CpKind::Zigzag, 2);
    let (da, db) = (tmpdir("trdpo-a"), tmpdir("trdpo-b"));
    let a = run(&with(Some(da.clone()), layout, 0.5)?)?;
    let mut cb = with(Some(db.clone()), layout, 0.5)?;
    cb.stop_after = Some(4);
    run(&cb)?;
    assert!(db.join("checkpoints").join(crate::train::checkpoint::checkpoint_name(3)).join("reference").join("config.json").exists());
    (cb.stop_after, cb.resume) = (None, true);
    let b = run(&cb)?;
    assert_eq!(b[0].start_step, 3);
    for (x, y) in a[0].metrics[3..].iter().zip(&b[0].metrics) {
        assert!(x.step == y.step && (x.train_loss - y.train_loss).abs() < 1e-6, "step {}: straight {} vs resumed {}", x.step, x.train_loss, y.train_loss);
    }
    std::fs::remove_dir_all(&da)?;
    std::fs::remove_dir_all(&db)?;
    // the refusals
    let mut bad = with(None, Layout::single(), 0.5)?;
    bad.lora = Some(crate::LoraSpec::new(2, 8.0, &["q_proj"])?);
    assert!(run(&bad).unwrap_err().to_string().contains("LoRA run's reference"));
    let mut bad = with(None, Layout::single(), 0.5)?;
    bad.dpo = Some(DpoConfig { loss: crate::train::DpoLoss::Simpo, sync_ref_model: Some(RefSync::default()), ..DpoConfig::default() });
    assert!(run(&bad).unwrap_err().to_string().contains("has none"));
    Ok(())
}
