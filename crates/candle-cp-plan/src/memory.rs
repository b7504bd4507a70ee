//! Memory arithmetic: activations per layer (Korthikanti and exact Llama counts), per GPU
//! under TP/SP/CP and recompute; weights, gradients and Adam state per GPU under ZeRO.
//!
//! Notation (docs/arithmetic.md): `s` global sequence, `c = s/cp` local tokens, `b`
//! micro-batch, `h` hidden, `a` query heads, `a_kv` KV heads, `d` head dim, `f` MLP
//! width, `v` vocab, `e` bytes per element, `t` TP degree.

use crate::layout::{ActivationModel, CpKind, Layout, Recompute};
use crate::model::ModelConfig;
use serde::Serialize;

/// The layout of one GPU, no parallelism, flash attention on or off.
fn single_gpu(flash: bool) -> Layout {
    Layout {
        flash,
        ..Layout::default()
    }
}

/// Korthikanti et al. (2022) eq. 1 generalised to `e`-byte activations, one layer, one
/// micro-batch, no parallelism: `s·b·h·(16e + 2) + a·s²·b·(2e + 1)` bytes
/// (`= sbh·(34 + 5as/h)` for `e = 2`). With `flash` the score term is 0.
pub fn korthikanti_layer_bytes(m: &ModelConfig, s: usize, b: usize, e: usize, flash: bool) -> f64 {
    korthikanti_per_gpu(m, &single_gpu(flash), s, b, e, Recompute::None)
}

/// Exact stored activations of one Llama layer (RMSNorm, GQA, SwiGLU, no dropout), no
/// parallelism: `s·b·e·(4h + 2·a·d + 2·a_kv·d + 3f)` bytes, plus `a·s²·b·e` (softmax
/// probabilities) without flash. For Llama 3 405B this is `31.75·sbh` at `e = 2`.
pub fn llama_layer_bytes(m: &ModelConfig, s: usize, b: usize, e: usize, flash: bool) -> f64 {
    llama_per_gpu(m, &single_gpu(flash), s, b, e, Recompute::None)
}

/// The terms both per-GPU counts share: TP degree `t`, local tokens `c = s/cp`, batch `b`,
/// bytes per element `e`, hidden size `h`, and the SP divisor (`t` with SP, else 1).
#[derive(Clone, Copy)]
struct Terms {
    t: f64,
    c: f64,
    bf: f64,
    ef: f64,
    h: f64,
    sp_div: f64,
}

impl Terms {
    fn new(m: &ModelConfig, l: &Layout, b: usize, s: usize, e: usize) -> Self {
        let (t, c) = (l.tp as f64, (s / l.cp) as f64);
        let sp_div = if l.sp { t } else { 1.0 };
        Terms {
            t,
            c,
            bf: b as f64,
            ef: e as f64,
            h: m.hidden as f64,
            sp_div,
        }
    }

    /// Full recompute keeps only the layer input: `c·b·h·e / sp_div` bytes.
    fn full_recompute(&self) -> f64 {
        self.c * self.bf * self.h * self.ef / self.sp_div
    }

    /// Attention scores kept for backward, `a·c·s·b·per_elem / t` bytes; 0 with flash
    /// attention or selective recompute.
    fn scores(&self, m: &ModelConfig, l: &Layout, s: usize, r: Recompute, per_elem: f64) -> f64 {
        if l.flash || r == Recompute::Selective {
            0.0
        } else {
            m.heads as f64 * self.c * s as f64 * self.bf * per_elem / self.t
        }
    }
}

/// Korthikanti count per GPU for one layer, CP and TP/SP applied (`c = s/cp` tokens):
/// - replicated unless SP: `c·b·h·(4e + 2)` (two norm inputs, QKV and MLP inputs, two
///   dropout masks) — divided by `t` with SP;
/// - always split over TP: `c·b·h·12e`;
/// - scores (not with flash or selective): `a·c·s·b·(2e + 1) / t`;
/// - full recompute keeps only the layer input `c·b·h·e` (over `t` with SP).
pub fn korthikanti_per_gpu(
    m: &ModelConfig,
    l: &Layout,
    s: usize,
    b: usize,
    e: usize,
    r: Recompute,
) -> f64 {
    let terms = Terms::new(m, l, b, s, e);
    let Terms {
        t,
        c,
        bf,
        ef,
        h,
        sp_div,
    } = terms;
    if r == Recompute::Full {
        return terms.full_recompute();
    }
    let replicated = c * bf * h * (4.0 * ef + 2.0) / sp_div;
    let split = c * bf * h * 12.0 * ef / t;
    let scores = terms.scores(m, l, s, r, 2.0 * ef + 1.0);
    replicated + split + scores
}

