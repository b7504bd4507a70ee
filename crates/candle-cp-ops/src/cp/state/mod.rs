//! The f32 running state of context-parallel attention: the forward's `(out, lse)` of this
//! rank's local query rows ([`LocalState`]) and the backward's gradient accumulators
//! ([`RowAccum`]: dQ of the local rows, dK/dV of a K/V chunk).
//!
//! Both have two representations, chosen from the device of the tensors they accumulate:
//!
//! - **CPU** (host form): host `Vec<f32>`s updated in place in one pass — no tensor op per
//!   update, which is what keeps the CPU ring fast.
//! - **Other devices** (device form): f32 tensors on that device. On CUDA each update is one
//!   in-place kernel over the rows of the update (candle `InplaceOp3` / `InplaceOp2` in
//!   `merge_op`: the merge of a step's partial result, the add of a gradient block), each row
//!   read and written once. On other devices, candle tensor ops touching only those rows
//!   (`narrow`, merge or add, then an in-place `Tensor::slice_set`: O(rows) per update, where
//!   `slice_assign` or `index_add` would rebuild the whole tensor). Nothing is copied to the
//!   host between ring steps; `finish` hands the f32 tensors back.
//!
//! The device form can also be forced on the CPU (crate-internal `Residency::ForceDevice`;
//! there the in-place ops run their CPU bodies, the host form's own loops), which is how it is
//! tested against the host form, and the in-place form against the `slice_set` form, without a
//! GPU.

mod accum;
mod bwd_op;
mod local;
mod merge_op;

pub use accum::RowAccum;
pub use local::LocalState;

use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor};

/// Which representation a state or accumulator takes (crate-internal; the public ops always
/// use [`Residency::Auto`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Residency {
    /// Host form on the CPU, device form on any other device.
    #[default]
    Auto,
    /// Device form whatever the device (tests run it on the CPU against the host form).
    ForceDevice,
}

impl Residency {
    /// Whether state for tensors on `device` takes the device form.
    pub(crate) fn device_form(self, device: &Device) -> bool {
        self == Residency::ForceDevice || !device.is_cpu()
    }
}

/// Run `f` on the f32 contents of `t` (row-major), without a copy when `t` is a contiguous
/// f32 CPU tensor.
fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.device().is_cpu() && t.dtype() == DType::F32 {
        let (st, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) =
            (&*st, layout.contiguous_offsets())
        {
            return Ok(f(&v[a..b]));
        }
    }
    let v = t
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(f(&v))
}
