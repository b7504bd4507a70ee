//! Reward-model training (TRL's `RewardTrainer`, the Bradley–Terry objective of InstructGPT)
//! on preference pairs, on every layout: a reward model ([`crate::reward`]) scores each answer
//! document `prompt ++ answer` at its last token, and per pair
//!
//! ```text
//! loss = mean over pairs of −log σ(r_chosen − r_rejected − m)
//!        + c · mean over pairs of (r_chosen + r_rejected)²          (c: center_rewards_coefficient)
//! ```
//!
//! (`m` the pair's margin where the data gives one, TRL's `margin` column,
//! [`PreferenceSet::margins`]; else 0).
//!
//! The pairs are packed whole as DPO's ([`super::preference`]); a document's last token lies on
//! one rank, which reads its reward, and the rewards are summed over the ranks holding distinct
//! tokens (one small all-gather per micro-batch). Each rank back-propagates the linearised loss
//! `Σ w_d · r_d` over the documents ending among its tokens, `w_d = ∂loss/∂r_d`, whose
//! gradients, summed over the ranks as the trainer sums every loss's, are exactly the loss's.

use super::dpo::sum_over;
use super::preference::PreferenceRow;
use super::preference::PreferenceSet;
use crate::{shard_batch, shard_batch_packed, Llama, ParallelCtx};
use candle_cp_ops::packing::Documents;
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_comm::Group;

/// A reward-model run's settings ([`super::TrainConfig::reward`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardConfig {
    /// TRL's `center_rewards_coefficient`: the weight of the mean squared sum of each pair's
    /// rewards (Eisenstein et al. 2023), which keeps the rewards centred on 0; 0: none.
    pub center_rewards_coefficient: f64,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self { center_rewards_coefficient: 0.0 }
    }
}

impl RewardConfig {
    /// Errors for a coefficient that is negative or not a number.
    pub fn validate(&self) -> Result<()> {
        let c = self.center_rewards_coefficient;
        if !(c >= 0.0 && c.is_finite()) {
            bail!("reward: center_rewards_coefficient must be a finite number >= 0, got {c}")
        }
        Ok(())
    }
}

/// The loss of a batch of pairs and what it reports.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardTerms {
    /// The mean loss over the pairs (with the centring term).
    pub loss: f64,
    /// Fraction of pairs whose chosen answer's reward exceeds the rejected one's.
    pub accuracy: f64,
    /// Mean `r_chosen − r_rejected`.
    pub margin: f64,
    /// `∂loss / ∂r` per reward, in the order given.
    pub d_reward: Vec<f64>,
}

/// `−log σ(x)`, stable for large `|x|`.
fn softplus_neg(x: f64) -> f64 {
    if x > 0.0 { (-x).exp().ln_1p() } else { -x + x.exp().ln_1p() }
}

/// `σ(x)`, stable for large `|x|`.
fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 { 1.0 / (1.0 + (-x).exp()) } else { x.exp() / (1.0 + x.exp()) }
}

/// The loss over `pairs` (indices of the chosen and the rejected answer into `rewards`, with
/// their `margins`, one per pair, or none: 0) and its derivatives. Errors for an index out of
/// range or another number of margins.
pub fn reward_terms(rewards: &[f64], pairs: &[(usize, usize)], margins: &[f64], cfg: &RewardConfig) -> Result<RewardTerms> {
    if let Some(&(c, r)) = pairs.iter().find(|&&(c, r)| c.max(r) >= rewards.len()) {
        bail!("reward_terms: answer {} of {} rewards", c.max(r), rewards.len())
    }
    if !margins.is_empty() && margins.len() != pairs.len() {
        bail!("reward_terms: {} margins for {} pairs", margins.len(), pairs.len())
    }
    let n = pairs.len().max(1) as f64;
    let coef = cfg.center_rewards_coefficient;
    let mut t = RewardTerms { loss: 0.0, accuracy: 0.0, margin: 0.0, d_reward: vec![0.0; rewards.len()] };
    for (k, &(c, r)) in pairs.iter().enumerate() {
        let (rc, rr) = (rewards[c], rewards[r]);
        let z = rc - rr - margins.get(k).copied().unwrap_or(0.0);
        let sum = rc + rr;
        t.loss += (softplus_neg(z) + coef * sum * sum) / n;
        t.accuracy += (rc > rr) as u8 as f64 / n;
        t.margin += (rc - rr) / n;
        // d/dz of −log σ(z) is −σ(−z)
        let g = -sigmoid(-z) / n;
        t.d_reward[c] += g + 2.0 * coef * sum / n;
        t.d_reward[r] += -g + 2.0 * coef * sum / n;
    }
    Ok(t)
}

