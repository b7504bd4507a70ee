//! Training data: a synthetic long-range key→value recall task, plain token streams and
//! packed documents ([`super::packed_data::PackedStream`]).
//!
//! Batches are drawn *statelessly*: the sample for (step, row) comes from [`Rng::derive`] of
//! the run seed and those indices. The data position after a restart is
//! therefore just the step number, and resuming reproduces the exact same batches.

use super::packed_data::PackedStream;
use super::preference::{PreferenceRow, PreferenceSet};
use super::rng::Rng;
use candle_core::{bail, Result};
use candle_cp_ops::packing::Documents;

/// The items kept to train on and those held out of `n` (`what`: their name in the error): the
/// last `fraction` of them, one at least, one left to train on.
fn split_counts(n: usize, fraction: f64, what: &str) -> Result<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let held = ((n as f64 * fraction).round() as usize).max(1);
    if held >= n {
        bail!("held-out split: {n} {what}, {held} held out leave none to train on")
    }
    Ok((0..n - held, n - held..n))
}

/// One training sequence of global length `T`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Token ids, length `T`.
    pub tokens: Vec<u32>,
    /// `long_range[t]` (t ≥ 1) marks token `t` as a target of the selective loss
    /// ([`crate::train::TrainConfig::long_range_only`]), predicted from position `t - 1`: in the
    /// recall task a long-range target (only predictable by attending to tokens at least `T/4`
    /// positions earlier), in prompt / completion data a completion token
    /// ([`super::PackedStream::from_examples`]). `long_range[0]` is false for the recall task.
    /// Length `T`.
    pub long_range: Vec<bool>,
    /// Packed documents of the sequence (boundaries covering `T`), or `None` for one
    /// sequence. A trainer shards rows with documents with
    /// [`crate::packed::shard_batch_packed`].
    pub documents: Option<Documents>,
}

/// Multi-query associative recall over a long sequence.
///
/// Each sequence draws a random map `key → value`. Vocabulary: `[0, n_fill)` filler,
/// `[n_fill, n_fill + n_keys)` keys, then `n_values` values, then (fused form only)
/// `n_keys · n_values` pair tokens. A sequence of length `T` has three regions:
/// - `[0, T/4)`: filler;
/// - `[T/4, T/2)`: densely packed pairs `k map[k]` (every key at least once, the rest random
///   keys; repeats agree) — or, fused, one token `pair(k, map[k])` per position;
/// - `[T/2, 3T/4)`: filler;
/// - `[3T/4, T)`: `n_queries` queries `k map[k]` (fused: `k pair(k, map[k])`) for DISTINCT
///   keys at random slots, filler elsewhere. Each query's value is a long-range target: since no key is queried twice,
///   the answer is nowhere in the last half — only in the first half, at least `T/4` tokens
///   earlier.
///
/// Under contiguous (ring) and zigzag sharding over `P` ranks (`T` divisible by `2P`, `P` a
/// power of two ≤ `T/8`), the second quarter and the last quarter live on DISJOINT ranks, so
/// every answer must be read from another rank (checked by the unit tests). Chance loss on the long-range targets is
/// `ln(n_values)`; a model that has learnt the lookup gets close to 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvRecall {
    /// Global sequence length `T` (≥ 16).
    pub seq_len: usize,
    /// Number of filler tokens.
    pub n_fill: usize,
    /// Number of key tokens (≤ `T/8`).
    pub n_keys: usize,
    /// Number of value tokens.
    pub n_values: usize,
    /// Queries per sequence (≤ `n_keys` and ≤ `T/8`).
    pub n_queries: usize,
    /// Store each pair as ONE token `pair(k, v)` instead of two adjacent tokens `k v`, and
    /// make the answer to query `k` that pair token: one attention layer then solves the
    /// lookup (attend from `k` to the pair tokens of key `k`, copy the token), instead of the
    /// two-layer induction circuit the two-token form needs. A 2-layer, 64-wide model learns
    /// the fused form in a few hundred steps (examples/README.md); the two-token form did not
    /// leave chance level in 800 steps in our runs.
    pub fused: bool,
}

impl KvRecall {
    /// A task of length `seq_len` with 16 filler, `min(16, T/8)` keys, 16 values and
    /// `min(16, T/8)` queries, two-token pairs.
    pub fn new(seq_len: usize) -> Result<Self> {
        let (n_keys, n_queries) = (16.min(seq_len / 8), 16.min(seq_len / 8));
        let t = Self {
            seq_len,
            n_fill: 16,
            n_keys,
            n_values: 16,
            n_queries,
            fused: false,
        };
        t.validate()?;
        Ok(t)
    }

