//! Context-parallel attention benchmark on CPU thread ranks.
//!
//! For each global length T and each number of ranks P: runs the causal forward and backward
//! ring (contiguous, zigzag, striped) and the all-gather-KV forward on P thread ranks, and
//! the single-device kernel (`attention_fwd` + `attention_bwd`) as the baseline. Prints a
//! markdown table:
//! - per-rank compute time (sum over ring steps of the time spent in attention blocks),
//! - exposed communication per step (time blocked in `PendingRecv::wait`, mean over steps),
//! - imbalance: measured (max/mean of per-rank compute) and exact (visible pairs, from
//!   `cp::balance`),
//! - peak activation memory per rank: a counting global allocator records the peak of live
//!   heap bytes in the process; before the timed call every rank has allocated its inputs
//!   (q, k, v, dout), rank 0 resets the peak to the current live bytes, and after the call
//!   `(peak − live_at_reset) / P` is the per-rank peak (thread ranks share one heap, so this is
//!   the mean over ranks of simultaneous peaks). Same measure for the single device (P = 1).
//! - zigzag: per-rank visible (q, k) pairs against the ideal T²/(2P).
//!
//! Run: `cargo run --release -p candle-cp-examples --example bench_cp -- --t 8192,16384 --p 1,2,4`
//!
//! The counting allocator is a process-wide static by necessity (`#[global_allocator]`); it is
//! measurement scaffolding for this binary only.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::attention::{attention_bwd, attention_fwd, Mask};
use candle_cp_ops::cp::{allgather_attention_stats, balance, ring_attention_bwd_raw, ring_attention_fwd_raw, CpOpts, Layout, RingStats};
use clap::Parser;
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: AllocLayout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: AllocLayout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn reset_peak() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

#[derive(Parser)]
#[command(about = "Context-parallel attention benchmark (CPU thread ranks)")]
struct Args {
    /// Global sequence lengths.
    #[arg(long, value_delimiter = ',', default_values_t = vec![8192usize, 16384])]
    t: Vec<usize>,
    /// Numbers of ranks.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2, 4])]
    p: Vec<usize>,
    /// Layouts (contiguous, zigzag, striped, allgather).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["contiguous".to_string(), "zigzag".into(), "striped".into(), "allgather".into()])]
    layouts: Vec<String>,
    /// Query heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// KV heads.
    #[arg(long, default_value_t = 1)]
    kv_heads: usize,
    /// Head dim.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Also run the backward ring.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    bwd: bool,
    /// Skip backward above this T (backward is ~2.5x the forward).
    #[arg(long, default_value_t = 16384)]
    bwd_max_t: usize,
}

struct RankOut {
    fwd: RingStats,
    bwd: Option<RingStats>,
}

struct Row {
    wall_fwd: Duration,
    wall_bwd: Option<Duration>,
    ranks: Vec<RankOut>,
    peak_per_rank: usize,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn run_single(t: usize, a: &Args, bwd: bool) -> Result<(Duration, Option<Duration>, usize)> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (1, t, a.heads, a.dim), &dev)?;
    let k = Tensor::randn(0f32, 1., (1, t, a.kv_heads, a.dim), &dev)?;
    let v = Tensor::randn(0f32, 1., (1, t, a.kv_heads, a.dim), &dev)?;
    let dout = Tensor::randn(0f32, 1., (1, t, a.heads, a.dim), &dev)?;
    let scale = 1.0 / (a.dim as f64).sqrt();
    let base = reset_peak();
    let t0 = Instant::now();
    let (out, lse) = attention_fwd(&q, &k, &v, &Mask::causal(), scale)?;
    let wf = t0.elapsed();
    let wb = if bwd {
        let t1 = Instant::now();
        let g = attention_bwd(&q, &k, &v, &out, &lse, &dout, &Mask::causal(), scale)?;
        let wb = t1.elapsed();
        drop(g);
        Some(wb)
    } else {
        None
    };
    Ok((wf, wb, PEAK.load(Ordering::Relaxed) - base))
}

