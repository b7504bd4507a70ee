//! Ulysses, 2-D Ulysses × ring, and Megatron sequence parallelism (threads as ranks).
//!
//! - every conjugate pair (Megatron mappings and the Ulysses all-to-alls) as a pair: the
//!   forward of one equals the backward of the other, and each forward matches the collective
//!   computed by hand from every rank's input;
//! - an SP+TP transformer block (RMSNorm → attention → dropout → LayerNorm → MLP → dropout)
//!   with TP = 2, 4, SP on and off, against a single-device block built from plain candle ops:
//!   outputs, input gradient and every parameter gradient;
//! - Ulysses and 2-D attention on every oracle case the heads allow (incl. KV replication),
//!   against the float64 oracle and the single-device op;
//! - error paths.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Shape, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_nn::{ColumnParallelLinear, Dropout, LayerNorm, Region, RmsNorm, RngStreams, RowParallelLinear, Tp};
use candle_cp_ops::attention::{attention, attention_slow, Mask};
use candle_cp_ops::cp::{self, Layout};
use candle_cp_ops::mappings as mp;
use candle_cp_ops::oracle::{run_single, AttnCase, AttnMetrics, AttnOutputs, AttnTol};
use candle_cp_ops::ulysses::{self, all_to_all_head_to_seq, all_to_all_seq_to_head, ulysses_attention, UlyssesOpts};
use candle_cp_ops::usp::{usp_attention, usp_positions, usp_shard, UspGroups, UspOpts};
use std::collections::HashMap;
use std::path::PathBuf;

// ---------------------------------------------------------------- helpers

/// Uniform in `[-1, 1)`, deterministic for (seed, name).
fn rand_t(seed: u64, name: &str, shape: &[usize]) -> candle_core::Result<Tensor> {
    let u = RngStreams::new(seed).uniform(name, 0, &Shape::from(shape), &Region::Replicated, &Device::Cpu)?;
    (u * 2.0)? - 1.0
}

fn all_ok<T>(res: Vec<candle_core::Result<T>>) -> Result<Vec<T>> {
    res.into_iter().enumerate().map(|(r, x)| x.with_context(|| format!("rank {r}"))).collect()
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.dims() != b.dims() {
        bail!("shape {:?} vs {:?}", a.dims(), b.dims())
    }
    Ok((a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?.abs()?.max_all()?.to_scalar::<f64>()?)
}

fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let m = b.to_dtype(DType::F64)?.abs()?.max_all()?.to_scalar::<f64>()?;
    Ok(max_abs(a, b)? / m.max(1e-30))
}

fn grad(g: &candle_core::backprop::GradStore, v: &Tensor, what: &str) -> candle_core::Result<Tensor> {
    match g.get(v) {
        Some(t) => Ok(t.clone()),
        None => candle_core::bail!("no gradient for {what}"),
    }
}

