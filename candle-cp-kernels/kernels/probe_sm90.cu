// Probe kernels for the Hopper warpgroup MMA the sm_90a flash kernels rest on (wgmma.mma_async
// m64nNk16, N = 64 and 128, f16 / bf16 -> f32): the operand forms of flash_fwd_sm90.cu and
// flash_bwd_sm90.cu, with their 128-byte-swizzle tiles (sw_load), descriptors (sw128_desc), k-step
// address advances and register fragments (acc_to_a), one k-step per wgmma, each k-step's
// accumulator written to global memory register by register. They compute nothing useful: the
// inputs are built so that every accumulator register identifies the A row, B column and k index
// it came from. Rust caller: candle_cp_kernels::probe::run_probes (src/probe.rs); CPU reference:
// candle_cp_kernels::probe_diag (src/probe_diag.rs: inputs, the documented accumulator layout,
// mismatch analysis). Emulator check: emu/check_probe.cpp. Built by build.rs with
// -arch=compute_90a (PTX `.target sm_90a`); loads only on compute capability 9.x.
//
// Every entry: grid (passes), block 256 (two warpgroups, like the flash kernels); block p runs pass
// p on its own inputs and writes out[((p * 8 + kk) * 256 + tid) * N/2 + reg] for k-steps kk = 0..7
// (K = 128: kk 1..3 advance the start address inside a 128-byte row, kk 4..7 cross into the second
// 64-element column block). Logical operands, row-major, A [128 x 128] (rows 64 wg .. of warpgroup
// wg, k index 0..127), B [128 x N] (k x n); k-step kk multiplies A[:, 16kk .. 16kk + 15] by
// B[16kk .. 16kk + 15, :].
//   probe_wgmma_ss_n{64,128}_{bf16,f16} (S = Q K^T of flash_fwd_sm90): a = A [128 x 128], b = B
//     stored K-major ([n][k], N x 128, like K); both loaded with sw_load, descriptors as issue_s:
//     A start q + (kk/4)*128*128 + wg*64*128 + (kk%4)*32, B start k + (kk/4)*N*128 + (kk%4)*32,
//     LBO 16, SBO 1024; wg_ss.
//   probe_wgmma_rs_n{64,128}_{bf16,f16} (O += P V): p = A as f32 [128 x 128]; each thread reads its
//     accumulator-layout elements (element 4i + e: row 64wg + 16wr + g + 8(e/2), column 8i + 2t + e%2)
//     and re-packs them with acc_to_a as the kernels re-pack P; b = B stored MN-major ([k][n],
//     128 x N, like V), sw_load; descriptor as issue_pv: start v + kk*2048, LBO 128*128, SBO 1024;
//     wg_rs (imm-trans-b = 1).
//   probe_wgmma_sstb_n64_{bf16,f16} (dQ = dS K of flash_bwd_sm90's atomic variant): A as in ss,
//     B as in rs; wg_ss_tb.
#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "probe_sm90.cu uses wgmma: compile it with -arch=compute_90a"
#endif

#include "wgmma.cuh"
#include "tma.cuh"  // probe_tma
#include "flash_sm90.cuh"  // probe_stsm_ds: bwd_sm90_ds_store

#define PROBE_WG_K 128
#define PROBE_WG_M 128
#define PROBE_WG_NTH 256
// Dynamic shared memory: A [128 x 128] and B [128 x N] 16-bit tiles, plus 1024 for the alignment.
#define PROBE_WG_SMEM(N) ((PROBE_WG_M + (N)) * PROBE_WG_K * 2 + 1024)

// FORM 0: ss (A desc K-major, B desc K-major); 1: rs (A registers, B desc MN-major);
// 2: sstb (A desc K-major, B desc MN-major).
template <typename T, int N, int FORM>
__device__ __forceinline__ void probe_wgmma(const T* __restrict__ a16, const float* __restrict__ a32,
                                            const T* __restrict__ b, float* __restrict__ out) {
  constexpr int NTH = PROBE_WG_NTH, M = PROBE_WG_M, K = PROBE_WG_K, KS = K / 16;
  CP_DYN_SMEM_A(unsigned char, wg_smem, 1024);
  const uint32_t a_sa = (cp_smem_u32(wg_smem) + 1023u) & ~1023u, b_sa = a_sa + M * K * 2;
  const int p = blockIdx.x, tid = threadIdx.x, wg = tid >> 7, wr = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  if constexpr (FORM != 1) sw_load<M, K, NTH>(a_sa, a16 + (size_t)p * M * K, K, 0, M, tid);
  if constexpr (FORM == 0)
    sw_load<N, K, NTH>(b_sa, b + (size_t)p * N * K, K, 0, N, tid);  // [n][k]
  else
    sw_load<K, N, NTH>(b_sa, b + (size_t)p * K * N, N, 0, K, tid);  // [k][n]
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  uint32_t pa[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
  if constexpr (FORM == 1) {
    float s[K / 2];
    const float* A = a32 + (size_t)p * M * K;
#pragma unroll
    for (int i = 0; i < K / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[4 * i + e] = A[(64 * wg + 16 * wr + g + 8 * (e >> 1)) * K + 8 * i + 2 * t + (e & 1)];
    acc_to_a<T>(pa, s);
  }
  float d[N / 2];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
    reg_fence(d);
    reg_fence(pa);
    wg_fence();
    const uint32_t aa = a_sa + (uint32_t)((kk >> 2) * M * 128 + wg * 64 * 128 + (kk & 3) * 32);
    if constexpr (FORM == 0)
      wg_ss<N, T>(d, sw128_desc(aa, 16, 1024), sw128_desc(b_sa + (uint32_t)((kk >> 2) * N * 128 + (kk & 3) * 32), 16, 1024), 0);
    else if constexpr (FORM == 1)
      wg_rs<N, T>(d, pa[kk], sw128_desc(b_sa + (uint32_t)(kk * 2048), K * 128, 1024), 0);
    else
      wg_ss_tb<N, T>(d, sw128_desc(aa, 16, 1024), sw128_desc(b_sa + (uint32_t)(kk * 2048), K * 128, 1024), 0);
    wg_commit();
    wg_wait<0>();
    reg_fence(d);
    reg_fence(pa);
    float* o = out + (((size_t)p * KS + kk) * NTH + tid) * (N / 2);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) o[i] = d[i];
  }
}

