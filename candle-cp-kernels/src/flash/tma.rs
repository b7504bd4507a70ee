//! TMA tensor maps for the TMA entries of the warp-specialized Hopper kernels
//! (`flash_fwd_wgmma_tma{,_band}_*` in `kernels/flash_fwd_sm90_ws.cu`, launched by
//! [`super::sm90_ws`]; `flash_bwd_wgmma_tma{,_band}_*` in `kernels/flash_bwd_sm90_ws.cu`, launched
//! by [`super::bwd_sm90_ws`]; both under [`super::FwdImpl::WgmmaTma`]) and of the TMA probe
//! (`probe_tma` in `kernels/probe_sm90.cu`, [`crate::probe`]).
//!
//! A tensor map describes a global tensor and the box (tile) one `cp.async.bulk.tensor` copies
//! into shared memory; the driver encodes it (`cuTensorMapEncodeTiled`) and the kernel takes it by
//! value as a `__grid_constant__` parameter. Ours: a contiguous 16-bit `[B, L, Hh, D]` tensor (q
//! with `L = T`, `Hh = H`; k / v with `L = S`, `Hh = Hkv`), dimensions innermost first
//! `(D, Hh, L, B)`, box `64 x 1 x rows x 1` (64 values of one head for `rows` rows: one 64-column
//! block of a tile of 128 rows, or of the backward's 64-row Q / dO tiles), 128-byte swizzle (the
//! layout the wgmma descriptors read, `kernels/wgmma.cuh`), zeros outside the tensor (rows past
//! `T` / `S`). And the backward's dq, f32 `[B, T, H, D]`, box `32 x 1 x 64 x 1` (128 bytes per
//! row again) with the same swizzle, which its TMA reductions add into (rows past `T` skipped).

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DeviceRepr};
use candle_core::{CudaDevice, Result};

/// A tensor map as the kernels take it (`CpTmaMap` in `kernels/tma.cuh`): `CUtensorMap`'s 128
/// opaque bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct TmaMap([u64; 16]);

// SAFETY: plain bytes with CUtensorMap's size and alignment; the kernels take it by value.
unsafe impl DeviceRepr for TmaMap {}

/// Bytes of one box row: one row of the 128-byte swizzle (64 16-bit values, 32 f32 values).
const BOX_ROW_BYTES: usize = 128;

/// The map of `view`, a contiguous 16-bit (`bf16` or f16) `[b, l, hh, d]` tensor on `dev`, with
/// boxes of `rows` rows (1..=256: the kernel's tile rows) and the 128-byte swizzle, for the TMA
/// loads (see the module doc). Errors: a head dim that is not a multiple of 64, a view shorter than
/// the shape or not 16-byte aligned, or the driver's refusal (its error code, with the shape).
pub(crate) fn map_bthd<T, V: DevicePtr<T>>(dev: &CudaDevice, view: &V, bf16: bool, dims: (usize, usize, usize, usize), rows: u32, what: &str) -> Result<TmaMap> {
    let dtype = if bf16 { sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 } else { sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16 };
    encode(dev, view, (dtype, 2), dims, rows, sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B, what)
}

/// The map of `view`, a contiguous f32 `[b, l, hh, d]` tensor on `dev` (the backward's dq), with
/// boxes of 32 values x `rows` rows and the 128-byte swizzle, for the TMA reductions (`.add`) of
/// `flash_bwd_wgmma_tma{,_band}_*`: the kernel's shared buffer is two such boxes per 64 columns,
/// stored in the swizzled layout so that its stores have no bank conflicts.
pub(crate) fn map_f32_bthd<V: DevicePtr<f32>>(dev: &CudaDevice, view: &V, dims: (usize, usize, usize, usize), rows: u32, what: &str) -> Result<TmaMap> {
    let dtype = sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    encode(dev, view, (dtype, 4), dims, rows, sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B, what)
}

/// `cuTensorMapEncodeTiled` of a contiguous `[b, l, hh, d]` tensor of `esize`-byte elements:
/// dimensions `(d, hh, l, b)`, box `128 / esize x 1 x rows x 1` (one 128-byte row of values of one
/// head per row), zeros out of bounds, L2 promotion 256 B.
fn encode<T, V: DevicePtr<T>>(
    dev: &CudaDevice,
    view: &V,
    (dtype, esize): (sys::CUtensorMapDataType, usize),
    (b, l, hh, d): (usize, usize, usize, usize),
    rows: u32,
    swizzle: sys::CUtensorMapSwizzle,
    what: &str,
) -> Result<TmaMap> {
    if d == 0 || d % 64 != 0 || b * l * hh == 0 || !(1..=256).contains(&rows) {
        candle_core::bail!("flash attention (TMA): {what} [{b}, {l}, {hh}, {d}] needs a head dim that is a multiple of 64 and no empty dimension (box rows {rows})")
    }
    if view.len() < b * l * hh * d {
        candle_core::bail!("flash attention (TMA): {what} [{b}, {l}, {hh}, {d}] is described on a buffer of only {} elements", view.len())
    }
    let stream = dev.cuda_stream();
    let (ptr, _record) = view.device_ptr(&stream);
    if ptr % 16 != 0 {
        candle_core::bail!("flash attention (TMA): {what} [{b}, {l}, {hh}, {d}] starts at {ptr:#x}, not 16-byte aligned")
    }
    let u = |x: usize| x as u64;
    let dims = [u(d), u(hh), u(l), u(b)];
    // bytes between consecutive indices of dimensions 1, 2, 3 (dimension 0 is contiguous)
    let es = esize as u64;
    let strides = [u(d) * es, u(hh * d) * es, u(l * hh * d) * es];
    let boxes = [(BOX_ROW_BYTES / esize) as u32, 1, rows, 1];
    let elem_strides = [1u32; 4];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every array has `rank` (4) entries (`strides` rank - 1), the pointers outlive the
    // call, and `map` is a writable CUtensorMap.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        candle_core::bail!("flash attention (TMA): cuTensorMapEncodeTiled failed ({r:?}) for {what} [{b}, {l}, {hh}, {d}] (dims {dims:?}, byte strides {strides:?}, box {boxes:?})")
    }
    // SAFETY: initialised by the successful call above.
    let map = unsafe { map.assume_init() };
    Ok(TmaMap(map.opaque))
}
