//! Dropout keep masks on CUDA from counter-based streams. CPU reference:
//! `candle_cp_nn::RngStreams::uniform_rows` then `u >= p`, times `1 / (1 - p)`, cast (equal bit
//! for bit); callers: `candle_cp_nn::RngStreams::keep_mask_rows` and `candle_cp_nn::Dropout::mask`
//! on a CUDA device.

use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Result, Tensor};
use half::{bf16, f16};

/// The keep mask `[rows.len(), cols.len()]` in `dtype` (f32, f16 or bf16) on the CUDA device
/// `device`: element `(r, j)` is `scale` (rounded to `dtype`) when the uniform value of global
/// element `rows[r]·total_cols + cols.start + j` of stream `key` is `>= p`, else 0. The row
/// indices travel to the device (8 bytes a row); nothing of the mask's size is drawn on the
/// host. Errors: columns past `total_cols`, another dtype, a device that is not CUDA.
#[allow(clippy::too_many_arguments)]
pub fn keep_mask(rows: &[u64], key: u64, cols: std::ops::Range<usize>, total_cols: usize, p: f32, scale: f32, dtype: DType, device: &Device) -> Result<Tensor> {
    let Device::Cuda(dev) = device else { candle_core::bail!("dropout keep_mask: device {device:?} is not CUDA") };
    if cols.end > total_cols || cols.start > cols.end {
        candle_core::bail!("dropout keep_mask: columns {cols:?} past the {total_cols} of the global tensor")
    }
    let n = rows.len() * cols.len();
    if n == 0 {
        return Tensor::zeros((rows.len(), cols.len()), dtype, device);
    }
    let idx: Vec<i64> = rows.iter().map(|&r| i64::try_from(r)).collect::<std::result::Result<_, _>>().map_err(|_| candle_core::Error::Msg("dropout keep_mask: a row index past i64".into()))?;
    let idx = Tensor::from_vec(idx, rows.len(), device)?;
    let (st, l) = idx.storage_and_layout();
    let rv = util::view::<i64>(util::storage(&st, "dropout keep_mask: row indices")?, l, "rows")?;
    let n_rows = util::to_i64(rows.len(), "rows")?;
    let ncols = util::to_i64(cols.len(), "cols")?;
    let (col0, total) = (cols.start as u64, total_cols as u64);
    let cfg = LaunchConfig { grid_dim: (util::grid_stride_blocks(n), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            // SAFETY: the kernel writes all n elements.
            let mut out = unsafe { dev.alloc::<$ty>(n)? };
            let func = dev.get_or_load_custom_func($name, ptx::DROPOUT_MODULE, ptx::DROPOUT)?;
            let mut bld = func.builder();
            bld.arg(&rv).arg(&n_rows).arg(&key).arg(&col0).arg(&ncols).arg(&total).arg(&p).arg(&scale).arg(&mut out);
            // SAFETY: matches KEEP_ENTRY in kernels/dropout.cu.
            unsafe { bld.launch(cfg) }.w()?;
            util::to_tensor(out, dev, (rows.len(), cols.len()))
        }};
    }
    Ok(match dtype {
        DType::F32 => go!(f32, "dropout_keep_f32"),
        DType::F16 => go!(f16, "dropout_keep_f16"),
        DType::BF16 => go!(bf16, "dropout_keep_bf16"),
        dt => candle_core::bail!("dropout keep_mask: dtype {dt:?} not supported (f32, f16, bf16); mask [{}, {}]", rows.len(), cols.len()),
    })
}
