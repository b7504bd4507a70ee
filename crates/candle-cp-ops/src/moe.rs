//! Mixture-of-experts primitives: the grouped matrix product of the experts, and the routing
//! of tokens to them.
//!
//! A mixture-of-experts layer sends each of `N` tokens to `K` of `E` experts. Sorting the
//! `N·K` (token, slot) pairs by expert makes each expert's rows one contiguous block, and the
//! experts' products one **grouped matmul** over a stack of weights `[E, out, in]`:
//!
//! ```text
//!   x [M = N·K, in], rows by expert        w [E, out, in]
//!   ┌ rows of expert 0 (counts[0]) ┐  ·  w[0]ᵀ  ┐
//!   │ rows of expert 1 (counts[1]) │  ·  w[1]ᵀ  ├─►  y [M, out]
//!   └ ...                          ┘  ·  ...    ┘
//! ```
//!
//! [`grouped_matmul`] is one graph node: its backward computes `dx` block by block and `dW`
//! expert by expert, without the zero-padded full-size gradients that `narrow` per expert
//! would give candle's backward (one `[M, in]` tensor per expert). [`grouped_matmul_slow`] is
//! the same product from candle's ops, the reference of the tests.
//!
//! [`combine`] weights the experts' rows and sums each token's `K` of them, one node that keeps
//! only the rows and the weights ([`combine_slow`]: the same from candle's ops, which keeps
//! two more `[N·K, h]` tensors until the backward).
//!
//! [`Routing`] is the host side: each token's top `K` experts from its router probabilities
//! (chosen on the device for CUDA tensors, `kernels/moe.cu`: only the `[N, K]` choices are
//! copied down, not the `[N, E]` probabilities), the permutation that groups the pairs by
//! expert and its inverse.

use crate::autograd::{attach2, attach_n, BackwardFn};
use crate::moe_gemm;
use candle_core::{bail, DType, Result, Tensor};
use std::sync::Arc;

fn check(op: &str, x: &Tensor, w: &Tensor, counts: &[usize]) -> Result<(usize, usize, usize)> {
    let (m, i) = match x.dims() {
        &[m, i] => (m, i),
        d => bail!("{op}: x must be [M, in], got shape {d:?}"),
    };
    let (e, o, wi) = match w.dims() {
        &[e, o, wi] => (e, o, wi),
        d => bail!("{op}: w must be [E, out, in], got shape {d:?}"),
    };
    if wi != i {
        bail!("{op}: x {:?} and w {:?} ([E, out, in]) disagree on in", x.dims(), w.dims())
    }
    if counts.len() != e {
        bail!("{op}: {} row counts for w {:?} with E = {e} experts", counts.len(), w.dims())
    }
    if counts.iter().sum::<usize>() != m {
        bail!("{op}: row counts {counts:?} sum to {}, x {:?} has M = {m} rows", counts.iter().sum::<usize>(), x.dims())
    }
    if x.dtype() != w.dtype() || !x.device().same_device(w.device()) {
        bail!("{op}: x {:?} {:?} and w {:?} {:?} differ in dtype or device", x.dims(), x.dtype(), w.dims(), w.dtype())
    }
    Ok((e, o, i))
}

/// `x [M, in]` times each expert's weight: rows `[o_e, o_e + counts[e])` (`o_e` the sum of
/// the counts before `e`) by `w[e]ᵀ`, `w` `[E, out, in]` → `[M, out]`.
///
/// One graph node, differentiable w.r.t. `x` and `w` (an expert without rows gets a zero
/// gradient). Errors name the shapes: `x` not 2-D, `w` not 3-D, `in` that differ, counts that
/// are not one per expert or do not sum to `M`, dtypes or devices that differ.
pub fn grouped_matmul(x: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    check("grouped_matmul", x, w, counts)?;
    grouped("grouped_matmul", x, w, None, counts)
}

