//! The [`ProcessGroup`] trait: the raw collectives every parallel algorithm is built on.
//!
//! Layering (after Megatron-Core's mappings):
//! 1. raw collectives on a `ProcessGroup` (this module) — no autograd;
//! 2. autograd ops whose backward is one call to the conjugate collective (`candle-cp-ops`);
//! 3. public functions used by models.
//!
//! All collectives are *blocking and collective*: every rank of the group must call the same
//! collective, in the same order, with tensors of the same shape and dtype (except where
//! noted). A mismatch is reported as an `Err` on every participating rank; a rank that fails
//! or panics makes the others' current or next collective return `Err` within the group's
//! timeout. Every tensor passed to a collective holds at least one element (see
//! [`ensure_nonempty`]).

use candle_core::{Device, Result, Tensor};
use std::sync::Arc;

/// `Err` naming `op`, `name` and the shape when `t` holds no elements (a dimension of size 0).
///
/// Every collective of this workspace's process groups, and every public op built on them,
/// refuses empty tensors with this error: candle 0.11's CPU backend panics on some views of
/// empty tensors (a `cat`, a `sum` or an `index_select` over a view at a non-zero offset
/// slices the storage past its end), and a rank that panics would take the others down with
/// it. A shard with no rows has no use in these methods, so the error is the honest answer.
pub fn ensure_nonempty(op: &str, name: &str, t: &Tensor) -> Result<()> {
    if t.elem_count() == 0 {
        candle_core::bail!("{op}: {name} {:?} is empty (a dimension of size 0); it needs at least one element", t.shape())
    }
    Ok(())
}

/// A pending result: the receive started by [`ProcessGroup::send_recv`], or the collective
/// started by [`ProcessGroup::all_reduce_start`] / [`ProcessGroup::reduce_scatter_start`] /
/// [`ProcessGroup::all_gather_start`].
///
/// The transfer makes progress in the background (the other ranks' deposits for
/// [`crate::ThreadGroup`], a communication stream for NCCL); call [`PendingRecv::wait`] to get
/// the result. Compute issued between the start and `wait` overlaps the transfer.
pub trait PendingRecv: Send {
    /// Block until the result has arrived (or the group failed / timed out).
    fn wait(self: Box<Self>) -> Result<Tensor>;
}

/// A result that is already there (the default of the `*_start` collectives).
struct Ready(Tensor);

impl PendingRecv for Ready {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        Ok(self.0)
    }
}

/// A group of `size()` ranks that communicate tensors.
///
/// Every implementation accepts tensors on the host (CPU) as well as on its compute device,
/// and returns results on the device of the tensor passed in ([`crate::ThreadGroup`]: any
/// device; `NcclGroup`: its GPU, host tensors are staged through it).
pub trait ProcessGroup: Send + Sync {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// Concatenate every rank's `t` along `dim`, in rank order. Every rank gets the result.
    /// `t` must have the same shape on all ranks.
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;

    /// Sum `t` over ranks, then split the sum into `size()` equal chunks along `dim`; rank `r`
    /// gets chunk `r`. `t.dim(dim)` must be divisible by `size()`.
    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor>;

    /// Sum `t` over ranks; every rank gets the sum.
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor>;

