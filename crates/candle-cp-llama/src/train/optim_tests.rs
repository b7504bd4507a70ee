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
