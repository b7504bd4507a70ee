//! Tests of [`super`]: the pair on threads-as-ranks against one device's grouped matmul.

use super::*;
use crate::moe::{grouped_matmul, Routing};
use candle_core::{DType, Var};
use candle_cp_comm::run_ranks;

/// Seeded expert choices `[N·K]` of `n` tokens, `k` distinct experts each among `allowed`.
fn choices(n: usize, k: usize, allowed: &[u32], seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n * k);
    for _ in 0..n {
        let mut mine: Vec<u32> = Vec::new();
        while mine.len() < k {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = allowed[(s % allowed.len() as u64) as usize];
            if !mine.contains(&x) {
                mine.push(x);
            }
        }
        out.extend(mine);
    }
    out
}

fn det(shape: &[usize], seed: usize) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| (((i * 37 + seed * 101) % 89) as f32 - 44.0) / 32.0).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// Four EP ranks with different token counts, 8 experts (2 per rank), top 2: every rank's
/// grouped-matmul output and `dx`, and each rank's slice of `dW`, equal one device's (each
/// rank's rows through the whole stack of experts; `dW` summed over the ranks). In the
/// second routing no token picks the experts of ranks 2 and 3: they carry the zero row and
/// get exactly zero `dW`. `return_from_experts ∘ dispatch_to_experts` is the identity, bit for
/// bit, and each op's backward is the other's forward.
#[test]
fn expert_parallel_grouped_matmul_matches_one_device() -> Result<()> {
    let (p, e, k, h, o) = (4usize, 8usize, 2usize, 6usize, 5usize);
    let tokens = [5usize, 3, 6, 4];
    let all: Vec<u32> = (0..e as u32).collect();
    for (case, allowed) in [all.as_slice(), &[0u32, 1, 2, 3][..]].into_iter().enumerate() {
        let w_full = det(&[e, o, h], 7)?;
        let routings: Vec<Routing> = (0..p)
            .map(|r| Routing::from_experts(choices(tokens[r], k, allowed, (case * 10 + r) as u64 + 1), tokens[r], k, e))
            .collect();
        // one device: each rank's rows through the full stack; dW summed over the ranks
        let mut want = Vec::new();
        let mut dw_full = w_full.zeros_like()?;
        for (r, rt) in routings.iter().enumerate() {
            let x = Var::from_tensor(&det(&[tokens[r] * k, h], r)?)?;
            let w = Var::from_tensor(&w_full)?;
            let y = grouped_matmul(x.as_tensor(), w.as_tensor(), &rt.counts)?;
            let dy = det(&[tokens[r] * k, o], 50 + r)?;
            let g = (&y * &dy)?.sum_all()?.backward()?;
            dw_full = (dw_full + g.get(w.as_tensor()).expect("dW"))?;
            want.push((y, g.get(x.as_tensor()).expect("dx").clone()));
        }
        let got = run_ranks(p, |g| {
            let r = g.rank();
            let rt = &routings[r];
            let ex = ExpertExchange::new(&rt.counts, &g)?;
            let x0 = det(&[tokens[r] * k, h], r)?;
            // the pair is the identity, bit for bit
            let back = return_from_experts(&dispatch_to_experts(&x0, &ex)?, &ex)?;
            let same = back.flatten_all()?.to_vec1::<f32>()? == x0.flatten_all()?.to_vec1::<f32>()?;
            let x = Var::from_tensor(&x0)?;
            let w = Var::from_tensor(&local_experts(&w_full, r, p)?)?;
            let xl = dispatch_to_experts(x.as_tensor(), &ex)?;
            let yl = grouped_matmul(&xl, w.as_tensor(), ex.local_counts())?;
            let y = return_from_experts(&yl, &ex)?;
            let dy = det(&[tokens[r] * k, o], 50 + r)?;
            let grads = (&y * &dy)?.sum_all()?.backward()?;
            // each op's backward is the other's forward
            let probe = det(&[ex.received().max(1), h], 90 + r)?;
            let gp = {
                let xv = Var::from_tensor(&x0)?;
                let d = dispatch_to_experts(xv.as_tensor(), &ex)?;
                (&d * &probe)?.sum_all()?.backward()?.get(xv.as_tensor()).expect("grad").clone()
            };
            let conj = max_diff(&gp, &return_from_experts(&probe, &ex)?)?;
            Ok((same, y, grads.get(x.as_tensor()).expect("dx").clone(), grads.get(w.as_tensor()).expect("dW").clone(), ex.received(), conj))
        });
        for (r, res) in got.into_iter().enumerate() {
            let (same, y, dx, dw, received, conj) = res?;
            assert!(same, "case {case} rank {r}: return ∘ dispatch is not the identity");
            assert_eq!(conj, 0.0, "case {case} rank {r}: dispatch's backward is not return");
            assert!(max_diff(&y, &want[r].0)? < 1e-5, "case {case} rank {r}: output");
            assert!(max_diff(&dx, &want[r].1)? < 1e-5, "case {case} rank {r}: dx");
            assert!(max_diff(&dw, &local_experts(&dw_full, r, p)?)? < 1e-4, "case {case} rank {r}: dW");
            if case == 1 && r >= 2 {
                assert_eq!(received, 0, "rank {r} should receive nothing");
                assert_eq!(dw.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "rank {r}: the zero row gave dW");
            }
        }
    }
    Ok(())
}

/// Bad input is refused by name: experts the group does not divide, a rank with no rows, a
/// tensor whose rows are not the exchange's, a weight slice of a non-dividing stack.
#[test]
fn expert_exchange_refuses_bad_input() -> Result<()> {
    let errs = run_ranks(2, |g| {
        let e1 = ExpertExchange::new(&[1, 2, 3], &g).err().map(|e| e.to_string()).unwrap_or_default();
        let e2 = ExpertExchange::new(&[0, 0], &g).err().map(|e| e.to_string()).unwrap_or_default();
        let ex = ExpertExchange::new(&[2, 1], &g)?;
        let bad = Tensor::zeros((4, 3), DType::F32, &Device::Cpu)?;
        let e3 = dispatch_to_experts(&bad, &ex).err().map(|e| e.to_string()).unwrap_or_default();
        Ok([e1, e2, e3])
    });
    for r in errs {
        let [e1, e2, e3] = r?;
        assert!(e1.contains("3 experts") && e1.contains("2 ranks"), "{e1}");
        assert!(e2.contains("no rows"), "{e2}");
        assert!(e3.contains("[4, 3]") && e3.contains("[3, ...]"), "{e3}");
    }
    let w = Tensor::zeros((6, 2, 2), DType::F32, &Device::Cpu)?;
    let e = local_experts(&w, 0, 4).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("6 experts") && e.contains("[6, 2, 2]"), "{e}");
    Ok(())
}