/// [`grouped_matmul`] plus each row's expert's bias (gpt-oss): `bias` `[E, nb]` is added to
/// columns `[col0, col0 + nb)` of its expert's rows (all of them when `nb = out`; a TP rank's
/// slice of a row-parallel projection's bias otherwise, so that the TP sum adds each column
/// once). One graph node keeping `x`, `w` and `bias` (no `[M, out]` tensor besides the
/// output): its backward adds `dbias[e]`, the sum of expert `e`'s rows of the output's
/// gradient over those columns. Errors name the shapes. Reference: [`grouped_matmul_bias_slow`].
pub fn grouped_matmul_bias(x: &Tensor, w: &Tensor, bias: &Tensor, col0: usize, counts: &[usize]) -> Result<Tensor> {
    let (e, o, _) = check("grouped_matmul_bias", x, w, counts)?;
    check_bias("grouped_matmul_bias", w, bias, col0, e, o)?;
    grouped("grouped_matmul_bias", x, w, Some((bias, col0)), counts)
}

/// The grouped product node of [`grouped_matmul`] and [`grouped_matmul_bias`] (checked): the
/// forward, `dx`, `dW` (and `dbias`) from [`crate::moe_gemm`] (the grouped kernel on CUDA, per
/// expert elsewhere), an expert without rows getting zero gradients.
fn grouped(name: &'static str, x: &Tensor, w: &Tensor, bias: Option<(&Tensor, usize)>, counts: &[usize]) -> Result<Tensor> {
    let (xd, wd) = (x.detach(), w.detach());
    let bias_d = bias.map(|(b, c)| (b.detach(), c));
    let y = moe_gemm::gmm(&xd, &wd, bias_d.as_ref().map(|(b, c)| (b, *c)), counts)?;
    let counts = counts.to_vec();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let dy = dy.detach();
        let mut grads = vec![Some(moe_gemm::gmm_dx(&dy, &wd, &counts)?), Some(moe_gemm::gmm_dw(&dy, &xd, &counts)?)];
        if let Some((bd, col0)) = &bias_d {
            grads.push(Some(moe_gemm::gmm_dbias(&dy, bd, *col0, &counts)?));
        }
        Ok(grads)
    });
    match bias {
        Some((b, _)) => attach_n(name, &[x, w, b], y, bwd),
        None => attach_n(name, &[x, w], y, bwd),
    }
}

/// `bias` `[E, nb]` fits `w` `[E, out, ·]` at column `col0` (`col0 + nb <= out`), its dtype
/// and device: returns `nb`.
fn check_bias(op: &str, w: &Tensor, bias: &Tensor, col0: usize, e: usize, o: usize) -> Result<usize> {
    match bias.dims() {
        &[be, nb] if be == e && nb > 0 && col0 + nb <= o && bias.dtype() == w.dtype() && bias.device().same_device(w.device()) => Ok(nb),
        d => bail!("{op}: bias {d:?} {:?} must be [E, nb] = [{e}, nb] with col0 {col0} + nb <= out = {o}, in w's dtype {:?} and device (w {:?})", bias.dtype(), w.dtype(), w.dims()),
    }
}

/// [`grouped_matmul_bias`] from candle's ops (the bias rows gathered by `index_select`,
/// padded, added; candle's backward): the reference.
pub fn grouped_matmul_bias_slow(x: &Tensor, w: &Tensor, bias: &Tensor, col0: usize, counts: &[usize]) -> Result<Tensor> {
    let (e, o, _) = check("grouped_matmul_bias_slow", x, w, counts)?;
    let nb = check_bias("grouped_matmul_bias_slow", w, bias, col0, e, o)?;
    let ids: Vec<u32> = counts.iter().enumerate().flat_map(|(e, &n)| std::iter::repeat_n(e as u32, n)).collect();
    let ids = Tensor::from_vec(ids, x.dim(0)?, x.device())?;
    grouped_matmul_slow(x, w, counts)? + bias.index_select(&ids, 0)?.pad_with_zeros(1, col0, o - col0 - nb)?
}

