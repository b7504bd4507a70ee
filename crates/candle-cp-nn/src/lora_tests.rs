//! LoRA adapters on the TP linears against the dense computation on full tensors.

use super::*;
use crate::{ColumnParallelLinear, LinearConfig, PartPost, RowParallelLinear, Shard};
use candle_core::{DType, Device, Module, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_nn::VarMap;
use std::collections::HashMap;
use std::sync::Arc;

fn t(shape: &[usize], seed: f64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.37 + seed).sin() * 0.5) as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// The full tensors of the test: a fused q (4 heads) / k (2 heads) column layer, q adapted,
/// k adapted, and a row layer `o` over q's features, adapted; `D = 2`, `in = 4`, `r = 3`.
struct Full {
    x: Tensor,
    w: HashMap<&'static str, Tensor>,
    /// Loss weights of o `[1, T, 4]` and k `[1, T, 4]`.
    co: Tensor,
    ck: Tensor,
}

const T: usize = 8;
const SCALE: f64 = 0.75;

fn full() -> Result<Full> {
    let mut w = HashMap::new();
    for (i, (name, shape)) in [("q", [8, 4]), ("k", [4, 4]), ("o", [4, 8]), ("qa", [3, 4]), ("qb", [8, 3]), ("ka", [3, 4]), ("kb", [4, 3]), ("oa", [3, 8]), ("ob", [4, 3])].into_iter().enumerate() {
        w.insert(name, t(&shape, 0.1 * i as f64 + 0.05)?);
    }
    // DoRA's magnitudes (positive, about the rows' norms)
    for (i, (name, n)) in [("qm", 8), ("km", 4), ("om", 4)].into_iter().enumerate() {
        w.insert(name, (t(&[n], 0.3 * i as f64 + 0.7)?.abs()? + 0.6)?);
    }
    Ok(Full { x: t(&[1, T, 4], 1.3)?, w, co: t(&[1, T, 4], 2.1)?, ck: t(&[1, T, 4], 2.7)? })
}

/// The output map of the test's q part (a linear map, as RoPE): `y ↦ 2y`.
fn double() -> PartPost {
    PartPost { fwd: Arc::new(|y: &Tensor| y * 2.0), bwd: Arc::new(|g: &Tensor| g * 2.0) }
}

/// The dropout of the split test's adapters: probability, the seed of the streams, the step.
const DROP: (f64, u64, u64) = (0.4, 9, 3);

/// The dropout key of the split test: one batch row, tokens `0..T`.
fn drop_key() -> crate::DropoutKey {
    crate::DropoutKey { streams: crate::RngStreams::new(DROP.1), step: DROP.2, rows: Arc::new((0..T as u64).collect()), batch: 1, tc: T }
}

/// `x` `[1, T, f]` through adapter `name`'s dropout, from the whole-tensor formula: keep where
/// the stream's value of element `t·f + j` is at least `p`, scaled by `1/(1-p)`.
fn dense_drop(x: &Tensor, name: &str) -> Result<Tensor> {
    let f = x.dim(2)?;
    let u = crate::RngStreams::new(DROP.1).uniform(name, DROP.2, &candle_core::Shape::from((T, f)), &crate::Region::Replicated, &Device::Cpu)?;
    x.broadcast_mul(&(u.ge(DROP.0 as f32)?.to_dtype(DType::F32)? * (1.0 / (1.0 - DROP.0)))?.unsqueeze(0)?)
}

