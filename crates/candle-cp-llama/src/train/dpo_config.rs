//! DPO's settings ([`DpoConfig`]): β, the loss (or a mix of losses), label smoothing, RPO's α,
//! the reference, KTO's weights, the f-divergence, and the rules [`DpoConfig::validate`] holds
//! them to.

use super::dpo_loss::{DpoLoss, FDivergence};
use candle_core::{bail, Result};

/// DPO's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct DpoConfig {
    /// β: how far the policy may move from the reference (TRL's default 0.1).
    pub beta: f64,
    /// ε: the probability that a pair's labels are flipped (conservative DPO; 0: plain DPO;
    /// the sigmoid, robust, exo_pair and simpo losses).
    pub label_smoothing: f64,
    /// The loss of a pair.
    pub loss: DpoLoss,
    /// SimPO's target margin γ (TRL's `simpo_gamma`, 0.5 there).
    pub simpo_gamma: f64,
    /// α of RPO (Pang et al.; TRL's `rpo_alpha`): `α ×` the chosen answers' mean cross-entropy
    /// per scored token added to the loss (0: none).
    pub rpo_alpha: f64,
    /// The reference model: a Hugging Face checkpoint directory (TRL's `ref_model`; e.g. the SFT
    /// model when the policy starts elsewhere), loaded on the run's layout for the reference
    /// pass only. `None`: the model as the run starts.
    pub reference_model: Option<std::path::PathBuf>,
    /// KTO's λ_D, the weight of a desirable example's loss (TRL's `desirable_weight`, 1; 1 for
    /// the other losses).
    pub desirable_weight: f64,
    /// KTO's λ_U, the weight of an undesirable example's loss (TRL's `undesirable_weight`, 1).
    pub undesirable_weight: f64,
    /// No reference model (TRL's `reference_free`): the reference log-probabilities taken as
    /// 0, no reference pass. With the sigmoid loss and [`DpoConfig::rpo_alpha`] 1 this is CPO's
    /// objective (TRL's `CPOTrainer`). Not with KTO, BCO or a reference model.
    pub reference_free: bool,
    /// DiscoPOP's temperature τ (TRL's `discopop_tau`, 0.05).
    pub discopop_tau: f64,
    /// Losses mixed (TRL's `loss_type` list with its `loss_weights`; MPO: sigmoid 0.8,
    /// bco_pair 0.2, sft 1): the objective is `Σ wᵢ·lossᵢ` over the pairs, `loss` then its
    /// first entry's. Empty: `loss` alone. Pair losses only (not the unpaired ones, simpo or orpo), each
    /// once, weights > 0.
    pub mix: Vec<(DpoLoss, f64)>,
    /// The f-divergence whose difference between the answers the losses of `h` take (TRL's
    /// `f_divergence_type`, f-DPO: Wang et al. 2023): the reverse KL (DPO's `h`, the default),
    /// Jensen–Shannon or an α-divergence ([`FDivergence`]). Sigmoid, robust, exo_pair, hinge and
    /// discopop only ([`DpoLoss::takes_f_divergence`]).
    pub f_divergence: FDivergence,
    /// LD-DPO's α (Liu et al. 2024, "Length Desensitization in DPO"; TRL's `ld_alpha`): the
    /// policy's log-probability of an answer weighs its first `l_p` scored tokens by 1 and the
    /// rest by α, `l_p` the shorter answer's scored tokens of its pair (the reference's and the
    /// cross-entropy terms — RPO's, sft's — stay unweighted). `None`: DPO's plain sums (α 1).
    /// Pair losses only (not the unpaired ones, orpo or sft alone), `0 ≤ α ≤ 1`.
    pub ld_alpha: Option<f64>,
    /// WPO (Zhou et al. 2024; TRL's `use_weighting`): each pair's loss weighed by
    /// `min(1, exp(m_c + m_r))`, `m` an answer's mean over its scored tokens of `log p − log Σ_v
    /// p_v²` under the policy ([`super::wpo`]). Pair losses other than orpo and the aot ones.
    pub use_weighting: bool,
    /// TR-DPO (Gorbatovski et al. 2024; TRL's `sync_ref_model`, `ref_model_sync_steps`,
    /// `ref_model_mixup_alpha`): every `every` optimizer steps the reference's weights move to
    /// `α·policy + (1 − α)·reference` and its log-probabilities are computed anew
    /// ([`super::tr_dpo`]). Not with LoRA (the reference is the base) or without a reference.
    pub sync_ref_model: Option<RefSync>,
}

