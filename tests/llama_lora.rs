//! LoRA adapters in the Llama model, on parallel layouts, against references they must equal:
//!
//! - `B = 0` (how adapters start): the model is the oracle's (`tests/data/oracle/tiny-llama`,
//!   float64), and the adapters' gradients follow from the oracle's weight gradients by the
//!   chain rule: `dB = s·dW·Aᵀ`, `dA = s·Bᵀ·dW = 0`.
//! - `B ≠ 0`: the model is the dense model with merged weights `W + s·B·A` (run on one device),
//!   `dA = s·Bᵀ·dW'` and `dB = s·dW'·Aᵀ` from its weight gradients `dW'`.
//!
//! Adapters on all seven projections; TP splits them as candle-cp-nn's `lora` module says
//! (K/V heads replicated over TP ranks at TP 4 and 8).

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::lora::TARGETS;
use candle_cp_llama::verify::{load_reference, run_layout, LayoutRun};
use candle_cp_llama::{hf::load_safetensors_dir, param_specs, LlamaConfig, LoraSpec};
use std::collections::HashMap;

const RANK: usize = 4;
const ALPHA: f64 = 6.0;

fn dir() -> std::path::PathBuf {
    candle_cp_tests::oracle_dir("tiny-llama")
}

/// The oracle's weights plus adapters: `A` seeded, `B` zero or seeded (`b_scale`).
fn with_adapters(cfg: &LlamaConfig, full: &HashMap<String, Tensor>, b_scale: f64) -> Result<HashMap<String, Tensor>> {
    let mut out = full.clone();
    for (i, s) in param_specs(cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        let t = if s.name.ends_with("lora_B.weight") && b_scale == 0.0 {
            Tensor::zeros(s.shape.as_slice(), DType::F32, &Device::Cpu)?
        } else {
            let sd = if s.name.ends_with("lora_B.weight") { b_scale } else { 0.2 };
            candle_cp_ops::oracle::randn(900 + i as u64, &s.shape, sd as f32)?.to_dtype(DType::F32)?
        };
        out.insert(s.name, t);
    }
    Ok(out)
}

/// The adapted weights' names: (weight, its A, its B).
fn adapted(cfg: &LlamaConfig) -> Vec<(String, String, String)> {
    param_specs(cfg)
        .into_iter()
        .filter_map(|s| {
            let base = s.name.strip_suffix(".lora_A.weight")?.to_string();
            Some((format!("{base}.weight"), s.name.clone(), format!("{base}.lora_B.weight")))
        })
        .collect()
}

use candle_cp_tests::lora_ref::{f64s, rel};

/// The adapters' gradients the chain rule gives from weight gradients `dw` (by weight name):
/// `dA = s·Bᵀ·dW`, `dB = s·dW·Aᵀ`, by adapter name.
fn chain_rule(cfg: &LlamaConfig, weights: &HashMap<String, Tensor>, dw: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let s = ALPHA / RANK as f64;
    let mut out = HashMap::new();
    for (w, a, b) in adapted(cfg) {
        let g = f64s(&dw[&w])?;
        out.insert(a.clone(), (f64s(&weights[&b])?.t()?.matmul(&g)? * s)?);
        out.insert(b, (g.matmul(&f64s(&weights[&a])?.t()?)? * s)?);
    }
    Ok(out)
}

