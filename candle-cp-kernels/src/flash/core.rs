//! The CUDA-core kernels' launch numbers (`kernels/flash_fwd.cu` `fwd_simple`,
//! `kernels/flash_bwd.cu` `bwd_dkdv` / `bwd_dq`, their `_band_` entries) and the head dims only
//! some families take ([`PARTIAL_HEAD_DIMS`]: 96 and 256).
//!
//! Head dim 96 (Phi-3-mini, Phi-3.5-mini) and 256 (Gemma 3 1B / 4B / 12B, Gemma 2) run on two
//! families, and 96 on the mma kernels too:
//! - the CUDA-core kernels ([`FwdImpl::Simple`]; f32, and f16/bf16 where the device lacks the
//!   tensor-core kernels' shared memory): at d = 96 their tiles fit in a block's static shared
//!   memory (33,024 bytes at most); at d = 256 (f32 K and V of 32 keys, the block's query rows)
//!   they need about 82 KB per block, more than a block may declare statically, so they take it
//!   as dynamic shared memory (`cp_core_smem` in `kernels/common.cuh`) and the launcher passes
//!   the size below;
//! - the pipelined tensor-core kernels ([`FwdImpl::Pipelined`], and `Auto` for f16/bf16): at
//!   d = 96 d = 64's forward tiles (128 rows over 64-key tiles, 80,384 bytes; 12 chunks of 16
//!   bytes a row, so 8 of the 128 threads copy nothing) and d = 128's backward ones (107,520 and
//!   106,496 bytes: sm_80 and Hopper); at d = 256 the forward with 64-row blocks over 32-key
//!   tiles (101,376 bytes: every GPU from sm_80 on), the backward with dK/dV blocks that each
//!   keep 128 of the 256 columns (203,264 bytes) and 128-row dQ blocks (202,752): Hopper only
//!   (232,448 bytes per block);
//! - at d = 96 the mma kernels ([`FwdImpl::Mma`]; static shared memory): `Auto`'s backward where
//!   the pipelined one does not fit (sm_86 / sm_89 / sm_120), as up to 128. At d = 256 `Auto`
//!   runs the CUDA-core backward there.
//!
//! The fused and Hopper families have no kernels at these head dims, nor the mma ones at 256;
//! `FwdImpl::for_head_dim` maps them to `Auto` there, and the raw kernel functions refuse them by
//! name.

use super::FwdImpl;
use crate::util;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::CudaFunction;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result, Shape};

/// Head dims every kernel family takes.
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Head dims only some families take: 96 (Phi-3-mini and Phi-3.5-mini: the CUDA-core
/// [`FwdImpl::Simple`], pipelined [`FwdImpl::Pipelined`] and [`FwdImpl::Mma`] kernels) and 256
/// (Gemma 2 and Gemma 3: the CUDA-core and pipelined kernels); `Auto` runs one of those.
pub const PARTIAL_HEAD_DIMS: [usize; 2] = [96, 256];

/// Whether some kernel family takes head dim `d` ([`HEAD_DIMS`] or [`PARTIAL_HEAD_DIMS`]).
pub fn head_dim_supported(d: usize) -> bool {
    HEAD_DIMS.contains(&d) || PARTIAL_HEAD_DIMS.contains(&d)
}

/// Whether family `imp` has kernels at head dim `d`: every family at [`HEAD_DIMS`]; at
/// [`PARTIAL_HEAD_DIMS`] `Auto`, `Simple`, `Pipelined`, and `Mma` at 96.
pub fn family_takes(imp: FwdImpl, d: usize) -> bool {
    use FwdImpl::{Auto, Mma, Pipelined, Simple};
    match d {
        _ if HEAD_DIMS.contains(&d) => true,
        96 => matches!(imp, Auto | Simple | Pipelined | Mma),
        256 => matches!(imp, Auto | Simple | Pipelined),
        _ => false,
    }
}

/// One of the CUDA-core kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Core {
    /// `flash_fwd_simple{,_band}_*`: K `[32][d+1]`, V `[32][d]`, Q `[16][d]` floats.
    Fwd,
    /// `flash_bwd_dkdv{,_band}_*`: K, V `[32][d+1]`, Q, dO `[8][d]`, P, dS `[8][32]` floats.
    Dkdv,
    /// `flash_bwd_dq{,_band}_*`: K, V `[32][d+1]`, Q, dO `[8][d]` floats.
    Dq,
}

/// The largest shared memory a block may declare statically (`CP_CORE_STATIC_SMEM`).
const STATIC_SMEM: usize = 48 * 1024;

