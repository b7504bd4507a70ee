//! Packed documents: documents of `L` tokens packed into the global sequence of `s` tokens
//! (the last one `s mod L` tokens when `L` does not divide `s`), attention kept inside each
//! document (`candle_cp_ops::packing::Documents`), optionally with a causal sliding window `w`
//! inside each document.
//!
//! A document length `L ≥ s` is one document: the planner then uses exactly the numbers
//! without documents ([`effective_doc_len`] returns `None`). With `L < s`:
//! - visible pairs: `Σ_docs P(len, w)` ([`visible_pairs`]), `P(n, w)` the exact pairs of the
//!   first `n` queries of one document (`n·(n+1)/2` without a window);
//! - the ring on contiguous shards of `c = s/R` tokens runs `1 + h` steps,
//!   `h = min(R−1, ceil((m−1)/c))` K/V hops with `m = min(L, w)` ([`ring_hops`]): a query
//!   reaches back at most `m − 1` positions. This is the worst placement: documents that cross
//!   no shard boundary need fewer hops (`candle_cp_ops::cp::ring::active_steps` stops the ring
//!   after the last step with work, which depends on where the boundaries fall);
//! - the backward's dK/dV accumulators travel as for the window: `h + 1` transfers;
//! - busiest/mean work of a contiguous split ([`contiguous_imbalance`]): exact for documents
//!   placed from position 0.

use crate::comm::RingComm;
use crate::window::{self, effective_window, halo_hops, prefix_pairs};

/// The document length the planner models for a global sequence of `s` tokens: `doc_len`
/// when it is shorter than `s` (and at least 1), `None` otherwise (one document of `s` tokens
/// is plain causal attention).
pub fn effective_doc_len(doc_len: Option<usize>, s: usize) -> Option<usize> {
    doc_len.filter(|&l| l >= 1 && l < s)
}

/// How far back a query can see, in keys including itself: `m = min(L, w)` over the
/// effective document length and window of a sequence of `s` tokens; `None` when neither
/// applies (the whole causal prefix).
pub fn reach(s: usize, doc_len: Option<usize>, window: Option<usize>) -> Option<usize> {
    match (effective_doc_len(doc_len, s), effective_window(window, s)) {
        (None, None) => None,
        (Some(l), None) => Some(l),
        (None, Some(w)) => Some(w),
        (Some(l), Some(w)) => Some(l.min(w)),
    }
}

/// Exact visible pairs of the first `n` queries of a sequence packed with documents of `l`
/// tokens from position 0 (window `w` inside each document, `None`: none):
/// `floor(n/l)·P(l, w') + P(n mod l, w')`, `w' = min(w, l)`.
pub fn packed_prefix_pairs(n: usize, l: usize, window: Option<usize>) -> f64 {
    let l = l.max(1);
    let w = window.map_or(l, |w| w.clamp(1, l));
    (n / l) as f64 * prefix_pairs(l, w) + prefix_pairs(n % l, w)
}

/// Query–key pairs a causal attention over `s` packed tokens computes. Without an effective
/// document length (`None`, or `L ≥ s`): [`window::visible_pairs`] exactly (the causal
/// convention `s²/2`, or the windowed count). With documents of `L < s`: the exact
/// `Σ_docs P(len, min(w, L))` = `floor(s/L)·P(L, w) + P(s mod L, w)`, `P(n, w)` the pairs of
/// the first `n` queries of one document (`n·(n+1)/2` for `n ≤ w`, else `n·w − w·(w−1)/2`).
pub fn visible_pairs(s: usize, doc_len: Option<usize>, window: Option<usize>) -> f64 {
    match effective_doc_len(doc_len, s) {
        None => window::visible_pairs(s, window),
        Some(l) => packed_prefix_pairs(s, l, effective_window(window, s)),
    }
}

/// K/V hops of the ring over `r` ranks holding contiguous shards of `c = s/r` tokens:
/// `R − 1` (the full ring) without documents or window; otherwise
/// `h = min(R − 1, ceil((m − 1)/c))`, `m = min(L, w)` ([`reach`]). An upper bound over where
/// the document boundaries fall, reached when a document of `m` (or more) tokens ends at the
/// first token of a shard.
pub fn ring_hops(s: usize, r: usize, doc_len: Option<usize>, window: Option<usize>) -> usize {
    match reach(s, doc_len, window) {
        None => r.saturating_sub(1),
        Some(m) => halo_hops(m, s / r.max(1), r),
    }
}

