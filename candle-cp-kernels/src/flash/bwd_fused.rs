//! Launcher of the fused backward `kernels/flash_bwd_fused.cu` (dK, dV and atomic dQ in one
//! kernel, FlashAttention-2 style), chosen by [`super::FwdImpl::AtomicDq`] in [`super::bwd_with`]
//! (opt-in; `Auto` never picks it). Same shapes as the other backward kernels: q `[B, T, H, D]`,
//! k/v `[B, S, Hkv, D]` (f16/bf16); out, dout f32 `[B, T, H, D]`, lse f32 `[B, H, T]`; returns
//! f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]`. dq is summed with f32 atomics from every
//! 128-key block, in a nondeterministic order.

use super::{bwd_out, dq_fresh, dq_view, BwdOut, DqOut, prep, suffix, BwdInputs, BwdPrep, Dims, KMask};
use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result, Shape, Tensor};
use half::{bf16, f16};

/// Tile shape of `kernels/flash_bwd_fused.cu` (its `FusedCfg<D>`; keep the two in sync):
/// `NW` warps x 16 keys per block, query tiles of `BQ` rows.
const NW: usize = 8;
/// See [`NW`].
const BQ: usize = 64;
/// Keys per block.
const BN: usize = 16 * NW;

/// Dynamic shared memory (bytes) of the fused kernel at head dim `d`: K and V tiles, two Q and
/// two dO buffers (rows of d + 8 16-bit elements), the dS^T tile (BN rows of BQ + 8 elements)
/// and two lse/delta buffers: 158,720 bytes at d = 128, 93,184 at d = 64.
fn smem(d: usize) -> u32 {
    ((2 * BN + 4 * BQ) * (d + 8) * 2 + BN * (BQ + 8) * 2 + 4 * BQ * 4) as u32
}

/// Errors (naming the sizes) where the fused kernel's shared memory exceeds the device's opt-in
/// maximum per block (sm_80: 166,912; sm_90: 232,448; sm_86, sm_89, sm_120: 101,376, so d = 128
/// does not run there).
pub(super) fn check_fits(dev: &CudaDevice, d: usize, q: &Shape) -> Result<()> {
    let need = smem(d);
    let optin = util::smem_optin(dev)?;
    if i64::from(need) > optin {
        candle_core::bail!("flash_bwd: the fused atomic-dQ kernel needs {need} bytes of shared memory per block at head dim {d}, the device allows {optin}; q {q:?}")
    }
    Ok(())
}

/// The `AtomicDq` backward of [`super::bwd_with`] on checked, non-empty inputs (f16/bf16; out,
/// lse, dout already contiguous f32): `flash_bwd_pipe_prep_*` (delta = rowsum(dO * O) in f32
/// and dO rounded to the input dtype), then `flash_bwd_fused_*` on a zero-filled dq.
pub(super) fn bwd_fused(
    dev: &CudaDevice,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (lse, pr): (&Tensor, &BwdPrep),
    (b, t, s, h, hkv, d): Dims,
    mask: KMask,
    scale: f32,
    dq_out: DqOut<'_>,
) -> Result<BwdOut> {
    let sfx = suffix(q.dtype())?;
    // 16-byte aligned rows for cp.async (q, k, v) and float4 loads (out, dout).
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let kv_tiles = s.div_ceil(BN);
    if kv_tiles > 65_535 {
        candle_core::bail!("flash_bwd: S = {s} too long for the fused kernel's grid (at most {} keys); q {:?}, k {:?}", 65_535 * BN, q.shape(), k.shape())
    }
    // 32-bit kernel arithmetic: (H / Hkv) * ceil(T / BQ) query tiles in an int; the prep kernel's
    // grid has one block per 4 rows.
    if (h / hkv) * t.div_ceil(BQ) > i32::MAX as usize || (b * t * h).div_ceil(4) > i32::MAX as usize {
        candle_core::bail!("flash_bwd: too many query rows for the fused kernel's 32-bit counters; q {:?}, k {:?}", q.shape(), k.shape())
    }
    let (dout, lse, delta) = pr.launch_rows(lse, true)?;
    let inp = BwdInputs::lock((&q, &k, &v), (&dout, &lse, &delta))?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let (causal, qo, qstr, ko, kstr) = mask.args()?;
    // accumulate = 0: dk/dv are overwritten; dq is always added to (zeros, or the caller's rows).
    let acc = 0i32;
    let smem = smem(d);
    // dq: the caller's rows, or a fresh zero-filled buffer (the kernel adds into it). SAFETY (dk,
    // dv): every element is written by the kernel.
    let (mut fresh, _) = dq_fresh(dev, &dq_out, b * t * h * d, true)?;
    let mut dq: CudaViewMut<'_, f32> = dq_view(dq_out, fresh.as_mut())?;
    let mut dk = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let mut dv = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    macro_rules! launch_fused {
        ($ty:ty) => {{
            let (qv, kv, vv) = inp.qkv::<$ty>()?;
            let (do16, lv, delta) = inp.rows::<$ty>()?;

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_fused_{sfx}_d{d}"), ptx::FLASH_BWD_FUSED_MODULE, ptx::FLASH_BWD_FUSED)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
            let cfg = LaunchConfig { grid_dim: (hkv as u32, kv_tiles as u32, b as u32), block_dim: (32 * NW as u32, 1, 1), shared_mem_bytes: smem };
            let mut bld = func.builder();
            bld.arg(&mut dq).arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc);
            // SAFETY: matches `float* dq, float* dk, float* dv, PIPE_ARGS` in kernels/flash_bwd_fused.cu.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match q.dtype() {
        DType::F16 => launch_fused!(f16),
        DType::BF16 => launch_fused!(bf16),
        dt => candle_core::bail!("flash_bwd: the fused kernel takes f16/bf16, got {dt:?}; q {:?}", q.shape()),
    }
    Ok(bwd_out(dev, fresh, (dk, dv), (b, t, s, h, hkv, d)))
}
