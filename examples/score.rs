//! Scores preference pairs with a reward model (a `*ForSequenceClassification` checkpoint of
//! one label, e.g. one `finetune_llama --reward-model` wrote, or a LoRA reward run's checkpoint
//! over its base): every answer's reward (its
//! prompt ++ answer scored at the last token), the pairs' accuracy (chosen above rejected) and
//! mean margin — on one device, then on the layout given (CPU thread ranks); exits non-zero if
//! the two disagree by more than 1e-4 (relative above 1) or rank the pairs differently.
//!
//! The pairs are read as `finetune_llama --dpo` reads them (TRL's preference forms, byte-level
//! or through `--tokenizer`, answers ended by `--eos`, conversations through
//! `--chat-template`); whole pairs are packed into rows of `--seq-len` tokens (default: the
//! longest pair, rounded up to what the layout needs). With `--completions` the data is
//! prompt / completion examples (as `--sft` reads them), each scored alone: their rewards and
//! mean. With `--steps` the model is a process reward model (a `*ForTokenClassification`
//! checkpoint, e.g. one `finetune_llama --prm` wrote) and the data stepwise examples (as
//! `--prm` reads them, `--step-separator`): every step's label probabilities, the steps'
//! accuracy (the likeliest label is the given one) and mean probability of label 1.
//!
//! ```text
//! cargo run --release --example score -- --model RM --data pairs.jsonl --eos 10 --cp 2
//! cargo run --release --example score -- --model RM --data pairs.jsonl --tokenizer tok.json --cp 2 --tp 2 --sp --show 5
//! cargo run --release --example score -- --model RM --data answers.jsonl --completions --eos 10 --show 10
//! cargo run --release --example score -- --model PRM --data steps.jsonl --steps --cp 2 --tp 2 --sp --show 3
//! ```

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use candle_cp_comm::run_ranks;
use candle_cp_llama::chat::ChatTemplate;
use candle_cp_llama::train::reward::{answer_rewards, score_documents};
use candle_cp_llama::train::sft::{read_sft, Tokenize};
use candle_cp_llama::train::prm::step_probabilities;
use candle_cp_llama::train::{PreferenceSet, StepSet};
use candle_cp_llama::reward::load_reward_model;
use candle_cp_llama::{CpKind, Layout, Llama, ParallelCtx, IGNORE};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
struct Args {
    /// The reward model's directory (config.json naming a `*ForSequenceClassification`).
    #[arg(long)]
    model: PathBuf,
    /// Preference pairs, JSON lines (`{"prompt": .., "chosen": .., "rejected": ..}` or
    /// conversations).
    #[arg(long)]
    data: PathBuf,
    /// A tokenizer.json (default: byte-level ids, as finetune_llama without --tokenizer).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The token id ending each answer (default: none).
    #[arg(long)]
    eos: Option<u32>,
    /// The chat template of conversations (e.g. llama3, chatml, qwen3; see finetune_llama).
    #[arg(long)]
    chat_template: Option<String>,
    /// Tokens per row (default: the longest pair rounded up to the layout's multiple).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Rows per forward (a multiple of --dp).
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// CP ranks of the second pass (threads).
    #[arg(long, default_value_t = 2)]
    cp: usize,
    /// ring | zigzag | striped | allgather | ulysses.
    #[arg(long, default_value = "zigzag")]
    cp_kind: String,
    /// TP ranks of the second pass.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Sequence parallelism with --tp.
    #[arg(long)]
    sp: bool,
    /// DP ranks of the second pass.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Print the first N pairs' (examples') rewards.
    #[arg(long, default_value_t = 0)]
    show: usize,
    /// --data is prompt / completion examples (or conversations), each scored alone.
    #[arg(long)]
    completions: bool,
    /// --model is a process reward model and --data stepwise examples (`{"prompt": ..,
    /// "completions": [steps], "labels": [bools]}`): every step's label probabilities.
    #[arg(long)]
    steps: bool,
    /// The text after each step (--steps; `\n` is a newline).
    #[arg(long, default_value = "\\n")]
    step_separator: String,
}

