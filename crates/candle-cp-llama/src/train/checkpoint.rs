//! Checkpoint directories: atomic publication and the training state that goes with the
//! model weights (step, data position, seed, layout).
//!
//! Layout of a run's output directory:
//! ```text
//! <out>/checkpoints/step-000120/   config.json, model.safetensors (HF format),
//!                                  optimizer-tp<t>.safetensors, train_state.json
//! <out>/checkpoints/latest         text file: the name of the newest complete checkpoint
//! ```
//! A LoRA run's checkpoints hold a PEFT adapter in place of the model's weights, naming the
//! frozen base model (`train/lora.rs`, [`crate::lora::base_model_dir`]).
//! A checkpoint is written into `.tmp-step-XXXXXX/`, then renamed; `latest` is replaced by a
//! rename too. A run killed at any moment leaves either the previous or the new checkpoint,
//! never a half-written one.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Everything besides weights and optimizer moments that a resumed run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: usize,
    /// Run seed (data streams and initial weights derive from it).
    pub seed: u64,
    /// Data position: micro-batches consumed (`step · grad_accum`). Batches are a pure
    /// function of (seed, step, micro-batch, DP rank), so this is the whole data state.
    pub micro_batches_done: usize,
    /// Tokens trained on so far (whole world).
    pub tokens_seen: u64,
    /// Wall time spent in training before this checkpoint, seconds.
    pub elapsed_s: f64,
    /// World size of the run that wrote the checkpoint (for the record: a resume may change
    /// it).
    pub world_size: usize,
    /// Human-readable layout (e.g. `zigzag cp=4 tp=1 dp=1`), for the record: a resume may
    /// use another (the optimizer files say the TP degree, [`optimizer_tp_degree`]).
    pub layout: String,
    /// Free-form run arguments, for the record.
    pub args: serde_json::Value,
    /// BCO's running mean reward δ at this step ([`super::bco`]; absent for other runs and in
    /// older checkpoints, which then resume from 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bco_mean: Option<super::bco::RunningMean>,
}

impl TrainState {
    /// Write as pretty JSON.
    pub fn save(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        std::fs::write(
            path,
            serde_json::to_string_pretty(self).map_err(std::io::Error::other)?,
        )
    }
    /// Read from JSON.
    pub fn load(path: impl AsRef<Path>) -> std::io::Result<Self> {
        let text = std::fs::read_to_string(path)?;
        serde_json::from_str(&text).map_err(std::io::Error::other)
    }
}

/// Name of the checkpoint directory of `step`.
pub fn checkpoint_name(step: usize) -> String {
    format!("step-{step:06}")
}

/// Where the files of a checkpoint in progress go: `<root>/.tmp-step-XXXXXX` (emptied).
pub fn begin_checkpoint(root: impl AsRef<Path>, step: usize) -> std::io::Result<PathBuf> {
    let tmp = root
        .as_ref()
        .join(format!(".tmp-{}", checkpoint_name(step)));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp)?;
    Ok(tmp)
}

/// Publish a checkpoint written by [`begin_checkpoint`]: rename it to `<root>/step-XXXXXX`
/// (replacing an older one of the same step), point `latest` at it, and keep only the
/// newest `keep` checkpoints (0 = keep all). Returns the final directory.
pub fn commit_checkpoint(
    root: impl AsRef<Path>,
    step: usize,
    keep: usize,
) -> std::io::Result<PathBuf> {
    let root = root.as_ref();
    let name = checkpoint_name(step);
    let tmp = root.join(format!(".tmp-{name}"));
    let dst = root.join(&name);
    if dst.exists() {
        std::fs::remove_dir_all(&dst)?;
    }
    std::fs::rename(&tmp, &dst)?;
    let latest_tmp = root.join("latest.tmp");
    std::fs::write(&latest_tmp, &name)?;
    std::fs::rename(&latest_tmp, root.join("latest"))?;
    if keep > 0 {
        let mut all = list_checkpoints(root)?;
        all.sort();
        let n = all.len();
        for (s, p) in all.into_iter().take(n.saturating_sub(keep)) {
            if s != step {
                std::fs::remove_dir_all(p)?;
            }
        }
    }
    Ok(dst)
}

