//! Seeded random GRPO runs: a few optimizer steps of online RL on a drawn layout (every CP
//! kind, CP 2 or 4, TP 2 with or without SP, DP 2), drawn batch split, ZeRO stage, recompute
//! and overlaps, and a drawn objective (grpo, bnpo, dr_grpo, dapo, cispo or sapo; rewards scaled by the group,
//! the batch or not; 2 or 4 completions of 1 or 2 prompts, 4 or 6 tokens at most, temperature
//! 1 or 0.7 with or without top-k; the KL term or not; truncated completions masked or not; 1, 2 or 3 iterations per generation,
//! the clipped ratio per token or per sequence (GSPO), ε_high 0.2 or 0.28, the two-sided cap δ 1.5
//! or none; every token trained or the top half by entropy) follow the single-device run of the same
//! prompts step by step: the same completions (rewards and lengths), the objective to 1e-6 and
//! the gradient norm to 1e-4 relative above 1 (10x after updates), on every rank. Sampling
//! draws the same tokens from logits that differ by rounding, except where a draw falls within
//! that rounding of a token's boundary: a run whose completions part so stops being compared at
//! that step (counted; at most one in twenty), and so may the entropy quantile's threshold
//! (near-equal entropies split by rounding). A run the trainer refuses must be refused for a
//! reason the draw explains. `CANDLE_CP_RANDOM_SEEDS=A..B` draws configurations `A..B`.

use candle_core::Result;
use candle_cp_llama::layout::Layout;
use candle_cp_llama::sampling::Sampling;
use candle_cp_llama::train::grpo::{GrpoConfig, GrpoLoss, ImportanceLevel, PromptSet, RewardFn, ScaleRewards};
use candle_cp_llama::train::sft::{bytes_of, read_sft};
use candle_cp_llama::train::{DataSource, ModelSource, Rng, TrainConfig};
use candle_cp_llama::LlamaConfig;
use candle_cp_tests::draws::{pick, rng, seeds};
use candle_cp_tests::train_draws::{assert_explained, draw_run, run};
use std::sync::Arc;

const CONFIGS: u64 = 16;

/// Byte-level prompts `abc=` (2 to 4 letters) with their reversed capitals as the answer.
fn prompts(seed: u64) -> Result<PromptSet> {
    let mut r = Rng::new(seed);
    let mut text = String::new();
    for _ in 0..8 {
        let p: String = (0..2 + r.below(3)).map(|_| (b'a' + r.below(6) as u8) as char).collect();
        let c: String = p.chars().rev().map(|x| x.to_ascii_uppercase()).collect();
        text.push_str(&format!("{{\"prompt\": \"{p}=\", \"completion\": \"{c}\"}}\n"));
    }
    PromptSet::from_marked(read_sft(&text, &bytes_of, Some(2), None)?)
}

/// The reward: the fraction of capital letters (a random model's groups differ).
fn capitals() -> RewardFn {
    Arc::new(|_, c, _| Ok(c.iter().filter(|&&t| (65..91).contains(&t)).count() as f64 / c.len().max(1) as f64))
}

/// An objective (2, 3 or 4 completions per prompt: DP 2 must divide prompts × completions, so
/// 3 completions of 1 prompt are refused there).
fn draw_objective(d: &mut Rng) -> GrpoConfig {
    let g = GrpoConfig {
        num_generations: pick(d, &[2, 3, 4]),
        prompts: pick(d, &[1, 2]),
        max_completion_length: pick(d, &[4, 6]),
        sampling: Sampling::Sample { temperature: pick(d, &[1.0, 0.7]), top_k: pick(d, &[0, 20]), top_p: 1.0, seed: d.below(1000) as u64 },
        stop: vec![2],
        loss_type: pick(d, &[GrpoLoss::Grpo, GrpoLoss::Bnpo, GrpoLoss::DrGrpo, GrpoLoss::Dapo, GrpoLoss::Cispo, GrpoLoss::Sapo]),
        scale_rewards: pick(d, &[ScaleRewards::Group, ScaleRewards::Batch, ScaleRewards::None]),
        reward: capitals(),
        reward_model: None,
        beta: pick(d, &[0.0, 0.04]),
        mask_truncated_completions: pick(d, &[false, true]),
        num_iterations: pick(d, &[1, 2, 3]),
        epsilon: 0.2,
        epsilon_high: pick(d, &[0.2, 0.28]),
        importance_sampling_level: pick(d, &[ImportanceLevel::Token, ImportanceLevel::Sequence]),
        delta: pick(d, &[None, Some(1.5)]),
        top_entropy_quantile: pick(d, &[1.0, 0.5]),
        sapo_temperatures: pick(d, &[(1.0, 1.05), (2.0, 3.0)]),
        steps_per_generation: pick(d, &[1, 1, 2]),
        dynamic_sampling: pick(d, &[0, 0, 2]),
    };
    // (CISPO: epsilon_high is the ratio's cap, and no δ; SAPO: no δ)
    match g.loss_type {
        GrpoLoss::Cispo => GrpoConfig { epsilon_high: 1.5, delta: None, ..g },
        GrpoLoss::Sapo => GrpoConfig { delta: None, ..g },
        _ => g,
    }
}

