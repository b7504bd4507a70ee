//! Launcher of the experimental Hopper backward, chosen by [`super::FwdImpl::Wgmma`] in
//! [`super::bwd_with`]: `flash_bwd_pipe_prep_*` (delta = rowsum(dO * O) in f32, dO rounded to the
//! input dtype; `kernels/flash_bwd_pipe.cu`), then the warpgroup-MMA kernels of
//! `kernels/flash_bwd_sm90.cu` (PTX for sm_90a): dK/dV `flash_bwd_wgmma_dkdv_{f16,bf16}_d{64,128}`
//! and dQ `flash_bwd_wgmma_dq_{f16,bf16}_d{64,128}`. No atomics: deterministic. Shapes as the
//! other backward kernels: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]` (f16/bf16); out, dout f32
//! `[B, T, H, D]`, lse f32 `[B, H, T]`; returns f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]`.
//! [`super::FwdImpl::WgmmaAtomic`] runs `flash_bwd_wgmma_atomic_*` instead of the last two: the
//! same kernel also computing dQ = dS K on wgmma and adding it into a zero-filled f32 buffer with
//! `red.global.add.f32` (nondeterministic summation order of dQ). The band entries of all three
//! kernels (`flash_bwd_wgmma_{dkdv,dq,atomic}_band_*`) run `bwd_band` under those two families
//! ([`bwd_wgmma_band`]).

use super::{bwd_out, dq_fresh, dq_view, BwdOut, DqOut, prep, sm90, storage_of, suffix, BwdInputs, BwdPrep, Dims, KMask};
use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result, Shape, Tensor};
use half::{bf16, f16};

/// Keys per block (two warpgroups of 64), query rows per streamed tile and threads per block;
/// mirror `WGMMA_BWD_BN`, `WGMMA_BWD_BQ` and `__launch_bounds__(256, 1)` in kernels/flash_bwd_sm90.cu.
const WGMMA_BWD_BN: usize = 128;
const WGMMA_BWD_BQ: usize = 64;
const WGMMA_BWD_THREADS: u32 = 256;

/// Dynamic shared memory of `flash_bwd_wgmma_dkdv_*_d{d}` (`WGMMA_BWD_SMEM(D)`): K and V
/// `[128 x d]`, two stages of Q and dO `[64 x d]` (16-bit), lse2 and delta `[2][64]` f32, plus
/// 1024 bytes to align the base to 1024 (133,120 bytes at d = 128, 67,584 at d = 64).
fn wgmma_bwd_smem(d: usize) -> u32 {
    ((2 * WGMMA_BWD_BN + 4 * WGMMA_BWD_BQ) * d * 2 + 4 * WGMMA_BWD_BQ * 4 + 1024) as u32
}

/// Query rows per block and keys per streamed tile of the dQ kernel; mirror `WGMMA_DQ_BM`,
/// `WGMMA_DQ_BK` in kernels/flash_bwd_sm90.cu (block: 256 threads, as the dK/dV kernel).
const WGMMA_DQ_BM: usize = 128;
const WGMMA_DQ_BK: usize = 128;

/// Dynamic shared memory of `flash_bwd_wgmma_dq_*_d{d}` (`WGMMA_DQ_SMEM(D)`): Q and dO
/// `[128 x d]`, two stages of K and V `[128 x d]` (16-bit), plus 1024 bytes to align the base
/// (197,632 bytes at d = 128, 99,328 at d = 64).
fn wgmma_dq_smem(d: usize) -> u32 {
    ((2 * WGMMA_DQ_BM + 4 * WGMMA_DQ_BK) * d * 2 + 1024) as u32
}

/// Dynamic shared memory of `flash_bwd_wgmma_atomic_*_d{d}` (`WGMMA_BWD_SMEM_ATOMIC(D)`):
/// [`wgmma_bwd_smem`] plus the 16-bit dS tile `[64 x 128]` (149,504 bytes at d = 128, 83,968 at
/// d = 64).
fn wgmma_bwd_smem_atomic(d: usize) -> u32 {
    wgmma_bwd_smem(d) + (WGMMA_BWD_BQ * WGMMA_BWD_BN * 2) as u32
}

