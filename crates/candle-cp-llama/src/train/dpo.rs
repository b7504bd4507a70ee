//! Direct preference optimisation (DPO, Rafailov et al. 2023) on every layout: the policy's
//! summed log-probability of each answer ([`super::preference`]'s documents) against the
//! reference model's, per pair
//!
//! ```text
//! z = β · ((log π(chosen) − log π_ref(chosen)) − (log π(rejected) − log π_ref(rejected)))
//! loss = mean over pairs of (1 − ε) · softplus(−z) + ε · softplus(z)      (ε: label smoothing)
//! ```
//!
//! (or robust DPO, EXO, IPO, the hinge, NCA, SPPO, APO-zero / -down, DiscoPOP, the reference-free SimPO
//! and ORPO: [`DpoLoss`], [`super::dpo_loss`]; BCO's pair loss against a running mean reward:
//! [`super::bco`]; or KTO and BCO over unpaired examples: [`super::kto`], [`super::bco`]).
//!
//! An answer's tokens lie on several ranks (CP cuts the row anywhere, DP holds other rows):
//! each rank sums its tokens' log-probabilities per answer, the partial sums are added over
//! the ranks holding distinct tokens (one small all-gather per micro-batch), and each rank
//! back-propagates the linearised loss `Σ_t w_t · nll_t` with `w_t = −∂loss/∂log π(answer of t)`
//! — whose gradients, summed over the ranks as the trainer sums every loss's, are exactly
//! DPO's. The reference log-probabilities are computed once, before the first step, by the
//! model as it starts (the reference: the loaded weights; a LoRA run's adapters start at
//! zero) or by a checkpoint of its own ([`DpoConfig::reference_model`]), over every pair in order ([`answer_logps`]); a resumed run reads them from its
//! output directory (`dpo_reference.json`).

use super::preference::{PreferenceRow, PreferenceSet};
use crate::{packed::shard_batch_packed, shard_batch, Llama, ParallelCtx, IGNORE};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_comm::Group;

pub use super::dpo_loss::DpoLoss;
use super::bco::{Delta, RunningMean};
use super::dpo_loss::{aot_loss, pair_loss};
use super::ld_dpo::shaped_terms;

pub use super::dpo_config::{DpoConfig, RefSync};
pub use super::dpo_run::{read_reference, write_reference};
pub(crate) use super::dpo_run::{prepare, DpoRun};

/// The loss of a batch of pairs and what it reports.
#[derive(Debug, Clone, PartialEq)]
pub struct DpoTerms {
    /// Mean loss over the pairs.
    pub loss: f64,
    /// Fraction of pairs whose chosen reward exceeds the rejected one (`h > 0`).
    pub accuracy: f64,
    /// Mean reward margin `β·h` (chosen reward − rejected reward; `h` the log-ratios' difference, per
    /// token for IPO and SimPO, ORPO's log odds, the rewards' under an f-divergence; KTO, BCO:
    /// [`super::kto::kto_terms`], [`super::bco::bco_terms`]).
    pub margin: f64,
    /// KTO's KL estimate `z₀` (`None` for the other losses).
    pub kl: Option<f64>,
    /// BCO's running mean reward δ as the loss used it ([`super::bco`]; `None` for the other
    /// losses).
    pub delta: Option<f64>,
    /// `∂loss / ∂log π(answer)` per answer, in the order of the log-probabilities given.
    pub d_logp: Vec<f64>,
}