/// TR-DPO's reference updates ([`DpoConfig::sync_ref_model`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RefSync {
    /// Optimizer steps between updates (TRL's `ref_model_sync_steps`, 512).
    pub every: usize,
    /// The policy's share α of the new reference (TRL's `ref_model_mixup_alpha`, 0.6; 1: a
    /// hard update, the policy copied).
    pub alpha: f64,
}

impl Default for RefSync {
    fn default() -> Self {
        Self { every: 512, alpha: 0.6 }
    }
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self { beta: 0.1, label_smoothing: 0.0, loss: DpoLoss::Sigmoid, simpo_gamma: 0.5, rpo_alpha: 0.0, reference_model: None, desirable_weight: 1.0, undesirable_weight: 1.0, reference_free: false, discopop_tau: 0.05, mix: Vec::new(), f_divergence: FDivergence::ReverseKl, ld_alpha: None, use_weighting: false, sync_ref_model: None }
    }
}

impl DpoConfig {
    /// Whether the run has no reference (SimPO, ORPO, or [`DpoConfig::reference_free`]): no
    /// reference pass.
    pub fn without_reference(&self) -> bool {
        self.reference_free || matches!(self.loss, DpoLoss::Simpo | DpoLoss::Orpo | DpoLoss::Sft) && self.mix.is_empty()
    }

    /// The losses and their weights: [`DpoConfig::mix`], or `loss` with weight 1.
    pub fn losses(&self) -> Vec<(DpoLoss, f64)> {
        match self.mix.is_empty() {
            true => vec![(self.loss, 1.0)],
            false => self.mix.clone(),
        }
    }

    /// The weight of the objective's cross-entropy terms (RPO's α and an sft entry's weight in
    /// the mix; an sft loss alone is 1) and the objective without them (`rpo_alpha` 0, the sft
    /// entry out of the mix): how [`DpoConfig::ld_alpha`] keeps those terms on the plain sums.
    pub fn split_cross_entropy(&self) -> (f64, DpoConfig) {
        let sft: f64 = self.losses().iter().filter(|(l, _)| *l == DpoLoss::Sft).map(|(_, w)| w).sum();
        let mix: Vec<(DpoLoss, f64)> = self.mix.iter().copied().filter(|(l, _)| *l != DpoLoss::Sft).collect();
        let loss = mix.first().map_or(self.loss, |&(l, _)| l);
        (self.rpo_alpha + sft, DpoConfig { rpo_alpha: 0.0, mix, loss, ..self.clone() })
    }

    /// Whether the objective keeps BCO's running mean reward (bco or bco_pair, alone or mixed).
    pub fn keeps_running_mean(&self) -> bool {
        self.losses().iter().any(|(l, _)| l.running_mean())
    }