/// Rank 0's rewards from `score` (the model, the rows' length, the rank's context) on `layout`,
/// each rank with its shards of the reward model at `dir` (with `tokens`, a token classifier;
/// else a sequence classifier of one label); rows of `seq_len` tokens (default: `longest`
/// rounded up to the layout's multiple). Returns the rows' length too; errors come from rank 0
/// first.
fn on_layout<T: Send>(dir: &std::path::Path, layout: Layout, (longest, seq_len): (usize, Option<usize>), tokens: bool, score: impl Fn(&Llama, usize, &ParallelCtx) -> candle_core::Result<T> + Sync) -> anyhow::Result<(T, usize)> {
    let out = run_ranks(layout.world_size(), |g| -> candle_core::Result<(T, usize)> {
        let ctx = ParallelCtx::new(g, layout)?;
        let model = load_reward_model(dir, &ctx, &Device::Cpu, DType::F32)?;
        let c = model.config();
        match (tokens, c.token_classifier.is_some()) {
            (true, false) => candle_core::bail!("{}: {} is not a process reward model (a *ForTokenClassification)", dir.display(), c.hf_class()),
            (false, true) => candle_core::bail!("{}: {} is a process reward model: score its steps with --steps", dir.display(), c.hf_class()),
            (false, _) if c.num_labels != Some(1) => candle_core::bail!("{}: a reward model of {:?} labels, not one", dir.display(), c.num_labels),
            _ => {}
        }
        let m = model.forward_multiple();
        let t = seq_len.unwrap_or(longest.div_ceil(m) * m);
        Ok((score(&model, t, &ctx)?, t))
    });
    let mut first = None;
    for r in out {
        let r = r?;
        first.get_or_insert(r);
    }
    first.context("no rank")
}

/// `--data` read by `read` through `--tokenizer` (else byte-level ids).
fn read_data<T>(a: &Args, read: impl Fn(Tokenize) -> candle_core::Result<T>) -> anyhow::Result<T> {
    match &a.tokenizer {
        None => read(&candle_cp_llama::train::sft::bytes_of),
        Some(p) => {
            let tok = tokenizers::Tokenizer::from_file(p).map_err(|e| anyhow::anyhow!("loading --tokenizer {}: {e}", p.display()))?;
            let encode = |s: &str, special: bool| -> candle_core::Result<Vec<u32>> {
                tok.encode(s, special).map(|e| e.get_ids().to_vec()).map_err(|e| candle_core::Error::Msg(format!("tokenizing: {e}")))
            };
            read(&encode)
        }
    }
    .with_context(|| format!("--data {}", a.data.display()))
}

/// The largest difference of two runs' rewards, relative above 1.
fn worst(one: &[f64], other: &[f64]) -> f64 {
    one.iter().zip(other).map(|(x, y)| (x - y).abs() / x.abs().max(1.0)).fold(0.0, f64::max)
}

/// `--completions`: every example's reward on one device and on `layout`, compared.
fn score_completions(a: &Args, text: &str, layout: Layout, chat: Option<ChatTemplate>) -> anyhow::Result<()> {
    let docs: Vec<Vec<u32>> = read_data(a, |tokenize| read_sft(text, tokenize, a.eos, chat))?.into_iter().map(|(t, _)| t).collect();
    let longest = docs.iter().map(Vec::len).max().unwrap_or(1);
    let score = |m: &Llama, t: usize, _: &ParallelCtx| score_documents(m, &docs, a.batch, t, &Device::Cpu);
    let (one, t1) = on_layout(&a.model, Layout::single(), (longest, a.seq_len), false, score)?;
    let (par, tl) = on_layout(&a.model, layout, (longest, a.seq_len), false, score)?;
    for (i, (x, y)) in one.iter().zip(&par).enumerate().take(a.show) {
        println!("example {i:>4}: reward {x:>9.4}  ({layout}: {y:>9.4})");
    }
    let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len().max(1) as f64;
    println!("model    : {} ({} examples, rows of {t1} / {tl} tokens, {} per forward)", a.model.display(), docs.len(), a.batch);
    println!("one      : mean reward {:.4}", mean(&one));
    println!("layout   : mean reward {:.4}  ({layout})", mean(&par));
    let worst = worst(&one, &par);
    println!("agree    : max difference {worst:.2e} (relative above 1)");
    if worst > 1e-4 {
        bail!("{layout} disagrees with one device: {worst:.2e}")
    }
    Ok(())
}

