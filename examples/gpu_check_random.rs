//! `gpu_check --sections random` (included by `gpu_check.rs` with `#[path]`): seeded random
//! configurations through every context-parallel method on virtual ranks on the GPU, against
//! the CPU path on the same inputs.
//!
//! The GPU twin of `tests/cp_random.rs`. The fixed sections pin chosen shapes; this one draws
//! many: packed documents with boundaries anywhere (length-1 documents, one document), causal
//! sliding windows of 1 key up to more than `T`, full and causal masks, GQA 1:1 to 4:1,
//! D = 64 and 128 (and 256 in about one draw in six, 96 in every sixth: the CUDA-core and
//! pipelined kernels, whatever the family), ring (contiguous, zigzag, striped), all-gather KV, Ulysses and 2-D Ulysses x
//! ring at P = 2 and 4, with the kernel family `CANDLE_CP_FLASH_IMPL` selects (Auto when unset).
//! Two in three configurations are bf16 (the tensor-core kernels), checked against the f32 CPU
//! result on the same bf16-rounded inputs with bf16 bounds; the others are f32 (the CUDA-core
//! kernels), checked with the oracle's f32 bounds. The reference is the CPU's single-device
//! `attention_docs_mask` (autograd), which `tests/cp_random.rs` checks against the dense
//! reference; the draws are `tests/draws.rs`'s. Half the Ulysses draws take the backward's
//! row sums from the f32 output (`RowSums::F32`) and then also run the single-device op so;
//! half the ring and all-gather draws take them from the returned output (`RowSums::Output`).
//! A third of the draws soft-cap the logits (Gemma 2: the CUDA-core kernels and the pipelined
//! forward's capped entries, `flash::Logits`).
//! 32 configurations (T up to 512), 12 under `--quick` (T up to 128);
//! `CANDLE_CP_RANDOM_SEEDS=A..B` draws configurations `A..B` instead, to search further.

use super::{case_to, report_metrics, Report};
use crate::draws::{doc_lengths, pick, random_case, rng, seeds};
use crate::gpu_util::{max_abs, rel};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_cp_ops::attention::{attention_docs_mask, attention_docs_mask_with, Mask, RowSums, Scores};
use candle_cp_ops::cp::{run_case_cp_with, CpMethod, CpOpts, Layout};
use candle_cp_ops::oracle::{run_single_with, AttnCase, AttnOutputs};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::ulysses::{HeadLayout, UlyssesOpts};
use candle_cp_ops::usp::{run_case_ulysses_opts, run_case_usp_opts, UspOpts};
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
enum Method {
    Cp(CpMethod),
    Ulysses(Layout),
    Usp { r: usize },
}

