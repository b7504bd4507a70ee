//! [`NcclGroup`]: the [`ProcessGroup`] collectives over NCCL (cudarc's bindings, re-exported
//! by candle-core as `candle_core::cuda_backend::cudarc`). Feature `nccl`.
//!
//! - Every collective runs on a dedicated **communication stream**. Before it, the comm stream
//!   waits for the compute stream (candle's stream of the group's device) with an event; after
//!   a blocking collective the compute stream waits for the comm stream, so the result is safe
//!   to use from candle. [`ProcessGroup::send_recv`] does not make the compute stream wait:
//!   its [`PendingRecv::wait`] does, so compute issued in between overlaps the transfer.
//! - Ring send/recv and all-to-all are grouped NCCL send/recv (`ncclGroupStart/End`); NCCL
//!   has no all-to-all. all-gather / reduce-scatter along a dim other than 0 reorder the data
//!   with candle ops (a transpose copy) around NCCL's flat collectives.
//! - Bootstrap: [`NcclGroup::from_env`] (one process per GPU: `RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`; the NCCL unique id goes from rank 0 to the
//!   others through [`crate::rendezvous`]: a TCP store on `MASTER_ADDR:MASTER_PORT`, or a shared
//!   file), [`NcclGroup::new`] / [`NcclGroup::with_timeout`] (you pass the id),
//!   or [`NcclGroup::single_process`] / [`run_nccl_ranks`] (one thread per GPU in one process).
//! - Tensors live on the group's GPU. Host (CPU) tensors are accepted too, like
//!   [`crate::ThreadGroup`] does: they are copied to the GPU and the result comes back to the
//!   host (two copies; meant for small bookkeeping tensors such as loss sums and norms). A
//!   tensor on another GPU is an error naming its shape and device.
//! - NCCL refuses two ranks on the same GPU: several ranks on one GPU use
//!   [`crate::ThreadGroup`] with a CUDA device instead (virtual ranks).
//!
//! # Failures never hang: timeout, poison, abort
//!
//! Each group has a **timeout** ([`DEFAULT_TIMEOUT`] = 300 s unless given to
//! [`NcclGroup::with_timeout`], [`NcclGroup::from_env`] or [`NcclGroup::single_process_with_timeout`];
//! change it with [`NcclGroup::set_timeout`]). The communicator is created non-blocking
//! (`ncclConfig_t.blocking = 0`), so:
//! - **init** waits at most the timeout for the other ranks to join; a rank that never joins
//!   makes `new`/`from_env`/`split` return `Err` (naming the rank, world size and elapsed time)
//!   instead of blocking forever;
//! - **each call** returns once NCCL has enqueued its GPU work, waiting at most the timeout;
//! - a per-group **watchdog thread** ([`crate::watchdog`]) checks every `poll` (50 ms) that the
//!   oldest enqueued collective completes on the GPU within the timeout and that
//!   `ncclCommGetAsyncError` stays clean (errors NCCL detects: network/proxy failures, e.g.
//!   a peer on another node that exits; a dead peer within the node, over NVLink/PCIe, is
//!   not reported there and is caught by the timeout, see NVIDIA/nccl#279).
//!
//! On a timeout or an NCCL error the group is **poisoned** (its first failure is recorded),
//! then the communicator is **aborted** (`ncclCommAbort`): NCCL kernels still spinning on the
//! GPU exit, so a host sync that waited on them (`to_vec1`, `synchronize`) returns. From then
//! on every call on the group returns `Err` at once, naming the call and the first failure.
//! The results of collectives that were in flight at the abort are undefined: treat a poisoned
//! group as fatal for the step, and call [`NcclGroup::synchronize`] (or
//! [`ProcessGroup::barrier`]) where you need to know that everything so far succeeded. A rank
//! that fails in [`run_nccl_ranks`] aborts the other ranks' groups at once.
//! The timeout counts from the moment a collective is enqueued, so it must exceed the longest
//! GPU work queued ahead of a collective plus the longest time ranks may drift apart.

mod boot;
mod process_group;
mod raw;

pub use boot::{run_nccl_env_rank, run_nccl_ranks, run_nccl_ranks_with_timeout, RANK_STACK};

