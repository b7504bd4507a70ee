//! LM head + cross-entropy without the logits: per-token `-log p(label)` computed in chunks
//! of rows, so a `[N, V]` logits tensor never exists.
//!
//! At long context the logits are the largest tensors of a step: 16k tokens per rank with a
//! 128k vocabulary are 4.2 GB in bf16, and the plain path ([`crate::Llama::loss`]) also keeps
//! an f32 copy and the f32 softmax for its backward (8.4 GB each), plus same-sized buffers in
//! the backward. [`token_nll`] keeps one `[chunk, V]` f32 buffer at a time and saves only the
//! per-row log-sum-exp (`[N]` f32):
//!
//! ```text
//! forward : for each chunk c of valid rows:  l = x_c · Wᵀ  (f32)   lse_c = logsumexp(l)
//!                                            nll_c = lse_c - l[label]
//! backward: for each chunk c:  l = x_c · Wᵀ (recomputed)   d = (exp(l - lse_c) - onehot) · dy_c
//!                              dx_c = d · W               dW += dᵀ · x_c   (f32 accumulation)
//! ```
//!
//! The price is one more head matmul in the backward. [`token_nll_slow`] is the reference from
//! plain candle ops (full logits, log-softmax, autograd).

use crate::layout::IGNORE;
use candle_core::{bail, DType, Result, Tensor, D};
use candle_cp_ops::autograd::{attach2, BackwardFn};
use std::sync::Arc;

/// Rows per chunk so that one `[rows, V]` f32 buffer is about 64 MiB (at least 16 rows;
/// a 128k vocabulary gives 130 rows, still a full-width matmul of the head).
pub fn default_chunk_rows(vocab: usize) -> usize {
    ((16usize << 20) / vocab.max(1)).max(16)
}

/// Valid rows (label ≠ [`IGNORE`]) and their labels; errors on labels outside the vocabulary.
fn valid_rows(labels: &[u32], vocab: usize, what: &str) -> Result<(Vec<u32>, Vec<u32>)> {
    let (mut idx, mut tgt) = (Vec::new(), Vec::new());
    for (i, &l) in labels.iter().enumerate() {
        if l == IGNORE {
            continue;
        }
        if l as usize >= vocab {
            bail!("{what}: label {l} out of range for vocab {vocab}")
        }
        idx.push(i as u32);
        tgt.push(l);
    }
    Ok((idx, tgt))
}

fn check(x: &Tensor, w: &Tensor, labels: &Tensor, what: &str) -> Result<(usize, usize, usize)> {
    let (n, h) = x.dims2()?;
    let (v, hw) = w.dims2()?;
    if hw != h || labels.dims() != [n] {
        bail!(
            "{what}: hidden {:?} [N, h], head {:?} [V, h] and labels {:?} [N] do not match",
            x.dims(),
            w.dims(),
            labels.dims()
        )
    }
    if x.dtype() != w.dtype() || !x.device().same_device(w.device()) {
        bail!("{what}: hidden {:?} {:?} and head {:?} {:?} must share dtype and device", x.dims(), x.dtype(), w.dims(), w.dtype())
    }
    Ok((n, h, v))
}

/// f32 logits `[c, V]` of rows `r0..r0 + c` of `xs` (the matmul in the weights' dtype),
/// soft-capped to `cap · tanh(l / cap)` when `cap` is set (Gemma 2's
/// `final_logit_softcapping`).
fn chunk_logits(xs: &Tensor, w: &Tensor, r0: usize, c: usize, cap: Option<f64>) -> Result<Tensor> {
    let l = xs.narrow(0, r0, c)?.matmul(&w.t()?)?.to_dtype(DType::F32)?;
    match cap {
        Some(cap) => cap_logits(&l, cap),
        None => Ok(l),
    }
}

/// `cap · tanh(l / cap)`: the output logits' soft cap (differentiable).
pub fn cap_logits(l: &Tensor, cap: f64) -> Result<Tensor> {
    (l / cap)?.tanh()? * cap
}

/// Errors for a cap that is not finite and > 0 (the attention's rule, `Scores::check`).
fn check_cap(cap: Option<f64>, what: &str) -> Result<()> {
    candle_cp_ops::attention::Scores::new(1.0).with_softcap(cap).check(what)
}

