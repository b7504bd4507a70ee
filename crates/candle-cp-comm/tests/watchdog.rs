//! The watchdog that bounds NCCL waits, driven by a fake communicator on the CPU: a timeout
//! fires within bounds, poisons the group and names the op and rank; completed work never
//! aborts; asynchronous errors abort promptly; the thread stops on drop.

use candle_cp_comm::watchdog::{poll_until, Poison, PollEnd, Watchable, Watchdog, WatchdogOptions};
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A fake communicator: work item `i` is done once `complete(i)` is called; `abort` completes
/// everything (as NCCL's kernels exit after `ncclCommAbort`).
#[derive(Default)]
struct Fake {
    done: Mutex<HashSet<u32>>,
    aborted: AtomicUsize,
    async_err: Mutex<Option<String>>,
    query_err: Mutex<Option<u32>>,
    polls: AtomicUsize,
}

impl Fake {
    fn complete(&self, i: u32) {
        self.done.lock().unwrap().insert(i);
    }
    fn aborts(&self) -> usize {
        self.aborted.load(Ordering::SeqCst)
    }
}

impl Watchable for Fake {
    type Work = u32;
    fn is_done(&self, w: &u32) -> Result<bool, String> {
        self.polls.fetch_add(1, Ordering::SeqCst);
        if *self.query_err.lock().unwrap() == Some(*w) {
            return Err("event query failed: CUDA_ERROR_ILLEGAL_ADDRESS".into());
        }
        Ok(self.aborts() > 0 || self.done.lock().unwrap().contains(w))
    }
    fn async_error(&self) -> Result<(), String> {
        match self.async_err.lock().unwrap().clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
    fn abort(&self) {
        self.aborted.fetch_add(1, Ordering::SeqCst);
    }
}

const POLL: Duration = Duration::from_millis(10);

fn start(timeout: Duration) -> (Arc<Fake>, Poison, Watchdog<Fake>) {
    let fake = Arc::new(Fake::default());
    let poison = Poison::new();
    let mut opts = WatchdogOptions::new(timeout, "nccl rank 1 of 4 (cuda:1)");
    opts.poll = POLL;
    opts.thread_name = "test-watchdog".into();
    let wd = Watchdog::spawn(fake.clone(), poison.clone(), opts).unwrap();
    (fake, poison, wd)
}

/// Wait (up to `limit`) until `poison` is set; returns the time it took.
fn wait_poisoned(poison: &Poison, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if poison.is_poisoned() {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

#[test]
fn timeout_fires_within_bounds_poisons_and_names_op_and_rank() {
    let timeout = Duration::from_millis(300);
    let (fake, poison, wd) = start(timeout);
    let t0 = Instant::now();
    wd.track("all_reduce [4, 128] f32", 7);
    wait_poisoned(&poison, Duration::from_secs(10)).expect("the watchdog never fired");
    // t0 precedes the item's enqueue time, so this bounds its age when the watchdog fired:
    // not before the timeout, and within the timeout + a generous slack on a loaded machine
    let since_track = t0.elapsed();
    assert!(
        since_track >= timeout,
        "fired after {since_track:?}, before the timeout {timeout:?}"
    );
    assert!(
        since_track < timeout + Duration::from_millis(1500),
        "fired after {since_track:?}, timeout {timeout:?}"
    );
    // the abort follows the poison (and happens exactly once)
    let t = Instant::now();
    while fake.aborts() == 0 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(fake.aborts(), 1);
    let reason = poison.reason().unwrap();
    for needle in [
        "all_reduce [4, 128] f32",
        "rank 1 of 4",
        "timeout",
        "aborted",
    ] {
        assert!(
            reason.contains(needle),
            "reason {reason:?} lacks {needle:?}"
        );
    }
    // every later call on the group is refused at once, naming that call and the reason
    let err = poison
        .check("nccl rank 1 of 4: all_gather")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("all_gather") && err.contains("all_reduce [4, 128] f32"),
        "{err}"
    );
    // the thread ended after poisoning; dropping does not abort again
    let t = Instant::now();
    while wd.is_running() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(!wd.is_running());
    drop(wd);
    assert_eq!(fake.aborts(), 1);
}

#[test]
fn completed_work_is_retired_and_never_aborts() {
    let timeout = Duration::from_millis(150);
    let (fake, poison, wd) = start(timeout);
    for i in 0..20 {
        wd.track(format!("send_recv #{i}"), i);
        fake.complete(i);
    }
    // well past the timeout: everything was done, so nothing may fire
    std::thread::sleep(timeout * 4);
    assert!(!poison.is_poisoned(), "poisoned: {:?}", poison.reason());
    assert_eq!(fake.aborts(), 0);
    assert_eq!(wd.outstanding(), 0);
    assert!(wd.is_running());
    assert!(poison.check("all_reduce").is_ok());
}

#[test]
fn timeout_counts_from_each_items_enqueue() {
    // item 1 completes after 1/3 of the timeout; item 2, enqueued later, never does: the
    // failure must name item 2 and come no earlier than its own deadline.
    let timeout = Duration::from_millis(600);
    let (fake, poison, wd) = start(timeout);
    wd.track("all_gather #1", 1);
    std::thread::sleep(Duration::from_millis(200));
    let t2 = Instant::now();
    wd.track("all_gather #2", 2);
    fake.complete(1);
    let took = wait_poisoned(&poison, Duration::from_secs(10)).expect("never fired");
    // t2 precedes item 2's enqueue: its age at firing is at most t2.elapsed()
    assert!(
        t2.elapsed() >= timeout,
        "fired {took:?} after item 2, before its timeout"
    );
    let reason = poison.reason().unwrap();
    assert!(
        reason.contains("all_gather #2") && !reason.contains("all_gather #1"),
        "{reason}"
    );
}

#[test]
fn set_timeout_applies_to_outstanding_work() {
    let (_fake, poison, wd) = start(Duration::from_secs(60));
    wd.track("broadcast", 3);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!poison.is_poisoned());
    wd.set_timeout(Duration::from_millis(100));
    assert_eq!(wd.timeout(), Duration::from_millis(100));
    wait_poisoned(&poison, Duration::from_secs(5)).expect("shortened timeout never fired");
}

#[test]
fn async_error_aborts_promptly_and_names_the_outstanding_op() {
    let (fake, poison, wd) = start(Duration::from_secs(60));
    wd.track("reduce_scatter [8] bf16", 1);
    *fake.async_err.lock().unwrap() = Some("ncclRemoteError (remote process exited)".into());
    let took = wait_poisoned(&poison, Duration::from_secs(10)).expect("async error ignored");
    assert!(
        took < Duration::from_secs(2),
        "took {took:?} with a 60 s timeout"
    );
    let reason = poison.reason().unwrap();
    for needle in ["ncclRemoteError", "reduce_scatter [8] bf16", "rank 1 of 4"] {
        assert!(
            reason.contains(needle),
            "reason {reason:?} lacks {needle:?}"
        );
    }
    let t = Instant::now();
    while fake.aborts() == 0 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(fake.aborts(), 1);
}

#[test]
fn failed_completion_query_poisons() {
    let (fake, poison, wd) = start(Duration::from_secs(60));
    *fake.query_err.lock().unwrap() = Some(5);
    wd.track("all_to_all", 5);
    wait_poisoned(&poison, Duration::from_secs(10)).expect("query error ignored");
    assert!(poison
        .reason()
        .unwrap()
        .contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
}

#[test]
fn drop_stops_the_thread_promptly_without_aborting() {
    let (fake, poison, wd) = start(Duration::from_secs(60));
    wd.track("all_reduce", 1); // never completes
    std::thread::sleep(POLL * 3);
    assert!(
        fake.polls.load(Ordering::SeqCst) > 0,
        "the thread never polled"
    );
    let t = Instant::now();
    drop(wd);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "drop took {:?}",
        t.elapsed()
    );
    // the thread released its reference on the target: it has exited
    assert_eq!(Arc::strong_count(&fake), 1);
    let polls = fake.polls.load(Ordering::SeqCst);
    std::thread::sleep(POLL * 5);
    assert_eq!(
        fake.polls.load(Ordering::SeqCst),
        polls,
        "polled after drop"
    );
    assert_eq!(fake.aborts(), 0);
    assert!(!poison.is_poisoned());
}

#[test]
fn external_poison_ends_the_watchdog_and_refuses_new_work() {
    let (fake, poison, wd) = start(Duration::from_secs(60));
    assert!(poison.poison("nccl rank 1 of 4: all_reduce: ncclSystemError"));
    assert!(
        !poison.poison("a later failure"),
        "only the first failure is recorded"
    );
    let t = Instant::now();
    while wd.is_running() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(!wd.is_running());
    wd.track("barrier", 9);
    assert_eq!(wd.outstanding(), 0);
    assert_eq!(
        fake.aborts(),
        0,
        "the watchdog must not abort for a failure it did not detect"
    );
    let err = poison
        .check("nccl rank 1 of 4: barrier")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("barrier") && err.contains("ncclSystemError") && !err.contains("later"),
        "{err}"
    );
}

