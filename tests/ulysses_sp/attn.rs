//! Ulysses and 2-D attention on the oracle cases; error paths.

use crate::{all_ok, grad};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::cp::{self, Layout};
use candle_cp_ops::oracle::{run_single, AttnCase, AttnMetrics, AttnOutputs, AttnTol};
use candle_cp_ops::ulysses::{self, ulysses_attention, UlyssesOpts};
use candle_cp_ops::usp::{usp_attention, usp_positions, usp_shard, UspGroups, UspOpts};
use candle_cp_tests::{oracle_attn, oracle_attn_files};

fn oracle_cases() -> Result<Vec<AttnCase>> {
    oracle_attn_files().iter().map(|p| Ok(AttnCase::load(p)?)).collect()
}

/// Each rank returns the global positions of its rows and its local results; rebuild the
/// global tensors (rows along dim 1, lse along dim 2).
pub(crate) fn assemble(parts: Vec<(Vec<usize>, AttnOutputs)>) -> Result<AttnOutputs> {
    let pos: Vec<u32> = parts.iter().flat_map(|(p, _)| p.iter().map(|&x| x as u32)).collect();
    let mut inv = vec![0u32; pos.len()];
    for (i, &p) in pos.iter().enumerate() {
        inv[p as usize] = i as u32;
    }
    let inv = Tensor::new(inv, &Device::Cpu)?;
    let cat = |f: &dyn Fn(&AttnOutputs) -> &Tensor, dim: usize| -> Result<Tensor> {
        let ts: Vec<Tensor> = parts.iter().map(|(_, o)| f(o).clone()).collect();
        Ok(Tensor::cat(&ts, dim)?.contiguous()?.index_select(&inv, dim)?)
    };
    Ok(AttnOutputs {
        out: cat(&|o| &o.out, 1)?,
        lse: cat(&|o| &o.lse, 2)?,
        dq: cat(&|o| &o.dq, 1)?,
        dk: cat(&|o| &o.dk, 1)?,
        dv: cat(&|o| &o.dv, 1)?,
    })
}

pub(crate) type ShardFn<'a> = &'a dyn Fn(&Tensor) -> candle_core::Result<Tensor>;
pub(crate) type AttnFn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<(Tensor, Tensor)>;

