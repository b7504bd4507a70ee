//! RMSNorm, RoPE (also as a projection's output map) and the SiLU- / GELU-gated products with hand-written backward
//! passes ([`candle_cp_ops::autograd::attach2`] / `attach1`), beside their plain-candle
//! references (`*_slow`, differentiated by candle's autograd). The fused versions record one
//! graph node instead of a dozen broadcast ops, and keep for the backward only what it needs
//! (a candle graph node keeps every input alive until the backward); tests compare values and
//! gradients of the two. The RMSNorm pair is candle-cp-nn's
//! (re-exported here; tested there), RoPE is here.

use candle_core::{bail, DType, Result, Tensor, D};
use candle_cp_nn::{NormWeight, PartMap, PartPost};
use candle_cp_ops::autograd::{attach1, attach2, BackwardFn};
use std::sync::Arc;

/// RMSNorm with a hand-written backward and its plain-candle reference: they live in
/// candle-cp-nn (used by its [`candle_cp_nn::RmsNorm`] layer, which the model uses).
pub use candle_cp_nn::{rms_norm, rms_norm_slow};

/// `(T, D, R)` of `x` `[B, T, H, D]` and its tables `[T, R]` / `[B, T, R]`: `R` (even, at most
/// `D`) the rotated dimensions (`R < D`: a partial RoPE, the rest pass through).
fn check_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(usize, usize, usize)> {
    let (b, t, _h, d) = x.dims4()?;
    let r = cos.dims().last().copied().unwrap_or(0);
    let ok = |c: &Tensor| c.dims() == [t, r] || c.dims() == [b, t, r];
    if !ok(cos) || cos.dims() != sin.dims() || r % 2 != 0 || r == 0 || r > d {
        bail!(
            "apply_rope: x {:?} [B, T, H, D] needs cos/sin [{t}, R] or [{b}, {t}, R] with R even, 0 < R <= {d} (the rotated dimensions), got {:?} / {:?}",
            x.dims(),
            cos.dims(),
            sin.dims()
        )
    }
    Ok((t, d, r))
}

/// The tables `[T, R]` (shared by the rows) or `[B, T, R]` (one per row) as `[1|B, T, 1, R]`
/// in `dtype` (no copy when they already are).
pub(crate) fn tables4(cos: &Tensor, sin: &Tensor, t: usize, r: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
    let rows = if cos.rank() == 3 { cos.dim(0)? } else { 1 };
    let f = |c: &Tensor| c.reshape((rows, t, 1, r))?.to_dtype(dtype);
    Ok((f(cos)?, f(sin)?))
}

/// `f` on the first `R` (the tables' width) of `y`'s last-dim entries, the rest passed
/// through (a partial RoPE); `f(y)` when `R` is all of them.
fn on_rotated(y: &Tensor, r: usize, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let d = y.dim(D::Minus1)?;
    if r == d {
        return f(y);
    }
    let rot = f(&y.narrow(D::Minus1, 0, r)?)?;
    Tensor::cat(&[&rot, &y.narrow(D::Minus1, r, d - r)?], D::Minus1)
}

/// `rotate_half(z) = cat(-z[.., D/2..], z[.., ..D/2])` (`transpose = false`) or its transpose
/// `cat(z[.., D/2..], -z[.., ..D/2])`.
fn rotate_half(z: &Tensor, transpose: bool) -> Result<Tensor> {
    let d = z.dim(D::Minus1)?;
    let (a, b) = (
        z.narrow(D::Minus1, 0, d / 2)?,
        z.narrow(D::Minus1, d / 2, d / 2)?,
    );
    if transpose {
        Tensor::cat(&[&b, &a.neg()?], D::Minus1)
    } else {
        Tensor::cat(&[&b.neg()?, &a], D::Minus1)
    }
}

/// RoPE in the HF `rotate_half` form, `x·cos + rotate_half(x)·sin`, for `x` `[B, T, H, D]`
/// and tables `[T, R]` (from [`crate::rope::rope_tables`]) or `[B, T, R]` (one per row):
/// over the first `R` dimensions of each head (`R = D`, or a partial RoPE's, the others passed
/// through). Differentiable w.r.t. `x` (backward: `dy·cos + rotate_halfᵀ(dy·sin)`).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (t, _, r) = check_rope(x, cos, sin)?;
    let (cos, sin) = tables4(cos, sin, t, r, x.dtype())?;
    let xd = x.detach();
    let out = rope4(&xd, &cos, &sin)?;
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| Ok(vec![Some(rope4_t(dy, &cos, &sin)?)]));
    attach1("apply_rope", x, out, bwd)
}

