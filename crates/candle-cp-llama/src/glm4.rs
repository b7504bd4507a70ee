//! Zhipu's GLM family ([`Glm`]): GLM (`model_type` `glm`, `GlmForCausalLM`: GLM-4-9B-chat-hf
//! and GLM-4-9B-hf, 2024) and GLM-4 (`model_type` `glm4`, `Glm4ForCausalLM`: GLM-4-9B-0414,
//! GLM-4-32B-0414 and the GLM-Z1 reasoning models). Both are a Llama with
//!
//! - (GLM-4 only) **norms before and after each branch**: `x + post_self_attn_layernorm(attn(input_layernorm(x)))`,
//!   `x + post_mlp_layernorm(mlp(post_attention_layernorm(x)))`, in a Llama's norm form (the
//!   layer of Gemma 3, whose names the model uses inside: see the table); GLM's layer is a
//!   Llama's (`input_layernorm`, `post_attention_layernorm` before the MLP);
//! - **q, k, v biases** (`attention_bias`, on by default; none on o_proj) and the MLP's gate and
//!   up projections stored fused (`mlp.gate_up_proj` `[2·I, h]`, the gate's rows first);
//! - **interleaved partial RoPE**: the first `R = head_dim · partial_rotary_factor` (0.5 by
//!   default) dimensions of each head rotate in pairs `(2i, 2i+1)` by frequency `i`, the rest
//!   pass through.
//!
//! The model rotates pairs `(i, i + R/2)` as every other architecture here (RoPE's "half" form)
//! and holds q_proj's and k_proj's rows permuted within each head so that the two agree: row
//! `i` of a head (`i < R/2`) is the checkpoint's row `2i`, row `R/2 + i` its row `2i + 1`, rows
//! `R..D` as they are. q and k are permuted alike, so every score `q·k` is the checkpoint's
//! model's; V and the output are untouched. The permutation is applied when a checkpoint or an
//! adapter is read and undone when one is written:
//!
//! | the model's parameter                        | the checkpoint tensor (GLM and GLM-4)                |
//! |----------------------------------------------|------------------------------------------------------|
//! | `self_attn.{q,k}_proj.{weight,bias}`         | the same, rows permuted within each head (above)     |
//! | `mlp.gate_proj.weight`, `mlp.up_proj.weight` | rows `0..I`, `I..2·I` of `mlp.gate_up_proj.weight`   |
//! | GLM-4's norms:                               |                                                      |
//! | `post_attention_layernorm.weight` (after the attention) | `post_self_attn_layernorm.weight`         |
//! | `pre_feedforward_layernorm.weight`           | `post_attention_layernorm.weight` (before the MLP)   |
//! | `post_feedforward_layernorm.weight`          | `post_mlp_layernorm.weight`                          |
//!
//! LoRA: the adapters' `lora_B` rows (and DoRA magnitudes) of q_proj and k_proj are permuted the
//! same way at the PEFT file boundary; PEFT's fused `gate_up_proj` target is refused by name
//! (name `down_proj` and the attention projections).

use super::{Arch, LlamaConfig};
use candle_core::{bail, Result, Tensor};
use serde_json::{json, Map, Value};

/// Which GLM ([`LlamaConfig::glm`]; the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glm {
    /// `GlmForCausalLM` (`model_type` `glm`): a Llama's layer with q, k, v biases, the fused
    /// MLP and the interleaved partial RoPE.
    Glm,
    /// `Glm4ForCausalLM` (`model_type` `glm4`): GLM's, with norms before and after each branch.
    Glm4,
}

impl Glm {
    /// The architecture it is.
    pub fn arch(self) -> Arch {
        match self {
            Glm::Glm => Arch::Glm,
            Glm::Glm4 => Arch::Glm4,
        }
    }

    /// Its name in errors.
    fn name(self) -> &'static str {
        match self {
            Glm::Glm => "GLM",
            Glm::Glm4 => "GLM-4",
        }
    }
}

/// [`LlamaConfig::features`]' name of GLM's and GLM-4's.
pub(crate) const GLM4: &str = "GLM's interleaved RoPE";

/// A `glm` or `glm4` config with `GlmConfig`'s / `Glm4Config`'s defaults where it leaves them
/// out (partial RoPE 0.5, q, k, v biases, `rms_norm_eps` 1.5625e-7); `None` for another
/// architecture.
pub(crate) fn with_defaults(m: &Map<String, Value>) -> Option<Map<String, Value>> {
    if !matches!(Arch::of_config(m).ok(), Some(Arch::Glm | Arch::Glm4)) {
        return None;
    }
    let mut t = m.clone();
    t.entry("partial_rotary_factor").or_insert(json!(0.5));
    t.entry("attention_bias").or_insert(json!(true));
    t.entry("rms_norm_eps").or_insert(json!(1.5625e-7));
    Some(t)
}

