// Flash-attention backward: delta = rowsum(dO * O), then dK/dV (key-tile major) and dQ
// (query-tile major), recomputing P from the saved LSE. No atomics: deterministic.
// Rust caller: candle_cp_kernels::flash::bwd (src/flash/bwd.rs), used by the attention op's
//   backward in crates/candle-cp-ops/src/attention/cuda.rs.
// CPU reference: candle_cp_ops::attention::attention_bwd.
//
// q [B, T, H, D], k/v [B, S, Hkv, D] (type T); o, do f32 [B, T, H, D]; lse, delta f32 [B, H, T]
// (lse of the *whole* attention the rows belong to: the global LSE in a ring).
// cap > 0: Gemma 2's logit soft cap (see bwd_p_ds; the forward's in flash_fwd.cu), 0 = none.
// dq f32 [B, T, H, D], dk/dv f32 [B, S, Hkv, D]. With accumulate != 0 the kernels add into
// dq/dk/dv (f32 accumulation across ring steps) instead of overwriting them.
// GQA: dK/dV of KV head kvh sum over its H / Hkv query heads.
// Band entries (`flash_bwd_{dkdv,dq}_band_*`, Rust caller src/flash/band.rs, CPU reference
// candle_cp_ops::attention::attention_bwd_band): the mask arguments replaced by a band (CpBand,
// common.cuh); dK/dV blocks visit the query rows [qbegin, qend) of their keys, dQ blocks the keys
// from the tile holding lo of their first row.
#include "common.cuh"

// delta[b, h, i] = sum_d do[b, i, h, d] * o[b, i, h, d]. One warp per (b, i, h) row.
// Launch: grid (ceil(B*T*H / 4)), block 128.
extern "C" __global__ void flash_bwd_delta_f32(const float* __restrict__ o, const float* __restrict__ dout,
                                               float* __restrict__ delta, int B, int T_, int H, int D) {
  size_t row = (size_t)blockIdx.x * 4 + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= (size_t)B * T_ * H) return;
  float acc = 0.f;
  for (int d = lane; d < D; d += 32) acc += o[row * D + d] * dout[row * D + d];
  acc = cp_warp_sum(acc);
  if (lane == 0) {
    int h = row % H;
    size_t bi = row / H;
    int i = bi % T_, b = bi / T_;
    delta[((size_t)b * H + h) * T_ + i] = acc;
  }
}

// p = exp(scale * q.k - lse) (0 where masked or lse = -inf); ds = p * (do.v - delta).
// With a soft cap (cap > 0): the logit x = cap * tanh(scale * q.k / cap), p = exp(x - lse), and
// ds (the gradient w.r.t. scale * q.k) times the cap's derivative 1 - tanh^2.
__device__ __forceinline__ void bwd_p_ds(float s, float dp, float lse_i, float delta_i, bool vis,
                                         float scale, float cap, float& p, float& ds) {
  float x = s * scale, g = 1.f;
  if (cap > 0.f) {
    const float th = tanhf(x / cap);
    x = cap * th;
    g = 1.f - th * th;
  }
  p = (vis && lse_i != -INFINITY) ? __expf(x - lse_i) : 0.f;
  ds = p * (dp - delta_i) * g;
}

