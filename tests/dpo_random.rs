//! Seeded random DPO runs: a few optimizer steps of preference tuning on a drawn layout
//! (every CP kind, CP 2 or 4, TP 2 with or without SP, DP 2), drawn batch split, ZeRO stage,
//! recompute and overlaps, and a drawn objective (DPO's sigmoid loss with or without label
//! smoothing, robust, EXO, IPO, hinge, NCA, SPPO, APO-zero / -down, reference-free SimPO and
//! ORPO; RPO's term or not; one in three of the others reference-free; KTO on the pairs
//! unpaired, λ_U 1 or 1.5; BCO and APO-zero unpaired on them without KL documents; bco_pair, whose running
//! mean reward δ crosses micro-batches; aot_pair and aot, sorted over the micro-batch; sft; a
//! quarter of the pair losses mixed with bco_pair and sft as MPO; a third of the losses of `h`
//! with f-DPO's Jensen–Shannon or α-divergence; a quarter of the pair losses but orpo, sft and
//! aot with LD-DPO's α ½, and a quarter, drawn apart, weighted by WPO; a quarter of those with
//! a reference moving it every 1 or 2 steps, TR-DPO's α ½ or 1) follow the single-device run
//! of the same pairs step by step: the objective to 1e-5 and the gradient norm to 1e-4
//! (relative above 1: IPO's loss is `(h − 1/(2β))²`, 25 at β 0.1) at step 1, 10x those after
//! updates, on every rank. A run the trainer
//! refuses must be refused for a reason the draw explains. Reward models (a score head on the
//! same pairs, the Bradley–Terry loss with or without TRL's centring term) are drawn the same
//! way and held to the same bounds, and so are process reward models (a token classifier with
//! a drawn dropout, 2 or 3 labels, on drawn stepwise examples, all steps labelled or the last;
//! a third of them LoRA runs training the head whole).
//! `CANDLE_CP_RANDOM_SEEDS=A..B` draws configurations `A..B`.

use candle_core::Result;
use candle_cp_llama::layout::Layout;
use candle_cp_llama::train::sft::bytes_of;
use candle_cp_llama::train::dpo::RefSync;
use candle_cp_llama::train::dpo_loss::FDivergence;
use candle_cp_llama::train::{DataSource, DpoConfig, DpoLoss, ModelSource, PreferenceSet, PrmConfig, RewardConfig, Rng, StepMetrics, StepSet, TrainConfig, TrainOutcome};
use candle_cp_llama::LlamaConfig;
use candle_cp_tests::draws::{pick, rng, seeds};
use candle_cp_tests::train_draws::{assert_explained, draw_run, run};

const CONFIGS: u64 = 16;

/// Byte-level pairs drawn from `seed`: a prompt of letters, the chosen answer its reverse in
/// capitals, the rejected one random capitals (lengths drawn apart), each ended by EOS 2;
/// unpaired: as KTO's and BCO's examples (the chosen desirable, the rejected not; BCO's without
/// KL documents).
fn pairs(seed: u64, loss: DpoLoss) -> Result<PreferenceSet> {
    let mut r = Rng::new(seed);
    let mut text = String::new();
    for _ in 0..12 {
        let p: String = (0..2 + r.below(6)).map(|_| (b'a' + r.below(12) as u8) as char).collect();
        let c: String = p.chars().rev().map(|x| x.to_ascii_uppercase()).collect();
        let rej: String = (0..1 + r.below(7)).map(|_| (b'A' + r.below(12) as u8) as char).collect();
        text.push_str(&format!("{{\"prompt\": \"{p}=\", \"chosen\": \"{c}\", \"rejected\": \"{rej}\"}}\n"));
    }
    match loss {
        DpoLoss::Kto => PreferenceSet::read_unpaired(&text, &bytes_of, Some(2), None),
        DpoLoss::Bco | DpoLoss::ApoZeroUnpaired => PreferenceSet::read_unpaired(&text, &bytes_of, Some(2), None)?.without_kl_documents(),
        _ => PreferenceSet::read(&text, &bytes_of, Some(2), None),
    }
}

