//! Band masks (`candle_cp_ops::attention::Band`: one key interval per query row): the kernel
//! against the dense reference (random bands with empty rows, per-batch bands, tiles cut
//! anywhere, f32 and bf16, GQA), raw forward/backward = autograd, errors, and the CP engines'
//! use of bands: packed documents and windows cost ONE attention call per ring step.

use candle_core::{DType, Result, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::attention::{
    attention_band, attention_band_slow, attention_bwd_band, attention_docs_mask_slow, attention_fwd_band, Band, Mask,
};
use candle_cp_ops::cp::ring::{block_schedule_mask, step_band};
use candle_cp_ops::cp::{allgather_attention_stats, ring_attention_fwd_raw, shard, CpOpts, Layout, MaskSpec};
use candle_cp_ops::oracle::randn;
use candle_cp_ops::packing::Documents;

/// A random band over `s` keys for `t` rows: non-decreasing bounds, some rows empty, some
/// intervals wider than a tile, starts off tile edges.
fn random_band(seed: u64, t: usize, s: usize) -> Result<Band> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n.max(1)
    };
    let (mut lo, mut hi) = (Vec::new(), Vec::new());
    let (mut a, mut b) = (0u32, 0u32);
    for _ in 0..t {
        // the upper bound moves on by 0..3, the lower bound catches up sometimes
        b = (b + next(4) as u32).min(s as u32);
        if next(9) == 0 {
            a = b; // empty row
        } else if next(3) == 0 {
            a = (a + next(40) as u32).min(b);
        }
        lo.push(a);
        hi.push(b);
    }
    Band::new(1, t, s, lo, hi)
}

struct Grads {
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
}

type Attn<'a> = dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)> + 'a;

/// out, lse and the gradients of `sum(out · dout)`.
fn grads(q: &Tensor, k: &Tensor, v: &Tensor, dout: &Tensor, f: &Attn<'_>) -> Result<Grads> {
    let (qv, kv, vv) = (Var::from_tensor(q)?, Var::from_tensor(k)?, Var::from_tensor(v)?);
    let (out, lse) = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
    let loss = (out.to_dtype(DType::F32)? * dout)?.sum_all()?;
    let g = loss.backward()?;
    let get = |x: &Var| -> Result<Tensor> {
        match g.get(x.as_tensor()) {
            Some(t) => t.to_dtype(DType::F32),
            None => x.as_tensor().zeros_like()?.to_dtype(DType::F32),
        }
    };
    Ok(Grads { out: out.to_dtype(DType::F32)?, lse, dq: get(&qv)?, dk: get(&kv)?, dv: get(&vv)? })
}

/// max |a - b| / max(max |b|, 1e-3)
fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let n = b.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(d / n.max(1e-3))
}

/// lse: the same rows are -inf (empty), the others within `tol`.
fn lse_close(a: &Tensor, b: &Tensor, tol: f32, what: &str) -> Result<()> {
    let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        if y.is_infinite() {
            assert!(x.is_infinite() && *x < 0.0, "{what}: lse[{i}] = {x}, reference -inf (empty row)");
        } else {
            assert!((x - y).abs() <= tol, "{what}: lse[{i}] = {x}, reference {y}");
        }
    }
    Ok(())
}

fn assert_close(got: &Grads, want: &Grads, tol_out: f32, tol_grad: f32, what: &str) -> Result<()> {
    assert!(rel(&got.out, &want.out)? <= tol_out, "{what}: out rel {:e}", rel(&got.out, &want.out)?);
    lse_close(&got.lse, &want.lse, tol_out.max(1e-5), what)?;
    for (name, a, b) in [("dq", &got.dq, &want.dq), ("dk", &got.dk, &want.dk), ("dv", &got.dv, &want.dv)] {
        let r = rel(a, b)?;
        assert!(r <= tol_grad, "{what}: {name} rel {r:e} > {tol_grad:e}");
    }
    Ok(())
}

