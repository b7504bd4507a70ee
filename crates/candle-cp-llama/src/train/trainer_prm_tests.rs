//! Trainer tests of process reward models ([`crate::train::prm`]) on stepwise examples.
use super::dpo_tests::{follows_on_layouts, with_held_out};
use super::tests::{run, tiny_cfg, tmpdir};
use super::*;
use crate::train::{PrmConfig, StepSet};
use crate::Layout;
use std::path::PathBuf;

/// 32 byte-level stepwise examples in rows of 64 (batch 2), a tiny model from random init made
/// a token classifier of 2 labels with dropout 0.1.
fn prm_cfg(out: Option<PathBuf>, layout: Layout, steps: usize) -> Result<TrainConfig> {
    let set = StepSet::read(&crate::train::prm::tests::steps_text(32, 7), &crate::train::sft::bytes_of, "\n")?;
    let mut c = tiny_cfg(out, layout, 2, 1);
    (c.data, c.model, c.seq_len, c.steps) = (DataSource::Steps(set), ModelSource::Init(crate::LlamaConfig::tiny(128, 32, 1, 2, 1)), 64, steps);
    c.schedule.total = steps;
    c.prm = Some(PrmConfig { num_labels: 2, dropout: Some(0.1) });
    Ok(c)
}

/// A PRM learns the step labels (the loss falls from about ln 2, the held-out steps evaluated);
/// zigzag CP 2, ring CP 2 × DP 2 and TP 2 + SP follow the single-device curve with dropout on
/// (loss, gradient norm, held-out loss); the checkpoint is a `LlamaForTokenClassification`
/// with its dropout, which trains on; refusals.
#[test]
fn prm_learns_and_matches_on_every_layout() -> Result<()> {
    let out = tmpdir("prm");
    let one = run(&with_held_out(prm_cfg(Some(out.clone()), Layout::single(), 16)?)?)?;
    let m = &one[0].metrics;
    let last = m.last().expect("steps");
    let early: f64 = m[..4].iter().map(|s| s.train_loss).sum::<f64>() / 4.0;
    let late: f64 = m[12..].iter().map(|s| s.train_loss).sum::<f64>() / 4.0;
    assert!(early > 0.5 && late < early - 0.05, "{early} → {late}");
    assert!(last.dpo_accuracy.is_some_and(|a| a > 0.5) && last.dpo_margin.is_none() && last.eval_dpo_accuracy.is_some(), "{last:?}");
    assert!(m[1].eval_loss.is_some() && m[0].eval_loss.is_none(), "{:?}", m[1]);
    assert!((last.loss - last.train_loss).abs() < 1e-12, "the reported loss is the objective");
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    follows_on_layouts("PRM", &want, |layout| {
        let mut c = with_held_out(prm_cfg(None, layout, 16)?)?;
        c.stop_after = Some(4);
        Ok(c)
    })?;
    // dropout draws: another dropout, another curve
    let mut nodrop = with_held_out(prm_cfg(None, Layout::single(), 16)?)?;
    (nodrop.stop_after, nodrop.prm) = (Some(2), Some(PrmConfig { num_labels: 2, dropout: Some(0.0) }));
    let n = run(&nodrop)?;
    assert!((n[0].metrics[1].train_loss - m[1].train_loss).abs() > 1e-7, "dropout changes the run");
    // the checkpoint: a token classifier transformers reads, its dropout kept; it trains on
    let ck = crate::train::checkpoint::latest_checkpoint(out.join("checkpoints"))?.expect("a checkpoint");
    let cfg = crate::LlamaConfig::from_file(ck.join("config.json"))?;
    assert_eq!((cfg.num_labels, cfg.hf_class(), cfg.token_classifier.map(|t| t.dropout)), (Some(2), "LlamaForTokenClassification".to_string(), Some(0.1)));
    let mut more = prm_cfg(None, Layout::single(), 2)?;
    (more.model, more.prm) = (ModelSource::Hf(ck.clone()), Some(PrmConfig::default()));
    let again = run(&more)?;
    assert!(again[0].metrics[0].train_loss < early, "from the trained PRM: {} vs {early}", again[0].metrics[0].train_loss);
    // a PRM trains by its own loss, on stepwise data, with a head holding the labels
    let mut lm = prm_cfg(None, Layout::single(), 2)?;
    (lm.model, lm.prm) = (ModelSource::Hf(ck.clone()), None);
    assert!(run(&lm).unwrap_err().to_string().contains("is a reward model"));
    let mut both = prm_cfg(None, Layout::single(), 2)?;
    both.reward = Some(crate::train::RewardConfig::default());
    assert!(run(&both).unwrap_err().to_string().contains("not with reward"));
    let mut three = prm_cfg(None, Layout::single(), 2)?;
    three.model = ModelSource::Hf(ck.clone());
    three.prm = Some(PrmConfig { num_labels: 3, dropout: None });
    assert!(run(&three).unwrap_err().to_string().contains("2 label(s), not 3"));
    let mut recall = prm_cfg(None, Layout::single(), 2)?;
    recall.data = DataSource::Recall(crate::train::KvRecall::new(64)?);
    assert!(run(&recall).unwrap_err().to_string().contains("trains on stepwise examples"));
    let mut bad = prm_cfg(None, Layout::single(), 2)?;
    bad.eval = Some(crate::train::EvalConfig { data: DataSource::Recall(crate::train::KvRecall::new(64)?), every: 1, batches: 1 });
    assert!(run(&bad).unwrap_err().to_string().contains("held-out data must be stepwise examples"));
    let mut one_label = prm_cfg(None, Layout::single(), 2)?;
    one_label.prm = Some(PrmConfig { num_labels: 1, dropout: None });
    assert!(run(&one_label).unwrap_err().to_string().contains("the data labels 2 classes"));
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// A PRM run killed after step 4 and resumed from its step-3 checkpoint (a token classifier's)
/// reproduces the uninterrupted run (dropout's masks included), on ring CP 2 × DP 2.
#[test]
fn resumed_prm_run_is_the_straight_run() -> Result<()> {
    crate::train::grpo::tests::resumed_is_straight(&prm_cfg(None, crate::Layout::cp(crate::CpKind::Ring, 2).with_dp(2), 6)?, "prm", 3, 4)
}

/// A LoRA process reward model (PEFT's TOKEN_CLS task: adapters on q and v, the new head
/// trained whole, weight and bias): the loss falls, zigzag CP 2, ring CP 2 × DP 2 and TP 2 + SP
/// follow the single device, the checkpoint is a PEFT adapter of task TOKEN_CLS holding the
/// head under PEFT's names over a written base that is a token classifier, merged = adapted,
/// and a run resumed from it is the straight one.
#[test]
fn lora_prm_trains_its_adapters_and_head() -> Result<()> {
    let cfg = |out: Option<PathBuf>, layout: Layout| -> Result<TrainConfig> {
        let mut c = prm_cfg(out, layout, 8)?;
        c.lora = Some(crate::LoraSpec::new(4, 8.0, &["q_proj", "v_proj"])?.with_modules_to_save(&["score"])?);
        c.schedule.peak = 5e-3;
        // (from a causal LM: the head drawn, the base written once as the token classifier)
        let lm = crate::LlamaConfig::tiny(128, 32, 1, 2, 1);
        let dir = std::env::temp_dir().join(format!("cp-prm-lora-lm-{}", std::process::id()));
        if !dir.join("config.json").exists() {
            crate::save_hf(&dir, &crate::init_params(&lm, c.seed, candle_core::DType::F32, &candle_core::Device::Cpu)?, &lm)?;
        }
        c.model = ModelSource::Hf(dir);
        Ok(c)
    };
    let da = tmpdir("prm-lora");
    let one = run(&cfg(Some(da.clone()), Layout::single())?)?;
    let m = &one[0].metrics;
    assert!(m[6..].iter().map(|s| s.train_loss).sum::<f64>() < m[..2].iter().map(|s| s.train_loss).sum::<f64>() - 0.02, "{:?}", m.iter().map(|s| s.train_loss).collect::<Vec<_>>());
    assert!(one[0].trainable_params < one[0].n_params / 4, "{} of {}", one[0].trainable_params, one[0].n_params);
    let want: Vec<&StepMetrics> = m[..4].iter().collect();
    follows_on_layouts("LoRA PRM", &want, |layout| {
        let mut c = cfg(None, layout)?;
        c.stop_after = Some(4);
        Ok(c)
    })?;
    let ck = crate::train::checkpoint::latest_checkpoint(da.join("checkpoints"))?.expect("a checkpoint");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ck.join("adapter_config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((json["task_type"].as_str(), json["modules_to_save"][0].as_str()), (Some("TOKEN_CLS"), Some("score")), "{json}");
    let names: Vec<String> = candle_core::safetensors::load(ck.join("adapter_model.safetensors"), &candle_core::Device::Cpu)?.into_keys().collect();
    assert!(names.iter().any(|n| n == "base_model.model.score.weight") && names.iter().any(|n| n == "base_model.model.score.bias"), "{names:?}");
    let base = crate::LlamaConfig::from_file(crate::lora::base_model_dir(&ck)?.join("config.json"))?;
    assert_eq!((base.num_labels, base.hf_class()), (Some(2), "LlamaForTokenClassification".to_string()));
    // the checkpoint as a PRM (adapters merged) scores as the adapted model; its bias trained
    for r in candle_cp_comm::run_ranks(1, |g| -> Result<()> {
        let (dev, dt) = (candle_core::Device::Cpu, candle_core::DType::F32);
        let ctx = crate::ParallelCtx::new(g, Layout::single())?;
        let merged = crate::reward::load_reward_model(&ck, &ctx, &dev, dt)?;
        let (vm, c) = crate::load_hf_sharded(crate::lora::base_model_dir(&ck)?, &ctx, &dev, dt)?;
        let adapted = crate::lora::load_adapter_sharded(&ck, &c, &vm, &ctx, dt, &dev)?.expect("an adapter");
        let plain = crate::Llama::new(candle_nn::VarBuilder::from_varmap(&vm, dt, &dev), &adapted, &ctx)?;
        let bias: Vec<f32> = vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?[crate::prm::SCORE_BIAS].as_tensor().to_vec1()?;
        assert!(bias.iter().any(|&b| b != 0.0), "the bias trained: {bias:?}");
        let ids = candle_core::Tensor::new(&[[104u32, 105, 61, 73, 72, 10]], &dev)?;
        let pos = candle_core::Tensor::arange(0u32, 6, &dev)?.unsqueeze(0)?;
        let docs = [crate::Documents::single(6)?];
        let (a, b): (Vec<f32>, Vec<f32>) = (merged.token_scores_packed(&ids, &pos, &docs, None)?.flatten_all()?.to_vec1()?, plain.token_scores_packed(&ids, &pos, &docs, None)?.flatten_all()?.to_vec1()?);
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4 * y.abs().max(1.0)), "{a:?} vs {b:?}");
        Ok(())
    }) {
        r?;
    }
    // killed after step 5 and resumed from step 4's checkpoint: the straight run's steps 5..8
    crate::train::grpo::tests::resumed_is_straight(&cfg(None, Layout::cp(crate::CpKind::Zigzag, 2))?, "prm-lora", 4, 5)?;
    std::fs::remove_dir_all(&da)?;
    std::fs::remove_dir_all(std::env::temp_dir().join(format!("cp-prm-lora-lm-{}", std::process::id())))?;
    Ok(())
}

