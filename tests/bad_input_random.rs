//! Seeded random malformed inputs to the public ops: nothing panics, nothing hangs.
//!
//! `empty_inputs.rs` tries each op with each dimension empty; this draws the other ways
//! callers get inputs wrong, alone and combined: a tensor of rank 3 or 5 instead of 4, batch /
//! length / head dim that differ between q, k and v, query heads that the KV heads do not
//! divide, a k or v of another dtype, strided (transposed) views, masks with offsets, strides
//! of 0 or a window of 0 keys, a log-sum-exp of the wrong shape, packed documents that do not
//! cover the sequence, and, on thread ranks, one rank passing another shape than the others.
//! Each call must return (`Ok` where the draw happens to be valid) without a panic; an `Err`
//! must name a value (a shape or a number) and not be a caught panic; the ranks of a
//! collective op all return within the group's timeout. `CANDLE_CP_RANDOM_SEEDS=A..B` draws
//! configurations `A..B`.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks_with, Group, ThreadGroupOptions};
use candle_cp_llama::train::Rng;
use candle_cp_ops::attention::{attention, attention_bwd, attention_docs, attention_fwd, merge, Mask};
use candle_cp_ops::cp::{allgather_attention, ring_attention, CpOpts, Layout};
use candle_cp_ops::mappings::{gather_from_sp_region, reduce_scatter_to_sp_region, scatter_to_sp_region};
use candle_cp_ops::packing::Documents;
use candle_cp_ops::ulysses::{all_to_all_head_to_seq, all_to_all_seq_to_head, ulysses_attention, UlyssesOpts};
use candle_cp_tests::draws::{pick, rng, seeds};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

const CONFIGS: u64 = 300;
const P: usize = 2;

/// Seeded values of `dims` in `dtype`.
fn tensor(dims: &[usize], dtype: DType, seed: u64) -> Result<Tensor> {
    let mut g = Rng::new(seed);
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| g.below(2001) as f32 / 1000.0 - 1.0).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(dtype)
}

/// A drawn set of inputs: q, k, v (and the backward's out / lse / dout), a mask, documents.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    mask: Mask,
    docs: Documents,
    what: String,
}

/// `dims[i] += by` where `dims` has an `i` (an earlier draw may have dropped it).
fn bump(dims: &mut [usize], i: usize, by: usize) {
    if let Some(x) = dims.get_mut(i) {
        *x += by;
    }
}

/// Valid dims `[B, T, H, D]` / `[B, T, Hkv, D]`, then up to three of the ways to get them wrong.
fn draw(d: &mut Rng, seed: u64, rank: usize) -> Result<Inputs> {
    let (b, t, hkv, dh) = (1 + d.below(2), pick(d, &[4, 6, 8, 12]), pick(d, &[1, 2]), pick(d, &[2, 4]));
    let h = hkv * pick(d, &[1, 2]);
    let mut qd = vec![b, t, h, dh];
    let mut kd = vec![b, t, hkv, dh];
    let mut vd = kd.clone();
    let mut kt = DType::F32;
    let mut lsed = vec![b, h, t];
    let mut transposed = false;
    let w = 1 + d.below(t);
    let mut mask = pick(d, &[Mask::Full, Mask::causal(), Mask::sliding_window(w)]);
    let mut doc_lens = vec![t];
    let mut wrong = vec![];
    for _ in 0..d.below(4) {
        let w = d.below(12);
        match w {
            0 => qd.push(1),
            1 => {
                kd.pop();
            }
            2 => bump(&mut kd, 0, 1),
            3 => bump(&mut vd, 1, 1),
            4 => bump(&mut kd, 2, 1),
            5 => bump(&mut vd, 3, 1),
            6 => kt = pick(d, &[DType::F16, DType::BF16, DType::F64]),
            7 => transposed = true,
            8 => lsed[2] += 1,
            9 => {
                mask = match d.below(3) {
                    0 => Mask::Causal { q_offset: d.below(9), q_stride: d.below(3), k_offset: d.below(9), k_stride: d.below(3) },
                    1 => Mask::sliding_window(0),
                    _ => Mask::Window { q_offset: d.below(9), q_stride: 1 + d.below(2), k_offset: d.below(9), k_stride: 0, window: d.below(4) },
                }
            }
            10 => doc_lens = vec![t / 2, t / 2 + 1 + d.below(3)],
            _ => {
                // this rank passes another length than the others
                if rank == 1 {
                    for x in [&mut qd, &mut kd, &mut vd] {
                        bump(x, 1, 2);
                    }
                }
            }
        }
        wrong.push(w);
    }
    let mut q = tensor(&qd, DType::F32, seed * 10 + 1)?;
    let k = tensor(&kd, kt, seed * 10 + 2)?;
    let v = tensor(&vd, DType::F32, seed * 10 + 3)?;
    if transposed && q.rank() >= 3 {
        q = q.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    }
    let lse = tensor(&lsed, DType::F32, seed * 10 + 4)?;
    let docs = Documents::from_lengths(&doc_lens)?;
    let what = format!("q {qd:?} k {kd:?} {kt:?} v {vd:?} lse {lsed:?} transposed {transposed} mask {mask:?} documents {doc_lens:?} (wrongs {wrong:?})");
    Ok(Inputs { q, k, v, lse, mask, docs, what })
}

