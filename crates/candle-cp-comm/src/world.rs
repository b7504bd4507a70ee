//! Rendezvous machinery shared by the thread backend: the world's failure state and the
//! per-group "rounds" through which ranks exchange tensors.
//!
//! Every call a rank makes on a group (collective or `send_recv`) takes the next sequence
//! number `seq` of that group handle and deposits an [`Entry`] into round `seq`. A rank then
//! waits until the round is *complete* (all members deposited), validates the whole round
//! (same op, shapes, dtypes — see `collect.rs`) and reads the other ranks' tensors from it.
//! Because every rank sees the same complete round, every rank reaches the same verdict:
//! either all succeed or all report the same mismatch.
//!
//! Waiting is on a condvar with a deadline; aborts (a rank failed) and exits (a rank returned)
//! wake every waiter of every group of the world, so failures propagate at once rather than
//! after the timeout.

use candle_core::{Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Lock a mutex, ignoring poisoning (our critical sections leave the state consistent).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Longest single condvar sleep: a backstop in case a wake-up is ever missed.
const POLL: Duration = Duration::from_millis(100);

/// Why the world was aborted: the first failure wins.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    /// World rank that failed.
    pub rank: usize,
    /// Human-readable reason (error message, panic message, timeout).
    pub reason: String,
}

/// State shared by every group (world and sub-groups) of one thread world.
pub(crate) struct World {
    /// How long a rank may wait in one collective.
    pub timeout: Duration,
    failed: AtomicBool,
    failure: Mutex<Option<Failure>>,
    exited: Vec<AtomicBool>,
    comms: Mutex<Vec<Weak<Comm>>>,
}

impl World {
    pub fn new(size: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            timeout,
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
            comms: Mutex::new(Vec::new()),
        })
    }

    /// The failure that aborted the world, if any.
    pub fn failure(&self) -> Option<Failure> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.failure).clone()
    }

    /// Abort the world: every current and future wait of every group returns `Err`.
    /// Only the first failure is kept. Must not be called while holding a comm lock.
    pub fn abort(&self, rank: usize, reason: String) {
        {
            let mut f = lock(&self.failure);
            if f.is_none() {
                *f = Some(Failure { rank, reason });
            }
        }
        self.failed.store(true, Ordering::Release);
        self.wake_all();
    }

    /// Record that world rank `rank` has finished (its closure returned); waits that still
    /// need it fail at once. Must not be called while holding a comm lock.
    pub fn mark_exited(&self, rank: usize) {
        if let Some(e) = self.exited.get(rank) {
            e.store(true, Ordering::Release);
        }
        self.wake_all();
    }

    fn has_exited(&self, rank: usize) -> bool {
        self.exited
            .get(rank)
            .is_some_and(|e| e.load(Ordering::Acquire))
    }

    fn register(&self, comm: &Arc<Comm>) {
        let mut comms = lock(&self.comms);
        comms.retain(|w| w.strong_count() > 0);
        comms.push(Arc::downgrade(comm));
    }

    fn wake_all(&self) {
        let comms: Vec<Arc<Comm>> = lock(&self.comms).iter().filter_map(Weak::upgrade).collect();
        for c in comms {
            let _guard = lock(&c.state);
            c.cv.notify_all();
        }
    }
}

/// What a rank asked for in one call; compared across ranks to detect mismatches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    AllGather { dim: usize },
    ReduceScatter { dim: usize },
    AllReduce,
    AllToAll { split_dim: usize, concat_dim: usize },
    /// Rows along dim 0: this rank's counts to and from each rank.
    AllToAllV { send_rows: Vec<usize>, recv_rows: Vec<usize> },
    Broadcast { root: usize },
    Barrier,
    SendRecv { dst: usize, src: usize },
    Split { color: usize, key: usize },
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::AllGather { dim } => write!(f, "all_gather(dim={dim})"),
            Op::ReduceScatter { dim } => write!(f, "reduce_scatter(dim={dim})"),
            Op::AllReduce => write!(f, "all_reduce"),
            Op::AllToAll {
                split_dim,
                concat_dim,
            } => {
                write!(
                    f,
                    "all_to_all(split_dim={split_dim}, concat_dim={concat_dim})"
                )
            }
            Op::AllToAllV { send_rows, recv_rows } => write!(f, "all_to_all_v(send_rows={send_rows:?}, recv_rows={recv_rows:?})"),
            Op::Broadcast { root } => write!(f, "broadcast(root={root})"),
            Op::Barrier => write!(f, "barrier"),
            Op::SendRecv { dst, src } => write!(f, "send_recv(dst={dst}, src={src})"),
            Op::Split { color, key } => write!(f, "split(color={color}, key={key})"),
        }
    }
}

/// One rank's contribution to a round. The tensor is detached from any autograd graph.
#[derive(Clone)]
pub(crate) struct Entry {
    pub op: Op,
    pub tensor: Option<Tensor>,
}

/// Per-round state that the ranks of a round share beyond their entries.
#[derive(Default)]
pub(crate) struct RoundShared {
    /// The all-reduce sum, computed once by the first rank that gets there.
    pub reduced: OnceLock<std::result::Result<Tensor, String>>,
    /// Sub-groups created by a `split`, by color.
    pub subcomms: Mutex<HashMap<usize, Arc<Comm>>>,
}

struct Round {
    entries: Vec<Option<Entry>>,
    n_in: usize,
    taken: Vec<bool>,
    n_taken: usize,
    shared: Arc<RoundShared>,
}

