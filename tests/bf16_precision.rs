//! bf16 accuracy of context-parallel attention does not degrade with the number of ranks.
//! Run with `cargo test --release --test bf16_precision -- --nocapture` to see every figure.
//!
//! Python ring implementations return each step's block output and gradients in bf16 and merge
//! or add those (ring-flash-attention's README calls it a known limitation; its issue #42
//! reports the backward error growing with the world size). Ours keeps the output
//! accumulator, the running LSE and the travelling dK/dV in f32 across every ring step and
//! casts once at the end, so a bf16 run on `P` ranks must be as accurate as the single-device
//! bf16 op — at every `P`, for every method and layout.
//!
//! The yardstick is exact: the inputs are rounded to bf16 first, and the reference is
//! attention on those rounded inputs computed in f64 (plain candle ops and autograd), so the
//! error measured is the computation's alone. For each of out, dq, dk, dv the relative RMS
//! error `‖x − ref‖₂ / ‖ref‖₂` of a CP run must be at most `RATIO` × the single-device op's,
//! and at most `RATIO_F32_OUT` × that of the single-device forward + backward whose
//! `rowsum(dO ∘ O)` is taken from the f32 output as the ring's backward takes it (plus a floor
//! far below bf16's resolution); Ulysses, which runs the op's kernel on gathered heads, at most
//! `RATIO_F32_OUT` × the op's. At P = 2, 4 and 8 the ring-based errors equal the f32-row-sum
//! computation's to four digits: about 1.6e-3, bf16's final rounding and nothing else.
//!
//! The CP gradients are *more* accurate than the single-device autograd op's: that op, like
//! FlashAttention, takes the row sums from the bf16 output it returned, and on a peaked softmax
//! (`q` drawn at deviation 3) its dq/dk errors are 1.58x the ring's (2.6e-3 against 1.7e-3);
//! 1.07x on the causal case at deviation 1. The ring keeps its f32 output for the backward
//! instead (4 bytes per output element held until the backward, against the op's bf16 output
//! that `o_proj` keeps anyway).
//!
//! `attention_with(.., RowSums::F32)` (the op with its row sums from the f32 output, rebuilt
//! from the bf16 output and its bf16 rounding residual) is that computation: within 1.02x of
//! it, 2.6e-3 → 1.7e-3 on the peaked case's dq / dk.
//!
//! Ulysses (P = 2, 4, 8) runs the single-device kernel on the gathered heads, so its errors
//! are the op's, and with `UlyssesOpts::with_row_sums(RowSums::F32)` (P = 2, 4) the f32-row-sum
//! computation's; 2-D Ulysses × ring (2 × 2, 4 × 2) the ring's; the zigzag ring with
//! `CpOpts::with_row_sums(RowSums::Output)` (no residual kept; P = 2, 4) the op's. With fewer KV heads than the
//! Ulysses degree, each KV head is replicated and the copies' gradients are summed: in bf16
//! (as the autograd of the all-to-all ops did here until session 26) that made dk / dv
//! 1.36–1.49x the op's error at P = 2·Hkv (Ulysses and 2-D); the backward now sums them in f32
//! (x1.00).
//!
//! The second test draws random cases (batch, length, heads, KV heads, head dim 32–128, mask,
//! query deviation 0.5–3) on a drawn method and degree with the same bounds; searched
//! `CANDLE_CP_RANDOM_SEEDS=0..2000`: 1,853 checked, 147 refused (degrees the heads or length do
//! not allow), every error within 1.0000x its reference's, 185 s; `2000..5000`: 2,746 checked,
//! 254 refused, the same worst, 180 s.
//!
//! Planted faults these tests catch (tried, then reverted): the travelling dK/dV accumulator
//! rounded to bf16 at each hop (x1.25 / x1.36 on dk / dv at P = 2), each step's block output
//! rounded to bf16 before the merge (x1.41 on out, striped at P = 2), and Ulysses' replicated
//! KV gradients rounded before they are summed (x1.41 / x1.49 at P = 4).

