//! OLMo 2 and OLMo 3 (`model_type` `olmo2`, `olmo3`): norms after the attention and the MLP
//! instead of before, q and k RMSNorms over the whole projection (`[H·D]`, `[Hkv·D]`), OLMo 3's
//! sliding layers (which rotate unscaled when the config scales RoPE).
//!
//! The tiny-llama oracle's weights as OLMo's (no `input_layernorm`; its
//! `post_attention_layernorm` now after the attention; `q_norm`, `k_norm` and
//! `post_feedforward_layernorm` drawn away from ones so that each binds) on every kind of
//! layout — ring, zigzag, striped, Ulysses, 2-D, TP with and without SP (the q / k norms'
//! statistic summed over the TP ranks' heads, forward and backward), TP × CP, DP — give the
//! float64 reference's logits, loss and every gradient (`dense_llama.rs`) within the oracle's
//! tolerances; cached decode equals the full forward and CP / TP decode the same tokens;
//! checkpoints save as `Olmo2ForCausalLM` / `Olmo3ForCausalLM` and load back as the same config
//! and weights. TP 4 over the 2 KV heads (each replicated on two ranks, counted twice in the
//! k norm's all-reduced sum, as every head is) gives the reference too.
//!
//! EXAONE 4 (`exaone4`: OLMo 2's norms after the branches with Qwen3's head norms; here layer 0
//! sliding with a window of 40, layer 1 global without RoPE) gives the reference on every kind
//! of layout, decodes the same tokens and round-trips as `Exaone4ForCausalLM`.
//!
//! OLMoE (`olmoe`: the norms before the branches, the same q / k norms, 8 experts 48 wide, top
//! 2 not renormalised, on both layers, the load-balancing loss on) gives the reference on every
//! kind of layout and under expert parallelism, decodes the same tokens, and round-trips as
//! `OlmoeForCausalLM` with its experts per expert.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{load_reference, Reference, Tolerances};
use candle_cp_llama::{load_hf, save_hf, Arch, LlamaConfig, MoeConfig, Olmo, RopeScaling};
use candle_cp_tests::dense_llama::{max_abs, on_layouts, reference, reference_routed};
use std::collections::HashMap;

const T: usize = 256;

/// `n` values `1 + 0.4·sin(0.7·i + phase)`: a norm weight away from ones.
fn wavy(n: usize, phase: f64) -> Result<Tensor> {
    Tensor::from_vec((0..n).map(|i| (1.0 + 0.4 * (0.7 * i as f64 + phase).sin()) as f32).collect::<Vec<_>>(), n, &Device::Cpu)
}

/// The oracle's weights for `cfg` (a config of its shape): the tensors `cfg` has, without those
/// it lacks (the input norms of a model normalising after its branches), with the norms it adds
/// (q / k norms, the norm after the MLP) drawn away from ones; its input ids.
fn oracle_as(cfg: LlamaConfig) -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    cfg.validate()?;
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    let ids = load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, T)?.contiguous()?;
    let mut oracle = load_safetensors_dir(&dir, &Device::Cpu)?;
    let mut full = HashMap::new();
    for (i, s) in candle_cp_llama::param_specs(&cfg).into_iter().enumerate() {
        let t = match oracle.remove(&s.name) {
            Some(t) => t,
            None if s.shape.len() == 1 => wavy(s.shape[0], i as f64)?,
            None => candle_core::bail!("oracle_as: no oracle tensor for {} {:?}", s.name, s.shape),
        };
        full.insert(s.name, t);
    }
    Ok((cfg, full, ids))
}

/// The oracle as OLMo `o` (`f` shapes its config further): its weights without the input
/// norms, with the whole-projection q / k norms and the norm after the MLP; its input ids.
fn olmo(o: Olmo, f: impl Fn(LlamaConfig) -> LlamaConfig) -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    oracle_as(f(LlamaConfig::from_file(candle_cp_tests::oracle_dir("tiny-llama").join("config.json"))?.with_olmo(Some(o))))
}

/// OLMo 3 with layer 0 sliding (window 40) and layer 1 full, its RoPE scaled by YaRN (layer 0
/// rotates unscaled).
fn olmo3() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    olmo(Olmo::Olmo3, |c| {
        let yarn = RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: 64, beta_fast: 32.0, beta_slow: 1.0, attention_factor: None, mscale: None, mscale_all_dim: None, truncate: true };
        LlamaConfig { rope_scaling: yarn, ..c }.with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false]))
    })
}

