//! GPU correctness check (feature `cuda`): every CUDA kernel against the CPU path, the oracle
//! cases through the autograd op on the GPU, ring / all-gather / Ulysses on virtual ranks
//! (thread ranks sharing one GPU), the tiny-Llama oracle on every layout family (CP, Ulysses,
//! TP + SP, 2-D) on virtual ranks, and (feature `nccl`) an NcclGroup smoke test of world 1
//! and its failure paths (abort; a rank that never joins must fail init within its timeout),
//! and the CP methods on NCCL ranks, one GPU each (section `nccl-ranks`, 2+ GPUs). Section
//! `views`: inputs that are views (storage offset, transposed) and bad input (gpu_check_views.rs).
//! Sections `packed` and `window`: packed documents (document masks) and causal sliding
//! windows through the single-device op, ring, all-gather KV and Ulysses on virtual ranks
//! against the CPU path and the oracle rows; `decode`: decoding against a KV cache sharded
//! over virtual ranks (gpu_check_masks.rs). Section `band`: band masks (one key interval per
//! query row) through the ops and the kernel crate vs the CPU (gpu_check_band.rs). Section
//! `random`: seeded random configurations (documents, windows, masks, GQA, D, dtype, layouts)
//! through every CP method on virtual ranks vs the CPU path (gpu_check_random.rs).
//! Sections `oracle` and `llama` (the oracle cases and the tiny Llama on virtual ranks):
//! gpu_check_oracle.rs. Section `quant`: the int8 / NF4 dequantization kernel (a LoRA run's
//! quantized base) against the host loops, bit for bit (gpu_check_quant.rs). Section `moe`: top-K
//! routing on the device against the host loop (gpu_check_moe.rs). Section `dropout`: dropout keep
//! masks drawn on the device against the host draws (gpu_check_dropout.rs). Sections `merge` and
//! `layout`: the ring-step merge and state kernels, the layout gather / scatter (gpu_check_merge.rs).
//!
//! ```text
//! cargo run --release --features cuda -p candle-cp-examples --example gpu_check -- [--oracle DIR] [--ordinal N] \
//!     [--llama DIR] [--impls auto,simple,mma,pipelined,wgmma,wgmma-atomic,wgmma-ws,wgmma-tma,wgmma-tma-wide,atomic] [--sections probe,flash,views,flash-large,merge,layout,quant,moe,dropout,band,oracle,packed,window,decode,random,llama,nccl,nccl-ranks]
//!     [--quick]
//! ```
//! `--impls` limits the kernel families checked by the flash sections (`wgmma`, `wgmma-atomic`, `wgmma-ws` and `wgmma-tma`, Hopper only, and
//! `atomic`, the fused backward with atomic dQ, are checked only when named; `auto`, named, adds
//! `Auto`'s choice on this device beside the explicit families); `--sections` runs only
//! the named sections (so a kernel that faults and poisons the CUDA context can be isolated in
//! its own process). The oracle section uses the ops' default kernels (`CANDLE_CP_FLASH_IMPL`).
//! `--quick` runs a reduced set (small flash and oracle cases, one Llama layout): what CI
//! runs on the CPU under the host CUDA shim (`candle-cp-kernels/emu/shim/`, docs/gpu.md).
//! Prints one `PASS`/`FAIL` line per check and exits non-zero if any check fails.
//! Run by `scripts/gpu-check.sh run` on the GPU machine (see docs/gpu.md).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_cp_kernels::flash::{self, FwdImpl, KMask};
use candle_cp_ops::attention::{attention_bwd, attention_fwd, Mask};
use candle_cp_ops::oracle::{AttnCase, AttnMetrics, AttnOutputs};
use std::time::Instant;

