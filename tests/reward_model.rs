//! Reward models (`candle_cp_llama::reward`): transformers' `LlamaForSequenceClassification`
//! on every layout, against the float64 oracle. A sequence classifier whose score head is one
//! row `k` of the oracle's LM head scores every token with the oracle's logit `k` (transformers
//! reads it at the last token): checked at every token on one device, zigzag CP 2 × TP 2 + SP,
//! ring CP 4 and Ulysses 2 (logits' tolerance, abs 1e-5). A causal LM loads as a reward model
//! with a drawn score head, the same on every rank; each kind of model refuses the other's use.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::load_reference;
use candle_cp_llama::{hf::load_safetensors_dir, load_hf_sharded, load_hf_sharded_reward, save_hf_tensors, shard_batch, Llama, LlamaConfig, ParallelCtx};
use candle_nn::VarBuilder;

const ROW: usize = 7;

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("cp-reward-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// This rank's scores `[Ts]` of the oracle's input and the global positions they belong to.
fn rank_scores(g: candle_cp_comm::Group, layout: Layout, dir: &std::path::Path, ids: &Tensor) -> Result<(Vec<f32>, Vec<u32>)> {
    let ctx = ParallelCtx::new(g, layout)?;
    let (vm, cfg) = load_hf_sharded(dir, &ctx, &Device::Cpu, DType::F32)?;
    assert_eq!(cfg.num_labels, Some(1));
    let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
    let sb = shard_batch(ids, &ctx)?;
    let s = model.scores(&sb.input_ids, &sb.positions)?;
    assert_eq!(s.dims(), [1, sb.input_ids.dim(1)?, 1]);
    // a reward model predicts no token
    let e = model.forward(&sb.input_ids, &sb.positions).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("LlamaForSequenceClassification") && e.contains("no LM head"), "{e}");
    Ok((s.flatten_all()?.to_vec1()?, sb.positions.to_vec1()?))
}

#[test]
fn sequence_classifier_scores_are_the_oracle_logits_on_every_layout() -> Result<()> {
    let oracle = candle_cp_tests::oracle_dir("tiny-llama");
    let reference = load_reference(oracle.join("reference.safetensors"))?;
    let want: Vec<f32> = reference.logits.i((0, .., ROW))?.to_vec1()?;
    // the oracle as a sequence classifier: its LM head's row ROW as the score head
    let cfg = LlamaConfig::from_file(oracle.join("config.json"))?.with_num_labels(Some(1));
    let mut tensors: Vec<(String, Tensor)> = load_safetensors_dir(&oracle, &Device::Cpu)?.into_iter().collect();
    let head = tensors.iter().find(|(n, _)| n == "lm_head.weight").map(|(_, t)| t.narrow(0, ROW, 1)).transpose()?.expect("lm_head");
    tensors.retain(|(n, _)| n != "lm_head.weight");
    tensors.push(("score.weight".into(), head));
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let dir = tmpdir("oracle");
    save_hf_tensors(&dir, &tensors, &cfg)?;
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!((json["architectures"][0].as_str(), json["id2label"]["0"].as_str()), (Some("LlamaForSequenceClassification"), Some("LABEL_0")));
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Layout::cp(CpKind::Ring, 4), Layout::cp(CpKind::Ulysses, 2)] {
        let mut seen = vec![false; want.len()];
        for r in run_ranks(layout.world_size(), |g| rank_scores(g, layout, &dir, &reference.input_ids)) {
            let (s, pos) = r?;
            for (x, &p) in s.iter().zip(&pos) {
                let w = want[p as usize];
                assert!((x - w).abs() < 1e-5, "{layout}: position {p}: score {x} vs the oracle's logit {w}");
                seen[p as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "{layout}: every position scored");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A causal LM read as a reward model: a drawn score head (the same on every rank of a layout,
/// from the seed), the LM head not read; a causal LM has no scores; labels must agree.
#[test]
fn causal_lm_loads_as_a_reward_model() -> Result<()> {
    let oracle = candle_cp_tests::oracle_dir("tiny-llama");
    let layout = Layout::single().with_tp(2, false);
    let heads = run_ranks(2, |g| -> Result<(Tensor, Vec<f32>)> {
        let ctx = ParallelCtx::new(g, layout)?;
        let (vm, cfg) = load_hf_sharded_reward(&oracle, 1, 5, &ctx, &Device::Cpu, DType::F32)?;
        assert_eq!(cfg.num_labels, Some(1));
        let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
        let ids = Tensor::new(&[[3u32, 9, 27, 81, 243, 217]], &Device::Cpu)?;
        let sb = shard_batch(&ids, &ctx)?;
        let s = model.scores(&sb.input_ids, &sb.positions)?.flatten_all()?.to_vec1()?;
        let head = vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?["score.weight"].as_tensor().clone();
        Ok((head, s))
    });
    let (a, b) = (heads[0].as_ref().map_err(|e| candle_core::Error::Msg(e.to_string()))?, heads[1].as_ref().map_err(|e| candle_core::Error::Msg(e.to_string()))?);
    assert_eq!(a.0.dims(), [1, 128]);
    assert_eq!(a.0.to_vec2::<f32>()?, b.0.to_vec2::<f32>()?, "the score head is the same on every rank");
    assert_eq!(a.1, b.1, "TP ranks without SP score the same tokens alike");
    let std = (a.0.sqr()?.mean_all()?.to_scalar::<f32>()?).sqrt();
    assert!((0.01..0.03).contains(&std), "drawn N(0, 0.02²): std {std}");
    // a causal LM has no score head; labels must match a sequence classifier's
    let dir = tmpdir("labels");
    std::fs::create_dir_all(&dir)?;
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(oracle.join("config.json"))?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    json["architectures"] = serde_json::json!(["LlamaForSequenceClassification"]);
    json["num_labels"] = serde_json::json!(3);
    std::fs::write(dir.join("config.json"), json.to_string())?;
    std::fs::copy(oracle.join("model.safetensors"), dir.join("model.safetensors"))?;
    for r in run_ranks(1, |g| -> Result<()> {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        let (vm, cfg) = load_hf_sharded(&oracle, &ctx, &Device::Cpu, DType::F32)?;
        let lm = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
        let ids = Tensor::new(&[[1u32, 2]], &Device::Cpu)?;
        let e = lm.scores(&ids, &Tensor::new(&[0u32, 1], &Device::Cpu)?).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("no score head"), "{e}");
        let e = load_hf_sharded_reward(&dir, 1, 0, &ctx, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("3 label(s), not 1"), "{e}");
        // (a sequence classifier's checkpoint that holds an LM head and no score head: named)
        let e = load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("lm_head.weight"), "{e}");
        Ok(())
    }) {
        r?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
