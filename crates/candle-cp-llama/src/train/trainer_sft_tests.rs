//! Trainer tests of prompt / completion fine-tuning ([`crate::train::sft`]) and of the files a
//! full checkpoint carries beside its weights ([`crate::hf_files`]).
use super::tests::{assert_same_curve, run, tiny_cfg, tmpdir};
use super::*;
use crate::{init_params, shard_params, CpKind, Layout, LlamaConfig};
use candle_core::DType;
use candle_cp_comm::run_ranks;
use candle_nn::VarBuilder;

/// Byte-level examples: a prompt of 3..12 letters `a..p`, its completion the same letters
/// shifted to `A..P` and reversed, then EOS (2).
fn sft_stream() -> Result<crate::train::PackedStream> {
    let mut rng = crate::train::Rng::new(23);
    let mut lines = String::new();
    for _ in 0..40 {
        let p: String = (0..3 + rng.below(10)).map(|_| (b'a' + rng.below(16) as u8) as char).collect();
        let c: String = p.chars().rev().map(|x| x.to_ascii_uppercase()).collect();
        lines.push_str(&format!("{{\"prompt\": \"{p}\", \"completion\": \"{c}\"}}\n"));
    }
    crate::train::sft::sft_stream(&lines, &crate::train::sft::bytes_of, Some(2), None)
}

/// Byte-level conversations in ChatML: a system turn, then two exchanges of a user's digits
/// and the assistant's letters `A..P`.
fn chat_stream() -> Result<crate::train::PackedStream> {
    let mut rng = crate::train::Rng::new(29);
    let mut lines = String::new();
    let mut turn = |role: &str, first: u8| {
        let text: String = (0..2 + rng.below(6)).map(|_| (first + rng.below(if first == b'0' { 10 } else { 16 }) as u8) as char).collect();
        format!("{{\"role\": \"{role}\", \"content\": \"{text}\"}}")
    };
    for _ in 0..30 {
        let m = [turn("system", b'0'), turn("user", b'0'), turn("assistant", b'A'), turn("user", b'0'), turn("assistant", b'A')];
        lines.push_str(&format!("{{\"messages\": [{}]}}\n", m.join(", ")));
    }
    crate::train::sft::sft_stream(&lines, &crate::train::sft::bytes_of, None, Some(crate::chat::ChatTemplate::ChatMl))
}

/// A prompt / completion run trains on the completion tokens alone: step 1's objective is
/// the mean cross-entropy of exactly the completions' targets (the last prompt token
/// predicting the first completion token, and so on to the EOS) under the initial weights,
/// computed by hand, and differs from the all-target loss; the run is the same on zigzag
/// CP 2, ring CP 2 × DP 2 and TP 2 + SP as on one device.
#[test]
fn completion_only_loss_on_every_layout() -> Result<()> {
    let completion = |t: u32| t == 2 || (65..=80).contains(&t);
    marked_loss_on_layouts(sft_stream()?, &completion, &[Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::single().with_tp(2, true)])
}

/// A conversation run trains on the assistant turns alone (their letters and the
/// `<|im_end|>` closing each; never the digits of the system and user turns): step 1's
/// objective by hand as above, the same run on zigzag CP 2 and Ulysses 2 as on one device.
#[test]
fn assistant_only_loss_on_cp_layouts() -> Result<()> {
    let assistant = |t: u32| (65..=80).contains(&t) || b"<|im_end>".contains(&(t as u8));
    marked_loss_on_layouts(chat_stream()?, &assistant, &[Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ulysses, 2)])
}

