//! GRPO's reward models ([`crate::train::reward::RunRewardModel`]): an outcome reward model, a
//! process reward model, one with a tokenizer of its own, and a dense one beside a mixture of
//! experts under expert parallelism.
use super::*;
use super::tests::grpo_cfg;
use crate::train::grpo::tests::{reverse_prompts, run, tiny_run};
use crate::train::grpo::{GrpoConfig, ImportanceLevel};
use crate::train::{DataSource, TrainConfig};
use crate::{init_params, CpKind, Layout, LlamaConfig};
use candle_cp_comm::run_ranks;
use candle_nn::VarBuilder;
use std::sync::Arc;

/// A reward model as GRPO's reward (TRL's `reward_funcs` naming a sequence classifier): a
/// drawn reward model of the policy's vocabulary, saved as a `LlamaForSequenceClassification`,
/// scores each `prompt ++ completion` — packed into rows, each document as it scores alone —;
/// with the reward functions giving 0, the run's rewards are the model's (weighted, spread)
/// and zigzag CP 2 and TP 2 + SP × DP 2 follow the single device; a causal LM and a reward
/// model of another vocabulary are refused by name.
#[test]
fn a_reward_model_rewards_completions() -> Result<()> {
    use crate::train::reward::{score_documents, RewardModelSpec};
    let dir = std::env::temp_dir().join(format!("cp-grpo-rm-{}", std::process::id()));
    let rcfg = LlamaConfig::tiny(128, 32, 1, 2, 1).with_num_labels(Some(1));
    crate::save_hf(dir.join("rm"), &init_params(&rcfg, 9, DType::F32, &Device::Cpu)?, &rcfg)?;
    for r in run_ranks(1, |g| -> Result<()> {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        let (vm, c) = crate::load_hf_sharded(dir.join("rm"), &ctx, &Device::Cpu, DType::F32)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &c, &ctx)?;
        let docs: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![4, 5, 6, 7, 8], vec![9], vec![10, 11, 12, 13], vec![14, 15]];
        let got = score_documents(&m, &docs, 2, 8, &Device::Cpu)?;
        for (d, g) in docs.iter().zip(&got) {
            let ids = Tensor::new(d.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
            let alone: Vec<f32> = m.scores(&ids, &Tensor::arange(0u32, d.len() as u32, &Device::Cpu)?)?.flatten_all()?.to_vec1()?;
            assert!((alone[d.len() - 1] as f64 - g).abs() < 1e-5, "{d:?}: packed {g} vs alone {}", alone[d.len() - 1]);
        }
        assert!(score_documents(&m, &[vec![1; 9]], 2, 8, &Device::Cpu).unwrap_err().to_string().contains("rows hold 1..=8"));
        Ok(())
    }) {
        r?;
    }
    let set = reverse_prompts(8, 2)?;
    let zero: super::super::grpo::RewardFn = Arc::new(|_, _, _| Ok(0.0));
    let with = |layout: Layout, spec: RewardModelSpec| -> TrainConfig {
        let mut c = tiny_run(layout, DataSource::Prompts(set.clone()), 3, (2, 1));
        c.grpo = Some(GrpoConfig { reward: zero.clone(), reward_model: Some(spec), ..grpo_cfg(ImportanceLevel::Token, 1) });
        c
    };
    let spec = RewardModelSpec { dir: dir.join("rm"), weight: 2.0, steps: None, retokenize: None };
    let one = run(&with(Layout::single(), spec.clone()))?;
    let m = &one[0].metrics;
    assert!(m.iter().all(|s| s.grpo_reward.is_some_and(|r| r != 0.0) && s.grpo_zero_std == Some(0.0)), "{m:?}");
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true).with_dp(2)] {
        let other = run(&with(layout, spec.clone()))?;
        for (a, b) in m.iter().zip(&other[0].metrics) {
            let (x, y) = (a.grpo_reward.unwrap_or(0.0), b.grpo_reward.unwrap_or(1.0));
            assert!((x - y).abs() < 1e-5 * x.abs().max(1.0) && (a.train_loss - b.train_loss).abs() < 1e-5 && (a.grad_norm - b.grad_norm).abs() < 1e-4 * a.grad_norm.max(1.0), "{layout} step {}: {a:?} vs {b:?}", a.step);
        }
    }
    // refused: a causal LM; a reward model of another vocabulary
    let lm = LlamaConfig::tiny(128, 32, 1, 2, 1);
    crate::save_hf(dir.join("lm"), &init_params(&lm, 9, DType::F32, &Device::Cpu)?, &lm)?;
    let e = run(&with(Layout::single(), RewardModelSpec { dir: dir.join("lm"), weight: 1.0, steps: None, retokenize: None })).unwrap_err().to_string();
    assert!(e.contains("not a reward model"), "{e}");
    let small = LlamaConfig::tiny(64, 32, 1, 2, 1).with_num_labels(Some(1));
    crate::save_hf(dir.join("small"), &init_params(&small, 9, DType::F32, &Device::Cpu)?, &small)?;
    let e = run(&with(Layout::single(), RewardModelSpec { dir: dir.join("small"), weight: 1.0, steps: None, retokenize: None })).unwrap_err().to_string();
    assert!(e.contains("must share its tokenizer"), "{e}");
    // a process reward model: each completion's steps (at token 10) judged, the least
    // probability of being right the reward (in [0, weight]); the layouts alike; refused
    // without its separator, and an outcome model with one
    let pcfg = LlamaConfig::tiny(128, 32, 1, 2, 1).with_num_labels(Some(2)).with_token_classifier(Some(crate::prm::TokenClassifier::new(0.1)?));
    crate::save_hf(dir.join("prm"), &init_params(&pcfg, 9, DType::F32, &Device::Cpu)?, &pcfg)?;
    let prm = RewardModelSpec { dir: dir.join("prm"), weight: 2.0, steps: Some((vec![10], crate::train::prm::StepAggregate::Min)), retokenize: None };
    let one = run(&with(Layout::single(), prm.clone()))?;
    assert!(one[0].metrics.iter().all(|s| s.grpo_reward.is_some_and(|r| r > 0.0 && r < 2.0)), "{:?}", one[0].metrics);
    let other = run(&with(Layout::cp(CpKind::Zigzag, 2), prm.clone()))?;
    for (a, b) in one[0].metrics.iter().zip(&other[0].metrics) {
        let (x, y) = (a.grpo_reward.unwrap_or(0.0), b.grpo_reward.unwrap_or(1.0));
        assert!((x - y).abs() < 1e-5 && (a.train_loss - b.train_loss).abs() < 1e-5, "zigzag step {}: {a:?} vs {b:?}", a.step);
    }
    let e = run(&with(Layout::single(), RewardModelSpec { steps: None, ..prm.clone() })).unwrap_err().to_string();
    assert!(e.contains("give its step separator"), "{e}");
    let e = run(&with(Layout::single(), RewardModelSpec { dir: dir.join("rm"), ..prm })).unwrap_err().to_string();
    assert!(e.contains("is not a process reward model"), "{e}");
    // a reward model with a tokenizer of its own (ids shifted by one, a vocabulary of 160): the
    // texts re-tokenised, the same model with its embedding rows shifted scores them as the
    // first run's model scored the policy's ids — the same rewards, the same run
    let mut shifted: Vec<(String, Tensor)> = crate::params::varmap_tensors(&init_params(&rcfg, 9, DType::F32, &Device::Cpu)?)?.into_iter().collect();
    for (n, t) in shifted.iter_mut().filter(|(n, _)| n == "model.embed_tokens.weight") {
        let h = t.dim(1)?;
        *t = Tensor::cat(&[Tensor::zeros((1, h), DType::F32, &Device::Cpu)?, t.clone(), Tensor::zeros((31, h), DType::F32, &Device::Cpu)?], 0)?;
        assert_eq!((n.as_str(), t.dim(0)?), ("model.embed_tokens.weight", 160));
    }
    let mut big = rcfg.clone();
    big.vocab_size = 160;
    crate::save_hf_tensors(dir.join("rm160"), &shifted, &big)?;
    let decode: super::super::reward_command::Decode = Arc::new(|ids: &[u32]| Ok(ids.iter().map(|&i| char::from(i as u8)).collect()));
    let encode: super::super::reward::Encode = Arc::new(|s: &str| Ok(s.bytes().map(|b| b as u32 + 1).collect()));
    let spec160 = RewardModelSpec { dir: dir.join("rm160"), weight: 2.0, steps: None, retokenize: Some((decode, encode)) };
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2)] {
        let got = run(&with(layout, spec160.clone()))?;
        for (a, b) in m.iter().zip(&got[0].metrics) {
            let (x, y) = (a.grpo_reward.unwrap_or(0.0), b.grpo_reward.unwrap_or(1.0));
            assert!((x - y).abs() < 1e-5 * x.abs().max(1.0) && (a.train_loss - b.train_loss).abs() < 1e-5, "{layout} step {}: re-tokenised {b:?} vs {a:?}", a.step);
        }
    }
    let e = run(&with(Layout::single(), RewardModelSpec { retokenize: None, ..spec160 })).unwrap_err().to_string();
    assert!(e.contains("must share its tokenizer"), "{e}");
    // a mixture-of-experts policy under expert parallelism with the dense reward model: read
    // without EP, the same rewards and run as on one device
    let moe = |layout: Layout| -> TrainConfig {
        let mut c = with(layout, spec.clone());
        c.model = crate::train::ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1).with_moe(Some(crate::MoeConfig::new(4, 2, 16))));
        c
    };
    let (a, b) = (run(&moe(Layout::single()))?, run(&moe(Layout::cp(CpKind::Zigzag, 2).with_ep(2)))?);
    for (x, y) in a[0].metrics.iter().zip(&b[0].metrics) {
        assert!((x.grpo_reward.unwrap_or(0.0) - y.grpo_reward.unwrap_or(1.0)).abs() < 1e-5 && (x.train_loss - y.train_loss).abs() < 1e-5, "EP 2 step {}: {y:?} vs {x:?}", x.step);
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
