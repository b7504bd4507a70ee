//! Picks the layout from the arithmetic: every layout of `N` GPUs the planner can price,
//! kept if it fits in memory, ranked by the optimizer step time of [`crate::step`].
//!
//! The global batch `B` (sequences per optimizer step) is fixed, so a shorter step is more
//! tokens per second on the same GPUs. Enumerated, with `tp·cp·pp·dp = N`:
//!
//! - `tp`: powers of two up to `max_tp` (default: the GPUs of one NVLink domain), with SP;
//! - `cp`: powers of two dividing `s`; each CP kind asked for (2-D: every power-of-two Ulysses
//!   degree `1 < U < cp`); at `cp = 1` the kind does not matter and one layout is kept;
//! - `pp`: powers of two up to the layer count; `dp = N / (tp·cp·pp)` whole, and `dp·b`
//!   dividing `B` (then `k = B / (dp·b)` micro-batches per step); with `pp > 1`, each
//!   power-of-two number of virtual stages `v` (interleaved 1F1B) with `pp·v ≤ L` and, as
//!   Megatron requires for `v > 1`, `pp` dividing `k`;
//! - each recompute policy and ZeRO stage asked for;
//! - Ulysses and 2-D under the candle-cp activation count: with and without the head layout
//!   regathered in the backward ([`Layout::regather_heads`]; only with it under
//!   `--regather-heads`).
//!
//! With [`SearchInput::finetune_llama`] only the layouts candle-cp's trainer
//! (`examples/finetune_llama`) runs are tried: no PP, ZeRO 0–2, recompute none or full, and
//! the overlaps it has — the gradient reduction during the backward only with full recompute,
//! the parameter all-gather during the next forward only under ZeRO-1/2 — and each row
//! carries the trainer's flags.
//!
//! Layouts the planner refuses (heads that do not divide, Ulysses degrees beyond the heads)
//! are skipped and counted. Of the layouts with the same degrees and CP kind, only the fastest
//! recompute / ZeRO / head-layout choice is listed, so the top rows are different layouts. Rows whose steps
//! are within 0.5% ([`TIE`]) of each other are listed simplest first (fewest GPUs per model
//! replica, then least memory; `rank`).

use crate::layout::{ActivationModel, CpKind, Dtype, Layout, Recompute};
use crate::plan::{plan, PlanInput};
use crate::step::{Overlap, StepTime};
use crate::{plan_bail, Result};
use serde::Serialize;
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// What to search.
#[derive(Debug, Clone)]
pub struct SearchInput {
    /// Model, hardware, sequence, micro-batch `b`, dtype, rates, overlap; its layout's
    /// `flash` is kept, the other layout fields are searched.
    pub base: PlanInput,
    /// GPUs, `N`.
    pub gpus: usize,
    /// Sequences per optimizer step, all replicas together, `B`.
    pub global_batch: usize,
    /// CP kinds to try.
    pub kinds: Vec<CpKind>,
    /// Recompute policies to try.
    pub recompute: Vec<Recompute>,
    /// ZeRO stages to try.
    pub zero: Vec<u8>,
    /// Largest TP degree; `None`: the hardware's GPUs per node.
    pub max_tp: Option<usize>,
    /// Rows to keep.
    pub top: usize,
    /// Only the layouts `examples/finetune_llama` runs, with its overlaps (module docs).
    pub finetune_llama: bool,
}

/// One ranked layout.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// The layout.
    pub layout: Layout,
    /// Micro-batches per step per replica, `k`.
    pub micro_batches: usize,
    /// Memory per GPU, bytes.
    pub memory_per_gpu_bytes: f64,
    /// The step.
    pub step: StepTime,
    /// What limits it ([`crate::Plan::bottleneck`]).
    pub bottleneck: String,
    /// With [`SearchInput::finetune_llama`]: its layout and overlap flags.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finetune_llama_flags: Option<String>,
}

/// The ranking.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SearchResult {
    /// GPUs searched.
    pub gpus: usize,
    /// Global batch, sequences.
    pub global_batch: usize,
    /// Layouts priced (valid for the model and the batch).
    pub evaluated: usize,
    /// Of those, the ones that fit in memory.
    pub fitting: usize,
    /// Layouts the planner refused (degrees that do not divide the heads, the sequence ...).
    pub invalid: usize,
    /// Searched with [`SearchInput::finetune_llama`].
    pub finetune_llama: bool,
    /// The activation count the memory verdicts used.
    pub activation_model: ActivationModel,
    /// The fastest fitting layouts, fastest first, one per degrees + CP kind.
    pub best: Vec<Candidate>,
}

