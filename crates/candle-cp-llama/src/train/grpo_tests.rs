use super::*;
use crate::train::rng::Rng;
use crate::Llama;
use crate::train::sft::bytes_of;
use crate::train::{DataSource, ModelSource, TrainConfig};
use crate::{init_params, shard_batch, shard_params, CpKind, Layout, LlamaConfig, ParallelCtx};
use candle_core::DType;
use candle_cp_comm::run_ranks;
use candle_nn::VarBuilder;

/// Advantages: each group's mean out, divided by its unbiased standard deviation + 1e-4, the
/// batch's, or nothing; a group of equal rewards has none.
#[test]
fn advantages_follow_trls_formula() -> Result<()> {
    let r = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0];
    let sd = |v: &[f64]| {
        let m = v.iter().sum::<f64>() / v.len() as f64;
        (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
    };
    let g = advantages(&r, 2, ScaleRewards::Group)?;
    let s0 = sd(&r[..2]) + 1e-4;
    assert_eq!(g, vec![0.5 / s0, -0.5 / s0, 0.0, 0.0, 0.0, 0.0]);
    let b = advantages(&r, 3, ScaleRewards::Batch)?;
    let (m0, m1, s) = (0.5, 1.5, sd(&r) + 1e-4);
    for (i, (x, y)) in b.iter().zip(r).enumerate() {
        let want = (y - if i < 3 { m0 } else { m1 }) / s;
        assert!((x - want).abs() < 1e-12, "{i}: {x} vs {want}");
    }
    assert_eq!(advantages(&r, 3, ScaleRewards::None)?, vec![0.5, -0.5, 0.0, -1.0, 0.5, 0.5]);
    assert!(advantages(&r, 4, ScaleRewards::None).is_err() && advantages(&r, 1, ScaleRewards::None).is_err());
    Ok(())
}

/// The per-token weights and the loss's value of each normalisation: GRPO's mean of means,
/// BNPO's token mean, Dr. GRPO's constant, DAPO's token mean over the step (here 20 tokens in 2
/// micro-batches).
#[test]
fn token_weights_normalise_as_each_loss() {
    let (adv, len) = ([1.0, -2.0, 0.5], [2usize, 4, 1]);
    let step = (20, 2);
    let (w, v) = token_weights(&adv, &len, GrpoLoss::Dapo, 8, step);
    assert_eq!(w, vec![1.0 / 10.0, -2.0 / 10.0, 0.5 / 10.0]);
    assert!((v - -(2.0 - 8.0 + 0.5) / 10.0).abs() < 1e-12, "{v}");
    let (w, v) = token_weights(&adv, &len, GrpoLoss::Grpo, 8, step);
    assert_eq!(w, vec![1.0 / 6.0, -2.0 / 12.0, 0.5 / 3.0]);
    assert!((v - -(1.0 - 2.0 + 0.5) / 3.0).abs() < 1e-12, "{v}");
    let (w, v) = token_weights(&adv, &len, GrpoLoss::Bnpo, 8, step);
    assert_eq!(w, vec![1.0 / 7.0, -2.0 / 7.0, 0.5 / 7.0]);
    assert!((v - -(2.0 - 8.0 + 0.5) / 7.0).abs() < 1e-12, "{v}");
    let (w, v) = token_weights(&adv, &len, GrpoLoss::DrGrpo, 8, step);
    assert_eq!(w, vec![1.0 / 24.0, -2.0 / 24.0, 0.5 / 24.0]);
    assert!((v - -(2.0 - 8.0 + 0.5) / 24.0).abs() < 1e-12, "{v}");
    // (one micro-batch per step: DAPO is BNPO)
    assert_eq!(token_weights(&adv, &len, GrpoLoss::Dapo, 8, (7, 1)), token_weights(&adv, &len, GrpoLoss::Bnpo, 8, step));
}

