//! RMSNorm and LayerNorm on sequence shards.
//!
//! The weight (and bias) `[C]` are replicated on every TP rank; the layers take them from a
//! `VarBuilder` under `weight` / `bias` (full shape `[C]`). With sequence parallelism a rank
//! normalises only its rows `[B, T/P, C]`, so the gradient of the weight computed on one rank
//! is partial. [`GradSync`] picks who sums it over the TP group:
//! - [`GradSync::InBackward`] (default): the layer uses the weight through
//!   [`copy_to_tp_region`] — identity forward, all-reduce backward — so after `backward()`
//!   every rank holds the full gradient;
//! - [`GradSync::Deferred`]: no collective; each rank holds the gradient of its own rows and
//!   the caller sums over the TP group (e.g. in the same bucketed all-reduce as the data- and
//!   context-parallel sums).
//!
//! Without SP every rank sees all rows and holds the full gradient; nothing is reduced.
//!
//! Statistics are computed in f32 whatever the input dtype (HF form for RMSNorm: the
//! normalised value is cast back to the input dtype, then multiplied by the weight; Gemma's
//! form, [`NormWeight::UnitOffset`], multiplies by `1 + w` in f32 and casts last; OLMo's,
//! [`NormWeight::ScaleF32`], by `w` in f32 and casts last).

use crate::{GradSync, Shard, Tp};
use candle_core::{bail, DType, Module, Result, Tensor, D};
use candle_cp_ops::autograd::{attach2, attach3, BackwardFn};
use candle_cp_ops::mappings::copy_to_tp_region;
use candle_nn::{Init, VarBuilder};
use std::sync::Arc;

/// How an RMSNorm's weight `w` scales the normalised value `x̂ = x · rsqrt(mean(x²) + eps)`
/// (computed in f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormWeight {
    /// HF Llama / Qwen: `x̂` cast to `x`'s dtype, then times `w` (weights start at ones).
    #[default]
    Scale,
    /// Gemma: `x̂ · (1 + w)` in f32, then cast to `x`'s dtype (weights start at zeros; a
    /// 16-bit `w` is widened before the 1 is added, so `1 + w` is not rounded).
    UnitOffset,
    /// OLMo 2 and 3: `x̂ · w` in f32, then cast to `x`'s dtype (weights start at ones; the
    /// same numbers as [`NormWeight::Scale`] in f32, one rounding fewer in 16 bits).
    ScaleF32,
}

/// RMSNorm `x · rsqrt(mean(x²) + eps) · w` (HF form: statistics in f32, the normalised
/// value cast to `x`'s dtype, then times `w`), with a hand-written backward (one graph node
/// instead of a dozen broadcast ops). `x` `[.., h]`, `w` `[h]`; output as `x`.
/// Differentiable w.r.t. `x` and `w` (backward in f32). Reference: [`rms_norm_slow`].
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm_with(x, w, eps, NormWeight::Scale)
}

/// [`rms_norm`] with the weight applied as `form` says ([`NormWeight::UnitOffset`]: Gemma's
/// `x̂ · (1 + w)`). Reference: [`rms_norm_slow_with`].
pub fn rms_norm_with(x: &Tensor, w: &Tensor, eps: f64, form: NormWeight) -> Result<Tensor> {
    candle_cp_comm::ensure_nonempty("rms_norm", "x", x)?;
    let h = x.dim(D::Minus1)?;
    if w.dims() != [h] {
        bail!("rms_norm: weight {:?} must be [{h}] for input {:?}", w.dims(), x.dims())
    }
    let xd = x.detach();
    let (out, r) = rms_norm_fwd_with(&xd, &w.detach(), eps, form)?;
    let wd = w.detach();
    // The backward keeps x (the graph node keeps it anyway) and r `[.., 1]`, and recomputes
    // x̂ = x·r: no normalised copy of the input stays alive between forward and backward.
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let (dx, dw) = rms_norm_bwd_with(&xd, &r, &wd, dy, form)?;
        Ok(vec![Some(dx), Some(dw)])
    });
    attach2("rms_norm", x, w, out, bwd)
}

