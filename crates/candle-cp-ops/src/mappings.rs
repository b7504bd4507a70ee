//! Megatron-style tensor- and sequence-parallel conjugate collectives (autograd ops).
//!
//! Every op here is a pair with its *conjugate*: the backward of one is exactly one call to
//! the forward of the other (after Megatron-Core's `mappings.py`):
//!
//! | op                                     | forward           | backward (= partner fwd)  |
//! |----------------------------------------|-------------------|---------------------------|
//! | [`copy_to_tp_region`]                  | identity          | all-reduce                |
//! | [`reduce_from_tp_region`]              | all-reduce        | identity                  |
//! | [`scatter_to_sp_region`]               | split (own chunk) | all-gather                |
//! | [`gather_from_sp_region_replicated_grad`] | all-gather     | split (own chunk)         |
//! | [`gather_from_sp_region`]              | all-gather        | reduce-scatter            |
//! | [`reduce_scatter_to_sp_region`]        | reduce-scatter    | all-gather                |
//!
//! **Sequence dimension.** The sequence-parallel ops take the dimension to split or gather
//! as an explicit `dim` argument. For activations laid out `[B, T, ...]` (the layout used
//! everywhere in candle-cp) pass [`SEQ_DIM`] `= 1`: a rank of a group of size `P` holds the
//! contiguous rows `[r·T/P, (r+1)·T/P)` of the global sequence (`T` global, `T/P` local).
//!
//! All ops are collective over `group`: every rank must call them in the same order with
//! tensors of the same shape. With a group of size 1 every op is the identity (no copy,
//! no communication).
//!
//! Implementation: forward runs the raw collective on the detached input, then
//! [`crate::autograd::attach1`] makes the result differentiable; the backward closure calls
//! the partner op on the (detached) incoming gradient.

use crate::autograd::{attach1, BackwardFn};
use candle_core::{Result, Tensor};
use candle_cp_comm::{ensure_nonempty, Group};
use std::sync::Arc;

/// The sequence dimension of `[B, T, ...]` activations (batch first).
pub const SEQ_DIM: usize = 1;

fn check_dim(op: &str, x: &Tensor, dim: usize) -> Result<()> {
    ensure_nonempty(op, "x", x)?;
    if dim >= x.rank() {
        candle_core::bail!("{op}: dim {dim} out of range for a tensor of shape {:?}", x.dims())
    }
    Ok(())
}

/// This rank's chunk `[r·n/P, (r+1)·n/P)` of `x` along `dim` (no communication, no graph).
fn own_chunk(op: &str, x: &Tensor, group: &Group, dim: usize) -> Result<Tensor> {
    check_dim(op, x, dim)?;
    let (n, p, r) = (x.dim(dim)?, group.size(), group.rank());
    if n % p != 0 {
        candle_core::bail!(
            "{op}: dim {dim} of shape {:?} has size {n}, not divisible by the group size {p}",
            x.dims()
        )
    }
    x.narrow(dim, r * (n / p), n / p)?.contiguous()
}

/// Wrap `out = f(x)` with a backward that is `partner(grad)`.
fn attach_partner(
    name: &'static str,
    x: &Tensor,
    out: Tensor,
    partner: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    let bwd: BackwardFn = Arc::new(move |g: &Tensor| Ok(vec![Some(partner(&g.detach())?)]));
    attach1(name, x, out, bwd)
}

/// Enter a tensor-parallel region: forward identity, backward all-reduce over `group`.
///
/// Put it in front of a column-parallel matmul whose input `x` (any shape, e.g. `[B, T, C]`,
/// identical on every rank) is used by every rank: each rank's gradient w.r.t. `x` is
/// partial and the backward sums them. Conjugate of [`reduce_from_tp_region`].
pub fn copy_to_tp_region(x: &Tensor, group: &Group) -> Result<Tensor> {
    ensure_nonempty("copy_to_tp_region", "x", x)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let g = group.clone();
    attach_partner("copy_to_tp_region", x, x.detach(), move |dy| reduce_from_tp_region(dy, &g))
}

