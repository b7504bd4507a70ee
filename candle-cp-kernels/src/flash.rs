//! Flash-attention forward (with LSE) and backward on CUDA. CPU reference:
//! `candle_cp_ops::attention::{attention_fwd, attention_bwd}`.
//!
//! Shapes: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]` (f32, f16 or bf16, same dtype), out f32
//! `[B, T, H, D]`, lse f32 `[B, H, T]` (natural log). `T`, `S` are local lengths; the mask
//! carries global positions. Head dims 16, 32, 64 and 128 on every family, 96 (Phi-3-mini) on the
//! CUDA-core, mma and pipelined kernels, 256 (Gemma) on the CUDA-core and pipelined ones (module
//! `core`). Query head `h` reads KV head `h / (H/Hkv)`.
//! Band masks (one key interval per query row): [`fwd_band`], [`bwd_band`] (module `band`).

use crate::{ptx, util};
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

mod band;
mod bwd;
mod bwd_fused;
mod bwd_pipe;
mod bwd_prep;
mod bwd_sm90;
mod bwd_sm90_ws;
mod core;
mod dst;
mod fold;
mod sm90;
mod sm90_ws;
pub(crate) mod tma;

pub use band::{bwd_band, bwd_band_prepared, bwd_band_prepared_add_dq, fwd_band, fwd_band_packed, fwd_storage_band, KBand};
pub use bwd::{bwd, bwd_prepared, bwd_prepared_add_dq, bwd_with, DqOut};
use bwd::{add_dq, bwd_out, check_bwd_rows, check_prepared, dq_fresh, dq_view, fresh_dq, zero_bwd, BwdOut};
pub use bwd_prep::{bwd_prep, BwdPrep};
use dst::{FoldAt, FwdDst};
pub use fold::{fwd_band_fold, fwd_fold};
use bwd_prep::BwdInputs;
pub use core::{family_takes, head_dim_supported, HEAD_DIMS, PARTIAL_HEAD_DIMS};

/// The logits the kernels compute: `scale · q·k`, soft-capped to `cap · tanh(x / cap)` when
/// `cap > 0` (Gemma 2's `attn_logit_softcapping`; CPU reference `candle_cp_ops::attention::Scores`).
/// Every launcher takes `impl Into<Logits>`: a plain `f32` scale is uncapped.
///
/// The CUDA-core kernels (`Simple`, forward and backward, band entries too) and the pipelined
/// ones (their capped entries `flash_fwd_pipe_cap_*`, `flash_bwd_pipe_cap_*`) apply a cap. With
/// one, a call asked of another family (mma, fused, Hopper) runs `Auto`'s choice (pipelined for
/// f16/bf16 where it fits, else CUDA cores; never mma).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Logits {
    /// Softmax scale.
    pub scale: f32,
    /// Soft cap (`0`: none).
    pub cap: f32,
}

impl From<f32> for Logits {
    fn from(scale: f32) -> Self {
        Self { scale, cap: 0.0 }
    }
}

impl Logits {
    /// `scale` with logits capped to `(-cap, cap)` (`cap = 0`: none).
    pub fn capped(scale: f32, cap: f32) -> Self {
        Self { scale, cap }
    }

    /// Errors for a cap that is negative or not finite, naming `op` and q's shape.
    fn check(&self, op: &str, q: &Shape) -> Result<()> {
        if !(self.cap.is_finite() && self.cap >= 0.0) {
            candle_core::bail!("{op}: a logit soft cap must be finite and > 0 (0: none), got {}; q {q:?}", self.cap)
        }
        Ok(())
    }

    /// The family a forward runs: `imp`, or with a cap `Auto` for a family without one (mma,
    /// fused, Hopper).
    fn fwd_family(&self, imp: FwdImpl) -> FwdImpl {
        match imp {
            _ if self.cap == 0.0 => imp,
            FwdImpl::Simple | FwdImpl::Pipelined | FwdImpl::Auto => imp,
            _ => FwdImpl::Auto,
        }
    }

    /// The family a backward runs: as [`Logits::fwd_family`] (the pipelined backward has capped
    /// entries too).
    fn bwd_family(&self, imp: FwdImpl) -> FwdImpl {
        self.fwd_family(imp)
    }
}

