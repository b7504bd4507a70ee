//! Which blocks a rank computes at each ring step: classification of (query segment × key
//! segment) blocks against the causal mask, the per-step schedule, fusion of adjacent fully
//! visible blocks into one kernel call, and row chunking.

use crate::attention::Mask;
use crate::cp::shard::{Layout, Segment};
use crate::packing::Documents;
use candle_core::Result;

/// What to do with one (query segment × key segment) block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// Every pair masked: skip.
    Skip,
    /// Every pair visible (the mask is `Mask::Full`).
    Full(Mask),
    /// Some pairs visible: causal mask with the segments' global offsets and strides.
    Partial(Mask),
}

/// What a context-parallel attention masks: causal or full, an optional causal sliding
/// window (`window` keys: a query sees itself and the `window - 1` keys before it), optional
/// packed documents. Pairs must pass all three.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MaskSpec<'a> {
    /// Causal on global positions (else full; a window needs causal).
    pub causal: bool,
    /// Sliding window size, `None` for none.
    pub window: Option<usize>,
    /// Packed documents of the global sequence, `None` for one document.
    pub docs: Option<&'a Documents>,
}

impl MaskSpec<'_> {
    /// Causal or full, no window, no documents.
    pub fn plain(causal: bool) -> MaskSpec<'static> {
        MaskSpec { causal, window: None, docs: None }
    }
}

/// Classify the block of query segment `q` against key segment `k` (global positions) under
/// a causal mask with an optional sliding window (ignored when not `causal`): skipped when no
/// pair is visible, full when all are, else partial with the offset/stride causal mask, or
/// the window mask when the window cuts into the block.
pub fn classify_mask(q: &Segment, k: &Segment, causal: bool, window: Option<usize>) -> Block {
    let base = classify(q, k, causal);
    let (Some(w), true) = (window, causal) else { return base };
    if base == Block::Skip {
        return base;
    }
    // distances qp - kp of the block: [q.offset - k.last(), q.last() - k.offset]
    let (dmin, dmax) = (q.offset as i128 - k.last() as i128, q.last() as i128 - k.offset as i128);
    if dmin >= w as i128 {
        return Block::Skip;
    }
    if dmax < w as i128 {
        return base;
    }
    Block::Partial(Mask::Window {
        q_offset: q.offset,
        q_stride: q.stride,
        k_offset: k.offset,
        k_stride: k.stride,
        window: w,
    })
}

/// Classify the block of query segment `q` against key segment `k` (global positions).
pub fn classify(q: &Segment, k: &Segment, causal: bool) -> Block {
    if q.len == 0 || k.len == 0 {
        return Block::Skip;
    }
    if !causal {
        return Block::Full(Mask::Full);
    }
    if k.offset > q.last() {
        Block::Skip
    } else if k.last() <= q.offset {
        Block::Full(Mask::Full)
    } else {
        Block::Partial(Mask::Causal {
            q_offset: q.offset,
            q_stride: q.stride,
            k_offset: k.offset,
            k_stride: k.stride,
        })
    }
}

/// One block of a ring step: query segment `qi` of this rank against key segment `ki` of the
/// K/V chunk held at this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    /// Index into this rank's query segments.
    pub qi: usize,
    /// Index into the source rank's key segments.
    pub ki: usize,
    /// The query segment.
    pub q: Segment,
    /// The key segment.
    pub k: Segment,
    /// How to compute it (never `Skip`).
    pub block: Block,
}

/// The blocks rank `rank` computes when holding source rank `src`'s K/V (fully masked
/// blocks left out). `t` is the global length.
pub fn block_schedule(
    layout: Layout,
    rank: usize,
    src: usize,
    p: usize,
    t: usize,
    causal: bool,
) -> Result<Vec<Scheduled>> {
    block_schedule_mask(layout, rank, src, p, t, MaskSpec::plain(causal))
}

