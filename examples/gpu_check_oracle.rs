//! `gpu_check --sections oracle,llama` (included by `gpu_check.rs` with `#[path]`): the PyTorch
//! float64 oracle on the GPU.
//!
//! `oracle`: every attention case (f32) through the raw kernels, the autograd op on the GPU, and
//! the CP methods on virtual ranks (thread ranks whose tensors all live on the one GPU), outputs
//! and gradients against the reference within the case's tolerances.
//!
//! `llama`: the tiny Hugging Face Llama's logits, loss and every parameter gradient on the GPU,
//! single device and on every layout family (CP, Ulysses, TP + SP, 2-D) on virtual ranks; the
//! same weights with Qwen2's q, k, v biases under TP 4 + SP, with Qwen3's head norms under TP 2
//! × ring 2, as Gemma 3 under TP 2 + SP × zigzag 2 (also with heads of 256: f32, so the
//! CUDA-core kernels; the pipelined ones at 256 run in the flash, band and random sections),
//! and as Phi-3 with heads of 96, LongRoPE and Phi-4-mini's partial RoPE on a ring of 4, against
//! the CPU.

use super::{case_to, kmask, oracle_cases, report_metrics, Report};
use crate::gpu_util;
use anyhow::Result;
use candle_cp_llama::Arch;
use candle_core::Device;
use candle_cp_kernels::flash::{self, FwdImpl};
use candle_cp_ops::cp::{run_case_cp, CpMethod};
use candle_cp_ops::oracle::{run_single, AttnOutputs};
use std::time::Duration;

/// Oracle cases (f32): the raw kernels, the autograd op on the GPU, and CP methods on virtual
/// ranks (thread ranks whose tensors all live on the one GPU).
pub fn check_oracle(rep: &mut Report, gpu: &Device, dir: &str) -> Result<()> {
    for case in oracle_cases(dir, rep.quick)? {
        let case = case?;
        let g = case_to(&case, gpu)?;
        let mask = kmask(&case.mask());
        let raw = (|| -> candle_core::Result<AttnOutputs> {
            let (out, lse) = flash::fwd(&g.q, &g.k, &g.v, mask, case.scale as f32, FwdImpl::Simple)?;
            let (dq, dk, dv) = flash::bwd_with(&g.q, &g.k, &g.v, &out, &lse, &g.dout, mask, case.scale as f32, FwdImpl::Simple)?;
            Ok(AttnOutputs { out, lse, dq, dk, dv })
        })();
        match raw {
            Ok(o) => report_metrics(rep, &format!("oracle {} kernels", case.name), &o, &case)?,
            Err(e) => rep.error(&format!("oracle {} kernels", case.name), e),
        }
        match run_single(&g) {
            Ok(o) => report_metrics(rep, &format!("oracle {} autograd op", case.name), &o, &case)?,
            Err(e) => rep.error(&format!("oracle {} autograd op", case.name), e),
        }
        let t = case.q.dim(1)?;
        for method in CpMethod::ALL {
            for p in [2, 4] {
                if rep.quick && p != 2 {
                    continue;
                }
                if t % method.layout().divisor(p) != 0 {
                    continue;
                }
                let name = format!("oracle {} {method} P{p} virtual ranks", case.name);
                match run_case_cp(&g, method, p, Duration::from_secs(120)) {
                    Ok(run) => report_metrics(rep, &name, &run.outputs, &case)?,
                    Err(e) => rep.error(&name, e),
                }
            }
        }
        let name = format!("oracle {} ulysses P2 virtual ranks", case.name);
        match gpu_util::run_ulysses(&g, 2) {
            Ok(o) => report_metrics(rep, &name, &o, &case)?,
            Err(e) => rep.error(&name, e),
        }
    }
    Ok(())
}

