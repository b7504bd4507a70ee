//! Fine-tune (or train from scratch) a Llama-style model with context parallelism.
//!
//! ```text
//! cargo run --release --example finetune_llama                     # CPU, 4 thread ranks, zigzag CP
//! cargo run --release --example finetune_llama -- --data book.txt --seq-len 1024
//! cargo run --release --example finetune_llama -- --model tests/data/oracle/tiny-llama --data notes.txt
//! # documents (separated by blank lines) packed into each sequence, masked from each other:
//! cargo run --release --example finetune_llama -- --data notes.txt --pack-docs --seq-len 1024
//! cargo run --release --example finetune_llama -- --sliding-window 128   # Mistral-style window
//! cargo run --release --example finetune_llama -- --qkv-bias    # Qwen2-style q, k, v biases
//! cargo run --release --example finetune_llama -- --qk-norm     # Qwen3-style q / k head norms
//! cargo run --release --example finetune_llama -- --resume         # continue runs/finetune
//! # 4 GPUs, NCCL, one process (a thread per GPU):
//! cargo run --release --features nccl --example finetune_llama -- --device cuda --comm nccl --gpus 4
//! # 4 GPUs, NCCL, one process per GPU (any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK,
//! # MASTER_ADDR, MASTER_PORT; every process gets the same flags):
//! RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//!   target/release/examples/finetune_llama --device cuda --comm nccl
//! ```
//!
//! Default data: a synthetic key→value recall task whose targets can only be predicted by
//! attending to tokens held by other CP ranks (see `candle_cp_llama::train::data::KvRecall`);
//! the loss on those targets is reported separately (`lr-loss`). See examples/README.md.