// ---------------------------------------------------------------- conjugate pairs

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
    let pairs: [((&str, Op), (&str, Op)); 4] = [
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

// ---------------------------------------------------------------- SP + TP transformer block

const BT: usize = 2; // batch
const T: usize = 16; // global sequence
const HID: usize = 32;
const HEADS: usize = 4;
const FFN: usize = 64;
const EPS: f64 = 1e-5;
const P_DROP: f64 = 0.1;

fn block_params() -> Result<HashMap<String, Tensor>> {
    let mut m = HashMap::new();
    let mut add = |n: &str, s: &[usize], scale: f64, offset: f64| -> Result<()> {
        m.insert(n.to_string(), ((rand_t(7, n, s)? * scale)? + offset)?);
        Ok(())
    };
    add("norm1.weight", &[HID], 0.2, 1.0)?;
    // No k bias: its gradient is zero in exact arithmetic (softmax is shift invariant), so
    // only rounding noise would be compared.
    for n in ["q", "k", "v", "o"] {
        add(&format!("attn.{n}.weight"), &[HID, HID], 0.3, 0.0)?;
        if n != "k" {
            add(&format!("attn.{n}.bias"), &[HID], 0.1, 0.0)?;
        }
    }
    add("norm2.weight", &[HID], 0.2, 1.0)?;
    add("norm2.bias", &[HID], 0.1, 0.0)?;
    add("mlp.up.weight", &[FFN, HID], 0.3, 0.0)?;
    add("mlp.up.bias", &[FFN], 0.1, 0.0)?;
    add("mlp.down.weight", &[HID, FFN], 0.2, 0.0)?;
    add("mlp.down.bias", &[HID], 0.1, 0.0)?;
    Ok(m)
}

/// How each parameter is sharded over TP: `Some(dim)` split along dim, `None` replicated.
fn shard_dim(name: &str) -> Option<usize> {
    match name {
        n if n.starts_with("attn.o.weight") || n == "mlp.down.weight" => Some(1),
        "attn.o.bias" | "mlp.down.bias" => None,
        n if n.starts_with("attn.") || n.starts_with("mlp.up") => Some(0),
        _ => None,
    }
}

/// Single-device block from plain candle ops (reference).
fn reference_block(p: &HashMap<String, Var>, x: &Tensor, rng: &RngStreams) -> candle_core::Result<Tensor> {
    let w = |n: &str| p[n].as_tensor().clone();
    let lin = |x: &Tensor, n: &str| {
        let b = p.get(&format!("{n}.bias")).map(|b| b.as_tensor().clone());
        candle_nn::Linear::new(w(&format!("{n}.weight")), b).forward(x)
    };
    let ms = x.sqr()?.mean_keepdim(2)?;
    let h = x.broadcast_div(&(ms + EPS)?.sqrt()?)?.broadcast_mul(&w("norm1.weight"))?;
    let d = HID / HEADS;
    let heads = |t: Tensor| t.reshape((BT, T, HEADS, d));
    let (q, k, v) = (heads(lin(&h, "attn.q")?)?, heads(lin(&h, "attn.k")?)?, heads(lin(&h, "attn.v")?)?);
    let (a, _) = attention_slow(&q, &k, &v, &Mask::causal(), 1.0 / (d as f64).sqrt())?;
    let a = lin(&a.reshape((BT, T, HID))?, "attn.o")?;
    let a = Dropout::new(P_DROP, "blk.attn_drop")?.forward(&a, rng, 3, &Region::Replicated, true)?;
    let x2 = (x + a)?;
    let xc = x2.broadcast_sub(&x2.mean_keepdim(2)?)?;
    let var = xc.sqr()?.mean_keepdim(2)?;
    let h2 = xc.broadcast_div(&(var + EPS)?.sqrt()?)?.broadcast_mul(&w("norm2.weight"))?.broadcast_add(&w("norm2.bias"))?;
    let m = lin(&lin(&h2, "mlp.up")?.gelu()?, "mlp.down")?;
    let m = Dropout::new(P_DROP, "blk.mlp_drop")?.forward(&m, rng, 3, &Region::Replicated, true)?;
    x2 + m
}

/// The same block from candle-cp-nn layers on a TP group (SP on or off).
struct TpBlock {
    norm1: RmsNorm,
    q: ColumnParallelLinear,
    k: ColumnParallelLinear,
    v: ColumnParallelLinear,
    o: RowParallelLinear,
    norm2: LayerNorm,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    tp: Tp,
}

impl TpBlock {
    fn load(vb: candle_nn::VarBuilder, tp: &Tp) -> candle_core::Result<Self> {
        let a = vb.pp("attn");
        Ok(Self {
            norm1: RmsNorm::load(vb.pp("norm1"), HID, EPS, tp)?,
            q: ColumnParallelLinear::load(a.pp("q"), HID, HID, true, tp)?,
            k: ColumnParallelLinear::load(a.pp("k"), HID, HID, false, tp)?,
            v: ColumnParallelLinear::load(a.pp("v"), HID, HID, true, tp)?,
            o: RowParallelLinear::load(a.pp("o"), HID, HID, true, tp)?,
            norm2: LayerNorm::load(vb.pp("norm2"), HID, EPS, tp)?,
            up: ColumnParallelLinear::load(vb.pp("mlp.up"), HID, FFN, true, tp)?,
            down: RowParallelLinear::load(vb.pp("mlp.down"), FFN, HID, true, tp)?,
            tp: tp.clone(),
        })
    }

    fn named_vars(&self) -> Vec<(String, Var)> {
        let mut out = vec![("norm1.weight".to_string(), self.norm1.weight().clone())];
        let mut lin = |n: &str, vs: Vec<Var>| {
            out.push((format!("{n}.weight"), vs[0].clone()));
            if let Some(b) = vs.get(1) {
                out.push((format!("{n}.bias"), b.clone()));
            }
        };
        lin("attn.q", self.q.vars());
        lin("attn.k", self.k.vars());
        lin("attn.v", self.v.vars());
        lin("attn.o", self.o.vars());
        lin("norm2", self.norm2.vars());
        lin("mlp.up", self.up.vars());
        lin("mlp.down", self.down.vars());
        out
    }

    /// `x` `[B, T/P, C]` with SP, `[B, T, C]` without.
    fn forward(&self, x: &Tensor, rng: &RngStreams) -> candle_core::Result<Tensor> {
        let hl = HEADS / self.tp.size();
        let d = HID / HEADS;
        let h = self.norm1.forward(x)?;
        let heads = |t: Tensor| t.reshape((BT, T, hl, d));
        let (q, k, v) = (heads(self.q.forward(&h)?)?, heads(self.k.forward(&h)?)?, heads(self.v.forward(&h)?)?);
        let (a, _) = attention(&q, &k, &v, &Mask::causal(), 1.0 / (d as f64).sqrt())?;
        let a = self.o.forward(&a.reshape((BT, T, hl * d))?)?;
        let region = self.tp.activation_region();
        let a = Dropout::new(P_DROP, "blk.attn_drop")?.forward(&a, rng, 3, &region, true)?;
        let x2 = (x + a)?;
        let m = self.down.forward(&self.up.forward(&self.norm2.forward(&x2)?)?.gelu()?)?;
        let m = Dropout::new(P_DROP, "blk.mlp_drop")?.forward(&m, rng, 3, &region, true)?;
        x2 + m
    }
}

fn check_block(tp_size: usize, sp: bool) -> Result<()> {
    let params = block_params()?;
    let x = rand_t(1, "x", &[BT, T, HID])?;
    let up = rand_t(2, "upstream", &[BT, T, HID])?;
    let rng = RngStreams::new(42);

    // single device
    let vars: HashMap<String, Var> = params.iter().map(|(k, v)| Ok((k.clone(), Var::from_tensor(v)?))).collect::<Result<_>>()?;
    let xv = Var::from_tensor(&x)?;
    let y_ref = reference_block(&vars, xv.as_tensor(), &rng)?;
    let g_ref = (&y_ref * &up)?.sum_all()?.backward()?;
    let dx_ref = grad(&g_ref, xv.as_tensor(), "x")?;

    let res = all_ok(run_ranks(tp_size, |g: Group| {
        let tp = Tp::new(g.clone(), sp);
        let vb = candle_nn::VarBuilder::from_tensors(params.clone(), DType::F32, &Device::Cpu);
        let blk = TpBlock::load(vb, &tp)?;
        let local = |t: &Tensor| if sp { mp::scatter_to_sp_region(t, &g, 1) } else { Ok(t.clone()) };
        let xl = Var::from_tensor(&local(&x)?)?;
        let y = blk.forward(xl.as_tensor(), &rng)?;
        let grads = (&y * local(&up)?)?.sum_all()?.backward()?;
        let mut named = vec![("x".to_string(), grad(&grads, xl.as_tensor(), "x")?)];
        for (n, v) in blk.named_vars() {
            named.push((n.clone(), grad(&grads, v.as_tensor(), &n)?));
        }
        Ok((y, named))
    }))?;

    let tag = format!("TP = {tp_size}, SP = {sp}");
    let take = |t: &Tensor, dim: usize, r: usize| t.narrow(dim, r * t.dim(dim).unwrap() / tp_size, t.dim(dim).unwrap() / tp_size);
    let tol = 2e-5;
    let (mut worst_y, mut worst_g) = (0f64, 0f64);
    for (r, (y, named)) in res.iter().enumerate() {
        let want_y = if sp { take(&y_ref, 1, r)? } else { y_ref.clone() };
        let e = max_abs(y, &want_y)?;
        assert!(e < 1e-5, "{tag} rank {r}: output differs by {e}");
        worst_y = worst_y.max(e);
        for (n, gr) in named {
            let full = if n == "x" { dx_ref.clone() } else { grad(&g_ref, vars[n].as_tensor(), n)? };
            let want = match (n.as_str(), shard_dim(n)) {
                ("x", _) if sp => take(&full, 1, r)?,
                ("x", _) => full,
                (_, Some(d)) => take(&full, d, r)?,
                (_, None) => full,
            };
            let e = rel(gr, &want)?;
            assert!(e < tol, "{tag} rank {r}: gradient of {n} off by rel {e:.2e}");
            worst_g = worst_g.max(e);
        }
    }
    eprintln!("block {tag}: output max abs err {worst_y:.1e}, worst gradient rel err {worst_g:.1e} ({} tensors)", res[0].1.len());
    // replicated parameters: identical gradients on every rank
    for (i, (n, gr)) in res[0].1.iter().enumerate() {
        if n != "x" && shard_dim(n).is_none() {
            for (r, other) in res.iter().enumerate().skip(1) {
                assert_eq!(max_abs(gr, &other.1[i].1)?, 0.0, "{tag}: ranks 0 and {r} disagree on grad {n}");
            }
        }
    }
    Ok(())
}

#[test]
fn sp_tp_block_matches_single_device_tp2() -> Result<()> {
    check_block(2, true)?;
    check_block(2, false)
}

#[test]
fn sp_tp_block_matches_single_device_tp4() -> Result<()> {
    check_block(4, true)?;
    check_block(4, false)
}

#[test]
fn dropout_masks_by_region() -> Result<()> {
    // Inside an SP region the 2 TP ranks get different masks; outside (replicated) the same.
    let res = all_ok(run_ranks(2, |g: Group| {
        let rng = RngStreams::new(5);
        let d = Dropout::new(0.5, "drop")?;
        let shape = Shape::from((2, 8, 16));
        let sp = d.mask(&shape, &rng, 0, &Tp::new(g.clone(), true).activation_region(), DType::F32, &Device::Cpu)?;
        let rep = d.mask(&shape, &rng, 0, &Tp::new(g.clone(), false).activation_region(), DType::F32, &Device::Cpu)?;
        Ok((sp, rep))
    }))?;
    assert!(max_abs(&res[0].0, &res[1].0)? > 0.0, "SP-region masks must differ across ranks");
    assert_eq!(max_abs(&res[0].1, &res[1].1)?, 0.0, "replicated-region masks must agree across TP ranks");
    Ok(())
}

// ---------------------------------------------------------------- Ulysses and 2-D on the oracle

fn oracle_cases() -> Result<Vec<AttnCase>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/oracle/attn");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)?.map(|e| Ok(e?.path())).collect::<Result<_>>()?;
    paths.retain(|p| p.extension().is_some_and(|x| x == "safetensors"));
    paths.sort();
    assert_eq!(paths.len(), 7, "expected 7 oracle cases in {}", dir.display());
    paths.iter().map(|p| Ok(AttnCase::load(p)?)).collect()
}