/// The tiny Hugging Face Llama oracle (logits, loss, every parameter gradient) on GPU virtual
/// ranks: single device, the CP methods, Ulysses, Megatron TP + SP (TP 4 replicating the 2 KV
/// heads too), and the 2-D layouts, with
/// the same tolerances as `tests/llama_parity.rs`.
pub fn check_llama(rep: &mut Report, gpu: &Device, dir: &str) -> Result<()> {
    use candle_cp_llama::layout::{CpKind, Layout};
    use candle_cp_llama::verify::{verify_prefix_on, verify_reference, verify_reference_recompute};
    let layouts = [
        ("single", Layout::single()),
        ("cp4 zigzag", Layout::cp(CpKind::Zigzag, 4)),
        ("cp2 ring", Layout::cp(CpKind::Ring, 2)),
        ("cp2 striped", Layout::cp(CpKind::Striped, 2)),
        ("cp2 all-gather", Layout::cp(CpKind::AllGather, 2)),
        ("ulysses2", Layout::cp(CpKind::Ulysses, 2)),
        ("tp2 + sp", Layout::single().with_tp(2, true)),
        ("tp2 x cp2 zigzag + sp", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true)),
        // 2 KV heads over TP 4: each KV head on 2 ranks, its gradient summed over them
        ("tp4 + sp, kv heads replicated", Layout::single().with_tp(4, true)),
        ("2-d 2x2", Layout::two_d(2, 2)),
        // the backward all-to-alls q, k, v and the output to heads again (--regather-heads;
        // the 2-D op covers Ulysses' path and the ring's rebuilt f32 output)
        ("2-d 2x2, heads regathered", Layout::two_d(2, 2).with_head_layout(candle_cp_llama::HeadLayout::Regathered)),
    ];
    // the same with every layer recomputed in backward (Llama::with_recompute)
    let recomputed = [("tp2 x cp2 zigzag + sp, recompute", Layout::cp(CpKind::Zigzag, 2).with_tp(2, true))];
    // (the tiny-Llama oracle is T = 2048: one layout takes minutes under the CPU emulation.
    // --quick runs these, on the first QUICK_TOKENS tokens against the CPU: the zigzag ring,
    // TP 4 with replicated KV heads, and Ulysses x ring on sub-groups of the thread world;
    // `nccl-ranks` runs TP x CP + SP)
    const QUICK: [&str; 3] = ["cp4 zigzag", "tp4 + sp, kv heads replicated", "2-d 2x2"];
    for (label, layout) in layouts {
        if rep.quick && !QUICK.contains(&label) {
            continue;
        }
        if rep.quick {
            let name = format!("llama {label}, first {QUICK_TOKENS} tokens vs cpu");
            let opts = candle_cp_comm::ThreadGroupOptions { device: gpu.clone(), ..Default::default() };
            let n = layout.world_size();
            let spawn = |body: &candle_cp_llama::verify::LayoutRankBody| Ok(candle_cp_comm::run_ranks_with(n, opts, body));
            let res = verify_prefix_on(dir, format!("{dir}/reference.safetensors"), QUICK_TOKENS, layout, gpu, spawn);
            report_llama(rep, &name, res);
            continue;
        }
        let name = format!("llama {label}");
        report_llama(rep, &name, verify_reference(dir, format!("{dir}/reference.safetensors"), layout, gpu));
    }
    if !rep.quick {
        for (label, layout) in recomputed {
            let name = format!("llama {label}");
            let res = verify_reference_recompute(dir, format!("{dir}/reference.safetensors"), layout, gpu, true);
            report_llama(rep, &name, res);
        }
    }
    let name = format!("llama qwen2 (q, k, v biases) tp4 + sp, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Qwen2, Layout::single().with_tp(4, true), None));
    // the head norms' gradients summed over TP in the backward (no SP), beside a ring
    let name = format!("llama qwen3 (q / k head norms) tp2, no sp x cp2 ring, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Qwen3, Layout::cp(CpKind::Ring, 2).with_tp(2, false), None));
    // Gemma 3: 1 + w norms, norms after attention and MLP, GELU, scaled tied embedding, a
    // window and the local RoPE on the first layer only
    let name = format!("llama gemma3 (window on layer 0) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Gemma3, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), None));
    // Gemma 3's head dim 256 (its 1B / 4B / 12B): the CUDA-core kernels (f32) in every ring
    // step, the sliding layer's band kernels included
    let name = format!("llama gemma3 head dim 256 (window on layer 0) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Gemma3, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Some((4, 2, 256))));
    // Phi-3-mini's head dim 96: the CUDA-core kernels (f32) in every ring step, on a contiguous
    // ring of 4 whose first rank holds positions below LongRoPE's original length (64) while the
    // sequence (256) is past it: every rank must rotate with the long factors; RoPE on 3/4 of
    // each head (Phi-4-mini's partial RoPE: 72 of the 96 dimensions)
    let name = format!("llama phi3 head dim 96 (longrope past its original length, partial rope 0.75) cp4 ring, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Phi3, Layout::cp(CpKind::Ring, 4), Some((4, 2, 96))));
    // Phi-3-medium's 4 query heads per KV head with KV heads TP neither divides nor is divided
    // by: 12 / 3 heads at TP 4 (each rank 3 KV-head copies of 12; the copies' gradients summed
    // over TP by one all-gather), beside zigzag CP 2
    let name = format!("llama 12 / 3 heads (kv-head copies mixed over tp) tp4 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Llama, Layout::cp(CpKind::Zigzag, 2).with_tp(4, true), Some((12, 3, 16))));
    // Gemma 2: its logit soft caps (attention 1, output 2: they bind on this model) in every ring
    // step's kernels and in the chunked head loss, Ulysses 4 (the head layout's attention calls)
    let name = format!("llama smollm3 (layer 1 without RoPE) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::SmolLM3, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), None));
    let name = format!("llama granite (embedding, attention, residual and logit multipliers) tp2 + sp x cp2 ring, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Granite, Layout::cp(CpKind::Ring, 2).with_tp(2, true), None));
    let name = format!("llama olmo3 (norms after the branches, q/k norms over the projections all-reduced over TP, layer 0 sliding 40, unscaled beside YaRN) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Olmo3, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), None));
    let name = format!("llama exaone4 (norms after the branches, head norms, layer 0 sliding 40, layer 1 global without RoPE) tp2 + sp x cp2 ring, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Exaone4, Layout::cp(CpKind::Ring, 2).with_tp(2, true), None));
    let name = format!("llama olmoe (q/k norms over the projections, 8 experts on every layer) tp2 + sp x cp2 zigzag x ep2, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Olmoe, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), None));
    let name = format!("llama granitemoe (multipliers, 8 experts on every layer, the scaled residual add after them) tp2 + sp x cp2 ring x ep2, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::GraniteMoe, Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2), None));
    let name = format!("llama glm4 (norms before and after each branch, q/k/v biases, rope on half of each head) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Glm4, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), None));
    let name = format!("llama glm4_moe (sigmoid router, correction bias, 4 expert groups, shared expert, head norms + biases, half rope) tp2 + sp x cp2 zigzag x ep2, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Glm4Moe, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), None));
    let name = format!("llama deepseek_v3 (latent attention at 192 per head, run at 256 on the GPU; GLM-4.5's experts) tp2 + sp x cp2 zigzag x ep2, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::DeepseekV3, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), None));
    let name = format!("llama gemma2 (soft caps, window on layer 0) ulysses 4 (KV heads replicated), first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Gemma2, Layout::cp(CpKind::Ulysses, 4), None));
    let name = format!("llama gemma2 (soft caps) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Gemma2, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), None));
    // Qwen3-MoE: routing, the experts' grouped matmuls (every expert's slice on each TP rank),
    // the combine and the load-balancing loss's derivative, on the GPU
    let name = format!("llama qwen3-moe (8 experts, top 2, load-balancing loss) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Qwen3Moe, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), None));
    let name = format!("llama qwen3-moe (8 experts, top 2, load-balancing loss) tp2, no sp x ulysses 2, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Qwen3Moe, Layout::cp(CpKind::Ulysses, 2).with_tp(2, false), None));
    let name = format!("llama qwen2-moe (8 experts, top 2, a shared expert, q, k, v biases) tp2, no sp x cp2 ring, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Qwen2Moe, Layout::cp(CpKind::Ring, 2).with_tp(2, false), None));
    let name = format!("llama mixtral (8 experts, top 2, window 40 on every layer) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Mixtral, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), None));
    // expert parallelism: the routed rows exchanged between the ranks holding their experts
    // (the all-to-all of uneven chunks, the reordering by expert, the zero row), on the GPU
    let name = format!("llama qwen3-moe expert parallel ep4 over cp4 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Qwen3Moe, Layout::cp(CpKind::Zigzag, 4).with_ep(4), None));
    let name = format!("llama mixtral expert parallel ep2 x tp2 + sp x cp2 ring, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::Mixtral, Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2), None));
    // gpt-oss: attention sinks applied once to each ring's merged rows (and to each Ulysses
    // rank's head slice), o_proj and expert biases (the down bias by TP columns), the clamped
    // SwiGLU, on the GPU
    let name = format!("llama gpt-oss (sinks, biases, 8 experts top 2, window 40 on layer 0) tp2 + sp x cp2 zigzag, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::GptOss, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), None));
    let name = format!("llama gpt-oss (sinks on each rank's heads) ulysses 4 x ep2, first {QUICK_TOKENS} tokens vs cpu");
    report_llama(rep, &name, arch_vs_cpu(gpu, dir, Arch::GptOss, Layout::cp(CpKind::Ulysses, 4).with_ep(2), None));
    // LoRA on gpt-oss's expert parameters (PEFT's target_parameters): the experts' updates and
    // biases inside one grouped node, gate and up sharing one A, over TP and EP, on the GPU
    let name = format!("llama gpt-oss LoRA on q_proj and the expert parameters ring 2 x tp2 + sp x ep2, first {QUICK_TOKENS} tokens vs cpu");
    let spec = candle_cp_llama::LoraSpec::new(2, 4.0, &["q_proj"]).and_then(|s| s.with_target_parameters(&["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]));
    report_llama(rep, &name, spec.and_then(|s| arch_vs_cpu_with(gpu, dir, Arch::GptOss, Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2), None, Some(s))));
    Ok(())
}

/// The oracle's weights with Qwen2's q, k, v biases (seeded, std ~0.4), Qwen3's q / k head
/// norms (weights 1 ± 0.4) or as Gemma 3 or 2 (every norm weight 0.4·sin, entering as `1 + w`;
/// the head tied; window 40 on layer 0; Gemma 2's soft caps 1 and 2) or as Phi-3 with LongRoPE
/// (original length 64) on `layout`'s GPU virtual ranks, against the
/// single-device CPU run of the same model (which `tests/llama_archs.rs` holds to a float64
/// reference), on the first [`QUICK_TOKENS`] tokens of the oracle's sequence. `heads`:
/// `(H, Hkv, D)` instead of the oracle's 8 / 2 of 16, their q, k, v, o projections drawn
/// (seeded, 5× the init's scale so that the attention is far from uniform).
fn arch_vs_cpu(gpu: &Device, dir: &str, arch: Arch, layout: candle_cp_llama::layout::Layout, heads: Option<(usize, usize, usize)>) -> candle_core::Result<candle_cp_llama::verify::Report> {
    arch_vs_cpu_with(gpu, dir, arch, layout, heads, None)
}

/// [`arch_vs_cpu`] with LoRA adapters `lora` (seeded factors, `B ≠ 0`): the adapters'
/// gradients compared.
fn arch_vs_cpu_with(
    gpu: &Device,
    dir: &str,
    arch: Arch,
    layout: candle_cp_llama::layout::Layout,
    heads: Option<(usize, usize, usize)>,
    lora: Option<candle_cp_llama::LoraSpec>,
) -> candle_core::Result<candle_cp_llama::verify::Report> {
    use candle_cp_llama::verify::{compare, load_reference, run_layout, run_layout_on, LayoutRankBody, Reference, Tolerances};
    use candle_cp_llama::{hf::load_safetensors_dir, init_params, params::varmap_tensors, LlamaConfig};
    let mut base = LlamaConfig::from_file(format!("{dir}/config.json"))?;
    if let Some(h) = heads {
        (base.num_attention_heads, base.num_key_value_heads, base.head_dim) = h;
    }
    let cfg = match arch {
        Arch::Gemma3 => base.with_gemma3(true).with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false])),
        Arch::Gemma2 => {
            let mut c = base.with_gemma2(true).with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false]));
            if let Some(g) = c.gemma2.as_mut() {
                (g.attn_logit_softcapping, g.final_logit_softcapping) = (Some(1.0), Some(2.0));
            }
            c
        }
        Arch::Qwen3Moe => {
            let mut moe = candle_cp_llama::MoeConfig::new(8, 2, 48);
            (moe.norm_topk_prob, moe.mlp_only_layers, moe.output_router_logits, moe.router_aux_loss_coef) = (true, vec![0], true, 0.5);
            base.with_moe(Some(moe))
        }
        Arch::Mixtral => base.with_moe(Some(candle_cp_llama::MoeConfig::mixtral(8, 2, 48))).with_sliding_window(Some(40)),
        Arch::GptOss => base.with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(8, 2, 48))).with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false])),
        Arch::Qwen2Moe => {
            let mut moe = candle_cp_llama::MoeConfig::qwen2_moe(8, 2, 48, 64);
            moe.mlp_only_layers = vec![0];
            base.with_moe(Some(moe))
        }
        Arch::Phi3 => {
            // LongRoPE: original length 64, the sequence 256 (the long factors act), factors
            // for the rotated dimensions' half (Phi-4-mini's partial RoPE: 3/4 of each head)
            let mut c = base.with_phi3(true).with_partial_rotary_factor(0.75);
            let half = c.rope_dim() / 2;
            c.max_position_embeddings = 1024;
            c.rope_scaling = candle_cp_llama::RopeScaling::LongRope {
                short_factor: (0..half).map(|i| 1.0 + 0.02 * i as f64).collect(),
                long_factor: (0..half).map(|i| 1.0 + 0.6 * i as f64).collect(),
                original_max_position_embeddings: 64,
                factor: 16.0,
                attention_factor: None,
            };
            c
        }
        // SmolLM3: layer 1 attends without RoPE
        Arch::SmolLM3 => base.with_nope_layers(Some(vec![false, true])),
        // Granite: its four multipliers (each residual branch scaled inside the row-parallel node)
        Arch::Granite => base.with_granite(Some(candle_cp_llama::Granite { embedding_multiplier: 3.0, attention_multiplier: 0.125, residual_multiplier: 0.5, logits_scaling: 4.0 })),
        // OLMoE: 8 experts 48 wide on both layers, top 2 (not renormalised), the loss on
        Arch::Olmoe => {
            let mut moe = candle_cp_llama::MoeConfig::new(8, 2, 48);
            (moe.output_router_logits, moe.router_aux_loss_coef) = (true, 0.5);
            base.with_moe(Some(moe)).with_olmo(Some(candle_cp_llama::Olmo::Olmoe))
        }
        // GLM-4: the norms before and after each branch, q, k, v biases, RoPE on half of each
        // head (8 of 16 dimensions; interleaved in its checkpoints, the half form here)
        Arch::Glm4 => base.with_glm4(true),
        // GLM: GLM-4's biases and RoPE with a Llama's norms (no row of its own above: its layer
        // runs GLM-4's kernels less two norms)
        Arch::Glm => base.with_glm(Some(candle_cp_llama::Glm::Glm)),
        // GLM-4.5: layer 1 sparse, 8 experts 48 wide in 4 groups of which 2 are kept, top 2,
        // scaled by 2.5, a shared expert 48 wide; q, k, v biases and head norms; half RoPE
        Arch::Glm4Moe => {
            let moe = candle_cp_llama::MoeConfig { mlp_only_layers: vec![0], groups: (4, 2), ..candle_cp_llama::MoeConfig::glm4_moe(8, 2, 48, 1, 2.5) };
            base.with_moe(Some(moe)).with_qkv_bias(true).with_qk_norm(true)
        }
        // DeepSeek-V3: latent attention at DeepSeek-V3's 128 + 64 = 192 dimensions per q / k head
        // (the GPU runs it at 256, padded: candle_cp_ops::attention::kernel_head_dim), values
        // 128, q rank 64, KV rank 32, interleaved RoPE; GLM-4.5's experts on layer 1
        Arch::DeepseekV3 => {
            let moe = candle_cp_llama::MoeConfig { mlp_only_layers: vec![0], groups: (4, 2), ..candle_cp_llama::MoeConfig::glm4_moe(8, 2, 48, 1, 2.5) };
            let mla = candle_cp_llama::config::deepseek::Mla { q_lora_rank: Some(64), kv_lora_rank: 32, qk_nope_head_dim: 128, qk_rope_head_dim: 64, v_head_dim: 128, rope_interleave: true };
            base.with_moe(Some(moe)).with_mla(Some(mla))
        }
        // GraniteMoE: Granite's multipliers over 8 experts 48 wide on both layers, top 2, the loss on
        Arch::GraniteMoe => {
            let mut moe = candle_cp_llama::MoeConfig::granite_moe(8, 2, 48);
            (moe.output_router_logits, moe.router_aux_loss_coef) = (true, 0.5);
            base.with_moe(Some(moe)).with_granite(Some(candle_cp_llama::Granite { embedding_multiplier: 3.0, attention_multiplier: 0.125, residual_multiplier: 0.5, logits_scaling: 4.0 }))
        }
        // EXAONE 4: layer 0 sliding, layer 1 global and NoPE
        Arch::Exaone4 => base.with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false])).with_exaone4(true),
        // OLMo 3: layer 0 sliding (unscaled RoPE) beside a full layer under YaRN
        Arch::Olmo3 => {
            let yarn = candle_cp_llama::RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: 64, beta_fast: 32.0, beta_slow: 1.0, attention_factor: None, mscale: None, mscale_all_dim: None, truncate: true };
            candle_cp_llama::LlamaConfig { rope_scaling: yarn, ..base.with_olmo(Some(candle_cp_llama::Olmo::Olmo3)) }.with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false]))
        }
        _ => base.with_qkv_bias(arch == Arch::Qwen2).with_qk_norm(arch == Arch::Qwen3),
    };
    let mut full = load_safetensors_dir(std::path::Path::new(dir), &Device::Cpu)?;
    if cfg.tie_word_embeddings {
        full.remove("lm_head.weight");
    }
    if cfg.post_norms_only() {
        // (OLMo 2 and 3 have no norm before the attention)
        full.retain(|k, _| !k.ends_with("input_layernorm.weight"));
    }
    // the architecture's parameters: the seeded biases (N(0, 0.02²)) times 20, head norm
    // weights 1 + 0.4·sin(i + name length) (init_params draws them as ones), Gemma's norm
    // weights 0.4·sin(..) (every norm)
    let sin = |k: &str, n: usize, one: f32| -> candle_core::Result<candle_core::Tensor> {
        let w: Vec<f32> = (0..n).map(|i| one + 0.4 * ((i + k.len()) as f32).sin()).collect();
        candle_core::Tensor::from_vec(w, n, &Device::Cpu)
    };
    for (k, t) in varmap_tensors(&init_params(&cfg, 7, candle_core::DType::F32, &Device::Cpu)?)? {
        if cfg.mla.is_some() && k.contains(".self_attn.") {
            // (DeepSeek-V3's attention: its own matrices, 5x the init's scale; latent norms ones)
            full.insert(k, if t.rank() == 2 { (t * 5.0)? } else { t });
        } else if k.ends_with(".bias") {
            full.insert(k, (t * 20.0)?);
        } else if k.ends_with(".sinks") {
            // (gpt-oss: sinks around 3, worth a share of a row's mass)
            full.insert(k, ((t * 50.0)? + 3.0)?);
        } else if k.ends_with(candle_cp_llama::params::CORRECTION_BIAS) {
            // (GLM-4.5's correction biases: 0.4·sin(..), choosing among near experts)
            full.insert(k.clone(), sin(&k, t.dim(0)?, 0.0)?);
        } else if matches!(arch, Arch::Qwen3Moe | Arch::Mixtral | Arch::Qwen2Moe | Arch::GptOss | Arch::Olmoe | Arch::GraniteMoe | Arch::Glm4Moe | Arch::DeepseekV3) && (k.contains(".experts.") || k.ends_with(".gate.weight") || k.ends_with(".router.weight")) {
            // (the router 5x the init's scale: probabilities far from uniform, no near ties)
            let router = k.ends_with(".gate.weight") || k.ends_with(".router.weight");
            full.insert(k.clone(), if router { (t * 5.0)? } else { t });
        } else if heads.is_some() && k.contains("self_attn") && k.ends_with("_proj.weight") {
            full.insert(k, (t * 5.0)?);
        } else if matches!(arch, Arch::Gemma3 | Arch::Gemma2) && t.rank() == 1 {
            full.insert(k.clone(), sin(&k, t.dim(0)?, 0.0)?);
        } else if (k.contains("self_attn") && k.ends_with("_norm.weight")) || (arch == Arch::Glm4 && k.ends_with("feedforward_layernorm.weight")) {
            // (and GLM-4's norms before and after the MLP)
            full.insert(k.clone(), sin(&k, t.dim(0)?, 1.0)?);
        } else {
            // (Qwen2-MoE's shared expert and its gate: the init's draw)
            full.entry(k).or_insert(t);
        }
    }
    let cfg = match lora {
        Some(spec) => {
            let cfg = cfg.with_lora(Some(spec));
            for (i, s) in candle_cp_llama::param_specs(&cfg).into_iter().filter(|s| s.is_lora()).enumerate() {
                full.insert(s.name.clone(), candle_cp_ops::oracle::randn(900 + i as u64, &s.shape, 0.1)?.to_dtype(candle_core::DType::F32)?);
            }
            cfg
        }
        None => cfg,
    };
    let ids = load_reference(format!("{dir}/reference.safetensors"))?.input_ids.narrow(1, 0, QUICK_TOKENS)?.contiguous()?;
    let cpu = run_layout(&full, &cfg, &ids, candle_cp_llama::layout::Layout::single(), &Device::Cpu)?;
    let reference = Reference { input_ids: ids.clone(), logits: cpu.logits.clone(), loss: cpu.loss, grads: cpu.grads.iter().cloned().collect() };
    let opts = candle_cp_comm::ThreadGroupOptions { device: gpu.clone(), ..Default::default() };
    let spawn = |body: &LayoutRankBody| Ok(candle_cp_comm::run_ranks_with(layout.world_size(), opts, body));
    compare(&run_layout_on(&full, &cfg, &ids, layout, gpu, spawn)?, &reference, Tolerances::default())
}

/// Tokens of the tiny-Llama oracle's sequence (2048) the `--quick` Llama checks run, against
/// the CPU on those tokens (the CPU emulation of CUDA takes minutes for the whole sequence).
pub const QUICK_TOKENS: usize = 256;

/// One PASS/FAIL line for a tiny-Llama oracle run (logits, loss, worst gradient, rank spread).
pub fn report_llama(rep: &mut Report, name: &str, res: candle_core::Result<candle_cp_llama::verify::Report>) {
    match res {
        Ok(r) => {
            println!(
                "{} {name}: logits {:.2e} loss {:.2e} grad rel {:.2e} ({}) ranks {:.1e}",
                if r.pass() { "PASS" } else { "FAIL" },
                r.logits_abs,
                r.loss_abs,
                r.grad_rel_max,
                r.worst_param,
                r.rank_spread
            );
            if r.pass() {
                rep.pass += 1
            } else {
                rep.fail.push(name.to_string())
            }
        }
        Err(e) => rep.error(name, e),
    }
}
