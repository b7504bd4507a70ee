//! `gpu_check` sections `merge` and `layout`: the ring-step merge kernel and the f32 output /
//! LSE state kernels against the CPU `merge`, and the zigzag / striped gather-scatter and
//! all-to-all pack / unpack kernels against the host permutations.

use super::{max_abs, rand_tensor, Report};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_cp_kernels::layout::{self, SeqLayout};
use candle_cp_ops::attention::merge;

/// Merge kernel vs CPU `merge` (with -inf rows on one or both sides) and the final cast.
pub(crate) fn check_merge(rep: &mut Report, gpu: &Device) -> Result<()> {
    let (b, t, h, d) = (2, 50, 3, 64);
    let oa = rand_tensor(&[b, t, h, d], 1)?;
    let ob = rand_tensor(&[b, t, h, d], 2)?;
    let mut la = rand_tensor(&[b, h, t], 3)?.to_vec3::<f32>()?;
    let mut lb = rand_tensor(&[b, h, t], 4)?.to_vec3::<f32>()?;
    for i in 0..t {
        if i % 5 == 0 {
            la[0][0][i] = f32::NEG_INFINITY;
        }
        if i % 7 == 0 {
            lb[0][0][i] = f32::NEG_INFINITY;
        }
        if i % 3 == 0 {
            la[1][2][i] = f32::NEG_INFINITY;
            lb[1][2][i] = f32::NEG_INFINITY;
        }
    }
    let la = Tensor::new(la, &Device::Cpu)?;
    let lb = Tensor::new(lb, &Device::Cpu)?;
    let (o_ref, l_ref) = merge(&oa, &la, &ob, &lb)?;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let obt = ob.to_dtype(dtype)?;
        let (o_ref, l_ref) = if dtype == DType::F32 { (o_ref.clone(), l_ref.clone()) } else { merge(&oa, &la, &obt, &lb)? };
        let name = format!("merge {dtype:?}");
        match candle_cp_kernels::merge::merge(&oa.to_device(gpu)?, &la.to_device(gpu)?, &obt.to_device(gpu)?, &lb.to_device(gpu)?) {
            Ok((o, l)) => {
                rep.check(&format!("{name} out"), max_abs(&o, &o_ref)?, 1e-5);
                rep.check(&format!("{name} lse"), max_abs(&l, &l_ref)?, 1e-5);
                let cast = candle_cp_kernels::merge::cast_out(&o, dtype)?;
                rep.check(&format!("cast_out {dtype:?}"), max_abs(&cast, &o.to_dtype(dtype)?)?, 0.0);
            }
            Err(e) => rep.error(&name, e),
        }
    }
    check_state(rep, gpu, &oa, &la, &ob, &lb)
}

/// The ring's running state on the GPU (`LocalState::on_device`: one f32 buffer merged in place
/// by `merge_rows_inplace_*`) vs the host state, over a full segment and partial ones (rows
/// never merged, rows masked on both sides), f32 / bf16 / f16 partial results; and the
/// backward's gradient accumulator (`RowAccum`, `add_rows_inplace_*`) the same way.
fn check_state(rep: &mut Report, gpu: &Device, oa: &Tensor, la: &Tensor, ob: &Tensor, lb: &Tensor) -> Result<()> {
    use candle_cp_ops::cp::state::LocalState;
    let (b, t, h, d) = oa.dims4()?;
    // (row0, n, which partial): the full rows, then overlapping segments; rows t-3.. never
    // after the first merge.
    let segs = [(0, t, 0), (5, 20, 1), (0, 9, 0), (30, t - 33, 1)];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let name = format!("ring state merged in place {dtype:?}");
        let run = |dev: &Device| -> Result<(Tensor, Tensor)> {
            let mut s = LocalState::on_device(b, t, h, d, dev)?;
            for &(row0, n, which) in &segs {
                let (o, l) = if which == 0 { (oa, la) } else { (ob, lb) };
                let o = o.narrow(1, row0, n)?.to_dtype(dtype)?.to_device(dev)?;
                let l = l.narrow(2, row0, n)?.to_device(dev)?;
                s.merge_rows(row0, &o, &l)?;
            }
            Ok(s.finish(dev)?)
        };
        match (run(&Device::Cpu), run(gpu)) {
            (Ok((o_ref, l_ref)), Ok((o, l))) => {
                rep.check(&format!("{name} out"), max_abs(&o, &o_ref)?, 1e-5);
                rep.check(&format!("{name} lse"), max_abs(&l, &l_ref)?, 1e-5);
            }
            (Err(e), _) | (_, Err(e)) => rep.error(&name, e),
        }
        // The backward's gradient accumulator (`RowAccum`: added to in place by
        // `add_rows_inplace_*`) vs the host form: overlapping blocks on both planes.
        let name = format!("ring gradient accumulator added in place {dtype:?}");
        let run = |dev: &Device| -> Result<Tensor> {
            let mut acc = candle_cp_ops::cp::state::RowAccum::on_device(2, b, t, h, d, dev)?;
            for &(plane, row0, n, which) in &[(0, 3, 30, 0), (1, 0, t, 1), (0, 20, 25, 1)] {
                let x = if which == 0 { oa } else { ob };
                acc.add_rows(plane, row0, &x.narrow(1, row0, n)?.to_dtype(dtype)?.to_device(dev)?)?;
            }
            Ok(acc.finish(dev)?)
        };
        match (run(&Device::Cpu), run(gpu)) {
            (Ok(r), Ok(g)) => rep.check(&name, max_abs(&g, &r)?, 1e-5),
            (Err(e), _) | (_, Err(e)) => rep.error(&name, e),
        }
    }
    Ok(())
}