/// [`block_schedule`] under a [`MaskSpec`]: with documents, each (query segment × key segment)
/// block is split along the documents into (query rows of document d × key rows of document
/// d) sub-blocks, classified like any block ([`classify_mask`], window included); pairs of
/// different documents are never computed. The documents must cover `t` (checked by the
/// callers).
pub fn block_schedule_mask(layout: Layout, rank: usize, src: usize, p: usize, t: usize, spec: MaskSpec) -> Result<Vec<Scheduled>> {
    let qs = layout.segments(rank, p, t)?;
    let ks = layout.segments(src, p, t)?;
    let mut out = Vec::new();
    for (qi, q) in qs.iter().enumerate() {
        for (ki, k) in ks.iter().enumerate() {
            let mut push = |q: Segment, k: Segment| {
                let block = classify_mask(&q, &k, spec.causal, spec.window);
                if block != Block::Skip {
                    out.push(Scheduled { qi, ki, q, k, block });
                }
            };
            match spec.docs {
                None => push(*q, *k),
                Some(docs) => {
                    let kparts = docs.split(k);
                    for (dq, qd) in docs.split(q) {
                        if let Some((_, kd)) = kparts.iter().find(|(dk, _)| *dk == dq) {
                            push(qd, *kd);
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The kernel calls of one ring step: [`block_schedule`] with its blocks fused into fewer,
/// larger attention calls (what a GPU wants). Zigzag, `j` = the source rank, `i` = this rank:
///
/// ```text
///  j < i: q chunk i      █ k chunk j  ──► [q chunks i, 2P-1-i] × k chunk j, full     (1 call)
///         q chunk 2P-1-i █ k chunk j
///  j > i: q chunk 2P-1-i █ k chunk j, █ k chunk 2P-1-j
///                                     ──► q chunk 2P-1-i × [k chunks j, 2P-1-j], full (1 call)
///  j = i: q chunk i      ◣ .          ──► all local rows × all local keys, plain causal
///         q chunk 2P-1-i █ ◣              mask on local indices                      (1 call)
/// ```
///
/// - Two `Full` blocks fuse (repeatedly) when they share the key rows and their query rows are
///   adjacent in the local shard, or share the query rows and their key rows are adjacent. A
///   fused segment keeps the first part's `offset` and `stride` (meaningless for a `Full`
///   block, which is never re-classified) and covers both parts' local rows; `qi`/`ki` are the
///   first part's.
/// - Causal, holding its own K/V (`src == rank`): when the rank's segments, in local order,
///   cover its rows contiguously with increasing global positions (contiguous, zigzag,
///   striped), key `b` is visible from query `a` exactly when `b <= a` in local indices, so the
///   step is one block over local coordinates: both segments `{offset: 0, stride: 1, len: T/P,
///   local: 0}` (positions replaced by local indices, which preserves every comparison), with
///   the plain causal mask.
pub fn step_schedule(layout: Layout, rank: usize, src: usize, p: usize, t: usize, causal: bool) -> Result<Vec<Scheduled>> {
    step_schedule_mask(layout, rank, src, p, t, MaskSpec::plain(causal))
}

/// [`step_schedule`] under a [`MaskSpec`]: the blocks of [`block_schedule_mask`], fully
/// visible ones fused where adjacent (blocks of different documents never share key rows, so
/// they never fuse wrongly). With documents or a window the own-K/V step is not collapsed into
/// one local-coordinate causal call (local indices keep the order of positions, not their
/// distances or document boundaries).
pub fn step_schedule_mask(layout: Layout, rank: usize, src: usize, p: usize, t: usize, spec: MaskSpec) -> Result<Vec<Scheduled>> {
    let blocks = block_schedule_mask(layout, rank, src, p, t, spec)?;
    let causal = spec.causal;
    if spec.docs.is_some() || spec.window.is_some() {
        return Ok(fuse_full_blocks(blocks));
    }
    if causal && src == rank && blocks.len() > 1 {
        if let Some(all) = local_order_segment(&layout.segments(rank, p, t)?) {
            let block = classify(&all, &all, true);
            return Ok(vec![Scheduled { qi: 0, ki: 0, q: all, k: all, block }]);
        }
    }
    Ok(fuse_full_blocks(blocks))
}

/// `{offset: 0, stride: 1, len, local: 0}` over all of `segs` when they cover local rows
/// `0..len` in order and their global positions increase along the local rows (so local
/// indices order rows as their positions do); `None` otherwise.
fn local_order_segment(segs: &[Segment]) -> Option<Segment> {
    let mut next_local = 0;
    let mut last_pos: Option<usize> = None;
    for s in segs.iter().filter(|s| s.len > 0) {
        if s.local != next_local || s.stride == 0 || last_pos.is_some_and(|l| s.offset <= l) {
            return None;
        }
        next_local += s.len;
        last_pos = Some(s.last());
    }
    (next_local > 0).then_some(Segment { offset: 0, stride: 1, len: next_local, local: 0 })
}

/// Fuse adjacent fully visible blocks until no two fuse (see [`step_schedule`]); other blocks
/// are kept as they are, in order.
pub fn fuse_full_blocks(mut blocks: Vec<Scheduled>) -> Vec<Scheduled> {
    loop {
        let n = blocks.len();
        blocks = fuse_once(blocks);
        if blocks.len() == n {
            return blocks;
        }
    }
}

/// One pass of [`fuse_full_blocks`]: each `Full` block joins the first earlier one it is
/// adjacent to.
fn fuse_once(blocks: Vec<Scheduled>) -> Vec<Scheduled> {
    let mut out: Vec<Scheduled> = Vec::with_capacity(blocks.len());
    for b in blocks {
        let fused = match b.block {
            Block::Full(_) => out.iter_mut().find_map(|a| {
                if !matches!(a.block, Block::Full(_)) {
                    return None;
                }
                let same = |x: &Segment, y: &Segment| x.local == y.local && x.len == y.len;
                if same(&a.k, &b.k) && a.q.local + a.q.len == b.q.local {
                    a.q.len += b.q.len;
                    Some(())
                } else if same(&a.q, &b.q) && a.k.local + a.k.len == b.k.local {
                    a.k.len += b.k.len;
                    Some(())
                } else {
                    None
                }
            }),
            _ => None,
        };
        if fused.is_none() {
            out.push(b);
        }
    }
    out
}

/// Visible (query, key) pairs of one attention call: rows `q` of a scheduled block against its
/// keys `k`, as [`sub_blocks`] classified it.
pub fn call_pairs(q: &Segment, k: &Segment, block: &Block) -> u64 {
    match block {
        Block::Skip => 0,
        Block::Full(_) => (q.len * k.len) as u64,
        Block::Partial(Mask::Window { window, .. }) => crate::cp::balance::visible_pairs_window(q, k, *window),
        Block::Partial(_) => crate::cp::balance::visible_pairs(q, k, true),
    }
}

/// Split a segment into runs of at most `max` rows (global offsets and local rows adjusted).
pub fn split_rows(seg: &Segment, max: usize) -> Vec<Segment> {
    let max = max.max(1);
    (0..seg.len)
        .step_by(max)
        .map(|i0| Segment {
            offset: seg.offset + i0 * seg.stride,
            stride: seg.stride,
            len: max.min(seg.len - i0),
            local: seg.local + i0,
        })
        .collect()
}

/// The query-row chunks of a scheduled block that see at least one key, with their masks.
/// Row chunks of a `Full` block are `Full` (every subset of a fully visible block is fully
/// visible; a fused block's segments are not arithmetic progressions, so they are never
/// re-classified); chunks of a `Partial` block are classified again.
pub fn sub_blocks(sb: &Scheduled, causal: bool, rows_per_call: usize) -> Vec<(Segment, Block)> {
    sub_blocks_window(sb, causal, None, rows_per_call)
}

/// [`sub_blocks`] with a sliding window (row chunks re-classified with [`classify_mask`]).
pub fn sub_blocks_window(sb: &Scheduled, causal: bool, window: Option<usize>, rows_per_call: usize) -> Vec<(Segment, Block)> {
    split_rows(&sb.q, rows_per_call)
        .into_iter()
        .map(|q| match sb.block {
            Block::Full(m) => (q, Block::Full(m)),
            _ => (q, classify_mask(&q, &sb.k, causal, window)),
        })
        .filter(|(_, b)| *b != Block::Skip)
        .collect()
}

pub(crate) fn mask_of(b: &Block) -> Mask {
    match b {
        Block::Full(m) | Block::Partial(m) => *m,
        Block::Skip => Mask::Full,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(offset: usize, stride: usize, len: usize) -> Segment {
        Segment {
            offset,
            stride,
            len,
            local: 0,
        }
    }

    #[test]
    fn classify_blocks() {
        assert_eq!(classify(&seg(0, 1, 4), &seg(4, 1, 4), true), Block::Skip);
        assert_eq!(
            classify(&seg(4, 1, 4), &seg(0, 1, 4), true),
            Block::Full(Mask::Full)
        );
        assert!(matches!(
            classify(&seg(4, 1, 4), &seg(4, 1, 4), true),
            Block::Partial(_)
        ));
        assert!(matches!(
            classify(&seg(0, 2, 4), &seg(1, 2, 4), true),
            Block::Partial(_)
        ));
        assert_eq!(
            classify(&seg(0, 1, 4), &seg(4, 1, 4), false),
            Block::Full(Mask::Full)
        );
    }

    #[test]
    fn zigzag_schedule_equal_work_every_step() -> Result<()> {
        for p in [2usize, 3, 4, 8] {
            let t = 2 * p * 16;
            let c = 16usize;
            for rank in 0..p {
                for s in 0..p {
                    let src = (rank + p - s) % p;
                    let blocks = block_schedule(Layout::Zigzag, rank, src, p, t, true)?;
                    let half: usize = blocks
                        .iter()
                        .map(|b| match b.block {
                            Block::Partial(_) => b.q.len * b.k.len / 2,
                            _ => b.q.len * b.k.len,
                        })
                        .sum();
                    assert_eq!(half, 2 * c * c, "P={p} rank={rank} step={s}");
                    if src < rank {
                        // Both query chunks against key chunk `src` only.
                        assert!(blocks.iter().all(|b| b.k.offset == src * c));
                        assert_eq!(blocks.len(), 2);
                    } else if src > rank {
                        // Query chunk 2P-1-i against both key chunks.
                        assert!(blocks.iter().all(|b| b.q.offset == (2 * p - 1 - rank) * c));
                        assert_eq!(blocks.len(), 2);
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn contiguous_skips_future_chunks() -> Result<()> {
        let p = 4;
        for rank in 0..p {
            for src in 0..p {
                let n = block_schedule(Layout::Contiguous, rank, src, p, 64, true)?.len();
                assert_eq!(n, usize::from(src <= rank));
            }
        }
        Ok(())
    }

    /// (query local row, key local row) pairs a list of blocks computes, as the ring engine
    /// computes them: 3-row chunks, each call's mask applied to its local row indices.
    fn pairs(blocks: &[Scheduled], causal: bool) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for b in blocks {
            for (qseg, blk) in sub_blocks(b, causal, 3) {
                for qi in qseg.local..qseg.local + qseg.len {
                    for ki in b.k.local..b.k.local + b.k.len {
                        let visible = match blk {
                            Block::Full(m) | Block::Partial(m) => m.visible(qi - qseg.local, ki - b.k.local),
                            Block::Skip => false,
                        };
                        if visible {
                            v.push((qi, ki));
                        }
                    }
                }
            }
        }
        v.sort_unstable();
        v
    }

    #[test]
    fn fused_schedule_computes_exactly_the_visible_pairs() -> Result<()> {
        for (layout, causal) in [Layout::Contiguous, Layout::Zigzag, Layout::Striped].into_iter().flat_map(|l| [(l, true), (l, false)]) {
            for p in [1usize, 2, 3, 4] {
                let t = 2 * p * 5;
                for rank in 0..p {
                    for src in 0..p {
                        let plain = block_schedule(layout, rank, src, p, t, causal)?;
                        let fused = step_schedule(layout, rank, src, p, t, causal)?;
                        let (ks, qs) = (layout.segments(src, p, t)?, layout.segments(rank, p, t)?);
                        // Ground truth: every (local q, local k) pair (causal: with k's position <= q's).
                        let mut want = Vec::new();
                        for q in &qs {
                            for k in &ks {
                                for a in 0..q.len {
                                    for b in 0..k.len {
                                        if !causal || k.offset + b * k.stride <= q.offset + a * q.stride {
                                            want.push((q.local + a, k.local + b));
                                        }
                                    }
                                }
                            }
                        }
                        want.sort_unstable();
                        let what = format!("{layout:?} causal={causal} P={p} rank={rank} src={src}");
                        assert_eq!(pairs(&plain, causal), want, "plain {what}");
                        assert_eq!(pairs(&fused, causal), want, "fused {what}");
                        assert!(fused.len() <= plain.len(), "{what}");
                        if layout == Layout::Zigzag {
                            assert_eq!(fused.len(), 1, "every zigzag step is one call: {what}");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn document_schedule_computes_exactly_the_same_document_pairs() -> Result<()> {
        // Boundaries anywhere (not multiples of the chunk or of P), one-token documents too.
        for lens in [vec![7usize, 1, 12, 4, 16], vec![40], vec![1; 40], vec![19, 21]] {
            let docs = Documents::from_lengths(&lens)?;
            let t = 40;
            for (layout, causal) in Layout::ALL.into_iter().flat_map(|l| [(l, true), (l, false)]) {
                for p in [1usize, 2, 4] {
                    for rank in 0..p {
                        for src in 0..p {
                            let (ks, qs) = (layout.segments(src, p, t)?, layout.segments(rank, p, t)?);
                            let mut want = Vec::new();
                            for q in &qs {
                                for k in &ks {
                                    for a in 0..q.len {
                                        for b in 0..k.len {
                                            if docs.visible(q.offset + a * q.stride, k.offset + b * k.stride, causal) {
                                                want.push((q.local + a, k.local + b));
                                            }
                                        }
                                    }
                                }
                            }
                            want.sort_unstable();
                            let what = format!("{lens:?} {layout:?} causal={causal} P={p} rank={rank} src={src}");
                            let spec = MaskSpec { causal, window: None, docs: Some(&docs) };
                            let plain = block_schedule_mask(layout, rank, src, p, t, spec)?;
                            let fused = step_schedule_mask(layout, rank, src, p, t, spec)?;
                            assert_eq!(pairs(&plain, causal), want, "plain {what}");
                            assert_eq!(pairs(&fused, causal), want, "fused {what}");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn fuse_only_adjacent_full_blocks() {
        let sg = |offset, len, local| Segment { offset, stride: 1, len, local };
        let full = Block::Full(Mask::Full);
        let part = Block::Partial(Mask::causal());
        let blk = |q: Segment, k: Segment, block| Scheduled { qi: 0, ki: 0, q, k, block };
        // Same keys, adjacent query rows: one block covering both.
        let f = fuse_full_blocks(vec![blk(sg(0, 4, 0), sg(0, 2, 0), full), blk(sg(40, 4, 4), sg(0, 2, 0), full)]);
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].q.local, f[0].q.len, f[0].k.len), (0, 8, 2));
        // Same queries, adjacent key rows.
        let f = fuse_full_blocks(vec![blk(sg(9, 4, 0), sg(0, 2, 0), full), blk(sg(9, 4, 0), sg(5, 3, 2), full)]);
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].k.local, f[0].k.len), (0, 5));
        // A gap in the query rows, different key rows, or a partial block: kept apart.
        let gap = vec![blk(sg(0, 4, 0), sg(0, 2, 0), full), blk(sg(40, 4, 5), sg(0, 2, 0), full)];
        assert_eq!(fuse_full_blocks(gap.clone()), gap);
        let other_k = vec![blk(sg(0, 4, 0), sg(0, 2, 0), full), blk(sg(40, 4, 4), sg(0, 2, 2), full)];
        assert_eq!(fuse_full_blocks(other_k.clone()), other_k);
        let partial = vec![blk(sg(0, 4, 0), sg(0, 2, 0), part), blk(sg(40, 4, 4), sg(0, 2, 0), full)];
        assert_eq!(fuse_full_blocks(partial.clone()), partial);
        let partial2 = vec![blk(sg(0, 4, 0), sg(0, 2, 0), full), blk(sg(40, 4, 4), sg(0, 2, 0), part)];
        assert_eq!(fuse_full_blocks(partial2.clone()), partial2);
    }
    #[test]
    fn diagonal_step_in_local_coordinates_only_when_order_is_kept() {
        let sg = |offset, stride, len, local| Segment { offset, stride, len, local };
        // Zigzag rank 1 of 4 (c = 5): chunks 1 and 6, increasing along the local rows.
        let z = [sg(5, 1, 5, 0), sg(30, 1, 5, 5)];
        assert_eq!(local_order_segment(&z), Some(sg(0, 1, 10, 0)));
        // Positions decreasing along the local rows, a gap in the local rows, or overlapping
        // positions: the local order is not the position order, no local-coordinate block.
        assert_eq!(local_order_segment(&[sg(30, 1, 5, 0), sg(5, 1, 5, 5)]), None);
        assert_eq!(local_order_segment(&[sg(5, 1, 5, 0), sg(30, 1, 5, 6)]), None);
        assert_eq!(local_order_segment(&[sg(0, 2, 5, 0), sg(7, 1, 5, 5)]), None);
        assert_eq!(local_order_segment(&[]), None);
        // Striped (stride P) is one increasing segment.
        assert_eq!(local_order_segment(&[sg(2, 4, 5, 0)]), Some(sg(0, 1, 5, 0)));
    }
}
