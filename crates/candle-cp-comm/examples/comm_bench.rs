//! Measures ThreadGroup collective times on CPU and how fast a rank failure propagates.
//!
//! `cargo run --release -p candle-cp-comm --example comm_bench [-- MiB]` (default 4 MiB of
//! f32 per rank). Prints one line per (op, P): median wall time over 10 calls on rank 0.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks, run_ranks_with, Group, ThreadGroupOptions};
use std::time::{Duration, Instant};

/// A collective applied to a rank's group and tensor.
type OpFn<'a> = &'a (dyn Fn(&Group, &Tensor) -> Result<()> + Sync);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median seconds of `op` over 10 calls after 2 warm-ups, measured on rank 0.
fn time_op(p: usize, n: usize, op: impl Fn(&Group, &Tensor) -> Result<()> + Sync) -> Result<f64> {
    let res = run_ranks(p, |g| {
        let x = Tensor::ones(n, DType::F32, &Device::Cpu)?;
        let mut times = vec![];
        for i in 0..12 {
            g.barrier()?;
            let t = Instant::now();
            op(&g, &x)?;
            if i >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        Ok(median(times))
    });
    res.into_iter().next().unwrap_or(Ok(f64::NAN))
}

fn main() -> Result<()> {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let n = mib * (1 << 20) / 4;
    println!("tensor: {mib} MiB f32 per rank ({n} elements)");
    for p in [2, 4, 8] {
        let n = n / p * p;
        let ops: [(&str, OpFn); 6] = [
            ("barrier", &|g, _| g.barrier()),
            ("all_reduce", &|g, x| g.all_reduce(x).map(|_| ())),
            ("reduce_scatter", &|g, x| g.reduce_scatter(x, 0).map(|_| ())),
            ("all_gather", &|g, x| g.all_gather(x, 0).map(|_| ())),
            ("all_to_all", &|g, x| g.all_to_all(x, 0, 0).map(|_| ())),
            ("send_recv", &|g, x| {
                let (r, p) = (g.rank(), g.size());
                g.send_recv(x, (r + 1) % p, (r + p - 1) % p)?
                    .wait()
                    .map(|_| ())
            }),
        ];
        for (name, op) in ops {
            let s = time_op(p, n, op)?;
            println!("P={p} {name:>14}: {:8.3} ms", s * 1e3);
        }
    }
    // baseline: what one all_gather result costs on a single thread (allocation + copy)
    let parts = (0..8)
        .map(|_| Tensor::ones(n, DType::F32, &Device::Cpu))
        .collect::<Result<Vec<_>>>()?;
    let times = (0..10)
        .map(|_| {
            let t = Instant::now();
            Tensor::cat(&parts, 0).map(|_| t.elapsed().as_secs_f64())
        })
        .collect::<Result<Vec<_>>>()?;
    println!(
        "baseline: one Tensor::cat of 8 tensors on one thread: {:.3} ms",
        median(times) * 1e3
    );
    // failure propagation: rank 0 fails while the others wait in a collective
    for p in [2, 8] {
        let opts = ThreadGroupOptions::with_timeout(Duration::from_secs(30));
        let res = run_ranks_with(p, opts, |g| {
            if g.rank() == 0 {
                std::thread::sleep(Duration::from_millis(50));
                candle_core::bail!("injected failure")
            }
            let t = Instant::now();
            let r = g.barrier();
            Ok((r.is_err(), t.elapsed().as_secs_f64() - 0.05))
        });
        let lat: Vec<f64> = res
            .into_iter()
            .flatten()
            .filter(|(e, _)| *e)
            .map(|(_, s)| s)
            .collect();
        let worst = lat.iter().cloned().fold(0.0, f64::max);
        println!(
            "P={p} failure seen by {} ranks, worst extra latency {:.2} ms",
            lat.len(),
            worst * 1e3
        );
    }
    Ok(())
}
