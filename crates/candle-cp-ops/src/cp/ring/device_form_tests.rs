//! The device form of the CP state ([`LocalState`](super::super::state::LocalState) and
//! [`RowAccum`](super::super::state::RowAccum), used for non-CPU tensors) forced on CPU
//! tensors through the whole ring and all-gather-KV passes: forward and backward equal the
//! host form's, the single-device op's and the oracle's results.

use super::super::shard::{shard, unshard, Layout};
use super::super::state::Residency;
use super::super::{allgather, check_inputs, CpMethod, CpOpts, StepStats};
use crate::oracle::{run_single, run_single_with, AttnCase, AttnMetrics, AttnOutputs};
use crate::Group;
use candle_core::{Result, Tensor};
use candle_cp_comm::run_ranks;
use std::path::PathBuf;

fn load(name: &str) -> Result<AttnCase> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle/attn");
    AttnCase::load(dir.join(format!("{name}.safetensors")))
}

/// One rank's forward `[out, lse]` (f32) and backward `[dq, dk, dv]` with the state in the
/// form `residency` picks for CPU tensors.
fn pass(
    method: CpMethod,
    xs: &[Tensor; 4],
    fwd_state: Option<(&Tensor, &Tensor)>,
    g: &Group,
    opts: &CpOpts,
    residency: Residency,
) -> Result<[Tensor; 5]> {
    let [q, k, v, dout] = xs;
    let dims = check_inputs("device_form_tests", q, k, v, g, opts)?;
    let (out, lse, dq, dk, dv) = match method {
        CpMethod::Ring(_) => {
            let plan = super::StepPlan::new(g, opts, &dims, q.device())?;
            let (o, l, _) = super::fwd(q, k, v, g, opts, &dims, &plan, residency)?;
            // The backward runs on the given forward state (if any), else on its own.
            let (bo, bl) = fwd_state.unwrap_or((&o, &l));
            let (dq, dk, dv, _) = super::bwd(q, k, v, bo, bl, dout, g, opts, &dims, &plan, residency)?;
            (o, l, dq, dk, dv)
        }
        CpMethod::AllGather(_) => {
            let kv = allgather::gather_kv(k, v, g, opts)?;
            let (p, r) = (g.size(), g.rank());
            let (o, l) = allgather::fwd(q, &kv, r, p, opts, &dims, &mut StepStats::default())?;
            let (bo, bl) = fwd_state.unwrap_or((&o, &l));
            let (dq, dk, dv) = allgather::bwd(q, &kv, bo, bl, dout, g, opts, &dims, residency)?;
            (o, l, dq, dk, dv)
        }
    };
    Ok([out, lse, dq, dk, dv])
}

fn flat(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (flat(a)?, flat(b)?);
    assert_eq!(a.len(), b.len());
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
        .fold(0f32, f32::max))
}

/// Run `case` on `p` thread ranks with `method`, the state in host and in device form;
/// per rank: backward with the device-form accumulators on the host forward's (out, lse)
/// equals the host backward bit for bit, the device-form forward is within 1e-6 of the host
/// one; the gathered device-form results (forward and backward both in device form) and the
/// host ones pass the oracle tolerances against the oracle and the single-device op.
fn check(
    case: &AttnCase,
    single: &AttnOutputs,
    method: CpMethod,
    p: usize,
    rows: usize,
) -> Result<()> {
    check_docs(case, single, method, p, rows, None, None)
}

/// [`check`] with attention kept inside packed `documents`.
fn check_docs(
    case: &AttnCase,
    single: &AttnOutputs,
    method: CpMethod,
    p: usize,
    rows: usize,
    documents: Option<crate::packing::Documents>,
    window: Option<usize>,
) -> Result<()> {
    let layout = method.layout();
    let opts = CpOpts {
        layout,
        causal: case.causal,
        scale: Some(case.scale),
        softcap: None,
        overlap: true,
        block_rows: rows,
        check_ranks: true,
        documents,
        row_documents: None,
        window,
        halo: true,
        row_sums: crate::attention::RowSums::F32,
        sinks: None,
    };
    let what = format!("{} {method} P={p} block_rows={rows}", case.name);
    let res = run_ranks(p, |g: Group| {
        let sh = |x: &Tensor| shard(x, layout, g.rank(), p, 1);
        let xs = [sh(&case.q)?, sh(&case.k)?, sh(&case.v)?, sh(&case.dout)?];
        let host = pass(method, &xs, None, &g, &opts, Residency::Auto)?;
        let dev = pass(method, &xs, None, &g, &opts, Residency::ForceDevice)?;
        let mixed = pass(
            method,
            &xs,
            Some((&host[0], &host[1])),
            &g,
            &opts,
            Residency::ForceDevice,
        )?;
        Ok((host, dev, mixed))
    });
    let mut host_all = Vec::new();
    let mut dev_all = Vec::new();
    for (r, x) in res.into_iter().enumerate() {
        let (host, dev, mixed) = x?;
        for (i, n) in ["dq", "dk", "dv"].iter().enumerate() {
            let (h, m) = (&host[2 + i], &mixed[2 + i]);
            assert_eq!(h.dims(), m.dims(), "{what} rank {r} {n}");
            assert_eq!(
                flat(h)?,
                flat(m)?,
                "{what} rank {r}: device-form {n} differs from host"
            );
        }
        for (i, n) in ["out", "lse"].iter().enumerate() {
            let e = max_abs(&host[i], &dev[i])?;
            assert!(
                e <= 1e-6,
                "{what} rank {r}: device-form {n} differs from host by {e}"
            );
        }
        host_all.push(host);
        dev_all.push(dev);
    }
    for (form, all) in [("host", &host_all), ("device", &dev_all)] {
        let col = |i: usize, dim: usize| {
            let ts: Vec<Tensor> = all.iter().map(|x| x[i].clone()).collect();
            unshard(&ts, layout, dim)
        };
        let got = AttnOutputs {
            out: col(0, 1)?,
            lse: col(1, 2)?,
            dq: col(2, 1)?,
            dk: col(3, 1)?,
            dv: col(4, 1)?,
        };
        let tol = case.tolerances();
        for (against, reference) in [("oracle", &case.reference), ("single device", single)] {
            let m = AttnMetrics::compute(&got, reference)?;
            assert!(
                m.passes(&tol),
                "{what}, {form} form vs {against}: {:?}\n{}",
                m.failures(&tol),
                m.report(&tol)
            );
        }
    }
    Ok(())
}