use crate::watchdog::{poll_until, PollEnd, Watchdog, WatchdogOptions};
use crate::{PendingRecv, ProcessGroup};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::sys::{self, ncclResult_t as R};
use candle_core::cuda_backend::cudarc::nccl::{Id, NcclType};
use candle_core::cuda_backend::WrapErr;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Shape, Storage, Tensor};
use raw::RawComm;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default timeout of an [`NcclGroup`]: how long init waits for every rank to join, and how
/// long one collective may stay enqueued before the group is aborted (see the module docs).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Dtype dispatch for the NCCL-supported dtypes.
macro_rules! dispatch {
    ($dt:expr, $what:expr, $go:ident) => {
        match $dt {
            DType::F32 => $go!(f32),
            DType::F64 => $go!(f64),
            DType::F16 => $go!(half::f16),
            DType::BF16 => $go!(half::bf16),
            DType::U8 => $go!(u8),
            DType::U32 => $go!(u32),
            DType::I64 => $go!(i64),
            dt => candle_core::bail!("{}: dtype {dt:?} not supported by NcclGroup", $what),
        }
    };
}

/// A rank of an NCCL communicator, as a [`ProcessGroup`]. Tensors must live on
/// [`NcclGroup::device`]. Never hangs on a dead peer: see the module docs (timeout, poison,
/// abort).
pub struct NcclGroup {
    raw: Arc<RawComm>,
    watchdog: Watchdog<RawComm>,
    rank: usize,
    size: usize,
    device: CudaDevice,
    comm_stream: Arc<CudaStream>,
}

impl NcclGroup {
    /// Join communicator `id` as `rank` of `world_size`, on `device` (the compute device), with
    /// the [`DEFAULT_TIMEOUT`]. Returns once all `world_size` ranks have joined, or `Err` after
    /// the timeout.
    pub fn new(device: &CudaDevice, rank: usize, world_size: usize, id: Id) -> Result<Self> {
        Self::with_timeout(device, rank, world_size, id, DEFAULT_TIMEOUT)
    }

    /// [`NcclGroup::new`] with `timeout` for init and every later collective.
    pub fn with_timeout(device: &CudaDevice, rank: usize, world_size: usize, id: Id, timeout: Duration) -> Result<Self> {
        if rank >= world_size {
            candle_core::bail!("NcclGroup::new: rank {rank} out of range for world size {world_size}")
        }
        let ctx = device.cuda_stream().context().clone();
        let comm_stream = ctx.new_stream().w()?;
        let raw = RawComm::init_rank(&ctx, rank, world_size, sys::ncclUniqueId { internal: *id.internal() }, timeout)?;
        Self::assemble(Arc::new(raw), rank, world_size, device.clone(), comm_stream)
    }

    /// Wrap an initialised communicator and start its watchdog.
    fn assemble(raw: Arc<RawComm>, rank: usize, size: usize, device: CudaDevice, comm_stream: Arc<CudaStream>) -> Result<Self> {
        let mut opts = WatchdogOptions::new(raw.timeout(), raw.label.clone());
        opts.thread_name = format!("nccl-watchdog-{rank}");
        let watchdog = Watchdog::spawn(raw.clone(), raw.poison.clone(), opts)?;
        Ok(Self { raw, watchdog, rank, size, device, comm_stream })
    }

    /// The candle device the group computes on (create tensors here).
    pub fn device(&self) -> Device {
        Device::Cuda(self.device.clone())
    }

    /// The group's timeout (see the module docs).
    pub fn timeout(&self) -> Duration {
        self.raw.timeout()
    }

    /// Change the timeout for later calls and for the watchdog (outstanding collectives
    /// included, counted from their enqueue time).
    pub fn set_timeout(&self, timeout: Duration) {
        self.raw.set_timeout(timeout);
        self.watchdog.set_timeout(timeout);
    }

    /// The group's first failure, once it has failed (every call then returns `Err`).
    pub fn failure(&self) -> Option<String> {
        self.raw.poison.reason()
    }

