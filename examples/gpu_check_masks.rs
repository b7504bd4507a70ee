//! `gpu_check --sections packed,window,decode` (included by `gpu_check.rs` with `#[path]`):
//! packed sequences (document masks), causal sliding windows and decoding against a sharded
//! KV cache on the GPU.
//!
//! `packed`:
//! Each oracle case is packed as the CPU tests pack it (`oracle::PackedOracle`): a causal case
//! after a prefix document cut from its own first `24 - T mod 8` tokens, a full-mask case
//! twice. Every run is checked twice: against the CPU packed attention (`attention_docs`,
//! autograd) of the same inputs, all rows, and against the oracle rows the packing keeps
//! exact. On the GPU: the single-device
//! `attention_docs`, ring (zigzag, striped) and all-gather KV with the documents on virtual
//! ranks (P = 2, and 4 unless `--quick`), Ulysses P = 2.
//!
//! `window`: each causal oracle case with a window of `T/4 + 3` keys: the CPU window attention
//! (its first `w` rows checked against the oracle), then on the GPU the single-device op (f32,
//! and bf16 through the tensor-core kernels against the f32 CPU result with bf16 bounds), the
//! ring (contiguous: stops after the window's hops, or the halo exchange; zigzag; striped) and
//! all-gather KV on virtual ranks, Ulysses P = 2; and a window of `T/8 + 1` on zigzag P = 2
//! (within one chunk: the halo exchange with both neighbours).
//!
//! `decode`: a prompt's K/V sharded zigzag over P = 2 and 4 virtual ranks plus decoded tokens
//! appended round-robin; `sharded_decode_attention` of the next tokens (f32 and bf16, with and
//! without a window) against the CPU's causal attention of the whole sequence; then DeepSeek's
//! latent rows (576 wide, one buffer as keys and values), which no kernel takes: the dense
//! path on the device.

use super::{case_to, oracle_cases, report_metrics, Report};
use crate::gpu_util::{max_abs, rel};
use anyhow::Result;
use candle_core::{DType, Device};
use candle_cp_ops::attention::{attention, attention_docs, Mask};
use candle_cp_ops::cp::{run_case_cp_with, CpMethod, CpOpts, Layout};
use candle_cp_ops::oracle::{run_single_with, AttnCase, AttnOutputs, PackedOracle};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::usp::run_case_ulysses_with;
use std::time::Duration;

/// Packed attention of `case`'s inputs on their device: out, lse and the gradients of
/// `sum(out · dout)`.
fn packed_single(case: &AttnCase, docs: &Documents) -> candle_core::Result<AttnOutputs> {
    run_single_with(case, |q, k, v| attention_docs(q, k, v, docs, case.causal, case.scale))
}

/// The packed version of an oracle case (CPU) with the CPU packed attention as its
/// reference, and the [`PackedOracle`] that knows the exact rows.
pub fn packed_case(case: &AttnCase) -> Result<(AttnCase, PackedOracle)> {
    let po = PackedOracle::new(case)?;
    let mut packed = po.case.clone();
    packed.reference = packed_single(&po.case, &po.documents)?;
    Ok((packed, po))
}

/// An oracle case with the CPU sliding-window attention (window `w`) as its reference.
pub fn window_case(case: &AttnCase, w: usize) -> Result<AttnCase> {
    let mut windowed = case.clone();
    windowed.name = format!("{} window {w}", case.name);
    windowed.reference = run_window(case, w)?;
    Ok(windowed)
}

/// Window attention (autograd) of `c`'s inputs on their device: out, lse, gradients.
fn run_window(c: &AttnCase, w: usize) -> candle_core::Result<AttnOutputs> {
    run_single_with(c, |q, k, v| attention(q, k, v, &Mask::sliding_window(w), c.scale))
}

