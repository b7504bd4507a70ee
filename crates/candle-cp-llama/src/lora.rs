//! LoRA fine-tuning of the model: adapters on chosen projections of every decoder layer
//! ([`LoraSpec`], [`crate::LlamaConfig::lora`]), the other parameters frozen.
//!
//! The adapters are parameters like the others ([`crate::param_specs`] lists them after the
//! weight they adapt, `….{q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight`, split over TP as
//! `candle_cp_nn::lora` says), so sharding, gathering, the gradient sums and ZeRO treat them
//! as any parameter; [`crate::params::trainable_specs`] is what a LoRA run trains. In a sparse
//! layer the targets `gate_proj`, `up_proj`, `down_proj` adapt every expert's projections
//! (factors stacked as the experts' weights, `….experts.{proj}.lora_A.weight` `[E, r, in]`,
//! `lora_B` `[E, out, r]`, split over EP as they are) and the shared expert's, as PEFT does.
//!
//! PEFT's `layers_to_transform`, `rank_pattern`, `alpha_pattern` and a `target_modules` regular
//! expression select layers and modules and give modules their own rank and alpha ([`crate::lora_select`]: [`LoraSpec::adapts_weight`],
//! [`LoraSpec::config_for`]).
//!
//! On disk they are a PEFT adapter: `adapter_model.safetensors` (names prefixed
//! `base_model.model.`; an expert's factors under its own name,
//! `….experts.{e}.{proj}.lora_A.weight`, Mixtral's `w1`, `w3`, `w2`) and `adapter_config.json`
//! ([`save_peft_adapter`], [`load_peft_adapter`]), which `peft.PeftModel.from_pretrained` reads
//! beside the base model.

use candle_core::{bail, Device, Result, Tensor};
use candle_cp_nn::LoraConfig;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The projections of a decoder layer LoRA may adapt (PEFT's `target_modules` names).
pub const TARGETS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// A mixture of experts' routers as PEFT names them (transformers 4's linear modules
/// `mlp.gate` / Mixtral's `block_sparse_moe.gate` `[E, h]`, Qwen2-MoE's `mlp.shared_expert_gate`
/// `[1, h]`): targets beside [`TARGETS`] (gpt-oss's `mlp.router` is no linear module in PEFT).
pub const ROUTER_TARGETS: [&str; 2] = ["gate", "shared_expert_gate"];

/// DeepSeek-V3's latent attention's projections ([`crate::config::deepseek`]): targets beside
/// [`TARGETS`] (its `q_proj` when `q_lora_rank` is null, and `o_proj`, are among those).
pub const MLA_TARGETS: [&str; 4] = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"];

/// PEFT's `all-linear`: every projection ([`TARGETS`], [`MLA_TARGETS`]) and the routers
/// ([`ROUTER_TARGETS`]), the head excepted.
pub const ALL_LINEAR: [&str; 13] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate", "shared_expert_gate", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"];

/// A Phi-3's fused modules as PEFT names them (its `qkv_proj` holds q, k, v; `gate_up_proj`
/// gate and up: [`crate::config::phi3`]), targets beside [`TARGETS`] on a Phi-3 only.
pub const FUSED_TARGETS: [&str; 2] = ["qkv_proj", "gate_up_proj"];

