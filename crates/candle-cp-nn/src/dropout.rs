//! Dropout with named, seeded, counter-based random streams (no global RNG state).
//!
//! The uniform number of an element is a hash of `(seed, stream name, step, global index)`,
//! where the global index is the element's row-major index in the *global* (unsharded)
//! tensor. Consequences:
//! - different ranks of a sequence-parallel region get different masks (they hold different
//!   rows), without any per-rank seed bookkeeping;
//! - ranks that hold the same replicated activation (TP ranks outside SP regions) get the same
//!   mask;
//! - the mask equals the single-device mask of the same seed, name and step, so a parallel
//!   model with dropout can be checked against the single-device model exactly;
//! - a run is deterministic for a seed. Use a different `step` (e.g. the training step) or
//!   name (e.g. `"layers.3.attn_dropout"`) to get independent masks.

use candle_core::{Device, Result, Shape, Tensor};

/// How the local tensor relates to the global one the mask is defined on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// The local tensor is the whole tensor (replicated on every rank that holds it).
    Replicated,
    /// The local tensor is chunk `rank` of `world` equal chunks of the global tensor along
    /// `dim` (e.g. a sequence shard `[B, T/P, C]` of `[B, T, C]`: `dim = 1`).
    Sharded {
        /// The split dimension.
        dim: usize,
        /// This rank's chunk.
        rank: usize,
        /// Number of chunks.
        world: usize,
    },
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// A seed from which named random streams are derived. Cheap to copy; pass it explicitly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RngStreams {
    seed: u64,
}

impl RngStreams {
    /// Streams derived from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }
    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
    /// The 64-bit key of stream `name` at `step`.
    pub fn key(&self, name: &str, step: u64) -> u64 {
        splitmix64(splitmix64(self.seed ^ fnv1a(name)) ^ splitmix64(step.wrapping_add(0x5851_F42D_4C95_7F2D)))
    }

    /// Uniform `[0, 1)` f32 values of stream `name` at `step` for a local tensor of `shape`
    /// placed in the global tensor as `region` says. Equal on every rank for the same global
    /// element; equal to the single-device values.
    pub fn uniform(&self, name: &str, step: u64, shape: &Shape, region: &Region, device: &Device) -> Result<Tensor> {
        // the local tensor as rows (its dims up to the split one) of its dims after it
        let (rows, inner) = region_rows(shape.dims(), region)?;
        self.uniform_rows(name, step, &rows, 0..inner, inner, device)?.reshape(shape.clone())
    }

    /// Uniform values `[rows.len(), cols.len()]` of stream `name` at `step` for the rows `rows`
    /// (their indices in a global 2-D tensor of `total_cols` columns) and the columns `cols`:
    /// element `(r, j)` is the global element `rows[r]·total_cols + cols.start + j`, as
    /// [`Self::uniform`] numbers it, so ranks holding rows in any order (a CP shard, zigzag
    /// chunks) draw the single-device values.
    pub fn uniform_rows(&self, name: &str, step: u64, rows: &[u64], cols: std::ops::Range<usize>, total_cols: usize, device: &Device) -> Result<Tensor> {
        if cols.end > total_cols || cols.start > cols.end {
            candle_core::bail!("dropout: columns {cols:?} past the {total_cols} of the global tensor")
        }
        let (col0, cols) = (cols.start, cols.len());
        let key = self.key(name, step);
        let mut v = Vec::with_capacity(rows.len() * cols);
        for &r in rows {
            let base = r * total_cols as u64 + col0 as u64;
            for j in 0..cols as u64 {
                let h = splitmix64(key ^ splitmix64(base + j));
                v.push((h >> 40) as f32 * (1.0 / (1u64 << 24) as f32));
            }
        }
        Tensor::from_vec(v, (rows.len(), cols), device)
    }

