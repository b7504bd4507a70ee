//! A window on some layers only ([`ModelConfig::partial_window`]: Gemma 3 slides on five layers
//! of six, Qwen2 / Qwen3 from `max_window_layers` on, any `layer_types`): the planner prices the
//! two kinds of layer apart and averages them over the model.
//!
//! - The `L − n` full layers are planned as without a window: causal attention, the zigzag ring.
//! - The `n` sliding layers (window `w < s`): their attention FLOPs are the window's
//!   (`4·b·a·d·(s·w − w·(w−1)/2)`, [`crate::window::visible_pairs`]); Ulysses and all-gather KV
//!   move the same bytes as a full layer; on a ring they share the full layers' sequence layout,
//!   zigzag (candle-cp's model uses one layout for every layer), on which the K/V still rotate
//!   the whole ring ([`crate::comm::ring_full`]: `R − 1` hops for a window's worth of work, so
//!   their transfers are the first to be exposed). A window on every layer is planned on
//!   contiguous shards instead (a halo, [`crate::window`]).
//! - Per layer: [`crate::plan::LayerTime`] is the average of the two kinds,
//!   `((L − n)·t_full + n·t_sliding) / L`, and so are the model FLOPs of the step. With PP the
//!   busiest stage is priced at that average too (its own mix of kinds may differ by a layer).
//!
//! ```text
//!   zigzag, R = 4, window w ≤ c: rank 1 holds chunks 1 and 6 of 8
//!   step   0        1          2        3
//!   K/V    own      rank 0's   rank 3's rank 2's
//!   work   both     chunk 0    none     chunk 7
//!          chunks   → chunk 1           → chunk 6
//! ```

use crate::comm::{self, CommCtx, RingComm};
use crate::compute::{layer_compute_seconds, layer_flops_packed, LayerFlops};
use crate::layout::CpKind;
use crate::model::ModelConfig;
use crate::window::effective_window;
use serde::Serialize;

/// The sliding layers of a model with a window on some layers only.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlidingLayers {
    /// The window `w` (shorter than the sequence).
    pub window: usize,
    /// Layers with the window, `n` (the other `L − n` attend causally).
    pub layers: usize,
    /// FLOPs of one sliding layer.
    pub flops: LayerFlops,
    /// The ring of one sliding layer: zigzag's full ring with the window's work
    /// ([`crate::comm::ring_full`]; the ring part for 2-D, a ring over `cp` for comparison
    /// otherwise).
    pub ring: RingComm,
    /// Attention of one sliding layer on one GPU, forward + backward (+ recompute), s.
    pub attention_s: f64,
    /// CP communication of one sliding layer not hidden behind compute, s.
    pub cp_exposed_s: f64,
}

/// The window and sliding-layer count a sequence of `s` tokens sees: `Some((w, n))` for
/// [`ModelConfig::partial_window`] `(w, n)` with `w < s` and `0 < n`; `None` otherwise (no
/// window on some layers only, or one at least as long as the sequence: every layer causal).
pub fn effective_partial(m: &ModelConfig, s: usize) -> Option<(usize, usize)> {
    let (w, n) = m.partial_window?;
    Some((effective_window(Some(w), s)?, n)).filter(|&(_, n)| n > 0)
}

/// The sliding layers' numbers for the plan of `cx` (micro-batch `b`, linear and attention
/// rates, the CP exposure of Ulysses / all-gather KV per layer, which the window leaves as
/// they are); `None` without a window on some layers only ([`effective_partial`]).
pub fn sliding_layers(cx: &CommCtx, linear_rate: f64, ulysses_exposed_s: f64, allgather_exposed_s: f64) -> Option<SlidingLayers> {
    let (m, l) = (cx.model, cx.layout);
    let (window, layers) = effective_partial(m, cx.seq)?;
    let sm = ModelConfig { sliding_window: Some(window), partial_window: None, ..m.clone() };
    let scx = CommCtx { model: &sm, ..cx.clone() };
    let flops = layer_flops_packed(&sm, l, cx.seq, cx.micro_batch, cx.doc_len);
    let ring = match l.cp_kind {
        CpKind::TwoD => comm::ring_full(&scx, l.ring_degree(), l.ulysses),
        _ => comm::ring_full(&scx, l.cp, 1),
    };
    let (_, attention_s) = layer_compute_seconds(&flops, l, linear_rate, cx.attn_rate);
    let cp_exposed_s = match l.cp_kind {
        CpKind::Ring => ring.exposed_s_per_layer,
        CpKind::Allgather => allgather_exposed_s,
        CpKind::Ulysses => ulysses_exposed_s,
        CpKind::TwoD => ring.exposed_s_per_layer + ulysses_exposed_s,
    };
    Some(SlidingLayers { window, layers, flops, ring, attention_s, cp_exposed_s })
}

