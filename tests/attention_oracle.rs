//! Blockwise attention (`candle_cp_ops::attention`) against the float64 oracle, against
//! `attention_slow`, and its algebra (merge, offsets, masked rows, dtypes, errors).

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_cp_ops::attention::{attention, attention_bwd, attention_fwd, attention_slow, merge, Mask};
use candle_cp_ops::oracle::{abs_err, rel_err, run_single, AttnCase, AttnMetrics, AttnOutputs, AttnTol};
use candle_cp_tests::{oracle_attn, oracle_attn_files as oracle_files};

/// Deterministic N(0, 1) f32 tensor on the CPU ([`candle_cp_ops::oracle::randn`]).
fn randn(seed: u64, shape: &[usize]) -> Tensor {
    candle_cp_ops::oracle::randn(seed, shape, 1.0).unwrap()
}

/// An autograd attention function (`attention` or `attention_slow`).
type AttnFn = fn(&Tensor, &Tensor, &Tensor, &Mask, f64) -> Result<(Tensor, Tensor)>;

/// Forward + backward of `sum(out * dout)` through an autograd attention function.
fn fwd_bwd(
    f: AttnFn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    mask: &Mask,
    scale: f64,
) -> AttnOutputs {
    let (qv, kv, vv) = (Var::from_tensor(q).unwrap(), Var::from_tensor(k).unwrap(), Var::from_tensor(v).unwrap());
    let (out, lse) = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), mask, scale).unwrap();
    let loss = (out.to_dtype(DType::F32).unwrap() * dout).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let get = |x: &Var| g.get(x.as_tensor()).expect("missing gradient").clone();
    AttnOutputs { out, lse, dq: get(&qv), dk: get(&kv), dv: get(&vv) }
}

#[test]
fn oracle_cases_autograd() {
    for path in oracle_files() {
        let case = AttnCase::load(&path).unwrap();
        let got = run_single(&case).unwrap();
        let m = AttnMetrics::compute(&got, &case.reference).unwrap();
        let tol = case.tolerances();
        println!("{} (autograd)\n{}", case.name, m.report(&tol));
        assert!(m.passes(&tol), "{}: {:?} over tolerance {:?}", case.name, m.failures(&tol), m);
    }
}

#[test]
fn oracle_cases_raw_fwd_bwd() {
    for path in oracle_files() {
        let case = AttnCase::load(&path).unwrap();
        let mask = case.mask();
        let (out, lse) = attention_fwd(&case.q, &case.k, &case.v, &mask, case.scale).unwrap();
        assert_eq!(out.dtype(), DType::F32);
        let (dq, dk, dv) = attention_bwd(&case.q, &case.k, &case.v, &out, &lse, &case.dout, &mask, case.scale).unwrap();
        let got = AttnOutputs { out, lse, dq, dk, dv };
        let m = AttnMetrics::compute(&got, &case.reference).unwrap();
        let tol = case.tolerances();
        println!("{} (raw)\n{}", case.name, m.report(&tol));
        assert!(m.passes(&tol), "{}: {:?} over tolerance {:?}", case.name, m.failures(&tol), m);
        // The backward from the *reference* out/lse must also give the reference gradients.
        let r = &case.reference;
        let (dq, dk, dv) = attention_bwd(&case.q, &case.k, &case.v, &r.out, &r.lse, &case.dout, &mask, case.scale).unwrap();
        assert!(rel_err(&dq, &r.dq).unwrap() <= tol.dq_rel);
        assert!(rel_err(&dk, &r.dk).unwrap() <= tol.dk_rel);
        assert!(rel_err(&dv, &r.dv).unwrap() <= tol.dv_rel);
    }
}

fn assert_close(got: &AttnOutputs, want: &AttnOutputs, tol: f64, what: &str) {
    let m = AttnMetrics::compute(got, want).unwrap();
    let t = AttnTol { out_abs: tol, lse_abs: tol, dq_rel: tol, dk_rel: tol, dv_rel: tol };
    assert!(m.passes(&t), "{what}: {:?} over {tol}: {m:?}", m.failures(&t));
}