#[path = "finetune_launch.rs"]
mod launch;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_cp_comm::Group;
use candle_cp_llama::train::{
    AdamWConfig, DataSource, KvRecall, ModelSource, PackedStream, StepMetrics, TokenStream,
    TrainConfig, WarmupCosine,
};
use candle_cp_llama::{CpKind, HeadLayout, Layout, LlamaConfig, RowSums};
use clap::Parser;
use launch::Launch;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    about = "Fine-tune a Llama-style model with context parallelism (thread ranks on CPU, or GPUs)"
)]
struct Args {
    /// Global sequence length T (tokens per row, split over the CP ranks).
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    /// Context-parallel degree.
    #[arg(long, default_value_t = 4)]
    cp: usize,
    /// CP algorithm: ring, zigzag, striped, allgather, ulysses, 2d.
    #[arg(long, default_value = "zigzag")]
    cp_kind: String,
    /// Ulysses degree for --cp-kind 2d (cp = ulysses · ring).
    #[arg(long, default_value_t = 2)]
    ulysses: usize,
    /// With --cp-kind ulysses or 2d: keep only the sequence layout of q, k, v and the
    /// attention output for the backward, which all-to-alls them to heads again (less
    /// activation memory, 50% more all-to-all volume). Same training, bit for bit.
    #[arg(long)]
    regather_heads: bool,
    /// bf16 / f16: where the attention backward's row sums take the output from. f32: the f32
    /// output (its bf16 rounding residual kept, 2 bytes per attention output element; dq and
    /// dk as accurate as with f32 outputs); output: the returned 16-bit output (nothing kept,
    /// FlashAttention's choice). [default: f32 for the ring kinds and 2d, output on one device
    /// and for ulysses]
    #[arg(long)]
    row_sums: Option<String>,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Megatron sequence parallelism inside the TP group.
    #[arg(long)]
    sp: bool,
    /// Data-parallel degree (gradients all-reduced over DP × CP).
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 400)]
    steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Warmup steps (linear), then cosine decay.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Final learning rate as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    min_lr_ratio: f64,
    /// AdamW weight decay (matrices only).
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Clip the global gradient norm (0 = off).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Global rows per micro-batch (default: 4 for the synthetic task, else dp; must be a
    /// multiple of dp).
    #[arg(long)]
    batch: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Run seed (initial weights, data).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Text file to fine-tune on (byte-level tokens unless --tokenizer).
    #[arg(long)]
    data: Option<PathBuf>,
    /// HF tokenizer.json for --data.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Pack documents: split --data into documents on --doc-separator (blank lines) and fill
    /// each sequence with consecutive documents (the last one cut). Attention stays inside a
    /// document, RoPE positions restart per document, and no document's last token is trained
    /// to predict the next document; the CP shards cut documents anywhere (no padding).
    /// Needs --data (the synthetic task is one sequence per row).
    #[arg(long)]
    pack_docs: bool,
    /// Document separator for --pack-docs (`\n` means a newline).
    #[arg(long, default_value = "\\n\\n")]
    doc_separator: String,
    /// HF Llama checkpoint directory to start from (default: random init).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Output directory: metrics.jsonl, loss.png, checkpoints/.
    #[arg(long, default_value = "runs/finetune")]
    out: PathBuf,
    /// Checkpoint every N steps (0 = only at the end).
    #[arg(long, default_value_t = 100)]
    save_every: usize,
    /// Keep the newest N checkpoints (0 = all).
    #[arg(long, default_value_t = 2)]
    keep: usize,
    /// Continue from the newest checkpoint in --out.
    #[arg(long)]
    resume: bool,
    /// Stop after this step without the final checkpoint (simulates a killed run).
    #[arg(long)]
    stop_after: Option<usize>,
    /// Causal sliding-window attention (Mistral `sliding_window`): each token attends to
    /// itself and the N - 1 tokens before it, on every layout (and within each document with
    /// --pack-docs). Overrides the `sliding_window` of a --model checkpoint's config.json,
    /// which is used otherwise; default: none (full causal attention).
    #[arg(long)]
    sliding_window: Option<usize>,
    /// Random-init model width.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Random-init model depth.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Random-init query heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Random-init KV heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Random-init model with biases on the q, k, v projections (Qwen2; saved as
    /// `Qwen2ForCausalLM`). A --model checkpoint's config.json says for itself.
    #[arg(long)]
    qkv_bias: bool,
    /// Random-init model with RMSNorms over each q and k head before RoPE (Qwen3; saved as
    /// `Qwen3ForCausalLM`). A --model checkpoint's config.json says for itself.
    #[arg(long)]
    qk_norm: bool,
    /// Random-init Gemma 3 model (`Gemma3ForCausalLM`: `1 + w` norms, norms after attention and
    /// MLP, GELU MLP, scaled embedding, tied head; with --sliding-window, the window on all
    /// but every sixth layer, which rotate by a RoPE of their own).
    #[arg(long)]
    gemma3: bool,
    /// Random-init vocabulary size: at least what the data needs (the default); larger
    /// leaves unused tokens, as fine-tuning does when it adds special tokens. A size --tp does
    /// not divide (e.g. 99 at --tp 4) pads the vocabulary-parallel tables.
    #[arg(long)]
    vocab: Option<usize>,
    /// Recall task: number of keys (each sequence draws a random key→value map).
    #[arg(long, default_value_t = 8)]
    keys: usize,
    /// Recall task: number of values (chance long-range loss is ln(values)).
    #[arg(long, default_value_t = 8)]
    values: usize,
    /// Recall task: queries (distinct keys) per sequence; default min(keys, T/8).
    #[arg(long)]
    queries: Option<usize>,
    /// Recall task: store a pair as two tokens `k v` (needs an induction circuit: learns
    /// much more slowly) instead of one fused token.
    #[arg(long)]
    unfused: bool,
    /// Training objective: `all` next-token targets, or `long-range` targets only (answer-only
    /// loss). Default: long-range for the synthetic task, all for --data. With long-range,
    /// the progress line also shows the (untrained) all-target loss as `all`.
    #[arg(long)]
    loss_on: Option<String>,
    /// Compute device of the ranks: cpu, or cuda (build with `--features cuda`; with --comm
    /// threads rank r uses GPU r % --gpus, several ranks may share one GPU).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// GPUs to spread the ranks over with --device cuda (--comm nccl: one rank per GPU, so at
    /// least as many as the layout has ranks).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Collectives: `threads` (ranks are threads of this process; tensors cross devices
    /// through the host) or `nccl` (GPUs only, build with `--features nccl`): one thread per
    /// GPU in this process, or, when RANK and WORLD_SIZE are set (a launcher started one
    /// process per GPU), this process's rank (LOCAL_RANK = its GPU, the NCCL id through
    /// MASTER_ADDR:MASTER_PORT or CANDLE_CP_NCCL_ID_FILE).
    #[arg(long, default_value = "threads")]
    comm: String,
    /// Weight dtype: f32, bf16 or f16 (low precision is meant for GPUs).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// ZeRO-1: split the optimizer state over the DP x CP replicas (1/(dp·cp) of it per rank;
    /// same training, same checkpoints).
    #[arg(long)]
    zero1: bool,
    /// ZeRO-2: --zero1, and the replicas' gradients reduce-scattered into f32 slices after
    /// every micro-batch instead of accumulated whole (less memory with --grad-accum > 1).
    #[arg(long)]
    zero2: bool,
    /// Recompute every decoder layer in backward instead of keeping its activations (less
    /// memory at long context, about one more forward of the layers).
    #[arg(long)]
    recompute: bool,
    /// With --recompute: start each layer's gradient reduction over the DP x CP replicas as
    /// soon as its backward is done (on a communicator of its own), overlapping the rest of
    /// the backward. Same training, bit for bit.
    #[arg(long, requires = "recompute")]
    overlap_grad_sync: bool,
    /// With --zero1 or --zero2: start the all-gathers of the updated parameters after the
    /// optimizer step and wait for each layer's only when the next forward reaches it (the
    /// later layers' parameters travel while the earlier ones compute). Same training.
    #[arg(long)]
    overlap_param_gather: bool,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

fn layout(a: &Args) -> Result<Layout> {
    let kind: CpKind = a.cp_kind.parse()?;
    let l = match kind {
        CpKind::TwoD => {
            if !a.cp.is_multiple_of(a.ulysses) {
                bail!(
                    "--cp {} must be a multiple of --ulysses {}",
                    a.cp,
                    a.ulysses
                )
            }
            Layout::two_d(a.ulysses, a.cp / a.ulysses)
        }
        k => Layout::cp(k, a.cp),
    };
    if a.regather_heads && !matches!(kind, CpKind::Ulysses | CpKind::TwoD) {
        bail!("--regather-heads applies to --cp-kind ulysses or 2d, not {kind}")
    }
    let heads = if a.regather_heads { HeadLayout::Regathered } else { HeadLayout::Kept };
    let mut l = l.with_tp(a.tp, a.sp).with_dp(a.dp).with_head_layout(heads);
    match a.row_sums.as_deref() {
        None => {}
        Some("f32") => l = l.with_row_sums(RowSums::F32),
        Some("output") => l = l.with_row_sums(RowSums::Output),
        Some(x) => bail!("--row-sums {x}: expected f32 or output"),
    }
    l.check_degrees()?;
    Ok(l)
}

fn data_source(a: &Args) -> Result<(DataSource, String)> {
    if a.pack_docs && a.data.is_none() {
        bail!("--pack-docs packs the documents of a text corpus: give --data FILE (documents separated by blank lines, or --doc-separator)")
    }
    let Some(path) = &a.data else {
        let mut t = KvRecall::new(a.seq_len)?;
        t.n_keys = a.keys;
        t.n_values = a.values;
        t.n_queries = a.queries.unwrap_or(a.keys.min(a.seq_len / 8));
        t.fused = !a.unfused;
        t.validate()?;
        let desc = format!(
            "synthetic key→value recall: {} keys stored in [T/4, T/2), {} queries in the last quarter (chance long-range loss ln {} = {:.2})",
            t.n_keys,
            t.long_range_targets(),
            t.n_values,
            (t.n_values as f64).ln()
        );
        return Ok((DataSource::Recall(t), desc));
    };
    let bytes =
        std::fs::read(path).with_context(|| format!("reading --data {}", path.display()))?;
    if a.pack_docs {
        return packed_source(a, path, &bytes);
    }
    let stream = match &a.tokenizer {
        None => TokenStream::from_bytes(&bytes),
        Some(tp) => {
            let tok = tokenizers::Tokenizer::from_file(tp)
                .map_err(|e| anyhow::anyhow!("loading --tokenizer {}: {e}", tp.display()))?;
            let text = String::from_utf8_lossy(&bytes);
            let enc = tok
                .encode(text.as_ref(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
            TokenStream {
                tokens: enc.get_ids().to_vec(),
            }
        }
    };
    let desc = format!(
        "{} ({} tokens, {})",
        path.display(),
        stream.tokens.len(),
        if a.tokenizer.is_some() { "tokenizer.json" } else { "byte-level" }
    );
    Ok((DataSource::Text(stream), desc))
}

/// `--pack-docs`: the documents of `bytes`, byte-level or through --tokenizer (each
/// document tokenised on its own).
fn packed_source(a: &Args, path: &std::path::Path, bytes: &[u8]) -> Result<(DataSource, String)> {
    let sep = a.doc_separator.replace("\\n", "\n");
    let stream = match &a.tokenizer {
        None => PackedStream::from_bytes(bytes, sep.as_bytes())?,
        Some(tp) => {
            let tok = tokenizers::Tokenizer::from_file(tp)
                .map_err(|e| anyhow::anyhow!("loading --tokenizer {}: {e}", tp.display()))?;
            let docs = candle_cp_llama::train::packed_data::split_documents(bytes, sep.as_bytes())?
                .into_iter()
                .map(|d| {
                    let enc = tok
                        .encode(String::from_utf8_lossy(d).as_ref(), false)
                        .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
                    Ok(enc.get_ids().to_vec())
                })
                .collect::<Result<Vec<_>>>()?;
            PackedStream::from_documents(docs)?
        }
    };
    let desc = format!(
        "{} ({} tokens in {} documents of {:.1} tokens on average, split on {:?}, {}), packed",
        path.display(),
        stream.len(),
        stream.count(),
        stream.mean_doc_len(),
        sep,
        if a.tokenizer.is_some() { "tokenizer.json" } else { "byte-level" }
    );
    Ok((DataSource::Packed(stream), desc))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let layout = layout(&a)?;
    let (data, data_desc) = data_source(&a)?;
    let model = match &a.model {
        Some(_) if a.vocab.is_some() => bail!("--vocab sizes a random-init model; a --model checkpoint has its own"),
        Some(_) if a.qkv_bias || a.qk_norm || a.gemma3 => bail!("--qkv-bias, --qk-norm and --gemma3 shape a random-init model; a --model checkpoint's config.json says what it has"),
        Some(dir) => ModelSource::Hf(dir.clone()),
        None => {
            let needed = data
                .vocab_needed()
                .max(if a.data.is_some() { 256 } else { 0 });
            let vocab = match a.vocab {
                Some(v) if v < needed => bail!("--vocab {v}: the data needs {needed} tokens"),
                Some(v) => v,
                None => needed,
            };
            let mut cfg = LlamaConfig::tiny(vocab, a.hidden, a.layers, a.heads, a.kv_heads).with_qkv_bias(a.qkv_bias).with_qk_norm(a.qk_norm);
            if [a.qkv_bias, a.qk_norm, a.gemma3].iter().filter(|&&x| x).count() > 1 {
                bail!("--qkv-bias (Qwen2), --qk-norm (Qwen3) and --gemma3: pick one")
            }
            if a.gemma3 {
                let every_sixth_full = (0..a.layers).map(|i| (i + 1) % 6 != 0).collect();
                cfg = cfg.with_gemma3(true).with_sliding_window(a.sliding_window).with_sliding_layers(a.sliding_window.map(|_| every_sixth_full));
            }
            ModelSource::Init(cfg)
        }
    };
    let cuda = match a.device.as_str() {
        "cpu" => false,
        "cuda" => true,
        d => bail!("--device {d}: expected cpu or cuda"),
    };
    let dtype = match a.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        d => bail!("--dtype {d}: expected f32, bf16 or f16"),
    };
    let batch = a
        .batch
        .unwrap_or(if a.data.is_none() { 4 * a.dp } else { a.dp });
    let long_range_only = match a.loss_on.as_deref() {
        None => a.data.is_none(),
        Some("all") => false,
        Some("long-range") => true,
        Some(o) => bail!("--loss-on {o}: expected all or long-range"),
    };
    if a.sliding_window == Some(0) {
        bail!("--sliding-window 0: a window holds at least 1 token (the query itself)")
    }
    if a.overlap_param_gather && !(a.zero1 || a.zero2) {
        bail!("--overlap-param-gather overlaps ZeRO's all-gather of the updated parameters: add --zero1 or --zero2")
    }
    let cfg = TrainConfig {
        layout,
        model,
        data,
        seq_len: a.seq_len,
        batch,
        grad_accum: a.grad_accum,
        steps: a.steps,
        schedule: WarmupCosine {
            peak: a.lr,
            warmup: a.warmup,
            total: a.steps,
            min_ratio: a.min_lr_ratio,
        },
        adamw: AdamWConfig {
            weight_decay: a.weight_decay,
            ..AdamWConfig::default()
        },
        clip: a.clip,
        seed: a.seed,
        out: Some(a.out.clone()),
        save_every: a.save_every,
        keep: a.keep,
        resume: a.resume,
        stop_after: a.stop_after,
        dtype,
        cuda,
        gpus: a.gpus,
        recompute: a.recompute,
        overlap_grad_sync: a.overlap_grad_sync,
        overlap_param_gather: a.overlap_param_gather,
        zero1: a.zero1,
        zero2: a.zero2,
        long_range_only,
        args: serde_json::json!(format!("{a:?}")),
        sliding_window: a.sliding_window,
    };
    let world = layout.world_size();
    let launch = Launch::from_args(&a, world, cuda)?;
    let quiet = launch.quiet();
    // launched processes other than world rank 0 only train; rank 0 reports
    macro_rules! say { ($($t:tt)*) => { if !quiet { println!($($t)*) } } }
    say!(
        "layout   : {layout} ({})",
        launch.describe(world, &a, cuda, dtype)
    );
    say!("data     : {data_desc}");
    if let DataSource::Packed(_) = &cfg.data {
        // the first step's rows (batches are a pure function of (seed, step, row))
        let rows = cfg.data.rows(cfg.seed, 0, 0, batch, a.seq_len)?;
        let counts: Vec<usize> = rows
            .iter()
            .map(|r| r.documents.as_ref().map_or(1, |d| d.count()))
            .collect();
        say!(
            "packing  : documents per sequence at step 1: {counts:?} (attention inside documents, RoPE positions per document, no target across a boundary)"
        );
    }
    say!(
        "batch    : {batch} rows x {} tokens x {} micro-batches per step",
        a.seq_len,
        a.grad_accum
    );
    say!(
        "objective: mean cross-entropy over {} targets",
        if long_range_only {
            "the long-range"
        } else {
            "all next-token"
        }
    );
    let replicas = layout.dp * layout.cp;
    say!(
        "memory   : layers {}; loss through the chunked head (no logits); optimizer state {}",
        if a.recompute {
            "recomputed in backward (--recompute)"
        } else {
            "keep their activations (--recompute to trade compute for memory)"
        },
        if (a.zero1 || a.zero2) && replicas > 1 {
            format!("split over {replicas} DP x CP replicas (--zero{})", if a.zero2 { 2 } else { 1 })
        } else {
            "replicated".to_string()
        }
    );
    if matches!(layout.cp_kind, CpKind::Ulysses | CpKind::TwoD) && layout.cp > 1 {
        say!(
            "attention: {}",
            if a.regather_heads {
                "q, k, v and the output all-to-alled to heads again in the backward (--regather-heads)"
            } else {
                "q, k, v and the output kept in the head layout for the backward (--regather-heads keeps less and sends 50% more all-to-all bytes)"
            }
        );
    }
    if a.dtype != "f32" {
        let rs = layout.effective_row_sums();
        let how = if layout.row_sums.is_some() { "--row-sums" } else { "this CP kind's default" };
        let what = match rs {
            RowSums::F32 => "a bf16 residual kept per attention output element; --row-sums output keeps none",
            RowSums::Output => "nothing kept; --row-sums f32 keeps a bf16 residual per output element for more accurate dq, dk",
        };
        say!("row sums : the attention backward takes them {rs} ({how}: {what})");
    }
    if replicas > 1 {
        let how = if a.zero2 {
            "reduce-scattered into f32 ZeRO-2 slices"
        } else if a.zero1 {
            "reduce-scattered into the ZeRO-1 slices"
        } else {
            "all-reduced"
        };
        let when = match (a.overlap_grad_sync, a.zero2) {
            (true, true) => "layer by layer during every micro-batch's backward (--overlap-grad-sync)",
            (true, false) => "layer by layer during the last micro-batch's backward (--overlap-grad-sync)",
            (false, true) => "after every micro-batch's backward",
            (false, false) => "after the last micro-batch's backward",
        };
        say!("gradients: {how} over the {replicas} DP x CP replicas, {when}");
        if a.zero1 || a.zero2 {
            let when = if a.overlap_param_gather { "layer by layer during the next forward (--overlap-param-gather)" } else { "in the optimizer step" };
            say!("params   : the updated ZeRO slices all-gathered {when}");
        }
    }
    say!("out      : {}", a.out.display());
    if a.resume {
        let root = a.out.join("checkpoints");
        match candle_cp_llama::train::checkpoint::latest_checkpoint(&root)? {
            Some(p) => {
                let old_tp = candle_cp_llama::train::checkpoint::optimizer_tp_degree(&p);
                let how = if old_tp == a.tp {
                    "optimizer state read as saved (same TP degree)".to_string()
                } else {
                    format!("optimizer state resharded from TP {old_tp} to TP {}", a.tp)
                };
                say!("resume   : from {} ({how})", p.display())
            }
            None => say!(
                "resume   : no checkpoint in {}, starting from step 0",
                root.display()
            ),
        }
    }
    let t0 = Instant::now();
    let steps = a.steps;
    let ranks_here = launch.ranks_here(world);
    let on_step = move |m: &StepMetrics| {
        let width = 20;
        let filled = (m.step * width).div_ceil(steps.max(1)).min(width);
        let bar: String = "#".repeat(filled) + &".".repeat(width - filled);
        let lr_loss = m
            .long_range_loss
            .map_or(String::new(), |x| format!("  long-range {x:.3}"));
        let all = if (m.train_loss - m.loss).abs() > 1e-6 {
            format!("  all {:.3}", m.loss)
        } else {
            String::new()
        };
        let mem = m.peak_rss_mib.map_or("n/a".to_string(), |x| {
            format!(
                "{:.0} MiB/rank ({:.0} MiB process)",
                x / ranks_here as f64,
                x
            )
        });
        println!(
            "[{bar}] step {:>4}/{steps}  loss {:.4}{lr_loss}{all}  lr {:.2e}  |g| {:.3}  {:.0} tok/s  peak {mem}  {:.1}s",
            m.step, m.train_loss, m.lr, m.grad_norm, m.tokens_per_s, m.elapsed_s
        );
    };
    let timeout = Duration::from_secs(a.timeout);
    let train = |g: Group| candle_cp_llama::train::train_rank(g, &cfg, &on_step);
    let Some(o) = launch.run(world, timeout, train)? else {
        // a launched process other than world rank 0: rank 0 reports
        return Ok(());
    };

    let c = &o.config;
    let window = match (c.sliding_window, &c.sliding_layers) {
        (None, _) => String::new(),
        (Some(w), None) => format!(", sliding window {w}"),
        (Some(w), Some(l)) => format!(", sliding window {w} on {} of {} layers", l.iter().filter(|&&s| s).count(), l.len()),
    };
    println!(
        "model    : {} {} params (hidden {}, {} layers, {} heads / {} kv heads, vocab {}{window})",
        c.arch().hf_names().0,
        o.n_params,
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size
    );
    if let (Some(first), Some(last)) = (o.metrics.first(), o.metrics.last()) {
        let fmt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.3}"));
        println!(
            "summary  : steps {}..{}  loss {:.3} -> {:.3}  long-range loss {} -> {}  (all-target loss {:.3} -> {:.3})",
            first.step,
            last.step,
            first.train_loss,
            last.train_loss,
            fmt(first.long_range_loss),
            fmt(last.long_range_loss),
            first.loss,
            last.loss
        );
    }
    println!("wall     : {:.1}s", t0.elapsed().as_secs_f64());
    println!(
        "wrote    : {}/metrics.jsonl, {}/loss.png, {}/checkpoints/",
        a.out.display(),
        a.out.display(),
        a.out.display()
    );
    Ok(())
}