/// [`grouped_matmul`] from candle's ops (`narrow`, `matmul`, `cat`; candle's backward): the
/// reference.
pub fn grouped_matmul_slow(x: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    let (_, o, _) = check("grouped_matmul_slow", x, w, counts)?;
    moe_gemm::blocks(x, counts, o, |e, xe| xe.matmul(&w.get(e)?.t()?))
}

/// `y[n] = Σ_k w[n, k] · ys[inverse[n·K + k]]`: each token's `K` expert rows, `ys` `[N·K, h]`
/// in expert order, weighted by `w` `[N, K]` and summed → `[N, h]`.
///
/// One graph node keeping `ys` and `w` (the backward: `dys` the weights times the output's
/// gradient, back in expert order; `dw` each row's dot product with it). `inverse` is
/// [`Routing::inverse`]. Errors name the shapes.
pub fn combine(ys: &Tensor, w: &Tensor, inverse: &[u32]) -> Result<Tensor> {
    let (n, k, h) = check_combine("combine", ys, w, inverse)?;
    let back = Tensor::from_vec(inverse.to_vec(), n * k, ys.device())?;
    let order = {
        let mut o = vec![0u32; n * k];
        for (j, &at) in inverse.iter().enumerate() {
            o[at as usize] = j as u32;
        }
        Tensor::from_vec(o, n * k, ys.device())?
    };
    let (ysd, wd) = (ys.detach(), w.detach());
    let y = pairs(&ysd, &back, n, k, h)?.broadcast_mul(&wd.unsqueeze(2)?)?.sum(1)?;
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let dy = dy.detach().unsqueeze(1)?;
        let dys = dy.broadcast_mul(&wd.unsqueeze(2)?)?.reshape((n * k, h))?.index_select(&order, 0)?;
        let dw = pairs(&ysd, &back, n, k, h)?.broadcast_mul(&dy)?.sum(2)?;
        Ok(vec![Some(dys), Some(dw)])
    });
    attach2("combine", ys, w, y, bwd)
}

/// The rows of `ys` in (token, slot) order, `[N, K, h]`.
fn pairs(ys: &Tensor, back: &Tensor, n: usize, k: usize, h: usize) -> Result<Tensor> {
    ys.index_select(back, 0)?.reshape((n, k, h))
}

fn check_combine(op: &str, ys: &Tensor, w: &Tensor, inverse: &[u32]) -> Result<(usize, usize, usize)> {
    let (m, h) = match ys.dims() {
        &[m, h] => (m, h),
        d => bail!("{op}: ys must be [N·K, h], got shape {d:?}"),
    };
    let (n, k) = match w.dims() {
        &[n, k] => (n, k),
        d => bail!("{op}: w must be [N, K], got shape {d:?}"),
    };
    if n * k != m || inverse.len() != m {
        bail!("{op}: ys {:?}, w {:?} and {} pair positions disagree (N·K rows)", ys.dims(), w.dims(), inverse.len())
    }
    if let Some(bad) = inverse.iter().find(|&&i| i as usize >= m) {
        bail!("{op}: pair position {bad} out of range for ys {:?}", ys.dims())
    }
    if ys.dtype() != w.dtype() || !ys.device().same_device(w.device()) {
        bail!("{op}: ys {:?} {:?} and w {:?} {:?} differ in dtype or device", ys.dims(), ys.dtype(), w.dims(), w.dtype())
    }
    Ok((n, k, h))
}

/// [`combine`] from candle's ops (`index_select`, `broadcast_mul`, `sum`): the reference.
pub fn combine_slow(ys: &Tensor, w: &Tensor, inverse: &[u32]) -> Result<Tensor> {
    let (n, k, h) = check_combine("combine_slow", ys, w, inverse)?;
    let back = Tensor::from_vec(inverse.to_vec(), n * k, ys.device())?;
    pairs(ys, &back, n, k, h)?.broadcast_mul(&w.unsqueeze(2)?)?.sum(1)
}