/// The raw forward of [`rms_norm`] on detached tensors: the output and the statistic
/// `r = rsqrt(mean(x²) + eps)` `[.., 1]` (f32), which [`rms_norm_bwd`] takes.
pub fn rms_norm_fwd(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    rms_norm_fwd_with(x, w, eps, NormWeight::Scale)
}

/// [`rms_norm_fwd`] with the weight applied as `form` says.
pub fn rms_norm_fwd_with(x: &Tensor, w: &Tensor, eps: f64, form: NormWeight) -> Result<(Tensor, Tensor)> {
    let x32 = x.to_dtype(DType::F32)?;
    let r = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let out = match form {
        NormWeight::Scale => x32.broadcast_mul(&r)?.to_dtype(x.dtype())?.broadcast_mul(w)?,
        NormWeight::UnitOffset => x32.broadcast_mul(&r)?.broadcast_mul(&(w.to_dtype(DType::F32)? + 1.0)?)?.to_dtype(x.dtype())?,
        NormWeight::ScaleF32 => x32.broadcast_mul(&r)?.broadcast_mul(&w.to_dtype(DType::F32)?)?.to_dtype(x.dtype())?,
    };
    Ok((out, r))
}

/// The raw backward of [`rms_norm`]: `(dx, dw)` for the output gradient `dy`, from the input
/// `x`, the statistic `r` of [`rms_norm_fwd`] and the weight `w` (x̂ = x·r recomputed; f32
/// arithmetic; `dx` in `x`'s dtype, `dw` in `w`'s). Also the backward of the fused head norm
/// and RoPE in candle-cp-llama.
pub fn rms_norm_bwd(x: &Tensor, r: &Tensor, w: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    rms_norm_bwd_with(x, r, w, dy, NormWeight::Scale)
}

/// [`rms_norm_bwd`] for the weight applied as `form` says (Gemma's `1 + w`: `dw` from the
/// f32 `x̂`, which that form never rounds).
pub fn rms_norm_bwd_with(x: &Tensor, r: &Tensor, w: &Tensor, dy: &Tensor, form: NormWeight) -> Result<(Tensor, Tensor)> {
    let (dt, h) = (x.dtype(), x.dim(D::Minus1)?);
    let xhat = x.to_dtype(DType::F32)?.broadcast_mul(r)?;
    let dy32 = dy.to_dtype(DType::F32)?;
    let (xh, w32) = match form {
        NormWeight::Scale => (xhat.to_dtype(dt)?.to_dtype(DType::F32)?, w.to_dtype(DType::F32)?),
        NormWeight::UnitOffset => (xhat.clone(), (w.to_dtype(DType::F32)? + 1.0)?),
        NormWeight::ScaleF32 => (xhat.clone(), w.to_dtype(DType::F32)?),
    };
    let lead: usize = dy32.elem_count() / h;
    let dw = (dy32.broadcast_mul(&xh)?).reshape((lead, h))?.sum(0)?.to_dtype(w.dtype())?;
    let g = dy32.broadcast_mul(&w32)?;
    let m = (&g * &xhat)?.mean_keepdim(D::Minus1)?;
    let dx = (g - xhat.broadcast_mul(&m)?)?.broadcast_mul(r)?.to_dtype(dt)?;
    Ok((dx, dw))
}

/// Reference RMSNorm from plain candle ops (same math as [`rms_norm`], candle autograd).
pub fn rms_norm_slow(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dt = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let ms = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = x32.broadcast_mul(&(ms + eps)?.sqrt()?.recip()?)?;
    xn.to_dtype(dt)?.broadcast_mul(w)
}

