//! Gradient sync overlapped with the backward (`TrainConfig::overlap_grad_sync`) against the
//! synchronous sync after the backward, on CPU thread ranks with a **modeled link**.
//!
//! Thread ranks exchange tensors through memory, in microseconds: there is nothing to hide.
//! So every all-reduce, reduce-scatter and all-gather goes through [`ModeledLink`], which
//! holds each result back for the time a ring collective of that size takes on a link of
//! `--gbps` GB/s per GPU (all-reduce `2(P-1)/P·bytes`, reduce-scatter and all-gather
//! `(P-1)/P·bytes` of the full buffer), one transfer at a time per communicator. A blocking
//! collective returns when its transfer ends; a started one (`all_reduce_start`,
//! `reduce_scatter_start`, `all_gather_start`) runs on the link while the rank computes, and
//! its `wait` returns when the transfer ends. Ring send/recv, all-to-all and broadcasts are not delayed.
//! The compute (forward, recomputed backward, AdamW) is real.
//!
//! For each mode (ZeRO-0 and ZeRO-1) the same run trains twice, synchronous and overlapped,
//! and the table gives the median step time of the steps after the first, the modeled
//! gradient-sync time per step, how much of it the overlap hid, and the speedup. The losses
//! of the two runs must be equal (the overlap changes when sums run, not what they are).
//! A second table does the same for ZeRO-1's all-gather of the updated parameters (the
//! gradient sync overlapped in both runs): inside the optimizer step, or layer by layer
//! during the next forward (`TrainConfig::overlap_param_gather`).
//!
//! Run: `cargo run --release -p candle-cp-examples --example bench_grad_sync`
//! (defaults: CP 2 × DP 2 on 4 thread ranks, 4 layers of hidden 256, T = 512 per sequence,
//! `--gbps 0.02`; pick `--gbps` so that the sync is of the order of the backward, as it is on
//! a 405B model at 128k over InfiniBand: see `candle-cp plan`, "Gradient sync per optimizer step").

use candle_core::{Result, Tensor};
use candle_cp_comm::{run_ranks, Group, PendingRecv, ProcessGroup};
use candle_cp_llama::train::{
    train_rank, DataSource, KvRecall, ModelSource, TrainConfig, WarmupCosine,
};
use candle_cp_llama::{CpKind, Layout, LlamaConfig};
use clap::Parser;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Link bandwidth per GPU, GB/s (10^9 bytes per second).
    #[arg(long, default_value_t = 0.02)]
    gbps: f64,
    /// Context-parallel ranks (zigzag).
    #[arg(long, default_value_t = 2)]
    cp: usize,
    /// Data-parallel ranks.
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Optimizer steps per run (the first is not timed).
    #[arg(long, default_value_t = 6)]
    steps: usize,
}

/// A [`ProcessGroup`] whose all-reduce, reduce-scatter and all-gather take the time of a
/// ring collective on a link of `bytes_per_s` (see the module docs). Sub-groups from
/// [`ProcessGroup::split`] get links of their own.
struct ModeledLink {
    inner: Group,
    bytes_per_s: f64,
    /// When this rank's link is free again.
    free_at: Arc<Mutex<Instant>>,
}

impl ModeledLink {
    fn wrap(inner: Group, bytes_per_s: f64) -> Group {
        Arc::new(Self { inner, bytes_per_s, free_at: Arc::new(Mutex::new(Instant::now())) })
    }

    /// Book a transfer of `factor · bytes(t)` starting now or when the link frees up; returns
    /// its end.
    fn book(&self, t: &Tensor, factor: f64) -> Instant {
        let p = self.inner.size() as f64;
        let bytes = (t.elem_count() * t.dtype().size_in_bytes()) as f64 * factor * (p - 1.0) / p;
        self.book_bytes(bytes)
    }

    /// Book a transfer of `bytes` on the link; returns its end.
    fn book_bytes(&self, bytes: f64) -> Instant {
        let d = Duration::from_secs_f64(bytes / self.bytes_per_s);
        let mut free = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
        let end = (*free).max(Instant::now()) + d;
        *free = end;
        end
    }
}

fn sleep_until(end: Instant) {
    let now = Instant::now();
    if end > now {
        std::thread::sleep(end - now);
    }
}

/// A started collective on a modeled link: ready when both the real one and the transfer are.
struct Delayed {
    inner: Box<dyn PendingRecv>,
    end: Instant,
}

impl PendingRecv for Delayed {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        let r = self.inner.wait()?;
        sleep_until(self.end);
        Ok(r)
    }
}

