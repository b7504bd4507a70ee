//! Phi-3 (`model_type` `phi3`, `Phi3ForCausalLM`) and LongRoPE.
//!
//! A Phi-3 is a Llama (pre-norm RMSNorms, SwiGLU, RoPE by `rotate_half`, GQA, Mistral's
//! sliding window) whose checkpoints fuse projections:
//!
//! ```text
//!   self_attn.qkv_proj.weight  [(H + 2·Hkv)·D, h] = rows of q_proj [H·D] | k_proj [Hkv·D] | v_proj [Hkv·D]
//!   mlp.gate_up_proj.weight    [2·I, h]           = rows of gate_proj [I] | up_proj [I]
//! ```
//!
//! The model keeps them apart (so TP splits each by heads / columns as for any Llama):
//! [`crate::load_hf`] / [`crate::load_hf_sharded`] read the rows of each out of the fused
//! tensor, and every writer ([`crate::save_hf`], [`crate::save_hf_tensors`],
//! [`crate::save_hf_sharded`], `candle-cp merge-lora`) writes the fused tensors back
//! ([`fused_checkpoint_name`], [`fuse_checkpoint_tensors`]).
//!
//! LoRA on the fused modules is PEFT's: one adapter on `qkv_proj` (`A` `[r, h]`, `B`
//! `[(H + 2·Hkv)·D, r]`), `ΔW_qkv = s·B·A`. Its rows split as the weight's, so the model runs it
//! as three adapters sharing one `A` (`….qkv_proj.lora_A.weight`, replicated over TP as a
//! column layer's `A`, its gradient the sum of the three layers') with `B`'s rows of q, k and v
//! (`….q_proj.lora_B.weight`, ...; split over TP as their weights), and one dropout mask for the
//! three (PEFT drops the module's input once); DoRA's magnitude, one per output row, splits
//! the same way. The adapter files hold PEFT's fused names ([`split_fused_adapters`] on load);
//! [`crate::lora::merge_adapter`] merges on the stacked weight. A target list naming some of a
//! fused module's parts without the others is refused ([`crate::lora::LoraSpec::with_fused`]
//! names the fused module for all of them).
//!
//! Phi-3's long-context models (`Phi-3-mini-128k`, `Phi-3.5-mini`) scale RoPE by LongRoPE
//! ([`RopeScaling::LongRope`]): per-frequency divisors, `short_factor` for a sequence of at
//! most `original_max_position_embeddings` tokens, `long_factor` beyond, and cos / sin
//! multiplied by `sqrt(1 + ln(factor) / ln(original))`. Which factors apply depends on the
//! sequence's length (transformers: its largest position id + 1), which a context-parallel
//! rank cannot see from its own shard — rank 0 of a contiguous ring holds only the first
//! `T/P` positions. [`crate::Llama`] takes it over the whole CP group, so every rank rotates
//! with the factors the single device uses; per row, so a packed row's (its longest
//! document's) does not depend on the rows beside it, nor on how DP splits the batch.
//!
//! Phi-4-mini (`Phi3ForCausalLM` too) rotates only part of each head:
//! `partial_rotary_factor` 0.75 ([`LlamaConfig::partial_rotary_factor`]): RoPE in the
//! `rotate_half` form over the first [`LlamaConfig::rope_dim`] = `int(head_dim · factor)`
//! dimensions (frequencies `theta^(-2i / rope_dim)`, LongRoPE's factors one per pair of those),
//! the others passed through, as transformers' Phi-3 does.
//!
//! Refused by name (each would be arithmetic the model does not do): `partial_rotary_factor`
//! other than 1 on the other architectures, and Phi-3's dropouts (`resid_pdrop`, `embd_pdrop`,
//! `attention_dropout`) above 0.

use super::{get_f64, get_usize, Arch, LlamaConfig, RopeScaling};
use candle_core::{bail, Result};
use serde_json::{json, Map, Value};

/// LongRoPE's default attention factor: `sqrt(1 + ln(factor) / ln(original))`, 1 for a
/// factor <= 1 (HF `_compute_longrope_parameters`).
pub fn longrope_attention_factor(factor: f64, original_max_position_embeddings: usize) -> f64 {
    if factor <= 1.0 || original_max_position_embeddings <= 1 {
        1.0
    } else {
        (1.0 + factor.ln() / (original_max_position_embeddings as f64).ln()).sqrt()
    }
}

