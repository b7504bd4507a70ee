//! An adapter on a mixture's experts held as parameters (transformers 5's layout, PEFT's
//! `target_parameters`: [`crate::expert_params`]) as the same adapter on transformers 4's
//! per-expert modules, for a serving stack that reads only those (`candle-cp convert-lora`).
//!
//! ```text
//!   transformers 5 (PEFT target_parameters)        transformers 4 (PEFT target_modules)
//!   mlp.experts.gate_up_proj   A_e [r, h]    ──┬─▶  mlp.experts.{e}.gate_proj  A_e, B_e[:I]
//!                              B_e [2I, r]     └─▶  mlp.experts.{e}.up_proj    A_e, B_e[I:]
//!   mlp.experts.down_proj      A_e, B_e      ────▶  mlp.experts.{e}.down_proj  A_e, B_e
//!   mlp.gate.weight            A, B          ────▶  mlp.gate (a linear module)  A, B
//! ```
//!
//! Each expert's update is the same: `s·B_e[:I]·A_e` is gate's rows of `s·B_e·A_e`. Gate and up
//! get the shared `A`; where a part's `B` has columns that are zero for every expert (PEFT's
//! conversion of a transformers 4 adapter writes gate_up_proj at rank `2r` with a
//! block-diagonal `B`, [`crate::expert_params`]), those columns and their rows of `A` are left
//! out, the alpha scaled to keep `s` (`alpha' = s·r'`, rsLoRA's `s·√r'`): such an adapter comes
//! back at its own rank `r`. A Mixtral's experts are `block_sparse_moe.experts.{e}.w1` / `w3` /
//! `w2` there.
//!
//! The modules adapted are exactly those adapted before: the target modules gain `gate_proj`,
//! `up_proj`, `down_proj` (and the router `gate`) where that adapts nothing else (no dense layer
//! or shared expert the adapter left alone, the same `layers_to_transform`); otherwise
//! `target_modules` becomes one regular expression naming the adapted modules. Ranks and alphas
//! keep the adapter's `rank_pattern` / `alpha_pattern` where those give every module its rank
//! and alpha, else patterns naming each module that differs. gpt-oss's experts are parameters
//! in every transformers version: refused.

use crate::lora::LoraSpec;
use crate::LlamaConfig;
use candle_core::{bail, DType, Result, Tensor};
use std::collections::{BTreeMap, HashMap};

/// The adapter `adapters` (full tensors by the model's names, [`crate::lora::model_adapters`]'s)
/// of model `cfg`, whose spec holds its experts as parameters ([`LoraSpec::expert_params`]), as
/// the same adapter on per-expert modules: its spec (without expert parameters) and tensors by
/// the names of `cfg` with that spec. Errors: no LoRA spec, experts held as modules already,
/// gpt-oss, tensors that do not fit the spec.
pub fn per_expert_adapter(cfg: &LlamaConfig, adapters: &HashMap<String, Tensor>) -> Result<(LoraSpec, HashMap<String, Tensor>)> {
    let Some(old) = cfg.lora.as_ref() else { bail!("per_expert_adapter: the model has no LoRA spec") };
    if cfg.gpt_oss {
        bail!("per_expert_adapter: gpt-oss's experts are parameters in every transformers version (no per-expert modules to adapt)")
    }
    if old.expert_params.is_none() || cfg.moe.is_none() {
        bail!("per_expert_adapter: the adapter ({old}) holds no experts as parameters: it is in the per-expert layout already")
    }
    let base = cfg.clone().with_lora(None);
    // the weights LoRA may adapt, and the rank and alpha each has
    let stems: Vec<String> = crate::param_specs(&base)
        .into_iter()
        .filter(|s| (s.shape.len() == 3 && s.name.contains(".experts.")) || (s.shape.len() == 2 && s.name.ends_with(".weight")))
        .map(|s| s.name.strip_suffix(".weight").unwrap_or(&s.name).to_string())
        .collect();
    // (gate's and up's shared A given to each)
    let mut tensors = crate::expert_params::untie(adapters);
    let mut wanted: BTreeMap<String, (usize, f64)> = BTreeMap::new();
    for stem in stems.iter().filter(|s| old.adapts_weight(s)) {
        let c = old.config_for(stem);
        let r = compact(&mut tensors, stem)?.unwrap_or(c.rank);
        let alpha = if r == c.rank { c.alpha } else { c.scale() * if c.rslora { (r as f64).sqrt() } else { r as f64 } };
        wanted.insert(stem.clone(), (r, alpha));
    }
    let spec = per_expert_spec(old, &stems, &wanted)?;
    // (what the model with that spec holds: the same names and shapes)
    let new = base.with_lora(Some(spec.clone()));
    new.validate()?;
    let specs: Vec<crate::ParamSpec> = crate::param_specs(&new).into_iter().filter(|s| spec.trains(&s.name)).collect();
    for s in &specs {
        match tensors.get(&s.name) {
            Some(t) if t.dims() == s.shape.as_slice() => {}
            Some(t) => bail!("per_expert_adapter: {} is {:?}, the per-expert spec ({spec}) gives {:?}", s.name, t.dims(), s.shape),
            None => bail!("per_expert_adapter: the adapter has no {} {:?}", s.name, s.shape),
        }
    }
    if let Some(extra) = tensors.keys().find(|n| !specs.iter().any(|s| &&s.name == n)) {
        bail!("per_expert_adapter: the adapter's {extra} has no place under the per-expert spec ({spec})")
    }
    Ok((spec, tensors))
}