    /// Poison the group with `reason` and abort its communicator: in-flight NCCL work stops,
    /// and every later call returns `Err`. What [`run_nccl_ranks`] does to every rank when one
    /// fails; launchers managing their own threads can do the same. Idempotent.
    pub fn abort(&self, reason: &str) {
        self.raw.fail(format!("{}: aborted: {reason}", self.raw.label));
    }

    /// Wait (at most the timeout) until every collective enqueued so far has completed on the
    /// GPU. `Err` if the group has failed (now or earlier) or the wait times out (which aborts
    /// the group).
    pub fn synchronize(&self) -> Result<()> {
        self.sync_op("synchronize")
    }

    fn sync_op(&self, op: &str) -> Result<()> {
        self.healthy(op)?;
        let ev = self.comm_stream.record_event(None).w()?;
        let start = Instant::now();
        let timeout = self.timeout();
        match poll_until(start + timeout, Some(&self.raw.poison), || ev.try_is_complete()) {
            // an abort also completes the work, hence the health check after completion
            Ok(()) | Err(PollEnd::Poisoned) => self.healthy(op),
            Err(PollEnd::Failed(e)) => {
                let msg = format!("{}: {op}: CUDA event query failed: {e:?}", self.raw.label);
                self.raw.fail(msg.clone());
                candle_core::bail!("{msg}")
            }
            Err(PollEnd::Timeout) => {
                let msg = format!(
                    "{}: {op}: enqueued NCCL work did not complete within the timeout {timeout:?} \
                     (waited {:.3?}); communicator aborted, the group is unusable",
                    self.raw.label,
                    start.elapsed()
                );
                self.raw.fail(msg.clone());
                candle_core::bail!("{msg}")
            }
        }
    }

    fn compute(&self) -> Arc<CudaStream> {
        self.device.cuda_stream()
    }

    /// `Err` naming `op` once the group is poisoned.
    fn healthy(&self, op: &str) -> Result<()> {
        self.raw.refuse_if_failed(op)
    }

    /// Comm stream waits for the compute stream (inputs and fresh outputs are ready).
    fn enter(&self) -> Result<()> {
        self.comm_stream.join(&self.compute()).w()
    }

    /// Event after everything queued on the comm stream so far, handed to the watchdog as
    /// `op`; with `join`, the compute stream also waits for it.
    fn leave(&self, op: String, join: bool) -> Result<Arc<CudaEvent>> {
        let ev = Arc::new(self.comm_stream.record_event(None).w()?);
        // tracked before the stream wait: where that wait blocks the host (the CPU shim's
        // eager streams), the watchdog must already be timing the collective to abort it
        self.watchdog.track(op, ev.clone());
        if join {
            self.compute().wait(&ev).w()?;
        }
        Ok(ev)
    }

    /// `t` on the group's GPU, contiguous, and whether it came from the host (then the result
    /// goes back there, see [`Self::back`]). A tensor on another GPU is an error.
    fn check(&self, t: &Tensor, op: &str) -> Result<(Tensor, bool)> {
        self.healthy(op)?;
        crate::ensure_nonempty(op, "tensor", t)?;
        match t.device() {
            Device::Cuda(d) if d.same_device(&self.device) => Ok((t.contiguous()?, false)),
            Device::Cpu => Ok((t.to_device(&self.device())?.contiguous()?, true)),
            other => candle_core::bail!("{op}: tensor {:?} is on {other:?}, the group's device is {:?}", t.shape(), self.device),
        }
    }

    /// A result back on the host when its input came from there, checked: the copy waits for
    /// the collective, then a group that failed meanwhile (a dead peer, an abort) or an error
    /// NCCL reports for the communicator makes this `Err` instead of handing out what the
    /// failed collective left in the buffer.
    fn back(&self, r: Tensor, host: bool, op: &str) -> Result<Tensor> {
        back_checked(&self.raw, r, host, op)
    }

