//! SP + TP transformer block against the single-device block; dropout regions; fused
//! column-parallel parts.

use crate::{all_ok, grad, max_abs, rand_t, rel, Counting};
use anyhow::Result;
use candle_core::{DType, Device, Module, Shape, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_nn::{ColumnParallelLinear, Dropout, LayerNorm, Region, RmsNorm, RngStreams, RowParallelLinear, Tp};
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
