//! Rendering of a [`SearchResult`]: one row per layout, fastest first.

use super::step::{count, overlap_label, secs};
use super::lower;
use crate::layout::{CpKind, Recompute};
use crate::plan::PlanInput;
use crate::search::{Candidate, SearchResult};
use crate::GB;
use std::fmt::Write;

/// The `candle-cp plan` flags that reproduce `c` (with the search's shared flags).
pub fn plan_flags(c: &Candidate) -> String {
    let l = &c.layout;
    let mut f = format!("--tp {} --cp {} --pp {} --dp {}", l.tp, l.cp, l.pp, l.dp);
    if l.ep > 1 {
        let _ = write!(f, " --ep {}", l.ep);
    }
    if l.virtual_stages > 1 {
        let _ = write!(f, " --virtual-stages {}", l.virtual_stages);
    }
    if l.sp {
        f.push_str(" --sp");
    }
    if l.cp > 1 {
        let _ = write!(f, " --cp-kind {}", kind(l.cp_kind));
        if l.cp_kind == CpKind::TwoD {
            let _ = write!(f, " --ulysses {}", l.ulysses);
        }
        if l.regather_heads && matches!(l.cp_kind, CpKind::Ulysses | CpKind::TwoD) {
            f.push_str(" --regather-heads");
        }
    }
    if l.recompute != Recompute::None {
        let _ = write!(f, " --recompute {}", lower(l.recompute));
    }
    let _ = write!(f, " --zero {} --micro-batches {}", l.zero, c.micro_batches);
    f
}

fn kind(k: CpKind) -> &'static str {
    match k {
        CpKind::Ring => "ring",
        CpKind::Allgather => "allgather",
        CpKind::Ulysses => "ulysses",
        CpKind::TwoD => "2d",
    }
}

/// Tables for people: the search's counts, then the ranked layouts, then the flags of the
/// fastest for `candle-cp plan`.
pub fn render_search(r: &SearchResult, base: &PlanInput) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{} on {} x {} ({:.0} GB), s = {} tokens, global batch {} sequences (b = {})",
        base.model.name,
        r.gpus,
        base.hardware.name,
        base.hardware.mem_bytes / GB,
        base.seq,
        r.global_batch,
        base.micro_batch
    );
    let _ = writeln!(
        o,
        "{} layouts priced, {} fit, {} refused by the planner; gradient sync: {}{}",
        r.evaluated,
        r.fitting,
        r.invalid,
        overlap_label(base.overlap),
        if r.finetune_llama {
            "\nOnly what examples/finetune_llama trains: no PP, ZeRO 0-2, the reduction overlapped only with --recompute"
        } else {
            ""
        }
    );
    if base.layout.regather_heads {
        o.push_str("Ulysses and 2-D with the head layout regathered in the backward (--regather-heads)\n");
    }
    if r.best.iter().any(|c| c.layout.regather_heads && c.layout.cp > 1) {
        o.push_str("rg: q, k, v and the attention output all-to-alled to heads again in the backward instead of kept (--regather-heads)\n");
    }
    if r.best.is_empty() {
        let _ = writeln!(o, "\nNo layout fits: more GPUs, a longer CP, or --zero 3 / --recompute full (if not already tried).");
        return o;
    }
    // (an "ep" column after "dp" for a mixture of experts)
    let moe = base.model.moe.is_some();
    let mut head = vec!["#", "tp", "cp", "kind", "pp", "v", "dp", "k", "recompute", "zero", "memory", "bubble", "step", "tok/s/GPU", "MFU", "bottleneck"];
    if moe {
        head.insert(7, "ep");
    }
    let mut rows: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for (n, c) in r.best.iter().enumerate() {
        let l = &c.layout;
        let k = match (l.cp, l.cp_kind) {
            (1, _) => "-".to_string(),
            (_, CpKind::TwoD) => format!("2d u{}", l.ulysses),
            (_, x) => kind(x).to_string(),
        };
        let k = if l.regather_heads && l.cp > 1 { format!("{k} rg") } else { k };
        rows.push(vec![
            (n + 1).to_string(),
            l.tp.to_string(),
            l.cp.to_string(),
            k,
            l.pp.to_string(),
            l.virtual_stages.to_string(),
            l.dp.to_string(),
            l.ep.to_string(),
            c.micro_batches.to_string(),
            lower(l.recompute),
            l.zero.to_string(),
            format!("{:.1} GB", c.memory_per_gpu_bytes / GB),
            format!("{:.0}%", 100.0 * c.step.bubble_fraction),
            secs(c.step.step_s),
            count(c.step.tokens_per_s_per_gpu),
            format!("{:.1}%", 100.0 * c.step.mfu),
            c.bottleneck.clone(),
        ]);
        if !moe {
            rows.last_mut().map(|r| r.remove(7));
        }
    }
    let cols = head.len();
    let width: Vec<usize> = (0..cols).map(|j| rows.iter().map(|r| r[j].chars().count()).max().unwrap_or(0)).collect();
    let _ = writeln!(o);
    for row in &rows {
        let mut line = String::from(" ");
        for (j, cell) in row.iter().enumerate() {
            let pad = width[j] - cell.chars().count();
            if j == cols - 1 {
                let _ = write!(line, " {cell}");
            } else if j == 3 || j == 8 {
                let _ = write!(line, " {cell}{}", " ".repeat(pad));
            } else {
                let _ = write!(line, " {}{cell}", " ".repeat(pad));
            }
        }
        let _ = writeln!(o, "{}", line.trim_end());
    }
    let _ = writeln!(
        o,
        "\nThe fastest in full: `candle-cp plan` with this search's model, sequence and hardware flags and\n  {}",
        plan_flags(&r.best[0])
    );
    if let Some(f) = &r.best[0].finetune_llama_flags {
        let _ = writeln!(
            o,
            "Trained by examples/finetune_llama (with --device cuda --comm nccl, docs in examples/README.md):\n  {f}"
        );
    }
    o
}
