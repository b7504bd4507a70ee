//! Tests of [`super::AdamW`] (hand-computed update, state round trip, master copies, ZeRO-1).
use super::*;

/// A bf16 weight at 1.0 under updates of 1e-4 (far below bf16's 2^-8 spacing there): with
/// the f32 master copy the weight moves once the updates add up; rounding every step
/// (the old behaviour, no master) would leave it at 1.0 for ever. Save / load keeps the
/// master copy, so a resumed run continues identically.
#[test]
fn bf16_updates_accumulate_in_the_master_copy() -> Result<()> {
    let mk = || -> Result<AdamW> {
        let w = Var::from_tensor(&Tensor::ones(4, DType::BF16, &Device::Cpu)?)?;
        AdamW::new(vec![("w".to_string(), w)], AdamWConfig::default())
    };
    let grads: HashMap<String, Tensor> = [("w".to_string(), Tensor::ones(4, DType::BF16, &Device::Cpu)?)].into();
    let value = |o: &AdamW| -> Result<f32> { o.slots[0].var.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>().map(|v| v[0]) };
    let mut a = mk()?;
    for _ in 0..10 {
        a.step(&grads, 1e-4, 1.0)?;
    }
    assert_eq!(value(&a)?, 1.0, "0.999 still rounds to 1.0 in bf16");
    let master = a.slots[0].master.as_ref().expect("bf16 gets a master copy").to_vec1::<f32>()?[0];
    assert!((master - 0.999).abs() < 1e-5, "master {master}");
    let dir = std::env::temp_dir().join(format!("cp-adamw-master-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("opt.safetensors");
    a.save(&file)?;
    let mut b = mk()?;
    b.load(&file)?;
    b.slots[0].var.set(a.slots[0].var.as_tensor())?;
    for _ in 0..20 {
        a.step(&grads, 1e-4, 1.0)?;
        b.step(&grads, 1e-4, 1.0)?;
    }
    assert_eq!(value(&a)?, 0.99609375, "after 30 updates of 1e-4 the weight moved one bf16 step");
    assert_eq!(value(&b)?, value(&a)?, "resumed from the saved state: identical");
    let _ = std::fs::remove_dir_all(&dir);
    // f32 parameters need no copy
    let w = Var::from_tensor(&Tensor::ones(2, DType::F32, &Device::Cpu)?)?;
    assert!(AdamW::new(vec![("x".to_string(), w)], AdamWConfig::default())?.slots[0].master.is_none());
    Ok(())
}

/// One AdamW step computed by hand in f64 for a 2-element parameter.
#[test]
fn matches_hand_computed_update() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::new(&[[1.0f32, -2.0]], &dev)?)?;
    let n = Var::from_tensor(&Tensor::new(&[0.5f32], &dev)?)?;
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(vec![("w".into(), w.clone()), ("n".into(), n.clone())], cfg)?;
    let mut g = HashMap::new();
    g.insert("w".to_string(), Tensor::new(&[[0.5f32, 0.25]], &dev)?);
    g.insert("n".to_string(), Tensor::new(&[2.0f32], &dev)?);
    let (lr, scale) = (0.01, 0.5);
    let mut want_w = [1.0f64, -2.0];
    let mut m = [0.0f64; 2];
    let mut v = [0.0f64; 2];
    for t in 1..=2 {
        opt.step(&g, lr, scale)?;
        for i in 0..2 {
            let gi = [0.5, 0.25][i] * scale;
            m[i] = 0.9 * m[i] + 0.1 * gi;
            v[i] = 0.99 * v[i] + 0.01 * gi * gi;
            let upd = (m[i] / (1.0 - 0.9f64.powi(t)))
                / ((v[i] / (1.0 - 0.99f64.powi(t))).sqrt() + 1e-8);
            want_w[i] = want_w[i] * (1.0 - lr * 0.1) - lr * upd;
        }
    }
    let got = w.as_tensor().to_vec2::<f32>()?;
    for i in 0..2 {
        assert!(
            (got[0][i] as f64 - want_w[i]).abs() < 1e-6,
            "{got:?} vs {want_w:?}"
        );
    }
    // Rank-1 parameter: no weight decay; first step of Adam moves it by ~lr.
    let nv = n.as_tensor().to_vec1::<f32>()?[0] as f64;
    assert!((nv - (0.5 - 2.0 * 0.01)).abs() < 1e-5, "{nv}");
    Ok(())
}

