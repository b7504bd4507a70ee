//! Tests of the reward model's pair loss ([`super::reward_terms`]).
use super::*;

/// The loss by hand (`−log σ(z)`, `z = r_c − r_r − m`, and the centring term) and its
/// derivatives against central finite differences, with and without the coefficient and
/// margins (accuracy and the mean margin are the rewards', whatever `m`); extreme rewards stay finite.
#[test]
fn pair_loss_by_hand_and_by_finite_differences() -> Result<()> {
    let rewards = [0.7, -0.4, 1.3, 2.1, -3.0, 0.2];
    let pairs = [(0, 1), (2, 3), (5, 4)];
    for (coef, margins) in [(0.0, vec![]), (0.01, vec![]), (0.5, vec![]), (0.01, vec![0.5, -0.25, 1.0])] {
        let cfg = RewardConfig { center_rewards_coefficient: coef };
        let m = |k: usize| margins.get(k).copied().unwrap_or(0.0);
        let t = reward_terms(&rewards, &pairs, &margins, &cfg)?;
        let by_hand: f64 = pairs
            .iter()
            .enumerate()
            .map(|(k, &(c, r))| {
                let z: f64 = rewards[c] - rewards[r] - m(k);
                (-(1.0 / (1.0 + (-z).exp())).ln() + coef * (rewards[c] + rewards[r]).powi(2)) / 3.0
            })
            .sum();
        assert!((t.loss - by_hand).abs() < 1e-12, "coef {coef}: {} vs {by_hand}", t.loss);
        assert!((t.accuracy - 2.0 / 3.0).abs() < 1e-12 && (t.margin - (1.1 - 0.8 + 3.2) / 3.0).abs() < 1e-12, "{t:?}");
        for i in 0..rewards.len() {
            let h = 1e-6;
            let (mut up, mut down) = (rewards, rewards);
            up[i] += h;
            down[i] -= h;
            let fd = (reward_terms(&up, &pairs, &margins, &cfg)?.loss - reward_terms(&down, &pairs, &margins, &cfg)?.loss) / (2.0 * h);
            assert!((fd - t.d_reward[i]).abs() < 1e-7, "coef {coef}, reward {i}: {fd} vs {}", t.d_reward[i]);
        }
    }
    let far = reward_terms(&[800.0, -800.0], &[(0, 1), (1, 0)], &[], &RewardConfig::default())?;
    assert!(far.loss.is_finite() && (far.loss - 800.0).abs() < 1e-9 && far.d_reward.iter().all(|d| d.is_finite()), "{far:?}");
    assert!(reward_terms(&[0.0], &[(0, 1)], &[], &RewardConfig::default()).is_err());
    assert!(reward_terms(&[0.0, 1.0], &[(0, 1)], &[1.0, 2.0], &RewardConfig::default()).unwrap_err().to_string().contains("2 margins for 1 pairs"));
    assert!(RewardConfig { center_rewards_coefficient: -1.0 }.validate().is_err());
    assert!(RewardConfig { center_rewards_coefficient: f64::NAN }.validate().is_err());
    Ok(())
}

/// TRL's `margin` column: read when every line has one, refused when some do, kept by a subset
/// (a held-out split); `with_margins` checks the count.
#[test]
fn margins_are_read_with_the_pairs() -> Result<()> {
    let read = |t: &str| PreferenceSet::read(t, &crate::train::sft::bytes_of, Some(2), None);
    let two = "{\"prompt\": \"ab=\", \"chosen\": \"BA\", \"rejected\": \"XY\", \"margin\": 1.5}\n{\"prompt\": \"c=\", \"chosen\": \"C\", \"rejected\": \"Z\", \"margin\": -0.5}\n";
    let s = read(two)?;
    assert_eq!(s.margins(), Some(&[1.5, -0.5][..]));
    assert_eq!(s.subset(1..2)?.margins(), Some(&[-0.5][..]));
    let none = read("{\"prompt\": \"ab=\", \"chosen\": \"BA\", \"rejected\": \"XY\"}\n")?;
    assert_eq!(none.margins(), None);
    let mixed = format!("{two}{{\"prompt\": \"d=\", \"chosen\": \"D\", \"rejected\": \"Q\"}}\n");
    assert!(read(&mixed).unwrap_err().to_string().contains("2 of 3 pairs have a `margin`"));
    assert!(read("{\"prompt\": \"d=\", \"chosen\": \"D\", \"rejected\": \"Q\", \"margin\": \"big\"}\n").unwrap_err().to_string().contains("finite number"));
    assert!(none.with_margins(Some(vec![1.0, 2.0])).is_err());
    Ok(())
}

