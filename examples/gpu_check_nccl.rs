//! `gpu_check` sections `nccl` and `nccl-ranks` (feature `nccl`; included by `gpu_check.rs` with
//! `#[path]`): `NcclGroup` on one GPU (world 1, empty tensors refused, abort, a rank that never
//! joins) and on NCCL ranks one GPU each (CP methods, Ulysses and the tiny Llama against the
//! oracles).

use super::oracle::report_llama;
use super::{oracle_cases, report_metrics, Report};
use crate::gpu_util::{self, max_abs, rand_tensor};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_cp_ops::cp::{CpMethod, Layout};
use std::time::{Duration, Instant};

pub fn check_nccl(rep: &mut Report, ordinal: usize) -> Result<()> {
    use candle_core::cuda_backend::cudarc::nccl::Id;
    use candle_core::CudaDevice;
    use candle_cp_comm::nccl::NcclGroup;
    use candle_cp_comm::ProcessGroup;
    {
        let groups = NcclGroup::single_process(&[ordinal])?;
        let g = &groups[0];
        let dev = g.device();
        let x = rand_tensor(&[2, 6, 4], 5)?.to_device(&dev)?;
        rep.check("nccl P1 all_gather", max_abs(&g.all_gather(&x, 1)?, &x)?, 0.0);
        rep.check("nccl P1 all_reduce", max_abs(&g.all_reduce(&x)?, &x)?, 0.0);
        rep.check("nccl P1 reduce_scatter", max_abs(&g.reduce_scatter(&x, 1)?, &x)?, 0.0);
        rep.check("nccl P1 all_to_all", max_abs(&g.all_to_all(&x, 2, 1)?, &x)?, 0.0);
        rep.check("nccl P1 broadcast", max_abs(&g.broadcast(&x, 0)?, &x)?, 0.0);
        let r = g.send_recv(&x, 0, 0)?.wait()?;
        rep.check("nccl P1 send_recv self", max_abs(&r, &x)?, 0.0);
        // host tensors are staged through the GPU and come back to the host
        let xh = x.to_device(&Device::Cpu)?;
        for (what, r) in [
            ("all_gather", g.all_gather(&xh, 1)?),
            ("all_reduce", g.all_reduce(&xh)?),
            ("send_recv", g.send_recv(&xh, 0, 0)?.wait()?),
        ] {
            // (a result left on the GPU counts as a failure)
            let err = if matches!(r.device(), Device::Cpu) { max_abs(&r, &xh)? } else { f64::INFINITY };
            rep.check(&format!("nccl P1 {what} of a host tensor, result on the host"), err, 0.0);
        }
        // an empty tensor (here a view with no rows, on the GPU and on the host) is refused at
        // once by every collective, with an error that says so, before NCCL sees it
        for (place, e) in [("GPU", x.narrow(1, 1, 0)?), ("host", xh.narrow(1, 1, 0)?)] {
            let t = Instant::now();
            let results = [
                ("all_gather", g.all_gather(&e, 1).err()),
                ("all_reduce", g.all_reduce(&e).err()),
                ("all_to_all", g.all_to_all(&e, 2, 1).err()),
                ("send_recv", g.send_recv(&e, 0, 0).err()),
            ];
            for (what, err) in results {
                let name = format!("nccl P1 {what} of an empty {place} tensor: Err (err = seconds)");
                match err {
                    Some(m) if m.to_string().contains("empty") => rep.check(&name, t.elapsed().as_secs_f64(), 0.5),
                    Some(m) => rep.error(&name, format!("unexpected message: {m}")),
                    None => rep.error(&name, "returned Ok"),
                }
            }
        }
        g.barrier()?;
        // Host time per call of the non-blocking communicator: each ncclSend/Recv group returns
        // ncclInProgress and NCCL launches it from a thread it creates per call, which we poll
        // (a world of 1 runs all_reduce as a local copy, without that thread: the baseline).
        // The printed times are the measurement; the 1 ms bound only catches a wait that
        // sleeps in coarse steps or stalls behind the watchdog.
        let small = Tensor::zeros(256, DType::F32, &dev)?;
        for (what, n) in [("send_recv self + wait", 200usize), ("all_reduce", 200)] {
            g.synchronize()?;
            let t = Instant::now();
            for _ in 0..n {
                if what == "all_reduce" {
                    g.all_reduce(&small)?;
                } else {
                    g.send_recv(&small, 0, 0)?.wait()?;
                }
            }
            let per_call = t.elapsed().as_secs_f64() / n as f64;
            g.synchronize()?;
            println!("  nccl P1 {what}: {:.1} us host time per call ({n} calls)", per_call * 1e6);
            rep.check(&format!("nccl P1 {what}: host seconds per call"), per_call, 1e-3);
        }
        // an aborted group refuses every later call at once, naming the call and the reason
        g.abort("gpu_check: deliberate abort");
        let t = Instant::now();
        let name = "nccl P1 call after abort: immediate Err (err = seconds)";
        match g.all_reduce(&x) {
            Err(e) if e.to_string().contains("all_reduce") && e.to_string().contains("deliberate abort") => {
                rep.check(name, t.elapsed().as_secs_f64(), 0.5)
            }
            Err(e) => rep.error(name, format!("unexpected message: {e}")),
            Ok(_) => rep.error(name, "returned Ok"),
        }
    }
    // World of 2 on this one GPU, rank 1 never joins: init must fail after the timeout
    // (non-blocking ncclCommInitRankConfig, polled, then ncclCommAbort), not hang.
    let timeout = Duration::from_secs(5);
    let name = "nccl world 2, rank 1 missing: init Err after the 5 s timeout (err = seconds taken)";
    let dev = CudaDevice::new_with_stream(ordinal)?;
    let id = Id::new().map_err(|e| anyhow::anyhow!("ncclGetUniqueId: {:?}", e.0))?;
    let t = Instant::now();
    let res = NcclGroup::with_timeout(&dev, 0, 2, id, timeout);
    let took = t.elapsed();
    match res {
        Err(e) if e.to_string().contains("timeout") => {
            println!("  missing rank: Err after {took:.2?}: {e}");
            rep.check(name, took.as_secs_f64(), timeout.as_secs_f64() + 5.0)
        }
        Err(e) => rep.error(name, format!("after {took:.2?}, not a timeout: {e}")),
        Ok(_) => rep.error(name, "init returned Ok without rank 1"),
    }
    Ok(())
}