/// A LongRoPE scaling object (`type` / `rope_type` `longrope` or `su`): `short_factor`,
/// `long_factor`, the original length (the object's, else `orig` — the config's top-level
/// key —, else `max_pos`), `factor` (else `max_pos / original`), `attention_factor`.
pub(crate) fn parse_longrope(obj: &Map<String, Value>, max_pos: usize, orig: Option<usize>) -> Result<RopeScaling> {
    let list = |k: &str| -> Result<Vec<f64>> {
        match obj.get(k) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_f64().ok_or_else(|| candle_core::Error::Msg(format!("config.json: longrope `{k}` must hold numbers, got {v}"))))
                .collect(),
            _ => bail!("config.json: longrope rope scaling needs `{k}` (a list of numbers, one per rotated frequency)"),
        }
    };
    let original = get_usize(obj, "original_max_position_embeddings")?.or(orig).unwrap_or(max_pos);
    if original == 0 {
        bail!("config.json: longrope needs original_max_position_embeddings > 0")
    }
    Ok(RopeScaling::LongRope {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: original,
        factor: get_f64(obj, "factor")?.unwrap_or(max_pos as f64 / original as f64),
        attention_factor: get_f64(obj, "attention_factor")?,
    })
}

/// Check a [`RopeScaling::LongRope`]: one short and one long factor per frequency (`D/2`
/// of a head of `head_dim`), every one finite and > 0; an original length > 0; a finite
/// factor > 0; an attention factor (if set) finite and > 0.
pub(crate) fn validate_longrope(s: &RopeScaling, rope_dim: usize) -> Result<()> {
    let RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, factor, attention_factor } = s else {
        return Ok(());
    };
    let ok = |x: f64| x.is_finite() && x > 0.0;
    for (what, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
        if f.len() != rope_dim / 2 {
            bail!("LlamaConfig: longrope {what} has {} entries, RoPE over {rope_dim} dimensions of a head rotates {} frequencies", f.len(), rope_dim / 2)
        }
        if let Some((i, x)) = f.iter().enumerate().find(|(_, &x)| !ok(x)) {
            bail!("LlamaConfig: longrope {what}[{i}] = {x} must be finite and > 0")
        }
    }
    if *original_max_position_embeddings == 0 || !ok(*factor) || attention_factor.is_some_and(|a| !ok(a)) {
        bail!(
            "LlamaConfig: longrope needs original_max_position_embeddings > 0 ({original_max_position_embeddings}), a finite factor > 0 ({factor}) and an attention_factor > 0 ({attention_factor:?})"
        )
    }
    Ok(())
}

/// The scaling keys of a [`RopeScaling::LongRope`] into `rope` (a `rope_parameters` object):
/// `factor` only when it is not `max_pos / original` (the value a reader derives).
pub(crate) fn write_longrope(rope: &mut Map<String, Value>, s: &RopeScaling, max_pos: usize) {
    let RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, factor, attention_factor } = s else {
        return;
    };
    rope.insert("rope_type".into(), json!("longrope"));
    rope.insert("short_factor".into(), json!(short_factor));
    rope.insert("long_factor".into(), json!(long_factor));
    rope.insert("original_max_position_embeddings".into(), json!(original_max_position_embeddings));
    let derived = max_pos as f64 / *original_max_position_embeddings as f64;
    if (factor - derived).abs() > 1e-12 * factor.abs() {
        rope.insert("factor".into(), json!(factor));
    }
    if let Some(a) = attention_factor {
        rope.insert("attention_factor".into(), json!(a));
    }
}

/// The config's `partial_rotary_factor` (at the top level or in `rope_parameters`; 1 when
/// absent): a Phi-3's (Phi-4-mini: 0.75); another architecture's must be 1 (refused by name:
/// their partial RoPE is not this one).
pub(crate) fn partial_rotary_factor(m: &Map<String, Value>, arch: Arch) -> Result<f64> {
    let in_rope = match m.get("rope_parameters") {
        Some(Value::Object(p)) => get_f64(p, "partial_rotary_factor")?,
        _ => None,
    };
    let f = get_f64(m, "partial_rotary_factor")?.or(in_rope).unwrap_or(1.0);
    if f != 1.0 && !matches!(arch, Arch::Phi3 | Arch::Glm | Arch::Glm4 | Arch::Glm4Moe) {
        bail!("config.json: partial_rotary_factor {f} not supported on a {} model (RoPE rotates every dimension of its heads here; only Phi-3's, GLM's and GLM-4.5's partial RoPE are)", arch.hf_names().0)
    }
    Ok(f)
}

