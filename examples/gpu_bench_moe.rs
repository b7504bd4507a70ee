//! `gpu_bench --moe 1`: a mixture of experts' grouped products, the grouped kernel
//! (`GroupedImpl::Kernel`: `candle_cp_kernels::grouped_gemm`, one launch) against the per-expert
//! path (`GroupedImpl::PerExpert`: one cuBLAS GEMM per expert and the copies that join them),
//! both through `candle_cp_ops::moe_gemm` as the model runs them, on the same bf16 inputs in the
//! same run. Shapes: a Qwen3-30B-A3B
//! expert projection (h 2048 -> I 768, 128 experts, top 8) and a Mixtral-8x7B one (h 4096 ->
//! I 14336, 8 experts, top 2) over token counts from decoding-sized to training-sized; the rows
//! are spread over the experts unevenly (a fixed pseudo-random routing). One JSON line per
//! (shape, tokens, op): both times, the speedup (per-expert time / kernel time) and each path's
//! TFLOP/s (`2·M·in·out` per product); `rows_per_expert` is what `GroupedImpl::Auto` compares
//! with `moe_gemm::AUTO_ROWS`. `--moe 2`: one tiny shape (h 64 -> 48, 8 experts, top 2), for the
//! CPU shim's runs of the script.

use super::{randn_bf16, time, Args};
use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_cp_ops::moe_gemm::{self, GroupedImpl};
use std::time::Instant;

/// Row counts of `n` tokens routed to `k` of `e` experts: each expert's share drawn from a
/// fixed sequence (from a third to twice the mean), summing to `n·k`.
fn counts(n: usize, k: usize, e: usize) -> Vec<usize> {
    let m = n * k;
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let w: Vec<f64> = (0..e)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            0.33 + 1.67 * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect();
    let tot: f64 = w.iter().sum();
    let mut c: Vec<usize> = w.iter().map(|x| (x / tot * m as f64).floor() as usize).collect();
    let short = m - c.iter().sum::<usize>();
    for j in 0..short {
        c[j % e] += 1;
    }
    c
}

/// One of the three products on the path `imp` (`candle_cp_ops::moe_gemm`'s, as the model runs them).
fn product(imp: GroupedImpl, op: &str, x: &Tensor, w: &Tensor, dy: &Tensor, c: &[usize]) -> candle_core::Result<Tensor> {
    match op {
        "forward" => moe_gemm::gmm_using(imp, x, w, None, c),
        "dx" => moe_gemm::gmm_dx_using(imp, dy, w, c),
        _ => moe_gemm::gmm_dw_using(imp, dy, x, c),
    }
}

pub(crate) fn moe_products(a: &Args, dev: &Device, start: Instant) -> Result<()> {
    type Shape = (&'static str, usize, usize, usize, usize, &'static [usize]);
    let shapes: &[Shape] = match a.moe {
        2 => &[("tiny", 64, 48, 8, 2, &[4, 32])],
        _ => &[("qwen3-30b-a3b", 2048, 768, 128, 8, &[16, 256, 2048, 8192]), ("mixtral-8x7b", 4096, 14336, 8, 2, &[16, 512, 4096])],
    };
    for &(name, h, inter, e, k, tokens) in shapes {
        let w = randn_bf16(dev, &[e, inter, h])?;
        for &n in tokens {
            if start.elapsed() > a.budget {
                println!("{{\"skipped\":\"budget\",\"moe\":\"{name}\",\"tokens\":{n}}}");
                continue;
            }
            let c = counts(n, k, e);
            let m = n * k;
            let x = randn_bf16(dev, &[m, h])?;
            let dy = randn_bf16(dev, &[m, inter])?;
            let flops = 2.0 * (m * h * inter) as f64;
            let active = c.iter().filter(|&&r| r > 0).count().max(1);
            for op in ["forward", "dx", "dw"] {
                let kern = time(dev, a.iters, || product(GroupedImpl::Kernel, op, &x, &w, &dy, &c).map(|_| ()))?;
                let per = time(dev, a.iters, || product(GroupedImpl::PerExpert, op, &x, &w, &dy, &c).map(|_| ()))?;
                println!(
                    "{{\"impl\":\"candle-cp-grouped\",\"moe\":\"{name}\",\"op\":\"{op}\",\"tokens\":{n},\"experts\":{e},\"top_k\":{k},\"in\":{h},\"out\":{inter},\"rows_per_expert\":{},\"kernel_ms\":{:.4},\"per_expert_ms\":{:.4},\"speedup\":{:.3},\"kernel_tflops\":{:.2},\"per_expert_tflops\":{:.2}}}",
                    m / active,
                    kern * 1e3,
                    per * 1e3,
                    per / kern,
                    flops / kern / 1e12,
                    flops / per / 1e12
                );
            }
        }
    }
    Ok(())
}
