//! Where the attention backward's row sums `delta = rowsum(dO ∘ O)` take `O` from
//! ([`RowSums`]), and the autograd attention functions that take them from the f32 output.
//!
//! The backward needs `dP − delta` per (query, key) pair; `delta` comes from the output. The
//! kernels compute the output in f32 and return it in q's dtype. FlashAttention (and
//! [`RowSums::Output`], the default) takes `delta` from the returned 16-bit output; on a peaked
//! softmax that rounding is the largest error of dq and dk (1.58x the f32 computation's in
//! `tests/bf16_precision.rs`). [`RowSums::F32`] takes it from the f32 output, rebuilt in the
//! backward from the returned output plus its bf16 rounding residual (2 bytes per output
//! element kept until the backward; [`crate::autograd::attach3_from_f32`]), as the ring and
//! all-gather CP and the 2-D op do by default (their options take a [`RowSums`] too:
//! `CpOpts::row_sums`, `UspOpts::row_sums`; Ulysses: `UlyssesOpts::row_sums`). With f32 inputs
//! nothing is rounded and both modes give the same values.

use super::Scores;
use super::{Band, Mask};
use candle_core::{Result, Tensor};

/// Where the backward's row sums `rowsum(dO ∘ O)` take the output `O` from, when the output is
/// returned in a 16-bit dtype (f32 outputs: both modes are the same computation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RowSums {
    /// The output as returned (bf16 / f16), as FlashAttention does: nothing kept beyond the
    /// output the graph holds anyway.
    #[default]
    Output,
    /// The f32 output, rebuilt from the returned output and its bf16 rounding residual
    /// (`out32 − out`, 2 bytes per output element `[B, T, H, D]`, kept until the backward): dq
    /// and dk as accurate as with an f32 output. The default of the ring kinds and 2-D.
    F32,
}

impl std::fmt::Display for RowSums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RowSums::Output => "from the returned output",
            RowSums::F32 => "from the f32 output",
        })
    }
}

/// [`super::attention`] with [`RowSums::F32`] (shapes already checked): the raw forward on
/// detached inputs (f32 output), the raw backward attached with the rebuilt f32 output
/// ([`super::sinks::attach_mask`], no sinks).
pub(super) fn attention_f32(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: Scores) -> Result<(Tensor, Tensor)> {
    super::sinks::attach_mask("attention (f32 row sums)", q, k, v, None, mask, scale, RowSums::F32)
}

/// [`super::attention_band`] with [`RowSums::F32`] (checked; `band` holds its device copy
/// where the kernels want one).
pub(super) fn attention_band_f32(q: &Tensor, k: &Tensor, v: &Tensor, band: Band, scale: Scores) -> Result<(Tensor, Tensor)> {
    super::sinks::attach_band("attention_band (f32 row sums)", q, k, v, None, band, scale, RowSums::F32)
}

#[cfg(test)]
mod tests {
    use super::super::{
        attention_bwd, attention_fwd, attention_band_with, attention_docs_mask_with, attention_with, Band, Mask,
    };
    use super::RowSums;
    use crate::oracle::randn;
    use crate::packing::Documents;
    use candle_core::{DType, Result, Tensor, Var};

