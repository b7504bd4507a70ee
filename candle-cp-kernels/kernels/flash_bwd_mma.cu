// Flash-attention backward on tensor cores (mma.sync m16n8k16, f16/bf16 in, f32 accumulate).
// Rust caller: candle_cp_kernels::flash::bwd (src/flash/bwd.rs) when the tensor-core path is chosen
//   (f16/bf16; `CANDLE_CP_FLASH_IMPL=simple` selects flash_bwd.cu instead).
// CPU reference: candle_cp_ops::attention::attention_bwd.
//
// Same contract as flash_bwd.cu (delta from flash_bwd_delta_f32 there): q [B, T, H, D],
// k/v [B, S, Hkv, D] (type T); dout f32 [B, T, H, D] (rounded to T on load, as FlashAttention
// keeps dO in 16 bits); lse, delta f32 [B, H, T]; dq f32 [B, T, H, D], dk/dv f32 [B, S, Hkv, D].
// P and dS are rounded to T before their products (FlashAttention-2 practice).
// Only row-major tiles in shared memory: an operand that is needed "transposed" is read as two
// 16-bit values from two rows (see the fragment layout in common.cuh).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ uint32_t cp_ld2(const T* p) {  // two consecutive elements
  return *reinterpret_cast<const uint32_t*>(p);
}
template <typename T>
__device__ __forceinline__ uint32_t cp_ld2_rows(const T* lo, const T* hi) {  // one element of two rows
  return (uint32_t)(*reinterpret_cast<const uint16_t*>(lo)) | ((uint32_t)(*reinterpret_cast<const uint16_t*>(hi)) << 16);
}

// dK, dV for 32 keys of one KV head: 2 warps x 16 keys; query tiles of 32 rows.
// Launch: grid (ceil(S/32), Hkv, B), block 64.
template <typename T, int D>
__device__ __forceinline__ void bwd_dkdv_mma(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const float* __restrict__ dout,
                                             const float* __restrict__ lse, const float* __restrict__ delta,
                                             float* __restrict__ dk, float* __restrict__ dv, int B, int T_,
                                             int S, int H, int Hkv, float scale, CpMask mask, int accumulate) {
  constexpr int BK = 32, BQ = 32, DP = D + 8, DC = D / 16, DT = D / 8;
  __shared__ __align__(16) T k_s[BK * DP], v_s[BK * DP], q_s[BQ * DP], do_s[BQ * DP];
  __shared__ float lse_s[BQ], dl_s[BQ];
  CP_EMU_POISON(k_s, v_s, q_s, do_s, lse_s, dl_s);
  const int b = blockIdx.z, kvh = blockIdx.y, k0 = blockIdx.x * BK, G = H / Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int kr = warp * 16 + g;  // tile row of this thread's first key (second: kr + 8)
  const float sl2 = scale * CP_LOG2E;
  for (int e = threadIdx.x; e < BK * D; e += blockDim.x) {
    int r = e / D, d = e % D, j = k0 + r;
    size_t gi = (((size_t)b * S + j) * Hkv + kvh) * D + d;
    k_s[r * DP + d] = j < S ? k[gi] : cp_from_f32<T>(0.f);
    v_s[r * DP + d] = j < S ? v[gi] : cp_from_f32<T>(0.f);
  }
  float acc_k[DT][4], acc_v[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[dt][e] = acc_v[dt][e] = 0.f;
  const int i_begin = mask.query_begin(mask.kpos(k0), T_);
  const int ja = k0 + kr, jb = ja + 8;

  for (int hq = kvh * G; hq < kvh * G + G; ++hq) {
    for (int i0 = i_begin; i0 < T_; i0 += BQ) {
      __syncthreads();
      for (int e = threadIdx.x; e < BQ * D; e += blockDim.x) {
        int r = e / D, d = e % D, i = i0 + r;
        size_t gi = (((size_t)b * T_ + i) * H + hq) * D + d;
        q_s[r * DP + d] = i < T_ ? q[gi] : cp_from_f32<T>(0.f);
        do_s[r * DP + d] = cp_from_f32<T>(i < T_ ? dout[gi] : 0.f);
      }
      for (int r = threadIdx.x; r < BQ; r += blockDim.x) {
        int i = i0 + r;
        size_t li = ((size_t)b * H + hq) * T_ + i;
        lse_s[r] = i < T_ ? lse[li] * CP_LOG2E : -INFINITY;
        dl_s[r] = i < T_ ? delta[li] : 0.f;
      }
      __syncthreads();
      // S^T = K Q^T and dP^T = V dO^T: rows = this warp's 16 keys, cols = 32 queries.
      float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
      for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
      for (int kc = 0; kc < DC; ++kc) {
        const int c = kc * 16 + 2 * t;
        uint32_t ka[4] = {cp_ld2(k_s + kr * DP + c), cp_ld2(k_s + (kr + 8) * DP + c), cp_ld2(k_s + kr * DP + c + 8),
                          cp_ld2(k_s + (kr + 8) * DP + c + 8)};
        uint32_t va[4] = {cp_ld2(v_s + kr * DP + c), cp_ld2(v_s + (kr + 8) * DP + c), cp_ld2(v_s + kr * DP + c + 8),
                          cp_ld2(v_s + (kr + 8) * DP + c + 8)};
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
          const T* qr = q_s + (nt * 8 + g) * DP + c;
          const T* dr = do_s + (nt * 8 + g) * DP + c;
          cp_mma16816<T>(st[nt], ka, cp_ld2(qr), cp_ld2(qr + 8));
          cp_mma16816<T>(dpt[nt], va, cp_ld2(dr), cp_ld2(dr + 8));
        }
      }
      // P^T = exp(S^T * scale - lse), dS^T = P^T (dP^T - delta) * scale (masked -> 0).
#pragma unroll
      for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int r = nt * 8 + 2 * t + (e & 1), i = i0 + r, j = e < 2 ? ja : jb;
          bool vis = i < T_ && j < S && mask.visible(i, j) && lse_s[r] != -INFINITY;
          float p = vis ? exp2f(st[nt][e] * sl2 - lse_s[r]) : 0.f;
          st[nt][e] = p;
          dpt[nt][e] = p * (dpt[nt][e] - dl_s[r]) * scale;
        }
      // dV += P^T dO, dK += dS^T Q: k = query (two chunks of 16), n = d.
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {
        uint32_t pa[4] = {cp_pack2<T>(st[2 * kk][0], st[2 * kk][1]), cp_pack2<T>(st[2 * kk][2], st[2 * kk][3]),
                          cp_pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]), cp_pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
        uint32_t da[4] = {cp_pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]), cp_pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]),
                          cp_pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                          cp_pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
        const int r0 = kk * 16 + 2 * t;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          const int col = dt * 8 + g;
          cp_mma16816<T>(acc_v[dt], pa, cp_ld2_rows(do_s + r0 * DP + col, do_s + (r0 + 1) * DP + col),
                         cp_ld2_rows(do_s + (r0 + 8) * DP + col, do_s + (r0 + 9) * DP + col));
          cp_mma16816<T>(acc_k[dt], da, cp_ld2_rows(q_s + r0 * DP + col, q_s + (r0 + 1) * DP + col),
                         cp_ld2_rows(q_s + (r0 + 8) * DP + col, q_s + (r0 + 9) * DP + col));
        }
      }
    }
  }
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    const int c = dt * 8 + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int j = half ? jb : ja;
      if (j >= S) continue;
      size_t gi = (((size_t)b * S + j) * Hkv + kvh) * D + c;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float ak = acc_k[dt][2 * half + u], av = acc_v[dt][2 * half + u];
        dk[gi + u] = accumulate ? dk[gi + u] + ak : ak;
        dv[gi + u] = accumulate ? dv[gi + u] + av : av;
      }
    }
  }
}