    /// Check the parameters fit together.
    pub fn validate(&self) -> Result<()> {
        if self.seq_len < 16 {
            bail!("KvRecall: seq_len {} must be at least 16", self.seq_len)
        }
        if self.n_keys == 0 || self.n_keys > self.seq_len / 8 {
            bail!(
                "KvRecall: n_keys {} must be in 1..=seq_len/8 ({})",
                self.n_keys,
                self.seq_len / 8
            )
        }
        if self.n_queries == 0 || self.n_queries > self.n_keys || self.n_queries > self.seq_len / 8
        {
            bail!(
                "KvRecall: n_queries {} must be in 1..=min(n_keys {}, seq_len/8 {})",
                self.n_queries,
                self.n_keys,
                self.seq_len / 8
            )
        }
        if self.n_fill == 0 || self.n_values == 0 {
            bail!(
                "KvRecall: n_fill {} and n_values {} must be > 0",
                self.n_fill,
                self.n_values
            )
        }
        Ok(())
    }

    /// Smallest model vocabulary that holds every token of the task.
    pub fn vocab_needed(&self) -> usize {
        self.n_fill
            + self.n_keys
            + self.n_values
            + if self.fused {
                self.n_keys * self.n_values
            } else {
                0
            }
    }

    /// The positions `[T/4, T/2)` (rounded to even) that hold the stored pairs.
    pub fn store_region(&self) -> (usize, usize) {
        (
            (self.seq_len / 4).next_multiple_of(2),
            (self.seq_len / 2) & !1,
        )
    }

    /// First position of the query region (even, ≥ `3T/4`).
    pub fn query_start(&self) -> usize {
        (3 * self.seq_len).div_ceil(4).next_multiple_of(2)
    }

    /// Draw one sequence.
    pub fn sample(&self, rng: &mut Rng) -> Sample {
        let t = self.seq_len;
        let mut tokens: Vec<u32> = (0..t).map(|_| rng.below(self.n_fill) as u32).collect();
        let mut long_range = vec![false; t];
        let key0 = self.n_fill as u32;
        let val0 = (self.n_fill + self.n_keys) as u32;
        let pair0 = (self.n_fill + self.n_keys + self.n_values) as u32;
        let map: Vec<u32> = (0..self.n_keys)
            .map(|_| rng.below(self.n_values) as u32)
            .collect();
        // Second quarter: every key once (random slots), the other slots random keys. A slot
        // is one position (fused) or two.
        let (s0, s1) = self.store_region();
        let width = if self.fused { 1 } else { 2 };
        let slots = (s1 - s0) / width;
        let mut keys: Vec<usize> = (0..slots)
            .map(|i| {
                if i < self.n_keys {
                    i
                } else {
                    rng.below(self.n_keys)
                }
            })
            .collect();
        rng.shuffle(&mut keys);
        for (slot, &k) in keys.iter().enumerate() {
            let p = s0 + width * slot;
            if self.fused {
                tokens[p] = pair0 + (k * self.n_values) as u32 + map[k];
            } else {
                tokens[p] = key0 + k as u32;
                tokens[p + 1] = val0 + map[k];
            }
        }
        // Last quarter: distinct keys at random slots.
        let q0 = self.query_start();
        let mut qslots: Vec<usize> = (0..(t - q0) / 2).collect();
        rng.shuffle(&mut qslots);
        let mut qkeys: Vec<usize> = (0..self.n_keys).collect();
        rng.shuffle(&mut qkeys);
        for (&slot, &k) in qslots.iter().zip(qkeys.iter()).take(self.n_queries) {
            let p = q0 + 2 * slot;
            tokens[p] = key0 + k as u32;
            tokens[p + 1] = if self.fused {
                pair0 + (k * self.n_values) as u32 + map[k]
            } else {
                val0 + map[k]
            };
            long_range[p + 1] = true;
        }
        Sample {
            tokens,
            long_range,
            documents: None,
        }
    }

    /// Number of long-range targets per sequence.
    pub fn long_range_targets(&self) -> usize {
        self.n_queries
    }
}

/// A token stream to fine-tune on (a tokenised text file); windows of `T` tokens are drawn at
/// random offsets.
#[derive(Debug, Clone)]
pub struct TokenStream {
    /// All tokens of the corpus.
    pub tokens: Vec<u32>,
}

