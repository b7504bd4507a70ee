// Probe kernels for the Ampere-class primitives the tensor-core kernels rest on: mma.sync
// m16n8k16 (bf16 / f16 -> f32) fragments, ldmatrix .x4 and .x4.trans (with the kernels' lane
// address formulas pipe_off_a / pipe_off_b), and 16-byte cp.async with zero-fill (src-size 0)
// and cp.async.wait_group. They compute nothing useful: each writes what the hardware put in
// each register of each thread, so that a wrong reading of the PTX ISA is diagnosed (which
// element sits where) rather than only detected. Rust caller: candle_cp_kernels::probe::run_probes
// (src/probe.rs); CPU reference: the fragment formulas of common.cuh / flash_bwd_pipe.cuh,
// transcribed in candle_cp_kernels::probe_diag (src/probe_diag.rs), which builds the same inputs,
// predicts every register and explains mismatches. Emulator check: emu/check_probe.cpp.
// Every probe uses the same wrappers as the real kernels (cp_mma16816, cp_pack2, cp_ldsm_x4,
// cp_ldsm_x4_trans, pipe_off_a / pipe_off_b, cp_async16, cp_async_commit, cp_async_wait);
// fragments are built from the documented formulas (comment above cp_mma16816 in common.cuh).
#include "common.cuh"
#include "flash_bwd_pipe.cuh"  // pipe_off_a, pipe_off_b (ldmatrix lane addresses of the kernels)

// ---- mma.sync m16n8k16 --------------------------------------------------------------------------
// probe_mma16816_{bf16,f16}: grid (passes), block 32 (one warp). Block p reads A [16 x 16] at
// a + 256 p and B [16 x 8] (k-major rows: B[k][n] at b + 128 p + 8 k + n), builds the fragments
// with the documented layout (g = lane / 4, t = lane % 4; a[i] = A[g + 8 (i & 1)][2t + 8 (i >> 1)
// + {0, 1}], b0 = B[2t + {0, 1}][g], b1 = B[2t + 8 + {0, 1}][g], low half = lower index), runs one
// mma with a zero accumulator and writes d[0..3] to out[(p * 32 + lane) * 4 + r].
template <typename T>
__device__ __forceinline__ void probe_mma(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ out) {
  const int p = blockIdx.x, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const T* A = a + 256 * p;
  const T* B = b + 128 * p;
  auto at = [&](int r, int c) { return cp_to_f32(A[16 * r + c]); };
  auto bt = [&](int k, int n) { return cp_to_f32(B[8 * k + n]); };
  uint32_t af[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i & 1), c = 2 * t + 8 * (i >> 1);
    af[i] = cp_pack2<T>(at(r, c), at(r, c + 1));
  }
  const uint32_t b0 = cp_pack2<T>(bt(2 * t, g), bt(2 * t + 1, g));
  const uint32_t b1 = cp_pack2<T>(bt(2 * t + 8, g), bt(2 * t + 9, g));
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  cp_mma16816<T>(d, af, b0, b1);
#pragma unroll
  for (int r = 0; r < 4; ++r) out[(p * 32 + lane) * 4 + r] = d[r];
}

// ---- ldmatrix -----------------------------------------------------------------------------------
// probe_ldsm: grid 1, block 32, dynamic shared memory 16 * PROBE_LDSM_DPB = 768 bytes (dynamic
// rather than a static __shared__ array in both probes: the emulator maps static arrays by address
// range, and one ending where another starts was mapped to the wrong one). A 16 x 16 tile of 16-bit codes (row << 8) | col in shared memory,
// rows (16 + 8) * 2 = 48 bytes apart (padded like the kernels' (D + 8) * 2 rows). Four loads, each
// writing r[0..3] of every lane to out[(v * 32 + lane) * 4 + r]: v = 0 x4 at pipe_off_a, 1 x4.trans
// at pipe_off_a, 2 x4 at pipe_off_b, 3 x4.trans at pipe_off_b.
#define PROBE_LDSM_DPB 48
extern "C" __global__ void probe_ldsm(unsigned int* __restrict__ out) {
  CP_DYN_SMEM(uint16_t, tile);
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < 16 * PROBE_LDSM_DPB / 2; e += 32) {
    const int r = e / (PROBE_LDSM_DPB / 2), c = e % (PROBE_LDSM_DPB / 2);
    tile[e] = c < 16 ? (uint16_t)((r << 8) | c) : (uint16_t)0xFFFF;
  }
  __syncthreads();
  const uint32_t base = cp_smem_u32(tile);
  uint32_t r[4];
  for (int v = 0; v < 4; ++v) {
    const uint32_t addr = base + (v < 2 ? pipe_off_a(lane, PROBE_LDSM_DPB) : pipe_off_b(lane, PROBE_LDSM_DPB));
    if (v & 1)
      cp_ldsm_x4_trans(r, addr);
    else
      cp_ldsm_x4(r, addr);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[(v * 32 + lane) * 4 + i] = r[i];
  }
}

// ---- cp.async -----------------------------------------------------------------------------------
// probe_cp_async: grid 1, block 64, dynamic shared memory 2048 bytes. src holds 128 chunks of 16 bytes (4 words each). Shared memory
// holds 128 chunks, first filled with 0xFFFFFFFF (poison) by plain stores. Thread i then issues
// group 0: chunk i <- src chunk i, zero-fill (src-size 0) when i % 4 == 3; commit;
// group 1: chunk 64 + i <- src chunk 64 + i, zero-fill when i % 5 == 0; commit;
// cp.async.wait_group 1 (group 0 complete): out_early[i] = 1 if this thread's chunk i already
// holds what group 0 wrote (its own copy is visible to it after the wait), else 0;
// cp.async.wait_group 0, barrier, then every chunk is written to out (128 * 4 words).
extern "C" __global__ void probe_cp_async(const unsigned int* __restrict__ src, unsigned int* __restrict__ out,
                                          unsigned int* __restrict__ out_early) {
  CP_DYN_SMEM(uint32_t, buf);  // 128 chunks of 4 words
  const int i = threadIdx.x;
  for (int w = 0; w < 8; ++w) buf[i * 8 + w] = 0xFFFFFFFFu;
  __syncthreads();
  const uint32_t base = cp_smem_u32(buf);
  const bool v0 = i % 4 != 3, v1 = i % 5 != 0;
  cp_async16(base + (uint32_t)(i * 16), v0 ? src + i * 4 : src, v0);
  cp_async_commit();
  cp_async16(base + (uint32_t)((64 + i) * 16), v1 ? src + (64 + i) * 4 : src, v1);
  cp_async_commit();
  cp_async_wait<1>();
  bool early = true;
  for (int w = 0; w < 4; ++w) early = early && buf[i * 4 + w] == (v0 ? src[i * 4 + w] : 0u);
  out_early[i] = early ? 1u : 0u;
  cp_async_wait<0>();
  __syncthreads();
  for (int w = 0; w < 8; ++w) out[i * 8 + w] = buf[i * 8 + w];
}

// ---- entry points -------------------------------------------------------------------------------
#define PROBE_MMA(NAME, TY)                                                                            \
  extern "C" __global__ void probe_mma16816_##NAME(const TY* a, const TY* b, float* out) {             \
    probe_mma<TY>(a, b, out);                                                                          \
  }
PROBE_MMA(bf16, __nv_bfloat16)
PROBE_MMA(f16, __half)