/// Which experts the tokens go to, and how their (token, slot) pairs are grouped by expert.
///
/// For `N` tokens and `K` slots, pair `j = n·K + k` is token `n`'s `k`-th choice.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// `[N·K]`: the expert of each pair, each token's experts by falling probability (ties:
    /// the lower expert first).
    pub experts: Vec<u32>,
    /// `[N·K]`: the pairs in expert order (stable: by token within an expert).
    pub order: Vec<u32>,
    /// `[N·K]`: the position of each pair in `order` (`order[inverse[j]] == j`).
    pub inverse: Vec<u32>,
    /// `[E]`: pairs per expert (the row counts of [`grouped_matmul`]).
    pub counts: Vec<usize>,
    /// Tokens `N`.
    pub tokens: usize,
    /// Slots `K` per token.
    pub top_k: usize,
}

/// Each row's (of `rows`, `E` probabilities each) top `K` experts into `out` (`K` per row), by
/// falling probability, ties by index: the top K partitioned off (O(E)), then sorted.
fn top_k_rows(rows: &[f32], e: usize, top_k: usize, out: &mut [u32]) {
    let mut idx: Vec<u32> = Vec::with_capacity(e);
    for (row, o) in rows.chunks(e).zip(out.chunks_mut(top_k)) {
        idx.clear();
        idx.extend(0..e as u32);
        let by = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        if top_k < e {
            idx.select_nth_unstable_by(top_k - 1, by);
        }
        idx[..top_k].sort_unstable_by(by);
        o.copy_from_slice(&idx[..top_k]);
    }
}

impl Routing {
    /// Each token's `top_k` experts from `probs` `[N, E]` (any float dtype; read on the
    /// host, or chosen by one kernel on a CUDA device for f32 / f16 / bf16 and `E <= 1024`: the
    /// same choices). Errors for `top_k` outside `1..=E`, a shape that is not 2-D, or a value
    /// that is not finite (a NaN router would route arbitrarily).
    pub fn top_k(probs: &Tensor, top_k: usize) -> Result<Routing> {
        let (n, e) = match probs.dims() {
            &[n, e] => (n, e),
            d => bail!("Routing::top_k: probabilities must be [N, E], got shape {d:?}"),
        };
        if top_k == 0 || top_k > e {
            bail!("Routing::top_k: top_k = {top_k} of E = {e} experts (probabilities {:?})", probs.dims())
        }
        #[cfg(feature = "cuda")]
        if probs.device().is_cuda() && e <= candle_cp_kernels::moe::MAX_EXPERTS && matches!(probs.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Self::top_k_cuda(probs, n, e, top_k);
        }
        let p: Vec<f32> = probs.detach().to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        if let Some(bad) = p.iter().position(|v| !v.is_finite()) {
            bail!("Routing::top_k: router probability of token {} expert {} is {} (probabilities {:?})", bad / e, bad % e, p[bad], probs.dims())
        }
        let mut experts = vec![0u32; n * top_k];
        // rows split over the host's threads (a layer at 32k tokens and 128 experts: 4M
        // probabilities per call)
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(n.div_ceil(2048)).max(1);
        if threads == 1 {
            // (a decode step's one token, a short sequence: no thread to start)
            top_k_rows(&p, e, top_k, &mut experts);
        } else {
            let rows_per = n.div_ceil(threads);
            std::thread::scope(|s| {
                for (out, rows) in experts.chunks_mut(rows_per * top_k).zip(p.chunks(rows_per * e)) {
                    s.spawn(move || top_k_rows(rows, e, top_k, out));
                }
            });
        }
        Ok(Self::from_experts(experts, n, top_k, e))
    }

