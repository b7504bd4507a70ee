//! Hugging Face checkpoints: `config.json` + `model.safetensors` (or sharded
//! `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`).
//!
//! [`save_hf`] writes the same key names transformers uses (`lm_head.weight` omitted when
//! tied), header metadata `{"format": "pt"}`, tensors in the Vars' dtype (f32 / bf16 / f16),
//! each file written to a temporary name in the target directory and renamed into place, so
//! a crash never leaves a half-written `model.safetensors` or `config.json`.

use crate::config::LlamaConfig;
use crate::layout::ParallelCtx;
use crate::config::phi3::{fuse_checkpoint_tensors, fused_checkpoint_name, fused_parts, fused_rows};
use crate::params::{checkpoint_tensors, fused_checkpoint_tensor, param_specs, varmap_tensors, ParamSpec};
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_nn::VarMap;
use std::collections::HashMap;
use std::path::Path;

#[path = "hf_convert.rs"]
mod convert;
use convert::Converted;
pub use convert::converts_checkpoint;
#[path = "hf_write.rs"]
mod write;
pub(crate) use write::stream_safetensors;
pub use write::{safetensors_bytes, write_atomic};
use write::{write_atomic_with, write_safetensors};

fn io_err(what: &str, p: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what} {}: {e}", p.display()))
}

/// Every tensor of the checkpoint's safetensors file(s) in `dir`, on `device`.
pub fn load_safetensors_dir(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for path in safetensors_files(dir)? {
        out.extend(candle_core::safetensors::load(&path, device).map_err(|e| io_err("loading", &path, e))?);
    }
    Ok(out)
}

/// The checkpoint's safetensors file(s) in `dir`: `model.safetensors`, or the files named by
/// `model.safetensors.index.json`.
fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        bail!(
            "{}: neither model.safetensors nor model.safetensors.index.json found",
            dir.display()
        )
    }
    let text = std::fs::read_to_string(&index).map_err(|e| io_err("reading", &index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| io_err("parsing", &index, e))?;
    let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{}: no `weight_map` object", index.display())
    };
    let mut files: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
    files.sort();
    files.dedup();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

/// Where a checkpoint keeps the text model's tensors: under their own names (`model.*`,
/// `lm_head.weight`), or inside a multimodal Gemma 3 (`Gemma3ForConditionalGeneration`):
/// `language_model.model.*` (transformers before 4.52) or `model.language_model.*` (since),
/// beside a vision tower and projector that the text model does not read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TextPrefix {
    Plain,
    LanguageModel,
    ModelLanguageModel,
}

impl TextPrefix {
    /// The layout of a checkpoint with tensors `names` (a multimodal one's text model: Gemma 3's,
    /// Mistral 3's, [`crate::config::multimodal`]).
    fn detect<'a>(_cfg: &LlamaConfig, names: impl Iterator<Item = &'a str>) -> Self {
        for n in names {
            match n {
                "language_model.model.embed_tokens.weight" => return TextPrefix::LanguageModel,
                "model.language_model.embed_tokens.weight" => return TextPrefix::ModelLanguageModel,
                _ => {}
            }
        }
        TextPrefix::Plain
    }

    /// The checkpoint's name of the parameter `spec` (an HF causal-LM name).
    fn checkpoint_name(self, spec: &str) -> String {
        match self {
            TextPrefix::Plain => spec.to_string(),
            TextPrefix::LanguageModel => format!("language_model.{spec}"),
            TextPrefix::ModelLanguageModel => match spec.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => spec.to_string(),
            },
        }
    }

    /// The parameter name of checkpoint tensor `name`; `None` for the other towers of a
    /// multimodal checkpoint (vision tower, projector), which the text model does not read.
    fn param_name(self, name: &str) -> Option<String> {
        let other_tower = ["vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."];
        match self {
            TextPrefix::Plain => Some(name.to_string()),
            _ if other_tower.iter().any(|p| name.starts_with(p)) => None,
            TextPrefix::LanguageModel => Some(name.strip_prefix("language_model.").unwrap_or(name).to_string()),
            TextPrefix::ModelLanguageModel => Some(match name.strip_prefix("model.language_model.") {
                Some(rest) => format!("model.{rest}"),
                None => name.to_string(),
            }),
        }
    }
}

