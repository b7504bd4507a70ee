//! A mixture of experts' grouped products on CUDA, every expert in one launch
//! (`kernels/grouped_gemm.cu`). CPU reference: the per-expert path of
//! `candle_cp_ops::moe_gemm` (candle matmuls, `candle_cp_ops::moe::grouped_matmul_slow`); caller:
//! the same module on a CUDA device.
//!
//! The rows of `x` `[M, in]` are grouped by expert, `counts[e]` rows each, in expert order:
//!
//! ```text
//!   forward  y  [M, out]      = x_e · w[e]ᵀ (+ bias[e] on columns col0 .. col0 + nb)   w [E, out, in]
//!   dx       dx [M, in]       = dy_e · w[e]
//!   dw       dw [E, out, in]  = dy_eᵀ · x_e       (zeros for an expert without rows)
//! ```
//!
//! f32 accumulation, one rounding into the dtype (f32, f16, bf16; f16 / bf16 on tensor cores).
//! The per-expert path launches one GEMM per expert (and copies the parts together); these are
//! one launch each, whatever the number of experts.

use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, DType, Device, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

/// Rows and columns of one block's output tile, and its threads (`GG_BM`, `GG_BN`,
/// `GG_THREADS` in `kernels/grouped_gemm.cu`).
const TILE: usize = 64;
const THREADS: u32 = 128;

/// The row offsets (`E + 1`: expert `e`'s rows are `offs[e] .. offs[e + 1]`) and the flattened
/// tile list (expert, first row; a tile every 64 rows of an expert, the last one shorter) of
/// `counts`; errors when the rows do not fit 32 bits.
fn tile_list(counts: &[usize]) -> Result<(Vec<u32>, Vec<u32>)> {
    let mut offs = Vec::with_capacity(counts.len() + 1);
    let mut tiles = Vec::new();
    let mut at = 0u32;
    offs.push(0u32);
    for (e, &n) in counts.iter().enumerate() {
        let n = u32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("grouped_gemm: {n} rows of expert {e} do not fit 32 bits")))?;
        let end = at.checked_add(n).ok_or_else(|| candle_core::Error::Msg(format!("grouped_gemm: row counts {counts:?} sum past 32 bits")))?;
        for r in (at..end).step_by(TILE) {
            tiles.extend([e as u32, r]);
        }
        at = end;
        offs.push(at);
    }
    Ok((offs, tiles))
}

/// The row offsets on the device, `[E + 1]` u32 (what every product reads).
fn offsets_on(counts: &[usize], dev: &Device) -> Result<Tensor> {
    let (offs, _) = tile_list(counts)?;
    Tensor::from_vec(offs, counts.len() + 1, dev)
}

/// The row offsets and the tile list on the device, and the number of tiles (the row-tiled
/// products: forward and dx).
fn tiles_on(counts: &[usize], dev: &Device) -> Result<(Tensor, Tensor, u32)> {
    let (offs, tiles) = tile_list(counts)?;
    let nt = u32::try_from(tiles.len() / 2).map_err(|_| candle_core::Error::Msg("grouped_gemm: too many row tiles".into()))?;
    Ok((Tensor::from_vec(offs, counts.len() + 1, dev)?, Tensor::from_vec(tiles, nt as usize * 2, dev)?, nt))
}

/// A kernel input made contiguous, and whether its start offset is a multiple of `ve` elements
/// (the 16-byte loads' alignment).
struct Arg {
    t: Tensor,
}

impl Arg {
    fn new(t: &Tensor) -> Result<Self> {
        Ok(Self { t: t.contiguous()? })
    }
    fn aligned(&self, ve: usize) -> bool {
        self.t.layout().start_offset().is_multiple_of(ve)
    }
}

/// The contiguous device view of a tensor's storage and layout.
fn view<'a, T: CudaDType>(s: &'a Storage, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    util::view::<T>(util::storage(s, what)?, l, what)
}

