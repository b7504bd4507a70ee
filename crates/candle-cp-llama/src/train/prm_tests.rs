//! Unit tests of stepwise data (TRL's tokenisation, packing) and the PRM loss.
use super::*;
use crate::train::sft::bytes_of;

/// `n` byte-level stepwise examples from `seed`: a prompt of letters and `=`, its answer (the
/// letters reversed, upper case) in two or three steps, each step right (label true) or a
/// random one (false, and so are the steps after it: Math-Shepherd's labels).
pub(crate) fn steps_text(n: usize, seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut out = String::new();
    for _ in 0..n {
        let p: String = (0..4 + rng.below(5)).map(|_| (b'a' + rng.below(12) as u8) as char).collect();
        let answer: Vec<char> = p.chars().rev().map(|x| x.to_ascii_uppercase()).collect();
        let parts = 2 + rng.below(2);
        let size = answer.len().div_ceil(parts);
        let (mut steps, mut labels, mut right) = (Vec::new(), Vec::new(), true);
        for chunk in answer.chunks(size) {
            let good = rng.below(10) < 7;
            let s: String = if good { chunk.iter().collect() } else { (0..chunk.len()).map(|_| (b'A' + rng.below(12) as u8) as char).collect() };
            right &= good || s.chars().eq(chunk.iter().copied());
            steps.push(format!("\"{s}\""));
            labels.push(right.to_string());
        }
        out.push_str(&format!("{{\"prompt\": \"{p}=\", \"completions\": [{}], \"labels\": [{}]}}\n", steps.join(", "), labels.join(", ")));
    }
    out
}

/// TRL's tokenisation: the prompt with its special tokens, each step then the separator, the
/// label on the separator's last token; bools and class numbers; errors named by line.
#[test]
fn reads_trl_stepwise_lines() -> Result<()> {
    // (a tokenizer with a BOS (1) and a two-token separator)
    let tok = |s: &str, special: bool| -> Result<Vec<u32>> { Ok(special.then_some(1).into_iter().chain(s.bytes().map(u32::from)).collect()) };
    let text = "{\"prompt\": \"ab\", \"completions\": [\"c\", \"de\"], \"labels\": [true, 0]}\n\n{\"prompt\": \"x\", \"completions\": [\"y\"], \"labels\": [2]}\n";
    let set = StepSet::read(text, &tok, "\n.")?;
    assert_eq!(set.len(), 2);
    let (t, l) = &set.docs[0];
    let i = IGNORE;
    assert_eq!(*t, [1, 97, 98, 99, 10, 46, 100, 101, 10, 46]);
    assert_eq!(*l, [i, i, i, i, i, 1, i, i, i, 0]);
    assert_eq!(set.docs[1].1, [i, i, i, i, 2]);
    assert_eq!((set.classes_needed(), set.vocab_needed()), (3, 122));
    // the last step only (TRL's train_on_last_step_only)
    let last = set.clone().last_step_only();
    assert_eq!(last.docs[0].1, [i, i, i, i, i, i, i, i, i, 0]);
    assert_eq!(last.docs[1].1, set.docs[1].1);
    for (bad, want) in [
        ("{\"prompt\": \"a\", \"completions\": [\"b\"], \"labels\": []}", "line 1: 1 steps and 0 labels"),
        ("{\"prompt\": \"a\", \"completions\": [\"b\"], \"labels\": [\"yes\"]}", "a label must be a bool or a class number"),
        ("{\"prompt\": \"a\", \"completions\": [3], \"labels\": [true]}", "a step must be a string"),
        ("\n{\"prompt\": \"a\", \"chosen\": \"b\"}", "line 2: expected {\"prompt\""),
        ("", "no example"),
    ] {
        let e = StepSet::read(bad, &tok, "\n").unwrap_err().to_string();
        assert!(e.contains(want), "{bad}: {e}");
    }
    assert!(StepSet::read(text, &tok, "").unwrap_err().to_string().contains("has no token"));
    assert!(StepSet::from_examples(vec![(vec![1, 2], vec![IGNORE, IGNORE])]).unwrap_err().to_string().contains("no labelled step"));
    Ok(())
}

