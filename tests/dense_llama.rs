//! A dense float64 model from plain candle ops, the reference of the architecture tests
//! (`llama_archs.rs`): embedding, RMSNorm, (biased) projections, q / k head
//! norms, RoPE by HF's `rotate_half`, dense softmax attention with GQA under a causal mask
//! (within each layer's window), the gated MLP, head, next-token cross-entropy; candle's
//! autograd for every gradient. It first reproduces the PyTorch oracle (`llama_archs.rs`), so
//! the Llama part is checked against PyTorch; each architecture's differences are written
//! here from transformers' modelling code, in the plainest form:
//!
//! - Qwen2: `+ b` on the q, k, v projections; Qwen3: `rms(q)·w`, `rms(k)·w` per head before
//!   RoPE.
//! - Gemma 3: embedding × `√h` (rounded to f32, the weights' dtype in the tests); every norm
//!   `x / √(mean(x²) + eps) · (1 + w)`; `x + norm(attn(..))` and `x + norm(mlp(..))`;
//!   `gelu_tanh(gate)·up`; scale `query_pre_attn_scalar^-1/2`; sliding layers rotate by
//!   `rope_local_base_freq^(-2i/D)`, unscaled.
//! - SmolLM3: no RoPE on its NoPE layers (`LlamaConfig::layer_rotates`).
//! - Granite: the embedding times `embedding_multiplier`, the softmax scale
//!   `attention_multiplier`, `x + r·attn(..)` and `x + r·mlp(..)` (`residual_multiplier`), the
//!   logits divided by `logits_scaling`.
//! - OLMo 2 and 3: no norm before the attention or the MLP; `x + rms(attn(x))` and
//!   `x + rms(mlp(x))`; q and k normalised over the whole projection (`H·D`, `Hkv·D`
//!   features of a token) before the split into heads and RoPE; OLMo 3's sliding layers
//!   rotate unscaled when the config scales RoPE. OLMoE: a Llama with those q and k norms and
//!   Qwen3-MoE's experts.
//! - Gemma 2: Gemma 3's norms, embedding factor, MLP and scale without the head norms and
//!   the local RoPE; attention logits `c·tanh(s/c)` (`attn_logit_softcapping`) before the
//!   mask, output logits `c·tanh(l/c)` (`final_logit_softcapping`) before the loss.
//! - Qwen3-MoE, Mixtral and Qwen2-MoE (plus `sigmoid(x·w_g)·shared(x)`): on a sparse layer the router's `softmax(x·Wrᵀ)`, each token's top `K`
//!   (renormalised with `norm_topk_prob`), and every expert's SwiGLU on every token weighted by
//!   that token's weight of it (0 when not chosen); with `output_router_logits` the loss adds
//!   `coef · E · Σ_e (C_e / R)·(S_e / R)` (`C_e` choices of expert `e`, `S_e` its summed
//!   probability, `R` router rows, over every sparse layer: `load_balancing_loss_func`).

use candle_core::{backprop::GradStore, DType, Device, Result, Tensor, Var, D};
use candle_cp_llama::verify::Reference;
use candle_cp_llama::LlamaConfig;
use std::collections::HashMap;

/// `x [.., in] · wᵀ (+ b)`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.broadcast_matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// RMSNorm, Llama's `x̂·w` or Gemma's `x̂·(1 + w)`.
pub fn rms(x: &Tensor, w: &Tensor, eps: f64, gemma: bool) -> Result<Tensor> {
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let w = if gemma { (w + 1.0)? } else { w.clone() };
    x.broadcast_mul(&r)?.broadcast_mul(&w)
}

/// HF's `rotate_half`: `[-x2, x1]` for the halves `x1, x2` of the last dim.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    Tensor::cat(&[&x.narrow(D::Minus1, d / 2, d / 2)?.neg()?, &x.narrow(D::Minus1, 0, d / 2)?], D::Minus1)
}

