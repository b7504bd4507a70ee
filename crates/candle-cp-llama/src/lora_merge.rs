//! Merging LoRA / DoRA adapters into the weights they adapt ([`merge_adapter`]), for a
//! serving stack that loads the model without PEFT (`candle-cp merge-lora`).

use crate::lora::{LoraSpec, MAGNITUDE};
use candle_core::{bail, Result, Tensor};
use std::collections::HashMap;

/// Merge adapters into their weights, in place: `W ← W + s·B·A` (DoRA: `m / ‖W + s·B·A‖ ⊙
/// (W + s·B·A)`; in f32, back in `W`'s dtype) for every adapted weight in `weights` (full
/// tensors by parameter name), the model a serving stack loads without PEFT. `adapters` by
/// parameter name (`….lora_{A,B}.weight`, `….lora_magnitude_vector`, as
/// [`crate::lora::load_peft_adapter`] gives them; a Phi-3's fused modules' under PEFT's fused names or its
/// parts' B and magnitudes under the model's, merged on the stacked weight). Returns how many weights were merged; errors name a
/// weight an adapter has no base for, or factors that do not fit it.
pub fn merge_adapter(weights: &mut HashMap<String, Tensor>, spec: &LoraSpec, adapters: &HashMap<String, Tensor>) -> Result<usize> {
    let mut merged = 0;
    // (gpt-oss's gate_up_proj: its one A merged with each part's B)
    let untied = crate::expert_params::untie(adapters);
    let adapters = &untied;
    // the modules trained whole: their tensors replace the base's
    for (name, t) in adapters.iter().filter(|(n, _)| spec.saved_param(n)) {
        let Some(w) = weights.get(name) else { bail!("merge_adapter: the model has no {name} for the adapter's module trained whole") };
        if w.dims() != t.dims() {
            bail!("merge_adapter: the adapter's {name} {:?} does not fit the model's {:?}", t.dims(), w.dims())
        }
        let t = t.to_dtype(w.dtype())?;
        weights.insert(name.clone(), t);
        merged += 1;
    }
    // a Phi-3's adapters by the model's names (its parts' B and magnitudes): as PEFT's file
    // holds them, stacked under the fused module whose A is there
    let parts: Vec<&String> = adapters.keys().filter(|n| fused_part_of_adapter(adapters, n)).collect();
    let fused_form;
    let adapters = if parts.is_empty() {
        adapters
    } else {
        let mut all = adapters.clone();
        let taken: Vec<(String, Tensor)> = parts.iter().filter_map(|n| all.remove_entry(*n)).collect();
        for (n, ts) in crate::config::phi3::fuse_checkpoint_tensors(true, taken)? {
            all.insert(n, Tensor::cat(&ts, 0)?);
        }
        fused_form = all;
        &fused_form
    };
    for (name, a) in adapters.iter().filter(|(n, _)| n.ends_with(".lora_A.weight")) {
        let stem = &name[..name.len() - ".lora_A.weight".len()];
        let (wn, bn) = (format!("{stem}.weight"), format!("{stem}.lora_B.weight"));
        let Some(b) = adapters.get(&bn) else { bail!("merge_adapter: {name} has no {bn}") };
        let m = adapters.get(&format!("{stem}{MAGNITUDE}"));
        match crate::config::phi3::fused_parts(stem).filter(|_| !weights.contains_key(&wn)) {
            // a Phi-3's fused module: its parts' weights stacked by rows, merged as one, split back
            Some(parts) => {
                let names: Vec<String> = parts.iter().map(|p| format!("{p}.weight")).collect();
                let ws = names
                    .iter()
                    .map(|n| weights.get(n).cloned().ok_or_else(|| candle_core::Error::Msg(format!("merge_adapter: the model has no {n} for adapter {name}"))))
                    .collect::<Result<Vec<_>>>()?;
                let new = merged_weight(&Tensor::cat(&ws, 0)?, (a, b, m), spec, stem, &wn)?;
                let mut at = 0;
                for (n, w) in names.into_iter().zip(&ws) {
                    let rows = w.dim(0)?;
                    weights.insert(n, new.narrow(0, at, rows)?.contiguous()?);
                    at += rows;
                }
            }
            None => {
                // a sparse layer's stacked experts are named without `.weight` ([E, out, in], the
                // factors [E, r, in] and [E, out, r]: one product per expert)
                let wn = if !weights.contains_key(&wn) && weights.contains_key(stem) { stem.to_string() } else { wn };
                let Some(w) = weights.get(&wn) else { bail!("merge_adapter: the model has no {wn} for adapter {name}") };
                let new = merged_weight(w, (a, b, m), spec, stem, &wn)?;
                weights.insert(wn, new);
            }
        }
        merged += 1;
    }
    Ok(merged)
}

/// Whether adapter tensor `name` is a part of a Phi-3's fused module's `B` or magnitude
/// (`….q_proj.lora_B.weight`) whose fused `A` is among `adapters`.
fn fused_part_of_adapter(adapters: &HashMap<String, Tensor>, name: &str) -> bool {
    !name.ends_with(".lora_A.weight")
        && crate::config::phi3::fused_checkpoint_name(name).is_some_and(|(f, _)| {
            [".lora_B.weight", MAGNITUDE].iter().any(|s| f.strip_suffix(s).is_some_and(|stem| adapters.contains_key(&format!("{stem}.lora_A.weight"))))
        })
}

/// Weight `w` (named `wn`) with the adapter `(A, B, DoRA's magnitude)` of module `stem`
/// merged in ([`merge_adapter`]'s formula), in `w`'s dtype.
fn merged_weight(w: &Tensor, (a, b, m): (&Tensor, &Tensor, Option<&Tensor>), spec: &LoraSpec, stem: &str, wn: &str) -> Result<Tensor> {
    let (f32, dt) = (candle_core::DType::F32, w.dtype());
    let (dw, w32) = (b.to_dtype(f32)?.matmul(&a.to_dtype(f32)?)?, w.to_dtype(f32)?);
    if dw.dims() != w32.dims() {
        bail!("merge_adapter: B {:?} · A {:?} does not fit {wn} {:?}", b.dims(), a.dims(), w.dims())
    }
    match m {
        // DoRA: m / ‖W + s·B·A‖ ⊙ (W + s·B·A)
        Some(m) if spec.dora => candle_cp_nn::dora_merge(w, a, b, m, spec.config_for(stem).scale()),
        None if spec.dora => bail!("merge_adapter: a DoRA adapter without {stem}{MAGNITUDE}"),
        _ => (w32 + (dw * spec.config_for(stem).scale())?)?.to_dtype(dt),
    }
}