impl TokenStream {
    /// Byte-level tokens of `text` (vocabulary 256).
    pub fn from_bytes(text: &[u8]) -> Self {
        Self {
            tokens: text.iter().map(|&b| b as u32).collect(),
        }
    }

    /// Draw a window of `seq_len` consecutive tokens. Errors if the corpus is shorter.
    pub fn sample(&self, seq_len: usize, rng: &mut Rng) -> Result<Sample> {
        if self.tokens.len() < seq_len || seq_len < 2 {
            bail!(
                "TokenStream: corpus has {} tokens, a window needs seq_len {} (≥ 2)",
                self.tokens.len(),
                seq_len
            )
        }
        let start = rng.below(self.tokens.len() - seq_len + 1);
        Ok(Sample {
            tokens: self.tokens[start..start + seq_len].to_vec(),
            long_range: vec![false; seq_len],
            documents: None,
        })
    }

    /// Largest token id + 1.
    pub fn vocab_needed(&self) -> usize {
        self.tokens.iter().max().map_or(0, |&m| m as usize + 1)
    }
}

/// Where a run's sequences come from.
#[derive(Debug, Clone)]
pub enum DataSource {
    /// The synthetic long-range recall task.
    Recall(KvRecall),
    /// Windows of a tokenised corpus.
    Text(TokenStream),
    /// Consecutive documents of a corpus packed into each sequence (samples carry their
    /// [`Documents`]).
    Packed(PackedStream),
    /// Preference pairs packed whole into each sequence, for DPO
    /// ([`super::TrainConfig::dpo`], [`super::preference`]).
    Preference(PreferenceSet),
    /// Prompts and their reference answers, whose completions GRPO samples and rewards
    /// ([`super::TrainConfig::grpo`], [`super::grpo`]).
    Prompts(super::grpo::PromptSet),
    /// Stepwise-supervised examples packed whole into each sequence, for a process reward
    /// model ([`super::TrainConfig::prm`], [`super::prm`]).
    Steps(super::prm::StepSet),
}

impl DataSource {
    /// Rows `first_row .. first_row + count` of optimizer step `step`'s global batch (all
    /// micro-batches of a step are numbered consecutively: micro-batch `m` of `b` rows holds
    /// rows `m·b ..`). Each row is drawn from its own stream derived from (seed, step, row), so
    /// any step can be regenerated after a restart, and the same rows come out whether a step
    /// is one batch of `2b` rows or two micro-batches of `b`.
    pub fn rows(
        &self,
        seed: u64,
        step: usize,
        first_row: usize,
        count: usize,
        seq_len: usize,
    ) -> Result<Vec<Sample>> {
        (first_row..first_row + count)
            .map(|row| {
                let mut rng = Rng::derive(seed, &[step as u64, row as u64]);
                match self {
                    DataSource::Recall(task) => {
                        if task.seq_len != seq_len {
                            bail!(
                                "recall task built for T={} but T={} requested",
                                task.seq_len,
                                seq_len
                            )
                        }
                        Ok(task.sample(&mut rng))
                    }
                    DataSource::Text(s) => s.sample(seq_len, &mut rng),
                    DataSource::Packed(s) => s.sample(seq_len, &mut rng),
                    DataSource::Preference(s) => Ok(s.sample(seq_len, &mut rng)?.0),
                    DataSource::Steps(s) => Ok(s.sample(seq_len, &mut rng)?.0),
                    DataSource::Prompts(_) => bail!("prompts are not rows: GRPO samples their completions (TrainConfig::grpo)"),
                }
            })
            .collect()
    }

