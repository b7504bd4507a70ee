//! PTX of each kernel file (compute_80, or compute_90a where noted; built by `build.rs` with
//! nvcc), and the module names under which `CudaDevice::get_or_load_custom_func` caches them.

/// `kernels/flash_fwd.cu`: `flash_fwd_simple_{f32,f16,bf16}_d*`, `flash_fwd_mma_{f16,bf16}_d*`,
/// `flash_fwd_pipe_{f16,bf16}_d*` (cp.async + ldmatrix pipeline, dynamic shared memory) (d 16, 32, 64, 96,
/// 128; the simple and pipe entries also 256),
/// and the band-mask entries `flash_fwd_simple_band_*`, `flash_fwd_pipe_band_*` (`flash::fwd_band`).
pub const FLASH_FWD: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_fwd.ptx"));
/// `kernels/flash_bwd.cu`: `flash_bwd_delta_f32`, `flash_bwd_{dkdv,dq}_{f32,f16,bf16}_d{16,32,64,96,128,256}`,
/// `flash_bwd_{dkdv,dq}_band_*` (band masks, `flash::bwd_band`).
pub const FLASH_BWD: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_bwd.ptx"));
/// `kernels/flash_bwd_mma.cu`: `flash_bwd_mma_{dkdv,dq}_{f16,bf16}_d{16,32,64,96,128}` (tensor cores).
pub const FLASH_BWD_MMA: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_bwd_mma.ptx"));
/// `kernels/flash_bwd_pipe.cu`: `flash_bwd_pipe_prep_{f16,bf16}`,
/// `flash_bwd_pipe_{dkdv,dq}_{f16,bf16}_d{16,32,64,96,128,256}` (cp.async + ldmatrix pipeline),
/// `flash_bwd_pipe_{dkdv,dq}_band_*` (band masks, `flash::bwd_band`).
pub const FLASH_BWD_PIPE: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_bwd_pipe.ptx"));
/// `kernels/flash_bwd_fused.cu`: `flash_bwd_fused_{f16,bf16}_d{16,32,64,128}` (dK, dV and atomic dQ
/// in one kernel; opt-in `FwdImpl::AtomicDq`).
pub const FLASH_BWD_FUSED: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_bwd_fused.ptx"));
/// `kernels/flash_fwd_sm90.cu`: `flash_fwd_wgmma_{f16,bf16}_d{64,128}` (Hopper warpgroup MMA,
/// experimental). PTX for `compute_90a` (`.target sm_90a`): loads only on compute capability 9.x.
pub const FLASH_FWD_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_fwd_sm90.ptx"));
/// `kernels/flash_fwd_sm90_ws.cu`: `flash_fwd_wgmma_ws_{f16,bf16}_d{64,128}` (Hopper
/// warp-specialized forward: producer warpgroup, mbarrier ring, two consumer warpgroups in
/// ping-pong; experimental). PTX for `compute_90a` (`.target sm_90a`): loads only on compute
/// capability 9.x.
pub const FLASH_FWD_SM90_WS: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_fwd_sm90_ws.ptx"));
/// `kernels/flash_bwd_sm90.cu`: `flash_bwd_wgmma_{dkdv,dq,atomic}_{f16,bf16}_d{64,128}` (Hopper
/// warpgroup-MMA backward, experimental). PTX for `compute_90a` (`.target sm_90a`): loads only on
/// compute capability 9.x.
pub const FLASH_BWD_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_bwd_sm90.ptx"));
/// `kernels/flash_bwd_sm90_ws.cu`: `flash_bwd_wgmma_ws_{f16,bf16}_d{64,128}` (Hopper
/// warp-specialized backward: producer warpgroup, mbarrier ring of Q / dO tiles, two consumer
/// warpgroups computing dK, dV and atomic dQ on wgmma; experimental). PTX for `compute_90a`
/// (`.target sm_90a`): loads only on compute capability 9.x.
pub const FLASH_BWD_SM90_WS: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_bwd_sm90_ws.ptx"));
/// `kernels/merge.cu`: `merge_step_{f32,f16,bf16}`, `cast_out_{f32,f16,bf16}`.
pub const MERGE: &str = include_str!(concat!(env!("OUT_DIR"), "/merge.ptx"));
/// `kernels/layout.cu`: `seq_permute_*`, `a2a_pack_*`, `a2a_unpack_*` for f32/f16/bf16/u32/u8.
pub const LAYOUT: &str = include_str!(concat!(env!("OUT_DIR"), "/layout.ptx"));
/// `kernels/quant.cu`: `dequant_{int8,nf4}_{f32,f16,bf16}` (a quantized frozen weight to a dense
/// one, see [`crate::quant`]).
pub const QUANT: &str = include_str!(concat!(env!("OUT_DIR"), "/quant.ptx"));
/// `kernels/moe.cu`: `moe_top_k_{f32,f16,bf16}` (each token's top K experts, see [`crate::moe`]).
pub const MOE: &str = include_str!(concat!(env!("OUT_DIR"), "/moe.ptx"));
/// `kernels/grouped_gemm.cu`: `grouped_gemm_{nt,nn,tn}_{f32,f16,bf16}` (a mixture of experts'
/// grouped products, forward and backward, see [`crate::grouped_gemm`]).
pub const GROUPED_GEMM: &str = include_str!(concat!(env!("OUT_DIR"), "/grouped_gemm.ptx"));
/// `kernels/dropout.cu`: `dropout_keep_{f32,f16,bf16}` (dropout keep masks from counter-based
/// streams, see [`crate::dropout`]).
pub const DROPOUT: &str = include_str!(concat!(env!("OUT_DIR"), "/dropout.ptx"));
/// `kernels/probe.cu`: `probe_mma16816_{f16,bf16}`, `probe_ldsm`, `probe_cp_async` (diagnostic
/// probes of mma.sync / ldmatrix / cp.async, see [`crate::probe`]).
pub const PROBE: &str = include_str!(concat!(env!("OUT_DIR"), "/probe.ptx"));
/// `kernels/probe_sm90.cu`: `probe_wgmma_{ss,rs}_n{64,128}_{f16,bf16}`, `probe_wgmma_sstb_n64_{f16,bf16}`
/// (diagnostic probes of wgmma). PTX for `compute_90a` (`.target sm_90a`): loads only on compute
/// capability 9.x.
pub const PROBE_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/probe_sm90.ptx"));

