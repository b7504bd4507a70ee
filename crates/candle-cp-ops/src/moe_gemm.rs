//! The experts' grouped products as plain tensor functions (no graph): the forward, `dx` and
//! `dW` that [`crate::moe::grouped_matmul`], its bias variant and
//! [`crate::moe_update::grouped_matmul_update`] build their nodes from.
//!
//! Rows of `x` `[M, in]` grouped by expert (`counts[e]` each, in expert order), weights `w`
//! `[E, out, in]`:
//!
//! ```text
//!   gmm        y  [M, out]      = x_e · w[e]ᵀ  (+ bias[e] on columns col0 .. col0 + nb)
//!   gmm_dx     dx [M, in]       = dy_e · w[e]
//!   gmm_dw     dw [E, out, in]  = dy_eᵀ · x_e   (zeros for an expert without rows)
//!   gmm_dbias  db [E, nb]       = Σ_rows of e  dy_e[:, col0 .. col0 + nb]
//! ```
//!
//! Two paths: **per expert** (candle's matmul on each expert's rows, then `cat` / `stack`: one
//! GEMM launch per expert on a GPU; the path on every device), and on CUDA (f32, f16, bf16) the
//! **grouped kernel** of `candle_cp_kernels::grouped_gemm`, one launch whatever the number of
//! experts. [`GroupedImpl`] picks: `CANDLE_CP_GROUPED_GEMM=kernel|per-expert|auto|auto:N`
//! (default `auto`: the kernel where an expert's rows are few — at most [`AUTO_ROWS`], or `N`,
//! per expert on average — the per-expert GEMMs otherwise).

use candle_core::{bail, DType, Result, Tensor};

/// `auto`'s bound on the mean rows per expert (of the experts that have rows) up to which the
/// grouped kernel runs. Provisional: no GPU has timed the two paths yet (`gpu_bench --moe`
/// prints both at several row counts; set this from its crossover).
pub const AUTO_ROWS: usize = 256;

/// Which path computes the grouped products of a CUDA tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupedImpl {
    /// The kernel for few rows per expert (at most [`AUTO_ROWS`] on average), else per expert.
    Auto,
    /// `Auto` with another bound on the mean rows per expert (`auto:N`: the crossover
    /// `gpu_bench --moe 1` measured on this GPU).
    AutoBelow(usize),
    /// Always the grouped kernel (CUDA, f32 / f16 / bf16).
    Kernel,
    /// Always one candle matmul per expert.
    PerExpert,
}

impl GroupedImpl {
    /// From `CANDLE_CP_GROUPED_GEMM` = `kernel` | `per-expert` | `auto` | `auto:N` | unset or
    /// empty (`Auto`). Any other value also runs `Auto`, and the first such call says so on stderr (a
    /// misspelt path must not pass for a measurement of it).
    pub fn from_env() -> Self {
        let v = std::env::var("CANDLE_CP_GROUPED_GEMM").unwrap_or_default();
        Self::from_name(&v).unwrap_or_else(|| {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("candle-cp: CANDLE_CP_GROUPED_GEMM={v:?} is not a path (kernel, per-expert, auto, auto:N); running auto"));
            GroupedImpl::Auto
        })
    }

    /// The path named `kernel`, `per-expert`, `auto` (empty: `auto`) or `auto:N` (N rows per
    /// expert), or `None`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name.trim() {
            "kernel" => Some(GroupedImpl::Kernel),
            "per-expert" => Some(GroupedImpl::PerExpert),
            "auto" | "" => Some(GroupedImpl::Auto),
            n => n.strip_prefix("auto:").and_then(|r| r.trim().parse().ok()).map(GroupedImpl::AutoBelow),
        }
    }

    /// Whether the grouped kernel runs for rows `t` grouped by `counts`.
    pub fn kernel_for(self, t: &Tensor, counts: &[usize]) -> bool {
        if !t.device().is_cuda() || !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) || !cfg!(feature = "cuda") {
            return false;
        }
        match self {
            GroupedImpl::Kernel => true,
            GroupedImpl::PerExpert => false,
            GroupedImpl::Auto => few_rows(counts, AUTO_ROWS),
            GroupedImpl::AutoBelow(rows) => few_rows(counts, rows),
        }
    }
}

/// `Auto`'s rule: at most `rows` rows per expert on average over the experts with rows.
fn few_rows(counts: &[usize], rows: usize) -> bool {
    let active = counts.iter().filter(|&&n| n > 0).count().max(1);
    counts.iter().sum::<usize>() <= rows.saturating_mul(active)
}

