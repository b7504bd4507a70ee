// Shared helpers for the candle-cp kernels: dtype conversions, warp reductions, tensor-core MMA.
// Included by every .cu file of candle-cp-kernels; not a kernel itself.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define CP_FULL_MASK 0xffffffffu
#define CP_LOG2E 1.4426950408889634f
#define CP_LN2 0.6931471805599453f

// ---- dtype conversions --------------------------------------------------------------------
__device__ __forceinline__ float cp_to_f32(float x) { return x; }
__device__ __forceinline__ float cp_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float cp_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T cp_from_f32(float x);
template <> __device__ __forceinline__ float cp_from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half cp_from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 cp_from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats -> one 32-bit register holding two 16-bit values, the first in the low half
// (the element with the lower column index, as mma.sync expects).
template <typename T> __device__ __forceinline__ uint32_t cp_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t cp_pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t cp_pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- warp reductions ------------------------------------------------------------------------
__device__ __forceinline__ float cp_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(CP_FULL_MASK, x, o);
  return x;
}
__device__ __forceinline__ float cp_warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(CP_FULL_MASK, x, o));
  return x;
}
// Reductions over the 4 lanes of an MMA quad (lanes 4g .. 4g+3 share a row).
__device__ __forceinline__ float cp_quad_sum(float x) {
  x += __shfl_xor_sync(CP_FULL_MASK, x, 1);
  x += __shfl_xor_sync(CP_FULL_MASK, x, 2);
  return x;
}
__device__ __forceinline__ float cp_quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(CP_FULL_MASK, x, 1));
  x = fmaxf(x, __shfl_xor_sync(CP_FULL_MASK, x, 2));
  return x;
}

// ---- masks ------------------------------------------------------------------------------------
// Mirror of `candle_cp_ops::attention::Mask`: query row i sits at global position
// q_off + i * q_str, key row j at k_off + j * k_str; causal means key pos <= query pos.
struct CpMask {
  int causal;
  long long q_off, q_str, k_off, k_str;
  __device__ __forceinline__ long long qpos(long long i) const { return q_off + i * q_str; }
  __device__ __forceinline__ long long kpos(long long j) const { return k_off + j * k_str; }
  __device__ __forceinline__ bool visible(long long i, long long j) const {
    return !causal || kpos(j) <= qpos(i);
  }
  // Number of leading keys (of s) that any query at position <= qp_max can see.
  __device__ __forceinline__ int key_end(long long qp_max, int s) const {
    if (!causal) return s;
    if (qp_max < k_off) return 0;
    long long n = (qp_max - k_off) / k_str + 1;
    return n < (long long)s ? (int)n : s;
  }
  // First query row (of t) whose position is >= kp_min (rows before it see no key at >= kp_min).
  __device__ __forceinline__ int query_begin(long long kp_min, int t) const {
    if (!causal || kp_min <= q_off) return 0;
    long long n = (kp_min - q_off + q_str - 1) / q_str;
    return n < (long long)t ? (int)n : t;
  }
};

// ---- tensor cores -----------------------------------------------------------------------------
// D = A * B + D for one m16n8k16 tile, f32 accumulate. Fragment layout (g = lane / 4, t = lane % 4):
//   a[0]: A[g][2t..2t+1]  a[1]: A[g+8][2t..2t+1]  a[2]: A[g][2t+8..]  a[3]: A[g+8][2t+8..]
//   b[0]: B[2t..2t+1][g]  b[1]: B[2t+8..2t+9][g]
//   d[0], d[1]: D[g][2t], D[g][2t+1]   d[2], d[3]: D[g+8][2t], D[g+8][2t+1]
template <typename T> __device__ __forceinline__ void cp_mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void cp_mma16816<__nv_bfloat16>(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void cp_mma16816<__half>(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
