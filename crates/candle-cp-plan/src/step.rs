//! One optimizer step: `k` micro-batches through a 1F1B pipeline, then the gradient
//! synchronisation; throughput and model FLOP utilisation (MFU).
//!
//! ```text
//!   stage 0 │F1 F2 F3 F4 B1 F5 B2 ... Bk│          the busiest stage runs k forward +
//!   stage 1 │   F1 F2 F3 B1 ...      Bk │ ...      backward micro-batches; the pipeline
//!   ...                                            fills and drains around them:
//!   step = (k + (pp − 1)/v) · stage  +  fill / drain sends  +  gradient sync left exposed
//! ```
//!
//! - `stage` = the busiest GPU's layers ([`crate::memory::layers_per_stage`]: `⌈L/pp⌉`, or
//!   `v` chunks of `⌈L/(pp·v)⌉` with `v` virtual stages) × the per-layer time
//!   ([`crate::plan::LayerTime`]) + the head (output projection and loss, forward and
//!   backward: `3·2·s·b·h·V / (t·cp)` FLOPs at the linear rate). Charging the head to the
//!   busiest stage is exact for `pp = 1` and an upper bound otherwise (it sits on the last
//!   stage).
//! - The fill and drain take `(pp − 1)` stage-times, `v` times fewer under Megatron's
//!   interleaved schedule: the bubble is `(pp − 1)/(v·k + pp − 1)`. The point-to-point
//!   activation sends between stages ([`StepTime::pp_sends_bytes`]: `2·v·(s/cp)·b·h·e/t` per
//!   micro-batch per GPU, the activations forward and their gradients backward, TP-sharded as
//!   Megatron sends them) overlap compute in the steady 1F1B phase; on the fill and the drain
//!   each stage waits for its neighbour's: `pp − 1` one-way sends of one chunk's activations
//!   forward and `pp − 1` of their gradients backward are exposed, whatever `v`
//!   ([`StepTime::pp_exposed_s`] = `2·(pp − 1)` sends of `pp_sends_bytes/(2·v)` bytes =
//!   `(pp − 1)·pp_sends_s / v`). Launch and collective latencies are not modelled.
//! - The gradient sync ([`crate::grad_sync`]) is counted as exposed after the last backward,
//!   in full ([`Overlap::None`]) or by its overlapped formulas.
//! - Model FLOPs exclude recomputation: `dp·k·(L·(linear + attention, fwd + bwd) + 3·logits)`
//!   per step; MFU = model FLOPs / (world · step · peak).

use crate::grad_sync::GradSync;
use crate::plan_bail;
use crate::Result;
use serde::Serialize;

/// How much of the gradient synchronisation the step time takes as hidden.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlap {
    /// All of it after the backward.
    None,
    /// The gradient reduction overlaps the backward layer by layer (`--overlap-grad-sync`).
    Grad,
    /// Only the ZeRO-1/2 parameter all-gather overlaps the next forward
    /// (`--overlap-param-gather` alone).
    Gather,
    /// + under ZeRO-1/2 the parameter all-gather overlaps the next forward
    ///   (`--overlap-param-gather`).
    All,
}

impl Overlap {
    /// Parses `none`, `grad`, `gather` or `all`.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "none" => Overlap::None,
            "grad" => Overlap::Grad,
            "gather" => Overlap::Gather,
            "all" => Overlap::All,
            _ => plan_bail!("unknown overlap '{s}' (known: none, grad, gather, all)"),
        })
    }

    /// (gradient reduction overlapped, parameter all-gather overlapped).
    fn parts(self) -> (bool, bool) {
        match self {
            Overlap::None => (false, false),
            Overlap::Grad => (true, false),
            Overlap::Gather => (false, true),
            Overlap::All => (true, true),
        }
    }

    /// This overlap, keeping only the parts allowed (`grad`: the reduction during the
    /// backward; `gather`: the all-gather during the next forward).
    pub fn limit(self, grad: bool, gather: bool) -> Self {
        match (self.parts().0 && grad, self.parts().1 && gather) {
            (false, false) => Overlap::None,
            (true, false) => Overlap::Grad,
            (false, true) => Overlap::Gather,
            (true, true) => Overlap::All,
        }
    }

    /// The gradient sync left exposed under this assumption (`g` after
    /// [`GradSync::overlapped`]).
    pub fn exposed_s(self, g: &GradSync) -> f64 {
        let grad = g.exposed_overlapped_s.unwrap_or(g.seconds_per_step);
        match self {
            Overlap::None => g.seconds_per_step,
            Overlap::Grad => grad,
            Overlap::Gather => g.exposed_gather_only_s.unwrap_or(g.seconds_per_step),
            Overlap::All => g.exposed_gather_overlapped_s.unwrap_or(grad),
        }
    }
}