/// The full tensor of parameter `spec` from the checkpoint, whose tensor `name` `get(name)`
/// returns (`None`: absent): the tensor of that name, or a stacked expert tensor `[E, ·, ·]`
/// from transformers 5's fused tensor or else from its `E` experts' tensors
/// ([`fused_checkpoint_tensor`], [`checkpoint_tensors`]). Errors name a missing or mis-shaped
/// tensor.
fn param_from_checkpoint(
    dir: &Path,
    cfg: &LlamaConfig,
    spec: &ParamSpec,
    prefix: TextPrefix,
    cache: &mut Option<(String, Tensor)>,
    mut get: impl FnMut(&str) -> Result<Option<Tensor>>,
) -> Result<Tensor> {
    // gpt-oss: its experts' interleaved gate_up_proj, transposed down_proj (or MXFP4), biases;
    // GraniteMoE: its router's name, its experts' input_linear / output_linear
    if let Some(conv) = Converted::of(cfg) {
        let mut g = |n: &str| get(&prefix.checkpoint_name(n));
        if let Some(t) = conv.read_param(&spec.name, &spec.shape, &mut g, cache).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", dir.display())))? {
            return Ok(t);
        }
        let name = prefix.checkpoint_name(&spec.name);
        let Some(t) = get(&name)? else { bail!("{}: checkpoint has no tensor {name} (expected {:?})", dir.display(), spec.shape) };
        if t.dims() != spec.shape.as_slice() {
            bail!("{}: tensor {name} has shape {:?}, config implies {:?}", dir.display(), t.dims(), spec.shape)
        }
        return Ok(t);
    }
    // Phi-3: the rows of a fused qkv_proj / gate_up_proj
    if let Some((start, len, total)) = fused_rows(cfg, &spec.name).filter(|_| cfg.phi3) {
        let name = prefix.checkpoint_name(&fused_checkpoint_name(&spec.name).map(|f| f.0).unwrap_or_default());
        let want = [total, spec.shape.get(1).copied().unwrap_or(0)];
        let Some(t) = get(&name)? else {
            bail!("{}: checkpoint has no tensor {name} (expected {want:?}, holding {} {:?})", dir.display(), spec.name, spec.shape)
        };
        if t.dims() != want {
            bail!("{}: tensor {name} has shape {:?}, config implies {want:?}", dir.display(), t.dims())
        }
        return t.narrow(0, start, len)?.contiguous();
    }
    if let Some((name, rows)) = fused_checkpoint_tensor(spec) {
        let name = prefix.checkpoint_name(&name);
        if let Some(t) = get(&name)? {
            let mut want = spec.shape.clone();
            if rows.is_some() {
                want[1] *= 2;
            }
            if t.dims() != want.as_slice() {
                bail!("{}: tensor {name} has shape {:?}, config implies {want:?}", dir.display(), t.dims())
            }
            return match rows {
                Some((start, len)) => t.narrow(1, start, len)?.contiguous(),
                None => Ok(t),
            };
        }
    }
    let mut parts = Vec::new();
    for (name, expert) in checkpoint_tensors(spec) {
        let name = prefix.checkpoint_name(&name);
        let want = if expert.is_some() { &spec.shape[1..] } else { spec.shape.as_slice() };
        let Some(t) = get(&name)? else {
            bail!("{}: checkpoint has no tensor {name} (expected {want:?})", dir.display())
        };
        if t.dims() != want {
            bail!("{}: tensor {name} has shape {:?}, config implies {want:?}", dir.display(), t.dims())
        }
        if expert.is_none() {
            return Ok(t);
        }
        parts.push(t);
    }
    Tensor::stack(&parts, 0)
}

/// Refuse checkpoint tensors the model of `cfg` would not read (a bias of a config that
/// names none, Qwen3's q/k norms, ...): loading without them would run a different model,
/// silently. Not refused: `lm_head.weight` of a tied model (some exporters write it),
/// RoPE's `*.rotary_emb.inv_freq` buffers (computed from the config), and a multimodal Gemma
/// 3's vision tower and projector ([`TextPrefix`]).
fn refuse_unused<'a>(dir: &Path, cfg: &LlamaConfig, prefix: TextPrefix, names: impl Iterator<Item = &'a str>) -> Result<()> {
    let specs = param_specs(cfg);
    if let Some(conv) = Converted::of(cfg) {
        let used: std::collections::HashSet<String> = specs.iter().flat_map(|s| conv.checkpoint_names(&s.name)).collect();
        return refuse_names(dir, cfg, prefix, names, |p| used.contains(p));
    }
    let fused = specs.iter().filter_map(fused_checkpoint_tensor).map(|(n, _)| n);
    let used: std::collections::HashSet<String> = specs
        .iter()
        .flat_map(checkpoint_tensors)
        .map(|(n, _)| match fused_checkpoint_name(&n).filter(|_| cfg.phi3) {
            Some((f, _)) => f,
            None => n,
        })
        .chain(fused)
        .collect();
    refuse_names(dir, cfg, prefix, names, |p| used.contains(p))
}

