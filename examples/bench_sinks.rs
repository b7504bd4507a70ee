//! Attention sinks (gpt-oss, `candle_cp_ops::attention::sinks`) benchmark on CPU thread ranks:
//! the autograd forward + backward of causal attention with sinks against the same attention
//! without them, measured in the same run, on one device (`attention_sinks` vs `attention_with`)
//! and on a zigzag ring of P ranks (`ring_attention` with and without `CpOpts::with_sinks`).
//! The sinks are a correction of each finished row (`apply_sinks`) and one more reduction for
//! their gradient (`sinks_grad`), elementwise ops on `[B, T/P, H]` and `[B, T/P, H, D]`: the
//! ratio says what they cost beside the kernels.
//!
//! Prints the median wall time of `--runs` runs (after one warm-up) and the ratio with / without.
//!
//! Run: `cargo run --release -p candle-cp-examples --example bench_sinks -- --t 4096,8192 --p 1,2,4`

use candle_core::{DType, Result, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::attention::{attention_sinks, attention_with, Mask, RowSums, Sinks};
use candle_cp_ops::cp::{ring_attention, shard, CpOpts, Layout};
use candle_cp_ops::oracle::randn;
use clap::Parser;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Attention with sinks vs without, forward + backward, one device and zigzag rings, CPU")]
struct Args {
    /// Global sequence lengths T.
    #[arg(long, value_delimiter = ',', default_values_t = vec![4096usize, 8192])]
    t: Vec<usize>,
    /// Ranks P (1: the single-device op).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2, 4])]
    p: Vec<usize>,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// KV heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Head dim.
    #[arg(long, default_value_t = 64)]
    d: usize,
    /// Timed runs per case (the median is printed).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// Seconds of one forward + backward of `sum(out · dout)` on `p` ranks of the zigzag ring (one
/// device for `p = 1`), with sinks or without.
fn once(x: &[Tensor; 5], p: usize, with: bool) -> Result<f64> {
    let [q, k, v, dout, z] = x;
    let scale = 1.0 / (q.dim(3)? as f64).sqrt();
    let res = run_ranks(p, |g: Group| {
        let sh = |y: &Tensor| if p == 1 { Ok(y.clone()) } else { shard(y, Layout::Zigzag, g.rank(), p, 1) };
        let [qv, kv, vv] = [q, k, v].map(|y| sh(y).and_then(|s| Var::from_tensor(&s)).expect("shard"));
        let zv = Var::from_tensor(z)?;
        let sinks = Sinks::new(zv.as_tensor())?;
        let d = sh(dout)?;
        g.barrier()?;
        let t0 = Instant::now();
        let out = match (p, with) {
            (1, true) => attention_sinks(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &sinks, &Mask::causal(), scale, RowSums::Output)?.0,
            (1, false) => attention_with(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &Mask::causal(), scale, RowSums::Output)?.0,
            _ => {
                let opts = CpOpts::new(Layout::Zigzag, true).with_sinks(with.then_some(sinks));
                ring_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &g, &opts)?.0
            }
        };
        (out * &d)?.sum_all()?.backward()?;
        g.barrier()?;
        Ok(t0.elapsed().as_secs_f64())
    });
    res.into_iter().try_fold(0f64, |m, r| Ok(m.max(r?)))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let a = Args::parse();
    println!("| T | P | without sinks (s) | with sinks (s) | with / without |");
    println!("|---|---|---|---|---|");
    for &t in &a.t {
        let r = |s: u64, shape: &[usize], sg: f32| randn(s, shape, sg);
        let x = [
            r(1, &[1, t, a.heads, a.d], 1.0)?,
            r(2, &[1, t, a.kv_heads, a.d], 1.0)?,
            r(3, &[1, t, a.kv_heads, a.d], 1.0)?,
            r(4, &[1, t, a.heads, a.d], 1.0)?,
            (r(5, &[a.heads], 1.0)? + (t as f64).ln())?.to_dtype(DType::F32)?,
        ];
        for &p in &a.p {
            once(&x, p, false)?;
            once(&x, p, true)?;
            let (mut without, mut with) = (Vec::new(), Vec::new());
            for _ in 0..a.runs {
                without.push(once(&x, p, false)?);
                with.push(once(&x, p, true)?);
            }
            let (w0, w1) = (median(without), median(with));
            println!("| {t} | {p} | {w0:.3} | {w1:.3} | {:.3} |", w1 / w0);
        }
    }
    Ok(())
}
