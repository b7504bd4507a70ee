use super::*;
use crate::train::dpo_loss::{assert_central_differences, sigmoid, softplus};
use crate::train::sft::bytes_of;
use crate::train::Rng;
use crate::{init_params, shard_params, CpKind, Layout, LlamaConfig};
use candle_cp_comm::run_ranks;
use candle_nn::VarBuilder;

/// Byte-level pairs: a prompt of lowercase letters; chosen: the letters reversed in capitals
/// (+ EOS 2), rejected: random capitals of the same length (+ EOS).
pub(crate) fn pairs_text(n: usize, seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut out = String::new();
    for _ in 0..n {
        let p: String = (0..2 + rng.below(6)).map(|_| (b'a' + rng.below(12) as u8) as char).collect();
        let c: String = p.chars().rev().map(|x| x.to_ascii_uppercase()).collect();
        let r: String = (0..p.len()).map(|_| (b'A' + rng.below(12) as u8) as char).collect();
        out.push_str(&format!("{{\"prompt\": \"{p}=\", \"chosen\": \"{c}\", \"rejected\": \"{r}\"}}\n"));
    }
    out
}

fn model_cfg() -> LlamaConfig {
    LlamaConfig::tiny(128, 32, 2, 4, 2)
}

/// A micro-batch of `rows` under the test model (seed 5) on one device, as the trainer holds
/// it: the model and its variables, the batch, its sharded ids, labels and marks.
struct OneDevice {
    vm: candle_nn::VarMap,
    m: Llama,
    b: DpoBatch,
    sb: crate::ShardedBatch,
    labels: Vec<u32>,
    marks: Vec<u32>,
}

impl OneDevice {
    fn new(rows: &[PreferenceRow], seq: usize, ctx: &ParallelCtx) -> Result<Self> {
        let mcfg = model_cfg();
        let vm = shard_params(&init_params(&mcfg, 5, DType::F32, &Device::Cpu)?, &mcfg, ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &mcfg, ctx)?;
        let b = DpoBatch::new(rows, seq)?;
        let sb = shard_batch_packed(&b.ids, &b.documents, ctx)?;
        let labels: Vec<u32> = sb.labels.flatten_all()?.to_vec1()?;
        let marks: Vec<u32> = shard_batch(&b.marks, ctx)?.labels.flatten_all()?.to_vec1()?;
        Ok(Self { vm, m, b, sb, labels, marks })
    }

    /// The linearised node `node` (its gradients `grads`) against the loss written in candle
    /// ops, `direct`: both values `loss` (the terms') within 1e-5 relative above 1, and the
    /// largest relative difference of their gradients ([`worst_difference`]).
    fn node_against(&self, node: &Tensor, grads: &candle_core::backprop::GradStore, loss: f64, direct: &Tensor) -> Result<f64> {
        let lv = direct.to_scalar::<f32>()? as f64;
        assert!((lv - loss).abs() < 1e-5 * lv.abs().max(1.0), "value {lv} vs {loss}");
        assert!((node.to_scalar::<f32>()? as f64 - loss).abs() < 1e-5 * lv.abs().max(1.0), "node {node} vs {loss}");
        worst_difference(&self.vm, grads, &direct.backward()?)
    }

    /// The per-token losses, flattened (a graph of their own each call).
    fn nll(&self) -> Result<Tensor> {
        self.m.token_nll_packed(&self.sb.input_ids, &self.sb.labels, &self.sb.positions, &self.sb.documents)?.flatten_all()
    }
}

/// Each slot's summed log-probability `[slots]` from per-token losses `nll` by a one-hot
/// product over the scored targets (`scored`: each target's slot + 1, 0 unscored), in candle
/// ops (autograd's reference).
fn slot_logps(nll: &Tensor, scored: &[u32], slots: usize) -> Result<Tensor> {
    let onehot: Vec<f32> = scored.iter().flat_map(|&s| (0..slots).map(move |j| (s as usize == j + 1) as u8 as f32)).collect();
    nll.neg()?.unsqueeze(0)?.matmul(&Tensor::from_vec(onehot, (scored.len(), slots), &Device::Cpu)?)?.squeeze(0)
}

