//! Gradient synchronisation once per optimizer step, over the `R = dp·cp` replicas that hold
//! the same weights (every CP rank saw other tokens of the sequence, every DP rank other
//! sequences, so each parameter's gradient is summed over all of them).
//!
//! Bytes one GPU sends per step for its `N` parameters (ring collectives: a reduce-scatter or
//! an all-gather sends `(R-1)/R` of the buffer, an all-reduce twice that), gradients reduced
//! in f32 (4 bytes, as `candle_cp_llama::reduce_gradients` does) and parameters gathered in
//! the training dtype (`e` bytes):
//!
//! | ZeRO | collectives | bytes |
//! |------|-------------|-------|
//! | 0 | all-reduce of the gradients | `2·(R-1)/R·N·4` |
//! | 1, 2 | reduce-scatter of the gradients into the owners' slices, all-gather of the updated parameters | `(R-1)/R·N·(4 + e)` |
//! | 3 | + the parameters all-gathered again in forward and backward | `(R-1)/R·N·(4 + 3e)` |
//!
//! Under SP the norm weights' gradients are summed over TP as well (`h·(2L+1)` parameters,
//! left out here).

use crate::hardware::{Hardware, Link};
use crate::layout::Layout;
use serde::Serialize;

/// Gradient synchronisation per optimizer step on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GradSync {
    /// Replicas `R = dp·cp`.
    pub replicas: usize,
    /// The link the replica group spans (ranks laid out TP fastest, then CP, PP, DP).
    pub link: Link,
    /// ZeRO stage of the layout.
    pub zero: u8,
    /// Parameters on this GPU before ZeRO sharding, `N`.
    pub params_per_gpu: f64,
    /// Bytes sent per GPU per optimizer step (module table).
    pub bytes_per_step: f64,
    /// `bytes_per_step / link bandwidth`, s: the time if none of it overlaps the backward.
    pub seconds_per_step: f64,
}

/// [`GradSync`] of `layout` on `hw` for `params_per_gpu` parameters trained in `e`-byte
/// elements.
pub fn grad_sync(layout: &Layout, hw: &Hardware, params_per_gpu: f64, e: usize) -> GradSync {
    let r = layout.dp * layout.cp;
    let frac = (r as f64 - 1.0) / r as f64;
    let e = e as f64;
    let per_param = match layout.zero {
        0 => 2.0 * 4.0,
        1 | 2 => 4.0 + e,
        _ => 4.0 + 3.0 * e,
    };
    let bytes = frac * params_per_gpu * per_param;
    // CP ranks are tp apart; with DP the group reaches across the whole world
    let link = if layout.dp == 1 {
        Link::for_group(layout.tp, layout.cp, hw)
    } else {
        Link::for_group(1, layout.world(), hw)
    };
    GradSync {
        replicas: r,
        link,
        zero: layout.zero,
        params_per_gpu,
        bytes_per_step: bytes,
        seconds_per_step: if r > 1 { bytes / link.bandwidth(hw) } else { 0.0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(tp: usize, cp: usize, dp: usize, zero: u8) -> Layout {
        Layout { tp, cp, dp, zero, ..Layout::default() }
    }

    /// R = 4 replicas, N = 1e9 parameters, bf16: ZeRO-0 sends 2·3/4·4 = 6 bytes per
    /// parameter, ZeRO-1 3/4·(4 + 2) = 4.5, ZeRO-3 3/4·(4 + 6) = 7.5; one replica sends nothing.
    #[test]
    fn bytes_per_zero_stage() {
        let hw = Hardware::preset("h100").unwrap();
        let n = 1e9;
        for (zero, per) in [(0u8, 6.0), (1, 4.5), (2, 4.5), (3, 7.5)] {
            let g = grad_sync(&layout(1, 4, 1, zero), &hw, n, 2);
            assert_eq!(g.replicas, 4);
            assert!((g.bytes_per_step - per * n).abs() < 1.0, "zero {zero}: {}", g.bytes_per_step);
            assert!((g.seconds_per_step - g.bytes_per_step / hw.nvlink_bw).abs() < 1e-12);
        }
        let one = grad_sync(&layout(8, 1, 1, 1), &hw, n, 2);
        assert_eq!((one.replicas, one.bytes_per_step, one.seconds_per_step), (1, 0.0, 0.0));
    }

    /// TP 8 × CP 2 spans two 8-GPU nodes (InfiniBand); CP 8 alone stays in one (NVLink); any
    /// DP over more than one node's worth of GPUs crosses nodes.
    #[test]
    fn link_of_the_replica_group() {
        let hw = Hardware::preset("h100").unwrap();
        assert_eq!(grad_sync(&layout(8, 2, 1, 1), &hw, 1e9, 2).link, Link::Ib);
        assert_eq!(grad_sync(&layout(1, 8, 1, 1), &hw, 1e9, 2).link, Link::Nvlink);
        assert_eq!(grad_sync(&layout(4, 2, 2, 1), &hw, 1e9, 2).link, Link::Ib);
        assert_eq!(grad_sync(&layout(2, 2, 2, 1), &hw, 1e9, 2).link, Link::Nvlink);
    }
}
