//! Launcher of the experimental Hopper forward `kernels/flash_fwd_sm90.cu`
//! (`flash_fwd_wgmma_{f16,bf16}_d{64,128}`, warpgroup MMA), chosen by [`super::FwdImpl::Wgmma`]
//! (and `WgmmaAtomic`); its band entries (`flash_fwd_wgmma_band_*`) run `fwd_band` under those.
//! Same shapes and results as the other forward kernels: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`
//! (f16/bf16), out f32 `[B, T, H, D]`, lse f32 `[B, H, T]`.

use super::{Dims, FwdDst, KMask};
use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

/// Query rows per block (two warpgroups of 64) and threads per block; mirrors `WGMMA_BQ` and
/// `__launch_bounds__(256, 1)` in kernels/flash_fwd_sm90.cu.
const WGMMA_BQ: usize = 128;
const WGMMA_THREADS: u32 = 256;
/// Keys per K/V tile (`WGMMA_BK`).
const WGMMA_BK: usize = 128;

/// Dynamic shared memory of `flash_fwd_wgmma_*_d{d}` (`WGMMA_SMEM(D)`): Q [128 x d] plus two
/// stages of K and V [128 x d], 16-bit, plus 1024 bytes to align the base to 1024
/// (164,864 bytes at d = 128, 82,944 at d = 64).
fn wgmma_smem(d: usize) -> u32 {
    ((WGMMA_BQ + 4 * WGMMA_BK) * d * 2 + 1024) as u32
}

/// Error unless `dev` is a compute capability 9.x (Hopper) device: the PTX targets `sm_90a`.
pub(super) fn check_hopper(dev: &CudaDevice, what: &str) -> Result<()> {
    let (major, minor) = dev.cuda_stream().context().compute_capability().w()?;
    if major != 9 {
        candle_core::bail!("{what}: the wgmma kernels (FwdImpl::Wgmma) need a Hopper GPU (compute capability 9.x), this device is {major}.{minor}; use FwdImpl::Auto or Pipelined")
    }
    Ok(())
}

/// Error unless the Hopper forward `kernel` (named in the message) can run: f16/bf16 (`sfx`),
/// head dim 64 or 128, a compute capability 9.x device.
pub(super) fn check_fwd(dev: &CudaDevice, sfx: &str, d: usize, ql: &Layout, kernel: &str) -> Result<()> {
    if sfx == "f32" {
        candle_core::bail!("flash_fwd: the {kernel} takes f16/bf16, got f32; q {:?}", ql.shape())
    }
    if d != 64 && d != 128 {
        candle_core::bail!("flash_fwd: the {kernel} supports head dims 64 and 128, got {d}; q {:?}", ql.shape())
    }
    check_hopper(dev, "flash_fwd")
}

/// The `Wgmma` forward of `fwd_t`: checks dtype (f16/bf16), head dim (64, 128) and device
/// (compute capability 9.x), then launches `flash_fwd_wgmma_{sfx}_d{d}` on grid
/// `(ceil(T / 128), H, B)`. Returns out f32 `[B, T, H, D]` and lse f32 `[B, H, T]` buffers.
#[allow(clippy::too_many_arguments)]
pub(super) fn fwd_wgmma<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    sfx: &str,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    (b, t, s, h, hkv, d): Dims,
    mask: KMask,
    scale: f32,
    dst: FwdDst<'_>,
) -> Result<()> {
    check_fwd(dev, sfx, d, ql, "wgmma kernel")?;
    if b * t * h == 0 {
        return dst.empty(dev);
    }
    let (causal, qo, qs, ko, ks) = mask.args()?;
    let inp = util::FwdQkv::<T>::new(dev, (q, ql), (k, kl), (v, vl), true)?;
    let (qv, kv, vv) = inp.qkv_views()?;
    // The kernel writes every element of out and lse (rows < T, all heads, all d).
    let (o_t, o_row0, o_merge): (i32, i32, i32) = dst.kernel_args(t)?;
    let (mut out, mut lse): (CudaViewMut<'_, f32>, CudaViewMut<'_, f32>) = (dst.out, dst.lse);
    let name = format!("flash_fwd_wgmma_{sfx}_d{d}");
    let func = dev.get_or_load_custom_func(&name, ptx::FLASH_FWD_SM90_MODULE, ptx::FLASH_FWD_SM90)?;
    let cfg = wgmma_config(&func, (b, t, h, d))?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let mut bld = func.builder();
    bld.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
    bld.arg(&causal).arg(&qo).arg(&qs).arg(&ko).arg(&ks);
    bld.arg(&o_t).arg(&o_row0).arg(&o_merge);
    // SAFETY: argument list matches FWD_ARGS in kernels/flash_fwd_sm90.cu; sizes checked by
    // check_dims, dtype/head dim/device above.
    unsafe { bld.launch(cfg) }.w()?;
    Ok(())
}

