//! Packed sequences (document masks) through every context-parallel attention, against the
//! oracle and the single-device op, on thread ranks; plus error paths and the balance report.
//!
//! Oracle construction (`oracle::PackedOracle`; the references have no documents, so the
//! packed sequence is built from them): a causal case packed after a prefix document cut from
//! its own first `t1` tokens, `[case[..t1] | case]` — the second document is the oracle case
//! exactly (all five tensors), the first one's out/lse are the oracle's first `t1` rows
//! (causal rows do not see later keys); a full-mask case packed twice, `[case | case]` (both
//! copies exact). Any attention across the boundary would change these values. The prefix
//! lengths put the boundaries inside shards (not on chunk edges).

use candle_core::{Result, Tensor};
use candle_cp_comm::{run_ranks_with, Group, ThreadGroupOptions};
use candle_cp_ops::attention::{attention_docs, attention_docs_slow, attention_slow, Mask};
use candle_cp_ops::cp::{balance, balance_docs, best_layout, ring_attention, run_case_cp_with, CpMethod, CpOpts, Layout, MaskSpec};
use candle_cp_ops::oracle::{randn, AttnCase, AttnOutputs, AttnTol, PackedOracle};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::ulysses::{ulysses_attention, UlyssesOpts};
use candle_cp_ops::usp::{run_case_ulysses_with, run_case_usp_with};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(120);

use candle_cp_tests::{assert_attn_close as check, fwd_bwd, load_attn_case as load};

/// Single-device packed attention (`attention_docs`, candle autograd) of `case`'s inputs.
fn single_docs(case: &AttnCase, docs: &Documents) -> Result<AttnOutputs> {
    fwd_bwd(case, &|q, k, v| attention_docs(q, k, v, docs, case.causal, case.scale))
}

/// The reference through plain candle ops with the dense document mask.
fn slow_docs(case: &AttnCase, docs: &Documents) -> Result<AttnOutputs> {
    fwd_bwd(case, &|q, k, v| attention_docs_slow(q, k, v, docs, case.causal, case.scale))
}

/// `got` on the packed oracle case against the oracle rows (`PackedOracle::metrics`).
fn check_against_oracle(got: &AttnOutputs, po: &PackedOracle, what: &str) -> Result<()> {
    let tol = po.case.tolerances();
    let m = po.metrics(got)?;
    assert!(m.passes(&tol), "{what} vs oracle: {:?} over tolerance\n{}", m.failures(&tol), m.report(&tol));
    Ok(())
}

#[test]
fn attention_docs_equals_each_document_alone_and_the_slow_reference() -> Result<()> {
    let lens = [7usize, 1, 20, 17];
    let docs = Documents::from_lengths(&lens)?;
    let t = docs.total_len();
    let dev = candle_core::Device::Cpu;
    for causal in [true, false] {
        let case = AttnCase {
            name: format!("random causal={causal}"),
            causal,
            scale: 0.25,
            sigma: 1.0,
            q: randn(1, &[2, t, 4, 16], 1.0)?,
            k: randn(2, &[2, t, 2, 16], 1.0)?,
            v: randn(3, &[2, t, 2, 16], 1.0)?,
            dout: randn(4, &[2, t, 4, 16], 1.0)?,
            reference: AttnOutputs {
                out: Tensor::zeros(1, candle_core::DType::F32, &dev)?,
                lse: Tensor::zeros(1, candle_core::DType::F32, &dev)?,
                dq: Tensor::zeros(1, candle_core::DType::F32, &dev)?,
                dk: Tensor::zeros(1, candle_core::DType::F32, &dev)?,
                dv: Tensor::zeros(1, candle_core::DType::F32, &dev)?,
            },
        };
        let fast = single_docs(&case, &docs)?;
        let slow = slow_docs(&case, &docs)?;
        check(&fast, &slow, &AttnTol::for_sigma(1.0), &format!("attention_docs vs slow, causal={causal}"))?;
        // each document alone through the plain reference
        let mask = if causal { Mask::causal() } else { Mask::Full };
        for d in 0..docs.count() {
            let (a, b) = docs.range(d);
            let r = |x: &Tensor| x.narrow(1, a, b - a);
            let (o, l) = attention_slow(&r(&case.q)?, &r(&case.k)?, &r(&case.v)?, &mask, case.scale)?;
            let eo = fast.out.narrow(1, a, b - a)?.sub(&o)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let el = fast.lse.narrow(2, a, b - a)?.sub(&l)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(eo < 1e-5 && el < 1e-5, "document {d} causal={causal}: out {eo}, lse {el}");
        }
    }
    Ok(())
}