#[test]
fn band_matches_the_dense_reference() -> Result<()> {
    // T and S cross the kernels' 128-row tiles; GQA 4 query heads on 2 KV heads
    let (b, t, s, h, hkv, d) = (2usize, 300usize, 260usize, 4usize, 2usize, 32usize);
    let q = randn(1, &[b, t, h, d], 1.0)?;
    let k = randn(2, &[b, s, hkv, d], 1.0)?;
    let v = randn(3, &[b, s, hkv, d], 1.0)?;
    let dout = randn(4, &[b, t, h, d], 1.0)?;
    let scale = 1.0 / (d as f64).sqrt();
    let shared = random_band(7, t, s)?;
    assert!(shared.lo().iter().zip(shared.hi()).any(|(a, b)| a == b), "the band must hold empty rows");
    let per_row = Band::stack(&[random_band(8, t, s)?, Band::from_mask(&Mask::causal_offsets(40, 0), t, s)])?;
    for (name, band) in [("shared", &shared), ("per batch row", &per_row)] {
        let want = grads(&q, &k, &v, &dout, &|q, k, v| attention_band_slow(q, k, v, band, scale))?;
        let got = grads(&q, &k, &v, &dout, &|q, k, v| attention_band(q, k, v, band, scale))?;
        assert_close(&got, &want, 1e-5, 2e-5, name)?;
        // raw forward + backward = the autograd op
        let (out, lse) = attention_fwd_band(&q, &k, &v, band, scale)?;
        let (dq, dk, dv) = attention_bwd_band(&q, &k, &v, &out, &lse, &dout, band, scale)?;
        let raw = Grads { out, lse, dq, dk, dv };
        assert_close(&raw, &got, 0.0, 0.0, &format!("{name}: raw vs autograd"))?;
        // bf16 inputs: f32 accumulation, only the output rounds
        let bf = |x: &Tensor| x.to_dtype(DType::BF16);
        let (qb, kb, vb) = (bf(&q)?, bf(&k)?, bf(&v)?);
        let want16 = grads(&qb, &kb, &vb, &dout, &|q, k, v| attention_band_slow(q, k, v, band, scale))?;
        let got16 = grads(&qb, &kb, &vb, &dout, &|q, k, v| attention_band(q, k, v, band, scale))?;
        assert_close(&got16, &want16, 1e-2, 2e-2, &format!("{name} bf16"))?;
    }
    Ok(())
}

/// A band from a mask is that mask: the kernel under `Band::from_mask` equals the plain mask
/// path bit for bit (both take the same tiles).
#[test]
fn band_of_a_mask_is_the_mask() -> Result<()> {
    let (t, s, h, d) = (200usize, 330usize, 2usize, 16usize);
    let q = randn(11, &[1, t, h, d], 1.0)?;
    let k = randn(12, &[1, s, h, d], 1.0)?;
    let v = randn(13, &[1, s, h, d], 1.0)?;
    let dout = randn(14, &[1, t, h, d], 1.0)?;
    for mask in [Mask::Full, Mask::causal_offsets(130, 0), Mask::Causal { q_offset: 3, q_stride: 2, k_offset: 0, k_stride: 1 }] {
        let want = grads(&q, &k, &v, &dout, &|q, k, v| candle_cp_ops::attention::attention_slow(q, k, v, &mask, 0.25))?;
        let band = Band::from_mask(&mask, t, s);
        let got = grads(&q, &k, &v, &dout, &|q, k, v| attention_band(q, k, v, &band, 0.25))?;
        assert_close(&got, &want, 1e-5, 2e-5, &format!("{mask:?}"))?;
    }
    Ok(())
}

#[test]
fn band_errors_name_the_shapes() -> Result<()> {
    let q = randn(1, &[2, 8, 2, 4], 1.0)?;
    let k = randn(2, &[2, 6, 1, 4], 1.0)?;
    let bad = Band::from_mask(&Mask::causal(), 8, 8); // 8 keys, k has 6
    let e = attention_band(&q, &k, &k, &bad, 0.5).unwrap_err().to_string();
    assert!(e.contains("S = 6") && e.contains("8"), "{e}");
    let three = Band::stack(&[bad.clone(), bad.clone(), bad])?; // batch 3, q has 2
    let e = attention_fwd_band(&q, &q, &q, &three, 0.5).unwrap_err().to_string();
    assert!(e.contains("B = 2"), "{e}");
    assert!(Band::new(1, 2, 4, vec![2, 1], vec![3, 3]).is_err());
    Ok(())
}