/// Kernel-side mirror of `candle_cp_ops::attention::Mask`: query row `i` is at global position
/// `q_offset + i * q_stride`, key row `j` at `k_offset + j * k_stride`; when `causal`, a key is
/// visible iff its position is `<=` the query's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KMask {
    /// Causal (true) or full (false).
    pub causal: bool,
    /// Global position of local query row 0.
    pub q_offset: usize,
    /// Distance between consecutive local query rows (>= 1).
    pub q_stride: usize,
    /// Global position of local key row 0.
    pub k_offset: usize,
    /// Distance between consecutive local key rows (>= 1).
    pub k_stride: usize,
}

impl KMask {
    /// Every query sees every key.
    pub fn full() -> Self {
        Self { causal: false, q_offset: 0, q_stride: 1, k_offset: 0, k_stride: 1 }
    }
    /// Causal mask with the given global offsets and strides.
    pub fn causal(q_offset: usize, q_stride: usize, k_offset: usize, k_stride: usize) -> Self {
        Self { causal: true, q_offset, q_stride, k_offset, k_stride }
    }
    fn args(&self) -> Result<(i32, i64, i64, i64, i64)> {
        if self.q_stride == 0 || self.k_stride == 0 {
            candle_core::bail!("flash attention: mask strides must be >= 1, got {self:?}")
        }
        Ok((
            self.causal as i32,
            util::to_i64(self.q_offset, "q_offset")?,
            util::to_i64(self.q_stride, "q_stride")?,
            util::to_i64(self.k_offset, "k_offset")?,
            util::to_i64(self.k_stride, "k_stride")?,
        ))
    }
}

