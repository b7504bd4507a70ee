//! The forward folded into a running state: [`fwd_fold`], [`fwd_band_fold`].
//!
//! A ring step's forward over one key chunk gives a partial result for some of the rank's query
//! rows, which the ring merges into its running state through the log-sum-exp (one f32 buffer:
//! out `[B, R, H, D]`, then lse `[B, H, R]`; the layout of [`super::fwd_packed`] and of
//! `candle_cp_ops::cp::state::LocalState`). Merged in a separate pass, the partial result is
//! written in f32 and read back; folded, the forward's epilogue reads the state's rows, folds its
//! result in and writes them back (`CpFwdDst` / `cp_fold` in kernels/flash_fwd.cu, merge.cu's
//! formula):
//!
//! ```text
//! separate:  forward: out_s, lse_s = attn(q, k, v)        writes 4·D + 4 bytes per query row
//!            merge:   state[rows] ⊕= (out_s, lse_s)       reads them back, reads + writes state
//! folded:    forward: state[rows] ⊕= attn(q, k, v)        reads + writes state
//! ```
//!
//! Every forward family folds: the kernels of flash_fwd.cu (`Simple`, `Mma`, `Pipelined`) and the
//! Hopper ones (`fwd_sm90_store` in flash_sm90.cuh), through one epilogue (`cp_fwd_store_quad`
//! in common.cuh; the CUDA-core kernel its own per-lane form).

use super::{band, fwd_storage_to, launchable, with_storages, Dims, FoldAt, FwdDst, FwdImpl, KBand, KMask, Logits};
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Result, Tensor};
use std::cell::RefCell;

/// The forward of q `[B, T, H, D]` against k, v `[B, S, Hkv, D]` under `mask`, folded into
/// rows `row0 .. row0 + T` of `state`, an f32 tensor `[B·R·H·D + B·H·R]` (out `[B, R, H, D]`,
/// then lse `[B, H, R]`, R = `rows`; contiguous, on q's device, not sharing q's, k's or v's
/// storage), in place: each row becomes the LSE merge of what it held with the call's result (a
/// row whose lse is `-inf` holds nothing: its out must be 0). Shapes that do not fit are an
/// error naming them.
#[allow(clippy::too_many_arguments)]
pub fn fwd_fold(q: &Tensor, k: &Tensor, v: &Tensor, mask: KMask, scale: impl Into<Logits>, imp: FwdImpl, state: &Tensor, rows: usize, row0: usize) -> Result<()> {
    let scale: Logits = scale.into();
    fold_into("flash_fwd_fold", (q, k, v), (state, rows, row0), |[qs, ks, vs], dims, dst| fwd_storage_to(qs, ks, vs, dims, mask, scale, imp, dst))
}

/// [`fwd_fold`] under a band (one key interval per query row, as [`super::fwd_band`]).
#[allow(clippy::too_many_arguments)]
pub fn fwd_band_fold(q: &Tensor, k: &Tensor, v: &Tensor, band: KBand<'_>, scale: impl Into<Logits>, imp: FwdImpl, state: &Tensor, rows: usize, row0: usize) -> Result<()> {
    let scale: Logits = scale.into();
    let (blo, bhi) = (band.lo.contiguous()?, band.hi.contiguous()?);
    fold_into("flash_fwd_band_fold", (q, k, v), (state, rows, row0), |[qs, ks, vs], dims, dst| {
        band.check("flash_fwd_band_fold", dims.0, dims.1, &qs.0.device)?;
        band::fwd_band_to(qs, ks, vs, dims, KBand { lo: &blo, hi: &bhi }, scale, imp, dst)
    })
}

type Write<'w> = Box<dyn FnOnce([(&CudaStorage, &Layout); 3], Dims, FwdDst<'_>) -> Result<()> + 'w>;

/// q, k, v made launchable and checked against the state, then `write` runs on the state's
/// storage (an in-place op) with a folding [`FwdDst`] over its two parts.
fn fold_into<'w>(
    op: &'static str,
    qkv: (&Tensor, &Tensor, &Tensor),
    (state, rows, row0): (&Tensor, usize, usize),
    write: impl FnOnce([(&CudaStorage, &Layout); 3], Dims, FwdDst<'_>) -> Result<()> + 'w,
) -> Result<()> {
    let (_, qkv, dims) = launchable(op, qkv)?;
    let (b, t, _, h, _, d) = dims;
    let n = b * rows * h * d + b * h * rows;
    if state.dtype() != DType::F32 || state.dims() != [n] || row0 + t > rows || !state.is_contiguous() || !state.device().same_device(qkv[0].device()) {
        candle_core::bail!(
            "{op}: the state must be a contiguous f32 [B·R·H·D + B·H·R] = [{n}] on q's device with rows {row0}..{} inside R = {rows}, for q {:?}; got {:?} {:?} on {:?}",
            row0 + t,
            qkv[0].shape(),
            state.dtype(),
            state.shape(),
            state.device()
        )
    }
    let fold = Fold { qkv, dims, at: FoldAt { rows, row0 }, write: RefCell::new(Some(Box::new(write))) };
    state.inplace_op1(&fold)
}

/// The in-place op of [`fold_into`] (CUDA only).
struct Fold<'w> {
    qkv: [Tensor; 3],
    dims: Dims,
    at: FoldAt,
    write: RefCell<Option<Write<'w>>>,
}

impl InplaceOp1 for Fold<'_> {
    fn name(&self) -> &'static str {
        "cp-flash-fwd-fold"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, l: &Layout) -> Result<()> {
        candle_core::bail!("flash_fwd_fold: the state {:?} is on the CPU, the kernels need CUDA", l.shape())
    }

    fn cuda_fwd(&self, st: &mut CudaStorage, l: &Layout) -> Result<()> {
        let Some(write) = self.write.borrow_mut().take() else {
            candle_core::bail!("flash_fwd_fold: the op ran twice (internal error)")
        };
        let (b, _, _, h, _, d) = self.dims;
        let FoldAt { rows, .. } = self.at;
        let n_out = b * rows * h * d;
        let Some((o0, o1)) = l.contiguous_offsets() else {
            candle_core::bail!("flash_fwd_fold: the state {:?} is not contiguous", l.shape())
        };
        let slice = st.as_cuda_slice_mut::<f32>()?;
        let mut buf = slice.slice_mut(o0..o1);
        let (out, lse) = buf.split_at_mut(n_out);
        with_storages(&self.qkv, |qkv| write(qkv, self.dims, FwdDst { out, lse, fold: Some(self.at) }))
    }
}
