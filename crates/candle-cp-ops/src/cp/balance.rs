//! Load-balance report: how much attention work each rank of a CP group does.
//!
//! Two measures per rank, both for the rank's local queries against the whole sequence:
//! - `pairs`: visible (query, key) pairs — the work of a kernel that skips masked entries
//!   exactly (what flash attention's causal tiles approach);
//! - `blocks`: the area of the (query segment × key segment) blocks the ring engine actually
//!   computes (fully masked blocks skipped, partially masked ones computed densely), with
//!   blocks that straddle the diagonal counted at half their area (`half_diag`), which is what
//!   a tiled kernel skipping masked tiles does for large blocks.
//!
//! Closed forms (c = T/P, causal): contiguous rank r sees `r·c² + c(c+1)/2` pairs, so
//! max/mean = (2Pc − c + 1)/(Pc + 1) → (2P−1)/P; in blocks exactly `(2P−1)/P`.
//! Zigzag (c = T/2P) every rank sees `2P·c² + c = T²/(2P) + T/(2P)` pairs: imbalance 1.00.

use super::ring::{block_schedule_mask, classify, Block, MaskSpec};
use crate::packing::Documents;
use super::shard::{Layout, Segment};
use candle_core::Result;

/// Attention work per rank for one layout, `P`, `T` and mask.
#[derive(Clone, Debug, PartialEq)]
pub struct BalanceReport {
    /// The layout.
    pub layout: Layout,
    /// Number of ranks.
    pub p: usize,
    /// Global sequence length.
    pub t: usize,
    /// Causal mask (else full).
    pub causal: bool,
    /// Visible (query, key) pairs per rank.
    pub pairs: Vec<u64>,
    /// Block work per rank: block areas the ring computes, diagonal-straddling blocks at half.
    pub blocks: Vec<f64>,
    /// Packed documents the mask was restricted to (`None`: one document).
    pub documents: Option<Documents>,
}

fn imbalance_of(xs: impl Iterator<Item = f64> + Clone) -> f64 {
    let n = xs.clone().count().max(1) as f64;
    let mean = xs.clone().sum::<f64>() / n;
    let max = xs.fold(0f64, f64::max);
    if mean == 0.0 {
        1.0
    } else {
        max / mean
    }
}

impl BalanceReport {
    /// Max over mean of the visible pairs (1.00 = perfectly balanced).
    pub fn imbalance(&self) -> f64 {
        imbalance_of(self.pairs.iter().map(|&x| x as f64))
    }
    /// Max over mean of the block work.
    pub fn block_imbalance(&self) -> f64 {
        imbalance_of(self.blocks.iter().copied())
    }
    /// The ideal per-rank work `T²/(2P)` (causal) or `T²/P` (full); with documents `T²` is
    /// replaced by the sum of the squared document lengths.
    pub fn ideal(&self) -> f64 {
        let t2 = match &self.documents {
            None => (self.t as f64).powi(2),
            Some(d) => d.lengths().iter().map(|&l| (l as f64).powi(2)).sum(),
        };
        if self.causal {
            t2 / (2.0 * self.p as f64)
        } else {
            t2 / self.p as f64
        }
    }
    /// Largest relative deviation of a rank's visible pairs from [`Self::ideal`].
    pub fn max_dev_from_ideal(&self) -> f64 {
        let ideal = self.ideal();
        self.pairs
            .iter()
            .map(|&x| ((x as f64) - ideal).abs() / ideal)
            .fold(0.0, f64::max)
    }
}

/// Visible pairs of query segment `q` against key segment `k`.
pub fn visible_pairs(q: &Segment, k: &Segment, causal: bool) -> u64 {
    if !causal {
        return (q.len * k.len) as u64;
    }
    (0..q.len)
        .map(|i| {
            let qp = q.offset + i * q.stride;
            if qp < k.offset || k.len == 0 {
                0
            } else {
                ((qp - k.offset) / k.stride + 1).min(k.len) as u64
            }
        })
        .sum()
}

