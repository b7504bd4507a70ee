//! A step's micro-batches as the trainer and the evaluation draw them: rows of the data source
//! from (seed, step, micro-batch), as ids, long-range marks and packed documents, and the
//! per-token loss sums they report.

use super::data::DataSource;
use super::TrainConfig;
use crate::IGNORE;
use candle_core::{bail, Device, Result, Tensor};
use candle_cp_ops::packing::Documents;

/// `(Σ nll, count)` over this rank's targets (labels ≠ [`IGNORE`]) and over its long-range
/// targets (`mask` = 1): `[all_sum, all_n, lr_sum, lr_n]`, from the per-token losses `nll`
/// (f32 values), `labels` and `mask` (u32 values), all of one shard `[B, Ts]` flattened.
pub(crate) fn nll_terms(nll: &[f32], labels: &[u32], mask: &[u32]) -> [f64; 4] {
    let mut out = [0.0; 4];
    for ((&v, &l), &m) in nll.iter().zip(labels).zip(mask) {
        if l != IGNORE {
            out[0] += v as f64;
            out[1] += 1.0;
            if m == 1 {
                out[2] += v as f64;
                out[3] += 1.0;
            }
        }
    }
    out
}

/// Global batch `[B, T]` of token ids and of long-range flags for one micro-batch, and the
/// rows' packed documents (`None` unless the data source packs documents).
pub(super) fn global_batch(
    cfg: &TrainConfig,
    step: usize,
    micro: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor, Option<Vec<Documents>>)> {
    batch_of(&cfg.data, cfg.seed, cfg, step, micro, dev)
}

/// [`global_batch`] of `data` drawn from `seed` (the held-out batches: [`super::eval`]).
pub(crate) fn batch_of(
    data: &DataSource,
    seed: u64,
    cfg: &TrainConfig,
    step: usize,
    micro: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor, Option<Vec<Documents>>)> {
    rows_batch(&data.rows(seed, step, micro * cfg.batch, cfg.batch, cfg.seq_len)?, cfg, (step, micro), dev)
}

/// `rows` as a micro-batch: ids and marks `[B, T]` on `dev`, their documents.
pub(super) fn rows_batch(rows: &[super::Sample], cfg: &TrainConfig, (step, micro): (usize, usize), dev: &Device) -> Result<(Tensor, Tensor, Option<Vec<Documents>>)> {
    let ids: Vec<u32> = rows.iter().flat_map(|s| s.tokens.iter().copied()).collect();
    let mask: Vec<u32> = rows
        .iter()
        .flat_map(|s| s.long_range.iter().map(|&b| b as u32))
        .collect();
    let docs: Option<Vec<Documents>> = rows.iter().map(|s| s.documents.clone()).collect();
    if docs.is_none() && rows.iter().any(|s| s.documents.is_some()) {
        bail!("train: step {step} micro-batch {micro}: some rows carry packed documents and some do not")
    }
    let shape = (cfg.batch, cfg.seq_len);
    Ok((
        Tensor::from_vec(ids, shape, dev)?,
        Tensor::from_vec(mask, shape, dev)?,
        docs,
    ))
}

