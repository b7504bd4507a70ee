//! Dequantization of a quantized frozen weight on CUDA, in one pass. CPU reference:
//! `candle_cp_nn::quant::QuantWeight::dequantize_host` (equal bit for bit); caller:
//! `candle_cp_nn::quant::QuantWeight::dequantize` on a CUDA device.
//!
//! ```text
//! codes  [out, in] u8 (int8)  or  [out, in/2] u8 (NF4, element 2j in the low nibble)
//! scales [out, in/g] f32      -> weight [out, in] in f32 / f16 / bf16
//! ```
//!
//! The candle-op formulation (`QuantWeight::dequantize_ops`) moves each element through about
//! eight f32 temporaries; this kernel reads the codes and scales once and writes the output once
//! (2.5 bytes per element for NF4 to bf16, against about 30).

use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};
use half::{bf16, f16};

/// How the codes encode the weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codes {
    /// One byte per element: `w = (code - 128) · scale` (scale = one step).
    Int8,
    /// Two 4-bit NormalFloat codes per byte: `w = NF4[code] · scale` (scale = the absmax).
    Nf4,
}


/// The weight `[out, in]` = `dims` in `dtype` (f32, f16 or bf16) from its `codes` (u8,
/// `[out, in]` for int8, `[out, in/2]` for NF4) and `scales` (f32, `[out, in/group]`, one per
/// group of `group` consecutive elements of a row), both on one CUDA device. Views are taken as
/// they are when contiguous (any start offset), copied otherwise. Errors name the shapes when
/// they do not fit `dims` and `group` (even, > 0, dividing `in`).
pub fn dequantize(codes: &Tensor, scales: &Tensor, kind: Codes, group: usize, dims: (usize, usize), dtype: DType) -> Result<Tensor> {
    let (o, i) = dims;
    let code_cols = match kind {
        Codes::Int8 => i,
        Codes::Nf4 => i / 2,
    };
    if group == 0 || !group.is_multiple_of(2) || !i.is_multiple_of(group) {
        candle_core::bail!("dequantize: group {group} must be even, > 0 and divide the input width of weight [{o}, {i}]")
    }
    if codes.dtype() != DType::U8 || codes.dims() != [o, code_cols] || scales.dtype() != DType::F32 || scales.dims() != [o, i / group] {
        candle_core::bail!(
            "dequantize: weight [{o}, {i}] ({kind:?}, group {group}) needs codes u8 [{o}, {code_cols}] and scales f32 [{o}, {}], got codes {:?} {:?} and scales {:?} {:?}",
            i / group, codes.dtype(), codes.shape(), scales.dtype(), scales.shape()
        )
    }
    let dev = util::cuda_device(codes, "dequantize: codes")?;
    if !scales.device().same_device(codes.device()) {
        candle_core::bail!("dequantize: codes {:?} and scales {:?} are on different devices", codes.shape(), scales.shape())
    }
    let n = o * i;
    if n == 0 {
        return Tensor::zeros((o, i), dtype, codes.device());
    }
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return dequantize(codes, scales, kind, group, dims, DType::F32)?.to_dtype(dtype);
    }
    let (codes, scales) = (codes.contiguous()?, scales.contiguous()?);
    let (cs, cl) = codes.storage_and_layout();
    let (ss, sl) = scales.storage_and_layout();
    let cv = util::view::<u8>(util::storage(&cs, "dequantize: codes")?, cl, "codes")?;
    let sv = util::view::<f32>(util::storage(&ss, "dequantize: scales")?, sl, "scales")?;
    let pairs = util::to_i64(n / 2, "pairs")?;
    let g = util::to_i64(group, "group")?;
    let cfg = LaunchConfig { grid_dim: (util::grid_stride_blocks(n / 2), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            // SAFETY: the kernel writes all n elements (n / 2 pairs; n is even as the group is).
            let mut out = unsafe { dev.alloc::<$ty>(n)? };
            let func = dev.get_or_load_custom_func($name, ptx::QUANT_MODULE, ptx::QUANT)?;
            let mut bld = func.builder();
            bld.arg(&cv).arg(&sv).arg(&mut out).arg(&pairs).arg(&g);
            // SAFETY: matches DEQUANT_ENTRY in kernels/quant.cu.
            unsafe { bld.launch(cfg) }.w()?;
            util::to_tensor(out, &dev, (o, i))
        }};
    }
    Ok(match (kind, dtype) {
        (Codes::Int8, DType::F32) => go!(f32, "dequant_int8_f32"),
        (Codes::Int8, DType::F16) => go!(f16, "dequant_int8_f16"),
        (Codes::Int8, DType::BF16) => go!(bf16, "dequant_int8_bf16"),
        (Codes::Nf4, DType::F32) => go!(f32, "dequant_nf4_f32"),
        (Codes::Nf4, DType::F16) => go!(f16, "dequant_nf4_f16"),
        (Codes::Nf4, DType::BF16) => go!(bf16, "dequant_nf4_bf16"),
        (_, dt) => candle_core::bail!("dequantize: output dtype {dt:?} not supported (f32, f16, bf16)"),
    })
}