/// One micro-batch of preference rows as a reward model reads it: per token of the global
/// rows `[B, T]`, `slot + 1` at an answer document's last token (0 elsewhere), and each
/// slot's answer index in the set (`2·p` chosen, `2·p + 1` rejected).
pub(crate) struct RewardBatch {
    ids: Tensor,
    documents: Vec<Documents>,
    ends: Tensor,
    answers: Vec<usize>,
}

impl RewardBatch {
    /// From sampled rows (all `seq_len` long, with their documents).
    pub(crate) fn new(rows: &[PreferenceRow], seq_len: usize) -> Result<Self> {
        let (mut docs, mut ids) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len() * seq_len));
        for (sample, _) in rows {
            if sample.tokens.len() != seq_len {
                bail!("reward: a preference row of {} tokens, rows are {seq_len}", sample.tokens.len())
            }
            docs.push(sample.documents.clone().ok_or_else(|| candle_core::Error::Msg("reward: a preference row without documents".into()))?);
            ids.extend_from_slice(&sample.tokens);
        }
        let mut answers = Vec::new();
        let ends = crate::reward::document_ends(&docs, seq_len, |b, d| {
            let a = rows[b].1.get(d).copied().flatten()?;
            answers.push(a);
            Some(answers.len() as u32 - 1)
        })?;
        Ok(Self { ids: Tensor::from_vec(ids, (rows.len(), seq_len), &Device::Cpu)?, documents: docs, ends, answers })
    }

    /// The answers' rewards, by slot, from this rank's scores `[B_local, Ts, 1]` (f32, as
    /// [`crate::Llama::scores_packed`] gives them for the shard of the batch's rows), summed
    /// over `group` (the ranks holding distinct tokens); with each local token's slot + 1.
    fn rewards(&self, scores: &Tensor, ctx: &ParallelCtx, group: &Group) -> Result<(Vec<f64>, Vec<u32>)> {
        let ends: Vec<u32> = shard_batch(&self.ends, ctx)?.input_ids.flatten_all()?.to_vec1()?;
        let dims = scores.dims().to_vec();
        if dims.len() != 3 || dims[2] != 1 || dims[0] * dims[1] != ends.len() {
            bail!("reward: scores {dims:?} for a shard of {} tokens: a reward model of one label scores [B, Ts, 1]", ends.len())
        }
        let s: Vec<f32> = scores.detach().flatten_all()?.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec1()?;
        let mut part = vec![0f64; self.answers.len()];
        for (i, &e) in ends.iter().enumerate() {
            if e > 0 {
                part[e as usize - 1] += s[i] as f64;
            }
        }
        Ok((sum_over(&part, group)?, ends))
    }

    /// Every answer's reward under `model`, by slot: a forward of the batch on the run's
    /// layout, no graph kept (a held-out evaluation). Collective over the world.
    pub(crate) fn forward_rewards(&self, model: &Llama, ctx: &ParallelCtx, dev: &Device) -> Result<Vec<f64>> {
        let sb = shard_batch_packed(&self.ids, &self.documents, ctx)?;
        let (ids, pos) = (sb.input_ids.to_device(dev)?, sb.positions.to_device(dev)?);
        let scores = model.scores_packed(&ids, &pos, &sb.documents)?.detach();
        Ok(self.rewards(&scores, ctx, ctx.token_group())?.0)
    }

    /// The pairs' loss: the node to back-propagate (`Σ w_d · r_d` over the documents ending
    /// among this rank's tokens) and its terms over the whole batch. `scores` this rank's
    /// (differentiable), `margins` the set's per pair ([`PreferenceSet::margins`]), `group` the
    /// ranks holding distinct tokens. Collective over `group`.
    pub(crate) fn loss(&self, scores: &Tensor, margins: Option<&[f64]>, cfg: &RewardConfig, ctx: &ParallelCtx, group: &Group) -> Result<(Tensor, RewardTerms)> {
        let (rewards, ends) = self.rewards(scores, ctx, group)?;
        // (slot pairs: each chosen answer 2·p with its rejected 2·p + 1)
        let slot_of: std::collections::HashMap<usize, usize> = self.answers.iter().enumerate().map(|(s, &a)| (a, s)).collect();
        let mut pairs = Vec::new();
        for (s, &a) in self.answers.iter().enumerate() {
            if a % 2 == 0 {
                match slot_of.get(&(a + 1)) {
                    Some(&r) => pairs.push((s, r)),
                    None => bail!("reward: pair {}'s rejected answer is not in the micro-batch (rows pack whole pairs)", a / 2),
                }
            }
        }
        let m: Vec<f64> = match margins {
            Some(m) => pairs.iter().map(|&(c, _)| m.get(self.answers[c] / 2).copied().ok_or_else(|| candle_core::Error::Msg(format!("reward: no margin for pair {}", self.answers[c] / 2)))).collect::<Result<_>>()?,
            None => Vec::new(),
        };
        let t = reward_terms(&rewards, &pairs, &m, cfg)?;
        let w: Vec<f32> = ends.iter().map(|&e| if e > 0 { t.d_reward[e as usize - 1] as f32 } else { 0.0 }).collect();
        let w = Tensor::from_vec(w, scores.shape(), scores.device())?;
        Ok(((scores * w)?.sum_all()?, t))
    }
}

