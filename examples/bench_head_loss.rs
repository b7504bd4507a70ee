//! LM head + cross-entropy, forward + backward: the chunked path that never builds the logits
//! (`candle_cp_llama::head_loss::token_nll`, what the trainer uses) against the logits path
//! (`x · Wᵀ` then the fused cross-entropy of `candle_cp_llama::local_nll`, what
//! `Llama::loss` does), in the same process.
//!
//! Run: `cargo run --release --example bench_head_loss [-- --tokens 4096 --hidden 512 --vocab 32000 --dtype f32]`
//!
//! Peak memory: the kernel's peak-RSS counter is reset before each path (`echo 5 >
//! /proc/self/clear_refs`), then VmHWM − VmRSS(before) is the extra resident memory the path
//! needed at its peak (inputs excluded). Time: wall clock of one forward + backward after a
//! warm-up run; the machine is shared, so read the ratio, not the seconds.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_cp_llama::head_loss::{default_chunk_rows, token_nll};
use candle_cp_llama::local_nll;
use candle_cp_examples::{arg, status_kb};
use std::time::Instant;

/// One forward + backward of `path`; (seconds, extra peak MiB, loss).
fn run(path: &str, x: &Var, w: &Var, labels: &Tensor) -> Result<(f64, f64, f32)> {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = status_kb("VmRSS:").unwrap_or(0);
    let t0 = Instant::now();
    let (sum, n) = match path {
        "chunked" => {
            let v = w.dims()[0];
            let nll = token_nll(x.as_tensor(), w.as_tensor(), labels, default_chunk_rows(v), None)?;
            (nll.sum_all()?, labels.dims()[0])
        }
        _ => {
            let logits = x.as_tensor().matmul(&w.as_tensor().t()?)?.unsqueeze(0)?;
            let (terms, n) = local_nll(&logits, &labels.unsqueeze(0)?)?;
            (terms.sum_all()?, n)
        }
    };
    let loss = (sum / n as f64)?;
    let grads = loss.backward()?;
    let gx = grads.get(x.as_tensor()).map(|g| g.sum_all()).transpose()?;
    let gw = grads.get(w.as_tensor()).map(|g| g.sum_all()).transpose()?;
    if gx.is_none() || gw.is_none() {
        bail!("{path}: missing gradients")
    }
    let secs = t0.elapsed().as_secs_f64();
    let peak = status_kb("VmHWM:").unwrap_or(0).saturating_sub(before) as f64 / 1024.0;
    Ok((secs, peak, loss.to_dtype(DType::F32)?.to_scalar::<f32>()?))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    candle_cp_examples::check_flags(&args, &["--tokens", "--hidden", "--vocab", "--dtype"], &[])?;
    let n: usize = arg("--tokens", 4096)?;
    let h: usize = arg("--hidden", 512)?;
    let v: usize = arg("--vocab", 32000)?;
    let dt = match arg::<String>("--dtype", "f32".into())?.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        d => bail!("--dtype {d}: f32 or bf16"),
    };
    let dev = Device::Cpu;
    let x = Var::from_tensor(&candle_cp_ops::oracle::randn(1, &[n, h], 1.0)?.to_dtype(dt)?)?;
    let w = Var::from_tensor(&candle_cp_ops::oracle::randn(2, &[v, h], 0.05)?.to_dtype(dt)?)?;
    let labels: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % v) as u32).collect();
    let labels = Tensor::new(labels, &dev)?;
    println!(
        "head + cross-entropy fwd+bwd: {n} tokens, hidden {h}, vocab {v}, {dt:?}; logits [{n}, {v}] f32 = {:.0} MiB; chunk {} rows",
        (n * v * 4) as f64 / 1048576.0,
        default_chunk_rows(v)
    );
    let mut res = vec![];
    for path in ["logits", "chunked"] {
        run(path, &x, &w, &labels)?; // warm-up
        let (s, p, l) = run(path, &x, &w, &labels)?;
        println!("{path:>8}: {s:7.3} s  peak +{p:7.0} MiB  loss {l:.6}");
        res.push((s, p, l));
    }
    let (a, b) = (res[0], res[1]);
    println!(
        "chunked / logits: time {:.2}x  peak memory {:.2}x  |loss diff| {:.1e}",
        b.0 / a.0,
        b.1 / a.1.max(1.0),
        (a.2 - b.2).abs()
    );
    Ok(())
}
