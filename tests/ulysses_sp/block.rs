//! SP + TP transformer block against the single-device block (layers built from a
//! `VarBuilder` over the rank's own `VarMap` of shards, gradients read from that `VarMap`,
//! with the replicated gradients summed in backward or by the caller); dropout regions;
//! fused column-parallel parts.

use crate::{all_ok, grad, max_abs, rand_t, rel, Counting};
use anyhow::Result;
use candle_core::{DType, Device, Module, Shape, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_nn::{
    shard_for_tp, ColumnParallelLinear, Dropout, GradSync, LayerNorm, LinearConfig, Region, RmsNorm, RngStreams,
    RowParallelLinear, Shard, Tp,
};
use candle_nn::{VarBuilder, VarMap};
use candle_cp_ops::attention::{attention, attention_slow, Mask};
use candle_cp_ops::mappings as mp;
use std::collections::HashMap;

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
    /// Layers taking their local shards from `vb` (created in a fresh `VarMap`).
    fn new(vb: VarBuilder, tp: &Tp, sync: GradSync) -> candle_core::Result<Self> {
        let a = vb.pp("attn");
        let (b, nb) = (LinearConfig::new(true), LinearConfig::new(false));
        Ok(Self {
            norm1: RmsNorm::new(vb.pp("norm1"), HID, EPS, tp)?.with_grad_sync(sync),
            q: ColumnParallelLinear::new(a.pp("q"), HID, HID, b, tp)?,
            k: ColumnParallelLinear::new(a.pp("k"), HID, HID, nb, tp)?,
            v: ColumnParallelLinear::new(a.pp("v"), HID, HID, b, tp)?,
            o: RowParallelLinear::new(a.pp("o"), HID, HID, b, tp)?.with_grad_sync(sync),
            norm2: LayerNorm::new(vb.pp("norm2"), HID, EPS, tp)?.with_grad_sync(sync),
            up: ColumnParallelLinear::new(vb.pp("mlp.up"), HID, FFN, b, tp)?,
            down: RowParallelLinear::new(vb.pp("mlp.down"), FFN, HID, b, tp)?.with_grad_sync(sync),
            tp: tp.clone(),
        })
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

/// This rank's `VarMap`: the layers create their shards (local shapes), then each is set
/// from the full tensor sliced as the test's own table [`shard_dim`] says (`set_one` fails on
/// a shape mismatch, and no var may be left unset or be extra).
fn rank_varmap(params: &HashMap<String, Tensor>, tp: &Tp, sync: GradSync) -> candle_core::Result<(VarMap, TpBlock)> {
    let mut vm = VarMap::new();
    let blk = TpBlock::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), tp, sync)?;
    let mut created: Vec<String> = vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.keys().cloned().collect();
    let mut names: Vec<String> = params.keys().cloned().collect();
    created.sort();
    names.sort();
    if created != names {
        candle_core::bail!("layers created vars {created:?}, the block has {names:?}")
    }
    for (n, full) in params {
        let shard = match shard_dim(n) {
            Some(0) => Shard::Rows,
            Some(_) => Shard::Cols,
            None => Shard::Replicated,
        };
        vm.set_one(n, shard_for_tp(full, shard, tp)?)?;
    }
    Ok((vm, blk))
}

fn check_block(tp_size: usize, sp: bool, sync: GradSync) -> Result<()> {
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
        let (vm, blk) = rank_varmap(&params, &tp, sync)?;
        let local = |t: &Tensor| if sp { mp::scatter_to_sp_region(t, &g, 1) } else { Ok(t.clone()) };
        let xl = Var::from_tensor(&local(&x)?)?;
        let y = blk.forward(xl.as_tensor(), &rng)?;
        let grads = (&y * local(&up)?)?.sum_all()?.backward()?;
        let mut named = vec![("x".to_string(), grad(&grads, xl.as_tensor(), "x")?)];
        let mut vs: Vec<(String, Var)> =
            vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        vs.sort_by(|a, b| a.0.cmp(&b.0));
        for (n, v) in vs {
            let mut gr = grad(&grads, v.as_tensor(), &n)?;
            if sp && sync == GradSync::Deferred && shard_dim(&n).is_none() {
                gr = g.all_reduce(&gr)?; // the caller's share of the work
            }
            named.push((n, gr));
        }
        Ok((y, named))
    }))?;

    let tag = format!("TP = {tp_size}, SP = {sp}, {sync:?}");
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
    check_block(2, true, GradSync::InBackward)?;
    check_block(2, true, GradSync::Deferred)?;
    check_block(2, false, GradSync::InBackward)
}

