//! Attach a hand-written backward to a tensor computed outside candle's graph.
//!
//! Our parallel ops (ring attention, the Megatron/Ulysses collectives) compute their forward
//! with raw tensor code and collectives, not with a single kernel on storages. To make the
//! result differentiable we apply a `CustomOpN` whose forward *returns the precomputed output*
//! (one device copy) and whose `bwd` calls a closure — typically one call to the conjugate
//! collective or the ring backward. Inputs are only there so candle records the edges.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Backward closure: gets `grad_out` (the gradient of the attached output) and returns one
/// optional gradient per input, in input order.
pub type BackwardFn = Arc<dyn Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// An elementwise factor of an op's input drawn again on each call, the same values each time
/// (e.g. a dropout's scaled keep mask, a function of its seed): an op that takes one keeps the
/// function, not the `[.., in]` tensor, for its backward.
pub type MaskFn = Arc<dyn Fn() -> Result<Tensor> + Send + Sync>;

/// `(x ⊙ mask(), mask())` for an op named `op`; errors name a mask of another shape than `x`.
pub fn apply_mask(op: &str, x: &Tensor, mask: &MaskFn) -> Result<(Tensor, Tensor)> {
    let m = mask()?;
    if m.dims() != x.dims() {
        candle_core::bail!("{op}: mask {:?} for an input {:?}", m.dims(), x.dims())
    }
    Ok(((x * &m)?, m))
}

/// [`apply_mask`] of an optional mask: `(x ⊙ mask(), Some(mask()))`, or `(x, None)` without one.
pub fn apply_mask_opt(op: &str, x: &Tensor, mask: Option<&MaskFn>) -> Result<(Tensor, Option<Tensor>)> {
    match mask {
        Some(m) => {
            let (xm, m) = apply_mask(op, x, m)?;
            Ok((xm, Some(m)))
        }
        None => Ok((x.clone(), None)),
    }
}

struct Attached {
    name: &'static str,
    /// The precomputed output until the forward hands it out: taken then, so the graph node
    /// does not keep a second copy of it alive until the backward (candle's forward must
    /// return an owned storage, so the result is one copy of this tensor).
    out: Mutex<Option<Tensor>>,
    bwd: BackwardFn,
}

/// `t` detached and contiguous from the start of its storage: what a `CustomOpN` forward can
/// hand out as its result storage ([`cpu_storage`], [`cuda_storage`]).
pub(crate) fn packed(t: &Tensor) -> Result<Tensor> {
    let t = t.detach();
    let l = t.layout();
    if l.is_contiguous() && l.start_offset() == 0 {
        Ok(t)
    } else {
        t.force_contiguous()
    }
}

/// A copy of the storage of `t` (from [`packed`]) and its shape, for a CPU forward; `name`
/// labels the error when `t` is not on the CPU.
pub(crate) fn cpu_storage(name: &str, t: &Tensor) -> Result<(CpuStorage, Shape)> {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => Ok((s.clone(), t.shape().clone())),
        _ => candle_core::bail!("{name}: precomputed output is not on the CPU"),
    }
}

/// [`cpu_storage`] for a CUDA forward.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_storage(name: &str, t: &Tensor) -> Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::backend::BackendStorage;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, t.shape().clone())),
        _ => candle_core::bail!("{name}: precomputed output is not on a CUDA device"),
    }
}

impl Attached {
    fn new(name: &'static str, out: Tensor, bwd: BackwardFn) -> Result<Self> {
        Ok(Self { name, out: Mutex::new(Some(packed(&out)?)), bwd })
    }

    /// The precomputed output, taken out of the op (the forward runs once).
    fn take_out(&self) -> Result<Tensor> {
        let mut g = self.out.lock().unwrap_or_else(|e| e.into_inner());
        match g.take() {
            Some(t) => Ok(t),
            None => candle_core::bail!("{}: the attached forward ran twice", self.name),
        }
    }

