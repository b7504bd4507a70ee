//! The flash-attention backward's entry points for the full/causal masks ([`bwd`], [`bwd_with`],
//! [`bwd_prepared`], [`bwd_prepared_add_dq`]), the CUDA-core / mma kernels they run themselves,
//! and the dQ-destination helpers every backward family shares ([`DqOut`], `dq_fresh`,
//! `dq_view`, `bwd_out`). CPU reference: `candle_cp_ops::attention::attention_bwd`.
//!
//! Shapes as in the parent module: q, out, dout `[B, T, H, D]`, k/v `[B, S, Hkv, D]`, lse f32
//! `[B, H, T]`; dq f32 `[B, T, H, D]`, dk/dv f32 `[B, S, Hkv, D]`.

use super::bwd_prep::{bwd_prep, BwdInputs, BwdPrep};
use super::core::{self, Core};
use super::{bwd_fused, bwd_pipe, bwd_sm90, bwd_sm90_ws, check_dims, family_takes, suffix, Dims, FwdImpl, KMask, Logits};
use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};
use half::{bf16, f16};

/// Where a backward's dQ goes: a fresh f32 `[B, T, H, D]` buffer (returned), or added into an
/// existing f32 `[B, T, H, D]` region (a ring's dQ accumulator rows: the kernels' `accumulate`
/// flag, or for the atomic-dQ kernels simply no zero fill), which saves the caller the buffer,
/// its zero fill and the pass that adds it.
pub enum DqOut<'a> {
    /// A new buffer.
    Fresh,
    /// Add into this contiguous f32 view of `B·T·H·D` elements.
    Add(CudaViewMut<'a, f32>),
}

/// A family's dQ, dK, dV: dQ only when it went to a fresh buffer ([`DqOut::Fresh`]).
pub(super) type BwdOut = (Option<Tensor>, Tensor, Tensor);

/// The fresh dQ buffer for `dq_out` (`n` elements, zero-filled when `zero`: the atomic kernels add
/// into it; none for [`DqOut::Add`]) and the dQ kernels' accumulate flag (1 for `Add`).
pub(super) fn dq_fresh(dev: &CudaDevice, dq_out: &DqOut<'_>, n: usize, zero: bool) -> Result<(Option<CudaSlice<f32>>, i32)> {
    Ok(match dq_out {
        DqOut::Add(_) => (None, 1),
        DqOut::Fresh if zero => (Some(dev.alloc_zeros::<f32>(n)?), 0),
        // SAFETY: the non-atomic dQ kernels write every element.
        DqOut::Fresh => (Some(unsafe { dev.alloc::<f32>(n)? }), 0),
    })
}

/// The view the dQ kernels write: the caller's rows or the fresh buffer of [`dq_fresh`].
pub(super) fn dq_view<'a>(dq_out: DqOut<'a>, fresh: Option<&'a mut CudaSlice<f32>>) -> Result<CudaViewMut<'a, f32>> {
    match (dq_out, fresh) {
        (DqOut::Add(v), _) => Ok(v),
        (DqOut::Fresh, Some(s)) => Ok(s.slice_mut(..)),
        (DqOut::Fresh, None) => candle_core::bail!("flash_bwd: no dq buffer (internal error)"),
    }
}

/// The backward kernels' f32 outputs as tensors: dq `[B, T, H, D]` when fresh, dk and dv
/// `[B, S, Hkv, D]`.
pub(super) fn bwd_out(dev: &CudaDevice, dq: Option<CudaSlice<f32>>, (dk, dv): (CudaSlice<f32>, CudaSlice<f32>), (b, t, s, h, hkv, d): Dims) -> BwdOut {
    (dq.map(|x| util::to_tensor(x, dev, (b, t, h, d))), util::to_tensor(dk, dev, (b, s, hkv, d)), util::to_tensor(dv, dev, (b, s, hkv, d)))
}