/// `got` against the oracle rows of the packed case ([`PackedOracle::metrics`]), one check.
fn oracle_rows(rep: &mut Report, name: &str, po: &PackedOracle, got: &AttnOutputs) -> Result<()> {
    let tol = po.case.tolerances();
    let m = po.metrics(got)?;
    let failures = m.failures(&tol);
    // one line: the worst metric relative to its bound
    let worst = [m.out_abs / tol.out_abs, m.lse_abs / tol.lse_abs, m.dq_rel / tol.dq_rel, m.dk_rel / tol.dk_rel, m.dv_rel / tol.dv_rel]
        .into_iter()
        .fold(0f64, |a, b| if b.is_nan() { f64::NAN } else { a.max(b) });
    rep.check(&format!("{name} vs oracle rows (worst metric / bound{})", if failures.is_empty() { String::new() } else { format!(", over: {failures:?}") }), worst, 1.0);
    Ok(())
}

/// The `packed` section (see the module docs).
pub fn check_packed(rep: &mut Report, gpu: &Device, dir: &str) -> Result<()> {
    for case in oracle_cases(dir, rep.quick)? {
        let case = case?;
        // the CPU path on the same inputs, checked against the oracle rows first
        let (packed, po) = packed_case(&case)?;
        let docs = po.documents.clone();
        oracle_rows(rep, &format!("packed {} CPU path", packed.name), &po, &packed.reference)?;
        let g = case_to(&packed, gpu)?;
        let name = format!("packed {} autograd op", packed.name);
        match packed_single(&g, &docs) {
            Ok(o) => {
                report_metrics(rep, &name, &o, &packed)?;
                oracle_rows(rep, &name, &po, &o)?;
            }
            Err(e) => rep.error(&name, e),
        }
        for method in [CpMethod::Ring(Layout::Zigzag), CpMethod::Ring(Layout::Striped), CpMethod::AllGather(Layout::Zigzag)] {
            for p in [2, 4] {
                if rep.quick && p != 2 {
                    continue;
                }
                let name = format!("packed {} {method} P{p} virtual ranks", packed.name);
                let opts = CpOpts::default().with_documents(docs.clone());
                match run_case_cp_with(&g, method, p, Duration::from_secs(120), opts) {
                    Ok(run) => {
                        report_metrics(rep, &name, &run.outputs, &packed)?;
                        oracle_rows(rep, &name, &po, &run.outputs)?;
                    }
                    Err(e) => rep.error(&name, e),
                }
            }
        }
        if case.q.dim(2)? % 2 == 0 {
            let name = format!("packed {} ulysses P2 virtual ranks", packed.name);
            match run_case_ulysses_with(&g, 2, Layout::Contiguous, Duration::from_secs(120), Some(docs.clone()), None) {
                Ok(run) => {
                    report_metrics(rep, &name, &run.outputs, &packed)?;
                    oracle_rows(rep, &name, &po, &run.outputs)?;
                }
                Err(e) => rep.error(&name, e),
            }
        }
    }
    Ok(())
}

