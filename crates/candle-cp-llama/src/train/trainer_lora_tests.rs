//! Trainer tests of LoRA fine-tuning: frozen base, adapters on layouts, PEFT checkpoints,
//! resume, refusals.
use super::tests::{assert_same_curve, run, tiny_cfg, tmpdir};
use super::*;
use crate::Layout;
use candle_core::DType;
use std::path::PathBuf;
use crate::CpKind;
use candle_cp_comm::run_ranks;
use candle_nn::VarMap;

fn lora_cfg(out: Option<PathBuf>, layout: Layout) -> Result<TrainConfig> {
    let mut c = tiny_cfg(out, layout, 2, 1);
    c.lora = Some(crate::LoraSpec::new(4, 8.0, &["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])?);
    Ok(c)
}

/// A LoRA run trains the adapters alone: the checkpoint's base weights are the initial ones
/// bit for bit, the adapters (a PEFT adapter beside them, `B` moved off zero) are all that the
/// optimizer holds state for; the loss falls. On zigzag 2 × DP 2 with ZeRO-1, on TP 2 + SP ×
/// ring 2 with recomputed layers, the overlapped gradient sync, ZeRO-2 and the overlapped
/// parameter gather, and on Ulysses 2 it follows the one-device run for 6 clipped steps and
/// writes the same adapters; stopped after step 4 on one layout it resumes on another on the
/// same curve. Resuming it without LoRA, or with another rank, is refused by name.
#[test]
fn lora_trains_the_adapters_alone_on_every_layout() -> Result<()> {
    let d1 = tmpdir("lora1");
    let c1 = lora_cfg(Some(d1.clone()), Layout::single())?;
    let one = run(&c1)?;
    let o = &one[0];
    let ModelSource::Init(base_cfg) = &c1.model else { candle_core::bail!("init model expected") };
    let initial = crate::params::varmap_tensors(&crate::init_params(base_cfg, c1.seed, DType::F32, &Device::Cpu)?)?;
    let ck = d1.join("checkpoints/step-000006");
    // the checkpoints hold the adapter only and name the base, written once into <out>/base
    let base_dir = std::path::absolute(d1.join("base"))?;
    assert_eq!(crate::lora::base_model_dir(&ck)?, base_dir);
    for c in ["step-000003", "step-000006"] {
        let c = d1.join("checkpoints").join(c);
        assert!(!c.join("model.safetensors").exists() && crate::lora::has_adapter(&c), "{}: the adapter alone", c.display());
    }
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).map_err(candle_core::Error::wrap);
    let base_file = base_dir.join("model.safetensors");
    let base_time = mtime(&base_file)?;
    assert!(base_time <= mtime(&d1.join("checkpoints/step-000003/adapter_model.safetensors"))?, "the base written once, before the first checkpoint");
    let saved = crate::params::varmap_tensors(&crate::load_hf(&base_dir, &Device::Cpu, DType::F32)?.0)?;
    assert_eq!(saved.len(), initial.len(), "the checkpoint's model is the base model");
    for (n, w) in &initial {
        let same = saved[n].flatten_all()?.to_vec1::<f32>()? == w.flatten_all()?.to_vec1::<f32>()?;
        assert!(same, "{n}: a frozen weight moved");
    }
    let (spec, adapters) = crate::lora::load_peft_adapter(&ck)?;
    assert_eq!(Some(&spec), c1.lora.as_ref());
    // 1 layer: q, k, v, o, gate, down adapted, A and B each
    assert_eq!(adapters.len(), 12);
    let b_moved = adapters.iter().filter(|(n, _)| n.ends_with("lora_B.weight")).all(|(_, t)| t.abs().and_then(|a| a.max_all()?.to_scalar::<f32>()).is_ok_and(|m| m > 0.0));
    assert!(b_moved, "every B trained off zero");
    assert!(o.trainable_params < o.n_params / 4, "{} of {} trainable", o.trainable_params, o.n_params);
    assert_eq!(o.optimizer_state_bytes, 8 * o.trainable_params, "f32 moments of the adapters only");
    let (first, last) = (o.metrics[0].loss, o.metrics[5].loss);
    assert!(last < first, "the loss falls: {first} → {last}");
    // the checkpoint as a model (base + adapter, load_adapter_sharded) gives the logits of
    // the merged weights W + s·B·A (merge_adapter)
    let ids = Tensor::new(&[[3u32, 9, 27, 1, 14, 5, 40, 2]], &Device::Cpu)?;
    let logits = run_ranks(1, |g| {
        let ctx = crate::ParallelCtx::new(g, Layout::single())?;
        let (vm, base) = crate::load_hf_sharded(crate::lora::base_model_dir(&ck)?, &ctx, &Device::Cpu, DType::F32)?;
        let Some(cfg) = crate::lora::load_adapter_sharded(&ck, &base, &vm, &ctx, DType::F32, &Device::Cpu)? else { candle_core::bail!("no adapter") };
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
        // merged: W + s·B·A for every adapted weight, no adapters
        let mut merged = saved.clone();
        assert_eq!(crate::lora::merge_adapter(&mut merged, &spec, &adapters)?, 6);
        let mvm = VarMap::new();
        for (n, t) in &merged {
            mvm.data().lock().map_err(|e| candle_core::Error::Msg(e.to_string()))?.insert(n.clone(), candle_core::Var::from_tensor(t)?);
        }
        let dense = Llama::new(VarBuilder::from_varmap(&mvm, DType::F32, &Device::Cpu), &base, &ctx)?;
        let pos = Tensor::arange(0u32, 8, &Device::Cpu)?;
        let (a, b) = (m.forward(&ids, &pos)?, dense.forward(&ids, &pos)?);
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    });
    for e in logits {
        let e = e?;
        assert!(e < 1e-5, "the loaded LoRA checkpoint's logits differ from the merged model's by {e}");
    }
    let curve: Vec<&StepMetrics> = o.metrics.iter().collect();
    // (layout, recompute + overlaps, ZeRO stage)
    let runs = [
        (Layout::cp(CpKind::Zigzag, 2).with_dp(2), false, 1),
        (Layout::cp(CpKind::Ring, 2).with_tp(2, true), true, 2),
        (Layout::cp(CpKind::Ulysses, 2), false, 0),
    ];
    for (i, (layout, overlap, zero)) in runs.into_iter().enumerate() {
        let d = tmpdir(&format!("lora-{i}"));
        let mut c = lora_cfg(Some(d.clone()), layout)?;
        (c.recompute, c.overlap_grad_sync) = (overlap, overlap);
        (c.zero1, c.zero2, c.overlap_param_gather) = (zero == 1, zero == 2, zero == 2 && overlap);
        let what = format!("{layout} zero {zero} overlap {overlap}");
        let other = run(&c)?;
        assert_same_curve(&what, &curve, &other[0].metrics);
        let (_, got) = crate::lora::load_peft_adapter(&d.join("checkpoints/step-000006"))?;
        for (n, w) in &adapters {
            let diff = (&got[n] - w)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{what}: {n} differs by {diff}");
        }
        std::fs::remove_dir_all(&d).ok();
    }
    // stopped after step 4 (checkpoint at 3) on zigzag 2 × DP 2, resumed on TP 2 + SP
    let tail: Vec<&StepMetrics> = o.metrics.iter().filter(|m| m.step > 3).collect();
    let d = tmpdir("lora-resume");
    let mut c = lora_cfg(Some(d.clone()), Layout::cp(CpKind::Zigzag, 2).with_dp(2))?;
    c.stop_after = Some(4);
    run(&c)?;
    (c.layout, c.resume, c.stop_after) = (Layout::single().with_tp(2, true), true, None);
    let base_time = mtime(&d.join("base/model.safetensors"))?;
    let rest = run(&c)?;
    assert_eq!(rest[0].start_step, 3);
    assert_same_curve("LoRA resumed on tp 2", &tail, &rest[0].metrics);
    assert_eq!(mtime(&d.join("base/model.safetensors"))?, base_time, "a resumed run keeps its checkpoint's base");
    assert_eq!(crate::lora::base_model_dir(&d.join("checkpoints/step-000006"))?, std::path::absolute(d.join("base"))?);
    // refusals: resumed without LoRA, or with another rank
    let mut plain = c.clone();
    plain.lora = None;
    let e = run(&plain).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("holds LoRA adapters"), "{e}");
    let mut other = c.clone();
    other.lora = Some(crate::LoraSpec::new(2, 8.0, &["q_proj"])?);
    let e = run(&other).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("LoRA adapters") && e.contains("this run asks for"), "{e}");
    std::fs::remove_dir_all(&d).ok();
    std::fs::remove_dir_all(&d1).ok();
    Ok(())
}

