//! Trainer tests of mixture-of-experts models: the load-balancing term, expert parallelism.
use super::tests::{assert_same_curve, run, tiny_cfg, tmpdir};
use super::*;
use crate::Layout;
use candle_core::DType;
use std::path::PathBuf;
use crate::CpKind;

fn moe_cfg(out: Option<PathBuf>, layout: Layout) -> Result<TrainConfig> {
    let mut c = tiny_cfg(out, layout, 2, 1);
    let ModelSource::Init(m) = &c.model else { candle_core::bail!("init model expected") };
    let mut moe = crate::MoeConfig::new(4, 2, 16);
    (moe.output_router_logits, moe.router_aux_loss_coef) = (true, 0.1);
    c.model = ModelSource::Init(m.clone().with_moe(Some(moe)));
    Ok(c)
}

/// A Qwen3-MoE with the load-balancing loss reports its term: near `coef · K` at the start
/// (balanced routing), included in the objective; the same on 2 DP × 2 CP ranks as on one
/// device (its statistics are the global batch's), and so is the routing balance
/// (`expert_load`, in `[1, E/K]`). A dense model reports neither.
#[test]
fn moe_load_balancing_term_is_reported() -> Result<()> {
    let mut base = tiny_cfg(None, Layout::single(), 2, 1);
    assert!(run(&base)?[0].metrics.iter().all(|m| m.router_aux_loss.is_none() && m.expert_load.is_none()));
    let ModelSource::Init(m) = &base.model else { candle_core::bail!("init model expected") };
    let mut moe = crate::MoeConfig::new(4, 2, 16);
    (moe.output_router_logits, moe.router_aux_loss_coef) = (true, 0.1);
    base.model = ModelSource::Init(m.clone().with_moe(Some(moe)));
    let one = run(&base)?;
    let first = one[0].metrics[0].router_aux_loss.expect("an aux term");
    assert!((0.1..0.4).contains(&first), "coef 0.1 × K 2 when balanced: {first}");
    let mut par = base.clone();
    par.layout = Layout::cp(CpKind::Zigzag, 2).with_dp(2);
    let two = run(&par)?;
    for (a, b) in one[0].metrics.iter().zip(&two[0].metrics) {
        let (x, y) = (a.router_aux_loss.unwrap_or(f64::NAN), b.router_aux_loss.unwrap_or(f64::NAN));
        assert!((x - y).abs() < 1e-5, "step {}: aux {x} on one device, {y} on DP 2 x CP 2", a.step);
        // the routing balance: of the global batch (the same counts on both), in [1, E/K]
        let (x, y) = (a.expert_load.unwrap_or(f64::NAN), b.expert_load.unwrap_or(f64::NAN));
        assert!((1.0..=2.0).contains(&x) && (x - y).abs() < 1e-6, "step {}: expert load {x} on one device, {y} on DP 2 x CP 2", a.step);
    }
    assert!(one[0].metrics.iter().any(|m| m.expert_load.is_some_and(|x| x > 1.0)), "some imbalance at random init");
    assert_same_curve("moe dp 2 x cp 2", &one[0].metrics.iter().collect::<Vec<_>>(), &two[0].metrics);
    Ok(())
}

