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
