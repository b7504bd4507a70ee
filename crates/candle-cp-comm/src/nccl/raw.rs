//! [`RawComm`]: one NCCL communicator, created **non-blocking** (`ncclConfig_t.blocking = 0`), so
//! that no NCCL call can block the calling thread without bound:
//!
//! - init (`ncclCommInitRankConfig`, or a group of them for several GPUs of one process) and
//!   every later call may return `ncclInProgress`; we then poll `ncclCommGetAsyncError` until it
//!   reads `ncclSuccess` (the GPU work is now enqueued) or an error, up to a deadline;
//! - on a deadline, an error, or an explicit [`RawComm::fail`], the group is poisoned first and
//!   then the communicator is aborted (`ncclCommAbort`): NCCL's kernels see the abort flag and
//!   exit, so host synchronisations waiting on them return. The handle is nulled, and every
//!   later call is refused by the poison check.
//!
//! Concurrency: NCCL communicators are not thread-safe, so every NCCL call on this
//! communicator, including `ncclCommGetAsyncError` and `ncclCommAbort` from the watchdog
//! thread, is made while holding `handle`'s mutex: no two NCCL calls on one communicator ever
//! overlap (stricter than NCCL's fault-tolerance model, which lets another thread abort a
//! communicator at any point; we do not rely on that). Callers hold the mutex only for bounded
//! time: the enqueue calls return at once in non-blocking mode, and the in-progress poll stops
//! at the deadline, or as soon as another thread has poisoned the group (that thread then
//! waits for the mutex to abort; the caller aborts first); the watchdog only `try_lock`s for
//! its status checks. `ncclGroupStart/End` state is per thread, and a group is opened and
//! closed within one locked section. `ncclCommAbort` is synchronous even for a non-blocking
//! communicator (NCCL runs the reclaim of a destroyed/aborted communicator as a blocking
//! group) and joins an init or launch still in progress after raising the abort flag; the
//! handle is never used again. CUDA driver calls (event query/record, context binding) are
//! thread-safe.
//!
//! NCCL return codes are read through cudarc's `ncclResult_t` Rust enum (codes 0..=9 of NCCL
//! 2.30); a future library returning a code outside that range would break this assumption.
//!
//! Fallback: if NCCL rejects the non-blocking config (`ncclInvalidArgument`/`ncclInvalidUsage`,
//! returned before any rank is contacted, so the unique id is still unused), we print a warning
//! and create a blocking communicator as before this module existed. Then init and enqueue calls
//! are not bounded by the timeout, and an abort waits for a blocked call to return (it holds
//! the mutex); the watchdog still aborts on stuck GPU work and asynchronous errors.

use crate::watchdog::{poll_until, Poison, PollEnd, Watchable};
use candle_core::cuda_backend::cudarc::driver::result::{ctx as driver_ctx, DriverError};
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent};
use candle_core::cuda_backend::cudarc::nccl::sys::{self, ncclResult_t as R};
use candle_core::{Error, Result};
use std::ffi::{c_int, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `NCCL_VERSION(2, 30, 0)`: the header version whose `ncclConfig_t` layout cudarc's
/// `nccl-02030` bindings (the feature candle's `nccl` selects) describe.
const CONFIG_VERSION: u32 = 2 * 10000 + 30 * 100;
/// `NCCL_API_MAGIC`, checked by NCCL to tell an initialised config from garbage.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): "not set, use NCCL's default".
const UNDEF_INT: c_int = c_int::MIN;

/// `NCCL_CONFIG_INITIALIZER` for the compiled-in layout, with `blocking = 0`.
///
/// Every field is listed, so a cudarc upgrade that changes the layout fails to compile here
/// instead of passing NCCL a half-initialised struct. NCCL reads `min(size, its own size)`
/// bytes and resets fields newer than `version` to their defaults, so a runtime library older
/// or newer than 2.30 reads this correctly (fields are only ever appended).
fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

// The C layout of NCCL 2.30's `ncclConfig_v22800` on LP64 (size_t/pointers 8 bytes, int 4),
// as laid out by nccl.h: checked at compile time against the bindings we pass to NCCL.
#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{offset_of, size_of};
    type C = sys::ncclConfig_t;
    assert!(offset_of!(C, size) == 0 && offset_of!(C, magic) == 8 && offset_of!(C, version) == 12);
    assert!(offset_of!(C, blocking) == 16 && offset_of!(C, maxCTAs) == 28 && offset_of!(C, netName) == 32);
    assert!(offset_of!(C, splitShare) == 40 && offset_of!(C, commName) == 48 && offset_of!(C, nvlsCTAs) == 68);
    assert!(offset_of!(C, maxP2pPeers) == 88 && size_of::<C>() == 96);
};

