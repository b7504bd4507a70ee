//! Generation (greedy, or sampled with `--temperature`/`--top-k`/`--top-p`/`--sample-seed`)
//! with the KV cache sharded over context-parallel ranks.
//!
//! Loads a Llama checkpoint (default: the tiny-llama oracle, `tests/data/oracle/tiny-llama`),
//! draws a seeded random prompt, and generates twice: on one device, then on `--cp`
//! CPU thread ranks with the layout `--cp-kind` (each rank prefills its shard of the prompt
//! and keeps only that shard's K/V; decode steps attend over the sharded cache with one small
//! all-gather per layer). With `--tp`, each TP rank also keeps only its own heads' K/V
//! (`--sp`: the layout trained with sequence parallelism; generation runs it off). Prints the tokens, prefill and decode time per token, the KV-cache
//! bytes per rank, and exits non-zero if the CP tokens differ from the single-device ones.
//!
//! ```text
//! cargo run --release --example generate
//! cargo run --release --example generate -- --cp 2 --cp-kind ulysses --prompt-len 512
//! cargo run --release --example generate -- --sliding-window 128 --new-tokens 32
//! cargo run --release --example generate -- --cp 2 --tp 4 --sp   # TP 4 > the 2 KV heads
//! cargo run --release --example generate -- --cp 2 --dp 2 --batch 2
//! cargo run --release --example generate -- --temperature 0.8 --top-p 0.9 --sample-seed 3
//! cargo run --release --example generate -- --stop-at-eos --new-tokens 256
//! cargo run --release --example generate -- --model DIR --prompt "The capital of France is" --stop-at-eos
//! cargo run --release --example generate -- --model /path/to/hf/llama --prompt-len 4096
//! cargo run --release --example generate -- --model DIR --chat --system "Be brief." --prompt "Hi?" --stop-at-eos
//! cargo run --release --example generate -- --model DIR --chat --messages conversation.json --prompt "And then?"
//! cargo run --release --example generate -- --model DIR --prompts questions.txt --stop-at-eos
//! cargo run --release --example generate -- --model DIR --prompts questions.txt --temperature 1 --best-of 8 --reward-model RM
//! cargo run --release --example generate -- --model DIR --prompts questions.txt --temperature 1 --best-of 8 --reward-model PRM --step-aggregate min
//! ```

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::train::reward::Judge;
use candle_cp_llama::{
    load_hf_sharded, CpKind, Generation, Layout, Llama, LlamaConfig, ParallelCtx, Sampling,
};
use candle_cp_llama::chat::{ChatTemplate, Message};
use candle_nn::VarBuilder;
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser)]
struct Args {
    /// HF checkpoint directory (config.json + *.safetensors); default: the tiny-llama oracle.
    #[arg(long)]
    model: Option<PathBuf>,
    /// A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) to run
    /// over --model; default: --model's own adapter when it is a LoRA run's checkpoint.
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// Run the adapter over the base quantized as a QLoRA run trained it (finetune_llama's
    /// --quantize-base: `int8` or `nf4`, `,GROUP`, `,dq`), each layer dequantized when used.
    /// Needs an adapter.
    #[arg(long, value_name = "KIND[,GROUP[,dq]]")]
    quantize_base: Option<String>,
    /// Number of CP ranks (threads).
    #[arg(long, default_value_t = 4)]
    cp: usize,
    /// ring | zigzag | striped | allgather | ulysses | 2d (2d: ulysses 2 × ring cp/2).
    #[arg(long, default_value = "zigzag")]
    cp_kind: String,
    /// Prompt length T of the seeded random prompt (any length: the longest prefix that suits
    /// the layout is prefilled, the rest decoded).
    #[arg(long, default_value_t = 1024)]
    prompt_len: usize,
    /// Generate from this text instead (every --batch row the same), tokenised by --tokenizer;
    /// the tokens generated are printed as text too.
    #[arg(long)]
    prompt: Option<String>,
    /// Generate from every non-empty line of this text file (each line a prompt; with --chat
    /// each a user's turn, after --system) in one batch: prompts of different lengths are
    /// padded on the left and the padding masked (`Llama::generate_ragged`); one row per line
    /// (--batch unused; with --dp, the lines divisible by it).
    #[arg(long, value_name = "FILE")]
    prompts: Option<PathBuf>,
    /// Send --prompt as a user's turn through the chat template (--chat-template, else the
    /// model's own), the assistant's header after it; the template's end-of-turn token is a stop
    /// token when the tokenizer holds it as one token.
    #[arg(long)]
    chat: bool,
    /// The chat template of --chat: llama3, chatml, qwen3, qwen3-thinking, qwen3-no-think, gemma, phi3, phi4, granite, deepseek, harmony, glm4, glm4.5, olmo2, tulu, exaone4, exaone3.5, mistral-v1, mistral-v3 or mistral-v7 (default:
    /// the family of the model's chat_template.jinja / tokenizer_config.json).
    #[arg(long, value_name = "NAME")]
    chat_template: Option<String>,
    /// A system turn before --chat's user turn.
    #[arg(long)]
    system: Option<String>,
    /// With --chat: the conversation so far, a JSON file holding a list of {"role", "content"}
    /// messages (or an object with them as `messages`: a line of TRL's data); --prompt, when
    /// given, is the user's next turn after them.
    #[arg(long, value_name = "FILE.json")]
    messages: Option<PathBuf>,
    /// HF tokenizer.json for --prompt (default: the model's own tokenizer.json; bytes when it
    /// has none).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    new_tokens: usize,
    /// Batch rows (independent prompts).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Sliding-window attention of N keys (overrides the checkpoint's `sliding_window`).
    #[arg(long)]
    sliding_window: Option<usize>,
    /// Prompt seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Sample with this softmax temperature (default: greedy).
    #[arg(long)]
    temperature: Option<f64>,
    /// With --temperature: keep the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// With --temperature: keep the most likely tokens up to this cumulative probability.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// With --temperature: seed of the sampler (the same on every rank and on one device).
    #[arg(long, default_value_t = 0)]
    sample_seed: u64,
    /// Tensor-parallel degree (must divide the query heads; each rank keeps lcm(KV heads, tp)/tp
    /// KV heads, copies counted: its share, one replicated head, or the copies its query heads
    /// use). World = cp · tp threads.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Sequence parallelism on the TP group (as the model was trained; decoding runs it off).
    #[arg(long)]
    sp: bool,
    /// Data-parallel replicas, each generating `--batch / dp` rows. World = dp · cp · tp.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Compute device: cpu, or cuda (build with `--features cuda`): the single-device run and
    /// every thread rank on GPU 0 (virtual ranks).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// End each row at its first token among these ids (kept; at most --new-tokens per row);
    /// generation ends when every row has stopped.
    #[arg(long, value_delimiter = ',', value_name = "ID[,ID...]")]
    stop: Vec<u32>,
    /// Stop at the checkpoint's end-of-sequence ids too (`eos_token_id` of its
    /// generation_config.json, else of its config.json).
    #[arg(long)]
    stop_at_eos: bool,
    /// Best-of-N: sample N completions of every prompt (needs --temperature) and keep the one
    /// --reward-model scores highest (rejection sampling), on one device and on the layout.
    #[arg(long, value_name = "N")]
    best_of: Option<usize>,
    /// The reward model of --best-of: a *ForSequenceClassification checkpoint of one label
    /// sharing the model's tokenizer (or a LoRA reward run's checkpoint), or a process reward
    /// model (a *ForTokenClassification, e.g. from finetune_llama --prm), which judges each
    /// completion's steps.
    #[arg(long, value_name = "DIR")]
    reward_model: Option<PathBuf>,
    /// A process reward model's steps end at this text's tokens (`\n` is a newline).
    #[arg(long, default_value = "\\n")]
    step_separator: String,
    /// How a process reward model's step probabilities make a completion's reward: min, last
    /// or prod.
    #[arg(long, default_value = "min")]
    step_aggregate: String,
}

