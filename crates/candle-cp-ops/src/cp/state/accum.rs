//! [`RowAccum`]: f32 gradient accumulators `[planes, B, rows, H, D]` to which blocks
//! `[B, n, H, D]` are added at a row offset — dQ of this rank's local rows (`planes = 1`) and
//! the dK/dV contributions to one K/V chunk (`planes = 2`: plane 0 dK, plane 1 dV).
//!
//! - **Host form** (CPU tensors): a host `Vec<f32>`, `+=` in place over the block's rows.
//! - **CUDA** (`InPlace`): one f32 tensor on the device, each block added to its rows in place
//!   by one kernel (`AddRowsInPlace`, `add_rows_inplace_*` in
//!   `candle-cp-kernels/kernels/merge.cu`): one pass (read the rows and the block, write the
//!   rows). Nothing goes through the host.
//! - **Other devices** (`Device`): one f32 tensor on the device, updated with
//!   [`Tensor::slice_set`] over the block's rows only — O(n) per update, where
//!   `slice_assign`/`index_add` would rebuild the whole accumulator. A row range never written
//!   before is set from the block (one copy); otherwise `rows + block` (strided read, one add)
//!   is written back. The reference the `InPlace` form is tested against.

use super::bwd_op::AddBwdDq;
use super::merge_op::{add_slices, block_on, AddRowsInPlace};
use super::{with_host_f32, Residency};
use crate::attention::BwdCall;
use candle_core::{DType, Device, Result, Tensor};

/// An f32 gradient accumulator of shape `[planes, B, rows, H, D]`, to which blocks
/// `[B, n, H, D]` are added at a row offset: host memory for CPU tensors, an f32 tensor on the
/// device otherwise (see the module doc).
pub struct RowAccum {
    repr: Repr,
    dims: (usize, usize, usize, usize, usize),
}

/// Where the accumulator lives.
enum Repr {
    /// Host `[planes * B * rows * H * D]`, row-major.
    Host { data: Vec<f32> },
    /// f32 `[planes, B, rows, H, D]` (contiguous, owned by this accumulator) on a device, and
    /// per (plane, row) whether the row holds anything yet.
    Device { acc: Tensor, written: Vec<bool> },
    /// f32 `[planes, B, rows, H, D]` (contiguous, owned) on CUDA (or forced on the CPU), added
    /// to in place by [`AddRowsInPlace`].
    InPlace { acc: Tensor },
}

impl RowAccum {
    /// Zeros of shape `[planes, B, rows, H, D]` in host memory.
    pub fn new(planes: usize, b: usize, rows: usize, h: usize, d: usize) -> Self {
        Self {
            repr: Repr::Host {
                data: vec![0f32; planes * b * rows * h * d],
            },
            dims: (planes, b, rows, h, d),
        }
    }

    /// Zeros of shape `[planes, B, rows, H, D]` for blocks on `device`: host memory when
    /// `device` is the CPU (same as [`RowAccum::new`]), an f32 tensor on `device` otherwise.
    pub fn on_device(
        planes: usize,
        b: usize,
        rows: usize,
        h: usize,
        d: usize,
        device: &Device,
    ) -> Result<Self> {
        Self::with_residency(planes, b, rows, h, d, device, Residency::Auto)
    }

    /// Zeros in the form `residency` picks for `device`.
    pub(crate) fn with_residency(
        planes: usize,
        b: usize,
        rows: usize,
        h: usize,
        d: usize,
        device: &Device,
        residency: Residency,
    ) -> Result<Self> {
        if residency.device_form(device) {
            Self::device_resident(planes, b, rows, h, d, device)
        } else {
            Ok(Self::new(planes, b, rows, h, d))
        }
    }