/// The oracle as EXAONE 4: no input norms, the norms after the branches, head norms `[D]`
/// (seeded away from ones), layer 0 sliding (40), layer 1 global and NoPE.
fn exaone4() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    let base = LlamaConfig::from_file(candle_cp_tests::oracle_dir("tiny-llama").join("config.json"))?;
    oracle_as(base.with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false])).with_exaone4(true))
}

/// The oracle's shape as OLMoE: both MLPs 8 experts 48 wide, top 2 (not renormalised, as
/// OlmoeConfig's default), the load-balancing loss at 0.3; the oracle's attention weights, the
/// rest seeded (the router's weights far from a tie).
fn olmoe() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    let mut moe = MoeConfig::new(8, 2, 48);
    (moe.output_router_logits, moe.router_aux_loss_coef) = (true, 0.3);
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?.with_moe(Some(moe)).with_olmo(Some(Olmo::Olmoe));
    cfg.validate()?;
    let ids = load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, T)?.contiguous()?;
    let oracle = load_safetensors_dir(&dir, &Device::Cpu)?;
    let mut full = HashMap::new();
    for spec in candle_cp_llama::param_specs(&cfg) {
        let name = &spec.name;
        let t = match oracle.get(name) {
            Some(t) => t.clone(),
            None if name.ends_with("_norm.weight") => ((candle_cp_tests::rand_t(23, name, &spec.shape)? * 0.5)? + 1.0)?,
            None if name.ends_with(".gate.weight") => (candle_cp_tests::rand_t(37, name, &spec.shape)? * 0.1)?,
            None => (candle_cp_tests::rand_t(41, name, &spec.shape)? * 0.08)?,
        };
        full.insert(name.clone(), t);
    }
    Ok((cfg, full, ids))
}

/// Every kind of layout (TP 4 replicating the 2 KV heads too), and DP on two rows, against
/// `want`; OLMo's norms compared.
fn on_every_layout(label: &str, full: &HashMap<String, Tensor>, cfg: &LlamaConfig, ids: &Tensor, want: &Reference) -> Result<()> {
    let more = [Layout::cp(CpKind::Ulysses, 2).with_tp(2, false), Layout::single().with_tp(4, true), Layout::cp(CpKind::Zigzag, 2).with_tp(4, false)];
    let olmo_norms = |n: &str| n.contains("q_norm") || n.contains("k_norm") || n.contains("post_feedforward_layernorm");
    candle_cp_tests::dense_llama::on_every_layout(label, (full, cfg, ids, want), &more, (&olmo_norms, 3 * cfg.num_hidden_layers))
}

/// OLMo 2 on every kind of layout: the reference; the norms after the branches and the
/// whole-projection norms each move the logits.
#[test]
fn olmo2_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = olmo(Olmo::Olmo2, |c| c)?;
    assert_eq!(cfg.arch(), Arch::Olmo2);
    let want = reference(&full, &cfg, &ids)?;
    for (what, name) in [("q_norm", "model.layers.0.self_attn.q_norm.weight"), ("k_norm", "model.layers.1.self_attn.k_norm.weight"), ("post_feedforward_layernorm", "model.layers.0.post_feedforward_layernorm.weight")] {
        let mut other = full.clone();
        other.insert(name.to_string(), Tensor::ones(full[name].dims(), DType::F32, &Device::Cpu)?);
        let moved = max_abs(&reference(&other, &cfg, &ids)?.logits, &want.logits)?;
        assert!(moved > 100.0 * Tolerances::default().logits_abs, "{what} moves the logits by only {moved:.1e}");
    }
    on_every_layout("olmo2", &full, &cfg, &ids, &want)
}

/// OLMo 3 (a sliding layer that rotates unscaled beside a full one under YaRN) on every kind
/// of layout: the reference.
#[test]
fn olmo3_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = olmo3()?;
    assert_eq!(cfg.arch(), Arch::Olmo3);
    assert!(cfg.layer_rope_is_local(0) && !cfg.layer_rope_is_local(1));
    let want = reference(&full, &cfg, &ids)?;
    on_every_layout("olmo3", &full, &cfg, &ids, &want)
}

/// EXAONE 4 on every kind of layout: the reference; the global layer's NoPE moves the logits.
#[test]
fn exaone4_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = exaone4()?;
    assert_eq!((cfg.arch(), cfg.layer_rotates(0), cfg.layer_rotates(1)), (Arch::Exaone4, true, false));
    let want = reference(&full, &cfg, &ids)?;
    let rotating = reference(&full, &cfg.clone().with_nope_layers(None), &ids)?;
    let moved = max_abs(&rotating.logits, &want.logits)?;
    assert!(moved > 100.0 * Tolerances::default().logits_abs, "NoPE moves the logits by only {moved:.1e}");
    on_every_layout("exaone4", &full, &cfg, &ids, &want)
}

