//! Bootstrap of [`NcclGroup`]s: from the launcher environment (one process per GPU, the unique
//! id through [`crate::rendezvous`]: a TCP store on `MASTER_ADDR:MASTER_PORT` or a shared
//! file), or one process driving several GPUs (one thread per rank).

use super::raw::RawComm;
use super::{NcclGroup, DEFAULT_TIMEOUT};
use crate::rendezvous::Rendezvous;
use crate::{Group, ProcessGroup};
use candle_core::cuda_backend::cudarc::nccl::Id;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env_usize(name: &str) -> Result<usize> {
    let v = std::env::var(name).map_err(|_| Error::Msg(format!("NcclGroup::from_env: {name} is not set")))?;
    v.trim().parse().map_err(|_| Error::Msg(format!("NcclGroup::from_env: {name}={v:?} is not a number")))
}

impl NcclGroup {
    /// One process per GPU, from the usual launcher environment: `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK` (the CUDA ordinal; default `RANK`). Rank 0 makes the unique id and hands
    /// it to the others through [`Rendezvous::from_env`]: a TCP store on
    /// `MASTER_ADDR:MASTER_PORT` (rank 0 listens on that port), or the file
    /// `$CANDLE_CP_NCCL_ID_FILE`. Ranks other than 0 wait for it up to `timeout`. `timeout` is
    /// also the group's timeout: init waits at most that long for every rank to join, and so
    /// does each collective (see the module docs).
    pub fn from_env(timeout: Duration) -> Result<Self> {
        let rank = env_usize("RANK")?;
        let world = env_usize("WORLD_SIZE")?;
        let local = env_usize("LOCAL_RANK").unwrap_or(rank);
        let device = CudaDevice::new_with_stream(local)?;
        let rdv = Rendezvous::from_env()?;
        let start = Instant::now();
        let mine = if rank == 0 {
            let id = Id::new().map_err(|e| Error::Msg(format!("NcclGroup::from_env: ncclGetUniqueId: {}", super::raw::describe(e.0))))?;
            Some(id.internal().iter().map(|&c| c as u8).collect::<Vec<u8>>())
        } else {
            None
        };
        let bytes = rdv.share(rank, world, mine.as_deref(), 128, timeout)?;
        let mut raw = [0 as std::ffi::c_char; 128];
        for (d, s) in raw.iter_mut().zip(&bytes) {
            *d = *s as std::ffi::c_char;
        }
        let id = Id::uninit(raw);
        // the id wait and the init share one budget
        let left = timeout.saturating_sub(start.elapsed()).max(Duration::from_secs(1));
        let g = Self::with_timeout(&device, rank, world, id, left)?;
        g.set_timeout(timeout);
        Ok(g)
    }

    /// All GPUs `ordinals` in this process, one rank each (rank `i` on `ordinals[i]`), with the
    /// [`DEFAULT_TIMEOUT`]. Drive each group from its own thread (see [`run_nccl_ranks`]).
    pub fn single_process(ordinals: &[usize]) -> Result<Vec<Arc<NcclGroup>>> {
        Self::single_process_with_timeout(ordinals, DEFAULT_TIMEOUT)
    }

    /// [`NcclGroup::single_process`] with `timeout` for init and every later collective. The
    /// communicators are created from this thread, one non-blocking `ncclCommInitRankConfig`
    /// per GPU inside one NCCL group.
    pub fn single_process_with_timeout(ordinals: &[usize], timeout: Duration) -> Result<Vec<Arc<NcclGroup>>> {
        if ordinals.is_empty() {
            candle_core::bail!("NcclGroup::single_process: no GPU ordinals given")
        }
        let mut devices = Vec::with_capacity(ordinals.len());
        let mut streams = Vec::with_capacity(ordinals.len());
        let mut ctxs = Vec::with_capacity(ordinals.len());
        for &o in ordinals {
            let d = CudaDevice::new_with_stream(o)?;
            let ctx = d.cuda_stream().context().clone();
            streams.push(ctx.new_stream().w()?);
            ctxs.push(ctx);
            devices.push(d);
        }
        let raws = RawComm::init_all(&ctxs, timeout)?;
        let size = raws.len();
        raws.into_iter()
            .zip(devices)
            .zip(streams)
            .enumerate()
            .map(|(rank, ((raw, device), comm_stream))| Ok(Arc::new(Self::assemble(Arc::new(raw), rank, size, device, comm_stream)?)))
            .collect()
    }
}