/// `log Σ exp` of `t` along `dim`, kept (f32, max-shifted).
fn logsumexp_keepdim(t: &Tensor, dim: usize) -> Result<Tensor> {
    let mx = t.max_keepdim(dim)?;
    t.broadcast_sub(&mx)?.exp()?.sum_keepdim(dim)?.log()?.add(&mx)
}

/// Zeros of `shape` (f32) that keep `x` and `w` in the graph with a zero gradient: the loss
/// of a call without any valid label, like `local_nll`'s empty case.
fn zeros_in_graph(x: &Tensor, w: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let zero = Tensor::zeros((), DType::F32, x.device())?;
    let z = (x.to_dtype(DType::F32)?.sum_all()? + w.to_dtype(DType::F32)?.sum_all()?)?.mul(&zero)?;
    Tensor::zeros(shape, DType::F32, x.device())?.broadcast_add(&z)
}

/// The chunked backward shared by [`token_nll`] and [`token_nll_vocab_parallel`]: per chunk of
/// the `m` valid rows `xs` `[m, h]`, recompute `l = x_c · Wᵀ`, `d = (exp(l - lse) + onehot) ·
/// dy` with `onehot` = `hot` `[m, 1]` (−1, or 0 where the target is on another rank) at
/// column `col` `[m, 1]` (with a soft cap, `d` times the cap's derivative `1 - (l/cap)²` of
/// the capped logits `l`); returns `dxs = d · W` `[m, h]` and `dW = Σ dᵀ · x_c` (f32 summed,
/// in W's dtype).
fn chunked_backward(
    xs: &Tensor,
    w: &Tensor,
    (lse, col, hot, dy): (&Tensor, &Tensor, &Tensor, &Tensor),
    chunk: usize,
    cap: Option<f64>,
) -> Result<(Tensor, Option<Tensor>)> {
    let m = xs.dim(0)?;
    let mut dxs = Vec::new();
    let mut dw: Option<Tensor> = None;
    for r0 in (0..m).step_by(chunk) {
        let c = chunk.min(m - r0);
        let l = chunk_logits(xs, w, r0, c, cap)?;
        let d = l
            .broadcast_sub(&lse.narrow(0, r0, c)?)?
            .exp()?
            .scatter_add(&col.narrow(0, r0, c)?, &hot.narrow(0, r0, c)?, 1)?
            .broadcast_mul(&dy.narrow(0, r0, c)?)?;
        let d = match cap {
            Some(cap) => (d * (1.0 - (l / cap)?.sqr()?)?)?,
            None => d,
        };
        let d = d.to_dtype(w.dtype())?; // [c, V] (or V/P)
        dxs.push(d.matmul(w)?);
        let dwc = d.t()?.matmul(&xs.narrow(0, r0, c)?)?.to_dtype(DType::F32)?;
        dw = Some(match dw {
            None => dwc,
            Some(a) => (a + dwc)?,
        });
    }
    Ok((Tensor::cat(&dxs, 0)?, dw.map(|d| d.to_dtype(w.dtype())).transpose()?))
}

/// `-log softmax(x · Wᵀ)[label]` per row, f32 `[N]`, `0` where the label is [`IGNORE`];
/// differentiable w.r.t. `x` and `w`. `x` `[N, h]` hidden states, `w` `[V, h]` the head
/// (same dtype; the matmuls run in it, the softmax in f32), `labels` `[N]` u32.
/// `chunk_rows` bounds the rows of one `[rows, V]` buffer ([`default_chunk_rows`]).
/// `softcap`: the logits soft-capped to `cap · tanh(l / cap)` before the softmax (Gemma 2's
/// `final_logit_softcapping`), `None` for none.
pub fn token_nll(x: &Tensor, w: &Tensor, labels: &Tensor, chunk_rows: usize, softcap: Option<f64>) -> Result<Tensor> {
    Ok(token_nll_stats(x, w, labels, chunk_rows, softcap, false)?.0)
}

/// [`token_nll`] and, per row, `log Σ_v p_v²` of the softmax (WPO's weight adjustment,
/// `logsumexp(2 · log p)`), f32 `[N]`, detached, 0 where the label is [`IGNORE`]: one more
/// pass over each chunk's logits, no more matmuls.
pub fn token_nll_sq(x: &Tensor, w: &Tensor, labels: &Tensor, chunk_rows: usize, softcap: Option<f64>) -> Result<(Tensor, Tensor)> {
    let (nll, sq) = token_nll_stats(x, w, labels, chunk_rows, softcap, true)?;
    Ok((nll, sq.ok_or_else(|| candle_core::Error::Msg("token_nll_sq: no statistics".into()))?))
}