/// A LoRA run from a Hugging Face model names that model as its checkpoints' base and writes
/// no base of its own; one that changes the model's config (the sliding window) writes the
/// changed base into `<out>/base`. A run directory moved since it was written still finds its
/// base (`<out>/base` beside the checkpoints), and resumes from there on the same curve.
#[test]
fn lora_checkpoints_name_their_base_model() -> Result<()> {
    let hf = tmpdir("lora-hf-base");
    let c0 = lora_cfg(None, Layout::single())?;
    let ModelSource::Init(base_cfg) = &c0.model else { candle_core::bail!("init model expected") };
    crate::save_hf(&hf, &crate::init_params(base_cfg, c0.seed, DType::F32, &Device::Cpu)?, base_cfg)?;
    let d = tmpdir("lora-hf");
    let mut c = lora_cfg(Some(d.clone()), Layout::single())?;
    c.model = ModelSource::Hf(hf.clone());
    let whole = run(&c)?;
    let ck = d.join("checkpoints/step-000006");
    assert_eq!(crate::lora::base_model_dir(&ck)?, std::path::absolute(&hf)?, "the model the run started from");
    assert!(!d.join("base").exists(), "no base of its own");
    // a changed window: the base (with that window) written into <out>/base
    let dw = tmpdir("lora-hf-window");
    let mut cw = c.clone();
    (cw.out, cw.sliding_window, cw.steps, cw.save_every) = (Some(dw.clone()), Some(4), 1, 1);
    std::fs::write(hf.join("tokenizer_config.json"), "{}")?;
    run(&cw)?;
    let wbase = crate::lora::base_model_dir(&dw.join("checkpoints/step-000001"))?;
    assert_eq!(wbase, std::path::absolute(dw.join("base"))?);
    assert_eq!(crate::LlamaConfig::from_file(wbase.join("config.json"))?.sliding_window, Some(4));
    // (carrying the HF model's tokenizer files)
    assert_eq!(std::fs::read_to_string(wbase.join("tokenizer_config.json"))?, "{}");
    // drawn weights, then the run directory moved: the base found beside the checkpoints
    let (da, moved) = (tmpdir("lora-move"), tmpdir("lora-moved"));
    let mut ca = lora_cfg(Some(da.clone()), Layout::single())?;
    ca.stop_after = Some(4);
    run(&ca)?;
    std::fs::rename(&da, &moved)?;
    let mut cm = ca.clone();
    (cm.out, cm.resume, cm.stop_after) = (Some(moved.clone()), true, None);
    let ck3 = moved.join("checkpoints/step-000003");
    assert_eq!(crate::lora::base_model_dir(&ck3)?, ck3.join("../../base"));
    let rest = run(&cm)?;
    let straight = run(&lora_cfg(None, Layout::single())?)?;
    let tail: Vec<&StepMetrics> = straight[0].metrics.iter().filter(|m| m.step > 3).collect();
    assert_same_curve("moved and resumed", &tail, &rest[0].metrics);
    // the same curve from the HF model as from the drawn weights it holds
    let all: Vec<&StepMetrics> = straight[0].metrics.iter().collect();
    assert_same_curve("from the HF model", &all, &whole[0].metrics);
    for x in [&hf, &d, &dw, &moved] {
        std::fs::remove_dir_all(x).ok();
    }
    Ok(())
}