    const DIMS: (usize, usize, usize, usize, usize) = (2, 48, 4, 2, 32);
    type Attn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>;
    type Named = (&'static str, Box<dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>>);

    /// q `[B, T, H, D]` (deviation `sigma`), k, v `[B, T, Hkv, D]`, dout, in `dt`.
    fn inputs(dt: DType, seed: u64, sigma: f32) -> Result<[Tensor; 4]> {
        let (b, t, h, hkv, d) = DIMS;
        let r = |s: u64, shape: &[usize], sg: f32| randn(s, shape, sg)?.to_dtype(dt);
        Ok([r(seed, &[b, t, h, d], sigma)?, r(seed + 1, &[b, t, hkv, d], 1.0)?, r(seed + 2, &[b, t, hkv, d], 1.0)?, r(seed + 3, &[b, t, h, d], 1.0)?])
    }

    /// out, lse, dq, dk, dv (f32) of `f` with the gradients of `sum(out · dout)`.
    fn run(f: Attn<'_>, x: &[Tensor; 4]) -> Result<Vec<Tensor>> {
        let [q, k, v] = [&x[0], &x[1], &x[2]].map(|t| Var::from_tensor(t).expect("var"));
        let (out, lse) = f(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let grads = (f32(&out)? * f32(&x[3])?)?.sum_all()?.backward()?;
        let mut r = vec![f32(&out)?, lse];
        for var in [&q, &k, &v] {
            r.push(f32(grads.get(var.as_tensor()).ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?)?);
        }
        Ok(r)
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// `‖a − b‖₂ / ‖b‖₂`.
    fn rel_rms(a: &Tensor, b: &Tensor) -> Result<f32> {
        let n = |t: &Tensor| -> Result<f32> { t.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>() };
        Ok(n(&(a - b)?)? / n(b)?.max(1e-30))
    }

    /// The visibilities the autograd functions take: a causal mask, a sliding window, a band of
    /// documents per row, and documents shared by the batch.
    fn visibilities(row_sums: RowSums) -> Result<Vec<Named>> {
        let (_, t, _, _, d) = DIMS;
        let scale = 1.0 / (d as f64).sqrt();
        let rows = vec![Documents::from_lengths(&[20, 28])?, Documents::from_lengths(&[5, 30, 13])?];
        let band = Band::documents(t, &rows, true, None)?;
        let shared = Documents::from_lengths(&[17, 31])?;
        Ok(vec![
            ("causal", Box::new(move |q: &Tensor, k: &Tensor, v: &Tensor| attention_with(q, k, v, &Mask::causal(), scale, row_sums))),
            ("window 9", Box::new(move |q: &Tensor, k: &Tensor, v: &Tensor| attention_with(q, k, v, &Mask::sliding_window(9), scale, row_sums))),
            ("documents per row", Box::new(move |q: &Tensor, k: &Tensor, v: &Tensor| attention_band_with(q, k, v, &band, scale, row_sums))),
            ("shared documents", Box::new(move |q: &Tensor, k: &Tensor, v: &Tensor| attention_docs_mask_with(q, k, v, &shared, &Mask::causal(), scale, row_sums))),
        ])
    }

    /// With f32 inputs nothing is rounded: the f32-row-sum functions give the op's out, lse
    /// and gradients exactly, under every visibility.
    #[test]
    fn f32_inputs_give_the_op_values_exactly() -> Result<()> {
        let x = inputs(DType::F32, 700, 1.0)?;
        for ((name, op), (_, f32_rows)) in visibilities(RowSums::Output)?.iter().zip(visibilities(RowSums::F32)?.iter()) {
            let (a, b) = (run(op.as_ref(), &x)?, run(f32_rows.as_ref(), &x)?);
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                assert_eq!(max_abs_diff(a, b)?, 0.0, "{name}: output {i} differs");
            }
        }
        Ok(())
    }

    /// bf16 on a peaked softmax (q at deviation 3): with [`RowSums::F32`] the gradients are
    /// those of the raw forward + backward on the f32 output (the residual rebuilds it to
    /// 2⁻¹⁷), while the op's row sums from the bf16 output move dq and dk visibly.
    #[test]
    fn bf16_f32_row_sums_follow_the_f32_output() -> Result<()> {
        let x = inputs(DType::BF16, 710, 3.0)?;
        let scale = 1.0 / (DIMS.4 as f64).sqrt();
        let mask = Mask::causal();
        let (out32, lse) = attention_fwd(&x[0], &x[1], &x[2], &mask, scale)?;
        let (dq, dk, dv) = attention_bwd(&x[0], &x[1], &x[2], &out32, &lse, &x[3], &mask, scale)?;
        let bf = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let want = [bf(&out32)?, lse, bf(&dq)?, bf(&dk)?, bf(&dv)?];
        let f32_rows = run(&|q: &Tensor, k: &Tensor, v: &Tensor| attention_with(q, k, v, &mask, scale, RowSums::F32), &x)?;
        let op = run(&|q: &Tensor, k: &Tensor, v: &Tensor| attention_with(q, k, v, &mask, scale, RowSums::Output), &x)?;
        for (i, name) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
            let (e_f32, e_op) = (rel_rms(&f32_rows[i], &want[i])?, rel_rms(&op[i], &want[i])?);
            println!("{name}: f32 row sums {e_f32:.3e}, the op {e_op:.3e} (relative RMS to the raw f32-output computation)");
            if ["out", "lse", "dv"].contains(name) {
                // the forward and dV do not read the row sums
                assert_eq!((e_f32, e_op), (0.0, 0.0), "{name}");
            } else {
                // measured 6.9e-5 / 2.1e-4 (a few elements one bf16 step apart) against 3.4e-3
                assert!(e_f32 < 5e-4 && e_op > 10.0 * e_f32, "{name}: f32 row sums {e_f32:.3e}, the op {e_op:.3e}");
            }
        }
        Ok(())
    }
}