/// CP methods and Ulysses on NCCL ranks, one GPU each (single process, one thread per device:
/// `NcclGroup`'s grouped send/recv ring and all-to-all, all-gather, reduce-scatter with real
/// peers), against the oracle.
/// With 4 or more GPUs also the tiny-Llama oracle at TP 2 x CP 2 zigzag + SP on 4 NCCL ranks.
/// Needs 2 or more GPUs: skipped on a one-GPU machine; CI runs it on the CPU under the host CUDA
/// shim with `CPEMU_DEVICES=4` (docs/gpu.md). `--quick`: the oracle files of at most
/// [`QUICK_MAX_TOKENS`] tokens.
pub fn check_nccl_ranks(rep: &mut Report, dir: &str, llama: &str) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    use candle_cp_comm::nccl::run_nccl_ranks;
    use candle_cp_ops::cp::{run_case_cp_on, CpOpts};
    let n = CudaContext::device_count().map_err(|e| anyhow::anyhow!("cuDeviceGetCount: {e:?}"))? as usize;
    if n < 2 {
        println!("  nccl-ranks: skipped ({n} GPU; NCCL ranks need one GPU each, 2 at least)");
        return Ok(());
    }
    // the started collectives (the overlapped gradient sync's): an all-reduce and a
    // reduce-scatter along dim 1 started, a blocking all-gather in between, waited in reverse
    // order; the same bits as the blocking calls on every rank (f32 and bf16)
    {
        let p = n.min(4);
        let ordinals: Vec<usize> = (0..p).collect();
        for dtype in [DType::F32, DType::BF16] {
            let res = run_nccl_ranks(&ordinals, |g| -> candle_core::Result<f64> {
                let dev = g.home_device().unwrap_or(Device::Cpu);
                let r = g.rank() as u64;
                let x = rand_tensor(&[3, 8 * p], 70 + r).map_err(|e| candle_core::Error::Msg(e.to_string()))?.to_dtype(dtype)?.to_device(&dev)?;
                let a = g.all_reduce_start(&x)?;
                let b = g.reduce_scatter_start(&x, 1)?;
                let c = g.all_gather_start(&x, 1)?;
                let gathered = g.all_gather(&x, 0)?;
                let (ag, rs, ar) = (c.wait()?, b.wait()?, a.wait()?);
                let f = |t: &Tensor| t.to_dtype(DType::F32)?.to_device(&Device::Cpu);
                let diff = |a: &Tensor, b: &Tensor| -> candle_core::Result<f32> {
                    if a.dims() != b.dims() {
                        return Ok(f32::INFINITY);
                    }
                    (f(a)? - f(b)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
                };
                let d1 = diff(&ar, &g.all_reduce(&x)?)?;
                let d2 = diff(&rs, &g.reduce_scatter(&x, 1)?)?;
                let d3 = if gathered.dims() == [3 * p, 8 * p] { 0.0 } else { f32::INFINITY };
                let d4 = diff(&ag, &g.all_gather(&x, 1)?)?;
                Ok(d1.max(d2).max(d3).max(d4) as f64)
            });
            let name = format!("nccl ranks P{p} all_reduce_start / reduce_scatter_start / all_gather_start {dtype:?} vs blocking");
            match res.and_then(|v| v.into_iter().collect::<candle_core::Result<Vec<f64>>>()) {
                Ok(d) => rep.check(&name, d.into_iter().fold(0.0, f64::max), 0.0),
                Err(e) => rep.error(&name, e),
            }
        }
    }
    // all_to_all_v (the experts' exchange) as grouped send/recv: uneven chunks, a rank that
    // sends nothing (rank 1) and one that receives nothing (the last), f32 and bf16: every rank
    // gets exactly the rows the others sent it, in rank order
    {
        let p = n.min(4);
        let ordinals: Vec<usize> = (0..p).collect();
        let rows = |i: usize, j: usize| if i == 1 || j == p - 1 { 0 } else { (i * 3 + j * 5) % 4 + 1 };
        for dtype in [DType::F32, DType::BF16] {
            let input = |i: usize| -> candle_core::Result<Tensor> {
                let m = (0..p).map(|j| rows(i, j)).sum::<usize>().max(1);
                rand_tensor(&[m, 3, 5], 90 + i as u64).map_err(|e| candle_core::Error::Msg(e.to_string()))?.to_dtype(dtype)
            };
            let res = run_nccl_ranks(&ordinals, |g| -> candle_core::Result<f64> {
                let (r, dev) = (g.rank(), g.home_device().unwrap_or(Device::Cpu));
                let send: Vec<usize> = (0..p).map(|j| rows(r, j)).collect();
                let recv: Vec<usize> = (0..p).map(|i| rows(i, r)).collect();
                let got = g.all_to_all_v(&input(r)?.to_device(&dev)?, &send, &recv)?.to_device(&Device::Cpu)?;
                let mut want = Vec::new();
                for i in 0..p {
                    let off: usize = (0..r).map(|j| rows(i, j)).sum();
                    if rows(i, r) > 0 {
                        want.push(input(i)?.narrow(0, off, rows(i, r))?);
                    }
                }
                let want = if want.is_empty() { Tensor::zeros((1, 3, 5), dtype, &Device::Cpu)? } else { Tensor::cat(&want, 0)? };
                if got.dims() != want.dims() {
                    return Ok(f64::INFINITY);
                }
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                Ok((f(&got)? - f(&want)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64)
            });
            let name = format!("nccl ranks P{p} all_to_all_v (uneven rows, empty chunks) {dtype:?}");
            match res.and_then(|v| v.into_iter().collect::<candle_core::Result<Vec<f64>>>()) {
                Ok(d) => rep.check(&name, d.into_iter().fold(0.0, f64::max), 0.0),
                Err(e) => rep.error(&name, e),
            }
        }
    }
    for case in oracle_cases(dir, rep.quick)? {
        let case = case?;
        let t = case.q.dim(1)?;
        for method in CpMethod::ALL {
            for p in [2, 4].into_iter().filter(|&p| p <= n) {
                if t % method.layout().divisor(p) != 0 {
                    continue;
                }
                let name = format!("oracle {} {method} P{p} nccl ranks", case.name);
                let ordinals: Vec<usize> = (0..p).collect();
                let opts = CpOpts { layout: method.layout(), causal: case.causal, scale: Some(case.scale), ..CpOpts::default() };
                match run_case_cp_on(&case, method, p, opts, |body| run_nccl_ranks(&ordinals, body)) {
                    Ok(run) => report_metrics(rep, &name, &run.outputs, &case)?,
                    Err(e) => rep.error(&name, e),
                }
            }
        }
        // masks on NCCL ranks: a sliding window on contiguous shards (the ring stops early and
        // returns dK/dV to their owners with one shift against the ring's direction), packed
        // documents on the zigzag ring; references: the CPU path (itself checked against the
        // oracle rows by sections `window` and `packed`)
        let p = n.min(4);
        let ordinals: Vec<usize> = (0..p).collect();
        if case.causal && t % p == 0 {
            let w = t / 4 + 3;
            let windowed = super::masks::window_case(&case, w)?;
            let name = format!("oracle {} window {w} ring P{p} nccl ranks", case.name);
            let method = CpMethod::Ring(Layout::Contiguous);
            let opts = CpOpts { layout: Layout::Contiguous, causal: true, scale: Some(case.scale), window: Some(w), ..CpOpts::default() };
            match run_case_cp_on(&windowed, method, p, opts, |body| run_nccl_ranks(&ordinals, body)) {
                Ok(run) => report_metrics(rep, &name, &run.outputs, &windowed)?,
                Err(e) => rep.error(&name, e),
            }
        }
        let (packed, po) = super::masks::packed_case(&case)?;
        if po.case.q.dim(1)? % (2 * p) == 0 {
            let name = format!("oracle {} zigzag P{p} nccl ranks", packed.name);
            let method = CpMethod::Ring(Layout::Zigzag);
            let opts = CpOpts { causal: case.causal, scale: Some(case.scale), ..CpOpts::default() }.with_documents(po.documents.clone());
            match run_case_cp_on(&packed, method, p, opts, |body| run_nccl_ranks(&ordinals, body)) {
                Ok(run) => report_metrics(rep, &name, &run.outputs, &packed)?,
                Err(e) => rep.error(&name, e),
            }
        }
        // Ulysses: all-to-all as NCCL grouped send/recv (heads must divide by P)
        let (h, hkv) = (case.q.dim(2)?, case.k.dim(2)?);
        for p in [2, 4].into_iter().filter(|&p| p <= n && h % p == 0 && (hkv % p == 0 || p % hkv == 0) && t % p == 0) {
            let name = format!("oracle {} ulysses P{p} nccl ranks", case.name);
            let ordinals: Vec<usize> = (0..p).collect();
            match gpu_util::run_ulysses_on(&case, p, |body| run_nccl_ranks(&ordinals, body)) {
                Ok(o) => report_metrics(rep, &name, &o, &case)?,
                Err(e) => rep.error(&name, e),
            }
        }
    }
    // the tiny-Llama oracle with TP 2 x CP 2 zigzag + SP on 4 NCCL ranks: NcclGroup::split into
    // the TP and CP sub-groups, TP all-reduces, SP all-gather / reduce-scatter, the zigzag ring
    if n >= 4 {
        use candle_cp_llama::layout::{CpKind, Layout};
        use candle_cp_llama::verify::verify_reference_on;
        use candle_cp_llama::verify::verify_prefix_on;
        let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true);
        let spawn = |body: &candle_cp_llama::verify::LayoutRankBody| run_nccl_ranks(&[0, 1, 2, 3], body);
        let reference = format!("{llama}/reference.safetensors");
        if rep.quick {
            // (the first tokens against the CPU: see super::oracle::QUICK_TOKENS)
            let tokens = super::oracle::QUICK_TOKENS;
            let name = format!("llama tp2 x cp2 zigzag + sp, 4 nccl ranks, first {tokens} tokens vs cpu");
            report_llama(rep, &name, verify_prefix_on(llama, reference, tokens, layout, &Device::Cpu, spawn));
        } else {
            let name = "llama tp2 x cp2 zigzag + sp, 4 nccl ranks";
            report_llama(rep, name, verify_reference_on(llama, reference, layout, &Device::Cpu, spawn));
        }
    }
    Ok(())
}