/// GLM's and GLM-4's keys of config.json.
pub(crate) fn write(m: &mut Map<String, Value>, cfg: &LlamaConfig) {
    for k in ["mlp_bias", "pretraining_tp", "use_sliding_window", "sliding_window"] {
        m.remove(k);
    }
    m.insert("partial_rotary_factor".into(), json!(cfg.partial_rotary_factor));
    m.insert("attention_bias".into(), json!(cfg.qkv_bias));
}

/// GLM or GLM-4 with its own features only (q, k, v biases or none; no head norms, window,
/// experts or other architecture's norms).
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    let Some(g) = cfg.glm else {
        return Ok(());
    };
    let who = g.name();
    let own = [GLM4, "q, k, v biases"];
    if let Some((what, _)) = cfg.features().into_iter().find(|(w, on)| *on && !own.contains(w)) {
        bail!("LlamaConfig: {who} with {what}: no architecture this model writes has both")
    }
    if let Some(w) = cfg.sliding_window {
        bail!("LlamaConfig: {who} with a sliding window ({w}): its config has none, so a saved checkpoint would load as another model")
    }
    // (its gate and up projections are one module to PEFT: adapters on them apart would be
    // no PEFT adapter of this model)
    if let Some(l) = &cfg.lora {
        let fused = l.targets.iter().any(|t| t == "gate_up_proj") && l.target_regex.is_none();
        let parts = (0..cfg.num_hidden_layers).any(|i| ["gate_proj", "up_proj"].iter().any(|p| l.adapts_weight(&format!("model.layers.{i}.mlp.{p}"))));
        if fused || parts {
            bail!("LlamaConfig: LoRA on {who}'s fused gate_up_proj (or its gate / up parts) is not supported: name down_proj and the attention projections")
        }
    }
    Ok(())
}

impl LlamaConfig {
    /// The same config as a GLM (`Some`: q, k, v biases, RoPE on half of each head,
    /// interleaved in its checkpoints; GLM-4: norms before and after each branch) or none.
    pub fn with_glm(mut self, glm: Option<Glm>) -> Self {
        self.glm = glm;
        if glm.is_some() {
            (self.qkv_bias, self.partial_rotary_factor) = (true, 0.5);
        }
        self
    }

    /// [`LlamaConfig::with_glm`] with GLM-4 (`on`) or none.
    pub fn with_glm4(self, on: bool) -> Self {
        self.with_glm(on.then_some(Glm::Glm4))
    }

    /// Whether it is GLM-4 (norms before and after each branch).
    pub fn is_glm4(&self) -> bool {
        self.glm == Some(Glm::Glm4)
    }

    /// Whether each branch has a norm before it and one after it (Gemma 2 and 3, GLM-4).
    pub fn pre_and_post_norms(&self) -> bool {
        self.is_gemma() || self.is_glm4()
    }

    /// A GLM's `(head_dim, R)`: the rows q_proj and k_proj hold per head and the rotated ones
    /// ([`LlamaConfig::rope_dim`]) whose checkpoint order is interleaved; `None` otherwise.
    pub fn interleaved_rope(&self) -> Option<(usize, usize)> {
        self.glm.map(|_| (self.head_dim, self.rope_dim()))
    }
}

/// The model's parameters (suffixes) and the checkpoint tensor each is (part of): (suffix,
/// checkpoint suffix, part); part 0 / 1 of `gate_up_proj` the gate / up rows. GLM's are the
/// first two, GLM-4's all.
const PARTS: [(&str, &str, usize); 5] = [
    ("mlp.gate_proj.weight", "mlp.gate_up_proj.weight", 0),
    ("mlp.up_proj.weight", "mlp.gate_up_proj.weight", 1),
    ("post_attention_layernorm.weight", "post_self_attn_layernorm.weight", 0),
    ("pre_feedforward_layernorm.weight", "post_attention_layernorm.weight", 0),
    ("post_feedforward_layernorm.weight", "post_mlp_layernorm.weight", 0),
];

/// The checkpoint tensor parameter `name` of a `glm` model is (part of), and which part;
/// `None` for a parameter held under its own name (q_proj and k_proj too: their rows are
/// permuted, see [`permutes_rows`]).
pub fn checkpoint_part(glm: Glm, name: &str) -> Option<(String, usize)> {
    let n = if glm == Glm::Glm4 { PARTS.len() } else { 2 };
    super::phi3::part_by_suffix(&PARTS[..n], name)
}

/// Whether tensor `name` (a parameter, an adapter's `lora_B` or DoRA magnitude) holds q_proj's
/// or k_proj's rows, which a GLM's checkpoints order interleaved.
pub fn permutes_rows(name: &str) -> bool {
    ["self_attn.q_proj.", "self_attn.k_proj."].iter().any(|p| {
        name.split_once(p).is_some_and(|(_, rest)| ["weight", "bias", "lora_B.weight", "lora_magnitude_vector"].contains(&rest))
    })
}

