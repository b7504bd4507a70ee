//! Band-mask attention benchmark (single device, CPU): packed documents as ONE band call
//! (`attention_fwd_band` / `attention_bwd_band`) against the baseline measured in the same run,
//! one call per document (`attention_fwd` / `attention_bwd` on each document's rows, what the
//! CP engines did before bands), and against the plain causal mask over all `T` tokens.
//!
//! For each document length: `T / len` documents of `len` tokens (causal inside each); prints
//! the median wall time of forward and backward (raw, no graph) over `--runs` runs after one
//! warm-up, the band / per-document ratio, and the masked / plain ratio next to the visible
//! pairs ratio (what the time should follow). `--window W` adds a causal sliding window
//! inside the documents (the per-document baseline then takes `Mask::sliding_window(W)`).
//!
//! Run: `cargo run --release -p candle-cp-examples --example bench_band -- --t 8192 --doc-lens 32,128,512,2048`

use candle_core::{Result, Tensor};
use candle_cp_ops::attention::{attention_bwd, attention_bwd_band, attention_fwd, attention_fwd_band, Band, Mask};
use candle_cp_ops::cp::MaskSpec;
use candle_cp_ops::oracle::randn;
use candle_cp_ops::packing::Documents;
use clap::Parser;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Band-mask attention (packed documents in one call) vs one call per document, CPU")]
struct Args {
    /// Sequence length T.
    #[arg(long, default_value_t = 8192)]
    t: usize,
    /// Document lengths to try.
    #[arg(long, value_delimiter = ',', default_values_t = vec![32usize, 128, 512, 2048])]
    doc_lens: Vec<usize>,
    /// Causal sliding window inside each document (none by default).
    #[arg(long)]
    window: Option<usize>,
    /// Query heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// KV heads.
    #[arg(long, default_value_t = 1)]
    kv_heads: usize,
    /// Head dim.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Timed runs per figure (median reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

/// Median wall time in ms of `runs` runs of `f` after one warm-up.
fn median_ms(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut v = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let t0 = Instant::now();
        f()?;
        v.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

fn main() -> Result<()> {
    let a = Args::parse();
    let (t, h, hkv, d) = (a.t, a.heads, a.kv_heads, a.dim);
    let scale = 1.0 / (d as f64).sqrt();
    let q = randn(1, &[1, t, h, d], 1.0)?;
    let k = randn(2, &[1, t, hkv, d], 1.0)?;
    let v = randn(3, &[1, t, hkv, d], 1.0)?;
    let dout = randn(4, &[1, t, h, d], 1.0)?;
    let pos: Vec<usize> = (0..t).collect();
    println!(
        "T={t} B=1 H={h} Hkv={hkv} D={d} f32, causal documents{}, {} rayon threads, median of {} runs",
        a.window.map_or(String::new(), |w| format!(" + window {w}")),
        rayon::current_num_threads(),
        a.runs
    );
    // the dense baseline: plain causal over all T
    let causal = Band::from_positions(&pos, &pos, MaskSpec::plain(true))?;
    let (po, pl) = attention_fwd(&q, &k, &v, &Mask::causal(), scale)?;
    let plain_f = median_ms(a.runs, || attention_fwd(&q, &k, &v, &Mask::causal(), scale).map(|_| ()))?;
    let plain_b = median_ms(a.runs, || attention_bwd(&q, &k, &v, &po, &pl, &dout, &Mask::causal(), scale).map(|_| ()))?;
    println!("plain causal: fwd {plain_f:.1} ms, bwd {plain_b:.1} ms, {} pairs\n", causal.pairs());
    println!("| doc len | docs | band fwd ms | band bwd ms | per-doc fwd ms | per-doc bwd ms | band / per-doc (fwd+bwd) | band / plain (fwd+bwd) | pairs / plain |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for &len in &a.doc_lens {
        let lens: Vec<usize> = (0..t.div_ceil(len)).map(|i| len.min(t - i * len)).collect();
        let docs = Documents::from_lengths(&lens)?;
        let spec = MaskSpec { causal: true, window: a.window, docs: Some(&docs) };
        let band = Band::from_positions(&pos, &pos, spec)?;
        let mask = a.window.map_or(Mask::causal(), Mask::sliding_window);
        let (bo, bl) = attention_fwd_band(&q, &k, &v, &band, scale)?;
        let band_f = median_ms(a.runs, || attention_fwd_band(&q, &k, &v, &band, scale).map(|_| ()))?;
        let band_b = median_ms(a.runs, || attention_bwd_band(&q, &k, &v, &bo, &bl, &dout, &band, scale).map(|_| ()))?;
        let piece = |x: &Tensor, dim: usize, i: usize| -> Result<Tensor> {
            let (s, e) = docs.range(i);
            x.narrow(dim, s, e - s)?.contiguous()
        };
        let mut fwd_out = Vec::new();
        for i in 0..docs.count() {
            fwd_out.push(attention_fwd(&piece(&q, 1, i)?, &piece(&k, 1, i)?, &piece(&v, 1, i)?, &mask, scale)?);
        }
        let doc_f = median_ms(a.runs, || {
            for i in 0..docs.count() {
                attention_fwd(&piece(&q, 1, i)?, &piece(&k, 1, i)?, &piece(&v, 1, i)?, &mask, scale)?;
            }
            Ok(())
        })?;
        let doc_b = median_ms(a.runs, || {
            for (i, (o, l)) in fwd_out.iter().enumerate() {
                attention_bwd(&piece(&q, 1, i)?, &piece(&k, 1, i)?, &piece(&v, 1, i)?, o, l, &piece(&dout, 1, i)?, &mask, scale)?;
            }
            Ok(())
        })?;
        println!(
            "| {len} | {} | {band_f:.1} | {band_b:.1} | {doc_f:.1} | {doc_b:.1} | {:.2} | {:.3} | {:.3} |",
            docs.count(),
            (band_f + band_b) / (doc_f + doc_b),
            (band_f + band_b) / (plain_f + plain_b),
            band.pairs() as f64 / causal.pairs() as f64
        );
    }
    Ok(())
}
