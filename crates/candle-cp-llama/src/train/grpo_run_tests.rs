use super::*;
use crate::sampling::Sampling;
use crate::train::grpo::{GrpoLoss, ScaleRewards};
use crate::train::{DataSource, TrainConfig};
use crate::{init_params, shard_params, CpKind, Layout, LlamaConfig};
use candle_cp_comm::run_ranks;
use candle_nn::VarBuilder;
use std::sync::Arc;
use crate::train::grpo::tests::{capitals, grad_gap, reverse_prompts, run, straight_and_resumed, tiny_run};

/// The clipped surrogate: inside the range `−r·a` with derivative `r·a` with respect to the
/// loss; a positive advantage clipped above `1 + ε_high`, a negative one below `1 − ε` (value
/// from the clip, derivative 0); the other sides unclipped; with the two-sided cap δ 1.5 a
/// negative advantage's ratio above δ held at δ (derivative 0); the derivative the finite
/// difference of the value in `nll` (`r = e^(old − nll)`).
#[test]
fn clipped_surrogate_follows_trls_min() {
    let eps = (0.2, 0.28);
    for delta in [None, Some(1.5)] {
        for (r, a, clipped) in [(1.1, 2.0, false), (1.3, 2.0, true), (1.3, -2.0, false), (0.7, -1.0, true), (0.7, 1.0, false), (1.25, 0.5, false), (0.85, -0.5, false), (2.0, -1.0, false), (2.0, 1.0, true)] {
            let (g, v, c) = clipped_surrogate(r, a, eps, delta);
            assert_eq!(c, clipped, "r {r} a {a}");
            let r1 = delta.map_or(r, |d: f64| r.min(d));
            let want = -(r1 * a).min(r.clamp(1.0 - eps.0, 1.0 + eps.1) * a);
            assert!((v - want).abs() < 1e-15, "r {r} a {a}: {v} vs {want}");
            // ∂/∂nll by central differences (log r = old − nll)
            let h = 1e-6;
            let at = |dn: f64| clipped_surrogate(r * (-dn).exp(), a, eps, delta).1;
            let fd = (at(h) - at(-h)) / (2.0 * h);
            assert!((g - fd).abs() < 1e-6, "r {r} a {a} δ {delta:?}: derivative {g} vs {fd}");
        }
    }
    // (the cap holds: a negative advantage at r 2 under δ 1.5 pushes no more)
    assert_eq!(clipped_surrogate(2.0, -1.0, eps, Some(1.5)), (0.0, 1.5, false));
}

/// SAPO's gate: its value `−σ(τ(r − 1))·4/τ·a` with `τ_pos` for a positive advantage and
/// `τ_neg` for a negative one, its derivative in `nll` the central difference of the value
/// (`a` at the ratio 1, GRPO's), fading far from 1, never clipped.
#[test]
fn sapo_gate_follows_its_formula() {
    let taus = (1.0, 1.05);
    for (r, a) in [(1.0, 2.0), (1.0, -1.0), (1.3, 2.0), (0.7, -1.0), (2.5, 1.0), (0.2, -0.5), (1.1, 0.0)] {
        let (g, v, c) = sapo_term(r, a, taus);
        let tau: f64 = if a > 0.0 { taus.0 } else { taus.1 };
        let s = 1.0 / (1.0 + (-tau * (r - 1.0)).exp());
        assert!((v + s * 4.0 / tau * a).abs() < 1e-15 && !c, "r {r} a {a}: {v}");
        let h = 1e-6;
        let at = |dn: f64| sapo_term(r * (-dn).exp(), a, taus).1;
        let fd = (at(h) - at(-h)) / (2.0 * h);
        assert!((g - fd).abs() < 1e-6, "r {r} a {a}: derivative {g} vs {fd}");
    }
    assert!((sapo_term(1.0, 2.0, taus).0 - 2.0).abs() < 1e-15 && (sapo_term(1.0, -1.0, taus).0 + 1.0).abs() < 1e-15);
    // (far from the ratio 1 the gradient fades; faster for a negative advantage at τ_neg > τ_pos)
    assert!(sapo_term(8.0, 1.0, (1.0, 3.0)).0 < 0.1 && sapo_term(8.0, -1.0, (1.0, 3.0)).0.abs() < sapo_term(8.0, 1.0, (1.0, 3.0)).0);
}

pub(super) fn grpo_cfg(level: ImportanceLevel, num_iterations: usize) -> GrpoConfig {
    GrpoConfig {
        num_generations: 4,
        max_completion_length: 6,
        loss_type: GrpoLoss::Bnpo,
        scale_rewards: ScaleRewards::None,
        num_iterations,
        epsilon_high: 0.28,
        importance_sampling_level: level,
        ..GrpoConfig::new(2, capitals(), vec![2], 7)
    }
}

