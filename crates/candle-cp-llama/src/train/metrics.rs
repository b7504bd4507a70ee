//! Per-step training metrics: a JSON-lines log (one object per optimizer step) that survives
//! restarts, and the process's peak memory.

use super::plot::{write_line_plot, Series};
use candle_core::Result;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

/// One optimizer step's measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer step, 1-based (the state after this many updates).
    pub step: usize,
    /// The training objective: mean over micro-batches of the model's loss (all targets, or
    /// the long-range targets only with [`crate::train::TrainConfig::long_range_only`]), plus
    /// a mixture of experts' load-balancing term when the config asks for it.
    pub train_loss: f64,
    /// Mean next-token cross-entropy over ALL targets of the step's batch (all micro-batches),
    /// whatever the objective.
    pub loss: f64,
    /// Mean cross-entropy over the long-range targets only (`NaN` → `null` when none).
    pub long_range_loss: Option<f64>,
    /// Learning rate used for this update.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens processed per second in this step (whole world).
    pub tokens_per_s: f64,
    /// Wall time since the (first) start of the run, in seconds.
    pub elapsed_s: f64,
    /// Peak resident memory of the process so far (VmHWM), MiB; `None` where unavailable.
    pub peak_rss_mib: Option<f64>,
    /// A mixture of experts' load-balancing term in `train_loss` (mean over micro-batches,
    /// `router_aux_loss_coef` times transformers' `load_balancing_loss_func`: `coef · K` when
    /// the routing is balanced, up to `coef · E` when one expert takes every token;
    /// [`crate::Llama::router_aux_loss`]); absent without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_aux_loss: Option<f64>,
    /// The routing balance beside it ([`crate::Llama::expert_load`]: each sparse layer's
    /// most-chosen expert over the mean, averaged over layers and micro-batches; 1 is
    /// balanced); absent without the load-balancing term.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<f64>,
    /// How a mixture of experts routed the step's tokens: for each sparse layer, each expert's
    /// (token, slot) choices over the global batch and all micro-batches (`[layers][E]`, a
    /// layer's counts sum to the step's tokens times `K`; [`crate::Llama::expert_counts`]
    /// summed over the DP × CP ranks). An expert at 0 is one no token chose. Absent for a
    /// dense model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_counts: Option<Vec<Vec<u64>>>,
    /// Mean loss over all targets of the held-out rows after this step's update
    /// ([`crate::train::TrainConfig::eval`]); absent on the steps that do not evaluate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// The same over the held-out rows' long-range targets (absent when they have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_long_range_loss: Option<f64>,
    /// A DPO run's fraction of pairs whose chosen answer's reward beats the rejected one's
    /// (this step's pairs; [`crate::train::dpo::DpoTerms::accuracy`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo_accuracy: Option<f64>,
    /// A DPO run's mean reward margin (chosen − rejected) over this step's pairs (KTO: the
    /// mean reward on the label's side of the KL baseline, [`crate::train::kto::kto_terms`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo_margin: Option<f64>,
    /// A KTO run's KL estimate `z₀` (mean over the step's micro-batches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kto_kl: Option<f64>,
    /// A BCO run's running mean reward δ after the step's last micro-batch ([`crate::train::bco`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bco_delta: Option<f64>,
    /// A GRPO run's mean reward over the step's completions ([`crate::train::grpo`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpo_reward: Option<f64>,
    /// A GRPO run's mean completion length in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_length: Option<f64>,
    /// A GRPO run's mean per-token KL estimate to its reference (with `beta` > 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpo_kl: Option<f64>,
    /// A GRPO run's fraction of completion tokens whose ratio `π/π_old` was clipped (the steps
    /// that train on an earlier step's completions, `num_iterations` > 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpo_clip_ratio: Option<f64>,
    /// A GRPO run's fraction of the step's groups whose completions all got the same reward
    /// (no advantage, nothing learnt from them; TRL's `frac_reward_zero_std`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpo_zero_std: Option<f64>,
    /// A GRPO run's held-out reward: the mean reward of a greedy completion of each held-out
    /// prompt, where evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_reward: Option<f64>,
    /// A DPO run's reward accuracy over its held-out pairs after this step's update (the steps
    /// that evaluate; `eval_loss` is then their DPO loss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_dpo_accuracy: Option<f64>,
}