/// DPO over `pairs` (indices of the chosen and the rejected answer into `policy`,
/// `reference` — the answers' summed log-probabilities — and `lengths`, their scored tokens).
/// Errors for [`DpoLoss::Kto`], [`DpoLoss::Bco`] and [`DpoLoss::BcoPair`] (which need more than
/// the pairs: [`super::kto::kto_terms`], [`super::bco::bco_terms`]) and for an answer index out
/// of range.
pub fn dpo_terms(policy: &[f64], reference: &[f64], lengths: &[f64], pairs: &[(usize, usize)], cfg: &DpoConfig) -> Result<DpoTerms> {
    match cfg.loss {
        DpoLoss::Kto => bail!("dpo_terms: the kto loss scores unpaired examples (kto_terms)"),
        l if l.running_mean() => bail!("dpo_terms: the {} loss scores against a running mean reward (bco_terms)", l.name()),
        _ => {}
    }
    if let Some(&(c, r)) = pairs.iter().find(|&&(c, r)| c.max(r) >= policy.len().min(reference.len()).min(lengths.len())) {
        bail!("dpo_terms: answer {} of {} log-probabilities ({} reference, {} lengths)", c.max(r), policy.len(), reference.len(), lengths.len())
    }
    let n = pairs.len().max(1) as f64;
    let (mut loss, mut right, mut margin) = (0.0, 0.0, 0.0);
    let mut d_logp = vec![0.0; policy.len()];
    match cfg.loss {
        // (rewards 0: no accuracy, no margin; its term is RPO's with α 1, below)
        DpoLoss::Sft => {}
        DpoLoss::AotPair | DpoLoss::Aot => {
            (loss, d_logp) = aot_loss(cfg, cfg.loss, policy, reference, pairs).ok_or_else(|| candle_core::Error::Msg("dpo_terms: not an aot loss".into()))?;
            for &(c, r) in pairs {
                let h = (policy[c] - reference[c]) - (policy[r] - reference[r]);
                right += (h > 0.0) as u8 as f64;
                margin += cfg.beta * h;
            }
        }
        _ => {
            for &(c, r) in pairs {
                let (h, l, gc, gr) = pair_loss(cfg, policy[c], policy[r], reference[c], reference[r], lengths[c], lengths[r]);
                loss += l / n;
                right += (h > 0.0) as u8 as f64;
                // (an f-divergence's h has the log-ratios' sign; the margin is the rewards', as TRL's)
                let h = if cfg.loss.takes_f_divergence() { (policy[c] - reference[c]) - (policy[r] - reference[r]) } else { h };
                margin += cfg.beta * h;
                d_logp[c] += gc / n;
                d_logp[r] += gr / n;
            }
        }
    }
    add_rpo(policy, lengths, pairs, chosen_ce_weight(cfg), &mut loss, &mut d_logp);
    Ok(DpoTerms { loss, accuracy: right / n, margin: margin / n, kl: None, delta: None, d_logp })
}

/// The weight of the chosen answers' cross-entropy in `cfg.loss`'s objective: RPO's α
/// ([`DpoConfig::rpo_alpha`]) plus ORPO's and sft's own 1.
pub(crate) fn chosen_ce_weight(cfg: &DpoConfig) -> f64 {
    cfg.rpo_alpha + if matches!(cfg.loss, DpoLoss::Orpo | DpoLoss::Sft) { 1.0 } else { 0.0 }
}

/// `alpha` × the chosen answers' mean cross-entropy per scored token (RPO's term,
/// [`chosen_ce_weight`]) added to a pairs' loss and its derivatives.
pub(crate) fn add_rpo(policy: &[f64], lengths: &[f64], pairs: &[(usize, usize)], alpha: f64, loss: &mut f64, d_logp: &mut [f64]) {
    if alpha > 0.0 {
        let tokens: f64 = pairs.iter().map(|&(c, _)| lengths[c]).sum::<f64>().max(1.0);
        for &(c, _) in pairs {
            *loss -= alpha * policy[c] / tokens;
            d_logp[c] -= alpha / tokens;
        }
    }
}

