//! Context-parallel attention (ring contiguous / zigzag / striped, all-gather KV) against the
//! oracle cases and the single-device op, on thread ranks; plus error paths.
//!
//! Coverage: every oracle case × every method at P = 2 and P = 4; the small cases (T = 64,
//! 256) also at P = 1 and P = 8; P = 3 (no oracle T is divisible by 3) on seeded inputs
//! against the single-device op and the plain-candle reference. Combinations the layout
//! cannot split must fail with an error naming T, P and the layout.

use candle_core::{DType, Result, Tensor, Var};
use candle_cp_comm::{run_ranks_with, Group, PendingRecv, ProcessGroup, ThreadGroupOptions};
use candle_cp_ops::attention::attention_slow;
use candle_cp_ops::cp::{ring_attention, run_case_cp, run_case_cp_with, CpMethod, CpOpts, Layout};
use candle_cp_ops::oracle::{randn, run_single, AttnCase, AttnMetrics, AttnOutputs, AttnTol};
use candle_cp_tests::oracle_attn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ALL_CASES: [&str; 7] = [
    "b1_t64_h4_kv4_d32_full",
    "b1_t64_h4_kv4_d32_causal",
    "b2_t256_h8_kv2_d64_causal",
    "b1_t1000_h6_kv1_d64_causal",
    "b1_t512_h4_kv2_d128_full",
    "b1_t1024_h2_kv1_d128_causal",
    "b1_t256_h4_kv4_d64_causal_sharp",
];
const SMALL_CASES: [&str; 4] = [
    "b1_t64_h4_kv4_d32_full",
    "b1_t64_h4_kv4_d32_causal",
    "b2_t256_h8_kv2_d64_causal",
    "b1_t256_h4_kv4_d64_causal_sharp",
];
const TIMEOUT: Duration = Duration::from_secs(120);

fn load(name: &str) -> Result<AttnCase> {
    AttnCase::load(oracle_attn(&format!("{name}.safetensors")))
}

fn assert_close(
    got: &AttnOutputs,
    reference: &AttnOutputs,
    tol: &AttnTol,
    what: &str,
) -> Result<()> {
    let m = AttnMetrics::compute(got, reference)?;
    assert!(
        m.passes(tol),
        "{what}: {:?} over tolerance\n{}",
        m.failures(tol),
        m.report(tol)
    );
    Ok(())
}

/// Run `case` with `method` on `p` ranks; check it against the oracle and the single-device
/// op, and the ranks' shapes. Returns false when the layout cannot split T (after checking
/// the error names T, P and the layout).
fn check_case(case: &AttnCase, single: &AttnOutputs, method: CpMethod, p: usize) -> Result<bool> {
    let (b, t, h, d) = case.q.dims4()?;
    let hkv = case.k.dim(2)?;
    let what = format!("{} {method} P={p}", case.name);
    if method.layout().local_len(t, p).is_err() {
        let e = run_case_cp(case, method, p, TIMEOUT)
            .expect_err(&what)
            .to_string();
        assert!(
            e.contains(&format!("T = {t}"))
                && e.contains(&format!("P = {p}"))
                && e.contains(method.layout().name()),
            "{what}: error should name T, P and layout: {e}"
        );
        return Ok(false);
    }
    let run = run_case_cp(case, method, p, TIMEOUT)?;
    let tl = t / p;
    let want = vec![
        vec![b, tl, h, d],
        vec![b, h, tl],
        vec![b, tl, h, d],
        vec![b, tl, hkv, d],
        vec![b, tl, hkv, d],
    ];
    assert_eq!(run.shapes.len(), p, "{what}");
    for (r, s) in run.shapes.iter().enumerate() {
        assert_eq!(s, &want, "{what}: rank {r} local shapes");
    }
    let tol = case.tolerances();
    assert_close(
        &run.outputs,
        &case.reference,
        &tol,
        &format!("{what} vs oracle"),
    )?;
    assert_close(
        &run.outputs,
        single,
        &tol,
        &format!("{what} vs single device"),
    )?;
    Ok(true)
}

fn check_cases(cases: &[&str], ps: &[usize]) -> Result<usize> {
    let mut ran = 0;
    for name in cases {
        let case = load(name)?;
        let single = run_single(&case)?;
        for &p in ps {
            for method in CpMethod::ALL {
                ran += check_case(&case, &single, method, p)? as usize;
            }
        }
    }
    Ok(ran)
}