/// Time and throughput of one optimizer step, on the busiest GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepTime {
    /// Micro-batches per optimizer step per data-parallel replica, `k`.
    pub micro_batches: usize,
    /// Layers on the busiest stage, `⌈L/pp⌉`.
    pub stage_layers: usize,
    /// Output projection and loss of one micro-batch, forward and backward, s.
    pub head_s: f64,
    /// One micro-batch's forward and backward on the busiest stage, s.
    pub stage_s: f64,
    /// Bytes one GPU sends to its neighbouring stages per micro-batch (not added to the step:
    /// they overlap compute in 1F1B), 0 without PP.
    pub pp_sends_bytes: f64,
    /// `pp_sends_bytes` over the link between stages, s.
    pub pp_sends_s: f64,
    /// The sends on the pipeline's fill and drain path, exposed: `(pp − 1)·pp_sends_s / v`
    /// (`2·(pp − 1)` one-way sends of one chunk's activations or their gradients), s; 0
    /// without PP.
    pub pp_exposed_s: f64,
    /// Pipeline bubble `(pp − 1)/(v·k + pp − 1)`.
    pub bubble_fraction: f64,
    /// `(k + (pp − 1)/v) · stage_s`, s.
    pub compute_s: f64,
    /// The overlap the step time assumes.
    pub overlap: Overlap,
    /// Gradient synchronisation left exposed under `overlap`, s.
    pub sync_exposed_s: f64,
    /// `compute_s + pp_exposed_s + sync_exposed_s`, s.
    pub step_s: f64,
    /// The same with nothing overlapped, s.
    pub step_s_no_overlap: f64,
    /// Tokens per optimizer step, all replicas: `dp·k·b·s`.
    pub tokens_per_step: f64,
    /// `tokens_per_step / (world · step_s)`.
    pub tokens_per_s_per_gpu: f64,
    /// Model FLOPs per optimizer step, all GPUs (no recomputation).
    pub model_flops_per_step: f64,
    /// `model_flops_per_step / (world · step_s)`, FLOP/s.
    pub model_flops_per_s_per_gpu: f64,
    /// Model FLOP utilisation: the above over the hardware peak.
    pub mfu: f64,
}

/// What [`step_time`] needs, all per micro-batch of `b` sequences unless named otherwise.
#[derive(Debug, Clone)]
pub struct StepInput<'a> {
    /// Micro-batches per step per replica, `k ≥ 1`.
    pub micro_batches: usize,
    /// Pipeline degree.
    pub pp: usize,
    /// Model chunks per pipeline rank (interleaved schedule), `v ≥ 1`.
    pub virtual_stages: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// `tp·cp·pp·dp`.
    pub world: usize,
    /// Layers of the model, `L`.
    pub layers: usize,
    /// Layers on the busiest stage.
    pub stage_layers: usize,
    /// One layer's forward + backward (+ recompute) on one GPU, s.
    pub layer_s: f64,
    /// The head's forward + backward on one GPU, s.
    pub head_s: f64,
    /// One layer's model FLOPs (linear + attention, forward + backward), unsharded.
    pub layer_model_flops: f64,
    /// The head's model FLOPs (forward + backward), unsharded.
    pub head_model_flops: f64,
    /// Tokens of one micro-batch, `b·s`.
    pub tokens: f64,
    /// Hardware peak, FLOP/s.
    pub peak_flops: f64,
    /// The gradient sync, with its overlapped formulas set.
    pub grad_sync: &'a GradSync,
    /// The overlap to assume.
    pub overlap: Overlap,
    /// Bytes one GPU sends between stages per micro-batch.
    pub pp_sends_bytes: f64,
    /// Bandwidth of the link between stages, bytes/s.
    pub pp_link_bw: f64,
}

