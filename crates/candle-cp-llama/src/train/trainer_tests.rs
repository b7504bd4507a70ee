//! Tests of [`super::train_rank`]: resume determinism, DP / accumulation equivalence, a CP
//! rank without targets.
use super::*;
use crate::train::{AdamWConfig, DataSource, WarmupCosine};
use crate::{Layout, LlamaConfig};
use candle_core::DType;
use std::path::PathBuf;
use crate::train::data::KvRecall;
use crate::CpKind;
use crate::{init_params, load_hf, shard_params};
use candle_cp_comm::run_ranks;

pub(super) fn tiny_cfg(out: Option<PathBuf>, layout: Layout, batch: usize, grad_accum: usize) -> TrainConfig {
    let mut task = KvRecall::new(64).unwrap();
    task.n_keys = 8;
    task.n_values = 8;
    task.n_queries = 8;
    task.fused = true;
    let vocab = task.vocab_needed();
    TrainConfig {
        batch,
        grad_accum,
        schedule: WarmupCosine { peak: 1e-2, warmup: 2, total: 6, min_ratio: 0.1 },
        adamw: AdamWConfig { weight_decay: 0.01, ..AdamWConfig::default() },
        clip: 0.5,
        seed: 3,
        out,
        save_every: 3,
        ..TrainConfig::new(layout, ModelSource::Init(LlamaConfig::tiny(vocab, 32, 1, 2, 1)), DataSource::Recall(task), 64, 6)
    }
}

pub(super) fn run(cfg: &TrainConfig) -> Result<Vec<TrainOutcome>> {
    run_ranks(cfg.layout.world_size(), |g| train_rank(g, cfg, &|_| {}))
        .into_iter()
        .collect()
}

/// `got` follows `want` step by step: the same steps, losses within 1e-5, gradient norms
/// within 1e-4 (relative above 1). `what` names the run in failures.
pub(super) fn assert_same_curve(what: &str, want: &[&StepMetrics], got: &[StepMetrics]) {
    for (x, y) in want.iter().zip(got) {
        assert_eq!(x.step, y.step, "{what}");
        assert!((x.loss - y.loss).abs() < 1e-5, "{what} step {}: loss {} vs {}", x.step, x.loss, y.loss);
        assert!(
            (x.grad_norm - y.grad_norm).abs() < 1e-4 * x.grad_norm.max(1.0),
            "{what} step {}: grad norm {} vs {}",
            x.step,
            x.grad_norm,
            y.grad_norm
        );
    }
}

