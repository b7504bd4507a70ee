//! Process reward models: transformers' `*ForTokenClassification` — the decoder with a score
//! head `score.weight` `[n, h]` and `score.bias` `[n]` in place of the LM head, every token
//! scored, dropout on the head's input while training — on every layout. TRL's `PRMTrainer`
//! trains one to classify each reasoning step, read at the step's last token (its separator):
//!
//! ```text
//!   document:   | prompt ............ | step₁ ⏎ | step₂ ⏎ | step₃ ⏎ |
//!   labels:       -100 ...       -100   ..   1    ..   1    ..   0
//!   logits:     [T, n] = drop(hidden) · scoreᵀ + bias            (the loss: cross-entropy at
//!                                                                  the labelled tokens)
//! ```
//!
//! The scores are per token, so every rank scores its own tokens and nothing crosses ranks
//! but the loss's sums ([`crate::train::prm`]). The head is replicated over TP (`n · (h + 1)`
//! numbers) and its gradients summed as a norm's. Dropout's mask is keyed on the token's index
//! in the global batch ([`ClassifierDropout`]), so every layout drops what one device drops.
//!
//! A process reward model loads from a `*ForTokenClassification` checkpoint or from a causal
//! LM (the head drawn as transformers draws it: weight `N(0, 0.02²)`, bias 0;
//! [`crate::reward::load_hf_sharded_reward`] with a [`TokenClassifier`]) and saves as the token
//! classifier of its architecture (`LlamaForTokenClassification`, ...), with its
//! `classifier_dropout`.

use crate::{Llama, LlamaConfig, ParallelCtx};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_ops::packing::Documents;
use candle_nn::VarMap;
use std::path::Path;

/// The token classifier's bias parameter name (transformers').
pub const SCORE_BIAS: &str = "score.bias";

/// What makes a reward model a token classifier ([`LlamaConfig::token_classifier`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenClassifier {
    /// Dropout probability on the head's input while training, in `[0, 1)` (transformers'
    /// `classifier_dropout`, else `hidden_dropout`, else [`TokenClassifier::HF_DROPOUT`]).
    pub dropout: f64,
    /// Whether the head has its bias `score.bias` (transformers' `token_classification_bias`,
    /// true unless a config says false).
    pub bias: bool,
}

impl TokenClassifier {
    /// transformers' dropout of a token classifier whose config names none.
    pub const HF_DROPOUT: f64 = 0.1;

    /// A token classifier with dropout `p` and a biased head; errors unless `p` is in `[0, 1)`.
    pub fn new(p: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            bail!("token classifier: dropout {p} must be in [0, 1)")
        }
        Ok(Self { dropout: p, bias: true })
    }

    /// The same classifier with a head with or without its bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
}

impl LlamaConfig {
    /// The same config as a token classifier (`Some`, with [`LlamaConfig::num_labels`]) or not.
    pub fn with_token_classifier(mut self, t: Option<TokenClassifier>) -> Self {
        self.token_classifier = t;
        self
    }

    /// The class transformers names this model by: its causal LM, sequence classifier or token
    /// classifier (`LlamaForCausalLM`, `LlamaForSequenceClassification`,
    /// `LlamaForTokenClassification`).
    pub fn hf_class(&self) -> String {
        match (self.num_labels, self.token_classifier) {
            (Some(_), Some(_)) => self.arch().hf_token_class(),
            (n, _) => self.arch().hf_class(n),
        }
    }
}

/// The config's token-classifier checks: labels and a dropout in `[0, 1)` (LoRA adapters
/// train the head whole, weight and bias, as PEFT's `TOKEN_CLS` task: [`crate::reward`]'s
/// check).
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    match (cfg.token_classifier, cfg.num_labels) {
        (Some(_), None) => bail!("LlamaConfig: a token classifier needs its labels (num_labels)"),
        (Some(t), Some(_)) if !(0.0..1.0).contains(&t.dropout) => bail!("LlamaConfig: the token classifier's dropout {} must be in [0, 1)", t.dropout),
        _ => Ok(()),
    }
}

