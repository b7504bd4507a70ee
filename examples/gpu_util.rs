//! Helpers shared by the `gpu_check` and `gpu_bench` examples (included with `#[path]`).
#![allow(dead_code)]

use candle_core::{Result, Tensor, Var};
use candle_cp_comm::run_ranks;
use candle_cp_ops::cp::RankBody;
use candle_cp_ops::Group;
use candle_cp_ops::oracle::{randn, AttnCase, AttnOutputs};
use candle_cp_ops::ulysses::{contiguous_shard, ulysses_attention, UlyssesOpts};

/// Deterministic N(0, 1) f32 tensor on the CPU from `seed` ([`randn`]).
pub fn rand_tensor(shape: &[usize], seed: u64) -> Result<Tensor> {
    randn(seed, shape, 1.0)
}

/// `max |a - b|` (any devices and dtypes; equal infinities count as 0, NaN gives NaN).
pub use candle_cp_ops::oracle::abs_err as max_abs;
/// `max |a - b| / max |b|`.
pub use candle_cp_ops::oracle::rel_err as rel;

/// Ulysses attention of an oracle case on `p` virtual ranks (threads; tensors on the case's
/// device): forward + backward of `sum(out * dout)`, shards gathered back to global tensors.
pub fn run_ulysses(case: &AttnCase, p: usize) -> Result<AttnOutputs> {
    run_ulysses_on(case, p, |body| Ok(run_ranks(p, body)))
}

/// [`run_ulysses`] on ranks started by `spawn` (see `candle_cp_ops::cp::run_case_cp_on`): each
/// rank's shards go to its group's home device (NCCL ranks: its GPU), results come back to the
/// case's device.
pub fn run_ulysses_on(case: &AttnCase, p: usize, spawn: impl FnOnce(&RankBody) -> Result<Vec<Result<[Tensor; 5]>>>) -> Result<AttnOutputs> {
    let home = case.q.device().clone();
    let body = |g: Group| -> Result<[Tensor; 5]> {
        let r = g.rank();
        let dev = g.home_device().unwrap_or_else(|| home.clone());
        let sh = |x: &Tensor| contiguous_shard(x, r, p)?.to_device(&dev);
        let q = Var::from_tensor(&sh(&case.q)?)?;
        let k = Var::from_tensor(&sh(&case.k)?)?;
        let v = Var::from_tensor(&sh(&case.v)?)?;
        let dout = sh(&case.dout)?;
        let opts = UlyssesOpts::new(case.causal, case.scale);
        let (out, lse) = ulysses_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &g, &opts)?;
        let grads = (&out * &dout)?.sum_all()?.backward()?;
        let grad = |x: &Var| -> Result<Tensor> {
            grads.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg(format!("rank {r}: missing gradient")))
        };
        let back = |x: Tensor| x.to_device(&home);
        Ok([back(out)?, back(lse)?, back(grad(&q)?)?, back(grad(&k)?)?, back(grad(&v)?)?])
    };
    let res = spawn(&body)?;
    let mut ranks = Vec::new();
    for (r, x) in res.into_iter().enumerate() {
        ranks.push(x.map_err(|e| candle_core::Error::Msg(format!("rank {r}: {e}")))?);
    }
    let col = |i: usize, dim: usize| -> Result<Tensor> {
        let xs: Vec<Tensor> = ranks.iter().map(|x| x[i].clone()).collect();
        Tensor::cat(&xs, dim)
    };
    Ok(AttnOutputs { out: col(0, 1)?, lse: col(1, 2)?, dq: col(2, 1)?, dk: col(3, 1)?, dv: col(4, 1)? })
}
