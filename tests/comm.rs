//! ThreadGroup collectives, sub-groups, Mesh, ring send/recv, faults and mismatches.
//!
//! Every collective is checked against a serial computation on the host for P = 1, 2, 3, 4, 8
//! with seeded random f32 and bf16 tensors; reductions must match bit for bit (sum in rank
//! order, f32 accumulation) and be identical on every rank.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks, run_ranks_with, Group, Mesh, ThreadGroupOptions};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const PS: [usize; 5] = [1, 2, 3, 4, 8];

/// Deterministic pseudo-random values in [-1, 1) (xorshift), so tests need no RNG crate.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// One seeded tensor per rank, of `shape` and `dtype`.
fn inputs(p: usize, shape: &[usize], dtype: DType, seed: u64) -> Result<Vec<Tensor>> {
    let n: usize = shape.iter().product();
    (0..p)
        .map(|r| {
            Tensor::from_vec(values(n, seed * 1000 + r as u64), shape, &Device::Cpu)?
                .to_dtype(dtype)
        })
        .collect()
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// Exact comparison (bit patterns of the f32 view, so -0.0 != 0.0 and NaN == NaN).
fn assert_same(got: &Tensor, want: &Tensor, what: &str) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (host(got)?, host(want)?);
    let bad = g
        .iter()
        .zip(&w)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert!(
        bad.is_none(),
        "{what}: first difference at {bad:?}: {:?} vs {:?}",
        bad.map(|i| g[i]),
        bad.map(|i| w[i])
    );
    Ok(())
}

/// Serial reference of a sum over ranks: f32 accumulation in rank order, cast to `dtype`.
fn serial_sum(xs: &[Tensor]) -> Result<Tensor> {
    let mut acc = host(&xs[0])?;
    for x in &xs[1..] {
        for (a, b) in acc.iter_mut().zip(host(x)?) {
            *a += b;
        }
    }
    Tensor::from_vec(acc, xs[0].dims(), &Device::Cpu)?.to_dtype(xs[0].dtype())
}

fn all_ok<T>(results: Vec<Result<T>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r} failed: {e}")))
        .collect()
}

fn short_opts() -> ThreadGroupOptions {
    ThreadGroupOptions::with_timeout(Duration::from_secs(20))
}