/// Exact Llama count per GPU for one layer (`c = s/cp` tokens, `a_kv,t` KV heads per TP
/// rank):
/// - replicated unless SP: `c·b·e·4h` (two RMSNorm inputs, QKV input, MLP input; OLMo,
///   without those norms, `c·b·e·2h`);
/// - `c·b·e·2·a·d / t` (Q after RoPE, attention output O);
/// - `c·b·e·2·a_kv,t·d` (K after RoPE, V; replicated heads count on every rank);
/// - `c·b·e·3f / t` (gate and up outputs, down-projection input); a sparse layer (mixture of
///   experts, averaged over the layers: [`ModelConfig::sparse_fraction`]) `c·b·e·K·(3f_e/t + 2h)`
///   instead (each token's `K` rows into the experts and out of them, gate, up, the product);
/// - without flash/selective: `a·c·s·b·e / t` (softmax probabilities);
/// - full recompute keeps only the layer input `c·b·h·e` (over `t` with SP).
pub fn llama_per_gpu(
    m: &ModelConfig,
    l: &Layout,
    s: usize,
    b: usize,
    e: usize,
    r: Recompute,
) -> f64 {
    let terms = Terms::new(m, l, b, s, e);
    let Terms {
        t,
        c,
        bf,
        ef,
        h,
        sp_div,
    } = terms;
    if r == Recompute::Full {
        return terms.full_recompute();
    }
    let cbe = c * bf * ef;
    // (OLMo: no norm before the attention or the MLP, so no norm input)
    let replicated = cbe * if m.post_norms { 2.0 } else { 4.0 } * h / sp_div;
    let q_o = cbe * 2.0 * m.q_dim() as f64 / t;
    let k_v = cbe * 2.0 * (l.kv_heads_per_tp_rank(m) * m.head_dim) as f64;
    let dense_mlp = cbe * 3.0 * m.ffn as f64 / t;
    let mlp = match &m.moe {
        None => dense_mlp,
        Some(x) => {
            // (Qwen2-MoE's shared expert: a dense MLP's `3·f_s/t` beside)
            let sparse = cbe * (x.top_k as f64 * (3.0 * x.expert_ffn as f64 / t + 2.0 * h) + 3.0 * x.shared_ffn as f64 / t);
            dense_mlp + m.sparse_fraction() * (sparse - dense_mlp)
        }
    };
    let scores = terms.scores(m, l, s, r, ef);
    replicated + q_o + k_v + mlp + scores
}

