//! Packed training data: a corpus split into documents; each training sequence packs
//! consecutive documents into `T` tokens (the last one cut) and carries their boundaries
//! ([`Documents`]), so the model keeps attention inside each document, restarts RoPE
//! positions per document and trains no target across a boundary
//! ([`crate::packed::shard_batch_packed`]). A stream of prompt / completion examples
//! ([`PackedStream::from_examples`], [`PackedStream::from_marked`], module [`super::sft`]) also marks each token that is a
//! target of the supervised loss (the completions'), carried into the samples.

use super::data::Sample;
use super::rng::Rng;
use candle_core::{bail, Result};
use candle_cp_ops::packing::Documents;

/// A corpus of documents to pack into training sequences.
#[derive(Debug, Clone)]
pub struct PackedStream {
    /// All tokens of the corpus, documents one after the other.
    tokens: Vec<u32>,
    /// Document boundaries in `tokens`: `[0, c1, .., tokens.len()]` (every document non-empty).
    cu: Vec<usize>,
    /// Per token of `tokens`: is it a target of the supervised loss ([`Sample::long_range`]'s
    /// marks; `None`: none marked, every target counts under an all-target loss).
    targets: Option<Vec<bool>>,
}

impl PackedStream {
    /// From tokenised documents, in order; empty ones are dropped. Errors if none is left.
    pub fn from_documents(docs: Vec<Vec<u32>>) -> Result<Self> {
        let mut tokens = Vec::new();
        let mut cu = vec![0];
        for d in docs.into_iter().filter(|d| !d.is_empty()) {
            tokens.extend(d);
            cu.push(tokens.len());
        }
        if cu.len() < 2 {
            bail!("PackedStream: the corpus has no non-empty document")
        }
        Ok(Self { tokens, cu, targets: None })
    }

    /// From prompt / completion examples, in order: each one document `prompt ++ completion`
    /// whose completion tokens are marked as the supervised targets (predicted from the token
    /// before each: the last prompt token predicts the first completion token); empty examples
    /// are dropped. Errors if none is left.
    pub fn from_examples(examples: Vec<(Vec<u32>, Vec<u32>)>) -> Result<Self> {
        Self::from_marked(
            examples
                .into_iter()
                .map(|(p, c)| {
                    let marks = std::iter::repeat_n(false, p.len()).chain(std::iter::repeat_n(true, c.len())).collect();
                    ([p, c].concat(), marks)
                })
                .collect(),
        )
    }

    /// From documents with a mark per token (is it a target of the supervised loss, predicted
    /// from the token before it), in order; empty ones are dropped. Errors if none is left or
    /// a document's marks are not one per token.
    pub fn from_marked(docs: Vec<(Vec<u32>, Vec<bool>)>) -> Result<Self> {
        let (mut tokens, mut targets, mut cu) = (Vec::new(), Vec::new(), vec![0]);
        for (i, (doc, marks)) in docs.into_iter().enumerate().filter(|(_, (d, _))| !d.is_empty()) {
            if marks.len() != doc.len() {
                bail!("PackedStream: document {i} has {} tokens but {} target marks", doc.len(), marks.len())
            }
            tokens.extend(doc);
            targets.extend(marks);
            cu.push(tokens.len());
        }
        if cu.len() < 2 {
            bail!("PackedStream: no non-empty supervised example")
        }
        Ok(Self { tokens, cu, targets: Some(targets) })
    }

    /// Documents `range` of the stream as a stream of their own (their targets kept).
    pub fn subset(&self, range: std::ops::Range<usize>) -> Result<Self> {
        if range.start >= range.end || range.end > self.count() {
            bail!("PackedStream::subset: documents {range:?} of {}", self.count())
        }
        let (a, b) = (self.cu[range.start], self.cu[range.end]);
        Ok(Self {
            tokens: self.tokens[a..b].to_vec(),
            cu: self.cu[range.start..=range.end].iter().map(|c| c - a).collect(),
            targets: self.targets.as_ref().map(|t| t[a..b].to_vec()),
        })
    }

    /// Does the stream mark supervised targets ([`PackedStream::from_examples`])?
    pub fn has_targets(&self) -> bool {
        self.targets.is_some()
    }

    /// Number of tokens marked as supervised targets.
    pub fn target_count(&self) -> usize {
        self.targets.as_ref().map_or(0, |t| t.iter().filter(|&&x| x).count())
    }

    /// Byte-level documents (vocabulary 256) of `text` split on `separator` (e.g. `b"\n\n"`,
    /// blank lines), each trimmed of surrounding ASCII whitespace; empty documents are dropped.
    pub fn from_bytes(text: &[u8], separator: &[u8]) -> Result<Self> {
        Self::from_documents(
            split_documents(text, separator)?
                .into_iter()
                .map(|d| d.iter().map(|&b| b as u32).collect())
                .collect(),
        )
    }

    /// Number of documents.
    pub fn count(&self) -> usize {
        self.cu.len() - 1
    }

    /// Number of tokens of the corpus.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the corpus has no token (never true for a constructed stream).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Tokens of document `i` (`i < count()`).
    pub fn document(&self, i: usize) -> &[u32] {
        &self.tokens[self.cu[i]..self.cu[i + 1]]
    }

    /// Mean document length in tokens.
    pub fn mean_doc_len(&self) -> f64 {
        self.tokens.len() as f64 / self.count() as f64
    }