/// The `window` section (see the module docs).
pub fn check_window(rep: &mut Report, gpu: &Device, dir: &str) -> Result<()> {
    for case in oracle_cases(dir, rep.quick)? {
        let case = case?;
        if !case.causal {
            continue;
        }
        let t = case.q.dim(1)?;
        let w = t / 4 + 3;
        let run_mask = |c: &AttnCase| run_window(c, w);
        let windowed = window_case(&case, w)?;
        // the CPU path's rows < w are the oracle's
        let tol = case.tolerances();
        let rows = |x: &candle_core::Tensor, dim: usize| x.narrow(dim, 0, w);
        rep.check(&format!("window {} CPU path rows < w vs oracle out", windowed.name), max_abs(&rows(&windowed.reference.out, 1)?, &rows(&case.reference.out, 1)?)?, tol.out_abs);
        let g = case_to(&windowed, gpu)?;
        let name = format!("window {} autograd op", windowed.name);
        match run_mask(&g) {
            Ok(o) => report_metrics(rep, &name, &o, &windowed)?,
            Err(e) => rep.error(&name, e),
        }
        // bf16 through the default tensor-core kernels, against the CPU path on the same
        // bf16-rounded inputs (f32 compute)
        let round = |x: &candle_core::Tensor| x.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let mut rounded = case.clone();
        for x in [&mut rounded.q, &mut rounded.k, &mut rounded.v, &mut rounded.dout] {
            *x = round(x)?;
        }
        let want = run_mask(&rounded)?;
        let mut b16 = case_to(&rounded, gpu)?;
        for x in [&mut b16.q, &mut b16.k, &mut b16.v, &mut b16.dout] {
            *x = x.to_dtype(DType::BF16)?;
        }
        let name = format!("window {} autograd op bf16", windowed.name);
        match run_mask(&b16) {
            Ok(o) => {
                rep.check(&format!("{name} out"), max_abs(&o.out, &want.out)?, 2e-2 * case.sigma.max(1.0));
                rep.check(&format!("{name} dq"), rel(&o.dq, &want.dq)?, 5e-2);
                rep.check(&format!("{name} dk"), rel(&o.dk, &want.dk)?, 5e-2);
                rep.check(&format!("{name} dv"), rel(&o.dv, &want.dv)?, 5e-2);
            }
            Err(e) => rep.error(&name, e),
        }
        for method in [CpMethod::Ring(Layout::Contiguous), CpMethod::Ring(Layout::Zigzag), CpMethod::Ring(Layout::Striped), CpMethod::AllGather(Layout::Zigzag)] {
            for p in [2, 4] {
                if (rep.quick && p != 2) || method.layout().local_len(t, p).is_err() {
                    continue;
                }
                let name = format!("window {} {method} P{p} virtual ranks", windowed.name);
                match run_case_cp_with(&g, method, p, Duration::from_secs(120), CpOpts::default().with_window(w)) {
                    Ok(run) => report_metrics(rep, &name, &run.outputs, &windowed)?,
                    Err(e) => rep.error(&name, e),
                }
            }
        }
        // a window within one zigzag chunk (T/4 at P = 2): the halo exchange with both
        // neighbours (cp::halo) instead of the ring
        let w2 = t / 8 + 1;
        let near = window_case(&case, w2)?;
        let name = format!("window {} zigzag P2 virtual ranks (halo exchange)", near.name);
        match run_case_cp_with(&case_to(&near, gpu)?, CpMethod::Ring(Layout::Zigzag), 2, Duration::from_secs(120), CpOpts::default().with_window(w2)) {
            Ok(run) => report_metrics(rep, &name, &run.outputs, &near)?,
            Err(e) => rep.error(&name, e),
        }
        if case.q.dim(2)? % 2 == 0 {
            let name = format!("window {} ulysses P2 virtual ranks", windowed.name);
            match run_case_ulysses_with(&g, 2, Layout::Contiguous, Duration::from_secs(120), None, Some(w)) {
                Ok(run) => report_metrics(rep, &name, &run.outputs, &windowed)?,
                Err(e) => rep.error(&name, e),
            }
        }
    }
    Ok(())
}

