//! Which weights a [`LoraSpec`] adapts, with which rank and alpha, as PEFT's `LoraConfig`
//! selects them: the target modules ([`LoraSpec::targets`]) on the decoder layers of
//! `layers_to_transform` ([`LoraSpec::layers`]; all without), each with the rank and alpha of
//! the first `rank_pattern` / `alpha_pattern` key that matches its module's name, else `r` and
//! `lora_alpha` ([`LoraSpec::config_for`]).
//!
//! `target_modules` may instead be one regular expression ([`LoraSpec::target_regex`]): a weight
//! is adapted when it matches the module's whole name (PEFT's `re.fullmatch`), its projection one
//! of [`crate::lora::TARGETS`].
//!
//! A module's name is its weight's without `.weight` (`model.layers.3.self_attn.q_proj`); a key
//! matches a name equal to it or ending in `.` + key, and is a regular expression when it holds
//! one's metacharacters (PEFT's `re.match(rf"(.*\.)?({key})$", name)`). Keys are tried in sorted
//! order (PEFT: the file's; the same unless two keys of different values match one module). A
//! sparse layer's experts are stacked, one adapter tensor for all of them: they take the rank
//! and alpha of PEFT's name for expert 0 (`….mlp.experts.0.gate_proj`, Mixtral's
//! `….block_sparse_moe.experts.0.w1`), and a key naming one expert (`experts.3`) is refused.

use crate::lora::LoraSpec;
use candle_core::{bail, Result};
use candle_cp_nn::LoraConfig;

/// Whether `key` matches module `name` (see the module doc).
fn matches(key: &str, name: &str) -> bool {
    // (names and dots alone: plain, the dots literal)
    if key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.') {
        return name == key || name.ends_with(&format!(".{key}"));
    }
    // (checked when the pattern was set: it compiles)
    regex::Regex::new(&format!("^(?:.*\\.)?(?:{key})$")).is_ok_and(|r| r.is_match(name))
}

/// Refuse keys that do not compile or that name one expert of a stacked mixture.
fn check_keys<'a>(what: &str, keys: impl Iterator<Item = &'a String>) -> Result<()> {
    let one_expert = regex::Regex::new(r"experts\.\d").map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    for k in keys {
        if let Err(e) = regex::Regex::new(&format!("^(?:.*\\.)?(?:{k})$")) {
            bail!("LoRA {what}: key '{k}' is not a regular expression ({e})")
        }
        if one_expert.is_match(k) {
            bail!("LoRA {what}: key '{k}' names one expert; a mixture's experts share one stacked adapter (name the projection for all of them)")
        }
    }
    Ok(())
}

/// PEFT's name for module `stem` (the parameter stem): a stacked expert projection as expert 0's.
fn peft_name(stem: &str) -> String {
    for (module, proj, per) in crate::params::EXPERT_NAMES {
        if let Some(prefix) = stem.strip_suffix(&format!("{module}.experts.{proj}")) {
            return format!("{prefix}{module}.experts.0.{per}");
        }
    }
    stem.to_string()
}

impl LoraSpec {
    /// PEFT's name of the module of parameter stem `stem`: [`peft_name`]'s, a Phi-3's q, k, v
    /// and gate, up projections as their fused module ([`LoraSpec::fused`]).
    pub(crate) fn module_name(&self, stem: &str) -> String {
        if let Some((param, _)) = self.expert_param(stem) {
            return param;
        }
        self.fused_module(stem).unwrap_or_else(|| peft_name(stem))
    }

    /// The name `rank_pattern` / `alpha_pattern` keys match for weight `stem`: PEFT's key of
    /// an adapted parameter (`….mlp.experts.gate_up_proj`, a Mixtral's under transformers 5's
    /// `mlp`; a router's `….mlp.gate.weight`), else [`LoraSpec::module_name`]'s.
    fn pattern_name(&self, stem: &str) -> String {
        if let Some((param, _)) = self.expert_param(stem) {
            return crate::expert_params::peft_param(&param);
        }
        self.router_param(stem).unwrap_or_else(|| self.module_name(stem))
    }

    /// gpt-oss's expert parameter of stacked expert stem `stem` and its part
    /// (`….experts.up_proj` → (`….experts.gate_up_proj`, 1); [`LoraSpec::expert_params`]).
    fn expert_param(&self, stem: &str) -> Option<(String, usize)> {
        self.expert_params.and_then(|_| crate::expert_params::param_of(stem))
    }