/// `(cos, sin)` `[T, D]` of the frequencies `inv` (`[D/2]`) at positions `0..t`, times `af`.
fn tables(inv: &[f64], t: usize, af: f64) -> Result<(Tensor, Tensor)> {
    let ang: Vec<f64> = (0..t).flat_map(|p| inv.iter().map(move |f| p as f64 * f)).collect();
    let ang = Tensor::from_vec(ang, (t, inv.len()), &Device::Cpu)?;
    let ang = Tensor::cat(&[&ang, &ang], 1)?;
    Ok(((ang.cos()? * af)?, (ang.sin()? * af)?))
}

/// The model in float64 from plain candle ops: logits, mean next-token loss, and the gradient
/// of every parameter (as f32), for `ids [B, T]` (positions `0..T` in every row).
pub fn reference(full: &HashMap<String, Tensor>, cfg: &LlamaConfig, ids: &Tensor) -> Result<Reference> {
    Ok(reference_routed(full, cfg, ids)?.0)
}

/// [`reference()`], and the smallest gap between a token's `K`-th and `K+1`-th router
/// probability over the sparse layers (infinite without experts): a routing whose gap is far
/// above float32 rounding routes the same in float32, on every layout.
pub fn reference_routed(full: &HashMap<String, Tensor>, cfg: &LlamaConfig, ids: &Tensor) -> Result<(Reference, f64)> {
    let vars: HashMap<&str, Var> =
        full.iter().map(|(k, t)| Ok((k.as_str(), Var::from_tensor(&t.to_dtype(DType::F64)?)?))).collect::<Result<_>>()?;
    let p = |n: &str| -> Result<&Tensor> {
        vars.get(n).map(|v| v.as_tensor()).ok_or_else(|| candle_core::Error::Msg(format!("reference: no {n}")))
    };
    let (b, t) = ids.dims2()?;
    let (h, hh, hkv, d) = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let (eps, gemma, gemma2) = (cfg.rms_norm_eps, cfg.gemma3.clone(), cfg.gemma2.clone());
    // Gemma 2 and 3 alike: `1 + w` norms, sandwich norms, GELU, the embedding factor
    let gemma_like = gemma.is_some() || gemma2.is_some();
    // a norm before and one after each branch: Gemma's, and GLM-4's (in a Llama's form)
    let sandwich = gemma_like || cfg.is_glm4();
    let norm = |x: &Tensor, name: &str| rms(x, p(name)?, eps, gemma_like);
    let (attn_cap, final_cap) = match &gemma2 {
        Some(g) => (g.attn_logit_softcapping, g.final_logit_softcapping),
        None => (None, None),
    };
    let cap = |x: Tensor, c: Option<f64>| -> Result<Tensor> {
        match c {
            Some(c) => (x / c)?.tanh()? * c,
            None => Ok(x),
        }
    };
    // the frequencies of the config's scaling (plain RoPE: theta^(-2i/D), which the oracle
    // test checks; YaRN's are checked by hand in `rope::tests`), and YaRN's factor on cos and
    // sin as HF applies it; Gemma's sliding layers: their own base, unscaled
    // LongRoPE written out here (not through the crate): theta^(-2i/R) over the long factors
    // when the T tokens pass the original length, the short ones otherwise, and cos, sin
    // times sqrt(1 + ln(factor) / ln(original)); R = int(D · partial_rotary_factor) the
    // rotated dimensions (Phi-4-mini's partial RoPE: the others pass through)
    // (DeepSeek-V3: its RoPE width, `qk_rope_head_dim`)
    let rd = cfg.mla.map_or((d as f64 * cfg.partial_rotary_factor) as usize, |a| a.qk_rope_head_dim);
    let global = match &cfg.rope_scaling {
        candle_cp_llama::RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings: o, factor, attention_factor: None } => {
            let ext = if t > *o { long_factor } else { short_factor };
            let inv: Vec<f64> = (0..rd / 2).map(|i| cfg.rope_theta.powf(-2.0 * i as f64 / rd as f64) / ext[i]).collect();
            let af = if *factor > 1.0 { (1.0 + factor.ln() / (*o as f64).ln()).sqrt() } else { 1.0 };
            tables(&inv, t, af)?
        }
        _ => tables(&candle_cp_llama::rope::inv_freq(cfg), t, cfg.rope_scaling.attention_factor())?,
    };
    // OLMo 2 and 3: norms after the branches only; every OLMo (OLMoE too): q / k norms over the
    // whole projections
    let (olmo, flat_qk) = (cfg.post_norms_only(), cfg.olmo.is_some());
    let olmo3_scaled = cfg.olmo == Some(candle_cp_llama::Olmo::Olmo3) && cfg.rope_scaling != candle_cp_llama::RopeScaling::Default;
    let local = match &gemma {
        Some(g) => Some(tables(&(0..d / 2).map(|i| g.rope_local_base_freq.powf(-2.0 * i as f64 / d as f64)).collect::<Vec<_>>(), t, 1.0)?),
        // OLMo 3 with a scaled RoPE: its sliding layers by theta^(-2i/D), unscaled
        None if olmo3_scaled => Some(tables(&(0..d / 2).map(|i| cfg.rope_theta.powf(-2.0 * i as f64 / d as f64)).collect::<Vec<_>>(), t, 1.0)?),
        None => None,
    };
    // causal, within the layer's window if it has one: query i sees key j iff i - w < j <= i
    let mask = |w: Option<usize>| -> Result<Tensor> {
        let w = w.unwrap_or(t);
        let m: Vec<f64> = (0..t * t).map(|i| if i % t > i / t || i / t - i % t >= w { f64::NEG_INFINITY } else { 0.0 }).collect();
        Tensor::from_vec(m, (t, t), &Device::Cpu)
    };
    let scale = match (&gemma, &gemma2, &cfg.granite) {
        (Some(g), _, _) => g.query_pre_attn_scalar.powf(-0.5),
        (None, Some(g), _) => g.query_pre_attn_scalar.powf(-0.5),
        // Granite: attention_multiplier
        (None, None, Some(g)) => g.attention_multiplier,
        (None, None, None) => (d as f64).powf(-0.5),
    };
    // Granite: embedding_multiplier, residual_multiplier, logits_scaling
    let (embed_mul, residual_mul, logits_div) = cfg.granite.as_ref().map_or((1.0, 1.0, 1.0), |g| (g.embedding_multiplier, g.residual_multiplier, g.logits_scaling));
    // the router's statistics (load-balancing loss) and the smallest top-K margin
    let mut margin = f64::INFINITY;
    let e_n = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    let mut counts = vec![0f64; e_n];
    let mut prob_sums: Option<Tensor> = None;
    // (0 · the GLM-4.5 correction biases: their zero gradients)
    let mut zero_grads = Tensor::new(0f64, &Device::Cpu)?;
    let mut rows = 0usize;
    let mut x = p("model.embed_tokens.weight")?.index_select(&ids.flatten_all()?, 0)?.reshape((b, t, h))?;
    if gemma_like {
        x = (x * ((h as f64).sqrt() as f32) as f64)?;
    }
    x = (x * embed_mul)?;
    for l in 0..cfg.num_hidden_layers {
        let n = |s: &str| format!("model.layers.{l}.{s}");
        let bias = |s: &str| -> Result<Option<&Tensor>> {
            if cfg.qkv_bias { p(&n(&format!("self_attn.{s}.bias"))).map(Some) } else { Ok(None) }
        };
        let window = cfg.layer_window(l);
        let (cos, sin) = match (&local, window) {
            (Some(loc), Some(_)) => loc,
            _ => &global,
        };
        let rope = |x: &Tensor| -> Result<Tensor> {
            // SmolLM3's NoPE layers: q and k as projected
            if !cfg.layer_rotates(l) {
                return Ok(x.clone());
            }
            let r = x.narrow(D::Minus1, 0, rd)?;
            let r = if cfg.glm.is_some() {
                // GLM, GLM-4 (x in its checkpoints' order): pairs (2i, 2i + 1) rotated by frequency i
                let (bb, nh, tt, _) = r.dims4()?;
                let pairs = r.reshape((bb, nh, tt, rd / 2, 2))?;
                let (xe, xo) = (pairs.narrow(4, 0, 1)?.squeeze(4)?, pairs.narrow(4, 1, 1)?.squeeze(4)?);
                let (c, s) = (cos.narrow(1, 0, rd / 2)?, sin.narrow(1, 0, rd / 2)?);
                let ye = (xe.broadcast_mul(&c)? - xo.broadcast_mul(&s)?)?;
                let yo = (xo.broadcast_mul(&c)? + xe.broadcast_mul(&s)?)?;
                Tensor::stack(&[ye, yo], 4)?.reshape((bb, nh, tt, rd))?
            } else {
                (r.broadcast_mul(cos)? + rotate_half(&r)?.broadcast_mul(sin)?)?
            };
            if rd == d { Ok(r) } else { Tensor::cat(&[&r, &x.narrow(D::Minus1, rd, d - rd)?], D::Minus1) }
        };
        let hn = if olmo { x.clone() } else { norm(&x, &n("input_layernorm.weight"))? };
        let o = match &cfg.mla {
            // DeepSeek-V3: the latent attention (mla_ref.rs)
            Some(_) => crate::mla_ref::attention(&p, cfg, l, &hn, (cos, sin), &mask(window)?)?,
            None => {
                let heads = |s: &str, nh: usize| -> Result<Tensor> {
                    let y = linear(&hn, p(&n(&format!("self_attn.{s}.weight")))?, bias(s)?)?;
                    // OLMo: q and k normalised over the whole projection, then split
                    let y = match (flat_qk, s) {
                        (true, "q_proj") => norm(&y, &n("self_attn.q_norm.weight"))?,
                        (true, "k_proj") => norm(&y, &n("self_attn.k_norm.weight"))?,
                        _ => y,
                    };
                    y.reshape((b, t, nh, d))?.transpose(1, 2)
                };
                let (mut q, mut k) = (heads("q_proj", hh)?, heads("k_proj", hkv)?);
                if cfg.qk_norm {
                    // Qwen3, Gemma 3: each head's D features normalised before RoPE
                    q = norm(&q, &n("self_attn.q_norm.weight"))?;
                    k = norm(&k, &n("self_attn.k_norm.weight"))?;
                }
                // GLM, GLM-4: q and k back in its checkpoints' order (the model holds each head's rotated
                // rows permuted, crate::config::glm4: row i < R/2 is the checkpoint's 2i, row R/2 + i its
                // 2i + 1), so that `rope` rotates them as GlmAttention and Glm4Attention do
                if cfg.glm.is_some() {
                    let idx: Vec<u32> = (0..d).map(|j| (if j >= rd { j } else if j % 2 == 0 { j / 2 } else { rd / 2 + j / 2 }) as u32).collect();
                    let idx = Tensor::from_vec(idx, d, &Device::Cpu)?;
                    (q, k) = (q.contiguous()?.index_select(&idx, 3)?, k.contiguous()?.index_select(&idx, 3)?);
                }
                let (q, k, v) = (rope(&q)?, rope(&k)?, heads("v_proj", hkv)?);
                // GQA: query head j uses KV head j / (H / Hkv)
                let rep = |x: Tensor| -> Result<Tensor> {
                    x.unsqueeze(2)?.broadcast_as((b, hkv, hh / hkv, t, d))?.reshape((b, hh, t, d))
                };
                let (k, v) = (rep(k)?, rep(v)?);
                let s = cap((q.matmul(&k.t()?)? * scale)?, attn_cap)?.broadcast_add(&mask(window)?)?;
                let a = if cfg.gpt_oss {
                    // gpt-oss: each head's sink logit one more softmax column, dropped before V
                    let col = p(&n("self_attn.sinks"))?.reshape((1, hh, 1, 1))?.broadcast_as((b, hh, t, 1))?.contiguous()?;
                    candle_nn::ops::softmax(&Tensor::cat(&[&s, &col], 3)?, D::Minus1)?.narrow(3, 0, t)?.matmul(&v)?
                } else {
                    candle_nn::ops::softmax(&s, D::Minus1)?.matmul(&v)?
                };
                let a = a.transpose(1, 2)?.reshape((b, t, hh * d))?;
                let o_bias = if cfg.gpt_oss { Some(p(&n("self_attn.o_proj.bias"))?) } else { None };
                linear(&a, p(&n("self_attn.o_proj.weight"))?, o_bias)?
            }
        };
        let (pre_mlp, o) = match (sandwich, olmo) {
            (true, _) => (Some("pre_feedforward_layernorm.weight"), norm(&o, &n("post_attention_layernorm.weight"))?),
            (false, true) => (None, norm(&o, &n("post_attention_layernorm.weight"))?),
            (false, false) => (Some("post_attention_layernorm.weight"), o),
        };
        x = (x + (o * residual_mul)?)?;
        let hn = match pre_mlp {
            Some(w) => norm(&x, &n(w))?,
            None => x.clone(),
        };
        let m = match &cfg.moe {
            Some(mc) if cfg.is_moe_layer(l) => {
                let (e, k, rn) = (mc.num_experts, mc.num_experts_per_tok, b * t);
                let x2 = hn.reshape((rn, h))?;
                let module = mc.module();
                let router = |s: &str| p(&n(&format!("{module}.{}.{s}", mc.router())));
                let rb = if mc.biases() { Some(router("bias")?) } else { None };
                let sigmoid = mc.sigmoid_scores();
                let probs = match sigmoid {
                    // GLM-4.5: sigmoid scores
                    true => candle_nn::ops::sigmoid(&linear(&x2, router("weight")?, None)?)?,
                    false => candle_nn::ops::softmax(&linear(&x2, router("weight")?, rb)?, D::Minus1)?,
                };
                // GLM-4.5: the experts chosen by the scores plus the correction bias, within the
                // best groups (a group's score the sum of its two best; the others' set to 0)
                // DeepSeek-V2: the softmax scores chosen within the best groups (a group's score
                // its best expert's), scaled, not renormalised
                let v2 = mc.style == candle_cp_llama::MoeStyle::DeepseekV2;
                let choice = match sigmoid || v2 {
                    false => probs.to_vec2::<f64>()?,
                    true => {
                        let choice_of = match sigmoid {
                            true => {
                                let cb = router(candle_cp_llama::params::CORRECTION_BIAS)?;
                                // (a zero gradient, as the model's: the bias only chooses; times a
                                // zero tensor, as candle prunes a scalar factor of 0 from the graph)
                                zero_grads = (zero_grads + cb.sum_all()?.mul(&Tensor::new(0f64, &Device::Cpu)?)?)?;
                                probs.broadcast_add(cb)?
                            }
                            false => probs.clone(),
                        };
                        let (g, keep) = mc.groups;
                        let per = e / g;
                        let mut rows_c = choice_of.to_vec2::<f64>()?;
                        for row in rows_c.iter_mut() {
                            let mut score: Vec<(usize, f64)> = (0..g)
                                .map(|gi| {
                                    let mut v = row[gi * per..(gi + 1) * per].to_vec();
                                    v.sort_by(|a, b| b.total_cmp(a));
                                    (gi, v[0] + if per > 1 && !v2 { v[1] } else { 0.0 })
                                })
                                .collect();
                            score.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                            for &(gi, _) in &score[keep.min(g)..] {
                                row[gi * per..(gi + 1) * per].iter_mut().for_each(|x| *x = 0.0);
                            }
                        }
                        rows_c
                    }
                };
                let mut chosen = vec![0f64; rn * e];
                for (i, row) in choice.iter().enumerate() {
                    let mut idx: Vec<usize> = (0..e).collect();
                    idx.sort_by(|&a, &c| row[c].total_cmp(&row[a]));
                    for &j in &idx[..k] {
                        chosen[i * e + j] = 1.0;
                        counts[j] += 1.0;
                    }
                    if k < e {
                        margin = margin.min(row[idx[k - 1]] - row[idx[k]]);
                    }
                }
                let s = probs.sum(0)?;
                prob_sums = Some(match prob_sums.take() {
                    Some(acc) => (acc + s)?,
                    None => s,
                });
                rows += rn;
                let mask = Tensor::from_vec(chosen, (rn, e), &Device::Cpu)?;
                let mut w = (&probs * &mask)?;
                if mc.style == candle_cp_llama::MoeStyle::GraniteMoe {
                    // GraniteMoeTopKGating: the softmax of the top-K logits
                    let logits = linear(&x2, router("weight")?, rb)?;
                    let ex = (logits.broadcast_sub(&logits.max_keepdim(1)?)?.exp()? * &mask)?;
                    w = ex.broadcast_div(&ex.sum_keepdim(1)?)?;
                } else if mc.norm_topk_prob {
                    w = w.broadcast_div(&w.sum_keepdim(1)?)?;
                }
                if sigmoid || v2 {
                    w = (w * mc.routed_scaling_factor)?;
                }
                let mut y = Tensor::zeros((rn, h), DType::F64, &Device::Cpu)?;
                for ex in 0..e {
                    let w_of = |s: &str| -> Result<Tensor> { p(&n(&format!("{module}.experts.{s}")))?.get(ex) };
                    // gpt-oss: each expert's biases
                    let b_of = |s: &str| -> Result<Option<Tensor>> { if mc.biases() { w_of(&format!("{s}.bias")).map(Some) } else { Ok(None) } };
                    let g = linear(&x2, &w_of("gate_proj")?, b_of("gate_proj")?.as_ref())?;
                    let u = linear(&x2, &w_of("up_proj")?, b_of("up_proj")?.as_ref())?;
                    let act = if cfg.gpt_oss {
                        // (clamp(u, ±7) + 1) · g · σ(1.702·g), g = min(gate, 7), as GptOssExperts
                        let gc = g.minimum(7.0)?;
                        ((u.clamp(-7.0, 7.0)? + 1.0)? * (&gc * candle_nn::ops::sigmoid(&(&gc * 1.702)?)?)?)?
                    } else {
                        (g.silu()? * u)?
                    };
                    let ye = linear(&act, &w_of("down_proj")?, b_of("down_proj")?.as_ref())?;
                    y = (y + ye.broadcast_mul(&w.narrow(1, ex, 1)?)?)?;
                }
                if mc.shared_expert_intermediate_size > 0 {
                    // Qwen2-MoE: + sigmoid(x·w_g) · shared(x); GLM-4.5: + shared(x)
                    let sh = |s: &str| p(&n(&format!("{module}.{}.{s}.weight", mc.shared_module())));
                    let m = (linear(&x2, sh("gate_proj")?, None)?.silu()? * linear(&x2, sh("up_proj")?, None)?)?;
                    let out = linear(&m, sh("down_proj")?, None)?;
                    y = match mc.shared_gate() {
                        true => (y + out.broadcast_mul(&candle_nn::ops::sigmoid(&linear(&x2, p(&n(&format!("{module}.shared_expert_gate.weight")))?, None)?)?)?)?,
                        false => (y + out)?,
                    };
                }
                y.reshape((b, t, h))?
            }
            _ => {
                let g = linear(&hn, p(&n("mlp.gate_proj.weight"))?, None)?;
                let u = linear(&hn, p(&n("mlp.up_proj.weight"))?, None)?;
                let act = if gemma_like { g.gelu()? } else { g.silu()? };
                linear(&(act * u)?, p(&n("mlp.down_proj.weight"))?, None)?
            }
        };
        let m = if sandwich || olmo { norm(&m, &n("post_feedforward_layernorm.weight"))? } else { m };
        x = (x + (m * residual_mul)?)?;
    }
    let head = if cfg.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
    let logits = cap((linear(&norm(&x, "model.norm.weight")?, p(head)?, None)? / logits_div)?, final_cap)?;
    let lp = candle_nn::ops::log_softmax(&logits.narrow(1, 0, t - 1)?, D::Minus1)?;
    let targets = ids.narrow(1, 1, t - 1)?.contiguous()?.unsqueeze(2)?;
    let mut loss = ((lp.gather(&targets, 2)?.sum_all()? / -((b * (t - 1)) as f64))? + zero_grads)?;
    if let (Some(mc), Some(s)) = (&cfg.moe, &prob_sums) {
        if mc.output_router_logits {
            let c = Tensor::from_vec(counts, e_n, &Device::Cpu)?;
            let aux = ((c * s)?.sum_all()? * (e_n as f64 / (rows * rows) as f64))?;
            loss = (loss + (aux * mc.router_aux_loss_coef)?)?;
        }
    }
    let store: GradStore = loss.backward()?;
    let mut grads = HashMap::new();
    for (k, v) in &vars {
        let g = store.get(v.as_tensor()).ok_or_else(|| candle_core::Error::Msg(format!("reference: no gradient for {k}")))?;
        grads.insert(k.to_string(), g.to_dtype(DType::F32)?);
    }
    Ok((Reference { input_ids: ids.clone(), logits: logits.to_dtype(DType::F32)?, loss: loss.to_scalar::<f64>()?, grads }, margin))
}

