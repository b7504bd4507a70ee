//! Seeded random model shapes and parallel layouts: the Llama's logits, loss and every
//! parameter gradient on the layout equal the single-device run, and the ranks agree.
//!
//! `llama_parity.rs` runs every layout on the oracle checkpoint (one shape); this draws the
//! shapes too: hidden width, depth, query and KV heads (MHA, GQA, MQA), a sliding window or
//! none, batch and length, then a layout that fits them: ring (contiguous), zigzag, striped,
//! all-gather, Ulysses or 2-D CP of degree 2 or 4, optionally with TP 2 or 4 (with or without
//! SP; TP above the KV-head count replicates KV heads; one model in six has 12 query heads over 3 KV
//! heads, which TP 2 and 4 copy `lcm(3, tp)/3` times; a vocabulary of 37 is padded over TP) or DP 2,
//! Ulysses and 2-D half the time with the head layout regathered in the backward, a third of
//! the models with Qwen2's q, k, v biases, Qwen3's q / k head norms and Gemma 3 a quarter
//! each (their window on one of two layers only in most of the draws that can have one), a
//! third of the rest Gemma 2 (logit soft caps in attention and on the output), half of the
//! Qwen3 ones Qwen3-MoE (4 or 8 experts, 1 to 3 per token, renormalised or not, the
//! load-balancing loss on or off, one layer of two dense or none), half of the Qwen2 ones
//! Qwen2-MoE (a shared expert too), a third of the other Llama ones Mixtral (half of those
//! without a window GraniteMoE, its multipliers drawn) and a third of those left Phi-3 with LongRoPE (an original length below T or not, factors drawn: the
//! short or long factors must be those of the whole sequence on every rank; half of them with
//! Phi-4-mini's partial RoPE over half of each head), a quarter of those left SmolLM3 (layers
//! without RoPE drawn, at least one) and the rest without a window Granite (its
//! multipliers drawn); a third of the dense Qwen3 draws are OLMo (OLMo 3 with a window, half of
//! those with YaRN, whose sliding layers rotate unscaled), a quarter of the other dense Qwen3
//! ones EXAONE 4 (NoPE on the layers without the window), half of the plain Qwen2 ones without a
//! window GLM-4 (norms before and after each branch, RoPE on half of each head), a third of the Qwen3-MoE ones
//! without a window or a dense layer OLMoE. Draws the model cannot split (heads that TP or Ulysses do not divide, lengths the
//! layout cannot shard) are refused with an error that says why, never a panic.
//!
//! The second test runs the same draws on packed documents (`packed_run::run_packed`) against
//! the single-device packed run. `CANDLE_CP_RANDOM_SEEDS=A..B` draws configurations `A..B`.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_llama::layout::{CpKind, HeadLayout, Layout};
use candle_cp_llama::params::varmap_tensors;
use candle_cp_llama::verify::{compare, run_layout, Reference, Tolerances};
use candle_cp_llama::{init_params, LlamaConfig};
use candle_cp_llama::train::Rng;
use candle_cp_llama::Documents;
use candle_cp_tests::draws::{doc_lengths, pick, rng, seeds};
use candle_cp_tests::packed_run::{max_diff, run_packed};
use std::collections::HashMap;

const CONFIGS: u64 = 120;

/// One drawn model and layout (see the module docs).
struct Draw {
    cfg: LlamaConfig,
    layout: Layout,
    b: usize,
    t: usize,
    window: Option<usize>,
    what: String,
}

