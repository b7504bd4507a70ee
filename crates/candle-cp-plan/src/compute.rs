//! FLOP counts per layer: linear layers and causal attention (optionally with a sliding
//! window and/or packed documents), forward and backward.

use crate::layout::{Layout, Recompute};
use crate::model::ModelConfig;
use crate::packed::{self, effective_doc_len};
use crate::window::{effective_window, visible_pairs};
use serde::Serialize;

/// FLOPs of one layer for one micro-batch of `b` sequences of `s` tokens.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerFlops {
    /// Linear layers, forward: `2·s·b·(2·h·a·d + 2·h·a_kv·d + 3·h·f)` (2 FLOP per MAC).
    pub linear_fwd: f64,
    /// Linear backward: `2 ×` forward (input and weight gradients).
    pub linear_bwd: f64,
    /// Causal attention forward: half of `4·s²·b·a·d` (QKᵀ and PV) = `2·s²·b·a·d`
    /// (`2·s²·h` for Llama, where `a·d = h`). With a sliding window `w < s`:
    /// `4·b·a·d·(s·w − w·(w−1)/2)` (the visible pairs, [`crate::window::visible_pairs`]).
    /// With packed documents: the pairs inside each document (see `doc_len`).
    pub attention_fwd: f64,
    /// The causal forward without the window or documents, `2·s²·b·a·d` (equals
    /// `attention_fwd` when neither applies), for comparison.
    pub attention_fwd_causal: f64,
    /// The sliding window applied (`None` without one, or when it is at least `s`).
    pub window: Option<usize>,
    /// Length `L` of the packed documents applied (`None` without, or when `L ≥ s`); the
    /// forward is then `4·b·a·d·Σ_docs P(len, w)` ([`crate::packed::visible_pairs`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub doc_len: Option<usize>,
    /// Attention backward: `2.5 ×` forward (dV, dP, dQ, dK and the recomputed QKᵀ).
    pub attention_bwd: f64,
    /// Forward re-run in backward: full recompute reruns the whole layer forward.
    pub recompute: f64,
    /// Output projection (logits) forward for the whole model: `2·s·b·h·v`.
    pub logits_fwd: f64,
    /// Per GPU, forward + backward + recompute of one layer: all terms over `t·cp`
    /// (TP splits matrices and heads; zigzag CP balances the causal work).
    pub per_gpu_fwd_bwd: f64,
}

/// Computes [`LayerFlops`] for global sequence `s`, micro-batch `b` (the model's
/// `sliding_window`, if shorter than `s`, limits the attention pairs).
pub fn layer_flops(m: &ModelConfig, l: &Layout, s: usize, b: usize) -> LayerFlops {
    layer_flops_packed(m, l, s, b, None)
}

/// [`layer_flops`] for a sequence packed with documents of `doc_len` tokens (attention inside
/// each document, the model's window inside each document); `None` or `L ≥ s` is exactly
/// [`layer_flops`].
pub fn layer_flops_packed(
    m: &ModelConfig,
    l: &Layout,
    s: usize,
    b: usize,
    doc_len: Option<usize>,
) -> LayerFlops {
    let (sf, bf) = (s as f64, b as f64);
    // (a mixture of experts: the router and the K experts each token goes through)
    let linear_fwd = 2.0 * sf * bf * m.layer_active_matrix_params();
    let attention_fwd_causal = 2.0 * sf * sf * bf * m.q_dim() as f64;
    let window = effective_window(m.sliding_window, s);
    let doc_len = effective_doc_len(doc_len, s);
    let attention_fwd = match (window, doc_len) {
        (None, None) => attention_fwd_causal,
        (Some(w), None) => 4.0 * visible_pairs(s, Some(w)) * bf * m.q_dim() as f64,
        (w, Some(d)) => 4.0 * packed::visible_pairs(s, Some(d), w) * bf * m.q_dim() as f64,
    };
    let linear_bwd = 2.0 * linear_fwd;
    let attention_bwd = 2.5 * attention_fwd;
    let recompute = if l.recompute == Recompute::Full {
        linear_fwd + attention_fwd
    } else {
        0.0
    };
    let split = (l.tp * l.cp) as f64;
    LayerFlops {
        linear_fwd,
        linear_bwd,
        attention_fwd,
        attention_fwd_causal,
        window,
        doc_len,
        attention_bwd,
        recompute,
        logits_fwd: 2.0 * sf * bf * (m.hidden * m.output_width()) as f64,
        per_gpu_fwd_bwd: (linear_fwd + linear_bwd + attention_fwd + attention_bwd + recompute)
            / split,
    }
}

/// Seconds one GPU spends on one layer (forward + backward + recompute), linear layers at
/// `linear_rate` and attention at `attn_rate` FLOP/s: returns (linear, attention).
pub fn layer_compute_seconds(
    f: &LayerFlops,
    l: &Layout,
    linear_rate: f64,
    attn_rate: f64,
) -> (f64, f64) {
    let split = (l.tp * l.cp) as f64;
    let (lin_re, att_re) = if l.recompute == Recompute::Full {
        (f.linear_fwd, f.attention_fwd)
    } else {
        (0.0, 0.0)
    };
    let lin = (f.linear_fwd + f.linear_bwd + lin_re) / split / linear_rate;
    let att = (f.attention_fwd + f.attention_bwd + att_re) / split / attn_rate;
    (lin, att)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_405b_128k() {
        let m = ModelConfig::preset("llama3-405b").unwrap();
        let s = 131072usize;
        let f = layer_flops(&m, &Layout::default(), s, 1);
        // 2·s²·h = 2^49 ≈ 563 TFLOP causal forward attention.
        assert_eq!(f.attention_fwd, 2f64.powi(49));
        assert!(
            (f.attention_fwd / 1e12 - 563.0).abs() < 0.5,
            "{}",
            f.attention_fwd / 1e12
        );
        assert_eq!(f.attention_bwd, 2.5 * f.attention_fwd);
        // Linear: 2·s·(3,187,671,040 matrix params) = 835.6 TFLOP.
        assert_eq!(m.layer_matrix_params(), 3_187_671_040);
        assert_eq!(f.linear_fwd, 2.0 * s as f64 * 3_187_671_040.0);
        assert_eq!(f.linear_bwd, 2.0 * f.linear_fwd);
        let l = Layout {
            tp: 8,
            cp: 16,
            ..Layout::default()
        };
        let g = layer_flops(&m, &l, s, 1);
        assert_eq!(
            g.per_gpu_fwd_bwd,
            (3.0 * f.linear_fwd + 3.5 * f.attention_fwd) / 128.0
        );
        let full = Layout {
            recompute: Recompute::Full,
            ..l.clone()
        };
        let g = layer_flops(&m, &full, s, 1);
        assert_eq!(
            g.per_gpu_fwd_bwd,
            (4.0 * f.linear_fwd + 4.5 * f.attention_fwd) / 128.0
        );
        let (lin, att) = layer_compute_seconds(&layer_flops(&m, &l, s, 1), &l, 1e15, 5e14);
        assert_eq!(lin, 3.0 * f.linear_fwd / 128.0 / 1e15);
        assert_eq!(att, 3.5 * f.attention_fwd / 128.0 / 5e14);
    }
}
