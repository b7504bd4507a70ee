//! The f32 running state `(out, lse)` of this rank's local query rows across ring steps.
//!
//! Each ring step produces partial results `(out_s [B, n, H, D], lse_s [B, H, n])` for a run
//! of local rows (a query segment) over a disjoint set of keys; the state folds them in through
//! the log-sum-exp:
//!
//! ```text
//! m = max(lse, lse_s)   w = e^(lse-m)   w_s = e^(lse_s-m)
//! out ← (w·out + w_s·out_s) / (w + w_s)     lse ← m + ln(w + w_s)     (-inf rows stay 0/-inf)
//! ```
//!
//! The state starts at out 0, lse `-inf` (the empty key set) for all `T/P` local rows, so the
//! final tensors need no concatenation. It has two representations, chosen by
//! [`LocalState::on_device`] from the device of the queries:
//!
//! - **CPU** (`Host`): host `Vec<f32>`s, merged in place in one pass. (The general
//!   [`crate::attention::merge`] builds ~10 broadcast tensor ops per merge, ~40% of a 1k×1k
//!   attention block on CPU; it stays the reference this is tested against.)
//! - **CUDA** (`Buffer`): `out [B, T/P, H, D]` and `lse [B, H, T/P]` in ONE f32 device buffer,
//!   each partial result folded into rows `row0 .. row0 + n` in place by one kernel
//!   (`MergeRowsInPlace`, `merge_rows_inplace_*` in `candle-cp-kernels/kernels/merge.cu`): one
//!   pass over the block's rows. Nothing is copied to the host; [`LocalState::finish`] returns
//!   `out` as a view of the buffer (the caller casts it to the output dtype once) and `lse` as
//!   its own small copy (so the lse the backward keeps does not pin the f32 `out`).
//! - **Other devices** (`Device`): f32 tensors `out`, `lse` on the device; each partial result
//!   is merged with [`crate::attention::merge`] on `narrow`ed views of its rows and written back
//!   with `Tensor::slice_set` (O(n) work, but each row moves three times). It is the reference
//!   the `Buffer` form is tested against.
//!
//! Both device forms can be forced on the CPU (the `Buffer` form's CPU body is the host form's
//! own merge), which is how they are tested against each other without a GPU.

use crate::attention::Scores;
use super::merge_op::{block_on, merge_slices, MergeRowsInPlace};
use super::{with_host_f32, Residency};
use crate::attention::{fwd_packed, CallMask};
use candle_core::{DType, Device, Result, Tensor};

/// Running (out, lse) of `T/P` local query rows, f32: host memory on CPU, device tensors
/// elsewhere (see the module doc).
pub struct LocalState {
    repr: Repr,
    dims: (usize, usize, usize, usize),
}

/// Where the running state lives.
enum Repr {
    /// Host `out [B*T/P*H*D]`, `lse [B*H*T/P]`, merged in place (CPU queries).
    Host { out: Vec<f32>, lse: Vec<f32> },
    /// f32 `out [B, T/P, H, D]`, `lse [B, H, T/P]` on the queries' device, merged with
    /// [`crate::attention::merge`] and `slice_set`.
    Device { out: Tensor, lse: Tensor },
    /// One f32 buffer `[B·T/P·H·D + B·H·T/P]` (`out`, then `lse`) on CUDA (or forced on the
    /// CPU), merged in place by [`MergeRowsInPlace`].
    Buffer { buf: Tensor },
    /// The `Buffer` form before anything was folded in: no buffer yet. The first merge makes
    /// it (out 0, lse `-inf`), or a first result covering every row becomes it
    /// ([`LocalState::adopt_packed`]: no initialisation, no merge).
    Empty { device: Device },
}

/// The empty `Buffer` (out 0, lse `-inf`) of a state of `dims` on `device`.
fn empty_buffer((b, tl, h, d): (usize, usize, usize, usize), device: &Device) -> Result<Tensor> {
    Tensor::cat(
        &[
            Tensor::zeros(b * tl * h * d, DType::F32, device)?,
            Tensor::full(f32::NEG_INFINITY, b * h * tl, device)?,
        ],
        0,
    )
}

impl LocalState {
    /// Empty state (out 0, lse `-inf`) for `[B, T/P, H, D]` local rows, in host memory.
    pub fn new(b: usize, tl: usize, h: usize, d: usize) -> Self {
        Self {
            repr: Repr::Host {
                out: vec![0f32; b * tl * h * d],
                lse: vec![f32::NEG_INFINITY; b * h * tl],
            },
            dims: (b, tl, h, d),
        }
    }

    /// Empty state for `[B, T/P, H, D]` local rows of queries on `device`: host memory when
    /// `device` is the CPU (same as [`LocalState::new`]), f32 tensors on `device` otherwise.
    pub fn on_device(b: usize, tl: usize, h: usize, d: usize, device: &Device) -> Result<Self> {
        Self::with_residency(b, tl, h, d, device, Residency::Auto)
    }

