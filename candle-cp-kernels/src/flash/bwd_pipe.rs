//! Launcher of the pipelined backward `kernels/flash_bwd_pipe.cu` (cp.async double buffering,
//! ldmatrix, mma.sync), chosen by [`super::FwdImpl::Pipelined`] and by `Auto` for f16/bf16 in
//! [`super::bwd_with`]. Same shapes and results as the other backward kernels: q `[B, T, H, D]`,
//! k/v `[B, S, Hkv, D]` (f16/bf16); out, dout f32 `[B, T, H, D]`, lse f32 `[B, H, T]`; returns
//! f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]`.

use super::{bwd_out, dq_fresh, dq_view, BwdOut, DqOut, prep, suffix, BwdInputs, BwdPrep, Dims, FwdImpl, KMask, Logits};
use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, DType, Result, Shape, Tensor};
use half::{bf16, f16};

/// Tile shapes of `kernels/flash_bwd_pipe.cu` (its `PipeCfg<D>`; keep the two in sync): the
/// dK/dV kernel runs `kv_nw` warps x 16 keys per block over `kv_bq`-row query tiles, each block
/// owning `kv_da` of the d columns of dK and dV (d / kv_da blocks per key tile: 2 at d = 256, 1
/// below; d = 96 takes d = 128's tiles), the dQ kernel `q_nw` warps x `16 * q_mt` query rows per block over `q_bn`-key tiles.
#[derive(Clone, Copy, Debug)]
pub(super) struct PipeCfg {
    pub(super) kv_nw: usize,
    pub(super) kv_bq: usize,
    pub(super) kv_da: usize,
    pub(super) q_nw: usize,
    pub(super) q_mt: usize,
    pub(super) q_bn: usize,
}

impl PipeCfg {
    pub(super) fn of(d: usize) -> Self {
        if d == 96 {
            Self { kv_nw: 8, kv_bq: 64, kv_da: 96, q_nw: 8, q_mt: 1, q_bn: 64 }
        } else if d == 128 {
            Self { kv_nw: 8, kv_bq: 64, kv_da: 128, q_nw: 8, q_mt: 1, q_bn: 64 }
        } else if d == 256 {
            Self { kv_nw: 8, kv_bq: 32, kv_da: 128, q_nw: 8, q_mt: 1, q_bn: 32 }
        } else {
            Self { kv_nw: 8, kv_bq: 64, kv_da: d, q_nw: 4, q_mt: 2, q_bn: 32 }
        }
    }
    /// Grid x of the dK/dV kernel for `hkv` KV heads at head dim `d`: one block per KV head and
    /// column slice.
    pub(super) fn kv_grid_x(&self, hkv: usize, d: usize) -> usize {
        hkv * (d / self.kv_da)
    }
    /// Keys per dK/dV block and query rows per dQ block.
    pub(super) fn block_rows(&self) -> (usize, usize) {
        (16 * self.kv_nw, 16 * self.q_mt * self.q_nw)
    }
    /// Dynamic shared memory (bytes) of the dK/dV and dQ kernels for head dim `d`: 16-bit tiles
    /// with a row stride of d + 8 elements (see the kernels' launch comments).
    pub(super) fn smem(&self, d: usize) -> (u32, u32) {
        let (bn, bm) = self.block_rows();
        let row = (d + 8) * 2;
        let kv = (2 * bn + 4 * self.kv_bq) * row + 4 * self.kv_bq * 4;
        let dq = (2 * bm + 4 * self.q_bn) * row;
        (kv as u32, dq as u32)
    }
}

/// Whether the pipelined backward can run at head dim `d` on `dev`: the dynamic shared memory
/// of both kernels (at d = 128: 140,288 bytes for dK/dV, 139,264 for dQ; at d = 96: 107,520 and
/// 106,496; at d = 64: 74,752 and 55,296; at d = 256: 203,264 and 202,752) within the device's
/// opt-in maximum per block (sm_80: 166,912; sm_90: 232,448; sm_86, sm_89, sm_120: 101,376).
/// Where it does not fit, `Auto` gets `Ok(false)` (the caller runs the mma kernels instead, the
/// CUDA-core ones at d = 256) and an
/// explicit kernel choice an error naming the sizes.
pub(super) fn fits(dev: &CudaDevice, d: usize, imp: FwdImpl, q: &Shape) -> Result<bool> {
    let (kv, dq) = PipeCfg::of(d).smem(d);
    let need = kv.max(dq);
    let optin = util::smem_optin(dev)?;
    if i64::from(need) <= optin {
        return Ok(true);
    }
    if imp == FwdImpl::Auto {
        return Ok(false);
    }
    candle_core::bail!("flash_bwd: the pipelined kernels need {need} bytes of shared memory per block at head dim {d}, the device allows {optin}; q {q:?}")
}