/// The band forward of `fwd_band` on Hopper (where the kernels apply: f16/bf16, head dims 64/128,
/// compute capability 9.x): `flash_fwd_wgmma_band_{sfx}_d{d}` under `Wgmma` / `WgmmaAtomic`
/// (`ws` false), `flash_fwd_wgmma_ws_band_{sfx}_d{d}` under `WgmmaWs` (`ws` true): the families'
/// forward kernels with the mask arguments replaced by the device band `lo`, `hi` u32
/// `[1 or B, T]` and its batch stride `bstride` (0 or T), on their usual grids. Returns out f32
/// `[B, T, H, D]` and lse f32 `[B, H, T]`; a row with an empty interval gets out 0, lse -inf.
#[allow(clippy::too_many_arguments)]
pub(super) fn fwd_hopper_band<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    sfx: &str,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    (b, t, s, h, hkv, d): Dims,
    lo: &CudaView<'_, u32>,
    hi: &CudaView<'_, u32>,
    bstride: i64,
    scale: f32,
    ws: bool,
    dst: FwdDst<'_>,
) -> Result<()> {
    check_fwd(dev, sfx, d, ql, "Hopper band kernel")?;
    if b * t * h == 0 {
        return dst.empty(dev);
    }
    let inp = util::FwdQkv::<T>::new(dev, (q, ql), (k, kl), (v, vl), true)?;
    let (qv, kv, vv) = inp.qkv_views()?;
    // The kernel writes every element of out and lse (rows < T, all heads, all d).
    let (o_t, o_row0, o_merge): (i32, i32, i32) = dst.kernel_args(t)?;
    let (mut out, mut lse): (CudaViewMut<'_, f32>, CudaViewMut<'_, f32>) = (dst.out, dst.lse);
    let fam = if ws { "wgmma_ws" } else { "wgmma" };
    let name = format!("flash_fwd_{fam}_band_{sfx}_d{d}");
    let func = if ws {
        dev.get_or_load_custom_func(&name, ptx::FLASH_FWD_SM90_WS_MODULE, ptx::FLASH_FWD_SM90_WS)?
    } else {
        dev.get_or_load_custom_func(&name, ptx::FLASH_FWD_SM90_MODULE, ptx::FLASH_FWD_SM90)?
    };
    let cfg = if ws { super::sm90_ws::ws_config(&func, (b, t, h), super::sm90_ws::ws_smem(d))? } else { wgmma_config(&func, (b, t, h, d))? };
    let (bi, ti, si, hi32, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let mut bld = func.builder();
    bld.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi32).arg(&hkvi).arg(&scale);
    bld.arg(lo).arg(hi).arg(&bstride);
    bld.arg(&o_t).arg(&o_row0).arg(&o_merge);
    // SAFETY: argument list matches FWD_BAND_ARGS in kernels/flash_fwd_sm90.cu and
    // kernels/flash_fwd_sm90_ws.cu; sizes checked by check_dims and KBand::check
    // (fwd_storage_band), dtype/head dim/device above.
    unsafe { bld.launch(cfg) }.w()?;
    Ok(())
}

/// Launch config of `flash_fwd_wgmma*` (grid `(ceil(T / 128), H, B)`, block 256, `wgmma_smem(d)`
/// bytes of dynamic shared memory, the limit raised for `func`).
fn wgmma_config(func: &CudaFunction, (b, t, h, d): (usize, usize, usize, usize)) -> Result<LaunchConfig> {
    let smem = wgmma_smem(d);
    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    Ok(LaunchConfig {
        grid_dim: (t.div_ceil(WGMMA_BQ) as u32, h as u32, b as u32),
        block_dim: (WGMMA_THREADS, 1, 1),
        shared_mem_bytes: smem,
    })
}