fn draw(d: &mut Rng, seed: u64) -> Draw {
    let drawn = pick(d, &[(4, 4), (4, 2), (4, 1), (8, 2), (2, 2), (2, 1)]);
    // one model in six: 12 query heads over 3 KV heads, which TP 2 and 4 neither divide nor
    // are divided by (each rank holds 3 KV-head copies; a stream of its own, so the other
    // draws of every seed stay what they were)
    let (heads, kv_heads) = if rng(990_000 + seed).below(6) == 0 { (12, 3) } else { drawn };
    let hidden = heads * pick(d, &[4, 8]);
    let layers = pick(d, &[1, 2]);
    let vocab = pick(d, &[37, 64]);
    let b = pick(d, &[1, 2]);
    let t = pick(d, &[16, 24, 32, 48]);
    let window = (d.below(3) == 0).then(|| 1 + d.below(t + 4));
    // the architecture: Llama, Qwen2 (q, k, v biases), Qwen3 (q / k head norms) or Gemma 3, a
    // quarter each (a stream of its own, as below)
    let arch = rng(910_000 + seed).below(4);
    let (bias, qk_norm) = (arch == 1, arch == 2);
    let cfg = LlamaConfig::tiny(vocab, hidden, layers, heads, kv_heads)
        .with_sliding_window(window)
        .with_qkv_bias(bias)
        .with_qk_norm(qk_norm)
        .with_gemma3(arch == 3);
    // a third of the Llama draws are Gemma 2 instead, with soft caps small enough to bind on
    // these logits (streams of their own)
    let cfg = match arch == 0 && rng(930_000 + seed).below(3) == 0 {
        true => {
            let mut c = cfg.with_gemma2(true);
            let mut caps = rng(940_000 + seed);
            if let Some(g) = c.gemma2.as_mut() {
                (g.attn_logit_softcapping, g.final_logit_softcapping) = (Some(pick(&mut caps, &[0.3, 1.0])), Some(pick(&mut caps, &[0.5, 3.0])));
            }
            c
        }
        false => cfg,
    };
    // half of the Qwen3 draws are Qwen3-MoE (a stream of its own)
    let mut m = rng(950_000 + seed);
    let cfg = match arch == 2 && m.below(2) == 0 {
        true => {
            let mut moe = candle_cp_llama::MoeConfig::new(pick(&mut m, &[4, 8]), 1 + m.below(3), pick(&mut m, &[8, 16]));
            moe.norm_topk_prob = m.below(2) == 0;
            (moe.output_router_logits, moe.router_aux_loss_coef) = (m.below(2) == 0, 0.3);
            if layers == 2 && m.below(2) == 0 {
                moe.mlp_only_layers = vec![m.below(2)];
            }
            cfg.with_moe(Some(moe))
        }
        false => cfg,
    };
    // half of the Qwen2 draws are Qwen2-MoE (a shared expert; a stream of its own)
    let mut q2 = rng(970_000 + seed);
    let cfg = match arch == 1 && q2.below(2) == 0 {
        true => {
            let mut moe = candle_cp_llama::MoeConfig::qwen2_moe(pick(&mut q2, &[4, 8]), 1 + q2.below(3), pick(&mut q2, &[8, 16]), pick(&mut q2, &[8, 24]));
            moe.norm_topk_prob = q2.below(2) == 0;
            (moe.output_router_logits, moe.router_aux_loss_coef) = (q2.below(2) == 0, 0.3);
            cfg.with_moe(Some(moe))
        }
        false => cfg,
    };
    // a third of the Qwen2-MoE draws without a window are GLM-4.5 (sigmoid scores chosen with a
    // correction bias within expert groups, scaled; ungated shared experts, 1 or 2 wide; the
    // first layer dense or not; head norms or not; RoPE on half of each head, where that half is
    // even; a stream of its own)
    let mut g45 = rng(996_000 + seed);
    let cfg = match cfg.moe.clone().filter(|m| m.style == candle_cp_llama::MoeStyle::Qwen2Moe && window.is_none() && cfg.head_dim.is_multiple_of(4) && g45.below(3) == 0) {
        Some(m) => {
            let (e, k) = (m.num_experts, m.num_experts_per_tok);
            let mut g = candle_cp_llama::MoeConfig::glm4_moe(e, k, m.moe_intermediate_size, 1 + g45.below(2), pick(&mut g45, &[1.0, 2.5]));
            // groups of 2 or 4 experts, enough kept for K
            let groups: Vec<(usize, usize)> = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 3)].into_iter().filter(|&(n, keep)| e.is_multiple_of(n) && e / n >= 2 && k <= keep * (e / n)).collect();
            g.groups = groups[g45.below(groups.len())];
            g.norm_topk_prob = g45.below(2) == 0;
            if layers == 2 && g45.below(2) == 0 {
                g.mlp_only_layers = vec![0];
            }
            cfg.with_moe(Some(g)).with_qk_norm(g45.below(2) == 0)
        }
        None => cfg,
    };
    // half of the GLM-4.5 draws are DeepSeek-V3 (its latent attention in place of q, k, v: a q
    // rank or one q_proj, a KV rank, the nope / rope / v widths, RoPE interleaved or not; no q,
    // k, v biases or head norms; a stream of its own)
    let mut ds = rng(997_000 + seed);
    let cfg = match cfg.arch() == candle_cp_llama::Arch::Glm4Moe && ds.below(2) == 0 {
        true => {
            let mla = candle_cp_llama::config::deepseek::Mla {
                q_lora_rank: pick(&mut ds, &[None, Some(cfg.hidden_size / 2), Some(24)]),
                kv_lora_rank: pick(&mut ds, &[8, 16, 32]),
                qk_nope_head_dim: pick(&mut ds, &[4, 8, 12]),
                qk_rope_head_dim: pick(&mut ds, &[2, 4, 8]),
                v_head_dim: pick(&mut ds, &[4, 8, 16, 24]),
                rope_interleave: ds.below(2) == 0,
            };
            let cfg = cfg.with_qkv_bias(false).with_qk_norm(false).with_mla(Some(mla));
            // half of them DeepSeek-V2: its softmax router over the same experts and groups
            // (a group's score its best expert's), scaled, never renormalised; RoPE interleaved
            if ds.below(2) == 0 { candle_cp_tests::mla_ref::as_deepseek_v2(cfg) } else { cfg }
        }
        false => cfg,
    };
    // half of the remaining plain Qwen2 draws are gpt-oss (attention sinks, biases on o, the
    // router and the experts, the clamped SwiGLU; a stream of its own)
    let mut go = rng(990_000 + seed);
    let cfg = match arch == 1 && cfg.moe.is_none() && go.below(2) == 0 {
        true => cfg.with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(pick(&mut go, &[4, 8]), 1 + go.below(2), pick(&mut go, &[8, 16])))),
        false => cfg,
    };
    // half of the remaining plain Qwen2 draws without a window are GLM-4 (norms before and
    // after each branch, RoPE on half of each head; where that half is even; a stream of its own),
    // a third of those GLM (GLM-4's RoPE with a Llama's norms)
    let cfg = match arch == 1 && cfg.moe.is_none() && window.is_none() && (cfg.head_dim / 2).is_multiple_of(2) && rng(995_000 + seed).below(2) == 0 {
        true => cfg.with_glm(Some(if rng(995_500 + seed).below(3) == 0 { candle_cp_llama::Glm::Glm } else { candle_cp_llama::Glm::Glm4 })),
        false => cfg,
    };
    // a third of the remaining Llama draws are Mixtral (its window, if drawn, on every layer)
    let mut mx = rng(960_000 + seed);
    let cfg = match arch == 0 && cfg.gemma2.is_none() && mx.below(3) == 0 {
        true => {
            let mut moe = candle_cp_llama::MoeConfig::mixtral(pick(&mut mx, &[4, 8]), 1 + mx.below(2), pick(&mut mx, &[8, 16]));
            (moe.output_router_logits, moe.router_aux_loss_coef) = (mx.below(2) == 0, 0.3);
            cfg.with_moe(Some(moe))
        }
        false => cfg,
    };
    // a third of the remaining plain Llama draws are Phi-3 with LongRoPE: an original length
    // below T or not (the long or the short factors, chosen over the whole sequence whatever
    // each rank holds), factors drawn (a stream of its own); half of those rotate half of each
    // head only (Phi-4-mini's partial RoPE, where that half is even; a stream of its own too)
    let mut ph = rng(980_000 + seed);
    let cfg = match arch == 0 && cfg.gemma2.is_none() && cfg.moe.is_none() && ph.below(3) == 0 {
        true => {
            let partial = rng(985_000 + seed).below(2) == 0 && (cfg.head_dim / 2) % 2 == 0;
            let cfg = cfg.with_phi3(true).with_partial_rotary_factor(if partial { 0.5 } else { 1.0 });
            let n = cfg.rope_dim() / 2;
            let original = pick(&mut ph, &[t / 4, t / 2, t, 2 * t]);
            let mut c = cfg;
            c.max_position_embeddings = original * pick(&mut ph, &[1, 4, 16]);
            let mut factors = |top: f64| (0..n).map(|_| 1.0 + top * ph.below(1000) as f64 / 1000.0).collect::<Vec<f64>>();
            let (short_factor, long_factor) = (factors(1.0), factors(30.0));
            c.rope_scaling = candle_cp_llama::RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings: original,
                factor: c.max_position_embeddings as f64 / original as f64,
                attention_factor: None,
            };
            c
        }
        false => cfg,
    };
    // a quarter of the remaining plain Llama draws are SmolLM3: each layer without RoPE with
    // probability 1/2, at least one (a stream of its own)
    let mut nope = rng(975_000 + seed);
    let cfg = match arch == 0 && cfg.gemma2.is_none() && cfg.moe.is_none() && !cfg.phi3 && nope.below(4) == 0 {
        true => {
            let mut n: Vec<bool> = (0..layers).map(|_| nope.below(2) == 0).collect();
            n[nope.below(layers)] = true;
            cfg.with_nope_layers(Some(n))
        }
        false => cfg,
    };
    // the remaining plain Llama draws without a window are Granite (about 2%: none may fall in
    // the suite's draws; tests/llama_smollm3_granite.rs pins it): its four multipliers drawn (a
    // stream of its own)
    let mut gr = rng(977_000 + seed);
    // (GraniteConfig has no window)
    let cfg = match arch == 0 && window.is_none() && cfg.gemma2.is_none() && cfg.moe.is_none() && !cfg.phi3 && cfg.nope_layers.is_none() {
        true => cfg.with_granite(Some(candle_cp_llama::Granite {
            embedding_multiplier: pick(&mut gr, &[1.0, 3.0, 12.0]),
            attention_multiplier: pick(&mut gr, &[0.05, 0.2, 0.5]),
            residual_multiplier: pick(&mut gr, &[0.22, 0.5, 1.0]),
            logits_scaling: pick(&mut gr, &[1.0, 4.0, 16.0]),
        })),
        false => cfg,
    };
    // half of the Mixtral draws without a window are GraniteMoE: the same experts under
    // Granite's multipliers, drawn (a stream of its own)
    let mut gm = rng(978_000 + seed);
    let cfg = match cfg.moe.clone().filter(|m| m.style == candle_cp_llama::MoeStyle::Mixtral && window.is_none() && gm.below(2) == 0) {
        Some(m) => {
            let mut g = candle_cp_llama::MoeConfig::granite_moe(m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size);
            (g.output_router_logits, g.router_aux_loss_coef) = (m.output_router_logits, m.router_aux_loss_coef);
            cfg.with_moe(Some(g)).with_granite(Some(candle_cp_llama::Granite {
                embedding_multiplier: pick(&mut gm, &[1.0, 3.0, 12.0]),
                attention_multiplier: pick(&mut gm, &[0.05, 0.2, 0.5]),
                residual_multiplier: pick(&mut gm, &[0.22, 0.5, 1.0]),
                logits_scaling: pick(&mut gm, &[1.0, 4.0, 16.0]),
            }))
        }
        None => cfg,
    };
    // a third of the dense Qwen3 draws are OLMo (norms after the branches only, q / k norms
    // over the whole projections): OLMo 3 with a window, half of those with YaRN (the sliding
    // layers rotate unscaled), else OLMo 2 (a stream of its own)
    let mut ol = rng(987_000 + seed);
    let cfg = match arch == 2 && cfg.moe.is_none() && ol.below(3) == 0 {
        true => {
            let o = if window.is_some() { candle_cp_llama::Olmo::Olmo3 } else { candle_cp_llama::Olmo::Olmo2 };
            let mut c = cfg.with_qk_norm(false).with_olmo(Some(o));
            if window.is_some() && ol.below(2) == 0 {
                let original = pick(&mut ol, &[t / 4, t / 2]);
                c.rope_scaling = candle_cp_llama::RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: original, beta_fast: 32.0, beta_slow: 1.0, attention_factor: None, mscale: None, mscale_all_dim: None, truncate: true };
            }
            c
        }
        false => cfg,
    };
    // a third of the Qwen3-MoE draws with every layer sparse and no window are OLMoE (OLMo's
    // q / k norms in place of the head norms; a stream of its own)
    let cfg = match arch == 2 && window.is_none() && cfg.moe.as_ref().is_some_and(|m| m.mlp_only_layers.is_empty()) && rng(988_000 + seed).below(3) == 0 {
        true => cfg.with_olmo(Some(candle_cp_llama::Olmo::Olmoe)),
        false => cfg,
    };
    // Qwen's window on one of two layers only, in three quarters of the draws that can have
    // it (a stream of its own)
    let mut per_layer = rng(920_000 + seed);
    let cfg = match (window, arch, layers, per_layer.below(4)) {
        (Some(_), 1..=3, 2, 1..) => cfg.with_sliding_layers(Some(if per_layer.below(2) == 0 { vec![true, false] } else { vec![false, true] })),
        _ => cfg,
    };
    // a quarter of the remaining dense Qwen3 draws are EXAONE 4 (OLMo 2's norms with the head
    // norms; with a window, NoPE on the layers without it; a stream of its own)
    let cfg = match arch == 2 && cfg.qk_norm && cfg.moe.is_none() && rng(986_000 + seed).below(4) == 0 {
        true => cfg.with_exaone4(true),
        false => cfg,
    };
    let cp = pick(d, &[2, 4]);
    let kind = pick(d, &[CpKind::Ring, CpKind::Zigzag, CpKind::Striped, CpKind::AllGather, CpKind::Ulysses, CpKind::TwoD]);
    let mut layout = match kind {
        CpKind::TwoD => Layout::two_d(2, cp / 2),
        k => Layout::cp(k, cp),
    };
    match d.below(4) {
        // TP 4 on 2 or 1 KV heads replicates each KV head over 2 or 4 TP ranks
        0 => layout = layout.with_tp(pick(d, &[2, 4]), d.below(2) == 0),
        1 => layout = layout.with_dp(2),
        _ => {}
    }
    // the 12 / 3-head models: half of those without TP get TP 2 or 4 (a stream of its own)
    let mut mixed = rng(995_000 + seed);
    if heads == 12 && layout.tp == 1 && mixed.below(2) == 0 {
        layout = layout.with_tp(pick(&mut mixed, &[2, 4]), mixed.below(2) == 0);
    }
    // Ulysses / 2-D: half of them with the head layout regathered in the backward (a stream
    // of its own, so the other draws of every seed stay what they were)
    if matches!(kind, CpKind::Ulysses | CpKind::TwoD) && rng(900_000 + seed).below(2) == 0 {
        layout = layout.with_head_layout(HeadLayout::Regathered);
    }
    // a mixture of experts: half of them with the experts split over EP ranks (a divisor of
    // dp · cp that divides the experts; a stream of its own)
    if let Some(m) = &cfg.moe {
        let mut e = rng(940_000 + seed);
        let ways: Vec<usize> = (2..=layout.dp * layout.cp).filter(|p| (layout.dp * layout.cp).is_multiple_of(*p) && m.num_experts.is_multiple_of(*p)).collect();
        if !ways.is_empty() && e.below(2) == 0 {
            layout = layout.with_ep(pick(&mut e, &ways));
        }
    }
    let what = format!(
        "config {seed}: {layout}, B {b} T {t}, vocab {vocab} hidden {hidden} layers {layers} heads {heads}/{kv_heads} window {window:?} on {:?} {:?}{}",
        cfg.sliding_layers,
        cfg.arch(),
        cfg.gemma2.as_ref().map_or(String::new(), |g| format!(" caps {:?} / {:?}", g.attn_logit_softcapping, g.final_logit_softcapping))
            + &cfg.moe.as_ref().map_or(String::new(), |m| format!(" experts {} top {} norm {} aux {} dense {:?}", m.num_experts, m.num_experts_per_tok, m.norm_topk_prob, m.output_router_logits, m.mlp_only_layers))
    );
    Draw { cfg, layout, b, t, window, what }
}

