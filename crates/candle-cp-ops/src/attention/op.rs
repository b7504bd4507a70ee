//! [`AttentionOp`]: the candle `CustomOp3` wrapping the blockwise kernels.

use super::Scores;
use super::{attention_bwd, attention_bwd_band, kernel, Band, Mask};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use std::borrow::Cow;
use std::sync::{Arc, Mutex};

/// Slot where the forward leaves lse `[B, H, T]` (f32) for the caller and for `bwd`.
pub(crate) type LseSlot = Arc<Mutex<Option<Tensor>>>;

/// Blockwise attention as a `CustomOp3` over (q `[B, T, H, D]`, k `[B, S, Hkv, D]`,
/// v `[B, S, Hkv, D]`) returning out `[B, T, H, D]`.
///
/// The op can only return one tensor, so the forward stores lse `[B, H, T]` (f32) in the
/// op's shared slot ([`AttentionOp::lse_slot`]); `bwd` reads it from there and runs
/// [`attention_bwd`] with the op's output. A CUDA implementation adds `cuda_fwd` here,
/// filling the same slot.
pub struct AttentionOp {
    /// Visibility of (query, key) pairs in global positions (ignored when `band` is set).
    pub mask: Mask,
    /// Visibility as per-row key intervals ([`Band`]); takes precedence over `mask`.
    pub band: Option<Arc<Band>>,
    /// Multiplier of q·k (usually 1/sqrt(D)) and logit soft cap.
    pub scale: Scores,
    /// Forward output dtype: f32 when true (raw `attention_fwd`), q's dtype otherwise.
    pub f32_out: bool,
    lse: LseSlot,
}

impl AttentionOp {
    /// New op with an empty lse slot.
    pub fn new(mask: Mask, scale: impl Into<Scores>, f32_out: bool) -> Self {
        Self { mask, scale: scale.into(), f32_out, band: None, lse: Arc::new(Mutex::new(None)) }
    }

    /// New op whose visibility is `band` (per-row key intervals), with an empty lse slot.
    pub fn with_band(band: Arc<Band>, scale: impl Into<Scores>, f32_out: bool) -> Self {
        Self { mask: Mask::Full, scale: scale.into(), f32_out, band: Some(band), lse: Arc::new(Mutex::new(None)) }
    }

    /// Handle on the slot where the forward leaves lse `[B, H, T]`.
    pub fn lse_slot(&self) -> Arc<Mutex<Option<Tensor>>> {
        self.lse.clone()
    }
}

/// The lse the forward stored (error if the forward has not run).
pub(crate) fn read_lse(slot: &LseSlot, op: &str) -> Result<Tensor> {
    let g = slot.lock().unwrap_or_else(|e| e.into_inner());
    match &*g {
        Some(t) => Ok(t.clone()),
        None => candle_core::bail!("{op}: the forward did not produce an lse"),
    }
}

fn storage_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<Cow<'a, [f32]>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("attention: {what} {:?} is not contiguous", l.shape())
    };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[a..b]),
        CpuStorage::BF16(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F16(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_f32()).collect()),
        _ => candle_core::bail!("attention: {what} {:?} has dtype {:?}, expected f32, bf16 or f16", l.shape(), s.dtype()),
    })
}

/// A window mask goes in as a band ([`Band::from_mask`], which [`super::attention`] and
/// [`super::attention_fwd`] do), not as `Mask::Window`.
fn reject_window(op: &AttentionOp) -> Result<()> {
    let mask = &op.mask;
    if let (Mask::Window { .. }, None) = (mask, &op.band) {
        candle_core::bail!("AttentionOp: the kernels take full and causal masks and bands; use attention() or attention_fwd() for {mask:?} (they turn a window into a band)")
    }
    Ok(())
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "cp-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        reject_window(self)?;
        self.scale.check("attention")?;
        let (b, t, h, d) = l1.shape().dims4()?;
        let (_, s, hkv, _) = l2.shape().dims4()?;
        if l3.shape() != l2.shape() || hkv == 0 || h % hkv != 0 {
            candle_core::bail!("attention: bad shapes q {:?}, k {:?}, v {:?}", l1.shape(), l2.shape(), l3.shape())
        }
        let q = storage_f32(s1, l1, "q")?;
        let k = storage_f32(s2, l2, "k")?;
        let v = storage_f32(s3, l3, "v")?;
        let dims = kernel::Dims { b, t, s, h, hkv, d };
        let band = match &self.band {
            Some(band) => {
                band.check("attention", b, t, s)?;
                band.clone()
            }
            None => Arc::new(Band::from_mask(&self.mask, t, s)),
        };
        let (out, lse) = kernel::forward(&q, &k, &v, dims, &band, self.scale.f32s());
        let lse = Tensor::from_vec(lse, (b, h, t), &Device::Cpu)?;
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        let storage = match (self.f32_out, s1.dtype()) {
            (true, _) | (false, DType::F32) => CpuStorage::F32(out),
            (false, DType::BF16) => CpuStorage::BF16(out.iter().map(|&x| bf16::from_f32(x)).collect()),
            (false, DType::F16) => CpuStorage::F16(out.iter().map(|&x| f16::from_f32(x)).collect()),
            (false, dt) => candle_core::bail!("attention: dtype {dt:?} not supported"),
        };
        Ok((storage, Shape::from((b, t, h, d))))
    }

    /// CUDA forward: the flash kernels of `candle-cp-kernels` (see `attention/cuda.rs`); fills
    /// the same lse slot as `cpu_fwd`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        reject_window(self)?;
        super::cuda::op_fwd(self, s1, l1, s2, l2, s3, l3)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = read_lse(&self.lse, "attention backward")?;
        let (dq, dk, dv) = match &self.band {
            Some(band) => attention_bwd_band(q, k, v, res, &lse, grad_res, band, self.scale)?,
            None => attention_bwd(q, k, v, res, &lse, grad_res, &self.mask, self.scale)?,
        };
        Ok((Some(dq.to_dtype(q.dtype())?), Some(dk.to_dtype(k.dtype())?), Some(dv.to_dtype(v.dtype())?)))
    }
}