    /// The scaled keep mask of dropout with probability `p` (`1 / (1 - p)` where the value of
    /// [`Self::uniform_rows`] is `>= p`, else 0) in `dtype`, for the same rows and columns. On a
    /// CUDA device (feature `cuda`) one kernel draws it there (`candle_cp_kernels::dropout`:
    /// only the row indices travel); elsewhere from [`Self::uniform_rows`] by candle ops. The
    /// same values either way.
    #[allow(clippy::too_many_arguments)]
    pub fn keep_mask_rows(&self, name: &str, step: u64, rows: &[u64], cols: std::ops::Range<usize>, total_cols: usize, p: f64, dtype: candle_core::DType, device: &Device) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if device.is_cuda() && matches!(dtype, candle_core::DType::F32 | candle_core::DType::F16 | candle_core::DType::BF16) {
            let scale = (1.0 / (1.0 - p)) as f32;
            return candle_cp_kernels::dropout::keep_mask(rows, self.key(name, step), cols, total_cols, p as f32, scale, dtype, device);
        }
        let u = self.uniform_rows(name, step, rows, cols, total_cols, device)?;
        (u.ge(p as f32)?.to_dtype(candle_core::DType::F32)? * (1.0 / (1.0 - p)))?.to_dtype(dtype)
    }
}

/// The global row indices (and the columns per row) of a local tensor of `dims` placed in the
/// global one as `region` says: [`RngStreams::uniform`]'s numbering as rows of the last
/// dimensions after `dim`.
fn region_rows(dims: &[usize], region: &Region) -> Result<(Vec<u64>, usize)> {
    let (dim, rank, world) = match *region {
        Region::Replicated => (0, 0, 1),
        Region::Sharded { dim, rank, world } => {
            if dim >= dims.len() || world == 0 || rank >= world {
                candle_core::bail!("dropout: region {region:?} does not fit a local tensor of shape {dims:?}")
            }
            (dim, rank, world)
        }
    };
    let n_local = if dims.is_empty() { 1 } else { dims[dim] };
    let outer: usize = dims.iter().take(dim).product();
    let inner: usize = dims.iter().skip(dim + 1).product();
    let rows = (0..outer).flat_map(|o| (0..n_local).map(move |j| (o * n_local * world + rank * n_local + j) as u64)).collect();
    Ok((rows, inner))
}

/// Inverted dropout: `y = x · keep / (1 - p)`, `keep = (u >= p)` with `u` from a named stream.
#[derive(Clone, Debug)]
pub struct Dropout {
    p: f64,
    name: String,
}

