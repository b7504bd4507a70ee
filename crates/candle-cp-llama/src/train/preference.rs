//! Preference data for DPO ([`super::dpo`]) and KTO: pairs of a chosen and a rejected answer to one
//! prompt (TRL's preference forms, one JSON object per line), each answer one document
//! `prompt ++ answer` whose answer tokens are the targets its log-probability sums over.
//!
//! A training row packs WHOLE pairs (a pair's two documents side by side, never cut: DPO
//! compares the two answers' summed log-probabilities), then pads the rest of the row with a
//! document of token 0 that holds no target:
//!
//! ```text
//! row of T:  | prompt₇ chosen₇ | prompt₇ rejected₇ | prompt₈ chosen₈ | prompt₈ rejected₈ | pad… |
//! docs:        2·7               2·7 + 1             2·8               2·8 + 1             none
//! ```
//!
//! The documents are packed as [`super::PackedStream`]'s are (attention and RoPE per
//! document), so a document's log-probability does not depend on its neighbours: the
//! reference model's is computed once per pair ([`PreferenceSet::in_order`]).
//!
//! KTO's unpaired examples ([`PreferenceSet::from_unpaired`], [`super::kto`]) come in two rows
//! ([`PreferenceSet::sample_split`]): the examples, and their KL documents (each example's
//! prompt with another example's completion), whose log-probability ratios estimate the KL
//! term in a forward without a backward. BCO's ([`super::bco`]) are KTO's without the KL
//! documents ([`PreferenceSet::without_kl_documents`]): rows of examples alone.

use super::data::Sample;
use super::rng::Rng;
use super::sft::{completion_tokens, conversation_tokens, json_lines, MarkedTokens, Tokenize};
use crate::chat::{parse_messages, ChatTemplate};
use candle_core::{bail, Result};
use candle_cp_ops::packing::Documents;
use serde_json::Value;

/// Preference pairs, tokenised: document `2·p` is pair `p`'s chosen answer, `2·p + 1` its
/// rejected one. Or KTO's unpaired examples ([`PreferenceSet::from_unpaired`]): document `2·p`
/// is example `p` (its prompt and completion, desirable or not), `2·p + 1` its KL document
/// (the same prompt with ANOTHER example's completion), sampled in a row of their own.
#[derive(Debug, Clone)]
pub struct PreferenceSet {
    docs: Vec<MarkedTokens>,
    /// KTO: per example, whether its completion is desirable (`None`: DPO pairs).
    desirable: Option<Vec<bool>>,
    /// Unpaired examples: whether their KL documents are sampled and scored (KTO's; BCO
    /// needs none: [`PreferenceSet::without_kl_documents`]).
    kl: bool,
    /// Per pair, the margin a reward model's chosen reward should beat the rejected one's by
    /// (TRL's `margin` column, [`super::reward`]); `None`: none.
    margins: Option<Vec<f64>>,
}

/// A sampled row and, per document of the row, its index in the set (`2·p` chosen, `2·p + 1`
/// rejected; `None` for the padding).
pub type PreferenceRow = (Sample, Vec<Option<usize>>);

impl PreferenceSet {
    /// From (chosen, rejected) documents with their target marks. Errors if there is no pair,
    /// a document's marks are not one per token, or a document has no target.
    pub fn from_pairs(pairs: Vec<(MarkedTokens, MarkedTokens)>) -> Result<Self> {
        if pairs.is_empty() {
            bail!("preference data: no pair")
        }
        let mut docs = Vec::with_capacity(2 * pairs.len());
        for (p, (chosen, rejected)) in pairs.into_iter().enumerate() {
            for (name, (t, m)) in [("chosen", &chosen), ("rejected", &rejected)] {
                if t.len() != m.len() {
                    bail!("preference pair {p}: the {name} document has {} tokens but {} target marks", t.len(), m.len())
                }
                if !m.iter().skip(1).any(|&x| x) {
                    bail!("preference pair {p}: the {name} answer has no token to score (its document's first token is never scored)")
                }
            }
            docs.push(chosen);
            docs.push(rejected);
        }
        Ok(Self { docs, desirable: None, kl: false, margins: None })
    }

