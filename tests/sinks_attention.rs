//! Attention sinks (gpt-oss's `self_attn.sinks`, `candle_cp_ops::attention::sinks`) on every
//! context-parallel method against a float64 reference written out here (loops over rows, the
//! sink one more softmax column whose value is zero): out, lse and the gradients of q, k, v
//! and the sinks (each rank's share summed over the ranks), on P thread ranks. The sinks are
//! drawn around `ln(keys seen)` so that a sink applied per ring step, or dropped, fails (checked:
//! without the sinks every output is far off). Plus GQA with replicated KV heads, packed
//! documents, windows (halo and ring), the 2-D layout, decoding against a sharded cache, bf16,
//! and refusals.

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::attention::{attention_sinks, Band, Mask, RowSums, Sinks};
use candle_cp_ops::cp::{allgather_attention, positions, ring_attention, shard, sharded_decode_attention_sinks, CpOpts, KvShard, Layout};
use candle_cp_ops::oracle::randn;
use candle_cp_ops::packing::Documents;
use candle_cp_ops::ulysses::{ulysses_attention, UlyssesOpts};
use candle_cp_ops::usp::{usp_attention, usp_positions, usp_shard, UspGroups, UspOpts};

/// q, k, v, dout `[B, T, ·, D]` and sinks `[H]` (around `ln T`).
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    sinks: Tensor,
}

fn inputs(seed: u64, [b, t, h, hkv, d]: [usize; 5]) -> Result<Inputs> {
    Ok(Inputs {
        q: randn(seed, &[b, t, h, d], 1.0)?,
        k: randn(seed + 1, &[b, t, hkv, d], 1.0)?,
        v: randn(seed + 2, &[b, t, hkv, d], 1.0)?,
        dout: randn(seed + 3, &[b, t, h, d], 1.0)?,
        sinks: (randn(seed + 4, &[h], 1.5)? + (t as f64 / 2.0).ln())?,
    })
}

/// out, lse, dq, dk, dv, dsinks.
type Outs = [Tensor; 6];
const NAMES: [&str; 6] = ["out", "lse", "dq", "dk", "dv", "dsinks"];