/// The autograd tests' micro-batch on one device: the policy (seed 5) and another model (seed
/// 6), one rollout of `set` by the policy (2 rows of 48) weighed, its rows sharded as the
/// trainer shards them, with the shard's labels and marks.
struct OneMicro {
    vm: candle_nn::VarMap,
    m: Llama,
    other: Llama,
    r: Rollout,
    sb: crate::ShardedBatch,
    labels: Vec<u32>,
    marks: Vec<u32>,
}

fn one_micro(mcfg: &LlamaConfig, cfg: &GrpoConfig, set: &PromptSet, ctx: &ParallelCtx) -> Result<OneMicro> {
    let dev = Device::Cpu;
    let model = |seed: u64| -> Result<(candle_nn::VarMap, Llama)> {
        let vm = shard_params(&init_params(mcfg, seed, DType::F32, &dev)?, mcfg, ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &dev), mcfg, ctx)?;
        Ok((vm, m))
    };
    let ((vm, m), (_, other)) = (model(5)?, model(6)?);
    let mut step = [super::super::grpo_sample::rollouts(&m, cfg, set, 3, (0, 1), (2, 48), None)?.remove(0)];
    super::super::grpo::weigh_step(&mut step, cfg)?;
    let [r] = step;
    let ids = Tensor::from_vec(r.rows.iter().flat_map(|s| s.tokens.iter().copied()).collect::<Vec<_>>(), (2, 48), &dev)?;
    let marks: Vec<u32> = r.rows.iter().flat_map(|s| s.long_range.iter().map(|&b| b as u32)).collect();
    let docs: Vec<_> = r.rows.iter().map(|s| s.documents.clone().expect("documents")).collect();
    let sb = crate::packed::shard_batch_packed(&ids, &docs, ctx)?;
    let labels: Vec<u32> = sb.labels.flatten_all()?.to_vec1()?;
    let marks: Vec<u32> = shard_batch(&Tensor::from_vec(marks, (2, 48), &dev)?, ctx)?.labels.flatten_all()?.to_vec1()?;
    Ok(OneMicro { vm, m, other, r, sb, labels, marks })
}