/// [`dpo_terms`] over pairs, [`super::kto::kto_terms`] over unpaired examples or
/// [`super::bco::bco_terms`] over either (with `delta`, BCO's running mean): `policy` per
/// slot, `of` each slot's answer index into `answers`, `pairs` of slots (an example's first).
/// Errors when the loss and the data disagree.
pub(super) fn terms<'a>(policy: &[f64], answers: &Answers, of: &[usize], pairs: &[(usize, usize)], cfg: &DpoConfig, delta: Option<Delta<'a>>) -> Result<DpoTerms> {
    let pick = |v: &[f64], what: &str| -> Result<Vec<f64>> {
        of.iter().map(|&a| v.get(a).copied().ok_or_else(|| candle_core::Error::Msg(format!("dpo: no {what} for answer {a}")))).collect()
    };
    let (reference, lengths) = (pick(&answers.reference, "reference log-probability")?, pick(&answers.lengths, "length")?);
    let given = delta;
    let delta = |d: Option<Delta<'a>>| d.ok_or_else(|| candle_core::Error::Msg(format!("dpo: the {} loss scores against its running mean reward, and none was given", cfg.loss.name())));
    match (&answers.desirable, cfg.loss) {
        (Some(d), l) if l.unpaired() => {
            let label = |e: usize| d.get(of[e] / 2).copied().ok_or_else(|| candle_core::Error::Msg(format!("dpo: no label for example {}", of[e] / 2)));
            let labels: Vec<bool> = pairs.iter().map(|&(e, _)| label(e)).collect::<Result<_>>()?;
            match l {
                DpoLoss::Kto => super::kto::kto_terms(policy, &reference, pairs, &labels, cfg),
                DpoLoss::ApoZeroUnpaired => super::kto::apo_zero_unpaired_terms(policy, &reference, pairs, &labels, cfg),
                _ => super::bco::bco_terms(policy, &reference, &lengths, pairs, Some(&labels), delta(given)?, cfg),
            }
        }
        (None, l) if l.unpaired() => bail!("dpo: the {} loss trains on unpaired examples (PreferenceSet::from_unpaired, --kto / --bco data), not pairs", l.name()),
        (Some(_), l) => bail!("dpo: unpaired examples train by the kto, bco or apo_zero_unpaired loss, not {}", l.name()),
        (None, _) if !cfg.mix.is_empty() => mixed_terms(policy, &reference, &lengths, pairs, cfg, given),
        (None, DpoLoss::BcoPair) => super::bco::bco_terms(policy, &reference, &lengths, pairs, None, delta(given)?, cfg),
        (None, _) => dpo_terms(policy, &reference, &lengths, pairs, cfg),
    }
}

/// [`DpoConfig::mix`]'s objective over pairs: `Σ wᵢ·lossᵢ` and its derivatives (bco_pair's with
/// `delta`), RPO's term once; `margin` the weighted sum of the losses' margins and `accuracy`
/// the first loss's other than sft (TRL adds the losses' rewards weighted, sft's being 0),
/// `delta` bco_pair's.
pub fn mixed_terms(policy: &[f64], reference: &[f64], lengths: &[f64], pairs: &[(usize, usize)], cfg: &DpoConfig, mut delta: Option<Delta<'_>>) -> Result<DpoTerms> {
    let mut out = DpoTerms { loss: 0.0, accuracy: 0.0, margin: 0.0, kl: None, delta: None, d_logp: vec![0.0; policy.len()] };
    let mut accuracy = None;
    for (l, w) in cfg.losses() {
        let one = DpoConfig { loss: l, rpo_alpha: 0.0, mix: Vec::new(), ..cfg.clone() };
        let t = match l {
            DpoLoss::BcoPair => {
                let d = delta.take().ok_or_else(|| candle_core::Error::Msg("dpo: the bco_pair loss scores against its running mean reward, and none was given".into()))?;
                super::bco::bco_terms(policy, reference, lengths, pairs, None, d, &one)?
            }
            _ => dpo_terms(policy, reference, lengths, pairs, &one)?,
        };
        out.loss += w * t.loss;
        out.margin += w * t.margin;
        out.delta = out.delta.or(t.delta);
        if l != DpoLoss::Sft {
            accuracy = accuracy.or(Some(t.accuracy));
        }
        out.d_logp.iter_mut().zip(&t.d_logp).for_each(|(a, b)| *a += w * b);
    }
    out.accuracy = accuracy.unwrap_or(0.0);
    // (RPO's α once; sft's own term came with its entry)
    add_rpo(policy, lengths, pairs, cfg.rpo_alpha, &mut out.loss, &mut out.d_logp);
    Ok(out)
}

/// One micro-batch of preference rows as the trainer feeds it: ids and target marks
/// `[B, T]`, the rows' documents, and per token `slot + 1` of its answer (0: padding) with the
/// answers' indices in the set per slot.
pub(crate) struct DpoBatch {
    pub ids: Tensor,
    pub marks: Tensor,
    pub documents: Vec<candle_cp_ops::packing::Documents>,
    slots: Tensor,
    pub(super) answers: Vec<usize>,
    /// Per token, its rank among its answer's scored tokens (from 1; 0: not scored), `[B, T]`
    /// ([`super::ld_dpo`]).
    ranks: Tensor,
    /// Per slot, LD-DPO's `l_p` ([`super::ld_dpo::public_lengths`]).
    public: Vec<u32>,
    /// Per slot, its answer's scored tokens.
    counts: Vec<u32>,
}

