//! ThreadGroup properties beyond those in the workspace test `tests/comm.rs`: caller-managed
//! threads, detached and unaliased results, several ring steps in flight.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks, ThreadGroup, ThreadGroupOptions};

/// One tensor per rank with distinct, exactly representable values.
fn inputs(p: usize, shape: &[usize], dtype: DType, seed: u64) -> Result<Vec<Tensor>> {
    let n: usize = shape.iter().product();
    (0..p)
        .map(|r| {
            let v: Vec<f32> = (0..n)
                .map(|i| ((seed as usize * 31 + r * 7 + i * 3) % 97) as f32 - 48.0)
                .collect();
            Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)
        })
        .collect()
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

fn assert_same(got: &Tensor, want: &Tensor, what: &str) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(host(got)?, host(want)?, "{what}: values");
    Ok(())
}

/// Serial sum in rank order (f32).
fn serial_sum(xs: &[Tensor]) -> Result<Tensor> {
    let mut acc = xs[0].clone();
    for x in &xs[1..] {
        acc = (acc + x)?;
    }
    Ok(acc)
}

fn all_ok<T>(results: Vec<Result<T>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r} failed: {e}")))
        .collect()
}

#[test]
fn send_recv_two_steps_in_flight() -> Result<()> {
    // two ring steps issued before either wait, waited in reverse order
    let p = 4;
    let xs = inputs(p, &[3], DType::F32, 55)?;
    all_ok(run_ranks(p, |g| {
        let r = g.rank();
        let a = g.send_recv(&xs[r], (r + 1) % p, (r + p - 1) % p)?;
        let b = g.send_recv(&xs[r], (r + p - 1) % p, (r + 1) % p)?;
        assert_same(&b.wait()?, &xs[(r + 1) % p], "second")?;
        assert_same(&a.wait()?, &xs[(r + p - 1) % p], "first")?;
        Ok(())
    }));
    Ok(())
}

#[test]
fn new_world_runs_on_caller_threads() -> Result<()> {
    let groups = ThreadGroup::new_world(3, ThreadGroupOptions::default());
    let xs = inputs(3, &[2, 2], DType::F32, 60)?;
    let want = serial_sum(&xs)?;
    std::thread::scope(|s| {
        let xs = &xs;
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| s.spawn(move || g.all_reduce(&xs[g.rank()])))
            .collect();
        for h in hs {
            let got = h.join().expect("no panic")?;
            assert_same(&got, &want, "new_world all_reduce")?;
        }
        Ok(())
    })
}

#[test]
fn results_are_detached_and_do_not_alias_inputs() -> Result<()> {
    let p = 3;
    all_ok(run_ranks(p, |g| {
        let r = g.rank();
        let v = candle_core::Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let y = (v.as_tensor() * (r as f64 + 1.0))?;
        let outs = [
            g.broadcast(&y, 0)?,
            g.all_gather(&y, 0)?,
            g.all_reduce(&y)?,
            g.send_recv(&y, (r + 1) % p, (r + p - 1) % p)?.wait()?,
        ];
        // gradients must not flow through a collective into any rank's graph
        let mut total = outs[0].sum_all()?;
        for o in &outs[1..] {
            total = (total + o.sum_all()?)?;
        }
        assert!(
            total.backward()?.get(v.as_tensor()).is_none(),
            "rank {r}: collective kept the graph"
        );
        // a sender overwriting its tensor in place must not change what others received
        let before = outs.iter().map(host).collect::<Result<Vec<_>>>()?;
        g.barrier()?;
        y.slice_set(&Tensor::new(&[-9f32, -9.0], &Device::Cpu)?, 0, 0)?;
        g.barrier()?;
        for (k, o) in outs.iter().enumerate() {
            if !(k == 0 && r == 0) {
                assert_eq!(
                    host(o)?,
                    before[k],
                    "rank {r}: result {k} aliases a sender's buffer"
                );
            }
        }
        Ok(())
    }));
    Ok(())
}

