//! Reading a PEFT adapter directory ([`load_peft_adapter`]): its tensors and the
//! `adapter_config.json` keys a [`LoraSpec`] takes, the others refused by name.

use super::*;

/// The adapters of a PEFT adapter directory (`adapter_model.safetensors`), by parameter name
/// (the `base_model.model.` prefix removed), on the host; and its rank, alpha and targets
/// from `adapter_config.json`.
pub fn load_peft_adapter(dir: &Path) -> Result<(LoraSpec, HashMap<String, Tensor>)> {
    let cfg_path = dir.join("adapter_config.json");
    let v = read_adapter_config(dir)?;
    let rank = v.get("r").and_then(|x| x.as_u64()).ok_or_else(|| candle_core::Error::Msg(format!("{}: no rank 'r'", cfg_path.display())))? as usize;
    let alpha = v.get("lora_alpha").and_then(|x| x.as_f64()).unwrap_or(rank as f64);
    let params: Vec<String> = match v.get("target_parameters") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(a)) => a.iter().map(|x| x.as_str().map(String::from).ok_or_else(|| candle_core::Error::Msg(format!("{}: 'target_parameters' holds {x}, not a parameter name", cfg_path.display())))).collect::<Result<_>>()?,
        Some(other) => bail!("{}: 'target_parameters' must be a list of parameter names, got {other}", cfg_path.display()),
    };
    let (targets, regex): (Vec<String>, Option<String>) = match v.get("target_modules") {
        // the expert parameters alone (PEFT allows no target_modules beside target_parameters)
        None | Some(serde_json::Value::Null) if !params.is_empty() => (Vec::new(), None),
        Some(serde_json::Value::Array(a)) => (a.iter().filter_map(|x| x.as_str().map(String::from)).collect(), None),
        // PEFT's shorthand for every linear layer but the output head
        Some(serde_json::Value::String(s)) if s == "all-linear" => (ALL_LINEAR.iter().map(|t| t.to_string()).collect(), None),
        // one regular expression over the modules' whole names
        Some(serde_json::Value::String(s)) => (ALL_LINEAR.iter().map(|t| t.to_string()).collect(), Some(s.clone())),
        _ => bail!("{}: 'target_modules' must be a list of module names, \"all-linear\" or a regular expression", cfg_path.display()),
    };
    refuse_unsupported(&v, &cfg_path)?;
    let rslora = v.get("use_rslora").and_then(|x| x.as_bool()).unwrap_or(false);
    let dora = v.get("use_dora").and_then(|x| x.as_bool()).unwrap_or(false);
    let saved: Vec<String> = match v.get("modules_to_save") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_str().map(String::from)).collect(),
        Some(other) => bail!("{}: 'modules_to_save' must be a list of module names, got {other}", cfg_path.display()),
    };
    // (PEFT's sequence- and token-classification tasks name their heads `classifier` and `score`
    // whatever the model has: a Llama's is `score`, and it is always trained whole)
    let saved: Vec<String> = match v.get("task_type").and_then(|t| t.as_str()) {
        Some("SEQ_CLS" | "TOKEN_CLS") => saved.into_iter().filter(|m| m != "classifier").chain(std::iter::once("score".to_string())).collect(),
        _ => saved,
    };
    let dropout = v.get("lora_dropout").and_then(|x| x.as_f64()).unwrap_or(0.0);
    // (Mixtral's expert modules w1, w3, w2 are our gate_proj, up_proj, down_proj)
    let targets: Vec<&str> = targets.iter().map(|s| crate::moe_lora::target_from_peft(s)).collect();
    let spec = match targets.is_empty() {
        true => LoraSpec::on_parameters(rank, alpha, &params.iter().map(|s| s.as_str()).collect::<Vec<_>>()),
        false => LoraSpec::new(rank, alpha, &targets).and_then(|s| s.with_target_parameters(&params.iter().map(|s| s.as_str()).collect::<Vec<_>>())),
    }
    .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", cfg_path.display())))?
        .with_rslora(rslora)
        .with_dropout(dropout)?
        .with_dora(dora)
        .with_modules_to_save(&saved.iter().map(|s| s.as_str()).collect::<Vec<_>>())
        .and_then(|s| s.with_rank_pattern(pattern(&v, "rank_pattern", |x| x.as_u64().map(|r| r as usize))?))
        .and_then(|s| s.with_alpha_pattern(pattern(&v, "alpha_pattern", |x| x.as_f64())?))
        .and_then(|s| s.with_target_regex(regex))
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", cfg_path.display())))?
        .with_layers(layers_to_transform(&v, &cfg_path)?);
    let file = dir.join("adapter_model.safetensors");
    let tensors = candle_core::safetensors::load(&file, &Device::Cpu)?
        .into_iter()
        .map(|(n, t)| (n.strip_prefix(PEFT_PREFIX).map(String::from).unwrap_or(n), t))
        .collect();
    // a sparse layer's per-expert factors stacked as the model holds them
    Ok((spec, crate::moe_lora::stack_expert_adapters(tensors)?))
}

