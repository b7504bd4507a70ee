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
//! The model sets the token indices of its CP shard before each training forward
//! ([`DropoutRows::set`]) and clears them for evaluation and generation (no dropout); a
//! recomputed layer draws the same masks again.

use crate::{RngStreams, Tp};
use candle_core::{bail, Result, Tensor};
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

    /// `x` `[B, T, f]` with its dropped elements zeroed and the kept ones scaled by `1/(1-p)`;
    /// `x` itself when no key is set. Errors name shapes that do not fit the key.
    pub(crate) fn apply(&self, x: &Tensor, input: Input, tp: &Tp) -> Result<Tensor> {
        let Some(k) = self.rows.get() else { return Ok(x.clone()) };
        let (b, t, f) = x.dims3()?;
        let (rank, p) = (tp.group.rank(), tp.size());
        let sp = p > 1 && tp.sequence_parallel;
        let t0 = match input {
            Input::Column if sp => rank * t,
            _ => 0,
        };
        let want_t = if matches!(input, Input::Column) && sp { k.tc / p } else { k.tc };
        if b != k.batch || t != want_t {
            bail!("LoRA dropout ({}): input {:?} does not fit the token indices of a [{}, {}] shard (TP {p}, SP {sp})", self.name, x.dims(), k.batch, k.tc)
        }
        let rows: Vec<u64> = (0..b).flat_map(|bb| k.rows[bb * k.tc + t0..bb * k.tc + t0 + t].iter().copied()).collect();
        let (col0, total) = match input {
            Input::Column => (0, f),
            Input::Row => (rank * f, f * p),
        };
        let keep = k.streams.keep_mask_rows(&self.name, k.step, &rows, col0..col0 + f, total, self.p, x.dtype(), x.device())?;
        x.mul(&keep.reshape((b, t, f))?)
    }
}
