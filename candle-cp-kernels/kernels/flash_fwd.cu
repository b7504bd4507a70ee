// Flash-attention forward with log-sum-exp.
// Rust caller: candle_cp_kernels::flash::fwd (src/flash.rs), used by the attention op's
//   cuda_fwd in crates/candle-cp-ops/src/attention/cuda.rs.
// CPU reference: candle_cp_ops::attention::attention_fwd (and attention_slow).
//
// q [B, T, H, D], k/v [B, S, Hkv, D] (contiguous, element type T), out f32 [B, T, H, D],
// lse f32 [B, H, T] (natural log). Query head h reads KV head h / (H / Hkv) (GQA).
// Mask: see CpMask in common.cuh. A row that sees no key gets out = 0 and lse = -inf.
//
// Two implementations:
// - `flash_fwd_simple_*`: CUDA cores, f32 math, every dtype (f32/f16/bf16). Block = 4 warps x 4
//   query rows; lane j of a warp scores key j of a 32-key tile; online softmax per row.
// - `flash_fwd_mma_*`: tensor cores (mma.sync m16n8k16, f32 accumulate), f16/bf16. Block = 4
//   warps x 16 query rows; 64-key tiles in shared memory; FlashAttention-2 register layout
//   (S and P never leave registers; P is re-packed from the C fragment into the A fragment).
#include "common.cuh"

// ------------------------------------------------------------------ CUDA-core version
template <typename T, int D>
__device__ __forceinline__ void fwd_simple(const T* __restrict__ q, const T* __restrict__ k,
                                           const T* __restrict__ v, float* __restrict__ out,
                                           float* __restrict__ lse, int B, int T_, int S, int H,
                                           int Hkv, float scale, CpMask mask) {
  constexpr int NW = 4, R = 4, BK = 32, DP = D + 1, DL = (D + 31) / 32;
  __shared__ float k_s[BK * DP];
  __shared__ float v_s[BK * D];
  __shared__ float q_s[NW * R * D];
  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * NW * R;
  const float sl2 = scale * CP_LOG2E;

  for (int e = threadIdx.x; e < NW * R * D; e += blockDim.x) {
    int r = e / D, d = e % D, i = row0 + r;
    q_s[e] = i < T_ ? cp_to_f32(q[(((size_t)b * T_ + i) * H + h) * D + d]) : 0.f;
  }
  float m[R], l[R], o[R][DL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < DL; ++c) o[r][c] = 0.f;
  }
  int last_row = min(row0 + NW * R, T_) - 1;
  int s_end = last_row < 0 ? 0 : mask.key_end(mask.qpos(last_row), S);

  for (int k0 = 0; k0 < s_end; k0 += BK) {
    __syncthreads();
    for (int e = threadIdx.x; e < BK * D; e += blockDim.x) {
      int jj = e / D, d = e % D, j = k0 + jj;
      size_t g = (((size_t)b * S + j) * Hkv + kvh) * D + d;
      k_s[jj * DP + d] = j < S ? cp_to_f32(k[g]) : 0.f;
      v_s[jj * D + d] = j < S ? cp_to_f32(v[g]) : 0.f;
    }
    __syncthreads();
    const int j = k0 + lane;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      float kd = k_s[lane * DP + d];
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] += q_s[(warp * R + r) * D + d] * kd;
    }
    float p[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      int i = row0 + warp * R + r;
      bool vis = j < S && i < T_ && mask.visible(i, j);
      float sv = vis ? s[r] * sl2 : -INFINITY;
      float m_new = fmaxf(m[r], cp_warp_max(sv));
      float alpha = 1.f;
      if (m_new == -INFINITY) {
        p[r] = 0.f;
      } else {
        p[r] = exp2f(sv - m_new);
        alpha = exp2f(m[r] - m_new);
      }
      l[r] = l[r] * alpha + cp_warp_sum(p[r]);
      m[r] = m_new;
#pragma unroll
      for (int c = 0; c < DL; ++c) o[r][c] *= alpha;
    }
