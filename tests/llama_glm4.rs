//! GLM-4 (`model_type` `glm4`): norms before and after each branch, q, k, v biases, the MLP's
//! gate and up stored fused, and RoPE over half of each head's dimensions in interleaved pairs.
//!
//! - The tiny-llama oracle's weights as GLM-4 (q, k, v biases and the two new norms seeded,
//!   RoPE on 8 of 16 dimensions) against the float64 reference (`dense_llama.rs`), which takes q
//!   and k back to the checkpoint's order and rotates pairs `(2i, 2i + 1)` as `Glm4Attention`
//!   does, while the model rotates its permuted rows in the half form: one device, ring, zigzag,
//!   striped, Ulysses, 2-D, TP with and without SP, TP × CP, TP 4, recomputed layers, DP —
//!   logits, loss and every gradient within the oracle's tolerances. The norms after the
//!   branches and the biases each bind.
//! - Generation: cached decoding equals the full forward; CP and TP decode the same tokens.
//! - Checkpoints: GLM-4's names and layout (`post_self_attn_layernorm`, `post_attention_layernorm`
//!   before the MLP, `post_mlp_layernorm`, `mlp.gate_up_proj`, q / k rows interleaved within each
//!   head): a file built by hand in that layout reads to the model's tensors, whole and over TP
//!   2; `save_hf` writes it back byte for byte and the sharded writer the same bytes.
//! - LoRA: an adapter written with q_proj's / k_proj's `lora_B` rows in the checkpoint's order
//!   (as PEFT trains them) reads back as the model's, and is written back the same.
//! - GLM (`model_type` `glm`, GLM-4's attention and MLP with a Llama's norms): the same
//!   reference on one device, zigzag, Ulysses, 2-D and TP × CP; generation over CP and TP; its
//!   checkpoints (no norm renamed, `mlp.gate_up_proj`, q / k rows interleaved) read and written.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{compare, load_reference, run_layout_recompute, Tolerances};
use candle_cp_llama::{load_hf, save_hf, Arch, Glm, LlamaConfig};
use candle_cp_tests::dense_llama::{cached_generation_agrees, max_abs, on_every_layout, reference, sharded_load_and_save};
use std::collections::HashMap;

const T: usize = 256;

fn io<E: std::fmt::Display>(e: E) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The oracle as GLM-4: its weights, the q, k, v biases (N(0, 0.3²)-like) and the norms before
/// the MLP and after it drawn; its input ids.
fn glm4() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    glm_model(Glm::Glm4)
}

/// The oracle as `g` (GLM: its weights and the biases drawn).
fn glm_model(g: Glm) -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?.with_glm(Some(g));
    cfg.validate()?;
    let ids = load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, T)?.contiguous()?;
    let mut oracle = load_safetensors_dir(&dir, &Device::Cpu)?;
    let mut full = HashMap::new();
    for s in candle_cp_llama::param_specs(&cfg) {
        let t = match oracle.remove(&s.name) {
            Some(t) => t,
            None if s.name.ends_with(".bias") => (candle_cp_tests::rand_t(61, &s.name, &s.shape)? * 0.3)?,
            None => ((candle_cp_tests::rand_t(67, &s.name, &s.shape)? * 0.4)? + 1.0)?,
        };
        full.insert(s.name, t);
    }
    Ok((cfg, full, ids))
}

/// Every kind of layout, recomputed layers and DP give the reference's results (which rotates
/// as GLM-4 does, in its checkpoints' order); the new norms and the biases each move the logits.
#[test]
fn glm4_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = glm4()?;
    assert_eq!((cfg.arch(), cfg.rope_dim(), cfg.head_dim), (Arch::Glm4, 8, 16));
    let want = reference(&full, &cfg, &ids)?;
    for (what, name) in [("the norm after the MLP", "model.layers.1.post_feedforward_layernorm.weight"), ("the norm after the attention", "model.layers.0.post_attention_layernorm.weight"), ("q_proj's bias", "model.layers.0.self_attn.q_proj.bias")] {
        let mut other = full.clone();
        other.insert(name.to_string(), (&full[name] * 0.5)?);
        let moved = max_abs(&reference(&other, &cfg, &ids)?.logits, &want.logits)?;
        assert!(moved > 1e-3, "{what} moves the logits by only {moved:.1e}");
    }
    let extra = |k: &str| k.ends_with("feedforward_layernorm.weight") || k.ends_with("_proj.bias");
    on_every_layout("glm4", (&full, &cfg, &ids, &want), &[Layout::single().with_tp(4, true), Layout::cp(CpKind::Zigzag, 2).with_tp(4, true)], (&extra, 2 * 2 + 3 * 2))?;
    let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true);
    let rep = compare(&run_layout_recompute(&full, &cfg, &ids, layout, &Device::Cpu, true)?, &want, Tolerances::default())?;
    assert!(rep.pass(), "glm4 {layout} recomputed: {rep:?}");
    Ok(())
}