// Head dims 16, 32, 64, 128, 256. Shared memory: cp_core_smem (common.cuh): static up to d 128,
// dynamic at d 256 ((80 d + 576) * 4 bytes for dK/dV, (80 d + 64) * 4 for dQ).
// dK, dV for a tile of 32 keys of one KV head. Launch: grid (ceil(S/32), Hkv, B), block 128.
template <typename T, int D, typename M>
__device__ __forceinline__ void bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k,
                                         const T* __restrict__ v, const float* __restrict__ dout,
                                         const float* __restrict__ lse, const float* __restrict__ delta,
                                         float* __restrict__ dk, float* __restrict__ dv, int B, int T_,
                                         int S, int H, int Hkv, float scale, float cap, M mask, int accumulate) {
  constexpr int NW = 4, RW = 2, NQ = NW * RW, BK = 32, DP = D + 1, PER = BK * D / (NW * 32);
  // k_s, v_s [BK][DP]; q_s, do_s [NQ][D]; p_s, ds_s [NQ][BK]: (80 D + 576) floats (core.rs CORE_DKDV_SMEM)
  float* const k_s = cp_core_smem<2 * BK * DP + 2 * NQ * D + 2 * NQ * BK>();
  float* const v_s = k_s + BK * DP;
  float* const q_s = v_s + BK * DP;
  float* const do_s = q_s + NQ * D;
  float* const p_s = do_s + NQ * D;
  float* const ds_s = p_s + NQ * BK;
  const int b = blockIdx.z, kvh = blockIdx.y, k0 = blockIdx.x * BK;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, G = H / Hkv;
  for (int e = threadIdx.x; e < BK * D; e += blockDim.x) {
    int jj = e / D, d = e % D, j = k0 + jj;
    size_t gi = (((size_t)b * S + j) * Hkv + kvh) * D + d;
    k_s[jj * DP + d] = j < S ? cp_to_f32(k[gi]) : 0.f;
    v_s[jj * DP + d] = j < S ? cp_to_f32(v[gi]) : 0.f;
  }
  float acc_k[PER], acc_v[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) acc_k[u] = acc_v[u] = 0.f;
  const int i_begin = mask.qbegin(k0, T_), i_end = mask.qend(min(k0 + BK, S), T_);
  const int j = k0 + lane;

  for (int hq = kvh * G; hq < kvh * G + G; ++hq) {
    for (int i0 = i_begin; i0 < i_end; i0 += NQ) {
      __syncthreads();
      for (int e = threadIdx.x; e < NQ * D; e += blockDim.x) {
        int r = e / D, d = e % D, i = i0 + r;
        size_t gi = (((size_t)b * T_ + i) * H + hq) * D + d;
        q_s[e] = i < T_ ? cp_to_f32(q[gi]) : 0.f;
        do_s[e] = i < T_ ? dout[gi] : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int rr = 0; rr < RW; ++rr) {
        int r = warp * RW + rr, i = i0 + r;
        float s = 0.f, dp = 0.f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
          s += q_s[r * D + d] * k_s[lane * DP + d];
          dp += do_s[r * D + d] * v_s[lane * DP + d];
        }
        float p = 0.f, ds = 0.f;
        if (i < T_) {
          size_t li = ((size_t)b * H + hq) * T_ + i;
          bwd_p_ds(s, dp, lse[li], delta[li], j < S && mask.visible(i, j), scale, cap, p, ds);
        }
        p_s[r * BK + lane] = p;
        ds_s[r * BK + lane] = ds * scale;
      }
      __syncthreads();
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        int e = threadIdx.x + u * NW * 32, jj = e / D, d = e % D;
        float ak = 0.f, av = 0.f;
#pragma unroll
        for (int r = 0; r < NQ; ++r) {
          av += p_s[r * BK + jj] * do_s[r * D + d];
          ak += ds_s[r * BK + jj] * q_s[r * D + d];
        }
        acc_k[u] += ak;
        acc_v[u] += av;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    int e = threadIdx.x + u * NW * 32, jj = e / D, d = e % D, jg = k0 + jj;
    if (jg >= S) continue;
    size_t gi = (((size_t)b * S + jg) * Hkv + kvh) * D + d;
    dk[gi] = accumulate ? dk[gi] + acc_k[u] : acc_k[u];
    dv[gi] = accumulate ? dv[gi] + acc_v[u] : acc_v[u];
  }
}

// dQ for 8 query rows of one head. Launch: grid (ceil(T/8), H, B), block 128.
template <typename T, int D, typename M>
__device__ __forceinline__ void bwd_dq(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, const float* __restrict__ dout,
                                       const float* __restrict__ lse, const float* __restrict__ delta,
                                       float* __restrict__ dq, int B, int T_, int S, int H, int Hkv,
                                       float scale, float cap, M mask, int accumulate) {
  constexpr int NW = 4, RW = 2, NQ = NW * RW, BK = 32, DP = D + 1, DL = (D + 31) / 32;
  // k_s, v_s [BK][DP]; q_s, do_s [NQ][D]: (80 D + 64) floats (core.rs CORE_DQ_SMEM)
  float* const k_s = cp_core_smem<2 * BK * DP + 2 * NQ * D>();
  float* const v_s = k_s + BK * DP;
  float* const q_s = v_s + BK * DP;
  float* const do_s = q_s + NQ * D;
  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / Hkv), i0 = blockIdx.x * NQ;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = threadIdx.x; e < NQ * D; e += blockDim.x) {
    int r = e / D, d = e % D, i = i0 + r;
    size_t gi = (((size_t)b * T_ + i) * H + h) * D + d;
    q_s[e] = i < T_ ? cp_to_f32(q[gi]) : 0.f;
    do_s[e] = i < T_ ? dout[gi] : 0.f;
  }
  float lse_r[RW], delta_r[RW], acc[RW][DL];