    fn cpu_out(&self) -> Result<(CpuStorage, Shape)> {
        cpu_storage(self.name, &self.take_out()?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_out(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda_storage(self.name, &self.take_out()?)
    }

    fn grads(&self, grad: &Tensor, n: usize) -> Result<Vec<Option<Tensor>>> {
        let g = (self.bwd)(grad)?;
        if g.len() != n {
            candle_core::bail!("{}: backward returned {} gradients for {n} inputs", self.name, g.len())
        }
        Ok(g)
    }
}

macro_rules! cuda_fwd_impl {
    ($($arg:ident),*) => {
        #[cfg(feature = "cuda")]
        fn cuda_fwd(&self, $($arg: &candle_core::CudaStorage, _: &Layout),*) -> Result<(candle_core::CudaStorage, Shape)> {
            $(let _ = $arg;)*
            self.0.cuda_out()
        }
    };
}

struct Attached1(Attached);
struct Attached2(Attached);
struct Attached3(Attached);

impl CustomOp1 for Attached1 {
    fn name(&self) -> &'static str {
        self.0.name
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.0.cpu_out()
    }
    cuda_fwd_impl!(a);
    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut g = self.0.grads(grad, 1)?;
        Ok(g.pop().flatten())
    }
}

impl CustomOp2 for Attached2 {
    fn name(&self) -> &'static str {
        self.0.name
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.0.cpu_out()
    }
    cuda_fwd_impl!(a, b);
    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.0.grads(grad, 2)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for Attached3 {
    fn name(&self) -> &'static str {
        self.0.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.0.cpu_out()
    }
    cuda_fwd_impl!(a, b, c);
    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.0.grads(grad, 3)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

/// The output of an attached op as its backward needs it, without a second full copy.
///
/// CP attention ops compute their output in f32 and return it in q's dtype; the backward's
/// row sums `rowsum(dO∘O)` want the f32 value. Keeping the f32 output would cost 4 bytes
/// per element on top of the returned one; instead this keeps the returned (graph) output
/// itself, shared with the graph once [`KeptOutput::set`] has seen it, and, for a 16-bit
/// output, its rounding residual `out32 − out` in bf16 (2 bytes per element):
/// `out + residual` is the f32 output to about 2⁻¹⁷ relative (bf16 output; 2⁻²⁰ for f16).
/// An f32 output keeps nothing extra.
#[derive(Clone)]
struct KeptOutput {
    node: OutputSlot,
    residual: Option<Tensor>,
}

/// The rounding residual `out32 − out` of an output `out` returned in a 16-bit dtype, in
/// bf16 (`None` for an f32 `out`: nothing was rounded). `out + residual` is `out32` to about
/// 2⁻¹⁷ relative.
pub(crate) fn rounding_residual(out32: &Tensor, out: &Tensor) -> Result<Option<Tensor>> {
    Ok(match out.dtype() {
        candle_core::DType::F32 => None,
        _ => Some((out32 - out.to_dtype(candle_core::DType::F32)?)?.to_dtype(candle_core::DType::BF16)?),
    })
}

/// `out` in f32 plus the residual of [`rounding_residual`] (if any).
pub(crate) fn add_residual(out: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    let o = out.to_dtype(candle_core::DType::F32)?;
    match residual {
        None => Ok(o),
        Some(r) => o + r.to_dtype(candle_core::DType::F32)?,
    }
}

/// The tensor an attached op returned, recorded after [`attach3`] so that its backward can
/// read it without keeping a copy (it shares the graph node's storage).
#[derive(Clone, Default)]
pub(crate) struct OutputSlot(Arc<std::sync::OnceLock<Tensor>>);

impl OutputSlot {
    /// Record the returned tensor (detached; the first call wins).
    pub(crate) fn set(&self, out: &Tensor) {
        let _ = self.0.set(out.detach());
    }

    /// The recorded tensor; errors if the forward did not record it.
    pub(crate) fn get(&self) -> Result<&Tensor> {
        match self.0.get() {
            Some(t) => Ok(t),
            None => candle_core::bail!("attached op: backward before the forward recorded its output"),
        }
    }
}

impl KeptOutput {
    /// From the f32 output and the output `out` returned in the op's dtype; without
    /// `keep_residual` the backward reads the returned output alone.
    fn new(out32: &Tensor, out: &Tensor, keep_residual: bool) -> Result<Self> {
        let residual = if keep_residual { rounding_residual(out32, out)? } else { None };
        Ok(Self { node: OutputSlot::default(), residual })
    }

