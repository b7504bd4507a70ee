//! LD-DPO's tests ([`crate::train::ld_dpo`]): the weighted sums against each answer scored
//! alone, on every layout, and the settings (the linearised loss against autograd:
//! `wpo_tests.rs`, with WPO's).
use super::*;

/// `n` byte-level pairs as `pairs_text`'s, the rejected answer 1 to 7 random capitals (most
/// pairs' answers of unequal lengths).
pub(crate) fn unequal_pairs_text(n: usize, seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut text = String::new();
    for _ in 0..n {
        let p: String = (0..2 + rng.below(6)).map(|_| (b'a' + rng.below(12) as u8) as char).collect();
        let c: String = p.chars().rev().map(|x| x.to_ascii_uppercase()).collect();
        let r: String = (0..1 + rng.below(7)).map(|_| (b'A' + rng.below(12) as u8) as char).collect();
        text.push_str(&format!("{{\"prompt\": \"{p}=\", \"chosen\": \"{c}\", \"rejected\": \"{r}\"}}\n"));
    }
    text
}

/// Answer `d`'s token weights by LD-DPO with `alpha` from the set alone: its k-th scored token
/// (from 1) weighs 1 up to the fewer scored tokens of it and its pair's other answer, α past.
fn weights_alone(set: &PreferenceSet, d: usize, alpha: f64) -> Vec<f64> {
    let lengths = set.scored_lengths();
    let public = lengths[d].min(lengths[d ^ 1]) as usize;
    (1..=lengths[d] as usize).map(|k| if k <= public { 1.0 } else { alpha }).collect()
}

/// With α, every answer's weighted sum equals the sum over its document run alone, its scored
/// tokens weighed by [`weights_alone`] (the pair's lengths apart: the chosen and rejected
/// answers differ in length in the data), on one device, zigzag CP 2 (tokens on two ranks and
/// a pair cut between them) and ring CP 2 × DP 2; the plain sums are those of `answer_logps`;
/// α 1 gives the plain sums.
#[test]
fn weighted_logps_are_per_document_on_every_layout() -> Result<()> {
    let set = PreferenceSet::read(&unequal_pairs_text(7, 5), &bytes_of, Some(2), None)?;
    let lengths = set.scored_lengths();
    assert!((0..set.len()).filter(|p| lengths[2 * p] != lengths[2 * p + 1]).count() >= 3, "{lengths:?}");
    let mcfg = model_cfg();
    let alpha = 0.3;
    let by_layout = |layout: Layout, a: f64| -> Result<(Vec<f64>, Vec<f64>)> {
        let out = run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_params(&init_params(&mcfg, 6, DType::F32, &Device::Cpu)?, &mcfg, &ctx)?;
            let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
            let p = policy_logps(&m, &set, 2, 48, &DpoConfig { ld_alpha: Some(a), ..DpoConfig::default() }, &ctx, &Device::Cpu)?;
            assert_eq!(p.plain, answer_logps(&m, &set, 2, 48, &ctx, &Device::Cpu)?);
            assert_eq!(p.wpo, None);
            Ok((p.plain, p.ld.expect("weighted sums")))
        });
        let mut all = out.into_iter().collect::<Result<Vec<_>>>()?;
        for r in &all[1..] {
            assert_eq!(r, &all[0], "{layout}: ranks agree");
        }
        Ok(all.remove(0))
    };
    let alone: Vec<f64> = scored_alone(&set, &mcfg, 6)?.iter().enumerate().map(|(d, t)| t.iter().zip(weights_alone(&set, d, alpha)).map(|(x, w)| x * w).sum()).collect();
    let (plain, one) = by_layout(Layout::single(), alpha)?;
    for (d, (a, b)) in one.iter().zip(&alone).enumerate() {
        assert!((a - b).abs() < 1e-4, "answer {d}: packed {a} vs alone {b}");
    }
    assert!(one.iter().zip(&plain).filter(|(a, b)| (*a - *b).abs() > 1e-3).count() >= 3, "α changes the longer answers");
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2)] {
        let (p, w) = by_layout(layout, alpha)?;
        for d in 0..one.len() {
            assert!((one[d] - w[d]).abs() < 1e-4 && (plain[d] - p[d]).abs() < 1e-4, "{layout}, answer {d}: {} {} vs one device {} {}", w[d], p[d], one[d], plain[d]);
        }
    }
    let (p, w) = by_layout(Layout::single(), 1.0)?;
    assert_eq!(p, w, "α 1: the plain sums");
    Ok(())
}

/// LD-DPO's settings: α in [0, 1], with pair losses other than orpo and not sft alone; α 1
/// and no α give the same terms.
#[test]
fn ld_alpha_is_checked_and_one_is_plain_dpo() -> Result<()> {
    for (cfg, says) in [
        (DpoConfig { ld_alpha: Some(1.5), ..DpoConfig::default() }, "[0, 1]"),
        (DpoConfig { ld_alpha: Some(-0.1), ..DpoConfig::default() }, "[0, 1]"),
        (DpoConfig { ld_alpha: Some(0.5), loss: DpoLoss::Orpo, ..DpoConfig::default() }, "orpo loss compares mean"),
        (DpoConfig { ld_alpha: Some(0.5), loss: DpoLoss::Kto, ..DpoConfig::default() }, "unpaired"),
        (DpoConfig { ld_alpha: Some(0.5), loss: DpoLoss::Sft, ..DpoConfig::default() }, "sft loss alone"),
    ] {
        let e = cfg.validate().expect_err(says).to_string();
        assert!(e.contains(says), "{e}");
    }
    DpoConfig { ld_alpha: Some(0.0), loss: DpoLoss::Simpo, beta: 2.0, ..DpoConfig::default() }.validate()?;
    let policy = [-3.0, -5.5, -2.0, -1.0];
    let answers = Answers { reference: vec![-4.0, -4.0, -2.5, -0.5], lengths: vec![3.0, 5.0, 2.0, 2.0], desirable: None };
    let (of, pairs) = ([0, 1, 2, 3], [(0, 1), (2, 3)]);
    let cfg = DpoConfig { rpo_alpha: 0.3, mix: vec![(DpoLoss::Sigmoid, 1.0), (DpoLoss::Sft, 0.5)], ..DpoConfig::default() };
    let plain = terms(&policy, &answers, &of, &pairs, &cfg, None)?;
    let (t, d_plain) = crate::train::ld_dpo::shaped_terms(&policy, Some(&policy), None, &answers, &of, &pairs, &cfg, None)?;
    assert!((t.loss - plain.loss).abs() < 1e-12 && t.accuracy == plain.accuracy && (t.margin - plain.margin).abs() < 1e-12, "{t:?} vs {plain:?}");
    for (i, (a, b)) in t.d_logp.iter().zip(&d_plain).enumerate() {
        assert!((a + b - plain.d_logp[i]).abs() < 1e-12, "answer {i}: {a} + {b} vs {}", plain.d_logp[i]);
    }
    Ok(())
}
