//! Tests of the reward model's pair loss ([`super::reward_terms`]).
use super::*;

/// The loss by hand (`−log σ(z)` and the centring term) and its derivatives against central
/// finite differences, with and without the coefficient; extreme margins stay finite.
#[test]
fn pair_loss_by_hand_and_by_finite_differences() -> Result<()> {
    let rewards = [0.7, -0.4, 1.3, 2.1, -3.0, 0.2];
    let pairs = [(0, 1), (2, 3), (5, 4)];
    for coef in [0.0, 0.01, 0.5] {
        let cfg = RewardConfig { center_rewards_coefficient: coef };
        let t = reward_terms(&rewards, &pairs, &cfg)?;
        let by_hand: f64 = pairs
            .iter()
            .map(|&(c, r)| {
                let z: f64 = rewards[c] - rewards[r];
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
            let fd = (reward_terms(&up, &pairs, &cfg)?.loss - reward_terms(&down, &pairs, &cfg)?.loss) / (2.0 * h);
            assert!((fd - t.d_reward[i]).abs() < 1e-7, "coef {coef}, reward {i}: {fd} vs {}", t.d_reward[i]);
        }
    }
    let far = reward_terms(&[800.0, -800.0], &[(0, 1), (1, 0)], &RewardConfig::default())?;
    assert!(far.loss.is_finite() && (far.loss - 800.0).abs() < 1e-9 && far.d_reward.iter().all(|d| d.is_finite()), "{far:?}");
    assert!(reward_terms(&[0.0], &[(0, 1)], &RewardConfig::default()).is_err());
    assert!(RewardConfig { center_rewards_coefficient: -1.0 }.validate().is_err());
    assert!(RewardConfig { center_rewards_coefficient: f64::NAN }.validate().is_err());
    Ok(())
}
