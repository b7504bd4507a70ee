//! Seeded random LoRA runs: a few optimizer steps of a LoRA fine-tune on a drawn layout with
//! drawn trainer options follow the single-device run of the same spec and global batch, step by
//! step.
//!
//! `llama_lora*.rs` pin the LoRA features one at a time against float64 references; this draws
//! them together over `train_random`'s models, layouts and options (`train_draws.rs`: every CP
//! kind, TP with and without SP, DP, micro-batches, ZeRO 0 / 1 / 2, recompute and both overlaps;
//! Llama, Qwen2, Qwen3, Gemma 2 / 3, Qwen3-MoE, gpt-oss, GraniteMoE): the targets (attention,
//! the MLP, PEFT's all-linear with a mixture's routers, or a mix; GraniteMoE's attention only),
//! rank and alpha, rsLoRA, DoRA, dropout
//! on the adapters' inputs (a mask keyed by each token's global position, so every layout draws
//! the single device's), `layers_to_transform`, a `rank_pattern`, the head or the embedding
//! trained whole (`modules_to_save`), a mixture's experts as PEFT's `target_parameters`, and a quantized base
//! (int8 or NF4, double-quantized scales too). Every run the trainer accepts must give the
//! single-device losses and gradient norms within `train_random`'s bounds on every rank; a run
//! it refuses must be refused for a reason the draw explains. `CANDLE_CP_RANDOM_SEEDS=A..B`
//! draws configurations `A..B`.

use candle_core::Result;
use candle_cp_llama::layout::Layout;
use candle_cp_llama::lora::{ALL_LINEAR, TARGETS};
use candle_cp_llama::train::{Rng, TrainConfig};
use candle_cp_llama::{LlamaConfig, LoraSpec};
use candle_cp_nn::{QuantConfig, QuantKind};
use candle_cp_tests::draws::{pick, rng, seeds};
use candle_cp_tests::train_draws::*;

const CONFIGS: u64 = 24;

