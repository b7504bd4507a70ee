//! GRPO's built-in reward functions ([`crate::train::grpo::RewardFn`]): against a prompt's
//! reference answer (exact match, token accuracy), whether a completion finished, DAPO's soft
//! overlong punishment, an external program's ([`crate::train::reward_command::command`]) and
//! weighted sums of them.

use super::RewardFn;
use std::sync::Arc;

pub use super::super::reward_command::{command, Decode};

/// 1 when the completion is the reference answer token for token, else 0.
pub fn exact_match() -> RewardFn {
    Arc::new(|_, completion, answer| Ok((completion == answer) as u8 as f64))
}

/// `Σ w_k · r_k`: several rewards summed with their weights (TRL's `reward_funcs` with
/// `reward_weights`).
pub fn weighted(parts: Vec<(RewardFn, f64)>) -> RewardFn {
    Arc::new(move |p, c, a| parts.iter().map(|(r, w)| Ok(w * r(p, c, a)?)).sum())
}

/// 1 when the completion ends with one of `stop` (it finished within the length), else 0.
pub fn finished(stop: Vec<u32>) -> RewardFn {
    Arc::new(move |_, c, _| Ok(c.last().is_some_and(|t| stop.contains(t)) as u8 as f64))
}

/// The fraction of the longer of the completion and the answer whose tokens match the
/// answer's position by position (1: the answer exactly; partial credit on the way).
pub fn token_accuracy() -> RewardFn {
    Arc::new(|_, completion, answer| {
        let n = completion.len().max(answer.len()).max(1);
        Ok(completion.iter().zip(answer).filter(|(a, b)| a == b).count() as f64 / n as f64)
    })
}

/// DAPO's soft overlong punishment (TRL's `get_soft_overlong_punishment`): 0 for a completion
/// of at most `max_len − cache` tokens, falling linearly to −1 at `max_len`, −1 past it. With
/// `max_len` the run's `max_completion_length` it punishes the completions that ran into the
/// limit, whatever the other rewards say (a reward model that favours long answers).
pub fn soft_overlong_punishment(max_len: usize, cache: usize) -> RewardFn {
    Arc::new(move |_, c, _| {
        let (n, free) = (c.len(), max_len.saturating_sub(cache));
        Ok(if n <= free {
            0.0
        } else if n <= max_len {
            (free as f64 - n as f64) / cache.max(1) as f64
        } else {
            -1.0
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TRL's values: 0 up to `max − cache`, then `(max − cache − n)/cache`, −1 past `max`.
    #[test]
    fn soft_overlong_punishment_is_trls() -> candle_core::Result<()> {
        let r = soft_overlong_punishment(16, 4);
        let at = |n: usize| r(&[], &vec![7; n], &[]);
        for (n, want) in [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (17, -1.0)] {
            assert_eq!(at(n)?, want, "{n} tokens");
        }
        Ok(())
    }
}
