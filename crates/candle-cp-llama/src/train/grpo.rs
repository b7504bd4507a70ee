//! GRPO (Shao et al. 2024, DeepSeekMath; TRL's `GRPOTrainer`) on every layout: online
//! reinforcement learning from a reward function. Each generation draws prompts, samples a
//! group of `G` completions per prompt from the policy as it is (generation on the run's
//! layout, the prompts of all the step's micro-batches in one batch:
//! [`crate::Llama::generate_ragged`]), scores them, and trains on them:
//!
//! ```text
//! prompt p ──generate──► o_1 … o_G   rewards r_1 … r_G   A_i = (r_i − mean(r)) / (std(r) + 1e-4)
//!
//! rows: [ p o_1 | p o_2 | … | p o_G | padding ]   (each p·o_i a document; o_i's tokens the targets)
//! loss = Σ_i Σ_{t ∈ o_i} −min(min(ρ_t, δ)·A_i, clip(ρ_t, 1 − ε, 1 + ε_high)·A_i) · k_i
//!        ρ_t = π(o_i,t) / π_old(o_i,t)   (δ: INTELLECT-2's cap, none by default; token level; sequence level: GSPO's
//!              ρ_i = exp(mean_t log(π/π_old)) for every token of o_i)
//!        k_i = 1 / (|o_i| · n)         grpo     (each completion's mean, then the completions')
//!        k_i = 1 / Σ_j |o_j|           bnpo     (every completion token alike)
//!        k_i = 1 / (n · max_len)       dr_grpo  (Dr. GRPO: a constant)
//!        k_i = M / Σ_step |o_j|        dapo     (every token of the step's M micro-batches alike)
//! cispo: −sg(min(ρ_t, ε_high))·A_i·log π(o_i,t) · k_i   (MiniMax-M1; k_i as dapo's)
//! sapo:  −σ(τ·(ρ_t − 1))·(4/τ)·A_i · k_i    τ = τ_pos if A_i > 0 else τ_neg   (Qwen's SAPO;
//!        a soft gate in place of the clip, the ratio-1 gradient GRPO's; k_i as dapo's)
//! ```
//!
//! As TRL's generation batch, the step's completions are all sampled before its first
//! micro-batch trains (the policy does not change within a step, so each micro-batch's are those
//! it would sample itself): `dapo`'s normaliser and `batch`-scaled advantages take the whole
//! step's. With `num_iterations` μ > 1 the completions sampled at step `s` (`s` a multiple of
//! μ) train the μ steps `s … s + μ − 1`: `π_old` is the policy that sampled them, its per-token
//! log-probabilities those of step `s`'s own forward (the policy unchanged within the step, so
//! the ratio is 1 there), kept for every target of the rows and, when a checkpoint falls inside
//! the μ steps, written into it (`grpo_rollouts.json`) with the completions and rewards, so a
//! resumed run — on any layout — goes on with them exactly.
//!
//! Each token's term is linear in its `nll = −log π` with a weight that is a constant of the
//! step: `k_i·A_i·ρ_t` where the ratio is not clipped (`∂(−ρA)/∂nll = ρA`), 0 where it is (TRL's
//! `min`: a positive advantage above `1 + ε_high`, a negative one below `1 − ε`); at the ratio 1
//! (`num_iterations` 1: TRL's case, where `π_old` is the policy detached) it is `k_i·A_i`. Each
//! rank back-propagates `Σ_t w_t·nll_t` over its targets, the node shifted so its value is
//! TRL's loss (`−Σ_i A_i·|o_i|·k_i` at the ratio 1, 0 for grpo with group-scaled rewards); GSPO's
//! sequence ratio `ρ_i` gives each of `o_i`'s tokens the weight `k_i·A_i·ρ_i` (the mean's
//! derivative `1/|o_i|` times its `|o_i|` terms), its log-ratio summed over the ranks holding
//! `o_i`'s tokens first. Generation samples the same tokens on every rank and on one device
//! (one seeded generator per prompt, the logits bitwise the same on every rank), so the rows,
//! rewards and weights are the same everywhere; the CP, TP and DP splits of the training
//! forward then follow the single-device gradients as for any loss.
//!
//! With `beta` > 0, TRL's KL term against a reference (the model as the run starts, kept
//! beside the policy like TR-DPO's, [`super::tr_dpo::RefModel`], and in each checkpoint's
//! `reference/`) joins each token's loss, `β · (e^(ref − log π) − (ref − log π) − 1)` (the k3
//! estimator), normalised as the rest: the reference scores the same rows by a forward
//! without a graph, and each token's weight gains `k_i·β·(e^(ref − log π) − 1)`. A LoRA run's
//! reference is its frozen base: the same tensors read without the adapters (PEFT's disabled
//! adapters; a quantized base's codes, [`crate::Llama::quantized_base`]), nothing copied or
//! checkpointed.
//!
//! Advantages (TRL's `scale_rewards`): the group's mean subtracted, then divided by the group's
//! standard deviation (`group`, unbiased as `torch.std`), by the whole micro-batch's (`batch`)
//! or not at all (`none`, Dr. GRPO's advice).