    /// KTO's unpaired examples (each a document with its target marks and whether its
    /// completion is desirable), each followed by its KL document: example `p`'s prompt (its
    /// tokens before the first target) with the completion (tokens from the first target on)
    /// of the nearest earlier example, wrapping around, whose prompt differs (skipping the run
    /// of consecutive examples that share `p`'s prompt, as an unpaired preference set has);
    /// the previous example's when every prompt is the same. TRL pairs an example with another
    /// completion of its batch (`_get_kl_dataset`); here the pairing is fixed, so the reference
    /// model scores every KL document once. Errors: fewer than two examples, an example
    /// without a target or a prompt, marks not one per token.
    pub fn from_unpaired(examples: Vec<(MarkedTokens, bool)>) -> Result<Self> {
        if examples.len() < 2 {
            bail!("unpaired (KTO) data: {} example(s); the KL estimate pairs each prompt with another example's completion, so at least 2 are needed", examples.len())
        }
        let mut split = Vec::with_capacity(examples.len());
        for (i, ((t, m), _)) in examples.iter().enumerate() {
            if t.len() != m.len() {
                bail!("example {i}: {} tokens but {} target marks", t.len(), m.len())
            }
            match m.iter().position(|&x| x) {
                Some(0) => bail!("example {i}: no prompt (its first token is a target, and nothing predicts it)"),
                Some(at) => split.push(at),
                None => bail!("example {i}: the completion has no token to score"),
            }
        }
        let n = examples.len();
        let prompt = |p: usize| &examples[p].0 .0[..split[p]];
        // the first example of each run of consecutive examples with one prompt
        let mut run_start = vec![0; n];
        for p in 1..n {
            run_start[p] = if prompt(p) == prompt(p - 1) { run_start[p - 1] } else { p };
        }
        let mut docs = Vec::with_capacity(2 * n);
        for p in 0..n {
            // the nearest earlier example (wrapping around) with another prompt, else the previous one
            let mut q = (run_start[p] + n - 1) % n;
            if prompt(q) == prompt(p) {
                q = (run_start[q] + n - 1) % n;
            }
            if prompt(q) == prompt(p) || q == p {
                q = (p + n - 1) % n;
            }
            let ((t, m), _) = &examples[p];
            let ((ot, om), _) = &examples[q];
            let (a, b) = (split[p], split[q]);
            let kl = ([&t[..a], &ot[b..]].concat(), [&m[..a], &om[b..]].concat());
            docs.push((t.clone(), m.clone()));
            docs.push(kl);
        }
        Ok(Self { docs, desirable: Some(examples.iter().map(|(_, d)| *d).collect()), kl: true, margins: None })
    }

    /// KTO's unpaired examples of JSON lines `text` (blank lines skipped), each line one of
    /// TRL's forms: `{"prompt": .., "completion": .., "label": true | false}` (strings, or
    /// lists of messages through `chat`, as [`PreferenceSet::read`] reads a pair's answer), or
    /// a preference pair in any of [`PreferenceSet::read`]'s forms, which gives two examples
    /// (the chosen answer desirable, the rejected one not: TRL's `unpair_preference_dataset`).
    /// Then [`PreferenceSet::from_unpaired`]. Errors name the line.
    pub fn read_unpaired(text: &str, tokenize: Tokenize, eos: Option<u32>, chat: Option<ChatTemplate>) -> Result<Self> {
        let lines = json_lines(text, "unpaired (KTO) data", |v| {
            if !v.is_object() {
                bail!("expected a JSON object, got {v}")
            }
            match (v.get("completion"), v.get("label")) {
                (Some(c), Some(l)) => {
                    let Some(p) = v.get("prompt") else { bail!("no `prompt` (expected {{\"prompt\": .., \"completion\": .., \"label\": ..}})") };
                    let Some(label) = l.as_bool() else { bail!("`label` must be true or false, got {l}") };
                    Ok(vec![(completion_tokens(p, c, "completion", tokenize, eos, chat)?, label)])
                }
                (Some(_), None) => bail!("no `label` (true: a desirable completion, false: an undesirable one)"),
                _ => {
                    let (c, r) = read_pair(v, tokenize, eos, chat)?;
                    Ok(vec![(c, true), (r, false)])
                }
            }
        })?;
        Self::from_unpaired(lines.into_iter().flatten().collect())
    }

    /// KTO: whether each example's completion is desirable, by example; `None` for DPO pairs.
    pub fn desirable(&self) -> Option<&[bool]> {
        self.desirable.as_deref()
    }

