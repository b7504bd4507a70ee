//! Launchers of the probe kernels (`kernels/probe.cu`, `kernels/probe_sm90.cu`): each isolates one
//! primitive the tensor-core kernels rest on (mma.sync m16n8k16, ldmatrix .x4 / .x4.trans,
//! cp.async with zero-fill and wait_group, wgmma m64nNk16 in the operand forms of the sm_90a flash
//! kernels) and dumps what every register of every thread holds. [`run_probes`] compares the dumps
//! with the layouts our kernels assume ([`crate::probe_map`], the same formulas as the kernels) and
//! explains mismatches ([`crate::probe_diag`]): which thread's register holds which element, and
//! the pattern. CPU reference: those two modules (unit-tested without CUDA). Run on a GPU by the
//! `probe` section of `examples/gpu_check.rs`; see docs/gpu.md "Probe kernels".

pub use crate::probe_diag::ProbeResult;
use crate::probe_diag::{diagnose, diagnose_all};
use crate::flash::tma::{map_bthd, map_f32_bthd, TmaMap};
use crate::probe_map::{self, WgForm, LDSM_VARIANTS, MMA_PASSES, WG_K, WG_M, WG_PASSES, WG_THREADS};
use crate::ptx;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result};
use half::{bf16, f16};

/// Runs every probe on `dev` and returns one [`ProbeResult`] per probe: `mma16816 {bf16,f16}`, the
/// four ldmatrix variants, `cp.async`, and on compute capability 9.x `wgmma {ss,rs} m64n{64,128}k16
/// {bf16,f16}`, `wgmma sstb m64n64k16 {bf16,f16}`, `tma` (one tensor-map tile load), `tma reduce`
/// (two f32 TMA reductions from a swizzled shared box, as the `wgmma-tma` backward adds its dQ) and
/// `stmatrix dS` (the Hopper backwards' transposed dS store, `bwd_sm90_ds_store`). A probe whose launch fails gives `ok = false`
/// with the error as its diagnosis (a later probe may then fail too: a faulting kernel poisons the
/// CUDA context). Errors only when the device's compute capability cannot be read.
pub fn run_probes(dev: &CudaDevice) -> Result<Vec<ProbeResult>> {
    let mut out = Vec::new();
    let mut push = |name: String, r: Result<ProbeResult>| {
        out.push(r.unwrap_or_else(|e| ProbeResult { name, ok: false, diagnosis: format!("error: {e}") }))
    };
    for dt in [DType::BF16, DType::F16] {
        push(format!("mma16816 {}", dt.as_str()), mma(dev, dt));
    }
    match ldsm(dev) {
        Ok(v) => v.into_iter().for_each(|r| push(r.name.clone(), Ok(r))),
        Err(e) => push("ldmatrix".into(), Err(e)),
    }
    push("cp.async".into(), cp_async(dev));
    let (major, _) = dev.cuda_stream().context().compute_capability().w()?;
    if major == 9 {
        for (form, n) in [(WgForm::Ss, 64), (WgForm::Ss, 128), (WgForm::Rs, 64), (WgForm::Rs, 128), (WgForm::SsTb, 64)] {
            for dt in [DType::BF16, DType::F16] {
                let name = format!("wgmma {} m64n{n}k16 {}", form.tag(), dt.as_str());
                push(name.clone(), wgmma(dev, form, n, dt, &name));
            }
        }
        push("tma".into(), tma(dev));
        push("tma reduce".into(), tma_red(dev));
        push("stmatrix dS".into(), stsm_ds(dev));
    }
    Ok(out)
}

