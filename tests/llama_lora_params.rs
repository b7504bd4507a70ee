//! LoRA on experts held as parameters, as PEFT adapts them (`target_parameters`,
//! `candle_cp_llama::LoraSpec::with_target_parameters`): gpt-oss's (`mlp.experts.gate_up_proj`
//! `[E, h, 2·I]`, gate and up interleaved; `down_proj` `[E, I, h]`) and transformers 5's
//! Qwen3-MoE's and Mixtral's (`[E, 2·I, h]`, gate's rows then up's; `[E, h, I]`; a Mixtral's
//! sparse layer is `mlp` in transformers 5, `block_sparse_moe` here), one adapter of per-expert
//! rank `r` over all experts (`lora_A` `[r·E, in]`, `lora_B` `[out, r·E]` in the file; gate and up
//! one `A`).
//!
//! - The adapted model is the model with merged weights: its logits and loss are the float64
//!   reference's of the weights `merge_adapter` gives, the adapters' gradients follow from the
//!   merged model's weight gradients by the chain rule (gate_up_proj's `A` summing gate's and
//!   up's), on one device, TP with and without SP, TP × CP (recomputed too), expert parallelism
//!   alone and with TP + SP, and across DP replicas; a `rank_pattern` gives down_proj its own
//!   rank; the experts' adapters move the logits.
//! - The PEFT file is what PEFT computes with: its `lora_A` / `lora_B` wrappers, merged into the
//!   fused parameters by PEFT's einsum (`"o r e, e r i -> e i o"` for gpt-oss's, `"… -> e o i"`
//!   for transformers 5's; written here element by element), give the weights `merge_adapter`
//!   gives (gpt-oss's through its checkpoint file, read back); the file reads back as the
//!   model's factors bit for bit and the same spec; so does the same update with its factors in
//!   PEFT 0.18's order (`lora_A` `[r·E, out]`, `lora_B` `[in, r·E]`), whose merge by PEFT 0.18's
//!   formula (`"… -> e i o"` on the parameter as it is) gives the same weights.
//! - An adapter configured as PEFT's gpt-oss recipes write them (`target_modules:
//!   "all-linear"`, `target_parameters` on one layer's experts) reads: the attention adapted on
//!   every layer, the experts of that layer only.
//! - A transformers 4 adapter (per-expert modules and the router) as PEFT converts it for
//!   transformers 5 (`target_parameters` `gate_up_proj`, `down_proj`, `gate.weight`; gate_up_proj
//!   of rank `2r` with a block-diagonal `B`, by `rank_pattern` / `alpha_pattern`), written here
//!   from the formula, reads as the same model (Qwen3-MoE, Mixtral: merged weights, logits and
//!   loss on three layouts) and is written back tensor for tensor.
//! - Generation with the adapters folded into the weights decodes the adapted model's tokens.
//! - Refused by name: dropout, DoRA, expert parameters on a dense model, a key that matches no
//!   parameter of a sparse layer, a
//!   key that names no expert parameter, gpt-oss's experts as target modules, the router as a
//!   target module beside expert parameters (transformers 5's router is a parameter; all-linear
//!   leaves it out there).

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::lora::{is_lora_name, GateUp, load_peft_adapter, merge_adapter, model_adapters, save_peft_adapter};
use candle_cp_llama::verify::{load_reference, run_layout_recompute};
use candle_cp_llama::{param_specs, save_hf, LlamaConfig, LoraSpec, MoeStyle};
use candle_cp_tests::dense_llama::{reference_routed, reference_rows};
use candle_cp_tests::lora_ref::{f64s, rel};
use candle_cp_tests::moe_model::moe_model;
use candle_cp_tests::peft_files::{peft_converted, write_adapter};
use std::collections::HashMap;

const T: usize = 128;
const PARAMS: [&str; 2] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

fn ids(t: usize) -> Result<Tensor> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, t)?.contiguous()
}

/// The models whose experts are parameters: gpt-oss (both layers sparse), Qwen3-MoE (layer 1
/// sparse), Mixtral (both layers sparse; transformers 5's `mlp.experts.*`, `block_sparse_moe`
/// here) and GLM-4.5 (layer 1 sparse, its router sigmoid, its shared expert beside) as
/// transformers 5 holds them.
const STYLES: [MoeStyle; 4] = [MoeStyle::GptOss, MoeStyle::Qwen3Moe, MoeStyle::Mixtral, MoeStyle::Glm4Moe];

