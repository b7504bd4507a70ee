//! `HeadLayout::Regathered` (the backward all-to-alls q, k, v and the output to heads again
//! instead of keeping them): the same results as `HeadLayout::Kept`, bit for bit, on Ulysses
//! and 2-D, f32 and bf16, split and replicated KV heads, permuted sequence orders; a second
//! backward over the same graph gives the same gradients.

use crate::attn::{assemble, check_case, local_run};
use crate::{all_ok, grad, max_abs};
use anyhow::Result;
use candle_core::{DType, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_ops::cp::{self, Layout};
use candle_cp_ops::attention::{attention_with, RowSums};
use candle_cp_ops::oracle::{run_single, run_single_with, AttnCase, AttnOutputs};
use candle_cp_ops::ulysses::{ulysses_attention, HeadLayout, UlyssesOpts};
use candle_cp_ops::usp::{usp_attention, usp_positions, usp_shard, UspGroups, UspOpts};
use candle_cp_tests::oracle_attn;

fn case(name: &str, dtype: DType) -> Result<AttnCase> {
    let mut case = AttnCase::load(oracle_attn(name))?;
    for x in [&mut case.q, &mut case.k, &mut case.v, &mut case.dout] {
        *x = x.to_dtype(dtype)?;
    }
    Ok(case)
}

/// Largest |a - b| over out, lse, dq, dk, dv.
fn max_diff(a: &AttnOutputs, b: &AttnOutputs) -> Result<f64> {
    let pairs = [(&a.out, &b.out), (&a.lse, &b.lse), (&a.dq, &b.dq), (&a.dk, &b.dk), (&a.dv, &b.dv)];
    pairs.iter().try_fold(0f64, |m, (x, y)| Ok(m.max(max_abs(x, y)?)))
}

/// Ulysses over `p` ranks with `layout` sharding, in both head-layout modes.
fn ulysses_both(case: &AttnCase, p: usize, layout: Layout) -> Result<[AttnOutputs; 2]> {
    ulysses_both_rows(case, p, layout, RowSums::Output)
}

/// [`ulysses_both`] with the backward's row sums taken as `rows` says.
fn ulysses_both_rows(case: &AttnCase, p: usize, layout: Layout, rows: RowSums) -> Result<[AttnOutputs; 2]> {
    let t = case.q.dim(1)?;
    let run = |mode: HeadLayout| -> Result<AttnOutputs> {
        let parts = all_ok(run_ranks(p, |g: Group| {
            let r = g.rank();
            let opts = UlyssesOpts::new(case.causal, case.scale).with_layout(layout, t, p)?.with_head_layout(mode).with_row_sums(rows);
            let shard = |x: &Tensor| cp::shard(x, layout, r, p, 1);
            let o = local_run(case, &shard, &|q, k, v| ulysses_attention(q, k, v, &g, &opts))?;
            Ok((cp::positions(layout, r, p, t)?, o))
        }))?;
        assemble(parts)
    };
    Ok([run(HeadLayout::Kept)?, run(HeadLayout::Regathered)?])
}

/// 2-D over `u × r` ranks (zigzag ring), in both head-layout modes.
fn usp_both(case: &AttnCase, u: usize, r: usize) -> Result<[AttnOutputs; 2]> {
    let t = case.q.dim(1)?;
    let run = |mode: HeadLayout| -> Result<AttnOutputs> {
        let parts = all_ok(run_ranks(u * r, |g: Group| {
            let groups = UspGroups::new(&g, u, r)?;
            let opts = UspOpts::new(case.causal, case.scale).with_head_layout(mode);
            let shard = |x: &Tensor| usp_shard(x, Layout::Zigzag, &groups, 1);
            let o = local_run(case, &shard, &|q, k, v| usp_attention(q, k, v, &groups, &opts))?;
            Ok((usp_positions(Layout::Zigzag, t, groups.ring.rank(), r, groups.ulysses.rank(), u)?, o))
        }))?;
        assemble(parts)
    };
    Ok([run(HeadLayout::Kept)?, run(HeadLayout::Regathered)?])
}

#[test]
fn regathered_head_layout_equals_kept() -> Result<()> {
    // (file, Ulysses degree and sharding): GQA with KV heads replicated (P = 4 > Hkv = 2) on
    // contiguous shards, split KV heads on zigzag shards (a permuted gathered order), full mask
    for (name, p, layout) in [
        ("b2_t256_h8_kv2_d64_causal.safetensors", 4, Layout::Contiguous),
        ("b2_t256_h8_kv2_d64_causal.safetensors", 2, Layout::Zigzag),
        ("b1_t512_h4_kv2_d128_full.safetensors", 2, Layout::Contiguous),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let c = case(name, dtype)?;
            let [kept, regathered] = ulysses_both(&c, p, layout)?;
            let d = max_diff(&kept, &regathered)?;
            eprintln!("ulysses {name} P = {p} {layout} {dtype:?}: regathered vs kept max |diff| {d:e}");
            assert_eq!(d, 0.0, "ulysses {name} P = {p} {layout} {dtype:?}: regathered differs from kept");
            if dtype == DType::F32 {
                let single = run_single(&c)?;
                check_case(&format!("ulysses regathered {name} P = {p} {layout}"), &c, &single, &regathered, 0.1)?;
            }
        }
    }
    // 2-D: the ring backward rebuilds its f32 output from the output and its bf16 residual in
    // both modes, so bf16 is bit-identical too
    for (name, u, r) in [("b2_t256_h8_kv2_d64_causal.safetensors", 4, 2), ("b1_t64_h4_kv4_d32_causal.safetensors", 2, 2)] {
        for dtype in [DType::F32, DType::BF16] {
            let c = case(name, dtype)?;
            let [kept, regathered] = usp_both(&c, u, r)?;
            let d = max_diff(&kept, &regathered)?;
            eprintln!("usp {name} U = {u} R = {r} {dtype:?}: regathered vs kept max |diff| {d:e}");
            assert_eq!(d, 0.0, "usp {name} {u}x{r} {dtype:?}: regathered differs from kept");
            if dtype == DType::F32 {
                let single = run_single(&c)?;
                check_case(&format!("usp regathered {name} U = {u} R = {r}"), &c, &single, &regathered, 0.5)?;
            }
        }
    }
    Ok(())
}