    /// Split `t` into `size()` equal chunks along `split_dim`, send chunk `j` to rank `j`, and
    /// concatenate the chunks received from ranks `0..size()` along `concat_dim`.
    fn all_to_all(&self, t: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor>;

    /// Uneven all-to-all along dim 0: the first `send_rows[0]` rows of `t` go to rank 0, the
    /// next `send_rows[1]` to rank 1, ...; the result holds, in rank order, the
    /// `recv_rows[i]` rows rank `i` sent here (`recv_rows[i]` must be rank `i`'s
    /// `send_rows[self.rank()]`, e.g. from an all-gather of the counts). How the tokens of a
    /// mixture of experts travel to the ranks that hold their experts and back
    /// (`candle_cp_ops::moe_ep`).
    ///
    /// No tensor without elements is passed or returned (see [`ensure_nonempty`]): when
    /// `send_rows` sum to 0, `t` gives only the trailing shape and the dtype (any number of
    /// rows); when `recv_rows` sum to 0 the result is one row of zeros. Errors name the counts
    /// and shapes when `t` has neither `Σ send_rows` rows nor (with nothing to send) any, or a
    /// count list is not one per rank.
    ///
    /// The default ([`crate::ThreadGroup`]) pads each rank's chunks to the largest chunk of the
    /// round (learnt from a one-number all-gather) and calls [`ProcessGroup::all_to_all`]:
    /// two collectives, and `P · max` rows on the wire per rank however uneven the counts.
    /// `NcclGroup` sends each pair's rows as they are (grouped send/recv).
    fn all_to_all_v(&self, t: &Tensor, send_rows: &[usize], recv_rows: &[usize]) -> Result<Tensor> {
        padded_all_to_all_v(self, t, send_rows, recv_rows)
    }

    /// Every rank gets `root`'s `t` (the other ranks' `t` give only shape and dtype).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;

    /// Wait until every rank has reached the barrier.
    fn barrier(&self) -> Result<()>;

    /// Non-blocking exchange with ring neighbours: send `t` to rank `dst` and start receiving
    /// a tensor from rank `src`. Returns at once with a handle on the receive. Every rank of
    /// the group must call `send_recv` together (it is a collective step of a ring); the
    /// tensor received must have been sent by `src` with `dst == self.rank()`.
    fn send_recv(&self, t: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv>>;

    /// [`ProcessGroup::all_reduce`] without waiting for it: returns at once with a handle on the
    /// sum, so compute issued before [`PendingRecv::wait`] overlaps the collective (how the
    /// trainer reduces a layer's gradients while the backward runs on). Every rank must start
    /// the same collectives in the same order, interleaved the same way with the group's other
    /// calls. The default runs the blocking collective; [`crate::ThreadGroup`] and `NcclGroup`
    /// do not wait.
    fn all_reduce_start(&self, t: &Tensor) -> Result<Box<dyn PendingRecv>> {
        Ok(Box::new(Ready(self.all_reduce(t)?)))
    }

    /// [`ProcessGroup::reduce_scatter`] without waiting for it, as
    /// [`ProcessGroup::all_reduce_start`].
    fn reduce_scatter_start(&self, t: &Tensor, dim: usize) -> Result<Box<dyn PendingRecv>> {
        Ok(Box::new(Ready(self.reduce_scatter(t, dim)?)))
    }

    /// [`ProcessGroup::all_gather`] without waiting for it, as
    /// [`ProcessGroup::all_reduce_start`] (how the trainer gathers ZeRO's updated parameters
    /// while the next forward runs, layer by layer).
    fn all_gather_start(&self, t: &Tensor, dim: usize) -> Result<Box<dyn PendingRecv>> {
        Ok(Box::new(Ready(self.all_gather(t, dim)?)))
    }

    /// Build the sub-group of the ranks that passed the same `color`, ordered by `key` (ties by
    /// rank). Collective over this group: every rank must call it.
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn ProcessGroup>>;

    /// The device this rank's tensors must live on, when the group fixes one (an NCCL rank's
    /// GPU); `None` when any device works (thread groups: the tensors' own device). Used by code
    /// that places one global input on many ranks, e.g. `candle_cp_ops::cp::run_case_cp_on`.
    fn home_device(&self) -> Option<Device> {
        None
    }

    /// Short description for error messages, e.g. `"thread group (rank 1 of 4)"`.
    fn describe(&self) -> String {
        format!("process group (rank {} of {})", self.rank(), self.size())
    }
}

/// [`ProcessGroup::all_to_all_v`] from [`ProcessGroup::all_gather`] (the round's largest
/// chunk) and [`ProcessGroup::all_to_all`] on chunks padded to it.
fn padded_all_to_all_v<G: ProcessGroup + ?Sized>(g: &G, t: &Tensor, send_rows: &[usize], recv_rows: &[usize]) -> Result<Tensor> {
    check_all_to_all_v(g, t, send_rows, recv_rows)?;
    let p = g.size();
    let got = recv_rows.iter().sum::<usize>();
    let dims = t.dims();
    let most = send_rows.iter().chain(recv_rows).copied().max().unwrap_or(0) as u32;
    let most = g.all_gather(&Tensor::new(&[most], &Device::Cpu)?, 0)?.to_vec1::<u32>()?;
    let m = most.iter().copied().max().unwrap_or(0).max(1) as usize;
    let mut rest = dims.to_vec();
    let mut chunks = Vec::with_capacity(2 * p);
    let mut off = 0;
    for &n in send_rows {
        if n > 0 {
            chunks.push(t.narrow(0, off, n)?);
        }
        if n < m {
            rest[0] = m - n;
            chunks.push(Tensor::zeros(rest.as_slice(), t.dtype(), t.device())?);
        }
        off += n;
    }
    let got_all = g.all_to_all(&Tensor::cat(&chunks, 0)?, 0, 0)?;
    if got == 0 {
        return got_all.narrow(0, 0, 1)?.zeros_like();
    }
    let parts = recv_rows
        .iter()
        .enumerate()
        .filter(|(_, &n)| n > 0)
        .map(|(i, &n)| got_all.narrow(0, i * m, n))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

/// The checks of [`ProcessGroup::all_to_all_v`]'s arguments on `g` (every implementation's):
/// one count per rank each way, `t` not empty and holding `Σ send_rows` rows (any number when
/// that is 0). Errors name the counts and the shape.
pub(crate) fn check_all_to_all_v<G: ProcessGroup + ?Sized>(g: &G, t: &Tensor, send_rows: &[usize], recv_rows: &[usize]) -> Result<()> {
    let p = g.size();
    if send_rows.len() != p || recv_rows.len() != p {
        candle_core::bail!(
            "all_to_all_v: {} send and {} receive counts on a group of {p} ranks ({})",
            send_rows.len(),
            recv_rows.len(),
            g.describe()
        )
    }
    ensure_nonempty("all_to_all_v", "t", t)?;
    let (dims, sent) = (t.dims(), send_rows.iter().sum::<usize>());
    if t.rank() == 0 || (dims[0] != sent && sent != 0) {
        candle_core::bail!("all_to_all_v: t {dims:?} must have the {sent} rows the send counts {send_rows:?} sum to")
    }
    Ok(())
}

/// Shared handle on a process group; what the ops and layers take.
pub type Group = Arc<dyn ProcessGroup>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_ranks;
    use candle_core::DType;

    /// The default (padded) `all_to_all_v`, which a `ProcessGroup` without its own gets,
    /// delivers what the thread group's native one does, bit for bit: uneven chunks, a rank
    /// sending nothing, one receiving nothing (one zero row).
    #[test]
    fn padded_all_to_all_v_matches_the_native_one() -> Result<()> {
        let rows = [[2usize, 3, 0], [0, 0, 0], [1, 4, 0]];
        let res = run_ranks(3, |g| {
            let r = g.rank();
            let sent = rows[r].iter().sum::<usize>().max(1);
            let t = Tensor::arange(0u32, (sent * 4) as u32, &Device::Cpu)?.to_dtype(DType::F32)?.affine(1.0, 100.0 * r as f64)?.reshape((sent, 4))?;
            let recv: Vec<usize> = (0..3).map(|i| rows[i][r]).collect();
            let native = g.all_to_all_v(&t, &rows[r], &recv)?;
            let padded = padded_all_to_all_v(g.as_ref(), &t, &rows[r], &recv)?;
            assert_eq!(native.dims(), padded.dims(), "rank {r}");
            assert_eq!(native.to_vec2::<f32>()?, padded.to_vec2::<f32>()?, "rank {r}");
            native.dim(0)
        });
        let got: Vec<usize> = res.into_iter().collect::<Result<_>>()?;
        assert_eq!(got, [3, 7, 1], "rows received (rank 2: one zero row)");
        Ok(())
    }
}
