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
        let saved: Vec<&str> = [(l.lora_save_embed, "embed_tokens"), (l.lora_save_head, "lm_head")].iter().filter(|(on, _)| *on).map(|(_, m)| *m).collect();
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
mod tests {
    use super::*;
    use crate::{Hardware, ModelConfig};

    fn input(model: &str, hw: &str, seq: usize, gpus: usize, batch: usize) -> SearchInput {
        let base = PlanInput::new(
            ModelConfig::preset(model).unwrap(),
            Hardware::preset(hw).unwrap(),
            Layout::default(),
            seq,
        );
        SearchInput {
            base,
            gpus,
            global_batch: batch,
            kinds: vec![CpKind::Ring, CpKind::Allgather, CpKind::Ulysses, CpKind::TwoD],
            recompute: vec![Recompute::None, Recompute::Full],
            zero: vec![1, 2, 3],
            max_tp: None,
            top: 10,
            finetune_llama: false,
        }
    }

    /// A mixture of experts is searched with expert parallelism too: Qwen3-30B-A3B at 128k on
    /// 16 H100s for finetune_llama (ZeRO ≤ 2) counts more layouts than with EP 1 only, ranks
    /// some EP layouts, each a valid plan that fits, whose flags carry `--ep`; the EP degrees
    /// tried divide both dp·cp and the 128 experts; a dense model is searched with EP 1.
    #[test]
    fn moe_search_tries_expert_parallelism() {
        let mut i = input("qwen3-30b-a3b", "h100", 131072, 16, 4);
        (i.finetune_llama, i.zero, i.top) = (true, vec![0, 1, 2], 40);
        let r = search(&i).unwrap();
        let ep: Vec<&Candidate> = r.best.iter().filter(|c| c.layout.ep > 1).collect();
        assert!(!ep.is_empty(), "{r:?}");
        for c in &ep {
            let l = &c.layout;
            assert!((l.dp * l.cp).is_multiple_of(l.ep) && 128 % l.ep == 0);
            let p = plan(&PlanInput { layout: l.clone(), micro_batches: Some(c.micro_batches), ..i.base.clone() }).unwrap();
            assert!(p.fits && p.ep_comm.fwd_bytes_per_layer > 0.0);
            let flags = c.finetune_llama_flags.as_deref().unwrap_or("");
            assert!(flags.contains(&format!("--ep {}", l.ep)), "{flags}");
        }
        assert_eq!(expert_degrees(&i.base, 16), vec![1, 2, 4, 8, 16]);
        assert_eq!(expert_degrees(&i.base, 12), vec![1, 2, 4]);
        let dense = input("llama3-8b", "h100", 131072, 16, 4);
        assert_eq!(expert_degrees(&dense.base, 16), vec![1]);
        assert!(search(&dense).unwrap().best.iter().all(|c| c.layout.ep == 1));
    }

    /// Every row is a valid, fitting layout of exactly N GPUs whose plan, recomputed, gives
    /// the same step; each row is within TIE of the fastest row after it; and no layout left
    /// out of the rows beats the first by more than TIE.
    #[test]
    fn ranks_fitting_layouts_by_step_time() {
        let i = input("llama3-8b", "h100", 131072, 64, 16);
        let r = search(&i).unwrap();
        assert!(r.best.len() == 10 && r.fitting >= 10 && r.evaluated >= r.fitting, "{r:?}");
        for (n, c) in r.best.iter().enumerate() {
            let rest = r.best[n..].iter().map(|c| c.step.step_s).fold(f64::INFINITY, f64::min);
            assert!(c.step.step_s <= rest * (1.0 + TIE), "row {n}");
        }
        for c in &r.best {
            let l = &c.layout;
            assert_eq!(l.world(), 64);
            assert_eq!(l.dp * c.micro_batches, 16);
            let p = plan(&PlanInput { layout: l.clone(), micro_batches: Some(c.micro_batches), ..i.base.clone() }).unwrap();
            assert!(p.fits && p.memory_per_gpu_bytes <= 80e9);
            assert_eq!(p.step, c.step);
        }
        // brute force over a few hand-written layouts: none fitting is faster than the first
        let first = r.best[0].step.step_s;
        for (tp, cp, pp) in [(8, 8, 1), (4, 16, 1), (8, 4, 2), (2, 32, 1), (1, 64, 1), (8, 2, 4)] {
            for zero in [1u8, 2, 3] {
                for recompute in [Recompute::None, Recompute::Full] {
                    let l = Layout { tp, sp: tp > 1, cp, pp, virtual_stages: if pp > 1 { 2 } else { 1 }, dp: 64 / (tp * cp * pp), zero, recompute, ..Layout::default() };
                    let k = 16 / l.dp;
                    let p = plan(&PlanInput { layout: l, micro_batches: Some(k), ..i.base.clone() }).unwrap();
                    assert!(!p.fits || p.step.step_s * (1.0 + TIE) >= first, "{tp} {cp} {pp} z{zero}: {} < {first}", p.step.step_s);
                }
            }
        }
    }