// `poll_until`: the calling thread's own bounded wait (an NCCL call in progress, a sync).

#[test]
fn poll_until_returns_once_ready_and_reacts_within_the_spin_phase() {
    // ready after ~200 µs (a typical non-blocking NCCL enqueue): seen well before a sleep
    // phase would matter, and `poll` stops being called once it reported ready
    let t = Instant::now();
    let mut polls = 0usize;
    let r = poll_until::<()>(t + Duration::from_secs(5), None, || {
        polls += 1;
        Ok(t.elapsed() >= Duration::from_micros(200))
    });
    let took = t.elapsed();
    assert_eq!(r, Ok(()));
    assert!(took >= Duration::from_micros(200), "{took:?}");
    assert!(took < Duration::from_millis(50), "took {took:?}");
    assert!(polls >= 2, "polled {polls} times");
}

#[test]
fn poll_until_times_out_at_the_deadline_and_reports_poll_errors() {
    let timeout = Duration::from_millis(60);
    let t = Instant::now();
    let r = poll_until::<()>(t + timeout, None, || Ok(false));
    let took = t.elapsed();
    assert_eq!(r, Err(PollEnd::Timeout));
    assert!(took >= timeout, "gave up after {took:?}");
    assert!(took < timeout + Duration::from_millis(500), "took {took:?}");
    // an error ends the wait at once, with that error
    let mut n = 0;
    let r = poll_until(Instant::now() + Duration::from_secs(5), None, || {
        n += 1;
        if n == 3 {
            Err("ncclRemoteError")
        } else {
            Ok(false)
        }
    });
    assert_eq!(r, Err(PollEnd::Failed("ncclRemoteError")));
    assert_eq!(n, 3);
    // the poll runs once even past the deadline, and success wins over the timeout
    assert_eq!(poll_until::<()>(Instant::now(), None, || Ok(true)), Ok(()));
}

