// Ring-step merge of partial attention results over disjoint key sets, in f32.
// Rust caller: candle_cp_kernels::merge::{merge_step, cast_out} (src/merge.rs), used by the
//   CUDA path of candle_cp_ops::attention::merge and by the ring loop (f32 accumulator kept
//   across steps, cast to the model dtype once at the end).
// CPU reference: candle_cp_ops::attention::merge.
//
// acc_o f32 [B, T, H, D], acc_lse f32 [B, H, T]: running state; blk_o [B, T, H, D] (type T),
// blk_lse f32 [B, H, T]: one step's block result. Writes new_o / new_lse (may alias acc_*):
//   lse = log(exp(la) + exp(lb)),  o = exp(la - lse) * oa + exp(lb - lse) * ob.
// -inf safe: when both LSEs are -inf the row stays (0, -inf).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void merge_step(const float* acc_o, const float* acc_lse, const T* blk_o,
                                           const float* blk_lse, float* new_o, float* new_lse, int B,
                                           int T_, int H, int D) {
  size_t row = (size_t)blockIdx.x * 4 + threadIdx.x / 32;  // row = (b * T + i) * H + h
  int lane = threadIdx.x % 32;
  if (row >= (size_t)B * T_ * H) return;
  int h = row % H;
  size_t bi = row / H;
  int i = bi % T_, b = bi / T_;
  size_t li = ((size_t)b * H + h) * T_ + i;
  float la = acc_lse[li], lb = blk_lse[li];
  float mx = fmaxf(la, lb);
  float wa = 0.f, wb = 0.f, lse = -INFINITY;
  if (mx != -INFINITY) {
    float ea = __expf(la - mx), eb = __expf(lb - mx);
    float sum = ea + eb;
    lse = mx + __logf(sum);
    wa = ea / sum;
    wb = eb / sum;
  }
  for (int d = lane; d < D; d += 32) {
    size_t gi = row * D + d;
    new_o[gi] = wa * acc_o[gi] + wb * cp_to_f32(blk_o[gi]);
  }
  __syncwarp();
  if (lane == 0) new_lse[li] = lse;
}

// Launch: grid (ceil(B*T*H / 4)), block 128.
#define MERGE_ENTRY(NAME, TY)                                                                                \
  extern "C" __global__ void merge_step_##NAME(const float* acc_o, const float* acc_lse, const TY* blk_o,  \
                                               const float* blk_lse, float* new_o, float* new_lse, int B,   \
                                               int T_, int H, int D) {                                      \
    merge_step<TY>(acc_o, acc_lse, blk_o, blk_lse, new_o, new_lse, B, T_, H, D);                            \
  }
MERGE_ENTRY(f32, float)
MERGE_ENTRY(f16, __half)
MERGE_ENTRY(bf16, __nv_bfloat16)

// Final cast of the f32 accumulator to the model dtype (once, after the last ring step).
// Launch: grid-stride, any grid; block 256.
#define CAST_ENTRY(NAME, TY)                                                                       \
  extern "C" __global__ void cast_out_##NAME(const float* src, TY* dst, size_t n) {               \
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;                         \
         e += (size_t)gridDim.x * blockDim.x)                                                     \
      dst[e] = cp_from_f32<TY>(src[e]);                                                           \
  }
CAST_ENTRY(f32, float)
CAST_ENTRY(f16, __half)
CAST_ENTRY(bf16, __nv_bfloat16)