/// Prompts from prompt / completion examples, and the reward functions.
#[test]
fn prompts_from_examples_and_rewards() -> Result<()> {
    let docs = crate::train::sft::read_sft("{\"prompt\": \"ab=\", \"completion\": \"BA\"}\n", &bytes_of, Some(2), None)?;
    let set = PromptSet::from_marked(docs)?;
    assert_eq!(set.get(0), Some((&b"ab="[..].iter().map(|&b| b as u32).collect::<Vec<_>>()[..], &[b'B' as u32, b'A' as u32, 2][..])));
    assert!(PromptSet::new(vec![(vec![], vec![1])]).is_err() && PromptSet::new(vec![]).is_err());
    let (e, t) = (rewards::exact_match(), rewards::token_accuracy());
    assert_eq!((e(&[1], &[5, 6, 2], &[5, 6, 2])?, e(&[1], &[5, 6], &[5, 6, 2])?), (1.0, 0.0));
    assert_eq!((t(&[1], &[5, 7, 2], &[5, 6, 2])?, t(&[1], &[5, 6, 2, 9], &[5, 6, 2])?), (2.0 / 3.0, 0.75));
    let f = rewards::finished(vec![2]);
    assert_eq!((f(&[1], &[5, 2], &[])?, f(&[1], &[5, 6], &[])?), (1.0, 0.0));
    let w = rewards::weighted(vec![(rewards::exact_match(), 2.0), (rewards::token_accuracy(), 0.5), (f, 1.0)]);
    assert_eq!(w(&[1], &[5, 7, 2], &[5, 6, 2])?, 0.5 * 2.0 / 3.0 + 1.0);
    Ok(())
}

/// Byte-level "reverse" prompts: `abc=` → `CBA` + EOS 2.
pub(crate) fn reverse_prompts(n: usize, seed: u64) -> Result<PromptSet> {
    let mut rng = Rng::new(seed);
    let mut text = String::new();
    for _ in 0..n {
        let p: String = (0..2 + rng.below(3)).map(|_| (b'a' + rng.below(6) as u8) as char).collect();
        let c: String = p.chars().rev().map(|x| x.to_ascii_uppercase()).collect();
        text.push_str(&format!("{{\"prompt\": \"{p}=\", \"completion\": \"{c}\"}}\n"));
    }
    PromptSet::from_marked(crate::train::sft::read_sft(&text, &bytes_of, Some(2), None)?)
}

fn grpo_cfg(loss_type: GrpoLoss, scale: ScaleRewards) -> GrpoConfig {
    GrpoConfig { num_generations: 4, max_completion_length: 6, loss_type, scale_rewards: scale, ..GrpoConfig::new(2, capitals(), vec![2], 7) }
}

/// The test reward: the fraction of a completion's tokens that are capital letters (a random
/// model writes some, so groups differ; the policy can learn to write more).
/// The largest gap between two gradients of `vm`'s variables, each relative to the second's
/// largest entry.
pub(crate) fn grad_gap(vm: &candle_nn::VarMap, g1: &candle_core::backprop::GradStore, g2: &candle_core::backprop::GradStore) -> Result<f64> {
    let mut worst = 0f64;
    for (name, v) in crate::params::lock_vars(vm)?.iter() {
        let (Some(a), Some(b)) = (g1.get(v.as_tensor()), g2.get(v.as_tensor())) else { bail!("no gradient of {name}") };
        let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
        worst = worst.max((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64 / scale.max(1e-12));
    }
    Ok(worst)
}

/// `c` run on its layout's ranks: each rank's outcome.
pub(crate) fn run(c: &TrainConfig) -> Result<Vec<crate::train::TrainOutcome>> {
    run_ranks(c.layout.world_size(), |g| crate::train::train_rank(g, c, &|_| {})).into_iter().collect()
}

/// `c` run straight, a checkpoint every `every` steps, and again killed after `stop` steps and
/// resumed from its last checkpoint: (straight, resumed) outcomes; the directories (named by
/// `tag`) removed.
pub(crate) fn straight_and_resumed(c: &TrainConfig, tag: &str, every: usize, stop: usize) -> Result<(Vec<crate::train::TrainOutcome>, Vec<crate::train::TrainOutcome>)> {
    let dir = |side: &str| std::env::temp_dir().join(format!("cp-grpo-{tag}-{side}-{}", std::process::id()));
    let (da, db) = (dir("a"), dir("b"));
    let mut ca = c.clone();
    (ca.out, ca.save_every) = (Some(da.clone()), every);
    let a = run(&ca)?;
    let mut cb = ca.clone();
    (cb.out, cb.stop_after) = (Some(db.clone()), Some(stop));
    run(&cb)?;
    (cb.stop_after, cb.resume) = (None, true);
    let b = run(&cb)?;
    std::fs::remove_dir_all(&da)?;
    std::fs::remove_dir_all(&db)?;
    Ok((a, b))
}

/// [`straight_and_resumed`] of `c` (checkpoints every `every` steps, killed after step `stop`):
/// the resumed run starts at the last checkpoint and its steps' objectives equal the straight
/// run's, bit for bit.
pub(crate) fn resumed_is_straight(c: &TrainConfig, tag: &str, every: usize, stop: usize) -> Result<()> {
    let (a, b) = straight_and_resumed(c, tag, every, stop)?;
    let start = stop / every * every;
    assert_eq!(b[0].start_step, start, "{tag}");
    let tail: Vec<(usize, f64)> = a[0].metrics[start..].iter().map(|m| (m.step, m.train_loss)).collect();
    assert_eq!(tail, b[0].metrics.iter().map(|m| (m.step, m.train_loss)).collect::<Vec<_>>(), "{tag}: straight vs resumed");
    Ok(())
}

/// The GRPO tests' run: the tiny model on `data`, rows of 48, `steps` steps of `batch` rows ×
/// `grad_accum`, seed 3.
pub(crate) fn tiny_run(layout: Layout, data: DataSource, steps: usize, (batch, grad_accum): (usize, usize)) -> TrainConfig {
    let mut c = TrainConfig::new(layout, ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1)), data, 48, steps);
    (c.batch, c.grad_accum, c.seed) = (batch, grad_accum, 3);
    c
}