/// The loss in closed form, its accuracy and margin, and its derivatives against central
/// differences: every loss, with and without label smoothing, with RPO's term.
#[test]
fn terms_match_the_formula_and_finite_differences() -> Result<()> {
    let policy = [-3.0, -5.5, -2.0, -1.0, -7.0, -7.5];
    let reference = [-4.0, -4.0, -2.5, -0.5, -7.0, -7.0];
    let lengths = [3.0, 5.0, 2.0, 2.0, 6.0, 4.0];
    let pairs = [(0, 1), (2, 3), (4, 5)];
    let cases = [
        (0.0, DpoLoss::Sigmoid, 0.0),
        (0.2, DpoLoss::Sigmoid, 0.0),
        (0.0, DpoLoss::Sigmoid, 0.7),
        (0.2, DpoLoss::Robust, 0.0),
        (1e-3, DpoLoss::ExoPair, 0.0),
        (0.2, DpoLoss::ExoPair, 0.3),
        (0.0, DpoLoss::Ipo, 0.0),
        (0.0, DpoLoss::Hinge, 0.3),
        (0.0, DpoLoss::NcaPair, 0.0),
        (0.0, DpoLoss::SppoHard, 0.0),
        (0.0, DpoLoss::ApoZero, 0.2),
        (0.0, DpoLoss::ApoDown, 0.0),
        (0.0, DpoLoss::DiscoPop, 0.0),
        (0.0, DpoLoss::Simpo, 0.0),
        (0.1, DpoLoss::Simpo, 0.2),
        (0.0, DpoLoss::Orpo, 0.0),
        (0.0, DpoLoss::Orpo, 0.3),
    ];
    for (eps, loss, rpo_alpha) in cases {
        let cfg = DpoConfig { beta: 0.5, label_smoothing: eps, loss, simpo_gamma: 0.3, rpo_alpha, reference_model: None, ..DpoConfig::default() };
        cfg.validate().expect("valid");
        assert_eq!(loss.name().parse::<DpoLoss>()?, loss);
        let t = dpo_terms(&policy, &reference, &lengths, &pairs, &cfg)?;
        let hs: Vec<f64> = pairs
            .iter()
            .map(|&(c, r)| match loss {
                DpoLoss::Simpo => policy[c] / lengths[c] - policy[r] / lengths[r],
                DpoLoss::Ipo => (policy[c] - reference[c]) / lengths[c] - (policy[r] - reference[r]) / lengths[r],
                DpoLoss::Orpo => {
                    let odds = |a: f64| a - (1.0 - a.exp()).ln();
                    odds(policy[c] / lengths[c]) - odds(policy[r] / lengths[r])
                }
                _ => (policy[c] - reference[c]) - (policy[r] - reference[r]),
            })
            .collect();
        // (written from TRL's formulas with σ and ln σ, β = 0.5)
        let s = |z: f64| 1.0 / (1.0 + (-z).exp());
        let ls = |z: f64| s(z).ln();
        let smoothed = |z: f64| -(1.0 - eps) * ls(z) - eps * ls(-z);
        let dpo: f64 = hs
            .iter()
            .zip(&pairs)
            .map(|(&h, &(c, r))| {
                let (a, b) = (policy[c] - reference[c], policy[r] - reference[r]);
                match loss {
                    DpoLoss::Sigmoid => smoothed(0.5 * h),
                    DpoLoss::Robust => (-(1.0 - eps) * ls(0.5 * h) + eps * ls(-0.5 * h)) / (1.0 - 2.0 * eps),
                    DpoLoss::ExoPair => s(0.5 * h) * (ls(0.5 * h) - (1.0 - eps).ln()) + s(-0.5 * h) * (ls(-0.5 * h) - eps.ln()),
                    DpoLoss::Simpo => smoothed(0.5 * h - 0.3),
                    DpoLoss::Ipo => (h - 1.0).powi(2),
                    DpoLoss::Hinge => (1.0 - 0.5 * h).max(0.0),
                    DpoLoss::NcaPair => -ls(0.5 * a) - 0.5 * ls(-0.5 * a) - 0.5 * ls(-0.5 * b),
                    DpoLoss::SppoHard => (a - 1.0).powi(2) + (b + 1.0).powi(2),
                    DpoLoss::ApoZero => (1.0 - s(0.5 * a)) + s(0.5 * b),
                    DpoLoss::ApoDown => s(0.5 * a) + (1.0 - s(0.5 * (a - b))),
                    DpoLoss::DiscoPop => {
                        let (z, m) = (0.5 * h, s(0.5 * h / 0.05));
                        -ls(z) * (1.0 - m) + (-z).exp() * m
                    }
                    DpoLoss::Orpo => -0.5 * ls(h),
                    // (not among the cases: kto_terms, bco_terms, batch_losses_match_trls_formulas)
                    DpoLoss::Kto | DpoLoss::Bco | DpoLoss::ApoZeroUnpaired | DpoLoss::BcoPair | DpoLoss::AotPair | DpoLoss::Aot | DpoLoss::Sft => f64::NAN,
                }
            })
            .sum::<f64>()
            / 3.0;
        let chosen_ce = -(policy[0] + policy[2] + policy[4]) / (lengths[0] + lengths[2] + lengths[4]);
        let nll_weight = rpo_alpha + if loss == DpoLoss::Orpo { 1.0 } else { 0.0 };
        let want = dpo + nll_weight * chosen_ce;
        assert!((t.loss - want).abs() < 1e-12, "{loss:?}: {} vs {want}", t.loss);
        assert_eq!(t.accuracy, hs.iter().filter(|&&h| h > 0.0).count() as f64 / 3.0);
        assert!((t.margin - 0.5 * hs.iter().sum::<f64>() / 3.0).abs() < 1e-12);
        let at = |p: &[f64]| Ok(dpo_terms(p, &reference, &lengths, &pairs, &cfg)?.loss);
        assert_central_differences(&at, &policy, &t.d_logp, &[0, 1, 2, 3, 4, 5], (1e-5, 1e-8), &format!("{loss:?} eps {eps} rpo {rpo_alpha}"))?;
    }
    assert!(softplus(800.0).is_finite() && softplus(-800.0) >= 0.0 && (sigmoid(-800.0)).abs() < 1e-300);
    assert!(DpoConfig { beta: 0.0, ..DpoConfig::default() }.validate().is_err());
    assert!(DpoConfig { label_smoothing: 0.5, ..DpoConfig::default() }.validate().is_err());
    assert!(DpoConfig { label_smoothing: 0.1, loss: DpoLoss::Ipo, ..DpoConfig::default() }.validate().is_err());
    assert_eq!(("ipo".parse::<DpoLoss>()?, "hinge".parse::<DpoLoss>()?, "sigmoid".parse::<DpoLoss>()?), (DpoLoss::Ipo, DpoLoss::Hinge, DpoLoss::Sigmoid));
    assert!("bcx".parse::<DpoLoss>().unwrap_err().to_string().contains("sigmoid, robust, exo_pair, ipo, hinge, nca_pair, sppo_hard, apo_zero, apo_down, discopop, simpo, orpo, kto, bco_pair, bco, aot_pair, aot, sft, apo_zero_unpaired"));
    assert!(DpoConfig { loss: DpoLoss::ExoPair, ..DpoConfig::default() }.validate().unwrap_err().to_string().contains("exo_pair loss needs label_smoothing"));
    assert!(DpoConfig { label_smoothing: 0.1, loss: DpoLoss::Robust, ..DpoConfig::default() }.validate().is_ok());
    assert!(DpoConfig { label_smoothing: 0.1, loss: DpoLoss::NcaPair, ..DpoConfig::default() }.validate().is_err());
    assert!(DpoConfig { discopop_tau: 0.0, ..DpoConfig::default() }.validate().is_err());
    // DiscoPOP far from 0: no overflow of e^(−βh)
    let far = dpo_terms(&[-3000.0, 0.0], &[0.0, 0.0], &[1.0, 1.0], &[(0, 1)], &DpoConfig { loss: DpoLoss::DiscoPop, ..DpoConfig::default() })?;
    assert!(far.loss.is_finite() && far.d_logp.iter().all(|x| x.is_finite()), "{far:?}");
    for (name, l) in crate::train::dpo_loss::DPO_LOSSES {
        assert_eq!((name.parse::<DpoLoss>()?, l.name()), (l, name));
    }
    assert!(dpo_terms(&policy, &reference, &lengths, &pairs, &DpoConfig { loss: DpoLoss::Kto, ..DpoConfig::default() }).is_err());
    assert!(dpo_terms(&policy, &reference, &lengths[..5], &pairs, &DpoConfig::default()).unwrap_err().to_string().contains("answer 5"));
    assert!(DpoConfig { label_smoothing: 0.1, loss: DpoLoss::Simpo, ..DpoConfig::default() }.validate().is_ok());
    assert!(DpoConfig { rpo_alpha: -1.0, ..DpoConfig::default() }.validate().is_err());
    Ok(())
}

