//! Communication arithmetic per layer: ring K/V rotation and its overlap with attention,
//! Ulysses all-to-all, all-gather-KV, and the TP/SP collectives.
//!
//! All byte counts are what one GPU *sends* per layer for one micro-batch; times are
//! `bytes / link bandwidth` with the link each group spans (ranks ordered TP fastest, then
//! the Ulysses part of CP, then the ring part).

use crate::hardware::{Hardware, Link};
use crate::layout::{check_ulysses, Layout};
use crate::model::ModelConfig;
use crate::packed::{self, effective_doc_len};
use crate::window::{accumulator_transfers, effective_window};
use serde::Serialize;

/// Inputs shared by the communication formulas.
#[derive(Debug, Clone)]
pub struct CommCtx<'a> {
    /// Model shape.
    pub model: &'a ModelConfig,
    /// Layout.
    pub layout: &'a Layout,
    /// Hardware (links).
    pub hw: &'a Hardware,
    /// Global sequence length `s`.
    pub seq: usize,
    /// Micro-batch `b`.
    pub micro_batch: usize,
    /// Bytes per activation element `e`.
    pub elem: usize,
    /// Bytes per dK/dV element `g` in the backward (`e`, or 4 with fp32 accumulation).
    pub grad_elem: usize,
    /// Achieved attention FLOP/s used for the overlap check.
    pub attn_rate: f64,
    /// Length `L` of packed documents (`None`: one document; `L ≥ s` is the same), see
    /// [`crate::packed`].
    pub doc_len: Option<usize>,
}

/// Ring attention over `R` ranks: zigzag (full ring) without a window or documents; with a
/// sliding window `w < s` and/or packed documents of `L < s` tokens, contiguous shards and a
/// halo of `h` hops (see [`crate::window`], [`crate::packed`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RingComm {
    /// Ring degree `R` (`cp`, or `cp/U` in 2-D).
    pub degree: usize,
    /// Sliding window modelled (`None`: causal, zigzag full ring; a window `≥ s` is none).
    pub window: Option<usize>,
    /// With a window of `w − 1 ≤` one chunk: the halo exchange of `m = w − 1` K/V rows with
    /// the neighbours that replaces the ring (`candle_cp_ops::cp::halo`); the byte and time
    /// fields below are then the exchange's (`hops` 1, `active_steps` 1, nothing hidden).
    /// `None`: the ring.
    pub halo_rows: Option<usize>,
    /// Packed document length modelled (`None`: one document; `L ≥ s` is none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub doc_len: Option<usize>,
    /// K/V hops per pass: `R-1` without a window or documents; with them
    /// `h = min(R-1, ceil((m-1)/c))`, `m = min(L, w)`, on contiguous shards (an upper bound
    /// over where document boundaries fall, see [`crate::packed::ring_hops`]).
    pub hops: usize,
    /// Steps with attention work: `h + 1`.
    pub active_steps: usize,
    /// dK/dV accumulator transfers in the backward: `h` along the ring + 1 home = `h + 1`
    /// (`R` for the full ring; 0 when `h = 0`).
    pub dkv_transfers: usize,
    /// Tokens per ring rank `c = s/R` (for 2-D: after the Ulysses all-to-all).
    pub chunk_tokens: usize,
    /// Query heads per rank during the ring (`a / (t·U)`).
    pub q_heads: usize,
    /// KV heads per rank during the ring (`max(a_kv / (t·U), 1)`).
    pub kv_heads: usize,
    /// Link the ring spans.
    pub link: Link,
    /// K+V bytes moved per step: `c·b·2·a_kv,r·d·e`.
    pub step_bytes: f64,
    /// Forward bytes per layer: `h·step` (`(R-1)·step` without a window).
    pub fwd_bytes_per_layer: f64,
    /// Backward bytes per layer: `h·step` (K/V again) + `(h+1)·step·g/e` (dK/dV home);
    /// without a window `(R-1)·step + R·step·g/e`.
    pub bwd_bytes_per_layer: f64,
    /// Attention FLOPs per forward step. Without a window (zigzag: half a `c×c` block):
    /// `2·c²·b·d·a_r`. With a window: the rank's windowed attention FLOPs spread evenly over
    /// the active steps, `4·b·d·a_r·(s·w − w·(w−1)/2) / R / (h+1)` (an average: on
    /// contiguous shards the diagonal step does more, the last hop less). With packed
    /// documents the same with the packed pairs `Σ_docs P(len, w)` in place of the windowed
    /// ones: the compute per step falls with the documents, the bytes per step do not.
    pub step_flops_fwd: f64,
    /// Forward step compute time at the attention rate, s.
    pub step_compute_s_fwd: f64,
    /// Forward step transfer time on the ring's link, s.
    pub step_transfer_s_fwd: f64,
    /// Whether the forward transfer hides behind compute.
    pub hides_fwd: bool,
    /// Backward step compute (`2.5 ×` forward), s.
    pub step_compute_s_bwd: f64,
    /// Backward step transfer (K/V + dK/dV: `step·(1 + g/e)`), s.
    pub step_transfer_s_bwd: f64,
    /// Whether the backward transfer hides.
    pub hides_bwd: bool,
    /// Smallest chunk that hides the forward on NVLink: `a_kv,r·e·R_attn/(a_r·BW)` tokens.
    pub min_chunk_fwd_nvlink: f64,
    /// Same on InfiniBand.
    pub min_chunk_fwd_ib: f64,
    /// Smallest chunk that hides the backward on NVLink: `a_kv,r·(e+g)·R_attn/(2.5·a_r·BW)`.
    pub min_chunk_bwd_nvlink: f64,
    /// Same on InfiniBand.
    pub min_chunk_bwd_ib: f64,
    /// Transfer time not hidden, per layer (forward + backward), s:
    /// `h·(max(0, transfer − compute)_fwd + max(0, transfer − compute)_bwd)`.
    pub exposed_s_per_layer: f64,
    /// Busiest/mean causal work with a contiguous split: `(2R-1)/R` without a window (zigzag
    /// balances it to 1); with a window the exact windowed ratio, close to 1
    /// ([`crate::window::contiguous_imbalance`]); with packed documents the exact ratio for
    /// documents placed from position 0 ([`crate::packed::contiguous_imbalance`]).
    pub contiguous_imbalance: f64,
}

