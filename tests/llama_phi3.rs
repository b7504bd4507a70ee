//! Phi-3 (`model_type` `phi3`): a Llama whose checkpoints fuse `qkv_proj` / `gate_up_proj`,
//! its long-context models scaling RoPE by LongRoPE (`RopeScaling::LongRope`).
//!
//! - The tiny-llama oracle's weights as a Phi-3 with LongRoPE over an original length of 64
//!   (T = 256 passes it: the long factors and the attention factor act) on every kind of
//!   layout against the float64 plain-candle reference (`dense_llama.rs`, which writes the
//!   LongRoPE frequencies out itself). On a contiguous ring of 4 rank 0 holds positions 0..63
//!   only: with its own shard's length it would rotate by the short factors while the others
//!   use the long ones; the model takes the length over the CP group. Over packed rows the
//!   length is each row's: a row of four 64-token documents keeps the short factors beside a
//!   256-token row, its logits those of the row alone, on DP 2, ring 2 × DP 2 and zigzag 2.
//! - Phi-4-mini's partial RoPE (`partial_rotary_factor` 0.75: the first 12 of 16 dimensions
//!   rotated, the rest passed through) on every kind of layout against the reference, and in
//!   generation.
//! - Generation: a prompt past the original length prefills and decodes with the long
//!   factors, the cached decode equal to the full forward; CP and TP decode the same tokens.
//! - LoRA on the fused modules as PEFT trains it (`qkv_proj`: one `A` for q, k and v, `B`
//!   their rows stacked): on every layout the adapted model's logits are the merged model's
//!   `W_qkv + s·B·A` (split by rows back into q, k, v; the same for `gate_up_proj`), and the
//!   adapters' gradients its weight gradients through the chain rule on the fused weights
//!   (`dA = s·Bᵀ·dW_qkv`, summed over the parts); the adapter file holds PEFT's fused names and
//!   shapes, loads back onto TP shards, and merges (`merge_adapter`, from the file's names or
//!   the model's) into the same weights; folded in for generation it decodes the same tokens.
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
use candle_cp_tests::lora_ref::{f64s, rel};
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
    on_layouts("phi3 + longrope", (&full, &cfg, &ids, &want), &[Layout::cp(CpKind::Ring, 2).with_tp(2, true)])
}

/// Single, ring 4, zigzag 4, Ulysses 2, 2-D 2 × 2, TP 2 + SP and `more` give `want`'s logits,
/// loss and every parameter's gradient.
fn on_layouts(label: &str, (full, cfg, ids, want): (&HashMap<String, Tensor>, &LlamaConfig, &Tensor, &candle_cp_llama::verify::Reference), more: &[Layout]) -> Result<()> {
    let every = [
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, true),
    ];
    for &layout in every.iter().chain(more) {
        let rep = compare(&run_layout(full, cfg, ids, layout, &Device::Cpu)?, want, Tolerances::default())?;
        println!("{label} {layout}: logits {:.1e} loss {:.1e} grad rel {:.1e}", rep.logits_abs, rep.loss_abs, rep.grad_rel_max);
        assert_eq!(rep.grad_rel.len(), want.grads.len(), "{label} {layout}: every parameter compared");
        assert!(rep.pass(), "{label} {layout}: {rep:?}");
    }
    Ok(())
}

/// [`phi3`] as Phi-4-mini rotates: `partial_rotary_factor` 0.75, RoPE on the first 12 of each
/// head's 16 dimensions (6 frequencies `theta^(-2i/12)`, 6 LongRoPE factors of each kind), the
/// last 4 passed through.
fn phi4_mini() -> Result<(LlamaConfig, HashMap<String, Tensor>, Tensor)> {
    let (mut cfg, full, ids) = phi3()?;
    cfg.partial_rotary_factor = 0.75;
    if let RopeScaling::LongRope { short_factor, long_factor, .. } = &mut cfg.rope_scaling {
        short_factor.truncate(6);
        long_factor.truncate(6);
    }
    cfg.validate()?;
    Ok((cfg, full, ids))
}