/// A micro-batch's summed log-probabilities on a rank ([`DpoBatch::scored_logps`]).
struct Scored {
    /// Per slot, the plain sums over the batch.
    plain: Vec<f64>,
    /// Per slot, LD-DPO's weighted sums (with an α).
    ld: Option<Vec<f64>>,
    /// Per slot, WPO's mean of `log p − log Σ_v p_v²` over the answer's scored tokens (with
    /// the statistic).
    wpo: Option<Vec<f64>>,
    /// Per local target, its slot + 1 (0: not scored).
    slots: Vec<u32>,
    /// Per local target, its LD-DPO weight (1 without α, or not scored).
    factor: Vec<f64>,
}

impl DpoBatch {
    /// From sampled rows (all `seq_len` long).
    pub(crate) fn new(rows: &[PreferenceRow], seq_len: usize) -> Result<Self> {
        let (mut ids, mut marks, mut slots, mut docs, mut answers) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut ranks, mut counts) = (Vec::new(), Vec::new());
        for (sample, doc_ids) in rows {
            let d = sample.documents.clone().ok_or_else(|| candle_core::Error::Msg("dpo: a preference row without documents".into()))?;
            let mut start = 0;
            for (len, id) in d.lengths().into_iter().zip(doc_ids) {
                let slot = match id {
                    Some(a) => {
                        answers.push(*a);
                        answers.len() as u32
                    }
                    None => 0,
                };
                slots.extend(std::iter::repeat_n(slot, len));
                // (an answer's scored tokens: its marked ones but the document's first, which
                // nothing predicts — PreferenceSet::scored_lengths)
                let mut k = 0u32;
                for p in start..start + len {
                    let scored = slot > 0 && p > start && sample.long_range.get(p).copied().unwrap_or(false);
                    k += scored as u32;
                    ranks.push(if scored { k } else { 0 });
                }
                if slot > 0 {
                    counts.push(k);
                }
                start += len;
            }
            ids.extend_from_slice(&sample.tokens);
            marks.extend(sample.long_range.iter().map(|&m| m as u32));
            docs.push(d);
        }
        let shape = (rows.len(), seq_len);
        Ok(Self {
            ids: Tensor::from_vec(ids, shape, &Device::Cpu)?,
            marks: Tensor::from_vec(marks, shape, &Device::Cpu)?,
            documents: docs,
            slots: Tensor::from_vec(slots, shape, &Device::Cpu)?,
            ranks: Tensor::from_vec(ranks, shape, &Device::Cpu)?,
            public: super::ld_dpo::public_lengths(&answers, &counts),
            counts,
            answers,
        })
    }

    /// The answers' summed log-probabilities over the whole batch, per slot: this rank's
    /// per-token losses `nll` (its shard, flattened; `labels` its labels, `marks` the shard's
    /// labels of [`DpoBatch::marks`]) summed per answer, then over `group`. Also returns each
    /// local target's slot + 1 (0: not scored).
    #[cfg(test)]
    fn logps(&self, nll: &[f32], labels: &[u32], marks: &[u32], ctx: &ParallelCtx, group: &Group) -> Result<(Vec<f64>, Vec<u32>)> {
        let s = self.scored_logps(nll, None, labels, marks, None, ctx, group)?;
        Ok((s.plain, s.slots))
    }

    /// [`DpoBatch::logps`] and, with LD-DPO's `ld_alpha`, the weighted sums, with WPO's
    /// statistic `sq` (each local target's `log Σ_v p_v²`, as `nll`) the answers' mean
    /// adjusted log-probabilities (one all-gather for all).
    #[allow(clippy::too_many_arguments)]
    fn scored_logps(&self, nll: &[f32], sq: Option<&[f32]>, labels: &[u32], marks: &[u32], ld_alpha: Option<f64>, ctx: &ParallelCtx, group: &Group) -> Result<Scored> {
        // (each target's mark, answer and rank are those of the token it predicts: the shard's
        // labels of the marks, slots and ranks, as the trainer's selection reads the marks)
        let slots: Vec<u32> = shard_batch(&self.slots, ctx)?.labels.flatten_all()?.to_vec1()?;
        if marks.len() != nll.len() || labels.len() != nll.len() || sq.is_some_and(|q| q.len() != nll.len()) {
            bail!("dpo: {} per-token losses for {} labels, {} marks and {:?} statistics", nll.len(), labels.len(), marks.len(), sq.map(<[f32]>::len))
        }
        let ranks: Vec<u32> = match ld_alpha {
            Some(_) => shard_batch(&self.ranks, ctx)?.labels.flatten_all()?.to_vec1()?,
            None => Vec::new(),
        };
        let n = self.answers.len();
        // (plain sums, then the weighted ones, then WPO's)
        let (at_ld, at_wpo) = (n, n * (1 + ld_alpha.is_some() as usize));
        let mut part = vec![0f64; at_wpo + if sq.is_some() { n } else { 0 }];
        let mut factor = vec![1.0; nll.len()];
        let scored: Vec<u32> = (0..nll.len())
            .map(|i| {
                let s = slots[i];
                if labels[i] != IGNORE && marks[i] == 1 && s > 0 {
                    part[s as usize - 1] -= nll[i] as f64;
                    if let Some(a) = ld_alpha {
                        factor[i] = super::ld_dpo::factor(ranks[i], self.public[s as usize - 1], a);
                        part[at_ld + s as usize - 1] -= factor[i] * nll[i] as f64;
                    }
                    if let Some(q) = sq {
                        part[at_wpo + s as usize - 1] -= nll[i] as f64 + q[i] as f64;
                    }
                    s
                } else {
                    0
                }
            })
            .collect();
        let mut plain = sum_over(&part, group)?;
        let wpo = sq.map(|_| plain.split_off(at_wpo).into_iter().zip(&self.counts).map(|(x, &c)| x / c.max(1) as f64).collect());
        let ld = ld_alpha.map(|_| plain.split_off(at_ld));
        Ok(Scored { plain, ld, wpo, slots: scored, factor })
    }

    /// Every answer's summed log-probability under `model`, by slot: a forward of the batch on
    /// the run's layout, no graph kept (the reference pass, KTO's KL rows). Collective over
    /// the world.
    pub(super) fn forward_logps(&self, model: &Llama, ctx: &ParallelCtx, dev: &Device) -> Result<Vec<f64>> {
        Ok(self.forward_policy(model, &DpoConfig::default(), ctx, dev)?.plain)
    }

    /// [`DpoBatch::forward_logps`] and what `cfg` asks of the policy beside the plain sums
    /// (LD-DPO's weighted sums, WPO's means), by slot.
    fn forward_policy(&self, model: &Llama, cfg: &DpoConfig, ctx: &ParallelCtx, dev: &Device) -> Result<PolicyLogps> {
        let sb = shard_batch_packed(&self.ids, &self.documents, ctx)?;
        let (ids, labels_d, pos) = (sb.input_ids.to_device(dev)?, sb.labels.to_device(dev)?, sb.positions.to_device(dev)?);
        let (nll, sq) = match cfg.use_weighting {
            true => model.token_nll_packed_stat(&ids, &labels_d, &pos, &sb.documents, crate::head_loss::HeadStat::SumSq).map(|(n, q)| (n, Some(q)))?,
            false => (model.token_nll_packed(&ids, &labels_d, &pos, &sb.documents)?, None),
        };
        let host = |t: &Tensor| -> Result<Vec<f32>> { t.detach().flatten_all()?.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec1() };
        let (values, sq) = (host(&nll)?, sq.as_ref().map(host).transpose()?);
        let labels: Vec<u32> = sb.labels.flatten_all()?.to_vec1()?;
        let marks: Vec<u32> = shard_batch(&self.marks, ctx)?.labels.flatten_all()?.to_vec1()?;
        let s = self.scored_logps(&values, sq.as_deref(), &labels, &marks, cfg.ld_alpha, ctx, ctx.token_group())?;
        Ok(PolicyLogps { plain: s.plain, ld: s.ld, wpo: s.wpo })
    }

    /// Pairs as (chosen slot, rejected slot); BCO's unpaired examples (`unpaired`) as (slot,
    /// slot).
    fn pairs(&self, unpaired: bool) -> Result<Vec<(usize, usize)>> {
        if unpaired {
            return Ok((0..self.answers.len()).map(|i| (i, i)).collect());
        }
        let mut out = Vec::new();
        for (i, &a) in self.answers.iter().enumerate() {
            if a % 2 == 0 {
                match self.answers.get(i + 1) {
                    Some(&r) if r == a + 1 => out.push((i, i + 1)),
                    _ => bail!("dpo: answer {a} (a chosen one) is not followed by its rejected answer in the batch"),
                }
            }
        }
        Ok(out)
    }

    /// The micro-batch's loss node: `Σ_t w_t · nll_t` over this rank's scored targets (`nll`
    /// its per-token losses, flattened, on the compute device; `labels` its labels, `marks` the
    /// shard's labels of [`DpoBatch::marks`], as the trainer has them), shifted by
    /// a constant so that its value is the DPO loss; and the terms. `answers` holds every
    /// answer's reference log-probability and scored tokens, by the answer's index in the set.
    /// KTO: `kl`, the policy's log-probabilities of the batch's examples' KL documents
    /// ([`KlLogps`]), each example paired with its own. BCO: `running`, δ, updated by the
    /// micro-batch's mean reward before the loss.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn loss(&self, (nll, sq): (&Tensor, Option<&Tensor>), labels: &[u32], marks: &[u32], answers: &Answers, cfg: &DpoConfig, ctx: &ParallelCtx, group: &Group, kl: Option<&KlLogps>, running: &mut RunningMean) -> Result<(Tensor, DpoTerms)> {
        let host = |t: &Tensor| -> Result<Vec<f32>> { t.detach().flatten_all()?.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec1() };
        let (values, sq) = (host(nll)?, sq.map(host).transpose()?);
        if cfg.use_weighting != sq.is_some() {
            bail!("dpo: WPO's weights need the head's log Σ p² per token (Llama::token_nll_packed_stat with HeadStat::SumSq), and only WPO takes it")
        }
        let Scored { plain: policy, ld, wpo, slots: scored, factor } = self.scored_logps(&values, sq.as_deref(), labels, marks, cfg.ld_alpha, ctx, group)?;
        let (terms, d_plain) = match kl {
            None if cfg.loss == DpoLoss::Kto => bail!("kto: the micro-batch's KL documents were not scored (DpoRun::kl_logps)"),
            None => {
                let pairs = self.pairs(cfg.loss.unpaired())?;
                let weights = wpo.map(|m| super::wpo::pair_weights(&m, &pairs));
                shaped_terms(&policy, ld.as_deref(), weights.as_deref(), answers, &self.answers, &pairs, cfg, Some(Delta::Update(running)))?
            }
            Some(k) => {
                // (the KL documents' slots after the examples': example j with its KL document)
                let n = self.answers.len();
                let of_kl = |j: usize, a: usize| k.answers.iter().position(|&b| b == a + 1).map(|i| (j, n + i));
                let pairs: Vec<(usize, usize)> = self
                    .answers
                    .iter()
                    .enumerate()
                    .map(|(j, &a)| of_kl(j, a).ok_or_else(|| candle_core::Error::Msg(format!("kto: example {} without its KL document in the micro-batch", a / 2))))
                    .collect::<Result<_>>()?;
                let all: Vec<f64> = policy.iter().chain(&k.logps).copied().collect();
                let of: Vec<usize> = self.answers.iter().chain(&k.answers).copied().collect();
                (terms(&all, answers, &of, &pairs, cfg, None)?, vec![0.0; policy.len()])
            }
        };
        // ∂loss/∂nll_t = −∂loss/∂log π(answer of t) (LD-DPO: −(∂loss/∂log π_LD · f_t + ∂loss/∂log π))
        let w: Vec<f32> = scored.iter().zip(&factor).map(|(&s, &f)| if s == 0 { 0.0 } else { -(terms.d_logp[s as usize - 1] * f + d_plain[s as usize - 1]) as f32 }).collect();
        let graph = (nll.to_dtype(DType::F32)? * Tensor::from_vec(w, nll.shape(), nll.device())?)?.sum_all()?;
        let gv = graph.to_scalar::<f32>()? as f64;
        Ok(((graph + (terms.loss - gv))?, terms))
    }
}

