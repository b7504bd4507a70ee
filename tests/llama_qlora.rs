//! A LoRA model over a quantized frozen base (`candle_cp_llama::quant`, QLoRA-style) on
//! parallel layouts: each rank quantizes its own TP shards, and the model must equal the
//! one-device model over the dequantized weights of the whole base (logits within 1e-5,
//! adapter gradients within 5e-5 relative, the ranks agreeing), with and without recompute, f32
//! and double-quantized scales —
//! that is, every layout computes with the same quantized weights. The quantization itself
//! changes the model (logits move off the unquantized model's), and a group width that does
//! not divide a rank's local input width is refused by name.

use candle_core::{Device, Result, Tensor};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::lora::TARGETS;
use candle_cp_llama::quant::is_quantized_weight;
use candle_cp_llama::verify::{load_reference, run_layout, run_layout_quantized, LayoutRun};
use candle_cp_llama::{hf::load_safetensors_dir, param_specs, LlamaConfig, LoraSpec};
use candle_cp_nn::{QuantConfig, QuantKind, QuantWeight};
use std::collections::HashMap;

fn dir() -> std::path::PathBuf {
    candle_cp_tests::oracle_dir("tiny-llama")
}

/// The oracle's weights plus seeded adapters (`B` off zero, as after training).
fn with_adapters(cfg: &LlamaConfig) -> Result<HashMap<String, Tensor>> {
    let mut full = load_safetensors_dir(&dir(), &Device::Cpu)?;
    for (i, s) in param_specs(cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        let sd = if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 };
        full.insert(s.name.clone(), candle_cp_ops::oracle::randn(500 + i as u64, &s.shape, sd)?);
    }
    Ok(full)
}

/// `full` with every weight the base quantizes replaced by its dequantized whole-tensor codes.
fn dequantized(full: &HashMap<String, Tensor>, q: QuantConfig) -> Result<HashMap<String, Tensor>> {
    full.iter()
        .map(|(n, t)| {
            // (a stacked [E, out, in] quantized as [E·out, in], as the base does)
            let t = if is_quantized_weight(n) {
                let in_dim = t.dims().last().copied().unwrap_or(1);
                QuantWeight::quantize(&t.reshape(((), in_dim))?, q)?.dequantize(t.dtype())?.reshape(t.shape())?
            } else {
                t.clone()
            };
            Ok((n.clone(), t))
        })
        .collect()
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// Logits and every adapter gradient of `got` against `want`.
fn check(what: &str, got: &LayoutRun, want: &LayoutRun) -> Result<()> {
    let e = max_abs(&got.logits, &want.logits)?;
    assert!(e < 1e-5, "{what}: logits off by {e}");
    assert!((got.loss - want.loss).abs() < 5e-6, "{what}: loss {} vs {}", got.loss, want.loss);
    assert!(got.grad_spread < 1e-6, "{what}: the ranks' adapter gradients differ by {}", got.grad_spread);
    let w: HashMap<&String, &Tensor> = want.grads.iter().map(|(n, g)| (n, g)).collect();
    assert_eq!(got.grads.len(), w.len(), "{what}: the adapters' gradients, and only theirs");
    let mut worst = 0f32;
    for (n, g) in &got.grads {
        let r = w[n];
        worst = worst.max(max_abs(g, r)? / r.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1e-12));
    }
    println!("{what}: logits {e:.2e}, adapter gradients {worst:.2e} relative");
    assert!(worst < 5e-5, "{what}: adapter gradients off by {worst} (relative)");
    Ok(())
}