/// Ring over the CP group's ring part; `u` is the Ulysses degree in front of it (1 for a
/// plain ring). The model's sliding window, if shorter than `s`, and packed documents
/// (`cx.doc_len`), if shorter than `s`, make it a halo exchange.
pub fn ring(cx: &CommCtx, r: usize, u: usize) -> RingComm {
    ring_with(cx, r, u, false)
}

/// [`ring`] on zigzag shards whatever the window: the window's layers of a model whose other
/// layers attend causally (a window on some layers only, [`crate::partial`]) share the layout
/// those need, zigzag, where every rank's two chunks border chunks of ranks all around the ring:
/// the K/V rotate the full ring (`R-1` hops, `R` dK/dV transfers) while the window's work
/// (`4·b·d·a_r·(s·w − w·(w−1)/2) / R` FLOPs per rank) is spread over the `R` steps (an
/// average: it falls on the steps that bring a neighbouring chunk).
pub fn ring_full(cx: &CommCtx, r: usize, u: usize) -> RingComm {
    ring_with(cx, r, u, true)
}

/// The window's halo exchange in place of the ring (`candle_cp_ops::cp::halo`, what
/// `ring_attention` runs by default): with a window whose `m = w − 1` keys before a query reach
/// at most one chunk back (`T/(2R)` on zigzag shards, `rg` from [`ring_full`]; `T/R` contiguous),
/// each rank exchanges the `m` K/V rows before each of its chunks with its neighbours (zigzag:
/// both, contiguous: the previous one), then attends in one local call; the backward sends the
/// halo rows' dK/dV back the same way (in the activation dtype). Bytes per direction
/// `m·b·2·a_kv,r·d·e`, forward and backward; nothing overlaps them (the call needs the rows).
/// `None` where it does not apply (no window, or one reaching further back). The ring part of
/// 2-D runs it too (`candle_cp_ops::usp`).
fn halo(cx: &CommCtx, rg: &RingComm, full: bool) -> Option<RingComm> {
    let w = rg.window?;
    let chunk = if full { rg.chunk_tokens / 2 } else { rg.chunk_tokens };
    if rg.degree < 2 || w - 1 > chunk {
        return None;
    }
    let m = w - 1;
    let dirs = if full { 2.0 } else { 1.0 };
    let bw = rg.link.bandwidth(cx.hw);
    let step_bytes = m as f64 * cx.micro_batch as f64 * 2.0 * rg.kv_heads as f64 * cx.model.head_dim as f64 * cx.elem as f64;
    let bytes = dirs * step_bytes;
    let flops = rg.step_flops_fwd * rg.active_steps as f64; // the rank's whole windowed forward
    Some(RingComm {
        halo_rows: Some(m),
        hops: usize::from(m > 0),
        active_steps: 1,
        dkv_transfers: if m > 0 { dirs as usize } else { 0 },
        step_bytes,
        fwd_bytes_per_layer: bytes,
        bwd_bytes_per_layer: bytes,
        step_flops_fwd: flops,
        step_compute_s_fwd: flops / cx.attn_rate,
        step_transfer_s_fwd: bytes / bw,
        hides_fwd: m == 0,
        step_compute_s_bwd: 2.5 * flops / cx.attn_rate,
        step_transfer_s_bwd: bytes / bw,
        hides_bwd: m == 0,
        exposed_s_per_layer: 2.0 * bytes / bw,
        ..rg.clone()
    })
}