/// PEFT's prefix of the adapter tensors' names in `adapter_model.safetensors`.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Which projections get adapters, and their rank and scale.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    /// Rank and `lora_alpha`.
    pub config: LoraConfig,
    /// PEFT module names, a subset of [`TARGETS`], in that order.
    pub targets: Vec<String>,
    /// Dropout on the adapters' inputs while training (PEFT's `lora_dropout`, in `[0, 1)`).
    pub dropout: f64,
    /// DoRA (PEFT's `use_dora`): each adapted weight `m / ‖W + s·B·A‖ ⊙ (W + s·B·A)` with a
    /// trained magnitude `m` per output row (`….lora_magnitude_vector`, [`candle_cp_nn::dora`]).
    pub dora: bool,
    /// Modules trained whole beside the adapters and saved in the adapter file (PEFT's
    /// `modules_to_save`): some of [`SAVED_MODULES`], e.g. for tokens added to the vocabulary.
    pub modules_to_save: Vec<String>,
    /// The decoder layers adapted (PEFT's `layers_to_transform`; `None`: every layer), sorted.
    pub layers: Option<Vec<usize>>,
    /// Per-module ranks (PEFT's `rank_pattern`), sorted by key: see [`crate::lora_select`].
    pub rank_pattern: Vec<(String, usize)>,
    /// Per-module alphas (PEFT's `alpha_pattern`), sorted by key.
    pub alpha_pattern: Vec<(String, f64)>,
    /// PEFT's `target_modules` as one regular expression over the modules' whole names
    /// (`re.fullmatch`), [`LoraSpec::targets`] then every projection: see [`crate::lora_select`].
    pub target_regex: Option<String>,
    /// The modules are a Phi-3's (set by [`crate::LlamaConfig::with_lora`] from the config):
    /// q, k, v adapted as the parts of `qkv_proj` — one `A` shared, `B` and DoRA's magnitude
    /// split by rows —, gate and up as those of `gate_up_proj` (see [`crate::config::phi3`]).
    pub fused: bool,
    /// PEFT's `target_parameters`: keys naming expert parameters as transformers names them
    /// (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, or one layer's, `7.mlp.experts.down_proj`),
    /// sorted; see [`crate::expert_params`].
    pub target_parameters: Vec<String>,
    /// The experts are parameters, their fused `gate_up_proj` in this layout (set by
    /// [`crate::LlamaConfig::with_lora`]: gpt-oss's always, interleaved; a Qwen3-MoE's,
    /// Qwen2-MoE's or Mixtral's when [`LoraSpec::target_parameters`] are given, as transformers 5 holds
    /// them): only target_parameters adapt them, `target_modules` do not (as in PEFT, where
    /// they are not linear modules). `None`: the experts are modules (transformers 4's
    /// `mlp.experts.{e}.gate_proj`), adapted by `target_modules`.
    pub expert_params: Option<GateUp>,
    /// GLM-4's `(head_dim, R)` (set by [`crate::LlamaConfig::with_lora`]): its PEFT files hold
    /// q_proj's and k_proj's `lora_B` rows and DoRA magnitudes in the checkpoint's interleaved
    /// order, which [`save_peft_adapter`] writes and [`model_adapters`] reads
    /// ([`crate::config::glm4`]). `None` for the other models.
    pub interleaved_rope: Option<(usize, usize)>,
}

/// How a fused `mlp.experts.gate_up_proj` holds gate's and up's outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateUp {
    /// Alternating columns, gate first (gpt-oss's `[E, h, 2·I]`).
    Interleaved,
    /// Gate's `I` rows, then up's (transformers 5's Qwen3-MoE / Qwen2-MoE `[E, 2·I, h]`).
    Concatenated,
}

/// The modules [`LoraSpec::modules_to_save`] may name, and their parameters (a reward model's
/// score head, [`crate::reward`], as PEFT's `SEQ_CLS` task trains it; a token classifier's
/// with its bias, [`crate::prm`], as the `TOKEN_CLS` task does).
pub const SAVED_MODULES: [(&str, &str); 4] = [("embed_tokens", "model.embed_tokens.weight"), ("lm_head", "lm_head.weight"), ("score", crate::reward::SCORE), ("score", crate::prm::SCORE_BIAS)];