use super::data::Sample;
use crate::sampling::Sampling;
use candle_core::{bail, Device, Result, Tensor};
use candle_cp_ops::packing::Documents;
use std::sync::Arc;

/// A reward function: `(prompt, completion, reference answer)` token ids → reward (finite;
/// an error, or a reward that is not, stops the run naming the completion). The completion
/// ends with its stop token when it stopped. It must give every rank the same reward for the
/// same completion (a run checks: [`super::grpo_run`]).
pub type RewardFn = Arc<dyn Fn(&[u32], &[u32], &[u32]) -> Result<f64> + Send + Sync>;

#[path = "grpo_rewards.rs"]
pub mod rewards;

/// How the per-token terms are normalised, and CISPO's term ([`GrpoConfig::loss_type`]).
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
    /// MiniMax-M1's CISPO (TRL's `cispo`): every token keeps its gradient, weighted by its
    /// ratio capped and detached, `−sg(min(ρ, ε_high))·A·log π` (`epsilon_high` an absolute
    /// cap here, ScaleRL's ε_max: TRL recommends 5); normalised as `dapo`.
    Cispo,
    /// Qwen's SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): the hard clip
    /// replaced by a soft gate, each token's term `−σ(τ·(ρ − 1))·(4/τ)·A`, `τ` the
    /// [`GrpoConfig::sapo_temperatures`] of a positive or a negative advantage (its gradient
    /// `A·ρ·4σ(1 − σ)` per `nll`: GRPO's at `ρ = 1`, fading as the ratio leaves 1, faster for
    /// negative advantages); normalised as `dapo`.
    Sapo,
}

