//! Parameters per GPU: each layer's (TP / EP splits, KV-head copies, DeepSeek's latent
//! attention, LoRA adapters, a quantized base's codes), the vocabulary tables', and the whole
//! busiest pipeline stage's ([`params_per_gpu`]). `tests/plan_params.rs` compares them with
//! what candle-cp-llama's model and trainer hold, rank by rank.

use super::layers_per_stage;
use crate::layout::Layout;
use crate::model::ModelConfig;

/// Vocabulary rows of the embedding / output projection on one GPU: `⌈V/t⌉` (a vocabulary
/// `t` does not divide is padded with zero rows to `t·⌈V/t⌉`, as the model and Megatron do),
/// or all `V` when `V < t` (replicated).
pub fn vocab_rows_per_gpu(m: &ModelConfig, l: &Layout) -> usize {
    if m.vocab < l.tp {
        m.vocab
    } else {
        m.vocab.div_ceil(l.tp.max(1))
    }
}

/// The attention's matrix parameters of one layer on one GPU: q and o over `t`, k and v over
/// `a_kv/t` (replicated when `t > a_kv`); DeepSeek's latent attention: the down-projections
/// whole, the up-projections and o_proj over `t`.
pub fn attn_matrix_params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    let t = l.tp as f64;
    let (h, q) = (m.hidden as f64, m.q_dim() as f64);
    match &m.mla {
        // DeepSeek's latent attention: the down-projections replicated, the up-projections and
        // o_proj split by heads
        Some(a) => a.down_params(m.hidden) as f64 + a.up_params(m.hidden, m.heads) as f64 / t,
        // q and o split by heads, k and v by KV heads (copies where TP exceeds them)
        None => 2.0 * h * q / t + 2.0 * h * (l.kv_heads_per_tp_rank(m) * m.head_dim) as f64,
    }
}

/// Parameters of one layer on one GPU: matrices over `t` (KV projections over `a_kv/t`,
/// replicated when `t > a_kv`), the q, k, v biases split the same way, and the two norms
/// and Qwen3's head norms (replicated; Gemma 3's four norms).
pub fn layer_params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    let t = l.tp as f64;
    let (h, q, f) = (m.hidden as f64, m.q_dim() as f64, m.ffn as f64);
    let kv = (l.kv_heads_per_tp_rank(m) * m.head_dim) as f64;
    let bias = if m.qkv_bias { q / t + 2.0 * kv } else { 0.0 };
    // gpt-oss: its sinks split by head, the o_proj bias replicated
    let sinks = if m.gpt_oss { m.heads as f64 / t + h } else { 0.0 };
    // (OLMo's q and k norms split as their projections' rows; Qwen3's replicated)
    let qk_norms = if m.qk_norm_flat { q / t + kv } else { m.qk_norm_params() as f64 };
    let attn = attn_matrix_params_per_gpu(m, l);
    let dense = attn + 3.0 * h * f / t + m.layer_norm_params() as f64 + bias + qk_norms + sinks;
    match &m.moe {
        // a sparse layer: the router (replicated) and every expert's 1/t slice for the dense MLP
        Some(x) => {
            // (its gate replicated; GLM-4.5's: none, the router's correction bias replicated)
            let shared = match (x.shared_ffn, x.sigmoid_router) {
                (0, false) => 0.0,
                (_, true) => 3.0 * h * x.shared_ffn as f64 / t + if x.correction_bias { x.experts as f64 } else { 0.0 },
                (_, false) => 3.0 * h * x.shared_ffn as f64 / t + h,
            };
            let ep = l.ep.max(1) as f64;
            // gpt-oss: the router's bias (replicated), the experts' split as their weights
            let biases = if m.gpt_oss { x.experts as f64 + (x.experts * (2 * x.expert_ffn + m.hidden)) as f64 / (t * ep) } else { 0.0 };
            dense + m.sparse_fraction() * (x.experts as f64 * h + 3.0 * h * (x.expert_ffn * x.experts) as f64 / (t * ep) - 3.0 * h * f / t + shared + biases)
        }
        None => dense,
    }
}

/// Expert parameters of one layer on one GPU (averaged over the layers like
/// [`layer_params_per_gpu`]): each expert's `1/t` slice of the `E/ep` experts it holds; 0 for
/// a dense model.
pub fn layer_expert_params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    match &m.moe {
        Some(x) => {
            // (gpt-oss: the experts' biases split with them)
            let biases = if m.gpt_oss { (x.experts * (2 * x.expert_ffn + m.hidden)) as f64 } else { 0.0 };
            m.sparse_fraction() * (3.0 * m.hidden as f64 * (x.expert_ffn * x.experts) as f64 + biases) / (l.tp * l.ep.max(1)) as f64
        }
        None => 0.0,
    }
}

