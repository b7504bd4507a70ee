//! `gpu_check --sections views` (included by `gpu_check.rs` with `#[path]`): inputs that are
//! views, as users pass them, and bad input.
//!
//! - q is a reshaped slice of a flat buffer (storage offset 5 elements: not 16-byte aligned for
//!   16-bit types, so the tensor-core launchers must copy it), k is a transposed
//!   `[B, Hkv, S, D]` tensor (not contiguous), v a plain tensor; the raw kernels
//!   (`flash::fwd` / `flash::bwd_with`, every selected family) and the autograd op (gradients
//!   flow back into the flat buffer and the transposed base) against the CPU path on the same
//!   views.
//! - a backward prepared once for all rows (`flash::bwd_prep`), called on rows `R0..T` of it
//!   (`BwdPrep::narrow_rows`, `flash::bwd_prepared`: what the ring runs per step) against the
//!   CPU backward of those rows, every selected family.
//! - the forward into one packed buffer (`flash::fwd_packed`: out then lse, the ring state's
//!   layout) equals `flash::fwd` bit for bit, every family.
//! - dQ added into a buffer holding values (`flash::bwd_prepared_add_dq`, the kernels'
//!   `accumulate` flag / no zero fill: what the ring's dQ accumulator gets), every family.
//! - the forward folded into rows of a running state that holds values (`flash::fwd_fold`: the
//!   ring's later steps, B = 2 so the rows are not one region) against the CPU LSE merge of the
//!   state with the CPU forward; rows outside the call untouched; every family.
//! - a fold into a state that does not fit (length, rows, device), q and k on different devices,
//!   and q and k of different dtypes, must be an `Err` naming the shapes (no panic, no kernel
//!   launch).

use super::gpu_add_dq::AddDq;
use super::{kmask, tensor_core, Report};
use crate::gpu_util::{max_abs, rand_tensor, rel};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_cp_kernels::flash::{self, FwdImpl};
use candle_cp_ops::attention::{attention, attention_bwd, attention_fwd, Mask};


/// The view inputs on `dev`: (flat q buffer, k base `[B, Hkv, S, D]`, v), and the views q, k.
struct Views {
    q_flat: Tensor,
    k_base: Tensor,
    v: Tensor,
}

const OFF: usize = 5;
/// First query row of the prepared-backward check (rows `R0..T` of one prep of all rows).
const R0: usize = 40;

impl Views {
    fn new(dims: (usize, usize, usize, usize, usize), dtype: DType, seed: u64) -> Result<Self> {
        let (b, t, h, hkv, d) = dims;
        Ok(Views {
            q_flat: rand_tensor(&[OFF + b * t * h * d], seed)?.to_dtype(dtype)?,
            k_base: rand_tensor(&[b, hkv, t, d], seed + 1)?.to_dtype(dtype)?,
            v: rand_tensor(&[b, t, hkv, d], seed + 2)?.to_dtype(dtype)?,
        })
    }
    fn to(&self, dev: &Device) -> Result<Self> {
        Ok(Views { q_flat: self.q_flat.to_device(dev)?, k_base: self.k_base.to_device(dev)?, v: self.v.to_device(dev)? })
    }
}

/// q `[B, T, H, D]` at storage offset [`OFF`] of `flat`; k `[B, S, Hkv, D]` transposed from `base`.
fn views(flat: &Tensor, base: &Tensor, dims: (usize, usize, usize, usize, usize)) -> Result<(Tensor, Tensor)> {
    let (b, t, h, _, d) = dims;
    let q = flat.narrow(0, OFF, b * t * h * d)?.reshape((b, t, h, d))?;
    Ok((q, base.transpose(1, 2)?))
}

/// Rows of the fold check's state: the call's T rows at [`FOLD_ROW0`] of T + 5.
const FOLD_ROW0: usize = 2;

