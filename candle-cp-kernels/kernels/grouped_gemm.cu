// Grouped matrix products of a mixture of experts: every expert's rows in one launch, where the
// per-expert path runs one cuBLAS GEMM (and a narrow, a cat or a stack) per expert.
// Rust caller: candle_cp_kernels::grouped_gemm (src/grouped_gemm.rs), the CUDA path of
//   candle_cp_ops::moe_gemm::{gmm, gmm_dx, gmm_dw} (grouped_matmul and its bias, their backward,
//   grouped_matmul_update's node).
// CPU reference: the same functions' per-expert path (candle matmuls of each expert's rows),
//   candle_cp_ops::moe::grouped_matmul_slow; emu/check_grouped.cpp (float64 reference),
//   gpu_check --sections moe.
//
// The rows of x [Mrows, in] are grouped by expert: expert e owns rows offs[e] .. offs[e + 1].
//   nt (forward):  y[r, o]     = sum_i x[r, i] * w[e(r), o, i]  (+ bias[e(r), o - col0])   w [E, out, in]
//   nn (dx):       dx[r, i]    = sum_o dy[r, o] * w[e(r), o, i]
//   tn (dW):       dw[e, o, i] = sum_{r of e} dy[r, o] * x[r, i]   (0 for an expert without rows)
// One block computes a 64 x 64 tile of C over k steps of 32, 128 threads, two shared-memory
// stages: step s + 1's A tile (64 rows x 32 k) and B tile (64 columns x 32 k) load while step s
// computes, each laid out as its source lies (k contiguous or rows contiguous: straight copies,
// cp.async for 16-bit); f16 / bf16 run mma.sync m16n8k16 on ldmatrix fragments (.trans for the
// row-contiguous layouts; 4 warps as 2 x 2, 32 x 32 each: 2 x 4 tiles of 16 x 8), f32 runs on
// CUDA cores (a thread: rows tr + 8i, columns tc + 16j, tr = tid / 16, tc = tid % 16). f32
// accumulation, one rounding into the output type (the bias added before it).
// nt and nn blocks walk a tile list (blockIdx.x: tiles[2b] = expert, tiles[2b + 1] = first row,
// 64 rows per tile at most, built on the host from the counts); tn blocks take blockIdx.z = expert
// and run k over its rows. `vec` (host-checked: in, out and every base offset multiples of
// 16 / sizeof(T) elements): global loads as 16-byte chunks, else element by element.
#include "common.cuh"

constexpr int GG_BM = 64;       // tile rows (C's m)
constexpr int GG_BN = 64;       // tile columns (C's n)
constexpr int GG_BK = 32;       // k per step
constexpr int GG_THREADS = 128;

// Shared layout of one operand's tile (64 rows x 32 k), as its source lies: KC (k contiguous in
// global memory) [64 r][LDK], else [32 k][LDR] (r contiguous), so every global load is a straight
// copy (cp.async for 16-bit). 16-bit rows of 80 / 144 bytes: multiples of 16 (cp.async, ldmatrix
// row addresses), and an ldmatrix phase's 8 rows fall in 32 distinct banks (20 / 36 words apart).
// f32 rows of 33 / 65 floats (odd: the CUDA-core reads of 16 consecutive rows or columns hit 16
// banks).
template <typename T, bool KC> struct GgOp {
  static constexpr int LDK = sizeof(T) == 4 ? GG_BK + 1 : GG_BK + 8;
  static constexpr int LDR = sizeof(T) == 4 ? GG_BM + 1 : GG_BM + 8;
  static __device__ __forceinline__ int at(int r, int k) { return KC ? r * LDK + k : k * LDR + r; }
};
// Elements of one stage's operand buffer: the larger layout (16-bit 2560 / 2304, f32 2112 / 2080).
template <typename T> struct GgSz {
  static constexpr int N = sizeof(T) == 4 ? GG_BM * (GG_BK + 1) : GG_BM * (GG_BK + 8);
};

// One operand tile into s (layout GgOp<T, KC>): element (r, k), r < 64, k < 32, is src[r * ld + k]
// when KC, else src[k * ld + r]; r >= r_lim or k >= k_lim is 0. vec: 16-byte chunks along the
// contiguous dimension (the host's check: widths, ld and src aligned to the vector), as cp.async
// for 16-bit (zero-filled past the limits; the caller commits and waits), as loads and stores for
// f32; else element by element (plain loads and stores).
template <typename T, bool KC>
__device__ __forceinline__ void gg_load(T* s, const T* src, long long ld, int r_lim, int k_lim, int vec) {
  constexpr int VE = 16 / sizeof(T);  // elements in a 16-byte chunk
  const int tid = threadIdx.x;
  if (vec) {
    // GG_BM * GG_BK / VE chunks, consecutive threads along the contiguous dimension
    for (int v = tid; v < GG_BM * GG_BK / VE; v += GG_THREADS) {
      int r, k;
      if (KC) {
        r = v / (GG_BK / VE);
        k = (v % (GG_BK / VE)) * VE;
      } else {
        r = (v % (GG_BM / VE)) * VE;
        k = v / (GG_BM / VE);
      }
      const bool ok = r < r_lim && k < k_lim;
      const T* p = ok ? (KC ? src + (long long)r * ld + k : src + (long long)k * ld + r) : src;
      if constexpr (sizeof(T) == 2) {
        cp_async16(cp_smem_u32(s + GgOp<T, KC>::at(r, k)), p, ok);
      } else {
        union {
          uint4 u;
          T t[VE];
        } val;  // (a union: the host emulation's g++ keeps strict aliasing)
        val.u = ok ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int j = 0; j < VE; ++j) s[KC ? GgOp<T, KC>::at(r, k + j) : GgOp<T, KC>::at(r + j, k)] = val.t[j];
      }
    }
  } else {
    for (int idx = tid; idx < GG_BM * GG_BK; idx += GG_THREADS) {
      const int r = KC ? idx / GG_BK : idx % GG_BM;
      const int k = KC ? idx % GG_BK : idx / GG_BM;
      T val = cp_from_f32<T>(0.f);
      if (r < r_lim && k < k_lim) val = KC ? src[(long long)r * ld + k] : src[(long long)k * ld + r];
      s[GgOp<T, KC>::at(r, k)] = val;
    }
  }
}

