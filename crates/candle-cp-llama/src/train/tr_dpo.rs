//! TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment";
//! TRL's `sync_ref_model`, [`super::DpoConfig::sync_ref_model`]): the reference moves towards
//! the policy during training,
//!
//! ```text
//! every τ optimizer steps:   θ_ref ← α·θ + (1 − α)·θ_ref        (α = 1: the policy copied)
//! ```
//!
//! Each rank keeps its own shard of the reference's weights beside the policy's — the same
//! names, shapes and splits (TP, EP), so the update is element-wise on every rank with no
//! communication (under ZeRO the policy's weights are whole on every replica once the step's
//! all-gather is done). After each update the reference's log-probabilities of every answer
//! (and of the held-out pairs) are computed anew by a forward of the updated reference on the
//! run's layout, as the first reference pass: the loss always compares the policy with the
//! reference as it is, which is what TRL gets by scoring each batch with its reference model.
//! The reference's weights are written into every checkpoint (`reference/`, a Hugging Face
//! checkpoint) and read back on resume, so that a resumed run goes on with the same reference.
//! Not with LoRA (the reference is the frozen base the adapters sit on, as in TRL, which
//! refuses the combination too).

use crate::{Llama, LlamaConfig, ParallelCtx};
use candle_core::{bail, DType, Device, Result};
use candle_nn::VarMap;
use std::path::Path;

/// This rank's shard of a TR-DPO run's reference weights and its model config.
#[derive(Clone)]
pub struct RefModel {
    /// The weights, by parameter name (this rank's shards).
    pub vm: VarMap,
    /// The reference's config (the policy's).
    pub cfg: LlamaConfig,
}

impl std::fmt::Debug for RefModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = crate::params::lock_vars(&self.vm).map(|d| d.len()).unwrap_or(0);
        write!(f, "RefModel {{ {n} tensors, {} layers }}", self.cfg.num_hidden_layers)
    }
}

impl RefModel {
    /// A copy of this rank's policy weights `policy` (their own storage).
    pub fn copy_of(policy: &VarMap, cfg: &LlamaConfig) -> Result<Self> {
        let vm = VarMap::new();
        {
            let mut data = crate::params::lock_vars(&vm)?;
            for (name, v) in crate::params::lock_vars(policy)?.iter() {
                data.insert(name.clone(), candle_core::Var::from_tensor(&v.as_tensor().copy()?)?);
            }
        }
        Ok(Self { vm, cfg: cfg.clone() })
    }

    /// This rank's shards of the checkpoint `dir` (collective loading as
    /// [`crate::load_hf_sharded`]), with the run's sliding window where it sets one.
    pub fn load(dir: &Path, ctx: &ParallelCtx, dev: &Device, dtype: DType, sliding_window: Option<usize>) -> Result<Self> {
        let (vm, mut cfg) = crate::load_hf_sharded(dir, ctx, dev, dtype)?;
        if sliding_window.is_some() {
            cfg.sliding_window = sliding_window;
        }
        Ok(Self { vm, cfg })
    }

    /// A resumed run's reference: its checkpoint `ckpt`'s `reference/` (written by
    /// [`RefModel::save`]); errors, naming `what` kept it, when the checkpoint has none.
    pub fn resumed(ckpt: &Path, what: &str, ctx: &ParallelCtx, dev: &Device, dtype: DType, sliding_window: Option<usize>) -> Result<Self> {
        let dir = ckpt.join("reference");
        if !dir.join("config.json").exists() {
            bail!("resume: {} holds no {what} reference (reference/): resume it from a checkpoint of a run that kept one", ckpt.display())
        }
        Self::load(&dir, ctx, dev, dtype, sliding_window)
    }

    /// The reference as a model on `ctx`'s layout.
    pub fn model(&self, dtype: DType, dev: &Device, ctx: &ParallelCtx) -> Result<Llama> {
        Llama::new(candle_nn::VarBuilder::from_varmap(&self.vm, dtype, dev), &self.cfg, ctx)
    }