/// The parameters of one layer on one GPU that a quantized base stores as codes
/// ([`Layout::base_quant`]): the attention's q, k, v, o, the dense MLP's gate, up, down, and a
/// sparse layer's experts and shared expert (split over TP and EP as [`layer_params_per_gpu`]
/// counts them); not the norms, biases or router.
pub fn layer_quantized_params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    let t = l.tp as f64;
    let (h, f) = (m.hidden as f64, m.ffn as f64);
    let dense_mlp = if m.moe.is_some() { 1.0 - m.sparse_fraction() } else { 1.0 };
    let shared = m.moe.as_ref().map_or(0.0, |x| m.sparse_fraction() * 3.0 * h * x.shared_ffn as f64 / t);
    attn_matrix_params_per_gpu(m, l) + dense_mlp * 3.0 * h * f / t + layer_expert_params_per_gpu(m, l) + shared
}

/// LoRA adapter parameters of one layer on one GPU ([`Layout::lora_rank`] `r`; 0 without):
/// `r·(in + out)` per adapted projection (a Phi-3's fused module one `A` for its parts,
/// [`ModelConfig::fused_proj`]), split over TP as candle-cp splits them (a
/// column-parallel projection's `A` `[r, in]` replicated and `B` `[out/t, r]`; a row-parallel
/// one's `A` `[r, in/t]` and `B` `[out, r]` replicated; K/V's `B` as their heads). The MLP's
/// with [`Layout::lora_mlp`]: a dense layer's, and a sparse layer's shared expert's and
/// experts' ([`layer_expert_lora_params_per_gpu`]), as PEFT's targets `gate_proj`, `up_proj`,
/// `down_proj` adapt them, and its routers' (PEFT's `all-linear`: `gate`, `shared_expert_gate`;
/// with DoRA a magnitude per expert too).
pub fn layer_lora_params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    let r = l.lora_rank as f64;
    if r == 0.0 {
        return 0.0;
    }
    let t = l.tp as f64;
    let (h, q, f) = (m.hidden as f64, m.q_dim() as f64, m.ffn as f64);
    let kv = (l.kv_heads_per_tp_rank(m) * m.head_dim) as f64;
    // q, k, v: A replicated, B split; o: A split, B replicated (DoRA: a magnitude per output
    // row, split as B)
    let dora = if l.lora_dora { 1.0 } else { 0.0 };
    // (a Phi-3's fused modules: one A for q, k, v and one for gate, up)
    let (qkv_a, gate_up_a) = if m.fused_proj { (1.0, 1.0) } else { (3.0, 2.0) };
    let attn = match &m.mla {
        // DeepSeek-V3: the latent attention's projections (PEFT's q_a_proj, q_b_proj — or
        // q_proj —, kv_a_proj_with_mqa, kv_b_proj) and o_proj: the down-projections' A and B
        // replicated, the up-projections' A replicated and B split, o_proj's A split; DoRA's
        // magnitudes as each B (the down-projections' replicated)
        Some(x) => {
            let (a, qk, nv) = (m.heads as f64, (x.qk_nope_head_dim + x.qk_rope_head_dim) as f64, (x.qk_nope_head_dim + x.v_head_dim) as f64);
            let (rkv, dr, v) = (x.kv_lora_rank as f64, x.qk_rope_head_dim as f64, x.v_head_dim as f64);
            let q = match x.q_lora_rank {
                Some(rq) => r * (h + rq as f64) + r * (rq as f64 + a * qk / t),
                None => r * (h + a * qk / t),
            };
            let q_down = x.q_lora_rank.map_or(0.0, |rq| rq as f64);
            q + r * (h + rkv + dr) + r * (rkv + a * nv / t) + r * (a * v / t + h) + dora * (q_down + a * qk / t + rkv + dr + a * nv / t + h)
        }
        None => r * (qkv_a * h + q / t + 2.0 * kv) + r * (q / t + h) + dora * (q / t + 2.0 * kv + h),
    };
    let dense_mlp = if m.moe.is_some() { 1.0 - m.sparse_fraction() } else { 1.0 };
    // gate, up: A replicated, B split; down: A split, B replicated
    let mlp_of = |f: f64| r * (gate_up_a * h + 2.0 * f / t) + r * (f / t + h) + dora * (2.0 * f / t + h);
    let shared = m.moe.as_ref().filter(|x| x.shared_ffn > 0).map_or(0.0, |x| m.sparse_fraction() * mlp_of(x.shared_ffn as f64));
    // a sparse layer's routers (PEFT's all-linear adapts them: `gate` [E, h], Qwen2-MoE's
    // `shared_expert_gate` [1, h]; gpt-oss's router is no linear module; DoRA: a magnitude per
    // output row), replicated
    let routers = match &m.moe {
        Some(x) if !m.gpt_oss => {
            let e = x.experts as f64;
            let shared_gate = if x.shared_ffn > 0 && !x.sigmoid_router { r * (h + 1.0) + dora } else { 0.0 };
            m.sparse_fraction() * (r * (h + e) + dora * e + shared_gate)
        }
        _ => 0.0,
    };
    let mlp = if l.lora_mlp { dense_mlp * mlp_of(f) + shared + routers } else { 0.0 };
    attn + mlp + layer_expert_lora_params_per_gpu(m, l)
}