impl LoraSpec {
    /// Adapters of rank `rank`, scale `alpha / rank`, on the projections `targets` (PEFT
    /// names: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`).
    /// Errors name an unknown or missing target.
    /// A Phi-3's `qkv_proj` / `gate_up_proj` ([`FUSED_TARGETS`]) are targets too.
    pub fn new(rank: usize, alpha: f64, targets: &[&str]) -> Result<Self> {
        let config = LoraConfig::new(rank, alpha)?;
        let known = || TARGETS.iter().chain(&FUSED_TARGETS).chain(&ROUTER_TARGETS).chain(&MLA_TARGETS);
        if let Some(t) = targets.iter().find(|t| !known().any(|k| k == *t)) {
            bail!("LoRA: unknown target module '{t}' (one of {TARGETS:?}, a mixture's routers {ROUTER_TARGETS:?}, a Phi-3's {FUSED_TARGETS:?} or DeepSeek-V3's {MLA_TARGETS:?})")
        }
        if targets.is_empty() {
            bail!("LoRA: no target modules (some of {TARGETS:?})")
        }
        let targets = known().filter(|t| targets.contains(t)).map(|t| t.to_string()).collect();
        Ok(Self { config, targets, dropout: 0.0, dora: false, modules_to_save: Vec::new(), layers: None, rank_pattern: Vec::new(), alpha_pattern: Vec::new(), target_regex: None, fused: false, target_parameters: Vec::new(), expert_params: None, interleaved_rope: None })
    }

    /// Adapters of rank `rank`, scale `alpha / rank`, on the expert parameters `keys` alone
    /// (PEFT's `target_parameters` without `target_modules`; see
    /// [`LoraSpec::with_target_parameters`]). Errors as those two do.
    pub fn on_parameters(rank: usize, alpha: f64, keys: &[&str]) -> Result<Self> {
        let mut s = Self::new(rank, alpha, &["q_proj"])?;
        s.targets.clear();
        s.with_target_parameters(keys)
    }

    /// The same adapters also on the expert parameters `keys` (PEFT's `target_parameters`):
    /// `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`, and transformers 5's routers'
    /// `mlp.gate.weight` (not gpt-oss's), a key naming a parameter whose name equals it or ends
    /// in `.` + it (`7.mlp.experts.down_proj`: layer 7's; `gate_up_proj`, `gate.weight`: every
    /// sparse layer's, as PEFT's conversion of a transformers 4 adapter names them).
    /// PEFT's ranks: `r` per expert (its factors are `[r·E, in]`, `[out, r·E]`), a
    /// `rank_pattern` key matching the parameter's name. Errors name a key that can name no
    /// expert parameter; [`crate::LlamaConfig::validate`] refuses them with dropout or DoRA
    /// (PEFT does) and on a model whose experts are modules.
    pub fn with_target_parameters(mut self, keys: &[&str]) -> Result<Self> {
        for k in keys {
            crate::expert_params::check_key(k)?;
        }
        let mut keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        keys.sort();
        keys.dedup();
        self.target_parameters = keys;
        Ok(self)
    }

    /// The same adapters on a model whose experts are parameters held in layout `layout`
    /// ([`LoraSpec::expert_params`]) or modules (`None`).
    pub fn with_expert_params(mut self, layout: Option<GateUp>) -> Self {
        self.expert_params = layout;
        self
    }

    /// The same adapters on a GLM-4 of `(head_dim, R)` ([`LoraSpec::interleaved_rope`]) or
    /// another model (`None`).
    pub fn with_interleaved_rope(mut self, dr: Option<(usize, usize)>) -> Self {
        self.interleaved_rope = dr;
        self
    }

    /// The same adapters on a Phi-3 (`on`: [`LoraSpec::fused`]) or another model. On a Phi-3 a
    /// list naming all of q, k, v names `qkv_proj` instead, all of gate, up `gate_up_proj`
    /// (PEFT's modules there; `all-linear`'s seven become its four); some of them only is left
    /// for [`crate::LlamaConfig::validate`] to refuse.
    pub fn with_fused(mut self, on: bool) -> Self {
        self.fused = on;
        // (a regular expression over the modules' names: the fused modules among the candidates)
        if on && self.target_regex.is_some() && !self.targets.iter().any(|t| t == FUSED_TARGETS[0]) {
            self.targets.extend(FUSED_TARGETS.iter().map(|t| t.to_string()));
        }
        if on && self.target_regex.is_none() {
            for (parts, fused) in [(&["q_proj", "k_proj", "v_proj"][..], "qkv_proj"), (&["gate_proj", "up_proj"][..], "gate_up_proj")] {
                if parts.iter().all(|p| self.targets.iter().any(|t| t == p)) {
                    self.targets.retain(|t| !parts.contains(&t.as_str()));
                    self.targets.push(fused.to_string());
                }
            }
            let order = |t: &String| TARGETS.iter().chain(&FUSED_TARGETS).chain(&ROUTER_TARGETS).chain(&MLA_TARGETS).position(|k| k == t);
            self.targets.sort_by_key(order);
        }
        self
    }

