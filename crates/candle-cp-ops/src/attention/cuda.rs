//! CUDA path of the attention ops: the same API as the CPU path, dispatching to the kernels of
//! `candle-cp-kernels` (flash forward with LSE, backward, f32 merge). Compiled only with the
//! `cuda` feature. Reference for every function here: the CPU implementation in this module's
//! parent, compared on a GPU by `examples/gpu_check.rs`.
//!
//! Forward kernel choice: tensor cores for f16/bf16, CUDA cores for f32; override with
//! `CANDLE_CP_FLASH_IMPL=simple|mma`. Head dims 16, 32, 64, 128 on every kernel family; 256
//! (Gemma 3 1B / 4B / 12B) on the CUDA-core and pipelined tensor-core kernels: a family without
//! kernels there (mma, fused, Hopper) runs `Auto`'s (`FwdImpl::for_head_dim`).
//!
//! Bands ([`Band`]: windows, packed documents, per-batch masks): the band kernels of the
//! `Simple`, `Pipelined` and Hopper families (`candle_cp_kernels::flash::{fwd_band, bwd_band}`);
//! `Mma` and `AtomicDq` fall back to `Auto`'s under a band.
//!
//! A logit soft cap ([`Scores::softcap`], Gemma 2) runs on the CUDA-core kernels and the pipelined
//! forward (`flash::Logits`): the other families' choices give way to those. The bounds are copied to the device at each call unless the
//! band holds a device copy (`Band::upload_all`: the ring uploads all its steps' bands at once).

use super::Scores;
use super::op::AttentionOp;
use super::{Band, BwdPrep, Mask};
use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Device, Layout, Result, Shape, Storage, Tensor};
use candle_cp_kernels::flash::{self, FwdImpl, KBand, KMask, Logits};

/// Head dims the CUDA kernels take (others: use the host-copy fallback or get an error):
/// `candle_cp_kernels::flash::head_dim_supported` (16, 32, 64, 128, and 96 and 256 on some
/// families: `flash::family_takes`).
pub(crate) fn supported(head_dim: usize) -> bool {
    flash::head_dim_supported(head_dim)
}

/// The smallest head dim at least `d` that the CUDA kernels take (`d` itself when none does).
pub(crate) fn width_at_least(d: usize) -> usize {
    flash::HEAD_DIMS.iter().chain(&flash::PARTIAL_HEAD_DIMS).copied().filter(|&w| w >= d).min().unwrap_or(d)
}

/// The kernel family for q `[B, T, H, D]`: `CANDLE_CP_FLASH_IMPL`'s, or `Auto` where that family
/// has no kernels at the head dim (`FwdImpl::for_head_dim`: the fused and Hopper families at 96
/// and 256, the mma one at 256).
fn imp(q: &Tensor) -> FwdImpl {
    imp_of_dims(q.dims())
}

/// [`imp`] from q's dims.
fn imp_of_dims(dims: &[usize]) -> FwdImpl {
    FwdImpl::from_env().for_head_dim(dims.last().copied().unwrap_or(0))
}

/// The logits as the kernels take them (scale and soft cap; a capped call runs the CUDA-core
/// kernels or the pipelined forward, `flash::Logits`).
fn kscale(s: Scores) -> Logits {
    Logits::capped(s.scale as f32, s.softcap.map_or(0.0, |c| c as f32))
}

/// Kernel mask from the op's [`Mask`].
pub(crate) fn kmask(m: &Mask) -> KMask {
    match *m {
        Mask::Full => KMask::full(),
        Mask::Causal { q_offset, q_stride, k_offset, k_stride } => KMask::causal(q_offset, q_stride, k_offset, k_stride),
        // never reaches a kernel (split into full and causal calls first; AttentionOp rejects
        // window masks): an all-masked kernel mask, should it ever
        Mask::Window { .. } => KMask::causal(0, 1, 1, 1),
    }
}

/// `AttentionOp::cuda_fwd`: out `[B, T, H, D]` (f32 when `op.f32_out`, else q's dtype, cast
/// once from the f32 kernel output); lse f32 `[B, H, T]` goes to the op's slot.
#[allow(clippy::too_many_arguments)]
pub(crate) fn op_fwd(
    op: &AttentionOp,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let ((out, out_shape), (lse, lse_shape)) = match &op.band {
        Some(band) => {
            let (lo, hi) = band_tensors(band, &Device::Cuda(q.device.clone()))?;
            flash::fwd_storage_band(q, ql, k, kl, v, vl, KBand { lo: &lo, hi: &hi }, kscale(op.scale), imp_of_dims(ql.dims()))?
        }
        None => flash::fwd_storage(q, ql, k, kl, v, vl, kmask(&op.mask), kscale(op.scale), imp_of_dims(ql.dims()))?,
    };
    let lse = Tensor::from_storage(Storage::Cuda(lse), lse_shape, candle_core::op::BackpropOp::none(), false);
    *op.lse_slot().lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
    if op.f32_out || q.dtype() == DType::F32 {
        return Ok((out, out_shape));
    }
    let view = out.as_cuda_slice::<f32>()?.slice(..);
    let cast = candle_cp_kernels::merge::cast_f32(&out.device, &view, q.dtype())?;
    Ok((cast, out_shape))
}

// `fwd`, `bwd` and `merge` are the CUDA branches of `attention_fwd`, `attention_bwd` and
// `merge` (parent module).

/// CUDA `attention_fwd` (raw, no graph): out f32 `[B, T, H, D]`, lse f32 `[B, H, T]`.
pub(crate) fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: Scores) -> Result<(Tensor, Tensor)> {
    flash::fwd(q, k, v, kmask(mask), kscale(scale), imp(q))
}