/// `[b, t]` token ids below `vocab`, varied by `seed`.
fn token_ids(b: usize, t: usize, vocab: usize, seed: u64) -> Result<Tensor> {
    let toks: Vec<u32> = (0..b * t).map(|i| ((i * 7 + seed as usize * 13 + i * i) % vocab) as u32).collect();
    Tensor::from_vec(toks, (b, t), &Device::Cpu)
}

/// The worst relative gradient error over the parameters and its parameter: each parameter's
/// `max |g - r|` over `max(max |r|, 1e-2 · the largest gradient of the model)`. A parameter
/// whose gradient is zero in exact arithmetic (q_proj and k_proj under a window of 1 key:
/// softmax over one key) holds float noise on both sides, from sums of terms that cancel; the
/// floor keeps that noise from counting as an error (config 2290, a Qwen3-MoE with a window of
/// 1 on zigzag 2 × TP 2 + SP: q_proj's gradient 5.1e-9 at most, the runs 1.7e-8 apart, the
/// largest gradient 0.155 — 1.1e-4 of the old floor of 1e-3, 1.1e-5 of this one).
fn worst_grad<'a>(run: impl IntoIterator<Item = (&'a String, &'a Tensor)>, reference: &HashMap<String, Tensor>) -> Result<(f64, String)> {
    let mut largest = 0f32;
    for r in reference.values() {
        largest = largest.max(r.abs()?.max_all()?.to_scalar::<f32>()?);
    }
    let floor = (1e-2 * largest).max(1e-12);
    let mut worst = (0f64, String::new());
    for (name, g) in run {
        let Some(r) = reference.get(name) else { candle_core::bail!("no reference gradient for {name}") };
        let scale = r.abs()?.max_all()?.to_scalar::<f32>()?.max(floor) as f64;
        let err = (g - r)?.abs()?.max_all()?.to_scalar::<f32>()? as f64 / scale;
        if err >= worst.0 {
            worst = (err, name.clone());
        }
    }
    Ok(worst)
}

