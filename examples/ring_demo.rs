//! Ring attention across thread ranks, checked against the single-device op.
//!
//! ```text
//! cargo run --release --example ring_demo -- [--p 4] [--t 2048] [--layout zigzag]
//! ```
//!
//! A seeded global `q, k, v` (`[1, T, 8, 64]`, 2 KV heads) is sharded over P thread ranks,
//! every rank runs `ring_attention` forward and backward on its shard, the outputs and
//! gradients are gathered back into global order and compared with `attention` on one device.
//! It also prints the per-rank attention work of the layout (the zigzag balance).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_cp_comm::run_ranks;
use candle_cp_ops::attention::{attention, Mask};
use candle_cp_ops::cp::{balance, gather, ring_attention, shard, CpOpts, Layout};
use rand::{rngs::StdRng, Rng, SeedableRng};
use candle_cp_examples::arg;
use std::time::Instant;

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    candle_cp_examples::check_flags(&args, &["--p", "--t", "--layout"], &[])?;
    let p: usize = arg("--p", 4)?;
    let t: usize = arg("--t", 2048)?;
    let layout: Layout = arg::<String>("--layout", "zigzag".into())?.parse()?;
    let (b, h, hkv, d) = (1, 8, 2, 64);
    let dev = Device::Cpu;
    let scale = 1.0 / (d as f64).sqrt();

    // Seeded global inputs.
    let mut rng = StdRng::seed_from_u64(7);
    let mut randn = |shape: (usize, usize, usize, usize)| -> Result<Tensor> {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        // Box-Muller from two uniforms.
        let data: Vec<f32> = (0..n)
            .map(|_| {
                let (u1, u2): (f32, f32) = (rng.random::<f32>().max(1e-12), rng.random());
                (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
            })
            .collect();
        Ok(Tensor::from_vec(data, shape, &dev)?)
    };
    let q = randn((b, t, h, d))?;
    let k = randn((b, t, hkv, d))?;
    let v = randn((b, t, hkv, d))?;
    let dout = randn((b, t, h, d))?;

    // Single device reference.
    let start = Instant::now();
    let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
    let (out_ref, lse_ref) = attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &Mask::causal(), scale)?;
    let g = (&out_ref * &dout)?.sum_all()?.backward()?;
    let grads_ref: Vec<Tensor> = [&qv, &kv, &vv].iter().map(|x| g.get(x).cloned().ok_or_else(|| anyhow::anyhow!("missing grad"))).collect::<Result<_>>()?;
    println!("single device: T = {t}, H = {h}, Hkv = {hkv}, D = {d}, causal, {:.2} s fwd+bwd", start.elapsed().as_secs_f64());

    // P thread ranks: shard, ring forward + backward, gather to global order.
    let start = Instant::now();
    let results = run_ranks(p, |group| {
        let r = group.rank();
        let local = |x: &Tensor| shard(x, layout, r, p, 1);
        let (ql, kl, vl) = (Var::from_tensor(&local(&q)?)?, Var::from_tensor(&local(&k)?)?, Var::from_tensor(&local(&v)?)?);
        let (out, lse) = ring_attention(ql.as_tensor(), kl.as_tensor(), vl.as_tensor(), &group, &CpOpts::new(layout, true).with_scale(scale))?;
        let g = (&out * local(&dout)?)?.sum_all()?.backward()?;
        let mut gathered = vec![gather(&out, &group, layout, 1)?, gather(&lse, &group, layout, 2)?];
        for x in [&ql, &kl, &vl] {
            let gx = g.get(x).ok_or_else(|| candle_core::Error::Msg("missing grad".into()))?;
            gathered.push(gather(gx, &group, layout, 1)?);
        }
        Ok(gathered)
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut per_rank = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        per_rank.push(res.map_err(|e| anyhow::anyhow!("rank {r}: {e}"))?);
    }
    println!("{p} ranks, {} layout: {elapsed:.2} s fwd+bwd (all ranks share this machine's cores)", layout.name());
    let names = ["out", "lse", "dq", "dk", "dv"];
    let refs = [&out_ref, &lse_ref, &grads_ref[0], &grads_ref[1], &grads_ref[2]];
    let mut worst = 0f32;
    for (i, name) in names.iter().enumerate() {
        let e = max_abs_diff(&per_rank[0][i], refs[i])?;
        // Every rank must hold the same gathered tensor.
        for other in &per_rank[1..] {
            anyhow::ensure!(max_abs_diff(&other[i], &per_rank[0][i])? == 0.0, "ranks disagree on {name}");
        }
        println!("  {name:<3} max |ring - single| = {e:.3e}");
        worst = worst.max(e);
    }
    let report = balance(layout, p, t, true)?;
    println!("attention work per rank (visible q·k pairs): {:?}, imbalance max/mean = {:.3}", report.pairs, report.imbalance());
    anyhow::ensure!(worst < 1e-4, "ring attention differs from the single-device op by {worst:e}");
    println!("OK: ring attention over {p} ranks equals the single-device result");
    Ok(())
}
