//! The in-place updates of the ring's f32 state on CUDA (and forced on the CPU in tests):
//! [`MergeRowsInPlace`], the fold of one ring step's partial result into the device form of
//! [`super::LocalState`], whose `out [B, T/P, H, D]` and `lse [B, H, T/P]` live in ONE f32
//! buffer (`out` first, then `lse`) so that a single in-place op can update both; and
//! [`AddRowsInPlace`], a block added to rows of a [`super::RowAccum`] (dQ, dK / dV).
//!
//! ```text
//! buffer: | out [B, T/P, H, D] ............................ | lse [B, H, T/P] |
//! block:  out_s [B, n, H, D], lse_s [B, H, n]  ->  rows row0 .. row0 + n of both, in place
//! ```
//!
//! CPU: [`merge_slices`] (the host form's own merge, so both forms compute the same thing);
//! CUDA: `merge_rows_inplace_*` in `candle-cp-kernels/kernels/merge.cu`. Either way one pass
//! over the block's rows, where a merge into fresh tensors followed by `slice_set` (the form
//! for other devices, kept as the reference in the tests) moves each row three times.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp2, InplaceOp3, Layout, Result, Tensor};
use std::borrow::Cow;

/// Fold rows `row0 .. row0 + n` of a block (`os [B, n, H, D]`, `ls [B, H, n]`) into the state
/// slices `out [B, T, H, D]`, `lse [B, H, T]` (`dims = (B, T, H, D)`), through the LSE; rows
/// masked on both sides (both LSEs `-inf`) stay out 0, lse `-inf`. Shapes already checked.
pub(crate) fn merge_slices(
    out: &mut [f32],
    lse: &mut [f32],
    dims: (usize, usize, usize, usize),
    row0: usize,
    os: &[f32],
    ls: &[f32],
) {
    let (b, tl, h, d) = dims;
    let n = ls.len().checked_div(b * h).unwrap_or(0);
    for bi in 0..b {
        for ti in 0..n {
            for hi in 0..h {
                let li = (bi * h + hi) * tl + row0 + ti;
                let (la, lb) = (lse[li], ls[(bi * h + hi) * n + ti]);
                let m = la.max(lb);
                if m == f32::NEG_INFINITY {
                    continue; // no key seen in either part: out 0, lse -inf
                }
                let (wa, wb) = ((la - m).exp(), (lb - m).exp());
                let sum = wa + wb;
                let (ca, cb) = (wa / sum, wb / sum);
                lse[li] = m + sum.ln();
                let o = ((bi * tl + row0 + ti) * h + hi) * d;
                let so = ((bi * n + ti) * h + hi) * d;
                for (x, y) in out[o..o + d].iter_mut().zip(&os[so..so + d]) {
                    *x = ca * *x + cb * *y;
                }
            }
        }
    }
}

/// A block for the in-place ops on `device`: moved there, kept in f32 / f16 / bf16 (what the
/// kernels read) or converted to f32, contiguous.
pub(crate) fn block_on(x: &Tensor, device: &Device) -> Result<Tensor> {
    let x = x.to_device(device)?;
    let x = match x.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => x,
        _ => x.to_dtype(DType::F32)?,
    };
    x.contiguous()
}

/// Elements `range` of an f32, f16 or bf16 CPU block as f32 (borrowed when already f32).
fn block_f32<'a>(
    s: &'a CpuStorage,
    range: std::ops::Range<usize>,
    what: &str,
) -> Result<Cow<'a, [f32]>> {
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[range]),
        CpuStorage::F16(v) => Cow::Owned(v[range].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::BF16(v) => Cow::Owned(v[range].iter().map(|x| x.to_f32()).collect()),
        other => candle_core::bail!(
            "{what} dtype {:?} not supported (f32, f16, bf16)",
            other.dtype()
        ),
    })
}

/// `buffer.inplace_op3(&out_s, &lse_s, &MergeRowsInPlace { .. })`: merge a partial result
/// `out_s [B, n, H, D]` (f32, f16 or bf16), `lse_s [B, H, n]` (f32), both contiguous, into rows
/// `row0 .. row0 + n` of the state buffer `[B·T·H·D + B·H·T]` f32 (contiguous) of
/// `dims = (B, T, H, D)`.
pub(crate) struct MergeRowsInPlace {
    pub dims: (usize, usize, usize, usize),
    pub row0: usize,
}

impl MergeRowsInPlace {
    /// The block's row count `n`, after checking every shape against the state.
    fn check(&self, st: &Layout, o: &Layout, l: &Layout) -> Result<usize> {
        let (b, t, h, d) = self.dims;
        let n = l.dims().get(2).copied().unwrap_or(0);
        if o.dims() != [b, n, h, d] || l.dims() != [b, h, n] || self.row0 + n > t {
            candle_core::bail!(
                "MergeRowsInPlace: block out {:?} / lse {:?} at row {} do not fit the state [B, T, H, D] = {:?}",
                o.shape(),
                l.shape(),
                self.row0,
                self.dims
            )
        }
        if st.dims() != [b * t * h * (d + 1)] || !st.is_contiguous() {
            candle_core::bail!(
                "MergeRowsInPlace: state buffer {:?} (stride {:?}) is not the contiguous [B·T·H·(D+1)] of {:?}",
                st.shape(),
                st.stride(),
                self.dims
            )
        }
        Ok(n)
    }
}

