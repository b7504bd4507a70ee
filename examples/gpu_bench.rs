//! GPU benchmark (feature `cuda`): forward and backward TFLOP/s of the candle-cp flash kernels,
//! and zigzag ring attention on virtual ranks (threads sharing one GPU) against the
//! single-GPU kernel; with `--mem 1`, the memory-bound kernels (ring merge, final cast,
//! zigzag shard/unshard, all-to-all pack/unpack, int8 / NF4 dequantization beside its candle-op
//! formulation, top-K routing on the device beside the host loop) in GB/s against a device-to-device copy of the same bytes. Prints one JSON object per line (read by `scripts/gpu_table.py`).
//!
//! ```text
//! cargo run --release --features cuda -p candle-cp-examples --example gpu_bench -- \
//!     [--t 4096,8192,16384,32768] [--heads 16] [--batch 1] [--d 128] [--iters 3] \
//!     [--impl auto|simple|mma|pipelined|wgmma|wgmma-atomic|wgmma-ws|wgmma-tma|wgmma-tma-wide|atomic[,...]] [--ring-t 16384] [--ring-p 4] [--budget-s 240]
//!     [--mem 0|1] [--bwd 1|0] [--docs 128,1024] [--docs-t 16384] [--window 1024] [--softcap 50] [--moe 0|1|2]
//! ```
//! `--moe 1`: a mixture of experts' grouped products, the grouped kernel against one cuBLAS
//! GEMM per expert (`gpu_bench_moe.rs`; `"impl":"candle-cp-grouped"` lines); `--moe 2`: the
//! same at a tiny size (the CPU shim's runs).
//! `--softcap C`: each family's line is followed by the same calls with Gemma 2's logit soft cap
//! `C` (`flash::Logits`: the pipelined forward's capped entries, the CUDA-core backward), in the
//! same run (`"impl":"candle-cp-softcap"`; `fwd_vs_plain` / `bwd_vs_plain` = capped time /
//! uncapped time).
//! `--window W`: after the ring, the autograd `ring_attention` with a causal window of `W` as
//! the halo exchange against the ring, same ranks, same run (`"impl":"candle-cp-halo"`).
//! `--docs L,..`: packed documents of `L` tokens over `--docs-t` tokens (causal inside each),
//! one band call (`flash::fwd_band` / `flash::bwd_band` with the first `--impl` family, the
//! bounds on the device beforehand) against one call per document (what the CP engines issued
//! before bands), forward and backward, in the same run (`"impl":"candle-cp-band"` lines with
//! the family as `kernel`; `speedup` = per-document time / band time).
//! `--impl` takes a comma-separated list: each kernel family is timed on the same inputs,
//! side by side; the ring uses the first. `--bwd 0` times the forward only (for a family whose
//! backward is another family's, e.g. `wgmma-ws`, whose backward is `wgmma`'s).
//! FLOPs (FlashAttention convention): forward `4·B·H·T²·D` (halved when causal), backward
//! 2.5× the forward. bf16 inputs, f32 accumulation.

#[path = "gpu_add_dq.rs"]
mod gpu_add_dq;
#[path = "gpu_bench_mem.rs"]
mod mem;
#[path = "gpu_bench_moe.rs"]
mod moe;
use mem::{band_docs, mem_kernels};

use anyhow::Result;
use gpu_add_dq::AddDq;
use candle_core::{DType, Device, Tensor};
use candle_cp_comm::{run_ranks_with, ThreadGroupOptions};
use candle_cp_kernels::flash::{self, FwdImpl, KMask};
use candle_cp_ops::cp::{ring_attention_bwd_raw, ring_attention_fwd_raw, shard, CpOpts, Layout, DEFAULT_BLOCK_ROWS};
use std::cell::RefCell;
use std::time::{Duration, Instant};

struct Args {
    ts: Vec<usize>,
    heads: usize,
    batch: usize,
    d: usize,
    iters: usize,
    imps: Vec<FwdImpl>,
    ring_t: usize,
    ring_p: usize,
    budget: Duration,
    mem: bool,
    /// Time the experts' grouped products (`--moe`: 0 no (default), 1 yes, 2 at a tiny size).
    moe: usize,
    /// Time the backward too (`--bwd`, default 1).
    bwd: bool,
    /// Packed-document lengths for the band benchmark (`--docs`, none by default).
    docs: Vec<usize>,
    /// Sequence length of the band benchmark (`--docs-t`).
    docs_t: usize,
    /// A causal window for the halo-against-ring benchmark (`--window`, none by default).
    window: Option<usize>,
    /// Gemma 2's logit soft cap, timed beside each family (`--softcap`, none by default).
    softcap: Option<f32>,
}