/// Every adapter gradient of `run` against `want`; logits against `logits`: the worst
/// (logits abs, gradient rel) and the adapter it was on.
fn check(what: &str, run: &LayoutRun, logits: &Tensor, want: &HashMap<String, Tensor>, grad_tol: f64) -> Result<()> {
    let e_logits = (f64s(&run.logits)? - f64s(logits)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    let got: HashMap<&String, &Tensor> = run.grads.iter().map(|(n, g)| (n, g)).collect();
    let (mut worst, mut at) = (0f64, String::new());
    for (n, w) in want {
        let e = rel(got[n], w)?;
        if e > worst {
            (worst, at) = (e, n.clone());
        }
    }
    println!("{what}: logits {e_logits:.2e}, adapter gradients {worst:.2e} ({at}), rank spread {:.1e}", run.grad_spread);
    assert!(e_logits < 1e-5, "{what}: logits off by {e_logits}");
    assert!(run.grad_spread < 1e-6, "{what}: the ranks' adapter gradients differ by {}", run.grad_spread);
    assert_eq!(run.grads.len(), want.len(), "{what}: the adapters' gradients, and only theirs");
    assert!(worst < grad_tol, "{what}: {at} off by {worst} (relative)");
    Ok(())
}

fn layouts() -> Vec<Layout> {
    vec![
        Layout::single(),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
        Layout::cp(CpKind::Ulysses, 2).with_tp(2, false),
        Layout::single().with_tp(4, true),
        Layout::two_d(2, 2),
    ]
}

/// `B = 0`: logits equal the float64 oracle's, `dB = s·dW·Aᵀ` of its weight gradients
/// (relative 5e-5, the README's gradient bound), `dA = 0`, on five layouts.
#[test]
fn fresh_adapters_follow_the_oracle_on_every_layout() -> Result<()> {
    let base = LlamaConfig::from_file(dir().join("config.json"))?;
    let cfg = base.clone().with_lora(Some(LoraSpec::new(RANK, ALPHA, &TARGETS)?));
    let reference = load_reference(dir().join("reference.safetensors"))?;
    let full = with_adapters(&cfg, &load_safetensors_dir(&dir(), &Device::Cpu)?, 0.0)?;
    let oracle_dw: HashMap<String, Tensor> = reference.grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
    let want = chain_rule(&cfg, &full, &oracle_dw)?;
    assert!(want.iter().filter(|(n, _)| n.ends_with("lora_A.weight")).all(|(_, g)| g.abs().and_then(|a| a.max_all()?.to_scalar::<f64>()).is_ok_and(|m| m == 0.0)));
    on_every_layout("B = 0", &full, &cfg, &reference.input_ids, (reference.loss, &reference.logits), &want, 5e-5)
}

/// [`check`] on every layout of [`layouts`], the loss within 5e-6 of `loss`.
fn on_every_layout(what: &str, full: &HashMap<String, Tensor>, cfg: &LlamaConfig, ids: &Tensor, (loss, logits): (f64, &Tensor), want: &HashMap<String, Tensor>, grad_tol: f64) -> Result<()> {
    for layout in layouts() {
        let run = run_layout(full, cfg, ids, layout, &Device::Cpu)?;
        assert!((run.loss - loss).abs() < 5e-6, "{layout}: loss {} vs {loss}", run.loss);
        check(&format!("{layout} ({what})"), &run, logits, want, grad_tol)?;
    }
    Ok(())
}

/// `B ≠ 0`: logits equal the merged dense model's (`W + s·B·A`, one device), the adapters'
/// gradients its weight gradients through the chain rule (relative 1e-4), on five layouts.
#[test]
fn trained_adapters_equal_the_merged_model_on_every_layout() -> Result<()> {
    let base = LlamaConfig::from_file(dir().join("config.json"))?;
    let cfg = base.clone().with_lora(Some(LoraSpec::new(RANK, ALPHA, &TARGETS)?));
    let reference = load_reference(dir().join("reference.safetensors"))?;
    let full = with_adapters(&cfg, &load_safetensors_dir(&dir(), &Device::Cpu)?, 0.05)?;
    // the merged model: W + s·B·A, no adapters
    let (adapters, mut merged): (HashMap<String, Tensor>, HashMap<String, Tensor>) = full.clone().into_iter().partition(|(n, _)| candle_cp_llama::lora::is_lora_name(n));
    let spec = cfg.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
    assert_eq!(candle_cp_llama::lora::merge_adapter(&mut merged, &spec, &adapters)?, 14);
    let dense = run_layout(&merged, &base, &reference.input_ids, Layout::single(), &Device::Cpu)?;
    let dw: HashMap<String, Tensor> = dense.grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
    let want = chain_rule(&cfg, &full, &dw)?;
    on_every_layout("B ≠ 0", &full, &cfg, &reference.input_ids, (dense.loss, &dense.logits), &want, 1e-4)
}

/// DoRA on every projection (`use_dora`; magnitudes off the rows' norms, `B ≠ 0`): logits equal
/// the merged dense model's (`m / ‖W + s·B·A‖ ⊙ (W + s·B·A)`, one device), the factors' and the
/// magnitudes' gradients its weight gradients through DoRA's chain rule (the norm a constant,
/// `candle_cp_tests::lora_ref`), relative 1e-4, on five layouts (o's and down's magnitudes
/// replicated over TP, their rows' norms summed over it); merged into the weights for generation
/// (`Llama::with_adapters_merged`), DoRA and plain LoRA decode the adapted model's tokens.
#[test]
fn dora_equals_the_merged_model_on_every_layout() -> Result<()> {
    let base = LlamaConfig::from_file(dir().join("config.json"))?;
    let cfg = base.clone().with_lora(Some(LoraSpec::new(RANK, ALPHA, &TARGETS)?.with_dora(true)));
    let reference = load_reference(dir().join("reference.safetensors"))?;
    let mut full = with_adapters(&cfg, &load_safetensors_dir(&dir(), &Device::Cpu)?, 0.05)?;
    candle_cp_tests::lora_ref::set_magnitudes(&cfg, &mut full, 950)?;
    let (adapters, mut merged): (HashMap<String, Tensor>, HashMap<String, Tensor>) = full.clone().into_iter().partition(|(n, _)| candle_cp_llama::lora::is_lora_name(n));
    assert_eq!(adapters.len(), 3 * 14, "A, B and a magnitude per adapted weight");
    let spec = cfg.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
    assert_eq!(candle_cp_llama::lora::merge_adapter(&mut merged, &spec, &adapters)?, 14);
    let dense = run_layout(&merged, &base, &reference.input_ids, Layout::single(), &Device::Cpu)?;
    let dw: HashMap<String, Tensor> = dense.grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
    let want = candle_cp_tests::lora_ref::adapter_grads(&cfg, &full, &dw)?;
    // the magnitudes bind: plain LoRA's merged model gives other logits
    let mut plain = full.clone().into_iter().filter(|(n, _)| !candle_cp_llama::lora::is_lora_name(n)).collect::<HashMap<_, _>>();
    candle_cp_llama::lora::merge_adapter(&mut plain, &spec.clone().with_dora(false), &adapters)?;
    let lora = run_layout(&plain, &base, &reference.input_ids, Layout::single(), &Device::Cpu)?;
    assert!((lora.loss - dense.loss).abs() > 1e-4, "DoRA's magnitudes move the loss ({} vs {})", lora.loss, dense.loss);
    on_every_layout("DoRA", &full, &cfg, &reference.input_ids, (dense.loss, &dense.logits), &want, 1e-4)?;
    // merged into the weights for generation (row-parallel DoRA norms over TP): the same tokens
    let ids = reference.input_ids.narrow(1, 0, 24)?;
    let layouts = [Layout::single(), Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_tp(2, false)];
    for c in [cfg.clone(), base.clone().with_lora(Some(LoraSpec::new(RANK, ALPHA, &TARGETS)?))] {
        let e = candle_cp_tests::lora_ref::merged_generation_agrees(&c, &full, &ids, &layouts)?;
        println!("merged adapters (DoRA {}): logits within {e:.1e}", c.lora.as_ref().is_some_and(|l| l.dora));
    }
    Ok(())
}

/// `modules_to_save` (PEFT: modules trained whole beside the adapters): with the embedding and
/// the head trained too and fresh adapters (`B = 0`), the model is the oracle's, the embedding's
/// and the head's gradients are the oracle's (vocabulary-parallel over TP), the adapters' the
/// chain rule's, on five layouts; the PEFT file holds them under their own names and reads back
/// the same; a module that cannot be trained whole is refused by name, as is `lm_head` of a
/// model whose head is tied to its embedding.
#[test]
fn modules_to_save_train_with_the_adapters_on_every_layout() -> Result<()> {
    let base = LlamaConfig::from_file(dir().join("config.json"))?;
    let spec = LoraSpec::new(RANK, ALPHA, &TARGETS)?.with_modules_to_save(&["lm_head", "embed_tokens"])?;
    assert_eq!(spec.modules_to_save, ["embed_tokens", "lm_head"]);
    let cfg = base.clone().with_lora(Some(spec.clone()));
    let trained: Vec<String> = candle_cp_llama::trainable_specs(&cfg).into_iter().map(|s| s.name).collect();
    assert!(trained.contains(&"model.embed_tokens.weight".to_string()) && trained.contains(&"lm_head.weight".to_string()), "{trained:?}");
    let reference = load_reference(dir().join("reference.safetensors"))?;
    let full = with_adapters(&cfg, &load_safetensors_dir(&dir(), &Device::Cpu)?, 0.0)?;
    let oracle_dw: HashMap<String, Tensor> = reference.grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
    let mut want = chain_rule(&cfg, &full, &oracle_dw)?;
    for n in ["model.embed_tokens.weight", "lm_head.weight"] {
        want.insert(n.to_string(), oracle_dw[n].clone());
    }
    on_every_layout("modules_to_save", &full, &cfg, &reference.input_ids, (reference.loss, &reference.logits), &want, 5e-5)?;
    // the PEFT file: the modules under their own names, read back bit for bit
    let tmp = std::env::temp_dir().join(format!("candle-cp-mts-{}", std::process::id()));
    let adapters: HashMap<String, Tensor> = full.iter().filter(|(n, _)| spec.trains(n)).map(|(n, t)| (n.clone(), t.clone())).collect();
    candle_cp_llama::lora::save_peft_adapter(&tmp, &spec, &adapters, "base")?;
    let file = candle_core::safetensors::load(tmp.join("adapter_model.safetensors"), &Device::Cpu)?;
    assert!(file.contains_key("base_model.model.model.embed_tokens.weight") && file.contains_key("base_model.model.lm_head.weight"));
    let (read_spec, read) = candle_cp_llama::lora::load_peft_adapter(&tmp)?;
    assert_eq!(read_spec, spec);
    assert_eq!(read.len(), adapters.len());
    assert_eq!((&read["lm_head.weight"] - &full["lm_head.weight"])?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    std::fs::remove_dir_all(&tmp).ok();
    // refusals
    let e = LoraSpec::new(RANK, ALPHA, &TARGETS)?.with_modules_to_save(&["norm"]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("'norm'") && e.contains("embed_tokens"), "{e}");
    let mut tied = cfg.clone();
    tied.tie_word_embeddings = true;
    let e = tied.validate().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("lm_head") && e.contains("tie_word_embeddings"), "{e}");
    Ok(())
}
