// Flash-attention forward with log-sum-exp.
// Rust caller: candle_cp_kernels::flash::fwd (src/flash.rs), used by the attention op's
//   cuda_fwd in crates/candle-cp-ops/src/attention/cuda.rs; flash::fwd_fold / fwd_band_fold
//   (src/flash/fold.rs: the result folded into the ring's running state, CpFwdDst in common.cuh).
// CPU reference: candle_cp_ops::attention::attention_fwd (and attention_slow).
// Band entries (`flash_fwd_{simple,pipe}_band_*`: one key interval per query row, CpBand in
//   common.cuh): Rust caller candle_cp_kernels::flash::fwd_band (src/flash/band.rs), CPU
//   reference candle_cp_ops::attention::attention_fwd_band; design notes in docs/kernels.md.
//
// q [B, T, H, D], k/v [B, S, Hkv, D] (contiguous, element type T), out f32 [B, T, H, D],
// lse f32 [B, H, T] (natural log). Query head h reads KV head h / (H / Hkv) (GQA).
// Mask: see CpMask in common.cuh. A row that sees no key gets out = 0 and lse = -inf.
// Soft cap (`cap` > 0, Gemma 2's attn_logit_softcapping; the simple and pipe entries, 0 = none):
//   the logit is cap * tanh(scale * q.k / cap) (CPU reference: candle_cp_ops::attention::Scores).
//
// Three implementations:
// - `flash_fwd_simple_*`: CUDA cores, f32 math, every dtype (f32/f16/bf16). Block = 4 warps x 4
//   query rows; lane j of a warp scores key j of a 32-key tile; online softmax per row.
// - `flash_fwd_mma_*`: tensor cores (mma.sync m16n8k16, f32 accumulate), f16/bf16. Block = 4
//   warps x 16 query rows; 64-key tiles in shared memory; FlashAttention-2 register layout
//   (S and P never leave registers; P is re-packed from the C fragment into the A fragment).
// - `flash_fwd_pipe_*`: the same math with a FlashAttention-2 pipeline, f16/bf16. Block = 4 warps
//   x 32 query rows; K/V tiles copied global -> shared with cp.async, double-buffered (next tile
//   in flight while the current one is used); fragments loaded with ldmatrix (.trans for V,
//   which stays row-major); padded shared rows (bank-conflict free). Simulated in
//   sim/fwd_pipe_sim.py; design notes in docs/kernels.md ("Forward kernel pipeline").
#include "common.cuh"

// ------------------------------------------------------------------ CUDA-core version
// M: CpMask, or CpBand (the `_band_` entries: keys from the tile of the block's first lo on).
template <typename T, int D, typename M>
__device__ __forceinline__ void fwd_simple(const T* __restrict__ q, const T* __restrict__ k,
                                           const T* __restrict__ v, CpFwdDst dst, int B, int T_,
                                           int S, int H, int Hkv, float scale, float cap, M mask) {
  constexpr int NW = 4, R = 4, BK = 32, DP = D + 1, DL = (D + 31) / 32;
  // k_s [BK][DP], v_s [BK][D], q_s [NW * R][D]: (80 D + 32) floats (CORE_FWD_SMEM in src/flash/core.rs)
  float* const k_s = cp_core_smem<BK * DP + BK * D + NW * R * D>();
  float* const v_s = k_s + BK * DP;
  float* const q_s = v_s + BK * D;
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
  int s_end = last_row < 0 ? 0 : mask.kend(last_row, S);
  const int k_first = M::BAND ? mask.kbegin(row0) / BK * BK : 0;  // row0 < T_ (grid ceil(T/16))

  for (int k0 = k_first; k0 < s_end; k0 += BK) {
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
      const float x = cap > 0.f ? cap * tanhf(s[r] * scale / cap) * CP_LOG2E : s[r] * sl2;
      float sv = vis ? x : -INFINITY;
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
    float* orow = dst.out_row(b, i, h, H, D);
    float* lp = dst.lse_at(b, h, H, i);
    const CpFold f = cp_fold(dst.merge, dst.merge ? *lp : 0.f, any ? (m[r] + log2f(l[r])) * CP_LN2 : -INFINITY);
#pragma unroll
    for (int c = 0; c < DL; ++c) {
      float* p = orow + lane + 32 * c;
      if (D % 32 == 0 || lane + 32 * c < D) *p = cp_fold_val(dst.merge, f, p, o[r][c] * inv);
    }
    if (dst.merge) __syncwarp();  // every lane read the old lse before lane 0 replaces it
    if (lane == 0) *lp = f.lse;
  }
}