/// Greedy generation of 6 tokens after `ids` `[B, T]`: the cached decode's logits equal the
/// full forward's rows (1e-4) on one device, and each of `layouts` decodes the same tokens
/// (logits within 1e-4) on every rank.
pub fn cached_generation_agrees(cfg: &LlamaConfig, full: &HashMap<String, Tensor>, ids: &Tensor, layouts: &[candle_cp_llama::Layout]) -> Result<()> {
    use candle_cp_llama::{shard_tensors, Layout, Llama, ParallelCtx};
    let gen = |layout: Layout| {
        candle_cp_comm::run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_tensors(full, cfg, &ctx)?;
            let m = Llama::new(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), cfg, &ctx)?;
            let out = m.generate_greedy(ids, 6)?;
            // the full forward of the prompt and the tokens, its last row before each token
            let toks = Tensor::from_vec(out.tokens.concat(), (out.tokens.len(), out.tokens[0].len()), &Device::Cpu)?;
            let seq = Tensor::cat(&[ids, &toks], 1)?;
            let all = if layout.world_size() == 1 { Some(m.forward(&seq, &Tensor::arange(0u32, seq.dim(1)? as u32, &Device::Cpu)?)?) } else { None };
            Ok((out, all))
        })
        .into_iter()
        .collect::<Result<Vec<_>>>()
    };
    let single = gen(Layout::single())?;
    let (want, Some(full_fwd)) = &single[0] else { candle_core::bail!("no full forward") };
    for (i, l) in want.logits.iter().enumerate() {
        let row = full_fwd.narrow(1, ids.dim(1)? - 1 + i, 1)?.squeeze(1)?;
        let e = max_abs(l, &row)?;
        assert!(e < 1e-4, "token {i}: cached logits differ from the full forward by {e:.1e}");
    }
    for &layout in layouts {
        for (r, (g, _)) in gen(layout)?.iter().enumerate() {
            assert_eq!(g.tokens, want.tokens, "{} {layout} rank {r}", cfg.arch().hf_names().0);
            for (a, b) in g.logits.iter().zip(&want.logits) {
                assert!(max_abs(a, b)? < 1e-4, "{layout} rank {r}");
            }
        }
    }
    Ok(())
}


