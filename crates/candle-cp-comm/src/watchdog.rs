//! Bounded waits on asynchronous communication work, independent of any GPU library.
//!
//! - [`Poison`]: the first failure of a group. Once set, every later call on the group returns
//!   `Err` at once, naming the call and the original reason.
//! - [`Watchdog`]: one thread per group that watches the work a group has *enqueued* (NCCL
//!   kernels on a CUDA stream, represented by a completion handle such as a CUDA event). If the
//!   oldest outstanding item is not done within the timeout, or the communicator reports an
//!   asynchronous error, the watchdog first poisons the group and then aborts the communicator
//!   (for NCCL: `ncclCommAbort`, after which NCCL's kernels exit, so host synchronisations that
//!   were waiting for them return instead of hanging).
//!
//! Both are generic over [`Watchable`] (poll one item / check for an asynchronous error /
//! abort), so the logic is unit-tested on the CPU with a fake communicator
//! (`tests/watchdog.rs`); `crate::nccl` implements it for its raw NCCL communicator.
//!
//! - [`poll_until`]: the bounded host-side wait of the calling thread itself (poll, yield,
//!   back off), which gives up at a deadline or as soon as another thread poisons the group.
//!
//! Timing: an item's age is measured from [`Watchdog::track`] (right after it is enqueued) to
//! the first poll that sees it done, so it includes time spent waiting on earlier GPU work
//! queued before it. A timeout fires at most one poll interval (plus the cost of one round of
//! polls) after it expires.

use candle_core::{Error, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Shared failure state of a group: unset while healthy; set once, by the first failure
/// (later reasons are ignored). Cloning shares the state.
#[derive(Clone, Default)]
pub struct Poison {
    inner: Arc<PoisonInner>,
}

#[derive(Default)]
struct PoisonInner {
    set: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Poison {
    /// A healthy (unpoisoned) state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record `reason` as the group's failure. Returns `true` if this call poisoned the state,
    /// `false` if it was already poisoned (the first reason is kept).
    pub fn poison(&self, reason: impl Into<String>) -> bool {
        let mut r = lock(&self.inner.reason);
        if r.is_some() {
            return false;
        }
        *r = Some(reason.into());
        self.inner.set.store(true, Ordering::Release);
        true
    }

    /// Whether a failure has been recorded.
    pub fn is_poisoned(&self) -> bool {
        self.inner.set.load(Ordering::Acquire)
    }

    /// The recorded failure, if any.
    pub fn reason(&self) -> Option<String> {
        lock(&self.inner.reason).clone()
    }

    /// `Ok(())` while healthy; once poisoned, an `Err` naming `what` (the call being refused,
    /// e.g. `"nccl rank 0 of 2: all_gather"`) and the recorded reason.
    pub fn check(&self, what: &str) -> Result<()> {
        if !self.is_poisoned() {
            return Ok(());
        }
        let reason = self.reason().unwrap_or_default();
        Err(Error::Msg(format!(
            "{what}: refused, the group is unusable since an earlier failure: {reason}"
        )))
    }
}

/// What a [`Watchdog`] needs from a communicator. Every method is called from the watchdog
/// thread and must return promptly (no unbounded blocking).
pub trait Watchable: Send + Sync + 'static {
    /// Completion handle of one enqueued piece of work (a CUDA event for NCCL).
    type Work: Send + 'static;
    /// `Ok(true)` once `work` has completed, `Ok(false)` while it is pending, `Err(message)` if
    /// its state cannot be queried (treated as a failure of the group).
    fn is_done(&self, work: &Self::Work) -> std::result::Result<bool, String>;
    /// `Err(message)` once the communicator reports an asynchronous error (e.g. a network
    /// failure). `Ok(())` while healthy, or when the state cannot be read right now.
    fn async_error(&self) -> std::result::Result<(), String>;
    /// Abort the communicator so that outstanding work finishes (with undefined results) and
    /// nothing waits on it any more. Must be idempotent and must not panic.
    fn abort(&self);
}

/// Settings of a [`Watchdog`].
#[derive(Clone, Debug)]
pub struct WatchdogOptions {
    /// Longest time an enqueued item may stay outstanding.
    pub timeout: Duration,
    /// How often the thread polls (clamped to at least 1 ms). Detection latency is about one
    /// poll interval.
    pub poll: Duration,
    /// Prefix of every failure message, e.g. `"nccl rank 0 of 2 (cuda:0)"`.
    pub label: String,
    /// Name of the watchdog thread.
    pub thread_name: String,
}

impl WatchdogOptions {
    /// Options with `timeout`, a 50 ms poll interval, and `label` (also used in the thread
    /// name).
    pub fn new(timeout: Duration, label: impl Into<String>) -> Self {
        let label = label.into();
        Self {
            timeout,
            poll: Duration::from_millis(50),
            thread_name: "watchdog".to_string(),
            label,
        }
    }
}

struct Pending<T> {
    op: String,
    since: Instant,
    work: T,
}

struct State<T> {
    queue: VecDeque<Pending<T>>,
    stop: bool,
}

struct Shared<W: Watchable> {
    target: Arc<W>,
    poison: Poison,
    label: String,
    poll: Duration,
    timeout_ns: AtomicU64,
    state: Mutex<State<W::Work>>,
    wake: Condvar,
}

impl<W: Watchable> Shared<W> {
    fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }
}