/// [`refuse_unused`] with the checkpoint's parameter names `used` says the model reads.
fn refuse_names<'a>(dir: &Path, cfg: &LlamaConfig, prefix: TextPrefix, names: impl Iterator<Item = &'a str>, used: impl Fn(&str) -> bool) -> Result<()> {
    let mut unused: Vec<&str> = names
        .filter(|n| match prefix.param_name(n) {
            None => false,
            Some(p) => !(used(&p) || p.ends_with(".rotary_emb.inv_freq") || (cfg.tie_word_embeddings && p == "lm_head.weight") || crate::config::glm4_moe::is_next_token_layer(cfg, &p)),
        })
        .collect();
    if unused.is_empty() {
        return Ok(());
    }
    unused.sort();
    let n = unused.len();
    unused.truncate(4);
    bail!(
        "{}: checkpoint has {n} tensor(s) a {} model with this config.json does not use ({}{}): its config names another architecture or leaves out a feature (supported: {})",
        dir.display(),
        cfg.arch().hf_names().0,
        unused.join(", "),
        if n > 4 { ", ..." } else { "" },
        crate::Arch::SUPPORTED
    )
}

/// This rank's shards of a HF Llama checkpoint directory, read one tensor at a time from the
/// memory-mapped safetensors file(s): a `VarMap` of the rank's TP slices (as
/// [`crate::shard_params`] of [`load_hf`] would give) in `dtype` on `device`, and the config.
///
/// The whole model never exists in memory: at most one full tensor is read (on the host)
/// before it is sliced, then the slice goes to `device`. [`load_hf`] + `shard_params` instead
/// hold the full model on every rank, which a model of 70B parameters (140 GB in bf16) does
/// not survive on one GPU. The layout is checked against the config's heads first, so a bad
/// TP degree is refused before anything is read. Errors name missing, mis-shaped or unused tensors.
pub fn load_hf_sharded(dir: impl AsRef<Path>, ctx: &ParallelCtx, device: &Device, dtype: DType) -> Result<(VarMap, LlamaConfig)> {
    let dir = dir.as_ref();
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
    load_hf_sharded_as(dir, cfg, ctx, device, dtype, None)
}

/// [`load_hf_sharded`] of `dir` as the model of `cfg` (its `config.json`, or that with a
/// reward model's score head, [`crate::reward::load_hf_sharded_reward`]); with `new_score` a
/// score head the checkpoint lacks is drawn from that seed (and its LM head is not read).
pub(crate) fn load_hf_sharded_as(dir: &Path, cfg: LlamaConfig, ctx: &ParallelCtx, device: &Device, dtype: DType, new_score: Option<u64>) -> Result<(VarMap, LlamaConfig)> {
    ctx.layout.validate(cfg.num_attention_heads, cfg.num_key_value_heads)?;
    let files = safetensors_files(dir)?;
    // SAFETY: the files are mapped read-only for the length of this call; as with candle's
    // `VarBuilder::from_mmaped_safetensors`, they must not be truncated meanwhile.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
        .map_err(|e| io_err("mapping", dir, e))?;
    let names = st.tensors();
    let prefix = TextPrefix::detect(&cfg, names.iter().map(|(n, _)| n.as_str()));
    let new_score = new_score.filter(|_| !names.iter().any(|(n, _)| prefix.param_name(n).as_deref() == Some(crate::reward::SCORE)));
    match new_score {
        // (a causal LM read as a reward model: its head is not read)
        Some(_) => refuse_unused(dir, &cfg, prefix, names.iter().map(|(n, _)| n.as_str()).filter(|n| prefix.param_name(n).as_deref() != Some("lm_head.weight")))?,
        None => refuse_unused(dir, &cfg, prefix, names.iter().map(|(n, _)| n.as_str()))?,
    }
    // (a Phi-3's fused tensor is read once for its parts, which follow each other, and so is
    // transformers 5's experts' gate_up_proj; a gpt-oss's gate_up_proj, dequantized if MXFP4,
    // once for its gate and up: `whole`)
    let mut last: Option<(String, Tensor)> = None;
    let mut whole = None;
    let vm = crate::params::sharded_params(&cfg, ctx, dtype, device, |spec| {
        // (a token classifier's bias with it)
        if let (Some(seed), crate::reward::SCORE | crate::prm::SCORE_BIAS) = (new_score, spec.name.as_str()) {
            return crate::params::init_tensor(spec, seed, &cfg);
        }
        param_from_checkpoint(dir, &cfg, spec, prefix, &mut whole, |name| {
            if let Some((_, t)) = last.as_ref().filter(|(n, _)| n == name) {
                return Ok(Some(t.clone()));
            }
            let t = match st.get(name) {
                Err(_) => return Ok(None),
                Ok(_) => st.load(name, &Device::Cpu)?,
            };
            let parts = fused_parts(name.strip_suffix(".weight").unwrap_or(name)).is_some() && cfg.phi3;
            last = (parts || name.ends_with("mlp.experts.gate_up_proj")).then(|| (name.to_string(), t.clone()));
            Ok(Some(t))
        })
    })?;
    Ok((vm, cfg))
}

