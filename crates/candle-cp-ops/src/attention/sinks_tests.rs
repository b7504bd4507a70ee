//! Tests of the single-device attention with sinks against the plain-ops reference (the sink as
//! one more softmax column), and of the per-partial mistake the module docs warn about.

use super::super::{attention_band_sinks_slow, attention_fwd, attention_sinks_slow, merge, Band, Mask, RowSums};
use super::*;
use crate::oracle::randn;
use crate::packing::Documents;
use candle_core::{DType, Device, Result, Tensor, Var};

const DIMS: (usize, usize, usize, usize, usize) = (2, 40, 4, 2, 16);

/// q, k, v, dout `[B, T, ·, D]` in `dt`, and sinks `[H]` drawn around `ln(T)` (a sink worth a
/// row's whole mass, give or take `e²`) so that getting them wrong shows.
fn inputs(dt: DType, seed: u64) -> Result<([Tensor; 4], Tensor)> {
    let (b, t, h, hkv, d) = DIMS;
    let r = |s: u64, shape: &[usize]| randn(s, shape, 1.0)?.to_dtype(dt);
    let sinks = (randn(seed + 9, &[h], 2.0)? + (t as f64).ln())?;
    Ok(([r(seed, &[b, t, h, d])?, r(seed + 1, &[b, t, hkv, d])?, r(seed + 2, &[b, t, hkv, d])?, r(seed + 3, &[b, t, h, d])?], sinks))
}

type Attn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>;

/// out, lse, dq, dk, dv, dsinks (f32) of `f` with the gradients of `sum(out · dout)`.
fn run(f: Attn<'_>, x: &[Tensor; 4], sinks: &Tensor) -> Result<Vec<Tensor>> {
    let [q, k, v, z] = [&x[0], &x[1], &x[2], sinks].map(|t| Var::from_tensor(t).expect("var"));
    let (out, lse) = f(q.as_tensor(), k.as_tensor(), v.as_tensor(), z.as_tensor())?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let grads = (f32(&out)? * f32(&x[3])?)?.sum_all()?.backward()?;
    let mut r = vec![f32(&out)?, lse];
    for var in [&q, &k, &v, &z] {
        r.push(f32(grads.get(var.as_tensor()).ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?)?);
    }
    Ok(r)
}

/// `‖a − b‖₂ / ‖b‖₂`.
fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
    let n = |t: &Tensor| -> Result<f32> { t.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>() };
    Ok(n(&(a - b)?)? / n(b)?.max(1e-30))
}

const NAMES: [&str; 6] = ["out", "lse", "dq", "dk", "dv", "dsinks"];

/// Every visibility (full, causal, window, documents per row, rows with no visible key) and
/// both row-sum modes, f32 and bf16: out, lse and all four gradients follow the reference.
#[test]
fn sinks_follow_the_reference() -> Result<()> {
    let (_, t, _, _, d) = DIMS;
    let scale = 1.0 / (d as f64).sqrt();
    let rows = vec![Documents::from_lengths(&[13, 27])?, Documents::from_lengths(&[5, 30, 5])?];
    let band = Band::documents(t, &rows, true, Some(9))?;
    let masks = [Mask::Full, Mask::causal(), Mask::sliding_window(7), Mask::causal_offsets(0, 5)];
    for (dt, tol) in [(DType::F32, 2e-5f32), (DType::BF16, 2.5e-2)] {
        let (x, sinks) = inputs(dt, 11)?;
        for row_sums in [RowSums::Output, RowSums::F32] {
            for mask in &masks {
                let ours = run(&|q, k, v, z| attention_sinks(q, k, v, &Sinks::new(z)?, mask, scale, row_sums), &x, &sinks)?;
                let want = run(&|q, k, v, z| attention_sinks_slow(q, k, v, z, mask, scale), &x, &sinks)?;
                for (i, name) in NAMES.iter().enumerate() {
                    let e = rel(&ours[i], &want[i])?;
                    assert!(e < tol, "{dt:?} {row_sums:?} {mask:?} {name}: rel {e}");
                }
            }
            let ours = run(&|q, k, v, z| attention_band_sinks(q, k, v, &Sinks::new(z)?, &band, scale, row_sums), &x, &sinks)?;
            let want = run(&|q, k, v, z| attention_band_sinks_slow(q, k, v, z, &band, scale), &x, &sinks)?;
            for (i, name) in NAMES.iter().enumerate() {
                let e = rel(&ours[i], &want[i])?;
                assert!(e < tol, "{dt:?} {row_sums:?} band {name}: rel {e}");
            }
        }
    }
    Ok(())
}

