//! Unit tests of the linear layers (one rank, shapes, errors, `VarMap` ownership).

use crate::{shard_for_tp, ColumnParallelLinear, LinearConfig, RowParallelLinear, Tp};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_cp_comm::{run_ranks, Group};
use candle_nn::{VarBuilder, VarMap};

fn t(shape: &[usize], seed: f64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.37 + seed).sin()) as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.max_all()?.to_scalar::<f32>()
}

/// A layer `build` makes from a fresh `VarMap`, whose entries `shards` (name, this rank's
/// shard) then fill: the layer and the map (its `Var`s get the gradients).
fn with_shards<L>(build: impl FnOnce(VarBuilder) -> Result<L>, shards: &[(&str, Tensor)]) -> Result<(L, VarMap)> {
    let mut vm = VarMap::new();
    let layer = build(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
    for (name, shard) in shards {
        vm.set_one(*name, shard.clone())?;
    }
    Ok((layer, vm))
}

#[test]
fn one_rank_equals_candle_linear() -> Result<()> {
    let (w, b, x) = (t(&[6, 4], 0.1)?, t(&[6], 0.2)?, t(&[2, 3, 4], 0.3)?);
    let w2 = t(&[4, 6], 0.4)?;
    for r in run_ranks(1, |g: Group| {
        let mut worst = 0f32;
        for sp in [false, true] {
            let tp = Tp::new(g.clone(), sp);
            let col = ColumnParallelLinear::from_full(&w, Some(&b), &tp)?.forward(&x)?;
            let want = candle_nn::Linear::new(w.clone(), Some(b.clone())).forward(&x)?;
            worst = worst.max(max_abs(&col, &want)?);
            let row = RowParallelLinear::from_full(&w2, None, &tp)?.forward(&col)?;
            let want2 = candle_nn::Linear::new(w2.clone(), None).forward(&want)?;
            worst = worst.max(max_abs(&row, &want2)?);
        }
        Ok(worst)
    }) {
        assert!(r? < 1e-6);
    }
    Ok(())
}

/// The layers' shards are the caller's `VarMap` entries (local shapes, the names the layer
/// was built under), trainable: a fresh builder creates them, `set_one` fills them from a
/// full checkpoint, and `backward` reaches them.
#[test]
fn shards_live_in_the_callers_varmap() -> Result<()> {
    let (w1, b1, w2, b2) = (t(&[8, 4], 0.1)?, t(&[8], 0.2)?, t(&[4, 8], 0.3)?, t(&[4], 0.4)?);
    let x = t(&[2, 4, 4], 0.5)?;
    for r in run_ranks(2, |g: Group| {
        let tp = Tp::new(g.clone(), true);
        let mut vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let up = ColumnParallelLinear::new(vb.pp("up"), 4, 8, LinearConfig::new(true), &tp)?;
        let down = RowParallelLinear::new(vb.pp("down"), 8, 4, LinearConfig::new(true), &tp)?;
        let mut names: Vec<(String, Vec<usize>)> =
            vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.iter().map(|(k, v)| (k.clone(), v.dims().to_vec())).collect();
        names.sort();
        vm.set_one("up.weight", shard_for_tp(&w1, ColumnParallelLinear::WEIGHT_SHARD, &tp)?)?;
        vm.set_one("up.bias", shard_for_tp(&b1, ColumnParallelLinear::BIAS_SHARD, &tp)?)?;
        vm.set_one("down.weight", shard_for_tp(&w2, RowParallelLinear::WEIGHT_SHARD, &tp)?)?;
        vm.set_one("down.bias", shard_for_tp(&b2, RowParallelLinear::BIAS_SHARD, &tp)?)?;
        let xl = x.narrow(1, 2 * g.rank(), 2)?;
        let y = down.forward(&up.forward(&xl)?)?;
        let want = candle_nn::Linear::new(w2.clone(), Some(b2.clone()))
            .forward(&candle_nn::Linear::new(w1.clone(), Some(b1.clone())).forward(&x)?)?
            .narrow(1, 2 * g.rank(), 2)?;
        let grads = y.sum_all()?.backward()?;
        let with_grad = vm.all_vars().iter().filter(|v| grads.get(v.as_tensor()).is_some()).count();
        Ok((names, max_abs(&y, &want)?, with_grad))
    }) {
        let (names, e, with_grad) = r?;
        let want: Vec<(String, Vec<usize>)> =
            [("down.bias", vec![4]), ("down.weight", vec![4, 4]), ("up.bias", vec![4]), ("up.weight", vec![4, 4])]
                .into_iter()
                .map(|(n, s)| (n.to_string(), s))
                .collect();
        assert_eq!(names, want);
        assert!(e < 1e-5, "{e}");
        assert_eq!(with_grad, 4);
    }
    Ok(())
}

#[test]
fn indivisible_shards_and_bad_inputs_are_errors() -> Result<()> {
    for r in run_ranks(4, |g: Group| {
        let tp = Tp::new(g, true);
        let z = |s: (usize, usize)| Tensor::zeros(s, DType::F32, &Device::Cpu);
        let err = |r: Result<()>| r.err().map(|e| e.to_string()).unwrap_or_default();
        let e1 = err(ColumnParallelLinear::from_full(&z((6, 8))?, None, &tp).map(|_| ()));
        let e2 = err(RowParallelLinear::from_full(&z((8, 6))?, None, &tp).map(|_| ()));
        let col = ColumnParallelLinear::from_full(&z((8, 8))?, None, &tp)?;
        let e3 = err(col.forward(&Tensor::zeros((1, 2, 5), DType::F32, &Device::Cpu)?).map(|_| ()));
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let e4 = err(ColumnParallelLinear::new(vb.pp("a"), 8, 6, LinearConfig::new(false), &tp).map(|_| ()));
        let e5 = err(RowParallelLinear::new(vb.pp("b"), 6, 8, LinearConfig::new(false), &tp).map(|_| ()));
        Ok([e1, e2, e3, e4, e5])
    }) {
        let [e1, e2, e3, e4, e5] = r?;
        assert!(e1.contains("[6, 8]") && e1.contains("TP size 4"), "{e1}");
        assert!(e2.contains("[8, 6]") && e2.contains("TP size 4"), "{e2}");
        assert!(e3.contains("[1, 2, 5]") && e3.contains("8"), "{e3}");
        assert!(e4.contains("out_dim = 6") && e4.contains("TP size 4"), "{e4}");
        assert!(e5.contains("in_dim = 6") && e5.contains("TP size 4"), "{e5}");
    }
    Ok(())
}

/// An input with an empty dimension (fresh, or a view at a non-zero offset, on which some of
/// candle's CPU ops panic) is an error on every rank from every layer, never a panic.
#[test]
fn empty_inputs_are_errors() -> Result<()> {
    for r in run_ranks(2, |g: Group| {
        let tp = Tp::new(g, true);
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let col = ColumnParallelLinear::new(vb.pp("col"), 8, 8, LinearConfig::new(true), &tp)?;
        let row = RowParallelLinear::new(vb.pp("row"), 8, 8, LinearConfig::new(true), &tp)?;
        let rms = crate::RmsNorm::new(vb.pp("rms"), 8, 1e-5, &tp)?;
        let ln = crate::LayerNorm::new(vb.pp("ln"), 8, 1e-5, &tp)?;
        let fresh = Tensor::zeros((1, 0, 8), DType::F32, &Device::Cpu)?;
        let view = Tensor::zeros((1, 4, 8), DType::F32, &Device::Cpu)?.narrow(1, 2, 0)?;
        let row_in = Tensor::zeros((1, 4, 4), DType::F32, &Device::Cpu)?.narrow(1, 2, 0)?;
        let mut errs = vec![];
        for x in [&fresh, &view] {
            errs.push(col.forward(x).err().map(|e| e.to_string()));
            errs.push(rms.forward(x).err().map(|e| e.to_string()));
            errs.push(ln.forward(x).err().map(|e| e.to_string()));
        }
        errs.push(row.forward(&row_in).err().map(|e| e.to_string()));
        Ok(errs)
    }) {
        for e in r? {
            let e = e.expect("an empty input must be refused");
            assert!(e.contains("empty") && e.contains("[1, 0,"), "{e}");
        }
    }
    Ok(())
}

/// A fused layer with a Rows part (4 heads) and a replicated `RowBlocks(2)` part (2 heads)
/// over TP = 4, with and without SP: each rank's outputs are its slices of the dense
/// outputs, the input gradient equals the dense one, and the weight gradient of the
/// replicated part, summed over its copies, equals the dense gradient of its block.
#[test]
fn replicated_row_blocks_match_the_dense_layer() -> Result<()> {
    use crate::Shard;
    let (hd, in_dim, p, t_len) = (2usize, 4usize, 4usize, 8usize);
    let (wq, wk, x) = (t(&[4 * hd, in_dim], 0.1)?, t(&[2 * hd, in_dim], 0.2)?, t(&[1, t_len, in_dim], 0.3)?);
    // dense reference: loss = Σ q·cq + Σ k·ck with fixed weights cq, ck
    let (cq, ck) = (t(&[1, t_len, 4 * hd], 0.4)?, t(&[1, t_len, 2 * hd], 0.5)?);
    let xv = candle_core::Var::from_tensor(&x)?;
    let (wqv, wkv) = (candle_core::Var::from_tensor(&wq)?, candle_core::Var::from_tensor(&wk)?);
    let q = xv.as_tensor().broadcast_matmul(&wqv.as_tensor().t()?)?;
    let k = xv.as_tensor().broadcast_matmul(&wkv.as_tensor().t()?)?;
    let g = ((&q * &cq)?.sum_all()? + (&k * &ck)?.sum_all()?)?.backward()?;
    let (dx, dwk) = (g.get(xv.as_tensor()).cloned().unwrap_or(x.zeros_like()?), g.get(wkv.as_tensor()).cloned().unwrap_or(wk.zeros_like()?));
    for sp in [false, true] {
        for r in run_ranks(p, |grp: Group| {
            let tp = Tp::new(grp.clone(), sp);
            let r = grp.rank();
            let vm = VarMap::new();
            let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
            let kv = Shard::RowBlocks(2);
            let parts = [(vb.pp("q"), 4 * hd, Shard::Rows), (vb.pp("k"), 2 * hd, kv)];
            let layer = ColumnParallelLinear::new_fused_sharded(&parts, in_dim, LinearConfig::new(false), &tp)?;
            assert_eq!(layer.part_sizes(), vec![hd, hd]);
            let mut m = vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.clone();
            m.get_mut("q.weight").map(|v| v.set(&Shard::Rows.slice(&wq, p, r)?)).transpose()?;
            m.get_mut("k.weight").map(|v| v.set(&kv.slice(&wk, p, r)?)).transpose()?;
            let xl = if sp { x.narrow(1, r * t_len / p, t_len / p)? } else { x.clone() };
            let xl = candle_core::Var::from_tensor(&xl)?;
            let ys = layer.forward_parts(xl.as_tensor())?;
            let cql = cq.narrow(2, r * hd, hd)?;
            let blk = kv.slice_index(p, r);
            let ckl = (ck.narrow(2, blk * hd, hd)? / kv.copies(p) as f64)?;
            let e_q = max_abs(&ys[0], &q.narrow(2, r * hd, hd)?)?;
            let e_k = max_abs(&ys[1], &k.narrow(2, blk * hd, hd)?)?;
            // each copy carries 1/copies of its block's loss, so the copies sum to the dense loss
            let grads = ((&ys[0] * &cql)?.sum_all()? + (&ys[1] * &ckl)?.sum_all()?)?.backward()?;
            let gx = grads.get(xl.as_tensor()).cloned().unwrap_or(xl.zeros_like()?);
            // (without SP the input's copy_to_tp_region already all-reduced it in backward)
            let want_dx = if sp { dx.narrow(1, r * t_len / p, t_len / p)? } else { dx.clone() };
            let gk = grads.get(m["k.weight"].as_tensor()).cloned().unwrap_or(m["k.weight"].zeros_like()?);
            let gk = kv.gather(&gk, &grp)?;
            Ok((e_q, e_k, max_abs(&gx, &want_dx)?, gk))
        }) {
            let (e_q, e_k, e_x, gk) = r?;
            assert!(e_q < 1e-5 && e_k < 1e-5, "sp {sp}: outputs {e_q} {e_k}");
            assert!(e_x < 1e-5, "sp {sp}: input grad {e_x}");
            // gather keeps one copy per block: its share is half the block's gradient
            assert!(max_abs(&(gk * 2.0)?, &dwk)? < 1e-5, "sp {sp}: k weight grad");
        }
    }
    Ok(())
}

/// `RowParallelLinear::forward_residual` (one graph node), and `residual + forward_lean(x)`,
/// (and `forward_residual_scaled`, `residual + s·forward(x)`) give the values and the gradients (input, weight shard, residual, and a bias summed over TP
/// in the backward or left as each rank's share, [`GradSync`]) of `residual + forward(x)`, on 1
/// and 2 ranks with and without sequence parallelism; a residual of another shape is an error
/// naming both shapes.
#[test]
fn forward_residual_equals_forward_plus_residual() -> Result<()> {
    let (w, b) = (t(&[6, 8], 0.4)?, t(&[6], 0.5)?);
    use crate::GradSync;
    for (bias, sync) in [(false, GradSync::InBackward), (true, GradSync::InBackward), (true, GradSync::Deferred)] {
        for p in [1usize, 2] {
            for sp in [false, true] {
                for r in run_ranks(p, |g: Group| {
                    let tp = Tp::new(g.clone(), sp);
                    let mut shards = vec![("o.weight", shard_for_tp(&w, RowParallelLinear::WEIGHT_SHARD, &tp)?)];
                    if bias {
                        shards.push(("o.bias", b.clone()));
                    }
                    let (layer, vm) = with_shards(|vb| Ok(RowParallelLinear::new(vb.pp("o"), 8, 6, LinearConfig::new(bias), &tp)?.with_grad_sync(sync)), &shards)?;
                    let vars = vm.data().lock().map_err(|_| candle_core::Error::Msg("lock".into()))?.clone();
                    let (wv, bv) = (vars["o.weight"].clone(), vars.get("o.bias").cloned());
                    let x = candle_core::Var::from_tensor(&t(&[2, 4, 8 / p], 0.3 + g.rank() as f64)?)?;
                    let rows = if sp { 4 / p } else { 4 };
                    let res = candle_core::Var::from_tensor(&t(&[2, rows, 6], 0.7 + g.rank() as f64)?)?;
                    let dy = t(&[2, rows, 6], 0.9)?;
                    let mut outs = Vec::new();
                    for mode in 0..5 {
                        let y = match mode {
                            0 => (res.as_tensor() + layer.forward(x.as_tensor())?)?,
                            1 => layer.forward_residual(x.as_tensor(), res.as_tensor())?,
                            2 => (res.as_tensor() + layer.forward_lean(x.as_tensor())?)?,
                            // Granite's residual multiplier: residual + 0.3 · forward(x)
                            3 => (res.as_tensor() + layer.forward(x.as_tensor())?.affine(0.3, 0.0)?)?,
                            _ => layer.forward_residual_scaled(x.as_tensor(), res.as_tensor(), 0.3)?,
                        };
                        let gr = (&y * &dy)?.sum_all()?.backward()?;
                        let get = |v: &candle_core::Var| gr.get(v.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no grad".into()));
                        let db = match &bv {
                            Some(v) => get(v)?,
                            None => Tensor::zeros(1, DType::F32, &Device::Cpu)?,
                        };
                        outs.push([y, get(&x)?, get(&wv)?, get(&res)?, db]);
                    }
                    let mut worst = (0..5).map(|i| Ok(max_abs(&outs[0][i], &outs[1][i])?.max(max_abs(&outs[0][i], &outs[2][i])?))).collect::<Result<Vec<f32>>>()?;
                    worst.extend((0..5).map(|i| max_abs(&outs[3][i], &outs[4][i])).collect::<Result<Vec<f32>>>()?);
                    // (the scale binds: the scaled node's input gradient is not the plain one's)
                    worst.push(if max_abs(&outs[0][1], &outs[4][1])? > 1e-3 { 0.0 } else { 1.0 });
                    let bad = layer.forward_residual(x.as_tensor(), &t(&[2, rows, 5], 0.1)?).unwrap_err().to_string();
                    Ok((worst, bad))
                }) {
                    let (worst, bad) = r?;
                    assert!(worst.iter().all(|&e| e < 1e-5), "bias {bias} {sync:?} p {p} sp {sp}: {worst:?}");
                    assert!(bad.contains("[2, 4, 8]") || bad.contains(&format!("[2, 4, {}]", 8 / p)), "{bad}");
                    assert!(bad.contains(", 5]"), "{bad}");
                }
            }
        }
    }
    Ok(())
}

/// `forward_parts_regathered` (the graph keeps the input shard; the backward gathers it again)
/// gives the values and gradients (input, weights, biases) of `forward_parts`, with an output
/// map on one part, on 1 and 2 ranks with and without sequence parallelism; a wrong number
/// of maps is an error.
#[test]
fn regathered_parts_equal_the_gathered_ones() -> Result<()> {
    let (w1, b1, w2) = (t(&[6, 8], 0.1)?, t(&[6], 0.2)?, t(&[4, 8], 0.3)?);
    // a linear map and its transpose: y ↦ y·M over the last dim
    let m = t(&[6, 6], 0.8)?;
    let (mf, mb) = (m.clone(), m.t()?.contiguous()?);
    let post = crate::PartPost {
        fwd: std::sync::Arc::new(move |y: &Tensor| y.broadcast_matmul(&mf)),
        bwd: std::sync::Arc::new(move |g: &Tensor| g.broadcast_matmul(&mb)),
    };
    for p in [1usize, 2] {
        for sp in [false, true] {
            for r in run_ranks(p, |g: Group| {
                let tp = Tp::new(g.clone(), sp);
                let rows_of = |w: &Tensor, sh| shard_for_tp(&Tensor::cat(&vec![w; p], 0)?, sh, &tp);
                let (layer, vm) = with_shards(
                    |vb| ColumnParallelLinear::new_fused(&[(vb.pp("a"), 6 * p), (vb.pp("b"), 4 * p)], 8, LinearConfig::new(true), &tp),
                    &[
                        ("a.weight", rows_of(&w1, ColumnParallelLinear::WEIGHT_SHARD)?),
                        ("a.bias", rows_of(&b1, ColumnParallelLinear::BIAS_SHARD)?),
                        ("b.weight", rows_of(&w2, ColumnParallelLinear::WEIGHT_SHARD)?),
                    ],
                )?;
                let rows = if sp { 4 / p } else { 4 };
                let x = candle_core::Var::from_tensor(&t(&[2, rows, 8], 0.3 + g.rank() as f64)?)?;
                let (d0, d1) = (t(&[2, 4, 6], 0.5)?, t(&[2, 4, 4], 0.6)?);
                let vars = vm.all_vars();
                let mut outs = Vec::new();
                for regather in [true, false] {
                    let ys = if regather {
                        layer.forward_parts_regathered(x.as_tensor(), &[Some(post.clone()), None])?
                    } else {
                        let ys = layer.forward_parts(x.as_tensor())?;
                        vec![(post.fwd)(&ys[0])?, ys[1].clone()]
                    };
                    let loss = ((&ys[0] * &d0)?.sum_all()? + (&ys[1] * &d1)?.sum_all()?)?;
                    let gr = loss.backward()?;
                    let mut v = vec![ys[0].clone(), ys[1].clone(), gr.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no x grad".into()))?];
                    for var in &vars {
                        v.push(gr.get(var.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no param grad".into()))?);
                    }
                    outs.push(v);
                }
                let worst = (0..outs[0].len()).map(|i| max_abs(&outs[0][i], &outs[1][i])).collect::<Result<Vec<f32>>>()?;
                let bad = layer.forward_parts_regathered(x.as_tensor(), &[None]).unwrap_err().to_string();
                Ok((worst, bad))
            }) {
                let (worst, bad) = r?;
                assert_eq!(worst.len(), 7);
                assert!(worst.iter().all(|&e| e < 1e-4), "p {p} sp {sp}: {worst:?}");
                assert!(bad.contains("1 output maps for 2 parts"), "{bad}");
            }
        }
    }
    Ok(())
}

/// A part whose output does not reach the loss adds nothing to the input's gradient (which is
/// still formed, and equals the plain graph's), and a second backward over the same graph
/// gives the same gradients: on 2 ranks with SP.
#[test]
fn regathered_parts_with_an_unused_part_and_two_backwards() -> Result<()> {
    let (w1, w2) = (t(&[6, 8], 0.1)?, t(&[4, 8], 0.3)?);
    for r in run_ranks(2, |g: Group| {
        let tp = Tp::new(g.clone(), true);
        let (fused, _vm) = with_shards(
            |vb| ColumnParallelLinear::new_fused(&[(vb.pp("a"), 6), (vb.pp("b"), 4)], 8, LinearConfig::new(false), &tp),
            &[
                ("a.weight", shard_for_tp(&w1, ColumnParallelLinear::WEIGHT_SHARD, &tp)?),
                ("b.weight", shard_for_tp(&w2, ColumnParallelLinear::WEIGHT_SHARD, &tp)?),
            ],
        )?;
        let x = candle_core::Var::from_tensor(&t(&[2, 2, 8], 0.3 + g.rank() as f64)?)?;
        let d0 = t(&[2, 4, 3], 0.5)?;
        let grad_x = |regather: bool| -> Result<(Tensor, Tensor)> {
            let ys = if regather { fused.forward_parts_regathered(x.as_tensor(), &[])? } else { fused.forward_parts(x.as_tensor())? };
            let loss = (&ys[0] * &d0)?.sum_all()?; // part 1 unused
            let a = loss.backward()?.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no x grad".into()))?;
            let b = loss.backward()?.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no x grad (2nd)".into()))?;
            Ok((a, b))
        };
        let ((r1, r2), (p1, _)) = (grad_x(true)?, grad_x(false)?);
        Ok((max_abs(&r1, &p1)?, max_abs(&r2, &r1)?))
    }) {
        let (vs_plain, second) = r?;
        assert!(vs_plain < 1e-5, "{vs_plain}");
        assert_eq!(second, 0.0);
    }
    Ok(())
}
