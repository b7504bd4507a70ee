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

/// f32 logits `[c, V]` of rows `r0..r0 + c` of `xs` (the matmul in the weights' dtype).
fn chunk_logits(xs: &Tensor, w: &Tensor, r0: usize, c: usize) -> Result<Tensor> {
    xs.narrow(0, r0, c)?.matmul(&w.t()?)?.to_dtype(DType::F32)
}

/// `-log softmax(x · Wᵀ)[label]` per row, f32 `[N]`, `0` where the label is [`IGNORE`];
/// differentiable w.r.t. `x` and `w`. `x` `[N, h]` hidden states, `w` `[V, h]` the head
/// (same dtype; the matmuls run in it, the softmax in f32), `labels` `[N]` u32.
/// `chunk_rows` bounds the rows of one `[rows, V]` buffer ([`default_chunk_rows`]).
pub fn token_nll(x: &Tensor, w: &Tensor, labels: &Tensor, chunk_rows: usize) -> Result<Tensor> {
    let (n, _, v) = check(x, w, labels, "token_nll")?;
    let lab: Vec<u32> = labels.to_dtype(DType::U32)?.to_vec1()?;
    let (idx, tgt) = valid_rows(&lab, v, "token_nll")?;
    let dev = x.device().clone();
    let m = idx.len();
    if m == 0 {
        // keep x (and the head) in the graph with a zero gradient, like local_nll's empty case
        let zero = Tensor::zeros((), DType::F32, &dev)?;
        let z = (x.to_dtype(DType::F32)?.sum_all()? + w.to_dtype(DType::F32)?.sum_all()?)?.mul(&zero)?;
        return Tensor::zeros(n, DType::F32, &dev)?.broadcast_add(&z);
    }
    let chunk = chunk_rows.max(1);
    let idx_t = Tensor::new(idx.as_slice(), &dev)?;
    let xs = x.detach().index_select(&idx_t, 0)?; // [m, h]
    let wd = w.detach();
    let tgt_t = Tensor::new(tgt.as_slice(), &dev)?.reshape((m, 1))?;
    let (mut lse, mut nll) = (Vec::new(), Vec::new());
    for r0 in (0..m).step_by(chunk) {
        let c = chunk.min(m - r0);
        let l = chunk_logits(&xs, &wd, r0, c)?;
        let mx = l.max_keepdim(D::Minus1)?;
        let s = l.broadcast_sub(&mx)?.exp()?.sum_keepdim(D::Minus1)?.log()?.add(&mx)?; // [c, 1]
        nll.push((&s - l.gather(&tgt_t.narrow(0, r0, c)?, 1)?)?);
        lse.push(s);
    }
    let lse = Tensor::cat(&lse, 0)?; // [m, 1] f32
    let nll = Tensor::cat(&nll, 0)?.reshape(m)?;
    // scatter the valid rows' terms into [N] (zeros elsewhere)
    let out = Tensor::zeros(n, DType::F32, &dev)?.index_add(&idx_t, &nll, 0)?;
    let (xs_b, w_b, x_dims) = (xs.clone(), wd.clone(), x.dims().to_vec());
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let dy = dy.to_dtype(DType::F32)?.index_select(&idx_t, 0)?.reshape((m, 1))?;
        let minus_one = Tensor::full(-1f32, (chunk.min(m), 1), xs_b.device())?;
        let mut dxs = Vec::new();
        let mut dw: Option<Tensor> = None;
        for r0 in (0..m).step_by(chunk) {
            let c = chunk.min(m - r0);
            let xc = xs_b.narrow(0, r0, c)?;
            let l = chunk_logits(&xs_b, &w_b, r0, c)?;
            let p = l.broadcast_sub(&lse.narrow(0, r0, c)?)?.exp()?;
            let d = p
                .scatter_add(&tgt_t.narrow(0, r0, c)?, &minus_one.narrow(0, 0, c)?, 1)?
                .broadcast_mul(&dy.narrow(0, r0, c)?)?
                .to_dtype(w_b.dtype())?; // [c, V]
            dxs.push(d.matmul(&w_b)?);
            let dwc = d.t()?.matmul(&xc)?.to_dtype(DType::F32)?;
            dw = Some(match dw {
                None => dwc,
                Some(a) => (a + dwc)?,
            });
        }
        let dxs = Tensor::cat(&dxs, 0)?;
        let dx = Tensor::zeros(x_dims.as_slice(), dxs.dtype(), dxs.device())?.index_add(&idx_t, &dxs, 0)?;
        let dw = match dw {
            Some(d) => Some(d.to_dtype(w_b.dtype())?),
            None => None,
        };
        Ok(vec![Some(dx), dw])
    });
    attach2("token_nll", x, w, out, bwd)
}

