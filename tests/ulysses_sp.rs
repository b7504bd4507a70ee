//! Ulysses, 2-D Ulysses × ring, and Megatron sequence parallelism (threads as ranks).
//!
//! - every conjugate pair (Megatron mappings and the Ulysses all-to-alls) as a pair: the
//!   forward of one equals the backward of the other, and each forward matches the collective
//!   computed by hand from every rank's input;
//! - an SP+TP transformer block (RMSNorm → attention → dropout → LayerNorm → MLP → dropout)
//!   with TP = 2, 4, SP on and off, against a single-device block built from plain candle ops:
//!   outputs, input gradient and every parameter gradient;
//! - Ulysses and 2-D attention on every oracle case the heads allow (incl. KV replication),
//!   against the float64 oracle and the single-device op; at degrees the KV heads neither
//!   divide nor are divided by (KV heads replicated to the lcm), against the dense reference;
//! - error paths.

#[path = "ulysses_sp/attn.rs"]
mod attn;
#[path = "ulysses_sp/block.rs"]
mod block;
#[path = "ulysses_sp/head_layout.rs"]
mod head_layout;
#[path = "ulysses_sp/kv_lcm.rs"]
mod kv_lcm;
#[path = "ulysses_sp/pairs.rs"]
mod pairs;
#[path = "ulysses_sp/volume.rs"]
mod volume;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_cp_comm::Group;
use std::collections::HashMap;

// ---------------------------------------------------------------- helpers

pub(crate) use candle_cp_tests::{grad, rand_t};

pub(crate) fn all_ok<T>(res: Vec<candle_core::Result<T>>) -> Result<Vec<T>> {
    res.into_iter().enumerate().map(|(r, x)| x.with_context(|| format!("rank {r}"))).collect()
}

pub(crate) fn max_abs(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.dims() != b.dims() {
        bail!("shape {:?} vs {:?}", a.dims(), b.dims())
    }
    Ok((a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?.abs()?.max_all()?.to_scalar::<f64>()?)
}

pub(crate) fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let m = b.to_dtype(DType::F64)?.abs()?.max_all()?.to_scalar::<f64>()?;
    Ok(max_abs(a, b)? / m.max(1e-30))
}

// ---------------------------------------------------------------- communication volume

/// A process group that logs the bytes this rank *sends* per collective (standard ring
/// algorithms: all-gather `(P-1)·|t|`, reduce-scatter and all-to-all `(P-1)/P·|t|`, all-reduce
/// `2(P-1)/P·|t|`, send/recv `|t|`). Collectives under 1 KiB (shape checks) are not counted.
pub(crate) struct Counting {
    inner: Group,
    log: std::sync::Arc<std::sync::Mutex<HashMap<&'static str, f64>>>,
}

impl Counting {
    pub(crate) fn wrap(inner: Group) -> (Group, std::sync::Arc<std::sync::Mutex<HashMap<&'static str, f64>>>) {
        let log = std::sync::Arc::new(std::sync::Mutex::new(HashMap::new()));
        (std::sync::Arc::new(Counting { inner, log: log.clone() }), log)
    }
    fn rec(&self, op: &'static str, t: &Tensor, factor: f64) {
        let bytes = (t.elem_count() * t.dtype().size_in_bytes()) as f64;
        if bytes >= 1024.0 {
            *self.log.lock().unwrap().entry(op).or_default() += bytes * factor;
        }
    }
    fn p(&self) -> f64 {
        self.inner.size() as f64
    }
}

impl candle_cp_comm::ProcessGroup for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
        self.rec("all_gather", t, self.p() - 1.0);
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
        self.rec("reduce_scatter", t, (self.p() - 1.0) / self.p());
        self.inner.reduce_scatter(t, dim)
    }
    fn all_reduce(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        self.rec("all_reduce", t, 2.0 * (self.p() - 1.0) / self.p());
        self.inner.all_reduce(t)
    }
    fn all_to_all(&self, t: &Tensor, split_dim: usize, concat_dim: usize) -> candle_core::Result<Tensor> {
        self.rec("all_to_all", t, (self.p() - 1.0) / self.p());
        self.inner.all_to_all(t, split_dim, concat_dim)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> candle_core::Result<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> candle_core::Result<()> {
        self.inner.barrier()
    }
    fn send_recv(&self, t: &Tensor, dst: usize, src: usize) -> candle_core::Result<Box<dyn candle_cp_comm::PendingRecv>> {
        self.rec("send_recv", t, 1.0);
        self.inner.send_recv(t, dst, src)
    }
    fn split(&self, color: usize, key: usize) -> candle_core::Result<Group> {
        let inner = self.inner.split(color, key)?;
        Ok(std::sync::Arc::new(Counting { inner, log: self.log.clone() }))
    }
}

pub(crate) type Log = std::sync::Arc<std::sync::Mutex<HashMap<&'static str, f64>>>;

pub(crate) fn total(log: &Log) -> f64 {
    log.lock().unwrap().values().sum()
}