/// Checks that the `Wgmma` (`atomic` false) or `WgmmaAtomic` backward can run: head dim 64 or
/// 128, a compute capability 9.x device, and the dynamic shared memory of its kernels within the
/// device's opt-in maximum per block. Errors name the device, sizes and shapes.
pub(super) fn check(dev: &CudaDevice, d: usize, atomic: bool, q: &Shape, k: &Shape) -> Result<()> {
    if d != 64 && d != 128 {
        candle_core::bail!("flash_bwd: the wgmma kernels (FwdImpl::Wgmma) support head dims 64 and 128, got {d}; q {q:?}, k {k:?}")
    }
    sm90::check_hopper(dev, "flash_bwd")?;
    let need = if atomic { wgmma_bwd_smem_atomic(d) } else { wgmma_bwd_smem(d).max(wgmma_dq_smem(d)) };
    let optin = util::smem_optin(dev)?;
    if i64::from(need) > optin {
        candle_core::bail!("flash_bwd: the wgmma backward needs {need} bytes of shared memory per block at head dim {d}, the device allows {optin}; q {q:?}, k {k:?}")
    }
    Ok(())
}

/// Key blocks (dK/dV grid y) and query blocks (dQ grid y) of a wgmma backward launch; errors
/// (named `what`, with the shapes) beyond the grid's 65,535 blocks or the kernels' 32-bit counters
/// (the dK/dV kernel counts (H / Hkv) * ceil(T / 64) query tiles in an int; the prep kernel's
/// grid has one block per 4 rows).
fn grid_tiles((b, t, s, h, hkv): (usize, usize, usize, usize, usize), q: &Tensor, k: &Tensor, what: &str) -> Result<(usize, usize)> {
    let (kv_tiles, q_tiles) = (s.div_ceil(WGMMA_BWD_BN), t.div_ceil(WGMMA_DQ_BM));
    if kv_tiles > 65_535 || q_tiles > 65_535 {
        candle_core::bail!("{what}: T = {t} or S = {s} too long for the wgmma backward's grid (S <= {}, T <= {}); q {:?}, k {:?}", 65_535 * WGMMA_BWD_BN, 65_535 * WGMMA_DQ_BM, q.shape(), k.shape())
    }
    if (h / hkv) * t.div_ceil(WGMMA_BWD_BQ) > i32::MAX as usize || (b * t * h).div_ceil(4) > i32::MAX as usize {
        candle_core::bail!("{what}: too many query rows for the wgmma backward's 32-bit counters; q {:?}, k {:?}", q.shape(), k.shape())
    }
    Ok((kv_tiles, q_tiles))
}