#[test]
fn sp_tp_block_matches_single_device_tp4() -> Result<()> {
    check_block(4, true, GradSync::InBackward)?;
    check_block(4, true, GradSync::Deferred)?;
    check_block(4, false, GradSync::Deferred)
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

#[test]
fn fused_column_parts_match_separate_layers_with_one_gather() -> Result<()> {
    let (p, c) = (2usize, 16usize);
    let outs: Vec<usize> = (1..=3).map(|i| c * i).collect();
    let ws: Vec<Tensor> = (0..3).map(|i| rand_t(30 + i as u64, "w", &[outs[i], c])).collect::<candle_core::Result<_>>()?;
    let bs: Vec<Tensor> = (0..3).map(|i| rand_t(40 + i as u64, "b", &[outs[i]])).collect::<candle_core::Result<_>>()?;
    let x = rand_t(3, "x", &[2, 16, c])?;
    let res = all_ok(run_ranks(p, |g: Group| {
        let (g, log) = Counting::wrap(g);
        let tp = Tp::new(g.clone(), true);
        let xl = mp::scatter_to_sp_region(&x, &g, 1)?;
        // one VarMap per model; the fused layer's parts keep their own names
        let mk = |fused: bool| -> candle_core::Result<(VarMap, Vec<ColumnParallelLinear>)> {
            let mut vm = VarMap::new();
            let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
            let parts: Vec<(VarBuilder, usize)> = (0..3).map(|i| (vb.pp(format!("p{i}")), outs[i])).collect();
            let layers = if fused {
                vec![ColumnParallelLinear::new_fused(&parts, c, LinearConfig::new(true), &tp)?]
            } else {
                parts.into_iter().map(|(vb, o)| ColumnParallelLinear::new(vb, c, o, LinearConfig::new(true), &tp)).collect::<candle_core::Result<_>>()?
            };
            for i in 0..3 {
                vm.set_one(format!("p{i}.weight"), shard_for_tp(&ws[i], ColumnParallelLinear::WEIGHT_SHARD, &tp)?)?;
                vm.set_one(format!("p{i}.bias"), shard_for_tp(&bs[i], ColumnParallelLinear::BIAS_SHARD, &tp)?)?;
            }
            Ok((vm, layers))
        };
        let weighted_sum = |ys: &[Tensor]| -> candle_core::Result<Tensor> {
            let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
            for (i, y) in ys.iter().enumerate() {
                loss = (loss + (y * (i as f64 + 1.0))?.sum_all()?)?;
            }
            Ok(loss)
        };
        let (vm_f, fused) = mk(true)?;
        let xv = Var::from_tensor(&xl)?;
        let ys = fused[0].forward_parts(xv.as_tensor())?;
        let gathered = log.lock().unwrap().get("all_gather").copied().unwrap_or(0.0);
        let gf = weighted_sum(&ys)?.backward()?;
        let (vm_s, seps) = mk(false)?;
        let xs = Var::from_tensor(&xl)?;
        let ys_s = seps.iter().map(|l| l.forward(xs.as_tensor())).collect::<candle_core::Result<Vec<_>>>()?;
        let gs = weighted_sum(&ys_s)?.backward()?;
        let mut worst = 0f32;
        for (a, b) in ys.iter().zip(&ys_s) {
            worst = worst.max((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?);
        }
        let (mut e_w, mut n_w) = (0f32, 0);
        let (df, ds) = (vm_f.data().lock().unwrap().clone(), vm_s.data().lock().unwrap().clone());
        for (n, v) in &df {
            let a = grad(&gf, v.as_tensor(), n)?;
            let b = grad(&gs, ds[n].as_tensor(), n)?;
            e_w = e_w.max((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?);
            n_w += 1;
        }
        let e_x = (grad(&gf, xv.as_tensor(), "x")? - grad(&gs, xs.as_tensor(), "x")?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok((worst, e_w, n_w, e_x, gathered, fused[0].part_sizes()))
    }))?;
    let one_gather = ((p - 1) * 2 * (16 / p) * c * 4) as f64; // (P-1)·|x local| in bytes
    for (r, (ey, ew, nw, ex, gathered, parts)) in res.into_iter().enumerate() {
        assert!(ey < 1e-5 && ew < 1e-5 && ex < 1e-5, "rank {r}: fused vs separate differ: out {ey}, dW {ew}, dx {ex}");
        assert_eq!(nw, 6, "rank {r}: the fused layer's VarMap must hold 3 weights and 3 biases");
        assert_eq!(gathered, one_gather, "rank {r}: the fused layer must all-gather its input once");
        assert_eq!(parts, vec![c / p, 2 * c / p, 3 * c / p]);
    }
    Ok(())
}