fn run_cp(t: usize, p: usize, layout: &str, a: &Args, bwd: bool) -> Result<Row> {
    let allgather = layout == "allgather";
    let lay: Layout = if allgather { Layout::Zigzag } else { layout.parse()? };
    let opts = CpOpts::new(lay, true);
    let tl = lay.local_len(t, p)?;
    let base = AtomicUsize::new(0);
    let walls = std::sync::Mutex::new((Duration::ZERO, None));
    let res = run_ranks(p, |g: Group| {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (1, tl, a.heads, a.dim), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, tl, a.kv_heads, a.dim), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, tl, a.kv_heads, a.dim), &dev)?;
        let dout = Tensor::randn(0f32, 1., (1, tl, a.heads, a.dim), &dev)?;
        g.barrier()?;
        if g.rank() == 0 {
            base.store(reset_peak(), Ordering::Relaxed);
        }
        g.barrier()?;
        let t0 = Instant::now();
        let (out, lse, fwd) = if allgather {
            allgather_attention_stats(&q, &k, &v, &g, &opts)?
        } else {
            ring_attention_fwd_raw(&q, &k, &v, &g, &opts)?
        };
        g.barrier()?;
        let wf = t0.elapsed();
        let bwd = if bwd && !allgather {
            let t1 = Instant::now();
            let (dq, dk, dv, st) = ring_attention_bwd_raw(&q, &k, &v, &out, &lse, &dout, &g, &opts)?;
            g.barrier()?;
            drop((dq, dk, dv));
            if g.rank() == 0 {
                if let Ok(mut w) = walls.lock() {
                    w.1 = Some(t1.elapsed());
                }
            }
            Some(st)
        } else {
            None
        };
        if g.rank() == 0 {
            if let Ok(mut w) = walls.lock() {
                w.0 = wf;
            }
        }
        Ok(RankOut { fwd, bwd })
    });
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base.load(Ordering::Relaxed));
    let ranks = res.into_iter().collect::<Result<Vec<_>>>()?;
    let (wall_fwd, wall_bwd) = *walls.lock().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    Ok(Row { wall_fwd, wall_bwd, ranks, peak_per_rank: peak / p })
}

fn imbalance(xs: &[f64]) -> f64 {
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    xs.iter().cloned().fold(0.0, f64::max) / mean
}

fn main() -> Result<()> {
    let a = Args::parse();
    println!(
        "B=1 H={} Hkv={} D={} f32 causal, rayon threads {} (shared by all thread ranks)\n",
        a.heads,
        a.kv_heads,
        a.dim,
        rayon_threads()
    );
    println!("| T | layout | P | fwd wall ms | fwd compute ms/rank (min–max) | fwd exposed comm ms/step | bwd wall ms | bwd compute ms/rank (min–max) | bwd exposed comm ms/step | imbalance measured / exact | peak MiB/rank | peak vs single | zigzag pairs/rank vs T²/2P |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &t in &a.t {
        let bwd = a.bwd && t <= a.bwd_max_t;
        let (wf, wb, peak1) = run_single(t, &a, bwd)?;
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        println!(
            "| {t} | single device | 1 | {:.0} | {:.0} | – | {} | {} | – | 1.00 | {:.1} | 1.00 | – |",
            ms(wf),
            ms(wf),
            wb.map(|d| format!("{:.0}", ms(d))).unwrap_or("–".into()),
            wb.map(|d| format!("{:.0}", ms(d))).unwrap_or("–".into()),
            mib(peak1)
        );
        for &p in &a.p {
            for layout in &a.layouts {
                let row = match run_cp(t, p, layout, &a, bwd) {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("T={t} P={p} {layout}: {e}");
                        continue;
                    }
                };
                let comp = |f: &dyn Fn(&RankOut) -> Option<&RingStats>| -> Option<(f64, f64, f64, f64)> {
                    let cs: Vec<f64> = row.ranks.iter().filter_map(f).map(|s| ms(s.compute())).collect();
                    if cs.is_empty() {
                        return None;
                    }
                    let steps: Vec<f64> = row.ranks.iter().filter_map(f).flat_map(|s| s.steps.iter().map(|x| ms(x.wait))).collect();
                    let wait = steps.iter().sum::<f64>() / steps.len().max(1) as f64;
                    Some((cs.iter().cloned().fold(f64::MAX, f64::min), cs.iter().cloned().fold(0.0, f64::max), wait, imbalance(&cs)))
                };
                let f = comp(&|r: &RankOut| Some(&r.fwd));
                let b = comp(&|r: &RankOut| r.bwd.as_ref());
                let lay: Layout = if layout == "allgather" { Layout::Zigzag } else { layout.parse()? };
                let rep = balance(lay, p, t, true)?;
                let zz = if lay == Layout::Zigzag {
                    format!("{:.4}×", rep.pairs.iter().cloned().max().unwrap_or(0) as f64 / rep.ideal())
                } else {
                    "–".into()
                };
                let fmt3 = |x: Option<(f64, f64, f64, f64)>| match x {
                    Some((lo, hi, w, _)) => (format!("{lo:.0}–{hi:.0}"), format!("{w:.1}")),
                    None => ("–".into(), "–".into()),
                };
                let (fc, fw) = fmt3(f);
                let (bc, bw) = fmt3(b);
                println!(
                    "| {t} | {layout} | {p} | {:.0} | {fc} | {fw} | {} | {bc} | {bw} | {:.2} / {:.3} | {:.1} | {:.3} (1/P = {:.3}) | {zz} |",
                    ms(row.wall_fwd),
                    row.wall_bwd.map(|d| format!("{:.0}", ms(d))).unwrap_or("–".into()),
                    f.map(|x| x.3).unwrap_or(1.0),
                    rep.imbalance(),
                    mib(row.peak_per_rank),
                    row.peak_per_rank as f64 / peak1 as f64,
                    1.0 / p as f64
                );
            }
        }
    }
    let _ = DType::F32;
    Ok(())
}

fn rayon_threads() -> String {
    std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| format!("default ({} cpus)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)))
}