/// With `π_old` recorded (here another model's per-token losses, so the ratios spread past the
/// clip range on both sides), the node's value is TRL's clipped loss and its gradient the
/// autograd gradient of `Σ_i k_i·Σ_t −min(ρ·A_i, clip(ρ)·A_i)` — per token, and per sequence
/// (GSPO: `ρ_i = exp(mean_t(old − nll))`, through the mean) —, or of CISPO's
/// `−sg(min(ρ, 1.1))·A·log π`, or of SAPO's `−σ(τ(ρ − 1))·(4/τ)·A` (τ 4 / 6; per token and per
/// sequence; at the ratio 1 GRPO's gradient), with the KL term (β 0.05); the
/// clipped fraction is the tokens' where the clip holds; `π_old` recorded from the policy's
/// own losses gives the ratio 1 (the loss of no ratio).
#[test]
fn clipped_loss_follows_autograd() -> Result<()> {
    let set = reverse_prompts(6, 1)?;
    let mcfg = LlamaConfig::tiny(128, 32, 1, 2, 1);
    for (level, loss_type) in [(ImportanceLevel::Token, GrpoLoss::Bnpo), (ImportanceLevel::Sequence, GrpoLoss::Bnpo), (ImportanceLevel::Token, GrpoLoss::Cispo), (ImportanceLevel::Token, GrpoLoss::Sapo), (ImportanceLevel::Sequence, GrpoLoss::Sapo)] {
        let (cispo, sapo) = (loss_type == GrpoLoss::Cispo, loss_type == GrpoLoss::Sapo);
        // (GSPO's clip range is narrow: a sequence's mean log-ratio moves little; CISPO's
        // epsilon_high is the ratio's cap)
        let (epsilon, epsilon_high) = match (level, cispo) {
            (_, true) => (0.2, 1.1),
            (ImportanceLevel::Token, _) => (0.2, 0.28),
            (ImportanceLevel::Sequence, _) => (0.03, 0.04),
        };
        // (per token, INTELLECT-2's cap too)
        let delta = (level == ImportanceLevel::Token && loss_type == GrpoLoss::Bnpo).then_some(1.5);
        // (SAPO: steep gates, so that they bend over the ratios' spread)
        let cfg = GrpoConfig { beta: 0.05, epsilon, epsilon_high, delta, loss_type, sapo_temperatures: (4.0, 6.0), ..grpo_cfg(level, 2) };
        let out = run_ranks(1, |g| {
            let ctx = ParallelCtx::single(g)?;
            let dev = Device::Cpu;
            let OneMicro { vm, m, other: old_model, mut r, sb, labels, marks } = one_micro(&mcfg, &cfg, &set, &ctx)?;
            let nll = m.token_nll_packed(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents)?.flatten_all()?;
            let old: Vec<f32> = old_model.token_nll_packed(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents)?.flatten_all()?.to_vec1()?;
            // (the reference: the old model too)
            let own: Vec<f32> = nll.to_vec1()?;
            let no_ratio = r.loss((&nll, &own), (Some(&old), None), &cfg, (&labels, &marks), &ctx, ctx.token_group())?;
            r.record_old(&own, &ctx, ctx.token_group())?;
            let unit = r.loss((&nll, &own), (Some(&old), None), &cfg, (&labels, &marks), &ctx, ctx.token_group())?;
            assert!((unit.value - no_ratio.value).abs() < 1e-6 && unit.clipped == Some(0.0), "ratio 1: {} vs {}", unit.value, no_ratio.value);
            // (SAPO at the ratio 1: GRPO's gradient, the value −(2/τ)·A per token)
            if sapo {
                let plain = GrpoConfig { loss_type: GrpoLoss::Dapo, ..cfg.clone() };
                let (gs, gp) = (unit.node.backward()?, r.loss((&nll, &own), (Some(&old), None), &plain, (&labels, &marks), &ctx, ctx.token_group())?.node.backward()?);
                assert!(grad_gap(&vm, &gs, &gp)? < 1e-5, "SAPO at the ratio 1 is GRPO's gradient");
            }
            r.record_old(&old, &ctx, ctx.token_group())?;
            let t = r.loss((&nll, &own), (Some(&old), None), &cfg, (&labels, &marks), &ctx, ctx.token_group())?;
            // by autograd: per position its completion (slots), A and k
            let slots: Vec<u32> = shard_batch(&r.slots, &ctx)?.labels.flatten_all()?.to_vec1()?;
            let n = slots.len();
            let c = r.rewards.len();
            let on = |i: usize| slots[i] > 0 && labels[i] != crate::IGNORE && marks[i] == 1;
            let col = |f: &dyn Fn(usize) -> f32| Tensor::from_vec((0..n).map(f).collect::<Vec<f32>>(), n, &dev);
            let a = col(&|i| if on(i) { r.advantages[slots[i] as usize - 1] as f32 } else { 0.0 })?;
            let k = col(&|i| if on(i) { r.norms[slots[i] as usize - 1] as f32 } else { 0.0 })?;
            let keep = col(&|i| on(i) as u8 as f32)?;
            let old_t = Tensor::from_vec(old.clone(), n, &dev)?;
            let log_ratio = ((&old_t - &nll)? * &keep)?;
            let ratio = match level {
                ImportanceLevel::Token => log_ratio.exp()?,
                ImportanceLevel::Sequence => {
                    // [n, C] one-hot of each position's completion over its length
                    let mut onehot = vec![0f32; n * c];
                    for i in (0..n).filter(|&i| on(i)) {
                        let s = slots[i] as usize - 1;
                        onehot[i * c + s] = 1.0 / r.lengths[s] as f32;
                    }
                    let oh = Tensor::from_vec(onehot.clone(), (n, c), &dev)?;
                    // [1, C]: each completion's mean log-ratio
                    let mean = log_ratio.unsqueeze(0)?.matmul(&oh)?;
                    let back = Tensor::from_vec(onehot.iter().map(|&x| (x > 0.0) as u8 as f32).collect::<Vec<_>>(), (n, c), &dev)?;
                    mean.exp()?.broadcast_mul(&back)?.sum(1)?
                }
            };
            let ratio = ratio.reshape(n)?;
            let clip = ratio.clamp(1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high)?;
            let capped = match cfg.delta {
                Some(d) => ratio.minimum(d)?,
                None => ratio.clone(),
            };
            let surrogate = match (cispo, sapo) {
                // (CISPO: −sg(min(ρ, cap))·A·log π)
                (true, _) => ((ratio.minimum(cfg.epsilon_high)?.detach() * &a)? * &nll)?,
                // (SAPO: −σ(τ·(ρ − 1))·(4/τ)·A, τ by the advantage's sign)
                (_, true) => {
                    let (tp, tn) = cfg.sapo_temperatures;
                    let tau = col(&|i| if on(i) && r.advantages[slots[i] as usize - 1] > 0.0 { tp as f32 } else { tn as f32 })?;
                    let gate = ((((&ratio - 1.0)? * &tau)?.neg()?.exp()? + 1.0)?.recip()? * 4.0)?.div(&tau)?;
                    (gate * &a)?.neg()?
                }
                _ => capped.mul(&a)?.minimum(&clip.mul(&a)?)?.neg()?,
            };
            let surrogate = (surrogate * &keep)?;
            let d = (&nll - &old_t)?;
            let k3 = (((d.exp()? - &d)? - 1.0)? * &keep)?;
            let direct = ((surrogate + (k3 * cfg.beta)?)? * &k)?.sum_all()?;
            let want = direct.to_scalar::<f32>()? as f64;
            assert!((t.value - want).abs() < 1e-5 * want.abs().max(1.0), "{level:?}: value {} vs {want}", t.value);
            assert!((t.node.to_scalar::<f32>()? as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
            // the clipped fraction by hand
            let (rv, av): (Vec<f32>, Vec<f32>) = (ratio.to_vec1()?, a.to_vec1()?);
            let counted: Vec<usize> = (0..n).filter(|&i| on(i)).collect();
            let clipped = match (cispo, sapo) {
                (true, _) => counted.iter().filter(|&&i| av[i] > 0.0 && rv[i] as f64 > cfg.epsilon_high).count(),
                (_, true) => 0,
                _ => counted.iter().filter(|&&i| (av[i] > 0.0 && rv[i] as f64 > 1.0 + cfg.epsilon_high) || (av[i] < 0.0 && (rv[i] as f64) < 1.0 - cfg.epsilon)).count(),
            } as f64
                / counted.len() as f64;
            assert!(t.clipped.is_some_and(|x| (x - clipped).abs() < 1e-12), "{level:?}: clipped {:?} vs {clipped}", t.clipped);
            let (g1, g2) = (t.node.backward()?, direct.backward()?);
            Ok((grad_gap(&vm, &g1, &g2)?, clipped))
        });
        let (worst, clipped) = out.into_iter().next().expect("one rank")?;
        assert!(worst < 1e-4, "{level:?}: gradients differ by {worst} relative");
        assert!((clipped > 0.0 || loss_type == GrpoLoss::Sapo) && clipped < 1.0, "{level:?}: the ratios spread past the clip range on some tokens only: {clipped}");
    }
    Ok(())
}

/// `num_iterations` 2: the completions of steps 1, 3 train steps 2, 4 again (the same rewards
/// and lengths), step 1's and 3's ratio 1 (no clip fraction), step 2's and 4's clipped ratio
/// (a fraction reported, step 2's strictly between 0 and 1); zigzag CP 2, ring CP 2 × DP 2 and
/// TP 2 + SP follow one device, per token, per sequence, per token on the top half of the
/// tokens by entropy (TP: the entropies over a vocabulary split by TP), and under CISPO and SAPO; a run killed after step 2 and resumed from step 1's checkpoint
/// (which keeps step 1's completions and π_old) reproduces the straight run on its layout and
/// on one device; a checkpoint without them is refused by name.
#[test]
fn iterations_reuse_completions_on_every_layout() -> Result<()> {
    let set = reverse_prompts(8, 2)?;
    let with = |layout: Layout, level: ImportanceLevel| -> TrainConfig {
        let mut c = tiny_run(layout, DataSource::Prompts(set.clone()), 4, (2, 2));
        c.schedule.peak = 4e-3;
        c.grpo = Some(GrpoConfig { loss_type: GrpoLoss::Grpo, scale_rewards: ScaleRewards::Group, sampling: Sampling::Sample { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 7 }, ..grpo_cfg(level, 2) });
        c
    };
    let with_q = |layout: Layout, level: ImportanceLevel, q: f64, loss: GrpoLoss| -> TrainConfig {
        let mut c = with(layout, level);
        if let Some(g) = c.grpo.as_mut() {
            g.top_entropy_quantile = q;
            match loss {
                GrpoLoss::Cispo => (g.loss_type, g.epsilon_high) = (GrpoLoss::Cispo, 1.1),
                GrpoLoss::Sapo => (g.loss_type, g.sapo_temperatures) = (GrpoLoss::Sapo, (4.0, 6.0)),
                _ => {}
            }
        }
        c
    };
    for (level, q, loss) in [(ImportanceLevel::Token, 1.0, GrpoLoss::Grpo), (ImportanceLevel::Sequence, 1.0, GrpoLoss::Grpo), (ImportanceLevel::Token, 0.5, GrpoLoss::Grpo), (ImportanceLevel::Token, 1.0, GrpoLoss::Cispo), (ImportanceLevel::Token, 1.0, GrpoLoss::Sapo)] {
        let (cispo, sapo) = (loss == GrpoLoss::Cispo, loss == GrpoLoss::Sapo);
        let with = |layout: Layout, level: ImportanceLevel| with_q(layout, level, q, loss);
        let one = run(&with(Layout::single(), level))?;
        let m = &one[0].metrics;
        assert_eq!((m[0].grpo_reward, m[0].completion_length), (m[1].grpo_reward, m[1].completion_length), "{level:?}: step 2 trains on step 1's completions");
        assert_eq!((m[2].grpo_reward, m[2].completion_length), (m[3].grpo_reward, m[3].completion_length));
        // (SAPO clips nothing: its fraction 0)
        assert!(m[0].grpo_clip_ratio.is_none() && m[2].grpo_clip_ratio.is_none() && m[1].grpo_clip_ratio.is_some_and(|c| if sapo { c == 0.0 } else { c > 0.0 && c < 1.0 }) && m[3].grpo_clip_ratio.is_some(), "{level:?}: step 2's clip holds on some tokens: {m:?}");
        // (after an update the ratio is no longer 1: the loss of group-scaled grpo leaves 0;
        // half the tokens' terms are not 0 at the ratio 1 either)
        assert!((q < 1.0 || cispo || sapo || m[0].train_loss.abs() < 1e-6) && m[1].train_loss.abs() > 1e-6, "{m:?}");
        for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::single().with_tp(2, true)] {
            let other = run(&with(layout, level))?;
            for (a, b) in m.iter().zip(&other[0].metrics) {
                assert_eq!((a.grpo_reward, a.completion_length), (b.grpo_reward, b.completion_length), "{layout} {level:?} step {}: the same completions", a.step);
                assert!((a.grad_norm - b.grad_norm).abs() < 1e-4 * a.grad_norm.max(1.0), "{layout} {level:?} step {}: |g| {} vs {}", a.step, b.grad_norm, a.grad_norm);
                assert!((a.train_loss - b.train_loss).abs() < 1e-5, "{layout} {level:?} step {}: loss {} vs {}", a.step, b.train_loss, a.train_loss);
                assert!(a.grpo_clip_ratio.zip(b.grpo_clip_ratio).is_none_or(|(x, y)| (x - y).abs() < 0.05), "{layout} {level:?} step {}: clipped {:?} vs {:?}", a.step, b.grpo_clip_ratio, a.grpo_clip_ratio);
            }
        }
    }
    // killed after step 2, resumed from step 1's checkpoint (mid-generation)
    let dir = |tag: &str| std::env::temp_dir().join(format!("cp-grpo-iter-{tag}-{}", std::process::id()));
    let (da, db) = (dir("a"), dir("b"));
    let mut ca = with(Layout::cp(CpKind::Zigzag, 2), ImportanceLevel::Token);
    (ca.out, ca.save_every) = (Some(da.clone()), 1);
    let a = run(&ca)?;
    let mut cb = ca.clone();
    (cb.out, cb.save_every, cb.stop_after) = (Some(db.clone()), 1, Some(2));
    run(&cb)?;
    let ckpt = |root: &std::path::Path, step: usize| root.join("checkpoints").join(super::super::checkpoint::checkpoint_name(step));
    assert!((1..=4).all(|s| ckpt(&da, s).join(KEPT_FILE).exists() == (s % 2 == 1)), "the kept completions in the checkpoints inside a generation (steps 1, 3) only");
    (cb.stop_after, cb.resume) = (None, true);
    let b = run(&cb)?;
    assert_eq!(b[0].start_step, 1);
    for (x, y) in a[0].metrics[1..].iter().zip(&b[0].metrics) {
        assert!(x.step == y.step && (x.train_loss - y.train_loss).abs() < 1e-9 && x.grpo_reward == y.grpo_reward && x.grpo_clip_ratio == y.grpo_clip_ratio, "step {}: straight {x:?} vs resumed {y:?}", x.step);
    }
    // (resumed on one device from the zigzag run's step-1 checkpoint)
    let mut cs = with(Layout::single(), ImportanceLevel::Token);
    (cs.out, cs.resume) = (Some(da.clone()), true);
    // (every checkpoint after step 1's dropped: the run resumes from it)
    let back_to_1 = |root: &std::path::Path| -> Result<()> {
        for (step, p) in super::super::checkpoint::list_checkpoints(root.join("checkpoints"))? {
            if step > 1 {
                std::fs::remove_dir_all(p)?;
            }
        }
        Ok(std::fs::write(root.join("checkpoints").join("latest"), super::super::checkpoint::checkpoint_name(1))?)
    };
    back_to_1(&da)?;
    let s = run(&cs)?;
    for (x, y) in a[0].metrics[1..].iter().zip(&s[0].metrics) {
        assert!(x.grpo_reward == y.grpo_reward && (x.train_loss - y.train_loss).abs() < 1e-5 && (x.grad_norm - y.grad_norm).abs() < 1e-4 * x.grad_norm.max(1.0), "one device, step {}: {x:?} vs {y:?}", x.step);
    }
    // a mid-generation checkpoint without its completions
    back_to_1(&da)?;
    std::fs::remove_file(ckpt(&da, 1).join(KEPT_FILE))?;
    let e = run(&cs).unwrap_err().to_string();
    assert!(e.contains("resume from a checkpoint written with them"), "{e}");
    std::fs::remove_dir_all(&da)?;
    std::fs::remove_dir_all(&db)?;
    let mut bad = with(Layout::single(), ImportanceLevel::Token);
    bad.grpo = Some(GrpoConfig { epsilon: 1.0, ..grpo_cfg(ImportanceLevel::Token, 2) });
    assert!(run(&bad).unwrap_err().to_string().contains("clip range"));
    bad.grpo = Some(GrpoConfig { num_iterations: 0, ..grpo_cfg(ImportanceLevel::Token, 2) });
    assert!(run(&bad).unwrap_err().to_string().contains("num_iterations and steps_per_generation must be ≥ 1"));
    Ok(())
}

/// `steps_per_generation` 2: the completions sampled at steps 1 and 3 feed steps 1–2 and 3–4
/// (slices of one generation batch); steps 2 and 4 train on off-policy slices whose `π_old` is
/// the sampling policy's forward at steps 1 and 3: with a learning rate of 0 their every ratio
/// is 1 (nothing clipped, group-scaled grpo's loss 0), with one the ratio moves; with
/// num_iterations 2 too (a cycle of 4 steps, steps 2–4 with ratios); zigzag CP 2, ring CP 2 ×
/// DP 2 and TP 2 + SP follow one device; a run killed inside the cycle and resumed from step
/// 1's checkpoint (its four micro-batches and their `π_old` kept) follows the straight run; 0
/// refused.
#[test]
fn steps_per_generation_slices_one_generation() -> Result<()> {
    let set = reverse_prompts(8, 2)?;
    let with = |layout: Layout, (spg, iters): (usize, usize), peak: f64| -> TrainConfig {
        let mut c = tiny_run(layout, DataSource::Prompts(set.clone()), 4, (2, 2));
        c.schedule.peak = peak;
        c.grpo = Some(GrpoConfig { loss_type: GrpoLoss::Grpo, scale_rewards: ScaleRewards::Group, sampling: Sampling::Sample { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 7 }, steps_per_generation: spg, ..grpo_cfg(ImportanceLevel::Token, iters) });
        c
    };
    let frozen = run(&with(Layout::single(), (2, 1), 0.0))?;
    let m = &frozen[0].metrics;
    assert!(m[0].grpo_clip_ratio.is_none() && m[2].grpo_clip_ratio.is_none() && m[1].grpo_clip_ratio == Some(0.0) && m[3].grpo_clip_ratio == Some(0.0), "lr 0: the later slices' ratio 1: {m:?}");
    assert!(m.iter().all(|x| x.train_loss.abs() < 1e-6), "lr 0: group-scaled grpo at the ratio 1: {m:?}");
    for (spg, iters) in [(2, 1), (2, 2)] {
        let one = run(&with(Layout::single(), (spg, iters), 4e-3))?;
        let m = &one[0].metrics;
        let with_ratio: Vec<bool> = m.iter().map(|x| x.grpo_clip_ratio.is_some()).collect();
        assert_eq!(with_ratio, if iters == 1 { vec![false, true, false, true] } else { vec![false, true, true, true] }, "{m:?}");
        assert!(m[1].train_loss.abs() > 1e-6 && m[1].grpo_clip_ratio.is_some_and(|c| c < 1.0), "step 2 off-policy: {m:?}");
        for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::single().with_tp(2, true)] {
            let other = run(&with(layout, (spg, iters), 4e-3))?;
            for (a, b) in m.iter().zip(&other[0].metrics) {
                assert_eq!((a.grpo_reward, a.completion_length), (b.grpo_reward, b.completion_length), "{layout} S {spg} μ {iters} step {}: the same completions", a.step);
                assert!((a.grad_norm - b.grad_norm).abs() < 1e-4 * a.grad_norm.max(1.0), "{layout} S {spg} μ {iters} step {}: |g| {} vs {}", a.step, b.grad_norm, a.grad_norm);
                assert!((a.train_loss - b.train_loss).abs() < 1e-5, "{layout} S {spg} μ {iters} step {}: loss {} vs {}", a.step, b.train_loss, a.train_loss);
            }
        }
    }
    // killed inside the cycle, resumed from step 1's checkpoint
    let (a, b) = straight_and_resumed(&with(Layout::cp(CpKind::Zigzag, 2), (2, 1), 4e-3), "spg", 1, 2)?;
    assert_eq!(b[0].start_step, 1);
    for (x, y) in a[0].metrics[1..].iter().zip(&b[0].metrics) {
        assert!(x.step == y.step && (x.train_loss - y.train_loss).abs() < 1e-9 && x.grpo_reward == y.grpo_reward && x.grpo_clip_ratio == y.grpo_clip_ratio, "step {}: straight {x:?} vs resumed {y:?}", x.step);
    }
    let mut bad = with(Layout::single(), (0, 1), 4e-3);
    bad.steps = 1;
    assert!(run(&bad).unwrap_err().to_string().contains("steps_per_generation must be ≥ 1"));
    Ok(())
}