use candle_core::{DType, Result, Tensor, Var, D};
use candle_cp_ops::attention::{attention, attention_with, RowSums};
use candle_cp_ops::cp::{run_case_cp, run_case_cp_with, CpMethod, CpOpts, Layout};
use candle_cp_ops::ulysses::UlyssesOpts;
use candle_cp_ops::usp::{run_case_ulysses, run_case_ulysses_opts, run_case_usp};
use candle_cp_tests::draws::{pick, rng, seeds};
use candle_cp_ops::oracle::{randn, AttnCase, AttnOutputs};
use std::time::Duration;

/// How much worse than the single-device op a CP run may be (relative RMS error).
const RATIO: f64 = 1.15;
/// How much worse than the single-device computation with the f32 output's row sums.
const RATIO_F32_OUT: f64 = 1.02;
/// Below bf16's unit roundoff (2^-9 ≈ 2e-3) by two orders: differences this small are noise.
const FLOOR: f64 = 2e-5;
const TIMEOUT: Duration = Duration::from_secs(120);

/// Attention on `q, k, v` in f64 with plain candle ops, the gradients of `sum(out · dout)`
/// through candle autograd. `q, dout [B, T, H, D]`, `k, v [B, T, Hkv, D]` (GQA: each KV head
/// serves `H / Hkv` query heads).
fn reference_f64(q: &Tensor, k: &Tensor, v: &Tensor, dout: &Tensor, causal: bool, scale: f64) -> Result<AttnOutputs> {
    let f = |x: &Tensor| x.to_dtype(DType::F64);
    let (qv, kv, vv) = (Var::from_tensor(&f(q)?)?, Var::from_tensor(&f(k)?)?, Var::from_tensor(&f(v)?)?);
    let (b, t, h, d) = q.dims4()?;
    let hkv = k.dim(2)?;
    let heads = |x: &Tensor| -> Result<Tensor> {
        // [B, T, Hkv, D] -> [B, H, T, D], each KV head repeated for its query heads
        let x = x.transpose(1, 2)?.unsqueeze(2)?.expand((b, hkv, h / hkv, t, d))?;
        x.reshape((b, h, t, d))
    };
    let qh = qv.as_tensor().transpose(1, 2)?.contiguous()?;
    let (kh, vh) = (heads(kv.as_tensor())?.contiguous()?, heads(vv.as_tensor())?.contiguous()?);
    let mut s = (qh.matmul(&kh.t()?)? * scale)?;
    if causal {
        let m: Vec<f64> = (0..t).flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f64::NEG_INFINITY })).collect();
        s = s.broadcast_add(&Tensor::from_vec(m, (t, t), q.device())?)?;
    }
    let max = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let out = e.broadcast_div(&sum)?.matmul(&vh)?.transpose(1, 2)?;
    let lse = (max + sum.log()?)?.squeeze(D::Minus1)?;
    let grads = (&out * f(dout)?)?.sum_all()?.backward()?;
    let g = |x: &Var, n: &str| grads.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg(format!("no gradient for {n}")));
    Ok(AttnOutputs { out, lse, dq: g(&qv, "q")?, dk: g(&kv, "k")?, dv: g(&vv, "v")? })
}

/// `‖x − ref‖₂ / ‖ref‖₂` in f64.
fn rel_rms(x: &Tensor, reference: &Tensor) -> Result<f64> {
    let r = reference.to_dtype(DType::F64)?;
    let e = (x.to_dtype(DType::F64)? - &r)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    Ok((e / r.sqr()?.sum_all()?.to_scalar::<f64>()?.max(1e-300)).sqrt())
}

/// The relative RMS errors of (out, dq, dk, dv).
fn errors(got: &AttnOutputs, reference: &AttnOutputs) -> Result<[f64; 4]> {
    Ok([
        rel_rms(&got.out, &reference.out)?,
        rel_rms(&got.dq, &reference.dq)?,
        rel_rms(&got.dk, &reference.dk)?,
        rel_rms(&got.dv, &reference.dv)?,
    ])
}

