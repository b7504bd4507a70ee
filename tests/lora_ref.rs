//! The adapters' gradients from a merged model's weight gradients (the chain rule through
//! `W' = W + s·B·A`, or DoRA's `W' = m / ‖V‖ ⊙ V`, `V = W + s·B·A`, the norm a constant), and
//! DoRA magnitudes to test with.

use candle_core::{bail, DType, Result, Tensor, D};
use candle_cp_llama::{lora::MAGNITUDE, param_specs, LlamaConfig};
use std::collections::HashMap;

/// `t` in float64.
pub fn f64s(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(DType::F64)
}

/// max |a − b| / max |b| (max |a − b| when b is 0).
pub fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let d = (f64s(a)? - f64s(b)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    let m = f64s(b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    Ok(if m > 0.0 { d / m } else { d })
}

/// The adapters' variables in `vm` (LoRA factors and DoRA magnitudes), by name.
pub fn adapter_vars(vm: &candle_nn::VarMap) -> Result<Vec<(String, candle_core::Var)>> {
    Ok(vm
        .data()
        .lock()
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?
        .iter()
        .filter(|(k, _)| candle_cp_llama::lora::is_lora_name(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect())
}

/// Every adapter's gradient (by name) from the merged model's weight gradients `dw` (by weight
/// name; a stacked expert weight `[E, out, in]` by its name without `.weight`), `full` holding
/// the weights and adapters, `s` each adapter's scale (`cfg`'s, per module): plain LoRA `dA = s·Bᵀ·dW'`, `dB = s·dW'·Aᵀ`; DoRA
/// (`cfg`'s spec) `dV = m/‖V‖ ⊙ dW'`, `dA = s·Bᵀ·dV`, `dB = s·dV·Aᵀ`, `dm = Σ_in dW' ⊙ V / ‖V‖`.
pub fn adapter_grads(cfg: &LlamaConfig, full: &HashMap<String, Tensor>, dw: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let Some(lora) = &cfg.lora else { bail!("adapter_grads: a model without adapters") };
    let dora = lora.dora;
    let mut out = HashMap::new();
    for spec in param_specs(cfg) {
        let Some(stem) = spec.name.strip_suffix(".lora_A.weight") else { continue };
        let s = lora.config_for(stem).scale();
        // gpt-oss's experts' gate_up_proj: one A for gate and up, `dA = s·Σ_part B_partᵀ·dW_part`
        if let Some(prefix) = stem.strip_suffix("experts.gate_up_proj") {
            let a = f64s(&full[&spec.name])?;
            let mut da = a.zeros_like()?;
            for part in ["gate_proj", "up_proj"] {
                let part = format!("{prefix}experts.{part}");
                let Some(g) = dw.get(&part) else { bail!("no weight gradient for {part}") };
                let (g, b) = (f64s(g)?, f64s(&full[&format!("{part}.lora_B.weight")])?);
                da = (da + b.t()?.contiguous()?.matmul(&g)?)?;
                out.insert(format!("{part}.lora_B.weight"), (g.matmul(&a.t()?.contiguous()?)? * s)?);
            }
            out.insert(spec.name.clone(), (da * s)?);
            continue;
        }
        let (wn, g) = match (dw.get(&format!("{stem}.weight")), dw.get(stem)) {
            (Some(g), _) => (format!("{stem}.weight"), f64s(g)?),
            (None, Some(g)) => (stem.to_string(), f64s(g)?),
            _ => bail!("no weight gradient for {stem}"),
        };
        let (a, b) = (f64s(&full[&spec.name])?, f64s(&full[&format!("{stem}.lora_B.weight")])?);
        let dv = if dora {
            let v = (f64s(&full[&wn])? + (b.matmul(&a)? * s)?)?;
            let n = v.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
            let m = f64s(&full[&format!("{stem}{MAGNITUDE}")])?.unsqueeze(D::Minus1)?;
            out.insert(format!("{stem}{MAGNITUDE}"), (&g * &v)?.broadcast_div(&n)?.sum(D::Minus1)?);
            g.broadcast_mul(&m.broadcast_div(&n)?)?
        } else {
            g
        };
        out.insert(spec.name.clone(), (b.t()?.contiguous()?.matmul(&dv)? * s)?);
        out.insert(format!("{stem}.lora_B.weight"), (dv.matmul(&a.t()?.contiguous()?)? * s)?);
    }
    Ok(out)
}

/// DoRA magnitudes for `full`'s adapted weights: each row's norm `‖W‖` times `1 + 0.2·z`
/// (`z` seeded normals), so `m / ‖W + s·B·A‖` is not one; replaces the magnitudes in `full`.
pub fn set_magnitudes(cfg: &LlamaConfig, full: &mut HashMap<String, Tensor>, seed: u64) -> Result<()> {
    for (i, spec) in param_specs(cfg).into_iter().filter(|s| s.name.ends_with(MAGNITUDE)).enumerate() {
        let stem = &spec.name[..spec.name.len() - MAGNITUDE.len()];
        let w = match (full.get(&format!("{stem}.weight")), full.get(stem)) {
            (Some(w), _) | (None, Some(w)) => w.clone(),
            _ => bail!("no weight for {}", spec.name),
        };
        let norm = w.to_dtype(DType::F32)?.sqr()?.sum(D::Minus1)?.sqrt()?;
        let z = candle_cp_ops::oracle::randn(seed + i as u64, &spec.shape, 0.2)?.to_dtype(DType::F32)?;
        full.insert(spec.name.clone(), (norm * (z + 1.0)?)?);
    }
    Ok(())
}

/// On each of `layouts` (every rank): `Llama::with_adapters_merged` (the adapters folded into the
/// weights, as generation runs) decodes the same 6 tokens after `ids` as the adapted model,
/// logits within 1e-4; the largest difference over the layouts.
pub fn merged_generation_agrees(cfg: &LlamaConfig, full: &HashMap<String, Tensor>, ids: &Tensor, layouts: &[candle_cp_llama::Layout]) -> Result<f64> {
    use candle_cp_llama::{shard_tensors, Llama, ParallelCtx};
    let mut worst = 0f64;
    for &layout in layouts {
        for r in candle_cp_comm::run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_tensors(full, cfg, &ctx)?;
            let build = || Llama::new(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &candle_core::Device::Cpu), cfg, &ctx);
            let adapted = build()?.generate_greedy(ids, 6)?;
            let merged = build()?.with_adapters_merged()?.generate_greedy(ids, 6)?;
            if adapted.tokens != merged.tokens {
                bail!("{layout}: merged adapters decode {:?}, the adapted model {:?}", merged.tokens, adapted.tokens)
            }
            let mut e = 0f64;
            for (a, b) in adapted.logits.iter().zip(&merged.logits) {
                e = e.max(crate::dense_llama::max_abs(a, b)?);
            }
            Ok(e)
        }) {
            let e = r?;
            assert!(e < 1e-4, "{layout}: merged adapters' logits off by {e}");
            worst = worst.max(e);
        }
    }
    Ok(worst)
}