/// Run `f` on one NCCL rank per GPU of `ordinals` in this process (one thread each, created
/// with [`NcclGroup::single_process`]); element `r` is rank `r`'s result.
///
/// A rank whose closure returns `Err` or panics (the panic is caught) aborts every rank's
/// group, so the other ranks' in-flight collectives stop and their next calls return `Err`
/// naming the failed rank, without waiting for the timeout. A rank that returns `Ok` while
/// others still call collectives with it makes them fail after the group's timeout.
pub fn run_nccl_ranks<T: Send>(ordinals: &[usize], f: impl Fn(Group) -> Result<T> + Send + Sync) -> Result<Vec<Result<T>>> {
    run_nccl_ranks_with_timeout(ordinals, DEFAULT_TIMEOUT, f)
}

/// [`run_nccl_ranks`] with `timeout` for init and every collective of the groups (see
/// [`NcclGroup::single_process_with_timeout`]).
pub fn run_nccl_ranks_with_timeout<T: Send>(
    ordinals: &[usize],
    timeout: Duration,
    f: impl Fn(Group) -> Result<T> + Send + Sync,
) -> Result<Vec<Result<T>>> {
    let groups = NcclGroup::single_process_with_timeout(ordinals, timeout)?;
    let f = &f;
    let all = &groups;
    Ok(std::thread::scope(|s| {
        let joins: Vec<_> = groups
            .iter()
            .cloned()
            .enumerate()
            .map(|(r, g)| {
                // the same stack as thread ranks: candle's backward recurses through deep graphs
                let b = std::thread::Builder::new().name(format!("nccl-rank-{r}")).stack_size(RANK_STACK);
                b.spawn_scoped(s, move || {
                    let fail = |why: String| {
                        for other in all {
                            other.abort(&format!("rank {r} {why}"));
                        }
                    };
                    match catch_unwind(AssertUnwindSafe(|| f(g as Group))) {
                        Ok(Ok(v)) => Ok(v),
                        Ok(Err(e)) => {
                            fail(format!("returned an error: {}", first_line(&e.to_string())));
                            Err(e)
                        }
                        Err(payload) => {
                            let msg = crate::thread::panic_message(&*payload);
                            fail(format!("panicked: {}", first_line(&msg)));
                            Err(Error::Msg(format!("nccl rank {r} panicked: {msg}")))
                        }
                    }
                })
            })
            .collect();
        joins
            .into_iter()
            .enumerate()
            .map(|(r, j)| match j {
                Ok(j) => j.join().unwrap_or_else(|_| Err(Error::Msg(format!("nccl rank {r} thread died")))),
                Err(e) => {
                    for other in all {
                        other.abort(&format!("rank {r} could not start its thread: {e}"));
                    }
                    Err(Error::Msg(format!("nccl rank {r}: spawning its thread: {e}")))
                }
            })
            .collect()
    }))
}

/// Run `f` on this process's NCCL rank, started by a launcher (one process per GPU; the
/// environment of [`NcclGroup::from_env`], whose `timeout` applies). `f` runs on a thread with
/// a [`RANK_STACK`] stack. If `f` returns `Err` or panics (the panic is caught), the group is
/// aborted first, so the other processes' collectives fail (NCCL reports the remote error)
/// instead of waiting for their timeout.
pub fn run_nccl_env_rank<T: Send>(timeout: Duration, f: impl FnOnce(Group) -> Result<T> + Send) -> Result<T> {
    let g = Arc::new(NcclGroup::from_env(timeout)?);
    let r = g.rank();
    std::thread::scope(|s| {
        let g2 = g.clone();
        let b = std::thread::Builder::new().name(format!("nccl-rank-{r}")).stack_size(RANK_STACK);
        let j = b
            .spawn_scoped(s, move || catch_unwind(AssertUnwindSafe(|| f(g2 as Group))))
            .map_err(|e| Error::Msg(format!("nccl rank {r}: spawning its thread: {e}")))?;
        match j.join() {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => {
                g.abort(&format!("rank {r} returned an error: {}", first_line(&e.to_string())));
                Err(e)
            }
            Ok(Err(payload)) | Err(payload) => {
                let msg = crate::thread::panic_message(&*payload);
                g.abort(&format!("rank {r} panicked: {}", first_line(&msg)));
                Err(Error::Msg(format!("nccl rank {r} panicked: {msg}")))
            }
        }
    })
}

/// Stack of each rank thread of [`run_nccl_ranks`] (and of the rank thread that launcher-started
/// processes run their rank on): 64 MiB virtual, like `ThreadGroupOptions::stack_size`.
pub const RANK_STACK: usize = 64 << 20;

/// The first line of `msg`, at most 300 characters (abort reasons are repeated on every rank).
fn first_line(msg: &str) -> String {
    let line = msg.lines().next().unwrap_or("");
    if line.chars().count() > 300 {
        format!("{}...", line.chars().take(300).collect::<String>())
    } else {
        line.to_string()
    }
}
