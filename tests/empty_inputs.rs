//! Tensors with an empty dimension (a size-0 `B`, `T`, `H` or `D`) are bad input: every public
//! op and every collective returns an `Err` that says so and names the shape, on every rank,
//! and nothing panics.
//!
//! Why a test: candle 0.11's CPU backend panics on some views of empty tensors (a `cat`, a
//! `sum` or an `index_select` of a view at a non-zero offset slices the storage past its end).
//! Before the checks, a fuzz over these entry points found 78 panics in 2000 calls (ring,
//! all-gather and Ulysses attention, the SP mappings, `unshard`, `rms_norm`, ...). Each input
//! is tried as a fresh tensor and as such a view; each op is also run on the non-empty shapes,
//! which must succeed (the checks refuse only what is empty).

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks_with, Group, ThreadGroupOptions};
use candle_cp_nn::rms_norm;
use candle_cp_ops::attention::{attention, attention_fwd, merge, Mask};
use candle_cp_ops::cp::{allgather_attention, ring_attention, shard, sharded_decode_attention, unshard, CpOpts, KvShard, Layout};
use candle_cp_ops::mappings::{
    copy_to_tp_region, gather_from_sp_region, reduce_from_tp_region, reduce_scatter_to_sp_region, scatter_to_sp_region,
};
use candle_cp_ops::ulysses::{all_to_all_head_to_seq, all_to_all_seq_to_head, ulysses_attention, UlyssesOpts};
use std::time::Duration;

const Q: [usize; 4] = [2, 8, 4, 4];
const KV: [usize; 4] = [2, 8, 2, 4];
const P: usize = 2;

/// A seeded f32 tensor of `dims`; with `zero = Some(i)` dimension `i` is 0, either fresh or
/// (`view`) as `narrow(i, 1, 0)` of a larger tensor (a view at a non-zero offset).
fn input(dims: [usize; 4], zero: Option<usize>, view: bool, seed: f32) -> Result<Tensor> {
    let mut d = dims;
    if let Some(i) = zero {
        d[i] = if view { 2 } else { 0 };
    }
    let n: usize = d.iter().product();
    let x = Tensor::arange(0f32, n as f32, &Device::Cpu)?
        .affine(0.01, seed as f64)?
        .sin()?
        .reshape(d.as_slice())?;
    match zero {
        Some(i) if view => x.narrow(i, 1, 0),
        _ => Ok(x),
    }
}

type Single = fn(&Tensor, &Tensor, &Tensor) -> Result<()>;
type Ranked = fn(&Tensor, &Tensor, &Tensor, &Group) -> Result<()>;

fn single_ops() -> Vec<(&'static str, Single)> {
    vec![
        ("attention", |q, k, v| {
            let m = Mask::Causal { q_offset: 0, q_stride: 1, k_offset: 0, k_stride: 1 };
            attention(q, k, v, &m, 0.5).map(|_| ())
        }),
        ("attention_fwd", |q, k, v| attention_fwd(q, k, v, &Mask::Full, 0.5).map(|_| ())),
        ("merge", |q, _, _| {
            let (b, t, h, _) = q.dims4()?;
            let lse = Tensor::zeros((b, h, t), DType::F32, q.device())?;
            merge(q, &lse, q, &lse).map(|_| ())
        }),
        ("rms_norm", |q, _, _| {
            let w = Tensor::ones(q.dim(3)?, DType::F32, q.device())?;
            rms_norm(q, &w, 1e-5).map(|_| ())
        }),
        ("shard", |q, _, _| shard(q, Layout::Zigzag, 1, P, 1).map(|_| ())),
        ("unshard", |q, _, _| unshard(&[q.clone(), q.clone()], Layout::Zigzag, 1).map(|_| ())),
    ]
}

fn ranked_ops() -> Vec<(&'static str, Ranked)> {
    vec![
        ("ring_attention", |q, k, v, g| ring_attention(q, k, v, g, &CpOpts::new(Layout::Zigzag, true)).map(|_| ())),
        ("allgather_attention", |q, k, v, g| {
            allgather_attention(q, k, v, g, &CpOpts::new(Layout::Zigzag, true)).map(|_| ())
        }),
        ("ulysses_attention", |q, k, v, g| ulysses_attention(q, k, v, g, &UlyssesOpts::new(true, 0.5)).map(|_| ())),
        ("all_to_all_seq_to_head", |q, _, _, g| all_to_all_seq_to_head(q, g).map(|_| ())),
        ("all_to_all_head_to_seq", |q, _, _, g| all_to_all_head_to_seq(q, g).map(|_| ())),
        ("gather_from_sp_region", |q, _, _, g| gather_from_sp_region(q, g, 1).map(|_| ())),
        ("reduce_scatter_to_sp_region", |q, _, _, g| reduce_scatter_to_sp_region(q, g, 1).map(|_| ())),
        ("scatter_to_sp_region", |q, _, _, g| scatter_to_sp_region(q, g, 1).map(|_| ())),
        ("copy_to_tp_region", |q, _, _, g| copy_to_tp_region(q, g).map(|_| ())),
        ("reduce_from_tp_region", |q, _, _, g| reduce_from_tp_region(q, g).map(|_| ())),
        ("ProcessGroup::all_gather", |q, _, _, g| g.all_gather(q, 1).map(|_| ())),
        ("ProcessGroup::reduce_scatter", |q, _, _, g| g.reduce_scatter(q, 1).map(|_| ())),
        ("ProcessGroup::all_reduce", |q, _, _, g| g.all_reduce(q).map(|_| ())),
        ("ProcessGroup::all_to_all", |q, _, _, g| g.all_to_all(q, 2, 1).map(|_| ())),
        ("ProcessGroup::broadcast", |q, _, _, g| g.broadcast(q, 0).map(|_| ())),
        ("ProcessGroup::send_recv", |q, _, _, g| {
            let (r, p) = (g.rank(), g.size());
            g.send_recv(q, (r + 1) % p, (r + p - 1) % p)?.wait().map(|_| ())
        }),
        ("sharded_decode_attention", |q, k, v, g| {
            let mut cache = KvShard::new();
            let rows = k.dim(1)?;
            let pos: Vec<usize> = (0..rows).map(|j| j * g.size() + g.rank()).collect();
            cache.append(k, v, &pos)?;
            let qpos: Vec<usize> = (0..q.dim(1)?).map(|j| 100 + j).collect();
            sharded_decode_attention(q, &qpos, &cache, g, 0.5, None).map(|_| ())
        }),
    ]
}