/// `lora_init`: the adapters start from a PEFT adapter directory (here a run's step-3
/// checkpoint; at learning rate 0 the run writes them back bit for bit, on TP 2 + SP where they
/// are split, while a run without it writes the drawn ones); an adapter of another rank, or
/// `lora_init` without `lora`, is refused by name.
#[test]
fn lora_starts_from_a_peft_adapter() -> Result<()> {
    let d = tmpdir("lora-init-src");
    let mut c = lora_cfg(Some(d.clone()), Layout::single())?;
    c.stop_after = Some(4);
    run(&c)?;
    let src = d.join("checkpoints/step-000003");
    let (_, want) = crate::lora::load_peft_adapter(&src)?;
    let still = |init: Option<PathBuf>, tag: &str| -> Result<HashMap<String, Tensor>> {
        let o = tmpdir(tag);
        let mut c = lora_cfg(Some(o.clone()), Layout::single().with_tp(2, true))?;
        c.schedule.peak = 0.0;
        (c.steps, c.save_every, c.lora_init) = (1, 1, init);
        run(&c)?;
        let got = crate::lora::load_peft_adapter(&o.join("checkpoints/step-000001"))?.1;
        std::fs::remove_dir_all(&o).ok();
        Ok(got)
    };
    let same = |a: &HashMap<String, Tensor>| -> Result<bool> {
        let mut all = a.len() == want.len();
        for (n, t) in a {
            all &= t.flatten_all()?.to_vec1::<f32>()? == want[n].flatten_all()?.to_vec1::<f32>()?;
        }
        Ok(all)
    };
    assert!(same(&still(Some(src.clone()), "lora-init")?)?, "the adapters started from the given ones");
    assert!(!same(&still(None, "lora-drawn")?)?, "without lora_init they are drawn");
    let mut other = lora_cfg(None, Layout::single())?;
    other.lora = Some(crate::LoraSpec::new(2, 8.0, &["q_proj"])?);
    other.lora_init = Some(src.clone());
    let e = run(&other).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("holds LoRA adapters") && e.contains("this run asks for"), "{e}");
    (other.lora, other.steps) = (None, 1);
    let e = run(&other).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("lora_init without lora"), "{e}");
    std::fs::remove_dir_all(&d).ok();
    Ok(())
}

