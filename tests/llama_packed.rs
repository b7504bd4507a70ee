//! Packed documents through the Llama: a row `[d0 | d1 | d2]` (lengths that divide nothing,
//! cut anywhere by the CP shards) gives, on every layout, the logits and per-token losses of
//! running EACH DOCUMENT ALONE on one device (positions from 0), and the packed loss's
//! gradients equal the single-device packed gradients, which equal the separate documents'
//! gradients weighted like the loss (`n_d / N`, `n_d` targets of document `d`).

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::params::varmap_tensors;
use candle_cp_llama::{
    gather_full, init_params, named_grads, shard_batch, shard_batch_packed, shard_tensors, Documents,
    Llama, LlamaConfig, ParallelCtx, IGNORE,
};
use candle_nn::VarBuilder;
use candle_cp_tests::packed_run::{max_abs, max_diff, run_packed, Run};
use std::collections::HashMap;

const T: usize = 48;

fn cfg() -> LlamaConfig {
    // 4 query heads, 2 KV heads (Ulysses 4 replicates them), head_dim 8
    LlamaConfig::tiny(61, 32, 2, 4, 2)
}

fn full_params() -> Result<HashMap<String, Tensor>> {
    varmap_tensors(&init_params(&cfg(), 11, DType::F32, &Device::Cpu)?)
}

/// `[b, T]` token ids from a small LCG.
fn token_ids(b: usize, seed: u64) -> Result<Tensor> {
    let mut s = seed;
    let v: Vec<u32> = (0..b * T)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % cfg().vocab_size as u64) as u32
        })
        .collect();
    Tensor::from_vec(v, (b, T), &Device::Cpu)
}

/// Single device, every document of every row run ALONE (plain `loss`, positions from 0):
/// global logits `[B·T·V]` placed at the documents' packed positions, and the gradient of
/// `Σ_d (n_d / N) · loss_d` (= the packed loss's gradient if the documents are independent).
fn run_separate(full: &HashMap<String, Tensor>, ids: &Tensor, docs: &[Documents]) -> Result<Run> {
    let cfg = cfg();
    let (b, t) = ids.dims2()?;
    let v = cfg.vocab_size;
    let res = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_tensors(full, &cfg, &ctx)?;
        let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
        let mut logits = vec![f32::NAN; b * t * v];
        let mut terms = Vec::new();
        let mut n_total = 0usize;
        for r in 0..b {
            let d = if docs.len() == 1 { &docs[0] } else { &docs[r] };
            for di in 0..d.count() {
                let (a, e) = d.range(di);
                let sb = shard_batch(&ids.narrow(0, r, 1)?.narrow(1, a, e - a)?, &ctx)?;
                let (loss, lg) = model.loss(&sb.input_ids, &sb.labels, &sb.positions)?;
                let dst = (r * t + a) * v;
                logits[dst..dst + (e - a) * v].copy_from_slice(&lg.flatten_all()?.to_vec1::<f32>()?);
                let n = e - a - 1;
                n_total += n;
                terms.push((loss, n));
            }
        }
        let mut total = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        for (l, n) in &terms {
            total = (total + (l * (*n as f64 / n_total as f64))?)?;
        }
        let grads = total.backward()?;
        let full_grads = gather_full(&named_grads(&grads, &vm)?, &cfg, &ctx)?;
        Ok((logits, total.to_scalar::<f32>()? as f64, full_grads))
    });
    let Some(r) = res.into_iter().next() else { bail!("no rank") };
    let (logits, loss, grads) = r?;
    Ok(Run { logits, nll: vec![], loss, grads, spread: 0.0 })
}

/// `-log softmax(logits)[label]` per global token (0 where the label is IGNORE).
fn nll_of(logits: &[f32], labels: &[u32], v: usize) -> Vec<f32> {
    labels
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            if l == IGNORE {
                return 0.0;
            }
            let row = &logits[i * v..(i + 1) * v];
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x)) as f64;
            let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            (lse - row[l as usize] as f64) as f32
        })
        .collect()
}