/// `full` and `sliding` weighted by their layer counts: `((L − n)·full + n·sliding) / L`.
pub fn average(layers: usize, sliding: &SlidingLayers, full: f64, slide: f64) -> f64 {
    let f = sliding.layers.min(layers) as f64 / layers.max(1) as f64;
    (1.0 - f) * full + f * slide
}

/// The per-layer FLOPs averaged over the model: the full layers' `full` with its attention
/// terms (and what full recompute reruns of them) averaged with the sliding layers' by layer
/// count; the linear terms are the same on both.
pub fn average_flops(layers: usize, full: &LayerFlops, sliding: &SlidingLayers) -> LayerFlops {
    let s = &sliding.flops;
    let avg = |a: f64, b: f64| average(layers, sliding, a, b);
    LayerFlops {
        attention_fwd: avg(full.attention_fwd, s.attention_fwd),
        attention_bwd: avg(full.attention_bwd, s.attention_bwd),
        recompute: avg(full.recompute, s.recompute),
        per_gpu_fwd_bwd: avg(full.per_gpu_fwd_bwd, s.per_gpu_fwd_bwd),
        window: None,
        ..full.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Hardware, Layout};

    /// Gemma-like: a window on 40 of 48 layers at 128k over a zigzag ring of 8 (chunks of
    /// 8192): the sliding layers' attention is the window's; a window of 1024 is a halo
    /// exchange of 1023 rows with both neighbours, one of 10000 keeps the full ring (7 hops);
    /// the averages weigh the two kinds 8 : 40.
    #[test]
    fn sliding_layers_of_a_mixed_model() {
        let mut m = ModelConfig::preset("llama3-8b").unwrap();
        m.layers = 48;
        let s = 131072;
        // one GPU per node: the ring on InfiniBand
        let hw = Hardware { gpus_per_node: 1, ..Hardware::preset("h100").unwrap() };
        let l = Layout { cp: 8, ..Layout::default() };
        let far = ModelConfig { partial_window: Some((10000, 40)), ..m.clone() };
        let cx = CommCtx { model: &far, layout: &l, hw: &hw, seq: s, micro_batch: 1, elem: 2, grad_elem: 4, attn_rate: 4e14, doc_len: None };
        let wide = sliding_layers(&cx, 6e14, 0.0, 0.0).unwrap();
        assert_eq!((wide.ring.halo_rows, wide.ring.hops, wide.ring.active_steps, wide.ring.dkv_transfers), (None, 7, 8, 8));
        let full = comm::ring(&cx, 8, 1);
        assert_eq!((wide.ring.step_bytes, wide.ring.fwd_bytes_per_layer), (full.step_bytes, full.fwd_bytes_per_layer));
        // the window's work per step: the rank's share spread over the 8 steps
        assert!((wide.ring.step_flops_fwd - wide.flops.attention_fwd / 8.0 / 8.0).abs() < 1e-3 * wide.ring.step_flops_fwd);
        assert!(wide.ring.exposed_s_per_layer > full.exposed_s_per_layer);
        m.partial_window = Some((1024, 40));
        let cx = CommCtx { model: &m, ..cx };
        let sl = sliding_layers(&cx, 6e14, 0.0, 0.0).unwrap();
        assert_eq!((sl.window, sl.layers), (1024, 40));
        let (sf, w) = (s as f64, 1024.0);
        assert_eq!(sl.flops.attention_fwd, 4.0 * (sf * w - w * (w - 1.0) / 2.0) * m.q_dim() as f64);
        // the halo: 1023 rows of the 8 KV heads of 128, bf16, to each neighbour, and back
        let rows = 1023.0 * 2.0 * 8.0 * 128.0 * 2.0;
        assert_eq!((sl.ring.halo_rows, sl.ring.hops, sl.ring.active_steps, sl.ring.dkv_transfers), (Some(1023), 1, 1, 2));
        assert_eq!((sl.ring.fwd_bytes_per_layer, sl.ring.bwd_bytes_per_layer), (2.0 * rows, 2.0 * rows));
        assert!(sl.ring.exposed_s_per_layer < wide.ring.exposed_s_per_layer / 50.0, "{} vs {}", sl.ring.exposed_s_per_layer, wide.ring.exposed_s_per_layer);
        let f = layer_flops_packed(&ModelConfig { partial_window: None, ..m.clone() }, &l, s, 1, None);
        let a = average_flops(48, &f, &sl);
        assert!((a.attention_fwd - (8.0 * f.attention_fwd + 40.0 * sl.flops.attention_fwd) / 48.0).abs() < 1e-6 * a.attention_fwd);
        assert_eq!((a.linear_fwd, a.window), (f.linear_fwd, None));
        // a window at least the sequence, or on no layer: every layer causal
        assert!(effective_partial(&ModelConfig { partial_window: Some((s, 40)), ..m.clone() }, s).is_none());
        assert!(effective_partial(&ModelConfig { partial_window: Some((1024, 0)), ..m.clone() }, s).is_none());
    }
}