    /// Zeros as an f32 tensor on `device`, whatever the device (also CPU: tests compare it
    /// against the host form): the in-place form on CUDA and the CPU, the `slice_set` form
    /// elsewhere.
    pub(crate) fn device_resident(
        planes: usize,
        b: usize,
        rows: usize,
        h: usize,
        d: usize,
        device: &Device,
    ) -> Result<Self> {
        if !(device.is_cuda() || device.is_cpu()) {
            return Self::device_resident_slice_set(planes, b, rows, h, d, device);
        }
        Ok(Self {
            repr: Repr::InPlace {
                acc: Tensor::zeros((planes, b, rows, h, d), DType::F32, device)?,
            },
            dims: (planes, b, rows, h, d),
        })
    }

    /// Zeros in the `slice_set` device form (the form for devices without the in-place add,
    /// and the reference of the in-place form).
    pub(crate) fn device_resident_slice_set(
        planes: usize,
        b: usize,
        rows: usize,
        h: usize,
        d: usize,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            repr: Repr::Device {
                acc: Tensor::zeros((planes, b, rows, h, d), DType::F32, device)?,
                written: vec![false; planes * rows],
            },
            dims: (planes, b, rows, h, d),
        })
    }

    /// An accumulator that starts from `t` (f32 `[planes, B, rows, H, D]`, a tensor nobody else
    /// holds: the ring's received accumulators, fresh buffers) instead of zeros, in the form
    /// `residency` picks for `t`'s device. The device forms take `t`'s storage and add to it in
    /// place (a contiguous copy first when `t` is a strided view); the host form copies it.
    pub(crate) fn from_tensor(t: Tensor, residency: Residency) -> Result<Self> {
        let dims = match *t.dims() {
            [planes, b, rows, h, d] if t.dtype() == DType::F32 => (planes, b, rows, h, d),
            _ => candle_core::bail!(
                "RowAccum::from_tensor: expected f32 [planes, B, rows, H, D], got {:?} {:?}",
                t.dtype(),
                t.shape()
            ),
        };
        let device = t.device().clone();
        if !residency.device_form(&device) {
            let data = t.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
            return Ok(Self {
                repr: Repr::Host { data },
                dims,
            });
        }
        let acc = if t.is_contiguous() {
            t
        } else {
            t.force_contiguous()?
        };
        let repr = if device.is_cuda() || device.is_cpu() {
            Repr::InPlace { acc }
        } else {
            Repr::Device {
                acc,
                written: vec![true; dims.0 * dims.2],
            }
        };
        Ok(Self { repr, dims })
    }

    /// Add `x [B, n, H, D]` (any float dtype, any device) to rows `row0 .. row0 + n` of plane
    /// `plane`.
    pub fn add_rows(&mut self, plane: usize, row0: usize, x: &Tensor) -> Result<()> {
        let (planes, b, rows, h, d) = self.dims;
        let (bx, n, hx, dx) = x.dims4()?;
        if plane >= planes || bx != b || hx != h || dx != d || row0 + n > rows {
            candle_core::bail!(
                "RowAccum::add_rows: block {:?} at plane {plane}, row {row0} does not fit [planes, B, rows, H, D] = {:?}",
                x.shape(),
                self.dims
            )
        }
        if x.elem_count() == 0 {
            return Ok(()); // no rows (or H·D = 0): nothing to add
        }
        match &mut self.repr {
            Repr::Host { data } => {
                with_host_f32(x, |xs| add_slices(data, self.dims, plane, row0, xs))
            }
            Repr::InPlace { acc } => {
                let x = block_on(x, acc.device())?;
                let op = AddRowsInPlace {
                    dims: self.dims,
                    plane,
                    row0,
                };
                acc.inplace_op2(&x, &op)
            }
            Repr::Device { acc, written } => {
                let x = x
                    .to_device(acc.device())?
                    .to_dtype(DType::F32)?
                    .contiguous()?
                    .unsqueeze(0)?;
                // Plane `plane`: a contiguous view [1, B, rows, H, D] of `acc`'s storage.
                let dst = acc.narrow(0, plane, 1)?;
                let w = &mut written[plane * rows + row0..plane * rows + row0 + n];
                if w.iter().any(|&f| f) {
                    let sum = (dst.narrow(2, row0, n)? + &x)?;
                    dst.slice_set(&sum, 2, row0)?;
                } else {
                    dst.slice_set(&x, 2, row0)?;
                }
                w.fill(true);
                Ok(())
            }
        }
    }

    /// Runs the backward `call` and adds its dQ `[B, n, H, D]` to rows `row0 .. row0 + n` of
    /// plane 0; returns its dK, dV. In the in-place form (CUDA) the kernels add dQ straight into
    /// the accumulator ([`AddBwdDq`]); otherwise the call returns dQ and [`RowAccum::add_rows`]
    /// adds it. Same sums either way.
    pub(crate) fn add_bwd(&mut self, row0: usize, call: &BwdCall<'_>) -> Result<(Tensor, Tensor)> {
        let (planes, b, rows, h, d) = self.dims;
        let (bq, n, hq, dq) = call.q.dims4()?;
        if planes != 1 || (bq, hq, dq) != (b, h, d) || row0 + n > rows {
            candle_core::bail!(
                "RowAccum::add_bwd: dq rows {row0}..{} of q {:?} do not fit [planes, B, rows, H, D] = {:?}",
                row0 + n,
                call.q.shape(),
                self.dims
            )
        }
        match &mut self.repr {
            Repr::InPlace { acc } => {
                let op = AddBwdDq {
                    call: *call,
                    dims: self.dims,
                    row0,
                    out: std::sync::Mutex::new(None),
                };
                acc.inplace_op1(&op)?;
                op.take()
            }
            _ => {
                let (dqb, dk, dv) = call.run()?;
                self.add_rows(0, row0, &dqb)?;
                Ok((dk, dv))
            }
        }
    }

    /// The accumulated tensor `[planes, B, rows, H, D]` (f32) on `device`.
    pub fn finish(self, device: &Device) -> Result<Tensor> {
        let (planes, b, rows, h, d) = self.dims;
        match self.repr {
            Repr::Host { data } => {
                Tensor::from_vec(data, (planes, b, rows, h, d), &Device::Cpu)?.to_device(device)
            }
            Repr::Device { acc, .. } | Repr::InPlace { acc } => acc.to_device(device),
        }
    }

    /// Whether this accumulator is in the device form.
    #[cfg(test)]
    pub(crate) fn is_device_form(&self) -> bool {
        matches!(self.repr, Repr::Device { .. } | Repr::InPlace { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(t: &Tensor) -> Result<Vec<f32>> {
        t.flatten_all()?.to_vec1::<f32>()
    }

    #[test]
    fn accum_adds_at_rows() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::arange(0f32, 2. * 3. * 2., &dev)?.reshape((2, 3, 2, 1))?;
        for device_form in [false, true] {
            let mut acc = if device_form {
                RowAccum::device_resident(2, 2, 5, 2, 1, &dev)?
            } else {
                RowAccum::new(2, 2, 5, 2, 1)
            };
            acc.add_rows(1, 2, &x)?;
            acc.add_rows(1, 2, &x)?;
            let t = acc.finish(&dev)?;
            let want = Tensor::zeros((2, 2, 5, 2, 1), DType::F32, &dev)?
                .slice_assign(&[1..2, 0..2, 2..5, 0..2, 0..1], &(&x * 2.0)?.unsqueeze(0)?)?;
            assert_eq!(flat(&t)?, flat(&want)?, "device form {device_form}");
        }
        Ok(())
    }

    /// An accumulator started from a tensor adds to it, in every form: the blocks' sum plus the
    /// starting values, and the device forms write into the tensor's own storage.
    #[test]
    fn from_tensor_adds_to_the_tensor() -> Result<()> {
        let dev = Device::Cpu;
        let (planes, b, rows, h, d) = (2, 2, 7, 3, 4);
        let start = Tensor::randn(0f32, 1., (planes, b, rows, h, d), &dev)?;
        let x = Tensor::randn(0f32, 1., (b, 3, h, d), &dev)?;
        let want = start.slice_assign(
            &[1..2, 0..b, 2..5, 0..h, 0..d],
            &(start.narrow(0, 1, 1)?.narrow(2, 2, 3)? + x.unsqueeze(0)?)?,
        )?;
        for residency in [Residency::Auto, Residency::ForceDevice] {
            let t = start.copy()?;
            let mut acc = RowAccum::from_tensor(t.clone(), residency)?;
            assert_eq!(acc.is_device_form(), residency == Residency::ForceDevice);
            acc.add_rows(1, 2, &x)?;
            let got = acc.finish(&dev)?;
            assert_eq!(flat(&got)?, flat(&want)?, "{residency:?}");
            // in place in the device form: the tensor handed over holds the sum
            let held = if residency == Residency::ForceDevice {
                &want
            } else {
                &start
            };
            assert_eq!(flat(&t)?, flat(held)?, "{residency:?}");
        }
        // strided input: copied first, then added to
        let t = Tensor::cat(&[&start, &start], 2)?.narrow(2, 0, rows)?;
        assert!(!t.is_contiguous());
        let mut acc = RowAccum::from_tensor(t, Residency::ForceDevice)?;
        acc.add_rows(1, 2, &x)?;
        assert_eq!(flat(&acc.finish(&dev)?)?, flat(&want)?);
        let e = RowAccum::from_tensor(x.clone(), Residency::Auto)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        // (not an accumulator's shape: an error naming it)
        assert!(e.contains("[2, 3, 3, 4]"), "{e}");
        Ok(())
    }

    /// A backward call's dQ added by `add_bwd`: the in-place form (its op's CPU body) equals the
    /// host form bit for bit, both equal the call's own dQ added to the rows, dK / dV are the
    /// call's; rows past the accumulator are an error naming the shapes.
    #[test]
    fn add_bwd_adds_the_calls_dq() -> Result<()> {
        use crate::attention::{attention_fwd, BwdCall, BwdPrep, CallMask, Mask};
        use crate::oracle::randn;
        let (b, n, h, hkv, d, rows, row0) = (2, 12, 4, 2, 8, 30, 7);
        let q = randn(1, &[b, n, h, d], 1.0)?;
        let (k, v) = (
            randn(2, &[b, 20, hkv, d], 1.0)?,
            randn(3, &[b, 20, hkv, d], 1.0)?,
        );
        let dout = randn(4, &[b, n, h, d], 1.0)?;
        let mask = Mask::causal_offsets(10, 0);
        let (out, lse) = attention_fwd(&q, &k, &v, &mask, 0.3)?;
        let prep = BwdPrep::new(&q, &out, &dout)?;
        let call = BwdCall {
            q: &q,
            k: &k,
            v: &v,
            lse: &lse,
            prep: &prep,
            mask: CallMask::Mask(&mask),
            scale: 0.3.into(),
        };
        let (dq, dk, dv) = call.run()?;
        let start = Tensor::randn(0f32, 1., (1, b, rows, h, d), &Device::Cpu)?;
        let want = start.slice_assign(
            &[0..1, 0..b, row0..row0 + n, 0..h, 0..d],
            &(start.narrow(2, row0, n)? + dq.unsqueeze(0)?)?,
        )?;
        let mut got = Vec::new();
        for residency in [Residency::Auto, Residency::ForceDevice] {
            let mut acc = RowAccum::from_tensor(start.copy()?, residency)?;
            let (gk, gv) = acc.add_bwd(row0, &call)?;
            assert_eq!(
                (flat(&gk)?, flat(&gv)?),
                (flat(&dk)?, flat(&dv)?),
                "{residency:?}"
            );
            got.push(flat(&acc.finish(&Device::Cpu)?)?);
        }
        assert_eq!(got[0], got[1]);
        assert_eq!(got[0], flat(&want)?);
        let mut acc = RowAccum::device_resident(1, b, rows, h, d, &Device::Cpu)?;
        let e = acc
            .add_bwd(rows - 4, &call)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("[2, 12, 4, 8]") && e.contains("(1, 2, 30, 4, 8)"),
            "{e}"
        );
        Ok(())
    }

    /// Both device forms (forced on CPU) equal the host form bit for bit over overlapping,
    /// partly written and never written row ranges on both planes, with f32, f16, bf16 and
    /// strided blocks; the blocks added are left unchanged.
    #[test]
    fn device_accum_equals_host_accum() -> Result<()> {
        for slice_set in [false, true] {
            device_accum_case(slice_set)?;
        }
        Ok(())
    }

    fn device_accum_case(slice_set: bool) -> Result<()> {
        let dev = Device::Cpu;
        let form = |planes, b, rows, h, d| {
            if slice_set {
                RowAccum::device_resident_slice_set(planes, b, rows, h, d, &dev)
            } else {
                RowAccum::device_resident(planes, b, rows, h, d, &dev)
            }
        };
        let (planes, b, rows, h, d) = (2, 2, 11, 3, 4);
        let mut host = RowAccum::on_device(planes, b, rows, h, d, &dev)?;
        assert!(!host.is_device_form());
        let mut devs = form(planes, b, rows, h, d)?;
        assert!(devs.is_device_form());
        assert_eq!(matches!(devs.repr, Repr::InPlace { .. }), !slice_set);
        let forced = RowAccum::with_residency(1, 1, 1, 1, 1, &dev, Residency::ForceDevice)?;
        assert!(forced.is_device_form());
        // (plane, row0, n): fresh, overlapping (partly written), repeated, the other plane,
        // the whole plane; rows 9..11 of plane 1 are never written.
        let adds = [
            (0, 2, 4),
            (0, 4, 5),
            (0, 2, 4),
            (1, 0, 3),
            (0, 0, 11),
            (1, 3, 6),
        ];
        for (i, &(plane, row0, n)) in adds.iter().enumerate() {
            let x = Tensor::randn(0f32, 1., (b, n, h, d), &dev)?;
            let x = match i % 4 {
                0 => x,
                1 => x.to_dtype(DType::F16)?,
                3 => x.to_dtype(DType::BF16)?,
                // strided: a [B, n, H, D] view of a [B, n, D, H] tensor
                _ => Tensor::randn(0f32, 1., (b, n, d, h), &dev)?.transpose(2, 3)?,
            };
            let before = flat(&x.to_dtype(DType::F32)?)?;
            host.add_rows(plane, row0, &x)?;
            devs.add_rows(plane, row0, &x)?;
            assert_eq!(
                flat(&x.to_dtype(DType::F32)?)?,
                before,
                "add {i} changed its block"
            );
        }
        let (th, td) = (host.finish(&dev)?, devs.finish(&dev)?);
        assert_eq!(td.dims(), [planes, b, rows, h, d]);
        assert_eq!(flat(&th)?, flat(&td)?);
        let untouched = flat(&td.get(1)?.narrow(1, 9, 2)?)?;
        assert!(untouched.iter().all(|x| *x == 0.0));
        assert!(flat(&td)?.iter().filter(|x| **x != 0.0).count() > 0);

        // Bad blocks are rejected by both forms, naming the shapes.
        for mut acc in [RowAccum::new(1, 2, 4, 2, 1), form(1, 2, 4, 2, 1)?] {
            let rows_over = acc.add_rows(0, 2, &Tensor::zeros((2, 3, 2, 1), DType::F32, &dev)?);
            let e = rows_over.expect_err("rows over the end").to_string();
            assert!(
                e.contains("[2, 3, 2, 1]") && e.contains("(1, 2, 4, 2, 1)"),
                "{e}"
            );
            assert!(acc
                .add_rows(1, 0, &Tensor::zeros((2, 1, 2, 1), DType::F32, &dev)?)
                .is_err());
            assert!(acc
                .add_rows(0, 0, &Tensor::zeros((2, 1, 3, 1), DType::F32, &dev)?)
                .is_err());
            assert!(acc
                .add_rows(0, 0, &Tensor::zeros((2, 1, 2), DType::F32, &dev)?)
                .is_err());
            // An empty block is a no-op.
            acc.add_rows(0, 4, &Tensor::zeros((2, 0, 2, 1), DType::F32, &dev)?)?;
        }
        Ok(())
    }
}