#[path = "gpu_util.rs"]
mod gpu_util;
#[path = "gpu_add_dq.rs"]
mod gpu_add_dq;
#[path = "gpu_check_views.rs"]
mod views;
#[path = "gpu_check_masks.rs"]
mod masks;
#[path = "gpu_check_band.rs"]
mod band;
#[path = "gpu_check_random.rs"]
mod random;
#[path = "gpu_check_quant.rs"]
mod quant;
#[path = "gpu_check_moe.rs"]
mod moe;
#[path = "gpu_check_dropout.rs"]
mod dropout;
#[path = "../tests/draws.rs"]
mod draws;
#[path = "gpu_check_oracle.rs"]
mod oracle;
#[path = "gpu_check_merge.rs"]
mod merge_layout;
#[cfg(feature = "nccl")]
#[path = "gpu_check_nccl.rs"]
mod nccl;
use gpu_util::{max_abs, rand_tensor, rel};

/// Whether `imp` is a tensor-core family (16-bit P, dO and dS: looser tolerances).
/// Whether `imp` on `dtype` runs tensor-core kernels, which round P (and dS) to 16 bits: the
/// tensor-core families, and `Auto` on f16 / bf16.
fn rounds16(imp: FwdImpl, dtype: DType) -> bool {
    tensor_core(imp) || (imp == FwdImpl::Auto && dtype != DType::F32)
}

fn tensor_core(imp: FwdImpl) -> bool {
    matches!(imp, FwdImpl::Mma | FwdImpl::Pipelined | FwdImpl::Wgmma | FwdImpl::WgmmaAtomic | FwdImpl::WgmmaWs | FwdImpl::WgmmaTma | FwdImpl::WgmmaTmaWide | FwdImpl::AtomicDq)
}

/// Pass/fail bookkeeping.
#[derive(Default)]
struct Report {
    pass: usize,
    fail: Vec<String>,
    /// Kernel families to check (`--impls`); all when empty.
    imps: Vec<FwdImpl>,
    /// `--quick`: the reduced set run on the CPU under the host CUDA shim in CI (see
    /// `docs/gpu.md`): no flash case over 333 positions, the oracle files of at most
    /// [`QUICK_MAX_TOKENS`] tokens (CP methods at P = 2 only on virtual ranks), one Llama
    /// layout (2-D: Ulysses 2 x ring 2). Every kernel family, dtype and mask kind is still exercised.
    quick: bool,
}

/// `--quick`: the largest oracle case (batch x tokens) the oracle sections run.
const QUICK_MAX_TOKENS: usize = 256;

impl Report {
    /// Whether `--impls` selects this kernel family.
    fn wants(&self, imp: FwdImpl) -> bool {
        self.imps.is_empty() || self.imps.contains(&imp)
    }
    /// Whether `--impls` names this family explicitly (opt-in families: `Wgmma`, Hopper only).
    fn named(&self, imp: FwdImpl) -> bool {
        self.imps.contains(&imp)
    }
    fn check(&mut self, name: &str, err: f64, tol: f64) {
        let ok = err.is_finite() && err <= tol;
        println!("{} {name}: err {err:.3e} (tol {tol:.1e})", if ok { "PASS" } else { "FAIL" });
        if ok {
            self.pass += 1
        } else {
            self.fail.push(name.to_string())
        }
    }
    fn error(&mut self, name: &str, e: impl std::fmt::Display) {
        println!("FAIL {name}: error {e}");
        self.fail.push(name.to_string());
    }
    /// An expected refusal (the error names why): a pass.
    fn refused(&mut self, name: &str, e: impl std::fmt::Display) {
        println!("PASS {name} refused on this device: {e}");
        self.pass += 1;
    }
}

/// One attention shape + mask.
#[derive(Clone, Copy)]
struct Case {
    b: usize,
    t: usize,
    s: usize,
    h: usize,
    hkv: usize,
    d: usize,
    mask: Mask,
    label: &'static str,
}

