//! Packed-sequence (document mask) benchmark on CPU thread ranks.
//!
//! A global sequence of `T` tokens packs documents of about `--doc-len` tokens (the first one
//! shorter, so no boundary falls on a chunk edge). For each layout the causal forward and
//! backward ring (all-gather KV: its forward and backward) run on `P` thread ranks twice: with
//! the documents and, as the baseline measured in the same run, as one document (the plain
//! causal mask). Prints per layout: the busiest rank's visible (q, k) pairs (`balance_docs`),
//! the busiest rank's attention compute time (sum of its ring steps' compute, forward +
//! backward), their packed / one-document ratios, and the number of attention calls; then the
//! layout [`best_layout`] picks for these documents. A document mask skips every block with
//! no document in common, so the time should follow the pairs, not `T²`.
//!
//! Run: `cargo run --release -p candle-cp-examples --example bench_packed -- --t 16384 --p 4 --doc-len 1024`

use candle_core::{Device, Result, Tensor};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::cp::{
    allgather_attention_bwd_raw, allgather_attention_stats, balance_docs, best_layout, ring_attention_bwd_raw, ring_attention_fwd_raw, CpOpts, Layout,
    MaskSpec, RingStats,
};
use candle_cp_ops::packing::Documents;
use clap::Parser;
use std::time::Duration;

#[derive(Parser)]
#[command(about = "Packed-sequence (document mask) benchmark on CPU thread ranks")]
struct Args {
    /// Global sequence length T.
    #[arg(long, default_value_t = 16384)]
    t: usize,
    /// Number of ranks.
    #[arg(long, default_value_t = 4)]
    p: usize,
    /// Typical document length (the first document is about half of it).
    #[arg(long, default_value_t = 1024)]
    doc_len: usize,
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

/// Per rank: (forward + backward compute, attention calls).
fn run(a: &Args, layout: &str, docs: Option<&Documents>) -> Result<Vec<(Duration, usize)>> {
    let allgather = layout == "allgather";
    let lay: Layout = if allgather { Layout::Zigzag } else { layout.parse()? };
    let mut opts = CpOpts::new(lay, true);
    opts.documents = docs.cloned();
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
        Ok((f.compute() + b.compute(), calls))
    });
    res.into_iter().collect()
}

fn main() -> Result<()> {
    let a = Args::parse();
    let docs = documents(a.t, a.doc_len)?;
    let one = Documents::single(a.t)?;
    println!(
        "T={} P={} B=1 H={} Hkv={} D={} f32 causal, {} documents (lengths {}..{}), 1 rayon thread per rank, {} cpus\n",
        a.t,
        a.p,
        a.heads,
        a.kv_heads,
        a.dim,
        docs.count(),
        docs.lengths().iter().min().unwrap_or(&0),
        docs.lengths().iter().max().unwrap_or(&0),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("| layout | busiest-rank pairs, 1 doc | packed | pairs ratio | busiest-rank compute ms fwd+bwd, 1 doc | packed | time ratio | calls/rank fwd, 1 doc | packed | packed pair imbalance |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for layout in &a.layouts {
        let lay: Layout = if layout == "allgather" { Layout::Zigzag } else { layout.parse()? };
        if lay.local_len(a.t, a.p).is_err() {
            eprintln!("{layout}: T = {} does not split over P = {}", a.t, a.p);
            continue;
        }
        let busiest = |d: &Documents| -> Result<u64> { Ok(balance_docs(lay, a.p, a.t, true, d)?.pairs.into_iter().max().unwrap_or(0)) };
        let (p1, pp) = (busiest(&one)?, busiest(&docs)?);
        let imb = balance_docs(lay, a.p, a.t, true, &docs)?.imbalance();
        let base = run(&a, layout, None)?;
        let packed = run(&a, layout, Some(&docs))?;
        let max_t = |xs: &[(Duration, usize)]| xs.iter().map(|x| x.0).max().unwrap_or_default();
        let max_c = |xs: &[(Duration, usize)]| xs.iter().map(|x| x.1).max().unwrap_or(0);
        println!(
            "| {layout} | {p1} | {pp} | {:.3} | {:.0} | {:.0} | {:.3} | {} | {} | {imb:.3} |",
            pp as f64 / p1 as f64,
            ms(max_t(&base)),
            ms(max_t(&packed)),
            max_t(&packed).as_secs_f64() / max_t(&base).as_secs_f64(),
            max_c(&base),
            max_c(&packed),
        );
    }
    let (best, _) = best_layout(a.p, a.t, MaskSpec { causal: true, window: None, docs: Some(&docs) })?;
    println!("\nbest_layout for these documents: {best}");
    Ok(())
}
