//! Unit tests of [`super::LocalState`] (its host, `Buffer` and `slice_set` forms against each
//! other and against `attention::merge`).

use super::*;
use crate::attention::merge;

/// A first result for all rows, packed, becomes the in-place state: equal to folding it
/// into the empty state, and only then (not for part of the rows, not twice, not the wrong
/// size); a state never folded into finishes as out 0, lse -inf.
#[test]
fn adopt_packed_equals_a_first_merge() -> Result<()> {
    let dev = Device::Cpu;
    let (b, tl, h, d) = (2, 6, 3, 4);
    // row t = 3 of batch 0, head 0 sees no key: lse -inf and out 0, as the kernels give
    let mut os = Tensor::randn(0f32, 1., (b, tl, h, d), &dev)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    os[3 * h * d..3 * h * d + d].fill(0.0);
    let os = Tensor::from_vec(os, (b, tl, h, d), &dev)?;
    let mut ls = Tensor::randn(0f32, 2., (b, h, tl), &dev)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    ls[3] = f32::NEG_INFINITY;
    let ls = Tensor::from_vec(ls, (b, h, tl), &dev)?;
    let mut merged = LocalState::device_resident(b, tl, h, d, &dev)?;
    let mut adopted = LocalState::device_resident(b, tl, h, d, &dev)?;
    assert!(
        adopted.takes_packed(0, tl)
            && !adopted.takes_packed(1, tl - 1)
            && !adopted.takes_packed(0, tl - 1)
    );
    assert!(!LocalState::new(b, tl, h, d).takes_packed(0, tl));
    merged.merge_rows(0, &os, &ls)?;
    assert!(!merged.takes_packed(0, tl));
    let bad = Tensor::zeros(7, DType::F32, &dev)?;
    let e = adopted
        .adopt_packed(bad)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("[7]") && e.contains("(2, 6, 3, 4)"), "{e}");
    adopted.adopt_packed(Tensor::cat(&[os.flatten_all()?, ls.flatten_all()?], 0)?)?;
    assert!(adopted
        .adopt_packed(Tensor::zeros(
            b * tl * h * d + b * h * tl,
            DType::F32,
            &dev
        )?)
        .is_err());
    let (mo, ml) = merged.finish(&dev)?;
    let (ao, al) = adopted.finish(&dev)?;
    let f = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    assert_eq!(f(&mo)?, f(&ao)?);
    assert_eq!(f(&ml)?, f(&al)?);
    let (eo, el) = LocalState::device_resident(b, tl, h, d, &dev)?.finish(&dev)?;
    assert!(f(&eo)?.iter().all(|&x| x == 0.0) && f(&el)?.iter().all(|&x| x == f32::NEG_INFINITY));
    Ok(())
}