/// Which kernels to run (forward and backward alike). Under a band ([`fwd_band`], [`bwd_band`])
/// `Simple`, `Pipelined` and the Hopper families `Wgmma`, `WgmmaAtomic`, `WgmmaWs`, `WgmmaTma` (and
/// `WgmmaTmaWide`, which runs `WgmmaTma`'s band kernels; f16/bf16, head dims 64/128, compute
/// capability 9.x) have kernels: `Simple` runs the CUDA-core band kernels,
/// every other choice (`Mma`, `AtomicDq`, a Hopper family where it does not apply) runs `Auto`'s
/// family (pipelined for f16/bf16, CUDA cores for f32 or where the pipelined kernels do not fit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FwdImpl {
    /// Tensor cores for f16/bf16 (the `Pipelined` kernels), CUDA cores for f32.
    Auto,
    /// CUDA-core kernels (f32 math) for every dtype.
    Simple,
    /// Tensor-core kernels (mma.sync m16n8k16, f32 accumulate); f16/bf16 only.
    Mma,
    /// Tensor-core kernels with `cp.async` double-buffered K/V tiles and `ldmatrix` fragment
    /// loads (FlashAttention-2 pipeline); f16/bf16 only. Forward: `flash_fwd_pipe_*`, 128 query
    /// rows per block (64 at head dim 256), tile j+1 of K and V copied while tile j is used; a
    /// scale <= 0 runs the `Mma` forward instead (the `Simple` one at head dim 256).
    Pipelined,
    /// EXPERIMENTAL, Hopper only, opt-in (`CANDLE_CP_FLASH_IMPL=wgmma`; `Auto` never picks it):
    /// warpgroup MMA (`wgmma.mma_async`, PTX for sm_90a), f16/bf16 and head dims 64/128 only;
    /// an error on other devices, dtypes or head dims. Forward: `kernels/flash_fwd_sm90.cu`.
    /// Backward (deterministic, no atomics): the `Pipelined` prep kernel (delta, 16-bit dO), then
    /// the wgmma dK/dV kernel (128 keys per block, dK/dV accumulators in registers) and the wgmma
    /// dQ kernel (128 query rows per block) of `kernels/flash_bwd_sm90.cu`. Checked under the CPU
    /// emulator only so far.
    Wgmma,
    /// Opt-in (`CANDLE_CP_FLASH_IMPL=atomic`; `Auto` never picks it); f16/bf16 only. Forward: the
    /// `Pipelined` kernel. Backward: one fused kernel per 128-key tile (`kernels/flash_bwd_fused.cu`,
    /// FlashAttention-2 style: 5 matrix products instead of the pipelined kernels' 7) that computes
    /// dK and dV and adds dQ into a zero-filled f32 buffer with atomics (`red.global.add.f32`):
    /// the f32 summation order of dQ is NONDETERMINISTIC (run-to-run differences in the last
    /// bits); dK and dV stay deterministic.
    AtomicDq,
    /// EXPERIMENTAL, Hopper only, opt-in (`CANDLE_CP_FLASH_IMPL=wgmma-atomic`; `Auto` never picks
    /// it); f16/bf16, head dims 64/128, an error elsewhere. Forward: the `Wgmma` kernel. Backward:
    /// the `Pipelined` prep kernel, then one wgmma kernel (`flash_bwd_wgmma_atomic_*` in
    /// `kernels/flash_bwd_sm90.cu`) computing dK, dV and dQ (dQ = dS K on wgmma, 5 products per
    /// (query, key) pair instead of 7), dQ added into a zero-filled f32 buffer with
    /// `red.global.add.f32`: the summation order of dQ is NONDETERMINISTIC; dK and dV stay
    /// deterministic. Checked under the CPU emulator only so far.
    WgmmaAtomic,
    /// EXPERIMENTAL, Hopper only, opt-in (`CANDLE_CP_FLASH_IMPL=wgmma-ws`; `Auto` never picks it);
    /// f16/bf16, head dims 64/128, an error elsewhere. Forward: `kernels/flash_fwd_sm90_ws.cu`,
    /// warp-specialized FlashAttention-3 structure (384 threads: a producer warpgroup copies Q and
    /// the K/V tiles with cp.async into an mbarrier ring of 3 (d 128) / 4 (d 64) stages; two consumer warpgroups of 64
    /// query rows run wgmma, taking turns on the tensor cores through named barriers (ping-pong)
    /// with the softmax of one overlapping the products of the other). Same results as `Wgmma`'s
    /// forward. Backward: warp-specialized atomic-dQ backward: the `Pipelined` prep kernel, then
    /// `flash_bwd_wgmma_ws_*` (`kernels/flash_bwd_sm90_ws.cu`; a producer warpgroup copies Q / dO
    /// tiles into an mbarrier ring, two consumer warpgroups compute dK, dV and dQ = dS K on wgmma),
    /// dQ added into a zero-filled f32 buffer with `red.global.add.v4.f32`: the summation order of dQ
    /// is NONDETERMINISTIC (as `WgmmaAtomic`, whose results it shares); dK and dV stay
    /// deterministic. Checked under the CPU emulator only so far.
    WgmmaWs,
    /// EXPERIMENTAL, Hopper only, opt-in (`CANDLE_CP_FLASH_IMPL=wgmma-tma`; `Auto` never picks it);
    /// f16/bf16, head dims 64/128, an error elsewhere. Forward: `WgmmaWs`'s kernel with its copies
    /// made by the tensor memory accelerator (`flash_fwd_wgmma_tma_*` in
    /// `kernels/flash_fwd_sm90_ws.cu`: one producer thread issues a `cp.async.bulk.tensor` load per
    /// 64-column block of a tile through tensor maps of q, k, v, completed on the stage's mbarrier
    /// by its byte count; FlashAttention-3's loads). Backward: `WgmmaWs`'s kernel with TMA loads of
    /// K, V and each query tile's Q and dO, and dQ added from a shared-memory buffer by one TMA
    /// reduction per tile instead of per-thread `red.global` (`flash_bwd_wgmma_tma_*` in
    /// `kernels/flash_bwd_sm90_ws.cu`). Same results as `WgmmaWs` (dQ's summation order
    /// nondeterministic). Checked under the CPU emulator only so far.
    WgmmaTma,
    /// EXPERIMENTAL, Hopper only, opt-in (`CANDLE_CP_FLASH_IMPL=wgmma-tma-wide`; `Auto` never picks
    /// it): `WgmmaTma` with wider key tiles in the forward for full and causal masks at head dim
    /// 128: `flash_fwd_wgmma_tma_wide_*_d128` takes 176 keys per tile (FlashAttention-3's tile for
    /// d = 128 without a causal mask) in a ring of 2 stages instead of 128 keys in 3. Band masks,
    /// head dim 64 and the backward are `WgmmaTma`'s. Same results as `WgmmaTma`. For the GPU
    /// benchmark to say which tile pays; checked under the CPU emulator only so far.
    WgmmaTmaWide,
}