/// QLoRA reward models: a PRM and an outcome reward model whose frozen base is held as NF4
/// codes (the head trained whole beside the adapters): the loss falls, zigzag CP 2 and TP 2 +
/// SP follow the single device.
#[test]
fn qlora_reward_models_train() -> Result<()> {
    let q = candle_cp_nn::QuantConfig::new(candle_cp_nn::QuantKind::Nf4, 8)?;
    for prm in [true, false] {
        let cfg = |layout: Layout| -> Result<TrainConfig> {
            let mut c = match prm {
                true => prm_cfg(None, layout, 8)?,
                false => {
                    let mut c = super::dpo_tests::dpo_cfg(None, layout, 8)?;
                    (c.dpo, c.reward) = (None, Some(crate::train::RewardConfig::default()));
                    c
                }
            };
            c.lora = Some(crate::LoraSpec::new(4, 8.0, &["q_proj", "v_proj"])?.with_modules_to_save(&["score"])?);
            (c.quantize_base, c.schedule.peak) = (Some(q), 5e-3);
            Ok(c)
        };
        let one = run(&cfg(Layout::single())?)?;
        let m = &one[0].metrics;
        assert!(m[6..].iter().map(|s| s.train_loss).sum::<f64>() < m[..2].iter().map(|s| s.train_loss).sum::<f64>(), "prm {prm}: {:?}", m.iter().map(|s| s.train_loss).collect::<Vec<_>>());
        assert!(one[0].frozen_weight_bytes > 0, "a quantized base");
        let want: Vec<&StepMetrics> = m[..4].iter().collect();
        follows_on_layouts(if prm { "QLoRA PRM" } else { "QLoRA reward model" }, &want, |layout| {
            let mut c = cfg(layout)?;
            c.stop_after = Some(4);
            Ok(c)
        })?;
    }
    Ok(())
}
