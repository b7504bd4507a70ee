//! Column-parallel parts whose graph keeps only the input's sequence shard.
//!
//! Under sequence parallelism a column-parallel layer multiplies the all-gathered input
//! `[B, T, in]`; a plain graph (all-gather node, then the GEMMs) keeps that gathered tensor
//! alive until the backward, `P` times the shard `[B, T/P, in]` the norm before it produced.
//! Megatron-LM keeps the shard and all-gathers it again in the backward; so does this. The
//! forward gathers once for all parts and drops the gathered input. The graph:
//!
//! ```text
//!   x [B, T/P, in] ──► token [1] ──┬──► part 0 (token, W0[, b0]) ──► y0
//!   (shard, kept)      (one node)  ├──► part 1 (token, W1[, b1]) ──► y1
//!                                  └──► ...
//! ```
//!
//! Backward: the first part to run all-gathers the shard again (kept until the token's
//! backward), every part that reaches the loss adds `g·Wᵢ` into one `[B, T, in]` input
//! gradient and returns a zero for the token; the token's backward, which candle runs after
//! all of its consumers, reduce-scatters that sum into the shard's gradient (one collective,
//! as before) and releases the state, so a part whose output is unused simply adds nothing and
//! another backward over the same graph starts afresh. Without SP the same holds with the
//! identity for the gather and an all-reduce for the reduce-scatter (`copy_to_tp_region`'s
//! pair), and the input is not copied.

use candle_core::{bail, Result, Tensor};
use candle_cp_comm::Group;
use candle_cp_ops::autograd::{apply_mask_opt, attach1, attach_n, BackwardFn, MaskFn};
use crate::linear::{affine, affine_grads};
use candle_cp_ops::mappings::SEQ_DIM;
use std::sync::{Arc, Mutex};

/// A tensor map and its transpose.
pub type PartMap = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// A linear map applied to a part's output inside its graph node, e.g. RoPE: `fwd` on the
/// output `[.., out_i/P]`, `bwd` its transpose on the gradient (returning `[.., out_i/P]`'s
/// elements in any shape). The map's input is not kept.
#[derive(Clone)]
pub struct PartPost {
    /// The map.
    pub fwd: PartMap,
    /// Its transpose (applied to the output gradient).
    pub bwd: PartMap,
}

/// The shared backward state of one forward's parts.
struct State {
    /// The input as given (sequence shard with SP), detached.
    x: Tensor,
    /// The input gathered again (first part's backward until the token's).
    full: Option<Tensor>,
    /// The sum of the parts' input gradients `[.., T, in]` so far.
    dx: Option<Tensor>,
}

/// One part: weight `[o, in]`, optional bias `[o]`, optional output map.
pub(crate) struct PartRef<'a> {
    pub(crate) weight: &'a Tensor,
    pub(crate) bias: Option<&'a Tensor>,
    pub(crate) post: Option<PartPost>,
    /// An adapter's update added inside the part's node, before its output map.
    pub(crate) update: Option<PartUpdate>,
}

/// A term a part adds inside its node, before its output map, from its gathered input `X`
/// `[.., T, in]` through an optional elementwise mask `M` (a dropout's, on the gathered shape:
/// `X̃ = X ⊙ M`, drawn again in the backward): the graph keeps the term's weights only, not the
/// masked input, the term or the base output that an add after the part would keep alive.
pub(crate) struct PartUpdate {
    pub(crate) kind: UpdateKind,
    pub(crate) mask: Option<MaskFn>,
}

/// The term of a [`PartUpdate`].
pub(crate) enum UpdateKind {
    /// LoRA's `s·(X̃·Aᵀ)·Bᵀ`, `A` `[r, in]`, `B` `[o, r]` (`X̃·Aᵀ` formed again in the backward).
    LowRank { a: Tensor, b: Tensor, scale: f64 },
    /// `X̃·Δᵀ`, `Δ` `[o, in]` (DoRA's `W' - W` while its dropout draws masks).
    Full { w: Tensor },
}

impl PartUpdate {
    /// The node's inputs the term adds (`A`, `B`, or `Δ`).
    fn inputs(&self) -> Vec<&Tensor> {
        match &self.kind {
            UpdateKind::LowRank { a, b, .. } => vec![a, b],
            UpdateKind::Full { w } => vec![w],
        }
    }

    /// `X̃` `[lead, in]` of the gathered input `full` and the mask `[lead, in]` (none without).
    fn masked(&self, full: &Tensor, lead: usize, in_dim: usize) -> Result<(Tensor, Option<Tensor>)> {
        let (xm, m) = apply_mask_opt("ColumnParallelLinear", full, self.mask.as_ref())?;
        Ok((xm.reshape((lead, in_dim))?, m.map(|m| m.reshape((lead, in_dim))).transpose()?))
    }

    /// The term `[lead, o]` of the gathered input (detached weights).
    fn term(&self, full: &Tensor, lead: usize, in_dim: usize, o: usize) -> Result<Tensor> {
        let (xm, _) = self.masked(full, lead, in_dim)?;
        let t = match &self.kind {
            UpdateKind::LowRank { a, b, scale } => xm.matmul(&a.detach().t()?)?.affine(*scale, 0.0)?.matmul(&b.detach().t()?)?,
            UpdateKind::Full { w } => xm.matmul(&w.detach().t()?)?,
        };
        if t.dims() != [lead, o] {
            bail!("ColumnParallelLinear: a part's update gives {:?} for an output [{lead}, {o}]", t.dims())
        }
        Ok(t)
    }

