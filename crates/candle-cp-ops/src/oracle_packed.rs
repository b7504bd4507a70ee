//! Packed versions of the oracle cases (the references have no documents; packing builds a
//! sequence whose exact values are still known), shared by the tests, `gpu_check` and
//! `candle-cp verify attn --packed`.
//!
//! - causal case of length `T`: `[case[..t1] | case]` with `t1 = 24 - T mod 8` (so the packed
//!   length splits over 2P = 8 and both boundaries fall off chunk edges for small P). The
//!   second document is the oracle case exactly (all five tensors); the first one's out and
//!   lse are the oracle's first `t1` rows (causal rows never see later keys). Its gradients
//!   are not the oracle's (later queries of the case are missing) and are not compared.
//! - full-mask case: `[case | case]`, both copies exact.
//!
//! Any attention across the boundary changes these values.

use super::{AttnCase, AttnMetrics, AttnOutputs};
use crate::packing::Documents;
use crate::attention::attention_docs;
use candle_core::{Result, Tensor};

/// An oracle case packed with documents (see the module docs).
#[derive(Clone, Debug)]
pub struct PackedOracle {
    /// The packed inputs `q, k, v, dout [B, T', ..]`; `reference` is the unpacked oracle
    /// case's (compare with [`PackedOracle::metrics`], not field by field).
    pub case: AttnCase,
    /// The documents of the packed sequence (two).
    pub documents: Documents,
}

fn rows(x: &AttnOutputs, a: usize, n: usize) -> Result<AttnOutputs> {
    Ok(AttnOutputs {
        out: x.out.narrow(1, a, n)?,
        lse: x.lse.narrow(2, a, n)?,
        dq: x.dq.narrow(1, a, n)?,
        dk: x.dk.narrow(1, a, n)?,
        dv: x.dv.narrow(1, a, n)?,
    })
}

impl PackedOracle {
    /// Pack `case` (causal: after a prefix document of `24 - T mod 8` tokens; full: twice).
    pub fn new(case: &AttnCase) -> Result<Self> {
        let t = case.q.dim(1)?;
        let t1 = 24 - t % 8;
        let (lens, xs) = if case.causal {
            let pack = |x: &Tensor| Tensor::cat(&[&x.narrow(1, 0, t1.min(t))?, x], 1);
            (vec![t1.min(t), t], [pack(&case.q)?, pack(&case.k)?, pack(&case.v)?, pack(&case.dout)?])
        } else {
            let pack = |x: &Tensor| Tensor::cat(&[x, x], 1);
            (vec![t, t], [pack(&case.q)?, pack(&case.k)?, pack(&case.v)?, pack(&case.dout)?])
        };
        let [q, k, v, dout] = xs;
        let case = AttnCase { name: format!("{} packed {lens:?}", case.name), q, k, v, dout, ..case.clone() };
        Ok(Self { case, documents: Documents::from_lengths(&lens)? })
    }

    /// The single-device packed attention (`attention::attention_docs`, candle autograd) of the
    /// packed inputs: out, lse and the gradients of `sum(out · dout)`.
    pub fn run_single(&self) -> Result<AttnOutputs> {
        let c = &self.case;
        super::run_single_with(c, |q, k, v| attention_docs(q, k, v, &self.documents, c.causal, c.scale))
    }

    /// Errors of a run on the packed inputs against the oracle: the worst over the two
    /// documents of each metric (for a causal case the first document counts its out and lse
    /// only). Compare with the case's tolerances (`case.tolerances()`).
    pub fn metrics(&self, got: &AttnOutputs) -> Result<AttnMetrics> {
        let reference = &self.case.reference;
        let (a0, b0) = self.documents.range(0);
        let (a1, b1) = self.documents.range(1);
        let whole = AttnMetrics::compute(&rows(got, a1, b1 - a1)?, reference)?;
        let first = rows(got, a0, b0 - a0)?;
        let want = rows(reference, 0, b0 - a0)?;
        let other = if self.case.causal {
            AttnMetrics {
                out_abs: super::abs_err(&first.out, &want.out)?,
                lse_abs: super::abs_err(&first.lse, &want.lse)?,
                dq_rel: 0.0,
                dk_rel: 0.0,
                dv_rel: 0.0,
            }
        } else {
            AttnMetrics::compute(&first, &want)?
        };
        // f64::max would hide a NaN: keep it
        let worst = |a: f64, b: f64| if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) };
        Ok(AttnMetrics {
            out_abs: worst(whole.out_abs, other.out_abs),
            lse_abs: worst(whole.lse_abs, other.lse_abs),
            dq_rel: worst(whole.dq_rel, other.dq_rel),
            dk_rel: worst(whole.dk_rel, other.dk_rel),
            dv_rel: worst(whole.dv_rel, other.dv_rel),
        })
    }
}
