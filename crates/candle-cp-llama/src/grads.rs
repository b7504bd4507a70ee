//! Gradient reduction across the layout's groups.
//!
//! After `loss.backward()` each rank holds its *share* of every parameter gradient (the
//! loss is a global mean whose backward only runs through the rank's own tokens). The true
//! gradient is the sum of the shares over the ranks that hold different tokens:
//!
//! | parameter                         | summed over                         |
//! |-----------------------------------|-------------------------------------|
//! | TP-sharded (q/k/v/o, gate/up/down; embeddings and head, padded when tp does not divide the vocabulary) | DP × CP (never TP: each TP rank owns a different slice) |
//! | replicated (norms; embeddings and head of a vocabulary smaller than tp), no SP | DP × CP (TP ranks already hold identical full gradients) |
//! | replicated, with SP               | DP × CP × TP (each TP rank saw other tokens) |
//! | k/v with fewer KV heads than TP ranks | DP × CP × the TP ranks holding the same KV head (each saw other query heads) |
//! | k/v with KV heads neither dividing nor divided by TP (10 over 4) | each KV head's copies summed over TP ([`candle_cp_nn::Shard::fold_copies`]: a rank may hold a head twice, or share it with a neighbour), then DP × CP |
//! | stacked experts under expert parallelism (`ep > 1`) | the DP × CP ranks holding the same experts ([`ParallelCtx::ep_dp`]; the EP exchange's backward brought the EP group's tokens) |
//!
//! Gradients are packed into f32 buffers of up to 2^26 elements per group (one all-reduce
//! each), in [`crate::param_specs`] order on every rank (a LoRA run: its adapters only, [`crate::trainable_specs`]).

use crate::config::LlamaConfig;
use crate::layout::ParallelCtx;
use crate::params::Shard;
use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Result, Tensor};
use candle_cp_comm::Group;
use candle_nn::VarMap;
use std::collections::HashMap;

