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

use candle_core::{bail, Result, Tensor, D};
use candle_cp_comm::Group;
use candle_cp_ops::autograd::{apply_mask, attach1, attach_n, BackwardFn, MaskFn};
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
    /// The input's elementwise mask ([`regathered_parts_masked`]): drawn again with the first
    /// part's backward, used by the token's.
    mask: Option<Tensor>,
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
    /// A low-rank update added inside the part's node, before its output map.
    pub(crate) update: Option<PartUpdate>,
}

/// A part's low-rank update `s·u·Bᵀ` (a LoRA adapter's, `u = x·Aᵀ` `[.., T, r]` over the whole
/// sequence, `B` `[o, r]`), added inside the part's node: the graph keeps `u` and `B`, not the
/// `[.., T, o]` base output and update that an add after the part would keep alive.
pub(crate) struct PartUpdate {
    pub(crate) u: Tensor,
    pub(crate) b: Tensor,
    pub(crate) scale: f64,
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
    regathered_parts_masked(x, None, parts, group, sp)
}

/// [`regathered_parts`] of the input `x ⊙ mask()` (e.g. a dropout's keep mask on the shard, the
/// same values on each call): the graph keeps `x` (and the mask function), not the masked
/// input; the backward masks the regathered shard and the shard's gradient again.
pub(crate) fn regathered_parts_masked(x: &Tensor, mask: Option<&MaskFn>, parts: Vec<PartRef<'_>>, group: &Group, sp: bool) -> Result<Vec<Tensor>> {
    let xd = x.detach();
    let full = match mask {
        Some(m) => gather(&apply_mask("ColumnParallelLinear", &xd, m)?.0, group, sp)?,
        None => gather(&xd, group, sp)?,
    };
    let mask = mask.cloned();
    let in_dim = full.dim(full.rank() - 1)?;
    let lead = full.elem_count() / in_dim.max(1);
    let full_dims = full.dims().to_vec();
    let state = Arc::new(Mutex::new(State { x: xd, mask: None, full: None, dx: None }));
    // the token: the parts' one edge to x; its backward forms x's gradient
    let token_val = Tensor::zeros(1, x.dtype(), x.device())?;
    let token = {
        let (st, g) = (state.clone(), group.clone());
        let bwd: BackwardFn = Arc::new(move |_: &Tensor| {
            let mut s = st.lock().unwrap_or_else(|e| e.into_inner());
            s.full = None;
            let m = s.mask.take();
            let Some(dx) = s.dx.take() else { return Ok(vec![None]) };
            let dx = dx.reshape(full_dims.as_slice())?;
            let dx = if g.size() == 1 {
                dx
            } else if sp {
                g.reduce_scatter(&dx, SEQ_DIM)?
            } else {
                g.all_reduce(&dx)?
            };
            Ok(vec![Some(match m {
                Some(m) => (dx * m)?,
                None => dx,
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
        // (u, B, s) detached, for the backward
        let upd = match &part.update {
            Some(up) => {
                let (ud, bd) = (up.u.detach(), up.b.detach());
                if ud.elem_count() / ud.dim(D::Minus1)?.max(1) != lead || bd.dims2()? != (o, ud.dim(D::Minus1)?) {
                    bail!("ColumnParallelLinear: update u {:?}, B {:?} do not fit the part's output [{lead}, {o}]", ud.dims(), bd.dims())
                }
                y = (y + affine(&(&ud * up.scale)?, &bd, None)?)?;
                Some((ud, bd, up.scale))
            }
            None => None,
        };
        if let Some(p) = &part.post {
            y = (p.fwd)(&y)?;
        }
        let (st, g, post, has_bias, zero, mask) = (state.clone(), group.clone(), part.post.clone(), part.bias.is_some(), token_val.clone(), mask.clone());
        let has_update = upd.is_some();
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
                    let f = match &mask {
                        Some(m) => {
                            let (xm, m) = apply_mask("ColumnParallelLinear", &s.x, m)?;
                            s.mask = Some(m);
                            gather(&xm, &g, sp)?
                        }
                        None => gather(&s.x, &g, sp)?,
                    };
                    s.full = Some(f.clone());
                    f
                }
            };
            let (dx, dw) = affine_grads(&gy, &full.reshape((lead, in_dim))?, &wd)?;
            s.dx = Some(match s.dx.take() {
                Some(acc) => (acc + dx)?,
                None => dx,
            });
            drop(s);
            let mut grads = vec![Some(zero.clone()), Some(dw)];
            if has_bias {
                grads.push(Some(gy.sum(0)?));
            }
            if let Some((ud, bd, sc)) = &upd {
                // du = s·g·B, dB = s·gᵀ·u
                let r = bd.dim(1)?;
                let u2 = ud.reshape((lead, r))?;
                grads.push(Some((gy.matmul(bd)? * *sc)?.reshape(ud.dims())?));
                grads.push(Some((gy.t()?.matmul(&u2)? * *sc)?));
            }
            Ok(grads)
        });
        let mut inputs: Vec<&Tensor> = vec![&token, part.weight];
        if let Some(b) = part.bias {
            inputs.push(b);
        }
        if let Some(up) = &part.update {
            inputs.extend([&up.u, &up.b]);
        }
        debug_assert_eq!(inputs.len(), 2 + usize::from(has_bias) + 2 * usize::from(has_update));
        let out = attach_n("ColumnParallelLinear part", &inputs, y, bwd)?;
        outs.push(out);
    }
    Ok(outs)
}