/// Every method on packed oracle cases: ring (contiguous, zigzag, striped, small row chunks),
/// all-gather KV (zigzag, contiguous, striped), Ulysses (contiguous, zigzag order), 2-D.
#[test]
fn every_cp_method_reproduces_the_oracle_on_packed_sequences() -> Result<()> {
    // packed lengths 88, 280, 1024, 1048, 280, 128, 1024: all split over 2P = 8
    for name in [
        "b1_t64_h4_kv4_d32_causal",
        "b2_t256_h8_kv2_d64_causal",
        "b1_t1000_h6_kv1_d64_causal",
        "b1_t1024_h2_kv1_d128_causal",
        "b1_t256_h4_kv4_d64_causal_sharp",
        "b1_t64_h4_kv4_d32_full",
        "b1_t512_h4_kv2_d128_full",
    ] {
        let case = load(name)?;
        let po = PackedOracle::new(&case)?;
        let (pc, docs) = (&po.case, &po.documents);
        let single = single_docs(pc, docs)?;
        check_against_oracle(&single, &po, &format!("{name} single device"))?;
        let tol = case.tolerances();
        let p = 4;
        for (method, block_rows) in [
            (CpMethod::Ring(Layout::Contiguous), 0),
            (CpMethod::Ring(Layout::Zigzag), 0),
            (CpMethod::Ring(Layout::Zigzag), 24),
            (CpMethod::Ring(Layout::Striped), 0),
            (CpMethod::AllGather(Layout::Zigzag), 0),
            (CpMethod::AllGather(Layout::Contiguous), 0),
            (CpMethod::AllGather(Layout::Striped), 24),
        ] {
            let opts = CpOpts { block_rows, ..CpOpts::default() }.with_documents(docs.clone());
            let run = run_case_cp_with(pc, method, p, TIMEOUT, opts)?;
            let what = format!("{name} {method} P={p} block_rows={block_rows}");
            check(&run.outputs, &single, &tol, &format!("{what} vs single device"))?;
            check_against_oracle(&run.outputs, &po, &what)?;
        }
        let h = case.q.dim(2)?;
        let u = if h % 4 == 0 { 4 } else { 2 };
        for layout in [Layout::Contiguous, Layout::Zigzag] {
            let run = run_case_ulysses_with(pc, u, layout, TIMEOUT, Some(docs.clone()), None)?;
            let what = format!("{name} ulysses P={u} ({layout})");
            check(&run.outputs, &single, &tol, &format!("{what} vs single device"))?;
            check_against_oracle(&run.outputs, &po, &what)?;
        }
        let run = run_case_usp_with(pc, 2, 2, TIMEOUT, Some(docs.clone()), None)?;
        let what = format!("{name} 2-D U=2 R=2");
        check(&run.outputs, &single, &tol, &format!("{what} vs single device"))?;
        check_against_oracle(&run.outputs, &po, &what)?;
    }
    Ok(())
}

/// Many short documents and one-token documents, boundaries everywhere, P = 2, 3 and 4,
/// seeded inputs against the dense-mask reference.
#[test]
fn many_small_documents_every_layout() -> Result<()> {
    let lens = [1usize, 3, 1, 9, 2, 14, 1, 5, 8, 4];
    let docs = Documents::from_lengths(&lens)?; // T = 48
    let t = docs.total_len();
    let dev = candle_core::Device::Cpu;
    let zero = || Tensor::zeros(1, candle_core::DType::F32, &dev);
    for causal in [true, false] {
        let mut case = AttnCase {
            name: format!("short documents causal={causal}"),
            causal,
            scale: 0.3,
            sigma: 1.0,
            q: randn(11, &[1, t, 6, 8], 1.0)?,
            k: randn(12, &[1, t, 3, 8], 1.0)?,
            v: randn(13, &[1, t, 3, 8], 1.0)?,
            dout: randn(14, &[1, t, 6, 8], 1.0)?,
            reference: AttnOutputs { out: zero()?, lse: zero()?, dq: zero()?, dk: zero()?, dv: zero()? },
        };
        case.reference = slow_docs(&case, &docs)?;
        let tol = AttnTol::for_sigma(1.0);
        for p in [2usize, 3, 4] {
            for method in [CpMethod::Ring(Layout::Contiguous), CpMethod::Ring(Layout::Zigzag), CpMethod::Ring(Layout::Striped), CpMethod::AllGather(Layout::Zigzag)] {
                if method.layout().local_len(t, p).is_err() {
                    continue;
                }
                let opts = CpOpts { block_rows: 5, ..CpOpts::default() }.with_documents(docs.clone());
                let run = run_case_cp_with(&case, method, p, TIMEOUT, opts)?;
                check(&run.outputs, &case.reference, &tol, &format!("{} {method} P={p}", case.name))?;
            }
            if candle_cp_ops::ulysses::valid_ulysses_degrees(6, 3).contains(&p) {
                let run = run_case_ulysses_with(&case, p, Layout::Striped, TIMEOUT, Some(docs.clone()), None)?;
                check(&run.outputs, &case.reference, &tol, &format!("{} ulysses P={p} striped", case.name))?;
            }
        }
    }
    Ok(())
}

