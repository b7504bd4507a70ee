//! Mixture-of-experts routing on CUDA: each token's top `K` experts. CPU reference:
//! `candle_cp_ops::moe::Routing::top_k` (its host loop, `top_k_rows`); caller: the same
//! function on a CUDA device, which then copies down only the `[N, K]` choices.

use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};
use half::{bf16, f16};

/// The most experts [`top_k`] takes (a lane's 32-bit mask of chosen experts, 32 lanes).
pub const MAX_EXPERTS: usize = 1024;


/// Each row's top `k` of `probs` `[N, E]` (f32, f16 or bf16, on a CUDA device) as u32
/// `[N, k]` on the device: expert indices by falling probability (f32's total order, as
/// `f32::total_cmp`), ties by the lower index. A row holding a value that is not finite is not
/// routed: its slot 0 holds `E + e`, `e` its first such expert (the caller reports it), its other
/// slots are unspecified. Errors (shapes named): `probs` not 2-D, `k` outside `1..=E`,
/// `E > MAX_EXPERTS`, another dtype.
pub fn top_k(probs: &Tensor, k: usize) -> Result<Tensor> {
    let dev = util::cuda_device(probs, "moe::top_k: probs")?;
    let (n, e) = probs.dims2().map_err(|_| candle_core::Error::Msg(format!("moe::top_k: probabilities {:?} are not [N, E]", probs.dims())))?;
    if k == 0 || k > e || e > MAX_EXPERTS {
        candle_core::bail!("moe::top_k: top {k} of probabilities {:?} ([N, E]): needs 1 <= k <= E <= {MAX_EXPERTS}", probs.dims())
    }
    if n == 0 {
        return Tensor::zeros((0, k), DType::U32, probs.device());
    }
    let (ni, ei, ki) = (util::to_i32(n, "N")?, util::to_i32(e, "E")?, util::to_i32(k, "K")?);
    let probs = probs.contiguous()?;
    let (st, l) = probs.storage_and_layout();
    let st = util::storage(&st, "moe::top_k: probs")?;
    // SAFETY: the kernel writes every slot of every routed row; a row it does not route gets
    // its slot 0 (the caller reads no other slot of it).
    let mut out = unsafe { dev.alloc::<u32>(n * k)? };
    let cfg = LaunchConfig { grid_dim: (n.div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let pv = util::view::<$ty>(st, l, "probs")?;
            let func = dev.get_or_load_custom_func($name, ptx::MOE_MODULE, ptx::MOE)?;
            let mut bld = func.builder();
            bld.arg(&pv).arg(&mut out).arg(&ni).arg(&ei).arg(&ki);
            // SAFETY: matches TOP_K_ENTRY in kernels/moe.cu.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match probs.dtype() {
        DType::F32 => go!(f32, "moe_top_k_f32"),
        DType::F16 => go!(f16, "moe_top_k_f16"),
        DType::BF16 => go!(bf16, "moe_top_k_bf16"),
        dt => candle_core::bail!("moe::top_k: probabilities {:?} of dtype {dt:?} (f32, f16, bf16)", probs.dims()),
    }
    Ok(util::to_tensor(out, &dev, (n, k)))
}
