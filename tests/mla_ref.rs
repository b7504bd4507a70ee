//! DeepSeek-V3's multi-head latent attention in float64 from plain candle ops, written from
//! transformers' `DeepseekV3Attention` (the reference `dense_llama.rs` calls for a config with
//! latent attention), and the tiny DeepSeek-V3 model of the tests.
//!
//! Unlike the model it keeps transformers' order and shapes: heads first (`[B, H, T, ·]`), the
//! query `[q_nope, q_rot]`, the interleaved RoPE dimensions reordered per head as
//! `apply_rotary_pos_emb_interleave` does, the key's RoPE part expanded over the heads, and the
//! value `v_head_dim` wide (no padding: the scores are `q·kᵀ` over `nope + rope`).

use candle_core::{Result, Tensor, D};
use candle_cp_llama::config::deepseek::Mla;
use candle_cp_llama::{LlamaConfig, MoeStyle, RopeScaling};
use std::collections::HashMap;

/// HF's `rotate_half`.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    Tensor::cat(&[&x.narrow(D::Minus1, d / 2, d / 2)?.neg()?, &x.narrow(D::Minus1, 0, d / 2)?], D::Minus1)
}

/// The attention of layer `l` on the normed input `hn` `[B, T, h]` → o_proj's output
/// `[B, T, h]`; `p` the parameters by name, `(cos, sin)` `[T, rope]`, `mask` `[T, T]` (0 or −∞).
pub fn attention<'a>(p: &dyn Fn(&str) -> Result<&'a Tensor>, cfg: &LlamaConfig, l: usize, hn: &Tensor, (cos, sin): (&Tensor, &Tensor), mask: &Tensor) -> Result<Tensor> {
    let a = cfg.mla.ok_or_else(|| candle_core::Error::Msg("mla_ref: no latent attention".into()))?;
    let (b, t, _) = hn.dims3()?;
    let heads = cfg.num_attention_heads;
    let (nope, dr, dv, r, qk) = (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank, a.qk_head_dim());
    let w = |s: &str| p(&format!("model.layers.{l}.self_attn.{s}.weight"));
    let lin = |x: &Tensor, s: &str| crate::dense_llama::linear(x, w(s)?, None);
    let rms = |x: &Tensor, s: &str| crate::dense_llama::rms(x, w(s)?, cfg.rms_norm_eps, false);
    let q = match a.q_lora_rank {
        Some(_) => lin(&rms(&lin(hn, "q_a_proj")?, "q_a_layernorm")?, "q_b_proj")?,
        None => lin(hn, "q_proj")?,
    };
    let q = q.reshape((b, t, heads, qk))?.transpose(1, 2)?;
    let (q_pass, q_rot) = (q.narrow(3, 0, nope)?, q.narrow(3, nope, dr)?);
    let compressed = lin(hn, "kv_a_proj_with_mqa")?;
    let (k_pass, k_rot) = (compressed.narrow(2, 0, r)?, compressed.narrow(2, r, dr)?);
    let kv = lin(&rms(&k_pass, "kv_a_layernorm")?, "kv_b_proj")?.reshape((b, t, heads, nope + dv))?.transpose(1, 2)?;
    let (k_pass, v) = (kv.narrow(3, 0, nope)?, kv.narrow(3, nope, dv)?);
    let k_rot = k_rot.reshape((b, 1, t, dr))?;
    // apply_rotary_pos_emb_interleave: view(d/2, 2).transpose(4, 3).reshape(d), then rotate_half
    let order = |x: &Tensor| -> Result<Tensor> {
        if !a.rope_interleave {
            return Ok(x.clone());
        }
        let (x0, x1, x2, _) = x.dims4()?;
        x.contiguous()?.reshape((x0, x1, x2, dr / 2, 2))?.transpose(3, 4)?.contiguous()?.reshape((x0, x1, x2, dr))
    };
    let rope = |x: &Tensor| -> Result<Tensor> { x.broadcast_mul(cos)? + rotate_half(x)?.broadcast_mul(sin)? };
    let (q_rot, k_rot) = (rope(&order(&q_rot)?)?, rope(&order(&k_rot)?)?);
    let k_rot = k_rot.broadcast_as((b, heads, t, dr))?;
    let q = Tensor::cat(&[&q_pass, &q_rot], 3)?;
    let k = Tensor::cat(&[&k_pass, &k_rot], 3)?;
    // DeepseekV3Attention.scaling: qk_head_dim^-1/2, times mscale² with YaRN's mscale_all_dim
    // (DeepseekV2Attention's: without it)
    let mut scale = (qk as f64).powf(-0.5);
    let v2 = cfg.arch() == candle_cp_llama::Arch::DeepseekV2;
    if let RopeScaling::Yarn { factor, mscale_all_dim: Some(m), .. } = cfg.rope_scaling {
        if m != 0.0 && factor > 1.0 && !v2 {
            let ms = 0.1 * m * factor.ln() + 1.0;
            scale *= ms * ms;
        }
    }
    let s = (q.matmul(&k.t()?)? * scale)?.broadcast_add(mask)?;
    let o = candle_nn::ops::softmax(&s, D::Minus1)?.matmul(&v.contiguous()?)?;
    lin(&o.transpose(1, 2)?.reshape((b, t, heads * dv))?, "o_proj")
}

