// Grouped matrix products of a mixture of experts: every expert's rows in one launch, where the
// per-expert path runs one cuBLAS GEMM (and a narrow, a cat or a stack) per expert.
// Rust caller: candle_cp_kernels::grouped_gemm (src/grouped_gemm.rs), the CUDA path of
//   candle_cp_ops::moe_gemm::{gmm, gmm_dx, gmm_dw} (grouped_matmul and its bias, their backward,
//   grouped_matmul_update's node).
// CPU reference: the same functions' per-expert path (candle matmuls of each expert's rows),
//   candle_cp_ops::moe::grouped_matmul_slow; emu/check_grouped.cpp (float64 reference),
//   gpu_check --sections grouped.
//
// The rows of x [Mrows, in] are grouped by expert: expert e owns rows offs[e] .. offs[e + 1].
//   nt (forward):  y[r, o]     = sum_i x[r, i] * w[e(r), o, i]  (+ bias[e(r), o - col0])   w [E, out, in]
//   nn (dx):       dx[r, i]    = sum_o dy[r, o] * w[e(r), o, i]
//   tn (dW):       dw[e, o, i] = sum_{r of e} dy[r, o] * x[r, i]   (0 for an expert without rows)
// One block computes a 64 x 64 tile of C over k steps of 32, 128 threads: a step loads the A tile
// (64 rows x 32 k) and the B tile (64 columns x 32 k) into shared memory, k contiguous in both
// (sources with the k dimension strided are transposed on the way in), then f16 / bf16 run
// mma.sync m16n8k16 on ldmatrix fragments (4 warps as 2 x 2, 32 x 32 each: 2 x 4 tiles of 16 x 8) and f32 runs on CUDA
// cores (a thread: rows tr + 8i, columns tc + 16j, tr = tid / 16, tc = tid % 16). f32 accumulation,
// one rounding into the output type (the bias added before it).
// nt and nn blocks walk a tile list (blockIdx.x: tiles[2b] = expert, tiles[2b + 1] = first row,
// 64 rows per tile at most, built on the host from the counts); tn blocks take blockIdx.z = expert
// and run k over its rows. `vec` (host-checked: in, out and every base offset multiples of
// 16 / sizeof(T) elements): global loads as 16-byte vectors, else element by element.
#include "common.cuh"

constexpr int GG_BM = 64;       // tile rows (C's m)
constexpr int GG_BN = 64;       // tile columns (C's n)
constexpr int GG_BK = 32;       // k per step
constexpr int GG_THREADS = 128;

// Shared row length: f32 33 (odd: the CUDA-core reads of 16 consecutive rows hit 16 banks);
// 16-bit 40 (even, for 32-bit fragment reads; 20 words a row: the 8 rows x 4 pairs of an mma
// fragment hit 32 banks).
template <typename T> struct GgLd {
  static constexpr int LD = sizeof(T) == 4 ? GG_BK + 1 : GG_BK + 8;
};

// s[r][k] = source element (r, k) for r < 64, k < 32: src[r * ld + k] when KC (k contiguous),
// else src[k * ld + r]; r >= r_lim or k >= k_lim read as 0. vec: 16-byte loads (r_lim, or k_lim
// and ld, multiples of the vector where the loads run, and src aligned: the host's check).
template <typename T, bool KC>
__device__ __forceinline__ void gg_load(T (*s)[GgLd<T>::LD], const T* src, long long ld, int r_lim, int k_lim, int vec) {
  constexpr int VE = 16 / sizeof(T);  // elements in a 16-byte vector
  const int tid = threadIdx.x;
  if (vec) {
    // GG_BM * GG_BK / VE vectors, consecutive threads along the contiguous dimension
    for (int v = tid; v < GG_BM * GG_BK / VE; v += GG_THREADS) {
      int r, k;
      if (KC) {
        r = v / (GG_BK / VE);
        k = (v % (GG_BK / VE)) * VE;
      } else {
        r = (v % (GG_BM / VE)) * VE;
        k = v / (GG_BM / VE);
      }
      union {
        uint4 u;
        T t[VE];
      } val;  // (a union: the host emulation's g++ keeps strict aliasing)
      val.u = make_uint4(0u, 0u, 0u, 0u);  // all-zero bits: 0 in every dtype
      if (r < r_lim && k < k_lim) {
        const T* p = KC ? src + (long long)r * ld + k : src + (long long)k * ld + r;
        val.u = *reinterpret_cast<const uint4*>(p);
      }
#pragma unroll
      for (int j = 0; j < VE; ++j) {
        if (KC) s[r][k + j] = val.t[j];
        else s[r + j][k] = val.t[j];
      }
    }
  } else {
    for (int idx = tid; idx < GG_BM * GG_BK; idx += GG_THREADS) {
      const int r = KC ? idx / GG_BK : idx % GG_BM;
      const int k = KC ? idx % GG_BK : idx / GG_BM;
      T val = cp_from_f32<T>(0.f);
      if (r < r_lim && k < k_lim) val = KC ? src[(long long)r * ld + k] : src[(long long)k * ld + r];
      s[r][k] = val;
    }
  }
}

