//! Qwen3-MoE (`model_type` `qwen3_moe`) and Mixtral (`mixtral`): mixture-of-experts MLPs on
//! every kind of layout.
//!
//! - The tiny-llama weights as a Qwen3-MoE model (seeded q / k norms; layer 0 dense through
//!   `mlp_only_layers`, layer 1 a mixture of 8 experts, 2 per token, renormalised, each 48
//!   wide; the load-balancing loss on with a coefficient that moves the router's gradient):
//!   one device, ring, zigzag, all-gather, Ulysses, 2-D, TP with and without SP (expert
//!   tensor parallelism: each rank holds every expert's slice), TP × CP, DP, and with the
//!   layers recomputed in the backward give the float64 reference's logits, loss and every
//!   gradient (router and stacked experts included) within the oracle's float32 tolerances.
//!   The reference's smallest top-K margin is asserted far above float32 rounding, so every
//!   layout routes as the reference does.
//! - The load-balancing loss binds (without it the router's gradient moves by > 5%).
//! - Generation: cached decoding equals the full forward; CP and TP decode the same tokens.
//! - Checkpoints: the experts are written per expert (`mlp.experts.{e}.{gate,up,down}_proj
//!   .weight`, as published Qwen3-MoE checkpoints hold them) and read back stacked, whole and
//!   sharded over TP 1, 2, 4, bit for bit; the sharded writer writes the same bytes; read as
//!   a dense Qwen3 the experts are refused by name. transformers 5's fused experts
//!   (`mlp.experts.gate_up_proj` `[E, 2·Ie, h]`, `mlp.experts.down_proj` `[E, h, Ie]`) read the
//!   same.
//! - Mixtral (no head norms, every layer sparse, a window of 40 on every layer, the top 2 of 8
//!   renormalised, the load-balancing loss on): six layouts, DP and recomputed layers give the
//!   reference's results; its checkpoint names (`block_sparse_moe.experts.{e}.{w1,w3,w2}`) round
//!   trip whole and sharded; transformers 5's Mixtral layout (`mlp.gate.weight`,
//!   `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) reads the same, whole, over TP 2 and
//!   over EP 2, and is written back in the published layout, byte for byte.
//! - Qwen2-MoE (q, k, v biases, a shared expert 64 wide behind its sigmoid gate): six layouts,
//!   DP and recomputed layers give the reference's results; the shared expert binds; its
//!   checkpoint round-trips whole and over TP 2.
//! - Expert parallelism (the experts split over EP ranks of the DP × CP group, routed rows
//!   exchanged by all-to-all): fourteen layouts of the three styles (EP over all or part of
//!   the CP group, every CP kind, with TP + SP, across DP replicas, recomputed) give the
//!   reference's results; EP decodes the single device's tokens; checkpoints load and write
//!   the same bytes from EP ranks; a degree that does not divide the experts, and EP on a
//!   dense model, are refused by name.
//! - Refused by name: an expert width TP does not divide, a checkpoint missing an expert's
//!   tensor or holding one of another shape.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{compare, load_reference, run_layout, run_layout_recompute, LayoutRun, Reference, Tolerances};
use candle_cp_llama::{load_hf, load_hf_sharded, save_hf, save_hf_sharded, shard_tensors, LlamaConfig, MoeStyle, ParallelCtx};
use candle_cp_tests::dense_llama::{max_abs, reference, reference_routed, reference_rows, sharded_load_matches};
use candle_cp_tests::moe_model::moe_model;
use std::collections::HashMap;

const T: usize = 256;

fn ids(t: usize) -> Result<Tensor> {
    let dir = candle_cp_tests::oracle_dir("tiny-llama");
    load_reference(dir.join("reference.safetensors"))?.input_ids.narrow(1, 0, t)?.contiguous()
}

/// The oracle's weights as a Qwen3-MoE model (see the module doc), `coef` the load-balancing
/// loss's weight (`None`: off).
fn qwen3_moe(coef: Option<f64>) -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    moe_model(MoeStyle::Qwen3Moe, coef)
}

/// [`qwen3_moe`]'s weights as a Mixtral: no head norms, both layers sparse, a window of 40.
fn mixtral(coef: Option<f64>) -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    moe_model(MoeStyle::Mixtral, coef)
}

