//! [`FwdDst`]: where a forward kernel writes (fresh buffers, a packed buffer, or rows of the ring's
//! running state it folds into: flash_fwd*.cu's `o_T, o_row0, o_merge`, `CpFwdDst` in common.cuh).

use candle_core::cuda_backend::cudarc::driver::CudaViewMut;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

/// Where a forward writes: out f32 `[B, T, H, D]` and lse f32 `[B, H, T]`, two fresh buffers
/// ([`super::fwd_storage`]) or the two parts of one packed buffer ([`super::fwd_packed`]); or,
/// with `fold`, rows of a running state that the result is folded into ([`super::fwd_fold`]).
pub(crate) struct FwdDst<'a> {
    pub out: CudaViewMut<'a, f32>,
    pub lse: CudaViewMut<'a, f32>,
    pub fold: Option<FoldAt>,
}

/// The rows of a running state a forward is folded into: out `[B, rows, H, D]`, lse
/// `[B, H, rows]`, the call's T query rows at `row0 .. row0 + T` (flash_fwd.cu's `CpFwdDst`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FoldAt {
    pub rows: usize,
    pub row0: usize,
}

impl<'a> FwdDst<'a> {
    /// A plain destination: out and lse written, not folded.
    pub(crate) fn plain(out: CudaViewMut<'a, f32>, lse: CudaViewMut<'a, f32>) -> Self {
        FwdDst { out, lse, fold: None }
    }

    /// The kernel arguments `o_T, o_row0, o_merge` of flash_fwd.cu's entries for a call of `t`
    /// query rows.
    pub(crate) fn kernel_args(&self, t: usize) -> Result<(i32, i32, i32)> {
        let (rows, row0, merge) = match self.fold {
            Some(f) => (f.rows, f.row0, 1),
            None => (t, 0, 0),
        };
        let i = |x: usize| i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("flash_fwd: {x} rows exceed i32")));
        Ok((i(rows)?, i(row0)?, merge))
    }
}

impl FwdDst<'_> {
    /// The result of no key seen (or no rows): out 0, lse `-inf`; folded into a state: nothing
    /// changes.
    pub(crate) fn empty(mut self, dev: &CudaDevice) -> Result<()> {
        if self.fold.is_some() {
            return Ok(());
        }
        let stream = dev.cuda_stream();
        stream.memset_zeros(&mut self.out).w()?;
        let n = self.lse.len();
        if n > 0 {
            stream.memcpy_htod(&vec![f32::NEG_INFINITY; n], &mut self.lse).w()?;
        }
        Ok(())
    }
}
