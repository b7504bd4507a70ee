//! The experts of a mixture-of-experts layer, forward + backward: the grouped matmul and the
//! combine of `candle_cp_ops::moe` (what Qwen3-MoE's sparse layers run) against the same
//! arithmetic from candle's ops (`grouped_matmul_slow`, `combine_slow`: `narrow` per expert,
//! `cat`, `index_select`, `broadcast_mul`, `sum`), in the same process, on the same routing.
//!
//! Run: `cargo run --release --example bench_moe [-- --tokens 2048 --hidden 512 --experts 16 --top-k 4 --width 256 --pairs 5]`
//!
//! Per path: the median wall time of one forward + backward over `--pairs` alternating runs
//! (after a warm-up of each), and the extra peak resident memory of the path (the kernel's
//! peak-RSS counter reset before it, `echo 5 > /proc/self/clear_refs`). The machine is shared:
//! read the ratio, not the seconds. The two paths' outputs and gradients are compared first.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor, Var};
use candle_cp_ops::moe::{combine, combine_slow, grouped_matmul, grouped_matmul_slow, Routing};
use candle_cp_examples::{arg, status_kb};
use std::time::Instant;

struct Inputs {
    x: Var,
    gate: Var,
    up: Var,
    down: Var,
    w: Var,
    routing: Routing,
    dy: Tensor,
}

/// The experts' SwiGLU on the routed rows and the weighted sum, `[N, h]`, by either path.
fn forward(i: &Inputs, fast: bool) -> Result<Tensor> {
    let r = &i.routing;
    let rows = Tensor::from_vec(r.sorted_tokens(), r.order.len(), i.x.device())?;
    let xs = i.x.as_tensor().index_select(&rows, 0)?;
    let gm = |x: &Tensor, w: &Var| if fast { grouped_matmul(x, w.as_tensor(), &r.counts) } else { grouped_matmul_slow(x, w.as_tensor(), &r.counts) };
    let m = (candle_nn::ops::silu(&gm(&xs, &i.gate)?)? * gm(&xs, &i.up)?)?;
    let ys = gm(&m, &i.down)?;
    Ok(if fast { combine(&ys, i.w.as_tensor(), &r.inverse)? } else { combine_slow(&ys, i.w.as_tensor(), &r.inverse)? })
}

/// One forward + backward: (seconds, extra peak MiB, the gradients).
fn run(i: &Inputs, fast: bool) -> Result<(f64, f64, Vec<Tensor>)> {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = status_kb("VmRSS:").unwrap_or(0);
    let t0 = Instant::now();
    let g = (forward(i, fast)? * &i.dy)?.sum_all()?.backward()?;
    let grads: Vec<Tensor> = [&i.x, &i.gate, &i.up, &i.down, &i.w].iter().map(|v| g.get(v.as_tensor()).cloned().ok_or_else(|| anyhow::anyhow!("no gradient"))).collect::<Result<_>>()?;
    let dt = t0.elapsed().as_secs_f64();
    let peak = status_kb("VmHWM:").unwrap_or(0).saturating_sub(before) as f64 / 1024.0;
    Ok((dt, peak, grads))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    candle_cp_examples::check_flags(&args, &["--tokens", "--hidden", "--experts", "--top-k", "--width", "--pairs"], &[])?;
    let (n, h, e, k, f, pairs) = (arg("--tokens", 2048usize)?, arg("--hidden", 512usize)?, arg("--experts", 16usize)?, arg("--top-k", 4usize)?, arg("--width", 256usize)?, arg("--pairs", 5usize)?);
    let dev = Device::Cpu;
    let probs = candle_nn::ops::softmax_last_dim(&Tensor::randn(0f32, 1., (n, e), &dev)?)?;
    // (the median of 5 calls)
    let mut times = vec![];
    for _ in 0..5 {
        let t0 = Instant::now();
        Routing::top_k(&probs, k)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let route_ms = median(times);
    let routing = Routing::top_k(&probs, k)?;
    let i = Inputs {
        x: Var::from_tensor(&Tensor::randn(0f32, 1., (n, h), &dev)?)?,
        gate: Var::from_tensor(&(Tensor::randn(0f32, 1., (e, f, h), &dev)? * 0.05)?)?,
        up: Var::from_tensor(&(Tensor::randn(0f32, 1., (e, f, h), &dev)? * 0.05)?)?,
        down: Var::from_tensor(&(Tensor::randn(0f32, 1., (e, h, f), &dev)? * 0.05)?)?,
        w: Var::from_tensor(&Tensor::rand(0f32, 1., (n, k), &dev)?)?,
        routing,
        dy: Tensor::randn(0f32, 1., (n, h), &dev)?,
    };
    println!("experts: N {n} tokens, h {h}, E {e} experts of width {f}, top {k} (f32, CPU); routing (host top-K) {route_ms:.1} ms; counts {:?}", i.routing.counts);
    let (_, _, a) = run(&i, true)?;
    let (_, _, b) = run(&i, false)?;
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(&b) {
        let scale = y.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30);
        worst = worst.max((x - y)?.abs()?.max_all()?.to_scalar::<f32>()? / scale);
    }
    if worst > 1e-4 {
        bail!("the grouped path's gradients differ from the reference by {worst:.1e} (relative)")
    }
    let (mut tf, mut ts, mut mf, mut ms) = (vec![], vec![], vec![], vec![]);
    for _ in 0..pairs.max(1) {
        let (t, m, _) = run(&i, true)?;
        tf.push(t);
        mf.push(m);
        let (t, m, _) = run(&i, false)?;
        ts.push(t);
        ms.push(m);
    }
    let (tf, ts, mf, ms) = (median(tf), median(ts), median(mf), median(ms));
    println!("grouped matmul + combine : {:8.1} ms  peak +{:7.1} MiB", tf * 1e3, mf);
    println!("candle ops (reference)   : {:8.1} ms  peak +{:7.1} MiB", ts * 1e3, ms);
    println!("ratio reference / grouped: time {:.2}x, peak memory {:.2}x (gradients agree to {worst:.1e})", ts / tf, ms / mf.max(1e-9));
    Ok(())
}