/// Every kind of layout (and recomputed layers, and DP, and expert parallelism over all or
/// part of the CP group, under every CP kind, with TP + SP, across DP replicas) gives the
/// reference's logits, loss and gradients (the experts' gathered back from their EP ranks);
/// the routing is far from a tie; the load-balancing loss binds.
#[test]
fn qwen3_moe_on_every_layout_matches_the_reference() -> Result<()> {
    let layouts = [
        Layout::single(),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::AllGather, 2),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(2, true),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
    ];
    // expert parallelism: (layout, recomputed layers, two DP rows)
    let ep = [
        (Layout::cp(CpKind::Zigzag, 4).with_ep(4), false, false),
        (Layout::cp(CpKind::Ring, 4).with_ep(2), false, false),
        (Layout::cp(CpKind::Ulysses, 2).with_ep(2), false, false),
        (Layout::two_d(2, 2).with_ep(4), false, false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), false, false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), true, false),
        (Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(4), false, true),
        (Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(2), false, true),
    ];
    on_layouts(MoeStyle::Qwen3Moe, &layouts, &ep)
}

/// The six layouts of the Mixtral and Qwen2-MoE tests, then their three expert-parallel ones
/// (layout, recomputed layers, two DP rows).
#[allow(clippy::type_complexity)]
fn six_layouts() -> ([Layout; 6], [(Layout, bool, bool); 3]) {
    let layouts = [
        Layout::single(),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
    ];
    let ep = [
        (Layout::cp(CpKind::Zigzag, 4).with_ep(4), false, false),
        (Layout::cp(CpKind::AllGather, 2).with_tp(2, false).with_ep(2), false, false),
        (Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_ep(2), true, true),
    ];
    (layouts, ep)
}

/// Mixtral (no head norms, every layer sparse, a window on every layer) on six layouts, DP,
/// recomputed layers and three expert-parallel layouts: the reference.
#[test]
fn mixtral_on_every_layout_matches_the_reference() -> Result<()> {
    let (layouts, ep) = six_layouts();
    on_layouts(MoeStyle::Mixtral, &layouts, &ep)
}

