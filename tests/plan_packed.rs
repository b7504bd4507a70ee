//! The planner's packed-document arithmetic (`candle_cp_plan::packed`) against the ring engine
//! (`candle_cp_ops`): hop counts against `cp::ring::active_steps` on contiguous shards, visible
//! pairs and the contiguous imbalance against the engine's per-rank pair counts
//! (`cp::balance_mask`).
//!
//! What is asserted about hops, for documents of at most `L` tokens and a window `w` inside
//! each (the planner's `h = min(R − 1, ceil((m − 1)/c))`, `m = min(L, w)`, `c = T/P`):
//! - for documents of exactly `L` placed from position 0, for every shifted placement
//!   (a first document of `f = 1..=L` tokens, then documents of `L`, the last one cut at `T`),
//!   and for seeded random lengths in `1..=L`: the engine's hops (`active_steps − 1`) are at
//!   most `h` (an upper bound);
//! - over the shifted placements the largest engine hop count equals `h` (the bound is reached:
//!   a document crossing a shard boundary far enough back);
//! - documents placed from 0 need fewer hops when `L` divides `c` (no document crosses a shard
//!   edge): the bound is not always reached by the placement from 0.

use candle_cp_ops::cp::ring::active_steps;
use candle_cp_ops::cp::{balance_mask, CpOpts, Layout, MaskSpec};
use candle_cp_ops::packing::Documents;
use candle_cp_plan::packed;

/// Documents `[first, l, l, .., rest]` covering `t` tokens (`1 ≤ first ≤ l`).
fn shifted(first: usize, l: usize, t: usize) -> Documents {
    let mut lens = vec![first.min(t)];
    let mut at = lens[0];
    while at < t {
        let n = l.min(t - at);
        lens.push(n);
        at += n;
    }
    Documents::from_lengths(&lens).unwrap()
}

/// The ring engine's K/V hops on contiguous shards for these documents and window.
fn engine_hops(docs: Documents, w: Option<usize>, p: usize, t: usize) -> usize {
    let mut opts = CpOpts::new(Layout::Contiguous, true).with_documents(docs);
    if let Some(w) = w {
        opts = opts.with_window(w);
    }
    active_steps(&opts, p, t).unwrap() - 1
}

/// (T, P, L, w, the planner's hops written out by hand).
const CASES: [(usize, usize, usize, Option<usize>, usize); 12] = [
    (64, 4, 1, None, 0),       // one-token documents: the diagonal only
    (64, 4, 8, None, 1),       // c = 16: L − 1 = 7
    (64, 4, 16, None, 1),      // L − 1 = c − 1
    (64, 4, 17, None, 1),      // L − 1 = c: exactly one shard back
    (64, 4, 18, None, 2),      // L − 1 = c + 1
    (64, 4, 40, None, 3),      // capped at P − 1
    (96, 8, 30, None, 3),      // c = 12: ceil(29/12)
    (96, 8, 30, Some(13), 1),  // the window is shorter: m = 13
    (96, 8, 30, Some(14), 2),  // m = 14: w − 1 = c + 1
    (96, 8, 10, Some(40), 1),  // the document is shorter: m = 10
    (128, 8, 64, Some(20), 2), // c = 16, m = 20
    (120, 6, 45, None, 3),     // c = 20, a last document of 30
];

#[test]
fn hops_bound_the_engine_and_are_reached() {
    for (t, p, l, w, want) in CASES {
        let h = packed::ring_hops(t, p, Some(l), w);
        assert_eq!(h, want, "planner: T {t} P {p} L {l} w {w:?}");
        let from0 = engine_hops(shifted(l, l, t), w, p, t);
        assert!(
            from0 <= h,
            "from 0: engine {from0} > planner {h} (T {t} P {p} L {l} w {w:?})"
        );
        let mut reached = 0;
        for first in 1..=l {
            let e = engine_hops(shifted(first, l, t), w, p, t);
            assert!(
                e <= h,
                "first {first}: engine {e} > planner {h} (T {t} P {p} L {l} w {w:?})"
            );
            reached = reached.max(e);
        }
        assert_eq!(
            reached, h,
            "largest engine hops over placements (T {t} P {p} L {l} w {w:?})"
        );
        // Seeded random lengths of at most L: still within the bound.
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t * 31 + l) as u64;
        for _ in 0..8 {
            let mut lens = Vec::new();
            let mut at = 0;
            while at < t {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let n = (1 + (x % l as u64) as usize).min(t - at);
                lens.push(n);
                at += n;
            }
            let e = engine_hops(Documents::from_lengths(&lens).unwrap(), w, p, t);
            assert!(
                e <= h,
                "lengths {lens:?}: engine {e} > planner {h} (P {p} w {w:?})"
            );
        }
    }
    // Documents placed from 0 whose length divides the shard cross no shard edge: the engine
    // needs no hop although a shifted placement needs the planner's one.
    assert_eq!(engine_hops(shifted(8, 8, 64), None, 4, 64), 0);
    assert_eq!(packed::ring_hops(64, 4, Some(8), None), 1);
    // One document of T tokens (L ≥ T): the full ring, as without documents.
    assert_eq!(engine_hops(shifted(64, 64, 64), None, 4, 64), 3);
    assert_eq!(packed::ring_hops(64, 4, Some(64), None), 3);
    assert_eq!(packed::ring_hops(64, 4, Some(1000), None), 3);
}

#[test]
fn pairs_and_imbalance_match_the_engine_counts() {
    for (t, p, l, w, _) in CASES {
        let docs = shifted(l, l, t);
        let spec = MaskSpec {
            causal: true,
            window: w,
            docs: Some(&docs),
        };
        let b = balance_mask(Layout::Contiguous, p, t, spec).unwrap();
        let total: u64 = b.pairs.iter().sum();
        assert_eq!(
            packed::visible_pairs(t, Some(l), w),
            total as f64,
            "pairs: T {t} P {p} L {l} w {w:?} ({:?})",
            b.pairs
        );
        let busiest = *b.pairs.iter().max().unwrap() as f64;
        let want = p as f64 * busiest / total as f64;
        let got = packed::contiguous_imbalance(t, p, Some(l), w);
        assert!(
            (got - want).abs() < 1e-12,
            "imbalance {got} vs engine {want} (T {t} P {p} L {l} w {w:?})"
        );
    }
}

#[test]
fn plan_ring_hops_match_the_packed_formula() {
    use candle_cp_plan::{plan, Hardware, Layout as PlanLayout, ModelConfig, PlanInput};
    for (t, p, l, w, want) in CASES {
        let mut m = ModelConfig::preset("llama3-8b").unwrap();
        m.sliding_window = w;
        let layout = PlanLayout {
            cp: p,
            ..PlanLayout::default()
        };
        let mut input = PlanInput::new(m, Hardware::preset("h100").unwrap(), layout, t);
        input.doc_len = Some(l);
        let r = plan(&input).unwrap().ring;
        match w.filter(|&w| w - 1 <= t / p) {
            // a window within one shard: the halo exchange of its w − 1 rows (whatever the
            // documents), one local call
            Some(w) => assert_eq!((r.halo_rows, r.hops, r.active_steps), (Some(w - 1), usize::from(w > 1), 1), "T {t} P {p} L {l} w {w}"),
            None => assert_eq!((r.halo_rows, r.hops, r.active_steps), (None, want, want + 1), "T {t} P {p} L {l} w {w:?}"),
        }
    }
}