/// Sum every parameter gradient in `grads` over the right groups of `ctx` (table in the
/// module doc), in place. Collective over the world group: every rank must call it with the
/// same `cfg` and a `VarMap` holding its shards (from [`crate::shard_params`] /
/// [`crate::Llama::new`]). A parameter without a gradient on this rank counts as zero (and
/// gets one). Gradients keep their dtype; the sum is done in f32.
pub fn reduce_gradients(grads: &mut GradStore, varmap: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<()> {
    reduce_with_buckets(grads, varmap, cfg, ctx, BUCKET, Skip::No, Skip::No).map(|_| ())
}

/// [`reduce_gradients`] for ZeRO-1 over `ctx.dp_cp`: the gradients whose group is `dp_cp`
/// (every TP-sharded parameter, and the replicated ones without SP) are left as this rank's
/// shares, for [`crate::train::AdamW::reduce_scatter_grads`] to sum (it sends half the bytes
/// of an all-reduce); the others are all-reduced as by [`reduce_gradients`]. Returns the
/// names left unreduced, each with a gradient (zeros where this rank had none). Collective
/// over the world group, like [`reduce_gradients`].
pub fn reduce_gradients_except_dp_cp(
    grads: &mut GradStore,
    varmap: &VarMap,
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
) -> Result<Vec<String>> {
    reduce_with_buckets(grads, varmap, cfg, ctx, BUCKET, Skip::Fill, Skip::No).map(|(n, _)| n)
}

/// The trainer's [`reduce_gradients_except_dp_cp`]: with `skip` = [`Skip::NoFill`] the names
/// of the gradients left to the replicas' sum are returned whether or not `grads` holds them
/// (the overlapped sync has taken them already); `experts` does the same for the stacked
/// experts under expert parallelism ([`Skip::No`]: summed over `ctx.ep_dp` here; otherwise
/// left for ZeRO to reduce-scatter over it). Returns (the replicas' names, the experts' names).
pub(crate) fn reduce_gradients_for_zero(
    grads: &mut GradStore,
    varmap: &VarMap,
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
    skip: Skip,
    experts: Skip,
) -> Result<(Vec<String>, Vec<String>)> {
    reduce_with_buckets(grads, varmap, cfg, ctx, BUCKET, skip, experts)
}

/// What [`reduce_with_buckets`] does with the gradients whose group is exactly `dp_cp` (or,
/// as its last argument, with the experts' under expert parallelism).
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Skip {
    /// Sum them like the others.
    No,
    /// Leave them, with zeros where this rank has none.
    Fill,
    /// Leave them as they are.
    NoFill,
}

fn reduce_with_buckets(
    grads: &mut GradStore,
    varmap: &VarMap,
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
    bucket_elems: usize,
    skip: Skip,
    skip_experts: Skip,
) -> Result<(Vec<String>, Vec<String>)> {
    let vars = crate::params::lock_vars(varmap)?.clone();
    // one list per gradient group (ParallelCtx::grad_group), in first-seen param_specs order
    // (checked before any collective: a rank that errors here communicates nothing)
    // (a LoRA run's frozen weights have no gradient to sum)
    let specs = crate::params::trainable_specs(cfg);
    if let Some(s) = specs.iter().find(|s| !vars.contains_key(&s.name)) {
        bail!(
            "reduce_gradients: parameter {} {:?} is not in the VarMap",
            s.name,
            s.shape
        )
    }
    // (replicated, copies, an expert under EP) → the group and its parameters
    type Key = (bool, usize, bool);
    let mut per_group: Vec<(Key, Group, Vec<String>)> = Vec::new();
    let (mut skipped, mut experts) = (Vec::new(), Vec::new());
    for s in specs {
        let shard = s.shard.resolve(ctx.layout.tp);
        let expert = s.is_expert() && ctx.ep.is_some();
        // left to the caller: the experts' (skip_experts) or the replicas' (skip) gradients
        let (mode, left) = if expert { (skip_experts, &mut experts) } else { (skip, &mut skipped) };
        if mode != Skip::No && (expert || ctx.param_grad_group_is_dp_cp(&s)) {
            let var = vars[&s.name].as_tensor();
            if mode == Skip::Fill && grads.get(var).is_none() {
                grads.insert(var, var.zeros_like()?);
            }
            left.push(s.name);
            continue;
        }
        if shard.mixed_copies(ctx.layout.tp) {
            // KV-head copies mixed over the TP ranks: sum each block's copies over `tp` first
            // (collective over tp, in param_specs order), then over dp_cp like any slice
            let var = vars[&s.name].as_tensor();
            let g = match grads.get(var) {
                Some(g) => g.clone(),
                None => var.zeros_like()?,
            };
            grads.insert(var, shard.fold_copies(&g, &ctx.tp)?);
        }
        let key = (shard == Shard::Replicated, shard.copies(ctx.layout.tp), expert);
        match per_group.iter_mut().find(|(k, _, _)| *k == key) {
            Some((_, _, names)) => names.push(s.name),
            None => {
                let group = ctx.param_grad_group(&s)?;
                per_group.push((key, group, vec![s.name]))
            }
        }
    }
    for (_, group, names) in per_group {
        if group.size() == 1 {
            continue;
        }
        // pack into f32 buckets of at most BUCKET elements (one all-reduce each)
        let mut bucket: Vec<(Tensor, Tensor)> = Vec::new();
        let mut elems = 0usize;
        for (i, n) in names.iter().enumerate() {
            let var = vars[n].as_tensor().clone();
            let g = match grads.get(&var) {
                Some(g) => g.clone(),
                None => var.zeros_like()?,
            };
            elems += g.elem_count();
            bucket.push((var, g));
            if elems >= bucket_elems || i + 1 == names.len() {
                all_reduce_bucket(grads, std::mem::take(&mut bucket), &group)?;
                elems = 0;
            }
        }
    }
    Ok((skipped, experts))
}

/// Elements per all-reduce bucket (256 MiB of f32).
const BUCKET: usize = 1 << 26;

/// Sum the gradients of one bucket over `group` (flattened to one f32 buffer) and store them.
fn all_reduce_bucket(grads: &mut GradStore, bucket: Vec<(Tensor, Tensor)>, group: &Group) -> Result<()> {
    if bucket.is_empty() {
        return Ok(());
    }
    let flat: Vec<Tensor> = bucket
        .iter()
        .map(|(_, g)| g.to_dtype(DType::F32)?.flatten_all())
        .collect::<Result<_>>()?;
    let summed = group.all_reduce(&Tensor::cat(&flat, 0)?)?;
    let mut off = 0;
    for (var, g) in bucket {
        let n = g.elem_count();
        grads.insert(&var, summed.narrow(0, off, n)?.reshape(g.shape())?.to_dtype(g.dtype())?);
        off += n;
    }
    Ok(())
}

/// The gradients of the `VarMap`'s parameters by name (missing ones omitted).
pub fn named_grads(grads: &GradStore, varmap: &VarMap) -> Result<HashMap<String, Tensor>> {
    let vars = crate::params::lock_vars(varmap)?;
    Ok(vars
        .iter()
        .filter_map(|(k, v)| grads.get(v.as_tensor()).map(|g| (k.clone(), g.clone())))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{shard_batch, CpKind, Layout};
    use crate::model::Llama;
    use crate::params::{init_params, shard_params};
    use candle_core::Device;
    use candle_cp_comm::run_ranks;
    use candle_nn::VarBuilder;

    /// Small buckets (many all-reduces) give exactly the one-bucket result, and ranks agree.
    #[test]
    fn bucket_size_does_not_change_the_sum() -> Result<()> {
        let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
        let ids = Tensor::arange(0u32, 64, &Device::Cpu)?.reshape((1, 64))?;
        let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true);
        let res = run_ranks(layout.world_size(), |world| {
            let ctx = ParallelCtx::new(world, layout)?;
            let vm = shard_params(&init_params(&cfg, 9, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
            let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
            let b = shard_batch(&ids, &ctx)?;
            let (loss, _) = m.loss(&b.input_ids, &b.labels, &b.positions)?;
            let (mut a, mut c) = (loss.backward()?, loss.backward()?);
            reduce_with_buckets(&mut a, &vm, &cfg, &ctx, BUCKET, Skip::No, Skip::No)?;
            reduce_with_buckets(&mut c, &vm, &cfg, &ctx, 100, Skip::No, Skip::No)?;
            let (na, nc) = (named_grads(&a, &vm)?, named_grads(&c, &vm)?);
            let mut worst = 0f32;
            for (k, g) in &na {
                worst = worst.max((g - &nc[k])?.abs()?.max_all()?.to_scalar::<f32>()?);
            }
            Ok(worst)
        });
        for r in res {
            assert_eq!(r?, 0.0);
        }
        Ok(())
    }
}
