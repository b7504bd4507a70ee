//! Reward models: transformers' `*ForSequenceClassification` — the decoder with a score head
//! `score.weight` `[n, h]` (no bias) in place of the LM head, a sequence's scores read at its
//! last token — on every layout.
//!
//! ```text
//!   packed row:   | prompt₀ chosen₀ | prompt₀ rejected₀ | prompt₁ chosen₁ | ... | pad |
//!   scores:                       r                   r                 r
//!                 (the final hidden state of each document's last token · scoreᵀ)
//! ```
//!
//! A document's last token lies on one rank of the CP group (one SP rank of its TP group under
//! sequence parallelism): [`Llama::scores_packed`] gives every local token's scores, and the
//! trainer ([`crate::train::reward`]) sums each document's over the ranks holding distinct
//! tokens. The score head is replicated over TP (it is `n · h` numbers) and its gradient summed
//! as a norm's ([`crate::grads`]).
//!
//! A reward model loads from a `*ForSequenceClassification` checkpoint (its `config.json`
//! names the class: [`LlamaConfig::num_labels`]) or from a causal LM whose LM head is left
//! unread and whose score head is drawn as transformers draws it, `N(0, 0.02²)`
//! ([`load_hf_sharded_reward`]); it saves as the sequence classifier of its architecture
//! (`LlamaForSequenceClassification`, `Qwen2ForSequenceClassification`, ...), which
//! transformers' `AutoModelForSequenceClassification` and TRL's reward trainer read. It
//! computes no logits: [`Llama::forward`], the losses and generation refuse it by name.

use crate::{LlamaConfig, Llama, ParallelCtx};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_ops::packing::Documents;
use candle_nn::VarMap;
use std::path::Path;

/// The score head's parameter name (transformers').
pub const SCORE: &str = "score.weight";

impl LlamaConfig {
    /// The same config as a reward model with `n` labels (`Some`; TRL's reward models have 1),
    /// or as a causal LM (`None`). See [`LlamaConfig::num_labels`].
    pub fn with_num_labels(mut self, n: Option<usize>) -> Self {
        self.num_labels = n;
        self
    }
}

/// The config's reward-model checks: at least one label; LoRA adapters on a reward model train
/// its score head whole (PEFT's `SEQ_CLS` task: `score` in `modules_to_save`), and only a reward
/// model has one (and no LM head).
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    let saves = |m: &str| cfg.lora.as_ref().is_some_and(|l| l.modules_to_save.iter().any(|s| s == m));
    match cfg.num_labels {
        Some(0) => bail!("LlamaConfig: a reward model (num_labels) needs at least one label"),
        Some(n) if cfg.lora.is_some() && !saves("score") => bail!("LlamaConfig: LoRA on a reward model ({n} label(s)) trains its new score head whole: add score to modules_to_save (PEFT's SEQ_CLS and TOKEN_CLS tasks do)"),
        Some(_) if saves("lm_head") => bail!("LlamaConfig: a reward model has no lm_head to train (modules_to_save): its head is score"),
        None if saves("score") => bail!("LlamaConfig: LoRA modules_to_save names score, which only a reward model has (num_labels)"),
        _ => Ok(()),
    }
}

/// This rank's shards of a checkpoint as a reward model with `num_labels` labels: a
/// `*ForSequenceClassification` checkpoint as it is (its labels must be `num_labels`), or a
/// causal LM with a new score head drawn from `seed` (the same on every rank) and its LM head
/// not read. Returns the weights and the reward model's config. As
/// [`crate::load_hf_sharded`] otherwise (one tensor at a time, refused tensors named).
pub fn load_hf_sharded_reward(dir: impl AsRef<Path>, num_labels: usize, seed: u64, ctx: &ParallelCtx, device: &Device, dtype: DType) -> Result<(VarMap, LlamaConfig)> {
    let dir = dir.as_ref();
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
    if cfg.token_classifier.is_some() {
        bail!("{}: a token classifier ({}): load it with crate::prm::load_hf_sharded_token_classifier", dir.display(), cfg.hf_class())
    }
    match cfg.num_labels {
        Some(n) if n != num_labels => bail!("{}: a reward model of {n} label(s), not {num_labels}", dir.display()),
        Some(_) => crate::hf::load_hf_sharded_as(dir, cfg, ctx, device, dtype, None),
        None => {
            let cfg = cfg.with_num_labels(Some(num_labels));
            cfg.validate()?;
            crate::hf::load_hf_sharded_as(dir, cfg, ctx, device, dtype, Some(seed))
        }
    }
}

