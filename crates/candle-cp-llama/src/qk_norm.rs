//! Qwen3's (and Gemma 3's, EXAONE 4's) q and k head norms as a layer holds them: the weights
//! `[D]`, shared by the heads, and how they apply, with RoPE or without (a NoPE layer).

use candle_core::{Result, Tensor};

/// RMSNorms over each q and k head (Qwen3), between the projection and RoPE.
#[derive(Clone)]
pub(crate) struct QkNorm {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) eps: f64,
    /// How the weights apply (Gemma 3: `1 + w`).
    pub(crate) form: candle_cp_nn::NormWeight,
}

impl QkNorm {
    /// `q [B, T, H, D]` and `k [B, T, Hkv, D]` normalised over `D` (generation: no backward).
    pub(crate) fn apply(&self, q: &Tensor, k: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = |x: &Tensor, w: &Tensor| candle_cp_nn::rms_norm_with(x, w, self.eps, self.form);
        Ok((n(q, &self.q)?, n(k, &self.k)?))
    }

    /// `q`, `k` normalised and rotated by the tables `(cos, sin)` (`None`: not rotated, a NoPE
    /// layer), each one graph node ([`crate::fused::qk_norm_rope`]: keeps the input and the
    /// statistic; without tables candle-cp-nn's RMSNorm node). `tp`: the
    /// weights' gradients, partial on each TP rank (its own heads), are summed over the TP
    /// group in the backward (`copy_to_tp_region`); `None` leaves them partial (under sequence
    /// parallelism, where [`crate::reduce_gradients`] sums replicated weights over the world).
    pub(crate) fn apply_with_rope(&self, q: &Tensor, k: &Tensor, rope: Option<(&Tensor, &Tensor)>, tp: Option<&candle_cp_comm::Group>) -> Result<(Tensor, Tensor)> {
        let w = |w: &Tensor| match tp {
            Some(g) => candle_cp_ops::mappings::copy_to_tp_region(w, g),
            None => Ok(w.clone()),
        };
        let f = |x: &Tensor, wt: &Tensor| match rope {
            Some((cos, sin)) => crate::fused::qk_norm_rope_with(x, wt, self.eps, cos, sin, self.form),
            None => candle_cp_nn::rms_norm_with(x, wt, self.eps, self.form),
        };
        Ok((f(q, &w(&self.q)?)?, f(k, &w(&self.k)?)?))
    }
}
