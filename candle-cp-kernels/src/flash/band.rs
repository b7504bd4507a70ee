//! Band-masked flash attention: query row `i` of batch row `b` sees the key rows
//! `lo[b][i] <= j < hi[b][i]` (local indices). CPU reference:
//! `candle_cp_ops::attention::{attention_fwd_band, attention_bwd_band}` (the bands come from
//! `candle_cp_ops::attention::Band`, which checks the invariants below).
//!
//! Kernels: the `_band_` entries of `kernels/flash_fwd.cu` (`flash_fwd_{simple,pipe}_band_*`),
//! `kernels/flash_bwd.cu` (`flash_bwd_{dkdv,dq}_band_*`) and `kernels/flash_bwd_pipe.cu`
//! (`flash_bwd_pipe_{dkdv,dq}_band_*`, after `flash_bwd_pipe_prep_*`): the `Simple` and
//! `Pipelined` kernels with the mask arguments replaced by the band (`CpBand` in
//! `kernels/common.cuh`). The Hopper kernels have band entries too (`flash_fwd_wgmma_band_*`,
//! `flash_bwd_wgmma_{dkdv,dq,atomic}_band_*` in `kernels/flash_{fwd,bwd}_sm90.cu`, run by `Wgmma` /
//! `WgmmaAtomic`; `flash_{fwd,bwd}_wgmma_ws_band_*` in `kernels/flash_{fwd,bwd}_sm90_ws.cu`, run by
//! `WgmmaWs`; the forward's TMA entries `flash_fwd_wgmma_tma_band_*`, with `WgmmaWs`'s backward, by
//! `WgmmaTma` and `WgmmaTmaWide`) where they apply (f16/bf16, head dims 64/128, compute capability 9.x). Otherwise
//! (`Mma`, `AtomicDq`, a Hopper family elsewhere) `Auto`'s family runs under a band (see
//! [`FwdImpl`]).

use super::bwd_pipe::PipeCfg;
use super::core::{self, Core};
use super::{add_dq, bwd_out, dq_fresh, dq_view, fresh_dq, packed_fwd, zero_bwd, BwdOut, DqOut, FwdDst, bwd_sm90, bwd_sm90_ws, check_bwd_rows, check_dims, check_prepared, pipe_config_of, pipe_pads_bounds, prep, sm90, sm90_ws, storage_of, suffix, bwd_prep, BwdInputs, BwdPrep, Dims, FwdImpl, Logits};
use crate::{ptx, util};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

/// A band on the device: `lo`, `hi` u32 `[batch, T]` (contiguous; `batch` 1: one band shared by
/// every batch row, else `B`), both non-decreasing along `T`, `lo <= hi <= S`. The kernels trust
/// these invariants (build the band with `candle_cp_ops::attention::Band`, which checks them);
/// they never read or write outside q, k, v and the outputs whatever the values.
#[derive(Clone, Copy, Debug)]
pub struct KBand<'a> {
    /// Lower bounds (first visible key row), u32 `[batch, T]`.
    pub lo: &'a Tensor,
    /// Upper bounds (one past the last visible key row), u32 `[batch, T]`.
    pub hi: &'a Tensor,
}

impl KBand<'_> {
    /// Checks dtype, shape and device against a call with batch `b` and `t` query rows on `dev`.
    pub(super) fn check(&self, op: &str, b: usize, t: usize, dev: &CudaDevice) -> Result<()> {
        let (lb, lt) = self.lo.dims2()?;
        if self.lo.dtype() != DType::U32 || self.hi.dtype() != DType::U32 || self.hi.dims() != self.lo.dims() || lt != t || (lb != 1 && lb != b) {
            candle_core::bail!(
                "{op}: band lo {:?} ({:?}) and hi {:?} ({:?}) must be u32 [1 or B, T] with B = {b}, T = {t}",
                self.lo.shape(), self.lo.dtype(), self.hi.shape(), self.hi.dtype()
            )
        }
        let q_dev = candle_core::Device::Cuda(dev.clone());
        for (what, x) in [("lo", self.lo), ("hi", self.hi)] {
            util::cuda_device(x, &format!("{op}: band {what}"))?;
            if !x.device().same_device(&q_dev) {
                candle_core::bail!("{op}: band {what} {:?} is on {:?}, q on {q_dev:?}", x.shape(), x.device())
            }
        }
        Ok(())
    }
}

