//! GRPO (Shao et al. 2024, DeepSeekMath; TRL's `GRPOTrainer`) on every layout: online
//! reinforcement learning from a reward function. Each micro-batch draws prompts, samples a
//! group of `G` completions per prompt from the policy as it is (generation on the run's
//! layout: [`crate::Llama::generate_until`]), scores them, and trains on them:
//!
//! ```text
//! prompt p ──generate──► o_1 … o_G   rewards r_1 … r_G   A_i = (r_i − mean(r)) / (std(r) + 1e-4)
//!
//! rows: [ p o_1 | p o_2 | … | p o_G | padding ]   (each p·o_i a document; o_i's tokens the targets)
//! loss = Σ_i Σ_{t ∈ o_i} −A_i · log π(o_i,t) · k_i
//!        k_i = 1 / (|o_i| · n)         grpo     (each completion's mean, then the completions')
//!        k_i = 1 / Σ_j |o_j|           bnpo     (every completion token alike)
//!        k_i = 1 / (n · max_len)       dr_grpo  (Dr. GRPO: a constant)
//!        k_i = M / Σ_step |o_j|        dapo     (every token of the step's M micro-batches alike)
//! ```
//!
//! As TRL's generation batch, the step's completions are all sampled before its first
//! micro-batch trains (the policy does not change within a step, so each micro-batch's are those
//! it would sample itself): `dapo`'s normaliser and `batch`-scaled advantages take the whole
//! step's.
//!
//! This is TRL's objective with one optimisation pass per generation (`num_iterations` 1,
//! where the clipped ratio `π/π_old` is 1 and its gradient `∇log π`) and no KL term (`beta` 0,
//! TRL's default): a weighted next-token loss whose weights are constants of the step — each
//! rank back-propagates `Σ_t k_i·A_i·nll_t` over its targets, the node shifted so its value is
//! TRL's loss (`−Σ_i A_i·|o_i|·k_i`, 0 for grpo with group-scaled rewards). Generation samples
//! the same tokens on every rank and on one device (one seeded generator per prompt, the
//! logits bitwise the same on every rank), so the rows, rewards and weights are the same
//! everywhere; the CP, TP and DP splits of the training forward then follow the
//! single-device gradients as for any loss.
//!
//! With `beta` > 0, TRL's KL term against a reference (the model as the run starts, kept
//! beside the policy like TR-DPO's, [`super::tr_dpo::RefModel`], and in each checkpoint's
//! `reference/`) joins each token's loss, `β · (e^(ref − log π) − (ref − log π) − 1)` (the k3
//! estimator), normalised as the rest: the reference scores the same rows by a forward
//! without a graph, and each token's weight becomes `k_i·(A_i + β·(e^(ref − log π) − 1))`. A
//! LoRA run's reference is its frozen base: the same tensors read without the adapters (PEFT's
//! disabled adapters), nothing copied or checkpointed.
//!
//! Advantages (TRL's `scale_rewards`): the group's mean subtracted, then divided by the group's
//! standard deviation (`group`, unbiased as `torch.std`), by the whole micro-batch's (`batch`)
//! or not at all (`none`, Dr. GRPO's advice).

use super::data::Sample;
use super::rng::Rng;
use crate::sampling::Sampling;
use crate::{shard_batch, Llama, ParallelCtx, IGNORE};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_ops::packing::Documents;
use std::sync::Arc;

/// A reward function: `(prompt, completion, reference answer)` token ids → reward. The
/// completion ends with its stop token when it stopped.
pub type RewardFn = Arc<dyn Fn(&[u32], &[u32], &[u32]) -> f64 + Send + Sync>;

/// Reward functions against a prompt's reference answer.
pub mod rewards {
    use super::RewardFn;
    use std::sync::Arc;

    /// 1 when the completion is the reference answer token for token, else 0.
    pub fn exact_match() -> RewardFn {
        Arc::new(|_, completion, answer| (completion == answer) as u8 as f64)
    }

    /// `Σ w_k · r_k`: several rewards summed with their weights (TRL's `reward_funcs` with
    /// `reward_weights`).
    pub fn weighted(parts: Vec<(RewardFn, f64)>) -> RewardFn {
        Arc::new(move |p, c, a| parts.iter().map(|(r, w)| w * r(p, c, a)).sum())
    }