/// The call's result as `Ok(())` / `Err(message)`, or `None` when it panicked.
fn guarded(f: impl FnOnce() -> Result<()>) -> Option<std::result::Result<(), String>> {
    catch_unwind(AssertUnwindSafe(f)).ok().map(|r| r.map_err(|e| e.to_string()))
}

/// An error must name a value and must not be a caught panic.
fn assert_named(what: &str, e: &str) {
    assert!(!e.contains("panicked"), "{what}: a panic became the error: {e}");
    assert!(e.chars().any(|c| c.is_ascii_digit()), "{what}: the error names no value: {e}");
}

type Single = fn(&Inputs) -> Result<()>;
type Ranked = fn(&Inputs, &Group) -> Result<()>;

fn single_ops() -> Vec<(&'static str, Single)> {
    vec![
        ("attention", |x| attention(&x.q, &x.k, &x.v, &x.mask, 0.5).map(|_| ())),
        ("attention_fwd", |x| attention_fwd(&x.q, &x.k, &x.v, &x.mask, 0.5).map(|_| ())),
        ("attention_bwd", |x| attention_bwd(&x.q, &x.k, &x.v, &x.q, &x.lse, &x.q, &x.mask, 0.5).map(|_| ())),
        ("merge", |x| merge(&x.q, &x.lse, &x.q, &x.lse).map(|_| ())),
        ("attention_docs", |x| attention_docs(&x.q, &x.k, &x.v, &x.docs, true, 0.5).map(|_| ())),
    ]
}

fn ranked_ops() -> Vec<(&'static str, Ranked)> {
    vec![
        ("ring_attention zigzag", |x, g| ring_attention(&x.q, &x.k, &x.v, g, &CpOpts::new(Layout::Zigzag, true)).map(|_| ())),
        ("ring_attention documents", |x, g| {
            ring_attention(&x.q, &x.k, &x.v, g, &CpOpts::new(Layout::Contiguous, true).with_documents(x.docs.clone())).map(|_| ())
        }),
        ("allgather_attention striped", |x, g| allgather_attention(&x.q, &x.k, &x.v, g, &CpOpts::new(Layout::Striped, false)).map(|_| ())),
        ("ulysses_attention", |x, g| ulysses_attention(&x.q, &x.k, &x.v, g, &UlyssesOpts::new(true, 0.5)).map(|_| ())),
        ("all_to_all_seq_to_head", |x, g| all_to_all_seq_to_head(&x.q, g).map(|_| ())),
        ("all_to_all_head_to_seq", |x, g| all_to_all_head_to_seq(&x.k, g).map(|_| ())),
        ("gather_from_sp_region", |x, g| gather_from_sp_region(&x.q, g, 1).map(|_| ())),
        ("reduce_scatter_to_sp_region", |x, g| reduce_scatter_to_sp_region(&x.q, g, 1).map(|_| ())),
        ("scatter_to_sp_region", |x, g| scatter_to_sp_region(&x.k, g, 1).map(|_| ())),
    ]
}

#[test]
fn random_malformed_inputs_are_errors_not_panics() -> Result<()> {
    let (mut calls, mut errors, mut mixed) = (0, 0, 0);
    let opts = ThreadGroupOptions { timeout: Duration::from_secs(5), ..Default::default() };
    for seed in seeds(CONFIGS)? {
        for (name, op) in single_ops() {
            let x = draw(&mut rng(17000 + seed), seed, 0)?;
            let what = format!("config {seed}: {name}: {}", x.what);
            match guarded(|| op(&x)) {
                None => panic!("{what}: panicked"),
                Some(Err(e)) => {
                    assert_named(&what, &e);
                    errors += 1;
                }
                Some(Ok(())) => {}
            }
            calls += 1;
        }
        for (name, op) in ranked_ops() {
            let t0 = Instant::now();
            let results = run_ranks_with(P, opts.clone(), |g| {
                let x = draw(&mut rng(17000 + seed), seed, g.rank())?;
                op(&x, &g)
            });
            let x = draw(&mut rng(17000 + seed), seed, 1)?;
            let what = format!("config {seed}: {name} on {P} ranks: rank 1 {}", x.what);
            assert!(t0.elapsed() < Duration::from_secs(30), "{what}: took {:?}", t0.elapsed());
            let mut oks = 0;
            for (r, res) in results.iter().enumerate() {
                match res {
                    Ok(()) => oks += 1,
                    Err(e) => {
                        assert_named(&format!("{what}, rank {r}"), &e.to_string());
                        errors += 1;
                    }
                }
            }
            mixed += (oks > 0 && oks < P) as usize;
            calls += P;
        }
    }
    println!("{calls} calls: {errors} errors, no panic; {mixed} collective calls where some ranks succeeded and others failed");
    Ok(())
}
