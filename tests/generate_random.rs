//! Seeded random generation: drawn models, prompts and layouts decode with the KV cache sharded
//! over the CP ranks and give the single-device tokens and logits.
//!
//! `llama_generate.rs` pins the oracle checkpoint and one prompt; this draws the model (width,
//! depth, query / KV heads, vocabulary, a sliding window; gpt-oss in a fifth of the models,
//! SmolLM3's layers without RoPE in a quarter of the others, OLMo 2 / 3 in a quarter of the
//! rest, EXAONE 4 in a quarter of those left, GraniteMoE and then GLM-4 in a quarter of the
//! rest without a window each), the prompt (batch, length), the
//! number of new tokens, the layout (every CP kind, CP 2 or 4, TP 2 with or without SP, DP 2)
//! and the sampling (greedy, or temperature / top-k / top-p from a seed). Every rank must
//! return the same tokens and logits bit for bit, and those must be the single device's: the
//! logits within 1e-4 at every step, the tokens equal. Float rounding may part the tokens only
//! where the single device's choice was a near tie: for greedy decoding the two best logits
//! within 2e-4 (checked), for sampling a draw on a boundary of the cumulative probabilities
//! (counted; must stay rare). From there on the two continuations are not comparable and the
//! check stops. A draw the layout cannot run must be refused for a reason the draw explains.
//! A third of the draws also batch 2 or 4 prompts of different lengths ([`Llama::generate_ragged`]):
//! on one device each row must follow its prompt generated alone (greedy), and on the layout
//! the batch must give the single device's batch.
//! `CANDLE_CP_RANDOM_SEEDS=A..B` draws configurations `A..B`.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::params::varmap_tensors;
use candle_cp_llama::{init_params, shard_tensors, Generation, Llama, LlamaConfig, ParallelCtx, Sampling};
use candle_cp_tests::draws::{pick, rng, seeds};
use candle_nn::VarBuilder;
use std::collections::HashMap;

const CONFIGS: u64 = 40;
const TOL: f32 = 1e-4;

fn generate(full: &HashMap<String, Tensor>, cfg: &LlamaConfig, layout: Layout, ids: &Tensor, new: usize, s: Sampling) -> Result<Vec<Generation>> {
    generate_with(full, cfg, layout, |m| m.generate(ids, new, s))
}

fn generate_with(full: &HashMap<String, Tensor>, cfg: &LlamaConfig, layout: Layout, f: impl Fn(&Llama) -> Result<Generation> + Sync) -> Result<Vec<Generation>> {
    run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = shard_tensors(full, cfg, &ctx)?;
        f(&Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), cfg, &ctx)?)
    })
    .into_iter()
    .collect()
}