/// Reference for [`token_nll`] from plain candle ops: full logits `x · Wᵀ`, f32
/// log-softmax, gather; candle's autograd for the backward.
pub fn token_nll_slow(x: &Tensor, w: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let (n, _, v) = check(x, w, labels, "token_nll_slow")?;
    let lab: Vec<u32> = labels.to_dtype(DType::U32)?.to_vec1()?;
    valid_rows(&lab, v, "token_nll_slow")?;
    let dev = x.device();
    let logits = x.matmul(&w.t()?)?.to_dtype(DType::F32)?;
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
    /// 1, 3 and all rows, with ignored labels, f32 and bf16
    #[test]
    fn token_nll_matches_slow() -> Result<()> {
        let (n, h, v) = (7, 6, 11);
        let labels = Tensor::new(&[3u32, IGNORE, 0, 10, IGNORE, 5, 5], &Device::Cpu)?;
        for (dt, tol) in [(DType::F32, 2e-6f32), (DType::BF16, 2e-2)] {
            let x = Var::from_tensor(&randn(1, &[n, h], 1.0)?.to_dtype(dt)?)?;
            let w = Var::from_tensor(&randn(2, &[v, h], 0.7)?.to_dtype(dt)?)?;
            let dy = randn(3, &[n], 1.0)?;
            let want = token_nll_slow(x.as_tensor(), w.as_tensor(), &labels)?;
            let gw = (&want * &dy)?.sum_all()?.backward()?;
            for chunk in [1, 3, 64] {
                let got = token_nll(x.as_tensor(), w.as_tensor(), &labels, chunk)?;
                assert_eq!(got.dims(), [n]);
                let d = max_diff(&got, &want)?;
                assert!(d <= tol, "{dt:?} chunk {chunk}: values differ by {d}");
                let g = (&got * &dy)?.sum_all()?.backward()?;
                for (name, t) in [("dx", x.as_tensor()), ("dW", w.as_tensor())] {
                    let d = max_diff(g.get(t).expect("grad"), gw.get(t).expect("grad"))?;
                    assert!(d <= tol * 4.0, "{dt:?} chunk {chunk}: {name} differs by {d}");
                }
            }
            // ignored rows are exactly zero
            let got = token_nll(x.as_tensor(), w.as_tensor(), &labels, 2)?.to_vec1::<f32>()?;
            assert_eq!((got[1], got[4]), (0.0, 0.0));
        }
        Ok(())
    }

    #[test]
    fn no_valid_label_and_bad_input() -> Result<()> {
        let x = Var::from_tensor(&randn(1, &[3, 4], 1.0)?)?;
        let w = Var::from_tensor(&randn(2, &[5, 4], 1.0)?)?;
        let none = Tensor::new(&[IGNORE; 3], &Device::Cpu)?;
        let z = token_nll(x.as_tensor(), w.as_tensor(), &none, 4)?;
        assert_eq!(z.to_vec1::<f32>()?, vec![0.0; 3]);
        let g = z.sum_all()?.backward()?;
        assert_eq!(max_diff(g.get(x.as_tensor()).expect("still in the graph"), &Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?)?, 0.0);
        let out_of_vocab = Tensor::new(&[1u32, 5, 0], &Device::Cpu)?;
        let e = token_nll(x.as_tensor(), w.as_tensor(), &out_of_vocab, 4).unwrap_err().to_string();
        assert!(e.contains("label 5 out of range for vocab 5"), "{e}");
        let short = Tensor::new(&[1u32, 2], &Device::Cpu)?;
        let e = token_nll(x.as_tensor(), w.as_tensor(), &short, 4).unwrap_err().to_string();
        assert!(e.contains("[3, 4]") && e.contains("[2]"), "{e}");
        Ok(())
    }
}