    /// Errors unless `beta > 0`, `0 ≤ label_smoothing < 0.5` (only with the losses that take it,
    /// [`DpoLoss::takes_label_smoothing`]; above 0 with exo_pair), `rpo_alpha ≥ 0` (none with
    /// KTO), KTO's weights and DiscoPOP's τ `> 0`, at most one of `reference_free`, a
    /// reference-free loss and `reference_model` (KTO and BCO never reference-free), λ_D and λ_U
    /// 1 but with KTO, no RPO with KTO or BCO (unpaired examples), an f-divergence other than the
    /// reverse KL only with a loss that takes it (α > 0), LD-DPO's α in `[0, 1]` with pair losses
    /// other than orpo (and not sft alone), WPO with pair losses other than orpo and aot (and not
    /// sft alone), TR-DPO's updates every ≥ 1 step with `0 < α ≤ 1` and a reference.
    pub fn validate(&self) -> Result<()> {
        if let Some(r) = self.sync_ref_model {
            if r.every == 0 || !(r.alpha > 0.0 && r.alpha <= 1.0) {
                bail!("dpo: sync_ref_model (TR-DPO) needs every ≥ 1 step and 0 < alpha ≤ 1, got every {} and alpha {}", r.every, r.alpha)
            }
            if self.without_reference() {
                bail!("dpo: sync_ref_model (TR-DPO) updates the reference; {} has none", if self.reference_free { "reference_free".to_string() } else { format!("the {} loss", self.loss.name()) })
            }
        }
        if self.use_weighting {
            if let Some((l, _)) = self.losses().into_iter().find(|(l, _)| l.unpaired() || matches!(l, DpoLoss::Orpo | DpoLoss::Aot | DpoLoss::AotPair)) {
                bail!(
                    "dpo: use_weighting (WPO) weighs each pair's loss; the {} loss {}",
                    l.name(),
                    if l.unpaired() { "trains unpaired examples" } else if l == DpoLoss::Orpo { "is not DPO's (TRL's ORPO takes no weights)" } else { "scores sorted positions, not pairs" }
                )
            }
            if self.losses().iter().all(|(l, _)| *l == DpoLoss::Sft) {
                bail!("dpo: use_weighting (WPO) weighs the pair losses; the sft loss alone has none")
            }
        }
        if let Some(a) = self.ld_alpha {
            if !(0.0..=1.0).contains(&a) {
                bail!("dpo: ld_alpha (LD-DPO's weight of the tokens past the shorter answer's length) must be in [0, 1], got {a}")
            }
            if let Some((l, _)) = self.losses().into_iter().find(|(l, _)| l.unpaired() || *l == DpoLoss::Orpo) {
                bail!("dpo: ld_alpha weighs the tokens of a pair's longer answer; the {} loss {}", l.name(), if l.unpaired() { "trains unpaired examples" } else { "compares mean log-probabilities (its odds)" })
            }
            if self.losses().iter().all(|(l, _)| *l == DpoLoss::Sft) {
                bail!("dpo: ld_alpha weighs the pair losses' log-probabilities; the sft loss alone has none (its cross-entropy stays unweighted)")
            }
        }
        if !(self.beta > 0.0 && self.beta.is_finite()) {
            bail!("dpo: beta must be a positive number, got {}", self.beta)
        }
        if let FDivergence::Alpha(a) = self.f_divergence {
            if !(a > 0.0 && a.is_finite()) {
                bail!("dpo: the alpha divergence's coefficient must be a positive number, got {a}")
            }
        }
        if self.f_divergence != FDivergence::ReverseKl && !self.losses().iter().any(|(l, _)| l.takes_f_divergence()) {
            bail!(
                "dpo: the {} f-divergence changes the sigmoid, robust, exo_pair, hinge and discopop losses' h; {} has none of them",
                self.f_divergence.name(),
                self.losses().iter().map(|(l, _)| l.name()).collect::<Vec<_>>().join(" + ")
            )
        }
        if let Some(&(first, _)) = self.mix.first() {
            if first != self.loss {
                bail!("dpo: the mix starts with {}, the loss is {}: set loss to the mix's first", first.name(), self.loss.name())
            }
            for (i, &(l, w)) in self.mix.iter().enumerate() {
                if l.unpaired() || matches!(l, DpoLoss::Simpo | DpoLoss::Orpo) {
                    bail!("dpo: the {} loss does not mix (kto, bco and apo_zero_unpaired train unpaired examples; simpo and orpo have no reference): train it alone", l.name())
                }
                if self.mix[..i].iter().any(|&(m, _)| m == l) {
                    bail!("dpo: the {} loss is in the mix twice", l.name())
                }
                if !(w > 0.0 && w.is_finite()) {
                    bail!("dpo: the {} loss's weight in the mix must be a positive number, got {w}", l.name())
                }
            }
            let mixed = DpoConfig { mix: Vec::new(), ..self.clone() };
            for &(l, _) in &self.mix {
                // each as if alone, but label smoothing may be some entries' only
                let smoothing = if l.takes_label_smoothing() { mixed.label_smoothing } else { 0.0 };
                let f_divergence = if l.takes_f_divergence() { mixed.f_divergence } else { FDivergence::ReverseKl };
                // (an sft entry's cross-entropy is never LD-weighted; WPO weighs the whole mix and
                // TR-DPO moves the reference of the mix's other losses)
                let (ld_alpha, use_weighting, sync_ref_model) = match l {
                    DpoLoss::Sft => (None, false, None),
                    _ => (mixed.ld_alpha, mixed.use_weighting, mixed.sync_ref_model),
                };
                DpoConfig { loss: l, label_smoothing: smoothing, f_divergence, ld_alpha, use_weighting, sync_ref_model, ..mixed.clone() }.validate()?;
            }
            if self.label_smoothing > 0.0 && !self.mix.iter().any(|(l, _)| l.takes_label_smoothing()) {
                bail!("dpo: label smoothing is the sigmoid, robust, exo_pair, simpo, aot_pair and aot losses'; none is in the mix")
            }
            return Ok(());
        }
        if !(0.0..0.5).contains(&self.label_smoothing) {
            bail!("dpo: label_smoothing must be in [0, 0.5), got {}", self.label_smoothing)
        }
        if self.label_smoothing > 0.0 && !self.loss.takes_label_smoothing() {
            bail!("dpo: label smoothing is the sigmoid, robust, exo_pair, simpo, aot_pair and aot losses'; the {} loss takes none", self.loss.name())
        }
        if self.loss == DpoLoss::ExoPair && self.label_smoothing <= 0.0 {
            bail!("dpo: the exo_pair loss needs label_smoothing in (0, 0.5) (its log ε; TRL advises 1e-3)")
        }
        if self.without_reference() && self.reference_model.is_some() {
            match self.reference_free {
                true => bail!("dpo: reference_free and a reference model: give one"),
                false => bail!("dpo: the {} loss takes no reference model", self.loss.name()),
            }
        }
        if !(self.discopop_tau > 0.0 && self.discopop_tau.is_finite()) {
            bail!("dpo: discopop_tau must be a positive number, got {}", self.discopop_tau)
        }
        if self.reference_free && self.loss.unpaired() {
            bail!("dpo: the {} loss needs its reference (its rewards against a baseline): not reference_free", self.loss.name())
        }
        if !(self.rpo_alpha >= 0.0 && self.rpo_alpha.is_finite() && self.simpo_gamma.is_finite()) {
            bail!("dpo: rpo_alpha must be ≥ 0 and simpo_gamma a number, got {} and {}", self.rpo_alpha, self.simpo_gamma)
        }
        if self.loss.unpaired() && self.rpo_alpha > 0.0 {
            bail!("dpo: the {} loss takes no rpo_alpha (its examples are not pairs)", self.loss.name())
        }
        if !self.loss.takes_example_weights() && (self.desirable_weight != 1.0 || self.undesirable_weight != 1.0) {
            bail!("dpo: desirable_weight and undesirable_weight are the kto and apo_zero_unpaired losses', not {}'s (got {} and {})", self.loss.name(), self.desirable_weight, self.undesirable_weight)
        }
        if !(self.desirable_weight > 0.0 && self.desirable_weight.is_finite() && self.undesirable_weight > 0.0 && self.undesirable_weight.is_finite()) {
            bail!("dpo: KTO's desirable and undesirable weights must be positive numbers, got {} and {}", self.desirable_weight, self.undesirable_weight)
        }
        Ok(())
    }
}
