//! Bytes sent per rank by each method, against the formulas of docs/parallelism.md.

use crate::{all_ok, rand_t, total, Counting};
use anyhow::Result;
use candle_core::{Module, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_nn::{ColumnParallelLinear, RowParallelLinear, Tp};
use candle_cp_ops::cp::{self, Layout};
use candle_cp_ops::ulysses::{ulysses_attention, HeadLayout, UlyssesOpts};
use candle_cp_ops::usp::{usp_attention, UspGroups, UspOpts};

type AttnFn<'a> = &'a (dyn Fn(&Tensor, &Tensor, &Tensor, &Group) -> candle_core::Result<(Tensor, Tensor)> + Sync);

/// Bytes rank 0 sends in forward and in backward of `sum(f(q, k, v) * 1)`.
fn measure_attn(p: usize, dims: (usize, usize, usize, usize, usize), f: AttnFn) -> Result<(f64, f64)> {
    let (b, t, h, hkv, d) = dims;
    let res = all_ok(run_ranks(p, |g: Group| {
        let (g, log) = Counting::wrap(g);
        let mk = |n: &str, hh: usize| Var::from_tensor(&rand_t(g.rank() as u64, n, &[b, t / p, hh, d])?);
        let (q, k, v) = (mk("q", h)?, mk("k", hkv)?, mk("v", hkv)?);
        let (out, _) = f(q.as_tensor(), k.as_tensor(), v.as_tensor(), &g)?;
        let fwd = total(&log);
        out.sum_all()?.backward()?;
        Ok((fwd, total(&log) - fwd))
    }))?;
    Ok(res[0])
}

#[test]
fn comm_volume_matches_formulas() -> Result<()> {
    let (p, b, t, h, hkv, d) = (4usize, 1usize, 256usize, 8usize, 2usize, 16usize);
    let s = 4.0; // f32 bytes
    let frac = (p as f64 - 1.0) / p as f64;
    let local = (b * t / p * d) as f64 * s; // bytes of one head of a local shard
    let scale = 1.0 / (d as f64).sqrt();
    let dims = (b, t, h, hkv, d);

    // Ulysses: q, k, v (KV replicated to P heads), out, and lse all-to-alls; backward moves
    // dout, dq, dk, dv (no lse).
    let (fwd, bwd) = measure_attn(p, dims, &|q, k, v, g| ulysses_attention(q, k, v, g, &UlyssesOpts::new(true, scale)))?;
    let hkv_sent = hkv.max(p) as f64;
    let want_fwd = frac * local * (2.0 * h as f64 + 2.0 * hkv_sent) + frac * (b * h * t / p) as f64 * 4.0;
    let want_bwd = frac * local * (2.0 * h as f64 + 2.0 * hkv_sent);
    assert_eq!((fwd, bwd), (want_fwd, want_bwd), "Ulysses bytes per rank (fwd, bwd)");
    eprintln!("ulysses  P={p}: fwd {fwd:>9.0} B  bwd {bwd:>9.0} B");
    // head layout regathered: the backward sends q, k, v and out to heads again
    let re = UlyssesOpts::new(true, scale).with_head_layout(HeadLayout::Regathered);
    let (fwd_re, bwd_re) = measure_attn(p, dims, &|q, k, v, g| ulysses_attention(q, k, v, g, &re))?;
    assert_eq!((fwd_re, bwd_re), (want_fwd, 2.0 * want_bwd), "Ulysses bytes, head layout regathered");
    eprintln!("ulysses  P={p}: fwd {fwd_re:>9.0} B  bwd {bwd_re:>9.0} B  (heads regathered)");

    // Ring (any layout): K/V of one shard per hop, P-1 hops; backward: K/V again plus the f32
    // dK/dV accumulators, P hops (docs/parallelism.md §3). All-gather KV: the same forward
    // bytes at once; backward all-gathers K/V again and reduce-scatters f32 dK/dV of global
    // length (§5).
    let kv_local = 2.0 * local * hkv as f64;
    let pm1 = p as f64 - 1.0;
    for layout in Layout::ALL {
        let opts = cp::CpOpts::new(layout, true);
        let (fwd, bwd) = measure_attn(p, dims, &|q, k, v, g| cp::ring_attention(q, k, v, g, &opts))?;
        assert_eq!((fwd, bwd), (pm1 * kv_local, pm1 * kv_local + p as f64 * kv_local), "ring ({layout}) bytes, §3");
        eprintln!("ring     P={p}: fwd {fwd:>9.0} B  bwd {bwd:>9.0} B  ({layout})");
    }
    let opts = cp::CpOpts::new(Layout::Zigzag, true);
    let (fwd, bwd) = measure_attn(p, dims, &|q, k, v, g| cp::allgather_attention(q, k, v, g, &opts))?;
    assert_eq!((fwd, bwd), (pm1 * kv_local, pm1 * kv_local + frac * (2 * b * t * hkv * d) as f64 * 4.0), "all-gather KV bytes, §5");
    eprintln!("allgather P={p}: fwd {fwd:>9.0} B  bwd {bwd:>9.0} B  (zigzag)");

    // 2-D, U = R = 2: Ulysses part over U on T/R-row groups, then the ring over R with
    // Hkv'/U KV heads (§6).
    let (u, r) = (2usize, 2usize);
    let (fwd, bwd) = measure_attn(p, dims, &|q, k, v, g| {
        let groups = UspGroups::new(g, u, r)?;
        usp_attention(q, k, v, &groups, &UspOpts::new(true, scale))
    })?;
    let uf = (u as f64 - 1.0) / u as f64;
    let uly = uf * (b * t / (r * u) * d) as f64 * s * (2 * h + 2 * hkv.max(u)) as f64;
    let lse = uf * (b * h * t / (r * u)) as f64 * 4.0;
    let ring_kv = 2.0 * (b * t / r * (hkv.max(u) / u) * d) as f64 * s;
    let want = (uly + lse + (r as f64 - 1.0) * ring_kv, uly + (r as f64 - 1.0) * ring_kv + r as f64 * ring_kv);
    assert_eq!((fwd, bwd), want, "2-D bytes, §6");
    eprintln!("usp  U={u} R={r}: fwd {fwd:>9.0} B  bwd {bwd:>9.0} B");
    let (fwd_re, bwd_re) = measure_attn(p, dims, &|q, k, v, g| {
        let groups = UspGroups::new(g, u, r)?;
        usp_attention(q, k, v, &groups, &UspOpts::new(true, scale).with_head_layout(HeadLayout::Regathered))
    })?;
    assert_eq!((fwd_re, bwd_re), (want.0, want.1 + uly), "2-D bytes, head layout regathered");
    eprintln!("usp  U={u} R={r}: fwd {fwd_re:>9.0} B  bwd {bwd_re:>9.0} B  (heads regathered)");

    // Megatron: an MLP (column + row parallel) moves 4(P-1)/P·B·T·C·s per rank without SP
    // (two all-reduces) and 5(P-1)/P·B·T·C·s with SP (all-gather + reduce-scatter in the
    // forward; in the backward the column-parallel input all-gathered again, its gradient
    // reduce-scattered and the row-parallel output's gradient all-gathered).
    let (c, f) = (32usize, 64usize);
    let w1 = rand_t(1, "w1", &[f, c])?;
    let w2 = rand_t(2, "w2", &[c, f])?;
    for sp in [true, false] {
        let res = all_ok(run_ranks(p, |g: Group| {
            let (g, log) = Counting::wrap(g);
            let tp = Tp::new(g.clone(), sp);
            let (l1, l2) = (ColumnParallelLinear::from_full(&w1, None, &tp)?, RowParallelLinear::from_full(&w2, None, &tp)?);
            let tl = if sp { t / p } else { t };
            let x = Var::from_tensor(&rand_t(g.rank() as u64, "x", &[b, tl, c])?)?;
            l2.forward(&l1.forward(x.as_tensor())?.gelu()?)?.sum_all()?.backward()?;
            Ok(total(&log))
        }))?;
        let want = if sp { 5.0 } else { 4.0 } * frac * (b * t * c) as f64 * s;
        assert_eq!(res[0], want, "MLP bytes per rank with SP = {sp}");
        eprintln!("megatron MLP P={p} SP={sp}: fwd+bwd {:>9.0} B", res[0]);
    }
    Ok(())
}