/// Batch stride of checked bounds `[batch, t]`: 0 for a shared band, else `t`.
fn bstride_of(lo: &Tensor, t: usize) -> usize {
    if lo.dim(0).unwrap_or(1) == 1 {
        0
    } else {
        t
    }
}

/// Which band kernels a call runs: the `Pipelined` ones for f16/bf16 (unless `imp` is `Simple`,
/// the scale is <= 0, or the device lacks the shared memory and `imp` is not `Pipelined`), the
/// `Simple` ones otherwise.
fn use_pipe(dev: &CudaDevice, sfx: &str, imp: FwdImpl, scale: f32, need: u32, what: &str, q: &Shape) -> Result<bool> {
    if sfx == "f32" || imp == FwdImpl::Simple || scale <= 0.0 {
        return Ok(false);
    }
    let optin = util::smem_optin(dev)?;
    if i64::from(need) <= optin {
        return Ok(true);
    }
    if imp == FwdImpl::Pipelined {
        candle_core::bail!("{what}: the pipelined band kernel needs {need} bytes of shared memory per block, the device allows {optin}; q {q:?}")
    }
    Ok(false)
}


/// Dynamic shared memory of `flash_fwd_pipe_band_*`: the non-band kernel's plus BQ ints (the
/// per-row lower bounds), none at d = 256 (they share the Q rows' padding: `pipe_pads_bounds`).
/// (`capped`: the soft-capped entries, `pipe_config_of`.)
fn pipe_band_smem(d: usize, capped: bool) -> (usize, u32, u32) {
    let (rows, threads, smem) = pipe_config_of(d, capped);
    (rows, threads, smem + if pipe_pads_bounds(d) { 0 } else { rows as u32 * 4 })
}

/// Band forward on storages (for `CustomOp3::cuda_fwd`): out f32 `[B, T, H, D]`, lse f32
/// `[B, H, T]` with their shapes. A row with an empty interval gets out 0 and lse `-inf`.
#[allow(clippy::too_many_arguments)]
pub fn fwd_storage_band(
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
    band: KBand<'_>,
    scale: impl Into<Logits>,
    imp: FwdImpl,
) -> Result<((CudaStorage, Shape), (CudaStorage, Shape))> {
    let scale: Logits = scale.into();
    let dims = check_dims("flash_fwd_band", ql.shape(), kl.shape(), vl.shape())?;
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!("flash_fwd_band: q, k, v dtypes differ ({:?}, {:?}, {:?}); q {:?}", q.dtype(), k.dtype(), v.dtype(), ql.shape())
    }
    let (b, t, _, h, _, d) = dims;
    let dev = q.device.clone();
    band.check("flash_fwd_band", b, t, &dev)?;
    // SAFETY: the forward writes every element of both (FwdDst::empty where it has no rows).
    let (mut out, mut lse) = unsafe { (dev.alloc::<f32>(b * t * h * d)?, dev.alloc::<f32>(b * h * t)?) };
    fwd_band_to((q, ql), (k, kl), (v, vl), dims, band, scale, imp, FwdDst::plain(out.slice_mut(..), lse.slice_mut(..)))?;
    Ok((
        (CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from((b, t, h, d))),
        (CudaStorage::wrap_cuda_slice(lse, dev), Shape::from((b, h, t))),
    ))
}