/// `flash_bwd_pipe_prep_*` (shared by the pipelined and the fused backward): delta f32 `[B, H, T]` =
/// rowsum(dO * O) from the f32 `out` / `dout` views `[B, T, H, D]`, and dO rounded to `T` (the
/// input dtype, f16/bf16) `[B, T, H, D]`; returns (delta, do16). The caller checked
/// ceil(B * T * H / 4) < 2^31 (one block per 4 rows).
pub(super) fn launch_prep<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    sfx: &str,
    ov: &CudaView<'_, f32>,
    dov: &CudaView<'_, f32>,
    (b, t, h, d): (usize, usize, usize, usize),
) -> Result<(CudaSlice<f32>, CudaSlice<T>)> {
    // SAFETY: the prep kernel writes every element of both.
    let mut delta = unsafe { dev.alloc::<f32>(b * h * t)? };
    let mut do16 = unsafe { dev.alloc::<T>(b * t * h * d)? };
    let (bi, ti, hi, di) = (b as i32, t as i32, h as i32, d as i32);
    let func = dev.get_or_load_custom_func(&format!("flash_bwd_pipe_prep_{sfx}"), ptx::FLASH_BWD_PIPE_MODULE, ptx::FLASH_BWD_PIPE)?;
    let cfg = LaunchConfig { grid_dim: ((b * t * h).div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let mut bld = func.builder();
    bld.arg(ov).arg(dov).arg(&mut delta).arg(&mut do16).arg(&bi).arg(&ti).arg(&hi).arg(&di);
    // SAFETY: matches flash_bwd_pipe_prep_*'s parameters; sizes checked by the caller.
    unsafe { bld.launch(cfg) }.w()?;
    Ok((delta, do16))
}

/// The `Pipelined` backward of [`bwd_with`] on checked inputs (f16/bf16; out, lse, dout already
/// contiguous f32): `flash_bwd_pipe_prep_*` (delta = rowsum(dO * O) in f32 and dO rounded to the
/// input dtype), then the dK/dV and dQ kernels of `kernels/flash_bwd_pipe.cu` (no atomics).
pub(super) fn bwd_pipe(
    dev: &CudaDevice,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (lse, pr): (&Tensor, &BwdPrep),
    (b, t, s, h, hkv, d): Dims,
    mask: KMask,
    logits: Logits,
    dq_out: DqOut<'_>,
) -> Result<BwdOut> {
    let (scale, cap): (f32, f32) = (logits.scale, logits.cap);
    let sfx = suffix(q.dtype())?;
    // the soft-capped entries (`flash_bwd_pipe_cap_*`) with a cap, the same tiles
    let kind = if cap > 0.0 { "pipe_cap" } else { "pipe" };
    // 16-byte aligned rows for cp.async (q, k, v) and float4 loads (out, dout): contiguous,
    // start offset a multiple of 8 elements.
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let pc = PipeCfg::of(d);
    let (bn, bm) = pc.block_rows();
    let (kv_tiles, q_tiles) = (s.div_ceil(bn), t.div_ceil(bm));
    let kv_x = pc.kv_grid_x(hkv, d);
    if kv_tiles > 65_535 || q_tiles > 65_535 {
        candle_core::bail!("flash_bwd: T = {t} or S = {s} too long for the pipelined kernels' grid (at most {} rows); q {:?}, k {:?}", 65_535 * bn.min(bm), q.shape(), k.shape())
    }
    // 32-bit kernel arithmetic: the dK/dV kernel counts (H / Hkv) * ceil(T / kv_bq) query tiles in
    // an int, the prep kernel's grid has one block per 4 rows (gridDim.x < 2^31).
    if (h / hkv) * t.div_ceil(pc.kv_bq) > i32::MAX as usize || (b * t * h).div_ceil(4) > i32::MAX as usize {
        candle_core::bail!("flash_bwd: too many query rows for the pipelined kernels' 32-bit counters; q {:?}, k {:?}", q.shape(), k.shape())
    }
    let (dout, lse, delta) = pr.launch_rows(lse, true)?;
    let inp = BwdInputs::lock((&q, &k, &v), (&dout, &lse, &delta))?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let (causal, qo, qstr, ko, kstr) = mask.args()?;
    let acc = 0i32;
    let (smem_kv, smem_q) = pc.smem(d);
    let (module, src) = (ptx::FLASH_BWD_PIPE_MODULE, ptx::FLASH_BWD_PIPE);
    // SAFETY (all allocations below): every element is written by the kernels.
    let (mut fresh, acc_dq) = dq_fresh(dev, &dq_out, b * t * h * d, false)?;
    let mut dq: CudaViewMut<'_, f32> = dq_view(dq_out, fresh.as_mut())?;
    let mut dk = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let mut dv = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    macro_rules! launch_pipe {
        ($ty:ty) => {{
            let (qv, kv, vv) = inp.qkv::<$ty>()?;
            let (do16, lv, delta) = inp.rows::<$ty>()?;

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_{kind}_dkdv_{sfx}_d{d}"), module, src)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_kv as i32).w()?;
            let cfg = LaunchConfig {
                grid_dim: (kv_x as u32, kv_tiles as u32, b as u32),
                block_dim: (32 * pc.kv_nw as u32, 1, 1),
                shared_mem_bytes: smem_kv,
            };
            let mut bld = func.builder();
            bld.arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc).arg(&cap);
            // SAFETY: matches `float* dk, float* dv, PIPE_ARGS, float cap` in kernels/flash_bwd_pipe.cu.
            unsafe { bld.launch(cfg) }.w()?;

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_{kind}_dq_{sfx}_d{d}"), module, src)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_q as i32).w()?;
            let cfg = LaunchConfig {
                grid_dim: (h as u32, q_tiles as u32, b as u32),
                block_dim: (32 * pc.q_nw as u32, 1, 1),
                shared_mem_bytes: smem_q,
            };
            let mut bld = func.builder();
            bld.arg(&mut dq).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc_dq).arg(&cap);
            // SAFETY: matches `float* dq, PIPE_ARGS, float cap` in kernels/flash_bwd_pipe.cu.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match q.dtype() {
        DType::F16 => launch_pipe!(f16),
        DType::BF16 => launch_pipe!(bf16),
        dt => candle_core::bail!("flash_bwd: the pipelined kernels take f16/bf16, got {dt:?}; q {:?}", q.shape()),
    }
    Ok(bwd_out(dev, fresh, (dk, dv), (b, t, s, h, hkv, d)))
}