// The accumulators of one thread: 32 floats (mma: [mi][ni][4] of 2 x 4 tiles; CUDA cores: [i][j]
// of rows tr + 8i, columns tc + 16j).
struct GgAcc {
  float v[32];
};

// acc += A_s * B_s^T over one 32-k step (A_s [64 m][32 k], B_s [64 n][32 k]).
template <typename T>
__device__ __forceinline__ void gg_step(GgAcc& acc, const T (*as)[GgLd<T>::LD], const T (*bs)[GgLd<T>::LD]) {
  const int tid = threadIdx.x;
  if constexpr (sizeof(T) == 4) {
    const int tr = tid / 16, tc = tid % 16;
#pragma unroll 4
    for (int k = 0; k < GG_BK; ++k) {
      float a[8], b[4];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = cp_to_f32(as[tr + 8 * i][k]);
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = cp_to_f32(bs[tc + 16 * j][k]);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc.v[i * 4 + j] = fmaf(a[i], b[j], acc.v[i * 4 + j]);
    }
  } else {
    // fragments by ldmatrix.x4 (rows of 80 bytes: the 8 rows of a matrix hit 32 distinct banks):
    // A's 16 x 16 tile as matrices (rows +0 / +8) x (k +0 / +8) = a[0..3]; B's two 8-column
    // tiles ni, ni + 1 as (k +0 / +8) x (columns +0 / +8) = b0, b1 of ni, then of ni + 1. Lane l
    // gives row l % 8 of matrix l / 8.
    const int lane = tid % 32, w = tid / 32, mat = lane / 8, row = lane % 8;
    const int m0 = (w / 2) * 32, n0 = (w % 2) * 32;
#pragma unroll
    for (int kk = 0; kk < GG_BK; kk += 16) {
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) cp_ldsm_x4(a[mi], cp_smem_u32(&as[m0 + mi * 16 + (mat % 2) * 8 + row][kk + (mat / 2) * 8]));
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        cp_ldsm_x4(b, cp_smem_u32(&bs[n0 + np * 16 + (mat / 2) * 8 + row][kk + (mat % 2) * 8]));
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          cp_mma16816<T>(&acc.v[(mi * 4 + 2 * np) * 4], a[mi], b[0], b[1]);
          cp_mma16816<T>(&acc.v[(mi * 4 + 2 * np + 1) * 4], a[mi], b[2], b[3]);
        }
      }
    }
  }
}

// Calls f(m, n, value) for each accumulator of this thread (tile coordinates, m < 64, n < 64).
template <typename T, typename F> __device__ __forceinline__ void gg_each(const GgAcc& acc, F f) {
  const int tid = threadIdx.x;
  if constexpr (sizeof(T) == 4) {
    const int tr = tid / 16, tc = tid % 16;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) f(tr + 8 * i, tc + 16 * j, acc.v[i * 4 + j]);
  } else {
    const int lane = tid % 32, w = tid / 32, g = lane / 4, t = lane % 4;
    const int m0 = (w / 2) * 32, n0 = (w % 2) * 32;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const float* d = &acc.v[(mi * 4 + ni) * 4];
        const int m = m0 + mi * 16 + g, n = n0 + ni * 8 + 2 * t;
        f(m, n, d[0]);
        f(m, n + 1, d[1]);
        f(m + 8, n, d[2]);
        f(m + 8, n + 1, d[3]);
      }
  }
}

// C tile [64 m][64 n] = sum over k < k_len of A(m, k) * B(k, n): A(m, k) from a (k contiguous
// when AKC, row / k stride lda), B(k, n) = b's element (n, k) (k contiguous when BKC, stride
// ldb); m < m_lim and n < n_lim are the tile's valid rows / columns.
template <typename T, bool AKC, bool BKC>
__device__ __forceinline__ void gg_tile(GgAcc& acc, const T* a, long long lda, const T* b, long long ldb, int m_lim, int n_lim,
                                        int k_len, int vec) {
  __shared__ __align__(16) T as[GG_BM][GgLd<T>::LD];
  __shared__ __align__(16) T bs[GG_BN][GgLd<T>::LD];
  CP_EMU_POISON(as, bs);
#pragma unroll
  for (int j = 0; j < 32; ++j) acc.v[j] = 0.f;
  for (int k0 = 0; k0 < k_len; k0 += GG_BK) {
    const int kl = min(GG_BK, k_len - k0);
    gg_load<T, AKC>(as, AKC ? a + k0 : a + (long long)k0 * lda, lda, m_lim, kl, vec);
    gg_load<T, BKC>(bs, BKC ? b + k0 : b + (long long)k0 * ldb, ldb, n_lim, kl, vec);
    __syncthreads();
    gg_step<T>(acc, as, bs);
    __syncthreads();
  }
}

