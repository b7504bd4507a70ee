//! The backward's key-independent inputs, prepared once for every call over the same query rows.
//! CPU reference: `candle_cp_ops::attention::BwdPrep` (the host delta loop of the CPU kernel).
//!
//! A flash backward reads, besides q, k, v and lse, two per-query-row inputs that do not depend
//! on the keys: delta = rowsum(dO * O) (f32 `[B, H, T]`) and dO itself, which the tensor-core
//! kernels read rounded to the input dtype. A ring runs one backward call per step over the same
//! query rows; [`bwd_prep`] makes both once (`flash_bwd_pipe_prep_*` for f16/bf16, one pass over
//! O and dO; `flash_bwd_delta_f32` for f32) and [`super::bwd_prepared`] takes them, so each step
//! reads only its rows of them instead of converting dO to f32 and rerunning the prep kernel.

use super::{bwd_pipe, prep, storage_of, suffix};
use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{DType, Layout, Result, StorageRef, Tensor};
use half::{bf16, f16};

/// The key-independent inputs of a backward over `T` query rows (see the module doc).
#[derive(Clone, Debug)]
pub struct BwdPrep {
    /// delta = rowsum(dO * O) in f32, `[B, H, T]`.
    pub delta: Tensor,
    /// dO `[B, T, H, D]` as given (the `Simple` and `Mma` kernels read it as f32).
    pub dout: Tensor,
    /// dO rounded to the input dtype `[B, T, H, D]` (round to nearest even), for f16/bf16 inputs:
    /// what the pipelined, fused and Hopper kernels read. `None` for f32 inputs.
    pub dout16: Option<Tensor>,
}