    /// The term's share of the input gradient `[lead, in]` and its weights' gradients from the
    /// part's output gradient `gy` `[lead, o]`.
    fn grads(&self, gy: &Tensor, full: &Tensor, lead: usize, in_dim: usize) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let (xm, m) = self.masked(full, lead, in_dim)?;
        let (dx, ws) = match &self.kind {
            UpdateKind::LowRank { a, b, scale } => {
                let (ad, bd) = (a.detach(), b.detach());
                // du = s·g·B, dB = s·gᵀ·u, dA = duᵀ·X̃, dX̃ = du·A
                let u = xm.matmul(&ad.t()?)?;
                let du = gy.matmul(&bd)?.affine(*scale, 0.0)?;
                let db = gy.t()?.matmul(&u)?.affine(*scale, 0.0)?;
                (du.matmul(&ad)?, vec![Some(du.t()?.matmul(&xm)?), Some(db)])
            }
            UpdateKind::Full { w } => (gy.matmul(&w.detach())?, vec![Some(gy.t()?.matmul(&xm)?)]),
        };
        let dx = match m {
            Some(m) => (dx * m)?,
            None => dx,
        };
        Ok((dx, ws))
    }
}

fn gather(x: &Tensor, group: &Group, sp: bool) -> Result<Tensor> {
    if sp && group.size() > 1 {
        group.all_gather(x, SEQ_DIM)
    } else {
        Ok(x.clone())
    }
}

/// The parts' outputs `post_i(gather(x)·Wᵢᵀ + bᵢ)` (see the module doc), `x` `[B, T/P, in]`
/// (SP) or `[.., in]`.
pub(crate) fn regathered_parts(x: &Tensor, parts: Vec<PartRef<'_>>, group: &Group, sp: bool) -> Result<Vec<Tensor>> {
    let xd = x.detach();
    let full = gather(&xd, group, sp)?;
    let in_dim = full.dim(full.rank() - 1)?;
    let lead = full.elem_count() / in_dim.max(1);
    let full_dims = full.dims().to_vec();
    let state = Arc::new(Mutex::new(State { x: xd, full: None, dx: None }));
    // the token: the parts' one edge to x; its backward forms x's gradient
    let token_val = Tensor::zeros(1, x.dtype(), x.device())?;
    let token = {
        let (st, g) = (state.clone(), group.clone());
        let bwd: BackwardFn = Arc::new(move |_: &Tensor| {
            let mut s = st.lock().unwrap_or_else(|e| e.into_inner());
            s.full = None;
            let Some(dx) = s.dx.take() else { return Ok(vec![None]) };
            let dx = dx.reshape(full_dims.as_slice())?;
            Ok(vec![Some(if g.size() == 1 {
                dx
            } else if sp {
                g.reduce_scatter(&dx, SEQ_DIM)?
            } else {
                g.all_reduce(&dx)?
            })])
        });
        attach1("ColumnParallelLinear input", x, token_val.clone(), bwd)?
    };
    let mut outs = Vec::with_capacity(parts.len());
    for part in parts {
        let (o, wi) = part.weight.dims2()?;
        if wi != in_dim {
            bail!("ColumnParallelLinear: input {:?} does not match weight {:?} ([out, in])", x.dims(), part.weight.dims())
        }
        let wd = part.weight.detach();
        let mut y = affine(&full, &wd, part.bias.map(|b| b.detach()).as_ref())?;
        if let Some(up) = &part.update {
            y = (y.reshape((lead, o))? + up.term(&full, lead, in_dim, o)?)?.reshape(y.dims())?;
        }
        if let Some(p) = &part.post {
            y = (p.fwd)(&y)?;
        }
        let (st, g, post, has_bias, zero) = (state.clone(), group.clone(), part.post.clone(), part.bias.is_some(), token_val.clone());
        let n_inputs = 2 + usize::from(has_bias) + part.update.as_ref().map_or(0, |u| u.inputs().len());
        let update = part.update.map(Arc::new);
        let upd = update.clone();
        let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
            let gy = match &post {
                Some(p) => (p.bwd)(dy)?,
                None => dy.clone(),
            };
            let gy = gy.reshape((lead, o))?;
            let mut s = st.lock().unwrap_or_else(|e| e.into_inner());
            let full = match &s.full {
                Some(f) => f.clone(),
                None => {
                    let f = gather(&s.x, &g, sp)?;
                    s.full = Some(f.clone());
                    f
                }
            };
            let (dx, dw) = affine_grads(&gy, &full.reshape((lead, in_dim))?, &wd)?;
            let (dx, dup) = match &upd {
                Some(up) => {
                    let (dxu, dws) = up.grads(&gy, &full, lead, in_dim)?;
                    ((dx + dxu)?, dws)
                }
                None => (dx, Vec::new()),
            };
            s.dx = Some(match s.dx.take() {
                Some(acc) => (acc + dx)?,
                None => dx,
            });
            drop(s);
            let mut grads = vec![Some(zero.clone()), Some(dw)];
            if has_bias {
                grads.push(Some(gy.sum(0)?));
            }
            grads.extend(dup);
            Ok(grads)
        });
        let mut inputs: Vec<&Tensor> = vec![&token, part.weight];
        if let Some(b) = part.bias {
            inputs.push(b);
        }
        if let Some(up) = &update {
            inputs.extend(up.inputs());
        }
        debug_assert_eq!(inputs.len(), n_inputs);
        let out = attach_n("ColumnParallelLinear part", &inputs, y, bwd)?;
        outs.push(out);
    }
    Ok(outs)
}