/// Shapes and devices of a grouped product: `a` `[M, ·]`, `counts` one per expert summing to
/// `M`, every tensor on `a`'s CUDA device in `a`'s dtype (f32, f16 or bf16).
fn check_common(op: &str, ts: &[(&str, &Tensor)], m: usize, counts: &[usize]) -> Result<CudaDevice> {
    let (name0, t0) = ts[0];
    let dev = util::cuda_device(t0, &format!("grouped_gemm::{op}: {name0}"))?;
    for (name, t) in ts {
        if t.dtype() != t0.dtype() || !t.device().same_device(t0.device()) {
            candle_core::bail!("grouped_gemm::{op}: {name} {:?} {:?} and {name0} {:?} {:?} differ in dtype or device", t.dims(), t.dtype(), t0.dims(), t0.dtype())
        }
    }
    if !matches!(t0.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("grouped_gemm::{op}: dtype {:?} of {name0} {:?} (f32, f16, bf16)", t0.dtype(), t0.dims())
    }
    if counts.is_empty() || counts.len() > 65_535 || counts.iter().sum::<usize>() != m {
        candle_core::bail!("grouped_gemm::{op}: row counts {counts:?} must be one per expert (1..=65535 of them) and sum to M = {m} ({name0} {:?})", t0.dims())
    }
    Ok(dev)
}

fn dims2(op: &str, what: &str, t: &Tensor) -> Result<(usize, usize)> {
    match t.dims() {
        &[a, b] => Ok((a, b)),
        d => candle_core::bail!("grouped_gemm::{op}: {what} must be 2-D, got shape {d:?}"),
    }
}

fn dims3(op: &str, what: &str, t: &Tensor) -> Result<(usize, usize, usize)> {
    match t.dims() {
        &[a, b, c] => Ok((a, b, c)),
        d => candle_core::bail!("grouped_gemm::{op}: {what} must be [E, out, in], got shape {d:?}"),
    }
}

/// `ve` elements in a 16-byte vector of `dt`.
fn ve(dt: DType) -> usize {
    16 / dt.size_in_bytes()
}

/// `y` `[M, out]`: rows `x_e` `[counts[e], in]` of `x` `[M, in]` times `w[e]ᵀ` (`w` `[E, out,
/// in]`), plus `bias` `[E, nb]` on columns `[col0, col0 + nb)` of its expert's rows when given.
/// One launch. Errors name the shapes.
pub fn forward(x: &Tensor, w: &Tensor, bias: Option<(&Tensor, usize)>, counts: &[usize]) -> Result<Tensor> {
    let (m, i) = dims2("forward", "x", x)?;
    let (e, o, wi) = dims3("forward", "w", w)?;
    let mut ts = vec![("x", x), ("w", w)];
    if let Some((b, _)) = bias {
        ts.push(("bias", b));
    }
    let dev = check_common("forward", &ts, m, counts)?;
    if wi != i || counts.len() != e {
        candle_core::bail!("grouped_gemm::forward: x {:?}, w {:?} ([E, out, in]) and {} row counts disagree", x.dims(), w.dims(), counts.len())
    }
    let (col0, nb) = match bias {
        None => (0, 0),
        Some((b, col0)) => match b.dims() {
            &[be, nb] if be == e && nb > 0 && col0 + nb <= o => (col0, nb),
            d => candle_core::bail!("grouped_gemm::forward: bias {d:?} must be [E, nb] = [{e}, nb] with col0 {col0} + nb <= out = {o}"),
        },
    };
    if m == 0 || o == 0 {
        return Tensor::zeros((m, o), x.dtype(), x.device());
    }
    let (ni, ki, c0, nbi) = (util::to_i32(o, "out")?, util::to_i32(i, "in")?, util::to_i32(col0, "col0")?, util::to_i32(nb, "nb")?);
    util::to_i32(m, "M")?;
    let (ot, tl, nt) = tiles_on(counts, x.device())?;
    let (xa, wa) = (Arg::new(x)?, Arg::new(w)?);
    let ba = bias.map(|(b, _)| Arg::new(b)).transpose()?;
    let v = ve(x.dtype());
    let vec = (i.is_multiple_of(v) && o.is_multiple_of(v) && xa.aligned(v) && wa.aligned(v)) as i32;
    let cfg = LaunchConfig { grid_dim: (nt, o.div_ceil(TILE) as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let (xg, wg, og, tg) = (xa.t.storage_and_layout(), wa.t.storage_and_layout(), ot.storage_and_layout(), tl.storage_and_layout());
    let bg = ba.as_ref().map(|b| b.t.storage_and_layout());
    let offs = view::<u32>(&og.0, og.1, "offsets")?;
    let tiles = view::<u32>(&tg.0, tg.1, "tiles")?;
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let xv = view::<$ty>(&xg.0, xg.1, "x")?;
            let wv = view::<$ty>(&wg.0, wg.1, "w")?;
            // without a bias the kernel reads none (nb = 0): w stands in for the pointer
            let bv = match &bg {
                Some(b) => view::<$ty>(&b.0, b.1, "bias")?,
                None => view::<$ty>(&wg.0, wg.1, "w")?,
            };
            // SAFETY: the kernel writes every element of y (each row is in one tile, each column
            // in one block of the grid's y).
            let mut y = unsafe { dev.alloc::<$ty>(m * o)? };
            let func = dev.get_or_load_custom_func($name, ptx::GROUPED_GEMM_MODULE, ptx::GROUPED_GEMM)?;
            let mut bld = func.builder();
            bld.arg(&xv).arg(&wv).arg(&bv).arg(&mut y).arg(&offs).arg(&tiles).arg(&ni).arg(&ki).arg(&c0).arg(&nbi).arg(&vec);
            // SAFETY: matches GG_ENTRIES' grouped_gemm_nt in kernels/grouped_gemm.cu.
            unsafe { bld.launch(cfg) }.w()?;
            util::to_tensor(y, &dev, (m, o))
        }};
    }
    Ok(match x.dtype() {
        DType::F32 => go!(f32, "grouped_gemm_nt_f32"),
        DType::F16 => go!(f16, "grouped_gemm_nt_f16"),
        _ => go!(bf16, "grouped_gemm_nt_bf16"),
    })
}