impl FwdImpl {
    /// `CANDLE_CP_FLASH_IMPL` = `simple` | `mma` | `pipelined` | `wgmma` | `atomic` |
    /// `wgmma-atomic` | `wgmma-ws` | `wgmma-tma` | `wgmma-tma-wide` | unset or empty (`Auto`).
    /// Any other value also runs `Auto`, and the first such call says so on stderr (a misspelt
    /// family must not pass for a measurement of it).
    pub fn from_env() -> Self {
        let v = std::env::var("CANDLE_CP_FLASH_IMPL").unwrap_or_default();
        if v.trim().is_empty() {
            return FwdImpl::Auto;
        }
        Self::from_name(&v).unwrap_or_else(|| {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "candle-cp: CANDLE_CP_FLASH_IMPL={v:?} is not a kernel family (auto, simple, mma, pipelined, wgmma, \
                     atomic, wgmma-atomic, wgmma-ws, wgmma-tma, wgmma-tma-wide); running auto"
                )
            });
            FwdImpl::Auto
        })
    }

    /// The family a whole-model setting (`CANDLE_CP_FLASH_IMPL`, through the attention ops)
    /// runs at head dim `d`: itself where it has kernels at `d` ([`family_takes`]), else `Auto`
    /// (at [`PARTIAL_HEAD_DIMS`], 96 and 256, the fused and Hopper families, and the mma one at
    /// 256, run `Auto`: the pipelined kernels for f16/bf16 where the device has their shared
    /// memory, else the mma ones at 96 and the CUDA-core ones at 256). The raw kernel functions do
    /// not do this: there such a family at 96 or 256 is an error.
    pub fn for_head_dim(self, d: usize) -> Self {
        if family_takes(self, d) || !head_dim_supported(d) {
            self
        } else {
            FwdImpl::Auto
        }
    }

    /// The family named `auto`, `simple`, `mma`, `pipelined`, `wgmma`, `atomic`, `wgmma-atomic`,
    /// `wgmma-ws`, `wgmma-tma` or `wgmma-tma-wide` (the names `CANDLE_CP_FLASH_IMPL` and the GPU examples' `--impl`/`--impls` take); `None`
    /// otherwise.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name.trim() {
            "auto" => FwdImpl::Auto,
            "simple" => FwdImpl::Simple,
            "mma" => FwdImpl::Mma,
            "pipelined" => FwdImpl::Pipelined,
            "wgmma" => FwdImpl::Wgmma,
            "atomic" => FwdImpl::AtomicDq,
            "wgmma-atomic" => FwdImpl::WgmmaAtomic,
            "wgmma-ws" => FwdImpl::WgmmaWs,
            "wgmma-tma" => FwdImpl::WgmmaTma,
            "wgmma-tma-wide" => FwdImpl::WgmmaTmaWide,
            _ => return None,
        })
    }

    /// Whether the family loads its tiles with TMA (`WgmmaTma`, `WgmmaTmaWide`: the same backward).
    pub(crate) fn tma(self) -> bool {
        matches!(self, FwdImpl::WgmmaTma | FwdImpl::WgmmaTmaWide)
    }
}

/// Sizes of one call: (b, t, s, h, hkv, d), checked.
type Dims = (usize, usize, usize, usize, usize, usize);

fn check_dims(op: &str, q: &Shape, k: &Shape, v: &Shape) -> Result<Dims> {
    let (b, t, h, d) = q.dims4()?;
    let (kb, s, hkv, kd) = k.dims4()?;
    if k != v || kb != b || kd != d || hkv == 0 || h % hkv != 0 {
        candle_core::bail!("{op}: expected q [B, T, H, D], k/v [B, S, Hkv, D] with H % Hkv == 0, got q {q:?}, k {k:?}, v {v:?}")
    }
    if !head_dim_supported(d) {
        candle_core::bail!("{op}: head dim {d} not supported by the CUDA kernels (16, 32, 64, 128; 96 on the CUDA-core, mma and pipelined kernels, 256 on the CUDA-core and pipelined ones); q {q:?}")
    }
    if h > 65_535 || b > 65_535 || hkv > 65_535 {
        candle_core::bail!("{op}: too many heads or batches for the launch grid; q {q:?}, k {k:?}")
    }
    // The kernels form 32-bit row and key indices up to one tile (<= 256 rows) past T and S
    // (`row0 + BQ`, `k0 + BK + row`, `key_end + BK - 1`): keep those below 2^31.
    const IDX_MAX: usize = i32::MAX as usize - 256;
    if t > IDX_MAX || s > IDX_MAX {
        candle_core::bail!("{op}: T = {t} or S = {s} exceeds the kernels' 32-bit row indices (max {IDX_MAX}); q {q:?}, k {k:?}")
    }
    Ok((b, t, s, h, hkv, d))
}

