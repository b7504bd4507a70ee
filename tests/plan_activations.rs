//! The planner's activation count (`candle_cp_plan::memory::candle_cp_per_gpu`, the
//! `candle-cp` activation model) equals the bytes our Llama layer keeps alive between its
//! forward and backward, measured, on every parallel layout, in f32 and bf16.
//!
//! Measure: a counting global allocator (this test binary only; one `#[test]` so nothing else
//! allocates meanwhile). Every rank builds the model and runs one forward to warm up; then,
//! between barriers, the live heap bytes before and after a forward whose output (and so its
//! whole graph) is held. The ranks are threads of one heap, so the difference is divided by
//! the world size (the layouts here give every rank the same shapes). A model of 3 layers
//! minus one of 1 layer, halved, is one layer's share: the embedding, the final norm and
//! constant overheads cancel. Each figure must be within 1.5% of the planner's (what is
//! left is the graph's own bookkeeping, about 20 bytes per token and layer).
//!
//! The Llama count (`llama_per_gpu`: what a fused Megatron-style layer keeps) is printed
//! beside it: on one device the model keeps 1.00x it; the difference elsewhere is the
//! implementation terms `candle_cp_extra_per_gpu` lists (Ulysses' and 2-D's head-layout
//! copies, the ring's bf16 output residual); with the head layout regathered in the backward
//! (`HeadLayout::Regathered`) Ulysses keeps the Llama count and 2-D the ring's. With the
//! backward's row sums from the f32 output (`RowSums::F32`), one device and Ulysses keep the
//! output's bf16 rounding residual in bf16 (the ring's term), nothing more in f32; with them
//! from the returned output (`RowSums::Output`) the ring and 2-D keep none.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::Layout;
use candle_cp_llama::HeadLayout::Regathered;
use candle_cp_llama::RowSums::{Output as OutRows, F32 as F32Rows};
use candle_cp_llama::{init_params_sharded, shard_batch, CpKind, Llama, LlamaConfig, ParallelCtx};
use candle_cp_plan::memory::{candle_cp_per_gpu, llama_per_gpu};
use candle_cp_plan::{CpKind as PlanCp, Layout as PlanLayout, ModelConfig, Recompute};
use candle_nn::VarBuilder;
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: AllocLayout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            LIVE.fetch_add(l.size(), Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: AllocLayout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const T: usize = 1024;

/// Live bytes per rank that one forward of `cfg` leaves behind (graph held), `T` tokens.
fn retained(cfg: &LlamaConfig, layout: Layout, dtype: DType, recompute: bool) -> Result<f64> {
    let n = layout.world_size();
    let bar = Arc::new(Barrier::new(n));
    let dev = Device::Cpu;
    let res = run_ranks(n, |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = init_params_sharded(cfg, 1, dtype, &ctx, &dev)?;
        let model = Llama::new(VarBuilder::from_varmap(&vm, dtype, &dev), cfg, &ctx)?.with_recompute(recompute);
        let ids: Vec<u32> = (0..T as u32).map(|i| (i * 7 + 3) % cfg.vocab_size as u32).collect();
        let sb = shard_batch(&Tensor::from_vec(ids, (1, T), &dev)?, &ctx)?;
        // a training forward's LoRA dropout (masks drawn; nothing without LoRA dropout)
        model.set_lora_dropout(Some((candle_cp_nn::RngStreams::new(1), 0, 1, T)))?;
        // warm-up: thread pools and GEMM scratch buffers allocated once
        model.hidden(&sb.input_ids, &sb.positions)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
        bar.wait();
        let before = LIVE.load(Ordering::SeqCst);
        bar.wait();
        let h = model.hidden(&sb.input_ids, &sb.positions)?;
        bar.wait();
        let after = LIVE.load(Ordering::SeqCst);
        bar.wait();
        drop(h);
        Ok(after as f64 - before as f64)
    });
    let v: Vec<f64> = res.into_iter().collect::<Result<_>>()?;
    Ok(v[0] / n as f64)
}

