//! Launcher of the experimental warp-specialized Hopper forward `kernels/flash_fwd_sm90_ws.cu`
//! (`flash_fwd_wgmma_ws_{f16,bf16}_d{64,128}`: a producer warpgroup copying K/V tiles into an
//! mbarrier ring, two consumer warpgroups on wgmma in ping-pong, FlashAttention-3 structure),
//! chosen by [`super::FwdImpl::WgmmaWs`]; its band entries (`flash_fwd_wgmma_ws_band_*`) run
//! `fwd_band` under `WgmmaWs` (launcher `super::sm90::fwd_hopper_band`). Its TMA entries
//! (`flash_fwd_wgmma_tma{,_band}_*`: the producer's copies as TMA tile loads issued by one thread,
//! tensor maps from [`super::tma`]) run under [`super::FwdImpl::WgmmaTma`] ([`fwd_wgmma_tma`],
//! with a [`TmaMask`]). Same shapes and results as the other forward kernels:
//! q `[B, T, H, D]`, k/v `[B, S, Hkv, D]` (f16/bf16), out f32 `[B, T, H, D]`, lse f32 `[B, H, T]`.

use super::sm90::check_fwd;
use super::tma::{map_bthd, TmaMap};
use super::{Dims, FwdDst, KMask};
use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

/// Query rows per block (two consumer warpgroups of 64) and threads per block (producer plus two
/// consumers); mirrors `WS_BQ` and `__launch_bounds__(384, 1)` in kernels/flash_fwd_sm90_ws.cu.
const WS_BQ: usize = 128;
const WS_THREADS: u32 = 384;
/// Keys per K/V tile (`WS_BK`).
const WS_BK: usize = 128;
/// Ring stages of K and of V (`WS_NST(D)`): 3 at d = 128 (what fits in 227 KB), 4 at d = 64.
fn ws_nst(d: usize) -> usize {
    if d == 128 { 3 } else { 4 }
}

/// Dynamic shared memory of `flash_fwd_wgmma_ws_*_d{d}` (`WS_SMEM(D)`): Q [128 x d] plus
/// `ws_nst(d)` stages of K and of V [128 x d], 16-bit, 1024 bytes to align the base to 1024, and
/// the 4 `ws_nst(d)` mbarriers of 8 bytes (230,496 bytes at d = 128, within sm_90's 232,448-byte
/// opt-in; 148,608 at d = 64).
pub(super) fn ws_smem(d: usize) -> u32 {
    ((WS_BQ + 2 * ws_nst(d) * WS_BK) * d * 2 + 1024 + 4 * ws_nst(d) * 8) as u32
}

/// Keys per K/V tile and ring stages of the wide-tile TMA entries `flash_fwd_wgmma_tma_wide_*_d128`
/// (`WS_WIDE_BK`, `WS_WIDE_NST`; [`super::FwdImpl::WgmmaTmaWide`], d = 128 and a [`KMask`] only).
const WS_WIDE_BK: usize = 176;
const WS_WIDE_NST: usize = 2;
/// Dynamic shared memory of the wide-tile entries (`WS_WIDE_SMEM`): Q [128 x 128] plus 2 stages of
/// K and of V [176 x 128], 16-bit, 1024 alignment bytes and 8 mbarriers: 214,080 bytes.
const WS_WIDE_SMEM: u32 = ((WS_BQ + 2 * WS_WIDE_NST * WS_WIDE_BK) * 128 * 2 + 1024 + 4 * WS_WIDE_NST * 8) as u32;