/// The band forward into `dst` (checked dims and band).
#[allow(clippy::too_many_arguments)]
pub(super) fn fwd_band_to(
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    dims: Dims,
    band: KBand<'_>,
    scale: Logits,
    imp: FwdImpl,
    dst: FwdDst<'_>,
) -> Result<()> {
    let dev = q.device.clone();
    let sfx = suffix(q.dtype())?;
    let bnd = (band.lo, band.hi);
    match q.dtype() {
        DType::F32 => fwd_band_t::<f32>(&dev, sfx, (q, ql), (k, kl), (v, vl), dims, bnd, scale, imp, dst),
        DType::F16 => fwd_band_t::<f16>(&dev, sfx, (q, ql), (k, kl), (v, vl), dims, bnd, scale, imp, dst),
        _ => fwd_band_t::<bf16>(&dev, sfx, (q, ql), (k, kl), (v, vl), dims, bnd, scale, imp, dst),
    }
}

/// [`fwd_band`] into ONE f32 buffer, out then lse (see [`super::fwd_packed`]).
pub fn fwd_band_packed(q: &Tensor, k: &Tensor, v: &Tensor, band: KBand<'_>, scale: impl Into<Logits>, imp: FwdImpl) -> Result<Tensor> {
    let scale: Logits = scale.into();
    let (blo, bhi) = (band.lo.contiguous()?, band.hi.contiguous()?);
    packed_fwd("flash_fwd_band", (q, k, v), |[qs, ks, vs], dims, dst| {
        band.check("flash_fwd_band", dims.0, dims.1, &qs.0.device)?;
        fwd_band_to(qs, ks, vs, dims, KBand { lo: &blo, hi: &bhi }, scale, imp, dst)
    })
}


#[allow(clippy::too_many_arguments)]
fn fwd_band_t<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    sfx: &str,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    (b, t, s, h, hkv, d): Dims,
    (blo, bhi): (&Tensor, &Tensor),
    logits: Logits,
    imp: FwdImpl,
    dst: FwdDst<'_>,
) -> Result<()> {
    logits.check("flash_fwd_band", ql.shape())?;
    let imp = core::family_for(dev, logits.fwd_family(imp), d, "flash_fwd_band", ql.shape())?;
    let (scale, cap): (f32, f32) = (logits.scale, logits.cap);
    if b * t * h == 0 {
        return dst.empty(dev);
    }
    let (los, lol) = blo.storage_and_layout();
    let (his, hil) = bhi.storage_and_layout();
    let lov = util::view::<u32>(storage_of(&los, "band lo", blo.shape())?, lol, "band lo")?;
    let hiv = util::view::<u32>(storage_of(&his, "band hi", bhi.shape())?, hil, "band hi")?;
    let bstride = util::to_i64(bstride_of(blo, t), "band batch stride")?;
    let dims = (b, t, s, h, hkv, d);
    if imp.tma() && sm90_ws::applies(dev, sfx, d)? {
        // (WgmmaTmaWide: bands keep the 128-key entries)
        let band = sm90_ws::TmaMask::Band { lo: &lov, hi: &hiv, bstride };
        return sm90_ws::fwd_wgmma_tma::<T>(dev, sfx, (q, ql), (k, kl), (v, vl), dims, band, scale, false, dst);
    }
    if matches!(imp, FwdImpl::Wgmma | FwdImpl::WgmmaAtomic | FwdImpl::WgmmaWs) && sm90_ws::applies(dev, sfx, d)? {
        let ws = imp == FwdImpl::WgmmaWs;
        return sm90::fwd_hopper_band::<T>(dev, sfx, (q, ql), (k, kl), (v, vl), dims, &lov, &hiv, bstride, scale, ws, dst);
    }
    let pipe = use_pipe(dev, sfx, imp, scale, pipe_band_smem(d, cap > 0.0).2, "flash_fwd_band", ql.shape())?;
    let inp = util::FwdQkv::<T>::new(dev, (q, ql), (k, kl), (v, vl), pipe)?;
    let (qv, kv, vv) = inp.qkv_views()?;
    let (o_t, o_row0, o_merge): (i32, i32, i32) = dst.kernel_args(t)?;
    // The kernel writes every element of out and lse (rows < T, all heads, all d).
    let (mut out, mut lse): (CudaViewMut<'_, f32>, CudaViewMut<'_, f32>) = (dst.out, dst.lse);
    let (kind, rows, threads, smem) = if pipe {
        let (rows, threads, smem) = pipe_band_smem(d, cap > 0.0);
        (if cap > 0.0 { "pipe_cap" } else { "pipe" }, rows, threads, smem)
    } else {
        ("simple", 16, 128, core::core_smem(Core::Fwd, d))
    };
    let name = format!("flash_fwd_{kind}_band_{sfx}_d{d}");
    let func = dev.get_or_load_custom_func(&name, ptx::FLASH_FWD_MODULE, ptx::FLASH_FWD)?;
    if smem > 48 * 1024 {
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    }
    let cfg = LaunchConfig { grid_dim: (t.div_ceil(rows) as u32, h as u32, b as u32), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let mut bld = func.builder();
    bld.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale).arg(&cap);
    bld.arg(&lov).arg(&hiv).arg(&bstride);
    bld.arg(&o_t).arg(&o_row0).arg(&o_merge);
    // SAFETY: argument list matches FWD_BAND_ARGS in kernels/flash_fwd.cu; sizes checked above (the
    // rows of a fold by `fold::fold_into`).
    unsafe { bld.launch(cfg) }.w()?;
    Ok(())
}