/// Every kind of layout the architecture tests run: one device, ring 4, zigzag 4, striped 2,
/// Ulysses 2, 2-D, TP 2 without and with SP, zigzag 2 × TP 2 + SP, then `more`; and DP 2 over
/// two rows (ring 2). `label`'s model `(full, cfg)` on `ids` against `want` on each
/// ([`on_layouts`], `extra` its own parameters).
pub fn on_every_layout(label: &str, (full, cfg, ids, want): Case<'_>, more: &[candle_cp_llama::Layout], extra: (&dyn Fn(&str) -> bool, usize)) -> Result<()> {
    use candle_cp_llama::{CpKind, Layout};
    let mut layouts = vec![
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Striped, 2),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(2, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
    ];
    layouts.extend_from_slice(more);
    on_layouts(label, (full, cfg, ids, want), &layouts, extra)?;
    on_layouts(label, (full, cfg, &Tensor::cat(&[ids, ids], 0)?, &reference_rows(want)?), &[Layout::cp(CpKind::Ring, 2).with_dp(2)], extra)
}

/// A model and its reference: full weights, config, input ids, the reference's results.
pub type Case<'a> = (&'a HashMap<String, Tensor>, &'a LlamaConfig, &'a Tensor, &'a candle_cp_llama::verify::Reference);