fn parse() -> Result<Args> {
    let a: Vec<String> = std::env::args().collect();
    candle_cp_examples::check_flags(
        &a,
        &["--t", "--heads", "--batch", "--d", "--iters", "--impl", "--ring-t", "--ring-p", "--budget-s", "--mem", "--bwd", "--docs", "--docs-t", "--window", "--softcap", "--moe"],
        &[],
    )?;
    let get = |f: &str| a.iter().position(|x| x == f).and_then(|i| a.get(i + 1)).cloned();
    let num = |f: &str, d: usize| -> Result<usize> { Ok(get(f).map(|s| s.parse()).transpose()?.unwrap_or(d)) };
    let ts = match get("--t") {
        Some(s) => s.split(',').map(|x| x.trim().parse()).collect::<std::result::Result<Vec<usize>, _>>()?,
        None => vec![4096, 8192, 16384, 32768],
    };
    let imps = get("--impl")
        .unwrap_or_else(|| "auto".into())
        .split(',')
        .map(|s| {
            FwdImpl::from_name(s).ok_or_else(|| anyhow::anyhow!("--impl: unknown kernel family {s:?} (auto, simple, mma, pipelined, wgmma, wgmma-atomic, wgmma-ws, wgmma-tma, wgmma-tma-wide, atomic)"))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Args {
        ts,
        heads: num("--heads", 16)?,
        batch: num("--batch", 1)?,
        d: num("--d", 128)?,
        iters: num("--iters", 3)?,
        imps,
        ring_t: num("--ring-t", 16384)?,
        ring_p: num("--ring-p", 4)?,
        budget: Duration::from_secs(num("--budget-s", 240)? as u64),
        mem: num("--mem", 0)? != 0,
        moe: num("--moe", 0)?,
        bwd: num("--bwd", 1)? != 0,
        docs: match get("--docs") {
            Some(s) => s.split(',').map(|x| x.trim().parse()).collect::<std::result::Result<Vec<usize>, _>>()?,
            None => Vec::new(),
        },
        docs_t: num("--docs-t", 16384)?,
        window: get("--window").map(|s| s.parse()).transpose()?,
        softcap: get("--softcap").map(|s| s.parse()).transpose()?,
    })
}

/// N(0, 1) bf16 tensor of `shape` on `dev`.
fn randn_bf16(dev: &Device, shape: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::randn(0f32, 1f32, shape, dev)?.to_dtype(DType::BF16)
}

/// Mean seconds of `f` over up to `iters` runs after one warm-up; one run only when the
/// warm-up alone took more than a second.
fn time(dev: &Device, iters: usize, mut f: impl FnMut() -> candle_core::Result<()>) -> Result<f64> {
    let t0 = Instant::now();
    f()?;
    dev.synchronize()?;
    let warm = t0.elapsed().as_secs_f64();
    let n = if warm > 1.0 { 1 } else { iters.max(1) };
    let t = Instant::now();
    for _ in 0..n {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / n as f64)
}

fn main() -> Result<()> {
    let a = parse()?;
    let dev = Device::new_cuda(0)?;
    let start = Instant::now();
    let (b, h, d) = (a.batch, a.heads, a.d);
    let scale = 1.0 / (d as f32).sqrt();
    if a.mem {
        mem_kernels(&a, &dev)?;
    }
    if a.moe > 0 {
        moe::moe_products(&a, &dev, start)?;
    }
    if !a.docs.is_empty() {
        band_docs(&a, &dev)?;
    }
    for &t in &a.ts {
        for causal in [true, false] {
            if start.elapsed() > a.budget {
                println!("{{\"skipped\":\"budget\",\"t\":{t},\"causal\":{causal}}}");
                continue;
            }
            let mk = |s: &[usize]| randn_bf16(&dev, s);
            let (q, k, v) = (mk(&[b, t, h, d])?, mk(&[b, t, h, d])?, mk(&[b, t, h, d])?);
            let dout = Tensor::randn(0f32, 1f32, (b, t, h, d), &dev)?;
            let mask = if causal { KMask::causal(0, 1, 0, 1) } else { KMask::full() };
            let flops = 4.0 * (b * h * d) as f64 * (t as f64) * (t as f64) * if causal { 0.5 } else { 1.0 };
            for &imp in &a.imps {
                let (out, lse) = flash::fwd(&q, &k, &v, mask, scale, imp)?;
                let fwd_s = time(&dev, a.iters, || flash::fwd(&q, &k, &v, mask, scale, imp).map(|_| ()))?;
                let bwd_s = if a.bwd {
                    Some(time(&dev, a.iters, || flash::bwd_with(&q, &k, &v, &out, &lse, &dout, mask, scale, imp).map(|_| ()))?)
                } else {
                    None
                };
                let bwd = bwd_s.map_or(String::new(), |bs| format!(",\"bwd_ms\":{:.3},\"bwd_tflops\":{:.2}", bs * 1e3, 2.5 * flops / bs / 1e12));
                println!(
                    "{{\"impl\":\"candle-cp\",\"kernel\":\"{:?}\",\"dtype\":\"bf16\",\"b\":{b},\"h\":{h},\"d\":{d},\"t\":{t},\"causal\":{causal},\"fwd_ms\":{:.3},\"fwd_tflops\":{:.2}{bwd}}}",
                    imp,
                    fwd_s * 1e3,
                    flops / fwd_s / 1e12,
                );
                if let Some(c) = a.softcap {
                    // the same calls with the soft cap (capped pipelined forward entries, CUDA-core backward)
                    let l = flash::Logits::capped(scale, c);
                    let (out_c, lse_c) = flash::fwd(&q, &k, &v, mask, l, imp)?;
                    let cf = time(&dev, a.iters, || flash::fwd(&q, &k, &v, mask, l, imp).map(|_| ()))?;
                    let cbwd = match bwd_s {
                        Some(bs) => {
                            let cb = time(&dev, a.iters, || flash::bwd_with(&q, &k, &v, &out_c, &lse_c, &dout, mask, l, imp).map(|_| ()))?;
                            format!(",\"bwd_ms\":{:.3},\"bwd_tflops\":{:.2},\"bwd_vs_plain\":{:.3}", cb * 1e3, 2.5 * flops / cb / 1e12, cb / bs)
                        }
                        None => String::new(),
                    };
                    println!(
                        "{{\"impl\":\"candle-cp-softcap\",\"kernel\":\"{imp:?}\",\"dtype\":\"bf16\",\"b\":{b},\"h\":{h},\"d\":{d},\"t\":{t},\"causal\":{causal},\"cap\":{c},\"fwd_ms\":{:.3},\"fwd_tflops\":{:.2},\"fwd_vs_plain\":{:.3}{cbwd}}}",
                        cf * 1e3,
                        flops / cf / 1e12,
                        cf / fwd_s
                    );
                }
            }
        }
    }
    if a.ring_p > 1 && start.elapsed() < a.budget {
        let ri = RingInputs::new(&a, &dev, scale)?;
        ring_steps(&a, &dev, scale, &ri)?;
        if start.elapsed() < a.budget {
            ring(&a, &dev, scale, &ri)?;
        }
        if let (Some(w), true) = (a.window, start.elapsed() < a.budget) {
            halo_vs_ring(&a, &dev, scale, &ri, w)?;
        }
    }
    Ok(())
}

/// With `--window W`: the autograd `ring_attention` (forward + backward of `sum(out · dout)`) on
/// `ring_p` virtual ranks, zigzag, causal window `W`, as the halo exchange (`cp::halo`, where
/// `W - 1 <= T/(2P)`) against the ring (`CpOpts::with_halo(false)`), in the same run: slowest
/// rank from a barrier, best of `--iters` after a warm-up (`"impl":"candle-cp-halo"`;
/// `speedup` = ring / halo). Virtual ranks share one GPU, so the transfers are device copies:
/// this times the calls and launches, not a link.
fn halo_vs_ring(a: &Args, dev: &Device, scale: f32, ri: &RingInputs, w: usize) -> Result<()> {
    let (t, p) = (a.ring_t, a.ring_p);
    let dout = randn_bf16(dev, &[a.batch, t, a.heads, a.d])?;
    let shards: Vec<[Tensor; 4]> = (0..p)
        .map(|r| {
            let sh = |x: &Tensor| shard(x, Layout::Zigzag, r, p, 1);
            Ok([sh(&ri.q)?, sh(&ri.k)?, sh(&ri.v)?, sh(&dout)?])
        })
        .collect::<candle_core::Result<_>>()?;
    let base = CpOpts::new(Layout::Zigzag, true).with_scale(scale as f64).with_window(w);
    let time = |halo: bool| -> Result<f64> {
        let opts = base.clone().with_halo(halo);
        slowest_rank(a, dev, p, |g| {
            let [q, k, v, d] = &shards[g.rank()];
            let (q, k, v) = (candle_core::Var::from_tensor(q)?, candle_core::Var::from_tensor(k)?, candle_core::Var::from_tensor(v)?);
            q.device().synchronize()?;
            g.barrier()?;
            let t0 = Instant::now();
            let (out, _) = candle_cp_ops::cp::ring_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &g, &opts)?;
            let grads = (out * d)?.sum_all()?.backward()?;
            if let Some(dq) = grads.get(q.as_tensor()) {
                dq.device().synchronize()?;
            }
            Ok(t0.elapsed().as_secs_f64())
        })
    };
    let (ring_s, halo_s) = (time(false)?, time(true)?);
    let applies = candle_cp_ops::cp::halo::applies(&base, p, t);
    println!(
        "{{\"impl\":\"candle-cp-halo\",\"kernel\":\"{:?}\",\"layout\":\"zigzag\",\"p\":{p},\"t\":{t},\"window\":{w},\"halo\":{applies},\"ring_ms\":{:.3},\"halo_ms\":{:.3},\"speedup\":{:.3}}}",
        FwdImpl::from_env(),
        ring_s * 1e3,
        halo_s * 1e3,
        ring_s / halo_s
    );
    Ok(())
}