/// Every answer's reward under reward model `model` (document `2·p` pair `p`'s chosen answer,
/// `2·p + 1` its rejected one), the pairs in order, `batch` rows of `seq_len` per forward (the
/// last batch padded with empty rows), on the run's layout; the same on every rank.
/// Collective over the world.
pub fn answer_rewards(model: &Llama, set: &PreferenceSet, batch: usize, seq_len: usize, ctx: &ParallelCtx, dev: &Device) -> Result<Vec<f64>> {
    if set.desirable().is_some() {
        bail!("reward: the examples are unpaired (KTO's); a reward model trains on preference pairs")
    }
    score_rows(model, set.in_order(seq_len)?, 2 * set.len(), (batch.max(1), seq_len), ctx, dev)
}

/// The rewards of documents `0..n` of `rows` (rows of `seq_len` whose documents name them,
/// [`PreferenceRow`]), `batch` rows per forward, the last forward filled with padding rows.
/// Errors name a document without a finite reward. Collective over the world.
fn score_rows(model: &Llama, mut rows: Vec<PreferenceRow>, n: usize, (batch, seq_len): (usize, usize), ctx: &ParallelCtx, dev: &Device) -> Result<Vec<f64>> {
    while !rows.len().is_multiple_of(batch) {
        let s = super::Sample { tokens: vec![0; seq_len], long_range: vec![false; seq_len], documents: Some(Documents::single(seq_len)?) };
        rows.push((s, vec![None]));
    }
    let mut out = vec![f64::NAN; n];
    for chunk in rows.chunks(batch) {
        let b = RewardBatch::new(chunk, seq_len)?;
        for (slot, r) in b.forward_rewards(model, ctx, dev)?.into_iter().enumerate() {
            out[b.answers[slot]] = r;
        }
    }
    if let Some(a) = out.iter().position(|x| !x.is_finite()) {
        bail!("reward: document {a} has no finite reward (not scored, or the model diverged)")
    }
    Ok(out)
}

/// [`reward_terms`] of every held-out pair of `set` under `model` (a run's evaluation: its
/// loss and accuracy). Collective over the world.
pub fn evaluate_pairs(model: &Llama, set: &PreferenceSet, cfg: &RewardConfig, batch: usize, seq_len: usize, ctx: &ParallelCtx, dev: &Device) -> Result<RewardTerms> {
    model.set_lora_dropout(None)?;
    let rewards = answer_rewards(model, set, batch, seq_len, ctx, dev)?;
    let pairs: Vec<(usize, usize)> = (0..set.len()).map(|p| (2 * p, 2 * p + 1)).collect();
    reward_terms(&rewards, &pairs, set.margins().unwrap_or(&[]), cfg)
}