/// `y·cos + rotate_half(y)·sin` with `[1|B, T, 1, R]` tables (over `y`'s first `R`
/// dimensions; the rest unchanged).
pub(crate) fn rope4(y: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    on_rotated(y, cos.dim(D::Minus1)?, |y| y.broadcast_mul(cos)? + rotate_half(y, false)?.broadcast_mul(sin)?)
}

/// The transpose (= inverse) of [`rope4`]: `dy·cos + rotate_halfᵀ(dy·sin)` (the passed-through
/// dimensions' gradient unchanged).
pub(crate) fn rope4_t(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    on_rotated(dy, cos.dim(D::Minus1)?, |dy| dy.broadcast_mul(cos)? + rotate_half(&dy.broadcast_mul(sin)?, true)?)
}

/// RoPE as an output map of a column-parallel part ([`candle_cp_nn::PartPost`], used with
/// `forward_parts_regathered`): the projection's output `[B, T, H·D]` → `[B, T, H, D]`
/// rotated with tables `[T, R]` or `[B, T, R]` (in the activations' dtype; `R` the rotated
/// dimensions of a head, `D` unless partial); the transpose rotates the gradient back. `heads`
/// is `H`, the tables give `T` and `R`, the output `D`.
pub fn rope_post(heads: usize, cos: &Tensor, sin: &Tensor) -> Result<PartPost> {
    let (t, r) = (cos.dim(cos.rank() - 2)?, cos.dim(D::Minus1)?);
    let (c4, s4) = tables4(cos, sin, t, r, cos.dtype())?;
    let (cb, sb) = (c4.clone(), s4.clone());
    let fwd: PartMap = Arc::new(move |y: &Tensor| {
        let (b, ty, o) = y.dims3()?;
        let d = o / heads.max(1);
        if ty != t || heads == 0 || o != heads * d || d < r {
            bail!("rope: projection output {:?} does not fit {heads} heads of at least {r} over {t} positions", y.dims())
        }
        let y4 = y.reshape((b, t, heads, d))?;
        rope4(&y4, &c4, &s4)
    });
    let bwd: PartMap = Arc::new(move |dy: &Tensor| rope4_t(dy, &cb, &sb));
    Ok(PartPost { fwd, bwd })
}

/// The SiLU-gated MLP product `silu(gate)·up` as one graph node (`gate`, `up` `[.., F]`, same
/// shape and dtype). Candle's own ops would keep `silu(gate)` too; this node keeps only its
/// two inputs and recomputes the sigmoid in the backward (in f32:
/// `dgate = dy·up·σ(g)(1 + g(1 − σ(g)))`, `dup = dy·silu(g)`). Reference: [`swiglu_slow`].
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_gate_up("swiglu", gate, up)?;
    let (g, u) = (gate.detach(), up.detach());
    let out = (g.silu()? * &u)?;
    let dt = gate.dtype();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let (g32, u32, dy32) = (g.to_dtype(DType::F32)?, u.to_dtype(DType::F32)?, dy.to_dtype(DType::F32)?);
        let s = (g32.neg()?.exp()? + 1.0)?.recip()?;
        let silu = (&g32 * &s)?;
        let dsilu = (&s * ((&g32 * (1.0 - &s)?)? + 1.0)?)?;
        let dup = (&dy32 * &silu)?.to_dtype(dt)?;
        let dgate = ((dy32 * u32)? * dsilu)?.to_dtype(dt)?;
        Ok(vec![Some(dgate), Some(dup)])
    });
    attach2("swiglu", gate, up, out, bwd)
}