// The accumulators of one thread: 32 floats (mma: [mi][ni][4] of 2 x 4 tiles; CUDA cores: [i][j]
// of rows tr + 8i, columns tc + 16j).
struct GgAcc {
  float v[32];
};

// acc += A * B^T over one 32-k step: A(m, k) in as (layout GgOp<T, AKC>), B's element (n, k) in bs
// (GgOp<T, BKC>).
template <typename T, bool AKC, bool BKC>
__device__ __forceinline__ void gg_step(GgAcc& acc, const T* as, const T* bs) {
  const int tid = threadIdx.x;
  if constexpr (sizeof(T) == 4) {
    const int tr = tid / 16, tc = tid % 16;
#pragma unroll 4
    for (int k = 0; k < GG_BK; ++k) {
      float a[8], b[4];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = as[GgOp<T, AKC>::at(tr + 8 * i, k)];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = bs[GgOp<T, BKC>::at(tc + 16 * j, k)];
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc.v[i * 4 + j] = fmaf(a[i], b[j], acc.v[i * 4 + j]);
    }
  } else {
    // Fragments by ldmatrix.x4; lane l gives row l % 8 of 8 x 8 matrix l / 8. A's 16 x 16 tile:
    // matrices (m +0 / +8) x (k +0 / +8) = a[0..3]; from [m][k] rows directly, from [k][m] rows
    // transposed (.trans). B's two 8-column tiles ni, ni + 1: matrices (k +0 / +8) x (n +0 / +8)
    // = b0, b1 of ni, then of ni + 1; from [n][k] or, transposed, [k][n].
    const int lane = tid % 32, w = tid / 32, mat = lane / 8, row = lane % 8;
    const int m0 = (w / 2) * 32, n0 = (w % 2) * 32;
#pragma unroll
    for (int kk = 0; kk < GG_BK; kk += 16) {
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int mb = m0 + mi * 16 + (mat % 2) * 8, kb = kk + (mat / 2) * 8;
        if (AKC) cp_ldsm_x4(a[mi], cp_smem_u32(as + GgOp<T, true>::at(mb + row, kb)));
        else cp_ldsm_x4_trans(a[mi], cp_smem_u32(as + GgOp<T, false>::at(mb, kb + row)));
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        const int nb = n0 + np * 16 + (mat / 2) * 8, kb = kk + (mat % 2) * 8;
        if (BKC) cp_ldsm_x4(b, cp_smem_u32(bs + GgOp<T, true>::at(nb + row, kb)));
        else cp_ldsm_x4_trans(b, cp_smem_u32(bs + GgOp<T, false>::at(nb, kb + row)));
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
// ldb); m < m_lim and n < n_lim are the tile's valid rows / columns. Two stages: step s + 1's
// tiles load (cp.async for 16-bit with vec) while step s computes.
//
//   load(0) commit | load(1) commit  wait<1> sync  mma(0) sync | load(2) commit wait<1> sync mma(1) sync | ...
template <typename T, bool AKC, bool BKC>
__device__ __forceinline__ void gg_tile(GgAcc& acc, const T* a, long long lda, const T* b, long long ldb, int m_lim, int n_lim,
                                        int k_len, int vec) {
  __shared__ __align__(16) T as[2][GgSz<T>::N];
  __shared__ __align__(16) T bs[2][GgSz<T>::N];
  CP_EMU_POISON(as, bs);
#pragma unroll
  for (int j = 0; j < 32; ++j) acc.v[j] = 0.f;
  const int steps = (k_len + GG_BK - 1) / GG_BK;
  auto load = [&](int st, int k0) {
    const int kl = min(GG_BK, k_len - k0);
    gg_load<T, AKC>(as[st], AKC ? a + k0 : a + (long long)k0 * lda, lda, m_lim, kl, vec);
    gg_load<T, BKC>(bs[st], BKC ? b + k0 : b + (long long)k0 * ldb, ldb, n_lim, kl, vec);
    cp_async_commit();
  };
  if (steps > 0) load(0, 0);
  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) {
      load((s + 1) & 1, (s + 1) * GG_BK);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    gg_step<T, AKC, BKC>(acc, as[s & 1], bs[s & 1]);
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
