//! Helpers shared by the `gpu_check` and `gpu_bench` examples (included with `#[path]`).
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_cp_comm::run_ranks;
use candle_cp_ops::oracle::{AttnCase, AttnOutputs};
use candle_cp_ops::ulysses::{contiguous_shard, ulysses_attention, UlyssesOpts};

/// Deterministic N(0, 1)-ish f32 tensor on the CPU (xorshift + Box-Muller), from `seed`.
pub fn rand_tensor(shape: &[usize], seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2) = (next(), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

fn host(x: &Tensor) -> Result<Vec<f64>> {
    x.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// (max |a - b|, max |b|) with equal values (also equal infinities) counting as 0; NaN
/// anywhere gives NaN. Errors if the shapes differ.
fn diff(a: &Tensor, b: &Tensor) -> Result<(f64, f64)> {
    if a.dims() != b.dims() {
        candle_core::bail!("shape {:?} differs from reference {:?}", a.dims(), b.dims())
    }
    let (a, b) = (host(a)?, host(b)?);
    let (mut e, mut m) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&b) {
        let d = if x == y { 0.0 } else { (x - y).abs() };
        if d.is_nan() {
            return Ok((f64::NAN, m));
        }
        e = e.max(d);
        if y.is_finite() {
            m = m.max(y.abs());
        }
    }
    Ok((e, m))
}

/// `max |a - b|` (any devices and dtypes).
pub fn max_abs(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok(diff(a, b)?.0)
}

/// `max |a - b| / max |b|`.
pub fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (e, m) = diff(a, b)?;
    Ok(if m > 0.0 { e / m } else { e })
}

/// Ulysses attention of an oracle case on `p` virtual ranks (threads; tensors on the case's
/// device): forward + backward of `sum(out * dout)`, shards gathered back to global tensors.
pub fn run_ulysses(case: &AttnCase, p: usize) -> Result<AttnOutputs> {
    let res = run_ranks(p, |g| {
        let r = g.rank();
        let sh = |x: &Tensor| contiguous_shard(x, r, p);
        let q = Var::from_tensor(&sh(&case.q)?)?;
        let k = Var::from_tensor(&sh(&case.k)?)?;
        let v = Var::from_tensor(&sh(&case.v)?)?;
        let dout = sh(&case.dout)?;
        let opts = UlyssesOpts::new(case.causal, case.scale);
        let (out, lse) = ulysses_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &g, &opts)?;
        let grads = (&out * &dout)?.sum_all()?.backward()?;
        let grad = |x: &Var| -> Result<Tensor> {
            grads.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg(format!("rank {r}: missing gradient")))
        };
        Ok([out, lse, grad(&q)?, grad(&k)?, grad(&v)?])
    });
    let mut ranks = Vec::new();
    for (r, x) in res.into_iter().enumerate() {
        ranks.push(x.map_err(|e| candle_core::Error::Msg(format!("rank {r}: {e}")))?);
    }
    let col = |i: usize, dim: usize| -> Result<Tensor> {
        let xs: Vec<Tensor> = ranks.iter().map(|x| x[i].clone()).collect();
        Tensor::cat(&xs, dim)
    };
    Ok(AttnOutputs { out: col(0, 1)?, lse: col(1, 2)?, dq: col(2, 1)?, dk: col(3, 1)?, dv: col(4, 1)? })
}