    /// A reduce-scatter's flat input (the chunks along `dim` made rank-major when `dim` is not
    /// the outermost) and its output shape (`dim` divided by the group size).
    fn scatter_input(&self, t: &Tensor, dim: usize, op: &str) -> Result<(Tensor, Shape)> {
        let (a, n, e) = around(t.dims(), dim, op)?;
        let p = self.size;
        if n % p != 0 {
            candle_core::bail!("{op}: dim {dim} of {:?} must divide by the group size {p}", t.shape())
        }
        let packed = if a == 1 { t.clone() } else { t.reshape((a, p, n / p * e))?.transpose(0, 1)?.contiguous()? };
        let mut dims = t.dims().to_vec();
        dims[dim] /= p;
        Ok((packed, Shape::from(dims)))
    }

    /// The pending result `out` of `op`, written on the comm stream until `event`; `send` (the
    /// input) stays alive until then.
    fn pending(&self, op: &'static str, out: Tensor, host: bool, event: Arc<CudaEvent>, send: Tensor) -> Box<NcclRecv> {
        Box::new(NcclRecv { op, out: Some(out), host, event, compute: self.compute(), raw: self.raw.clone(), _send: send, then: None })
    }

    /// Flat NCCL collective from `src` (contiguous) into a fresh buffer of the same dtype with
    /// `out_shape`'s element count; the compute stream waits for it.
    fn flat(&self, src: &Tensor, out_shape: Shape, kind: Flat) -> Result<Tensor> {
        Ok(self.flat_with(src, out_shape, kind, true)?.0)
    }

    /// [`Self::flat`]; with `join` false the compute stream does not wait: the returned event
    /// (recorded on the comm stream after the collective) is what a consumer must wait for.
    fn flat_with(&self, src: &Tensor, out_shape: Shape, kind: Flat, join: bool) -> Result<(Tensor, Arc<CudaEvent>)> {
        let n = out_shape.elem_count();
        let op = format!("{} {:?} {:?}", kind.name(), src.dims(), src.dtype());
        let storage = {
            let (ss, sl) = src.storage_and_layout();
            let Storage::Cuda(ss) = &*ss else { candle_core::bail!("{}: input is not on a CUDA device", kind.name()) };
            let Some((a, b)) = sl.contiguous_offsets() else {
                candle_core::bail!("{}: input {:?} is not contiguous", kind.name(), src.shape())
            };
            macro_rules! go {
                ($ty:ty) => {{
                    let s = ss.as_cuda_slice::<$ty>()?.slice(a..b);
                    let mut o = self.device.alloc_zeros::<$ty>(n)?;
                    self.enter()?;
                    let stream = &*self.comm_stream;
                    let cs = stream.cu_stream() as sys::cudaStream_t;
                    let dt = <$ty as NcclType>::as_nccl_type();
                    let count_in = s.len();
                    // The guards record cudarc's read/write events when dropped, which must be
                    // after NCCL has enqueued its kernel: `call` returns only then.
                    let (sp, _src_guard) = s.device_ptr(stream);
                    let (dp, _dst_guard) = o.device_ptr_mut(stream);
                    let (sp, dp) = (sp as *const c_void, dp as *mut c_void);
                    let sum = sys::ncclRedOp_t::ncclSum;
                    // SAFETY: sp/dp point to live device buffers of this group's device (the
                    // input view with `count_in` elements, the fresh output with `n`), which
                    // outlive the call (and stay alive until the compute stream, which frees
                    // them, has waited for the comm stream); sizes match NCCL's contract for
                    // each collective (all-gather: n = P·count_in; reduce-scatter: count_in =
                    // P·n; the others: n = count_in); cs is the comm stream of this context.
                    unsafe {
                        self.raw.call(&op, |comm| match kind {
                            Flat::AllGather => sys::ncclAllGather(sp, dp, count_in, dt, comm, cs),
                            Flat::AllReduce => sys::ncclAllReduce(sp, dp, count_in, dt, sum, comm, cs),
                            Flat::ReduceScatter => sys::ncclReduceScatter(sp, dp, n, dt, sum, comm, cs),
                            Flat::Broadcast(root) => sys::ncclBroadcast(sp, dp, n, dt, root as c_int, comm, cs),
                        })?;
                    }
                    drop((_src_guard, _dst_guard));
                    CudaStorage::wrap_cuda_slice(o, self.device.clone())
                }};
            }
            dispatch!(src.dtype(), kind.name(), go)
        };
        let ev = self.leave(op, join)?;
        Ok((Tensor::from_storage(Storage::Cuda(storage), out_shape, BackpropOp::none(), false), ev))
    }

