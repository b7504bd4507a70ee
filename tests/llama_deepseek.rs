//! DeepSeek-V3 (`model_type` `deepseek_v3`): multi-head latent attention in every layer and
//! GLM-4.5's mixture of experts on layer 1.
//!
//! - The tiny DeepSeek-V3 (`mla_ref.rs`: 8 heads, q rank 32, KV rank 24, nope 12, RoPE 8
//!   interleaved, v 10, YaRN with mscale_all_dim) against the float64 reference written from
//!   `DeepseekV3Attention` (`mla_ref.rs`, called by `dense_llama.rs`): one device, ring,
//!   zigzag, striped, Ulysses, 2-D, TP with and without SP, zigzag × TP + SP with recomputed
//!   layers, expert parallelism, DP — logits, loss and every gradient within the oracle's
//!   tolerances. Values wider than the query (`v = 24`), one `q_proj` (`q_lora_rank` null) and
//!   RoPE without interleaving on layouts too; the interleaving, the mscale and the latent
//!   norms each bind.
//! - Generation: cached decoding equals the full forward; CP, TP and EP decode the single
//!   device's tokens.
//! - Checkpoints: DeepSeek-V3's names and config.json written, read back bit for bit, whole and
//!   over TP 2; the multi-token-prediction layer skipped on load.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::config::deepseek::Mla;
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{compare, load_reference, run_layout_recompute, Tolerances};
use candle_cp_llama::{load_hf, save_hf, Arch};
use candle_cp_tests::dense_llama::{cached_generation_agrees, max_abs, reference, reference_rows, sharded_load_and_save};
use candle_cp_tests::mla_ref::deepseek_model;

const T: usize = 64;

/// The tests' latent attention: q rank 32, KV rank 24, nope 12, RoPE 8 interleaved, v 10.
const MLA: Mla = Mla { q_lora_rank: Some(32), kv_lora_rank: 24, qk_nope_head_dim: 12, qk_rope_head_dim: 8, v_head_dim: 10, rope_interleave: true };

fn ids(t: usize) -> Result<Tensor> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, t)?.contiguous()
}

fn io<E: std::fmt::Display>(e: E) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The checkpoint in `dir` reads back as `cfg` with `full`'s tensors, bit for bit.
fn reads_back(dir: &std::path::Path, full: &std::collections::HashMap<String, Tensor>, cfg: &candle_cp_llama::LlamaConfig) -> Result<()> {
    let (back, back_cfg) = load_hf(dir, &Device::Cpu, DType::F32)?;
    assert_eq!(&back_cfg, cfg);
    let got = candle_cp_llama::params::varmap_tensors(&back)?;
    assert_eq!(got.len(), full.len());
    for (k, t) in full {
        assert_eq!(max_abs(&got[k], t)?, 0.0, "{k}");
    }
    Ok(())
}

/// The model on the first `T` oracle ids on each `(layout, recompute)` against the float64
/// reference: every parameter compared, all pass.
fn check_layouts(label: &str, full: &std::collections::HashMap<String, Tensor>, cfg: &candle_cp_llama::LlamaConfig, layouts: &[(Layout, bool)]) -> Result<()> {
    let ids = ids(T)?;
    check_layouts_against(label, full, cfg, &ids, &reference(full, cfg, &ids)?, layouts)
}

/// [`check_layouts`] on `ids` against `want`.
fn check_layouts_against(label: &str, full: &std::collections::HashMap<String, Tensor>, cfg: &candle_cp_llama::LlamaConfig, ids: &Tensor, want: &candle_cp_llama::verify::Reference, layouts: &[(Layout, bool)]) -> Result<()> {
    for &(layout, recompute) in layouts {
        let rep = compare(&run_layout_recompute(full, cfg, ids, layout, &Device::Cpu, recompute)?, want, Tolerances::default())?;
        println!("{label} {layout} (recompute {recompute}): logits {:.1e} loss {:.1e} grad rel {:.1e} ({})", rep.logits_abs, rep.loss_abs, rep.grad_rel_max, rep.worst_param);
        assert_eq!(rep.grad_rel.len(), want.grads.len(), "{label} {layout}: every parameter compared");
        assert!(rep.pass(), "{label} {layout}: {rep:?}");
    }
    Ok(())
}