/// [`LlamaConfig::partial_rotary_factor`]'s invariants: in (0, 1], rotating an even number of
/// a head's dimensions, at least 2.
pub(crate) fn validate_partial_rotary(cfg: &LlamaConfig) -> Result<()> {
    let (f, r) = (cfg.partial_rotary_factor, cfg.rope_dim());
    if !(f > 0.0 && f <= 1.0) || r < 2 || r % 2 != 0 {
        bail!("LlamaConfig: partial_rotary_factor {f} must be in (0, 1] and rotate an even number (>= 2) of a head's {} dimensions, got {r}", cfg.head_dim)
    }
    if f != 1.0 && !cfg.phi3 && cfg.glm.is_none() && cfg.arch() != Arch::Glm4Moe {
        bail!("LlamaConfig: partial_rotary_factor {f} on a {} model (only a Phi-3's, GLM's or GLM-4.5's RoPE is partial here)", cfg.arch().hf_names().0)
    }
    Ok(())
}

/// Refuse what no architecture here computes: Phi-3's dropouts above 0 (training would run
/// without them).
pub(crate) fn refuse_unsupported(m: &Map<String, Value>, arch: Arch) -> Result<()> {
    if arch == Arch::Phi3 {
        for k in ["resid_pdrop", "embd_pdrop", "attention_dropout"] {
            if let Some(p) = get_f64(m, k)?.filter(|&p| p != 0.0) {
                bail!("config.json: `{k}` {p} not supported (training runs without that dropout: set it to 0.0)")
            }
        }
    }
    Ok(())
}

/// A Phi-3 `config.json`'s keys beside a Llama's (`m` is [`LlamaConfig::to_hf_json`]'s
/// object): the top-level `original_max_position_embeddings` and dropouts of 0; a LongRoPE
/// written as Phi-3's released configs hold it — `rope_scaling` `{type, short_factor,
/// long_factor}` (transformers 4's `Phi3Config` accepts exactly these keys), no
/// `rope_parameters`.
pub(crate) fn write(m: &mut Map<String, Value>, cfg: &LlamaConfig) {
    let original = match &cfg.rope_scaling {
        RopeScaling::LongRope { original_max_position_embeddings, .. } => *original_max_position_embeddings,
        _ => cfg.max_position_embeddings,
    };
    m.insert("original_max_position_embeddings".into(), json!(original));
    m.insert("resid_pdrop".into(), json!(0.0));
    m.insert("embd_pdrop".into(), json!(0.0));
    m.remove("mlp_bias");
    m.remove("pretraining_tp");
    if cfg.partial_rotary_factor != 1.0 {
        m.insert("partial_rotary_factor".into(), json!(cfg.partial_rotary_factor));
    }
    if let RopeScaling::LongRope { .. } = cfg.rope_scaling {
        let mut rope = Map::new();
        write_longrope(&mut rope, &cfg.rope_scaling, cfg.max_position_embeddings);
        rope.remove("rope_type");
        rope.remove("original_max_position_embeddings");
        rope.insert("type".into(), json!("longrope"));
        m.insert("rope_scaling".into(), Value::Object(rope));
        m.remove("rope_parameters");
    }
}

/// The modules of a Phi-3's fused ones: (part, fused module, part index).
const PARTS: [(&str, &str, usize); 5] = [
    ("self_attn.q_proj", "self_attn.qkv_proj", 0),
    ("self_attn.k_proj", "self_attn.qkv_proj", 1),
    ("self_attn.v_proj", "self_attn.qkv_proj", 2),
    ("mlp.gate_proj", "mlp.gate_up_proj", 0),
    ("mlp.up_proj", "mlp.gate_up_proj", 1),
];

/// What a fused tensor holds of each part by rows: the weight, LoRA's `B`, DoRA's magnitude
/// (one `A` serves every part: it is the fused module's own, `….qkv_proj.lora_A.weight`).
const ROW_SUFFIXES: [&str; 3] = [".weight", ".lora_B.weight", ".lora_magnitude_vector"];

/// The fused tensor holding tensor `name` of a Phi-3 and the part it is:
/// `….self_attn.{q,k,v}_proj.weight` → (`….self_attn.qkv_proj.weight`, 0 / 1 / 2),
/// `….mlp.{gate,up}_proj.weight` → (`….mlp.gate_up_proj.weight`, 0 / 1); the same for their
/// adapters' `lora_B.weight` and `lora_magnitude_vector` (rows of the fused module's); `None`
/// for a tensor held under its own name.
pub fn fused_checkpoint_name(name: &str) -> Option<(String, usize)> {
    PARTS.iter().find_map(|(own, fused, part)| {
        ROW_SUFFIXES.iter().find_map(|suffix| {
            let prefix = name.strip_suffix(&format!("{own}{suffix}")).filter(|p| p.starts_with("model.layers.") && p.ends_with('.'))?;
            Some((format!("{prefix}{fused}{suffix}"), *part))
        })
    })
}