/// Shared memory of a CUDA-core kernel at head dim `d`, in bytes (`cp_core_smem<N>` with the N
/// of each kernel: `80·d + 32`, `80·d + 576`, `80·d + 64` floats).
pub(super) fn smem_bytes(k: Core, d: usize) -> usize {
    let floats = match k {
        Core::Fwd => 80 * d + 32,
        Core::Dkdv => 80 * d + 576,
        Core::Dq => 80 * d + 64,
    };
    floats * 4
}

/// The dynamic shared memory a launch of `k` at head dim `d` passes: 0 while the kernel's arrays
/// are static (up to 48 KiB: d ≤ 128), else all of [`smem_bytes`] (d = 256: 82,048 / 84,224 /
/// 82,176 bytes).
pub(super) fn core_smem(k: Core, d: usize) -> u32 {
    let b = smem_bytes(k, d);
    if b <= STATIC_SMEM {
        0
    } else {
        b as u32
    }
}

/// Opts `func` into `smem` bytes of dynamic shared memory when that is above 48 KiB (the
/// driver's default limit per kernel); nothing otherwise.
pub(super) fn opt_in(func: &CudaFunction, smem: u32) -> Result<()> {
    if smem as usize > STATIC_SMEM {
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    }
    Ok(())
}

/// The family a call at head dim `d` runs: `imp` for [`HEAD_DIMS`]; at a [`PARTIAL_HEAD_DIMS`] head
/// dim `imp` for a family that takes it ([`family_takes`]: `Auto`, `Simple`, `Pipelined`, and
/// `Mma` at 96), after checking that the device gives a block the CUDA-core kernels' shared
/// memory (at 256 the launchers fall back to them where they would run the mma kernels, which
/// have none there: `Auto` where the pipelined kernels do not fit, a forward with scale <= 0);
/// an error naming the head dim for an explicit other family.
pub(super) fn family_for(dev: &CudaDevice, imp: FwdImpl, d: usize, op: &str, q: &Shape) -> Result<FwdImpl> {
    if !PARTIAL_HEAD_DIMS.contains(&d) {
        return Ok(imp);
    }
    if !family_takes(imp, d) {
        let fams = if family_takes(FwdImpl::Mma, d) {
            "the CUDA-core, mma and pipelined kernels only (FwdImpl::Simple, Mma, Pipelined or Auto)"
        } else {
            "the CUDA-core and pipelined kernels only (FwdImpl::Simple, Pipelined or Auto)"
        };
        candle_core::bail!("{op}: head dim {d} runs on {fams}, not {imp:?}; q {q:?}")
    }
    let need = [Core::Fwd, Core::Dkdv, Core::Dq].into_iter().map(|k| smem_bytes(k, d)).max().unwrap_or(0);
    let optin = util::smem_optin(dev)?;
    if need as i64 > optin {
        candle_core::bail!("{op}: head dim {d} needs {need} bytes of shared memory per block, the device allows {optin}; q {q:?}")
    }
    Ok(imp)
}


#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes the kernels' `cp_core_smem<N>` take: static (0 dynamic) up to d = 128 (96
    /// included), the whole buffer at d = 256.
    #[test]
    fn core_smem_static_up_to_128() {
        for d in HEAD_DIMS {
            for k in [Core::Fwd, Core::Dkdv, Core::Dq] {
                assert_eq!(core_smem(k, d), 0, "{k:?} d{d}: {} bytes", smem_bytes(k, d));
            }
        }
        assert_eq!(smem_bytes(Core::Dkdv, 128), 43_264);
        assert_eq!(core_smem(Core::Fwd, 256), 82_048);
        assert_eq!(core_smem(Core::Dkdv, 256), 84_224);
        assert_eq!(core_smem(Core::Dq, 256), 82_176);
        for k in [Core::Fwd, Core::Dkdv, Core::Dq] {
            assert_eq!(core_smem(k, 96), 0, "{k:?} d96: {} bytes", smem_bytes(k, 96));
        }
        assert_eq!(smem_bytes(Core::Dkdv, 96), 33_024);
        assert!(head_dim_supported(256) && head_dim_supported(96) && !head_dim_supported(80) && !head_dim_supported(512));
        for d in PARTIAL_HEAD_DIMS {
            assert!(family_takes(FwdImpl::Pipelined, d) && family_takes(FwdImpl::Auto, d) && family_takes(FwdImpl::Simple, d));
            assert!(!family_takes(FwdImpl::WgmmaTma, d) && !family_takes(FwdImpl::AtomicDq, d));
        }
        assert!(family_takes(FwdImpl::Mma, 96) && !family_takes(FwdImpl::Mma, 256));
        assert!(family_takes(FwdImpl::WgmmaTma, 128) && !family_takes(FwdImpl::Simple, 80));
    }
}