    /// Grouped send/recv: send `sends[i] = (tensor, peer)`, receive into fresh tensors shaped
    /// like `recvs[i] = (shape, peer)`. Returns the received tensors and an event recorded on
    /// the comm stream after the group (the compute stream is NOT made to wait).
    fn p2p(&self, name: &str, sends: &[(Tensor, usize)], recvs: &[(Shape, usize)], dtype: DType) -> Result<(Vec<Tensor>, Arc<CudaEvent>)> {
        let op = match sends.first() {
            Some((t, _)) => format!("{name} {:?} {dtype:?}", t.dims()),
            None => name.to_string(),
        };
        let sg: Vec<_> = sends.iter().map(|(t, _)| t.storage_and_layout()).collect();
        macro_rules! go {
            ($ty:ty) => {{
                let mut views = Vec::with_capacity(sends.len());
                for ((st, l), (t, _)) in sg.iter().zip(sends) {
                    let Storage::Cuda(c) = &**st else { candle_core::bail!("{name}: tensor {:?} is not on CUDA", t.shape()) };
                    let Some((a, b)) = l.contiguous_offsets() else {
                        candle_core::bail!("{name}: tensor {:?} is not contiguous", t.shape())
                    };
                    views.push(c.as_cuda_slice::<$ty>()?.slice(a..b));
                }
                let mut bufs = recvs
                    .iter()
                    .map(|(s, _)| self.device.alloc_zeros::<$ty>(s.elem_count()))
                    .collect::<Result<Vec<_>>>()?;
                self.enter()?;
                let stream = &*self.comm_stream;
                let cs = stream.cu_stream() as sys::cudaStream_t;
                let dt = <$ty as NcclType>::as_nccl_type();
                // (pointer, count, peer); guards kept until NCCL has enqueued (see `flat`)
                let (src, src_guards): (Vec<_>, Vec<_>) = views
                    .iter()
                    .zip(sends)
                    .map(|(v, (_, peer))| {
                        let (p, g) = v.device_ptr(stream);
                        ((p as *const c_void, v.len(), *peer as c_int), g)
                    })
                    .unzip();
                let (dst, dst_guards): (Vec<_>, Vec<_>) = bufs
                    .iter_mut()
                    .zip(recvs)
                    .map(|(b, (_, peer))| {
                        let count = b.len();
                        let (p, g) = b.device_ptr_mut(stream);
                        ((p as *mut c_void, count, *peer as c_int), g)
                    })
                    .unzip();
                // SAFETY: every pointer is a live device buffer on this group's device with the
                // given element count, alive until `call` returns (and until the compute stream
                // waits for the comm stream before reusing them); peers are < size (checked by
                // the callers); the group is opened and closed inside the closure, under the
                // communicator lock, on this thread; cs is this context's comm stream.
                unsafe {
                    self.raw.call(&op, |comm| {
                        let s = sys::ncclGroupStart();
                        if s != R::ncclSuccess {
                            return s;
                        }
                        let mut first = R::ncclSuccess;
                        let ok = |r: R| r == R::ncclSuccess || r == R::ncclInProgress;
                        for &(p, count, peer) in &src {
                            if first == R::ncclSuccess {
                                let r = sys::ncclSend(p, count, dt, peer, comm, cs);
                                if !ok(r) {
                                    first = r;
                                }
                            }
                        }
                        for &(p, count, peer) in &dst {
                            if first == R::ncclSuccess {
                                let r = sys::ncclRecv(p, count, dt, peer, comm, cs);
                                if !ok(r) {
                                    first = r;
                                }
                            }
                        }
                        let end = sys::ncclGroupEnd();
                        if first != R::ncclSuccess {
                            first
                        } else {
                            end
                        }
                    })?;
                }
                drop((src_guards, dst_guards));
                bufs.into_iter()
                    .zip(recvs)
                    .map(|(b, (s, _))| {
                        let st = CudaStorage::wrap_cuda_slice(b, self.device.clone());
                        Tensor::from_storage(Storage::Cuda(st), s.clone(), BackpropOp::none(), false)
                    })
                    .collect::<Vec<_>>()
            }};
        }
        let outs = dispatch!(dtype, name, go);
        drop(sg);
        let ev = self.leave(op, false)?;
        Ok((outs, ev))
    }
}