/// Every document's reward under reward model `model`, in order: the documents (each at most
/// `seq_len` tokens) packed in order into rows of `seq_len` (each row's rest a padding
/// document), `batch` rows per forward (a multiple of DP; the last forward filled with padding
/// rows), on the model's layout; the same on every rank. Collective over the world.
pub fn score_documents(model: &Llama, docs: &[Vec<u32>], batch: usize, seq_len: usize, dev: &Device) -> Result<Vec<f64>> {
    let ctx = model.ctx();
    if batch == 0 || !batch.is_multiple_of(ctx.layout.dp) {
        bail!("score_documents: {batch} rows per forward over dp = {}", ctx.layout.dp)
    }
    let row = |tokens: Vec<u32>, mut lens: Vec<usize>, mut ids: Vec<Option<usize>>| -> Result<PreferenceRow> {
        let used: usize = lens.iter().sum();
        let mut tokens = tokens;
        if used < seq_len {
            tokens.resize(seq_len, 0);
            lens.push(seq_len - used);
            ids.push(None);
        }
        let s = super::Sample { tokens, long_range: vec![false; seq_len], documents: Some(Documents::from_lengths(&lens)?) };
        Ok((s, ids))
    };
    let (mut rows, mut cur, mut lens, mut ids) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, d) in docs.iter().enumerate() {
        if d.is_empty() || d.len() > seq_len {
            bail!("score_documents: document {i} has {} tokens, rows hold 1..={seq_len}", d.len())
        }
        if cur.len() + d.len() > seq_len {
            rows.push(row(std::mem::take(&mut cur), std::mem::take(&mut lens), std::mem::take(&mut ids))?);
        }
        cur.extend_from_slice(d);
        lens.push(d.len());
        ids.push(Some(i));
    }
    if !cur.is_empty() {
        rows.push(row(cur, lens, ids)?);
    }
    score_rows(model, rows, docs.len(), (batch, seq_len), ctx, dev)
}

/// Rewards within this of the highest (relative above 1) tie for [`best_of_n`]'s pick, the
/// first of them kept: rounding, which differs between layouts, does not choose.
pub const BEST_TIE: f64 = 1e-4;

/// One prompt's best-of-N samples ([`best_of_n`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BestOfN {
    /// The N completions (each ending at its stop token, or at the token limit).
    pub completions: Vec<Vec<u32>>,
    /// Their rewards under the reward model.
    pub rewards: Vec<f64>,
    /// The index of the best (the first of the highest rewards, ties within [`BEST_TIE`]).
    pub best: usize,
}

/// How [`best_of_n`]'s reward model judges a completion.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Judge<'a> {
    /// An outcome reward model (a sequence classifier of one label): its score of `prompt ++
    /// completion` at the last token ([`score_documents`]).
    Outcome,
    /// A process reward model (a token classifier): the completion's steps ended by
    /// `separator`'s tokens, each step's probability of being right, made one reward by
    /// `aggregate` ([`super::prm::completion_rewards`]).
    Process {
        /// The step separator's token ids.
        separator: &'a [u32],
        /// How the steps' probabilities make the reward.
        aggregate: super::prm::StepAggregate,
    },
}

