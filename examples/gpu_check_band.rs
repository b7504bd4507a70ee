//! `gpu_check --sections band` (included by `gpu_check.rs` with `#[path]`): band masks
//! ([`Band`]: one key interval per query row) on the GPU against the CPU band kernels, inputs
//! rounded to the dtype first (f32, bf16, f16). Bands: packed documents (causal and full, from
//! `Band::from_positions`), documents + sliding window, a window over a ring step's keys
//! (queries after the keys), `Mask::sliding_window` (`Band::from_mask`), random monotone bands
//! with empty rows, and per-batch bands (`Band::stack`, a different band per batch row); head
//! dims 16, 32, 64, 128, and 96 and 256 (the CUDA-core and pipelined kernels alone). Per case and dtype:
//! - `attention_fwd_band` / `attention_bwd_band` (the ops' default kernels, `CANDLE_CP_FLASH_IMPL`)
//!   against the CPU (backward from the CPU's out / lse);
//! - `attention_band` (autograd: out in the input dtype, gradients of `sum(out · dout)`);
//! - the kernel crate directly (`flash::fwd_band` / `flash::bwd_band`) with `Simple`, `Pipelined`,
//!   `Mma` and (f16/bf16) `Wgmma`, `WgmmaAtomic`, `WgmmaWs` — `Mma` has no band kernels and must
//!   run `Auto`'s family (the check of the fallback), whatever `CANDLE_CP_FLASH_IMPL` says; the
//!   Hopper families run their band kernels at head dims 64 / 128 on a 9.x device (the fallback
//!   elsewhere).
//!
//! - bounds uploaded once for all cases (`Band::upload_all`): the device views equal the host
//!   bounds, and the ops on such bands (bf16) match the CPU as above.
//!
//! Rows with an empty interval must give out 0, lse -inf and no NaN in any gradient.

use super::Report;
use crate::gpu_util::{max_abs, rand_tensor, rel};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_cp_kernels::flash::{self, FwdImpl, KBand};
use candle_cp_ops::attention::{attention_band, attention_bwd_band, attention_fwd_band, Band, Mask};
use candle_cp_ops::cp::ring::MaskSpec;
use candle_cp_ops::packing::Documents;

/// One band problem: q `[b, t, h, d]`, k/v `[b, s, hkv, d]`, `band` of batch 1 or `b`.
struct BandCase {
    label: String,
    b: usize,
    h: usize,
    hkv: usize,
    d: usize,
    band: Band,
}

/// Random monotone band (xorshift from `seed`): lower bounds creep up, upper bounds run ahead,
/// every 9th row empty (lo = hi), runs of rows that see the rest of the keys.
fn random_band(t: usize, s: usize, seed: u64) -> Result<Band> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let (mut lo, mut hi) = (Vec::with_capacity(t), Vec::with_capacity(t));
    let (mut a, mut b) = (0u32, 0u32);
    for i in 0..t {
        if next(10) < 3 {
            a = (a + next(9) as u32).min(s as u32);
        }
        if next(10) < 7 {
            b = (b + next(7) as u32).min(s as u32);
        }
        if i % 9 == 4 {
            a = a.max(b);
        }
        if i % 41 == 40 {
            b = s as u32;
        }
        b = b.max(a);
        lo.push(a);
        hi.push(b);
    }
    Ok(Band::new(1, t, s, lo, hi)?)
}

