//! Gradient clipping by the global L2 norm over all ranks.
//!
//! After the model's gradient reduction, a replicated parameter (same value on every rank of
//! the tensor-parallel group) has the same gradient on every rank, while a tensor-parallel
//! shard has its own slice of the full gradient, and a replicated KV-head block (fewer KV
//! heads than TP ranks) is held by `c` of the ranks. The global squared norm is therefore
//! `Σ_replicated ‖g‖² + all_reduce_tp(Σ_sliced ‖g‖² / c)`: replicated gradients are counted
//! once, slices are summed over the group, each block once. Every rank gets the same norm
//! and the same scale. (KV-head copies mixed over the TP ranks — a rank may hold a head twice,
//! `candle_cp_nn::Shard::mixed_copies` — are passed by the trainer as slices scaled by
//! `1/√c`, copies 1.)

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::Group;

/// Global L2 norm of `grads`: pairs of a gradient and its number of *copies*, how many ranks
/// of `shard_group` hold that same gradient (`1` for a TP shard, `shard_group.size()` for a
/// replicated parameter, `tp / Hkv` for a replicated KV head: [`candle_cp_nn::Shard::copies`]).
///
/// `shard_group` is the group whose ranks hold different slices of the sharded gradients
/// (the TP group); `None` means every gradient is complete on this rank. Collective over
/// `shard_group`: every rank of it must call this, with the same number of sharded items.
/// Squares are summed in f64.
pub fn global_norm(grads: &[(Tensor, usize)], shard_group: Option<&Group>) -> Result<f64> {
    global_norm_zero1(grads, &[], None, shard_group)
}

/// [`global_norm`] when some gradients are ZeRO-1 slices: `slices` pairs this rank's slice
/// of a gradient summed over `slice_group` (the replica group,
/// [`super::AdamW::reduce_scatter_grads`]) with that gradient's copies; `full` are whole
/// gradients as in [`global_norm`]. The slices' squared norms are summed over `slice_group`
/// first (one all-reduce of two f64s). Collective over `slice_group` (when `slices` is
/// non-empty on any rank of it: every rank must then pass it) and over `shard_group`.
pub fn global_norm_zero1(
    full: &[(Tensor, usize)],
    slices: &[(Tensor, usize)],
    slice_group: Option<&Group>,
    shard_group: Option<&Group>,
) -> Result<f64> {
    let size = shard_group.map(|g| g.size()).unwrap_or(1);
    // (squared norms of the gradients every shard-group rank holds alike, of the sharded ones
    // divided by their copies)
    let split = |items: &[(Tensor, usize)]| -> Result<[f64; 2]> {
        let mut acc = [0f64; 2];
        for (g, copies) in items {
            let sq = g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
            if *copies >= size {
                acc[0] += sq;
            } else {
                acc[1] += sq / (*copies).max(1) as f64;
            }
        }
        Ok(acc)
    };
    let [mut replicated, mut sharded] = split(full)?;
    if let Some(group) = slice_group.filter(|g| g.size() > 1) {
        let part = group.all_reduce(&Tensor::new(&split(slices)?, &Device::Cpu)?)?.to_vec1::<f64>()?;
        replicated += part[0];
        sharded += part[1];
    } else {
        let [r, s] = split(slices)?;
        replicated += r;
        sharded += s;
    }
    if let Some(group) = shard_group {
        if group.size() > 1 {
            let t = Tensor::new(&[sharded], &Device::Cpu)?;
            sharded = group.all_reduce(&t)?.to_vec1::<f64>()?[0];
        }
    }
    Ok((replicated + sharded).sqrt())
}