#[test]
fn started_collectives_match_the_blocking_ones() -> Result<()> {
    // an all-reduce, a reduce-scatter and two all-gathers (dims 0 and 1) started, a blocking
    // all-gather in between, waited in reverse order: the same bits as the blocking
    // collectives (bf16 sums in f32, rank order)
    let p = 3;
    for dtype in [DType::F32, DType::BF16] {
        let xs = inputs(p, &[6, 2], dtype, 70)?;
        let ys = inputs(p, &[2, 6], dtype, 71)?;
        let res = all_ok(run_ranks(p, |g| {
            let r = g.rank();
            let a = g.all_reduce_start(&xs[r])?;
            let b = g.reduce_scatter_start(&ys[r], 1)?;
            let c0 = g.all_gather_start(&xs[r], 0)?;
            let c1 = g.all_gather_start(&ys[r], 1)?;
            let gathered = g.all_gather(&xs[r], 0)?;
            let ag1 = c1.wait()?;
            let ag0 = c0.wait()?;
            let rs = b.wait()?;
            let ar = a.wait()?;
            let blocking = [g.all_reduce(&xs[r])?, g.reduce_scatter(&ys[r], 1)?, g.all_gather(&ys[r], 1)?];
            Ok(([ar, rs, ag0, ag1], gathered, blocking))
        }));
        let want = serial_sum(&xs.iter().map(|x| x.to_dtype(DType::F32)).collect::<Result<Vec<_>>>()?)?.to_dtype(dtype)?;
        for (r, ([ar, rs, ag0, ag1], gathered, [ar_blocking, rs_blocking, ag1_blocking])) in res.iter().enumerate() {
            assert_same(ar, &want, "all_reduce_start")?;
            assert_same(ar, ar_blocking, "all_reduce_start vs all_reduce")?;
            assert_same(rs, rs_blocking, "reduce_scatter_start vs reduce_scatter")?;
            assert_eq!(rs.dims(), &[2, 2], "rank {r}: reduce_scatter_start shape");
            assert_same(gathered, &Tensor::cat(&xs, 0)?, "all_gather between")?;
            assert_same(ag0, &Tensor::cat(&xs, 0)?, "all_gather_start dim 0")?;
            assert_same(ag1, &Tensor::cat(&ys, 1)?, "all_gather_start dim 1")?;
            assert_same(ag1, ag1_blocking, "all_gather_start vs all_gather")?;
        }
    }
    Ok(())
}

#[test]
fn started_collectives_report_mismatches_and_failures() {
    // ranks that start different collectives get an error naming the op, not a wrong sum
    let res = run_ranks(2, |g| {
        let t = Tensor::ones(4, DType::F32, &Device::Cpu)?;
        let pending = if g.rank() == 0 { g.all_reduce_start(&t)? } else { g.reduce_scatter_start(&t, 0)? };
        pending.wait()
    });
    for (r, x) in res.iter().enumerate() {
        let e = x.as_ref().expect_err("mismatched collectives must fail").to_string();
        assert!(e.contains("all_reduce") && e.contains("reduce_scatter"), "rank {r}: {e}");
    }
    // an all-gather started with different shapes: an error naming both, on every rank
    let res = run_ranks(2, |g| {
        let t = Tensor::ones(2 + g.rank(), DType::F32, &Device::Cpu)?;
        g.all_gather_start(&t, 0)?.wait()
    });
    for (r, x) in res.iter().enumerate() {
        let e = x.as_ref().expect_err("mismatched all-gather shapes must fail").to_string();
        assert!(e.contains("[2]") && e.contains("[3]"), "rank {r}: {e}");
    }
    // a rank that fails before depositing: the others' wait returns an error, not a hang
    let t0 = std::time::Instant::now();
    let res = run_ranks(3, |g| {
        if g.rank() == 1 {
            candle_core::bail!("injected failure")
        }
        let t = Tensor::ones(4, DType::F32, &Device::Cpu)?;
        g.all_reduce_start(&t)?.wait()
    });
    for (r, x) in res.iter().enumerate() {
        let e = x.as_ref().expect_err("a failed rank must fail the others").to_string();
        assert!(r == 1 || e.contains("injected failure"), "rank {r}: {e}");
    }
    assert!(t0.elapsed().as_secs() < 30, "took {:?}", t0.elapsed());
}