/// `probe_mma16816_{bf16,f16}`: grid MMA_PASSES, block 32; dump `[pass][lane][4]` f32.
fn mma(dev: &CudaDevice, dtype: DType) -> Result<ProbeResult> {
    let cfg = LaunchConfig { grid_dim: (MMA_PASSES as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    let (mut ah, mut bh) = (Vec::new(), Vec::new());
    for p in 0..MMA_PASSES {
        let (a, b) = probe_map::mma_inputs(p);
        ah.extend(a);
        bh.extend(b);
    }
    let mut out = dev.alloc_zeros::<f32>(MMA_PASSES * 32 * 4)?;
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let ac: Vec<$ty> = ah.iter().map(|&x| <$ty>::from_f32(x)).collect();
            let bc: Vec<$ty> = bh.iter().map(|&x| <$ty>::from_f32(x)).collect();
            let mut a = dev.alloc_zeros::<$ty>(ac.len())?;
            dev.memcpy_htod(&ac, &mut a)?;
            let mut b = dev.alloc_zeros::<$ty>(bc.len())?;
            dev.memcpy_htod(&bc, &mut b)?;
            let func = dev.get_or_load_custom_func($name, ptx::PROBE_MODULE, ptx::PROBE)?;
            let mut bld = func.builder();
            bld.arg(&a).arg(&b).arg(&mut out);
            // SAFETY: matches probe_mma16816_* in kernels/probe.cu (a [passes][16][16], b [passes][16][8]).
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match dtype {
        DType::BF16 => go!(bf16, "probe_mma16816_bf16"),
        DType::F16 => go!(f16, "probe_mma16816_f16"),
        dt => candle_core::bail!("probe mma16816: dtype {dt:?} not supported (bf16, f16)"),
    }
    let dump = dev.clone_dtoh(&out)?;
    Ok(diagnose_all(&format!("mma16816 {}", dtype.as_str()), &probe_map::mma_checks(&dump)))
}

/// `probe_ldsm`: grid 1, block 32, 768 bytes of dynamic shared memory (16 rows of
/// [`probe_map::LDSM_DPB`] bytes); dump `[4 variants][lane][4]` u32.
fn ldsm(dev: &CudaDevice) -> Result<Vec<ProbeResult>> {
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: (16 * probe_map::LDSM_DPB) as u32 };
    let mut out = dev.alloc_zeros::<u32>(LDSM_VARIANTS.len() * 32 * 4)?;
    let func = dev.get_or_load_custom_func("probe_ldsm", ptx::PROBE_MODULE, ptx::PROBE)?;
    let mut bld = func.builder();
    bld.arg(&mut out);
    // SAFETY: matches probe_ldsm in kernels/probe.cu (out [4][32][4] u32).
    unsafe { bld.launch(cfg) }.w()?;
    let dump = dev.clone_dtoh(&out)?;
    Ok((0..LDSM_VARIANTS.len()).map(|v| diagnose(&probe_map::ldsm_check(&dump, v))).collect())
}

/// `probe_cp_async`: grid 1, block 64, 2048 bytes of dynamic shared memory (128 chunks of 16
/// bytes); dumps 128 chunks of 4 u32 and 64 wait_group flags.
fn cp_async(dev: &CudaDevice) -> Result<ProbeResult> {
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (64, 1, 1), shared_mem_bytes: 128 * 16 };
    let host = probe_map::cp_async_src();
    let mut src = dev.alloc_zeros::<u32>(host.len())?;
    dev.memcpy_htod(&host, &mut src)?;
    let mut out = dev.alloc_zeros::<u32>(128 * 4)?;
    let mut early = dev.alloc_zeros::<u32>(64)?;
    let func = dev.get_or_load_custom_func("probe_cp_async", ptx::PROBE_MODULE, ptx::PROBE)?;
    let mut bld = func.builder();
    bld.arg(&src).arg(&mut out).arg(&mut early);
    // SAFETY: matches probe_cp_async in kernels/probe.cu (src 512 u32, out 512 u32, early 64 u32).
    unsafe { bld.launch(cfg) }.w()?;
    let (chunks, flags) = (dev.clone_dtoh(&out)?, dev.clone_dtoh(&early)?);
    Ok(diagnose_all("cp.async", &probe_map::cp_async_checks(&chunks, &flags)))
}

/// `probe_tma`: grid 1, block 128, `PROBE_TMA_SMEM` bytes of dynamic shared memory; loads one box
/// of a map of [`probe_map::tma_src`] (made as the flash kernels' maps are) at
/// [`probe_map::TMA_COORDS`] and dumps the buffer (4096 words) and 128 phase flags. Compute
/// capability 9.x only.
fn tma(dev: &CudaDevice) -> Result<ProbeResult> {
    const SMEM: u32 = 64 * 2 * 128 + 1024 + 8;
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: SMEM };
    let host = probe_map::tma_src();
    let mut src = dev.alloc_zeros::<u16>(host.len())?;
    dev.memcpy_htod(&host, &mut src)?;
    let map: TmaMap = map_bthd(dev, &src, true, probe_map::TMA_DIMS, probe_map::TMA_BOX.0 as u32, "probe_tma source")?;
    let c = probe_map::TMA_COORDS;
    let (c0, c1, c2, c3): (i32, i32, i32, i32) = (c[0], c[1], c[2], c[3]);
    let mut out = dev.alloc_zeros::<u32>(4096)?;
    let mut done = dev.alloc_zeros::<u32>(128)?;
    let func = dev.get_or_load_custom_func("probe_tma", ptx::PROBE_SM90_MODULE, ptx::PROBE_SM90)?;
    let mut bld = func.builder();
    bld.arg(&mut out).arg(&mut done).arg(&c0).arg(&c1).arg(&c2).arg(&c3).arg(&map);
    // SAFETY: matches probe_tma in kernels/probe_sm90.cu (out 4096 u32, done 128 u32, the load's
    // coordinates, the map of `src`, which outlives the launch).
    unsafe { bld.launch(cfg) }.w()?;
    let (words, flags) = (dev.clone_dtoh(&out)?, dev.clone_dtoh(&done)?);
    Ok(diagnose_all("tma", &probe_map::tma_check(&words, &flags)))
}