/// Every kind of layout, recomputed layers, expert parallelism and DP give the reference's
/// results; the interleaving, the mscale and the latent norms each move them.
#[test]
fn deepseek_v3_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full) = deepseek_model(MLA)?;
    assert_eq!((cfg.arch(), cfg.head_dim, cfg.rope_dim(), cfg.num_key_value_heads, cfg.moe_layers()), (Arch::DeepseekV3, 20, 8, 8, 1));
    let ids = ids(T)?;
    let want = reference(&full, &cfg, &ids)?;
    // each part binds: the reference without it moves the logits
    let mut flat_norm = full.clone();
    let kvn = "model.layers.0.self_attn.kv_a_layernorm.weight";
    flat_norm.insert(kvn.into(), full[kvn].ones_like()?);
    let mut plain = cfg.clone();
    plain.rope_scaling = candle_cp_llama::RopeScaling::Default;
    let no_interleave = cfg.clone().with_mla(Some(Mla { rope_interleave: false, ..MLA }));
    for (what, c, f) in [("the interleaved RoPE order", &no_interleave, &full), ("YaRN and its mscale", &plain, &full), ("kv_a_layernorm", &cfg, &flat_norm)] {
        let moved = max_abs(&reference(f, c, &ids)?.logits, &want.logits)?;
        assert!(moved > 1e-3, "{what} moves the logits by only {moved:.1e}");
    }
    let layouts = [
        (Layout::single(), false),
        (Layout::cp(CpKind::Ring, 4), false),
        (Layout::cp(CpKind::Zigzag, 4), false),
        (Layout::cp(CpKind::Striped, 2), false),
        (Layout::cp(CpKind::Ulysses, 2), false),
        (Layout::two_d(2, 2), false),
        (Layout::single().with_tp(2, false), false),
        (Layout::single().with_tp(4, true), false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true),
        (Layout::cp(CpKind::Zigzag, 4).with_ep(4), false),
        (Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2), true),
    ];
    check_layouts_against("deepseek_v3", &full, &cfg, &ids, &want, &layouts)?;
    // DP 2 over two rows
    let two = Tensor::cat(&[&ids, &ids], 0)?;
    check_layouts_against("deepseek_v3", &full, &cfg, &two, &reference_rows(&want)?, &[(Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_ep(2), false)])
}

/// The other forms: values wider than the query and key (the query and key padded), one
/// `q_proj` (`q_lora_rank` null) with RoPE not interleaved.
#[test]
fn deepseek_v3_forms_on_layouts() -> Result<()> {
    let wide_v = Mla { v_head_dim: 24, ..MLA };
    let (cfg, full) = deepseek_model(wide_v)?;
    assert_eq!(cfg.head_dim, 24);
    check_layouts("deepseek_v3 v 24", &full, &cfg, &[(Layout::single(), false), (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), false), (Layout::cp(CpKind::Ulysses, 2), false)])?;
    let (cfg, full) = deepseek_model(Mla { q_lora_rank: None, rope_interleave: false, ..MLA })?;
    assert!(full.contains_key("model.layers.1.self_attn.q_proj.weight") && !full.contains_key("model.layers.1.self_attn.q_a_proj.weight"));
    check_layouts("deepseek_v3 q_proj", &full, &cfg, &[(Layout::single(), false), (Layout::two_d(2, 2), false), (Layout::single().with_tp(2, false), false)])
}

/// Cached decoding (the latent rows cached, the absorbed query) equals the full forward; CP,
/// TP and EP decode the single device's tokens; the cache holds `rkv + rope` values per token
/// and layer, once.
#[test]
fn deepseek_v3_generation() -> Result<()> {
    let (cfg, full) = deepseek_model(MLA)?;
    let layouts = [Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true), Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2)];
    cached_generation_agrees(&cfg, &full, &ids(32)?, &layouts)?;
    let bytes = candle_cp_comm::run_ranks(1, |g| {
        let ctx = candle_cp_llama::ParallelCtx::new(g, Layout::single())?;
        let vm = candle_cp_tests::varmap_of(&full)?;
        let m = candle_cp_llama::Llama::new(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
        Ok(m.prefill(&ids(32)?)?.0.bytes())
    });
    // 2 layers, B = 1, 32 rows of [c | kr] = 24 + 8 values, held once (keys and values), f32
    assert_eq!(bytes.into_iter().collect::<Result<Vec<_>>>()?, vec![2 * 32 * (24 + 8) * 4]);
    Ok(())
}