#[test]
fn quantized_base_equals_its_dequantized_weights_on_every_layout() -> Result<()> {
    let base = LlamaConfig::from_file(dir().join("config.json"))?;
    let cfg = base.clone().with_lora(Some(LoraSpec::new(4, 6.0, &TARGETS)?));
    let ids = load_reference(dir().join("reference.safetensors"))?.input_ids;
    let full = with_adapters(&cfg)?;
    let plain = run_layout(&full, &cfg, &ids, Layout::single(), &Device::Cpu)?;
    // (layout, recompute): TP 4 splits down_proj's 352 inputs into 88 per rank
    let layouts = [
        (Layout::single(), false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true),
        (Layout::cp(CpKind::Ulysses, 2).with_tp(2, false), false),
        (Layout::single().with_tp(4, true), false),
        (Layout::two_d(2, 2), true),
    ];
    // NF4 and int8 with f32 scales, NF4 with double-quantized scales (blocks of 4 rows)
    let configs = [QuantConfig::new(QuantKind::Nf4, 8)?, QuantConfig::new(QuantKind::Int8, 8)?, QuantConfig::new(QuantKind::Nf4, 8)?.with_double_quant(4)?];
    for q in configs {
        let want = run_layout(&dequantized(&full, q)?, &cfg, &ids, Layout::single(), &Device::Cpu)?;
        let moved = max_abs(&want.logits, &plain.logits)?;
        assert!(moved > 1e-4, "{q}: quantizing moved the logits by {moved} only");
        // (int8 and double quantization on the layouts with the most splits: the same code
        // path as NF4's otherwise)
        for (layout, recompute) in layouts.into_iter().filter(|(l, _)| q == configs[0] || l.world_size() == 4) {
            let got = run_layout_quantized(&full, &cfg, &ids, layout, &Device::Cpu, recompute, q)?;
            check(&format!("{q} on {layout}, recompute {recompute}"), &got, &want)?;
        }
    }
    // groups of 64 do not divide down_proj's 176 inputs per rank at TP 2
    let e = run_layout_quantized(&full, &cfg, &ids, Layout::single().with_tp(2, true), &Device::Cpu, false, QuantConfig::new(QuantKind::Nf4, 64)?)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("down_proj.weight") && e.contains("group 64") && e.contains("[128, 176]"), "{e}");
    // a model without adapters is refused
    let e = run_layout_quantized(&full, &base, &ids, Layout::single(), &Device::Cpu, false, QuantConfig::new(QuantKind::Nf4, 8)?)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("no LoRA adapters"), "{e}");
    Ok(())
}

/// QDoRA: DoRA adapters (magnitudes off the rows' norms) over an NF4 base equal DoRA over the
/// dequantized weights on one device — logits, every factor's and magnitude's gradient — on one
/// device, TP 2 + SP × zigzag 2 with recomputed layers and TP 4 + SP (each layer's DoRA weights
/// built from the weights dequantized in its forward).
#[test]
fn dora_over_a_quantized_base_equals_its_dequantized_weights() -> Result<()> {
    let base = LlamaConfig::from_file(dir().join("config.json"))?;
    let cfg = base.clone().with_lora(Some(LoraSpec::new(4, 6.0, &TARGETS)?.with_dora(true)));
    let ids = load_reference(dir().join("reference.safetensors"))?.input_ids;
    let mut full = with_adapters(&cfg)?;
    candle_cp_tests::lora_ref::set_magnitudes(&cfg, &mut full, 520)?;
    let q = QuantConfig::new(QuantKind::Nf4, 8)?;
    let want = run_layout(&dequantized(&full, q)?, &cfg, &ids, Layout::single(), &Device::Cpu)?;
    assert_eq!(want.grads.iter().filter(|(n, _)| n.ends_with(candle_cp_llama::lora::MAGNITUDE)).count(), 14, "a magnitude per adapted weight");
    for (layout, recompute) in [(Layout::single(), false), (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true), (Layout::single().with_tp(4, true), false)] {
        let got = run_layout_quantized(&full, &cfg, &ids, layout, &Device::Cpu, recompute, q)?;
        check(&format!("DoRA over {q} on {layout}, recompute {recompute}"), &got, &want)?;
    }
    Ok(())
}

