//! Gradient clipping by the global L2 norm over all ranks.
//!
//! After the model's gradient reduction, a replicated parameter (same value on every rank of
//! the tensor-parallel group) has the same gradient on every rank, while a tensor-parallel
//! shard has its own slice of the full gradient. The global squared norm is therefore
//! `Σ_replicated ‖g‖² + all_reduce_tp(Σ_sharded ‖g‖²)`: replicated gradients are counted once,
//! shards are summed over the group. Every rank gets the same norm and the same scale.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::Group;

/// Global L2 norm of `grads` (pairs of gradient and "is a shard over `shard_group`").
///
/// `shard_group` is the group whose ranks hold different slices of the sharded gradients
/// (the TP group); `None` means every gradient is complete on this rank. Collective over
/// `shard_group`: every rank of it must call this, with the same number of sharded items.
pub fn global_norm(grads: &[(Tensor, bool)], shard_group: Option<&Group>) -> Result<f64> {
    let mut replicated = 0f64;
    let mut sharded = 0f64;
    for (g, is_shard) in grads {
        let sq = g
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        if *is_shard {
            sharded += sq;
        } else {
            replicated += sq;
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
            (Tensor::new(&[3.0f32, 0.0], &dev)?, false),
            (Tensor::new(&[[4.0f32]], &dev)?, false),
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
                (Tensor::new(&[3.0f32, 4.0], &dev)?, false),
                (Tensor::new(shard, &dev)?, true),
            ];
            global_norm(&items, Some(&g))
        });
        for r in res {
            let n = r?;
            assert!((n - 50f64.sqrt()).abs() < 1e-6, "{n}");
        }
        Ok(())
    }
}