#[test]
fn all_gather_matches_serial() -> Result<()> {
    for p in PS {
        for dtype in [DType::F32, DType::BF16] {
            for dim in 0..3 {
                let xs = inputs(p, &[2, 3, 5], dtype, 1 + dim as u64)?;
                let want = Tensor::cat(&xs, dim)?;
                let got = all_ok(run_ranks(p, |g| g.all_gather(&xs[g.rank()], dim)));
                for (r, t) in got.iter().enumerate() {
                    assert_same(
                        t,
                        &want,
                        &format!("all_gather p={p} {dtype:?} dim={dim} rank {r}"),
                    )?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn reduce_scatter_matches_serial() -> Result<()> {
    for p in PS {
        for dtype in [DType::F32, DType::BF16] {
            for dim in 0..3 {
                let mut shape = vec![3, 2, 5];
                shape[dim] = 2 * p;
                let xs = inputs(p, &shape, dtype, 10 + dim as u64)?;
                let sum = serial_sum(&xs)?;
                let got = all_ok(run_ranks(p, |g| g.reduce_scatter(&xs[g.rank()], dim)));
                for (r, t) in got.iter().enumerate() {
                    let want = sum.narrow(dim, 2 * r, 2)?;
                    assert_same(
                        t,
                        &want,
                        &format!("reduce_scatter p={p} {dtype:?} dim={dim} rank {r}"),
                    )?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn all_reduce_matches_serial_and_is_identical_on_all_ranks() -> Result<()> {
    for p in PS {
        for dtype in [DType::F32, DType::BF16] {
            let xs = inputs(p, &[4, 7, 3], dtype, 20)?;
            let want = serial_sum(&xs)?;
            let got = all_ok(run_ranks(p, |g| g.all_reduce(&xs[g.rank()])));
            for (r, t) in got.iter().enumerate() {
                assert_same(t, &want, &format!("all_reduce p={p} {dtype:?} rank {r}"))?;
                assert_same(
                    t,
                    &got[0],
                    &format!("all_reduce p={p} {dtype:?} rank {r} vs rank 0"),
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn reduce_scatter_then_all_gather_equals_all_reduce() -> Result<()> {
    for p in [2, 3, 4] {
        let xs = inputs(p, &[2 * p, 9], DType::BF16, 25)?;
        let got = all_ok(run_ranks(p, |g| {
            let rs = g.reduce_scatter(&xs[g.rank()], 0)?;
            Ok((g.all_gather(&rs, 0)?, g.all_reduce(&xs[g.rank()])?))
        }));
        for (r, (ag, ar)) in got.iter().enumerate() {
            assert_same(ag, ar, &format!("p={p} rank {r}"))?;
        }
    }
    Ok(())
}

#[test]
fn all_to_all_matches_serial() -> Result<()> {
    for p in PS {
        for dtype in [DType::F32, DType::BF16] {
            for (split_dim, concat_dim) in [(0, 1), (1, 0), (2, 1), (1, 1)] {
                let mut shape = vec![2, 3, 4];
                shape[split_dim] = 2 * p;
                let xs = inputs(p, &shape, dtype, 30 + split_dim as u64)?;
                let got = all_ok(run_ranks(p, |g| {
                    g.all_to_all(&xs[g.rank()], split_dim, concat_dim)
                }));
                for (j, t) in got.iter().enumerate() {
                    let parts = xs
                        .iter()
                        .map(|x| x.narrow(split_dim, 2 * j, 2))
                        .collect::<Result<Vec<_>>>()?;
                    let want = Tensor::cat(&parts, concat_dim)?;
                    let what = format!(
                        "all_to_all p={p} {dtype:?} split={split_dim} concat={concat_dim} rank {j}"
                    );
                    assert_same(t, &want, &what)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn broadcast_from_every_root() -> Result<()> {
    for p in PS {
        for dtype in [DType::F32, DType::BF16] {
            let xs = inputs(p, &[3, 4], dtype, 40)?;
            for root in 0..p {
                let got = all_ok(run_ranks(p, |g| g.broadcast(&xs[g.rank()], root)));
                for (r, t) in got.iter().enumerate() {
                    assert_same(
                        t,
                        &xs[root],
                        &format!("broadcast p={p} {dtype:?} root={root} rank {r}"),
                    )?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn barrier_waits_for_every_rank() -> Result<()> {
    for p in PS {
        let arrived = AtomicUsize::new(0);
        let seen = all_ok(run_ranks(p, |g| {
            std::thread::sleep(Duration::from_millis(5 * g.rank() as u64));
            arrived.fetch_add(1, Ordering::SeqCst);
            g.barrier()?;
            Ok(arrived.load(Ordering::SeqCst))
        }));
        assert!(
            seen.iter().all(|&n| n == p),
            "p={p}: ranks passed the barrier early: {seen:?}"
        );
    }
    Ok(())
}

#[test]
fn send_recv_ring_rotates_back_to_start() -> Result<()> {
    for p in PS {
        let xs = inputs(p, &[4, 8], DType::F32, 50)?;
        let w = Tensor::from_vec(values(64, 7), (8, 8), &Device::Cpu)?;
        all_ok(run_ranks(p, |g| {
            let (r, n) = (g.rank(), g.size());
            let mut cur = xs[r].clone();
            for step in 1..=n {
                let pending = g.send_recv(&cur, (r + 1) % n, (r + n - 1) % n)?;
                // compute while the chunk travels
                let busy = cur.matmul(&w)?.sum_all()?.to_scalar::<f32>()?;
                assert!(busy.is_finite());
                cur = pending.wait()?;
                let want = &xs[(r + n * 2 - step) % n];
                assert_same(&cur, want, &format!("ring p={p} rank {r} step {step}"))?;
            }
            assert_same(&cur, &xs[r], &format!("ring p={p} rank {r} back to start"))?;
            Ok(())
        }));
    }
    Ok(())
}

#[test]
fn split_orders_by_key_and_runs_collectives() -> Result<()> {
    for p in PS {
        let got = all_ok(run_ranks(p, |g| {
            let r = g.rank();
            // two colors; key reverses the order inside each color
            let sub = g.split(r % 2, p - r)?;
            let ids = Tensor::new(&[r as f32], &Device::Cpu)?;
            let members = sub.all_gather(&ids, 0)?.to_vec1::<f32>()?;
            let sum = sub.all_reduce(&ids)?.to_vec1::<f32>()?[0];
            Ok((sub.rank(), sub.size(), members, sum))
        }));
        for (r, (sr, ss, members, sum)) in got.into_iter().enumerate() {
            let mut want: Vec<f32> = (0..p)
                .filter(|q| q % 2 == r % 2)
                .map(|q| q as f32)
                .collect();
            want.reverse();
            assert_eq!(members, want, "p={p} rank {r} members");
            assert_eq!(ss, want.len());
            assert_eq!(want[sr], r as f32, "p={p} rank {r} sub-rank");
            assert_eq!(sum, want.iter().sum::<f32>());
        }
    }
    Ok(())
}

#[test]
fn mesh_rank_order_last_dim_fastest() -> Result<()> {
    let got = all_ok(run_ranks(8, |g| {
        let r = g.rank();
        let mesh = Mesh::new(g, &[("dp", 2), ("cp", 2), ("tp", 2)])?;
        let ids = Tensor::new(&[r as f32], &Device::Cpu)?;
        let mut out = vec![];
        for name in ["dp", "cp", "tp"] {
            let grp = mesh.group(name)?;
            assert_eq!(grp.rank(), mesh.coord(name)?);
            assert_eq!(grp.size(), mesh.size(name)?);
            out.push(grp.all_gather(&ids, 0)?.to_vec1::<f32>()?);
        }
        out.push(
            mesh.split_over(&["cp", "tp"])?
                .all_gather(&ids, 0)?
                .to_vec1::<f32>()?,
        );
        Ok(out)
    }));
    for (r, groups) in got.iter().enumerate() {
        let (dp, cp, tp) = (r / 4, (r / 2) % 2, r % 2);
        let f = |d: usize, c: usize, t: usize| (d * 4 + c * 2 + t) as f32;
        assert_eq!(
            groups[0],
            vec![f(0, cp, tp), f(1, cp, tp)],
            "rank {r} dp group"
        );
        assert_eq!(
            groups[1],
            vec![f(dp, 0, tp), f(dp, 1, tp)],
            "rank {r} cp group"
        );
        assert_eq!(
            groups[2],
            vec![f(dp, cp, 0), f(dp, cp, 1)],
            "rank {r} tp group"
        );
        let cptp: Vec<f32> = (0..4).map(|i| (dp * 4 + i) as f32).collect();
        assert_eq!(groups[3], cptp, "rank {r} cp x tp group");
    }
    Ok(())
}

#[test]
fn mesh_rejects_bad_dims() {
    let res = run_ranks(4, |g| Mesh::new(g, &[("cp", 3), ("tp", 2)]).map(|_| ()));
    for r in res {
        let e = r.expect_err("product 6 != 4 must fail").to_string();
        assert!(e.contains("cp") && e.contains('4'), "{e}");
    }
    let res = run_ranks(2, |g| {
        let mesh = Mesh::new(g, &[("cp", 2)])?;
        mesh.group("tp").map(|_| ())
    });
    assert!(res
        .iter()
        .all(|r| r.as_ref().is_err_and(|e| e.to_string().contains("tp"))));
}

/// Run `f` on `p` ranks with a generous timeout; every rank must fail quickly (well before
/// the timeout, so failures are propagated, not timed out); returns the error messages.
fn expect_all_fail(p: usize, f: impl Fn(Group) -> Result<()> + Send + Sync) -> Vec<String> {
    let start = Instant::now();
    let res = run_ranks_with(p, short_opts(), f);
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    res.into_iter()
        .enumerate()
        .map(|(r, x)| match x {
            Ok(()) => panic!("rank {r} succeeded"),
            Err(e) => e.to_string(),
        })
        .collect()
}

#[test]
fn rank_error_before_collective_fails_others_fast() {
    let msgs = expect_all_fail(4, |g| {
        if g.rank() == 2 {
            candle_core::bail!("boom from rank two")
        }
        g.all_reduce(&Tensor::ones(3, DType::F32, &Device::Cpu)?)?;
        Ok(())
    });
    for (r, m) in msgs.iter().enumerate() {
        assert!(m.contains("boom from rank two"), "rank {r}: {m}");
        if r != 2 {
            assert!(
                m.contains("world rank 2") && m.contains("all_reduce"),
                "rank {r}: {m}"
            );
        }
    }
}

#[test]
fn every_failure_kind_before_or_during_collectives_fails_others_fast() {
    for panics in [false, true] {
        for during in [false, true] {
            let msgs = expect_all_fail(4, |g| {
                let x = Tensor::ones((2, 4), DType::BF16, &Device::Cpu)?;
                if during {
                    g.reduce_scatter(&x, 1)?; // one good round first
                }
                if g.rank() == 1 {
                    if during {
                        std::thread::sleep(Duration::from_millis(100)); // others are waiting now
                    }
                    if panics {
                        panic!("rank one panicked on purpose");
                    }
                    candle_core::bail!("rank one failed on purpose")
                }
                g.all_to_all(&x, 1, 0)?;
                g.barrier()?;
                Ok(())
            });
            for (r, m) in msgs.iter().enumerate() {
                let what = format!("panics={panics} during={during} rank {r}: {m}");
                assert!(m.contains("rank one") && m.contains("on purpose"), "{what}");
                if r != 1 {
                    assert!(
                        m.contains("world rank 1") && m.contains("all_to_all"),
                        "{what}"
                    );
                }
            }
        }
    }
}

#[test]
fn rank_panic_during_collectives_fails_others_fast() {
    let msgs = expect_all_fail(3, |g| {
        let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu)?;
        g.all_gather(&x, 0)?; // one good round first
        if g.rank() == 0 {
            std::thread::sleep(Duration::from_millis(200)); // the others are now waiting
            panic!("rank zero exploded");
        }
        g.all_gather(&x, 1)?;
        Ok(())
    });
    for (r, m) in msgs.iter().enumerate() {
        assert!(m.contains("rank zero exploded"), "rank {r}: {m}");
        assert!(m.contains("panicked"), "rank {r}: {m}");
    }
}

#[test]
fn failure_reaches_sub_groups_and_pending_receives() {
    let msgs = expect_all_fail(4, |g| {
        let r = g.rank();
        let sub = g.split(r / 2, r)?;
        if r == 3 {
            std::thread::sleep(Duration::from_millis(100));
            candle_core::bail!("rank three gave up")
        }
        if r == 2 {
            // waits on rank 3 in a sub-group ring step
            sub.send_recv(
                &Tensor::zeros(2, DType::F32, &Device::Cpu)?,
                1 - sub.rank(),
                1 - sub.rank(),
            )?
            .wait()?;
        } else {
            sub.barrier()?; // ranks 0 and 1 complete this one
            g.barrier()?; // then wait on the world
        }
        Ok(())
    });
    for (r, m) in msgs.iter().enumerate() {
        assert!(m.contains("rank three gave up"), "rank {r}: {m}");
    }
}

#[test]
fn rank_that_returns_early_fails_waiters_fast() {
    let start = Instant::now();
    let res = run_ranks_with(3, short_opts(), |g| {
        if g.rank() != 1 {
            g.barrier()?;
        }
        Ok(())
    });
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(res[1].is_ok());
    for r in [0, 2] {
        let m = res[r].as_ref().expect_err("waiter must fail").to_string();
        assert!(
            m.contains("rank 1") && m.contains("barrier"),
            "rank {r}: {m}"
        );
    }
}

#[test]
fn mismatched_ops_shapes_dtypes_fail_on_all_ranks() {
    let dev = Device::Cpu;
    // different op
    let msgs = expect_all_fail(3, |g| {
        let x = Tensor::ones((2, 3), DType::F32, &dev)?;
        if g.rank() == 1 {
            g.all_reduce(&x)?;
        } else {
            g.all_gather(&x, 0)?;
        }
        Ok(())
    });
    for m in &msgs {
        assert!(
            m.contains("mismatched") && m.contains("all_reduce") && m.contains("all_gather(dim=0)"),
            "{m}"
        );
    }
    // different shape
    let msgs = expect_all_fail(2, |g| {
        let x = Tensor::ones((2, 3 + g.rank()), DType::F32, &dev)?;
        g.all_gather(&x, 0)?;
        Ok(())
    });
    for m in &msgs {
        assert!(
            m.contains("[2, 3]") && m.contains("[2, 4]") && m.contains("all_gather"),
            "{m}"
        );
    }
    // different dtype
    let msgs = expect_all_fail(2, |g| {
        let dt = if g.rank() == 0 {
            DType::F32
        } else {
            DType::BF16
        };
        g.reduce_scatter(&Tensor::ones((4, 2), dt, &dev)?, 0)?;
        Ok(())
    });
    for m in &msgs {
        assert!(
            m.contains("F32") && m.contains("BF16") && m.contains("reduce_scatter"),
            "{m}"
        );
    }
    // different dim
    let msgs = expect_all_fail(2, |g| {
        g.all_to_all(&Tensor::ones((4, 4), DType::F32, &dev)?, g.rank(), 0)?;
        Ok(())
    });
    for m in &msgs {
        assert!(
            m.contains("all_to_all(split_dim=0") && m.contains("all_to_all(split_dim=1"),
            "{m}"
        );
    }
    // dim or root out of range
    let msgs = expect_all_fail(2, |g| {
        g.all_gather(&Tensor::ones((4, 2), DType::F32, &dev)?, 2)?;
        Ok(())
    });
    assert!(
        msgs.iter()
            .all(|m| m.contains("out of range") && m.contains("[4, 2]")),
        "{msgs:?}"
    );
    let msgs = expect_all_fail(2, |g| {
        g.broadcast(&Tensor::ones(2, DType::F32, &dev)?, 2)?;
        Ok(())
    });
    assert!(msgs.iter().all(|m| m.contains("root 2")), "{msgs:?}");
    // indivisible split and inconsistent ring pairing
    let msgs = expect_all_fail(3, |g| {
        g.reduce_scatter(&Tensor::ones((4, 2), DType::F32, &dev)?, 0)?;
        Ok(())
    });
    assert!(
        msgs.iter()
            .all(|m| m.contains("not divisible") && m.contains("[4, 2]")),
        "{msgs:?}"
    );
    let msgs = expect_all_fail(3, |g| {
        let r = g.rank();
        g.send_recv(
            &Tensor::ones(2, DType::F32, &dev)?,
            (r + 1) % 3,
            (r + 1) % 3,
        )?
        .wait()?;
        Ok(())
    });
    assert!(msgs.iter().all(|m| m.contains("send_recv")), "{msgs:?}");
}

#[test]
fn timeout_returns_err_and_aborts_world() {
    let start = Instant::now();
    let res = run_ranks_with(
        3,
        ThreadGroupOptions::with_timeout(Duration::from_millis(300)),
        |g| {
            if g.rank() == 2 {
                // stuck in "compute" longer than the timeout, then tries to join
                std::thread::sleep(Duration::from_millis(900));
            }
            g.barrier()
        },
    );
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    for (r, x) in res.iter().enumerate() {
        let m = x.as_ref().expect_err("all ranks must fail").to_string();
        assert!(m.contains("timed out"), "rank {r}: {m}");
    }
}