/// Raw band forward on CUDA tensors, no graph: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]` (f32, f16
/// or bf16) -> out f32 `[B, T, H, D]`, lse f32 `[B, H, T]`; a row with an empty interval gets
/// out 0 and lse `-inf`. `imp`: `Simple` runs the CUDA-core kernel, every other choice the
/// pipelined tensor-core kernel for f16/bf16 (see [`FwdImpl`]).
pub fn fwd_band(q: &Tensor, k: &Tensor, v: &Tensor, band: KBand<'_>, scale: impl Into<Logits>, imp: FwdImpl) -> Result<(Tensor, Tensor)> {
    let scale: Logits = scale.into();
    util::cuda_device(q, "flash_fwd_band: q")?;
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let (blo, bhi) = (band.lo.contiguous()?, band.hi.contiguous()?);
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let ((o, os), (l, ls)) = fwd_storage_band(
        storage_of(&qs, "q", q.shape())?,
        ql,
        storage_of(&ks, "k", k.shape())?,
        kl,
        storage_of(&vs, "v", v.shape())?,
        vl,
        KBand { lo: &blo, hi: &bhi },
        scale,
        imp,
    )?;
    let none = || candle_core::op::BackpropOp::none();
    Ok((Tensor::from_storage(Storage::Cuda(o), os, none(), false), Tensor::from_storage(Storage::Cuda(l), ls, none(), false)))
}

/// Raw band backward on CUDA tensors, no graph (as [`super::bwd_with`], under a band): `out`
/// `[B, T, H, D]` and `lse` `[B, H, T]` of the whole attention of these rows, `dout`
/// `[B, T, H, D]`; returns f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]`. Rows with an empty
/// interval (lse `-inf`) contribute nothing. Deterministic (no atomics). `imp`: `Simple` runs the
/// CUDA-core kernels (`kernels/flash_bwd.cu`), every other choice the pipelined kernels
/// (`kernels/flash_bwd_pipe.cu`) for f16/bf16 where the device has their shared memory.
#[allow(clippy::too_many_arguments)]
pub fn bwd_band(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    band: KBand<'_>,
    scale: impl Into<Logits>,
    imp: FwdImpl,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Logits = scale.into();
    check_bwd_rows("flash_bwd_band", (q, k, v), (out, lse, dout))?;
    bwd_band_prepared(q, k, v, lse, &bwd_prep(out, dout, q.dtype())?, band, scale, imp)
}

