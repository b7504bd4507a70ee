//! Phi-3 (`model_type` `phi3`): a Llama whose checkpoints fuse `qkv_proj` / `gate_up_proj`,
//! its long-context models scaling RoPE by LongRoPE (`RopeScaling::LongRope`).
//!
//! - The tiny-llama oracle's weights as a Phi-3 with LongRoPE over an original length of 64
//!   (T = 256 passes it: the long factors and the attention factor act) on every kind of
//!   layout against the float64 plain-candle reference (`dense_llama.rs`, which writes the
//!   LongRoPE frequencies out itself). On a contiguous ring of 4 rank 0 holds positions 0..63
//!   only: with its own shard's length it would rotate by the short factors while the others
//!   use the long ones; the model takes the length over the CP group.
//! - Generation: a prompt past the original length prefills and decodes with the long
//!   factors, the cached decode equal to the full forward; CP and TP decode the same tokens.
//! - Checkpoints: written with the fused tensors (`qkv_proj` = q | k | v rows, `gate_up_proj`
//!   = gate | up), `Phi3ForCausalLM` and Phi-3's `rope_scaling`; read back bit for bit, whole
//!   or sharded over TP 1, 2, 4; written again by the streaming TP writer byte for byte; under
//!   a Llama config the fused tensors are refused by name.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::hf::{load_safetensors_dir, save_hf_tensors};
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{compare, load_reference, run_layout, Tolerances};
use candle_cp_llama::{load_hf, load_hf_sharded, save_hf, save_hf_sharded, shard_tensors, LlamaConfig, ParallelCtx, RopeScaling};
use candle_cp_tests::dense_llama::{max_abs, reference};
use std::collections::HashMap;

const T: usize = 256;

/// The oracle's weights and ids, its config as a Phi-3 with LongRoPE: original length 64,
/// `max_position_embeddings` 1024 (factor 16, attention factor `sqrt(1 + ln 16 / ln 64)`),
/// short factors near 1, long ones growing to 30 with the wavelength.
fn phi3() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    let mut cfg = LlamaConfig::from_file(dir.join("config.json"))?.with_phi3(true);
    cfg.max_position_embeddings = 1024;
    cfg.rope_scaling = RopeScaling::LongRope {
        short_factor: vec![1.0, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0],
        long_factor: vec![1.0, 1.2, 1.8, 3.0, 5.0, 9.0, 16.0, 30.0],
        original_max_position_embeddings: 64,
        factor: 16.0,
        attention_factor: None,
    };
    cfg.validate()?;
    let ids = load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, T)?.contiguous()?;
    Ok((cfg, load_safetensors_dir(&dir, &Device::Cpu)?, ids))
}

/// Every kind of layout gives the reference's logits, loss and gradients; the long factors
/// act (the reference with the short ones differs).
#[test]
fn phi3_with_longrope_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = phi3()?;
    let want = reference(&full, &cfg, &ids)?;
    let mut short = cfg.clone();
    if let RopeScaling::LongRope { short_factor, long_factor, .. } = &mut short.rope_scaling {
        *long_factor = short_factor.clone();
    }
    let moved = max_abs(&reference(&full, &short, &ids)?.logits, &want.logits)?;
    assert!(moved > 100.0 * Tolerances::default().logits_abs, "the long factors moved the logits by only {moved:.1e}");
    for layout in [
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, true),
        Layout::cp(CpKind::Ring, 2).with_tp(2, true),
    ] {
        let rep = compare(&run_layout(&full, &cfg, &ids, layout, &Device::Cpu)?, &want, Tolerances::default())?;
        println!("phi3 + longrope {layout}: logits {:.1e} loss {:.1e} grad rel {:.1e}", rep.logits_abs, rep.loss_abs, rep.grad_rel_max);
        assert_eq!(rep.grad_rel.len(), want.grads.len(), "{layout}: every parameter compared");
        assert!(rep.pass(), "{layout}: {rep:?}");
    }
    Ok(())
}

/// A prompt of 80 tokens (past the original 64): the cached decode equals the full forward,
/// and zigzag CP 2 and TP 4 decode the single device's tokens.
#[test]
fn phi3_generation_past_the_original_length() -> Result<()> {
    let (cfg, full, ids) = phi3()?;
    let ids = ids.narrow(1, 0, 80)?.contiguous()?;
    candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(4, false)])
}