/// The fused module of a Phi-3's weight stem `stem` (`….self_attn.k_proj` →
/// (`….self_attn.qkv_proj`, 1)) and the part it is; `None` for a module of its own.
pub fn fused_module(stem: &str) -> Option<(String, usize)> {
    let (fused, part) = fused_checkpoint_name(&format!("{stem}.weight"))?;
    Some((fused.strip_suffix(".weight").unwrap_or(&fused).to_string(), part))
}

/// The part stems of fused module stem `stem` (`….self_attn.qkv_proj` → its q, k, v
/// projections' stems; `….mlp.gate_up_proj` → gate, up), in row order; `None` for another.
pub fn fused_parts(stem: &str) -> Option<Vec<String>> {
    let prefix = ["self_attn.qkv_proj", "mlp.gate_up_proj"].iter().find_map(|f| stem.strip_suffix(f).map(|p| (p, *f)))?;
    Some(PARTS.iter().filter(|(_, f, _)| *f == prefix.1).map(|(own, _, _)| format!("{}{own}", prefix.0)).collect())
}

/// Tensor `name`'s rows in its fused tensor (see [`fused_checkpoint_name`]): `(start, len,
/// total)` along dim 0 — q `H·D`, k and v `Hkv·D` each; gate and up `I` each.
pub fn fused_rows(cfg: &LlamaConfig, name: &str) -> Option<(usize, usize, usize)> {
    let (fused, part) = fused_checkpoint_name(name)?;
    let (q, kv, i) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size);
    let sizes: &[usize] = if fused.contains(".qkv_proj.") { &[q, kv, kv] } else { &[i, i] };
    Some((sizes[..part].iter().sum(), sizes[part], sizes.iter().sum()))
}

/// Group a model's tensors `(name, x)` (in the model's names) into those a checkpoint or a
/// PEFT adapter holds: with `fused` (a Phi-3) the fused ones, named by
/// [`fused_checkpoint_name`], their parts in row order; every other tensor alone, in the
/// order given (a fused one where its first part was). Errors name a fused tensor some of
/// whose parts are missing.
pub fn fuse_checkpoint_tensors<T>(fused: bool, tensors: Vec<(String, T)>) -> Result<Vec<(String, Vec<T>)>> {
    let parts = |name: &str| if name.contains(".qkv_proj.") { 3 } else { 2 };
    group_parts(tensors, |name| fused_checkpoint_name(name).filter(|_| fused), parts)
}

/// The checkpoint tensor that parameter `name` is (part of) by a table of `(parameter suffix,
/// checkpoint suffix, part)` rows (gpt-oss's, GraniteMoE's, GLM-4's): the first row whose
/// suffix ends `name`, its prefix kept; `None` for a parameter held under its own name.
pub(crate) fn part_by_suffix(table: &[(&str, &str, usize)], name: &str) -> Option<(String, usize)> {
    table.iter().find_map(|(suffix, ck, part)| name.strip_suffix(suffix).map(|prefix| (format!("{prefix}{ck}"), *part)))
}

/// Group tensors `(name, x)` by the checkpoint tensor each is part of: `part_of(name)` is
/// `Some((checkpoint name, part))` for a part (`parts(checkpoint name)` of them, in part order)
/// and `None` for a tensor held alone under its own name; groups in the order given (a group
/// where its first part was). Errors name a group missing a part. Phi-3's fused projections
/// ([`fuse_checkpoint_tensors`]) and gpt-oss's interleaved experts
/// ([`super::gpt_oss::group`]).
pub(crate) fn group_parts<T>(tensors: Vec<(String, T)>, part_of: impl Fn(&str) -> Option<(String, usize)>, parts: impl Fn(&str) -> usize) -> Result<Vec<(String, Vec<T>)>> {
    let mut out: Vec<(String, Vec<(usize, T)>)> = Vec::with_capacity(tensors.len());
    let mut at: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (name, x) in tensors {
        match part_of(&name) {
            Some((f, part)) => match at.get(&f) {
                Some(&i) => out[i].1.push((part, x)),
                None => {
                    at.insert(f.clone(), out.len());
                    out.push((f, vec![(part, x)]));
                }
            },
            None => out.push((name, vec![(0, x)])),
        }
    }
    out.into_iter()
        .map(|(name, mut parts_of)| {
            parts_of.sort_by_key(|(p, _)| *p);
            let want = if at.contains_key(&name) { parts(&name) } else { 1 };
            if parts_of.len() != want || parts_of.iter().enumerate().any(|(i, (p, _))| *p != i) {
                bail!("checkpoint tensor {name}: {} of its {want} parts given", parts_of.len())
            }
            Ok((name, parts_of.into_iter().map(|(_, x)| x).collect()))
        })
        .collect()
}