pub(super) fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cp-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// 6 steps straight vs 4 steps (checkpoint at 3, "killed" after 4) + resume: the same
/// loss curve bit for bit, the same final weights, and a metrics file without the lost
/// step 4 duplicated.
#[test]
fn resume_reproduces_the_uninterrupted_run() -> Result<()> {
    let layout = Layout::cp(CpKind::Zigzag, 2);
    let (da, db) = (tmpdir("a"), tmpdir("b"));
    let a = run(&tiny_cfg(Some(da.clone()), layout, 1, 2))?;
    let mut cb = tiny_cfg(Some(db.clone()), layout, 1, 2);
    cb.stop_after = Some(4);
    let b1 = run(&cb)?;
    assert_eq!(b1[0].metrics.len(), 4);
    cb.stop_after = None;
    cb.resume = true;
    let b2 = run(&cb)?;
    assert_eq!(b2[0].start_step, 3);
    let la: Vec<(usize, f64, f64)> = a[0]
        .metrics
        .iter()
        .map(|m| (m.step, m.loss, m.grad_norm))
        .collect();
    let lb: Vec<(usize, f64, f64)> = b1[0].metrics[..3]
        .iter()
        .chain(b2[0].metrics.iter())
        .map(|m| (m.step, m.loss, m.grad_norm))
        .collect();
    assert_eq!(la, lb);
    // The lost step 4 of the killed run was recomputed identically.
    assert_eq!(b1[0].metrics[3].loss, b2[0].metrics[0].loss);
    // Both ranks report the same numbers.
    assert_eq!(
        a[0].metrics.iter().map(|m| m.loss).collect::<Vec<_>>(),
        a[1].metrics.iter().map(|m| m.loss).collect::<Vec<_>>()
    );
    // Metrics file of the resumed run: steps 1..=6 once each, equal to the straight run's.
    let ma = MetricsLog::read(da.join("metrics.jsonl")).unwrap();
    let mb = MetricsLog::read(db.join("metrics.jsonl")).unwrap();
    assert_eq!(
        mb.iter().map(|r| r.step).collect::<Vec<_>>(),
        (1..=6).collect::<Vec<_>>()
    );
    assert_eq!(
        ma.iter().map(|r| r.loss).collect::<Vec<_>>(),
        mb.iter().map(|r| r.loss).collect::<Vec<_>>()
    );
    // Byte-identical apart from the timing columns.
    let strip = |p: PathBuf| -> Vec<(usize, u64, u64, u64, u64)> {
        MetricsLog::read(p)
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r.step,
                    r.train_loss.to_bits(),
                    r.loss.to_bits(),
                    r.grad_norm.to_bits(),
                    r.lr.to_bits(),
                )
            })
            .collect()
    };
    assert_eq!(
        strip(da.join("metrics.jsonl")),
        strip(db.join("metrics.jsonl"))
    );
    // Final checkpoints hold identical weights.
    let wa = std::fs::read(da.join("checkpoints/step-000006/model.safetensors")).unwrap();
    let wb = std::fs::read(db.join("checkpoints/step-000006/model.safetensors")).unwrap();
    assert!(wa == wb, "final weights differ");
    assert!(da.join("loss.png").exists());
    // The final checkpoint loads back as a HF model.
    let (_, c) = load_hf(da.join("checkpoints/step-000006"), &Device::Cpu, DType::F32)?;
    assert_eq!(c.vocab_size, a[0].config.vocab_size);
    // Resuming under another layout reshards the optimizer state (a finished run: nothing
    // left to do); with an optimizer file gone it is an error naming the directory.
    let mut cc = tiny_cfg(Some(da.clone()), Layout::single(), 1, 2);
    cc.resume = true;
    let done = run(&cc)?;
    assert_eq!((done[0].start_step, done[0].metrics.len()), (6, 0));
    std::fs::remove_file(da.join("checkpoints/step-000006/optimizer-tp0.safetensors")).ok();
    let e = run(&cc).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("optimizer-tp0.safetensors") && e.contains("step-000006"), "{e}");
    std::fs::remove_dir_all(&da).ok();
    std::fs::remove_dir_all(&db).ok();
    Ok(())
}