#[test]
fn state_round_trips_and_bad_state_is_rejected() -> Result<()> {
    let dev = Device::Cpu;
    let dir = std::env::temp_dir().join(format!("adamw-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mk = || -> Result<(Var, AdamW)> {
        let w = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0, 3.0], &dev)?)?;
        let opt = AdamW::new(vec![("w".into(), w.clone())], AdamWConfig::default())?;
        Ok((w, opt))
    };
    let mut g = HashMap::new();
    g.insert("w".to_string(), Tensor::new(&[0.1f32, -0.2, 0.3], &dev)?);
    let (wa, mut a) = mk()?;
    a.step(&g, 0.1, 1.0)?;
    a.save(dir.join("opt.safetensors"))?;
    let (wb, mut b) = mk()?;
    wb.set(wa.as_tensor())?;
    b.load(dir.join("opt.safetensors"))?;
    assert_eq!(b.step, 1);
    a.step(&g, 0.1, 1.0)?;
    b.step(&g, 0.1, 1.0)?;
    assert_eq!(
        wa.as_tensor().to_vec1::<f32>()?,
        wb.as_tensor().to_vec1::<f32>()?
    );
    // A parameter with another shape cannot take this state.
    let w2 = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &dev)?)?;
    let mut c = AdamW::new(vec![("w".into(), w2)], AdamWConfig::default())?;
    assert!(c.load(dir.join("opt.safetensors")).is_err());
    // Wrong gradient shape is an error.
    let mut bad = HashMap::new();
    bad.insert("w".to_string(), Tensor::new(&[0.1f32], &dev)?);
    assert!(b.step(&bad, 0.1, 1.0).is_err());
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}


