//! Seeded draws shared by the randomized parity checks: `tests/cp_random.rs`,
//! `tests/llama_random.rs` (through `candle_cp_tests::draws`) and their GPU twin
//! `examples/gpu_check_random.rs` (included there with `#[path]`), so that the CPU test and the
//! GPU section draw the same kinds of configurations.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::train::Rng;
use candle_cp_ops::oracle::{randn, AttnCase, AttnOutputs};

/// The generator of configuration `seed` (its own stream, whatever the other seeds draw).
pub fn rng(seed: u64) -> Rng {
    Rng::derive(0xC0FF_EE00_D1CE_5EED, &[seed])
}

/// The configurations a randomized check draws: `0..default`, or the range that the environment
/// variable `CANDLE_CP_RANDOM_SEEDS` names as `A..B` (to search more seeds than the suite runs,
/// e.g. `CANDLE_CP_RANDOM_SEEDS=400..5000 cargo test --release --test cp_random`). Errors on a
/// value that is not such a range.
pub fn seeds(default: u64) -> Result<std::ops::Range<u64>> {
    let Ok(v) = std::env::var("CANDLE_CP_RANDOM_SEEDS") else { return Ok(0..default) };
    let parsed = v.split_once("..").and_then(|(a, b)| Some((a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?)));
    match parsed {
        Some((a, b)) if a < b => Ok(a..b),
        _ => candle_core::bail!("CANDLE_CP_RANDOM_SEEDS must be a non-empty range A..B, got {v:?}"),
    }
}

/// One of `xs`, uniformly.
pub fn pick<T: Copy>(r: &mut Rng, xs: &[T]) -> T {
    xs[r.below(xs.len())]
}

/// Document lengths summing to `t`: mostly short documents, sometimes length 1, and one
/// document in a fifth of the draws.
pub fn doc_lengths(r: &mut Rng, t: usize) -> Vec<usize> {
    if r.below(5) == 0 {
        return vec![t];
    }
    let mut lens = vec![];
    let mut left = t;
    while left > 0 {
        let l = if r.below(6) == 0 { 1 } else { 1 + r.below(left.min(t / 2 + 1)) }.min(left);
        lens.push(l);
        left -= l;
    }
    lens
}

/// An attention case of N(0, 1) inputs `q, dout [b, t, h, d]`, `k, v [b, t, hkv, d]` on the CPU
/// (seeded from `seed`, each passed through `map`, e.g. a bf16 rounding), scale `1/sqrt(d)`,
/// with an all-zero reference for the caller to fill in.
pub fn random_case(
    name: String,
    seed: u64,
    [b, t, h, hkv, d]: [usize; 5],
    causal: bool,
    map: impl Fn(Tensor) -> Result<Tensor>,
) -> Result<AttnCase> {
    let zero = || Tensor::zeros(1, DType::F32, &Device::Cpu);
    Ok(AttnCase {
        name,
        causal,
        scale: 1.0 / (d as f64).sqrt(),
        sigma: 1.0,
        q: map(randn(4 * seed + 1, &[b, t, h, d], 1.0)?)?,
        k: map(randn(4 * seed + 2, &[b, t, hkv, d], 1.0)?)?,
        v: map(randn(4 * seed + 3, &[b, t, hkv, d], 1.0)?)?,
        dout: map(randn(4 * seed + 4, &[b, t, h, d], 1.0)?)?,
        reference: AttnOutputs { out: zero()?, lse: zero()?, dq: zero()?, dk: zero()?, dv: zero()? },
    })
}