/// The step model of the module docs.
pub fn step_time(i: &StepInput) -> StepTime {
    let k = i.micro_batches.max(1);
    let (kf, pp, v) = (k as f64, i.pp.max(1) as f64, i.virtual_stages.max(1) as f64);
    let stage_s = i.stage_layers as f64 * i.layer_s + i.head_s;
    let compute_s = (kf + (pp - 1.0) / v) * stage_s;
    let pp_sends_s = if i.pp_sends_bytes > 0.0 { i.pp_sends_bytes / i.pp_link_bw } else { 0.0 };
    let pp_exposed_s = (pp - 1.0) * pp_sends_s / v;
    let sync_exposed_s = i.overlap.exposed_s(i.grad_sync);
    let step_s = compute_s + pp_exposed_s + sync_exposed_s;
    let tokens_per_step = i.dp as f64 * kf * i.tokens;
    let model_flops_per_step =
        i.dp as f64 * kf * (i.layers as f64 * i.layer_model_flops + i.head_model_flops);
    let per_gpu = |x: f64| if step_s > 0.0 { x / (i.world as f64 * step_s) } else { 0.0 };
    let model_flops_per_s_per_gpu = per_gpu(model_flops_per_step);
    StepTime {
        micro_batches: k,
        stage_layers: i.stage_layers,
        head_s: i.head_s,
        stage_s,
        pp_sends_bytes: i.pp_sends_bytes,
        pp_sends_s,
        pp_exposed_s,
        bubble_fraction: (pp - 1.0) / (v * kf + pp - 1.0),
        compute_s,
        overlap: i.overlap,
        sync_exposed_s,
        step_s,
        step_s_no_overlap: compute_s + pp_exposed_s + i.grad_sync.seconds_per_step,
        tokens_per_step,
        tokens_per_s_per_gpu: per_gpu(tokens_per_step),
        model_flops_per_step,
        model_flops_per_s_per_gpu,
        mfu: model_flops_per_s_per_gpu / i.peak_flops,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grad_sync::grad_sync;
    use crate::{Hardware, Layout};

    /// PP 4 with k = 4: a bubble of 3/7 (3/11 interleaved with v = 2); 2 layers of 1 s + a
    /// 0.5 s head per stage; 1 GB sent per micro-batch at 50 GB/s.
    #[test]
    fn pipeline_bubble_and_throughput() {
        let hw = Hardware::preset("h100").unwrap();
        let l = Layout { cp: 4, pp: 4, dp: 2, ..Layout::default() };
        let g = grad_sync(&l, &hw, 1e9, 2, 4).overlapped(2, 0.5, 0.25);
        let i = StepInput {
            micro_batches: 4,
            pp: 4,
            virtual_stages: 1,
            dp: 2,
            world: 32,
            layers: 8,
            stage_layers: 2,
            layer_s: 1.0,
            head_s: 0.5,
            layer_model_flops: 1e15,
            head_model_flops: 2e14,
            tokens: 4096.0,
            peak_flops: 1e15,
            grad_sync: &g,
            overlap: Overlap::None,
            pp_sends_bytes: 1e9,
            pp_link_bw: 50e9,
        };
        let t = step_time(&i);
        assert_eq!(t.stage_s, 2.5);
        assert_eq!(t.compute_s, 7.0 * 2.5);
        assert_eq!(t.bubble_fraction, 3.0 / 7.0);
        assert_eq!(t.pp_sends_s, 0.02);
        // the fill's 3 forward sends and the drain's 3 backward sends, 10 ms each
        assert_eq!(t.pp_exposed_s, 3.0 * 0.02);
        assert_eq!(t.step_s, 17.5 + t.pp_exposed_s + g.seconds_per_step);
        assert_eq!(t.step_s, t.step_s_no_overlap);
        assert_eq!(t.tokens_per_step, 2.0 * 4.0 * 4096.0);
        assert_eq!(t.model_flops_per_step, 8.0 * (8e15 + 2e14));
        assert!((t.mfu - 8.0 * 8.2e15 / (32.0 * t.step_s) / 1e15).abs() < 1e-15);
        // each overlap leaves less exposed, and never more than none
        let all = step_time(&StepInput { overlap: Overlap::All, ..i.clone() });
        let grad = step_time(&StepInput { overlap: Overlap::Grad, ..i.clone() });
        assert!(all.step_s <= grad.step_s && grad.step_s < t.step_s, "{} {} {}", all.step_s, grad.step_s, t.step_s);
        assert_eq!(grad.sync_exposed_s, g.exposed_overlapped_s.unwrap());
        assert_eq!(all.sync_exposed_s, g.exposed_gather_overlapped_s.unwrap());
        assert!(Overlap::parse("sideways").is_err());
        // the gather alone: the whole reduction, and the gather as overlapped
        let gather = step_time(&StepInput { overlap: Overlap::Gather, ..i.clone() });
        let (reduce, rest) = (g.reduce_bytes_per_step / (g.bytes_per_step / g.seconds_per_step), g.seconds_per_step * (1.0 - g.reduce_bytes_per_step / g.bytes_per_step));
        // 2 layers, a layer forward of 0.25 s (the overlapped() call above)
        let gather_ov = (rest / 2.0).max(rest - 0.25);
        assert!((gather.sync_exposed_s - (reduce + gather_ov)).abs() < 1e-12, "{} {}", gather.sync_exposed_s, reduce + gather_ov);
        assert!(all.step_s <= gather.step_s && gather.step_s < t.step_s);
        assert_eq!(Overlap::All.limit(false, true), Overlap::Gather);
        assert_eq!(Overlap::Grad.limit(true, true), Overlap::Grad);
        assert_eq!(Overlap::All.limit(true, false), Overlap::Grad);
        assert_eq!(Overlap::Gather.limit(true, false), Overlap::None);
        // interleaved, v = 2: the fill and drain take (pp − 1)/v stages
        let v2 = step_time(&StepInput { virtual_stages: 2, overlap: Overlap::None, ..i.clone() });
        assert_eq!(v2.compute_s, (4.0 + 1.5) * 2.5);
        assert_eq!(v2.bubble_fraction, 3.0 / 11.0);
        assert!((v2.bubble_fraction - 1.5 / 5.5).abs() < 1e-15);
        // the same 2·(pp − 1) one-way sends of a chunk's activations, a chunk being 1/v of
        // what a micro-batch sends
        assert_eq!(v2.pp_exposed_s, 3.0 * 0.02 / 2.0);
        // no PP: nothing to send
        let flat = step_time(&StepInput { pp: 1, pp_sends_bytes: 0.0, ..i.clone() });
        assert_eq!(flat.pp_exposed_s, 0.0);
    }
}