/// Busiest/mean work of a contiguous split of `s` tokens over `r` ranks. Without documents:
/// [`window::contiguous_imbalance`] exactly. With documents of `L < s` placed from position 0
/// (window `w` inside each): `R·max_k (Q((k+1)·c) − Q(k·c)) / Q(s)` with
/// `Q(n)` = [`packed_prefix_pairs`]: exact; 1 when `L` divides `c` (every shard holds the
/// same whole documents).
pub fn contiguous_imbalance(
    s: usize,
    r: usize,
    doc_len: Option<usize>,
    window: Option<usize>,
) -> f64 {
    let Some(l) = effective_doc_len(doc_len, s) else {
        return window::contiguous_imbalance(s, r, window);
    };
    let (r, w) = (r.max(1), effective_window(window, s));
    let c = s / r;
    let q = |n: usize| packed_prefix_pairs(n, l, w);
    let busiest = (0..r)
        .map(|k| q((k + 1) * c) - q(k * c))
        .fold(0.0, f64::max);
    r as f64 * busiest / q(s)
}

/// Plan notes about packed documents (none without `--doc-len`): a length `≥ s` is one
/// document; with a ring of `ring_degree > 1` the planner models contiguous shards and the
/// hop count is the worst placement.
pub fn notes(
    s: usize,
    doc_len: Option<usize>,
    window: Option<usize>,
    ring_degree: usize,
) -> Vec<String> {
    let mut n = Vec::new();
    match (doc_len, effective_doc_len(doc_len, s)) {
        (Some(l), None) => n.push(format!(
            "document length {l} >= sequence {s}: one document, the same as no packing"
        )),
        (_, Some(l)) if ring_degree > 1 => {
            let what = match window {
                Some(w) => format!("packed documents of {l} with sliding window {w}"),
                None => format!("packed documents of {l}"),
            };
            n.push(format!(
                "{what}: the planner models contiguous shards (a halo of {} hop(s) when a document crosses a shard boundary; fewer when the boundaries fall on shard edges); zigzag would keep the full ring ({} hops)",
                ring_hops(s, ring_degree, Some(l), window),
                ring_degree - 1
            ))
        }
        _ => {}
    }
    n
}

