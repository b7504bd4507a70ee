// Per-thread accumulator-fragment steps shared by the Hopper attention kernels (flash_fwd_sm90.cu
// and its warp-specialized variant flash_fwd_sm90_ws.cu; flash_bwd_sm90.cu and flash_bwd_sm90_ws.cu):
// the forward's online softmax of an S tile, O rescale + P re-pack and O / lse store; the
// backward's P^T and dS^T on the transposed accumulators. Each thread holds accumulator rows
// a = 16 wr + g and b = a + 8 of its warp; element 4i + e of an m64nN f32 fragment is row
// (e < 2 ? a : b), column 8i + 2t + (e & 1). Moved here from those kernels (PTX byte-identical).
// Include only from files compiled with -arch=compute_90a.
#pragma once
#include "wgmma.cuh"

// ---- forward ------------------------------------------------------------------------------------
// S = Q K^T for the 64 query rows [64w, 64w + 64) of the BQ-row Q tile at q_sa and the BK-key K
// stage at ka_st (both K-major): D/16 wgmma into s, not committed.
template <typename T, int D, int BQ, int BK>
__device__ __forceinline__ void fwd_sm90_issue_s(float (&s)[BK / 2], uint32_t q_sa, uint32_t ka_st, int w) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t qa = q_sa + (uint32_t)((kk >> 2) * BQ * 128 + w * 64 * 128 + (kk & 3) * 32);
    const uint32_t ka = ka_st + (uint32_t)((kk >> 2) * BK * 128 + (kk & 3) * 32);
    wg_ss<BK, T>(s, sw128_desc(qa, 16, 1024), sw128_desc(ka, 16, 1024), 1);
  }
}

// O += P V (64 x D) with P = pa (A fragments) and V from the BK-key stage at va_st (MN-major):
// BK/16 wgmma, not committed.
template <typename T, int D, int BK>
__device__ __forceinline__ void fwd_sm90_issue_pv(float (&o)[D / 2], const uint32_t (&pa)[BK / 16][4], uint32_t va_st) {
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk)
    wg_rs<D, T>(o, pa[kk], sw128_desc(va_st + (uint32_t)(kk * 2048), BK * 128, 1024), 1);
}

// Scale (log2 domain), mask and online softmax of the S tile of keys [k0, k0 + BK) in s (element
// 4i + e: row (e < 2 ? a : b), key k0 + 8i + 2t + (e & 1)); s becomes P. Keys [0, w_full) are
// visible to every row of the warpgroup, row a / b sees keys [0, lim_a / lim_b). Updates the running
// row max m (log2 domain) and per-thread partial row sums l (quad-reduced by fwd_sm90_store);
// returns the rescale factors al of O.
// BAND (the `_band_` entries): row a / b sees keys [lo_a / lo_b, lim_a / lim_b) instead, and a tile
// needs no test only if also w_lo (lo of the warpgroup's last row, the largest) <= k0.
template <int BK, bool BAND = false>
__device__ __forceinline__ void fwd_sm90_softmax(float (&s)[BK / 2], int k0, int w_full, int lim_a, int lim_b,
                                                 int t, float sl2, float& m_a, float& m_b, float& l_a,
                                                 float& l_b, float& al_a, float& al_b, int lo_a = 0,
                                                 int lo_b = 0, int w_lo = 0) {
  constexpr int NS = BK / 2;
  const bool full_tile = k0 + BK <= w_full && (!BAND || w_lo <= k0);
  const int ca = lim_a - k0 - 2 * t, cb = lim_b - k0 - 2 * t;
  // band: key c (relative to k0 + 2t) is visible iff la <= c < ca: one unsigned compare
  const int la = lo_a - k0 - 2 * t, lb = lo_b - k0 - 2 * t;
  float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
  for (int i = 0; i < NS / 4; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[4 * i + e] * sl2;
      if constexpr (BAND) {
        const int l0 = e < 2 ? la : lb;
        if (!full_tile && (unsigned)(8 * i + (e & 1) - l0) >= (unsigned)((e < 2 ? ca : cb) - l0)) x = -INFINITY;
      } else {
        if (!full_tile && 8 * i + (e & 1) >= (e < 2 ? ca : cb)) x = -INFINITY;
      }
      s[4 * i + e] = x;
    }
    mx_a = fmaxf(mx_a, fmaxf(s[4 * i], s[4 * i + 1]));
    mx_b = fmaxf(mx_b, fmaxf(s[4 * i + 2], s[4 * i + 3]));
  }
  const float mn_a = fmaxf(m_a, cp_quad_max(mx_a)), mn_b = fmaxf(m_b, cp_quad_max(mx_b));
  // Row with nothing visible yet: subtract 0 instead of -inf (every s is -inf -> p = 0, no NaN).
  const float mo_a = mn_a == -INFINITY ? 0.f : mn_a, mo_b = mn_b == -INFINITY ? 0.f : mn_b;
  al_a = cp_exp2(m_a - mo_a);
  al_b = cp_exp2(m_b - mo_b);
  float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
  for (int i = 0; i < NS / 4; ++i) {
    s[4 * i] = cp_exp2(s[4 * i] - mo_a);
    s[4 * i + 1] = cp_exp2(s[4 * i + 1] - mo_a);
    s[4 * i + 2] = cp_exp2(s[4 * i + 2] - mo_b);
    s[4 * i + 3] = cp_exp2(s[4 * i + 3] - mo_b);
    sum_a += s[4 * i] + s[4 * i + 1];
    sum_b += s[4 * i + 2] + s[4 * i + 3];
  }
  l_a = l_a * al_a + sum_a;  // per-thread partial row sums, quad-reduced at the end
  l_b = l_b * al_b + sum_b;
  m_a = mn_a;
  m_b = mn_b;
}