// ---- entry points ---------------------------------------------------------------------------------
#define PROBE_SS(NAME, TY, N)                                                                  \
  extern "C" __global__ void probe_wgmma_ss_n##N##_##NAME(const TY* a, const TY* b, float* out) { \
    probe_wgmma<TY, N, 0>(a, nullptr, b, out);                                                  \
  }
#define PROBE_RS(NAME, TY, N)                                                                     \
  extern "C" __global__ void probe_wgmma_rs_n##N##_##NAME(const float* a, const TY* b, float* out) { \
    probe_wgmma<TY, N, 1>(nullptr, a, b, out);                                                     \
  }
#define PROBE_SSTB(NAME, TY, N)                                                                  \
  extern "C" __global__ void probe_wgmma_sstb_n##N##_##NAME(const TY* a, const TY* b, float* out) { \
    probe_wgmma<TY, N, 2>(a, nullptr, b, out);                                                    \
  }
PROBE_SS(bf16, __nv_bfloat16, 64) PROBE_SS(bf16, __nv_bfloat16, 128)
PROBE_SS(f16, __half, 64) PROBE_SS(f16, __half, 128)
PROBE_RS(bf16, __nv_bfloat16, 64) PROBE_RS(bf16, __nv_bfloat16, 128)
PROBE_RS(f16, __half, 64) PROBE_RS(f16, __half, 128)
PROBE_SSTB(bf16, __nv_bfloat16, 64) PROBE_SSTB(f16, __half, 64)

// ---- TMA ------------------------------------------------------------------------------------------
// probe_tma (the loads of the `_tma_` entries of flash_{fwd,bwd}_sm90_ws.cu): grid 1, block 128,
// dynamic shared memory PROBE_TMA_SMEM. Thread 0 initialises an mbarrier (count 1), prefetches the
// map, arrives with expect_tx of one box (16,384 bytes) and issues one cp.async.bulk.tensor.4d load
// of `map` (the flash kernels' maps: (D, Hh, L, B) innermost first, box 64 x 1 x 128 x 1, 128-byte
// swizzle) at coordinates (c0, c1, c2, c3) into a 1024-aligned buffer; every thread waits for the
// phase, then copies its 32 words of the buffer (raw, swizzled as it landed) to out[tid * 32 ..] and
// sets done[tid] = 1. The host (probe_map::tma_check) predicts every 16-bit element: the tensor
// element of box row r, 16-byte chunk c ^ (r % 8), or zero out of bounds.
#define PROBE_TMA_BOX_BYTES (64 * 2 * 128)
#define PROBE_TMA_SMEM (PROBE_TMA_BOX_BYTES + 1024 + 8)
extern "C" __global__ void probe_tma(unsigned int* out, unsigned int* done, int c0, int c1, int c2, int c3,
                                     const CP_GRID_CONSTANT CpTmaMap map) {
  CP_DYN_SMEM_A(unsigned char, tma_smem, 1024);
  const uint32_t base = cp_smem_u32(tma_smem);
  const uint32_t box_sa = (base + 1023u) & ~1023u;
  uint64_t* bar = reinterpret_cast<uint64_t*>(tma_smem + (box_sa - base) + PROBE_TMA_BOX_BYTES);
  const int tid = threadIdx.x;
  if (tid == 0) {
    cp_mbar_init(bar, 1);
    cp_mbar_init_fence();
  }
  __syncthreads();
  if (tid == 0) {
    cp_tma_prefetch_map(&map);
    cp_mbar_arrive_expect_tx(bar, PROBE_TMA_BOX_BYTES);
    cp_tma_load_4d(box_sa, &map, c0, c1, c2, c3, bar);
  }
  cp_mbar_wait(bar, 0);
  const unsigned int* box = reinterpret_cast<const unsigned int*>(tma_smem + (box_sa - base));
#pragma unroll 4
  for (int i = 0; i < 32; ++i) out[tid * 32 + i] = box[tid * 32 + i];
  done[tid] = 1;
}