/// `probe_tma_red`: grid 1, block 128, `PROBE_TMA_RED_SMEM` bytes of dynamic shared memory; adds two
/// swizzled f32 boxes into a dq tensor ([`probe_map::tma_red_init`]) through a map made by
/// [`map_f32_bthd`] (the `wgmma-tma` backward's dq map) at [`probe_map::TMA_RED_COORDS`] and d + 32,
/// then reads the tensor back. Compute capability 9.x only.
fn tma_red(dev: &CudaDevice) -> Result<ProbeResult> {
    const SMEM: u32 = 2 * 64 * 32 * 4 + 1024;
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: SMEM };
    let host = probe_map::tma_red_init();
    let mut dq = dev.alloc_zeros::<f32>(host.len())?;
    dev.memcpy_htod(&host, &mut dq)?;
    let map: TmaMap = map_f32_bthd(dev, &dq, probe_map::TMA_RED_DIMS, 64, "probe_tma_red dq")?;
    let c = probe_map::TMA_RED_COORDS;
    let (c0, c1, c2, c3): (i32, i32, i32, i32) = (c[0], c[1], c[2], c[3]);
    let func = dev.get_or_load_custom_func("probe_tma_red", ptx::PROBE_SM90_MODULE, ptx::PROBE_SM90)?;
    let mut bld = func.builder();
    bld.arg(&c0).arg(&c1).arg(&c2).arg(&c3).arg(&map);
    // SAFETY: matches probe_tma_red in kernels/probe_sm90.cu (the first reduction's coordinates, the
    // map of `dq`, which outlives the launch and is read back after it on the same stream).
    unsafe { bld.launch(cfg) }.w()?;
    let after = dev.clone_dtoh(&dq)?;
    Ok(diagnose_all("tma reduce", &probe_map::tma_red_check(&after)))
}

/// `probe_stsm_ds`: grid 1, block 256, `PROBE_STSM_SMEM` bytes of dynamic shared memory; both
/// warpgroups store coded dS^T fragments ([`probe_map::stsm_frag`]) with `bwd_sm90_ds_store` and the
/// raw tile ([`probe_map::STSM_TILE_BYTES`]) is dumped. Compute capability 9.x only (stmatrix).
fn stsm_ds(dev: &CudaDevice) -> Result<ProbeResult> {
    const SMEM: u32 = (probe_map::STSM_TILE_BYTES + 1024) as u32;
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: SMEM };
    let mut out = dev.alloc_zeros::<u32>(probe_map::STSM_TILE_BYTES / 4)?;
    let func = dev.get_or_load_custom_func("probe_stsm_ds", ptx::PROBE_SM90_MODULE, ptx::PROBE_SM90)?;
    let mut bld = func.builder();
    bld.arg(&mut out);
    // SAFETY: matches probe_stsm_ds in kernels/probe_sm90.cu (out 4096 u32).
    unsafe { bld.launch(cfg) }.w()?;
    let words = dev.clone_dtoh(&out)?;
    Ok(diagnose_all("stmatrix dS", &probe_map::stsm_check(&words)))
}

/// Dynamic shared memory of the wgmma probes (`PROBE_WG_SMEM(N)`): A [128 x 128] and B [128 x N]
/// 16-bit tiles plus 1024 bytes of alignment (66,560 bytes at N = 128).
fn wg_smem(n: usize) -> u32 {
    ((WG_M + n) * WG_K * 2 + 1024) as u32
}

