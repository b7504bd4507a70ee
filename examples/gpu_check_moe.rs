//! `gpu_check --sections moe` (included by `gpu_check.rs` with `#[path]`): mixture-of-experts
//! routing on the device (`kernels/moe.cu`, `candle_cp_kernels::moe::top_k`, the CUDA path of
//! `Routing::top_k`) against the host loop: the same `Routing` (choices, grouping, counts) for
//! E of 8, 60, 128 and 1000, K of 1 to 8, f32 / f16 / bf16, rows full of ties (values on a grid
//! of 1/4), negative values; a NaN or an infinity refused with the same message as the host's;
//! E past the kernel's 1024 taken by the host loop; bad shapes refused by the launcher.
//!
//! Then the experts' grouped products (`kernels/grouped_gemm.cu`, `candle_cp_kernels::grouped_gemm`:
//! forward with and without the experts' biases, dx, dW), and the per-expert path on the device
//! (`GroupedImpl::PerExpert`: cuBLAS per expert), against the per-expert path of
//! `candle_cp_ops::moe_gemm` on the host: f32 / f16 / bf16, an expert past one row tile, experts
//! without rows, odd widths (element loads) and multiples of 8 (16-byte loads), inputs that are
//! views at an offset; `grouped_matmul_bias`'s node on the device (the kernel under `Auto`)
//! against the host, output and every gradient; bad shapes refused by the launchers.

use super::Report;
use crate::gpu_util::rand_tensor;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_cp_ops::moe::Routing;

/// Section `moe`.
pub fn check_moe(rep: &mut Report, gpu: &Device) -> Result<()> {
    let shapes = [(37, 8, 2), (70, 128, 8), (16, 60, 4), (5, 1000, 8), (9, 8, 8), (3, 1100, 2)];
    for (si, &(n, e, k)) in shapes.iter().enumerate() {
        let raw = rand_tensor(&[n, e], 110 + si as u64)?;
        // `ties`: the values on a grid of 1/4 (many equal values per row)
        for (tag, x) in [("randn", raw.clone()), ("ties", ((&raw * 4.0)?.round()? / 4.0)?)] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let name = format!("Routing::top_k {tag} [{n}, {e}] K {k} {dtype:?}");
                let host = x.to_dtype(dtype)?;
                let want = Routing::top_k(&host, k)?;
                match Routing::top_k(&host.to_device(gpu)?, k) {
                    Ok(got) => rep.check(&name, if got == want { 0.0 } else { 1.0 }, 0.0),
                    Err(err) => rep.error(&name, err),
                }
            }
        }
        // a NaN (and a later infinity) in one row: refused as the host refuses it
        let mut v = raw.flatten_all()?.to_vec1::<f32>()?;
        v[(n / 2) * e + e - 1] = f32::NAN;
        v[(n - 1) * e] = f32::INFINITY;
        let bad = Tensor::from_vec(v, (n, e), &Device::Cpu)?;
        let name = format!("Routing::top_k refuses a non-finite probability [{n}, {e}] K {k}");
        match (Routing::top_k(&bad, k), Routing::top_k(&bad.to_device(gpu)?, k)) {
            (Err(h), Err(g)) if h.to_string() == g.to_string() => rep.check(&name, 0.0, 0.0),
            (h, g) => rep.error(&name, format!("host {:?} / device {:?}", h.err().map(|e| e.to_string()), g.err().map(|e| e.to_string()))),
        }
    }
    // the launcher's own checks
    let p = rand_tensor(&[4, 16], 120)?.to_device(gpu)?;
    for (what, x, k, needle) in [
        ("k = 0", p.clone(), 0, "[4, 16]"),
        ("k > E", p.clone(), 17, "[4, 16]"),
        ("E > 1024", Tensor::zeros((2, 1025), DType::F32, gpu)?, 2, "[2, 1025]"),
        ("3-D probabilities", p.reshape((2, 2, 16))?, 2, "[2, 2, 16]"),
        ("f64 probabilities", p.to_dtype(DType::F64)?, 2, "F64"),
    ] {
        let name = format!("moe::top_k refuses {what}");
        match candle_cp_kernels::moe::top_k(&x, k) {
            Ok(_) => rep.error(&name, "accepted"),
            Err(err) if err.to_string().contains(needle) => rep.check(&name, 0.0, 0.0),
            Err(err) => rep.error(&format!("{name} (error names {needle})"), err),
        }
    }
    check_grouped(rep, gpu)
}

