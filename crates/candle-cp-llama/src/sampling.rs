//! Choosing the next token from its logits: greedy, or sampled with temperature, top-k and
//! top-p (nucleus) from a seeded generator.
//!
//! Under context parallelism every rank holds bitwise the same logits (the sharded decode
//! merges the same partial results in the same order on every rank), so ranks that start
//! from the same seed draw the same tokens without any communication; a single device with the
//! same seed draws them too.

use crate::train::Rng;
use candle_core::{bail, Result, Tensor};

/// How [`crate::Llama::generate`] picks each token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The argmax of the logits.
    Greedy,
    /// A draw from `softmax(logits / temperature)` restricted to the `top_k` most likely
    /// tokens (`0`: all) and then to the smallest set whose probability reaches `top_p`
    /// (`1.0`: all), renormalised; `seed` starts the generator (one stream for the whole
    /// generation, rows drawn in order).
    Sample {
        /// Softmax temperature (> 0).
        temperature: f64,
        /// Keep the `top_k` most likely tokens (0 = every token).
        top_k: usize,
        /// Keep the most likely tokens up to cumulative probability `top_p` (in (0, 1]).
        top_p: f64,
        /// Seed of the generator.
        seed: u64,
    },
}

impl Sampling {
    /// Check the parameters (temperature > 0, top_p in (0, 1]).
    pub fn check(&self) -> Result<()> {
        if let Sampling::Sample { temperature, top_p, .. } = *self {
            if !(temperature > 0.0 && temperature.is_finite()) {
                bail!("sampling: temperature must be > 0, got {temperature}")
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                bail!("sampling: top_p must be in (0, 1], got {top_p}")
            }
        }
        Ok(())
    }
}

/// The chooser of one generation: the mode and, when sampling, its generator.
pub(crate) struct Sampler {
    mode: Sampling,
    rng: Rng,
}

impl Sampler {
    /// A sampler for `mode` (checked).
    pub(crate) fn new(mode: Sampling) -> Result<Self> {
        mode.check()?;
        let seed = match mode {
            Sampling::Sample { seed, .. } => seed,
            Sampling::Greedy => 0,
        };
        Ok(Self { mode, rng: Rng::new(seed) })
    }

    /// The next token of every row of `logits` f32 `[B, V]`: u32 `[B]`.
    pub(crate) fn next(&mut self, logits: &Tensor) -> Result<Tensor> {
        let Sampling::Sample { temperature, top_k, top_p, .. } = self.mode else {
            return logits.argmax(candle_core::D::Minus1);
        };
        let rows = logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            let u = self.rng.uniform();
            out.push(sample_row(row, temperature, top_k, top_p, u)? as u32);
        }
        Tensor::from_vec(out, rows.len(), logits.device())
    }
}

/// The token drawn from one row of logits with the uniform number `u` in `[0, 1)` (see
/// [`Sampling::Sample`]): the kept tokens (top-k, then the nucleus, ranked by logit, ties the
/// lower token id first) laid out in token-id order over `[0, 1)`, each its renormalised
/// probability wide. Errors on an empty row or
/// non-finite logits.
pub fn sample_row(logits: &[f32], temperature: f64, top_k: usize, top_p: f64, u: f64) -> Result<usize> {
    if logits.is_empty() {
        bail!("sampling: empty logits row")
    }
    if let Some(i) = logits.iter().position(|x| !x.is_finite()) {
        bail!("sampling: logit {i} is {} (of {} logits)", logits[i], logits.len())
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let keep = if top_k == 0 { order.len() } else { top_k.min(order.len()) };
    order.truncate(keep);
    let max = logits[order[0]] as f64;
    let mut probs: Vec<f64> = order.iter().map(|&i| ((logits[i] as f64 - max) / temperature).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    // nucleus: the smallest prefix whose probability reaches top_p
    let mut cum = 0.0;
    let mut n = probs.len();
    for (i, p) in probs.iter().enumerate() {
        cum += p;
        if cum >= top_p {
            n = i + 1;
            break;
        }
    }
    // the kept tokens drawn in token-id order, not by rank: two near-equal logits whose order
    // another layout's rounding swaps then change the draw only where they move the kept set's
    // boundary, or where `u` lies within rounding of a cumulative boundary
    let mut kept: Vec<(usize, f64)> = order[..n].iter().copied().zip(probs[..n].iter().copied()).collect();
    kept.sort_unstable_by_key(|&(i, _)| i);
    let mass: f64 = kept.iter().map(|&(_, p)| p).sum();
    let target = u * mass;
    let mut acc = 0.0;
    for &(i, p) in &kept {
        acc += p;
        if target < acc {
            return Ok(i);
        }
    }
    Ok(kept[kept.len() - 1].0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_reduce_to_argmax() -> Result<()> {
        let row = [0.1f32, 2.0, -1.0, 1.9];
        for u in [0.0, 0.3, 0.999] {
            assert_eq!(sample_row(&row, 1.0, 1, 1.0, u)?, 1); // top-k 1
            assert_eq!(sample_row(&row, 1.0, 0, 1e-9, u)?, 1); // top-p ~0
            assert_eq!(sample_row(&row, 1e-4, 0, 1.0, u)?, 1); // temperature ~0
        }
        Ok(())
    }

    /// Frequencies over many draws follow the renormalised softmax of the kept tokens.
    #[test]
    fn draws_follow_the_distribution() -> Result<()> {
        let row = [1.0f32, 0.0, 2.0, -0.5, 0.5];
        let mut rng = Rng::new(7);
        let n = 40_000;
        for (top_k, top_p) in [(0usize, 1.0f64), (3, 1.0), (0, 0.8)] {
            let mut counts = [0usize; 5];
            for _ in 0..n {
                counts[sample_row(&row, 0.7, top_k, top_p, rng.uniform())?] += 1;
            }
            // expected: softmax(row / 0.7) over the kept set
            let mut order: Vec<usize> = (0..5).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let w: Vec<f64> = order.iter().map(|&i| ((row[i] as f64 - 2.0) / 0.7).exp()).collect();
            let tot: f64 = w.iter().sum();
            let mut keep = if top_k == 0 { 5 } else { top_k };
            let mut cum = 0.0;
            for (i, x) in w.iter().enumerate().take(keep) {
                cum += x / tot;
                if cum >= top_p {
                    keep = i + 1;
                    break;
                }
            }
            let mass: f64 = w[..keep].iter().sum();
            for (rank, &tok) in order.iter().enumerate() {
                let want = if rank < keep { w[rank] / mass } else { 0.0 };
                let got = counts[tok] as f64 / n as f64;
                assert!((got - want).abs() < 0.01, "top_k {top_k} top_p {top_p}: token {tok} freq {got:.4} vs {want:.4}");
            }
        }
        Ok(())
    }

    #[test]
    fn bad_parameters_are_errors() {
        assert!(Sampler::new(Sampling::Sample { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 1 }).is_err());
        assert!(Sampler::new(Sampling::Sample { temperature: 1.0, top_k: 0, top_p: 1.5, seed: 1 }).is_err());
        assert!(sample_row(&[], 1.0, 0, 1.0, 0.5).is_err());
        assert!(sample_row(&[0.0, f32::NAN], 1.0, 0, 1.0, 0.5).is_err());
    }
}