fn ring_with(cx: &CommCtx, r: usize, u: usize, full: bool) -> RingComm {
    let rg = ring_of(cx, r, u, full);
    halo(cx, &rg, full).unwrap_or(rg)
}

fn ring_of(cx: &CommCtx, r: usize, u: usize, full: bool) -> RingComm {
    let (m, l, hw) = (cx.model, cx.layout, cx.hw);
    let q_heads = (m.heads / l.tp / u).max(1);
    let kv_heads = crate::layout::kv_copies_per_ulysses_rank(l.kv_heads_per_tp_rank(m), u);
    let c = cx.seq / r;
    let (cf, bf, d, e, g) = (
        c as f64,
        cx.micro_batch as f64,
        m.head_dim as f64,
        cx.elem as f64,
        cx.grad_elem as f64,
    );
    let link = Link::for_group(l.tp * u, r, hw);
    let bw = link.bandwidth(hw);
    let step_bytes = cf * bf * 2.0 * kv_heads as f64 * d * e;
    let window = effective_window(m.sliding_window, cx.seq);
    let doc_len = effective_doc_len(cx.doc_len, cx.seq);
    let hops = if full { r.saturating_sub(1) } else { packed::ring_hops(cx.seq, r, doc_len, window) };
    let dkv_transfers = accumulator_transfers(hops);
    let steps = hops as f64;
    let step_flops_fwd = if window.is_none() && doc_len.is_none() {
        2.0 * cf * cf * bf * d * q_heads as f64
    } else {
        let pairs = packed::visible_pairs(cx.seq, doc_len, window);
        let rank = 4.0 * pairs * bf * d * q_heads as f64 / r as f64;
        rank / (hops + 1) as f64
    };
    let step_compute_s_fwd = step_flops_fwd / cx.attn_rate;
    let step_transfer_s_fwd = step_bytes / bw;
    let step_compute_s_bwd = 2.5 * step_compute_s_fwd;
    let step_transfer_s_bwd = step_bytes * (1.0 + g / e) / bw;
    let ratio = kv_heads as f64 / q_heads as f64 * cx.attn_rate;
    let exposed = if r > 1 {
        steps
            * ((step_transfer_s_fwd - step_compute_s_fwd).max(0.0)
                + (step_transfer_s_bwd - step_compute_s_bwd).max(0.0))
    } else {
        0.0
    };
    RingComm {
        degree: r,
        window,
        halo_rows: None,
        doc_len,
        hops,
        active_steps: hops + 1,
        dkv_transfers,
        chunk_tokens: c,
        q_heads,
        kv_heads,
        link,
        step_bytes,
        fwd_bytes_per_layer: steps * step_bytes,
        bwd_bytes_per_layer: if r > 1 {
            steps * step_bytes + dkv_transfers as f64 * step_bytes * g / e
        } else {
            0.0
        },
        step_flops_fwd,
        step_compute_s_fwd,
        step_transfer_s_fwd,
        hides_fwd: step_compute_s_fwd >= step_transfer_s_fwd,
        step_compute_s_bwd,
        step_transfer_s_bwd,
        hides_bwd: step_compute_s_bwd >= step_transfer_s_bwd,
        min_chunk_fwd_nvlink: ratio * e / hw.nvlink_bw,
        min_chunk_fwd_ib: ratio * e / hw.ib_bw,
        min_chunk_bwd_nvlink: ratio * (e + g) / (2.5 * hw.nvlink_bw),
        min_chunk_bwd_ib: ratio * (e + g) / (2.5 * hw.ib_bw),
        exposed_s_per_layer: exposed,
        contiguous_imbalance: packed::contiguous_imbalance(cx.seq, r, doc_len, window),
    }
}

