//! [`Scores`]: how a query–key dot product becomes the softmax's logit (scale and Gemma 2's
//! soft cap), shared by every attention op, kernel and reference.

use candle_core::{bail, Result};

/// How a query–key dot product becomes the logit the softmax takes:
/// `s = scale · q·k`, then, with a soft cap `c`, `c · tanh(s / c)` (Gemma 2's
/// `attn_logit_softcapping`, which keeps every logit inside `(-c, c)`).
///
/// Every attention function takes `impl Into<Scores>`, so a plain `f64` scale still works
/// (`Scores::from(scale)`: no cap). The cap is applied before masking, per (query, key) pair,
/// inside the kernels (the CPU kernels; on CUDA the CUDA-core kernels and the pipelined
/// forward's capped entries, `candle_cp_kernels::flash::Logits`); the log-sum-exp the ops
/// return is that of the capped logits, so ring and all-gather partial results merge as
/// without a cap. Backward: `dL/ds = dL/ds' · (1 - (s'/c)²)` with `s'` the capped logit,
/// recomputed per tile as P is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    /// Softmax scale, usually `1/sqrt(D)`.
    pub scale: f64,
    /// Soft cap `c > 0` (`None`: logits uncapped).
    pub softcap: Option<f64>,
}

impl Scores {
    /// Logits `scale · q·k`, uncapped.
    pub fn new(scale: f64) -> Self {
        Self { scale, softcap: None }
    }

    /// The same scale with logits capped to `(-cap, cap)` by `cap · tanh(s / cap)` (`None`: no
    /// cap). [`Scores::check`] refuses a cap that is not finite and > 0.
    pub fn with_softcap(mut self, cap: Option<f64>) -> Self {
        self.softcap = cap;
        self
    }

    /// Errors for a scale that is not finite or a soft cap that is not finite and > 0, naming
    /// `op` and the value.
    pub fn check(&self, op: &str) -> Result<()> {
        if !self.scale.is_finite() {
            bail!("{op}: the softmax scale must be finite, got {}", self.scale)
        }
        match self.softcap {
            Some(c) if !(c.is_finite() && c > 0.0) => bail!("{op}: a logit soft cap must be finite and > 0, got {c}"),
            _ => Ok(()),
        }
    }

    /// `(scale, cap)` as the f32 kernels take them (cap 0: none).
    pub(crate) fn f32s(&self) -> (f32, f32) {
        (self.scale as f32, self.softcap.map_or(0.0, |c| c as f32))
    }
}

impl From<f64> for Scores {
    fn from(scale: f64) -> Self {
        Scores::new(scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::blas::{softcap_row, softcap_row_grad};

    #[test]
    fn checks_the_cap() {
        assert!(Scores::new(0.5).check("t").is_ok());
        assert!(Scores::new(0.5).with_softcap(Some(50.0)).check("t").is_ok());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = Scores::new(0.5).with_softcap(Some(bad)).check("op_x").unwrap_err().to_string();
            assert!(e.contains("op_x") && e.contains("soft cap"), "{e}");
        }
        assert!(Scores::new(f64::NAN).check("t").is_err());
    }

    #[test]
    fn cap_and_its_derivative() {
        let mut row = vec![-300.0f32, -3.0, 0.0, 2.0, 80.0];
        let orig = row.clone();
        let mut g = vec![0f32; 5];
        softcap_row_grad(&mut row, &mut g, 30.0);
        for ((x, o), gi) in row.iter().zip(&orig).zip(&g) {
            assert!(x.abs() <= 30.0);
            // (the vectorised tanh through the fast exp: ~1e-7 absolute before the cap's factor)
            assert!((x - 30.0 * (o / 30.0).tanh()).abs() < 1e-5);
            // finite difference of the cap
            let h = 1e-2f64;
            let f = |y: f64| 30.0 * (y / 30.0).tanh();
            let fd = (f(*o as f64 + h) - f(*o as f64 - h)) / (2.0 * h);
            assert!((fd - *gi as f64).abs() < 1e-4, "{o}: {fd} vs {gi}");
        }
        let mut r2 = orig.clone();
        softcap_row(&mut r2, 30.0);
        assert_eq!(r2, row);
        // a long row (the vectorised loop) against std's tanh
        let long: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let mut capped = long.clone();
        softcap_row(&mut capped, 5.0);
        for (c, o) in capped.iter().zip(&long) {
            assert!((c - 5.0 * (o / 5.0).tanh()).abs() < 2e-6, "{o}: {c}");
        }
    }
}