    /// Record the tensor the op returned: the backward reads it.
    fn set(&self, out: &Tensor) {
        self.node.set(out)
    }

    /// The f32 output (reconstructed; errors if [`KeptOutput::set`] was not called).
    fn f32(&self) -> Result<Tensor> {
        add_residual(self.node.get()?, self.residual.as_ref())
    }
}

/// Backward of [`attach3_from_f32`]: gets the f32 output (as `KeptOutput` rebuilds it) and
/// the output's gradient, returns the three inputs' gradients.
pub type BackwardFromF32 = Box<dyn Fn(&Tensor, &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// [`attach3`] for an op computed in f32: returns `out32` cast to `dtype`, differentiable
/// w.r.t. `a`, `b`, `c` through `bwd(out_f32, grad)`. The f32 output is not kept: the backward
/// gets it back from the returned output plus, for a 16-bit `dtype`, a bf16 rounding residual
/// (2 bytes per element; see `KeptOutput`).
pub fn attach3_from_f32(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    out32: Tensor,
    dtype: candle_core::DType,
    bwd: BackwardFromF32,
) -> Result<Tensor> {
    attach3_from_f32_with(name, a, b, c, out32, dtype, true, bwd)
}

/// [`attach3_from_f32`], keeping the bf16 rounding residual only when `keep_residual`: without
/// it the backward's `out_f32` is the returned 16-bit output in f32 (nothing extra kept; the
/// row sums of FlashAttention).
#[allow(clippy::too_many_arguments)]
pub fn attach3_from_f32_with(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    out32: Tensor,
    dtype: candle_core::DType,
    keep_residual: bool,
    bwd: BackwardFromF32,
) -> Result<Tensor> {
    attach_n_from_f32(name, &[a, b, c], out32, dtype, keep_residual, bwd)
}

/// [`attach3_from_f32_with`] over any number of inputs ([`attach_n`]): `bwd` returns one
/// gradient per input, in order (e.g. q, k, v and an attention's sink logits).
pub fn attach_n_from_f32(
    name: &'static str,
    inputs: &[&Tensor],
    out32: Tensor,
    dtype: candle_core::DType,
    keep_residual: bool,
    bwd: BackwardFromF32,
) -> Result<Tensor> {
    let out = out32.to_dtype(dtype)?;
    let kept = KeptOutput::new(&out32, &out, keep_residual)?;
    drop(out32);
    let k = kept.clone();
    let out = attach_n(name, inputs, out, Arc::new(move |g: &Tensor| bwd(&k.f32()?, g)))?;
    kept.set(&out);
    Ok(out)
}

/// True when any input takes part in a graph (is a variable or derived from one).
fn tracked(ts: &[&Tensor]) -> bool {
    ts.iter().any(|t| t.track_op())
}

/// Make `out` (computed from `a`) differentiable w.r.t. `a` with the given backward.
/// When `a` is not tracked, `out` is returned as is (no copy).
pub fn attach1(name: &'static str, a: &Tensor, out: Tensor, bwd: BackwardFn) -> Result<Tensor> {
    if !tracked(&[a]) {
        return Ok(out);
    }
    a.apply_op1(Attached1(Attached::new(name, out, bwd)?))
}

/// Make `out` (computed from `a`, `b`) differentiable w.r.t. both.
pub fn attach2(name: &'static str, a: &Tensor, b: &Tensor, out: Tensor, bwd: BackwardFn) -> Result<Tensor> {
    if !tracked(&[a, b]) {
        return Ok(out);
    }
    a.apply_op2(b, Attached2(Attached::new(name, out, bwd)?))
}

/// Make `out` (computed from `a`, `b`, `c`) differentiable w.r.t. all three.
pub fn attach3(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    out: Tensor,
    bwd: BackwardFn,
) -> Result<Tensor> {
    if !tracked(&[a, b, c]) {
        return Ok(out);
    }
    a.apply_op3(b, c, Attached3(Attached::new(name, out, bwd)?))
}

/// Make `out` (computed from `inputs`) differentiable w.r.t. each of them: `bwd` returns one
/// gradient per input, in order. Up to three inputs this is [`attach1`] to [`attach3`]; past
/// three, the inputs from the third on enter through one token node (a `[1]` tensor, itself
/// attached to them): the main node's backward leaves their gradients for the token's, which
/// candle runs after it (the token is the main node's input). So a node may keep any number of
/// small tensors without a separate op (e.g. an add) keeping its large operands alive.
pub fn attach_n(name: &'static str, inputs: &[&Tensor], out: Tensor, bwd: BackwardFn) -> Result<Tensor> {
    match inputs {
        [] => candle_core::bail!("{name}: no inputs to attach"),
        [a] => attach1(name, a, out, bwd),
        [a, b] => attach2(name, a, b, out, bwd),
        [a, b, c] => attach3(name, a, b, c, out, bwd),
        [a, b, rest @ ..] => {
            if !tracked(inputs) {
                return Ok(out);
            }
            let n = rest.len();
            let slot: Arc<Mutex<Option<Vec<Option<Tensor>>>>> = Arc::new(Mutex::new(None));
            let token_val = Tensor::zeros(1, a.dtype(), a.device())?;
            let s = slot.clone();
            let token_bwd: BackwardFn = Arc::new(move |_: &Tensor| {
                let taken = s.lock().unwrap_or_else(|e| e.into_inner()).take();
                Ok(taken.unwrap_or_else(|| vec![None; n]))
            });
            let token = attach_n(name, rest, token_val.clone(), token_bwd)?;
            let main: BackwardFn = Arc::new(move |g: &Tensor| {
                let mut grads = bwd(g)?;
                if grads.len() != n + 2 {
                    candle_core::bail!("{name}: backward gave {} gradients for {} inputs", grads.len(), n + 2)
                }
                let tail = grads.split_off(2);
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(tail);
                grads.push(Some(token_val.zeros_like()?));
                Ok(grads)
            });
            attach3(name, a, b, &token, out, main)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Five inputs (two through the token): each gets its gradient; a second backward over the
    /// same graph gets them again.
    #[test]
    fn attach_n_routes_every_gradient() -> Result<()> {
        let vs: Vec<Var> = (0..5).map(|i| Var::new(&[i as f32 + 1.0, 2.0 * i as f32], &Device::Cpu)).collect::<Result<_>>()?;
        // out = Σ_i (i + 1) · x_i
        let mut val = Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu)?;
        for (i, v) in vs.iter().enumerate() {
            val = (val + (v.as_tensor() * (i as f64 + 1.0))?)?;
        }
        let bwd: BackwardFn = Arc::new(|g: &Tensor| (0..5).map(|i| Ok(Some((g * (i as f64 + 1.0))?))).collect());
        let ins: Vec<&Tensor> = vs.iter().map(|v| v.as_tensor()).collect();
        let out = attach_n("weighted sum", &ins, val.detach(), bwd)?;
        for _ in 0..2 {
            let grads = (&out * 3.0)?.sum_all()?.backward()?;
            for (i, v) in vs.iter().enumerate() {
                let g = grads.get(v).ok_or_else(|| candle_core::Error::Msg(format!("no gradient for input {i}")))?;
                assert_eq!(g.to_vec1::<f32>()?, vec![3.0 * (i as f32 + 1.0); 2], "input {i}");
            }
        }
        Ok(())
    }

    #[test]
    fn attached_backward_is_called() -> Result<()> {
        let x = Var::new(&[1f32, 2., 3.], &Device::Cpu)?;
        let y = (x.as_tensor() * 2.0)?.detach();
        let bwd: BackwardFn = Arc::new(|g: &Tensor| Ok(vec![Some((g * 2.0)?)]));
        let y = attach1("double", x.as_tensor(), y, bwd)?;
        assert_eq!(y.to_vec1::<f32>()?, vec![2., 4., 6.]);
        let grads = y.sum_all()?.backward()?;
        assert_eq!(grads.get(&x).unwrap().to_vec1::<f32>()?, vec![2., 2., 2.]);
        Ok(())
    }

    #[test]
    fn untracked_input_returns_output_unchanged() -> Result<()> {
        let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
        let bwd: BackwardFn = Arc::new(|_| Ok(vec![None]));
        let y = attach1("noop", &x, (&x + 1.0)?, bwd)?;
        assert!(!y.track_op());
        assert_eq!(y.to_vec1::<f32>()?, vec![2., 3.]);
        Ok(())
    }
}
