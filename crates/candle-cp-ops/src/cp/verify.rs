//! Run an oracle attention case on `P` thread ranks with a CP method and gather the results.
//!
//! Used by the `candle-cp verify attn --layout … --cp P` command and the `cp_oracle` tests:
//! the global q, k, v, dout of the case are sharded by the method's layout, every rank runs the
//! differentiable CP op and the backward of `sum(out · dout)` through candle autograd, and the
//! shards of out, lse, dq, dk, dv are put back in token order.

use super::shard::{shard, unshard, Layout};
use super::{allgather_attention, ring_attention, CpOpts};
use crate::oracle::{AttnCase, AttnOutputs};
use crate::Group;
use candle_core::{bail, Result, Tensor, Var};
use candle_cp_comm::{run_ranks_with, ThreadGroupOptions};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A context-parallel attention algorithm and its layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpMethod {
    /// [`ring_attention`] with the given layout.
    Ring(Layout),
    /// [`allgather_attention`] with the given layout (zigzag from the command line).
    AllGather(Layout),
}

impl CpMethod {
    /// The four methods of the command line: `ring` (contiguous), `zigzag`, `striped`,
    /// `allgather` (zigzag layout).
    pub const ALL: [CpMethod; 4] = [
        CpMethod::Ring(Layout::Contiguous),
        CpMethod::Ring(Layout::Zigzag),
        CpMethod::Ring(Layout::Striped),
        CpMethod::AllGather(Layout::Zigzag),
    ];

    /// The sharding layout.
    pub fn layout(&self) -> Layout {
        match self {
            CpMethod::Ring(l) | CpMethod::AllGather(l) => *l,
        }
    }

    /// Run the method's differentiable op on this rank's shards (see [`ring_attention`]);
    /// `opts.layout` is replaced by the method's layout.
    pub fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        group: &Group,
        opts: &CpOpts,
    ) -> Result<(Tensor, Tensor)> {
        let opts = CpOpts {
            layout: self.layout(),
            ..opts.clone()
        };
        match self {
            CpMethod::Ring(_) => ring_attention(q, k, v, group, &opts),
            CpMethod::AllGather(_) => allgather_attention(q, k, v, group, &opts),
        }
    }
}

impl fmt::Display for CpMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpMethod::Ring(Layout::Contiguous) => f.write_str("ring"),
            CpMethod::Ring(l) => write!(f, "{l}"),
            CpMethod::AllGather(Layout::Zigzag) => f.write_str("allgather"),
            CpMethod::AllGather(l) => write!(f, "allgather-{l}"),
        }
    }
}

impl FromStr for CpMethod {
    type Err = candle_core::Error;
    /// `ring`/`contiguous`, `zigzag`, `striped`, `allgather` (zigzag), `allgather-<layout>`.
    fn from_str(s: &str) -> Result<Self> {
        let s = s.to_ascii_lowercase();
        if s == "allgather" || s == "all-gather" {
            return Ok(CpMethod::AllGather(Layout::Zigzag));
        }
        if let Some(l) = s.strip_prefix("allgather-") {
            return Ok(CpMethod::AllGather(l.parse()?));
        }
        match s.parse::<Layout>() {
            Ok(l) => Ok(CpMethod::Ring(l)),
            Err(_) => {
                bail!("unknown CP layout '{s}' (expected ring, zigzag, striped or allgather)")
            }
        }
    }
}

/// Global results of a CP run plus what every rank reported.
#[derive(Clone, Debug)]
pub struct CpRun {
    /// Gathered global out, lse, dq, dk, dv.
    pub outputs: AttnOutputs,
    /// Local shapes of (out, lse, dq, dk, dv) per rank (all equal when the run succeeds).
    pub shapes: Vec<Vec<Vec<usize>>>,
}

/// Run `case` on `p` thread ranks with `method` (forward + autograd backward of
/// `sum(out · dout)`) and gather the results. Errors when `T` does not suit the layout
/// (naming T, P, layout), when any rank fails, or when ranks disagree on output shapes.
pub fn run_case_cp(
    case: &AttnCase,
    method: CpMethod,
    p: usize,
    timeout: Duration,
) -> Result<CpRun> {
    run_case_cp_with(case, method, p, timeout, CpOpts::default())
}

