//! Seeded random sequences of collectives on thread ranks, against serial references.
//!
//! `comm.rs` checks each collective alone on fresh tensors; this draws sequences of them as
//! the ops above issue them: all-gather, reduce-scatter, all-reduce, all-to-all, broadcast,
//! ring send/recv by any shift, the started (non-blocking) all-reduce / reduce-scatter /
//! all-gather waited for only after the next collective, and any of those on a sub-group from
//! `split` (colors and keys drawn) — on tensors of 1 to 4 dimensions, f32 / f64 / bf16 / f16,
//! passed contiguous, transposed (strided) or as a view at a non-zero offset, over 1 to 5
//! ranks. The inputs are small integers, so every sum is exact in every dtype whatever the
//! order, and every rank's result must equal the serial reference bit for bit (each rank
//! rebuilds every rank's inputs from the seed). `CANDLE_CP_RANDOM_SEEDS=A..B` draws sequences
//! `A..B`.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks, PendingRecv, ProcessGroup};
use candle_cp_llama::train::Rng;
use candle_cp_tests::draws::{pick, rng, seeds};

const CONFIGS: u64 = 150;

/// One drawn collective.
#[derive(Debug, Clone)]
enum Op {
    AllGather { dim: usize },
    ReduceScatter { dim: usize },
    AllReduce,
    AllToAll { split: usize, concat: usize },
    Broadcast { root: usize },
    SendRecv { shift: usize },
    /// The started form of `AllReduce` / `ReduceScatter` / `AllGather`, waited for after the
    /// next op.
    Started(Box<Op>),
    /// `op` on the sub-group of `split(color, key)` (colors and keys of every rank).
    Sub { colors: Vec<usize>, keys: Vec<usize>, op: Box<Op> },
}

/// How the input is passed.
#[derive(Debug, Clone, Copy)]
enum View {
    Contiguous,
    Transposed,
    Offset,
}

/// One step of a sequence: the op, the (logical) input shape and dtype, the view.
#[derive(Debug, Clone)]
struct Step {
    op: Op,
    shape: Vec<usize>,
    dtype: DType,
    view: View,
}

/// The draw of sequence `seed` over `p` ranks.
fn draw(seed: u64) -> (usize, Vec<Step>) {
    let mut d = rng(13000 + seed);
    let p = 1 + d.below(5);
    let n = 3 + d.below(6);
    let steps = (0..n).map(|_| draw_step(&mut d, p, true)).collect();
    (p, steps)
}

fn draw_step(d: &mut Rng, p: usize, nest: bool) -> Step {
    let rank = 1 + d.below(4);
    let mut shape: Vec<usize> = (0..rank).map(|_| 1 + d.below(4)).collect();
    let dtype = pick(d, &[DType::F32, DType::F64, DType::BF16, DType::F16]);
    let view = pick(d, &[View::Contiguous, View::Transposed, View::Offset]);
    let dim = d.below(rank);
    let op = match d.below(if nest { 9 } else { 8 }) {
        0 => Op::AllGather { dim },
        1 => {
            shape[dim] *= p;
            Op::ReduceScatter { dim }
        }
        2 => Op::AllReduce,
        3 => {
            let concat = d.below(rank);
            shape[dim] *= p;
            Op::AllToAll { split: dim, concat }
        }
        4 => Op::Broadcast { root: d.below(p) },
        5 => Op::SendRecv { shift: d.below(p) },
        6 | 7 => {
            let inner = match d.below(3) {
                0 => Op::AllReduce,
                1 => {
                    shape[dim] *= p;
                    Op::ReduceScatter { dim }
                }
                _ => Op::AllGather { dim },
            };
            Op::Started(Box::new(inner))
        }
        _ => {
            let colors: Vec<usize> = (0..p).map(|_| d.below(2)).collect();
            let keys: Vec<usize> = (0..p).map(|_| d.below(4)).collect();
            // the sub-group's op (any but another split), its split dim unscaled: each
            // sub-group scales it by its own size (`sub_shape`)
            let mut inner = draw_step(d, p, false);
            if let Op::ReduceScatter { dim } | Op::AllToAll { split: dim, .. } = unstarted(&inner.op) {
                inner.shape[*dim] /= p;
            }
            return Step { op: Op::Sub { colors, keys, op: Box::new(inner.op) }, ..inner };
        }
    };
    Step { op, shape, dtype, view }
}

