//! Exact blockwise (flash-style) attention that returns the log-sum-exp, its backward, the
//! LSE merge, and `attention_slow` built from plain candle ops for tests.
//!
//! Shapes: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`, out `[B, T, H, D]`, lse `[B, H, T]`
//! (natural log, f32). Query head `h` uses KV head `h / (H / Hkv)` (GQA/MQA).
//!
//! Implementation: [`AttentionOp`] (a candle `CustomOp3`, module `op`) runs the CPU kernels of
//! module `kernel` (128×128 tiles through the `gemm` crate, rayon over
//! (batch, head, block), online softmax in f32). No T×S matrix is ever built: the forward
//! needs its output plus two 128×128 tiles per thread; the backward adds per-query-head dK/dV
//! partials (`[B, S, H, D]` each, summed over the G heads of a KV head at the end) and dQ
//! partials per key chunk (one chunk per head unless B·H < 4·threads). `merge` lives in module
//! `merge` (one host pass on CPU), `attention_slow` in `slow`.
//!
//! Where the LSE lives: the op returns one tensor (out); the forward writes lse into a shared
//! slot (`Arc<Mutex<Option<Tensor>>>`) held by the op struct, which `attention` reads to return
//! it and which the op's `bwd` reads to run the backward.

mod band;
mod blas;
mod call;
mod dense;
#[cfg(feature = "cuda")]
mod cuda;
mod docs;
mod kernel;
mod merge;
mod op;
mod prep;
mod row_sums;
mod scores;
pub mod sinks;
mod slow;
mod window;

pub use band::Band;
pub(crate) use docs::check_docs;
pub use docs::{attention_docs, attention_docs_mask, attention_docs_mask_with};
pub use merge::merge;
pub use op::AttentionOp;
pub use prep::BwdPrep;
pub use row_sums::RowSums;
pub use scores::Scores;
pub(crate) use call::{fwd_packed, BwdCall, CallMask};
#[cfg(feature = "cuda")]
pub(crate) use call::fwd_fold_cuda;
pub use sinks::{apply_sinks, attention_band_sinks, attention_sinks, sinks_grad, Sinks};
pub use slow::{attention_band_sinks_slow, attention_band_slow, attention_docs_mask_slow, attention_docs_slow, attention_sinks_slow, attention_slow};

use std::sync::Arc;
use candle_core::{DType, Device, Result, Tensor};

/// Which (query, key) pairs are visible.
///
/// Positions are *global*: local query row `i` sits at `q_offset + i * q_stride`, local key row
/// `j` at `k_offset + j * k_stride`. Contiguous and zigzag chunks use stride 1; the striped
/// layout (token `t` on rank `t mod P`) uses stride `P`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Every query sees every key.
    Full,
    /// Query at global position `qp` sees key at `kp` iff `kp <= qp`.
    Causal {
        /// Global position of local query row 0.
        q_offset: usize,
        /// Global distance between consecutive local query rows (1, or `P` when striped).
        q_stride: usize,
        /// Global position of local key row 0.
        k_offset: usize,
        /// Global distance between consecutive local key rows (1, or `P` when striped).
        k_stride: usize,
    },
    /// Causal sliding window (Mistral-style): query at `qp` sees key at `kp` iff
    /// `qp - window < kp <= qp` (itself and the `window - 1` keys before it). `window >= 1`.
    /// The kernels take only `Full` and `Causal`; [`attention_fwd`], [`attention_bwd`] and
    /// [`attention`] split a window call into at most three kernel calls per `window` query
    /// rows (module `window`).
    Window {
        /// Global position of local query row 0.
        q_offset: usize,
        /// Global distance between consecutive local query rows.
        q_stride: usize,
        /// Global position of local key row 0.
        k_offset: usize,
        /// Global distance between consecutive local key rows.
        k_stride: usize,
        /// Keys each query sees: itself and the `window - 1` before it.
        window: usize,
    },
}