    /// Draw one sequence of `seq_len` tokens: start at a random document (at a random offset
    /// inside it if it alone is longer than `seq_len`), then append the following documents
    /// (wrapping around the corpus) until `seq_len` tokens; the last one is cut. The sample's
    /// `documents` are the pieces' boundaries, its `long_range` the pieces' target marks (all
    /// false without them). Errors if the corpus is shorter than `seq_len`.
    pub fn sample(&self, seq_len: usize, rng: &mut Rng) -> Result<Sample> {
        if self.tokens.len() < seq_len || seq_len < 2 {
            bail!(
                "PackedStream: corpus has {} tokens in {} documents, a sequence needs seq_len {} (≥ 2)",
                self.tokens.len(),
                self.count(),
                seq_len
            )
        }
        let mut d = rng.below(self.count());
        let first = self.document(d);
        let mut start = 0;
        if first.len() > seq_len {
            start = rng.below(first.len() - seq_len + 1);
        }
        let mut tokens = Vec::with_capacity(seq_len);
        let mut marks = Vec::with_capacity(seq_len);
        let mut lengths = Vec::new();
        while tokens.len() < seq_len {
            let at = self.cu[d] + start;
            let take = (self.cu[d + 1] - at).min(seq_len - tokens.len());
            tokens.extend_from_slice(&self.tokens[at..at + take]);
            match &self.targets {
                Some(t) => marks.extend_from_slice(&t[at..at + take]),
                None => marks.extend(std::iter::repeat_n(false, take)),
            }
            lengths.push(take);
            d = (d + 1) % self.count();
            start = 0;
        }
        Ok(Sample {
            tokens,
            long_range: marks,
            documents: Some(Documents::from_lengths(&lengths)?),
        })
    }

    /// Largest token id + 1.
    pub fn vocab_needed(&self) -> usize {
        self.tokens.iter().max().map_or(0, |&m| m as usize + 1)
    }
}

/// Split `text` on `separator` (non-empty), trim each piece of surrounding ASCII whitespace
/// and drop the empty ones.
pub fn split_documents<'a>(text: &'a [u8], separator: &[u8]) -> Result<Vec<&'a [u8]>> {
    if separator.is_empty() {
        bail!("split_documents: empty document separator")
    }
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        let at = rest.windows(separator.len()).position(|w| w == separator);
        let (piece, next) = match at {
            Some(i) => (&rest[..i], Some(&rest[i + separator.len()..])),
            None => (rest, None),
        };
        let piece = piece.trim_ascii();
        if !piece.is_empty() {
            out.push(piece);
        }
        match next {
            Some(n) => rest = n,
            None => return Ok(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_split_on_blank_lines_and_pack_in_order() -> Result<()> {
        let text = b"alpha one\n\n\n  beta\ntwo  \n\ngamma\n\n\n\n";
        let docs = split_documents(text, b"\n\n")?;
        assert_eq!(docs, vec![&b"alpha one"[..], b"beta\ntwo", b"gamma"]);
        let s = PackedStream::from_bytes(text, b"\n\n")?;
        assert_eq!((s.count(), s.len(), s.vocab_needed()), (3, 9 + 8 + 5, b'w' as usize + 1));
        assert!(split_documents(text, b"").is_err());
        assert!(PackedStream::from_bytes(b"\n\n \n\n", b"\n\n").is_err());
        // every sample: seq_len tokens, consecutive documents (the first maybe entered at an
        // offset, the last cut), boundaries where the documents change
        for seed in 0..40 {
            let smp = s.sample(15, &mut Rng::new(seed))?;
            let d = smp.documents.clone().expect("packed samples carry documents");
            assert_eq!((smp.tokens.len(), d.total_len()), (15, 15));
            let lens = d.lengths();
            // find the first document: the sample's first piece is a suffix of it
            let first = smp.tokens[..lens[0]].to_vec();
            let start = (0..s.count())
                .find(|&i| s.document(i).ends_with(&first) || s.document(i).starts_with(&first))
                .expect("first piece from a document");
            for (k, &len) in lens.iter().enumerate().skip(1) {
                let (a, _) = d.range(k);
                let doc = s.document((start + k) % s.count());
                assert_eq!(&smp.tokens[a..a + len], &doc[..len], "seed {seed}: piece {k}");
                if k + 1 < lens.len() {
                    assert_eq!(len, doc.len(), "only the last piece is cut");
                }
            }
        }
        assert!(s.sample(23, &mut Rng::new(0)).is_err());
        Ok(())
    }

    #[test]
    fn a_long_document_is_entered_at_a_random_offset() -> Result<()> {
        let s = PackedStream::from_documents(vec![(0..100).collect(), vec![7; 3]])?;
        let mut starts = std::collections::HashSet::new();
        for seed in 0..30 {
            let smp = s.sample(10, &mut Rng::new(seed))?;
            if smp.tokens[0] != 7 {
                // a window of document 0, then (maybe) document 1
                let d = smp.documents.expect("documents");
                let first = d.lengths()[0];
                assert!(smp.tokens[..first].windows(2).all(|w| w[1] == w[0] + 1));
                starts.insert(smp.tokens[0]);
            }
        }
        assert!(starts.len() > 3, "{starts:?}");
        Ok(())
    }
}
