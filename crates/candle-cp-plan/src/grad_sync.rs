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
//! | 3 | reduce-scatter of the gradients; the parameters all-gathered for the forward and again for the backward (no all-gather after the step: the next forward's gathers collect the updated slices) | `(R-1)/R·N·(4 + 2e)` |
//!
//! (ZeRO-3 moves 1.5× the elements of ZeRO-0's all-reduce, as the ZeRO paper counts.) With
//! `k` micro-batches per optimizer step ([`crate::PlanInput::micro_batches`]) the stages that
//! shard the gradients cannot accumulate them locally: ZeRO-2 (candle-cp's `--zero2`)
//! reduce-scatters after every micro-batch, `(R-1)/R·N·(4k + e)`, and ZeRO-3 repeats all of
//! its collectives for every micro-batch, `(R-1)/R·N·k·(4 + 2e)`. ZeRO-0 and 1 accumulate
//! locally and reduce once per step; `k = 1` is the table.
//!
//! Under SP the norm weights' gradients are summed over TP as well (`h·(2L+1)` parameters,
//! left out here).
//!
//! **Overlapped** (`--recompute --overlap-grad-sync`: each layer's gradients are reduced as
//! soon as its backward is done, on a communicator of its own): with `L` layers on the GPU,
//! the reduction `T` (the all-reduce, or the reduce-scatter, of all `N` gradients) split into
//! `L` equal parts started one layer-backward `b` apart, the link finishes
//! `max(T/L, T − (L−1)·b)` after the backward: the last layer's part when the link keeps up
//! (`T/L ≤ b`), else what the backward could not cover. `b` (and `f` below) is the part of a layer's
//! time the link is free: [`crate::plan::plan`] subtracts what the CP and TP collectives on
//! the same link take (`plan::link_busy_per_layer`). The ZeRO all-gather of the updated
//! parameters runs after the optimizer step and stays exposed, unless it overlaps the next
//! forward (`--overlap-param-gather`: each layer's parameters gathered while the layers
//! before it compute, one layer-forward `f` apart): then its `G` leaves
//! `max(G/L, G − (L−1)·f)`, by the same argument. With `k` reductions per step (ZeRO-2/3),
//! each of `T/k` overlaps its own micro-batch's backward: `k·max(T/(kL), T/k − (L−1)·b)`
//! (no credit is taken for a reduction spilling into the next micro-batch's forward).
//! ZeRO-3's gathers overlap like the ZeRO all-gather (prefetched one layer ahead, as FSDP and
//! DeepSpeed do): each micro-batch's forward gather `G` leaves `max(G/L, G − (L−1)·f)`. Its
//! backward gather shares the link with that micro-batch's reduce-scatter `T/k`: with both
//! overlapped the pair leaves `max(B/L, B − (L−1)·b)` for `B = G + T/k`; with the gathers
//! alone overlapped, the backward gather leaves `max(G/L, G − (L−1)·b)` and the
//! reduce-scatter is exposed. Without the gathers' overlap they are exposed in full.

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
    /// Gradient reductions per optimizer step: the micro-batch count `k` under ZeRO-2/3
    /// (sharded gradients cannot be accumulated locally), else 1.
    pub reductions: usize,
    /// Bytes sent per GPU per optimizer step (module table, `k` micro-batches).
    pub bytes_per_step: f64,
    /// `bytes_per_step / link bandwidth`, s: the time if none of it overlaps the backward.
    pub seconds_per_step: f64,
    /// Of `bytes_per_step`, the gradient reduction (all-reduce, or reduce-scatter under ZeRO):
    /// the part that can overlap the backward.
    pub reduce_bytes_per_step: f64,
    /// The time left exposed when the reduction overlaps the backward layer by layer (module
    /// docs); `None` until [`GradSync::overlapped`] sets it.
    pub exposed_overlapped_s: Option<f64>,
    /// ZeRO: the time left exposed when the parameter all-gathers also overlap compute layer
    /// by layer (ZeRO-1/2: the next forward; ZeRO-3: each micro-batch's forward and backward;
    /// module docs); `None` without ZeRO or until [`GradSync::overlapped`] sets it.
    pub exposed_gather_overlapped_s: Option<f64>,
    /// ZeRO: the time left exposed when only the parameter all-gathers overlap compute (the
    /// gradient reduction in full); `None` without ZeRO or until [`GradSync::overlapped`]
    /// sets it.
    pub exposed_gather_only_s: Option<f64>,
}