impl InplaceOp3 for MergeRowsInPlace {
    fn name(&self) -> &'static str {
        "cp-merge-rows-inplace"
    }

    fn cpu_fwd(
        &self,
        st: &mut CpuStorage,
        st_l: &Layout,
        o: &CpuStorage,
        o_l: &Layout,
        l: &CpuStorage,
        l_l: &Layout,
    ) -> Result<()> {
        self.check(st_l, o_l, l_l)?;
        let (b, t, h, d) = self.dims;
        let (Some((a0, a1)), Some((o0, o1)), Some((l0, l1))) = (
            st_l.contiguous_offsets(),
            o_l.contiguous_offsets(),
            l_l.contiguous_offsets(),
        ) else {
            candle_core::bail!(
                "MergeRowsInPlace: non-contiguous operands {:?}, {:?}",
                o_l.shape(),
                l_l.shape()
            )
        };
        let CpuStorage::F32(buf) = st else {
            candle_core::bail!(
                "MergeRowsInPlace: the state buffer must be f32, got {:?}",
                st.dtype()
            )
        };
        let CpuStorage::F32(ls) = l else {
            candle_core::bail!(
                "MergeRowsInPlace: the block lse must be f32, got {:?}",
                l.dtype()
            )
        };
        let os = block_f32(o, o0..o1, "MergeRowsInPlace: block out")?;
        let (out, lse) = buf[a0..a1].split_at_mut(b * t * h * d);
        merge_slices(out, lse, self.dims, self.row0, &os, &ls[l0..l1]);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        st: &mut candle_core::CudaStorage,
        st_l: &Layout,
        o: &candle_core::CudaStorage,
        o_l: &Layout,
        l: &candle_core::CudaStorage,
        l_l: &Layout,
    ) -> Result<()> {
        self.check(st_l, o_l, l_l)?;
        candle_cp_kernels::merge::merge_rows_inplace(st, st_l, self.dims, self.row0, o, o_l, l, l_l)
    }
}

/// `acc += x` over rows `row0 .. row0 + n` of plane `plane`: `acc [planes * B * rows * H * D]`
/// row-major, `xs [B, n, H, D]` row-major; shapes already checked.
pub(crate) fn add_slices(
    acc: &mut [f32],
    dims: (usize, usize, usize, usize, usize),
    plane: usize,
    row0: usize,
    xs: &[f32],
) {
    let (_, b, rows, h, d) = dims;
    let row = h * d;
    let n = xs.len().checked_div(b * row).unwrap_or(0);
    for bi in 0..b {
        let dst = ((plane * b + bi) * rows + row0) * row;
        let src = bi * n * row;
        for (a, v) in acc[dst..dst + n * row]
            .iter_mut()
            .zip(&xs[src..src + n * row])
        {
            *a += v;
        }
    }
}

/// `acc.inplace_op2(&x, &AddRowsInPlace { .. })`: add `x [B, n, H, D]` (f32, f16 or bf16,
/// contiguous) to rows `row0 .. row0 + n` of plane `plane` of the contiguous f32 accumulator
/// `acc [planes, B, rows, H, D]` (`dims`).
pub(crate) struct AddRowsInPlace {
    pub dims: (usize, usize, usize, usize, usize),
    pub plane: usize,
    pub row0: usize,
}

impl InplaceOp2 for AddRowsInPlace {
    fn name(&self) -> &'static str {
        "cp-add-rows-inplace"
    }

    fn cpu_fwd(
        &self,
        acc: &mut CpuStorage,
        acc_l: &Layout,
        x: &CpuStorage,
        x_l: &Layout,
    ) -> Result<()> {
        let (planes, b, rows, h, d) = self.dims;
        let n = x_l.dims().get(1).copied().unwrap_or(0);
        if x_l.dims() != [b, n, h, d] || self.plane >= planes || self.row0 + n > rows {
            candle_core::bail!(
                "AddRowsInPlace: block {:?} at plane {}, row {} does not fit [planes, B, rows, H, D] = {:?}",
                x_l.shape(),
                self.plane,
                self.row0,
                self.dims
            )
        }
        let (Some((a0, a1)), Some((x0, x1))) =
            (acc_l.contiguous_offsets(), x_l.contiguous_offsets())
        else {
            candle_core::bail!(
                "AddRowsInPlace: non-contiguous operands {:?}, {:?}",
                acc_l.shape(),
                x_l.shape()
            )
        };
        if a1 - a0 != planes * b * rows * h * d {
            candle_core::bail!(
                "AddRowsInPlace: accumulator of {} elements, expected {:?}",
                a1 - a0,
                self.dims
            )
        }
        let CpuStorage::F32(data) = acc else {
            candle_core::bail!(
                "AddRowsInPlace: the accumulator must be f32, got {:?}",
                acc.dtype()
            )
        };
        let xs = block_f32(x, x0..x1, "AddRowsInPlace: block")?;
        add_slices(&mut data[a0..a1], self.dims, self.plane, self.row0, &xs);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        acc_l: &Layout,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
    ) -> Result<()> {
        candle_cp_kernels::merge::add_rows_inplace(
            acc, acc_l, self.dims, self.plane, self.row0, x, x_l,
        )
    }
}