/// `cfg` (a DeepSeek-V3) as DeepSeek-V2: its softmax router over the same experts and groups
/// (never renormalised), RoPE on interleaved pairs; `cfg` itself without experts.
pub fn as_deepseek_v2(cfg: LlamaConfig) -> LlamaConfig {
    match (cfg.mla, cfg.moe.clone()) {
        (Some(a), Some(m)) => cfg.with_mla(Some(Mla { rope_interleave: true, ..a })).with_moe(Some(candle_cp_llama::MoeConfig { style: MoeStyle::DeepseekV2, norm_topk_prob: false, ..m })),
        _ => cfg,
    }
}

/// [`deepseek_model`] as DeepSeek-V2 (`a` interleaved): its softmax router over the same 8
/// experts in 4 groups, 1 kept (a group's score its best expert's; with 2 kept the top 2 would be
/// the plain top 2), top 2 scaled by 2.5 and not
/// renormalised, a shared expert 48 wide, layer 0 dense; the softmax scale without YaRN's
/// mscale (as transformers' DeepseekV2Attention).
pub fn deepseek_v2_model(a: Mla) -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let (cfg, mut full) = deepseek_model(a)?;
    let cfg = as_deepseek_v2(cfg);
    let m = cfg.moe.clone().ok_or_else(|| candle_core::Error::Msg("deepseek_v2_model: no experts".into()))?;
    // (one group kept: with two the top 2 would be the plain top 2, the groups idle)
    let cfg = cfg.with_moe(Some(candle_cp_llama::MoeConfig { groups: (4, 1), norm_topk_prob: false, ..m }));
    cfg.validate()?;
    let names: std::collections::HashSet<String> = candle_cp_llama::param_specs(&cfg).into_iter().map(|s| s.name).collect();
    full.retain(|k, _| names.contains(k));
    Ok((cfg, full))
}

/// The tiny GLM-4.5 of [`crate::moe_model::moe_model`] (dense layer 0, 8 experts in 4 groups on
/// layer 1) with DeepSeek-V3's latent attention `a` in place of q, k, v (8 heads), YaRN over 32
/// positions with `mscale = mscale_all_dim = 1` (the softmax scale times `(0.1·ln 4 + 1)²`):
/// its config and full weights, the latent attention's drawn from a seed (norms around 1).
pub fn deepseek_model(a: Mla) -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let (cfg, moe_full) = crate::moe_model::moe_model(MoeStyle::Glm4Moe, None)?;
    let mut cfg = cfg.with_qkv_bias(false).with_qk_norm(false).with_partial_rotary_factor(1.0).with_mla(Some(a));
    cfg.rope_scaling = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 32,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: None,
        mscale: Some(1.0),
        mscale_all_dim: Some(1.0),
        truncate: true,
    };
    cfg.validate()?;
    let mut full = HashMap::new();
    for spec in candle_cp_llama::param_specs(&cfg) {
        let name = &spec.name;
        let t = match moe_full.get(name) {
            Some(t) if t.dims() == spec.shape.as_slice() => t.clone(),
            _ if name.ends_with("layernorm.weight") => ((crate::rand_t(71, name, &spec.shape)? * 0.3)? + 1.0)?,
            _ => (crate::rand_t(73, name, &spec.shape)? * 0.08)?,
        };
        full.insert(name.clone(), t);
    }
    Ok((cfg, full))
}
