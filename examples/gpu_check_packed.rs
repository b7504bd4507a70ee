//! `gpu_check --sections packed` (included by `gpu_check.rs` with `#[path]`): packed
//! sequences (document masks) on the GPU.
//!
//! Each oracle case is packed as the CPU tests pack it (`tests/packed_attention.rs`): a causal
//! case after a prefix document cut from its own first `t1` tokens (`t1` chosen so that the
//! packed length splits over 2P = 8 and the boundaries fall inside shards), a full-mask case
//! twice. The reference is the CPU packed attention (`attention_docs`, autograd) of the same
//! inputs, itself checked against the oracle by the CPU tests. On the GPU: the single-device
//! `attention_docs`, ring (zigzag, striped) and all-gather KV with the documents on virtual
//! ranks (P = 2, and 4 unless `--quick`), Ulysses P = 2.

use super::{case_to, report_metrics, Report, QUICK_MAX_TOKENS};
use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use candle_cp_ops::attention::attention_docs;
use candle_cp_ops::cp::{run_case_cp_with, CpMethod, CpOpts, Layout};
use candle_cp_ops::oracle::{AttnCase, AttnOutputs};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::usp::run_case_ulysses_with;
use std::time::Duration;

/// Packed attention of `case`'s inputs on their device: out, lse and the gradients of
/// `sum(out · dout)`.
fn packed_single(case: &AttnCase, docs: &Documents) -> candle_core::Result<AttnOutputs> {
    let (q, k, v) = (Var::from_tensor(&case.q)?, Var::from_tensor(&case.k)?, Var::from_tensor(&case.v)?);
    let (out, lse) = attention_docs(q.as_tensor(), k.as_tensor(), v.as_tensor(), docs, case.causal, case.scale)?;
    let g = (&out * &case.dout)?.sum_all()?.backward()?;
    let grad = |x: &Var| g.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("missing gradient".into()));
    Ok(AttnOutputs { out, lse, dq: grad(&q)?, dk: grad(&k)?, dv: grad(&v)? })
}

/// The packed case (CPU, reference = the CPU packed attention) and its documents.
fn pack(case: &AttnCase) -> Result<(AttnCase, Documents)> {
    let t = case.q.dim(1)?;
    let t1 = 24 - t % 8; // (t1 + t) % 8 == 0, 17 <= t1 <= 24
    let (lens, xs): (Vec<usize>, Vec<Tensor>) = {
        let cat = |x: &Tensor| -> candle_core::Result<Tensor> {
            if case.causal {
                Tensor::cat(&[&x.narrow(1, 0, t1)?, x], 1)
            } else {
                Tensor::cat(&[x, x], 1)
            }
        };
        let lens = if case.causal { vec![t1, t] } else { vec![t, t] };
        (lens, vec![cat(&case.q)?, cat(&case.k)?, cat(&case.v)?, cat(&case.dout)?])
    };
    let docs = Documents::from_lengths(&lens)?;
    let mut c = AttnCase {
        name: format!("{} packed {lens:?}", case.name),
        q: xs[0].clone(),
        k: xs[1].clone(),
        v: xs[2].clone(),
        dout: xs[3].clone(),
        ..case.clone()
    };
    c.reference = packed_single(&c, &docs)?;
    Ok((c, docs))
}

/// The `packed` section (see the module docs).
pub fn check_packed(rep: &mut Report, gpu: &Device, dir: &str) -> Result<()> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    for path in files.iter().filter(|p| p.extension().is_some_and(|e| e == "safetensors")) {
        let case = AttnCase::load(path)?;
        if rep.quick && case.q.dim(0)? * case.q.dim(1)? > QUICK_MAX_TOKENS {
            continue;
        }
        let (packed, docs) = pack(&case)?;
        let g = case_to(&packed, gpu)?;
        let name = format!("packed {} autograd op", packed.name);
        match packed_single(&g, &docs) {
            Ok(o) => report_metrics(rep, &name, &o, &packed)?,
            Err(e) => rep.error(&name, e),
        }
        for method in [CpMethod::Ring(Layout::Zigzag), CpMethod::Ring(Layout::Striped), CpMethod::AllGather(Layout::Zigzag)] {
            for p in [2, 4] {
                if rep.quick && p != 2 {
                    continue;
                }
                let name = format!("packed {} {method} P{p} virtual ranks", packed.name);
                let opts = CpOpts::default().with_documents(docs.clone());
                match run_case_cp_with(&g, method, p, Duration::from_secs(120), opts) {
                    Ok(run) => report_metrics(rep, &name, &run.outputs, &packed)?,
                    Err(e) => rep.error(&name, e),
                }
            }
        }
        if case.q.dim(2)? % 2 == 0 {
            let name = format!("packed {} ulysses P2 virtual ranks", packed.name);
            match run_case_ulysses_with(&g, 2, Layout::Contiguous, Duration::from_secs(120), Some(docs.clone())) {
                Ok(run) => report_metrics(rep, &name, &run.outputs, &packed)?,
                Err(e) => rep.error(&name, e),
            }
        }
    }
    Ok(())
}