// ------------------------------------------------------------------ tensor-core version
template <typename T, int D>
__device__ __forceinline__ void fwd_mma(const T* __restrict__ q, const T* __restrict__ k,
                                        const T* __restrict__ v, CpFwdDst dst, int B, int T_,
                                        int S, int H, int Hkv, float scale, CpMask mask) {
  constexpr int BQ = 64, BK = 64, DP = D + 8, KP = BK + 8, DC = D / 16, DT = D / 8, NT = BK / 8;
  __shared__ __align__(16) T k_s[BK * DP];  // K tile, row-major [key][d]
  __shared__ __align__(16) T vt_s[D * KP];  // V tile, transposed [d][key]
  CP_EMU_POISON(k_s, vt_s);
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
      T ve[8];  // memcpy, not a T* into vv: reading a uint4 through T lvalues breaks strict aliasing
      memcpy(static_cast<void*>(ve), &vv, 16);
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
  cp_fwd_store_quad<D / 8>(dst, [&](int i, int e) { return o[i][e]; }, inv_a, inv_b,
                           l_a > 0.f ? (m_a + log2f(l_a)) * CP_LN2 : -INFINITY,
                           l_b > 0.f ? (m_b + log2f(l_b)) * CP_LN2 : -INFINITY, b, h, H, D, ra, T_, t);
}

// ------------------------------------------------------------------ pipelined tensor-core version

// Copy ROWS rows of D elements (16-bit) from global `src` (row r at src + r * rstride) into shared
// `dst` (row stride D + 8 elements) with 16-byte cp.async; rows >= rows_valid are zero-filled.
// Thread tid copies chunks c = tid % (D/8) of rows tid / (D/8) + i * RSTEP, RSTEP = NTH / (D/8)
// rows per step. Where the D/8 chunks of a row do not divide NTH (D = 96: 12 chunks, 10 rows per
// step of 128 threads) the last NTH % (D/8) threads copy nothing: each thread keeps one source
// pointer and one shared address, as at the other head dims (a per-chunk row / column split
// costs the d96 forward its last registers: 8-36 bytes of spill on sm_80).
template <int ROWS, int D, int NTH, typename T>
__device__ __forceinline__ void fwd_pipe_load(uint32_t dst, const T* __restrict__ src, size_t rstride,
                                              int r0, int rows_valid, int tid) {
  constexpr int CH = D / 8, DP = D + 8, RSTEP = NTH / CH, ITER = (ROWS + RSTEP - 1) / RSTEP;
  static_assert(RSTEP >= 1, "a block must copy at least one row per step");
  const int c = tid % CH, rr = tid / CH;
  if constexpr (NTH % CH != 0)
    if (rr >= RSTEP) return;
  const T* p = src + (size_t)(r0 + rr) * rstride + c * 8;
  dst += (uint32_t)((rr * DP + c * 8) * 2);
#pragma unroll
  for (int i = 0; i < ITER; ++i) {
    if (ROWS % RSTEP == 0 || rr + i * RSTEP < ROWS) {
      const bool valid = r0 + rr + i * RSTEP < rows_valid;
      cp_async16(dst + (uint32_t)(i * RSTEP * DP * 2), valid ? p + (size_t)i * RSTEP * rstride : src, valid);
    }
  }
}