/// The op a started op starts (the op itself otherwise).
fn unstarted(op: &Op) -> &Op {
    match op {
        Op::Started(inner) => inner,
        op => op,
    }
}

/// Rank `r`'s logical input of step `i`: small integers in [-8, 8].
fn input(seed: u64, i: usize, r: usize, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let mut g = Rng::derive(seed, &[i as u64, r as u64]);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| g.below(17) as f32 - 8.0).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// `x` as `view` passes it (same values, another layout).
fn as_view(x: &Tensor, view: View) -> Result<Tensor> {
    match view {
        View::Contiguous => Ok(x.clone()),
        View::Transposed if x.rank() >= 2 => {
            let l = x.rank() - 1;
            x.transpose(0, l)?.contiguous()?.transpose(0, l)
        }
        View::Transposed => Ok(x.clone()),
        View::Offset => {
            let pad = Tensor::zeros(x.dims(), x.dtype(), &Device::Cpu)?;
            let n0 = x.dim(0)?;
            Tensor::cat(&[&pad, x], 0)?.narrow(0, n0, n0)
        }
    }
}

/// The shape of a step's input on a sub-group of `size` ranks: the split dim scaled by `size`
/// instead of the world's (drawn at 1).
fn sub_shape(op: &Op, shape: &[usize], size: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    match op {
        Op::ReduceScatter { dim } | Op::AllToAll { split: dim, .. } => s[*dim] *= size,
        Op::Started(inner) => return sub_shape(inner, shape, size),
        _ => {}
    }
    s
}

fn sum(xs: &[Tensor]) -> Result<Tensor> {
    let mut acc = xs[0].to_dtype(DType::F64)?;
    for x in &xs[1..] {
        acc = (acc + x.to_dtype(DType::F64)?)?;
    }
    acc.to_dtype(xs[0].dtype())
}

/// The serial reference of `op` for rank `r` of the ranks whose inputs are `xs`.
fn reference(op: &Op, xs: &[Tensor], r: usize) -> Result<Tensor> {
    let p = xs.len();
    match op {
        Op::AllGather { dim } => Tensor::cat(xs, *dim),
        Op::ReduceScatter { dim } => {
            let s = sum(xs)?;
            let c = s.dim(*dim)? / p;
            s.narrow(*dim, r * c, c)
        }
        Op::AllReduce => sum(xs),
        Op::AllToAll { split, concat } => {
            let c = xs[0].dim(*split)? / p;
            let parts: Vec<Tensor> = xs.iter().map(|x| x.narrow(*split, r * c, c)).collect::<Result<_>>()?;
            Tensor::cat(&parts, *concat)
        }
        Op::Broadcast { root } => Ok(xs[*root % p].clone()),
        Op::SendRecv { shift } => Ok(xs[(r + p - shift % p) % p].clone()),
        Op::Started(inner) => reference(inner, xs, r),
        Op::Sub { .. } => unreachable!("sub-groups are resolved by the caller"),
    }
}

/// Start `op` on `g` (the blocking ones complete here).
fn start(g: &dyn ProcessGroup, op: &Op, x: &Tensor) -> Result<Box<dyn PendingRecv>> {
    let r = g.rank();
    let p = g.size();
    let done = |t: Tensor| -> Result<Box<dyn PendingRecv>> { Ok(Box::new(Done(t))) };
    match op {
        Op::AllGather { dim } => done(g.all_gather(x, *dim)?),
        Op::ReduceScatter { dim } => done(g.reduce_scatter(x, *dim)?),
        Op::AllReduce => done(g.all_reduce(x)?),
        Op::AllToAll { split, concat } => done(g.all_to_all(x, *split, *concat)?),
        Op::Broadcast { root } => done(g.broadcast(x, *root % p)?),
        Op::SendRecv { shift } => g.send_recv(x, (r + shift) % p, (r + p - shift % p) % p),
        Op::Started(inner) => match inner.as_ref() {
            Op::AllReduce => g.all_reduce_start(x),
            Op::ReduceScatter { dim } => g.reduce_scatter_start(x, *dim),
            Op::AllGather { dim } => g.all_gather_start(x, *dim),
            other => start(g, other, x),
        },
        Op::Sub { .. } => unreachable!("sub-groups are resolved by the caller"),
    }
}