/// DAPO's dynamic sampling: a reward that is the same for every completion of the prompts of
/// odd length leaves their groups flat; without dynamic sampling some steps train on flat groups
/// (`grpo_zero_std` > 0), with 12 more rounds allowed none does, the rewards of every kept group
/// spread; zigzag CP 2 and ring CP 2 × DP 2 follow one device (the same rounds, the same
/// completions).
#[test]
fn dynamic_sampling_replaces_flat_groups() -> Result<()> {
    let set = reverse_prompts(8, 2)?;
    let capitals = capitals();
    let reward: super::super::grpo::RewardFn = Arc::new(move |p, c, a| if p.len() % 2 == 1 { Ok(0.5) } else { capitals(p, c, a) });
    let with = |layout: Layout, rounds: usize| -> TrainConfig {
        let mut c = tiny_run(layout, DataSource::Prompts(set.clone()), 4, (2, 2));
        c.schedule.peak = 4e-3;
        c.grpo = Some(GrpoConfig { loss_type: GrpoLoss::Grpo, scale_rewards: ScaleRewards::Group, dynamic_sampling: rounds, reward: reward.clone(), ..grpo_cfg(ImportanceLevel::Token, 1) });
        c
    };
    let plain = run(&with(Layout::single(), 0))?;
    assert!(plain[0].metrics.iter().any(|m| m.grpo_zero_std.is_some_and(|z| z > 0.0)), "flat groups without dynamic sampling: {:?}", plain[0].metrics);
    let one = run(&with(Layout::single(), 12))?;
    let m = &one[0].metrics;
    assert!(m.iter().all(|x| x.grpo_zero_std == Some(0.0)), "no flat group kept: {m:?}");
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2)] {
        let other = run(&with(layout, 12))?;
        for (a, b) in m.iter().zip(&other[0].metrics) {
            assert_eq!((a.grpo_reward, a.completion_length, a.grpo_zero_std), (b.grpo_reward, b.completion_length, b.grpo_zero_std), "{layout} step {}: the same completions", a.step);
            assert!((a.grad_norm - b.grad_norm).abs() < 1e-4 * a.grad_norm.max(1.0) && (a.train_loss - b.train_loss).abs() < 1e-5, "{layout} step {}: {a:?} vs {b:?}", a.step);
        }
    }
    Ok(())
}

