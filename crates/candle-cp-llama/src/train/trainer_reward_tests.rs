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
    crate::train::grpo::tests::resumed_is_straight(&reward_cfg(None, crate::Layout::cp(crate::CpKind::Zigzag, 2), 6)?, "reward", 3, 4)
}

/// A LoRA reward model (PEFT's SEQ_CLS task: adapters on q and v, the new score head trained
/// whole): the pair loss falls, zigzag CP 2 and TP 2 + SP follow the single device, the
/// checkpoint is a PEFT adapter of task SEQ_CLS holding the score head under PEFT's name over a
/// written base that is a sequence classifier, and a resumed run is the straight one.
#[test]
fn lora_reward_model_trains_its_adapters_and_score_head() -> Result<()> {
    let cfg = |out: Option<PathBuf>, layout: Layout| -> Result<TrainConfig> {
        let mut c = reward_cfg(out, layout, 8)?;
        c.lora = Some(crate::LoraSpec::new(4, 8.0, &["q_proj", "v_proj"])?.with_modules_to_save(&["score"])?);
        c.schedule.peak = 5e-3;
        Ok(c)
    };
    let (da, db) = (tmpdir("reward-lora-a"), tmpdir("reward-lora-b"));
    let one = run(&cfg(Some(da.clone()), Layout::single())?)?;
    let m = &one[0].metrics;
    assert!(m[7].train_loss < m[0].train_loss - 0.02, "{} → {}", m[0].train_loss, m[7].train_loss);
    assert!(one[0].trainable_params < one[0].n_params / 4, "{} of {}", one[0].trainable_params, one[0].n_params);
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    follows_on_layouts("LoRA reward", &want, |layout| {
        let mut c = cfg(None, layout)?;
        c.stop_after = Some(4);
        Ok(c)
    })?;
    let ck = crate::train::checkpoint::latest_checkpoint(da.join("checkpoints"))?.expect("a checkpoint");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ck.join("adapter_config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((json["task_type"].as_str(), json["modules_to_save"][0].as_str()), (Some("SEQ_CLS"), Some("score")), "{json}");
    let names: Vec<String> = candle_core::safetensors::load(ck.join("adapter_model.safetensors"), &candle_core::Device::Cpu)?.into_keys().collect();
    assert!(names.iter().any(|n| n == "base_model.model.score.weight"), "{names:?}");
    let base = crate::LlamaConfig::from_file(crate::lora::base_model_dir(&ck)?.join("config.json"))?;
    assert_eq!(base.num_labels, Some(1));
    // the checkpoint as a reward model (adapters merged) scores as the adapted model
    for r in candle_cp_comm::run_ranks(1, |g| -> Result<()> {
        let (dev, dt) = (candle_core::Device::Cpu, candle_core::DType::F32);
        let ctx = crate::ParallelCtx::new(g, Layout::single())?;
        let merged = crate::reward::load_reward_model(&ck, &ctx, &dev, dt)?;
        let (vm, c) = crate::load_hf_sharded(crate::lora::base_model_dir(&ck)?, &ctx, &dev, dt)?;
        let adapted = crate::lora::load_adapter_sharded(&ck, &c, &vm, &ctx, dt, &dev)?.expect("an adapter");
        let plain = crate::Llama::new(candle_nn::VarBuilder::from_varmap(&vm, dt, &dev), &adapted, &ctx)?;
        let ids = candle_core::Tensor::new(&[[104u32, 105, 61, 73, 72, 10]], &dev)?;
        let pos = candle_core::Tensor::arange(0u32, 6, &dev)?;
        let (a, b): (Vec<f32>, Vec<f32>) = (merged.scores(&ids, &pos)?.flatten_all()?.to_vec1()?, plain.scores(&ids, &pos)?.flatten_all()?.to_vec1()?);
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4 * y.abs().max(1.0)), "{a:?} vs {b:?}");
        Ok(())
    }) {
        r?;
    }
    // from the same weights saved as a causal LM (the score head drawn alike, its base written
    // as the reward model), killed after step 5 and resumed from step 4's checkpoint: the
    // straight run's steps 5..8
    let mut cb = cfg(Some(db.clone()), Layout::cp(crate::CpKind::Zigzag, 2))?;
    let lm = crate::LlamaConfig::tiny(128, 32, 1, 2, 1);
    let lm_dir = db.with_extension("lm");
    crate::save_hf(&lm_dir, &crate::init_params(&lm, cb.seed, candle_core::DType::F32, &candle_core::Device::Cpu)?, &lm)?;
    (cb.model, cb.save_every, cb.stop_after) = (ModelSource::Hf(lm_dir.clone()), 4, Some(5));
    run(&cb)?;
    assert_eq!(crate::LlamaConfig::from_file(db.join("base").join("config.json"))?.num_labels, Some(1), "the written base");
    (cb.stop_after, cb.resume) = (None, true);
    let b = run(&cb)?;
    assert_eq!(b[0].start_step, 4);
    for (x, y) in m[4..].iter().zip(&b[0].metrics) {
        assert!((x.train_loss - y.train_loss).abs() < 1e-5, "step {}: {} vs {}", x.step, x.train_loss, y.train_loss);
    }
    std::fs::remove_dir_all(&da)?;
    std::fs::remove_dir_all(&db)?;
    std::fs::remove_dir_all(&lm_dir)?;
    Ok(())
}

/// TRL's per-pair margins: with every pair's margin 1 the first step's loss is
/// `softplus(1 − Δr)`'s mean — above the run without margins, whose rewards are the same at
/// step 1 — and zigzag CP 2 follows the single device.
#[test]
fn margins_raise_the_bar_on_every_layout() -> Result<()> {
    let with_margins = |layout: Layout| -> Result<TrainConfig> {
        let mut c = reward_cfg(None, layout, 3)?;
        if let DataSource::Preference(s) = &c.data {
            let n = s.len();
            c.data = DataSource::Preference(s.clone().with_margins(Some(vec![1.0; n]))?);
        }
        c.reward = Some(RewardConfig::default());
        Ok(c)
    };
    let plain = run(&TrainConfig { reward: Some(RewardConfig::default()), ..reward_cfg(None, Layout::single(), 3)? })?;
    let one = run(&with_margins(Layout::single())?)?;
    let (p0, m0) = (&plain[0].metrics[0], &one[0].metrics[0]);
    assert!(m0.train_loss > p0.train_loss + 0.2 && m0.dpo_margin == p0.dpo_margin, "{m0:?} vs {p0:?}");
    let cp = run(&with_margins(Layout::cp(crate::CpKind::Zigzag, 2))?)?;
    for (a, b) in one[0].metrics.iter().zip(&cp[0].metrics) {
        assert!((a.train_loss - b.train_loss).abs() < 1e-5 && (a.grad_norm - b.grad_norm).abs() < 1e-4 * a.grad_norm.max(1.0), "step {}: {a:?} vs {b:?}", a.step);
    }
    Ok(())
}