struct Done(Tensor);
impl PendingRecv for Done {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        Ok(self.0)
    }
}

/// `got` equals `want` bit for bit (shape, dtype, values).
fn same(got: &Tensor, want: &Tensor) -> Result<bool> {
    Ok(got.dims() == want.dims()
        && got.dtype() == want.dtype()
        && got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()? == want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

#[test]
fn random_collective_sequences_match_serial_references() -> Result<()> {
    let (mut checked, mut ops, mut started, mut subs) = (0, 0, 0, 0);
    for seed in seeds(CONFIGS)? {
        let (p, steps) = draw(seed);
        let what = format!("sequence {seed} on {p} ranks: {steps:?}");
        let results = run_ranks(p, |g| {
            let r = g.rank();
            // a started collective waits here until the next step has run
            let mut pending: Option<(usize, Box<dyn PendingRecv>, Tensor)> = None;
            for (i, st) in steps.iter().enumerate() {
                let (group, op, members): (candle_cp_comm::Group, &Op, Vec<usize>) = match &st.op {
                    Op::Sub { colors, keys, op } => {
                        let sub = g.split(colors[r], keys[r])?;
                        let mut members: Vec<usize> = (0..p).filter(|&q| colors[q] == colors[r]).collect();
                        members.sort_by_key(|&q| (keys[q], q));
                        (sub, op.as_ref(), members)
                    }
                    op => (g.clone(), op, (0..p).collect()),
                };
                let me = members.iter().position(|&q| q == r).expect("a member of its own group");
                if group.rank() != me || group.size() != members.len() {
                    candle_core::bail!("step {i}: sub-group rank {} of {}, expected {me} of {}", group.rank(), group.size(), members.len());
                }
                let shape = sub_shape(op, &st.shape, members.len());
                let xs: Vec<Tensor> = members.iter().map(|&q| input(seed, i, q, &shape, st.dtype)).collect::<Result<_>>()?;
                let want = reference(op, &xs, me)?;
                let handle = start(group.as_ref(), op, &as_view(&xs[me], st.view)?)?;
                if let Some((j, h, w)) = pending.take() {
                    let got = h.wait()?;
                    if !same(&got, &w)? {
                        candle_core::bail!("step {j} (started) on rank {r}: {got} vs {w}");
                    }
                }
                if matches!(op, Op::Started(_)) {
                    pending = Some((i, handle, want));
                } else {
                    let got = handle.wait()?;
                    if !same(&got, &want)? {
                        candle_core::bail!("step {i} on rank {r}: {got} vs {want}");
                    }
                }
            }
            if let Some((j, h, w)) = pending.take() {
                let got = h.wait()?;
                if !same(&got, &w)? {
                    candle_core::bail!("step {j} (started) on rank {r}: {got} vs {w}");
                }
            }
            Ok(())
        });
        for (r, x) in results.into_iter().enumerate() {
            if let Err(e) = x {
                panic!("{what}: rank {r}: {e}");
            }
        }
        checked += 1;
        ops += steps.len();
        started += steps.iter().filter(|s| matches!(s.op, Op::Started(_))).count();
        subs += steps.iter().filter(|s| matches!(s.op, Op::Sub { .. })).count();
        started += steps.iter().filter(|s| matches!(&s.op, Op::Sub { op, .. } if matches!(op.as_ref(), Op::Started(_)))).count();
    }
    println!("{checked} sequences ({ops} collectives, {started} started, {subs} on sub-groups) match");
    Ok(())
}