/// A seeded bf16 case `[B, T, H, D]` (`Hkv` KV heads, queries drawn with deviation
/// `q_sigma`: 3 makes the softmax peaked) and its f64 reference.
fn bf16_case(seed: u64, b: usize, [t, h, hkv, d]: [usize; 4], q_sigma: f32, causal: bool) -> Result<AttnCase> {
    let bf = |x: Tensor| x.to_dtype(DType::BF16);
    let q = bf(randn(seed, &[b, t, h, d], q_sigma)?)?;
    let k = bf(randn(seed + 1, &[b, t, hkv, d], 1.0)?)?;
    let v = bf(randn(seed + 2, &[b, t, hkv, d], 1.0)?)?;
    let dout = bf(randn(seed + 3, &[b, t, h, d], 1.0)?)?;
    let scale = 1.0 / (d as f64).sqrt();
    let reference = reference_f64(&q, &k, &v, &dout, causal, scale)?;
    let name = format!("bf16_b{b}_t{t}_h{h}_kv{hkv}_d{d}_q{q_sigma}_{}", if causal { "causal" } else { "full" });
    Ok(AttnCase { name, causal, scale, sigma: 1.0, q, k, v, dout, reference })
}

/// The single-device op on the case (bf16 in, bf16 out and gradients).
fn single(case: &AttnCase) -> Result<AttnOutputs> {
    candle_cp_ops::oracle::run_single_with(case, |q, k, v| attention(q, k, v, &case.mask(), case.scale))
}

/// The single-device autograd op with [`RowSums::F32`]: row sums from the f32 output rebuilt
/// from the bf16 output and its residual.
fn single_f32_rows(case: &AttnCase) -> Result<AttnOutputs> {
    candle_cp_ops::oracle::run_single_with(case, |q, k, v| attention_with(q, k, v, &case.mask(), case.scale, RowSums::F32))
}

/// The raw single-device forward and backward, the backward's row sums taken from the f32
/// output (as the ring's backward takes them).
fn single_f32_out(case: &AttnCase) -> Result<AttnOutputs> {
    let (out32, lse) = candle_cp_ops::attention::attention_fwd(&case.q, &case.k, &case.v, &case.mask(), case.scale)?;
    let (dq, dk, dv) = candle_cp_ops::attention::attention_bwd(&case.q, &case.k, &case.v, &out32, &lse, &case.dout, &case.mask(), case.scale)?;
    let bf = |x: Tensor| x.to_dtype(DType::BF16);
    Ok(AttnOutputs { out: bf(out32)?, lse, dq: bf(dq)?, dk: bf(dk)?, dv: bf(dv)? })
}

fn fmt(e: &[f64; 4]) -> String {
    format!("out {:.3e} dq {:.3e} dk {:.3e} dv {:.3e}", e[0], e[1], e[2], e[3])
}

/// A parallel method of the tests: a CP method on `P` ranks, Ulysses on `P`, or 2-D `U × R`.
#[derive(Clone, Copy, Debug)]
enum Method {
    Cp(CpMethod, usize),
    Ulysses(usize),
    /// Ulysses with [`RowSums::F32`].
    UlyssesF32Rows(usize),
    /// The zigzag ring with [`RowSums::Output`] (row sums from its bf16 output, as the op).
    RingOutputRows(usize),
    Usp(usize, usize),
}

impl Method {
    /// Runs `case` (bf16) on thread ranks: forward + backward, gathered.
    fn run(self, case: &AttnCase) -> Result<AttnOutputs> {
        let run = match self {
            Method::Cp(m, p) => run_case_cp(case, m, p, TIMEOUT)?,
            Method::Ulysses(p) => run_case_ulysses(case, p, Layout::Zigzag, TIMEOUT)?,
            Method::RingOutputRows(p) => {
                let opts = CpOpts::default().with_row_sums(RowSums::Output);
                run_case_cp_with(case, CpMethod::Ring(Layout::Zigzag), p, TIMEOUT, opts)?
            }
            Method::UlyssesF32Rows(p) => {
                let opts = UlyssesOpts::new(case.causal, case.scale).with_row_sums(RowSums::F32);
                run_case_ulysses_opts(case, p, Layout::Zigzag, TIMEOUT, opts)?
            }
            Method::Usp(u, r) => run_case_usp(case, u, r, TIMEOUT)?,
        };
        Ok(run.outputs)
    }