/// The verdict's clause on the ring with packed documents of `l` tokens: compute per step
/// against one K/V transfer, with documents (`r`) and without (`plain`). Short documents cut
/// the compute per step; the bytes per hop stay.
pub fn ring_verdict(l: usize, r: &RingComm, plain: &RingComm) -> String {
    let status = if r.hides_fwd && r.hides_bwd {
        "the transfers hide behind compute".to_string()
    } else {
        format!(
            "NOT hidden, {} per layer exposed",
            crate::report::ms(r.exposed_s_per_layer)
        )
    };
    format!(
        "packed documents of {l}: attention per ring step {} fwd / {} bwd ({} / {} without documents) against {} / {} per K/V transfer, {} hop(s) ({} without): {status}",
        crate::report::ms(r.step_compute_s_fwd),
        crate::report::ms(r.step_compute_s_bwd),
        crate::report::ms(plain.step_compute_s_fwd),
        crate::report::ms(plain.step_compute_s_bwd),
        crate::report::ms(r.step_transfer_s_fwd),
        crate::report::ms(r.step_transfer_s_bwd),
        r.hops,
        plain.hops
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute-force count of the pairs `(i, j)`, `j ≤ i`, in the same document of `l` tokens
    /// (documents from position 0) and `i − j < w`, over the first `n` queries.
    fn brute(n: usize, l: usize, w: Option<usize>) -> f64 {
        let mut count = 0usize;
        for i in 0..n {
            for j in 0..=i {
                let same_doc = i / l == j / l;
                let in_window = w.is_none_or(|w| i - j < w);
                if same_doc && in_window {
                    count += 1;
                }
            }
        }
        count as f64
    }

    #[test]
    fn pairs_match_brute_force() {
        for s in [1usize, 2, 7, 16, 33, 64] {
            for l in 1..=s + 2 {
                for w in [None, Some(1), Some(2), Some(3), Some(5), Some(16), Some(s)] {
                    let got = visible_pairs(s, Some(l), w);
                    if l < s {
                        assert_eq!(got, brute(s, l, w), "s {s} L {l} w {w:?}");
                        for n in 0..=s {
                            let ew = effective_window(w, s);
                            assert_eq!(packed_prefix_pairs(n, l, ew), brute(n, l, ew));
                        }
                    } else {
                        // One document: the numbers without documents, bit for bit.
                        assert_eq!(got, window::visible_pairs(s, w), "s {s} L {l} w {w:?}");
                    }
                }
            }
        }
        // Hand-computed: s = 10, L = 4 (documents 4, 4, 2): 10 + 10 + 3 = 23.
        assert_eq!(visible_pairs(10, Some(4), None), 23.0);
        // ... with w = 2: (1 + 2·3) + (1 + 2·3) + (1 + 2) = 17.
        assert_eq!(visible_pairs(10, Some(4), Some(2)), 17.0);
        // A window of at least L masks nothing inside a document.
        assert_eq!(visible_pairs(10, Some(4), Some(7)), 23.0);
        // None and L ≥ s: the causal convention s²/2 (and the windowed count) exactly.
        for w in [None, Some(3)] {
            let base = window::visible_pairs(10, w);
            for l in [None, Some(10), Some(11), Some(usize::MAX), Some(0)] {
                assert_eq!(visible_pairs(10, l, w), base, "L {l:?} w {w:?}");
            }
        }
        assert_eq!(effective_doc_len(Some(10), 10), None);
        assert_eq!(effective_doc_len(Some(9), 10), Some(9));
    }

    #[test]
    fn documents_of_4k_at_128k() {
        // 32 documents of 4096: 32·4096·4097/2 pairs against the causal 131072²/2: 32x fewer
        // (32·4097/4096 to be exact).
        let s = 131072usize;
        let p = visible_pairs(s, Some(4096), None);
        assert_eq!(p, 32.0 * 4096.0 * 4097.0 / 2.0);
        let ratio = window::visible_pairs(s, None) / p;
        assert_eq!(ratio, 32.0 * 4096.0 / 4097.0);
        // CP 16: c = 8192, one hop instead of 15.
        assert_eq!(ring_hops(s, 16, Some(4096), None), 1);
        assert_eq!(ring_hops(s, 16, None, None), 15);
        assert_eq!(ring_hops(s, 16, Some(s), None), 15);
    }

    #[test]
    fn hops_follow_min_of_document_and_window() {
        // (s, R, L, w) -> h, c = s/R
        for (s, r, l, w, h) in [
            (1024, 8, None, None, 7),
            (1024, 8, Some(1), None, 0), // one-token documents: the diagonal only
            (1024, 8, Some(128), None, 1), // L - 1 = c - 1
            (1024, 8, Some(129), None, 1), // L - 1 = c: one shard back
            (1024, 8, Some(130), None, 2), // L - 1 = c + 1
            (1024, 8, Some(1000), None, 7), // capped at R - 1
            (1024, 8, Some(1000), Some(129), 1), // the window is shorter
            (1024, 8, Some(129), Some(1000), 1), // the document is shorter
            (1024, 8, None, Some(300), 3), // window only: window::halo_hops
            (1024, 1, Some(100), None, 0), // R = 1: no ring
        ] {
            assert_eq!(ring_hops(s, r, l, w), h, "s {s} R {r} L {l:?} w {w:?}");
        }
        assert_eq!(reach(1024, None, None), None);
        assert_eq!(reach(1024, Some(2048), Some(100)), Some(100));
        assert_eq!(reach(1024, Some(50), Some(100)), Some(50));
    }

    #[test]
    fn imbalance_with_documents() {
        // No documents, or L ≥ s: the window module's numbers.
        assert_eq!(contiguous_imbalance(1024, 8, None, None), 15.0 / 8.0);
        assert_eq!(contiguous_imbalance(1024, 8, Some(1024), None), 15.0 / 8.0);
        assert_eq!(
            contiguous_imbalance(1024, 8, None, Some(100)),
            window::contiguous_imbalance(1024, 8, Some(100))
        );
        // L divides c: every shard holds the same whole documents.
        assert_eq!(contiguous_imbalance(1024, 8, Some(64), None), 1.0);
        assert_eq!(contiguous_imbalance(1024, 8, Some(128), Some(7)), 1.0);
        // Brute force over the ranks: s = 16, R = 4, L = 6 (documents 6, 6, 4).
        for (l, w) in [(6usize, None), (6, Some(2)), (3, None), (5, Some(4))] {
            let q = |n: usize| brute(n, l, w);
            let per: Vec<f64> = (0..4).map(|k| q(4 * (k + 1)) - q(4 * k)).collect();
            let want = 4.0 * per.iter().cloned().fold(0.0, f64::max) / q(16);
            assert_eq!(
                contiguous_imbalance(16, 4, Some(l), w),
                want,
                "L {l} w {w:?}"
            );
        }
        // By hand, L = 6: shard [0,4) 1+2+3+4 = 10; [4,8) rows 4, 5 of document 0 and rows
        // 0, 1 of document 1, 5+6+1+2 = 14; [8,12) 3+4+5+6 = 18; [12,16) 10: 4·18/52.
        assert_eq!(contiguous_imbalance(16, 4, Some(6), None), 72.0 / 52.0);
    }

    fn ctx_ring(doc_len: Option<usize>, window: Option<usize>, gpus_per_node: usize) -> RingComm {
        use crate::comm::{ring, CommCtx};
        use crate::{Hardware, Layout, ModelConfig};
        let mut m = ModelConfig::preset("llama3-8b").unwrap();
        m.sliding_window = window;
        let mut hw = Hardware::preset("h100").unwrap();
        hw.gpus_per_node = gpus_per_node;
        let l = Layout {
            cp: 16,
            ..Layout::default()
        };
        let cx = CommCtx {
            model: &m,
            layout: &l,
            hw: &hw,
            seq: 131072,
            micro_batch: 1,
            elem: 2,
            grad_elem: 2,
            attn_rate: 600e12,
            doc_len,
        };
        ring(&cx, 16, 1)
    }

    #[test]
    fn ring_with_documents() {
        use crate::hardware::Link;
        use crate::MIB;
        let full = ctx_ring(None, None, 8);
        assert_eq!((full.hops, full.doc_len, full.link), (15, None, Link::Ib));
        // Documents of 4096 at 128k over CP 16 (c = 8192): one hop, two transfers home.
        let r = ctx_ring(Some(4096), None, 8);
        assert_eq!((r.doc_len, r.window), (Some(4096), None));
        assert_eq!((r.hops, r.active_steps, r.dkv_transfers), (1, 2, 2));
        // The bytes per hop stay: 8192·2·8·128·2 = 32 MiB.
        assert_eq!(r.step_bytes, full.step_bytes);
        assert_eq!(r.step_bytes, 32.0 * MIB);
        assert_eq!(r.fwd_bytes_per_layer, 32.0 * MIB);
        assert_eq!(r.bwd_bytes_per_layer, 32.0 * MIB + 2.0 * 32.0 * MIB);
        // The compute per step collapses: the rank's packed pairs over 2 steps.
        let rank = 4.0 * 32.0 * (4096.0 * 4097.0 / 2.0) * 128.0 * 32.0 / 16.0;
        assert_eq!(r.step_flops_fwd, rank / 2.0);
        assert_eq!(r.step_compute_s_fwd, rank / 2.0 / 600e12);
        assert!(r.step_flops_fwd < full.step_flops_fwd / 3.9);
        // On InfiniBand it no longer hides (the causal zigzag ring does); exposed = h·gaps.
        assert!(full.hides_fwd && full.hides_bwd && full.exposed_s_per_layer == 0.0);
        assert!(!r.hides_fwd && !r.hides_bwd);
        let gap = (r.step_transfer_s_fwd - r.step_compute_s_fwd)
            + (r.step_transfer_s_bwd - r.step_compute_s_bwd);
        assert_eq!(r.exposed_s_per_layer, gap);
        assert_eq!(r.contiguous_imbalance, 1.0);
        // One NVLink domain of 16: the same step hides.
        let nv = ctx_ring(Some(4096), None, 16);
        assert_eq!(nv.link, Link::Nvlink);
        assert!(nv.hides_fwd && nv.hides_bwd && nv.exposed_s_per_layer == 0.0);
        // Longer documents reach further back: L - 1 = 19999 = 2c + 3615: three hops; a
        // window of 9000 inside them: two.
        let long = ctx_ring(Some(20000), None, 8);
        assert_eq!((long.hops, long.dkv_transfers), (3, 4));
        assert_eq!(long.fwd_bytes_per_layer, 3.0 * 32.0 * MIB);
        assert_eq!(ctx_ring(Some(20000), Some(9000), 8).hops, 2);
        assert_eq!(ctx_ring(Some(4096), Some(1024), 8).hops, 1);
        // L ≥ s is no document at all: the full ring, bit for bit (with a window: the window's).
        assert_eq!(ctx_ring(Some(131072), None, 8), full);
        assert_eq!(
            ctx_ring(Some(1 << 20), Some(4096), 8),
            ctx_ring(None, Some(4096), 8)
        );
    }

    #[test]
    fn plan_with_documents() {
        use crate::{plan, CpKind, Hardware, Layout, ModelConfig, PlanInput};
        let run = |doc_len: Option<usize>, kind: CpKind| {
            let l = Layout {
                cp: 16,
                cp_kind: kind,
                ulysses: if kind == CpKind::TwoD { 8 } else { 1 },
                ..Layout::default()
            };
            let m = ModelConfig::preset("llama3-8b").unwrap();
            let mut i = PlanInput::new(m, Hardware::preset("h100").unwrap(), l, 131072);
            i.doc_len = doc_len;
            plan(&i).unwrap()
        };
        let pairs = visible_pairs(131072, Some(4096), None) / window::visible_pairs(131072, None);
        for kind in [
            CpKind::Ring,
            CpKind::Allgather,
            CpKind::Ulysses,
            CpKind::TwoD,
        ] {
            let (c, p) = (run(None, kind), run(Some(4096), kind));
            // Bytes of all-gather, Ulysses and TP, memory and linear time are unchanged.
            assert_eq!(c.allgather, p.allgather);
            assert_eq!(c.ulysses, p.ulysses);
            assert_eq!(c.tp_comm, p.tp_comm);
            assert_eq!(c.memory_per_gpu_bytes, p.memory_per_gpu_bytes);
            assert_eq!(c.layer_time.linear_s, p.layer_time.linear_s);
            assert_eq!(p.flops.doc_len, Some(4096));
            assert_eq!(p.flops.attention_fwd, c.flops.attention_fwd * pairs);
            let ratio = p.layer_time.attention_s / c.layer_time.attention_s;
            assert!((ratio - pairs).abs() < 1e-12, "{ratio} vs {pairs}");
            let ring_clause = p
                .verdict
                .contains("packed documents of 4096: attention per ring step");
            assert_eq!(
                ring_clause,
                matches!(kind, CpKind::Ring | CpKind::TwoD),
                "{}",
                p.verdict
            );
            assert!(p.verdict.starts_with(&c.verdict), "{}", p.verdict);
            // None, L = s and L > s: every number is the one without documents.
            for same in [run(Some(131072), kind), run(Some(1 << 20), kind)] {
                assert_eq!(
                    (&c.flops, &c.ring, &c.layer_time, &c.verdict, &c.bottleneck),
                    (
                        &same.flops,
                        &same.ring,
                        &same.layer_time,
                        &same.verdict,
                        &same.bottleneck
                    )
                );
            }
        }
        // 2-D: Ulysses 8 x ring 2 on 65536-token shards: 4096-token documents need one hop.
        let p = run(Some(4096), CpKind::TwoD);
        assert_eq!((p.ring.degree, p.ring.hops), (2, 1));
        // The JSON has no doc_len without documents, and has it with them.
        let plain = serde_json::to_string(&run(None, CpKind::Ring)).unwrap();
        assert!(!plain.contains("doc_len"));
        let packed = serde_json::to_value(run(Some(4096), CpKind::Ring)).unwrap();
        assert_eq!(packed["input"]["doc_len"], 4096);
        assert_eq!(packed["flops"]["doc_len"], 4096);
        assert_eq!(packed["ring"]["hops"], 1);
        // A document length of 0 is an error naming the flag.
        let mut bad = run(None, CpKind::Ring).input;
        bad.doc_len = Some(0);
        let e = plan(&bad).unwrap_err();
        assert!(
            e.0.contains("--doc-len) must be at least 1 token, got 0"),
            "{e}"
        );
    }
}