#[path = "generate_best_of.rs"]
mod best_of;

/// The messages of `--messages FILE`: a JSON list of {"role", "content"}, or an object holding
/// it as `messages`; errors name the file.
fn read_messages(path: &Path) -> anyhow::Result<Vec<Message>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading --messages {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("--messages {}", path.display()))?;
    let list = v.get("messages").unwrap_or(&v);
    candle_cp_llama::chat::parse_messages(list, "--messages").with_context(|| format!("--messages {}", path.display()))
}

/// Seeded random ids `[b, t]` below `vocab` (the training SplitMix64 `Rng`).
fn random_prompt(b: usize, t: usize, vocab: usize, seed: u64) -> candle_core::Result<Tensor> {
    let mut rng = candle_cp_llama::train::rng::Rng::new(seed);
    let ids: Vec<u32> = (0..b * t).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
    Tensor::from_vec(ids, (b, t), &Device::Cpu)
}

/// Generate on every rank of `layout`; results in rank order.
#[allow(clippy::too_many_arguments)]
fn run(
    dev: &Device,
    dir: &Path,
    adapter: Option<&Path>,
    quant: Option<candle_cp_nn::QuantConfig>,
    cfg: &LlamaConfig,
    layout: Layout,
    (rows, ragged): (&[Vec<u32>], bool),
    new: usize,
    sampling: Sampling,
    stop: &[u32],
) -> anyhow::Result<Vec<Generation>> {
    // rows of one length as one [B, T] prompt (any T: its tail decoded), else left-padded
    let prompt = match ragged {
        true => None,
        false => Some(Tensor::from_vec(rows.concat(), (rows.len(), rows.first().map_or(0, Vec::len)), &Device::Cpu)?),
    };
    let res = run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        // each rank reads only its own shards (memory-mapped, one tensor at a time)
        let (vm, _) = load_hf_sharded(dir, &ctx, dev, DType::F32)?;
        // a PEFT adapter's shards beside the base model's
        let lora_cfg = match adapter {
            Some(ad) => match candle_cp_llama::lora::load_adapter_sharded(ad, cfg, &vm, &ctx, DType::F32, dev)? {
                Some(c) => Some(c),
                None => candle_core::bail!("{}: no adapter_config.json (not a PEFT adapter)", ad.display()),
            },
            None => None,
        };
        let m = match (quant, &lora_cfg) {
            // (an adapter merged into the weights once: no adapter work per decode step)
            (None, _) => Llama::new(VarBuilder::from_varmap(&vm, DType::F32, dev), lora_cfg.as_ref().unwrap_or(cfg), &ctx)?.with_adapters_merged()?,
            // the model a QLoRA run computed with: the frozen projections as codes
            (Some(q), Some(lc)) => Llama::new_quantized(&candle_cp_llama::quant::QuantBase::from_varmap(&vm, lc, q)?, DType::F32, dev, lc, &ctx)?,
            (Some(_), None) => candle_core::bail!("--quantize-base runs an adapter over a quantized base: give --adapter (or a LoRA run's checkpoint as --model)"),
        };
        match &prompt {
            Some(p) => m.generate_until(p, new, sampling, stop),
            None => m.generate_ragged(rows, new, sampling, stop),
        }
    });
    res.into_iter()
        .enumerate()
        .map(|(r, x)| x.with_context(|| format!("{layout}: rank {r}")))
        .collect()
}