// O *= alpha, then P (tile just softmaxed) re-packed as A fragments: k-step kk covers keys
// 16kk .. 16kk+15 = accumulator blocks 2kk, 2kk+1. Only once no wgmma uses O or pa.
template <typename T, int NO, int NP, int NS>
__device__ __forceinline__ void fwd_sm90_rescale_pack(float (&o)[NO], uint32_t (&pa)[NP][4], const float (&s)[NS],
                                                      float al_a, float al_b) {
#pragma unroll
  for (int i = 0; i < NO / 4; ++i) {
    o[4 * i] *= al_a;
    o[4 * i + 1] *= al_a;
    o[4 * i + 2] *= al_b;
    o[4 * i + 3] *= al_b;
  }
  acc_to_a<T>(pa, s);
}

// O / l into rows ra, rb of head h of the destination (CpFwdDst: stored, or folded into a running
// state), and lse = (m + log2 l) ln 2 (l = 0, nothing visible: O 0, lse -inf); rows >= T are not
// stored (cp_fwd_store_quad, common.cuh).
template <int D, int NO>
__device__ __forceinline__ void fwd_sm90_store(const float (&o)[NO], float m_a, float m_b, float l_a, float l_b,
                                               const CpFwdDst& dst, int b, int h, int H, int T_, int ra, int t) {
  const float la = cp_quad_sum(l_a), lb = cp_quad_sum(l_b);
  const float inv_a = la > 0.f ? 1.f / la : 0.f, inv_b = lb > 0.f ? 1.f / lb : 0.f;
  cp_fwd_store_quad<NO / 4>(dst, [&](int i, int e) { return o[4 * i + e]; }, inv_a, inv_b,
                            la > 0.f ? (m_a + log2f(la)) * CP_LN2 : -INFINITY, lb > 0.f ? (m_b + log2f(lb)) * CP_LN2 : -INFINITY,
                            b, h, H, D, ra, T_, t);
}

// ---- backward (dK / dV kernels: transposed accumulators, rows = keys, columns = queries) --------
// S^T = K_w Q^T, then dP^T = V_w dO^T for the 64 keys [64w, 64w + 64) of the block's K / V tiles
// (BN rows, K-major) and the BQ queries of stage qa / da: D/16 wgmma each, two commit groups.
template <typename T, int D, int BN, int BQ>
__device__ __forceinline__ void bwd_sm90_issue_s_dp(float (&s)[BQ / 2], float (&dp)[BQ / 2], uint32_t k_sa,
                                                    uint32_t v_sa, uint32_t qa, uint32_t da, int w) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t ko = (uint32_t)((kk >> 2) * BN * 128 + w * 64 * 128 + (kk & 3) * 32);
    const uint32_t qo = (uint32_t)((kk >> 2) * BQ * 128 + (kk & 3) * 32);
    wg_ss<BQ, T>(s, sw128_desc(k_sa + ko, 16, 1024), sw128_desc(qa + qo, 16, 1024), 1);
  }
  wg_commit();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t ko = (uint32_t)((kk >> 2) * BN * 128 + w * 64 * 128 + (kk & 3) * 32);
    const uint32_t qo = (uint32_t)((kk >> 2) * BQ * 128 + (kk & 3) * 32);
    wg_ss<BQ, T>(dp, sw128_desc(v_sa + ko, 16, 1024), sw128_desc(da + qo, 16, 1024), 1);
  }
  wg_commit();
}