/// dQ of a [`DqOut::Fresh`] backward (the families return it whenever it was fresh).
pub(super) fn fresh_dq((dq, dk, dv): BwdOut) -> Result<(Tensor, Tensor, Tensor)> {
    match dq {
        Some(dq) => Ok((dq, dk, dv)),
        None => candle_core::bail!("flash_bwd: a fresh backward returned no dq (internal error)"),
    }
}

/// The f32 `[B, T, H, D]` view of `dq` (storage and layout of a tensor of that shape, contiguous)
/// that [`bwd_prepared_add_dq`] / [`super::band::bwd_band_prepared_add_dq`] add into.
pub(super) fn dq_region<'a>(dq: &'a mut CudaStorage, dq_l: &Layout, (b, t, h, d): (usize, usize, usize, usize), op: &str) -> Result<CudaViewMut<'a, f32>> {
    let Some((a0, a1)) = dq_l.contiguous_offsets() else {
        candle_core::bail!("{op}: the dq rows {:?} (stride {:?}) are not contiguous", dq_l.shape(), dq_l.stride())
    };
    if dq_l.dims() != [b, t, h, d] {
        candle_core::bail!("{op}: dq rows {:?}, expected [B, T, H, D] = {:?}", dq_l.shape(), [b, t, h, d])
    }
    Ok(dq.as_cuda_slice_mut::<f32>()?.slice_mut(a0..a1))
}

/// The backward of no rows or no keys: zeros (dQ only when fresh: nothing to add otherwise).
pub(super) fn zero_bwd(q: &Tensor, (b, t, s, h, hkv, d): Dims, dq_out: &DqOut<'_>) -> Result<BwdOut> {
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, q.device());
    let dq = match dq_out {
        DqOut::Fresh => Some(z(&[b, t, h, d])?),
        DqOut::Add(_) => None,
    };
    Ok((dq, z(&[b, s, hkv, d])?, z(&[b, s, hkv, d])?))
}

/// The checks of an unprepared backward call before its prep: q, k, v on a CUDA device with the
/// kernels' shapes, out/dout `[B, T, H, D]` and lse `[B, H, T]` of q's rows, a kernel dtype.
pub(super) fn check_bwd_rows(op: &str, (q, k, v): (&Tensor, &Tensor, &Tensor), (out, lse, dout): (&Tensor, &Tensor, &Tensor)) -> Result<()> {
    util::cuda_device(q, &format!("{op}: q"))?;
    let (b, t, _, h, _, d) = check_dims(op, q.shape(), k.shape(), v.shape())?;
    if out.dims() != [b, t, h, d] || dout.dims() != [b, t, h, d] || lse.dims() != [b, h, t] {
        candle_core::bail!(
            "{op}: expected out/dout [B, T, H, D] = {:?} and lse [B, H, T], got out {:?}, dout {:?}, lse {:?}",
            q.shape(), out.shape(), dout.shape(), lse.shape()
        )
    }
    suffix(q.dtype()).map(|_| ())
}

/// The checks of a prepared backward call: q's device and the kernels' shapes, lse `[B, H, T]`,
/// the prep's rows ([`BwdPrep`]), one dtype for q, k, v. Returns the device and the dims.
pub(super) fn check_prepared(op: &str, (q, k, v): (&Tensor, &Tensor, &Tensor), lse: &Tensor, pr: &BwdPrep) -> Result<(CudaDevice, Dims)> {
    let dev = util::cuda_device(q, &format!("{op}: q"))?;
    let dims = check_dims(op, q.shape(), k.shape(), v.shape())?;
    let (b, t, _, h, _, _) = dims;
    if lse.dims() != [b, h, t] {
        candle_core::bail!("{op}: expected lse [B, H, T] for q {:?}, got {:?}", q.shape(), lse.shape())
    }
    pr.check(op, q)?;
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!("{op}: q, k, v dtypes differ ({:?}, {:?}, {:?})", q.dtype(), k.dtype(), v.dtype())
    }
    Ok((dev, dims))
}

