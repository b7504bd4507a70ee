//! Llama parity: logits, loss and EVERY parameter gradient of each parallel layout equal the
//! float64 oracle (`tests/data/oracle/tiny-llama`, T = 2048) within the README tolerances
//! (logits abs 1e-5, loss abs 5e-6, grad rel 5e-5), and all ranks agree.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::verify::{compare, load_reference, run_layout, run_layout_recompute, Reference, Tolerances};
use candle_cp_llama::{global_mean, hf::load_safetensors_dir, LlamaConfig};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

struct Data {
    cfg: LlamaConfig,
    full: HashMap<String, Tensor>,
    reference: Reference,
}

fn dir() -> PathBuf {
    candle_cp_tests::oracle_dir("tiny-llama")
}

fn data() -> &'static Data {
    static D: OnceLock<Data> = OnceLock::new();
    D.get_or_init(|| {
        let load = || -> Result<Data> {
            let cfg = LlamaConfig::from_file(dir().join("config.json"))?;
            let full = load_safetensors_dir(&dir(), &Device::Cpu)?;
            let reference = load_reference(dir().join("reference.safetensors"))?;
            Ok(Data { cfg, full, reference })
        };
        load().expect("loading tiny-llama oracle")
    })
}

/// Run `layout` on the oracle input and assert every metric is within tolerance.
fn check(layout: Layout) {
    check_ids(layout, &data().reference.input_ids)
}

