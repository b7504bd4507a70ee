//! Expert parallelism: the `E` experts of a mixture-of-experts layer split over the `P` ranks
//! of an EP group (rank `j` holds experts `[j·E/P, (j+1)·E/P)`), each rank's routed rows sent
//! to the ranks holding their experts and the experts' outputs sent back.
//!
//! ```text
//!  rank r: pairs grouped by expert (moe::Routing)      rank j: its experts' rows, by expert
//!  xs [M, h] = │ experts of rank 0 │ of rank 1 │ ...   ──dispatch_to_experts──►  x_local [R, h]
//!                                                                    grouped matmuls (E/P experts)
//!  ys [M, h] ◄──return_from_experts──  rows back to the ranks they came from  ◄── y_local [R, h]
//! ```
//!
//! [`ExpertExchange::new`] learns from one all-gather of the `[E]` expert counts how many rows
//! go where; [`dispatch_to_experts`] and [`return_from_experts`] are conjugate autograd ops
//! (each one's backward is the other applied to the gradient), built on
//! [`candle_cp_comm::ProcessGroup::all_to_all_v`]. A rank receives its experts' rows rank by
//! rank; the exchange reorders them expert by expert (one `index_select`) so the grouped
//! matmul ([`crate::moe::grouped_matmul`]) reads each expert's rows as one block.
//!
//! A rank whose experts no token chose gets one row of zeros, counted as its first expert's
//! (no tensor without elements is ever made, see [`candle_cp_comm::ensure_nonempty`]): its
//! output is dropped by [`return_from_experts`] and its gradient is zero, so it adds nothing
//! to the weights' gradients.
//!
//! Every rank of the group must build the exchange and call the ops in the same order (they
//! are collectives over the EP group), and a layer's forward and backward use its weights'
//! slices `[E/P, ·, ·]`: the weight gradients cover every token the EP group routed to them,
//! and are summed over the ranks that hold the same experts (data-parallel replicas) only.

use crate::autograd::{attach1, BackwardFn};
use candle_core::{bail, Device, Result, Tensor};
use candle_cp_comm::Group;
use std::sync::Arc;

/// How one layer's routed rows travel over an EP group (see the module doc).
#[derive(Clone)]
pub struct ExpertExchange {
    group: Group,
    /// Rows this rank sends to each rank (the rows of that rank's experts), `[P]`.
    send: Vec<usize>,
    /// Rows this rank receives from each rank, `[P]`.
    recv: Vec<usize>,
    /// Rows of each local expert, `[E/P]` (the zero row counted in the first when none came).
    counts: Vec<usize>,
    /// Expert-major position → position in the received (rank-major) rows, `[R]`.
    order: Vec<u32>,
    /// Rank-major position → expert-major position, `[R]`.
    inverse: Vec<u32>,
}

impl ExpertExchange {
    /// The exchange of a rank whose `M = Σ counts` rows are grouped by expert, `counts` `[E]`
    /// (a [`crate::moe::Routing`]'s). Collective over `group` (one all-gather of the counts):
    /// every rank passes `E` counts. Errors when `P` does not divide `E` or a rank has no rows
    /// (every rank routes at least one token), naming the counts.
    pub fn new(counts: &[usize], group: &Group) -> Result<ExpertExchange> {
        let (p, me, e) = (group.size(), group.rank(), counts.len());
        if e == 0 || !e.is_multiple_of(p) {
            bail!("ExpertExchange: {e} experts (counts {counts:?}) do not split over the {p} ranks of the EP group ({})", group.describe())
        }
        if counts.iter().all(|&c| c == 0) {
            bail!("ExpertExchange: no rows to route (counts {counts:?}); every EP rank routes at least one token")
        }
        if counts.iter().any(|&c| c > u32::MAX as usize) {
            bail!("ExpertExchange: counts {counts:?} past 2^32 rows")
        }
        let el = e / p;
        let mine: Vec<u32> = counts.iter().map(|&c| c as u32).collect();
        let all = group.all_gather(&Tensor::from_vec(mine, e, &Device::Cpu)?, 0)?.to_vec1::<u32>()?;
        if all.len() != p * e {
            bail!("ExpertExchange: gathered {} counts, expected {p} ranks × {e} experts", all.len())
        }
        // all[i·E + x]: rows rank i routes to expert x
        let of = |i: usize, x: usize| all[i * e + x] as usize;
        let send = (0..p).map(|j| counts[j * el..(j + 1) * el].iter().sum()).collect();
        let recv: Vec<usize> = (0..p).map(|i| (0..el).map(|x| of(i, me * el + x)).sum()).collect();
        let mut counts_local: Vec<usize> = (0..el).map(|x| (0..p).map(|i| of(i, me * el + x)).sum()).collect();
        let r: usize = recv.iter().sum();
        // received rows: rank by rank, inside each rank's block expert by expert; `start[i·el
        // + x]` is where rank i's rows of local expert x begin
        let mut start = Vec::with_capacity(p * el);
        let mut at = 0usize;
        for i in 0..p {
            for x in 0..el {
                start.push(at);
                at += of(i, me * el + x);
            }
        }
        let mut order = Vec::with_capacity(r);
        for x in 0..el {
            for i in 0..p {
                let a = start[i * el + x];
                order.extend((a..a + of(i, me * el + x)).map(|v| v as u32));
            }
        }
        let mut inverse = vec![0u32; r];
        for (pos, &src) in order.iter().enumerate() {
            inverse[src as usize] = pos as u32;
        }
        if r == 0 {
            counts_local[0] = 1;
        }
        Ok(ExpertExchange { group: group.clone(), send, recv, counts: counts_local, order, inverse })
    }