#[test]
fn poll_until_stops_promptly_when_another_thread_poisons() {
    // a call stuck in progress (a peer never joins) with a long timeout: the watchdog or an
    // abort poisons the group from another thread, and the wait must end within a few ms
    // (it holds the communicator lock that the aborting thread waits for)
    let poison = Poison::new();
    let p2 = poison.clone();
    let poisoner = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        p2.poison("nccl rank 1 of 4: aborted: rank 0 returned an error");
        Instant::now()
    });
    let r = poll_until::<()>(Instant::now() + Duration::from_secs(60), Some(&poison), || Ok(false));
    let ended = Instant::now();
    let poisoned_at = poisoner.join().unwrap();
    assert_eq!(r, Err(PollEnd::Poisoned));
    let lag = ended.saturating_duration_since(poisoned_at);
    assert!(lag < Duration::from_millis(200), "noticed the poison {lag:?} late");
    // already poisoned: one poll, then stop (a ready poll still wins)
    let mut n = 0;
    let r = poll_until::<()>(Instant::now() + Duration::from_secs(60), Some(&poison), || {
        n += 1;
        Ok(false)
    });
    assert_eq!((r, n), (Err(PollEnd::Poisoned), 1));
    assert_eq!(poll_until::<()>(Instant::now() + Duration::from_secs(60), Some(&poison), || Ok(true)), Ok(()));
}
