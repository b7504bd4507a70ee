//! Causal sliding-window attention (`Mask::Window`, `CpOpts::window`) on one device and
//! through every context-parallel method, against the dense-mask reference and the oracle;
//! the early-stopping ring (a halo exchange for windows shorter than a shard); packed
//! documents with a window; error paths; the balance report.
//!
//! Oracle: the references have no window, but a causal row `i < w` sees every earlier key
//! anyway, so its out/lse under a window of `w` are the oracle's; and a window of at least `T`
//! never binds, so every output and gradient is the oracle's.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks, run_ranks_with, Group, ThreadGroupOptions};
use candle_cp_ops::attention::{attention, attention_docs_mask, attention_docs_mask_slow, attention_slow, Mask};
use candle_cp_ops::cp::ring::active_steps;
use candle_cp_ops::cp::{balance_mask, best_layout, ring_attention, ring_attention_fwd_raw, run_case_cp_with, CpMethod, CpOpts, Layout, MaskSpec};
use candle_cp_ops::oracle::{randn, AttnCase, AttnOutputs, AttnTol};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::usp::{run_case_ulysses_with, run_case_usp_with};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(120);

use candle_cp_tests::{assert_attn_close as check, fwd_bwd as run, load_attn_case as load};

fn random_case(seed: u64, b: usize, t: usize, h: usize, hkv: usize, d: usize) -> Result<AttnCase> {
    let zero = || Tensor::zeros(1, DType::F32, &Device::Cpu);
    Ok(AttnCase {
        name: format!("random b{b} t{t} h{h} kv{hkv} d{d}"),
        causal: true,
        scale: 1.0 / (d as f64).sqrt(),
        sigma: 1.0,
        q: randn(seed, &[b, t, h, d], 1.0)?,
        k: randn(seed + 1, &[b, t, hkv, d], 1.0)?,
        v: randn(seed + 2, &[b, t, hkv, d], 1.0)?,
        dout: randn(seed + 3, &[b, t, h, d], 1.0)?,
        reference: AttnOutputs { out: zero()?, lse: zero()?, dq: zero()?, dk: zero()?, dv: zero()? },
    })
}

#[test]
fn single_device_window_matches_the_dense_reference_and_the_oracle() -> Result<()> {
    let case = random_case(1, 2, 70, 4, 2, 16)?;
    let tol = AttnTol::for_sigma(1.0);
    for w in [1usize, 2, 7, 16, 33, 69, 70, 500] {
        let mask = Mask::sliding_window(w);
        let got = run(&case, &|q, k, v| attention(q, k, v, &mask, case.scale))?;
        let want = run(&case, &|q, k, v| attention_slow(q, k, v, &mask, case.scale))?;
        check(&got, &want, &tol, &format!("window {w}"))?;
    }
    // offsets and strides (a striped shard against another rank's keys)
    for mask in [
        Mask::Window { q_offset: 40, q_stride: 1, k_offset: 10, k_stride: 1, window: 25 },
        Mask::Window { q_offset: 3, q_stride: 4, k_offset: 1, k_stride: 4, window: 30 },
    ] {
        let c = random_case(9, 1, 40, 2, 1, 8)?;
        let got = run(&c, &|q, k, v| attention(q, k, v, &mask, c.scale))?;
        let want = run(&c, &|q, k, v| attention_slow(q, k, v, &mask, c.scale))?;
        check(&got, &want, &tol, &format!("{mask:?}"))?;
    }
    // oracle: a window of T never binds (every tensor), rows < w see all earlier keys
    let case = load("b2_t256_h8_kv2_d64_causal")?;
    let tol = case.tolerances();
    let all = run(&case, &|q, k, v| attention(q, k, v, &Mask::sliding_window(256), case.scale))?;
    check(&all, &case.reference, &tol, "window = T vs oracle")?;
    let w = 50;
    let part = run(&case, &|q, k, v| attention(q, k, v, &Mask::sliding_window(w), case.scale))?;
    let rows = |x: &Tensor, dim: usize| x.narrow(dim, 0, w);
    let eo = candle_cp_ops::oracle::abs_err(&rows(&part.out, 1)?, &rows(&case.reference.out, 1)?)?;
    let el = candle_cp_ops::oracle::abs_err(&rows(&part.lse, 2)?, &rows(&case.reference.lse, 2)?)?;
    assert!(eo <= tol.out_abs && el <= tol.lse_abs, "rows < w vs oracle: out {eo}, lse {el}");
    // and the window binds after that
    let later = candle_cp_ops::oracle::abs_err(&part.out.narrow(1, w, 256 - w)?, &case.reference.out.narrow(1, w, 256 - w)?)?;
    assert!(later > 1e-3, "a window of {w} changed nothing after row {w}: {later}");
    Ok(())
}

