//! Process reward model training (TRL's `PRMTrainer`, Math-Shepherd's step labels) on every
//! layout: a token classifier ([`crate::prm`]) learns whether each reasoning step is right,
//! from the step's last token (its separator):
//!
//! ```text
//! {"prompt": "2+3·4?", "completions": ["3·4 = 12", "2 + 12 = 15"], "labels": [true, false]}
//!
//! document:  BOS 2+3·4?  3·4 = 12 ⏎  2 + 12 = 15 ⏎
//! labels:    -100 ...    -100 ..  1  -100 ....   0        (class 1: the step is right)
//! loss    =  mean over the labelled tokens of −log softmax(logits)[label]
//! ```
//!
//! The examples are packed whole into rows (attention, RoPE and the loss per document, as
//! [`super::preference`]'s); an example longer than a row is cut to the row's length (TRL's
//! `max_length`). Each rank's loss is the cross-entropy of its own labelled tokens over their
//! count in the whole micro-batch ([`crate::global_mean`] over the ranks holding distinct
//! tokens), so the gradients summed over the ranks are the mean's.

use super::data::Sample;
use super::rng::Rng;
use super::sft::{json_lines, Tokenize};
use crate::{shard_batch, shard_batch_packed, Llama, ParallelCtx, IGNORE};
use candle_core::{bail, Device, Result, Tensor, D};
use candle_cp_comm::Group;
use candle_cp_ops::packing::Documents;
use serde_json::Value;

/// A process-reward run's settings ([`super::TrainConfig::prm`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrmConfig {
    /// The labels of the head drawn for a causal LM (TRL's PRM: 2, a step wrong or right); a
    /// token classifier's own must be these.
    pub num_labels: usize,
    /// Dropout on the head's input while training (`None`: the checkpoint's, transformers'
    /// 0.1 for a causal LM).
    pub dropout: Option<f64>,
}

impl Default for PrmConfig {
    fn default() -> Self {
        Self { num_labels: 2, dropout: None }
    }
}

impl PrmConfig {
    /// The token classifier this run sets (`None`: the checkpoint's); errors for a dropout
    /// outside `[0, 1)` or no label.
    pub fn classifier(&self) -> Result<Option<crate::prm::TokenClassifier>> {
        if self.num_labels == 0 {
            bail!("prm: a token classifier of no label")
        }
        self.dropout.map(crate::prm::TokenClassifier::new).transpose()
    }
}

/// Process-supervised examples, tokenised: per example its tokens and per token its label
/// (a class, or [`IGNORE`] where nothing is learnt).
#[derive(Debug, Clone)]
pub struct StepSet {
    docs: Vec<(Vec<u32>, Vec<u32>)>,
}

/// A sampled row and its labels, one per token (the padding's [`IGNORE`]).
pub type StepRow = (Sample, Vec<u32>);

impl StepSet {
    /// From (tokens, labels) examples. Errors for an empty set, an example whose labels are
    /// not one per token, or one without tokens or labels.
    pub fn from_examples(docs: Vec<(Vec<u32>, Vec<u32>)>) -> Result<Self> {
        if docs.is_empty() {
            bail!("step data: no example")
        }
        for (i, (t, l)) in docs.iter().enumerate() {
            if t.is_empty() || t.len() != l.len() {
                bail!("step data: example {i} has {} tokens and {} labels (one per token, at least one)", t.len(), l.len())
            }
            if l.iter().all(|&x| x == IGNORE) {
                bail!("step data: example {i} has no labelled step")
            }
        }
        Ok(Self { docs })
    }

    /// TRL's stepwise-supervision lines `{"prompt": "...", "completions": ["step", ...],
    /// "labels": [true, ...]}` (blank lines skipped): as TRL's `PRMTrainer` tokenises them,
    /// the prompt with the tokenizer's special tokens (its BOS), then each step followed by
    /// `separator`'s tokens, whose last token carries the step's label (`true` 1, `false` 0,
    /// or a class number). Errors name the line.
    pub fn read(text: &str, tokenize: Tokenize, separator: &str) -> Result<Self> {
        let sep = tokenize(separator, false)?;
        if sep.is_empty() {
            bail!("step data: the step separator {separator:?} has no token")
        }
        let docs = json_lines(text, "step data", |v| {
            let (Some(p), Some(Value::Array(steps)), Some(Value::Array(labels))) = (v.get("prompt").and_then(Value::as_str), v.get("completions"), v.get("labels")) else {
                bail!("expected {{\"prompt\": string, \"completions\": [strings], \"labels\": [bools]}}, got {v}")
            };
            if steps.len() != labels.len() || steps.is_empty() {
                bail!("{} steps and {} labels (one per step, at least one)", steps.len(), labels.len())
            }
            let mut tokens = tokenize(p, true)?;
            let mut out = vec![IGNORE; tokens.len()];
            for (s, l) in steps.iter().zip(labels) {
                let Some(s) = s.as_str() else { bail!("a step must be a string, got {s}") };
                let label = match l {
                    Value::Bool(b) => *b as u32,
                    v => v.as_u64().filter(|&c| c < IGNORE as u64).ok_or_else(|| candle_core::Error::Msg(format!("a label must be a bool or a class number, got {v}")))? as u32,
                };
                tokens.extend(tokenize(s, false)?);
                tokens.extend_from_slice(&sep);
                out.resize(tokens.len() - 1, IGNORE);
                out.push(label);
            }
            Ok((tokens, out))
        })?;
        Self::from_examples(docs)
    }