/// Qwen2-MoE (q, k, v biases; a shared expert weighted by its sigmoid gate beside the routed
/// ones) on six layouts, DP, recomputed layers and three expert-parallel layouts: the reference; the shared expert binds; its
/// checkpoint round-trips (whole and over TP 2).
#[test]
fn qwen2_moe_on_every_layout_matches_the_reference() -> Result<()> {
    let (layouts, ep) = six_layouts();
    on_layouts(MoeStyle::Qwen2Moe, &layouts, &ep)?;
    // the shared expert matters: without it the logits move
    let (cfg, full) = moe_model(MoeStyle::Qwen2Moe, None)?;
    let ids = ids(T)?;
    let mut zeroed = full.clone();
    let down = "model.layers.1.mlp.shared_expert.down_proj.weight";
    zeroed.insert(down.into(), full[down].zeros_like()?);
    let moved = max_abs(&reference(&zeroed, &cfg, &ids)?.logits, &reference(&full, &cfg, &ids)?.logits)?;
    assert!(moved > 1e-3, "the shared expert moves the logits by only {moved:.1e}");
    // its checkpoint: the shared expert under its transformers names, whole and over TP 2
    let dir = std::env::temp_dir().join(format!("candle-cp-qwen2-moe-{}", std::process::id()));
    let names = save_and_reload(&dir, &full, &cfg)?;
    for k in ["model.layers.1.mlp.shared_expert_gate.weight", "model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.1.mlp.experts.7.gate_proj.weight", "model.layers.1.self_attn.k_proj.bias"] {
        assert!(names.contains_key(k), "{k}");
    }
    sharded_load_matches(&dir, &full, &cfg, Layout::single().with_tp(2, true))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// `full` saved as a HF checkpoint in `dir` ([`save_hf`]) and read back whole: the same config
/// and every tensor bit for bit. Returns the checkpoint's tensors by their names.
fn save_and_reload(dir: &std::path::Path, full: &HashMap<String, Tensor>, cfg: &LlamaConfig) -> Result<HashMap<String, Tensor>> {
    save_hf(dir, &candle_cp_tests::varmap_of(full)?, cfg)?;
    let (back, back_cfg) = load_hf(dir, &Device::Cpu, DType::F32)?;
    assert_eq!(&back_cfg, cfg);
    let got = candle_cp_llama::params::varmap_tensors(&back)?;
    assert_eq!(got.len(), full.len());
    for (k, t) in full {
        assert_eq!(max_abs(&got[k], t)?, 0.0, "{k}");
    }
    load_safetensors_dir(dir, &Device::Cpu)
}

/// The model of `style` (load-balancing loss at 0.5) on `layouts`, then zigzag 2 × TP 2 + SP
/// with recomputed layers and ring 2 × DP 2, then the expert-parallel layouts `ep` (layout,
/// recomputed layers, two DP rows), against the float64 reference.
fn on_layouts(style: MoeStyle, layouts: &[Layout], ep: &[(Layout, bool, bool)]) -> Result<()> {
    let (cfg, full) = moe_model(style, Some(0.5))?;
    let ids = ids(T)?;
    let (want, margin) = reference_routed(&full, &cfg, &ids)?;
    println!("{style:?}: smallest top-2 margin of the router probabilities: {margin:.2e}");
    assert!(margin > 1e-5, "a near tie in the routing ({margin:.1e}): float32 could route otherwise");
    let (plain_cfg, _) = moe_model(style, None)?;
    let plain = reference(&full, &plain_cfg, &ids)?;
    let module = cfg.moe.as_ref().map_or("mlp", |m| m.module());
    let r = format!("model.layers.1.{module}.gate.weight");
    let rel = max_abs(&plain.grads[&r], &want.grads[&r])? / max_abs(&want.grads[&r], &want.grads[&r].zeros_like()?)?;
    assert!(rel > 0.05, "the load-balancing loss moves the router's gradient by only {rel:.1e}");
    let check = |layout: Layout, run: LayoutRun, want: &Reference| check_run(&cfg, layout, run, want);
    for &layout in layouts {
        check(layout, run_layout(&full, &cfg, &ids, layout, &Device::Cpu)?, &want)?;
    }
    let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true);
    check(layout, run_layout_recompute(&full, &cfg, &ids, layout, &Device::Cpu, true)?, &want)?;
    let two = Tensor::cat(&[&ids, &ids], 0)?;
    let layout = Layout::cp(CpKind::Ring, 2).with_dp(2);
    let rows_want = reference_rows(&want)?;
    check(layout, run_layout(&full, &cfg, &two, layout, &Device::Cpu)?, &rows_want)?;
    for &(layout, recompute, dp) in ep {
        let (input, want) = if dp { (&two, &rows_want) } else { (&ids, &want) };
        check(layout, run_layout_recompute(&full, &cfg, input, layout, &Device::Cpu, recompute)?, want)?;
    }
    Ok(())
}

/// `run` (of `layout`) gives `want`'s logits, loss and every gradient, the router's and the
/// stacked experts' among them, within the oracle's float32 tolerances.
fn check_run(cfg: &LlamaConfig, layout: Layout, run: LayoutRun, want: &Reference) -> Result<()> {
    let module = cfg.moe.as_ref().map_or("mlp", |m| m.module());
    let experts = |k: &str| k.contains(&format!("{module}.experts.")) || k.ends_with(&format!("{module}.gate.weight"));
    let rep = compare(&run, want, Tolerances::default())?;
    println!("{module} {layout}: logits {:.1e} loss {:.1e} grad rel {:.1e} ({})", rep.logits_abs, rep.loss_abs, rep.grad_rel_max, rep.worst_param);
    assert_eq!(rep.grad_rel.len(), want.grads.len(), "{layout}: every parameter compared");
    assert_eq!(rep.grad_rel.iter().filter(|(k, _)| experts(k)).count(), 4 * cfg.moe_layers(), "{layout}");
    assert!(rep.pass(), "{module} {layout}: {rep:?}");
    Ok(())
}

/// Cached decoding equals the full forward; CP, TP and EP decode the single device's tokens
/// (Qwen3-MoE; Mixtral with a window of 12, which binds within the 32 + 6 tokens).
#[test]
fn moe_generation() -> Result<()> {
    let layouts = [
        Layout::cp(CpKind::Zigzag, 2),
        Layout::single().with_tp(2, true),
        Layout::single().with_tp(4, false),
        Layout::cp(CpKind::Zigzag, 2).with_ep(2),
        Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2),
    ];
    let (cfg, full) = qwen3_moe(None)?;
    candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids(32)?, &layouts)?;
    let (cfg, full) = mixtral(None)?;
    candle_cp_tests::dense_llama::cached_generation_agrees(&cfg.with_sliding_window(Some(12)), &full, &ids(32)?, &layouts)?;
    let (cfg, full) = moe_model(MoeStyle::Qwen2Moe, None)?;
    candle_cp_tests::dense_llama::cached_generation_agrees(&cfg, &full, &ids(32)?, &layouts)
}