/// `flash::fwd_fold` of the call into a state of T + 5 rows holding a previous partial result
/// (random out / lse, every 7th row empty: lse -inf, out 0), at rows [`FOLD_ROW0`]..: the state's
/// rows must equal the CPU LSE merge of what they held with the CPU forward `(o_ref, l_ref)`,
/// the other rows must not change.
#[allow(clippy::too_many_arguments)]
fn check_fold(
    rep: &mut Report,
    name: &str,
    imp: FwdImpl,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (o_ref, l_ref): (&Tensor, &Tensor),
    mask: flash::KMask,
    scale: f32,
    tol: f64,
) -> Result<()> {
    let (b, t, h, d) = q.dims4()?;
    let r = t + 5;
    let so = rand_tensor(&[b, r, h, d], 940)?;
    let sl = (rand_tensor(&[b, h, r], 941)? * 3.0)?;
    let empty = Tensor::from_vec((0..b * h * r).map(|i| u8::from(i % 7 == 3)).collect::<Vec<_>>(), (b, h, r), &Device::Cpu)?;
    let sl = empty.where_cond(&Tensor::full(f32::NEG_INFINITY, (b, h, r), &Device::Cpu)?, &sl)?;
    let so = empty.transpose(1, 2)?.unsqueeze(3)?.broadcast_as((b, r, h, d))?.where_cond(&so.zeros_like()?, &so)?;
    let start = Tensor::cat(&[so.flatten_all()?, sl.flatten_all()?], 0)?;
    let state = start.to_device(q.device())?;
    flash::fwd_fold(q, k, v, mask, scale, imp, &state, r, FOLD_ROW0)?;
    let got = state.to_device(&Device::Cpu)?;
    let n_out = b * r * h * d;
    let (go, gl) = (got.narrow(0, 0, n_out)?.reshape((b, r, h, d))?, got.narrow(0, n_out, b * h * r)?.reshape((b, h, r))?);
    let name = format!("{name} fwd folded into a state (rows {FOLD_ROW0}..{} of {r}, B = {b})", FOLD_ROW0 + t);
    let (mo, ml) = candle_cp_ops::attention::merge(&so.narrow(1, FOLD_ROW0, t)?, &sl.narrow(2, FOLD_ROW0, t)?, o_ref, l_ref)?;
    rep.check(&format!("{name} out"), max_abs(&go.narrow(1, FOLD_ROW0, t)?, &mo)?, tol);
    rep.check(&format!("{name} lse"), max_abs(&gl.narrow(2, FOLD_ROW0, t)?, &ml)?, 1e-3);
    let outside = |x: &Tensor, dim: usize| -> Result<Tensor> { Ok(Tensor::cat(&[x.narrow(dim, 0, FOLD_ROW0)?, x.narrow(dim, FOLD_ROW0 + t, r - FOLD_ROW0 - t)?], dim)?) };
    rep.check(&format!("{name}: other rows untouched (out)"), max_abs(&outside(&go, 1)?, &outside(&so, 1)?)?, 0.0);
    rep.check(&format!("{name}: other rows untouched (lse)"), max_abs(&outside(&gl, 2)?, &outside(&sl, 2)?)?, 0.0);
    Ok(())
}

