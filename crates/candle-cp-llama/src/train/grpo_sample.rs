//! GRPO's sampling ([`super::grpo`] has the objective): a step's prompts drawn per
//! micro-batch, their groups sampled in one generation batch ([`Llama::generate_ragged`]) and
//! rewarded, DAPO's dynamic sampling in place of flat groups, the groups packed into each
//! micro-batch's rows.

use super::grpo::{GrpoConfig, PromptSet, Rollout};
use super::reward::RunRewardModel;
use super::rng::Rng;
use crate::sampling::Sampling;
use crate::Llama;
use candle_core::{bail, Result};

/// One prompt's group: its index in the set, its completions and their rewards.
type Group = (usize, Vec<Vec<u32>>, Vec<f64>);

/// The groups of the prompts `picks` (`G` completions each) sampled by `model` as it is in one
/// batch ([`Llama::generate_ragged`]; prompts of different lengths padded on the left) with
/// the generator of (seed, step, round), rewarded (by the reward functions, plus the reward
/// model's weighted scores with `rm`). Collective over the world.
fn sample_groups(model: &Llama, cfg: &GrpoConfig, set: &PromptSet, picks: &[usize], seed: u64, (step, round): (usize, usize), rm: Option<&RunRewardModel>) -> Result<Vec<Group>> {
    let g = cfg.num_generations;
    let prompt = |i: usize| set.get(i).ok_or_else(|| candle_core::Error::Msg(format!("grpo: no prompt {i}")));
    let mut rows = Vec::with_capacity(picks.len() * g);
    for &i in picks {
        rows.extend(std::iter::repeat_n(prompt(i)?.0.to_vec(), g));
    }
    // (round 0's generator is the step's; a dynamic sampling round's its own)
    let key: Vec<u64> = if round == 0 { vec![step as u64] } else { vec![step as u64, round as u64] };
    let sampling = match cfg.sampling {
        Sampling::Sample { temperature, top_k, top_p, seed: s } => Sampling::Sample { temperature, top_k, top_p, seed: Rng::derive(s ^ seed, &key).next_u64() },
        Sampling::Greedy => Sampling::Greedy,
    };
    let tokens = model.generate_ragged(&rows, cfg.max_completion_length, sampling, &cfg.stop)?.tokens;
    // (the reward model's weighted scores of every row at once: one collective pass)
    let scored = match rm {
        Some(m) => {
            if tokens.len() != rows.len() {
                bail!("grpo: generation gave {} rows for the {} asked", tokens.len(), rows.len())
            }
            m.rewards(&rows.iter().zip(&tokens).map(|(p, c)| (p.as_slice(), c.as_slice())).collect::<Vec<_>>())?
        }
        None => vec![0.0; tokens.len()],
    };
    let mut scored = scored.into_iter();
    let mut out = tokens.into_iter();
    let mut groups = Vec::with_capacity(picks.len());
    for (p, &i) in picks.iter().enumerate() {
        let (text, answer) = prompt(i)?;
        let (mut completions, mut rewards) = (Vec::with_capacity(g), Vec::with_capacity(g));
        for k in 0..g {
            let Some(completion) = out.next() else { bail!("grpo: generation gave fewer rows than the {} asked", rows.len()) };
            let r = (cfg.reward)(text, &completion, answer).map_err(|e| candle_core::Error::Msg(format!("grpo: the reward of completion {k} of prompt {i} (step {}, group {p}): {e}", step + 1)))? + scored.next().unwrap_or(0.0);
            if !r.is_finite() {
                bail!("grpo: the reward function gave {r} for completion {k} of prompt {i} (step {}, group {p}): rewards must be finite", step + 1)
            }
            completions.push(completion);
            rewards.push(r);
        }
        groups.push((i, completions, rewards));
    }
    Ok(groups)
}

/// The completions of `step`'s `micro_batches` micro-batches: for each, `cfg.prompts` prompts
/// of `set` drawn from (seed, step, micro) and `G` completions of each sampled by `model` as it
/// is — every micro-batch's prompts in one batch (TRL's generation batch; one generator seeded
/// from (seed, step)) —, rewarded, and packed in order into `batch` rows of `seq_len` per
/// micro-batch. With [`GrpoConfig::dynamic_sampling`], the groups whose rewards are all equal
/// are set aside and newly drawn prompts sampled in their place (at most that many more
/// batches), the batch filled with set-aside groups only when the rounds run out.
/// Collective over the world (generation). Errors when they do not fit.
pub(crate) fn rollouts(model: &Llama, cfg: &GrpoConfig, set: &PromptSet, seed: u64, (step, micro_batches): (usize, usize), (batch, seq_len): (usize, usize), rm: Option<&RunRewardModel>) -> Result<Vec<Rollout>> {
    model.set_lora_dropout(None)?;
    let need = micro_batches * cfg.prompts;
    let mut picks: Vec<usize> = (0..micro_batches)
        .flat_map(|micro| {
            let mut pick = Rng::derive(seed, &[step as u64, micro as u64, 0x6772_706f]);
            (0..cfg.prompts).map(|_| pick.below(set.len())).collect::<Vec<_>>()
        })
        .collect();
    let (mut kept, mut flat): (Vec<Group>, Vec<Group>) = (Vec::new(), Vec::new());
    for round in 0..=cfg.dynamic_sampling {
        for group in sample_groups(model, cfg, set, &picks, seed, (step, round), rm)? {
            let spread = group.2.iter().any(|r| r.to_bits() != group.2[0].to_bits());
            if spread || cfg.dynamic_sampling == 0 {
                kept.push(group);
            } else {
                flat.push(group);
            }
        }
        if kept.len() >= need {
            break;
        }
        // (the next round: as many new prompts as groups missing, rounded up to whole
        // micro-batches of prompts — DP divides their rows — whatever the layout, so that every
        // layout samples the same batches)
        let missing = (need - kept.len()).div_ceil(cfg.prompts) * cfg.prompts;
        let mut pick = Rng::derive(seed, &[step as u64, round as u64 + 1, 0x6472_7073]);
        picks = (0..missing).map(|_| pick.below(set.len())).collect();
    }
    kept.truncate(need);
    let fill = need - kept.len();
    kept.extend(flat.into_iter().take(fill));
    let mut groups = kept.into_iter();
    let mut rollouts = Vec::with_capacity(micro_batches);
    for _ in 0..micro_batches {
        let (mut docs, mut rewards) = (Vec::new(), Vec::new());
        for (i, completions, r) in groups.by_ref().take(cfg.prompts) {
            let prompt = set.get(i).ok_or_else(|| candle_core::Error::Msg(format!("grpo: no prompt {i}")))?.0;
            docs.extend(completions.into_iter().map(|c| (prompt.to_vec(), c)));
            rewards.extend(r);
        }
        rollouts.push(Rollout::packed(docs, rewards, cfg, (batch, seq_len))?);
    }
    Ok(rollouts)
}