    /// The router's weight as PEFT's `target_parameters` name it (`….mlp.gate.weight`) when the
    /// experts are parameters ([`LoraSpec::expert_params`]) and `stem` is a sparse layer's router
    /// (not gpt-oss's `mlp.router`).
    fn router_param(&self, stem: &str) -> Option<String> {
        self.expert_params.and_then(|_| crate::expert_params::router_param(stem))
    }

    /// The module whose one `A` weight stem `stem` shares with its other parts, and its part:
    /// a Phi-3's fused module ([`LoraSpec::fused`]), gpt-oss's `….experts.gate_up_proj` for the
    /// experts' gate and up; `None` for an adapter of its own.
    pub(crate) fn shared_a(&self, stem: &str) -> Option<(String, usize)> {
        match self.expert_param(stem) {
            Some((param, part)) if !param.ends_with("down_proj") => Some((param, part)),
            Some(_) => None,
            None => self.fused.then(|| crate::config::phi3::fused_module(stem)).flatten(),
        }
    }

    /// The fused module of weight stem `stem` under a Phi-3's spec ([`LoraSpec::fused`]).
    fn fused_module(&self, stem: &str) -> Option<String> {
        self.fused.then(|| crate::config::phi3::fused_module(stem)).flatten().map(|(m, _)| m)
    }
}