#pragma unroll
  for (int rr = 0; rr < RW; ++rr) {
    int i = i0 + warp * RW + rr;
    size_t li = ((size_t)b * H + h) * T_ + i;
    lse_r[rr] = i < T_ ? lse[li] : -INFINITY;
    delta_r[rr] = i < T_ ? delta[li] : 0.f;
#pragma unroll
    for (int c = 0; c < DL; ++c) acc[rr][c] = 0.f;
  }
  const int last = min(i0 + NQ, T_) - 1;
  const int s_end = mask.kend(last, S);
  for (int k0 = M::BAND ? mask.kbegin(i0) / BK * BK : 0; k0 < s_end; k0 += BK) {
    __syncthreads();
    for (int e = threadIdx.x; e < BK * D; e += blockDim.x) {
      int jj = e / D, d = e % D, j = k0 + jj;
      size_t gi = (((size_t)b * S + j) * Hkv + kvh) * D + d;
      k_s[jj * DP + d] = j < S ? cp_to_f32(k[gi]) : 0.f;
      v_s[jj * DP + d] = j < S ? cp_to_f32(v[gi]) : 0.f;
    }
    __syncthreads();
    const int j = k0 + lane;
#pragma unroll
    for (int rr = 0; rr < RW; ++rr) {
      int r = warp * RW + rr, i = i0 + r;
      float s = 0.f, dp = 0.f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) {
        s += q_s[r * D + d] * k_s[lane * DP + d];
        dp += do_s[r * D + d] * v_s[lane * DP + d];
      }
      float p, ds;
      bwd_p_ds(s, dp, lse_r[rr], delta_r[rr], i < T_ && j < S && mask.visible(i, j), scale, cap, p, ds);
      ds *= scale;
#pragma unroll 4
      for (int jj = 0; jj < BK; ++jj) {
        float dsj = __shfl_sync(CP_FULL_MASK, ds, jj);
#pragma unroll
        for (int c = 0; c < DL; ++c)
          if (D % 32 == 0 || lane + 32 * c < D) acc[rr][c] += dsj * k_s[jj * DP + lane + 32 * c];
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < RW; ++rr) {
    int i = i0 + warp * RW + rr;
    if (i >= T_) continue;
    size_t base = (((size_t)b * T_ + i) * H + h) * D;
#pragma unroll
    for (int c = 0; c < DL; ++c) {
      if (D % 32 != 0 && lane + 32 * c >= D) continue;
      size_t gi = base + lane + 32 * c;
      dq[gi] = accumulate ? dq[gi] + acc[rr][c] : acc[rr][c];
    }
  }
}

#define BWD_ARGS_COMMON                                                                            \
  const TY *q, const TY *k, const TY *v, const float *dout, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, float cap, int causal, long long q_off,  \
      long long q_str, long long k_off, long long k_str, int accumulate
#define MASK CpMask{causal, q_off, q_str, k_off, k_str}
#define DKDV(D) bwd_dkdv<TY, D>(q, k, v, dout, lse, delta, dk, dv, B, T_, S, H, Hkv, scale, cap, MASK, accumulate)
#define DQ(D) bwd_dq<TY, D>(q, k, v, dout, lse, delta, dq, B, T_, S, H, Hkv, scale, cap, MASK, accumulate)
#define BWD_BAND_ARGS                                                                              \
  const TY *q, const TY *k, const TY *v, const float *dout, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, float cap, CP_BAND_ARGS, int accumulate
#define ENTRIES_D(NAME, D)                                                                                    \
  extern "C" __global__ void __launch_bounds__(128) flash_bwd_dkdv_##NAME##_d##D(float* dk, float* dv, BWD_ARGS_COMMON) { DKDV(D); } \
  extern "C" __global__ void __launch_bounds__(128) flash_bwd_dq_##NAME##_d##D(float* dq, BWD_ARGS_COMMON) { DQ(D); } \
  extern "C" __global__ void __launch_bounds__(128) flash_bwd_dkdv_band_##NAME##_d##D(float* dk, float* dv, BWD_BAND_ARGS) { \
    bwd_dkdv<TY, D>(q, k, v, dout, lse, delta, dk, dv, B, T_, S, H, Hkv, scale, cap, CP_BAND_OF_BLOCK, accumulate); \
  } \
  extern "C" __global__ void __launch_bounds__(128) flash_bwd_dq_band_##NAME##_d##D(float* dq, BWD_BAND_ARGS) { \
    bwd_dq<TY, D>(q, k, v, dout, lse, delta, dq, B, T_, S, H, Hkv, scale, cap, CP_BAND_OF_BLOCK, accumulate); \
  }
#define ENTRIES(NAME) ENTRIES_D(NAME, 16) ENTRIES_D(NAME, 32) ENTRIES_D(NAME, 64) ENTRIES_D(NAME, 96) ENTRIES_D(NAME, 128) ENTRIES_D(NAME, 256)

#define TY float
ENTRIES(f32)
#undef TY
#define TY __half
ENTRIES(f16)
#undef TY
#define TY __nv_bfloat16
ENTRIES(bf16)
#undef TY