fn suffix(dt: DType) -> Result<&'static str> {
    Ok(match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        dt => candle_core::bail!("flash attention: dtype {dt:?} not supported (f32, f16, bf16)"),
    })
}

/// Forward on storages (for `CustomOp3::cuda_fwd`): returns out f32 `[B, T, H, D]` and lse f32
/// `[B, H, T]` as storages with their shapes.
#[allow(clippy::too_many_arguments)]
pub fn fwd_storage(
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
    mask: KMask,
    scale: impl Into<Logits>,
    imp: FwdImpl,
) -> Result<((CudaStorage, Shape), (CudaStorage, Shape))> {
    let scale: Logits = scale.into();
    use candle_core::backend::BackendStorage;
    let dims = check_dims("flash_fwd", ql.shape(), kl.shape(), vl.shape())?;
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!("flash_fwd: q, k, v dtypes differ ({:?}, {:?}, {:?}); q {:?}", q.dtype(), k.dtype(), v.dtype(), ql.shape())
    }
    let dev = q.device.clone();
    let (b, t, _, h, _, d) = dims;
    // SAFETY: the forward writes every element of both (FwdDst::empty where it has no rows).
    let (mut out, mut lse) = unsafe { (dev.alloc::<f32>(b * t * h * d)?, dev.alloc::<f32>(b * h * t)?) };
    fwd_storage_to((q, ql), (k, kl), (v, vl), dims, mask, scale, imp, FwdDst::plain(out.slice_mut(..), lse.slice_mut(..)))?;
    Ok((
        (CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from((b, t, h, d))),
        (CudaStorage::wrap_cuda_slice(lse, dev), Shape::from((b, h, t))),
    ))
}

/// The forward of [`fwd_storage`] into `dst` (checked dims).
#[allow(clippy::too_many_arguments)]
fn fwd_storage_to(
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    dims: Dims,
    mask: KMask,
    scale: Logits,
    imp: FwdImpl,
    dst: FwdDst<'_>,
) -> Result<()> {
    use candle_core::backend::BackendStorage;
    let sfx = suffix(q.dtype())?;
    let dev = q.device.clone();
    match q.dtype() {
        DType::F32 => fwd_t::<f32>(&dev, sfx, (q, ql), (k, kl), (v, vl), dims, mask, scale, imp, dst),
        DType::F16 => fwd_t::<f16>(&dev, sfx, (q, ql), (k, kl), (v, vl), dims, mask, scale, imp, dst),
        _ => fwd_t::<bf16>(&dev, sfx, (q, ql), (k, kl), (v, vl), dims, mask, scale, imp, dst),
    }
}

/// [`fwd`] into ONE f32 buffer `[B·T·H·D + B·H·T]`: out `[B, T, H, D]`, then lse `[B, H, T]` —
/// the layout of the ring's running state (`candle_cp_ops::cp::state::LocalState`), which takes
/// a first result covering all its rows as its state instead of merging it into an empty one.
pub fn fwd_packed(q: &Tensor, k: &Tensor, v: &Tensor, mask: KMask, scale: impl Into<Logits>, imp: FwdImpl) -> Result<Tensor> {
    let scale: Logits = scale.into();
    packed_fwd("flash_fwd", (q, k, v), |[qs, ks, vs], dims, dst| fwd_storage_to(qs, ks, vs, dims, mask, scale, imp, dst))
}