/// KTO's KL documents of a micro-batch under the policy: their answer indices and summed
/// log-probabilities ([`DpoRun::kl_logps`]).
#[derive(Debug, Clone)]
pub(crate) struct KlLogps {
    pub(super) answers: Vec<usize>,
    pub(super) logps: Vec<f64>,
}

/// `v` summed element-wise over `group` (an f64 all-gather on the host, added in rank order,
/// as `metrics::step_sums` adds the loss terms).
pub(crate) fn sum_over(v: &[f64], group: &Group) -> Result<Vec<f64>> {
    if group.size() == 1 || v.is_empty() {
        return Ok(v.to_vec());
    }
    let rows = group.all_gather(&Tensor::from_slice(v, (1, v.len()), &Device::Cpu)?, 0)?.to_vec2::<f64>()?;
    Ok((0..v.len()).map(|i| rows.iter().map(|r| r[i]).sum()).collect())
}

/// Every answer's summed log-probability under `model` (the reference pass; a held-out
/// evaluation's policy), by answer index: the pairs in order, `batch` rows of `seq_len` per forward (the
/// last batch padded with empty rows), on the run's layout.
pub fn answer_logps(model: &Llama, set: &PreferenceSet, batch: usize, seq_len: usize, ctx: &ParallelCtx, dev: &Device) -> Result<Vec<f64>> {
    Ok(policy_logps(model, set, batch, seq_len, &DpoConfig::default(), ctx, dev)?.plain)
}