/// The global causal problem of the ring benchmarks (`[B, ring_t, H, D]` bf16) and the
/// single-GPU kernel's time on it, measured once for both.
struct RingInputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    imp: FwdImpl,
    single_s: f64,
    /// With `--bwd 1`: the whole sequence's out `[B, T, H, D]`, lse `[B, H, T]` (what every
    /// ring step's backward reads for its query rows), dout f32 `[B, T, H, D]` and the
    /// single-GPU backward's seconds.
    bwd: Option<(Tensor, Tensor, Tensor, f64)>,
}

impl RingInputs {
    fn new(a: &Args, dev: &Device, scale: f32) -> Result<Self> {
        let shape = [a.batch, a.ring_t, a.heads, a.d];
        let (q, k, v) = (randn_bf16(dev, &shape)?, randn_bf16(dev, &shape)?, randn_bf16(dev, &shape)?);
        let imp = a.imps.first().copied().unwrap_or(FwdImpl::Auto);
        let causal = KMask::causal(0, 1, 0, 1);
        let single_s = time(dev, a.iters, || flash::fwd(&q, &k, &v, causal, scale, imp).map(|_| ()))?;
        let bwd = if a.bwd {
            let (out, lse) = flash::fwd(&q, &k, &v, causal, scale, imp)?;
            let dout = Tensor::randn(0f32, 1f32, &shape, dev)?;
            let s = time(dev, a.iters, || flash::bwd_with(&q, &k, &v, &out, &lse, &dout, causal, scale, imp).map(|_| ()))?;
            Some((out, lse, dout, s))
        } else {
            None
        };
        Ok(Self { q, k, v, imp, single_s, bwd })
    }
}