/// The rows of `t` (`[heads · d, ..]`) reordered within each head of `d`: to the checkpoint's
/// interleaved order (`to_checkpoint`) or from it (see the module doc; `r` rotated rows).
pub fn permute_rows(t: &Tensor, (d, r): (usize, usize), to_checkpoint: bool) -> Result<Tensor> {
    let n = t.dim(0)?;
    if d == 0 || !n.is_multiple_of(d) || r > d || !r.is_multiple_of(2) {
        bail!("GLM q/k rows: tensor {:?} is not in heads of {d} with {r} rotated rows", t.dims())
    }
    let half = r / 2;
    // the model's row j of a head from the checkpoint's row src(j), and back
    let from_ck = |j: usize| if j < half { 2 * j } else if j < r { 2 * (j - half) + 1 } else { j };
    let to_ck = |j: usize| if j < r { if j.is_multiple_of(2) { j / 2 } else { half + j / 2 } } else { j };
    let idx: Vec<u32> = (0..n).map(|i| ((i / d) * d + if to_checkpoint { to_ck(i % d) } else { from_ck(i % d) }) as u32).collect();
    t.index_select(&Tensor::from_vec(idx, n, t.device())?, 0)
}

/// Adapter tensors (by the model's names) with q_proj's and k_proj's `lora_B` rows and DoRA
/// magnitudes ([`permutes_rows`]) to the checkpoint's interleaved order (`to_checkpoint`) or
/// from it; the others as they are.
pub fn permute_adapters(tensors: std::collections::HashMap<String, Tensor>, dr: (usize, usize), to_checkpoint: bool) -> Result<std::collections::HashMap<String, Tensor>> {
    tensors.into_iter().map(|(n, t)| Ok((n.clone(), if permutes_rows(&n) { permute_rows(&t, dr, to_checkpoint)? } else { t }))).collect()
}

/// The checkpoint's tensors of the model's `tensors` (by the model's names): each
/// [`checkpoint_part`]'s parts grouped under its checkpoint name in part order, every other
/// tensor alone under its own.
pub fn group<T>(glm: Glm, tensors: Vec<(String, T)>) -> Result<Vec<(String, Vec<T>)>> {
    super::phi3::group_parts(tensors, |n| checkpoint_part(glm, n), |ck| if ck.ends_with("gate_up_proj.weight") { 2 } else { 1 })
}

/// Checkpoint tensor `ck` from the model's `parts` (full tensors, in part order): gate and up
/// stacked by rows, q / k rows to the interleaved order (`dr`: `(head_dim, R)`), any other as it is.
pub fn combine(ck: &str, parts: &[Tensor], dr: (usize, usize)) -> Result<Tensor> {
    match parts {
        [g, u] if ck.ends_with("gate_up_proj.weight") => Tensor::cat(&[g, u], 0),
        [x] if permutes_rows(ck) => permute_rows(x, dr, true),
        [x] => Ok(x.clone()),
        _ => bail!("GLM checkpoint tensor {ck}: {} parts", parts.len()),
    }
}

/// The shape [`combine`] gives from parts of shapes `parts`.
pub fn combined_shape(ck: &str, parts: &[Vec<usize>]) -> Vec<usize> {
    match parts {
        [g, _] if ck.ends_with("gate_up_proj.weight") && !g.is_empty() => [&[2 * g[0]], &g[1..]].concat(),
        [x, ..] => x.clone(),
        [] => vec![],
    }
}

/// Parameter `name` (full shape `shape`) of a `glm` model from its checkpoint (`get`, `None`:
/// absent): its rows of `gate_up_proj` (read once for both, kept in `cache`), a norm under its
/// checkpoint name, q / k rows from the interleaved order; `Ok(None)` for a parameter held as
/// it is under its own name. Errors name a missing or mis-shaped tensor.
pub fn read_param(glm: Glm, name: &str, shape: &[usize], dr: (usize, usize), get: &mut dyn FnMut(&str) -> Result<Option<Tensor>>, cache: &mut Option<(String, Tensor)>) -> Result<Option<Tensor>> {
    let who = glm.name();
    let (ck, part, permuted) = match checkpoint_part(glm, name) {
        Some((ck, part)) => (ck, part, false),
        None if permutes_rows(name) => (name.to_string(), 0, true),
        None => return Ok(None),
    };
    let fused = ck.ends_with("gate_up_proj.weight");
    let t = match cache.as_ref().filter(|(c, _)| *c == ck) {
        Some((_, t)) => t.clone(),
        None => match get(&ck)? {
            Some(t) => t,
            None => bail!("{who} checkpoint has no tensor {ck} (for {name} {shape:?})"),
        },
    };
    let mut want = shape.to_vec();
    if fused && !want.is_empty() {
        want[0] *= 2;
    }
    if t.dims() != want.as_slice() {
        bail!("{who} checkpoint tensor {ck} has shape {:?}, the config implies {want:?} (for {name} {shape:?})", t.dims())
    }
    Ok(Some(match (fused, permuted) {
        (true, _) => {
            *cache = Some((ck, t.clone()));
            t.narrow(0, part * shape[0], shape[0])?.contiguous()?
        }
        (false, true) => permute_rows(&t, dr, false)?,
        (false, false) => t,
    }))
}

#[cfg(test)]
#[path = "glm4_tests.rs"]
mod tests;