// P^T = exp2(S^T * sl2 - lse2) in place (element 4i + e: key row a/b, query i0 + 8i + 2t + (e & 1);
// ls = the tile's lse2). need_mask: key position kp_a / kp_b past the query's -> 0 (causal);
// ragged: keys past S (kok_a / kok_b false) -> 0.
// (flash_bwd_sm90.cu keeps its own copy of this loop: there the call changes the PTX, register
// numbering and operand order of a few instructions, which the refactor keeps byte-identical.)
template <int NS>
__device__ __forceinline__ void bwd_sm90_p(float (&s)[NS], const float* ls, float sl2, int t, int i0,
                                           CpMask mask, bool need_mask, long long kp_a, long long kp_b,
                                           bool ragged, bool kok_a, bool kok_b) {
#pragma unroll
  for (int i = 0; i < NS / 4; ++i) {
    const float2 l2 = *reinterpret_cast<const float2*>(ls + 8 * i + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = cp_exp2(fmaf(s[4 * i + e], sl2, -((e & 1) ? l2.y : l2.x)));
      if (need_mask && (e < 2 ? kp_a : kp_b) > mask.qpos(i0 + 8 * i + 2 * t + (e & 1))) p = 0.f;
      if (ragged && !(e < 2 ? kok_a : kok_b)) p = 0.f;
      s[4 * i + e] = p;
    }
  }
}

// Band bounds of this thread's rows ra, rb and of its 64-row warpgroup from wrow0, in a band
// kernel whose key tiles start at kb (the tile holding lo of the block's first row; every bound
// relative to kb, rows past T take row T - 1's): row a / b sees keys [lo_a / lo_b, lim_a / lim_b);
// keys [0, w_full) are seen by the warpgroup's first row; w_lo = lo of its last row; w_end = hi
// of its last row (0 for a warpgroup past T). The forward (flash_fwd_sm90.cu,
// flash_fwd_sm90_ws.cu) and the dQ kernel (flash_bwd_sm90.cu) of the Hopper band entries.
struct Sm90BandRows {
  int w_end, w_full, lim_a, lim_b, lo_a, lo_b, w_lo;
};
__device__ __forceinline__ Sm90BandRows sm90_band_rows(const CpBand& band, int kb, int wrow0, int ra, int rb, int T_,
                                                       int S) {
  const int last = T_ - 1;
  Sm90BandRows r;
  r.w_end = wrow0 < T_ ? band.kend(min(wrow0 + 64, T_) - 1, S) - kb : 0;
  r.w_full = band.kend(min(wrow0, last), S) - kb;
  r.lim_a = band.kend(min(ra, last), S) - kb, r.lim_b = band.kend(min(rb, last), S) - kb;
  r.lo_a = band.kbegin(min(ra, last)) - kb, r.lo_b = band.kbegin(min(rb, last)) - kb;
  r.w_lo = band.kbegin(min(wrow0 + 63, last)) - kb;
  return r;
}

// bwd_sm90_p under a band (the `_band_` entries). The query rows that see key j form one interval,
// [qbegin(j), qend(j + 1)) (both bounds of the band are non-decreasing), found once per block for
// this thread's two keys (bwd_sm90_key_rows): where need_mask, P^T = 0 outside it. Element 4i + e is
// key a (e < 2) or b and query i0 + 8i + 2t + (e & 1). Keys past S see no row.
__device__ __forceinline__ void bwd_sm90_key_rows(const CpBand& band, int j, int S, int T_, int& q_lo, int& q_hi) {
  if (j >= S) {
    q_lo = q_hi = 0;
    return;
  }
  q_lo = band.qbegin(j, T_), q_hi = band.qend(j + 1, T_);
}
template <int NS>
__device__ __forceinline__ void bwd_sm90_p_band(float (&s)[NS], const float* ls, float sl2, int t, int i0, bool need_mask,
                                                int qa_lo, int qa_hi, int qb_lo, int qb_hi, bool ragged, bool kok_a,
                                                bool kok_b) {
  // query c = 8i + (e & 1) relative to i0 + 2t is visible from key a iff (unsigned)(c - ua) < wa
  const int ua = qa_lo - i0 - 2 * t, ub = qb_lo - i0 - 2 * t;
  const unsigned wa = (unsigned)max(qa_hi - qa_lo, 0), wb = (unsigned)max(qb_hi - qb_lo, 0);
#pragma unroll
  for (int i = 0; i < NS / 4; ++i) {
    const float2 l2 = *reinterpret_cast<const float2*>(ls + 8 * i + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = cp_exp2(fmaf(s[4 * i + e], sl2, -((e & 1) ? l2.y : l2.x)));
      if (need_mask && (unsigned)(8 * i + (e & 1) - (e < 2 ? ua : ub)) >= (e < 2 ? wa : wb)) p = 0.f;
      if (ragged && !(e < 2 ? kok_a : kok_b)) p = 0.f;
      s[4 * i + e] = p;
    }
  }
}