    /// Empty state in the form `residency` picks for `device`.
    pub(crate) fn with_residency(
        b: usize,
        tl: usize,
        h: usize,
        d: usize,
        device: &Device,
        residency: Residency,
    ) -> Result<Self> {
        if residency.device_form(device) {
            Self::device_resident(b, tl, h, d, device)
        } else {
            Ok(Self::new(b, tl, h, d))
        }
    }

    /// Empty device-form state on `device`, whatever the device (also CPU: tests compare it
    /// against the host state): the in-place `Buffer` form on CUDA and the CPU, the
    /// `slice_set` form elsewhere.
    pub(crate) fn device_resident(
        b: usize,
        tl: usize,
        h: usize,
        d: usize,
        device: &Device,
    ) -> Result<Self> {
        if !(device.is_cuda() || device.is_cpu()) {
            return Self::device_resident_slice_set(b, tl, h, d, device);
        }
        Ok(Self {
            repr: Repr::Empty {
                device: device.clone(),
            },
            dims: (b, tl, h, d),
        })
    }

    /// Empty state in the `slice_set` device form (merge into fresh tensors, written back),
    /// the form for devices without the in-place merge and the reference of the `Buffer` form.
    pub(crate) fn device_resident_slice_set(
        b: usize,
        tl: usize,
        h: usize,
        d: usize,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            repr: Repr::Device {
                out: Tensor::zeros((b, tl, h, d), DType::F32, device)?,
                lse: Tensor::full(f32::NEG_INFINITY, (b, h, tl), device)?,
            },
            dims: (b, tl, h, d),
        })
    }

    /// Fold in a partial result for local rows `row0 .. row0 + n`:
    /// `out_s [B, n, H, D]`, `lse_s [B, H, n]` (any float dtype, any device).
    pub fn merge_rows(&mut self, row0: usize, out_s: &Tensor, lse_s: &Tensor) -> Result<()> {
        let (b, tl, h, d) = self.dims;
        let (bs, n, hs, ds) = out_s.dims4()?;
        if bs != b || hs != h || ds != d || row0 + n > tl || lse_s.dims() != [b, h, n] {
            candle_core::bail!(
                "LocalState::merge_rows: partial out {:?}, lse {:?} at row {row0} do not fit the state [B, T/P, H, D] = {:?}",
                out_s.shape(),
                lse_s.shape(),
                self.dims
            )
        }
        if out_s.elem_count() == 0 {
            return Ok(()); // no rows (or D = 0): nothing to fold in
        }
        self.init_empty()?;
        match &mut self.repr {
            Repr::Empty { .. } => {
                candle_core::bail!("LocalState: empty after initialisation (internal error)")
            }
            Repr::Host { out, lse } => merge_host(out, lse, self.dims, row0, out_s, lse_s),
            Repr::Buffer { buf } => {
                let os = block_on(out_s, buf.device())?;
                let ls = block_on(&lse_s.to_dtype(DType::F32)?, buf.device())?;
                let op = MergeRowsInPlace {
                    dims: self.dims,
                    row0,
                };
                buf.inplace_op3(&os, &ls, &op)
            }
            Repr::Device { out, lse } => {
                let dev = out.device().clone();
                let os = out_s.to_device(&dev)?.to_dtype(DType::F32)?;
                let ls = lse_s.to_device(&dev)?.to_dtype(DType::F32)?;
                if row0 == 0 && n == tl {
                    let (o, l) = crate::attention::merge(out, lse, &os, &ls)?;
                    (*out, *lse) = (o, l);
                } else {
                    let oa = out.narrow(1, row0, n)?.contiguous()?;
                    let la = lse.narrow(2, row0, n)?.contiguous()?;
                    let (o, l) = crate::attention::merge(&oa, &la, &os, &ls)?;
                    // In place, O(rows): `out`/`lse` are this state's own contiguous tensors
                    // and `o`/`l` fresh merge results.
                    out.slice_set(&o.contiguous()?, 1, row0)?;
                    lse.slice_set(&l.contiguous()?, 2, row0)?;
                }
                Ok(())
            }
        }
    }

    /// Fold in the forward of `q [B, n, H, D]` (local rows `row0 .. row0 + n`) against `k, v`
    /// under `mask`: what [`LocalState::merge_rows`] of that forward's result gives. The first
    /// call over all rows of the in-place form becomes the state ([`LocalState::adopt_packed`]);
    /// later calls on CUDA are folded in by the forward kernels' epilogue where they can
    /// (`flash::fwd_fold`: no partial result written and read back, no merge pass); everything
    /// else runs the forward and merges.
    pub(crate) fn merge_fwd(
        &mut self,
        row0: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: CallMask<'_>,
        scale: Scores,
    ) -> Result<()> {
        let (_, n, _, _) = q.dims4()?;
        if self.takes_packed(row0, n) {
            return self.adopt_packed(fwd_packed(q, k, v, mask, scale)?);
        }
        #[cfg(feature = "cuda")]
        {
            let (b, tl, h, d) = self.dims;
            if q.device().is_cuda() && q.dims4()? == (b, n, h, d) && row0 + n <= tl && n > 0 {
                self.init_empty()?;
                if let Repr::Buffer { buf } = &self.repr {
                    if crate::attention::fwd_fold_cuda(q, k, v, mask, scale, buf, tl, row0)? {
                        return Ok(());
                    }
                }
            }
        }
        let (o, l) = mask.fwd(q, k, v, scale)?;
        self.merge_rows(row0, &o, &l)
    }

    /// The `Empty` form becomes the `Buffer` form of the empty state (out 0, lse `-inf`); other
    /// forms stay as they are.
    fn init_empty(&mut self) -> Result<()> {
        if let Repr::Empty { device } = &self.repr {
            self.repr = Repr::Buffer {
                buf: empty_buffer(self.dims, device)?,
            };
        }
        Ok(())
    }

    /// Whether a result for rows `row0 .. row0 + n` would become the state as it is
    /// ([`LocalState::adopt_packed`]): nothing folded in yet (in-place form) and all rows.
    pub(crate) fn takes_packed(&self, row0: usize, n: usize) -> bool {
        matches!(self.repr, Repr::Empty { .. }) && row0 == 0 && n == self.dims.1
    }

    /// Takes `buf`, a first result for ALL rows in the buffer layout (f32 `[B·T/P·H·D +
    /// B·H·T/P]`: out then lse, e.g. `candle_cp_kernels::flash::fwd_packed`), as the state: what
    /// folding it into the empty state gives (for a result whose rows with lse `-inf` have out 0,
    /// as every attention kernel's do), without initialising the buffer or merging.
    /// Errors unless [`LocalState::takes_packed`] holds for all rows and `buf` has that shape.
    pub(crate) fn adopt_packed(&mut self, buf: Tensor) -> Result<()> {
        let (b, tl, h, d) = self.dims;
        let n = b * tl * h * d + b * h * tl;
        let Repr::Empty { device } = &self.repr else {
            candle_core::bail!("LocalState::adopt_packed: the state already holds results")
        };
        if buf.dims() != [n] || buf.dtype() != DType::F32 || !buf.device().same_device(device) {
            candle_core::bail!(
                "LocalState::adopt_packed: expected an f32 buffer [{n}] on {device:?} for the state [B, T/P, H, D] = {:?}, got {:?} {:?} on {:?}",
                self.dims,
                buf.dtype(),
                buf.shape(),
                buf.device()
            )
        }
        let buf = if buf.is_contiguous() {
            buf
        } else {
            buf.force_contiguous()?
        };
        self.repr = Repr::Buffer { buf };
        Ok(())
    }

    /// The state as f32 tensors `(out [B, T/P, H, D], lse [B, H, T/P])` on `device`.
    pub fn finish(self, device: &Device) -> Result<(Tensor, Tensor)> {
        let (b, tl, h, d) = self.dims;
        let repr = match self.repr {
            Repr::Empty { device } => Repr::Buffer {
                buf: empty_buffer(self.dims, &device)?,
            },
            r => r,
        };
        match repr {
            Repr::Empty { .. } => {
                candle_core::bail!("LocalState: empty after initialisation (internal error)")
            }
            Repr::Host { out, lse } => Ok((
                Tensor::from_vec(out, (b, tl, h, d), &Device::Cpu)?.to_device(device)?,
                Tensor::from_vec(lse, (b, h, tl), &Device::Cpu)?.to_device(device)?,
            )),
            Repr::Device { out, lse } => Ok((out.to_device(device)?, lse.to_device(device)?)),
            Repr::Buffer { buf } => {
                let no = b * tl * h * d;
                let out = buf.narrow(0, 0, no)?.reshape((b, tl, h, d))?;
                // its own copy: the lse kept for the backward must not pin the f32 out
                let lse = buf
                    .narrow(0, no, b * h * tl)?
                    .reshape((b, h, tl))?
                    .force_contiguous()?;
                Ok((out.to_device(device)?, lse.to_device(device)?))
            }
        }
    }
}

/// The host merge of [`LocalState::merge_rows`], in place; shapes already checked.
fn merge_host(
    out: &mut [f32],
    lse: &mut [f32],
    dims: (usize, usize, usize, usize),
    row0: usize,
    out_s: &Tensor,
    lse_s: &Tensor,
) -> Result<()> {
    with_host_f32(lse_s, |ls| {
        with_host_f32(out_s, |os| merge_slices(out, lse, dims, row0, os, ls))
    })??;
    Ok(())
}

#[cfg(test)]
#[path = "local_tests.rs"]
mod tests;