/// `quantize_base`: a LoRA run over an NF4 base (quantized by each rank from its shards) on
/// TP 2 + SP × DP 2 with recompute follows the one-device run over the dequantized base step
/// by step and writes the same adapters; it holds the codes (`frozen_weight_bytes`: NF4's
/// bytes for the projections, the rest as loaded); a drawn base is written to `<out>/base` in
/// full precision before it is quantized. Without lora it is refused.
#[test]
fn lora_over_a_quantized_base_follows_the_dequantized_one() -> Result<()> {
    let q = candle_cp_nn::QuantConfig::new(candle_cp_nn::QuantKind::Nf4, 8)?;
    let c0 = lora_cfg(None, Layout::single())?;
    let ModelSource::Init(base_cfg) = &c0.model else { candle_core::bail!("init model expected") };
    let init = crate::init_params(base_cfg, c0.seed, DType::F32, &Device::Cpu)?;
    let deq = VarMap::new();
    for (n, t) in crate::params::varmap_tensors(&init)? {
        let t = if crate::quant::is_quantized_weight(&n) { candle_cp_nn::QuantWeight::quantize(&t, q)?.dequantize(DType::F32)? } else { t };
        crate::params::lock_vars(&deq)?.insert(n, candle_core::Var::from_tensor(&t)?);
    }
    let (hf, hfq) = (tmpdir("qlora-hf"), tmpdir("qlora-hfq"));
    crate::save_hf(&hf, &init, base_cfg)?;
    crate::save_hf(&hfq, &deq, base_cfg)?;
    let (da, db) = (tmpdir("qlora-a"), tmpdir("qlora-b"));
    let mut want_cfg = lora_cfg(Some(db.clone()), Layout::single())?;
    want_cfg.model = ModelSource::Hf(hfq.clone());
    let want = run(&want_cfg)?;
    let layout = Layout::single().with_tp(2, true).with_dp(2);
    let mut c = lora_cfg(Some(da.clone()), layout)?;
    (c.model, c.quantize_base, c.recompute) = (ModelSource::Hf(hf.clone()), Some(q), true);
    let got = run(&c)?;
    let curve: Vec<&StepMetrics> = want[0].metrics.iter().collect();
    assert_same_curve("NF4 base on tp 2 + sp × dp 2", &curve, &got[0].metrics);
    let (_, a) = crate::lora::load_peft_adapter(&da.join("checkpoints/step-000006"))?;
    let (_, b) = crate::lora::load_peft_adapter(&db.join("checkpoints/step-000006"))?;
    for (n, t) in &b {
        let diff = (&a[n] - t)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{n} differs by {diff}");
    }
    assert_eq!(crate::lora::base_model_dir(&da.join("checkpoints/step-000006"))?, std::path::absolute(&hf)?, "the full-precision model named");
    // the frozen bytes of rank 0: NF4 codes and scales of its projection shards, the rest f32
    let ctx_shapes = |s: &crate::ParamSpec| -> usize { s.shape.iter().product::<usize>() / if s.shard.copies(2) == 2 { 1 } else { 2 } };
    let mcfg = base_cfg.clone().with_lora(c.lora.clone());
    let expect: usize = crate::param_specs(&mcfg)
        .iter()
        .filter(|s| !s.is_lora())
        .map(|s| if crate::quant::is_quantized_weight(&s.name) { q.bytes(ctx_shapes(s)) } else { 4 * ctx_shapes(s) })
        .sum();
    assert_eq!(got[0].frozen_weight_bytes, expect);
    assert!(got[0].frozen_weight_bytes < want[0].frozen_weight_bytes / 2, "{} vs {}", got[0].frozen_weight_bytes, want[0].frozen_weight_bytes);
    // a drawn base: written in full precision into <out>/base, then quantized
    let dc = tmpdir("qlora-init");
    let mut ci = lora_cfg(Some(dc.clone()), Layout::single())?;
    (ci.quantize_base, ci.steps, ci.save_every) = (Some(q), 1, 1);
    run(&ci)?;
    let written = crate::params::varmap_tensors(&crate::load_hf(dc.join("base"), &Device::Cpu, DType::F32)?.0)?;
    for (n, t) in crate::params::varmap_tensors(&init)? {
        assert!(written[&n].flatten_all()?.to_vec1::<f32>()? == t.flatten_all()?.to_vec1::<f32>()?, "{n}: the base as drawn");
    }
    let mut plain = c0.clone();
    plain.lora = None;
    plain.quantize_base = Some(q);
    let e = run(&plain).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("quantize_base") && e.contains("set lora"), "{e}");
    for x in [&hf, &hfq, &da, &db, &dc] {
        std::fs::remove_dir_all(x).ok();
    }
    Ok(())
}