/// (prefill ms per prompt token, decode ms per generated token) of the slowest rank.
fn per_token_ms(gens: &[Generation], t: usize) -> (f64, f64, f64) {
    let new = gens.iter().map(|g| g.logits.len()).max().unwrap_or(0);
    let pre = gens
        .iter()
        .map(|g| g.prefill_time.as_secs_f64())
        .fold(0.0, f64::max)
        * 1e3;
    let dec = gens
        .iter()
        .map(|g| g.decode_time.as_secs_f64())
        .fold(0.0, f64::max)
        * 1e3;
    (
        pre,
        pre / t as f64,
        if new > 1 { dec / (new - 1) as f64 } else { 0.0 },
    )
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let model = a.model.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/oracle/tiny-llama")
    });
    // the base model and the adapter run over it: --adapter over --model, or a LoRA run's
    // checkpoint (its adapter, naming its base)
    let (dir, adapter) = match &a.adapter {
        Some(ad) => (model.clone(), Some(ad.clone())),
        None => (candle_cp_llama::lora::base_model_dir(&model)?, candle_cp_llama::lora::has_adapter(&model).then(|| model.clone())),
    };
    let quant = a.quantize_base.as_deref().map(|q| q.parse::<candle_cp_nn::QuantConfig>().map_err(|e| anyhow::anyhow!("--quantize-base {q}: {e}"))).transpose()?;
    if quant.is_some() && adapter.is_none() {
        anyhow::bail!("--quantize-base runs an adapter over a quantized base: give --adapter (or a LoRA run's checkpoint as --model)")
    }
    let mut cfg = LlamaConfig::from_file(dir.join("config.json"))
        .with_context(|| format!("config of {}", dir.display()))?;
    if a.sliding_window.is_some() {
        cfg = cfg.with_sliding_window(a.sliding_window);
    }
    let dev = match a.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        d => bail!("--device {d}: expected cpu or cuda"),
    };
    let kind: CpKind = a.cp_kind.parse()?;
    let layout = match kind {
        CpKind::TwoD => {
            if a.cp < 2 || a.cp % 2 != 0 {
                bail!(
                    "--cp-kind 2d needs an even --cp (ulysses 2 × ring cp/2), got {}",
                    a.cp
                )
            }
            Layout::two_d(2, a.cp / 2)
        }
        k => Layout::cp(k, a.cp),
    }
    .with_tp(a.tp, a.sp)
    .with_dp(a.dp);
    layout.validate(cfg.num_attention_heads, cfg.num_key_value_heads)?;
    let new = a.new_tokens;
    // --prompt: through the tokenizer (or bytes); else a seeded random prompt
    let tok_path = a.tokenizer.clone().or_else(|| Some(dir.join("tokenizer.json")).filter(|p| p.exists()));
    if (a.system.is_some() || a.chat_template.is_some() || a.messages.is_some()) && !a.chat {
        bail!("--system, --chat-template and --messages go with --chat")
    }
    if a.chat && a.prompt.is_none() && a.messages.is_none() && a.prompts.is_none() {
        bail!("--chat sends a conversation through a chat template: give --prompt TEXT (the user's turn) and / or --messages FILE.json, or --prompts FILE")
    }
    if a.prompts.is_some() && (a.prompt.is_some() || a.messages.is_some()) {
        bail!("--prompts FILE gives every prompt: not with --prompt or --messages")
    }
    let from_text = a.prompt.is_some() || a.messages.is_some() || a.prompts.is_some();
    let tokenizer = match (from_text, &tok_path) {
        (true, Some(p)) => Some(tokenizers::Tokenizer::from_file(p).map_err(|e| anyhow::anyhow!("loading tokenizer {}: {e}", p.display()))?),
        _ => None,
    };
    let chat = match (a.chat, &a.chat_template) {
        (false, _) => None,
        (true, Some(name)) => Some(ChatTemplate::from_name(name)?),
        (true, None) => Some(ChatTemplate::of_model_dir(&dir)?),
    };
    // the template's text carries its own BOS: no special tokens added then
    let encode = |text: &str| -> anyhow::Result<Vec<u32>> {
        Ok(match &tokenizer {
            Some(tk) => tk.encode(text, chat.is_none()).map_err(|e| anyhow::anyhow!("tokenizing --prompt: {e}"))?.get_ids().to_vec(),
            None => text.bytes().map(u32::from).collect(),
        })
    };
    let mut chat_stop = Vec::new();
    // the template's end-of-turn token (when one token) stops generation
    let mut templated = |t: &ChatTemplate, turns: &[Message]| -> anyhow::Result<Vec<u32>> {
        let rendered = t.render_text(turns, true)?;
        println!("chat template {}: {rendered:?}", t.name());
        if let [id] = encode(t.end_of_turn())?[..] {
            if !chat_stop.contains(&id) {
                chat_stop.push(id);
            }
        }
        encode(&rendered)
    };
    let system: Vec<Message> = a.system.iter().map(|s| Message::new("system", s)).collect();
    let rows: Vec<Vec<u32>> = match (from_text, &a.prompts) {
        (true, Some(file)) => {
            let text = std::fs::read_to_string(file).with_context(|| format!("reading --prompts {}", file.display()))?;
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            if lines.is_empty() {
                bail!("--prompts {}: no prompt (every line is empty)", file.display())
            }
            lines
                .iter()
                .map(|line| match &chat {
                    Some(t) => templated(t, &system.iter().cloned().chain([Message::new("user", line)]).collect::<Vec<_>>()),
                    None => encode(line),
                })
                .collect::<anyhow::Result<_>>()?
        }
        (true, None) => {
            let ids = match (&chat, &a.prompt) {
                (None, Some(text)) => encode(text)?,
                (None, None) => bail!("--messages goes with --chat"),
                (Some(t), _) => {
                    let earlier = match &a.messages {
                        Some(f) => read_messages(f)?,
                        None => Vec::new(),
                    };
                    let turns: Vec<Message> = system.iter().cloned().chain(earlier).chain(a.prompt.iter().map(|p| Message::new("user", p))).collect();
                    templated(t, &turns)?
                }
            };
            vec![ids; a.batch]
        }
        (false, _) => random_prompt(a.batch, a.prompt_len, cfg.vocab_size, a.seed)?.to_vec2::<u32>()?,
    };
    for (i, ids) in rows.iter().enumerate() {
        if ids.is_empty() || ids.iter().any(|&x| x as usize >= cfg.vocab_size) {
            bail!("prompt {i}: {} tokens {:?}: needs at least one, each below the vocabulary {}", ids.len(), &ids[..ids.len().min(8)], cfg.vocab_size)
        }
    }
    let ragged = rows.iter().any(|r| r.len() != rows[0].len());
    let t = rows.iter().map(Vec::len).max().unwrap_or(0);
    let as_text = |row: &[u32]| -> String {
        match &tokenizer {
            Some(tk) => tk.decode(row, false).unwrap_or_else(|e| format!("<undecodable: {e}>")),
            None => String::from_utf8_lossy(&row.iter().map(|&x| x as u8).collect::<Vec<_>>()).into_owned(),
        }
    };
    println!(
        "model {} ({} {} layers, hidden {}, {} heads / {} kv, vocab {}), window {:?}{}; prompt [{}, {t}]{} ({}), {new} new tokens",
        dir.display(),
        cfg.arch().hf_names().0,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
        cfg.sliding_window,
        cfg.sliding_layers.as_ref().map_or(String::new(), |l| format!(" on {} of the layers", l.iter().filter(|&&s| s).count())),
        rows.len(),
        if ragged { format!(" (lengths {:?}, padded on the left in one batch)", rows.iter().map(Vec::len).collect::<Vec<_>>()) } else { String::new() },
        match (from_text, &tok_path) {
            (true, Some(p)) => format!("text through {}", p.display()),
            (true, None) => "text as bytes".to_string(),
            (false, _) => format!("seed {}", a.seed),
        }
    );

    let sampling = match a.temperature {
        None => Sampling::Greedy,
        Some(temperature) => Sampling::Sample { temperature, top_k: a.top_k, top_p: a.top_p, seed: a.sample_seed },
    };
    println!("sampling: {sampling:?}");
    let mut stop = a.stop.clone();
    stop.extend(chat_stop);
    if a.stop_at_eos {
        stop.extend(candle_cp_llama::stop_tokens(&dir)?);
    }
    if !stop.is_empty() {
        println!("stop tokens: {stop:?}");
    }
    if let Some(ad) = &adapter {
        println!("adapter: {} (PEFT LoRA, over the model{})", ad.display(), quant.map(|q| format!(" quantized {q}")).unwrap_or_default());
    }
    match (a.best_of, &a.reward_model) {
        (Some(n), Some(rm)) => {
            if adapter.is_some() || quant.is_some() || a.sliding_window.is_some() {
                bail!("--best-of samples the model as its checkpoint holds it: not with an adapter, --quantize-base or --sliding-window")
            }
            // (a process reward model judges the steps: the separator's tokens, no special ones)
            let rm_cfg = candle_cp_llama::LlamaConfig::from_file(candle_cp_llama::lora::base_model_dir(rm)?.join("config.json"))?;
            let separator: Vec<u32> = match &tokenizer {
                Some(tk) => tk.encode(a.step_separator.replace("\\n", "\n"), false).map_err(|e| anyhow::anyhow!("tokenizing --step-separator: {e}"))?.get_ids().to_vec(),
                None => a.step_separator.replace("\\n", "\n").bytes().map(u32::from).collect(),
            };
            let judge = match rm_cfg.token_classifier {
                Some(_) => Judge::Process { separator: &separator, aggregate: a.step_aggregate.parse()? },
                None => Judge::Outcome,
            };
            let b = best_of::BestOf { dev: &dev, policy: &dir, reward_model: rm, judge, rows: &rows, n, new, sampling, stop: &stop };
            return best_of::run(&b, layout, &|t: &[u32]| as_text(t));
        }
        (None, None) => {}
        _ => bail!("--best-of N and --reward-model DIR go together"),
    }
    let single = run(&dev, &dir, adapter.as_deref(), quant, &cfg, Layout::single(), (&rows, ragged), new, sampling, &stop)
        .with_context(|| format!("weights of {}", dir.display()))?;
    let cp = run(&dev, &dir, adapter.as_deref(), quant, &cfg, layout, (&rows, ragged), new, sampling, &stop)?;
    let s = &single[0];
    for (name, gens) in [("single device", &single), (&*format!("{layout}"), &cp)] {
        let (pre, pre_tok, dec_tok) = per_token_ms(gens, t);
        println!("\n{name}:");
        for (i, row) in gens[0].tokens.iter().enumerate() {
            let end = if gens[0].stopped.get(i) == Some(&true) { " (stopped)" } else { "" };
            println!("  tokens[{i}]    {row:?}{end}");
            if from_text {
                println!("  text[{i}]      {:?}", as_text(row));
            }
        }
        println!("  prefill      {pre:.1} ms ({pre_tok:.3} ms / prompt token)");
        println!("  decode       {dec_tok:.2} ms / token");
        let bytes: Vec<String> = gens.iter().map(|g| format!("{}", g.cache_bytes)).collect();
        println!(
            "  KV cache     {} B per rank [{}] (rows {:?})",
            gens[0].cache_bytes,
            bytes.join(", "),
            gens.iter().map(|g| g.cache_rows).collect::<Vec<_>>()
        );
    }
    let max_rank = cp.iter().map(|g| g.cache_bytes).max().unwrap_or(0);
    println!(
        "\nKV cache per rank: max {max_rank} B = {:.3} of single device ({} B; 1/CP = {:.3}, times {}/{} KV heads per TP rank, times 1/DP = {:.3})",
        max_rank as f64 / s.cache_bytes.max(1) as f64,
        s.cache_bytes,
        1.0 / layout.cp as f64,
        candle_cp_nn::blocks_per_rank(cfg.num_key_value_heads, layout.tp),
        cfg.num_key_value_heads,
        1.0 / layout.dp as f64
    );
    let mut worst = 0f32;
    for g in &cp {
        for (x, y) in g.logits.iter().zip(&s.logits) {
            worst = worst.max((x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
        }
    }
    println!("logits max |CP - single| over all generated tokens and ranks: {worst:.2e}");
    let agree = cp.iter().all(|g| g.tokens == s.tokens);
    if !agree {
        bail!("{layout}: generated tokens differ from the single-device ones")
    }
    println!("tokens: identical to single device on every rank");
    Ok(())
}