/// Checkpoints in DeepSeek-V3's names and config.json: written, read back bit for bit (config
/// included), a multi-token-prediction layer beside them skipped, whole and over TP 2.
#[test]
fn deepseek_v3_checkpoints() -> Result<()> {
    let (cfg, full) = deepseek_model(MLA)?;
    let h = cfg.hidden_size;
    let tmp = |tag: &str| std::env::temp_dir().join(format!("candle-cp-deepseek-{tag}-{}", std::process::id()));
    let dir = tmp("saved");
    save_hf(&dir, &candle_cp_tests::varmap_of(&full)?, &cfg)?;
    let mut names = load_safetensors_dir(&dir, &Device::Cpu)?;
    let p = "model.layers.1.self_attn.";
    for (k, shape) in [("q_a_proj.weight", vec![32, h]), ("q_a_layernorm.weight", vec![32]), ("q_b_proj.weight", vec![8 * 20, 32]), ("kv_a_proj_with_mqa.weight", vec![24 + 8, h]), ("kv_a_layernorm.weight", vec![24]), ("kv_b_proj.weight", vec![8 * 22, 24]), ("o_proj.weight", vec![h, 8 * 10])] {
        assert_eq!(names.get(&format!("{p}{k}")).map(|t| t.dims().to_vec()), Some(shape), "{k}");
    }
    assert!(!names.keys().any(|k| k.contains("k_proj") || k.contains("v_proj.")), "no k_proj / v_proj");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).map_err(io)?).map_err(io)?;
    assert_eq!(
        (config["architectures"][0].as_str(), config["model_type"].as_str(), config["head_dim"].as_u64(), config["kv_lora_rank"].as_u64(), config["q_lora_rank"].as_u64(), config["v_head_dim"].as_u64(), config["rope_interleave"].as_bool()),
        (Some("DeepseekV3ForCausalLM"), Some("deepseek_v3"), Some(8), Some(24), Some(32), Some(10), Some(true))
    );
    assert!(config.get("use_qk_norm").is_none() && config.get("partial_rotary_factor").is_none());
    reads_back(&dir, &full, &cfg)?;
    // a multi-token-prediction layer after the last one (layer 2 of 2): skipped
    let mtp = tmp("mtp");
    std::fs::create_dir_all(&mtp).map_err(io)?;
    names.insert("model.layers.2.eh_proj.weight".into(), Tensor::zeros((h, 2 * h), DType::F32, &Device::Cpu)?);
    names.insert("model.layers.2.self_attn.kv_b_proj.weight".into(), Tensor::zeros((8 * 22, 24), DType::F32, &Device::Cpu)?);
    candle_core::safetensors::save(&names, mtp.join("model.safetensors"))?;
    std::fs::copy(dir.join("config.json"), mtp.join("config.json")).map_err(io)?;
    let (back, _) = load_hf(&mtp, &Device::Cpu, DType::F32)?;
    assert_eq!(candle_cp_llama::params::varmap_tensors(&back)?.len(), full.len());
    let bytes = std::fs::read(dir.join("model.safetensors")).map_err(io)?;
    let out = tmp("sharded");
    sharded_load_and_save(&mtp, &full, &cfg, Layout::single().with_tp(2, true), &out, &bytes)?;
    for d in [dir, mtp, out] {
        let _ = std::fs::remove_dir_all(d);
    }
    Ok(())
}

/// LoRA on every projection (PEFT's all-linear: the latent attention's four, o_proj, the dense
/// MLP, the experts, the shared experts, the router) equals the merged model's float64
/// reference on one device, TP with and without SP, TP × CP (recomputed too) and expert
/// parallelism, the adapters' gradients by the chain rule; the down-projections' adapters bind;
/// merged for generation they decode the adapted model's tokens.
#[test]
fn deepseek_v3_lora_equals_the_merged_model() -> Result<()> {
    lora_equals_the_merged_model(false)
}

