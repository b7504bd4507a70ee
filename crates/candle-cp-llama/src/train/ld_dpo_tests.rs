//! LD-DPO's tests ([`crate::train::ld_dpo`]): the weighted sums against each answer scored
//! alone, on every layout, and the linearised loss against autograd.
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
    let alone = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_params(&init_params(&mcfg, 6, DType::F32, &Device::Cpu)?, &mcfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
        (0..2 * set.len())
            .map(|d| {
                let (t, marks) = set.document(d);
                let ids = Tensor::from_vec(t.clone(), (1, t.len()), &Device::Cpu)?;
                let sb = shard_batch(&ids, &ctx)?;
                let nll: Vec<f32> = m.token_nll(&sb.input_ids, &sb.labels, &sb.positions)?.flatten_all()?.to_vec1()?;
                let scored: Vec<f64> = (0..t.len() - 1).filter(|&i| marks[i + 1]).map(|i| -(nll[i] as f64)).collect();
                Ok(scored.iter().zip(weights_alone(&set, d, alpha)).map(|(x, w)| x * w).sum())
            })
            .collect::<Result<Vec<f64>>>()
    });
    let alone = alone.into_iter().next().expect("one rank")?;
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

/// On one device, the linearised node of LD-DPO (α 0.25) has autograd's gradients of the loss
/// written with candle ops — the policy's sums weighted per token by hand (a slot's k-th scored
/// target past its pair's shorter length weighs α), RPO's and sft's cross-entropy over the
/// plain sums — for the sigmoid loss with RPO's α, IPO (the weighted sum per scored token) and
/// MPO's mix (sigmoid, bco_pair, sft); its value is the loss.
#[test]
fn linearised_loss_has_the_gradients_of_ld_dpo() -> Result<()> {
    let set = PreferenceSet::read(&unequal_pairs_text(12, 3), &bytes_of, Some(2), None)?;
    let (seq, batch, alpha) = (64, 2, 0.25);
    let rows: Vec<PreferenceRow> = (0..batch).map(|r| set.sample(seq, &mut Rng::new(40 + r as u64))).collect::<Result<_>>()?;
    let sigmoid = DpoConfig { beta: 0.3, rpo_alpha: 0.4, ld_alpha: Some(alpha), ..DpoConfig::default() };
    let ipo = DpoConfig { beta: 0.3, loss: DpoLoss::Ipo, ld_alpha: Some(alpha), ..DpoConfig::default() };
    let mpo = DpoConfig { beta: 0.5, mix: vec![(DpoLoss::Sigmoid, 0.8), (DpoLoss::BcoPair, 0.2), (DpoLoss::Sft, 1.0)], ld_alpha: Some(alpha), ..DpoConfig::default() };
    for cfg in [sigmoid, ipo, mpo] {
        cfg.validate()?;
        let out = run_ranks(1, |g| {
            let ctx = ParallelCtx::single(g)?;
            let one = OneDevice::new(&rows, seq, &ctx)?;
            let (b, labels, marks) = (&one.b, &one.labels, &one.marks);
            let mut rng = Rng::new(9);
            let reference: Vec<f64> = (0..2 * set.len()).map(|_| -20.0 - 10.0 * rng.below(1000) as f64 / 1000.0).collect();
            let answers = Answers { reference: reference.clone(), lengths: set.scored_lengths(), desirable: None };
            let mut running = crate::train::bco::RunningMean::default();
            let (loss, terms) = b.loss((&one.nll()?, None), labels, marks, &answers, &cfg, &ctx, ctx.token_group(), None, &mut running)?;
            let g1 = loss.backward()?;
            // the loss by candle ops: per-token weights by hand (one device: targets in order)
            let n1 = one.nll()?;
            let (_, scored) = b.logps(&n1.to_vec1::<f32>()?, labels, marks, &ctx, ctx.token_group())?;
            let slots = b.answers.len();
            let lengths = set.scored_lengths();
            let mut seen = vec![0usize; slots];
            let weights: Vec<f32> = scored
                .iter()
                .map(|&s| {
                    if s == 0 {
                        return 0.0;
                    }
                    let a = b.answers[s as usize - 1];
                    seen[s as usize - 1] += 1;
                    if seen[s as usize - 1] as f64 <= lengths[a].min(lengths[a ^ 1]) { 1.0 } else { alpha as f32 }
                })
                .collect();
            let plain = slot_logps(&n1, &scored, slots)?;
            let weighted = slot_logps(&(&n1 * Tensor::from_vec(weights, n1.shape(), &Device::Cpu)?)?, &scored, slots)?;
            let per_slot = |v: &[f64]| Tensor::from_vec(b.answers.iter().map(|&a| v[a] as f32).collect::<Vec<_>>(), slots, &Device::Cpu);
            let mut ratio = (&weighted - per_slot(&reference)?)?;
            if cfg.loss == DpoLoss::Ipo {
                ratio = (ratio / per_slot(&lengths)?)?;
            }
            let pairs = b.pairs(false)?;
            let idx = |f: fn(&(usize, usize)) -> usize| Tensor::from_vec(pairs.iter().map(|p| f(p) as u32).collect::<Vec<_>>(), pairs.len(), &Device::Cpu);
            let h = (ratio.index_select(&idx(|p| p.0)?, 0)? - ratio.index_select(&idx(|p| p.1)?, 0)?)?;
            let softplus = |x: &Tensor| -> Result<Tensor> { (x.exp()? + 1.0)?.log() };
            let tokens: f64 = pairs.iter().map(|p| lengths[b.answers[p.0]]).sum();
            let chosen_ce = (plain.index_select(&idx(|p| p.0)?, 0)?.sum_all()? * (-1.0 / tokens))?;
            let mut direct = (&chosen_ce * cfg.rpo_alpha)?;
            for (l, w) in cfg.losses() {
                let one = match l {
                    DpoLoss::Ipo => (h.clone() - 1.0 / (2.0 * cfg.beta))?.sqr()?.mean_all()?,
                    DpoLoss::BcoPair => {
                        let rewards = (&ratio * cfg.beta)?;
                        let delta = rewards.to_vec1::<f32>()?.iter().map(|&x| x as f64).sum::<f64>() / slots as f64;
                        let x = (rewards.index_select(&idx(|p| p.0)?, 0)? - delta)?;
                        let y = (rewards.index_select(&idx(|p| p.1)?, 0)? - delta)?;
                        (softplus(&x.neg()?)? + softplus(&y)?)?.mean_all()?
                    }
                    DpoLoss::Sft => chosen_ce.clone(),
                    _ => softplus(&(&h * -cfg.beta)?)?.mean_all()?,
                };
                direct = (direct + (one * w)?)?;
            }
            // (the weighting matters here: the longer answers' tails are scored)
            let unweighted = b.loss((&one.nll()?, None), labels, marks, &answers, &DpoConfig { ld_alpha: None, ..cfg.clone() }, &ctx, ctx.token_group(), None, &mut crate::train::bco::RunningMean::default())?.1;
            assert!((unweighted.loss - terms.loss).abs() > 1e-4, "{unweighted:?} vs {terms:?}");
            one.node_against(&loss, &g1, terms.loss, &direct)
        });
        let worst = out.into_iter().next().expect("one rank")?;
        assert!(worst < 1e-4, "{cfg:?}: gradients differ by {worst} relative");
    }
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