fn cases() -> Vec<Case> {
    let c = |b, t, s, h, hkv, d, mask, label| Case { b, t, s, h, hkv, d, mask, label };
    let causal = Mask::causal();
    let mut v = Vec::new();
    for d in [16, 32, 64, 128] {
        v.push(c(1, 77, 77, 2, 2, d, Mask::Full, "full"));
        v.push(c(2, 130, 130, 4, 2, d, causal, "causal-gqa"));
    }
    // ring blocks: queries after keys (below the diagonal), keys after queries (fully masked
    // rows), striped (stride P = 4, rank 1 queries vs rank 3 keys), T != S, MQA.
    v.push(c(1, 96, 64, 4, 1, 128, Mask::causal_offsets(64, 0), "offset-below"));
    v.push(c(1, 64, 64, 2, 2, 64, Mask::causal_offsets(0, 32), "offset-partly-masked"));
    v.push(c(1, 64, 64, 2, 2, 64, Mask::causal_offsets(0, 100), "offset-all-masked"));
    v.push(c(1, 100, 100, 4, 4, 128, Mask::Causal { q_offset: 1, q_stride: 4, k_offset: 3, k_stride: 4 }, "striped"));
    v.push(c(1, 200, 333, 8, 1, 64, Mask::Full, "t-ne-s-mqa"));
    // one query row (a decode step) with a group of 3 query heads per KV head; tiny ragged
    // causal blocks, batch 3, group of 2.
    v.push(c(1, 1, 200, 6, 2, 64, Mask::Full, "decode-gqa3"));
    v.push(c(3, 9, 9, 6, 3, 128, causal, "tiny-causal-b3"));
    // many K/V tiles per query block (exercises the double-buffered pipelines), ragged ends.
    v.push(c(1, 1000, 1000, 4, 2, 128, Mask::causal_offsets(24, 0), "long-causal-gqa"));
    v.push(c(2, 513, 1031, 2, 1, 64, Mask::Full, "long-full-mqa"));
    // head dim 256 (Gemma 3 1B / 4B / 12B): the CUDA-core kernels (dynamic shared memory) and
    // the pipelined ones (64-row forward blocks, dK/dV blocks of 128 columns); full, causal GQA
    // with two key tiles, a ring block below the diagonal, and several blocks of each kind
    // with ragged ends (3 forward blocks, 2 key blocks x 2 column slices, 9 query tiles)
    v.push(c(1, 45, 77, 2, 2, 256, Mask::Full, "full"));
    v.push(c(2, 70, 70, 4, 2, 256, causal, "causal-gqa"));
    v.push(c(1, 40, 64, 2, 1, 256, Mask::causal_offsets(64, 0), "offset-below"));
    v.push(c(1, 150, 200, 3, 1, 256, Mask::causal_offsets(50, 0), "ragged-causal-gqa3"));
    // head dim 96 (Phi-3-mini, Phi-3.5-mini): the CUDA-core, mma and pipelined kernels (the
    // pipelined forward's 12 chunks a row over 120 of its 128 threads; d128's backward tiles);
    // full, causal over several key tiles, a ring block below the diagonal, ragged blocks with GQA.
    v.push(c(1, 45, 77, 2, 2, 96, Mask::Full, "full"));
    v.push(c(2, 150, 150, 4, 2, 96, causal, "causal-gqa"));
    v.push(c(1, 40, 64, 2, 1, 96, Mask::causal_offsets(64, 0), "offset-below"));
    v.push(c(1, 200, 260, 3, 1, 96, Mask::causal_offsets(60, 0), "ragged-causal-gqa3"));
    v
}

fn kmask(m: &Mask) -> KMask {
    match *m {
        Mask::Full => KMask::full(),
        Mask::Causal { q_offset, q_stride, k_offset, k_stride } => KMask::causal(q_offset, q_stride, k_offset, k_stride),
        // the raw-kernel cases above hold no window (section `window` goes through attention())
        Mask::Window { .. } => unreachable!("raw kernel cases have no window mask"),
    }
}