fn cases(quick: bool) -> Result<Vec<BandCase>> {
    let c = |label: &str, b, h, hkv, d, band| BandCase { label: label.to_string(), b, h, hkv, d, band };
    let pos = |start: usize, n: usize| (start..start + n).collect::<Vec<_>>();
    let docs = Documents::from_lengths(&[40, 1, 70, 39])?;
    let causal_docs = MaskSpec { causal: true, window: None, docs: Some(&docs) };
    let full_docs = MaskSpec { causal: false, window: None, docs: Some(&docs) };
    let window_docs = MaskSpec { causal: true, window: Some(17), docs: Some(&docs) };
    let p150 = pos(0, 150);
    let mut v = vec![
        c("docs causal", 1, 2, 1, 64, Band::from_positions(&p150, &p150, causal_docs)?),
        c("docs full", 2, 2, 2, 32, Band::from_positions(&p150, &p150, full_docs)?),
        c("docs + window 17", 1, 4, 2, 128, Band::from_positions(&p150, &p150, window_docs)?),
        c("ring step window 150", 1, 2, 1, 128, Band::from_positions(&pos(300, 64), &pos(100, 192), MaskSpec { causal: true, window: Some(150), docs: None })?),
        c("sliding window 33", 1, 2, 2, 16, Band::from_mask(&Mask::sliding_window(33), 130, 130)),
        c("random, empty rows", 2, 3, 1, 64, random_band(170, 201, 5)?),
        c(
            "batch-2 per-row bands (window 50 | docs full)",
            2,
            2,
            1,
            128,
            Band::stack(&[Band::from_mask(&Mask::sliding_window(50), 150, 150), Band::from_positions(&p150, &p150, full_docs)?])?,
        ),
        c("batch-2 per-row random bands", 2, 2, 2, 32, Band::stack(&[random_band(90, 77, 6)?, random_band(90, 77, 7)?])?),
        // head dim 256 (Gemma 3's sliding layers): the CUDA-core and pipelined band kernels
        c("docs + window 17", 1, 2, 1, 256, Band::from_positions(&pos(0, 80), &pos(0, 80), MaskSpec { causal: true, window: Some(17), docs: Some(&Documents::from_lengths(&[30, 1, 49])?) })?),
        // head dim 96 (Phi-3-mini's packed documents): the CUDA-core and pipelined band kernels
        c("docs causal", 1, 3, 1, 96, Band::from_positions(&pos(0, 150), &pos(0, 150), MaskSpec { causal: true, window: None, docs: Some(&Documents::from_lengths(&[70, 3, 77])?) })?),
    ];
    if !quick {
        let long = Documents::from_lengths(&[300, 5, 420, 275])?;
        let p = pos(0, 1000);
        let spec = MaskSpec { causal: true, window: Some(129), docs: Some(&long) };
        v.push(c("long docs + window 129", 1, 4, 2, 128, Band::from_positions(&p, &p, spec)?));
        v.push(c("long docs causal", 2, 2, 1, 64, Band::from_positions(&p, &p, MaskSpec { causal: true, window: None, docs: Some(&long) })?));
    }
    Ok(v)
}

/// (out, lse) and (dq, dk, dv) tolerances of a kernel family on `dtype`: the tensor-core kernels
/// round P, dO and dS to 16 bits (like FlashAttention).
fn tols(dtype: DType, tensor_cores: bool) -> ((f64, f64), f64) {
    match (dtype, tensor_cores) {
        (DType::F32, _) | (_, false) => ((2e-5, 2e-5), 1e-4),
        (DType::BF16, true) => ((2e-2, 1e-3), 3e-2),
        _ => ((4e-3, 1e-3), 5e-3),
    }
}

/// Gradients of `sum(out · dout)` through `attention_band` (autograd) on `dev`: out (as f32),
/// dq, dk, dv.
fn autograd(q: &Tensor, k: &Tensor, v: &Tensor, dout: &Tensor, band: &Band, scale: f64, dev: &Device) -> Result<[Tensor; 4]> {
    let (q, k, v) = (Var::from_tensor(&q.to_device(dev)?)?, Var::from_tensor(&k.to_device(dev)?)?, Var::from_tensor(&v.to_device(dev)?)?);
    let (out, _lse) = attention_band(q.as_tensor(), k.as_tensor(), v.as_tensor(), band, scale)?;
    let loss = (out.to_dtype(DType::F32)? * dout.to_device(dev)?)?.sum_all()?;
    let grads = loss.backward()?;
    let g = |x: &Var| -> Result<Tensor> {
        Ok(grads.get(x.as_tensor()).ok_or_else(|| anyhow::anyhow!("no gradient"))?.to_dtype(DType::F32)?)
    };
    Ok([out.to_dtype(DType::F32)?, g(&q)?, g(&k)?, g(&v)?])
}