/// A step's sums over the ranks of `group` (those holding distinct tokens): the four loss
/// terms (f64, added in rank order) and each sparse layer's expert counts (`counts`, this
/// rank's, summed over its micro-batches; zeros where `own` is false — a TP rank other than the
/// first under SP, routing the same tokens), gathered in one all-gather on the host. `None` for
/// the counts of a dense model.
#[allow(clippy::type_complexity)]
pub(crate) fn step_sums(terms: [f64; 4], counts: &[Vec<usize>], own: bool, group: &candle_cp_comm::Group, host: &candle_core::Device) -> candle_core::Result<([f64; 4], Option<Vec<Vec<u64>>>)> {
    let row: Vec<f64> = terms.iter().copied().chain(counts.iter().flatten().map(|&c| if own { c as f64 } else { 0.0 })).collect();
    let row_t = candle_core::Tensor::from_vec(row, (1, 4 + counts.iter().map(Vec::len).sum::<usize>()), host)?;
    let rows = if group.size() > 1 { group.all_gather(&row_t, 0)? } else { row_t };
    let mut tot = [0f64; 4];
    let mut all_counts = vec![0u64; rows.dim(1)? - 4];
    for r in rows.to_vec2::<f64>()? {
        for (a, x) in tot.iter_mut().zip(&r) {
            *a += x;
        }
        for (a, x) in all_counts.iter_mut().zip(&r[4..]) {
            *a += *x as u64;
        }
    }
    let per_layer = match counts.first() {
        Some(l) if !l.is_empty() => Some(all_counts.chunks(l.len()).map(<[u64]>::to_vec).collect()),
        _ => None,
    };
    Ok((tot, per_layer))
}

/// Append-only JSON-lines metrics file.
pub struct MetricsLog {
    path: PathBuf,
}