/// `dx` `[M, in]`: rows `dy_e` of `dy` `[M, out]` times `w[e]` (`w` `[E, out, in]`). One
/// launch. Errors name the shapes.
pub fn dx(dy: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    let (m, o) = dims2("dx", "dy", dy)?;
    let (e, wo, i) = dims3("dx", "w", w)?;
    let dev = check_common("dx", &[("dy", dy), ("w", w)], m, counts)?;
    if wo != o || counts.len() != e {
        candle_core::bail!("grouped_gemm::dx: dy {:?}, w {:?} ([E, out, in]) and {} row counts disagree", dy.dims(), w.dims(), counts.len())
    }
    if m == 0 || i == 0 || o == 0 {
        return Tensor::zeros((m, i), dy.dtype(), dy.device());
    }
    let (ni, ki) = (util::to_i32(i, "in")?, util::to_i32(o, "out")?);
    util::to_i32(m, "M")?;
    let (ot, tl, nt) = tiles_on(counts, dy.device())?;
    let (da, wa) = (Arg::new(dy)?, Arg::new(w)?);
    let v = ve(dy.dtype());
    let vec = (i.is_multiple_of(v) && o.is_multiple_of(v) && da.aligned(v) && wa.aligned(v)) as i32;
    let cfg = LaunchConfig { grid_dim: (nt, i.div_ceil(TILE) as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let (dg, wg, og, tg) = (da.t.storage_and_layout(), wa.t.storage_and_layout(), ot.storage_and_layout(), tl.storage_and_layout());
    let offs = view::<u32>(&og.0, og.1, "offsets")?;
    let tiles = view::<u32>(&tg.0, tg.1, "tiles")?;
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let dv = view::<$ty>(&dg.0, dg.1, "dy")?;
            let wv = view::<$ty>(&wg.0, wg.1, "w")?;
            // SAFETY: the kernel writes every element of dx.
            let mut out = unsafe { dev.alloc::<$ty>(m * i)? };
            let func = dev.get_or_load_custom_func($name, ptx::GROUPED_GEMM_MODULE, ptx::GROUPED_GEMM)?;
            let mut bld = func.builder();
            bld.arg(&dv).arg(&wv).arg(&mut out).arg(&offs).arg(&tiles).arg(&ni).arg(&ki).arg(&vec);
            // SAFETY: matches GG_ENTRIES' grouped_gemm_nn in kernels/grouped_gemm.cu.
            unsafe { bld.launch(cfg) }.w()?;
            util::to_tensor(out, &dev, (m, i))
        }};
    }
    Ok(match dy.dtype() {
        DType::F32 => go!(f32, "grouped_gemm_nn_f32"),
        DType::F16 => go!(f16, "grouped_gemm_nn_f16"),
        _ => go!(bf16, "grouped_gemm_nn_bf16"),
    })
}

