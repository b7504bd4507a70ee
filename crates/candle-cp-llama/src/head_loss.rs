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
    Ok(token_nll_stats(x, w, labels, chunk_rows, softcap, None)?.0)
}

/// A per-row statistic of the softmax computed beside the losses from the same chunks of
/// logits (one more pass over each, no more matmuls), f32, detached, 0 where the label is
/// [`IGNORE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadStat {
    /// `log Σ_v p_v²` (WPO's weight adjustment).
    SumSq,
    /// The entropy `−Σ_v p_v·log p_v` (GRPO's high-entropy tokens).
    Entropy,
}

/// [`token_nll`] and `stat` of the same rows, f32 `[N]` ([`HeadStat`]).
pub fn token_nll_stat(x: &Tensor, w: &Tensor, labels: &Tensor, chunk_rows: usize, softcap: Option<f64>, stat: HeadStat) -> Result<(Tensor, Tensor)> {
    let (nll, st) = token_nll_stats(x, w, labels, chunk_rows, softcap, Some(stat))?;
    Ok((nll, st.ok_or_else(|| candle_core::Error::Msg("token_nll_stat: no statistics".into()))?))
}

/// `log Σ_v p_v² = logsumexp(2·l) − 2·lse` per row, `[c, 1]`, from a chunk's logits `l` and
/// their `lse`.
fn sq_of(l: &Tensor, lse: &Tensor) -> Result<Tensor> {
    logsumexp_keepdim(&(l * 2.0)?, 1)? - (lse * 2.0)?
}

/// The entropy `lse − Σ_v softmax(l)_v·l_v` per row, `[c, 1]`, from a chunk's logits `l` and
/// their `lse`.
fn entropy_of(l: &Tensor, lse: &Tensor) -> Result<Tensor> {
    lse - (l.broadcast_sub(lse)?.exp()? * l)?.sum_keepdim(1)?
}

/// `stat` of a chunk's logits `l` with their `lse`.
fn stat_of(stat: HeadStat, l: &Tensor, lse: &Tensor) -> Result<Tensor> {
    match stat {
        HeadStat::SumSq => sq_of(l, lse),
        HeadStat::Entropy => entropy_of(l, lse),
    }
}

/// [`token_nll`], with `stat` when asked.
fn token_nll_stats(x: &Tensor, w: &Tensor, labels: &Tensor, chunk_rows: usize, softcap: Option<f64>, stat: Option<HeadStat>) -> Result<(Tensor, Option<Tensor>)> {
    let want_sq = stat.is_some();
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
        if let Some(st) = stat {
            sq.push(stat_of(st, &l, &s)?);
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
    Ok(token_nll_vocab_parallel_stats(x, w, labels, vocab, chunk_rows, group, (own_rows_only, softcap), None)?.0)
}

/// [`token_nll_vocab_parallel`] and `stat` of the same rows over the whole vocabulary, merged
/// over the group by one more all-gather of a row per slice (`log Σ p²`: each slice's
/// `logsumexp(2·l)`; the entropy: each slice's `Σ softmax_r(l)·l`, weighted by `e^(lse_r −
/// lse)`), detached. Collective over `group`.
#[allow(clippy::too_many_arguments)]
pub fn token_nll_vocab_parallel_stat(
    x: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    vocab: usize,
    chunk_rows: usize,
    group: &candle_cp_comm::Group,
    (own_rows_only, softcap): (bool, Option<f64>),
    stat: HeadStat,
) -> Result<(Tensor, Tensor)> {
    let (nll, st) = token_nll_vocab_parallel_stats(x, w, labels, vocab, chunk_rows, group, (own_rows_only, softcap), Some(stat))?;
    Ok((nll, st.ok_or_else(|| candle_core::Error::Msg("token_nll_vocab_parallel_stat: no statistics".into()))?))
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
    stat: Option<HeadStat>,
) -> Result<(Tensor, Option<Tensor>)> {
    const WHAT: &str = "token_nll_vocab_parallel";
    let want_sq = stat.is_some();
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
    // (with a statistic, each slice's part beside its lse: rows [2, m] — logsumexp(2·l), or
    // Σ softmax_r(l)·l)
    let (lse_r, t_r) = if real == 0 {
        // a slice of padding only: no probability mass, no target
        let none = Tensor::full(f32::NEG_INFINITY, (1, m), &dev)?;
        let lse_r = match stat {
            Some(HeadStat::SumSq) => Tensor::cat(&[&none, &none], 0)?,
            Some(HeadStat::Entropy) => Tensor::cat(&[&none, &Tensor::zeros((1, m), DType::F32, &dev)?], 0)?,
            None => none,
        };
        (lse_r, Tensor::zeros(m, DType::F32, &dev)?)
    } else {
        let (mut lse_r, mut s2_r, mut t_r) = (Vec::new(), Vec::new(), Vec::new());
        for r0 in (0..m).step_by(chunk) {
            let c = chunk.min(m - r0);
            let l = chunk_logits(&xs, &wd, r0, c, softcap)?;
            let s = logsumexp_keepdim(&l, 1)?; // [c, 1]
            match stat {
                Some(HeadStat::SumSq) => s2_r.push(logsumexp_keepdim(&(&l * 2.0)?, 1)?),
                Some(HeadStat::Entropy) => s2_r.push((l.broadcast_sub(&s)?.exp()? * &l)?.sum_keepdim(1)?),
                None => {}
            }
            lse_r.push(s);
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
    let merged = match stat {
        Some(HeadStat::SumSq) => {
            let s2 = logsumexp_keepdim(&all.narrow(1, 1, 1)?.squeeze(1)?, 0)?.reshape(m)?;
            Some((s2 - (lse.reshape(m)? * 2.0)?)?)
        }
        Some(HeadStat::Entropy) => {
            // Σ_v p_v·l_v = Σ_r e^(lse_r − lse) · Σ_{v ∈ r} softmax_r(l)_v·l_v
            let weight = all.narrow(1, 0, 1)?.squeeze(1)?.broadcast_sub(&lse.reshape((1, m))?)?.exp()?;
            let mean = (weight * all.narrow(1, 1, 1)?.squeeze(1)?)?.sum(0)?;
            Some((lse.reshape(m)? - mean)?)
        }
        None => None,
    };
    let sq = merged.map(|q| own(&Tensor::zeros(n, DType::F32, &dev)?.index_add(&idx_t, &q, 0)?)).transpose()?;
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
#[path = "head_loss_tests.rs"]
mod tests;