impl Mask {
    /// Plain causal mask, queries and keys both starting at position 0 with stride 1.
    pub fn causal() -> Self {
        Mask::Causal { q_offset: 0, q_stride: 1, k_offset: 0, k_stride: 1 }
    }
    /// Causal mask for a chunk of queries starting at global `q_offset` paired with a chunk
    /// of keys starting at global `k_offset` (both stride 1).
    pub fn causal_offsets(q_offset: usize, k_offset: usize) -> Self {
        Mask::Causal { q_offset, q_stride: 1, k_offset, k_stride: 1 }
    }
    /// Causal sliding window of `window` keys (itself and `window - 1` before), queries and
    /// keys both starting at position 0 with stride 1.
    pub fn sliding_window(window: usize) -> Self {
        Mask::Window { q_offset: 0, q_stride: 1, k_offset: 0, k_stride: 1, window }
    }
    /// Is key row `j` visible from query row `i` (local indices)?
    pub fn visible(&self, i: usize, j: usize) -> bool {
        match *self {
            Mask::Full => true,
            Mask::Causal { q_offset, q_stride, k_offset, k_stride } => {
                k_offset + j * k_stride <= q_offset + i * q_stride
            }
            Mask::Window { q_offset, q_stride, k_offset, k_stride, window } => {
                let (qp, kp) = (q_offset + i * q_stride, k_offset + j * k_stride);
                kp <= qp && qp - kp < window
            }
        }
    }
}

/// Sizes of one attention call, checked by [`check_qkv`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Batch.
    pub b: usize,
    /// Local number of query rows.
    pub t: usize,
    /// Local number of key rows.
    pub s: usize,
    /// Query heads.
    pub h: usize,
    /// KV heads (divides `h`).
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
}

/// The head dim to run an attention of head dim `d` at on `device`: on CUDA the smallest one
/// at least `d` that the kernels take (16, 32, 64, 96, 128, 256; `d` above 256), so that a
/// caller free to pad its heads with zeros (which change neither the scores nor the output:
/// DeepSeek-V3's 192 runs at 256) stays on the GPU kernels rather than their host-copy
/// fallback; `d` elsewhere (the CPU kernel takes every head dim).
pub fn kernel_head_dim(d: usize, device: &candle_core::Device) -> usize {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return cuda::width_at_least(d);
    }
    let _ = device;
    d
}

/// Validate q `[B, T, H, D]`, k/v `[B, S, Hkv, D]` (same dtype f32/bf16/f16, same device,
/// `H % Hkv == 0`) and the mask (strides >= 1). Errors name the shapes.
pub fn check_qkv(op: &str, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask) -> Result<AttnDims> {
    let (qs, ks, vs) = (q.dims(), k.dims(), v.dims());
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        candle_core::bail!(
            "{op}: expected q [B, T, H, D], k/v [B, S, Hkv, D], got q {:?}, k {:?}, v {:?}",
            q.shape(), k.shape(), v.shape()
        )
    }
    if ks != vs {
        candle_core::bail!("{op}: k {:?} and v {:?} must have the same shape", k.shape(), v.shape())
    }
    candle_cp_comm::ensure_nonempty(op, "q", q)?;
    candle_cp_comm::ensure_nonempty(op, "k/v", k)?;
    let (b, t, h, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (kb, s, hkv, kd) = (ks[0], ks[1], ks[2], ks[3]);
    if kb != b || kd != d {
        candle_core::bail!(
            "{op}: batch and head dim of q {:?} and k/v {:?} must agree ([B, T, H, D] vs [B, S, Hkv, D])",
            q.shape(), k.shape()
        )
    }
    if hkv == 0 || h % hkv != 0 {
        candle_core::bail!(
            "{op}: query heads H = {h} must be a multiple of KV heads Hkv = {hkv} (q {:?}, k {:?})",
            q.shape(), k.shape()
        )
    }
    for (name, x) in [("k", k), ("v", v)] {
        if x.dtype() != q.dtype() {
            candle_core::bail!("{op}: {name} dtype {:?} differs from q dtype {:?} (q {:?}, {name} {:?})",
                x.dtype(), q.dtype(), q.shape(), x.shape())
        }
        if !x.device().same_device(q.device()) {
            candle_core::bail!("{op}: {name} {:?} is on {:?}, q {:?} on {:?}", x.shape(), x.device(), q.shape(), q.device())
        }
    }
    if !matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        candle_core::bail!("{op}: dtype {:?} not supported (f32, bf16, f16); q {:?}", q.dtype(), q.shape())
    }
    match *mask {
        Mask::Causal { q_stride, k_stride, .. } | Mask::Window { q_stride, k_stride, .. } if q_stride == 0 || k_stride == 0 => {
            candle_core::bail!("{op}: mask strides must be >= 1, got {mask:?} (q {:?}, k {:?})", q.shape(), k.shape())
        }
        Mask::Window { window: 0, .. } => {
            candle_core::bail!("{op}: a sliding window must hold at least 1 key, got {mask:?} (q {:?}, k {:?})", q.shape(), k.shape())
        }
        _ => {}
    }
    Ok(AttnDims { b, t, s, h, hkv, d })
}