    /// The same adapters with dropout `p` on their inputs while training (PEFT's
    /// `lora_dropout`). Errors unless `p` is in `[0, 1)`.
    pub fn with_dropout(mut self, p: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            bail!("LoRA: dropout {p} must be in [0, 1)")
        }
        self.dropout = p;
        Ok(self)
    }

    /// The same adapters with rsLoRA's scale `alpha / √r` (`on`, PEFT's `use_rslora`).
    pub fn with_rslora(mut self, on: bool) -> Self {
        self.config = self.config.with_rslora(on);
        self
    }

    /// The same adapters as DoRA (`on`, PEFT's `use_dora`) or plain LoRA.
    pub fn with_dora(mut self, on: bool) -> Self {
        self.dora = on;
        self
    }

    /// The same adapters with `modules` (some of `embed_tokens`, `lm_head`: [`SAVED_MODULES`])
    /// trained whole beside them (PEFT's `modules_to_save`). Errors name another module.
    pub fn with_modules_to_save(mut self, modules: &[&str]) -> Result<Self> {
        if let Some(m) = modules.iter().find(|m| !SAVED_MODULES.iter().any(|(n, _)| n == *m)) {
            bail!("LoRA: module '{m}' cannot be trained whole beside the adapters (modules_to_save: some of {:?})", SAVED_MODULES.map(|(n, _)| n))
        }
        self.modules_to_save = SAVED_MODULES.iter().filter(|(n, _)| modules.contains(n)).map(|(n, _)| n.to_string()).collect();
        // (a module of several parameters once)
        self.modules_to_save.dedup();
        Ok(self)
    }

    /// Whether a run with these adapters trains parameter `name`: an adapter's factor or DoRA
    /// magnitude ([`is_lora_name`]), or a module trained whole ([`LoraSpec::modules_to_save`]).
    pub fn trains(&self, name: &str) -> bool {
        is_lora_name(name) || self.saved_param(name)
    }

    /// Whether `name` is the parameter of a module in [`LoraSpec::modules_to_save`].
    pub fn saved_param(&self, name: &str) -> bool {
        SAVED_MODULES.iter().any(|(m, p)| *p == name && self.modules_to_save.iter().any(|s| s == m))
    }

    /// Whether projection `module` (e.g. `q_proj`) is adapted.
    pub fn adapts(&self, module: &str) -> bool {
        self.targets.iter().any(|t| t == module)
    }

    /// PEFT's `adapter_config.json` for these adapters on the model at `base` (a name or a
    /// path, as `base_model_name_or_path`).
    pub fn peft_config_json(&self, base: &str) -> serde_json::Value {
        let mut v = serde_json::json!({
            "peft_type": "LORA",
            // (a reward model's adapters: PEFT's sequence-classification task, its score head
            // trained whole)
            "task_type": if self.modules_to_save.iter().any(|m| m == "score") { "SEQ_CLS" } else { "CAUSAL_LM" },
            "base_model_name_or_path": base,
            "r": self.config.rank,
            "lora_alpha": self.config.alpha,
            "lora_dropout": self.dropout,
            "use_rslora": self.config.rslora,
            "use_dora": self.dora,
            "bias": "none",
            "target_modules": match &self.target_regex {
                Some(r) => serde_json::json!(r),
                None if self.targets.is_empty() => serde_json::Value::Null,
                None => serde_json::json!(self.targets),
            },
            "fan_in_fan_out": false,
            "modules_to_save": if self.modules_to_save.is_empty() { serde_json::Value::Null } else { serde_json::json!(self.modules_to_save) },
            "layers_to_transform": self.layers,
            "layers_pattern": self.layers.as_ref().map(|_| "layers"),
            "rank_pattern": self.rank_pattern.iter().map(|(k, r)| (k.clone(), serde_json::json!(r))).collect::<serde_json::Map<_, _>>(),
            "alpha_pattern": self.alpha_pattern.iter().map(|(k, a)| (k.clone(), serde_json::json!(a))).collect::<serde_json::Map<_, _>>(),
            "inference_mode": false,
        });
        // (written only when set: PEFT before 0.17 has no such field)
        if !self.target_parameters.is_empty() {
            v["target_parameters"] = serde_json::json!(self.target_parameters);
        }
        v
    }
}