/// A forward into ONE f32 buffer `[B·T·H·D + B·H·T]`: q, k, v made launchable and checked, then
/// `write` fills out (the first part) and lse (the rest) through a [`FwdDst`] over the two
/// parts. [`fwd_packed`] and [`band::fwd_band_packed`].
pub(super) fn packed_fwd(
    op: &str,
    qkv: (&Tensor, &Tensor, &Tensor),
    write: impl FnOnce([(&CudaStorage, &Layout); 3], Dims, FwdDst<'_>) -> Result<()>,
) -> Result<Tensor> {
    let (dev, qkv, dims) = launchable(op, qkv)?;
    let (b, t, _, h, _, d) = dims;
    let n_out = b * t * h * d;
    // SAFETY: the forward writes every element (FwdDst::empty where it has no rows).
    let mut buf = unsafe { dev.alloc::<f32>(n_out + b * h * t)? };
    with_storages(&qkv, |st| {
        let (out, lse) = buf.split_at_mut(n_out);
        write(st, dims, FwdDst::plain(out, lse))
    })?;
    let n = buf.len();
    Ok(util::to_tensor(buf, &dev, n))
}

/// q, k, v as the kernels read them ([`prep`]: contiguous, 16-byte aligned) on a CUDA device,
/// checked against each other ([`check_dims`], one dtype): the device, the tensors, the dims.
/// [`packed_fwd`] and `fold::fold_into`.
pub(super) fn launchable(op: &str, (q, k, v): (&Tensor, &Tensor, &Tensor)) -> Result<(CudaDevice, [Tensor; 3], Dims)> {
    let dev = util::cuda_device(q, &format!("{op}: q"))?;
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let dims = check_dims(op, q.shape(), k.shape(), v.shape())?;
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!("{op}: q, k, v dtypes differ ({:?}, {:?}, {:?}); q {:?}", q.dtype(), k.dtype(), v.dtype(), q.shape())
    }
    Ok((dev, [q, k, v], dims))
}

/// `f` on the CUDA storages and layouts of q, k, v (held for its duration).
pub(super) fn with_storages<R>([q, k, v]: &[Tensor; 3], f: impl FnOnce([(&CudaStorage, &Layout); 3]) -> Result<R>) -> Result<R> {
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    f([(storage_of(&qs, "q", q.shape())?, ql), (storage_of(&ks, "k", k.shape())?, kl), (storage_of(&vs, "v", v.shape())?, vl)])
}

/// The forward kernel family a call runs (after resolving [`FwdImpl`] against the dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FwdKernel {
    Simple,
    Mma,
    Pipelined,
}

/// Tile of `flash_fwd_pipe_*_d{d}` (`PIPES` in kernels/flash_fwd.cu): (warps NW, 16-row tiles
/// per warp MT, keys per K/V tile BK): 4 x 2 x 64 up to d = 128 (96 included), 4 x 1 x 32 at d = 256.
fn pipe_tile(d: usize) -> (usize, usize, usize) {
    if d == 256 {
        (4, 1, 32)
    } else {
        (4, 2, 64)
    }
}

/// [`pipe_tile`] of the entries a call runs: with a soft cap (`capped`) the
/// `flash_fwd_pipe_cap{,_band}_*` ones (`PIPES_CAP` in `kernels/flash_fwd.cu`: d128 over 32-key
/// tiles, where 64 would spill).
fn pipe_tile_of(d: usize, capped: bool) -> (usize, usize, usize) {
    if capped && d == 128 {
        (4, 2, 32)
    } else {
        pipe_tile(d)
    }
}

/// Whether `flash_fwd_pipe{,_band}_*_d{d}` keeps its per-row key bounds in the Q rows' padding
/// (d = 256: `CpPadInts`, no shared memory of their own) rather than in BQ ints after the tiles
/// (BQ more for a band).
fn pipe_pads_bounds(d: usize) -> bool {
    d == 256
}

/// Launch shape of `flash_fwd_pipe_*_d{d}`: (query rows per block BQ = 16 NW MT, threads per block
/// 32 NW, dynamic shared memory bytes: Q plus two K and two V buffers, (BQ + 4 BK) rows of (d + 8)
/// 16-bit elements, plus BQ ints unless [`pipe_pads_bounds`]): 104,960 bytes at d = 128, 80,384
/// at d = 96, 55,808 at d = 64, 101,376 at d = 256 (sm_86 / sm_89 / sm_120's maximum per block).
fn pipe_config(d: usize) -> (usize, u32, u32) {
    let (nw, mt, bk) = pipe_tile(d);
    let bq = 16 * nw * mt;
    let ints = if pipe_pads_bounds(d) { 0 } else { bq * 4 };
    (bq, 32 * nw as u32, ((bq + 4 * bk) * (d + 8) * 2 + ints) as u32)
}