#[test]
fn random_shapes_and_layouts_equal_single_device() -> Result<()> {
    let tol = Tolerances { logits_abs: 2e-5, loss_abs: 2e-5, grad_rel: 1e-4 };
    let (mut checked, mut refused, mut tp, mut dp, mut windowed) = (0, 0, 0, 0, 0);
    let (mut kv_copies, mut padded, mut regathered, mut biased, mut normed) = (0, 0, 0, 0, 0);
    let (mut some_layers, mut gemma, mut gemma2, mut moe, mut ep) = (0, 0, 0, 0, 0);
    let (mut phi3, mut partial, mut mixed, mut gpt_oss, mut smollm3, mut granite, mut glm4, mut glm, mut glm45) = (0, 0, 0, 0, 0, 0, 0, 0, 0);
    let (mut olmo, mut exaone, mut deepseek, mut deepseek_v2) = (0, 0, 0, 0);
    let range = seeds(CONFIGS)?;
    let n_configs = range.end - range.start;
    // (the corners are asserted for draws at least as many as the suite's)
    let corners = n_configs >= CONFIGS;
    for seed in range {
        let Draw { cfg, layout, b, t, window, what } = draw(&mut rng(1000 + seed), seed);
        let (kv_heads, vocab) = (cfg.num_key_value_heads, cfg.vocab_size);

        let mut full = varmap_tensors(&init_params(&cfg, seed + 1, DType::F32, &Device::Cpu)?)?;
        // gpt-oss: sinks around 2 (the init's are near 0, where a misplaced sink hides)
        for (k, t) in full.iter_mut().filter(|(k, _)| k.ends_with(".sinks")) {
            *t = ((&*t * 100.0)? + 2.0).map_err(|e| candle_core::Error::Msg(format!("{k}: {e}")))?;
        }
        // GLM-4.5: correction biases of std 0.3 (the init's are 0, where they choose nothing)
        for (k, t) in full.iter_mut().filter(|(k, _)| k.ends_with(candle_cp_llama::params::CORRECTION_BIAS)) {
            *t = (candle_cp_tests::rand_t(seed + 3, k, t.dims())? * 0.3)?;
        }
        let ids = token_ids(b, t, vocab, seed)?;
        let single = run_layout(&full, &cfg, &ids, Layout::single(), &Device::Cpu)?;
        let reference = Reference {
            input_ids: ids.clone(),
            logits: single.logits.clone(),
            loss: single.loss,
            grads: single.grads.iter().cloned().collect(),
        };
        match run_layout(&full, &cfg, &ids, layout, &Device::Cpu) {
            Ok(run) => {
                let rep = compare(&run, &reference, tol)?;
                let worst = worst_grad(run.grads.iter().map(|(n, g)| (n, g)), &reference.grads)?;
                assert!(
                    rep.logits_abs <= tol.logits_abs && rep.loss_abs <= tol.loss_abs && worst.0 <= tol.grad_rel && rep.rank_spread <= 1e-6,
                    "{what}: logits {:.1e} loss {:.1e} grad {:.1e} ({}) rank spread {:.1e}",
                    rep.logits_abs, rep.loss_abs, worst.0, worst.1, rep.rank_spread
                );
                checked += 1;
                tp += (layout.tp > 1) as usize;
                kv_copies += (layout.tp > kv_heads && layout.tp.is_multiple_of(kv_heads)) as usize;
                mixed += (layout.tp > 1 && !kv_heads.is_multiple_of(layout.tp) && !layout.tp.is_multiple_of(kv_heads)) as usize;
                padded += (layout.tp > 1 && !vocab.is_multiple_of(layout.tp)) as usize;
                dp += (layout.dp > 1) as usize;
                windowed += window.is_some() as usize;
                regathered += (layout.head_layout == HeadLayout::Regathered && layout.cp > 1) as usize;
                biased += cfg.qkv_bias as usize;
                normed += cfg.qk_norm as usize;
                some_layers += cfg.sliding_layers.is_some() as usize;
                gemma += cfg.gemma3.is_some() as usize;
                gemma2 += cfg.gemma2.is_some() as usize;
                moe += cfg.moe.is_some() as usize;
                ep += (layout.ep > 1) as usize;
                phi3 += cfg.phi3 as usize;
                smollm3 += cfg.nope_layers.is_some() as usize;
                granite += cfg.granite.is_some() as usize;
                glm4 += cfg.is_glm4() as usize;
                glm += (cfg.arch() == candle_cp_llama::Arch::Glm) as usize;
                glm45 += (cfg.arch() == candle_cp_llama::Arch::Glm4Moe) as usize;
                deepseek += cfg.mla.is_some() as usize;
                deepseek_v2 += (cfg.arch() == candle_cp_llama::Arch::DeepseekV2) as usize;
                olmo += cfg.olmo.is_some() as usize;
                exaone += cfg.exaone4 as usize;
                partial += (cfg.partial_rotary_factor != 1.0) as usize;
                gpt_oss += cfg.gpt_oss as usize;
            }
            Err(e) => {
                assert_explained(&what, &e);
                refused += 1;
            }
        }
    }
    println!("{checked} configurations checked ({tp} with TP, {kv_copies} of them with replicated KV heads, {mixed} with KV-head copies mixed over the TP ranks, {padded} with a padded vocabulary, {dp} with DP, {windowed} with a window ({some_layers} on one layer of two), {regathered} Ulysses / 2-D with the head layout regathered, {biased} with q, k, v biases, {normed} with q / k head norms, {gemma} of them Gemma 3, {gemma2} Gemma 2, {moe} mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss: {gpt_oss}), {ep} with expert parallelism, {phi3} Phi-3 with LongRoPE ({partial} with a partial RoPE), {smollm3} SmolLM3 with NoPE layers, {granite} Granite or GraniteMoE, {glm4} GLM-4, {glm} GLM, {glm45} GLM-4.5, {deepseek} DeepSeek-V3 or -V2 ({deepseek_v2} V2), {olmo} OLMo, {exaone} EXAONE 4), {refused} refused");
    assert!(
        checked >= n_configs as usize / 2
            && (!corners || (tp >= 3 && kv_copies >= 2 && mixed >= 1 && padded >= 2 && dp >= 3 && windowed >= 3 && some_layers >= 2 && regathered >= 3 && biased >= 3 && normed >= 3 && gemma >= 3 && gemma2 >= 3 && moe >= 3 && phi3 >= 2 && partial >= 1 && gpt_oss >= 1 && smollm3 >= 1 && olmo >= 1)),
        "{checked} checked, {tp} TP ({kv_copies} with KV copies, {mixed} mixed, {padded} padded vocabularies), {dp} DP, {windowed} window ({some_layers} on one layer of two), {regathered} regathered, {biased} biased, {normed} with head norms"
    );
    Ok(())
}