/// Rows pack whole examples from a random one on, labels beside their tokens, the padding
/// unlabelled; an example longer than a row is cut to it; in order, every example once.
#[test]
fn rows_pack_examples_whole_or_cut_to_the_row() -> Result<()> {
    let set = StepSet::read(&steps_text(20, 3), &bytes_of, "\n")?;
    for seed in 0..20 {
        let (s, labels) = set.sample(48, &mut Rng::new(seed))?;
        assert_eq!((s.tokens.len(), labels.len()), (48, 48));
        let docs = s.documents.expect("documents");
        let mut at = 0;
        for (k, len) in docs.lengths().into_iter().enumerate() {
            let (toks, labs) = (&s.tokens[at..at + len], &labels[at..at + len]);
            match set.docs.iter().find(|(t, _)| t.as_slice() == toks) {
                Some((_, l)) => assert_eq!(l.as_slice(), labs, "seed {seed}: document {k}'s labels"),
                // (the padding, the last document)
                None => assert!(k == docs.count() - 1 && labs.iter().all(|&x| x == IGNORE) && toks.iter().all(|&x| x == 0), "seed {seed}: document {k}"),
            }
            at += len;
        }
        assert_eq!(s.long_range, labels.iter().map(|&l| l != IGNORE).collect::<Vec<_>>());
    }
    // rows shorter than an example: its first tokens and labels
    let (s, labels) = set.sample(6, &mut Rng::new(0))?;
    let e = set.docs.iter().find(|(t, _)| t[..6] == s.tokens[..]).expect("a cut example");
    assert_eq!(labels, e.1[..6]);
    let rows = set.in_order(48)?;
    let n: usize = rows.iter().map(|(s, _)| s.documents.as_ref().map_or(0, |d| d.count())).sum::<usize>() - rows.iter().filter(|(s, _)| s.tokens.last() == Some(&0)).count();
    assert_eq!(n, set.len(), "every example once");
    Ok(())
}

/// The loss is the mean cross-entropy over the labelled tokens (computed by hand in f64), the
/// accuracy the fraction whose highest logit is the label, and the node's gradient
/// `(softmax − onehot) / count` at the labelled tokens, 0 elsewhere.
#[test]
fn loss_is_the_mean_cross_entropy_of_the_labelled_tokens() -> Result<()> {
    let set = StepSet::from_examples(vec![(vec![5, 6, 7, 8], vec![IGNORE, 1, IGNORE, 0]), (vec![9, 9], vec![2, IGNORE])])?;
    let rows = set.in_order(6)?;
    assert_eq!(rows.len(), 1);
    let out = candle_cp_comm::run_ranks(1, |g| -> Result<()> {
        let ctx = crate::ParallelCtx::new(g, crate::Layout::single())?;
        check_loss(&rows, &ctx)
    });
    out.into_iter().collect()
}

fn check_loss(rows: &[StepRow], ctx: &crate::ParallelCtx) -> Result<()> {
    let vals: Vec<f32> = (0..18).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
    let var = candle_core::Var::from_vec(vals.clone(), (1, 6, 3), &Device::Cpu)?;
    let (node, t) = rows_loss(rows, var.as_tensor(), ctx, ctx.token_group())?;
    let labels = [IGNORE, 1, IGNORE, 0, 2, IGNORE];
    let (mut want, mut right) = (0f64, 0f64);
    let mut grad = vec![0f64; 18];
    for (k, &c) in labels.iter().enumerate().filter(|(_, &c)| c != IGNORE) {
        let z: Vec<f64> = vals[3 * k..3 * k + 3].iter().map(|&x| x as f64).collect();
        let lse = z.iter().map(|x| x.exp()).sum::<f64>().ln();
        want += lse - z[c as usize];
        right += (z.iter().cloned().fold(f64::NEG_INFINITY, f64::max) == z[c as usize]) as u8 as f64;
        for j in 0..3 {
            grad[3 * k + j] = ((z[j] - lse).exp() - (j == c as usize) as u8 as f64) / 3.0;
        }
    }
    assert!((t.loss - want / 3.0).abs() < 1e-6 && (t.accuracy - right / 3.0).abs() < 1e-12 && t.count == 3.0, "{t:?} vs {}", want / 3.0);
    assert!((node.to_scalar::<f32>()? as f64 - t.loss).abs() < 1e-6);
    let g: Vec<f32> = node.backward()?.get(var.as_tensor()).expect("grad").flatten_all()?.to_vec1()?;
    for (a, b) in g.iter().zip(&grad) {
        assert!((*a as f64 - b).abs() < 1e-6, "{g:?} vs {grad:?}");
    }
    // a label the head lacks
    let e = rows_loss(rows, &Tensor::zeros((1, 6, 2), candle_core::DType::F32, &Device::Cpu)?, ctx, ctx.token_group()).unwrap_err().to_string();
    assert!(e.contains("label 2 for a head of 2"), "{e}");
    Ok(())
}