/// What candle-cp's Llama layer keeps per GPU beyond [`llama_per_gpu`], by how it is
/// implemented (`c = s/cp` tokens, `a_t = a/t` query heads and `kv_t` KV heads per TP rank,
/// `u` the Ulysses degree, `kv_u = lcm(kv_t, u)/u` KV heads per Ulysses rank, copies
/// included):
/// - the attention's log-sum-exp `[B, a_t, c]` f32: `4·a_t·c·b`;
/// - the two RMSNorm statistics `[B, c/sp_div]` f32: `8·c·b / sp_div`;
/// - Ulysses and 2-D keeping their head layout: q, k, v and the output there, in q's dtype:
///   `c·b·e·(2·a_t·d + 2·u·kv_u·d)` (with [`Layout::regather_heads`] nothing: the backward
///   all-to-alls them again);
/// - where the backward's row sums come from the f32 output
///   ([`Layout::f32_row_sums_or_default`]: by default the ring kinds and 2-D, with
///   [`Layout::f32_row_sums`] also one device and Ulysses) and activations are 16-bit: the
///   output's bf16 rounding residual `2·a_t·d·c·b` (Ulysses and 2-D: in the head layout, the
///   same bytes);
/// - Qwen3's head norms ([`ModelConfig::qk_norm`]): RoPE comes out of the projection's node
///   into one node with the norm, which keeps q and k before the norm, in the activations'
///   dtype, and each head's f32 statistic: `c·b·(a_t + kv_t)·(d·e + 4)`.
/// - OLMo's q and k norms over the whole projection ([`ModelConfig::qk_norm_flat`]): one node with
///   RoPE, keeping q and k before the norm and a token's f32 statistic for each:
///   `c·b·((a_t + kv_t)·d·e + 8)`; OLMo 2 and 3 have no norm before the attention or the MLP
///   ([`ModelConfig::post_norms`]: no statistics term above).
/// - Gemma's and OLMo's norms after the attention and the MLP ([`ModelConfig::sandwich_norms`]): each norm and
///   its residual add are one node, which keeps the projection's output (`[B, c/sp_div, h]`)
///   and the f32 statistic: `2·c·b·(h·e + 4) / sp_div`.
/// - a sparse layer (averaged over the layers, [`ModelConfig::sparse_fraction`]): the router's
///   logits and f32 probabilities `c·b·E·(e + 4)`, the chosen experts and their f32 weights
///   `8·c·b·K` (renormalised: `4·c·b·(K + 1)` more; 16-bit: the weights in `e` bytes too), the
///   pair indices `12·c·b·K`, the MLP output before the residual add `c·b·h·e / sp_div`; with
///   `t > 1` the gathered (or copied) input and the partial output `2·c·b·h·e` (the input is
///   not regathered in the backward as the dense MLP's is), without SP the router's copy
///   `E·h·e`; GLM-4.5's sigmoid router ([`crate::model::MoeShape::sigmoid_router`]) the same with
///   its logits in f32 (`8·c·b·E`), its
///   weights scaled once more (`4·c·b·K`), its shared expert ungated: the output and the routed
///   experts' sum beside it (`2·c·b·h·e`).
///
/// The column-parallel inputs are kept as the sequence shards (gathered again in the
/// backward, as Megatron-LM does), so TP and SP add no term. Full recompute adds nothing
/// (the layer input is all that stays). Selective recompute is
/// the same as none (the attention is flash-style already).
pub fn candle_cp_extra_per_gpu(m: &ModelConfig, l: &Layout, s: usize, b: usize, e: usize, r: Recompute) -> f64 {
    if r == Recompute::Full {
        return 0.0;
    }
    let terms = Terms::new(m, l, b, s, e);
    let (c, bf, ef, sp_div) = (terms.c, terms.bf, terms.ef, terms.sp_div);
    let d = m.head_dim as f64;
    let a_t = l.heads_per_tp_rank(m) as f64;
    let kv_t = l.kv_heads_per_tp_rank(m);
    let lse = 4.0 * a_t * c * bf;
    // (OLMo has no norm before the attention or the MLP: its norms are the sandwich term's)
    let norms = if m.post_norms { 0.0 } else { 8.0 * c * bf / sp_div };
    let u = l.ulysses_degree();
    let kv_u = crate::layout::kv_copies_per_ulysses_rank(kv_t, u) as f64;
    let head_kv = 2.0 * u as f64 * kv_u * d;
    // the output's bf16 rounding residual (16-bit activations), for f32 row sums
    let residual = if e < 4 && l.f32_row_sums_or_default() { 2.0 * a_t * d * c * bf } else { 0.0 };
    // Ulysses and 2-D keeping their head layout: q, k, v and the output there, in q's dtype
    let head_layout = match l.cp_kind {
        CpKind::Ulysses | CpKind::TwoD if l.cp > 1 && !l.regather_heads => c * bf * ef * (2.0 * a_t * d + head_kv),
        _ => 0.0,
    };
    let attention = head_layout + residual;
    let qk_norm = match (m.qk_norm, m.qk_norm_flat) {
        (true, _) => c * bf * (a_t + kv_t as f64) * (d * ef + 4.0),
        // OLMo: q and k before the norm and one f32 statistic per token each
        (false, true) => c * bf * ((a_t + kv_t as f64) * d * ef + 8.0),
        (false, false) => 0.0,
    };
    let sandwich = if m.sandwich_norms { 2.0 * c * bf * (m.hidden as f64 * ef + 4.0) / sp_div } else { 0.0 };
    let moe = match &m.moe {
        None => 0.0,
        Some(x) => {
            let (n, k, ex, h) = (c * bf, x.top_k as f64, x.experts as f64, m.hidden as f64);
            // (GLM-4.5's logits in f32)
            let router = n * ex * (if x.sigmoid_router { 4.0 } else { ef } + 4.0);
            let scaled = if x.sigmoid_router { 4.0 * n * k } else { 0.0 };
            let weights = 8.0 * n * k + if x.norm_topk { 4.0 * n * (k + 1.0) } else { 0.0 } + if e < 4 { n * k * ef } else { 0.0 } + scaled;
            let pairs = 12.0 * n * k;
            let out = n * h * ef / sp_div;
            let tp = if l.tp > 1 { 2.0 * n * h * ef + if l.sp { 0.0 } else { ex * h * ef } } else { 0.0 };
            // Qwen2-MoE's shared expert: its gate's logit through the sigmoid's four steps and the
            // gate (five `[N, 1]`), its output, the product and the routed experts' sum beside it
            // (three `[N, h]`); without SP its gate weight's copy
            let shared = match (x.shared_ffn, x.sigmoid_router) {
                (0, _) => 0.0,
                // (GLM-4.5's, ungated: its output and the routed experts' sum)
                (_, true) => 2.0 * n * h * ef,
                (_, false) => n * ef * (3.0 * h + 5.0) + if l.tp > 1 && !l.sp { h * ef } else { 0.0 },
            };
            m.sparse_fraction() * (router + weights + pairs + out + tp + shared)
        }
    };
    // DeepSeek-V3's latent attention (q, k, v at the padded width and the output are the Llama
    // count's, with as many KV heads as heads): the latents, their norms' outputs and f32
    // statistics on the rank's own tokens; kv_b_proj's output; the key's rotated part (the
    // shard before the gather under SP, the whole CP shard, its reordered copy, rotated); the
    // output's first v dimensions copied for o_proj when v < D
    let mla = match &m.mla {
        None => 0.0,
        Some(x) => {
            let (st, rq, rkv, dr) = (c * bf / sp_div, x.q_lora_rank.unwrap_or(0) as f64, x.kv_lora_rank as f64, x.qk_rope_head_dim as f64);
            let (nope, v) = (x.qk_nope_head_dim as f64, x.v_head_dim as f64);
            let latents = st * (2.0 * rq + 2.0 * rkv + dr) * ef + 4.0 * st * if x.q_lora_rank.is_some() { 2.0 } else { 1.0 };
            let kv = c * bf * a_t * (nope + v) * ef;
            let rot = (if l.tp > 1 && l.sp { st } else { 0.0 } + c * bf * if x.rope_interleave { 3.0 } else { 2.0 }) * dr * ef;
            let out = if x.v_head_dim < m.head_dim { c * bf * a_t * v * ef } else { 0.0 };
            latents + kv + rot + out
        }
    };
    lse + norms + attention + qk_norm + sandwich + moe + mla
}