/// LoRA dropout 0.3 (the masks keyed on each token's index in the global batch and each
/// feature's in the layer's input): zigzag 2 × TP 2 + SP with recompute and ring 2 × DP 2 with
/// two micro-batches follow the one-device run step by step; the masks change the curve; the
/// checkpoint's adapter config records `lora_dropout`; the held-out loss is evaluated without
/// dropout (at learning rate 0 it equals the dropout-free run's).
#[test]
fn lora_dropout_is_the_same_on_every_layout() -> Result<()> {
    let d = tmpdir("lora-drop");
    let mut c = lora_cfg(Some(d.clone()), Layout::single())?;
    c.lora = c.lora.map(|l| l.with_dropout(0.3)).transpose()?;
    let one = run(&c)?;
    let mut plain = c.clone();
    (plain.out, plain.lora) = (None, plain.lora.map(|l| l.with_dropout(0.0)).transpose()?);
    let without = run(&plain)?;
    // (B starts at zero: step 1's loss is the base model's either way; the gradients differ)
    assert!((one[0].metrics[0].grad_norm - without[0].metrics[0].grad_norm).abs() > 1e-6, "dropout changes the first step's gradients");
    assert!((one[0].metrics[3].loss - without[0].metrics[3].loss).abs() > 1e-6, "dropout changes the curve");
    let (spec, _) = crate::lora::load_peft_adapter(&d.join("checkpoints/step-000006"))?;
    assert_eq!(spec.dropout, 0.3);
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    for (layout, recompute, accum) in [(Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true, 1), (Layout::cp(CpKind::Ring, 2).with_dp(2), false, 2)] {
        let mut cl = c.clone();
        (cl.out, cl.layout, cl.recompute) = (None, layout, recompute);
        if accum == 2 {
            // the same rows as one batch of 2: two micro-batches of 1 would be other masks' keys
            (cl.batch, cl.grad_accum) = (2, 1);
        }
        assert_same_curve(&format!("LoRA dropout on {layout}"), &curve, &run(&cl)?[0].metrics);
    }
    // evaluation runs without dropout: from the trained adapters (B off zero) at learning rate
    // 0, the held-out loss of a run with dropout is the dropout-free run's
    let mut e1 = c.clone();
    (e1.out, e1.steps, e1.lora_init) = (None, 1, Some(d.join("checkpoints/step-000006")));
    e1.schedule.peak = 0.0;
    e1.eval = Some(crate::train::EvalConfig { data: e1.data.clone(), every: 1, batches: 1 });
    let mut e0 = e1.clone();
    e0.lora = e0.lora.map(|l| l.with_dropout(0.0)).transpose()?;
    let (a, b) = (run(&e1)?[0].metrics[0].eval_loss, run(&e0)?[0].metrics[0].eval_loss);
    assert_eq!(a, b, "the held-out loss without dropout");
    assert!((run(&e1)?[0].metrics[0].loss - run(&e0)?[0].metrics[0].loss).abs() > 1e-6, "while the training loss has it");
    std::fs::remove_dir_all(&d).ok();
    Ok(())
}