#[derive(Default)]
struct CommState {
    rounds: HashMap<u64, Round>,
}

/// A complete round as seen by one rank.
pub(crate) struct Taken {
    pub entries: Vec<Entry>,
    pub shared: Arc<RoundShared>,
}

/// The shared communicator of one group: its members and its rounds.
pub(crate) struct Comm {
    pub world: Arc<World>,
    /// World rank of each group rank.
    pub members: Vec<usize>,
    /// Name used in error messages ("world", "split(color=1) of world").
    pub label: String,
    state: Mutex<CommState>,
    cv: Condvar,
}

impl Comm {
    /// Create a communicator over `members` (world ranks) and register it for wake-ups.
    pub fn new(world: Arc<World>, members: Vec<usize>, label: String) -> Arc<Self> {
        let comm = Arc::new(Self {
            world: world.clone(),
            members,
            label,
            state: Mutex::new(CommState::default()),
            cv: Condvar::new(),
        });
        world.register(&comm);
        comm
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// "rank 2" in the world, "rank 1 (world rank 5)" in a sub-group.
    pub fn who(&self, rank: usize) -> String {
        match self.members.get(rank) {
            Some(&w) if self.label != "world" => format!("rank {rank} (world rank {w})"),
            _ => format!("rank {rank}"),
        }
    }

    fn aborted_error(&self, rank: usize, op: &Op, seq: u64, f: &Failure) -> Error {
        Error::Msg(format!(
            "thread group {}: {} in {op} (call #{seq}): aborted because world rank {} failed: {}",
            self.label,
            self.who(rank),
            f.rank,
            f.reason
        ))
    }

    /// Deposit `rank`'s entry for round `seq`. Fails at once if the world is aborted.
    pub fn deposit(&self, seq: u64, rank: usize, entry: Entry) -> Result<()> {
        let p = self.size();
        let mut st = lock(&self.state);
        if let Some(f) = self.world.failure() {
            return Err(self.aborted_error(rank, &entry.op, seq, &f));
        }
        let round = st.rounds.entry(seq).or_insert_with(|| Round {
            entries: vec![None; p],
            n_in: 0,
            taken: vec![false; p],
            n_taken: 0,
            shared: Arc::new(RoundShared::default()),
        });
        if round.entries[rank].is_some() {
            candle_core::bail!(
                "thread group {}: {} deposited twice in call #{seq} (group handle shared between threads?)",
                self.label,
                self.who(rank)
            )
        }
        round.entries[rank] = Some(entry);
        round.n_in += 1;
        if round.n_in == p {
            self.cv.notify_all();
        }
        Ok(())
    }

    /// Wait until round `seq` is complete, then return every rank's entry. `op` is this rank's
    /// own op (for messages). Fails when the world is aborted, when a rank the round waits for
    /// has exited, or after the world's timeout (which then aborts the world).
    pub fn take(&self, seq: u64, rank: usize, op: &Op) -> Result<Taken> {
        let start = Instant::now();
        let deadline = start + self.world.timeout;
        let mut st = lock(&self.state);
        let (err, timed_out) = loop {
            let Some(round) = st.rounds.get_mut(&seq) else {
                break (
                    Error::Msg(format!(
                        "thread group {}: {} in {op}: round #{seq} vanished (internal error)",
                        self.label,
                        self.who(rank)
                    )),
                    false,
                );
            };
            if round.n_in == self.size() {
                let entries: Vec<Entry> = round.entries.iter().flatten().cloned().collect();
                let shared = round.shared.clone();
                if !round.taken[rank] {
                    round.taken[rank] = true;
                    round.n_taken += 1;
                }
                if round.n_taken == self.size() {
                    st.rounds.remove(&seq);
                }
                return Ok(Taken { entries, shared });
            }
            if let Some(f) = self.world.failure() {
                break (self.aborted_error(rank, op, seq, &f), false);
            }
            let missing: Vec<usize> = (0..self.size())
                .filter(|&r| round.entries[r].is_none())
                .collect();
            let gone: Vec<String> = missing
                .iter()
                .filter(|&&r| self.world.has_exited(self.members[r]))
                .map(|&r| self.who(r))
                .collect();
            if !gone.is_empty() {
                break (
                    Error::Msg(format!(
                        "thread group {}: {} in {op} (call #{seq}): {} already returned without joining this call",
                        self.label,
                        self.who(rank),
                        gone.join(", ")
                    )),
                    false,
                );
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> = missing.iter().map(|&r| self.who(r)).collect();
                break (
                    Error::Msg(format!(
                        "thread group {}: {} timed out after {:.1?} in {op} (call #{seq}) waiting for {}",
                        self.label,
                        self.who(rank),
                        now - start,
                        missing.join(", ")
                    )),
                    true,
                );
            }
            let wait = (deadline - now).min(POLL);
            st = self
                .cv
                .wait_timeout(st, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(st);
        if timed_out {
            self.world.abort(self.members[rank], err.to_string());
        }
        Err(err)
    }

    /// Mark `rank` as done with round `seq` without waiting (a dropped pending receive).
    pub fn release(&self, seq: u64, rank: usize) {
        let mut st = lock(&self.state);
        let p = self.size();
        if let Some(round) = st.rounds.get_mut(&seq) {
            if !round.taken[rank] {
                round.taken[rank] = true;
                round.n_taken += 1;
            }
            if round.n_taken == p {
                st.rounds.remove(&seq);
            }
        }
    }
}