/// Kernels vs the CPU implementation (inputs rounded to `dtype` first, so both see the same
/// values): forward (simple and tensor-core kernels) and backward.
fn check_flash(rep: &mut Report, gpu: &Device) -> Result<()> {
    for (ci, c) in cases().iter().enumerate() {
        if rep.quick && c.t.max(c.s) > 333 {
            continue;
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let seed = 1000 + ci as u64 * 7;
            let mk = |shape: &[usize], s: u64| -> Result<Tensor> { Ok(rand_tensor(shape, s)?.to_dtype(dtype)?) };
            let q = mk(&[c.b, c.t, c.h, c.d], seed)?;
            let k = mk(&[c.b, c.s, c.hkv, c.d], seed + 1)?;
            let v = mk(&[c.b, c.s, c.hkv, c.d], seed + 2)?;
            let dout = rand_tensor(&[c.b, c.t, c.h, c.d], seed + 3)?;
            let scale = 1.0 / (c.d as f64).sqrt();
            let (o_ref, l_ref) = attention_fwd(&q, &k, &v, &c.mask, scale)?;
            let (gq, gk, gv) = (q.to_device(gpu)?, k.to_device(gpu)?, v.to_device(gpu)?);
            let tag = format!("{} d{} {dtype:?} [b{} t{} s{} h{} kv{}]", c.label, c.d, c.b, c.t, c.s, c.h, c.hkv);
            // head dims 96 and 256: some families alone (the CUDA-core and pipelined kernels; mma at 96)
            let partial = flash::PARTIAL_HEAD_DIMS.contains(&c.d);
            let all: &[FwdImpl] = if dtype == DType::F32 {
                &[FwdImpl::Simple]
            } else if partial {
                // the families that take the head dim (flash::family_takes), and Auto: the
                // pipelined kernels, or where the device lacks their shared memory the mma ones
                // (96) or the CUDA-core ones (256)
                &[FwdImpl::Simple, FwdImpl::Mma, FwdImpl::Pipelined, FwdImpl::Auto]
            } else {
                &[FwdImpl::Simple, FwdImpl::Mma, FwdImpl::Pipelined]
            };
            let mut imps: Vec<FwdImpl> = all.iter().copied().filter(|&i| rep.wants(i) && flash::family_takes(i, c.d)).collect();
            if dtype != DType::F32 && matches!(c.d, 64 | 128) && rep.named(FwdImpl::Wgmma) {
                imps.push(FwdImpl::Wgmma);
            }
            if dtype != DType::F32 && matches!(c.d, 64 | 128) && rep.named(FwdImpl::WgmmaAtomic) {
                imps.push(FwdImpl::WgmmaAtomic);
            }
            if dtype != DType::F32 && matches!(c.d, 64 | 128) && rep.named(FwdImpl::WgmmaWs) {
                imps.push(FwdImpl::WgmmaWs);
            }
            if dtype != DType::F32 && matches!(c.d, 64 | 128) && rep.named(FwdImpl::WgmmaTma) {
                imps.push(FwdImpl::WgmmaTma);
            }
            // (its own kernels at d = 128 only; d = 64 is WgmmaTma's)
            if dtype != DType::F32 && c.d == 128 && rep.named(FwdImpl::WgmmaTmaWide) {
                imps.push(FwdImpl::WgmmaTmaWide);
            }
            // (Auto named: its choice on this device, e.g. the mma kernels where the pipelined
            // ones do not fit; at 96 and 256 it is in the list above)
            if dtype != DType::F32 && !partial && rep.named(FwdImpl::Auto) {
                imps.push(FwdImpl::Auto);
            }
            if dtype != DType::F32 && !partial && rep.named(FwdImpl::AtomicDq) {
                imps.push(FwdImpl::AtomicDq);
            }
            if partial && dtype == DType::BF16 {
                check_partial_refused(rep, &tag, (&gq, &gk, &gv), kmask(&c.mask), scale as f32);
            }
            let imps = &imps;
            for &imp in imps {
                let name = format!("flash_fwd {imp:?} {tag}");
                match flash::fwd(&gq, &gk, &gv, kmask(&c.mask), scale as f32, imp) {
                    Ok((o, l)) => {
                        // mma rounds P to 16 bits before P·V (like FlashAttention).
                        let tol = match (imp, dtype) {
                            (i, DType::BF16) if rounds16(i, dtype) => 2e-2,
                            (i, DType::F16) if rounds16(i, dtype) => 4e-3,
                            _ => 2e-5,
                        };
                        rep.check(&format!("{name} out"), max_abs(&o, &o_ref)?, tol);
                        rep.check(&format!("{name} lse"), max_abs(&l, &l_ref)?, if imp == FwdImpl::Simple { 2e-5 } else { 1e-3 });
                    }
                    Err(e) if lacks_smem(imp, &e) => rep.refused(&name, e),
                    Err(e) => rep.error(&name, e),
                }
            }
            let (dq_r, dk_r, dv_r) = attention_bwd(&q, &k, &v, &o_ref, &l_ref, &dout, &c.mask, scale)?;
            let go = o_ref.to_device(gpu)?;
            let gl = l_ref.to_device(gpu)?;
            let gd = dout.to_device(gpu)?;
            for &imp in imps {
                let name = format!("flash_bwd {imp:?} {tag}");
                // mma rounds dO, P and dS to 16 bits before the products (like FlashAttention).
                let tol = match (imp, dtype) {
                    (i, DType::BF16) if rounds16(i, dtype) => 3e-2,
                    (i, DType::F16) if rounds16(i, dtype) => 5e-3,
                    _ => 1e-4,
                };
                match flash::bwd_with(&gq, &gk, &gv, &go, &gl, &gd, kmask(&c.mask), scale as f32, imp) {
                    Ok((dq, dk, dv)) => {
                        rep.check(&format!("{name} dq"), rel(&dq, &dq_r)?, tol);
                        rep.check(&format!("{name} dk"), rel(&dk, &dk_r)?, tol);
                        rep.check(&format!("{name} dv"), rel(&dv, &dv_r)?, tol);
                    }
                    Err(e) if lacks_smem(imp, &e) => rep.refused(&name, e),
                    Err(e) => rep.error(&name, e),
                }
            }
        }
    }
    Ok(())
}

