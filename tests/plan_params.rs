//! The planner's parameter count per GPU (`candle_cp_plan::memory::params_per_gpu`) equals
//! what the Llama model actually holds on each rank, exactly, for every TP degree: Q/O and
//! the MLP split over TP, K/V split by KV head, replicated when TP exceeds the KV heads, or
//! copied `lcm(Hkv, tp)/Hkv` times when neither divides the other,
//! the embedding and head split by vocabulary (padded when TP does not divide it), norms
//! replicated, a reward model's score head (and a token classifier's bias) replicated in place of the head, Qwen2's q, k, v biases split like their weights, Qwen3's head norms replicated, Qwen3-MoE's router replicated and every expert's slice on each TP rank (one layer of two dense). The planner's memory figures
//! (weights, gradients, optimizer states) are therefore about the model we run, not an ideal.

use candle_core::{DType, Device, Result};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::Layout;
use candle_cp_llama::train::AdamW;
use candle_cp_llama::{init_params, shard_params, Llama, LlamaConfig, ParallelCtx};
use candle_cp_plan::memory::params_per_gpu;
use candle_cp_plan::{Layout as PlanLayout, ModelConfig};
use candle_nn::VarBuilder;

/// Parameters (elements) each rank of TP `tp` holds after building the model, rank order.
fn held(cfg: &LlamaConfig, tp: usize, sp: bool) -> Result<Vec<usize>> {
    let layout = Layout::single().with_tp(tp, sp);
    run_ranks(tp, |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = shard_params(&init_params(cfg, 1, DType::F32, &Device::Cpu)?, cfg, &ctx)?;
        // the model accepts exactly these shards (it would refuse another shape)
        Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), cfg, &ctx)?;
        Ok(vm.all_vars().iter().map(|v| v.elem_count()).sum())
    })
    .into_iter()
    .collect()
}