    /// The same examples with only each one's last step labelled (TRL's
    /// `train_on_last_step_only`, for the training set).
    pub fn last_step_only(mut self) -> Self {
        for (_, l) in &mut self.docs {
            if let Some(last) = l.iter().rposition(|&x| x != IGNORE) {
                l[..last].iter_mut().for_each(|x| *x = IGNORE);
            }
        }
        self
    }

    /// The number of examples.
    pub fn len(&self) -> usize {
        self.docs.len()
    }

    /// Whether there is no example (never: [`StepSet::from_examples`] refuses).
    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    /// Example `i`'s tokens and per-token labels (`None` past [`StepSet::len`]).
    pub fn example(&self, i: usize) -> Option<&(Vec<u32>, Vec<u32>)> {
        self.docs.get(i)
    }

    /// Examples `range` as a set of their own (a held-out split).
    pub fn subset(&self, range: std::ops::Range<usize>) -> Result<Self> {
        if range.start >= range.end || range.end > self.len() {
            bail!("StepSet::subset: examples {range:?} of {}", self.len())
        }
        Ok(Self { docs: self.docs[range].to_vec() })
    }

    /// Smallest model vocabulary that holds every token.
    pub fn vocab_needed(&self) -> usize {
        self.docs.iter().flat_map(|(t, _)| t.iter()).max().map_or(0, |&m| m as usize + 1)
    }

    /// The labels a head needs: the highest class + 1.
    pub fn classes_needed(&self) -> usize {
        self.docs.iter().flat_map(|(_, l)| l.iter()).filter(|&&x| x != IGNORE).max().map_or(0, |&m| m as usize + 1)
    }

    /// One row of `seq_len` tokens: whole examples from a random one on (in order, wrapping
    /// around, each at most once), as many as fit — the first cut to `seq_len` when it alone
    /// does not —, then the padding.
    pub fn sample(&self, seq_len: usize, rng: &mut Rng) -> Result<StepRow> {
        let first = rng.below(self.len());
        let mut take = Vec::new();
        let mut len = 0;
        for i in 0..self.len() {
            let e = (first + i) % self.len();
            let n = self.docs[e].0.len();
            if len + n > seq_len && !take.is_empty() {
                break;
            }
            len += n;
            take.push(e);
            if len >= seq_len {
                break;
            }
        }
        self.pack(&take, seq_len)
    }

    /// Every example once, in order, packed into rows of `seq_len` (an evaluation's rows;
    /// an example longer than a row cut to it).
    pub fn in_order(&self, seq_len: usize) -> Result<Vec<StepRow>> {
        let (mut rows, mut row, mut len) = (Vec::new(), Vec::new(), 0);
        for (e, (t, _)) in self.docs.iter().enumerate() {
            let n = t.len().min(seq_len);
            if len + n > seq_len {
                rows.push(self.pack(&row, seq_len)?);
                (row, len) = (Vec::new(), 0);
            }
            row.push(e);
            len += n;
        }
        rows.push(self.pack(&row, seq_len)?);
        Ok(rows)
    }

