//! Launcher of the experimental warp-specialized Hopper backward, chosen by
//! [`super::FwdImpl::WgmmaWs`] in [`super::bwd_with`]: `flash_bwd_pipe_prep_*` (delta =
//! rowsum(dO * O) in f32, dO rounded to the input dtype; `kernels/flash_bwd_pipe.cu`), then
//! `flash_bwd_wgmma_ws_{f16,bf16}_d{64,128}` of `kernels/flash_bwd_sm90_ws.cu` (PTX for sm_90a: a
//! producer warpgroup copying each query tile's Q and dO into an mbarrier ring, two consumer
//! warpgroups on wgmma computing dK, dV in registers and dQ = dS K, FlashAttention-3 structure),
//! which adds dQ into a zero-filled f32 buffer with `red.global.add.v4.f32` (nondeterministic
//! summation order of dQ; dK, dV are deterministic). Same results as the `WgmmaAtomic` backward
//! ([`super::bwd_sm90`]). Shapes as the other backward kernels: q `[B, T, H, D]`, k/v
//! `[B, S, Hkv, D]` (f16/bf16); out, dout f32 `[B, T, H, D]`, lse f32 `[B, H, T]`; returns f32 dq
//! `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]`. Its band entries (`flash_bwd_wgmma_ws_band_*`) run
//! `bwd_band` under `WgmmaWs`. Under [`super::FwdImpl::WgmmaTma`] the same kernel's TMA entries run
//! (`flash_bwd_wgmma_tma{,_band}_*`: K, V, Q and dO loaded by TMA through tensor maps from
//! [`super::tma`], issued by one producer thread).

use super::tma::{map_bthd, map_f32_bthd, TmaMap};
use super::{bwd_out, dq_fresh, dq_view, BwdOut, DqOut, prep, sm90, storage_of, suffix, BwdInputs, BwdPrep, Dims, KMask};
use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result, Shape, Tensor};
use half::{bf16, f16};

/// Keys per block (two consumer warpgroups of 64), query rows per streamed tile and threads per
/// block (producer plus two consumers); mirror `WSB_BN`, `WSB_BQ` and `__launch_bounds__(384, 1)`
/// in kernels/flash_bwd_sm90_ws.cu.
const WSB_BN: usize = 128;
const WSB_BQ: usize = 64;
const WSB_THREADS: u32 = 384;

/// Ring stages of Q / dO tiles (`WSB_NST(D)`): 3 at d = 128 (what fits in 227 KB), 4 at d = 64.
fn wsb_nst(d: usize) -> usize {
    if d == 128 { 3 } else { 4 }
}

/// Dynamic shared memory of `flash_bwd_wgmma_ws_*_d{d}` (`WSB_SMEM(D)`): K and V `[128 x d]`,
/// `wsb_nst(d)` stages of Q and of dO `[64 x d]`, two 16-bit dS tiles `[64 x 128]`, lse2 and delta
/// `[wsb_nst(d)][64]` f32, `2 wsb_nst(d)` mbarriers of 8 bytes, and 1024 bytes to align the base
/// (199,216 bytes at d = 128, within sm_90's 232,448-byte opt-in; 134,208 at d = 64).
fn wsb_smem(d: usize) -> u32 {
    let nst = wsb_nst(d);
    ((2 * WSB_BN + 2 * nst * WSB_BQ) * d * 2 + 2 * WSB_BQ * WSB_BN * 2 + 2 * nst * WSB_BQ * 4 + 2 * nst * 8 + 1024) as u32
}

/// Dynamic shared memory of the TMA entries `flash_bwd_wgmma_tma*_d{d}` (`WSB_SMEM_TMA(D)`):
/// [`wsb_smem`] plus two f32 `[64 x 64]` dQ buffers (231,984 bytes at d = 128; 166,976 at d = 64).
fn wsb_smem_tma(d: usize) -> u32 {
    wsb_smem(d) + (2 * WSB_BQ * 64 * 4) as u32
}

/// Checks that the `WgmmaWs` backward (`tma`: its TMA entries, `WgmmaTma`) can run: head dim 64 or
/// 128, a compute capability 9.x device, and its dynamic shared memory within the device's opt-in
/// maximum per block. Errors name the device, sizes and shapes.
pub(super) fn check(dev: &CudaDevice, d: usize, q: &Shape, k: &Shape, tma: bool) -> Result<()> {
    if d != 64 && d != 128 {
        candle_core::bail!("flash_bwd: the warp-specialized wgmma backward (FwdImpl::WgmmaWs) supports head dims 64 and 128, got {d}; q {q:?}, k {k:?}")
    }
    sm90::check_hopper(dev, "flash_bwd")?;
    let need = if tma { wsb_smem_tma(d) } else { wsb_smem(d) };
    let optin = util::smem_optin(dev)?;
    if i64::from(need) > optin {
        candle_core::bail!("flash_bwd: the warp-specialized wgmma backward needs {need} bytes of shared memory per block at head dim {d}, the device allows {optin}; q {q:?}, k {k:?}")
    }
    Ok(())
}