/// Per-step compute of the zigzag ring (rank 0's schedule, the kernel calls the ring engine
/// issues: `step_schedule`, row chunks of `CpOpts::rows_per_call`, offset masks) without
/// communication, as the ring runs them since session 15: step 0's one call over all rows into
/// the state's buffer (`fwd_packed`), every other call folded into the running state
/// (`fwd_fold`); each step's rate (visible pairs · 4·H·D FLOP / time) against the single-GPU
/// kernel's rate on the whole causal sequence. Target: >= 0.9. The calls alone, each writing a
/// fresh result, are printed too (`kernel_step_ms`), and the paths of earlier sessions beside
/// them (`first_step_s13_vs_now`, `fold_s14_vs_now`: their time / the ring's). With
/// `--bwd 1` the same for the backward, as the ring runs it: each call's
/// `flash::bwd_prepared_add_dq` on the step's keys, with the rows of the rank's backward
/// prepared once from the whole sequence's out / dout and the lse of its query rows, adding dQ
/// into the rank's f32 accumulator (2.5x the forward's FLOP; the prep's time / P added to each
/// step) against the single-GPU backward's rate; and, in the same run, session 13's path
/// (`flash::bwd_with` per call, its fresh dQ added by one more kernel: `bwd_s13_vs_now` =
/// its time / the ring's).
fn ring_steps(a: &Args, dev: &Device, scale: f32, ri: &RingInputs) -> Result<()> {
    use candle_cp_ops::cp::ring::{call_pairs, step_schedule, sub_blocks, Block};
    let (b, h, d, t, p) = (a.batch, a.heads, a.d, a.ring_t, a.ring_p);
    let (q, k, v, imp) = (&ri.q, &ri.k, &ri.v, ri.imp);
    let single_rate = 4.0 * (b * h * d) as f64 * (t as f64) * (t as f64 + 1.0) / 2.0 / ri.single_s;
    let rank = 0usize;
    let ql = shard(q, Layout::Zigzag, rank, p, 1)?;
    // rank 0's lse rows (dim 2), its backward prepared once from its rows of out and dout (what
    // the ring's backward does before its steps; the prep's time, amortized over the P steps, is
    // added to each step's), and the single-GPU backward's rate
    // (the rank's rows of out and dout stay for the session-13 path timed alongside, which
    // prepared every call and added a fresh dQ to the accumulator)
    let bl = match &ri.bwd {
        Some((out, lse, dout, s)) => {
            let (ol, gl) = (shard(out, Layout::Zigzag, rank, p, 1)?, shard(dout, Layout::Zigzag, rank, p, 1)?);
            let prep_s = time(dev, a.iters, || flash::bwd_prep(&ol, &gl, q.dtype()).map(|_| ()))?;
            let pr = flash::bwd_prep(&ol, &gl, q.dtype())?;
            Some((shard(lse, Layout::Zigzag, rank, p, 2)?, pr, prep_s, 2.5 * single_rate * ri.single_s / s, ol, gl))
        }
        None => None,
    };
    // this rank's f32 dQ accumulator [1, B, T/P, H, D] (what the ring's calls add into)
    let dq_acc = Tensor::zeros((1, b, t / p, h, d), DType::F32, dev)?;
    // The engine's default on CUDA (no row chunking: one call per block, `rows_per_call` of
    // the default options on this device), then its CPU chunking (1024 rows), for comparison.
    let on_gpu = CpOpts::new(Layout::Zigzag, true).rows_per_call(dev);
    for block_rows in [on_gpu, DEFAULT_BLOCK_ROWS] {
        let (mut worst, mut worst_bwd) = (f64::MAX, f64::MAX);
        for step in 0..p {
            let src = (rank + p - step) % p;
            let (ks, vs) = (shard(k, Layout::Zigzag, src, p, 1)?, shard(v, Layout::Zigzag, src, p, 1)?);
            // (query rows, keys, mask, visible pairs) of every kernel call of this step.
            let mut calls = Vec::new();
            for sb in step_schedule(Layout::Zigzag, rank, src, p, t, true)? {
                // The engine's own row chunks and masks of each (possibly fused) block.
                for (qseg, block) in sub_blocks(&sb, true, block_rows) {
                    let mask = match block {
                        Block::Skip => continue,
                        Block::Full(_) => KMask::full(),
                        Block::Partial(_) => KMask::causal(qseg.offset, qseg.stride, sb.k.offset, sb.k.stride),
                    };
                    let pairs = call_pairs(&qseg, &sb.k, &block) as usize;
                    let qr = ql.narrow(1, qseg.local, qseg.len)?.contiguous()?;
                    let kr = ks.narrow(1, sb.k.local, sb.k.len)?.contiguous()?;
                    let vr = vs.narrow(1, sb.k.local, sb.k.len)?.contiguous()?;
                    let rows = match &bl {
                        Some((l, pr, _, _, ol, gl)) => Some((
                            l.narrow(2, qseg.local, qseg.len)?.contiguous()?,
                            pr.narrow_rows(qseg.local, qseg.len)?,
                            qseg.local,
                            ol.narrow(1, qseg.local, qseg.len)?.contiguous()?,
                            gl.narrow(1, qseg.local, qseg.len)?.contiguous()?,
                        )),
                        None => None,
                    };
                    calls.push((qr, kr, vr, mask, pairs, rows, qseg.local));
                }
            }
            let pairs: usize = calls.iter().map(|c| c.4).sum();
            // the step's kernel calls alone, each writing a fresh result
            let kernel_secs = time(dev, a.iters, || {
                for (qr, kr, vr, mask, ..) in &calls {
                    flash::fwd(qr, kr, vr, *mask, scale, imp)?;
                }
                Ok(())
            })?;
            // The step as the ring runs it (`secs`: `step_ms`, `ratio`, `worst_step_ratio`), beside
            // the path of the session before in the same run. Step 0's one call over all rows
            // writes the running state's buffer (`fwd_packed`, since session 14; before: the state
            // initialised, the result merged into it).
            let (first, secs) = match calls.as_slice() {
                [(qr, kr, vr, mask, ..)] if step == 0 && qr.dim(1)? == t / p => {
                    let now = time(dev, a.iters, || flash::fwd_packed(qr, kr, vr, *mask, scale, imp).map(|_| ()))?;
                    let s13 = time(dev, a.iters, || {
                        let mut st = candle_cp_ops::cp::state::LocalState::on_device(b, t / p, h, d, dev)?;
                        let (o, l) = flash::fwd(qr, kr, vr, *mask, scale, imp)?;
                        st.merge_rows(0, &o, &l)
                    })?;
                    (format!(",\"first_step_ms\":{:.3},\"first_step_s13_ms\":{:.3},\"first_step_s13_vs_now\":{:.3}", now * 1e3, s13 * 1e3, s13 / now), now)
                }
                // any other step: its calls folded into the running state by the forward kernels
                // (`fwd_fold`, since session 15) against session 14's path (forward, then the
                // in-place merge kernel), in the same run
                _ => {
                    let tl = t / p;
                    let state = Tensor::cat(&[Tensor::zeros(b * tl * h * d, DType::F32, dev)?, Tensor::full(f32::NEG_INFINITY, b * h * tl, dev)?], 0)?;
                    let now = time(dev, a.iters, || {
                        for (qr, kr, vr, mask, .., q0) in &calls {
                            flash::fwd_fold(qr, kr, vr, *mask, scale, imp, &state, tl, *q0)?;
                        }
                        Ok(())
                    })?;
                    let mut st = candle_cp_ops::cp::state::LocalState::on_device(b, tl, h, d, dev)?;
                    let s14 = time(dev, a.iters, || {
                        for (qr, kr, vr, mask, .., q0) in &calls {
                            let (o, l) = flash::fwd(qr, kr, vr, *mask, scale, imp)?;
                            st.merge_rows(*q0, &o, &l)?;
                        }
                        Ok(())
                    })?;
                    (format!(",\"fold_step_ms\":{:.3},\"fold_s14_ms\":{:.3},\"fold_s14_vs_now\":{:.3}", now * 1e3, s14 * 1e3, s14 / now), now)
                }
            };
            let rate = 4.0 * (b * h * d) as f64 * pairs as f64 / secs;
            worst = worst.min(rate / single_rate);
            let bwd = match &bl {
                Some((_, _, prep_s, single_bwd_rate, ..)) => {
                    // the ring's path: prepared calls adding dQ into the accumulator's rows (B > 1
                    // and part of the rows: a fresh dQ added by one more kernel, as the ring does)
                    let mut part_acc = candle_cp_ops::cp::state::RowAccum::on_device(1, b, t / p, h, d, dev)?;
                    let bsecs = time(dev, a.iters, || {
                        for (qr, kr, vr, mask, _, rows, _) in &calls {
                            if let Some((l, pr, q0, ..)) = rows {
                                let n = qr.dim(1)?;
                                if b == 1 || n == t / p {
                                    // rows q0 .. q0 + n of the accumulator: one contiguous region
                                    let acc = dq_acc.narrow(2, *q0, n)?.squeeze(0)?;
                                    acc.inplace_op1(&AddDq { q: qr, k: kr, v: vr, lse: l, pr, mask: *mask, scale, imp, out: RefCell::new(None) })?;
                                } else {
                                    let (dq, _, _) = flash::bwd_prepared(qr, kr, vr, l, pr, *mask, scale, imp)?;
                                    part_acc.add_rows(0, *q0, &dq)?;
                                }
                            }
                        }
                        Ok(())
                    })? + prep_s / p as f64;
                    // session 13's path: every call prepared (dO to f32, prep kernel), a fresh dQ
                    // added to the accumulator by one more kernel
                    let mut old_acc = candle_cp_ops::cp::state::RowAccum::on_device(1, b, t / p, h, d, dev)?;
                    let osecs = time(dev, a.iters, || {
                        for (qr, kr, vr, mask, _, rows, _) in &calls {
                            if let Some((l, _, q0, o, g)) = rows {
                                let (dq, _, _) = flash::bwd_with(qr, kr, vr, o, l, g, *mask, scale, imp)?;
                                old_acc.add_rows(0, *q0, &dq)?;
                            }
                        }
                        Ok(())
                    })?;
                    let brate = 2.5 * 4.0 * (b * h * d) as f64 * pairs as f64 / bsecs;
                    worst_bwd = worst_bwd.min(brate / single_bwd_rate);
                    format!(
                        ",\"bwd_step_ms\":{:.3},\"bwd_prep_ms\":{:.3},\"bwd_s13_step_ms\":{:.3},\"bwd_s13_vs_now\":{:.3},\"bwd_step_tflops\":{:.2},\"bwd_single_tflops\":{:.2},\"bwd_ratio\":{:.3}",
                        bsecs * 1e3,
                        prep_s * 1e3,
                        osecs * 1e3,
                        osecs / bsecs,
                        brate / 1e12,
                        single_bwd_rate / 1e12,
                        brate / single_bwd_rate
                    )
                }
                None => String::new(),
            };
            println!(
                "{{\"impl\":\"candle-cp-ring-step\",\"kernel\":\"{imp:?}\",\"layout\":\"zigzag\",\"p\":{p},\"t\":{t},\"step\":{step},\"block_rows\":{},\"calls\":{},\"kernel_step_ms\":{:.3},\"step_ms\":{:.3},\"step_tflops\":{:.2},\"single_tflops\":{:.2},\"ratio\":{:.3}{first}{bwd}}}",
                block_rows.min(t),
                calls.len(),
                kernel_secs * 1e3,
                secs * 1e3,
                rate / 1e12,
                single_rate / 1e12,
                rate / single_rate
            );
        }
        let bwd = if bl.is_some() { format!(",\"worst_bwd_step_ratio\":{worst_bwd:.3}") } else { String::new() };
        println!("{{\"impl\":\"candle-cp-ring-steps\",\"kernel\":\"{imp:?}\",\"p\":{p},\"t\":{t},\"block_rows\":{},\"worst_step_ratio\":{worst:.3}{bwd}}}", block_rows.min(t));
    }
    Ok(())
}


