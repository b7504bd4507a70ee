//! A process reward model as a judge of completions (PRM-weighted best-of-N, Lightman et al.
//! 2023; Math-Shepherd's verification): each `prompt ++ completion` split into steps at the
//! separator's tokens, every step's probability of being right (label 1) read at its last
//! token, the probabilities made one reward by a [`StepAggregate`].
//!
//! ```text
//! completion:  3·4 = 12 ⏎ 2 + 12 = 14 ⏎ so 14 <eos>
//! steps:       ........ ^ .......... ^ ....... ^      (each separator's last token; the
//! P(right):           0.97         0.08      0.11      completion's last token ends the last
//! min 0.08, last 0.11, prod 0.0085                      step that has no separator)
//! ```

use super::*;

/// How a completion's steps' probabilities of being right make its reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepAggregate {
    /// The least likely step (a chain is as right as its weakest step).
    Min,
    /// The last step's (the outcome as the PRM sees it).
    Last,
    /// Their product (every step right).
    Prod,
}

impl std::str::FromStr for StepAggregate {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "min" => Ok(Self::Min),
            "last" => Ok(Self::Last),
            "prod" => Ok(Self::Prod),
            other => bail!("step aggregate {other:?}: expected min, last or prod"),
        }
    }
}

impl StepAggregate {
    /// The reward of a completion whose steps are right with probabilities `p` (at least one).
    pub fn of(self, p: &[f64]) -> f64 {
        match self {
            Self::Min => p.iter().copied().fold(f64::INFINITY, f64::min),
            Self::Last => p.last().copied().unwrap_or(f64::NAN),
            Self::Prod => p.iter().product(),
        }
    }
}

/// The index in `completion` of each step's last token: each occurrence of `separator`'s last
/// token (occurrences not overlapping, left to right), and the completion's last token when it
/// does not end one. Empty for an empty completion.
pub fn step_ends(completion: &[u32], separator: &[u32]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut i = 0;
    while !separator.is_empty() && i + separator.len() <= completion.len() {
        if completion[i..i + separator.len()] == *separator {
            ends.push(i + separator.len() - 1);
            i += separator.len();
        } else {
            i += 1;
        }
    }
    if !completion.is_empty() && ends.last() != Some(&(completion.len() - 1)) {
        ends.push(completion.len() - 1);
    }
    ends
}

/// Every `prompt ++ completion`'s reward under process reward model `prm` (a token classifier
/// of at least 2 labels): its completion's steps ([`step_ends`] of `separator`), each step's
/// probability of label 1 ([`step_probabilities`], every document as alone), made one by
/// `aggregate`. `batch` rows of `seq_len` per forward (at least the longest document); the
/// same on every rank. Errors for an empty completion. Collective over the world.
pub fn completion_rewards(prm: &Llama, docs: &[(&[u32], &[u32])], separator: &[u32], aggregate: StepAggregate, batch: usize, seq_len: usize, dev: &Device) -> Result<Vec<f64>> {
    let c = prm.config();
    if c.token_classifier.is_none() || c.num_labels.unwrap_or(0) < 2 {
        bail!("completion_rewards: {} ({:?} labels) is not a process reward model (a token classifier of 2 labels or more)", c.hf_class(), c.num_labels)
    }
    if separator.is_empty() {
        bail!("completion_rewards: the step separator has no token")
    }
    let mut examples = Vec::with_capacity(docs.len());
    for (i, (p, comp)) in docs.iter().enumerate() {
        if comp.is_empty() {
            bail!("completion_rewards: completion {i} is empty: no step to judge")
        }
        if p.len() + comp.len() > seq_len {
            bail!("completion_rewards: document {i} has {} tokens, rows hold {seq_len}", p.len() + comp.len())
        }
        let mut labels = vec![IGNORE; p.len() + comp.len()];
        for e in step_ends(comp, separator) {
            labels[p.len() + e] = 0;
        }
        examples.push((p.iter().chain(comp.iter()).copied().collect(), labels));
    }
    let set = StepSet::from_examples(examples)?;
    let probs = step_probabilities(prm, &set, batch, seq_len, dev)?;
    Ok(probs.iter().map(|steps| aggregate.of(&steps.iter().map(|s| s[1]).collect::<Vec<_>>())).collect())
}