/// [`deepseek_v3_lora_equals_the_merged_model`] with DoRA (a magnitude per output row, the
/// replicated down-projections' whole on each rank): against the merged model
/// `m / ‖W + s·B·A‖ ⊙ (W + s·B·A)`, the magnitudes' gradients by DoRA's chain rule.
#[test]
fn deepseek_v3_dora_equals_the_merged_model() -> Result<()> {
    lora_equals_the_merged_model(true)
}

fn lora_equals_the_merged_model(dora: bool) -> Result<()> {
    use candle_cp_llama::lora::{is_lora_name, merge_adapter, ALL_LINEAR};
    use candle_cp_llama::{param_specs, LoraSpec};
    use candle_cp_tests::lora_ref::rel;
    let (base, mut full) = deepseek_model(MLA)?;
    let cfg = base.clone().with_lora(Some(LoraSpec::new(4, 6.0, &ALL_LINEAR)?.with_dora(dora)));
    for (i, s) in param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        let sd = if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 };
        full.insert(s.name.clone(), candle_cp_ops::oracle::randn(2300 + i as u64, &s.shape, sd)?.to_dtype(DType::F32)?);
    }
    if dora {
        candle_cp_tests::lora_ref::set_magnitudes(&cfg, &mut full, 2900)?;
    }
    let adapted: Vec<String> = param_specs(&cfg).iter().filter_map(|s| s.name.strip_suffix(".lora_A.weight").map(String::from)).filter(|n| n.starts_with("model.layers.0.self_attn.")).collect();
    assert_eq!(adapted.len(), 5, "q_a, q_b, kv_a, kv_b, o: {adapted:?}");
    let (adapters, weights): (std::collections::HashMap<String, Tensor>, std::collections::HashMap<String, Tensor>) = full.clone().into_iter().partition(|(n, _)| is_lora_name(n));
    let spec = cfg.lora.clone().ok_or_else(|| io("a LoRA config"))?;
    let mut merged = weights.clone();
    merge_adapter(&mut merged, &spec, &adapters)?;
    let ids = ids(T)?;
    let want = reference(&merged, &base, &ids)?;
    // the down-projections' adapters bind
    let down: std::collections::HashMap<String, Tensor> = adapters.iter().filter(|(n, _)| !n.contains("_a_proj")).map(|(n, t)| (n.clone(), t.clone())).collect();
    let mut without = weights.clone();
    merge_adapter(&mut without, &spec, &down)?;
    let moved = max_abs(&reference(&without, &base, &ids)?.logits, &want.logits)?;
    assert!(moved > 1e-3, "q_a_proj's and kv_a_proj_with_mqa's adapters move the logits by only {moved:.1e}");
    let want_g = candle_cp_tests::lora_ref::adapter_grads(&cfg, &full, &want.grads)?;
    for (layout, recompute) in [
        (Layout::single(), false),
        (Layout::single().with_tp(2, false), false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), false),
        (Layout::cp(CpKind::Ring, 2).with_tp(2, true), true),
        (Layout::cp(CpKind::Ulysses, 2).with_ep(2), false),
    ] {
        let run = run_layout_recompute(&full, &cfg, &ids, layout, &Device::Cpu, recompute)?;
        let e_logits = max_abs(&run.logits, &want.logits)?;
        let mut worst = (0f64, String::new());
        for (n, g) in &run.grads {
            let Some(w) = want_g.get(n) else { candle_core::bail!("{layout}: a gradient for {n}, which is no adapter") };
            let e = rel(g, w)?;
            if e > worst.0 {
                worst = (e, n.clone());
            }
        }
        println!("deepseek_v3 LoRA (DoRA {dora}) {layout} (recompute {recompute}): logits {e_logits:.1e} loss {:.1e} adapter grads {:.1e} ({}) spread {:.1e}", (run.loss - want.loss).abs(), worst.0, worst.1, run.grad_spread);
        assert_eq!(run.grads.len(), want_g.len(), "{layout}: every adapter's gradient, and only theirs");
        assert!(e_logits < 2e-5 && (run.loss - want.loss).abs() < 5e-6 && worst.0 < 2e-4 && run.grad_spread < 1e-6, "{layout}");
    }
    let e = candle_cp_tests::lora_ref::merged_generation_agrees(&cfg, &full, &ids.narrow(1, 0, 32)?.contiguous()?, &[Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true)])?;
    assert!(e < 1e-4, "{e}");
    // a PEFT adapter file: the latent projections' factors under PEFT's names, read back bit for bit
    let dir = std::env::temp_dir().join(format!("candle-cp-deepseek-lora-{dora}-{}", std::process::id()));
    candle_cp_llama::lora::save_peft_adapter(&dir, &spec, &adapters, "base")?;
    let file = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)?;
    for m in ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"] {
        let k = format!("base_model.model.model.layers.0.self_attn.{m}.lora_A.weight");
        assert!(file.contains_key(&k), "{k}");
    }
    let (read_spec, read) = candle_cp_llama::lora::load_peft_adapter(&dir)?;
    assert_eq!((read_spec.targets.clone(), read.len()), (spec.targets.clone(), adapters.len()));
    for (k, t) in &adapters {
        assert_eq!(max_abs(&read[k], t)?, 0.0, "{k}");
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// DeepSeek-V2 (`deepseek_v2`): the same latent attention (RoPE on interleaved pairs, the scale
/// without YaRN's mscale) with its softmax router chosen within groups by their best expert,
/// scaled and not renormalised — against the float64 reference on one device, zigzag 4, Ulysses
/// 2, TP 2 + SP × zigzag 2 (recomputed), EP 4; the group rule and the scale bind; generation on
/// CP and TP; its checkpoint and config.json round trip.
#[test]
fn deepseek_v2_on_layouts_and_checkpoints() -> Result<()> {
    use candle_cp_tests::mla_ref::deepseek_v2_model;
    let (cfg, full) = deepseek_v2_model(Mla { q_lora_rank: None, ..MLA })?;
    assert_eq!(cfg.arch(), Arch::DeepseekV2);
    assert!(!full.keys().any(|k| k.ends_with(candle_cp_llama::params::CORRECTION_BIAS)));
    let ids = ids(T)?;
    let want = reference(&full, &cfg, &ids)?;
    let m = cfg.moe.clone().ok_or_else(|| io("no experts"))?;
    let greedy = cfg.clone().with_moe(Some(candle_cp_llama::MoeConfig { groups: (1, 1), ..m.clone() }));
    let unscaled = cfg.clone().with_moe(Some(candle_cp_llama::MoeConfig { routed_scaling_factor: 1.0, ..m }));
    for (what, c) in [("the groups", &greedy), ("routed_scaling_factor", &unscaled)] {
        let moved = max_abs(&reference(&full, c, &ids)?.logits, &want.logits)?;
        assert!(moved > 1e-3, "{what} moves the logits by only {moved:.1e}");
    }
    check_layouts(
        "deepseek_v2",
        &full,
        &cfg,
        &[(Layout::single(), false), (Layout::cp(CpKind::Zigzag, 4), false), (Layout::cp(CpKind::Ulysses, 2), false), (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true), (Layout::cp(CpKind::Ring, 4).with_ep(4), false)],
    )?;
    cached_generation_agrees(&cfg, &full, &ids.narrow(1, 0, 32)?.contiguous()?, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true)])?;
    let dir = std::env::temp_dir().join(format!("candle-cp-deepseek-v2-{}", std::process::id()));
    save_hf(&dir, &candle_cp_tests::varmap_of(&full)?, &cfg)?;
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).map_err(io)?).map_err(io)?;
    assert_eq!(
        (config["architectures"][0].as_str(), config["topk_method"].as_str(), config["n_group"].as_u64(), config["q_lora_rank"].is_null(), config.get("rope_interleave").is_none()),
        (Some("DeepseekV2ForCausalLM"), Some("group_limited_greedy"), Some(4), true, true)
    );
    reads_back(&dir, &full, &cfg)?;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