/// A DPO objective: the loss, label smoothing where it applies, RPO's α (KTO: its weight of
/// the undesirable examples instead).
fn draw_objective(d: &mut Rng) -> DpoConfig {
    let loss = pick(d, &candle_cp_llama::train::dpo_loss::DPO_LOSSES.map(|(_, l)| l));
    let smoothing = match loss {
        DpoLoss::Sigmoid | DpoLoss::Simpo | DpoLoss::Robust | DpoLoss::AotPair | DpoLoss::Aot => pick(d, &[0.0, 0.1]),
        DpoLoss::ExoPair => pick(d, &[1e-3, 0.1]),
        _ => 0.0,
    };
    let beta = match loss {
        DpoLoss::Simpo => 2.0,
        _ => pick(d, &[0.1, 0.5]),
    };
    match loss {
        DpoLoss::Kto | DpoLoss::ApoZeroUnpaired => return DpoConfig { beta, loss, undesirable_weight: pick(d, &[1.0, 1.5]), ..DpoConfig::default() },
        DpoLoss::Bco => return DpoConfig { beta, loss, ..DpoConfig::default() },
        _ => {}
    }
    let reference_free = !matches!(loss, DpoLoss::Simpo | DpoLoss::Orpo) && pick(d, &[false, false, true]);
    // one in four of the mixable losses mixed with bco_pair and sft, as MPO (weights drawn)
    let mix = match !matches!(loss, DpoLoss::Simpo | DpoLoss::Orpo | DpoLoss::BcoPair | DpoLoss::Sft) && pick(d, &[false, false, false, true]) {
        true => vec![(loss, pick(d, &[0.8, 1.0])), (DpoLoss::BcoPair, pick(d, &[0.2, 0.5])), (DpoLoss::Sft, pick(d, &[0.5, 1.0]))],
        false => Vec::new(),
    };
    // f-DPO: a third of the losses that take one draw Jensen–Shannon or an α-divergence
    let f_divergence = match loss.takes_f_divergence() {
        true => pick(d, &[FDivergence::ReverseKl, FDivergence::ReverseKl, FDivergence::ReverseKl, FDivergence::ReverseKl, FDivergence::JsDivergence, FDivergence::Alpha(0.5)]),
        false => FDivergence::ReverseKl,
    };
    let rpo_alpha = pick(d, &[0.0, 0.5]);
    // LD-DPO: a quarter of the pair losses that take it weigh the longer answers' tails by ½
    // (not aot's: at step 1 every shorter answer's weighted log-ratio is 0 up to float noise,
    // and AOT's sort over the batch hands tied answers their places — and gradients — by that
    // noise, which differs between layouts: seed 68, a mix with aot_pair on 2-D CP + TP)
    let ld_alpha = match matches!(loss, DpoLoss::Orpo | DpoLoss::Sft | DpoLoss::Aot | DpoLoss::AotPair) {
        true => None,
        false => pick(d, &[None, None, None, Some(0.5)]),
    };
    // WPO: a quarter of the pair losses but orpo, sft and aot weigh each pair by the policy
    let use_weighting = !matches!(loss, DpoLoss::Orpo | DpoLoss::Sft | DpoLoss::Aot | DpoLoss::AotPair) && pick(d, &[false, false, false, true]);
    // TR-DPO: a quarter of the losses with a reference move it every 1 or 2 steps by α ½ or 1
    let with_reference = !reference_free && !matches!(loss, DpoLoss::Simpo | DpoLoss::Orpo | DpoLoss::Sft);
    let sync_ref_model = match with_reference && pick(d, &[false, false, false, true]) {
        true => Some(RefSync { every: pick(d, &[1, 2]), alpha: pick(d, &[0.5, 1.0]) }),
        false => None,
    };
    DpoConfig { beta, label_smoothing: smoothing, loss, simpo_gamma: 0.5, rpo_alpha, reference_model: None, reference_free, mix, f_divergence, ld_alpha, use_weighting, sync_ref_model, ..DpoConfig::default() }
}