/// Every CP method with a window against the single-device window attention (oracle case:
/// its first `w` rows are the oracle's, checked above).
#[test]
fn every_cp_method_with_a_window() -> Result<()> {
    let case = load("b2_t256_h8_kv2_d64_causal")?;
    let tol = case.tolerances();
    for w in [1usize, 24, 64, 65, 100, 256] {
        let mask = Mask::sliding_window(w);
        let single = run(&case, &|q, k, v| attention(q, k, v, &mask, case.scale))?;
        // A window of 1: every query sees only itself, P = 1 and dS = P·(dP - dO·O) = 0, so dQ
        // and dK are exactly 0 and a relative comparison of two roundings is meaningless:
        // assert both are ~0 and compare the rest.
        let check = |got: &AttnOutputs, want: &AttnOutputs, tol: &AttnTol, what: &str| -> Result<()> {
            if w > 1 {
                return check(got, want, tol, what);
            }
            for (name, x) in [("dq", &got.dq), ("dk", &got.dk), ("single dq", &want.dq), ("single dk", &want.dk)] {
                let m = x.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(m < 1e-5, "{what}: window 1: {name} must be ~0, max |{name}| = {m:e}");
            }
            let zeroed = AttnOutputs { dq: want.dq.clone(), dk: want.dk.clone(), ..got.clone() };
            check(&zeroed, want, tol, what)
        };
        for (method, p, rows) in [
            (CpMethod::Ring(Layout::Contiguous), 4, 0),
            (CpMethod::Ring(Layout::Contiguous), 4, 16),
            (CpMethod::Ring(Layout::Zigzag), 4, 0),
            (CpMethod::Ring(Layout::Striped), 4, 0),
            (CpMethod::Ring(Layout::Striped), 2, 16),
            (CpMethod::AllGather(Layout::Zigzag), 4, 0),
            (CpMethod::AllGather(Layout::Contiguous), 2, 24),
        ] {
            let opts = CpOpts { block_rows: rows, ..CpOpts::default() }.with_window(w);
            let run = run_case_cp_with(&case, method, p, TIMEOUT, opts)?;
            check(&run.outputs, &single, &tol, &format!("window {w} {method} P={p} rows={rows}"))?;
        }
        let run = run_case_ulysses_with(&case, 4, Layout::Zigzag, TIMEOUT, None, Some(w))?;
        check(&run.outputs, &single, &tol, &format!("window {w} ulysses P=4 (zigzag order)"))?;
        let run = run_case_usp_with(&case, 2, 2, TIMEOUT, None, Some(w))?;
        check(&run.outputs, &single, &tol, &format!("window {w} 2-D 2x2"))?;
    }
    Ok(())
}

/// Contiguous shards of `T/P` tokens: the ring runs `1 + ceil((w-1)/(T/P))` steps and sends
/// only those hops' K/V; the layouts that spread every chunk's neighbours over all ranks keep
/// the full ring.
#[test]
fn the_ring_stops_after_the_window() -> Result<()> {
    let (p, t, tl) = (4usize, 256usize, 64usize);
    for (w, want) in [(1usize, 1usize), (40, 2), (65, 2), (66, 3), (129, 3), (130, 4), (256, 4)] {
        let opts = CpOpts::new(Layout::Contiguous, true).with_window(w);
        assert_eq!(active_steps(&opts, p, t)?, want, "window {w}");
        assert_eq!(want, (1 + (w - 1).div_ceil(tl)).min(p));
        let res = run_ranks(p, |g: Group| {
            let q = randn(5, &[1, tl, 2, 8], 1.0)?;
            let (_, _, st) = ring_attention_fwd_raw(&q, &q.narrow(2, 0, 1)?, &q.narrow(2, 0, 1)?, &g, &opts)?;
            Ok((st.steps.len(), st.bytes_sent))
        });
        for r in res {
            let (steps, bytes) = r?;
            assert_eq!(steps, want, "window {w}");
            // K and V of one KV head: [2, 1, T/P, 1, 8] f32 per hop
            assert_eq!(bytes, ((want - 1) * 2 * tl * 8 * 4) as u64, "window {w}");
        }
    }
    assert_eq!(active_steps(&CpOpts::new(Layout::Zigzag, true).with_window(40), p, t)?, p);
    assert_eq!(active_steps(&CpOpts::new(Layout::Contiguous, true), p, t)?, p);
    // packed documents that never cross a shard boundary: no hop at all
    let docs = Documents::from_lengths(&[64, 30, 34, 64, 64])?;
    assert_eq!(active_steps(&CpOpts::new(Layout::Contiguous, true).with_documents(docs), p, t)?, 1);
    Ok(())
}