fn powers_of_two(max: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(1usize), |x| x.checked_mul(2)).take_while(move |&x| x <= max)
}

/// The expert-parallel degrees to try over `replicas = dp·cp` ranks: 1, and for a mixture of
/// experts every power of two that divides both the replicas and the experts.
fn expert_degrees(base: &PlanInput, replicas: usize) -> Vec<usize> {
    match &base.model.moe {
        Some(m) => powers_of_two(replicas).filter(|&e| replicas.is_multiple_of(e) && m.experts.is_multiple_of(e)).collect(),
        None => vec![1],
    }
}

/// The (kind, Ulysses degree) pairs to try at CP degree `cp`.
fn kinds_at(kinds: &[CpKind], cp: usize) -> Vec<(CpKind, usize)> {
    if cp == 1 {
        return vec![(CpKind::Ring, 1)];
    }
    let mut out = Vec::new();
    for &k in kinds {
        match k {
            CpKind::TwoD => out.extend(powers_of_two(cp / 2).skip(1).map(|u| (k, u))),
            _ => out.push((k, 1)),
        }
    }
    out
}

/// The head-layout choices to try for `kind` (see [`Layout::regather_heads`]): Ulysses and
/// 2-D try both under the candle-cp activation count (the only count in which regathering
/// saves memory; it always costs backward bytes), only regathered with `--regather-heads`;
/// the other kinds have none to choose.
fn regathers(base: &PlanInput, kind: CpKind) -> &'static [bool] {
    match kind {
        CpKind::Ulysses | CpKind::TwoD if base.layout.regather_heads => &[true],
        CpKind::Ulysses | CpKind::TwoD if base.activation_model == ActivationModel::CandleCp => &[false, true],
        _ => &[false],
    }
}

/// The ZeRO stages and recompute policies to try: those asked for, less what
/// `examples/finetune_llama` cannot run under [`SearchInput::finetune_llama`].
fn choices(i: &SearchInput) -> (Vec<u8>, Vec<Recompute>) {
    let t = i.finetune_llama;
    let zero = i.zero.iter().copied().filter(|&z| !t || z <= 2).collect();
    let recompute = i.recompute.iter().copied().filter(|&r| !t || r != Recompute::Selective).collect();
    (zero, recompute)
}

