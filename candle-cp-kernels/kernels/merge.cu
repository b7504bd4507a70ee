// Ring-step merge of partial attention results over disjoint key sets, in f32.
// Rust caller: candle_cp_kernels::merge::{merge, merge_rows_inplace, add_rows_inplace, cast_out}
//   (src/merge.rs);
//   `merge` is the CUDA path of candle_cp_ops::attention::merge, `merge_rows_inplace` the
//   CUDA path of the ring's running state (candle_cp_ops::cp::state::LocalState: f32
//   accumulator kept across steps, cast to the model dtype once at the end).
// CPU reference: candle_cp_ops::attention::merge (and LocalState's host form).
//
//   lse = log(exp(la) + exp(lb)),  o = exp(la - lse) * oa + exp(lb - lse) * ob.
// -inf safe: when both LSEs are -inf the row stays (0, -inf).
#include "common.cuh"

// One warp per (b, i, h) row of the block: the block's rows i < n are rows row0 + i of a state of
// T_ rows. acc_o f32 [B, T_, H, D], acc_lse f32 [B, H, T_]; blk_o [B, n, H, D] (type T), blk_lse
// f32 [B, H, n]; new_o / new_lse have acc's layout and may alias acc_* (every element is read
// and written by one thread; the row's lse is read by all lanes before lane 0 writes it).
template <typename T>
__device__ __forceinline__ void merge_rows(const float* acc_o, const float* acc_lse, const T* blk_o,
                                           const float* blk_lse, float* new_o, float* new_lse, int B,
                                           int T_, int row0, int n, int H, int D) {
  size_t row = (size_t)blockIdx.x * 4 + threadIdx.x / 32;  // row = (b * n + i) * H + h
  int lane = threadIdx.x % 32;
  if (row >= (size_t)B * n * H) return;
  int h = row % H;
  size_t bi = row / H;
  int i = bi % n, b = bi / n;
  size_t la_i = ((size_t)b * H + h) * T_ + row0 + i, lb_i = ((size_t)b * H + h) * n + i;
  float la = acc_lse[la_i], lb = blk_lse[lb_i];
  float mx = fmaxf(la, lb);
  float wa = 0.f, wb = 0.f, lse = -INFINITY;
  if (mx != -INFINITY) {
    float ea = __expf(la - mx), eb = __expf(lb - mx);
    float sum = ea + eb;
    lse = mx + __logf(sum);
    wa = ea / sum;
    wb = eb / sum;
  }
  const size_t ao = (((size_t)b * T_ + row0 + i) * H + h) * D, bo = row * D;
  for (int d = lane; d < D; d += 32) new_o[ao + d] = wa * acc_o[ao + d] + wb * cp_to_f32(blk_o[bo + d]);
  __syncwarp();
  if (lane == 0) new_lse[la_i] = lse;
}

// merge_step_*: the whole state (n = T_, row0 = 0) into new_o / new_lse (may alias acc_*).
// Launch: grid (ceil(B*T*H / 4)), block 128.
#define MERGE_ENTRY(NAME, TY)                                                                                \
  extern "C" __global__ void merge_step_##NAME(const float* acc_o, const float* acc_lse, const TY* blk_o,  \
                                               const float* blk_lse, float* new_o, float* new_lse, int B,   \
                                               int T_, int H, int D) {                                      \
    merge_rows<TY>(acc_o, acc_lse, blk_o, blk_lse, new_o, new_lse, B, T_, 0, T_, H, D);                     \
  }
MERGE_ENTRY(f32, float)
MERGE_ENTRY(f16, __half)
MERGE_ENTRY(bf16, __nv_bfloat16)

// merge_rows_inplace_*: block rows [row0, row0 + n) into a state held in one f32 buffer `st`:
// out [B, T_, H, D] at st, lse [B, H, T_] at st + B*T_*H*D, updated in place.
// Launch: grid (ceil(B*n*H / 4)), block 128.
#define MERGE_ROWS_ENTRY(NAME, TY)                                                                          \
  extern "C" __global__ void merge_rows_inplace_##NAME(float* st, const TY* blk_o, const float* blk_lse,    \
                                                       int B, int T_, int row0, int n, int H, int D) {      \
    float* st_lse = st + (size_t)B * T_ * H * D;                                                            \
    merge_rows<TY>(st, st_lse, blk_o, blk_lse, st, st_lse, B, T_, row0, n, H, D);                           \
  }
MERGE_ROWS_ENTRY(f32, float)
MERGE_ROWS_ENTRY(f16, __half)
MERGE_ROWS_ENTRY(bf16, __nv_bfloat16)

// add_rows_inplace_*: the ring backward's f32 gradient accumulators (dQ of the local rows, dK / dV
// of a K/V chunk; candle_cp_ops::cp::state::RowAccum, CPU reference: its host form). acc [P, B, R,
// HD] f32, rows [row0, row0 + n) of plane `plane` += x [B, n, HD] (type T), in place.
// Launch: grid-stride, any grid; block 256.
#define ADD_ROWS_ENTRY(NAME, TY)                                                                           \
  extern "C" __global__ void add_rows_inplace_##NAME(float* acc, const TY* x, int B, int R, int plane,     \
                                                     int row0, int n, long long hd) {                      \
    const size_t total = (size_t)B * n * hd;                                                               \
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;                              \
         e += (size_t)gridDim.x * blockDim.x) {                                                            \
      const size_t c = e % hd, r = e / hd, i = r % n, b = r / n;                                           \
      acc[(((size_t)plane * B + b) * R + row0 + i) * hd + c] += cp_to_f32(x[e]);                           \
    }                                                                                                      \
  }
ADD_ROWS_ENTRY(f32, float)
ADD_ROWS_ENTRY(f16, __half)
ADD_ROWS_ENTRY(bf16, __nv_bfloat16)

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