const PACKED_CONFIGS: u64 = 60;

/// Packed documents through the drawn models and layouts: documents with boundaries anywhere
/// (length-1 documents, one document), one set per batch row or shared, a window or none,
/// sometimes recomputed layers. The packed loss, logits, per-token losses and gradients on the
/// layout equal the single-device packed run (which `llama_packed.rs` ties to running each
/// document alone), and the ranks agree.
#[test]
fn random_packed_documents_equal_single_device() -> Result<()> {
    let (mut checked, mut refused, mut per_row, mut len_one, mut recomputed) = (0, 0, 0, 0, 0);
    let range = seeds(PACKED_CONFIGS)?;
    let n_configs = range.end - range.start;
    let corners = n_configs >= PACKED_CONFIGS;
    for seed in range {
        let mut d = rng(5000 + seed);
        let Draw { cfg, layout, b, t, what, .. } = draw(&mut d, seed);
        let mut docs = vec![Documents::from_lengths(&doc_lengths(&mut d, t))?];
        if b == 2 && d.below(2) == 0 {
            docs.push(Documents::from_lengths(&doc_lengths(&mut d, t))?);
        }
        let recompute = d.below(4) == 0;
        let what = format!("{what}, documents {docs:?}, recompute {recompute}");
        let full = varmap_tensors(&init_params(&cfg, seed + 7, DType::F32, &Device::Cpu)?)?;
        let ids = token_ids(b, t, cfg.vocab_size, seed)?;
        let single = run_packed(&full, &cfg, &ids, &docs, Layout::single(), false)?;
        match run_packed(&full, &cfg, &ids, &docs, layout, recompute) {
            Ok(run) => {
                let dl = max_diff(&run.logits, &single.logits);
                // (token_nll_packed is not computed under recompute)
                let dn = if recompute { 0.0 } else { max_diff(&run.nll, &single.nll) };
                let dloss = (run.loss - single.loss).abs();
                let reference: HashMap<String, Tensor> = single.grads.iter().cloned().collect();
                let worst = worst_grad(run.grads.iter().map(|(n, g)| (n, g)), &reference)?;
                assert!(
                    dl <= 2e-5 && dn <= 2e-5 && dloss <= 2e-5 && worst.0 <= 1e-4 && run.spread <= 1e-6,
                    "{what}: logits {dl:.1e} nll {dn:.1e} loss {dloss:.1e} grad {:.1e} ({}) rank spread {:.1e}",
                    worst.0, worst.1, run.spread
                );
                checked += 1;
                per_row += (docs.len() == 2) as usize;
                len_one += docs.iter().any(|x| (0..x.count()).any(|i| x.range(i).1 - x.range(i).0 == 1)) as usize;
                recomputed += recompute as usize;
            }
            Err(e) => {
                assert_explained(&what, &e);
                refused += 1;
            }
        }
    }
    println!("{checked} packed configurations checked ({per_row} with documents per row, {len_one} with length-1 documents, {recomputed} recomputed), {refused} refused");
    assert!(
        checked >= n_configs as usize / 2 && (!corners || (per_row >= 3 && len_one >= 3 && recomputed >= 3)),
        "{checked} checked, {refused} refused, {per_row} per row, {len_one} with length-1 documents, {recomputed} recomputed"
    );
    Ok(())
}

/// A draw the model cannot split must be refused for a reason the draw explains (heads or
/// lengths that do not divide), never with a panic.
fn assert_explained(what: &str, e: &candle_core::Error) {
    let msg = e.to_string();
    let explained = ["divisible", "must divide", "needs"].iter().any(|k| msg.contains(k));
    assert!(explained && !msg.contains("panicked"), "{what}: refused for an unexpected reason: {msg}");
}
