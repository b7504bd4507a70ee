//! Causal sliding-window arithmetic (Mistral `sliding_window`): query `i` sees keys `j` with
//! `i - w < j <= i`.
//!
//! A window of at least the global sequence length `s` is plain causal attention, and the
//! planner then uses exactly the causal numbers ([`effective_window`] returns `None`). With a
//! window `w < s`:
//! - visible pairs: `s·w − w·(w−1)/2` ([`visible_pairs`]) instead of the causal `s²/2`;
//! - the ring on contiguous shards of `c = s/R` tokens runs `1 + h` steps, `h = min(R−1,
//!   ceil((w−1)/c))` K/V hops ([`halo_hops`]): a halo exchange instead of the full ring;
//! - its backward sends each dK/dV accumulator `h` times along the ring and once more home,
//!   `h + 1` transfers (none when `h = 0`: the accumulator never leaves its owner)
//!   ([`accumulator_transfers`]).

/// The window the planner models for a global sequence of `s` tokens: `window` when it is
/// shorter than `s` (and at least 1), `None` otherwise (a window `≥ s` masks nothing beyond
/// causality).
pub fn effective_window(window: Option<usize>, s: usize) -> Option<usize> {
    window.filter(|&w| w >= 1 && w < s)
}

/// Query–key pairs a causal attention over `s` tokens computes: the planner's causal
/// convention `s²/2` without a window (or with `w ≥ s`), and the exact count
/// `Σ_i min(i+1, w) = s·w − w·(w−1)/2` with a window `w < s`.
pub fn visible_pairs(s: usize, window: Option<usize>) -> f64 {
    let sf = s as f64;
    match effective_window(window, s) {
        None => sf * sf / 2.0,
        Some(w) => {
            let wf = w as f64;
            sf * wf - wf * (wf - 1.0) / 2.0
        }
    }
}

/// Exact visible pairs of the first `n` queries with a window `w`: `n·(n+1)/2` for `n ≤ w`,
/// else `n·w − w·(w−1)/2` (also one document's pairs in [`crate::packed`]).
pub fn prefix_pairs(n: usize, w: usize) -> f64 {
    let (nf, wf) = (n as f64, w as f64);
    if n <= w {
        nf * (nf + 1.0) / 2.0
    } else {
        nf * wf - wf * (wf - 1.0) / 2.0
    }
}

/// K/V hops of the windowed ring over `r` ranks holding contiguous shards of `c` tokens:
/// `h = min(r − 1, ceil((w − 1)/c))` (the ring runs `h + 1` steps). `w − 1 = c` needs one
/// hop, `w − 1 = c + 1` two; `w = 1` none.
pub fn halo_hops(w: usize, c: usize, r: usize) -> usize {
    let full = r.saturating_sub(1);
    w.saturating_sub(1).div_ceil(c.max(1)).min(full)
}

/// dK/dV accumulator transfers in the ring backward after `h` K/V hops: `h` along the ring
/// plus one home, `h + 1`; none when `h = 0` (the full ring: `R`).
pub fn accumulator_transfers(h: usize) -> usize {
    if h == 0 {
        0
    } else {
        h + 1
    }
}