    /// Llama 3 405B at 128k on 16,384 H100s with a batch of 128 sequences: nothing without
    /// CP fits; every row uses CP ≥ 16 and TP within a node.
    #[test]
    fn llama3_405b_needs_cp() {
        let mut i = input("llama3-405b", "h100", 131072, 16384, 128);
        i.kinds = vec![CpKind::Ring];
        let r = search(&i).unwrap();
        assert!(!r.best.is_empty());
        for c in &r.best {
            assert!(c.layout.tp <= 8 && c.layout.cp * c.layout.tp >= 64, "{:?}", c.layout);
        }
    }

    /// Llama 3 8B at 4k on 8 GPUs: CP 2 models no faster than plain DP (the chunks hide their
    /// ring steps, and the rates do not depend on the chunk), so the first row has no CP; the
    /// ranking rule, not the step, decides it.
    #[test]
    fn ties_go_to_the_simpler_layout() {
        let i = input("llama3-8b", "h100", 4096, 8, 64);
        let r = search(&i).unwrap();
        let first = &r.best[0];
        assert_eq!((first.layout.tp, first.layout.cp, first.layout.pp), (1, 1, 1), "{:?}", first.layout);
        let fastest = r.best.iter().map(|c| c.step.step_s).fold(f64::INFINITY, f64::min);
        assert!(first.step.step_s <= fastest * (1.0 + TIE));
        // rank() on its own: a 0.1% slower row with fewer GPUs per replica goes first; a 1%
        // slower one does not
        let mut a = first.clone();
        let mut b = first.clone();
        b.layout.cp = 2;
        b.step.step_s = a.step.step_s / 1.001;
        assert_eq!(rank(vec![b.clone(), a.clone()], 2)[0].layout.cp, 1);
        a.step.step_s = b.step.step_s * 1.01;
        assert_eq!(rank(vec![a, b], 2)[0].layout.cp, 2);
    }

    /// `--finetune-llama`: only what the trainer runs, with the overlaps it has, and its flags.
    #[test]
    fn finetune_llama_rows_are_what_the_trainer_runs() {
        let mut i = input("llama3-8b", "h200", 131072, 16, 16);
        i.finetune_llama = true;
        i.zero = vec![0, 1, 2, 3];
        i.top = 50;
        let r = search(&i).unwrap();
        assert!(r.best.len() > 5, "{r:?}");
        for c in &r.best {
            let l = &c.layout;
            assert!(l.pp == 1 && l.zero <= 2 && l.recompute != Recompute::Selective, "{l:?}");
            let f = c.finetune_llama_flags.as_deref().unwrap();
            let full = l.recompute == Recompute::Full;
            let zero12 = matches!(l.zero, 1 | 2);
            assert_eq!(f.contains("--overlap-grad-sync"), full, "{f}");
            assert_eq!(f.contains("--overlap-param-gather"), zero12, "{f}");
            assert_eq!(c.step.overlap, Overlap::All.limit(full, zero12));
            assert!(f.contains(&format!("--cp {} ", l.cp)) && f.contains(&format!("--batch {} --grad-accum {}", l.dp, c.micro_batches)), "{f}");
        }
        // without the trainer's limits, the same layout with recompute none is priced with
        // the gradient reduction overlapped: never slower
        let free = search(&SearchInput { finetune_llama: false, ..i.clone() }).unwrap();
        assert!(free.best[0].step.step_s <= r.best[0].step.step_s);
        assert!(free.best.iter().all(|c| c.finetune_llama_flags.is_none()));
        i.zero = vec![3];
        assert!(search(&i).unwrap_err().0.contains("leave nothing"));
    }

