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