/// The `Wgmma` (`atomic` false) or `WgmmaAtomic` backward of [`super::bwd_with`] on checked
/// inputs ([`check`] passed; f16/bf16; out, lse, dout already contiguous f32, B * T * H > 0, S > 0).
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_wgmma(
    dev: &CudaDevice,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (lse, pr): (&Tensor, &BwdPrep),
    (b, t, s, h, hkv, d): Dims,
    mask: KMask,
    scale: f32,
    atomic: bool,
    dq_out: DqOut<'_>,
) -> Result<BwdOut> {
    let sfx = suffix(q.dtype())?;
    // 16-byte aligned rows for cp.async (q, k, v) and float4 loads (out, dout).
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let (kv_tiles, q_tiles) = grid_tiles((b, t, s, h, hkv), &q, &k, "flash_bwd")?;
    let (dout, lse, delta) = pr.launch_rows(lse, true)?;
    let inp = BwdInputs::lock((&q, &k, &v), (&dout, &lse, &delta))?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let (causal, qo, qstr, ko, kstr) = mask.args()?;
    let acc = 0i32;
    let (smem_kv, smem_q) = (if atomic { wgmma_bwd_smem_atomic(d) } else { wgmma_bwd_smem(d) }, wgmma_dq_smem(d));
    // dq: the caller's rows (added to) or a fresh buffer, zero-filled for the atomic kernel, which
    // adds into it. SAFETY (the others): every element is written by the kernels.
    let (mut fresh, acc_dq) = dq_fresh(dev, &dq_out, b * t * h * d, atomic)?;
    let mut dq: CudaViewMut<'_, f32> = dq_view(dq_out, fresh.as_mut())?;
    let mut dk = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let mut dv = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    macro_rules! launch_wgmma_bwd {
        ($ty:ty) => {{
            let (qv, kv, vv) = inp.qkv::<$ty>()?;
            let (do16, lv, delta) = inp.rows::<$ty>()?;
            let cfg = LaunchConfig {
                grid_dim: (hkv as u32, kv_tiles as u32, b as u32),
                block_dim: (WGMMA_BWD_THREADS, 1, 1),
                shared_mem_bytes: smem_kv,
            };
            if atomic {
                let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_atomic_{sfx}_d{d}"), ptx::FLASH_BWD_SM90_MODULE, ptx::FLASH_BWD_SM90)?;
                func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_kv as i32).w()?;
                let mut bld = func.builder();
                bld.arg(&mut dq).arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
                bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
                bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc);
                // SAFETY: matches `float* dq, float* dk, float* dv, PIPE_ARGS` in
                // kernels/flash_bwd_sm90.cu; device, head dim and shared memory checked by `check`.
                unsafe { bld.launch(cfg) }.w()?;
                return Ok(bwd_out(dev, fresh, (dk, dv), (b, t, s, h, hkv, d)));
            }

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_dkdv_{sfx}_d{d}"), ptx::FLASH_BWD_SM90_MODULE, ptx::FLASH_BWD_SM90)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_kv as i32).w()?;
            let mut bld = func.builder();
            bld.arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc);
            // SAFETY: matches `float* dk, float* dv, PIPE_ARGS` in kernels/flash_bwd_sm90.cu;
            // device, head dim and shared memory checked by `check`, sizes above.
            unsafe { bld.launch(cfg) }.w()?;

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_dq_{sfx}_d{d}"), ptx::FLASH_BWD_SM90_MODULE, ptx::FLASH_BWD_SM90)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_q as i32).w()?;
            let cfg = LaunchConfig {
                grid_dim: (h as u32, q_tiles as u32, b as u32),
                block_dim: (WGMMA_BWD_THREADS, 1, 1),
                shared_mem_bytes: smem_q,
            };
            let mut bld = func.builder();
            bld.arg(&mut dq).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc_dq);
            // SAFETY: matches `float* dq, PIPE_ARGS` in kernels/flash_bwd_sm90.cu.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match q.dtype() {
        DType::F16 => launch_wgmma_bwd!(f16),
        DType::BF16 => launch_wgmma_bwd!(bf16),
        dt => candle_core::bail!("flash_bwd: the wgmma kernels take f16/bf16, got {dt:?}; q {:?}", q.shape()),
    }
    Ok(bwd_out(dev, fresh, (dk, dv), (b, t, s, h, hkv, d)))
}

