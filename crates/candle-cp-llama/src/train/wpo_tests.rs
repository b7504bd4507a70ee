//! The policy-shaping tests through a micro-batch — LD-DPO's weighted sums
//! ([`crate::train::ld_dpo`]) and WPO's pair weights ([`crate::train::wpo`]): the linearised
//! loss against autograd with the weights by hand, and WPO's settings' rules.
use super::*;

/// On one device, the linearised node of LD-DPO and WPO has autograd's gradients of the loss
/// written with candle ops — LD-DPO: the policy's sums weighted per token by hand (a slot's
/// k-th scored target past its pair's shorter length weighs α), RPO's and sft's cross-entropy
/// over the plain sums; WPO: each pair's loss times `min(1, exp(m_c + m_r))`, `m` an answer's
/// mean of `log p − log Σ_v p_v²` over its scored tokens, `log Σ p²` from the full logits'
/// log-softmax (the model's head by hand), detached, the cross-entropy terms times the
/// weights' mean — for LD-DPO (α 0.25) with the sigmoid loss and RPO's α, IPO and MPO's mix
/// (sigmoid, bco_pair, sft), WPO with the sigmoid loss and RPO's α and with MPO's mix, and both
/// with IPO; its value is the loss, LD-DPO's differs from the unweighted one and WPO's weights
/// are not all 1.
#[test]
fn linearised_loss_has_the_gradients_of_ld_dpo_and_wpo() -> Result<()> {
    let set = PreferenceSet::read(&super::ld_dpo_tests::unequal_pairs_text(12, 3), &bytes_of, Some(2), None)?;
    let (seq, batch) = (64, 2);
    let rows: Vec<PreferenceRow> = (0..batch).map(|r| set.sample(seq, &mut Rng::new(40 + r as u64))).collect::<Result<_>>()?;
    let sigmoid = DpoConfig { beta: 0.3, rpo_alpha: 0.4, ..DpoConfig::default() };
    let mpo = DpoConfig { beta: 0.5, mix: vec![(DpoLoss::Sigmoid, 0.8), (DpoLoss::BcoPair, 0.2), (DpoLoss::Sft, 1.0)], ..DpoConfig::default() };
    let ipo = DpoConfig { beta: 0.3, loss: DpoLoss::Ipo, ..DpoConfig::default() };
    let ld = |c: &DpoConfig, a: f64| DpoConfig { ld_alpha: Some(a), ..c.clone() };
    let wpo = |c: DpoConfig| DpoConfig { use_weighting: true, ..c };
    for cfg in [ld(&sigmoid, 0.25), ld(&ipo, 0.25), ld(&mpo, 0.25), wpo(sigmoid.clone()), wpo(mpo.clone()), wpo(ld(&ipo, 0.5))] {
        cfg.validate()?;
        let out = run_ranks(1, |g| {
            let ctx = ParallelCtx::single(g)?;
            let one = OneDevice::new(&rows, seq, &ctx)?;
            let (b, labels, marks) = (&one.b, &one.labels, &one.marks);
            let mut rng = Rng::new(9);
            let reference: Vec<f64> = (0..2 * set.len()).map(|_| -20.0 - 10.0 * rng.below(1000) as f64 / 1000.0).collect();
            let answers = Answers { reference: reference.clone(), lengths: set.scored_lengths(), desirable: None };
            let (nll, sq) = one.m.token_nll_packed_stat(&one.sb.input_ids, &one.sb.labels, &one.sb.positions, &one.sb.documents, crate::head_loss::HeadStat::SumSq)?;
            let (nll, sq) = (nll.flatten_all()?, cfg.use_weighting.then_some(&sq));
            // (the node refuses a statistic it does not take, and WPO without one)
            let other = DpoConfig { use_weighting: !cfg.use_weighting, ..cfg.clone() };
            let mut running = crate::train::bco::RunningMean::default();
            assert!(b.loss((&nll, sq), labels, marks, &answers, &other, &ctx, ctx.token_group(), None, &mut running).is_err());
            let (loss, terms) = b.loss((&nll, sq), labels, marks, &answers, &cfg, &ctx, ctx.token_group(), None, &mut running)?;
            if cfg.ld_alpha.is_some() {
                // (the weighting matters here: the longer answers' tails are scored)
                let unweighted = b.loss((&nll, sq), labels, marks, &answers, &DpoConfig { ld_alpha: None, ..cfg.clone() }, &ctx, ctx.token_group(), None, &mut crate::train::bco::RunningMean::default())?.1;
                assert!((unweighted.loss - terms.loss).abs() > 1e-4, "{unweighted:?} vs {terms:?}");
            }
            let g1 = loss.backward()?;
            // log Σ p² by hand: the full logits of the model's forward
            let logits = one.m.forward_packed(&one.sb.input_ids, &one.sb.positions, &one.sb.documents)?.to_dtype(DType::F32)?;
            let lsm = candle_nn::ops::log_softmax(&logits.flatten_to(1)?, 1)?;
            let sq_hand = (lsm * 2.0)?.exp()?.sum(1)?.log()?;
            // the loss by candle ops
            let n1 = one.nll()?;
            let (_, scored) = b.logps(&n1.to_vec1::<f32>()?, labels, marks, &ctx, ctx.token_group())?;
            let slots = b.answers.len();
            let lengths = set.scored_lengths();
            let keep = Tensor::from_vec(scored.iter().map(|&s| (s > 0) as u8 as f32).collect::<Vec<_>>(), scored.len(), &Device::Cpu)?;
            let per_slot = |v: &[f64]| Tensor::from_vec(b.answers.iter().map(|&a| v[a] as f32).collect::<Vec<_>>(), slots, &Device::Cpu);
            let adjusted = slot_logps(&((n1.detach() + sq_hand)? * &keep)?, &scored, slots)?;
            let means: Vec<f32> = (adjusted / per_slot(&lengths)?)?.to_vec1()?;
            let pairs = b.pairs(false)?;
            let w: Vec<f64> = match cfg.use_weighting {
                true => pairs.iter().map(|&(c, r)| (means[c] as f64 + means[r] as f64).exp().min(1.0)).collect(),
                false => vec![1.0; pairs.len()],
            };
            assert!(!cfg.use_weighting || w.iter().any(|&x| x < 0.99) && w.iter().all(|&x| x > 0.0 && x <= 1.0), "{w:?}");
            let mut seen = vec![0usize; slots];
            let ld_weights: Vec<f32> = scored
                .iter()
                .map(|&s| {
                    if s == 0 {
                        return 0.0;
                    }
                    let a = b.answers[s as usize - 1];
                    seen[s as usize - 1] += 1;
                    match cfg.ld_alpha {
                        Some(al) if seen[s as usize - 1] as f64 > lengths[a].min(lengths[a ^ 1]) => al as f32,
                        _ => 1.0,
                    }
                })
                .collect();
            let plain = slot_logps(&n1, &scored, slots)?;
            let policy = slot_logps(&(&n1 * Tensor::from_vec(ld_weights, n1.shape(), &Device::Cpu)?)?, &scored, slots)?;
            let mut ratio = (&policy - per_slot(&reference)?)?;
            if cfg.loss == DpoLoss::Ipo {
                ratio = (ratio / per_slot(&lengths)?)?;
            }
            let idx = |f: fn(&(usize, usize)) -> usize| Tensor::from_vec(pairs.iter().map(|p| f(p) as u32).collect::<Vec<_>>(), pairs.len(), &Device::Cpu);
            let h = (ratio.index_select(&idx(|p| p.0)?, 0)? - ratio.index_select(&idx(|p| p.1)?, 0)?)?;
            let softplus = |x: &Tensor| -> Result<Tensor> { (x.exp()? + 1.0)?.log() };
            let tokens: f64 = pairs.iter().map(|p| lengths[b.answers[p.0]]).sum();
            let chosen_ce = (plain.index_select(&idx(|p| p.0)?, 0)?.sum_all()? * (-1.0 / tokens))?;
            let wt = Tensor::from_vec(w.iter().map(|&x| x as f32).collect::<Vec<_>>(), pairs.len(), &Device::Cpu)?;
            let w_mean = w.iter().sum::<f64>() / w.len() as f64;
            // per pair, weighted, then the mean; the cross-entropy terms times the weights' mean
            let mut direct = (&chosen_ce * (cfg.rpo_alpha * w_mean))?;
            for (l, lw) in cfg.losses() {
                let per_pair = match l {
                    DpoLoss::Ipo => (h.clone() - 1.0 / (2.0 * cfg.beta))?.sqr()?,
                    DpoLoss::BcoPair => {
                        let rewards = (&ratio * cfg.beta)?;
                        let delta = rewards.to_vec1::<f32>()?.iter().map(|&x| x as f64).sum::<f64>() / slots as f64;
                        let x = (rewards.index_select(&idx(|p| p.0)?, 0)? - delta)?;
                        let y = (rewards.index_select(&idx(|p| p.1)?, 0)? - delta)?;
                        (softplus(&x.neg()?)? + softplus(&y)?)?
                    }
                    DpoLoss::Sft => {
                        direct = (direct + (&chosen_ce * (lw * w_mean))?)?;
                        continue;
                    }
                    _ => softplus(&(&h * -cfg.beta)?)?,
                };
                direct = (direct + ((per_pair * &wt)?.mean_all()? * lw)?)?;
            }
            one.node_against(&loss, &g1, terms.loss, &direct)
        });
        let worst = out.into_iter().next().expect("one rank")?;
        assert!(worst < 1e-4, "{cfg:?}: gradients differ by {worst} relative");
    }
    Ok(())
}

/// WPO's settings: with pair losses other than orpo and aot, not sft alone; LD-DPO beside it.
#[test]
fn use_weighting_is_checked() -> Result<()> {
    let wpo = |loss: DpoLoss| DpoConfig { loss, use_weighting: true, ..DpoConfig::default() };
    for (cfg, says) in [
        (wpo(DpoLoss::Orpo), "not DPO's"),
        (wpo(DpoLoss::Aot), "sorted positions"),
        (DpoConfig { mix: vec![(DpoLoss::Sigmoid, 1.0), (DpoLoss::AotPair, 0.5)], ..wpo(DpoLoss::Sigmoid) }, "sorted positions"),
        (wpo(DpoLoss::Kto), "unpaired"),
        (wpo(DpoLoss::Sft), "sft loss alone"),
    ] {
        let e = cfg.validate().expect_err(says).to_string();
        assert!(e.contains(says), "{e}");
    }
    for ok in [wpo(DpoLoss::Sigmoid), DpoConfig { beta: 2.0, ..wpo(DpoLoss::Simpo) }, DpoConfig { ld_alpha: Some(0.5), ..wpo(DpoLoss::Hinge) }] {
        ok.validate()?;
    }
    Ok(())
}