/// Expert parallelism: 4 experts over 4 DP × CP ranks (one each), over 2 of them, over CP 2 ×
/// TP 2 + SP with recomputed layers and the overlapped gradient sync, and with ZeRO-1 and
/// ZeRO-2 (+ the overlapped parameter gather; the experts' gradients reduce-scattered and
/// their state split over the 2 ranks holding the same experts, the rest over the 4
/// replicas), and ZeRO-1 under TP 2 + SP too, follow the one-device run for 6 clipped steps (the gradient norm counts every
/// expert once); their checkpoints hold every expert, the same weights; a run stopped after
/// step 4 (EP 4, ZeRO-1) resumes from its step-3 checkpoint on another EP degree with ZeRO-2
/// and on one device, on the same curve. ZeRO-2 with 2 micro-batches (the experts' gradient
/// slices summed over them) follows the one-device run of the same micro-batches.
#[test]
fn expert_parallel_trains_like_one_device_and_resumes() -> Result<()> {
    let d1 = tmpdir("ep1");
    let one = run(&moe_cfg(Some(d1.clone()), Layout::single())?)?;
    let (want, _) = crate::load_hf(d1.join("checkpoints/step-000006"), &Device::Cpu, DType::F32)?;
    let want = crate::params::varmap_tensors(&want)?;
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    // (the third: recomputed layers, the replicas' gradients summed as each layer's backward
    // ends, the experts' over their own group after it)
    // (layout, recompute + overlapped gradient sync, ZeRO stage)
    let runs = [
        (Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_ep(4), false, 0),
        (Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(2), false, 0),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), true, 0),
        (Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_ep(2), false, 1),
        (Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(2), true, 2),
        (Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_tp(2, true).with_ep(2), true, 1),
    ];
    for (i, (layout, overlap, zero)) in runs.into_iter().enumerate() {
        let d = tmpdir(&format!("ep-{i}"));
        let mut c = moe_cfg(Some(d.clone()), layout)?;
        (c.recompute, c.overlap_grad_sync) = (overlap, overlap);
        (c.zero1, c.zero2, c.overlap_param_gather) = (zero == 1, zero == 2, zero == 2);
        let layout = format!("{layout} zero {zero}");
        let other = run(&c)?;
        assert_eq!(other[0].metrics.len(), 6);
        assert_same_curve(&layout.to_string(), &curve, &other[0].metrics);
        let (got, _) = crate::load_hf(d.join("checkpoints/step-000006"), &Device::Cpu, DType::F32)?;
        let got = crate::params::varmap_tensors(&got)?;
        assert_eq!(got.len(), want.len());
        for (name, w) in &want {
            let diff = (&got[name] - w)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{layout}: {name} differs by {diff}");
        }
        std::fs::remove_dir_all(&d).ok();
    }
    // ZeRO-2 over 2 micro-batches: the experts' slices summed over them (plain and overlapped)
    let mut acc = moe_cfg(None, Layout::single())?;
    acc.grad_accum = 2;
    let one2 = run(&acc)?;
    let curve2: Vec<&StepMetrics> = one2[0].metrics.iter().collect();
    for overlap in [false, true] {
        let mut c = acc.clone();
        c.layout = Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(2);
        (c.zero2, c.recompute, c.overlap_grad_sync) = (true, overlap, overlap);
        assert_same_curve(&format!("{} zero 2, 2 micro-batches, overlap {overlap}", c.layout), &curve2, &run(&c)?[0].metrics);
    }
    // stopped after step 4 (checkpoint at 3) on EP 4, resumed on EP 2 and on one device
    let tail: Vec<&StepMetrics> = one[0].metrics.iter().filter(|m| m.step > 3).collect();
    for (i, (next, zero2)) in [(Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(2), true), (Layout::single(), false)].into_iter().enumerate() {
        let d = tmpdir(&format!("ep-resume{i}"));
        let mut c = moe_cfg(Some(d.clone()), Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_ep(4))?;
        (c.stop_after, c.zero1) = (Some(4), true);
        run(&c)?;
        (c.layout, c.resume, c.stop_after, c.zero1, c.zero2) = (next, true, None, false, zero2);
        let rest = run(&c)?;
        assert_eq!(rest[0].start_step, 3, "{next}");
        assert_same_curve(&format!("resumed on {next}"), &tail, &rest[0].metrics);
        std::fs::remove_dir_all(&d).ok();
    }
    std::fs::remove_dir_all(&d1).ok();
    Ok(())
}

/// The layouts the adapter runs are checked on, `(layout, recompute, zero1)`: zigzag 2 × TP 2 +
/// SP with recomputed layers, EP 2 over zigzag 2 × DP 2 with ZeRO-1, EP 4 over ring 2 × DP 2,
/// EP 2 over ring 2 × TP 2 + SP (the factors every TP rank holds whole — gate's and up's `A`,
/// down's `B` — counted once in the clipped norm, not once per TP rank).
fn adapter_layouts() -> [(Layout, bool, bool); 4] {
    [
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true, false),
        (Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_ep(2), false, true),
        (Layout::cp(CpKind::Ring, 2).with_dp(2).with_ep(4), false, false),
        (Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2), false, false),
    ]
}