    /// Rows of each of this rank's `E/P` experts in [`dispatch_to_experts`]' output (the
    /// counts of [`crate::moe::grouped_matmul`] with this rank's weight slices). When no row
    /// came, `[1, 0, ...]`: the zero row.
    pub fn local_counts(&self) -> &[usize] {
        &self.counts
    }

    /// Rows this rank's experts received (0: none; the ops then carry one zero row).
    pub fn received(&self) -> usize {
        self.order.len()
    }

    /// Rows this rank sends to each EP rank, `[P]`.
    pub fn send_rows(&self) -> &[usize] {
        &self.send
    }

    /// Rows this rank receives from each EP rank, `[P]`.
    pub fn recv_rows(&self) -> &[usize] {
        &self.recv
    }

    /// The EP group.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Per-row keys (`u64`, one per row of this rank's `[M, ·]` rows grouped by expert) sent
    /// as [`dispatch_to_experts`] sends the rows: the keys of this rank's experts' rows, grouped
    /// by local expert (`[R]`; one key 0 for the zero row when `R = 0`). For values that must
    /// travel with the rows, e.g. the (token, expert) keys of dropout masks drawn where the
    /// experts are. Collective over the EP group.
    pub fn dispatch_keys(&self, keys: &[u64], device: &Device) -> Result<Vec<u64>> {
        let m: usize = self.send.iter().sum();
        if keys.len() != m {
            bail!("ExpertExchange::dispatch_keys: {} keys for the {m} rows sent {:?}", keys.len(), self.send)
        }
        // (as i64 bits: every group moves i64)
        let t = Tensor::from_vec(keys.iter().map(|&k| k as i64).collect::<Vec<_>>(), (m, 1), device)?;
        Ok(self.forward_raw(&t)?.flatten_all()?.to_vec1::<i64>()?.into_iter().map(|k| k as u64).collect())
    }

    fn check(&self, op: &str, t: &Tensor, rows: usize) -> Result<()> {
        if t.rank() < 2 || t.dim(0)? != rows {
            bail!("{op}: input {:?} must be [{rows}, ...] (rows sent {:?}, received {:?})", t.dims(), self.send, self.recv)
        }
        Ok(())
    }

    /// Rank-major rows [M, ·] out → expert-major local rows (no autograd).
    fn forward_raw(&self, xs: &Tensor) -> Result<Tensor> {
        let got = self.group.all_to_all_v(xs, &self.send, &self.recv)?;
        if self.order.is_empty() {
            return Ok(got); // the zero row
        }
        let idx = Tensor::from_vec(self.order.clone(), self.order.len(), xs.device())?;
        got.index_select(&idx, 0)
    }

    /// Expert-major local rows (or the zero row) → this rank's rows `[M, ·]` (no autograd).
    fn backward_raw(&self, ys: &Tensor) -> Result<Tensor> {
        let back = if self.inverse.is_empty() {
            ys.clone() // the zero row: nothing to send, it gives the shape
        } else {
            let idx = Tensor::from_vec(self.inverse.clone(), self.inverse.len(), ys.device())?;
            ys.index_select(&idx, 0)?
        };
        self.group.all_to_all_v(&back, &self.recv, &self.send)
    }
}

/// `xs` `[M, ·]`, this rank's rows grouped by expert (the exchange's counts), → the rows of
/// this rank's experts from every EP rank, grouped by local expert: `[R, ·]`
/// ([`ExpertExchange::local_counts`]; one zero row when `R = 0`). Differentiable; the
/// backward is [`return_from_experts`] of the gradient. Collective over the EP group.
pub fn dispatch_to_experts(xs: &Tensor, ex: &ExpertExchange) -> Result<Tensor> {
    ex.check("dispatch_to_experts", xs, ex.send.iter().sum())?;
    let out = ex.forward_raw(&xs.detach())?;
    let back = ex.clone();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| Ok(vec![Some(back.backward_raw(dy)?)]));
    attach1("dispatch_to_experts", xs, out, bwd)
}

/// The conjugate of [`dispatch_to_experts`]: the experts' outputs `[R, ·]` (grouped by local
/// expert; the zero row's output when `R = 0`) back to the ranks their rows came from, in
/// each rank's order: `[M, ·]`. Differentiable; the backward is [`dispatch_to_experts`] of
/// the gradient. Collective over the EP group.
pub fn return_from_experts(ys: &Tensor, ex: &ExpertExchange) -> Result<Tensor> {
    ex.check("return_from_experts", ys, ex.received().max(1))?;
    let out = ex.backward_raw(&ys.detach())?;
    let fwd = ex.clone();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| Ok(vec![Some(fwd.forward_raw(dy)?)]));
    attach1("return_from_experts", ys, out, bwd)
}

/// This EP rank's slice `[E/P, ·, ·]` of a stacked expert weight `[E, ·, ·]` (experts
/// `[rank·E/P, (rank+1)·E/P)`). Errors when `P` does not divide `E`.
pub fn local_experts(w: &Tensor, rank: usize, size: usize) -> Result<Tensor> {
    let e = w.dim(0)?;
    if size == 0 || rank >= size || !e.is_multiple_of(size) {
        bail!("local_experts: {e} experts (weight {:?}) do not split over {size} EP ranks (rank {rank})", w.dims())
    }
    w.narrow(0, rank * (e / size), e / size)
}

#[cfg(test)]
#[path = "moe_ep_tests.rs"]
mod tests;