#[test]
fn planner_params_per_gpu_equal_the_model_shards() -> Result<()> {
    let oracle = LlamaConfig::from_file(candle_cp_tests::oracle_dir("tiny-llama").join("config.json"))?;
    let mut tied = LlamaConfig::tiny(64, 32, 2, 8, 1);
    tied.tie_word_embeddings = true;
    // a vocabulary no TP degree here divides: padded to tp·⌈37/tp⌉ rows (6 per rank at TP 8)
    let odd = LlamaConfig::tiny(37, 32, 2, 8, 2);
    // Qwen2: q, k, v biases, split like their weights (the 2 KV heads' replicated at TP 4, 8)
    let qwen2 = oracle.clone().with_qkv_bias(true);
    // Qwen3: q / k head-norm weights `[D]`, replicated on every TP rank
    let qwen3 = oracle.clone().with_qk_norm(true);
    // Qwen3-MoE: 8 experts 48 wide on layer 1 (layer 0 dense)
    let mut experts = candle_cp_llama::MoeConfig::new(8, 2, 48);
    experts.mlp_only_layers = vec![0];
    let qwen3_moe = oracle.clone().with_moe(Some(experts));
    // Mixtral: 8 experts 48 wide on both layers, no head norms
    let mixtral = oracle.clone().with_moe(Some(candle_cp_llama::MoeConfig::mixtral(8, 2, 48)));
    // Qwen2-MoE: a shared expert 64 wide and its gate beside 8 experts, q, k, v biases
    let qwen2_moe = oracle.clone().with_moe(Some(candle_cp_llama::MoeConfig::qwen2_moe(8, 2, 48, 64)));
    // gpt-oss: sinks (split by head), an o_proj bias (replicated), a router bias, the experts'
    // biases (gate / up split as their rows, down by columns of h)
    let gpt_oss = oracle.clone().with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(8, 2, 48)));
    // 12 heads / 3 KV heads with q, k, v biases: at TP 2 and 4 each rank holds 3 KV-head
    // copies (of 6, of 12; Phi-3-medium's 10 KV heads at TP 4 hold 5), their biases too
    let mixed = LlamaConfig::tiny(64, 48, 2, 12, 3).with_qkv_bias(true);
    // OLMo 2: q / k norms over the whole projections (split as their rows), the norms after
    // the branches and none before
    let olmo2 = oracle.clone().with_olmo(Some(candle_cp_llama::Olmo::Olmo2));
    // OLMoE: those q / k norms with a Llama's norms and 8 experts 48 wide on both layers
    // EXAONE 4: OLMo 2's norms with head norms `[D]` (replicated), a window on layer 0
    let exaone4 = oracle.clone().with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false])).with_exaone4(true);
    let olmoe = oracle.clone().with_moe(Some(candle_cp_llama::MoeConfig::new(8, 2, 48))).with_olmo(Some(candle_cp_llama::Olmo::Olmoe));
    // GLM-4: q, k, v biases and four norms per layer
    let glm4 = oracle.clone().with_glm4(true);
    // GraniteMoE: Mixtral's experts under Granite's multipliers (no parameters of their own)
    let granite_moe = oracle.clone().with_moe(Some(candle_cp_llama::MoeConfig::granite_moe(8, 2, 48))).with_granite(Some(candle_cp_llama::Granite { embedding_multiplier: 12.0, ..Default::default() }));
    // DeepSeek-V3: the latent attention's down-projections and their norms replicated, its
    // up-projections and o_proj split by heads; GLM-4.5's experts on layer 1
    let mla = candle_cp_llama::config::deepseek::Mla { q_lora_rank: Some(32), kv_lora_rank: 24, qk_nope_head_dim: 12, qk_rope_head_dim: 8, v_head_dim: 10, rope_interleave: true };
    let deepseek = candle_cp_tests::mla_ref::deepseek_model(mla)?.0;
    let lite = deepseek.clone().with_mla(Some(candle_cp_llama::config::deepseek::Mla { q_lora_rank: None, v_head_dim: 24, ..mla }));
    // DeepSeek-V2: its softmax router without a correction bias, the shared expert ungated
    let v2 = candle_cp_tests::mla_ref::deepseek_v2_model(mla)?.0;
    // a reward model (a sequence classifier of one label: score.weight [1, h] replicated, no
    // LM head) and a process reward model (a token classifier of 3 labels, with score.bias)
    let reward = oracle.clone().with_num_labels(Some(1));
    let prm = oracle.clone().with_num_labels(Some(3)).with_token_classifier(Some(candle_cp_llama::prm::TokenClassifier::new(0.1)?));
    // (config, TP degrees): 8 heads / 2 KV heads (V = 512), MQA with a tied head (V = 64),
    // V = 37, and the first with biases (Qwen2) and with head norms (Qwen3)
    for (cfg, tps) in [(&mixed, [1usize, 2, 4, 6]), (&oracle, [1usize, 2, 4, 8]), (&tied, [1, 2, 4, 8]), (&odd, [1, 2, 4, 8]), (&qwen2, [1, 2, 4, 8]), (&qwen3, [1, 2, 4, 8]), (&qwen3_moe, [1, 2, 4, 8]), (&mixtral, [1, 2, 4, 8]), (&qwen2_moe, [1, 2, 4, 8]), (&gpt_oss, [1, 2, 4, 8]), (&olmo2, [1, 2, 4, 8]), (&olmoe, [1, 2, 4, 8]), (&exaone4, [1, 2, 4, 8]), (&granite_moe, [1, 2, 4, 8]), (&glm4, [1, 2, 4, 8]), (&deepseek, [1, 2, 4, 8]), (&lite, [1, 2, 8, 8]), (&v2, [1, 2, 4, 8]), (&reward, [1, 2, 4, 8]), (&prm, [1, 2, 4, 8])] {
        let m = ModelConfig::from_hf_json(&cfg.to_hf_json("float32"), "test")
            .map_err(|e| candle_core::Error::Msg(format!("planner config: {e:?}")))?;
        for tp in tps {
            let want = params_per_gpu(&m, &PlanLayout { tp, sp: true, ..PlanLayout::default() });
            for sp in [false, true] {
                let got = held(cfg, tp, sp)?;
                for (r, n) in got.iter().enumerate() {
                    assert_eq!(*n as f64, want, "tp {tp} sp {sp} rank {r}: the model holds {n} parameters, the planner says {want}");
                }
                println!("heads {}/{} V {} tp {tp} sp {sp}: {} parameters per rank = planner", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, got[0]);
            }
        }
    }
    Ok(())
}

