//! Process reward models (`candle_cp_llama::prm`): transformers' `LlamaForTokenClassification`
//! on every layout, against the float64 oracle. A token classifier whose score head is rows
//! 7 and 11 of the oracle's LM head, with a bias, scores every token with those two oracle
//! logits plus the bias: checked at every token on one device, zigzag CP 2 × TP 2 + SP, ring
//! CP 4, Ulysses 2 and ring CP 2 × DP 2 (logits' tolerance, abs 1e-5). A causal LM loads as a
//! token classifier with a drawn head (bias 0, the same on every rank); the kinds of
//! classifier refuse each other's loaders.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::{local_token_indices, CpKind, Layout};
use candle_cp_llama::prm::{load_hf_sharded_token_classifier, TokenClassifier};
use candle_cp_llama::verify::load_reference;
use candle_cp_llama::{hf::load_safetensors_dir, load_hf_sharded, load_hf_sharded_reward, save_hf_tensors, shard_batch_packed, Documents, Llama, LlamaConfig, ParallelCtx};
use candle_nn::VarBuilder;

const ROWS: [usize; 2] = [7, 11];
const BIAS: [f32; 2] = [0.5, -0.25];

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("cp-token-cls-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn json(p: &std::path::Path) -> Result<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(p)?).map_err(|e| candle_core::Error::Msg(e.to_string()))
}

/// This rank's scores `[Ts·2]` of `ids` (`[B, T]`, one document a row) and the global token
/// index of each.
fn rank_scores(g: candle_cp_comm::Group, layout: Layout, dir: &std::path::Path, ids: &Tensor) -> Result<(Vec<f32>, Vec<u64>)> {
    let ctx = ParallelCtx::new(g, layout)?;
    let (vm, cfg) = load_hf_sharded(dir, &ctx, &Device::Cpu, DType::F32)?;
    assert_eq!((cfg.num_labels, cfg.token_classifier.map(|t| t.dropout)), (Some(2), Some(0.1)));
    let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
    let (b, t) = ids.dims2()?;
    let docs = vec![Documents::single(t)?; b];
    let sb = shard_batch_packed(ids, &docs, &ctx)?;
    let s = model.token_scores_packed(&sb.input_ids, &sb.positions, &sb.documents, None)?;
    assert_eq!(s.dims(), [b / layout.dp, sb.input_ids.dim(1)?, 2]);
    // a token classifier predicts no token, nor scores a sequence
    let e = model.forward(&sb.input_ids, &sb.positions.i(0)?).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("LlamaForTokenClassification") && e.contains("no LM head"), "{e}");
    Ok((s.flatten_all()?.to_vec1()?, local_token_indices(b, t, &ctx)?))
}

