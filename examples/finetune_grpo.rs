//! `finetune_llama --grpo`: GRPO's flags ([`GrpoArgs`], flattened into the example's) and the
//! [`GrpoConfig`] they make.

use anyhow::{bail, Result};
use candle_cp_llama::sampling::Sampling;
use candle_cp_llama::train::grpo::{rewards, GrpoConfig, GrpoLoss, ImportanceLevel, ScaleRewards};

/// GRPO's options (with `--grpo`).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct GrpoArgs {
    /// GRPO (online RL, TRL's GRPOTrainer): --data
    /// is prompt / completion examples (as --sft's); each micro-batch samples
    /// --num-generations completions of --grpo-prompts prompts from the model as it is, scores
    /// each against its example's completion (--reward) and trains on them weighted by their
    /// advantages.
    #[arg(long)]
    pub(crate) grpo: bool,
    /// Completions per prompt (TRL's num_generations; ≥ 2; --dp must divide --grpo-prompts × this).
    #[arg(long, default_value_t = 8)]
    pub(crate) num_generations: usize,
    /// Prompts per micro-batch (their completions are packed into --batch rows of --seq-len).
    #[arg(long, default_value_t = 2)]
    pub(crate) grpo_prompts: usize,
    /// Most tokens of a completion (it ends earlier at the end-of-sequence id).
    #[arg(long, default_value_t = 32)]
    pub(crate) max_completion_length: usize,
    /// Sampling temperature of the completions.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) grpo_temperature: f64,
    /// Sample from the top-k tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    pub(crate) grpo_top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches top-p (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) grpo_top_p: f64,
    /// The per-token normalisation: grpo (each completion's mean, then the mean), bnpo (every
    /// token of a micro-batch alike), dr_grpo (a constant) or dapo (every token of the step
    /// alike; TRL's default); or cispo (MiniMax-M1: every token's gradient weighted by its
    /// ratio capped at --epsilon-high, TRL recommends 5; normalised as dapo), or sapo (Qwen's
    /// SAPO: a soft gate σ(τ·(ρ − 1))·4/τ in place of the clip, τ from --sapo-temperatures;
    /// normalised as dapo).
    #[arg(long, default_value = "grpo")]
    pub(crate) grpo_loss: String,
    /// Advantages divided by the group's reward spread (group), the micro-batch's (batch) or
    /// not (none).
    #[arg(long, default_value = "group")]
    pub(crate) scale_rewards: String,
    /// The KL term's weight β against the model as the run starts (TRL's beta; 0: none, no
    /// reference kept; DeepSeekMath 0.04). With --lora the reference is the frozen base (with
    /// --quantize-base, its codes).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) grpo_beta: f64,
    /// Leave out of the loss the completions that reach --max-completion-length without the
    /// end-of-sequence id (TRL's mask_truncated_completions).
    #[arg(long)]
    pub(crate) mask_truncated_completions: bool,
    /// Optimizer steps per generation (TRL's num_iterations): the completions sampled at a
    /// step train it and the next steps, the ratio π/π_old clipped to [1 − ε, 1 + ε_high].
    #[arg(long, default_value_t = 1)]
    pub(crate) num_iterations: usize,
    /// Optimizer steps one generation feeds with distinct completions (TRL's
    /// steps_per_generation): the sampling step draws S steps' micro-batches in one batch,
    /// the later steps' slices trained off-policy under the clipped ratio (their π_old from a
    /// forward when sampled).
    #[arg(long, default_value_t = 1)]
    pub(crate) steps_per_generation: usize,
    /// DAPO's dynamic sampling: set aside the groups whose completions all got the same reward
    /// and sample new prompts in their place, at most N more generation batches per
    /// generation (0: off).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub(crate) dynamic_sampling: usize,
    /// The clip range's lower side ε (TRL's epsilon).
    #[arg(long, default_value_t = 0.2)]
    pub(crate) epsilon: f64,
    /// The clip range's upper side (TRL's epsilon_high; default --epsilon; DAPO's 0.28).
    #[arg(long)]
    pub(crate) epsilon_high: Option<f64>,
    /// The ratio per token (token) or one per completion from its tokens' mean log-ratio
    /// (sequence: GSPO).
    #[arg(long, default_value = "token")]
    pub(crate) importance_sampling_level: String,
    /// Two-sided clipping (INTELLECT-2, TRL's delta): the unclipped term's ratio capped at
    /// DELTA (> 1; best above 1 + --epsilon-high).
    #[arg(long)]
    pub(crate) delta: Option<f64>,
    /// Train on this fraction of each micro-batch's completion tokens, those of highest
    /// entropy under the policy (TRL's top_entropy_quantile; 1: all).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_entropy_quantile: f64,
    /// SAPO's gate temperatures for tokens of a positive and of a negative advantage
    /// (--grpo-loss sapo; the paper's 1.0,1.05).
    #[arg(long, value_delimiter = ',', num_args = 2, value_name = "POS,NEG", default_values_t = [1.0, 1.05])]
    pub(crate) sapo_temperatures: Vec<f64>,
    /// The reward against the example's completion: exact (1 for the completion itself, else
    /// 0), tokens (the fraction of positions that match), finished (1 when the completion
    /// ends with the end-of-sequence id), overlong (DAPO's soft overlong punishment: 0, falling
    /// to −1 over the last --overlong-cache tokens of --max-completion-length), command
    /// (--reward-command's) or model (--reward-model-dir's score of the prompt and completion);
    /// several, comma separated, summed (--reward-weights).
    #[arg(long, default_value = "tokens")]
    pub(crate) reward: String,
    /// The weights of a --reward list, comma separated (default: 1 each).
    #[arg(long, value_name = "W,..")]
    pub(crate) reward_weights: Option<String>,
    /// The shell command of `--reward command`, started once (`sh -c CMD`): it reads one JSON
    /// line per completion, `{"prompt": .., "completion": .., "answer": ..}` (texts, decoded by
    /// --tokenizer or byte-level), and prints one number per line, the completion's reward.
    #[arg(long, value_name = "CMD")]
    pub(crate) reward_command: Option<String>,
    /// The reward model of `--reward model`: a `*ForSequenceClassification` checkpoint of one
    /// label sharing the policy's tokenizer (e.g. a `finetune_llama --reward-model` checkpoint,
    /// a LoRA one too: its adapter over the base it names, merged),
    /// loaded frozen on the run's layout; it scores each prompt ++ completion at its last token.
    #[arg(long, value_name = "DIR")]
    pub(crate) reward_model_dir: Option<std::path::PathBuf>,
    /// The reward model's own tokenizer.json, when it is not the policy's: each prompt and
    /// completion decoded (--tokenizer, special tokens skipped; else bytes) and encoded again by
    /// it, as TRL feeds a reward model of another tokenizer (--step-separator through it too).
    #[arg(long, value_name = "FILE")]
    pub(crate) reward_model_tokenizer: Option<std::path::PathBuf>,
    /// How a process reward model's (a `*ForTokenClassification` as --reward-model-dir) step
    /// probabilities make a completion's reward: min, last or prod (its steps end at
    /// --step-separator).
    #[arg(long, default_value = "min")]
    pub(crate) step_aggregate: String,
    /// The tokens before --max-completion-length over which `--reward overlong` falls from 0 to
    /// −1 (TRL's soft_punish_cache; default: a quarter of the length).
    #[arg(long, value_name = "N")]
    pub(crate) overlong_cache: Option<usize>,
    /// Seconds --reward-command may take to answer one completion.
    #[arg(long, default_value_t = 60)]
    pub(crate) reward_timeout: u64,
}