/// Busiest/mean causal work of a contiguous split of `s` tokens over `r` ranks: `(2R−1)/R`
/// without a window (the causal convention); with a window `w < s` the exact
/// `R·(P(s) − P(s − c))/P(s)`, `P(n)` the visible pairs of the first `n` queries (the last
/// rank is the busiest). Close to 1 for `w ≪ s`.
pub fn contiguous_imbalance(s: usize, r: usize, window: Option<usize>) -> f64 {
    match effective_window(window, s) {
        None => (2 * r - 1) as f64 / r as f64,
        Some(w) => {
            let c = s / r.max(1);
            let total = prefix_pairs(s, w);
            r as f64 * (total - prefix_pairs(s - c, w)) / total
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{ring, CommCtx, RingComm};
    use crate::compute::layer_flops;
    use crate::{Hardware, Layout, ModelConfig, MIB};

    /// Brute-force count of `i - w < j <= i` pairs.
    fn brute(s: usize, w: usize) -> f64 {
        (0..s).map(|i| (i + 1).min(w)).sum::<usize>() as f64
    }

    #[test]
    fn pairs_match_brute_force() {
        for (s, w) in [
            (16, 1),
            (16, 4),
            (16, 15),
            (100, 7),
            (1000, 999),
            (4096, 4096),
        ] {
            let want = if w < s {
                brute(s, w)
            } else {
                (s * s) as f64 / 2.0
            };
            assert_eq!(visible_pairs(s, Some(w)), want, "s {s} w {w}");
        }
        // Hand-computed: s = 8, w = 3: 1 + 2 + 3·6 = 21 = 8·3 − 3·2/2.
        assert_eq!(visible_pairs(8, Some(3)), 21.0);
        assert_eq!(visible_pairs(8, None), 32.0);
        // w ≥ s is the causal convention, exactly.
        assert_eq!(visible_pairs(8, Some(8)), visible_pairs(8, None));
        assert_eq!(visible_pairs(8, Some(100)), visible_pairs(8, None));
        assert_eq!(effective_window(Some(8), 8), None);
        assert_eq!(effective_window(Some(7), 8), Some(7));
    }

    #[test]
    fn hops_for_windows_and_shards() {
        // (w, c, R) -> h
        for (w, c, r, h) in [
            (1, 1024, 8, 0),     // the diagonal only
            (1024, 1024, 8, 1),  // w - 1 = c - 1: one neighbour
            (1025, 1024, 8, 1),  // w - 1 = c: exactly one shard back
            (1026, 1024, 8, 2),  // w - 1 = c + 1: one key in the second shard back
            (4096, 16384, 8, 1), // Mistral window, 128k over 8
            (3000, 1024, 8, 3),
            (8193, 1024, 8, 7), // w - 1 = 8·c: capped at R - 1
            (1 << 20, 1024, 8, 7),
            (4096, 4096, 1, 0), // R = 1: no ring
        ] {
            assert_eq!(halo_hops(w, c, r), h, "w {w} c {c} R {r}");
        }
        assert_eq!(accumulator_transfers(0), 0);
        assert_eq!(accumulator_transfers(1), 2);
        assert_eq!(accumulator_transfers(7), 8);
    }

    #[test]
    fn imbalance_with_a_window() {
        assert_eq!(contiguous_imbalance(1024, 8, None), 15.0 / 8.0);
        assert_eq!(contiguous_imbalance(1024, 8, Some(1024)), 15.0 / 8.0);
        // s = 16, R = 4, w = 2: P(16) = 31, the last shard 4·2 = 8: 4·8/31.
        assert_eq!(contiguous_imbalance(16, 4, Some(2)), 32.0 / 31.0);
        assert_eq!(brute(16, 2), 31.0);
    }

    fn mistral(window: Option<usize>) -> ModelConfig {
        ModelConfig {
            name: "mistral-like".into(),
            hidden: 4096,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14336,
            vocab: 32000,
            tie_embeddings: false,
            sliding_window: window,
            qkv_bias: false,
            qk_norm: false,
            partial_window: None,
            sandwich_norms: false,
            moe: None,
            fused_proj: false,
            post_norms: false,
            qk_norm_flat: false,
            gpt_oss: false,
            mla: None,
            score_head: None,
        }
    }

    #[test]
    fn flops_with_a_window() {
        let s = 131072usize;
        let l = Layout {
            cp: 8,
            ..Layout::default()
        };
        let f = layer_flops(&mistral(Some(4096)), &l, s, 1);
        // pairs = 131072·4096 − 4096·4095/2 = 528,484,352; fwd = 4·pairs·a·d = 4·pairs·4096.
        assert_eq!(visible_pairs(s, Some(4096)), 528_484_352.0);
        assert_eq!(f.attention_fwd, 4.0 * 528_484_352.0 * 4096.0);
        assert_eq!(f.attention_bwd, 2.5 * f.attention_fwd);
        assert_eq!(f.window, Some(4096));
        let causal = layer_flops(&mistral(None), &l, s, 1);
        assert_eq!(f.attention_fwd_causal, causal.attention_fwd);
        assert_eq!(causal.attention_fwd_causal, causal.attention_fwd);
        assert_eq!(f.linear_fwd, causal.linear_fwd);
        assert_eq!(
            f.per_gpu_fwd_bwd,
            (3.0 * f.linear_fwd + 3.5 * f.attention_fwd) / 8.0
        );
        // A window of s or more: the causal numbers, bit for bit.
        let big = layer_flops(&mistral(Some(s)), &l, s, 1);
        assert_eq!(big, causal);
        // Small hand-computed case: s = 8, w = 3, b = 2, a·d = 4096: 4·21·2·4096.
        let small = layer_flops(&mistral(Some(3)), &Layout::default(), 8, 2);
        assert_eq!(small.attention_fwd, 4.0 * 21.0 * 2.0 * 4096.0);
    }

    /// The ring of a Mistral-like model with window `w` over CP 8 on h100 at `seq` tokens.
    fn ring8(w: Option<usize>, seq: usize, grad_elem: usize) -> RingComm {
        let (m, hw) = (mistral(w), Hardware::preset("h100").unwrap());
        let l = Layout {
            cp: 8,
            ..Layout::default()
        };
        let cx = CommCtx {
            model: &m,
            layout: &l,
            hw: &hw,
            seq,
            micro_batch: 1,
            elem: 2,
            grad_elem,
            attn_rate: 600e12,
            doc_len: None,
        };
        ring(&cx, 8, 1)
    }

    #[test]
    fn ring_with_a_window() {
        let s = 131072usize;
        let full = ring8(None, s, 2);
        assert_eq!((full.window, full.hops, full.active_steps), (None, 7, 8));
        assert_eq!(full.dkv_transfers, 8);
        let r = ring8(Some(4096), s, 2);
        // c = 16384 ≥ w - 1: the halo exchange instead of the ring: the 4095 K/V rows before
        // the shard from the previous rank, 4095·2·8·128·2 bytes, forward and (dK/dV) backward,
        // one local call with the rank's windowed FLOPs, nothing hidden.
        assert_eq!((r.window, r.halo_rows, r.hops, r.active_steps, r.dkv_transfers), (Some(4096), Some(4095), 1, 1, 1));
        let halo = 4095.0 * 2.0 * 8.0 * 128.0 * 2.0;
        assert_eq!((r.step_bytes, r.fwd_bytes_per_layer, r.bwd_bytes_per_layer), (halo, halo, halo));
        assert_eq!(ring8(Some(4096), s, 4).bwd_bytes_per_layer, halo);
        let rank = 4.0 * visible_pairs(s, Some(4096)) * 128.0 * 32.0 / 8.0;
        assert_eq!(r.step_flops_fwd, rank);
        assert!((r.step_compute_s_bwd - 2.5 * r.step_compute_s_fwd).abs() < 1e-12 * r.step_compute_s_bwd);
        let bw = r.link.bandwidth(&Hardware::preset("h100").unwrap());
        assert!((r.exposed_s_per_layer - 2.0 * halo / bw).abs() < 1e-12 * r.exposed_s_per_layer);
        assert!(r.contiguous_imbalance < 1.02);
        // w - 1 = c: the largest halo; w - 1 = c + 1: the ring, two hops (the halo's chunk
        // bound), each of a whole chunk: 16384·2·8·128·2 = 64 MiB
        assert_eq!(ring8(Some(16385), s, 2).halo_rows, Some(16384));
        let r = ring8(Some(16386), s, 2);
        assert_eq!((r.halo_rows, r.hops, r.active_steps), (None, 2, 3));
        assert_eq!(r.step_bytes, 64.0 * MIB);
        assert_eq!(r.step_bytes, full.step_bytes);
        assert_eq!(r.fwd_bytes_per_layer, 2.0 * 64.0 * MIB);
        // fp32 dK/dV: accumulators at g/e = 2.
        let r4 = ring8(Some(16386), s, 4);
        assert_eq!(r4.bwd_bytes_per_layer, 2.0 * 64.0 * MIB + 3.0 * 128.0 * MIB);
        // Compute per active step: the rank's windowed FLOPs over h + 1 = 3 steps.
        let rank = 4.0 * visible_pairs(s, Some(16386)) * 128.0 * 32.0 / 8.0;
        assert_eq!(r.step_flops_fwd, rank / 3.0);
        assert_eq!(r.step_compute_s_fwd, rank / 3.0 / 600e12);
        assert_eq!(r.step_compute_s_bwd, 2.5 * r.step_compute_s_fwd);
        // w - 1 = 2c: two hops; a window ≥ s: exactly the full ring.
        let r2 = ring8(Some(2 * 16384 + 1), s, 2);
        assert_eq!((r2.hops, r2.dkv_transfers), (2, 3));
        assert_eq!(r2.fwd_bytes_per_layer, 2.0 * 64.0 * MIB);
        assert_eq!(r2.bwd_bytes_per_layer, 2.0 * 64.0 * MIB + 3.0 * 64.0 * MIB);
        let rs = ring8(Some(s), s, 2);
        assert_eq!(rs, full);
        // w = 1: no halo rows, no traffic, nothing exposed.
        let r1 = ring8(Some(1), s, 2);
        assert_eq!(
            (r1.halo_rows, r1.hops, r1.fwd_bytes_per_layer, r1.bwd_bytes_per_layer),
            (Some(0), 0, 0.0, 0.0)
        );
        assert_eq!(r1.exposed_s_per_layer, 0.0);
        // Short shards (512 tokens on NVLink): exposed = h·(gap_fwd + gap_bwd).
        let r3 = ring8(Some(1024), 4096, 2);
        assert_eq!(r3.hops, 2);
        assert!(!r3.hides_fwd);
        let gap = (r3.step_transfer_s_fwd - r3.step_compute_s_fwd).max(0.0)
            + (r3.step_transfer_s_bwd - r3.step_compute_s_bwd).max(0.0);
        assert_eq!(r3.exposed_s_per_layer, 2.0 * gap);
    }

    #[test]
    fn plan_with_a_window() {
        use crate::{plan, CpKind, PlanInput};
        let run = |w: Option<usize>, kind: CpKind| {
            let l = Layout {
                cp: 8,
                cp_kind: kind,
                ..Layout::default()
            };
            let hw = Hardware::preset("h100").unwrap();
            plan(&PlanInput::new(mistral(w), hw, l, 131072)).unwrap()
        };
        for kind in [CpKind::Ring, CpKind::Allgather, CpKind::Ulysses] {
            let (c, p) = (run(None, kind), run(Some(4096), kind));
            // Communication of all-gather and Ulysses is unchanged; attention time shrinks.
            assert_eq!(c.allgather, p.allgather);
            assert_eq!(c.ulysses, p.ulysses);
            assert_eq!(c.tp_comm, p.tp_comm);
            assert_eq!(c.memory_per_gpu_bytes, p.memory_per_gpu_bytes);
            assert_eq!(c.layer_time.linear_s, p.layer_time.linear_s);
            let ratio = p.layer_time.attention_s / c.layer_time.attention_s;
            let want = visible_pairs(131072, Some(4096)) / visible_pairs(131072, None);
            assert!((ratio - want).abs() < 1e-12, "{ratio} vs {want}");
            let halo_note = p.notes.iter().any(|n| n.contains("a halo exchange of the 4095 K/V rows"));
            assert_eq!(halo_note, kind == CpKind::Ring, "{:?}", p.notes);
            assert!(c.notes.iter().all(|n| !n.contains("sliding window")));
        }
        // A window of 0 is an error naming the window.
        let mut bad = run(None, CpKind::Ring).input;
        bad.model.sliding_window = Some(0);
        let e = plan(&bad).unwrap_err();
        assert!(e.0.contains("sliding window must be at least 1"), "{e}");
        // A window ≥ s: every number is the causal one (only the model's field differs).
        let (c, p) = (run(None, CpKind::Ring), run(Some(131072), CpKind::Ring));
        assert_eq!(
            (c.flops, c.ring, c.layer_time),
            (p.flops, p.ring, p.layer_time)
        );
    }
}