pub(crate) fn capitals() -> RewardFn {
    Arc::new(|_, c, _| Ok(c.iter().filter(|&&t| (65..91).contains(&t)).count() as f64 / c.len().max(1) as f64))
}

/// A rollout on one device: the completions are `generate_ragged`'s for its prompts (one
/// seeded generator, the prompts of different lengths in one batch), packed with its prompt as a document whose completion tokens are the
/// marked targets; the rewards are the reward function's; the node's value is TRL's loss and
/// its gradient that of `Σ_i w_i · Σ_{t ∈ o_i} nll_t + β·Σ_i k_i·Σ_t kl_t` (the KL term, β 0.1,
/// against another model's per-token losses), each completion run alone (the packing isolates
/// documents).
#[test]
fn rollout_packs_scores_and_weighs_completions() -> Result<()> {
    let set = reverse_prompts(6, 1)?;
    let cfg = grpo_cfg(GrpoLoss::Bnpo, ScaleRewards::None);
    let mcfg = LlamaConfig::tiny(128, 32, 1, 2, 1);
    let out = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_params(&init_params(&mcfg, 5, DType::F32, &Device::Cpu)?, &mcfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
        let rvm = shard_params(&init_params(&mcfg, 6, DType::F32, &Device::Cpu)?, &mcfg, &ctx)?;
        let reference = Llama::new(VarBuilder::from_varmap(&rvm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
        let beta = 0.1;
        let mut step = [crate::train::grpo_sample::rollouts(&m, &cfg, &set, 3, (0, 1), (2, 48), None)?.remove(0)];
        weigh_step(&mut step, &cfg)?;
        let [r] = step;
        assert_eq!((r.rows.len(), r.rewards.len()), (2, 8));
        // the completions again, by hand: the same prompts, generator and stops, each prompt's
        // rows (prompts of different lengths) in one batch
        let mut pick = Rng::derive(3, &[0, 0, 0x6772_706f]);
        let chosen: Vec<(&[u32], &[u32])> = (0..2).map(|_| set.get(pick.below(set.len())).expect("prompt")).collect();
        assert_ne!(chosen[0].0.len(), chosen[1].0.len(), "the test wants prompts of different lengths");
        let Sampling::Sample { temperature, top_k, top_p, seed } = cfg.sampling else { bail!("sampled") };
        let s = Sampling::Sample { temperature, top_k, top_p, seed: Rng::derive(seed ^ 3, &[0]).next_u64() };
        let rows: Vec<Vec<u32>> = chosen.iter().flat_map(|(p, _)| std::iter::repeat_n(p.to_vec(), 4)).collect();
        let mut docs = Vec::new();
        for (k, c) in m.generate_ragged(&rows, 6, s, &[2])?.tokens.into_iter().enumerate() {
            let (prompt, answer) = chosen[k / 4];
            docs.push((prompt.to_vec(), c.clone(), (cfg.reward)(prompt, &c, answer)?));
        }
        assert_eq!(docs.iter().map(|d| d.2).collect::<Vec<_>>(), r.rewards);
        assert!(r.rewards.iter().any(|&x| x != r.rewards[0]), "the rewards differ: {:?}", r.rewards);
        // the rows' documents, padding left out, are the completions with their prompts in order
        let mut packed: Vec<(Vec<u32>, Vec<bool>)> = Vec::new();
        for s in &r.rows {
            let d = s.documents.as_ref().expect("documents");
            for k in 0..d.count() {
                let (a, b) = d.range(k);
                if s.tokens[a..b].iter().all(|&x| x == 0) {
                    continue;
                }
                packed.push((s.tokens[a..b].to_vec(), s.long_range[a..b].to_vec()));
            }
        }
        let want: Vec<(Vec<u32>, Vec<bool>)> = docs.iter().map(|(p, c, _)| (p.iter().chain(c).copied().collect(), p.iter().map(|_| false).chain(c.iter().map(|_| true)).collect())).collect();
        assert_eq!(packed, want);
        let flat: Vec<u32> = r.rows.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        // the node
        let rows: Vec<&Sample> = r.rows.iter().collect();
        let ids = Tensor::from_vec(flat, (2, 48), &Device::Cpu)?;
        let marks = Tensor::from_vec(rows.iter().flat_map(|s| s.long_range.iter().map(|&b| b as u32)).collect::<Vec<_>>(), (2, 48), &Device::Cpu)?;
        let docs_t: Vec<Documents> = rows.iter().map(|s| s.documents.clone().expect("documents")).collect();
        let sb = crate::packed::shard_batch_packed(&ids, &docs_t, &ctx)?;
        let labels: Vec<u32> = sb.labels.flatten_all()?.to_vec1()?;
        let marks: Vec<u32> = shard_batch(&marks, &ctx)?.labels.flatten_all()?.to_vec1()?;
        let nll = m.token_nll_packed(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents)?.flatten_all()?;
        let ref_nll: Vec<f32> = reference.token_nll_packed(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents)?.flatten_all()?.to_vec1()?;
        let kl_cfg = GrpoConfig { beta, ..cfg.clone() };
        let vals: Vec<f32> = nll.to_vec1()?;
        let crate::train::grpo_run::GrpoTerms { node, value, kl, clipped } = r.loss((&nll, &vals), (Some(&ref_nll), None), &kl_cfg, (&labels, &marks), &ctx, ctx.token_group())?;
        assert!(clipped.is_none(), "no ratio before π_old is recorded");
        assert!(r.loss((&nll, &vals), (None, None), &kl_cfg, (&labels, &marks), &ctx, ctx.token_group()).is_err(), "the KL term without the reference");
        let adv = advantages(&r.rewards, 4, ScaleRewards::None)?;
        let one_step = (r.lengths.iter().sum(), 1);
        let (w, value_a) = token_weights(&adv, &r.lengths, GrpoLoss::Bnpo, 6, one_step);
        let k = norms(&r.lengths, GrpoLoss::Bnpo, 6, one_step);
        let g1 = node.backward()?;
        // each completion alone: Σ_i w_i · (its completion tokens' nll) + β·k_i·Σ_t kl_t
        let mut direct = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        let (mut kl_sum, mut kl_plain, mut kl_tokens) = (0f64, 0f64, 0f64);
        for (((p, c, _), wi), ki) in docs.iter().zip(&w).zip(&k) {
            let t: Vec<u32> = p.iter().chain(c).copied().collect();
            let one = crate::shard_batch(&Tensor::from_vec(t.clone(), (1, t.len()), &Device::Cpu)?, &ctx)?;
            let nll: Tensor = m.token_nll(&one.input_ids, &one.labels, &one.positions)?.flatten_all()?;
            let ref_one = reference.token_nll(&one.input_ids, &one.labels, &one.positions)?.flatten_all()?.detach();
            let keep = Tensor::from_vec((0..t.len()).map(|i| (i + 1 >= p.len() && i + 1 < t.len()) as u8 as f32).collect::<Vec<_>>(), t.len(), &Device::Cpu)?;
            let d = (&nll - &ref_one)?;
            let k3 = ((d.exp()? - &d)? - 1.0)?;
            let k3 = (k3 * &keep)?.sum_all()?;
            kl_sum += ki * k3.to_scalar::<f32>()? as f64;
            kl_plain += k3.to_scalar::<f32>()? as f64;
            kl_tokens += keep.sum_all()?.to_scalar::<f32>()? as f64;
            direct = ((direct + ((nll * &keep)?.sum_all()? * *wi)?)? + (k3 * (beta * ki))?)?;
        }
        let want = value_a + beta * kl_sum;
        assert!((value - want).abs() < 1e-5 && (node.to_scalar::<f32>()? as f64 - want).abs() < 1e-5, "value {value} vs {want}");
        assert!(kl > 1e-3 && (kl - kl_plain / kl_tokens).abs() < 1e-3 * kl, "mean KL {kl}");
        let g2 = direct.backward()?;
        grad_gap(&vm, &g1, &g2)
    });
    let worst = out.into_iter().next().expect("one rank")?;
    assert!(worst < 1e-4, "gradients differ by {worst} relative");
    Ok(())
}

/// A GRPO run: zigzag CP 2, ring CP 2 × DP 2 (each replica generating half of each group) and
/// TP 2 + SP follow the single-device run step by step — the same completions, rewards,
/// objective and gradients —, without and with the KL term (β 0.04: step 1's KL 0, the policy
/// being its reference, then above 0); a run with the KL term killed after step 3 and resumed
/// from step 2's checkpoint (its reference read back from it) reproduces the straight run; the
/// settings' errors are refused by name.
#[test]
fn grpo_runs_match_on_every_layout() -> Result<()> {
    let set = reverse_prompts(8, 2)?;
    let with = |layout: Layout, beta: f64| -> TrainConfig {
        let mut c = tiny_run(layout, DataSource::Prompts(set.clone()), 4, (2, 2));
        c.schedule.peak = 1e-2;
        c.grpo = Some(GrpoConfig { beta, ..grpo_cfg(GrpoLoss::Grpo, ScaleRewards::Group) });
        c
    };
    let cfg = |layout: Layout| with(layout, 0.0);
    for beta in [0.0, 0.04] {
        let one = run(&with(Layout::single(), beta))?;
        let m = &one[0].metrics;
        assert!(m.iter().all(|x| x.grpo_reward.is_some_and(|r| (0.0..=1.0).contains(&r)) && x.completion_length.is_some_and(|l| l >= 1.0)), "{m:?}");
        assert!(m.iter().all(|x| x.grad_norm > 0.0), "{m:?}");
        match beta > 0.0 {
            false => assert!(m.iter().all(|x| x.train_loss.abs() < 1e-6 && x.grpo_kl.is_none()), "grpo's value with group-scaled advantages is 0: {m:?}"),
            true => assert!(m[0].grpo_kl.is_some_and(|k| k.abs() < 1e-6) && m[3].grpo_kl.is_some_and(|k| k > 1e-5) && m[3].train_loss > 1e-7, "{m:?}"),
        }
        for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::single().with_tp(2, true)] {
            let other = run(&with(layout, beta))?;
            for (a, b) in m.iter().zip(&other[0].metrics) {
                assert_eq!((a.grpo_reward, a.completion_length), (b.grpo_reward, b.completion_length), "{layout} β {beta} step {}: the same completions", a.step);
                assert!((a.grad_norm - b.grad_norm).abs() < 1e-4 * a.grad_norm.max(1.0), "{layout} β {beta} step {}: |g| {} vs {}", a.step, b.grad_norm, a.grad_norm);
                assert!((a.loss - b.loss).abs() < 1e-5 && (a.train_loss - b.train_loss).abs() < 1e-6, "{layout} β {beta} step {}: loss {} vs {}", a.step, b.loss, a.loss);
            }
        }
    }
    // killed after step 3, resumed from step 2's checkpoint
    let (a, b) = straight_and_resumed(&with(Layout::cp(CpKind::Zigzag, 2), 0.04), "kl", 2, 3)?;
    assert_eq!(b[0].start_step, 2);
    for (x, y) in a[0].metrics[2..].iter().zip(&b[0].metrics) {
        assert!(x.step == y.step && (x.train_loss - y.train_loss).abs() < 1e-9 && x.grpo_reward == y.grpo_reward && x.grpo_kl == y.grpo_kl, "step {}: straight {x:?} vs resumed {y:?}", x.step);
    }
    let mut bad = cfg(Layout::single());
    bad.grpo = None;
    assert!(run(&bad).unwrap_err().to_string().contains("train by GRPO"));
    let mut bad = cfg(Layout::single().with_dp(3));
    bad.batch = 3;
    assert!(run(&bad).unwrap_err().to_string().contains("dp = 3 must divide their product"));
    let mut bad = cfg(Layout::single());
    bad.seq_len = 16;
    assert!(run(&bad).unwrap_err().to_string().contains("may not fit"));
    let mut bad = cfg(Layout::single());
    bad.grpo = Some(GrpoConfig { sampling: Sampling::Greedy, ..grpo_cfg(GrpoLoss::Grpo, ScaleRewards::Group) });
    assert!(run(&bad).unwrap_err().to_string().contains("greedy"));
    // LoRA with the KL term: the reference is the frozen base — step 1's KL 0 (the adapters
    // start at zero), later above; zigzag CP 2 follows one device; so with a quantized base
    // (QLoRA: the reference reads the same NF4 codes)
    let lora = |layout: Layout, quant: Option<&str>| -> Result<TrainConfig> {
        let mut c = with(layout, 0.04);
        c.lora = Some(crate::LoraSpec::new(2, 8.0, &["q_proj", "v_proj", "down_proj"])?);
        c.quantize_base = quant.map(str::parse).transpose()?;
        Ok(c)
    };
    for quant in [None, Some("nf4,32")] {
        let a = run(&lora(Layout::single(), quant)?)?;
        let m = &a[0].metrics;
        assert!(m[0].grpo_kl.is_some_and(|k| k.abs() < 1e-7) && m[3].grpo_kl.is_some_and(|k| k > 1e-7), "{quant:?}: {m:?}");
        let b = run(&lora(Layout::cp(CpKind::Zigzag, 2), quant)?)?;
        for (x, y) in m.iter().zip(&b[0].metrics) {
            assert!(x.grpo_reward == y.grpo_reward && (x.train_loss - y.train_loss).abs() < 1e-6 && (x.grad_norm - y.grad_norm).abs() < 1e-4 * x.grad_norm.max(1.0), "LoRA {quant:?} step {}: {x:?} vs {y:?}", x.step);
        }
    }
    let mut bad = lora(Layout::single(), None)?;
    if let Some(l) = bad.lora.as_mut() {
        l.modules_to_save = vec!["lm_head".into()];
    }
    let e = run(&bad).unwrap_err().to_string();
    assert!(e.contains("set beta 0"), "{e}");
    Ok(())
}