impl GradSync {
    /// Sets [`GradSync::exposed_overlapped_s`] (and, under ZeRO 1 / 2,
    /// [`GradSync::exposed_gather_overlapped_s`]) for `layers` layers on this GPU whose
    /// backward (recompute included) takes `bwd_layer_s` each and forward `fwd_layer_s`.
    pub fn overlapped(mut self, layers: usize, bwd_layer_s: f64, fwd_layer_s: f64) -> Self {
        let gathers = self.zero >= 1;
        if self.bytes_per_step <= 0.0 || layers == 0 {
            self.exposed_overlapped_s = Some(0.0);
            self.exposed_gather_overlapped_s = gathers.then_some(0.0);
            self.exposed_gather_only_s = gathers.then_some(0.0);
            return self;
        }
        let bw = self.bytes_per_step / self.seconds_per_step;
        let k = self.reductions.max(1) as f64;
        let t = self.reduce_bytes_per_step / bw / k;
        let l = layers as f64;
        let rest = (self.bytes_per_step - self.reduce_bytes_per_step) / bw;
        let reduce = k * (t / l).max(t - (l - 1.0) * bwd_layer_s);
        self.exposed_overlapped_s = Some(reduce + rest);
        let hide = |g: f64, per_layer: f64| (g / l).max(g - (l - 1.0) * per_layer);
        let (f, b) = (fwd_layer_s, bwd_layer_s);
        let full_reduce = k * t;
        let (both, gather_only) = if self.zero >= 3 {
            // k forward and k backward gathers of rest / (2k) each; a backward gather and its
            // micro-batch's reduce-scatter share the link
            let g = rest / (2.0 * k);
            (k * (hide(g, f) + hide(g + t, b)), full_reduce + k * (hide(g, f) + hide(g, b)))
        } else {
            (reduce + hide(rest, f), full_reduce + hide(rest, f))
        };
        self.exposed_gather_overlapped_s = gathers.then_some(both);
        self.exposed_gather_only_s = gathers.then_some(gather_only);
        self
    }
}

