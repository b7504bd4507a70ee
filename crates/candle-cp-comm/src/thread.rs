//! [`ThreadGroup`]: a [`ProcessGroup`] whose ranks are threads of one process, and the
//! launchers [`run_ranks`] / [`run_ranks_with`].
//!
//! Tensors are exchanged as candle [`Tensor`]s on whatever [`Device`] the ranks use (CPU now,
//! CUDA later): a receiving rank gets its result on the device of the tensor it passed in.
//! Results never share a buffer with another rank's tensor (they are freshly computed or
//! copied), so in-place updates on one rank can never be seen by another.
//!
//! Guarantees:
//! - **Deterministic reductions**: sums are taken in rank order (f16/bf16/f32 accumulate in
//!   f32), computed once for `all_reduce`, so every rank gets the same bits and the result
//!   equals the serial sum `((t0 + t1) + t2) + ...`.
//! - **Mismatch detection**: every rank validates the complete round (op, parameters, shapes,
//!   dtypes), so ranks calling different collectives, or the same one with different shapes,
//!   dtypes or dims, all get the same `Err` naming the op and each rank's shape.
//! - **Fault propagation**: a rank that fails (its closure returns `Err` or panics under
//!   [`run_ranks`]) aborts the world; every other rank's current or next call, in any
//!   sub-group, returns `Err` naming the failed rank and the reason, without waiting for the
//!   timeout. A call that waits longer than [`ThreadGroupOptions::timeout`] returns `Err` and
//!   aborts the world too. A rank waiting for a rank that has already returned fails at once.
//! - **Inputs are detached**: collectives are raw (no autograd); results are fresh leaves.

use crate::collect::{check_round, chunk, fresh_on, sum_in_order, tensor_of};
use crate::world::{lock, Comm, Entry, Op, Taken, World};
use crate::{ensure_nonempty, Group, PendingRecv, ProcessGroup};
use candle_core::{Device, Error, Result, Tensor};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Options of a thread world.
#[derive(Clone, Debug)]
pub struct ThreadGroupOptions {
    /// Longest time a rank waits in one collective (or in [`PendingRecv::wait`]) for the
    /// other ranks. Past it the call returns `Err` and the world is aborted. Default 60 s.
    pub timeout: Duration,
    /// Device the ranks are meant to compute on, for launch code that creates tensors
    /// (read it with [`ThreadGroup::device`] or [`WorldHandle::device`]). Collectives do not
    /// depend on it: results land on the device of the tensor each rank passes in.
    /// Default [`Device::Cpu`].
    pub device: Device,
    /// Stack size of each rank thread spawned by [`run_ranks_with`] (deep autograd graphs
    /// recurse in candle's backward). Default 64 MiB (virtual; only touched pages count).
    pub stack_size: usize,
}

impl Default for ThreadGroupOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            device: Device::Cpu,
            stack_size: 64 << 20,
        }
    }
}

impl ThreadGroupOptions {
    /// Default options with the given timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            timeout,
            ..Self::default()
        }
    }
}

/// Control over a thread world from outside its ranks (for callers that manage their own
/// threads with [`ThreadGroup::new_world_with_handle`]).
#[derive(Clone)]
pub struct WorldHandle {
    world: Arc<World>,
    device: Device,
}

impl WorldHandle {
    /// Abort the world on behalf of world rank `rank`: every rank's current or next call
    /// returns `Err` naming `rank` and `reason`. Only the first abort is recorded.
    pub fn abort(&self, rank: usize, reason: impl Into<String>) {
        self.world.abort(rank, reason.into());
    }

    /// Record that world rank `rank` has returned: any call still waiting for it fails at
    /// once instead of timing out.
    pub fn mark_exited(&self, rank: usize) {
        self.world.mark_exited(rank);
    }

    /// `Some((rank, reason))` once the world has been aborted.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.world.failure().map(|f| (f.rank, f.reason))
    }

    /// The device from the world's options.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

/// One rank's handle on a group of thread ranks (the world or a sub-group of it).
///
/// Create a world with [`ThreadGroup::new_world`] (or let [`run_ranks`] do it) and hand
/// group `r` to the thread of rank `r`. Each handle must be used by one thread at a time.
pub struct ThreadGroup {
    comm: Arc<Comm>,
    rank: usize,
    seq: AtomicU64,
    device: Device,
}

impl ThreadGroup {
    /// Create a world of `p` thread ranks; element `r` is rank `r`'s group.
    pub fn new_world(p: usize, opts: ThreadGroupOptions) -> Vec<Group> {
        Self::new_world_with_handle(p, opts).0
    }