/// Ulysses all-to-all over `U` ranks (exposed: nothing to overlap with).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UlyssesComm {
    /// Degree `U`.
    pub degree: usize,
    /// Whether the head constraint holds for this degree.
    pub valid: bool,
    /// The constraint, or why it fails.
    pub constraint: String,
    /// Each KV head is replicated this many times (`lcm(a_kv,t, U) / a_kv,t`: `U / a_kv,t`
    /// when `a_kv,t` divides `U`, 1 when `U` divides `a_kv,t`).
    pub kv_replication: usize,
    /// Link the all-to-all spans.
    pub link: Link,
    /// Forward bytes sent per layer: `(U-1)/U · c·b·d·(2·a_t·e + 2·max(a_kv,t, U)·e)`
    /// (Q, K, V in; O out), `c = s/cp`.
    pub fwd_bytes_per_layer: f64,
    /// Backward: dO in, dQ out at `e`; dK, dV out at `g`; with
    /// [`crate::Layout::regather_heads`] also Q, K, V and O in again (the forward's bytes).
    pub bwd_bytes_per_layer: f64,
    /// Forward bytes relative to a ring of the same degree on the same tokens.
    pub ratio_vs_ring_fwd: f64,
    /// Transfer time per layer, forward + backward, s (all exposed).
    pub exposed_s_per_layer: f64,
}

/// Ulysses all-to-all of degree `u` on `c = s/cp` local tokens.
pub fn ulysses(cx: &CommCtx, u: usize) -> UlyssesComm {
    let (m, l, hw) = (cx.model, cx.layout, cx.hw);
    let (valid, constraint) = match check_ulysses(m, l.tp, u) {
        Ok(()) => (
            true,
            format!(
                "degree {u} divides the {} query heads per TP rank",
                m.heads / l.tp
            ),
        ),
        Err(e) => (false, e.0),
    };
    let hq = (m.heads / l.tp) as f64;
    let kv_t = l.kv_heads_per_tp_rank(m);
    // KV heads entering the all-to-all, copies included: lcm(kv_t, u)
    let kv_eff = (crate::layout::kv_copies_per_ulysses_rank(kv_t, u) * u) as f64;
    let c = (cx.seq / l.cp) as f64;
    let (bf, d, e, g) = (
        cx.micro_batch as f64,
        m.head_dim as f64,
        cx.elem as f64,
        cx.grad_elem as f64,
    );
    let frac = (u - 1) as f64 / u as f64;
    let link = Link::for_group(l.tp, u, hw);
    let bw = link.bandwidth(hw);
    let fwd = frac * c * bf * d * (2.0 * hq * e + 2.0 * kv_eff * e);
    let regather = if l.regather_heads { fwd } else { 0.0 };
    let bwd = frac * c * bf * d * (2.0 * hq * e + 2.0 * kv_eff * g) + regather;
    let ring_fwd = (u - 1) as f64 * c * bf * 2.0 * kv_t as f64 * d * e;
    UlyssesComm {
        degree: u,
        valid,
        constraint,
        kv_replication: crate::layout::kv_copies_per_ulysses_rank(kv_t, u) * u / kv_t.max(1),
        link,
        fwd_bytes_per_layer: fwd,
        bwd_bytes_per_layer: bwd,
        ratio_vs_ring_fwd: if u > 1 { fwd / ring_fwd } else { 0.0 },
        exposed_s_per_layer: (fwd + bwd) / bw,
    }
}

/// Llama 3 style all-gather of K/V over the CP group (reduce-scatter of dK/dV backward).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllgatherComm {
    /// Degree (`cp`).
    pub degree: usize,
    /// Link the group spans.
    pub link: Link,
    /// Forward bytes sent per layer: `(cp-1)·c·b·2·a_kv,t·d·e` (same total as the ring).
    pub fwd_bytes_per_layer: f64,
    /// Backward (reduce-scatter dK/dV): `(cp-1)·c·b·2·a_kv,t·d·g`.
    pub bwd_bytes_per_layer: f64,
    /// Gathered K/V held during one layer's attention: `s·b·2·a_kv,t·d·e`.
    pub gathered_kv_bytes: f64,
    /// Transfer time per layer, forward + backward, s (exposed: not overlapped).
    pub exposed_s_per_layer: f64,
}