/// What a DPO objective reads of the policy per answer ([`policy_logps`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLogps {
    /// The answers' summed log-probabilities.
    pub plain: Vec<f64>,
    /// LD-DPO's weighted sums ([`DpoConfig::ld_alpha`], [`super::ld_dpo`]).
    pub ld: Option<Vec<f64>>,
    /// WPO's mean over each answer's scored tokens of `log p − log Σ_v p_v²`
    /// ([`DpoConfig::use_weighting`], [`super::wpo`]).
    pub wpo: Option<Vec<f64>>,
}

/// [`answer_logps`] and what `cfg` reads of the policy beside them ([`PolicyLogps`]), by
/// answer index. Collective over the world.
pub fn policy_logps(model: &Llama, set: &PreferenceSet, batch: usize, seq_len: usize, cfg: &DpoConfig, ctx: &ParallelCtx, dev: &Device) -> Result<PolicyLogps> {
    let mut rows = set.in_order(seq_len)?;
    let pad = || -> Result<PreferenceRow> {
        let s = super::Sample { tokens: vec![0; seq_len], long_range: vec![false; seq_len], documents: Some(candle_cp_ops::packing::Documents::single(seq_len)?) };
        Ok((s, vec![None]))
    };
    while !rows.len().is_multiple_of(batch) {
        rows.push(pad()?);
    }
    // (a KL document the set never scores, BCO's: 0)
    let mut out: Vec<f64> = (0..2 * set.len()).map(|d| if set.is_scored(d) { f64::NAN } else { 0.0 }).collect();
    let mut weighted = cfg.ld_alpha.map(|_| out.clone());
    let mut wpo = cfg.use_weighting.then(|| out.clone());
    model.set_lora_dropout(None)?;
    let place = |into: &mut Option<Vec<f64>>, from: Option<Vec<f64>>, answers: &[usize]| {
        if let (Some(to), Some(v)) = (into, from) {
            for (slot, x) in v.into_iter().enumerate() {
                to[answers[slot]] = x;
            }
        }
    };
    for chunk in rows.chunks(batch) {
        let b = DpoBatch::new(chunk, seq_len)?;
        let p = b.forward_policy(model, cfg, ctx, dev)?;
        for (slot, logp) in p.plain.into_iter().enumerate() {
            out[b.answers[slot]] = logp;
        }
        place(&mut weighted, p.ld, &b.answers);
        place(&mut wpo, p.wpo, &b.answers);
    }
    if let Some(a) = out.iter().chain(weighted.iter().flatten()).chain(wpo.iter().flatten()).position(|x| !x.is_finite()) {
        bail!("dpo: the log-probability of answer {} is not finite", a % out.len())
    }
    Ok(PolicyLogps { plain: out, ld: weighted, wpo })
}

/// What the loss knows of each answer of a set, by answer index.
#[derive(Debug, Clone)]
pub(crate) struct Answers {
    /// The reference's summed log-probability (zeros for SimPO and ORPO, which have none).
    pub reference: Vec<f64>,
    /// Scored tokens ([`PreferenceSet::scored_lengths`]).
    pub lengths: Vec<f64>,
    /// KTO and BCO: each example's label, by example ([`PreferenceSet::desirable`]); `None` for
    /// pairs.
    pub desirable: Option<Vec<bool>>,
}

#[cfg(test)]
#[path = "dpo_tests.rs"]
pub(crate) mod tests;
