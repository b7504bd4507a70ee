//! Gradient reduction across the layout's groups.
//!
//! After `loss.backward()` each rank holds its *share* of every parameter gradient (the
//! loss is a global mean whose backward only runs through the rank's own tokens). The true
//! gradient is the sum of the shares over the ranks that hold different tokens:
//!
//! | parameter                         | summed over                         |
//! |-----------------------------------|-------------------------------------|
//! | TP-sharded (q/k/v/o, gate/up/down)| DP × CP (never TP: each TP rank owns a different slice) |
//! | replicated (embeddings, norms, head), no SP | DP × CP (TP ranks already hold identical full gradients) |
//! | replicated, with SP               | DP × CP × TP (each TP rank saw other tokens) |
//!
//! Gradients are packed into one f32 buffer per group (one all-reduce each).

use crate::config::LlamaConfig;
use crate::layout::ParallelCtx;
use crate::params::{param_specs, Shard};
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
    let vars = varmap.data().lock().map_err(|_| candle_core::Error::Msg("varmap lock poisoned".into()))?.clone();
    let sp = ctx.layout.seq_parallel();
    // two buckets: (group, names)
    let mut shard_names = Vec::new();
    let mut repl_names = Vec::new();
    for s in param_specs(cfg) {
        if !vars.contains_key(&s.name) {
            bail!("reduce_gradients: parameter {} {:?} is not in the VarMap", s.name, s.shape)
        }
        match s.shard {
            Shard::Replicated => repl_names.push(s.name),
            _ => shard_names.push(s.name),
        }
    }
    let repl_group = if sp { &ctx.world } else { &ctx.dp_cp };
    let buckets: [(&Group, Vec<String>); 2] = if !sp {
        // same group: one bucket
        let mut all = shard_names;
        all.extend(repl_names);
        [(&ctx.dp_cp, all), (&ctx.dp_cp, Vec::new())]
    } else {
        [(&ctx.dp_cp, shard_names), (repl_group, repl_names)]
    };
    for (group, names) in buckets.iter() {
        if group.size() == 1 || names.is_empty() {
            continue;
        }
        let mut flat = Vec::with_capacity(names.len());
        let mut meta = Vec::with_capacity(names.len());
        for n in names {
            let var = &vars[n];
            let g = match grads.get(var.as_tensor()) {
                Some(g) => g.clone(),
                None => var.as_tensor().zeros_like()?,
            };
            meta.push((var.as_tensor().clone(), g.shape().clone(), g.dtype(), g.elem_count()));
            flat.push(g.to_dtype(DType::F32)?.flatten_all()?);
        }
        let summed = group.all_reduce(&Tensor::cat(&flat, 0)?)?;
        let mut off = 0;
        for (var_t, shape, dt, n) in meta {
            let g = summed.narrow(0, off, n)?.reshape(shape)?.to_dtype(dt)?;
            off += n;
            grads.insert(&var_t, g);
        }
    }
    Ok(())
}

/// The gradients of the `VarMap`'s parameters by name (missing ones omitted).
pub fn named_grads(grads: &GradStore, varmap: &VarMap) -> Result<HashMap<String, Tensor>> {
    let vars = varmap.data().lock().map_err(|_| candle_core::Error::Msg("varmap lock poisoned".into()))?;
    Ok(vars
        .iter()
        .filter_map(|(k, v)| grads.get(v.as_tensor()).map(|g| (k.clone(), g.clone())))
        .collect())
}