// One int per query row of the block in the padding of its Q tile row (elements D .. D+7: 16
// bytes that no cp.async or ldmatrix touches; `base` = row 0's first padding byte, + 4 for the
// second int): fwd_pipe's lim_s / lo_s at D = 256.
template <int STRIDE>
struct CpPadInts {
  unsigned char* base;
  __device__ __forceinline__ int& operator[](int r) const { return *reinterpret_cast<int*>(base + r * STRIDE); }
};

// Block = NW warps; warp w owns query rows [w*MT*16, (w+1)*MT*16) of the block's BQ = NW*MT*16
// rows (MT m16 row tiles). K/V tiles of BK keys. Dynamic shared memory, row stride D + 8
// elements (odd multiple of 16 bytes: ldmatrix / cp.async phases are bank-conflict free):
//   q_s [BQ][D+8] | k_s [2][BK][D+8] | v_s [2][BK][D+8] | lim_s [BQ] int
//   ((BQ + 4*BK) * (D+8) * 2 + BQ * 4 bytes; a band's lo_s: BQ ints more). At D = 256 lim_s and
//   lo_s live in q_s's row padding instead (CpPadInts), so the block takes (BQ + 4*BK) * (D+8) * 2
//   = 101,376 bytes, band or not: sm_86 / sm_89 / sm_120's maximum per block. (The
//   padded layout at D = 128 makes the band entry spill 4-8 bytes on sm_80, hence only at 256.)
// Pipeline per key tile j (K and V double-buffered, buffer j % 2):
//   wait(K_j, V_j) + barrier -> issue K_{j+1}, V_{j+1} into buffer (j+1) % 2
//   -> S = Q K_j^T -> mask + online softmax -> O += P V_j,
// so tile j+1 lands while tile j is computed; one barrier per tile (it also tells that every
// warp is done with tile j-1, the previous user of buffer (j+1) % 2).
// Q fragments: kept in registers when MT*D <= 128, else re-read from q_s with ldmatrix per tile.
// Requires scale > 0 (the launcher runs fwd_mma otherwise).
// M = CpBand (`_band_` entries): the tiles start at the one holding lo of the block's first row;
// a warp skips tiles below its first row's lo, and a tile needs no mask test when every row of
// the warp sees all of it (lo of the last row <= k0, k0 + BK <= hi of the first row).
// CAP: the soft-capped variant (`flash_fwd_pipe_cap{,_band}_*`, PIPES_CAP): the cap's code only
// there, so the uncapped entries keep their registers (d128 sits at 255 without a spill).
template <typename T, int D, int NW, int MT, int BK, bool CAP, typename M>
__device__ __forceinline__ void fwd_pipe(const T* __restrict__ q, const T* __restrict__ k,
                                         const T* __restrict__ v, CpFwdDst dst, int B, int T_,
                                         int S, int H, int Hkv, float scale, float cap, M mask) {
  constexpr int NTH = NW * 32, BQ = NW * MT * 16, DP = D + 8, DC = D / 16, DT = D / 8, NT = BK / 8;
  constexpr bool QREG = MT * D <= 128;
  CP_DYN_SMEM(unsigned char, fwd_pipe_smem);
  constexpr uint32_t TILE_B = BK * DP * 2;  // bytes of one K or V buffer
  const uint32_t q_sa = cp_smem_u32(fwd_pipe_smem), k_sa = q_sa + BQ * DP * 2, v_sa = k_sa + 2 * TILE_B;
  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / Hkv);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  // Highest query block first: under a causal mask the last blocks carry the most keys, so the
  // final wave of the grid gets the light ones.
  const int row0 = (gridDim.x - 1 - blockIdx.x) * BQ, wrow0 = row0 + warp * MT * 16;
  const float sl2 = scale * CP_LOG2E;
  // Soft cap: raw score x (masked: -inf) -> cap * tanh(x * scale / cap) in the log2 domain.
  const float sc = CAP ? scale / cap : 0.f, capl2 = cap * CP_LOG2E;
  auto cap_l2 = [sc, capl2](float x) { return x == -INFINITY ? -INFINITY : capl2 * cp_tanh_fast(x * sc); };

  // Keys [0, n_tiles * BK) hold every key some row of the block sees; [0, w_end) of this warp.
  // Band: key indices below are relative to kb, the start of the tile holding lo of the block's
  // first row (K/V pointers, S and every bound shifted by kb; 0 without a band).
  const int kb = M::BAND ? mask.kbegin(row0) / BK * BK : 0;
  const int n_tiles = (mask.kend(min(row0 + BQ, T_) - 1, S) - kb + BK - 1) / BK;
  const int w_end = wrow0 < T_ ? mask.kend(min(wrow0 + MT * 16, T_) - 1, S) - kb : 0;
  // Keys [0, w_full) are visible to every row of the warp (to its first row, hence to all).
  const int w_full = mask.kend(M::BAND ? min(wrow0, T_ - 1) : wrow0, S) - kb;
  // lim_s[r] = key_end of block row r: row r sees exactly keys [0, lim_s[r]) (positions increase
  // with the index). Read only for tiles that need a mask test; visible after the first barrier.
  auto lim_s = [&] {
    if constexpr (D == 256) return CpPadInts<DP * 2>{fwd_pipe_smem + D * 2};
    else return reinterpret_cast<int*>(fwd_pipe_smem + (BQ + 4 * BK) * DP * 2);
  }();
  for (int r = tid; r < BQ; r += NTH) lim_s[r] = mask.kend(M::BAND ? min(row0 + r, T_ - 1) : row0 + r, S) - kb;
  // Band: lo_s[r] = lo of block row r (BQ more ints of dynamic shared memory; D = 256: the next
  // int of the row's padding); row r sees keys [lo_s[r], lim_s[r]). Rows past T repeat row T - 1.
  auto lo_s = [&] {
    if constexpr (D == 256) return CpPadInts<DP * 2>{fwd_pipe_smem + D * 2 + 4};
    else return lim_s + BQ;
  }();
  if constexpr (M::BAND)
    for (int r = tid; r < BQ; r += NTH) lo_s[r] = mask.kbegin(min(row0 + r, T_ - 1)) - kb;

  const size_t kv_rs = (size_t)Hkv * D;
  // K and V of (b, kvh) start at the same element offset: one 64-bit register pair across the
  // loop instead of two pointers (this removes a 4-byte spill of the d128 kernel on sm_80).
  const size_t kv_off = ((size_t)b * S * Hkv + kvh) * D + (size_t)kb * kv_rs;
  const int s_rel = S - kb;  // keys left from kb

  // Per-lane ldmatrix row addresses: lane l feeds row l % 8 of matrix l / 8.
  const int mi = lane >> 3, mr = lane & 7;
  const uint32_t q_la = q_sa + (uint32_t)(((warp * MT * 16 + (mi & 1) * 8 + mr) * DP + (mi >> 1) * 8) * 2);
  const uint32_t k_la = k_sa + (uint32_t)((((mi >> 1) * 8 + mr) * DP + (mi & 1) * 8) * 2);
  const uint32_t v_la = v_sa + (uint32_t)((((mi & 1) * 8 + mr) * DP + (mi >> 1) * 8) * 2);

  float o[MT][DT][4];
  float m_r[MT][2], l_r[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m_r[mt][0] = m_r[mt][1] = -INFINITY;
    l_r[mt][0] = l_r[mt][1] = 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
  }
  uint32_t qa[QREG ? MT : 1][QREG ? DC : 1][4];

  if (n_tiles > 0) {
    fwd_pipe_load<BQ, D, NTH>(q_sa, q + ((size_t)b * T_ * H + h) * D, (size_t)H * D, row0, T_, tid);
    fwd_pipe_load<BK, D, NTH>(k_sa, k + kv_off, kv_rs, 0, s_rel, tid);
    fwd_pipe_load<BK, D, NTH>(v_sa, v + kv_off, kv_rs, 0, s_rel, tid);
    cp_async_commit();
  }
  for (int j = 0; j < n_tiles; ++j) {
    const int k0 = j * BK;
    const uint32_t cur = (j & 1) * TILE_B, nxt = TILE_B - cur;
    cp_async_wait<0>();
    __syncthreads();  // tile j (and Q) visible to all; every warp is done with tile j-1
    if (j + 1 < n_tiles) {
      fwd_pipe_load<BK, D, NTH>(k_sa + nxt, k + kv_off, kv_rs, k0 + BK, s_rel, tid);
      fwd_pipe_load<BK, D, NTH>(v_sa + nxt, v + kv_off, kv_rs, k0 + BK, s_rel, tid);
      cp_async_commit();
    }
    if (QREG && j == 0) {
#pragma unroll
      for (int mt = 0; mt < (QREG ? MT : 1); ++mt)
#pragma unroll
        for (int kc = 0; kc < (QREG ? DC : 1); ++kc) cp_ldsm_x4(qa[mt][kc], q_la + (uint32_t)((mt * 16 * DP + kc * 16) * 2));
    }
    // Warp-uniform: no row of this warp sees a key of the tile. Band: nor when the tile ends at
    // or before lo of the warp's first row (the smallest lo of the warp), e.g. in a short
    // document of the block's other warps. The band reads its bounds from shared memory (w_end =
    // lim_s of the warp's last row unless the warp starts past T) rather than keeping them live.
    if constexpr (M::BAND) {
      if (k0 >= lim_s[warp * MT * 16 + MT * 16 - 1] || k0 + BK <= lo_s[warp * MT * 16] ||
          ((int)cp_nctaid_x() - 1 - (int)cp_ctaid_x()) * BQ + warp * MT * 16 >= T_)
        continue;
    } else if (k0 >= w_end) {
      continue;
    }
    float s[MT][NT][4];
    {  // S = Q K_j^T
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < DC; ++kc) {
        uint32_t qf[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (QREG) {
            qf[mt][0] = qa[mt][kc][0], qf[mt][1] = qa[mt][kc][1], qf[mt][2] = qa[mt][kc][2], qf[mt][3] = qa[mt][kc][3];
          } else {
            cp_ldsm_x4(qf[mt], q_la + (uint32_t)((mt * 16 * DP + kc * 16) * 2));
          }
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t kf[4];  // b0, b1 of key n-tiles 2np and 2np+1 for d chunk kc
          cp_ldsm_x4(kf, k_la + cur + (uint32_t)((np * 16 * DP + kc * 16) * 2));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            cp_mma16816<T>(s[mt][2 * np], qf[mt], kf[0], kf[1]);
            cp_mma16816<T>(s[mt][2 * np + 1], qf[mt], kf[2], kf[3]);
          }
        }
      }
    }

    // Mask (raw scores; the scale enters in the exp2 below, which needs scale > 0: row maxima are
    // taken before scaling). A tile below the diagonal of every row of the warp needs no test.
    // (band: and lo of the warp's last row <= k0)
    // (band: w_full = lim_s of the warp's first row, read here rather than kept in a register)
    const bool full_tile = M::BAND ? k0 + BK <= lim_s[warp * MT * 16] && lo_s[warp * MT * 16 + MT * 16 - 1] <= k0
                                   : k0 + BK <= w_full;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (!full_tile) {
        // Key k0 + c, c = nt*8 + 2t + (e&1), is visible to row a iff c < lim_s[a] - k0.
        const int ca = lim_s[warp * MT * 16 + mt * 16 + g] - k0 - 2 * t;
        const int cb = lim_s[warp * MT * 16 + mt * 16 + g + 8] - k0 - 2 * t;
        if constexpr (M::BAND) {  // ... and c >= la = lo_s[a] - k0 - 2t: one unsigned compare
          const int la = lo_s[warp * MT * 16 + mt * 16 + g] - k0 - 2 * t;
          const int lb = lo_s[warp * MT * 16 + mt * 16 + g + 8] - k0 - 2 * t;
          const unsigned wa = (unsigned)(ca - la), wb = (unsigned)(cb - lb);  // lo <= hi
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if ((unsigned)(nt * 8 + (e & 1) - (e < 2 ? la : lb)) >= (e < 2 ? wa : wb)) s[mt][nt][e] = -INFINITY;
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (nt * 8 + (e & 1) >= (e < 2 ? ca : cb)) s[mt][nt][e] = -INFINITY;
        }
      }
      float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mx_a = fmaxf(mx_a, fmaxf(s[mt][nt][0], s[mt][nt][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[mt][nt][2], s[mt][nt][3]));
      }
      // Running max in the log2 domain (-inf * sl2 = -inf). Soft cap: the capped logit of the raw
      // maximum (cap * tanh(x * scale / cap) increases with x, scale > 0), each score capped as it
      // is exponentiated below (no extra live registers: d128 sits at 255).
      const float mn_a = fmaxf(m_r[mt][0], CAP ? cap_l2(cp_quad_max(mx_a)) : cp_quad_max(mx_a) * sl2);
      const float mn_b = fmaxf(m_r[mt][1], CAP ? cap_l2(cp_quad_max(mx_b)) : cp_quad_max(mx_b) * sl2);
      // Row with nothing visible yet: subtract 0 instead of -inf (every s is -inf -> p = 0, no NaN).
      const float mo_a = mn_a == -INFINITY ? 0.f : mn_a, mo_b = mn_b == -INFINITY ? 0.f : mn_b;
      // alpha = 1 exactly when the running max did not move (then O needs no rescale).
      const float al_a = mn_a == m_r[mt][0] ? 1.f : cp_exp2(m_r[mt][0] - mo_a);
      const float al_b = mn_b == m_r[mt][1] ? 1.f : cp_exp2(m_r[mt][1] - mo_b);
      float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if constexpr (CAP) {
          s[mt][nt][0] = cp_exp2(cap_l2(s[mt][nt][0]) - mo_a);
          s[mt][nt][1] = cp_exp2(cap_l2(s[mt][nt][1]) - mo_a);
          s[mt][nt][2] = cp_exp2(cap_l2(s[mt][nt][2]) - mo_b);
          s[mt][nt][3] = cp_exp2(cap_l2(s[mt][nt][3]) - mo_b);
        } else {
          s[mt][nt][0] = cp_exp2(fmaf(s[mt][nt][0], sl2, -mo_a));
          s[mt][nt][1] = cp_exp2(fmaf(s[mt][nt][1], sl2, -mo_a));
          s[mt][nt][2] = cp_exp2(fmaf(s[mt][nt][2], sl2, -mo_b));
          s[mt][nt][3] = cp_exp2(fmaf(s[mt][nt][3], sl2, -mo_b));
        }
        sum_a += s[mt][nt][0] + s[mt][nt][1];
        sum_b += s[mt][nt][2] + s[mt][nt][3];
      }
      l_r[mt][0] = l_r[mt][0] * al_a + sum_a;  // per-lane partial row sums, quad-reduced at the end
      l_r[mt][1] = l_r[mt][1] * al_b + sum_b;
      m_r[mt][0] = mn_a;
      m_r[mt][1] = mn_b;
      // Past the first tiles the max rarely moves: skip the O rescale when no row of the warp needs it.
      if (__any_sync(CP_FULL_MASK, al_a != 1.f || al_b != 1.f)) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][0] *= al_a;
          o[mt][dt][1] *= al_a;
          o[mt][dt][2] *= al_b;
          o[mt][dt][3] *= al_b;
        }
      }
    }
    // O += P V_j: P's C fragments re-packed as A fragments (16 keys per k step).
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t pf[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pf[mt][0] = cp_pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pf[mt][1] = cp_pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pf[mt][2] = cp_pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pf[mt][3] = cp_pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t vf[4];  // b0, b1 of d n-tiles 2dp and 2dp+1 for keys 16kk .. 16kk+15
        cp_ldsm_x4_trans(vf, v_la + cur + (uint32_t)((kk * 16 * DP + dp * 16) * 2));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          cp_mma16816<T>(o[mt][2 * dp], pf[mt], vf[0], vf[1]);
          cp_mma16816<T>(o[mt][2 * dp + 1], pf[mt], vf[2], vf[3]);
        }
      }
    }
  }

  // Re-derive the warp's first row here (volatile reads of %ctaid.x / %nctaid.x) so that it does
  // not stay live, or spilled, across the loop.
  const int wrow0e = ((int)cp_nctaid_x() - 1 - (int)cp_ctaid_x()) * BQ + warp * MT * 16;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ra = wrow0e + mt * 16 + g;
    const float la = cp_quad_sum(l_r[mt][0]), lb = cp_quad_sum(l_r[mt][1]);
    const float inv_a = la > 0.f ? 1.f / la : 0.f, inv_b = lb > 0.f ? 1.f / lb : 0.f;
    cp_fwd_store_quad<D / 8>(dst, [&](int i, int e) { return o[mt][i][e]; }, inv_a, inv_b,
                             la > 0.f ? (m_r[mt][0] + log2f(la)) * CP_LN2 : -INFINITY,
                             lb > 0.f ? (m_r[mt][1] + log2f(lb)) * CP_LN2 : -INFINITY, b, h, H, D, ra, T_, t);
  }
}

