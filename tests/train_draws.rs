//! The draws of the randomized trainer tests (`train_random.rs`, `lora_random.rs`): a layout,
//! a tiny model and a run's batch split and options, the trainer configuration around them, and
//! how two runs' curves are compared.

use candle_core::Result;
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::{CpKind, HeadLayout, Layout};
use candle_cp_llama::train::{
    train_rank, AdamWConfig, DataSource, KvRecall, ModelSource, PackedStream, Rng, StepMetrics, TrainConfig, TrainOutcome,
    WarmupCosine,
};
use candle_cp_llama::{LlamaConfig, RowSums};
use crate::draws::{pick, rng};

pub const STEPS: usize = 3;

/// The trainer's configuration for `layout` and the drawn options; the rest as the trainer
/// tests set it (KvRecall data, 64 tokens, AdamW with clipping).
pub fn config(layout: Layout, model: LlamaConfig, task: KvRecall, batch: usize, grad_accum: usize, seed: u64) -> TrainConfig {
    // AdamW's epsilon 1e-6 (the default is 1e-8). Gradients near 1e-8 — a freshly drawn
    // gpt-oss's router's, some of a Gemma 3's on packed documents — sit where `g / (|g| + 1e-8)`
    // turns float32 summation noise into weight steps of up to the learning rate: gpt-oss's
    // config 111 of `24..724` was 7.4e-4 off in the loss at step 3 (a top-K routing flip; 9.4e-5 /
    // 4.8e-3 loss / grad norm on every layout, DP 2 included, with 1e-8, 2.4e-7 / 6.5e-8 with
    // 1e-6), and config 789 of `124..1124` (Gemma 3, packed documents, CP 4 × TP 2 of any kind)
    // 1.7e-4 at step 3 with 1e-8 — 1.4e-6 without clipping, 3.2e-7 with 1e-6, and the same data
    // at a learning rate of 0 within 5e-7. Both sides run the same optimizer; a layout's error
    // in a gradient shows far above 1e-6.
    let eps = 1e-6;
    TrainConfig {
        batch,
        grad_accum,
        schedule: WarmupCosine { peak: 1e-2, warmup: 1, total: STEPS, min_ratio: 0.1 },
        adamw: AdamWConfig { weight_decay: 0.01, eps, ..AdamWConfig::default() },
        clip: 0.5,
        seed,
        ..TrainConfig::new(layout, ModelSource::Init(model), DataSource::Recall(task), 64, STEPS)
    }
}

/// Bounds on `(loss, grad norm)` gaps to the single-device run at the first step (the same
/// weights on both sides) and at later ones (see the comment in the first test).
pub const FIRST_STEP: (f64, f64) = (1e-5, 1e-4);
pub const LATER_STEPS: (f64, f64) = (1e-4, 1e-3);

/// A layout of the draws: every CP kind, CP 2 or 4 (2-D: Ulysses 2 × ring `cp/2`; Ulysses and
/// 2-D at CP 4 with the head layout regathered, Ulysses at CP 2 with f32 row sums, all-gather
/// and 2-D at CP 4 with the output's), TP 2 with or without SP in a third of the
/// draws, DP 2 in half.
pub fn draw_layout(d: &mut Rng) -> Layout {
    let kind = pick(d, &[CpKind::Ring, CpKind::Zigzag, CpKind::Striped, CpKind::AllGather, CpKind::Ulysses, CpKind::TwoD]);
    let cp = pick(d, &[2, 4]);
    let mut layout = match kind {
        CpKind::TwoD => Layout::two_d(2, cp / 2),
        k => Layout::cp(k, cp),
    };
    // Ulysses / 2-D at CP 4: the head layout regathered in the backward (no draw of its own,
    // so every seed's other draws stay what they were)
    if matches!(kind, CpKind::Ulysses | CpKind::TwoD) && cp == 4 {
        layout = layout.with_head_layout(HeadLayout::Regathered);
    }
    // Ulysses at CP 2: the backward's row sums from the f32 output (the same in f32; in bf16
    // the residual is kept and read)
    if kind == CpKind::Ulysses && cp == 2 {
        layout = layout.with_row_sums(RowSums::F32);
    }
    // all-gather and 2-D at CP 4: the row sums from the returned output (no residual kept)
    if matches!(kind, CpKind::AllGather | CpKind::TwoD) && cp == 4 {
        layout = layout.with_row_sums(RowSums::Output);
    }
    let (with_tp, with_dp) = (d.below(3) == 0, d.below(2) == 0);
    if with_tp {
        layout = layout.with_tp(2, d.below(2) == 0);
    }
    if with_dp {
        layout = layout.with_dp(2);
    }
    layout
}