fn check_like(op: &str, name: &str, x: &Tensor, want: &[usize], q: &Tensor) -> Result<()> {
    if x.dims() != want {
        candle_core::bail!("{op}: {name} has shape {:?}, expected {want:?} (q {:?})", x.shape(), q.shape())
    }
    if !x.device().same_device(q.device()) {
        candle_core::bail!("{op}: {name} {:?} is on {:?}, q on {:?}", x.shape(), x.device(), q.device())
    }
    Ok(())
}

/// Contents of `x` as a flat f32 vector on the host (row-major).
pub(crate) fn host_f32(x: &Tensor) -> Result<Vec<f32>> {
    x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// The f32 contents of a tensor on the host (row-major): borrowed from a contiguous f32 CPU
/// tensor (no copy), else a copy ([`host_f32`]).
pub(crate) enum HostF32<'a> {
    /// The tensor's own storage, elements `[a, b)`.
    Borrowed(Box<dyn std::ops::Deref<Target = candle_core::Storage> + 'a>, usize, usize),
    /// A converted copy.
    Owned(Vec<f32>),
}

impl std::ops::Deref for HostF32<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            HostF32::Borrowed(g, a, b) => match &***g {
                candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => &v[*a..*b],
                _ => &[], // never built for other storages (see host_f32_ref)
            },
            HostF32::Owned(v) => v,
        }
    }
}

/// [`HostF32`] of `x`: no copy for a contiguous f32 CPU tensor.
pub(crate) fn host_f32_ref(x: &Tensor) -> Result<HostF32<'_>> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        let (st, layout) = x.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(_)), Some((a, b))) = (&*st, layout.contiguous_offsets()) {
            return Ok(HostF32::Borrowed(Box::new(st), a, b));
        }
    }
    Ok(HostF32::Owned(host_f32(x)?))
}

/// Raw forward, no graph. q `[B, T, H, D]`, k/v `[B, S, Hkv, D]` (f32/bf16/f16) ->
/// out f32 `[B, T, H, D]`, lse f32 `[B, H, T]` (natural log). A query row with no visible key
/// gets out 0 and lse `-inf`. `T`, `S` are the *local* lengths; the mask carries the global
/// positions.
pub fn attention_fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: impl Into<Scores>) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("causal")?;
    let dims = check_qkv("attention_fwd", q, k, v, mask)?;
    if let Mask::Window { .. } = mask {
        if !band_kernels(q) {
            return window::fwd(q, k, v, mask, scale, dims);
        }
        return attention_fwd_band(q, k, v, &Band::from_mask(mask, dims.t, dims.s), scale);
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && cuda::supported(q.dim(3)?) {
        return cuda::fwd(q, k, v, mask, scale);
    }
    if !q.device().is_cpu() {
        // Devices without a kernel for this head dim: an unmasked call with a small score
        // matrix (a decode step) from candle ops on the device (module dense), else the CPU
        // kernel on host copies.
        if *mask == Mask::Full && dense::fits(dims) {
            return dense::fwd(q, k, v, scale, dims);
        }
        let cpu = |x: &Tensor| x.to_device(&Device::Cpu);
        let (out, lse) = attention_fwd(&cpu(q)?, &cpu(k)?, &cpu(v)?, mask, scale)?;
        return Ok((out.to_device(q.device())?, lse.to_device(q.device())?));
    }
    raw_fwd(AttentionOp::new(*mask, scale, true), q, k, v, "attention_fwd")
}