/// Load a HF Llama checkpoint directory: returns the FULL (unsharded) model as a `VarMap`
/// of Vars in `dtype` on `device` (shard it per rank with [`crate::shard_params`]) and its
/// config. Errors name missing or mis-shaped tensors, and tensors the model would not use
/// (a `lm_head.weight` of a tied model and RoPE's `inv_freq` buffers are ignored). A
/// multimodal Gemma 3 checkpoint gives its text model (the vision tower is not read).
pub fn load_hf(dir: impl AsRef<Path>, device: &Device, dtype: DType) -> Result<(VarMap, LlamaConfig)> {
    let dir = dir.as_ref();
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
    let tensors = load_safetensors_dir(dir, device)?;
    let prefix = TextPrefix::detect(&cfg, tensors.keys().map(|k| k.as_str()));
    refuse_unused(dir, &cfg, prefix, tensors.keys().map(|k| k.as_str()))?;
    let vm = VarMap::new();
    let mut whole = None;
    {
        let mut data = crate::params::lock_vars(&vm)?;
        for s in param_specs(&cfg) {
            let t = param_from_checkpoint(dir, &cfg, &s, prefix, &mut whole, |name| Ok(tensors.get(name).cloned()))?;
            data.insert(s.name.clone(), Var::from_tensor(&t.to_dtype(s.dtype_in(dtype))?)?);
        }
    }
    Ok((vm, cfg))
}

/// Save a FULL model (`VarMap` with every parameter of `cfg` at full shape, e.g. from
/// [`load_hf`], [`crate::init_params`], or gathered with [`crate::gather_full`]) as a HF
/// checkpoint directory: `model.safetensors` then `config.json`, each written atomically.
/// Creates `dir` if needed.
pub fn save_hf(dir: impl AsRef<Path>, varmap: &VarMap, cfg: &LlamaConfig) -> Result<()> {
    let tensors = varmap_tensors(varmap)?;
    let mut named = Vec::new();
    for s in param_specs(cfg) {
        let Some(t) = tensors.get(&s.name) else {
            bail!("save_hf: VarMap has no {} {:?}", s.name, s.shape)
        };
        if t.dims() != s.shape.as_slice() {
            bail!(
                "save_hf: {} has shape {:?}, full shape is {:?} (gather TP shards first)",
                s.name,
                t.dims(),
                s.shape
            )
        }
        // (gpt-oss, GraniteMoE: by the model's names, converted by save_hf_tensors)
        let parts = if converts_checkpoint(cfg) { vec![(s.name.clone(), None)] } else { checkpoint_tensors(&s) };
        for (name, expert) in parts {
            named.push((name, match expert {
                Some(e) => t.get(e)?,
                None => t.clone(),
            }));
        }
    }
    save_hf_tensors(dir, &named, cfg)
}

/// [`save_hf`] from a list of `(name, full tensor)` (a Phi-3's q, k, v and gate, up
/// projections written fused: [`crate::config::phi3`]; a gpt-oss's experts by the model's
/// names, written in its checkpoint layout: [`crate::config::gpt_oss`]; a GraniteMoE's
/// experts fused as [`crate::config::granite_moe`] says).
pub fn save_hf_tensors(dir: impl AsRef<Path>, tensors: &[(String, Tensor)], cfg: &LlamaConfig) -> Result<()> {
    let dir = dir.as_ref();
    let fused;
    let tensors = if let Some(conv) = Converted::of(cfg) {
        fused = conv.group(tensors.to_vec())?.into_iter().map(|(n, parts)| Ok((n.clone(), conv.combine(&n, &parts)?))).collect::<Result<Vec<_>>>()?;
        fused.as_slice()
    } else if cfg.phi3 {
        fused = fuse_checkpoint_tensors(true, tensors.to_vec())?
            .into_iter()
            .map(|(n, parts)| Ok((n, Tensor::cat(&parts, 0)?)))
            .collect::<Result<Vec<_>>>()?;
        fused.as_slice()
    } else {
        tensors
    };
    std::fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
    // streamed: the file's bytes are never all in memory at once
    let file = dir.join("model.safetensors");
    write_atomic_with(&file, |w| write_safetensors(w, tensors, &file))?;
    write_config(dir, cfg, tensors.first().map(|(_, t)| t.dtype()))
}