    /// [`Routing::top_k`] on a CUDA device: the choices made there (`kernels/moe.cu`, the same
    /// as the host loop's), only the `[N, K]` indices copied down.
    #[cfg(feature = "cuda")]
    fn top_k_cuda(probs: &Tensor, n: usize, e: usize, top_k: usize) -> Result<Routing> {
        let experts: Vec<u32> = candle_cp_kernels::moe::top_k(&probs.detach(), top_k)?.flatten_all()?.to_vec1()?;
        // a row that was not routed holds E + (its first non-finite expert) in slot 0
        if let Some(t) = experts.chunks(top_k).position(|row| row[0] as usize >= e) {
            let x = experts[t * top_k] as usize - e;
            let v = probs.get(t)?.get(x)?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            bail!("Routing::top_k: router probability of token {t} expert {x} is {v} (probabilities {:?})", probs.dims())
        }
        Ok(Self::from_experts(experts, n, top_k, e))
    }

    /// The grouping of given choices: `experts` `[N·K]` (each `< e`).
    pub fn from_experts(experts: Vec<u32>, tokens: usize, top_k: usize, e: usize) -> Routing {
        let mut counts = vec![0usize; e];
        for &x in &experts {
            counts[x as usize] += 1;
        }
        // counting sort, stable
        let mut start: Vec<usize> = counts.iter().scan(0, |s, &c| { let o = *s; *s += c; Some(o) }).collect();
        let mut order = vec![0u32; experts.len()];
        let mut inverse = vec![0u32; experts.len()];
        for (j, &x) in experts.iter().enumerate() {
            let at = start[x as usize];
            order[at] = j as u32;
            inverse[j] = at as u32;
            start[x as usize] += 1;
        }
        Routing { experts, order, inverse, counts, tokens, top_k }
    }