#pragma unroll 4
    for (int jj = 0; jj < BK; ++jj) {
      float vj[DL];
#pragma unroll
      for (int c = 0; c < DL; ++c) vj[c] = (D % 32 == 0 || lane + 32 * c < D) ? v_s[jj * D + lane + 32 * c] : 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float pj = __shfl_sync(CP_FULL_MASK, p[r], jj);
#pragma unroll
        for (int c = 0; c < DL; ++c) o[r][c] += pj * vj[c];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    int i = row0 + warp * R + r;
    if (i >= T_) continue;
    bool any = l[r] > 0.f;
    float inv = any ? 1.f / l[r] : 0.f;
    size_t base = (((size_t)b * T_ + i) * H + h) * D;
#pragma unroll
    for (int c = 0; c < DL; ++c)
      if (D % 32 == 0 || lane + 32 * c < D) out[base + lane + 32 * c] = o[r][c] * inv;
    if (lane == 0) lse[((size_t)b * H + h) * T_ + i] = any ? (m[r] + log2f(l[r])) * CP_LN2 : -INFINITY;
  }
}

// ------------------------------------------------------------------ tensor-core version
template <typename T, int D>
__device__ __forceinline__ void fwd_mma(const T* __restrict__ q, const T* __restrict__ k,
                                        const T* __restrict__ v, float* __restrict__ out,
                                        float* __restrict__ lse, int B, int T_, int S, int H,
                                        int Hkv, float scale, CpMask mask) {
  constexpr int BQ = 64, BK = 64, DP = D + 8, KP = BK + 8, DC = D / 16, DT = D / 8, NT = BK / 8;
  __shared__ __align__(16) T k_s[BK * DP];  // K tile, row-major [key][d]
  __shared__ __align__(16) T vt_s[D * KP];  // V tile, transposed [d][key]
  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int ra = blockIdx.x * BQ + warp * 16 + g, rb = ra + 8;
  const float sl2 = scale * CP_LOG2E;

  // Q fragments stay in registers for the whole kernel.
  uint32_t qa[DC][4];
  {
    const T* qra = q + (((size_t)b * T_ + ra) * H + h) * D;
    const T* qrb = q + (((size_t)b * T_ + rb) * H + h) * D;
#pragma unroll
    for (int kc = 0; kc < DC; ++kc) {
      int c = kc * 16 + 2 * t;
      qa[kc][0] = ra < T_ ? *reinterpret_cast<const uint32_t*>(qra + c) : 0u;
      qa[kc][1] = rb < T_ ? *reinterpret_cast<const uint32_t*>(qrb + c) : 0u;
      qa[kc][2] = ra < T_ ? *reinterpret_cast<const uint32_t*>(qra + c + 8) : 0u;
      qa[kc][3] = rb < T_ ? *reinterpret_cast<const uint32_t*>(qrb + c + 8) : 0u;
    }
  }
  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  const long long pa = mask.qpos(ra), pb = mask.qpos(rb);

  int last_row = min((int)blockIdx.x * BQ + BQ, T_) - 1;
  int s_end = mask.key_end(mask.qpos(last_row), S);
  const long long first_qpos = mask.qpos((long long)blockIdx.x * BQ);

  for (int k0 = 0; k0 < s_end; k0 += BK) {
    __syncthreads();
    for (int e = threadIdx.x; e < BK * D / 8; e += blockDim.x) {
      int row = e / (D / 8), c8 = (e % (D / 8)) * 8, j = k0 + row;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (j < S) {
        size_t gi = (((size_t)b * S + j) * Hkv + kvh) * D + c8;
        kv = *reinterpret_cast<const uint4*>(k + gi);
        vv = *reinterpret_cast<const uint4*>(v + gi);
      }
      *reinterpret_cast<uint4*>(k_s + row * DP + c8) = kv;
      const T* ve = reinterpret_cast<const T*>(&vv);
#pragma unroll
      for (int u = 0; u < 8; ++u) vt_s[(c8 + u) * KP + row] = ve[u];
    }
    __syncthreads();

    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < DC; ++kc) {
        const T* kr = k_s + (nt * 8 + g) * DP + kc * 16 + 2 * t;
        cp_mma16816<T>(s[nt], qa[kc], *reinterpret_cast<const uint32_t*>(kr),
                       *reinterpret_cast<const uint32_t*>(kr + 8));
      }
    }
    // Scale and mask. A tile entirely below the diagonal of every row needs no mask test.
    const bool full_tile = k0 + BK <= S && (!mask.causal || mask.kpos(k0 + BK - 1) <= first_qpos);
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int j = k0 + nt * 8 + 2 * t + (e & 1);
        bool vis = full_tile || (j < S && (!mask.causal || mask.kpos(j) <= (e < 2 ? pa : pb)));
        s[nt][e] = vis ? s[nt][e] * sl2 : -INFINITY;
      }
      mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
    }
    float mn_a = fmaxf(m_a, cp_quad_max(mx_a)), mn_b = fmaxf(m_b, cp_quad_max(mx_b));
    float al_a = mn_a == -INFINITY ? 1.f : exp2f(m_a - mn_a);
    float al_b = mn_b == -INFINITY ? 1.f : exp2f(m_b - mn_b);
    float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = mn_a == -INFINITY ? 0.f : exp2f(s[nt][0] - mn_a);
      s[nt][1] = mn_a == -INFINITY ? 0.f : exp2f(s[nt][1] - mn_a);
      s[nt][2] = mn_b == -INFINITY ? 0.f : exp2f(s[nt][2] - mn_b);
      s[nt][3] = mn_b == -INFINITY ? 0.f : exp2f(s[nt][3] - mn_b);
      sum_a += s[nt][0] + s[nt][1];
      sum_b += s[nt][2] + s[nt][3];
    }
    l_a = l_a * al_a + sum_a;  // per-thread partial row sums; reduced over the quad at the end
    l_b = l_b * al_b + sum_b;
    m_a = mn_a;
    m_b = mn_b;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= al_a;
      o[dt][1] *= al_a;
      o[dt][2] *= al_b;
      o[dt][3] *= al_b;
    }
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t pf[4] = {cp_pack2<T>(s[2 * kk][0], s[2 * kk][1]), cp_pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                        cp_pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                        cp_pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const T* vr = vt_s + (dt * 8 + g) * KP + kk * 16 + 2 * t;
        cp_mma16816<T>(o[dt], pf, *reinterpret_cast<const uint32_t*>(vr),
                       *reinterpret_cast<const uint32_t*>(vr + 8));
      }
    }
  }
  l_a = cp_quad_sum(l_a);
  l_b = cp_quad_sum(l_b);
  const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    int c = dt * 8 + 2 * t;
    if (ra < T_)
      *reinterpret_cast<float2*>(out + (((size_t)b * T_ + ra) * H + h) * D + c) =
          make_float2(o[dt][0] * inv_a, o[dt][1] * inv_a);
    if (rb < T_)
      *reinterpret_cast<float2*>(out + (((size_t)b * T_ + rb) * H + h) * D + c) =
          make_float2(o[dt][2] * inv_b, o[dt][3] * inv_b);
  }
  if (t == 0) {
    if (ra < T_) lse[((size_t)b * H + h) * T_ + ra] = l_a > 0.f ? (m_a + log2f(l_a)) * CP_LN2 : -INFINITY;
    if (rb < T_) lse[((size_t)b * H + h) * T_ + rb] = l_b > 0.f ? (m_b + log2f(l_b)) * CP_LN2 : -INFINITY;
  }
}