/// [`llama_per_gpu`] plus [`candle_cp_extra_per_gpu`]: what candle-cp's Llama keeps per
/// layer and GPU.
pub fn candle_cp_per_gpu(m: &ModelConfig, l: &Layout, s: usize, b: usize, e: usize, r: Recompute) -> f64 {
    llama_per_gpu(m, l, s, b, e, r) + candle_cp_extra_per_gpu(m, l, s, b, e, r)
}

/// [`candle_cp_per_gpu`] of one layer, no parallelism (flash-style attention always).
pub fn candle_cp_layer_bytes(m: &ModelConfig, s: usize, b: usize, e: usize) -> f64 {
    candle_cp_per_gpu(m, &single_gpu(true), s, b, e, Recompute::None)
}

/// Per-layer, per-GPU stored activations under the chosen activation model.
pub fn layer_per_gpu(
    am: ActivationModel,
    m: &ModelConfig,
    l: &Layout,
    s: usize,
    b: usize,
    e: usize,
    r: Recompute,
) -> f64 {
    match am {
        ActivationModel::Korthikanti => korthikanti_per_gpu(m, l, s, b, e, r),
        ActivationModel::Llama => llama_per_gpu(m, l, s, b, e, r),
        ActivationModel::CandleCp => candle_cp_per_gpu(m, l, s, b, e, r),
    }
}

/// Layers held by the busiest pipeline stage: `ceil(L / pp)`; with `v` virtual stages, `v`
/// chunks of `ceil(L / (pp·v))`.
pub fn layers_per_stage(m: &ModelConfig, l: &Layout) -> usize {
    let v = l.virtual_stages.max(1);
    v * m.layers.div_ceil(l.pp * v)
}