/// Run `op` (f32 output) on the CPU without a graph: out and the lse it stored.
fn raw_fwd(op: AttentionOp, q: &Tensor, k: &Tensor, v: &Tensor, what: &str) -> Result<(Tensor, Tensor)> {
    let slot = op.lse_slot();
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let out = q.apply_op3_no_bwd(&k, &v, &op)?;
    let lse = op::read_lse(&slot, what)?;
    Ok((out, lse))
}

/// Shapes of the backward's extra inputs: out/dout `[B, T, H, D]`, lse `[B, H, T]`.
fn check_bwd_inputs(op: &str, q: &Tensor, out: &Tensor, lse: &Tensor, dout: &Tensor, dims: AttnDims) -> Result<()> {
    let AttnDims { b, t, h, d, .. } = dims;
    check_like(op, "out", out, &[b, t, h, d], q)?;
    check_like(op, "dout", dout, &[b, t, h, d], q)?;
    check_like(op, "lse", lse, &[b, h, t], q)
}

/// The CPU backward kernel under `band`, on host views of the inputs (no copy for contiguous
/// f32 CPU tensors); results on q's device.
#[allow(clippy::too_many_arguments)]
fn cpu_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    prep: &BwdPrep,
    dims: AttnDims,
    band: &Band,
    scale: Scores,
) -> Result<(Tensor, Tensor, Tensor)> {
    let AttnDims { b, t, s, h, hkv, d } = dims;
    let (dq, dk, dv) = kernel::backward(
        &host_f32_ref(q)?,
        &host_f32_ref(k)?,
        &host_f32_ref(v)?,
        &host_f32_ref(prep.delta())?,
        &host_f32_ref(lse)?,
        &host_f32_ref(prep.dout())?,
        dims,
        band,
        scale.f32s(),
    );
    let dev = q.device();
    Ok((
        Tensor::from_vec(dq, (b, t, h, d), &Device::Cpu)?.to_device(dev)?,
        Tensor::from_vec(dk, (b, s, hkv, d), &Device::Cpu)?.to_device(dev)?,
        Tensor::from_vec(dv, (b, s, hkv, d), &Device::Cpu)?.to_device(dev)?,
    ))
}

/// Raw backward, no graph. `out` f32 `[B, T, H, D]` and `lse` `[B, H, T]` are those of the
/// *whole* attention these query rows belong to (the global LSE in ring attention, where this
/// is called once per (query chunk, key chunk) block); `dout` `[B, T, H, D]`.
/// Returns f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]` (dk/dv summed over the G = H/Hkv query
/// heads of each KV head). Rows with lse `-inf` contribute nothing. Several calls over the same
/// query rows: make one [`BwdPrep`] and call [`attention_bwd_prepared`].
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    mask: &Mask,
    scale: impl Into<Scores>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_bwd")?;
    let dims = check_qkv("attention_bwd", q, k, v, mask)?;
    check_bwd_inputs("attention_bwd", q, out, lse, dout, dims)?;
    attention_bwd_prepared(q, k, v, lse, &BwdPrep::new(q, out, dout)?, mask, scale)
}