/// `cfg` (a drawn layout's run) against `one` (the same run on one device) step by step: the
/// objective to 1e-5 and the gradient norm to 1e-4 (relative above 1) at step 1, 10x those
/// after updates, on every rank, and `more` of each step's pair (one device's first) and the
/// rank's outcome. `false`: the trainer refused `cfg`, for a reason the draw explains.
fn follows_one_device(what: &str, cfg: &TrainConfig, one: &TrainConfig, more: impl Fn(&StepMetrics, &StepMetrics, &TrainOutcome)) -> Result<bool> {
    let got = match run(cfg) {
        Ok(g) => g,
        Err(e) => {
            assert_explained(what, &e);
            return Ok(false);
        }
    };
    let want = run(one)?;
    let want = &want[0].metrics;
    for (r, out) in got.iter().enumerate() {
        for (a, b) in want.iter().zip(&out.metrics) {
            let k = if a.step == 1 { 1.0 } else { 10.0 };
            assert!((a.train_loss - b.train_loss).abs() < 1e-5 * k * a.train_loss.abs().max(1.0), "{what}, rank {r} step {}: objective {} vs {}", a.step, b.train_loss, a.train_loss);
            assert!((a.grad_norm - b.grad_norm).abs() < 1e-4 * k * a.grad_norm.max(1.0), "{what}, rank {r} step {}: |g| {} vs {}", a.step, b.grad_norm, a.grad_norm);
            more(a, b, out);
        }
    }
    Ok(true)
}

#[test]
fn random_dpo_runs_follow_one_device() -> Result<()> {
    let (mut checked, mut refused) = (0, 0);
    for seed in seeds(CONFIGS)? {
        let mut d = rng(77_000 + seed);
        let (layout, batch, grad_accum, opts) = draw_run(&mut d);
        let dpo = draw_objective(&mut d);
        let model = LlamaConfig::tiny(128, 32, pick(&mut d, &[1, 2]), 4, 2);
        let base = |layout: Layout| -> Result<TrainConfig> {
            let mut c = TrainConfig::new(layout, ModelSource::Init(model.clone()), DataSource::Preference(pairs(seed, dpo.loss)?), 64, 3);
            (c.batch, c.grad_accum, c.seed, c.dpo) = (batch, grad_accum, seed, Some(dpo.clone()));
            c.schedule.peak = 5e-3;
            // (AdamW's epsilon 1e-6, as `train_draws::config` sets it: DiscoPOP's τ = 0.05 curves
            // its loss sharply near h = 0, and at step 1, policy = reference, gradients near 1e-8
            // turn float32 noise into steps of up to the learning rate with 1e-8 — config 731 of
            // `300..1000`, ring 2 × DP 2 with ZeRO-1 and recompute, was 1.6e-4 off at step 2, the
            // gradient 1.1e-6 apart at step 1, with the default)
            c.adamw.eps = 1e-6;
            Ok(c)
        };
        let mut cfg = base(layout)?;
        opts.apply(&mut cfg);
        let what = format!("seed {seed}: {layout}, batch {batch} x {grad_accum}, {opts:?}, {dpo:?}");
        match follows_one_device(&what, &cfg, &base(Layout::single())?, |a, b, _| assert_eq!(a.dpo_accuracy.is_some(), b.dpo_accuracy.is_some(), "{what}"))? {
            true => checked += 1,
            false => refused += 1,
        }
    }
    println!("{checked} DPO configurations checked against one device, {refused} refused");
    assert!(checked > 0, "every draw refused");
    Ok(())
}

#[test]
fn random_reward_model_runs_follow_one_device() -> Result<()> {
    let (mut checked, mut refused) = (0, 0);
    for seed in seeds(CONFIGS)? {
        let mut d = rng(78_000 + seed);
        let (layout, batch, grad_accum, opts) = draw_run(&mut d);
        let reward = RewardConfig { center_rewards_coefficient: pick(&mut d, &[0.0, 0.01]) };
        let model = LlamaConfig::tiny(128, 32, pick(&mut d, &[1, 2]), 4, 2);
        let base = |layout: Layout| -> Result<TrainConfig> {
            let mut c = TrainConfig::new(layout, ModelSource::Init(model.clone()), DataSource::Preference(pairs(seed, DpoLoss::Sigmoid)?), 64, 3);
            (c.batch, c.grad_accum, c.seed, c.reward) = (batch, grad_accum, seed, Some(reward));
            c.schedule.peak = 5e-3;
            c.adamw.eps = 1e-6;
            Ok(c)
        };
        let mut cfg = base(layout)?;
        opts.apply(&mut cfg);
        let what = format!("seed {seed}: {layout}, batch {batch} x {grad_accum}, {opts:?}, {reward:?}");
        match follows_one_device(&what, &cfg, &base(Layout::single())?, |a, b, out| assert_eq!((a.dpo_accuracy, out.config.num_labels), (b.dpo_accuracy, Some(1)), "{what} step {}", a.step))? {
            true => checked += 1,
            false => refused += 1,
        }
    }
    println!("{checked} reward-model configurations checked against one device, {refused} refused");
    assert!(checked > 0, "every draw refused");
    Ok(())
}

