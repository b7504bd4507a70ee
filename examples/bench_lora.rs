//! One adapted projection, forward + backward over a frozen base weight: no adapter (the
//! baseline), LoRA (`y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`), DoRA (`y = x·W'ᵀ`, `W' = m / ‖W + s·B·A‖ ⊙
//! (W + s·B·A)`, candle-cp-nn's `dora`), and both training with dropout 0.1 on the adapter's
//! input (LoRA: `s·(drop(x)·Aᵀ)·Bᵀ`; DoRA: PEFT's `x·Wᵀ + drop(x)·(W' - W)ᵀ`, a second
//! `[out, in]` product), through `ColumnParallelLinear` and `RowParallelLinear` on one rank, in
//! the same process, on the same input.
//!
//! Run: `cargo run --release --example bench_lora [-- --tokens 1024 --hidden 1024 --out 2816 --rank 16 --pairs 5]`
//!
//! Per path and layer: the median wall time of one forward + backward (the adapters' gradients
//! and the input's) over `--pairs` rounds of the three paths (after a warm-up of each). The
//! machine is shared: read the ratios to the baseline, not the seconds. DoRA's output is checked
//! against the merged weight first. (What the graphs keep for the backward is the planner's and
//! `tests/plan_activations.rs`'s business, not a timing run's.)

use anyhow::{bail, Result};
use candle_core::{Device, Module, Tensor, Var};
use candle_cp_examples::arg;
use candle_cp_nn::{ColumnParallelLinear, Lora, RowParallelLinear, Tp};
use std::time::Instant;

/// Which adapter a run puts on the layer.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Base,
    Lora,
    Dora,
    /// LoRA with dropout on its input.
    LoraDrop,
    /// DoRA with dropout on its input.
    DoraDrop,
}

struct Inputs {
    x: Var,
    w: Tensor,
    a: Var,
    b: Var,
    m: Var,
    dy: Tensor,
    scale: f64,
    /// The dropout's token indices (a key set: masks drawn, as in a training forward).
    rows: candle_cp_nn::DropoutRows,
}

/// The adapter of `kind` on `i`'s factors (`None` for the baseline).
fn adapter(i: &Inputs, kind: Kind) -> Result<Option<Lora>> {
    let l = Lora::new(i.a.as_tensor().clone(), i.b.as_tensor().clone(), i.scale)?;
    let drop = |l: Lora| l.with_dropout(0.1, "bench", &i.rows);
    Ok(match kind {
        Kind::Base => None,
        Kind::Lora => Some(l),
        Kind::Dora => Some(l.with_dora(i.m.as_tensor().clone())?),
        Kind::LoraDrop => Some(drop(l)?),
        Kind::DoraDrop => Some(drop(l)?.with_dora(i.m.as_tensor().clone())?),
    })
}

/// One forward + backward of the layer (`row`: row-parallel) with `kind`: (seconds, output).
fn run(i: &Inputs, kind: Kind, row: bool, tp: &Tp) -> Result<(f64, Tensor)> {
    let t0 = Instant::now();
    let y = if row {
        let mut l = RowParallelLinear::from_full(&i.w, None, tp)?;
        if let Some(a) = adapter(i, kind)? {
            l = l.with_lora(a)?;
        }
        l.forward(i.x.as_tensor())?
    } else {
        let l = ColumnParallelLinear::from_full(&i.w, None, tp)?;
        let l = match adapter(i, kind)? {
            Some(a) => l.with_lora(vec![Some(a)])?,
            None => l,
        };
        l.forward(i.x.as_tensor())?
    };
    let g = (&y * &i.dy)?.sum_all()?.backward()?;
    if g.get(i.x.as_tensor()).is_none() {
        bail!("no input gradient")
    }
    Ok((t0.elapsed().as_secs_f64(), y))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    candle_cp_examples::check_flags(&args, &["--tokens", "--hidden", "--out", "--rank", "--pairs"], &[])?;
    let (t, h, o, r, pairs) = (arg("--tokens", 1024usize)?, arg("--hidden", 1024usize)?, arg("--out", 2816usize)?, arg("--rank", 16usize)?, arg("--pairs", 5usize)?);
    let dev = Device::Cpu;
    let tp = candle_cp_comm::run_ranks(1, |g| Ok(Tp::new(g, false))).into_iter().next().ok_or_else(|| anyhow::anyhow!("no rank"))??;
    println!("one projection [{o}, {h}] over {t} tokens, LoRA rank {r} (f32, CPU, one rank), forward + backward");
    for row in [false, true] {
        let w = (Tensor::randn(0f32, 1., (o, h), &dev)? * 0.02)?;
        let (inp, out) = if row { (o, h) } else { (h, o) };
        // (a row-parallel layer maps o features to h: its weight is [h, o])
        let w = if row { w.t()?.contiguous()? } else { w };
        let i = Inputs {
            x: Var::from_tensor(&Tensor::randn(0f32, 1., (1, t, inp), &dev)?)?,
            a: Var::from_tensor(&(Tensor::randn(0f32, 1., (r, inp), &dev)? * (1.0 / (inp as f64).sqrt()))?)?,
            b: Var::from_tensor(&(Tensor::randn(0f32, 1., (out, r), &dev)? * 0.01)?)?,
            m: Var::from_tensor(&(w.sqr()?.sum(1)?.sqrt()? * 1.1)?)?,
            dy: Tensor::randn(0f32, 1., (1, t, out), &dev)?,
            w,
            scale: 2.0,
            rows: candle_cp_nn::DropoutRows::default(),
        };
        let key = candle_cp_nn::DropoutKey { streams: candle_cp_nn::RngStreams::new(1), step: 0, rows: std::sync::Arc::new((0..t as u64).collect()), batch: 1, tc: t };
        i.rows.set(Some(key))?;
        // DoRA's output is the merged weight's
        let (_, y) = run(&i, Kind::Dora, row, &tp)?;
        let merged = candle_cp_nn::dora_merge(&i.w, i.a.as_tensor(), i.b.as_tensor(), i.m.as_tensor(), i.scale)?;
        let want = i.x.as_tensor().broadcast_matmul(&merged.t()?)?;
        let e = ((&y - &want)?.abs()?.max_all()?.to_scalar::<f32>()? / want.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30)) as f64;
        if e > 1e-4 {
            bail!("DoRA's output differs from the merged weight's by {e:.1e} (relative)")
        }
        let kinds = [Kind::Base, Kind::Lora, Kind::Dora, Kind::LoraDrop, Kind::DoraDrop];
        let mut ts = vec![vec![]; kinds.len()];
        for &k in &kinds {
            run(&i, k, row, &tp)?; // warm-up
        }
        for _ in 0..pairs.max(1) {
            for (j, &k) in kinds.iter().enumerate() {
                ts[j].push(run(&i, k, row, &tp)?.0);
            }
        }
        let t0 = median(ts[0].clone());
        let layer = if row { "RowParallelLinear" } else { "ColumnParallelLinear" };
        for (j, name) in ["base (frozen W)", "LoRA", "DoRA", "LoRA dropout", "DoRA dropout"].iter().enumerate() {
            let tj = median(ts[j].clone());
            println!("{layer:21} {name:16}: {:8.1} ms   {:.2}x the base", tj * 1e3, tj / t0);
        }
    }
    Ok(())
}