/// ZeRO-1 over 3 replica ranks: parameters of 10 (not divisible), 2 (a rank owns nothing)
/// and 6 bf16 elements (sliced master copies), weight decay on. After 5 steps every rank's
/// parameters equal the unsharded optimizer's bit for bit; the gathered state equals its
/// state; a file saved by the sharded optimizer resumes both kinds identically. Stepping
/// from reduce-scattered gradient slices gives the same parameters.
#[test]
fn zero1_matches_the_unsharded_optimizer() -> Result<()> {
    use candle_cp_comm::run_ranks;
    let cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
    let init = |seed: u64| -> Result<Vec<(String, Var)>> {
        let dev = Device::Cpu;
        let t = |n: &[usize], s: u64| candle_cp_ops::oracle::randn(s, n, 1.0);
        Ok(vec![
            ("a.weight".to_string(), Var::from_tensor(&t(&[2, 5], seed)?)?),
            ("b.bias".to_string(), Var::from_tensor(&t(&[2], seed + 1)?)?),
            ("c.weight".to_string(), Var::from_tensor(&t(&[3, 2], seed + 2)?.to_dtype(DType::BF16)?.to_device(&dev)?)?),
        ])
    };
    let grads = |step: u64| -> Result<HashMap<String, Tensor>> {
        Ok([
            ("a.weight".to_string(), candle_cp_ops::oracle::randn(100 + step, &[2, 5], 1.0)?),
            ("b.bias".to_string(), candle_cp_ops::oracle::randn(200 + step, &[2], 1.0)?),
            ("c.weight".to_string(), candle_cp_ops::oracle::randn(300 + step, &[3, 2], 1.0)?.to_dtype(DType::BF16)?),
        ]
        .into())
    };
    let flat = |o: &AdamW| -> Result<Vec<f32>> {
        let mut v = vec![];
        for (_, var) in o.params() {
            v.extend(var.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(v)
    };
    let mut plain = AdamW::new(init(1)?, cfg)?;
    for k in 0..5 {
        plain.step(&grads(k)?, 1e-2, 0.5)?;
    }
    let want = flat(&plain)?;
    let want_state = plain.state_tensors()?;
    let dir = std::env::temp_dir().join(format!("cp-adamw-zero1-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("opt.safetensors");
    let res = run_ranks(3, |g| {
        let mut o = AdamW::new_zero1(init(1)?, cfg, g.clone())?;
        assert!(o.is_sharded());
        for k in 0..5 {
            o.step(&grads(k)?, 1e-2, 0.5)?;
        }
        let got = flat(&o)?;
        // the same steps from reduce-scattered slices: rank 0 holds the gradients, the other
        // ranks zeros (the sum is exact), each rank steps with its slice of the sum
        let mut o3 = AdamW::new_zero1(init(1)?, cfg, g.clone())?;
        for k in 0..5 {
            let mut share = grads(k)?;
            if g.rank() > 0 {
                for t in share.values_mut() {
                    *t = t.zeros_like()?;
                }
            }
            let slices = o3.reduce_scatter_grads(&share)?;
            assert!(slices.iter().all(|(n, t)| t.elem_count() < share[n].elem_count()), "slices, not whole gradients");
            o3.step(&slices, 1e-2, 0.5)?;
        }
        assert_eq!(flat(&o3)?, want, "parameters after 5 steps from reduce-scattered slices");
        // a slice of the wrong length is refused on every rank before any collective
        let bad: HashMap<String, Tensor> = [("a.weight".to_string(), Tensor::zeros(3, DType::F32, &Device::Cpu)?)].into();
        let e = o3.step(&bad, 1e-2, 1.0).unwrap_err().to_string();
        assert!(e.contains("a.weight") && e.contains("[3]") && e.contains("[2, 5]"), "{e}");
        assert!(o3.reduce_scatter_grads(&bad).is_err());
        let st = o.state_tensors()?;
        o.save_from(&file, g.rank() == 0)?;
        g.barrier()?;
        // resume from the sharded file: sharded and plain continue alike
        let mut o2 = AdamW::new_zero1(init(1)?, cfg, g.clone())?;
        for ((_, a), (_, b)) in o2.params().into_iter().zip(o.params()) {
            a.set(b.as_tensor())?;
        }
        o2.load(&file)?;
        o2.step(&grads(9)?, 1e-2, 1.0)?;
        Ok((got, st, flat(&o2)?))
    });
    let mut resumed_plain = AdamW::new(init(1)?, cfg)?;
    for ((_, a), (_, b)) in resumed_plain.params().into_iter().zip(plain.params()) {
        a.set(b.as_tensor())?;
    }
    resumed_plain.load(&file)?;
    resumed_plain.step(&grads(9)?, 1e-2, 1.0)?;
    let want_resumed = flat(&resumed_plain)?;
    for r in res {
        let (got, st, resumed) = r?;
        assert_eq!(got, want, "parameters after 5 steps");
        for (k, t) in &want_state {
            let d = (t.to_dtype(DType::F32)? - st[k].to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "gathered state {k}");
        }
        assert_eq!(resumed, want_resumed, "resumed from the sharded file");
    }
    // the streamed files (ZeRO: gathered tensor by tensor; plain) hold exactly the state
    let plain_file = dir.join("plain.safetensors");
    plain.save(&plain_file)?;
    for f in [&file, &plain_file] {
        let on_disk = candle_core::safetensors::load(f, &Device::Cpu)?;
        assert_eq!(on_disk.len(), want_state.len(), "{}", f.display());
        for (k, t) in &want_state {
            let got = &on_disk[k];
            assert_eq!((got.dims(), got.dtype()), (t.dims(), t.dtype()), "{k}");
            let same = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()? == t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            assert!(same, "{}: {k} differs from state_tensors", f.display());
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// ZeRO with expert parallelism on 4 ranks: EP 2 (ranks {0, 1}, {2, 3}), each expert slice
/// held by 2 ranks ({0, 2}, {1, 3}). A dense weight (state split over the 4 replicas), stacked
/// experts `[4, 3]` (each rank holds 2 of them, their state split over the 2 ranks holding
/// them: 3 of the 6 elements each) and bf16 experts (sliced master copies). After 4 steps,
/// blocking, through `step_start` and from reduce-scattered gradients, every rank's parameters equal the slices of one plain
/// optimizer's over the whole experts, bit for bit; the saved file is that optimizer's state;
/// a state file resumes it identically. Missing or mismatched groups are refused by name.
#[test]
fn zero_splits_the_experts_state_over_the_ranks_holding_them() -> Result<()> {
    use candle_cp_comm::run_ranks;
    let cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
    let t = |n: &[usize], s: u64| candle_cp_ops::oracle::randn(s, n, 1.0);
    // (name, whole shape, dtype, expert)
    let spec: [(&str, [usize; 2], DType, bool); 3] = [("dense.weight", [2, 5], DType::F32, false), ("experts.up", [4, 3], DType::F32, true), ("experts.down", [4, 2], DType::BF16, true)];
    // this EP rank's slice (of `ep` along dim 0) of the whole tensor of spec `i`
    let part = |x: &Tensor, expert: bool, e: usize| -> Result<Tensor> { if expert { x.narrow(0, 2 * e, 2) } else { Ok(x.clone()) } };
    let whole = |i: usize, seed: u64| -> Result<Tensor> { t(&spec[i].1, seed + i as u64)?.to_dtype(spec[i].2) };
    let params = |e: Option<usize>| -> Result<Vec<(String, Var)>> {
        (0..spec.len()).map(|i| Ok((spec[i].0.to_string(), Var::from_tensor(&part(&whole(i, 1)?, spec[i].3 && e.is_some(), e.unwrap_or(0))?)?))).collect()
    };
    let grads = |step: u64, e: Option<usize>| -> Result<HashMap<String, Tensor>> {
        (0..spec.len()).map(|i| Ok((spec[i].0.to_string(), part(&whole(i, 100 * step)?, spec[i].3 && e.is_some(), e.unwrap_or(0))?))).collect()
    };
    let mut plain = AdamW::new(params(None)?, cfg)?;
    for k in 0..4 {
        plain.step(&grads(k, None)?, 1e-2, 0.5)?;
    }
    let want_state = plain.state_tensors()?;
    let dir = std::env::temp_dir().join(format!("cp-adamw-ep-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("opt.safetensors");
    // plain's parameters after 4 steps, and after a fifth resumed from its saved state
    let at4: Vec<Tensor> = plain.params().iter().map(|(_, v)| v.as_tensor().copy()).collect::<Result<_>>()?;
    let set = |o: &AdamW, e: Option<usize>| -> Result<()> {
        for ((name, v), w) in o.params().into_iter().zip(&at4) {
            let expert = spec.iter().any(|s| s.0 == name && s.3);
            v.set(&part(w, expert && e.is_some(), e.unwrap_or(0))?)?;
        }
        Ok(())
    };
    plain.save(dir.join("plain.safetensors"))?;
    let mut resumed = AdamW::new(params(None)?, cfg)?;
    set(&resumed, None)?;
    resumed.load(dir.join("plain.safetensors"))?;
    resumed.step(&grads(9, None)?, 1e-2, 1.0)?;
    let experts = || spec.iter().filter(|s| s.3).map(|s| s.0.to_string());
    let res = run_ranks(4, |g| {
        let (ep, replicas) = (g.split(g.rank() / 2, g.rank() % 2)?, g.split(g.rank() % 2, g.rank() / 2)?);
        let e = ep.rank();
        let wrong = AdamW::new_zero1(params(Some(e))?, cfg, g.clone())?.with_expert_parallel(ep.clone(), g.clone(), experts());
        let msg = wrong.err().map(|x| x.to_string()).unwrap_or_default();
        assert!(msg.contains("2 EP ranks × 4 ranks") && msg.contains("not the 4 replicas"), "{msg}");
        // 0: blocking steps from whole gradients, 1: through step_start, 2: from the slices
        // reduce_scatter_grads sums (one rank of each group holds the gradient, the others zeros)
        for mode in 0..3 {
            let mut o = AdamW::new_zero1(params(Some(e))?, cfg, g.clone())?.with_expert_parallel(ep.clone(), replicas.clone(), experts())?;
            for s in &o.slots {
                let n = s.var.elem_count();
                let want = if spec.iter().any(|x| x.0 == s.name && x.3) { span(n, replicas.rank(), 2).1 } else { span(n, g.rank(), 4).1 };
                assert_eq!((s.m.elem_count(), s.zero.is_some()), (want, true), "{}: state split over the ranks holding it", s.name);
            }
            for k in 0..4 {
                if mode == 2 {
                    let mut share = grads(k, Some(e))?;
                    for (n, t) in share.iter_mut() {
                        let holder = if n.starts_with("experts") { replicas.rank() == 0 } else { g.rank() == 0 };
                        if !holder {
                            *t = t.zeros_like()?;
                        }
                    }
                    assert!(o.splits_experts());
                    let slices = o.reduce_scatter_grads(&share)?;
                    assert!(slices.iter().all(|(n, t)| t.elem_count() < share[n].elem_count()), "slices, not whole gradients");
                    o.step(&slices, 1e-2, 0.5)?;
                } else if mode == 1 {
                    let msg = o.step_start(&grads(k, Some(e))?, 1e-2, 0.5, &g, None, &|_| 0).err().map(|x| x.to_string()).unwrap_or_default();
                    assert!(msg.contains("expert_comm") && msg.contains("2 ranks"), "{msg}");
                    let (c, xc) = (g.split(0, g.rank())?, replicas.split(0, replicas.rank())?);
                    o.step_start(&grads(k, Some(e))?, 1e-2, 0.5, &c, Some(&xc), &|n| usize::from(n.starts_with("experts")))?.finish()?;
                } else {
                    o.step(&grads(k, Some(e))?, 1e-2, 0.5)?;
                }
            }
            for (name, var) in o.params() {
                let i = spec.iter().position(|s| s.0 == name).expect("a spec");
                let want = part(plain.slots.iter().find(|s| s.name == name).expect("slot").var.as_tensor(), spec[i].3, e)?;
                let same = var.as_tensor().to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()? == want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                assert!(same, "{name} on rank {} (mode {mode})", g.rank());
            }
            o.save_from(&file, g.rank() == 0)?;
            g.barrier()?;
            let on_disk = candle_core::safetensors::load(&file, &Device::Cpu)?;
            for (k, t) in &want_state {
                let same = on_disk[k].to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()? == t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                assert!(same, "{k} in the file (mode {mode})");
            }
            g.barrier()?;
        }
        // resumed from the file on the same layout: the plain optimizer's fifth step
        let mut o = AdamW::new_zero1(params(Some(e))?, cfg, g.clone())?.with_expert_parallel(ep.clone(), replicas.clone(), experts())?;
        set(&o, Some(e))?;
        o.load(&file)?;
        o.step(&grads(9, Some(e))?, 1e-2, 1.0)?;
        for ((name, var), (_, w)) in o.params().into_iter().zip(resumed.params()) {
            let i = spec.iter().position(|s| s.0 == name).expect("a spec");
            let want = part(w.as_tensor(), spec[i].3, e)?;
            let same = var.as_tensor().to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()? == want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            assert!(same, "{name} on rank {} after resuming", g.rank());
        }
        Ok(())
    });
    for r in res {
        r?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
