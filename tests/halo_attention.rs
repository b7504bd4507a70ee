//! The halo exchange of `cp::halo`: a causal sliding window whose `w − 1` keys reach at most one
//! chunk back runs (through `ring_attention`, on zigzag and contiguous shards) as an exchange
//! of the `w − 1` K/V rows before each chunk with the ring neighbours and one local band call.
//! Against the dense single-device reference (outputs and gradients, every rank's rows), and
//! against the ring with the exchange off, on P = 2, 3, 4, windows from 1 key to one chunk +
//! 1 (the chunk bound itself and the first window past it, which keeps the ring), with and
//! without packed documents shared by the batch or one set per row; GQA.

use candle_core::{Result, Tensor};
use candle_cp_ops::attention::{attention_docs_mask_slow, Mask};
use candle_cp_ops::cp::{halo, run_case_cp_with, CpMethod, CpOpts, Layout};
use candle_cp_ops::oracle::{AttnCase, AttnOutputs, AttnTol};
use candle_cp_ops::packing::Documents;
use std::time::Duration;

use candle_cp_tests::draws::random_case;
use candle_cp_tests::{assert_attn_close as check, fwd_bwd as run};

const TIMEOUT: Duration = Duration::from_secs(120);

/// The dense reference, batch row by batch row (each with its own documents).
fn reference(c: &AttnCase, docs: &[Documents], w: usize) -> Result<AttnOutputs> {
    let b = c.q.dim(0)?;
    let mut rows = Vec::with_capacity(b);
    for i in 0..b {
        let pick = |x: &Tensor| x.narrow(0, i, 1);
        let one = AttnCase { q: pick(&c.q)?, k: pick(&c.k)?, v: pick(&c.v)?, dout: pick(&c.dout)?, ..c.clone() };
        let d = &docs[i.min(docs.len() - 1)];
        rows.push(run(&one, &|q, k, v| attention_docs_mask_slow(q, k, v, d, &Mask::sliding_window(w), one.scale))?);
    }
    let cat = |f: &dyn Fn(&AttnOutputs) -> Tensor| Tensor::cat(&rows.iter().map(f).collect::<Vec<_>>(), 0);
    Ok(AttnOutputs {
        out: cat(&|o| o.out.clone())?,
        lse: cat(&|o| o.lse.clone())?,
        dq: cat(&|o| o.dq.clone())?,
        dk: cat(&|o| o.dk.clone())?,
        dv: cat(&|o| o.dv.clone())?,
    })
}

#[test]
fn halo_matches_the_dense_reference_and_the_ring() -> Result<()> {
    let (b, t) = (2usize, 48usize);
    let tol = AttnTol::for_sigma(1.0);
    let c = random_case(format!("halo b{b} t{t}"), 7, [b, t, 4, 2, 8], true, Ok)?;
    let one = Documents::single(t)?;
    let shared = Documents::from_lengths(&[5, 17, 1, 14, 11])?;
    let per_row = vec![Documents::from_lengths(&[30, 18])?, Documents::from_lengths(&[3, 1, 44])?];
    let mut halo_runs = 0;
    for (layout, p) in [(Layout::Zigzag, 2), (Layout::Zigzag, 3), (Layout::Zigzag, 4), (Layout::Contiguous, 2), (Layout::Contiguous, 3)] {
        let chunk = if layout == Layout::Zigzag { t / (2 * p) } else { t / p };
        for w in [1, 2, chunk / 2 + 1, chunk + 1, chunk + 2] {
            for (tag, docs) in [("one document", vec![one.clone()]), ("shared documents", vec![shared.clone()]), ("documents per row", per_row.clone())] {
                let what = format!("{layout} P{p} window {w} ({tag})");
                let want = reference(&c, &docs, w)?;
                let mut opts = CpOpts::default().with_window(w);
                opts = match docs.len() {
                    1 if tag == "one document" => opts,
                    1 => opts.with_documents(docs[0].clone()),
                    _ => opts.with_row_documents(docs.clone()),
                };
                let applies = halo::applies(&CpOpts { layout, ..opts.clone() }, p, t);
                assert_eq!(applies, w - 1 <= chunk, "{what}: halo applies");
                halo_runs += applies as usize;
                let got = run_case_cp_with(&c, CpMethod::Ring(layout), p, TIMEOUT, opts.clone())?;
                check(&got.outputs, &want, &tol, &format!("{what}: halo vs dense"))?;
                let ring = run_case_cp_with(&c, CpMethod::Ring(layout), p, TIMEOUT, opts.with_halo(false))?;
                check(&ring.outputs, &want, &tol, &format!("{what}: ring vs dense"))?;
            }
        }
    }
    assert!(halo_runs >= 40, "{halo_runs} halo runs");
    // striped shards border every rank: never a halo
    assert!(!halo::applies(&CpOpts::new(Layout::Striped, true).with_window(2), 2, t));
    Ok(())
}