/// Leave out the columns of expert gate / up part `stem`'s `B` that are zero for every expert,
/// and their rows of its `A` (see the module doc); the rank left when columns went, `None`
/// when none did (or all would: an adapter not trained yet keeps its rank).
fn compact(tensors: &mut HashMap<String, Tensor>, stem: &str) -> Result<Option<usize>> {
    if !(stem.ends_with(".experts.gate_proj") || stem.ends_with(".experts.up_proj")) {
        return Ok(None);
    }
    let (a_name, b_name) = (format!("{stem}.lora_A.weight"), format!("{stem}.lora_B.weight"));
    let (Some(a), Some(b)) = (tensors.get(&a_name), tensors.get(&b_name)) else { return Ok(None) };
    // B [E, out, r]: each column's largest magnitude over experts and rows
    let col = b.to_dtype(DType::F32)?.abs()?.max(1)?.max(0)?.to_vec1::<f32>()?;
    let keep: Vec<u32> = (0..col.len() as u32).filter(|&j| col[j as usize] != 0.0).collect();
    if keep.is_empty() || keep.len() == col.len() {
        return Ok(None);
    }
    let idx = Tensor::new(keep.as_slice(), a.device())?;
    let (a, b) = (a.index_select(&idx, 1)?, b.index_select(&idx, 2)?);
    tensors.insert(a_name, a);
    tensors.insert(b_name, b);
    Ok(Some(keep.len()))
}

/// The per-expert spec adapting exactly `wanted`'s stems (of the candidate weights `stems`) with
/// their ranks and alphas, as close to `old` as that allows (see the module doc).
fn per_expert_spec(old: &LoraSpec, stems: &[String], wanted: &BTreeMap<String, (usize, f64)>) -> Result<LoraSpec> {
    let mut spec = old.clone().with_expert_params(None);
    spec.target_parameters.clear();
    // the experts' projections and the router as target modules
    let mut targets: Vec<&str> = spec.targets.iter().map(|t| t.as_str()).collect();
    for stem in wanted.keys() {
        let module = stem.rsplit('.').next().unwrap_or(stem);
        let router = crate::expert_params::router_param(stem).is_some();
        if (crate::expert_params::param_of(stem).is_some() || router) && !targets.contains(&module) {
            targets.push(module);
        }
    }
    if spec.target_regex.is_none() {
        let with = LoraSpec::new(old.config.rank, old.config.alpha, &targets)?;
        spec.targets = with.targets;
    }
    let adapted = |s: &LoraSpec| stems.iter().filter(|t| s.adapts_weight(t)).cloned().collect::<std::collections::BTreeSet<_>>();
    let want: std::collections::BTreeSet<String> = wanted.keys().cloned().collect();
    if adapted(&spec) != want {
        // one regular expression naming each adapted module (its layers grouped)
        let regex = grouped(wanted.keys().map(|s| (spec.module_name(s), ())).collect::<Vec<_>>()).into_iter().map(|(k, _)| k).collect::<Vec<_>>().join("|");
        spec = spec.with_layers(None).with_target_regex(Some(regex))?;
        if adapted(&spec) != want {
            bail!("per_expert_adapter: no target modules adapt exactly the adapter's {} modules (internal error)", wanted.len())
        }
    }
    let fits = |s: &LoraSpec| wanted.iter().all(|(stem, &(r, alpha))| s.config_for(stem).rank == r && s.config_for(stem).alpha == alpha);
    if !fits(&spec) {
        // a key for each module of another rank or alpha than the spec's
        let ranks = wanted.iter().filter(|(_, v)| v.0 != spec.config.rank).map(|(s, v)| (spec.module_name(s), v.0)).collect();
        let alphas = wanted.iter().filter(|(_, v)| v.1 != spec.config.alpha).map(|(s, v)| (spec.module_name(s), v.1.to_bits())).collect();
        let alphas = grouped(alphas).into_iter().map(|(k, a)| (k, f64::from_bits(a))).collect();
        spec = spec.with_rank_pattern(grouped(ranks))?.with_alpha_pattern(alphas)?;
        if !fits(&spec) {
            bail!("per_expert_adapter: no rank_pattern / alpha_pattern gives the adapter's modules their ranks (internal error)")
        }
    }
    // (keys that no longer decide a module's rank or alpha — the parameters' names they matched,
    // `.*\.gate_up_proj`, are gone — left out)
    for k in spec.rank_pattern.clone() {
        let mut without = spec.clone();
        without.rank_pattern.retain(|x| x.0 != k.0);
        if fits(&without) {
            spec = without;
        }
    }
    for k in spec.alpha_pattern.clone() {
        let mut without = spec.clone();
        without.alpha_pattern.retain(|x| x.0 != k.0);
        if fits(&without) {
            spec = without;
        }
    }
    Ok(spec)
}

