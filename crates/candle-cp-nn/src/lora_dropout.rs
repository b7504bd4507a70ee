//! Dropout on a LoRA adapter's input (PEFT's `lora_dropout`): the update is
//! `s·(drop(x)·Aᵀ)·Bᵀ`, the base path sees `x` whole.
//!
//! A mask element is a function of the seed, the step, the adapter's name, the token's index in
//! the global batch and the feature's index in the layer's whole input
//! ([`crate::RngStreams::uniform_rows`]), so every layout drops exactly what one device drops:
//! a column-parallel layer's input under SP is a sequence shard (its rows), without SP the
//! whole CP shard on every TP rank (the same mask on each); a row-parallel layer's input is the
//! CP shard's rows with this rank's slice of the features.
//!
//! Memory: the masks are not kept for the backward, nor the dropped inputs: the adapter's
//! product is one node over the layer's own input ([`masked_matmul`]; under SP a DoRA column
//! layer's regathered input, `regather`), which draws the mask again in the backward, so
//! dropout adds no `[T, in]` tensor to the graph.
//!
//! The model sets the token indices of its CP shard before each training forward
//! ([`DropoutRows::set`]) and clears them for evaluation and generation (no dropout); a
//! recomputed layer draws the same masks again.

use crate::{RngStreams, Tp};
use candle_core::{bail, Result, Tensor, D};
use candle_cp_ops::autograd::{apply_mask, attach2, BackwardFn, MaskFn};
use std::sync::{Arc, Mutex};

/// The token indices the adapters' masks are drawn for in the current forward: this rank's CP
/// shard, `[B, Tc]` (row-major), each the token's index `b·T + t` in the global batch.
#[derive(Debug, Clone)]
pub struct DropoutKey {
    /// The run's streams.
    pub streams: RngStreams,
    /// Which forward: e.g. the optimizer step and micro-batch, numbered consecutively.
    pub step: u64,
    /// Global token indices of the CP shard, `batch · tc` of them.
    pub rows: Arc<Vec<u64>>,
    /// Rows `B` of the local batch.
    pub batch: usize,
    /// Tokens `Tc` of the CP shard (the TP region's sequence length).
    pub tc: usize,
}

/// The current [`DropoutKey`], shared by a model's adapters (`None`: no dropout).
#[derive(Debug, Clone, Default)]
pub struct DropoutRows(Arc<Mutex<Option<Arc<DropoutKey>>>>);

impl DropoutRows {
    /// Draw the next forwards' masks for `key` (`None`: dropout off).
    pub fn set(&self, key: Option<DropoutKey>) -> Result<()> {
        if let Some(k) = &key {
            if k.rows.len() != k.batch * k.tc {
                bail!("LoRA dropout: {} token indices for a [{}, {}] shard", k.rows.len(), k.batch, k.tc)
            }
        }
        *self.0.lock().map_err(|e| candle_core::Error::Msg(format!("LoRA dropout: {e}")))? = key.map(Arc::new);
        Ok(())
    }

    fn get(&self) -> Option<Arc<DropoutKey>> {
        self.0.lock().ok().and_then(|k| k.clone())
    }

    /// The current key (`None`: no dropout), for adapters outside this crate that draw their
    /// masks themselves (a mixture of experts' adapters, whose rows are (token, expert) pairs).
    pub fn key(&self) -> Option<Arc<DropoutKey>> {
        self.get()
    }
}

/// Which layer's input a mask is for.
#[derive(Clone, Copy)]
pub(crate) enum Input {
    /// A column-parallel layer's (the sequence shard under SP, else the CP shard; all features).
    Column,
    /// A row-parallel layer's (the CP shard; this rank's slice of the features).
    Row,
}

/// One adapter's dropout: probability, stream name, the model's shared token indices.
#[derive(Clone, Debug)]
pub(crate) struct AdapterDropout {
    pub(crate) p: f64,
    pub(crate) name: String,
    pub(crate) rows: DropoutRows,
}