/// The `WgmmaWs` forward of `fwd_t`: checks dtype (f16/bf16), head dim (64, 128) and device
/// (compute capability 9.x), then launches `flash_fwd_wgmma_ws_{sfx}_d{d}` on grid
/// `(ceil(T / 128), H, B)`, block 384. Returns out f32 `[B, T, H, D]` and lse f32 `[B, H, T]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn fwd_wgmma_ws<T: CudaDType + DeviceRepr>(
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
    check_fwd(dev, sfx, d, ql, "warp-specialized wgmma kernel")?;
    if b * t * h == 0 {
        return dst.empty(dev);
    }
    let (causal, qo, qs, ko, ks) = mask.args()?;
    let inp = util::FwdQkv::<T>::new(dev, (q, ql), (k, kl), (v, vl), true)?;
    let (qv, kv, vv) = inp.qkv_views()?;
    // The kernel writes every element of out and lse (rows < T, all heads, all d).
    let (o_t, o_row0, o_merge): (i32, i32, i32) = dst.kernel_args(t)?;
    let (mut out, mut lse): (CudaViewMut<'_, f32>, CudaViewMut<'_, f32>) = (dst.out, dst.lse);
    let name = format!("flash_fwd_wgmma_ws_{sfx}_d{d}");
    let func = dev.get_or_load_custom_func(&name, ptx::FLASH_FWD_SM90_WS_MODULE, ptx::FLASH_FWD_SM90_WS)?;
    let cfg = ws_config(&func, (b, t, h), ws_smem(d))?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let mut bld = func.builder();
    bld.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
    bld.arg(&causal).arg(&qo).arg(&qs).arg(&ko).arg(&ks);
    bld.arg(&o_t).arg(&o_row0).arg(&o_merge);
    // SAFETY: argument list matches FWD_ARGS in kernels/flash_fwd_sm90_ws.cu; sizes checked by
    // check_dims, dtype/head dim/device above.
    unsafe { bld.launch(cfg) }.w()?;
    Ok(())
}

/// The tensor maps of q `[B, T, H, D]` (boxes of `WS_BQ` rows), k and v `[B, S, Hkv, D]` (boxes of
/// `bk` rows: the key tile, `WS_BK` or `WS_WIDE_BK`) for the forward's TMA entries
/// ([`super::tma::map_bthd`]).
fn tma_maps<T>(dev: &CudaDevice, sfx: &str, (qv, kv, vv): (&CudaView<'_, T>, &CudaView<'_, T>, &CudaView<'_, T>), (b, t, s, h, hkv, d): Dims, bk: usize) -> Result<(TmaMap, TmaMap, TmaMap)> {
    let bf = sfx == "bf16";
    let (rq, rk) = (WS_BQ as u32, bk as u32);
    Ok((map_bthd(dev, qv, bf, (b, t, h, d), rq, "q")?, map_bthd(dev, kv, bf, (b, s, hkv, d), rk, "k")?, map_bthd(dev, vv, bf, (b, s, hkv, d), rk, "v")?))
}

/// Visibility of a `WgmmaTma` forward launch: a [`KMask`] (`flash_fwd_wgmma_tma_*`) or a band on
/// the device, u32 `lo`, `hi` `[1 or B, T]` with batch stride `bstride` (0 or T), shape checked by
/// the caller (`flash_fwd_wgmma_tma_band_*`).
pub(super) enum TmaMask<'a> {
    Mask(KMask),
    Band { lo: &'a CudaView<'a, u32>, hi: &'a CudaView<'a, u32>, bstride: i64 },
}