/// Layout kernels vs `candle_cp_ops::cp::{shard, unshard}` and a CPU all-to-all pack/unpack.
pub(crate) fn check_layout(rep: &mut Report, gpu: &Device) -> Result<()> {
    use candle_cp_ops::cp::{shard, unshard, Layout};
    let x = rand_tensor(&[2, 48, 3, 8], 9)?;
    let gx = x.to_device(gpu)?;
    for p in [2, 3, 4] {
        for (l, kl) in [(Layout::Zigzag, SeqLayout::Zigzag), (Layout::Striped, SeqLayout::Striped)] {
            let mut shards = Vec::new();
            for r in 0..p {
                let want = shard(&x, l, r, p, 1)?;
                let name = format!("shard {l:?} P{p} r{r}");
                match layout::shard(&gx, 1, kl, p, r) {
                    Ok(got) => {
                        rep.check(&name, max_abs(&got, &want)?, 0.0);
                        shards.push(got);
                    }
                    Err(e) => rep.error(&name, e),
                }
                // The ops' own entry point on a CUDA tensor (dispatches to the kernel).
                match shard(&gx, l, r, p, 1) {
                    Ok(got) => rep.check(&format!("cp::{name}"), max_abs(&got, &want)?, 0.0),
                    Err(e) => rep.error(&format!("cp::{name}"), e),
                }
            }
            if shards.len() == p {
                let cat = Tensor::cat(&shards, 1)?;
                let name = format!("unshard {l:?} P{p}");
                match layout::unshard(&cat, 1, kl, p) {
                    Ok(got) => {
                        let cpu_shards = shards.iter().map(|s| s.to_device(&Device::Cpu)).collect::<candle_core::Result<Vec<_>>>()?;
                        rep.check(&name, max_abs(&got, &unshard(&cpu_shards, l, 1)?)?, 0.0);
                        rep.check(&format!("{name} roundtrip"), max_abs(&got, &x)?, 0.0);
                    }
                    Err(e) => rep.error(&name, e),
                }
                match unshard(&shards, l, 1) {
                    Ok(got) => rep.check(&format!("cp::{name}"), max_abs(&got, &x)?, 0.0),
                    Err(e) => rep.error(&format!("cp::{name}"), e),
                }
            }
        }
        // all-to-all pack along heads (dim 2 of [B, T, H, D] with H = 12) and unpack along seq.
        let y = rand_tensor(&[2, 5, 12, 8], 10)?;
        let packed = layout::a2a_pack(&y.to_device(gpu)?, 2, p)?;
        let want: Vec<Tensor> = (0..p).map(|j| y.narrow(2, j * 12 / p, 12 / p)).collect::<candle_core::Result<_>>()?;
        rep.check(&format!("a2a_pack P{p}"), max_abs(&packed, &Tensor::stack(&want, 0)?)?, 0.0);
        let unpacked = layout::a2a_unpack(&packed, 1)?;
        rep.check(&format!("a2a_unpack P{p}"), max_abs(&unpacked, &Tensor::cat(&want, 1)?)?, 0.0);
    }
    Ok(())
}