/// Visible pairs of query segment `q` against key segment `k` under a causal sliding window
/// of `window` keys (`qp - window < kp <= qp`).
pub fn visible_pairs_window(q: &Segment, k: &Segment, window: usize) -> u64 {
    if k.len == 0 || k.stride == 0 {
        return 0;
    }
    let (ko, ks) = (k.offset as i128, k.stride as i128);
    (0..q.len)
        .map(|i| {
            let qp = (q.offset + i * q.stride) as i128;
            let (lo, hi) = (qp - window as i128 + 1, qp);
            let first = if lo <= ko { 0 } else { (lo - ko + ks - 1) / ks };
            let last = if hi < ko { -1 } else { ((hi - ko) / ks).min(k.len as i128 - 1) };
            (last - first + 1).max(0) as u64
        })
        .sum()
}

/// Compute the work per rank for `layout`, `p` ranks, global length `t`.
/// Errors if `t` is not divisible as the layout needs.
pub fn balance(layout: Layout, p: usize, t: usize, causal: bool) -> Result<BalanceReport> {
    let mut pairs = Vec::with_capacity(p);
    let mut blocks = Vec::with_capacity(p);
    for r in 0..p {
        let qs = layout.segments(r, p, t)?;
        let mut np = 0u64;
        let mut nb = 0f64;
        for src in 0..p {
            let ks = layout.segments(src, p, t)?;
            for q in &qs {
                for k in &ks {
                    np += visible_pairs(q, k, causal);
                    let area = (q.len * k.len) as f64;
                    nb += match classify(q, k, causal) {
                        Block::Skip => 0.0,
                        Block::Full(_) => area,
                        Block::Partial(_) => area / 2.0,
                    };
                }
            }
        }
        pairs.push(np);
        blocks.push(nb);
    }
    Ok(BalanceReport {
        layout,
        p,
        t,
        causal,
        pairs,
        blocks,
        documents: None,
    })
}

/// [`balance`] for a packed sequence: the work per rank when attention stays inside the
/// `docs` (which must cover `t`), counted over the per-document blocks the ring engine
/// computes ([`super::ring::block_schedule_mask`]).
pub fn balance_docs(layout: Layout, p: usize, t: usize, causal: bool, docs: &Documents) -> Result<BalanceReport> {
    balance_mask(layout, p, t, MaskSpec { causal, window: None, docs: Some(docs) })
}

/// [`balance`] under any [`MaskSpec`] (sliding window, packed documents): each rank's visible
/// pairs and block work over the blocks the ring engine computes.
pub fn balance_mask(layout: Layout, p: usize, t: usize, spec: MaskSpec) -> Result<BalanceReport> {
    if let Some(docs) = spec.docs {
        docs.check_len(&format!("balance ({layout}, P = {p})"), t)?;
    }
    let mut pairs = Vec::with_capacity(p);
    let mut blocks = Vec::with_capacity(p);
    for r in 0..p {
        let (mut np, mut nb) = (0u64, 0f64);
        for src in 0..p {
            for sb in block_schedule_mask(layout, r, src, p, t, spec)? {
                np += match (spec.window, spec.causal) {
                    (Some(w), true) => visible_pairs_window(&sb.q, &sb.k, w),
                    _ => visible_pairs(&sb.q, &sb.k, spec.causal),
                };
                let area = (sb.q.len * sb.k.len) as f64;
                nb += if matches!(sb.block, Block::Partial(_)) { area / 2.0 } else { area };
            }
        }
        pairs.push(np);
        blocks.push(nb);
    }
    Ok(BalanceReport { layout, p, t, causal: spec.causal, pairs, blocks, documents: spec.docs.cloned() })
}