    /// 1 when the completion ends with one of `stop` (it finished within the length), else 0.
    pub fn finished(stop: Vec<u32>) -> RewardFn {
        Arc::new(move |_, c, _| c.last().is_some_and(|t| stop.contains(t)) as u8 as f64)
    }

    /// The fraction of the longer of the completion and the answer whose tokens match the
    /// answer's position by position (1: the answer exactly; partial credit on the way).
    pub fn token_accuracy() -> RewardFn {
        Arc::new(|_, completion, answer| {
            let n = completion.len().max(answer.len()).max(1);
            completion.iter().zip(answer).filter(|(a, b)| a == b).count() as f64 / n as f64
        })
    }
}

/// How the per-token terms are normalised ([`GrpoConfig::loss_type`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrpoLoss {
    /// Each completion's mean over its tokens, then the mean over completions (GRPO's).
    Grpo,
    /// Every completion token of the micro-batch alike (TRL's `bnpo`; its `dapo` with one
    /// micro-batch per step).
    Bnpo,
    /// A constant, `n · max_completion_length` (Dr. GRPO's).
    DrGrpo,
    /// Every completion token of the step's micro-batches alike (TRL's `dapo`, its default).
    Dapo,
}

impl GrpoLoss {
    /// TRL's name.
    pub fn name(self) -> &'static str {
        match self {
            GrpoLoss::Grpo => "grpo",
            GrpoLoss::Bnpo => "bnpo",
            GrpoLoss::DrGrpo => "dr_grpo",
            GrpoLoss::Dapo => "dapo",
        }
    }
}

impl std::str::FromStr for GrpoLoss {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "grpo" => GrpoLoss::Grpo,
            "bnpo" => GrpoLoss::Bnpo,
            "dr_grpo" => GrpoLoss::DrGrpo,
            "dapo" => GrpoLoss::Dapo,
            _ => bail!("grpo: unknown loss type {s:?} (grpo, bnpo, dr_grpo or dapo)"),
        })
    }
}

/// How rewards become advantages ([`GrpoConfig::scale_rewards`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleRewards {
    /// Divided by the group's standard deviation (+ 1e-4).
    Group,
    /// Divided by the whole step's standard deviation (+ 1e-4).
    Batch,
    /// Not divided.
    None,
}

impl std::str::FromStr for ScaleRewards {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "group" => ScaleRewards::Group,
            "batch" => ScaleRewards::Batch,
            "none" => ScaleRewards::None,
            _ => bail!("grpo: unknown reward scaling {s:?} (group, batch or none)"),
        })
    }
}

/// GRPO's settings ([`super::TrainConfig::grpo`]).
#[derive(Clone)]
pub struct GrpoConfig {
    /// Completions per prompt, `G` (TRL's `num_generations`, 8); at least 2, divisible by DP.
    pub num_generations: usize,
    /// Prompts per micro-batch; their `prompts · G` completions are packed into the
    /// micro-batch's rows.
    pub prompts: usize,
    /// Most tokens a completion takes (TRL's `max_completion_length`).
    pub max_completion_length: usize,
    /// How completions are sampled (TRL: temperature 1, all tokens).
    pub sampling: Sampling,
    /// Tokens that end a completion (kept as its last token): an EOS.
    pub stop: Vec<u32>,
    /// The per-token normalisation.
    pub loss_type: GrpoLoss,
    /// How rewards become advantages.
    pub scale_rewards: ScaleRewards,
    /// The reward of a completion.
    pub reward: RewardFn,
    /// The KL term's weight β (TRL's `beta`, 0: none, no reference kept; DeepSeekMath 0.04).
    pub beta: f64,
    /// Leave out of the loss (and of the token counts) the completions that reached
    /// `max_completion_length` without a stop token (TRL's `mask_truncated_completions`); their
    /// rewards still count in their groups' advantages.
    pub mask_truncated_completions: bool,
}

impl std::fmt::Debug for GrpoConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpoConfig")
            .field("num_generations", &self.num_generations)
            .field("prompts", &self.prompts)
            .field("max_completion_length", &self.max_completion_length)
            .field("sampling", &self.sampling)
            .field("stop", &self.stop)
            .field("loss_type", &self.loss_type)
            .field("scale_rewards", &self.scale_rewards)
            .field("beta", &self.beta)
            .field("mask_truncated_completions", &self.mask_truncated_completions)
            .finish_non_exhaustive()
    }
}