/// On one device, the linearised loss node's gradients equal autograd's gradients of the loss
/// written with candle ops (log-probabilities summed per answer by a one-hot product) —
/// DPO with label smoothing and RPO's term against a reference that differs from the policy,
/// SimPO, ORPO, bco_pair (δ, the first micro-batch's mean reward, a constant), aot_pair (each
/// sequence sorted by its values, as torch.sort) and MPO's mix — and its value is the loss; the
/// scored tokens per answer are the set's lengths.
#[test]
fn linearised_loss_has_the_gradients_of_dpo() -> Result<()> {
    let set = PreferenceSet::read(&pairs_text(12, 3), &bytes_of, Some(2), None)?;
    let (seq, batch) = (64, 2);
    let rows: Vec<PreferenceRow> = (0..batch).map(|r| set.sample(seq, &mut Rng::new(40 + r as u64))).collect::<Result<_>>()?;
    let sigmoid_rpo = DpoConfig { beta: 0.3, label_smoothing: 0.1, rpo_alpha: 0.4, ..DpoConfig::default() };
    let simpo = DpoConfig { beta: 2.0, loss: DpoLoss::Simpo, simpo_gamma: 0.5, ..DpoConfig::default() };
    let orpo = DpoConfig { beta: 0.5, loss: DpoLoss::Orpo, ..DpoConfig::default() };
    let bco_pair = DpoConfig { beta: 0.5, loss: DpoLoss::BcoPair, rpo_alpha: 0.2, ..DpoConfig::default() };
    let aot_pair = DpoConfig { beta: 0.5, loss: DpoLoss::AotPair, label_smoothing: 0.1, ..DpoConfig::default() };
    let mpo = DpoConfig { beta: 0.5, mix: vec![(DpoLoss::Sigmoid, 0.8), (DpoLoss::BcoPair, 0.2), (DpoLoss::Sft, 1.0)], ..DpoConfig::default() };
    for cfg in [sigmoid_rpo, simpo, orpo, bco_pair, aot_pair, mpo] {
        let out = run_ranks(1, |g| {
            let ctx = ParallelCtx::single(g)?;
            let one = OneDevice::new(&rows, seq, &ctx)?;
            let (b, labels, marks) = (&one.b, &one.labels, &one.marks);
            let mut rng = Rng::new(9);
            let reference: Vec<f64> = match cfg.loss {
                DpoLoss::Simpo | DpoLoss::Orpo => vec![0.0; 2 * set.len()],
                _ => (0..2 * set.len()).map(|_| -20.0 - 10.0 * rng.below(1000) as f64 / 1000.0).collect(),
            };
            let answers = Answers { reference: reference.clone(), lengths: set.scored_lengths(), desirable: None };
            let nll = || one.nll();
            // the linearised node
            let mut running = crate::train::bco::RunningMean::default();
            let (loss, terms) = b.loss((&nll()?, None), labels, marks, &answers, &cfg, &ctx, ctx.token_group(), None, &mut running)?;
            assert_eq!(terms.delta, cfg.keeps_running_mean().then_some(running.mean));
            let g1 = loss.backward()?;
            // the loss by candle ops
            let n1 = nll()?;
            let values: Vec<f32> = n1.to_vec1()?;
            let (_, scored) = b.logps(&values, labels, marks, &ctx, ctx.token_group())?;
            let slots = b.answers.len();
            for (j, &a) in b.answers.iter().enumerate() {
                assert_eq!(scored.iter().filter(|&&s| s as usize == j + 1).count() as f64, answers.lengths[a], "answer {a}'s scored tokens");
            }
            let logp = slot_logps(&n1, &scored, slots)?;
            let per_slot = |v: &[f64]| Tensor::from_vec(b.answers.iter().map(|&a| v[a] as f32).collect::<Vec<_>>(), slots, &Device::Cpu);
            let ratio = match cfg.loss {
                DpoLoss::Simpo => (&logp / per_slot(&answers.lengths)?)?,
                DpoLoss::Orpo => {
                    // log odds of the mean log-probability ā: ā − ln(1 − e^ā)
                    let mean = (&logp / per_slot(&answers.lengths)?)?;
                    (&mean - (mean.exp()?.neg()? + 1.0)?.log()?)?
                }
                _ => (&logp - per_slot(&reference)?)?,
            };
            let pairs = b.pairs(false)?;
            let idx = |f: fn(&(usize, usize)) -> usize| Tensor::from_vec(pairs.iter().map(|p| f(p) as u32).collect::<Vec<_>>(), pairs.len(), &Device::Cpu);
            let mut z = ((ratio.index_select(&idx(|p| p.0)?, 0)? - ratio.index_select(&idx(|p| p.1)?, 0)?)? * cfg.beta)?;
            if cfg.loss == DpoLoss::Simpo {
                z = (z - cfg.simpo_gamma)?;
            }
            let softplus = |x: &Tensor| -> Result<Tensor> { (x.exp()? + 1.0)?.log() };
            let sigmoid_of = |z: &Tensor| -> Result<Tensor> { ((softplus(&z.neg()?)? * (1.0 - cfg.label_smoothing))? + (softplus(z)? * cfg.label_smoothing)?)?.mean_all() };
            let chosen_ce = || -> Result<Tensor> {
                let tokens: f64 = pairs.iter().map(|p| answers.lengths[b.answers[p.0]]).sum();
                logp.index_select(&idx(|p| p.0)?, 0)?.sum_all()? * (-1.0 / tokens)
            };
            // (a tensor's entries in increasing order: the permutation from its values, as torch.sort)
            let sorted = |t: &Tensor| -> Result<Tensor> {
                let v = t.to_vec1::<f32>()?;
                let mut order: Vec<u32> = (0..v.len() as u32).collect();
                order.sort_by(|&x, &y| v[x as usize].total_cmp(&v[y as usize]).then(x.cmp(&y)));
                t.index_select(&Tensor::new(order.as_slice(), &Device::Cpu)?, 0)
            };
            let mut direct = (chosen_ce()? * cfg.rpo_alpha)?;
            for (l, w) in cfg.losses() {
                let one = match l {
                    DpoLoss::Orpo => ((softplus(&(&z / cfg.beta)?.neg()?)?.mean_all()? * cfg.beta)? + chosen_ce()?)?,
                    DpoLoss::BcoPair => {
                        // δ: the batch's mean reward over both answers of every pair (fresh running mean)
                        let rewards = (&ratio * cfg.beta)?;
                        let delta = rewards.to_vec1::<f32>()?.iter().map(|&x| x as f64).sum::<f64>() / slots as f64;
                        assert!((terms.delta.expect("delta") - delta).abs() < 1e-5 * delta.abs().max(1.0), "{terms:?} vs {delta}");
                        let x = (rewards.index_select(&idx(|p| p.0)?, 0)? - delta)?;
                        let y = (rewards.index_select(&idx(|p| p.1)?, 0)? - delta)?;
                        (softplus(&x.neg()?)? + softplus(&y)?)?.mean_all()?
                    }
                    DpoLoss::AotPair => {
                        let (chosen, rejected) = (sorted(&ratio.index_select(&idx(|p| p.0)?, 0)?)?, sorted(&ratio.index_select(&idx(|p| p.1)?, 0)?)?);
                        sigmoid_of(&((chosen - rejected)? * cfg.beta)?)?
                    }
                    DpoLoss::Sft => chosen_ce()?,
                    _ => sigmoid_of(&z)?,
                };
                direct = (direct + (one * w)?)?;
            }
            assert!(terms.margin.abs() > 0.01 && pairs.len() >= 2, "{terms:?}");
            one.node_against(&loss, &g1, terms.loss, &direct)
        });
        let worst = out.into_iter().next().expect("one rank")?;
        assert!(worst < 1e-4, "{cfg:?}: gradients differ by {worst} relative");
    }
    Ok(())
}