/// The recall task and a tiny model of the draws: query / KV heads, 1 or 2 layers, a sliding
/// window in a quarter of the draws, Qwen2's q, k, v biases, Qwen3's q / k head norms and
/// Gemma 3 in a quarter of the seeds each (a stream of its own, so the other draws stay what
/// they were), Gemma 2 in a third of the rest (another stream), OLMo in a third of the dense
/// Qwen3 ones, EXAONE 4 in a quarter of the rest, OLMoE in a third of the Qwen3-MoE ones
/// without a window; with those numbers
/// `(heads, kv_heads, layers, window)`.
#[allow(clippy::type_complexity)]
pub fn draw_model(d: &mut Rng, seed: u64) -> Result<(KvRecall, LlamaConfig, (usize, usize, usize, Option<usize>))> {
    let mut task = KvRecall::new(64)?;
    (task.n_keys, task.n_values, task.n_queries, task.fused) = (8, 8, 8, true);
    let drawn = pick(d, &[(2, 1), (2, 2), (4, 2), (4, 1)]);
    // one model in five (a stream of its own): 12 query heads over 3 KV heads, which TP 2
    // neither divides nor is divided by (each TP rank holds 3 KV-head copies of 6)
    let (heads, kv_heads) = if rng(959_000 + seed).below(5) == 0 { (12, 3) } else { drawn };
    let layers = pick(d, &[1, 2]);
    let window = (d.below(4) == 0).then(|| 1 + d.below(70));
    let arch = rng(919_000 + seed).below(4);
    let model = LlamaConfig::tiny(task.vocab_needed(), hidden_for(heads), layers, heads, kv_heads)
        .with_sliding_window(window)
        .with_qkv_bias(arch == 1)
        .with_qk_norm(arch == 2)
        .with_gemma3(arch == 3);
    // a third of the Llama seeds are Gemma 2 instead (soft caps 1 in attention, 3 on the output)
    let model = match arch == 0 && rng(929_000 + seed).below(3) == 0 {
        true => with_caps(model.with_gemma2(true), Some((1.0, 3.0))),
        false => model,
    };
    // half of the Qwen3 seeds are Qwen3-MoE instead
    let model = match arch == 2 && rng(939_000 + seed).below(2) == 0 {
        true => {
            let mut moe = candle_cp_llama::MoeConfig::new(4, 2, 16);
            (moe.norm_topk_prob, moe.output_router_logits, moe.router_aux_loss_coef) = (true, true, 0.1);
            model.with_moe(Some(moe))
        }
        false => model,
    };
    // a quarter of the Qwen3-MoE seeds without a window are GLM-4.5 instead (sigmoid scores
    // chosen with a correction bias in 2 groups of 2, one or both kept, scaled by 2.5; a shared
    // expert 16 wide; layer 0 dense with two layers or more; q, k, v biases or not beside the
    // head norms; RoPE on half of each head, where that half is even; a stream of its own)
    let mut g45 = rng(939_500 + seed);
    let model = match model.moe.is_some() && arch == 2 && window.is_none() && model.head_dim.is_multiple_of(4) && g45.below(4) == 0 {
        true => {
            let mut moe = candle_cp_llama::MoeConfig::glm4_moe(4, 2, 16, 1, 2.5);
            moe.groups = (2, 1 + g45.below(2));
            if layers >= 2 {
                moe.mlp_only_layers = vec![0];
            }
            model.with_moe(Some(moe)).with_qkv_bias(g45.below(2) == 0)
        }
        false => model,
    };
    // a third of those are DeepSeek-V3: its latent attention in place of q, k, v (a q rank or
    // one q_proj, values 8 or 24 wide beside q / k of 12, RoPE interleaved or not; a stream of
    // its own)
    let mut ds = rng(939_700 + seed);
    let model = match model.arch() == candle_cp_llama::Arch::Glm4Moe && ds.below(3) == 0 {
        true => {
            let mla = candle_cp_llama::config::deepseek::Mla {
                q_lora_rank: pick(&mut ds, &[None, Some(16)]),
                kv_lora_rank: 8,
                qk_nope_head_dim: 8,
                qk_rope_head_dim: 4,
                v_head_dim: pick(&mut ds, &[8, 24]),
                rope_interleave: ds.below(2) == 0,
            };
            let model = model.with_qkv_bias(false).with_qk_norm(false).with_mla(Some(mla));
            // (half of them DeepSeek-V2: its softmax router over the same experts and groups,
            // not renormalised; RoPE interleaved)
            if ds.below(2) == 0 { crate::mla_ref::as_deepseek_v2(model) } else { model }
        }
        false => model,
    };
    // a third of the Qwen2 seeds are gpt-oss instead (sinks, biases on o, the router and the
    // experts, the clamped SwiGLU; a stream of its own)
    let model = match arch == 1 && rng(949_000 + seed).below(3) == 0 {
        true => model.with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(4, 2, 16))),
        false => model,
    };
    // a third of the remaining Qwen2 seeds without a window are GLM-4 (norms before and after
    // each branch, RoPE on half of each head, where that half is even; a stream of its own), a
    // third of those GLM (GLM-4's RoPE with a Llama's norms)
    let model = match arch == 1 && model.moe.is_none() && window.is_none() && (model.head_dim / 2).is_multiple_of(2) && rng(989_950 + seed).below(3) == 0 {
        true => model.with_glm(Some(if rng(989_960 + seed).below(3) == 0 { candle_cp_llama::Glm::Glm } else { candle_cp_llama::Glm::Glm4 })),
        false => model,
    };
    // of the remaining Llama seeds (a stream of their own): a quarter SmolLM3 (its last layer
    // without RoPE), a quarter of those without a window Granite (granite-3.x's multipliers,
    // the softmax scale 1/head_dim)
    let mut other = rng(969_000 + seed);
    let plain = arch == 0 && model.gemma2.is_none();
    let model = match (plain, other.below(4), window) {
        (true, 0, _) => model.with_nope_layers(Some((0..layers).map(|i| i + 1 == layers).collect())),
        (true, 1, None) => {
            let d = model.head_dim as f64;
            model.with_granite(Some(candle_cp_llama::Granite { embedding_multiplier: 12.0, attention_multiplier: 1.0 / d, residual_multiplier: 0.22, logits_scaling: 16.0 }))
        }
        _ => model,
    };
    // a third of the Granite seeds are GraniteMoE (its multipliers over 4 experts 16 wide, 2
    // per token, the load-balancing loss on; a stream of its own)
    let model = match model.granite.is_some() && rng(989_900 + seed).below(3) == 0 {
        true => {
            let mut moe = candle_cp_llama::MoeConfig::granite_moe(4, 2, 16);
            (moe.output_router_logits, moe.router_aux_loss_coef) = (true, 0.1);
            model.with_moe(Some(moe))
        }
        false => model,
    };
    // a third of the dense Qwen3 seeds are OLMo (norms after the branches only, q / k norms
    // over the whole projections; OLMo 3 with a window; a stream of its own)
    let model = match arch == 2 && model.moe.is_none() && rng(989_000 + seed).below(3) == 0 {
        true => model.with_qk_norm(false).with_olmo(Some(if window.is_some() { candle_cp_llama::Olmo::Olmo3 } else { candle_cp_llama::Olmo::Olmo2 })),
        false => model,
    };
    // a quarter of the remaining dense Qwen3 seeds are EXAONE 4 (OLMo 2's norms with the head
    // norms; with two layers and a window, layer 0 slides and layer 1 is global and NoPE; a
    // stream of its own)
    let model = match arch == 2 && model.qk_norm && model.moe.is_none() && rng(989_700 + seed).below(4) == 0 {
        true if window.is_some() && layers == 2 => model.with_sliding_layers(Some(vec![true, false])).with_exaone4(true),
        true => model.with_exaone4(true),
        false => model,
    };
    // a third of the Qwen3-MoE seeds without a window are OLMoE (a stream of its own)
    let model = match arch == 2 && window.is_none() && model.moe.as_ref().is_some_and(|m| m.style == candle_cp_llama::MoeStyle::Qwen3Moe) && rng(989_500 + seed).below(3) == 0 {
        true => model.with_olmo(Some(candle_cp_llama::Olmo::Olmoe)),
        false => model,
    };
    Ok((task, model, (heads, kv_heads, layers, window)))
}