/// `log Σ_v p_v² = logsumexp(2·l) − 2·lse` per row, `[c, 1]`, from a chunk's logits `l` and
/// their `lse`.
fn sq_of(l: &Tensor, lse: &Tensor) -> Result<Tensor> {
    logsumexp_keepdim(&(l * 2.0)?, 1)? - (lse * 2.0)?
}

/// [`token_nll`], with [`token_nll_sq`]'s statistic when `want_sq`.
fn token_nll_stats(x: &Tensor, w: &Tensor, labels: &Tensor, chunk_rows: usize, softcap: Option<f64>, want_sq: bool) -> Result<(Tensor, Option<Tensor>)> {
    let (n, _, v) = check(x, w, labels, "token_nll")?;
    check_cap(softcap, "token_nll")?;
    let lab: Vec<u32> = labels.to_dtype(DType::U32)?.to_vec1()?;
    let (idx, tgt) = valid_rows(&lab, v, "token_nll")?;
    let dev = x.device().clone();
    let m = idx.len();
    let zeros = || Tensor::zeros(n, DType::F32, &dev);
    if m == 0 {
        return Ok((zeros_in_graph(x, w, &[n])?, want_sq.then(zeros).transpose()?));
    }
    let chunk = chunk_rows.max(1);
    let idx_t = Tensor::new(idx.as_slice(), &dev)?;
    let xs = x.detach().index_select(&idx_t, 0)?; // [m, h]
    let wd = w.detach();
    let tgt_t = Tensor::new(tgt.as_slice(), &dev)?.reshape((m, 1))?;
    let (mut lse, mut nll, mut sq) = (Vec::new(), Vec::new(), Vec::new());
    for r0 in (0..m).step_by(chunk) {
        let c = chunk.min(m - r0);
        let l = chunk_logits(&xs, &wd, r0, c, softcap)?;
        let s = logsumexp_keepdim(&l, 1)?; // [c, 1]
        nll.push((&s - l.gather(&tgt_t.narrow(0, r0, c)?, 1)?)?);
        if want_sq {
            sq.push(sq_of(&l, &s)?);
        }
        lse.push(s);
    }
    let lse = Tensor::cat(&lse, 0)?; // [m, 1] f32
    let nll = Tensor::cat(&nll, 0)?.reshape(m)?;
    // scatter the valid rows' terms into [N] (zeros elsewhere)
    let out = zeros()?.index_add(&idx_t, &nll, 0)?;
    let sq = match want_sq {
        true => Some(zeros()?.index_add(&idx_t, &Tensor::cat(&sq, 0)?.reshape(m)?, 0)?),
        false => None,
    };
    let (xs_b, w_b, x_dims) = (xs.clone(), wd.clone(), x.dims().to_vec());
    let minus_one = Tensor::full(-1f32, (m, 1), &dev)?;
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let dy = dy.to_dtype(DType::F32)?.index_select(&idx_t, 0)?.reshape((m, 1))?;
        let (dxs, dw) = chunked_backward(&xs_b, &w_b, (&lse, &tgt_t, &minus_one, &dy), chunk, softcap)?;
        let dx = Tensor::zeros(x_dims.as_slice(), dxs.dtype(), dxs.device())?.index_add(&idx_t, &dxs, 0)?;
        Ok(vec![Some(dx), dw])
    });
    Ok((attach2("token_nll", x, w, out, bwd)?, sq))
}