/// The largest difference between two sets of gradients of `vm`'s parameters, relative to
/// each parameter's largest gradient in `g2`; errors when a gradient is missing.
fn worst_difference(vm: &candle_nn::VarMap, g1: &candle_core::backprop::GradStore, g2: &candle_core::backprop::GradStore) -> Result<f64> {
    let mut worst = 0f64;
    for (name, v) in crate::params::lock_vars(vm)?.iter() {
        let (Some(a), Some(b)) = (g1.get(v.as_tensor()), g2.get(v.as_tensor())) else { bail!("{name}: a gradient is missing") };
        let scale = b.abs()?.max_keepdim(0)?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
        let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
        assert!(scale > 0.0, "{name}: zero gradient");
        worst = worst.max(diff / scale);
    }
    Ok(worst)
}

/// KTO (unpaired examples, λ_U = 1.5, a reference that puts the KL estimate above 0): the
/// examples' row and their KL documents' row sampled together; the KL estimate from the KL
/// rows' forward equals the one by hand; the linearised node's value is the loss and its
/// gradients equal autograd's gradients of KTO written with candle ops, the KL estimate a
/// constant (detached, as TRL's).
#[test]
fn linearised_loss_has_the_gradients_of_kto() -> Result<()> {
    let set = PreferenceSet::read_unpaired(&pairs_text(8, 3), &bytes_of, Some(2), None)?;
    let (seq, batch) = (64, 2);
    let split: Vec<(PreferenceRow, PreferenceRow)> = (0..batch).map(|r| set.sample_split(seq, &mut Rng::new(40 + r as u64))).collect::<Result<_>>()?;
    let (rows, kl_rows): (Vec<PreferenceRow>, Vec<PreferenceRow>) = split.into_iter().unzip();
    let cfg = DpoConfig { beta: 0.3, loss: DpoLoss::Kto, undesirable_weight: 1.5, ..DpoConfig::default() };
    let out = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let one = OneDevice::new(&rows, seq, &ctx)?;
        let (b, labels, marks) = (&one.b, &one.labels, &one.marks);
        let nll = || one.nll();
        // the KL rows' forward (the same examples' KL documents)
        let bk = DpoBatch::new(&kl_rows, seq)?;
        let kl_logps = KlLogps { answers: bk.answers.clone(), logps: bk.forward_logps(&one.m, &ctx, &Device::Cpu)? };
        assert_eq!(bk.answers, b.answers.iter().map(|a| a + 1).collect::<Vec<_>>());
        // the reference: the policy's own log-probabilities moved by −1..1 (examples) and
        // −2..0 (KL documents: the estimate ≈ 1)
        let (policy, scored) = b.logps(&nll()?.to_vec1::<f32>()?, labels, marks, &ctx, ctx.token_group())?;
        let mut rng = Rng::new(9);
        let mut reference = vec![0.0; 2 * set.len()];
        for ((&a, &p), (&k, &q)) in b.answers.iter().zip(&policy).zip(kl_logps.answers.iter().zip(&kl_logps.logps)) {
            let u = rng.below(1000) as f64 / 1000.0;
            reference[a] = p - (2.0 * u - 1.0);
            reference[k] = q - 2.0 * u;
        }
        let answers = Answers { reference: reference.clone(), lengths: set.scored_lengths(), desirable: set.desirable().map(<[bool]>::to_vec) };
        let mut running = crate::train::bco::RunningMean::default();
        let (loss, terms) = b.loss((&nll()?, None), labels, marks, &answers, &cfg, &ctx, ctx.token_group(), Some(&kl_logps), &mut running)?;
        // (without the KL rows the examples have no partner)
        assert!(b.loss((&nll()?, None), labels, marks, &answers, &cfg, &ctx, ctx.token_group(), None, &mut running).is_err());
        assert_eq!(running, crate::train::bco::RunningMean::default(), "KTO keeps no running mean");
        let g1 = loss.backward()?;
        let kl = terms.kl.expect("kl");
        assert!(kl > 0.2, "{terms:?}");
        // KTO by candle ops
        let n1 = nll()?;
        let slots = b.answers.len();
        let logp = slot_logps(&n1, &scored, slots)?;
        // z₀ by hand from the KL documents
        let z0 = (kl_logps.answers.iter().zip(&kl_logps.logps).map(|(&k, &q)| q - reference[k]).sum::<f64>() / slots as f64).max(0.0);
        assert!((z0 - kl).abs() < 1e-9, "{z0} vs {kl}");
        let examples = Tensor::from_vec((0..slots as u32).collect::<Vec<_>>(), slots, &Device::Cpu)?;
        let per_example = |f: &dyn Fn(usize) -> f64| Tensor::from_vec(b.answers.iter().map(|&a| f(a) as f32).collect::<Vec<_>>(), slots, &Device::Cpu);
        let sign = |a: usize| if set.desirable().expect("labels")[a / 2] { 1.0 } else { -1.0 };
        let weight = |a: usize| if sign(a) > 0.0 { 1.0 } else { 1.5 };
        // x = ±β·(r − z₀), loss = mean of λ·σ(−x) = λ / (1 + eˣ)
        let r = (logp.index_select(&examples, 0)? - per_example(&|a| reference[a] + kl)?)?;
        let x = ((r * per_example(&sign)?)? * cfg.beta)?;
        let direct = (per_example(&weight)? / (x.exp()? + 1.0)?)?.mean_all()?;
        one.node_against(&loss, &g1, terms.loss, &direct)
    });
    let worst = out.into_iter().next().expect("one rank")?;
    assert!(worst < 1e-4, "gradients differ by {worst} relative");
    Ok(())
}