/// Visibility of a `WgmmaWs` backward launch: a [`KMask`] (`flash_bwd_wgmma_ws_*`) or a band on
/// the device, u32 `lo`, `hi` `[1 or B, T]` (contiguous, checked by the caller:
/// `flash_bwd_wgmma_ws_band_*`).
pub(super) enum WsbMask<'a> {
    Mask(KMask),
    Band { lo: &'a Tensor, hi: &'a Tensor },
}

/// The tensor maps of q and dO `[B, T, H, D]` (boxes of `WSB_BQ` rows), k and v `[B, S, Hkv, D]`
/// (`WSB_BN` rows) for the backward's TMA loads ([`super::tma::map_bthd`]), and of dq f32
/// `[B, T, H, D]` for its reductions ([`super::tma::map_f32_bthd`], boxes of `WSB_BQ` rows).
#[allow(clippy::type_complexity)]
fn bwd_tma_maps<T, V, W, X>(dev: &CudaDevice, bf: bool, (qv, dov, kv, vv, dqv): (&V, &W, &V, &V, &X), (b, t, s, h, hkv, d): Dims) -> Result<(TmaMap, TmaMap, TmaMap, TmaMap, TmaMap)>
where
    V: DevicePtr<T>,
    W: DevicePtr<T>,
    X: DevicePtr<f32>,
{
    let (rq, rk) = (WSB_BQ as u32, WSB_BN as u32);
    Ok((
        map_bthd(dev, qv, bf, (b, t, h, d), rq, "q")?,
        map_bthd(dev, dov, bf, (b, t, h, d), rq, "dout")?,
        map_bthd(dev, kv, bf, (b, s, hkv, d), rk, "k")?,
        map_bthd(dev, vv, bf, (b, s, hkv, d), rk, "v")?,
        map_f32_bthd(dev, dqv, (b, t, h, d), rq, "dq")?,
    ))
}