/// Leave a tensor-parallel region: forward all-reduce (sum) over `group`, backward identity.
///
/// `x` (any shape) holds this rank's partial sum, e.g. the output `[B, T, C]` of a
/// row-parallel matmul. Conjugate of [`copy_to_tp_region`].
pub fn reduce_from_tp_region(x: &Tensor, group: &Group) -> Result<Tensor> {
    ensure_nonempty("reduce_from_tp_region", "x", x)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let out = group.all_reduce(&x.detach())?;
    let g = group.clone();
    attach_partner("reduce_from_tp_region", x, out, move |dy| copy_to_tp_region(dy, &g))
}

/// Split a replicated tensor into sequence shards: forward keeps this rank's chunk along
/// `dim` (`[B, T, C]` → `[B, T/P, C]` for `dim = 1`), backward all-gathers the gradient.
///
/// `x.dim(dim)` must be divisible by the group size. Conjugate of
/// [`gather_from_sp_region_replicated_grad`].
pub fn scatter_to_sp_region(x: &Tensor, group: &Group, dim: usize) -> Result<Tensor> {
    if group.size() == 1 {
        check_dim("scatter_to_sp_region", x, dim)?;
        return Ok(x.clone());
    }
    let out = own_chunk("scatter_to_sp_region", &x.detach(), group, dim)?;
    let g = group.clone();
    attach_partner("scatter_to_sp_region", x, out, move |dy| {
        gather_from_sp_region_replicated_grad(dy, &g, dim)
    })
}

/// Gather sequence shards into a tensor that every rank then uses *identically* (e.g. a
/// loss computed the same way on every rank): forward all-gather along `dim`
/// (`[B, T/P, C]` → `[B, T, C]`), backward keeps this rank's chunk of the (replicated)
/// gradient. Conjugate of [`scatter_to_sp_region`].
///
/// Use [`gather_from_sp_region`] instead when each rank's use of the gathered tensor is
/// different (tensor-parallel) and its gradient is therefore partial.
pub fn gather_from_sp_region_replicated_grad(x: &Tensor, group: &Group, dim: usize) -> Result<Tensor> {
    check_dim("gather_from_sp_region_replicated_grad", x, dim)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let out = group.all_gather(&x.detach(), dim)?;
    let g = group.clone();
    attach_partner("gather_from_sp_region_replicated_grad", x, out, move |dy| {
        scatter_to_sp_region(dy, &g, dim)
    })
}

/// Leave the sequence-parallel region into a tensor-parallel one: forward all-gather along
/// `dim` (`[B, T/P, C]` → `[B, T, C]`), backward reduce-scatter (each rank's gradient w.r.t.
/// the gathered tensor is partial, e.g. it feeds a column-parallel matmul; the backward sums
/// them and keeps this rank's chunk). Conjugate of [`reduce_scatter_to_sp_region`].
pub fn gather_from_sp_region(x: &Tensor, group: &Group, dim: usize) -> Result<Tensor> {
    check_dim("gather_from_sp_region", x, dim)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let out = group.all_gather(&x.detach(), dim)?;
    let g = group.clone();
    attach_partner("gather_from_sp_region", x, out, move |dy| reduce_scatter_to_sp_region(dy, &g, dim))
}

/// Leave a tensor-parallel region into the sequence-parallel one: forward reduce-scatter
/// (sum the partial `[B, T, C]` over ranks, keep this rank's chunk `[B, T/P, C]` along
/// `dim`), backward all-gather. `x.dim(dim)` must be divisible by the group size.
/// Conjugate of [`gather_from_sp_region`].
pub fn reduce_scatter_to_sp_region(x: &Tensor, group: &Group, dim: usize) -> Result<Tensor> {
    check_dim("reduce_scatter_to_sp_region", x, dim)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let n = x.dim(dim)?;
    if n % group.size() != 0 {
        candle_core::bail!(
            "reduce_scatter_to_sp_region: dim {dim} of shape {:?} has size {n}, not divisible by the group size {}",
            x.dims(),
            group.size()
        )
    }
    let out = group.reduce_scatter(&x.detach(), dim)?;
    let g = group.clone();
    attach_partner("reduce_scatter_to_sp_region", x, out, move |dy| gather_from_sp_region(dy, &g, dim))
}