/// Raw backward on CUDA tensors, no graph. `out` `[B, T, H, D]` and `lse` `[B, H, T]` belong to
/// the *whole* attention of these query rows (global LSE in a ring); `dout` `[B, T, H, D]`.
/// Returns f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]` (summed over each KV head's query
/// heads). Runs delta = rowsum(dO * O), then the dK/dV and dQ kernels (no atomics). Kernel
/// choice from `CANDLE_CP_FLASH_IMPL` (see [`FwdImpl::from_env`]); [`bwd_with`] takes it.
#[allow(clippy::too_many_arguments)]
pub fn bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    mask: KMask,
    scale: impl Into<Logits>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Logits = scale.into();
    bwd_with(q, k, v, out, lse, dout, mask, scale, FwdImpl::from_env())
}

/// [`bwd`] with an explicit kernel choice: `Pipelined` (f16/bf16 only) runs
/// `kernels/flash_bwd_pipe.cu` (tensor cores, cp.async double buffering, ldmatrix; dO, P and dS
/// rounded to 16 bits), `Mma` (f16/bf16 only) runs `kernels/flash_bwd_mma.cu` (tensor cores, P
/// and dS rounded to 16 bits), `Simple` runs `kernels/flash_bwd.cu` (f32 math on CUDA cores),
/// `Auto` picks `Pipelined` for f16/bf16 and `Simple` for f32; the opt-in `Wgmma` (Hopper,
/// f16/bf16, head dims 64/128) runs the `Pipelined` prep kernel, then the wgmma dK/dV and dQ
/// kernels of `kernels/flash_bwd_sm90.cu`. All of them are deterministic, except the opt-in
/// `AtomicDq` (f16/bf16 only): `kernels/flash_bwd_fused.cu`, one fused dK/dV/dQ kernel whose dQ
/// is summed with f32 atomics in a nondeterministic order, and the opt-in `WgmmaAtomic` (as
/// `Wgmma`, but dQ computed with wgmma inside the dK/dV kernel and summed with f32 atomics) and the
/// opt-in `WgmmaWs` (the same computation in the warp-specialized `kernels/flash_bwd_sm90_ws.cu`:
/// producer warpgroup, mbarrier ring, two consumer warpgroups).
#[allow(clippy::too_many_arguments)]
pub fn bwd_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    mask: KMask,
    scale: impl Into<Logits>,
    imp: FwdImpl,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Logits = scale.into();
    check_bwd_rows("flash_bwd", (q, k, v), (out, lse, dout))?;
    bwd_prepared(q, k, v, lse, &bwd_prep(out, dout, q.dtype())?, mask, scale, imp)
}

/// [`bwd_with`] on a prepared backward ([`bwd_prep`] of the whole attention's out and dO for these
/// query rows, or its [`BwdPrep::narrow_rows`]): what a ring runs at each step, so that delta and the
/// 16-bit dO are made once per backward instead of once per step. `lse` `[B, H, T]` as in [`bwd`].
#[allow(clippy::too_many_arguments)]
pub fn bwd_prepared(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    pr: &BwdPrep,
    mask: KMask,
    scale: impl Into<Logits>,
    imp: FwdImpl,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Logits = scale.into();
    fresh_dq(bwd_prepared_to(q, k, v, lse, pr, mask, scale, imp, DqOut::Fresh)?)
}

/// [`bwd_prepared`] adding dQ into `dq` (the storage and layout of an f32 `[B, T, H, D]`
/// tensor, contiguous: e.g. rows of a ring's dQ accumulator, written in place) instead of
/// returning it; returns dK, dV `[B, S, Hkv, D]` (f32).
#[allow(clippy::too_many_arguments)]
pub fn bwd_prepared_add_dq(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    pr: &BwdPrep,
    mask: KMask,
    scale: impl Into<Logits>,
    imp: FwdImpl,
    (dq, dq_l): (&mut CudaStorage, &Layout),
) -> Result<(Tensor, Tensor)> {
    let scale: Logits = scale.into();
    add_dq(q, (dq, dq_l), "flash_bwd", |out| bwd_prepared_to(q, k, v, lse, pr, mask, scale, imp, out))
}

