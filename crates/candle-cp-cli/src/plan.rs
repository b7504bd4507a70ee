//! `candle-cp plan`: memory, FLOPs and communication of a layout, whether it fits, and what
//! one optimizer step takes.
//!
//! Formulas: `docs/arithmetic.md`; arithmetic: the `candle-cp-plan` crate.

use candle_cp_plan::{
    plan, report, ActivationModel, AttnRates, CpKind, Dtype, Hardware, Layout, ModelConfig,
    Overlap, PlanInput, Recompute,
};

/// Model, sequence, hardware and rate flags shared by `candle-cp plan` and `candle-cp search`.
#[derive(clap::Args, Debug)]
pub struct CommonArgs {
    /// Model: llama3-8b, llama3-70b, llama3-405b, qwen2.5-7b, qwen2.5-72b, qwen3-8b, qwen3-32b,
    /// gemma3-1b, gemma3-4b, gemma3-12b, gemma3-27b, gemma2-2b, gemma2-9b, gemma2-27b,
    /// qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, phi3-mini, phi3-medium, phi4-mini, phi4, gpt-oss-20b, gpt-oss-120b, smollm3-3b, mistral-small-24b, olmo2-7b, olmo3-7b, olmo3-32b, olmoe-1b-7b, exaone4-32b, granite3-1b-a400m, granite3-3b-a800m, glm4-9b, glm4.5-air, glm4.5, deepseek-v3, kimi-k2, or the path of a Hugging Face config.json
    /// (the architectures candle-cp-llama reads: Llama, Mistral, Qwen2 / 3, the MoEs, Gemma 2 / 3, Phi-3, gpt-oss, SmolLM3, Granite, OLMo, EXAONE 4, GLM, DeepSeek-V3 / V2).
    #[arg(long)]
    pub model: String,
    /// Global sequence length in tokens (all CP ranks together).
    #[arg(long)]
    pub seq: usize,
    /// Causal sliding window in tokens (query i sees keys i-W < j <= i); overrides the
    /// model's `sliding_window`. Cuts the attention FLOPs; on the ring, W - 1 <= the shard
    /// (s/CP) is a halo exchange of the W - 1 K/V rows before each shard, a longer window a
    /// ring of the few hops it reaches on contiguous shards.
    #[arg(long)]
    pub sliding_window: Option<usize>,
    /// Packed documents of L tokens (the last one possibly shorter), attention kept inside
    /// each document (with --sliding-window: a window inside each). L >= --seq is one
    /// document. Cuts the attention FLOPs and makes the ring a halo exchange of
    /// min(R-1, ceil((min(L, W)-1)/c)) hops on contiguous shards.
    #[arg(long)]
    pub doc_len: Option<usize>,
    /// Sequences per micro-batch (per data-parallel replica).
    #[arg(long, default_value_t = 1)]
    pub micro_batch: usize,
    /// Training dtype: bf16, fp16 or fp32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Hardware preset: h100 (80 GB) or h200 (141 GB); the flags below override it.
    #[arg(long, default_value = "h100")]
    pub hardware: String,
    /// GPU memory, GB (10^9 bytes).
    #[arg(long)]
    pub gpu_mem_gb: Option<f64>,
    /// LoRA fine-tuning: adapters of rank R on q, k, v, o (finetune_llama --lora R,ALPHA),
    /// every other weight frozen: gradients and Adam state for the adapters only. 0: full
    /// fine-tuning.
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub lora: usize,
    /// With --lora: the MLP projections (gate, up, down) too (gpt-oss: its experts as PEFT's
    /// target_parameters adapt them, gate and up sharing one A).
    #[arg(long)]
    pub lora_mlp: bool,
    /// With --lora: DoRA (finetune_llama --dora): a magnitude per output row, and each adapted
    /// weight's DoRA copy kept for the backward (one layer's with --recompute full).
    #[arg(long)]
    pub dora: bool,
    /// With --lora: modules trained whole beside the adapters (finetune_llama
    /// --lora-modules-to-save): embed_tokens, lm_head, or a reward model's score (its head).
    #[arg(long, value_name = "M,..")]
    pub lora_modules_to_save: Option<String>,
    /// With --lora: the frozen base quantized (finetune_llama --quantize-base): int8 or nf4,
    /// optionally ,GROUP (inputs per scale, default 64) and ,dq (double-quantized scales: u8
    /// each, blocks of 16 rows; ,dqROWS another block).
    #[arg(long, value_name = "KIND[,GROUP[,dq]]")]
    pub quant_base: Option<String>,
    /// Dense bf16 peak, TFLOP/s.
    #[arg(long)]
    pub flops: Option<f64>,
    /// NVLink bandwidth per GPU, one direction, GB/s (gigaBYTES; preset 450).
    #[arg(long)]
    pub nvlink_gbps: Option<f64>,
    /// InfiniBand bandwidth per GPU, GB/s (gigaBYTES; preset 50 = 400 Gb/s).
    #[arg(long)]
    pub ib_gbps: Option<f64>,
    /// GPUs per NVLink domain (node).
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    /// Achieved attention rate, TFLOP/s (overlap check and attention time).
    #[arg(long, default_value_t = 600.0)]
    pub attn_tflops: f64,
    /// Measured attention rates by sequence length: gpu_bench's JSON lines (bench.jsonl of
    /// scripts/gpu-check.sh). Attention is then priced at the rate of the length each layout's
    /// kernel calls run (the chunk s/cp for the ring), interpolated in log T, from the rows
    /// measured at the model's head dim (else the nearest measured one, said in the report);
    /// replaces --attn-tflops.
    #[arg(long, conflicts_with = "attn_tflops")]
    pub attn_rates: Option<std::path::PathBuf>,
    /// Achieved rate of the linear layers, TFLOP/s [default: 70% of the hardware peak].
    #[arg(long)]
    pub linear_tflops: Option<f64>,
    /// Activation count driving the per-GPU totals: korthikanti (34·sbh), llama (exact count
    /// of a fused Llama layer) or candle-cp (what this workspace's Llama keeps, measured)
    /// [default: korthikanti; candle-cp for `search --finetune-llama`].
    #[arg(long)]
    pub activations: Option<String>,
    /// Attention stores its s×s scores (no flash attention).
    #[arg(long)]
    pub no_flash: bool,
    /// Ulysses and 2-D CP: the backward all-to-alls q, k, v and the attention output to heads
    /// again instead of keeping them (finetune_llama --regather-heads): less activation
    /// memory under --activations candle-cp, more Ulysses backward bytes.
    #[arg(long)]
    pub regather_heads: bool,
    /// Where the attention backward's row sums come from (finetune_llama --row-sums): f32
    /// (the output's bf16 rounding residual joins the candle-cp count for 16-bit activations)
    /// or output (none) [default: f32 for the ring kinds and 2d, output on one device and for
    /// ulysses].
    #[arg(long)]
    pub row_sums: Option<String>,
    /// dK/dV accumulated and sent in fp32 in the CP backward.
    #[arg(long)]
    pub dkv_fp32: bool,
    /// Gradient sync the step time takes as hidden: none, grad (reduction during the
    /// backward, --overlap-grad-sync), gather (ZeRO-1/2's parameter all-gather during the
    /// next forward, --overlap-param-gather) or all (both).
    #[arg(long, default_value = "all")]
    pub overlap: String,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `candle-cp plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Context-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub cp: usize,
    /// Pipeline-parallel degree (1F1B schedule assumed).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Model chunks per pipeline rank: Megatron's interleaved 1F1B schedule (1: plain 1F1B).
    #[arg(long, default_value_t = 1)]
    pub virtual_stages: usize,
    /// Data-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Expert-parallel degree (a mixture of experts): the experts split over `ep` of the
    /// dp·cp ranks. Must divide dp·cp and the experts.
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Megatron sequence parallelism on the TP group.
    #[arg(long)]
    pub sp: bool,
    /// CP kind: ring (zigzag), allgather, ulysses, 2d.
    #[arg(long, default_value = "ring")]
    pub cp_kind: String,
    /// Ulysses degree inside CP for --cp-kind 2d (ring degree = cp / ulysses).
    #[arg(long, default_value_t = 1)]
    pub ulysses: usize,
    /// Activation recomputation: none, selective, full.
    #[arg(long, default_value = "none")]
    pub recompute: String,
    /// ZeRO stage 0-3 (optimizer / +gradients / +weights sharded over DP x CP).
    #[arg(long, default_value_t = 1)]
    pub zero: u8,
    /// Micro-batches per optimizer step per data-parallel replica (gradient accumulation;
    /// the pipeline's micro-batches) [default: --pp].
    #[arg(long)]
    pub micro_batches: Option<usize>,
}

/// Builds the planner input from the shared flags and `layout`; errors name the bad value.
pub fn input_from_common(a: &CommonArgs, mut layout: Layout) -> anyhow::Result<PlanInput> {
    (layout.lora_rank, layout.lora_mlp, layout.lora_dora) = (a.lora, a.lora_mlp, a.dora);
    let saved: Vec<&str> = a.lora_modules_to_save.as_deref().map(|m| m.split(',').map(|m| m.trim()).collect()).unwrap_or_default();
    for m in &saved {
        match *m {
            "embed_tokens" => layout.lora_save_embed = true,
            // (a reward model's head is its score head)
            "lm_head" | "score" => layout.lora_save_head = true,
            other => anyhow::bail!("--lora-modules-to-save {other}: embed_tokens, lm_head or score"),
        }
    }
    if (layout.lora_save_embed || layout.lora_save_head) && a.lora == 0 {
        anyhow::bail!("--lora-modules-to-save trains modules beside the LoRA adapters: give the adapters' rank with --lora R")
    }
    if a.dora && a.lora == 0 {
        anyhow::bail!("--dora decomposes the LoRA adapters' weights: give the adapters' rank with --lora R")
    }
    layout.base_quant = a.quant_base.as_deref().map(candle_cp_plan::layout::BaseQuant::parse).transpose()?;
    if layout.base_quant.is_some() && a.lora == 0 {
        anyhow::bail!("--quant-base quantizes a LoRA run's frozen base: give the adapters' rank with --lora R")
    }
    if a.lora_mlp && a.lora == 0 {
        anyhow::bail!("--lora-mlp adapts the MLP projections too: give the adapters' rank with --lora R")
    }
    let mut model = ModelConfig::from_name_or_path(&a.model)?;
    // (score is a reward model's head, lm_head a causal LM's)
    match (model.score_head.is_some(), saved.iter().find(|m| matches!(**m, "lm_head" | "score"))) {
        (true, Some(&"lm_head")) => anyhow::bail!("--lora-modules-to-save lm_head: {} is a reward model, its head is score", a.model),
        (false, Some(&"score")) => anyhow::bail!("--lora-modules-to-save score: {} is a causal LM, its head is lm_head", a.model),
        _ => {}
    }
    if let Some(w) = a.sliding_window {
        if w == 0 {
            anyhow::bail!("--sliding-window must be at least 1 token, got 0")
        }
        // on every layer (a window the config had on some layers only goes)
        (model.sliding_window, model.partial_window) = (Some(w), None);
    }
    let mut hw = Hardware::preset(&a.hardware)?;
    if let Some(x) = a.gpu_mem_gb {
        hw.mem_bytes = x * 1e9;
    }
    if let Some(x) = a.flops {
        hw.peak_flops = x * 1e12;
    }
    if let Some(x) = a.nvlink_gbps {
        hw.nvlink_bw = x * 1e9;
    }
    if let Some(x) = a.ib_gbps {
        hw.ib_bw = x * 1e9;
    }
    if let Some(x) = a.gpus_per_node {
        hw.gpus_per_node = x;
    }
    let overridden = a.gpu_mem_gb.is_some()
        || a.flops.is_some()
        || a.nvlink_gbps.is_some()
        || a.ib_gbps.is_some();
    if overridden {
        hw.name = format!("{} (overridden)", hw.name);
    }
    let layout = Layout {
        flash: !a.no_flash,
        regather_heads: a.regather_heads,
        f32_row_sums: match a.row_sums.as_deref() {
            None => None,
            Some("f32") => Some(true),
            Some("output") => Some(false),
            Some(x) => anyhow::bail!("--row-sums {x}: expected f32 or output"),
        },
        ..layout
    };
    if a.doc_len == Some(0) {
        anyhow::bail!("--doc-len must be at least 1 token, got 0")
    }
    let mut input = PlanInput::new(model, hw, layout, a.seq);
    input.doc_len = a.doc_len;
    input.micro_batch = a.micro_batch;
    input.dtype = Dtype::parse(&a.dtype)?;
    input.dkv_fp32 = a.dkv_fp32;
    input.overlap = Overlap::parse(&a.overlap)?;
    input.activation_model = ActivationModel::parse(a.activations.as_deref().unwrap_or("korthikanti"))?;
    input.attn_flops = a.attn_tflops * 1e12;
    if let Some(path) = &a.attn_rates {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--attn-rates {}: {e}", path.display()))?;
        input.attn_rates = Some(AttnRates::from_bench_jsonl(&text, &path.display().to_string(), input.model.head_dim)?);
    }
    if let Some(x) = a.linear_tflops {
        input.linear_flops = x * 1e12;
    }
    Ok(input)
}

/// Builds the planner input from the flags of `candle-cp plan`; errors name the bad value.
pub fn input_from_args(a: &PlanArgs) -> anyhow::Result<PlanInput> {
    let layout = Layout {
        tp: a.tp,
        sp: a.sp,
        cp: a.cp,
        cp_kind: CpKind::parse(&a.cp_kind)?,
        ulysses: a.ulysses,
        pp: a.pp,
        virtual_stages: a.virtual_stages,
        dp: a.dp,
        ep: a.ep,
        zero: a.zero,
        recompute: Recompute::parse(&a.recompute)?,
        flash: true,
        regather_heads: false,
        f32_row_sums: None,
        lora_rank: 0,
        lora_mlp: false,
        lora_dora: false,
        lora_save_embed: false,
        lora_save_head: false,
        base_quant: None,
    };
    let mut input = input_from_common(&a.common, layout)?;
    input.micro_batches = a.micro_batches;
    Ok(input)
}

/// Runs the planner and prints tables or JSON. `Ok(true)` whenever the input is valid
/// (whether or not the layout fits: that is in the output); `Err` on bad input.
pub fn run(a: PlanArgs) -> crate::Outcome {
    let input = input_from_args(&a)?;
    let p = plan(&input)?;
    if a.common.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", report::render(&p));
    }
    Ok(true)
}