/// [`pipe_config`] of the entries a call runs ([`pipe_tile_of`]): the soft-capped d128 ones hold
/// 4 × 32 fewer K / V rows, 70,144 bytes.
fn pipe_config_of(d: usize, capped: bool) -> (usize, u32, u32) {
    let (rows, threads, smem) = pipe_config(d);
    let (bk, cbk) = (pipe_tile(d).2, pipe_tile_of(d, capped).2);
    (rows, threads, smem - (4 * (bk - cbk) * (d + 8) * 2) as u32)
}

#[allow(clippy::too_many_arguments)]
fn fwd_t<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    sfx: &str,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    (b, t, s, h, hkv, d): Dims,
    mask: KMask,
    logits: Logits,
    imp: FwdImpl,
    dst: FwdDst<'_>,
) -> Result<()> {
    logits.check("flash_fwd", ql.shape())?;
    let imp = core::family_for(dev, logits.fwd_family(imp), d, "flash_fwd", ql.shape())?;
    let (scale, cap): (f32, f32) = (logits.scale, logits.cap);
    let kern = match imp {
        FwdImpl::Wgmma | FwdImpl::WgmmaAtomic => return sm90::fwd_wgmma::<T>(dev, sfx, (q, ql), (k, kl), (v, vl), (b, t, s, h, hkv, d), mask, scale, dst),
        FwdImpl::WgmmaWs => return sm90_ws::fwd_wgmma_ws::<T>(dev, sfx, (q, ql), (k, kl), (v, vl), (b, t, s, h, hkv, d), mask, scale, dst),
        FwdImpl::WgmmaTma | FwdImpl::WgmmaTmaWide => {
            let wide = imp == FwdImpl::WgmmaTmaWide;
            return sm90_ws::fwd_wgmma_tma::<T>(dev, sfx, (q, ql), (k, kl), (v, vl), (b, t, s, h, hkv, d), sm90_ws::TmaMask::Mask(mask), scale, wide, dst);
        }
        FwdImpl::Auto | FwdImpl::Simple if sfx == "f32" => FwdKernel::Simple,
        FwdImpl::Simple => FwdKernel::Simple,
        FwdImpl::Mma | FwdImpl::Pipelined | FwdImpl::AtomicDq if sfx == "f32" => candle_core::bail!("flash_fwd: the tensor-core kernel takes f16/bf16, got f32; q {:?}", ql.shape()),
        FwdImpl::Mma => FwdKernel::Mma,
        FwdImpl::Auto | FwdImpl::Pipelined | FwdImpl::AtomicDq if scale > 0.0 => FwdKernel::Pipelined,
        // The pipelined kernel takes row maxima before scaling, which needs scale > 0.
        // (the CUDA-core kernels where the mma ones have no kernel: head dim 256)
        FwdImpl::Auto | FwdImpl::Pipelined | FwdImpl::AtomicDq if !family_takes(FwdImpl::Mma, d) => FwdKernel::Simple,
        FwdImpl::Auto | FwdImpl::Pipelined | FwdImpl::AtomicDq => FwdKernel::Mma,
    };
    // The pipelined kernel's shared memory (104,960 bytes at d = 128) exceeds what some GPUs
    // allow per block (e.g. sm_86/sm_89: 99 KiB): Auto falls back to the mma kernel there.
    let kern = if kern == FwdKernel::Pipelined {
        let optin = util::smem_optin(dev)?;
        let need = pipe_config_of(d, cap > 0.0).2;
        match (i64::from(need) <= optin, imp) {
            (true, _) => FwdKernel::Pipelined,
            (false, FwdImpl::Auto) if !family_takes(FwdImpl::Mma, d) => FwdKernel::Simple,
            (false, FwdImpl::Auto) => FwdKernel::Mma,
            (false, _) => candle_core::bail!(
                "flash_fwd: the pipelined kernel needs {need} bytes of shared memory per block, the device allows {optin}; q {:?}",
                ql.shape()
            ),
        }
    } else {
        kern
    };
    // (the mma kernels take no cap: a capped Auto falls back to the CUDA-core ones)
    let kern = if cap > 0.0 && kern == FwdKernel::Mma { FwdKernel::Simple } else { kern };
    if b * t * h == 0 {
        return dst.empty(dev);
    }
    let (causal, qo, qs, ko, ks) = mask.args()?;
    let (o_t, o_row0, o_merge): (i32, i32, i32) = dst.kernel_args(t)?;
    let inp = util::FwdQkv::<T>::new(dev, (q, ql), (k, kl), (v, vl), kern != FwdKernel::Simple)?;
    let (qv, kv, vv) = inp.qkv_views()?;
    // The kernel writes every element of out and lse (rows < T, all heads, all d).
    let (mut out, mut lse): (CudaViewMut<'_, f32>, CudaViewMut<'_, f32>) = (dst.out, dst.lse);
    let (kind, rows, threads, smem) = match kern {
        FwdKernel::Simple => ("simple", 16, 128, core::core_smem(core::Core::Fwd, d)),
        FwdKernel::Mma => ("mma", 64, 128, 0),
        FwdKernel::Pipelined => {
            let (rows, threads, smem) = pipe_config_of(d, cap > 0.0);
            // (the soft-capped entries: `flash_fwd_pipe_cap_*`)
            (if cap > 0.0 { "pipe_cap" } else { "pipe" }, rows, threads, smem)
        }
    };
    let name = format!("flash_fwd_{kind}_{sfx}_d{d}");
    let func = dev.get_or_load_custom_func(&name, ptx::FLASH_FWD_MODULE, ptx::FLASH_FWD)?;
    if smem > 48 * 1024 {
        // Dynamic shared memory above 48 KiB must be opted into, per kernel.
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).w()?;
    }
    let cfg = LaunchConfig { grid_dim: (t.div_ceil(rows) as u32, h as u32, b as u32), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
    let (bi, ti, si, hi, hkvi) = (b as i32, t as i32, s as i32, h as i32, hkv as i32);
    let mut bld = func.builder();
    bld.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
    bld.arg(&bi).arg(&ti).arg(&si).arg(&hi).arg(&hkvi).arg(&scale).arg(&cap);
    bld.arg(&causal).arg(&qo).arg(&qs).arg(&ko).arg(&ks);
    bld.arg(&o_t).arg(&o_row0).arg(&o_merge);
    // SAFETY: argument list matches FWD_ARGS in kernels/flash_fwd.cu; sizes checked above (the
    // rows of a fold by `fold::fold_into`).
    unsafe { bld.launch(cfg) }.w()?;
    Ok(())
}