/// The `WgmmaTma` forward of `fwd_t` (a [`TmaMask::Mask`]) and of `fwd_band` (a
/// [`TmaMask::Band`], where [`applies`]): as [`fwd_wgmma_ws`], with the TMA entry
/// `flash_fwd_wgmma_tma_{sfx}_d{d}` / `flash_fwd_wgmma_tma_band_{sfx}_d{d}` (Q and the K/V tiles
/// loaded by TMA through the tensor maps of q, k and v, which it takes after the usual
/// arguments). `wide` ([`super::FwdImpl::WgmmaTmaWide`]): a [`TmaMask::Mask`] at d = 128 runs the
/// wide-tile entry `flash_fwd_wgmma_tma_wide_{sfx}_d128` (176-key tiles, 2 stages, k/v maps with
/// 176-row boxes) instead; bands and d = 64 keep the 128-key entries. Returns out f32 `[B, T, H, D]`
/// and lse f32 `[B, H, T]`; a row that sees no key gets out 0, lse -inf.
#[allow(clippy::too_many_arguments)]
pub(super) fn fwd_wgmma_tma<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    sfx: &str,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    (b, t, s, h, hkv, d): Dims,
    mask: TmaMask<'_>,
    scale: f32,
    wide: bool,
    dst: FwdDst<'_>,
) -> Result<()> {
    check_fwd(dev, sfx, d, ql, "TMA wgmma kernel")?;
    let wide = wide && d == 128 && matches!(mask, TmaMask::Mask(_));
    let (bk, smem) = if wide { (WS_WIDE_BK, WS_WIDE_SMEM) } else { (WS_BK, ws_smem(d)) };
    if b * t * h == 0 || s == 0 {
        // (a map needs at least one key row)
        return dst.empty(dev);
    }
    let inp = util::FwdQkv::<T>::new(dev, (q, ql), (k, kl), (v, vl), true)?;
    let (qv, kv, vv) = inp.qkv_views()?;
    let (tq, tk, tv) = tma_maps(dev, sfx, (&qv, &kv, &vv), (b, t, s, h, hkv, d), bk)?;
    // The kernel writes every element of out and lse (rows < T, all heads, all d).
    let (o_t, o_row0, o_merge): (i32, i32, i32) = dst.kernel_args(t)?;
    let (mut out, mut lse): (CudaViewMut<'_, f32>, CudaViewMut<'_, f32>) = (dst.out, dst.lse);
    let (bi, ti, si, hi32, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    match mask {
        TmaMask::Mask(m) => {
            let (causal, qo, qs, ko, ks) = m.args()?;
            let entry = if wide { "tma_wide" } else { "tma" };  // (wide: d = 128)
            let name = format!("flash_fwd_wgmma_{entry}_{sfx}_d{d}");
            let func = dev.get_or_load_custom_func(&name, ptx::FLASH_FWD_SM90_WS_MODULE, ptx::FLASH_FWD_SM90_WS)?;
            let cfg = ws_config(&func, (b, t, h), smem)?;
            let mut bld = func.builder();
            bld.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi32).arg(&hkvi).arg(&scale);
            bld.arg(&causal).arg(&qo).arg(&qs).arg(&ko).arg(&ks);
            bld.arg(&o_t).arg(&o_row0).arg(&o_merge);
            bld.arg(&tq).arg(&tk).arg(&tv);
            // SAFETY: argument list matches FWD_ARGS + TMA_MAPS in kernels/flash_fwd_sm90_ws.cu
            // (WGMMA_WS's and WGMMA_TMA_WIDE's TMA entries); sizes checked by check_dims,
            // dtype/head dim/device above; the maps describe qv, kv, vv with the entry's key tile.
            unsafe { bld.launch(cfg) }.w()?;
        }
        TmaMask::Band { lo, hi, bstride } => {
            let func = dev.get_or_load_custom_func(&format!("flash_fwd_wgmma_tma_band_{sfx}_d{d}"), ptx::FLASH_FWD_SM90_WS_MODULE, ptx::FLASH_FWD_SM90_WS)?;
            let cfg = ws_config(&func, (b, t, h), smem)?;
            let mut bld = func.builder();
            bld.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi32).arg(&hkvi).arg(&scale);
            bld.arg(lo).arg(hi).arg(&bstride);
            bld.arg(&o_t).arg(&o_row0).arg(&o_merge);
            bld.arg(&tq).arg(&tk).arg(&tv);
            // SAFETY: argument list matches FWD_BAND_ARGS + TMA_MAPS in kernels/flash_fwd_sm90_ws.cu;
            // sizes checked by check_dims and KBand::check (fwd_storage_band), dtype/head
            // dim/device above.
            unsafe { bld.launch(cfg) }.w()?;
        }
    }
    Ok(())
}

/// Launch config of `flash_fwd_wgmma_ws*` / `flash_fwd_wgmma_tma*` (grid `(ceil(T / 128), H, B)`,
/// block 384, `smem` bytes of dynamic shared memory: [`ws_smem`] or `WS_WIDE_SMEM`; the limit
/// raised for `func`).
pub(super) fn ws_config(func: &CudaFunction, (b, t, h): (usize, usize, usize), smem: u32) -> Result<LaunchConfig> {
    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    Ok(LaunchConfig {
        grid_dim: (t.div_ceil(WS_BQ) as u32, h as u32, b as u32),
        block_dim: (WS_THREADS, 1, 1),
        shared_mem_bytes: smem,
    })
}

/// Can the warp-specialized forward run here: f16/bf16 (`sfx`), head dim 64 or 128, a compute
/// capability 9.x device? (`fwd_band` under `WgmmaWs` falls back to `Auto`'s kernels where not.)
pub(super) fn applies(dev: &CudaDevice, sfx: &str, d: usize) -> Result<bool> {
    let (major, _) = dev.cuda_stream().context().compute_capability().w()?;
    Ok(sfx != "f32" && (d == 64 || d == 128) && major == 9)
}
