// Device code shared by the tensor-core backward kernels flash_bwd_pipe.cu (pipelined dK/dV and
// dQ kernels) and flash_bwd_fused.cu (fused dK/dV + atomic dQ): cp.async tile loads into padded
// shared tiles (rows of D + 8 16-bit elements), ldmatrix lane offsets, the per-warp products of the
// dK/dV side (S^T = K Q^T, dP^T = V dO^T, P^T, dV += P^T dO, dK += dS^T Q), the query-tile prefetch
// (Q, dO, lse2, delta) and the f32 row stores. Everything is __forceinline__: each kernel compiles
// to the same code as when these lines were written out in it. Indexing model: sim/bwd_pipe_sim.py.
#pragma once
#include "common.cuh"

// Entry parameters after the outputs (both files; the Rust launchers push them in this order).
#define PIPE_ARGS                                                                                 \
  const TY *q, const TY *k, const TY *v, const TY *dout16, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, int causal, long long q_off,            \
      long long q_str, long long k_off, long long k_str, int accumulate
#define PIPE_MASK CpMask{causal, q_off, q_str, k_off, k_str}

// Copy rows row0 .. row0+ROWS-1 (of `limit` valid rows; the others are zero-filled) of a strided
// row-major [*, D] global matrix into a padded shared tile at byte address s.
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void pipe_load_tile(uint32_t s, const T* __restrict__ base, size_t stride, int row0,
                                               int limit) {
  constexpr int CH = D / 8, DPB = (D + 8) * 2;
#pragma unroll
  for (int e0 = 0; e0 < ROWS * CH; e0 += NT) {
    const int e = e0 + threadIdx.x;
    if ((ROWS * CH) % NT != 0 && e >= ROWS * CH) break;
    const int r = e / CH, c = e % CH, row = row0 + r;
    const bool ok = row < limit;
    cp_async16(s + r * DPB + c * 16, base + (size_t)(ok ? row : 0) * stride + c * 8, ok);
  }
}

// log2-domain LSE of a row, +inf for a row past T or with lse = -inf (then P = 0).
// The soft cap of the pipelined backward's capped entries (flash_bwd_pipe_cap_*, Gemma 2): the
// logit of a raw score s in the log2 domain, capl2 * tanh(s * sc) (sc = scale / cap, capl2 = cap
// log2 e), and the cap's derivative 1 - tanh^2 recovered from P = exp2(logit - lse2) itself, so no
// register per score is added: tanh = (log2 P + lse2) / capl2 (P = 0: no gradient).
struct CpCap {
  float sc = 0.f, capl2 = 0.f;
  __device__ static CpCap of(float scale, float cap) { return CpCap{scale / cap, cap * CP_LOG2E}; }
  __device__ float logit2(float s) const { return capl2 * cp_tanh_fast(s * sc); }
  // ds (w.r.t. the capped logit) -> w.r.t. the raw scaled score (a division rather than a third
  // live constant: the d128 dK/dV band entry sits at 255 registers)
  __device__ float grad(float ds, float p, float l2) const {
    const float th = __fdividef(__log2f(p) + l2, capl2);
    return p > 0.f ? ds * (1.f - th * th) : 0.f;
  }
};

__device__ __forceinline__ float pipe_lse2(const float* __restrict__ lse, size_t li, bool valid) {
  if (!valid) return INFINITY;
  const float l = lse[li];
  return l == -INFINITY ? INFINITY : l * CP_LOG2E;
}

// ldmatrix lane offsets (row stride dpb bytes). `a`: matrices (rows 0-7, cols 0-7), (rows 8-15,
// cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15): A fragments (16x16 at the tile origin),
// and with .trans B fragments of two n-tiles from K x N row-major storage. `b`: (rows 0-7, cols
// 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15): B fragments of two
// n-tiles from N x K storage, and with .trans the A fragment of X^T from a row-major X (the fused
// kernel's dS from dS^T).
__device__ __forceinline__ uint32_t pipe_off_a(int lane, int dpb) {
  return ((lane & 7) + 8 * ((lane >> 3) & 1)) * dpb + (lane >> 4) * 16;
}
__device__ __forceinline__ uint32_t pipe_off_b(int lane, int dpb) {
  return ((lane & 7) + 8 * (lane >> 4)) * dpb + ((lane >> 3) & 1) * 16;
}