/// [`token_nll`] with the head split by vocabulary rows over a TP group (Megatron's
/// vocab-parallel cross-entropy, chunked).
///
/// `x` `[B, Tc, h]`: the hidden states of the whole TP region (SP: after
/// `gather_from_sp_region`; else after `copy_to_tp_region`, so that the backward sums this
/// op's partial `dx` over the TP ranks). `w` `[k, h]`, `k = ⌈V/P⌉`: this rank's head rows
/// `[r·k, (r+1)·k)` of a `vocab`-token head ([`candle_cp_nn::Shard::RowsPadded`]; rows past
/// `vocab` are padding, left out of the softmax, and get a zero gradient). `labels` `[B, Tc]`
/// u32, the same on every TP rank. Returns f32
/// `-log p(label)` of this rank's rows: `[B, Tc/P]` (rows `[r·Tc/P, (r+1)·Tc/P)`) when
/// `own_rows_only` (SP), else `[B, Tc]`. `softcap` as in [`token_nll`].
///
/// ```text
/// forward : per chunk  l = x_c · W_rᵀ (f32, real rows only)  lse_r = logsumexp(l) (-inf: none)
///           t_r = l[label] if it is in r's slice, else 0
///           lse = logsumexp_r(lse_r) (all-gather [P, m])   nll = lse - Σ_r t_r (all-reduce [m])
/// backward: dy of all Tc rows (all-gather over TP when own_rows_only)
///           d = (exp(l - lse) - onehot_r) · dy   dx_c = d · W_r (partial)   dW_r += dᵀ · x_c
/// ```
#[allow(clippy::too_many_arguments)]
pub fn token_nll_vocab_parallel(
    x: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    vocab: usize,
    chunk_rows: usize,
    group: &candle_cp_comm::Group,
    own_rows_only: bool,
    softcap: Option<f64>,
) -> Result<Tensor> {
    Ok(token_nll_vocab_parallel_stats(x, w, labels, vocab, chunk_rows, group, (own_rows_only, softcap), false)?.0)
}

/// [`token_nll_vocab_parallel`] and [`token_nll_sq`]'s statistic of the same rows, `log Σ_v
/// p_v²` over the whole vocabulary (each rank's `logsumexp(2·l)` over its slice, merged over
/// the group by one more all-gather), detached. Collective over `group`.
#[allow(clippy::too_many_arguments)]
pub fn token_nll_vocab_parallel_sq(
    x: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    vocab: usize,
    chunk_rows: usize,
    group: &candle_cp_comm::Group,
    own_rows_only: bool,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    let (nll, sq) = token_nll_vocab_parallel_stats(x, w, labels, vocab, chunk_rows, group, (own_rows_only, softcap), true)?;
    Ok((nll, sq.ok_or_else(|| candle_core::Error::Msg("token_nll_vocab_parallel_sq: no statistics".into()))?))
}