/// Each rank returns the global positions of its rows and its local results; rebuild the
/// global tensors (rows along dim 1, lse along dim 2).
fn assemble(parts: Vec<(Vec<usize>, AttnOutputs)>) -> Result<AttnOutputs> {
    let pos: Vec<u32> = parts.iter().flat_map(|(p, _)| p.iter().map(|&x| x as u32)).collect();
    let mut inv = vec![0u32; pos.len()];
    for (i, &p) in pos.iter().enumerate() {
        inv[p as usize] = i as u32;
    }
    let inv = Tensor::new(inv, &Device::Cpu)?;
    let cat = |f: &dyn Fn(&AttnOutputs) -> &Tensor, dim: usize| -> Result<Tensor> {
        let ts: Vec<Tensor> = parts.iter().map(|(_, o)| f(o).clone()).collect();
        Ok(Tensor::cat(&ts, dim)?.contiguous()?.index_select(&inv, dim)?)
    };
    Ok(AttnOutputs {
        out: cat(&|o| &o.out, 1)?,
        lse: cat(&|o| &o.lse, 2)?,
        dq: cat(&|o| &o.dq, 1)?,
        dk: cat(&|o| &o.dk, 1)?,
        dv: cat(&|o| &o.dv, 1)?,
    })
}

/// Forward + backward of `sum(out * dout)` on local shards; `attn` is the parallel op.
fn local_run(
    case: &AttnCase,
    shard: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    attn: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<(Tensor, Tensor)>,
) -> candle_core::Result<AttnOutputs> {
    let (q, k, v) = (Var::from_tensor(&shard(&case.q)?)?, Var::from_tensor(&shard(&case.k)?)?, Var::from_tensor(&shard(&case.v)?)?);
    let (out, lse) = attn(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
    let grads = (&out * shard(&case.dout)?)?.sum_all()?.backward()?;
    Ok(AttnOutputs { out, lse, dq: grad(&grads, q.as_tensor(), "q")?, dk: grad(&grads, k.as_tensor(), "k")?, dv: grad(&grads, v.as_tensor(), "v")? })
}

/// Compare against the oracle (its tolerances) and the single-device op (the oracle's
/// tolerances times `tight`).
fn check_case(what: &str, case: &AttnCase, single: &AttnOutputs, got: &AttnOutputs, tight: f64) -> Result<()> {
    let tol = case.tolerances();
    let m = AttnMetrics::compute(got, &case.reference)?;
    assert!(m.passes(&tol), "{what} vs oracle:\n{}", m.report(&tol));
    let tight: AttnTol = tol.scaled(tight);
    let s = AttnMetrics::compute(got, single)?;
    assert!(s.passes(&tight), "{what} vs single device:\n{}", s.report(&tight));
    let row = |m: &AttnMetrics| format!("{:.1e} {:.1e} {:.1e} {:.1e} {:.1e}", m.out_abs, m.lse_abs, m.dq_rel, m.dk_rel, m.dv_rel);
    eprintln!("{what:<55} oracle [{}]  single [{}]", row(&m), row(&s));
    Ok(())
}

fn dims(case: &AttnCase) -> (usize, usize, usize) {
    (case.q.dim(1).unwrap(), case.q.dim(2).unwrap(), case.k.dim(2).unwrap())
}

#[test]
fn ulysses_on_oracle_cases() -> Result<()> {
    let mut ran = 0;
    let mut replicated = 0;
    for case in oracle_cases()? {
        let (t, h, hkv) = dims(&case);
        let single = run_single(&case)?;
        for p in [2usize, 4, 8] {
            if !ulysses::valid_ulysses_degrees(h, hkv).contains(&p) || t % p != 0 {
                continue;
            }
            // contiguous for every case; zigzag/striped sequence order on causal cases
            let mut layouts = vec![Layout::Contiguous];
            if case.causal && p == 2 && t <= 256 {
                layouts.extend([Layout::Zigzag, Layout::Striped]);
            }
            for layout in layouts {
                if t % layout.divisor(p) != 0 {
                    continue;
                }
                let parts = all_ok(run_ranks(p, |g: Group| {
                    let r = g.rank();
                    let opts = UlyssesOpts::new(case.causal, case.scale).with_layout(layout, t, p)?;
                    let shard = |x: &Tensor| cp::shard(x, layout, r, p, 1);
                    let o = local_run(&case, &shard, &|q, k, v| ulysses_attention(q, k, v, &g, &opts))?;
                    Ok((cp::positions(layout, r, p, t)?, o))
                }))?;
                check_case(&format!("ulysses {} P = {p} {layout}", case.name), &case, &single, &assemble(parts)?, 0.1)?;
                ran += 1;
                replicated += usize::from(hkv < p);
            }
        }
    }
    assert!(ran >= 12 && replicated >= 4, "too few Ulysses runs: {ran} ({replicated} with KV replication)");
    Ok(())
}

#[test]
fn usp_2d_on_oracle_cases() -> Result<()> {
    let mut ran = 0;
    let mut replicated = 0;
    for case in oracle_cases()? {
        let (t, h, hkv) = dims(&case);
        let single = run_single(&case)?;
        for (u, r) in [(2usize, 2usize), (4, 2), (2, 4)] {
            let ok = ulysses::valid_ulysses_degrees(h, hkv).contains(&u) && t % (2 * r) == 0 && (t / r) % u == 0;
            if !ok || (r == 4 && t > 1000) {
                continue;
            }
            let parts = all_ok(run_ranks(u * r, |g: Group| {
                let groups = UspGroups::new(&g, u, r)?;
                // documented rank order: world rank = ring index · U + Ulysses index
                if g.rank() != groups.ring.rank() * u + groups.ulysses.rank() {
                    candle_core::bail!("rank order: world {} ring {} ulysses {}", g.rank(), groups.ring.rank(), groups.ulysses.rank())
                }
                let opts = UspOpts::new(case.causal, case.scale);
                let shard = |x: &Tensor| usp_shard(x, Layout::Zigzag, &groups, 1);
                let o = local_run(&case, &shard, &|q, k, v| usp_attention(q, k, v, &groups, &opts))?;
                Ok((usp_positions(Layout::Zigzag, t, groups.ring.rank(), r, groups.ulysses.rank(), u)?, o))
            }))?;
            check_case(&format!("usp {} U = {u} R = {r}", case.name), &case, &single, &assemble(parts)?, 0.5)?;
            ran += 1;
            replicated += usize::from(hkv < u);
        }
    }
    assert!(ran >= 8 && replicated >= 3, "too few 2-D runs: {ran} ({replicated} with KV replication)");
    Ok(())
}

// ---------------------------------------------------------------- error paths

#[test]
fn ulysses_errors_name_heads_and_degrees() -> Result<()> {
    let z = |h: usize| Tensor::zeros((1, 4, h, 8), DType::F32, &Device::Cpu);
    // H = 6 over P = 4
    let res = run_ranks(4, |g: Group| {
        let e = ulysses_attention(&z(6)?, &z(6)?, &z(6)?, &g, &UlyssesOpts::new(true, 0.3));
        Ok(e.err().map(|e| e.to_string()).unwrap_or_default())
    });
    for m in all_ok(res)? {
        assert!(m.contains("H = 6") && m.contains("P = 4"), "{m}");
    }
    // H = 12, Hkv = 3 over P = 2: KV heads can be neither split nor replicated
    let res = run_ranks(2, |g: Group| {
        let e = ulysses_attention(&z(12)?, &z(3)?, &z(3)?, &g, &UlyssesOpts::new(false, 0.3));
        Ok(e.err().map(|e| e.to_string()).unwrap_or_default())
    });
    for m in all_ok(res)? {
        assert!(m.contains("Hkv = 3") && m.contains("P = 2") && m.contains("[1, 3, 6, 12]"), "{m}");
    }
    // 2-D: the Ulysses degree is checked the same way; U·R must be the world size
    let res = run_ranks(4, |g: Group| {
        let groups = UspGroups::new(&g, 4, 1)?;
        let e = usp_attention(&z(12)?, &z(3)?, &z(3)?, &groups, &UspOpts::new(true, 0.3));
        let bad = UspGroups::new(&g, 3, 1).err().map(|e| e.to_string()).unwrap_or_default();
        Ok((e.err().map(|e| e.to_string()).unwrap_or_default(), bad))
    });
    for (m, bad) in all_ok(res)? {
        assert!(m.contains("P = 4") && m.contains("[1, 3, 6, 12]"), "{m}");
        assert!(bad.contains("U = 3") && bad.contains("world size 4"), "{bad}");
    }
    Ok(())
}

// ---------------------------------------------------------------- communication volume

/// A process group that logs the bytes this rank *sends* per collective (standard ring
/// algorithms: all-gather `(P-1)·|t|`, reduce-scatter and all-to-all `(P-1)/P·|t|`, all-reduce
/// `2(P-1)/P·|t|`, send/recv `|t|`). Collectives under 1 KiB (shape checks) are not counted.
struct Counting {
    inner: Group,
    log: std::sync::Arc<std::sync::Mutex<HashMap<&'static str, f64>>>,
}

impl Counting {
    fn wrap(inner: Group) -> (Group, std::sync::Arc<std::sync::Mutex<HashMap<&'static str, f64>>>) {
        let log = std::sync::Arc::new(std::sync::Mutex::new(HashMap::new()));
        (std::sync::Arc::new(Counting { inner, log: log.clone() }), log)
    }
    fn rec(&self, op: &'static str, t: &Tensor, factor: f64) {
        let bytes = (t.elem_count() * t.dtype().size_in_bytes()) as f64;
        if bytes >= 1024.0 {
            *self.log.lock().unwrap().entry(op).or_default() += bytes * factor;
        }
    }
    fn p(&self) -> f64 {
        self.inner.size() as f64
    }
}

impl candle_cp_comm::ProcessGroup for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
        self.rec("all_gather", t, self.p() - 1.0);
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
        self.rec("reduce_scatter", t, (self.p() - 1.0) / self.p());
        self.inner.reduce_scatter(t, dim)
    }
    fn all_reduce(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        self.rec("all_reduce", t, 2.0 * (self.p() - 1.0) / self.p());
        self.inner.all_reduce(t)
    }
    fn all_to_all(&self, t: &Tensor, split_dim: usize, concat_dim: usize) -> candle_core::Result<Tensor> {
        self.rec("all_to_all", t, (self.p() - 1.0) / self.p());
        self.inner.all_to_all(t, split_dim, concat_dim)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> candle_core::Result<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> candle_core::Result<()> {
        self.inner.barrier()
    }
    fn send_recv(&self, t: &Tensor, dst: usize, src: usize) -> candle_core::Result<Box<dyn candle_cp_comm::PendingRecv>> {
        self.rec("send_recv", t, 1.0);
        self.inner.send_recv(t, dst, src)
    }
    fn split(&self, color: usize, key: usize) -> candle_core::Result<Group> {
        let inner = self.inner.split(color, key)?;
        Ok(std::sync::Arc::new(Counting { inner, log: self.log.clone() }))
    }
}