impl GrpoLoss {
    /// TRL's name.
    pub fn name(self) -> &'static str {
        match self {
            GrpoLoss::Grpo => "grpo",
            GrpoLoss::Bnpo => "bnpo",
            GrpoLoss::DrGrpo => "dr_grpo",
            GrpoLoss::Dapo => "dapo",
            GrpoLoss::Cispo => "cispo",
            GrpoLoss::Sapo => "sapo",
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
            "cispo" => GrpoLoss::Cispo,
            "sapo" => GrpoLoss::Sapo,
            _ => bail!("grpo: unknown loss type {s:?} (grpo, bnpo, dr_grpo, dapo, cispo or sapo)"),
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

/// Where the ratio `π/π_old` is taken ([`GrpoConfig::importance_sampling_level`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportanceLevel {
    /// Each token's own ratio (GRPO's, TRL's default).
    Token,
    /// One ratio per completion, the exponential of its tokens' mean log-ratio, clipped as a
    /// whole (GSPO, Zheng et al. 2025).
    Sequence,
}

impl std::str::FromStr for ImportanceLevel {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "token" => ImportanceLevel::Token,
            "sequence" => ImportanceLevel::Sequence,
            _ => bail!("grpo: unknown importance sampling level {s:?} (token or sequence)"),
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
    /// A reward model's weighted score of each `prompt ++ completion`, added to
    /// [`GrpoConfig::reward`]'s ([`super::reward::RewardModelSpec`]); `None`: none.
    pub reward_model: Option<super::reward::RewardModelSpec>,
    /// The KL term's weight β (TRL's `beta`, 0: none, no reference kept; DeepSeekMath 0.04).
    pub beta: f64,
    /// Leave out of the loss (and of the token counts) the completions that reached
    /// `max_completion_length` without a stop token (TRL's `mask_truncated_completions`); their
    /// rewards still count in their groups' advantages.
    pub mask_truncated_completions: bool,
    /// Optimisation steps per generation, μ (TRL's `num_iterations`, 1): the completions
    /// sampled at a step train it and the next μ − 1 steps, under the clipped ratio.
    pub num_iterations: usize,
    /// The ratio's lower clip `1 − ε` (TRL's `epsilon`, 0.2).
    pub epsilon: f64,
    /// The ratio's upper clip `1 + ε_high` (TRL's `epsilon_high`: `epsilon` unless set; DAPO's
    /// clip-higher 0.28).
    pub epsilon_high: f64,
    /// Per-token ratios or GSPO's per-sequence one (TRL's `importance_sampling_level`).
    pub importance_sampling_level: ImportanceLevel,
    /// Two-sided clipping (INTELLECT-2; TRL's `delta`): the unclipped term's ratio capped at
    /// `δ` (> 1, best above `1 + ε_high`), bounding a negative advantage's push on a token the
    /// policy has made far likelier; `None`: no cap.
    pub delta: Option<f64>,
    /// Train on the completion tokens of highest entropy only (TRL's `top_entropy_quantile`,
    /// Wang et al. 2025, "Beyond the 80/20 rule"): the policy term of the tokens whose entropy
    /// under the policy is below the `1 − ρ` quantile of the micro-batch's completion tokens
    /// (over every rank; a token within [`super::grpo_run::ENTROPY_TIE`] of it, relative,
    /// counts as at it, so that rounding does not split equal entropies between layouts) left
    /// out, their KL term kept; 1: every token.
    pub top_entropy_quantile: f64,
    /// SAPO's gate temperatures `(τ_pos, τ_neg)` for tokens of a positive and of a negative
    /// advantage ([`GrpoLoss::Sapo`]; the paper's 1.0 and 1.05: a negative advantage's gate
    /// closes faster). Unused by the other losses.
    pub sapo_temperatures: (f64, f64),
    /// Optimizer steps one generation feeds with distinct completions (TRL's
    /// `steps_per_generation`): the step that samples draws `S` steps' micro-batches in one
    /// generation batch; step `k` of the cycle trains on slice `k mod S` (each slice weighed
    /// as a step of its own), `S · num_iterations` steps per generation. The slices trained
    /// after the sampling step are off-policy: their `π_old` comes from a forward of the
    /// sampling policy over their rows before the first update. 1: every step its own.
    pub steps_per_generation: usize,
    /// DAPO's dynamic sampling (Yu et al. 2025; verl's `filter_groups` with
    /// `max_num_gen_batches`): the groups whose completions all got the same reward (no
    /// advantage) are set aside and the prompts of as many new groups sampled in their place,
    /// at most this many more generation batches per generation; what is still missing then is
    /// filled with set-aside groups. 0: off.
    pub dynamic_sampling: usize,
}

impl GrpoConfig {
    /// The defaults (TRL's, with its `grpo` loss and one completion token at most 32): `G` 8,
    /// temperature 1, group-scaled rewards, no KL term, one iteration, ε 0.2.
    pub fn new(prompts: usize, reward: RewardFn, stop: Vec<u32>, seed: u64) -> Self {
        Self {
            num_generations: 8,
            prompts,
            max_completion_length: 32,
            sampling: Sampling::Sample { temperature: 1.0, top_k: 0, top_p: 1.0, seed },
            stop,
            loss_type: GrpoLoss::Grpo,
            scale_rewards: ScaleRewards::Group,
            reward,
            reward_model: None,
            beta: 0.0,
            mask_truncated_completions: false,
            num_iterations: 1,
            epsilon: 0.2,
            epsilon_high: 0.2,
            importance_sampling_level: ImportanceLevel::Token,
            delta: None,
            top_entropy_quantile: 1.0,
            sapo_temperatures: (1.0, 1.05),
            steps_per_generation: 1,
            dynamic_sampling: 0,
        }
    }
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
            .field("reward_model", &self.reward_model)
            .field("beta", &self.beta)
            .field("mask_truncated_completions", &self.mask_truncated_completions)
            .field("num_iterations", &self.num_iterations)
            .field("epsilon", &self.epsilon)
            .field("epsilon_high", &self.epsilon_high)
            .field("importance_sampling_level", &self.importance_sampling_level)
            .field("delta", &self.delta)
            .field("top_entropy_quantile", &self.top_entropy_quantile)
            .field("sapo_temperatures", &self.sapo_temperatures)
            .field("steps_per_generation", &self.steps_per_generation)
            .field("dynamic_sampling", &self.dynamic_sampling)
            .finish_non_exhaustive()
    }
}

impl GrpoConfig {
    /// Steps per generation cycle: `steps_per_generation · num_iterations`.
    pub fn cycle(&self) -> usize {
        self.steps_per_generation * self.num_iterations
    }

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