/// Each rank's step probabilities of `set` under a drawn token classifier (3 labels) on
/// `layout`, rows of `seq_len`.
fn probabilities_on(layout: crate::Layout, set: &StepSet, seq_len: usize) -> Result<Vec<Vec<Vec<Vec<f64>>>>> {
    let cfg = crate::LlamaConfig::tiny(128, 32, 2, 4, 2).with_num_labels(Some(3)).with_token_classifier(Some(crate::prm::TokenClassifier::new(0.1)?));
    candle_cp_comm::run_ranks(layout.world_size(), |g| {
        let ctx = crate::ParallelCtx::new(g, layout)?;
        let vm = crate::init_params_sharded(&cfg, 4, candle_core::DType::F32, &ctx, &Device::Cpu)?;
        let model = Llama::new(candle_nn::VarBuilder::from_varmap(&vm, candle_core::DType::F32, &Device::Cpu), &cfg, &ctx)?;
        step_probabilities(&model, set, 2, seq_len, &Device::Cpu)
    })
    .into_iter()
    .collect()
}

/// The step probabilities are each example's softmax at its labelled tokens, scored alone (a
/// forward of the example by itself), per example and step in order; every rank of zigzag
/// CP 2 × TP 2 + SP and ring CP 2 × DP 2 gets one device's; an example longer than a row
/// keeps the steps inside it.
#[test]
fn step_probabilities_are_each_examples_softmax_on_every_layout() -> Result<()> {
    let set = StepSet::read(&steps_text(9, 5), &bytes_of, "\n")?;
    let one = probabilities_on(crate::Layout::single(), &set, 64)?.remove(0);
    assert_eq!(one.len(), set.len());
    // (one example alone in a row of its own length: the same probabilities)
    for e in [0, 4, 8] {
        let alone = StepSet::from_examples(vec![set.docs[e].clone()])?;
        let t = set.docs[e].0.len().div_ceil(4) * 4;
        let p = probabilities_on(crate::Layout::single(), &alone, t)?.remove(0).remove(0);
        assert_eq!(p.len(), set.docs[e].1.iter().filter(|&&x| x != IGNORE).count());
        for (a, b) in p.iter().flatten().zip(one[e].iter().flatten()) {
            assert!((a - b).abs() < 1e-5, "example {e}: {p:?} vs {:?}", one[e]);
        }
        assert!(p.iter().all(|s| (s.iter().sum::<f64>() - 1.0).abs() < 1e-5), "{p:?}");
    }
    for layout in [crate::Layout::cp(crate::CpKind::Zigzag, 2).with_tp(2, true), crate::Layout::cp(crate::CpKind::Ring, 2).with_dp(2)] {
        for (r, got) in probabilities_on(layout, &set, 64)?.into_iter().enumerate() {
            for (a, b) in got.iter().flatten().flatten().zip(one.iter().flatten().flatten()) {
                assert!((a - b).abs() < 1e-5, "{layout} rank {r}: {a} vs one device {b}");
            }
            assert_eq!(got.iter().map(Vec::len).collect::<Vec<_>>(), one.iter().map(Vec::len).collect::<Vec<_>>());
        }
    }
    // rows shorter than some examples: their steps past the row left out
    let short = probabilities_on(crate::Layout::single(), &set, 12)?.remove(0);
    for (e, s) in short.iter().enumerate() {
        assert_eq!(s.len(), set.docs[e].1[..12.min(set.docs[e].1.len())].iter().filter(|&&x| x != IGNORE).count());
    }
    Ok(())
}

/// A completion's steps end at each separator occurrence's last token and at its own last
/// token; the aggregates are the least, the last and the product; names parse.
#[test]
fn completions_split_into_steps_and_aggregate() -> Result<()> {
    assert_eq!(step_ends(&[1, 2, 7, 8, 3, 7, 8], &[7, 8]), [3, 6]);
    assert_eq!(step_ends(&[1, 2, 7, 8, 3, 4], &[7, 8]), [3, 5]);
    assert_eq!(step_ends(&[7, 7, 7], &[7, 7]), [1, 2]);
    assert_eq!(step_ends(&[5], &[10]), [0]);
    assert!(step_ends(&[], &[10]).is_empty());
    let p = [0.9, 0.2, 0.5];
    assert_eq!((StepAggregate::Min.of(&p), StepAggregate::Last.of(&p)), (0.2, 0.5));
    assert!((StepAggregate::Prod.of(&p) - 0.09).abs() < 1e-12);
    assert_eq!("prod".parse::<StepAggregate>()?, StepAggregate::Prod);
    assert!("mean".parse::<StepAggregate>().unwrap_err().to_string().contains("min, last or prod"));
    Ok(())
}