/// The experts' share of [`layer_lora_params_per_gpu`] (averaged over the layers, as
/// [`layer_expert_params_per_gpu`]): with [`Layout::lora_mlp`] each of the `E/ep` experts a GPU
/// holds has a dense MLP's adapters of width `f_e` (`r·(3h + 3f_e/t)`; gpt-oss's experts,
/// parameters adapted as PEFT's `target_parameters` do, one `A` for gate and up:
/// `r·(2h + 3f_e/t)`, no DoRA); 0 otherwise. Split over EP like the experts, so ZeRO splits
/// their state over the `dp·cp/ep` ranks holding them.
pub fn layer_expert_lora_params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    let (r, t, h) = (l.lora_rank as f64, l.tp as f64, m.hidden as f64);
    match &m.moe {
        Some(x) if l.lora_mlp && r > 0.0 => {
            let dora = if l.lora_dora && !m.gpt_oss { 2.0 * x.expert_ffn as f64 / t + h } else { 0.0 };
            // (gpt-oss: gate_up_proj's one A)
            let a_h = if m.gpt_oss { 2.0 } else { 3.0 };
            let per_expert = r * (a_h * h + 3.0 * x.expert_ffn as f64 / t) + dora;
            m.sparse_fraction() * per_expert * x.experts as f64 / l.ep.max(1) as f64
        }
        _ => 0.0,
    }
}

/// The weights of one layer on one GPU that LoRA adapts ([`Layout::lora_rank`]): q, k, v, o,
/// and with [`Layout::lora_mlp`] the MLP's (a sparse layer's experts and shared expert too); 0
/// without LoRA. DoRA keeps a copy of each for the backward ([`super::ModelStates::dora_weights`]).
pub fn layer_adapted_params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    if l.lora_rank == 0 {
        return 0.0;
    }
    if l.lora_mlp {
        // the quantized base's projections are exactly these
        layer_quantized_params_per_gpu(m, l)
    } else {
        attn_matrix_params_per_gpu(m, l)
    }
}

/// The parameters of the modules a LoRA run trains whole on one GPU ([`Layout::lora_save_embed`],
/// [`Layout::lora_save_head`]): the embedding's and the head's vocabulary rows of this GPU
/// (`⌈V/t⌉·h` each); with pipeline stages the busier of the first (embedding) and the last
/// (head). 0 without LoRA.
pub fn lora_saved_params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    if l.lora_rank == 0 {
        return 0.0;
    }
    let rows = vocab_rows_per_gpu(m, l) as f64 * m.hidden as f64;
    // (a reward model's score head is saved whole, replicated)
    let head = m.score_head.map_or(rows, |s| s.params(m.hidden) as f64);
    let (e, h) = (if l.lora_save_embed { rows } else { 0.0 }, if l.lora_save_head && (!m.tie_embeddings || m.score_head.is_some()) { head } else { 0.0 });
    if l.pp > 1 {
        e.max(h)
    } else {
        e + h
    }
}

/// Parameters held by one GPU (busiest pipeline stage): [`layer_params_per_gpu`] per layer,
/// embedding and output projection vocab-parallel over `t` ([`vocab_rows_per_gpu`]), on the
/// first/last stage.
pub fn params_per_gpu(m: &ModelConfig, l: &Layout) -> f64 {
    let h = m.hidden as f64;
    let layer = layer_params_per_gpu(m, l);
    let emb = vocab_rows_per_gpu(m, l) as f64 * h;
    if l.pp == 1 {
        let out = match m.score_head {
            // (a reward model's score head, replicated over TP)
            Some(s) => s.params(m.hidden) as f64,
            None if m.tie_embeddings => 0.0,
            None => emb,
        };
        return m.layers as f64 * layer + emb + out + h;
    }
    // First stage: layers + embedding; the last stage is heavier by the final norm:
    // layers + output projection (a copy of the embedding if tied) + final norm.
    layers_per_stage(m, l) as f64 * layer + emb + h
}