/// This rank's shards of a checkpoint as a token classifier of `num_labels` labels: a
/// `*ForTokenClassification` checkpoint as it is (its labels must be `num_labels`), or a causal
/// LM with a new head drawn from `seed` (weight `N(0, 0.02²)`, bias 0, the same on every
/// rank) and its LM head not read. `classifier` sets the dropout (`None`: the checkpoint's,
/// transformers' 0.1 for a causal LM). A sequence classifier is refused. Returns the weights
/// and the model's config. As [`crate::load_hf_sharded`] otherwise.
pub fn load_hf_sharded_token_classifier(dir: impl AsRef<Path>, num_labels: usize, classifier: Option<TokenClassifier>, seed: u64, ctx: &ParallelCtx, device: &Device, dtype: DType) -> Result<(VarMap, LlamaConfig)> {
    let dir = dir.as_ref();
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
    let (cfg, new_head) = match (cfg.num_labels, cfg.token_classifier) {
        (Some(n), Some(_)) if n != num_labels => bail!("{}: a token classifier of {n} label(s), not {num_labels}", dir.display()),
        (Some(_), Some(t)) => (cfg.with_token_classifier(Some(classifier.unwrap_or(t))), None),
        (Some(n), None) => bail!("{}: a sequence classifier ({}, {n} label(s)), not a token classifier", dir.display(), cfg.hf_class()),
        (None, _) => {
            let t = classifier.unwrap_or(TokenClassifier { dropout: TokenClassifier::HF_DROPOUT, bias: true });
            (cfg.with_num_labels(Some(num_labels)).with_token_classifier(Some(t)), Some(seed))
        }
    };
    cfg.validate()?;
    crate::hf::load_hf_sharded_as(dir, cfg, ctx, device, dtype, new_head)
}

/// Dropout on a token classifier's input for one training forward: the mask of forward `step`
/// (e.g. the micro-batch's number in the run) of stream `score.dropout`, keyed on each token's
/// index in the global batch `[batch, seq_len]` and the feature's, so that every layout drops
/// what one device drops.
#[derive(Debug, Clone, Copy)]
pub struct ClassifierDropout {
    /// The run's streams.
    pub streams: candle_cp_nn::RngStreams,
    /// The forward's number.
    pub step: u64,
    /// Rows `B` of the global batch.
    pub batch: usize,
    /// Tokens `T` of a global row.
    pub seq_len: usize,
}

impl Llama {
    /// A token classifier's scores (logits) of this rank's tokens of packed rows, f32
    /// `[B, Ts, n]`, differentiable: `drop(hidden) · scoreᵀ + bias` (transformers'
    /// `*ForTokenClassification`; `dropout` `None`: none, as evaluation wants). Arguments as
    /// [`Llama::hidden_packed`]. Collective. Errors for a model that is not a token classifier.
    pub fn token_scores_packed(&self, input_ids: &Tensor, positions: &Tensor, docs: &[Documents], dropout: Option<ClassifierDropout>) -> Result<Tensor> {
        let (Some(w), Some(t)) = (&self.score, self.cfg.token_classifier) else {
            bail!("Llama::token_scores_packed: {} is not a token classifier (load a *ForTokenClassification checkpoint, or a causal LM with LlamaConfig::with_token_classifier)", self.cfg.hf_class())
        };
        let h = self.hidden_with(input_ids, positions, Some(docs))?;
        let h = match dropout.filter(|_| t.dropout > 0.0) {
            Some(d) => {
                let (b, ts, hs) = h.dims3()?;
                let rows = crate::layout::local_token_indices(d.batch, d.seq_len, &self.ctx)?;
                if rows.len() != b * ts {
                    bail!("Llama::token_scores_packed: dropout keyed for a [{}, {}] batch, but this rank holds [{b}, {ts}] of another one", d.batch, d.seq_len)
                }
                let mask = d.streams.keep_mask_rows("score.dropout", d.step, &rows, 0..hs, hs, t.dropout, h.dtype(), h.device())?;
                (h * mask.reshape((b, ts, hs))?)?
            }
            None => h,
        };
        let s = crate::model::linear(&h, w)?;
        match &self.score_bias {
            Some(b) => s.broadcast_add(b)?.to_dtype(DType::F32),
            None => s.to_dtype(DType::F32),
        }
    }
}

#[cfg(test)]
#[path = "prm_tests.rs"]
mod tests;