// probe_tma_red (the dQ reductions of flash_bwd_sm90_ws.cu's `_tma_` entries): grid 1, block 128,
// dynamic shared memory PROBE_TMA_RED_SMEM. Writes two f32 boxes of 64 rows x 32 columns into a
// 1024-aligned buffer in the 128-byte swizzled layout the backward's dQ buffer uses (element (r, c)
// of box x, c < 32, at x * 8192 + cp_sw128_f32_off(r, c), tma.cuh) with the value
// 1 + (32 x + c) + 64 r, fences for the async proxy, and thread 0 adds box x into `map` (an f32
// [B, L, Hh, D] map like the backward's dq map: box 32 x 1 x 64 x 1, 128-byte swizzle) at
// (c0 + 32 x, c1, c2, c3) with cp.reduce.async.bulk.tensor, then waits until both have read the
// buffer. The host (probe_map::tma_red_check) predicts every element of the tensor afterwards.
#define PROBE_TMA_RED_SMEM (2 * 64 * 32 * 4 + 1024)
extern "C" __global__ void probe_tma_red(int c0, int c1, int c2, int c3, const CP_GRID_CONSTANT CpTmaMap map) {
  CP_DYN_SMEM_A(unsigned char, red_smem, 1024);
  const uint32_t base = cp_smem_u32(red_smem);
  const uint32_t buf_sa = (base + 1023u) & ~1023u;
  const int tid = threadIdx.x;
  for (int e = tid; e < 2 * 64 * 32; e += 128) {
    const int x = e >> 11, r = (e >> 5) & 63, c = e & 31;
    const uint32_t a = buf_sa + (uint32_t)(x * 8192) + cp_sw128_f32_off(r, c);
    *reinterpret_cast<float*>(red_smem + (a - base)) = (float)(1 + 32 * x + c + 64 * r);
  }
  fence_proxy_async();
  __syncthreads();
  if (tid == 0) {
    cp_tma_prefetch_map(&map);
    cp_tma_reduce_add_4d(&map, c0, c1, c2, c3, buf_sa);
    cp_tma_reduce_add_4d(&map, c0 + 32, c1, c2, c3, buf_sa + 8192);
    cp_bulk_commit();
    cp_bulk_wait_read<0>();
  }
}

// ---- stmatrix: the Hopper backwards' transposed dS store ------------------------------------------
// probe_stsm_ds (bwd_sm90_ds_store of flash_sm90.cuh, called by flash_bwd_sm90.cu's atomic dQ and
// flash_bwd_sm90_ws.cu): grid 1, block 256 (two warpgroups, as the kernels), dynamic shared memory
// PROBE_STSM_SMEM. Every thread fills its dS^T fragments dsa[kk][r] (BQ = 64) as the kernels hold
// them, each 16-bit value a code of its element: 0x8000 | (query << 8) | key, key = 64 wg + 16 wr + g
// + 8 (r & 1), query = 16 kk + 8 (r >> 1) + 2t (+ 1 in the high half); warpgroup wg stores with
// w = wg into a zeroed, 1024-aligned [64 x 64]-per-warpgroup tile; after a barrier every thread copies
// 16 words of the raw tile (2 x 8192 bytes) to out[tid * 16 ..]. The host (probe_map::stsm_check)
// predicts every 16-bit element: byte w * 8192 + q * 128 + 16 c + 2 e holds query q, key 64 w +
// 8 ((c ^ q) & 7) + e.
#define PROBE_STSM_SMEM (2 * 64 * 128 + 1024)
extern "C" __global__ void probe_stsm_ds(unsigned int* __restrict__ out) {
  CP_DYN_SMEM_A(unsigned char, st_smem, 1024);
  const uint32_t base = cp_smem_u32(st_smem);
  const uint32_t buf_sa = (base + 1023u) & ~1023u;
  unsigned char* buf = st_smem + (buf_sa - base);
  const int tid = threadIdx.x, wg = tid >> 7, wr = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int e = tid; e < 2 * 64 * 128 / 4; e += 256) reinterpret_cast<uint32_t*>(buf)[e] = 0u;
  uint32_t dsa[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t key = (uint32_t)(64 * wg + 16 * wr + g + 8 * (r & 1)), q = (uint32_t)(16 * kk + 8 * (r >> 1) + 2 * t);
      dsa[kk][r] = (0x8000u | (q << 8) | key) | ((0x8000u | ((q + 1) << 8) | key) << 16);
    }
  __syncthreads();
  bwd_sm90_ds_store<64>(dsa, buf_sa, wg, wr, lane);
  __syncthreads();
  for (int w = 0; w < 16; ++w) out[tid * 16 + w] = reinterpret_cast<const uint32_t*>(buf)[tid * 16 + w];
}