/// The `decode` section (see the module docs).
pub fn check_decode(rep: &mut Report, gpu: &Device) -> Result<()> {
    use candle_cp_ops::attention::attention_slow;
    let (b, h, hkv, d, t) = (2usize, 8usize, 2usize, 64usize, 96usize);
    let total = t + 2;
    let mk = |shape: &[usize], seed: u64| crate::gpu_util::rand_tensor(shape, seed);
    let (q, k, v) = (mk(&[b, total, h, d], 81)?, mk(&[b, total, hkv, d], 82)?, mk(&[b, total, hkv, d], 83)?);
    let scale = 1.0 / (d as f64).sqrt();
    for window in [None, Some(40)] {
        let mask = window.map_or(Mask::causal(), Mask::sliding_window);
        let (want, _) = attention_slow(&q, &k, &v, &mask, scale)?;
        for dtype in [DType::F32, DType::BF16] {
            for p in [2usize, 4] {
                let name = format!("decode {dtype:?} window {window:?} P{p} virtual ranks");
                decode_on_ranks(rep, &name, gpu, (&q, &k, Some(&v)), (dtype, p, t, scale, window), &want)?;
            }
        }
    }
    // DeepSeek's absorbed decode: every query head against one latent row per token, 576
    // wide, held once as keys and values (`KvShard::append_shared`); no kernel takes that
    // width, so `attention_fwd` runs it from candle ops on the device (`attention/dense.rs`),
    // not on host copies
    let (q, rows) = (mk(&[b, total, h, 576], 86)?, mk(&[b, total, 1, 576], 87)?);
    let scale = 1.0 / 192f64.sqrt();
    let (want, _) = attention_slow(&q, &rows, &rows, &Mask::causal(), scale)?;
    for dtype in [DType::F32, DType::BF16] {
        let name = format!("decode latent rows (576, shared as k and v, dense on the device) {dtype:?} P2 virtual ranks");
        decode_on_ranks(rep, &name, gpu, (&q, &rows, None), (dtype, 2, t, scale, None), &want)?;
    }
    Ok(())
}

/// The first `t` rows of k, v (`v` `None`: `k` is keys and values at once, one buffer) sharded
/// zigzag over `p` virtual ranks on `gpu` in `dtype`, then positions `t` and `t + 1` decoded
/// one at a time (each row appended to its owner first): the output rows against `want`'s.
fn decode_on_ranks(
    rep: &mut Report,
    name: &str,
    gpu: &Device,
    (q, k, v): (&candle_core::Tensor, &candle_core::Tensor, Option<&candle_core::Tensor>),
    (dtype, p, t, scale, window): (DType, usize, usize, f64, Option<usize>),
    want: &candle_core::Tensor,
) -> Result<()> {
    use candle_cp_ops::cp::{decode_owner, positions, shard, sharded_decode_attention, KvShard};
    let cast = |x: &candle_core::Tensor| -> candle_core::Result<candle_core::Tensor> { x.to_dtype(dtype)?.to_device(gpu) };
    let (qg, kg, vg) = (cast(q)?, cast(k)?, v.map(cast).transpose()?);
    let res = candle_cp_comm::run_ranks(p, |g: candle_cp_ops::Group| {
        let r = g.rank();
        let layout = Layout::Zigzag;
        let mut cache = KvShard::new();
        let append = |cache: &mut KvShard, rows: std::ops::Range<usize>, pos: &[usize]| -> candle_core::Result<()> {
            let part = |x: &candle_core::Tensor| -> candle_core::Result<candle_core::Tensor> {
                let x = x.narrow(1, rows.start, rows.len())?;
                if rows.start == 0 { shard(&x, layout, r, p, 1) } else { Ok(x) }
            };
            match &vg {
                Some(vg) => cache.append(&part(&kg)?, &part(vg)?, pos),
                None => cache.append_shared(&part(&kg)?, pos),
            }
        };
        append(&mut cache, 0..t, &positions(layout, r, p, t)?)?;
        let mut outs = Vec::new();
        for qp in [t, t + 1] {
            if decode_owner(qp, p) == r {
                append(&mut cache, qp..qp + 1, &[qp])?;
            }
            outs.push(sharded_decode_attention(&qg.narrow(1, qp, 1)?, &[qp], &cache, &g, scale, window)?.0);
        }
        candle_core::Tensor::cat(&outs, 1)
    });
    let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
    for (r, x) in res.into_iter().enumerate() {
        match x {
            Ok(o) => rep.check(&format!("{name} rank {r} out"), max_abs(&o, &want.narrow(1, t, 2)?)?, tol),
            Err(e) => rep.error(&format!("{name} rank {r}"), e),
        }
    }
    Ok(())
}
