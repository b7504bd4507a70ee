// Dropout keep masks on the device, from the counter-based streams of candle_cp_nn::RngStreams:
// the scaled mask (0 or 1 / (1 - p)) of rows whose global indices are given, so that no uniform
// value is drawn on the host and copied over (a [tokens, features] f32 tensor per mask).
// Rust caller: candle_cp_kernels::dropout::keep_mask (src/dropout.rs), the CUDA path of
//   candle_cp_nn::RngStreams::keep_mask_rows (LoRA dropout, candle_cp_nn::lora_dropout) and of
//   candle_cp_nn::Dropout::mask (SP dropout regions).
// CPU reference: candle_cp_nn::RngStreams::uniform_rows, then `u >= p`, times the scale, cast
//   (bit for bit: the hash is integer arithmetic, u = (h >> 40) * 2^-24 is exact in f32);
//   emu/check_dropout.cpp, gpu_check --sections dropout.
//
//   element (r, j):  g = rows[r] * total_cols + col0 + j,  h = splitmix64(key ^ splitmix64(g)),
//                    u = (h >> 40) * 2^-24,  out = u >= p ? scale : 0   (scale rounded to T)
// Grid-stride loop over the n_rows * cols elements, one each.
#include "common.cuh"

__device__ __forceinline__ unsigned long long cp_splitmix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__device__ __forceinline__ void keep_mask(const long long* rows, long long n_rows, unsigned long long key,
                                          unsigned long long col0, long long cols, unsigned long long total_cols, float p,
                                          float scale, T* out) {
  const long long n = n_rows * cols;
  const T on = cp_from_f32<T>(scale), off = cp_from_f32<T>(0.f);
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
    const long long r = e / cols, j = e % cols;
    const unsigned long long g = (unsigned long long)rows[r] * total_cols + col0 + (unsigned long long)j;
    const unsigned long long h = cp_splitmix64(key ^ cp_splitmix64(g));
    const float u = (float)(unsigned)(h >> 40) * (1.0f / 16777216.0f);
    out[e] = u >= p ? on : off;
  }
}

// dropout_keep_{f32,f16,bf16}(rows [n_rows] i64 (>= 0), n_rows, key, col0, cols, total_cols, p, scale,
// out [n_rows, cols]). Launch: grid (min(ceil(n / 256), 65535)), block 256.
#define KEEP_ENTRY(NAME, TY)                                                                                  \
  extern "C" __global__ void dropout_keep_##NAME(const long long* rows, long long n_rows,                    \
                                                 unsigned long long key, unsigned long long col0, long long cols, \
                                                 unsigned long long total_cols, float p, float scale, TY* out) { \
    keep_mask<TY>(rows, n_rows, key, col0, cols, total_cols, p, scale, out);                                 \
  }
KEEP_ENTRY(f32, float)
KEEP_ENTRY(f16, __half)
KEEP_ENTRY(bf16, __nv_bfloat16)