/// The `key → value` object `key` of an adapter config (absent, null or empty: none); errors
/// name a value `get` does not read.
fn pattern<T>(v: &serde_json::Value, key: &str, get: impl Fn(&serde_json::Value) -> Option<T>) -> Result<Vec<(String, T)>> {
    match v.get(key) {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Object(o)) => o.iter().map(|(k, x)| get(x).map(|x| (k.clone(), x)).ok_or_else(|| candle_core::Error::Msg(format!("'{key}': '{k}' has the value {x}")))).collect(),
        Some(other) => bail!("'{key}' must be an object of module-name keys, got {other}"),
    }
}

/// PEFT's `layers_to_transform` (an index or a list; absent or null: every layer) over the
/// decoder layers `model.layers.{i}` (`layers_pattern` absent, null, or `layers`).
fn layers_to_transform(v: &serde_json::Value, path: &Path) -> Result<Option<Vec<usize>>> {
    match v.get("layers_pattern") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(s)) if s == "layers" => {}
        Some(serde_json::Value::Array(a)) if a.len() == 1 && a[0].as_str() == Some("layers") => {}
        Some(other) => bail!("{}: 'layers_pattern' = {other} is not supported (this model's decoder layers are 'layers')", path.display()),
    }
    let index = |x: &serde_json::Value| x.as_u64().map(|i| i as usize).ok_or_else(|| candle_core::Error::Msg(format!("{}: 'layers_to_transform' holds {x}, not a layer index", path.display())));
    match v.get("layers_to_transform") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Array(a)) => Ok(Some(a.iter().map(index).collect::<Result<_>>()?)),
        Some(x) => Ok(Some(vec![index(x)?])),
    }
}

/// Refuse, by name, the PEFT options that change what the adapter computes and that this model
/// does not implement (they would otherwise be ignored silently): trained biases, transposed
/// weights, layer replication. `lora_dropout` (training only) and the init settings are
/// accepted.
fn refuse_unsupported(v: &serde_json::Value, path: &Path) -> Result<()> {
    let set = |key: &str| match v.get(key) {
        None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => false,
        Some(serde_json::Value::Array(a)) => !a.is_empty(),
        Some(serde_json::Value::Object(o)) => !o.is_empty(),
        Some(serde_json::Value::String(s)) => key != "bias" || s != "none",
        Some(_) => true,
    };
    let what = [
        ("bias", "trained biases"),
        ("lora_bias", "trained biases on lora_B"),
        ("fan_in_fan_out", "transposed (Conv1D) weights"),
        ("layer_replication", "layer replication"),
        ("exclude_modules", "excluded modules"),
    ];
    match what.iter().find(|(k, _)| set(k)) {
        Some((k, w)) => bail!("{}: '{k}' = {} ({w}) is not supported", path.display(), v[*k]),
        None => Ok(()),
    }
}