/// [`bwd_band`] on a prepared backward ([`bwd_prep`], see [`super::bwd_prepared`]).
#[allow(clippy::too_many_arguments)]
pub fn bwd_band_prepared(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    pr: &BwdPrep,
    band: KBand<'_>,
    scale: impl Into<Logits>,
    imp: FwdImpl,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Logits = scale.into();
    fresh_dq(bwd_band_prepared_to(q, k, v, lse, pr, band, scale, imp, DqOut::Fresh)?)
}

/// [`bwd_band_prepared`] adding dQ into `dq` (as [`super::bwd_prepared_add_dq`]); returns dK, dV.
#[allow(clippy::too_many_arguments)]
pub fn bwd_band_prepared_add_dq(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    pr: &BwdPrep,
    band: KBand<'_>,
    scale: impl Into<Logits>,
    imp: FwdImpl,
    (dq, dq_l): (&mut CudaStorage, &Layout),
) -> Result<(Tensor, Tensor)> {
    let scale: Logits = scale.into();
    add_dq(q, (dq, dq_l), "flash_bwd_band", |out| bwd_band_prepared_to(q, k, v, lse, pr, band, scale, imp, out))
}

#[allow(clippy::too_many_arguments)]
fn bwd_band_prepared_to(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    pr: &BwdPrep,
    band: KBand<'_>,
    logits: Logits,
    imp: FwdImpl,
    dq_out: DqOut<'_>,
) -> Result<BwdOut> {
    let (dev, (b, t, s, h, hkv, d)) = check_prepared("flash_bwd_band", (q, k, v), lse, pr)?;
    band.check("flash_bwd_band", b, t, &dev)?;
    logits.check("flash_bwd_band", q.shape())?;
    let imp = core::family_for(&dev, logits.bwd_family(imp), d, "flash_bwd_band", q.shape())?;
    let (scale, cap): (f32, f32) = (logits.scale, logits.cap);
    let sfx = suffix(q.dtype())?;
    let pc = PipeCfg::of(d);
    let (smem_kv, smem_q) = pc.smem(d);
    let pipe = use_pipe(&dev, sfx, imp, 1.0, smem_kv.max(smem_q), "flash_bwd_band", q.shape())?;
    if b * t * h == 0 || s == 0 {
        return zero_bwd(q, (b, t, s, h, hkv, d), &dq_out);
    }
    let (blo, bhi) = (band.lo.contiguous()?, band.hi.contiguous()?);
    let dims = (b, t, s, h, hkv, d);
    if (imp == FwdImpl::WgmmaWs || imp.tma()) && sm90_ws::applies(&dev, sfx, d)? && bwd_sm90_ws::check(&dev, d, q.shape(), k.shape(), imp.tma()).is_ok() {
        let band = bwd_sm90_ws::WsbMask::Band { lo: &blo, hi: &bhi };
        return bwd_sm90_ws::bwd_wgmma_ws(&dev, (q, k, v), (lse, pr), dims, band, scale, imp.tma(), dq_out);
    }
    let atomic = imp == FwdImpl::WgmmaAtomic;
    if (imp == FwdImpl::Wgmma || atomic) && sm90_ws::applies(&dev, sfx, d)? && bwd_sm90::check(&dev, d, atomic, q.shape(), k.shape()).is_ok() {
        return bwd_sm90::bwd_wgmma_band(&dev, (q, k, v), (lse, pr), dims, (&blo, &bhi), scale, atomic, dq_out);
    }
    if pipe {
        return bwd_pipe_band(&dev, (q, k, v), (lse, pr), dims, (&blo, &bhi), logits, dq_out);
    }
    let (los, lol) = blo.storage_and_layout();
    let (his, hil) = bhi.storage_and_layout();
    let lov = util::view::<u32>(storage_of(&los, "band lo", blo.shape())?, lol, "band lo")?;
    let hiv = util::view::<u32>(storage_of(&his, "band hi", bhi.shape())?, hil, "band hi")?;
    let bstride = util::to_i64(bstride_of(&blo, t), "band batch stride")?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (dout, lse, delta) = pr.launch_rows(lse, false)?;
    let inp = BwdInputs::lock((&q, &k, &v), (&dout, &lse, &delta))?;
    let (dov, lv, delta): (CudaView<'_, f32>, CudaView<'_, f32>, CudaView<'_, f32>) = inp.rows()?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let acc = 0i32;
    // SAFETY (all allocations below): every element is written by the kernels.
    let (mut fresh, acc_dq) = dq_fresh(&dev, &dq_out, b * t * h * d, false)?;
    let mut dq: CudaViewMut<'_, f32> = dq_view(dq_out, fresh.as_mut())?;
    let mut dk = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let mut dv = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let (module, src) = (ptx::FLASH_BWD_MODULE, ptx::FLASH_BWD);
    macro_rules! launch_band {
        ($ty:ty) => {{
            let (qv, kv, vv) = inp.qkv::<$ty>()?;
            let smem = core::core_smem(Core::Dkdv, d);
            let func = dev.get_or_load_custom_func(&format!("flash_bwd_dkdv_band_{sfx}_d{d}"), module, src)?;
            core::opt_in(&func, smem)?;
            let cfg = LaunchConfig { grid_dim: (s.div_ceil(32) as u32, hkv as u32, b as u32), block_dim: (128, 1, 1), shared_mem_bytes: smem };
            let mut bld = func.builder();
            bld.arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale).arg(&cap);
            bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc);
            // SAFETY: matches `float* dk, float* dv, BWD_BAND_ARGS` in kernels/flash_bwd.cu.
            unsafe { bld.launch(cfg) }.w()?;

            let smem = core::core_smem(Core::Dq, d);
            let func = dev.get_or_load_custom_func(&format!("flash_bwd_dq_band_{sfx}_d{d}"), module, src)?;
            core::opt_in(&func, smem)?;
            let cfg = LaunchConfig { grid_dim: (t.div_ceil(8) as u32, h as u32, b as u32), block_dim: (128, 1, 1), shared_mem_bytes: smem };
            let mut bld = func.builder();
            bld.arg(&mut dq).arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale).arg(&cap);
            bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc_dq);
            // SAFETY: matches `float* dq, BWD_BAND_ARGS` in kernels/flash_bwd.cu.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match q.dtype() {
        DType::F32 => launch_band!(f32),
        DType::F16 => launch_band!(f16),
        _ => launch_band!(bf16),
    }
    Ok(bwd_out(&dev, fresh, (dk, dv), dims))
}