/// Byte-level stepwise examples drawn from `seed`: a prompt of letters, its reverse in capitals
/// in 1–3 steps, each right or random, labelled right while every step so far is (or, with 3
/// labels, 2 for a right step after a wrong one).
fn steps(seed: u64, labels: usize) -> Result<StepSet> {
    let mut r = Rng::new(seed);
    let mut text = String::new();
    for _ in 0..10 {
        let p: String = (0..2 + r.below(6)).map(|_| (b'a' + r.below(12) as u8) as char).collect();
        let answer: Vec<char> = p.chars().rev().map(|x| x.to_ascii_uppercase()).collect();
        let (mut s, mut l, mut right) = (Vec::new(), Vec::new(), true);
        for chunk in answer.chunks(answer.len().div_ceil(1 + r.below(3))) {
            let good = r.below(3) > 0;
            let step: String = if good { chunk.iter().collect() } else { chunk.iter().map(|_| (b'A' + r.below(12) as u8) as char).collect() };
            let label = match (right, good) {
                (true, true) => 1,
                (false, true) if labels == 3 => 2,
                _ => 0,
            };
            right &= good;
            s.push(format!("\"{step}\""));
            l.push(label.to_string());
        }
        text.push_str(&format!("{{\"prompt\": \"{p}=\", \"completions\": [{}], \"labels\": [{}]}}\n", s.join(", "), l.join(", ")));
    }
    StepSet::read(&text, &bytes_of, "\n")
}

#[test]
fn random_prm_runs_follow_one_device() -> Result<()> {
    let (mut checked, mut refused) = (0, 0);
    for seed in seeds(CONFIGS)? {
        let mut d = rng(79_000 + seed);
        let (layout, batch, grad_accum, opts) = draw_run(&mut d);
        let labels = pick(&mut d, &[2, 3]);
        let prm = PrmConfig { num_labels: labels, dropout: Some(pick(&mut d, &[0.0, 0.1, 0.3])) };
        let last_only = pick(&mut d, &[false, false, true]);
        let model = LlamaConfig::tiny(128, 32, pick(&mut d, &[1, 2]), 4, 2);
        // (a third LoRA PRMs: adapters on q and v, the head trained whole, PEFT's TOKEN_CLS)
        let lora = match pick(&mut d, &[false, false, true]) {
            true => Some(candle_cp_llama::LoraSpec::new(4, 8.0, &["q_proj", "v_proj"])?.with_modules_to_save(&["score"])?),
            false => None,
        };
        let base = |layout: Layout| -> Result<TrainConfig> {
            let set = steps(seed, labels)?;
            let set = if last_only { set.last_step_only() } else { set };
            let mut c = TrainConfig::new(layout, ModelSource::Init(model.clone()), DataSource::Steps(set), 64, 3);
            (c.batch, c.grad_accum, c.seed, c.prm, c.lora) = (batch, grad_accum, seed, Some(prm), lora.clone());
            c.schedule.peak = 5e-3;
            c.adamw.eps = 1e-6;
            Ok(c)
        };
        let mut cfg = base(layout)?;
        opts.apply(&mut cfg);
        let what = format!("seed {seed}: {layout}, batch {batch} x {grad_accum}, {opts:?}, {prm:?}, last step only {last_only}, LoRA {}", lora.is_some());
        let check = |a: &StepMetrics, b: &StepMetrics, out: &TrainOutcome| {
            assert_eq!((out.config.num_labels, out.config.token_classifier.map(|t| t.dropout)), (Some(labels), prm.dropout), "{what}");
            let (x, y) = (a.dpo_accuracy.unwrap_or(-1.0), b.dpo_accuracy.unwrap_or(-2.0));
            assert!((x - y).abs() < 1e-9, "{what} step {}: accuracy {y} vs {x}", a.step);
        };
        match follows_one_device(&what, &cfg, &base(Layout::single())?, check)? {
            true => checked += 1,
            false => refused += 1,
        }
    }
    println!("{checked} PRM configurations checked against one device, {refused} refused");
    assert!(checked > 0, "every draw refused");
    Ok(())
}