/// An explicit `Pipelined` call on a device without the shared memory its kernels need (e.g. the
/// d256 backward's 203,264 bytes per block: Hopper only; d128's 104,960-byte forward on sm_86 /
/// sm_89 / sm_120): the launcher's refusal, which names the sizes (`Auto` runs the mma or
/// CUDA-core kernels there). Only on a device that allows less than Hopper's 232,448 bytes: on
/// an H100 / H200 such an error is a wrong size, and fails.
fn lacks_smem(imp: FwdImpl, e: &candle_core::Error) -> bool {
    let msg = e.to_string();
    let allows = msg.split("the device allows ").nth(1).and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next()?.parse::<u64>().ok());
    imp == FwdImpl::Pipelined && allows.is_some_and(|a| a < 232_448)
}

/// At a head dim only some families take (96, 256), the raw kernel functions refuse the others
/// (the fused and Hopper families; mma at 256) by name (one check per family: an error naming
/// the head dim), and `Auto` runs (on the pipelined kernels where the device has their shared
/// memory).
fn check_partial_refused(rep: &mut Report, tag: &str, (q, k, v): (&Tensor, &Tensor, &Tensor), mask: KMask, scale: f32) {
    let d = q.dim(3).unwrap_or(0);
    let head_dim = format!("head dim {d}");
    for imp in [FwdImpl::Mma, FwdImpl::AtomicDq, FwdImpl::WgmmaTma].into_iter().filter(|&i| !flash::family_takes(i, d)) {
        let name = format!("flash_fwd {imp:?} {tag} refused");
        match flash::fwd(q, k, v, mask, scale, imp) {
            Err(e) if e.to_string().contains(&head_dim) => {
                println!("PASS {name}: {e}");
                rep.pass += 1
            }
            Err(e) => rep.error(&name, e),
            Ok(_) => rep.error(&name, "ran instead of refusing"),
        }
    }
    let name = format!("flash_fwd Auto {tag} runs");
    match flash::fwd(q, k, v, mask, scale, FwdImpl::Auto) {
        Ok(_) => {
            println!("PASS {name}");
            rep.pass += 1
        }
        Err(e) => rep.error(&name, e),
    }
}