/// Extra activations the first stage stores under the interleaved schedule:
/// `1 + (pp−1)/(pp·v)` for `v > 1` virtual stages, else 1.
pub fn interleave_factor(l: &Layout) -> f64 {
    let (p, v) = (l.pp as f64, l.virtual_stages.max(1) as f64);
    if l.virtual_stages > 1 {
        1.0 + (p - 1.0) / (p * v)
    } else {
        1.0
    }
}

/// Activation memory per GPU, bytes, for the busiest stage.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActivationTotals {
    /// Stored per layer per GPU under the chosen recompute policy.
    pub per_layer_per_gpu: f64,
    /// Micro-batches in flight on the first stage (1F1B schedule: `min(pp, k)`).
    pub in_flight_microbatches: usize,
    /// `in_flight · ceil(L/pp) · per_layer_per_gpu` on the first stage (× the interleaved
    /// schedule's [`interleave_factor`]).
    pub layers: f64,
    /// Full recompute: one layer's un-recomputed activations live during its backward.
    pub recompute_working_set: f64,
    /// fp32 logits for the loss on the last stage: `c·b·(v/t)·4`.
    pub logits: f64,
    /// Peak over the first and last stage.
    pub total: f64,
}

/// Activation memory per GPU: the first stage stores `min(pp, k)` micro-batches (1F1B with
/// `k` micro-batches per step) of `ceil(L/pp)` layers; the last stage stores one micro-batch
/// plus the fp32 logits; full recompute adds one layer's full activations (the layer being
/// backpropagated).
#[allow(clippy::too_many_arguments)]
pub fn activation_totals(
    am: ActivationModel,
    m: &ModelConfig,
    l: &Layout,
    s: usize,
    b: usize,
    e: usize,
    micro_batches: usize,
) -> ActivationTotals {
    let per_layer = layer_per_gpu(am, m, l, s, b, e, l.recompute);
    let lps = layers_per_stage(m, l) as f64;
    let in_flight = l.pp.min(micro_batches.max(1));
    let layers = in_flight as f64 * lps * per_layer * interleave_factor(l);
    let working = if l.recompute == Recompute::Full {
        layer_per_gpu(am, m, l, s, b, e, Recompute::Selective)
    } else {
        0.0
    };
    let c = (s / l.cp) as f64;
    // (a reward model's f32 scores: its labels per token, replicated over TP)
    let logits = c * b as f64 * m.score_head.map_or(vocab_rows_per_gpu(m, l), |s| s.labels) as f64 * 4.0;
    let first = layers + working;
    let last = lps * per_layer + working + logits;
    let total = if l.pp == 1 {
        first + logits
    } else {
        first.max(last)
    };
    ActivationTotals {
        per_layer_per_gpu: per_layer,
        in_flight_microbatches: in_flight,
        layers,
        recompute_working_set: working,
        logits,
        total,
    }
}

#[path = "memory/params.rs"]
mod params;
pub use params::{
    attn_matrix_params_per_gpu, layer_adapted_params_per_gpu, layer_expert_lora_params_per_gpu, layer_expert_params_per_gpu, layer_lora_params_per_gpu, layer_params_per_gpu, layer_quantized_params_per_gpu, lora_saved_params_per_gpu, params_per_gpu,
    vocab_rows_per_gpu,
};

/// Weights, gradients and optimizer state per GPU, bytes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelStates {
    /// Parameters on this GPU before ZeRO sharding.
    pub params: f64,
    /// `e` bytes per parameter (over `dp·cp` with ZeRO-3).
    pub weights: f64,
    /// `e` bytes per parameter (over `dp·cp` with ZeRO-2/3).
    pub grads: f64,
    /// Adam: fp32 master (when `e < 4`) + m + v = 12 bytes/param (8 in fp32), over `dp·cp`
    /// with ZeRO-1/2/3.
    pub optimizer: f64,
    /// Ranks sharing the same weights, over which ZeRO shards: `dp·cp`.
    pub zero_shards: usize,
    /// A quantized base's dequantized working weights ([`Layout::base_quant`]): `e` bytes
    /// for one layer's quantized projections with full recompute (built in the layer's forward
    /// and again in its backward), for every layer's without (the graph keeps them for the
    /// backward); 0 without quantization.
    pub dequantized: f64,
    /// DoRA's working weights ([`Layout::lora_dora`]): `e` bytes per adapted weight
    /// ([`layer_adapted_params_per_gpu`]) for one layer with full recompute, for every layer
    /// without (each layer's graph keeps its DoRA weights for the backward); 0 without DoRA.
    pub dora_weights: f64,
    /// ZeRO-3's unsharded working copies: the weights of the layer being computed and of the
    /// next one (prefetched), and the gradients of one layer before their reduce-scatter,
    /// `3·e·max(layer, embedding)` parameters of this GPU; 0 below ZeRO-3.
    pub zero3_gathered: f64,
    /// Sum of the four.
    pub total: f64,
}