/// Phi-4-mini's partial RoPE on every kind of layout against the float64 reference (which
/// rotates the first 12 dimensions itself); it acts (rotating all 16, with two more factors,
/// moves the logits far past the tolerance); its tied checkpoint (no `lm_head`) round-trips; the
/// cached decode of a prompt past the original length equals the full forward, and zigzag CP 2
/// and TP 2 decode the same tokens.
#[test]
fn phi4_mini_partial_rope_on_every_layout_matches_the_reference() -> Result<()> {
    let (cfg, full, ids) = phi4_mini()?;
    assert_eq!(cfg.rope_dim(), 12);
    let want = reference(&full, &cfg, &ids)?;
    let (whole, _, _) = phi3()?;
    let moved = max_abs(&reference(&full, &whole, &ids)?.logits, &want.logits)?;
    assert!(moved > 100.0 * Tolerances::default().logits_abs, "the partial RoPE moved the logits by only {moved:.1e}");
    on_layouts("phi4-mini partial rope", (&full, &cfg, &ids, &want), &[])?;
    // tied as Phi-4-mini is: the checkpoint has no lm_head, fused projections, and reads back
    // the same config and tensors
    let tied = LlamaConfig { tie_word_embeddings: true, ..cfg.clone() };
    let mut tensors: Vec<(String, Tensor)> = full.iter().filter(|(k, _)| *k != "lm_head.weight").map(|(k, t)| (k.clone(), t.clone())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let dir = std::env::temp_dir().join(format!("candle-cp-phi4-{}", std::process::id()));
    save_hf_tensors(&dir, &tensors, &tied)?;
    let file = load_safetensors_dir(&dir, &Device::Cpu)?;
    assert!(!file.contains_key("lm_head.weight") && file.contains_key("model.layers.1.self_attn.qkv_proj.weight"), "{:?}", file.keys());
    let (vm, back) = load_hf(&dir, &Device::Cpu, DType::F32)?;
    assert_eq!(back, tied);
    let read = candle_cp_llama::params::varmap_tensors(&vm)?;
    assert_eq!(read.len(), tensors.len());
    for (k, t) in read {
        let want_t = &tensors.iter().find(|(n, _)| *n == k).ok_or_else(|| candle_core::Error::Msg(format!("{k} read, not written")))?.1;
        assert_eq!(max_abs(&t, want_t)?, 0.0, "{k}");
    }
    std::fs::remove_dir_all(&dir)?;
    let prompt = ids.narrow(1, 0, 80)?.contiguous()?;
    candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &prompt, &[Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, false)])
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

const RANK: usize = 4;
const ALPHA: f64 = 6.0;

/// A fused module's parts' weight stems under layer prefix `p` (`model.layers.{i}.`), and
/// the plain adapted modules'.
const FUSED: [(&str, &[&str]); 2] = [("self_attn.qkv_proj", &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]), ("mlp.gate_up_proj", &["mlp.gate_proj", "mlp.up_proj"])];
const PLAIN: [&str; 2] = ["self_attn.o_proj", "mlp.down_proj"];

/// `(fused A, B stacked over the parts, W stacked over the parts, the parts' row counts)` of
/// fused module `f` of layer prefix `p`, from `full` (and the weights of `w`), in f64.
#[allow(clippy::type_complexity)]
fn fused_view(full: &HashMap<String, Tensor>, w: &HashMap<String, Tensor>, p: &str, (f, parts): (&str, &[&str])) -> Result<(Tensor, Tensor, Tensor, Vec<usize>)> {
    let a = f64s(&full[&format!("{p}{f}.lora_A.weight")])?;
    let b: Vec<Tensor> = parts.iter().map(|q| f64s(&full[&format!("{p}{q}.lora_B.weight")])).collect::<Result<_>>()?;
    let ws: Vec<Tensor> = parts.iter().map(|q| f64s(&w[&format!("{p}{q}.weight")])).collect::<Result<_>>()?;
    let rows = ws.iter().map(|t| t.dim(0)).collect::<Result<_>>()?;
    Ok((a, Tensor::cat(&b, 0)?, Tensor::cat(&ws, 0)?, rows))
}