/// `merge_fwd` (a forward folded in: adopted when it is the first over all rows, then
/// forward + merge on the CPU) equals merging each call's forward into the host state, for
/// both forms, under full, offset-causal and band masks on parts of the rows; calls that
/// do not fit the state are errors naming the shapes.
#[test]
fn merge_fwd_equals_forward_then_merge() -> Result<()> {
    use crate::attention::{attention_fwd, Band, CallMask, Mask};
    let dev = Device::Cpu;
    let (b, tl, h, hkv, d, s) = (2, 8, 4, 2, 8, 6);
    let q = Tensor::randn(0f32, 1., (b, tl, h, d), &dev)?;
    let k = Tensor::randn(0f32, 1., (b, s, hkv, d), &dev)?;
    let v = Tensor::randn(0f32, 1., (b, s, hkv, d), &dev)?;
    let causal = Mask::causal_offsets(3, 0);
    // rows 1..6: row i sees keys [i / 2, i / 2 + 3)
    let (lo, hi): (Vec<u32>, Vec<u32>) = (0..5u32).map(|i| (i / 2, i / 2 + 3)).unzip();
    let band = Band::new(1, 5, s, lo, hi)?;
    let calls: [(usize, usize, CallMask<'_>); 3] = [
        (0, tl, CallMask::Mask(&Mask::Full)),
        (4, 4, CallMask::Mask(&causal)),
        (1, 5, CallMask::Band(&band)),
    ];
    let mut reference = LocalState::new(b, tl, h, d);
    for (row0, n, mask) in calls {
        let (o, l) = mask.fwd(&q.narrow(1, row0, n)?, &k, &v, 0.3.into())?;
        reference.merge_rows(row0, &o, &l)?;
    }
    let (ro, rl) = reference.finish(&dev)?;
    for form in 0..2 {
        let mut st = if form == 0 {
            LocalState::new(b, tl, h, d)
        } else {
            LocalState::device_resident(b, tl, h, d, &dev)?
        };
        for (row0, n, mask) in calls {
            st.merge_fwd(
                row0,
                &q.narrow(1, row0, n)?.contiguous()?,
                &k,
                &v,
                mask,
                0.3.into(),
            )?;
        }
        if form == 1 {
            assert!(matches!(st.repr, Repr::Buffer { .. }));
        }
        let e = st
            .merge_fwd(
                5,
                &q.narrow(1, 0, 4)?,
                &k,
                &v,
                CallMask::Mask(&Mask::Full),
                0.3.into(),
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[2, 4, 4, 8]") && e.contains("(2, 8, 4, 8)"),
            "{e}"
        );
        let (so, sl) = st.finish(&dev)?;
        let eo = (&so - &ro)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let el = (&sl - &rl)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(eo < 1e-6 && el < 1e-6, "form {form}: {eo} {el}");
    }
    // the first call alone, over all rows: the forward itself
    let (fo, fl) = attention_fwd(&q, &k, &v, &Mask::Full, 0.3)?;
    let mut st = LocalState::device_resident(b, tl, h, d, &dev)?;
    st.merge_fwd(0, &q, &k, &v, CallMask::Mask(&Mask::Full), 0.3.into())?;
    let (so, sl) = st.finish(&dev)?;
    assert_eq!(
        so.flatten_all()?.to_vec1::<f32>()?,
        fo.flatten_all()?.to_vec1::<f32>()?
    );
    assert_eq!(
        sl.flatten_all()?.to_vec1::<f32>()?,
        fl.flatten_all()?.to_vec1::<f32>()?
    );
    Ok(())
}

#[test]
fn state_merge_equals_attention_merge() -> Result<()> {
    let dev = Device::Cpu;
    let (b, n, h, d) = (2, 5, 3, 4);
    let oa = Tensor::randn(0f32, 1., (b, n, h, d), &dev)?;
    let ob = Tensor::randn(0f32, 1., (b, n, h, d), &dev)?;
    let oc = Tensor::randn(0f32, 1., (b, n, h, d), &dev)?;
    let mut la = Tensor::randn(0f32, 3., (b, h, n), &dev)?.to_vec3::<f32>()?;
    la[1][2][3] = f32::NEG_INFINITY; // a row masked in the first part only
    let la = Tensor::new(la, &dev)?;
    let lb = Tensor::randn(0f32, 3., (b, h, n), &dev)?;
    let lc = Tensor::randn(0f32, 3., (b, h, n), &dev)?;
    let (o1, l1) = merge(&oa, &la, &ob, &lb)?;
    let (o1, l1) = merge(&o1, &l1, &oc, &lc)?;
    // The state covers 2n rows; the merged rows are n..2n, rows 0..n stay empty.
    let mut s = LocalState::new(b, 2 * n, h, d);
    s.merge_rows(n, &oa, &la)?;
    s.merge_rows(n, &ob, &lb)?;
    s.merge_rows(n, &oc, &lc)?;
    let (o2, l2) = s.finish(&dev)?;
    let (o2e, l2e) = (o2.narrow(1, 0, n)?, l2.narrow(2, 0, n)?);
    let (o2, l2) = (o2.narrow(1, n, n)?, l2.narrow(2, n, n)?);
    let eo = (o1 - o2)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let el = (l1 - l2)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(eo < 1e-6 && el < 1e-6, "{eo} {el}");
    assert!(o2e
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|x| *x == 0.0));
    assert!(l2e
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|x| *x == f32::NEG_INFINITY));
    Ok(())
}