// ------------------------------------------------------------------ entry points
// Head dims 16, 32, 64, 128. Launch: simple: grid (ceil(T/16), H, B), block 128;
// mma: grid (ceil(T/64), H, B), block 128.
#define FWD_ARGS                                                                              \
  const TY *q, const TY *k, const TY *v, float *out, float *lse, int B, int T_, int S, int H, \
      int Hkv, float scale, int causal, long long q_off, long long q_str, long long k_off,    \
      long long k_str
#define FWD_CALL(IMPL, D)                                                                       \
  IMPL<TY, D>(q, k, v, out, lse, B, T_, S, H, Hkv, scale, CpMask{causal, q_off, q_str, k_off, k_str})

#define SIMPLE(NAME, D) \
  extern "C" __global__ void __launch_bounds__(128) flash_fwd_simple_##NAME##_d##D(FWD_ARGS) { FWD_CALL(fwd_simple, D); }
#define MMA(NAME, D) \
  extern "C" __global__ void __launch_bounds__(128) flash_fwd_mma_##NAME##_d##D(FWD_ARGS) { FWD_CALL(fwd_mma, D); }
#define TY float
SIMPLE(f32, 16) SIMPLE(f32, 32) SIMPLE(f32, 64) SIMPLE(f32, 128)
#undef TY
#define TY __half
SIMPLE(f16, 16) SIMPLE(f16, 32) SIMPLE(f16, 64) SIMPLE(f16, 128)
MMA(f16, 16) MMA(f16, 32) MMA(f16, 64) MMA(f16, 128)
#undef TY
#define TY __nv_bfloat16
SIMPLE(bf16, 16) SIMPLE(bf16, 32) SIMPLE(bf16, 64) SIMPLE(bf16, 128)
MMA(bf16, 16) MMA(bf16, 32) MMA(bf16, 64) MMA(bf16, 128)
#undef TY
