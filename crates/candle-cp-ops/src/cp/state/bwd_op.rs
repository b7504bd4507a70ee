//! [`AddBwdDq`]: one backward call run inside an in-place op on the dQ accumulator of a
//! [`super::RowAccum`] (device form), so that on CUDA the kernels add the call's dQ straight
//! into the accumulator's rows (their `accumulate` flag) instead of writing a fresh dQ that an
//! [`AddRowsInPlace`] pass then adds:
//!
//! ```text
//! before:  dq_blk = alloc (+ zero fill for the atomic kernels); kernels write dq_blk;
//!          acc[rows] += dq_blk                  (read dq_blk, read + write acc)
//! now:     kernels: acc[rows] += dQ             (read + write acc)
//! ```
//!
//! CPU body (the device form forced on the CPU in tests), and CUDA calls whose rows are not one
//! contiguous region (B > 1 and a part of the rows) or that the kernels do not take: the call
//! with a fresh dQ, then [`AddRowsInPlace`]'s body: the same sums as before.

use super::merge_op::AddRowsInPlace;
use crate::attention::BwdCall;
use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Result, Tensor};
use std::sync::Mutex;

/// The in-place op (see the module doc): `call`'s dQ added to rows `row0 .. row0 + n` of the
/// f32 `[1, B, rows, H, D]` accumulator it runs on; dK, dV left in `out`.
pub(crate) struct AddBwdDq<'a> {
    pub call: BwdCall<'a>,
    pub dims: (usize, usize, usize, usize, usize),
    pub row0: usize,
    pub out: Mutex<Option<(Tensor, Tensor)>>,
}

impl AddBwdDq<'_> {
    fn keep(&self, dkv: (Tensor, Tensor)) {
        *self.out.lock().unwrap_or_else(|e| e.into_inner()) = Some(dkv);
    }

    /// dK, dV of the call (after the op ran).
    pub(crate) fn take(&self) -> Result<(Tensor, Tensor)> {
        match self.out.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(x) => Ok(x),
            None => candle_core::bail!("AddBwdDq: the op did not run (internal error)"),
        }
    }

    fn add_rows(&self) -> AddRowsInPlace {
        AddRowsInPlace {
            dims: self.dims,
            plane: 0,
            row0: self.row0,
        }
    }
}

impl InplaceOp1 for AddBwdDq<'_> {
    fn name(&self) -> &'static str {
        "cp-add-bwd-dq"
    }

    fn cpu_fwd(&self, acc: &mut CpuStorage, acc_l: &Layout) -> Result<()> {
        let (dq, dk, dv) = self.call.run()?;
        let dq = dq.to_device(&candle_core::Device::Cpu)?.contiguous()?;
        let (st, l) = dq.storage_and_layout();
        match &*st {
            candle_core::Storage::Cpu(x) => self.add_rows().cpu_fwd(acc, acc_l, x, l)?,
            _ => candle_core::bail!(
                "AddBwdDq: dq {:?} not on the CPU (internal error)",
                dq.shape()
            ),
        }
        drop(st);
        self.keep((dk, dv));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, acc: &mut candle_core::CudaStorage, acc_l: &Layout) -> Result<()> {
        if let Some(dkv) = self.call.add_dq_cuda(acc, acc_l, self.row0)? {
            self.keep(dkv);
            return Ok(());
        }
        let (dq, dk, dv) = self.call.run()?;
        let dq = super::merge_op::block_on(&dq, &candle_core::Device::Cuda(acc.device.clone()))?;
        let (st, l) = dq.storage_and_layout();
        match &*st {
            candle_core::Storage::Cuda(x) => self.add_rows().cuda_fwd(acc, acc_l, x, l)?,
            _ => candle_core::bail!("AddBwdDq: dq {:?} not on CUDA (internal error)", dq.shape()),
        }
        drop(st);
        self.keep((dk, dv));
        Ok(())
    }
}
