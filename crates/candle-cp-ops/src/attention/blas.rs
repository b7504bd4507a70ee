//! Small dense building blocks for the CPU attention kernels: a bounds-checked wrapper around
//! the `gemm` crate (the GEMM candle itself uses on CPU) and a vectorisable `exp`.

/// A strided read-only matrix view: element `(r, c)` is `data[off + r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    pub fn new(data: &'a [f32], off: usize, rs: usize, cs: usize) -> Self {
        Self { data, off, rs, cs }
    }
    /// Panics (internal invariant, never user input) if `rows x cols` does not fit.
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            let last = self.off + (rows - 1) * self.rs + (cols - 1) * self.cs;
            assert!(last < self.data.len(), "attention kernel: matrix view out of bounds");
        }
    }
}

/// `dst[m x n] (row stride dst_rs, unit column stride) = (acc ? dst : 0) + beta * lhs[m x k] * rhs[k x n]`.
///
/// Runs single-threaded: the attention kernels parallelise over (batch, head, block) instead.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    acc: bool,
    lhs: Mat<'_>,
    rhs: Mat<'_>,
    beta: f32,
) {
    gemm_strided(m, n, k, dst, dst_rs, 1, acc, lhs, rhs, beta)
}

#[allow(clippy::too_many_arguments)]
fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    dst_cs: usize,
    acc: bool,
    lhs: Mat<'_>,
    rhs: Mat<'_>,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * dst_rs + (n - 1) * dst_cs < dst.len(), "attention kernel: dst out of bounds");
    if k == 0 {
        if !acc {
            for r in 0..m {
                for c in 0..n {
                    dst[r * dst_rs + c * dst_cs] = 0.0;
                }
            }
        }
        return;
    }
    lhs.check(m, k);
    rhs.check(k, n);
    // SAFETY: every element addressed by the three views was bounds-checked above, `dst` is
    // exclusively borrowed and does not alias `lhs`/`rhs` (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs as isize,
            dst_rs as isize,
            acc,
            lhs.data.as_ptr().add(lhs.off),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr().add(rhs.off),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0f32,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// `exp(x)` for f32 with ~1 ulp error on the range that matters here, written without
/// branches or libm calls so loops over it auto-vectorise. Returns 0 for `x < -87.3`
/// (including `-inf`), saturates at `exp(88)` above.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: float add rounds to nearest integer
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n from the integer bits of t (t = MAGIC + n exactly, n in [-126, 127]).
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let pow2 = f32::from_bits(((ni + 127) as u32) << 23);
    let v = y * pow2;
    if x < -87.0 {
        0.0
    } else {
        v
    }
}