/// `f(e, rows of expert e)` for each expert with rows, concatenated: `[M, width]`.
pub(crate) fn blocks(x: &Tensor, counts: &[usize], width: usize, f: impl Fn(usize, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(counts.len());
    let mut off = 0;
    for (e, &n) in counts.iter().enumerate() {
        if n > 0 {
            parts.push(f(e, &x.narrow(0, off, n)?)?);
        }
        off += n;
    }
    match parts.len() {
        0 => Tensor::zeros((0, width), x.dtype(), x.device()),
        _ => Tensor::cat(&parts, 0),
    }
}

fn check_counts(op: &str, t: &Tensor, counts: &[usize], e: usize) -> Result<()> {
    if counts.len() != e || counts.iter().sum::<usize>() != t.dim(0)? {
        bail!("{op}: {} row counts {counts:?} for E = {e} experts and rows {:?}", counts.len(), t.dims())
    }
    Ok(())
}

/// `y` `[M, out]` = each expert's rows of `x` `[M, in]` times `w[e]ᵀ` (`w` `[E, out, in]`),
/// plus `bias` `[E, nb]` on columns `[col0, col0 + nb)` when given (the caller checked its shape);
/// the path `CANDLE_CP_GROUPED_GEMM` picks ([`gmm_using`] names it).
pub fn gmm(x: &Tensor, w: &Tensor, bias: Option<(&Tensor, usize)>, counts: &[usize]) -> Result<Tensor> {
    gmm_using(GroupedImpl::from_env(), x, w, bias, counts)
}

/// [`gmm`] on the path `imp` picks (the kernel only for CUDA tensors of f32, f16, bf16).
pub fn gmm_using(imp: GroupedImpl, x: &Tensor, w: &Tensor, bias: Option<(&Tensor, usize)>, counts: &[usize]) -> Result<Tensor> {
    #[cfg(not(feature = "cuda"))]
    let _ = imp;
    let (e, o, _) = w.dims3()?;
    check_counts("gmm", x, counts, e)?;
    #[cfg(feature = "cuda")]
    if imp.kernel_for(x, counts) {
        return candle_cp_kernels::grouped_gemm::forward(x, w, bias, counts);
    }
    blocks(x, counts, o, |e, xe| {
        let y = xe.matmul(&w.get(e)?.t()?)?;
        match bias {
            Some((b, col0)) => {
                let nb = b.dim(1)?;
                y.broadcast_add(&b.get(e)?.unsqueeze(0)?.pad_with_zeros(1, col0, o - col0 - nb)?)
            }
            None => Ok(y),
        }
    })
}

/// `dx` `[M, in]` = each expert's rows of `dy` `[M, out]` times `w[e]` (`w` `[E, out, in]`).
pub fn gmm_dx(dy: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    gmm_dx_using(GroupedImpl::from_env(), dy, w, counts)
}

/// [`gmm_dx`] on the path `imp` picks.
pub fn gmm_dx_using(imp: GroupedImpl, dy: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    #[cfg(not(feature = "cuda"))]
    let _ = imp;
    let (e, _, i) = w.dims3()?;
    check_counts("gmm_dx", dy, counts, e)?;
    #[cfg(feature = "cuda")]
    if imp.kernel_for(dy, counts) {
        return candle_cp_kernels::grouped_gemm::dx(dy, w, counts);
    }
    blocks(dy, counts, i, |e, ge| ge.matmul(&w.get(e)?))
}

/// `dw` `[E, out, in]`: expert `e`'s rows of `dy` `[M, out]`, transposed, times its rows of `x`
/// `[M, in]`; zeros for an expert without rows.
pub fn gmm_dw(dy: &Tensor, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
    gmm_dw_using(GroupedImpl::from_env(), dy, x, counts)
}

/// [`gmm_dw`] on the path `imp` picks.
pub fn gmm_dw_using(imp: GroupedImpl, dy: &Tensor, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
    #[cfg(not(feature = "cuda"))]
    let _ = imp;
    let (o, i) = (dy.dim(1)?, x.dim(1)?);
    check_counts("gmm_dw", dy, counts, counts.len())?;
    #[cfg(feature = "cuda")]
    if imp.kernel_for(dy, counts) {
        return candle_cp_kernels::grouped_gemm::dw(dy, x, counts);
    }
    let mut dw = Vec::with_capacity(counts.len());
    let mut off = 0;
    for &n in counts {
        dw.push(match n {
            0 => Tensor::zeros((o, i), dy.dtype(), dy.device())?,
            _ => dy.narrow(0, off, n)?.t()?.matmul(&x.narrow(0, off, n)?)?,
        });
        off += n;
    }
    Tensor::stack(&dw, 0)
}

/// `db` `[E, nb]` (of `bias` `[E, nb]` added at column `col0`): each expert's rows of `dy`
/// `[M, out]` summed over those columns in f32 (zeros for an expert without rows), in `bias`'s
/// dtype. On the kernel path one grouped `dw` against a column of ones.
pub fn gmm_dbias(dy: &Tensor, bias: &Tensor, col0: usize, counts: &[usize]) -> Result<Tensor> {
    gmm_dbias_using(GroupedImpl::from_env(), dy, bias, col0, counts)
}

/// [`gmm_dbias`] on the path `imp` picks.
pub fn gmm_dbias_using(imp: GroupedImpl, dy: &Tensor, bias: &Tensor, col0: usize, counts: &[usize]) -> Result<Tensor> {
    #[cfg(not(feature = "cuda"))]
    let _ = imp;
    let nb = bias.dim(1)?;
    check_counts("gmm_dbias", dy, counts, bias.dim(0)?)?;
    #[cfg(feature = "cuda")]
    if imp.kernel_for(dy, counts) {
        let g = dy.narrow(1, col0, nb)?.to_dtype(DType::F32)?;
        let ones = Tensor::ones((dy.dim(0)?, 1), DType::F32, dy.device())?;
        return candle_cp_kernels::grouped_gemm::dw(&g, &ones, counts)?.reshape((counts.len(), nb))?.to_dtype(bias.dtype());
    }
    let mut db = Vec::with_capacity(counts.len());
    let mut off = 0;
    for &n in counts {
        db.push(match n {
            0 => Tensor::zeros(nb, bias.dtype(), bias.device())?,
            _ => dy.narrow(0, off, n)?.narrow(1, col0, nb)?.to_dtype(DType::F32)?.sum(0)?.to_dtype(bias.dtype())?,
        });
        off += n;
    }
    Tensor::stack(&db, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::{grouped_matmul_bias_slow, grouped_matmul_slow};
    use candle_core::{Device, Var};

    fn t(shape: &[usize], seed: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.61 + seed).sin() * 0.5) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }

    fn diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// The four products against candle's autograd through the slow references: an expert
    /// without rows (zero dW and dbias), a bias on a column slice.
    #[test]
    fn products_match_the_slow_reference_and_its_gradients() -> Result<()> {
        let (e, i, o, col0, nb) = (3, 5, 6, 2, 3);
        let counts = [4usize, 0, 3];
        let m = 7;
        let (x, w, b) = (Var::from_tensor(&t(&[m, i], 0.1)?)?, Var::from_tensor(&t(&[e, o, i], 1.2)?)?, Var::from_tensor(&t(&[e, nb], 2.3)?)?);
        let dy = t(&[m, o], 3.4)?;
        let want = grouped_matmul_bias_slow(x.as_tensor(), w.as_tensor(), b.as_tensor(), col0, &counts)?;
        let g = (&want * &dy)?.sum_all()?.backward()?;
        let grad = |v: &Var| g.get(v.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()));
        assert!(diff(&gmm(x.as_tensor(), w.as_tensor(), Some((b.as_tensor(), col0)), &counts)?, &want)? < 1e-6);
        assert!(diff(&gmm(x.as_tensor(), w.as_tensor(), None, &counts)?, &grouped_matmul_slow(x.as_tensor(), w.as_tensor(), &counts)?)? < 1e-6);
        assert!(diff(&gmm_dx(&dy, w.as_tensor(), &counts)?, &grad(&x)?)? < 1e-6);
        let dw = gmm_dw(&dy, x.as_tensor(), &counts)?;
        assert!(diff(&dw, &grad(&w)?)? < 1e-6);
        assert_eq!(dw.get(1)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        let db = gmm_dbias(&dy, b.as_tensor(), col0, &counts)?;
        assert!(diff(&db, &grad(&b)?)? < 1e-6);
        assert!(db.abs()?.sum_all()?.to_scalar::<f32>()? > 1e-3);
        let err = gmm(x.as_tensor(), w.as_tensor(), None, &[4, 3]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("[4, 3]") && err.contains("[7, 5]"), "{err}");
        Ok(())
    }

    /// CPU tensors never take the kernel; `Auto` takes it up to `AUTO_ROWS` rows per expert
    /// with rows on average; the names the environment variable takes.
    #[test]
    fn the_kernel_runs_only_on_cuda_and_for_few_rows() -> Result<()> {
        let x = t(&[4, 2], 0.0)?;
        for imp in [GroupedImpl::Auto, GroupedImpl::Kernel, GroupedImpl::PerExpert] {
            assert!(!imp.kernel_for(&x, &[4]));
        }
        assert_eq!(GroupedImpl::from_name(" kernel"), Some(GroupedImpl::Kernel));
        assert_eq!(GroupedImpl::from_name("per-expert"), Some(GroupedImpl::PerExpert));
        assert_eq!(GroupedImpl::from_name(""), Some(GroupedImpl::Auto));
        assert_eq!(GroupedImpl::from_name("cublas"), None);
        assert_eq!(GroupedImpl::from_name("auto:512"), Some(GroupedImpl::AutoBelow(512)));
        assert_eq!(GroupedImpl::from_name("auto:"), None);
        assert_eq!(GroupedImpl::from_name("auto:-1"), None);
        let r = AUTO_ROWS;
        assert!(few_rows(&[r, 0, r], r));
        assert!(few_rows(&[0, 0], r));
        assert!(!few_rows(&[r + 1, 0], r));
        assert!(!few_rows(&[2 * r, 0, 0, 0], r) && few_rows(&[2 * r - 1, 1], r));
        assert!(few_rows(&[r + 1, 0], r + 1) && !few_rows(&[1], 0));
        Ok(())
    }
}