    /// Unpaired examples whose KL documents are never sampled nor scored (BCO's, which has no
    /// KL term, [`super::bco`]): rows pack examples only, the reference pass scores examples
    /// only (a KL document keeps its index `2·p + 1`, unused). Errors for preference pairs.
    pub fn without_kl_documents(mut self) -> Result<Self> {
        if self.desirable.is_none() {
            bail!("PreferenceSet::without_kl_documents: preference pairs have no KL documents (unpaired examples do)")
        }
        self.kl = false;
        Ok(self)
    }

    /// Whether the set's KL documents are sampled and scored (unpaired examples as
    /// [`PreferenceSet::from_unpaired`] builds them; not after
    /// [`PreferenceSet::without_kl_documents`], nor for pairs).
    pub fn has_kl_documents(&self) -> bool {
        self.desirable.is_some() && self.kl
    }

    /// Whether document `d` is ever sampled and scored (all but an unused KL document).
    pub fn is_scored(&self, d: usize) -> bool {
        self.desirable.is_none() || self.kl || d.is_multiple_of(2)
    }

    /// The pairs of JSON lines `text` (blank lines skipped), each line one of TRL's preference
    /// forms:
    ///
    /// - `{"prompt": "...", "chosen": "...", "rejected": "..."}`: each `prompt ++ answer`
    ///   tokenised whole by `tokenize` (with the tokenizer's special tokens), `eos` after each
    ///   answer; the targets are the answer's tokens (those after the prompt's).
    /// - `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`: each answer
    ///   a conversation through `chat`, its assistant turns the targets.
    /// - `{"chosen": [messages], "rejected": [messages]}` (implicit prompt): the messages the
    ///   two share from the start are the prompt.
    ///
    /// A line's number `margin` (TRL's reward-model column, [`PreferenceSet::margins`]) is
    /// kept; either every line has one or none does. Errors name the line.
    pub fn read(text: &str, tokenize: Tokenize, eos: Option<u32>, chat: Option<ChatTemplate>) -> Result<Self> {
        let lines = json_lines(text, "preference data", |v| {
            let pair = read_pair(v, tokenize, eos, chat)?;
            for (name, (_, m)) in [("chosen", &pair.0), ("rejected", &pair.1)] {
                if !m.iter().skip(1).any(|&x| x) {
                    bail!("the {name} answer has no token to score (an empty prompt leaves its first token unscored)")
                }
            }
            let margin = match v.get("margin") {
                None | Some(Value::Null) => None,
                Some(m) => Some(m.as_f64().filter(|x| x.is_finite()).ok_or_else(|| candle_core::Error::Msg(format!("`margin` must be a finite number, got {m}")))?),
            };
            Ok((pair, margin))
        })?;
        let with = lines.iter().filter(|(_, m)| m.is_some()).count();
        if with != 0 && with != lines.len() {
            bail!("preference data: {with} of {} pairs have a `margin`: give every pair one, or none", lines.len())
        }
        let margins: Option<Vec<f64>> = (with > 0).then(|| lines.iter().map(|(_, m)| m.unwrap_or(0.0)).collect());
        Self::from_pairs(lines.into_iter().map(|(p, _)| p).collect())?.with_margins(margins)
    }

    /// Per pair, the margin a reward model's chosen reward should beat the rejected one's by
    /// (TRL's `margin`: the loss `−log σ(r_chosen − r_rejected − margin)`, [`super::reward`]);
    /// `None` without margins.
    pub fn margins(&self) -> Option<&[f64]> {
        self.margins.as_deref()
    }

    /// The same pairs with `margins` (one finite number per pair; `None`: none). Errors for
    /// unpaired examples, another count or a margin that is not finite.
    pub fn with_margins(mut self, margins: Option<Vec<f64>>) -> Result<Self> {
        if let Some(m) = &margins {
            if self.desirable.is_some() || m.len() != self.len() || m.iter().any(|x| !x.is_finite()) {
                bail!("PreferenceSet::with_margins: {} margins (finite) for {} pairs{}", m.len(), self.len(), if self.desirable.is_some() { " of unpaired examples (margins are pairs')" } else { "" })
            }
        }
        self.margins = margins;
        Ok(self)
    }

    /// Number of pairs (KTO: of examples).
    pub fn len(&self) -> usize {
        self.docs.len() / 2
    }

    /// Whether the set has no pair (never true for a constructed set).
    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    /// Document `i` (`2·p` chosen, `2·p + 1` rejected) with its target marks.
    pub fn document(&self, i: usize) -> &MarkedTokens {
        &self.docs[i]
    }