/// Regular expressions naming modules `names` (PEFT's names: a stacked expert as expert 0's,
/// `….experts.0.gate_proj`, standing for every expert), grouped by value, then by layers, then by
/// the path before the module: `model\.layers\.1\.mlp\.experts\.\d+\.(?:gate_proj|up_proj)`,
/// `model\.layers\.(?:0|1)\.self_attn\.q_proj`.
fn grouped<V: Copy + Ord>(names: Vec<(String, V)>) -> Vec<(String, V)> {
    let escaped = |p: &str| regex::escape(p).replace(r"experts\.0\.", r"experts\.\d+\.");
    let alternatives = |mut xs: Vec<String>| match xs.len() {
        1 => xs.remove(0),
        _ => format!("(?:{})", xs.join("|")),
    };
    // (the path after the layer, the value) → the layers
    let mut by_path: BTreeMap<(String, V), Vec<usize>> = BTreeMap::new();
    let mut out = Vec::new();
    for (name, v) in names {
        let layered = name.strip_prefix("model.layers.").and_then(|t| t.split_once('.')).and_then(|(l, p)| Some((l.parse::<usize>().ok()?, p.to_string())));
        match layered {
            Some((l, path)) => by_path.entry((path, v)).or_default().push(l),
            None => out.push((escaped(&name), v)),
        }
    }
    // (the layers, the path before the module, the value) → the modules
    let mut by_layers: BTreeMap<(Vec<usize>, String, V), Vec<String>> = BTreeMap::new();
    for ((path, v), mut layers) in by_path {
        layers.sort_unstable();
        let (dir, module) = path.rsplit_once('.').unwrap_or(("", &path));
        by_layers.entry((layers, dir.to_string(), v)).or_default().push(module.to_string());
    }
    for ((layers, dir, v), modules) in by_layers {
        let layers = alternatives(layers.iter().map(|l| l.to_string()).collect());
        // (`mlp.experts.0` → `mlp\.experts\.\d+\.`)
        let dir = if dir.is_empty() { String::new() } else { escaped(&format!("{dir}.")) };
        out.push((format!(r"model\.layers\.{layers}\.{dir}{}", alternatives(modules.iter().map(|m| regex::escape(m)).collect())), v));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names grouped by module path and value, the experts standing for every expert.
    #[test]
    fn grouped_names() {
        let g = grouped(vec![
            ("model.layers.3.mlp.experts.0.gate_proj".to_string(), 2),
            ("model.layers.1.mlp.experts.0.gate_proj".to_string(), 2),
            ("model.layers.1.mlp.experts.0.up_proj".to_string(), 2),
            ("model.layers.3.mlp.experts.0.up_proj".to_string(), 2),
            ("model.layers.10.mlp.experts.0.gate_proj".to_string(), 4),
            ("model.layers.1.self_attn.q_proj".to_string(), 2),
            ("lm_head".to_string(), 2),
        ]);
        assert_eq!(
            g,
            vec![
                ("lm_head".to_string(), 2),
                (r"model\.layers\.1\.self_attn\.q_proj".to_string(), 2),
                (r"model\.layers\.(?:1|3)\.mlp\.experts\.\d+\.(?:gate_proj|up_proj)".to_string(), 2),
                (r"model\.layers\.10\.mlp\.experts\.\d+\.gate_proj".to_string(), 4),
            ]
        );
        let re = regex::Regex::new(&format!("^(?:{})$", g[2].0)).expect("compiles");
        assert!(re.is_match("model.layers.3.mlp.experts.17.up_proj") && !re.is_match("model.layers.13.mlp.experts.17.gate_proj"));
    }
}