pub fn check_views(rep: &mut Report, gpu: &Device) -> Result<()> {
    let dims = (2, 96, 4, 2, 64);
    let mask = Mask::causal();
    let scale = 0.125;
    for dtype in [DType::F32, DType::BF16] {
        let cpu = Views::new(dims, dtype, 900)?;
        let dev = cpu.to(gpu)?;
        let (q, k) = views(&cpu.q_flat, &cpu.k_base, dims)?;
        let (gq, gk) = views(&dev.q_flat, &dev.k_base, dims)?;
        if gq.layout().start_offset() != OFF || gk.is_contiguous() {
            anyhow::bail!("views: expected q at offset {OFF} and a non-contiguous k, got {:?} / {:?}", gq.layout(), gk.layout());
        }
        let (o_ref, l_ref) = attention_fwd(&q, &k, &cpu.v, &mask, scale)?;
        let dout = rand_tensor(o_ref.dims(), 903)?;
        let (dq_r, dk_r, dv_r) = attention_bwd(&q, &k, &cpu.v, &o_ref, &l_ref, &dout, &mask, scale)?;
        let (go, gl, gd) = (o_ref.to_device(gpu)?, l_ref.to_device(gpu)?, dout.to_device(gpu)?);
        // the rows R0.. of a prepared backward (B = 2: the prep's rows are a strided view)
        let t = dims.1;
        let rows = |x: &Tensor, dim: usize| x.narrow(dim, R0, t - R0);
        let row_mask = Mask::causal_offsets(R0, 0);
        let (qr, lr) = (rows(&q, 1)?, rows(&l_ref, 2)?);
        let rows_ref = attention_bwd(&qr, &k, &cpu.v, &rows(&o_ref, 1)?, &lr, &rows(&dout, 1)?, &row_mask, scale)?;
        let mut imps: Vec<FwdImpl> = if dtype == DType::F32 { vec![FwdImpl::Simple] } else { vec![FwdImpl::Simple, FwdImpl::Mma, FwdImpl::Pipelined] };
        imps.retain(|&i| rep.wants(i));
        if dtype != DType::F32 {
            imps.extend([FwdImpl::Wgmma, FwdImpl::WgmmaAtomic, FwdImpl::WgmmaWs, FwdImpl::WgmmaTma, FwdImpl::WgmmaTmaWide, FwdImpl::AtomicDq].into_iter().filter(|&i| rep.named(i)));
        }
        for imp in imps {
            let (tf, tb) = match (tensor_core(imp), dtype) {
                (true, DType::BF16) => (2e-2, 3e-2),
                (true, _) => (4e-3, 5e-3),
                _ => (2e-5, 1e-4),
            };
            let name = format!("views {imp:?} {dtype:?} (q at offset {OFF}, k transposed)");
            match flash::fwd(&gq, &gk, &dev.v, kmask(&mask), scale as f32, imp) {
                Ok((o, l)) => {
                    rep.check(&format!("{name} fwd out"), max_abs(&o, &o_ref)?, tf);
                    rep.check(&format!("{name} fwd lse"), max_abs(&l, &l_ref)?, if imp == FwdImpl::Simple { 2e-5 } else { 1e-3 });
                    // the same forward into one packed buffer (out, then lse: the ring state's
                    // layout), bit for bit
                    match flash::fwd_packed(&gq, &gk, &dev.v, kmask(&mask), scale as f32, imp) {
                        Ok(buf) => {
                            let packed = Tensor::cat(&[o.flatten_all()?, l.flatten_all()?], 0)?;
                            rep.check(&format!("{name} fwd_packed = fwd"), max_abs(&buf, &packed)?, 0.0);
                        }
                        Err(e) => rep.error(&format!("{name} fwd_packed"), e),
                    }
                    if let Err(e) = check_fold(rep, &name, imp, (&gq, &gk, &dev.v), (&o_ref, &l_ref), kmask(&mask), scale as f32, tf) {
                        rep.error(&format!("{name} fwd folded into a state"), e);
                    }
                }
                Err(e) => rep.error(&format!("{name} fwd"), e),
            }
            match flash::bwd_with(&gq, &gk, &dev.v, &go, &gl, &gd, kmask(&mask), scale as f32, imp) {
                Ok((dq, dk, dv)) => {
                    rep.check(&format!("{name} bwd dq"), rel(&dq, &dq_r)?, tb);
                    rep.check(&format!("{name} bwd dk"), rel(&dk, &dk_r)?, tb);
                    rep.check(&format!("{name} bwd dv"), rel(&dv, &dv_r)?, tb);
                }
                Err(e) => rep.error(&format!("{name} bwd"), e),
            }
            let prepared = flash::bwd_prep(&go, &gd, dtype).and_then(|pr| {
                let pr = pr.narrow_rows(R0, t - R0)?;
                flash::bwd_prepared(&rows(&gq, 1)?, &gk, &dev.v, &rows(&gl, 2)?, &pr, kmask(&row_mask), scale as f32, imp)
            });
            match prepared {
                Ok((dq, dk, dv)) => {
                    rep.check(&format!("{name} prepared rows {R0}.. dq"), rel(&dq, &rows_ref.0)?, tb);
                    rep.check(&format!("{name} prepared rows {R0}.. dk"), rel(&dk, &rows_ref.1)?, tb);
                    rep.check(&format!("{name} prepared rows {R0}.. dv"), rel(&dv, &rows_ref.2)?, tb);
                }
                Err(e) => rep.error(&format!("{name} prepared rows {R0}.."), e),
            }
            // dQ added into a buffer that already holds values (a ring's dQ accumulator): all
            // rows (B = 2), through `flash::bwd_prepared_add_dq`; the buffer must end as its
            // start plus dQ, dK / dV as returned
            let start = rand_tensor(q.dims(), 905)?;
            let acc = start.to_device(gpu)?;
            let added = flash::bwd_prep(&go, &gd, dtype).and_then(|pr| {
                let op = AddDq { q: &gq, k: &gk, v: &dev.v, lse: &gl, pr: &pr, mask: kmask(&mask), scale: scale as f32, imp, out: std::cell::RefCell::new(None) };
                acc.inplace_op1(&op)?;
                op.out.take().ok_or_else(|| candle_core::Error::Msg("add_dq did not run".into()))
            });
            match added {
                Ok((dk, dv)) => {
                    let want = (&start + &dq_r)?;
                    rep.check(&format!("{name} dq added into a buffer"), rel(&acc.sub(&start.to_device(gpu)?)?, &dq_r)?, tb);
                    rep.check(&format!("{name} dq added into a buffer (sum)"), max_abs(&acc, &want)?, 4.0 * tb);
                    rep.check(&format!("{name} dq added into a buffer: dk"), rel(&dk, &dk_r)?, tb);
                    rep.check(&format!("{name} dq added into a buffer: dv"), rel(&dv, &dv_r)?, tb);
                }
                Err(e) => rep.error(&format!("{name} dq added into a buffer"), e),
            }
        }
        // the autograd op on the views: gradients flow back to the flat buffer and the k base
        let grads_of = |v: &Views, dout: &Tensor| -> Result<[Tensor; 4]> {
            let (qf, kb, vv) = (Var::from_tensor(&v.q_flat)?, Var::from_tensor(&v.k_base)?, Var::from_tensor(&v.v)?);
            let (q, k) = views(qf.as_tensor(), kb.as_tensor(), dims)?;
            let (out, _) = attention(&q, &k, vv.as_tensor(), &mask, scale)?;
            let g = (out.to_dtype(DType::F32)? * dout)?.sum_all()?.backward()?;
            let get = |x: &Var, n: &str| g.get(x.as_tensor()).cloned().ok_or_else(|| anyhow::anyhow!("views: no gradient for {n}"));
            Ok([out, get(&qf, "the q buffer")?, get(&kb, "the k base")?, get(&vv, "v")?])
        };
        let name = format!("views autograd op {dtype:?}");
        let want = grads_of(&cpu, &dout)?;
        match grads_of(&dev, &gd) {
            Ok(got) => {
                // bf16: both outputs are rounded to bf16 (up to an ulp, 7.8e-3 in [1, 2), each)
                let (tf, tb) = if dtype == DType::F32 { (2e-5, 1e-4) } else { (4e-2, 3e-2) };
                rep.check(&format!("{name} out"), max_abs(&got[0], &want[0])?, tf);
                for (i, what) in [(1, "d(q buffer)"), (2, "d(k base)"), (3, "dv")] {
                    rep.check(&format!("{name} {what}"), rel(&got[i], &want[i])?, tb);
                }
            }
            Err(e) => rep.error(&name, e),
        }
    }
    // bad input: an Err naming the shapes, not a panic
    let (q, k) = views(&Views::new(dims, DType::F32, 910)?.to(gpu)?.q_flat, &Views::new(dims, DType::F32, 920)?.k_base, dims)?;
    let v = rand_tensor(&[2, 96, 2, 64], 930)?;
    let expect_err = |rep: &mut Report, name: &str, r: candle_core::Result<(Tensor, Tensor)>| match r {
        Err(e) if e.to_string().contains("96") => {
            println!("  {name}: {}", e.to_string().lines().next().unwrap_or(""));
            rep.pass += 1
        }
        Err(e) => rep.error(name, format!("error without the shapes: {e}")),
        Ok(_) => rep.error(name, "returned Ok"),
    };
    expect_err(rep, "views: q on the GPU, k and v on the CPU -> Err", attention(&q, &k, &v, &mask, scale));
    // a prep of all 96 rows for a call on 40 of them
    let (kg, vg) = (k.to_device(gpu)?, v.to_device(gpu)?);
    let bad = flash::bwd_prep(&q, &q, DType::F32).and_then(|pr| {
        let l = Tensor::zeros((2, 4, 40), DType::F32, gpu)?;
        flash::bwd_prepared(&q.narrow(1, 0, 40)?, &kg, &vg, &l, &pr, kmask(&mask), scale as f32, FwdImpl::Simple)
    });
    expect_err(rep, "views: a prep of 96 rows for 40 query rows -> Err", bad.map(|(dq, dk, _)| (dq, dk)));
    // a fold into a state that does not fit: the wrong length, rows past its end, on the CPU
    let fold_err = |state: &Tensor, rows: usize, row0: usize| {
        flash::fwd_fold(&q, &kg, &vg, kmask(&mask), scale as f32, FwdImpl::Simple, state, rows, row0).map(|()| (q.clone(), q.clone()))
    };
    let n = 2 * 100 * 4 * 64 + 2 * 4 * 100;
    expect_err(rep, "views: a fold into a state buffer of the wrong length -> Err", fold_err(&Tensor::zeros(n - 1, DType::F32, gpu)?, 100, 0));
    expect_err(rep, "views: a fold of 96 rows at row 10 of a 100-row state -> Err", fold_err(&Tensor::zeros(n, DType::F32, gpu)?, 100, 10));
    expect_err(rep, "views: a fold into a state on the CPU -> Err", fold_err(&Tensor::zeros(n, DType::F32, &Device::Cpu)?, 100, 0));
    let (qb, kb, vb) = (q.to_dtype(DType::BF16)?, k.to_device(gpu)?, v.to_device(gpu)?);
    expect_err(rep, "views: q bf16, k and v f32 -> Err", attention(&qb, &kb, &vb, &mask, scale));
    Ok(())
}