/// `ncclFoo (NCCL's description)`.
pub(crate) fn describe(code: R) -> String {
    // SAFETY: ncclGetErrorString takes any code by value and returns a pointer to a static,
    // NUL-terminated string (or null, handled).
    let p = unsafe { sys::ncclGetErrorString(code) };
    if p.is_null() {
        return format!("{code:?}");
    }
    // SAFETY: non-null, NUL-terminated, static lifetime (see above); copied at once.
    let text = unsafe { CStr::from_ptr(p) }.to_string_lossy();
    format!("{code:?} ({text})")
}

/// NCCL's last error message (`ncclGetLastError`), if any.
///
/// # Safety
/// `comm` must be null or a live communicator of this process.
unsafe fn last_error(comm: sys::ncclComm_t) -> String {
    // SAFETY (of the call): comm is live or null (the argument is unused by current NCCL). The
    // result points into a process-wide NUL-terminated buffer that NCCL rewrites on each
    // warning; another thread's warning can at worst tear the text, never overrun the buffer
    // (it stays NUL-terminated at its end).
    let p = sys::ncclGetLastError(comm);
    if p.is_null() {
        return String::new();
    }
    CStr::from_ptr(p).to_string_lossy().trim().to_string()
}

/// Why a call failed (formatted by [`RawComm::fail_call`]).
pub(crate) enum Fail {
    /// Still `ncclInProgress` at the deadline.
    Timeout,
    /// NCCL returned / reported this error.
    Nccl(R),
    /// Another thread (the watchdog, [`RawComm::fail`]) poisoned the group while this call was
    /// still in progress; it then waits for the lock to abort, so the call must stop waiting.
    Poisoned,
}

/// The communicator handle; null once aborted.
struct Handle(sys::ncclComm_t);
// SAFETY: the handle is only used while holding the Mutex around it (one thread at a time),
// which is all NCCL requires to use a communicator from several threads.
unsafe impl Send for Handle {}

/// Poll `ncclCommGetAsyncError` until the communicator leaves `ncclInProgress` (see
/// [`poll_until`] for the waiting); stop early (`Fail::Poisoned`) once `poison` is set by
/// another thread.
///
/// In non-blocking mode every call returns `ncclInProgress`: `ncclGroupEnd` (explicit, or
/// inside each collective) launches the work from a helper thread it creates per call, and
/// the `ncclCommGetAsyncError` that first reads `ncclSuccess` joins that thread.
///
/// # Safety
/// `comm` must be a live communicator not used concurrently by another thread.
unsafe fn wait_ready(comm: sys::ncclComm_t, deadline: Instant, poison: Option<&Poison>) -> std::result::Result<(), Fail> {
    let poll = || {
        let mut state = R::ncclSuccess;
        // SAFETY: comm is live and exclusively ours (caller contract); `state` is a valid
        // out-pointer for the duration of the call.
        let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        match (r, state) {
            (R::ncclSuccess, R::ncclSuccess) => Ok(true),
            (R::ncclSuccess, R::ncclInProgress) => Ok(false),
            (R::ncclSuccess, e) | (e, _) => Err(e),
        }
    };
    poll_until(deadline, poison, poll).map_err(|end| match end {
        PollEnd::Failed(e) => Fail::Nccl(e),
        PollEnd::Poisoned => Fail::Poisoned,
        PollEnd::Timeout => Fail::Timeout,
    })
}

/// One NCCL communicator (see the module docs).
pub(crate) struct RawComm {
    handle: Mutex<Handle>,
    ctx: Arc<CudaContext>,
    pub(crate) poison: Poison,
    /// `"nccl rank 0 of 2 (cuda:0)"`, the prefix of every message.
    pub(crate) label: String,
    /// Whether this is the blocking fallback (see the module docs).
    pub(crate) blocking: bool,
    timeout_ns: AtomicU64,
}