    /// Tokens of pair `p` (both documents).
    pub fn pair_len(&self, p: usize) -> usize {
        self.docs[2 * p].0.len() + self.docs[2 * p + 1].0.len()
    }

    /// Errors naming the longest pair (KTO: the longest example or KL document, each of which
    /// takes a row of its own) when it does not fit in a row of `seq_len` tokens.
    pub fn check_fits(&self, seq_len: usize) -> Result<()> {
        if self.desirable.is_some() {
            let (d, len) = self.docs.iter().enumerate().filter(|&(d, _)| self.is_scored(d)).map(|(d, (t, _))| (d, t.len())).max_by_key(|&(_, l)| l).unwrap_or((0, 0));
            if len > seq_len {
                let which = if d % 2 == 0 { "" } else { "'s KL document" };
                bail!("KTO example {}{which} has {len} tokens, more than a row of seq_len {seq_len}: a document is never cut (raise the sequence length or shorten the example)", d / 2)
            }
            return Ok(());
        }
        let (p, len) = (0..self.len()).map(|p| (p, self.pair_len(p))).max_by_key(|&(_, l)| l).unwrap_or((0, 0));
        if len > seq_len {
            bail!(
                "preference pair {p} has {} + {} tokens, more than a row of seq_len {seq_len}: a pair is never cut (raise the sequence length or shorten the pair)",
                self.docs[2 * p].0.len(),
                self.docs[2 * p + 1].0.len()
            )
        }
        Ok(())
    }

    /// Number of tokens scored (the answers' targets) over the set (not an unused KL
    /// document's).
    pub fn target_count(&self) -> usize {
        self.scored_lengths().iter().enumerate().filter(|&(d, _)| self.is_scored(d)).map(|(_, l)| l).sum::<f64>() as usize
    }

    /// Each answer's scored tokens, by answer index: its marked tokens after the document's
    /// first (which nothing in the document predicts).
    pub fn scored_lengths(&self) -> Vec<f64> {
        self.docs.iter().map(|(_, m)| m.iter().skip(1).filter(|&&x| x).count() as f64).collect()
    }

    /// Total tokens of the set (not an unused KL document's).
    pub fn token_count(&self) -> usize {
        self.docs.iter().enumerate().filter(|&(d, _)| self.is_scored(d)).map(|(_, (t, _))| t.len()).sum()
    }

    /// Largest token id + 1.
    pub fn vocab_needed(&self) -> usize {
        self.docs.iter().flat_map(|(t, _)| t.iter()).max().map_or(0, |&m| m as usize + 1)
    }

    /// Pairs `range` as a set of their own (a held-out split).
    pub fn subset(&self, range: std::ops::Range<usize>) -> Result<Self> {
        if range.start >= range.end || range.end > self.len() {
            bail!("PreferenceSet::subset: pairs {range:?} of {}", self.len())
        }
        Ok(Self {
            docs: self.docs[2 * range.start..2 * range.end].to_vec(),
            desirable: self.desirable.as_ref().map(|d| d[range.clone()].to_vec()),
            kl: self.kl,
            margins: self.margins.as_ref().map(|m| m[range].to_vec()),
        })
    }

    /// One row of `seq_len` tokens: whole pairs from a random one on (in order, wrapping
    /// around, each pair at most once), as many as fit, then the padding (KTO: the examples'
    /// row of [`PreferenceSet::sample_split`]; without KL documents, whole examples as pairs
    /// are). Errors if the first pair does not fit ([`PreferenceSet::check_fits`]).
    pub fn sample(&self, seq_len: usize, rng: &mut Rng) -> Result<PreferenceRow> {
        if self.has_kl_documents() {
            return Ok(self.sample_split(seq_len, rng)?.0);
        }
        if self.desirable.is_some() {
            let examples = self.fitting_examples(seq_len, rng)?;
            return self.pack_docs(&examples.iter().map(|p| 2 * p).collect::<Vec<_>>(), seq_len);
        }
        let first = rng.below(self.len());
        let pairs: Vec<usize> = (0..self.len()).map(|i| (first + i) % self.len()).collect();
        let (row, used) = self.pack(&pairs, seq_len)?;
        if used == 0 {
            self.check_fits(seq_len)?;
        }
        Ok(row)
    }