    /// Like [`ThreadGroup::new_world`], also returning a [`WorldHandle`] to abort the world
    /// or mark ranks as exited (what [`run_ranks`] does when a rank fails or returns).
    pub fn new_world_with_handle(p: usize, opts: ThreadGroupOptions) -> (Vec<Group>, WorldHandle) {
        let world = World::new(p, opts.timeout);
        let comm = Comm::new(world.clone(), (0..p).collect(), "world".to_string());
        let groups = (0..p)
            .map(|rank| Arc::new(Self::on(comm.clone(), rank, opts.device.clone())) as Group)
            .collect();
        (
            groups,
            WorldHandle {
                world,
                device: opts.device,
            },
        )
    }

    fn on(comm: Arc<Comm>, rank: usize, device: Device) -> Self {
        Self {
            comm,
            rank,
            seq: AtomicU64::new(0),
            device,
        }
    }

    /// The device from the world's options (see [`ThreadGroupOptions::device`]).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// World rank of each rank of this group, in group order.
    pub fn world_ranks(&self) -> &[usize] {
        &self.comm.members
    }

    /// Deposit this rank's entry and wait for the complete, validated round.
    fn exchange(&self, op: Op, tensor: Option<&Tensor>) -> Result<(u64, Taken)> {
        let seq = self.start(op.clone(), tensor)?;
        let taken = self.comm.take(seq, self.rank, &op)?;
        check_round(&self.comm.label, seq, &taken.entries)?;
        Ok((seq, taken))
    }

    /// Deposit this rank's entry for the next round without waiting.
    fn start(&self, op: Op, tensor: Option<&Tensor>) -> Result<u64> {
        if let Some(t) = tensor.filter(|t| t.elem_count() == 0) {
            // (the label is formatted only for the error, not on every call)
            ensure_nonempty(&format!("thread group {}: rank {} in {op}", self.comm.label, self.rank), "tensor", t)?;
        }
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let entry = Entry {
            op,
            tensor: tensor.map(|t| t.detach()),
        };
        self.comm.deposit(seq, self.rank, entry)?;
        Ok(seq)
    }
}