/// Best-of-N sampling (rejection sampling with a reward model, as RAFT or Llama 2's
/// rejection-sampling fine-tuning draw data): `n` completions of each prompt sampled by `policy`
/// in one batch of different lengths ([`Llama::generate_ragged`], at most `max_new_tokens`,
/// ending at `stop`), each `prompt ++ completion` judged by reward model `rm` on the same layout
/// as `judge` says (`batch` rows per forward), the best kept per prompt. The same on every
/// rank. `prompts · n` must divide by DP; the reward model must share the policy's
/// vocabulary. Collective over the world.
#[allow(clippy::too_many_arguments)]
pub fn best_of_n(policy: &Llama, (rm, judge): (&Llama, Judge), prompts: &[Vec<u32>], n: usize, max_new_tokens: usize, sampling: crate::Sampling, stop: &[u32], batch: usize) -> Result<Vec<BestOfN>> {
    if n == 0 || prompts.is_empty() {
        bail!("best_of_n: {n} samples of {} prompts: needs at least one of each", prompts.len())
    }
    if n > 1 && sampling == crate::Sampling::Greedy {
        bail!("best_of_n: {n} greedy samples of a prompt are one completion n times: sample (a temperature)")
    }
    let (rc, outcome) = (rm.config(), judge == Judge::Outcome);
    if rc.vocab_size != policy.config().vocab_size || (outcome && (rc.num_labels != Some(1) || rc.token_classifier.is_some())) {
        bail!("best_of_n: the reward model ({}, {:?} labels, vocabulary {}) must share the policy's vocabulary {}{}", rc.hf_class(), rc.num_labels, rc.vocab_size, policy.config().vocab_size, if outcome { " and score sequences with one label (a process reward model judges steps: Judge::Process)" } else { "" })
    }
    let rows: Vec<Vec<u32>> = prompts.iter().flat_map(|p| std::iter::repeat_n(p.clone(), n)).collect();
    let tokens = policy.generate_ragged(&rows, max_new_tokens, sampling, stop)?.tokens;
    let docs: Vec<Vec<u32>> = rows.iter().zip(&tokens).map(|(p, c)| p.iter().chain(c).copied().collect()).collect();
    let m = rm.forward_multiple();
    let seq_len = docs.iter().map(Vec::len).max().unwrap_or(1).div_ceil(m) * m;
    let dev = policy.embed.device().clone();
    let rewards = match judge {
        Judge::Outcome => score_documents(rm, &docs, batch, seq_len, &dev)?,
        Judge::Process { separator, aggregate } => {
            let pairs: Vec<(&[u32], &[u32])> = rows.iter().zip(&tokens).map(|(p, c)| (p.as_slice(), c.as_slice())).collect();
            super::prm::completion_rewards(rm, &pairs, separator, aggregate, batch, seq_len, &dev)?
        }
    };
    Ok(tokens
        .chunks(n)
        .zip(rewards.chunks(n))
        .map(|(c, r)| {
            // (the first of the rewards within rounding of the highest: the same completion
            // sampled twice scores alike up to rounding, which differs between layouts)
            let top = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let best = r.iter().position(|&x| x >= top - BEST_TIE * top.abs().max(1.0)).unwrap_or(0);
            BestOfN { completions: c.to_vec(), rewards: r.to_vec(), best }
        })
        .collect())
}

/// A reward model as one of GRPO's rewards ([`super::grpo::GrpoConfig::reward_model`]): a
/// `*ForSequenceClassification` checkpoint of one label, sharing the policy's tokenizer, whose
/// score of `prompt ++ completion` (at the completion's last token) times `weight` is added to
/// the reward functions' (TRL's `reward_funcs` naming a sequence classifier); or a process
/// reward model (a `*ForTokenClassification`) whose completion's steps' probabilities of being
/// right, aggregated ([`super::prm::completion_rewards`]), are the score. A reward model with
/// a tokenizer of its own reads the texts again ([`RewardModelSpec::retokenize`], as TRL does).
#[derive(Clone)]
pub struct RewardModelSpec {
    /// The reward model's directory (a `*ForSequenceClassification` checkpoint of one label, or
    /// a `*ForTokenClassification` with `steps`).
    pub dir: std::path::PathBuf,
    /// Its weight in the reward (TRL's `reward_weights` entry).
    pub weight: f64,
    /// A process reward model's step separator (token ids, of the reward model's tokenizer)
    /// and aggregate; `None` for an outcome reward model.
    pub steps: Option<(Vec<u32>, super::prm::StepAggregate)>,
    /// A reward model with another tokenizer than the policy's: the policy's ids decoded to
    /// text, and text encoded by the reward model's tokenizer (no special tokens added). The
    /// reward model then scores `encode(decode(prompt) + decode(completion))` (TRL's texts,
    /// re-tokenised; a process reward model: the prompt's and the completion's texts encoded
    /// apart, its steps inside the completion). `None`: the policy's ids as they are (the
    /// vocabularies must agree).
    pub retokenize: Option<(super::reward_command::Decode, Encode)>,
}