/// `probe_wgmma_{ss,rs,sstb}_n{n}_{bf16,f16}`: grid WG_PASSES, block 256; dump
/// `[pass][kk][thread][n / 2]` f32. Compute capability 9.x only (PTX for sm_90a).
fn wgmma(dev: &CudaDevice, form: WgForm, n: usize, dtype: DType, name: &str) -> Result<ProbeResult> {
    let smem = wg_smem(n);
    let cfg = LaunchConfig { grid_dim: (WG_PASSES as u32, 1, 1), block_dim: (WG_THREADS as u32, 1, 1), shared_mem_bytes: smem };
    let (ah, bh) = probe_map::wg_inputs(form, n);
    let mut out = dev.alloc_zeros::<f32>(WG_PASSES * (WG_K / 16) * WG_THREADS * n / 2)?;
    // A and B as 16-bit operands (ss, sstb), or B only (rs: A goes in as f32 and is packed in registers)
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let ac: Vec<$ty> = ah.iter().map(|&x| <$ty>::from_f32(x)).collect();
            let bc: Vec<$ty> = bh.iter().map(|&x| <$ty>::from_f32(x)).collect();
            let mut a = dev.alloc_zeros::<$ty>(ac.len())?;
            dev.memcpy_htod(&ac, &mut a)?;
            let mut b = dev.alloc_zeros::<$ty>(bc.len())?;
            dev.memcpy_htod(&bc, &mut b)?;
            let func = dev.get_or_load_custom_func($name, ptx::PROBE_SM90_MODULE, ptx::PROBE_SM90)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
            let mut bld = func.builder();
            bld.arg(&a).arg(&b).arg(&mut out);
            // SAFETY: matches probe_wgmma_{ss,sstb}_* in kernels/probe_sm90.cu (a [4][128][128],
            // b [4][n][128] or [4][128][n], out [4][8][256][n / 2]).
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match (form, n, dtype) {
        (WgForm::Ss, 64, DType::BF16) => go!(bf16, "probe_wgmma_ss_n64_bf16"),
        (WgForm::Ss, 128, DType::BF16) => go!(bf16, "probe_wgmma_ss_n128_bf16"),
        (WgForm::Ss, 64, DType::F16) => go!(f16, "probe_wgmma_ss_n64_f16"),
        (WgForm::Ss, 128, DType::F16) => go!(f16, "probe_wgmma_ss_n128_f16"),
        (WgForm::SsTb, 64, DType::BF16) => go!(bf16, "probe_wgmma_sstb_n64_bf16"),
        (WgForm::SsTb, 64, DType::F16) => go!(f16, "probe_wgmma_sstb_n64_f16"),
        (WgForm::Rs, _, _) => out = wgmma_rs(dev, n, dtype, &ah, &bh, cfg)?,
        _ => candle_core::bail!("probe wgmma: no kernel for form {form:?}, n {n}, dtype {dtype:?}"),
    }
    let dump = dev.clone_dtoh(&out)?;
    Ok(diagnose(&probe_map::wg_check(name, n, &dump)))
}

/// The `rs` launches of [`wgmma`]: A as f32 (`ah`), B (`bh`) converted to `dtype`; returns the dump.
fn wgmma_rs(dev: &CudaDevice, n: usize, dtype: DType, ah: &[f32], bh: &[f32], cfg: LaunchConfig) -> Result<CudaSlice<f32>> {
    let mut a32 = dev.alloc_zeros::<f32>(ah.len())?;
    dev.memcpy_htod(ah, &mut a32)?;
    let mut out = dev.alloc_zeros::<f32>(WG_PASSES * (WG_K / 16) * WG_THREADS * n / 2)?;
    macro_rules! go {
        ($ty:ty, $name:literal) => {{
            let bc: Vec<$ty> = bh.iter().map(|&x| <$ty>::from_f32(x)).collect();
            let mut b = dev.alloc_zeros::<$ty>(bc.len())?;
            dev.memcpy_htod(&bc, &mut b)?;
            let func = dev.get_or_load_custom_func($name, ptx::PROBE_SM90_MODULE, ptx::PROBE_SM90)?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, cfg.shared_mem_bytes as i32).w()?;
            let mut bld = func.builder();
            bld.arg(&a32).arg(&b).arg(&mut out);
            // SAFETY: matches probe_wgmma_rs_* in kernels/probe_sm90.cu (a [4][128][128] f32,
            // b [4][128][n], out [4][8][256][n / 2]).
            unsafe { bld.launch(cfg) }.w()?;
        }};
    }
    match (n, dtype) {
        (64, DType::BF16) => go!(bf16, "probe_wgmma_rs_n64_bf16"),
        (128, DType::BF16) => go!(bf16, "probe_wgmma_rs_n128_bf16"),
        (64, DType::F16) => go!(f16, "probe_wgmma_rs_n64_f16"),
        (128, DType::F16) => go!(f16, "probe_wgmma_rs_n128_f16"),
        _ => candle_core::bail!("probe wgmma rs: no kernel for n {n}, dtype {dtype:?}"),
    }
    Ok(out)
}