#[test]
fn oracle_p2_every_case_every_layout() -> Result<()> {
    // T = 64, 256, 512, 1000, 1024 are all divisible by 2P = 4.
    assert_eq!(check_cases(&ALL_CASES, &[2])?, ALL_CASES.len() * 4);
    Ok(())
}

#[test]
fn oracle_p4_every_case_every_layout() -> Result<()> {
    // 2P = 8 divides every oracle T (1000 = 8 · 125).
    assert_eq!(check_cases(&ALL_CASES, &[4])?, ALL_CASES.len() * 4);
    Ok(())
}

#[test]
fn oracle_p1_p3_p8_small_cases() -> Result<()> {
    // No oracle T is divisible by 3: P = 3 must fail with T, P and the layout named (checked in
    // `check_case`); P = 3 runs on seeded inputs in `p3_seeded_matches_single_device_and_slow`.
    assert_eq!(
        check_cases(&SMALL_CASES, &[1, 3, 8])?,
        SMALL_CASES.len() * 4 * 2
    );
    Ok(())
}

#[test]
fn oracle_p8_odd_length_contiguous_and_striped() -> Result<()> {
    // T = 1000 at P = 8: 125 tokens per rank (contiguous, striped); zigzag would need
    // 16 | 1000 and must say so.
    let case = load("b1_t1000_h6_kv1_d64_causal")?;
    let single = run_single(&case)?;
    assert!(check_case(
        &case,
        &single,
        CpMethod::Ring(Layout::Striped),
        8
    )?);
    assert!(!check_case(
        &case,
        &single,
        CpMethod::Ring(Layout::Zigzag),
        8
    )?);
    assert!(!check_case(
        &case,
        &single,
        CpMethod::AllGather(Layout::Zigzag),
        8
    )?);
    Ok(())
}

/// A seeded case whose reference is the single-device autograd op.
fn seeded_case(
    seed: u64,
    b: usize,
    t: usize,
    h: usize,
    hkv: usize,
    d: usize,
    causal: bool,
) -> Result<AttnCase> {
    let q = randn(seed, &[b, t, h, d], 1.0)?;
    let k = randn(seed + 1, &[b, t, hkv, d], 1.0)?;
    let v = randn(seed + 2, &[b, t, hkv, d], 1.0)?;
    let dout = randn(seed + 3, &[b, t, h, d], 1.0)?;
    let mut case = AttnCase {
        name: format!(
            "seeded_b{b}_t{t}_h{h}_kv{hkv}_d{d}_{}",
            if causal { "causal" } else { "full" }
        ),
        causal,
        scale: 1.0 / (d as f64).sqrt(),
        sigma: 1.0,
        q: q.clone(),
        k: k.clone(),
        v: v.clone(),
        dout: dout.clone(),
        reference: AttnOutputs {
            out: q.clone(),
            lse: q.clone(),
            dq: q.clone(),
            dk: k.clone(),
            dv: v.clone(),
        },
    };
    case.reference = run_single(&case)?;
    Ok(case)
}

/// Plain-candle reference (attention_slow through candle autograd).
fn slow_reference(case: &AttnCase) -> Result<AttnOutputs> {
    let (q, k, v) = (
        Var::from_tensor(&case.q)?,
        Var::from_tensor(&case.k)?,
        Var::from_tensor(&case.v)?,
    );
    let (out, lse) = attention_slow(
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        &case.mask(),
        case.scale,
    )?;
    let grads = (&out * &case.dout)?.sum_all()?.backward()?;
    let g = |x: &Var| grads.get(x.as_tensor()).cloned().expect("gradient");
    Ok(AttnOutputs {
        out,
        lse,
        dq: g(&q),
        dk: g(&k),
        dv: g(&v),
    })
}

#[test]
fn p3_seeded_matches_single_device_and_slow() -> Result<()> {
    // T = 96: divisible by 2P = 6; GQA 6 query heads over 2 KV heads; batch 2.
    for causal in [true, false] {
        let case = seeded_case(7 + causal as u64, 2, 96, 6, 2, 16, causal)?;
        let slow = slow_reference(&case)?;
        let tol = case.tolerances();
        assert_close(&case.reference, &slow, &tol, "single device vs slow")?;
        for method in CpMethod::ALL {
            let run = run_case_cp(&case, method, 3, TIMEOUT)?;
            assert_close(
                &run.outputs,
                &case.reference,
                &tol,
                &format!("{} {method} P=3 vs single", case.name),
            )?;
            assert_close(
                &run.outputs,
                &slow,
                &tol,
                &format!("{} {method} P=3 vs slow", case.name),
            )?;
        }
    }
    Ok(())
}