/// The `WgmmaWs` backward of [`super::bwd_with`] (and of `bwd_band` under `WgmmaWs` where [`check`]
/// passes) on checked inputs ([`check`] passed; f16/bf16; out, lse, dout already contiguous f32,
/// B * T * H > 0, S > 0): the prep kernel, then `flash_bwd_wgmma_ws_{sfx}_d{d}` (or
/// `flash_bwd_wgmma_ws_band_{sfx}_d{d}`) on grid `(Hkv, ceil(S / 128), B)`, block 384, dq
/// zero-filled. With `tma` (`WgmmaTma`) the TMA entries `flash_bwd_wgmma_tma{,_band}_{sfx}_d{d}`
/// instead, the tensor maps of q, dO, k and v after the usual arguments.
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_wgmma_ws(
    dev: &CudaDevice,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (lse, pr): (&Tensor, &BwdPrep),
    (b, t, s, h, hkv, d): Dims,
    mask: WsbMask<'_>,
    scale: f32,
    tma: bool,
    dq_out: DqOut<'_>,
) -> Result<BwdOut> {
    let sfx = suffix(q.dtype())?;
    // 16-byte aligned rows for cp.async (q, k, v) and float4 loads (out, dout).
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let kv_tiles = s.div_ceil(WSB_BN);
    if kv_tiles > 65_535 {
        candle_core::bail!("flash_bwd: S = {s} too long for the warp-specialized wgmma backward's grid (S <= {}); q {:?}, k {:?}", 65_535 * WSB_BN, q.shape(), k.shape())
    }
    // 32-bit kernel arithmetic: the kernel counts (H / Hkv) * ceil(T / 64) query tiles in an int;
    // the prep kernel's grid has one block per 4 rows.
    if (h / hkv) * t.div_ceil(WSB_BQ) > i32::MAX as usize || (b * t * h).div_ceil(4) > i32::MAX as usize {
        candle_core::bail!("flash_bwd: too many query rows for the warp-specialized wgmma backward's 32-bit counters; q {:?}, k {:?}", q.shape(), k.shape())
    }
    let (dout, lse, delta) = pr.launch_rows(lse, true)?;
    let inp = BwdInputs::lock((&q, &k, &v), (&dout, &lse, &delta))?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let acc = 0i32;
    let smem = if tma { wsb_smem_tma(d) } else { wsb_smem(d) };
    let cfg = LaunchConfig {
        grid_dim: (hkv as u32, kv_tiles as u32, b as u32),
        block_dim: (WSB_THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    // The band's device views (read-locked for the launch).
    let (lo_g, hi_g) = match &mask {
        WsbMask::Band { lo, hi } => (Some(lo.storage_and_layout()), Some(hi.storage_and_layout())),
        WsbMask::Mask(_) => (None, None),
    };
    // The kernel adds into dq: the caller's rows, or a fresh zero-filled buffer. SAFETY (dk, dv): every element is written by the kernel
    // (a key block without query tiles stores zeros).
    let (mut fresh, _) = dq_fresh(dev, &dq_out, b * t * h * d, true)?;
    let mut dq: CudaViewMut<'_, f32> = dq_view(dq_out, fresh.as_mut())?;
    let mut dk = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let mut dv = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    macro_rules! launch_wgmma_ws_bwd {
        ($ty:ty) => {{
            let (qv, kv, vv) = inp.qkv::<$ty>()?;
            let (do16, lv, delta) = inp.rows::<$ty>()?;
            match (&mask, &lo_g, &hi_g) {
                (WsbMask::Mask(m), _, _) if tma => {
                    let (causal, qo, qstr, ko, kstr) = m.args()?;
                    let (tq, tdo, tk, tv, tdq) = bwd_tma_maps(dev, sfx == "bf16", (&qv, &do16, &kv, &vv, &dq), (b, t, s, h, hkv, d))?;
                    let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_tma_{sfx}_d{d}"), ptx::FLASH_BWD_SM90_WS_MODULE, ptx::FLASH_BWD_SM90_WS)?;
                    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
                    let mut bld = func.builder();
                    bld.arg(&mut dq).arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
                    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
                    bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc);
                    bld.arg(&tq).arg(&tdo).arg(&tk).arg(&tv).arg(&tdq);
                    // SAFETY: matches `float* dq, float* dk, float* dv, PIPE_ARGS, TMA_BWD_MAPS` in
                    // kernels/flash_bwd_sm90_ws.cu; device, head dim and shared memory checked by `check`;
                    // the maps describe qv, do16, kv, vv and dq.
                    unsafe { bld.launch(cfg) }.w()?;
                }
                (WsbMask::Band { lo, .. }, Some((los, lol)), Some((his, hil))) if tma => {
                    let lov = util::view::<u32>(storage_of(los, "band lo", lo.shape())?, lol, "band lo")?;
                    let hiv = util::view::<u32>(storage_of(his, "band hi", lo.shape())?, hil, "band hi")?;
                    let bstride = util::to_i64(if lo.dim(0)? == 1 { 0 } else { t }, "band batch stride")?;
                    let (tq, tdo, tk, tv, tdq) = bwd_tma_maps(dev, sfx == "bf16", (&qv, &do16, &kv, &vv, &dq), (b, t, s, h, hkv, d))?;
                    let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_tma_band_{sfx}_d{d}"), ptx::FLASH_BWD_SM90_WS_MODULE, ptx::FLASH_BWD_SM90_WS)?;
                    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
                    let mut bld = func.builder();
                    bld.arg(&mut dq).arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
                    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
                    bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc);
                    bld.arg(&tq).arg(&tdo).arg(&tk).arg(&tv).arg(&tdq);
                    // SAFETY: matches `float* dq, float* dk, float* dv, PIPE_BAND_ARGS, TMA_BWD_MAPS` in
                    // kernels/flash_bwd_sm90_ws.cu; the band's shape and device checked by KBand::check.
                    unsafe { bld.launch(cfg) }.w()?;
                }
                (WsbMask::Mask(m), _, _) => {
                    let (causal, qo, qstr, ko, kstr) = m.args()?;
                    let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_ws_{sfx}_d{d}"), ptx::FLASH_BWD_SM90_WS_MODULE, ptx::FLASH_BWD_SM90_WS)?;
                    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
                    let mut bld = func.builder();
                    bld.arg(&mut dq).arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
                    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
                    bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc);
                    // SAFETY: matches `float* dq, float* dk, float* dv, PIPE_ARGS` in
                    // kernels/flash_bwd_sm90_ws.cu; device, head dim and shared memory checked by `check`.
                    unsafe { bld.launch(cfg) }.w()?;
                }
                (WsbMask::Band { lo, .. }, Some((los, lol)), Some((his, hil))) => {
                    let lov = util::view::<u32>(storage_of(los, "band lo", lo.shape())?, lol, "band lo")?;
                    let hiv = util::view::<u32>(storage_of(his, "band hi", lo.shape())?, hil, "band hi")?;
                    let bstride = util::to_i64(if lo.dim(0)? == 1 { 0 } else { t }, "band batch stride")?;
                    let func = dev.get_or_load_custom_func(&format!("flash_bwd_wgmma_ws_band_{sfx}_d{d}"), ptx::FLASH_BWD_SM90_WS_MODULE, ptx::FLASH_BWD_SM90_WS)?;
                    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
                    let mut bld = func.builder();
                    bld.arg(&mut dq).arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
                    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
                    bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc);
                    // SAFETY: matches `float* dq, float* dk, float* dv, PIPE_BAND_ARGS` in
                    // kernels/flash_bwd_sm90_ws.cu; the band's shape and device checked by KBand::check.
                    unsafe { bld.launch(cfg) }.w()?;
                }
                _ => candle_core::bail!("flash_bwd_band: the band's device views are missing"),
            }
        }};
    }
    match q.dtype() {
        DType::F16 => launch_wgmma_ws_bwd!(f16),
        DType::BF16 => launch_wgmma_ws_bwd!(bf16),
        dt => candle_core::bail!("flash_bwd: the warp-specialized wgmma backward takes f16/bf16, got {dt:?}; q {:?}", q.shape()),
    }
    Ok(bwd_out(dev, fresh, (dk, dv), (b, t, s, h, hkv, d)))
}
