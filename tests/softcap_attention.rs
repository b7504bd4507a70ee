//! Logit soft-capping (Gemma 2's `attn_logit_softcapping`, [`Scores`]): the CPU kernels, the
//! plain-candle reference and every context-parallel method against a float64 reference
//! written out here (loops over rows, no candle), outputs and gradients; the cap must change
//! the result (inputs large enough that the logits bend); bad caps and ranks that disagree on
//! the cap are refused. (`cp_random.rs` draws a cap in a third of its configurations too.)

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::attention::{attention, attention_slow, attention_with, Mask, RowSums, Scores};
use candle_cp_ops::cp::{ring_attention, run_case_cp_with, shard, CpMethod, CpOpts, Layout};
use candle_cp_ops::oracle::{randn, AttnCase, AttnOutputs, AttnTol};
use candle_cp_ops::ulysses::UlyssesOpts;
use candle_cp_ops::usp::{run_case_ulysses_opts, run_case_usp_opts, UspOpts};
use candle_cp_tests::{assert_attn_close as check, fwd_bwd};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A case with inputs of standard deviation `sigma` (large: logits past the cap).
fn case(seed: u64, [b, t, h, hkv, d]: [usize; 5], causal: bool, sigma: f32) -> Result<AttnCase> {
    let zero = || Tensor::zeros(1, DType::F32, &Device::Cpu);
    Ok(AttnCase {
        name: format!("softcap b{b} t{t} h{h} kv{hkv} d{d}"),
        causal,
        scale: 1.0 / (d as f64).sqrt(),
        sigma: 1.0,
        q: randn(seed, &[b, t, h, d], sigma)?,
        k: randn(seed + 1, &[b, t, hkv, d], sigma)?,
        v: randn(seed + 2, &[b, t, hkv, d], 1.0)?,
        dout: randn(seed + 3, &[b, t, h, d], 1.0)?,
        reference: AttnOutputs { out: zero()?, lse: zero()?, dq: zero()?, dk: zero()?, dv: zero()? },
    })
}