impl GrpoConfig {
    /// Errors unless every micro-batch's completions surely fit in `batch` rows of `seq_len`
    /// whatever is sampled: packed in order, a row holds at least `⌊seq_len / L⌋` documents of
    /// at most `L` tokens (the longest prompt of `set` and a whole completion).
    pub fn check_fits(&self, set: &PromptSet, batch: usize, seq_len: usize) -> Result<()> {
        let l = set.max_prompt_len() + self.max_completion_length;
        let per_row = seq_len / l.max(1);
        if batch * per_row < self.prompts * self.num_generations {
            bail!(
                "grpo: {} prompts × {} completions per micro-batch may not fit: a row of {seq_len} tokens surely holds {per_row} of the longest prompt ({} tokens) with a whole completion ({} tokens), and {batch} rows hold {}: raise the batch or the sequence length, or lower the prompts, num_generations or max_completion_length",
                self.prompts,
                self.num_generations,
                set.max_prompt_len(),
                self.max_completion_length,
                batch * per_row
            )
        }
        Ok(())
    }

    /// Errors unless `G ≥ 2`, at least one prompt and one completion token, and a sampling
    /// that draws (greedy decoding would give every group one completion, and no advantage).
    pub fn validate(&self) -> Result<()> {
        if self.num_generations < 2 || self.prompts == 0 || self.max_completion_length == 0 {
            bail!("grpo: num_generations must be ≥ 2 and prompts and max_completion_length ≥ 1, got {}, {} and {}", self.num_generations, self.prompts, self.max_completion_length)
        }
        if !(self.beta >= 0.0 && self.beta.is_finite()) {
            bail!("grpo: beta must be ≥ 0, got {}", self.beta)
        }
        if self.sampling == Sampling::Greedy {
            bail!("grpo: greedy decoding gives each group one completion and no advantage: sample (Sampling::Sample)")
        }
        self.sampling.check()
    }
}

/// Prompts with their reference answers (for the reward), by index.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptSet {
    examples: Vec<(Vec<u32>, Vec<u32>)>,
}

impl PromptSet {
    /// From `(prompt, reference answer)` token ids; errors on no example or an empty prompt.
    pub fn new(examples: Vec<(Vec<u32>, Vec<u32>)>) -> Result<Self> {
        if examples.is_empty() {
            bail!("grpo: no prompts")
        }
        if let Some(i) = examples.iter().position(|(p, _)| p.is_empty()) {
            bail!("grpo: prompt {i} is empty")
        }
        Ok(Self { examples })
    }

    /// From prompt / completion examples as [`super::sft::read_sft`] gives them: the prompt
    /// the tokens before the first target, the answer the targets.
    pub fn from_marked(docs: Vec<super::sft::MarkedTokens>) -> Result<Self> {
        let examples = docs
            .into_iter()
            .enumerate()
            .map(|(i, (t, m))| match m.iter().position(|&x| x) {
                Some(k) if k > 0 => Ok((t[..k].to_vec(), t.iter().zip(&m).filter(|(_, &x)| x).map(|(&x, _)| x).collect())),
                _ => bail!("grpo: example {i} has no prompt before its completion"),
            })
            .collect::<Result<Vec<_>>>()?;
        Self::new(examples)
    }

    /// How many prompts.
    pub fn len(&self) -> usize {
        self.examples.len()
    }

    /// Whether there is none (never: [`PromptSet::new`] refuses it).
    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// Prompt `i` and its answer.
    pub fn get(&self, i: usize) -> Option<(&[u32], &[u32])> {
        self.examples.get(i).map(|(p, a)| (p.as_slice(), a.as_slice()))
    }

    /// Prompts `range` as a set of their own (a held-out split).
    pub fn subset(&self, range: std::ops::Range<usize>) -> Result<Self> {
        if range.start >= range.end || range.end > self.len() {
            bail!("PromptSet::subset: prompts {range:?} of {}", self.len())
        }
        Self::new(self.examples[range].to_vec())
    }

    /// The longest prompt's tokens.
    pub fn max_prompt_len(&self) -> usize {
        self.examples.iter().map(|(p, _)| p.len()).max().unwrap_or(0)
    }

    /// Largest token id + 1.
    pub fn vocab_needed(&self) -> usize {
        self.examples.iter().flat_map(|(p, a)| p.iter().chain(a)).max().map_or(0, |&m| m as usize + 1)
    }
}

