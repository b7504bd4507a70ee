//! Helpers shared by the launchers: storage access, alignment, wrapping results as tensors.

use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape, Storage, Tensor};

/// The device's opt-in maximum of dynamic shared memory per block in bytes (sm_80: 166,912;
/// sm_90: 232,448; sm_86, sm_89, sm_120: 101,376), which every launcher compares its need with.
pub(crate) fn smem_optin(dev: &CudaDevice) -> Result<i64> {
    let optin = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).w()?;
    Ok(i64::from(optin))
}

/// The CUDA storage in `s`, or an error naming `what`.
pub(crate) fn storage<'a>(s: &'a Storage, what: &str) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("{what} is not on a CUDA device"),
    }
}

/// Contiguous view of `l`'s elements in `s`.
pub(crate) fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{what} {:?} (stride {:?}) is not contiguous", l.shape(), l.stride())
    };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// q, k, v of a forward launch as contiguous device views, each 16-byte aligned when `align`
/// (a fresh copy where the input's start offset is not a multiple of 8 elements, [`aligned_copy`];
/// the tensor-core kernels read 16-byte vectors), else the inputs as they are.
pub(crate) struct FwdQkv<'a, T> {
    src: [(&'a CudaStorage, &'a Layout, &'static str); 3],
    copies: [Option<CudaSlice<T>>; 3],
}

impl<'a, T: CudaDType + DeviceRepr> FwdQkv<'a, T> {
    /// The inputs `(storage, layout)` of q, k, v, copied where `align` needs it.
    pub(crate) fn new(
        dev: &CudaDevice,
        (q, ql): (&'a CudaStorage, &'a Layout),
        (k, kl): (&'a CudaStorage, &'a Layout),
        (v, vl): (&'a CudaStorage, &'a Layout),
        align: bool,
    ) -> Result<Self> {
        let src = [(q, ql, "q"), (k, kl, "k"), (v, vl, "v")];
        let mut copies = [None, None, None];
        if align {
            for (c, (s, l, what)) in copies.iter_mut().zip(src) {
                *c = aligned_copy::<T>(dev, s, l, what)?;
            }
        }
        Ok(Self { src, copies })
    }

    /// The device views of q, k, v (the copies where made).
    pub(crate) fn qkv_views(&self) -> Result<(CudaView<'_, T>, CudaView<'_, T>, CudaView<'_, T>)> {
        let one = |i: usize| -> Result<CudaView<'_, T>> {
            let (s, l, what) = self.src[i];
            match &self.copies[i] {
                Some(c) => Ok(c.slice(..)),
                None => view::<T>(s, l, what),
            }
        };
        Ok((one(0)?, one(1)?, one(2)?))
    }
}

/// A fresh copy of `l`'s elements when its start offset is not a multiple of 8 elements
/// (the tensor-core kernels read 16-byte vectors); `None` when the input can be used as is.
pub(crate) fn aligned_copy<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    s: &CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<Option<CudaSlice<T>>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{what} {:?} (stride {:?}) is not contiguous", l.shape(), l.stride())
    };
    if a % 8 == 0 || b == a {
        return Ok(None);
    }
    let src = s.as_cuda_slice::<T>()?.slice(a..b);
    // SAFETY: fully overwritten by the copy below.
    let mut dst = unsafe { dev.alloc::<T>(b - a)? };
    dev.memcpy_dtod(&src, &mut dst)?;
    Ok(Some(dst))
}

/// Wrap a device buffer as a (graph-less) tensor of `shape`.
pub(crate) fn to_tensor<T: CudaDType, S: Into<Shape>>(s: CudaSlice<T>, dev: &CudaDevice, shape: S) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// The CUDA device of `t`, or an error naming `what` and its shape.
pub(crate) fn cuda_device(t: &Tensor, what: &str) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        other => candle_core::bail!("{what} {:?} is on {other:?}, expected a CUDA device", t.shape()),
    }
}

/// `usize` -> kernel `int`, with an error naming the quantity when it does not fit.
pub(crate) fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{what} = {x} does not fit the kernels' 32-bit sizes")))
}

/// `usize` -> kernel `long long`.
pub(crate) fn to_i64(x: usize, what: &str) -> Result<i64> {
    i64::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{what} = {x} does not fit in i64")))
}

/// Grid size for the grid-stride kernels (256 threads per block).
pub(crate) fn grid_stride_blocks(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 65_535) as u32
}