/// Dense reference: `q = map(x·(Wq + s·Bq·Aq)ᵀ)`, `k = x·(Wk + s·Bk·Ak)ᵀ`, `o = q·(Wo + s·Bo·Ao)ᵀ`
/// (the adapters as their own products; with `drop`, each adapter's input through its dropout,
/// [`dense_drop`]), loss `Σ o·co + Σ k·ck`: the loss's gradients by name (`x` and every
/// weight), and o, k.
/// With `dora`, each layer's weight is DoRA's `W' = m / ‖W + s·B·A‖ ⊙ (W + s·B·A)` (the norm a
/// constant; `m` the tensors `qm`, `km`, `om`) in place of the adapter's update; with `drop`
/// too, PEFT's `W·x + (W' - W)·drop(x)`.
fn dense(f: &Full, map: bool, drop: bool, dora: bool) -> Result<(HashMap<String, Tensor>, Tensor, Tensor)> {
    let vars: HashMap<&str, Var> = f.w.iter().map(|(k, v)| Ok((*k, Var::from_tensor(v)?))).collect::<Result<_>>()?;
    let xv = Var::from_tensor(&f.x)?;
    let v = |n: &str| vars[n].as_tensor().clone();
    let lin = |x: &Tensor, w: &str, a: &str, b: &str| -> Result<Tensor> {
        if dora {
            let vw = (v(w) + (v(b).matmul(&v(a))? * SCALE)?)?;
            let norm = vw.detach().sqr()?.sum_keepdim(1)?.sqrt()?;
            let wd = vw.broadcast_mul(&v(&format!("{w}m")).unsqueeze(1)?.broadcast_div(&norm)?)?;
            if drop {
                // PEFT's DoRA with dropout: W·x + (g - 1) ⊙ W·x̃ + g ⊙ s·B·A·x̃
                return x.broadcast_matmul(&v(w).t()?)? + dense_drop(x, w)?.broadcast_matmul(&(wd - v(w))?.t()?)?;
            }
            return x.broadcast_matmul(&wd.t()?);
        }
        let xa = if drop { dense_drop(x, w)? } else { x.clone() };
        x.broadcast_matmul(&v(w).t()?)? + (xa.broadcast_matmul(&v(a).t()?)?.broadcast_matmul(&v(b).t()?)? * SCALE)?
    };
    let mut q = lin(xv.as_tensor(), "q", "qa", "qb")?;
    if map {
        q = (q * 2.0)?;
    }
    let k = lin(xv.as_tensor(), "k", "ka", "kb")?;
    let o = lin(&q, "o", "oa", "ob")?;
    let loss = ((&o * &f.co)?.sum_all()? + (&k * &f.ck)?.sum_all()?)?;
    let g = loss.backward()?;
    let mut out: HashMap<String, Tensor> = vars.iter().map(|(n, var)| Ok((n.to_string(), g.get(var.as_tensor()).cloned().unwrap_or(var.zeros_like()?)))).collect::<Result<_>>()?;
    out.insert("x".into(), g.get(xv.as_tensor()).cloned().unwrap_or(f.x.zeros_like()?));
    Ok((out, o, k))
}

/// TP 2 and 4 (k's 2 heads replicated over 2 ranks each at TP 4), SP on and off; the column
/// layer through `forward_parts` and `forward_parts_regathered` (q with an output map), the
/// row layer through `forward`, `forward_lean` and `forward_residual`: each rank's outputs are
/// its slices of the dense ones; the input gradient equals the dense one; every split factor's
/// gradient is the dense gradient's slice (k's `B` summed over its copies), every replicated
/// factor's (q's and k's `A`, o's `B`) the dense gradient, summed over TP under SP. The
/// weights' gradients too (the adapters leave them right).
#[test]
fn adapters_match_the_dense_layers_on_every_split() -> Result<()> {
    splits(false, false)
}

/// DoRA ([`crate::dora`]) on the same layers, splits and paths: outputs, the input's gradient,
/// the factors' and the magnitudes' gradients (q's and k's `m` split as their rows, o's
/// replicated and summed over TP under SP; the norms of o's rows all-reduced over TP) equal the
/// dense DoRA layers'; a magnitude of the wrong size is refused by name.
#[test]
fn dora_matches_the_dense_layers_on_every_split() -> Result<()> {
    splits(false, true)?;
    let f = full()?;
    let e = Lora::new(f.w["qa"].clone(), f.w["qb"].clone(), SCALE)?.with_dora(f.w["km"].clone()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("[4]") && e.contains("[8, 3]"), "{e}");
    Ok(())
}

/// DoRA training with dropout 0.4 on every adapter's input: PEFT's `W·x + (W' - W)·drop(x)`
/// (the base weight run a second time on the dropped input) on every split and path, outputs
/// and gradients (the base weights' too) as the dense layers'.
#[test]
fn dora_with_dropout_matches_the_dense_layers_on_every_split() -> Result<()> {
    splits(true, true)
}