impl std::fmt::Display for LoraSpec {
    /// `rank 8, alpha 16 (rsLoRA) on q_proj, v_proj`
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rs = match (self.config.rslora, self.dora) {
            (true, true) => " (rsLoRA, DoRA)",
            (true, false) => " (rsLoRA)",
            (false, true) => " (DoRA)",
            (false, false) => "",
        };
        let drop = if self.dropout > 0.0 { format!(", dropout {}", self.dropout) } else { String::new() };
        let drop = if self.modules_to_save.is_empty() { drop } else { format!("{drop}, {} trained whole", self.modules_to_save.join(", ")) };
        let drop = match &self.layers {
            Some(ls) => format!("{drop}, layers {ls:?} only"),
            None => drop,
        };
        let drop = if self.rank_pattern.is_empty() && self.alpha_pattern.is_empty() { drop } else { format!("{drop}, per-module ranks {:?} / alphas {:?}", self.rank_pattern, self.alpha_pattern) };
        let on = match &self.target_regex {
            Some(r) => format!("the modules matching '{r}'"),
            None => self.targets.join(", "),
        };
        let on = match (self.target_parameters.is_empty(), on.is_empty()) {
            (true, _) => on,
            (false, true) => format!("the parameters {}", self.target_parameters.join(", ")),
            (false, false) => format!("{on} and the parameters {}", self.target_parameters.join(", ")),
        };
        write!(f, "rank {}, alpha {}{rs}{drop} on {on}", self.config.rank, self.config.alpha)
    }
}

impl crate::LlamaConfig {
    /// The same config with LoRA adapters `lora` (or none).
    pub fn with_lora(mut self, lora: Option<LoraSpec>) -> Self {
        // (a Phi-3's modules are its fused ones: LoraSpec::with_fused)
        // (the experts as parameters: gpt-oss's always; another mixture's when the spec names them)
        // (or when the spec says so, on a mixture: `expert_params::transformers_5_spec`)
        let layout = |l: &LoraSpec| match (self.gpt_oss, self.moe.is_some() && !l.target_parameters.is_empty()) {
            (true, _) => Some(GateUp::Interleaved),
            (false, true) => Some(GateUp::Concatenated),
            (false, false) => l.expert_params.filter(|_| self.moe.is_some()),
        };
        self.lora = lora.map(|l| {
            let g = layout(&l);
            l.with_fused(self.phi3).with_expert_params(g).with_interleaved_rope(self.interleaved_rope())
        });
        self
    }
}

/// Whether parameter `name` is a LoRA factor (`….lora_A.weight` / `….lora_B.weight`) or a DoRA
/// magnitude (`….lora_magnitude_vector`).
pub fn is_lora_name(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight") || name.ends_with(MAGNITUDE)
}

/// The suffix of a DoRA magnitude's name (PEFT's, in the adapter file and the model).
pub const MAGNITUDE: &str = ".lora_magnitude_vector";