/// DoRA (`use_dora`): a drawn run starts as the base model (`B` zero, each magnitude its row's
/// norm, so step 1's loss is plain LoRA's) and trains the magnitudes too (off the norms); the
/// checkpoint's PEFT file holds them (`….lora_magnitude_vector`, `use_dora` in its config);
/// zigzag 2 × TP 2 + SP with recomputed layers and ring 2 × DP 2 with ZeRO-1 follow the
/// one-device run; resumed from its checkpoint it continues the curve. Over an NF4 base the
/// magnitudes start at the dequantized rows' norms (step 1 = the QLoRA run's).
#[test]
fn dora_trains_magnitudes_alike_on_every_layout() -> Result<()> {
    let d = tmpdir("dora");
    let mut c = lora_cfg(Some(d.clone()), Layout::single())?;
    c.lora = c.lora.map(|l| l.with_dora(true));
    let one = run(&c)?;
    let mut plain = c.clone();
    (plain.out, plain.lora) = (None, plain.lora.map(|l| l.with_dora(false)));
    let lora = run(&plain)?;
    assert!((one[0].metrics[0].loss - lora[0].metrics[0].loss).abs() < 1e-6, "DoRA starts as the base model");
    assert!((one[0].metrics[5].loss - lora[0].metrics[5].loss).abs() > 1e-6, "and trains otherwise than LoRA");
    let ck = d.join("checkpoints/step-000006");
    let (spec, adapters) = crate::lora::load_peft_adapter(&ck)?;
    assert!(spec.dora && Some(&spec) == c.lora.as_ref());
    let ModelSource::Init(base_cfg) = &c.model else { candle_core::bail!("init model expected") };
    let init = crate::params::varmap_tensors(&crate::init_params(base_cfg, c.seed, DType::F32, &Device::Cpu)?)?;
    let mags: Vec<(&String, &Tensor)> = adapters.iter().filter(|(n, _)| n.ends_with(crate::lora::MAGNITUDE)).collect();
    assert_eq!(mags.len(), 6, "q, k, v, o, gate, down");
    for (n, m) in mags {
        let w = &init[&format!("{}.weight", &n[..n.len() - crate::lora::MAGNITUDE.len()])];
        let moved = (m - w.sqr()?.sum(1)?.sqrt()?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(moved > 1e-6, "{n}: the magnitude did not train");
    }
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    for (layout, recompute, zero1) in [(Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true, false), (Layout::cp(CpKind::Ring, 2).with_dp(2), false, true)] {
        let mut cl = c.clone();
        (cl.out, cl.layout, cl.recompute, cl.zero1) = (None, layout, recompute, zero1);
        assert_same_curve(&format!("DoRA on {layout}"), &curve, &run(&cl)?[0].metrics);
    }
    // stopped after step 4 (checkpoint at 3), resumed on TP 2: the same curve
    let dr = tmpdir("dora-resume");
    let mut cr = c.clone();
    (cr.out, cr.stop_after) = (Some(dr.clone()), Some(4));
    run(&cr)?;
    (cr.layout, cr.resume, cr.stop_after) = (Layout::single().with_tp(2, false), true, None);
    let resumed = run(&cr)?;
    assert_eq!(resumed[0].start_step, 3);
    assert_same_curve("DoRA resumed on tp 2", &curve[3..], &resumed[0].metrics);
    // over an NF4 base: step 1 is the QLoRA run's
    let q = candle_cp_nn::QuantConfig::new(candle_cp_nn::QuantKind::Nf4, 8)?;
    let (mut cq, mut pq) = (c.clone(), plain.clone());
    (cq.out, cq.steps, cq.quantize_base, pq.steps, pq.quantize_base) = (None, 1, Some(q), 1, Some(q));
    let (a, b) = (run(&cq)?[0].metrics[0].loss, run(&pq)?[0].metrics[0].loss);
    assert!((a - b).abs() < 1e-6, "QDoRA starts as the quantized base: {a} vs {b}");
    for x in [&d, &dr] {
        std::fs::remove_dir_all(x).ok();
    }
    Ok(())
}

/// DoRA with LoRA dropout 0.1 (PEFT's `W·x + (W' - W)·drop(x)`, candle_cp_nn::dora): the
/// dropout changes the first step's gradients and the curve; zigzag 2 × TP 2 + SP with
/// recomputed layers and ring 2 × DP 2 with ZeRO-1 follow the one-device run; the held-out loss
/// is DoRA's without dropout (at learning rate 0, the dropout-free run's).
#[test]
fn dora_with_dropout_is_the_same_on_every_layout() -> Result<()> {
    let d = tmpdir("dora-drop");
    let mut c = lora_cfg(Some(d.clone()), Layout::single())?;
    c.lora = c.lora.map(|l| l.with_dora(true).with_dropout(0.1)).transpose()?;
    let one = run(&c)?;
    c.out = None;
    let mut plain = c.clone();
    plain.lora = plain.lora.map(|l| l.with_dropout(0.0)).transpose()?;
    let without = run(&plain)?;
    assert!((one[0].metrics[0].loss - without[0].metrics[0].loss).abs() < 1e-6, "B = 0, m = ‖W‖: the base model either way");
    assert!((one[0].metrics[0].grad_norm - without[0].metrics[0].grad_norm).abs() > 1e-6, "dropout changes the first step's gradients");
    assert!((one[0].metrics[3].loss - without[0].metrics[3].loss).abs() > 1e-6, "dropout changes the curve");
    same_curve_with_dropout("DoRA with dropout", &c, &one[0].metrics)?;
    // from the trained adapters (B and m moved) at learning rate 0
    let (mut e1, mut e0) = (c.clone(), plain.clone());
    for e in [&mut e1, &mut e0] {
        (e.steps, e.schedule.peak, e.lora_init) = (1, 0.0, Some(d.join("checkpoints/step-000006")));
        e.eval = Some(crate::train::EvalConfig { data: e.data.clone(), every: 1, batches: 1 });
    }
    let (m1, m0) = (run(&e1)?[0].metrics[0].clone(), run(&e0)?[0].metrics[0].clone());
    assert_eq!(m1.eval_loss, m0.eval_loss, "the held-out loss without dropout");
    assert!((m1.loss - m0.loss).abs() > 1e-6, "while the training loss has it");
    std::fs::remove_dir_all(&d).ok();
    Ok(())
}

/// `modules_to_save`: the embedding and the head trained whole beside the adapters (PEFT's
/// option, e.g. for added tokens): both move, the other base weights do not; zigzag 2 × TP 2 +
/// SP (vocabulary-parallel) and ring 2 × DP 2 with ZeRO-1 over an NF4 base follow the one-device
/// runs; the checkpoint's PEFT file holds them, and the checkpoint as a model (base + adapter)
/// gives the trained model's loss; resumed on TP 2 it continues the curve.
#[test]
fn modules_to_save_train_whole_beside_the_adapters() -> Result<()> {
    let d = tmpdir("mts");
    let mut c = lora_cfg(Some(d.clone()), Layout::single())?;
    c.lora = c.lora.map(|l| l.with_modules_to_save(&["embed_tokens", "lm_head"])).transpose()?;
    let one = run(&c)?;
    let ck = d.join("checkpoints/step-000006");
    let (spec, adapters) = crate::lora::load_peft_adapter(&ck)?;
    assert_eq!(Some(&spec), c.lora.as_ref());
    let ModelSource::Init(base_cfg) = &c.model else { candle_core::bail!("init model expected") };
    let init = crate::params::varmap_tensors(&crate::init_params(base_cfg, c.seed, DType::F32, &Device::Cpu)?)?;
    for n in ["model.embed_tokens.weight", "lm_head.weight"] {
        let moved = (&adapters[n] - &init[n])?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(moved > 1e-6, "{n} did not train");
    }
    let base = crate::params::varmap_tensors(&crate::load_hf(crate::lora::base_model_dir(&ck)?, &Device::Cpu, DType::F32)?.0)?;
    assert!(base["lm_head.weight"].flatten_all()?.to_vec1::<f32>()? == init["lm_head.weight"].flatten_all()?.to_vec1::<f32>()?, "the base's head is the initial one");
    assert!(one[0].trainable_params > (init["lm_head.weight"].elem_count() + init["model.embed_tokens.weight"].elem_count()));
    let curve: Vec<&StepMetrics> = one[0].metrics.iter().collect();
    let mut cl = c.clone();
    (cl.out, cl.layout, cl.recompute) = (None, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true);
    assert_same_curve("modules_to_save on zigzag 2 x tp 2 + sp", &curve, &run(&cl)?[0].metrics);
    // over an NF4 base: the one-device QLoRA run's curve on ring 2 × DP 2 with ZeRO-1
    let q = candle_cp_nn::QuantConfig::new(candle_cp_nn::QuantKind::Nf4, 8)?;
    let mut q1 = c.clone();
    (q1.out, q1.quantize_base) = (None, Some(q));
    let qone = run(&q1)?;
    let mut q2 = q1.clone();
    (q2.layout, q2.zero1) = (Layout::cp(CpKind::Ring, 2).with_dp(2), true);
    assert_same_curve("modules_to_save over NF4 on ring 2 x dp 2", &qone[0].metrics.iter().collect::<Vec<_>>(), &run(&q2)?[0].metrics);
    // stopped after step 4, resumed on TP 2
    let dr = tmpdir("mts-resume");
    let mut cr = c.clone();
    (cr.out, cr.stop_after) = (Some(dr.clone()), Some(4));
    run(&cr)?;
    (cr.layout, cr.resume, cr.stop_after) = (Layout::single().with_tp(2, false), true, None);
    assert_same_curve("modules_to_save resumed on tp 2", &curve[3..], &run(&cr)?[0].metrics);
    for x in [&d, &dr] {
        std::fs::remove_dir_all(x).ok();
    }
    Ok(())
}

/// A Phi-3 (LongRoPE acting at this length: original 32 of 64 tokens) with DoRA and dropout on
/// all of its linear layers — PEFT's `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`, one `A`
/// and one dropout mask per fused module: zigzag 2 × TP 2 + SP recomputed (its one KV head
/// replicated) and ring 2 × DP 2 with ZeRO-1 follow the one-device curve; the checkpoints hold
/// PEFT's fused adapter tensors, the base written once with its fused weights.
#[test]
fn phi3_dora_with_dropout_on_the_fused_modules_is_the_same_on_every_layout() -> Result<()> {
    let d = tmpdir("phi3-dora");
    let mut c = tiny_cfg(Some(d.clone()), Layout::single(), 2, 1);
    let ModelSource::Init(m) = &c.model else { candle_core::bail!("init model expected") };
    let mut m = m.clone().with_phi3(true);
    m.max_position_embeddings = 512;
    m.rope_scaling = crate::RopeScaling::LongRope {
        short_factor: vec![1.0; m.head_dim / 2],
        long_factor: (0..m.head_dim / 2).map(|i| 1.0 + 2.0 * i as f64).collect(),
        original_max_position_embeddings: 32,
        factor: 16.0,
        attention_factor: None,
    };
    c.model = ModelSource::Init(m);
    c.lora = Some(crate::LoraSpec::new(4, 8.0, &crate::lora::TARGETS)?.with_dora(true).with_dropout(0.1)?);
    let one = run(&c)?;
    let ck = d.join("checkpoints/step-000006");
    let (saved, tensors) = crate::lora::load_peft_adapter(&ck)?;
    assert_eq!(saved.targets, ["o_proj", "down_proj", "qkv_proj", "gate_up_proj"]);
    for n in ["self_attn.qkv_proj.lora_A.weight", "self_attn.qkv_proj.lora_B.weight", "mlp.gate_up_proj.lora_magnitude_vector"] {
        assert!(tensors.contains_key(&format!("model.layers.0.{n}")), "{n}: {:?}", tensors.keys());
    }
    assert!(!tensors.keys().any(|k| k.contains(".q_proj.") || k.contains(".up_proj.")), "{:?}", tensors.keys());
    let base = crate::hf::load_safetensors_dir(&crate::lora::base_model_dir(&ck)?, &Device::Cpu)?;
    assert!(base.contains_key("model.layers.0.self_attn.qkv_proj.weight") && !base.contains_key("model.layers.0.self_attn.q_proj.weight"));
    c.out = None;
    same_curve_with_dropout("Phi-3 DoRA with dropout", &c, &one[0].metrics)
}

/// Run `c` (adapters with dropout) on zigzag 2 × TP 2 + SP with recomputed layers and on ring 2
/// × DP 2 with ZeRO-1: each follows `curve`, the one-device run's.
fn same_curve_with_dropout(what: &str, c: &TrainConfig, curve: &[StepMetrics]) -> Result<()> {
    let curve: Vec<&StepMetrics> = curve.iter().collect();
    for (layout, recompute, zero1) in [(Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), true, false), (Layout::cp(CpKind::Ring, 2).with_dp(2), false, true)] {
        let mut cl = c.clone();
        (cl.layout, cl.recompute, cl.zero1) = (layout, recompute, zero1);
        if layout.dp == 2 {
            // the same rows as one batch of 2 (two micro-batches of 1 would key other masks)
            (cl.batch, cl.grad_accum) = (2, 1);
        }
        assert_same_curve(&format!("{what} on {layout}"), &curve, &run(&cl)?[0].metrics);
    }
    Ok(())
}
