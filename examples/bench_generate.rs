//! Prompts of different lengths: one batch (`Llama::generate_ragged`, the prompts padded on
//! the left, the padding masked) against one generation per prompt (`Llama::generate_until`,
//! what GRPO did before), on one device and on a CP layout, in the same process. Checks that
//! both give the same tokens, then prints the wall time of each and their ratio.
//!
//! Run: `cargo run --release --example bench_generate [-- --prompts 16 --min-len 16
//! --max-len 96 --new-tokens 32 --hidden 256 --layers 4 --cp 2 --cp-kind zigzag]`
//!
//! The model is a seeded random Llama (`--hidden`, `--layers`, 8 heads / 2 KV heads, vocab
//! 512); prompt lengths are drawn evenly from `--min-len..=--max-len`; decoding is greedy
//! and runs all `--new-tokens` (no stop). The machine is shared: read the ratio, not the
//! seconds.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_examples::arg;
use candle_cp_llama::params::{init_params, shard_params};
use candle_cp_llama::train::rng::Rng;
use candle_cp_llama::{CpKind, Generation, Layout, Llama, LlamaConfig, ParallelCtx, Sampling};
use candle_nn::VarBuilder;
use std::time::Instant;

/// The tokens of `prompts` on `layout` one prompt at a time and in one batch, with the wall
/// time of each (rank 0's tokens; every rank must agree).
fn both(cfg: &LlamaConfig, layout: Layout, prompts: &[Vec<u32>], new: usize) -> Result<[(f64, Vec<Vec<u32>>); 2]> {
    let res = run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = shard_params(&init_params(cfg, 7, DType::F32, &Device::Cpu)?, cfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), cfg, &ctx)?;
        // (a warm-up call: buffers and thread pools)
        m.generate_ragged(&prompts[..prompts.len().min(2)], 2, Sampling::Greedy, &[])?;
        let t0 = Instant::now();
        let mut alone = Vec::with_capacity(prompts.len());
        for p in prompts {
            let ids = Tensor::new(p.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
            alone.extend(m.generate_until(&ids, new, Sampling::Greedy, &[])?.tokens);
        }
        let t_alone = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let batch: Generation = m.generate_ragged(prompts, new, Sampling::Greedy, &[])?;
        Ok([(t_alone, alone), (t1.elapsed().as_secs_f64(), batch.tokens)])
    });
    let mut out = None;
    for (r, x) in res.into_iter().enumerate() {
        let x = x?;
        match &out {
            None => out = Some(x),
            Some(o) if o[0].1 != x[0].1 || o[1].1 != x[1].1 => bail!("{layout}: rank {r}'s tokens differ from rank 0's"),
            Some(_) => {}
        }
    }
    out.ok_or_else(|| anyhow::anyhow!("no rank"))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    candle_cp_examples::check_flags(&args, &["--prompts", "--min-len", "--max-len", "--new-tokens", "--hidden", "--layers", "--cp", "--cp-kind"], &[])?;
    let n: usize = arg("--prompts", 16)?;
    let (lo, hi): (usize, usize) = (arg("--min-len", 16)?, arg("--max-len", 96)?);
    let new: usize = arg("--new-tokens", 32)?;
    let (hidden, layers): (usize, usize) = (arg("--hidden", 256)?, arg("--layers", 4)?);
    let cp: usize = arg("--cp", 2)?;
    let kind: CpKind = arg::<String>("--cp-kind", "zigzag".into())?.parse()?;
    if n == 0 || lo == 0 || hi < lo || new == 0 {
        bail!("--prompts, --min-len and --new-tokens must be at least 1 and --max-len at least --min-len (got {n}, {lo}..={hi}, {new})")
    }
    let cfg = LlamaConfig::tiny(512, hidden, layers, 8, 2);
    cfg.validate()?;
    let mut rng = Rng::new(11);
    let prompts: Vec<Vec<u32>> = (0..n).map(|_| (0..lo + rng.below(hi - lo + 1)).map(|_| rng.below(512) as u32).collect()).collect();
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    println!("model hidden {hidden}, {layers} layers, 8 heads / 2 KV, vocab 512; {n} prompts of {lo}..={hi} tokens ({tokens} in all), {new} new tokens each, greedy");
    println!("{:<28} {:>12} {:>12} {:>8}", "layout", "one by one", "one batch", "ratio");
    for layout in [Layout::single(), Layout::cp(kind, cp)] {
        let [(ta, alone), (tb, batch)] = both(&cfg, layout, &prompts, new)?;
        // the batch must give each prompt's own tokens (greedy; a near tie could part them)
        let same = alone.iter().zip(&batch).filter(|(a, b)| a == b).count();
        println!("{:<28} {:>10.2} s {:>10.2} s {:>7.2}x   ({same}/{n} rows the same tokens)", layout.to_string(), ta, tb, ta / tb);
    }
    Ok(())
}