/// Prepares the backward of query rows whose whole-attention output is `out` and upstream
/// gradient `dout` (both `[B, T, H, D]`, any float dtype, on one CUDA device) for inputs of dtype
/// `dtype` (f32, f16 or bf16): delta and, for f16/bf16, dO in that dtype. Errors name the shapes.
pub fn bwd_prep(out: &Tensor, dout: &Tensor, dtype: DType) -> Result<BwdPrep> {
    let dev = util::cuda_device(out, "flash_bwd_prep: out")?;
    util::cuda_device(dout, "flash_bwd_prep: dout")?;
    let (b, t, h, d) = match out.dims() {
        &[b, t, h, d] if dout.dims() == out.dims() => (b, t, h, d),
        _ => candle_core::bail!("flash_bwd_prep: expected out and dout [B, T, H, D] of one shape, got out {:?}, dout {:?}", out.shape(), dout.shape()),
    };
    let sfx = suffix(dtype)?;
    if (b * t * h).div_ceil(4) > i32::MAX as usize || d > i32::MAX as usize {
        candle_core::bail!("flash_bwd_prep: too many rows for the prep kernels' grid (one block per 4 rows); out {:?}", out.shape())
    }
    if b * t * h == 0 {
        let dout16 = if dtype == DType::F32 { None } else { Some(dout.to_dtype(dtype)?) };
        return Ok(BwdPrep { delta: Tensor::zeros((b, h, t), DType::F32, out.device())?, dout: dout.clone(), dout16 });
    }
    let f32c = |x: &Tensor| -> Result<Tensor> { prep(&x.to_dtype(DType::F32)?) };
    let (of, df) = (f32c(out)?, f32c(dout)?);
    let (os, ol) = of.storage_and_layout();
    let (ds, dl) = df.storage_and_layout();
    let ov = util::view::<f32>(storage_of(&os, "out", of.shape())?, ol, "out")?;
    let dov = util::view::<f32>(storage_of(&ds, "dout", df.shape())?, dl, "dout")?;
    let (delta, dout16) = match dtype {
        DType::F16 => {
            let (delta, do16) = bwd_pipe::launch_prep::<f16>(&dev, sfx, &ov, &dov, (b, t, h, d))?;
            (delta, Some(util::to_tensor(do16, &dev, (b, t, h, d))))
        }
        DType::BF16 => {
            let (delta, do16) = bwd_pipe::launch_prep::<bf16>(&dev, sfx, &ov, &dov, (b, t, h, d))?;
            (delta, Some(util::to_tensor(do16, &dev, (b, t, h, d))))
        }
        _ => {
            // SAFETY: the kernel writes every element.
            let mut delta = unsafe { dev.alloc::<f32>(b * h * t)? };
            let (bi, ti, hi, di) = (b as i32, t as i32, h as i32, d as i32);
            let func = dev.get_or_load_custom_func("flash_bwd_delta_f32", ptx::FLASH_BWD_MODULE, ptx::FLASH_BWD)?;
            let cfg = LaunchConfig { grid_dim: ((b * t * h).div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
            let mut bld = func.builder();
            bld.arg(&ov).arg(&dov).arg(&mut delta).arg(&bi).arg(&ti).arg(&hi).arg(&di);
            // SAFETY: matches flash_bwd_delta_f32's parameters; one block per 4 rows, checked above.
            unsafe { bld.launch(cfg) }.w()?;
            (delta, None)
        }
    };
    Ok(BwdPrep { delta: util::to_tensor(delta, &dev, (b, h, t)), dout: dout.clone(), dout16 })
}

impl BwdPrep {
    /// The prep of query rows `start .. start + len` (views, no copy).
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<BwdPrep> {
        Ok(BwdPrep {
            delta: self.delta.narrow(2, start, len)?,
            dout: self.dout.narrow(1, start, len)?,
            dout16: self.dout16.as_ref().map(|x| x.narrow(1, start, len)).transpose()?,
        })
    }

    /// Checks the prep against the call's q `[B, T, H, D]` (and its dtype for the 16-bit copy).
    pub(super) fn check(&self, op: &str, q: &Tensor) -> Result<()> {
        let (b, t, h, d) = q.dims4()?;
        let d16_ok = match (&self.dout16, q.dtype()) {
            (Some(x), dt) => dt != DType::F32 && x.dtype() == dt && x.dims() == [b, t, h, d],
            (None, dt) => dt == DType::F32,
        };
        if self.delta.dims() != [b, h, t] || self.dout.dims() != [b, t, h, d] || !d16_ok {
            candle_core::bail!(
                "{op}: the prepared backward (delta {:?}, dout {:?}, dout16 {:?}) does not match q {:?} ({:?}); expected delta [B, H, T], dout [B, T, H, D] and a 16-bit dout exactly for f16/bf16 q",
                self.delta.shape(), self.dout.shape(), self.dout16.as_ref().map(|x| (x.shape().clone(), x.dtype())), q.shape(), q.dtype()
            )
        }
        Ok(())
    }

    /// What one family's kernels read, launchable (contiguous, 16-byte aligned): dO (the 16-bit copy
    /// when `sixteen`, else dO as f32), lse (f32, from the call's `lse`) and delta.
    pub(super) fn launch_rows(&self, lse: &Tensor, sixteen: bool) -> Result<(Tensor, Tensor, Tensor)> {
        let dout = match (&self.dout16, sixteen) {
            (Some(x), true) => prep(x)?,
            (None, true) => candle_core::bail!("flash_bwd: the tensor-core kernels read a 16-bit dout, the prep holds none (f32 inputs); dout {:?}", self.dout.shape()),
            (_, false) => prep(&self.dout.to_dtype(DType::F32)?)?,
        };
        Ok((dout, prep(&lse.to_dtype(DType::F32)?)?, prep(&self.delta)?))
    }
}

/// Read-locked storages of one backward call's inputs, in launch order: q, k, v `[B, T|S, H|Hkv, D]`
/// (the input dtype), dO `[B, T, H, D]` (the dtype the family reads, [`BwdPrep::launch_rows`]),
/// lse and delta `[B, H, T]` (f32), with the views the kernel launches take.
pub(super) struct BwdInputs<'a> {
    t: [&'a Tensor; 6],
    g: [(StorageRef<'a>, &'a Layout); 6],
}

impl<'a> BwdInputs<'a> {
    const NAMES: [&'static str; 6] = ["q", "k", "v", "dout", "lse", "delta"];

    /// Locks the storages of q, k, v, dout, lse, delta (in that order); errors naming the tensor
    /// and its shape where one is not on a CUDA device.
    pub(super) fn lock((q, k, v): (&'a Tensor, &'a Tensor, &'a Tensor), (dout, lse, delta): (&'a Tensor, &'a Tensor, &'a Tensor)) -> Result<Self> {
        let t = [q, k, v, dout, lse, delta];
        let g = t.map(|x| x.storage_and_layout());
        for (i, what) in Self::NAMES.iter().enumerate() {
            storage_of(&g[i].0, what, t[i].shape())?;
        }
        Ok(Self { t, g })
    }

    fn view<T: CudaDType>(&self, i: usize) -> Result<CudaView<'_, T>> {
        let what = Self::NAMES[i];
        util::view::<T>(storage_of(&self.g[i].0, what, self.t[i].shape())?, self.g[i].1, what)
    }

    /// q, k, v as views of `T` (their dtype).
    pub(super) fn qkv<T: CudaDType>(&self) -> Result<(CudaView<'_, T>, CudaView<'_, T>, CudaView<'_, T>)> {
        Ok((self.view(0)?, self.view(1)?, self.view(2)?))
    }

    /// dO as a view of `T` (the 16-bit copy or f32), lse and delta as f32 views.
    pub(super) fn rows<T: CudaDType>(&self) -> Result<(CudaView<'_, T>, CudaView<'_, f32>, CudaView<'_, f32>)> {
        Ok((self.view(3)?, self.view(4)?, self.view(5)?))
    }
}