/// The decoder layer of parameter stem `stem` (`model.layers.{i}.…`).
fn layer_of(stem: &str) -> Option<usize> {
    stem.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

impl LoraSpec {
    /// The same adapters on the decoder layers `layers` only (PEFT's `layers_to_transform`;
    /// `None`: every layer).
    pub fn with_layers(mut self, layers: Option<Vec<usize>>) -> Self {
        self.layers = layers.map(|mut l| {
            l.sort_unstable();
            l.dedup();
            l
        });
        self
    }

    /// The same adapters with per-module ranks (PEFT's `rank_pattern`: module-name key → rank;
    /// see the module doc). Errors name a zero rank, a key that is not a regular expression,
    /// or one naming a single expert.
    pub fn with_rank_pattern(mut self, pattern: Vec<(String, usize)>) -> Result<Self> {
        if let Some((k, _)) = pattern.iter().find(|(_, r)| *r == 0) {
            bail!("LoRA rank_pattern: key '{k}' has rank 0")
        }
        check_keys("rank_pattern", pattern.iter().map(|(k, _)| k))?;
        self.rank_pattern = pattern;
        self.rank_pattern.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(self)
    }

    /// The same adapters with per-module alphas (PEFT's `alpha_pattern`), as
    /// [`LoraSpec::with_rank_pattern`].
    pub fn with_alpha_pattern(mut self, pattern: Vec<(String, f64)>) -> Result<Self> {
        if let Some((k, a)) = pattern.iter().find(|(_, a)| !a.is_finite()) {
            bail!("LoRA alpha_pattern: key '{k}' has alpha {a}")
        }
        check_keys("alpha_pattern", pattern.iter().map(|(k, _)| k))?;
        self.alpha_pattern = pattern;
        self.alpha_pattern.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(self)
    }

    /// The same adapters on the modules whose whole names match `regex` (PEFT's `target_modules`
    /// as a string; `None`: the [`LoraSpec::targets`] list). Errors name a regular expression
    /// that does not compile.
    pub fn with_target_regex(mut self, regex: Option<String>) -> Result<Self> {
        if let Some(r) = &regex {
            if let Err(e) = regex::Regex::new(&format!("^(?:{r})$")) {
                bail!("LoRA target_modules: '{r}' is not a regular expression ({e})")
            }
            self.targets = crate::lora::ALL_LINEAR.iter().map(|t| t.to_string()).collect();
            if self.fused {
                self.targets.extend(crate::lora::FUSED_TARGETS.iter().map(|t| t.to_string()));
            }
        }
        self.target_regex = regex;
        Ok(self)
    }

    /// Whether the weight with parameter stem `stem` (its name without `.weight`, e.g.
    /// `model.layers.0.self_attn.q_proj`; a sparse layer's stacked experts
    /// `model.layers.1.mlp.experts.gate_proj`) gets an adapter: its projection a target, its
    /// layer among [`LoraSpec::layers`].
    pub fn adapts_weight(&self, stem: &str) -> bool {
        // gpt-oss's experts: by target_parameters alone, on every layer (PEFT's; not by
        // target_modules, layers_to_transform or a target regex)
        if let Some((param, _)) = self.expert_param(stem) {
            let param = crate::expert_params::peft_param(&param);
            return self.target_parameters.iter().any(|k| crate::expert_params::key_matches(k, &param));
        }
        // (with its experts as parameters — transformers 5's layout — a router is a parameter
        // too, `Qwen3MoeTopKRouter`, not a linear module: no target module adapts it, a
        // target_parameters key naming its weight does)
        if let Some(param) = self.router_param(stem) {
            return self.target_parameters.iter().any(|k| crate::expert_params::key_matches(k, &param));
        }
        let name = self.module_name(stem);
        // (the projection as the targets name it: a Phi-3's fused module, else the stem's own —
        // Mixtral's experts are gate_proj, up_proj, down_proj there)
        let fused = self.fused_module(stem);
        let module = fused.as_deref().unwrap_or(stem).rsplit('.').next().unwrap_or(stem);
        let layer_ok = match (&self.layers, layer_of(stem)) {
            (Some(ls), Some(i)) => ls.contains(&i),
            (Some(_), None) => false,
            (None, _) => true,
        };
        let regex_ok = match &self.target_regex {
            // (compiled when set)
            Some(r) => regex::Regex::new(&format!("^(?:{r})$")).is_ok_and(|re| re.is_match(&name)),
            None => true,
        };
        self.adapts(module) && layer_ok && regex_ok
    }

    /// The rank and scale of the adapter on weight `stem` (see [`LoraSpec::adapts_weight`]):
    /// the first matching `rank_pattern` / `alpha_pattern` key's, else [`LoraSpec::config`]'s.
    pub fn config_for(&self, stem: &str) -> LoraConfig {
        let name = self.pattern_name(stem);
        let rank = self.rank_pattern.iter().find(|(k, _)| matches(k, &name)).map_or(self.config.rank, |(_, r)| *r);
        let alpha = self.alpha_pattern.iter().find(|(k, _)| matches(k, &name)).map_or(self.config.alpha, |(_, a)| *a);
        LoraConfig { rank, alpha, rslora: self.config.rslora }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain keys match a name or its last components; regular expressions the whole tail (one
    /// for every expert's `up_proj`); the experts take expert 0's name; layers select; bad keys
    /// are refused by name.
    #[test]
    fn keys_layers_and_experts() -> Result<()> {
        let s = LoraSpec::new(8, 16.0, &crate::lora::TARGETS)?
            .with_rank_pattern(vec![("q_proj".into(), 4), ("layers\\.1\\.self_attn\\.v_proj".into(), 2), ("mlp\\.experts\\.\\d+\\.up_proj".into(), 6)])?
            .with_alpha_pattern(vec![("w1".into(), 3.0)])?
            .with_layers(Some(vec![2, 0, 2]));
        assert_eq!(s.layers, Some(vec![0, 2]));
        assert_eq!(s.config_for("model.layers.0.self_attn.q_proj").rank, 4);
        assert_eq!(s.config_for("model.layers.1.self_attn.v_proj").rank, 2);
        assert_eq!(s.config_for("model.layers.11.self_attn.v_proj").rank, 8, "regex anchored at a component");
        assert_eq!(s.config_for("model.layers.3.mlp.experts.up_proj").rank, 6);
        assert_eq!(s.config_for("model.layers.3.block_sparse_moe.experts.gate_proj").alpha, 3.0, "Mixtral's w1");
        assert_eq!(s.config_for("model.layers.3.mlp.gate_proj").scale(), 2.0);
        assert!(s.adapts_weight("model.layers.2.mlp.down_proj") && !s.adapts_weight("model.layers.1.mlp.down_proj"));
        let e = s.clone().with_rank_pattern(vec![("experts.3.gate_proj".into(), 2)]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("'experts.3.gate_proj'") && e.contains("one expert"), "{e}");
        let e = s.clone().with_rank_pattern(vec![("q_proj(".into(), 2)]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("'q_proj('") && e.contains("regular expression"), "{e}");
        assert!(s.with_rank_pattern(vec![("q_proj".into(), 0)]).is_err());
        // target_modules as one regular expression over whole names (experts as expert 0)
        let r = LoraSpec::new(8, 16.0, &["q_proj"])?.with_target_regex(Some(r".*\.layers\.1\..*(v_proj|experts\.\d+\.w2)".into()))?;
        assert_eq!(r.targets.len(), crate::lora::ALL_LINEAR.len());
        assert!(r.adapts_weight("model.layers.1.self_attn.v_proj") && !r.adapts_weight("model.layers.0.self_attn.v_proj"));
        assert!(!r.adapts_weight("model.layers.1.self_attn.q_proj"), "a whole-name match");
        assert!(r.adapts_weight("model.layers.1.block_sparse_moe.experts.down_proj") && !r.adapts_weight("model.layers.1.block_sparse_moe.experts.up_proj"));
        let e = r.with_target_regex(Some("(q_proj".into())).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("'(q_proj'"), "{e}");
        Ok(())
    }
}