/// Every layout of the module docs with its micro-batch count `k`, not yet validated, over
/// the ZeRO stages and recompute policies of [`choices`].
fn layouts(i: &SearchInput, zero: &[u8], recompute: &[Recompute]) -> Vec<(Layout, usize)> {
    let base = &i.base;
    let max_tp = i.max_tp.unwrap_or(base.hardware.gpus_per_node).max(1);
    let mut out = Vec::new();
    let max_pp = if i.finetune_llama { 1 } else { base.model.layers };
    for tp in powers_of_two(max_tp.min(i.gpus)) {
        for cp in powers_of_two(i.gpus / tp).filter(|&c| base.seq.is_multiple_of(c)) {
            for pp in powers_of_two(max_pp.min(i.gpus / (tp * cp))) {
                if !i.gpus.is_multiple_of(tp * cp * pp) {
                    continue;
                }
                let dp = i.gpus / (tp * cp * pp);
                let rows = match dp.checked_mul(base.micro_batch) {
                    Some(r) if i.global_batch.is_multiple_of(r) => r,
                    _ => continue,
                };
                let k = i.global_batch / rows;
                let vs: Vec<usize> = if pp == 1 || !k.is_multiple_of(pp) {
                    vec![1]
                } else {
                    powers_of_two(base.model.layers / pp).collect()
                };
                for (cp_kind, ulysses, regather_heads) in kinds_at(&i.kinds, cp)
                    .into_iter()
                    .flat_map(|(k, u)| regathers(base, k).iter().map(move |&r| (k, u, r)))
                {
                    for &virtual_stages in &vs {
                        for &recompute in recompute {
                            for (&zero, ep) in zero.iter().flat_map(|z| expert_degrees(base, dp * cp).into_iter().map(move |e| (z, e))) {
                                let layout = Layout {
                                    tp,
                                    sp: tp > 1,
                                    cp,
                                    cp_kind,
                                    ulysses,
                                    pp,
                                    virtual_stages,
                                    dp,
                                    ep,
                                    zero,
                                    recompute,
                                    flash: base.layout.flash,
                                    regather_heads,
                                    f32_row_sums: base.layout.f32_row_sums,
                                    lora_rank: base.layout.lora_rank,
                                    lora_mlp: base.layout.lora_mlp,
                                    lora_dora: base.layout.lora_dora,
                                    lora_save_embed: base.layout.lora_save_embed,
                                    lora_save_head: base.layout.lora_save_head,
                                    base_quant: base.layout.base_quant,
                                };
                                out.push((layout, k));
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Runs the search of the module docs; errors name bad inputs (no GPUs, a batch no layout
/// splits, a model no layout of these GPUs suits, empty choice lists).
pub fn search(i: &SearchInput) -> Result<SearchResult> {
    let base = &i.base;
    base.model.validate()?;
    base.hardware.validate()?;
    if i.gpus == 0 || i.global_batch == 0 || base.micro_batch == 0 {
        plan_bail!(
            "--gpus ({}), --global-batch ({}) and --micro-batch ({}) must be at least 1",
            i.gpus,
            i.global_batch,
            base.micro_batch
        )
    }
    if i.kinds.is_empty() || i.recompute.is_empty() || i.zero.is_empty() {
        plan_bail!("search: the CP kinds, recompute policies and ZeRO stages to try must not be empty")
    }
    if let Some(z) = i.zero.iter().find(|&&z| z > 3) {
        plan_bail!("--zero must be 0, 1, 2 or 3, got {z}")
    }
    let (zero, recompute) = choices(i);
    if zero.is_empty() || recompute.is_empty() {
        plan_bail!(
            "--finetune-llama: the trainer runs ZeRO 0-2 and recompute none or full; the lists asked for ({:?}, {:?}) leave nothing",
            i.zero,
            i.recompute
        )
    }
    let (mut evaluated, mut fitting, mut invalid) = (0, 0, 0);
    let mut first_refusal = None;
    // the fastest candidate per (tp, cp, kind, ulysses, pp); ordered, so that ties list the
    // same way on every run
    let mut best: BTreeMap<(usize, usize, String, usize, usize), Candidate> = BTreeMap::new();
    for (layout, k) in layouts(i, &zero, &recompute) {
        if let Err(e) = layout.validate(&base.model, base.seq) {
            invalid += 1;
            first_refusal.get_or_insert(e.0);
            continue;
        }
        let overlap = if i.finetune_llama {
            base.overlap.limit(layout.recompute == Recompute::Full, matches!(layout.zero, 1 | 2))
        } else {
            base.overlap
        };
        let input = PlanInput {
            layout: layout.clone(),
            micro_batches: Some(k),
            overlap,
            ..base.clone()
        };
        let p = match plan(&input) {
            Ok(p) => p,
            Err(e) => {
                invalid += 1;
                first_refusal.get_or_insert(e.0);
                continue;
            }
        };
        evaluated += 1;
        if !p.fits {
            continue;
        }
        fitting += 1;
        let l = &layout;
        let key = (l.tp, l.cp, format!("{:?}", l.cp_kind), l.ulysses, l.pp);
        let finetune_llama_flags = i
            .finetune_llama
            .then(|| finetune_llama_flags(&layout, k, base, overlap));
        let c = Candidate {
            layout,
            micro_batches: k,
            memory_per_gpu_bytes: p.memory_per_gpu_bytes,
            step: p.step,
            bottleneck: p.bottleneck,
            finetune_llama_flags,
        };
        match best.get(&key) {
            Some(old) if !faster(&c, old) => {}
            _ => {
                best.insert(key, c);
            }
        }
    }
    if evaluated == 0 {
        match first_refusal {
            Some(e) => plan_bail!(
                "the planner refuses every layout of {} GPUs for a global batch of {} sequences, e.g.: {e}",
                i.gpus,
                i.global_batch
            ),
            None => plan_bail!(
                "no layout of {} GPUs splits a global batch of {} sequences of micro-batch {} (dp·b must divide it) with the degrees and kinds asked for",
                i.gpus,
                i.global_batch,
                base.micro_batch
            ),
        }
    }
    let best = rank(best.into_values().collect(), i.top.max(1));
    Ok(SearchResult {
        gpus: i.gpus,
        global_batch: i.global_batch,
        evaluated,
        fitting,
        invalid,
        finetune_llama: i.finetune_llama,
        activation_model: i.base.activation_model,
        best,
    })
}

/// `examples/finetune_llama`'s flags for `l` with `k` micro-batches (`--batch` is the rows of
/// one micro-batch over all DP replicas, `--grad-accum` the micro-batches per step).
fn finetune_llama_flags(l: &Layout, k: usize, base: &PlanInput, overlap: Overlap) -> String {
    use std::fmt::Write;
    let mut f = format!("--seq-len {} --tp {}", base.seq, l.tp);
    if l.sp {
        f.push_str(" --sp");
    }
    let kind = match l.cp_kind {
        CpKind::Ring => "zigzag",
        CpKind::Allgather => "allgather",
        CpKind::Ulysses => "ulysses",
        CpKind::TwoD => "2d",
    };
    let _ = write!(f, " --cp {} --cp-kind {kind}", l.cp);
    if l.cp_kind == CpKind::TwoD {
        let _ = write!(f, " --ulysses {}", l.ulysses);
    }
    if l.regather_heads && matches!(l.cp_kind, CpKind::Ulysses | CpKind::TwoD) {
        f.push_str(" --regather-heads");
    }
    match l.f32_row_sums {
        Some(true) => f.push_str(" --row-sums f32"),
        Some(false) => f.push_str(" --row-sums output"),
        None => {}
    }
    let _ = write!(f, " --dp {} --batch {} --grad-accum {k}", l.dp, l.dp * base.micro_batch);
    if l.ep > 1 {
        let _ = write!(f, " --ep {}", l.ep);
    }
    let dtype = match base.dtype {
        Dtype::Bf16 => "bf16",
        Dtype::Fp16 => "f16",
        Dtype::Fp32 => "f32",
    };
    let _ = write!(f, " --dtype {dtype}");
    if l.recompute == Recompute::Full {
        f.push_str(" --recompute");
    }
    match l.zero {
        1 => f.push_str(" --zero1"),
        2 => f.push_str(" --zero2"),
        _ => {}
    }
    if matches!(overlap, Overlap::Grad | Overlap::All) {
        f.push_str(" --overlap-grad-sync");
    }
    if matches!(overlap, Overlap::Gather | Overlap::All) {
        f.push_str(" --overlap-param-gather");
    }
    if l.lora_rank > 0 {
        // (alpha = 2r, a common choice; it does not change the plan)
        let _ = write!(f, " --lora {},{}", l.lora_rank, 2 * l.lora_rank);
        if l.lora_mlp {
            f.push_str(" --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
        }
        if l.lora_dora {
            f.push_str(" --dora");
        }
        // (a reward model's head is its score head)
        let head = if base.model.score_head.is_some() { "score" } else { "lm_head" };
        let saved: Vec<&str> = [(l.lora_save_embed, "embed_tokens"), (l.lora_save_head, head)].iter().filter(|(on, _)| *on).map(|(_, m)| *m).collect();
        if !saved.is_empty() {
            let _ = write!(f, " --lora-modules-to-save {}", saved.join(","));
        }
        if let Some(q) = l.base_quant {
            let _ = write!(f, " --quantize-base {q}");
        }
    }
    f
}

/// Steps within this fraction of each other count as equal when ranking.
pub const TIE: f64 = 0.005;

/// GPUs per model replica, `tp·cp·pp`: fewer is simpler.
fn model_parallel(c: &Candidate) -> usize {
    c.layout.tp * c.layout.cp * c.layout.pp
}

/// The first `top` rows: each time, of the rows whose step is within [`TIE`] of the fastest
/// left, the one with the fewest GPUs per model replica, then the least memory. The model
/// leaves out per-step latencies that grow with the model-parallel degrees (kernel launches,
/// collective latency, smaller attention blocks running slower), so at an equal modelled
/// step the simpler layout is the better bet: CP that buys nothing is not recommended.
fn rank(mut rows: Vec<Candidate>, top: usize) -> Vec<Candidate> {
    rows.sort_by(|a, b| a.step.step_s.total_cmp(&b.step.step_s));
    let mut out = Vec::new();
    while !rows.is_empty() && out.len() < top {
        let limit = rows[0].step.step_s * (1.0 + TIE);
        let pick = rows
            .iter()
            .enumerate()
            .take_while(|(_, c)| c.step.step_s <= limit)
            .min_by(|(_, a), (_, b)| {
                model_parallel(a)
                    .cmp(&model_parallel(b))
                    .then(a.memory_per_gpu_bytes.total_cmp(&b.memory_per_gpu_bytes))
                    .then(a.step.step_s.total_cmp(&b.step.step_s))
            })
            .map_or(0, |(j, _)| j);
        out.push(rows.remove(pick));
    }
    out
}

/// Shorter step; on a tie, less memory, then fewer GPUs per TP/CP group (simpler layouts).
fn faster(a: &Candidate, b: &Candidate) -> bool {
    let key = |c: &Candidate| {
        (
            c.step.step_s,
            c.memory_per_gpu_bytes,
            (c.layout.tp * c.layout.cp) as f64,
            c.layout.zero as f64,
        )
    };
    key(a).partial_cmp(&key(b)) == Some(Ordering::Less)
}

#[cfg(test)]
#[path = "search_tests.rs"]
mod tests;