/// Global packed labels `[B·T]`.
fn labels_of(ids: &Tensor, docs: &[Documents]) -> Result<Vec<u32>> {
    let rows = ids.to_vec2::<u32>()?;
    Ok(rows
        .iter()
        .enumerate()
        .flat_map(|(r, row)| candle_cp_llama::packed::packed_labels(row, if docs.len() == 1 { &docs[0] } else { &docs[r] }))
        .collect())
}

/// Max |a - b| over two flat vectors.
/// Worst per-parameter relative gradient error (max |a - b| / max |b|) and its parameter.
fn grad_rel(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<(f64, String)> {
    assert_eq!(a.len(), b.len(), "same parameters");
    let mut worst = (0f64, String::new());
    for ((na, ga), (nb, gb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let scale = gb.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30) as f64;
        let rel = max_abs(ga, gb)? / scale;
        if rel >= worst.0 {
            worst = (rel, na.clone());
        }
    }
    Ok(worst)
}

/// Every layout vs the single-device packed run and the separate documents.
fn check_layouts(ids: &Tensor, docs: &[Documents], layouts: &[Layout], recompute: bool) -> Result<()> {
    let full = full_params()?;
    let v = cfg().vocab_size;
    let labels = labels_of(ids, docs)?;
    let sep = run_separate(&full, ids, docs)?;
    let single = run_packed(&full, &cfg(), ids, docs, Layout::single(), false)?;
    let sep_nll = nll_of(&sep.logits, &labels, v);
    // single-device packed = separate documents (logits, per-token loss, loss, gradients)
    let (gr, worst) = grad_rel(&single.grads, &sep.grads)?;
    let (dl, dn) = (max_diff(&single.logits, &sep.logits), max_diff(&single.nll, &sep_nll));
    println!("single packed vs separate: logits {dl:.1e} nll {dn:.1e} loss {:.1e} grad_rel {gr:.1e} ({worst})", (single.loss - sep.loss).abs());
    assert!(dl < 1e-5 && dn < 1e-5, "single packed vs separate: logits {dl:.2e}, nll {dn:.2e}");
    assert!((single.loss - sep.loss).abs() < 5e-6, "loss {} vs {}", single.loss, sep.loss);
    assert!(gr < 5e-5, "single packed vs separate: grad rel {gr:.2e} ({worst})");
    for &layout in layouts {
        let t0 = std::time::Instant::now();
        let run = run_packed(&full, &cfg(), ids, docs, layout, recompute)?;
        let dl = max_diff(&run.logits, &sep.logits);
        let nll = nll_of(&run.logits, &labels, v);
        let dn = max_diff(&nll, &sep_nll);
        let (gr, worst) = grad_rel(&run.grads, &single.grads)?;
        let dloss = (run.loss - single.loss).abs();
        println!(
            "{layout}{}: logits {dl:.1e} nll {dn:.1e} loss {dloss:.1e} grad_rel {gr:.1e} ({worst}) spread {:.1e} [{:.2}s]",
            if recompute { " recompute" } else { "" },
            run.spread,
            t0.elapsed().as_secs_f64()
        );
        assert!(dl < 1e-5 && dn < 1e-5, "{layout}: logits {dl:.2e}, nll {dn:.2e} vs separate documents");
        if !recompute {
            // token_nll_packed (the chunked head) gives the same per-token losses
            let dt = max_diff(&run.nll, &sep_nll);
            assert!(dt < 1e-5, "{layout}: token_nll_packed {dt:.2e} vs separate documents");
        }
        assert!(dloss < 5e-6, "{layout}: loss {} vs single {}", run.loss, single.loss);
        assert!(gr < 5e-5, "{layout}: grad rel {gr:.2e} ({worst}) vs single-device packed");
        assert!(run.spread < 1e-5, "{layout}: ranks disagree by {:.2e}", run.spread);
    }
    Ok(())
}

fn docs_3() -> Documents {
    Documents::from_lengths(&[13, 22, 13]).expect("valid lengths")
}

/// THE key test: one packed row `[13 | 22 | 13]` on every CP layout (and TP + SP).
#[test]
fn packed_equals_separate_documents_on_every_layout() -> Result<()> {
    let layouts = [
        Layout::cp(CpKind::Ring, 2),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 2),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Striped, 2),
        Layout::cp(CpKind::Striped, 4),
        Layout::cp(CpKind::AllGather, 2),
        Layout::cp(CpKind::AllGather, 4),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::cp(CpKind::Ulysses, 4),
        Layout::two_d(2, 2),
        Layout::single().with_tp(2, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
        Layout::cp(CpKind::Ulysses, 2).with_tp(2, false),
    ];
    check_layouts(&token_ids(1, 5)?, &[docs_3()], &layouts, false)
}