/// The model `(full, cfg)` on `ids` on each of `layouts` against `want` within the oracle's
/// tolerances, every parameter compared, `count` of them those `extra` names (the
/// architecture's own).
pub fn on_layouts(label: &str, (full, cfg, ids, want): Case<'_>, layouts: &[candle_cp_llama::Layout], (extra, count): (&dyn Fn(&str) -> bool, usize)) -> Result<()> {
    use candle_cp_llama::verify::{compare, run_layout, Tolerances};
    for &layout in layouts {
        let rep = compare(&run_layout(full, cfg, ids, layout, &Device::Cpu)?, want, Tolerances::default())?;
        println!("{label} {layout}: logits {:.1e} loss {:.1e} grad rel {:.1e} ({})", rep.logits_abs, rep.loss_abs, rep.grad_rel_max, rep.worst_param);
        assert_eq!(rep.grad_rel.len(), want.grads.len(), "{label} {layout}: every parameter compared");
        assert_eq!(rep.grad_rel.iter().filter(|(k, _)| extra(k)).count(), count, "{label} {layout}");
        assert!(rep.pass(), "{label} {layout}: {rep:?}");
    }
    Ok(())
}

/// Max |a - b| in f64.
pub fn max_abs(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()
}

/// The reference of a batch of two copies of its row: the same loss and gradients.
pub fn reference_rows(r: &Reference) -> Result<Reference> {
    Ok(Reference {
        input_ids: Tensor::cat(&[&r.input_ids, &r.input_ids], 0)?,
        logits: Tensor::cat(&[&r.logits, &r.logits], 0)?,
        loss: r.loss,
        grads: r.grads.clone(),
    })
}