/// Advantages of `rewards` in groups of `g` (consecutive), scaled by `scale`.
pub fn advantages(rewards: &[f64], g: usize, scale: ScaleRewards) -> Result<Vec<f64>> {
    if g < 2 || rewards.is_empty() || !rewards.len().is_multiple_of(g) {
        bail!("grpo: {} rewards in groups of {g}", rewards.len())
    }
    let std = |v: &[f64]| -> f64 {
        let m = v.iter().sum::<f64>() / v.len() as f64;
        (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1).max(1) as f64).sqrt()
    };
    let all = std(rewards);
    Ok(rewards
        .chunks(g)
        .flat_map(|grp| {
            let m = grp.iter().sum::<f64>() / g as f64;
            let s = match scale {
                ScaleRewards::Group => std(grp) + 1e-4,
                ScaleRewards::Batch => all + 1e-4,
                ScaleRewards::None => 1.0,
            };
            grp.iter().map(move |r| (r - m) / s).collect::<Vec<_>>()
        })
        .collect())
}

/// Per completion of a micro-batch (`lengths`: its tokens), the normalisation `k_i` of its
/// tokens' terms; `step`: the step's completion tokens and micro-batches (dapo's).
pub fn norms(lengths: &[usize], loss: GrpoLoss, max_len: usize, (step_tokens, micro_batches): (usize, usize)) -> Vec<f64> {
    let n = lengths.len().max(1) as f64;
    let total: usize = lengths.iter().sum();
    lengths
        .iter()
        .map(|&len| match loss {
            GrpoLoss::Grpo => 1.0 / (len.max(1) as f64 * n),
            GrpoLoss::Bnpo => 1.0 / total.max(1) as f64,
            GrpoLoss::DrGrpo => 1.0 / (n * max_len.max(1) as f64),
            GrpoLoss::Dapo => micro_batches as f64 / step_tokens.max(1) as f64,
        })
        .collect()
}

/// Per completion, the weight `k_i·A_i` of each of its tokens' `nll` (`lengths`: its tokens),
/// and the loss's value `−Σ_i A_i·|o_i|·k_i` (without the KL term); `step` as [`norms`].
pub fn token_weights(adv: &[f64], lengths: &[usize], loss: GrpoLoss, max_len: usize, step: (usize, usize)) -> (Vec<f64>, f64) {
    let w: Vec<f64> = adv.iter().zip(norms(lengths, loss, max_len, step)).map(|(a, k)| a * k).collect();
    let value = -w.iter().zip(lengths).map(|(w, &l)| w * l as f64).sum::<f64>();
    (w, value)
}

/// One micro-batch's completions, packed into rows, with their rewards and (once the step's
/// are all sampled, [`weigh_step`]) weights.
pub(crate) struct Rollout {
    /// The rows, `seq_len` each.
    pub rows: Vec<Sample>,
    /// Per token `1 + completion` (0: prompt or padding), `[B, T]`.
    slots: Tensor,
    /// Per completion, its tokens' weight `k_i·A_i`.
    weights: Vec<f64>,
    /// Per completion, its normalisation `k_i`.
    norms: Vec<f64>,
    /// TRL's loss value.
    value: f64,
    /// The completions' rewards.
    pub rewards: Vec<f64>,
    /// The completions' lengths.
    pub lengths: Vec<usize>,
    /// Per completion, whether it stopped at the length limit (no stop token).
    pub truncated: Vec<bool>,
}