/// [`GradSync`] of `layout` on `hw` for `params_per_gpu` parameters trained in `e`-byte
/// elements, `micro_batches` micro-batches per optimizer step (module docs; 0 counts as 1).
pub fn grad_sync(
    layout: &Layout,
    hw: &Hardware,
    params_per_gpu: f64,
    e: usize,
    micro_batches: usize,
) -> GradSync {
    let r = layout.dp * layout.cp;
    let frac = (r as f64 - 1.0) / r as f64;
    let e = e as f64;
    let reductions = if layout.zero >= 2 { micro_batches.max(1) } else { 1 };
    let k = reductions as f64;
    let per_param = match layout.zero {
        0 => 2.0 * 4.0,
        1 | 2 => 4.0 * k + e,
        _ => k * (4.0 + 2.0 * e),
    };
    let bytes = frac * params_per_gpu * per_param;
    let reduce_bytes = frac * params_per_gpu * if layout.zero == 0 { 8.0 } else { 4.0 * k };
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
        reductions,
        bytes_per_step: bytes,
        seconds_per_step: if r > 1 { bytes / link.bandwidth(hw) } else { 0.0 },
        reduce_bytes_per_step: reduce_bytes,
        exposed_overlapped_s: None,
        exposed_gather_overlapped_s: None,
        exposed_gather_only_s: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(tp: usize, cp: usize, dp: usize, zero: u8) -> Layout {
        Layout { tp, cp, dp, zero, ..Layout::default() }
    }

    /// R = 4 replicas, N = 1e9 parameters, bf16: ZeRO-0 sends 2·3/4·4 = 6 bytes per
    /// parameter, ZeRO-1 3/4·(4 + 2) = 4.5, ZeRO-3 3/4·(4 + 4) = 6; one replica sends nothing.
    #[test]
    fn bytes_per_zero_stage() {
        let hw = Hardware::preset("h100").unwrap();
        let n = 1e9;
        for (zero, per) in [(0u8, 6.0), (1, 4.5), (2, 4.5), (3, 6.0)] {
            let g = grad_sync(&layout(1, 4, 1, zero), &hw, n, 2, 1);
            assert_eq!(g.replicas, 4);
            assert!((g.bytes_per_step - per * n).abs() < 1.0, "zero {zero}: {}", g.bytes_per_step);
            assert!((g.seconds_per_step - g.bytes_per_step / hw.nvlink_bw).abs() < 1e-12);
        }
        let one = grad_sync(&layout(8, 1, 1, 1), &hw, n, 2, 1);
        assert_eq!((one.replicas, one.bytes_per_step, one.seconds_per_step), (1, 0.0, 0.0));
    }

    /// `k = 4` micro-batches, R = 4, N = 1e9, bf16: ZeRO-0 and 1 still reduce once (6 and 4.5
    /// bytes per parameter); ZeRO-2 reduce-scatters 4 times, 3/4·(4·4 + 2) = 13.5; ZeRO-3
    /// repeats its reduce-scatter and two gathers per micro-batch, 3/4·4·(4 + 4) = 24.
    #[test]
    fn micro_batches_multiply_the_sharded_reductions() {
        let hw = Hardware::preset("h100").unwrap();
        let n = 1e9;
        for (zero, per, reductions) in [(0u8, 6.0, 1), (1, 4.5, 1), (2, 13.5, 4), (3, 24.0, 4)] {
            let g = grad_sync(&layout(1, 4, 1, zero), &hw, n, 2, 4);
            assert!((g.bytes_per_step - per * n).abs() < 1.0, "zero {zero}: {}", g.bytes_per_step);
            assert_eq!(g.reductions, reductions, "zero {zero}");
        }
        // 0 micro-batches count as 1
        assert_eq!(grad_sync(&layout(1, 4, 1, 2), &hw, n, 2, 0), grad_sync(&layout(1, 4, 1, 2), &hw, n, 2, 1));
        // overlapped: each of the k reductions T/k against its own micro-batch's backward
        let bw = hw.nvlink_bw;
        let z = grad_sync(&layout(1, 4, 1, 2), &hw, n, 2, 4);
        let (t, gather) = (z.reduce_bytes_per_step / bw, (z.bytes_per_step - z.reduce_bytes_per_step) / bw);
        let (slow, fast) = (10.0, t / 4.0 / 8.0); // a backward layer far longer / shorter than T/k
        let got = |b: f64| z.clone().overlapped(4, b, 10.0).exposed_overlapped_s.unwrap();
        assert!((got(slow) - (4.0 * (t / 16.0) + gather)).abs() < 1e-9);
        assert!((got(fast) - (4.0 * (t / 4.0 - 3.0 * fast) + gather)).abs() < 1e-9);
        // ZeRO-3, k = 4: 4 forward and 4 backward gathers of G = gather/8 each, prefetched one
        // layer ahead: with slow layers one layer's share of each, with f, b → 0 all of it
        let z3 = grad_sync(&layout(1, 4, 1, 3), &hw, n, 2, 4);
        let (t3, g3) = (z3.reduce_bytes_per_step / bw, (z3.bytes_per_step - z3.reduce_bytes_per_step) / bw);
        assert!((g3 / t3 - 1.0).abs() < 1e-12); // 2e = 4 bytes of gathers per 4 of reduce-scatter
        let g = g3 / 8.0;
        let slow = z3.clone().overlapped(4, 10.0, 10.0);
        assert!((slow.exposed_overlapped_s.unwrap() - (4.0 * (t3 / 16.0) + g3)).abs() < 1e-9);
        // both: per micro-batch G/4 of the forward gather, (G + T/4)/4 of the backward pair
        let want = 4.0 * (g / 4.0 + (g + t3 / 4.0) / 4.0);
        assert!((slow.exposed_gather_overlapped_s.unwrap() - want).abs() < 1e-9);
        // the gathers alone: the whole reduce-scatter, a quarter of each gather
        assert!((slow.exposed_gather_only_s.unwrap() - (t3 + 8.0 * g / 4.0)).abs() < 1e-9);
        let none = z3.clone().overlapped(4, 0.0, 0.0);
        assert!((none.exposed_gather_overlapped_s.unwrap() - (t3 + g3)).abs() < 1e-9);
        // a backward just long enough for the gather alone cannot also carry the
        // reduce-scatter: (L−1)·b = G hides G, not G + T/4
        let tight = z3.overlapped(4, g / 3.0, 10.0);
        assert!((tight.exposed_gather_only_s.unwrap() - (t3 + 4.0 * (g / 4.0 + g / 4.0))).abs() < 1e-9);
        let pair = g + t3 / 4.0;
        assert!((tight.exposed_gather_overlapped_s.unwrap() - 4.0 * (g / 4.0 + (pair - g))).abs() < 1e-9);
    }

    /// TP 8 × CP 2 spans two 8-GPU nodes (InfiniBand); CP 8 alone stays in one (NVLink); any
    /// DP over more than one node's worth of GPUs crosses nodes.
    #[test]
    fn link_of_the_replica_group() {
        let hw = Hardware::preset("h100").unwrap();
        assert_eq!(grad_sync(&layout(8, 2, 1, 1), &hw, 1e9, 2, 1).link, Link::Ib);
        assert_eq!(grad_sync(&layout(1, 8, 1, 1), &hw, 1e9, 2, 1).link, Link::Nvlink);
        assert_eq!(grad_sync(&layout(4, 2, 2, 1), &hw, 1e9, 2, 1).link, Link::Ib);
        assert_eq!(grad_sync(&layout(2, 2, 2, 1), &hw, 1e9, 2, 1).link, Link::Nvlink);
    }

    /// 4 layers, ZeRO-0 (all of it a reduction) of T = 0.8 s: a backward of 0.5 s per layer
    /// leaves the last layer's 0.2 s; one of 0.1 s per layer leaves 0.8 − 3·0.1 = 0.5 s.
    /// ZeRO-1 adds its all-gather (e = 2 of 4 + 2 bytes: 1/3 of the time) in full.
    #[test]
    fn exposed_when_overlapped() {
        let hw = Hardware::preset("h100").unwrap();
        let g = grad_sync(&layout(1, 4, 1, 0), &hw, 1e9, 2, 1);
        let bw = hw.nvlink_bw;
        let n = 0.8 * bw / 6.0; // 6 bytes per parameter: T = 0.8 s
        let g = GradSync { params_per_gpu: n, bytes_per_step: 0.8 * bw, seconds_per_step: 0.8, reduce_bytes_per_step: 0.8 * bw, ..g };
        let close = |a: Option<f64>, b: f64| (a.unwrap() - b).abs() < 1e-9;
        assert!(close(g.clone().overlapped(4, 0.5, 0.2).exposed_overlapped_s, 0.2));
        assert!(close(g.clone().overlapped(4, 0.1, 0.2).exposed_overlapped_s, 0.5));
        assert_eq!(g.clone().overlapped(4, 0.1, 0.2).exposed_gather_overlapped_s, None);
        let z = grad_sync(&layout(1, 4, 1, 1), &hw, 1e9, 2, 1);
        let (t, gather) = (z.reduce_bytes_per_step / bw, (z.bytes_per_step - z.reduce_bytes_per_step) / bw);
        assert!((gather / z.seconds_per_step - 1.0 / 3.0).abs() < 1e-12);
        assert!(close(z.clone().overlapped(4, 10.0, 5.0).exposed_overlapped_s, t / 4.0 + gather));
        // the all-gather overlapping the forward: a forward layer slower than a quarter of the
        // gather leaves that quarter; a fast one (f → 0) leaves almost all of it
        assert!(close(z.clone().overlapped(4, 10.0, 5.0).exposed_gather_overlapped_s, t / 4.0 + gather / 4.0));
        let f = gather / 10.0;
        assert!(close(z.clone().overlapped(4, 10.0, f).exposed_gather_overlapped_s, t / 4.0 + gather - 3.0 * f));
        let one = grad_sync(&layout(8, 1, 1, 1), &hw, 1e9, 2, 1).overlapped(4, 0.1, 0.05);
        assert_eq!((one.exposed_overlapped_s, one.exposed_gather_overlapped_s), (Some(0.0), Some(0.0)));
    }
}
