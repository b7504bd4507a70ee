//! Activation recomputation ("gradient checkpointing") for candle's autograd.
//!
//! candle keeps every tensor a recorded op saved until the backward is done, so a model's
//! activation memory grows with its depth × local sequence length. At long context that is
//! what runs out first. [`Recompute::checkpoint`] runs a block (e.g. one decoder layer)
//! *without* keeping its graph: only the block's input is saved. When the backward reaches
//! the block, it reruns the block's forward from the saved input with autograd, backpropagates
//! the incoming gradient through it, returns the input's gradient to candle's backward and
//! files the parameters' gradients in the [`Recompute`] (candle's `CustomOp1::bwd` can only
//! return the gradient of its tensor argument). [`Recompute::backward`] = `loss.backward()` plus
//! those parameter gradients.
//!
//! ```text
//! forward :  x ──[block, graph dropped]──► y           saved: x only
//! backward:  dy ─► x' = var(x) ─[block with graph]─► y' ; (y'·dy).sum().backward()
//!                 ├─► dx  (to candle's backward, as the op's input gradient)
//!                 └─► dW  (parameters: kept here until Recompute::backward / collect_into)
//! ```
//!
//! The block may contain collectives (ring attention, TP/SP mappings): its backward reruns
//! them during the outer backward, in the same order on every rank as long as every rank
//! checkpoints the same blocks. The rerun must compute the same forward: blocks with random
//! draws (dropout) must take their randomness from explicit seeds (as
//! `candle_cp_nn::Dropout` does), not from a global RNG.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, Var};
use std::sync::{Arc, Mutex};

/// A block's forward, rerun in the backward: `[.., h] → [.., h']`, any shapes.
pub type BlockFn = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// Called with each block's gradients as soon as the backward has rerun the block (blocks in
/// reverse order of their forward), before they are filed for [`Recompute::collect_into`].
/// The store holds the gradients of the variables the block used (its parameters) and of the
/// block's intermediate tensors; look up the tensors you care about. A gradient the hook
/// removes from the store is not filed (its memory goes as soon as the hook drops it): a hook
/// that hands the gradients on, e.g. to a reduction, takes them. An `Err` fails the backward.
/// Used to start a block's gradient reduction while the backward of the blocks before it runs
/// (see [`Recompute::set_block_hook`]).
pub type BlockGradsHook = Arc<dyn Fn(&mut GradStore) -> Result<()> + Send + Sync>;

/// Recomputes checkpointed blocks in the backward and holds their parameters' gradients
/// until they are collected. Clones share the same store. One per model replica (rank).
#[derive(Clone, Default)]
pub struct Recompute {
    grads: Arc<Mutex<Option<GradStore>>>,
    hook: Arc<Mutex<Option<BlockGradsHook>>>,
}

impl std::fmt::Debug for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recompute {{ pending: {} }}", !self.is_empty())
    }
}

fn lock_err<T>(_: T) -> candle_core::Error {
    candle_core::Error::Msg("Recompute: gradient store lock poisoned (a rank panicked in backward)".into())
}

impl Recompute {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// `f(x)`, differentiable w.r.t. `x` and every variable `f` uses, without keeping `f`'s
    /// graph: the backward reruns `f` (see the module docs). `name` labels errors.
    ///
    /// When neither `x` nor anything inside `f` is tracked (inference), this is plain `f(x)`.
    pub fn checkpoint(&self, name: &'static str, x: &Tensor, f: BlockFn) -> Result<Tensor> {
        let y = f(&x.detach())?;
        if !x.track_op() && !y.track_op() {
            return Ok(y);
        }
        // candle records the op only for a tracked argument: an untracked input (e.g. frozen
        // embeddings) becomes a variable copy so the backward still reaches the block
        let arg = if x.track_op() { x.clone() } else { Var::from_tensor(x)?.as_tensor().clone() };
        let op = Checkpoint { name, out: Mutex::new(Some(crate::autograd::packed(&y)?)), f, store: self.clone() };
        drop(y); // the block's graph goes with it
        arg.apply_op1(op)
    }