/// The completions of micro-batch `micro` of `step`: `cfg.prompts` prompts of `set` drawn
/// from (seed, step, micro), `G` completions each sampled by `model` as it is (one generator
/// per prompt, seeded from the same), rewarded, and packed in order into `batch` rows of
/// `seq_len`. Collective over the world (generation). Errors when they do not fit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rollout(model: &Llama, cfg: &GrpoConfig, set: &PromptSet, seed: u64, (step, micro): (usize, usize), (batch, seq_len): (usize, usize), dev: &Device) -> Result<Rollout> {
    model.set_lora_dropout(None)?;
    let mut pick = Rng::derive(seed, &[step as u64, micro as u64, 0x6772_706f]);
    let g = cfg.num_generations;
    let (mut docs, mut rewards, mut lengths, mut truncated) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for p in 0..cfg.prompts {
        let i = pick.below(set.len());
        let (prompt, answer) = set.get(i).ok_or_else(|| candle_core::Error::Msg(format!("grpo: no prompt {i}")))?;
        let ids = Tensor::from_vec(prompt.repeat(g), (g, prompt.len()), &Device::Cpu)?;
        let sampling = match cfg.sampling {
            Sampling::Sample { temperature, top_k, top_p, seed: s } => Sampling::Sample { temperature, top_k, top_p, seed: Rng::derive(s ^ seed, &[step as u64, micro as u64, p as u64]).next_u64() },
            Sampling::Greedy => Sampling::Greedy,
        };
        let out = model.generate_until(&ids.to_device(dev)?, cfg.max_completion_length, sampling, &cfg.stop)?;
        for completion in out.tokens {
            rewards.push((cfg.reward)(prompt, &completion, answer));
            lengths.push(completion.len());
            truncated.push(!completion.last().is_some_and(|t| cfg.stop.contains(t)) && completion.len() >= cfg.max_completion_length);
            docs.push((prompt.to_vec(), completion));
        }
    }
    // packed in order: as many documents per row as fit
    let (mut rows, mut slots) = (Vec::new(), Vec::new());
    let mut next = 0;
    for _ in 0..batch {
        let (mut tokens, mut marks, mut lens, mut row_slots) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        while let Some((p, c)) = docs.get(next) {
            if tokens.len() + p.len() + c.len() > seq_len {
                break;
            }
            tokens.extend(p.iter().chain(c));
            marks.extend(std::iter::repeat_n(false, p.len()).chain(std::iter::repeat_n(true, c.len())));
            row_slots.extend(std::iter::repeat_n(next as u32 + 1, p.len() + c.len()));
            lens.push(p.len() + c.len());
            next += 1;
        }
        if tokens.len() < seq_len {
            lens.push(seq_len - tokens.len());
            row_slots.extend(std::iter::repeat_n(0, seq_len - tokens.len()));
            marks.resize(seq_len, false);
            tokens.resize(seq_len, 0);
        }
        slots.extend(row_slots);
        rows.push(Sample { tokens, long_range: marks, documents: Some(Documents::from_lengths(&lens)?) });
    }
    if next < docs.len() {
        let need: usize = docs.iter().map(|(p, c)| p.len() + c.len()).sum();
        bail!("grpo: the micro-batch's {} completions ({need} tokens with their prompts) do not fit in {batch} rows of {seq_len}: raise the batch or the sequence length, or lower prompts, num_generations or max_completion_length", docs.len())
    }
    Ok(Rollout { rows, slots: Tensor::from_vec(slots, (batch, seq_len), &Device::Cpu)?, weights: Vec::new(), norms: Vec::new(), value: 0.0, rewards, lengths, truncated })
}

/// The step's micro-batches' rollouts weighed: the advantages (within each group, scaled by
/// the group's or the whole step's spread), each completion's normalisation and weight, each
/// micro-batch's value.
pub(crate) fn weigh_step(rollouts: &mut [Rollout], cfg: &GrpoConfig) -> Result<()> {
    let all: Vec<f64> = rollouts.iter().flat_map(|r| r.rewards.iter().copied()).collect();
    let adv = advantages(&all, cfg.num_generations, cfg.scale_rewards)?;
    // (TRL's mask_truncated_completions: a truncated completion's tokens out of the loss and
    // of the token counts, its reward still in its group's advantages)
    let masked = |r: &Rollout| -> Vec<usize> { r.lengths.iter().zip(&r.truncated).map(|(&l, &t)| if cfg.mask_truncated_completions && t { 0 } else { l }).collect() };
    let step = (rollouts.iter().flat_map(masked).sum::<usize>(), rollouts.len());
    let mut at = 0;
    for r in rollouts.iter_mut() {
        let a = &adv[at..at + r.rewards.len()];
        at += r.rewards.len();
        let lengths = masked(r);
        // (a masked completion: no weight, no KL term)
        r.norms = norms(&lengths, cfg.loss_type, cfg.max_completion_length, step).into_iter().zip(&lengths).map(|(k, &l)| if l == 0 { 0.0 } else { k }).collect();
        r.weights = a.iter().zip(&r.norms).map(|(a, k)| a * k).collect();
        r.value = -r.weights.iter().zip(&lengths).map(|(w, &l)| w * l as f64).sum::<f64>();
    }
    Ok(())
}