#[test]
fn random_grpo_runs_follow_one_device() -> Result<()> {
    let (mut checked, mut refused, mut parted) = (0, 0, 0);
    for seed in seeds(CONFIGS)? {
        let mut d = rng(91_000 + seed);
        let (layout, batch, grad_accum, opts) = draw_run(&mut d);
        let grpo = draw_objective(&mut d);
        let model = LlamaConfig::tiny(128, 32, pick(&mut d, &[1, 2]), 4, 2);
        let set = prompts(seed)?;
        // rows that surely hold the micro-batch's completions, a multiple of 16 tokens
        let doc = set.max_prompt_len() + grpo.max_completion_length;
        let seq_len = (doc * (grpo.prompts * grpo.num_generations).div_ceil(batch)).div_ceil(16) * 16;
        let base = |layout: Layout| -> TrainConfig {
            let mut c = TrainConfig::new(layout, ModelSource::Init(model.clone()), DataSource::Prompts(set.clone()), seq_len, 3);
            (c.batch, c.grad_accum, c.seed, c.grpo) = (batch, grad_accum, seed, Some(grpo.clone()));
            c.schedule.peak = 5e-3;
            c.adamw.eps = 1e-6;
            c
        };
        let mut cfg = base(layout);
        opts.apply(&mut cfg);
        let what = format!("seed {seed}: {layout}, batch {batch} x {grad_accum}, seq {seq_len}, {opts:?}, {grpo:?}");
        let got = match run(&cfg) {
            Ok(g) => g,
            Err(e) => {
                assert_explained(&what, &e);
                refused += 1;
                continue;
            }
        };
        let want = run(&base(Layout::single()))?;
        let want = &want[0].metrics;
        let mut apart = false;
        for (r, out) in got.iter().enumerate() {
            for (a, b) in want.iter().zip(&out.metrics) {
                if (a.grpo_reward, a.completion_length) != (b.grpo_reward, b.completion_length) {
                    // (a draw within rounding of a token boundary: the runs part here)
                    println!("{what}: rank {r} parted at step {}", a.step);
                    apart = true;
                    break;
                }
                let k = if a.step == 1 { 1.0 } else { 10.0 };
                // (the entropy quantile splits near-equal entropies at its threshold by rounding,
                // as sampling does its near-ties: a run whose objective moves apart there stops
                // being compared, counted as parted)
                let off = (a.train_loss - b.train_loss).abs() >= 1e-6 * k * a.train_loss.abs().max(1.0) || (a.grad_norm - b.grad_norm).abs() >= 1e-4 * k * a.grad_norm.max(1.0);
                if off && grpo.top_entropy_quantile < 1.0 {
                    println!("{what}: rank {r} parted at step {} (entropy threshold)", a.step);
                    apart = true;
                    break;
                }
                assert!((a.train_loss - b.train_loss).abs() < 1e-6 * k * a.train_loss.abs().max(1.0), "{what}, rank {r} step {}: objective {} vs {}", a.step, b.train_loss, a.train_loss);
                assert!((a.grad_norm - b.grad_norm).abs() < 1e-4 * k * a.grad_norm.max(1.0), "{what}, rank {r} step {}: |g| {} vs {}", a.step, b.grad_norm, a.grad_norm);
                assert_eq!((a.grpo_kl.is_some(), a.grpo_clip_ratio.is_some()), (b.grpo_kl.is_some(), b.grpo_clip_ratio.is_some()));
            }
        }
        parted += apart as usize;
        checked += 1;
    }
    println!("{checked} GRPO configurations checked against one device ({parted} parted by a sampling or entropy near-tie), {refused} refused");
    assert!(checked > 0, "every draw refused");
    assert!(parted * 20 <= checked.max(20), "{parted} of {checked} runs parted: sampling does not follow one device");
    Ok(())
}