    /// Errors unless every parameter of `policy` has a reference weight of its shape and dtype
    /// (a `--ref-model` of another architecture or size cannot be mixed).
    pub fn check_matches(&self, policy: &VarMap) -> Result<()> {
        let mine = crate::params::lock_vars(&self.vm)?;
        for (name, v) in crate::params::lock_vars(policy)?.iter() {
            match mine.get(name) {
                Some(r) if r.shape() == v.shape() && r.dtype() == v.dtype() => {}
                Some(r) => bail!("tr-dpo: the reference's {name} is {:?} {:?}, the policy's {:?} {:?}: TR-DPO mixes the two", r.shape().dims(), r.dtype(), v.shape().dims(), v.dtype()),
                None => bail!("tr-dpo: the reference has no {name} {:?}: TR-DPO mixes it with the policy's", v.shape().dims()),
            }
        }
        Ok(())
    }

    /// `θ_ref ← α·θ + (1 − α)·θ_ref` for every parameter of `policy` (in f32, stored in the
    /// reference's dtype).
    pub fn mix(&self, policy: &VarMap, alpha: f64) -> Result<()> {
        self.check_matches(policy)?;
        let mine = crate::params::lock_vars(&self.vm)?;
        for (name, v) in crate::params::lock_vars(policy)?.iter() {
            let Some(r) = mine.get(name) else { bail!("tr-dpo: the reference has no {name}") };
            let mixed = ((v.as_tensor().to_dtype(DType::F32)? * alpha)? + (r.as_tensor().to_dtype(DType::F32)? * (1.0 - alpha))?)?;
            r.set(&mixed.to_dtype(r.dtype())?)?;
        }
        Ok(())
    }

    /// Writes the reference into `dir` as a Hugging Face checkpoint (gathered over TP and
    /// written by `write`'s rank: collective, as [`crate::save_hf_sharded`]).
    pub fn save(&self, dir: &Path, ctx: &ParallelCtx, write: bool) -> Result<()> {
        crate::save_hf_sharded(dir, &crate::params::varmap_tensors(&self.vm)?, &self.cfg, ctx, write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mix is `α·θ + (1 − α)·θ_ref` element-wise, the copy has storage of its own (the
    /// policy's later updates leave it), and a reference of another shape is refused by name.
    #[test]
    fn mix_moves_the_reference_towards_the_policy() -> Result<()> {
        let cfg = LlamaConfig::tiny(64, 16, 1, 2, 1);
        let policy = crate::init_params(&cfg, 1, DType::F32, &Device::Cpu)?;
        let r = RefModel::copy_of(&crate::init_params(&cfg, 2, DType::F32, &Device::Cpu)?, &cfg)?;
        // (deep copies: a Var's tensor shares its storage, which `set` overwrites)
        let copies = |vm: &VarMap| -> Result<std::collections::HashMap<String, candle_core::Tensor>> { crate::params::varmap_tensors(vm)?.into_iter().map(|(k, t)| Ok((k, t.copy()?))).collect() };
        let before = copies(&r.vm)?;
        r.mix(&policy, 0.25)?;
        let (p, after) = (copies(&policy)?, copies(&r.vm)?);
        for (name, a) in &after {
            let want = ((&p[name] * 0.25)? + (&before[name] * 0.75)?)?;
            let d = (a - want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(d < 1e-6, "{name}: {d}");
        }
        let copy = RefModel::copy_of(&policy, &cfg)?;
        let name = "model.norm.weight";
        crate::params::lock_vars(&policy)?[name].set(&p[name].affine(2.0, 1.0)?)?;
        let kept = crate::params::varmap_tensors(&copy.vm)?;
        assert_eq!(kept[name].to_vec1::<f32>()?, p[name].to_vec1::<f32>()?, "the copy keeps its own storage");
        let other = LlamaConfig::tiny(64, 32, 1, 2, 1);
        let e = RefModel::copy_of(&crate::init_params(&other, 2, DType::F32, &Device::Cpu)?, &other)?.mix(&policy, 0.5).unwrap_err().to_string();
        assert!(e.contains("TR-DPO mixes"), "{e}");
        Ok(())
    }
}