// Forward: y[r, :] = x[r, :] w[e]^T (+ bias). Grid (tiles, ceil(n / 64)).
template <typename T>
__device__ __forceinline__ void gg_nt(const T* x, const T* w, const T* bias, T* y, const uint32_t* offs, const uint32_t* tiles,
                                      int n, int k, int col0, int nb, int vec) {
  const int e = (int)tiles[2 * blockIdx.x];
  const long long r0 = tiles[2 * blockIdx.x + 1];
  const int rows = (int)min((long long)GG_BM, (long long)offs[e + 1] - r0);
  const int n0 = blockIdx.y * GG_BN;
  GgAcc acc;
  gg_tile<T, true, true>(acc, x + r0 * k, k, w + ((long long)e * n + n0) * k, k, rows, n - n0, k, vec);
  const T* be = bias + (long long)e * nb;  // this expert's bias, column col0 first
  const int c1 = col0 + nb;
  gg_each<T>(acc, [=]  /* (by value: by reference ptxas spilled 8 bytes on sm_80) */(int m, int c, float v) {
    const int col = n0 + c;
    if (m < rows && col < n) {
      const float bv = col >= col0 && col < c1 ? cp_to_f32(be[col - col0]) : 0.f;
      y[(r0 + m) * n + col] = cp_from_f32<T>(v + bv);
    }
  });
}

// dx[r, :] = dy[r, :] w[e]: A = dy (k = out contiguous), B(k, n) = w[e][k][n] (n contiguous).
// Grid (tiles, ceil(n / 64)), n = in, k = out.
template <typename T>
__device__ __forceinline__ void gg_nn(const T* dy, const T* w, T* dx, const uint32_t* offs, const uint32_t* tiles, int n, int k,
                                      int vec) {
  const int e = (int)tiles[2 * blockIdx.x];
  const long long r0 = tiles[2 * blockIdx.x + 1];
  const int rows = (int)min((long long)GG_BM, (long long)offs[e + 1] - r0);
  const int n0 = blockIdx.y * GG_BN;
  GgAcc acc;
  gg_tile<T, true, false>(acc, dy + r0 * k, k, w + (long long)e * k * n + n0, n, rows, n - n0, k, vec);
  gg_each<T>(acc, [&](int m, int c, float v) {
    if (m < rows && n0 + c < n) dx[(r0 + m) * n + n0 + c] = cp_from_f32<T>(v);
  });
}

// dw[e] = dy_e^T x_e: A(m, k) = dy[offs[e] + k][m] (m = out contiguous), B(k, n) = x[offs[e] + k][n]
// (n = in contiguous). Grid (ceil(n / 64), ceil(m / 64), E).
template <typename T>
__device__ __forceinline__ void gg_tn(const T* dy, const T* x, T* dw, const uint32_t* offs, int m, int n, int vec) {
  const int e = blockIdx.z;
  const long long r0 = offs[e];
  const int k_len = (int)((long long)offs[e + 1] - r0);
  const int m0 = blockIdx.y * GG_BM, n0 = blockIdx.x * GG_BN;
  GgAcc acc;
  gg_tile<T, false, false>(acc, dy + r0 * m + m0, m, x + r0 * n + n0, n, m - m0, n - n0, k_len, vec);
  gg_each<T>(acc, [&](int mm, int c, float v) {
    if (m0 + mm < m && n0 + c < n) dw[((long long)e * m + m0 + mm) * n + n0 + c] = cp_from_f32<T>(v);
  });
}

// grouped_gemm_{nt,nn,tn}_{f32,f16,bf16}. Block 128 threads; grids as above.
#define GG_ENTRIES(NAME, TY)                                                                                          \
  extern "C" __global__ void __launch_bounds__(GG_THREADS)                                                          \
      grouped_gemm_nt_##NAME(const TY* x, const TY* w, const TY* bias, TY* y, const uint32_t* offs,                   \
                             const uint32_t* tiles, int n, int k, int col0, int nb, int vec) {                      \
    gg_nt<TY>(x, w, bias, y, offs, tiles, n, k, col0, nb, vec);                                                      \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(GG_THREADS)                                                          \
      grouped_gemm_nn_##NAME(const TY* dy, const TY* w, TY* dx, const uint32_t* offs, const uint32_t* tiles, int n, \
                             int k, int vec) {                                                                       \
    gg_nn<TY>(dy, w, dx, offs, tiles, n, k, vec);                                                                    \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(GG_THREADS)                                                          \
      grouped_gemm_tn_##NAME(const TY* dy, const TY* x, TY* dw, const uint32_t* offs, int m, int n, int vec) {      \
    gg_tn<TY>(dy, x, dw, offs, m, n, vec);                                                                           \
  }
GG_ENTRIES(f32, float)
GG_ENTRIES(f16, __half)
GG_ENTRIES(bf16, __nv_bfloat16)