/// Split `t` by rows into the parts' `rows`, named `{p}{part}{suffix}`.
fn split_rows(out: &mut HashMap<String, Tensor>, t: &Tensor, p: &str, parts: &[&str], rows: &[usize], suffix: &str) -> Result<()> {
    let mut at = 0;
    for (q, &r) in parts.iter().zip(rows) {
        out.insert(format!("{p}{q}{suffix}"), t.narrow(0, at, r)?.to_dtype(DType::F32)?);
        at += r;
    }
    Ok(())
}

/// LoRA on a Phi-3's fused modules (PEFT's `qkv_proj` / `gate_up_proj`, `A` shared by the
/// parts) and on o_proj, down_proj: on every layout the merged model's logits and loss, and
/// the adapters' gradients by the chain rule on the fused weights; the adapter file PEFT's.
#[test]
fn phi3_lora_on_the_fused_modules_is_pefts_on_every_layout() -> Result<()> {
    let (base, weights, ids) = phi3()?;
    let cfg = base.clone().with_lora(Some(candle_cp_llama::LoraSpec::new(RANK, ALPHA, &candle_cp_llama::lora::TARGETS)?));
    let spec = cfg.lora.clone().ok_or_else(|| candle_core::Error::Msg("a LoRA config".into()))?;
    assert_eq!(spec.targets, ["o_proj", "down_proj", "qkv_proj", "gate_up_proj"]);
    let mut full = weights.clone();
    for (i, s) in candle_cp_llama::param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
        let sd = if s.name.ends_with("lora_B.weight") { 0.05 } else { 0.2 };
        full.insert(s.name.clone(), candle_cp_ops::oracle::randn(700 + i as u64, &s.shape, sd)?.to_dtype(DType::F32)?);
    }
    // PEFT's formula, written out on the fused weights
    let sc = ALPHA / RANK as f64;
    let mut merged = weights.clone();
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        for fp in FUSED {
            let (a, b, w, rows) = fused_view(&full, &weights, &p, fp)?;
            split_rows(&mut merged, &(w + (b.matmul(&a)? * sc)?)?, &p, fp.1, &rows, ".weight")?;
        }
        for m in PLAIN {
            let (a, b) = (f64s(&full[&format!("{p}{m}.lora_A.weight")])?, f64s(&full[&format!("{p}{m}.lora_B.weight")])?);
            merged.insert(format!("{p}{m}.weight"), (f64s(&weights[&format!("{p}{m}.weight")])? + (b.matmul(&a)? * sc)?)?.to_dtype(DType::F32)?);
        }
    }
    let dense = run_layout(&merged, &base, &ids, Layout::single(), &Device::Cpu)?;
    let dw: HashMap<String, Tensor> = dense.grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
    // the adapters' gradients: dA = s·Bᵀ·dW, dB = s·dW·Aᵀ on the fused (stacked) tensors
    let mut want = HashMap::new();
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        for fp in FUSED {
            let (a, b, g, rows) = fused_view(&full, &dw, &p, fp)?;
            want.insert(format!("{p}{}.lora_A.weight", fp.0), (b.t()?.matmul(&g)? * sc)?);
            split_rows(&mut want, &(g.matmul(&a.t()?)? * sc)?, &p, fp.1, &rows, ".lora_B.weight")?;
        }
        for m in PLAIN {
            let (a, b, g) = (f64s(&full[&format!("{p}{m}.lora_A.weight")])?, f64s(&full[&format!("{p}{m}.lora_B.weight")])?, f64s(&dw[&format!("{p}{m}.weight")])?);
            want.insert(format!("{p}{m}.lora_A.weight"), (b.t()?.matmul(&g)? * sc)?);
            want.insert(format!("{p}{m}.lora_B.weight"), (g.matmul(&a.t()?)? * sc)?);
        }
    }
    assert_eq!(want.len(), 11 * cfg.num_hidden_layers);
    for layout in [
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
        Layout::cp(CpKind::Ulysses, 2).with_tp(2, false),
        Layout::single().with_tp(4, true),
        Layout::two_d(2, 2),
    ] {
        let run = run_layout(&full, &cfg, &ids, layout, &Device::Cpu)?;
        let e_logits = max_abs(&run.logits, &dense.logits)?;
        let got: HashMap<&String, &Tensor> = run.grads.iter().map(|(n, g)| (n, g)).collect();
        let (mut worst, mut at) = (0f64, String::new());
        for (n, w) in &want {
            let Some(g) = got.get(n) else { candle_core::bail!("{layout}: no gradient for {n}") };
            let e = rel(g, w)?;
            if e > worst {
                (worst, at) = (e, n.clone());
            }
        }
        println!("phi3 LoRA {layout}: logits {e_logits:.1e} loss {:.1e} adapter grads {worst:.1e} ({at}) rank spread {:.1e}", (run.loss - dense.loss).abs(), run.grad_spread);
        assert!(e_logits < 1e-5 && (run.loss - dense.loss).abs() < 5e-6, "{layout}: logits {e_logits:.1e}, loss {} vs {}", run.loss, dense.loss);
        assert_eq!(run.grads.len(), want.len(), "{layout}: the adapters' gradients, and only theirs");
        assert!(worst < 1e-4 && run.grad_spread < 1e-6, "{layout}: {at} off by {worst:.1e}");
    }
    // generation with the adapters folded into the weights decodes the adapted model's tokens
    let e = candle_cp_tests::lora_ref::merged_generation_agrees(&cfg, &full, &ids.narrow(1, 0, 80)?.contiguous()?, &[Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, false)])?;
    assert!(e < 1e-4, "merged for generation: logits off by {e:.1e}");
    // the adapter file: PEFT's names and shapes (B stacked by rows), loaded back onto TP
    // shards, merged into the weights written out above
    let dir = std::env::temp_dir().join(format!("candle-cp-phi3-lora-{}", std::process::id()));
    candle_cp_llama::lora::save_peft_adapter(&dir, &spec, &full, "tiny-phi3")?;
    let file = load_safetensors_dir_named(&dir)?;
    let (h, q, kv, i) = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size);
    let pre = candle_cp_llama::lora::PEFT_PREFIX;
    assert_eq!(file[&format!("{pre}model.layers.1.self_attn.qkv_proj.lora_A.weight")].dims(), [RANK, h]);
    assert_eq!(file[&format!("{pre}model.layers.1.self_attn.qkv_proj.lora_B.weight")].dims(), [q + 2 * kv, RANK]);
    assert_eq!(file[&format!("{pre}model.layers.1.mlp.gate_up_proj.lora_B.weight")].dims(), [2 * i, RANK]);
    assert_eq!(file.len(), 8 * cfg.num_hidden_layers, "{:?}", file.keys());
    let text = std::fs::read_to_string(dir.join("adapter_config.json"))?;
    assert!(text.contains("\"qkv_proj\"") && text.contains("\"gate_up_proj\"") && !text.contains("\"q_proj\""), "{text}");
    let (loaded, tensors) = candle_cp_llama::lora::load_peft_adapter(&dir)?;
    assert_eq!(loaded.clone().with_fused(true), spec);
    for r in run_ranks(2, |g| {
        let ctx = ParallelCtx::new(g, Layout::single().with_tp(2, true))?;
        let want = candle_cp_llama::params::varmap_tensors(&shard_tensors(&full, &cfg, &ctx)?)?;
        let vm = shard_tensors(&weights, &base, &ctx)?;
        let Some(_) = candle_cp_llama::lora::load_adapter_sharded(&dir, &base, &vm, &ctx, DType::F32, &Device::Cpu)? else { candle_core::bail!("no adapter") };
        let got = candle_cp_llama::params::varmap_tensors(&vm)?;
        let mut worst = if got.len() == want.len() { 0.0 } else { f64::INFINITY };
        for (k, w) in &want {
            worst = f64::max(worst, got.get(k).map_or(Ok(f64::INFINITY), |g| max_abs(g, w))?);
        }
        Ok(worst)
    }) {
        assert_eq!(r?, 0.0, "the adapter loaded onto TP 2 differs from sharding the adapted model");
    }
    let mut merged_again = weights.clone();
    assert_eq!(candle_cp_llama::lora::merge_adapter(&mut merged_again, &loaded, &tensors)?, 4 * cfg.num_hidden_layers);
    // (and from the model's names: the parts' B as the VarMap holds them)
    let internal: HashMap<String, Tensor> = full.iter().filter(|(n, _)| candle_cp_llama::lora::is_lora_name(n)).map(|(n, t)| (n.clone(), t.clone())).collect();
    let mut merged_internal = weights.clone();
    assert_eq!(candle_cp_llama::lora::merge_adapter(&mut merged_internal, &spec, &internal)?, 4 * cfg.num_hidden_layers);
    for (k, w) in &merged {
        assert!(max_abs(&merged_again[k], w)? < 1e-6 && max_abs(&merged_internal[k], w)? < 1e-6, "merge_adapter: {k}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The tensors of `dir/adapter_model.safetensors` by their names in the file.
fn load_safetensors_dir_named(dir: &std::path::Path) -> Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)
}