    /// `[N·K]` u32: the token of each pair in expert order (the rows of [`grouped_matmul`]'s
    /// input, an `index_select` of the tokens).
    pub fn sorted_tokens(&self) -> Vec<u32> {
        self.order.iter().map(|&j| j / self.top_k as u32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// The op and its reference agree in the forward and in both gradients, with experts that
    /// get no rows among them.
    #[test]
    fn grouped_matmul_matches_slow() -> Result<()> {
        let dev = Device::Cpu;
        for counts in [vec![3usize, 0, 5, 1], vec![0, 0, 9, 0], vec![2, 2, 2, 2]] {
            let m: usize = counts.iter().sum();
            let x = Var::from_tensor(&Tensor::randn(0f32, 1., (m, 6), &dev)?)?;
            let w = Var::from_tensor(&Tensor::randn(0f32, 1., (4, 5, 6), &dev)?)?;
            let dy = Tensor::randn(0f32, 1., (m, 5), &dev)?;
            let y = grouped_matmul(x.as_tensor(), w.as_tensor(), &counts)?;
            let ys = grouped_matmul_slow(x.as_tensor(), w.as_tensor(), &counts)?;
            assert!(max_diff(&y, &ys)? < 1e-5);
            // the rows of expert e are x_rows · w[e]ᵀ
            let e = counts.iter().position(|&c| c > 0).unwrap_or(0);
            let want = x.as_tensor().narrow(0, 0, counts[e])?.matmul(&w.as_tensor().get(e)?.t()?)?;
            assert!(max_diff(&y.narrow(0, 0, counts[e])?, &want)? < 1e-5);
            let (g, gs) = ((&y * &dy)?.sum_all()?.backward()?, (&ys * &dy)?.sum_all()?.backward()?);
            for v in [&x, &w] {
                let (a, b) = (g.get(v.as_tensor()).expect("grad"), gs.get(v.as_tensor()).expect("grad"));
                assert!(max_diff(a, b)? < 1e-5, "{counts:?}");
            }
            // an expert without rows: zero gradient
            if let Some(z) = counts.iter().position(|&c| c == 0) {
                let dw = g.get(w.as_tensor()).expect("grad").get(z)?;
                assert_eq!(dw.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
            }
        }
        Ok(())
    }

    /// With biases (all columns, and a column slice as a TP rank adds it): the op and its
    /// reference agree in the forward and in the three gradients, empty experts included.
    #[test]
    fn grouped_matmul_bias_matches_slow() -> Result<()> {
        let dev = Device::Cpu;
        for (counts, col0, nb) in [(vec![3usize, 0, 5, 1], 0, 5), (vec![2, 2, 0, 2], 2, 2), (vec![0, 0, 9, 0], 1, 3)] {
            let m: usize = counts.iter().sum();
            let x = Var::from_tensor(&Tensor::randn(0f32, 1., (m, 6), &dev)?)?;
            let w = Var::from_tensor(&Tensor::randn(0f32, 1., (4, 5, 6), &dev)?)?;
            let b = Var::from_tensor(&Tensor::randn(0f32, 1., (4, nb), &dev)?)?;
            let dy = Tensor::randn(0f32, 1., (m, 5), &dev)?;
            let y = grouped_matmul_bias(x.as_tensor(), w.as_tensor(), b.as_tensor(), col0, &counts)?;
            let ys = grouped_matmul_bias_slow(x.as_tensor(), w.as_tensor(), b.as_tensor(), col0, &counts)?;
            assert!(max_diff(&y, &ys)? < 1e-5);
            let (g, gs) = ((&y * &dy)?.sum_all()?.backward()?, (&ys * &dy)?.sum_all()?.backward()?);
            for v in [&x, &w, &b] {
                let (p, q) = (g.get(v.as_tensor()).expect("grad"), gs.get(v.as_tensor()).expect("grad"));
                assert!(max_diff(p, q)? < 1e-5, "{counts:?} col0 {col0}");
            }
        }
        let (x, w) = (Tensor::zeros((4, 6), DType::F32, &dev)?, Tensor::zeros((2, 5, 6), DType::F32, &dev)?);
        let e = grouped_matmul_bias(&x, &w, &Tensor::zeros((2, 4), DType::F32, &dev)?, 2, &[2, 2]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("col0 2 + nb <= out = 5"), "{e}");
        Ok(())
    }

    #[test]
    fn grouped_matmul_refuses_bad_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let (x, w) = (Tensor::zeros((4, 6), DType::F32, &dev)?, Tensor::zeros((2, 5, 6), DType::F32, &dev)?);
        for (x, w, c, want) in [
            (x.clone(), w.clone(), vec![1usize, 2], "sum to 3"),
            (x.clone(), w.clone(), vec![4], "1 row counts"),
            (x.reshape((2, 2, 6))?, w.clone(), vec![2, 2], "[M, in]"),
            (x.clone(), w.reshape((2, 30))?, vec![2, 2], "[E, out, in]"),
            (x.narrow(1, 0, 5)?, w.clone(), vec![2, 2], "disagree on in"),
            (x.to_dtype(DType::BF16)?, w.clone(), vec![2, 2], "dtype"),
        ] {
            let e = grouped_matmul(&x, &w, &c).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(want), "{want}: {e}");
        }
        Ok(())
    }

    /// The combine and its reference agree in the forward and in both gradients; bad shapes
    /// are refused by name.
    #[test]
    fn combine_matches_slow() -> Result<()> {
        let dev = Device::Cpu;
        let probs = Tensor::rand(0f32, 1., (7, 5), &dev)?;
        let r = Routing::top_k(&probs, 3)?;
        let ys = Var::from_tensor(&Tensor::randn(0f32, 1., (21, 6), &dev)?)?;
        let w = Var::from_tensor(&Tensor::rand(0f32, 1., (7, 3), &dev)?)?;
        let dy = Tensor::randn(0f32, 1., (7, 6), &dev)?;
        let y = combine(ys.as_tensor(), w.as_tensor(), &r.inverse)?;
        let ys_ = combine_slow(ys.as_tensor(), w.as_tensor(), &r.inverse)?;
        assert!(max_diff(&y, &ys_)? < 1e-5);
        // token 4 = Σ_k w[4, k] · ys[inverse[4·3 + k]]
        let mut want = Tensor::zeros(6, DType::F32, &dev)?;
        for k in 0..3 {
            let row = ys.as_tensor().get(r.inverse[12 + k] as usize)?;
            want = (want + (row * w.as_tensor().get(4)?.get(k)?.to_scalar::<f32>()? as f64)?)?;
        }
        assert!(max_diff(&y.get(4)?, &want)? < 1e-5);
        let (g, gs) = ((&y * &dy)?.sum_all()?.backward()?, (&ys_ * &dy)?.sum_all()?.backward()?);
        for v in [&ys, &w] {
            assert!(max_diff(g.get(v.as_tensor()).expect("grad"), gs.get(v.as_tensor()).expect("grad"))? < 1e-5);
        }
        for (ysb, wb, inv, want) in [
            (ys.as_tensor().narrow(0, 0, 20)?, w.as_tensor().clone(), r.inverse.clone(), "disagree"),
            (ys.as_tensor().clone(), w.as_tensor().clone(), vec![99; 21], "out of range"),
            (ys.as_tensor().clone(), w.as_tensor().to_dtype(DType::BF16)?, r.inverse.clone(), "dtype"),
        ] {
            let e = combine(&ysb, &wb, &inv).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(want), "{want}: {e}");
        }
        Ok(())
    }