// ------------------------------------------------------------------ entry points
// Head dims 16, 32, 64, 128 (and 256 for simple). Launch: simple: grid (ceil(T/16), H, B), block
// 128, dynamic shared memory 0 up to d 128 and (80 d + 32) * 4 bytes at d 256 (cp_core_smem);
// mma: grid (ceil(T/64), H, B), block 128; pipe: grid (ceil(T/BQ), H, B), block NW*32, dynamic
// shared memory as below.
// o_T, o_row0, o_merge: CpFwdDst (a plain call: T, 0, 0).
#define FWD_ARGS                                                                              \
  const TY *q, const TY *k, const TY *v, float *out, float *lse, int B, int T_, int S, int H, \
      int Hkv, float scale, float cap, int causal, long long q_off, long long q_str,          \
      long long k_off, long long k_str, int o_T, int o_row0, int o_merge
#define FWD_DST CpFwdDst{out, lse, o_T, o_row0, o_merge}
#define FWD_CALL(IMPL, D)                                                                       \
  IMPL<TY, D>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale, CpMask{causal, q_off, q_str, k_off, k_str})
// Band entries (`flash_fwd_{simple,pipe}_band_*`, Rust caller src/flash/band.rs, CPU reference
// candle_cp_ops::attention::attention_fwd_band): the mask arguments replaced by the band (CpBand).
#define FWD_BAND_ARGS                                                                         \
  const TY *q, const TY *k, const TY *v, float *out, float *lse, int B, int T_, int S, int H, \
      int Hkv, float scale, float cap, CP_BAND_ARGS, int o_T, int o_row0, int o_merge