/// Text → token ids of a reward model's tokenizer ([`RewardModelSpec::retokenize`]).
pub type Encode = std::sync::Arc<dyn Fn(&str) -> Result<Vec<u32>> + Send + Sync>;

impl std::fmt::Debug for RewardModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardModelSpec").field("dir", &self.dir).field("weight", &self.weight).field("steps", &self.steps).field("retokenize", &self.retokenize.is_some()).finish()
    }
}

/// A GRPO run's reward model, loaded frozen on the run's layout (each rank its shards).
pub(crate) struct RunRewardModel {
    model: Llama,
    weight: f64,
    steps: Option<(Vec<u32>, super::prm::StepAggregate)>,
    retokenize: Option<(super::reward_command::Decode, Encode)>,
    batch: usize,
    dev: Device,
}

impl RunRewardModel {
    /// Loads `spec`'s model for the run `cfg` of policy `mcfg`: one label, the policy's
    /// vocabulary. Collective over the world.
    pub(crate) fn load(spec: &RewardModelSpec, cfg: &super::TrainConfig, mcfg: &crate::LlamaConfig, ctx: &ParallelCtx, dev: &Device) -> Result<Self> {
        if !spec.weight.is_finite() {
            bail!("grpo: the reward model's weight must be finite, got {}", spec.weight)
        }
        // (a dense reward model beside a mixture of experts under expert parallelism: read on
        // the run's layout without EP, whose groups it does not use)
        let dense = crate::LlamaConfig::from_file(crate::lora::base_model_dir(&spec.dir)?.join("config.json"))?.moe.is_none();
        let own;
        let ctx = match ctx.layout.ep > 1 && dense {
            true => {
                own = ParallelCtx::new(ctx.world.clone(), ctx.layout.with_ep(1))?;
                &own
            }
            false => ctx,
        };
        let model = crate::reward::load_reward_model(&spec.dir, ctx, dev, cfg.dtype).map_err(|e| candle_core::Error::Msg(format!("grpo: the reward model: {e}")))?;
        let rcfg = model.config();
        match (rcfg.token_classifier.is_some(), &spec.steps) {
            (true, None) => bail!("grpo: {} is a process reward model ({}): give its step separator and aggregate (RewardModelSpec::steps)", spec.dir.display(), rcfg.hf_class()),
            (false, Some(_)) => bail!("grpo: {} ({}) is not a process reward model: it judges no steps (RewardModelSpec::steps: None)", spec.dir.display(), rcfg.hf_class()),
            (false, None) if rcfg.num_labels != Some(1) => bail!("grpo: {} is not a reward model of one label ({:?} labels)", spec.dir.display(), rcfg.num_labels),
            _ => {}
        }
        if rcfg.vocab_size != mcfg.vocab_size && spec.retokenize.is_none() {
            bail!("grpo: the reward model {} has a vocabulary of {}, the policy {}: it scores the policy's tokens, so it must share its tokenizer (or read the texts again: RewardModelSpec::retokenize)", spec.dir.display(), rcfg.vocab_size, mcfg.vocab_size)
        }
        Ok(Self { model, weight: spec.weight, steps: spec.steps.clone(), retokenize: spec.retokenize.clone(), batch: cfg.batch, dev: dev.clone() })
    }