/// The model's name of `cfg`'s sparse layers (`mlp`, a Mixtral's `block_sparse_moe`).
fn module(cfg: &LlamaConfig) -> &'static str {
    cfg.moe.as_ref().map_or("mlp", |m| m.module())
}

/// `style` with adapters on q_proj and both expert parameters (rank 2, down_proj's 3 by
/// `rank_pattern`, alpha 6), the factors seeded (`B ≠ 0`): (base config, adapted config, full
/// weights and factors).
fn adapted(style: MoeStyle) -> Result<(LlamaConfig, LlamaConfig, HashMap<String, Tensor>)> {
    let (base, mut full) = moe_model(style, None)?;
    let spec = LoraSpec::new(2, 6.0, &["q_proj"])?.with_target_parameters(&PARAMS)?.with_rank_pattern(vec![("mlp.experts.down_proj".into(), 3)])?;
    let cfg = base.clone().with_lora(Some(spec));
    for (i, s) in param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        let sd = if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 };
        full.insert(s.name.clone(), candle_cp_ops::oracle::randn(2300 + i as u64, &s.shape, sd)?.to_dtype(DType::F32)?);
    }
    Ok((base, cfg, full))
}

/// `full` as a `VarMap`.
fn varmap(full: &HashMap<String, Tensor>) -> Result<candle_nn::VarMap> {
    candle_cp_tests::varmap_of(full)
}

fn split(full: &HashMap<String, Tensor>) -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    full.clone().into_iter().partition(|(n, _)| is_lora_name(n))
}

/// Every layout equals the merged model's float64 reference (logits, loss, each adapter's
/// gradient by the chain rule); the experts' adapters bind.
#[test]
fn expert_parameter_adapters_equal_the_merged_model_on_every_layout() -> Result<()> {
    for style in STYLES {
        on_every_layout(style)?;
    }
    Ok(())
}

fn on_every_layout(style: MoeStyle) -> Result<()> {
    let (base, cfg, full) = adapted(style)?;
    let specs = param_specs(&cfg);
    let experts: Vec<(&str, &[usize])> = specs.iter().filter(|s| s.is_lora() && s.is_expert()).map(|s| (s.name.as_str(), s.shape.as_slice())).collect();
    // per sparse layer: gate_up's A, gate's and up's B, down's A and B (rank 3 by the pattern)
    assert_eq!(experts.len(), 5 * cfg.moe_layers(), "{experts:?}");
    let m = module(&cfg);
    assert!(experts.contains(&(format!("model.layers.1.{m}.experts.gate_up_proj.lora_A.weight").as_str(), &[8, 2, 128][..])), "{experts:?}");
    assert!(experts.contains(&(format!("model.layers.1.{m}.experts.down_proj.lora_A.weight").as_str(), &[8, 3, 48][..])), "{experts:?}");
    let (adapters, weights) = split(&full);
    let spec = cfg.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
    let mut merged = weights.clone();
    // q_proj on each of the 2 layers, gate, up and down on each sparse one
    assert_eq!(merge_adapter(&mut merged, &spec, &adapters)?, 2 + 3 * cfg.moe_layers(), "{style:?}");
    let ids = ids(T)?;
    let (want, margin) = reference_routed(&merged, &base, &ids)?;
    assert!(margin > 1e-5, "{style:?}: a near tie in the routing ({margin:.1e})");
    let dense: HashMap<String, Tensor> = adapters.iter().filter(|(n, _)| !n.contains(".experts.")).map(|(n, t)| (n.clone(), t.clone())).collect();
    let mut no_experts = weights.clone();
    merge_adapter(&mut no_experts, &spec, &dense)?;
    let moved = (f64s(&reference_routed(&no_experts, &base, &ids)?.0.logits)? - f64s(&want.logits)?)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(moved > 1e-3, "{style:?}: the expert adapters move the logits by only {moved:.1e}");
    let want_g = candle_cp_tests::lora_ref::adapter_grads(&cfg, &full, &want.grads)?;
    assert_eq!(want_g.len(), adapters.len());
    let two = Tensor::cat(&[&ids, &ids], 0)?;
    let rows_want = reference_rows(&want)?;
    let layouts = [
        (Layout::single(), false, false),
        (Layout::single().with_tp(2, false), false, false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), false, false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true, false),
        (Layout::cp(CpKind::Ulysses, 2).with_ep(2), false, false),
        (Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2), false, false),
        (Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(4), false, true),
    ];
    for (layout, recompute, dp) in layouts {
        let (input, w) = if dp { (&two, &rows_want) } else { (&ids, &want) };
        let name = format!("{style:?} {layout}{}", if recompute { " (recomputed)" } else { "" });
        let run = run_layout_recompute(&full, &cfg, input, layout, &Device::Cpu, recompute)?;
        let e_logits = (f64s(&run.logits)? - f64s(&w.logits)?)?.abs()?.max_all()?.to_scalar::<f64>()?;
        let (mut worst, mut at) = (0f64, String::new());
        for (n, g) in &want_g {
            let Some((_, got)) = run.grads.iter().find(|(k, _)| k == n) else { candle_core::bail!("{name}: no gradient for {n}") };
            let e = rel(got, g)?;
            if e > worst {
                (worst, at) = (e, n.clone());
            }
        }
        println!("expert-parameter LoRA {name}: logits {e_logits:.2e}, loss {:.1e}, adapter gradients {worst:.2e} ({at})", (run.loss - w.loss).abs());
        assert!(e_logits < 2e-5 && (run.loss - w.loss).abs() < 5e-6, "{name}: logits {e_logits}, loss {} vs {}", run.loss, w.loss);
        assert_eq!(run.grads.len(), want_g.len(), "{name}: the adapters' gradients, and only theirs");
        assert!(worst < 2e-4, "{name}: {at} off by {worst} (relative)");
        assert!(run.grad_spread < 1e-6, "{name}: the ranks' adapter gradients differ by {}", run.grad_spread);
    }
    Ok(())
}