impl GrpoArgs {
    /// The run's GRPO settings (`None` without --grpo), completions ending at `eos`; a process
    /// reward model's steps end at `step_separator` (tokenised by `tokenizer`, else bytes).
    pub(crate) fn config(&self, eos: Option<u32>, seed: u64, tokenizer: Option<&std::path::Path>, step_separator: &str) -> Result<Option<GrpoConfig>> {
        if !self.grpo {
            return Ok(None);
        }
        let names: Vec<&str> = self.reward.split(',').map(str::trim).collect();
        let weights: Vec<f64> = match &self.reward_weights {
            None => vec![1.0; names.len()],
            Some(w) => w.split(',').map(|x| x.trim().parse::<f64>().map_err(|e| anyhow::anyhow!("--reward-weights {w}: {e}"))).collect::<Result<_>>()?,
        };
        if weights.len() != names.len() {
            bail!("--reward-weights gives {} weights for the {} rewards of --reward {}", weights.len(), names.len(), self.reward)
        }
        // (the reward model's weight; its scores come from the run, not a function)
        let model_weight = names.iter().zip(&weights).filter(|(n, _)| **n == "model").map(|(_, w)| *w).sum::<f64>();
        let reward_model = match (names.contains(&"model"), &self.reward_model_dir) {
            (true, Some(dir)) => {
                // (a process reward model judges the completion's steps)
                let rm = candle_cp_llama::LlamaConfig::from_file(candle_cp_llama::lora::base_model_dir(dir)?.join("config.json"))?;
                // (the reward model's tokenizer: its own, else the policy's, else bytes)
                let rm_tok = match self.reward_model_tokenizer.as_deref().or(tokenizer) {
                    Some(p) => Some(std::sync::Arc::new(tokenizers::Tokenizer::from_file(p).map_err(|e| anyhow::anyhow!("loading {}: {e}", p.display()))?)),
                    None => None,
                };
                let encode = |text: &str| -> candle_core::Result<Vec<u32>> {
                    match &rm_tok {
                        Some(t) => Ok(t.encode(text, false).map_err(|e| candle_core::Error::Msg(format!("tokenizing for the reward model: {e}")))?.get_ids().to_vec()),
                        None => Ok(text.bytes().map(u32::from).collect()),
                    }
                };
                let steps = match rm.token_classifier {
                    Some(_) => Some((encode(&step_separator.replace("\\n", "\n"))?, self.step_aggregate.parse()?)),
                    None => None,
                };
                let retokenize = match (&self.reward_model_tokenizer, rm_tok.clone()) {
                    (Some(_), Some(t)) => {
                        let encode: candle_cp_llama::train::reward::Encode = std::sync::Arc::new(move |s: &str| Ok(t.encode(s, false).map_err(|e| candle_core::Error::Msg(format!("tokenizing for the reward model: {e}")))?.get_ids().to_vec()));
                        Some((decoder(tokenizer, true)?, encode))
                    }
                    _ => None,
                };
                Some(candle_cp_llama::train::reward::RewardModelSpec { dir: dir.clone(), weight: model_weight, steps, retokenize })
            }
            (true, None) => bail!("--reward model needs --reward-model-dir DIR"),
            (false, Some(_)) => bail!("--reward-model-dir is the reward `model`: name it in --reward"),
            (false, None) if self.reward_model_tokenizer.is_some() => bail!("--reward-model-tokenizer is the reward model's (--reward model --reward-model-dir DIR)"),
            (false, None) => None,
        };
        let zero: candle_cp_llama::train::grpo::RewardFn = std::sync::Arc::new(|_, _, _| Ok(0.0));
        let parts = names
            .iter()
            .zip(weights)
            .map(|(&n, w)| {
                let r = match n {
                    "exact" => rewards::exact_match(),
                    "tokens" => rewards::token_accuracy(),
                    "finished" => rewards::finished(eos.into_iter().collect()),
                    "overlong" => rewards::soft_overlong_punishment(self.max_completion_length, self.overlong_cache.unwrap_or(self.max_completion_length / 4).max(1)),
                    "command" => {
                        let Some(cmd) = &self.reward_command else { bail!("--reward command needs --reward-command CMD") };
                        rewards::command("sh", &["-c".into(), cmd.clone()], decoder(tokenizer, false)?, std::time::Duration::from_secs(self.reward_timeout))?
                    }
                    // (a function's zero in its place: the model's scores are added by the run)
                    "model" => zero.clone(),
                    r => bail!("--reward {r}: expected exact, tokens, finished, overlong, command or model"),
                };
                Ok((r, w))
            })
            .collect::<Result<Vec<_>>>()?;
        if self.overlong_cache.is_some() && !names.contains(&"overlong") {
            bail!("--overlong-cache is the reward `overlong`'s: name it in --reward")
        }
        if self.reward_command.is_some() && !names.contains(&"command") {
            bail!("--reward-command is the reward `command`: name it in --reward")
        }
        let reward = match parts.len() {
            1 if parts[0].1 == 1.0 => parts.into_iter().next().map(|(r, _)| r).ok_or_else(|| anyhow::anyhow!("--reward: none"))?,
            _ => rewards::weighted(parts),
        };
        let c = GrpoConfig {
            num_generations: self.num_generations,
            prompts: self.grpo_prompts,
            max_completion_length: self.max_completion_length,
            sampling: Sampling::Sample { temperature: self.grpo_temperature, top_k: self.grpo_top_k, top_p: self.grpo_top_p, seed },
            stop: eos.into_iter().collect(),
            loss_type: self.grpo_loss.parse::<GrpoLoss>()?,
            scale_rewards: self.scale_rewards.parse::<ScaleRewards>()?,
            reward,
            reward_model,
            beta: self.grpo_beta,
            mask_truncated_completions: self.mask_truncated_completions,
            num_iterations: self.num_iterations,
            steps_per_generation: self.steps_per_generation,
            dynamic_sampling: self.dynamic_sampling,
            epsilon: self.epsilon,
            epsilon_high: self.epsilon_high.unwrap_or(self.epsilon),
            importance_sampling_level: self.importance_sampling_level.parse::<ImportanceLevel>()?,
            delta: self.delta,
            top_entropy_quantile: self.top_entropy_quantile,
            sapo_temperatures: match self.sapo_temperatures.as_slice() {
                &[p, n] => (p, n),
                t => anyhow::bail!("--sapo-temperatures takes two numbers POS,NEG, got {t:?}"),
            },
        };
        c.validate()?;
        Ok(Some(c))
    }
}

/// Token ids → text for --reward-command (special tokens kept) or a reward model's own
/// tokenizer (`skip_special`, as TRL decodes for it): through --tokenizer, else the bytes as
/// UTF-8 (lossy; an id past 255 as U+FFFD).
fn decoder(tokenizer: Option<&std::path::Path>, skip_special: bool) -> Result<rewards::Decode> {
    Ok(match tokenizer {
        Some(p) => {
            let tok = tokenizers::Tokenizer::from_file(p).map_err(|e| anyhow::anyhow!("loading --tokenizer {}: {e}", p.display()))?;
            std::sync::Arc::new(move |ids: &[u32]| tok.decode(ids, skip_special).map_err(|e| candle_core::Error::Msg(format!("decoding {} ids: {e}", ids.len()))))
        }
        // (an id past the bytes, of a larger random-init vocabulary: U+FFFD)
        None => std::sync::Arc::new(|ids: &[u32]| Ok(String::from_utf8_lossy(&ids.iter().flat_map(|&t| if t < 256 { vec![t as u8] } else { "\u{fffd}".as_bytes().to_vec() }).collect::<Vec<_>>()).into_owned())),
    })
}