/// A LoRA spec for `model` and a quantized base (or none), with a description of the draw.
fn draw_lora(d: &mut Rng, model: &LlamaConfig) -> Result<(LoraSpec, Option<QuantConfig>, String)> {
    let moe = model.moe.is_some();
    // a mixture's experts as parameters (PEFT's target_parameters) in a third of the mixtures
    // (GraniteMoE: adapters on its attention only, no experts as parameters)
    let granite_moe = model.moe.as_ref().is_some_and(|m| m.style == candle_cp_llama::MoeStyle::GraniteMoe);
    let params = moe && d.below(3) == 0 && !granite_moe;
    let attention: &[&str] = &["q_proj", "k_proj", "v_proj", "o_proj"];
    let choices: Vec<&[&str]> = match (model.gpt_oss, params) {
        _ if granite_moe => vec![&["q_proj", "v_proj"], attention],
        // (GLM-4: its gate and up are one module to PEFT; adapters on them are refused)
        _ if model.glm.is_some() => vec![&["q_proj", "v_proj"], attention, &["o_proj", "down_proj"]],
        // gpt-oss's MLP projections are parameters: all of them named, or none
        (true, _) | (false, true) => vec![&["q_proj", "v_proj"], attention, &ALL_LINEAR],
        (false, false) => vec![&["q_proj", "v_proj"], attention, &ALL_LINEAR, &TARGETS[4..], &["o_proj", "down_proj"]],
    };
    let targets = pick(d, &choices);
    let (rank, alpha) = (pick(d, &[1, 2, 4]), pick(d, &[1.0, 4.0, 8.0]));
    let mut spec = LoraSpec::new(rank, alpha, targets)?.with_rslora(d.below(4) == 0);
    if params {
        spec = spec.with_target_parameters(&["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])?;
    } else {
        // (PEFT takes neither dropout nor DoRA on parameters)
        spec = spec.with_dora(d.below(4) == 0);
        if d.below(3) == 0 {
            spec = spec.with_dropout(pick(d, &[0.1, 0.3]))?;
        }
    }
    if model.num_hidden_layers > 1 && d.below(4) == 0 {
        spec = spec.with_layers(Some(vec![1]));
    }
    if d.below(5) == 0 {
        let key = if params { "experts.down_proj" } else { "o_proj" };
        spec = spec.with_rank_pattern(vec![(key.to_string(), 2 * rank)])?;
    }
    if d.below(8) == 0 {
        // (a tied head is the embedding: PEFT names it so)
        spec = spec.with_modules_to_save(&[if model.tie_word_embeddings { "embed_tokens" } else { pick(d, &["lm_head", "embed_tokens"]) }])?;
    }
    let quant = match d.below(5) {
        0 => Some(QuantConfig::new(QuantKind::Int8, pick(d, &[4, 8]))?),
        1 => {
            let q = QuantConfig::new(QuantKind::Nf4, pick(d, &[4, 8]))?;
            Some(if d.below(2) == 0 { q.with_double_quant(pick(d, &[2, 4]))? } else { q })
        }
        _ => None,
    };
    let what = format!("LoRA {spec}{}", quant.map_or(String::new(), |q| format!(", base {} g{}{}", q.kind, q.group, q.double.map_or(String::new(), |r| format!(" dq{r}")))));
    Ok((spec, quant, what))
}

/// LoRA runs on drawn layouts follow the single-device run of the same spec (see the module doc).
#[test]
fn random_lora_runs_follow_one_device() -> Result<()> {
    let (mut checked, mut refused) = (0, 0);
    let (mut dora, mut dropout, mut params, mut quant, mut tp, mut zero, mut saved) = (0, 0, 0, 0, 0, 0, 0);
    // (SmolLM3's and Granite's models: the residual multiplier scales the adapted o_proj's and
    // down_proj's branch inside their nodes)
    let (mut smollm3, mut granite, mut glm45, mut deepseek) = (0, 0, 0, 0);
    let range = seeds(CONFIGS)?;
    let n_configs = range.end - range.start;
    for seed in range {
        let mut d = rng(39_000 + seed);
        let (task, model, (heads, kv_heads, layers, window)) = draw_model(&mut d, seed)?;
        let (layout, batch, grad_accum, opts) = draw_run(&mut d);
        let (spec, q, lora) = draw_lora(&mut rng(39_500 + seed), &model)?;
        let arch = model.arch().hf_names().0;
        let is_glm45 = model.arch() == candle_cp_llama::Arch::Glm4Moe;
        let is_deepseek = model.mla.is_some();
        let (cfg_model_nope, cfg_model_granite) = (model.nope_layers.is_some(), model.granite.is_some());
        let one = TrainConfig { lora: Some(spec.clone()), quantize_base: q, ..config(Layout::single(), model, task, batch, grad_accum, seed) };
        let mut cfg = TrainConfig { layout, ..one.clone() };
        opts.apply(&mut cfg);
        let what = format!("config {seed}: {layout}, heads {heads}/{kv_heads} layers {layers} window {window:?} {arch}, batch {batch} x {grad_accum} micro-batches, {opts:?}, {lora}");
        let base = run(&one).map_err(|e| candle_core::Error::Msg(format!("{what}: the single-device run: {e}")))?;
        let bounds: Vec<(f64, f64)> = (0..STEPS).map(|i| if i == 0 { FIRST_STEP } else { LATER_STEPS }).collect();
        match run(&cfg) {
            Ok(outs) => {
                for (r, o) in outs.iter().enumerate() {
                    if let Some(e) = diverges(&base[0].metrics, &o.metrics, &bounds) {
                        panic!("{what}: rank {r} leaves the single-device run at {e}");
                    }
                }
                checked += 1;
                dora += spec.dora as usize;
                dropout += (spec.dropout > 0.0) as usize;
                params += !spec.target_parameters.is_empty() as usize;
                quant += q.is_some() as usize;
                tp += (layout.tp > 1) as usize;
                zero += (opts.stage > 0) as usize;
                saved += !spec.modules_to_save.is_empty() as usize;
                smollm3 += cfg_model_nope as usize;
                granite += cfg_model_granite as usize;
                glm45 += is_glm45 as usize;
                deepseek += is_deepseek as usize;
            }
            Err(e) => {
                assert_explained(&what, &e);
                refused += 1;
            }
        }
    }
    println!("{checked} LoRA configurations checked ({dora} DoRA, {dropout} with dropout, {params} with expert parameters, {quant} over a quantized base, {saved} with the head trained whole, {tp} with TP, {zero} with ZeRO, {smollm3} SmolLM3, {granite} Granite, {glm45} GLM-4.5, {deepseek} DeepSeek-V3 or -V2), {refused} refused");
    assert!(
        checked >= n_configs as usize / 2 && (n_configs < CONFIGS || (dora >= 2 && dropout >= 2 && quant >= 2 && tp >= 2)),
        "{checked} checked, {refused} refused; {dora} DoRA, {dropout} dropout, {quant} quantized, {tp} TP"
    );
    Ok(())
}