    /// Asserts the bounds on `got`'s errors: Ulysses (the single-device kernel on gathered
    /// heads) and the ring with the op's row sums within `RATIO_F32_OUT` × the op's `base`; the
    /// ring-based methods and Ulysses with
    /// f32 row sums within `RATIO` × `base` and `RATIO_F32_OUT` × `best` (the f32-row-sum
    /// computation's). Returns the largest ratio to the reference bound by `RATIO_F32_OUT`.
    fn check(self, what: &str, got: &[f64; 4], base: &[f64; 4], best: &[f64; 4]) -> f64 {
        let mut worst = 0f64;
        for (((g, b), f), n) in got.iter().zip(base).zip(best).zip(["out", "dq", "dk", "dv"]) {
            let (ok, reference) = match self {
                Method::Ulysses(_) => (*g <= RATIO_F32_OUT * b + FLOOR, b),
                // the op's row sums, the ring's f32 merge: within the op's error
                Method::RingOutputRows(_) => (*g <= RATIO_F32_OUT * b + FLOOR, b),
                _ => (*g <= RATIO * b + FLOOR && *g <= RATIO_F32_OUT * f + FLOOR, f),
            };
            assert!(ok, "{what}: {n} relative RMS error {g:.3e}; single-device op {b:.3e} (bound x{RATIO}), with f32 row sums {f:.3e} (bound x{RATIO_F32_OUT})");
            worst = worst.max(g / reference);
        }
        worst
    }
}

#[test]
fn bf16_cp_error_does_not_grow_with_the_ranks() -> Result<()> {
    let cases = [(401, [512, 4, 2, 64], 1.0, true), (411, [512, 4, 2, 64], 1.0, false), (421, [256, 8, 2, 128], 3.0, true)];
    for (seed, shape, q_sigma, causal) in cases {
        let case = bf16_case(seed, 1, shape, q_sigma, causal)?;
        let base = errors(&single(&case)?, &case.reference)?;
        let best = errors(&single_f32_out(&case)?, &case.reference)?;
        println!("{}: single-device op {}; with the f32 output's row sums {}", case.name, fmt(&base), fmt(&best));
        // the op with RowSums::F32 is that computation (its f32 output rebuilt to 2^-17)
        let rows = errors(&single_f32_rows(&case)?, &case.reference)?;
        println!("  the op with RowSums::F32: {}", fmt(&rows));
        for ((r, f), n) in rows.iter().zip(&best).zip(["out", "dq", "dk", "dv"]) {
            assert!(*r <= RATIO_F32_OUT * f + FLOOR, "{}: the op with f32 row sums, {n} error {r:.3e} against {f:.3e}", case.name);
        }
        // bf16 itself: the single-device op is off by about its unit roundoff, not more
        for (e, n) in base.iter().zip(["out", "dq", "dk", "dv"]) {
            assert!(*e > 1e-4 && *e < 1e-2, "{}: single-device {n} error {e:.3e} is not bf16-sized", case.name);
        }
        let h = case.q.dim(2)?;
        let mut methods = Vec::new();
        for p in [2, 4, 8] {
            for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Striped] {
                methods.push(Method::Cp(CpMethod::Ring(layout), p));
            }
            methods.push(Method::Cp(CpMethod::AllGather(Layout::Zigzag), p));
        }
        // Ulysses runs the single-device kernel on whole sequences of H/P heads: its error is
        // the op's (the row sums from the bf16 output included), KV heads replicated or not
        methods.extend([2, 4, 8].into_iter().filter(|p| h % p == 0).map(Method::Ulysses));
        methods.extend([2, 4].into_iter().filter(|p| h % p == 0).map(Method::UlyssesF32Rows));
        methods.extend([2, 4].map(Method::RingOutputRows));
        methods.extend([(2, 2), (4, 2)].into_iter().filter(|(u, _)| h % u == 0).map(|(u, r)| Method::Usp(u, r)));
        for method in methods {
            let out = method.run(&case)?;
            assert_eq!(out.out.dtype(), DType::BF16);
            let got = errors(&out, &case.reference)?;
            println!("  {method:?}: {} (x{:.3} x{:.3} x{:.3} x{:.3} the op's)", fmt(&got), got[0] / base[0], got[1] / base[1], got[2] / base[2], got[3] / base[3]);
            method.check(&format!("{} {method:?}", case.name), &got, &base, &best);
        }
    }
    Ok(())
}