/// The `band` section (see the module docs).
pub fn check_band(rep: &mut Report, gpu: &Device) -> Result<()> {
    let env_simple = FwdImpl::from_env() == FwdImpl::Simple;
    let cases = cases(rep.quick)?;
    // Every case's bounds uploaded in one transfer (`Band::upload_all`, as a ring pass does):
    // the device views hold exactly the host bounds, and the op reads them (below, bf16).
    let mut uploaded: Vec<Band> = cases.iter().map(|c| c.band.clone()).collect();
    Band::upload_all(uploaded.iter_mut(), gpu)?;
    for (c, u) in cases.iter().zip(&uploaded) {
        let name = format!("band Band::upload_all {} [band{} t{} s{}]", c.label, c.band.batch(), c.band.rows(), c.band.keys());
        match u.device_bounds(gpu) {
            Some((lo, hi)) => {
                let same = lo.dims() == [c.band.batch(), c.band.rows()]
                    && lo.flatten_all()?.to_vec1::<u32>()? == c.band.lo()
                    && hi.flatten_all()?.to_vec1::<u32>()? == c.band.hi();
                rep.check(&name, if same { 0.0 } else { 1.0 }, 0.0);
            }
            None => rep.error(&name, "no device copy after upload_all"),
        }
    }
    for (ci, (c, up)) in cases.iter().zip(&uploaded).enumerate() {
        let (t, s) = (c.band.rows(), c.band.keys());
        let shape = (c.band.batch(), t);
        let (glo, ghi) = (Tensor::from_slice(c.band.lo(), shape, gpu)?, Tensor::from_slice(c.band.hi(), shape, gpu)?);
        let kband = KBand { lo: &glo, hi: &ghi };
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let seed = 5000 + ci as u64 * 11;
            let mk = |shape: &[usize], s: u64| -> Result<Tensor> { Ok(rand_tensor(shape, s)?.to_dtype(dtype)?) };
            let q = mk(&[c.b, t, c.h, c.d], seed)?;
            let k = mk(&[c.b, s, c.hkv, c.d], seed + 1)?;
            let v = mk(&[c.b, s, c.hkv, c.d], seed + 2)?;
            let dout = rand_tensor(&[c.b, t, c.h, c.d], seed + 3)?;
            let scale = 1.0 / (c.d as f64).sqrt();
            let tag = format!("{} d{} {dtype:?} [b{} t{t} s{s} h{} kv{} band{}]", c.label, c.d, c.b, c.h, c.hkv, c.band.batch());
            let (o_ref, l_ref) = attention_fwd_band(&q, &k, &v, &c.band, scale)?;
            let (dq_r, dk_r, dv_r) = attention_bwd_band(&q, &k, &v, &o_ref, &l_ref, &dout, &c.band, scale)?;
            let (gq, gk, gv) = (q.to_device(gpu)?, k.to_device(gpu)?, v.to_device(gpu)?);
            let (go, gl, gd) = (o_ref.to_device(gpu)?, l_ref.to_device(gpu)?, dout.to_device(gpu)?);

            // the ops (default kernels)
            let ((to, tl), tg) = tols(dtype, !env_simple);
            let name = format!("band attention_fwd_band {tag}");
            match attention_fwd_band(&gq, &gk, &gv, &c.band, scale) {
                Ok((o, l)) => {
                    rep.check(&format!("{name} out"), max_abs(&o, &o_ref)?, to);
                    rep.check(&format!("{name} lse"), max_abs(&l, &l_ref)?, tl);
                }
                Err(e) => rep.error(&name, e),
            }
            if dtype == DType::BF16 {
                let name = format!("band attention_fwd_band (uploaded bounds) {tag}");
                match attention_fwd_band(&gq, &gk, &gv, up, scale) {
                    Ok((o, l)) => {
                        rep.check(&format!("{name} out"), max_abs(&o, &o_ref)?, to);
                        rep.check(&format!("{name} lse"), max_abs(&l, &l_ref)?, tl);
                    }
                    Err(e) => rep.error(&name, e),
                }
                let name = format!("band attention_bwd_band (uploaded bounds) {tag}");
                match attention_bwd_band(&gq, &gk, &gv, &go, &gl, &gd, up, scale) {
                    Ok((dq, dk, dv)) => {
                        rep.check(&format!("{name} dq"), rel(&dq, &dq_r)?, tg);
                        rep.check(&format!("{name} dk"), rel(&dk, &dk_r)?, tg);
                        rep.check(&format!("{name} dv"), rel(&dv, &dv_r)?, tg);
                    }
                    Err(e) => rep.error(&name, e),
                }
            }
            let name = format!("band attention_bwd_band {tag}");
            match attention_bwd_band(&gq, &gk, &gv, &go, &gl, &gd, &c.band, scale) {
                Ok((dq, dk, dv)) => {
                    rep.check(&format!("{name} dq"), rel(&dq, &dq_r)?, tg);
                    rep.check(&format!("{name} dk"), rel(&dk, &dk_r)?, tg);
                    rep.check(&format!("{name} dv"), rel(&dv, &dv_r)?, tg);
                }
                Err(e) => rep.error(&name, e),
            }
            let name = format!("band attention_band (autograd) {tag}");
            let want = autograd(&q, &k, &v, &dout, &c.band, scale, &Device::Cpu)?;
            match autograd(&q, &k, &v, &dout, &c.band, scale, gpu) {
                Ok(got) => {
                    // out rounded to the dtype on both sides: add its rounding to the bound
                    let round = match dtype {
                        DType::BF16 => 1e-2,
                        DType::F16 => 2e-3,
                        _ => 0.0,
                    };
                    rep.check(&format!("{name} out"), max_abs(&got[0], &want[0])?, to + round);
                    for (i, g) in ["dq", "dk", "dv"].iter().enumerate() {
                        rep.check(&format!("{name} {g}"), rel(&got[i + 1], &want[i + 1])?, tg + round);
                    }
                }
                Err(e) => rep.error(&name, e),
            }

            // the kernel crate with an explicit family; Mma falls back to Auto's
            // (head dims 96 and 256: the CUDA-core and pipelined kernels alone; the others refuse
            // them by name, gpu_check.rs)
            let partial = flash::PARTIAL_HEAD_DIMS.contains(&c.d);
            let imps: &[FwdImpl] = if partial && dtype == DType::F32 {
                &[FwdImpl::Simple]
            } else if partial {
                &[FwdImpl::Simple, FwdImpl::Pipelined]
            } else if dtype == DType::F32 {
                &[FwdImpl::Simple, FwdImpl::Mma]
            } else { &[FwdImpl::Simple, FwdImpl::Pipelined, FwdImpl::Mma, FwdImpl::Wgmma, FwdImpl::WgmmaAtomic, FwdImpl::WgmmaWs, FwdImpl::WgmmaTma] };
            for &imp in imps {
                let ((to, tl), tg) = tols(dtype, imp != FwdImpl::Simple);
                let name = format!("band flash::fwd_band {imp:?} {tag}");
                match flash::fwd_band(&gq, &gk, &gv, kband, scale as f32, imp) {
                    Ok((o, l)) => {
                        rep.check(&format!("{name} out"), max_abs(&o, &o_ref)?, to);
                        rep.check(&format!("{name} lse"), max_abs(&l, &l_ref)?, tl);
                    }
                    Err(e) if super::lacks_smem(imp, &e) => rep.refused(&name, e),
                    Err(e) => rep.error(&name, e),
                }
                let name = format!("band flash::bwd_band {imp:?} {tag}");
                match flash::bwd_band(&gq, &gk, &gv, &go, &gl, &gd, kband, scale as f32, imp) {
                    Ok((dq, dk, dv)) => {
                        rep.check(&format!("{name} dq"), rel(&dq, &dq_r)?, tg);
                        rep.check(&format!("{name} dk"), rel(&dk, &dk_r)?, tg);
                        rep.check(&format!("{name} dv"), rel(&dv, &dv_r)?, tg);
                    }
                    Err(e) if super::lacks_smem(imp, &e) => rep.refused(&name, e),
                    Err(e) => rep.error(&name, e),
                }
            }
        }
    }
    Ok(())
}