/// A Phi-3 adapter's tensors by the model's names: each fused `lora_B` / DoRA magnitude
/// (`….qkv_proj.lora_B.weight`, `….gate_up_proj.lora_magnitude_vector`, as PEFT writes them)
/// split by rows into its parts' (`….q_proj.lora_B.weight`, ...); the rest as given. Errors
/// name a fused tensor whose rows are not its parts'.
pub fn split_fused_adapters(cfg: &LlamaConfig, tensors: &std::collections::HashMap<String, candle_core::Tensor>) -> Result<std::collections::HashMap<String, candle_core::Tensor>> {
    let mut out = std::collections::HashMap::new();
    for (name, t) in tensors {
        let parts = [".lora_B.weight", ".lora_magnitude_vector"].iter().find_map(|suffix| Some((fused_parts(name.strip_suffix(suffix)?)?, *suffix)));
        let Some((parts, suffix)) = parts.filter(|_| cfg.phi3) else {
            out.insert(name.clone(), t.clone());
            continue;
        };
        for p in parts {
            let part = format!("{p}{suffix}");
            let Some((start, len, total)) = fused_rows(cfg, &part) else { bail!("Phi-3 adapter: no rows for {part}") };
            if t.dims().first() != Some(&total) {
                bail!("Phi-3 adapter: {name} {:?} does not hold the {total} rows of its parts", t.dims())
            }
            out.insert(part, t.narrow(0, start, len)?.contiguous()?);
        }
    }
    Ok(out)
}

/// A Phi-3 config's invariants: none of the other architectures' features (q, k, v biases,
/// head norms, Gemma's, experts, a window on some layers only: its config.json could not
/// say them); a LoRA spec of its fused modules ([`crate::lora::LoraSpec::fused`]) that names
/// no part of one alone (q, k, v, gate, up: some of a fused module's parts without the others).
pub(crate) fn validate(cfg: &LlamaConfig) -> Result<()> {
    if !cfg.phi3 {
        return Ok(());
    }
    if cfg.qkv_bias || cfg.qk_norm || cfg.gemma2.is_some() || cfg.gemma3.is_some() || cfg.moe.is_some() || cfg.sliding_layers.is_some() {
        bail!("LlamaConfig: a Phi-3 has no q, k, v biases, head norms, Gemma norms, experts or per-layer windows")
    }
    let Some(l) = cfg.lora.as_ref() else { return Ok(()) };
    if !l.fused {
        bail!("LlamaConfig: a Phi-3's LoRA spec must name its fused modules (set it with LlamaConfig::with_lora)")
    }
    if l.target_regex.is_none() {
        let last = |m: &str| m.rsplit('.').next().unwrap_or(m).to_string();
        if let Some((t, fused)) = l.targets.iter().find_map(|t| PARTS.iter().find(|(own, _, _)| last(own) == *t).map(|(_, f, _)| (t, last(f)))) {
            bail!("LlamaConfig: LoRA target {t} of a Phi-3, whose checkpoint fuses it into {fused} (PEFT adapts the fused module: name all of its parts, or {fused})")
        }
    }
    Ok(())
}

/// A LoRA target only a Phi-3 has ([`crate::lora::FUSED_TARGETS`]) on another model: refused.
pub(crate) fn refuse_fused_targets(cfg: &LlamaConfig) -> Result<()> {
    let Some(l) = cfg.lora.as_ref().filter(|l| !cfg.phi3 && l.target_regex.is_none()) else { return Ok(()) };
    if let Some(t) = l.targets.iter().find(|t| crate::lora::FUSED_TARGETS.contains(&t.as_str())) {
        bail!("LlamaConfig: LoRA target {t} is a Phi-3's fused module; a {} model has q_proj, k_proj, v_proj / gate_proj, up_proj", cfg.arch().hf_names().0)
    }
    Ok(())
}

#[cfg(test)]
#[path = "phi3_tests.rs"]
mod tests;