    /// KTO: a row of examples and a row of their KL documents — the same examples, from a
    /// random one on (in order, wrapping around, each at most once), as many as both rows
    /// fit —, each padded. The trainer scores the KL row in a forward of its own, without
    /// a backward ([`super::kto`]). Errors for pairs or a set without KL documents, or when
    /// the first example does not fit.
    pub fn sample_split(&self, seq_len: usize, rng: &mut Rng) -> Result<(PreferenceRow, PreferenceRow)> {
        if self.desirable.is_none() {
            bail!("PreferenceSet::sample_split: preference pairs are sampled whole (sample)")
        }
        if !self.kl {
            bail!("PreferenceSet::sample_split: the set's KL documents are not used (without_kl_documents): sample its examples alone (sample)")
        }
        let examples = self.fitting_examples(seq_len, rng)?;
        let docs = |of: usize| examples.iter().map(|p| 2 * p + of).collect::<Vec<_>>();
        Ok((self.pack_docs(&docs(0), seq_len)?, self.pack_docs(&docs(1), seq_len)?))
    }

    /// Unpaired examples from a random one on (in order, wrapping around, each at most once), as
    /// many as a row of `seq_len` holds — and, with KL documents, a row of theirs too. Errors
    /// when the first one does not fit ([`PreferenceSet::check_fits`]).
    fn fitting_examples(&self, seq_len: usize, rng: &mut Rng) -> Result<Vec<usize>> {
        let first = rng.below(self.len());
        let (mut examples, mut a, mut b) = (Vec::new(), 0, 0);
        for i in 0..self.len() {
            let p = (first + i) % self.len();
            let (x, y) = (self.docs[2 * p].0.len(), if self.kl { self.docs[2 * p + 1].0.len() } else { 0 });
            if a + x > seq_len || b + y > seq_len {
                break;
            }
            (a, b) = (a + x, b + y);
            examples.push(p);
        }
        if examples.is_empty() {
            self.check_fits(seq_len)?;
        }
        Ok(examples)
    }

    /// Every pair once, in order, packed into rows of `seq_len` (the reference pass; KTO's
    /// documents one by one, each example and KL document in the next row with room; without
    /// KL documents, the examples alone).
    pub fn in_order(&self, seq_len: usize) -> Result<Vec<PreferenceRow>> {
        self.check_fits(seq_len)?;
        if self.desirable.is_some() {
            let (mut rows, mut row, mut len) = (Vec::new(), Vec::new(), 0);
            for (d, (t, _)) in self.docs.iter().enumerate().filter(|&(d, _)| self.is_scored(d)) {
                if len + t.len() > seq_len {
                    rows.push(self.pack_docs(&row, seq_len)?);
                    (row, len) = (Vec::new(), 0);
                }
                row.push(d);
                len += t.len();
            }
            rows.push(self.pack_docs(&row, seq_len)?);
            return Ok(rows);
        }
        let mut rows = Vec::new();
        let mut next = 0;
        while next < self.len() {
            let (row, used) = self.pack(&(next..self.len()).collect::<Vec<_>>(), seq_len)?;
            rows.push(row);
            next += used;
        }
        Ok(rows)
    }

    /// A row of the leading pairs of `pairs` that fit in `seq_len`, and how many were taken.
    fn pack(&self, pairs: &[usize], seq_len: usize) -> Result<(PreferenceRow, usize)> {
        let (mut docs, mut len) = (Vec::new(), 0);
        for &p in pairs {
            if len + self.pair_len(p) > seq_len {
                break;
            }
            len += self.pair_len(p);
            docs.extend([2 * p, 2 * p + 1]);
        }
        Ok((self.pack_docs(&docs, seq_len)?, docs.len() / 2))
    }

    /// A row of documents `docs` (which fit in `seq_len`) side by side, then the padding.
    fn pack_docs(&self, docs: &[usize], seq_len: usize) -> Result<PreferenceRow> {
        let (mut tokens, mut marks, mut lengths, mut ids) = (Vec::with_capacity(seq_len), Vec::with_capacity(seq_len), Vec::new(), Vec::new());
        for &d in docs {
            let (t, m) = &self.docs[d];
            tokens.extend_from_slice(t);
            marks.extend_from_slice(m);
            lengths.push(t.len());
            ids.push(Some(d));
        }
        if tokens.len() > seq_len {
            bail!("PreferenceSet: {} tokens of documents for a row of {seq_len}", tokens.len())
        }
        if tokens.len() < seq_len {
            let pad = seq_len - tokens.len();
            tokens.extend(std::iter::repeat_n(0, pad));
            marks.extend(std::iter::repeat_n(false, pad));
            lengths.push(pad);
            ids.push(None);
        }
        Ok((Sample { tokens, long_range: marks, documents: Some(Documents::from_lengths(&lengths)?) }, ids))
    }
}