/// Ulysses with `RowSums::F32` (a bf16 residual of the head-layout output kept for the
/// backward's row sums): kept and regathered head layouts bit-identical; in f32 the same as
/// the default mode; in bf16 on a peaked softmax dq and dk move to the single-device op with
/// f32 row sums: measured equal (dk 1.3e-7 relative at P = 4, where the replicated KV heads'
/// gradients are summed in another order), against 2.8e-3 for the default mode; dv and the
/// forward do not read the row sums.
#[test]
fn f32_row_sums_under_both_head_layouts() -> Result<()> {
    for (name, p, layout) in [
        ("b2_t256_h8_kv2_d64_causal.safetensors", 4, Layout::Contiguous),
        ("b2_t256_h8_kv2_d64_causal.safetensors", 2, Layout::Zigzag),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let mut c = case(name, dtype)?;
            // a peaked softmax: the row sums' rounding shows
            c.q = (c.q.to_dtype(DType::F32)? * 3.0)?.to_dtype(dtype)?;
            let [kept, regathered] = ulysses_both_rows(&c, p, layout, RowSums::F32)?;
            let what = format!("ulysses f32 row sums {name} P = {p} {layout} {dtype:?}");
            assert_eq!(max_diff(&kept, &regathered)?, 0.0, "{what}: regathered differs from kept");
            let [op_rows, _] = ulysses_both(&c, p, layout)?;
            if dtype == DType::F32 {
                assert_eq!(max_diff(&kept, &op_rows)?, 0.0, "{what}: differs from the default mode in f32");
                continue;
            }
            let single = |rs: RowSums| run_single_with(&c, |q, k, v| attention_with(q, k, v, &c.mask(), c.scale, rs));
            let (s32, sop) = (single(RowSums::F32)?, single(RowSums::Output)?);
            let rel = |a: &Tensor, b: &Tensor| -> Result<f64> {
                let f = |x: &Tensor| x.to_dtype(DType::F64);
                let n = |x: Tensor| -> Result<f64> { Ok(x.sqr()?.sum_all()?.sqrt()?.to_scalar::<f64>()?) };
                Ok(n((f(a)? - f(b)?)?)? / n(f(b)?)?)
            };
            for (n, got, op, want, other) in [
                ("dq", &kept.dq, &op_rows.dq, &s32.dq, &sop.dq),
                ("dk", &kept.dk, &op_rows.dk, &s32.dk, &sop.dk),
            ] {
                let (e, e_op, e_other) = (rel(got, want)?, rel(op, want)?, rel(got, other)?);
                eprintln!("{what}: {n} vs the op with f32 row sums {e:.2e} (default mode {e_op:.2e}; vs the default op {e_other:.2e})");
                assert!(e < 1e-5 && e_op > 1e-3 && e_other > 1e-3, "{what}: {n} {e:.2e}, default mode {e_op:.2e}, vs the default op {e_other:.2e}");
            }
            assert_eq!(max_abs(&kept.dv, &op_rows.dv)?, 0.0, "{what}: dv");
            assert_eq!(max_abs(&kept.out, &op_rows.out)?, 0.0, "{what}: out");
        }
    }
    Ok(())
}

#[test]
fn regathered_second_backward_gives_the_same_gradients() -> Result<()> {
    let c = case("b2_t256_h8_kv2_d64_causal.safetensors", DType::F32)?;
    let res = run_ranks(4, |g: Group| {
        let groups = UspGroups::new(&g, 2, 2)?;
        let mut diffs = vec![];
        for two_d in [false, true] {
            let shard = |x: &Tensor| match two_d {
                false => cp::shard(x, Layout::Contiguous, g.rank(), 4, 1),
                true => usp_shard(x, Layout::Zigzag, &groups, 1),
            };
            let (q, k, v) = (Var::from_tensor(&shard(&c.q)?)?, Var::from_tensor(&shard(&c.k)?)?, Var::from_tensor(&shard(&c.v)?)?);
            let out = match two_d {
                false => {
                    let o = UlyssesOpts::new(true, c.scale).with_head_layout(HeadLayout::Regathered);
                    ulysses_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &g, &o)?.0
                }
                true => {
                    let o = UspOpts::new(true, c.scale).with_head_layout(HeadLayout::Regathered);
                    usp_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &groups, &o)?.0
                }
            };
            let loss = out.sqr()?.sum_all()?;
            let (a, b) = (loss.backward()?, loss.backward()?);
            for x in [&q, &k, &v] {
                let (ga, gb) = (grad(&a, x.as_tensor(), "first")?, grad(&b, x.as_tensor(), "second")?);
                diffs.push((ga - gb)?.abs()?.max_all()?.to_scalar::<f32>()?);
            }
        }
        Ok(diffs)
    });
    for (rank, diffs) in all_ok(res)?.into_iter().enumerate() {
        assert!(diffs.iter().all(|&d| d == 0.0), "rank {rank}: second backward differs: {diffs:?}");
    }
    Ok(())
}