/// Complete checkpoints under `root` as (step, path).
pub fn list_checkpoints(root: impl AsRef<Path>) -> std::io::Result<Vec<(usize, PathBuf)>> {
    let mut out = vec![];
    if !root.as_ref().exists() {
        return Ok(out);
    }
    for e in std::fs::read_dir(root)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(s) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<usize>().ok())
        {
            if e.path().join("train_state.json").exists() {
                out.push((s, e.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The newest complete checkpoint under `root` (from `latest`, else the highest step).
pub fn latest_checkpoint(root: impl AsRef<Path>) -> std::io::Result<Option<PathBuf>> {
    let root = root.as_ref();
    if let Ok(name) = std::fs::read_to_string(root.join("latest")) {
        let p = root.join(name.trim());
        if p.join("train_state.json").exists() {
            return Ok(Some(p));
        }
    }
    Ok(list_checkpoints(root)?.pop().map(|(_, p)| p))
}

/// How many TP ranks wrote the optimizer state of checkpoint `dir`: the number of
/// `optimizer-tp<t>.safetensors` files, counted from `t = 0` (0 when there is none). A run
/// with this TP degree loads its own rank's file as it is, whatever its CP, DP, SP or head
/// layout; another degree reshards ([`reshard_optimizer_state`]).
pub fn optimizer_tp_degree(dir: &Path) -> usize {
    (0..).take_while(|&t| dir.join(format!("optimizer-tp{t}.safetensors")).is_file()).count()
}

/// The optimizer state of checkpoint `dir` (written by a run with any TP degree: one
/// `optimizer-tp<t>.safetensors` per TP rank) as this rank of `ctx` holds it: each moment
/// (and master copy) reassembled to its full shape from the old TP ranks' files
/// ([`candle_cp_nn::Shard::assemble`], one copy of replicated KV heads), then sliced for
/// this layout's TP rank. What [`super::AdamW::load_tensors`] takes. The old files are
/// memory-mapped and read one tensor at a time: besides its own slices, a rank holds at most
/// one full tensor on the host.
pub fn reshard_optimizer_state(
    dir: &Path,
    cfg: &crate::LlamaConfig,
    ctx: &crate::ParallelCtx,
) -> candle_core::Result<std::collections::HashMap<String, candle_core::Tensor>> {
    use candle_core::{bail, Device, Error};
    let file = |t: usize| dir.join(format!("optimizer-tp{t}.safetensors"));
    let old_tp = optimizer_tp_degree(dir);
    if old_tp == 0 {
        bail!("resume: no optimizer-tp0.safetensors in {}", dir.display())
    }
    let files = (0..old_tp)
        .map(|t| {
            // SAFETY: mapped read-only while this function runs; checkpoints are published
            // once (renamed into place) and never rewritten
            unsafe { candle_core::safetensors::MmapedSafetensors::new(file(t)) }
                .map_err(|e| Error::Msg(format!("reading optimizer state {}: {e}", file(t).display())))
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    // the tensor `key` of old file `t`, read now; None when the file has no such tensor
    let read = |t: usize, key: &str| -> candle_core::Result<Option<candle_core::Tensor>> {
        match files[t].get(key) {
            Err(_) => Ok(None),
            Ok(_) => files[t]
                .load(key, &Device::Cpu)
                .map(Some)
                .map_err(|e| Error::Msg(format!("reading {key} of {}: {e}", file(t).display()))),
        }
    };
    let steps = (0..old_tp)
        .map(|t| match read(t, "step")? {
            Some(s) => s.to_vec1::<u32>(),
            None => Ok(vec![]),
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    if steps.iter().any(|s| s.is_empty() || s != &steps[0]) {
        bail!("resume: the {old_tp} optimizer files of {} disagree on the step ({steps:?})", dir.display())
    }
    let mut out = std::collections::HashMap::new();
    out.insert("step".to_string(), candle_core::Tensor::new(steps[0].as_slice(), &Device::Cpu)?);
    for spec in crate::params::trainable_specs(cfg) {
        for prefix in ["m", "v", "w"] {
            let key = format!("{prefix}.{}", spec.name);
            let parts: Vec<candle_core::Tensor> = (0..old_tp).map(|t| read(t, &key)).collect::<candle_core::Result<Vec<_>>>()?.into_iter().flatten().collect();
            if parts.is_empty() {
                continue; // no master copy (f32 run), or a missing moment that load_tensors names
            }
            if parts.len() != old_tp {
                bail!("resume: {key} is in {} of the {old_tp} optimizer files of {}", parts.len(), dir.display())
            }
            let full = spec.shard.assemble(&parts).map_err(|e| Error::Msg(format!("resume: {key}: {e}")))?;
            out.insert(key, spec.slice_for(&full, ctx)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Optimizer files written by TP 4 (2 KV heads: each on 2 ranks; V = 64 split by rows, or
    /// V = 62 padded to 16 rows per rank), with moments and master copies (`w.`), resharded for
    /// TP 2 and for one device; and TP 2 files resharded for TP 4: every tensor is the new
    /// rank's slice of the full state.
    #[test]
    fn optimizer_state_reshards_between_tp_degrees() -> candle_core::Result<()> {
        for vocab in [64usize, 62] {
            reshards_between_tp_degrees_of(vocab)?;
        }
        Ok(())
    }

    fn reshards_between_tp_degrees_of(vocab: usize) -> candle_core::Result<()> {
        use crate::layout::Layout;
        use candle_core::{DType, Device, Tensor};
        let cfg = crate::LlamaConfig::tiny(vocab, 32, 1, 4, 2);
        let specs = crate::params::param_specs(&cfg);
        let mut full = std::collections::HashMap::new();
        for (i, spec) in specs.iter().enumerate() {
            for (j, prefix) in ["m", "v", "w"].iter().enumerate() {
                let n: usize = spec.shape.iter().product();
                let t = Tensor::arange(0f32, n as f32, &Device::Cpu)?.affine(1.0, (100 * i + 10 * j) as f64)?;
                full.insert(format!("{prefix}.{}", spec.name), t.reshape(spec.shape.as_slice())?);
            }
        }
        for (old_tp, new_tp) in [(4usize, 2usize), (4, 1), (2, 4)] {
            let dir = std::env::temp_dir().join(format!("reshard-{vocab}-{old_tp}-{new_tp}-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            for r in 0..old_tp {
                let mut file = std::collections::HashMap::new();
                file.insert("step".to_string(), Tensor::new(&[7u32], &Device::Cpu)?);
                for spec in &specs {
                    for prefix in ["m", "v", "w"] {
                        let key = format!("{prefix}.{}", spec.name);
                        file.insert(key.clone(), spec.slice(&full[&key], old_tp, r)?);
                    }
                }
                candle_core::safetensors::save(&file, dir.join(format!("optimizer-tp{r}.safetensors")))?;
            }
            let layout = Layout::single().with_tp(new_tp, true);
            for res in candle_cp_comm::run_ranks(new_tp, |g| {
                let ctx = crate::ParallelCtx::new(g, layout)?;
                let got = reshard_optimizer_state(&dir, &cfg, &ctx)?;
                let mut worst = 0f32;
                for spec in &specs {
                    for prefix in ["m", "v", "w"] {
                        let key = format!("{prefix}.{}", spec.name);
                        let want = spec.slice(&full[&key], new_tp, ctx.coords.2)?;
                        let d = (&got[&key] - want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                        worst = worst.max(d);
                    }
                }
                Ok((worst, got["step"].to_dtype(DType::U32)?.to_vec1::<u32>()?, got.len()))
            }) {
                let (worst, step, n) = res?;
                assert_eq!((worst, step, n), (0.0, vec![7], 1 + 3 * specs.len()), "V {vocab}: tp {old_tp} -> {new_tp}");
            }
            std::fs::remove_dir_all(&dir).ok();
        }
        Ok(())
    }

    #[test]
    fn checkpoints_are_published_atomically_and_pruned() -> std::io::Result<()> {
        let root = std::env::temp_dir().join(format!("ckpt-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let state = |step| TrainState {
            step,
            seed: 1,
            micro_batches_done: step * 2,
            tokens_seen: 10,
            elapsed_s: 1.5,
            world_size: 4,
            layout: "zigzag cp=4".into(),
            args: serde_json::json!({"lr": 1e-3}),
            bco_mean: (step == 20).then_some(super::super::bco::RunningMean { mean: -0.25, count: 3.0 }),
        };
        assert_eq!(latest_checkpoint(&root)?, None);
        for step in [10, 20, 30] {
            let tmp = begin_checkpoint(&root, step)?;
            state(step).save(tmp.join("train_state.json"))?;
            commit_checkpoint(&root, step, 2)?;
        }
        // An unfinished checkpoint (killed mid-write) is ignored.
        let tmp = begin_checkpoint(&root, 40)?;
        std::fs::write(tmp.join("model.safetensors"), b"partial")?;
        let latest = latest_checkpoint(&root)?.unwrap();
        assert!(latest.ends_with("step-000030"));
        assert_eq!(
            TrainState::load(latest.join("train_state.json"))?,
            state(30)
        );
        let steps: Vec<usize> = list_checkpoints(&root)?
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(steps, [20, 30]);
        // BCO's running mean round-trips; a state without one writes no key for it
        let at20 = root.join(checkpoint_name(20)).join("train_state.json");
        assert_eq!(TrainState::load(&at20)?, state(20));
        assert!(!std::fs::read_to_string(latest.join("train_state.json"))?.contains("bco_mean"));
        std::fs::remove_dir_all(&root)?;
        Ok(())
    }
}