    /// Call `hook` with each block's gradients during the backward (`None`: no hook). Shared by
    /// the clones of this store.
    pub fn set_block_hook(&self, hook: Option<BlockGradsHook>) -> Result<()> {
        *self.hook.lock().map_err(lock_err)? = hook;
        Ok(())
    }

    /// True when no parameter gradient is waiting to be collected.
    pub fn is_empty(&self) -> bool {
        self.grads.lock().map(|g| g.is_none()).unwrap_or(true)
    }

    /// Move the parameter gradients of the blocks backpropagated so far into `grads`
    /// (summing with what is there). The store is empty afterwards.
    pub fn collect_into(&self, grads: &mut GradStore) -> Result<()> {
        let pending = self.grads.lock().map_err(lock_err)?.take();
        match pending {
            Some(p) => grads.extend(p),
            None => Ok(()),
        }
    }

    /// `loss.backward()` plus the parameter gradients of the checkpointed blocks: use this
    /// instead of `loss.backward()` whenever blocks were checkpointed.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        // a failed earlier backward may have left partial gradients: never mix them in
        self.clear();
        let mut grads = loss.backward()?;
        self.collect_into(&mut grads)?;
        Ok(grads)
    }

    /// Drop uncollected parameter gradients.
    pub fn clear(&self) {
        if let Ok(mut g) = self.grads.lock() {
            *g = None;
        }
    }

    fn add(&self, g: GradStore) -> Result<()> {
        let mut slot = self.grads.lock().map_err(lock_err)?;
        match slot.as_mut() {
            Some(s) => s.extend(g),
            None => {
                *slot = Some(g);
                Ok(())
            }
        }
    }
}

/// The recorded op: forward hands out the precomputed block output once; backward reruns.
struct Checkpoint {
    name: &'static str,
    out: Mutex<Option<Tensor>>,
    f: BlockFn,
    store: Recompute,
}

impl Checkpoint {
    fn take_out(&self) -> Result<Tensor> {
        let out = self.out.lock().map_err(lock_err)?.take();
        out.ok_or_else(|| candle_core::Error::Msg(format!("{}: checkpoint forward ran twice", self.name)))
    }
}

