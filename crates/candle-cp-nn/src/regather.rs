//! Column-parallel parts whose graph keeps only the input's sequence shard.
//!
//! Under sequence parallelism a column-parallel layer multiplies the all-gathered input
//! `[B, T, in]`; a plain graph (all-gather node, then the GEMMs) keeps that gathered tensor
//! alive until the backward, `P` times the shard `[B, T/P, in]` the norm before it produced.
//! Megatron-LM keeps the shard and all-gathers it again in the backward; so does this. The
//! forward gathers once for all parts and drops the gathered input; each part is one graph
//! node over `(shard, weight[, bias])`. In the backward the first part to run all-gathers the
//! shard again (kept until the last part has run), every part adds `g·Wᵢ` into one
//! `[B, T, in]` input gradient, and the last one reduce-scatters it (one collective, as
//! before). Without SP the same holds with the identity for the gather and an all-reduce
//! for the reduce-scatter (`copy_to_tp_region`'s pair), and the input is not copied.
//!
//! Every part's output must take part in the loss: the input's gradient is formed by the
//! last part's backward (an unused part leaves it unformed).

use candle_core::{bail, Result, Tensor};
use candle_cp_comm::Group;
use candle_cp_ops::autograd::{attach2, attach3, BackwardFn};
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
    full: Option<Tensor>,
    dx: Option<Tensor>,
    /// Parts whose backward has not run yet in this backward pass.
    pending: usize,
    /// Number of parts (the count starts again for another backward over the same graph).
    parts: usize,
}

/// One part: weight `[o, in]`, optional bias `[o]`, optional output map.
pub(crate) struct PartRef<'a> {
    pub(crate) weight: &'a Tensor,
    pub(crate) bias: Option<&'a Tensor>,
    pub(crate) post: Option<PartPost>,
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
    let state = Arc::new(Mutex::new(State { x: xd, full: None, dx: None, pending: parts.len(), parts: parts.len() }));
    let mut outs = Vec::with_capacity(parts.len());
    for part in parts {
        let (o, wi) = part.weight.dims2()?;
        if wi != in_dim {
            bail!("ColumnParallelLinear: input {:?} does not match weight {:?} ([out, in])", x.dims(), part.weight.dims())
        }
        let wd = part.weight.detach();
        let mut dims = full.dims().to_vec();
        let last = dims.len() - 1;
        dims[last] = o;
        let mut y = full.reshape((lead, in_dim))?.matmul(&wd.t()?)?;
        if let Some(b) = part.bias {
            y = y.broadcast_add(&b.detach())?;
        }
        let mut y = y.reshape(dims.as_slice())?;
        if let Some(p) = &part.post {
            y = (p.fwd)(&y)?;
        }
        let (st, g, post, has_bias) = (state.clone(), group.clone(), part.post.clone(), part.bias.is_some());
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
            let dw = gy.t()?.matmul(&full.reshape((lead, in_dim))?)?;
            let dx = gy.matmul(&wd)?;
            s.dx = Some(match s.dx.take() {
                Some(acc) => (acc + dx)?,
                None => dx,
            });
            s.pending = s.pending.saturating_sub(1);
            let dx_in = if s.pending == 0 {
                (s.full, s.pending) = (None, s.parts);
                let dx = match s.dx.take() {
                    Some(d) => d.reshape(full.dims())?,
                    None => bail!("ColumnParallelLinear: no input gradient formed"),
                };
                Some(if g.size() == 1 {
                    dx
                } else if sp {
                    g.reduce_scatter(&dx, SEQ_DIM)?
                } else {
                    g.all_reduce(&dx)?
                })
            } else {
                None
            };
            let db = if has_bias { Some(gy.sum(0)?) } else { None };
            Ok(vec![dx_in, Some(dw), db])
        });
        let out = match part.bias {
            Some(b) => attach3("ColumnParallelLinear part", x, part.weight, b, y, bwd)?,
            None => {
                let bwd2: BackwardFn = Arc::new(move |dy: &Tensor| {
                    let mut v = bwd(dy)?;
                    v.truncate(2);
                    Ok(v)
                });
                attach2("ColumnParallelLinear part", x, part.weight, y, bwd2)?
            }
        };
        outs.push(out);
    }
    Ok(outs)
}
