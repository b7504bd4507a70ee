//! [`fwd_packed`]: one forward call whose result comes in the ring state's buffer layout,
//! [`fwd_fold_cuda`]: one folded into it, and
//! [`BwdCall`]: one prepared backward call (a ring step's block), which either returns its dQ
//! or adds it straight into rows of an f32 dQ accumulator on the device
//! ([`crate::cp::state::RowAccum::add_bwd`]: the CUDA kernels' `accumulate` flag, so no dQ
//! buffer, zero fill or add pass per step).

use super::Scores;
use super::{attention_bwd_band_prepared, attention_bwd_prepared, attention_fwd, attention_fwd_band, Band, BwdPrep, Mask};
use candle_core::{Result, Tensor};

/// The mask of one call: a kernel mask or a band.
#[derive(Clone, Copy, Debug)]
pub(crate) enum CallMask<'a> {
    /// Full or (offset, strided) causal.
    Mask(&'a Mask),
    /// One key interval per query row.
    Band(&'a Band),
}

/// One prepared backward call: q `[B, n, H, D]`, k/v `[B, S, Hkv, D]`, the rows' lse
/// `[B, H, n]` and prep ([`BwdPrep::narrow_rows`]).
#[derive(Clone, Copy)]
pub(crate) struct BwdCall<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub lse: &'a Tensor,
    pub prep: &'a BwdPrep,
    pub mask: CallMask<'a>,
    pub scale: Scores,
}

impl BwdCall<'_> {
    /// The call with a fresh dQ: f32 dq `[B, n, H, D]`, dk/dv `[B, S, Hkv, D]`.
    pub(crate) fn run(&self) -> Result<(Tensor, Tensor, Tensor)> {
        let BwdCall { q, k, v, lse, prep, scale, .. } = *self;
        match self.mask {
            CallMask::Mask(m) => attention_bwd_prepared(q, k, v, lse, prep, m, scale),
            CallMask::Band(b) => attention_bwd_band_prepared(q, k, v, lse, prep, b, scale),
        }
    }

    /// CUDA: the call with its dQ added into `acc` (the storage and layout of an f32
    /// `[1, B, rows, H, D]` accumulator, contiguous) at rows `row0 .. row0 + n`, in place, when
    /// those rows are one contiguous region (B = 1, or all rows) and the kernels take the call;
    /// `None` otherwise (the caller runs [`BwdCall::run`] and adds). Returns dk, dv.
    #[cfg(feature = "cuda")]
    pub(crate) fn add_dq_cuda(
        &self,
        acc: &mut candle_core::CudaStorage,
        acc_l: &candle_core::Layout,
        row0: usize,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let (b, n, h, d) = self.q.dims4()?;
        let rows = match *acc_l.dims() {
            [1, ab, rows, ah, ad] if ab == b && ah == h && ad == d && row0 + n <= rows => rows,
            _ => candle_core::bail!(
                "BwdCall::add_dq_cuda: dq rows {row0}..{} of q {:?} do not fit the accumulator {:?}",
                row0 + n,
                self.q.shape(),
                acc_l.shape()
            ),
        };
        let Some((a0, _)) = acc_l.contiguous_offsets() else {
            return Ok(None);
        };
        if !(self.q.device().is_cuda() && super::cuda::supported(d)) || !(b == 1 || (row0 == 0 && n == rows)) {
            return Ok(None);
        }
        if let CallMask::Mask(Mask::Window { .. }) = self.mask {
            return Ok(None); // a window is a band for these kernels (attention_bwd_prepared)
        }
        let sub = candle_core::Layout::contiguous_with_offset((b, n, h, d), a0 + row0 * h * d);
        super::cuda::bwd_add_dq(self, (acc, &sub)).map(Some)
    }
}

impl CallMask<'_> {
    /// The forward of `q [B, n, H, D]` against `k, v` under this mask: f32 out `[B, n, H, D]`,
    /// lse `[B, H, n]` (no graph).
    pub(crate) fn fwd(self, q: &Tensor, k: &Tensor, v: &Tensor, scale: Scores) -> Result<(Tensor, Tensor)> {
        match self {
            CallMask::Mask(m) => attention_fwd(q, k, v, m, scale),
            CallMask::Band(b) => attention_fwd_band(q, k, v, b, scale),
        }
    }
}

/// CUDA: the forward of `q [B, n, H, D]` against `k, v` under `mask`, folded into rows
/// `row0 .. row0 + n` of `state` (the ring state's f32 buffer `[B·R·H·D + B·H·R]`, R = `rows`)
/// by the kernels' epilogue (`flash::fwd_fold`): no partial result in memory, no merge pass.
/// `Ok(false)` (state untouched) where the kernels do not take the call (not CUDA, a head dim
/// they do not take, a window mask): the caller runs [`CallMask::fwd`] and merges.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn fwd_fold_cuda(q: &Tensor, k: &Tensor, v: &Tensor, mask: CallMask<'_>, scale: Scores, state: &Tensor, rows: usize, row0: usize) -> Result<bool> {
    if !kernels_take(q, k, v, mask)? {
        return Ok(false);
    }
    super::cuda::fwd_fold(q, k, v, mask, scale, state, rows, row0)?;
    Ok(true)
}

/// Whether the CUDA forward kernels take this call (q on CUDA, a head dim they take, not a
/// window mask: windows are bands for them), its q, k, v checked when they do.
#[cfg(feature = "cuda")]
fn kernels_take(q: &Tensor, k: &Tensor, v: &Tensor, mask: CallMask<'_>) -> Result<bool> {
    if !(q.device().is_cuda() && super::cuda::supported(q.dim(3)?)) || matches!(mask, CallMask::Mask(Mask::Window { .. })) {
        return Ok(false);
    }
    super::check_qkv("attention_fwd", q, k, v, &Mask::Full)?;
    Ok(true)
}

/// The forward of `q [B, n, H, D]` against `k, v` under `mask` as ONE f32 tensor
/// `[B·n·H·D + B·H·n]`: out, then lse — the buffer layout of the ring's running state, which
/// takes a first result covering all its rows as it is
/// ([`crate::cp::state::LocalState::adopt_packed`]). On CUDA the kernels write that buffer
/// directly (`flash::fwd_packed`, `fwd_band_packed`); elsewhere (the state's in-place form
/// forced on the CPU in tests) the two results are concatenated.
pub(crate) fn fwd_packed(q: &Tensor, k: &Tensor, v: &Tensor, mask: CallMask<'_>, scale: Scores) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if kernels_take(q, k, v, mask)? {
        return super::cuda::fwd_packed(q, k, v, mask, scale);
    }
    let (out, lse) = mask.fwd(q, k, v, scale)?;
    Tensor::cat(&[out.flatten_all()?, lse.flatten_all()?], 0)
}