/// The activation of the gated MLP: `down(act(gate) · up)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (Llama, Mistral, Qwen: `hidden_act` `silu`), [`swiglu`].
    #[default]
    Silu,
    /// GELU, tanh approximation (Gemma: `hidden_activation` `gelu_pytorch_tanh`), [`geglu`].
    GeluTanh,
    /// gpt-oss's experts: `(clamp(up) + 1) · g · σ(1.702·g)`, `g = min(gate, 7)`
    /// ([`crate::config::gpt_oss::clamped_swiglu`]).
    ClampedSwiglu,
}

impl Activation {
    /// `act(gate) · up` as one graph node ([`swiglu`] or [`geglu`]).
    pub fn gated(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Silu => swiglu(gate, up),
            Activation::GeluTanh => geglu(gate, up),
            Activation::ClampedSwiglu => crate::config::gpt_oss::clamped_swiglu(gate, up),
        }
    }

    /// `act(gate) · up` from candle's ops (no backward of its own: generation).
    pub fn gated_plain(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Silu => swiglu_slow(gate, up),
            Activation::GeluTanh => geglu_slow(gate, up),
            Activation::ClampedSwiglu => crate::config::gpt_oss::clamped_swiglu_slow(gate, up),
        }
    }
}

/// Gemma's gated MLP product `gelu_tanh(gate)·up` as one graph node (`gelu_tanh(g) = g/2 ·
/// (1 + tanh(√(2/π)·(g + 0.044715·g³)))`, PyTorch's `gelu(approximate="tanh")`); keeps only
/// its two inputs, the backward in f32. Reference: [`geglu_slow`].
pub fn geglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_gate_up("geglu", gate, up)?;
    let (g, u) = (gate.detach(), up.detach());
    let out = (g.gelu()? * &u)?;
    let dt = gate.dtype();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let (g32, u32, dy32) = (g.to_dtype(DType::F32)?, u.to_dtype(DType::F32)?, dy.to_dtype(DType::F32)?);
        const C: f64 = 0.797_884_560_802_865_4; // √(2/π)
        const K: f64 = 0.044_715;
        let g2 = g32.sqr()?;
        let th = ((&g32 * ((&g2 * K)? + 1.0)?)? * C)?.tanh()?;
        let half1 = ((&th + 1.0)? * 0.5)?;
        let gelu = (&g32 * &half1)?;
        // d/dg: (1 + th)/2 + g/2 · (1 - th²) · √(2/π) · (1 + 3K·g²)
        let dgelu = (&half1 + (((&g32 * 0.5)? * (1.0 - th.sqr()?)?)? * ((&g2 * (3.0 * K * C))? + C)?)?)?;
        let dup = (&dy32 * &gelu)?.to_dtype(dt)?;
        let dgate = ((dy32 * u32)? * dgelu)?.to_dtype(dt)?;
        Ok(vec![Some(dgate), Some(dup)])
    });
    attach2("geglu", gate, up, out, bwd)
}

fn check_gate_up(op: &str, gate: &Tensor, up: &Tensor) -> Result<()> {
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!(
            "{op}: gate {:?} ({:?}) and up {:?} ({:?}) must have one shape and dtype",
            gate.dims(),
            gate.dtype(),
            up.dims(),
            up.dtype()
        )
    }
    Ok(())
}

/// Qwen3's head norm then RoPE as one graph node: `rope(rms_norm(x)·w)` over the last dim of
/// `x` `[B, T, H, D]`, weight `w` `[D]` (shared by the heads), tables as [`apply_rope`]'s.
/// Values and gradients are those of [`rms_norm`] followed by [`apply_rope`] (the same
/// operations in the same order, bit for bit), but the node keeps only `x` (its input) and
/// the per-head statistic `[B, T, H, 1]` f32: the normalised copy the two nodes would keep
/// between them is recomputed in the backward. Reference: [`qk_norm_rope_slow`].
pub fn qk_norm_rope(x: &Tensor, w: &Tensor, eps: f64, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    qk_norm_rope_with(x, w, eps, cos, sin, NormWeight::Scale)
}