#[test]
fn planner_activations_equal_what_the_model_keeps() -> Result<()> {
    // the architecture: 0 Llama, 1 Qwen3 (head norms), 2 Gemma 3 (head norms, norms after
    // attention and MLP, GELU, scaled embedding; no window here)
    // 3 Qwen3-MoE (8 experts, 2 per token, 64 wide, renormalised); 7 OLMo 2
    let moe = || {
        let mut m = candle_cp_llama::MoeConfig::new(8, 2, 64);
        m.norm_topk_prob = true;
        m
    };
    // 4 Mixtral (the same experts, no head norms)
    let cfg = |layers, arch: usize| {
        let c = LlamaConfig::tiny(64, 256, layers, 8, 2).with_qk_norm(arch == 1).with_gemma3(arch == 2).with_moe((arch == 3).then(moe));
        match arch {
            4 => c.with_moe(Some(candle_cp_llama::MoeConfig::mixtral(8, 2, 64))),
            // 5 Qwen2-MoE (a shared expert 96 wide, q, k, v biases)
            5 => c.with_moe(Some(candle_cp_llama::MoeConfig::qwen2_moe(8, 2, 64, 96))),
            // 6 gpt-oss (sinks, biases on q, k, v, o, the router and the experts, the clamped
            // SwiGLU; its experts 64 wide = intermediate_size)
            6 => c.with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(8, 2, 64))),
            // 7 OLMo 2 (norms after the branches only, q / k norms over the whole projections)
            7 => c.with_olmo(Some(candle_cp_llama::Olmo::Olmo2)),
            // 8 OLMoE (those q / k norms, a Llama's norms, the experts of 3 on every layer)
            8 => c.with_moe(Some(candle_cp_llama::MoeConfig::new(8, 2, 64))).with_olmo(Some(candle_cp_llama::Olmo::Olmoe)),
            // 9 EXAONE 4 (OLMo 2's norms with head norms; no window here, so every layer rotates)
            9 => c.with_exaone4(true),
            // 11 GLM-4 (norms before and after each branch, q, k, v biases, RoPE on half of
            // each head)
            11 => c.with_glm4(true),
            // 12 GLM-4.5 (sigmoid scores chosen with a correction bias in 2 groups, a shared
            // expert 64 wide without a gate, q, k, v biases and head norms, RoPE on half of
            // each head; every layer sparse here, so that one layer and three differ by sparse
            // layers)
            12 => c.with_moe(Some(candle_cp_llama::MoeConfig { groups: (2, 1), ..candle_cp_llama::MoeConfig::glm4_moe(8, 2, 64, 1, 2.5) })).with_qkv_bias(true).with_qk_norm(true),
            // 13 DeepSeek-V3 (latent attention: q rank 96, KV rank 64, 32 + 16 interleaved
            // RoPE dimensions per q / k head, values 24 wide, padded to 48; GLM-4.5's experts
            // on every layer)
            13 => c
                .with_moe(Some(candle_cp_llama::MoeConfig { groups: (2, 1), ..candle_cp_llama::MoeConfig::glm4_moe(8, 2, 64, 1, 2.5) }))
                .with_mla(Some(candle_cp_llama::config::deepseek::Mla { q_lora_rank: Some(96), kv_lora_rank: 64, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 24, rope_interleave: true })),
            // 14 DeepSeek-V2 (13's attention, interleaved; its softmax router in 2 groups, 1 kept,
            // scaled, not renormalised; a shared expert 64 wide)
            14 => c
                .with_moe(Some(candle_cp_llama::MoeConfig { groups: (2, 1), ..candle_cp_llama::MoeConfig::deepseek_v2(8, 2, 64, 1, 2.5) }))
                .with_mla(Some(candle_cp_llama::config::deepseek::Mla { q_lora_rank: Some(96), kv_lora_rank: 64, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 24, rope_interleave: true })),
            // 10 GraniteMoE (Mixtral's experts under Granite's multipliers)
            10 => c.with_moe(Some(candle_cp_llama::MoeConfig::granite_moe(8, 2, 64))).with_granite(Some(candle_cp_llama::Granite { embedding_multiplier: 12.0, attention_multiplier: 0.015625, residual_multiplier: 0.22, logits_scaling: 6.0 })),
            _ => c,
        }
    };
    let model = |arch| {
        ModelConfig::from_hf_json(&cfg(1, arch).to_hf_json("float32"), "tiny").map_err(|e| candle_core::Error::Msg(format!("planner config: {e:?}")))
    };
    let (m, qwen3, gemma3, qwen3_moe, mixtral, qwen2_moe, gpt_oss, olmo2) = (model(0)?, model(1)?, model(2)?, model(3)?, model(4)?, model(5)?, model(6)?, model(7)?);
    let (olmoe, exaone4, granite_moe, glm4, glm45, deepseek) = (model(8)?, model(9)?, model(10)?, model(11)?, model(12)?, model(13)?);
    // (the planner plans a GPU, where the latent attention's 48 runs at 64; measured here on
    // the CPU, which runs it at 48: the planner's terms at the width the run has)
    let cpu_width = |m: ModelConfig| ModelConfig { head_dim: m.mla.map_or(m.head_dim, |a| a.attn_dim()), ..m };
    let (deepseek, deepseek_v2) = (cpu_width(deepseek), cpu_width(model(14)?));
    assert!(deepseek_v2.moe.as_ref().is_some_and(|m| m.sigmoid_router && !m.correction_bias && !m.norm_topk));
    assert!(deepseek.mla.is_some_and(|a| a.attn_dim() == 48 && a.rope_interleave) && deepseek.head_dim == 48 && deepseek.kv_heads == 8);
    assert!(glm4.sandwich_norms && glm4.qkv_bias && !glm4.post_norms);
    assert!(glm45.qkv_bias && glm45.qk_norm && glm45.moe.as_ref().is_some_and(|m| m.sigmoid_router && m.shared_ffn == 64 && m.sparse_layers == 1));
    assert!(granite_moe.moe.as_ref().is_some_and(|m| m.experts == 8 && m.top_k == 2 && m.expert_ffn == 64));
    assert!(olmoe.qk_norm_flat && !olmoe.post_norms && olmoe.moe.is_some() && exaone4.post_norms && exaone4.qk_norm);
    assert!(qwen3.qk_norm && !m.qk_norm && gemma3.sandwich_norms && gemma3.qk_norm && qwen3_moe.moe.is_some() && olmo2.post_norms && olmo2.qk_norm_flat && olmo2.sandwich_norms);
    let plan = |tp: usize, sp: bool, cp: usize, kind: PlanCp, ulysses: usize| PlanLayout { tp, sp, cp, cp_kind: kind, ulysses, ..PlanLayout::default() };
    let regathered = |l: PlanLayout| PlanLayout { regather_heads: true, ..l };
    let f32_rows = |l: PlanLayout| PlanLayout { f32_row_sums: Some(true), ..l };
    let out_rows = |l: PlanLayout| PlanLayout { f32_row_sums: Some(false), ..l };
    let mut cases: Vec<(&str, Layout, PlanLayout, bool)> = vec![
        ("one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("tp 2, no sp", Layout::single().with_tp(2, false), plan(2, false, 1, PlanCp::Ring, 1), false),
        ("zigzag ring 2", Layout::cp(CpKind::Zigzag, 2), plan(1, false, 2, PlanCp::Ring, 1), false),
        ("striped ring 4", Layout::cp(CpKind::Striped, 4), plan(1, false, 4, PlanCp::Ring, 1), false),
        ("all-gather 2", Layout::cp(CpKind::AllGather, 2), plan(1, false, 2, PlanCp::Allgather, 1), false),
        ("ulysses 2", Layout::cp(CpKind::Ulysses, 2), plan(1, false, 2, PlanCp::Ulysses, 2), false),
        ("ulysses 4 (kv replicated)", Layout::cp(CpKind::Ulysses, 4), plan(1, false, 4, PlanCp::Ulysses, 4), false),
        ("2-d 2 x 2", Layout::two_d(2, 2), plan(1, false, 4, PlanCp::TwoD, 2), false),
        ("ulysses 2, heads regathered", Layout::cp(CpKind::Ulysses, 2).with_head_layout(Regathered), regathered(plan(1, false, 2, PlanCp::Ulysses, 2)), false),
        ("ulysses 4, heads regathered", Layout::cp(CpKind::Ulysses, 4).with_head_layout(Regathered), regathered(plan(1, false, 4, PlanCp::Ulysses, 4)), false),
        ("2-d 2 x 2, heads regathered", Layout::two_d(2, 2).with_head_layout(Regathered), regathered(plan(1, false, 4, PlanCp::TwoD, 2)), false),
        ("one device, f32 row sums", Layout::single().with_row_sums(F32Rows), f32_rows(plan(1, false, 1, PlanCp::Ring, 1)), false),
        ("ulysses 2, f32 row sums", Layout::cp(CpKind::Ulysses, 2).with_row_sums(F32Rows), f32_rows(plan(1, false, 2, PlanCp::Ulysses, 2)), false),
        ("ulysses 4, regathered, f32 rows", Layout::cp(CpKind::Ulysses, 4).with_head_layout(Regathered).with_row_sums(F32Rows), f32_rows(regathered(plan(1, false, 4, PlanCp::Ulysses, 4))), false),
        ("zigzag ring 2, output row sums", Layout::cp(CpKind::Zigzag, 2).with_row_sums(OutRows), out_rows(plan(1, false, 2, PlanCp::Ring, 1)), false),
        ("2-d 2 x 2, output row sums", Layout::two_d(2, 2).with_row_sums(OutRows), out_rows(plan(1, false, 4, PlanCp::TwoD, 2)), false),
        ("2-d regathered, output rows", Layout::two_d(2, 2).with_head_layout(Regathered).with_row_sums(OutRows), out_rows(regathered(plan(1, false, 4, PlanCp::TwoD, 2))), false),
        ("tp 2 + sp, zigzag 2", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), false),
        ("one device, recompute", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), true),
        ("tp 2 + sp, zigzag 2, recompute", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), true),
    ];
    // Qwen3's head norms (the model and the planner with `qk_norm`)
    let qwen3_cases = [
        ("qwen3: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("qwen3: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("qwen3: tp 4, no sp (kv replicated)", Layout::single().with_tp(4, false), plan(4, false, 1, PlanCp::Ring, 1), false),
        ("qwen3: zigzag ring 2", Layout::cp(CpKind::Zigzag, 2), plan(1, false, 2, PlanCp::Ring, 1), false),
        ("qwen3: ulysses 2", Layout::cp(CpKind::Ulysses, 2), plan(1, false, 2, PlanCp::Ulysses, 2), false),
    ];
    // Gemma 3 (the model and the planner with `gemma3`)
    let gemma3_cases = [
        ("gemma3: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("gemma3: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("gemma3: tp 2, no sp", Layout::single().with_tp(2, false), plan(2, false, 1, PlanCp::Ring, 1), false),
        ("gemma3: zigzag ring 2", Layout::cp(CpKind::Zigzag, 2), plan(1, false, 2, PlanCp::Ring, 1), false),
        ("gemma3: ulysses 2", Layout::cp(CpKind::Ulysses, 2), plan(1, false, 2, PlanCp::Ulysses, 2), false),
    ];
    // Qwen3-MoE (the model's experts and the planner's `moe`)
    let moe_cases = [
        ("qwen3-moe: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("qwen3-moe: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("qwen3-moe: tp 2, no sp", Layout::single().with_tp(2, false), plan(2, false, 1, PlanCp::Ring, 1), false),
        ("qwen3-moe: zigzag ring 2", Layout::cp(CpKind::Zigzag, 2), plan(1, false, 2, PlanCp::Ring, 1), false),
        ("qwen3-moe: ulysses 2", Layout::cp(CpKind::Ulysses, 2), plan(1, false, 2, PlanCp::Ulysses, 2), false),
        ("qwen3-moe: tp 2 + sp, zigzag 2, recompute", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), true),
    ];
    let mixtral_cases = [
        ("mixtral: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("mixtral: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
    ];
    let qwen2_moe_cases = [
        ("qwen2-moe: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("qwen2-moe: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("qwen2-moe: tp 2, no sp", Layout::single().with_tp(2, false), plan(2, false, 1, PlanCp::Ring, 1), false),
    ];
    let gpt_oss_cases = [
        ("gpt-oss: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("gpt-oss: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("gpt-oss: zigzag ring 2", Layout::cp(CpKind::Zigzag, 2), plan(1, false, 2, PlanCp::Ring, 1), false),
        ("gpt-oss: ulysses 2", Layout::cp(CpKind::Ulysses, 2), plan(1, false, 2, PlanCp::Ulysses, 2), false),
    ];
    // OLMo 2 (the model and the planner with `post_norms` and `qk_norm_flat`)
    let olmo2_cases = [
        ("olmo2: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("olmo2: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("olmo2: tp 2, no sp", Layout::single().with_tp(2, false), plan(2, false, 1, PlanCp::Ring, 1), false),
        ("olmo2: zigzag ring 2", Layout::cp(CpKind::Zigzag, 2), plan(1, false, 2, PlanCp::Ring, 1), false),
        ("olmo2: ulysses 2", Layout::cp(CpKind::Ulysses, 2), plan(1, false, 2, PlanCp::Ulysses, 2), false),
    ];
    let olmoe_cases = [
        ("olmoe: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("olmoe: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("olmoe: zigzag ring 2", Layout::cp(CpKind::Zigzag, 2), plan(1, false, 2, PlanCp::Ring, 1), false),
    ];
    let (n_plain, n_qwen3, n_gemma3, n_moe, n_mixtral) = (cases.len(), qwen3_cases.len(), gemma3_cases.len(), moe_cases.len(), mixtral_cases.len());
    let exaone4_cases = [
        ("exaone4: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("exaone4: tp 2 + sp, zigzag 2", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), false),
    ];
    let granite_moe_cases = [
        ("granitemoe: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("granitemoe: tp 2 + sp, zigzag 2", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), false),
    ];
    let (n_qwen2_moe, n_gpt_oss, n_olmo2, n_olmoe) = (qwen2_moe_cases.len(), gpt_oss_cases.len(), olmo2_cases.len(), olmoe_cases.len());
    let n_exaone4 = exaone4_cases.len();
    let glm4_cases = [
        ("glm4: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("glm4: tp 2 + sp, zigzag 2", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), false),
    ];
    let n_granite_moe = granite_moe_cases.len();
    let glm45_cases = [
        ("glm4.5: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("glm4.5: tp 2 + sp, zigzag 2", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), false),
    ];
    let n_glm4 = glm4_cases.len();
    let deepseek_cases = [
        ("deepseek-v3: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("deepseek-v3: tp 2 + sp", Layout::single().with_tp(2, true), plan(2, true, 1, PlanCp::Ring, 1), false),
        ("deepseek-v3: tp 2, no sp", Layout::single().with_tp(2, false), plan(2, false, 1, PlanCp::Ring, 1), false),
        ("deepseek-v3: ulysses 2", Layout::cp(CpKind::Ulysses, 2), plan(1, false, 2, PlanCp::Ulysses, 2), false),
        ("deepseek-v3: tp 2 + sp, zigzag 2", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), false),
    ];
    let n_deepseek = deepseek_cases.len();
    let deepseek_v2_cases = [
        ("deepseek-v2: one device", Layout::single(), plan(1, false, 1, PlanCp::Ring, 1), false),
        ("deepseek-v2: tp 2 + sp, zigzag 2", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), plan(2, true, 2, PlanCp::Ring, 1), false),
    ];
    let n_glm45 = glm45_cases.len();
    cases.extend(qwen3_cases);
    cases.extend(gemma3_cases);
    cases.extend(moe_cases);
    cases.extend(mixtral_cases);
    cases.extend(qwen2_moe_cases);
    cases.extend(gpt_oss_cases);
    cases.extend(olmo2_cases);
    cases.extend(olmoe_cases);
    cases.extend(exaone4_cases);
    cases.extend(granite_moe_cases);
    cases.extend(glm4_cases);
    cases.extend(glm45_cases);
    cases.extend(deepseek_cases);
    cases.extend(deepseek_v2_cases);
    let mut worst = 0f64;
    for (i, (name, layout, pl, rc)) in cases.iter().enumerate() {
        let (arch, m) = match i {
            i if i < n_plain => (0, &m),
            i if i < n_plain + n_qwen3 => (1, &qwen3),
            i if i < n_plain + n_qwen3 + n_gemma3 => (2, &gemma3),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe => (3, &qwen3_moe),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral => (4, &mixtral),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe => (5, &qwen2_moe),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe + n_gpt_oss => (6, &gpt_oss),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe + n_gpt_oss + n_olmo2 => (7, &olmo2),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe + n_gpt_oss + n_olmo2 + n_olmoe => (8, &olmoe),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe + n_gpt_oss + n_olmo2 + n_olmoe + n_exaone4 => (9, &exaone4),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe + n_gpt_oss + n_olmo2 + n_olmoe + n_exaone4 + n_granite_moe => (10, &granite_moe),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe + n_gpt_oss + n_olmo2 + n_olmoe + n_exaone4 + n_granite_moe + n_glm4 => (11, &glm4),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe + n_gpt_oss + n_olmo2 + n_olmoe + n_exaone4 + n_granite_moe + n_glm4 + n_glm45 => (12, &glm45),
            i if i < n_plain + n_qwen3 + n_gemma3 + n_moe + n_mixtral + n_qwen2_moe + n_gpt_oss + n_olmo2 + n_olmoe + n_exaone4 + n_granite_moe + n_glm4 + n_glm45 + n_deepseek => (13, &deepseek),
            _ => (14, &deepseek_v2),
        };
        for dtype in [DType::F32, DType::BF16] {
            let per_layer = (retained(&cfg(3, arch), *layout, dtype, *rc)? - retained(&cfg(1, arch), *layout, dtype, *rc)?) / 2.0;
            let r = if *rc { Recompute::Full } else { Recompute::None };
            let e = dtype.size_in_bytes();
            let want = candle_cp_per_gpu(m, pl, T, 1, e, r);
            let fused = llama_per_gpu(m, pl, T, 1, e, r);
            let ratio = per_layer / want;
            println!("{name:32} {dtype:?}: kept {per_layer:>10.0} B/layer, planner {want:>10.0} ({ratio:.4}x), fused Llama count {fused:>10.0} ({:.3}x)", per_layer / fused);
            assert!((ratio - 1.0).abs() < 0.015, "{name} {dtype:?}: the model keeps {per_layer} bytes per layer, the planner says {want}");
            worst = worst.max((ratio - 1.0).abs());
        }
    }
    println!("worst |kept/planner - 1| = {worst:.4}");
    // LoRA of rank 8 on all seven projections with dropout 0.1: a layer keeps the base layer's
    // activations plus r-wide ones (u = x·Aᵀ per column part, gathered along the sequence under
    // SP; the row layers' reduced v), no [T, out] update, base output or mask; bounded here by
    // 2 · 7 · Tc · r elements per layer (Tc the CP shard's tokens)
    let (rank, targets) = (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]);
    let spec = candle_cp_llama::LoraSpec::new(rank, 16.0, &targets)?.with_dropout(0.1)?;
    let adapted = |layers| {
        let mut c = cfg(layers, 0);
        c.lora = Some(spec.clone());
        c
    };
    for (name, layout, cp) in [("one device", Layout::single(), 1), ("tp 2 + sp", Layout::single().with_tp(2, true), 1), ("tp 2, no sp", Layout::single().with_tp(2, false), 1), ("zigzag ring 2", Layout::cp(CpKind::Zigzag, 2), 2), ("tp 2 + sp, zigzag 2", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), 2)] {
        let dtype = DType::F32;
        let base = (retained(&cfg(3, 0), layout, dtype, false)? - retained(&cfg(1, 0), layout, dtype, false)?) / 2.0;
        let lora = (retained(&adapted(3), layout, dtype, false)? - retained(&adapted(1), layout, dtype, false)?) / 2.0;
        let bound = (2 * targets.len() * (T / cp) * rank * dtype.size_in_bytes()) as f64;
        println!("lora {name:27} {dtype:?}: kept {lora:>10.0} B/layer, the base layer {base:>10.0}: +{:.0} B (bound {bound:.0})", lora - base);
        assert!(lora - base <= bound, "LoRA on {name}: a layer keeps {} bytes more than the base layer's {base}, over the r-wide bound {bound}", lora - base);
    }
    Ok(())
}