/// `Llama::expert_counts` holds the last forward's routing only: a prefill's `B · T · K`
/// choices per sparse layer, then each decode step's `B · K` (the log does not grow with the
/// tokens generated), on one device and on each CP rank of zigzag 2 × EP 2 (its own tokens:
/// the ranks' prefill counts sum to the single device's).
#[test]
fn expert_counts_follow_the_last_forward() -> Result<()> {
    let (cfg, full) = qwen3_moe(None)?;
    let (k, layers) = (cfg.moe.as_ref().map_or(0, |m| m.num_experts_per_tok), cfg.moe_layers());
    let prompt = ids(32)?;
    let (b, t) = prompt.dims2()?;
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_ep(2)] {
        let prefills = run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_tensors(&full, &cfg, &ctx)?;
            let m = candle_cp_llama::Llama::new(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
            let (mut cache, _) = m.prefill(&prompt)?;
            let prefill = m.expert_counts();
            for step in 0..3 {
                m.decode_step(&mut cache, &Tensor::new(&[3u32, 5][..b], &Device::Cpu)?)?;
                let c = m.expert_counts();
                assert!(c.len() == layers && c.iter().all(|l| l.iter().sum::<usize>() == b * k), "{layout}: decode step {step}: {c:?}");
            }
            Ok(prefill)
        })
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
        for l in 0..layers {
            let sum: usize = prefills.iter().map(|p| p[l].iter().sum::<usize>()).sum();
            assert_eq!(sum, b * t * k, "{layout}: layer {l}'s prefill counts");
        }
    }
    Ok(())
}