/// The same with dropout 0.4 on every adapter's input (`Lora::with_dropout`): each rank's masks
/// are its rows' and features' of the whole-tensor masks ([`dense_drop`]), so outputs and
/// gradients are the dense ones on every split and path; without a key no dropout happens.
#[test]
fn adapter_dropout_matches_the_dense_masks_on_every_split() -> Result<()> {
    splits(true, false)?;
    // no key set: the adapter's input as it is
    let f = full()?;
    let rows = crate::DropoutRows::default();
    let tp1 = run_ranks(1, |g: Group| {
        let tp = Tp::new(g, false);
        let l = Lora::new(f.w["qa"].clone(), f.w["qb"].clone(), SCALE)?.with_dropout(0.4, "q", &rows)?;
        let plain = Lora::new(f.w["qa"].clone(), f.w["qb"].clone(), SCALE)?;
        max_abs(&column_delta(&f.x, &l, &tp)?, &column_delta(&f.x, &plain, &tp)?)
    });
    for e in tp1 {
        assert_eq!(e?, 0.0, "without a key, no dropout");
    }
    assert!(Lora::new(f.w["qa"].clone(), f.w["qb"].clone(), SCALE)?.with_dropout(1.0, "q", &rows).is_err());
    Ok(())
}

/// [`adapters_match_the_dense_layers_on_every_split`], the adapters with dropout or not, as
/// DoRA or not.
fn splits(drop: bool, dora: bool) -> Result<()> {
    let f = full()?;
    let rows = crate::DropoutRows::default();
    rows.set(drop.then(drop_key))?;
    for (p, sp, col_path, row_path) in [(2, false, 0, 0), (2, true, 1, 1), (4, false, 1, 2), (4, true, 0, 2), (4, true, 1, 0), (2, false, 1, 1)] {
        let map = col_path == 1;
        let (want, o, k) = dense(&f, map, drop, dora)?;
        let what = format!("tp {p} sp {sp} column path {col_path} row path {row_path} dropout {drop} dora {dora}");
        // (with dropout: stream `name`, the dense reference's)
        let ad = |l: Lora, name: &str, m: Tensor| -> Result<Lora> {
            let l = if drop { l.with_dropout(DROP.0, name, &rows)? } else { l };
            if dora {
                l.with_dora(m)
            } else {
                Ok(l)
            }
        };
        for r in run_ranks(p, |g: Group| {
            let tp = Tp::new(g.clone(), sp);
            let r = g.rank();
            let kv = if p > 2 { Shard::RowBlocks(2) } else { Shard::Rows };
            // (name, shard) of every tensor
            let mut shards: Vec<(&str, Shard)> =
                vec![("q", Shard::Rows), ("k", kv), ("o", Shard::Cols), ("qa", Shard::Replicated), ("qb", Shard::Rows), ("ka", Shard::Replicated), ("kb", kv), ("oa", Shard::Cols), ("ob", Shard::Replicated)];
            if dora {
                shards.extend([("qm", Shard::Rows), ("km", kv), ("om", Shard::Replicated)]);
            }
            let mut vars: HashMap<&str, Var> = shards.iter().map(|(n, s)| Ok((*n, Var::from_tensor(&s.slice(&f.w[n], p, r)?)?))).collect::<Result<_>>()?;
            // (the magnitudes when not DoRA: unused)
            let v = |n: &str| vars.get(n).map_or_else(|| f.w[n].clone(), |x| x.as_tensor().clone());
            let vm = VarMap::new();
            let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
            let col = ColumnParallelLinear::new_fused_sharded(&[(vb.pp("q"), 8, Shard::Rows), (vb.pp("k"), 4, kv)], 4, LinearConfig::new(false), &tp)?;
            {
                let m = vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?;
                m["q.weight"].set(&v("q"))?;
                m["k.weight"].set(&v("k"))?;
            }
            let col = col.with_lora(vec![Some(ad(Lora::new(v("qa"), v("qb"), SCALE)?, "q", v("qm"))?), Some(ad(Lora::new(v("ka"), v("kb"), SCALE)?, "k", v("km"))?)])?;
            let row = RowParallelLinear::new(vb.pp("o"), 8, 4, LinearConfig::new(false), &tp)?;
            vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?["o.weight"].set(&v("o"))?;
            let row = row.with_lora(ad(Lora::new(v("oa"), v("ob"), SCALE)?, "o", v("om"))?)?;
            // the weights' gradients land on the layers' own variables
            for n in ["q", "k", "o"] {
                let var = vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?[&format!("{n}.weight")].clone();
                vars.insert(n, var);
            }
            let xl = Var::from_tensor(&if sp { f.x.narrow(1, r * T / p, T / p)? } else { f.x.clone() })?;
            let ys = if col_path == 0 { col.forward_parts(xl.as_tensor())? } else { col.forward_parts_regathered(xl.as_tensor(), &[Some(double()), None])? };
            let ol = match row_path {
                0 => row.forward(&ys[0])?,
                1 => row.forward_lean(&ys[0])?,
                _ => row.forward_residual(&ys[0], &Tensor::zeros(if sp { (1, T / p, 4) } else { (1, T, 4) }, DType::F32, &Device::Cpu)?)?,
            };
            let rows = |x: &Tensor| if sp { x.narrow(1, r * T / p, T / p) } else { Ok(x.clone()) };
            let (blk, copies) = (kv.slice_index(p, r), kv.copies(p));
            let kd = 4 / p * copies;
            let (e_o, e_k) = (max_abs(&ol, &rows(&o)?)?, max_abs(&ys[1], &k.narrow(2, blk * kd, kd)?)?);
            // o: each rank's rows (SP), or the whole output on every rank (counted once: a TP
            // rank's loss is the loss); k: this rank's block, 1/copies of it per copy
            let ckl = (f.ck.narrow(2, blk * kd, kd)? / copies as f64)?;
            let loss = ((&ol * &rows(&f.co)?)?.sum_all()? + (&ys[1] * &ckl)?.sum_all()?)?;
            let gr = loss.backward()?;
            let grad = |var: &Var| -> Result<Tensor> { gr.get(var.as_tensor()).cloned().map_or_else(|| var.zeros_like(), Ok) };
            let mut errs = vec![("o".to_string(), e_o), ("k".to_string(), e_k), ("x".to_string(), max_abs(&grad(&xl)?, &rows(&want["x"])?)?)];
            for (n, s) in shards.iter().copied() {
                let mut gv = grad(&vars[n])?;
                // replicated: the sum over TP under SP (each rank's rows), else already whole;
                // replicated blocks: the sum over their copies
                if s == Shard::Replicated && sp && p > 1 {
                    gv = g.all_reduce(&gv)?;
                }
                let gathered = match s {
                    Shard::Replicated => gv,
                    // (one copy per block kept, carrying 1/copies of the block's gradient)
                    _ => (s.gather(&gv, &g)? * s.copies(p) as f64)?,
                };
                errs.push((format!("d{n}"), max_abs(&gathered, &want[n])?));
            }
            Ok(errs)
        }) {
            for (n, e) in r? {
                assert!(e < 2e-5, "{what}: {n} off by {e}");
            }
        }
    }
    Ok(())
}