/// Run `$body` compiled for AVX2+FMA when the CPU has it (runtime check), else for the
/// baseline target. `$body` must be an `#[inline(always)]` generic function call.
macro_rules! simd_dispatch {
    ($name:ident, $imp:ident, ($($arg:ident : $ty:ty),*) -> $ret:ty) => {
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $imp($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports the enabled target features (checked above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $imp($($arg),*)
        }
    };
}

const LANES: usize = 16;

/// Max of a slice (`-inf` if empty), with LANES independent accumulators so it vectorises.
#[inline(always)]
fn max_imp(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut it = row.chunks_exact(LANES);
    for c in &mut it {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in it.remainder().iter().chain(acc.iter()) {
        m = if x > m { x } else { m };
    }
    m
}

/// `row[j] = exp(row[j] - m)` in place, returning the sum of the results.
#[inline(always)]
fn exp_sub_sum_imp(row: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut it = row.chunks_exact_mut(LANES);
    for c in &mut it {
        for i in 0..LANES {
            let e = exp_f32(c[i] - m);
            c[i] = e;
            acc[i] += e;
        }
    }
    let mut s = 0f32;
    for x in it.into_remainder() {
        let e = exp_f32(*x - m);
        *x = e;
        s += e;
    }
    s + acc.iter().sum::<f32>()
}

/// `row[j] = exp(row[j] - m)` in place (no sum).
#[inline(always)]
fn exp_sub_imp(row: &mut [f32], m: f32) {
    for x in row.iter_mut() {
        *x = exp_f32(*x - m);
    }
}

/// `ds[j] = p[j] * (ds[j] - delta)` in place.
#[inline(always)]
fn ds_imp(ds: &mut [f32], p: &[f32], delta: f32) {
    for (x, p) in ds.iter_mut().zip(p) {
        *x = p * (*x - delta);
    }
}

/// `x[j] *= a`.
#[inline(always)]
fn scale_imp(x: &mut [f32], a: f32) {
    for v in x.iter_mut() {
        *v *= a;
    }
}

/// `sum_j a[j] * b[j]` with LANES accumulators.
#[inline(always)]
fn dot_imp(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut ia = a.chunks_exact(LANES);
    let mut ib = b.chunks_exact(LANES);
    for (x, y) in (&mut ia).zip(&mut ib) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ia.remainder().iter().zip(ib.remainder()).map(|(x, y)| x * y).sum();
    tail + acc.iter().sum::<f32>()
}

simd_dispatch!(row_max, max_imp, (row: &[f32]) -> f32);
/// `tanh(x) = sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|})` through [`exp_f32`] (branch-free, so
/// the row loops below vectorise; ~1e-7 absolute error, exactly ±1 past |x| ≈ 44).
#[inline(always)]
fn tanh_f32(x: f32) -> f32 {
    let e = exp_f32(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// Gemma 2's logit soft cap on one row in place: `x = cap · tanh(x / cap)`
/// (`super::Scores`).
#[inline(always)]
fn softcap_imp(row: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for x in row {
        *x = cap * tanh_f32(*x * inv);
    }
}

/// [`softcap_row`] that also writes the cap's derivative `1 - tanh²` into `grad`.
#[inline(always)]
fn softcap_grad_imp(row: &mut [f32], grad: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for (x, g) in row.iter_mut().zip(grad.iter_mut()) {
        let t = tanh_f32(*x * inv);
        *x = cap * t;
        *g = 1.0 - t * t;
    }
}

simd_dispatch!(exp_sub_sum, exp_sub_sum_imp, (row: &mut [f32], m: f32) -> f32);
simd_dispatch!(softcap_row, softcap_imp, (row: &mut [f32], cap: f32) -> ());
simd_dispatch!(softcap_row_grad, softcap_grad_imp, (row: &mut [f32], grad: &mut [f32], cap: f32) -> ());
simd_dispatch!(exp_sub, exp_sub_imp, (row: &mut [f32], m: f32) -> ());
simd_dispatch!(ds_row, ds_imp, (ds: &mut [f32], p: &[f32], delta: f32) -> ());
simd_dispatch!(scale_row, scale_imp, (x: &mut [f32], a: f32) -> ());
simd_dispatch!(dot, dot_imp, (a: &[f32], b: &[f32]) -> f32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 10.0 {
            let a = exp_f32(x) as f64;
            let b = (x as f64).exp();
            worst = worst.max(((a - b) / b).abs());
            x += 0.00731;
        }
        assert!(worst < 3e-7, "exp_f32 relative error {worst}");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        let mut row: Vec<f32> = (0..37).map(|i| i as f32 * -0.25).collect();
        let want: f32 = row.iter().map(|x| (x - 1.0).exp()).sum();
        assert_eq!(row_max(&row), 0.0);
        let got = exp_sub_sum(&mut row, 1.0);
        assert!((got - want).abs() < 1e-5 * want);
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        assert_eq!(dot(&a, &a), (0..37).map(|i| (i * i) as f32).sum::<f32>());
    }

    #[test]
    fn matmul_strided() {
        // lhs 2x3 row-major, rhs given as the transpose of a 2x3 (i.e. 3x2 with cs = 3).
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0];
        let mut d = [0.0f32; 4];
        matmul(2, 2, 3, &mut d, 2, false, Mat::new(&a, 0, 3, 1), Mat::new(&b, 0, 1, 3), 2.0);
        assert_eq!(d, [8.0, 4.0, 20.0, 10.0]);
    }
}