#[test]
fn matches_slow_values_and_grads() {
    // (b, t, s, h, hkv, d, mask)
    let cases: Vec<(usize, usize, usize, usize, usize, usize, Mask)> = vec![
        (2, 37, 53, 4, 2, 16, Mask::Full),
        (1, 130, 130, 6, 1, 32, Mask::causal()),
        (1, 200, 300, 4, 4, 8, Mask::causal_offsets(100, 0)),
        (1, 70, 90, 2, 1, 16, Mask::causal_offsets(40, 50)),
        (1, 64, 64, 4, 2, 16, Mask::Causal { q_offset: 1, q_stride: 3, k_offset: 2, k_stride: 3 }),
        (2, 150, 140, 2, 2, 24, Mask::Causal { q_offset: 0, q_stride: 2, k_offset: 1, k_stride: 2 }),
    ];
    for (i, &(b, t, s, h, hkv, d, mask)) in cases.iter().enumerate() {
        let seed = 100 + 10 * i as u64;
        let q = randn(seed, &[b, t, h, d]);
        let k = randn(seed + 1, &[b, s, hkv, d]);
        let v = randn(seed + 2, &[b, s, hkv, d]);
        let dout = randn(seed + 3, &[b, t, h, d]);
        let scale = 1.0 / (d as f64).sqrt();
        let fast = fwd_bwd(attention, &q, &k, &v, &dout, &mask, scale);
        let slow = fwd_bwd(attention_slow, &q, &k, &v, &dout, &mask, scale);
        assert_close(&fast, &slow, 2e-5, &format!("case {i} {mask:?}"));
    }
}

#[test]
fn merge_of_two_key_halves_is_whole() {
    let (b, t, s, h, d) = (2, 48, 96, 4, 16);
    let q = randn(1, &[b, t, h, d]);
    let k = randn(2, &[b, s, 2, d]);
    let v = randn(3, &[b, s, 2, d]);
    let scale = 0.3;
    let (whole, lse) = attention_fwd(&q, &k, &v, &Mask::Full, scale).unwrap();
    let half = |lo: usize| {
        let (k, v) = (k.narrow(1, lo, s / 2).unwrap(), v.narrow(1, lo, s / 2).unwrap());
        attention_fwd(&q, &k, &v, &Mask::Full, scale).unwrap()
    };
    let ((oa, la), (ob, lb)) = (half(0), half(s / 2));
    let (o, l) = merge(&oa, &la, &ob, &lb).unwrap();
    assert!(abs_err(&o, &whole).unwrap() < 1e-5);
    assert!(abs_err(&l, &lse).unwrap() < 1e-5);
    // merge is symmetric
    let (o2, l2) = merge(&ob, &lb, &oa, &la).unwrap();
    assert!(abs_err(&o2, &o).unwrap() < 1e-6 && abs_err(&l2, &l).unwrap() < 1e-6);
}