impl Drop for NcclGroup {
    /// Waits (at most the timeout) for enqueued work to finish, with the watchdog still
    /// running (so an asynchronous NCCL error ends the wait early), stops the watchdog, then
    /// the communicator is aborted (`RawComm`'s drop; never destroyed, which may wait on peers).
    fn drop(&mut self) {
        if !self.raw.poison.is_poisoned() {
            if let Err(e) = self.sync_op("drop") {
                eprintln!("candle-cp: {e}");
            }
        }
        self.watchdog.stop();
    }
}

#[derive(Clone, Copy)]
enum Flat {
    AllGather,
    AllReduce,
    ReduceScatter,
    Broadcast(usize),
}

impl Flat {
    fn name(&self) -> &'static str {
        match self {
            Flat::AllGather => "all_gather",
            Flat::AllReduce => "all_reduce",
            Flat::ReduceScatter => "reduce_scatter",
            Flat::Broadcast(_) => "broadcast",
        }
    }
}

/// `[d0.., N, ..]` viewed as `(A, N, E)` around `dim`.
fn around(dims: &[usize], dim: usize, op: &str) -> Result<(usize, usize, usize)> {
    if dim >= dims.len() {
        candle_core::bail!("{op}: dim {dim} out of range for shape {dims:?}")
    }
    Ok((dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product()))
}

/// An all-gather's flat result `[p, a, n·e]` (rank-major) → the input's dims with `dim`
/// multiplied by `p` (`a`: the elements before `dim`).
fn gathered(g: Tensor, a: usize, dims: &[usize], dim: usize, p: usize) -> Result<Tensor> {
    let mut dims = dims.to_vec();
    dims[dim] *= p;
    if a == 1 { g.reshape(dims) } else { g.transpose(0, 1)?.contiguous()?.reshape(dims) }
}

/// See [`NcclGroup::back`].
fn back_checked(raw: &RawComm, r: Tensor, host: bool, op: &str) -> Result<Tensor> {
    if !host {
        return Ok(r);
    }
    let r = r.to_device(&Device::Cpu)?;
    raw.refuse_if_failed(op)?;
    if let Err(e) = raw.async_error() {
        let msg = format!("{}: {op}: NCCL reported an error for the communicator: {e}; communicator aborted, the result is invalid", raw.label);
        raw.fail(msg.clone());
        candle_core::bail!("{msg}")
    }
    Ok(r)
}

/// Pending result of `send_recv`, `all_reduce_start`, `reduce_scatter_start` or
/// `all_gather_start`: the output buffer, written on the comm stream until `event`.
struct NcclRecv {
    op: &'static str,
    out: Option<Tensor>,
    host: bool, // the sent tensor came from the host: so does the received one
    /// Layout fix-up of the received buffer on the compute stream (all-gather), after the wait.
    then: Option<Box<dyn FnOnce(Tensor) -> Result<Tensor> + Send>>,

    event: Arc<CudaEvent>,
    compute: Arc<CudaStream>,
    raw: Arc<RawComm>,
    _send: Tensor,
}

impl PendingRecv for NcclRecv {
    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        self.compute.wait(&self.event).w()?;
        let what = format!("{} wait", self.op);
        self.raw.refuse_if_failed(&what)?;
        let out = self.out.take().ok_or_else(|| candle_core::Error::Msg(format!("{}: result already taken", self.op)))?;
        let out = match self.then.take() {
            Some(f) => f(out)?,
            None => out,
        };
        back_checked(&self.raw, out, self.host, &what)
    }
}

impl Drop for NcclRecv {
    /// Unwaited receive: the compute stream (which frees the buffers) still waits for the
    /// transfer, so NCCL never writes into freed memory.
    fn drop(&mut self) {
        if self.out.is_some() {
            let _ = self.compute.wait(&self.event);
        }
    }
}