/// GQA, B = 2, causal: every ring layout and all-gather KV at P = 2 and 4, with query rows in
/// chunks of 24 (uneven runs: partly written accumulator rows, prefixes of varying length).
#[test]
fn device_form_matches_host_single_and_oracle_causal_gqa() -> Result<()> {
    let case = load("b2_t256_h8_kv2_d64_causal")?;
    let single = run_single(&case)?;
    let methods = [
        CpMethod::Ring(Layout::Contiguous),
        CpMethod::Ring(Layout::Zigzag),
        CpMethod::Ring(Layout::Striped),
        CpMethod::AllGather(Layout::Zigzag),
    ];
    for p in [2, 4] {
        for m in methods {
            check(&case, &single, m, p, 24)?;
        }
    }
    Ok(())
}

/// Full mask: ring (zigzag) and all-gather KV over the contiguous and striped layouts, one
/// attention call per segment.
#[test]
fn device_form_matches_host_single_and_oracle_full() -> Result<()> {
    let case = load("b1_t64_h4_kv4_d32_full")?;
    let single = run_single(&case)?;
    for m in [
        CpMethod::Ring(Layout::Zigzag),
        CpMethod::AllGather(Layout::Contiguous),
        CpMethod::AllGather(Layout::Striped),
    ] {
        check(&case, &single, m, 4, 1024)?;
    }
    Ok(())
}

/// Packed documents: the causal GQA case packed twice after a 24-token prefix document cut
/// from it (boundaries at 24 and 280, inside shards): every ring layout and all-gather KV,
/// device form = host form, and both match the single-device packed attention
/// (`attention_docs`), whose rows of the two full copies are the oracle's.
#[test]
fn device_form_matches_host_with_packed_documents() -> Result<()> {
    let case = load("b2_t256_h8_kv2_d64_causal")?;
    let t = case.q.dim(1)?;
    let docs = crate::packing::Documents::from_lengths(&[24, t, t])?;
    let pack = |x: &Tensor| Tensor::cat(&[&x.narrow(1, 0, 24)?, x, x], 1);
    let packed = AttnCase {
        name: format!("{} packed [24, {t}, {t}]", case.name),
        q: pack(&case.q)?,
        k: pack(&case.k)?,
        v: pack(&case.v)?,
        dout: pack(&case.dout)?,
        ..case.clone()
    };
    // single-device packed reference through candle autograd
    let single = run_single_with(&packed, |q, k, v| crate::attention::attention_docs(q, k, v, &docs, true, case.scale))?;
    // the two full copies are the oracle case exactly
    let tol = case.tolerances();
    for copy in 0..2 {
        let rows = |x: &Tensor, dim: usize| x.narrow(dim, 24 + copy * t, t);
        let got = AttnOutputs {
            out: rows(&single.out, 1)?,
            lse: rows(&single.lse, 2)?,
            dq: rows(&single.dq, 1)?,
            dk: rows(&single.dk, 1)?,
            dv: rows(&single.dv, 1)?,
        };
        let m = AttnMetrics::compute(&got, &case.reference)?;
        assert!(m.passes(&tol), "packed copy {copy} vs oracle: {}", m.report(&tol));
    }
    let packed = AttnCase { reference: single.clone(), ..packed };
    for m in [
        CpMethod::Ring(Layout::Contiguous),
        CpMethod::Ring(Layout::Zigzag),
        CpMethod::Ring(Layout::Striped),
        CpMethod::AllGather(Layout::Zigzag),
    ] {
        check_docs(&packed, &single, m, 4, 40, Some(docs.clone()), None)?;
    }
    Ok(())
}

/// Sliding window (40 keys, boundaries and row chunks off the window): every ring layout and
/// all-gather KV, device form = host form, both = the single-device window attention, whose
/// first 40 rows are the oracle's (those rows see every earlier key anyway).
#[test]
fn device_form_matches_host_with_a_sliding_window() -> Result<()> {
    let case = load("b2_t256_h8_kv2_d64_causal")?;
    let w = 40;
    let mask = crate::attention::Mask::sliding_window(w);
    let single = run_single_with(&case, |q, k, v| crate::attention::attention(q, k, v, &mask, case.scale))?;
    let tol = case.tolerances();
    let eo = max_abs(&single.out.narrow(1, 0, w)?, &case.reference.out.narrow(1, 0, w)?)?;
    let el = max_abs(&single.lse.narrow(2, 0, w)?, &case.reference.lse.narrow(2, 0, w)?)?;
    assert!(eo as f64 <= tol.out_abs && el as f64 <= tol.lse_abs, "window rows < w vs oracle: out {eo}, lse {el}");
    let windowed = AttnCase { reference: single.clone(), ..case.clone() };
    for m in [
        CpMethod::Ring(Layout::Contiguous),
        CpMethod::Ring(Layout::Zigzag),
        CpMethod::Ring(Layout::Striped),
        CpMethod::AllGather(Layout::Zigzag),
    ] {
        check_docs(&windowed, &single, m, 4, 24, None, Some(w))?;
    }
    Ok(())
}
