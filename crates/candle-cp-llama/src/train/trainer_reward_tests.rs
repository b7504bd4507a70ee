//! Trainer tests of reward models ([`crate::train::reward`]) on preference pairs.
use super::dpo_tests::{dpo_cfg, follows_on_layouts, with_held_out};
use super::tests::{run, tmpdir};
use super::*;
use crate::train::RewardConfig;
use crate::Layout;
use std::path::PathBuf;

/// DPO's run (16 byte-level pairs, rows of 96 tokens) as a reward model's, with centring.
fn reward_cfg(out: Option<PathBuf>, layout: Layout, steps: usize) -> Result<TrainConfig> {
    let mut c = dpo_cfg(out, layout, steps)?;
    c.dpo = None;
    c.reward = Some(RewardConfig { center_rewards_coefficient: 0.01 });
    Ok(c)
}

/// A reward model learns the pairs (the loss falls below ln 2, most pairs ranked right, the
/// held-out pairs evaluated); zigzag CP 2, ring CP 2 × DP 2 and TP 2 + SP follow the
/// single-device curve (loss, gradient norm, held-out loss); the checkpoint is a
/// `LlamaForSequenceClassification` that loads as a reward model; refusals.
#[test]
fn reward_model_learns_and_matches_on_every_layout() -> Result<()> {
    let out = tmpdir("reward");
    let one = run(&with_held_out(reward_cfg(Some(out.clone()), Layout::single(), 12)?)?)?;
    let m = &one[0].metrics;
    let last = m.last().expect("steps");
    assert!(m[0].train_loss > 0.5 && last.train_loss < std::f64::consts::LN_2 - 0.1, "{} → {}", m[0].train_loss, last.train_loss);
    let late: f64 = m[8..].iter().map(|s| s.dpo_accuracy.unwrap_or(0.0)).sum::<f64>() / 4.0;
    assert!(late > 0.6 && last.dpo_margin.is_some_and(|x| x > 0.0) && last.eval_dpo_accuracy.is_some_and(|a| a > 0.5), "accuracy {late}: {last:?}");
    assert!(m[1].eval_loss.is_some() && m[1].eval_dpo_accuracy.is_some() && m[0].eval_loss.is_none(), "{:?}", m[1]);
    assert!((last.loss - last.train_loss).abs() < 1e-12, "the reported loss is the objective");
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    follows_on_layouts("reward", &want, |layout| {
        let mut c = with_held_out(reward_cfg(None, layout, 12)?)?;
        c.stop_after = Some(4);
        Ok(c)
    })?;
    // the checkpoint: a sequence classifier transformers reads, and a reward model here
    let ck = crate::train::checkpoint::latest_checkpoint(out.join("checkpoints"))?.expect("a checkpoint");
    let cfg = crate::LlamaConfig::from_file(ck.join("config.json"))?;
    assert_eq!((cfg.num_labels, cfg.arch().hf_class(cfg.num_labels)), (Some(1), "LlamaForSequenceClassification".to_string()));
    let mut more = reward_cfg(None, Layout::single(), 2)?;
    more.model = ModelSource::Hf(ck.clone());
    let again = run(&more)?;
    assert!(again[0].metrics[0].train_loss < m[0].train_loss, "from the trained reward model: {} vs {}", again[0].metrics[0].train_loss, m[0].train_loss);
    // a reward model trains by its own loss only; a causal run refuses a reward model
    let mut lm = reward_cfg(None, Layout::single(), 2)?;
    (lm.model, lm.reward, lm.dpo) = (ModelSource::Hf(ck), None, Some(crate::train::DpoConfig::default()));
    assert!(run(&lm).unwrap_err().to_string().contains("is a reward model"));
    let mut both = reward_cfg(None, Layout::single(), 2)?;
    both.dpo = Some(crate::train::DpoConfig::default());
    assert!(run(&both).unwrap_err().to_string().contains("not with dpo"));
    let mut bad = reward_cfg(None, Layout::single(), 2)?;
    bad.eval = Some(crate::train::EvalConfig { data: DataSource::Recall(crate::train::KvRecall::new(96)?), every: 1, batches: 1 });
    assert!(run(&bad).unwrap_err().to_string().contains("held-out data must be preference pairs"));
    let mut recall = reward_cfg(None, Layout::single(), 2)?;
    recall.data = DataSource::Recall(crate::train::KvRecall::new(96)?);
    assert!(run(&recall).unwrap_err().to_string().contains("trains on preference pairs"));
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// A reward run killed after step 4 and resumed from its step-3 checkpoint (a sequence
/// classifier's) reproduces the uninterrupted run, on zigzag CP 2.
#[test]
fn resumed_reward_run_is_the_straight_run() -> Result<()> {
    let layout = crate::Layout::cp(crate::CpKind::Zigzag, 2);
    let (da, db) = (tmpdir("reward-a"), tmpdir("reward-b"));
    let a = run(&reward_cfg(Some(da.clone()), layout, 6)?)?;
    let mut cb = reward_cfg(Some(db.clone()), layout, 6)?;
    (cb.save_every, cb.stop_after) = (3, Some(4));
    run(&cb)?;
    (cb.stop_after, cb.resume) = (None, true);
    let b = run(&cb)?;
    assert_eq!(b[0].start_step, 3);
    let tail: Vec<(usize, f64)> = a[0].metrics[3..].iter().map(|m| (m.step, m.train_loss)).collect();
    assert_eq!(tail, b[0].metrics.iter().map(|m| (m.step, m.train_loss)).collect::<Vec<_>>());
    std::fs::remove_dir_all(&da)?;
    std::fs::remove_dir_all(&db)?;
    Ok(())
}