impl ProcessGroup for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let (_, taken) = self.exchange(Op::AllGather { dim }, Some(t))?;
        if self.size() == 1 {
            return Ok(t.detach());
        }
        cat_entries(&taken, self.size(), dim, t.device())
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let (_, taken) = self.exchange(Op::ReduceScatter { dim }, Some(t))?;
        scatter_sum(&taken, dim, self.rank, self.size(), t.device())
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        let (_, taken) = self.exchange(Op::AllReduce, Some(t))?;
        if self.size() == 1 {
            return Ok(t.detach());
        }
        sum_once(&self.comm.label, &taken, t.device())
    }

    fn all_reduce_start(&self, t: &Tensor) -> Result<Box<dyn PendingRecv>> {
        let op = Op::AllReduce;
        let seq = self.start(op.clone(), Some(t))?;
        Ok(Box::new(ThreadRecv::new(self, seq, op, t.device())))
    }

    fn reduce_scatter_start(&self, t: &Tensor, dim: usize) -> Result<Box<dyn PendingRecv>> {
        let op = Op::ReduceScatter { dim };
        let seq = self.start(op.clone(), Some(t))?;
        Ok(Box::new(ThreadRecv::new(self, seq, op, t.device())))
    }

    fn all_gather_start(&self, t: &Tensor, dim: usize) -> Result<Box<dyn PendingRecv>> {
        let op = Op::AllGather { dim };
        let seq = self.start(op.clone(), Some(t))?;
        Ok(Box::new(ThreadRecv::new(self, seq, op, t.device())))
    }

    fn all_to_all(&self, t: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let (_, taken) = self.exchange(
            Op::AllToAll {
                split_dim,
                concat_dim,
            },
            Some(t),
        )?;
        let p = self.size();
        if p == 1 {
            return Ok(t.detach());
        }
        let dev = t.device();
        let parts = (0..p)
            .map(|r| chunk(tensor_of(&taken.entries, r)?, split_dim, self.rank, p)?.to_device(dev))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, concat_dim)
    }

    /// Native: each rank reads its rows straight from the others' tensors (no padding to the
    /// round's largest chunk, as the default does); the counts of every pair are checked
    /// against each other, on every rank.
    fn all_to_all_v(&self, t: &Tensor, send_rows: &[usize], recv_rows: &[usize]) -> Result<Tensor> {
        crate::group::check_all_to_all_v(self, t, send_rows, recv_rows)?;
        let op = Op::AllToAllV { send_rows: send_rows.to_vec(), recv_rows: recv_rows.to_vec() };
        let (_, taken) = self.exchange(op, Some(t))?;
        let (me, dev) = (self.rank, t.device());
        let mut parts = Vec::new();
        for (r, e) in taken.entries.iter().enumerate() {
            let (Op::AllToAllV { send_rows: theirs, .. }, Some(x)) = (&e.op, &e.tensor) else {
                candle_core::bail!("thread group {}: rank {r} took part in all_to_all_v without counts (internal error)", self.comm.label)
            };
            if recv_rows[r] > 0 {
                let off: usize = theirs[..me].iter().sum();
                parts.push(x.narrow(0, off, recv_rows[r])?.to_device(dev)?);
            }
        }
        if parts.is_empty() {
            // nothing received: one zero row (never a tensor without elements)
            return t.narrow(0, 0, 1)?.zeros_like();
        }
        Tensor::cat(&parts, 0)?.force_contiguous()
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let (_, taken) = self.exchange(Op::Broadcast { root }, Some(t))?;
        if root == self.rank {
            return Ok(t.detach());
        }
        fresh_on(tensor_of(&taken.entries, root)?, t.device())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange(Op::Barrier, None)?;
        Ok(())
    }

    fn send_recv(&self, t: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv>> {
        let op = Op::SendRecv { dst, src };
        let seq = self.start(op.clone(), Some(t))?;
        Ok(Box::new(ThreadRecv::new(self, seq, op, t.device())))
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn ProcessGroup>> {
        let (seq, taken) = self.exchange(Op::Split { color, key }, None)?;
        let mut members: Vec<(usize, usize)> = taken
            .entries
            .iter()
            .enumerate()
            .filter_map(|(r, e)| match e.op {
                Op::Split { color: c, key: k } if c == color => Some((k, r)),
                _ => None,
            })
            .collect();
        members.sort();
        let Some(new_rank) = members.iter().position(|&(_, r)| r == self.rank) else {
            candle_core::bail!(
                "thread group {}: split: rank {} not in its own color (internal error)",
                self.comm.label,
                self.rank
            )
        };
        let comm = lock(&taken.shared.subcomms)
            .entry(color)
            .or_insert_with(|| {
                let world_ranks = members.iter().map(|&(_, r)| self.comm.members[r]).collect();
                let label = format!("split#{seq}(color={color}) of {}", self.comm.label);
                Comm::new(self.comm.world.clone(), world_ranks, label)
            })
            .clone();
        Ok(Arc::new(Self::on(comm, new_rank, self.device.clone())))
    }

    fn describe(&self) -> String {
        format!(
            "thread group {} (rank {} of {})",
            self.comm.label,
            self.rank,
            self.size()
        )
    }
}

/// The sum over the round's entries in rank order, computed once (by whichever rank gets
/// here first) so every rank gets the same bits.
fn sum_once(label: &str, taken: &Taken, dev: &Device) -> Result<Tensor> {
    let sum = taken.shared.reduced.get_or_init(|| {
        sum_in_order(&taken.entries.iter().flat_map(|e| e.tensor.clone()).collect::<Vec<_>>(), dev)
            .map_err(|e| e.to_string())
    });
    match sum {
        Ok(s) => fresh_on(s, dev),
        Err(e) => Err(Error::Msg(format!("thread group {label}: all_reduce failed: {e}"))),
    }
}

/// The `p` ranks' entries on `dev`, concatenated along `dim` in rank order (an all-gather).
fn cat_entries(taken: &Taken, p: usize, dim: usize, dev: &Device) -> Result<Tensor> {
    let parts = (0..p).map(|r| tensor_of(&taken.entries, r)?.to_device(dev)).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, dim)
}

/// Chunk `rank` of every entry along `dim`, summed in rank order.
fn scatter_sum(taken: &Taken, dim: usize, rank: usize, p: usize, dev: &Device) -> Result<Tensor> {
    let parts = (0..p)
        .map(|r| chunk(tensor_of(&taken.entries, r)?, dim, rank, p))
        .collect::<Result<Vec<_>>>()?;
    sum_in_order(&parts, dev)
}

/// Pending result of a [`ThreadGroup::send_recv`] (a ring step), `all_reduce_start`,
/// `reduce_scatter_start` or `all_gather_start`: this rank's tensor is already deposited;
/// `wait` picks up the round once every rank of the group has deposited its own.
struct ThreadRecv {
    comm: Arc<Comm>,
    seq: u64,
    rank: usize,
    op: Op,
    device: Device,
    done: bool,
}

impl ThreadRecv {
    fn new(g: &ThreadGroup, seq: u64, op: Op, device: &Device) -> Self {
        Self { comm: g.comm.clone(), seq, rank: g.rank, op, device: device.clone(), done: false }
    }
}