/// `residual + rms_norm_with(y, w, eps, form)` as one graph node (Gemma's norms after the
/// attention and after the MLP, each before its residual add): the node keeps `y` and the
/// statistic, not the normalised copy a separate add would keep; the sum is the same
/// arithmetic (the normalised value in `y`'s dtype, then the add). `residual`, `y` `[.., h]`
/// of one shape and dtype, `w` `[h]`. Reference: [`rms_norm_slow_with`] plus an add.
pub fn rms_norm_add(residual: &Tensor, y: &Tensor, w: &Tensor, eps: f64, form: NormWeight) -> Result<Tensor> {
    candle_cp_comm::ensure_nonempty("rms_norm_add", "y", y)?;
    let h = y.dim(D::Minus1)?;
    if w.dims() != [h] || residual.dims() != y.dims() || residual.dtype() != y.dtype() {
        bail!(
            "rms_norm_add: residual {:?} ({:?}), y {:?} ({:?}) and weight {:?}: need one shape and dtype, and weight [{h}]",
            residual.dims(),
            residual.dtype(),
            y.dims(),
            y.dtype(),
            w.dims()
        )
    }
    let (yd, wd) = (y.detach(), w.detach());
    let (n, r) = rms_norm_fwd_with(&yd, &wd, eps, form)?;
    let out = (residual.detach() + n)?;
    let bwd: BackwardFn = Arc::new(move |dout: &Tensor| {
        let (dy, dw) = rms_norm_bwd_with(&yd, &r, &wd, dout, form)?;
        Ok(vec![Some(dout.clone()), Some(dy), Some(dw)])
    });
    attach3("rms_norm_add", residual, y, w, out, bwd)
}