/// Under expert parallelism each rank holds `E/ep` experts (each its TP slice): the planner's
/// parameters per GPU equal the model's shards on every rank (Qwen3-MoE and Mixtral, EP 2 and
/// 4 over CP / DP ranks, with TP 2 too), and its model states shrink by the experts' share;
/// under ZeRO-1 its Adam state per GPU is the trainer's (the experts' split over the ranks
/// holding them).
#[test]
fn planner_params_per_gpu_equal_the_model_shards_under_expert_parallelism() -> Result<()> {
    let oracle = LlamaConfig::from_file(candle_cp_tests::oracle_dir("tiny-llama").join("config.json"))?;
    let mut experts = candle_cp_llama::MoeConfig::new(8, 2, 48);
    experts.mlp_only_layers = vec![0];
    let qwen3_moe = oracle.clone().with_moe(Some(experts));
    let mixtral = oracle.clone().with_moe(Some(candle_cp_llama::MoeConfig::mixtral(8, 2, 48)));
    let gpt_oss = oracle.clone().with_moe(Some(candle_cp_llama::MoeConfig::gpt_oss(8, 2, 48)));
    let layouts = [
        Layout::cp(candle_cp_llama::CpKind::Zigzag, 2).with_ep(2),
        Layout::cp(candle_cp_llama::CpKind::Zigzag, 2).with_dp(2).with_ep(4),
        Layout::cp(candle_cp_llama::CpKind::Zigzag, 2).with_dp(2).with_ep(2),
        Layout::cp(candle_cp_llama::CpKind::Zigzag, 2).with_tp(2, true).with_ep(2),
    ];
    for cfg in [&qwen3_moe, &mixtral, &gpt_oss] {
        let m = ModelConfig::from_hf_json(&cfg.to_hf_json("float32"), "test")
            .map_err(|e| candle_core::Error::Msg(format!("planner config: {e:?}")))?;
        for layout in layouts {
            let plan = PlanLayout { tp: layout.tp, sp: layout.sp, cp: layout.cp, dp: layout.dp, ep: layout.ep, zero: 0, ..PlanLayout::default() };
            let want = params_per_gpu(&m, &plan);
            let whole = params_per_gpu(&m, &PlanLayout { ep: 1, ..plan.clone() });
            assert!(want < whole, "{layout}: EP holds fewer parameters");
            let got = run_ranks(layout.world_size(), |g| {
                let ctx = ParallelCtx::new(g, layout)?;
                let vm = shard_params(&init_params(cfg, 1, DType::F32, &Device::Cpu)?, cfg, &ctx)?;
                Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), cfg, &ctx)?;
                Ok(vm.all_vars().iter().map(|v| v.elem_count()).sum::<usize>())
            });
            for (r, n) in got.into_iter().enumerate() {
                let n = n?;
                assert_eq!(n as f64, want, "{layout} rank {r}: the model holds {n} parameters, the planner says {want}");
            }
            println!("{layout}: {want} parameters per rank = planner ({whole} without EP)");
            // ZeRO-1: the trainer's Adam state (dense over dp·cp, experts over the dp·cp/ep
            // ranks holding them, bf16 weights: 12 bytes per parameter) summed over the ranks
            // is the planner's per-GPU figure times the GPUs (the ranks' ⌈n/R⌉ slices differ
            // by an element, their sum does not)
            let zero = PlanLayout { zero: 1, ..plan.clone() };
            let want = candle_cp_plan::memory::model_states(&m, &zero, 2).optimizer * layout.world_size() as f64;
            let dense = candle_cp_plan::memory::model_states(&m, &PlanLayout { ep: 1, ..zero.clone() }, 2).optimizer * layout.world_size() as f64;
            let got = run_ranks(layout.world_size(), |g| {
                let ctx = ParallelCtx::new(g, layout)?;
                let vm = shard_params(&init_params(cfg, 1, DType::BF16, &Device::Cpu)?, cfg, &ctx)?;
                let named = vm.data().lock().map_err(|e| candle_core::Error::Msg(e.to_string()))?.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                let experts = candle_cp_llama::param_specs(cfg).into_iter().filter(|s| s.is_expert()).map(|s| s.name);
                let opt = AdamW::new_zero1(named, Default::default(), ctx.dp_cp.clone())?;
                let ep = ctx.ep.clone().ok_or_else(|| candle_core::Error::Msg("an EP group".into()))?;
                Ok(opt.with_expert_parallel(ep, ctx.ep_dp.clone(), experts)?.state_bytes())
            });
            let total: usize = got.into_iter().sum::<Result<usize>>()?;
            assert!((total as f64 - want).abs() < 1e-9 * want, "{layout}: the ranks hold {total} bytes of Adam state, the planner says {want} in all");
            // (the same total as ZeRO over every replica without EP: each element's state once)
            assert!((want - dense).abs() < 1e-9 * want, "{layout}: {want} bytes of Adam state in all, {dense} without EP");
            println!("{layout} ZeRO-1: {total} bytes of Adam state over the ranks = planner");
        }
    }
    Ok(())
}