/// [`run_case_cp`] with explicit options: `opts.overlap` and `opts.block_rows` are used,
/// the layout, mask and scale come from `method` and `case`.
pub fn run_case_cp_with(
    case: &AttnCase,
    method: CpMethod,
    p: usize,
    timeout: Duration,
    opts: CpOpts,
) -> Result<CpRun> {
    let layout = method.layout();
    let cp_opts = CpOpts {
        layout,
        causal: case.causal,
        scale: Some(case.scale),
        ..opts
    };
    let opts = ThreadGroupOptions::with_timeout(timeout);
    run_case_cp_on(case, method, p, cp_opts, |body| Ok(run_ranks_with(p, opts, body)))
}

/// One rank's part of a CP run ([`run_case_cp_on`]): given the rank's group, returns its local
/// `[out, lse, dq, dk, dv]` on the case's device.
pub type RankBody<'a> = dyn Fn(Group) -> Result<[Tensor; 5]> + Send + Sync + 'a;

/// [`run_case_cp_with`] on ranks started by `spawn`, which must call the body once per rank
/// `0..p` (each on its own thread, with the rank's group) and return the results in rank
/// order: thread ranks ([`candle_cp_comm::run_ranks_with`]) or NCCL ranks
/// (`candle_cp_comm::nccl::run_nccl_ranks`, one GPU each). Each rank's shards of the global
/// `case` go to its group's [`ProcessGroup::home_device`](candle_cp_comm::ProcessGroup::home_device)
/// (else stay on the case's device) and its results come back to the case's device, where
/// they are gathered. `opts` is used as given (layout, mask and scale included).
pub fn run_case_cp_on(
    case: &AttnCase,
    method: CpMethod,
    p: usize,
    cp_opts: CpOpts,
    spawn: impl FnOnce(&RankBody) -> Result<Vec<Result<[Tensor; 5]>>>,
) -> Result<CpRun> {
    let layout = cp_opts.layout;
    let t = case.q.dim(1)?;
    layout.local_len(t, p)?;
    let home = case.q.device().clone();
    let body = |g: Group| -> Result<[Tensor; 5]> {
        let r = g.rank();
        if g.size() != p {
            bail!("{method}: rank {r}'s group has {} ranks, the run asked for P = {p}", g.size())
        }
        let dev = g.home_device().unwrap_or_else(|| home.clone());
        let sh = |x: &Tensor| shard(x, layout, r, p, 1)?.to_device(&dev);
        let q = Var::from_tensor(&sh(&case.q)?)?;
        let k = Var::from_tensor(&sh(&case.k)?)?;
        let v = Var::from_tensor(&sh(&case.v)?)?;
        let dout = sh(&case.dout)?;
        let (out, lse) =
            method.attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &g, &cp_opts)?;
        let grads = (&out * &dout)?.sum_all()?.backward()?;
        let grad = |x: &Var, n: &str| -> Result<Tensor> {
            match grads.get(x.as_tensor()) {
                Some(t) => Ok(t.clone()),
                None => bail!("{method} rank {r}: no gradient for {n}"),
            }
        };
        let back = |x: Tensor| x.to_device(&home);
        Ok([back(out)?, back(lse)?, back(grad(&q, "q")?)?, back(grad(&k, "k")?)?, back(grad(&v, "v")?)?])
    };
    let res = spawn(&body)?;
    if res.len() != p {
        bail!("{method} with P = {p}: the ranks returned {} results", res.len())
    }
    let mut per_rank = Vec::with_capacity(p);
    let mut errs = Vec::new();
    for (r, x) in res.into_iter().enumerate() {
        match x {
            Ok(x) => per_rank.push(x),
            Err(e) => errs.push(format!("rank {r}: {e}")),
        }
    }
    if !errs.is_empty() {
        bail!(
            "{method} with P = {p} on {}: {}",
            case.name,
            errs.join("; ")
        )
    }
    let shapes: Vec<Vec<Vec<usize>>> = per_rank
        .iter()
        .map(|xs| xs.iter().map(|x| x.dims().to_vec()).collect())
        .collect();
    if let Some(r) = shapes.iter().position(|s| s != &shapes[0]) {
        bail!(
            "{method} with P = {p}: rank {r} output shapes {:?} differ from rank 0 {:?}",
            shapes[r],
            shapes[0]
        )
    }
    let col = |i: usize| per_rank.iter().map(|xs| xs[i].clone()).collect::<Vec<_>>();
    let outputs = AttnOutputs {
        out: unshard(&col(0), layout, 1)?,
        lse: unshard(&col(1), layout, 2)?,
        dq: unshard(&col(2), layout, 1)?,
        dk: unshard(&col(3), layout, 1)?,
        dv: unshard(&col(4), layout, 1)?,
    };
    Ok(CpRun { outputs, shapes })
}