impl Rollout {
    /// The micro-batch's loss node: `Σ_t k_i·A_i·nll_t` over this rank's completion targets
    /// (`nll` its per-token losses, flattened, on the compute device; `labels` and `marks` the
    /// shard's, as the trainer has them), with `beta` > 0 and the reference's per-token losses
    /// `ref_nll` (of the same targets) the KL term's `k_i·β·(e^(ref − log π) − 1)` in each
    /// weight, shifted so that its value is TRL's loss; also that value and the mean per-token
    /// KL over the completions (0 without the term). Collective over `group` with the KL term
    /// (the ranks holding distinct tokens).
    pub(crate) fn loss(&self, nll: &Tensor, ref_nll: Option<&[f32]>, beta: f64, (labels, marks): (&[u32], &[u32]), ctx: &ParallelCtx, group: &candle_cp_comm::Group) -> Result<(Tensor, f64, f64)> {
        let slots: Vec<u32> = shard_batch(&self.slots, ctx)?.labels.flatten_all()?.to_vec1()?;
        let n = slots.len();
        if n != nll.elem_count() || labels.len() != n || marks.len() != n || ref_nll.is_some_and(|r| r.len() != n) {
            bail!("grpo: {} per-token losses for {} labels, {} marks, {} slots and {:?} reference losses", nll.elem_count(), labels.len(), marks.len(), n, ref_nll.map(<[f32]>::len))
        }
        let kl_on = beta > 0.0;
        if kl_on && ref_nll.is_none() {
            bail!("grpo: the KL term (beta {beta}) needs the reference's per-token losses")
        }
        let values: Vec<f32> = match kl_on {
            true => nll.detach().to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec1()?,
            false => Vec::new(),
        };
        // (the KL sums: Σ k_i·kl_t, Σ kl_t, tokens)
        let mut kl = [0f64; 3];
        let w: Vec<f32> = (0..n)
            .map(|i| match slots[i] {
                s if s > 0 && labels[i] != IGNORE && marks[i] == 1 => {
                    let c = s as usize - 1;
                    let mut w = self.weights[c];
                    if let (true, Some(r)) = (kl_on, ref_nll) {
                        // ref − log π = nll − ref_nll
                        let d = values[i] as f64 - r[i] as f64;
                        let k3 = d.exp() - d - 1.0;
                        kl = [kl[0] + self.norms[c] * k3, kl[1] + k3, kl[2] + 1.0];
                        w += self.norms[c] * beta * (d.exp() - 1.0);
                    }
                    w as f32
                }
                _ => 0.0,
            })
            .collect();
        let kl = match kl_on {
            true => super::dpo::sum_over(&kl, group)?,
            false => kl.to_vec(),
        };
        let value = self.value + beta * kl[0];
        let graph = (nll.to_dtype(DType::F32)? * Tensor::from_vec(w, nll.shape(), nll.device())?)?.sum_all()?;
        // (each rank's node has the loss's value, as every loss's; its gradient is its share)
        let gv = graph.to_scalar::<f32>()? as f64;
        Ok(((graph + (value - gv))?, value, kl[1] / kl[2].max(1.0)))
    }
}

/// A GRPO run beside the trainer: its settings, prompts and (with the KL term) reference.
pub(crate) struct GrpoRun {
    pub cfg: GrpoConfig,
    pub set: PromptSet,
    /// The reference's weights (kept in checkpoints; `None` for a LoRA run's, its frozen base)
    /// and model (with `beta` > 0).
    pub reference: Option<(Option<super::tr_dpo::RefModel>, Llama)>,
    /// The held-out prompts (with [`super::TrainConfig::eval`]).
    pub eval: Option<PromptSet>,
}

impl GrpoRun {
    /// The held-out reward: the mean reward of one greedy completion of every held-out prompt
    /// (at most `max_completion_length` tokens, ending at the stop tokens) under `model` as it
    /// is; `None` without held-out prompts. Each prompt is generated as `dp` copies of itself
    /// (every DP replica one row). Collective over the world.
    pub(crate) fn evaluate(&self, model: &Llama, ctx: &ParallelCtx, dev: &Device) -> Result<Option<f64>> {
        let Some(set) = &self.eval else { return Ok(None) };
        model.set_lora_dropout(None)?;
        let dp = ctx.layout.dp.max(1);
        let mut total = 0.0;
        for i in 0..set.len() {
            let (prompt, answer) = set.get(i).ok_or_else(|| candle_core::Error::Msg(format!("grpo: no held-out prompt {i}")))?;
            let ids = Tensor::from_vec(prompt.repeat(dp), (dp, prompt.len()), dev)?;
            let out = model.generate_until(&ids, self.cfg.max_completion_length, Sampling::Greedy, &self.cfg.stop)?;
            let completion = out.tokens.first().ok_or_else(|| candle_core::Error::Msg("grpo: no completion".into()))?;
            total += (self.cfg.reward)(prompt, completion, answer);
        }
        Ok(Some(total / set.len().max(1) as f64))
    }

