//! `gpu_check --sections moe` (included by `gpu_check.rs` with `#[path]`): mixture-of-experts
//! routing on the device (`kernels/moe.cu`, `candle_cp_kernels::moe::top_k`, the CUDA path of
//! `Routing::top_k`) against the host loop: the same `Routing` (choices, grouping, counts) for
//! E of 8, 60, 128 and 1000, K of 1 to 8, f32 / f16 / bf16, rows full of ties (values on a grid
//! of 1/4), negative values; a NaN or an infinity refused with the same message as the host's;
//! E past the kernel's 1024 taken by the host loop; bad shapes refused by the launcher.

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
    Ok(())
}