fn check_ids(layout: Layout, ids: &Tensor) {
    let d = data();
    let t0 = std::time::Instant::now();
    let run = run_layout(&d.full, &d.cfg, ids, layout, &Device::Cpu).unwrap_or_else(|e| panic!("{layout}: {e}"));
    let mut reference = Reference {
        input_ids: ids.clone(),
        logits: d.reference.logits.clone(),
        loss: d.reference.loss,
        grads: d.reference.grads.clone(),
    };
    let b = ids.dim(0).unwrap();
    if b > 1 {
        // every batch row is the oracle sequence: same logits per row, same mean loss and grads
        reference.logits = Tensor::cat(&vec![&d.reference.logits; b], 0).unwrap();
    }
    let rep = compare(&run, &reference, Tolerances::default()).unwrap();
    println!(
        "{layout}: logits_abs {:.2e} loss_abs {:.2e} grad_rel_max {:.2e} ({}) rank_spread {:.1e} [{:.1}s]",
        rep.logits_abs,
        rep.loss_abs,
        rep.grad_rel_max,
        rep.worst_param,
        rep.rank_spread,
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(
        rep.grad_rel.len(),
        d.reference.grads.len(),
        "{layout}: every parameter compared"
    );
    assert!(rep.pass(), "{layout}: out of tolerance: {rep:?}");
}

#[test]
fn single_device() {
    check(Layout::single());
}

#[test]
fn perturbed_reference_fails() {
    // the comparison is sharp: a 1e-3 relative change of one gradient, or 1e-4 on one
    // logit, is reported as FAIL and blamed on the right tensor
    let d = data();
    let run = run_layout(&d.full, &d.cfg, &d.reference.input_ids, Layout::single(), &Device::Cpu).unwrap();
    let mut bad = Reference {
        input_ids: d.reference.input_ids.clone(),
        logits: d.reference.logits.clone(),
        loss: d.reference.loss,
        grads: d.reference.grads.clone(),
    };
    let name = "model.layers.1.mlp.up_proj.weight";
    let g = &bad.grads[name];
    let bumped = (g + (g.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() as f64 * 1e-3)).unwrap();
    bad.grads.insert(name.to_string(), bumped);
    let rep = compare(&run, &bad, Tolerances::default()).unwrap();
    assert!(!rep.pass() && rep.worst_param == name, "{rep:?}");
    assert!(rep.grad_rel_max > 5e-4, "{rep:?}");
    let mut bad2 = Reference {
        grads: d.reference.grads.clone(),
        logits: (&d.reference.logits + 1e-4).unwrap(),
        ..bad
    };
    bad2.loss = d.reference.loss;
    let rep = compare(&run, &bad2, Tolerances::default()).unwrap();
    assert!(!rep.pass() && rep.logits_abs > 9e-5, "{rep:?}");
    let mut bad3 = Reference {
        logits: d.reference.logits.clone(),
        loss: d.reference.loss + 1e-5,
        ..bad2
    };
    bad3.grads = d.reference.grads.clone();
    assert!(!compare(&run, &bad3, Tolerances::default()).unwrap().pass());
}

#[test]
fn cp_ring_contiguous() {
    check(Layout::cp(CpKind::Ring, 2));
    check(Layout::cp(CpKind::Ring, 4));
}

#[test]
fn cp_zigzag() {
    check(Layout::cp(CpKind::Zigzag, 2));
    check(Layout::cp(CpKind::Zigzag, 4));
}

#[test]
fn cp_striped() {
    check(Layout::cp(CpKind::Striped, 2));
    check(Layout::cp(CpKind::Striped, 4));
}

#[test]
fn cp_allgather() {
    check(Layout::cp(CpKind::AllGather, 2));
    check(Layout::cp(CpKind::AllGather, 4));
}

#[test]
fn ulysses_2_and_4_with_kv_replication() {
    check(Layout::cp(CpKind::Ulysses, 2));
    // 2 KV heads over 4 ranks: each KV head replicated twice
    check(Layout::cp(CpKind::Ulysses, 4));
}

#[test]
fn tp2_with_sp() {
    check(Layout::single().with_tp(2, true));
}

#[test]
fn tp2_without_sp() {
    check(Layout::single().with_tp(2, false));
}

#[test]
fn tp2_x_cp2_zigzag_sp() {
    check(Layout::cp(CpKind::Zigzag, 2).with_tp(2, true));
}

#[test]
fn tp2_x_ulysses2_sp_kv_replicated() {
    // after TP each rank has 1 KV head; Ulysses 2 replicates it
    check(Layout::cp(CpKind::Ulysses, 2).with_tp(2, true));
}

#[test]
fn tp4_sp_kv_heads_replicated() {
    // 2 KV heads over TP 4: each KV head on 2 TP ranks, its weight gradient summed over them
    check(Layout::single().with_tp(4, true));
}

#[test]
fn tp8_no_sp_one_query_head_per_rank() {
    // 8 query heads, 2 KV heads over TP 8: one query head per rank, each KV head on 4 ranks
    check(Layout::single().with_tp(8, false));
}

#[test]
fn tp4_x_cp2_zigzag_sp_kv_heads_replicated() {
    // the KV-copy gradient groups span the CP ranks too (8 ranks)
    check(Layout::cp(CpKind::Zigzag, 2).with_tp(4, true));
}

#[test]
fn two_d_2x2() {
    check(Layout::two_d(2, 2));
}

#[test]
fn dp2_x_cp2_duplicated_batch() {
    // B = 2 copies of the oracle sequence over 2 DP replicas: the mean over both rows
    // equals the oracle loss, and the summed gradients its gradients.
    let ids = &data().reference.input_ids;
    let ids2 = Tensor::cat(&[ids, ids], 0).unwrap();
    check_ids(Layout::cp(CpKind::Zigzag, 2).with_dp(2), &ids2);
}

#[test]
fn global_loss_is_finite_when_a_rank_has_no_target() -> Result<()> {
    // rank 0 holds 3 targets, rank 1 none: both return (1+2+3)/3 = 2, gradient 1/3 on rank 0
    let res = run_ranks(2, |g| {
        let terms = if g.rank() == 0 {
            candle_core::Var::new(&[1f32, 2., 3.], &Device::Cpu)?
        } else {
            candle_core::Var::new(&[0f32], &Device::Cpu)?
        };
        let n = if g.rank() == 0 { 3 } else { 0 };
        let terms_t = if n == 0 {
            (terms.as_tensor() * 0.0)?
        } else {
            terms.as_tensor().clone()
        };
        let loss = global_mean(&terms_t, n, &g)?;
        let grads = loss.backward()?;
        let gr = grads.get(terms.as_tensor()).map(|x| x.to_vec1::<f32>()).transpose()?;
        Ok((loss.to_dtype(DType::F32)?.to_scalar::<f32>()?, gr))
    });
    let r0 = res[0].as_ref().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let r1 = res[1].as_ref().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert!((r0.0 - 2.0).abs() < 1e-6 && (r1.0 - 2.0).abs() < 1e-6, "{r0:?} {r1:?}");
    let g0 = r0.1.clone().unwrap_or_default();
    assert!(g0.iter().all(|x| (x - 1.0 / 3.0).abs() < 1e-6), "{g0:?}");
    assert!(r1.1.clone().unwrap_or_default().iter().all(|x| *x == 0.0));
    // nobody holds a target: 0, not NaN
    let res = run_ranks(2, |g| {
        let t = Tensor::zeros(1, DType::F32, &Device::Cpu)?;
        global_mean(&t, 0, &g)?.to_scalar::<f32>()
    });
    for r in res {
        assert_eq!(r?, 0.0);
    }
    Ok(())
}

#[test]
fn tied_head_and_llama3_rope_layouts_equal_single_device() -> Result<()> {
    // No oracle for this config: the single-device run is the reference. Tied embeddings
    // (the embedding gets gradient from both uses) and llama3 RoPE scaling at global
    // positions beyond original_max_position_embeddings.
    let mut cfg = LlamaConfig::tiny(96, 64, 2, 4, 2);
    cfg.tie_word_embeddings = true;
    cfg.rope_theta = 500000.0;
    cfg.rope_scaling = candle_cp_llama::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    };
    let vm = candle_cp_llama::init_params(&cfg, 5, DType::F32, &Device::Cpu)?;
    let full = candle_cp_llama::params::varmap_tensors(&vm)?;
    let t = 256;
    let ids: Vec<u32> = (0..t as u32).map(|i| (i * 37 + 11) % 96).collect();
    let ids = Tensor::from_vec(ids, (1, t), &Device::Cpu)?;
    let single = run_layout(&full, &cfg, &ids, Layout::single(), &Device::Cpu)?;
    assert!(!single.grads.iter().any(|(k, _)| k == "lm_head.weight"));
    let reference = Reference {
        input_ids: ids.clone(),
        logits: single.logits.clone(),
        loss: single.loss,
        grads: single.grads.iter().cloned().collect(),
    };
    for layout in [
        Layout::cp(CpKind::Striped, 4),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
        Layout::two_d(2, 2),
        Layout::cp(CpKind::AllGather, 2).with_tp(2, false),
    ] {
        let run = run_layout(&full, &cfg, &ids, layout, &Device::Cpu)?;
        let rep = compare(&run, &reference, Tolerances::default())?;
        println!(
            "tied/llama3 {layout}: logits {:.1e} loss {:.1e} grad {:.1e}",
            rep.logits_abs, rep.loss_abs, rep.grad_rel_max
        );
        assert!(rep.pass(), "{layout}: {rep:?}");
    }
    Ok(())
}