type Log = std::sync::Arc<std::sync::Mutex<HashMap<&'static str, f64>>>;

fn total(log: &Log) -> f64 {
    log.lock().unwrap().values().sum()
}

/// Bytes rank 0 sends in forward and in backward of `sum(f(q, k, v) * 1)`.
fn measure_attn(
    p: usize,
    dims: (usize, usize, usize, usize, usize),
    f: &(dyn Fn(&Tensor, &Tensor, &Tensor, &Group) -> candle_core::Result<(Tensor, Tensor)> + Sync),
) -> Result<(f64, f64)> {
    let (b, t, h, hkv, d) = dims;
    let res = all_ok(run_ranks(p, |g: Group| {
        let (g, log) = Counting::wrap(g);
        let mk = |n: &str, hh: usize| Var::from_tensor(&rand_t(g.rank() as u64, n, &[b, t / p, hh, d])?);
        let (q, k, v) = (mk("q", h)?, mk("k", hkv)?, mk("v", hkv)?);
        let (out, _) = f(q.as_tensor(), k.as_tensor(), v.as_tensor(), &g)?;
        let fwd = total(&log);
        out.sum_all()?.backward()?;
        Ok((fwd, total(&log) - fwd))
    }))?;
    Ok(res[0])
}

#[test]
fn comm_volume_matches_formulas() -> Result<()> {
    let (p, b, t, h, hkv, d) = (4usize, 1usize, 256usize, 8usize, 2usize, 16usize);
    let s = 4.0; // f32 bytes
    let frac = (p as f64 - 1.0) / p as f64;
    let local = (b * t / p * d) as f64 * s; // bytes of one head of a local shard
    let scale = 1.0 / (d as f64).sqrt();
    let dims = (b, t, h, hkv, d);

    // Ulysses: q, k, v (KV replicated to P heads), out, and lse all-to-alls; backward moves
    // dout, dq, dk, dv (no lse).
    let (fwd, bwd) = measure_attn(p, dims, &|q, k, v, g| ulysses_attention(q, k, v, g, &UlyssesOpts::new(true, scale)))?;
    let hkv_sent = hkv.max(p) as f64;
    let want_fwd = frac * local * (2.0 * h as f64 + 2.0 * hkv_sent) + frac * (b * h * t / p) as f64 * 4.0;
    let want_bwd = frac * local * (2.0 * h as f64 + 2.0 * hkv_sent);
    assert_eq!((fwd, bwd), (want_fwd, want_bwd), "Ulysses bytes per rank (fwd, bwd)");
    eprintln!("ulysses  P={p}: fwd {fwd:>9.0} B  bwd {bwd:>9.0} B");

    // Ring (zigzag) and all-gather KV: at least the K/V of the other P-1 ranks must arrive.
    let kv_local = 2.0 * local * hkv as f64;
    for layout in [Layout::Zigzag] {
        let opts = cp::CpOpts::new(layout, true);
        let (fwd, bwd) = measure_attn(p, dims, &|q, k, v, g| cp::ring_attention(q, k, v, g, &opts))?;
        assert!(fwd >= (p as f64 - 1.0) * kv_local, "ring fwd moved only {fwd} B");
        eprintln!("ring     P={p}: fwd {fwd:>9.0} B  bwd {bwd:>9.0} B  ({layout})");
        let (fwd, bwd) = measure_attn(p, dims, &|q, k, v, g| cp::allgather_attention(q, k, v, g, &opts))?;
        assert!(fwd >= (p as f64 - 1.0) * kv_local, "all-gather KV fwd moved only {fwd} B");
        eprintln!("allgather P={p}: fwd {fwd:>9.0} B  bwd {bwd:>9.0} B  ({layout})");
    }
    let (fwd, bwd) = measure_attn(p, dims, &|q, k, v, g| {
        let groups = UspGroups::new(g, 2, 2)?;
        usp_attention(q, k, v, &groups, &UspOpts::new(true, scale))
    })?;
    eprintln!("usp  U=2 R=2: fwd {fwd:>9.0} B  bwd {bwd:>9.0} B");

    // Megatron: an MLP (column + row parallel) moves 4(P-1)/P·B·T·C·s per rank with SP
    // (all-gather + reduce-scatter, fwd and bwd) and without (two all-reduces).
    let (c, f) = (32usize, 64usize);
    let w1 = rand_t(1, "w1", &[f, c])?;
    let w2 = rand_t(2, "w2", &[c, f])?;
    for sp in [true, false] {
        let res = all_ok(run_ranks(p, |g: Group| {
            let (g, log) = Counting::wrap(g);
            let tp = Tp::new(g.clone(), sp);
            let (l1, l2) = (ColumnParallelLinear::from_full(&w1, None, &tp)?, RowParallelLinear::from_full(&w2, None, &tp)?);
            let tl = if sp { t / p } else { t };
            let x = Var::from_tensor(&rand_t(g.rank() as u64, "x", &[b, tl, c])?)?;
            l2.forward(&l1.forward(x.as_tensor())?.gelu()?)?.sum_all()?.backward()?;
            Ok(total(&log))
        }))?;
        let want = 4.0 * frac * (b * t * c) as f64 * s;
        assert_eq!(res[0], want, "MLP bytes per rank with SP = {sp}");
        eprintln!("megatron MLP P={p} SP={sp}: fwd+bwd {:>9.0} B", res[0]);
    }
    Ok(())
}