/// The fused checkpoint: names, shapes and rows; `config.json` as Phi-3's; read back whole
/// and sharded; written again whole and by the TP writer, byte for byte; refused as a Llama.
#[test]
fn phi3_checkpoints_fuse_the_projections() -> Result<()> {
    let (cfg, full, _) = phi3()?;
    let root = std::env::temp_dir().join(format!("candle-cp-phi3-{}", std::process::id()));
    let dir = root.join("phi3");
    let mut tensors: Vec<(String, Tensor)> = full.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    save_hf_tensors(&dir, &tensors, &cfg)?;
    // the file: fused tensors, q | k | v and gate | up by rows, no separate projections
    let file = load_safetensors_dir(&dir, &Device::Cpu)?;
    let (h, q, kv, i) = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        let qkv = &file[&format!("{p}self_attn.qkv_proj.weight")];
        assert_eq!(qkv.dims(), [q + 2 * kv, h]);
        for (name, start, len) in [("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, kv), ("self_attn.v_proj", q + kv, kv)] {
            assert_eq!(max_abs(&qkv.narrow(0, start, len)?, &full[&format!("{p}{name}.weight")])?, 0.0, "{p}{name}");
        }
        let gu = &file[&format!("{p}mlp.gate_up_proj.weight")];
        assert_eq!(gu.dims(), [2 * i, h]);
        assert_eq!(max_abs(&gu.narrow(0, 0, i)?, &full[&format!("{p}mlp.gate_proj.weight")])?, 0.0);
        assert_eq!(max_abs(&gu.narrow(0, i, i)?, &full[&format!("{p}mlp.up_proj.weight")])?, 0.0);
    }
    assert_eq!(file.len(), full.len() - 3 * cfg.num_hidden_layers);
    assert!(!file.keys().any(|k| [".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj."].iter().any(|p| k.contains(p))), "{:?}", file.keys());
    // config.json: Phi-3's keys, LongRoPE as its released configs write it
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!(v["model_type"], "phi3");
    assert_eq!(v["architectures"][0], "Phi3ForCausalLM");
    assert_eq!(v["original_max_position_embeddings"], 64);
    let rope = v["rope_scaling"].as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    assert_eq!(rope, ["long_factor", "short_factor", "type"], "{text}");
    assert!(v.get("rope_parameters").is_none(), "{text}");
    // read back, written again
    let (vm, back) = load_hf(&dir, &Device::Cpu, DType::F32)?;
    assert_eq!(back, cfg);
    let again = root.join("again");
    save_hf(&again, &vm, &back)?;
    let bytes = std::fs::read(dir.join("model.safetensors"))?;
    assert!(bytes == std::fs::read(again.join("model.safetensors"))?, "written again, the bytes differ");
    for tp in [1usize, 2, 4] {
        let streamed = root.join(format!("tp{tp}"));
        for r in run_ranks(tp, |g| {
            let ctx = ParallelCtx::new(g, Layout::single().with_tp(tp, true))?;
            let want = shard_tensors(&full, &cfg, &ctx)?;
            let (got, _) = load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32)?;
            let (want, got) = (candle_cp_llama::params::varmap_tensors(&want)?, candle_cp_llama::params::varmap_tensors(&got)?);
            let mut same = want.len() == got.len();
            for (k, w) in &want {
                same &= got.get(k).map(|g| max_abs(g, w).map(|e| e == 0.0)).transpose()? == Some(true);
            }
            save_hf_sharded(&streamed, &got, &cfg, &ctx, ctx.tp.rank() == 0)?;
            Ok(same)
        }) {
            assert!(r?, "tp {tp}: the sharded load differs from sharding the whole model");
        }
        assert!(bytes == std::fs::read(streamed.join("model.safetensors"))?, "tp {tp}: the streamed checkpoint differs");
    }
    // the same file under a Llama config.json: the fused tensors are not a Llama's
    let llama = root.join("llama");
    std::fs::create_dir_all(&llama)?;
    std::fs::copy(dir.join("model.safetensors"), llama.join("model.safetensors"))?;
    std::fs::write(llama.join("config.json"), text.replace("\"phi3\"", "\"llama\"").replace("Phi3ForCausalLM", "LlamaForCausalLM"))?;
    let e = load_hf(&llama, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("4 tensor(s)") && e.contains("model.layers.0.mlp.gate_up_proj.weight"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