/// Activation recomputation (every decoder layer checkpointed, rerun in backward with its
/// collectives) gives the plain run's logits, loss and gradients on every kind of layout,
/// and still the oracle's.
#[test]
fn recompute_matches_plain_on_every_layout() {
    let d = data();
    let ids = &d.reference.input_ids;
    for layout in [
        Layout::single(),
        Layout::cp(CpKind::Zigzag, 2),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::cp(CpKind::AllGather, 2),
        Layout::single().with_tp(2, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
        Layout::two_d(2, 2),
    ] {
        let t0 = std::time::Instant::now();
        let plain = run_layout(&d.full, &d.cfg, ids, layout, &Device::Cpu).unwrap_or_else(|e| panic!("{layout}: {e}"));
        let rc = run_layout_recompute(&d.full, &d.cfg, ids, layout, &Device::Cpu, true)
            .unwrap_or_else(|e| panic!("{layout} recompute: {e}"));
        let logits = diff(&plain.logits, &rc.logits);
        let loss = (plain.loss - rc.loss).abs();
        let mut grad = 0f64;
        assert_eq!(plain.grads.len(), rc.grads.len(), "{layout}: same parameters");
        for ((na, a), (nb, b)) in plain.grads.iter().zip(&rc.grads) {
            assert_eq!(na, nb);
            grad = grad.max(diff(a, b) / max_abs(a).max(1e-30));
        }
        println!(
            "{layout} recompute vs plain: logits {logits:.1e} loss {loss:.1e} grad rel {grad:.1e} [{:.1}s]",
            t0.elapsed().as_secs_f64()
        );
        assert!(logits <= 1e-6 && loss <= 1e-7 && grad <= 1e-5, "{layout}: recompute differs from the plain run");
        let rep = compare(&rc, &d.reference, Tolerances::default()).unwrap();
        assert!(rep.pass(), "{layout} recompute: out of oracle tolerance: {rep:?}");
    }
}

fn diff(a: &Tensor, b: &Tensor) -> f64 {
    max_abs(&(a - b).unwrap())
}

fn max_abs(a: &Tensor) -> f64 {
    a.to_dtype(DType::F64).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

/// `verify_prefix_on` (the quick CUDA check's comparison): a zigzag CP 2 x TP 2 + SP run on
/// thread ranks over the first 128 tokens passes against the CPU run of those tokens; a
/// prefix of 0 tokens, or longer than the reference's sequence, is an error naming the shape.
#[test]
fn prefix_against_the_cpu_run() {
    use candle_cp_llama::verify::verify_prefix_on;
    let d = dir();
    let reference = d.join("reference.safetensors");
    let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true);
    let n = layout.world_size();
    let spawn = |body: &candle_cp_llama::verify::LayoutRankBody| Ok(candle_cp_comm::run_ranks_with(n, Default::default(), body));
    let r = verify_prefix_on(&d, &reference, 128, layout, &Device::Cpu, spawn).unwrap();
    assert!(r.pass(), "logits {} loss {} grad rel {} ({})", r.logits_abs, r.loss_abs, r.grad_rel_max, r.worst_param);
    for bad in [0, 1 << 20] {
        let e = verify_prefix_on(&d, &reference, bad, layout, &Device::Cpu, spawn).unwrap_err().to_string();
        assert!(e.contains("input_ids ["), "{e}");
    }
}

/// Ulysses and 2-D with the head layout regathered in the backward (`--regather-heads`)
/// give the kept run's logits, loss and every gradient bit for bit (f32), and the oracle's.
#[test]
fn regathered_heads_match_kept() {
    use candle_cp_llama::HeadLayout;
    let d = data();
    let ids = &d.reference.input_ids;
    for layout in [Layout::cp(CpKind::Ulysses, 2), Layout::two_d(2, 2), Layout::cp(CpKind::Ulysses, 2).with_tp(2, true)] {
        let t0 = std::time::Instant::now();
        let kept = run_layout(&d.full, &d.cfg, ids, layout, &Device::Cpu).unwrap_or_else(|e| panic!("{layout}: {e}"));
        let layout = layout.with_head_layout(HeadLayout::Regathered);
        let re = run_layout(&d.full, &d.cfg, ids, layout, &Device::Cpu).unwrap_or_else(|e| panic!("{layout}: {e}"));
        assert_eq!(kept.grads.len(), re.grads.len(), "{layout}: same parameters");
        let mut grad = 0f64;
        for ((na, a), (nb, b)) in kept.grads.iter().zip(&re.grads) {
            assert_eq!(na, nb);
            grad = grad.max(diff(a, b));
        }
        let (logits, loss) = (diff(&kept.logits, &re.logits), (kept.loss - re.loss).abs());
        println!("{layout} vs kept: logits {logits:e} loss {loss:e} grad {grad:e} [{:.1}s]", t0.elapsed().as_secs_f64());
        assert!(logits == 0.0 && loss == 0.0 && grad == 0.0, "{layout}: regathered differs from kept");
        let rep = compare(&re, &d.reference, Tolerances::default()).unwrap();
        assert!(rep.pass(), "{layout}: out of oracle tolerance: {rep:?}");
    }
}

/// Where the attention backward's row sums come from (`--row-sums f32|output`) changes nothing
/// in f32 (nothing is rounded): one device, TP 2 + SP and Ulysses 2 (head layout kept and
/// regathered) with f32 row sums, the zigzag ring 2 and 2-D 2 × 2 with the output's, give the
/// default run's logits, loss and every gradient bit for bit, and the oracle's. (bf16:
/// `tests/bf16_precision.rs`, `tests/ulysses_sp/head_layout.rs`; memory:
/// `tests/plan_activations.rs`.)
#[test]
fn row_sums_change_nothing_in_f32() {
    use candle_cp_llama::{HeadLayout, RowSums};
    let d = data();
    let ids = &d.reference.input_ids;
    let ulysses = Layout::cp(CpKind::Ulysses, 2);
    let f32_rows = [Layout::single(), Layout::single().with_tp(2, true), ulysses, ulysses.with_head_layout(HeadLayout::Regathered)];
    let out_rows = [Layout::cp(CpKind::Zigzag, 2), Layout::two_d(2, 2)];
    let cases = f32_rows.map(|l| (l, RowSums::F32)).into_iter().chain(out_rows.map(|l| (l, RowSums::Output)));
    for (layout, rows) in cases {
        let base = run_layout(&d.full, &d.cfg, ids, layout, &Device::Cpu).unwrap_or_else(|e| panic!("{layout}: {e}"));
        let layout = layout.with_row_sums(rows);
        let rs = run_layout(&d.full, &d.cfg, ids, layout, &Device::Cpu).unwrap_or_else(|e| panic!("{layout}: {e}"));
        let grad = base.grads.iter().zip(&rs.grads).map(|((na, a), (nb, b))| {
            assert_eq!(na, nb);
            diff(a, b)
        });
        let grad = grad.fold(0f64, f64::max);
        let (logits, loss) = (diff(&base.logits, &rs.logits), (base.loss - rs.loss).abs());
        println!("{layout} vs default: logits {logits:e} loss {loss:e} grad {grad:e}");
        assert!(logits == 0.0 && loss == 0.0 && grad == 0.0, "{layout}: differs from the default row sums in f32");
        let rep = compare(&rs, &d.reference, Tolerances::default()).unwrap();
        assert!(rep.pass(), "{layout}: out of oracle tolerance: {rep:?}");
    }
}
