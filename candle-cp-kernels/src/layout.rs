//! Sequence layouts and the all-to-all pack/unpack on CUDA. CPU reference: the candle
//! `narrow`/`cat`/`index_select` formulations in `candle_cp_ops::cp` and the chunk/concat of
//! `ThreadGroup::all_to_all`; `examples/gpu_check.rs` compares them.

use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};
use half::{bf16, f16};

/// How a global sequence of length `L` is split over `P` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqLayout {
    /// `2P` chunks of `L/(2P)`; rank `r` holds chunks `r` and `2P-1-r` (balanced causal load).
    Zigzag,
    /// Token `t` on rank `t mod P`, at local index `t / P`.
    Striped,
}


/// Copy kernel over `x` (made contiguous): `name_{dtype}` with args (src, dst, extra...).
fn launch(
    x: &Tensor,
    kernel: &str,
    out_dims: &[usize],
    extra: &[i64],
    mode: Option<i32>,
) -> Result<Tensor> {
    let dev = util::cuda_device(x, kernel)?;
    let n: usize = out_dims.iter().product();
    if n == 0 {
        return Tensor::zeros(out_dims, x.dtype(), x.device());
    }
    let x = x.contiguous()?;
    let (st, l) = x.storage_and_layout();
    let st = util::storage(&st, kernel)?;
    let cfg = LaunchConfig { grid_dim: (util::grid_stride_blocks(n), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    macro_rules! go {
        ($ty:ty, $sfx:literal) => {{
            let src = util::view::<$ty>(st, l, kernel)?;
            // SAFETY: the kernel writes all n elements.
            let mut dst = unsafe { dev.alloc::<$ty>(n)? };
            let func = dev.get_or_load_custom_func(&format!("{kernel}_{}", $sfx), ptx::LAYOUT_MODULE, ptx::LAYOUT)?;
            let mut bld = func.builder();
            bld.arg(&src).arg(&mut dst);
            if let Some(m) = mode.as_ref() {
                bld.arg(m);
            }
            for e in extra {
                bld.arg(e);
            }
            // SAFETY: argument lists match LAYOUT_ENTRIES in kernels/layout.cu.
            unsafe { bld.launch(cfg) }.w()?;
            util::to_tensor(dst, &dev, out_dims)
        }};
    }
    Ok(match x.dtype() {
        DType::F32 => go!(f32, "f32"),
        DType::F16 => go!(f16, "f16"),
        DType::BF16 => go!(bf16, "bf16"),
        DType::U32 => go!(u32, "u32"),
        DType::U8 => go!(u8, "u8"),
        dt => candle_core::bail!("{kernel}: dtype {dt:?} not supported (f32, f16, bf16, u32, u8); shape {:?}", x.shape()),
    })
}

/// (A, N, E): product of dims before `dim`, `dims[dim]`, product after.
fn split3(x: &Tensor, dim: usize, what: &str) -> Result<(usize, usize, usize)> {
    let dims = x.dims();
    if dim >= dims.len() {
        candle_core::bail!("{what}: dim {dim} out of range for shape {:?}", x.shape())
    }
    Ok((dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product()))
}

/// Rank `r`'s shard of the global sequence along `dim`: `[.., L, ..]` -> `[.., L/P, ..]`.
/// `L` must divide by `2P` (zigzag) or `P` (striped).
pub fn shard(x: &Tensor, dim: usize, layout: SeqLayout, p: usize, r: usize) -> Result<Tensor> {
    let (a, l, e) = split3(x, dim, "shard")?;
    let unit = if layout == SeqLayout::Zigzag { 2 * p } else { p };
    if p == 0 || r >= p || l % unit != 0 {
        candle_core::bail!("shard: length {l} of dim {dim} of {:?} must divide by {unit} ({layout:?}, P = {p}, rank {r})", x.shape())
    }
    let mode = if layout == SeqLayout::Zigzag { 0 } else { 1 };
    let mut out = x.dims().to_vec();
    out[dim] = l / p;
    let args = [a, l, l / p, e, l, p, r].map(|v| v as i64);
    launch(x, "seq_permute", &out, &args, Some(mode))
}

/// Inverse of [`shard`]: `x` holds the `P` shards concatenated along `dim` in rank order
/// (what an all-gather returns); returns the global sequence order.
pub fn unshard(x: &Tensor, dim: usize, layout: SeqLayout, p: usize) -> Result<Tensor> {
    let (a, l, e) = split3(x, dim, "unshard")?;
    let unit = if layout == SeqLayout::Zigzag { 2 * p } else { p };
    if p == 0 || l % unit != 0 {
        candle_core::bail!("unshard: length {l} of dim {dim} of {:?} must divide by {unit} ({layout:?}, P = {p})", x.shape())
    }
    let mode = if layout == SeqLayout::Zigzag { 2 } else { 3 };
    let args = [a, l, l, e, l, p, 0].map(|v| v as i64);
    launch(x, "seq_permute", x.dims(), &args, Some(mode))
}

/// All-to-all send buffer: split `split_dim` into `P` chunks and put the chunk index first:
/// `[d0.., N, ..]` -> `[P, d0.., N/P, ..]` (contiguous; chunk `j` goes to rank `j`).
pub fn a2a_pack(x: &Tensor, split_dim: usize, p: usize) -> Result<Tensor> {
    let (a, n, e) = split3(x, split_dim, "a2a_pack")?;
    if p == 0 || n % p != 0 {
        candle_core::bail!("a2a_pack: dim {split_dim} of {:?} must divide by P = {p}", x.shape())
    }
    let mut out = vec![p];
    out.extend_from_slice(x.dims());
    out[split_dim + 1] = n / p;
    launch(x, "a2a_pack", &out, &[a as i64, p as i64, (n / p * e) as i64], None)
}

/// All-to-all receive buffer `[P, d0.., n, ..]` (chunk `j` from rank `j`) -> the chunks
/// concatenated along `concat_dim` (an index into the dims after the leading `P`):
/// `[d0.., P*n, ..]`.
pub fn a2a_unpack(x: &Tensor, concat_dim: usize) -> Result<Tensor> {
    let dims = x.dims();
    if dims.len() < 2 || concat_dim + 1 >= dims.len() {
        candle_core::bail!("a2a_unpack: expected [P, ...] with concat dim {concat_dim} inside, got {:?}", x.shape())
    }
    let p = dims[0];
    let a: usize = dims[1..concat_dim + 1].iter().product();
    let m: usize = dims[concat_dim + 1..].iter().product();
    let mut out = dims[1..].to_vec();
    out[concat_dim] *= p;
    launch(x, "a2a_unpack", &out, &[a as i64, p as i64, m as i64], None)
}