// Store one warp's 16 x D f32 accumulator rows (rows r_a and r_a + 8) times `scale`.
template <int D>
__device__ __forceinline__ void pipe_store_rows(float* __restrict__ out, const float (*acc)[4], size_t gi_a,
                                                size_t gi_b, bool ok_a, bool ok_b, int t, float scale,
                                                int accumulate) {
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int c = dt * 8 + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (!(half ? ok_b : ok_a)) continue;
      float2* p = reinterpret_cast<float2*>(out + (half ? gi_b : gi_a) + c);
      float2 val = make_float2(acc[dt][2 * half] * scale, acc[dt][2 * half + 1] * scale);
      if (accumulate) {
        const float2 old = *p;
        val.x += old.x;
        val.y += old.y;
      }
      *p = val;
    }
  }
}

// dK/dV side: store this warp's dK (times scale) and dV rows: keys ja = k0 + 16 * warp + g and
// ja + 8 of KV head kvh (dk/dv f32 [B, S, Hkv, D]), columns c0 .. c0 + DA - 1 (DA < D: a block
// that owns a column slice of dK / dV, the pipelined kernel at D = 256).
template <int D, int DA = D>
__device__ __forceinline__ void pipe_store_kv(float* __restrict__ dk, float* __restrict__ dv, const float (*acc_k)[4],
                                              const float (*acc_v)[4], int b, int ja, int S, int Hkv, int kvh,
                                              int t, float scale, int accumulate, int c0 = 0) {
  const int jb = ja + 8;
  const size_t gi_a = (((size_t)b * S + ja) * Hkv + kvh) * D + c0, gi_b = gi_a + (size_t)8 * Hkv * D;
  pipe_store_rows<DA>(dk, acc_k, gi_a, gi_b, ja < S, jb < S, t, scale, accumulate);
  pipe_store_rows<DA>(dv, acc_v, gi_a, gi_b, ja < S, jb < S, t, 1.f, accumulate);
}

// dK/dV side: issue the cp.async copies of query tile (head hq, rows i0 .. i0 + BQ - 1) of Q and
// dO (row stride q_stride = H * D, hoisted by the caller) into the shared tiles at q_dst / do_dst;
// threads tid < BQ read the row's lse2 and delta into l2 / dl (rows past T: +inf and 0).
template <typename T, int D, int BQ, int NT>
__device__ __forceinline__ void pipe_issue_q(uint32_t q_dst, uint32_t do_dst, const T* __restrict__ q,
                                             const T* __restrict__ do16, const float* __restrict__ lse,
                                             const float* __restrict__ delta, size_t q_stride, int b, int hq,
                                             int i0, int T_, int H, float& l2, float& dl) {
  const size_t qb = ((size_t)b * T_ * H + hq) * D;
  pipe_load_tile<T, D, BQ, NT>(q_dst, q + qb, q_stride, i0, T_);
  pipe_load_tile<T, D, BQ, NT>(do_dst, do16 + qb, q_stride, i0, T_);
  const int tid = threadIdx.x;
  if (tid < BQ) {
    const int i = i0 + tid;
    const size_t li = ((size_t)b * H + hq) * T_ + i;
    l2 = pipe_lse2(lse, li, i < T_);
    dl = i < T_ ? delta[li] : 0.f;
  }
}

