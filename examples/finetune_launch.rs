//! How `finetune_llama`'s ranks are started: thread ranks, NCCL ranks as threads of one
//! process, or one NCCL process of a launcher-started world (`--comm`, and the `RANK` /
//! `WORLD_SIZE` environment). Included by `finetune_llama.rs` with `#[path]`.

use super::Args;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_cp_comm::{run_ranks_with, Group, ThreadGroupOptions};
use candle_cp_llama::train::TrainOutcome;
use std::time::Duration;

/// How the ranks of this run are started (--comm, and the launcher environment).
pub(crate) enum Launch {
    /// All ranks are threads of this process (ThreadGroup).
    Threads,
    /// One NCCL rank per GPU 0..world, a thread each, in this process.
    NcclThreads,
    /// This process is NCCL rank `rank` of a launcher-started world.
    NcclProcess { rank: usize },
}

impl Launch {
    pub(crate) fn from_args(a: &Args, world: usize, cuda: bool) -> Result<Self> {
        match a.comm.as_str() {
            "threads" => Ok(Launch::Threads),
            "nccl" => {
                if !cfg!(feature = "nccl") {
                    bail!("--comm nccl: this binary was built without NCCL (cargo run --release --features nccl --example finetune_llama ...)")
                }
                if !cuda {
                    bail!("--comm nccl needs --device cuda")
                }
                let env = |k: &str| std::env::var(k).ok();
                match (env("RANK"), env("WORLD_SIZE")) {
                    (Some(r), Some(w)) => {
                        let rank: usize = r.trim().parse().with_context(|| format!("RANK={r:?}"))?;
                        let size: usize = w.trim().parse().with_context(|| format!("WORLD_SIZE={w:?}"))?;
                        if size != world {
                            bail!("WORLD_SIZE={size}, but the layout needs {world} ranks (cp x tp x dp)")
                        }
                        if rank >= size {
                            bail!("RANK={rank} is out of range for WORLD_SIZE={size}")
                        }
                        Ok(Launch::NcclProcess { rank })
                    }
                    (None, None) => {
                        if a.gpus < world {
                            bail!("--comm nccl runs one rank per GPU: the layout needs {world} ranks, --gpus is {}", a.gpus)
                        }
                        Ok(Launch::NcclThreads)
                    }
                    _ => bail!("--comm nccl: set both RANK and WORLD_SIZE (a launched process) or neither (one process, a thread per GPU)"),
                }
            }
            c => bail!("--comm {c}: expected threads or nccl"),
        }
    }

    /// Launched processes other than world rank 0 print nothing.
    pub(crate) fn quiet(&self) -> bool {
        matches!(self, Launch::NcclProcess { rank } if *rank != 0)
    }

    pub(crate) fn ranks_here(&self, world: usize) -> usize {
        match self {
            Launch::NcclProcess { .. } => 1,
            _ => world,
        }
    }

    pub(crate) fn describe(&self, world: usize, a: &Args, cuda: bool, dtype: DType) -> String {
        match self {
            Launch::Threads if cuda => {
                format!(
                    "{world} thread ranks on CUDA, {} GPU(s), {dtype:?} weights",
                    a.gpus
                )
            }
            Launch::Threads => format!("{world} thread ranks on CPU, {dtype:?} weights"),
            Launch::NcclThreads => {
                format!("{world} NCCL ranks on GPUs 0..{world}, a thread each, {dtype:?} weights")
            }
            Launch::NcclProcess { .. } => {
                format!("{world} NCCL ranks, one process each; this is rank 0, {dtype:?} weights")
            }
        }
    }

    /// Runs `train` on this process's ranks; `Some(outcome of world rank 0)` where this
    /// process holds it. Any failing rank fails the run.
    pub(crate) fn run(
        &self,
        world: usize,
        timeout: Duration,
        train: impl Fn(Group) -> candle_core::Result<TrainOutcome> + Send + Sync,
    ) -> Result<Option<TrainOutcome>> {
        let results: Vec<candle_core::Result<TrainOutcome>> = match self {
            Launch::Threads => {
                let opts = ThreadGroupOptions {
                    timeout,
                    ..Default::default()
                };
                run_ranks_with(world, opts, train)
            }
            #[cfg(feature = "nccl")]
            Launch::NcclThreads => {
                let ordinals: Vec<usize> = (0..world).collect();
                candle_cp_comm::nccl::run_nccl_ranks_with_timeout(&ordinals, timeout, train)?
            }
            #[cfg(feature = "nccl")]
            Launch::NcclProcess { rank } => {
                let r = candle_cp_comm::nccl::run_nccl_env_rank(timeout, train)
                    .with_context(|| format!("rank {rank}"))?;
                return Ok((*rank == 0).then_some(r));
            }
            #[cfg(not(feature = "nccl"))]
            _ => bail!("built without the nccl feature"),
        };
        let mut outcome = None;
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Ok(o) if r == 0 => outcome = Some(o),
                Ok(_) => {}
                Err(e) => bail!("rank {r} failed: {e}"),
            }
        }
        outcome.map(Some).context("no rank returned")
    }
}
