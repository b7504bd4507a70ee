//! Masks with packed documents or a sliding window as [`Band`]s: one kernel call per ring step
//! (per row chunk), whatever documents or window edges the step's blocks cut.
//!
//! Every layout keeps a rank's local rows in increasing global position (contiguous: one run;
//! zigzag: chunk `i` then chunk `2P-1-i`; striped: `rank, rank + P, ...`), so the keys a query
//! row sees in the K/V chunk held at a step form one interval of local key rows, and the
//! intervals move forward with the rows: a band ([`Band::from_positions`]).
//!
//! ```text
//!   zigzag P = 2, T = 16, documents [0,6) [6,16), rank 0 (positions 0..4, 12..16) holding
//!   rank 1's K/V (positions 4..8, 8..12):
//!     q 0..4   keys 4,5 are later (causal) → empty rows
//!     q 12..16 document 1 → keys at 6..12 → local key rows [2, 8) : ONE call, band lo = 2
//! ```

use super::MaskSpec;
use crate::attention::Band;
use crate::cp::shard::Layout;
use candle_core::Result;

/// Global positions of `rank`'s local rows, in local order (`T/P` of them).
pub fn local_positions(layout: Layout, rank: usize, p: usize, t: usize) -> Result<Vec<usize>> {
    let mut segs = layout.segments(rank, p, t)?;
    segs.sort_by_key(|s| s.local);
    Ok(segs.iter().flat_map(|s| (0..s.len).map(move |i| s.offset + i * s.stride)).collect())
}

/// The band of `rank`'s queries against the K/V chunk of source rank `src` under `spec`
/// (`[1, T/P]` over `T/P` keys; local indices on both sides). Errors if a layout's local rows
/// were not in increasing position order (none of this crate's layouts).
pub fn step_band(layout: Layout, rank: usize, src: usize, p: usize, t: usize, spec: MaskSpec) -> Result<Band> {
    let q = local_positions(layout, rank, p, t)?;
    let k = if src == rank { q.clone() } else { local_positions(layout, src, p, t)? };
    Band::from_positions(&q, &k, spec)
}

/// Row chunks `[r0, r0 + n)` of `rows` rows, at most `max` each.
pub fn row_chunks(rows: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let max = max.max(1);
    (0..rows).step_by(max).map(move |r0| (r0, max.min(rows - r0)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cp::ring::block_schedule_mask;
    use crate::packing::Documents;

    /// The band of a step holds exactly the pairs of the step's scheduled blocks.
    #[test]
    fn step_band_is_the_block_schedule() -> Result<()> {
        let (p, t) = (3, 48);
        let docs = Documents::from_lengths(&[5, 1, 17, 9, 16])?;
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Striped] {
            for (causal, window, d) in [(true, Some(7), None), (true, None, Some(&docs)), (false, None, Some(&docs)), (true, Some(4), Some(&docs))] {
                let spec = MaskSpec { causal, window, docs: d };
                for rank in 0..p {
                    for src in 0..p {
                        let band = step_band(layout, rank, src, p, t, spec)?;
                        let mut want = vec![false; (t / p) * (t / p)];
                        for sb in block_schedule_mask(layout, rank, src, p, t, spec)? {
                            for i in 0..sb.q.len {
                                for j in 0..sb.k.len {
                                    let (qp, kp) = (sb.q.offset + i * sb.q.stride, sb.k.offset + j * sb.k.stride);
                                    let vis = (!causal || kp <= qp)
                                        && window.is_none_or(|w| qp - kp < w)
                                        && d.is_none_or(|d| d.doc_of(qp) == d.doc_of(kp));
                                    if vis {
                                        want[(sb.q.local + i) * (t / p) + sb.k.local + j] = true;
                                    }
                                }
                            }
                        }
                        for i in 0..t / p {
                            for j in 0..t / p {
                                assert_eq!(band.visible(0, i, j), want[i * (t / p) + j], "{layout:?} {spec:?} rank {rank} src {src} ({i}, {j})");
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