/// Write the adapters `tensors` (full tensors by parameter name) as a PEFT adapter into
/// `dir`: `adapter_model.safetensors` and `adapter_config.json` (`base` as its base model).
pub fn save_peft_adapter(dir: &Path, spec: &LoraSpec, tensors: &HashMap<String, Tensor>, base: &str) -> Result<()> {
    save_peft_adapter_as(dir, spec, tensors, base, None)
}

/// [`save_peft_adapter`] with PEFT's `task_type` given (`None`: from the tensors — a token
/// classifier's head bias saved makes it `TOKEN_CLS`, a score head `SEQ_CLS`).
pub(crate) fn save_peft_adapter_as(dir: &Path, spec: &LoraSpec, tensors: &HashMap<String, Tensor>, base: &str, task: Option<&str>) -> Result<()> {
    // (with the modules trained whole, under their own names, as PEFT saves modules_to_save)
    let adapters: HashMap<String, Tensor> = tensors.iter().filter(|(n, _)| spec.trains(n)).map(|(n, t)| (n.clone(), t.clone())).collect();
    // (a Phi-3's parts' B and magnitudes as its fused modules', PEFT's: crate::config::phi3)
    let adapters: HashMap<String, Tensor> = match spec.fused {
        true => crate::config::phi3::fuse_checkpoint_tensors(true, adapters.into_iter().collect())?
            .into_iter()
            .map(|(n, parts)| Ok((n, Tensor::cat(&parts, 0)?)))
            .collect::<Result<_>>()?,
        false => adapters,
    };
    // (GLM-4's q / k rows in its checkpoints' interleaved order: crate::config::glm4)
    let adapters = match spec.interleaved_rope {
        Some(dr) => crate::config::glm4::permute_adapters(adapters, dr, true)?,
        None => adapters,
    };
    // (gpt-oss's experts as PEFT's parameter wrappers: crate::expert_params)
    let adapters = match spec.expert_params {
        Some(layout) => crate::expert_params::to_peft(adapters, layout)?,
        None if !spec.target_parameters.is_empty() => bail!("save_peft_adapter: target_parameters on a spec that does not say how the experts are held (take it from LlamaConfig::with_lora)"),
        None => adapters,
    };
    // (a sparse layer's stacked expert factors as PEFT's per-expert tensors)
    let named: HashMap<String, Tensor> = crate::moe_lora::split_expert_adapters(&adapters)?
        .into_iter()
        .map(|(n, t)| Ok((format!("{PEFT_PREFIX}{n}"), t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<Result<_>>()?;
    if named.is_empty() {
        bail!("save_peft_adapter: no LoRA tensors to write into {}", dir.display())
    }
    let io = |what: &str, p: &Path, e: std::io::Error| candle_core::Error::Msg(format!("{what} {}: {e}", p.display()));
    std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
    candle_core::safetensors::save(&named, dir.join("adapter_model.safetensors"))?;
    let cfg = dir.join("adapter_config.json");
    let mut json = spec.peft_config_json(base);
    // (a token classifier's adapters, its head's bias among the modules trained whole: PEFT's
    // token-classification task)
    match task {
        Some(t) => json["task_type"] = serde_json::json!(t),
        None if adapters.contains_key(crate::prm::SCORE_BIAS) => json["task_type"] = serde_json::json!("TOKEN_CLS"),
        None => {}
    }
    // Mixtral's experts are w1, w3, w2 to PEFT
    if spec.target_regex.is_none() && !spec.targets.is_empty() {
        json["target_modules"] = serde_json::json!(crate::moe_lora::peft_target_names(&spec.targets, named.keys()));
    }
    let text = serde_json::to_string_pretty(&json).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    std::fs::write(&cfg, text).map_err(|e| io("writing", &cfg, e))
}

/// Whether `dir` holds a PEFT adapter (`adapter_config.json`), as a LoRA run's checkpoints do.
pub fn has_adapter(dir: &Path) -> bool {
    dir.join("adapter_config.json").exists()
}

/// Whether `dir` holds a model's weights (`model.safetensors` or
/// `model.safetensors.index.json`) and its `config.json`.
pub fn has_model_weights(dir: &Path) -> bool {
    dir.join("config.json").exists() && (dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists())
}

/// The directory holding the base model of checkpoint `dir`, for [`crate::load_hf_sharded`]:
/// `dir` itself when it holds the weights ([`has_model_weights`]: a full fine-tune's
/// checkpoint, a Hugging Face model); else, for a PEFT adapter that names its base (a LoRA
/// run's checkpoints keep only the adapter and reference the frozen base, written once), the
/// adapter's `base_model_name_or_path` — as given (absolute, or relative to the working
/// directory), relative to `dir`, or, for a run directory moved since it was written, the
/// trainer's `<out>/base` beside `<out>/checkpoints/step-N`. Errors name every place looked at.
pub fn base_model_dir(dir: &Path) -> Result<PathBuf> {
    if has_model_weights(dir) {
        return Ok(dir.to_path_buf());
    }
    if !has_adapter(dir) {
        bail!("{}: no model weights (config.json with model.safetensors or its index) and no adapter_config.json", dir.display())
    }
    let base = read_adapter_config(dir)?.get("base_model_name_or_path").and_then(|b| b.as_str().map(String::from)).unwrap_or_default();
    let given = PathBuf::from(&base);
    let mut tried = vec![given.clone()];
    if given.is_relative() {
        tried.push(dir.join(&given));
    }
    tried.push(dir.join("..").join("..").join("base"));
    match tried.iter().find(|p| !p.as_os_str().is_empty() && has_model_weights(p)) {
        Some(p) => Ok(p.clone()),
        None => bail!(
            "{}: the adapter's base model '{base}' was not found (looked in {})",
            dir.display(),
            tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The tensor names of the PEFT adapter in `dir` (`adapter_model.safetensors`, `base_model.model.`
/// prefix removed), from the file's header alone.
pub fn adapter_tensor_names(dir: &Path) -> Result<Vec<String>> {
    // SAFETY: mapped read-only for this call; adapter files are not rewritten in place
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(dir.join("adapter_model.safetensors"))? };
    Ok(st.tensors().into_iter().map(|(n, _)| n.strip_prefix(PEFT_PREFIX).map(String::from).unwrap_or(n)).collect())
}

/// `dir/adapter_config.json` as JSON.
pub fn read_adapter_config(dir: &Path) -> Result<serde_json::Value> {
    let cfg_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| candle_core::Error::Msg(format!("reading {}: {e}", cfg_path.display())))?;
    serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", cfg_path.display())))
}

/// Add this rank's shards of the PEFT adapter in `dir` to `varmap` (the base model's shards,
/// e.g. from [`crate::load_hf_sharded`] of the same directory) and return `cfg` with its
/// [`LoraSpec`]: build the model from both to run the fine-tuned model (generation). `None`
/// when `dir` holds no adapter. Errors name a missing adapter tensor or one of another shape.
pub fn load_adapter_sharded(dir: &Path, cfg: &crate::LlamaConfig, varmap: &candle_nn::VarMap, ctx: &crate::ParallelCtx, dtype: candle_core::DType, device: &Device) -> Result<Option<crate::LlamaConfig>> {
    if !has_adapter(dir) {
        return Ok(None);
    }
    let (spec, tensors) = load_peft_adapter(dir)?;
    let cfg = cfg.clone().with_lora(Some(crate::expert_params::transformers_5_spec(cfg, spec, tensors.keys())));
    insert_loaded_adapter(dir, &cfg, &tensors, varmap, ctx, dtype, device)?;
    Ok(Some(cfg))
}

/// Insert this rank's shards of `cfg`'s adapters from `tensors` (the full tensors of the PEFT
/// adapter in `dir`, [`load_peft_adapter`]'s) into `varmap`. Errors name a tensor the spec does
/// not give the model (none is left out silently), one missing, or one of another shape.
pub(crate) fn insert_loaded_adapter(
    dir: &Path,
    cfg: &crate::LlamaConfig,
    tensors: &HashMap<String, Tensor>,
    varmap: &candle_nn::VarMap,
    ctx: &crate::ParallelCtx,
    dtype: candle_core::DType,
    device: &Device,
) -> Result<()> {
    let Some(spec) = &cfg.lora else { bail!("{}: inserting an adapter into a model without a LoRA spec", dir.display()) };
    // (gpt-oss's expert wrappers as the model's factors)
    let converted = model_adapters(cfg, tensors.clone()).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", dir.display())))?;
    let tensors = &converted;
    // (a Phi-3's fused B and magnitudes split into its parts')
    let split;
    let tensors = match cfg.phi3 {
        true => {
            split = crate::config::phi3::split_fused_adapters(cfg, tensors)?;
            &split
        }
        false => tensors,
    };
    let names: std::collections::HashSet<String> = crate::param_specs(cfg).into_iter().filter(|s| spec.trains(&s.name)).map(|s| s.name).collect();
    if let Some(extra) = tensors.keys().find(|n| !names.contains(*n)) {
        bail!("{}: the adapter's {extra} is not one of the {} adapter tensors of this model ({} layers)", dir.display(), names.len(), cfg.num_hidden_layers)
    }
    let full_of = |s: &crate::ParamSpec| match tensors.get(&s.name) {
        Some(t) => Ok(t.clone()),
        None => bail!("{}: the adapter has no {} {:?}", dir.display(), s.name, s.shape),
    };
    insert_adapter_shards(varmap, cfg, ctx, dtype, device, full_of)?;
    // the modules trained whole replace the base's
    let mut data = crate::params::lock_vars(varmap)?;
    for s in crate::param_specs(cfg).into_iter().filter(|s| spec.saved_param(&s.name)) {
        let local = s.slice_for(&full_of(&s)?, ctx)?;
        data.insert(s.name.clone(), candle_core::Var::from_tensor(&local.to_dtype(dtype)?.to_device(device)?)?);
    }
    Ok(())
}

/// The adapter tensors of a PEFT file (`tensors`, as [`load_peft_adapter`] gives them) by the
/// parameter names of model `cfg`: on gpt-oss, PEFT's wrappers of its expert parameters as the
/// model's factors ([`crate::expert_params`]); on another model they are as they were. Errors
/// name wrappers whose factors are not gpt-oss's.
pub fn model_adapters(cfg: &crate::LlamaConfig, tensors: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    // (GLM-4: q / k rows from its checkpoints' interleaved order, crate::config::glm4)
    if let Some(dr) = cfg.interleaved_rope() {
        return crate::config::glm4::permute_adapters(tensors, dr, false);
    }
    match (&cfg.moe, cfg.lora.as_ref().and_then(|l| l.expert_params)) {
        (Some(m), Some(layout)) => crate::expert_params::from_peft(tensors, m.num_experts, cfg.hidden_size, m.moe_intermediate_size, layout, m.module()),
        _ => Ok(tensors),
    }
}

/// Insert this rank's shard of each of `cfg`'s adapters into `varmap`, the full tensor from
/// `full_of` (checked against the spec, sliced for the rank, cast, moved).
pub(crate) fn insert_adapter_shards(
    varmap: &candle_nn::VarMap,
    cfg: &crate::LlamaConfig,
    ctx: &crate::ParallelCtx,
    dtype: candle_core::DType,
    device: &Device,
    full_of: impl Fn(&crate::ParamSpec) -> Result<Tensor>,
) -> Result<()> {
    let mut data = crate::params::lock_vars(varmap)?;
    for s in crate::param_specs(cfg).into_iter().filter(|s| s.is_lora()) {
        let local = s.slice_for(&full_of(&s)?, ctx)?;
        data.insert(s.name.clone(), candle_core::Var::from_tensor(&local.to_dtype(dtype)?.to_device(device)?)?);
    }
    Ok(())
}

#[path = "lora_read.rs"]
mod read;
pub use read::load_peft_adapter;

pub use crate::lora_merge::merge_adapter;

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