/// GLM on one device, zigzag 4, Ulysses 2, 2-D and zigzag 2 × TP 2 + SP gives the reference's
/// results (GLM-4's rotation, a Llama's norms); the biases move the logits.
#[test]
fn glm_on_layouts_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = glm_model(Glm::Glm)?;
    assert_eq!((cfg.arch(), cfg.rope_dim(), cfg.pre_and_post_norms(), cfg.interleaved_rope()), (Arch::Glm, 8, false, Some((16, 8))));
    assert!(!full.keys().any(|k| k.contains("feedforward_layernorm")));
    let want = reference(&full, &cfg, &ids)?;
    let mut other = full.clone();
    let name = "model.layers.1.self_attn.k_proj.bias";
    other.insert(name.to_string(), (&full[name] * 0.5)?);
    let moved = max_abs(&reference(&other, &cfg, &ids)?.logits, &want.logits)?;
    assert!(moved > 1e-3, "k_proj's bias moves the logits by only {moved:.1e}");
    let layouts = [Layout::single(), Layout::cp(CpKind::Zigzag, 4), Layout::cp(CpKind::Ulysses, 2), Layout::two_d(2, 2), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true)];
    candle_cp_tests::dense_llama::on_layouts("glm", (&full, &cfg, &ids, &want), &layouts, (&|k: &str| k.ends_with("_proj.bias"), 3 * 2))?;
    cached_generation_agrees(&cfg, &full, &ids.narrow(1, 0, 32)?.contiguous()?, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true)])
}

/// Cached decoding equals the full forward; CP and TP decode the single device's tokens.
#[test]
fn glm4_generation() -> Result<()> {
    let (cfg, full, ids) = glm4()?;
    cached_generation_agrees(&cfg, &full, &ids.narrow(1, 0, 32)?.contiguous()?, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, true), Layout::cp(CpKind::Ulysses, 2).with_tp(2, false)])
}

/// The model's tensors in GLM-4's (or GLM's: no norm renamed) checkpoint layout, built here
/// (the permutation written out again, not through the crate): row `2i` of a head's rotated
/// rows is the model's row `i`, row `2i + 1` its row `R/2 + i`.
fn by_hand(full: &HashMap<String, Tensor>, cfg: &LlamaConfig) -> Result<HashMap<String, Tensor>> {
    let (d, r) = (cfg.head_dim, cfg.rope_dim());
    let to_checkpoint = |t: &Tensor| -> Result<Tensor> {
        let n = t.dim(0)?;
        let idx: Vec<u32> = (0..n).map(|i| ((i / d) * d + { let j = i % d; if j >= r { j } else if j % 2 == 0 { j / 2 } else { r / 2 + j / 2 } }) as u32).collect();
        t.index_select(&Tensor::from_vec(idx, n, &Device::Cpu)?, 0)
    };
    let mut out = HashMap::new();
    for (k, t) in full {
        let rename = [("post_attention_layernorm.weight", "post_self_attn_layernorm.weight"), ("pre_feedforward_layernorm.weight", "post_attention_layernorm.weight"), ("post_feedforward_layernorm.weight", "post_mlp_layernorm.weight")];
        if let Some((p, ck)) = rename.iter().filter(|_| cfg.is_glm4()).find_map(|(m, ck)| Some((k.strip_suffix(m)?, ck))) {
            out.insert(format!("{p}{ck}"), t.clone());
        } else if let Some(p) = k.strip_suffix("mlp.gate_proj.weight") {
            out.insert(format!("{p}mlp.gate_up_proj.weight"), Tensor::cat(&[t, &full[&format!("{p}mlp.up_proj.weight")]], 0)?);
        } else if k.ends_with("mlp.up_proj.weight") {
        } else if k.contains("self_attn.q_proj.") || k.contains("self_attn.k_proj.") {
            out.insert(k.clone(), to_checkpoint(t)?);
        } else {
            out.insert(k.clone(), t.clone());
        }
    }
    Ok(out)
}

/// A checkpoint built by hand in GLM-4's layout reads to the model's tensors (whole, TP 2);
/// `save_hf` writes that file's tensors, and the sharded writer the same bytes.
#[test]
fn glm4_checkpoints() -> Result<()> {
    checkpoints(Glm::Glm4, "Glm4ForCausalLM")
}

/// [`glm4_checkpoints`] for GLM: its `post_attention_layernorm` is the norm before the MLP, as
/// a Llama's; the fused MLP and the interleaved q / k rows as GLM-4's.
#[test]
fn glm_checkpoints() -> Result<()> {
    checkpoints(Glm::Glm, "GlmForCausalLM")
}

