//! Blockwise attention forward + backward on CPU vs `attention_slow` (plain candle ops).
//!
//! Run: `cargo run --release -p candle-cp-examples --example bench_attention [-- --t 1024,2048] [--no-slow] [--split] [--softcap 50]`
//! (`--split`: also time the raw `attention_fwd` / `attention_bwd` separately; `--softcap C`: the
//! op with Gemma 2's logit soft cap `C` against the uncapped op, alternating pairs.)
//!
//! Shapes: B = 1, H = 8 (Hkv = 8), D = 64, causal, f32; T = 1k, 2k, 4k, 8k by default.
//! CPU time (user + system over all threads, /proc/self/stat, 10 ms ticks) is printed too: on a
//! shared, busy machine wall time is unreliable, CPU time much less so; "CPU/2" is the wall time
//! two fully available cores would give if the work splits evenly (it does: ≥ 8 equal work items).
//! The load average is printed at start and end.
//! Time: median wall-clock of `attention` forward + autograd backward of `sum(out * dout)`.
//! FLOPs (causal fwd + bwd) = 3.5 · (2 · 2 · T² · D · H) / 2 = 7 · T² · D · H: the forward is two
//! T×T×D GEMMs (QKᵀ, PV) at 2 flops per multiply-add, halved by the causal mask, and the
//! backward is 2.5× the forward (recompute QKᵀ, dP = dO Vᵀ, dV, dQ, dK).
//! Peak memory: before each run we reset the kernel's peak-RSS counter (`echo 5 >
//! /proc/self/clear_refs`), then report VmHWM − VmRSS(before), i.e. the extra resident memory
//! the run needed at its peak (inputs excluded).
//! PyTorch reference (issue 2, `scaled_dot_product_attention` fwd+bwd on this kind of machine,
//! 2 cores, quiet): 0.61 s at T = 4096, 2.4 s at T = 8192; at T = 1024/2048 we compare with the
//! time ~100 GFLOP/s would give (the reference's rate), marked "~".

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_cp_ops::attention::{attention, attention_bwd, attention_fwd, attention_slow, Mask, Scores};
use candle_cp_examples::status_kb;
use std::time::Instant;

type AttnFn = fn(&Tensor, &Tensor, &Tensor, &Mask, Scores) -> Result<(Tensor, Tensor)>;

/// Reset VmHWM to the current RSS (Linux >= 4.0); returns the RSS before the run in kB.
fn reset_peak() -> u64 {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    status_kb("VmRSS:").unwrap_or(0)
}

/// CPU time (user + system, all threads) of this process in seconds, from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // fields after the ")" of the command name: state is field 3; utime, stime are 14, 15
    let rest = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

struct Run {
    wall: f64,
    cpu: f64,
    peak_mb: f64,
}

fn run_once(f: AttnFn, q: &Tensor, k: &Tensor, v: &Tensor, dout: &Tensor, scale: Scores) -> Result<Run> {
    let (qv, kv, vv) = (Var::from_tensor(q)?, Var::from_tensor(k)?, Var::from_tensor(v)?);
    let base = reset_peak();
    let c0 = cpu_seconds();
    let t0 = Instant::now();
    let (out, _lse) = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &Mask::causal(), scale)?;
    let grads = (out * dout)?.sum_all()?.backward()?;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - c0;
    let peak_mb = status_kb("VmHWM:").unwrap_or(0).saturating_sub(base) as f64 / 1024.0;
    for x in [&qv, &kv, &vv] {
        if grads.get(x.as_tensor()).is_none() {
            candle_core::bail!("missing gradient")
        }
    }
    Ok(Run { wall, cpu, peak_mb })
}