#[test]
fn documents_must_cover_t_and_agree_across_ranks() -> Result<()> {
    let opts = ThreadGroupOptions::with_timeout(Duration::from_secs(20));
    let q = randn(1, &[1, 8, 2, 4], 1.0)?;
    // documents covering 12 tokens for T = 2·8 = 16
    let res = run_ranks_with(2, opts.clone(), |g: Group| {
        let o = CpOpts::default().with_documents(Documents::from_lengths(&[5, 7])?);
        ring_attention(&q, &q, &q, &g, &o).map(|_| ())
    });
    for r in res {
        let e = r.expect_err("short documents must fail").to_string();
        assert!(e.contains("12 tokens") && e.contains("T = 16"), "{e}");
    }
    // ranks with different boundaries: an error on every rank, not garbage
    let res = run_ranks_with(2, opts.clone(), |g: Group| {
        let lens: &[usize] = if g.rank() == 0 { &[8, 8] } else { &[4, 12] };
        let o = CpOpts::default().with_documents(Documents::from_lengths(lens)?);
        ring_attention(&q, &q, &q, &g, &o).map(|_| ())
    });
    for r in res {
        let e = r.expect_err("disagreeing documents must fail").to_string();
        assert!(e.contains("packed documents"), "{e}");
    }
    // Ulysses: the documents must cover the gathered T
    let res = run_ranks_with(2, opts, |g: Group| {
        let o = UlyssesOpts::new(true, 0.5).with_documents(Documents::from_lengths(&[3, 3])?);
        ulysses_attention(&q, &q, &q, &g, &o).map(|_| ())
    });
    for r in res {
        let e = r.expect_err("ulysses short documents must fail").to_string();
        assert!(e.contains("T = 16"), "{e}");
    }
    // single device: q and k must have the same length, documents must cover it
    let k = randn(2, &[1, 6, 2, 4], 1.0)?;
    let docs = Documents::from_lengths(&[8])?;
    assert!(attention_docs(&q, &k, &k, &docs, true, 0.5).is_err());
    let e = attention_docs(&q, &q, &q, &Documents::from_lengths(&[4])?, true, 0.5).unwrap_err().to_string();
    assert!(e.contains("T = 8") && e.contains("[1, 8, 2, 4]"), "{e}");
    Ok(())
}

#[test]
fn balance_with_documents_and_the_best_layout() -> Result<()> {
    let (p, t) = (4usize, 1024usize);
    // one document: the same report as without documents
    let one = Documents::single(t)?;
    for layout in Layout::ALL {
        for causal in [true, false] {
            assert_eq!(balance_docs(layout, p, t, causal, &one)?.pairs, balance(layout, p, t, causal)?.pairs);
        }
    }
    let (best, _) = best_layout(p, t, MaskSpec { causal: true, window: None, docs: Some(&one) })?;
    assert_eq!(best, Layout::Zigzag);
    // one long document then many short ones: every report counts the mask's visible pairs,
    // and the chosen layout's busiest rank is no busier than any other layout's
    let mut lens = vec![512usize];
    lens.extend(std::iter::repeat_n(16, 32));
    let docs = Documents::from_lengths(&lens)?;
    let visible: u64 = lens.iter().map(|&l| (l * (l + 1) / 2) as u64).sum();
    let (best, reports) = best_layout(p, t, MaskSpec { causal: true, window: None, docs: Some(&docs) })?;
    let busiest = |l: Layout| reports.iter().find(|r| r.layout == l).map(|r| *r.pairs.iter().max().unwrap_or(&0));
    for r in &reports {
        assert_eq!(r.pairs.iter().sum::<u64>(), visible, "{}", r.layout);
        assert!(busiest(best) <= busiest(r.layout), "{best} vs {}", r.layout);
    }
    // contiguous puts the whole long document on ranks 0 and 1: zigzag or striped beat it
    assert_ne!(best, Layout::Contiguous);
    assert!(busiest(Layout::Contiguous) > busiest(best));
    assert!(best_layout(3, 10, MaskSpec::plain(true)).is_err());
    Ok(())
}