#[test]
fn merge_with_empty_parts() {
    let out = randn(5, &[1, 3, 2, 4]);
    let lse = Tensor::new(&[[[0.5f32, f32::NEG_INFINITY, 2.0], [f32::NEG_INFINITY, f32::NEG_INFINITY, -1.0]]], &Device::Cpu).unwrap();
    let zero = out.zeros_like().unwrap();
    let ninf = Tensor::full(f32::NEG_INFINITY, (1, 2, 3), &Device::Cpu).unwrap();
    // merging with an empty part (lse -inf, out 0) is the identity, including -inf rows
    let (o, l) = merge(&out, &lse, &zero, &ninf).unwrap();
    let l_v = l.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(l_v, lse.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    let o_v = o.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(o_v.iter().all(|x| x.is_finite()));
    // rows with lse -inf give 0, the others keep out
    let mask = Tensor::new(&[[[1f32, 0.], [0., 0.], [1., 1.]]], &Device::Cpu).unwrap().unsqueeze(3).unwrap();
    let want = out.broadcast_mul(&mask).unwrap();
    assert!(abs_err(&o, &want).unwrap() < 1e-7);
    // bad shapes
    assert!(merge(&out, &lse.transpose(1, 2).unwrap(), &zero, &ninf).is_err());
}

/// Queries of chunk c paired with each key chunk (global offsets), merged over key chunks,
/// equal the corresponding rows of the full causal attention — forward and backward.
#[test]
fn offsets_chunks_equal_slice_of_full_causal() {
    let (b, t, h, hkv, d, p) = (1, 128, 4, 2, 16, 4);
    let c = t / p;
    let q = randn(11, &[b, t, h, d]);
    let k = randn(12, &[b, t, hkv, d]);
    let v = randn(13, &[b, t, hkv, d]);
    let dout = randn(14, &[b, t, h, d]);
    let scale = 0.25;
    let (out, lse) = attention_fwd(&q, &k, &v, &Mask::causal(), scale).unwrap();
    let (dq, dk, dv) = attention_bwd(&q, &k, &v, &out, &lse, &dout, &Mask::causal(), scale).unwrap();
    let mut dk_sum = k.zeros_like().unwrap();
    let mut dv_sum = v.zeros_like().unwrap();
    for qc in 0..p {
        let qi = q.narrow(1, qc * c, c).unwrap();
        let di = dout.narrow(1, qc * c, c).unwrap();
        let out_i = out.narrow(1, qc * c, c).unwrap();
        let lse_i = lse.narrow(2, qc * c, c).unwrap();
        let mut acc: Option<(Tensor, Tensor)> = None;
        let mut dq_i = qi.zeros_like().unwrap();
        for kc in 0..p {
            let kj = k.narrow(1, kc * c, c).unwrap();
            let vj = v.narrow(1, kc * c, c).unwrap();
            let mask = Mask::causal_offsets(qc * c, kc * c);
            let (o, l) = attention_fwd(&qi, &kj, &vj, &mask, scale).unwrap();
            if kc > qc {
                // fully masked block
                assert!(o.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() == 0.0);
                assert!(l.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|x| *x == f32::NEG_INFINITY));
            }
            acc = Some(match acc {
                None => (o, l),
                Some((ao, al)) => merge(&ao, &al, &o, &l).unwrap(),
            });
            // ring-style backward of this block with the global out/lse of these rows
            let (a, bk, bv) = attention_bwd(&qi, &kj, &vj, &out_i, &lse_i, &di, &mask, scale).unwrap();
            dq_i = (dq_i + a).unwrap();
            let pad = |x: &Tensor| -> Tensor {
                let z = |n: usize| Tensor::zeros((b, n, hkv, d), DType::F32, &Device::Cpu).unwrap();
                Tensor::cat(&[z(kc * c), x.clone(), z(t - (kc + 1) * c)], 1).unwrap()
            };
            dk_sum = (dk_sum + pad(&bk)).unwrap();
            dv_sum = (dv_sum + pad(&bv)).unwrap();
        }
        let (o, l) = acc.unwrap();
        assert!(abs_err(&o, &out_i).unwrap() < 1e-5, "chunk {qc} out");
        assert!(abs_err(&l, &lse_i).unwrap() < 1e-5, "chunk {qc} lse");
        assert!(rel_err(&dq_i, &dq.narrow(1, qc * c, c).unwrap()).unwrap() < 1e-5, "chunk {qc} dq");
    }
    assert!(rel_err(&dk_sum, &dk).unwrap() < 1e-5);
    assert!(rel_err(&dv_sum, &dv).unwrap() < 1e-5);
}

