//! `candle-cp search`: the fastest layouts of N GPUs that fit, from the planner's arithmetic.

use crate::plan::{input_from_common, CommonArgs};
use candle_cp_plan::{report, search, ActivationModel, CpKind, Layout, Recompute, SearchInput};

/// Arguments of `candle-cp search`.
#[derive(clap::Args, Debug)]
pub struct SearchArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// GPUs to lay out (tp x cp x pp x dp).
    #[arg(long)]
    pub gpus: usize,
    /// Sequences per optimizer step, all data-parallel replicas together (dp x micro-batch
    /// must divide it; the rest is micro-batches per step).
    #[arg(long)]
    pub global_batch: usize,
    /// CP kinds to try, comma-separated: ring, allgather, ulysses, 2d.
    #[arg(long, default_value = "ring,allgather,ulysses,2d")]
    pub cp_kinds: String,
    /// Recompute policies to try, comma-separated: none, selective, full.
    #[arg(long, default_value = "none,full")]
    pub recompute: String,
    /// ZeRO stages to try, comma-separated (0-3).
    #[arg(long, default_value = "1,2,3")]
    pub zero: String,
    /// Largest TP degree [default: the GPUs of one node].
    #[arg(long)]
    pub max_tp: Option<usize>,
    /// Layouts to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Only the layouts examples/finetune_llama trains (no PP, ZeRO 0-2, the gradient sync
    /// overlapped only with full recompute), with its flags; activations counted as our
    /// Llama keeps them (`--activations candle-cp`) unless `--activations` says otherwise.
    #[arg(long)]
    pub finetune_llama: bool,
}

fn list<T>(what: &str, s: &str, parse: impl Fn(&str) -> anyhow::Result<T>) -> anyhow::Result<Vec<T>> {
    let out = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(parse)
        .collect::<anyhow::Result<Vec<T>>>()?;
    if out.is_empty() {
        anyhow::bail!("--{what} lists nothing to try: '{s}'")
    }
    Ok(out)
}

/// Builds the search input from the flags; errors name the bad value.
pub fn input_from_args(a: &SearchArgs) -> anyhow::Result<SearchInput> {
    let mut base = input_from_common(&a.common, Layout::default())?;
    if a.finetune_llama && a.common.activations.is_none() {
        // the layouts our trainer runs: count what our Llama keeps
        base.activation_model = ActivationModel::CandleCp;
    }
    Ok(SearchInput {
        base,
        gpus: a.gpus,
        global_batch: a.global_batch,
        kinds: list("cp-kinds", &a.cp_kinds, |x| Ok(CpKind::parse(x)?))?,
        recompute: list("recompute", &a.recompute, |x| Ok(Recompute::parse(x)?))?,
        zero: list("zero", &a.zero, |x| {
            x.parse::<u8>()
                .map_err(|_| anyhow::anyhow!("--zero: '{x}' is not a ZeRO stage (0-3)"))
        })?,
        max_tp: a.max_tp,
        top: a.top,
        finetune_llama: a.finetune_llama,
    })
}

/// Runs the search and prints the ranking (or JSON). `Ok(true)` when the input is valid,
/// whether or not a layout fits (that is in the output); `Err` on bad input.
pub fn run(a: SearchArgs) -> crate::Outcome {
    let input = input_from_args(&a)?;
    let r = search(&input)?;
    if a.common.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", report::render_search(&r, &input.base));
    }
    Ok(true)
}