/// `dw` `[E, out, in]`: expert `e`'s rows of `dy` `[M, out]`, transposed, times its rows of
/// `x` `[M, in]`; zeros for an expert without rows. One launch. Errors name the shapes.
pub fn dw(dy: &Tensor, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
    let (m, o) = dims2("dw", "dy", dy)?;
    let (xm, i) = dims2("dw", "x", x)?;
    let dev = check_common("dw", &[("dy", dy), ("x", x)], m, counts)?;
    if xm != m {
        candle_core::bail!("grouped_gemm::dw: dy {:?} and x {:?} differ in rows", dy.dims(), x.dims())
    }
    let e = counts.len();
    if o == 0 || i == 0 {
        return Tensor::zeros((e, o, i), dy.dtype(), dy.device());
    }
    let (mi, ni) = (util::to_i32(o, "out")?, util::to_i32(i, "in")?);
    util::to_i32(m, "M")?;
    let ot = offsets_on(counts, dy.device())?;
    let (da, xa) = (Arg::new(dy)?, Arg::new(x)?);
    let v = ve(dy.dtype());
    let vec = (i.is_multiple_of(v) && o.is_multiple_of(v) && da.aligned(v) && xa.aligned(v)) as i32;
    let cfg = LaunchConfig { grid_dim: (i.div_ceil(TILE) as u32, o.div_ceil(TILE) as u32, e as u32), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let (dg, xg, og) = (da.t.storage_and_layout(), xa.t.storage_and_layout(), ot.storage_and_layout());
    let offs = view::<u32>(&og.0, og.1, "offsets")?;
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let dv = view::<$ty>(&dg.0, dg.1, "dy")?;
            let xv = view::<$ty>(&xg.0, xg.1, "x")?;
            // SAFETY: the kernel writes every element of dw (zeros where an expert has no rows).
            let mut out = unsafe { dev.alloc::<$ty>(e * o * i)? };
            let func = dev.get_or_load_custom_func($name, ptx::GROUPED_GEMM_MODULE, ptx::GROUPED_GEMM)?;
            let mut bld = func.builder();
            bld.arg(&dv).arg(&xv).arg(&mut out).arg(&offs).arg(&mi).arg(&ni).arg(&vec);
            // SAFETY: matches GG_ENTRIES' grouped_gemm_tn in kernels/grouped_gemm.cu.
            unsafe { bld.launch(cfg) }.w()?;
            util::to_tensor(out, &dev, (e, o, i))
        }};
    }
    Ok(match dy.dtype() {
        DType::F32 => go!(f32, "grouped_gemm_tn_f32"),
        DType::F16 => go!(f16, "grouped_gemm_tn_f16"),
        _ => go!(bf16, "grouped_gemm_tn_bf16"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets and tiles: an expert past one tile, experts without rows (no tile), the last
    /// expert's short tile; counts past 32 bits refused.
    #[test]
    fn tile_list_covers_each_experts_rows_once() -> Result<()> {
        let (offs, tiles) = tile_list(&[70, 0, 5, 128, 0])?;
        assert_eq!(offs, [0, 70, 70, 75, 203, 203]);
        assert_eq!(tiles, [0, 0, 0, 64, 2, 70, 3, 75, 3, 139]);
        assert_eq!(tile_list(&[0, 0])?, (vec![0, 0, 0], vec![]));
        let err = tile_list(&[u32::MAX as usize, 1]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("sum past 32 bits"), "{err}");
        Ok(())
    }
}