/// Two rows with different documents (one of length 1: no target): attention row by row on
/// a CP group, or one row per DP replica.
#[test]
fn per_row_documents_on_cp_dp_and_2d() -> Result<()> {
    let docs = [docs_3(), Documents::from_lengths(&[5, 30, 1, 12])?];
    let layouts = [
        Layout::cp(CpKind::Zigzag, 2),
        Layout::cp(CpKind::Ring, 2).with_dp(2),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
        Layout::cp(CpKind::Striped, 2).with_tp(2, true),
    ];
    check_layouts(&token_ids(2, 9)?, &docs, &layouts, false)
}

/// Recomputed layers (the checkpoint closure holds the documents): same results.
#[test]
fn packed_with_recompute() -> Result<()> {
    check_layouts(&token_ids(1, 5)?, &[docs_3()], &[Layout::cp(CpKind::Zigzag, 4)], true)
}

/// The comparison is sharp: the same row WITHOUT the document mask (plain causal, positions
/// 0..T) differs from the separate documents far beyond the tolerance after the first
/// document, and equals them on the first.
#[test]
fn unpacked_row_differs_from_separate_documents() -> Result<()> {
    let full = full_params()?;
    let ids = token_ids(1, 5)?;
    let docs = [docs_3()];
    let sep = run_separate(&full, &ids, &docs)?;
    let v = cfg().vocab_size;
    let res = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_tensors(&full, &cfg(), &ctx)?;
        let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg(), &ctx)?;
        let sb = shard_batch(&ids, &ctx)?;
        model.forward(&sb.input_ids, &sb.positions)?.flatten_all()?.to_vec1::<f32>()
    });
    let plain = res.into_iter().next().expect("one rank")?;
    let first = 13 * v;
    assert!(max_diff(&plain[..first], &sep.logits[..first]) < 1e-5);
    let d = max_diff(&plain[first..], &sep.logits[first..]);
    assert!(d > 1e-3, "unmasked logits differ by only {d:.2e}");
    Ok(())
}

/// Bad documents are errors naming the shapes, on the model too.
#[test]
fn mismatched_documents_are_errors() -> Result<()> {
    let full = full_params()?;
    let ids = token_ids(2, 1)?;
    let layout = Layout::cp(CpKind::Zigzag, 2);
    let res = run_ranks(2, |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = shard_tensors(&full, &cfg(), &ctx)?;
        let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg(), &ctx)?;
        let sb = shard_batch_packed(&ids, &[docs_3()], &ctx)?;
        let short = Documents::from_lengths(&[13, 22, 12])?;
        let e1 = model.loss_packed(&sb.input_ids, &sb.labels, &sb.positions, &[short]).err().map(|e| e.to_string());
        let three = vec![docs_3(); 3];
        let e2 = model.forward_packed(&sb.input_ids, &sb.positions, &three).err().map(|e| e.to_string());
        Ok((e1, e2))
    });
    for r in res {
        let (e1, e2) = r?;
        let e1 = e1.expect("47-token documents for T = 48 must fail");
        assert!(e1.contains("47 tokens") && e1.contains("T = 48"), "{e1}");
        let e2 = e2.expect("3 documents for 2 rows must fail");
        assert!(e2.contains("3 Documents") && e2.contains("[2, 24]"), "{e2}");
    }
    Ok(())
}