/// `all_to_all_v` delivers every rank's chunks, in rank order, on 3 ranks with counts that
/// include empty chunks, a rank that sends nothing (its `t` only gives the shape) and a rank
/// that receives nothing (one zero row back); f32 and bf16, rows of shape `[2, 3]`. Wrong
/// counts are refused by name on every rank.
#[test]
fn all_to_all_v_delivers_uneven_chunks() -> Result<()> {
    // rows[i][j]: what rank i sends rank j (rank 1 sends nothing, rank 2 receives nothing)
    let rows = [[2usize, 3, 0], [0, 0, 0], [1, 4, 0]];
    for dtype in [DType::F32, DType::BF16] {
        let p = 3;
        let sent: Vec<usize> = rows.iter().map(|r| r.iter().sum::<usize>().max(1)).collect();
        let xs: Vec<Tensor> = (0..p)
            .map(|r| Ok(inputs(1, &[sent[r], 2, 3], dtype, 5 + r as u64)?.remove(0)))
            .collect::<Result<_>>()?;
        let got = all_ok(run_ranks(p, |g| {
            let r = g.rank();
            let recv: Vec<usize> = (0..p).map(|i| rows[i][r]).collect();
            g.all_to_all_v(&xs[r], &rows[r], &recv)
        }));
        for (r, got) in got.iter().enumerate() {
            let mut want = Vec::new();
            for (i, x) in xs.iter().enumerate() {
                let off: usize = rows[i][..r].iter().sum();
                if rows[i][r] > 0 {
                    want.push(x.narrow(0, off, rows[i][r])?);
                }
            }
            let want = if want.is_empty() { Tensor::zeros((1, 2, 3), dtype, &Device::Cpu)? } else { Tensor::cat(&want, 0)? };
            assert_same(got, &want, &format!("{dtype:?} rank {r}"))?;
        }
    }
    let errs = run_ranks(2, |g| {
        let t = Tensor::zeros((3, 2), DType::F32, &Device::Cpu)?;
        match g.rank() {
            0 => g.all_to_all_v(&t, &[1, 1], &[1, 1]),
            _ => g.all_to_all_v(&t, &[1, 2, 0], &[1, 1]),
        }
    });
    let msgs: Vec<String> = errs.into_iter().map(|e| e.err().map(|e| e.to_string()).unwrap_or_default()).collect();
    assert!(msgs[0].contains("rows") || msgs[0].contains("rank"), "{msgs:?}");
    assert!(msgs[1].contains("3 send and 2 receive counts"), "{msgs:?}");
    // counts that disagree between a pair (rank 0 sends rank 1 two rows, rank 1 expects one),
    // and rows of another width: refused on every rank, by name
    for (width, recv01) in [(2usize, 1usize), (3, 2)] {
        let errs = run_ranks(2, |g| {
            let w = if g.rank() == 1 { width } else { 2 };
            let t = Tensor::zeros((3, w), DType::F32, &Device::Cpu)?;
            match g.rank() {
                0 => g.all_to_all_v(&t, &[1, 2], &[1, 1]),
                _ => g.all_to_all_v(&t, &[1, 2], &[recv01, 2]),
            }
        });
        for e in errs {
            let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
            let want = if width == 2 { "rank 0 sends rank 1 Some(2) rows, rank 1 receives Some(1)" } else { "rows of the same shape and dtype" };
            assert!(msg.contains(want) && msg.contains("all_to_all_v"), "{msg}");
        }
    }
    Ok(())
}