/// The band backward of `bwd_band` under `Wgmma` (`atomic` false: `flash_bwd_wgmma_dkdv_band_*` then
/// `flash_bwd_wgmma_dq_band_*`, deterministic) or `WgmmaAtomic` (`flash_bwd_wgmma_atomic_band_*`,
/// dQ added with atomics into a zero-filled buffer), after the prep kernel, on the grids of
/// [`bwd_wgmma`]. Inputs as [`bwd_wgmma`]'s ([`check`] passed) plus the device band `lo`, `hi` u32
/// `[1 or B, T]` (contiguous, checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_wgmma_band(
    dev: &CudaDevice,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (lse, pr): (&Tensor, &BwdPrep),
    (b, t, s, h, hkv, d): Dims,
    (blo, bhi): (&Tensor, &Tensor),
    scale: f32,
    atomic: bool,
    dq_out: DqOut<'_>,
) -> Result<BwdOut> {
    let sfx = suffix(q.dtype())?;
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let (kv_tiles, q_tiles) = grid_tiles((b, t, s, h, hkv), &q, &k, "flash_bwd_band")?;
    let (dout, lse, delta) = pr.launch_rows(lse, true)?;
    let inp = BwdInputs::lock((&q, &k, &v), (&dout, &lse, &delta))?;
    let (los, lol) = blo.storage_and_layout();
    let (his, hil) = bhi.storage_and_layout();
    let lov = util::view::<u32>(storage_of(&los, "band lo", blo.shape())?, lol, "band lo")?;
    let hiv = util::view::<u32>(storage_of(&his, "band hi", bhi.shape())?, hil, "band hi")?;
    let bstride = util::to_i64(if blo.dim(0)? == 1 { 0 } else { t }, "band batch stride")?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let acc = 0i32;
    let (smem_kv, smem_q) = (if atomic { wgmma_bwd_smem_atomic(d) } else { wgmma_bwd_smem(d) }, wgmma_dq_smem(d));
    // dq: the caller's rows (added to) or a fresh buffer, zero-filled for the atomic kernel, which
    // adds into it. SAFETY (the others): every element is written by the kernels.
    let (mut fresh, acc_dq) = dq_fresh(dev, &dq_out, b * t * h * d, atomic)?;
    let mut dq: CudaViewMut<'_, f32> = dq_view(dq_out, fresh.as_mut())?;
    let mut dk = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let mut dv = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let kv_cfg = LaunchConfig { grid_dim: (hkv as u32, kv_tiles as u32, b as u32), block_dim: (WGMMA_BWD_THREADS, 1, 1), shared_mem_bytes: smem_kv };
    let q_cfg = LaunchConfig { grid_dim: (h as u32, q_tiles as u32, b as u32), block_dim: (WGMMA_BWD_THREADS, 1, 1), shared_mem_bytes: smem_q };
    let (module, src) = (ptx::FLASH_BWD_SM90_MODULE, ptx::FLASH_BWD_SM90);
    macro_rules! launch_wgmma_bwd_band {
        ($ty:ty) => {{
            let (qv, kv, vv) = inp.qkv::<$ty>()?;
            let (do16, lv, delta) = inp.rows::<$ty>()?;
            if atomic {
                let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_atomic_band_{sfx}_d{d}"), module, src)?;
                func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_kv as i32).w()?;
                let mut bld = func.builder();
                bld.arg(&mut dq).arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
                bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
                bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc);
                // SAFETY: matches `float* dq, float* dk, float* dv, PIPE_BAND_ARGS` in kernels/flash_bwd_sm90.cu.
                unsafe { bld.launch(kv_cfg) }.w()?;
                return Ok(bwd_out(dev, fresh, (dk, dv), (b, t, s, h, hkv, d)));
            }

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_dkdv_band_{sfx}_d{d}"), module, src)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_kv as i32).w()?;
            let mut bld = func.builder();
            bld.arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc);
            // SAFETY: matches `float* dk, float* dv, PIPE_BAND_ARGS` in kernels/flash_bwd_sm90.cu.
            unsafe { bld.launch(kv_cfg) }.w()?;

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_dq_band_{sfx}_d{d}"), module, src)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_q as i32).w()?;
            let mut bld = func.builder();
            bld.arg(&mut dq).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc_dq);
            // SAFETY: matches `float* dq, PIPE_BAND_ARGS` in kernels/flash_bwd_sm90.cu.
            unsafe { bld.launch(q_cfg) }.w()?;
        }};
    }
    match q.dtype() {
        DType::F16 => launch_wgmma_bwd_band!(f16),
        DType::BF16 => launch_wgmma_bwd_band!(bf16),
        dt => candle_core::bail!("flash_bwd_band: the wgmma kernels take f16/bf16, got {dt:?}; q {:?}", q.shape()),
    }
    Ok(bwd_out(dev, fresh, (dk, dv), (b, t, s, h, hkv, d)))
}