    /// A row of examples `take` side by side (the last cut at `seq_len`), then the padding.
    fn pack(&self, take: &[usize], seq_len: usize) -> Result<StepRow> {
        if seq_len == 0 {
            bail!("step data: rows of 0 tokens")
        }
        let (mut tokens, mut labels, mut lengths) = (Vec::with_capacity(seq_len), Vec::with_capacity(seq_len), Vec::new());
        for &e in take {
            let (t, l) = &self.docs[e];
            let n = t.len().min(seq_len - tokens.len());
            tokens.extend_from_slice(&t[..n]);
            labels.extend_from_slice(&l[..n]);
            lengths.push(n);
        }
        if tokens.len() < seq_len {
            let pad = seq_len - tokens.len();
            tokens.resize(seq_len, 0);
            labels.resize(seq_len, IGNORE);
            lengths.push(pad);
        }
        let marks = labels.iter().map(|&l| l != IGNORE).collect();
        Ok((Sample { tokens, long_range: marks, documents: Some(Documents::from_lengths(&lengths)?) }, labels))
    }
}

/// A batch's loss and what it reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrmTerms {
    /// The mean cross-entropy over the labelled tokens.
    pub loss: f64,
    /// The fraction of labelled tokens whose highest logit is their label.
    pub accuracy: f64,
    /// The labelled tokens.
    pub count: f64,
}

/// The loss of rows `rows` (all `seq_len` long): the node to back-propagate (this rank's
/// share of the mean, [`crate::global_mean`]) and its terms over the whole batch. `scores`
/// this rank's logits `[B_local, Ts, n]` (f32, [`Llama::token_scores_packed`] of the rows'
/// shard), `group` the ranks holding distinct tokens. Collective over `group`.
pub(crate) fn rows_loss(rows: &[StepRow], scores: &Tensor, ctx: &ParallelCtx, group: &Group) -> Result<(Tensor, PrmTerms)> {
    let t = rows.first().map_or(0, |r| r.1.len());
    let labels: Vec<u32> = rows.iter().flat_map(|r| r.1.iter().copied()).collect();
    if rows.iter().any(|r| r.1.len() != t) {
        bail!("prm: rows of different lengths")
    }
    let labels = Tensor::from_vec(labels, (rows.len(), t), &Device::Cpu)?;
    // (the labels sharded as the ids: each token's own, not the next one's)
    let local: Vec<u32> = shard_batch(&labels, ctx)?.input_ids.flatten_all()?.to_vec1()?;
    let (b, ts, n) = scores.dims3()?;
    if b * ts != local.len() {
        bail!("prm: scores {:?} for a shard of {} tokens", scores.dims(), local.len())
    }
    if let Some(&c) = local.iter().find(|&&c| c != IGNORE && c as usize >= n) {
        bail!("prm: label {c} for a head of {n} label(s)")
    }
    let dev = scores.device();
    let logp = candle_nn::ops::log_softmax(&scores.reshape((b * ts, n))?, D::Minus1)?;
    let idx: Vec<u32> = local.iter().map(|&c| if c == IGNORE { 0 } else { c }).collect();
    let keep: Vec<f32> = local.iter().map(|&c| (c != IGNORE) as u8 as f32).collect();
    let picked = logp.gather(&Tensor::from_vec(idx, (b * ts, 1), dev)?, 1)?.squeeze(1)?;
    let nll = (picked.neg()? * Tensor::from_vec(keep, b * ts, dev)?)?;
    let count = local.iter().filter(|&&c| c != IGNORE).count();
    // (the terms: Σ nll, Σ right, count over the group)
    let values: Vec<f32> = nll.detach().to_device(&Device::Cpu)?.to_vec1()?;
    let best: Vec<u32> = logp.detach().argmax(D::Minus1)?.to_device(&Device::Cpu)?.to_vec1()?;
    let right = local.iter().zip(&best).filter(|(&c, &p)| c != IGNORE && c == p).count();
    let sums = super::dpo::sum_over(&[values.iter().map(|&v| v as f64).sum(), right as f64, count as f64], group)?;
    let node = crate::global_mean(&nll, count, group)?;
    let total = sums[2].max(1.0);
    Ok((node, PrmTerms { loss: sums[0] / total, accuracy: sums[1] / total, count: sums[2] }))
}