#define SIMPLE(NAME, D) \
  extern "C" __global__ void __launch_bounds__(128) flash_fwd_simple_##NAME##_d##D(FWD_ARGS) {                   \
    fwd_simple<TY, D>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale, cap, CpMask{causal, q_off, q_str, k_off, k_str}); \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) flash_fwd_simple_band_##NAME##_d##D(FWD_BAND_ARGS) { \
    fwd_simple<TY, D>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale, cap, CP_BAND_OF_BLOCK);                 \
  }
// (no soft cap: the launcher runs the simple or pipe entries for one; `cap` is 0 here)
#define MMA(NAME, D) \
  extern "C" __global__ void __launch_bounds__(128) flash_fwd_mma_##NAME##_d##D(FWD_ARGS) { FWD_CALL(fwd_mma, D); }
// Pipelined: block NW*32 threads, BQ = NW*MT*16 rows, dynamic shared memory (BQ + 4*BK) * (D + 8)
// * 2 + BQ * 4 bytes (band: + BQ * 4 more; D = 256: no ints, band or not); the Rust launcher
// (src/flash.rs, `pipe_config`, band.rs `pipe_band_smem`) mirrors these numbers and
// sim/fwd_pipe_sim.py parses them from PIPES. d128 at BK = 64 sits at 255 registers (ptxas 13.0,
// sm_80 / sm_90 / sm_90a: no spill); BK = 32 would cut 32 registers.
#define PIPE_ENTRIES(NAME, D, NW, MT, BK, KIND, CAP, CAPV)                                     \
  extern "C" __global__ void __launch_bounds__(NW * 32, 1) flash_fwd_##KIND##_##NAME##_d##D(FWD_ARGS) { \
    fwd_pipe<TY, D, NW, MT, BK, CAP>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale, CAPV,                \
                                     CpMask{causal, q_off, q_str, k_off, k_str});              \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(NW * 32, 1) flash_fwd_##KIND##_band_##NAME##_d##D(FWD_BAND_ARGS) { \
    fwd_pipe<TY, D, NW, MT, BK, CAP>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale, CAPV, CP_BAND_OF_BLOCK); \
  }