/// Median wall time, CPU time of that run, max peak over `reps` runs.
fn bench(f: AttnFn, q: &Tensor, k: &Tensor, v: &Tensor, dout: &Tensor, scale: Scores, reps: usize) -> Result<Run> {
    let mut runs = Vec::new();
    for _ in 0..reps {
        runs.push(run_once(f, q, k, v, dout, scale)?);
    }
    let peak_mb = runs.iter().map(|r| r.peak_mb).fold(0.0, f64::max);
    runs.sort_by(|a, b| a.wall.total_cmp(&b.wall));
    let m = &runs[runs.len() / 2];
    Ok(Run { wall: m.wall, cpu: m.cpu, peak_mb })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    candle_cp_examples::check_flags(&args, &["--t", "--softcap"], &["--no-slow", "--split"]).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let ts: Vec<usize> = match args.iter().position(|a| a == "--t") {
        Some(i) => args
            .get(i + 1)
            .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
            .unwrap_or_default(),
        None => vec![1024, 2048, 4096, 8192],
    };
    let (b, h, d) = (1usize, 8usize, 64usize);
    let scale = Scores::new(1.0 / (d as f64).sqrt());
    println!("attention fwd+bwd, CPU, B={b} H={h} D={d} causal f32, rayon threads = {}", rayon_threads());
    let no_slow = args.iter().any(|a| a == "--no-slow");
    println!("load average at start: {}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    println!("| T | ours wall (s) | ours CPU (s) | GFLOP/s (wall) | GFLOP per CPU-s | ours peak MB | slow wall (s) | slow CPU (s) | slow peak MB | slow/ours (CPU) | PyTorch ref (s) | ours/PyTorch (wall) | ours (CPU/2)/PyTorch |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &t in &ts {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev)?;
        let dout = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev)?.to_dtype(DType::F32)?;
        let flops = 7.0 * (t * t * d * h * b) as f64;
        let reps = if t <= 2048 { 5 } else { 3 };
        let _ = run_once(attention, &q, &k, &v, &dout, scale)?; // warm-up
        let r = bench(attention, &q, &k, &v, &dout, scale, reps)?;
        let ours = r.wall;
        // slow: ~14 live [B, H, T, T] f32 tensors; skip above ~8 GB (it also takes > 30 s there).
        let slow_bytes = 14.0 * 4.0 * (b * h * t * t) as f64;
        let (slow_s, slow_mb, ratio) = if no_slow {
            ("not run (--no-slow) | -".to_string(), "-".into(), "-".into())
        } else if slow_bytes <= 8e9 {
            let s = bench(attention_slow, &q, &k, &v, &dout, scale, 1)?;
            (format!("{:.2} | {:.2}", s.wall, s.cpu), format!("{:.0}", s.peak_mb), format!("{:.1}x", s.cpu / r.cpu))
        } else {
            (format!("skipped (~{:.0} GB) | -", slow_bytes / 1e9), "-".into(), "-".into())
        };
        let (ref_s, approx) = match t {
            4096 => (0.61, ""),
            8192 => (2.4, ""),
            _ => (flops / 100e9, "~"),
        };
        println!(
            "| {t} | {ours:.3} | {:.2} | {:.1} | {:.1} | {:.0} | {slow_s} | {slow_mb} | {ratio} | {approx}{ref_s:.3} | {:.2}x | {:.2}x |",
            r.cpu,
            flops / ours / 1e9,
            flops / r.cpu / 1e9,
            r.peak_mb,
            ours / ref_s,
            r.cpu / 2.0 / ref_s
        );
    }
    if args.iter().any(|a| a == "--split") {
        split(&ts, scale.scale)?;
    }
    if let Some(c) = args.iter().position(|a| a == "--softcap").and_then(|i| args.get(i + 1)) {
        let cap: f64 = c.parse().map_err(|e| candle_core::Error::Msg(format!("--softcap {c}: {e}")))?;
        softcap(&ts, scale, cap)?;
    }
    println!("load average at end: {}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    Ok(())
}

/// `--split`: raw `attention_fwd` and `attention_bwd` timed separately (median of 3).
fn split(ts: &[usize], scale: f64) -> Result<()> {
    println!("| T | fwd wall (s) | fwd CPU (s) | fwd GFLOP per CPU-s | bwd wall (s) | bwd CPU (s) | bwd GFLOP per CPU-s |");
    println!("|---|---|---|---|---|---|---|");
    for &t in ts {
        let shape = (1, t, 8, 64);
        let r = || Tensor::randn(0f32, 1.0, shape, &Device::Cpu);
        let (q, k, v, dout) = (r()?, r()?, r()?, r()?);
        let fwd_flops = 2.0 * (t * t * 64 * 8) as f64;
        let mut runs = Vec::new();
        for _ in 0..3 {
            let (c0, t0) = (cpu_seconds(), Instant::now());
            let (out, lse) = attention_fwd(&q, &k, &v, &Mask::causal(), scale)?;
            let (c1, w1) = (cpu_seconds(), t0.elapsed().as_secs_f64());
            let _ = attention_bwd(&q, &k, &v, &out, &lse, &dout, &Mask::causal(), scale)?;
            let (c2, w2) = (cpu_seconds(), t0.elapsed().as_secs_f64());
            runs.push((w1, c1 - c0, w2 - w1, c2 - c1));
        }
        runs.sort_by(|a, b| (a.0 + a.2).total_cmp(&(b.0 + b.2)));
        let (fw, fc, bw, bc) = runs[1];
        println!(
            "| {t} | {fw:.3} | {fc:.2} | {:.1} | {bw:.3} | {bc:.2} | {:.1} |",
            fwd_flops / fc / 1e9,
            2.5 * fwd_flops / bc / 1e9
        );
    }
    Ok(())
}

/// `--softcap C`: `attention` forward + backward (causal, the shapes above) with the logit soft
/// cap `C` against the uncapped op on the same inputs: 5 alternating pairs after a warm-up of
/// each, median CPU times and the median of the pairs' ratios (capped / uncapped).
fn softcap(ts: &[usize], scale: Scores, cap: f64) -> Result<()> {
    let capped = scale.with_softcap(Some(cap));
    println!("| T | uncapped CPU (s) | capped (softcap {cap}) CPU (s) | capped / uncapped (median of 5 pairs) |");
    println!("|---|---|---|---|");
    for &t in ts {
        let r = || Tensor::randn(0f32, 1.0, (1, t, 8, 64), &Device::Cpu);
        let (q, k, v, dout) = (r()?, r()?, r()?, r()?);
        run_once(attention, &q, &k, &v, &dout, scale)?;
        run_once(attention, &q, &k, &v, &dout, capped)?;
        let mut pairs = Vec::new();
        for _ in 0..5 {
            let a = run_once(attention, &q, &k, &v, &dout, scale)?.cpu;
            let b = run_once(attention, &q, &k, &v, &dout, capped)?.cpu;
            pairs.push((a, b));
        }
        let med = |mut x: Vec<f64>| {
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        let ratio = med(pairs.iter().map(|(a, b)| b / a.max(1e-9)).collect());
        let (a, b) = (med(pairs.iter().map(|p| p.0).collect()), med(pairs.iter().map(|p| p.1).collect()));
        println!("| {t} | {a:.2} | {b:.2} | {ratio:.3}x |");
    }
    Ok(())
}

/// Threads of rayon's global pool: `RAYON_NUM_THREADS` if set, else the number of CPUs.
fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}
