//! LD-DPO (Liu et al. 2024, "Length Desensitization in Direct Preference Optimization"; TRL's
//! `ld_alpha`, [`super::DpoConfig::ld_alpha`]): the policy's log-probability of an answer
//! weighs the tokens past the shorter answer of its pair by α, so that a longer answer's extra
//! tokens move the reward less:
//!
//! ```text
//! answer y: scored tokens y_1 … y_n;  its pair's other answer: n' scored tokens;  l_p = min(n, n')
//! log π_LD(y) = Σ_{k ≤ l_p} log π(y_k)  +  α · Σ_{k > l_p} log π(y_k)
//!
//!   chosen   [ y_1 … y_lp | y_lp+1 … y_n ]      weight 1 | α
//!   rejected [ y_1 … y_lp ]                     (the shorter: all weight 1)
//! ```
//!
//! The pair losses take `log π_LD` of the policy where DPO takes `log π`; the reference's
//! log-probabilities stay plain sums (TRL weighs the policy's only), and so do the objective's
//! cross-entropy terms (RPO's α and an sft entry: [`super::DpoConfig::split_cross_entropy`]),
//! which TRL computes from the logits apart. IPO and SimPO divide the weighted sum by the
//! answer's scored tokens as they divide the plain one.
//!
//! `k` counts an answer's *scored* tokens (its marked targets), never positions in a row: a
//! prompt, a packed row or a CP shard does not move the boundary (the mistake of counting
//! positions was ms-swift's padding-free LD-DPO, fixed in its pull request 10072). Each rank
//! holds the rank `k` of each of its targets ([`DpoBatch`](super::dpo)'s ranks, cut like its
//! labels) and the pair's `l_p`, sums both `log π` and `log π_LD` per answer, and its
//! linearised loss weighs target `t` by `−(∂L/∂log π_LD · f_t + ∂L/∂log π)`, `f_t ∈ {1, α}`.

use super::dpo::{add_rpo, terms, Answers, DpoTerms};
use super::bco::Delta;
use super::DpoConfig;
use candle_core::Result;

/// Per slot of a micro-batch (`answers`: each slot's answer index in the set; `counts`: its
/// scored tokens), `l_p`: the fewer scored tokens of the slot's answer and its pair's other
/// answer (answer `a`'s partner is `a ^ 1`, in the slot beside it); a slot whose partner is not
/// in the micro-batch keeps its own count.
pub(crate) fn public_lengths(answers: &[usize], counts: &[u32]) -> Vec<u32> {
    (0..answers.len())
        .map(|s| {
            let partner = if answers[s].is_multiple_of(2) { s + 1 } else { s.wrapping_sub(1) };
            match answers.get(partner) {
                Some(&b) if b == answers[s] ^ 1 => counts[s].min(counts[partner]),
                _ => counts[s],
            }
        })
        .collect()
}

/// The weight of an answer's scored token of rank `rank` (from 1) under a pair's shared length
/// `public`: 1 within it, α past it.
pub(crate) fn factor(rank: u32, public: u32, alpha: f64) -> f64 {
    if rank <= public {
        1.0
    } else {
        alpha
    }
}

/// The objective's terms with the policy shaped: LD-DPO's pair losses over `ld` (the policy's
/// weighted sums) and WPO's per-pair `weights` ([`super::wpo`]), the cross-entropy terms over
/// `plain` (times the weights' mean with WPO); returns the terms (`d_logp`: ∂/∂ the sums the
/// pair losses took) and ∂/∂ the plain sums. Without either, the objective over `plain` and
/// zeros.
#[allow(clippy::too_many_arguments)]
pub(crate) fn shaped_terms(plain: &[f64], ld: Option<&[f64]>, weights: Option<&[f64]>, answers: &Answers, of: &[usize], pairs: &[(usize, usize)], cfg: &DpoConfig, delta: Option<Delta<'_>>) -> Result<(DpoTerms, Vec<f64>)> {
    let mut d_plain = vec![0.0; plain.len()];
    if ld.is_none() && weights.is_none() {
        return Ok((terms(plain, answers, of, pairs, cfg, delta)?, d_plain));
    }
    let (ce, rest) = cfg.split_cross_entropy();
    let policy = ld.unwrap_or(plain);
    let (mut t, scale) = match weights {
        Some(w) => (super::wpo::weighted_terms(policy, answers, of, pairs, &rest, delta, w)?, w.iter().sum::<f64>() / w.len().max(1) as f64),
        None => (terms(policy, answers, of, pairs, &rest, delta)?, 1.0),
    };
    let lengths: Vec<f64> = of.iter().map(|&a| answers.lengths.get(a).copied().unwrap_or(0.0)).collect();
    add_rpo(plain, &lengths, pairs, ce * scale, &mut t.loss, &mut d_plain);
    Ok((t, d_plain))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_lengths_pair_neighbours_and_factor_cuts_at_them() {
        // slots: pair 0 (answers 0, 1), pair 3 (6, 7), and answer 9 whose partner 8 is elsewhere
        let answers = [0, 1, 6, 7, 9];
        let counts = [5, 3, 2, 4, 6];
        assert_eq!(public_lengths(&answers, &counts), vec![3, 3, 2, 2, 6]);
        let w: Vec<f64> = (1..=5).map(|k| factor(k, 3, 0.25)).collect();
        assert_eq!(w, vec![1.0, 1.0, 1.0, 0.25, 0.25]);
    }
}