/// Probe kernels (`candle_cp_kernels::probe`): mma.sync / ldmatrix / cp.async (and wgmma on
/// Hopper) against the register layouts our kernels assume; one line per probe, `probe <name>: OK`
/// or `probe <name>: FAIL <diagnosis>` (which thread's register holds which element, and the
/// pattern; see docs/gpu.md "Probe kernels").
fn check_probe(rep: &mut Report, gpu: &Device) -> Result<()> {
    let Device::Cuda(dev) = gpu else { anyhow::bail!("probe: {gpu:?} is not a CUDA device") };
    for r in candle_cp_kernels::probe::run_probes(dev)? {
        if r.ok {
            println!("probe {}: OK", r.name);
            rep.pass += 1;
        } else {
            println!("probe {}: FAIL {}", r.name, r.diagnosis);
            rep.fail.push(format!("probe {}", r.name));
        }
    }
    Ok(())
}

/// The oracle attention cases of `dir` (its `*.safetensors` files, in file-name order), loaded
/// one at a time; with `quick`, those over [`QUICK_MAX_TOKENS`] (batch x tokens) are left out.
fn oracle_cases(dir: &str, quick: bool) -> Result<impl Iterator<Item = Result<AttnCase>>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "safetensors"));
    files.sort();
    let small = |c: &AttnCase| -> candle_core::Result<bool> { Ok(c.q.dim(0)? * c.q.dim(1)? <= QUICK_MAX_TOKENS) };
    Ok(files.into_iter().filter_map(move |path| match AttnCase::load(&path).and_then(|c| Ok((!quick || small(&c)?, c))) {
        Ok((true, c)) => Some(Ok(c)),
        Ok((false, _)) => None,
        Err(e) => Some(Err(e.into())),
    }))
}

fn case_to(case: &AttnCase, dev: &Device) -> Result<AttnCase> {
    let mut c = case.clone();
    c.q = c.q.to_device(dev)?;
    c.k = c.k.to_device(dev)?;
    c.v = c.v.to_device(dev)?;
    c.dout = c.dout.to_device(dev)?;
    Ok(c)
}

fn report_metrics(rep: &mut Report, name: &str, got: &AttnOutputs, case: &AttnCase) -> Result<()> {
    let m = AttnMetrics::compute(got, &case.reference)?;
    let tol = case.tolerances();
    rep.check(&format!("{name} out"), m.out_abs, tol.out_abs);
    rep.check(&format!("{name} lse"), m.lse_abs, tol.lse_abs);
    rep.check(&format!("{name} dq"), m.dq_rel, tol.dq_rel);
    rep.check(&format!("{name} dk"), m.dk_rel, tol.dk_rel);
    rep.check(&format!("{name} dv"), m.dv_rel, tol.dv_rel);
    Ok(())
}