    /// The reference's per-token losses of the rows `sb` (this rank's shard, as the policy's
    /// forward takes them), flattened; `None` without the KL term. Collective over the world.
    pub(crate) fn reference_nll(&self, sb: &crate::ShardedBatch, dev: &Device) -> Result<Option<Vec<f32>>> {
        let Some((_, m)) = &self.reference else { return Ok(None) };
        let nll = m.token_nll_packed(&sb.input_ids.to_device(dev)?, &sb.labels.to_device(dev)?, &sb.positions.to_device(dev)?, &sb.documents)?;
        Ok(Some(nll.detach().flatten_all()?.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec1()?))
    }
}

/// A run's GRPO (`None` without [`super::TrainConfig::grpo`]): its settings checked against
/// the data, the layout and the rows; with the KL term, the reference — this rank's copy of the
/// model as the run starts, or a resumed run's from its checkpoint (`resume_dir/reference`).
pub(crate) fn prepare(cfg: &super::TrainConfig, mcfg: &crate::LlamaConfig, (policy, ctx, dev): (&candle_nn::VarMap, &ParallelCtx, &Device), resume_dir: Option<&std::path::Path>) -> Result<Option<GrpoRun>> {
    let (g, set) = match (&cfg.grpo, &cfg.data) {
        (None, super::DataSource::Prompts(_)) => bail!("train: prompts train by GRPO: set grpo"),
        (None, _) => return Ok(None),
        (Some(g), super::DataSource::Prompts(set)) => (g, set),
        (Some(_), _) => bail!("train: GRPO samples completions of prompts (DataSource::Prompts)"),
    };
    g.validate()?;
    if cfg.dpo.is_some() {
        bail!("train: a GRPO run takes no dpo")
    }
    let eval = match cfg.eval.as_ref().map(|e| &e.data) {
        None => None,
        Some(super::DataSource::Prompts(s)) => Some(s.clone()),
        Some(_) => bail!("train: a GRPO run's held-out data must be prompts too"),
    };
    if !g.num_generations.is_multiple_of(ctx.layout.dp) {
        bail!("train: GRPO's {} completions per prompt are generated split over DP: dp = {} must divide num_generations", g.num_generations, ctx.layout.dp)
    }
    if set.vocab_needed() > mcfg.vocab_size {
        bail!("train: the prompts use {} token ids, the model's vocabulary is {}", set.vocab_needed(), mcfg.vocab_size)
    }
    g.check_fits(set, cfg.batch, cfg.seq_len)?;
    let reference = match g.beta > 0.0 {
        false => None,
        // (a LoRA run's reference: its frozen base, the same tensors read without the adapters,
        // as PEFT's disabled adapters — nothing copied, nothing to checkpoint)
        true if cfg.lora.is_some() => {
            if cfg.quantize_base.is_some() || mcfg.lora.as_ref().is_some_and(|l| !l.modules_to_save.is_empty()) {
                bail!("train: GRPO's KL term (beta {}) with LoRA takes the frozen base as its reference: not with a quantized base or modules trained whole (modules_to_save): set beta 0", g.beta)
            }
            let base = crate::LlamaConfig { lora: None, ..mcfg.clone() };
            Some((None, Llama::new(super::lora::frozen_builder(policy, &base, cfg.dtype, dev)?, &base, ctx)?))
        }
        true => {
            let r = match resume_dir {
                Some(d) => super::tr_dpo::RefModel::resumed(d, "GRPO", ctx, dev, cfg.dtype, cfg.sliding_window)?,
                None => super::tr_dpo::RefModel::copy_of(policy, mcfg)?,
            };
            r.check_matches(policy)?;
            let m = r.model(cfg.dtype, dev, ctx)?;
            Some((Some(r), m))
        }
    };
    Ok(Some(GrpoRun { cfg: g.clone(), set: set.clone(), reference, eval }))
}

#[cfg(test)]
#[path = "grpo_tests.rs"]
mod tests;