impl AdapterDropout {
    /// Whether masks are drawn now (a key is set: a training forward).
    pub(crate) fn active(&self) -> bool {
        self.rows.get().is_some()
    }

    /// The scaled keep mask of `x` `[B, T, f]` (0 where dropped, `1/(1-p)` where kept) as a
    /// function that draws it again on each call from the current key (captured now): `None`
    /// when no key is set (no dropout). Errors name shapes that do not fit the key.
    pub(crate) fn mask(&self, x: &Tensor, input: Input, tp: &Tp) -> Result<Option<MaskFn>> {
        self.mask_of(x.dims3()?, x.dtype(), x.device(), input, tp)
    }

    /// [`Self::mask`] of an input `[B, T, f]` = `dims` of `dtype` on `dev`.
    pub(crate) fn mask_of(&self, dims: (usize, usize, usize), dtype: candle_core::DType, dev: &candle_core::Device, input: Input, tp: &Tp) -> Result<Option<MaskFn>> {
        let Some(k) = self.rows.get() else { return Ok(None) };
        let (b, t, f) = dims;
        let (rank, p) = (tp.group.rank(), tp.size());
        let sp = p > 1 && tp.sequence_parallel;
        let t0 = match input {
            Input::Column if sp => rank * t,
            _ => 0,
        };
        let want_t = if matches!(input, Input::Column) && sp { k.tc / p } else { k.tc };
        if b != k.batch || t != want_t {
            bail!("LoRA dropout ({}): input {dims:?} does not fit the token indices of a [{}, {}] shard (TP {p}, SP {sp})", self.name, k.batch, k.tc)
        }
        let rows: Vec<u64> = (0..b).flat_map(|bb| k.rows[bb * k.tc + t0..bb * k.tc + t0 + t].iter().copied()).collect();
        let (col0, total) = match input {
            Input::Column => (0, f),
            Input::Row => (rank * f, f * p),
        };
        let (name, p, dev) = (self.name.clone(), self.p, dev.clone());
        Ok(Some(Arc::new(move || k.streams.keep_mask_rows(&name, k.step, &rows, col0..col0 + f, total, p, dtype, &dev)?.reshape((b, t, f)))))
    }
}

/// `(x ⊙ mask())·wᵀ` for `x` `[.., in]`, `w` `[out, in]` (e.g. an adapter's `A` on its dropped
/// input) as one node that keeps `x` and `w`, not the mask or the dropped input (each `[.., in]`,
/// what `x.mul(mask)` then a matmul would keep): the backward draws the mask again,
/// `dx = mask ⊙ (g·w)`, `dw = gᵀ·(x ⊙ mask)`. Without a mask, `x·wᵀ`.
pub fn masked_matmul(x: &Tensor, w: &Tensor, mask: Option<&MaskFn>) -> Result<Tensor> {
    let Some(mask) = mask else { return crate::linear::affine(x, w, None) };
    let (xd, wd) = (x.detach(), w.detach());
    let (o, i) = wd.dims2()?;
    if xd.dim(D::Minus1)? != i {
        bail!("masked_matmul: input {:?} does not match weight {:?} ([out, in])", x.dims(), w.dims())
    }
    let y = crate::linear::affine(&apply_mask("masked_matmul", &xd, mask)?.0, &wd, None)?;
    let mask = mask.clone();
    let bwd: BackwardFn = Arc::new(move |g: &Tensor| {
        let (xm, m) = apply_mask("masked_matmul", &xd, &mask)?;
        let lead = xd.elem_count() / i.max(1);
        let (dx, dw) = crate::linear::affine_grads(&g.reshape((lead, o))?, &xm.reshape((lead, i))?, &wd)?;
        Ok(vec![Some((dx.reshape(xd.dims())? * m)?), Some(dw)])
    });
    attach2("masked_matmul", x, w, y, bwd)
}
