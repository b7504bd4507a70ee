//! Masked context-parallel attention benchmark (packed documents, sliding window) on CPU
//! thread ranks.
//!
//! The masked run packs documents of about `--doc-len` tokens into the global sequence of `T`
//! tokens (the first one shorter, so no boundary falls on a chunk edge; `--doc-len 0`: one
//! document) and/or applies a causal sliding window of `--window` keys. For each layout the
//! causal forward and backward ring (all-gather KV: its forward and backward) run on `P`
//! thread ranks twice: masked and, as the baseline measured in the same run, with the plain
//! causal mask. Prints per layout: the busiest rank's visible (q, k) pairs (`balance_mask`),
//! the busiest rank's attention compute time (sum of its ring steps' compute, forward +
//! backward), their masked / plain ratios, the attention calls and the bytes one rank sends in
//! the forward (the ring stops early when no rank needs the later steps); then the layout
//! [`best_layout`] picks for this mask. Blocks the mask hides are skipped, so the time should
//! follow the pairs, not `T²`. With `--window`, then: the autograd `ring_attention` (forward +
//! backward) with the halo exchange against the ring, zigzag and contiguous, in the same run.
//!
//! Run: `cargo run --release -p candle-cp-examples --example bench_masks -- --t 16384 --p 4 --doc-len 1024`
//! (`--doc-len 0 --window 2048`: a sliding window alone)

use candle_core::{Device, Result, Tensor};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::cp::{
    allgather_attention_bwd_raw, allgather_attention_stats, balance_mask, best_layout, ring_attention_bwd_raw, ring_attention_fwd_raw, CpOpts, Layout,
    MaskSpec, RingStats,
};
use candle_cp_ops::packing::Documents;
use clap::Parser;
use std::time::Duration;

#[derive(Parser)]
#[command(about = "Masked CP attention benchmark (packed documents, sliding window) on CPU thread ranks")]
struct Args {
    /// Global sequence length T.
    #[arg(long, default_value_t = 16384)]
    t: usize,
    /// Number of ranks.
    #[arg(long, default_value_t = 4)]
    p: usize,
    /// Typical document length (the first document is about half of it); 0: one document.
    #[arg(long, default_value_t = 1024)]
    doc_len: usize,
    /// Causal sliding window (keys), none by default.
    #[arg(long)]
    window: Option<usize>,
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
}

/// Documents of `len` tokens after a first one of `len/2 + 7`, the last one cut to fit `t`.
fn documents(t: usize, len: usize) -> Result<Documents> {
    let mut lens = vec![(len / 2 + 7).min(t)];
    let mut used = lens[0];
    while used < t {
        let l = len.min(t - used);
        lens.push(l);
        used += l;
    }
    Documents::from_lengths(&lens)
}

/// Per rank: (forward + backward compute, attention calls, forward bytes sent).
fn run(a: &Args, layout: &str, docs: Option<&Documents>, window: Option<usize>) -> Result<Vec<(Duration, usize, u64)>> {
    let allgather = layout == "allgather";
    let lay: Layout = if allgather { Layout::Zigzag } else { layout.parse()? };
    let mut opts = CpOpts::new(lay, true);
    opts.documents = docs.cloned();
    opts.window = window;
    let tl = lay.local_len(a.t, a.p)?;
    let res = run_ranks(a.p, |g: Group| {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (1, tl, a.heads, a.dim), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, tl, a.kv_heads, a.dim), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, tl, a.kv_heads, a.dim), &dev)?;
        let dout = Tensor::randn(0f32, 1., (1, tl, a.heads, a.dim), &dev)?;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let (f, b): (RingStats, RingStats) = pool.install(|| -> Result<_> {
            if allgather {
                let (out, lse, f) = allgather_attention_stats(&q, &k, &v, &g, &opts)?;
                let (.., b) = allgather_attention_bwd_raw(&q, &k, &v, &out, &lse, &dout, &g, &opts)?;
                Ok((f, b))
            } else {
                let (out, lse, f) = ring_attention_fwd_raw(&q, &k, &v, &g, &opts)?;
                let (.., b) = ring_attention_bwd_raw(&q, &k, &v, &out, &lse, &dout, &g, &opts)?;
                Ok((f, b))
            }
        })?;
        let calls = f.steps.iter().map(|s| s.blocks).sum::<usize>();
        Ok((f.compute() + b.compute(), calls, f.bytes_sent))
    });
    res.into_iter().collect()
}