/// BCO (unpaired examples without KL documents, a reference that differs from the policy, a
/// running mean that has seen two earlier micro-batches): rows pack examples only; the
/// linearised node's value is the loss and its gradients equal autograd's gradients of BCO
/// written with candle ops, δ (updated by this micro-batch's mean reward) a constant.
#[test]
fn linearised_loss_has_the_gradients_of_bco() -> Result<()> {
    let set = PreferenceSet::read_unpaired(&pairs_text(8, 3), &bytes_of, Some(2), None)?.without_kl_documents()?;
    let (seq, batch) = (64, 2);
    let rows: Vec<PreferenceRow> = (0..batch).map(|r| set.sample(seq, &mut Rng::new(40 + r as u64))).collect::<Result<_>>()?;
    assert!(rows.iter().all(|(_, ids)| ids.iter().flatten().all(|d| d % 2 == 0)), "examples only");
    let cfg = DpoConfig { beta: 0.3, loss: DpoLoss::Bco, ..DpoConfig::default() };
    let out = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let one = OneDevice::new(&rows, seq, &ctx)?;
        let (b, labels, marks) = (&one.b, &one.labels, &one.marks);
        let nll = || one.nll();
        let (policy, scored) = b.logps(&nll()?.to_vec1::<f32>()?, labels, marks, &ctx, ctx.token_group())?;
        // the reference: the policy's own log-probabilities moved by −1..1
        let mut rng = Rng::new(9);
        let mut reference = vec![0.0; 2 * set.len()];
        for (&a, &p) in b.answers.iter().zip(&policy) {
            reference[a] = p - (2.0 * rng.below(1000) as f64 / 1000.0 - 1.0);
        }
        let answers = Answers { reference: reference.clone(), lengths: set.scored_lengths(), desirable: set.desirable().map(<[bool]>::to_vec) };
        let mut running = crate::train::bco::RunningMean::default();
        running.update(0.4);
        running.update(-0.1);
        let (loss, terms) = b.loss((&nll()?, None), labels, marks, &answers, &cfg, &ctx, ctx.token_group(), None, &mut running)?;
        let g1 = loss.backward()?;
        let slots = b.answers.len();
        let sign = |a: usize| if set.desirable().expect("labels")[a / 2] { 1.0 } else { -1.0 };
        let rewards: Vec<f64> = b.answers.iter().zip(&policy).map(|(&a, &p)| cfg.beta * (p - reference[a])).collect();
        let delta = (0.4 - 0.1 + rewards.iter().sum::<f64>() / slots as f64) / 3.0;
        assert!((terms.delta.expect("delta") - delta).abs() < 1e-9 && running.mean == terms.delta.expect("delta"), "{terms:?} vs {delta}");
        assert!(b.answers.iter().any(|&a| sign(a) > 0.0) && b.answers.iter().any(|&a| sign(a) < 0.0), "both labels in the batch");
        // BCO by candle ops: x = ±(β·(log π − log π_ref) − δ), loss = mean of softplus(−x)
        let n1 = nll()?;
        let logp = slot_logps(&n1, &scored, slots)?;
        let per_example = |f: &dyn Fn(usize) -> f64| Tensor::from_vec(b.answers.iter().map(|&a| f(a) as f32).collect::<Vec<_>>(), slots, &Device::Cpu);
        let x = ((((logp - per_example(&|a| reference[a])?)? * cfg.beta)? - delta)? * per_example(&sign)?)?;
        let direct = (x.neg()?.exp()? + 1.0)?.log()?.mean_all()?;
        one.node_against(&loss, &g1, terms.loss, &direct)
    });
    let worst = out.into_iter().next().expect("one rank")?;
    assert!(worst < 1e-4, "gradients differ by {worst} relative");
    Ok(())
}