/// Step 1's objective over `stream`'s marked targets (each marked token satisfying
/// `marked_kind`) equals the mean cross-entropy of those targets by hand; the run on each of
/// `layouts` matches the single-device one.
fn marked_loss_on_layouts(stream: crate::train::PackedStream, marked_kind: &(dyn Fn(u32) -> bool + Sync), layouts: &[Layout]) -> Result<()> {
    let mut c1 = tiny_cfg(None, Layout::single(), 2, 1);
    (c1.data, c1.model, c1.steps, c1.long_range_only) = (DataSource::Packed(stream), ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1)), 3, true);
    let (ids, mask, docs) = global_batch(&c1, 0, 0, &Device::Cpu)?;
    let docs = docs.expect("packed rows carry documents");
    let one = run(&c1)?;
    let ModelSource::Init(mcfg) = &c1.model else { bail!("init model") };
    let by_hand = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_params(&init_params(mcfg, c1.seed, DType::F32, &Device::Cpu)?, mcfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), mcfg, &ctx)?;
        let p = crate::packed::shard_batch_packed(&ids, &docs, &ctx)?;
        let nll: Vec<f32> = m.token_nll_packed(&p.input_ids, &p.labels, &p.positions, &p.documents)?.flatten_all()?.to_vec1()?;
        let (labels, ids_h, marks): (Vec<u32>, Vec<u32>, Vec<u32>) = (p.labels.flatten_all()?.to_vec1()?, ids.flatten_all()?.to_vec1()?, mask.flatten_all()?.to_vec1()?);
        // target i is token i + 1 of the row: counted when that token is marked (a
        // completion's or an assistant turn's) and the label is not cut at a document's end
        let t = ids.dim(1)?;
        let picked: Vec<f64> = (0..labels.len())
            .filter(|&i| i % t + 1 < t && labels[i] != crate::IGNORE && marks[i + 1] == 1)
            .map(|i| {
                assert!(marked_kind(ids_h[i + 1]), "token {} marked", ids_h[i + 1]);
                nll[i] as f64
            })
            .collect();
        let all: Vec<f64> = (0..labels.len()).filter(|&i| labels[i] != crate::IGNORE).map(|i| nll[i] as f64).collect();
        Ok((picked.iter().sum::<f64>() / picked.len() as f64, all.iter().sum::<f64>() / all.len() as f64, picked.len()))
    });
    let (completion, all, n) = by_hand.into_iter().next().expect("one rank")?;
    let m0 = &one[0].metrics[0];
    assert!(n > 20, "{n} completion targets");
    assert!((m0.train_loss - completion).abs() < 2e-6, "objective {} vs the completions' {completion}", m0.train_loss);
    assert!((m0.loss - all).abs() < 2e-6, "all-target loss {} vs {all}", m0.loss);
    assert!((completion - all).abs() > 1e-4, "completion {completion} vs all {all}: no selection");
    assert!(m0.long_range_loss.is_some_and(|x| (x - m0.train_loss).abs() < 1e-6));
    for &layout in layouts {
        let mut c = c1.clone();
        c.layout = layout;
        let other = run(&c)?;
        assert_same_curve(&layout.to_string(), &one[0].metrics.iter().collect::<Vec<_>>(), &other[0].metrics);
    }
    Ok(())
}

/// A full fine-tune from a Hugging Face model writes checkpoints that carry the model's
/// tokenizer, generation defaults and special token ids (`pad_token_id` too, which the model's
/// config does not hold; and a run resumed from one of them carries them on), so a checkpoint
/// loads in transformers as the model did; the run's own tokenizer goes beside the weights of
/// a run from random weights, not over the model's.
#[test]
fn full_checkpoints_carry_the_models_files() -> Result<()> {
    let c0 = tiny_cfg(None, Layout::cp(CpKind::Ring, 2), 1, 1);
    let ModelSource::Init(mcfg) = &c0.model else { candle_core::bail!("init model expected") };
    let hf = tmpdir("carry-hf");
    crate::save_hf(&hf, &init_params(mcfg, c0.seed, DType::F32, &candle_core::Device::Cpu)?, mcfg)?;
    std::fs::write(hf.join("tokenizer.json"), "{\"model\": {}}")?;
    std::fs::write(hf.join("generation_config.json"), "{\"eos_token_id\": 5}")?;
    let mut hcfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(hf.join("config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    (hcfg["bos_token_id"], hcfg["eos_token_id"], hcfg["pad_token_id"]) = (4.into(), 5.into(), 6.into());
    std::fs::write(hf.join("config.json"), hcfg.to_string())?;
    // (a --tokenizer of the run's own: the model's wins where it has one)
    let tok = hf.join("run-tokenizer.json");
    std::fs::write(&tok, "{\"run\": 1}")?;
    let d = tmpdir("carry-run");
    let mut c = tiny_cfg(Some(d.clone()), Layout::cp(CpKind::Ring, 2), 1, 1);
    (c.model, c.stop_after, c.tokenizer) = (ModelSource::Hf(hf.clone()), Some(3), Some(tok.clone()));
    run(&c)?;
    (c.stop_after, c.resume) = (None, true);
    run(&c)?;
    for step in ["step-000003", "step-000006"] {
        let ck = d.join("checkpoints").join(step);
        assert_eq!(std::fs::read_to_string(ck.join("tokenizer.json"))?, "{\"model\": {}}", "{step}");
        assert_eq!(std::fs::read_to_string(ck.join("generation_config.json"))?, "{\"eos_token_id\": 5}", "{step}");
        let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ck.join("config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        assert_eq!((cfg["bos_token_id"].as_u64(), cfg["eos_token_id"].as_u64(), cfg["pad_token_id"].as_u64()), (Some(4), Some(5), Some(6)), "{step}");
        // (and it still reads as the model's config)
        let want = LlamaConfig { bos_token_id: Some(4.into()), eos_token_id: Some(5.into()), ..mcfg.clone() };
        assert_eq!(LlamaConfig::from_file(ck.join("config.json"))?, want);
    }
    // from random weights: the run's tokenizer beside the weights
    let dr = tmpdir("carry-init");
    let mut ci = tiny_cfg(Some(dr.clone()), Layout::single(), 1, 1);
    (ci.steps, ci.save_every, ci.tokenizer) = (1, 1, Some(tok));
    run(&ci)?;
    assert_eq!(std::fs::read_to_string(dr.join("checkpoints/step-000001/tokenizer.json"))?, "{\"run\": 1}");
    for x in [&hf, &d, &dr] {
        std::fs::remove_dir_all(x).ok();
    }
    Ok(())
}