/// GRPO learns: with the capitals reward, 40 steps on one device raise the mean reward of the
/// last 10 steps well above the first 10's.
#[test]
fn grpo_raises_the_reward() -> Result<()> {
    let set = reverse_prompts(8, 2)?;
    let mut c = TrainConfig::new(Layout::single(), ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1)), DataSource::Prompts(set), 48, 40);
    (c.batch, c.grad_accum, c.seed) = (2, 1, 3);
    (c.schedule.peak, c.schedule.total) = (1e-2, 40);
    c.grpo = Some(grpo_cfg(GrpoLoss::Grpo, ScaleRewards::Group));
    let out = run_ranks(1, |g| crate::train::train_rank(g, &c, &|_| {})).into_iter().next().expect("one rank")?;
    let r: Vec<f64> = out.metrics.iter().map(|m| m.grpo_reward.expect("reward")).collect();
    let (first, last) = (r[..10].iter().sum::<f64>() / 10.0, r[30..].iter().sum::<f64>() / 10.0);
    println!("GRPO reward: first 10 steps {first:.3}, last 10 {last:.3}");
    assert!(last > first + 0.2, "{r:?}");
    Ok(())
}

/// Held-out prompts: every evaluation reports the mean reward of one greedy completion of each
/// held-out prompt — with a learning rate of 0, that of the starting model by hand — the same
/// on zigzag CP 2 and on ring CP 2 × DP 2 as on one device; held-out data that is not prompts is
/// refused.
#[test]
fn held_out_prompts_are_evaluated_on_every_layout() -> Result<()> {
    let set = reverse_prompts(12, 4)?;
    let data = DataSource::Prompts(set);
    let (train, held) = data.split_held_out(0.25, 48)?;
    let DataSource::Prompts(held_set) = &held else { bail!("prompts") };
    let with = |layout: Layout, peak: f64| -> TrainConfig {
        let mut c = tiny_run(layout, train.clone(), 4, (2, 1));
        c.schedule.peak = peak;
        c.grpo = Some(grpo_cfg(GrpoLoss::Grpo, ScaleRewards::Group));
        c.eval = Some(crate::train::EvalConfig { data: held.clone(), every: 2, batches: 1 });
        c
    };
    // the starting model's greedy completions, by hand
    let mcfg = LlamaConfig::tiny(128, 32, 1, 2, 1);
    let by_hand = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_params(&init_params(&mcfg, 3, DType::F32, &Device::Cpu)?, &mcfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
        let mut total = 0.0;
        for i in 0..held_set.len() {
            let (p, a) = held_set.get(i).expect("prompt");
            let out = m.generate_until(&Tensor::from_vec(p.to_vec(), (1, p.len()), &Device::Cpu)?, 6, Sampling::Greedy, &[2])?;
            total += capitals()(p, &out.tokens[0], a)?;
        }
        Ok(total / held_set.len() as f64)
    });
    let by_hand = by_hand.into_iter().next().expect("one rank")?;
    let frozen = run(&with(Layout::single(), 0.0))?;
    let e = frozen[0].metrics[1].eval_reward.expect("evaluated at step 2");
    assert!((e - by_hand).abs() < 1e-12, "held-out reward {e} vs by hand {by_hand}");
    let one = run(&with(Layout::single(), 1e-2))?;
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2)] {
        let other = run(&with(layout, 1e-2))?;
        for (a, b) in one[0].metrics.iter().zip(&other[0].metrics) {
            assert_eq!(a.eval_reward.is_some(), a.step % 2 == 0, "step {}", a.step);
            assert_eq!(a.eval_reward, b.eval_reward, "{layout} step {}", a.step);
        }
    }
    let mut bad = with(Layout::single(), 1e-2);
    bad.eval = Some(crate::train::EvalConfig { data: DataSource::Recall(crate::train::KvRecall::new(48)?), every: 1, batches: 1 });
    assert!(run(&bad).unwrap_err().to_string().contains("held-out data must be prompts"));
    Ok(())
}