/// Every example of `set` in order, packed into rows of `seq_len`, `batch` rows per forward
/// (the last filled with padding rows), forward on `model`'s layout without dropout: `each`
/// gets each forward's rows and this rank's logits `[B_local, Ts, n]` (detached). Collective
/// over the world.
fn for_each_forward(model: &Llama, set: &StepSet, (batch, seq_len): (usize, usize), dev: &Device, mut each: impl FnMut(&[StepRow], &Tensor) -> Result<()>) -> Result<()> {
    let mut rows = set.in_order(seq_len)?;
    while !rows.len().is_multiple_of(batch) {
        let s = Sample { tokens: vec![0; seq_len], long_range: vec![false; seq_len], documents: Some(Documents::single(seq_len)?) };
        rows.push((s, vec![IGNORE; seq_len]));
    }
    for chunk in rows.chunks(batch) {
        let ids: Vec<u32> = chunk.iter().flat_map(|r| r.0.tokens.iter().copied()).collect();
        let docs: Vec<Documents> = chunk.iter().map(|r| r.0.documents.clone().ok_or_else(|| candle_core::Error::Msg("prm: a row without documents".into()))).collect::<Result<_>>()?;
        let sb = shard_batch_packed(&Tensor::from_vec(ids, (chunk.len(), seq_len), &Device::Cpu)?, &docs, model.ctx())?;
        let scores = model.token_scores_packed(&sb.input_ids.to_device(dev)?, &sb.positions.to_device(dev)?, &sb.documents, None)?.detach();
        each(chunk, &scores)?;
    }
    Ok(())
}

/// The loss and accuracy over every example of `set` under `model` (a held-out evaluation:
/// no dropout), `batch` rows of `seq_len` per forward (the last filled with padding rows), on
/// the run's layout; the same on every rank. Collective over the world.
pub fn evaluate_steps(model: &Llama, set: &StepSet, batch: usize, seq_len: usize, ctx: &ParallelCtx, dev: &Device) -> Result<PrmTerms> {
    model.set_lora_dropout(None)?;
    let (mut sum, mut right, mut count) = (0.0, 0.0, 0.0);
    for_each_forward(model, set, (batch.max(1), seq_len), dev, |chunk, scores| {
        let (_, t) = rows_loss(chunk, scores, ctx, ctx.token_group())?;
        sum += t.loss * t.count;
        right += t.accuracy * t.count;
        count += t.count;
        Ok(())
    })?;
    Ok(PrmTerms { loss: sum / count.max(1.0), accuracy: right / count.max(1.0), count })
}

/// Every labelled step's label probabilities under token classifier `model` (a softmax of its
/// logits at the step's last token), per example of `set` in order, per step in order: what a
/// process reward model tells of each step (TRL's: the probability of label 1, the step is
/// right). `batch` rows of `seq_len` per forward (a multiple of DP; the last filled with
/// padding rows), no dropout, on the model's layout; the same on every rank. The steps of an
/// example longer than a row that lie past `seq_len` are not scored (left out). Collective over
/// the world.
pub fn step_probabilities(model: &Llama, set: &StepSet, batch: usize, seq_len: usize, dev: &Device) -> Result<Vec<Vec<Vec<f64>>>> {
    let ctx = model.ctx();
    if batch == 0 || !batch.is_multiple_of(ctx.layout.dp) {
        bail!("step_probabilities: {batch} rows per forward over dp = {}", ctx.layout.dp)
    }
    let n = model.config().num_labels.unwrap_or(0);
    // (the labelled tokens of the rows in order: the examples' steps in order)
    let mut out: Vec<Vec<f64>> = Vec::new();
    for_each_forward(model, set, (batch, seq_len), dev, |chunk, scores| {
        let labels: Vec<u32> = chunk.iter().flat_map(|r| r.1.iter().copied()).collect();
        let slot: std::collections::HashMap<usize, usize> = labels.iter().enumerate().filter(|(_, &l)| l != IGNORE).enumerate().map(|(s, (i, _))| (i, s)).collect();
        let probs: Vec<f32> = candle_nn::ops::softmax_last_dim(scores)?.flatten_all()?.to_device(&Device::Cpu)?.to_vec1()?;
        let mut part = vec![0f64; slot.len() * n];
        for (k, g) in crate::layout::local_token_indices(chunk.len(), seq_len, ctx)?.into_iter().enumerate() {
            if let Some(&s) = slot.get(&(g as usize)) {
                for j in 0..n {
                    part[s * n + j] = probs[k * n + j] as f64;
                }
            }
        }
        out.extend(super::dpo::sum_over(&part, ctx.token_group())?.chunks(n.max(1)).map(|c| c.to_vec()));
        Ok(())
    })?;
    // (back into examples: each one's labelled steps within the row, in order)
    let mut steps = out.into_iter();
    set.docs.iter().map(|(_, l)| (0..l[..l.len().min(seq_len)].iter().filter(|&&x| x != IGNORE).count()).map(|_| steps.next().ok_or_else(|| candle_core::Error::Msg("step_probabilities: internal error (a step not scored)".into()))).collect()).collect()
}

#[path = "prm_completions.rs"]
mod completions;
pub use completions::{completion_rewards, step_ends, StepAggregate};

#[cfg(test)]
#[path = "prm_tests.rs"]
pub(crate) mod tests;
