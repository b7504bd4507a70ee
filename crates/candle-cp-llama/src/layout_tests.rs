//! Tests of `layout` (included by `layout.rs`).

use super::*;
use candle_core::Device;
use candle_cp_comm::run_ranks;

/// Every (layout, rank): labels are the global next token, every position held once
/// per TP-replica set, positions match the ids.
#[test]
fn shard_batch_labels_follow_global_positions() -> Result<()> {
    let t = 32usize;
    let ids: Vec<u32> = (0..t as u32).map(|i| 1000 + i).collect();
    let ids = Tensor::from_vec(ids, (1, t), &Device::Cpu)?;
    let layouts = [
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
        Layout::cp(CpKind::Striped, 4),
        Layout::cp(CpKind::Ulysses, 2).with_tp(2, false),
        Layout::two_d(2, 2),
    ];
    for layout in layouts {
        let res = run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let b = shard_batch(&ids, &ctx)?;
            let (i, l, p) = (
                b.input_ids.to_vec2::<u32>()?,
                b.labels.to_vec2::<u32>()?,
                b.positions.to_vec1::<u32>()?,
            );
            Ok((i, l, p))
        });
        let mut seen = vec![0usize; t];
        for r in res {
            let (i, l, p) = r?;
            for (j, &pos) in p.iter().enumerate() {
                seen[pos as usize] += 1;
                assert_eq!(i[0][j], 1000 + pos, "{layout}");
                let want = if pos as usize == t - 1 { IGNORE } else { 1001 + pos };
                assert_eq!(l[0][j], want, "{layout}");
            }
        }
        let copies = if layout.seq_parallel() { 1 } else { layout.tp };
        assert!(seen.iter().all(|&c| c == copies), "{layout}: {seen:?}");
    }
    Ok(())
}

/// `grad_group` for DP 2 × CP 2 × TP 4 (SP) with 2 KV heads: K/V gradients are summed
/// over every rank holding the same KV head, across all DP and CP indices (8 of the 16
/// ranks); split weights over DP × CP (4 ranks); replicated ones over the world (SP).
#[test]
fn grad_groups_hold_the_copies() -> Result<()> {
    let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(4, true).with_dp(2);
    let res = run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g.clone(), layout)?;
        let members = |grp: &Group| -> Result<Vec<u32>> {
            let me = Tensor::new(&[g.rank() as f32], &Device::Cpu)?;
            Ok(grp.all_gather(&me, 0)?.to_vec1::<f32>()?.iter().map(|&x| x as u32).collect())
        };
        let kv = members(&ctx.grad_group(Shard::RowBlocks(2))?)?;
        // asked again: the cached group, no new collective
        let again = members(&ctx.grad_group(Shard::RowBlocks(2))?)?;
        let rows = members(&ctx.grad_group(Shard::Rows)?)?;
        let repl = ctx.grad_group(Shard::Replicated)?.size();
        let one_copy = ctx.grad_group(Shard::RowBlocks(8))?.size();
        Ok((kv, again, rows, repl, one_copy))
    });
    for (r, out) in res.into_iter().enumerate() {
        let (kv, again, rows, repl, one_copy) = out?;
        let head = (r % 4) / 2;
        let want: Vec<u32> = (0..16u32).filter(|w| ((w % 4) / 2) as usize == head).collect();
        assert_eq!(kv, want, "rank {r}");
        assert_eq!(again, want, "rank {r}");
        let want_rows: Vec<u32> = (0..16u32).filter(|w| w % 4 == r as u32 % 4).collect();
        assert_eq!(rows, want_rows, "rank {r}");
        assert_eq!((repl, one_copy), (16, 4), "rank {r}");
    }
    Ok(())
}

/// Expert parallelism 2 on DP 2 × CP 2 × TP 2: the EP group is the two consecutive DP × CP
/// ranks of one TP rank (`q = dp·2 + cp`, `q / 2` alike), the experts' gradient group the
/// ranks with the same `q mod 2` and TP rank; `ep_coords` is the index in the EP group.
#[test]
fn ep_groups_hold_consecutive_replicas() -> Result<()> {
    let layout = Layout::cp(CpKind::Zigzag, 2).with_tp(2, true).with_dp(2).with_ep(2);
    let res = run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g.clone(), layout)?;
        let members = |grp: &Group| -> Result<Vec<u32>> {
            let me = Tensor::new(&[g.rank() as f32], &Device::Cpu)?;
            Ok(grp.all_gather(&me, 0)?.to_vec1::<f32>()?.iter().map(|&x| x as u32).collect())
        };
        let ep = ctx.ep.as_ref().ok_or_else(|| candle_core::Error::Msg("no EP group".into()))?;
        Ok((members(ep)?, members(&ctx.ep_dp)?, ctx.ep_coords()))
    });
    for (r, out) in res.into_iter().enumerate() {
        let (ep, ep_dp, coords) = out?;
        let (tp_i, q) = (r % 2, r / 2);
        let want_ep: Vec<u32> = (0..4).filter(|&w| w / 2 == q / 2).map(|w| (w * 2 + tp_i) as u32).collect();
        let want_dp: Vec<u32> = (0..4).filter(|&w| w % 2 == q % 2).map(|w| (w * 2 + tp_i) as u32).collect();
        assert_eq!((ep, ep_dp, coords), (want_ep, want_dp, (q % 2, 2)), "rank {r}");
    }
    // EP must divide DP × CP
    let e = Layout::cp(CpKind::Zigzag, 2).with_ep(4).check_degrees().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("ep = 4 must divide dp · cp = 2"), "{e}");
    Ok(())
}

#[test]
fn bad_degrees_are_errors() {
    assert!(Layout::cp(CpKind::Ulysses, 3).validate(8, 2).is_err());
    // TP 4 over 2 KV heads replicates them; TP 3 over 2 copies each 3 times (2 per rank)
    assert!(Layout::single().with_tp(4, true).validate(8, 2).is_ok());
    assert!(Layout::single().with_tp(3, true).validate(6, 2).is_ok());
    let e = Layout::single().with_tp(3, true).validate(6, 4).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("kv heads (4) must divide heads (6)"), "{e}");
    assert!(Layout::single().with_tp(4, true).validate(6, 2).is_err());
    assert!(Layout::cp(CpKind::Ulysses, 4).validate(8, 2).is_ok());
    // a zero degree is refused before any model is known (the examples' flag check)
    for l in [Layout::cp(CpKind::Zigzag, 0), Layout::cp(CpKind::Zigzag, 2).with_dp(0), Layout::single().with_tp(0, false)] {
        let e = l.check_degrees().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("every degree must be at least 1"), "{l}: {e}");
    }
    assert!(Layout::two_d(2, 2).check_degrees().is_ok());
    let ids = Tensor::zeros((1, 10), DType::U32, &Device::Cpu).unwrap();
    let res = run_ranks(2, |g| {
        shard_batch(&ids, &ParallelCtx::new(g, Layout::cp(CpKind::Zigzag, 2))?).map(|_| ())
    });
    let e = res[0].as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("T = 10"), "{e}");
}