#[allow(clippy::too_many_arguments)]
fn token_nll_vocab_parallel_stats(
    x: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    vocab: usize,
    chunk_rows: usize,
    group: &candle_cp_comm::Group,
    (own_rows_only, softcap): (bool, Option<f64>),
    want_sq: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    const WHAT: &str = "token_nll_vocab_parallel";
    check_cap(softcap, WHAT)?;
    let (b, tc, hd) = x.dims3()?;
    let (p, r) = (group.size(), group.rank());
    if labels.dims() != [b, tc] || (own_rows_only && !tc.is_multiple_of(p)) {
        bail!("{WHAT}: hidden {:?} [B, Tc, h] and labels {:?} [B, Tc] do not match (Tc divisible by the TP size {p} with own rows)", x.dims(), labels.dims())
    }
    let x2 = x.reshape((b * tc, hd))?;
    let lab2 = labels.flatten_all()?;
    let (n, _, vl) = check(&x2, w, &lab2, WHAT)?;
    if vl != candle_cp_nn::padded_rows(vocab, p) {
        bail!("{WHAT}: head slice {:?} is not ⌈{vocab}/{p}⌉ rows of the {vocab}-token vocabulary", w.dims())
    }
    let off = r * vl;
    // the real (not padding) rows of this rank's slice
    let real = vocab.saturating_sub(off).min(vl);
    let lab: Vec<u32> = lab2.to_dtype(DType::U32)?.to_vec1()?;
    let (idx, tgt) = valid_rows(&lab, vocab, WHAT)?;
    let dev = x.device().clone();
    let m = idx.len();
    let ts = if own_rows_only { tc / p } else { tc };
    let own = |t: &Tensor| -> Result<Tensor> {
        let t = t.reshape((b, tc))?;
        if own_rows_only { t.narrow(1, r * ts, ts) } else { Ok(t) }
    };
    if m == 0 {
        // the same on every rank (labels are): no collective
        return Ok((zeros_in_graph(x, w, &[b, ts])?, want_sq.then(|| Tensor::zeros((b, ts), DType::F32, &dev)).transpose()?));
    }
    let chunk = chunk_rows.max(1);
    let idx_t = Tensor::new(idx.as_slice(), &dev)?;
    let xs = x2.detach().index_select(&idx_t, 0)?; // [m, h]
    let wd = w.detach();
    let wd = if real < vl && real > 0 { wd.narrow(0, 0, real)? } else { wd };
    // target column in this rank's slice (0 when elsewhere) and whether it is here
    let mine: Vec<bool> = tgt.iter().map(|&t| (t as usize) >= off && (t as usize) < off + vl).collect();
    let col: Vec<u32> = tgt.iter().zip(&mine).map(|(&t, &h)| if h { t - off as u32 } else { 0 }).collect();
    let here: Vec<f32> = mine.iter().map(|&h| if h { 1.0 } else { 0.0 }).collect();
    let col_t = Tensor::new(col.as_slice(), &dev)?.reshape((m, 1))?;
    let here_t = Tensor::new(here.as_slice(), &dev)?.reshape((m, 1))?;
    // (with want_sq, each slice's logsumexp(2·l) beside its lse: rows [2, m])
    let (lse_r, t_r) = if real == 0 {
        // a slice of padding only: no probability mass, no target
        (Tensor::full(f32::NEG_INFINITY, (1 + want_sq as usize, m), &dev)?, Tensor::zeros(m, DType::F32, &dev)?)
    } else {
        let (mut lse_r, mut s2_r, mut t_r) = (Vec::new(), Vec::new(), Vec::new());
        for r0 in (0..m).step_by(chunk) {
            let c = chunk.min(m - r0);
            let l = chunk_logits(&xs, &wd, r0, c, softcap)?;
            lse_r.push(logsumexp_keepdim(&l, 1)?); // [c, 1]
            if want_sq {
                s2_r.push(logsumexp_keepdim(&(&l * 2.0)?, 1)?);
            }
            t_r.push((l.gather(&col_t.narrow(0, r0, c)?, 1)? * here_t.narrow(0, r0, c)?)?);
        }
        let lse_r = Tensor::cat(&lse_r, 0)?.reshape((1, m))?;
        let lse_r = match want_sq {
            true => Tensor::cat(&[lse_r, Tensor::cat(&s2_r, 0)?.reshape((1, m))?], 0)?,
            false => lse_r,
        };
        (lse_r, Tensor::cat(&t_r, 0)?.reshape(m)?)
    };
    // merge the P slices: lse = log Σ_r exp(lse_r), target logit = the one rank's
    let all = group.all_gather(&lse_r.contiguous()?, 0)?; // [P, m] ([P·2, m] with want_sq)
    let all = all.reshape((group.size(), 1 + want_sq as usize, m))?;
    let lse = logsumexp_keepdim(&all.narrow(1, 0, 1)?.squeeze(1)?, 0)?.reshape((m, 1))?;
    let target = group.all_reduce(&t_r.contiguous()?)?;
    let nll = (lse.reshape(m)? - target)?;
    let out = own(&Tensor::zeros(n, DType::F32, &dev)?.index_add(&idx_t, &nll, 0)?)?;
    let sq = match want_sq {
        true => {
            let s2 = logsumexp_keepdim(&all.narrow(1, 1, 1)?.squeeze(1)?, 0)?.reshape(m)?;
            let sq = (s2 - (lse.reshape(m)? * 2.0)?)?;
            Some(own(&Tensor::zeros(n, DType::F32, &dev)?.index_add(&idx_t, &sq, 0)?)?)
        }
        false => None,
    };
    let minus_here = here_t.neg()?;
    let (xs_b, w_b, x_dims, group) = (xs.clone(), wd.clone(), x.dims().to_vec(), group.clone());
    let w_dims = w.dims().to_vec();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        // every rank's slice of the head saw every row: the gradient of all Tc rows
        let dy = dy.to_dtype(DType::F32)?.contiguous()?;
        let dy = if own_rows_only { group.all_gather(&dy, 1)? } else { dy };
        if real == 0 {
            let dx = Tensor::zeros(x_dims.as_slice(), w_b.dtype(), w_b.device())?;
            return Ok(vec![Some(dx), Some(Tensor::zeros(w_dims.as_slice(), w_b.dtype(), w_b.device())?)]);
        }
        let dy = dy.flatten_all()?.index_select(&idx_t, 0)?.reshape((m, 1))?;
        let (dxs, dw) = chunked_backward(&xs_b, &w_b, (&lse, &col_t, &minus_here, &dy), chunk, softcap)?;
        let dx = Tensor::zeros((n, x_dims[2]), dxs.dtype(), dxs.device())?
            .index_add(&idx_t, &dxs, 0)?
            .reshape(x_dims.as_slice())?;
        // padding rows: zero gradient
        let dw = match dw {
            Some(d) if real < vl => {
                let pad = Tensor::zeros((vl - real, x_dims[2]), d.dtype(), d.device())?;
                Some(Tensor::cat(&[d, pad], 0)?)
            }
            d => d,
        };
        Ok(vec![Some(dx), dw])
    });
    Ok((attach2(WHAT, x, w, out, bwd)?, sq))
}