fn host(x: &Tensor) -> Result<Vec<f64>> {
    x.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Float64 attention with soft-capped logits, and the gradients of `sum(out · dout)`, by the
/// textbook formulas: `s' = c·tanh(scale·q·k / c)`, `P = softmax(s')` over visible keys,
/// `dS' = P ∘ (dP − rowsum(P ∘ dP))`, `dS = dS' ∘ (1 − (s'/c)²)`.
fn reference(c: &AttnCase, mask: &Mask, scores: Scores) -> Result<AttnOutputs> {
    let (b, t, h, d) = c.q.dims4()?;
    let (s, hkv) = (c.k.dim(1)?, c.k.dim(2)?);
    let g = h / hkv;
    let (q, k, v, dout) = (host(&c.q)?, host(&c.k)?, host(&c.v)?, host(&c.dout)?);
    let (mut out, mut lse) = (vec![0f64; b * t * h * d], vec![f64::NEG_INFINITY; b * h * t]);
    let (mut dq, mut dk, mut dv) = (vec![0f64; q.len()], vec![0f64; k.len()], vec![0f64; v.len()]);
    let qi = |bb: usize, i: usize, hh: usize| ((bb * t + i) * h + hh) * d;
    let ki = |bb: usize, j: usize, hk: usize| ((bb * s + j) * hkv + hk) * d;
    for bb in 0..b {
        for hh in 0..h {
            let hk = hh / g;
            for i in 0..t {
                let vis: Vec<usize> = (0..s).filter(|&j| mask.visible(i, j)).collect();
                if vis.is_empty() {
                    continue;
                }
                let (qo, dro) = (qi(bb, i, hh), qi(bb, i, hh));
                let logit: Vec<f64> = vis
                    .iter()
                    .map(|&j| {
                        let x = scores.scale * (0..d).map(|e| q[qo + e] * k[ki(bb, j, hk) + e]).sum::<f64>();
                        scores.softcap.map_or(x, |cap| cap * (x / cap).tanh())
                    })
                    .collect();
                let m = logit.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = logit.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = logit.iter().map(|x| (x - m).exp() / z).collect();
                lse[(bb * h + hh) * t + i] = m + z.ln();
                for (n, &j) in vis.iter().enumerate() {
                    for e in 0..d {
                        out[qo + e] += p[n] * v[ki(bb, j, hk) + e];
                        dv[ki(bb, j, hk) + e] += p[n] * dout[dro + e];
                    }
                }
                let dp: Vec<f64> = vis.iter().map(|&j| (0..d).map(|e| dout[dro + e] * v[ki(bb, j, hk) + e]).sum()).collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (n, &j) in vis.iter().enumerate() {
                    let mut ds = p[n] * (dp[n] - delta);
                    if let Some(cap) = scores.softcap {
                        ds *= 1.0 - (logit[n] / cap).powi(2);
                    }
                    for e in 0..d {
                        dq[qo + e] += scores.scale * ds * k[ki(bb, j, hk) + e];
                        dk[ki(bb, j, hk) + e] += scores.scale * ds * q[qo + e];
                    }
                }
            }
        }
    }
    let f = |x: Vec<f64>, shape: &[usize]| Tensor::from_vec(x, shape, &Device::Cpu)?.to_dtype(DType::F32);
    Ok(AttnOutputs {
        out: f(out, &[b, t, h, d])?,
        lse: f(lse, &[b, h, t])?,
        dq: f(dq, &[b, t, h, d])?,
        dk: f(dk, &[b, s, hkv, d])?,
        dv: f(dv, &[b, s, hkv, d])?,
    })
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

#[test]
fn kernels_and_plain_reference_match_float64() -> Result<()> {
    let tol = AttnTol::for_sigma(2.0);
    // 150 rows: two 128-row tiles of the CPU kernels, the second ragged
    for (mask, causal) in [(Mask::Full, false), (Mask::causal(), true), (Mask::sliding_window(7), true)] {
        for (cap, shape) in [(1.5, [1, 150, 4, 2, 16]), (8.0, [2, 40, 2, 1, 8])] {
            let mut c = case(11, shape, causal, 2.0)?;
            let scores = Scores::new(c.scale).with_softcap(Some(cap));
            c.reference = reference(&c, &mask, scores)?;
            let what = |x: &str| format!("{x}, {mask:?}, cap {cap}, shape {shape:?}");
            check(&fwd_bwd(&c, &|q, k, v| attention(q, k, v, &mask, scores))?, &c.reference, &tol, &what("op"))?;
            check(&fwd_bwd(&c, &|q, k, v| attention_with(q, k, v, &mask, scores, RowSums::F32))?, &c.reference, &tol, &what("f32 row sums"))?;
            check(&fwd_bwd(&c, &|q, k, v| attention_slow(q, k, v, &mask, scores))?, &c.reference, &tol, &what("attention_slow"))?;
            // the cap matters at these sizes: without it every output is far off
            let uncapped = fwd_bwd(&c, &|q, k, v| attention(q, k, v, &mask, c.scale))?;
            for (name, a, b) in [("out", &uncapped.out, &c.reference.out), ("dq", &uncapped.dq, &c.reference.dq), ("dk", &uncapped.dk, &c.reference.dk)] {
                let diff = max_diff(a, b)?;
                assert!(diff > 0.05, "{}: uncapped {name} only {diff} from the capped reference", what("sensitivity"));
            }
        }
    }
    Ok(())
}

#[test]
fn bf16_inputs_match_the_plain_reference() -> Result<()> {
    let mut c = case(23, [1, 64, 4, 2, 32], true, 2.0)?;
    for x in [&mut c.q, &mut c.k, &mut c.v, &mut c.dout] {
        *x = x.to_dtype(DType::BF16)?;
    }
    let scores = Scores::new(c.scale).with_softcap(Some(3.0));
    let mask = Mask::causal();
    c.reference = fwd_bwd(&c, &|q, k, v| attention_slow(q, k, v, &mask, scores))?;
    let got = fwd_bwd(&c, &|q, k, v| attention(q, k, v, &mask, scores))?;
    check(&got, &c.reference, &AttnTol::for_sigma(1.0).scaled(1000.0), "bf16 op vs attention_slow with a cap")
}

#[test]
fn every_parallel_method_matches_float64() -> Result<()> {
    let tol = AttnTol::for_sigma(2.0);
    let shape = [2, 48, 4, 2, 8];
    let cap = 2.0;
    for (window, causal) in [(None, true), (None, false), (Some(5), true)] {
        let mut c = case(31, shape, causal, 2.5)?;
        let scores = Scores::new(c.scale).with_softcap(Some(cap));
        let mask = match window {
            Some(w) => Mask::sliding_window(w),
            None if causal => Mask::causal(),
            None => Mask::Full,
        };
        c.reference = reference(&c, &mask, scores)?;
        let what = |m: &str| format!("{m}, causal {causal}, window {window:?}, cap {cap}");
        for (method, p) in [
            (CpMethod::Ring(Layout::Zigzag), 4),
            (CpMethod::Ring(Layout::Contiguous), 3),
            (CpMethod::Ring(Layout::Striped), 2),
            (CpMethod::AllGather(Layout::Zigzag), 2),
        ] {
            let mut opts = CpOpts::default().with_softcap(Some(cap));
            if let Some(w) = window {
                opts = opts.with_window(w); // w = 5 fits a zigzag chunk: the halo exchange
            }
            let run = run_case_cp_with(&c, method, p, TIMEOUT, opts)?;
            check(&run.outputs, &c.reference, &tol, &what(&format!("{method:?} P {p}")))?;
        }
        let u = UlyssesOpts { window, ..UlyssesOpts::new(causal, c.scale).with_softcap(Some(cap)) };
        let run = run_case_ulysses_opts(&c, 2, Layout::Contiguous, TIMEOUT, u)?;
        check(&run.outputs, &c.reference, &tol, &what("Ulysses P 2"))?;
        let o = UspOpts { window, ..UspOpts::new(causal, c.scale).with_softcap(Some(cap)) };
        let run = run_case_usp_opts(&c, 2, 2, TIMEOUT, o)?;
        check(&run.outputs, &c.reference, &tol, &what("2-D U 2 x R 2"))?;
    }
    Ok(())
}

#[test]
fn bad_caps_are_refused() -> Result<()> {
    let c = case(41, [1, 8, 2, 1, 4], true, 1.0)?;
    for bad in [0.0, -2.0, f64::NAN, f64::INFINITY] {
        let s = Scores::new(0.5).with_softcap(Some(bad));
        let e = attention(&c.q, &c.k, &c.v, &Mask::causal(), s).unwrap_err().to_string();
        assert!(e.contains("soft cap"), "{e}");
        let e = attention_slow(&c.q, &c.k, &c.v, &Mask::causal(), s).unwrap_err().to_string();
        assert!(e.contains("soft cap"), "{e}");
        let (q, k, v) = (c.q.clone(), c.k.clone(), c.v.clone());
        let res = run_ranks(2, move |g: Group| {
            let sh = |x: &Tensor| shard(x, Layout::Zigzag, g.rank(), 2, 1);
            ring_attention(&sh(&q)?, &sh(&k)?, &sh(&v)?, &g, &CpOpts::default().with_softcap(Some(bad)))
        });
        for r in res {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("soft cap"), "{e}");
        }
    }
    Ok(())
}

#[test]
fn ranks_that_disagree_on_the_cap_are_refused() -> Result<()> {
    let c = case(43, [1, 8, 2, 1, 4], true, 1.0)?;
    let (q, k, v) = (c.q.clone(), c.k.clone(), c.v.clone());
    let res = run_ranks(2, move |g: Group| {
        let sh = |x: &Tensor| shard(x, Layout::Zigzag, g.rank(), 2, 1);
        let cap = if g.rank() == 0 { Some(30.0) } else { None };
        ring_attention(&sh(&q)?, &sh(&k)?, &sh(&v)?, &g, &CpOpts::default().with_softcap(cap))
    });
    for r in res {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("soft cap"), "{e}");
    }
    Ok(())
}