/// Production-sized problem (T = 4096, D = 128, bf16, causal and full, GQA 2:1): the
/// tensor-core kernel families against the f32 CUDA-core kernels on the same bf16 inputs
/// (the CPU reference would take minutes here). Catches pipeline bugs that only show with
/// many K/V tiles per block and many blocks per SM.
fn check_large(rep: &mut Report, gpu: &Device) -> Result<()> {
    let (b, t, h, hkv, d) = (1usize, 4096usize, 8usize, 4usize, 128usize);
    let mk = |shape: &[usize], s: u64| -> Result<Tensor> { Ok(rand_tensor(shape, s)?.to_dtype(DType::BF16)?.to_device(gpu)?) };
    let (q, k, v) = (mk(&[b, t, h, d], 71)?, mk(&[b, t, hkv, d], 72)?, mk(&[b, t, hkv, d], 73)?);
    let dout = rand_tensor(&[b, t, h, d], 74)?.to_device(gpu)?;
    let scale = 1.0 / (d as f32).sqrt();
    for mask in [KMask::causal(0, 1, 0, 1), KMask::full()] {
        let label = if mask.causal { "causal" } else { "full" };
        let (o_ref, l_ref) = flash::fwd(&q, &k, &v, mask, scale, FwdImpl::Simple)?;
        let (dq_r, dk_r, dv_r) = flash::bwd_with(&q, &k, &v, &o_ref, &l_ref, &dout, mask, scale, FwdImpl::Simple)?;
        let mut imps: Vec<FwdImpl> = [FwdImpl::Mma, FwdImpl::Pipelined].into_iter().filter(|&i| rep.wants(i)).collect();
        if rep.named(FwdImpl::Wgmma) {
            imps.push(FwdImpl::Wgmma);
        }
        if rep.named(FwdImpl::WgmmaAtomic) {
            imps.push(FwdImpl::WgmmaAtomic);
        }
        if rep.named(FwdImpl::WgmmaWs) {
            imps.push(FwdImpl::WgmmaWs);
        }
        if rep.named(FwdImpl::WgmmaTma) {
            imps.push(FwdImpl::WgmmaTma);
        }
        if rep.named(FwdImpl::WgmmaTmaWide) {
            imps.push(FwdImpl::WgmmaTmaWide);
        }
        if rep.named(FwdImpl::AtomicDq) {
            imps.push(FwdImpl::AtomicDq);
        }
        for imp in imps {
            let name = format!("large {imp:?} {label} [b{b} t{t} h{h} kv{hkv} d{d}] bf16");
            match flash::fwd(&q, &k, &v, mask, scale, imp) {
                Ok((o, l)) => {
                    rep.check(&format!("{name} fwd out"), max_abs(&o, &o_ref)?, 2e-2);
                    rep.check(&format!("{name} fwd lse"), max_abs(&l, &l_ref)?, 1e-3);
                }
                Err(e) => rep.error(&format!("{name} fwd"), e),
            }
            match flash::bwd_with(&q, &k, &v, &o_ref, &l_ref, &dout, mask, scale, imp) {
                Ok((dq, dk, dv)) => {
                    rep.check(&format!("{name} bwd dq"), rel(&dq, &dq_r)?, 3e-2);
                    rep.check(&format!("{name} bwd dk"), rel(&dk, &dk_r)?, 3e-2);
                    rep.check(&format!("{name} bwd dv"), rel(&dv, &dv_r)?, 3e-2);
                }
                Err(e) => rep.error(&format!("{name} bwd"), e),
            }
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    candle_cp_examples::check_flags(&args, &["--ordinal", "--oracle", "--llama", "--impls", "--sections"], &["--quick"])?;
    let arg = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let ordinal: usize = arg("--ordinal").map(|s| s.parse()).transpose()?.unwrap_or(0);
    let oracle = arg("--oracle").unwrap_or_else(|| "tests/data/oracle/attn".into());
    let llama = arg("--llama").unwrap_or_else(|| "tests/data/oracle/tiny-llama".into());
    let imps = match arg("--impls") {
        None => Vec::new(),
        Some(list) => list
            .split(',')
            .map(|x| match FwdImpl::from_name(x) {
                None => Err(anyhow::anyhow!("--impls: unknown kernel family {x:?} (auto, simple, mma, pipelined, wgmma, wgmma-atomic, wgmma-ws, wgmma-tma, wgmma-tma-wide, atomic)")),
                Some(imp) => Ok(imp),
            })
            .collect::<Result<Vec<_>>>()?,
    };
    let only: Option<Vec<String>> = arg("--sections").map(|l| l.split(',').map(|x| x.trim().to_string()).collect());
    // A misspelt section would otherwise run nothing and report "0 passed" (device time is short).
    const SECTIONS: [&str; 18] = [
        "probe", "flash", "views", "flash-large", "merge", "layout", "quant", "moe", "dropout", "band", "oracle", "packed", "window", "decode", "random", "llama",
        "nccl", "nccl-ranks",
    ];
    for x in only.iter().flatten() {
        if !SECTIONS.contains(&x.as_str()) {
            anyhow::bail!("--sections: unknown section {x:?} (one of {})", SECTIONS.join(", "));
        }
        if x.starts_with("nccl") && !cfg!(feature = "nccl") {
            anyhow::bail!("--sections: {x:?} needs the binary built with `--features candle-cp-examples/nccl`");
        }
    }
    let want = |name: &str| only.as_ref().is_none_or(|l| l.iter().any(|x| x == name));
    let gpu = Device::new_cuda(ordinal)?;
    let quick = args.iter().any(|a| a == "--quick");
    let mut rep = Report { imps, quick, ..Default::default() };
    let start = Instant::now();
    type Section = fn(&mut Report, &Device) -> Result<()>;
    let sections: [(&str, Section); 10] = [
        ("probe", check_probe),
        ("flash", check_flash),
        ("views", views::check_views),
        ("flash-large", check_large),
        ("merge", merge_layout::check_merge),
        ("layout", merge_layout::check_layout),
        ("quant", quant::check_quant),
        ("moe", moe::check_moe),
        ("dropout", dropout::check_dropout),
        ("band", band::check_band),
    ];
    for (name, f) in sections {
        if !want(name) {
            continue;
        }
        let t = Instant::now();
        if let Err(e) = f(&mut rep, &gpu) {
            rep.error(&format!("section {name}"), e);
        }
        println!("-- section {name}: {:.1} s", t.elapsed().as_secs_f64());
    }
    if want("oracle") {
        let t = Instant::now();
        if let Err(e) = oracle::check_oracle(&mut rep, &gpu, &oracle) {
            rep.error("section oracle", e);
        }
        println!("-- section oracle + virtual ranks: {:.1} s", t.elapsed().as_secs_f64());
    }
    if want("packed") {
        let t = Instant::now();
        if let Err(e) = masks::check_packed(&mut rep, &gpu, &oracle) {
            rep.error("section packed", e);
        }
        println!("-- section packed documents (virtual ranks): {:.1} s", t.elapsed().as_secs_f64());
    }
    if want("decode") {
        let t = Instant::now();
        if let Err(e) = masks::check_decode(&mut rep, &gpu) {
            rep.error("section decode", e);
        }
        println!("-- section decode against a sharded KV cache (virtual ranks): {:.1} s", t.elapsed().as_secs_f64());
    }
    if want("window") {
        let t = Instant::now();
        if let Err(e) = masks::check_window(&mut rep, &gpu, &oracle) {
            rep.error("section window", e);
        }
        println!("-- section sliding window (virtual ranks): {:.1} s", t.elapsed().as_secs_f64());
    }
    if want("random") {
        let t = Instant::now();
        if let Err(e) = random::check_random(&mut rep, &gpu) {
            rep.error("section random", e);
        }
        println!("-- section random configurations (virtual ranks): {:.1} s", t.elapsed().as_secs_f64());
    }
    if want("llama") {
        let t = Instant::now();
        if let Err(e) = oracle::check_llama(&mut rep, &gpu, &llama) {
            rep.error("section llama", e);
        }
        println!("-- section llama (virtual ranks): {:.1} s", t.elapsed().as_secs_f64());
    }
    #[cfg(feature = "nccl")]
    if want("nccl") {
        if let Err(e) = nccl::check_nccl(&mut rep, ordinal) {
            rep.error("section nccl", e);
        }
    }
    #[cfg(feature = "nccl")]
    if want("nccl-ranks") {
        let t = Instant::now();
        if let Err(e) = nccl::check_nccl_ranks(&mut rep, &oracle, &llama) {
            rep.error("section nccl-ranks", e);
        }
        println!("-- section nccl-ranks: {:.1} s", t.elapsed().as_secs_f64());
    }
    println!(
        "gpu_check: {} passed, {} failed in {:.1} s{}",
        rep.pass,
        rep.fail.len(),
        start.elapsed().as_secs_f64(),
        if rep.fail.is_empty() { String::new() } else { format!(": {}", rep.fail.join(", ")) }
    );
    if !rep.fail.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}
