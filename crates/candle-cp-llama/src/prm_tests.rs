//! Unit tests of the token classifier: its config checks, its scores on every layout with and
//! without dropout (the masks keyed on the global token: every layout drops what one device
//! drops), and its head read from a causal LM.
use super::*;
use crate::layout::{CpKind, Layout};
use crate::{init_params_sharded, shard_batch_packed};
use candle_core::Device;
use candle_cp_comm::run_ranks;
use candle_nn::VarBuilder;

#[test]
fn token_classifier_configs_are_checked() {
    let c = LlamaConfig::tiny(64, 32, 1, 4, 2);
    let t = Some(TokenClassifier::new(0.1).expect("p"));
    assert!(c.clone().with_num_labels(Some(2)).with_token_classifier(t).validate().is_ok());
    assert!(c.clone().with_token_classifier(t).validate().unwrap_err().to_string().contains("needs its labels"));
    assert!(TokenClassifier::new(1.0).unwrap_err().to_string().contains("[0, 1)"));
    let bad = c.clone().with_num_labels(Some(2)).with_token_classifier(Some(TokenClassifier { dropout: -0.5, bias: true }));
    assert!(bad.validate().unwrap_err().to_string().contains("dropout -0.5"));
    // (LoRA trains the head whole: weight and bias)
    let lora = crate::LoraSpec::new(4, 8.0, &["q_proj"]).expect("spec");
    let prm = c.clone().with_num_labels(Some(2)).with_token_classifier(t);
    let e = prm.clone().with_lora(Some(lora.clone())).validate().unwrap_err().to_string();
    assert!(e.contains("add score to modules_to_save"), "{e}");
    let lora = lora.with_modules_to_save(&["score"]).expect("score");
    assert_eq!(lora.modules_to_save, ["score"]);
    let prm = prm.with_lora(Some(lora));
    assert!(prm.validate().is_ok());
    let trained: Vec<String> = crate::params::trainable_specs(&prm).into_iter().filter(|s| !s.is_lora()).map(|s| s.name).collect();
    assert_eq!(trained, [crate::reward::SCORE, SCORE_BIAS]);
    assert_eq!(c.clone().with_num_labels(Some(2)).with_token_classifier(t).hf_class(), "LlamaForTokenClassification");
    // the head's parameters: weight and bias, replicated; the bias starts at zero
    let specs = crate::param_specs(&c.with_num_labels(Some(3)).with_token_classifier(t));
    let bias = specs.iter().find(|s| s.name == SCORE_BIAS).expect("bias");
    assert_eq!(bias.shape, [3]);
    assert!(specs.iter().any(|s| s.name == crate::reward::SCORE && s.shape == [3, 32]));
}

/// `b` rows of `t` tokens, two documents each.
fn batch(b: usize, t: usize, vocab: u32) -> Result<(Tensor, Vec<Documents>)> {
    let ids: Vec<u32> = (0..b * t).map(|i| ((i * 37 + 11) % vocab as usize) as u32).collect();
    let docs = (0..b).map(|r| Documents::from_lengths(&[5 + r, t - 5 - r])).collect::<Result<Vec<_>>>()?;
    Ok((Tensor::from_vec(ids, (b, t), &Device::Cpu)?, docs))
}

/// Every rank's scores by global token index `b·T + t`, `n` per token.
fn scores_on(layout: Layout, cfg: &LlamaConfig, dropout: Option<ClassifierDropout>) -> Result<Vec<Vec<f32>>> {
    let (b, t) = (2, 16);
    let (ids, docs) = batch(b, t, cfg.vocab_size as u32)?;
    let n = cfg.num_labels.unwrap_or(1);
    let mut out = vec![Vec::new(); b * t];
    for r in run_ranks(layout.world_size(), |g| -> Result<Vec<(u64, Vec<f32>)>> {
        let ctx = crate::ParallelCtx::new(g, layout)?;
        let vm = init_params_sharded(cfg, 3, DType::F32, &ctx, &Device::Cpu)?;
        let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), cfg, &ctx)?;
        let sb = shard_batch_packed(&ids, &docs, &ctx)?;
        let s = model.token_scores_packed(&sb.input_ids, &sb.positions, &sb.documents, dropout)?;
        let rows = crate::layout::local_token_indices(b, t, &ctx)?;
        let v: Vec<f32> = s.flatten_all()?.to_vec1()?;
        Ok(rows.into_iter().zip(v.chunks(n).map(|c| c.to_vec())).collect())
    }) {
        for (i, s) in r? {
            let slot = &mut out[i as usize];
            if slot.is_empty() {
                *slot = s;
            } else {
                // (TP ranks without SP score the same tokens: alike)
                assert_eq!(*slot, s, "{layout}: token {i} scored differently by two ranks");
            }
        }
    }
    assert!(out.iter().all(|s| s.len() == n), "{layout}: every token scored");
    Ok(out)
}

#[test]
fn token_scores_agree_on_every_layout_with_and_without_dropout() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2).with_num_labels(Some(2)).with_token_classifier(Some(TokenClassifier::new(0.5)?));
    let drop = ClassifierDropout { streams: candle_cp_nn::RngStreams::new(9), step: 4, batch: 2, seq_len: 16 };
    let plain = scores_on(Layout::single(), &cfg, None)?;
    let dropped = scores_on(Layout::single(), &cfg, Some(drop))?;
    assert!(plain.iter().zip(&dropped).any(|(a, b)| a != b), "dropout changes the scores");
    // (another step draws another mask)
    let other = scores_on(Layout::single(), &cfg, Some(ClassifierDropout { step: 5, ..drop }))?;
    assert!(other != dropped, "each forward its own mask");
    // (no dropout in the config: none drawn)
    let none = cfg.clone().with_token_classifier(Some(TokenClassifier::new(0.0)?));
    assert_eq!(scores_on(Layout::single(), &none, Some(drop))?, plain);
    // (a head without its bias, transformers' token_classification_bias false: scores alike)
    let unbiased = cfg.clone().with_token_classifier(cfg.token_classifier.map(|t| t.with_bias(false)));
    let u = scores_on(Layout::single(), &unbiased, Some(drop))?;
    assert_eq!(u, dropped, "a zero bias or none: the same scores");
    let z = scores_on(Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), &unbiased, Some(drop))?;
    assert!(z.iter().flatten().zip(u.iter().flatten()).all(|(x, y)| (x - y).abs() < 1e-5), "a head without its bias on zigzag CP 2 x TP 2 + SP");
    for layout in [Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Layout::cp(CpKind::Ring, 2).with_dp(2), Layout::cp(CpKind::Ulysses, 2).with_tp(2, false)] {
        for (want, d) in [(&plain, None), (&dropped, Some(drop))] {
            let got = scores_on(layout, &cfg, d)?;
            for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                for (x, y) in g.iter().zip(w) {
                    assert!((x - y).abs() < 1e-5, "{layout} dropout {}: token {i}: {x} vs one device {y}", d.is_some());
                }
            }
        }
    }
    Ok(())
}