#[test]
fn exact_against_merge_f32() -> Result<()> {
    let dev = Device::Cpu;
    let oa = Tensor::randn(0f32, 1., (1, 4, 2, 8), &dev)?;
    let ob = Tensor::randn(0f32, 1., (1, 4, 2, 8), &dev)?;
    let la = Tensor::randn(0f32, 2., (1, 2, 4), &dev)?;
    let lb = Tensor::full(f32::NEG_INFINITY, (1, 2, 4), &dev)?;
    let (o1, l1) = merge(&oa, &la, &ob, &lb)?;
    let mut s = LocalState::new(1, 4, 2, 8);
    s.merge_rows(0, &oa, &la)?;
    s.merge_rows(0, &ob, &lb)?;
    let (o2, l2) = s.finish(&dev)?;
    assert!((o1 - o2)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
    assert!((l1 - l2)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
    assert!(s_bad().is_err());
    Ok(())
}

/// Both device forms (forced on CPU) equal the host state over full and partial row
/// segments, with rows masked in every part keeping out 0, lse -inf.
#[test]
fn device_state_equals_host_state() -> Result<()> {
    for slice_set in [false, true] {
        device_state_case(slice_set)?;
    }
    Ok(())
}

fn device_state_case(slice_set: bool) -> Result<()> {
    let dev = Device::Cpu;
    let form = |b, tl, h, d| {
        if slice_set {
            LocalState::device_resident_slice_set(b, tl, h, d, &dev)
        } else {
            LocalState::device_resident(b, tl, h, d, &dev)
        }
    };
    let (b, tl, h, d) = (2, 8, 3, 4);
    let mut host = LocalState::on_device(b, tl, h, d, &dev)?;
    assert!(matches!(host.repr, Repr::Host { .. }));
    let mut devs = form(b, tl, h, d)?;
    if slice_set {
        assert!(matches!(devs.repr, Repr::Device { .. }));
    } else {
        assert!(matches!(
            devs.repr,
            Repr::Buffer { .. } | Repr::Empty { .. }
        ));
    }
    // (row0, n): a full segment, overlapping partial ones, and rows 6..8 never merged.
    for (i, &(row0, n)) in [(0, 8), (2, 3), (0, 2), (2, 4)].iter().enumerate() {
        let o = Tensor::randn(0f32, 1., (b, n, h, d), &dev)?;
        let mut l = Tensor::randn(0f32, 3., (b, h, n), &dev)?.to_vec3::<f32>()?;
        l[1][2][1] = f32::NEG_INFINITY; // row row0+1, head 2 of batch 1: masked here
        if i > 0 {
            l[0][0][0] = f32::NEG_INFINITY;
        }
        let l = Tensor::new(l, &dev)?;
        host.merge_rows(row0, &o, &l)?;
        devs.merge_rows(row0, &o, &l)?;
    }
    let (oh, lh) = host.finish(&dev)?;
    let (od, ld) = devs.finish(&dev)?;
    assert_eq!(od.dims(), [b, tl, h, d]);
    assert_eq!(ld.dims(), [b, h, tl]);
    let eo = (&oh - &od)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(eo < 1e-6, "out differs by {eo}");
    let (lh, ld) = (
        lh.flatten_all()?.to_vec1::<f32>()?,
        ld.flatten_all()?.to_vec1::<f32>()?,
    );
    for (x, y) in lh.iter().zip(&ld) {
        assert!(
            (x.is_infinite() && x == y) || (x - y).abs() < 1e-6,
            "lse {x} vs {y}"
        );
    }
    // Batch 1, head 2, row 1 is masked in both parts covering it, (0, 8) and (0, 2):
    // lse -inf, out 0.
    assert_eq!(ld[(h + 2) * tl + 1], f32::NEG_INFINITY);
    let o121 = od.get(1)?.get(1)?.get(2)?.to_vec1::<f32>()?;
    assert_eq!(o121, [0.0; 4]);

    // Rows 0 and 3 never merged, row 1 masked in every part: out 0, lse -inf on both;
    // f16 partials accepted.
    let mut host = LocalState::new(1, 4, 1, 2);
    let mut devs = form(1, 4, 1, 2)?;
    let o = Tensor::randn(0f32, 1., (1, 2, 1, 2), &dev)?.to_dtype(DType::F16)?;
    let l = Tensor::new(&[[[f32::NEG_INFINITY, 0.5f32]]], &dev)?;
    for s in [&mut host, &mut devs] {
        s.merge_rows(1, &o, &l)?;
        s.merge_rows(1, &o, &l)?;
    }
    let ((oh, lh), (od, ld)) = (host.finish(&dev)?, devs.finish(&dev)?);
    assert_eq!(
        lh.flatten_all()?.to_vec1::<f32>()?,
        ld.flatten_all()?.to_vec1::<f32>()?
    );
    let ldv = ld.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!([ldv[0], ldv[1], ldv[3]], [f32::NEG_INFINITY; 3]);
    assert!(ldv[2].is_finite());
    let eo = (&oh - &od)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(eo < 1e-6, "out differs by {eo}");
    assert_eq!(
        od.narrow(1, 0, 2)?.flatten_all()?.to_vec1::<f32>()?,
        [0.0; 4]
    );
    assert_eq!(
        od.narrow(1, 3, 1)?.flatten_all()?.to_vec1::<f32>()?,
        [0.0; 2]
    );
    // Bad shapes are rejected by both.
    let bad = Tensor::zeros((1, 3, 1, 2), DType::F32, &dev)?;
    let badl = Tensor::zeros((1, 1, 3), DType::F32, &dev)?;
    assert!(form(1, 4, 1, 2)?.merge_rows(2, &bad, &badl).is_err());
    Ok(())
}

/// The in-place op itself rejects what does not fit: a block past the state's rows, a
/// buffer of the wrong length, a non-f32 lse; and its lse comes back as its own tensor.
#[test]
fn inplace_merge_rejects_bad_operands() -> Result<()> {
    let dev = Device::Cpu;
    let (b, tl, h, d) = (1, 4, 2, 3);
    let buf = Tensor::zeros(b * tl * h * (d + 1), DType::F32, &dev)?;
    let o = Tensor::zeros((b, 2, h, d), DType::F32, &dev)?;
    let l = Tensor::zeros((b, h, 2), DType::F32, &dev)?;
    let op = |row0| MergeRowsInPlace {
        dims: (b, tl, h, d),
        row0,
    };
    buf.inplace_op3(&o, &l, &op(2))?;
    let e = buf.inplace_op3(&o, &l, &op(3)).unwrap_err().to_string();
    assert!(
        e.contains("do not fit") && e.contains("[1, 2, 2, 3]"),
        "{e}"
    );
    let short = Tensor::zeros(b * tl * h * d, DType::F32, &dev)?;
    let e = short.inplace_op3(&o, &l, &op(0)).unwrap_err().to_string();
    assert!(e.contains("state buffer"), "{e}");
    assert!(buf
        .inplace_op3(&o, &l.to_dtype(DType::F16)?, &op(0))
        .is_err());
    let s = LocalState::device_resident(b, tl, h, d, &dev)?;
    let (out, lse) = s.finish(&dev)?;
    assert_eq!(
        (out.dims(), lse.dims()),
        (&[b, tl, h, d][..], &[b, h, tl][..])
    );
    assert_eq!(
        lse.layout().start_offset(),
        0,
        "lse is a copy, not a view of the buffer"
    );
    Ok(())
}

fn s_bad() -> Result<()> {
    let mut s = LocalState::new(1, 4, 2, 8);
    let o = Tensor::zeros((1, 3, 2, 8), DType::F32, &Device::Cpu)?;
    let l = Tensor::zeros((1, 2, 3), DType::F32, &Device::Cpu)?;
    s.merge_rows(2, &o, &l)
}