/// LongRoPE over packed rows: the factors follow each row's length (its largest position id +
/// 1, over the CP group), not the batch's. Row 0 is one document of 256 tokens (the long
/// factors), row 1 four of 64 (its positions stop at 63: the short ones). Row 1's logits in the
/// two-row batch equal those of row 1 alone, and DP 2 (each replica one row), ring 2 × DP 2
/// and zigzag 2 give the single device's logits, per-token losses, loss and gradients — with
/// the batch's largest position instead, DP's replica of row 1 alone would pick other factors
/// than the single device (a drawn configuration of `llama_random` caught that).
#[test]
fn phi3_longrope_over_packed_rows_follows_each_row() -> Result<()> {
    use candle_cp_llama::Documents;
    use candle_cp_tests::packed_run::{max_diff, run_packed};
    let (cfg, full, ids) = phi3()?;
    let two = Tensor::cat(&[&ids, &ids.flip(&[1])?], 0)?;
    let docs = vec![Documents::from_lengths(&[T])?, Documents::from_lengths(&[64, 64, 64, 64])?];
    let both = run_packed(&full, &cfg, &two, &docs, Layout::single(), false)?;
    let alone = run_packed(&full, &cfg, &two.narrow(0, 1, 1)?, &docs[1..], Layout::single(), false)?;
    let v = cfg.vocab_size;
    let d = max_diff(&both.logits[T * v..], &alone.logits);
    assert!(d <= 1e-6, "row 1's logits depend on row 0 by {d:.1e}");
    // (the short factors act on row 1: with the long ones its logits move)
    let mut long = cfg.clone();
    if let RopeScaling::LongRope { short_factor, long_factor, .. } = &mut long.rope_scaling {
        *short_factor = long_factor.clone();
    }
    let moved = max_diff(&run_packed(&full, &long, &two.narrow(0, 1, 1)?, &docs[1..], Layout::single(), false)?.logits, &alone.logits);
    assert!(moved > 1e-3, "the short factors moved row 1's logits by only {moved:.1e}");
    for layout in [Layout::single().with_dp(2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::cp(CpKind::Zigzag, 2)] {
        let run = run_packed(&full, &cfg, &two, &docs, layout, false)?;
        let (dl, dn, dloss) = (max_diff(&run.logits, &both.logits), max_diff(&run.nll, &both.nll), (run.loss - both.loss).abs());
        let mut worst = 0f64;
        for ((n, g), (_, w)) in run.grads.iter().zip(&both.grads) {
            let e = rel(g, w)?;
            assert!(e < 1e-4, "{layout}: {n} off by {e:.1e}");
            worst = worst.max(e);
        }
        println!("phi3 packed rows {layout}: logits {dl:.1e}, nll {dn:.1e}, loss {dloss:.1e}, gradients {worst:.1e}");
        assert!(dl <= 2e-5 && dn <= 2e-5 && dloss <= 2e-5 && run.spread <= 1e-6, "{layout}: logits {dl:.1e} nll {dn:.1e} loss {dloss:.1e}");
    }
    Ok(())
}