/// The `random` section (see the module docs).
pub fn check_random(rep: &mut Report, gpu: &Device) -> Result<()> {
    let (n, lengths): (u64, &[usize]) = if rep.quick { (12, &[64, 96, 128]) } else { (32, &[64, 128, 192, 256, 384, 512]) };
    let timeout = Duration::from_secs(120);
    for seed in seeds(n)? {
        let mut d = rng(2000 + seed);
        let b = pick(&mut d, &[1, 2]);
        let t = pick(&mut d, lengths);
        let (h, hkv) = pick(&mut d, &[(4, 2), (4, 1), (2, 2), (8, 2), (4, 4)]);
        let hd = pick(&mut d, &[64, 128]);
        // head dim 256 in about one draw in six (Gemma 3's; an independent stream, so the other
        // draws of each seed stay what they were)
        let hd = if rng(720_000 + seed).below(6) == 0 { 256 } else { hd };
        // head dim 96 (Phi-3-mini's) in every sixth draw that is not at 256 (seeds 5, 11, ..: the
        // quick run has two)
        let hd = if hd != 256 && seed % 6 == 5 { 96 } else { hd };
        let causal = d.below(4) != 0;
        let window = (causal && d.below(3) == 0).then(|| 1 + d.below(t + 8));
        let lens = doc_lengths(&mut d, t);
        let docs = Documents::from_lengths(&lens)?;
        // Ulysses splits heads: P = 4 only where 4 divides H
        let p = if h >= 4 { pick(&mut d, &[2, 4]) } else { 2 };
        let layout = pick(&mut d, &[Layout::Contiguous, Layout::Zigzag, Layout::Striped]);
        let method = match d.below(6) {
            0 => Method::Ulysses(layout),
            1 => Method::Usp { r: pick(&mut d, &[1, 2]) },
            2 => Method::Cp(CpMethod::AllGather(layout)),
            _ => Method::Cp(CpMethod::Ring(layout)),
        };
        let bf16 = d.below(3) != 0;
        // Ulysses / 2-D: half of them regather the head layout in the backward (own stream)
        let uly = matches!(method, Method::Ulysses(_) | Method::Usp { .. });
        let heads = if uly && rng(700_000 + seed).below(2) == 0 { HeadLayout::Regathered } else { HeadLayout::Kept };
        // Ulysses: half of them take the backward's row sums from the f32 output, and then the
        // single-device op does too; ring / all-gather: half of them from the returned output
        // (own stream)
        let half = rng(710_000 + seed).below(2) == 0;
        let rows = match method {
            Method::Ulysses(_) if half => RowSums::F32,
            Method::Cp(_) if half => RowSums::Output,
            Method::Ulysses(_) => RowSums::Output,
            _ => RowSums::F32,
        };
        let single_f32_rows = matches!(method, Method::Ulysses(_)) && rows == RowSums::F32;
        // a third of them with a logit soft cap that binds at these logits (own stream)
        let softcap = (rng(740_000 + seed).below(3) == 0).then(|| pick(&mut rng(750_000 + seed), &[1.0, 3.0]));
        let ranks = match method {
            Method::Usp { r } => format!("U 2 x R {r}"),
            _ => format!("P{p}"),
        };
        let name = format!(
            "random {seed} {method:?} {ranks}{}{} {} b{b} t{t} h{h} kv{hkv} d{hd} {} window {window:?} docs {lens:?}{}",
            if heads == HeadLayout::Regathered { " heads regathered" } else { "" },
            match (&method, rows) {
                (Method::Ulysses(_), RowSums::F32) => " f32 row sums",
                (Method::Cp(_), RowSums::Output) => " output row sums",
                _ => "",
            },
            if bf16 { "bf16" } else { "f32" },
            if causal { "causal" } else { "full" },
            softcap.map_or(String::new(), |c| format!(" softcap {c}"))
        );

        // inputs on the CPU (bf16-rounded for bf16 runs), the CPU path's result as reference
        let round = |x: Tensor| -> candle_core::Result<Tensor> { if bf16 { x.to_dtype(DType::BF16)?.to_dtype(DType::F32) } else { Ok(x) } };
        let mut case = random_case(name.clone(), 100 + seed, [b, t, h, hkv, hd], causal, round)?;
        let mask = match window {
            Some(w) => Mask::sliding_window(w),
            None if causal => Mask::causal(),
            None => Mask::Full,
        };
        let scores = Scores::new(case.scale).with_softcap(softcap);
        case.reference = run_single_with(&case, |q, k, v| attention_docs_mask(q, k, v, &docs, &mask, scores))?;

        let mut g = case_to(&case, gpu)?;
        if bf16 {
            for x in [&mut g.q, &mut g.k, &mut g.v, &mut g.dout] {
                *x = x.to_dtype(DType::BF16)?;
            }
        }
        let run = match method {
            Method::Cp(m) => {
                let mut opts = CpOpts::default().with_documents(docs.clone()).with_softcap(softcap);
                if let Some(w) = window {
                    opts = opts.with_window(w);
                }
                run_case_cp_with(&g, m, p, timeout, opts.with_row_sums(rows))
            }
            Method::Ulysses(l) => {
                let o = UlyssesOpts { documents: Some(docs.clone()), window, ..UlyssesOpts::new(g.causal, g.scale).with_softcap(softcap) };
                run_case_ulysses_opts(&g, p, l, timeout, o.with_head_layout(heads).with_row_sums(rows))
            }
            Method::Usp { r } => {
                let o = UspOpts { documents: Some(docs.clone()), window, ..UspOpts::new(g.causal, g.scale).with_softcap(softcap) };
                run_case_usp_opts(&g, 2, r, timeout, o.with_head_layout(heads))
            }
        };
        check_run(rep, &name, run.map(|r| r.outputs), &case, bf16)?;
        if single_f32_rows {
            // the single-device op with f32 row sums on the GPU (its raw forward and backward
            // attached, the bf16 residual rebuilding the f32 output)
            let single = run_single_with(&g, |q, k, v| attention_docs_mask_with(q, k, v, &docs, &mask, scores, RowSums::F32));
            check_run(rep, &format!("{name}, single-device op with f32 row sums"), single, &case, bf16)?;
        }
    }
    Ok(())
}

/// Checks `run` against `case.reference`: bf16 bounds for a bf16 run, else the oracle's.
fn check_run(rep: &mut Report, name: &str, run: candle_core::Result<AttnOutputs>, case: &AttnCase, bf16: bool) -> Result<()> {
    match run {
        Ok(o) if bf16 => {
            let want = &case.reference;
            rep.check(&format!("{name} out"), max_abs(&o.out, &want.out)?, 2e-2);
            rep.check(&format!("{name} lse"), max_abs(&o.lse, &want.lse)?, 2e-2);
            rep.check(&format!("{name} dq"), rel(&o.dq, &want.dq)?, 5e-2);
            rep.check(&format!("{name} dk"), rel(&o.dk, &want.dk)?, 5e-2);
            rep.check(&format!("{name} dv"), rel(&o.dv, &want.dv)?, 5e-2);
        }
        Ok(o) => report_metrics(rep, name, &o, case)?,
        Err(e) => rep.error(name, e),
    }
    Ok(())
}
