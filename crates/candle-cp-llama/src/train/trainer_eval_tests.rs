//! Trainer tests of the held-out evaluation ([`crate::train::eval`]).
use super::tests::{packed_corpus, run, tiny_cfg, tmpdir};
use super::*;
use crate::train::eval::EVAL_SALT;
use crate::train::EvalConfig;
use crate::{CpKind, Layout, LlamaConfig};
use candle_core::DType;
use candle_cp_comm::run_ranks;
use candle_nn::VarBuilder;

/// The held-out loss is evaluated at steps 3 and 6 only (every 3 and the last) and equals the
/// mean cross-entropy of the held-out rows under the step-3 checkpoint's weights computed by
/// hand (logits, log-softmax, every next token); on zigzag 2 × DP 2 with ZeRO-1 and the
/// overlapped parameter gather, and on TP 2 + SP × ring 2 with recompute, it equals the
/// one-device run's, and each layout's training is the same with and without evaluation, bit
/// for bit.
#[test]
fn held_out_loss_is_the_models_on_every_layout() -> Result<()> {
    let d = tmpdir("eval");
    let mut c = tiny_cfg(Some(d.clone()), Layout::single(), 2, 1);
    let eval = EvalConfig { data: c.data.clone(), every: 3, batches: 2 };
    c.eval = Some(eval.clone());
    let one = run(&c)?;
    let at: Vec<usize> = one[0].metrics.iter().filter(|m| m.eval_loss.is_some()).map(|m| m.step).collect();
    assert_eq!(at, [3, 6]);
    assert!(one[0].metrics[2].eval_long_range_loss.is_some(), "the recall task's long-range targets");
    let (vm, mcfg) = crate::load_hf(d.join("checkpoints/step-000003"), &Device::Cpu, DType::F32)?;
    let by_hand = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &mcfg, &ctx)?;
        let (mut sum, mut n) = (0f64, 0usize);
        for k in 0..eval.batches {
            let (ids, _, _) = batch_of(&eval.data, c.seed ^ EVAL_SALT, &c, 0, k, &Device::Cpu)?;
            let pos = Tensor::arange(0u32, c.seq_len as u32, &Device::Cpu)?;
            let logp: Vec<Vec<Vec<f32>>> = candle_nn::ops::log_softmax(&m.forward(&ids, &pos)?, 2)?.to_vec3()?;
            for (b, row) in ids.to_vec2::<u32>()?.iter().enumerate() {
                for t in 0..row.len() - 1 {
                    sum -= logp[b][t][row[t + 1] as usize] as f64;
                    n += 1;
                }
            }
        }
        Ok(sum / n as f64)
    });
    let want = by_hand.into_iter().next().ok_or_else(|| candle_core::Error::Msg("no rank".into()))??;
    let got = one[0].metrics[2].eval_loss.unwrap_or(f64::NAN);
    assert!((got - want).abs() < 1e-5, "held-out loss {got}, by hand {want}");
    // (layout, ZeRO-1 + overlapped gather, recompute)
    let runs = [(Layout::cp(CpKind::Zigzag, 2).with_dp(2), true, false), (Layout::cp(CpKind::Ring, 2).with_tp(2, true), false, true)];
    for (layout, zero, recompute) in runs {
        let mut cl = c.clone();
        (cl.out, cl.layout, cl.zero1, cl.overlap_param_gather, cl.recompute) = (None, layout, zero, zero, recompute);
        let with = run(&cl)?;
        cl.eval = None;
        let without = run(&cl)?;
        for ((x, y), z) in with[0].metrics.iter().zip(&without[0].metrics).zip(&one[0].metrics) {
            assert_eq!((x.train_loss, x.grad_norm), (y.train_loss, y.grad_norm), "{layout} step {}: evaluation changed training", x.step);
            match (x.eval_loss, z.eval_loss) {
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-5, "{layout} step {}: held-out {a} vs one device {b}", x.step),
                (None, None) => {}
                (a, b) => panic!("{layout} step {}: held-out {a:?} vs one device {b:?}", x.step),
            }
        }
    }
    std::fs::remove_dir_all(&d).ok();
    Ok(())
}

/// Held-out packed documents (the corpus's last ones, `split_held_out`) on zigzag 2 equal the
/// one-device evaluation; the split leaves disjoint document sets; bad settings are refused.
#[test]
fn held_out_documents_and_refusals() -> Result<()> {
    let corpus = DataSource::Packed(packed_corpus()?);
    let (train, held) = corpus.split_held_out(0.25, 64)?;
    let (DataSource::Packed(t), DataSource::Packed(h), DataSource::Packed(all)) = (&train, &held, &corpus) else { candle_core::bail!("packed parts") };
    assert_eq!((t.count() + h.count(), h.count()), (all.count(), 10));
    assert_eq!(h.document(0), all.document(30), "the last documents held out");
    let mut c1 = tiny_cfg(None, Layout::single(), 2, 1);
    (c1.data, c1.model, c1.steps) = (train, ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1)), 2);
    c1.eval = Some(EvalConfig { data: held, every: 1, batches: 1 });
    let one = run(&c1)?;
    let mut c2 = c1.clone();
    c2.layout = Layout::cp(CpKind::Zigzag, 2);
    let two = run(&c2)?;
    for (a, b) in one[0].metrics.iter().zip(&two[0].metrics) {
        let (x, y) = (a.eval_loss.unwrap_or(f64::NAN), b.eval_loss.unwrap_or(f64::NAN));
        assert!((x - y).abs() < 1e-5, "step {}: held-out {x} vs {y}", a.step);
    }
    // refusals: a text corpus too short for two windows, fractions out of range, every 0
    let text = DataSource::Text(crate::train::TokenStream::from_bytes(&[b'a'; 100]));
    let e = text.split_held_out(0.1, 64).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("seq_len 64"), "{e}");
    let (tr, he) = text.split_held_out(0.3, 30)?;
    let (DataSource::Text(tr), DataSource::Text(he)) = (tr, he) else { candle_core::bail!("text parts") };
    assert_eq!((tr.tokens.len(), he.tokens.len()), (70, 30));
    assert!(text.split_held_out(1.0, 8).is_err() && text.split_held_out(0.0, 8).is_err());
    let mut bad = c1.clone();
    bad.eval = Some(EvalConfig { data: c1.data.clone(), every: 0, batches: 1 });
    let e = run(&bad).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("every = 0"), "{e}");
    Ok(())
}
