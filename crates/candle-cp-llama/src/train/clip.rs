//! Gradient clipping by the global L2 norm over all ranks.
//!
//! After the model's gradient reduction, a replicated parameter (same value on every rank of
//! the tensor-parallel group) has the same gradient on every rank, while a tensor-parallel
//! shard has its own slice of the full gradient, and a replicated KV-head block (fewer KV
//! heads than TP ranks) is held by `c` of the ranks. The global squared norm is therefore
//! `Σ_replicated ‖g‖² + all_reduce_tp(Σ_sliced ‖g‖² / c)`: replicated gradients are counted
//! once, slices are summed over the group, each block once. Every rank gets the same norm
//! and the same scale.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::Group;

/// Global L2 norm of `grads`: pairs of a gradient and its number of *copies*, how many ranks
/// of `shard_group` hold that same gradient (`1` for a TP shard, `shard_group.size()` for a
/// replicated parameter, `tp / Hkv` for a replicated KV head: [`candle_cp_nn::Shard::copies`]).
///
/// `shard_group` is the group whose ranks hold different slices of the sharded gradients
/// (the TP group); `None` means every gradient is complete on this rank. Collective over
/// `shard_group`: every rank of it must call this, with the same number of sharded items.
pub fn global_norm(grads: &[(Tensor, usize)], shard_group: Option<&Group>) -> Result<f64> {
    let size = shard_group.map(|g| g.size()).unwrap_or(1);
    let mut replicated = 0f64;
    let mut sharded = 0f64;
    for (g, copies) in grads {
        let sq = g
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        if *copies >= size {
            replicated += sq;
        } else {
            sharded += sq / (*copies).max(1) as f64;
        }
    }
    if let Some(group) = shard_group {
        if group.size() > 1 {
            let t = Tensor::new(&[sharded as f32], &Device::Cpu)?;
            sharded = group.all_reduce(&t)?.to_vec1::<f32>()?[0] as f64;
        }
    }
    Ok((replicated + sharded).sqrt())
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
}