#[test]
fn query_row_chunking_matches_oracle() -> Result<()> {
    // block_rows = 13 splits every segment (zigzag halves of 64/8 = 8.. up to 256 rows) into
    // uneven chunks, including chunks that straddle the diagonal and chunks that are skipped.
    for name in ["b1_t64_h4_kv4_d32_causal", "b2_t256_h8_kv2_d64_causal"] {
        let case = load(name)?;
        for p in [1usize, 2, 4] {
            for method in CpMethod::ALL {
                let run = run_case_cp_with(
                    &case,
                    method,
                    p,
                    TIMEOUT,
                    CpOpts {
                        block_rows: 13,
                        // also exercises the unchecked path (no cross-rank shape all-gather)
                        check_ranks: p != 2,
                        ..CpOpts::default()
                    },
                )?;
                assert_close(
                    &run.outputs,
                    &case.reference,
                    &case.tolerances(),
                    &format!("{name} {method} P={p} block_rows=13"),
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn overlap_off_gives_identical_results() -> Result<()> {
    // Waiting for each transfer before computing changes timing only, never the numbers.
    let case = load("b2_t256_h8_kv2_d64_causal")?;
    for method in [
        CpMethod::Ring(Layout::Zigzag),
        CpMethod::Ring(Layout::Striped),
    ] {
        let on = run_case_cp(&case, method, 4, TIMEOUT)?.outputs;
        let off = run_case_cp_with(
            &case,
            method,
            4,
            TIMEOUT,
            CpOpts {
                overlap: false,
                ..CpOpts::default()
            },
        )?
        .outputs;
        for (a, b, n) in [
            (&on.out, &off.out, "out"),
            (&on.lse, &off.lse, "lse"),
            (&on.dq, &off.dq, "dq"),
            (&on.dk, &off.dk, "dk"),
            (&on.dv, &off.dv, "dv"),
        ] {
            let (a, b) = (
                a.flatten_all()?.to_vec1::<f32>()?,
                b.flatten_all()?.to_vec1::<f32>()?,
            );
            assert!(a == b, "{method}: {n} differs with overlap off");
        }
    }
    Ok(())
}

#[test]
fn bf16_ring_matches_f32_single_device_loosely() -> Result<()> {
    let case = seeded_case(21, 1, 64, 4, 2, 32, true)?;
    let bf = |x: &Tensor| x.to_dtype(DType::BF16);
    let mut bcase = case.clone();
    (bcase.q, bcase.k, bcase.v, bcase.dout) =
        (bf(&case.q)?, bf(&case.k)?, bf(&case.v)?, bf(&case.dout)?);
    for method in [
        CpMethod::Ring(Layout::Zigzag),
        CpMethod::AllGather(Layout::Zigzag),
    ] {
        let run = run_case_cp(&bcase, method, 2, TIMEOUT)?;
        assert_eq!(run.outputs.out.dtype(), DType::BF16, "out keeps q's dtype");
        assert_eq!(run.outputs.lse.dtype(), DType::F32, "lse is f32");
        assert_eq!(run.outputs.dk.dtype(), DType::BF16);
        // bf16 inputs and outputs: ~3 significant digits.
        assert_close(
            &run.outputs,
            &case.reference,
            &AttnTol::for_sigma(1.0).scaled(2000.0),
            &format!("bf16 {method}"),
        )?;
    }
    Ok(())
}

fn opts_short() -> ThreadGroupOptions {
    ThreadGroupOptions::with_timeout(Duration::from_secs(10))
}

#[test]
fn divisibility_errors_name_t_p_layout() -> Result<()> {
    // Global T = 60 cannot be zigzagged over 8 ranks (needs 16 | T).
    let case = load("b1_t64_h4_kv4_d32_causal")?;
    let mut odd = case.clone();
    odd.q = case.q.narrow(1, 0, 60)?;
    odd.k = case.k.narrow(1, 0, 60)?;
    odd.v = case.v.narrow(1, 0, 60)?;
    odd.dout = case.dout.narrow(1, 0, 60)?;
    let e = run_case_cp(&odd, CpMethod::Ring(Layout::Zigzag), 8, TIMEOUT)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("T = 60") && e.contains("P = 8") && e.contains("zigzag"),
        "{e}"
    );
    // Local shards of odd length cannot be zigzag halves: every rank errs, naming T and P.
    let res = run_ranks_with(2, opts_short(), |g: Group| {
        let q = randn(1, &[1, 3, 2, 8], 1.0)?;
        let k = randn(2, &[1, 3, 2, 8], 1.0)?;
        ring_attention(&q, &k, &k, &g, &CpOpts::new(Layout::Zigzag, true))
    });
    for r in res {
        let e = r.expect_err("odd zigzag shard must fail").to_string();
        assert!(
            e.contains("T = 6") && e.contains("P = 2") && e.contains("zigzag"),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn mismatched_shapes_across_ranks_fail_on_every_rank() -> Result<()> {
    let t0 = Instant::now();
    let res = run_ranks_with(3, opts_short(), |g: Group| {
        let tl = if g.rank() == 1 { 8 } else { 4 };
        let q = randn(1, &[1, tl, 2, 8], 1.0)?;
        let k = randn(2, &[1, tl, 1, 8], 1.0)?;
        ring_attention(&q, &k, &k, &g, &CpOpts::new(Layout::Contiguous, true))
    });
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "no hang: {:?}",
        t0.elapsed()
    );
    for (r, x) in res.into_iter().enumerate() {
        let e = x
            .err()
            .unwrap_or_else(|| panic!("rank {r} must fail"))
            .to_string();
        assert!(
            e.contains("[1, 4, 2, 1, 8]") && e.contains("[1, 8, 2, 1, 8]"),
            "rank {r}: error should name the shapes: {e}"
        );
    }
    // Local shape errors: H not a multiple of Hkv, k/v shapes differ.
    let res = run_ranks_with(2, opts_short(), |g: Group| {
        let q = randn(1, &[1, 4, 6, 8], 1.0)?;
        let k = randn(2, &[1, 4, 4, 8], 1.0)?;
        ring_attention(&q, &k, &k, &g, &CpOpts::new(Layout::Striped, false))
    });
    for x in res {
        let e = x.expect_err("GQA mismatch must fail").to_string();
        assert!(
            e.contains("[1, 4, 6, 8]") && e.contains("[1, 4, 4, 8]"),
            "{e}"
        );
    }
    Ok(())
}

/// A process group whose `send_recv` fails on its `fail_at`-th call (0-based), to simulate a
/// rank whose transport breaks in the middle of the ring.
struct FailingGroup {
    inner: Group,
    calls: AtomicUsize,
    fail_at: usize,
}

impl ProcessGroup for FailingGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.inner.reduce_scatter(t, dim)
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        self.inner.all_reduce(t)
    }
    fn all_to_all(&self, t: &Tensor, s: usize, c: usize) -> Result<Tensor> {
        self.inner.all_to_all(t, s, c)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
    fn send_recv(&self, t: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv>> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == self.fail_at {
            candle_core::bail!("injected transport failure on rank {}", self.rank())
        }
        self.inner.send_recv(t, dst, src)
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn ProcessGroup>> {
        self.inner.split(color, key)
    }
}

#[test]
fn rank_failing_mid_ring_fails_all_ranks_quickly() -> Result<()> {
    let p = 4;
    // Forward ring: P-1 = 3 K/V hops; fail at hop 1. Backward: the forward's 3 hops, then
    // K/V and dK/dV hops interleave; fail at call 5 (inside the backward ring).
    for fail_at in [1usize, 5] {
        let t0 = Instant::now();
        let res = run_ranks_with(p, opts_short(), |g: Group| {
            let g: Group = if g.rank() == 1 {
                Arc::new(FailingGroup {
                    inner: g,
                    calls: AtomicUsize::new(0),
                    fail_at,
                })
            } else {
                g
            };
            let q = Var::from_tensor(&randn(1, &[1, 8, 2, 8], 1.0)?)?;
            let k = Var::from_tensor(&randn(2, &[1, 8, 1, 8], 1.0)?)?;
            let v = Var::from_tensor(&randn(3, &[1, 8, 1, 8], 1.0)?)?;
            let (out, _) = ring_attention(
                q.as_tensor(),
                k.as_tensor(),
                v.as_tensor(),
                &g,
                &CpOpts::new(Layout::Zigzag, true),
            )?;
            let grads = out.sum_all()?.backward()?;
            Ok(grads.get(k.as_tensor()).is_some())
        });
        let el = t0.elapsed();
        assert!(
            el < Duration::from_secs(5),
            "fail_at {fail_at}: ranks took {el:?} (should abort, not time out)"
        );
        for (r, x) in res.into_iter().enumerate() {
            assert!(
                x.is_err(),
                "fail_at {fail_at}: rank {r} returned Ok although rank 1 failed"
            );
        }
    }
    Ok(())
}