/// [`attention_bwd`] on a prepared backward: `prep` is [`BwdPrep::new`] of these query rows'
/// whole-attention out and dO (or [`BwdPrep::narrow_rows`] of a larger one), `lse` `[B, H, T]`.
/// What ring, all-gather and window attention call per block.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_prepared(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    prep: &BwdPrep,
    mask: &Mask,
    scale: impl Into<Scores>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_bwd_prepared")?;
    let dims = check_qkv("attention_bwd", q, k, v, mask)?;
    check_like("attention_bwd", "lse", lse, &[dims.b, dims.h, dims.t], q)?;
    prep.check("attention_bwd", q, dims)?;
    let (t, s) = (dims.t, dims.s);
    if let Mask::Window { .. } = mask {
        if !band_kernels(q) {
            return window::bwd(q, k, v, lse, prep, mask, scale, dims);
        }
        return attention_bwd_band_prepared(q, k, v, lse, prep, &Band::from_mask(mask, t, s), scale);
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && cuda::supported(dims.d) {
        return cuda::bwd(q, k, v, lse, prep, mask, scale);
    }
    // CPU, and other devices / head dims: the CPU kernel (host copies off the CPU).
    cpu_bwd(q, k, v, lse, prep, dims, &Band::from_mask(mask, t, s), scale)
}

/// Autograd attention: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]` -> out `[B, T, H, D]` in q's
/// dtype (differentiable w.r.t. q, k, v through [`AttentionOp`]'s `bwd`), lse f32 `[B, H, T]`
/// (not differentiable). Accumulation is f32 for every input dtype. The backward's row sums
/// come from the returned output ([`RowSums::Output`]); [`attention_with`] chooses.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: impl Into<Scores>) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention")?;
    attention_with(q, k, v, mask, scale, RowSums::Output)
}

/// [`attention`] with the backward's row sums taken as `row_sums` says: from the returned
/// output (the op, nothing extra kept) or from the f32 output ([`RowSums::F32`]: the raw
/// forward and backward attached as a closure, a bf16 rounding residual kept for a 16-bit
/// output).
pub fn attention_with(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: impl Into<Scores>, row_sums: RowSums) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_with")?;
    let dims = check_qkv("attention", q, k, v, mask)?;
    if row_sums == RowSums::F32 {
        if let Mask::Window { .. } = mask {
            if band_kernels(q) {
                return attention_band_with(q, k, v, &Band::from_mask(mask, dims.t, dims.s), scale, row_sums);
            }
        }
        return row_sums::attention_f32(q, k, v, mask, scale);
    }
    if let Mask::Window { .. } = mask {
        if !band_kernels(q) {
            return window_autograd(q, k, v, mask, scale, dims);
        }
        return attention_band(q, k, v, &Band::from_mask(mask, dims.t, dims.s), scale);
    }
    let op = AttentionOp::new(*mask, scale, false);
    let slot = op.lse_slot();
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let out = q.apply_op3(&k, &v, op)?;
    let lse = op::read_lse(&slot, "attention")?;
    Ok((out, lse))
}

/// Do the kernels for `q`'s device take a [`Band`] directly (CPU: always; CUDA: the
/// `Simple`/`Pipelined` kernels)? Otherwise window masks are split into full/causal calls
/// (module `window`) and documents into one call per document.
fn band_kernels(q: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return q.dim(3).map(cuda::supported).unwrap_or(false);
    }
    q.device().is_cpu()
}

/// Raw forward under a [`Band`] (per-row key intervals), no graph: q `[B, T, H, D]`, k/v
/// `[B, S, Hkv, D]` -> out f32 `[B, T, H, D]`, lse f32 `[B, H, T]`; the band is `[1 or B, T]`
/// over `S` keys. A row with an empty interval gets out 0 and lse `-inf`. One kernel call
/// whatever the band holds (documents, windows, causal edges).
pub fn attention_fwd_band(q: &Tensor, k: &Tensor, v: &Tensor, band: &Band, scale: impl Into<Scores>) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_fwd_band")?;
    let dims = check_qkv("attention_fwd_band", q, k, v, &Mask::Full)?;
    band.check("attention_fwd_band", dims.b, dims.t, dims.s)?;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && cuda::supported(dims.d) {
        return cuda::fwd_band(q, k, v, band, scale);
    }
    if !q.device().is_cpu() {
        let cpu = |x: &Tensor| x.to_device(&Device::Cpu);
        let (out, lse) = attention_fwd_band(&cpu(q)?, &cpu(k)?, &cpu(v)?, band, scale)?;
        return Ok((out.to_device(q.device())?, lse.to_device(q.device())?));
    }
    raw_fwd(AttentionOp::with_band(Arc::new(band.clone()), scale, true), q, k, v, "attention_fwd_band")
}