/// Every rank's result of `op` on `P` thread ranks (a 10 s timeout bounds a hang).
fn on_ranks(op: Ranked, q: &Tensor, k: &Tensor, v: &Tensor) -> Vec<Result<()>> {
    let opts = ThreadGroupOptions { timeout: Duration::from_secs(10), ..Default::default() };
    run_ranks_with(P, opts, |g| op(q, k, v, &g))
}

fn assert_empty_error(what: &str, r: &Result<()>) {
    match r {
        Ok(()) => panic!("{what}: accepted an empty input"),
        Err(e) => {
            let m = e.to_string();
            assert!(m.contains("empty") && !m.contains("panicked"), "{what}: unexpected error: {m}");
        }
    }
}

#[test]
fn single_device_ops_refuse_empty_inputs() -> Result<()> {
    for (name, op) in single_ops() {
        let (q, k, v) = (input(Q, None, false, 0.)?, input(KV, None, false, 1.)?, input(KV, None, false, 2.)?);
        op(&q, &k, &v).unwrap_or_else(|e| panic!("{name} on q {Q:?}, k/v {KV:?}: {e}"));
        for zero in 0..4 {
            for view in [false, true] {
                let (q, k, v) = (input(Q, Some(zero), view, 0.)?, input(KV, Some(zero), view, 1.)?, input(KV, Some(zero), view, 2.)?);
                let what = format!("{name}, dim {zero} empty (view {view}), q {:?}", q.dims());
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(&q, &k, &v)));
                let r = r.unwrap_or_else(|_| panic!("{what}: panicked"));
                assert_empty_error(&what, &r);
            }
        }
    }
    Ok(())
}

#[test]
fn ranked_ops_and_collectives_refuse_empty_inputs_on_every_rank() -> Result<()> {
    for (name, op) in ranked_ops() {
        let (q, k, v) = (input(Q, None, false, 0.)?, input(KV, None, false, 1.)?, input(KV, None, false, 2.)?);
        for (r, res) in on_ranks(op, &q, &k, &v).into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("{name} on q {Q:?}, k/v {KV:?}, rank {r}: {e}"));
        }
        for zero in 0..4 {
            for view in [false, true] {
                let (q, k, v) = (input(Q, Some(zero), view, 0.)?, input(KV, Some(zero), view, 1.)?, input(KV, Some(zero), view, 2.)?);
                let results = on_ranks(op, &q, &k, &v);
                assert_eq!(results.len(), P);
                for (r, res) in results.iter().enumerate() {
                    assert_empty_error(&format!("{name}, dim {zero} empty (view {view}), q {:?}, rank {r}", q.dims()), res);
                }
            }
        }
    }
    Ok(())
}

/// A rank that holds no row of a prefill appends nothing: `Ok`, and the cache is unchanged.
#[test]
fn kv_shard_append_of_zero_rows_is_a_no_op() -> Result<()> {
    let mut cache = KvShard::new();
    let (k, v) = (input(KV, None, false, 1.)?, input(KV, None, false, 2.)?);
    cache.append(&k.narrow(1, 0, 3)?, &v.narrow(1, 0, 3)?, &[0, 2, 4])?;
    for view in [false, true] {
        let (k0, v0) = (input(KV, Some(1), view, 1.)?, input(KV, Some(1), view, 2.)?);
        cache.append(&k0, &v0, &[])?;
        assert_eq!(cache.positions(), &[0, 2, 4]);
    }
    cache.append(&k.narrow(1, 3, 1)?, &v.narrow(1, 3, 1)?, &[6])?;
    assert_eq!(cache.positions(), &[0, 2, 4, 6]);
    let (kc, _) = cache.kv().expect("rows cached");
    let want = k.narrow(1, 0, 4)?;
    assert_eq!(kc.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
    Ok(())
}