fn host(x: &Tensor) -> Result<Vec<f64>> {
    x.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Float64 attention with sinks under `visible(query, key)` and the gradients of
/// `sum(out · dout)`: `P = softmax([s, z_h])`, the sink column dropped; `dS = P ∘ (dP − δ)`,
/// `dz_h = −Σ P_sink · δ`.
fn reference(x: &Inputs, scale: f64, visible: &dyn Fn(usize, usize) -> bool) -> Result<Outs> {
    let (b, t, h, d) = x.q.dims4()?;
    let hkv = x.k.dim(2)?;
    let g = h / hkv;
    let (q, k, v, dout, z) = (host(&x.q)?, host(&x.k)?, host(&x.v)?, host(&x.dout)?, host(&x.sinks)?);
    let (mut out, mut lse) = (vec![0f64; q.len()], vec![0f64; b * h * t]);
    let (mut dq, mut dk, mut dv, mut dz) = (vec![0f64; q.len()], vec![0f64; k.len()], vec![0f64; v.len()], vec![0f64; h]);
    let qi = |bb: usize, i: usize, hh: usize| ((bb * t + i) * h + hh) * d;
    let ki = |bb: usize, j: usize, hk: usize| ((bb * t + j) * hkv + hk) * d;
    for bb in 0..b {
        for hh in 0..h {
            let hk = hh / g;
            for i in 0..t {
                let vis: Vec<usize> = (0..t).filter(|&j| visible(i, j)).collect();
                let o = qi(bb, i, hh);
                let logit: Vec<f64> = vis.iter().map(|&j| scale * (0..d).map(|e| q[o + e] * k[ki(bb, j, hk) + e]).sum::<f64>()).collect();
                let m = logit.iter().cloned().fold(z[hh], f64::max);
                let sum: f64 = logit.iter().map(|s| (s - m).exp()).sum::<f64>() + (z[hh] - m).exp();
                let p: Vec<f64> = logit.iter().map(|s| (s - m).exp() / sum).collect();
                let p_sink = (z[hh] - m).exp() / sum;
                lse[(bb * h + hh) * t + i] = m + sum.ln();
                for (n, &j) in vis.iter().enumerate() {
                    for e in 0..d {
                        out[o + e] += p[n] * v[ki(bb, j, hk) + e];
                        dv[ki(bb, j, hk) + e] += p[n] * dout[o + e];
                    }
                }
                let dp: Vec<f64> = vis.iter().map(|&j| (0..d).map(|e| dout[o + e] * v[ki(bb, j, hk) + e]).sum()).collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum(); // the sink's dP is 0
                dz[hh] -= p_sink * delta;
                for (n, &j) in vis.iter().enumerate() {
                    let ds = p[n] * (dp[n] - delta);
                    for e in 0..d {
                        dq[o + e] += scale * ds * k[ki(bb, j, hk) + e];
                        dk[ki(bb, j, hk) + e] += scale * ds * q[o + e];
                    }
                }
            }
        }
    }
    let f = |x: Vec<f64>, shape: &[usize]| Tensor::from_vec(x, shape, &Device::Cpu)?.to_dtype(DType::F32);
    Ok([f(out, &[b, t, h, d])?, f(lse, &[b, h, t])?, f(dq, &[b, t, h, d])?, f(dk, &[b, t, hkv, d])?, f(dv, &[b, t, hkv, d])?, f(dz, &[h])?])
}

/// One rank's run of an attention method on its shards: out, lse (its rows) and the gradients
/// of q, k, v (its rows) and of the sinks (its share).
type Method<'a> = &'a (dyn Fn(&Group, &Tensor, &Tensor, &Tensor, &Sinks) -> Result<(Tensor, Tensor)> + Sync);

fn rank_run(g: &Group, x: &Inputs, pos: &[usize], sh: &dyn Fn(&Tensor) -> Result<Tensor>, method: Method<'_>) -> Result<Outs> {
    let dt = x.q.dtype();
    let [q, k, v] = [&x.q, &x.k, &x.v].map(|t| sh(t).and_then(|s| Var::from_tensor(&s)).expect("shard"));
    let z = Var::from_tensor(&x.sinks)?;
    let (out, lse) = method(g, q.as_tensor(), k.as_tensor(), v.as_tensor(), &Sinks::new(z.as_tensor())?)?;
    let dout = sh(&x.dout)?.to_dtype(dt)?;
    let grads = (out.to_dtype(DType::F32)? * dout.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
    let gr = |t: &Tensor| -> Result<Tensor> { grads.get(t).ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?.to_dtype(DType::F32) };
    let _ = pos;
    Ok([out.to_dtype(DType::F32)?, lse, gr(q.as_tensor())?, gr(k.as_tensor())?, gr(v.as_tensor())?, gr(z.as_tensor())?])
}

/// The global tensors from each rank's rows (`pos`: their global positions): rows of dim 1
/// (dim 2 for lse), the sinks' gradient summed.
fn assemble(parts: Vec<(Vec<usize>, Outs)>) -> Result<Outs> {
    let order: Vec<usize> = parts.iter().flat_map(|(p, _)| p.iter().copied()).collect();
    let mut inv = vec![0u32; order.len()];
    for (i, &p) in order.iter().enumerate() {
        inv[p] = i as u32;
    }
    let inv = Tensor::new(inv, &Device::Cpu)?;
    let cat = |i: usize, dim: usize| -> Result<Tensor> {
        let xs: Vec<&Tensor> = parts.iter().map(|(_, o)| &o[i]).collect();
        Tensor::cat(&xs, dim)?.contiguous()?.index_select(&inv, dim)
    };
    let mut dz = parts[0].1[5].zeros_like()?;
    for (_, o) in &parts {
        dz = (dz + &o[5])?;
    }
    Ok([cat(0, 1)?, cat(1, 2)?, cat(2, 1)?, cat(3, 1)?, cat(4, 1)?, dz])
}

/// `‖a − b‖₂ / ‖b‖₂`.
fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
    let n = |t: &Tensor| -> Result<f32> { t.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>() };
    Ok(n(&(a - b)?)? / n(b)?.max(1e-30))
}

fn check(got: &Outs, want: &Outs, tol: f32, what: &str) -> Result<()> {
    for (i, name) in NAMES.iter().enumerate() {
        let e = rel(&got[i], &want[i])?;
        assert!(e < tol, "{what}: {name} rel {e} (tol {tol})");
    }
    Ok(())
}

/// Run `method` on `p` thread ranks of the CP `layout` and assemble.
fn run_cp(x: &Inputs, p: usize, layout: Layout, method: Method<'_>) -> Result<Outs> {
    let t = x.q.dim(1)?;
    let res = run_ranks(p, |g: Group| {
        let (r, n) = (g.rank(), g.size());
        let pos = positions(layout, r, n, t)?;
        let sh = |y: &Tensor| shard(y, layout, r, n, 1);
        Ok((pos.clone(), rank_run(&g, x, &pos, &sh, method)?))
    });
    assemble(res.into_iter().collect::<Result<Vec<_>>>()?)
}

/// Visibility: causal or full, an optional window, packed documents.
fn band(t: usize, causal: bool, window: Option<usize>, docs: Option<&Documents>) -> Result<Band> {
    let one = Documents::from_lengths(&[t])?;
    Band::documents(t, &[docs.unwrap_or(&one).clone()], causal, window)
}

const TOL: f32 = 2e-5;

/// Ring (zigzag, contiguous, striped) and all-gather KV, causal and full, a window short
/// enough for the halo exchange and one long enough for the ring, packed documents.
#[test]
fn ring_and_allgather_match_float64() -> Result<()> {
    let (b, t, h, hkv, d) = (2, 48, 4, 2, 8);
    let x = inputs(7, [b, t, h, hkv, d])?;
    let scale = 1.0 / (d as f64).sqrt();
    let docs = Documents::from_lengths(&[7, 19, 3, 19])?;
    for (causal, window, dd) in [(true, None, None), (false, None, None), (true, Some(5), None), (true, Some(21), None), (true, None, Some(&docs))] {
        let bd = band(t, causal, window, dd)?;
        let want = reference(&x, scale, &|i, j| bd.visible(0, i, j))?;
        let opts = |layout: Layout| {
            let mut o = CpOpts { documents: dd.cloned(), window, ..CpOpts::new(layout, causal) };
            o.block_rows = 5; // several row chunks per block
            o
        };
        for (layout, p, ag) in [(Layout::Zigzag, 4, false), (Layout::Contiguous, 3, false), (Layout::Striped, 2, false), (Layout::Zigzag, 2, true), (Layout::Contiguous, 4, true)] {
            let o = opts(layout);
            let m = move |g: &Group, q: &Tensor, k: &Tensor, v: &Tensor, z: &Sinks| {
                let o = o.clone().with_sinks(Some(z.clone()));
                if ag { allgather_attention(q, k, v, g, &o) } else { ring_attention(q, k, v, g, &o) }
            };
            let got = run_cp(&x, p, layout, &m)?;
            check(&got, &want, TOL, &format!("{} {layout:?} P {p} causal {causal} window {window:?} docs {}", if ag { "all-gather" } else { "ring" }, dd.is_some()))?;
        }
    }
    // without the sinks every output is far off: the inputs make them matter
    let bd = band(t, true, None, None)?;
    let want = reference(&x, scale, &|i, j| bd.visible(0, i, j))?;
    let res = run_ranks(2, |g: Group| {
        let sh = |y: &Tensor| shard(y, Layout::Zigzag, g.rank(), 2, 1);
        let (o, _) = ring_attention(&sh(&x.q)?, &sh(&x.k)?, &sh(&x.v)?, &g, &CpOpts::default())?;
        Ok((positions(Layout::Zigzag, g.rank(), 2, t)?, o))
    });
    let parts = res.into_iter().collect::<Result<Vec<_>>>()?;
    let plain: Vec<&Tensor> = parts.iter().map(|(_, o)| o).collect();
    let want_rows: Vec<Tensor> = parts.iter().map(|(p, _)| want[0].index_select(&Tensor::new(p.iter().map(|&i| i as u32).collect::<Vec<_>>(), &Device::Cpu).expect("idx"), 1)).collect::<Result<_>>()?;
    let e = rel(&Tensor::cat(&plain, 1)?, &Tensor::cat(&want_rows, 1)?)?;
    assert!(e > 0.1, "the sinks must matter at these inputs: {e}");
    Ok(())
}

/// Ulysses (KV heads split and replicated, contiguous and zigzag order, a window, documents)
/// and 2-D Ulysses × ring (ring and halo window): the rank's sinks are its heads' slice.
#[test]
fn ulysses_and_2d_match_float64() -> Result<()> {
    let (b, t, h, hkv, d) = (1, 48, 4, 2, 8);
    let x = inputs(17, [b, t, h, hkv, d])?;
    let scale = 1.0 / (d as f64).sqrt();
    let docs = Documents::from_lengths(&[30, 18])?;
    for (causal, window, dd) in [(true, None, None), (false, None, None), (true, Some(5), None), (true, None, Some(&docs))] {
        let bd = band(t, causal, window, dd)?;
        let want = reference(&x, scale, &|i, j| bd.visible(0, i, j))?;
        let what = format!("causal {causal} window {window:?} docs {}", dd.is_some());
        // Ulysses: P 2 splits the KV heads, P 4 replicates them; zigzag order at P 4
        for (p, layout) in [(2usize, Layout::Contiguous), (4, Layout::Zigzag)] {
            let mut uo = UlyssesOpts { window, documents: dd.cloned(), ..UlyssesOpts::new(causal, scale) }.with_layout(layout, t, p)?;
            uo.row_sums = if p == 2 { RowSums::F32 } else { RowSums::Output };
            let m = move |g: &Group, q: &Tensor, k: &Tensor, v: &Tensor, z: &Sinks| ulysses_attention(q, k, v, g, &uo.clone().with_sinks(Some(z.clone())));
            check(&run_cp(&x, p, layout, &m)?, &want, TOL, &format!("Ulysses P {p} {layout:?} {what}"))?;
        }
        // 2-D: U 2 x R 2 (zigzag ring; a 5-key window is the halo exchange)
        let (u, r) = (2usize, 2usize);
        let uo = UspOpts { window, documents: dd.cloned(), ..UspOpts::new(causal, scale) };
        let res = run_ranks(u * r, |g: Group| {
            let groups = UspGroups::new(&g, u, r)?;
            let pos = usp_positions(uo.ring_layout, t, groups.ring.rank(), r, groups.ulysses.rank(), u)?;
            let sh = |y: &Tensor| usp_shard(y, uo.ring_layout, &groups, 1);
            let m = |_: &Group, q: &Tensor, k: &Tensor, v: &Tensor, z: &Sinks| usp_attention(q, k, v, &groups, &uo.clone().with_sinks(Some(z.clone())));
            Ok((pos.clone(), rank_run(&g, &x, &pos, &sh, &m)?))
        });
        check(&assemble(res.into_iter().collect::<Result<Vec<_>>>()?)?, &want, TOL, &format!("2-D U {u} x R {r} {what}"))?;
    }
    Ok(())
}

/// bf16 inputs and sinks: the ring and Ulysses follow the single-device bf16 op (the float64
/// reference pins that one above) as closely as one device follows float64.
#[test]
fn bf16_parallel_follows_one_device() -> Result<()> {
    let (b, t, h, hkv, d) = (2, 64, 4, 2, 16);
    let mut x = inputs(29, [b, t, h, hkv, d])?;
    for y in [&mut x.q, &mut x.k, &mut x.v, &mut x.dout, &mut x.sinks] {
        *y = y.to_dtype(DType::BF16)?;
    }
    let scale = 1.0 / (d as f64).sqrt();
    let one = run_cp(&x, 1, Layout::Contiguous, &|_, q, k, v, z| attention_sinks(q, k, v, z, &Mask::causal(), scale, RowSums::F32))?;
    let x64 = Inputs { q: x.q.to_dtype(DType::F32)?, k: x.k.to_dtype(DType::F32)?, v: x.v.to_dtype(DType::F32)?, dout: x.dout.to_dtype(DType::F32)?, sinks: x.sinks.to_dtype(DType::F32)? };
    let exact = reference(&x64, scale, &|i, j| j <= i)?;
    check(&one, &exact, 2e-2, "one device bf16 vs float64")?;
    let ring = run_cp(&x, 4, Layout::Zigzag, &|g, q, k, v, z| ring_attention(q, k, v, g, &CpOpts::default().with_sinks(Some(z.clone()))))?;
    check(&ring, &exact, 2e-2, "ring bf16 vs float64")?;
    check(&ring, &one, 2e-2, "ring bf16 vs one device")?;
    let uo = UlyssesOpts::new(true, scale).with_layout(Layout::Zigzag, t, 2)?;
    let uly = run_cp(&x, 2, Layout::Zigzag, &|g, q, k, v, z| ulysses_attention(q, k, v, g, &uo.clone().with_sinks(Some(z.clone()))))?;
    check(&uly, &exact, 2e-2, "Ulysses bf16 vs float64")
}

/// Decoding against a KV cache sharded over P ranks: the sinks join the merged rows once;
/// equals the float64 reference's last rows, on every rank.
#[test]
fn sharded_decode_with_sinks_matches_float64() -> Result<()> {
    let (b, t, h, hkv, d) = (2, 25, 4, 2, 8);
    let x = inputs(37, [b, t, h, hkv, d])?;
    let scale = 0.3;
    for window in [None, Some(6)] {
        let want = reference(&x, scale, &|i, j| j <= i && window.is_none_or(|w| i - j < w))?;
        for p in [1usize, 2, 3] {
            let res = run_ranks(p, |g: Group| {
                let r = g.rank();
                let mut cache = KvShard::new();
                let mine: Vec<usize> = (0..t).filter(|i| i % p == r).collect();
                let idx = Tensor::new(mine.iter().map(|&i| i as u32).collect::<Vec<_>>(), &Device::Cpu)?;
                cache.append(&x.k.index_select(&idx, 1)?, &x.v.index_select(&idx, 1)?, &mine)?;
                let z = Sinks::new(&x.sinks)?;
                sharded_decode_attention_sinks(&x.q.narrow(1, t - 2, 2)?, &[t - 2, t - 1], &cache, &g, scale, window, Some(&z))
            });
            for (r, o) in res.into_iter().enumerate() {
                let (o, l) = o?;
                let what = format!("decode P {p} rank {r} window {window:?}");
                assert!(rel(&o, &want[0].narrow(1, t - 2, 2)?)? < TOL, "{what}: out");
                assert!(rel(&l, &want[1].narrow(2, t - 2, 2)?)? < TOL, "{what}: lse");
            }
        }
    }
    Ok(())
}

/// Sinks of the wrong length are refused by name on every method; ranks that pass different
/// sinks are refused on every rank.
#[test]
fn bad_sinks_are_refused() -> Result<()> {
    let x = inputs(3, [1, 16, 4, 2, 8])?;
    let three = Sinks::new(&Tensor::zeros(3, DType::F32, &Device::Cpu)?)?;
    let res = run_ranks(2, |g: Group| {
        let sh = |y: &Tensor| shard(y, Layout::Zigzag, g.rank(), 2, 1);
        let (q, k, v) = (sh(&x.q)?, sh(&x.k)?, sh(&x.v)?);
        let o = CpOpts::default().with_sinks(Some(three.clone()));
        let e1 = ring_attention(&q, &k, &v, &g, &o).unwrap_err().to_string();
        let e2 = allgather_attention(&q, &k, &v, &g, &o).unwrap_err().to_string();
        let e3 = ulysses_attention(&q, &k, &v, &g, &UlyssesOpts::new(true, 0.3).with_sinks(Some(three.clone()))).unwrap_err().to_string();
        // the same length, different values on the two ranks
        let mine = Sinks::new(&Tensor::full(g.rank() as f32, 4, &Device::Cpu)?)?;
        let e4 = ring_attention(&q, &k, &v, &g, &CpOpts::default().with_sinks(Some(mine))).unwrap_err().to_string();
        Ok([e1, e2, e3, e4])
    });
    for r in res {
        let [e1, e2, e3, e4] = r?;
        for e in [&e1, &e2, &e3] {
            assert!(e.contains("3 sink logits") && e.contains("H = 4"), "{e}");
        }
        assert!(e4.contains("attention sinks"), "{e4}");
    }
    Ok(())
}