/// Raw backward under a [`Band`], no graph (see [`attention_bwd`] for `out`/`lse`, which are
/// the whole attention's). Returns f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_band(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    band: &Band,
    scale: impl Into<Scores>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_bwd_band")?;
    let dims = check_qkv("attention_bwd_band", q, k, v, &Mask::Full)?;
    check_bwd_inputs("attention_bwd_band", q, out, lse, dout, dims)?;
    attention_bwd_band_prepared(q, k, v, lse, &BwdPrep::new(q, out, dout)?, band, scale)
}

/// [`attention_bwd_band`] on a prepared backward (see [`attention_bwd_prepared`]).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_band_prepared(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    prep: &BwdPrep,
    band: &Band,
    scale: impl Into<Scores>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_bwd_band_prepared")?;
    let dims = check_qkv("attention_bwd_band", q, k, v, &Mask::Full)?;
    band.check("attention_bwd_band", dims.b, dims.t, dims.s)?;
    check_like("attention_bwd_band", "lse", lse, &[dims.b, dims.h, dims.t], q)?;
    prep.check("attention_bwd_band", q, dims)?;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && cuda::supported(dims.d) {
        return cuda::bwd_band(q, k, v, lse, prep, band, scale);
    }
    cpu_bwd(q, k, v, lse, prep, dims, band, scale)
}

/// Autograd attention under a [`Band`]: out `[B, T, H, D]` in q's dtype (differentiable
/// w.r.t. q, k, v), lse f32 `[B, H, T]`. One kernel call forward, one backward (on CUDA both
/// read one device copy of the bounds, made here unless `band` already has one). Row sums from
/// the returned output; [`attention_band_with`] chooses.
pub fn attention_band(q: &Tensor, k: &Tensor, v: &Tensor, band: &Band, scale: impl Into<Scores>) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_band")?;
    attention_band_with(q, k, v, band, scale, RowSums::Output)
}

/// [`attention_band`] with the backward's row sums taken as `row_sums` says ([`attention_with`]).
pub fn attention_band_with(q: &Tensor, k: &Tensor, v: &Tensor, band: &Band, scale: impl Into<Scores>, row_sums: RowSums) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    scale.check("attention_band_with")?;
    let dims = check_qkv("attention_band", q, k, v, &Mask::Full)?;
    band.check("attention_band", dims.b, dims.t, dims.s)?;
    let mut band = band.clone();
    if band.device_bounds(q.device()).is_none() {
        Band::upload_all([&mut band], q.device())?;
    }
    if row_sums == RowSums::F32 {
        return row_sums::attention_band_f32(q, k, v, band, scale);
    }
    let op = AttentionOp::with_band(Arc::new(band), scale, false);
    let slot = op.lse_slot();
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let out = q.apply_op3(&k, &v, op)?;
    let lse = op::read_lse(&slot, "attention_band")?;
    Ok((out, lse))
}

/// [`attention`] for a window mask: the decomposed forward (module `window`) on detached
/// inputs, its backward attached as a closure.
fn window_autograd(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: Scores, dims: AttnDims) -> Result<(Tensor, Tensor)> {
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let (out32, lse) = window::fwd(&qd, &kd, &vd, mask, scale, dims)?;
    let out = out32.to_dtype(q.dtype())?;
    let (m, l) = (*mask, lse.clone());
    let (qdt, kdt) = (q.dtype(), k.dtype());
    let bwd_fn: crate::autograd::BackwardFn = std::sync::Arc::new(move |dout: &Tensor| {
        let (dq, dk, dv) = window::bwd(&qd, &kd, &vd, &l, &BwdPrep::new(&qd, &out32, dout)?, &m, scale, dims)?;
        Ok(vec![Some(dq.to_dtype(qdt)?), Some(dk.to_dtype(kdt)?), Some(dv.to_dtype(kdt)?)])
    });
    let out = crate::autograd::attach3("attention (window)", q, k, v, out, bwd_fn)?;
    Ok((out, lse))
}