#[test]
fn fully_masked_rows_give_zero_and_neg_inf() {
    let (b, t, s, h, d) = (1, 40, 40, 2, 8);
    let q = randn(21, &[b, t, h, d]);
    let k = randn(22, &[b, s, 1, d]);
    let v = randn(23, &[b, s, 1, d]);
    let dout = randn(24, &[b, t, h, d]);
    // keys start at position 25: query rows 0..25 see nothing
    let mask = Mask::causal_offsets(0, 25);
    let fast = fwd_bwd(attention, &q, &k, &v, &dout, &mask, 0.5);
    let slow = fwd_bwd(attention_slow, &q, &k, &v, &dout, &mask, 0.5);
    assert_eq!(fast.lse.dims(), &[b, h, t]);
    let lse = fast.lse.to_vec3::<f32>().unwrap();
    for row in &lse[0] {
        for (i, &l) in row.iter().enumerate() {
            assert_eq!(l == f32::NEG_INFINITY, i < 25, "row {i}");
        }
    }
    let masked_out = fast.out.narrow(1, 0, 25).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(masked_out, 0.0);
    for g in [&fast.dq, &fast.dk, &fast.dv, &slow.dq] {
        let v = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "non-finite gradient");
    }
    let dq_masked = fast.dq.narrow(1, 0, 25).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(dq_masked, 0.0);
    assert_close(&fast, &slow, 2e-5, "masked rows vs slow");
    // all rows masked: everything zero / -inf, gradients zero
    let all = fwd_bwd(attention, &q, &k, &v, &dout, &Mask::causal_offsets(0, 1000), 0.5);
    for g in [&all.out, &all.dq, &all.dk, &all.dv] {
        assert_eq!(g.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
    assert!(all.lse.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|x| *x == f32::NEG_INFINITY));
}

#[test]
fn half_precision_inputs() {
    let path = oracle_attn("b2_t256_h8_kv2_d64_causal.safetensors");
    let case = AttnCase::load(path).unwrap();
    for dt in [DType::BF16, DType::F16] {
        let c = |x: &Tensor| x.to_dtype(dt).unwrap();
        let got = fwd_bwd(attention, &c(&case.q), &c(&case.k), &c(&case.v), &case.dout, &case.mask(), case.scale);
        assert_eq!(got.out.dtype(), dt);
        assert_eq!(got.lse.dtype(), DType::F32);
        assert_eq!(got.dq.dtype(), dt);
        let m = AttnMetrics::compute(&got, &case.reference).unwrap();
        // bf16 has 8 mantissa bits (eps 7.8e-3), f16 11 (eps 9.8e-4); inputs are rounded too.
        let tol = if dt == DType::BF16 {
            AttnTol { out_abs: 5e-2, lse_abs: 5e-2, dq_rel: 5e-2, dk_rel: 5e-2, dv_rel: 5e-2 }
        } else {
            AttnTol { out_abs: 5e-3, lse_abs: 5e-3, dq_rel: 5e-3, dk_rel: 5e-3, dv_rel: 5e-3 }
        };
        println!("{dt:?}\n{}", m.report(&tol));
        assert!(m.passes(&tol), "{dt:?}: {:?}: {m:?}", m.failures(&tol));
        // and not accidentally exact (the inputs were rounded)
        assert!(m.out_abs > 0.0);
    }
}