/// [`qk_norm_rope`] with the norm's weight applied as `form` says (Gemma 3's head norms:
/// [`NormWeight::UnitOffset`]).
pub fn qk_norm_rope_with(x: &Tensor, w: &Tensor, eps: f64, cos: &Tensor, sin: &Tensor, form: NormWeight) -> Result<Tensor> {
    let (t, d, r) = check_rope(x, cos, sin)?;
    if w.dims() != [d] {
        bail!("qk_norm_rope: weight {:?} must be [{d}] for x {:?}", w.dims(), x.dims())
    }
    let (c4, s4) = tables4(cos, sin, t, r, x.dtype())?;
    let (xd, wd) = (x.detach(), w.detach());
    let (n, r) = candle_cp_nn::rms_norm_fwd_with(&xd, &wd, eps, form)?;
    let out = rope4(&n, &c4, &s4)?;
    drop(n);
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        // RoPE's transpose gives the norm's output gradient; then the RMSNorm backward
        let (dx, dw) = candle_cp_nn::rms_norm_bwd_with(&xd, &r, &wd, &rope4_t(dy, &c4, &s4)?, form)?;
        Ok(vec![Some(dx), Some(dw)])
    });
    attach2("qk_norm_rope", x, w, out, bwd)
}

/// Reference for [`qk_norm_rope`] from plain candle ops (candle autograd).
pub fn qk_norm_rope_slow(x: &Tensor, w: &Tensor, eps: f64, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    apply_rope_slow(&rms_norm_slow(x, w, eps)?, cos, sin)
}

/// Reference for [`qk_norm_rope_with`] from plain candle ops (candle autograd).
pub fn qk_norm_rope_slow_with(x: &Tensor, w: &Tensor, eps: f64, cos: &Tensor, sin: &Tensor, form: NormWeight) -> Result<Tensor> {
    apply_rope_slow(&candle_cp_nn::rms_norm_slow_with(x, w, eps, form)?, cos, sin)
}

/// Reference for [`geglu`] from candle ops (candle autograd).
pub fn geglu_slow(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.gelu()? * up
}

/// Reference for [`swiglu`] from candle ops (candle autograd).
pub fn swiglu_slow(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.silu()? * up
}

