//! Ring-step merge on an f32 accumulator, and the final cast. CPU reference:
//! `candle_cp_ops::attention::merge`.
//!
//! Ring attention keeps `(acc [B, T, H, D] f32, lse [B, H, T] f32)` across its P steps and
//! merges each step's block result into it with [`merge`]; only the final result is cast to
//! the model dtype ([`cast_out`]), once. Python ring implementations that round the running
//! output to bf16 after every step lose precision; this path never does.

use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::backend::BackendStorage;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};


/// Merge `(acc_o, acc_lse)` (running state; `acc_o` any float dtype, converted to f32) with a
/// block result `(blk_o, blk_lse)` over a disjoint key set: out `[B, T, H, D]` f32, lse
/// `[B, H, T]` f32. Rows where both LSEs are `-inf` stay (0, `-inf`).
pub fn merge(acc_o: &Tensor, acc_lse: &Tensor, blk_o: &Tensor, blk_lse: &Tensor) -> Result<(Tensor, Tensor)> {
    let dev = util::cuda_device(acc_o, "merge: acc_o")?;
    let (b, t, h, d) = acc_o.dims4()?;
    if blk_o.dims() != acc_o.dims() || acc_lse.dims() != [b, h, t] || blk_lse.dims() != [b, h, t] {
        candle_core::bail!(
            "merge: expected out [B, T, H, D] and lse [B, H, T], got acc_o {:?}, acc_lse {:?}, blk_o {:?}, blk_lse {:?}",
            acc_o.shape(), acc_lse.shape(), blk_o.shape(), blk_lse.shape()
        )
    }
    if b * t * h * d == 0 {
        return Ok((acc_o.to_dtype(DType::F32)?, acc_lse.to_dtype(DType::F32)?));
    }
    let (bi, ti, hi, di) = (util::to_i32(b, "B")?, util::to_i32(t, "T")?, util::to_i32(h, "H")?, util::to_i32(d, "D")?);
    let f32c = |x: &Tensor| -> Result<Tensor> { x.to_dtype(DType::F32)?.contiguous() };
    let (ao, al, bl) = (f32c(acc_o)?, f32c(acc_lse)?, f32c(blk_lse)?);
    let bo = blk_o.contiguous()?;
    let (aos, aol) = ao.storage_and_layout();
    let (als, all) = al.storage_and_layout();
    let (bos, bol) = bo.storage_and_layout();
    let (bls, bll) = bl.storage_and_layout();
    let aov = util::view::<f32>(util::storage(&aos, "merge: acc_o")?, aol, "acc_o")?;
    let alv = util::view::<f32>(util::storage(&als, "merge: acc_lse")?, all, "acc_lse")?;
    let blv = util::view::<f32>(util::storage(&bls, "merge: blk_lse")?, bll, "blk_lse")?;
    let bos = util::storage(&bos, "merge: blk_o")?;
    // SAFETY: the kernel writes every row of out and lse.
    let mut out = unsafe { dev.alloc::<f32>(b * t * h * d)? };
    let mut lse = unsafe { dev.alloc::<f32>(b * h * t)? };
    let cfg = LaunchConfig { grid_dim: ((b * t * h).div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let bov = util::view::<$ty>(bos, bol, "blk_o")?;
            let func = dev.get_or_load_custom_func($name, ptx::MERGE_MODULE, ptx::MERGE)?;
            let mut bld = func.builder();
            bld.arg(&aov).arg(&alv).arg(&bov).arg(&blv).arg(&mut out).arg(&mut lse);
            bld.arg(&bi).arg(&ti).arg(&hi).arg(&di);
            // SAFETY: matches merge_step_* in kernels/merge.cu.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match blk_o.dtype() {
        DType::F32 => go!(f32, "merge_step_f32"),
        DType::F16 => go!(f16, "merge_step_f16"),
        DType::BF16 => go!(bf16, "merge_step_bf16"),
        dt => candle_core::bail!("merge: blk_o dtype {dt:?} not supported (f32, f16, bf16); shape {:?}", blk_o.shape()),
    }
    Ok((util::to_tensor(out, &dev, (b, t, h, d)), util::to_tensor(lse, &dev, (b, h, t))))
}

/// In place, for `InplaceOp3::cuda_fwd` bodies: merge a block result over a disjoint key set
/// into rows `row0 .. row0 + n` of a running state held in ONE f32 buffer `st` (layout `st_l`,
/// contiguous): `out [B, T, H, D]` followed by `lse [B, H, T]`, `dims = (B, T, H, D)`.
/// `blk_o [B, n, H, D]` (f32, f16 or bf16) and `blk_lse [B, H, n]` f32, both contiguous. One
/// pass over the block's rows (read the state rows and the block, write the state rows), where
/// a merge into fresh tensors followed by `slice_set` moves each row three times. Rows where
/// both LSEs are `-inf` stay (0, `-inf`).
#[allow(clippy::too_many_arguments)]
pub fn merge_rows_inplace(
    st: &mut CudaStorage,
    st_l: &Layout,
    dims: (usize, usize, usize, usize),
    row0: usize,
    blk_o: &CudaStorage,
    blk_o_l: &Layout,
    blk_lse: &CudaStorage,
    blk_lse_l: &Layout,
) -> Result<()> {
    let (b, t, h, d) = dims;
    let n = blk_lse_l.dims().get(2).copied().unwrap_or(0);
    if blk_o_l.dims() != [b, n, h, d] || blk_lse_l.dims() != [b, h, n] || row0 + n > t {
        candle_core::bail!(
            "merge_rows_inplace: block out {:?} / lse {:?} at row {row0} do not fit the state [B, T, H, D] = {dims:?}",
            blk_o_l.shape(), blk_lse_l.shape()
        )
    }
    let len = b * t * h * (d + 1);
    let Some((a0, a1)) = st_l.contiguous_offsets() else {
        candle_core::bail!("merge_rows_inplace: state buffer {:?} (stride {:?}) is not contiguous", st_l.shape(), st_l.stride())
    };
    if a1 - a0 != len {
        candle_core::bail!("merge_rows_inplace: state buffer of {} elements, expected B·T·H·(D+1) = {len} for {dims:?}", a1 - a0)
    }
    if b * n * h * d == 0 {
        return Ok(());
    }
    let dev = st.device.clone();
    let bi = util::to_i32(b, "B")?;
    let ti = util::to_i32(t, "T")?;
    let r0 = util::to_i32(row0, "row0")?;
    let ni = util::to_i32(n, "n")?;
    let hi = util::to_i32(h, "H")?;
    let di = util::to_i32(d, "D")?;
    let lsv = util::view::<f32>(blk_lse, blk_lse_l, "blk_lse")?;
    let mut stv: CudaViewMut<'_, f32> = st.as_cuda_slice_mut::<f32>()?.slice_mut(a0..a1);
    let cfg = LaunchConfig { grid_dim: ((b * n * h).div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let bov = util::view::<$ty>(blk_o, blk_o_l, "blk_o")?;
            let func = dev.get_or_load_custom_func($name, ptx::MERGE_MODULE, ptx::MERGE)?;
            let mut bld = func.builder();
            bld.arg(&mut stv).arg(&bov).arg(&lsv);
            bld.arg(&bi).arg(&ti).arg(&r0).arg(&ni).arg(&hi).arg(&di);
            // SAFETY: matches merge_rows_inplace_* in kernels/merge.cu; `stv` holds the
            // B·T·H·(D+1) elements the kernel indexes.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match blk_o.dtype() {
        DType::F32 => go!(f32, "merge_rows_inplace_f32"),
        DType::F16 => go!(f16, "merge_rows_inplace_f16"),
        DType::BF16 => go!(bf16, "merge_rows_inplace_bf16"),
        dt => candle_core::bail!("merge_rows_inplace: block out dtype {dt:?} not supported (f32, f16, bf16); shape {:?}", blk_o_l.shape()),
    }
    Ok(())
}

/// In place, for `InplaceOp2::cuda_fwd` bodies: add `x [B, n, H, D]` (f32, f16 or bf16,
/// contiguous) to rows `row0 .. row0 + n` of plane `plane` of the f32 accumulator `acc`
/// (`[planes, B, rows, H, D]`, contiguous; `dims` in that order): the ring backward's dQ and
/// dK / dV accumulators. One pass (read the rows and the block, write the rows).
pub fn add_rows_inplace(
    acc: &mut CudaStorage,
    acc_l: &Layout,
    dims: (usize, usize, usize, usize, usize),
    plane: usize,
    row0: usize,
    x: &CudaStorage,
    x_l: &Layout,
) -> Result<()> {
    let (planes, b, rows, h, d) = dims;
    let n = x_l.dims().get(1).copied().unwrap_or(0);
    if x_l.dims() != [b, n, h, d] || plane >= planes || row0 + n > rows {
        candle_core::bail!(
            "add_rows_inplace: block {:?} at plane {plane}, row {row0} does not fit [planes, B, rows, H, D] = {dims:?}",
            x_l.shape()
        )
    }
    let Some((a0, a1)) = acc_l.contiguous_offsets() else {
        candle_core::bail!("add_rows_inplace: accumulator {:?} (stride {:?}) is not contiguous", acc_l.shape(), acc_l.stride())
    };
    if a1 - a0 != planes * b * rows * h * d {
        candle_core::bail!("add_rows_inplace: accumulator of {} elements, expected {dims:?}", a1 - a0)
    }
    let total = b * n * h * d;
    if total == 0 {
        return Ok(());
    }
    let dev = acc.device.clone();
    let bi = util::to_i32(b, "B")?;
    let ri = util::to_i32(rows, "rows")?;
    let pi = util::to_i32(plane, "plane")?;
    let r0 = util::to_i32(row0, "row0")?;
    let ni = util::to_i32(n, "n")?;
    let hd = util::to_i64(h * d, "H·D")?;
    let mut accv: CudaViewMut<'_, f32> = acc.as_cuda_slice_mut::<f32>()?.slice_mut(a0..a1);
    let cfg = LaunchConfig { grid_dim: (util::grid_stride_blocks(total), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let xv = util::view::<$ty>(x, x_l, "x")?;
            let func = dev.get_or_load_custom_func($name, ptx::MERGE_MODULE, ptx::MERGE)?;
            let mut bld = func.builder();
            bld.arg(&mut accv).arg(&xv).arg(&bi).arg(&ri).arg(&pi).arg(&r0).arg(&ni).arg(&hd);
            // SAFETY: matches add_rows_inplace_* in kernels/merge.cu; `accv` holds the whole
            // accumulator the kernel indexes.
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match x.dtype() {
        DType::F32 => go!(f32, "add_rows_inplace_f32"),
        DType::F16 => go!(f16, "add_rows_inplace_f16"),
        DType::BF16 => go!(bf16, "add_rows_inplace_bf16"),
        dt => candle_core::bail!("add_rows_inplace: block dtype {dt:?} not supported (f32, f16, bf16); shape {:?}", x_l.shape()),
    }
    Ok(())
}

/// Cast the f32 accumulator to `dtype` (f32, f16, bf16) once, at the end of the ring.
pub fn cast_out(acc: &Tensor, dtype: DType) -> Result<Tensor> {
    let dev = util::cuda_device(acc, "cast_out: acc")?;
    if acc.dtype() != DType::F32 {
        candle_core::bail!("cast_out: accumulator {:?} must be f32, got {:?}", acc.shape(), acc.dtype())
    }
    if acc.elem_count() == 0 {
        return acc.to_dtype(dtype);
    }
    let acc = acc.contiguous()?;
    let (st, l) = acc.storage_and_layout();
    let src = util::view::<f32>(util::storage(&st, "merge: acc")?, l, "acc")?;
    let out = cast_f32(&dev, &src, dtype)?;
    Ok(Tensor::from_storage(Storage::Cuda(out), acc.shape().clone(), candle_core::op::BackpropOp::none(), false))
}

/// Storage-level cast of an f32 buffer to `dtype` (f32, f16, bf16), for `cuda_fwd` bodies.
pub fn cast_f32(dev: &CudaDevice, src: &CudaView<'_, f32>, dtype: DType) -> Result<CudaStorage> {
    let n = src.len();
    let nn = n as u64;
    let cfg = LaunchConfig { grid_dim: (util::grid_stride_blocks(n), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            // SAFETY: the kernel writes all n elements.
            let mut dst = unsafe { dev.alloc::<$ty>(n.max(1))? };
            if n > 0 {
                let func = dev.get_or_load_custom_func($name, ptx::MERGE_MODULE, ptx::MERGE)?;
                let mut bld = func.builder();
                bld.arg(src).arg(&mut dst).arg(&nn);
                // SAFETY: matches cast_out_* in kernels/merge.cu.
                unsafe { bld.launch(cfg) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(dst, dev.clone())
        }};
    }
    Ok(match dtype {
        DType::F32 => go!(f32, "cast_out_f32"),
        DType::F16 => go!(f16, "cast_out_f16"),
        DType::BF16 => go!(bf16, "cast_out_bf16"),
        dt => candle_core::bail!("cast_out: target dtype {dt:?} not supported (f32, f16, bf16)"),
    })
}