/// LoRA on a mixture of experts: the targets adapt every expert's gate, up and down (stacked
/// factors; crate::moe_lora) and the router (PEFT's `gate`) beside the attention's, with
/// dropout 0.3 on their inputs (an expert's mask rows keyed on the (token, expert) pair, the
/// router's on the token). The adapters alone train (the
/// checkpoint's PEFT file holds each expert's factors, B moved off zero for every one); zigzag
/// 2 × TP 2 + SP with recomputed layers, EP 2 over zigzag 2 × DP 2 with ZeRO-1, and EP 4 over
/// ring 2 × DP 2 follow the one-device run for 6 clipped steps; the dropout changes the curve.
#[test]
fn lora_on_experts_trains_alike_on_every_layout() -> Result<()> {
    let d = tmpdir("moe-lora");
    let mut c = moe_cfg(Some(d.clone()), Layout::single())?;
    c.lora = Some(crate::LoraSpec::new(4, 8.0, &["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "gate"])?.with_dropout(0.3)?);
    let one = run(&c)?;
    let (spec, adapters) = crate::lora::load_peft_adapter(&d.join("checkpoints/step-000006"))?;
    assert_eq!(Some(&spec), c.lora.as_ref());
    let experts: Vec<(&String, &Tensor)> = adapters.iter().filter(|(n, _)| n.contains(".experts.")).collect();
    // 1 sparse layer: gate, up, down × A, B, stacked over 4 experts
    assert_eq!(experts.len(), 6, "{:?}", experts.iter().map(|(n, _)| n).collect::<Vec<_>>());
    let router = adapters.get("model.layers.0.mlp.gate.lora_B.weight").map(|t| t.abs()?.max_all()?.to_scalar::<f32>()).transpose()?;
    assert!(router.is_some_and(|m| m > 0.0), "the router's B trained: {router:?}");
    for (n, t) in experts.iter().filter(|(n, _)| n.ends_with("lora_B.weight")) {
        for e in 0..4 {
            let m = t.get(e)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(m > 0.0, "{n}: expert {e}'s B did not train");
        }
    }
    let mut plain = c.clone();
    (plain.out, plain.lora) = (None, plain.lora.map(|l| l.with_dropout(0.0)).transpose()?);
    let without = run(&plain)?;
    assert!((one[0].metrics[3].loss - without[0].metrics[3].loss).abs() > 1e-6, "dropout changes the curve");
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    for (layout, recompute, zero1) in adapter_layouts() {
        let mut cl = c.clone();
        (cl.out, cl.layout, cl.recompute, cl.zero1) = (None, layout, recompute, zero1);
        assert_same_curve(&format!("MoE LoRA on {layout}"), &curve, &run(&cl)?[0].metrics);
    }
    std::fs::remove_dir_all(&d).ok();
    Ok(())
}

/// DoRA with dropout 0.3 on a Qwen2-MoE's experts, shared expert and routers (each projection
/// trained as `W·x + (W' - W)·drop(x)`, the experts' rows keyed on (token, expert); crate::moe_lora):
/// the dropout changes the curve; zigzag 2 × TP 2 + SP with recomputed layers, EP 2 over
/// zigzag 2 × DP 2 with ZeRO-1, and EP 4 over ring 2 × DP 2 follow the one-device run.
#[test]
fn dora_with_dropout_on_experts_trains_alike_on_every_layout() -> Result<()> {
    let mut c = moe_cfg(None, Layout::single())?;
    let ModelSource::Init(m) = &c.model else { candle_core::bail!("init model expected") };
    let mut moe = m.moe.clone().ok_or_else(|| candle_core::Error::Msg("moe config expected".into()))?;
    (moe.style, moe.shared_expert_intermediate_size) = (crate::MoeStyle::Qwen2Moe, 16);
    c.model = ModelSource::Init(m.clone().with_moe(Some(moe)));
    // (the routers too: PEFT's `gate` and Qwen2-MoE's `shared_expert_gate`, DoRA as the others)
    c.lora = Some(crate::LoraSpec::new(4, 8.0, &["q_proj", "gate_proj", "up_proj", "down_proj", "gate", "shared_expert_gate"])?.with_dora(true).with_dropout(0.3)?);
    let one = run(&c)?;
    let mut plain = c.clone();
    plain.lora = plain.lora.map(|l| l.with_dropout(0.0)).transpose()?;
    let without = run(&plain)?;
    assert!((one[0].metrics[0].grad_norm - without[0].metrics[0].grad_norm).abs() > 1e-6, "dropout changes the first step's gradients");
    assert!((one[0].metrics[3].loss - without[0].metrics[3].loss).abs() > 1e-6, "dropout changes the curve");
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    for (layout, recompute, zero1) in adapter_layouts() {
        let mut cl = c.clone();
        (cl.layout, cl.recompute, cl.zero1) = (layout, recompute, zero1);
        assert_same_curve(&format!("MoE DoRA with dropout on {layout}"), &curve, &run(&cl)?[0].metrics);
    }
    Ok(())
}

/// LoRA on gpt-oss's experts as PEFT adapts them (`target_parameters`: its experts are
/// parameters; crate::expert_params) beside q_proj's: gate and up share one `A` (the fused
/// `gate_up_proj`'s), trained with the experts' biases inside the same nodes. The checkpoint's
/// PEFT file holds the wrappers (`….mlp.experts.lora_*` down, `….mlp.experts.base_layer.lora_*`
/// gate_up, `[r·E, in]` / `[out, r·E]`) and `target_parameters`, B moved off zero for every
/// expert; it reads back as the run's spec; zigzag 2 × TP 2 + SP with recomputed layers, EP 2
/// over zigzag 2 × DP 2 with ZeRO-1, and EP 4 over ring 2 × DP 2 follow the one-device run;
/// the experts' adapters change the curve. Started from that file (`lora_init`), ring 2 × TP 2
/// + SP × EP 2 follows the one-device run started from it.
#[test]
fn lora_on_gpt_oss_expert_parameters_trains_alike_on_every_layout() -> Result<()> {
    let d = tmpdir("gpt-oss-lora");
    let mut c = tiny_cfg(Some(d.clone()), Layout::single(), 2, 1);
    let ModelSource::Init(m) = &c.model else { candle_core::bail!("init model expected") };
    let m = m.clone().with_moe(Some(crate::MoeConfig::gpt_oss(4, 2, 16)));
    c.model = ModelSource::Init(m.clone());
    c.lora = Some(crate::LoraSpec::new(4, 8.0, &["q_proj"])?.with_target_parameters(&["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])?);
    let one = run(&c)?;
    let step = d.join("checkpoints/step-000006");
    let text = std::fs::read_to_string(step.join("adapter_config.json")).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert!(text.contains("\"target_parameters\""), "{text}");
    let (spec, _) = crate::lora::load_peft_adapter(&step)?;
    assert_eq!(Some(&spec.with_expert_params(Some(crate::lora::GateUp::Interleaved))), c.lora.as_ref().map(|l| l.clone().with_expert_params(Some(crate::lora::GateUp::Interleaved))).as_ref());
    let file = candle_core::safetensors::load(step.join("adapter_model.safetensors"), &candle_core::Device::Cpu)?;
    let experts: Vec<(&String, &Tensor)> = file.iter().filter(|(n, _)| n.contains(".experts.")).collect();
    // one layer: 2 wrappers × A, B
    assert_eq!(experts.len(), 4, "{:?}", experts.iter().map(|(n, _)| n).collect::<Vec<_>>());
    let f = |n: &str| file.get(&format!("base_model.model.model.layers.0.mlp.experts.{n}")).map(|t| t.dims().to_vec());
    let (h, i, e, r) = (m.hidden_size, 16, 4, 4);
    assert_eq!((f("base_layer.lora_A.weight"), f("base_layer.lora_B.weight")), (Some(vec![r * e, h]), Some(vec![2 * i, r * e])));
    assert_eq!((f("lora_A.weight"), f("lora_B.weight")), (Some(vec![r * e, i]), Some(vec![h, r * e])));
    for (n, t) in experts.iter().filter(|(n, _)| n.ends_with("lora_B.weight")) {
        // column j·E + e is expert e's
        let t = t.reshape((t.dim(0)?, r, e))?;
        for ex in 0..e {
            let m = t.narrow(2, ex, 1)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(m > 0.0, "{n}: expert {ex}'s B did not train");
        }
    }
    let mut attn_only = c.clone();
    (attn_only.out, attn_only.lora) = (None, Some(crate::LoraSpec::new(4, 8.0, &["q_proj"])?));
    let without = run(&attn_only)?;
    assert!((one[0].metrics[3].loss - without[0].metrics[3].loss).abs() > 1e-6, "the experts' adapters change the curve");
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    for (layout, recompute, zero1) in adapter_layouts() {
        let mut cl = c.clone();
        (cl.out, cl.layout, cl.recompute, cl.zero1) = (None, layout, recompute, zero1);
        assert_same_curve(&format!("gpt-oss expert LoRA on {layout}"), &curve, &run(&cl)?[0].metrics);
    }
    // started from the file (read into each rank's shards over TP and EP): the one-device curve
    let mut from = c.clone();
    (from.out, from.lora_init) = (None, Some(step.clone()));
    let want = run(&from)?;
    assert!((want[0].metrics[0].loss - one[0].metrics[0].loss).abs() > 1e-6, "the file's adapters act from step 1");
    from.layout = Layout::cp(CpKind::Ring, 2).with_tp(2, true).with_ep(2);
    assert_same_curve("gpt-oss expert LoRA from its file on ring 2 x TP 2 + SP x EP 2", &want[0].metrics.iter().collect::<Vec<_>>(), &run(&from)?[0].metrics);
    std::fs::remove_dir_all(&d).ok();
    Ok(())
}

/// LoRA on a Qwen3-MoE's expert parameters (transformers 5's fused `gate_up_proj`, PEFT's
/// `target_parameters`) beside v_proj's: the adapters alone train, the checkpoint's PEFT file
/// holds the wrappers and reads back as the run's spec, and every adapter layout follows the
/// one-device run.
#[test]
fn lora_on_qwen3_moe_expert_parameters_trains_alike_on_every_layout() -> Result<()> {
    let d = tmpdir("qwen-params-lora");
    let mut c = moe_cfg(Some(d.clone()), Layout::single())?;
    c.lora = Some(crate::LoraSpec::new(4, 8.0, &["v_proj"])?.with_target_parameters(&["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])?);
    let one = run(&c)?;
    let step = d.join("checkpoints/step-000006");
    let (spec, _) = crate::lora::load_peft_adapter(&step)?;
    let layout = Some(crate::lora::GateUp::Concatenated);
    assert_eq!(Some(spec.with_expert_params(layout)), c.lora.clone().map(|l| l.with_expert_params(layout)));
    let file = candle_core::safetensors::load(step.join("adapter_model.safetensors"), &candle_core::Device::Cpu)?;
    let mut experts: Vec<&String> = file.keys().filter(|n| n.contains(".experts.")).collect();
    experts.sort();
    assert_eq!(experts.len(), 4, "{experts:?}");
    assert!(experts[0].ends_with("mlp.experts.base_layer.lora_A.weight"), "{experts:?}");
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    for (layout, recompute, zero1) in adapter_layouts() {
        let mut cl = c.clone();
        (cl.out, cl.layout, cl.recompute, cl.zero1) = (None, layout, recompute, zero1);
        assert_same_curve(&format!("Qwen3-MoE expert-parameter LoRA on {layout}"), &curve, &run(&cl)?[0].metrics);
    }
    std::fs::remove_dir_all(&d).ok();
    Ok(())
}

/// Every step of a mixture of experts reports how its layers routed the global batch
/// (`expert_counts`, with or without the load-balancing term): per sparse layer, counts that
/// sum to the step's tokens times K, the same on one device and on DP 2 × CP 2 or zigzag CP 2 ×
/// TP 2 + SP × EP 2 with recomputed layers (their second routing in the backward not counted)
/// and 2 micro-batches; written to the metrics file and read back. A dense model has none.
#[test]
fn expert_counts_are_the_global_batch_routing() -> Result<()> {
    let mut base = tiny_cfg(None, Layout::single(), 2, 2);
    base.steps = 2;
    assert!(run(&base)?[0].metrics.iter().all(|m| m.expert_counts.is_none()), "a dense model routes nothing");
    let ModelSource::Init(m) = &base.model else { candle_core::bail!("init model expected") };
    let mut m = m.clone().with_moe(Some(crate::MoeConfig::new(4, 2, 16)));
    m.num_hidden_layers = 2;
    base.model = ModelSource::Init(m);
    let one = run(&base)?;
    let tokens = (base.batch * base.seq_len * base.grad_accum) as u64;
    for s in &one[0].metrics {
        let c = s.expert_counts.as_ref().expect("counts of a mixture of experts");
        assert_eq!(c.len(), 2, "step {}: two sparse layers, got {c:?}", s.step);
        assert!(c.iter().all(|l| l.len() == 4 && l.iter().sum::<u64>() == tokens * 2), "step {}: {c:?} for {tokens} tokens, top 2", s.step);
    }
    let dir = tmpdir("expert-counts");
    for (layout, recompute) in [
        (Layout::cp(CpKind::Ring, 2).with_dp(2), false),
        (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), true),
    ] {
        let mut c = TrainConfig { layout, out: Some(dir.clone()), ..base.clone() };
        c.recompute = recompute;
        let outs = run(&c)?;
        for (r, o) in outs.iter().enumerate() {
            // (the first step runs the same weights; the rest may part by rounding only)
            assert_eq!(o.metrics[0].expert_counts, one[0].metrics[0].expert_counts, "{layout}: rank {r}");
        }
        let text = std::fs::read_to_string(dir.join("metrics.jsonl"))?;
        let rows: Vec<StepMetrics> = text.lines().map(serde_json::from_str).collect::<std::result::Result<_, _>>().map_err(candle_core::Error::wrap)?;
        assert_eq!(rows.iter().map(|m| m.expert_counts.clone()).collect::<Vec<_>>(), outs[0].metrics.iter().map(|m| m.expert_counts.clone()).collect::<Vec<_>>(), "{layout}: the metrics file");
    }
    Ok(())
}

/// GLM-4.5's loss-free balancing: each step moves the correction bias by `rate · sign(mean −
/// count)` of the step's global counts (from 0: the first step's bias is that alone); DP × CP,
/// TP + SP × EP with recompute, and ZeRO-1 with the overlapped parameter gather give the single
/// device's first-step bias and losses; without the update the bias stays 0 through AdamW (its
/// gradient is zero); a Qwen3-MoE or a LoRA run refuses the update by name.
#[test]
fn expert_bias_update_moves_the_correction_bias() -> Result<()> {
    let mut base = tiny_cfg(None, Layout::single(), 2, 2);
    base.steps = 2;
    let ModelSource::Init(m) = &base.model else { candle_core::bail!("init model expected") };
    let mut m = m.clone().with_moe(Some(crate::MoeConfig { mlp_only_layers: vec![0], ..crate::MoeConfig::glm4_moe(4, 2, 16, 1, 2.5) }));
    m.num_hidden_layers = 2;
    base.model = ModelSource::Init(m.clone());
    let bias = |dir: &std::path::Path, step: usize| -> Result<Vec<f32>> {
        let t = crate::hf::load_safetensors_dir(&dir.join(format!("checkpoints/step-{step:06}")), &candle_core::Device::Cpu)?;
        let b = t.get(&format!("model.layers.1.mlp.gate.{}", crate::params::CORRECTION_BIAS)).ok_or_else(|| candle_core::Error::Msg("no bias".into()))?;
        assert_eq!(b.dtype(), DType::F32);
        b.to_vec1::<f32>()
    };
    let rate = 0.01;
    let moved = |out: PathBuf, layout: Layout, zero: bool, recompute: bool, update: Option<f64>| -> Result<(Vec<TrainOutcome>, Vec<f32>, Vec<f32>)> {
        let mut c = TrainConfig { layout, out: Some(out.clone()), save_every: 1, expert_bias_update: update, ..base.clone() };
        (c.zero1, c.overlap_param_gather, c.recompute) = (zero, zero, recompute);
        let outs = run(&c)?;
        Ok((outs, bias(&out, 1)?, bias(&out, 2)?))
    };
    let (one, b1, b2) = moved(tmpdir("bias-one"), Layout::single(), false, false, Some(rate))?;
    let step = |prev: &[f32], counts: &[u64]| -> Vec<f32> {
        let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
        prev.iter().zip(counts).map(|(&b, &c)| b + (rate * if (c as f64) < mean { 1.0 } else if (c as f64) > mean { -1.0 } else { 0.0 }) as f32).collect()
    };
    let counts = |s: usize| -> Vec<u64> { one[0].metrics[s].expert_counts.as_ref().map(|c| c[0].clone()).unwrap_or_default() };
    assert_eq!(b1, step(&[0.0; 4], &counts(0)), "step 1 from 0, counts {:?}", counts(0));
    assert_eq!(b2, step(&b1, &counts(1)), "step 2, counts {:?}", counts(1));
    assert!(b1.iter().any(|&b| b != 0.0), "the routing was balanced at step 1 ({:?}): nothing moved", counts(0));
    for (layout, zero, recompute) in [(Layout::cp(CpKind::Ring, 2).with_dp(2), true, false), (Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_ep(2), false, true)] {
        let (outs, l1, _) = moved(tmpdir("bias-layout"), layout, zero, recompute, Some(rate))?;
        assert_eq!(l1, b1, "{layout}: the first step's bias");
        assert_same_curve(&format!("{layout} with the bias update"), &one[0].metrics.iter().collect::<Vec<_>>(), &outs[0].metrics);
    }
    let (_, f1, f2) = moved(tmpdir("bias-off"), Layout::cp(CpKind::Ring, 2).with_dp(2), true, false, None)?;
    assert_eq!((f1, f2), (vec![0.0; 4], vec![0.0; 4]), "without the update the bias stays as loaded");
    // a softmax router has no bias to move; a LoRA run's bias is frozen
    let qwen = TrainConfig { model: ModelSource::Init(m.clone().with_moe(Some(crate::MoeConfig::new(4, 2, 16))).with_qk_norm(true).with_partial_rotary_factor(1.0)), expert_bias_update: Some(rate), ..base.clone() };
    let e = run(&qwen).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("expert_bias_update") && e.contains("Qwen3MoeForCausalLM"), "{e}");
    let lora = TrainConfig { lora: Some(crate::LoraSpec::new(2, 4.0, &["q_proj"])?), expert_bias_update: Some(rate), ..base.clone() };
    let e = run(&lora).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("frozen base weight"), "{e}");
    Ok(())
}

/// A tiny DeepSeek-V3 (latent attention: q rank 16, KV rank 12, nope 6, RoPE 4, v 8; GLM-4.5's
/// experts, 4 in 2 groups, on its one layer) trains alike on every layout, all its weights and
/// then LoRA and DoRA with dropout 0.3 on every projection (the replicated down-projections'
/// masks keyed on the tokens each rank holds): zigzag 2 × TP 2 + SP with recomputed layers, EP 2 over zigzag 2
/// × DP 2 with ZeRO-1, EP 4 over ring 2 × DP 2, ring 2 × TP 2 + SP × EP 2 follow the one-device
/// run; the dropout changes the curve.
#[test]
fn deepseek_v3_trains_alike_on_every_layout() -> Result<()> {
    let mut c = tiny_cfg(None, Layout::single(), 2, 1);
    let ModelSource::Init(m) = &c.model else { candle_core::bail!("init model expected") };
    let mut moe = crate::MoeConfig::glm4_moe(4, 2, 16, 1, 2.5);
    moe.groups = (2, 1);
    let mla = crate::config::deepseek::Mla { q_lora_rank: Some(16), kv_lora_rank: 12, qk_nope_head_dim: 6, qk_rope_head_dim: 4, v_head_dim: 8, rope_interleave: true };
    c.model = ModelSource::Init(m.clone().with_moe(Some(moe)).with_mla(Some(mla)));
    let one = run(&c)?;
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    for (layout, recompute, zero1) in adapter_layouts() {
        let mut cl = c.clone();
        (cl.layout, cl.recompute, cl.zero1) = (layout, recompute, zero1);
        assert_same_curve(&format!("DeepSeek-V3 on {layout}"), &curve, &run(&cl)?[0].metrics);
    }
    // (then DoRA with dropout: the down-projections' (W' - W)·drop(x) on each rank's rows)
    for dora in [false, true] {
        c.lora = Some(crate::LoraSpec::new(4, 8.0, &crate::lora::ALL_LINEAR)?.with_dropout(0.3)?.with_dora(dora));
        let one = run(&c)?;
        let mut plain = c.clone();
        plain.lora = plain.lora.map(|l| l.with_dropout(0.0)).transpose()?;
        let without = run(&plain)?;
        assert!((one[0].metrics[0].grad_norm - without[0].metrics[0].grad_norm).abs() > 1e-6, "dropout changes the first step's gradients");
        let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
        for (layout, recompute, zero1) in adapter_layouts() {
            let mut cl = c.clone();
            (cl.layout, cl.recompute, cl.zero1) = (layout, recompute, zero1);
            assert_same_curve(&format!("DeepSeek-V3 LoRA (DoRA {dora}) with dropout on {layout}"), &curve, &run(&cl)?[0].metrics);
        }
    }
    Ok(())
}