/// The layout with the least work on its busiest rank (visible pairs; ties keep the order of
/// [`Layout::ALL`]) for `p` ranks, length `t` and the mask (causal or full, sliding window,
/// packed documents), with the reports of every layout that can split `t`. Errors if none
/// can.
pub fn best_layout(p: usize, t: usize, spec: MaskSpec) -> Result<(Layout, Vec<BalanceReport>)> {
    let mut reports = Vec::new();
    for layout in Layout::ALL {
        if layout.local_len(t, p).is_err() {
            continue;
        }
        reports.push(balance_mask(layout, p, t, spec)?);
    }
    let busiest = |r: &BalanceReport| r.pairs.iter().copied().max().unwrap_or(0);
    match reports.iter().min_by_key(|r| busiest(r)) {
        Some(best) => Ok((best.layout, reports.clone())),
        None => candle_core::bail!("best_layout: no layout splits T = {t} over P = {p} ranks (contiguous and striped need T % P == 0, zigzag T % 2P == 0)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_pairs_is_causal_triangle() -> Result<()> {
        for layout in Layout::ALL {
            for p in [1usize, 2, 3, 4, 8] {
                let t = 48;
                let r = balance(layout, p, t, true)?;
                assert_eq!(
                    r.pairs.iter().sum::<u64>(),
                    (t * (t + 1) / 2) as u64,
                    "{layout} P={p}"
                );
                let f = balance(layout, p, t, false)?;
                assert!(f.pairs.iter().all(|&x| x == (t * t / p) as u64));
                assert!((f.imbalance() - 1.0).abs() < 1e-12);
            }
        }
        Ok(())
    }

    #[test]
    fn zigzag_is_balanced_exactly() -> Result<()> {
        for p in [1usize, 2, 3, 4, 8, 16] {
            let t = 2 * p * 64;
            let r = balance(Layout::Zigzag, p, t, true)?;
            let c = (t / (2 * p)) as u64;
            let expect = 2 * p as u64 * c * c + c;
            assert!(
                r.pairs.iter().all(|&x| x == expect),
                "P={p}: {:?} vs {expect}",
                r.pairs
            );
            assert_eq!(r.imbalance(), 1.0);
            assert!((r.block_imbalance() - 1.0).abs() < 1e-12);
            // T²/(2P) + T/(2P): within 2% of the ideal once c >= 50.
            assert!(
                r.max_dev_from_ideal() < 0.02,
                "P={p}: {}",
                r.max_dev_from_ideal()
            );
        }
        Ok(())
    }

    #[test]
    fn contiguous_matches_closed_form() -> Result<()> {
        for p in [1usize, 2, 3, 4, 8] {
            let c = 32usize;
            let t = p * c;
            let r = balance(Layout::Contiguous, p, t, true)?;
            for (rank, &x) in r.pairs.iter().enumerate() {
                assert_eq!(x, (rank * c * c + c * (c + 1) / 2) as u64);
            }
            let exact = (2 * p * c - c + 1) as f64 / (p * c + 1) as f64;
            assert!((r.imbalance() - exact).abs() < 1e-12, "P={p}");
            let asym = (2 * p - 1) as f64 / p as f64;
            assert!(
                (r.block_imbalance() - asym).abs() < 1e-12,
                "P={p}: {}",
                r.block_imbalance()
            );
            assert!((r.imbalance() - asym).abs() < 1.0 / c as f64);
        }
        Ok(())
    }

    #[test]
    fn striped_is_nearly_balanced() -> Result<()> {
        for p in [2usize, 4, 8] {
            let t = p * 256;
            let r = balance(Layout::Striped, p, t, true)?;
            // rank r's query l (position r + lP) sees r + lP + 1 keys: rank work differs by
            // (T/P)·1 per rank step, relative spread ~ 2P/T.
            assert!(
                r.imbalance() - 1.0 < 2.0 * p as f64 / t as f64 + 1e-12,
                "P={p}: {}",
                r.imbalance()
            );
        }
        Ok(())
    }

    #[test]
    fn bad_divisibility_is_an_error() {
        assert!(balance(Layout::Zigzag, 3, 9, true).is_err());
    }
}