/// Packed documents and a window on the ring and all-gather KV: the results equal the dense
/// reference and every ring step is ONE attention call (per row chunk), whatever the number
/// of documents it touches; the pairs computed are exactly the visible ones.
#[test]
fn documents_cost_one_call_per_step() -> Result<()> {
    let (p, t, h, d) = (4usize, 256usize, 2usize, 16usize);
    // 19 short documents, boundaries off every chunk edge
    let lens = [5usize, 17, 3, 30, 1, 9, 22, 14, 8, 25, 11, 2, 19, 6, 27, 13, 4, 21, 19];
    assert_eq!(lens.iter().sum::<usize>(), t);
    let docs = Documents::from_lengths(&lens)?;
    let q = randn(21, &[1, t, h, d], 1.0)?;
    let k = randn(22, &[1, t, 1, d], 1.0)?;
    let v = randn(23, &[1, t, 1, d], 1.0)?;
    let scale = 0.25;
    for window in [None, Some(12)] {
        let mask = window.map_or(Mask::causal(), Mask::sliding_window);
        let (want, want_lse) = attention_docs_mask_slow(&q, &k, &v, &docs, &mask, scale)?;
        for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Striped] {
            let mut opts = CpOpts::new(layout, true).with_documents(docs.clone());
            opts.window = window;
            let spec = MaskSpec { causal: true, window, docs: Some(&docs) };
            let res = run_ranks(p, |g: Group| {
                let r = g.rank();
                let sh = |x: &Tensor| shard(x, layout, r, p, 1);
                let (o, l, st) = ring_attention_fwd_raw(&sh(&q)?, &sh(&k)?, &sh(&v)?, &g, &opts)?;
                let (_, _, ag) = allgather_attention_stats(&sh(&q)?, &sh(&k)?, &sh(&v)?, &g, &opts)?;
                Ok((o, l, st, ag))
            });
            for (r, x) in res.into_iter().enumerate() {
                let (o, l, st, ag) = x?;
                let what = format!("{layout:?} window {window:?} rank {r}");
                let wo = shard(&want, layout, r, p, 1)?;
                let d = (o - &wo)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(d < 1e-5, "{what}: out differs by {d:e}");
                lse_close(&l, &shard(&want_lse, layout, r, p, 2)?, 1e-5, &what)?;
                for (s, step) in st.steps.iter().enumerate() {
                    let src = (r + p - s) % p;
                    let band = step_band(layout, r, src, p, t, spec)?;
                    let blocks = block_schedule_mask(layout, r, src, p, t, spec)?;
                    assert_eq!(step.blocks, usize::from(!band.is_empty()), "{what} step {s}: calls ({} blocks in the schedule)", blocks.len());
                    assert_eq!(step.pairs, band.pairs(), "{what} step {s}: pairs");
                }
                // all-gather KV: one call per local segment (zigzag: 2)
                let segs = layout.segments(r, p, t)?.len();
                assert_eq!(ag.steps[0].blocks, segs, "{what}: all-gather calls");
            }
        }
    }
    Ok(())
}

/// A prefix-LM mask (query `i` sees keys `[0, max(prefix, i + 1))`) as a band equals the same
/// attention built from plain masks: the prefix rows full over the prefix keys, the others
/// causal.
#[test]
fn prefix_lm_band() -> Result<()> {
    let (t, prefix, h, d) = (190usize, 70usize, 2usize, 16usize);
    let q = randn(41, &[1, t, h, d], 1.0)?;
    let k = randn(42, &[1, t, 1, d], 1.0)?;
    let v = randn(43, &[1, t, 1, d], 1.0)?;
    let lo = vec![0u32; t];
    let hi: Vec<u32> = (0..t).map(|i| prefix.max(i + 1) as u32).collect();
    let band = Band::new(1, t, t, lo, hi)?;
    let (out, lse) = attention_band(&q, &k, &v, &band, 0.25)?;
    let slow = candle_cp_ops::attention::attention_slow;
    let (o1, l1) = slow(&q.narrow(1, 0, prefix)?, &k.narrow(1, 0, prefix)?, &v.narrow(1, 0, prefix)?, &Mask::Full, 0.25)?;
    let (o2, l2) = slow(&q.narrow(1, prefix, t - prefix)?, &k, &v, &Mask::causal_offsets(prefix, 0), 0.25)?;
    let want = Tensor::cat(&[o1, o2], 1)?;
    assert!(rel(&out, &want)? < 1e-5, "prefix-LM out rel {:e}", rel(&out, &want)?);
    lse_close(&lse, &Tensor::cat(&[l1, l2], 2)?, 1e-5, "prefix-LM lse")?;
    Ok(())
}