impl ProcessGroup for ModeledLink {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let r = self.inner.all_gather(t, dim)?;
        sleep_until(self.book(&r, 1.0));
        Ok(r)
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let r = self.inner.reduce_scatter(t, dim)?;
        sleep_until(self.book(t, 1.0));
        Ok(r)
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        let r = self.inner.all_reduce(t)?;
        sleep_until(self.book(t, 2.0));
        Ok(r)
    }
    fn all_reduce_start(&self, t: &Tensor) -> Result<Box<dyn PendingRecv>> {
        let end = self.book(t, 2.0);
        Ok(Box::new(Delayed { inner: self.inner.all_reduce_start(t)?, end }))
    }
    fn reduce_scatter_start(&self, t: &Tensor, dim: usize) -> Result<Box<dyn PendingRecv>> {
        let end = self.book(t, 1.0);
        Ok(Box::new(Delayed { inner: self.inner.reduce_scatter_start(t, dim)?, end }))
    }
    fn all_gather_start(&self, t: &Tensor, dim: usize) -> Result<Box<dyn PendingRecv>> {
        // (the result's bytes: P times the input's)
        let end = self.book(t, self.inner.size() as f64);
        Ok(Box::new(Delayed { inner: self.inner.all_gather_start(t, dim)?, end }))
    }
    fn all_to_all(&self, t: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        self.inner.all_to_all(t, split_dim, concat_dim)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
    fn send_recv(&self, t: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv>> {
        self.inner.send_recv(t, dst, src)
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn ProcessGroup>> {
        Ok(Self::wrap(self.inner.split(color, key)?, self.bytes_per_s))
    }
    fn describe(&self) -> String {
        format!("{} on a modeled {} GB/s link", self.inner.describe(), self.bytes_per_s / 1e9)
    }
}

/// What one run overlaps: the gradient sync with the backward, ZeRO-1's parameter
/// all-gather with the next forward.
#[derive(Clone, Copy)]
struct Mode {
    zero1: bool,
    grad: bool,
    params: bool,
}

fn config(a: &Args, m: Mode) -> Result<TrainConfig> {
    let mut task = KvRecall::new(a.seq_len)?;
    task.n_keys = 16;
    task.n_queries = 16;
    let vocab = task.vocab_needed();
    Ok(TrainConfig {
        batch: a.dp,
        schedule: WarmupCosine { peak: 1e-3, warmup: 1, total: a.steps, min_ratio: 0.1 },
        seed: 1,
        recompute: true,
        overlap_grad_sync: m.grad,
        overlap_param_gather: m.params,
        zero1: m.zero1,
        ..TrainConfig::new(
            Layout::cp(CpKind::Zigzag, a.cp).with_dp(a.dp),
            ModelSource::Init(LlamaConfig::tiny(vocab, a.hidden, a.layers, 4, 2)),
            DataSource::Recall(task),
            a.seq_len,
            a.steps,
        )
    })
}

/// Median step time (s) of the steps after the first, and the losses.
fn measure(a: &Args, m: Mode) -> Result<(f64, Vec<f64>, usize)> {
    let cfg = config(a, m)?;
    let bps = a.gbps * 1e9;
    let outs = run_ranks(cfg.layout.world_size(), |g| train_rank(ModeledLink::wrap(g, bps), &cfg, &|_| {}));
    let out = outs.into_iter().next().ok_or_else(|| candle_core::Error::Msg("no rank".into()))??;
    let tokens = (cfg.batch * cfg.seq_len) as f64;
    let mut times: Vec<f64> = out.metrics.iter().skip(1).map(|m| tokens / m.tokens_per_s).collect();
    if times.is_empty() {
        candle_core::bail!("--steps {}: at least 2 needed (the first is not timed)", a.steps)
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], out.metrics.iter().map(|m| m.loss).collect(), out.n_params))
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.gbps <= 0.0 {
        candle_core::bail!("--gbps {}: must be > 0", a.gbps)
    }
    let r = a.cp * a.dp;
    println!(
        "bench_grad_sync: CP {} x DP {} (zigzag) on {} thread ranks, {} layers, hidden {}, T = {}, f32, layers recomputed; modeled link {} GB/s",
        a.cp, a.dp, r, a.layers, a.hidden, a.seq_len, a.gbps
    );
    println!();
    println!("| ZeRO | sync after backward (s/step) | overlapped (s/step) | modeled sync (s/step) | hidden | speedup |");
    println!("|---|---|---|---|---|---|");
    let mut z1_over = None;
    for zero1 in [false, true] {
        let (t_sync, l_sync, n_params) = measure(&a, Mode { zero1, grad: false, params: false })?;
        let (t_over, l_over, _) = measure(&a, Mode { zero1, grad: true, params: false })?;
        if l_sync != l_over {
            candle_core::bail!("the overlapped run's losses {l_over:?} differ from the synchronous run's {l_sync:?}")
        }
        // the gradients' bytes on the link per step: all-reduce 2(R-1)/R·4N, reduce-scatter (R-1)/R·4N
        // (+ the ZeRO-1 all-gather of the updated f32 parameters, the second table)
        let grad = 4.0 * n_params as f64 * (r as f64 - 1.0) / r as f64 * if zero1 { 1.0 } else { 2.0 };
        let sync_s = grad / (a.gbps * 1e9);
        let hidden = ((t_sync - t_over) / sync_s).clamp(-9.99, 9.99);
        println!(
            "| {} | {t_sync:.3} | {t_over:.3} | {sync_s:.3} | {:.0}% | {:.2}x |",
            if zero1 { 1 } else { 0 },
            100.0 * hidden,
            t_sync / t_over
        );
        if zero1 {
            z1_over = Some((t_over, l_over, n_params));
        }
    }
    println!();
    println!("(hidden = (sync after backward − overlapped) / modeled sync; losses of both runs equal)");
    let Some((t_step, l_step, n_params)) = z1_over else {
        candle_core::bail!("no ZeRO-1 run")
    };
    let (t_fwd, l_fwd, _) = measure(&a, Mode { zero1: true, grad: true, params: true })?;
    if l_fwd != l_step {
        candle_core::bail!("the run with the parameter all-gather overlapped has losses {l_fwd:?}, the other {l_step:?}")
    }
    let gather_s = 4.0 * n_params as f64 * (r as f64 - 1.0) / r as f64 / (a.gbps * 1e9);
    println!();
    println!("| ZeRO-1 parameter all-gather | in the optimizer step (s/step) | during the next forward (s/step) | modeled gather (s/step) | hidden | speedup |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| gradient sync overlapped in both | {t_step:.3} | {t_fwd:.3} | {gather_s:.3} | {:.0}% | {:.2}x |",
        100.0 * ((t_step - t_fwd) / gather_s).clamp(-9.99, 9.99),
        t_step / t_fwd
    );
    println!("(hidden = (in the step − during the forward) / modeled gather; losses of both runs equal)");
    Ok(())
}