#[test]
fn token_classifier_scores_are_the_oracle_logits_plus_bias_on_every_layout() -> Result<()> {
    let oracle = candle_cp_tests::oracle_dir("tiny-llama");
    let reference = load_reference(oracle.join("reference.safetensors"))?;
    let t = reference.input_ids.dim(1)?;
    // two rows (the oracle's sequence twice) so that DP splits them
    let ids = Tensor::cat(&[&reference.input_ids, &reference.input_ids], 0)?;
    let want: Vec<Vec<f32>> = ROWS.iter().map(|&r| reference.logits.i((0, .., r))?.to_vec1()).collect::<Result<_>>()?;
    let cfg = LlamaConfig::from_file(oracle.join("config.json"))?.with_num_labels(Some(2)).with_token_classifier(Some(TokenClassifier::new(0.1)?));
    let mut tensors: Vec<(String, Tensor)> = load_safetensors_dir(&oracle, &Device::Cpu)?.into_iter().collect();
    let lm = tensors.iter().find(|(n, _)| n == "lm_head.weight").map(|(_, w)| w.clone()).expect("lm_head");
    let head = Tensor::cat(&[lm.narrow(0, ROWS[0], 1)?, lm.narrow(0, ROWS[1], 1)?], 0)?;
    tensors.retain(|(n, _)| n != "lm_head.weight");
    tensors.push(("score.weight".into(), head));
    tensors.push(("score.bias".into(), Tensor::new(&BIAS, &Device::Cpu)?.to_dtype(lm.dtype())?));
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let dir = tmpdir("oracle");
    save_hf_tensors(&dir, &tensors, &cfg)?;
    let j = json(&dir.join("config.json"))?;
    assert_eq!((j["architectures"][0].as_str(), j["classifier_dropout"].as_f64(), j["id2label"]["1"].as_str()), (Some("LlamaForTokenClassification"), Some(0.1), Some("LABEL_1")));
    let layouts = [Layout::single(), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Layout::cp(CpKind::Ring, 4), Layout::cp(CpKind::Ulysses, 2), Layout::cp(CpKind::Ring, 2).with_dp(2)];
    for layout in layouts {
        let mut seen = vec![false; 2 * t];
        for r in run_ranks(layout.world_size(), |g| rank_scores(g, layout, &dir, &ids)) {
            let (s, idx) = r?;
            for (x, &i) in s.chunks(2).zip(&idx) {
                let p = i as usize % t;
                for k in 0..2 {
                    let w = want[k][p] + BIAS[k];
                    assert!((x[k] - w).abs() < 1e-5, "{layout}: token {i}, label {k}: {} vs the oracle's logit + bias {w}", x[k]);
                }
                seen[i as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "{layout}: every token scored");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A causal LM read as a token classifier: a drawn head (weight N(0, 0.02²), bias 0, the same on
/// every rank of a layout), the LM head not read, the dropout as asked (else transformers'
/// 0.1); a sequence classifier is not a token classifier, nor the other way round.
#[test]
fn causal_lm_loads_as_a_token_classifier() -> Result<()> {
    let oracle = candle_cp_tests::oracle_dir("tiny-llama");
    let layout = Layout::single().with_tp(2, false);
    let heads = run_ranks(2, |g| -> Result<(Vec<Vec<f32>>, Vec<f32>, f64)> {
        let ctx = ParallelCtx::new(g, layout)?;
        let (vm, cfg) = load_hf_sharded_token_classifier(&oracle, 2, Some(TokenClassifier::new(0.25)?), 5, &ctx, &Device::Cpu, DType::F32)?;
        let data = vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?;
        let (w, b) = (data["score.weight"].as_tensor().to_vec2()?, data["score.bias"].as_tensor().to_vec1()?);
        Ok((w, b, cfg.token_classifier.map_or(-1.0, |t| t.dropout)))
    });
    let (a, b) = (heads[0].as_ref().map_err(|e| candle_core::Error::Msg(e.to_string()))?, heads[1].as_ref().map_err(|e| candle_core::Error::Msg(e.to_string()))?);
    assert_eq!((a.0.len(), a.0[0].len(), a.2), (2, 128, 0.25));
    assert_eq!(a.0, b.0, "the score head is the same on every rank");
    assert_eq!((a.1.clone(), b.1.clone()), (vec![0.0; 2], vec![0.0; 2]), "the bias starts at zero");
    let std = (a.0.iter().flatten().map(|x| x * x).sum::<f32>() / 256.0).sqrt();
    assert!((0.01..0.03).contains(&std), "drawn N(0, 0.02²): std {std}");
    for r in run_ranks(1, |g| -> Result<()> {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        let (_, cfg) = load_hf_sharded_token_classifier(&oracle, 2, None, 5, &ctx, &Device::Cpu, DType::F32)?;
        assert_eq!(cfg.token_classifier, Some(TokenClassifier { dropout: 0.1, bias: true }));
        // a sequence classifier and a token classifier refuse each other's loader
        let (vm, seq) = load_hf_sharded_reward(&oracle, 1, 5, &ctx, &Device::Cpu, DType::F32)?;
        let dir = tmpdir("seq");
        candle_cp_llama::save_hf(&dir, &vm, &seq)?;
        let e = load_hf_sharded_token_classifier(&dir, 1, None, 5, &ctx, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("a sequence classifier (LlamaForSequenceClassification"), "{e}");
        let (vm, tok) = load_hf_sharded_token_classifier(&oracle, 2, None, 5, &ctx, &Device::Cpu, DType::F32)?;
        let dir2 = tmpdir("tok");
        candle_cp_llama::save_hf(&dir2, &vm, &tok)?;
        let e = load_hf_sharded_reward(&dir2, 2, 5, &ctx, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("a token classifier (LlamaForTokenClassification)"), "{e}");
        let e = load_hf_sharded_token_classifier(&dir2, 3, None, 5, &ctx, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("2 label(s), not 3"), "{e}");
        // (read back: the same head)
        let (back, c) = load_hf_sharded(&dir2, &ctx, &Device::Cpu, DType::F32)?;
        assert_eq!(c.hf_class(), "LlamaForTokenClassification");
        let w = |vm: &candle_nn::VarMap| -> Result<Vec<Vec<f32>>> { vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?["score.weight"].as_tensor().to_vec2() };
        assert_eq!(w(&back)?, w(&vm)?);
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&dir2);
        Ok(())
    }) {
        r?;
    }
    Ok(())
}