/// One item for [`global_norm`] standing for `grads` split over `group` (each rank holds
/// different ones: the experts of an expert-parallel group): `[‖all of them‖]` (f64, on the
/// host), the L2 norm over the group's ranks, with one copy per rank of the TP group (the
/// experts are TP slices too). Collective over `group`.
pub fn group_norm_item(grads: &[Tensor], group: &Group) -> Result<Tensor> {
    let mut sq = 0f64;
    for g in grads {
        sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    }
    let sq = group.all_reduce(&Tensor::new(&[sq], &Device::Cpu)?)?.to_vec1::<f64>()?[0];
    Tensor::new(&[sq.sqrt()], &Device::Cpu)
}

/// The factor that brings a gradient of norm `norm` down to `max_norm` (1 if already below,
/// or if `max_norm <= 0`, which disables clipping).
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

/// A training step's gradient norm (before the `1/grad_accum` of accumulation), over every
/// rank: `named` the whole gradients and `slices` ZeRO's slices ([`super::grad_step::Summed`]),
/// `shards` each parameter's TP split, `experts` the expert parameters under EP (their whole
/// gradients one item, normed over the EP group unless ZeRO splits them). KV-head copies mixed
/// over the TP ranks count as slices scaled by `1/√copies`. Collective over the layout's
/// groups.
pub(crate) fn step_norm(
    (named, slices): (&std::collections::HashMap<String, Tensor>, &std::collections::HashMap<String, Tensor>),
    (shards, experts): (&std::collections::HashMap<String, crate::params::Shard>, &std::collections::HashSet<String>),
    opt: &super::AdamW,
    ctx: &crate::ParallelCtx,
) -> Result<f64> {
    // (KV-head copies mixed over the TP ranks — a rank may hold a head twice — as slices
    // scaled by 1/√copies)
    let item = |(n, g): (&String, &Tensor)| -> Result<(Tensor, usize)> {
        let tp = ctx.layout.tp;
        Ok(match shards.get(n) {
            Some(s) if s.mixed_copies(tp) => ((g.to_dtype(candle_core::DType::F32)? / (s.copies(tp) as f64).sqrt())?, 1),
            Some(s) => (g.clone(), s.copies(tp)),
            None => (g.clone(), tp),
        })
    };
    let mut full_items: Vec<(&String, &Tensor)> = named.iter().filter(|(n, _)| !experts.contains(*n)).collect();
    full_items.sort_by(|a, b| a.0.cmp(b.0));
    // the experts' whole gradients under EP: one item, their norm over the EP group (with
    // ZeRO splitting them over the ranks holding them they are slices, summed over dp_cp
    // with the others)
    let mut expert_items: Vec<(&String, &Tensor)> = named.iter().filter(|(n, _)| experts.contains(*n)).collect();
    expert_items.sort_by(|a, b| a.0.cmp(b.0));
    // (an expert tensor every TP rank holds whole — a LoRA factor of the experts replicated
    // over TP — scaled by 1/√copies: the TP sum of the item counts it once)
    let expert_grad = |(n, g): &(&String, &Tensor)| -> Result<Tensor> {
        match shards.get(*n).map(|s| s.copies(ctx.layout.tp)).filter(|&c| c > 1) {
            Some(c) => g.to_dtype(candle_core::DType::F32)? / (c as f64).sqrt(),
            None => Ok((*g).clone()),
        }
    };
    let expert_item = match &ctx.ep {
        Some(ep) if !opt.splits_experts() => Some((super::clip::group_norm_item(&expert_items.iter().map(expert_grad).collect::<Result<Vec<_>>>()?, ep)?, 1)),
        _ => None,
    };
    let mut slice_items: Vec<(&String, &Tensor)> = slices.iter().collect();
    slice_items.sort_by(|a, b| a.0.cmp(b.0));
    let mut full_items: Vec<(Tensor, usize)> = full_items.into_iter().map(item).collect::<Result<_>>()?;
    full_items.extend(expert_item);
    let slice_items: Vec<(Tensor, usize)> = slice_items.into_iter().map(item).collect::<Result<_>>()?;
    let zero_group = opt.is_sharded().then_some(&ctx.dp_cp);
    global_norm_zero1(&full_items, &slice_items, zero_group, Some(&ctx.tp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_of_local_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let g = vec![
            (Tensor::new(&[3.0f32, 0.0], &dev)?, 1),
            (Tensor::new(&[[4.0f32]], &dev)?, 1),
        ];
        let n = global_norm(&g, None)?;
        assert!((n - 5.0).abs() < 1e-9);
        assert_eq!(clip_factor(n, 10.0), 1.0);
        assert!((clip_factor(n, 1.0) * n - 1.0).abs() < 1e-6);
        assert_eq!(clip_factor(n, 0.0), 1.0);
        Ok(())
    }

    /// Two TP ranks: a replicated gradient [3, 4] (same on both) and a sharded one split as
    /// [1, 2] | [2, 4]. Global norm² = 9 + 16 + (1 + 4) + (4 + 16) = 50 on both ranks.
    #[test]
    fn replicated_counted_once_shards_summed() -> Result<()> {
        let res = candle_cp_comm::run_ranks(2, |g| {
            let dev = Device::Cpu;
            let shard: &[f32] = if g.rank() == 0 {
                &[1.0, 2.0]
            } else {
                &[2.0, 4.0]
            };
            let items = vec![
                (Tensor::new(&[3.0f32, 4.0], &dev)?, 2),
                (Tensor::new(shard, &dev)?, 1),
            ];
            global_norm(&items, Some(&g))
        });
        for r in res {
            let n = r?;
            assert!((n - 50f64.sqrt()).abs() < 1e-6, "{n}");
        }
        Ok(())
    }

    /// Four TP ranks: a replicated [1] (on all 4), a shard [r + 1] per rank, and a block held
    /// twice: [2] on ranks 0, 1 and [3] on ranks 2, 3. Norm² = 1 + (1 + 4 + 9 + 16) + 4 + 9 = 44.
    #[test]
    fn replicated_blocks_counted_once() -> Result<()> {
        let res = candle_cp_comm::run_ranks(4, |g| {
            let dev = Device::Cpu;
            let r = g.rank();
            let block = if r < 2 { 2.0f32 } else { 3.0 };
            let items = vec![
                (Tensor::new(&[1.0f32], &dev)?, 4),
                (Tensor::new(&[r as f32 + 1.0], &dev)?, 1),
                (Tensor::new(&[block], &dev)?, 2),
            ];
            global_norm(&items, Some(&g))
        });
        for r in res {
            let n = r?;
            assert!((n - 44f64.sqrt()).abs() < 1e-6, "{n}");
        }
        Ok(())
    }

    /// ZeRO-1 slices on 4 ranks: TP 2 (ranks {0,1}, {2,3}) x 2 replicas ({0,2}, {1,3}). A
    /// replicated gradient [3, 4] is cut into [3] | [4] over the replicas; TP rank 0's shard
    /// [1, 2] into [1] | [2], TP rank 1's [2, 4] into [2] | [4]; a whole replicated [1] too.
    /// Norm² = 9 + 16 + (1 + 4) + (4 + 16) + 1 = 51 on every rank.
    #[test]
    fn slices_summed_over_the_replicas() -> Result<()> {
        let res = candle_cp_comm::run_ranks(4, |g| {
            let dev = Device::Cpu;
            let (t, d) = (g.rank() % 2, g.rank() / 2);
            let tp = g.split(d, t)?;
            let replicas = g.split(2 + t, d)?;
            let shard = [[1.0f32, 2.0], [2.0, 4.0]][t];
            let slices = vec![
                (Tensor::new(&[[3.0f32, 4.0][d]], &dev)?, 2),
                (Tensor::new(&[shard[d]], &dev)?, 1),
            ];
            let full = vec![(Tensor::new(&[1.0f32], &dev)?, 2)];
            global_norm_zero1(&full, &slices, Some(&replicas), Some(&tp))
        });
        for r in res {
            let n = r?;
            assert!((n - 51f64.sqrt()).abs() < 1e-12, "{n}");
        }
        Ok(())
    }
}