    /// Split off held-out data for [`super::EvalConfig::data`]: a corpus's last `fraction` of
    /// tokens (a window's worth at least: errors when either part is shorter than `seq_len`),
    /// a packed corpus's last `fraction` of documents (one at least, one left to train on);
    /// the synthetic task is its own held-out source (the evaluation salts the seed). Returns
    /// (training data, held-out data).
    pub fn split_held_out(&self, fraction: f64, seq_len: usize) -> Result<(DataSource, DataSource)> {
        if !(fraction > 0.0 && fraction < 1.0) {
            bail!("held-out fraction {fraction}: must be in (0, 1)")
        }
        match self {
            DataSource::Recall(_) => Ok((self.clone(), self.clone())),
            DataSource::Text(s) => {
                let n = s.tokens.len();
                let cut = n - ((n as f64 * fraction).round() as usize).max(seq_len).min(n);
                if cut < seq_len {
                    bail!("held-out split: {n} tokens leave {cut} to train on and {} held out, each part needs a window of seq_len {seq_len}", n - cut)
                }
                let part = |r: std::ops::Range<usize>| DataSource::Text(TokenStream { tokens: s.tokens[r].to_vec() });
                Ok((part(0..cut), part(cut..n)))
            }
            DataSource::Packed(s) => {
                let (train, held) = split_counts(s.count(), fraction, "documents")?;
                Ok((DataSource::Packed(s.subset(train)?), DataSource::Packed(s.subset(held)?)))
            }
            DataSource::Preference(s) => {
                let (train, held) = split_counts(s.len(), fraction, "preference pairs")?;
                Ok((DataSource::Preference(s.subset(train)?), DataSource::Preference(s.subset(held)?)))
            }
            DataSource::Steps(s) => {
                let (train, held) = split_counts(s.len(), fraction, "stepwise examples")?;
                Ok((DataSource::Steps(s.subset(train)?), DataSource::Steps(s.subset(held)?)))
            }
            DataSource::Prompts(s) => {
                let (train, held) = split_counts(s.len(), fraction, "prompts")?;
                Ok((DataSource::Prompts(s.subset(train)?), DataSource::Prompts(s.subset(held)?)))
            }
        }
    }

    /// Smallest model vocabulary that holds every token.
    pub fn vocab_needed(&self) -> usize {
        match self {
            DataSource::Recall(t) => t.vocab_needed(),
            DataSource::Text(s) => s.vocab_needed(),
            DataSource::Packed(s) => s.vocab_needed(),
            DataSource::Preference(s) => s.vocab_needed(),
            DataSource::Prompts(s) => s.vocab_needed(),
            DataSource::Steps(s) => s.vocab_needed(),
        }
    }

    /// [`DataSource::rows`] of preference pairs with each row's documents' answer indices
    /// (the same rows); errors for other data.
    pub fn preference_rows(&self, seed: u64, step: usize, first_row: usize, count: usize, seq_len: usize) -> Result<Vec<PreferenceRow>> {
        let DataSource::Preference(s) = self else { bail!("preference rows: the data holds no preference pairs") };
        (first_row..first_row + count).map(|row| s.sample(seq_len, &mut Rng::derive(seed, &[step as u64, row as u64]))).collect()
    }

    /// [`DataSource::rows`] of stepwise examples with each row's per-token labels (the same
    /// rows); errors for other data.
    pub fn step_rows(&self, seed: u64, step: usize, first_row: usize, count: usize, seq_len: usize) -> Result<Vec<super::prm::StepRow>> {
        let DataSource::Steps(s) = self else { bail!("step rows: the data holds no stepwise examples") };
        (first_row..first_row + count).map(|row| s.sample(seq_len, &mut Rng::derive(seed, &[step as u64, row as u64]))).collect()
    }