/// A rank that fails between the forward and the backward (its gradient never exchanged) makes
/// the others' backward return an error within the group's timeout, never hang; ranks that
/// disagree on the window fail on every rank before any exchange.
#[test]
fn a_failing_rank_ends_the_halo_exchange() -> Result<()> {
    use candle_cp_comm::{run_ranks_with, Group, ThreadGroupOptions};
    use candle_cp_ops::cp::ring_attention;
    use std::time::Instant;
    let opts = || ThreadGroupOptions::with_timeout(Duration::from_secs(3));
    let t0 = Instant::now();
    let res = run_ranks_with(3, opts(), |g: Group| {
        let q = candle_core::Var::from_tensor(&candle_cp_ops::oracle::randn(1, &[1, 8, 2, 8], 1.0)?)?;
        let k = candle_core::Var::from_tensor(&candle_cp_ops::oracle::randn(2, &[1, 8, 1, 8], 1.0)?)?;
        let o = CpOpts::new(Layout::Zigzag, true).with_window(3);
        let (out, _) = ring_attention(q.as_tensor(), k.as_tensor(), k.as_tensor(), &g, &o)?;
        if g.rank() == 1 {
            candle_core::bail!("rank 1 gives up before its backward");
        }
        out.sum_all()?.backward().map(|_| ())
    });
    assert!(t0.elapsed() < Duration::from_secs(30), "no hang: {:?}", t0.elapsed());
    for (r, x) in res.into_iter().enumerate() {
        assert!(x.is_err(), "rank {r} must fail (rank 1 never exchanged its gradient)");
    }
    let res = run_ranks_with(2, opts(), |g: Group| {
        let q = candle_cp_ops::oracle::randn(1, &[1, 8, 2, 8], 1.0)?;
        let k = candle_cp_ops::oracle::randn(2, &[1, 8, 1, 8], 1.0)?;
        let o = CpOpts::new(Layout::Zigzag, true).with_window(2 + g.rank());
        ring_attention(&q, &k, &k, &g, &o).map(|_| ())
    });
    for (r, x) in res.into_iter().enumerate() {
        let e = x.err().unwrap_or_else(|| panic!("rank {r} must fail")).to_string();
        assert!(e.contains("sliding window"), "rank {r}: {e}");
    }
    Ok(())
}

/// 2-D Ulysses × ring (`usp_attention`): a window within one chunk of the ring part runs its
/// halo exchange on the head-layout rows, the backward through that graph; against the dense
/// reference with U = 2 × R = 2 and U = 4 × R = 2 (the KV heads replicated), with and without
/// packed documents.
#[test]
fn usp_ring_part_runs_the_halo_exchange() -> Result<()> {
    use candle_cp_ops::usp::run_case_usp_with;
    let (b, t) = (2usize, 48usize);
    let tol = AttnTol::for_sigma(1.0);
    let c = random_case(format!("usp halo b{b} t{t}"), 11, [b, t, 4, 2, 8], true, Ok)?;
    let shared = Documents::from_lengths(&[5, 17, 1, 14, 11])?;
    for (u, r) in [(2usize, 2usize), (4, 2)] {
        let chunk = t / (2 * r);
        for w in [1, 2, chunk / 2 + 1, chunk + 1, chunk + 2] {
            for docs in [None, Some(shared.clone())] {
                let what = format!("U{u} x R{r} window {w} documents {}", docs.is_some());
                let want = reference(&c, &[docs.clone().unwrap_or(Documents::single(t)?)], w)?;
                let ring_part = CpOpts::new(Layout::Zigzag, true).with_window(w);
                assert_eq!(halo::applies(&ring_part, r, t), w - 1 <= chunk, "{what}");
                let got = run_case_usp_with(&c, u, r, TIMEOUT, docs, Some(w))?;
                check(&got.outputs, &want, &tol, &what)?;
            }
        }
    }
    Ok(())
}
