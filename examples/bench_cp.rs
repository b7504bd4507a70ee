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

use candle_core::{Device, Result, Tensor};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::attention::{attention_bwd, attention_fwd, Mask};
use candle_cp_ops::cp::{
    allgather_attention_bwd_raw, allgather_attention_stats, balance, ring_attention_bwd_raw,
    ring_attention_fwd_raw, CpOpts, Layout, RingStats,
};
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
    /// Overlap the next K/V transfer with the current block (false: wait first).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    overlap: bool,
    /// Rayon threads per rank (each rank computes in its own pool; the single-device
    /// baseline uses one pool of this size).
    #[arg(long, default_value_t = 1)]
    rank_threads: usize,
    /// Skip backward above this T (backward is ~2.5x the forward).
    #[arg(long, default_value_t = 16384)]
    bwd_max_t: usize,
}

/// CPU time (ns) this thread has run, from `/proc/thread-self/schedstat` (Linux).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(0)
}

/// Total CPU time (ns) of a pool's threads.
fn pool_cpu_ns(pool: &rayon::ThreadPool) -> u64 {
    pool.broadcast(|_| thread_cpu_ns()).iter().sum()
}

fn pool(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| candle_core::Error::Msg(e.to_string()))
}

struct RankOut {
    fwd: RingStats,
    bwd: Option<RingStats>,
    fwd_cpu: Duration,
    bwd_cpu: Option<Duration>,
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

struct Single {
    wall_fwd: Duration,
    wall_bwd: Option<Duration>,
    cpu_fwd: Duration,
    cpu_bwd: Option<Duration>,
    peak: usize,
}

fn run_single(t: usize, a: &Args, bwd: bool) -> Result<Single> {
    let dev = Device::Cpu;
    let pool = pool(a.rank_threads)?;
    let q = Tensor::randn(0f32, 1., (1, t, a.heads, a.dim), &dev)?;
    let k = Tensor::randn(0f32, 1., (1, t, a.kv_heads, a.dim), &dev)?;
    let v = Tensor::randn(0f32, 1., (1, t, a.kv_heads, a.dim), &dev)?;
    let dout = Tensor::randn(0f32, 1., (1, t, a.heads, a.dim), &dev)?;
    let scale = 1.0 / (a.dim as f64).sqrt();
    let base = reset_peak();
    let c0 = pool_cpu_ns(&pool);
    let t0 = Instant::now();
    let (out, lse) = pool.install(|| attention_fwd(&q, &k, &v, &Mask::causal(), scale))?;
    let wall_fwd = t0.elapsed();
    let c1 = pool_cpu_ns(&pool);
    let (wall_bwd, cpu_bwd) = if bwd {
        let t1 = Instant::now();
        let g =
            pool.install(|| attention_bwd(&q, &k, &v, &out, &lse, &dout, &Mask::causal(), scale))?;
        let wb = t1.elapsed();
        drop(g);
        (
            Some(wb),
            Some(Duration::from_nanos(pool_cpu_ns(&pool) - c1)),
        )
    } else {
        (None, None)
    };
    let peak = PEAK.load(Ordering::Relaxed) - base;
    Ok(Single {
        wall_fwd,
        wall_bwd,
        cpu_fwd: Duration::from_nanos(c1 - c0),
        cpu_bwd,
        peak,
    })
}

fn run_cp(t: usize, p: usize, layout: &str, a: &Args, bwd: bool) -> Result<Row> {
    let allgather = layout == "allgather";
    let lay: Layout = if allgather {
        Layout::Zigzag
    } else {
        layout.parse()?
    };
    let opts = CpOpts {
        overlap: a.overlap,
        ..CpOpts::new(lay, true)
    };
    let tl = lay.local_len(t, p)?;
    let base = AtomicUsize::new(0);
    let walls = std::sync::Mutex::new((Duration::ZERO, None));
    let res = run_ranks(p, |g: Group| {
        let dev = Device::Cpu;
        let pool = pool(a.rank_threads)?;
        let q = Tensor::randn(0f32, 1., (1, tl, a.heads, a.dim), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, tl, a.kv_heads, a.dim), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, tl, a.kv_heads, a.dim), &dev)?;
        let dout = Tensor::randn(0f32, 1., (1, tl, a.heads, a.dim), &dev)?;
        g.barrier()?;
        if g.rank() == 0 {
            base.store(reset_peak(), Ordering::Relaxed);
        }
        g.barrier()?;
        let c0 = pool_cpu_ns(&pool);
        let t0 = Instant::now();
        let (out, lse, fwd) = pool.install(|| {
            if allgather {
                allgather_attention_stats(&q, &k, &v, &g, &opts)
            } else {
                ring_attention_fwd_raw(&q, &k, &v, &g, &opts)
            }
        })?;
        let fwd_cpu = Duration::from_nanos(pool_cpu_ns(&pool) - c0);
        g.barrier()?;
        let wf = t0.elapsed();
        let (bwd, bwd_cpu) = if bwd {
            let c1 = pool_cpu_ns(&pool);
            let t1 = Instant::now();
            let (dq, dk, dv, st) = pool.install(|| {
                if allgather {
                    allgather_attention_bwd_raw(&q, &k, &v, &out, &lse, &dout, &g, &opts)
                } else {
                    ring_attention_bwd_raw(&q, &k, &v, &out, &lse, &dout, &g, &opts)
                }
            })?;
            let cpu = Duration::from_nanos(pool_cpu_ns(&pool) - c1);
            g.barrier()?;
            drop((dq, dk, dv));
            if g.rank() == 0 {
                if let Ok(mut w) = walls.lock() {
                    w.1 = Some(t1.elapsed());
                }
            }
            (Some(st), Some(cpu))
        } else {
            (None, None)
        };
        if g.rank() == 0 {
            if let Ok(mut w) = walls.lock() {
                w.0 = wf;
            }
        }
        Ok(RankOut {
            fwd,
            bwd,
            fwd_cpu,
            bwd_cpu,
        })
    });
    let peak = PEAK
        .load(Ordering::Relaxed)
        .saturating_sub(base.load(Ordering::Relaxed));
    let ranks = res.into_iter().collect::<Result<Vec<_>>>()?;
    let (wall_fwd, wall_bwd) = *walls
        .lock()
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    Ok(Row {
        wall_fwd,
        wall_bwd,
        ranks,
        peak_per_rank: peak / p,
    })
}