/// A Mixtral's experts go to a checkpoint under Mixtral's names and come back, whole and
/// sharded over TP 2.
#[test]
fn mixtral_checkpoints() -> Result<()> {
    let (cfg, full) = mixtral(Some(0.02))?;
    let dir = std::env::temp_dir().join(format!("candle-cp-mixtral-{}", std::process::id()));
    let names = save_and_reload(&dir, &full, &cfg)?;
    for k in ["model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.7.w1.weight", "model.layers.1.block_sparse_moe.experts.0.w2.weight"] {
        assert!(names.contains_key(k), "{k}");
    }
    // w1 is the gate, w3 the up projection, w2 the down projection
    let stacked = |p: &str| full[&format!("model.layers.0.block_sparse_moe.experts.{p}")].get(3);
    for (ckpt, p) in [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")] {
        assert_eq!(max_abs(&names[&format!("model.layers.0.block_sparse_moe.experts.3.{ckpt}.weight")], &stacked(p)?)?, 0.0, "{ckpt}");
    }
    let config = std::fs::read_to_string(dir.join("config.json"))?;
    assert!(config.contains("MixtralForCausalLM"));
    sharded_load_matches(&dir, &full, &cfg, Layout::single().with_tp(2, true))?;
    // transformers 5's Mixtral (save_original_format=False): the sparse layer is `mlp`, its
    // router `mlp.gate.weight`, its experts fused, w1's rows then w3's in gate_up_proj
    let fused_dir = dir.join("fused");
    std::fs::create_dir_all(&fused_dir)?;
    let mut fused: HashMap<String, Tensor> = HashMap::new();
    for (k, t) in &full {
        let v5 = k.replace(".block_sparse_moe.", ".mlp.");
        if let Some(p) = k.strip_suffix("block_sparse_moe.experts.gate_proj") {
            fused.insert(format!("{p}mlp.experts.gate_up_proj"), Tensor::cat(&[t, &full[&format!("{p}block_sparse_moe.experts.up_proj")]], 1)?);
        } else if !k.ends_with("experts.up_proj") {
            fused.insert(v5, t.clone());
        }
    }
    assert!(fused.contains_key("model.layers.1.mlp.gate.weight") && fused.contains_key("model.layers.1.mlp.experts.down_proj"));
    assert!(!fused.keys().any(|k| k.contains("block_sparse_moe")));
    candle_core::safetensors::save(&fused, fused_dir.join("model.safetensors"))?;
    std::fs::write(fused_dir.join("config.json"), &config)?;
    let got = candle_cp_llama::params::varmap_tensors(&load_hf(&fused_dir, &Device::Cpu, DType::F32)?.0)?;
    assert_eq!(got.len(), full.len());
    for (k, t) in &full {
        assert_eq!(max_abs(&got[k], t)?, 0.0, "transformers 5's layout: {k}");
    }
    sharded_load_matches(&fused_dir, &full, &cfg, Layout::single().with_tp(2, true))?;
    sharded_load_matches(&fused_dir, &full, &cfg, Layout::cp(CpKind::Zigzag, 2).with_ep(2))?;
    // and written back in the published layout, the bytes of the first checkpoint
    let again = dir.join("again");
    let vm = load_hf(&fused_dir, &Device::Cpu, DType::F32)?.0;
    save_hf(&again, &vm, &cfg)?;
    assert!(std::fs::read(again.join("model.safetensors"))? == std::fs::read(dir.join("model.safetensors"))?, "transformers 5's layout written back differs");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The experts go to a checkpoint per expert and come back stacked, whole and sharded; the
/// sharded writer writes the same bytes; a dense Qwen3 config refuses them by name.
#[test]
fn qwen3_moe_checkpoints() -> Result<()> {
    let (cfg, full) = qwen3_moe(Some(0.01))?;
    let root = std::env::temp_dir().join(format!("candle-cp-qwen3-moe-{}", std::process::id()));
    let dir = root.join("whole");
    let names = save_and_reload(&dir, &full, &cfg)?;
    assert!(names.contains_key("model.layers.1.mlp.experts.7.down_proj.weight") && names.contains_key("model.layers.1.mlp.gate.weight"));
    assert_eq!(names["model.layers.1.mlp.experts.3.gate_proj.weight"].dims(), [48, 128]);
    assert!(!names.keys().any(|k| k.ends_with("experts.gate_proj")), "stacked names leaked into the checkpoint");
    assert_eq!(max_abs(&names["model.layers.1.mlp.experts.5.up_proj.weight"], &full["model.layers.1.mlp.experts.up_proj"].get(5)?)?, 0.0);
    let config = std::fs::read_to_string(dir.join("config.json"))?;
    assert!(config.contains("Qwen3MoeForCausalLM") && config.contains("\"mlp_only_layers\""), "{config}");
    let bytes = std::fs::read(dir.join("model.safetensors"))?;
    // over TP, and with the experts split over EP ranks (alone and with TP)
    let layouts = [
        Layout::single().with_tp(1, true),
        Layout::single().with_tp(2, true),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Zigzag, 2).with_ep(2),
        Layout::cp(CpKind::Ring, 4).with_ep(4),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2),
    ];
    for (i, layout) in layouts.into_iter().enumerate() {
        sharded_load_matches(&dir, &full, &cfg, layout)?;
        let sharded = root.join(format!("layout{i}"));
        for r in run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let mine = candle_cp_llama::params::varmap_tensors(&shard_tensors(&full, &cfg, &ctx)?)?;
            save_hf_sharded(&sharded, &mine, &cfg, &ctx, ctx.world.rank() == 0)
        }) {
            r?;
        }
        assert!(std::fs::read(sharded.join("model.safetensors"))? == bytes, "{layout}: the sharded writer wrote other bytes");
    }
    // transformers 5's fused experts: gate and up concatenated along dim 1, down as stacked
    let fused_dir = root.join("fused");
    std::fs::create_dir_all(&fused_dir)?;
    let mut fused: HashMap<String, Tensor> = HashMap::new();
    for (k, t) in &full {
        if let Some(p) = k.strip_suffix("mlp.experts.gate_proj") {
            fused.insert(format!("{p}mlp.experts.gate_up_proj"), Tensor::cat(&[t, &full[&format!("{p}mlp.experts.up_proj")]], 1)?);
        } else if !k.ends_with("mlp.experts.up_proj") {
            fused.insert(k.clone(), t.clone());
        }
    }
    candle_core::safetensors::save(&fused, fused_dir.join("model.safetensors"))?;
    std::fs::write(fused_dir.join("config.json"), &config)?;
    let got = candle_cp_llama::params::varmap_tensors(&load_hf(&fused_dir, &Device::Cpu, DType::F32)?.0)?;
    for (k, t) in &full {
        assert_eq!(max_abs(&got[k], t)?, 0.0, "fused: {k}");
    }
    sharded_load_matches(&fused_dir, &full, &cfg, Layout::single().with_tp(2, false))?;
    // read as a dense Qwen3: the router and the experts are not its parameters
    let mut dense = cfg.clone().with_moe(None);
    dense.intermediate_size = 352;
    std::fs::write(dir.join("config.json"), dense.to_hf_json("float32"))?;
    let e = load_hf(&dir, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("model.layers.1.mlp.experts.0.down_proj.weight") && e.contains("Qwen3ForCausalLM"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

/// What a mixture of experts cannot be split or loaded as is refused by name: a width TP does
/// not divide, a checkpoint missing an expert or holding one of another shape.
#[test]
fn moe_bad_inputs_are_refused_by_name() -> Result<()> {
    let (cfg, full) = qwen3_moe(None)?;
    // 48-wide experts over TP 4 split; 50-wide ones do not
    let mut odd = cfg.clone();
    if let Some(m) = odd.moe.as_mut() {
        m.moe_intermediate_size = 50;
    }
    let errs: Vec<String> = run_ranks(4, |g| {
        let ctx = ParallelCtx::new(g, Layout::single().with_tp(4, true))?;
        let vm = candle_cp_llama::init_params(&odd, 1, DType::F32, &Device::Cpu)?;
        Ok(candle_cp_llama::shard_params(&vm, &odd, &ctx).err().map(|e| e.to_string()).unwrap_or_default())
    })
    .into_iter()
    .collect::<Result<_>>()?;
    for e in errs {
        assert!(e.contains("mlp.experts.gate_proj") && e.contains("TP size 4") && e.contains("[8, 50, 128]"), "{e}");
    }
    // a checkpoint without expert 5's up projection, and one with expert 2's down projection transposed
    let dir = std::env::temp_dir().join(format!("candle-cp-moe-bad-{}", std::process::id()));
    save_and_reload(&dir, &full, &cfg)?;
    let whole = load_safetensors_dir(&dir, &Device::Cpu)?;
    let mut tensors = whole.clone();
    tensors.remove("model.layers.1.mlp.experts.5.up_proj.weight");
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    let e = load_hf(&dir, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("no tensor model.layers.1.mlp.experts.5.up_proj.weight") && e.contains("[48, 128]"), "{e}");
    let mut tensors = whole;
    let down = "model.layers.1.mlp.experts.2.down_proj.weight";
    let t = tensors[down].t()?.contiguous()?;
    tensors.insert(down.into(), t);
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    for r in run_ranks(2, |g| {
        let ctx = ParallelCtx::new(g, Layout::single().with_tp(2, false))?;
        Ok(load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default())
    }) {
        let e = r?;
        assert!(e.contains(down) && e.contains("[48, 128]") && e.contains("[128, 48]"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    // expert parallelism over a degree that does not divide the 8 experts, and on a dense model
    let errs = run_ranks(6, |g| {
        let ctx = ParallelCtx::new(g, Layout::cp(CpKind::Ring, 6).with_ep(6))?;
        let vm = candle_cp_llama::init_params(&cfg, 1, DType::F32, &Device::Cpu)?;
        Ok(candle_cp_llama::shard_params(&vm, &cfg, &ctx).err().map(|e| e.to_string()).unwrap_or_default())
    });
    for e in errs {
        let e = e?;
        assert!(e.contains("8 experts") && e.contains("ep = 6"), "{e}");
    }
    let dense = LlamaConfig::from_file(candle_cp_tests::oracle_dir("tiny-llama").join("config.json"))?;
    let errs = run_ranks(2, |g| {
        let ctx = ParallelCtx::new(g, Layout::cp(CpKind::Zigzag, 2).with_ep(2))?;
        let vm = candle_cp_llama::shard_params(&candle_cp_llama::init_params(&dense, 1, DType::F32, &Device::Cpu)?, &dense, &ctx)?;
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        Ok(candle_cp_llama::Llama::new(vb, &dense, &ctx).err().map(|e| e.to_string()).unwrap_or_default())
    });
    for e in errs {
        let e = e?;
        assert!(e.contains("ep = 2") && e.contains("no experts"), "{e}");
    }
    Ok(())
}