    /// Many tokens (the rows split over the host's threads) with ties among them: each token's
    /// experts are those of a full sort by falling probability, ties by index.
    #[test]
    fn routing_of_many_tokens_matches_a_full_sort() -> Result<()> {
        let (n, e, k) = (5000, 16, 3);
        // probabilities rounded to 1/8: many ties
        let p = (Tensor::rand(0f32, 1., (n, e), &Device::Cpu)? * 8.0)?.floor()?;
        let r = Routing::top_k(&p, k)?;
        let rows: Vec<Vec<f32>> = p.to_vec2()?;
        for (i, row) in rows.iter().enumerate() {
            let mut idx: Vec<u32> = (0..e as u32).collect();
            idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
            assert_eq!(&r.experts[i * k..(i + 1) * k], &idx[..k], "token {i}: {row:?}");
        }
        assert_eq!(r.counts.iter().sum::<usize>(), n * k);
        Ok(())
    }

    #[test]
    fn routing_groups_pairs_by_expert() -> Result<()> {
        let p = Tensor::new(&[[0.1f32, 0.5, 0.4], [0.3, 0.3, 0.4], [0.6, 0.1, 0.3]], &Device::Cpu)?;
        let r = Routing::top_k(&p, 2)?;
        // ties by the lower expert
        assert_eq!(r.experts, vec![1, 2, 2, 0, 0, 2]);
        assert_eq!(r.counts, vec![2, 1, 3]);
        // expert 0: pairs 3, 4; expert 1: pair 0; expert 2: pairs 1, 2, 5
        assert_eq!(r.order, vec![3, 4, 0, 1, 2, 5]);
        for (j, &at) in r.inverse.iter().enumerate() {
            assert_eq!(r.order[at as usize], j as u32);
        }
        assert_eq!(r.sorted_tokens(), vec![1, 2, 0, 0, 1, 2]);
        for (k, want) in [(0, "top_k = 0"), (4, "top_k = 4")] {
            let e = Routing::top_k(&p, k).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(want), "{e}");
        }
        let nan = Tensor::new(&[[0.1f32, f32::NAN]], &Device::Cpu)?;
        assert!(Routing::top_k(&nan, 1).err().map(|e| e.to_string()).unwrap_or_default().contains("NaN"));
        Ok(())
    }
}