    /// `weight ×` the reward model's score of each `prompt ++ completion` (a process reward
    /// model's: its steps' aggregate), in rows as long as the longest document needs; 0 for a
    /// completion that re-tokenises to nothing. Collective over the world.
    pub(crate) fn rewards(&self, docs: &[(&[u32], &[u32])]) -> Result<Vec<f64>> {
        // (the reward model's own ids: the texts encoded again — a process reward model's
        // prompt and completion apart, an outcome model's whole text as TRL does)
        let mut parts: Vec<(Vec<u32>, Vec<u32>)> = Vec::with_capacity(docs.len());
        for (p, c) in docs {
            parts.push(match &self.retokenize {
                None => (p.to_vec(), c.to_vec()),
                Some((decode, encode)) if self.steps.is_some() => (encode(&decode(p)?)?, encode(&decode(c)?)?),
                Some((decode, encode)) => (Vec::new(), encode(&format!("{}{}", decode(p)?, decode(c)?))?),
            });
        }
        // (a completion whose text re-tokenises to nothing — its stop token alone, say — has no
        // step to judge nor text to score: reward 0)
        let empty: Vec<bool> = parts.iter().map(|(p, c)| c.is_empty() && (self.steps.is_some() || p.is_empty())).collect();
        let parts: Vec<(Vec<u32>, Vec<u32>)> = parts.into_iter().zip(&empty).filter(|(_, &e)| !e).map(|(d, _)| d).collect();
        if parts.is_empty() {
            return Ok(vec![0.0; docs.len()]);
        }
        let vocab = self.model.config().vocab_size;
        if let Some(t) = parts.iter().flat_map(|(p, c)| p.iter().chain(c)).find(|&&t| t as usize >= vocab) {
            bail!("grpo: the reward model's ids hold {t}, its vocabulary is {vocab}")
        }
        let m = self.model.forward_multiple();
        let seq_len = parts.iter().map(|(p, c)| p.len() + c.len()).max().unwrap_or(1).max(1).div_ceil(m) * m;
        let scores = match &self.steps {
            Some((separator, aggregate)) => {
                let pairs: Vec<(&[u32], &[u32])> = parts.iter().map(|(p, c)| (p.as_slice(), c.as_slice())).collect();
                super::prm::completion_rewards(&self.model, &pairs, separator, *aggregate, self.batch, seq_len, &self.dev)?
            }
            None => {
                let whole: Vec<Vec<u32>> = parts.into_iter().map(|(p, c)| p.into_iter().chain(c).collect()).collect();
                score_documents(&self.model, &whole, self.batch, seq_len, &self.dev)?
            }
        };
        let mut scores = scores.into_iter();
        empty.iter().map(|&e| Ok(if e { 0.0 } else { self.weight * scores.next().ok_or_else(|| candle_core::Error::Msg("grpo: internal error (a reward model's score missing)".into()))? })).collect()
    }
}

/// The run's checks for a reward model (before the first step): the objective alone (no DPO,
/// GRPO or LoRA), preference pairs, a model of one label; and a reward model trains by nothing
/// else.
pub(crate) fn check_run(cfg: &super::TrainConfig, mcfg: &crate::LlamaConfig) -> Result<()> {
    let Some(r) = &cfg.reward else {
        if let Some(n) = mcfg.num_labels {
            bail!("train: the model is a reward model ({}, {n} label(s)): train it with reward (--reward-model)", mcfg.hf_class())
        }
        return Ok(());
    };
    r.validate()?;
    if cfg.dpo.is_some() || cfg.grpo.is_some() {
        bail!("train: reward modelling trains by its own loss: not with dpo or grpo")
    }
    match &cfg.data {
        super::DataSource::Preference(s) if s.desirable().is_none() => {}
        _ => bail!("train: a reward model trains on preference pairs (DataSource::Preference of pairs)"),
    }
    if let Some(e) = &cfg.eval {
        if !matches!(&e.data, super::DataSource::Preference(s) if s.desirable().is_none()) {
            bail!("train: a reward model's held-out data must be preference pairs")
        }
    }
    match mcfg.num_labels {
        Some(1) => Ok(()),
        n => bail!("train: the pairs' loss reads one reward per answer: the model has {n:?} label(s)"),
    }
}

/// A reward run's held-out evaluation: [`evaluate_pairs`] over the evaluation's pairs.
pub(crate) fn evaluate_run(model: &Llama, cfg: &super::TrainConfig, eval: &super::EvalConfig, ctx: &ParallelCtx, dev: &Device) -> Result<RewardTerms> {
    match (&eval.data, &cfg.reward) {
        (super::DataSource::Preference(set), Some(r)) => evaluate_pairs(model, set, r, cfg.batch, cfg.seq_len, ctx, dev),
        _ => bail!("train: a reward model evaluates on held-out preference pairs"),
    }
}

#[cfg(test)]
#[path = "reward_tests.rs"]
mod tests;