/// Forward + backward of `sum(out * dout)` on local shards; `attn` is the parallel op.
pub(crate) fn local_run(case: &AttnCase, shard: ShardFn, attn: AttnFn) -> candle_core::Result<AttnOutputs> {
    let (q, k, v) = (Var::from_tensor(&shard(&case.q)?)?, Var::from_tensor(&shard(&case.k)?)?, Var::from_tensor(&shard(&case.v)?)?);
    let (out, lse) = attn(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
    let grads = (&out * shard(&case.dout)?)?.sum_all()?.backward()?;
    Ok(AttnOutputs { out, lse, dq: grad(&grads, q.as_tensor(), "q")?, dk: grad(&grads, k.as_tensor(), "k")?, dv: grad(&grads, v.as_tensor(), "v")? })
}

/// Compare against the oracle (its tolerances) and the single-device op (the oracle's
/// tolerances times `tight`).
pub(crate) fn check_case(what: &str, case: &AttnCase, single: &AttnOutputs, got: &AttnOutputs, tight: f64) -> Result<()> {
    let tol = case.tolerances();
    let m = AttnMetrics::compute(got, &case.reference)?;
    assert!(m.passes(&tol), "{what} vs oracle:\n{}", m.report(&tol));
    let tight: AttnTol = tol.scaled(tight);
    let s = AttnMetrics::compute(got, single)?;
    assert!(s.passes(&tight), "{what} vs single device:\n{}", s.report(&tight));
    let row = |m: &AttnMetrics| format!("{:.1e} {:.1e} {:.1e} {:.1e} {:.1e}", m.out_abs, m.lse_abs, m.dq_rel, m.dk_rel, m.dv_rel);
    eprintln!("{what:<55} oracle [{}]  single [{}]", row(&m), row(&s));
    Ok(())
}

fn dims(case: &AttnCase) -> (usize, usize, usize) {
    (case.q.dim(1).unwrap(), case.q.dim(2).unwrap(), case.k.dim(2).unwrap())
}

#[test]
fn ulysses_on_oracle_cases() -> Result<()> {
    let mut ran = 0;
    let mut replicated = 0;
    for case in oracle_cases()? {
        let (t, h, hkv) = dims(&case);
        let single = run_single(&case)?;
        for p in [2usize, 4, 8] {
            if !ulysses::valid_ulysses_degrees(h, hkv).contains(&p) || t % p != 0 {
                continue;
            }
            // contiguous for every case; zigzag/striped sequence order on causal cases
            let mut layouts = vec![Layout::Contiguous];
            if case.causal && p == 2 && t <= 256 {
                layouts.extend([Layout::Zigzag, Layout::Striped]);
            }
            for layout in layouts {
                if t % layout.divisor(p) != 0 {
                    continue;
                }
                let parts = all_ok(run_ranks(p, |g: Group| {
                    let r = g.rank();
                    let opts = UlyssesOpts::new(case.causal, case.scale).with_layout(layout, t, p)?;
                    let shard = |x: &Tensor| cp::shard(x, layout, r, p, 1);
                    let o = local_run(&case, &shard, &|q, k, v| ulysses_attention(q, k, v, &g, &opts))?;
                    Ok((cp::positions(layout, r, p, t)?, o))
                }))?;
                check_case(&format!("ulysses {} P = {p} {layout}", case.name), &case, &single, &assemble(parts)?, 0.1)?;
                ran += 1;
                replicated += usize::from(hkv < p);
            }
        }
    }
    assert!(ran >= 12 && replicated >= 4, "too few Ulysses runs: {ran} ({replicated} with KV replication)");
    Ok(())
}

#[test]
fn usp_2d_on_oracle_cases() -> Result<()> {
    let mut ran = 0;
    let mut replicated = 0;
    for case in oracle_cases()? {
        let (t, h, hkv) = dims(&case);
        let single = run_single(&case)?;
        for (u, r) in [(2usize, 2usize), (4, 2), (2, 4)] {
            let ok = ulysses::valid_ulysses_degrees(h, hkv).contains(&u) && t % (2 * r) == 0 && (t / r) % u == 0;
            if !ok || (r == 4 && t > 1000) {
                continue;
            }
            let parts = all_ok(run_ranks(u * r, |g: Group| {
                let groups = UspGroups::new(&g, u, r)?;
                // documented rank order: world rank = ring index · U + Ulysses index
                if g.rank() != groups.ring.rank() * u + groups.ulysses.rank() {
                    candle_core::bail!("rank order: world {} ring {} ulysses {}", g.rank(), groups.ring.rank(), groups.ulysses.rank())
                }
                let opts = UspOpts::new(case.causal, case.scale);
                let shard = |x: &Tensor| usp_shard(x, Layout::Zigzag, &groups, 1);
                let o = local_run(&case, &shard, &|q, k, v| usp_attention(q, k, v, &groups, &opts))?;
                Ok((usp_positions(Layout::Zigzag, t, groups.ring.rank(), r, groups.ulysses.rank(), u)?, o))
            }))?;
            check_case(&format!("usp {} U = {u} R = {r}", case.name), &case, &single, &assemble(parts)?, 0.5)?;
            ran += 1;
            replicated += usize::from(hkv < u);
        }
    }
    assert!(ran >= 8 && replicated >= 3, "too few 2-D runs: {ran} ({replicated} with KV replication)");
    Ok(())
}

// ---------------------------------------------------------------- error paths

#[test]
fn ulysses_errors_name_heads_and_degrees() -> Result<()> {
    let z = |h: usize| Tensor::zeros((1, 4, h, 8), DType::F32, &Device::Cpu);
    // H = 6 over P = 4
    let res = run_ranks(4, |g: Group| {
        let e = ulysses_attention(&z(6)?, &z(6)?, &z(6)?, &g, &UlyssesOpts::new(true, 0.3));
        Ok(e.err().map(|e| e.to_string()).unwrap_or_default())
    });
    for m in all_ok(res)? {
        assert!(m.contains("H = 6") && m.contains("P = 4"), "{m}");
    }
    // H = 12, Hkv = 3 over P = 5: the message lists every divisor of H (KV heads are split or
    // replicated to fit any of them, `kv_lcm.rs`)
    let res = run_ranks(5, |g: Group| {
        let e = ulysses_attention(&z(12)?, &z(3)?, &z(3)?, &g, &UlyssesOpts::new(false, 0.3));
        Ok(e.err().map(|e| e.to_string()).unwrap_or_default())
    });
    for m in all_ok(res)? {
        assert!(m.contains("Hkv = 3") && m.contains("P = 5") && m.contains("[1, 2, 3, 4, 6, 12]"), "{m}");
    }
    // 2-D: the Ulysses degree is checked the same way; U·R must be the world size
    let res = run_ranks(4, |g: Group| {
        let groups = UspGroups::new(&g, 4, 1)?;
        let e = usp_attention(&z(10)?, &z(5)?, &z(5)?, &groups, &UspOpts::new(true, 0.3));
        let bad = UspGroups::new(&g, 3, 1).err().map(|e| e.to_string()).unwrap_or_default();
        Ok((e.err().map(|e| e.to_string()).unwrap_or_default(), bad))
    });
    for (m, bad) in all_ok(res)? {
        assert!(m.contains("P = 4") && m.contains("[1, 2, 5, 10]"), "{m}");
        assert!(bad.contains("U = 3") && bad.contains("world size 4"), "{bad}");
    }
    Ok(())
}

#[test]
fn ulysses_and_usp_bf16_match_single_device_bf16() -> Result<()> {
    let path = oracle_attn("b2_t256_h8_kv2_d64_causal.safetensors");
    let mut case = AttnCase::load(path)?;
    for x in [&mut case.q, &mut case.k, &mut case.v, &mut case.dout] {
        *x = x.to_dtype(DType::BF16)?;
    }
    let single = run_single(&case)?;
    let f32s = |o: AttnOutputs| -> candle_core::Result<AttnOutputs> {
        let c = |t: &Tensor| t.to_dtype(DType::F32);
        Ok(AttnOutputs { out: c(&o.out)?, lse: c(&o.lse)?, dq: c(&o.dq)?, dk: c(&o.dk)?, dv: c(&o.dv)? })
    };
    let single = f32s(single)?;
    // Ulysses runs the single-device kernel on the same bf16 values: out and dq are the op's,
    // bit for bit; the replicated KV heads' gradients leave the kernel in f32 and are summed
    // before one rounding, so dk / dv differ from the op's (which sums the query heads of a
    // KV head in f32 too) only where the two f32 sums round to neighbouring bf16 values
    // (measured 1.5e-5 / 3.8e-7; summing the copies in bf16 gave 7.6e-3 on dk).
    let tol_ulysses = AttnTol { out_abs: 1e-6, lse_abs: 1e-5, dq_rel: 1e-6, dk_rel: 1e-3, dv_rel: 1e-3 };
    // 2-D: the ring's merge adds f32 rounding differences, which bf16 rounding can turn into
    // one ulp (8 mantissa bits).
    let tol = AttnTol { out_abs: 1e-2, lse_abs: 1e-5, dq_rel: 1e-2, dk_rel: 1e-2, dv_rel: 1e-2 };
    let (t, p) = (256usize, 4usize);
    let parts = all_ok(run_ranks(p, |g: Group| {
        let r = g.rank();
        let opts = UlyssesOpts::new(true, case.scale);
        let shard = |x: &Tensor| cp::shard(x, Layout::Contiguous, r, p, 1);
        let o = local_run(&case, &shard, &|q, k, v| ulysses_attention(q, k, v, &g, &opts))?;
        if o.out.dtype() != DType::BF16 || o.dk.dtype() != DType::BF16 {
            candle_core::bail!("dtypes out {:?}, dk {:?}", o.out.dtype(), o.dk.dtype())
        }
        Ok((cp::positions(Layout::Contiguous, r, p, t)?, f32s(o)?))
    }))?;
    let m = AttnMetrics::compute(&assemble(parts)?, &single)?;
    eprintln!("ulysses bf16 P = 4 vs single bf16: {m:?}");
    assert!(m.passes(&tol_ulysses), "ulysses bf16:\n{}", m.report(&tol_ulysses));
    let parts = all_ok(run_ranks(4, |g: Group| {
        let groups = UspGroups::new(&g, 2, 2)?;
        let opts = UspOpts::new(true, case.scale);
        let shard = |x: &Tensor| usp_shard(x, Layout::Zigzag, &groups, 1);
        let o = local_run(&case, &shard, &|q, k, v| usp_attention(q, k, v, &groups, &opts))?;
        Ok((usp_positions(Layout::Zigzag, t, groups.ring.rank(), 2, groups.ulysses.rank(), 2)?, f32s(o)?))
    }))?;
    let m = AttnMetrics::compute(&assemble(parts)?, &single)?;
    eprintln!("usp bf16 2x2 vs single bf16: {m:?}");
    assert!(m.passes(&tol), "usp bf16:\n{}", m.report(&tol));
    Ok(())
}
