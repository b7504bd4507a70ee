//! `candle-cp verify llama`: run a Llama checkpoint on a parallel layout (thread ranks) and
//! compare logits, loss and every parameter gradient with a reference file
//! (`input_ids`, `logits`, `loss`, `grad.<name>`; the oracle format of
//! `tests/data/oracle/tiny-llama/reference.safetensors`). The logic lives in
//! [`candle_cp_llama::verify`].

use candle_core::Device;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::verify_reference_recompute;
use std::path::PathBuf;

/// Arguments of `verify llama`.
#[derive(clap::Args, Debug)]
pub struct LlamaArgs {
    /// HF checkpoint directory (config.json + model.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Reference safetensors (`input_ids`, `logits`, `loss`, `grad.<name>`).
    #[arg(long)]
    reference: PathBuf,
    /// CP algorithm: ring (contiguous), zigzag, striped, allgather, ulysses, 2d; or `single`.
    #[arg(long, default_value = "zigzag")]
    layout: String,
    /// CP degree (for 2d: ulysses · ring; may be omitted then).
    #[arg(long)]
    cp: Option<usize>,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Megatron sequence parallelism inside the TP group.
    #[arg(long)]
    sp: bool,
    /// Data-parallel degree (the reference batch is split over DP ranks).
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Ulysses degree of the 2d layout.
    #[arg(long)]
    ulysses: Option<usize>,
    /// Ring degree of the 2d layout.
    #[arg(long)]
    ring: Option<usize>,
    /// Compute on this device: `cpu` or `cuda:N` (needs the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Recompute every decoder layer in backward (activation checkpointing).
    #[arg(long)]
    recompute: bool,
}

fn parse_device(s: &str) -> anyhow::Result<Device> {
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    let ord = match s.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .trim_start_matches(':')
            .parse::<usize>()
            .map_err(|_| anyhow::anyhow!("bad device '{s}' (cpu or cuda:N)"))?,
        None => anyhow::bail!("bad device '{s}' (cpu or cuda:N)"),
    };
    Ok(Device::new_cuda(ord)?)
}

/// Build the layout from the flags; errors on inconsistent degrees.
pub fn layout_from_args(a: &LlamaArgs) -> anyhow::Result<Layout> {
    let base = if matches!(a.layout.as_str(), "single" | "none") {
        if a.cp.unwrap_or(1) != 1 {
            anyhow::bail!("--layout single takes no --cp (got {:?})", a.cp)
        }
        Layout::single()
    } else {
        let kind: CpKind = a.layout.parse()?;
        if kind == CpKind::TwoD {
            let (u, r) = match (a.ulysses, a.ring, a.cp) {
                (Some(u), Some(r), _) => (u, r),
                (Some(u), None, Some(c)) if u > 0 && c % u == 0 => (u, c / u),
                (None, Some(r), Some(c)) if r > 0 && c % r == 0 => (c / r, r),
                _ => anyhow::bail!("--layout 2d needs two of --ulysses, --ring, --cp (cp = ulysses · ring)"),
            };
            if let Some(c) = a.cp {
                if c != u * r {
                    anyhow::bail!("--cp {c} is not --ulysses {u} × --ring {r}")
                }
            }
            Layout::two_d(u, r)
        } else {
            if a.ring.is_some() || (a.ulysses.is_some() && kind != CpKind::Ulysses) {
                anyhow::bail!("--ulysses / --ring only apply to --layout 2d (or --ulysses with ulysses)")
            }
            let cp = a.cp.or(a.ulysses).unwrap_or(1);
            if kind == CpKind::Ulysses && a.ulysses.is_some_and(|u| u != cp) {
                anyhow::bail!("--layout ulysses: --ulysses {:?} differs from --cp {cp}", a.ulysses)
            }
            Layout::cp(kind, cp)
        }
    };
    Ok(base.with_tp(a.tp, a.sp).with_dp(a.dp))
}

/// Run the check; prints the metrics and PASS / FAIL.
pub fn run(a: LlamaArgs) -> crate::Outcome {
    let layout = layout_from_args(&a)?;
    let device = parse_device(&a.device)?;
    println!("model      {}", a.model.display());
    println!("reference  {}", a.reference.display());
    let rc = if a.recompute { ", layers recomputed in backward" } else { "" };
    println!("layout     {layout} ({} ranks, {}{rc})", layout.world_size(), a.device);
    let t0 = std::time::Instant::now();
    let rep = verify_reference_recompute(&a.model, &a.reference, layout, &device, a.recompute)?;
    let t = rep.tol;
    println!("logits_abs    {:.3e}   (tol {:.1e})", rep.logits_abs, t.logits_abs);
    println!("loss_abs      {:.3e}   (tol {:.1e})", rep.loss_abs, t.loss_abs);
    println!(
        "grad_rel_max  {:.3e}   (tol {:.1e})   worst: {}",
        rep.grad_rel_max, t.grad_rel, rep.worst_param
    );
    println!("rank_spread   {:.3e}   (tol {:.1e})", rep.rank_spread, t.loss_abs);
    println!("time          {:.1} s", t0.elapsed().as_secs_f64());
    let pass = rep.pass();
    println!("{}", if pass { "PASS" } else { "FAIL" });
    Ok(pass)
}