/// LoRA (rank 4, on q, k, v, o and on every projection; with the embedding and the head trained
/// whole, modules_to_save): the planner's Adam state per GPU
/// (the adapters' alone, f32: 8 bytes per parameter, split over the replicas by ZeRO-1) times
/// the GPUs equals what the trainer's optimizer over each rank's adapters holds, on TP 1, 2 and
/// 4 (K/V adapters replicated with the heads at TP 4) and over DP 2 × CP 2 with ZeRO-1.
#[test]
fn planner_lora_state_equals_the_trainers() -> Result<()> {
    let oracle = LlamaConfig::from_file(candle_cp_tests::oracle_dir("tiny-llama").join("config.json"))?;
    let all = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    // (the last: the embedding and the head trained whole too, modules_to_save)
    for (targets, mlp, saved) in [(&all[..4], false, false), (&all[..], true, false), (&all[..4], false, true)] {
        let spec = candle_cp_llama::LoraSpec::new(4, 8.0, targets)?;
        let spec = if saved { spec.with_modules_to_save(&["embed_tokens", "lm_head"])? } else { spec };
        let cfg = oracle.clone().with_lora(Some(spec));
        let m = ModelConfig::from_hf_json(&oracle.to_hf_json("float32"), "test").map_err(|e| candle_core::Error::Msg(format!("planner config: {e:?}")))?;
        let layouts = [Layout::single(), Layout::single().with_tp(2, true), Layout::single().with_tp(4, false), Layout::cp(candle_cp_llama::CpKind::Zigzag, 2).with_dp(2).with_tp(2, true)];
        for layout in layouts {
            let zero = (layout.dp * layout.cp > 1) as u8;
            let plan = PlanLayout { tp: layout.tp, sp: layout.sp, cp: layout.cp, dp: layout.dp, zero, lora_rank: 4, lora_mlp: mlp, lora_save_embed: saved, lora_save_head: saved, ..PlanLayout::default() };
            let want = candle_cp_plan::memory::model_states(&m, &plan, 4).optimizer * layout.world_size() as f64;
            let got = run_ranks(layout.world_size(), |g| {
                let ctx = ParallelCtx::new(g, layout)?;
                let vm = shard_params(&init_params(&cfg, 1, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
                Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
                let mut named = candle_cp_tests::lora_ref::adapter_vars(&vm)?;
                if saved {
                    let vars = vm.data().lock().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                    named.extend(["model.embed_tokens.weight", "lm_head.weight"].map(|n| (n.to_string(), vars[n].clone())));
                }
                let opt = if zero > 0 { AdamW::new_zero1(named, Default::default(), ctx.dp_cp.clone())? } else { AdamW::new(named, Default::default())? };
                Ok(opt.state_bytes())
            });
            let total: usize = got.into_iter().sum::<Result<usize>>()?;
            assert!((total as f64 - want).abs() < 1e-9 * want, "{layout} mlp {mlp} saved {saved}: the ranks hold {total} bytes of adapter state, the planner says {want}");
            println!("{layout} LoRA (mlp {mlp}, embedding and head trained {saved}): {total} bytes of Adam state over the ranks = planner");
        }
    }
    Ok(())
}

/// LoRA on every projection of a Qwen2-MoE (the experts' stacked adapters and the shared
/// expert's too), plain and DoRA (a magnitude per output row, the experts' split over EP): the
/// planner's adapter parameters and Adam state per GPU equal the trainer's
/// on one device, TP 2 + SP, EP 2 over zigzag 2 and EP 2 over ring 2 × DP 2 with ZeRO-1 (the
/// experts' adapters' state split over the ranks holding their experts, the rest over the
/// replicas), every rank. The same for a Phi-3's adapters (one `A` per fused module) on one
/// device, TP 2 + SP, TP 4 (KV heads replicated) and ring 2 × DP 2 with ZeRO-1; and for
/// gpt-oss's (its experts adapted as parameters, one `A` for gate and up) on one device, TP 2 +
/// SP and ring 2 × TP 2 + SP × EP 2.
#[test]
fn planner_moe_lora_state_equals_the_trainers() -> Result<()> {
    use candle_cp_llama::layout::CpKind;
    let base = candle_cp_tests::moe_model::moe_model(candle_cp_llama::MoeStyle::Qwen2Moe, None)?.0;
    let layouts = [Layout::single(), Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_ep(2), Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(2)];
    lora_state_equals_the_trainers("qwen2-moe", &base, &layouts, &[false, true])?;
    // gpt-oss: its experts adapted as parameters (PEFT's target_parameters), one A for gate and
    // up; over TP + SP and EP too
    let gpt_oss = candle_cp_tests::moe_model::moe_model(candle_cp_llama::MoeStyle::GptOss, None)?.0;
    let layouts = [Layout::single(), Layout::single().with_tp(2, true), Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2)];
    lora_state_equals_the_trainers("gpt-oss", &gpt_oss, &layouts, &[false])?;
    // a Phi-3: one A per fused module (qkv_proj, gate_up_proj), its KV heads replicated at TP 4
    let phi3 = LlamaConfig::from_file(candle_cp_tests::oracle_dir("tiny-llama").join("config.json"))?.with_phi3(true);
    let layouts = [Layout::single(), Layout::single().with_tp(2, true), Layout::single().with_tp(4, false), Layout::cp(CpKind::Ring, 2).with_dp(2)];
    lora_state_equals_the_trainers("phi3", &phi3, &layouts, &[false, true])?;
    // DeepSeek-V3: the latent projections' adapters (the down-projections' replicated), o_proj's,
    // the experts', the shared experts' and the router's
    let mla = candle_cp_llama::config::deepseek::Mla { q_lora_rank: Some(32), kv_lora_rank: 24, qk_nope_head_dim: 12, qk_rope_head_dim: 8, v_head_dim: 10, rope_interleave: true };
    let deepseek = candle_cp_tests::mla_ref::deepseek_model(mla)?.0;
    let layouts = [Layout::single(), Layout::single().with_tp(2, true), Layout::single().with_tp(4, false), Layout::cp(CpKind::Zigzag, 2).with_ep(2)];
    lora_state_equals_the_trainers("deepseek-v3", &deepseek, &layouts, &[false, true])
}

/// [`planner_moe_lora_state_equals_the_trainers`] for one model on `layouts`.
/// (gpt-oss: every projection and both expert parameters, PEFT's `target_parameters`.)
fn lora_state_equals_the_trainers(label: &str, base: &LlamaConfig, layouts: &[Layout], doras: &[bool]) -> Result<()> {
    let m = ModelConfig::from_hf_json(&base.to_hf_json("float32"), "test").map_err(|e| candle_core::Error::Msg(format!("planner config: {e:?}")))?;
    let params: &[&str] = if base.gpt_oss { &["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] } else { &[] };
    for (layout, dora) in layouts.iter().flat_map(|&l| doras.iter().map(move |&d| (l, d))) {
        // (PEFT's all-linear: the routers too, DoRA's magnitudes with them)
        let targets: &[&str] = &candle_cp_llama::lora::ALL_LINEAR;
        let cfg = base.clone().with_lora(Some(candle_cp_llama::LoraSpec::new(4, 8.0, targets)?.with_target_parameters(params)?.with_dora(dora)));
        cfg.validate()?;
        let zero = (layout.dp * layout.cp > 1) as u8;
        let plan = PlanLayout { tp: layout.tp, sp: layout.sp, cp: layout.cp, dp: layout.dp, ep: layout.ep, zero, lora_rank: 4, lora_mlp: true, lora_dora: dora, ..PlanLayout::default() };
        let per_gpu = candle_cp_plan::memory::layers_per_stage(&m, &plan) as f64 * candle_cp_plan::memory::layer_lora_params_per_gpu(&m, &plan);
        let want = candle_cp_plan::memory::model_states(&m, &plan, 4).optimizer;
        let got = run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_params(&init_params(&cfg, 1, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
            Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
            let named = candle_cp_tests::lora_ref::adapter_vars(&vm)?;
            let params: usize = named.iter().map(|(_, v)| v.elem_count()).sum();
            let experts: Vec<String> = candle_cp_llama::params::trainable_specs(&cfg).into_iter().filter(|s| s.is_expert() && ctx.ep.is_some()).map(|s| s.name).collect();
            let mut opt = if zero > 0 { AdamW::new_zero1(named, Default::default(), ctx.dp_cp.clone())? } else { AdamW::new(named, Default::default())? };
            if let Some(ep) = &ctx.ep {
                opt = opt.with_expert_parallel(ep.clone(), ctx.ep_dp.clone(), experts)?;
            }
            Ok((params, opt.state_bytes()))
        });
        for (r, x) in got.into_iter().enumerate() {
            let (params, bytes) = x?;
            assert!((params as f64 - per_gpu).abs() < 1e-9 * per_gpu, "{layout} rank {r}: {params} adapter parameters, the planner says {per_gpu}");
            // (ZeRO's split of an odd element count — Qwen2-MoE's shared_expert_gate's DoRA
            // magnitude is [1] — leaves one replica a parameter's m and v more: 8 bytes)
            let slack = if zero > 0 { 8.0 } else { 1e-9 * want };
            assert!((bytes as f64 - want).abs() <= slack, "{layout} rank {r}: {bytes} bytes of adapter state, the planner says {want}");
        }
        println!("{label} {layout} LoRA (DoRA {dora}): {per_gpu} adapter parameters, {want} bytes of Adam state per GPU = planner");
    }
    Ok(())
}

/// A quantized base (NF4 and int8, groups of 8, NF4 with double-quantized scales in blocks of
/// 4 rows, LoRA on every projection; the tiny Llama and a Qwen2-MoE of it): the planner's
/// weights per GPU (the projections' codes and scales, the other frozen weights and the
/// adapters at `e` bytes) equal what each rank's `QuantBase` holds plus its adapters, on TP
/// 1, 2 and 4, every rank.
#[test]
fn planner_quantized_base_equals_the_trainers() -> Result<()> {
    let oracle = LlamaConfig::from_file(candle_cp_tests::oracle_dir("tiny-llama").join("config.json"))?;
    let moe = candle_cp_tests::moe_model::moe_model(candle_cp_llama::MoeStyle::Qwen2Moe, None)?.0;
    // (model, layouts): the dense Llama on TP 1, 2, 4; the Qwen2-MoE (experts and shared expert
    // quantized too) on TP 1, TP 2 + SP, and EP 2 over zigzag 2
    let dense_layouts = vec![Layout::single(), Layout::single().with_tp(2, true), Layout::single().with_tp(4, false)];
    let moe_layouts = vec![Layout::single(), Layout::single().with_tp(2, true), Layout::cp(candle_cp_llama::layout::CpKind::Zigzag, 2).with_ep(2)];
    // DeepSeek-V3: the latent projections quantized (the replicated ones whole on every rank)
    let mla = candle_cp_llama::config::deepseek::Mla { q_lora_rank: Some(32), kv_lora_rank: 24, qk_nope_head_dim: 12, qk_rope_head_dim: 8, v_head_dim: 10, rope_interleave: true };
    let deepseek = candle_cp_tests::mla_ref::deepseek_model(mla)?.0;
    let ds_layouts = vec![Layout::single(), Layout::single().with_tp(2, true), Layout::cp(candle_cp_llama::layout::CpKind::Zigzag, 2).with_ep(2)];
    for (base, layouts) in [(oracle, dense_layouts), (moe, moe_layouts), (deepseek, ds_layouts)] {
    let cfg = base.clone().with_lora(Some(candle_cp_llama::LoraSpec::new(4, 8.0, &candle_cp_llama::lora::ALL_LINEAR)?));
    let m = ModelConfig::from_hf_json(&base.to_hf_json("float32"), "test").map_err(|e| candle_core::Error::Msg(format!("planner config: {e:?}")))?;
    for (kind, bits, double) in [(candle_cp_nn::QuantKind::Nf4, 4, None), (candle_cp_nn::QuantKind::Int8, 8, None), (candle_cp_nn::QuantKind::Nf4, 4, Some(4))] {
        let q = candle_cp_nn::QuantConfig::new(kind, 8)?;
        let q = match double {
            Some(b) => q.with_double_quant(b)?,
            None => q,
        };
        for &layout in &layouts {
            let base_quant = Some(candle_cp_plan::layout::BaseQuant { bits, group: 8, double });
            let plan = PlanLayout { tp: layout.tp, sp: layout.sp, cp: layout.cp, ep: layout.ep, lora_rank: 4, lora_mlp: true, base_quant, ..PlanLayout::default() };
            let want = candle_cp_plan::memory::model_states(&m, &plan, 4).weights;
            let got = run_ranks(layout.world_size(), |g| {
                let ctx = ParallelCtx::new(g, layout)?;
                let vm = shard_params(&init_params(&cfg, 1, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
                let qb = candle_cp_llama::quant::QuantBase::from_varmap(&vm, &cfg, q)?;
                let (codes, plain) = qb.frozen_bytes();
                // what is left in the VarMap: the adapters (and the unquantized frozen weights)
                let adapters: usize = vm.all_vars().iter().map(|v| v.elem_count()).sum::<usize>() * 4 - plain;
                Ok(codes + plain + adapters)
            });
            for (r, b) in got.into_iter().enumerate() {
                let b = b? as f64;
                assert!((b - want).abs() < 1e-9 * want, "{kind} {layout} rank {r}: {b} bytes of weights, the planner says {want}");
            }
            println!("{} {q} {layout}: {want} bytes of weights per GPU = planner", base.arch().hf_names().1);
        }
    }
    }
    Ok(())
}
