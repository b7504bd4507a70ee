//! Packed sequences: several documents in one global sequence, attention kept inside each
//! document (the "document mask" of packed long-context training).
//!
//! A [`Documents`] value holds the boundaries `cu_seqlens = [0, c1, .., cn = T]` of the global
//! (packed) sequence; document `d` covers global positions `[c_d, c_{d+1})`. The mask is:
//! query at global position `i` sees key at `j` iff `i` and `j` are in the same document and
//! (causal) `j <= i`. The same boundaries apply to every batch row (pack rows with different
//! boundaries into one row of a `B = 1` batch).
//!
//! Every context-parallel op takes the documents through its options
//! ([`crate::cp::CpOpts::documents`], [`crate::ulysses::UlyssesOpts::documents`],
//! [`crate::usp::UspOpts::documents`]) and keeps its layout: documents are **not** padded to
//! `2·P` and may cross shard boundaries anywhere. Each ring step is ONE attention call under a
//! [`crate::attention::Band`] (per query row, the interval of keys of its own document, up to
//! itself when causal), and a step whose queries share no document with the keys it holds is
//! skipped; the schedule view ([`crate::cp::ring::block_schedule_mask`], used for balance and
//! pair counts) splits each block along the documents:
//!
//! ```text
//!   packed T = 16, documents [0,5) [5,13) [13,16), zigzag P = 2 (chunks of 4):
//!   rank 0 holds chunks 0 [0,4) and 3 [12,16); rank 1 holds chunks 1 [4,8) and 2 [8,12)
//!   rank 0, step with rank 1's K/V:  q [0,4) × k [4,12): no common document → skipped
//!                                    q [12,16) × k [4,12): doc 1 only: q [12,13) × k [5,12)
//!                                                          full (all keys are earlier);
//!                                    band: rows 0..4 empty, row 4 keys [1, 8), rows 5..8 empty
//! ```
//!
//! Position ids for RoPE restart at each document ([`Documents::position_ids`]).

use crate::cp::shard::Segment;
use candle_core::{bail, Result};
use std::sync::Arc;

/// Document boundaries of a packed global sequence of `T` tokens (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Documents {
    /// `[0, c1, .., T]`, strictly increasing, at least two entries.
    cu: Arc<[usize]>,
}

impl Documents {
    /// From cumulative lengths `[0, c1, .., T]` (strictly increasing, starting at 0: every
    /// document has at least one token). Errors name the offending entries.
    pub fn from_cu_seqlens(cu: &[usize]) -> Result<Self> {
        if cu.len() < 2 || cu[0] != 0 {
            bail!("Documents: cu_seqlens must start at 0 and hold at least one document, got {cu:?}")
        }
        if let Some(i) = (1..cu.len()).find(|&i| cu[i] <= cu[i - 1]) {
            bail!(
                "Documents: cu_seqlens must be strictly increasing (every document non-empty): entry {i} = {} after {} (cu_seqlens of {} entries)",
                cu[i],
                cu[i - 1],
                cu.len()
            )
        }
        Ok(Self { cu: cu.into() })
    }

    /// From document lengths (each at least 1), in order.
    pub fn from_lengths(lens: &[usize]) -> Result<Self> {
        if let Some(i) = lens.iter().position(|&l| l == 0) {
            bail!("Documents: document {i} has length 0 (lengths {lens:?})")
        }
        let mut cu = Vec::with_capacity(lens.len() + 1);
        cu.push(0);
        for &l in lens {
            cu.push(cu[cu.len() - 1] + l);
        }
        Self::from_cu_seqlens(&cu)
    }

    /// From per-token position ids of the packed sequence (HF-style packing): a document
    /// starts at token 0 and at every token whose position id is 0; within a document the
    /// ids must count up by one. Errors name the first token that breaks this.
    pub fn from_position_ids(pos: &[u32]) -> Result<Self> {
        if pos.is_empty() {
            bail!("Documents::from_position_ids: empty position ids")
        }
        let mut cu = vec![0];
        for i in 1..pos.len() {
            if pos[i] == 0 {
                cu.push(i);
            } else if pos[i] != pos[i - 1] + 1 {
                bail!(
                    "Documents::from_position_ids: token {i} has position id {} after {} (ids must restart at 0 or count up by one; {} tokens)",
                    pos[i],
                    pos[i - 1],
                    pos.len()
                )
            }
        }
        if pos[0] != 0 {
            bail!("Documents::from_position_ids: token 0 has position id {} (a packed sequence starts a document)", pos[0])
        }
        cu.push(pos.len());
        Self::from_cu_seqlens(&cu)
    }

    /// One document covering `t` tokens (`t >= 1`): the plain causal / full mask.
    pub fn single(t: usize) -> Result<Self> {
        Self::from_lengths(&[t])
    }

    /// Total length `T` of the packed sequence.
    pub fn total_len(&self) -> usize {
        self.cu[self.cu.len() - 1]
    }

    /// Number of documents.
    pub fn count(&self) -> usize {
        self.cu.len() - 1
    }

    /// The boundaries `[0, c1, .., T]`.
    pub fn cu_seqlens(&self) -> &[usize] {
        &self.cu
    }

