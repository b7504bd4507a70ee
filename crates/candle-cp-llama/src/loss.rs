//! The next-token loss from logits, reduced over ranks: per-target terms ([`local_nll`], a
//! fused cross-entropy) and their global mean ([`global_mean`]). The trainer's memory-lean path
//! without logits is [`crate::head_loss`].

use crate::layout::IGNORE;
use candle_cp_ops::autograd::{attach1, BackwardFn};
use candle_core::{bail, DType, Result, Tensor};
use std::sync::Arc;

/// Per-target `-log p(label)` (f32 `[n]`, differentiable) over the positions whose label is
/// not [`IGNORE`], and `n`. `logits` `[B, T, V]`, `labels` `[B, T]` u32. With no target the
/// terms are one `0·Σlogits` (so every rank's graph still reaches the logits) and `n = 0`.
pub fn local_nll(logits: &Tensor, labels: &Tensor) -> Result<(Tensor, usize)> {
    let (b, t, v) = logits.dims3()?;
    if labels.dims() != [b, t] {
        bail!(
            "local_nll: labels {:?} must be [{b}, {t}] for logits {:?}",
            labels.dims(),
            logits.dims()
        )
    }
    let lab: Vec<u32> = labels.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    let mut idx = Vec::new();
    let mut tgt = Vec::new();
    for (i, &l) in lab.iter().enumerate() {
        if l != IGNORE {
            if l as usize >= v {
                bail!(
                    "local_nll: label {l} out of range for vocab {v} (logits {:?})",
                    logits.dims()
                )
            }
            idx.push(i as u32);
            tgt.push(l);
        }
    }
    let dev = logits.device();
    if idx.is_empty() {
        // `x * 0.0` is an affine op that candle's backward prunes (mul == 0): multiply by a zero
        // tensor instead so the graph (and the collectives in its backward) is still walked.
        let zero = Tensor::zeros((), DType::F32, logits.device())?;
        return Ok((
            logits
                .to_dtype(DType::F32)?
                .sum_all()?
                .mul(&zero)?
                .reshape(1)?,
            0,
        ));
    }
    let n = idx.len();
    let rows = logits
        .reshape((b * t, v))?
        .index_select(&Tensor::new(idx, dev)?, 0)?
        .to_dtype(DType::F32)?;
    let tgt = Tensor::new(tgt, dev)?.reshape((n, 1))?;
    // fused cross-entropy: terms = lse - picked; backward (softmax - onehot) · dterm
    let r = rows.detach();
    let shifted = r.broadcast_sub(&r.max_keepdim(1)?)?;
    let e = shifted.exp()?;
    let sum = e.sum_keepdim(1)?;
    let terms = (sum.log()? - shifted.gather(&tgt, 1)?)?.reshape(n)?;
    let probs = e.broadcast_div(&sum)?;
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        // softmax - onehot in one [n, V] buffer (no separate one-hot: at a 128k vocabulary
        // each such buffer is 0.5 MB per token)
        let minus_one = Tensor::full(-1f32, (n, 1), probs.device())?;
        let d = probs.scatter_add(&tgt, &minus_one, 1)?;
        Ok(vec![Some(
            d.broadcast_mul(&dy.to_dtype(DType::F32)?.reshape((n, 1))?)?,
        )])
    });
    Ok((attach1("cross_entropy", &rows, terms, bwd)?, n))
}

/// Global mean `Σ_group terms / max(Σ_group n, 1)` as an f32 scalar, the same value on every
/// rank of `group`, differentiable w.r.t. this rank's `terms` with gradient `1 / Σ n` each
/// (identity backward of the reduction: every rank backpropagates the same global scalar
/// through its own terms; [`crate::reduce_gradients`] then sums the parameter gradients).
///
/// The value is summed in f64 on the host (an f32 sum of thousands of terms would be off by
/// ~1e-5); the graph part only carries the gradient.
pub fn global_mean(terms: &Tensor, n: usize, group: &candle_cp_comm::Group) -> Result<Tensor> {
    let local: f64 = terms.to_dtype(DType::F64)?.to_vec1::<f64>()?.iter().sum();
    let hi = local as f32;
    let lo = (local - hi as f64) as f32;
    let row = Tensor::new(&[[hi, lo, n as f32]], &candle_core::Device::Cpu)?;
    let rows = if group.size() > 1 {
        // (a host tensor: an NCCL group checks its health after the copy back)
        group.all_gather(&row, 0)?
    } else {
        row
    };
    let (mut total, mut count) = (0f64, 0f64);
    for r in rows.to_vec2::<f32>()? {
        total += r[0] as f64 + r[1] as f64;
        count += r[2] as f64;
    }
    let count = count.max(1.0);
    let graph = (terms.sum_all()? / count)?;
    let gv = graph.to_scalar::<f32>()? as f64;
    graph + (total / count - gv)
}
