//! RMSNorm and LayerNorm on sequence shards.
//!
//! With sequence parallelism a rank normalises only its rows `[B, T/P, C]`, so the gradient
//! of the (replicated) weight and bias computed on one rank is partial. The layers therefore
//! use the weight through [`copy_to_tp_region`] — identity forward, all-reduce backward — so
//! after `backward()` every rank holds the full gradient (sum over the TP group) in its own
//! copy of the weight. Without SP every rank sees all rows and no reduction is done.
//!
//! Statistics are computed in f32 whatever the input dtype; the output has the input dtype.

use crate::Tp;
use candle_core::{DType, Module, Result, Tensor, Var, D};
use candle_cp_ops::mappings::copy_to_tp_region;
use candle_nn::VarBuilder;

fn replicated(what: &str, t: &Tensor, dim: usize) -> Result<Var> {
    if t.dims() != [dim] {
        candle_core::bail!("{what}: parameter {:?} must be [{dim}]", t.dims())
    }
    Var::from_tensor(&t.detach().contiguous()?)
}

fn param(v: &Var, tp: &Tp) -> Result<Tensor> {
    if tp.sequence_parallel {
        copy_to_tp_region(v.as_tensor(), &tp.group)
    } else {
        Ok(v.as_tensor().clone())
    }
}

fn check_input(what: &str, x: &Tensor, dim: usize) -> Result<()> {
    if x.rank() == 0 || x.dim(D::Minus1)? != dim {
        candle_core::bail!("{what}: input {:?} must be [.., {dim}]", x.dims())
    }
    Ok(())
}

/// `y = x / sqrt(mean(x², last dim) + eps) · weight`, on `[B, T/P, C]` (SP) or `[B, T, C]`.
///
/// `weight` `[C]` is replicated on every TP rank; with SP its gradient is all-reduced over
/// the TP group during backward (see the module docs).
#[derive(Clone)]
pub struct RmsNorm {
    weight: Var,
    eps: f64,
    tp: Tp,
}

impl RmsNorm {
    /// Load `weight` `[dim]` from `vb`.
    pub fn load(vb: VarBuilder, dim: usize, eps: f64, tp: &Tp) -> Result<Self> {
        Self::from_weight(&vb.get(dim, "weight")?, eps, tp)
    }
    /// Build from a weight `[C]`.
    pub fn from_weight(weight: &Tensor, eps: f64, tp: &Tp) -> Result<Self> {
        let c = weight.dim(0)?;
        Ok(Self { weight: replicated("RmsNorm", weight, c)?, eps, tp: tp.clone() })
    }
    /// The weight `[C]` (after backward its gradient is the full one, with or without SP).
    pub fn weight(&self) -> &Var {
        &self.weight
    }
    /// The layer's parameters.
    pub fn vars(&self) -> Vec<Var> {
        vec![self.weight.clone()]
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("RmsNorm", x, self.weight.dim(0)?)?;
        let dt = x.dtype();
        let xf = x.to_dtype(DType::F32)?;
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xf.broadcast_div(&(ms + self.eps)?.sqrt()?)?;
        let w = param(&self.weight, &self.tp)?.to_dtype(DType::F32)?;
        y.broadcast_mul(&w)?.to_dtype(dt)
    }
}

/// `y = (x - mean) / sqrt(var + eps) · weight + bias` over the last dim, on `[B, T/P, C]`
/// (SP) or `[B, T, C]`; `var` is the biased variance.
///
/// `weight`, `bias` `[C]` are replicated; with SP their gradients are all-reduced over the TP
/// group during backward.
#[derive(Clone)]
pub struct LayerNorm {
    weight: Var,
    bias: Var,
    eps: f64,
    tp: Tp,
}

impl LayerNorm {
    /// Load `weight` and `bias` `[dim]` from `vb`.
    pub fn load(vb: VarBuilder, dim: usize, eps: f64, tp: &Tp) -> Result<Self> {
        Self::from_weights(&vb.get(dim, "weight")?, &vb.get(dim, "bias")?, eps, tp)
    }
    /// Build from `weight`, `bias` `[C]`.
    pub fn from_weights(weight: &Tensor, bias: &Tensor, eps: f64, tp: &Tp) -> Result<Self> {
        let c = weight.dim(0)?;
        Ok(Self {
            weight: replicated("LayerNorm weight", weight, c)?,
            bias: replicated("LayerNorm bias", bias, c)?,
            eps,
            tp: tp.clone(),
        })
    }
    /// The weight `[C]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }
    /// The bias `[C]`.
    pub fn bias(&self) -> &Var {
        &self.bias
    }
    /// The layer's parameters (weight, bias).
    pub fn vars(&self) -> Vec<Var> {
        vec![self.weight.clone(), self.bias.clone()]
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
        let w = param(&self.weight, &self.tp)?.to_dtype(DType::F32)?;
        let b = param(&self.bias, &self.tp)?.to_dtype(DType::F32)?;
        y.broadcast_mul(&w)?.broadcast_add(&b)?.to_dtype(dt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_cp_comm::{run_ranks, Group};

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
}