/// Reference for [`token_nll`] from plain candle ops: full logits `x · Wᵀ`, f32
/// log-softmax (of the capped logits with `softcap`), gather; candle's autograd for the
/// backward.
pub fn token_nll_slow(x: &Tensor, w: &Tensor, labels: &Tensor, softcap: Option<f64>) -> Result<Tensor> {
    let (n, _, v) = check(x, w, labels, "token_nll_slow")?;
    check_cap(softcap, "token_nll_slow")?;
    let lab: Vec<u32> = labels.to_dtype(DType::U32)?.to_vec1()?;
    valid_rows(&lab, v, "token_nll_slow")?;
    let dev = x.device();
    let logits = x.matmul(&w.t()?)?.to_dtype(DType::F32)?;
    let logits = match softcap {
        Some(c) => cap_logits(&logits, c)?,
        None => logits,
    };
    let mx = logits.max_keepdim(D::Minus1)?.detach();
    let sh = logits.broadcast_sub(&mx)?;
    let lsm = sh.broadcast_sub(&sh.exp()?.sum_keepdim(D::Minus1)?.log()?)?;
    let safe: Vec<u32> = lab.iter().map(|&l| if l == IGNORE { 0 } else { l }).collect();
    let keep: Vec<f32> = lab.iter().map(|&l| if l == IGNORE { 0.0 } else { 1.0 }).collect();
    let picked = lsm.gather(&Tensor::new(safe, dev)?.reshape((n, 1))?, 1)?.reshape(n)?;
    picked.neg()?.mul(&Tensor::new(keep, dev)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use candle_cp_ops::oracle::randn;

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// values and gradients (w.r.t. x and W) equal the full-logits reference, for chunks of
    /// 1, 3 and all rows, with ignored labels, f32 and bf16, with and without a soft cap
    #[test]
    fn token_nll_matches_slow() -> Result<()> {
        let (n, h, v) = (7, 6, 11);
        let labels = Tensor::new(&[3u32, IGNORE, 0, 10, IGNORE, 5, 5], &Device::Cpu)?;
        for ((dt, tol), cap) in [(DType::F32, 2e-6f32), (DType::BF16, 2e-2)].into_iter().flat_map(|d| [(d, None), (d, Some(1.5))]) {
            let x = Var::from_tensor(&randn(1, &[n, h], 1.0)?.to_dtype(dt)?)?;
            let w = Var::from_tensor(&randn(2, &[v, h], 0.7)?.to_dtype(dt)?)?;
            let dy = randn(3, &[n], 1.0)?;
            let want = token_nll_slow(x.as_tensor(), w.as_tensor(), &labels, cap)?;
            if cap.is_some() {
                // the cap changes the loss at these logits
                let plain = token_nll_slow(x.as_tensor(), w.as_tensor(), &labels, None)?;
                assert!(max_diff(&plain, &want)? > 0.1, "the cap does not bend these logits");
            }
            let gw = (&want * &dy)?.sum_all()?.backward()?;
            for chunk in [1, 3, 64] {
                let got = token_nll(x.as_tensor(), w.as_tensor(), &labels, chunk, cap)?;
                assert_eq!(got.dims(), [n]);
                let d = max_diff(&got, &want)?;
                assert!(d <= tol, "{dt:?} cap {cap:?} chunk {chunk}: values differ by {d}");
                let g = (&got * &dy)?.sum_all()?.backward()?;
                for (name, t) in [("dx", x.as_tensor()), ("dW", w.as_tensor())] {
                    let d = max_diff(g.get(t).expect("grad"), gw.get(t).expect("grad"))?;
                    assert!(d <= tol * 4.0, "{dt:?} cap {cap:?} chunk {chunk}: {name} differs by {d}");
                }
            }
            // ignored rows are exactly zero
            let got = token_nll(x.as_tensor(), w.as_tensor(), &labels, 2, cap)?.to_vec1::<f32>()?;
            assert_eq!((got[1], got[4]), (0.0, 0.0));
        }
        Ok(())
    }

    /// The vocabulary-parallel loss over 2 and 4 ranks, with own rows (SP) and without,
    /// chunks of 1 and all rows, for vocabularies of 12 (split evenly), 10 (padded: 3 rows per
    /// rank) and 5 (over 4 ranks: the last rank holds padding only): values equal the
    /// full-logits reference, and the input and head gradients (input partials summed over the
    /// ranks, head slices, zero on padding) equal its gradients.
    #[test]
    fn vocab_parallel_matches_slow() -> Result<()> {
        for v in [12usize, 10, 5] {
            vocab_parallel_matches_slow_of(v, None)?;
        }
        vocab_parallel_matches_slow_of(10, Some(1.5))
    }

    fn vocab_parallel_matches_slow_of(v: usize, cap: Option<f64>) -> Result<()> {
        let (b, tc, h) = (2usize, 4usize, 5usize);
        let lab = [[3u32, IGNORE, 0, 11], [7, 7, IGNORE, 5]].map(|r| r.map(|l| if l == IGNORE { l } else { l % v as u32 }));
        let labels = Tensor::new(&lab, &Device::Cpu)?;
        let x = Var::from_tensor(&randn(1, &[b, tc, h], 1.0)?)?;
        let w = Var::from_tensor(&randn(2, &[v, h], 0.7)?)?;
        let dy = randn(3, &[b, tc], 1.0)?;
        let want = token_nll_slow(&x.as_tensor().reshape((b * tc, h))?, w.as_tensor(), &labels.flatten_all()?, cap)?.reshape((b, tc))?;
        let gw = (&want * &dy)?.sum_all()?.backward()?;
        let (gx_want, gw_want) = (gw.get(x.as_tensor()).cloned().expect("dx"), gw.get(w.as_tensor()).cloned().expect("dW"));
        let shard = candle_cp_nn::Shard::RowsPadded(v);
        for p in [2usize, 4] {
            for own in [false, true] {
                for chunk in [1usize, 64] {
                    let res = candle_cp_comm::run_ranks(p, |g| {
                        let r = g.rank();
                        let wl = Var::from_tensor(&shard.slice(w.as_tensor(), p, r)?)?;
                        let xr = Var::from_tensor(x.as_tensor())?;
                        let got = token_nll_vocab_parallel(xr.as_tensor(), wl.as_tensor(), &labels, v, chunk, &g, own, cap)?;
                        let ts = if own { tc / p } else { tc };
                        let (want_l, dy_l) = if own {
                            (want.narrow(1, r * ts, ts)?, dy.narrow(1, r * ts, ts)?)
                        } else {
                            (want.clone(), dy.clone())
                        };
                        let e = max_diff(&got, &want_l)?;
                        let gr = (&got * &dy_l)?.sum_all()?.backward()?;
                        // each rank's input gradient is the part through its vocabulary
                        // slice: they add up to the whole (the model's gather / copy to the TP
                        // region sums them in backward); its head slice's gradient is complete
                        let gx = g.all_reduce(gr.get(xr.as_tensor()).expect("dx"))?;
                        let ex = max_diff(&gx, &gx_want)?;
                        let gwl = gr.get(wl.as_tensor()).expect("dW").clone();
                        let ew = max_diff(&gwl, &shard.slice(&gw_want, p, r)?)?;
                        Ok((e, ex, ew))
                    });
                    for res in res {
                        let (e, ex, ew) = res?;
                        assert!(e < 2e-6 && ex < 1e-5 && ew < 1e-5, "V {v} P {p} own {own} chunk {chunk} cap {cap:?}: values {e} dx {ex} dW {ew}");
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn no_valid_label_and_bad_input() -> Result<()> {
        let x = Var::from_tensor(&randn(1, &[3, 4], 1.0)?)?;
        let w = Var::from_tensor(&randn(2, &[5, 4], 1.0)?)?;
        let none = Tensor::new(&[IGNORE; 3], &Device::Cpu)?;
        let z = token_nll(x.as_tensor(), w.as_tensor(), &none, 4, None)?;
        assert_eq!(z.to_vec1::<f32>()?, vec![0.0; 3]);
        let g = z.sum_all()?.backward()?;
        assert_eq!(max_diff(g.get(x.as_tensor()).expect("still in the graph"), &Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?)?, 0.0);
        let out_of_vocab = Tensor::new(&[1u32, 5, 0], &Device::Cpu)?;
        let e = token_nll(x.as_tensor(), w.as_tensor(), &out_of_vocab, 4, None).unwrap_err().to_string();
        assert!(e.contains("label 5 out of range for vocab 5"), "{e}");
        let short = Tensor::new(&[1u32, 2], &Device::Cpu)?;
        let e = token_nll(x.as_tensor(), w.as_tensor(), &short, 4, None).unwrap_err().to_string();
        assert!(e.contains("[3, 4]") && e.contains("[2]"), "{e}");
        for bad in [0.0, -1.0, f64::NAN] {
            let e = token_nll(x.as_tensor(), w.as_tensor(), &out_of_vocab.narrow(0, 0, 1)?.repeat(3)?, 4, Some(bad)).unwrap_err().to_string();
            assert!(e.contains("soft cap"), "{e}");
        }
        Ok(())
    }

    /// WPO's statistic `log Σ_v p_v²` per row equals `logsumexp(2 · log_softmax(l))` of the full
    /// logits (capped or not, 0 on ignored rows), from [`token_nll_sq`] in chunks of 1 and all
    /// rows and from [`token_nll_vocab_parallel_sq`] over 2 and 4 ranks (vocabularies of 12 and
    /// 5: a rank of padding only), own rows or not; the losses beside it are [`token_nll`]'s.
    #[test]
    fn squared_probability_statistic_matches_the_logits() -> Result<()> {
        let (b, tc, h) = (2usize, 4usize, 5usize);
        for (v, cap) in [(12usize, None), (5, None), (10, Some(1.5))] {
            let lab = [[3u32, IGNORE, 0, 11], [7, 7, IGNORE, 5]].map(|r| r.map(|l| if l == IGNORE { l } else { l % v as u32 }));
            let labels = Tensor::new(&lab, &Device::Cpu)?.flatten_all()?;
            let x = randn(1, &[b * tc, h], 1.0)?;
            let w = randn(2, &[v, h], 2.0)?;
            let logits = x.matmul(&w.t()?)?;
            let logits = match cap {
                Some(c) => cap_logits(&logits, c)?,
                None => logits,
            };
            let lsm = candle_nn::ops::log_softmax(&logits, 1)?;
            let keep: Vec<f32> = lab.iter().flatten().map(|&l| (l != IGNORE) as u8 as f32).collect();
            let want = (logsumexp_keepdim(&(lsm * 2.0)?, 1)?.reshape(b * tc)? * Tensor::new(keep, &Device::Cpu)?)?;
            for chunk in [1, 64] {
                let (nll, sq) = token_nll_sq(&x, &w, &labels, chunk, cap)?;
                assert!(max_diff(&sq, &want)? < 2e-6 && max_diff(&nll, &token_nll(&x, &w, &labels, chunk, cap)?)? == 0.0, "V {v} chunk {chunk}");
            }
            assert!(want.to_vec1::<f32>()?.iter().any(|&q| q < -0.5), "a spread distribution somewhere");
            for p in [2usize, 4] {
                for own in [false, true] {
                    let res = candle_cp_comm::run_ranks(p, |g| {
                        let wl = candle_cp_nn::Shard::RowsPadded(v).slice(&w, p, g.rank())?;
                        let x3 = x.reshape((b, tc, h))?;
                        let labels2 = labels.reshape((b, tc))?;
                        let (nll, sq) = token_nll_vocab_parallel_sq(&x3, &wl, &labels2, v, 3, &g, own, cap)?;
                        let plain = token_nll_vocab_parallel(&x3, &wl, &labels2, v, 3, &g, own, cap)?;
                        let ts = if own { tc / p } else { tc };
                        let want = want.reshape((b, tc))?.narrow(1, if own { g.rank() * ts } else { 0 }, ts)?;
                        Ok((max_diff(&sq, &want)?, max_diff(&nll, &plain)?))
                    });
                    for r in res {
                        let (e, n) = r?;
                        assert!(e < 2e-6 && n == 0.0, "V {v} P {p} own {own}: statistic {e}, losses {n}");
                    }
                }
            }
        }
        Ok(())
    }
}