/// `config.json` of `cfg` in `dir` (atomically), its `torch_dtype` from the weights' dtype.
fn write_config(dir: &Path, cfg: &LlamaConfig, dtype: Option<DType>) -> Result<()> {
    let dname = match dtype {
        Some(DType::BF16) => "bfloat16",
        Some(DType::F16) => "float16",
        Some(DType::F64) => "float64",
        _ => "float32",
    };
    write_atomic(&dir.join("config.json"), cfg.to_hf_json(dname).as_bytes())
}

/// Save the model whose TP shards `local` (name → this rank's shard, as the `VarMap` holds
/// them) are spread over `ctx`'s TP groups as a HF checkpoint directory, like
/// [`save_hf_tensors`] of [`crate::gather_full`]'s tensors, byte for byte. Collective: every
/// rank calls it; only the rank with `write` writes.
///
/// Parameters are gathered one at a time and the writer streams each into the file as it
/// arrives (the header is known from the shapes), so no rank ever holds the whole model, on
/// the device or on the host. A write error on the writer does not desynchronise the
/// collectives: it keeps gathering, then returns the error.
pub fn save_hf_sharded(
    dir: impl AsRef<Path>,
    local: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
    write: bool,
) -> Result<()> {
    let dir = dir.as_ref();
    let specs = param_specs(cfg);
    let mut shards = Vec::with_capacity(specs.len());
    for s in &specs {
        let Some(t) = local.get(&s.name) else { bail!("save_hf_sharded: missing parameter {} {:?}", s.name, s.shape) };
        shards.push(t);
    }
    // the checkpoint's tensors by name: (name, its parts: (parameter, expert of a stacked
    // one)), a Phi-3's fused ones of several parameters stacked by rows
    let conv = Converted::of(cfg);
    let mut tensors = if let Some(conv) = conv {
        conv.group(specs.iter().enumerate().map(|(i, s)| (s.name.clone(), (i, None))).collect())?
    } else {
        let named = specs.iter().enumerate().flat_map(|(i, s)| checkpoint_tensors(s).into_iter().map(move |(n, e)| (n, (i, e))));
        fuse_checkpoint_tensors(cfg.phi3, named.collect())?
    };
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let part_shape = |&(i, e): &(usize, Option<usize>)| if e.is_some() { specs[i].shape[1..].to_vec() } else { specs[i].shape.clone() };
    let entries: Vec<(String, Vec<usize>, DType)> = tensors
        .iter()
        .map(|(n, parts)| {
            let shape = if let Some(conv) = conv {
                conv.combined_shape(n, &parts.iter().map(part_shape).collect::<Vec<_>>())
            } else {
                let mut shape = part_shape(&parts[0]);
                shape[0] = parts.iter().map(|p| part_shape(p)[0]).sum();
                shape
            };
            (n.clone(), shape, shards[parts[0].0].dtype())
        })
        .collect();
    // a stacked parameter is gathered once and kept until its last expert is written (its
    // experts' names interleave with the other projections' of the layer)
    let mut left: Vec<usize> = vec![0; specs.len()];
    for (i, _) in tensors.iter().flat_map(|(_, p)| p) {
        left[*i] += 1;
    }
    let mut held: HashMap<usize, Tensor> = HashMap::new();
    stream_safetensors(&dir.join("model.safetensors"), &entries, write, |k| {
        let mut out = Vec::with_capacity(tensors[k].1.len());
        for &(i, e) in &tensors[k].1 {
            let full = match held.remove(&i) {
                Some(t) => t,
                None => specs[i].gather(shards[i], ctx)?,
            };
            left[i] -= 1;
            out.push(match e {
                Some(e) => full.get(e)?,
                None => full.clone(),
            });
            if left[i] > 0 {
                held.insert(i, full);
            }
        }
        match (conv, out.as_slice()) {
            (Some(c), parts) => c.combine(&tensors[k].0, parts),
            (None, [one]) => Ok(one.clone()),
            (None, parts) => Tensor::cat(parts, 0),
        }
    })?;
    if !write {
        return Ok(());
    }
    write_config(dir, cfg, shards.first().map(|t| t.dtype()))
}

#[cfg(test)]
#[path = "hf_tests.rs"]
mod tests;