    /// Document lengths, in order.
    pub fn lengths(&self) -> Vec<usize> {
        self.cu.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Global positions `[start, end)` of document `d`; past the last document an empty
    /// range at `T`.
    pub fn range(&self, d: usize) -> (usize, usize) {
        match (self.cu.get(d), self.cu.get(d + 1)) {
            (Some(&a), Some(&b)) => (a, b),
            _ => (self.total_len(), self.total_len()),
        }
    }

    /// The document holding global position `pos`, `None` past the end.
    pub fn doc_of(&self, pos: usize) -> Option<usize> {
        if pos >= self.total_len() {
            return None;
        }
        // the last boundary <= pos
        Some(self.cu.partition_point(|&c| c <= pos) - 1)
    }

    /// Position of each token within its document, `[T]` (the RoPE position ids of a packed
    /// sequence).
    pub fn position_ids(&self) -> Vec<u32> {
        self.cu
            .windows(2)
            .flat_map(|w| 0..(w[1] - w[0]) as u32)
            .collect()
    }

    /// Error unless the documents cover exactly `t` tokens (`what` names the caller and the
    /// shapes that gave `t`).
    pub fn check_len(&self, what: &str, t: usize) -> Result<()> {
        if self.total_len() != t {
            bail!(
                "{what}: documents cover {} tokens ({} documents) but the global sequence has T = {t}",
                self.total_len(),
                self.count()
            )
        }
        Ok(())
    }

    /// Is key position `kp` visible from query position `qp` (same document, and `kp <= qp`
    /// when `causal`)?
    pub fn visible(&self, qp: usize, kp: usize, causal: bool) -> bool {
        (!causal || kp <= qp) && self.doc_of(qp).is_some() && self.doc_of(qp) == self.doc_of(kp)
    }

    /// A fingerprint of the boundaries, for checking that ranks agree (not cryptographic).
    pub fn fingerprint(&self) -> u64 {
        // FNV-1a over the boundaries
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &c in self.cu.iter() {
            for b in (c as u64).to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }

    /// Split a segment of global positions along the documents: `(document, rows of the
    /// segment in that document)` for every document the segment touches, in order. The
    /// pieces keep the segment's stride and cover its rows exactly once.
    pub fn split(&self, seg: &Segment) -> Vec<(usize, Segment)> {
        let mut out = Vec::new();
        if seg.len == 0 || seg.stride == 0 {
            return out;
        }
        let (first, last) = match (self.doc_of(seg.offset), self.doc_of(seg.last())) {
            (Some(a), Some(b)) => (a, b),
            (Some(a), None) => (a, self.count() - 1),
            _ => return out,
        };
        for d in first..=last {
            let (a, b) = self.range(d);
            // rows i with a <= offset + i·stride < b
            let lo = if a <= seg.offset { 0 } else { (a - seg.offset).div_ceil(seg.stride) };
            let hi = if b <= seg.offset { 0 } else { (b - seg.offset).div_ceil(seg.stride).min(seg.len) };
            if lo < hi {
                out.push((
                    d,
                    Segment {
                        offset: seg.offset + lo * seg.stride,
                        stride: seg.stride,
                        len: hi - lo,
                        local: seg.local + lo,
                    },
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_agree_and_reject_bad_input() -> Result<()> {
        let d = Documents::from_lengths(&[5, 8, 3])?;
        assert_eq!(d.cu_seqlens(), &[0, 5, 13, 16]);
        assert_eq!((d.total_len(), d.count()), (16, 3));
        assert_eq!(d.lengths(), vec![5, 8, 3]);
        let pos = d.position_ids();
        assert_eq!(&pos[..7], &[0, 1, 2, 3, 4, 0, 1]);
        assert_eq!(Documents::from_position_ids(&pos)?, d);
        assert_eq!(Documents::from_cu_seqlens(&[0, 5, 13, 16])?, d);
        assert_eq!(d.doc_of(4), Some(0));
        assert_eq!(d.doc_of(5), Some(1));
        assert_eq!(d.doc_of(15), Some(2));
        assert_eq!(d.doc_of(16), None);
        assert_eq!((d.range(1), d.range(3), d.range(9)), ((5, 13), (16, 16), (16, 16)));
        assert!(d.visible(7, 5, true) && !d.visible(7, 4, true) && !d.visible(5, 7, true));
        assert!(d.visible(5, 7, false) && !d.visible(13, 12, false));
        for bad in [Documents::from_lengths(&[3, 0]), Documents::from_cu_seqlens(&[0, 4, 4]), Documents::from_cu_seqlens(&[1, 4])] {
            assert!(bad.is_err());
        }
        let e = Documents::from_position_ids(&[0, 1, 3]).unwrap_err().to_string();
        assert!(e.contains("token 2"), "{e}");
        assert!(Documents::from_position_ids(&[1, 2]).is_err());
        let e = d.check_len("op q [1, 4, 2, 8]", 12).unwrap_err().to_string();
        assert!(e.contains("16 tokens") && e.contains("T = 12"), "{e}");
        assert_ne!(d.fingerprint(), Documents::from_lengths(&[5, 7, 4])?.fingerprint());
        Ok(())
    }

    #[test]
    fn split_covers_every_row_once_in_its_document() -> Result<()> {
        let d = Documents::from_lengths(&[1, 6, 2, 9, 3, 11])?; // T = 32
        for stride in 1..5usize {
            for offset in 0..stride.max(1) * 3 {
                let max_len = (32 - offset).div_ceil(stride);
                for len in 0..=max_len {
                    let seg = Segment { offset, stride, len, local: 7 };
                    let parts = d.split(&seg);
                    let mut rows = Vec::new();
                    for (doc, p) in &parts {
                        assert_eq!(p.stride, stride);
                        for i in 0..p.len {
                            let pos = p.offset + i * stride;
                            assert_eq!(d.doc_of(pos), Some(*doc));
                            // local row consistent with the parent segment
                            assert_eq!(pos, offset + (p.local + i - 7) * stride);
                            rows.push(p.local + i);
                        }
                    }
                    let want: Vec<usize> = (7..7 + len).collect();
                    assert_eq!(rows, want, "offset {offset} stride {stride} len {len}");
                }
            }
        }
        Ok(())
    }
}
