//! [`BwdPrep`]: the backward's key-independent inputs, made once for every call over the same
//! query rows.
//!
//! The backward of a block reads, besides q, k, v and the whole attention's lse, two per-row
//! inputs that do not depend on the keys: delta = rowsum(dO ∘ O) (f32 `[B, H, T]`) and dO. Ring,
//! all-gather and window attention run one backward call per block over the same query rows;
//! [`super::attention_bwd_prepared`] takes a [`BwdPrep`] (or its [`BwdPrep::narrow_rows`]) so
//! that delta (and on CUDA the 16-bit copy of dO the tensor-core kernels read) is made once per
//! backward instead of once per call. [`super::attention_bwd`] is prep + prepared call.
//!
//! ```text
//!  ring step:      0        1        2   ...  P-1
//!  before:   [delta,dO16] [delta,dO16] ...          + kernels      (one prep per step)
//!  now:      [delta,dO16] once, then rows of it     + kernels
//! ```

use super::{check_like, host_f32_ref, kernel, AttnDims};
use candle_core::{Device, Result, Tensor};

/// The key-independent inputs of a backward over query rows `[B, T, H, D]`.
#[derive(Clone, Debug)]
pub struct BwdPrep {
    /// rowsum(dO ∘ O) in f32, `[B, H, T]`, on q's device.
    delta: Tensor,
    /// dO `[B, T, H, D]` as given.
    dout: Tensor,
    /// CUDA, f16/bf16 q: dO rounded to q's dtype `[B, T, H, D]` (the tensor-core kernels' input).
    dout16: Option<Tensor>,
}

impl BwdPrep {
    /// Prepares the backward of the query rows `q [B, T, H, D]` whose whole-attention output is
    /// `out` and upstream gradient `dout` (both `[B, T, H, D]`, on q's device). On CUDA (head
    /// dims of the kernels) one prep kernel; elsewhere the CPU kernel's delta loop on the host.
    pub fn new(q: &Tensor, out: &Tensor, dout: &Tensor) -> Result<Self> {
        let (b, t, h, d) = q.dims4()?;
        check_like("attention backward prep", "out", out, &[b, t, h, d], q)?;
        check_like("attention backward prep", "dout", dout, &[b, t, h, d], q)?;
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() && super::cuda::supported(d) {
            let p = candle_cp_kernels::flash::bwd_prep(out, dout, q.dtype())?;
            return Ok(Self { delta: p.delta, dout: p.dout, dout16: p.dout16 });
        }
        let delta = kernel::delta(&host_f32_ref(out)?, &host_f32_ref(dout)?, (b, t, h, d));
        let delta = Tensor::from_vec(delta, (b, h, t), &Device::Cpu)?.to_device(q.device())?;
        Ok(Self { delta, dout: dout.clone(), dout16: None })
    }

    /// The prep of query rows `start .. start + len` (views, no copy).
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<Self> {
        self.map_rows(|x, dim| x.narrow(dim, start, len))
    }