/// All-gather-KV over `cp` ranks.
pub fn allgather(cx: &CommCtx) -> AllgatherComm {
    let (m, l, hw) = (cx.model, cx.layout, cx.hw);
    let kv = (l.kv_heads_per_tp_rank(m) * m.head_dim) as f64;
    let c = (cx.seq / l.cp) as f64;
    let bf = cx.micro_batch as f64;
    let link = Link::for_group(l.tp, l.cp, hw);
    let fwd = (l.cp - 1) as f64 * c * bf * 2.0 * kv * cx.elem as f64;
    let bwd = (l.cp - 1) as f64 * c * bf * 2.0 * kv * cx.grad_elem as f64;
    AllgatherComm {
        degree: l.cp,
        link,
        fwd_bytes_per_layer: fwd,
        bwd_bytes_per_layer: bwd,
        gathered_kv_bytes: cx.seq as f64 * bf * 2.0 * kv * cx.elem as f64,
        exposed_s_per_layer: (fwd + bwd) / link.bandwidth(hw),
    }
}

/// Tensor-parallel collectives per layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TpComm {
    /// Degree `t`.
    pub degree: usize,
    /// Link the group spans.
    pub link: Link,
    /// Forward bytes sent per layer: `4·(t-1)/t·c·b·h·e` (SP: 2 all-gathers + 2
    /// reduce-scatters; without SP: 2 all-reduces, the same volume).
    pub fwd_bytes_per_layer: f64,
    /// Backward: the same volume, plus with SP the two column-parallel inputs all-gathered
    /// again (the forward keeps only their sequence shards, as Megatron-LM does):
    /// `6·(t-1)/t·c·b·h·e` with SP.
    pub bwd_bytes_per_layer: f64,
    /// Transfer time per layer, forward + backward, s (counted as exposed).
    pub exposed_s_per_layer: f64,
}

/// TP/SP collectives on `c = s/cp` tokens.
pub fn tp(cx: &CommCtx) -> TpComm {
    let (m, l, hw) = (cx.model, cx.layout, cx.hw);
    let t = l.tp as f64;
    let c = (cx.seq / l.cp) as f64;
    let fwd = 4.0 * (t - 1.0) / t * c * cx.micro_batch as f64 * m.hidden as f64 * cx.elem as f64;
    let bwd = if l.sp { 1.5 * fwd } else { fwd };
    let link = Link::for_group(1, l.tp, hw);
    TpComm {
        degree: l.tp,
        link,
        fwd_bytes_per_layer: fwd,
        bwd_bytes_per_layer: bwd,
        exposed_s_per_layer: (fwd + bwd) / link.bandwidth(hw),
    }
}

/// Expert-parallel all-to-alls per layer (averaged over the layers: only the sparse ones
/// exchange).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpComm {
    /// Degree `ep`.
    pub degree: usize,
    /// Link the group spans (its ranks `tp` apart).
    pub link: Link,
    /// Forward bytes sent per layer: the routed rows to their experts' ranks and back,
    /// `2·(ep−1)/ep·c·b·K·h·e` on a sparse layer (balanced routing; every TP rank sends its
    /// copy of the rows).
    pub fwd_bytes_per_layer: f64,
    /// Backward: the gradients of the same rows both ways, the forward's volume.
    pub bwd_bytes_per_layer: f64,
    /// Transfer time per layer, forward + backward, s (counted as exposed).
    pub exposed_s_per_layer: f64,
}

/// The EP exchange on `c = s/cp` tokens per rank (zero without experts or with `ep = 1`).
pub fn ep(cx: &CommCtx) -> EpComm {
    let (m, l, hw) = (cx.model, cx.layout, cx.hw);
    let link = Link::for_group(l.tp, l.ep, hw);
    let k = m.moe.as_ref().map_or(0, |x| x.top_k) as f64;
    let ep = l.ep.max(1) as f64;
    let c = (cx.seq / l.cp) as f64;
    let fwd = m.sparse_fraction() * 2.0 * (ep - 1.0) / ep * c * cx.micro_batch as f64 * k * m.hidden as f64 * cx.elem as f64;
    EpComm { degree: l.ep, link, fwd_bytes_per_layer: fwd, bwd_bytes_per_layer: fwd, exposed_s_per_layer: 2.0 * fwd / link.bandwidth(hw) }
}

#[cfg(test)]
#[path = "comm_tests.rs"]
mod tests;