/// One line of [`PreferenceSet::read`] (errors without the line number).
fn read_pair(v: &Value, tokenize: Tokenize, eos: Option<u32>, chat: Option<ChatTemplate>) -> Result<(MarkedTokens, MarkedTokens)> {
    if !v.is_object() {
        bail!("expected a JSON object, got {v}")
    }
    let (Some(chosen), Some(rejected)) = (v.get("chosen"), v.get("rejected")) else {
        let missing = if v.get("chosen").is_none() { "chosen" } else { "rejected" };
        bail!("no `{missing}` (expected {{\"prompt\": .., \"chosen\": .., \"rejected\": ..}})")
    };
    match v.get("prompt") {
        Some(p) => Ok((completion_tokens(p, chosen, "chosen", tokenize, eos, chat)?, completion_tokens(p, rejected, "rejected", tokenize, eos, chat)?)),
        None => {
            // implicit prompt: the messages both lists start with
            let (c, r) = (parse_messages(chosen, "`chosen`")?, parse_messages(rejected, "`rejected`")?);
            let shared = c.iter().zip(&r).take_while(|(a, b)| a == b).count();
            if shared == c.len() || shared == r.len() {
                bail!("`chosen` and `rejected` share all of their {shared} leading messages: nothing to compare")
            }
            Ok((conversation_tokens(&c, shared, tokenize, chat)?, conversation_tokens(&r, shared, tokenize, chat)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::sft::bytes_of;

    /// The three forms read; rows hold whole pairs side by side and pad the rest; every pair
    /// comes out of the ordered pass exactly once; bad lines and pairs too long are errors.
    #[test]
    fn reads_pairs_and_packs_them_whole() -> Result<()> {
        let text = concat!(
            r#"{"prompt": "ab", "chosen": "XY", "rejected": "Z"}"#,
            "\n",
            r#"{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "A"}], "rejected": [{"role": "assistant", "content": "B"}]}"#,
            "\n",
            r#"{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "C"}], "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "DE"}]}"#,
            "\n"
        );
        let s = PreferenceSet::read(text, &bytes_of, Some(1), Some(ChatTemplate::ChatMl))?;
        assert_eq!(s.len(), 3);
        assert_eq!(s.document(0), &(vec![97, 98, 88, 89, 1], vec![false, false, true, true, true]));
        assert_eq!(s.document(1), &(vec![97, 98, 90, 1], vec![false, false, true, true]));
        let marked = |d: usize| -> String { s.document(d).0.iter().zip(&s.document(d).1).filter(|(_, m)| **m).map(|(t, _)| *t as u8 as char).collect() };
        assert_eq!((marked(2), marked(3), marked(4), marked(5)), ("A<|im_end|>".into(), "B<|im_end|>".into(), "C<|im_end|>".into(), "DE<|im_end|>".into()));
        // the explicit and implicit conversational prompts render alike
        assert_eq!(&s.document(2).0[..s.document(2).0.len() - 12], &s.document(4).0[..s.document(4).0.len() - 12]);
        let seq = s.pair_len(1) + s.pair_len(2) + 3;
        for seed in 0..20 {
            let (row, ids) = s.sample(seq, &mut Rng::new(seed))?;
            assert_eq!((row.tokens.len(), row.long_range.len()), (seq, seq));
            let docs = row.documents.as_ref().expect("documents");
            let lens = docs.lengths();
            assert_eq!(lens.len(), ids.len());
            let mut at = 0;
            for (len, id) in lens.iter().zip(&ids) {
                match id {
                    Some(d) => {
                        assert_eq!(&row.tokens[at..at + len], &s.document(*d).0[..], "seed {seed}");
                        assert_eq!(&row.long_range[at..at + len], &s.document(*d).1[..]);
                    }
                    None => assert!(row.tokens[at..at + len].iter().all(|&t| t == 0) && !row.long_range[at..at + len].iter().any(|&m| m)),
                }
                at += len;
            }
            // pairs whole: each chosen followed by its rejected
            let real: Vec<usize> = ids.iter().flatten().copied().collect();
            assert!(!real.is_empty() && real.chunks(2).all(|c| c.len() == 2 && c[0] % 2 == 0 && c[1] == c[0] + 1), "{ids:?}");
        }
        let rows = s.in_order(seq)?;
        let all: Vec<usize> = rows.iter().flat_map(|(_, ids)| ids.iter().flatten().copied()).collect();
        assert_eq!(all, (0..6).collect::<Vec<_>>());
        let e = s.in_order(s.pair_len(1) - 1).unwrap_err().to_string();
        assert!(e.contains("preference pair") && e.contains("never cut"), "{e}");
        assert!(s.sample(s.pair_len(0) - 1, &mut Rng::new(0)).is_err() || s.pair_len(0) > s.pair_len(1));
        assert_eq!(s.subset(1..3)?.len(), 2);
        for (bad, want) in [
            (r#"{"prompt": "a", "chosen": "b"}"#, "line 1: no `rejected`"),
            (r#"{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}"#, "`prompt` and `rejected` must both be strings"),
            (r#"{"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "q"}]}"#, "nothing to compare"),
            (r#"{"prompt": "a", "chosen": "", "rejected": "c"}"#, "line 1: the chosen answer has no token"),
            ("\n", "no pair"),
        ] {
            let e = PreferenceSet::read(bad, &bytes_of, None, Some(ChatTemplate::ChatMl)).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
        Ok(())
    }

    /// KTO's forms read (labelled strings, labelled conversations, a pair unpaired into a
    /// desirable and an undesirable example); each example is followed by its KL document: its
    /// own prompt with the completion of the nearest earlier example of another prompt; rows
    /// of examples come with rows of their KL documents; bad lines are errors naming the line.
    #[test]
    fn reads_unpaired_examples_with_their_kl_documents() -> Result<()> {
        let text = concat!(
            r#"{"prompt": "ab", "completion": "XY", "label": true}"#,
            "\n",
            r#"{"prompt": "cd", "chosen": "Z", "rejected": "WV"}"#,
            "\n",
            r#"{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "A"}], "label": false}"#,
            "\n"
        );
        let s = PreferenceSet::read_unpaired(text, &bytes_of, Some(1), Some(ChatTemplate::ChatMl))?;
        assert_eq!(s.len(), 4);
        assert_eq!(s.desirable(), Some(&[true, true, false, false][..]));
        assert_eq!(s.document(0), &(vec![97, 98, 88, 89, 1], vec![false, false, true, true, true]));
        assert_eq!(s.document(2), &(vec![99, 100, 90, 1], vec![false, false, true, true]));
        assert_eq!(s.document(4), &(vec![99, 100, 87, 86, 1], vec![false, false, true, true, true]));
        // KL documents: example 0 takes the last example's completion (another prompt); examples
        // 1 and 2 share the prompt "cd", so both take example 0's; example 3 takes example 2's
        let (conv, conv_marks) = s.document(6).clone();
        let at = conv_marks.iter().position(|&m| m).expect("a target");
        let kl = |p: usize| s.document(2 * p + 1).clone();
        assert_eq!(kl(0), ([&[97, 98][..], &conv[at..]].concat(), [&[false, false][..], &conv_marks[at..]].concat()));
        assert_eq!(kl(1), (vec![99, 100, 88, 89, 1], vec![false, false, true, true, true]));
        assert_eq!(kl(2), (vec![99, 100, 88, 89, 1], vec![false, false, true, true, true]));
        assert_eq!(kl(3), ([&conv[..at], &[87, 86, 1][..]].concat(), [&conv_marks[..at], &[true, true, true][..]].concat()));
        // one prompt throughout: the previous example's completion
        let same = PreferenceSet::read_unpaired("{\"prompt\": \"a\", \"completion\": \"B\", \"label\": true}\n{\"prompt\": \"a\", \"completion\": \"CD\", \"label\": false}\n", &bytes_of, None, None)?;
        assert_eq!((same.document(1).0.clone(), same.document(3).0.clone()), (vec![97, 67, 68], vec![97, 66]));
        // a row of examples and a row of their KL documents, the same examples in order; the
        // examples' row is what `sample` gives
        let longest = (0..s.len()).map(|p| s.document(2 * p).0.len().max(s.document(2 * p + 1).0.len())).max().unwrap_or(0);
        for seed in 0..10 {
            for seq in [longest, longest + 20, 3 * longest] {
                let ((ex, ex_ids), (kl, kl_ids)) = s.sample_split(seq, &mut Rng::new(seed))?;
                assert_eq!((ex.tokens.len(), kl.tokens.len()), (seq, seq));
                let (e, k): (Vec<usize>, Vec<usize>) = (ex_ids.iter().flatten().copied().collect(), kl_ids.iter().flatten().copied().collect());
                assert!(!e.is_empty() && e.iter().all(|d| d % 2 == 0) && k == e.iter().map(|d| d + 1).collect::<Vec<_>>(), "{e:?} {k:?}");
                assert_eq!(s.sample(seq, &mut Rng::new(seed))?.1, ex_ids);
            }
        }
        assert!(s.sample_split(longest - 1, &mut Rng::new(0)).unwrap_err().to_string().contains("a document is never cut"));
        assert!(PreferenceSet::read(&crate::train::dpo::tests::pairs_text(2, 1), &bytes_of, None, None)?.sample_split(64, &mut Rng::new(0)).is_err());
        // the reference pass: every document once, in order, one by one
        let all: Vec<usize> = s.in_order(longest)?.iter().flat_map(|(_, ids)| ids.iter().flatten().copied()).collect();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        // without KL documents (BCO's): rows of examples alone, as many as fit; the reference
        // pass, the counts and the fit check over examples only
        let b = s.clone().without_kl_documents()?;
        assert!(s.has_kl_documents() && !b.has_kl_documents() && (0..8).all(|d| b.is_scored(d) == (d % 2 == 0)));
        let examples: Vec<usize> = (0..s.len()).map(|p| s.document(2 * p).0.len()).collect();
        assert_eq!(b.token_count(), examples.iter().sum::<usize>());
        assert_eq!(b.target_count(), (0..s.len()).map(|p| s.scored_lengths()[2 * p]).sum::<f64>() as usize);
        let widest = *examples.iter().max().expect("examples");
        for seed in 0..10 {
            for seq in [widest, widest + 5, 2 * widest + 3] {
                let (row, ids) = b.sample(seq, &mut Rng::new(seed))?;
                let got: Vec<usize> = ids.iter().flatten().copied().collect();
                assert!(!got.is_empty() && got.iter().all(|d| d % 2 == 0) && row.tokens.len() == seq, "{got:?}");
                // as many as fit: the next example in order would not
                let used: usize = got.iter().map(|&d| examples[d / 2]).sum();
                let next = (got[got.len() - 1] / 2 + 1) % s.len();
                assert!(got.len() == s.len() || used + examples[next] > seq, "{got:?} in {seq}");
            }
        }
        let all: Vec<usize> = b.in_order(widest)?.iter().flat_map(|(_, ids)| ids.iter().flatten().copied()).collect();
        assert_eq!(all, [0, 2, 4, 6]);
        assert!(b.check_fits(widest).is_ok() && b.check_fits(widest - 1).is_err());
        assert!(b.sample_split(3 * widest, &mut Rng::new(0)).unwrap_err().to_string().contains("not used"));
        assert!(!b.subset(1..3)?.has_kl_documents());
        assert!(PreferenceSet::read(&crate::train::dpo::tests::pairs_text(2, 1), &bytes_of, None, None)?.without_kl_documents().is_err());
        // the subset keeps the labels
        assert_eq!(s.subset(1..3)?.desirable(), Some(&[true, false][..]));
        assert!(PreferenceSet::read(text, &bytes_of, None, Some(ChatTemplate::ChatMl)).is_err());
        for (bad, want) in [
            (r#"{"prompt": "a", "completion": "b"}"#, "line 1: no `label`"),
            (r#"{"prompt": "a", "completion": "b", "label": 1}"#, "`label` must be true or false"),
            (r#"{"completion": "b", "label": true}"#, "no `prompt`"),
            ("{\"prompt\": \"a\", \"completion\": \"b\", \"label\": true}\n", "1 example(s)"),
            ("{\"prompt\": \"\", \"completion\": \"b\", \"label\": true}\n{\"prompt\": \"a\", \"completion\": \"b\", \"label\": true}", "example 0: no prompt"),
            ("{\"prompt\": \"a\", \"completion\": \"\", \"label\": true}\n{\"prompt\": \"a\", \"completion\": \"b\", \"label\": true}", "example 0: the completion has no token"),
        ] {
            let e = PreferenceSet::read_unpaired(bad, &bytes_of, None, None).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
        Ok(())
    }
}