/// Generations `got` against `want` (the same rows) step by step until the tokens part, which
/// greedy decoding may do only on a near tie of `want`'s logits; returns whether they parted.
/// `rows` maps got's rows to want's (`None`: all, in order); steps past `want`'s end are not
/// compared.
fn follows(got: &Generation, want: &Generation, rows: &[(usize, usize)], greedy: bool, what: &str) -> Result<bool> {
    for i in 0..want.logits.len().min(got.logits.len()) {
        for &(g, w) in rows {
            let e = max_abs_diff(&got.logits[i].get(g)?, &want.logits[i].get(w)?)?;
            assert!(e < TOL, "{what}: token {i} row {g}: logits differ by {e:.2e}");
        }
        for &(g, w) in rows {
            let (mine, theirs) = (got.tokens[g].get(i), want.tokens[w].get(i));
            if mine != theirs {
                if greedy {
                    let gap = top2_gap(&want.logits[i].get(w)?.to_vec1::<f32>()?);
                    assert!(gap < 2.0 * TOL, "{what}: token {i} row {g}: {mine:?} vs {theirs:?} with the best two logits {gap:.2e} apart");
                }
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Prompts of different lengths in one batch ([`Llama::generate_ragged`]): on one device each
/// row follows its prompt generated alone (greedy), and on `layout` the batch gives the
/// single device's batch (ranks bit for bit alike). Returns (parted, refused).
#[allow(clippy::too_many_arguments)]
fn ragged(full: &HashMap<String, Tensor>, cfg: &LlamaConfig, layout: Layout, prompts: &[Vec<u32>], new: usize, sampling: Sampling, what: &str) -> Result<(usize, bool)> {
    let mut parted = 0;
    let rows: Vec<(usize, usize)> = (0..prompts.len()).map(|i| (i, i)).collect();
    let one = generate_with(full, cfg, Layout::single(), |m| m.generate_ragged(prompts, new, Sampling::Greedy, &[]))?.remove(0);
    for (i, p) in prompts.iter().enumerate() {
        let ids = Tensor::from_vec(p.clone(), (1, p.len()), &Device::Cpu)?;
        let alone = generate(full, cfg, Layout::single(), &ids, new, Sampling::Greedy)?.remove(0);
        parted += follows(&one, &alone, &[(i, 0)], true, &format!("{what}: ragged prompt {i} (length {}) against itself alone", p.len()))? as usize;
    }
    let one = match sampling {
        Sampling::Greedy => one,
        s => generate_with(full, cfg, Layout::single(), |m| m.generate_ragged(prompts, new, s, &[]))?.remove(0),
    };
    let gens = match generate_with(full, cfg, layout, |m| m.generate_ragged(prompts, new, sampling, &[])) {
        Ok(g) => g,
        Err(e) => {
            let msg = e.to_string();
            let explained = ["divisible", "must divide", "needs", "multiple of"].iter().any(|k| msg.contains(k));
            assert!(explained && !msg.contains("panicked"), "{what}: ragged refused for an unexpected reason: {msg}");
            return Ok((parted, true));
        }
    };
    for (r, g) in gens.iter().enumerate().skip(1) {
        assert_eq!(g.tokens, gens[0].tokens, "{what}: ragged: rank {r}'s tokens differ from rank 0's");
        for (i, (x, y)) in g.logits.iter().zip(&gens[0].logits).enumerate() {
            assert_eq!(max_abs_diff(x, y)?, 0.0, "{what}: ragged: rank {r}'s logits of token {i} differ from rank 0's");
        }
    }
    parted += follows(&gens[0], &one, &rows, sampling == Sampling::Greedy, &format!("{what}: ragged batch on the layout against one device"))? as usize;
    Ok((parted, false))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// The gap between the two largest values of `row`.
fn top2_gap(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    a - b
}

#[test]
fn random_generation_equals_single_device() -> Result<()> {
    let (mut checked, mut refused, mut parted, mut sampled, mut windowed, mut tp, mut dp) = (0, 0, 0, 0, 0, 0, 0);
    let (mut oss, mut smol, mut olmos, mut exaones, mut granites, mut glm4s, mut glm45s, mut deepseeks) = (0, 0, 0, 0, 0, 0, 0, 0);
    let mut cuts = 0;
    let (mut ragged_checked, mut ragged_refused, mut ragged_parted) = (0, 0, 0);
    let range = seeds(CONFIGS)?;
    let n_configs = range.end - range.start;
    let corners = n_configs >= CONFIGS;
    for seed in range {
        let mut d = rng(7000 + seed);
        let (heads, kv_heads) = pick(&mut d, &[(4, 4), (4, 2), (4, 1), (8, 2), (2, 1)]);
        let hidden = heads * pick(&mut d, &[4, 8]);
        let layers = pick(&mut d, &[1, 2]);
        let vocab = pick(&mut d, &[37, 64]);
        let b = pick(&mut d, &[1, 2]);
        let t = pick(&mut d, &[8, 16, 24, 32, 48]);
        let new = 1 + d.below(6);
        let window = (d.below(3) == 0).then(|| 1 + d.below(t + new + 4));
        let cfg = LlamaConfig::tiny(vocab, hidden, layers, heads, kv_heads).with_sliding_window(window);
        // a fifth of the models are gpt-oss (sinks, biases, 4 experts of its width, top 2; a
        // stream of its own, so every seed's other draws stay what they were)
        let gpt_oss = rng(7500 + seed).below(5) == 0;
        let cfg = if gpt_oss { cfg.with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(4, 2, hidden))) } else { cfg };
        // a quarter of the others are SmolLM3: each layer without RoPE with probability 1/2, at
        // least one (a stream of its own)
        let mut nope = rng(7700 + seed);
        let smollm3 = !gpt_oss && nope.below(4) == 0;
        let cfg = match smollm3 {
            true => {
                let mut n: Vec<bool> = (0..layers).map(|_| nope.below(2) == 0).collect();
                n[nope.below(layers)] = true;
                cfg.with_nope_layers(Some(n))
            }
            false => cfg,
        };
        // a quarter of the rest are OLMo: norms after the branches only, q / k norms over the
        // whole projections (their statistic all-reduced over TP in every decode step); OLMo 3
        // with a window (a stream of its own)
        let olmo = !gpt_oss && !smollm3 && rng(7800 + seed).below(4) == 0;
        let cfg = match (olmo, window) {
            (true, Some(_)) => cfg.with_olmo(Some(candle_cp_llama::Olmo::Olmo3)),
            (true, None) => cfg.with_olmo(Some(candle_cp_llama::Olmo::Olmo2)),
            (false, _) => cfg,
        };
        // a quarter of the rest are EXAONE 4, its window (if any) on layer 0 of two, the global
        // layers without RoPE (a stream of its own)
        let exaone = !gpt_oss && !smollm3 && !olmo && rng(7900 + seed).below(4) == 0;
        let cfg = match (exaone, window, layers) {
            (true, Some(_), 2) => cfg.with_sliding_layers(Some(vec![true, false])).with_exaone4(true),
            (true, _, _) => cfg.with_exaone4(true),
            (false, _, _) => cfg,
        };
        // a quarter of the rest without a window are GraniteMoE: Granite's multipliers over 4
        // experts of its width, top 2 (a stream of its own)
        let granite_moe = !gpt_oss && !smollm3 && !olmo && !exaone && window.is_none() && rng(7950 + seed).below(4) == 0;
        let cfg = match granite_moe {
            true => cfg.with_moe(Some(candle_cp_llama::MoeConfig::granite_moe(4, 2, hidden))).with_granite(Some(candle_cp_llama::Granite {
                embedding_multiplier: 3.0,
                attention_multiplier: 0.3,
                residual_multiplier: 0.5,
                logits_scaling: 4.0,
            })),
            false => cfg,
        };
        // a quarter of the rest without a window are GLM-4 (norms before and after each branch,
        // q, k, v biases, RoPE on half of each head where that half is even; a stream of its own)
        let glm4 = !gpt_oss && !smollm3 && !olmo && !exaone && !granite_moe && window.is_none() && (hidden / heads / 2).is_multiple_of(2) && rng(7970 + seed).below(4) == 0;
        // (a third of them GLM: GLM-4's RoPE with a Llama's norms)
        let cfg = if glm4 { cfg.with_glm(Some(if rng(7971 + seed).below(3) == 0 { candle_cp_llama::Glm::Glm } else { candle_cp_llama::Glm::Glm4 })) } else { cfg };
        // a quarter of the rest without a window are GLM-4.5: 4 experts of its width in 2 groups
        // of which 1 is kept, top 2, scaled by 2.5, a shared expert as wide, q, k, v biases and
        // head norms, RoPE on half of each head where that half is even (a stream of its own)
        let glm45 = !gpt_oss && !smollm3 && !olmo && !exaone && !granite_moe && !glm4 && window.is_none() && (hidden / heads).is_multiple_of(4) && rng(7980 + seed).below(4) == 0;
        let cfg = match glm45 {
            true => cfg.with_moe(Some(candle_cp_llama::MoeConfig { groups: (2, 1), ..candle_cp_llama::MoeConfig::glm4_moe(4, 2, hidden, 1, 2.5) })).with_qkv_bias(true).with_qk_norm(true),
            false => cfg,
        };
        // half of them DeepSeek-V3: its latent attention in place of q, k, v (one q_proj or a q
        // rank of half the width, values narrower or wider than q / k, RoPE interleaved or not)
        let mut ds = rng(7990 + seed);
        let deepseek = glm45 && ds.below(2) == 0;
        let cfg = match deepseek {
            true => {
                let mla = candle_cp_llama::config::deepseek::Mla {
                    q_lora_rank: pick(&mut ds, &[None, Some(hidden / 2)]),
                    kv_lora_rank: pick(&mut ds, &[8, 16]),
                    qk_nope_head_dim: pick(&mut ds, &[4, 8]),
                    qk_rope_head_dim: pick(&mut ds, &[2, 4]),
                    v_head_dim: pick(&mut ds, &[4, 16]),
                    rope_interleave: ds.below(2) == 0,
                };
                let cfg = cfg.with_qkv_bias(false).with_qk_norm(false).with_mla(Some(mla));
                // (half of them DeepSeek-V2: its softmax router, interleaved RoPE)
                if ds.below(2) == 0 { candle_cp_tests::mla_ref::as_deepseek_v2(cfg) } else { cfg }
            }
            false => cfg,
        };
        let cp = pick(&mut d, &[2, 4]);
        let kind = pick(&mut d, &[CpKind::Ring, CpKind::Zigzag, CpKind::Striped, CpKind::AllGather, CpKind::Ulysses, CpKind::TwoD]);
        let mut layout = match kind {
            CpKind::TwoD => Layout::two_d(2, cp / 2),
            k => Layout::cp(k, cp),
        };
        match d.below(4) {
            0 => layout = layout.with_tp(2, d.below(2) == 0),
            1 => layout = layout.with_dp(2),
            _ => {}
        }
        let sampling = match d.below(2) {
            0 => Sampling::Greedy,
            _ => Sampling::Sample {
                temperature: pick(&mut d, &[0.7, 1.0, 1.5]),
                top_k: pick(&mut d, &[0, 5, 20]),
                top_p: pick(&mut d, &[1.0, 0.9, 0.5]),
                seed: seed + 3,
            },
        };
        let what = format!(
            "config {seed}: {layout}, prompt [{b}, {t}] + {new}, vocab {vocab} hidden {hidden} layers {layers} heads {heads}/{kv_heads} window {window:?}, gpt-oss {gpt_oss}, NoPE layers {:?}, {:?}, EXAONE 4 {exaone}, GraniteMoE {granite_moe}, GLM {:?}, GLM-4.5 {glm45}, DeepSeek-V3 {:?}, {sampling:?}", cfg.nope_layers, cfg.olmo, cfg.glm, cfg.mla
        );
        let mut full = varmap_tensors(&init_params(&cfg, seed + 5, DType::F32, &Device::Cpu)?)?;
        // GLM-4.5: correction biases of std 0.3 (the init's are 0)
        for (k, t) in full.iter_mut().filter(|(k, _)| k.ends_with(candle_cp_llama::params::CORRECTION_BIAS)) {
            *t = (candle_cp_tests::rand_t(seed + 3, k, t.dims())? * 0.3)?;
        }
        // gpt-oss: sinks around 2 (the init's are near 0)
        for t in full.iter_mut().filter(|(k, _)| k.ends_with(".sinks")).map(|(_, t)| t) {
            *t = ((&*t * 100.0)? + 2.0)?;
        }
        // one prompt in three 1..5 tokens short of the drawn length (no draw: the seed's), so
        // that it does not suit the layout: generation prefills a prefix and decodes the rest
        let cut = if seed % 3 == 0 { 1 + (seed as usize / 3) % 5 } else { 0 };
        let t = t - cut;
        let what = format!("{what}, prompt cut to T = {t}");
        let toks: Vec<u32> = (0..b * t).map(|i| ((i * 11 + seed as usize * 17 + i * i * 3) % vocab) as u32).collect();
        let ids = Tensor::from_vec(toks, (b, t), &Device::Cpu)?;
        let one = generate(&full, &cfg, Layout::single(), &ids, new, sampling)?.remove(0);
        let gens = match generate(&full, &cfg, layout, &ids, new, sampling) {
            Ok(g) => g,
            Err(e) => {
                let msg = e.to_string();
                let explained = ["divisible", "must divide", "needs", "multiple of"].iter().any(|k| msg.contains(k));
                assert!(explained && !msg.contains("panicked"), "{what}: refused for an unexpected reason: {msg}");
                refused += 1;
                continue;
            }
        };
        // the ranks agree bit for bit
        for (r, g) in gens.iter().enumerate().skip(1) {
            assert_eq!(g.tokens, gens[0].tokens, "{what}: rank {r}'s tokens differ from rank 0's");
            for (i, (x, y)) in g.logits.iter().zip(&gens[0].logits).enumerate() {
                assert_eq!(max_abs_diff(x, y)?, 0.0, "{what}: rank {r}'s logits of token {i} differ from rank 0's");
            }
        }
        // rank 0 against the single device, step by step, until the tokens part on a near tie
        let g = &gens[0];
        assert_eq!(g.logits.len(), new, "{what}");
        'steps: for i in 0..new {
            let e = max_abs_diff(&g.logits[i], &one.logits[i])?;
            assert!(e < TOL, "{what}: token {i}: logits differ from the single device by {e:.2e}");
            for (row, (mine, theirs)) in g.tokens.iter().zip(&one.tokens).enumerate() {
                if mine[i] != theirs[i] {
                    if sampling == Sampling::Greedy {
                        let gap = top2_gap(&one.logits[i].get(row)?.to_vec1::<f32>()?);
                        assert!(gap < 2.0 * TOL, "{what}: token {i} row {row}: {} vs the single device's {} with the best two logits {gap:.2e} apart", mine[i], theirs[i]);
                    }
                    parted += 1;
                    break 'steps;
                }
            }
        }
        // a third of the draws also generate prompts of different lengths in one batch (2 or 4
        // prompts, one of the drawn length; a stream of its own)
        let mut rg = rng(7300 + seed);
        if rg.below(3) == 0 {
            let n = pick(&mut rg, &[2usize, 4]);
            let prompts: Vec<Vec<u32>> = (0..n)
                .map(|i| {
                    let len = if i == 0 { t } else { 1 + rg.below(t) };
                    (0..len).map(|j| ((j * 7 + i * 13 + seed as usize * 5 + j * j) % vocab) as u32).collect()
                })
                .collect();
            let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
            let (p, r) = ragged(&full, &cfg, layout, &prompts, new, sampling, &format!("{what}, ragged lengths {lens:?}"))?;
            ragged_parted += p;
            match r {
                true => ragged_refused += 1,
                false => ragged_checked += 1,
            }
        }
        checked += 1;
        oss += gpt_oss as usize;
        smol += smollm3 as usize;
        olmos += olmo as usize;
        exaones += exaone as usize;
        granites += granite_moe as usize;
        glm4s += glm4 as usize;
        glm45s += (glm45 && !deepseek) as usize;
        deepseeks += deepseek as usize;
        sampled += (sampling != Sampling::Greedy) as usize;
        cuts += (cut > 0) as usize;
        windowed += window.is_some() as usize;
        tp += (layout.tp > 1) as usize;
        dp += (layout.dp > 1) as usize;
    }
    println!("{checked} generations checked ({cuts} from a prompt cut short of the layout's multiple, {sampled} sampled, {windowed} with a window, {tp} with TP, {dp} with DP, {oss} gpt-oss, {smol} SmolLM3, {olmos} OLMo, {exaones} EXAONE 4, {granites} GraniteMoE, {glm4s} GLM or GLM-4, {glm45s} GLM-4.5, {deepseeks} DeepSeek-V3 or -V2; {parted} parted on a tie), {refused} refused; ragged batches: {ragged_checked} checked, {ragged_refused} refused, {ragged_parted} parted on a tie");
    assert!(
        checked >= n_configs as usize / 2 && parted * 50 <= checked && ragged_parted * 10 <= ragged_checked.max(1) && (!corners || ragged_checked >= 5) && (!corners || (sampled >= 3 && windowed >= 3 && tp >= 3 && dp >= 3 && oss >= 1 && smol >= 1 && olmos >= 1)),
        "{checked} checked, {refused} refused, {parted} parted; {sampled} sampled, {windowed} window, {tp} TP, {dp} DP"
    );
    Ok(())
}