/// `--steps`: every step's label probabilities on one device and on `layout`, compared.
fn score_steps(a: &Args, text: &str, layout: Layout) -> anyhow::Result<()> {
    let sep = a.step_separator.replace("\\n", "\n");
    let set = read_data(a, |tokenize| StepSet::read(text, tokenize, &sep))?;
    let examples: Vec<(Vec<u32>, Vec<u32>)> = (0..set.len()).filter_map(|i| set.example(i).cloned()).collect();
    let longest = examples.iter().map(|e| e.0.len()).max().unwrap_or(1);
    let score = |m: &Llama, t: usize, _: &ParallelCtx| step_probabilities(m, &set, a.batch, t, &Device::Cpu);
    let (one, t1) = on_layout(&a.model, Layout::single(), (longest, a.seq_len), true, score)?;
    let (par, tl) = on_layout(&a.model, layout, (longest, a.seq_len), true, score)?;
    for (i, (x, y)) in one.iter().zip(&par).enumerate().take(a.show) {
        let given: Vec<u32> = examples[i].1.iter().copied().filter(|&l| l != IGNORE).collect();
        let fmt = |p: &[Vec<f64>]| p.iter().map(|s| format!("{:.3}", s.get(1).copied().unwrap_or(f64::NAN))).collect::<Vec<_>>().join(" ");
        println!("example {i:>4}: labels {given:?}  P(1) {}  ({layout}: {})", fmt(x), fmt(y));
    }
    // (accuracy: the likeliest label is the given one; the mean probability of label 1)
    let summary = |p: &[Vec<Vec<f64>>]| -> (f64, f64, usize) {
        let (mut right, mut p1, mut n) = (0usize, 0.0, 0usize);
        for (e, steps) in p.iter().enumerate() {
            for (s, l) in steps.iter().zip(examples[e].1.iter().filter(|&&l| l != IGNORE)) {
                let best = s.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (k, &x)| if x > b.1 { (k, x) } else { b }).0;
                right += (best == *l as usize) as usize;
                p1 += s.get(1).copied().unwrap_or(0.0);
                n += 1;
            }
        }
        (right as f64 / n.max(1) as f64, p1 / n.max(1) as f64, n)
    };
    let ((acc1, p1, n), (accl, pl, _)) = (summary(&one), summary(&par));
    println!("model    : {} ({} examples, {n} steps scored, rows of {t1} / {tl} tokens, {} per forward)", a.model.display(), set.len(), a.batch);
    println!("one      : step accuracy {acc1:.4}  mean P(1) {p1:.4}");
    println!("layout   : step accuracy {accl:.4}  mean P(1) {pl:.4}  ({layout})");
    let flat = |p: &[Vec<Vec<f64>>]| -> Vec<f64> { p.iter().flatten().flatten().copied().collect() };
    let worst = worst(&flat(&one), &flat(&par));
    println!("agree    : max difference {worst:.2e}");
    if worst > 1e-4 || acc1 != accl {
        bail!("{layout} disagrees with one device: {worst:.2e}, accuracy {accl} vs {acc1}")
    }
    Ok(())
}

/// (accuracy, mean margin) of pairs' rewards (`2·p` chosen, `2·p + 1` rejected).
fn summary(r: &[f64]) -> (f64, f64) {
    let n = (r.len() / 2).max(1) as f64;
    let right = r.chunks(2).filter(|p| p[0] > p[1]).count() as f64;
    (right / n, r.chunks(2).map(|p| p[0] - p[1]).sum::<f64>() / n)
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let text = std::fs::read_to_string(&a.data).with_context(|| format!("reading --data {}", a.data.display()))?;
    let chat = a.chat_template.as_deref().map(ChatTemplate::from_name).transpose()?;
    let layout = Layout::cp(a.cp_kind.parse::<CpKind>()?, a.cp).with_tp(a.tp, a.sp).with_dp(a.dp);
    layout.check_degrees()?;
    if a.completions {
        return score_completions(&a, &text, layout, chat);
    }
    if a.steps {
        return score_steps(&a, &text, layout);
    }
    let set = read_data(&a, |tokenize| PreferenceSet::read(&text, tokenize, a.eos, chat))?;
    let longest = (0..set.len()).map(|p| set.pair_len(p)).max().unwrap_or(1);
    let score = |m: &Llama, t: usize, ctx: &ParallelCtx| answer_rewards(m, &set, a.batch, t, ctx, &Device::Cpu);
    let t0 = std::time::Instant::now();
    let (one, t1) = on_layout(&a.model, Layout::single(), (longest, a.seq_len), false, score)?;
    let s1 = t0.elapsed().as_secs_f64();
    let t0 = std::time::Instant::now();
    let (par, tl) = on_layout(&a.model, layout, (longest, a.seq_len), false, score)?;
    let sl = t0.elapsed().as_secs_f64();
    for p in 0..a.show.min(set.len()) {
        println!("pair {p:>4}: chosen {:>9.4}  rejected {:>9.4}  ({layout}: {:>9.4} / {:>9.4})", one[2 * p], one[2 * p + 1], par[2 * p], par[2 * p + 1]);
    }
    let ((acc1, m1), (accl, ml)) = (summary(&one), summary(&par));
    println!("model    : {} ({} pairs, rows of {t1} / {tl} tokens, {} per forward)", a.model.display(), set.len(), a.batch);
    println!("one      : accuracy {acc1:.4}  margin {m1:.4}  ({s1:.2}s)");
    println!("layout   : accuracy {accl:.4}  margin {ml:.4}  ({sl:.2}s, {layout})");
    let worst = worst(&one, &par);
    println!("agree    : max difference {worst:.2e} (relative above 1)");
    if worst > 1e-4 || acc1 != accl {
        bail!("{layout} disagrees with one device: {worst:.2e}, accuracy {accl} vs {acc1}")
    }
    Ok(())
}