// dQ for 64 query rows of one head: 4 warps x 16 rows; key tiles of 32.
// Launch: grid (ceil(T/64), H, B), block 128.
template <typename T, int D>
__device__ __forceinline__ void bwd_dq_mma(const T* __restrict__ q, const T* __restrict__ k,
                                           const T* __restrict__ v, const float* __restrict__ dout,
                                           const float* __restrict__ lse, const float* __restrict__ delta,
                                           float* __restrict__ dq, int B, int T_, int S, int H, int Hkv,
                                           float scale, CpMask mask, int accumulate) {
  constexpr int BQ = 64, BK = 32, DP = D + 8, DC = D / 16, DT = D / 8;
  __shared__ __align__(16) T k_s[BK * DP], v_s[BK * DP];
  CP_EMU_POISON(k_s, v_s);
  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int ra = blockIdx.x * BQ + warp * 16 + g, rb = ra + 8;
  const float sl2 = scale * CP_LOG2E;
  // Q and dO fragments (A operands), element by element: no alignment needed.
  uint32_t qa[DC][4], oa[DC][4];
  {
    auto qe = [&](int r, int c) -> T { return r < T_ ? q[(((size_t)b * T_ + r) * H + h) * D + c] : cp_from_f32<T>(0.f); };
    auto oe = [&](int r, int c) -> float { return r < T_ ? dout[(((size_t)b * T_ + r) * H + h) * D + c] : 0.f; };
    auto pk = [](T lo, T hi) -> uint32_t {
      return (uint32_t)(*reinterpret_cast<const uint16_t*>(&lo)) | ((uint32_t)(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
    };
#pragma unroll
    for (int kc = 0; kc < DC; ++kc) {
      int c = kc * 16 + 2 * t;
      qa[kc][0] = pk(qe(ra, c), qe(ra, c + 1));
      qa[kc][1] = pk(qe(rb, c), qe(rb, c + 1));
      qa[kc][2] = pk(qe(ra, c + 8), qe(ra, c + 9));
      qa[kc][3] = pk(qe(rb, c + 8), qe(rb, c + 9));
      oa[kc][0] = cp_pack2<T>(oe(ra, c), oe(ra, c + 1));
      oa[kc][1] = cp_pack2<T>(oe(rb, c), oe(rb, c + 1));
      oa[kc][2] = cp_pack2<T>(oe(ra, c + 8), oe(ra, c + 9));
      oa[kc][3] = cp_pack2<T>(oe(rb, c + 8), oe(rb, c + 9));
    }
  }
  const size_t la = ((size_t)b * H + h) * T_ + ra, lb = la + 8;
  const float lse_a = ra < T_ ? lse[la] * CP_LOG2E : -INFINITY, lse_b = rb < T_ ? lse[lb] * CP_LOG2E : -INFINITY;
  const float dl_a = ra < T_ ? delta[la] : 0.f, dl_b = rb < T_ ? delta[lb] : 0.f;
  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
  const int last = min((int)blockIdx.x * BQ + BQ, T_) - 1;
  const int s_end = mask.key_end(mask.qpos(last), S);

  for (int k0 = 0; k0 < s_end; k0 += BK) {
    __syncthreads();
    for (int e = threadIdx.x; e < BK * D; e += blockDim.x) {
      int r = e / D, d = e % D, j = k0 + r;
      size_t gi = (((size_t)b * S + j) * Hkv + kvh) * D + d;
      k_s[r * DP + d] = j < S ? k[gi] : cp_from_f32<T>(0.f);
      v_s[r * DP + d] = j < S ? v[gi] : cp_from_f32<T>(0.f);
    }
    __syncthreads();
    float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
      for (int kc = 0; kc < DC; ++kc) {
        const T* kr = k_s + (nt * 8 + g) * DP + kc * 16 + 2 * t;
        const T* vr = v_s + (nt * 8 + g) * DP + kc * 16 + 2 * t;
        cp_mma16816<T>(s[nt], qa[kc], cp_ld2(kr), cp_ld2(kr + 8));
        cp_mma16816<T>(dp[nt], oa[kc], cp_ld2(vr), cp_ld2(vr + 8));
      }
    }
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int i = e < 2 ? ra : rb, j = k0 + nt * 8 + 2 * t + (e & 1);
        float li = e < 2 ? lse_a : lse_b, di = e < 2 ? dl_a : dl_b;
        bool vis = i < T_ && j < S && mask.visible(i, j) && li != -INFINITY;
        float p = vis ? exp2f(s[nt][e] * sl2 - li) : 0.f;
        s[nt][e] = p * (dp[nt][e] - di) * scale;  // dS * scale
      }
    // dQ += dS K: k = key (two chunks of 16), n = d.
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t da[4] = {cp_pack2<T>(s[2 * kk][0], s[2 * kk][1]), cp_pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                        cp_pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), cp_pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const int r0 = kk * 16 + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const int col = dt * 8 + g;
        cp_mma16816<T>(acc[dt], da, cp_ld2_rows(k_s + r0 * DP + col, k_s + (r0 + 1) * DP + col),
                       cp_ld2_rows(k_s + (r0 + 8) * DP + col, k_s + (r0 + 9) * DP + col));
      }
    }
  }
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    const int c = dt * 8 + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int i = half ? rb : ra;
      if (i >= T_) continue;
      size_t gi = (((size_t)b * T_ + i) * H + h) * D + c;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float a = acc[dt][2 * half + u];
        dq[gi + u] = accumulate ? dq[gi + u] + a : a;
      }
    }
  }
}