/// The models' width: 32, or 48 for 12 heads (of 4 dimensions each).
pub fn hidden_for(heads: usize) -> usize {
    if heads == 12 { 48 } else { 32 }
}

/// `cfg` with Gemma 2's soft caps `(attention, output)` (`cfg` must be Gemma 2), or as it is.
pub fn with_caps(mut cfg: LlamaConfig, caps: Option<(f64, f64)>) -> LlamaConfig {
    if let (Some(g), Some((a, f))) = (cfg.gemma2.as_mut(), caps) {
        (g.attn_logit_softcapping, g.final_logit_softcapping) = (Some(a), Some(f));
    }
    cfg
}

/// A run of the draws on one layout: the layout, rows per step (1 or 2 per DP replica),
/// micro-batches (1 or 2) and the trainer options.
pub fn draw_run(d: &mut Rng) -> (Layout, usize, usize, Options) {
    let layout = draw_layout(d);
    let batch = layout.dp * pick(d, &[1, 2]);
    let grad_accum = pick(d, &[1, 2]);
    (layout, batch, grad_accum, Options::draw(d))
}

/// The trainer options of the draws: ZeRO 0 / 1 / 2, recompute, the overlapped gradient sync
/// (with recompute) and parameter gather (with ZeRO).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub stage: usize,
    pub recompute: bool,
    pub overlap_grad_sync: bool,
    pub overlap_param_gather: bool,
}