    /// KTO: the rows of KL documents matching [`DataSource::rows`]' rows of examples (the
    /// second row of [`PreferenceSet::sample_split`]); errors for other data.
    pub fn kl_rows(&self, seed: u64, step: usize, first_row: usize, count: usize, seq_len: usize) -> Result<Vec<PreferenceRow>> {
        let DataSource::Preference(s) = self else { bail!("KL rows: the data holds no unpaired examples") };
        (first_row..first_row + count).map(|row| Ok(s.sample_split(seq_len, &mut Rng::derive(seed, &[step as u64, row as u64]))?.1)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recall_targets_are_determined_by_a_distant_pair_only() {
        for &(t, fused) in &[
            (16usize, false),
            (64, true),
            (1000, false),
            (1024, true),
            (1024, false),
        ] {
            let mut task = KvRecall::new(t).unwrap();
            task.fused = fused;
            for seed in 0..20 {
                let s = task.sample(&mut Rng::new(seed));
                assert_eq!(s.tokens.len(), t);
                assert!(s.tokens.iter().all(|&x| (x as usize) < task.vocab_needed()));
                let key0 = task.n_fill as u32;
                let val0 = (task.n_fill + task.n_keys) as u32;
                let pair0 = val0 + task.n_values as u32;
                let is_key = |x: u32| (key0..val0).contains(&x);
                // The map as stored in [T/4, T/2); repeats must agree; every key present.
                let mut table = std::collections::HashMap::new();
                let (s0, s1) = task.store_region();
                assert!(
                    s.tokens[..s0].iter().all(|&x| x < key0),
                    "key/value/pair before T/4"
                );
                for p in s0..s1 {
                    let (k, v) = if fused && s.tokens[p] >= pair0 {
                        let i = s.tokens[p] - pair0;
                        (
                            key0 + i / task.n_values as u32,
                            val0 + i % task.n_values as u32,
                        )
                    } else if !fused && is_key(s.tokens[p]) {
                        (s.tokens[p], s.tokens[p + 1])
                    } else {
                        continue;
                    };
                    assert!(v >= val0 && v < pair0, "key not paired with a value");
                    assert_eq!(*table.entry(k).or_insert(v), v, "inconsistent pair");
                }
                assert_eq!(table.len(), task.n_keys);
                // No key, value or pair between T/2 and the query region.
                assert!(s.tokens[t / 2..task.query_start()]
                    .iter()
                    .all(|&x| x < key0));
                let n_lr = s.long_range.iter().filter(|&&b| b).count();
                assert_eq!(n_lr, task.long_range_targets());
                let mut queried = std::collections::HashSet::new();
                for p in 1..t {
                    if s.long_range[p] {
                        assert!(p > task.query_start());
                        let key = s.tokens[p - 1];
                        let v = table[&key];
                        // Fused: the answer is the stored pair token itself; else the value.
                        let want = if fused {
                            pair0 + (key - key0) * task.n_values as u32 + (v - val0)
                        } else {
                            v
                        };
                        assert_eq!(s.tokens[p], want, "target is not the stored value");
                        assert!(queried.insert(key), "key queried twice");
                        // The answer appears nowhere in the second half before the target.
                        assert!(p > s1 + t / 4 - 2, "query too close to the stored pairs");
                        assert!(
                            !s.tokens[t / 2..p].contains(&s.tokens[p]) || {
                                // a value token may repeat (another key with the same value) but
                                // never right after the same key
                                (t / 2..p - 1).all(|q| {
                                    !(s.tokens[q] == key && s.tokens[q + 1] == s.tokens[p])
                                })
                            }
                        );
                    } else if p >= task.query_start() {
                        assert!(s.tokens[p] < val0, "unmarked value in the query region");
                    }
                }
            }
        }
    }

    /// Rank of global position `p` under zigzag (2P chunks, rank i holds i and 2P-1-i) and
    /// contiguous sharding of length `t` over `p_ranks`.
    fn zigzag_rank(p: usize, t: usize, ranks: usize) -> usize {
        let c = p / (t / (2 * ranks));
        if c < ranks {
            c
        } else {
            2 * ranks - 1 - c
        }
    }

    #[test]
    fn answers_live_on_other_ranks_under_ring_and_zigzag() {
        for &t in &[64usize, 512, 1024] {
            for &ranks in &[2usize, 4, 8] {
                if t % (2 * ranks) != 0 || ranks > t / 8 {
                    continue;
                }
                let mut task = KvRecall::new(t).unwrap();
                task.fused = true;
                let (s0, s1) = task.store_region();
                for store in s0..s1 {
                    for q in task.query_start()..t {
                        assert_ne!(
                            zigzag_rank(store, t, ranks),
                            zigzag_rank(q, t, ranks),
                            "zigzag T={t} P={ranks}"
                        );
                        assert_ne!(
                            store / (t / ranks),
                            q / (t / ranks),
                            "contiguous T={t} P={ranks}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn batches_are_a_pure_function_of_their_indices() {
        let src = DataSource::Recall(KvRecall::new(64).unwrap());
        let a = src.rows(1, 5, 0, 2, 64).unwrap();
        let b = src.rows(1, 5, 0, 2, 64).unwrap();
        assert_eq!(a, b);
        assert_ne!(a[0], a[1]);
        assert_ne!(a, src.rows(1, 6, 0, 2, 64).unwrap());
        assert_ne!(a, src.rows(2, 5, 0, 2, 64).unwrap());
        assert_eq!(a[1..], src.rows(1, 5, 1, 1, 64).unwrap()[..]);
        assert!(src.rows(1, 5, 0, 1, 32).is_err());
    }

    #[test]
    fn bad_parameters_are_errors() {
        assert!(KvRecall::new(8).is_err());
        let mut t = KvRecall::new(64).unwrap();
        t.n_queries = 9;
        assert!(t.validate().is_err());
        t.n_queries = 4;
        t.n_keys = 9;
        assert!(t.validate().is_err());
        let s = TokenStream::from_bytes(b"hello");
        assert!(s.sample(6, &mut Rng::new(0)).is_err());
        let w = s.sample(5, &mut Rng::new(0)).unwrap();
        assert_eq!(
            w.tokens,
            b"hello".iter().map(|&b| b as u32).collect::<Vec<_>>()
        );
    }
}