impl MetricsLog {
    /// Open `path` for appending. With `resume_step = Some(s)`, rows of steps after `s` (from a
    /// run that was killed after its last checkpoint) are dropped first, so the log continues
    /// exactly where the checkpoint did; with `None` any existing file is truncated.
    pub fn open(path: impl AsRef<Path>, resume_step: Option<usize>) -> std::io::Result<Self> {
        let path = path.as_ref().to_path_buf();
        // Kept rows are copied verbatim (a parse/print round trip could change the last digit).
        let mut keep: Vec<String> = vec![];
        if let (Some(s), true) = (resume_step, path.exists()) {
            let text = std::fs::read_to_string(&path)?;
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let row: StepMetrics = serde_json::from_str(line).map_err(std::io::Error::other)?;
                if row.step <= s {
                    keep.push(line.to_string());
                }
            }
        }
        let tmp = path.with_extension("jsonl.tmp");
        {
            let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
            for line in &keep {
                writeln!(f, "{line}")?;
            }
            f.flush()?;
        }
        std::fs::rename(&tmp, &path)?;
        Ok(Self { path })
    }

    /// Append one row (flushed at once).
    pub fn append(&self, row: &StepMetrics) -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)?;
        writeln!(
            f,
            "{}",
            serde_json::to_string(row).map_err(std::io::Error::other)?
        )
    }

    /// All rows of the file at `path`.
    pub fn read(path: impl AsRef<Path>) -> std::io::Result<Vec<StepMetrics>> {
        let f = std::io::BufReader::new(std::fs::File::open(path)?);
        let mut rows = vec![];
        for line in f.lines() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            rows.push(serde_json::from_str(&line).map_err(std::io::Error::other)?);
        }
        Ok(rows)
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Peak resident set size of this process (`VmHWM` from `/proc/self/status`), in bytes.
/// `None` on systems without procfs. With thread ranks this is the whole process (all ranks).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Write `loss.png` (training loss, all-target loss if different, long-range loss per step,
/// held-out loss where evaluated) from the metrics file.
pub fn plot_metrics(metrics_path: &Path, png_path: &Path) -> Result<()> {
    let rows = MetricsLog::read(metrics_path).map_err(|e| super::trainer::ioe("reading", metrics_path, e))?;
    let train: Vec<(f64, f64)> = rows.iter().map(|r| (r.step as f64, r.train_loss)).collect();
    let all: Vec<(f64, f64)> = rows.iter().map(|r| (r.step as f64, r.loss)).collect();
    let lr: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.step as f64, r.long_range_loss.unwrap_or(f64::NAN)))
        .collect();
    let same = rows.iter().all(|r| (r.train_loss - r.loss).abs() < 1e-6);
    let lr_only = rows.iter().all(|r| {
        r.long_range_loss
            .is_some_and(|x| (x - r.train_loss).abs() < 1e-4)
    });
    let mut series = vec![];
    if !lr_only {
        series.push(Series {
            label: "train loss",
            color: [31, 119, 180],
            points: &train,
        });
    }
    if !same {
        series.push(Series {
            label: "all-target loss",
            color: [150, 150, 150],
            points: &all,
        });
    }
    if lr.iter().any(|p| p.1.is_finite()) {
        let label = if lr_only {
            "long-range loss (trained)"
        } else {
            "long-range loss"
        };
        series.push(Series {
            label,
            color: [214, 39, 40],
            points: &lr,
        });
    }
    // held-out loss at the steps that evaluated
    let eval: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.eval_loss.map(|x| (r.step as f64, x))).collect();
    if !eval.is_empty() {
        series.push(Series { label: "held-out loss", color: [44, 160, 44], points: &eval });
    }
    write_line_plot(png_path, 800, 480, &series).map_err(|e| super::trainer::ioe("writing", png_path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(step: usize) -> StepMetrics {
        StepMetrics {
            step,
            train_loss: 2.0 / step as f64,
            loss: 1.0 / step as f64,
            long_range_loss: if step.is_multiple_of(2) {
                Some(0.5)
            } else {
                None
            },
            lr: 1e-3,
            grad_norm: 0.1,
            tokens_per_s: 100.0,
            elapsed_s: step as f64,
            peak_rss_mib: Some(10.0),
            router_aux_loss: step.is_multiple_of(3).then_some(0.02),
            expert_load: step.is_multiple_of(3).then_some(1.25),
            expert_counts: step.is_multiple_of(3).then(|| vec![vec![3, 0, 5], vec![1, 6, 1]]),
            eval_loss: step.is_multiple_of(2).then_some(0.75),
            eval_long_range_loss: None,
            dpo_accuracy: step.is_multiple_of(4).then_some(0.5),
            dpo_margin: step.is_multiple_of(4).then_some(-0.25),
            kto_kl: step.is_multiple_of(8).then_some(0.125),
            bco_delta: step.is_multiple_of(8).then_some(-0.375),
            grpo_reward: step.is_multiple_of(8).then_some(0.625),
            completion_length: step.is_multiple_of(8).then_some(3.5),
            grpo_kl: step.is_multiple_of(8).then_some(0.0625),
            grpo_clip_ratio: step.is_multiple_of(8).then_some(0.03125),
            grpo_zero_std: step.is_multiple_of(8).then_some(0.25),
            eval_reward: step.is_multiple_of(8).then_some(0.4375),
            eval_dpo_accuracy: step.is_multiple_of(4).then_some(0.75),
        }
    }

    #[test]
    fn log_round_trips_and_resume_drops_rows_after_the_checkpoint() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("metrics-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let p = dir.join("m.jsonl");
        let log = MetricsLog::open(&p, None)?;
        for s in 1..=5 {
            log.append(&row(s))?;
        }
        assert_eq!(MetricsLog::read(&p)?, (1..=5).map(row).collect::<Vec<_>>());
        let before = std::fs::read_to_string(&p)?;
        let log = MetricsLog::open(&p, Some(3))?;
        assert_eq!(MetricsLog::read(&p)?.len(), 3);
        let kept: String = before.lines().take(3).map(|l| format!("{l}\n")).collect();
        assert_eq!(
            std::fs::read_to_string(&p)?,
            kept,
            "kept rows must be byte-identical"
        );
        log.append(&row(4))?;
        assert_eq!(MetricsLog::read(&p)?, (1..=4).map(row).collect::<Vec<_>>());
        MetricsLog::open(&p, None)?;
        assert!(MetricsLog::read(&p)?.is_empty());
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    #[test]
    fn peak_rss_is_reported_on_linux() {
        if cfg!(target_os = "linux") {
            let b = peak_rss_bytes().unwrap();
            assert!(b > 1 << 20, "{b}");
        }
    }
}