/// This rank's reward model from `dir`: a `*ForSequenceClassification` checkpoint, or a LoRA
/// reward run's checkpoint (a PEFT adapter of task SEQ_CLS over the base it names, the adapters
/// merged into the weights: [`Llama::with_adapters_merged`]). Errors for a causal LM. Collective
/// over the layout's TP group (the shards are read per rank).
pub fn load_reward_model(dir: &Path, ctx: &ParallelCtx, device: &Device, dtype: DType) -> Result<Llama> {
    let base = crate::lora::base_model_dir(dir)?;
    let (vm, cfg) = crate::load_hf_sharded(&base, ctx, device, dtype)?;
    if cfg.num_labels.is_none() {
        bail!("{}: not a reward model (a *ForSequenceClassification checkpoint, or a LoRA reward run's adapter over one): {} is a causal LM", dir.display(), base.display())
    }
    match crate::lora::load_adapter_sharded(dir, &cfg, &vm, ctx, dtype, device)? {
        Some(adapted) => Llama::new(candle_nn::VarBuilder::from_varmap(&vm, dtype, device), &adapted, ctx)?.with_adapters_merged(),
        None => Llama::new(candle_nn::VarBuilder::from_varmap(&vm, dtype, device), &cfg, ctx),
    }
}

impl Llama {
    /// A multiple of which a row's length suits this layout's forward (a training forward,
    /// [`Llama::scores_packed`]): [`Llama::prompt_multiple`] times the TP degree under sequence
    /// parallelism (each CP shard split over the TP ranks).
    pub fn forward_multiple(&self) -> usize {
        let l = &self.ctx.layout;
        self.prompt_multiple() * if l.seq_parallel() { l.tp } else { 1 }
    }

    /// The score head `[n, h]`; an error for a causal LM.
    fn score_head(&self) -> Result<&Tensor> {
        match &self.score {
            Some(s) => Ok(s),
            None => bail!("Llama::scores: a causal LM ({}) has no score head: load it as a reward model (load_hf_sharded_reward, LlamaConfig::with_num_labels)", self.cfg.arch().hf_names().0),
        }
    }

    /// A reward model's scores of this rank's tokens, f32 `[B, Ts, n]`, differentiable: the
    /// final hidden states ([`Llama::hidden`]) times the score head (transformers' `score`,
    /// read at a sequence's last token). Arguments as [`Llama::hidden`]. Collective.
    pub fn scores(&self, input_ids: &Tensor, positions: &Tensor) -> Result<Tensor> {
        self.scores_with(input_ids, positions, None)
    }

    /// [`Llama::scores`] of packed rows (arguments as [`Llama::hidden_packed`]): each
    /// document scored alone, its scores those of its last token.
    pub fn scores_packed(&self, input_ids: &Tensor, positions: &Tensor, docs: &[Documents]) -> Result<Tensor> {
        self.scores_with(input_ids, positions, Some(docs))
    }

    fn scores_with(&self, input_ids: &Tensor, positions: &Tensor, docs: Option<&[Documents]>) -> Result<Tensor> {
        let w = self.score_head()?.clone();
        let h = self.hidden_with(input_ids, positions, docs)?;
        crate::model::linear(&h, &w)?.to_dtype(DType::F32)
    }
}

/// Per token of global rows `[B, T]` packed with `docs` (one per row), `slot(b, d) + 1` at the
/// last token of document `d` of row `b` where `slot` gives one, else 0: the map that
/// [`crate::shard_batch`] shards beside the ids, so that each rank finds the documents ending
/// among its tokens. Errors when a row's documents do not cover `t` tokens.
pub fn document_ends(docs: &[Documents], t: usize, mut slot: impl FnMut(usize, usize) -> Option<u32>) -> Result<Tensor> {
    let mut out = vec![0u32; docs.len() * t];
    for (b, d) in docs.iter().enumerate() {
        if d.total_len() != t {
            bail!("document_ends: row {b}'s documents cover {} tokens, rows are {t}", d.total_len())
        }
        let mut end = 0;
        for (i, len) in d.lengths().into_iter().enumerate() {
            end += len;
            if let Some(s) = slot(b, i) {
                out[b * t + end - 1] = s + 1;
            }
        }
    }
    Tensor::from_vec(out, (docs.len(), t), &Device::Cpu)
}

#[cfg(test)]
#[path = "reward_tests.rs"]
mod tests;