#[test]
fn fused_column_parts_match_separate_layers_with_one_gather() -> Result<()> {
    let (p, c) = (2usize, 16usize);
    let ws: Vec<Tensor> = (0..3).map(|i| rand_t(30 + i, "w", &[c * (i as usize + 1), c])).collect::<candle_core::Result<_>>()?;
    let bs: Vec<Tensor> = (0..3).map(|i| rand_t(40 + i, "b", &[c * (i as usize + 1)])).collect::<candle_core::Result<_>>()?;
    let x = rand_t(3, "x", &[2, 16, c])?;
    let res = all_ok(run_ranks(p, |g: Group| {
        let (g, log) = Counting::wrap(g);
        let tp = Tp::new(g.clone(), true);
        let xl = mp::scatter_to_sp_region(&x, &g, 1)?;
        let wr: Vec<&Tensor> = ws.iter().collect();
        let br: Vec<&Tensor> = bs.iter().collect();
        let fused = ColumnParallelLinear::from_full_parts(&wr, Some(&br), &tp)?;
        let xv = Var::from_tensor(&xl)?;
        let ys = fused.forward_parts(xv.as_tensor())?;
        let gathered = log.lock().unwrap().get("all_gather").copied().unwrap_or(0.0);
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        for (i, y) in ys.iter().enumerate() {
            loss = (loss + (y * (i as f64 + 1.0))?.sum_all()?)?;
        }
        let gf = loss.backward()?;
        let (dw_f, dx_f) = (grad(&gf, fused.weight().as_tensor(), "fused w")?, grad(&gf, xv.as_tensor(), "x")?);
        // separate layers on the same input
        let xs = Var::from_tensor(&xl)?;
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        let mut seps = vec![];
        let mut worst = 0f32;
        for i in 0..3 {
            let l = ColumnParallelLinear::from_full(&ws[i], Some(&bs[i]), &tp)?;
            let y = l.forward(xs.as_tensor())?;
            worst = worst.max((&y - &ys[i])?.abs()?.max_all()?.to_scalar::<f32>()?);
            loss = (loss + (y * (i as f64 + 1.0))?.sum_all()?)?;
            seps.push(l);
        }
        let gs = loss.backward()?;
        let dw_s = Tensor::cat(&seps.iter().map(|l| grad(&gs, l.weight().as_tensor(), "w")).collect::<candle_core::Result<Vec<_>>>()?, 0)?;
        let dx_s = grad(&gs, xs.as_tensor(), "x")?;
        let e_w = (dw_f - dw_s)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let e_x = (dx_f - dx_s)?.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok((worst, e_w, e_x, gathered, fused.part_sizes().to_vec()))
    }))?;
    let one_gather = ((p - 1) * 2 * (16 / p) * c * 4) as f64; // (P-1)·|x local| in bytes
    for (r, (ey, ew, ex, gathered, parts)) in res.into_iter().enumerate() {
        assert!(ey < 1e-5 && ew < 1e-5 && ex < 1e-5, "rank {r}: fused vs separate differ: out {ey}, dW {ew}, dx {ex}");
        assert_eq!(gathered, one_gather, "rank {r}: the fused layer must all-gather its input once");
        assert_eq!(parts, vec![c / p, 2 * c / p, 3 * c / p]);
    }
    Ok(())
}