fn main() -> Result<()> {
    let a = Args::parse();
    let docs = if a.doc_len > 0 { Some(documents(a.t, a.doc_len)?) } else { None };
    let doc_note = match &docs {
        Some(d) => format!(
            "{} documents (lengths {}..{})",
            d.count(),
            d.lengths().iter().min().unwrap_or(&0),
            d.lengths().iter().max().unwrap_or(&0)
        ),
        None => "one document".into(),
    };
    let window_note = a.window.map_or("no window".to_string(), |w| format!("window {w}"));
    println!(
        "T={} P={} B=1 H={} Hkv={} D={} f32 causal, masked run: {doc_note}, {window_note}; 1 rayon thread per rank, {} cpus\n",
        a.t,
        a.p,
        a.heads,
        a.kv_heads,
        a.dim,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("| layout | busiest-rank pairs, plain | masked | pairs ratio | busiest-rank compute ms fwd+bwd, plain | masked | time ratio | calls/rank fwd, plain | masked | fwd KiB sent/rank, plain | masked | masked pair imbalance |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let spec = MaskSpec { causal: true, window: a.window, docs: docs.as_ref() };
    for layout in &a.layouts {
        let lay: Layout = if layout == "allgather" { Layout::Zigzag } else { layout.parse()? };
        if lay.local_len(a.t, a.p).is_err() {
            eprintln!("{layout}: T = {} does not split over P = {}", a.t, a.p);
            continue;
        }
        let busiest = |s: MaskSpec| -> Result<u64> { Ok(balance_mask(lay, a.p, a.t, s)?.pairs.into_iter().max().unwrap_or(0)) };
        let (p1, pp) = (busiest(MaskSpec::plain(true))?, busiest(spec)?);
        let imb = balance_mask(lay, a.p, a.t, spec)?.imbalance();
        let base = run(&a, layout, None, None)?;
        let masked = run(&a, layout, docs.as_ref(), a.window)?;
        let max_t = |xs: &[(Duration, usize, u64)]| xs.iter().map(|x| x.0).max().unwrap_or_default();
        let max_c = |xs: &[(Duration, usize, u64)]| xs.iter().map(|x| x.1).max().unwrap_or(0);
        let max_b = |xs: &[(Duration, usize, u64)]| xs.iter().map(|x| x.2).max().unwrap_or(0) as f64 / 1024.0;
        println!(
            "| {layout} | {p1} | {pp} | {:.3} | {:.0} | {:.0} | {:.3} | {} | {} | {:.0} | {:.0} | {imb:.3} |",
            pp as f64 / p1 as f64,
            ms(max_t(&base)),
            ms(max_t(&masked)),
            max_t(&masked).as_secs_f64() / max_t(&base).as_secs_f64(),
            max_c(&base),
            max_c(&masked),
            max_b(&base),
            max_b(&masked),
        );
    }
    let (best, _) = best_layout(a.p, a.t, spec)?;
    println!("\nbest_layout for this mask: {best}");
    if let Some(w) = a.window {
        halo_table(&a, docs.as_ref(), w)?;
    }
    Ok(())
}

/// With a window: the autograd `ring_attention` (forward + backward, wall time of the slowest
/// rank, median of 3 after a warm-up) with the halo exchange (`cp::halo`, the default where the
/// window reaches at most one chunk back) against the ring (`CpOpts::with_halo(false)`) in the
/// same run, zigzag and contiguous.
fn halo_table(a: &Args, docs: Option<&Documents>, w: usize) -> Result<()> {
    println!("\n| layout | halo applies | ring ms fwd+bwd (slowest rank) | halo ms | halo / ring | halo fwd KiB sent/rank (2·(w-1)·Hkv·D·4 per neighbour) |");
    println!("|---|---|---|---|---|---|");
    for lay in [Layout::Zigzag, Layout::Contiguous] {
        if lay.local_len(a.t, a.p).is_err() {
            continue;
        }
        let mut opts = CpOpts::new(lay, true).with_window(w);
        opts.documents = docs.cloned();
        let applies = candle_cp_ops::cp::halo::applies(&opts, a.p, a.t);
        let time = |halo: bool| -> Result<f64> {
            let mut xs = Vec::new();
            for i in 0..4 {
                let o = opts.clone().with_halo(halo);
                let ranks = run_ranks(a.p, |g: Group| one_pass(a, &g, &o));
                let t = ranks.into_iter().collect::<Result<Vec<_>>>()?.into_iter().fold(0f64, f64::max);
                if i > 0 {
                    xs.push(t);
                }
            }
            xs.sort_by(f64::total_cmp);
            Ok(xs[xs.len() / 2])
        };
        let (ring, halo) = (time(false)?, time(true)?);
        let neighbours = if lay == Layout::Zigzag { 2 } else { 1 };
        let kib = if applies { (neighbours * 2 * (w - 1) * a.kv_heads * a.dim * 4) as f64 / 1024.0 } else { f64::NAN };
        println!("| {lay} | {} | {:.1} | {:.1} | {:.3} | {kib:.0} |", if applies { "yes" } else { "no (ring both times)" }, ring * 1e3, halo * 1e3, halo / ring);
    }
    Ok(())
}

/// One rank's autograd `ring_attention` forward and backward (1 rayon thread), seconds.
fn one_pass(a: &Args, g: &Group, opts: &CpOpts) -> Result<f64> {
    let tl = opts.layout.local_len(a.t, a.p)?;
    let dev = Device::Cpu;
    let q = candle_core::Var::randn(0f32, 1., (1, tl, a.heads, a.dim), &dev)?;
    let k = candle_core::Var::randn(0f32, 1., (1, tl, a.kv_heads, a.dim), &dev)?;
    let v = candle_core::Var::randn(0f32, 1., (1, tl, a.kv_heads, a.dim), &dev)?;
    let dout = Tensor::randn(0f32, 1., (1, tl, a.heads, a.dim), &dev)?;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    pool.install(|| {
        let t0 = std::time::Instant::now();
        let (out, _) = candle_cp_ops::cp::ring_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), g, opts)?;
        (out * &dout)?.sum_all()?.backward()?;
        Ok(t0.elapsed().as_secs_f64())
    })
}