/// The checkpoint in `dir` read sharded on `layout` ([`candle_cp_llama::load_hf_sharded`])
/// gives each rank exactly its shards of `full`.
pub fn sharded_load_matches(dir: &std::path::Path, full: &HashMap<String, Tensor>, cfg: &LlamaConfig, layout: candle_cp_llama::Layout) -> Result<()> {
    use candle_cp_llama::{load_hf_sharded, shard_tensors, ParallelCtx};
    for r in candle_cp_comm::run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let want = candle_cp_llama::params::varmap_tensors(&shard_tensors(full, cfg, &ctx)?)?;
        let got = candle_cp_llama::params::varmap_tensors(&load_hf_sharded(dir, &ctx, &Device::Cpu, DType::F32)?.0)?;
        let mut same = want.len() == got.len();
        for (k, w) in &want {
            same &= got.get(k).map(|g| max_abs(g, w).map(|e| e == 0.0)).transpose()? == Some(true);
        }
        Ok(same)
    }) {
        assert!(r?, "{}, {layout}: the sharded load differs from sharding the whole model", dir.display());
    }
    Ok(())
}

/// [`sharded_load_matches`], and `full`'s shards on `layout` written by the sharded writer into
/// `out` are `bytes` (save_hf's file of `full`), byte for byte.
pub fn sharded_load_and_save(dir: &std::path::Path, full: &HashMap<String, Tensor>, cfg: &LlamaConfig, layout: candle_cp_llama::Layout, out: &std::path::Path, bytes: &[u8]) -> Result<()> {
    use candle_cp_llama::{save_hf_sharded, shard_tensors, ParallelCtx};
    sharded_load_matches(dir, full, cfg, layout)?;
    for r in candle_cp_comm::run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let mine = candle_cp_llama::params::varmap_tensors(&shard_tensors(full, cfg, &ctx)?)?;
        save_hf_sharded(out, &mine, cfg, &ctx, ctx.world.rank() == 0)
    }) {
        r?;
    }
    let written = std::fs::read(out.join("model.safetensors")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert!(written == bytes, "{layout}: the sharded writer's bytes differ from save_hf's");
    Ok(())
}