/// The sinks matter at the drawn values (the output moves well past the tolerance), very
/// negative sinks give the attention without them, and a row with no visible key gets out 0,
/// lse = its sink.
#[test]
fn sinks_change_the_result_and_vanish_when_very_negative() -> Result<()> {
    let (b, t, h, _, d) = DIMS;
    let scale = 1.0 / (d as f64).sqrt();
    let (x, sinks) = inputs(DType::F32, 3)?;
    let (plain, plain_lse) = attention_fwd(&x[0], &x[1], &x[2], &Mask::causal(), scale)?;
    let (with, _) = attention_sinks(&x[0], &x[1], &x[2], &Sinks::new(&sinks)?, &Mask::causal(), scale, RowSums::Output)?;
    assert!(rel(&with, &plain)? > 0.2, "sinks near ln(T) must move the output: {}", rel(&with, &plain)?);
    let off = Tensor::full(-60f32, h, &Device::Cpu)?;
    let (o, l) = attention_sinks(&x[0], &x[1], &x[2], &Sinks::new(&off)?, &Mask::causal(), scale, RowSums::Output)?;
    assert!(rel(&o, &plain)? < 1e-6 && rel(&l, &plain_lse)? < 1e-6);
    // rows 0..5 see no key under causal offsets (0, 5)
    let (o, l) = attention_sinks(&x[0], &x[1], &x[2], &Sinks::new(&sinks)?, &Mask::causal_offsets(0, 5), scale, RowSums::Output)?;
    assert_eq!(o.narrow(1, 0, 5)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    let want = sinks.reshape((1, h, 1))?.broadcast_as((b, h, 5))?;
    assert_eq!(l.narrow(2, 0, 5)?.to_vec3::<f32>()?, want.to_vec3::<f32>()?);
    assert!(l.narrow(2, 5, t - 5)?.ge(&want.narrow(2, 0, 1)?.broadcast_as((b, h, t - 5))?)?.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()? == 1.0);
    Ok(())
}

/// Applying the sink to each of two partial results and then merging counts `exp(z)` twice:
/// the error the module docs warn about, well above the tolerance of the test above.
#[test]
fn sinks_on_partials_are_wrong() -> Result<()> {
    let (_, t, _, _, d) = DIMS;
    let scale = 1.0 / (d as f64).sqrt();
    let (x, sinks) = inputs(DType::F32, 5)?;
    let half = t / 2;
    let kv = |i: usize, a: usize| x[i].narrow(1, a, half);
    let (oa, la) = attention_fwd(&x[0], &kv(1, 0)?, &kv(2, 0)?, &Mask::Full, scale)?;
    let (ob, lb) = attention_fwd(&x[0], &kv(1, half)?, &kv(2, half)?, &Mask::Full, scale)?;
    let (right, _) = {
        let (o, l) = merge(&oa, &la, &ob, &lb)?;
        apply_sinks(&o, &l, &sinks)?
    };
    let want = attention_sinks_slow(&x[0], &x[1], &x[2], &sinks, &Mask::Full, scale)?.0;
    assert!(rel(&right, &want)? < 2e-5, "{}", rel(&right, &want)?);
    let (oa, la) = apply_sinks(&oa, &la, &sinks)?;
    let (ob, lb) = apply_sinks(&ob, &lb, &sinks)?;
    let wrong = merge(&oa, &la, &ob, &lb)?.0;
    assert!(rel(&wrong, &want)? > 0.05, "{}", rel(&wrong, &want)?);
    Ok(())
}

#[test]
fn bad_sinks_are_refused_by_name() -> Result<()> {
    let (x, _) = inputs(DType::F32, 1)?;
    let two = Tensor::zeros((2, 2), DType::F32, &Device::Cpu)?;
    assert!(Sinks::new(&two).unwrap_err().to_string().contains("[2, 2]"));
    let ints = Tensor::zeros(4, DType::U32, &Device::Cpu)?;
    assert!(Sinks::new(&ints).is_err());
    let three = Sinks::new(&Tensor::zeros(3, DType::F32, &Device::Cpu)?)?;
    let e = attention_sinks(&x[0], &x[1], &x[2], &three, &Mask::causal(), 0.25, RowSums::Output).unwrap_err().to_string();
    assert!(e.contains("3 sink logits") && e.contains("H = 4"), "{e}");
    assert!(three.narrow(2, 2).is_err());
    let a = Sinks::new(&Tensor::zeros(4, DType::F32, &Device::Cpu)?)?;
    assert_eq!(a, a.clone());
    assert_ne!(a, Sinks::new(&Tensor::zeros(4, DType::F32, &Device::Cpu)?)?);
    Ok(())
}
