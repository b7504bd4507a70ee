//! Loss-free load balancing of a sigmoid router (DeepSeek-V3's, which GLM-4.5 was trained with;
//! Megatron-Core's `moe_router_enable_expert_bias`): after each step, every sparse layer's
//! correction bias (`mlp.gate.e_score_correction_bias`, which chooses the experts and weights
//! nothing: [`crate::config::glm4_moe`]) moves towards balance,
//!
//! ```text
//!   b_e += rate · sign(mean_e' c_e' − c_e)      c: the step's global (token, slot) choices per expert
//! ```
//!
//! so an expert chosen more than the mean is chosen less next step. The counts are the step's
//! over the whole global batch and every micro-batch (the trainer's `expert_counts`, the same on
//! every rank), so every rank moves its copy of the (replicated) bias alike. The update is
//! written before the optimizer step, which leaves the bias as it is (its gradient is zero)
//! and, with ZeRO, gathers it from the updated slices.

use crate::params::{lock_vars, CORRECTION_BIAS};
use crate::LlamaConfig;
use candle_core::{bail, DType, Result, Tensor};
use candle_nn::VarMap;

/// Errors for a rate that is no positive number, a model without a sigmoid router (no
/// correction bias to move), or a LoRA run (the bias is a frozen base weight there).
pub(crate) fn check(rate: f64, cfg: &LlamaConfig, lora: bool) -> Result<()> {
    if !(rate.is_finite() && rate > 0.0) {
        bail!("train: expert_bias_update must be a finite rate > 0, got {rate}")
    }
    if !cfg.moe.as_ref().is_some_and(|m| m.sigmoid_scores()) {
        bail!("train: expert_bias_update {rate} on a {} model: only a sigmoid router with a correction bias (GLM-4.5, model_type glm4_moe) has a bias to move", cfg.arch().hf_names().0)
    }
    if lora {
        bail!("train: expert_bias_update {rate} with LoRA: the correction bias is a frozen base weight of a LoRA run; train every weight to move it")
    }
    Ok(())
}

/// Move each sparse layer's correction bias in `varmap` by `rate · sign(mean − count)` of the
/// step's global `counts` (one `[E]` row per sparse layer, in layer order).
pub(crate) fn update(varmap: &VarMap, cfg: &LlamaConfig, counts: &[Vec<u64>], rate: f64) -> Result<()> {
    let Some(m) = &cfg.moe else { bail!("expert_bias_update: the model has no experts") };
    let layers: Vec<usize> = (0..cfg.num_hidden_layers).filter(|&i| cfg.is_moe_layer(i)).collect();
    if layers.len() != counts.len() || counts.iter().any(|c| c.len() != m.num_experts) {
        bail!(
            "expert_bias_update: {} sparse layers of {} experts, counts for {} layers of {:?}",
            layers.len(),
            m.num_experts,
            counts.len(),
            counts.iter().map(Vec::len).collect::<Vec<_>>()
        )
    }
    let vars = lock_vars(varmap)?;
    for (i, c) in layers.into_iter().zip(counts) {
        let name = format!("model.layers.{i}.{}.{}.{CORRECTION_BIAS}", m.module(), m.router());
        let Some(v) = vars.get(&name) else { bail!("expert_bias_update: no parameter {name}") };
        let mean = c.iter().sum::<u64>() as f64 / c.len() as f64;
        let step: Vec<f32> = c.iter().map(|&x| (rate * sign(mean - x as f64)) as f32).collect();
        let b = v.as_tensor();
        let moved = (b.to_dtype(DType::F32)? + Tensor::from_vec(step, c.len(), b.device())?)?;
        v.set(&moved.to_dtype(b.dtype())?)?;
    }
    Ok(())
}

/// -1, 0 or 1 (`torch.sign`: 0 at 0).
fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}
