// Mixture-of-experts routing on the device: each token's top K experts from its router
// probabilities, so that only the [N, K] choices travel to the host (not the [N, E] probabilities).
// Rust caller: candle_cp_kernels::moe::top_k (src/moe.rs), the CUDA path of
//   candle_cp_ops::moe::Routing::top_k.
// CPU reference: candle_cp_ops::moe::top_k_rows (the same choices: by falling probability in
//   f32's total order, ties by the lower expert index); emu/check_moe.cpp, gpu_check --sections moe.
//
// One warp per token (row), 4 rows per block. Expert e of a row belongs to lane e % 32 (slot
// e / 32 of that lane's bit mask of experts already chosen, so E <= 1024). K rounds: each lane
// takes the best of its experts not yet chosen as one 64-bit key (the probability's total-order
// bits above, the complement of the index below: the larger key is the higher probability, then
// the lower index), the warp takes the maximum by shuffles, lane 0 writes it, the owning lane
// marks it. A row holding a value that is not finite is not routed: its slot 0 gets E + e, e the
// first such expert (the caller reports it; the other slots are left as they are).
#include "common.cuh"

// f32 bits in an order that, compared as unsigned, is f32's total order (Rust's f32::total_cmp):
// negatives (sign bit set) reversed below the positives, -0 below +0.
__device__ __forceinline__ uint32_t cp_total_order_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Not NaN and not infinite: the exponent bits are not all ones.
__device__ __forceinline__ bool cp_finite(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return (b & 0x7F800000u) != 0x7F800000u;
}

template <typename T>
__device__ __forceinline__ void top_k_rows(const T* probs, uint32_t* out, int N, int E, int K) {
  const int row = blockIdx.x * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* p = probs + (size_t)row * E;
  // the first expert whose probability is not finite (E if none)
  int bad = E;
  for (int e = lane; e < E; e += 32) {
    if (!cp_finite(cp_to_f32(p[e]))) {
      bad = e;
      break;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) bad = min(bad, __shfl_xor_sync(CP_FULL_MASK, bad, o));
  if (bad < E) {
    if (lane == 0) out[(size_t)row * K] = (uint32_t)(E + bad);
    return;
  }
  uint32_t taken = 0;  // bit j: expert lane + 32 j already chosen
  for (int r = 0; r < K; ++r) {
    unsigned long long best = 0;
    for (int e = lane, j = 0; e < E; e += 32, ++j) {
      if (taken & (1u << j)) continue;
      const unsigned long long key =
          ((unsigned long long)cp_total_order_bits(cp_to_f32(p[e])) << 32) | (unsigned long long)(0xFFFFFFFFu - (uint32_t)e);
      best = key > best ? key : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      // (two 32-bit shuffles: what a 64-bit one compiles to)
      const uint32_t hi = __shfl_xor_sync(CP_FULL_MASK, (uint32_t)(best >> 32), o);
      const uint32_t lo = __shfl_xor_sync(CP_FULL_MASK, (uint32_t)(best & 0xFFFFFFFFull), o);
      const unsigned long long other = ((unsigned long long)hi << 32) | lo;
      best = other > best ? other : best;
    }
    const uint32_t e = 0xFFFFFFFFu - (uint32_t)(best & 0xFFFFFFFFull);
    if ((int)(e % 32) == lane) taken |= 1u << (e / 32);
    if (lane == 0) out[(size_t)row * K + r] = e;
  }
}

// moe_top_k_{f32,f16,bf16}(probs [N, E], out [N, K] u32, N, E, K); E <= 1024, 1 <= K <= E.
// Launch: grid (ceil(N / 4)), block 128.
#define TOP_K_ENTRY(NAME, TY)                                                                        \
  extern "C" __global__ void moe_top_k_##NAME(const TY* probs, uint32_t* out, int N, int E, int K) { \
    top_k_rows<TY>(probs, out, N, E, K);                                                             \
  }
TOP_K_ENTRY(f32, float)
TOP_K_ENTRY(f16, __half)
TOP_K_ENTRY(bf16, __nv_bfloat16)
