//! Conjugate pairs: the forward of one equals the backward of the other, and each forward
//! equals the collective computed by hand from every rank's input.

use crate::{all_ok, grad, rand_t};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::mappings as mp;
use candle_cp_ops::ulysses::{all_to_all_head_to_seq, all_to_all_seq_to_head};

type Op = fn(&Tensor, &Group) -> candle_core::Result<Tensor>;

const B: usize = 2;
const TL: usize = 3; // local rows
const C: usize = 5;

fn copy(x: &Tensor, g: &Group) -> candle_core::Result<Tensor> {
    mp::copy_to_tp_region(x, g)
}
fn reduce(x: &Tensor, g: &Group) -> candle_core::Result<Tensor> {
    mp::reduce_from_tp_region(x, g)
}
fn scatter(x: &Tensor, g: &Group) -> candle_core::Result<Tensor> {
    mp::scatter_to_sp_region(x, g, mp::SEQ_DIM)
}
fn gather_rep(x: &Tensor, g: &Group) -> candle_core::Result<Tensor> {
    mp::gather_from_sp_region_replicated_grad(x, g, mp::SEQ_DIM)
}
fn gather(x: &Tensor, g: &Group) -> candle_core::Result<Tensor> {
    mp::gather_from_sp_region(x, g, mp::SEQ_DIM)
}
fn reduce_scatter(x: &Tensor, g: &Group) -> candle_core::Result<Tensor> {
    mp::reduce_scatter_to_sp_region(x, g, mp::SEQ_DIM)
}

/// Input shape of each op for a group of `p` ranks (the output shape of its partner).
fn in_shape(name: &str, p: usize) -> Vec<usize> {
    match name {
        "copy" | "reduce" => vec![B, TL * p, C],
        "scatter" | "reduce_scatter" => vec![B, TL * p, C],
        "gather_rep" | "gather" => vec![B, TL, C],
        "seq_to_head" => vec![B, TL, 2 * p, C],
        "head_to_seq" => vec![B, TL * p, 2, C],
        _ => unreachable!(),
    }
}

/// What the op's forward must return on `rank`, computed by hand from all ranks' inputs.
fn expected(name: &str, xs: &[Tensor], rank: usize) -> candle_core::Result<Tensor> {
    let p = xs.len();
    let sum = || xs.iter().skip(1).try_fold(xs[0].clone(), |a, x| a + x);
    let chunk = |x: &Tensor, dim: usize| x.narrow(dim, rank * x.dim(dim)? / p, x.dim(dim)? / p);
    match name {
        "copy" => Ok(xs[rank].clone()),
        "reduce" => sum(),
        "scatter" => chunk(&xs[rank], 1),
        "gather_rep" | "gather" => Tensor::cat(xs, 1),
        "reduce_scatter" => chunk(&sum()?, 1),
        "seq_to_head" => chunk(&Tensor::cat(xs, 1)?, 2),
        "head_to_seq" => Tensor::cat(&xs.iter().map(|x| chunk(x, 1)).collect::<candle_core::Result<Vec<_>>>()?, 2),
        _ => unreachable!(),
    }
}

fn seq_to_head(x: &Tensor, g: &Group) -> candle_core::Result<Tensor> {
    all_to_all_seq_to_head(x, g)
}
fn head_to_seq(x: &Tensor, g: &Group) -> candle_core::Result<Tensor> {
    all_to_all_head_to_seq(x, g)
}

/// Gradient of `sum(op(v) * upstream)` w.r.t. `v` (a fresh variable of shape `in_shape`).
fn vjp(op: Op, g: &Group, in_shape: &[usize], upstream: &Tensor) -> candle_core::Result<Tensor> {
    let v = Var::from_tensor(&Tensor::zeros(in_shape, DType::F32, &Device::Cpu)?)?;
    let y = op(v.as_tensor(), g)?;
    let grads = (y * upstream)?.sum_all()?.backward()?;
    grad(&grads, v.as_tensor(), "vjp input")
}

#[test]
fn conjugate_pairs_forward_of_one_is_backward_of_other() -> Result<()> {
    type Named = (&'static str, Op);
    let pairs: [(Named, Named); 4] = [
        (("copy", copy), ("reduce", reduce)),
        (("scatter", scatter), ("gather_rep", gather_rep)),
        (("gather", gather), ("reduce_scatter", reduce_scatter)),
        (("seq_to_head", seq_to_head), ("head_to_seq", head_to_seq)),
    ];
    for p in [2usize, 3, 4] {
        for ((na, fa), (nb, fb)) in pairs {
            let res = all_ok(run_ranks(p, |g: Group| {
                let r = g.rank();
                let input = |n: &str, rank: usize| rand_t(100 + rank as u64, n, &in_shape(n, p));
                let mut worst = 0f64;
                for (n1, f1, _n2, f2) in [(na, fa, nb, fb), (nb, fb, na, fa)] {
                    // forward of f1 against the hand-made collective
                    let xs = (0..p).map(|s| input(n1, s)).collect::<candle_core::Result<Vec<_>>>()?;
                    let y = f1(&xs[r], &g)?;
                    let want = expected(n1, &xs, r)?;
                    let e = (&y - &want)?.abs()?.max_all()?.to_scalar::<f32>()? as f64;
                    if e > 1e-6 {
                        candle_core::bail!("{n1} forward differs from the collective by {e} (P = {p})")
                    }
                    // backward of f2 with upstream = f1's input equals f1's forward
                    let back = vjp(f2, &g, y.dims(), &xs[r])?;
                    let e = (&back - &y)?.abs()?.max_all()?.to_scalar::<f32>()? as f64;
                    worst = worst.max(e);
                }
                Ok(worst)
            }))?;
            for (r, e) in res.iter().enumerate() {
                assert!(*e <= 1e-6, "P = {p}, pair {na}/{nb}, rank {r}: backward differs from partner forward by {e}");
            }
        }
    }
    Ok(())
}

#[test]
fn mapping_errors_name_shapes() -> Result<()> {
    let res = run_ranks(2, |g: Group| {
        let x = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu)?;
        let e1 = mp::reduce_scatter_to_sp_region(&x, &g, 1).err().map(|e| e.to_string()).unwrap_or_default();
        let e2 = mp::scatter_to_sp_region(&x, &g, 1).err().map(|e| e.to_string()).unwrap_or_default();
        let e3 = mp::gather_from_sp_region(&x, &g, 5).err().map(|e| e.to_string()).unwrap_or_default();
        Ok([e1, e2, e3])
    });
    for msgs in all_ok(res)? {
        assert!(msgs[0].contains("[2, 3, 4]") && msgs[0].contains("group size 2"), "{}", msgs[0]);
        assert!(msgs[1].contains("[2, 3, 4]") && msgs[1].contains("not divisible"), "{}", msgs[1]);
        assert!(msgs[2].contains("dim 5"), "{}", msgs[2]);
    }
    Ok(())
}