pub(crate) fn label(rank: usize, size: usize, ordinal: usize) -> String {
    format!("nccl rank {rank} of {size} (cuda:{ordinal})")
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl RawComm {
    fn wrap(comm: sys::ncclComm_t, ctx: Arc<CudaContext>, label: String, blocking: bool, timeout: Duration) -> Self {
        Self {
            handle: Mutex::new(Handle(comm)),
            ctx,
            poison: Poison::new(),
            label,
            blocking,
            timeout_ns: AtomicU64::new(duration_ns(timeout)),
        }
    }

    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    pub(crate) fn set_timeout(&self, t: Duration) {
        self.timeout_ns.store(duration_ns(t), Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, Handle> {
        self.handle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Join communicator `id` as `rank` of `size` on `ctx`'s device, waiting at most `timeout`
    /// for the other ranks (then the half-made communicator is aborted and this returns `Err`).
    pub(crate) fn init_rank(ctx: &Arc<CudaContext>, rank: usize, size: usize, id: sys::ncclUniqueId, timeout: Duration) -> Result<Self> {
        let ordinal = ctx.ordinal();
        let label = label(rank, size, ordinal);
        let (n, r) = (to_int(size, "world size")?, to_int(rank, "rank")?);
        // ncclCommInitRank* takes the device from the calling thread's current context.
        ctx.bind_to_thread().map_err(|e| Error::Msg(format!("{label}: init: binding the CUDA context: {e:?}")))?;
        let start = Instant::now();
        let mut cfg = nonblocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `cfg` are valid for writes/reads for the duration of the call and
        // `cfg` stays alive (and unmoved) until this function returns, after the init has
        // finished or been aborted (NCCL copies the config during the call; keeping it alive
        // longer is only a precaution). `id` is passed by value.
        let code = unsafe { sys::ncclCommInitRankConfig(&mut comm, n, id, r, &mut cfg) };
        let result = match code {
            R::ncclSuccess => Ok(()),
            // SAFETY: comm was written by NCCL (non-null with ncclInProgress) and is used by
            // this thread only until returned.
            R::ncclInProgress if !comm.is_null() => unsafe { wait_ready(comm, start + timeout, None) },
            R::ncclInvalidArgument | R::ncclInvalidUsage if comm.is_null() => {
                eprintln!(
                    "candle-cp: {label}: NCCL rejected the non-blocking communicator config ({}: {}); \
                     falling back to a blocking ncclCommInitRank, which cannot time out",
                    describe(code),
                    // SAFETY: null comm is accepted.
                    unsafe { last_error(std::ptr::null_mut()) }
                );
                // SAFETY: as above; blocking init writes `comm` on success.
                let code = unsafe { sys::ncclCommInitRank(&mut comm, n, id, r) };
                return match code {
                    R::ncclSuccess => Ok(Self::wrap(comm, ctx.clone(), label, true, timeout)),
                    e => Err(Error::Msg(format!(
                        "{label}: ncclCommInitRank (blocking fallback) failed after {:.3?}: {}",
                        start.elapsed(),
                        describe(e)
                    ))),
                };
            }
            e => Err(Fail::Nccl(e)),
        };
        // (`cfg` is a local of this function: it outlives the init and the abort below.)
        match result {
            Ok(()) => Ok(Self::wrap(comm, ctx.clone(), label, false, timeout)),
            Err(fail) => {
                // SAFETY: comm is null or the half-made communicator, used by no other thread.
                let detail = unsafe { last_error(comm) };
                abort_raw(ctx, comm);
                Err(Error::Msg(init_message(&label, "ncclCommInitRankConfig", &fail, &detail, start.elapsed(), timeout)))
            }
        }
    }

    /// All of `ctxs` in this process, rank `i` on `ctxs[i]`, from this thread (one
    /// `ncclCommInitRankConfig` per device inside `ncclGroupStart/End`), bounded by `timeout`.
    pub(crate) fn init_all(ctxs: &[Arc<CudaContext>], timeout: Duration) -> Result<Vec<Self>> {
        let size = ctxs.len();
        let n = to_int(size, "world size")?;
        let what = format!("nccl single-process world of {size}");
        let mut id = std::mem::MaybeUninit::<sys::ncclUniqueId>::uninit();
        // SAFETY: `id` is a valid out-pointer; NCCL fully initialises it on success.
        let code = unsafe { sys::ncclGetUniqueId(id.as_mut_ptr()) };
        if code != R::ncclSuccess {
            candle_core::bail!("{what}: ncclGetUniqueId failed: {}", describe(code))
        }
        // SAFETY: initialised by the successful call above.
        let id = unsafe { id.assume_init() };
        let start = Instant::now();
        let mut cfgs: Vec<sys::ncclConfig_t> = (0..size).map(|_| nonblocking_config()).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); size];
        let mut code = R::ncclSuccess;
        let mut bind_err = None;
        // SAFETY: group start/end bracket the inits on this thread; every pointer passed is an
        // element of `comms`/`cfgs`, which are neither moved nor resized before this function
        // returns.
        let end = unsafe {
            let s = sys::ncclGroupStart();
            if s != R::ncclSuccess {
                candle_core::bail!("{what}: ncclGroupStart failed: {}", describe(s))
            }
            for (i, ctx) in ctxs.iter().enumerate() {
                if let Err(e) = ctx.bind_to_thread() {
                    bind_err = Some(format!("{what}: binding the CUDA context of rank {i}: {e:?}"));
                    break;
                }
                let r = sys::ncclCommInitRankConfig(&mut comms[i], n, id, i as c_int, &mut cfgs[i]);
                if code == R::ncclSuccess && r != R::ncclSuccess && r != R::ncclInProgress {
                    code = r;
                }
            }
            sys::ncclGroupEnd()
        };
        if let Some(msg) = bind_err {
            for (c, ctx) in comms.into_iter().zip(ctxs) {
                abort_raw(ctx, c);
            }
            candle_core::bail!("{msg}")
        }
        if code == R::ncclSuccess {
            code = end;
        }
        let fail = match code {
            R::ncclSuccess | R::ncclInProgress => {
                let deadline = start + timeout;
                let mut fail = None;
                for &c in &comms {
                    if c.is_null() {
                        fail = Some(Fail::Nccl(R::ncclInternalError));
                        break;
                    }
                    // SAFETY: c is a communicator made above, used by this thread only.
                    if let Err(f) = unsafe { wait_ready(c, deadline, None) } {
                        fail = Some(f);
                        break;
                    }
                }
                fail
            }
            R::ncclInvalidArgument | R::ncclInvalidUsage if comms.iter().all(|c| c.is_null()) => {
                eprintln!(
                    "candle-cp: {what}: NCCL rejected the non-blocking communicator config ({}); \
                     falling back to a blocking ncclCommInitAll, which cannot time out",
                    describe(code)
                );
                let ordinals: Vec<c_int> = ctxs.iter().map(|c| c.ordinal() as c_int).collect();
                // SAFETY: `comms` has room for `size` handles, `ordinals` holds `size` ids.
                let code = unsafe { sys::ncclCommInitAll(comms.as_mut_ptr(), n, ordinals.as_ptr()) };
                if code != R::ncclSuccess {
                    candle_core::bail!("{what}: ncclCommInitAll (blocking fallback) failed: {}", describe(code))
                }
                return Ok(Self::wrap_all(comms, ctxs, true, timeout));
            }
            e => Some(Fail::Nccl(e)),
        };
        drop(cfgs);
        match fail {
            None => Ok(Self::wrap_all(comms, ctxs, false, timeout)),
            Some(fail) => {
                // SAFETY: null accepted; comms are ours only.
                let detail = unsafe { last_error(comms[0]) };
                for (c, ctx) in comms.into_iter().zip(ctxs) {
                    abort_raw(ctx, c);
                }
                Err(Error::Msg(init_message(&what, "ncclCommInitRankConfig (grouped)", &fail, &detail, start.elapsed(), timeout)))
            }
        }
    }

    fn wrap_all(comms: Vec<sys::ncclComm_t>, ctxs: &[Arc<CudaContext>], blocking: bool, timeout: Duration) -> Vec<Self> {
        let size = comms.len();
        comms
            .into_iter()
            .zip(ctxs)
            .enumerate()
            .map(|(rank, (c, ctx))| Self::wrap(c, ctx.clone(), label(rank, size, ctx.ordinal()), blocking, timeout))
            .collect()
    }

    /// Run the NCCL call(s) `f` on the communicator and wait, bounded by the timeout, until
    /// NCCL has enqueued their GPU work. On failure the group is poisoned, the communicator
    /// aborted, and the `Err` names `op`, this rank, the elapsed time and the NCCL error.
    ///
    /// `f` gets the live handle and returns the first NCCL error, or the result of its last
    /// call (`ncclInProgress` included). It must open and close any group it starts, and
    /// device buffers it passes must stay alive until this returns (the work may be enqueued
    /// only during the in-progress wait).
    ///
    /// # Safety
    /// `f` must make valid NCCL calls for this communicator (pointers to live device buffers of
    /// the right length on the right device, a stream of this communicator's context).
    pub(crate) unsafe fn call(&self, op: &str, f: impl FnOnce(sys::ncclComm_t) -> R) -> Result<()> {
        self.refuse_if_failed(op)?;
        let mut h = self.lock();
        // poisoned while we waited for the lock: the poisoning thread is about to abort
        self.refuse_if_failed(op)?;
        if h.0.is_null() {
            // aborted meanwhile (abort always poisons first, so this reports the reason)
            self.refuse_if_failed(op)?;
            candle_core::bail!("{}: {op}: the communicator was aborted", self.label)
        }
        self.ctx.bind_to_thread().map_err(|e| Error::Msg(format!("{}: {op}: binding the CUDA context: {e:?}", self.label)))?;
        let start = Instant::now();
        let code = f(h.0);
        let res = match code {
            R::ncclSuccess => Ok(()),
            // SAFETY: h.0 is live (non-null under the lock) and used by this thread only.
            R::ncclInProgress => wait_ready(h.0, start + self.timeout(), Some(&self.poison)),
            e => Err(Fail::Nccl(e)),
        };
        match res {
            Ok(()) => Ok(()),
            Err(Fail::Poisoned) => {
                // abort here (the poisoning thread waits for this lock to do it), then report
                // the first failure
                self.abort_locked(&mut h);
                self.refuse_if_failed(op)?;
                candle_core::bail!("{}: {op}: the communicator was aborted", self.label)
            }
            Err(fail) => Err(self.fail_call(&mut h, op, &fail, start)),
        }
    }

    /// `Err` naming `op` and the first failure once the group is poisoned (formats nothing
    /// while healthy).
    pub(crate) fn refuse_if_failed(&self, op: &str) -> Result<()> {
        if self.poison.is_poisoned() {
            return self.poison.check(&format!("{}: {op}", self.label));
        }
        Ok(())
    }

    /// Poison with a message built from `fail`, abort (lock held), return that message.
    fn fail_call(&self, h: &mut Handle, op: &str, fail: &Fail, start: Instant) -> Error {
        let elapsed = start.elapsed();
        let timeout = self.timeout();
        // SAFETY: h.0 is live (under the lock).
        let detail = unsafe { last_error(h.0) };
        let what = match fail {
            Fail::Timeout => format!("NCCL still in progress after {elapsed:.3?} (timeout {timeout:?})"),
            Fail::Nccl(e) => format!("NCCL error {} after {elapsed:.3?}", describe(*e)),
            Fail::Poisoned => format!("interrupted after {elapsed:.3?}: the group failed meanwhile"),
        };
        let detail = if detail.is_empty() { String::new() } else { format!(" [NCCL: {detail}]") };
        let msg = format!("{}: {op}: {what}{detail}; communicator aborted, the group is unusable", self.label);
        self.poison.poison(msg.clone());
        self.abort_locked(h);
        Error::Msg(msg)
    }

    /// Poison the group with `reason` (if healthy) and abort the communicator. Blocks while
    /// another thread is inside a (bounded) call. Idempotent.
    pub(crate) fn fail(&self, reason: String) {
        self.poison.poison(reason);
        let mut h = self.lock();
        self.abort_locked(&mut h);
    }

    fn abort_locked(&self, h: &mut Handle) {
        let comm = std::mem::replace(&mut h.0, std::ptr::null_mut());
        abort_raw(&self.ctx, comm);
    }

    /// `Err` once the communicator reports an asynchronous error; `Ok` when healthy, aborted,
    /// or busy (a calling thread holds it and checks for errors itself).
    pub(crate) fn async_error(&self) -> std::result::Result<(), String> {
        let Ok(h) = self.handle.try_lock() else { return Ok(()) };
        if h.0.is_null() {
            return Ok(());
        }
        let mut state = R::ncclSuccess;
        // SAFETY: h.0 is live under the lock; `state` is a valid out-pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(h.0, &mut state) };
        match (r, state) {
            (R::ncclSuccess, R::ncclSuccess | R::ncclInProgress) => Ok(()),
            (R::ncclSuccess, e) | (e, _) => {
                // SAFETY: live under the lock.
                let detail = unsafe { last_error(h.0) };
                Err(format!("{} [NCCL: {detail}]", describe(e)))
            }
        }
    }
}

impl Drop for RawComm {
    /// Abort (never destroy: `ncclCommDestroy`/`ncclCommFinalize` may wait for peers that are
    /// gone). `NcclGroup`'s drop first waits, bounded, for its enqueued work to finish.
    fn drop(&mut self) {
        let h = self.handle.get_mut().unwrap_or_else(|e| e.into_inner());
        let comm = std::mem::replace(&mut h.0, std::ptr::null_mut());
        abort_raw(&self.ctx, comm);
    }
}

/// `ncclCommAbort(comm)` if non-null, ignoring its result (an aborted or failed communicator
/// may report an error; there is nothing more to do). Never panics.
fn abort_raw(ctx: &Arc<CudaContext>, comm: sys::ncclComm_t) {
    if comm.is_null() {
        return;
    }
    // NCCL switches to the communicator's device itself; binding the context first makes the
    // call independent of what the calling (e.g. watchdog) thread had current.
    let _ = bind_quietly(ctx);
    // SAFETY: comm is a live communicator that the caller owns exclusively (taken out of the
    // locked handle, or never published); it is not used again after this call. ncclCommAbort
    // first raises the abort flag that running NCCL kernels and the init/proxy threads poll,
    // then joins the init thread and frees the resources.
    let _ = unsafe { sys::ncclCommAbort(comm) };
}

/// Make `ctx` current on this thread. Unlike `CudaContext::bind_to_thread`, this does not
/// first take (`check_err`) the error that cudarc records from its `Drop`s for whichever
/// thread calls it next: the watchdog polls every 50 ms, so it would take the compute
/// thread's errors, report them as this group's failure and abort the communicator.
fn bind_quietly(ctx: &CudaContext) -> std::result::Result<(), DriverError> {
    if driver_ctx::get_current()? != Some(ctx.cu_ctx()) {
        // SAFETY: `ctx` is alive (borrowed), so its CUcontext is a valid, initialised context.
        unsafe { driver_ctx::set_current(ctx.cu_ctx()) }?;
    }
    Ok(())
}

fn to_int(v: usize, what: &str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::Msg(format!("nccl: {what} {v} does not fit in a C int")))
}

fn init_message(who: &str, call: &str, fail: &Fail, detail: &str, elapsed: Duration, timeout: Duration) -> String {
    let what = match fail {
        Fail::Timeout => format!(
            "{call} did not complete within the timeout {timeout:?} (elapsed {elapsed:.3?}): \
             did every rank join with the same id and world size?"
        ),
        Fail::Nccl(e) => format!("{call} failed after {elapsed:.3?}: {}", describe(*e)),
        Fail::Poisoned => format!("{call} interrupted after {elapsed:.3?}"),
    };
    let detail = if detail.is_empty() { String::new() } else { format!(" [NCCL: {detail}]") };
    format!("{who}: init: {what}{detail}; communicator aborted")
}

/// The watchdog polls our CUDA events and asynchronous errors, and aborts through
/// [`RawComm::fail`]'s path (the watchdog has already poisoned the group).
impl Watchable for RawComm {
    type Work = Arc<CudaEvent>;

    fn is_done(&self, ev: &Arc<CudaEvent>) -> std::result::Result<bool, String> {
        bind_quietly(&self.ctx).map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        ev.try_is_complete().map_err(|e| format!("CUDA event query failed: {e:?}"))
    }

    fn async_error(&self) -> std::result::Result<(), String> {
        RawComm::async_error(self)
    }

    fn abort(&self) {
        let mut h = self.lock();
        self.abort_locked(&mut h);
    }
}