/// Best-of-N: N sampled completions per prompt (prompts of different lengths in one batch),
/// each scored by a reward model as alone — or judged step by step by a process reward model,
/// the steps' probabilities aggregated —, the best the highest; zigzag CP 2 and TP 2 + SP ×
/// DP 2 draw the same completions, score them alike and keep the same ones; greedy N > 1, a
/// reward model of another vocabulary and a judge of the other kind are refused.
#[test]
fn best_of_n_keeps_the_highest_reward_on_every_layout() -> Result<()> {
    for process in [false, true] {
        best_of_n_with_judge(process)?;
    }
    Ok(())
}

fn best_of_n_with_judge(process: bool) -> Result<()> {
    use crate::{init_params_sharded, Layout, Llama, ParallelCtx, Sampling};
    let (dev, dt) = (Device::Cpu, DType::F32);
    let pcfg = crate::LlamaConfig::tiny(128, 32, 1, 2, 1);
    let seq = pcfg.clone().with_num_labels(Some(1));
    let tok = pcfg.clone().with_num_labels(Some(2)).with_token_classifier(Some(crate::prm::TokenClassifier::new(0.1)?));
    let (rcfg, wrong) = if process { (&tok, &seq) } else { (&seq, &tok) };
    let judge = match process {
        true => Judge::Process { separator: &[7, 8], aggregate: crate::train::prm::StepAggregate::Min },
        false => Judge::Outcome,
    };
    let prompts = vec![vec![5u32, 6, 7], vec![9; 5], vec![11, 12]];
    let sampling = Sampling::Sample { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 9 };
    let go = |layout: Layout| -> Result<Vec<BestOfN>> {
        let out = candle_cp_comm::run_ranks(layout.world_size(), |g| -> Result<Vec<BestOfN>> {
            let ctx = ParallelCtx::new(g, layout)?;
            let model = |c: &crate::LlamaConfig, seed: u64| -> Result<Llama> { Llama::new(candle_nn::VarBuilder::from_varmap(&init_params_sharded(c, seed, dt, &ctx, &dev)?, dt, &dev), c, &ctx) };
            let (p, r) = (model(&pcfg, 3)?, model(rcfg, 4)?);
            if layout == Layout::single() {
                assert!(best_of_n(&p, (&r, judge), &prompts, 2, 6, Sampling::Greedy, &[2], 1).unwrap_err().to_string().contains("greedy"));
                let other = model(&crate::LlamaConfig::tiny(64, 32, 1, 2, 1).with_num_labels(rcfg.num_labels).with_token_classifier(rcfg.token_classifier), 4)?;
                assert!(best_of_n(&p, (&other, judge), &prompts, 2, 6, sampling, &[2], 1).unwrap_err().to_string().contains("vocabulary"));
                let e = best_of_n(&p, (&model(wrong, 4)?, judge), &prompts, 2, 6, sampling, &[2], 1).unwrap_err().to_string();
                assert!(e.contains(if process { "not a process reward model" } else { "Judge::Process" }), "{e}");
            }
            best_of_n(&p, (&r, judge), &prompts, 4, 6, sampling, &[2], layout.dp)
        });
        out.into_iter().next().ok_or_else(|| candle_core::Error::Msg("no rank".into()))?
    };
    let one = go(Layout::single())?;
    if process {
        // (a reward is the least of the steps' probabilities of label 1)
        assert!(one.iter().flat_map(|b| &b.rewards).all(|&r| (0.0..=1.0).contains(&r)), "{one:?}");
    }
    assert_eq!(one.len(), 3);
    for b in &one {
        assert_eq!((b.completions.len(), b.rewards.len()), (4, 4));
        assert!(b.rewards.iter().all(|&r| r <= b.rewards[b.best]) && b.rewards.iter().any(|&r| r != b.rewards[0]), "{b:?}");
    }
    for layout in [Layout::cp(crate::CpKind::Zigzag, 2), Layout::single().with_tp(2, true).with_dp(2)] {
        for (a, b) in one.iter().zip(&go(layout)?) {
            assert_eq!((&a.completions, a.best), (&b.completions, b.best), "{layout}");
            assert!(a.rewards.iter().zip(&b.rewards).all(|(x, y)| (x - y).abs() < 1e-5 * x.abs().max(1.0)), "{layout}: {:?} vs {:?}", a.rewards, b.rewards);
        }
    }
    Ok(())
}