impl PendingRecv for ThreadRecv {
    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        self.done = true;
        let taken = self.comm.take(self.seq, self.rank, &self.op)?;
        check_round(&self.comm.label, self.seq, &taken.entries)?;
        let p = self.comm.size();
        match self.op {
            Op::SendRecv { src, .. } => fresh_on(tensor_of(&taken.entries, src)?, &self.device),
            Op::AllReduce if p == 1 => fresh_on(tensor_of(&taken.entries, 0)?, &self.device),
            Op::AllReduce => sum_once(&self.comm.label, &taken, &self.device),
            Op::ReduceScatter { dim } => scatter_sum(&taken, dim, self.rank, p, &self.device),
            Op::AllGather { dim } => cat_entries(&taken, p, dim, &self.device),
            ref op => Err(Error::Msg(format!("thread group {}: no pending result for {op} (internal error)", self.comm.label))),
        }
    }
}

impl Drop for ThreadRecv {
    fn drop(&mut self) {
        if !self.done {
            self.comm.release(self.seq, self.rank);
        }
    }
}

/// Run `f` on `p` thread ranks of a new world with default options (60 s timeout); element
/// `r` of the result is rank `r`'s result. See [`run_ranks_with`].
pub fn run_ranks<T: Send>(
    p: usize,
    f: impl Fn(Group) -> Result<T> + Send + Sync,
) -> Vec<Result<T>> {
    run_ranks_with(p, ThreadGroupOptions::default(), f)
}

/// Run `f` on `p` thread ranks (scoped threads named `rank-<r>`) of a new world.
///
/// A rank whose closure returns `Err` or panics (the panic is caught) aborts the world, so
/// the other ranks' pending or next collectives return `Err` promptly; a rank that returns
/// `Ok` is marked exited, so collectives still waiting for it fail at once. Element `r` of
/// the result is rank `r`'s result (a panic becomes `Err("rank r panicked: ...")`).
pub fn run_ranks_with<T: Send>(
    p: usize,
    opts: ThreadGroupOptions,
    f: impl Fn(Group) -> Result<T> + Send + Sync,
) -> Vec<Result<T>> {
    let stack_size = opts.stack_size;
    let (groups, handle) = ThreadGroup::new_world_with_handle(p, opts);
    let f = &f;
    let handle = &handle;
    std::thread::scope(|s| {
        let joins: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, g)| {
                let spawned = std::thread::Builder::new()
                    .name(format!("rank-{r}"))
                    .stack_size(stack_size)
                    .spawn_scoped(s, move || run_one(r, g, f, handle));
                if let Err(e) = &spawned {
                    handle.abort(r, format!("could not spawn its thread: {e}"));
                }
                (r, spawned)
            })
            .collect();
        joins
            .into_iter()
            .map(|(r, j)| match j {
                Ok(j) => j
                    .join()
                    .unwrap_or_else(|_| Err(Error::Msg(format!("rank {r} thread died")))),
                Err(e) => Err(Error::Msg(format!(
                    "rank {r}: could not spawn its thread: {e}"
                ))),
            })
            .collect()
    })
}

fn run_one<T>(
    r: usize,
    g: Group,
    f: &(impl Fn(Group) -> Result<T> + Sync),
    handle: &WorldHandle,
) -> Result<T> {
    let out = catch_unwind(AssertUnwindSafe(|| f(g)));
    match out {
        Ok(Ok(v)) => {
            handle.mark_exited(r);
            Ok(v)
        }
        Ok(Err(e)) => {
            handle.abort(r, format!("returned an error: {}", short(&reason(&e))));
            Err(e)
        }
        Err(payload) => {
            let msg = panic_message(&*payload);
            handle.abort(r, format!("panicked: {}", short(&msg)));
            Err(Error::Msg(format!("rank {r} panicked: {msg}")))
        }
    }
}

/// An error's message without its backtrace (formatting a captured backtrace resolves
/// symbols, which can take a long time, and abort reasons are repeated on every rank).
fn reason(e: &Error) -> String {
    match e {
        Error::WithBacktrace { inner, .. } => reason(inner),
        Error::Context { inner, context } => format!("{context}: {}", reason(inner)),
        Error::WithPath { inner, path } => format!("path {path:?}: {}", reason(inner)),
        e => e.to_string(),
    }
}

/// A message on one line, at most 400 characters.
fn short(msg: &str) -> String {
    let line = msg.lines().collect::<Vec<_>>().join(" / ");
    if line.chars().count() > 400 {
        format!("{}...", line.chars().take(400).collect::<String>())
    } else {
        line
    }
}

/// The text of a panic payload (`&str` or `String`; anything else is named as such).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_string())
}