/// A backward whose dQ goes into `dq` (the rows [`dq_region`] checks against q): dK, dV.
/// [`bwd_prepared_add_dq`] and [`super::band::bwd_band_prepared_add_dq`].
pub(super) fn add_dq(q: &Tensor, (dq, dq_l): (&mut CudaStorage, &Layout), op: &str, run: impl FnOnce(DqOut<'_>) -> Result<BwdOut>) -> Result<(Tensor, Tensor)> {
    let view = dq_region(dq, dq_l, q.dims4()?, op)?;
    let (_, dk, dv) = run(DqOut::Add(view))?;
    Ok((dk, dv))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_prepared_to(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    pr: &BwdPrep,
    mask: KMask,
    logits: Logits,
    imp: FwdImpl,
    dq_out: DqOut<'_>,
) -> Result<BwdOut> {
    let (dev, (b, t, s, h, hkv, d)) = check_prepared("flash_bwd", (q, k, v), lse, pr)?;
    logits.check("flash_bwd", q.shape())?;
    let imp = core::family_for(&dev, logits.bwd_family(imp), d, "flash_bwd", q.shape())?;
    let (scale, cap): (f32, f32) = (logits.scale, logits.cap);
    let sfx = suffix(q.dtype())?;
    let (use_mma, pipe) = match imp {
        FwdImpl::Auto => (false, sfx != "f32"),
        FwdImpl::Simple => (false, false),
        FwdImpl::Mma | FwdImpl::Pipelined | FwdImpl::Wgmma | FwdImpl::WgmmaAtomic | FwdImpl::WgmmaWs | FwdImpl::WgmmaTma | FwdImpl::WgmmaTmaWide | FwdImpl::AtomicDq if sfx == "f32" => candle_core::bail!("flash_bwd: the tensor-core kernels take f16/bf16, got f32; q {:?}", q.shape()),
        FwdImpl::Mma => (true, false),
        FwdImpl::Pipelined => (false, true),
        // Run bwd_sm90 / bwd_fused below.
        FwdImpl::Wgmma | FwdImpl::WgmmaAtomic | FwdImpl::WgmmaWs | FwdImpl::WgmmaTma | FwdImpl::WgmmaTmaWide | FwdImpl::AtomicDq => (false, false),
    };
    let wgmma = matches!(imp, FwdImpl::Wgmma | FwdImpl::WgmmaAtomic);
    if imp == FwdImpl::AtomicDq {
        bwd_fused::check_fits(&dev, d, q.shape())?;
    }
    if wgmma {
        bwd_sm90::check(&dev, d, imp == FwdImpl::WgmmaAtomic, q.shape(), k.shape())?;
    }
    let ws = imp == FwdImpl::WgmmaWs || imp.tma();
    if ws {
        bwd_sm90_ws::check(&dev, d, q.shape(), k.shape(), imp.tma())?;
    }
    // Auto runs the mma kernels where the pipelined ones need more shared memory per block than
    // the device allows (d = 128 on sm_86/sm_89/sm_120); an explicit choice is an error there.
    // (At head dim 256, which has no mma kernels, the CUDA-core ones.)
    // (a soft cap: never the mma kernels, which take none)
    let (use_mma, pipe) = if pipe && !bwd_pipe::fits(&dev, d, imp, q.shape())? { (family_takes(FwdImpl::Mma, d) && cap == 0.0, false) } else { (use_mma, pipe) };
    if b * t * h == 0 || s == 0 {
        return zero_bwd(q, (b, t, s, h, hkv, d), &dq_out);
    }
    let dims = (b, t, s, h, hkv, d);
    if wgmma {
        let atomic = imp == FwdImpl::WgmmaAtomic;
        return bwd_sm90::bwd_wgmma(&dev, (q, k, v), (lse, pr), dims, mask, scale, atomic, dq_out);
    }
    if ws {
        return bwd_sm90_ws::bwd_wgmma_ws(&dev, (q, k, v), (lse, pr), dims, bwd_sm90_ws::WsbMask::Mask(mask), scale, imp.tma(), dq_out);
    }
    if imp == FwdImpl::AtomicDq {
        return bwd_fused::bwd_fused(&dev, (q, k, v), (lse, pr), dims, mask, scale, dq_out);
    }
    if pipe {
        return bwd_pipe::bwd_pipe(&dev, (q, k, v), (lse, pr), dims, mask, logits, dq_out);
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (dout, lse, delta) = pr.launch_rows(lse, false)?;
    let inp = BwdInputs::lock((&q, &k, &v), (&dout, &lse, &delta))?;
    let (dov, lv, delta): (CudaView<'_, f32>, CudaView<'_, f32>, CudaView<'_, f32>) = inp.rows()?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let (causal, qo, qstr, ko, kstr) = mask.args()?;
    let acc = 0i32;

    // SAFETY (all allocations below): every element is written by the kernels.
    let (mut fresh, acc_dq) = dq_fresh(&dev, &dq_out, b * t * h * d, false)?;
    let mut dq: CudaViewMut<'_, f32> = dq_view(dq_out, fresh.as_mut())?;
    let mut dk = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let mut dv = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    macro_rules! launch_bwd {
        ($ty:ty) => {{
            let (qv, kv, vv) = inp.qkv::<$ty>()?;
            let (pre, module, src) = if use_mma {
                ("flash_bwd_mma", ptx::FLASH_BWD_MMA_MODULE, ptx::FLASH_BWD_MMA)
            } else {
                ("flash_bwd", ptx::FLASH_BWD_MODULE, ptx::FLASH_BWD)
            };
            let name = format!("{pre}_dkdv_{sfx}_d{d}");
            let smem = if use_mma { 0 } else { core::core_smem(Core::Dkdv, d) };
            let func = dev.get_or_load_custom_func(&name, module, src)?;
            core::opt_in(&func, smem)?;
            let threads = if use_mma { 64 } else { 128 };
            let cfg = LaunchConfig { grid_dim: (s.div_ceil(32) as u32, hkv as u32, b as u32), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
            let mut bld = func.builder();
            bld.arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale).arg(&cap);
            bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc);
            // SAFETY: matches `float* dk, float* dv, BWD_ARGS_COMMON` in kernels/flash_bwd{,_mma}.cu.
            unsafe { bld.launch(cfg) }.w()?;

            let name = format!("{pre}_dq_{sfx}_d{d}");
            let smem = if use_mma { 0 } else { core::core_smem(Core::Dq, d) };
            let func = dev.get_or_load_custom_func(&name, module, src)?;
            core::opt_in(&func, smem)?;
            let rows = if use_mma { 64 } else { 8 };
            let cfg = LaunchConfig { grid_dim: (t.div_ceil(rows) as u32, h as u32, b as u32), block_dim: (128, 1, 1), shared_mem_bytes: smem };
            let mut bld = func.builder();
            bld.arg(&mut dq).arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale).arg(&cap);
            bld.arg(&causal).arg(&qo).arg(&qstr).arg(&ko).arg(&kstr).arg(&acc_dq);
            // SAFETY: matches `float* dq, BWD_ARGS_COMMON` in kernels/flash_bwd{,_mma}.cu.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match q.dtype() {
        DType::F32 => launch_bwd!(f32),
        DType::F16 => launch_bwd!(f16),
        _ => launch_bwd!(bf16),
    }
    Ok(bwd_out(&dev, fresh, (dk, dv), (b, t, s, h, hkv, d)))
}