/// Reference RoPE from plain candle ops (same math as [`apply_rope`]).
pub fn apply_rope_slow(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (t, _, r) = check_rope(x, cos, sin)?;
    let (cos, sin) = tables4(cos, sin, t, r, x.dtype())?;
    rope4(x, &cos, &sin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn max_rel(a: &Tensor, b: &Tensor) -> Result<f32> {
        let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok(d / b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30))
    }

    #[test]
    fn rope_matches_slow_values_and_grads() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = crate::config::LlamaConfig::tiny(16, 32, 1, 2, 1);
        let pos: Vec<u32> = vec![3, 900, 17, 4096, 0];
        let (cos, sin) = crate::rope::rope_tables(&cfg, &pos, DType::F32, &dev)?;
        let x = Var::randn(0f32, 1.0, (2, 5, 2, 16), &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (2, 5, 2, 16), &dev)?;
        let y = apply_rope(x.as_tensor(), &cos, &sin)?;
        let ys = apply_rope_slow(x.as_tensor(), &cos, &sin)?;
        assert!(max_rel(&y, &ys)? < 1e-6);
        let g = (&y * &dy)?.sum_all()?.backward()?;
        let gs = (&ys * &dy)?.sum_all()?.backward()?;
        let (a, b) = (
            g.get(x.as_tensor()).unwrap(),
            gs.get(x.as_tensor()).unwrap(),
        );
        assert!(max_rel(a, b)? < 1e-6);
        assert!(apply_rope(x.as_tensor(), &cos.narrow(0, 0, 4)?, &sin).is_err());
        Ok(())
    }

    /// A partial RoPE (tables 8 wide on heads of 16, Phi-4-mini's form): dimension `i < 4` pairs
    /// with `i + 4` (not `i + 8`), dimensions 8.. pass through, values (a hand-computed pair)
    /// and gradients (the transpose: a rotation back, the passed part's gradient unchanged), and
    /// `rope_post` gives the same.
    #[test]
    fn partial_rope_rotates_the_first_dims_only() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = crate::config::LlamaConfig::tiny(16, 32, 1, 2, 1).with_phi3(true).with_partial_rotary_factor(0.5);
        let pos: Vec<u32> = vec![5, 900, 0];
        let (cos, sin) = crate::rope::rope_tables(&cfg, &pos, DType::F64, &dev)?;
        assert_eq!(cos.dims(), [3, 8]);
        let x = Var::randn(0f64, 1.0, (1, 3, 2, 16), &dev)?;
        let y = apply_rope(x.as_tensor(), &cos, &sin)?;
        let (xs, ys): (Vec<f64>, Vec<f64>) = (x.flatten_all()?.to_vec1()?, y.flatten_all()?.to_vec1()?);
        let at = |v: &Vec<f64>, t: usize, h: usize, i: usize| v[(t * 2 + h) * 16 + i];
        for (t, h, i) in [(0, 0, 8), (1, 1, 15), (2, 0, 11)] {
            assert_eq!(at(&ys, t, h, i), at(&xs, t, h, i), "passed-through ({t}, {h}, {i})");
        }
        // position 5, frequency 0 (theta^0 = 1): the pair (0, 4) turned by 5 radians
        let (c, s_) = (5f64.cos(), 5f64.sin());
        let want0 = at(&xs, 0, 1, 0) * c - at(&xs, 0, 1, 4) * s_;
        let want4 = at(&xs, 0, 1, 4) * c + at(&xs, 0, 1, 0) * s_;
        assert!((at(&ys, 0, 1, 0) - want0).abs() < 1e-12 && (at(&ys, 0, 1, 4) - want4).abs() < 1e-12);
        // the gradient of sum(y·dy) is the rotation back of dy; the passed part's is dy
        let dy = Tensor::randn(0f64, 1.0, (1, 3, 2, 16), &dev)?;
        let g = (&y * &dy)?.sum_all()?.backward()?;
        let gx = g.get(x.as_tensor()).ok_or_else(|| candle_core::Error::Msg("no grad".into()))?;
        assert_eq!(gx.narrow(3, 8, 8)?.flatten_all()?.to_vec1::<f64>()?, dy.narrow(3, 8, 8)?.flatten_all()?.to_vec1::<f64>()?);
        let back = apply_rope(gx, &cos, &sin)?;
        assert!(max_rel_f64(&back, &dy)? < 1e-12);
        // rope_post (the projection's output map) rotates the same, forward and back
        let post = rope_post(2, &cos, &sin)?;
        let y3 = (post.fwd)(&x.as_tensor().reshape((1, 3, 32))?)?;
        assert!(max_rel_f64(&y3, &y)? < 1e-15);
        assert!(max_rel_f64(&(post.bwd)(&dy)?, gx)? < 1e-15);
        Ok(())
    }

    fn max_rel_f64(a: &Tensor, b: &Tensor) -> Result<f64> {
        let d = (a - b)?.abs()?.max_all()?.to_scalar::<f64>()?;
        Ok(d / b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-300))
    }

    /// Gradients of `sum(y·dy)` w.r.t. `vars`, for the fused and the reference op.
    fn grads_of(y: &Tensor, dy: &Tensor, vars: &[&Var]) -> Result<Vec<Tensor>> {
        let g = (y * dy)?.sum_all()?.backward()?;
        vars.iter().map(|v| g.get(v.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no grad".into()))).collect()
    }

    /// `rope_post` (RoPE as a projection's output map: the map and its transpose) gives the
    /// values and the input gradient of `apply_rope_slow` on the reshaped projection output,
    /// with shared and per-row tables; an output that does not fit the heads is an error.
    #[test]
    fn rope_post_matches_slow_values_and_grads() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = crate::config::LlamaConfig::tiny(16, 32, 1, 2, 1);
        let (b, t, h, d) = (2, 5, 3, 16);
        let pos: Vec<u32> = vec![3, 900, 17, 4096, 0];
        let (c1, s1) = crate::rope::rope_tables(&cfg, &pos, DType::F32, &dev)?;
        let (c2, s2) = crate::rope::rope_tables(&cfg, &[0, 1, 2, 3, 4], DType::F32, &dev)?;
        let (cb, sb) = (Tensor::stack(&[&c1, &c2], 0)?, Tensor::stack(&[&s1, &s2], 0)?);
        for (cos, sin) in [(&c1, &s1), (&cb, &sb)] {
            let post = rope_post(h, cos, sin)?;
            let y = Var::randn(0f32, 1.0, (b, t, h * d), &dev)?;
            let dy = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev)?;
            let out = (post.fwd)(y.as_tensor())?;
            let want = apply_rope_slow(&y.as_tensor().reshape((b, t, h, d))?, cos, sin)?;
            assert_eq!(out.dims(), [b, t, h, d]);
            assert!(max_rel(&out, &want)? < 1e-6);
            let g = (post.bwd)(&dy)?.reshape((b, t, h * d))?;
            let gs = grads_of(&want, &dy, &[&y])?;
            assert!(max_rel(&g, &gs[0])? < 1e-6, "{}", max_rel(&g, &gs[0])?);
        }
        let post = rope_post(h, &c1, &s1)?;
        let e = (post.fwd)(&Tensor::zeros((b, t, 40), DType::F32, &dev)?).unwrap_err();
        assert!(e.to_string().contains("[2, 5, 40]"), "{e}");
        assert!((post.fwd)(&Tensor::zeros((b, 4, h * d), DType::F32, &dev)?).is_err());
        Ok(())
    }

    /// The fused head norm + RoPE: the plain-candle reference's values and gradients (x and
    /// the weight) in f32, and bit for bit what `rms_norm` then `apply_rope` give, in f32 and
    /// bf16, shared and per-row tables; a weight of the wrong width is an error.
    #[test]
    fn qk_norm_rope_matches_slow_and_the_two_ops() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = crate::config::LlamaConfig::tiny(16, 32, 1, 2, 1);
        let (b, t, h, d) = (2, 5, 3, 16);
        let (c1, s1) = crate::rope::rope_tables(&cfg, &[3, 900, 17, 4096, 0], DType::F32, &dev)?;
        let (c2, s2) = crate::rope::rope_tables(&cfg, &[0, 1, 2, 3, 4], DType::F32, &dev)?;
        let (cb, sb) = (Tensor::stack(&[&c1, &c2], 0)?, Tensor::stack(&[&s1, &s2], 0)?);
        for (cos, sin) in [(&c1, &s1), (&cb, &sb)] {
            for dtype in [DType::F32, DType::BF16] {
                let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, (b, t, h, d), &dev)?.to_dtype(dtype)?)?;
                let w = Var::from_tensor(&(Tensor::randn(0f32, 0.5, d, &dev)? + 1.0)?.to_dtype(dtype)?)?;
                let dy = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev)?.to_dtype(dtype)?;
                let y = qk_norm_rope(x.as_tensor(), w.as_tensor(), 1e-6, cos, sin)?;
                let two = apply_rope(&rms_norm(x.as_tensor(), w.as_tensor(), 1e-6)?, cos, sin)?;
                let bits = |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
                assert_eq!(bits(&y)?, bits(&two)?, "{dtype:?}: values");
                let (g, g2) = (grads_of(&y, &dy, &[&x, &w])?, grads_of(&two, &dy, &[&x, &w])?);
                for (a, r) in g.iter().zip(&g2) {
                    assert_eq!(bits(a)?, bits(r)?, "{dtype:?}: gradients");
                }
                if dtype == DType::F32 {
                    let ys = qk_norm_rope_slow(x.as_tensor(), w.as_tensor(), 1e-6, cos, sin)?;
                    assert!(max_rel(&y, &ys)? < 1e-6);
                    for (a, r) in g.iter().zip(&grads_of(&ys, &dy, &[&x, &w])?) {
                        assert!(max_rel(a, r)? < 1e-5, "{}", max_rel(a, r)?);
                    }
                }
            }
        }
        let e = qk_norm_rope(&Tensor::zeros((b, t, h, d), DType::F32, &dev)?, &Tensor::ones(8, DType::F32, &dev)?, 1e-6, &c1, &s1).unwrap_err();
        assert!(e.to_string().contains("[8]"), "{e}");
        Ok(())
    }

    #[test]
    fn swiglu_matches_slow_values_and_grads() -> Result<()> {
        let dev = Device::Cpu;
        // wide values: the sigmoid saturates on both sides
        let g = Var::randn(0f32, 6.0, (3, 7, 11), &dev)?;
        let u = Var::randn(0f32, 1.0, (3, 7, 11), &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (3, 7, 11), &dev)?;
        let y = swiglu(g.as_tensor(), u.as_tensor())?;
        let ys = swiglu_slow(g.as_tensor(), u.as_tensor())?;
        assert!(max_rel(&y, &ys)? < 1e-6);
        let (a, r) = (grads_of(&y, &dy, &[&g, &u])?, grads_of(&ys, &dy, &[&g, &u])?);
        for (a, r) in a.iter().zip(&r) {
            assert!(max_rel(a, r)? < 1e-5, "{}", max_rel(a, r)?);
        }
        let e = swiglu(g.as_tensor(), &u.as_tensor().narrow(2, 0, 5)?).unwrap_err();
        assert!(e.to_string().contains("[3, 7, 5]"), "{e}");
        Ok(())
    }

    /// GeGLU (Gemma): values and gradients equal candle's `gelu` (tanh form) times `up` under
    /// candle's autograd, in f32 over wide values (tanh saturating both ways); values and
    /// gradients also match PyTorch's formula (gradient by central differences) in f64.
    #[test]
    fn geglu_matches_slow_values_and_grads() -> Result<()> {
        let dev = Device::Cpu;
        let g = Var::randn(0f32, 3.0, (3, 7, 11), &dev)?;
        let u = Var::randn(0f32, 1.0, (3, 7, 11), &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (3, 7, 11), &dev)?;
        let y = geglu(g.as_tensor(), u.as_tensor())?;
        let ys = geglu_slow(g.as_tensor(), u.as_tensor())?;
        assert!(max_rel(&y, &ys)? < 1e-6);
        let (a, r) = (grads_of(&y, &dy, &[&g, &u])?, grads_of(&ys, &dy, &[&g, &u])?);
        for (a, r) in a.iter().zip(&r) {
            assert!(max_rel(a, r)? < 1e-5, "{}", max_rel(a, r)?);
        }
        let torch = |x: f64| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
        let ones = Tensor::ones((1, 1, 9), DType::F32, &dev)?;
        let xs = [-6.0f32, -2.5, -1.0, -0.3, 0.0, 0.2, 1.1, 2.7, 5.0];
        let gx = Var::from_tensor(&Tensor::new(&xs, &dev)?.reshape((1, 1, 9))?)?;
        let yx = geglu(gx.as_tensor(), &ones)?;
        let dg = grads_of(&yx, &ones, &[&gx])?[0].flatten_all()?.to_vec1::<f32>()?;
        for ((x, d), y) in xs.iter().zip(&dg).zip(yx.flatten_all()?.to_vec1::<f32>()?) {
            let (x, h) = (*x as f64, 1e-4);
            assert!((y as f64 - torch(x)).abs() < 1e-6, "gelu({x}): {y} vs {}", torch(x));
            let want = (torch(x + h) - torch(x - h)) / (2.0 * h);
            assert!((*d as f64 - want).abs() < 1e-5, "gelu' at {x}: {d} vs {want}");
        }
        Ok(())
    }

    /// The head norm with Gemma's `1 + w`: the plain reference's values and gradients.
    #[test]
    fn qk_norm_rope_unit_offset_matches_slow() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = crate::config::LlamaConfig::tiny(16, 32, 1, 2, 1);
        let (cos, sin) = crate::rope::rope_tables(&cfg, &[3, 900, 17, 4096, 0], DType::F32, &dev)?;
        let x = Var::randn(0f32, 2.0, (2, 5, 3, 16), &dev)?;
        let w = Var::randn(0f32, 0.3, 16, &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (2, 5, 3, 16), &dev)?;
        let f = NormWeight::UnitOffset;
        let y = qk_norm_rope_with(x.as_tensor(), w.as_tensor(), 1e-6, &cos, &sin, f)?;
        let ys = qk_norm_rope_slow_with(x.as_tensor(), w.as_tensor(), 1e-6, &cos, &sin, f)?;
        assert!(max_rel(&y, &ys)? < 1e-6);
        for (a, r) in grads_of(&y, &dy, &[&x, &w])?.iter().zip(&grads_of(&ys, &dy, &[&x, &w])?) {
            assert!(max_rel(a, r)? < 1e-5, "{}", max_rel(a, r)?);
        }
        Ok(())
    }
}