/// A thread that aborts a communicator whose enqueued work does not complete within the
/// timeout, or that reports an asynchronous error, and poisons the group first (see the module
/// docs). One per group; the thread stops when the `Watchdog` is dropped (or
/// [`Watchdog::stop`] is called), or after it has poisoned the group.
pub struct Watchdog<W: Watchable> {
    shared: Arc<Shared<W>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<W: Watchable> Watchdog<W> {
    /// Start watching `target`; failures are recorded in `poison` (shared with the group).
    /// Errors only if the thread cannot be spawned.
    pub fn spawn(target: Arc<W>, poison: Poison, opts: WatchdogOptions) -> Result<Self> {
        let shared = Arc::new(Shared {
            target,
            poison,
            label: opts.label,
            poll: opts.poll.max(Duration::from_millis(1)),
            timeout_ns: AtomicU64::new(duration_ns(opts.timeout)),
            state: Mutex::new(State {
                queue: VecDeque::new(),
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(opts.thread_name)
            .spawn(move || run(sh))
            .map_err(|e| Error::Msg(format!("watchdog: could not spawn its thread: {e}")))?;
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Watch `work` (already enqueued), labelled `op` in failure messages (e.g.
    /// `"all_reduce [4, 128] f32"`). Dropped at once if the group is poisoned or the watchdog
    /// stopped.
    pub fn track(&self, op: impl Into<String>, work: W::Work) {
        let mut st = lock(&self.shared.state);
        if st.stop || self.shared.poison.is_poisoned() {
            return;
        }
        st.queue.push_back(Pending {
            op: op.into(),
            since: Instant::now(),
            work,
        });
    }

    /// Number of tracked items not yet seen completed.
    pub fn outstanding(&self) -> usize {
        lock(&self.shared.state).queue.len()
    }

    /// The current timeout.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout()
    }

    /// Change the timeout (applies to outstanding items too, from their enqueue time).
    pub fn set_timeout(&self, timeout: Duration) {
        self.shared
            .timeout_ns
            .store(duration_ns(timeout), Ordering::Relaxed);
        self.shared.wake.notify_all();
    }

    /// Stop the thread and wait for it; outstanding items are dropped unwatched. Idempotent;
    /// also done by `Drop`. Returns within about one poll round (or one `abort` call, if the
    /// thread is in the middle of one).
    pub fn stop(&self) {
        {
            let mut st = lock(&self.shared.state);
            st.stop = true;
            st.queue.clear();
        }
        self.shared.wake.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join(); // a panicking target only ends the watchdog
        }
    }

    /// Whether the watchdog thread is still running (it ends on stop, or after poisoning).
    pub fn is_running(&self) -> bool {
        lock(&self.thread)
            .as_ref()
            .is_some_and(|t| !t.is_finished())
    }
}

impl<W: Watchable> Drop for Watchdog<W> {
    fn drop(&mut self) {
        self.stop();
    }
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The watchdog thread. Target methods are called without holding the state lock (so a slow
/// `abort` never blocks `track`, and no lock order between the state and the target exists).
fn run<W: Watchable>(sh: Arc<Shared<W>>) {
    let mut st = lock(&sh.state);
    loop {
        if st.stop {
            return;
        }
        st = sh
            .wake
            .wait_timeout(st, sh.poll)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        if st.stop {
            return;
        }
        if sh.poison.is_poisoned() {
            // someone else (the calling thread) already failed and aborted the group
            st.queue.clear();
            return;
        }
        let mut pending = std::mem::take(&mut st.queue);
        drop(st);
        let verdict = inspect(&sh, &mut pending);
        st = lock(&sh.state);
        if let Some(reason) = verdict {
            st.queue.clear();
            drop(st);
            drop(pending);
            // poison first, then abort: a thread released by the abort (its host sync returns)
            // must already see the group as failed.
            sh.poison.poison(reason);
            sh.target.abort();
            return;
        }
        // items tracked meanwhile are newer than the survivors
        pending.extend(st.queue.drain(..));
        st.queue = pending;
    }
}

/// Retire completed items; return a failure reason if an item's state cannot be read, the
/// communicator has an asynchronous error, or the oldest outstanding item is past the timeout.
fn inspect<W: Watchable>(
    sh: &Shared<W>,
    pending: &mut VecDeque<Pending<W::Work>>,
) -> Option<String> {
    let mut i = 0;
    while i < pending.len() {
        match sh.target.is_done(&pending[i].work) {
            Ok(true) => {
                pending.remove(i);
            }
            Ok(false) => i += 1,
            Err(e) => {
                let p = &pending[i];
                return Some(format!(
                    "{}: {} (enqueued {:.3?} ago): cannot query its completion: {e}; communicator aborted",
                    sh.label,
                    p.op,
                    p.since.elapsed()
                ));
            }
        }
    }
    if let Err(e) = sh.target.async_error() {
        let during = match pending.front() {
            Some(p) => format!(
                " while {} (enqueued {:.3?} ago) was outstanding",
                p.op,
                p.since.elapsed()
            ),
            None => String::new(),
        };
        return Some(format!(
            "{}: asynchronous communicator error{during}: {e}; communicator aborted (a peer rank probably failed)",
            sh.label
        ));
    }
    let timeout = sh.timeout();
    let oldest = pending.iter().min_by_key(|p| p.since)?;
    let age = oldest.since.elapsed();
    if age > timeout {
        return Some(format!(
            "{}: {} did not complete within the timeout {timeout:?} (outstanding for {age:.3?}, {} item(s) pending); \
             communicator aborted (a peer rank probably died, hangs, or called a different collective)",
            sh.label,
            oldest.op,
            pending.len()
        ));
    }
    None
}

/// Why [`poll_until`] stopped before its condition held.
#[derive(Debug, PartialEq, Eq)]
pub enum PollEnd<E> {
    /// The poll itself failed with this error.
    Failed(E),
    /// The poison was set (by another thread) before the condition held.
    Poisoned,
    /// The condition still did not hold at the deadline.
    Timeout,
}

/// Call `poll` until it returns `Ok(true)`; stop with [`PollEnd::Failed`] when it returns
/// `Err`, with [`PollEnd::Poisoned`] once `poison` is set, with [`PollEnd::Timeout`] once
/// `deadline` has passed (`poll` runs at least once).
///
/// Between polls the thread yields for the first millisecond, then sleeps from 125 µs up to
/// 5 ms (an eighth of the time waited so far). Short waits (an NCCL enqueue, tens of µs) thus
/// end within a scheduler yield of the condition instead of paying a sleep (at least ~60 µs
/// on Linux, timer slack included); long waits (init, a peer far behind) cost little CPU.
pub fn poll_until<E>(
    deadline: Instant,
    poison: Option<&Poison>,
    mut poll: impl FnMut() -> std::result::Result<bool, E>,
) -> std::result::Result<(), PollEnd<E>> {
    let start = Instant::now();
    loop {
        match poll() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(PollEnd::Failed(e)),
        }
        if poison.is_some_and(Poison::is_poisoned) {
            return Err(PollEnd::Poisoned);
        }
        if Instant::now() >= deadline {
            return Err(PollEnd::Timeout);
        }
        let waited = start.elapsed();
        if waited < Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::thread::sleep((waited / 8).min(Duration::from_millis(5)));
        }
    }
}