fn imbalance(xs: &[f64]) -> f64 {
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    xs.iter().cloned().fold(0.0, f64::max) / mean
}

fn main() -> Result<()> {
    let a = Args::parse();
    println!(
        "B=1 H={} Hkv={} D={} f32 causal, overlap {}, {} rayon thread(s) per rank, {} cpus\n",
        a.heads,
        a.kv_heads,
        a.dim,
        a.overlap,
        a.rank_threads,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    println!("| T | layout | P | fwd wall ms | fwd CPU ms/rank (min–max) | fwd exposed comm ms/step | bwd wall ms | bwd CPU ms/rank (min–max) | bwd exposed comm ms/step | imbalance CPU fwd+bwd / exact pairs | peak MiB/rank | peak vs single | zigzag pairs/rank ÷ T²/2P |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let opt = |d: Option<Duration>| d.map(|d| format!("{:.0}", ms(d))).unwrap_or("–".into());
    for &t in &a.t {
        let bwd = a.bwd && t <= a.bwd_max_t;
        let s = run_single(t, &a, bwd)?;
        println!(
            "| {t} | single device | 1 | {:.0} | {:.0} | – | {} | {} | – | 1.00 / 1.000 | {:.1} | 1.000 | – |",
            ms(s.wall_fwd),
            ms(s.cpu_fwd),
            opt(s.wall_bwd),
            opt(s.cpu_bwd),
            mib(s.peak)
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
                let range = |xs: &[f64]| {
                    if xs.is_empty() {
                        "–".to_string()
                    } else {
                        format!(
                            "{:.0}–{:.0}",
                            xs.iter().cloned().fold(f64::MAX, f64::min),
                            xs.iter().cloned().fold(0.0, f64::max)
                        )
                    }
                };
                let wait = |f: &dyn Fn(&RankOut) -> Option<&RingStats>| -> String {
                    let w: Vec<f64> = row
                        .ranks
                        .iter()
                        .filter_map(f)
                        .flat_map(|s| s.steps.iter().map(|x| ms(x.wait)))
                        .collect();
                    if w.is_empty() {
                        "–".into()
                    } else {
                        format!("{:.1}", w.iter().sum::<f64>() / w.len() as f64)
                    }
                };
                let fc: Vec<f64> = row.ranks.iter().map(|r| ms(r.fwd_cpu)).collect();
                let bc: Vec<f64> = row.ranks.iter().filter_map(|r| r.bwd_cpu.map(ms)).collect();
                let tot: Vec<f64> = row
                    .ranks
                    .iter()
                    .map(|r| ms(r.fwd_cpu) + r.bwd_cpu.map(ms).unwrap_or(0.0))
                    .collect();
                let lay: Layout = if layout == "allgather" {
                    Layout::Zigzag
                } else {
                    layout.parse()?
                };
                let rep = balance(lay, p, t, true)?;
                let zz = if lay == Layout::Zigzag {
                    format!(
                        "{:.4}",
                        rep.pairs.iter().cloned().max().unwrap_or(0) as f64 / rep.ideal()
                    )
                } else {
                    "–".into()
                };
                println!(
                    "| {t} | {layout} | {p} | {:.0} | {} | {} | {} | {} | {} | {:.2} / {:.3} | {:.1} | {:.3} | {zz} |",
                    ms(row.wall_fwd),
                    range(&fc),
                    wait(&|r: &RankOut| Some(&r.fwd)),
                    opt(row.wall_bwd),
                    range(&bc),
                    wait(&|r: &RankOut| r.bwd.as_ref()),
                    imbalance(&tot),
                    rep.imbalance(),
                    mib(row.peak_per_rank),
                    row.peak_per_rank as f64 / s.peak as f64,
                );
            }
        }
    }
    Ok(())
}