#[test]
fn bad_shapes_are_errors_naming_shapes() {
    let q = randn(1, &[1, 8, 6, 4]);
    let k = randn(2, &[1, 8, 4, 4]);
    let err = attention(&q, &k, &k, &Mask::Full, 1.0).unwrap_err().to_string();
    assert!(err.contains("[1, 8, 6, 4]") && err.contains("[1, 8, 4, 4]"), "{err}");
    let k2 = randn(2, &[1, 8, 2, 4]);
    let bad: Vec<(Tensor, Tensor, Tensor)> = vec![
        (q.clone(), randn(3, &[1, 8, 2, 5]), randn(3, &[1, 8, 2, 5])), // head dim
        (q.clone(), randn(3, &[2, 8, 2, 4]), randn(3, &[2, 8, 2, 4])), // batch
        (q.clone(), k2.clone(), randn(4, &[1, 9, 2, 4])),              // k != v
        (q.reshape((8, 6, 4)).unwrap(), k2.clone(), k2.clone()),       // rank
        (q.clone(), k2.to_dtype(DType::F16).unwrap(), k2.to_dtype(DType::F16).unwrap()), // dtype
        (q.to_dtype(DType::F64).unwrap(), k2.to_dtype(DType::F64).unwrap(), k2.to_dtype(DType::F64).unwrap()),
    ];
    for (i, (q, k, v)) in bad.iter().enumerate() {
        for r in [attention(q, k, v, &Mask::Full, 1.0).map(|_| ()), attention_fwd(q, k, v, &Mask::Full, 1.0).map(|_| ()), attention_slow(q, k, v, &Mask::Full, 1.0).map(|_| ())] {
            let e = r.expect_err(&format!("bad case {i} accepted")).to_string();
            assert!(e.contains('['), "case {i}: error does not name shapes: {e}");
        }
    }
    let stride0 = Mask::Causal { q_offset: 0, q_stride: 0, k_offset: 0, k_stride: 1 };
    assert!(attention(&q, &k2, &k2, &stride0, 1.0).is_err());
    // backward with wrongly shaped out / lse / dout
    let (out, lse) = attention_fwd(&q, &k2, &k2, &Mask::Full, 1.0).unwrap();
    let e = attention_bwd(&q, &k2, &k2, &out, &lse.transpose(1, 2).unwrap(), &out, &Mask::Full, 1.0).unwrap_err().to_string();
    assert!(e.contains("lse") && e.contains("[1, 8, 6]"), "{e}");
    assert!(attention_bwd(&q, &k2, &k2, &out.narrow(1, 0, 4).unwrap(), &lse, &out, &Mask::Full, 1.0).is_err());
    assert!(attention_bwd(&q, &k2, &k2, &out, &lse, &out.narrow(3, 0, 2).unwrap(), &Mask::Full, 1.0).is_err());
    // metric helpers refuse mismatched shapes
    assert!(abs_err(&out, &lse).is_err());
}

#[test]
fn oracle_loader_errors() {
    let dir = std::env::temp_dir().join(format!("cp-attn-oracle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    assert!(AttnCase::load(dir.join("missing.safetensors")).unwrap_err().to_string().contains("missing.safetensors"));
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    assert!(AttnCase::load(&junk).is_err());
    // a file with the tensors but no metadata
    let t = randn(1, &[1, 4, 1, 2]);
    let noheader = dir.join("nometa.safetensors");
    candle_core::safetensors::save(&std::collections::HashMap::from([("q".to_string(), t)]), &noheader).unwrap();
    assert!(AttnCase::load(&noheader).unwrap_err().to_string().contains("causal"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Non-contiguous views (e.g. q from a `[B, H, T, D]` projection transposed) give the same
/// values and gradients as contiguous copies.
#[test]
fn non_contiguous_inputs() {
    let (b, t, h, d) = (1, 50, 4, 16);
    let q = randn(31, &[b, h, t, d]).transpose(1, 2).unwrap(); // [B, T, H, D] view
    assert!(!q.is_contiguous());
    let kv = randn(32, &[b, t, 2, 2 * d]);
    let (k, v) = (kv.narrow(3, 0, d).unwrap(), kv.narrow(3, d, d).unwrap());
    let dout = randn(33, &[b, t, h, d]);
    let mask = Mask::causal();
    let a = fwd_bwd(attention, &q, &k, &v, &dout, &mask, 0.25);
    let c = |x: &Tensor| x.contiguous().unwrap();
    let want = fwd_bwd(attention, &c(&q), &c(&k), &c(&v), &dout, &mask, 0.25);
    assert_close(&a, &want, 0.0, "non-contiguous vs contiguous");
    let slow = fwd_bwd(attention_slow, &q, &k, &v, &dout, &mask, 0.25);
    assert_close(&a, &slow, 2e-5, "non-contiguous vs slow");
}