    /// `f(x, row_dim)` applied to every part (delta's rows are dim 2, dO's dim 1): the window
    /// path flips rows with it.
    pub(crate) fn map_rows(&self, f: impl Fn(&Tensor, usize) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            delta: f(&self.delta, 2)?,
            dout: f(&self.dout, 1)?,
            dout16: self.dout16.as_ref().map(|x| f(x, 1)).transpose()?,
        })
    }

    /// delta = rowsum(dO ∘ O), f32 `[B, H, T]`.
    pub fn delta(&self) -> &Tensor {
        &self.delta
    }

    /// dO `[B, T, H, D]` as given.
    pub fn dout(&self) -> &Tensor {
        &self.dout
    }

    /// Checks the prep against a call's q (shapes, device). Errors name the shapes.
    pub(crate) fn check(&self, op: &str, q: &Tensor, dims: AttnDims) -> Result<()> {
        let AttnDims { b, t, h, d, .. } = dims;
        check_like(op, "prepared delta", &self.delta, &[b, h, t], q)?;
        check_like(op, "prepared dout", &self.dout, &[b, t, h, d], q)
    }

    /// The kernels' form (CUDA).
    #[cfg(feature = "cuda")]
    pub(crate) fn kernel(&self) -> candle_cp_kernels::flash::BwdPrep {
        candle_cp_kernels::flash::BwdPrep { delta: self.delta.clone(), dout: self.dout.clone(), dout16: self.dout16.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{attention_bwd, attention_bwd_band, attention_bwd_band_prepared, attention_bwd_prepared, attention_fwd, attention_slow, Band, Mask};
    use super::*;
    use crate::oracle::randn;

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// Inputs `[B, T, H, D]` / `[B, S, Hkv, D]` (B = 2, GQA) with the forward's out and lse.
    fn case(seed: u64) -> Result<[Tensor; 6]> {
        let (b, t, h, hkv, d) = (2, 40, 4, 2, 8);
        let q = randn(seed, &[b, t, h, d], 1.0)?;
        let k = randn(seed + 1, &[b, t, hkv, d], 1.0)?;
        let v = randn(seed + 2, &[b, t, hkv, d], 1.0)?;
        let dout = randn(seed + 3, &[b, t, h, d], 1.0)?;
        let (out, lse) = attention_fwd(&q, &k, &v, &Mask::causal(), 0.3)?;
        Ok([q, k, v, out, lse, dout])
    }

    /// delta is rowsum(dO ∘ O), `[B, H, T]`, against plain tensor ops.
    #[test]
    fn delta_is_the_row_sum_of_dout_times_out() -> Result<()> {
        let [q, _, _, out, _, dout] = case(10)?;
        let p = BwdPrep::new(&q, &out, &dout)?;
        let want = (&out * &dout)?.sum(3)?.transpose(1, 2)?;
        assert_eq!(p.delta().dims(), &[2, 4, 40]);
        assert!(max_diff(p.delta(), &want)? < 1e-5);
        Ok(())
    }

    /// One prep of all rows, narrowed (a strided view: B = 2), gives the same gradients as the
    /// unprepared call on those rows, for masks and bands; and the whole backward matches
    /// autograd through plain candle ops.
    #[test]
    fn narrowed_prep_equals_the_call_on_the_rows() -> Result<()> {
        let [q, k, v, out, lse, dout] = case(20)?;
        let (r0, n) = (13, 20);
        let prep = BwdPrep::new(&q, &out, &dout)?;
        let rows = |x: &Tensor, dim: usize| x.narrow(dim, r0, n);
        let (qr, lr, pr) = (rows(&q, 1)?, rows(&lse, 2)?, prep.narrow_rows(r0, n)?);
        let mask = Mask::causal_offsets(r0, 0);
        let got = attention_bwd_prepared(&qr, &k, &v, &lr, &pr, &mask, 0.3)?;
        let want = attention_bwd(&qr, &k, &v, &rows(&out, 1)?, &lr, &rows(&dout, 1)?, &mask, 0.3)?;
        for (g, w) in [(&got.0, &want.0), (&got.1, &want.1), (&got.2, &want.2)] {
            assert_eq!(max_diff(g, w)?, 0.0);
        }
        let band = Band::from_mask(&mask, n, 40);
        let got = attention_bwd_band_prepared(&qr, &k, &v, &lr, &pr, &band, 0.3)?;
        let want = attention_bwd_band(&qr, &k, &v, &rows(&out, 1)?, &lr, &rows(&dout, 1)?, &band, 0.3)?;
        for (g, w) in [(&got.0, &want.0), (&got.1, &want.1), (&got.2, &want.2)] {
            assert_eq!(max_diff(g, w)?, 0.0);
        }
        // the whole prepared backward against autograd through candle ops
        let (qv, kv, vv) = (candle_core::Var::from_tensor(&q)?, candle_core::Var::from_tensor(&k)?, candle_core::Var::from_tensor(&v)?);
        let (o, _) = attention_slow(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &Mask::causal(), 0.3)?;
        let g = (o * &dout)?.sum_all()?.backward()?;
        let got = attention_bwd_prepared(&q, &k, &v, &lse, &prep, &Mask::causal(), 0.3)?;
        for (x, w) in [(&qv, &got.0), (&kv, &got.1), (&vv, &got.2)] {
            let d = max_diff(g.get(x.as_tensor()).expect("gradient"), w)?;
            assert!(d < 1e-4, "prepared backward vs autograd: {d}");
        }
        Ok(())
    }

    /// A prep of other rows or on a bad shape is an error naming the shapes, not a panic.
    #[test]
    fn mismatched_prep_is_an_error_with_shapes() -> Result<()> {
        let [q, k, v, out, lse, dout] = case(30)?;
        let prep = BwdPrep::new(&q, &out, &dout)?;
        let e = attention_bwd_prepared(&q.narrow(1, 0, 8)?, &k, &v, &lse.narrow(2, 0, 8)?, &prep, &Mask::causal(), 0.3)
            .expect_err("prep of 40 rows for 8 query rows must fail");
        assert!(e.to_string().contains("[2, 4, 40]") && e.to_string().contains("[2, 8, 4, 8]"), "{e}");
        let e = BwdPrep::new(&q, &out.narrow(1, 0, 8)?, &dout).expect_err("out of other rows must fail");
        assert!(e.to_string().contains("[2, 8, 4, 8]"), "{e}");
        let e = attention_bwd_prepared(&q, &k, &v, &lse.narrow(2, 0, 8)?, &prep, &Mask::causal(), 0.3)
            .expect_err("lse of other rows must fail");
        assert!(e.to_string().contains("lse"), "{e}");
        Ok(())
    }
}