/// The pipelined band backward (f16/bf16; out, lse, dout contiguous f32): prep (delta, 16-bit
/// dO), then `flash_bwd_pipe_{dkdv,dq}_band_*`.
fn bwd_pipe_band(
    dev: &CudaDevice,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (lse, pr): (&Tensor, &BwdPrep),
    (b, t, s, h, hkv, d): Dims,
    (blo, bhi): (&Tensor, &Tensor),
    logits: Logits,
    dq_out: DqOut<'_>,
) -> Result<BwdOut> {
    let (scale, cap): (f32, f32) = (logits.scale, logits.cap);
    let sfx = suffix(q.dtype())?;
    let kind = if cap > 0.0 { "pipe_cap" } else { "pipe" };  // (the soft-capped entries)
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let pc = PipeCfg::of(d);
    let (bn, bm) = pc.block_rows();
    let (kv_tiles, q_tiles) = (s.div_ceil(bn), t.div_ceil(bm));
    if kv_tiles > 65_535 || q_tiles > 65_535 {
        candle_core::bail!("flash_bwd_band: T = {t} or S = {s} too long for the pipelined kernels' grid (at most {} rows); q {:?}, k {:?}", 65_535 * bn.min(bm), q.shape(), k.shape())
    }
    if (h / hkv) * t.div_ceil(pc.kv_bq) > i32::MAX as usize || (b * t * h).div_ceil(4) > i32::MAX as usize {
        candle_core::bail!("flash_bwd_band: too many query rows for the pipelined kernels' 32-bit counters; q {:?}, k {:?}", q.shape(), k.shape())
    }
    let (dout, lse, delta) = pr.launch_rows(lse, true)?;
    let inp = BwdInputs::lock((&q, &k, &v), (&dout, &lse, &delta))?;
    let (los, lol) = blo.storage_and_layout();
    let (his, hil) = bhi.storage_and_layout();
    let lov = util::view::<u32>(storage_of(&los, "band lo", blo.shape())?, lol, "band lo")?;
    let hiv = util::view::<u32>(storage_of(&his, "band hi", bhi.shape())?, hil, "band hi")?;
    let bstride = util::to_i64(bstride_of(blo, t), "band batch stride")?;
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let acc = 0i32;
    let (smem_kv, smem_q) = pc.smem(d);
    let (module, src) = (ptx::FLASH_BWD_PIPE_MODULE, ptx::FLASH_BWD_PIPE);
    // SAFETY (all allocations below): every element is written by the kernels.
    let (mut fresh, acc_dq) = dq_fresh(dev, &dq_out, b * t * h * d, false)?;
    let mut dq: CudaViewMut<'_, f32> = dq_view(dq_out, fresh.as_mut())?;
    let mut dk = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    let mut dv = unsafe { dev.alloc::<f32>(b * s * hkv * d)? };
    macro_rules! launch_pipe_band {
        ($ty:ty) => {{
            let (qv, kv, vv) = inp.qkv::<$ty>()?;
            let (do16, lv, delta) = inp.rows::<$ty>()?;

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_{kind}_dkdv_band_{sfx}_d{d}"), module, src)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_kv as i32).w()?;
            let cfg = LaunchConfig { grid_dim: (pc.kv_grid_x(hkv, d) as u32, kv_tiles as u32, b as u32), block_dim: (32 * pc.kv_nw as u32, 1, 1), shared_mem_bytes: smem_kv };
            let mut bld = func.builder();
            bld.arg(&mut dk).arg(&mut dv).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc).arg(&cap);
            // SAFETY: matches `float* dk, float* dv, PIPE_BAND_ARGS, float cap` in kernels/flash_bwd_pipe.cu.
            unsafe { bld.launch(cfg) }.w()?;

            let func = dev.get_or_load_custom_func(&format!("flash_bwd_{kind}_dq_band_{sfx}_d{d}"), module, src)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_q as i32).w()?;
            let cfg = LaunchConfig { grid_dim: (h as u32, q_tiles as u32, b as u32), block_dim: (32 * pc.q_nw as u32, 1, 1), shared_mem_bytes: smem_q };
            let mut bld = func.builder();
            bld.arg(&mut dq).arg(&qv).arg(&kv).arg(&vv).arg(&do16).arg(&lv).arg(&delta);
            bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale);
            bld.arg(&lov).arg(&hiv).arg(&bstride).arg(&acc_dq).arg(&cap);
            // SAFETY: matches `float* dq, PIPE_BAND_ARGS, float cap` in kernels/flash_bwd_pipe.cu.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match q.dtype() {
        DType::F16 => launch_pipe_band!(f16),
        DType::BF16 => launch_pipe_band!(bf16),
        dt => candle_core::bail!("flash_bwd_band: the pipelined kernels take f16/bf16, got {dt:?}; q {:?}", q.shape()),
    }
    Ok(bwd_out(dev, fresh, (dk, dv), (b, t, s, h, hkv, d)))
}
