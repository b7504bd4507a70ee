//! ThreadGroup properties beyond the collectives' values (those are in the workspace test
//! `tests/comm.rs`): mismatch reports, caller-managed threads, detached and unaliased results,
//! several ring steps in flight.

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks, run_ranks_with, Group, ThreadGroup, ThreadGroupOptions};
use std::time::{Duration, Instant};

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

/// Every rank must fail well before the (20 s) timeout; returns the error messages.
fn expect_all_fail(p: usize, f: impl Fn(Group) -> Result<()> + Send + Sync) -> Vec<String> {
    let start = Instant::now();
    let res = run_ranks_with(
        p,
        ThreadGroupOptions::with_timeout(Duration::from_secs(20)),
        f,
    );
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