/// `mask_truncated_completions`: a completion without its stop token at the length limit gets
/// no weight and leaves the token counts (bnpo's, dapo's over the step), its reward still in
/// its group's advantage; off, every completion weighs.
#[test]
fn truncated_completions_are_masked() -> Result<()> {
    let micro = |rewards: Vec<f64>, lengths: Vec<usize>, truncated: Vec<bool>| Rollout {
        docs: Vec::new(),
        rows: Vec::new(),
        slots: Tensor::zeros(1, DType::U32, &Device::Cpu).expect("slots"),
        advantages: Vec::new(),
        norms: Vec::new(),
        value: 0.0,
        rewards,
        lengths,
        truncated,
        old: None,
    };
    for loss in [GrpoLoss::Bnpo, GrpoLoss::Dapo, GrpoLoss::Grpo] {
        let cfg = GrpoConfig { num_generations: 2, max_completion_length: 6, mask_truncated_completions: true, ..grpo_cfg(loss, ScaleRewards::None) };
        let mut step = [micro(vec![1.0, 0.0], vec![6, 3], vec![true, false]), micro(vec![0.5, 0.25], vec![2, 4], vec![false, false])];
        weigh_step(&mut step, &cfg)?;
        assert_eq!((step[0].weight(0), step[0].norms[0]), (0.0, 0.0), "{loss:?}");
        // (the truncated completion's reward still moves its partner's advantage: −0.5)
        let k = match loss {
            GrpoLoss::Bnpo => 1.0 / 3.0,
            GrpoLoss::Dapo => 2.0 / 9.0,
            _ => 1.0 / (3.0 * 2.0),
        };
        assert!((step[0].weight(1) - -0.5 * k).abs() < 1e-12, "{loss:?}: {}", step[0].weight(1));
        let unmasked = GrpoConfig { mask_truncated_completions: false, ..cfg.clone() };
        let mut step = [micro(vec![1.0, 0.0], vec![6, 3], vec![true, false])];
        weigh_step(&mut step, &unmasked)?;
        assert!(step[0].weight(0) > 0.0, "{loss:?}");
    }
    Ok(())
}
