//! `flash::bwd_prepared_add_dq` as the in-place op on an f32 dQ buffer that the ring runs it in
//! (`candle_cp_ops`'s `AddBwdDq`): shared by `gpu_check` (views section) and `gpu_bench` (ring
//! steps), included with `#[path]`.

use candle_core::{CpuStorage, CudaStorage, InplaceOp1, Layout, Tensor};
use candle_cp_kernels::flash::{self, BwdPrep, FwdImpl, KMask};
use std::cell::RefCell;

/// One prepared backward call whose dQ is added into the buffer the op runs on; dK, dV in `out`.
pub struct AddDq<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub lse: &'a Tensor,
    pub pr: &'a BwdPrep,
    pub mask: KMask,
    pub scale: f32,
    pub imp: FwdImpl,
    pub out: RefCell<Option<(Tensor, Tensor)>>,
}

impl InplaceOp1 for AddDq<'_> {
    fn name(&self) -> &'static str {
        "gpu-add-dq"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("AddDq runs on CUDA only")
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let dkv = flash::bwd_prepared_add_dq(self.q, self.k, self.v, self.lse, self.pr, self.mask, self.scale, self.imp, (s, l))?;
        *self.out.borrow_mut() = Some(dkv);
        Ok(())
    }
}