// flash_fwd_pipe{,_band}_* (uncapped: `cap` ignored) and flash_fwd_pipe_cap{,_band}_* (soft cap,
// PIPES_CAP below)
#define PIPE(NAME, D, NW, MT, BK) PIPE_ENTRIES(NAME, D, NW, MT, BK, pipe, false, 0.f)
#define PIPE_CAP(NAME, D, NW, MT, BK) PIPE_ENTRIES(NAME, D, NW, MT, BK, pipe_cap, true, cap)
// d256 (Gemma 3): 4 warps x 16 rows (BQ 64) over key tiles of 32, Q re-read from shared memory
// per tile (MT * D > 128): 101,376 bytes, band entry too (the row bounds in Q's row padding:
// sm_86 / sm_89 / sm_120's maximum per block); two blocks per Hopper SM; its O accumulators (128
// per thread) are d128's.
#define PIPES(NAME) PIPE(NAME, 16, 4, 2, 64) PIPE(NAME, 32, 4, 2, 64) PIPE(NAME, 64, 4, 2, 64) PIPE(NAME, 96, 4, 2, 64) \
  PIPE(NAME, 128, 4, 2, 64) PIPE(NAME, 256, 4, 1, 32)
// The soft-capped entries (Gemma 2): PIPES' tiles but d128 over 32-key tiles (BQ 128: 70,144 bytes):
// at 64 the cap's tanh pushes it past 255 registers (ptxas: 20-136 bytes of spill). src/flash.rs
// `pipe_tile_of(d, true)` mirrors these.
#define PIPES_CAP(NAME) PIPE_CAP(NAME, 16, 4, 2, 64) PIPE_CAP(NAME, 32, 4, 2, 64) PIPE_CAP(NAME, 64, 4, 2, 64) \
  PIPE_CAP(NAME, 96, 4, 2, 64) PIPE_CAP(NAME, 128, 4, 2, 32) PIPE_CAP(NAME, 256, 4, 1, 32)
#define TY float
SIMPLE(f32, 16) SIMPLE(f32, 32) SIMPLE(f32, 64) SIMPLE(f32, 96) SIMPLE(f32, 128) SIMPLE(f32, 256)
#undef TY
#define TY __half
SIMPLE(f16, 16) SIMPLE(f16, 32) SIMPLE(f16, 64) SIMPLE(f16, 96) SIMPLE(f16, 128) SIMPLE(f16, 256)
MMA(f16, 16) MMA(f16, 32) MMA(f16, 64) MMA(f16, 96) MMA(f16, 128)
PIPES(f16) PIPES_CAP(f16)
#undef TY
#define TY __nv_bfloat16
SIMPLE(bf16, 16) SIMPLE(bf16, 32) SIMPLE(bf16, 64) SIMPLE(bf16, 96) SIMPLE(bf16, 128) SIMPLE(bf16, 256)
MMA(bf16, 16) MMA(bf16, 32) MMA(bf16, 64) MMA(bf16, 96) MMA(bf16, 128)
PIPES(bf16) PIPES_CAP(bf16)
#undef TY