/// Window inside packed documents: every method against the dense reference.
#[test]
fn window_inside_packed_documents() -> Result<()> {
    let docs = Documents::from_lengths(&[9, 40, 3, 44])?; // T = 96
    let mut case = random_case(21, 1, 96, 4, 2, 8)?;
    let w = 12;
    let mask = Mask::sliding_window(w);
    case.reference = run(&case, &|q, k, v| attention_docs_mask_slow(q, k, v, &docs, &mask, case.scale))?;
    let tol = AttnTol::for_sigma(1.0);
    let single = run(&case, &|q, k, v| attention_docs_mask(q, k, v, &docs, &mask, case.scale))?;
    check(&single, &case.reference, &tol, "attention_docs_mask")?;
    for method in [CpMethod::Ring(Layout::Contiguous), CpMethod::Ring(Layout::Zigzag), CpMethod::Ring(Layout::Striped), CpMethod::AllGather(Layout::Zigzag)] {
        let opts = CpOpts { block_rows: 7, ..CpOpts::default() }.with_documents(docs.clone()).with_window(w);
        let run = run_case_cp_with(&case, method, 4, TIMEOUT, opts)?;
        check(&run.outputs, &case.reference, &tol, &format!("{method} docs + window"))?;
    }
    let run = run_case_ulysses_with(&case, 2, Layout::Contiguous, TIMEOUT, Some(docs.clone()), Some(w))?;
    check(&run.outputs, &case.reference, &tol, "ulysses docs + window")?;
    let run = run_case_usp_with(&case, 2, 2, TIMEOUT, Some(docs.clone()), Some(w))?;
    check(&run.outputs, &case.reference, &tol, "2-D docs + window")?;
    Ok(())
}

#[test]
fn window_errors() -> Result<()> {
    let q = randn(1, &[1, 8, 2, 4], 1.0)?;
    // a window needs the causal mask; a window of 0 keys is an error, never a panic
    let opts = ThreadGroupOptions::with_timeout(Duration::from_secs(20));
    let res = run_ranks_with(2, opts.clone(), |g: Group| ring_attention(&q, &q, &q, &g, &CpOpts::new(Layout::Zigzag, false).with_window(4)).map(|_| ()));
    for r in res {
        let e = r.expect_err("window without causal").to_string();
        assert!(e.contains("needs the causal mask"), "{e}");
    }
    let res = run_ranks_with(2, opts.clone(), |g: Group| ring_attention(&q, &q, &q, &g, &CpOpts::default().with_window(0)).map(|_| ()));
    assert!(res.iter().all(|r| r.is_err()));
    assert!(attention(&q, &q, &q, &Mask::sliding_window(0), 0.5).is_err());
    // ranks with different windows: an error on every rank
    let res = run_ranks_with(2, opts, |g: Group| {
        let w = if g.rank() == 0 { 4 } else { 5 };
        ring_attention(&q, &q, &q, &g, &CpOpts::default().with_window(w)).map(|_| ())
    });
    for r in res {
        let e = r.expect_err("disagreeing windows").to_string();
        assert!(e.contains("sliding window"), "{e}");
    }
    // the raw kernel op refuses a window mask (it must be split first)
    let op = candle_cp_ops::attention::AttentionOp::new(Mask::sliding_window(3), 0.5, false);
    assert!(q.apply_op3_no_bwd(&q, &q, &op).is_err());
    Ok(())
}

#[test]
fn balance_with_a_window() -> Result<()> {
    let (p, t, w) = (4usize, 1024usize, 100usize);
    let visible: u64 = (0..t).map(|i| (i + 1).min(w) as u64).sum();
    let spec = MaskSpec { causal: true, window: Some(w), docs: None };
    for layout in Layout::ALL {
        let r = balance_mask(layout, p, t, spec)?;
        assert_eq!(r.pairs.iter().sum::<u64>(), visible, "{layout}");
    }
    // a short window spreads work evenly over contiguous shards: contiguous is (near) best
    let (best, reports) = best_layout(p, t, spec)?;
    let busiest = |l: Layout| reports.iter().find(|r| r.layout == l).and_then(|r| r.pairs.iter().max().copied());
    assert!(busiest(best) <= busiest(Layout::Contiguous));
    assert!(busiest(Layout::Contiguous).unwrap_or(0) as f64 <= 1.01 * visible as f64 / p as f64 + w as f64 * w as f64);
    Ok(())
}