/// Generation over a quantized base (`Llama::new_quantized`: what `generate --quantize-base`
/// runs, the model a QLoRA run trained) equals generation over the dequantized weights on one
/// device: the same tokens, logits within 1e-5, on one device and on TP 2 + SP × zigzag 2
/// (f32 scales and double-quantized ones).
#[test]
fn generation_over_a_quantized_base_equals_the_dequantized_model() -> Result<()> {
    use candle_core::DType;
    use candle_cp_comm::run_ranks;
    use candle_cp_llama::{shard_tensors, Llama, ParallelCtx};
    use candle_nn::VarBuilder;
    let cfg = LlamaConfig::from_file(dir().join("config.json"))?.with_lora(Some(LoraSpec::new(4, 6.0, &TARGETS)?));
    let full = with_adapters(&cfg)?;
    let prompt = load_reference(dir().join("reference.safetensors"))?.input_ids.narrow(1, 0, 32)?;
    for q in [QuantConfig::new(QuantKind::Nf4, 8)?, QuantConfig::new(QuantKind::Int8, 8)?.with_double_quant(4)?] {
        let deq = dequantized(&full, q)?;
        let want = run_ranks(1, |g| {
            let ctx = ParallelCtx::new(g, Layout::single())?;
            let vm = shard_tensors(&deq, &cfg, &ctx)?;
            Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?.generate_greedy(&prompt, 5)
        })
        .remove(0)?;
        for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true)] {
            let got = run_ranks(layout.world_size(), |g| {
                let ctx = ParallelCtx::new(g, layout)?;
                let vm = shard_tensors(&full, &cfg, &ctx)?;
                let qb = candle_cp_llama::quant::QuantBase::from_varmap(&vm, &cfg, q)?;
                Llama::new_quantized(&qb, DType::F32, &Device::Cpu, &cfg, &ctx)?.generate_greedy(&prompt, 5)
            });
            for (r, g) in got.into_iter().enumerate() {
                let g = g?;
                assert_eq!(g.tokens, want.tokens, "{q} on {layout}, rank {r}: tokens");
                for (a, b) in g.logits.iter().zip(&want.logits) {
                    let e = max_abs(a, b)?;
                    assert!(e < 1e-5, "{q} on {layout}, rank {r}: logits off by {e}");
                }
            }
        }
    }
    Ok(())
}

/// A mixture of experts over a quantized base: the experts' stacked weights and the shared
/// expert's are quantized too (most of its weights), and the model equals the one-device model
/// over the dequantized weights — logits, loss, adapter gradients — on one device, TP 2 + SP ×
/// zigzag 2 and EP 2 over zigzag 2 (Qwen2-MoE: a dense layer, a shared expert; Mixtral: its
/// `block_sparse_moe` names), NF4 groups of 8; the experts' adapters (LoRA on every expert) stay
/// unquantized.
#[test]
fn moe_experts_are_quantized_and_every_layout_equals_the_dequantized_model() -> Result<()> {
    use candle_cp_llama::MoeStyle;
    let ids = load_reference(dir().join("reference.safetensors"))?.input_ids;
    for style in [MoeStyle::Qwen2Moe, MoeStyle::Mixtral] {
        let (base, weights) = candle_cp_tests::moe_model::moe_model(style, None)?;
        let cfg = base.with_lora(Some(LoraSpec::new(4, 6.0, &TARGETS)?));
        let mut full = weights;
        for (i, s) in param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
            let sd = if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 };
            full.insert(s.name.clone(), candle_cp_ops::oracle::randn(700 + i as u64, &s.shape, sd)?);
        }
        let lora = candle_cp_llama::lora::is_lora_name;
        let experts: Vec<&String> = full.keys().filter(|n| (n.contains(".experts.") || n.contains("shared_expert.")) && !lora(n)).collect();
        assert!(!experts.is_empty() && experts.iter().all(|n| is_quantized_weight(n) || n.ends_with("shared_expert_gate.weight")), "{style:?}: {experts:?}");
        // the experts' adapters (stacked factors, trained) are not quantized
        let adapters: Vec<&String> = full.keys().filter(|n| n.contains(".experts.") && lora(n)).collect();
        assert!(adapters.len() == 6 * cfg.moe_layers() && adapters.iter().all(|n| !is_quantized_weight(n)), "{style:?}: {adapters:?}");
        let q = QuantConfig::new(QuantKind::Nf4, 8)?;
        let want = run_layout(&dequantized(&full, q)?, &cfg, &ids, Layout::single(), &Device::Cpu)?;
        let plain = run_layout(&full, &cfg, &ids, Layout::single(), &Device::Cpu)?;
        assert!(max_abs(&want.logits, &plain.logits)? > 1e-4, "{style:?}: quantizing moved nothing");
        for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_ep(2)] {
            let got = run_layout_quantized(&full, &cfg, &ids, layout, &Device::Cpu, false, q)?;
            check(&format!("{style:?} {q} on {layout}"), &got, &want)?;
        }
    }
    Ok(())
}