/// Module names (keys of candle's custom-module cache).
pub const FLASH_FWD_MODULE: &str = "candle_cp_flash_fwd";
/// See [`FLASH_FWD_MODULE`].
pub const FLASH_BWD_MODULE: &str = "candle_cp_flash_bwd";
/// See [`FLASH_FWD_MODULE`].
pub const FLASH_BWD_MMA_MODULE: &str = "candle_cp_flash_bwd_mma";
/// See [`FLASH_FWD_MODULE`].
pub const FLASH_BWD_PIPE_MODULE: &str = "candle_cp_flash_bwd_pipe";
/// See [`FLASH_FWD_MODULE`].
pub const FLASH_BWD_FUSED_MODULE: &str = "candle_cp_flash_bwd_fused";
/// See [`FLASH_FWD_MODULE`].
pub const FLASH_FWD_SM90_MODULE: &str = "candle_cp_flash_fwd_sm90";
/// See [`FLASH_FWD_MODULE`].
pub const FLASH_FWD_SM90_WS_MODULE: &str = "candle_cp_flash_fwd_sm90_ws";
/// See [`FLASH_FWD_MODULE`].
pub const FLASH_BWD_SM90_MODULE: &str = "candle_cp_flash_bwd_sm90";
/// See [`FLASH_FWD_MODULE`].
pub const FLASH_BWD_SM90_WS_MODULE: &str = "candle_cp_flash_bwd_sm90_ws";
/// See [`FLASH_FWD_MODULE`].
pub const MERGE_MODULE: &str = "candle_cp_merge";
/// See [`FLASH_FWD_MODULE`].
pub const LAYOUT_MODULE: &str = "candle_cp_layout";
/// See [`FLASH_FWD_MODULE`].
pub const QUANT_MODULE: &str = "candle_cp_quant";
/// See [`FLASH_FWD_MODULE`].
pub const MOE_MODULE: &str = "candle_cp_moe";
/// See [`FLASH_FWD_MODULE`].
pub const GROUPED_GEMM_MODULE: &str = "candle_cp_grouped_gemm";
/// See [`FLASH_FWD_MODULE`].
pub const DROPOUT_MODULE: &str = "candle_cp_dropout";
/// See [`FLASH_FWD_MODULE`].
pub const PROBE_MODULE: &str = "candle_cp_probe";
/// See [`FLASH_FWD_MODULE`].
pub const PROBE_SM90_MODULE: &str = "candle_cp_probe_sm90";