impl CustomOp1 for Checkpoint {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        crate::autograd::cpu_storage(self.name, &self.take_out()?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, _: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::autograd::cuda_storage(self.name, &self.take_out()?)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // rerun the block from a leaf copy of the saved input, with its graph this time
        let x = Var::from_tensor(&arg.detach())?;
        let y = (self.f)(x.as_tensor())?;
        if y.shape() != grad.shape() {
            candle_core::bail!("{}: recomputed output {:?} differs from the gradient {:?}", self.name, y.shape(), grad.shape())
        }
        let g = grad.detach().to_dtype(y.dtype())?;
        // d/dy of Σ(y ⊙ g) is g exactly: the same gradient the block would have received
        let mut grads = (&y * &g)?.sum_all()?.backward()?;
        let dx = grads.remove(x.as_tensor());
        grads.remove(&g); // (candle files a gradient for both sides of a product)
        let hook = self.store.hook.lock().map_err(lock_err)?.clone();
        if let Some(h) = hook {
            h(&mut grads)?;
        }
        self.store.add(grads)?;
        Ok(dx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oracle::randn;
    use candle_core::{DType, D};

    /// Two-layer gated MLP with a residual, the shape of a decoder block's second half.
    fn block(w1: &Tensor, w2: &Tensor, x: &Tensor) -> Result<Tensor> {
        let h = x.broadcast_matmul(&w1.t()?)?;
        let h = (h.silu()? * h.sqr()?)?;
        x + h.broadcast_matmul(&w2.t()?)?
    }

    fn vars(seed: u64) -> Result<(Var, Var, Tensor)> {
        let w1 = Var::from_tensor(&randn(seed, &[12, 8], 0.3)?)?;
        let w2 = Var::from_tensor(&randn(seed + 1, &[8, 12], 0.3)?)?;
        let x = randn(seed + 2, &[2, 5, 8], 1.0)?;
        Ok((w1, w2, x))
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// A scalar loss of three stacked blocks on `x0` (a var when `x_var`).
    fn run(rc: Option<&Recompute>, x_var: bool) -> Result<(f32, Vec<Tensor>)> {
        let (w1, w2, x) = vars(7)?;
        let xv = Var::from_tensor(&x)?;
        let mut h = if x_var { xv.as_tensor().clone() } else { x.clone() };
        for _ in 0..3 {
            h = match rc {
                Some(rc) => {
                    let (a, b) = (w1.as_tensor().clone(), w2.as_tensor().clone());
                    rc.checkpoint("mlp", &h, Arc::new(move |x: &Tensor| block(&a, &b, x)))?
                }
                None => block(w1.as_tensor(), w2.as_tensor(), &h)?,
            };
        }
        let loss = (h.sqr()?.mean_all()? + h.sin()?.mean_keepdim(D::Minus1)?.mean_all()?)?;
        let g = match rc {
            Some(rc) => rc.backward(&loss)?,
            None => loss.backward()?,
        };
        let mut out = vec![];
        for t in [w1.as_tensor(), w2.as_tensor()] {
            out.push(g.get(t).cloned().ok_or_else(|| candle_core::Error::Msg("missing grad".into()))?);
        }
        if x_var {
            out.push(g.get(xv.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("missing dx".into()))?);
        }
        Ok((loss.to_scalar::<f32>()?, out))
    }

    #[test]
    fn checkpoint_matches_plain_autograd() -> Result<()> {
        for x_var in [false, true] {
            let (l0, g0) = run(None, x_var)?;
            let rc = Recompute::new();
            let (l1, g1) = run(Some(&rc), x_var)?;
            assert_eq!(l0, l1, "loss");
            assert_eq!(g0.len(), g1.len());
            for (a, b) in g0.iter().zip(&g1) {
                let d = max_diff(a, b)?;
                assert!(d <= 1e-6, "grad differs by {d} (x_var {x_var})");
            }
            assert!(rc.is_empty(), "backward collects every parameter gradient");
        }
        Ok(())
    }

    #[test]
    fn input_gradient_without_parameters_and_inference() -> Result<()> {
        // frozen block (constant weights): only dx flows
        let (w1, w2, x) = vars(3)?;
        let (a, b) = (w1.as_tensor().detach(), w2.as_tensor().detach());
        let xv = Var::from_tensor(&x)?;
        let rc = Recompute::new();
        let (a2, b2) = (a.clone(), b.clone());
        let y = rc.checkpoint("frozen", xv.as_tensor(), Arc::new(move |x: &Tensor| block(&a2, &b2, x)))?;
        let gy = rc.backward(&y.sqr()?.sum_all()?)?;
        let y0 = block(&a, &b, xv.as_tensor())?;
        let g0 = y0.sqr()?.sum_all()?.backward()?;
        let d = max_diff(gy.get(xv.as_tensor()).expect("dx"), g0.get(xv.as_tensor()).expect("dx"))?;
        assert!(d <= 1e-6, "dx differs by {d}");
        // inference: nothing tracked, plain forward, nothing recorded
        let y = rc.checkpoint("frozen", &x, Arc::new(move |x: &Tensor| block(&a, &b, x)))?;
        assert!(!y.track_op());
        Ok(())
    }

    #[test]
    fn uncollected_gradients_stay_until_collected_and_dtype_follows() -> Result<()> {
        let (w1, w2, x) = vars(5)?;
        let rc = Recompute::new();
        let (a, b) = (w1.as_tensor().to_dtype(DType::BF16)?, w2.as_tensor().to_dtype(DType::BF16)?);
        let y = rc.checkpoint("bf16", &x.to_dtype(DType::BF16)?, Arc::new(move |x: &Tensor| block(&a, &b, x)))?;
        assert_eq!(y.dtype(), DType::BF16);
        let mut g = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
        assert!(g.get(w1.as_tensor()).is_none(), "plain backward cannot see the block's parameters");
        assert!(!rc.is_empty());
        rc.collect_into(&mut g)?;
        assert!(rc.is_empty());
        assert_eq!(g.get(w1.as_tensor()).expect("dW1").dtype(), DType::F32);
        Ok(())
    }

    #[test]
    fn a_failing_block_is_an_error() -> Result<()> {
        let (w1, _, x) = vars(1)?;
        let rc = Recompute::new();
        let w = w1.as_tensor().clone();
        // wrong inner dimension: the forward fails with candle's shape error
        let r = rc.checkpoint("bad", &x.narrow(2, 0, 3)?, Arc::new(move |x: &Tensor| x.broadcast_matmul(&w.t()?)));
        assert!(r.is_err());
        Ok(())
    }

    #[test]
    fn the_hook_sees_each_block_once_and_can_fail_the_backward() -> Result<()> {
        let (w1, w2, x) = vars(9)?;
        let rc = Recompute::new();
        let seen: Arc<Mutex<Vec<Tensor>>> = Arc::default();
        let (wt, seen2) = (w1.as_tensor().clone(), seen.clone());
        rc.set_block_hook(Some(Arc::new(move |g: &mut GradStore| {
            let gw = g.get(&wt).ok_or_else(|| candle_core::Error::Msg("hook: no dW1".into()))?;
            seen2.lock().map_err(lock_err)?.push(gw.clone());
            Ok(())
        })))?;
        let mut h = x.clone();
        for _ in 0..3 {
            let (a, b) = (w1.as_tensor().clone(), w2.as_tensor().clone());
            h = rc.checkpoint("mlp", &h, Arc::new(move |x: &Tensor| block(&a, &b, x)))?;
        }
        let g = rc.backward(&h.sqr()?.mean_all()?)?;
        // three blocks, three calls; the per-block dW1 add up to the collected one
        let seen = seen.lock().map_err(lock_err)?.clone();
        assert_eq!(seen.len(), 3);
        let sum = ((&seen[0] + &seen[1])? + &seen[2])?;
        let d = max_diff(&sum, g.get(w1.as_tensor()).expect("dW1"))?;
        assert!(d <= 1e-6, "hooked dW1 sum differs by {d}");
        // an Err from the hook fails the backward
        rc.set_block_hook(Some(Arc::new(|_: &mut GradStore| candle_core::bail!("hook refused"))))?;
        let (a, b) = (w1.as_tensor().clone(), w2.as_tensor().clone());
        let y = rc.checkpoint("mlp", &x, Arc::new(move |x: &Tensor| block(&a, &b, x)))?;
        let e = rc.backward(&y.sum_all()?).expect_err("the hook's error must fail the backward");
        assert!(e.to_string().contains("hook refused"), "{e}");
        // a gradient the hook takes is not filed: dW2 stays, dW1 is gone
        let w1t = w1.as_tensor().clone();
        rc.set_block_hook(Some(Arc::new(move |g: &mut GradStore| {
            g.remove(&w1t);
            Ok(())
        })))?;
        let (a, b) = (w1.as_tensor().clone(), w2.as_tensor().clone());
        let y = rc.checkpoint("mlp", &x, Arc::new(move |x: &Tensor| block(&a, &b, x)))?;
        let g = rc.backward(&y.sum_all()?)?;
        assert!(g.get(w1.as_tensor()).is_none() && g.get(w2.as_tensor()).is_some());
        rc.set_block_hook(None)?;
        Ok(())
    }
}