const RANDOM_CASES: u64 = 24;

/// Seeded random cases (batch, length, heads, KV heads, head dim, mask, query deviation) on a
/// drawn method and degree, with the first test's bounds: ring / all-gather / 2-D within 1.02x
/// the single-device computation with f32 row sums and 1.15x the op; Ulysses within 1.02x the
/// op. `CANDLE_CP_RANDOM_SEEDS=A..B` draws cases `A..B`.
#[test]
fn bf16_random_cases_stay_at_one_device_error() -> Result<()> {
    let (mut checked, mut refused, mut worst) = (0, 0, 0f64);
    let range = seeds(RANDOM_CASES)?;
    let n = range.end - range.start;
    for seed in range {
        let mut d = rng(51000 + seed);
        let b = pick(&mut d, &[1, 2]);
        let t = pick(&mut d, &[64, 96, 128, 192, 256]);
        let (h, hkv) = pick(&mut d, &[(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 1)]);
        let dh = pick(&mut d, &[32, 64, 128]);
        let causal = d.below(3) != 0;
        let q_sigma = pick(&mut d, &[0.5, 1.0, 2.0, 3.0]);
        let p = pick(&mut d, &[2, 4, 8]);
        let method = match d.below(6) {
            0 => Method::Cp(CpMethod::Ring(Layout::Contiguous), p),
            1 => Method::Cp(CpMethod::Ring(Layout::Zigzag), p),
            2 => Method::Cp(CpMethod::Ring(Layout::Striped), p),
            3 => Method::Cp(CpMethod::AllGather(Layout::Zigzag), p),
            // f32 row sums on half the Ulysses draws (own stream: the other draws unchanged)
            4 if rng(52000 + seed).below(2) == 0 => Method::UlyssesF32Rows(p),
            4 => Method::Ulysses(p),
            _ => Method::Usp(pick(&mut d, &[2, 4]), pick(&mut d, &[2, 4])),
        };
        let case = bf16_case(90_000 + 10 * seed, b, [t, h, hkv, dh], q_sigma, causal)?;
        let what = format!("random case {seed}: {} on {method:?}", case.name);
        let out = match method.run(&case) {
            Ok(out) => out,
            Err(e) => {
                // a degree the heads or the length do not allow: refused with the numbers
                let msg = e.to_string();
                assert!(
                    ["divisible", "cannot", "T = ", "H = "].iter().any(|k| msg.contains(k)) && !msg.contains("panicked"),
                    "{what}: refused for an unexpected reason: {msg}"
                );
                refused += 1;
                continue;
            }
        };
        let (base, best) = (errors(&single(&case)?, &case.reference)?, errors(&single_f32_out(&case)?, &case.reference)?);
        let got = errors(&out, &case.reference)?;
        worst = worst.max(method.check(&what, &got, &base, &best));
        checked += 1;
    }
    println!("{checked} bf16 random cases checked, {refused} refused; worst error x{worst:.4} its reference's");
    assert!(checked >= n as usize / 2, "{checked} checked, {refused} refused");
    Ok(())
}