/// CUDA `attention_bwd_prepared` (raw, no graph): f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]`.
pub(crate) fn bwd(q: &Tensor, k: &Tensor, v: &Tensor, lse: &Tensor, prep: &BwdPrep, mask: &Mask, scale: Scores) -> Result<(Tensor, Tensor, Tensor)> {
    flash::bwd_prepared(q, k, v, lse, &prep.kernel(), kmask(mask), kscale(scale), imp(q))
}

/// CUDA backward of `call` adding its dQ into `dq` (an f32 `[B, n, H, D]` contiguous region, the
/// rows of a ring's dQ accumulator); returns dk, dv `[B, S, Hkv, D]`.
pub(crate) fn bwd_add_dq(call: &super::call::BwdCall<'_>, dq: (&mut CudaStorage, &Layout)) -> Result<(Tensor, Tensor)> {
    let super::call::BwdCall { q, k, v, lse, prep, scale, .. } = *call;
    let (b, n, h, _) = q.dims4()?;
    super::check_like("attention_bwd", "lse", lse, &[b, h, n], q)?;
    let dims = super::check_qkv("attention_bwd", q, k, v, &Mask::Full)?;
    prep.check("attention_bwd", q, dims)?;
    let kp = prep.kernel();
    match call.mask {
        super::call::CallMask::Mask(m) => flash::bwd_prepared_add_dq(q, k, v, lse, &kp, kmask(m), kscale(scale), imp(q), dq),
        super::call::CallMask::Band(band) => {
            let (lo, hi) = band_args(band, "attention_bwd_band", (b, n, dims.s), q.device())?;
            flash::bwd_band_prepared_add_dq(q, k, v, lse, &kp, KBand { lo: &lo, hi: &hi }, kscale(scale), imp(q), dq)
        }
    }
}

/// CUDA forward of one call into the packed buffer `[B·n·H·D + B·H·n]` (out, then lse).
pub(crate) fn fwd_packed(q: &Tensor, k: &Tensor, v: &Tensor, mask: super::call::CallMask<'_>, scale: Scores) -> Result<Tensor> {
    match mask {
        super::call::CallMask::Mask(m) => flash::fwd_packed(q, k, v, kmask(m), kscale(scale), imp(q)),
        super::call::CallMask::Band(band) => {
            let (b, t, _, _) = q.dims4()?;
            let (lo, hi) = band_args(band, "attention_fwd_band", (b, t, k.dim(1)?), q.device())?;
            flash::fwd_band_packed(q, k, v, KBand { lo: &lo, hi: &hi }, kscale(scale), imp(q))
        }
    }
}

/// CUDA forward of one call folded into rows `row0 .. row0 + n` of the ring state's buffer
/// (`flash::fwd_fold`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn fwd_fold(q: &Tensor, k: &Tensor, v: &Tensor, mask: super::call::CallMask<'_>, scale: Scores, state: &Tensor, rows: usize, row0: usize) -> Result<()> {
    match mask {
        super::call::CallMask::Mask(m) => flash::fwd_fold(q, k, v, kmask(m), kscale(scale), imp(q), state, rows, row0),
        super::call::CallMask::Band(band) => {
            let (b, t, _, _) = q.dims4()?;
            let (lo, hi) = band_args(band, "attention_fwd_band", (b, t, k.dim(1)?), q.device())?;
            flash::fwd_band_fold(q, k, v, KBand { lo: &lo, hi: &hi }, kscale(scale), imp(q), state, rows, row0)
        }
    }
}

/// The bounds of `band` for a call of `b` batch rows, `t` query rows and `s` keys on `dev`,
/// checked ([`Band::check`]), as [`band_tensors`] gives them.
fn band_args(band: &Band, op: &str, (b, t, s): (usize, usize, usize), dev: &Device) -> Result<(Tensor, Tensor)> {
    band.check(op, b, t, s)?;
    band_tensors(band, dev)
}

/// The bounds of `band` as u32 tensors `[batch, T]` on `dev` (lo, hi): its device copy when
/// it has one on `dev` ([`Band::upload_all`]), else copied now.
fn band_tensors(band: &Band, dev: &Device) -> Result<(Tensor, Tensor)> {
    if let Some((lo, hi)) = band.device_bounds(dev) {
        return Ok((lo.clone(), hi.clone()));
    }
    let shape = (band.batch(), band.rows());
    Ok((Tensor::from_slice(band.lo(), shape, dev)?, Tensor::from_slice(band.hi(), shape, dev)?))
}

/// CUDA `attention_fwd_band` (raw, no graph): out f32 `[B, T, H, D]`, lse f32 `[B, H, T]`.
pub(crate) fn fwd_band(q: &Tensor, k: &Tensor, v: &Tensor, band: &Band, scale: Scores) -> Result<(Tensor, Tensor)> {
    let (lo, hi) = band_tensors(band, q.device())?;
    flash::fwd_band(q, k, v, KBand { lo: &lo, hi: &hi }, kscale(scale), imp(q))
}

/// CUDA `attention_bwd_band_prepared` (raw, no graph): f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]`.
pub(crate) fn bwd_band(q: &Tensor, k: &Tensor, v: &Tensor, lse: &Tensor, prep: &BwdPrep, band: &Band, scale: Scores) -> Result<(Tensor, Tensor, Tensor)> {
    let (lo, hi) = band_tensors(band, q.device())?;
    flash::bwd_band_prepared(q, k, v, lse, &prep.kernel(), KBand { lo: &lo, hi: &hi }, kscale(scale), imp(q))
}

/// CUDA `merge`: f32 out `[B, T, H, D]`, lse `[B, H, T]`.
pub(crate) fn merge(out_a: &Tensor, lse_a: &Tensor, out_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
    candle_cp_kernels::merge::merge(out_a, lse_a, out_b, lse_b)
}