    /// Under the candle-cp count Ulysses is tried with and without the head layout
    /// regathered: kept where it fits (faster), regathered where only that fits, with the
    /// trainer's flag; `--regather-heads` forces it; other counts never regather.
    #[test]
    fn ulysses_regathers_heads_only_where_that_fits() {
        let mut i = input("llama3-8b", "h100", 131072, 16, 16);
        i.kinds = vec![CpKind::Ulysses];
        i.recompute = vec![Recompute::None];
        i.zero = vec![1];
        i.finetune_llama = true;
        i.base.activation_model = ActivationModel::CandleCp;
        let l = Layout { tp: 2, sp: true, cp: 8, cp_kind: CpKind::Ulysses, dp: 1, ..Layout::default() };
        let mem = |regather_heads: bool| {
            let layout = Layout { regather_heads, ..l.clone() };
            plan(&PlanInput { layout, micro_batches: Some(16), ..i.base.clone() }).unwrap().memory_per_gpu_bytes
        };
        let (kept, regathered) = (mem(false), mem(true));
        assert!(regathered < kept, "{regathered} vs {kept}");
        let row = |i: &SearchInput| {
            let r = search(i).unwrap();
            r.best.into_iter().find(|c| (c.layout.tp, c.layout.cp) == (2, 8)).expect("a tp 2 x ulysses 8 row")
        };
        i.base.hardware.mem_bytes = kept * 1.01;
        let c = row(&i);
        assert!(!c.layout.regather_heads && !c.finetune_llama_flags.as_deref().unwrap().contains("--regather-heads"));
        i.base.hardware.mem_bytes = (kept + regathered) / 2.0;
        let c = row(&i);
        assert!(c.layout.regather_heads && c.finetune_llama_flags.as_deref().unwrap().contains("--regather-heads"), "{c:?}");
        let text = crate::report::render_search(&search(&i).unwrap(), &i.base);
        assert!(text.contains("ulysses rg") && text.contains("rg: q, k, v"), "{text}");
        // forced
        i.base.hardware.mem_bytes = kept * 1.01;
        i.base.layout.regather_heads = true;
        assert!(row(&i).layout.regather_heads);
        // another count: the head layout changes no memory there, so it is never tried
        i.base.layout.regather_heads = false;
        i.base.activation_model = ActivationModel::Llama;
        i.base.hardware.mem_bytes = 1e12;
        assert!(search(&i).unwrap().best.iter().all(|c| !c.layout.regather_heads));
    }

    #[test]
    fn bad_inputs_are_named() {
        let mut i = input("llama3-8b", "h100", 8192, 0, 16);
        assert!(search(&i).unwrap_err().0.contains("--gpus (0)"));
        i.gpus = 8;
        i.global_batch = 3; // no dp·b divides 3 except dp = 1: 8 GPUs of TP/CP/PP only
        assert!(search(&i).is_ok());
        i.kinds.clear();
        assert!(search(&i).unwrap_err().0.contains("must not be empty"));
        let mut j = input("llama3-8b", "h100", 8192, 8, 16);
        j.zero = vec![4];
        assert!(search(&j).unwrap_err().0.contains("got 4"));
        let mut k = input("llama3-8b", "h100", 8192, 6, 5);
        k.max_tp = Some(1);
        // 6 GPUs: pp and cp are powers of two, so dp is 6, 3 (pp or cp 2) or ... none divides 5
        assert!(search(&k).unwrap_err().0.contains("no layout of 6 GPUs"));
        // a micro-batch so large that dp·b overflows: no layout splits the batch, no panic
        let mut o = input("llama3-8b", "h100", 8192, 8, 8);
        o.base.micro_batch = usize::MAX / 2 + 1;
        assert!(search(&o).unwrap_err().0.contains("no layout of 8 GPUs"));
        // a bad rate makes the planner refuse every layout: the error says why
        let mut r = input("llama3-8b", "h100", 8192, 8, 8);
        r.base.attn_flops = -1.0;
        let e = search(&r).unwrap_err().0;
        assert!(e.contains("refuses every layout") && e.contains("attention FLOP/s must be positive"), "{e}");
    }
}