/// Mixed-precision Adam state per GPU (16 bytes/param in bf16/fp16; a LoRA run: `e` bytes
/// per frozen weight, 16 per adapter parameter), sharded per ZeRO
/// stage over the `dp·cp` ranks that hold the same weight shard; under expert parallelism the
/// experts' (split over the EP ranks already) over the `dp·cp/ep` ranks holding the same
/// experts, as candle-cp's trainer splits them (`AdamW::with_expert_parallel`) and
/// Megatron's distributed optimizer does.
pub fn model_states(m: &ModelConfig, l: &Layout, e: usize) -> ModelStates {
    // (with the modules trained whole: their gradients and Adam state as the adapters'; their
    // weights are the base's, counted once)
    let saved = lora_saved_params_per_gpu(m, l);
    let adapters = layers_per_stage(m, l) as f64 * layer_lora_params_per_gpu(m, l) + saved;
    let params = params_per_gpu(m, l) + adapters - saved;
    let experts = layers_per_stage(m, l) as f64 * layer_expert_params_per_gpu(m, l);
    let dense = params - experts;
    let n = (l.dp * l.cp) as f64;
    let n_ex = n / l.ep.max(1) as f64;
    let opt_bytes = if e < 4 { 12.0 } else { 8.0 };
    let shard = |stage: u8, n: f64| if l.zero >= stage { n } else { 1.0 };
    let by = |bytes: f64, stage: u8| dense * bytes / shard(stage, n) + experts * bytes / shard(stage, n_ex);
    let mut weights = by(e as f64, 3);
    // a quantized base: its projections' codes and scales in place of e bytes per weight,
    // and the dequantized copies the forward builds
    let quantized = layers_per_stage(m, l) as f64 * layer_quantized_params_per_gpu(m, l);
    let dequantized = match l.base_quant.filter(|_| l.lora_rank > 0) {
        Some(q) => {
            weights -= quantized * (e as f64 - q.bytes_per_weight()) / shard(3, n);
            let layers = if l.recompute == crate::layout::Recompute::Full { 1.0 } else { layers_per_stage(m, l) as f64 };
            e as f64 * layer_quantized_params_per_gpu(m, l) * layers
        }
        None => 0.0,
    };
    // DoRA: the adapted weights' DoRA copies, kept for the backward
    let dora_weights = if l.lora_dora && l.lora_rank > 0 {
        let layers = if l.recompute == crate::layout::Recompute::Full { 1.0 } else { layers_per_stage(m, l) as f64 };
        e as f64 * layer_adapted_params_per_gpu(m, l) * layers
    } else {
        0.0
    };
    // LoRA: gradients and Adam state of the adapters alone (the base weights frozen)
    let (grads, optimizer) = if l.lora_rank > 0 {
        // (the experts' adapters split over the ranks holding their experts, as the experts)
        let ex = layers_per_stage(m, l) as f64 * layer_expert_lora_params_per_gpu(m, l);
        let of = |bytes: f64, stage: u8| (adapters - ex) * bytes / shard(stage, n) + ex * bytes / shard(stage, n_ex);
        (of(e as f64, 2), of(opt_bytes, 1))
    } else {
        (by(e as f64, 2), by(opt_bytes, 1))
    };
    let zero3_gathered = if l.zero >= 3 && n > 1.0 {
        let emb = vocab_rows_per_gpu(m, l) as f64 * m.hidden as f64;
        3.0 * e as f64 * layer_params_per_gpu(m, l).max(emb)
    } else {
        0.0
    };
    ModelStates {
        params,
        weights,
        grads,
        optimizer,
        zero_shards: l.dp * l.cp,
        dequantized,
        dora_weights,
        zero3_gathered,
        total: weights + grads + optimizer + zero3_gathered + dequantized + dora_weights,
    }
}

#[cfg(test)]
mod tests;
