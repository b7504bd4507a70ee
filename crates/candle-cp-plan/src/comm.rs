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
mod tests {
    use super::*;
    use crate::layout::CpKind;
    use crate::MIB;

    const S: usize = 131072;

    fn ctx<'a>(m: &'a ModelConfig, l: &'a Layout, hw: &'a Hardware) -> CommCtx<'a> {
        CommCtx {
            model: m,
            layout: l,
            hw,
            seq: S,
            micro_batch: 1,
            elem: 2,
            grad_elem: 2,
            attn_rate: 600e12,
            doc_len: None,
        }
    }

    #[test]
    fn ring_405b_cp16() {
        let m = ModelConfig::preset("llama3-405b").unwrap();
        let hw = Hardware::preset("h100").unwrap();
        let l = Layout {
            cp: 16,
            ..Layout::default()
        };
        let r = ring(&ctx(&m, &l, &hw), 16, 1);
        assert_eq!(r.chunk_tokens, 8192);
        // K+V per token 2·8·128·2 = 4096 B; 8192 tokens: 32 MiB.
        assert_eq!(r.step_bytes, 32.0 * MIB);
        assert_eq!(r.fwd_bytes_per_layer, 480.0 * MIB);
        assert_eq!(r.bwd_bytes_per_layer, 15.0 * 32.0 * MIB + 16.0 * 32.0 * MIB);
        // Half a c×c block: 2·c²·d·a = 2.2 TFLOP.
        assert_eq!(r.step_flops_fwd, 2.0 * 8192f64.powi(2) * 128.0 * 128.0);
        assert!((r.step_flops_fwd / 1e12 - 2.2).abs() < 0.005);
        // c ≥ R/(8·BW): 1500 tokens on IB at 600 TFLOP/s, 167 on NVLink.
        assert!(
            (r.min_chunk_fwd_ib - 1500.0).abs() < 1e-6,
            "{}",
            r.min_chunk_fwd_ib
        );
        assert!((r.min_chunk_fwd_nvlink - 600e12 / (8.0 * 450e9)).abs() < 1e-9);
        assert_eq!(r.link, Link::Ib);
        assert!(r.hides_fwd && r.hides_bwd);
        assert_eq!(r.exposed_s_per_layer, 0.0);
        assert_eq!(r.contiguous_imbalance, 31.0 / 16.0);
        // With TP8: 4 MiB per step, 0.275 TFLOP per step, same minimum chunk.
        let l8 = Layout {
            tp: 8,
            cp: 16,
            ..Layout::default()
        };
        let r8 = ring(&ctx(&m, &l8, &hw), 16, 1);
        assert_eq!(r8.step_bytes, 4.0 * MIB);
        assert!((r8.step_flops_fwd / 1e12 - 0.275).abs() < 0.001);
        assert!((r8.min_chunk_fwd_ib - 1500.0).abs() < 1e-6);
        // Chunk 1024 < 1500 on IB: does not hide; exposed = 15·(transfer - compute) fwd.
        let short = CommCtx {
            seq: 16384,
            ..ctx(&m, &l8, &hw)
        };
        let rs = ring(&short, 16, 1);
        assert!(!rs.hides_fwd);
        let fwd_gap = rs.step_transfer_s_fwd - rs.step_compute_s_fwd;
        let bwd_gap = (rs.step_transfer_s_bwd - rs.step_compute_s_bwd).max(0.0);
        assert!((rs.exposed_s_per_layer - 15.0 * (fwd_gap + bwd_gap)).abs() < 1e-15);
        // fp32 dK/dV: backward moves step·(1 + 4/2), min chunk (2+4)/2.5 vs 2.
        let g4 = CommCtx {
            grad_elem: 4,
            ..ctx(&m, &l8, &hw)
        };
        let r4 = ring(&g4, 16, 1);
        assert_eq!(r4.bwd_bytes_per_layer, 15.0 * 4.0 * MIB + 16.0 * 8.0 * MIB);
        assert!((r4.min_chunk_bwd_ib - 1500.0 * 6.0 / 5.0).abs() < 1e-6);
    }

    #[test]
    fn ulysses_and_allgather_bytes() {
        let m = ModelConfig::preset("llama3-405b").unwrap();
        let hw = Hardware::preset("h100").unwrap();
        // TP1, U = 8: (h + h_kv)/(P·h_kv) = 17/8 of the ring's bytes.
        let l = Layout {
            cp: 8,
            cp_kind: CpKind::Ulysses,
            ..Layout::default()
        };
        let u = ulysses(&ctx(&m, &l, &hw), 8);
        assert!(u.valid);
        assert!((u.ratio_vs_ring_fwd - 17.0 / 8.0).abs() < 1e-12);
        let c = (S / 8) as f64;
        assert_eq!(
            u.fwd_bytes_per_layer,
            7.0 / 8.0 * c * 2.0 * 2.0 * (16384.0 + 1024.0)
        );
        assert_eq!(u.link, Link::Nvlink);
        // TP8 leaves 1 KV head per rank: U = 16 replicates it 16 times.
        let l = Layout {
            tp: 8,
            cp: 16,
            cp_kind: CpKind::Ulysses,
            ..Layout::default()
        };
        let u = ulysses(&ctx(&m, &l, &hw), 16);
        assert!(u.valid && u.kv_replication == 16);
        // regathered head layout: the backward sends the forward's bytes once more
        let lr = Layout { regather_heads: true, ..l.clone() };
        let ur = ulysses(&ctx(&m, &lr, &hw), 16);
        assert_eq!(ur.fwd_bytes_per_layer, u.fwd_bytes_per_layer);
        assert_eq!(ur.bwd_bytes_per_layer, u.bwd_bytes_per_layer + u.fwd_bytes_per_layer);
        assert!(ur.exposed_s_per_layer > u.exposed_s_per_layer);
        assert_eq!(
            u.fwd_bytes_per_layer,
            15.0 / 16.0 * 8192.0 * 2.0 * 128.0 * (32.0 + 32.0)
        );
        // Qwen2.5-7B: 28 query / 4 KV heads. U = 7 and 14 neither divide nor are multiples of
        // the 4 KV heads: each is replicated to lcm(4, U) = 28 copies (7 each), 4 or 2 per rank
        let q7 = ModelConfig::preset("qwen2.5-7b").unwrap();
        let lq = Layout { cp: 14, cp_kind: CpKind::Ulysses, ..Layout::default() };
        for (deg, per_rank) in [(7, 4), (14, 2)] {
            let uq = ulysses(&ctx(&q7, &lq, &hw), deg);
            assert!(uq.valid && uq.kv_replication == 7, "{uq:?}");
            assert_eq!(crate::layout::kv_copies_per_ulysses_rank(4, deg), per_rank);
            let frac = (deg - 1) as f64 / deg as f64;
            assert_eq!(uq.fwd_bytes_per_layer, frac * (131072 / 14) as f64 * 2.0 * 128.0 * (2.0 * 28.0 + 2.0 * 28.0));
        }
        assert!(lq.validate(&q7, 14 * 8192).is_ok());
        let bad = ulysses(&ctx(&m, &l, &hw), 32);
        assert!(
            !bad.valid
                && bad
                    .constraint
                    .contains("does not divide the 16 query heads")
        );
        // All-gather moves what the ring moves, at once.
        let a = allgather(&ctx(&m, &l, &hw));
        assert_eq!(a.fwd_bytes_per_layer, 15.0 * 4.0 * MIB);
        assert_eq!(a.gathered_kv_bytes, S as f64 * 2.0 * 128.0 * 2.0);
        assert_eq!(a.exposed_s_per_layer, 2.0 * 60.0 * MIB / 50e9);
        // TP8 with SP: 4·7/8·c·h·e per direction on NVLink.
        let t = tp(&ctx(&m, &l, &hw));
        assert_eq!(t.fwd_bytes_per_layer, 3.5 * 8192.0 * 16384.0 * 2.0);
        assert_eq!(t.link, Link::Nvlink);
    }

    #[test]
    fn two_d_ring_part() {
        let m = ModelConfig::preset("llama3-405b").unwrap();
        let hw = Hardware::preset("h100").unwrap();
        // TP1, CP16 = Ulysses 8 (NVLink) x ring 2: ring chunk s/2, 16 q heads, 1 kv head.
        let l = Layout {
            cp: 16,
            cp_kind: CpKind::TwoD,
            ulysses: 8,
            ..Layout::default()
        };
        let r = ring(&ctx(&m, &l, &hw), 2, 8);
        assert_eq!((r.chunk_tokens, r.q_heads, r.kv_heads), (65536, 16, 1));
        assert_eq!(r.step_bytes, 65536.0 * 2.0 * 128.0 * 2.0);
        assert_eq!(r.link, Link::Ib);
        assert_eq!(ulysses(&ctx(&m, &l, &hw), 8).link, Link::Nvlink);
    }

    /// The EP exchange: Qwen3-30B-A3B (every layer sparse, top 8, h 2048) at 128k over CP 8,
    /// EP 8 sends `2·7/8·c·K·h·e` = 896 MiB each way per layer, in a node at TP 1 and across
    /// nodes at TP 2; nothing with EP 1 or a dense model. The layout refuses EP that divides
    /// neither the experts nor dp·cp, and EP on a dense model, by name. ZeRO splits the
    /// experts' Adam state over the `dp·cp/ep` ranks holding them.
    #[test]
    fn ep_bytes_and_refusals() {
        let m = ModelConfig::preset("qwen3-30b-a3b").unwrap();
        let hw = Hardware::preset("h100").unwrap();
        let l = Layout { cp: 8, cp_kind: CpKind::Ring, ep: 8, zero: 0, ..Layout::default() };
        let x = ep(&ctx(&m, &l, &hw));
        assert_eq!(x.fwd_bytes_per_layer, 2.0 * 7.0 / 8.0 * 16384.0 * 8.0 * 2048.0 * 2.0);
        assert_eq!(x.fwd_bytes_per_layer, 896.0 * MIB);
        assert_eq!((x.bwd_bytes_per_layer, x.link), (x.fwd_bytes_per_layer, Link::Nvlink));
        assert_eq!(ep(&ctx(&m, &Layout { tp: 2, ..l.clone() }, &hw)).link, Link::Ib);
        assert_eq!(ep(&ctx(&m, &Layout { ep: 1, ..l.clone() }, &hw)).fwd_bytes_per_layer, 0.0);
        assert!(l.validate(&m, S).is_ok());
        let e = |l: Layout, m: &ModelConfig| format!("{:?}", l.validate(m, S).unwrap_err());
        assert!(e(Layout { ep: 3, cp: 6, ..l.clone() }, &m).contains("does not divide the 128 experts"));
        assert!(e(Layout { ep: 16, ..l.clone() }, &m).contains("does not divide dp·cp = 8"));
        let dense = ModelConfig::preset("llama3-8b").unwrap();
        assert!(e(l.clone(), &dense).contains("needs a mixture of experts"));
        // ZeRO-1 with EP 8 over dp·cp 16: the dense parameters' Adam state over the 16, the
        // experts' over the 2 ranks holding the same experts; with EP 16 whole
        let z = Layout { dp: 2, zero: 1, ..l.clone() };
        let st = crate::memory::model_states(&m, &z, 2);
        let ex = m.layers as f64 * crate::memory::layer_expert_params_per_gpu(&m, &z);
        assert_eq!(ex, 48.0 * 3.0 * 2048.0 * 768.0 * 128.0 / 8.0);
        assert!((st.optimizer - ((st.params - ex) * 12.0 / 16.0 + ex * 12.0 / 2.0)).abs() < 1.0, "{st:?}");
        let z16 = Layout { ep: 16, ..z.clone() };
        let (st, ex) = (crate::memory::model_states(&m, &z16, 2), ex / 2.0);
        assert!((st.optimizer - ((st.params - ex) * 12.0 / 16.0 + ex * 12.0)).abs() < 1.0, "{st:?}");
    }
}