/// One set of documents per batch row (`CpOpts::row_documents`): one ring pass (and one
/// all-gather) for the whole batch, outputs and gradients equal to the single-device band
/// attention with one band per row; mismatched rows are errors.
#[test]
fn row_documents_in_one_ring_pass() -> Result<()> {
    use candle_cp_ops::cp::{allgather_attention, ring_attention};
    let (p, t, h, d) = (2usize, 96usize, 2usize, 8usize);
    let rows = vec![Documents::from_lengths(&[7, 40, 1, 48])?, Documents::from_lengths(&[50, 46])?];
    let q = randn(51, &[2, t, h, d], 1.0)?;
    let k = randn(52, &[2, t, 1, d], 1.0)?;
    let v = randn(53, &[2, t, 1, d], 1.0)?;
    let dout = randn(54, &[2, t, h, d], 1.0)?;
    let pos: Vec<usize> = (0..t).collect();
    for window in [None, Some(9)] {
        let bands = rows
            .iter()
            .map(|docs| Band::from_positions(&pos, &pos, MaskSpec { causal: true, window, docs: Some(docs) }))
            .collect::<Result<Vec<_>>>()?;
        let band = Band::stack(&bands)?;
        let want = grads(&q, &k, &v, &dout, &|q, k, v| attention_band_slow(q, k, v, &band, 0.3))?;
        for (layout, allgather) in [(Layout::Zigzag, false), (Layout::Striped, false), (Layout::Contiguous, false), (Layout::Zigzag, true)] {
            let mut opts = CpOpts::new(layout, true).with_scale(0.3).with_row_documents(rows.clone());
            opts.window = window;
            let res = run_ranks(p, |g: Group| {
                let r = g.rank();
                let sh = |x: &Tensor| shard(x, layout, r, p, 1);
                let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    if allgather {
                        allgather_attention(q, k, v, &g, &opts)
                    } else {
                        ring_attention(q, k, v, &g, &opts)
                    }
                };
                grads(&sh(&q)?, &sh(&k)?, &sh(&v)?, &sh(&dout)?, &f).map(|g| (g.out, g.lse, g.dq, g.dk, g.dv))
            });
            for (r, x) in res.into_iter().enumerate() {
                let (out, lse, dq, dk, dv) = x?;
                let sh = |x: &Tensor, dim: usize| shard(x, layout, r, p, dim);
                let got = Grads { out, lse, dq, dk, dv };
                let want_r = Grads { out: sh(&want.out, 1)?, lse: sh(&want.lse, 2)?, dq: sh(&want.dq, 1)?, dk: sh(&want.dk, 1)?, dv: sh(&want.dv, 1)? };
                assert_close(&got, &want_r, 1e-5, 2e-5, &format!("{layout:?} all-gather {allgather} window {window:?} rank {r}"))?;
            }
        }
    }
    // one entry per row, not both kinds, each covering T
    let bad = [
        CpOpts::new(Layout::Zigzag, true).with_row_documents(vec![rows[0].clone()]),
        CpOpts::new(Layout::Zigzag, true).with_row_documents(rows.clone()).with_documents(rows[1].clone()),
        CpOpts::new(Layout::Zigzag, true).with_row_documents(vec![rows[0].clone(), Documents::from_lengths(&[95])?]),
    ];
    for (i, opts) in bad.iter().enumerate() {
        let res = run_ranks(p, |g: Group| {
            let sh = |x: &Tensor| shard(x, Layout::Zigzag, g.rank(), p, 1);
            ring_attention(&sh(&q)?, &sh(&k)?, &sh(&v)?, &g, opts).map(|_| ())
        });
        for r in res {
            let e = r.expect_err("bad row documents must fail").to_string();
            let want = ["1 row_documents", "not both", "95 tokens"][i];
            assert!(e.contains(want), "case {i}: {e}");
        }
    }
    Ok(())
}