fn storage_of<'a>(s: &'a Storage, what: &str, shape: &Shape) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("{what} {shape:?} is not on a CUDA device"),
    }
}

/// Make `t` contiguous with a start offset that is a multiple of 8 elements (16 bytes for the
/// 16-bit types: the cp.async / vector loads need it). A misaligned view gets a fresh storage:
/// `force_contiguous` (`Tensor::copy` would clone the whole storage and keep the offset).
fn prep(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    if t.layout().start_offset() % 8 == 0 {
        Ok(t)
    } else {
        t.force_contiguous()
    }
}

/// Raw forward on CUDA tensors, no graph: out f32 `[B, T, H, D]`, lse f32 `[B, H, T]`.
/// A query row with no visible key gets out 0 and lse `-inf`.
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: KMask, scale: impl Into<Logits>, imp: FwdImpl) -> Result<(Tensor, Tensor)> {
    let scale: Logits = scale.into();
    util::cuda_device(q, "flash_fwd: q")?;
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let ((o, os), (l, ls)) = fwd_storage(
        storage_of(&qs, "q", q.shape())?,
        ql,
        storage_of(&ks, "k", k.shape())?,
        kl,
        storage_of(&vs, "v", v.shape())?,
        vl,
        mask,
        scale,
        imp,
    )?;
    let none = || candle_core::op::BackpropOp::none();
    Ok((
        Tensor::from_storage(Storage::Cuda(o), os, none(), false),
        Tensor::from_storage(Storage::Cuda(l), ls, none(), false),
    ))
}
