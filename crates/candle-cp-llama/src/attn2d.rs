//! 2-D (Ulysses × ring) attention dispatch; filled in once `candle_cp_ops::usp` lands.

use crate::layout::ParallelCtx;
use candle_core::{bail, Result, Tensor};

/// 2-D attention of the CP shard (Ulysses inner, ring outer).
pub fn attend_2d(q: &Tensor, _k: &Tensor, _v: &Tensor, ctx: &ParallelCtx, _scale: f64) -> Result<Tensor> {
    bail!("2-D attention not available yet (layout {}, q {:?})", ctx.layout, q.dims())
}