/// Reference for [`rms_norm_with`] from plain candle ops (candle autograd).
pub fn rms_norm_slow_with(x: &Tensor, w: &Tensor, eps: f64, form: NormWeight) -> Result<Tensor> {
    match form {
        NormWeight::Scale => rms_norm_slow(x, w, eps),
        NormWeight::UnitOffset => {
            let x32 = x.to_dtype(DType::F32)?;
            let xn = x32.broadcast_div(&(x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?)?;
            xn.broadcast_mul(&(w.to_dtype(DType::F32)? + 1.0)?)?.to_dtype(x.dtype())
        }
        NormWeight::ScaleF32 => {
            let x32 = x.to_dtype(DType::F32)?;
            let xn = x32.broadcast_div(&(x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?)?;
            xn.broadcast_mul(&w.to_dtype(DType::F32)?)?.to_dtype(x.dtype())
        }
    }
}

fn replicated(what: &str, t: &Tensor, dim: usize) -> Result<Tensor> {
    if t.dims() != [dim] {
        bail!("{what}: parameter {:?} must be [{dim}]", t.dims())
    }
    Ok(t.clone())
}

fn param(v: &Tensor, tp: &Tp, sync: GradSync) -> Result<Tensor> {
    if tp.sequence_parallel && sync == GradSync::InBackward {
        copy_to_tp_region(v, &tp.group)
    } else {
        Ok(v.clone())
    }
}

fn check_input(what: &str, x: &Tensor, dim: usize) -> Result<()> {
    candle_cp_comm::ensure_nonempty(what, "input", x)?;
    if x.rank() == 0 || x.dim(D::Minus1)? != dim {
        bail!("{what}: input {:?} must be [.., {dim}]", x.dims())
    }
    Ok(())
}

/// `y = x / sqrt(mean(x², last dim) + eps) · weight` ([`rms_norm`]), on `[B, T/P, C]` (SP)
/// or `[B, T, C]`.
///
/// `weight` `[C]` is replicated on every TP rank; with SP its gradient is summed over the TP
/// group as [`GradSync`] says (module docs).
#[derive(Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    sync: GradSync,
    tp: Tp,
    form: NormWeight,
}

impl RmsNorm {
    /// How the weight is split over TP.
    pub const WEIGHT_SHARD: Shard = Shard::Replicated;

    /// `weight` `[dim]` from `vb` (created as ones in a fresh `VarMap`).
    pub fn new(vb: VarBuilder, dim: usize, eps: f64, tp: &Tp) -> Result<Self> {
        Self::from_weight(&vb.get_with_hints(dim, "weight", Init::Const(1.0))?, eps, tp)
    }
    /// Build from a weight `[C]` (used as is: pass a `Var`'s tensor to train it).
    pub fn from_weight(weight: &Tensor, eps: f64, tp: &Tp) -> Result<Self> {
        let c = weight.dim(0)?;
        Ok(Self { weight: replicated("RmsNorm", weight, c)?, eps, sync: GradSync::InBackward, tp: tp.clone(), form: NormWeight::Scale })
    }
    /// How the weight scales the normalised value (default [`NormWeight::Scale`]; Gemma's
    /// [`NormWeight::UnitOffset`]).
    pub fn with_form(mut self, form: NormWeight) -> Self {
        self.form = form;
        self
    }
    /// Who sums the weight gradient over the TP group under SP (default [`GradSync::InBackward`]).
    pub fn with_grad_sync(mut self, sync: GradSync) -> Self {
        self.sync = sync;
        self
    }
    /// The weight `[C]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

impl RmsNorm {
    /// `residual + self.forward(y)` as one graph node ([`rms_norm_add`]), `residual` and `y`
    /// on the same rows.
    pub fn forward_add(&self, residual: &Tensor, y: &Tensor) -> Result<Tensor> {
        check_input("RmsNorm", y, self.weight.dim(0)?)?;
        rms_norm_add(residual, y, &param(&self.weight, &self.tp, self.sync)?, self.eps, self.form)
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("RmsNorm", x, self.weight.dim(0)?)?;
        rms_norm_with(x, &param(&self.weight, &self.tp, self.sync)?, self.eps, self.form)
    }
}

/// `y = (x - mean) / sqrt(var + eps) · weight + bias` over the last dim, on `[B, T/P, C]`
/// (SP) or `[B, T, C]`; `var` is the biased variance.
///
/// `weight`, `bias` `[C]` are replicated; with SP their gradients are summed over the TP
/// group as [`GradSync`] says (module docs).
#[derive(Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
    sync: GradSync,
    tp: Tp,
}

impl LayerNorm {
    /// How the weight and bias are split over TP.
    pub const WEIGHT_SHARD: Shard = Shard::Replicated;

    /// `weight` and `bias` `[dim]` from `vb` (created as ones / zeros in a fresh `VarMap`).
    pub fn new(vb: VarBuilder, dim: usize, eps: f64, tp: &Tp) -> Result<Self> {
        let w = vb.get_with_hints(dim, "weight", Init::Const(1.0))?;
        let b = vb.get_with_hints(dim, "bias", Init::Const(0.0))?;
        Self::from_weights(&w, &b, eps, tp)
    }
    /// Build from `weight`, `bias` `[C]` (used as they are).
    pub fn from_weights(weight: &Tensor, bias: &Tensor, eps: f64, tp: &Tp) -> Result<Self> {
        let c = weight.dim(0)?;
        Ok(Self {
            weight: replicated("LayerNorm weight", weight, c)?,
            bias: replicated("LayerNorm bias", bias, c)?,
            eps,
            sync: GradSync::InBackward,
            tp: tp.clone(),
        })
    }
    /// Who sums the gradients over the TP group under SP (default [`GradSync::InBackward`]).
    pub fn with_grad_sync(mut self, sync: GradSync) -> Self {
        self.sync = sync;
        self
    }
    /// The weight `[C]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// The bias `[C]`.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("LayerNorm", x, self.weight.dim(0)?)?;
        let dt = x.dtype();
        let xf = x.to_dtype(DType::F32)?;
        let xc = xf.broadcast_sub(&xf.mean_keepdim(D::Minus1)?)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xc.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let w = param(&self.weight, &self.tp, self.sync)?.to_dtype(DType::F32)?;
        let b = param(&self.bias, &self.tp, self.sync)?.to_dtype(DType::F32)?;
        y.broadcast_mul(&w)?.broadcast_add(&b)?.to_dtype(dt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use candle_cp_comm::{run_ranks, Group};

    fn max_rel(a: &Tensor, b: &Tensor) -> Result<f32> {
        let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok(d / b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30))
    }

    #[test]
    fn one_rank_norms_equal_candle_nn() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::arange(0f32, 24., &dev)?.reshape((2, 3, 4))?.sin()?;
        let w = Tensor::new(&[0.5f32, 1.0, 1.5, 2.0], &dev)?;
        let b = Tensor::new(&[0.1f32, -0.2, 0.3, 0.0], &dev)?;
        for r in run_ranks(1, |g: Group| {
            let tp = Tp::new(g, true);
            let rms = RmsNorm::from_weight(&w, 1e-5, &tp)?.forward(&x)?;
            let want = candle_nn::ops::rms_norm_slow(&x, &w, 1e-5)?;
            let ln = LayerNorm::from_weights(&w, &b, 1e-5, &tp)?.forward(&x)?;
            let want_ln = candle_nn::ops::layer_norm_slow(&x, &w, &b, 1e-5)?;
            let e1 = (rms - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let e2 = (ln - want_ln)?.abs()?.max_all()?.to_scalar::<f32>()?;
            Ok(e1.max(e2))
        }) {
            assert!(r? < 1e-5);
        }
        Ok(())
    }

    #[test]
    fn rms_norm_matches_slow_values_and_grads() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::randn(0.5f32, 2.0, (2, 7, 24), &dev)?;
        let w = Var::randn(1f32, 0.1, 24, &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (2, 7, 24), &dev)?;
        let y = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5)?;
        let ys = rms_norm_slow(x.as_tensor(), w.as_tensor(), 1e-5)?;
        assert!(max_rel(&y, &ys)? < 1e-6);
        let g = (&y * &dy)?.sum_all()?.backward()?;
        let gs = (&ys * &dy)?.sum_all()?.backward()?;
        for v in [&x, &w] {
            let (a, b) = (g.get(v.as_tensor()).unwrap(), gs.get(v.as_tensor()).unwrap());
            assert!(max_rel(a, b)? < 1e-5, "{:?}", max_rel(a, b));
        }
        let e = rms_norm(x.as_tensor(), &Tensor::ones(5, DType::F32, &dev)?, 1e-5).err().map(|e| e.to_string());
        assert!(e.unwrap_or_default().contains("[5]"));
        Ok(())
    }

    /// Gemma's `x̂ · (1 + w)`: values and gradients equal the plain-op reference (f32, and
    /// bf16 where `1 + w` must not be rounded to bf16: a bf16 `1 + w` would be off by up to
    /// 2^-8), and differ from the scale form.
    /// The weight form `f` with weights around `w_mean`: values and both gradients equal the
    /// plain-op reference in f32, and in bf16 the output is the f32 arithmetic on the bf16
    /// values rounded once; `(x, w, dy)` for the caller's own checks.
    fn form_matches_slow(f: NormWeight, w_mean: f32, w_std: f32) -> Result<(Var, Var, Tensor)> {
        let dev = Device::Cpu;
        let x = Var::randn(0.5f32, 2.0, (2, 7, 24), &dev)?;
        let w = Var::randn(w_mean, w_std, 24, &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (2, 7, 24), &dev)?;
        let y = rms_norm_with(x.as_tensor(), w.as_tensor(), 1e-6, f)?;
        let ys = rms_norm_slow_with(x.as_tensor(), w.as_tensor(), 1e-6, f)?;
        assert!(max_rel(&y, &ys)? < 1e-6);
        let g = (&y * &dy)?.sum_all()?.backward()?;
        let gs = (&ys * &dy)?.sum_all()?.backward()?;
        for v in [&x, &w] {
            let (a, b) = (g.get(v.as_tensor()).unwrap(), gs.get(v.as_tensor()).unwrap());
            assert!(max_rel(a, b)? < 1e-5, "{:?}", max_rel(a, b));
        }
        let (xb, wb) = (x.as_tensor().to_dtype(DType::BF16)?, w.as_tensor().to_dtype(DType::BF16)?);
        let yb = rms_norm_with(&xb, &wb, 1e-6, f)?.to_dtype(DType::F32)?;
        let want = rms_norm_slow_with(&xb.to_dtype(DType::F32)?, &wb.to_dtype(DType::F32)?, 1e-6, f)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        assert_eq!((yb - want)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
        Ok((x, w, dy))
    }

    #[test]
    fn unit_offset_matches_slow_values_and_grads() -> Result<()> {
        let dev = Device::Cpu;
        let f = NormWeight::UnitOffset;
        let (x, w, dy) = form_matches_slow(f, 0.0, 0.05)?;
        let ys = rms_norm_slow_with(x.as_tensor(), w.as_tensor(), 1e-6, f)?;
        let plain = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6)?;
        assert!(max_rel(&plain, &ys)? > 0.5, "the offset changed nothing");
        // `residual + norm(y)` as one node: the two ops' values and gradients
        let r = Var::randn(0f32, 1.0, (2, 7, 24), &dev)?;
        let fused = rms_norm_add(r.as_tensor(), x.as_tensor(), w.as_tensor(), 1e-6, f)?;
        let two = (r.as_tensor() + rms_norm_slow_with(x.as_tensor(), w.as_tensor(), 1e-6, f)?)?;
        assert!(max_rel(&fused, &two)? < 1e-6);
        let (g, gs) = ((&fused * &dy)?.sum_all()?.backward()?, (&two * &dy)?.sum_all()?.backward()?);
        for v in [&r, &x, &w] {
            let (a, b) = (g.get(v.as_tensor()).unwrap(), gs.get(v.as_tensor()).unwrap());
            assert!(max_rel(a, b)? < 1e-5, "{:?}", max_rel(a, b));
        }
        let e = rms_norm_add(&r.as_tensor().narrow(1, 0, 3)?, x.as_tensor(), w.as_tensor(), 1e-6, f).err().map(|e| e.to_string());
        assert!(e.unwrap_or_default().contains("[2, 3, 24]"));
        // the module: zeros are the identity scale
        for r in run_ranks(1, |g: Group| {
            let n = RmsNorm::from_weight(&Tensor::zeros(24, DType::F32, &dev)?, 1e-6, &Tp::new(g, false))?.with_form(f);
            let want = rms_norm(x.as_tensor(), &Tensor::ones(24, DType::F32, &dev)?, 1e-6)?;
            max_rel(&n.forward(x.as_tensor())?, &want)
        }) {
            assert!(r? < 1e-6);
        }
        Ok(())
    }

    /// OLMo's `x̂ · w` in f32, cast last: values and gradients equal the plain-op reference
    /// in f32 (where it equals the scale form) and in bf16 (one rounding: the scale form
    /// rounds `x̂` before the product and differs).
    #[test]
    fn scale_f32_matches_slow_values_and_grads() -> Result<()> {
        let (x, w, _) = form_matches_slow(NormWeight::ScaleF32, 1.0, 0.3)?;
        let y = rms_norm_with(x.as_tensor(), w.as_tensor(), 1e-6, NormWeight::ScaleF32)?;
        assert!(max_rel(&y, &rms_norm(x.as_tensor(), w.as_tensor(), 1e-6)?)? < 1e-6);
        let (xb, wb) = (x.as_tensor().to_dtype(DType::BF16)?, w.as_tensor().to_dtype(DType::BF16)?);
        let yb = rms_norm_with(&xb, &wb, 1e-6, NormWeight::ScaleF32)?.to_dtype(DType::F32)?;
        let scale = rms_norm(&xb, &wb, 1e-6)?.to_dtype(DType::F32)?;
        assert!((yb - scale)?.abs()?.max_all()?.to_scalar::<f32>()? > 0.0, "bf16: the two forms round alike");
        Ok(())
    }
}