/// Reward functions at the run's edges: a command's rewards (a shell script counting the
/// capitals of each completion's text) give zigzag CP 2 the single device's run, the command
/// asked once per distinct completion however many ranks ask (its log counts the queries); a
/// reward that differs between ranks (a counter), one that is not finite and one that fails are
/// refused by name.
#[test]
fn reward_functions_are_checked_across_ranks() -> Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let set = reverse_prompts(8, 2)?;
    let with = |layout: Layout, reward: super::super::grpo::RewardFn| -> TrainConfig {
        let mut c = tiny_run(layout, DataSource::Prompts(set.clone()), 3, (2, 1));
        c.grpo = Some(GrpoConfig { reward, ..grpo_cfg(ImportanceLevel::Token, 1) });
        c
    };
    let dir = std::env::temp_dir().join(format!("cp-grpo-cmd-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let script = "while read line; do echo \"$line\" >> \"$0\"; c=${line#*\\\"completion\\\":\\\"}; c=${c%%\\\"*}; printf '%s' \"$c\" | tr -cd 'A-Z' | wc -c; done";
    let bytes: super::super::reward_command::Decode = Arc::new(|ids: &[u32]| Ok(ids.iter().map(|&t| t as u8 as char).collect()));
    let mut metrics = Vec::new();
    for (tag, layout) in [("one", Layout::single()), ("zigzag", Layout::cp(CpKind::Zigzag, 2))] {
        let log = dir.join(tag);
        let reward = super::super::reward_command::command("sh", &["-c".into(), script.into(), log.display().to_string()], bytes.clone(), std::time::Duration::from_secs(30))?;
        let out = run(&with(layout, reward))?;
        let queries = std::fs::read_to_string(&log)?.lines().count();
        assert!(queries > 0 && queries <= 3 * 2 * 4, "{tag}: {queries} queries for 24 completions");
        metrics.push((out[0].metrics.clone(), queries));
    }
    assert_eq!(metrics[0].1, metrics[1].1, "each completion asked once on two ranks too");
    for (a, b) in metrics[0].0.iter().zip(&metrics[1].0) {
        assert!(a.grpo_reward == b.grpo_reward && a.grpo_reward.is_some_and(|r| r > 0.0) && (a.grad_norm - b.grad_norm).abs() < 1e-4 * a.grad_norm.max(1.0), "step {}: {a:?} vs {b:?}", a.step);
    }
    std::fs::remove_dir_all(&dir)?;
    let calls = Arc::new(AtomicUsize::new(0));
    let counter: super::super::grpo::RewardFn = {
        let calls = calls.clone();
        Arc::new(move |_, _, _| Ok(calls.fetch_add(1, Ordering::SeqCst) as f64))
    };
    let e = run(&with(Layout::cp(CpKind::Zigzag, 2), counter)).unwrap_err().to_string();
    assert!(e.contains("must give every rank the same reward"), "{e}");
    let e = run(&with(Layout::single(), Arc::new(|_, _, _| Ok(f64::NAN)))).unwrap_err().to_string();
    assert!(e.contains("rewards must be finite"), "{e}");
    let e = run(&with(Layout::single(), Arc::new(|_, _, _| Err(candle_core::Error::Msg("no verifier".into()))))).unwrap_err().to_string();
    assert!(e.contains("no verifier") && e.contains("the reward of completion 0"), "{e}");
    Ok(())
}

/// `top_entropy_quantile` 0.5: the policy's per-token entropies (beside its losses) are those
/// of its full logits; the node's value and gradient are autograd's of the policy term on the
/// tokens at or above the median entropy of the completion tokens (by hand) plus the KL term
/// on every token — at the ratio 1 and with `π_old` recorded (another model's losses) —; about
/// half the tokens train.
#[test]
fn entropy_quantile_keeps_the_high_entropy_tokens() -> Result<()> {
    let set = reverse_prompts(6, 1)?;
    let mcfg = LlamaConfig::tiny(128, 32, 1, 2, 1);
    let cfg = GrpoConfig { beta: 0.05, top_entropy_quantile: 0.5, ..grpo_cfg(ImportanceLevel::Token, 2) };
    let out = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let dev = Device::Cpu;
        let OneMicro { vm, m, other, mut r, sb, labels, marks } = one_micro(&mcfg, &cfg, &set, &ctx)?;
        let (nll, ent) = m.token_nll_packed_stat(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents, crate::head_loss::HeadStat::Entropy)?;
        let (nll, ent) = (nll.flatten_all()?, ent.flatten_all()?.to_vec1::<f32>()?);
        // the entropies are the full logits'
        let logits = m.forward_packed(&sb.input_ids, &sb.positions, &sb.documents)?.flatten_to(1)?;
        let lsm = candle_nn::ops::log_softmax(&logits, 1)?;
        let full: Vec<f32> = (lsm.exp()? * &lsm)?.sum(1)?.neg()?.to_vec1()?;
        let slots: Vec<u32> = shard_batch(&r.slots, &ctx)?.labels.flatten_all()?.to_vec1()?;
        let n = slots.len();
        let on = |i: usize| slots[i] > 0 && labels[i] != crate::IGNORE && marks[i] == 1;
        for i in (0..n).filter(|&i| on(i)) {
            assert!((ent[i] - full[i]).abs() < 1e-4, "position {i}: entropy {} vs the logits' {}", ent[i], full[i]);
        }
        let reference: Vec<f32> = other.token_nll_packed(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents)?.flatten_all()?.to_vec1()?;
        // the median of the completion tokens' entropies, by hand
        let mut e: Vec<f64> = (0..n).filter(|&i| on(i)).map(|i| ent[i] as f64).collect();
        e.sort_by(f64::total_cmp);
        let pos = 0.5 * (e.len() - 1) as f64;
        let median = e[pos.floor() as usize] + (e[pos.ceil() as usize] - e[pos.floor() as usize]) * (pos - pos.floor());
        let keep_high: Vec<f32> = (0..n).map(|i| (on(i) && ent[i] as f64 >= median - ENTROPY_TIE * median) as u8 as f32).collect();
        let kept = keep_high.iter().sum::<f32>() as f64 / e.len() as f64;
        let col = |f: &dyn Fn(usize) -> f32| Tensor::from_vec((0..n).map(f).collect::<Vec<f32>>(), n, &dev);
        let a = col(&|i| if on(i) { r.advantages[slots[i] as usize - 1] as f32 } else { 0.0 })?;
        let k = col(&|i| if on(i) { r.norms[slots[i] as usize - 1] as f32 } else { 0.0 })?;
        let keep = col(&|i| on(i) as u8 as f32)?;
        let high = Tensor::from_vec(keep_high, n, &dev)?;
        let ref_t = Tensor::from_vec(reference.clone(), n, &dev)?;
        let mut worst = 0f64;
        for with_old in [false, true] {
            if with_old {
                r.record_old(&reference, &ctx, ctx.token_group())?;
            }
            let t = r.loss((&nll, &nll.to_vec1::<f32>()?), (Some(&reference), Some(&ent)), &cfg, (&labels, &marks), &ctx, ctx.token_group())?;
            let ratio = match with_old {
                true => (&ref_t - &nll)?.exp()?,
                // (the ratio 1 with its gradient: π_old the policy detached, as TRL's)
                false => (nll.detach() - &nll)?.exp()?,
            };
            let clip = ratio.clamp(1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high)?;
            let surrogate = (ratio.mul(&a)?.minimum(&clip.mul(&a)?)?.neg()? * &high)?;
            let d = (&nll - &ref_t)?;
            let k3 = (((d.exp()? - &d)? - 1.0)? * &keep)?;
            let direct = ((surrogate + (k3 * cfg.beta)?)? * &k)?.sum_all()?;
            let want = direct.to_scalar::<f32>()? as f64;
            assert!((t.value - want).abs() < 1e-5 * want.abs().max(1.0), "π_old {with_old}: value {} vs {want}", t.value);
            let (g1, g2) = (t.node.backward()?, direct.backward()?);
            worst = worst.max(grad_gap(&vm, &g1, &g2)?);
        }
        Ok((worst, kept))
    });
    let (worst, kept) = out.into_iter().next().expect("one rank")?;
    assert!(worst < 1e-4, "gradients differ by {worst} relative");
    assert!((0.4..=0.6).contains(&kept), "about half the tokens train: {kept}");
    Ok(())
}