// dS^T = P^T (dP^T - delta) in place in dp (dls = the tile's delta).
template <int NS>
__device__ __forceinline__ void bwd_sm90_ds(float (&dp)[NS], const float (&p)[NS], const float* dls, int t) {
#pragma unroll
  for (int i = 0; i < NS / 4; ++i) {
    const float2 d2 = *reinterpret_cast<const float2*>(dls + 8 * i + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[4 * i + e] = p[4 * i + e] * (dp[4 * i + e] - ((e & 1) ? d2.y : d2.x));
  }
}

// dS^T (the rounded values of dsa) into the dS tile at ds, transposed: dS [query][key] in the SW128
// K-major layout (BQ rows; keys of warpgroup / consumer w = column block w). One stmatrix .x4 .trans
// per 16 queries: dsa[kk][i] is the m16n8 fragment of keys kl0 + 8 (i & 1) (row g) and queries
// 16 kk + 8 (i >> 1) (columns 2t, 2t + 1), i.e. 8x8 matrix i; stored transposed, row j of matrix i is
// query 16 kk + 8 (i >> 1) + j holding its 8 keys, one 16-byte chunk of the swizzled row. Lane l
// gives that row's address (i = l / 8, j = l % 8). The 8 rows of a matrix are 8 different 16-byte
// chunks (the swizzle XORs in j) of rows 128 bytes apart: 8 bank quads, one wavefront per matrix
// (the emulator checks it).
template <int BQ>
__device__ __forceinline__ void bwd_sm90_ds_store(const uint32_t (&dsa)[BQ / 16][4], uint32_t ds, int w, int wr,
                                                  int lane) {
  const int i = lane >> 3, j = lane & 7;
  const uint32_t a0 = ds + (uint32_t)(w * BQ * 128 + (8 * (i >> 1) + j) * 128 + ((((2 * wr + (i & 1)) ^ j) & 7) << 4));
#pragma unroll
  for (int kk = 0; kk < BQ / 16; ++kk) cp_stsm_x4_trans(a0 + (uint32_t)(kk * 16 * 128), dsa[kk]);
}

// Store dK (times scale) and dV rows ja, ja + 8 (< S) of KV head kvh into dk / dv [B, S, Hkv, D]
// (accumulate != 0: added to what is there): element 4i + e is row (e < 2 ? ja : ja + 8),
// d = 8i + 2t + (e & 1).
template <int D, int NA>
__device__ __forceinline__ void bwd_sm90_store_dkdv(const float (&acc_k)[NA], const float (&acc_v)[NA],
                                                    float* __restrict__ dk, float* __restrict__ dv, int b, int S,
                                                    int Hkv, int kvh, int ja, int t, float scale, int accumulate) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j = ja + 8 * half;
    if (j >= S) continue;
    const size_t gi = (((size_t)b * S + j) * Hkv + kvh) * D + 2 * t;
#pragma unroll
    for (int i = 0; i < NA / 4; ++i) {
      float2 kx = make_float2(acc_k[4 * i + 2 * half] * scale, acc_k[4 * i + 2 * half + 1] * scale);
      float2 vx = make_float2(acc_v[4 * i + 2 * half], acc_v[4 * i + 2 * half + 1]);
      float2* pk = reinterpret_cast<float2*>(dk + gi + 8 * i);
      float2* pv = reinterpret_cast<float2*>(dv + gi + 8 * i);
      if (accumulate) {
        const float2 ok = *pk, ov = *pv;
        kx.x += ok.x, kx.y += ok.y, vx.x += ov.x, vx.y += ov.y;
      }
      *pk = kx;
      *pv = vx;
    }
  }
}