// `cap`: flash_bwd.cu's argument list (one Rust launcher for both); always 0 here (a soft cap
// runs the flash_bwd.cu kernels).
#define BWD_ARGS_COMMON                                                                            \
  const TY *q, const TY *k, const TY *v, const float *dout, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, float cap, int causal, long long q_off,  \
      long long q_str, long long k_off, long long k_str, int accumulate
#define MASK CpMask{causal, q_off, q_str, k_off, k_str}
#define ENTRIES_D(NAME, D)                                                                                       \
  extern "C" __global__ void __launch_bounds__(64) flash_bwd_mma_dkdv_##NAME##_d##D(float* dk, float* dv, BWD_ARGS_COMMON) { \
    bwd_dkdv_mma<TY, D>(q, k, v, dout, lse, delta, dk, dv, B, T_, S, H, Hkv, scale, MASK, accumulate);           \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(128) flash_bwd_mma_dq_##NAME##_d##D(float* dq, BWD_ARGS_COMMON) { \
    bwd_dq_mma<TY, D>(q, k, v, dout, lse, delta, dq, B, T_, S, H, Hkv, scale, MASK, accumulate);                 \
  }
#define ENTRIES(NAME) ENTRIES_D(NAME, 16) ENTRIES_D(NAME, 32) ENTRIES_D(NAME, 64) ENTRIES_D(NAME, 96) ENTRIES_D(NAME, 128)

#define TY __half
ENTRIES(f16)
#undef TY
#define TY __nv_bfloat16
ENTRIES(bf16)
#undef TY