/// A completion's reward is its steps' probabilities of label 1 ([`step_probabilities`] of the
/// document labelled at the step ends) aggregated; a sequence classifier, an empty completion
/// and a document longer than the rows are refused.
#[test]
fn completion_rewards_aggregate_the_steps_probabilities() -> Result<()> {
    let cfg = crate::LlamaConfig::tiny(128, 32, 1, 4, 2).with_num_labels(Some(2)).with_token_classifier(Some(crate::prm::TokenClassifier::new(0.1)?));
    let out = candle_cp_comm::run_ranks(1, |g| -> Result<()> {
        let ctx = crate::ParallelCtx::new(g, crate::Layout::single())?;
        let dev = Device::Cpu;
        let vm = crate::init_params_sharded(&cfg, 6, candle_core::DType::F32, &ctx, &dev)?;
        let prm = Llama::new(candle_nn::VarBuilder::from_varmap(&vm, candle_core::DType::F32, &dev), &cfg, &ctx)?;
        let docs: Vec<(&[u32], &[u32])> = vec![(&[1, 2, 3], &[4, 10, 5, 6, 10]), (&[7], &[8, 9, 10, 11])];
        for agg in [StepAggregate::Min, StepAggregate::Last, StepAggregate::Prod] {
            let got = completion_rewards(&prm, &docs, &[10], agg, 1, 16, &dev)?;
            // (by hand: the documents labelled at their steps' ends)
            let set = StepSet::from_examples(vec![
                (vec![1, 2, 3, 4, 10, 5, 6, 10], vec![IGNORE, IGNORE, IGNORE, IGNORE, 0, IGNORE, IGNORE, 0]),
                (vec![7, 8, 9, 10, 11], vec![IGNORE, IGNORE, IGNORE, 0, 0]),
            ])?;
            let p = step_probabilities(&prm, &set, 1, 16, &dev)?;
            let want: Vec<f64> = p.iter().map(|steps| agg.of(&steps.iter().map(|s| s[1]).collect::<Vec<_>>())).collect();
            assert_eq!(got, want, "{agg:?}");
            assert_eq!(p.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2]);
        }
        let seq = crate::LlamaConfig::tiny(128, 32, 1, 4, 2).with_num_labels(Some(1));
        let rm = Llama::new(candle_nn::VarBuilder::from_varmap(&crate::init_params_sharded(&seq, 6, candle_core::DType::F32, &ctx, &dev)?, candle_core::DType::F32, &dev), &seq, &ctx)?;
        assert!(completion_rewards(&rm, &docs, &[10], StepAggregate::Min, 1, 16, &dev).unwrap_err().to_string().contains("not a process reward model"));
        assert!(completion_rewards(&prm, &[(&[1], &[])], &[10], StepAggregate::Min, 1, 16, &dev).unwrap_err().to_string().contains("empty"));
        assert!(completion_rewards(&prm, &docs, &[10], StepAggregate::Min, 1, 6, &dev).unwrap_err().to_string().contains("rows hold 6"));
        assert!(completion_rewards(&prm, &docs, &[], StepAggregate::Min, 1, 16, &dev).unwrap_err().to_string().contains("separator has no token"));
        Ok(())
    });
    out.into_iter().collect()
}

/// Malformed stepwise lines (valid ones cut short or with a character replaced, seeds 0..300)
/// are read or refused with the line named, never a panic; what is read holds a label per token.
#[test]
fn malformed_step_lines_are_errors_not_panics() -> Result<()> {
    let junk = ['"', '[', ']', '{', '}', ',', ':', '0', '7', 't', 'f', 'n', ' ', '\\', '-'];
    let (mut read, mut refused) = (0, 0);
    for seed in 0..300u64 {
        let mut rng = Rng::new(seed);
        let mut text: Vec<char> = steps_text(2, seed).chars().collect();
        match rng.below(3) {
            0 => text.truncate(rng.below(text.len())),
            _ => {
                let i = rng.below(text.len());
                text[i] = junk[rng.below(junk.len())];
            }
        }
        let text: String = text.into_iter().collect();
        match StepSet::read(&text, &bytes_of, "\n") {
            Ok(set) => {
                read += 1;
                assert!(set.docs.iter().all(|(t, l)| t.len() == l.len() && l.iter().any(|&x| x != IGNORE)), "seed {seed}");
            }
            Err(e) => {
                refused += 1;
                let e = e.to_string();
                assert!(e.contains("step data"), "seed {seed}: {e}");
            }
        }
    }
    assert!(read > 0 && refused > 0, "{read} read, {refused} refused");
    Ok(())
}
