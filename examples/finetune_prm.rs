//! `finetune_llama --prm`: a process reward model's flags ([`PrmArgs`], flattened into the
//! example's), the stepwise data they read and the [`PrmConfig`] they make.

use anyhow::{bail, Context, Result};
use candle_cp_llama::train::{DataSource, PrmConfig, StepSet};

/// A process reward model's options (with `--prm`).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct PrmArgs {
    /// Train a process reward model (TRL's PRMTrainer) on stepwise examples: --data is JSON
    /// lines `{"prompt": "...", "completions": ["step", ...], "labels": [true, ...]}`; the model
    /// becomes a token classifier (`*ForTokenClassification`: a causal LM's head drawn, its LM
    /// head left unread), each step followed by --step-separator, its label read at the
    /// separator's last token; the loss is the cross-entropy there.
    #[arg(long)]
    pub(crate) prm: bool,
    /// The text after each step (TRL's step_separator; `\n` is a newline); with --grpo, where
    /// a process reward model (--reward-model-dir) cuts each completion into steps.
    #[arg(long, default_value = "\\n")]
    pub(crate) step_separator: String,
    /// Learn each training example's last step only (TRL's train_on_last_step_only; the
    /// held-out examples are evaluated on every step).
    #[arg(long)]
    pub(crate) train_on_last_step_only: bool,
    /// The labels of the head drawn for a causal LM (TRL's PRM: 2, a step wrong or right).
    #[arg(long, default_value_t = 2)]
    pub(crate) prm_labels: usize,
    /// Dropout on the head's input while training (default: the checkpoint's
    /// classifier_dropout, transformers' 0.1 for a causal LM).
    #[arg(long)]
    pub(crate) classifier_dropout: Option<f64>,
}

impl PrmArgs {
    /// Flags given without --prm are refused (`--step-separator` also goes with GRPO's reward
    /// model: `separator_used`).
    pub(crate) fn check(&self, separator_used: bool) -> Result<()> {
        if !self.prm && (self.train_on_last_step_only || self.prm_labels != 2 || self.classifier_dropout.is_some()) {
            bail!("--train-on-last-step-only, --prm-labels and --classifier-dropout are --prm's: add it")
        }
        if !self.prm && !separator_used && self.step_separator != "\\n" {
            bail!("--step-separator ends a process reward model's steps: add --prm, or --grpo with --reward-model-dir")
        }
        Ok(())
    }

    /// The run's PRM settings (`None` without --prm).
    pub(crate) fn config(&self) -> Result<Option<PrmConfig>> {
        if !self.prm {
            return Ok(None);
        }
        let c = PrmConfig { num_labels: self.prm_labels, dropout: self.classifier_dropout };
        c.classifier()?;
        Ok(Some(c))
    }

    /// The training data as trained on: with --train-on-last-step-only, each example's last
    /// step alone labelled.
    pub(crate) fn training_data(&self, data: DataSource) -> DataSource {
        match data {
            DataSource::Steps(s) if self.train_on_last_step_only => DataSource::Steps(s.last_step_only()),
            d => d,
        }
    }

    /// The stepwise examples of `bytes` (`flag`'s file at `path`), byte-level or through
    /// `tokenize`, and their description.
    pub(crate) fn read(&self, path: &std::path::Path, bytes: &[u8], flag: &str, tokenize: candle_cp_llama::train::sft::Tokenize) -> Result<(DataSource, String)> {
        let text = std::str::from_utf8(bytes).with_context(|| format!("{flag} {}: not UTF-8 text", path.display()))?;
        let sep = self.step_separator.replace("\\n", "\n");
        let set = StepSet::read(text, tokenize, &sep).with_context(|| format!("{flag} {}", path.display()))?;
        let desc = format!(
            "{} ({} stepwise examples, labels of {} classes, steps ended by {sep:?}), packed whole",
            path.display(),
            set.len(),
            set.classes_needed(),
        );
        Ok((DataSource::Steps(set), desc))
    }
}