/// OLMoE on every kind of layout, with its experts split over EP ranks too: the reference,
/// routed far from a tie.
#[test]
fn olmoe_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = olmoe()?;
    assert_eq!(cfg.arch(), Arch::Olmoe);
    let (want, margin) = reference_routed(&full, &cfg, &ids)?;
    assert!(margin > 1e-5, "a near tie in the routing ({margin:.1e}): float32 could route otherwise");
    let layouts = [
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 4).with_ep(4),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2).with_ep(2),
        Layout::single().with_tp(2, true),
        Layout::single().with_tp(4, false),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2),
    ];
    let norms = |n: &str| n.contains("q_norm") || n.contains("k_norm");
    on_layouts("olmoe", (&full, &cfg, &ids, &want), &layouts, (&norms, 2 * cfg.num_hidden_layers))
}

/// Cached decoding equals the full forward; CP and TP decode the same tokens (TP: the norms'
/// statistic all-reduced in every decode step; TP 4 replicating the KV heads).
#[test]
fn olmo_generation() -> Result<()> {
    for (cfg, full, ids) in [olmo(Olmo::Olmo2, |c| c)?, olmo3()?, olmoe()?, exaone4()?] {
        let ids = ids.narrow(1, 0, 32)?.contiguous()?;
        candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(4, false), Layout::cp(CpKind::Ring, 2).with_tp(2, true)])?;
    }
    Ok(())
}

/// Checkpoints save as `Olmo2ForCausalLM` / `Olmo3ForCausalLM` (its `layer_types`) and load
/// back as the same config and weights.
#[test]
fn olmo_checkpoints_round_trip() -> Result<()> {
    for ((cfg, full, _), class, key) in [(olmo(Olmo::Olmo2, |c| c)?, "Olmo2ForCausalLM", "olmo2"), (olmo3()?, "Olmo3ForCausalLM", "layer_types"), (olmoe()?, "OlmoeForCausalLM", "clip_qkv"), (exaone4()?, "Exaone4ForCausalLM", "sliding_window_pattern")] {
        let dir = std::env::temp_dir().join(format!("candle-cp-{class}-{}", std::process::id()));
        let vm = candle_nn::VarMap::new();
        for (k, t) in &full {
            vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.insert(k.clone(), candle_core::Var::from_tensor(t)?);
        }
        save_hf(&dir, &vm, &cfg)?;
        let text = std::fs::read_to_string(dir.join("config.json"))?;
        assert!(text.contains(class) && text.contains(key), "{text}");
        // (OLMo 2 and 3 have no input norm; OLMoE's experts are written one by one)
        let names = load_safetensors_dir(&dir, &Device::Cpu)?;
        assert_eq!(names.keys().any(|k| k.contains("input_layernorm")), !cfg.post_norms_only());
        assert_eq!(names.contains_key("model.layers.1.mlp.experts.7.down_proj.weight"), cfg.olmo == Some(Olmo::Olmoe));
        let (back, bcfg) = load_hf(&dir, &Device::Cpu, DType::F32)?;
        assert_eq!(bcfg, cfg);
        let data = back.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?;
        assert_eq!(data.len(), full.len());
        for (k, t) in &full {
            let Some(got) = data.get(k) else { candle_core::bail!("{k} not loaded") };
            assert_eq!(max_abs(got.as_tensor(), t)?, 0.0, "{k}");
        }
        drop(data);
        std::fs::remove_dir_all(&dir).ok();
    }
    Ok(())
}

/// A checkpoint with an input norm is refused as a tensor the model does not use.
#[test]
fn olmo_refusals() -> Result<()> {
    let (cfg, full, _) = olmo(Olmo::Olmo2, |c| c)?;
    let mut extra = full.clone();
    extra.insert("model.layers.0.input_layernorm.weight".into(), Tensor::ones(cfg.hidden_size, DType::F32, &Device::Cpu)?);
    let dir = std::env::temp_dir().join(format!("candle-cp-olmo-extra-{}", std::process::id()));
    let named: Vec<(String, Tensor)> = extra.into_iter().collect();
    candle_cp_llama::save_hf_tensors(&dir, &named, &cfg)?;
    let e = load_hf(&dir, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    std::fs::remove_dir_all(&dir).ok();
    assert!(e.contains("input_layernorm"), "{e}");
    Ok(())
}