/// PEFT's `get_delta_weight` of a `[E, in, out]` parameter from the file's factors (`A`
/// `[r·E, in]`, `B` `[out, r·E]`): `ΔW[e][i][o] = s·Σ_j B[o][j·E + e]·A[e·r + j][i]`.
fn peft_delta(a: &Tensor, b: &Tensor, e: usize, s: f64) -> Result<Tensor> {
    let (a, b) = (a.to_dtype(DType::F64)?.to_vec2::<f64>()?, b.to_dtype(DType::F64)?.to_vec2::<f64>()?);
    let (r, i, o) = (a.len() / e, a[0].len(), b.len());
    let mut d = vec![0f64; e * i * o];
    for ex in 0..e {
        for ii in 0..i {
            for oo in 0..o {
                d[(ex * i + ii) * o + oo] = s * (0..r).map(|j| b[oo][j * e + ex] * a[ex * r + j][ii]).sum::<f64>();
            }
        }
    }
    Tensor::from_vec(d, (e, i, o), &Device::Cpu)
}

/// PEFT's merge of the adapter file in `adir` into the weights of `base` (`weights`, by the
/// model's names), back in the model's names: q_proj's `W + s·B·A`; the expert parameters'
/// `+ ΔW` (PEFT's einsum) on the fused tensors — gpt-oss's in its checkpoint file (written,
/// merged there, read back), transformers 5's `[E, 2·I, h]` / `[E, h, I]` joined here.
/// `old`: the file holds PEFT 0.18's order (transformers 5's models only: the parameter
/// `[E, d1, d2]` read as `[E, in, out]`, its update `"… -> e i o"` on the parameter as it is).
fn peft_merged(style: MoeStyle, base: &LlamaConfig, weights: &HashMap<String, Tensor>, adir: &std::path::Path, root: &std::path::Path, old: bool) -> Result<HashMap<String, Tensor>> {
    let file = candle_core::safetensors::load(adir.join("adapter_model.safetensors"), &Device::Cpu)?;
    let f = |l: usize, w: &str| file.get(&format!("base_model.model.model.layers.{l}.mlp.experts.{w}.weight")).cloned().ok_or_else(|| candle_core::Error::Msg(format!("the file has no layer {l} {w}")));
    let (e, scale_gu, scale_d, layers) = (8, 6.0 / 2.0, 6.0 / 3.0, base.num_hidden_layers);
    let sparse: Vec<usize> = (0..layers).filter(|&l| base.is_moe_layer(l)).collect();
    let q_merged = |l: usize, w: &Tensor| -> Result<Tensor> {
        let q = |x: &str| file.get(&format!("base_model.model.model.layers.{l}.self_attn.q_proj.{x}.weight")).map(f64s).transpose();
        let (Some(a), Some(b)) = (q("lora_A")?, q("lora_B")?) else { candle_core::bail!("the file has no layer {l} q_proj") };
        (f64s(w)? + (b.matmul(&a)? * scale_gu)?)?.to_dtype(DType::F32)
    };
    if style == MoeStyle::GptOss {
        let (bdir, mdir) = (root.join("base"), root.join("merged"));
        save_hf(&bdir, &varmap(weights)?, base)?;
        let mut ckpt = candle_core::safetensors::load(bdir.join("model.safetensors"), &Device::Cpu)?;
        for &l in &sparse {
            for (w, at, s) in [("gate_up_proj", "base_layer.lora", scale_gu), ("down_proj", "lora", scale_d)] {
                let name = format!("model.layers.{l}.mlp.experts.{w}");
                // gpt-oss's [E, in, out]: einsum "o r e, e r i -> e i o"
                let d = peft_delta(&f(l, &format!("{at}_A"))?, &f(l, &format!("{at}_B"))?, e, s)?;
                let t = ckpt[&name].to_dtype(DType::F64)?;
                assert_eq!(t.dims(), d.dims(), "{name}");
                ckpt.insert(name, (t + d)?.to_dtype(DType::F32)?);
            }
        }
        for l in 0..layers {
            let name = format!("model.layers.{l}.self_attn.q_proj.weight");
            ckpt.insert(name.clone(), q_merged(l, &ckpt[&name])?);
        }
        std::fs::create_dir_all(&mdir).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        candle_core::safetensors::save(&ckpt, mdir.join("model.safetensors"))?;
        std::fs::copy(bdir.join("config.json"), mdir.join("config.json")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let (vm, _) = candle_cp_llama::load_hf(&mdir, &Device::Cpu, DType::F32)?;
        return candle_cp_llama::params::varmap_tensors(&vm);
    }
    let mut out = weights.clone();
    for l in 0..layers {
        let name = format!("model.layers.{l}.self_attn.q_proj.weight");
        out.insert(name.clone(), q_merged(l, &weights[&name])?);
    }
    for &l in &sparse {
        let p = |w: &str| format!("model.layers.{l}.{}.experts.{w}", module(base));
        // transformers 5's [E, out, in]: einsum "o r e, e r i -> e o i", the transpose of
        // peft_delta's [E, in, out] (PEFT 0.18: "… -> e i o" on [E, d1, d2] as it is)
        let delta = |a: &str, b: &str, s: f64| -> Result<Tensor> {
            let d = peft_delta(&f(l, a)?, &f(l, b)?, e, s)?;
            if old { Ok(d) } else { d.transpose(1, 2) }
        };
        let gate_up = Tensor::cat(&[&weights[&p("gate_proj")], &weights[&p("up_proj")]], 1)?.to_dtype(DType::F64)?;
        let gate_up = (gate_up + delta("base_layer.lora_A", "base_layer.lora_B", scale_gu)?)?.to_dtype(DType::F32)?;
        let i = gate_up.dim(1)? / 2;
        out.insert(p("gate_proj"), gate_up.narrow(1, 0, i)?.contiguous()?);
        out.insert(p("up_proj"), gate_up.narrow(1, i, i)?.contiguous()?);
        let down = (weights[&p("down_proj")].to_dtype(DType::F64)? + delta("lora_A", "lora_B", scale_d)?)?;
        out.insert(p("down_proj"), down.to_dtype(DType::F32)?);
    }
    Ok(out)
}

/// The file PEFT reads: merged by PEFT's formula into the fused parameters, it gives
/// `merge_adapter`'s weights; it reads back bit for bit; misuse is refused by name.
#[test]
fn expert_parameter_adapter_file_is_what_peft_computes() -> Result<()> {
    for style in STYLES {
        file_of(style)?;
    }
    refusals()
}

fn file_of(style: MoeStyle) -> Result<()> {
    let (base, cfg, full) = adapted(style)?;
    let (adapters, weights) = split(&full);
    let spec = cfg.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
    let root = std::env::temp_dir().join(format!("candle-cp-lora-params-{style:?}-{}", std::process::id()));
    let adir = root.join("adapter");
    save_peft_adapter(&adir, &spec, &adapters, "base")?;
    let text = std::fs::read_to_string(adir.join("adapter_config.json")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let mut json: serde_json::Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!(json["target_parameters"], serde_json::json!(["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]));
    assert_eq!(json["target_modules"], serde_json::json!(["q_proj"]));
    assert_eq!(json["lora_dropout"], serde_json::json!(0.0));
    let pefts = peft_merged(style, &base, &weights, &adir, &root, false)?;
    let mut merged = weights.clone();
    merge_adapter(&mut merged, &spec, &adapters)?;
    let mut worst = 0f64;
    for (n, t) in &merged {
        let Some(p) = pefts.get(n) else { candle_core::bail!("{style:?}: PEFT's merge has no {n}") };
        let d = (f64s(p)? - f64s(t)?)?.abs()?.max_all()?.to_scalar::<f64>()?;
        if d > 1e-6 {
            println!("{style:?} {n}: {d:.2e}");
        }
        worst = worst.max(d);
    }
    println!("{style:?}: PEFT's merge of the file vs merge_adapter: {worst:.1e}");
    assert!(worst < 1e-6, "{style:?}: PEFT's merge differs by {worst}");
    // ... and the update matters at this size
    let up = format!("model.layers.1.{}.experts.up_proj", module(&base));
    let moved = (f64s(&pefts[&up])? - f64s(&weights[&up])?)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(moved > 1e-3, "{style:?}: the update moves up_proj by {moved}");
    // read back: the spec and the model's factors, bit for bit
    let (back, tensors) = load_peft_adapter(&adir)?;
    assert_eq!(back.with_expert_params(spec.expert_params), spec);
    let layout = if style == MoeStyle::GptOss { GateUp::Interleaved } else { GateUp::Concatenated };
    assert_eq!(spec.expert_params, Some(layout), "{style:?}");
    let tensors = model_adapters(&cfg, tensors)?;
    assert_eq!(tensors.len(), adapters.len());
    for (n, t) in &adapters {
        assert_eq!((&tensors[n] - t)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "{n}");
    }
    // the same update in PEFT 0.18's order of the factors (gpt-oss: PEFT 0.19.0's) reads as the
    // same factors; on transformers 5's models PEFT 0.18's own merge of it gives merge_adapter's
    let odir = root.join("peft-0.18");
    std::fs::create_dir_all(&odir).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let file = candle_core::safetensors::load(adir.join("adapter_model.safetensors"), &Device::Cpu)?;
    candle_core::safetensors::save(&peft_018(&file, 8)?, odir.join("adapter_model.safetensors"))?;
    json["peft_version"] = serde_json::json!("0.18.1");
    std::fs::write(odir.join("adapter_config.json"), json.to_string()).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let (_, old) = load_peft_adapter(&odir)?;
    let old = model_adapters(&cfg, old)?;
    assert_eq!(old.len(), adapters.len());
    for (n, t) in &adapters {
        assert_eq!((&old[n] - t)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "PEFT 0.18's order: {n}");
    }
    if style != MoeStyle::GptOss {
        let pefts = peft_merged(style, &base, &weights, &odir, &root, true)?;
        let worst = merged.iter().map(|(n, t)| (f64s(&pefts[n])? - f64s(t)?)?.abs()?.max_all()?.to_scalar::<f64>()).collect::<Result<Vec<f64>>>()?.into_iter().fold(0f64, f64::max);
        println!("{style:?}: PEFT 0.18's merge of its file vs merge_adapter: {worst:.1e}");
        assert!(worst < 1e-6, "{style:?}: PEFT 0.18's merge differs by {worst}");
    }
    std::fs::remove_dir_all(&root).ok();
    Ok(())
}

/// `file`'s expert wrappers (`lora_A` `[r·E, in]`, `lora_B` `[out, r·E]`) as PEFT 0.18 writes
/// the same update on transformers 5's models (`[r·E, out]`, `[in, r·E]`):
/// `A'[e·r + j][o] = B[o][j·E + e]`, `B'[i][j·E + e] = A[e·r + j][i]`, element by element; other
/// tensors as they are.
fn peft_018(file: &HashMap<String, Tensor>, e: usize) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (n, t) in file {
        let wrapper = |f: &str| n.ends_with(&format!("experts.{f}.weight")) || n.ends_with(&format!("experts.base_layer.{f}.weight"));
        if wrapper("lora_B") {
            continue;
        }
        let Some(stem) = n.strip_suffix(".lora_A.weight").filter(|_| wrapper("lora_A")) else {
            out.insert(n.clone(), t.clone());
            continue;
        };
        let a = t.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let b = file[&format!("{stem}.lora_B.weight")].to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let (re, i, o) = (a.len(), a[0].len(), b.len());
        let r = re / e;
        let mut a2 = vec![0f32; re * o];
        let mut b2 = vec![0f32; i * re];
        for ex in 0..e {
            for j in 0..r {
                for (oo, row) in b.iter().enumerate() {
                    a2[(ex * r + j) * o + oo] = row[j * e + ex];
                }
                for ii in 0..i {
                    b2[ii * re + j * e + ex] = a[ex * r + j][ii];
                }
            }
        }
        out.insert(format!("{stem}.lora_A.weight"), Tensor::from_vec(a2, (re, o), &Device::Cpu)?);
        out.insert(format!("{stem}.lora_B.weight"), Tensor::from_vec(b2, (i, re), &Device::Cpu)?);
    }
    Ok(out)
}

/// Misuse refused by name.
fn refusals() -> Result<()> {
    let (base, _) = moe_model(MoeStyle::GptOss, None)?;
    let err = |c: LlamaConfig| c.validate().err().map(|e| e.to_string()).unwrap_or_default();
    let with = |s: Result<LoraSpec>| -> Result<LlamaConfig> { Ok(base.clone().with_lora(Some(s?))) };
    let e1 = err(with(LoraSpec::on_parameters(2, 4.0, &PARAMS).and_then(|s| s.with_dropout(0.1)))?);
    assert!(e1.contains("lora_dropout 0.1"), "{e1}");
    let e2 = err(with(LoraSpec::on_parameters(2, 4.0, &PARAMS).map(|s| s.with_dora(true)))?);
    assert!(e2.contains("DoRA"), "{e2}");
    // gpt-oss's router is `mlp.router`, no `gate.weight`
    let e9 = err(with(LoraSpec::on_parameters(2, 4.0, &["gate.weight"]))?);
    assert!(e9.contains("'gate.weight'") && e9.contains("matches no"), "{e9}");
    let e3 = err(with(LoraSpec::on_parameters(2, 4.0, &["9.mlp.experts.down_proj"]))?);
    assert!(e3.contains("'9.mlp.experts.down_proj'") && e3.contains("matches no"), "{e3}");
    let (qwen, _) = moe_model(MoeStyle::Qwen3Moe, None)?;
    let e4 = err(qwen.clone().with_moe(None).with_lora(Some(LoraSpec::on_parameters(2, 4.0, &PARAMS)?)));
    assert!(e4.contains("dense model"), "{e4}");
    let e5 = LoraSpec::on_parameters(2, 4.0, &["mlp.experts.gate_proj"]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e5.contains("'mlp.experts.gate_proj'"), "{e5}");
    // Qwen3-MoE's layer 0 is dense: no expert parameter there
    let e6 = err(qwen.clone().with_lora(Some(LoraSpec::on_parameters(2, 4.0, &["0.mlp.experts.down_proj"])?)));
    assert!(e6.contains("'0.mlp.experts.down_proj'") && e6.contains("1 sparse layers"), "{e6}");
    // transformers 5's router is a parameter too: all-linear leaves it out beside
    // target_parameters, naming it is refused
    let all = qwen.clone().with_lora(Some(LoraSpec::new(2, 4.0, &candle_cp_llama::lora::ALL_LINEAR)?.with_target_parameters(&PARAMS)?));
    all.validate()?;
    assert!(param_specs(&all).iter().all(|s| !s.name.contains("mlp.gate.lora")), "no router adapter beside the expert parameters");
    let e8 = err(qwen.with_lora(Some(LoraSpec::new(2, 4.0, &["q_proj", "gate"])?.with_target_parameters(&PARAMS)?)));
    assert!(e8.contains("router") && e8.contains("parameter"), "{e8}");
    // gpt-oss's experts named as target modules (they are parameters)
    let e7 = err(with(LoraSpec::new(2, 4.0, &["q_proj", "down_proj"]))?);
    assert!(e7.contains("down_proj") && e7.contains("target_parameters"), "{e7}");
    Ok(())
}

/// An adapter configured as PEFT's gpt-oss fine-tuning recipes write them: `target_modules`
/// `"all-linear"` (q, k, v, o: gpt-oss's router and experts are not linear modules) and
/// `target_parameters` naming layer 1's experts only. It reads, and the model built from it is
/// the one the same spec builds directly (every layer's attention adapted, layer 1's experts
/// only): the same logits.
#[test]
fn a_recipe_style_gpt_oss_adapter_reads() -> Result<()> {
    let (base, mut full) = moe_model(MoeStyle::GptOss, None)?;
    let one_layer = ["1.mlp.experts.gate_up_proj", "1.mlp.experts.down_proj"];
    let cfg = base.clone().with_lora(Some(LoraSpec::new(2, 4.0, &candle_cp_llama::lora::ALL_LINEAR)?.with_target_parameters(&one_layer)?));
    let specs: Vec<_> = param_specs(&cfg).into_iter().filter(|s| s.is_lora()).collect();
    assert!(specs.iter().all(|s| !s.name.starts_with("model.layers.0.mlp")), "layer 0's experts are not adapted");
    assert_eq!(specs.iter().filter(|s| s.name.contains(".experts.")).count(), 5);
    for (i, s) in specs.iter().enumerate() {
        full.insert(s.name.clone(), candle_cp_ops::oracle::randn(3300 + i as u64, &s.shape, 0.1)?.to_dtype(DType::F32)?);
    }
    let (adapters, _) = split(&full);
    let dir = std::env::temp_dir().join(format!("candle-cp-lora-recipe-{}", std::process::id()));
    let spec = cfg.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
    save_peft_adapter(&dir, &spec, &adapters, "openai/gpt-oss-20b")?;
    // the recipe's config: target_modules "all-linear"
    let path = dir.join("adapter_config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).map_err(|e| candle_core::Error::Msg(e.to_string()))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    json["target_modules"] = serde_json::json!("all-linear");
    std::fs::write(&path, json.to_string()).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let (read, tensors) = load_peft_adapter(&dir)?;
    let rcfg = base.clone().with_lora(Some(read));
    rcfg.validate()?;
    assert_eq!(rcfg.lora, cfg.lora);
    let tensors = model_adapters(&rcfg, tensors)?;
    let mut back = full.clone();
    back.retain(|n, _| !is_lora_name(n));
    back.extend(tensors);
    let ids = ids(64)?;
    let a = run_layout_recompute(&full, &cfg, &ids, Layout::single(), &Device::Cpu, false)?;
    let b = run_layout_recompute(&back, &rcfg, &ids, Layout::single(), &Device::Cpu, false)?;
    assert_eq!((&a.logits - &b.logits)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// Generation with the expert-parameter adapters folded into the weights (what
/// `Llama::with_adapters_merged` runs) decodes the adapted model's tokens on one device, TP 2 +
/// SP and EP 2 over zigzag 2, for both models.
#[test]
fn expert_parameter_adapters_generate_alike() -> Result<()> {
    for style in STYLES {
        let (_, cfg, full) = adapted(style)?;
        let layouts = [Layout::single(), Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_ep(2)];
        let e = candle_cp_tests::lora_ref::merged_generation_agrees(&cfg, &full, &ids(64)?, &layouts)?;
        println!("{style:?}: merged adapters decode alike, logits within {e:.1e}");
    }
    Ok(())
}

/// A transformers 4 adapter (every expert's `gate_proj`, `up_proj`, `down_proj` and the router
/// `gate` as modules, rank 2, alpha 6) as PEFT converts it for transformers 5's fused experts
/// and writes it again: `target_parameters` `gate_up_proj`, `down_proj`, `gate.weight` (bare, as
/// the conversion names them); gate_up_proj's wrapper of rank 4 (`rank_pattern` /
/// `alpha_pattern` `.*\.gate_up_proj`: 4 / 12, the same scale), its `A` gate's rows then up's
/// per expert and its `B` block-diagonal; down_proj's stacked; the router's as it was. Written
/// here element by element from the transformers 4 adapter's factors; read back, it is the same
/// model: merged weights within 1e-6, logits and loss on one device and over zigzag 2 × TP 2 +
/// SP and EP 2 equal the transformers 4 adapter's.
#[test]
fn a_transformers_4_adapter_converted_by_peft_reads_as_the_same_model() -> Result<()> {
    for style in [MoeStyle::Qwen3Moe, MoeStyle::Mixtral] {
        converted_by_peft(style)?;
    }
    Ok(())
}

fn converted_by_peft(style: MoeStyle) -> Result<()> {
    let (base, mut full) = moe_model(style, None)?;
    let m = module(&base);
    // (Qwen3-MoE's dense layer 0 left out: PEFT's conversion moves gate_proj, up_proj, down_proj
    // to the experts' parameters, so a dense layer's would not be adapted after it)
    let layers = (style == MoeStyle::Qwen3Moe).then(|| vec![1]);
    let spec4 = LoraSpec::new(2, 6.0, &["q_proj", "gate", "gate_proj", "up_proj", "down_proj"])?.with_layers(layers.clone());
    let cfg4 = base.clone().with_lora(Some(spec4.clone()));
    for (i, s) in param_specs(&cfg4).into_iter().filter(|s| s.is_lora()).enumerate() {
        full.insert(s.name.clone(), candle_cp_ops::oracle::randn(4300 + i as u64, &s.shape, if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 })?.to_dtype(DType::F32)?);
    }
    let (adapters4, weights) = split(&full);
    // PEFT's converted file, from the stacked transformers 4 factors
    let sparse: Vec<usize> = (0..base.num_hidden_layers).filter(|&l| base.is_moe_layer(l)).collect();
    let file = peft_converted(&base, &adapters4, 2)?;
    let dir = std::env::temp_dir().join(format!("candle-cp-lora-converted-{style:?}-{}", std::process::id()));
    let config = serde_json::json!({
        "peft_type": "LORA", "peft_version": "0.19.1", "r": 2, "lora_alpha": 6, "lora_dropout": 0.0,
        "target_modules": ["q_proj"], "target_parameters": ["down_proj", "gate.weight", "gate_up_proj"],
        "rank_pattern": {".*\\.gate_up_proj": 4}, "alpha_pattern": {".*\\.gate_up_proj": 12},
        "layers_to_transform": layers, "base_model_name_or_path": "base", "use_dora": false, "use_rslora": false,
    });
    write_adapter(&dir, file, &config)?;
    // read as this model holds it
    let (spec5, tensors) = load_peft_adapter(&dir)?;
    let cfg5 = base.clone().with_lora(Some(spec5.clone()));
    cfg5.validate()?;
    let adapters5 = model_adapters(&cfg5, tensors)?;
    let names5: Vec<String> = param_specs(&cfg5).into_iter().filter(|s| s.is_lora()).map(|s| s.name).collect();
    assert_eq!(names5.len(), adapters5.len(), "{style:?}: {names5:?}");
    assert!(adapters5.contains_key(&format!("model.layers.{}.{m}.gate.lora_A.weight", sparse[0])), "{style:?}: the router's adapter");
    assert_eq!(adapters5[&format!("model.layers.{}.{m}.experts.gate_up_proj.lora_A.weight", sparse[0])].dims(), &[8, 4, 128]);
    // merged: the same weights
    let spec5 = cfg5.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
    // written again: PEFT's file, tensor for tensor
    let again = dir.join("again");
    save_peft_adapter(&again, &spec5, &adapters5, "base")?;
    let (a, b) = (candle_core::safetensors::load(again.join("adapter_model.safetensors"), &Device::Cpu)?, candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)?);
    let mut keys: Vec<&String> = a.keys().collect();
    keys.sort();
    let mut want: Vec<&String> = b.keys().collect();
    want.sort();
    assert_eq!(keys, want, "{style:?}: the names written again");
    for (n, t) in &a {
        assert_eq!((t - &b[n])?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "{style:?}: {n} written again");
    }
    let (mut m4, mut m5) = (weights.clone(), weights.clone());
    let n4 = merge_adapter(&mut m4, &spec4, &adapters4)?;
    let n5 = merge_adapter(&mut m5, &spec5, &adapters5)?;
    assert_eq!(n4, n5, "{style:?}: merged weights");
    let mut worst = 0f64;
    for (n, t) in &m4 {
        worst = worst.max((f64s(&m5[n])? - f64s(t)?)?.abs()?.max_all()?.to_scalar::<f64>()?);
    }
    assert!(worst < 1e-6, "{style:?}: the converted adapter merges {worst} away");
    let moved = (f64s(&m4[&format!("model.layers.{}.{m}.gate.weight", sparse[0])])? - f64s(&weights[&format!("model.layers.{}.{m}.gate.weight", sparse[0])])?)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(moved > 1e-3, "{style:?}: the router's adapter moves it by only {moved}");
    // run: the same logits and loss
    let mut full5 = weights.clone();
    full5.extend(adapters5);
    let ids = ids(64)?;
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Layout::cp(CpKind::Ring, 2).with_ep(2)] {
        let a = run_layout_recompute(&full, &cfg4, &ids, layout, &Device::Cpu, false)?;
        let b = run_layout_recompute(&full5, &cfg5, &ids, layout, &Device::Cpu, false)?;
        let d = (f64s(&a.logits)? - f64s(&b.logits)?)?.abs()?.max_all()?.to_scalar::<f64>()?;
        println!("{style:?} {layout}: PEFT's converted adapter vs the transformers 4 one: logits {d:.1e}, loss {:.1e}", (a.loss - b.loss).abs());
        assert!(d < 1e-5 && (a.loss - b.loss).abs() < 1e-6, "{style:?} {layout}: logits {d}, loss {} vs {}", a.loss, b.loss);
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