// dK/dV side, block start: unless the block has no query tile (n_it == 0; then nothing may still
// be in flight into shared memory when its threads exit), copy the BN-key K and V tiles (keys k0 ..)
// to k_a / v_a and issue query tile 0 (issue(0, 0, l2, dl)), its lse2 / delta going to lse_s / dl_s;
// commit that group; zero this warp's dK / dV accumulators (DTA 8-column tiles: D / 8, or the
// block's column slice).
template <typename T, int D, int BN, int BQ, int NT, int DTA, typename Issue>
__device__ __forceinline__ void pipe_kv_begin(int n_it, uint32_t k_a, uint32_t v_a, const T* __restrict__ k,
                                              const T* __restrict__ v, size_t kv_base, size_t kv_stride, int k0,
                                              int S, int tid, float* lse_s, float* dl_s, const Issue& issue,
                                              float (&acc_k)[DTA][4], float (&acc_v)[DTA][4]) {
  if (n_it > 0) {
    pipe_load_tile<T, D, BN, NT>(k_a, k + kv_base, kv_stride, k0, S);
    pipe_load_tile<T, D, BN, NT>(v_a, v + kv_base, kv_stride, k0, S);
    float l2 = 0.f, dl = 0.f;
    issue(0, 0, l2, dl);
    if (tid < BQ) lse_s[tid] = l2, dl_s[tid] = dl;
  }
  cp_async_commit();
#pragma unroll
  for (int dt = 0; dt < DTA; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[dt][e] = acc_v[dt][e] = 0.f;
}

// acc = A B^T for one warp: A = 16 rows at shared byte address a_rows (K or V rows of this warp),
// B = the QT * 8 rows of the query tile at b_tile (Q or dO): S^T = K Q^T and dP^T = V dO^T.
template <typename T, int D, int QT>
__device__ __forceinline__ void pipe_rows_x_tile(float (&acc)[QT][4], uint32_t a_rows, uint32_t b_tile,
                                                 uint32_t off_a, uint32_t off_b) {
  constexpr int DPB = (D + 8) * 2;
#pragma unroll
  for (int nt = 0; nt < QT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    uint32_t a[4];
    cp_ldsm_x4(a, a_rows + kc * 32 + off_a);
#pragma unroll
    for (int np = 0; np < QT / 2; ++np) {
      uint32_t bb[4];
      cp_ldsm_x4(bb, b_tile + np * 16 * DPB + kc * 32 + off_b);
      cp_mma16816<T>(acc[2 * np], a, bb[0], bb[1]);
      cp_mma16816<T>(acc[2 * np + 1], a, bb[2], bb[3]);
    }
  }
}

// P^T = exp2(S^T * scale * log2 e - lse2) in place (sl2 = scale * log2 e, ls = the tile's lse2):
// pairs hidden by the causal mask (checked where need_mask) and, with RAGGED where ragged, keys
// past S (kok_a / kok_b false) -> 0.
template <int QT, bool RAGGED>
__device__ __forceinline__ void pipe_pt(float (&st)[QT][4], const float* ls, int t, float sl2, CpMask mask,
                                        bool need_mask, long long kp_a, long long kp_b, int i0, bool ragged,
                                        bool kok_a, bool kok_b, const CpCap* cc = nullptr) {
#pragma unroll
  for (int nt = 0; nt < QT; ++nt) {
    const float2 l2 = *reinterpret_cast<const float2*>(ls + nt * 8 + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float l = (e & 1) ? l2.y : l2.x;
      float p = cc ? cp_exp2(cc->logit2(st[nt][e]) - l) : cp_exp2(fmaf(st[nt][e], sl2, -l));  // (cc: the capped entries)
      if (need_mask && (e < 2 ? kp_a : kp_b) > mask.qpos(i0 + nt * 8 + 2 * t + (e & 1))) p = 0.f;
      if (RAGGED && ragged && !(e < 2 ? kok_a : kok_b)) p = 0.f;
      st[nt][e] = p;
    }
  }
}

// A fragment (rounded to T) of the 16 x 16 block formed by two 8-column accumulator tiles x0, x1.
template <typename T>
__device__ __forceinline__ void pipe_pack_a(uint32_t (&a)[4], const float (&x0)[4], const float (&x1)[4]) {
  a[0] = cp_pack2<T>(x0[0], x0[1]);
  a[1] = cp_pack2<T>(x0[2], x0[3]);
  a[2] = cp_pack2<T>(x1[0], x1[1]);
  a[3] = cp_pack2<T>(x1[2], x1[3]);
}

// acc[16 x D] += A (16 x 16, this warp's fragment) times the 16 query rows at b_rows (dO or Q,
// via ldmatrix.trans): dV += P^T dO and dK += dS^T Q, 16 queries per call.
template <typename T, int D>
__device__ __forceinline__ void pipe_acc_trans(float (*acc)[4], const uint32_t (&a)[4], uint32_t b_rows,
                                               uint32_t off_a) {
#pragma unroll
  for (int dp = 0; dp < D / 16; ++dp) {
    uint32_t bb[4];
    cp_ldsm_x4_trans(bb, b_rows + dp * 32 + off_a);
    cp_mma16816<T>(acc[2 * dp], a, bb[0], bb[1]);
    cp_mma16816<T>(acc[2 * dp + 1], a, bb[2], bb[3]);
  }
}