/// max |a - b| / max |b| (both read back as f32 on the host).
fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?, b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?);
    let d = (&a - &b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
    let m = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1e-30) as f64;
    Ok(d / m)
}

/// The grouped kernels against the host's per-expert path, and `grouped_matmul_bias`'s node.
fn check_grouped(rep: &mut Report, gpu: &Device) -> Result<()> {
    use candle_cp_kernels::grouped_gemm as gg;
    use candle_cp_ops::moe_gemm::{self, GroupedImpl};
    let cases: [(&[usize], usize, usize); 4] = [(&[70, 0, 5], 40, 72), (&[3, 66, 0, 1], 13, 10), (&[9, 31, 0, 140, 2, 0, 17, 64], 128, 96), (&[0, 0, 4], 24, 16)];
    for (ci, &(counts, i, o)) in cases.iter().enumerate() {
        let (m, e) = (counts.iter().sum::<usize>(), counts.len());
        let seed = 130 + 10 * ci as u64;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let tol = match dtype {
                DType::F32 => 1e-5,
                DType::F16 => 2e-3,
                _ => 1e-2,
            };
            // x as rows 1 .. m + 1 of a larger tensor: a view at an offset (element loads), and
            // at offset 8 rows x i (16-byte loads where i is a multiple of 8)
            let big = rand_tensor(&[m + 8, i], seed)?.to_dtype(dtype)?;
            let w = rand_tensor(&[e, o, i], seed + 1)?.to_dtype(dtype)?;
            let dy = rand_tensor(&[m, o], seed + 2)?.to_dtype(dtype)?;
            let bias = rand_tensor(&[e, o - 3], seed + 3)?.to_dtype(dtype)?;
            let (bg, wg, dyg, biasg) = (big.to_device(gpu)?, w.to_device(gpu)?, dy.to_device(gpu)?, bias.to_device(gpu)?);
            for start in [1, 8] {
                let x = big.narrow(0, start, m)?;
                let xg = bg.narrow(0, start, m)?;
                let tag = format!("{counts:?} in {i} out {o} {dtype:?} x at row {start}");
                let pe = GroupedImpl::PerExpert;
                let runs: [(&str, candle_core::Result<Tensor>, candle_core::Result<Tensor>); 8] = [
                    ("forward", gg::forward(&xg, &wg, None, counts), moe_gemm::gmm(&x, &w, None, counts)),
                    ("forward + bias at column 3", gg::forward(&xg, &wg, Some((&biasg, 3)), counts), moe_gemm::gmm(&x, &w, Some((&bias, 3)), counts)),
                    ("dx", gg::dx(&dyg, &wg, counts), moe_gemm::gmm_dx(&dy, &w, counts)),
                    ("dw", gg::dw(&dyg, &xg, counts), moe_gemm::gmm_dw(&dy, &x, counts)),
                    // the per-expert path on the device (cuBLAS per expert), the same references
                    ("per-expert forward", moe_gemm::gmm_using(pe, &xg, &wg, None, counts), moe_gemm::gmm(&x, &w, None, counts)),
                    ("per-expert forward + bias at column 3", moe_gemm::gmm_using(pe, &xg, &wg, Some((&biasg, 3)), counts), moe_gemm::gmm(&x, &w, Some((&bias, 3)), counts)),
                    ("per-expert dx", moe_gemm::gmm_dx_using(pe, &dyg, &wg, counts), moe_gemm::gmm_dx(&dy, &w, counts)),
                    ("per-expert dw", moe_gemm::gmm_dw_using(pe, &dyg, &xg, counts), moe_gemm::gmm_dw(&dy, &x, counts)),
                ];
                for (what, got, want) in runs {
                    let name = format!("grouped_gemm {what} {tag}");
                    match (got, want) {
                        (Ok(g), Ok(w)) if g.dims() == w.dims() => rep.check(&name, rel(&g, &w)?, tol),
                        (Ok(g), Ok(w)) => rep.error(&name, format!("shape {:?}, host {:?}", g.dims(), w.dims())),
                        (g, w) => rep.error(&name, format!("device {:?} / host {:?}", g.err().map(|e| e.to_string()), w.err().map(|e| e.to_string()))),
                    }
                }
            }
        }
        // the node on the device (Auto: the kernel at these row counts) against the host
        let (x, w, bias) = (rand_tensor(&[m, i], seed + 4)?, rand_tensor(&[e, o, i], seed + 5)?, rand_tensor(&[e, o - 3], seed + 6)?);
        let c = rand_tensor(&[m, o], seed + 7)?;
        let run = |dev: &Device| -> Result<Vec<Tensor>> {
            let vars = [&x, &w, &bias].into_iter().map(|t| candle_core::Var::from_tensor(&t.to_device(dev)?)).collect::<candle_core::Result<Vec<_>>>()?;
            let y = candle_cp_ops::moe::grouped_matmul_bias(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), 3, counts)?;
            let g = (&y * c.to_device(dev)?)?.sum_all()?.backward()?;
            let mut out = vec![y];
            for v in &vars {
                out.push(g.get(v.as_tensor()).cloned().ok_or_else(|| anyhow::anyhow!("no gradient"))?);
            }
            Ok(out)
        };
        let name = format!("grouped_matmul_bias node {counts:?} in {i} out {o} f32 (y, dx, dw, dbias)");
        match (run(gpu), run(&Device::Cpu)) {
            (Ok(g), Ok(h)) => {
                let mut worst = 0f64;
                for (a, b) in g.iter().zip(&h) {
                    worst = worst.max(rel(a, b)?);
                }
                rep.check(&name, worst, 1e-5)
            }
            (g, h) => rep.error(&name, format!("device {:?} / host {:?}", g.err().map(|e| e.to_string()), h.err().map(|e| e.to_string()))),
        }
    }
    // the launchers' own checks
    let x = rand_tensor(&[6, 8], 199)?.to_device(gpu)?;
    let w = rand_tensor(&[2, 4, 8], 198)?.to_device(gpu)?;
    for (what, got, needle) in [
        ("counts that do not sum to M", gg::forward(&x, &w, None, &[2, 3]).err(), "[2, 3]"),
        ("a 2-D weight", gg::forward(&x, &w.get(0)?, None, &[6]).err(), "[4, 8]"),
        ("a bias past out", gg::forward(&x, &w, Some((&Tensor::zeros((2, 3), DType::F32, gpu)?, 2)), &[3, 3]).err(), "[2, 3]"),
        ("f64 rows", gg::dx(&x.to_dtype(DType::F64)?, &w.to_dtype(DType::F64)?, &[3, 3]).err(), "F64"),
        ("rows that differ", gg::dw(&x.narrow(0, 0, 5)?, &x, &[2, 3]).err(), "[5, 8]"),
    ] {
        let name = format!("grouped_gemm refuses {what}");
        match got {
            None => rep.error(&name, "accepted"),
            Some(err) if err.to_string().contains(needle) => rep.check(&name, 0.0, 0.0),
            Some(err) => rep.error(&format!("{name} (error names {needle})"), err),
        }
    }
    Ok(())
}