/// Long-range-only objective under zigzag CP = 2 with T = 64: every long-range target
/// lies in the last chunk (rank 0), rank 1 has none — training must neither hang nor
/// produce a non-finite loss, and must match the single-device run.
#[test]
fn long_range_objective_with_a_rank_without_targets() -> Result<()> {
    let mut c2 = tiny_cfg(None, Layout::cp(CpKind::Zigzag, 2), 1, 1);
    c2.long_range_only = true;
    c2.steps = 3;
    let mut c1 = c2.clone();
    c1.layout = Layout::single();
    let two = run(&c2)?;
    let one = run(&c1)?;
    for (x, y) in one[0].metrics.iter().zip(two[0].metrics.iter()) {
        assert!(x.train_loss.is_finite() && x.long_range_loss.is_some());
        assert!((x.train_loss - x.long_range_loss.unwrap_or(f64::NAN)).abs() < 1e-4);
        assert!(
            (x.train_loss - y.train_loss).abs() < 1e-5,
            "step {}: {} vs {}",
            x.step,
            x.train_loss,
            y.train_loss
        );
    }
    assert_eq!(two[0].metrics.len(), 3);
    assert_eq!(
        two[1]
            .metrics
            .iter()
            .map(|m| m.train_loss)
            .collect::<Vec<_>>(),
        two[0]
            .metrics
            .iter()
            .map(|m| m.train_loss)
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// The same rows trained as (dp 1, one 2-row batch), (dp 2, one 2-row batch split over
/// DP) and (dp 1, two 1-row micro-batches): the same losses and gradient norms to f32
/// rounding — DP all-reduce and gradient accumulation average exactly like one batch.
#[test]
fn data_parallel_and_accumulation_match_one_batch() -> Result<()> {
    let zz = Layout::cp(CpKind::Zigzag, 2);
    let one = run(&tiny_cfg(None, zz, 2, 1))?;
    let dp2 = run(&tiny_cfg(None, zz.with_dp(2), 2, 1))?;
    let acc = run(&tiny_cfg(None, zz, 1, 2))?;
    for other in [&dp2, &acc] {
        assert_same_curve("dp 2 / accumulation", &one[0].metrics.iter().collect::<Vec<_>>(), &other[0].metrics);
    }
    Ok(())
}

/// Training with every layer recomputed in backward (with gradient accumulation and
/// TP + SP + zigzag CP, so collectives rerun inside the backward) follows the plain run's
/// loss and gradient-norm curve exactly.
#[test]
fn recompute_trains_like_the_plain_run() -> Result<()> {
    let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true);
    let mut c = tiny_cfg(None, layout, 1, 2);
    if let ModelSource::Init(m) = &c.model {
        // 2 KV heads, so that TP = 2 divides them
        c.model = ModelSource::Init(LlamaConfig::tiny(m.vocab_size, 32, 2, 2, 2));
    }
    let plain = run(&c)?;
    c.recompute = true;
    let rc = run(&c)?;
    assert_eq!(plain[0].metrics.len(), rc[0].metrics.len());
    for (x, y) in plain[0].metrics.iter().zip(rc[0].metrics.iter()) {
        assert_eq!((x.loss, x.grad_norm), (y.loss, y.grad_norm), "step {}", x.step);
    }
    Ok(())
}

/// The test model has 2 query heads and 1 KV head. TP 2 (with SP, alone and with zigzag
/// CP 2) holds that KV head on both TP ranks and sums its gradient over them. These runs
/// follow the one-device run for 6 clipped steps: same losses, same gradient norms (the
/// norm counts the KV head once). Their final checkpoints hold the same weights.
#[test]
fn tp_beyond_the_kv_heads_trains_like_one_device() -> Result<()> {
    let d1 = tmpdir("kv1");
    let one = run(&tiny_cfg(Some(d1.clone()), Layout::single(), 1, 1))?;
    let (want, _) = load_hf(d1.join("checkpoints/step-000006"), &Device::Cpu, DType::F32)?;
    let want = crate::params::varmap_tensors(&want)?;
    for (i, layout) in [Layout::single().with_tp(2, true), Layout::cp(CpKind::Zigzag, 2).with_tp(2, true)].into_iter().enumerate() {
        let d = tmpdir(&format!("kv-tp{i}"));
        let other = run(&tiny_cfg(Some(d.clone()), layout, 1, 1))?;
        assert_eq!(other[0].metrics.len(), 6);
        assert_same_curve(&layout.to_string(), &one[0].metrics.iter().collect::<Vec<_>>(), &other[0].metrics);
        let (got, _) = load_hf(d.join("checkpoints/step-000006"), &Device::Cpu, DType::F32)?;
        let got = crate::params::varmap_tensors(&got)?;
        assert_eq!(got.len(), want.len());
        for (name, w) in &want {
            assert_eq!(got[name].dims(), w.dims(), "{layout}: {name}");
            let e = (&got[name] - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(e < 1e-4, "{layout}: {name} differs by {e}");
        }
        std::fs::remove_dir_all(&d).ok();
    }
    std::fs::remove_dir_all(&d1).ok();
    Ok(())
}

/// A checkpoint written by one layout resumes on another: the step-3 checkpoint of zigzag CP 2 × TP 2 + SP
/// (the KV head replicated on both TP ranks, the vocabulary split) continues for the last 3 steps on
/// one device, on ring CP 2 × DP 2 with ZeRO-1, and on TP 2 without SP. The TP 1 runs reshard the
/// optimizer state from the two per-TP-rank files; the TP 2 run reads its own rank's file as it
/// is (the same TP degree: no reshard, whatever else changed). Every continuation follows the
/// uninterrupted run (losses to 1e-5, gradient norms to 1e-4): the moments carried over.
#[test]
fn resume_on_another_layout_follows_the_run() -> Result<()> {
    let first = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true);
    let whole = run(&tiny_cfg(None, first, 2, 1))?;
    for (i, next, zero1) in [
        (0, Layout::single(), false),
        (1, Layout::cp(CpKind::Ring, 2).with_dp(2), true),
        (2, Layout::single().with_tp(2, false), false),
    ] {
        let d = tmpdir(&format!("relayout{i}"));
        let mut c = tiny_cfg(Some(d.clone()), first, 2, 1);
        c.stop_after = Some(4); // checkpoint at step 3, "killed" after step 4
        run(&c)?;
        (c.layout, c.resume, c.stop_after, c.zero1) = (next, true, None, zero1);
        let rest = run(&c)?;
        assert_eq!(rest[0].start_step, 3, "{next}");
        let want = if next.tp == 2 { None } else { Some(2) };
        assert!(rest.iter().all(|r| r.optimizer_resharded_from == want), "{next}");
        let tail: Vec<_> = whole[0].metrics.iter().filter(|m| m.step > 3).collect();
        assert_eq!(rest[0].metrics.len(), tail.len(), "{next}");
        assert_same_curve(&next.to_string(), &tail, &rest[0].metrics);
        std::fs::remove_dir_all(&d).ok();
    }
    Ok(())
}

/// ZeRO-1 over DP 2 x CP 2 (bf16 weights: sliced master copies) follows the unsharded run
/// exactly; its checkpoint resumes a run without ZeRO-1 on the same curve.
#[test]
fn zero1_trains_like_the_plain_run_and_resumes_without_it() -> Result<()> {
    let layout = Layout::cp(CpKind::Zigzag, 2).with_dp(2);
    let (da, db) = (tmpdir("z1a"), tmpdir("z1b"));
    let mut c = tiny_cfg(Some(da.clone()), layout, 2, 1);
    c.dtype = DType::BF16;
    let plain = run(&c)?;
    let mut z = c.clone();
    z.zero1 = true;
    z.out = Some(db.clone());
    z.stop_after = Some(4);
    let part = run(&z)?;
    for (x, y) in plain[0].metrics.iter().zip(part[0].metrics.iter()) {
        // the same updates (losses equal to the bit); the norm adds the slices' f64 squared
        // norms in another order, so it may differ in its last bit
        assert_eq!(x.loss, y.loss, "step {}", x.step);
        assert!((x.grad_norm - y.grad_norm).abs() <= 1e-14 * x.grad_norm, "step {}: {} vs {}", x.step, x.grad_norm, y.grad_norm);
    }
    // resume the ZeRO-1 run's step-3 checkpoint without ZeRO-1
    let mut r = c.clone();
    r.out = Some(db.clone());
    r.resume = true;
    let rest = run(&r)?;
    let tail: Vec<_> = plain[0].metrics.iter().filter(|m| m.step > 3).collect();
    assert_eq!(rest[0].metrics.len(), tail.len());
    for (x, y) in tail.iter().zip(rest[0].metrics.iter()) {
        assert_eq!((x.step, x.loss, x.grad_norm), (y.step, y.loss, y.grad_norm));
    }
    let _ = (std::fs::remove_dir_all(&da), std::fs::remove_dir_all(&db));
    Ok(())
}

/// ZeRO-1 on TP 2 + SP x CP 2 x DP 2: the sharded weights' gradients are reduce-scattered
/// over the 4 replicas, while the norms (summed over all 8 ranks under SP) and the KV head
/// (held by both TP ranks) are all-reduced; the run follows the plain one: the same losses,
/// bit for bit.
#[test]
fn zero1_with_tp_and_sp_trains_like_the_plain_run() -> Result<()> {
    let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_dp(2);
    let c = tiny_cfg(None, layout, 2, 1);
    let plain = run(&c)?;
    let mut z = c.clone();
    z.zero1 = true;
    let zero = run(&z)?;
    assert_eq!(plain[0].metrics.len(), zero[0].metrics.len());
    for (x, y) in plain[0].metrics.iter().zip(zero[0].metrics.iter()) {
        // (the squared norm adds the slices' f64 sums in another order: last-bit differences,
        // which do not reach the f32 clipping factor)
        assert_eq!(x.loss, y.loss, "step {}", x.step);
        assert!((x.grad_norm - y.grad_norm).abs() <= 1e-12 * x.grad_norm, "step {}: {} vs {}", x.step, x.grad_norm, y.grad_norm);
    }
    Ok(())
}

/// Gradient sums started layer by layer during the backward (`overlap_grad_sync`) train like
/// the synchronous path, bit for bit: DP 2 × CP 2 with accumulation over 2 micro-batches, and
/// ZeRO-1 on TP 2 + SP × CP 2 × DP 2 (norms under SP stay synchronous). Without recompute
/// the option is refused before anything runs.
#[test]
fn overlapped_gradient_sync_trains_like_the_synchronous_path() -> Result<()> {
    let two_layers = |c: &mut TrainConfig| {
        if let ModelSource::Init(m) = &c.model {
            c.model = ModelSource::Init(LlamaConfig::tiny(m.vocab_size, 32, 2, 2, 2));
        }
        c.recompute = true;
        c.steps = 4;
    };
    let mut a = tiny_cfg(None, Layout::cp(CpKind::Zigzag, 2).with_dp(2), 2, 2);
    two_layers(&mut a);
    let mut b = tiny_cfg(None, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_dp(2), 2, 1);
    two_layers(&mut b);
    b.zero1 = true;
    for c in [a, b] {
        let sync = run(&c)?;
        let mut o = c.clone();
        o.overlap_grad_sync = true;
        let over = run(&o)?;
        assert_eq!(sync[0].metrics.len(), over[0].metrics.len());
        for (x, y) in sync[0].metrics.iter().zip(over[0].metrics.iter()) {
            assert_eq!((x.loss, x.grad_norm), (y.loss, y.grad_norm), "{} step {}", c.layout, x.step);
        }
    }
    let mut c = tiny_cfg(None, Layout::cp(CpKind::Zigzag, 2), 1, 1);
    c.overlap_grad_sync = true;
    let e = run(&c).expect_err("overlap without recompute must be refused").to_string();
    assert!(e.contains("needs recompute"), "{e}");
    Ok(())
}

/// ZeRO-2 (the replicas' gradients reduce-scattered after every micro-batch, summed as f32
/// slices) on DP 2 × CP 2, f32: with one micro-batch it is ZeRO-1 bit for bit; with 2 it
/// follows ZeRO-1 to rounding (sums in another order), with or without the overlapped sync
/// (which gives the same bits as without).
#[test]
fn zero2_trains_like_zero1() -> Result<()> {
    let layout = Layout::cp(CpKind::Zigzag, 2).with_dp(2);
    for accum in [1, 2] {
        let mut z1 = tiny_cfg(None, layout, 2, accum);
        if let ModelSource::Init(m) = &z1.model {
            z1.model = ModelSource::Init(LlamaConfig::tiny(m.vocab_size, 32, 2, 2, 2));
        }
        z1.steps = 4;
        z1.zero1 = true;
        let mut z2 = z1.clone();
        z2.zero2 = true;
        let a = run(&z1)?;
        let b = run(&z2)?;
        assert_eq!(a[0].metrics.len(), b[0].metrics.len());
        if accum == 1 {
            for (x, y) in a[0].metrics.iter().zip(&b[0].metrics) {
                assert_eq!((x.loss, x.grad_norm), (y.loss, y.grad_norm), "step {}", x.step);
            }
        } else {
            assert_same_curve("ZeRO-2, 2 micro-batches", &a[0].metrics.iter().collect::<Vec<_>>(), &b[0].metrics);
            z2.recompute = true;
            let plain = run(&z2)?;
            z2.overlap_grad_sync = true;
            let over = run(&z2)?;
            for (x, y) in plain[0].metrics.iter().zip(&over[0].metrics) {
                assert_eq!((x.loss, x.grad_norm), (y.loss, y.grad_norm), "overlapped ZeRO-2 step {}", x.step);
            }
        }
    }
    Ok(())
}

/// ZeRO's parameter all-gathers waited for layer by layer in the next forward
/// (`overlap_param_gather`) train like the gathers inside the step, bit for bit: ZeRO-1 on
/// DP 2 × CP 2 with 2 micro-batches (checkpoints at steps 3 and 6: the same weights), and
/// ZeRO-2 with the overlapped gradient sync on TP 2 + SP × CP 2 × DP 2. Without ZeRO the
/// option is refused.
#[test]
fn overlapped_param_gather_trains_like_the_gather_in_the_step() -> Result<()> {
    let two_layers = |c: &mut TrainConfig| {
        if let ModelSource::Init(m) = &c.model {
            c.model = ModelSource::Init(LlamaConfig::tiny(m.vocab_size, 32, 2, 2, 2));
        }
    };
    let (da, db) = (tmpdir("pg-a"), tmpdir("pg-b"));
    let mut a = tiny_cfg(Some(da.clone()), Layout::cp(CpKind::Zigzag, 2).with_dp(2), 2, 2);
    two_layers(&mut a);
    a.zero1 = true;
    let mut b = tiny_cfg(None, Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_dp(2), 2, 1);
    two_layers(&mut b);
    b.steps = 4;
    (b.zero2, b.recompute, b.overlap_grad_sync) = (true, true, true);
    for c in [a, b] {
        let plain = run(&c)?;
        let mut o = c.clone();
        o.overlap_param_gather = true;
        if o.out.is_some() {
            o.out = Some(db.clone());
        }
        let over = run(&o)?;
        assert_eq!(plain[0].metrics.len(), c.steps);
        assert_eq!(plain[0].metrics.len(), over[0].metrics.len());
        for (x, y) in plain[0].metrics.iter().zip(&over[0].metrics) {
            assert_eq!((x.loss, x.grad_norm), (y.loss, y.grad_norm), "{} step {}", c.layout, x.step);
        }
    }
    for step in ["step-000003", "step-000006"] {
        let (want, _) = load_hf(da.join("checkpoints").join(step), &Device::Cpu, DType::F32)?;
        let (got, _) = load_hf(db.join("checkpoints").join(step), &Device::Cpu, DType::F32)?;
        let (want, got) = (crate::params::varmap_tensors(&want)?, crate::params::varmap_tensors(&got)?);
        assert_eq!(want.len(), got.len());
        for (name, w) in &want {
            let e = (&got[name] - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(e, 0.0, "{step}: {name}");
        }
    }
    let mut c = tiny_cfg(None, Layout::cp(CpKind::Zigzag, 2), 1, 1);
    c.overlap_param_gather = true;
    let e = run(&c).expect_err("overlap_param_gather without ZeRO must be refused").to_string();
    assert!(e.contains("needs zero1 or zero2"), "{e}");
    std::fs::remove_dir_all(&da).ok();
    std::fs::remove_dir_all(&db).ok();
    Ok(())
}

/// A packed corpus of short byte documents of uneven lengths.
pub(super) fn packed_corpus() -> Result<crate::train::PackedStream> {
    let mut rng = crate::train::Rng::new(17);
    let mut text = Vec::new();
    for _ in 0..40 {
        let len = 3 + rng.below(25);
        text.extend((0..len).map(|_| b'a' + rng.below(16) as u8));
        text.extend_from_slice(b"\n\n");
    }
    crate::train::PackedStream::from_bytes(&text, b"\n\n")
}

/// Packed fine-tune (2 rows with different documents per step) on zigzag CP 2 and on
/// ring CP 2 x DP 2 follows the single-device packed run; step 1's loss is the packed loss
/// of step 0's batch under the initial weights (labels stop at document ends, attention
/// stays inside documents), which differs from the same rows read as plain sequences.
#[test]
fn packed_finetune_on_cp_matches_single_device() -> Result<()> {
    let stream = packed_corpus()?;
    let mut c1 = tiny_cfg(None, Layout::single(), 2, 1);
    c1.data = DataSource::Packed(stream);
    c1.model = ModelSource::Init(LlamaConfig::tiny(128, 32, 1, 2, 1));
    c1.steps = 3;
    let (ids, _, docs) = global_batch(&c1, 0, 0, &Device::Cpu)?;
    let docs = docs.expect("packed rows carry documents");
    assert!(docs.iter().all(|d| d.count() >= 2) && docs[0] != docs[1], "{docs:?}");
    let one = run(&c1)?;
    // step 1's loss by hand: packed and plain losses of the batch under the initial weights
    let ModelSource::Init(mcfg) = &c1.model else { bail!("init model") };
    let direct = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_params(&init_params(mcfg, c1.seed, DType::F32, &Device::Cpu)?, mcfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), mcfg, &ctx)?;
        let p = shard_batch_packed(&ids, &docs, &ctx)?;
        let (lp, _) = m.loss_packed(&p.input_ids, &p.labels, &p.positions, &p.documents)?;
        let b = shard_batch(&ids, &ctx)?;
        let (lb, _) = m.loss(&b.input_ids, &b.labels, &b.positions)?;
        Ok((lp.to_scalar::<f32>()? as f64, lb.to_scalar::<f32>()? as f64))
    });
    let (packed, plain) = direct.into_iter().next().expect("one rank")?;
    let first = one[0].metrics[0].loss;
    // (at init every loss is near ln V, so the plain loss differs by only ~1e-3)
    assert!((first - packed).abs() < 2e-6, "trainer step 1 loss {first} vs packed loss {packed}");
    assert!((first - plain).abs() > 2e-4, "packed {first} vs plain {plain}: packing had no effect");
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ring, 2).with_dp(2)] {
        let mut c = c1.clone();
        c.layout = layout;
        let other = run(&c)?;
        assert_eq!(other[0].metrics.len(), 3);
        assert_same_curve(&layout.to_string(), &one[0].metrics.iter().collect::<Vec<_>>(), &other[0].metrics);
        // the loss moves: training happened
        assert!((other[0].metrics[2].loss - other[0].metrics[0].loss).abs() > 1e-4);
    }
    Ok(())
}