/// Zigzag ring forward on `ring_p` virtual ranks vs one flash forward over the whole sequence
/// (same FLOPs): efficiency = single-GPU time / ring time. The ring's kernels are `Auto`'s
/// (`CANDLE_CP_FLASH_IMPL`, printed as `kernel`), the single-GPU kernel the first `--impl`
/// (`single_kernel`): set the variable to that family to compare like with like. With
/// `--bwd 1` also the ring's backward against the single-GPU backward (`bwd_efficiency`).
fn ring(a: &Args, dev: &Device, scale: f32, ri: &RingInputs) -> Result<()> {
    let (b, h, d, t, p) = (a.batch, a.heads, a.d, a.ring_t, a.ring_p);
    let (q, k, v, single) = (&ri.q, &ri.k, &ri.v, ri.single_s);
    let shards: Vec<[Tensor; 3]> = (0..p)
        .map(|r| Ok([shard(q, Layout::Zigzag, r, p, 1)?, shard(k, Layout::Zigzag, r, p, 1)?, shard(v, Layout::Zigzag, r, p, 1)?]))
        .collect::<candle_core::Result<_>>()?;
    let opts = CpOpts::new(Layout::Zigzag, true).with_scale(scale as f64);
    let run = || -> Result<f64> {
        let t0 = Instant::now();
        let res = run_ranks_with(p, ThreadGroupOptions { device: dev.clone(), ..Default::default() }, |g| {
            let [q, k, v] = &shards[g.rank()];
            let (out, _, _) = ring_attention_fwd_raw(q, k, v, &g, &opts)?;
            out.device().synchronize()?;
            Ok(())
        });
        for r in res {
            r?;
        }
        dev.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    run()?; // warm-up
    let ring_s = (0..a.iters.max(1)).map(|_| run()).collect::<Result<Vec<_>>>()?.into_iter().fold(f64::MAX, f64::min);
    let flops = 4.0 * (b * h * d) as f64 * (t as f64) * (t as f64) * 0.5;
    // With `--bwd 1`: the ring's backward (K/V and dK/dV rotating, dQ accumulated in place) on
    // the same ranks, from each rank's forward (out, lse) computed once, untimed; timed from a
    // barrier to the slowest rank's end, against the single-GPU backward.
    let bwd = match &ri.bwd {
        Some((_, _, dout, single_bwd)) => {
            let douts: Vec<Tensor> = (0..p).map(|r| shard(dout, Layout::Zigzag, r, p, 1)).collect::<candle_core::Result<_>>()?;
            let fwds = run_ranks_with(p, ThreadGroupOptions { device: dev.clone(), ..Default::default() }, |g| {
                let [q, k, v] = &shards[g.rank()];
                let (out, lse, _) = ring_attention_fwd_raw(q, k, v, &g, &opts)?;
                Ok((out, lse))
            })
            .into_iter()
            .collect::<std::result::Result<Vec<_>, _>>()?;
            let s = slowest_rank(a, dev, p, |g| {
                let [q, k, v] = &shards[g.rank()];
                let (out, lse) = &fwds[g.rank()];
                out.device().synchronize()?;
                g.barrier()?;
                let t0 = Instant::now();
                let (dq, _, _, _) = ring_attention_bwd_raw(q, k, v, out, lse, &douts[g.rank()], &g, &opts)?;
                dq.device().synchronize()?;
                Ok(t0.elapsed().as_secs_f64())
            })?;
            format!(",\"ring_bwd_ms\":{:.3},\"single_bwd_ms\":{:.3},\"bwd_efficiency\":{:.3}", s * 1e3, single_bwd * 1e3, single_bwd / s)
        }
        None => String::new(),
    };
    println!(
        "{{\"impl\":\"candle-cp-ring\",\"kernel\":\"{:?}\",\"single_kernel\":\"{:?}\",\"layout\":\"zigzag\",\"p\":{p},\"t\":{t},\"causal\":true,\"ring_ms\":{:.3},\"single_ms\":{:.3},\"ring_tflops\":{:.2},\"efficiency\":{:.3}{bwd}}}",
        FwdImpl::from_env(),
        ri.imp,
        ring_s * 1e3,
        single * 1e3,
        flops / ring_s / 1e12,
        single / ring_s
    );
    Ok(())
}

/// `body` on `p` virtual ranks of `dev` (each returns its seconds, timed from a barrier): the
/// slowest rank's, best of `--iters` runs after a warm-up.
fn slowest_rank(a: &Args, dev: &Device, p: usize, body: impl Fn(candle_cp_comm::Group) -> candle_core::Result<f64> + Send + Sync) -> Result<f64> {
    let run = || -> Result<f64> {
        let res = run_ranks_with(p, ThreadGroupOptions { device: dev.clone(), ..Default::default() }, &body);
        let mut worst = 0f64;
        for r in res {
            worst = worst.max(r?);
        }
        Ok(worst)
    };
    run()?; // warm-up
    Ok((0..a.iters.max(1)).map(|_| run()).collect::<Result<Vec<_>>>()?.into_iter().fold(f64::MAX, f64::min))
}