/// Mismatched factors are refused by name: another rank in A and B, factors that do not fit
/// the layer's shard, one adapter too many.
#[test]
fn bad_adapters_are_refused() -> Result<()> {
    let z = |s: (usize, usize)| Tensor::zeros(s, DType::F32, &Device::Cpu);
    let e = Lora::new(z((3, 4))?, z((8, 2))?, 1.0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("[3, 4]") && e.contains("[8, 2]"), "{e}");
    for r in run_ranks(2, |g: Group| {
        let tp = Tp::new(g, false);
        let col = ColumnParallelLinear::from_full(&z((8, 4))?, None, &tp)?;
        let e1 = col.clone().with_lora(vec![Some(Lora::new(z((3, 4))?, z((8, 3))?, 1.0)?)]).err().map(|e| e.to_string()).unwrap_or_default();
        let e2 = col.with_lora(vec![None, None]).err().map(|e| e.to_string()).unwrap_or_default();
        let row = RowParallelLinear::from_full(&z((4, 8))?, None, &tp)?;
        let e3 = row.with_lora(Lora::new(z((3, 8))?, z((4, 3))?, 1.0)?).err().map(|e| e.to_string()).unwrap_or_default();
        Ok([e1, e2, e3])
    }) {
        let [e1, e2, e3] = r?;
        assert!(e1.contains("[8, 3]") && e1.contains("[4, 4]"), "{e1}");
        assert!(e2.contains("2 LoRA adapters for 1 parts"), "{e2}");
        assert!(e3.contains("[3, 8]") && e3.contains("[4, 4]"), "{e3}");
    }
    assert!(LoraConfig::new(0, 16.0).is_err());
    assert_eq!(LoraConfig::new(8, 16.0)?.scale(), 2.0);
    assert_eq!(LoraConfig::new(16, 16.0)?.with_rslora(true).scale(), 4.0, "rsLoRA: alpha / √r");
    Ok(())
}
