//! `candle-cp verify attn --case FILE.safetensors [--layout L] [--cp P] [--ulysses U --ring R] [--packed]`
//!
//! Reads an attention case in the oracle format (q, k, v, dout, out, lse, dq, dk, dv + header
//! metadata causal/scale/sigma/case), runs it on the chosen layout, gathers the global
//! results and prints `out_abs`, `lse_abs`, `dq_rel`, `dk_rel`, `dv_rel` against the README
//! tolerances, then a last line starting with `PASS` or `FAIL`. `--packed` runs the case packed
//! into two documents with the document mask and compares the rows the packing keeps exact.

use anyhow::{bail, Context};
use candle_cp_ops::oracle::{run_single, AttnCase, AttnMetrics, AttnOutputs, PackedOracle};
use std::path::PathBuf;

/// Layouts accepted by `--layout` (those not yet built in report so).
pub const LAYOUTS: &str = "single, ring, zigzag, striped, allgather, ulysses, usp";

/// Arguments of `verify attn`.
#[derive(clap::Args, Debug)]
pub struct AttnArgs {
    /// Attention case file in the oracle format (safetensors).
    #[arg(long)]
    pub case: PathBuf,
    /// Layout: single | ring | zigzag | striped | allgather | ulysses | usp.
    #[arg(long, default_value = "single")]
    pub layout: String,
    /// Context-parallel degree P (ring, zigzag, striped, allgather); ranks run as threads.
    #[arg(long)]
    pub cp: Option<usize>,
    /// Ulysses (all-to-all) degree U (ulysses, usp).
    #[arg(long)]
    pub ulysses: Option<usize>,
    /// Ring degree R inside each Ulysses group (usp).
    #[arg(long)]
    pub ring: Option<usize>,
    /// Pack the case into a sequence of two documents (causal: after a prefix document cut
    /// from its own first tokens; full: twice) and run it with the document mask; the rows
    /// the packing keeps exact are compared with the oracle (`oracle::PackedOracle`).
    #[arg(long)]
    pub packed: bool,
}

/// Run the case on `a.layout`; `Ok(true)` PASS, `Ok(false)` FAIL, `Err` bad input.
pub fn run(a: AttnArgs) -> crate::Outcome {
    let oracle = AttnCase::load(&a.case).with_context(|| format!("loading case {}", a.case.display()))?;
    let po = if a.packed { Some(PackedOracle::new(&oracle)?) } else { None };
    let case = po.as_ref().map_or(&oracle, |p| &p.case);
    let docs = po.as_ref().map(|p| p.documents.clone());
    if let Some(d) = &docs {
        println!("packed: documents {:?} (T = {})", d.lengths(), d.total_len());
    }
    let got: AttnOutputs = match a.layout.as_str() {
        "single" => {
            for (flag, val) in [("--cp", a.cp), ("--ulysses", a.ulysses), ("--ring", a.ring)] {
                if val.is_some_and(|p| p != 1) {
                    bail!("layout single runs on one device; {flag} {} needs a parallel layout ({LAYOUTS})", val.unwrap_or(1))
                }
            }
            match &po {
                Some(p) => p.run_single()?,
                None => run_single(case)?,
            }
        }
        // CP engineer: ring / zigzag / striped / all-gather-KV with `--cp P`.
        "ring" | "zigzag" | "striped" | "allgather" => {
            for (flag, val) in [("--ulysses", a.ulysses), ("--ring", a.ring)] {
                if val.is_some() {
                    bail!("layout {} takes --cp P, not {flag} (that is for ulysses/usp)", a.layout)
                }
            }
            let Some(p) = a.cp else { bail!("layout {} needs --cp P (number of thread ranks)", a.layout) };
            if p == 0 {
                bail!("--cp must be at least 1")
            }
            let method: candle_cp_ops::cp::CpMethod = a.layout.parse()?;
            let opts = candle_cp_ops::cp::CpOpts { documents: docs.clone(), ..Default::default() };
            let run = candle_cp_ops::cp::run_case_cp_with(case, method, p, std::time::Duration::from_secs(300), opts)?;
            println!("ranks: {p} thread ranks, {} layout, local shapes (out, lse, dq, dk, dv) {:?}", method.layout(), run.shapes[0]);
            run.outputs
        }
        // Ulysses: `--cp P` (or `--ulysses P`); 2-D: `--ulysses U --ring R` (P = U·R).
        "ulysses" => {
            if a.ring.is_some_and(|r| r != 1) {
                bail!("layout ulysses takes --cp P (or --ulysses P); --ring R is for layout usp")
            }
            let p = match (a.cp, a.ulysses) {
                (Some(p), None) | (None, Some(p)) => p,
                (Some(p), Some(u)) if p == u => p,
                (Some(p), Some(u)) => bail!("layout ulysses: --cp {p} and --ulysses {u} disagree (give one of them)"),
                (None, None) => bail!("layout ulysses needs --cp P (the Ulysses degree; ranks run as threads)"),
            };
            if p == 0 {
                bail!("--cp must be at least 1")
            }
            let layout = candle_cp_ops::cp::Layout::Contiguous;
            let run = candle_cp_ops::usp::run_case_ulysses_with(case, p, layout, std::time::Duration::from_secs(300), docs.clone(), None)?;
            println!("ranks: {p} thread ranks, ulysses all-to-all ({layout} sequence shards), local shapes (out, lse, dq, dk, dv) {:?}", run.shapes[0]);
            run.outputs
        }
        "usp" => {
            let (Some(u), Some(r)) = (a.ulysses, a.ring) else {
                bail!("layout usp needs --ulysses U --ring R (U·R thread ranks)")
            };
            if let Some(p) = a.cp {
                if p != u * r {
                    bail!("layout usp: --cp {p} must equal U·R = {u}·{r} = {}", u * r)
                }
            }
            let run = candle_cp_ops::usp::run_case_usp_with(case, u, r, std::time::Duration::from_secs(300), docs.clone(), None)?;
            println!(
                "ranks: {} thread ranks = {u} ulysses × {r} ring (zigzag), local shapes (out, lse, dq, dk, dv) {:?}",
                u * r,
                run.shapes[0]
            );
            run.outputs
        }
        other => bail!("unknown layout {other:?}; valid layouts: {LAYOUTS}"),
    };
    let metrics = match &po {
        Some(p) => p.metrics(&got)?,
        None => AttnMetrics::compute(&got, &case.reference)?,
    };
    let tol = case.tolerances();
    let (b, t, h, d) = case.q.dims4()?;
    let hkv = case.k.dims()[2];
    println!(
        "case {} layout {}: B={b} T={t} H={h} Hkv={hkv} D={d} causal={} sigma={} scale={}",
        case.name, a.layout, case.causal, case.sigma, case.scale
    );
    print!("{}", metrics.report(&tol));
    let pass = metrics.passes(&tol);
    if pass {
        println!("PASS {}", case.name);
    } else {
        println!("FAIL {}: {} over tolerance", case.name, metrics.failures(&tol).join(", "));
    }
    Ok(pass)
}