    /// Errors unless `G ≥ 2`, at least one prompt, completion token and iteration, a clip range
    /// `0 < ε < 1`, `ε_high > 0`, and a sampling that draws (greedy decoding would give every
    /// group one completion, and no advantage).
    pub fn validate(&self) -> Result<()> {
        if self.num_generations < 2 || self.prompts == 0 || self.max_completion_length == 0 {
            bail!("grpo: num_generations must be ≥ 2 and prompts and max_completion_length ≥ 1, got {}, {} and {}", self.num_generations, self.prompts, self.max_completion_length)
        }
        if !(self.beta >= 0.0 && self.beta.is_finite()) {
            bail!("grpo: beta must be ≥ 0, got {}", self.beta)
        }
        if self.num_iterations == 0 || self.steps_per_generation == 0 {
            bail!("grpo: num_iterations and steps_per_generation must be ≥ 1, got {} and {}", self.num_iterations, self.steps_per_generation)
        }
        if !(self.epsilon > 0.0 && self.epsilon < 1.0 && self.epsilon_high > 0.0 && self.epsilon_high.is_finite()) {
            bail!("grpo: the clip range needs 0 < epsilon < 1 and epsilon_high > 0, got {} and {}", self.epsilon, self.epsilon_high)
        }
        if self.delta.is_some() && matches!(self.loss_type, GrpoLoss::Cispo | GrpoLoss::Sapo) {
            bail!("grpo: delta caps the clipped objective's ratio; {} has no clip to cap ({})", self.loss_type.name(), if self.loss_type == GrpoLoss::Cispo { "CISPO caps it by epsilon_high" } else { "SAPO's gate fades it" })
        }
        let (tp, tn) = self.sapo_temperatures;
        if !(tp > 0.0 && tn > 0.0 && tp.is_finite() && tn.is_finite()) {
            bail!("grpo: SAPO's temperatures must be > 0, got ({tp}, {tn})")
        }
        if self.delta.is_some_and(|d| !(d > 1.0 && d.is_finite())) {
            bail!("grpo: delta caps the ratio above 1 (best above 1 + epsilon_high): got {:?}", self.delta)
        }
        if !(self.top_entropy_quantile > 0.0 && self.top_entropy_quantile <= 1.0) {
            bail!("grpo: top_entropy_quantile is the fraction of tokens trained, in (0, 1], got {}", self.top_entropy_quantile)
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
            GrpoLoss::Dapo | GrpoLoss::Cispo | GrpoLoss::Sapo => micro_batches as f64 / step_tokens.max(1) as f64,
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
    /// The prompts and completions, in order.
    pub docs: Vec<(Vec<u32>, Vec<u32>)>,
    /// The rows, `seq_len` each.
    pub rows: Vec<Sample>,
    /// Per token `1 + completion` (0: prompt or padding), `[B, T]`.
    pub(super) slots: Tensor,
    /// Per completion, its advantage `A_i`.
    pub(super) advantages: Vec<f64>,
    /// Per completion, its normalisation `k_i`.
    pub(super) norms: Vec<f64>,
    /// TRL's loss value at the ratio 1.
    pub(super) value: f64,
    /// The completions' rewards.
    pub rewards: Vec<f64>,
    /// The completions' lengths.
    pub lengths: Vec<usize>,
    /// Per completion, whether it stopped at the length limit (no stop token).
    pub truncated: Vec<bool>,
    /// `π_old`'s per-token losses (`num_iterations` > 1): per position `b·T + t` of the rows,
    /// the loss of its target under the policy that sampled them (0 where no target is
    /// trained); `None` until that forward recorded them ([`Rollout::record_old`]).
    pub(super) old: Option<Vec<f32>>,
}

impl Rollout {
    /// `docs` (prompt, completion) with their `rewards`, packed in order into `batch` rows of
    /// `seq_len` (as many documents per row as fit), not yet weighed. Errors when they do not
    /// fit.
    pub(crate) fn packed(docs: Vec<(Vec<u32>, Vec<u32>)>, rewards: Vec<f64>, cfg: &GrpoConfig, (batch, seq_len): (usize, usize)) -> Result<Self> {
        if docs.len() != rewards.len() {
            bail!("grpo: {} completions with {} rewards", docs.len(), rewards.len())
        }
        let lengths = docs.iter().map(|(_, c)| c.len()).collect();
        let truncated = docs.iter().map(|(_, c)| !c.last().is_some_and(|t| cfg.stop.contains(t)) && c.len() >= cfg.max_completion_length).collect();
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
        let slots = Tensor::from_vec(slots, (batch, seq_len), &Device::Cpu)?;
        Ok(Rollout { docs, rows, slots, advantages: Vec::new(), norms: Vec::new(), value: 0.0, rewards, lengths, truncated, old: None })
    }
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
        r.advantages = adv[at..at + r.rewards.len()].to_vec();
        at += r.rewards.len();
        let lengths = masked(r);
        // (a masked completion: no weight, no KL term)
        r.norms = norms(&lengths, cfg.loss_type, cfg.max_completion_length, step).into_iter().zip(&lengths).map(|(k, &l)| if l == 0 { 0.0 } else { k }).collect();
        r.value = -(0..lengths.len()).map(|k| r.weight(k) * lengths[k] as f64).sum::<f64>();
    }
    Ok(())
}

impl Rollout {
    /// Completion `k`'s tokens' weight at the ratio 1, `k_k·A_k` (0 for a masked completion).
    pub(super) fn weight(&self, k: usize) -> f64 {
        self.advantages[k] * self.norms[k]
    }
}

#[cfg(test)]
#[path = "grpo_tests.rs"]
pub(crate) mod tests;