fn checkpoints(g: Glm, class: &str) -> Result<()> {
    let (cfg, full, _) = glm_model(g)?;
    let tmp = |tag: &str| std::env::temp_dir().join(format!("candle-cp-{g:?}-{tag}-{}", std::process::id()));
    let hand_dir = tmp("by-hand");
    std::fs::create_dir_all(&hand_dir).map_err(io)?;
    let hand = by_hand(&full, &cfg)?;
    candle_core::safetensors::save(&hand, hand_dir.join("model.safetensors"))?;
    std::fs::write(hand_dir.join("config.json"), cfg.to_hf_json("float32")).map_err(io)?;
    let (back, back_cfg) = load_hf(&hand_dir, &Device::Cpu, DType::F32)?;
    assert_eq!(back_cfg, cfg);
    let got = candle_cp_llama::params::varmap_tensors(&back)?;
    for (k, t) in &full {
        assert_eq!(max_abs(&got[k], t)?, 0.0, "{k}");
    }
    let saved = tmp("saved");
    save_hf(&saved, &back, &cfg)?;
    let names = load_safetensors_dir(&saved, &Device::Cpu)?;
    assert_eq!(names.len(), hand.len());
    assert_eq!(names.keys().filter(|k| k.ends_with("layernorm.weight")).count(), if g == Glm::Glm4 { 4 } else { 2 } * cfg.num_hidden_layers);
    for (k, t) in &hand {
        assert_eq!(names.get(k).map(|s| max_abs(s, t)).transpose()?, Some(0.0), "save_hf's {k}");
    }
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).map_err(io)?).map_err(io)?;
    assert_eq!((config["architectures"][0].as_str(), config["partial_rotary_factor"].as_f64()), (Some(class), Some(0.5)));
    let bytes = std::fs::read(saved.join("model.safetensors")).map_err(io)?;
    let layout = Layout::single().with_tp(2, true);
    let out = tmp("sharded");
    sharded_load_and_save(&hand_dir, &full, &cfg, layout, &out, &bytes)?;
    for d in [hand_dir, saved, out] {
        let _ = std::fs::remove_dir_all(d);
    }
    Ok(())
}

/// An adapter file holds q_proj's and k_proj's `lora_B` rows (and DoRA magnitudes) in the
/// checkpoint's order: the model's read from it are the permuted rows, and written back they
/// are the file's.
#[test]
fn glm4_adapters_permute_q_k_rows() -> Result<()> {
    let (cfg, _, _) = glm4()?;
    let spec = candle_cp_llama::LoraSpec::new(2, 4.0, &["q_proj", "k_proj", "v_proj", "down_proj"])?.with_dora(true);
    let cfg = cfg.with_lora(Some(spec));
    cfg.validate()?;
    let model: HashMap<String, Tensor> = candle_cp_llama::param_specs(&cfg)
        .into_iter()
        .filter(|s| cfg.lora.as_ref().is_some_and(|l| l.trains(&s.name)))
        .map(|s| Ok((s.name.clone(), candle_cp_tests::rand_t(71, &s.name, &s.shape)?)))
        .collect::<Result<_>>()?;
    let dir = std::env::temp_dir().join(format!("candle-cp-glm4-adapter-{}", std::process::id()));
    candle_cp_llama::lora::save_peft_adapter(&dir, cfg.lora.as_ref().ok_or_else(|| io("no spec"))?, &model, "tiny-glm4")?;
    let (_, file) = candle_cp_llama::lora::load_peft_adapter(&dir)?;
    let r = cfg.rope_dim();
    for (k, t) in &file {
        let m = &model[k];
        let permuted = (k.contains("q_proj.") || k.contains("k_proj.")) && (k.ends_with("lora_B.weight") || k.ends_with("lora_magnitude_vector"));
        // the file's row 2i (i < R/2) of head 0 is the model's row i; row 1 the model's R/2
        let row = |t: &Tensor, i: usize| -> Result<Vec<f32>> { t.get(i)?.flatten_all()?.to_vec1::<f32>() };
        if permuted {
            assert_eq!((row(t, 2)?, row(t, 1)?), (row(m, 1)?, row(m, r / 2)?), "{k}");
            assert_ne!(row(t, 1)?, row(m, 1)?, "{k}: permuted");
        } else {
            assert_eq!(max_abs(t, m)?, 0.0, "{k}: as it is");
        }
    }
    let back = candle_cp_llama::lora::model_adapters(&cfg, file)?;
    for (k, t) in &model {
        assert_eq!(max_abs(&back[k], t)?, 0.0, "{k}: read back");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
