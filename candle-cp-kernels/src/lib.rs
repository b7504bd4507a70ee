//! CUDA kernels for candle-cp. Without the `cuda` feature this crate is empty and its build
//! script does nothing (no nvcc needed).
//!
//! With `cuda`, `build.rs` compiles `kernels/*.cu` to PTX for `compute_80` (Ampere and Hopper;
//! the driver JIT-compiles it; the Hopper `wgmma` files for `compute_90a`) and this crate
//! exposes (modules present only with the feature):
//! - `ptx`: the PTX sources as string constants;
//! - `flash`: flash-attention forward with LSE (tensor cores for bf16/f16; opt-in Hopper wgmma)
//!   and backward;
//! - `merge`: ring-step LSE merge on an f32 accumulator, and the final cast;
//! - `layout`: zigzag / striped shard and unshard along the sequence, all-to-all pack/unpack;
//! - `dropout`: dropout keep masks from counter-based streams (SP and LoRA dropout);
//! - `moe`: each token's top K experts on the device (mixture-of-experts routing);
//! - `grouped_gemm`: the experts' grouped products (forward, dx, dW) in one launch each;
//! - `quant`: dequantization of int8 / NF4 frozen weights (a LoRA run's quantized base);
//! - `probe`: probe kernels that check (and diagnose) our reading of the PTX ISA for mma.sync,
//!   ldmatrix, cp.async and wgmma on the GPU (`probe_map` / `probe_diag`, their host-side layouts
//!   and analysis, are compiled without the feature too).
//!
//! The functions take and return candle `Tensor`s on a CUDA device (or
//! `CudaStorage` + `Layout` for `CustomOp::cuda_fwd`), so CPU and CUDA paths share one API in
//! `candle-cp-ops`. Every kernel has a CPU reference there, named at the top of its `.cu`
//! file; `examples/gpu_check.rs` compares them on a GPU.

#![warn(missing_docs)]

#[cfg(feature = "cuda")]
pub mod dropout;
#[cfg(feature = "cuda")]
pub mod flash;
#[cfg(feature = "cuda")]
pub mod grouped_gemm;
#[cfg(feature = "cuda")]
pub mod layout;
#[cfg(feature = "cuda")]
pub mod merge;
#[cfg(feature = "cuda")]
pub mod moe;
#[cfg(feature = "cuda")]
pub mod probe;
pub mod probe_diag;
pub mod probe_map;
#[cfg(feature = "cuda")]
pub mod ptx;
#[cfg(feature = "cuda")]
pub mod quant;
#[cfg(feature = "cuda")]
mod util;