impl Dropout {
    /// Dropout with drop probability `p` in `[0, 1)` on stream `name`.
    pub fn new(p: f64, name: impl Into<String>) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            candle_core::bail!("dropout: probability {p} must be in [0, 1)")
        }
        Ok(Self { p, name: name.into() })
    }
    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }
    /// The stream name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The scaled keep mask (`0` or `1/(1-p)`, in `dtype`) for a local tensor of `shape`; on
    /// a CUDA device drawn there ([`RngStreams::keep_mask_rows`]), the same values.
    pub fn mask(&self, shape: &Shape, rng: &RngStreams, step: u64, region: &Region, dtype: candle_core::DType, device: &Device) -> Result<Tensor> {
        // the local tensor as rows of its dims past the split one ([`RngStreams::uniform`]'s
        // numbering); on CUDA the mask is drawn there
        let (rows, inner) = region_rows(shape.dims(), region)?;
        rng.keep_mask_rows(&self.name, step, &rows, 0..inner, inner, self.p, dtype, device)?.reshape(shape)
    }

    /// Apply dropout to `x` (any shape; `region` says which part of the global tensor `x`
    /// is). Identity when `!train` or `p == 0`. Differentiable w.r.t. `x`.
    pub fn forward(&self, x: &Tensor, rng: &RngStreams, step: u64, region: &Region, train: bool) -> Result<Tensor> {
        if !train || self.p == 0.0 {
            return Ok(x.clone());
        }
        let m = self.mask(x.shape(), rng, step, region, x.dtype(), x.device())?;
        x.mul(&m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, IndexOp};

    /// [`Dropout::mask`] (rows of a region through [`RngStreams::keep_mask_rows`], the form the
    /// CUDA kernel draws) equals the definition element by element: the hash of each element's
    /// index in the global tensor, for a replicated tensor and a shard along a middle dimension,
    /// in f32 and bf16.
    #[test]
    fn mask_equals_the_definition() -> Result<()> {
        let rng = RngStreams::new(11);
        let (p, d) = (0.25, Dropout::new(0.25, "blk.drop")?);
        let key = rng.key("blk.drop", 4);
        // (local dims, region, global index of local (a, j, rest) as a, global row, rest)
        for (dims, region, rank, world) in [(vec![2usize, 8, 5], Region::Replicated, 0, 1), (vec![3, 2, 4, 6], Region::Sharded { dim: 1, rank: 2, world: 3 }, 2, 3)] {
            let (outer, n, inner) = (dims[0], dims[1], dims[2..].iter().product::<usize>());
            let mut want = Vec::new();
            for a in 0..outer {
                for j in 0..n {
                    for e in 0..inner {
                        let g = ((a * n * world + rank * n + j) * inner + e) as u64;
                        let u = (splitmix64(key ^ splitmix64(g)) >> 40) as f32 / (1u64 << 24) as f32;
                        want.push(if u >= p as f32 { (1.0 / (1.0 - p)) as f32 } else { 0.0 });
                    }
                }
            }
            let want = Tensor::from_vec(want, dims.clone(), &Device::Cpu)?;
            for dtype in [DType::F32, DType::BF16] {
                let got = d.mask(&Shape::from(dims.clone()), &rng, 4, &region, dtype, &Device::Cpu)?;
                let diff = (got.to_dtype(DType::F32)? - want.to_dtype(dtype)?.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "{dims:?} {region:?} {dtype:?}");
            }
        }
        assert!(region_rows(&[2, 3], &Region::Sharded { dim: 2, rank: 0, world: 2 }).is_err());
        Ok(())
    }

    #[test]
    fn shard_masks_equal_slices_of_global_mask() -> Result<()> {
        let rng = RngStreams::new(7);
        let d = Dropout::new(0.3, "blk.drop")?;
        let dev = Device::Cpu;
        let global = d.mask(&Shape::from((2, 8, 5)), &rng, 3, &Region::Replicated, DType::F32, &dev)?;
        let mut parts = vec![];
        for r in 0..4 {
            let local = d.mask(&Shape::from((2, 2, 5)), &rng, 3, &Region::Sharded { dim: 1, rank: r, world: 4 }, DType::F32, &dev)?;
            let diff = (&local - global.i((.., 2 * r..2 * r + 2, ..))?)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "rank {r}");
            parts.push(local);
        }
        // shards differ from each other
        let d01 = (&parts[0] - &parts[1])?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert!(d01 > 0.0);
        // keep fraction near 1 - p, values are 0 or 1/(1-p)
        let v = global.flatten_all()?.to_vec1::<f32>()?;
        assert!(v.iter().all(|&x| x == 0.0 || (x - 1.0 / 0.7).abs() < 1e-6));
        Ok(())
    }

    #[test]
    fn streams_are_deterministic_and_named() -> Result<()> {
        let dev = Device::Cpu;
        let s = Shape::from((64, 64));
        let a = RngStreams::new(1).uniform("a", 0, &s, &Region::Replicated, &dev)?;
        let a2 = RngStreams::new(1).uniform("a", 0, &s, &Region::Replicated, &dev)?;
        let b = RngStreams::new(1).uniform("b", 0, &s, &Region::Replicated, &dev)?;
        let a_step = RngStreams::new(1).uniform("a", 1, &s, &Region::Replicated, &dev)?;
        let a_seed = RngStreams::new(2).uniform("a", 0, &s, &Region::Replicated, &dev)?;
        let diff = |x: &Tensor, y: &Tensor| -> Result<f32> { (x - y)?.abs()?.sum_all()?.to_scalar::<f32>() };
        assert_eq!(diff(&a, &a2)?, 0.0);
        assert!(diff(&a, &b)? > 100.0);
        assert!(diff(&a, &a_step)? > 100.0);
        assert!(diff(&a, &a_seed)? > 100.0);
        let mean = a.mean_all()?.to_scalar::<f32>()?;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        Ok(())
    }

    /// Rows in any order and a column slice draw the values of the whole tensor's.
    #[test]
    fn rows_draw_the_global_values() -> Result<()> {
        let (rng, dev) = (RngStreams::new(5), Device::Cpu);
        let global = rng.uniform("x", 2, &Shape::from((6, 8)), &Region::Replicated, &dev)?;
        let got = rng.uniform_rows("x", 2, &[4, 1, 5], 3..7, 8, &dev)?;
        for (i, r) in [4usize, 1, 5].into_iter().enumerate() {
            let d = (got.i(i)? - global.i((r, 3..7))?)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "row {r}");
        }
        assert!(rng.uniform_rows("x", 2, &[0], 6..10, 8, &dev).is_err());
        Ok(())
    }

    #[test]
    fn bad_probability_is_an_error() {
        assert!(Dropout::new(1.0, "x").is_err());
        assert!(Dropout::new(-0.1, "x").is_err());
    }
}
