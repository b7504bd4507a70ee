//! `candle-cp`: verify parallel layouts against reference data, plan layouts, and search
//! for the fastest one.
//!
//! Exit codes: 0 PASS (or success), 1 FAIL, 2 bad input (message on stderr).

mod convert_lora;
mod merge_lora;
mod plan;
mod search;
mod verify_attn;
mod verify_llama;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "candle-cp", version, about = "Sequence and context parallelism for candle")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Check a layout against reference data (oracle format); prints metrics and PASS/FAIL.
    #[command(subcommand)]
    Verify(Verify),
    /// What a layout costs: activation memory, weights/optimizer, FLOPs, ring bytes, overlap.
    Plan(plan::PlanArgs),
    /// The fastest layouts of N GPUs that fit in memory, ranked by the planner's step time.
    Search(search::SearchArgs),
    /// A LoRA checkpoint (base model + PEFT adapter) as one merged Hugging Face model.
    MergeLora(merge_lora::MergeArgs),
    /// A PEFT adapter on a mixture's expert parameters (transformers 5) as the same adapter on
    /// per-expert modules (transformers 4), for serving stacks that read only those.
    ConvertLora(convert_lora::ConvertArgs),
}

#[derive(Subcommand)]
enum Verify {
    /// Attention case: q, k, v, dout -> out, lse, dq, dk, dv.
    Attn(verify_attn::AttnArgs),
    /// Llama checkpoint + reference (input_ids, logits, loss, grad.*).
    Llama(verify_llama::LlamaArgs),
}

/// Outcome of a command: `Ok(true)` PASS, `Ok(false)` FAIL, `Err` bad input.
pub type Outcome = anyhow::Result<bool>;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let res = match cli.cmd {
        Cmd::Verify(Verify::Attn(a)) => verify_attn::run(a),
        Cmd::Verify(Verify::Llama(a)) => verify_llama::run(a),
        Cmd::Plan(a) => plan::run(a),
        Cmd::Search(a) => search::run(a),
        Cmd::MergeLora(a) => merge_lora::run(a),
        Cmd::ConvertLora(a) => convert_lora::run(a),
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