/// Each answer of `set`, its document run alone on one device by the model `mcfg` drawn from
/// `seed`: its scored tokens' log-probabilities, in order.
pub(crate) fn scored_alone(set: &PreferenceSet, mcfg: &LlamaConfig, seed: u64) -> Result<Vec<Vec<f64>>> {
    let out = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_params(&init_params(mcfg, seed, DType::F32, &Device::Cpu)?, mcfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), mcfg, &ctx)?;
        (0..2 * set.len())
            .map(|d| {
                let (t, marks) = set.document(d);
                let ids = Tensor::from_vec(t.clone(), (1, t.len()), &Device::Cpu)?;
                let sb = shard_batch(&ids, &ctx)?;
                let nll: Vec<f32> = m.token_nll(&sb.input_ids, &sb.labels, &sb.positions)?.flatten_all()?.to_vec1()?;
                Ok((0..t.len() - 1).filter(|&i| marks[i + 1]).map(|i| -(nll[i] as f64)).collect())
            })
            .collect::<Result<Vec<Vec<f64>>>>()
    });
    out.into_iter().next().expect("one rank")
}

/// The reference pass: each answer's summed log-probability equals that of its document run
/// alone (the packing isolates documents), on one device and on zigzag CP 2 (its tokens on
/// two ranks, the partial sums added over them).
#[test]
fn reference_logps_are_per_document_on_every_layout() -> Result<()> {
    let set = PreferenceSet::read(&pairs_text(7, 4), &bytes_of, Some(2), None)?;
    let mcfg = model_cfg();
    let by_layout = |layout: Layout| -> Result<Vec<f64>> {
        let out = run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_params(&init_params(&mcfg, 6, DType::F32, &Device::Cpu)?, &mcfg, &ctx)?;
            let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
            answer_logps(&m, &set, 2, 48, &ctx, &Device::Cpu)
        });
        let mut all = out.into_iter().collect::<Result<Vec<_>>>()?;
        for r in &all[1..] {
            assert_eq!(r, &all[0], "{layout}: ranks agree");
        }
        Ok(all.remove(0))
    };
    let one = by_layout(Layout::single())?;
    let alone: Vec<f64> = scored_alone(&set, &mcfg, 6)?.iter().map(|t| t.iter().sum()).collect();
    for (d, (a, b)) in one.iter().zip(&alone).enumerate() {
        assert!((a - b).abs() < 1e-4, "answer {d}: packed {a} vs alone {b}");
    }
    let cp = by_layout(Layout::cp(CpKind::Zigzag, 2))?;
    for (d, (a, b)) in one.iter().zip(&cp).enumerate() {
        assert!((a - b).abs() < 1e-4, "answer {d}: one device {a} vs zigzag 2 {b}");
    }
    // the file round trip, and a file of other data refused
    let dir = std::env::temp_dir().join(format!("candle-cp-dpo-ref-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("dpo_reference.json");
    write_reference(&path, &set, &one)?;
    assert_eq!(read_reference(&path, &set)?, one);
    let other = set.subset(0..3)?;
    assert!(read_reference(&path, &other).unwrap_err().to_string().contains("resume with the data"));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[path = "ld_dpo_tests.rs"]
pub(crate) mod ld_dpo_tests;

#[path = "wpo_tests.rs"]
mod wpo_tests;
