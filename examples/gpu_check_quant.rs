//! `gpu_check --sections quant` (included by `gpu_check.rs` with `#[path]`): the dequantization
//! kernel (`kernels/quant.cu`, `candle_cp_kernels::quant::dequantize`: the CUDA path of
//! `QuantWeight::dequantize`, a LoRA run's quantized base) against the host loops
//! (`QuantWeight::dequantize_host`, the CPU reference) bit for bit, every kind (int8, NF4) and
//! output dtype (f32, f16, bf16; f64 through the f32 kernel), groups of 2 and 64, f32 and
//! double-quantized scales (decoded by candle ops, then the kernel), and a weight of more than
//! one launch block; the candle-op path on the GPU (`dequantize_ops`) to the same bits;
//! codes and scales that are row views (storage offset); bad shapes and groups refused with the
//! shapes named.

use super::Report;
use crate::gpu_util::{max_abs, rand_tensor};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_cp_kernels::quant::{dequantize, Codes};
use candle_cp_nn::quant::{QuantConfig, QuantKind, QuantWeight};

/// Section `quant`.
pub fn check_quant(rep: &mut Report, gpu: &Device) -> Result<()> {
    let shapes: &[(usize, usize, usize)] = if rep.quick { &[(5, 12, 2), (7, 128, 64), (33, 256, 64)] } else { &[(5, 12, 2), (7, 128, 64), (33, 256, 64), (1024, 4096, 64)] };
    for (si, &(o, i, g)) in shapes.iter().enumerate() {
        let w = rand_tensor(&[o, i], 90 + si as u64)?;
        // f32 scales, and double-quantized ones (one block of all the rows per scale column)
        let mut cfgs = Vec::new();
        for kind in [QuantKind::Int8, QuantKind::Nf4] {
            let plain = QuantConfig::new(kind, g)?;
            cfgs.extend([plain, plain.with_double_quant(o)?]);
        }
        for cfg in cfgs {
            let kind = cfg.kind;
            let host = QuantWeight::quantize(&w, cfg)?;
            let dev = QuantWeight::quantize(&w.to_device(gpu)?, cfg)?;
            let want32 = host.dequantize_host()?;
            let tag = format!("dequantize {cfg} [{o}, {i}]");
            rep.check(&format!("{tag} codes"), max_abs(&dev.codes().to_dtype(DType::F32)?, &host.codes().to_dtype(DType::F32)?)?, 0.0);
            for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
                let want = want32.to_dtype(dtype)?;
                match dev.dequantize(dtype) {
                    Ok(got) if got.dtype() == dtype && got.device().same_device(gpu) => {
                        rep.check(&format!("{tag} {dtype:?} kernel"), max_abs(&got, &want)?, 0.0)
                    }
                    Ok(got) => rep.error(&format!("{tag} {dtype:?} kernel"), format!("{:?} on {:?}", got.dtype(), got.device())),
                    Err(e) => rep.error(&format!("{tag} {dtype:?} kernel"), e),
                }
                if dtype != DType::F64 {
                    rep.check(&format!("{tag} {dtype:?} candle ops"), max_abs(&dev.dequantize_ops(dtype)?, &want)?, 0.0);
                }
            }
            // rows 1.. of the codes and scales: views at a storage offset, as they are
            let codes_k = if kind == QuantKind::Int8 { Codes::Int8 } else { Codes::Nf4 };
            let (c, s) = (dev.codes().narrow(0, 1, o - 1)?, dev.scales()?.narrow(0, 1, o - 1)?);
            match dequantize(&c, &s, codes_k, g, (o - 1, i), DType::BF16) {
                Ok(got) => rep.check(&format!("{tag} rows 1.. (views)"), max_abs(&got, &want32.narrow(0, 1, o - 1)?.to_dtype(DType::BF16)?)?, 0.0),
                Err(e) => rep.error(&format!("{tag} rows 1.. (views)"), e),
            }
        }
    }
    // bad input: refused with the shapes named, nothing launched
    let dev = QuantWeight::quantize(&rand_tensor(&[4, 16], 99)?.to_device(gpu)?, QuantConfig::new(QuantKind::Nf4, 8)?)?;
    // (what, scales (None: the right ones), group, weight dims, what the error must name)
    type Bad<'a> = (&'a str, Option<Tensor>, usize, (usize, usize), &'a str);
    let cases: [Bad; 4] = [
        ("scales of another shape", Some(dev.scales()?.narrow(1, 0, 1)?), 8, (4, 16), "[4, 1]"),
        ("an odd group", None, 3, (4, 16), "group 3"),
        ("codes of another width", None, 8, (4, 32), "[4, 8]"),
        ("a weight narrower than its codes", None, 8, (4, 8), "[4, 4]"),
    ];
    for (what, scales, g, dims, needle) in cases {
        let scales = match scales {
            Some(s) => s,
            None => dev.scales()?,
        };
        match dequantize(dev.codes(), &scales, Codes::Nf4, g, dims, DType::F32) {
            Ok(_) => rep.error(&format!("dequantize refuses {what}"), "accepted"),
            Err(e) if e.to_string().contains(needle) => rep.check(&format!("dequantize refuses {what}"), 0.0, 0.0),
            Err(e) => rep.error(&format!("dequantize refuses {what} (error names {needle})"), e),
        }
    }
    Ok(())
}