impl Options {
    pub fn draw(d: &mut Rng) -> Self {
        let stage = pick(d, &[0, 1, 2]);
        let recompute = d.below(2) == 0;
        let overlap_grad_sync = recompute && d.below(2) == 0;
        let overlap_param_gather = stage > 0 && d.below(2) == 0;
        Self { stage, recompute, overlap_grad_sync, overlap_param_gather }
    }

    pub fn apply(self, cfg: &mut TrainConfig) {
        (cfg.zero1, cfg.zero2) = (self.stage == 1, self.stage == 2);
        (cfg.recompute, cfg.overlap_grad_sync, cfg.overlap_param_gather) =
            (self.recompute, self.overlap_grad_sync, self.overlap_param_gather);
    }
}

/// A refusal must name its reason (a degree that does not divide, a size it needs), not panic.
pub fn assert_explained(what: &str, e: &candle_core::Error) {
    let msg = e.to_string();
    let explained = ["divisible", "must divide", "needs"].iter().any(|k| msg.contains(k));
    assert!(explained && !msg.contains("panicked"), "{what}: refused for an unexpected reason: {msg}");
}

pub fn run(cfg: &TrainConfig) -> Result<Vec<TrainOutcome>> {
    run_ranks(cfg.layout.world_size(), |g| train_rank(g, cfg, &|_| {})).into_iter().collect()
}