/// A sliding window (8 keys at T = 64, from `TrainConfig::sliding_window`) trains the same
/// on zigzag CP 2 and Ulysses 2 as on one device (2 steps, losses to 1e-5); the outcome and
/// the checkpoint's config.json carry the window, and the window changes the losses (the
/// same run without it differs).
#[test]
fn sliding_window_finetune_on_cp_matches_single_device() -> Result<()> {
    let dir = tmpdir("swa");
    let mut c1 = tiny_cfg(Some(dir.clone()), Layout::single(), 2, 1);
    c1.steps = 2;
    c1.long_range_only = false;
    c1.sliding_window = Some(8);
    let one = run(&c1)?;
    assert_eq!(one[0].config.sliding_window, Some(8));
    let (_, saved) = load_hf(dir.join("checkpoints/step-000002"), &Device::Cpu, DType::F32)?;
    assert_eq!(saved.sliding_window, Some(8), "checkpoint config.json keeps the window");
    std::fs::remove_dir_all(&dir).ok();
    let mut plain = c1.clone();
    (plain.out, plain.sliding_window) = (None, None);
    let p = run(&plain)?;
    assert_eq!(p[0].config.sliding_window, None);
    let d = (p[0].metrics[1].loss - one[0].metrics[1].loss).abs();
    println!("window 8: losses {:?}, no window: {:?}", one[0].metrics.iter().map(|m| m.loss).collect::<Vec<_>>(), p[0].metrics.iter().map(|m| m.loss).collect::<Vec<_>>());
    assert!(d > 1e-4, "step 2 loss with and without the window differ by only {d:.2e}");
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Ulysses, 2)] {
        let mut c = c1.clone();
        (c.layout, c.out) = (layout, None);
        let other = run(&c)?;
        for r in &other {
            assert_eq!(r.metrics.len(), 2);
            assert_same_curve(&layout.to_string(), &one[0].metrics.iter().collect::<Vec<_>>(), &r.metrics);
        }
    }
    Ok(())
}

/// Hyperparameters that would train on NaN or nonsense are refused before anything runs, naming
/// the value: a negative or NaN learning rate, a final ratio above 1, a decay of 1 (bias
/// correction divided by zero), eps 0, a negative weight decay, a NaN clip.
#[test]
fn bad_hyperparameters_are_refused() {
    let base = tiny_cfg(None, Layout::single(), 1, 1);
    type Set = fn(&mut TrainConfig);
    let bad: [(&str, Set); 8] = [
        ("peak learning rate", |c| c.schedule.peak = -1e-3),
        ("peak learning rate", |c| c.schedule.peak = f64::NAN),
        ("min_ratio", |c| c.schedule.min_ratio = 1.5),
        ("beta1", |c| c.adamw.beta1 = 1.0),
        ("beta2", |c| c.adamw.beta2 = -0.1),
        ("eps", |c| c.adamw.eps = 0.0),
        ("weight_decay", |c| c.adamw.weight_decay = -0.01),
        ("clip", |c| c.clip = f64::NAN),
    ];
    for (key, set) in bad {
        let mut c = base.clone();
        set(&mut c);
        let e = run(&c).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(key), "{key}: {e:?}");
    }
}