/// How far two runs' curves are apart at each step: `(loss, grad norm)` differences, the loss
/// the larger of the next-token loss's and the objective's, the grad norm's relative above 1.
pub fn gaps(a: &[StepMetrics], b: &[StepMetrics]) -> Vec<(f64, f64)> {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let dl = (x.loss - y.loss).abs().max((x.train_loss - y.train_loss).abs());
            (dl, (x.grad_norm - y.grad_norm).abs() / x.grad_norm.max(1.0))
        })
        .collect()
}

/// The step (1-based, after the first) at which a mixture of experts' two runs routed their
/// tokens differently by a tie: their expert counts (`StepMetrics::expert_counts`, over the
/// global batch) differ in at most [`TIE_CHOICES`] (token, slot) choices over all layers.
/// After updates the two runs' weights differ by rounding (about 1e-7), so a token whose K-th
/// and (K+1)-th router logits are that close can take another expert on one side: its loss
/// and every later step then part by far more than the bounds, and the comparison stops there.
/// `train_random` config 4843 of `4124..5124` (gpt-oss, striped CP 4 × EP 2) is one: one token
/// of layer 2 at step 3, margin 6.8e-6 on one device, took expert 2 instead of 0 on the
/// layout (and on ring CP 2 × EP 2), the loss 3.1e-4 off. Identical weights (step 1) or counts
/// apart by more are never a tie: a layout that routes wrongly differs there.
pub fn parted_on_tie(want: &[StepMetrics], got: &[StepMetrics]) -> Option<usize> {
    let (i, a, b) = want.iter().zip(got).enumerate().find_map(|(i, (x, y))| match (&x.expert_counts, &y.expert_counts) {
        (Some(a), Some(b)) if a != b => Some((i, a, b)),
        _ => None,
    })?;
    let apart: u64 = a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| x.abs_diff(*y)).sum();
    // (one token's choice moved is 2: one expert's count down, another's up)
    (i > 0 && a.len() == b.len() && apart <= 2 * TIE_CHOICES).then_some(want[i].step)
}

/// At most this many (token, slot) choices moved between two runs' routings for [`parted_on_tie`].
pub const TIE_CHOICES: u64 = 4;

/// Where `got` leaves `want`: the first step whose loss or gradient norm differs by more than
/// the step's bound, `(loss, grad norm)` of `bounds`. Runs that route tokens differently by a
/// tie ([`parted_on_tie`]) are compared up to the step before (count them with it).
pub fn diverges(want: &[StepMetrics], got: &[StepMetrics], bounds: &[(f64, f64)]) -> Option<String> {
    if want.len() != got.len() {
        return Some(format!("{} steps vs {}", got.len(), want.len()));
    }
    let n = parted_on_tie(want, got).map_or(want.len(), |s| want.iter().position(|m| m.step == s).unwrap_or(want.len()));
    let (want, got) = (&want[..n], &got[..n]);
    for ((x, (dl, dg)), (bl, bg)) in want.iter().zip(gaps(want, got)).zip(bounds) {
        // (a NaN gap is a divergence too)
        if !(dl <= *bl && dg <= *bg) {
            return Some(format!(
                "step {}: loss and objective off by {dl:.2e} (bound {bl:.1e}), grad norm by {dg:.2e} (bound {bg:.1e}) of {}",
                x.step, x.grad_norm
            ));
        }
    }
    None
}

/// A byte corpus of 40 short documents of uneven lengths, packed into each sequence.
pub fn packed_corpus() -> Result<PackedStream> {
    let mut r = Rng::new(17);
    let mut text = Vec::new();
    for _ in 0..40 {
        let len = 3 + r.below(25);
        text.extend((0..len).map(|_| b'a' + r.below(16) as u8));
        text.extend_from_slice(b"\n\n");
    }
    PackedStream::from_bytes(&text, b"\n\n")
}
