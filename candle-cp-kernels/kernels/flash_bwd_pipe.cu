// Flash-attention backward, pipelined tensor-core kernels (FlashAttention-2 class): cp.async
// 16-byte copies with zero-fill into padded shared tiles, double buffering of the streamed
// tiles, ldmatrix / ldmatrix.trans fragment loads, mma.sync m16n8k16 with f32 accumulators.
// Rust caller: candle_cp_kernels::flash::bwd_with -> src/flash/bwd_pipe.rs, for
//   FwdImpl::Pipelined (and Auto for f16/bf16). CPU reference: candle_cp_ops::attention::attention_bwd.
// Indexing model: sim/bwd_pipe_sim.py (lane-by-lane, checked against a float64 reference).
//
// Contract (as flash_bwd_mma.cu, except that dO arrives in 16 bits):
//   q [B, T, H, D], k/v [B, S, Hkv, D] (type TY); lse, delta f32 [B, H, T] (lse of the *whole*
//   attention of these rows; -inf marks a row that sees no key: it contributes nothing);
//   do16 [B, T, H, D] in TY, written by flash_bwd_pipe_prep_* from the f32 dO (round to nearest
//   even, the same rounding flash_bwd_mma.cu applies on load); delta = rowsum(dO * O) is
//   computed there in f32 from the unrounded dO (as flash_bwd_delta_f32).
//   dq f32 [B, T, H, D]; dk/dv f32 [B, S, Hkv, D] summed over the H / Hkv query heads of each
//   KV head. accumulate != 0 adds into dq/dk/dv instead of overwriting. P and dS are rounded to
//   TY before their products (FlashAttention-2 practice); the softmax scale multiplies dK and dQ
//   once at the end (dS itself is unscaled). No atomics: every output element has one writer,
//   results are deterministic.
//
// dK/dV kernel: one block = BN = 16 * NW keys of one KV head (warp w owns keys 16w .. 16w+15 and
//   their dK/dV rows in registers); it streams query tiles of BQ rows of every query head of the
//   group, from the first query that sees the block's first key (CpMask::query_begin).
//   Per warp and query tile: S^T = K Q^T and dP^T = V dO^T (A = K/V rows via ldmatrix, B = Q/dO
//   rows via ldmatrix), P^T / dS^T stay in registers and are the A operands of
//   dV += P^T dO and dK += dS^T Q (B = dO/Q via ldmatrix.trans).
// dQ kernel: one block = BM = 16 * MT * NW query rows of one head (warp w owns MT m-tiles of 16
//   rows, so every K/V fragment feeds MT mma); it streams key tiles of BN keys up to the last key
//   any of its rows sees (CpMask::key_end): S = Q K^T, dP = dO V^T (A = Q/dO rows, B = K/V rows,
//   both via ldmatrix), dQ += dS K (B = K via ldmatrix.trans).
// Shared tiles are row-major with a row stride of D + 8 elements (D*2 + 16 bytes): the 8 row
//   addresses of one ldmatrix phase fall on 8 distinct 16-byte bank groups (conflict free), and
//   so do the 16-byte cp.async stores of 8 consecutive threads when D >= 64 (for D = 16/32 an
//   8-thread phase stores 2-4 rows and is 2-way conflicted; no padding serves both).
// Ragged edges: rows/keys past T/S are zero-filled; such a query row gets lse2 = +inf, so
//   P = exp2(s - inf) = 0 and it adds nothing; keys past S only feed dK/dV rows that are never
//   stored (dK/dV kernel) or are masked explicitly (dQ kernel). A row with lse = -inf also gets
//   lse2 = +inf. Causal masking is evaluated per element only in tiles that cross the diagonal.
// Soft cap (Gemma 2): `flash_bwd_pipe_cap_*` (CAP, `cap` > 0): P from the capped logit, dS times
//   the cap's derivative recovered from P (CpCap, flash_bwd_pipe.cuh); every entry takes `cap` last.
// Band entries (`flash_bwd_pipe_{dkdv,dq}_band_*`, Rust caller src/flash/band.rs, CPU reference
//   candle_cp_ops::attention::attention_bwd_band): the mask arguments replaced by a band (CpBand,
//   common.cuh; same shared memory). dK/dV blocks stream the query rows [qbegin, qend) of their
//   keys, dQ blocks the key tiles from the one holding lo of their first row; per-element tests
//   (lo <= j < hi) only in tiles not seen whole by every row.
#include "flash_bwd_pipe.cuh"  // shared with flash_bwd_fused.cu: tile loads, dK/dV-side products, stores

// Tile shapes per head dim (kept in sync with `PipeCfg::of` in src/flash/bwd_pipe.rs, which sizes
// the grid and the dynamic shared memory from them): the dK/dV kernel runs KV_NW warps x 16 keys over
// KV_BQ-query tiles, each block owning KV_DA of the D columns of dK / dV (grid x = Hkv * D / KV_DA);
// the dQ kernel Q_NW warps x 16 * Q_MT rows over Q_BN-key tiles. D = 128 keeps Q_MT = 1 (Q_MT = 2
// spills there: 128 accumulator registers plus S and dP), and so does D = 96 (Phi-3-mini: its soft-capped
// band dQ entry spills 12-16 bytes at Q_MT = 2 over 32-key tiles). D = 256 (Gemma 3): a warp's dK and dV
// rows of all 256 columns would take 256 accumulator registers, so each dK/dV block keeps 128
// columns of both (two blocks per key tile, both computing the whole S^T and dP^T from the full
// K, V, Q, dO tiles: 6 instead of 4 matrix products per pair of tiles), and query tiles of 32
// rows keep the tiles within Hopper's 227 KiB per block (203,264 bytes; dQ 202,752).
template <int D> struct PipeCfg {
  static constexpr int KV_NW = 8, KV_BQ = 64, KV_DA = D, Q_NW = 4, Q_MT = 2, Q_BN = 32;
};
template <> struct PipeCfg<96> {
  static constexpr int KV_NW = 8, KV_BQ = 64, KV_DA = 96, Q_NW = 8, Q_MT = 1, Q_BN = 64;
};
template <> struct PipeCfg<128> {
  static constexpr int KV_NW = 8, KV_BQ = 64, KV_DA = 128, Q_NW = 8, Q_MT = 1, Q_BN = 64;
};
template <> struct PipeCfg<256> {
  static constexpr int KV_NW = 8, KV_BQ = 32, KV_DA = 128, Q_NW = 8, Q_MT = 1, Q_BN = 32;
};

// pipe_pt under a band: P^T = exp2(S^T * sl2 - lse2), and where need_mask 0 for the pairs
// outside the band: key ja (rows e < 2; ja + 8 for e >= 2) and query i0 + nt * 8 + 2t + (e & 1)
// (its bounds read from global memory; rows past T take row T - 1's, their lse2 = +inf gives 0).
template <int QT>
__device__ __forceinline__ void pipe_pt_band(float (&st)[QT][4], const float* ls, int t, float sl2, CpBand band,
                                             bool need_mask, int ja, int i0, int T_, const CpCap* cc = nullptr) {
#pragma unroll
  for (int nt = 0; nt < QT; ++nt) {
    const float2 l2 = *reinterpret_cast<const float2*>(ls + nt * 8 + 2 * t);
    int lo[2] = {0, 0}, hi[2] = {0, 0};
    if (need_mask)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = min(i0 + nt * 8 + 2 * t + u, T_ - 1);
        lo[u] = band.kbegin(i), hi[u] = band.kend(i, 0);
      }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float l = (e & 1) ? l2.y : l2.x;
      float p = cc ? cp_exp2(cc->logit2(st[nt][e]) - l) : cp_exp2(fmaf(st[nt][e], sl2, -l));
      const int j = ja + (e < 2 ? 0 : 8);
      if (need_mask && (j < lo[e & 1] || j >= hi[e & 1])) p = 0.f;
      st[nt][e] = p;
    }
  }
}

// Grid (Hkv * D / DA, ceil(S / BN), B), block 32 * NW, dynamic shared memory
// (2 * BN + 4 * BQ) * (D + 8) * sizeof(T) + 4 * BQ * 4 bytes.
// CAP: the soft-capped entries (flash_bwd_pipe_cap_*; CpCap), `cap` > 0 there and unused otherwise.
template <typename T, int D, int NW, int BQ, int DA, bool CAP, typename M>
__device__ __forceinline__ void bwd_pipe_dkdv(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v, const T* __restrict__ do16,
                                              const float* __restrict__ lse, const float* __restrict__ delta,
                                              float* __restrict__ dk, float* __restrict__ dv, int T_, int S, int H,
                                              int Hkv, float scale, float cap, M mask, int accumulate) {
  constexpr int BN = 16 * NW, NT = 32 * NW, DP = D + 8, DPB = DP * 2, DTA = DA / 8, QT = BQ / 8;
  static_assert(D % 16 == 0 && BQ % 16 == 0 && BQ <= NT && DA % 16 == 0 && D % DA == 0, "tile shape");
  CP_DYN_SMEM(unsigned char, pipe_smem);
  const uint32_t k_a = cp_smem_u32(pipe_smem), v_a = k_a + BN * DPB, q_a = v_a + BN * DPB,
                 do_a = q_a + 2 * BQ * DPB;
  float* lse_s = reinterpret_cast<float*>(pipe_smem + (2 * BN + 4 * BQ) * DPB);  // [2][BQ]
  float* dl_s = lse_s + 2 * BQ;                                                   // [2][BQ]
  // Key tiles along y, in increasing order: under a causal mask the first tiles see the most
  // queries, so the heaviest blocks are dispatched first (heads vary fastest, along x; with
  // DA < D, x = kvh * (D / DA) + the block's column slice, columns c0 .. c0 + DA - 1).
  const int b = blockIdx.z, kvh = blockIdx.x / (D / DA), c0 = (blockIdx.x % (D / DA)) * DA, k0 = blockIdx.y * BN, G = H / Hkv;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const uint32_t off_a = pipe_off_a(lane, DPB), off_b = pipe_off_b(lane, DPB);
  const float sl2 = scale * CP_LOG2E;

  const size_t kv_base = ((size_t)b * S * Hkv + kvh) * D, kv_stride = (size_t)Hkv * D, q_stride = (size_t)H * D;
  const int i_begin = mask.qbegin(k0, T_);
  const int i_end = M::BAND ? mask.qend(min(k0 + BN, S), T_) : T_;
  const int n_qt = (i_end - i_begin + BQ - 1) / BQ, n_it = G * n_qt;  // G * n_qt < 2^31: checked by the launcher
  // Tile `it`: query head kvh * G + it / n_qt, rows i_begin + (it % n_qt) * BQ ..
  auto issue = [&](int it, int buf, float& l2, float& dl) {
    pipe_issue_q<T, D, BQ, NT>(q_a + buf * BQ * DPB, do_a + buf * BQ * DPB, q, do16, lse, delta,
                               q_stride, b, kvh * G + it / n_qt, i_begin + (it % n_qt) * BQ, T_, H, l2, dl);
  };
  // A block with no query tile (every query precedes its keys) issues no copy at all.
  float acc_k[DTA][4], acc_v[DTA][4];
  pipe_kv_begin<T, D, BN, BQ, NT>(n_it, k_a, v_a, k, v, kv_base, kv_stride, k0, S, tid, lse_s, dl_s, issue, acc_k, acc_v);
  const int kr0 = warp * 16;
  const long long kp_last = mask.kpos(min(k0 + BN, S) - 1);  // (band: unused)
  const long long kp_a = mask.kpos(k0 + kr0 + g), kp_b = mask.kpos(k0 + kr0 + g + 8);
  // Band: the query rows [wq_begin, wq_end) hold every row that sees a key of this warp's 16;
  // a query tile outside them is skipped by the warp (in a block whose keys span several short
  // documents, each warp visits only its own documents' rows).
  int wq_begin = 0, wq_end = 0;
  if constexpr (M::BAND)
    if (k0 + kr0 < S) wq_begin = mask.qbegin(k0 + kr0, T_), wq_end = mask.qend(min(k0 + kr0 + 16, S), T_);

  for (int it = 0; it < n_it; ++it) {
    const int buf = it & 1;
    const bool more = it + 1 < n_it;
    float nl = 0.f, nd = 0.f;
    if (more) issue(it + 1, buf ^ 1, nl, nd);
    cp_async_commit();
    cp_async_wait<1>();  // everything but the prefetch just issued has landed (this thread's copies)
    __syncthreads();     // ... and everyone's

    const int i0 = i_begin + (it % n_qt) * BQ;
    // (band: some row of the tile does not see all of the block's keys)
    const bool need_mask = M::BAND ? mask.tile_partial(i0, min(i0 + BQ, T_), k0, k0 + BN, S)
                                   : mask.causal && kp_last > mask.qpos(i0);
    if (!M::BAND || (i0 < wq_end && i0 + BQ > wq_begin)) {  // warp-uniform
      const uint32_t qb_a = q_a + buf * BQ * DPB, dob_a = do_a + buf * BQ * DPB;
      const float* ls = lse_s + buf * BQ;
      const float* dls = dl_s + buf * BQ;

      // S^T = K Q^T: rows = this warp's 16 keys, cols = BQ queries.
      float st[QT][4];
      pipe_rows_x_tile<T, D, QT>(st, k_a + kr0 * DPB, qb_a, off_a, off_b);
      // P^T = exp2(S^T * scale * log2 e - lse2) (capped: exp2(capped logit - lse2)); causally
      // hidden pairs -> 0.
      const CpCap cc = CAP ? CpCap::of(scale, cap) : CpCap{};
      if constexpr (M::BAND)
        pipe_pt_band<QT>(st, ls, t, sl2, mask, need_mask, k0 + kr0 + g, i0, T_, CAP ? &cc : nullptr);
      else
        pipe_pt<QT, false>(st, ls, t, sl2, mask, need_mask, kp_a, kp_b, i0, false, true, true, CAP ? &cc : nullptr);
      // dV += P^T dO: k = queries (16 per step), n = d (two 8-column tiles per ldmatrix.trans).
#pragma unroll
      for (int kk = 0; kk < QT / 2; ++kk) {
        uint32_t pa[4];
        pipe_pack_a<T>(pa, st[2 * kk], st[2 * kk + 1]);
        pipe_acc_trans<T, DA>(acc_v, pa, dob_a + kk * 16 * DPB + c0 * 2, off_a);
      }
      // dP^T = V dO^T.
      float dpt[QT][4];
      pipe_rows_x_tile<T, D, QT>(dpt, v_a + kr0 * DPB, dob_a, off_a, off_b);
      // dS^T = P^T (dP^T - delta) (unscaled; capped: times the cap's derivative).
#pragma unroll
      for (int nt = 0; nt < QT; ++nt) {
        const float2 d2 = *reinterpret_cast<const float2*>(dls + nt * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[nt][e] = st[nt][e] * (dpt[nt][e] - ((e & 1) ? d2.y : d2.x));
        if constexpr (CAP) {
          const float2 l2 = *reinterpret_cast<const float2*>(ls + nt * 8 + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) dpt[nt][e] = cc.grad(dpt[nt][e], st[nt][e], (e & 1) ? l2.y : l2.x);
        }
      }
      // dK += dS^T Q.
#pragma unroll
      for (int kk = 0; kk < QT / 2; ++kk) {
        uint32_t da[4];
        pipe_pack_a<T>(da, dpt[2 * kk], dpt[2 * kk + 1]);
        pipe_acc_trans<T, DA>(acc_k, da, qb_a + kk * 16 * DPB + c0 * 2, off_a);
      }
    }
    if (more && tid < BQ) lse_s[(buf ^ 1) * BQ + tid] = nl, dl_s[(buf ^ 1) * BQ + tid] = nd;
    __syncthreads();  // buffer `buf` is free for the prefetch of the next iteration
  }
  pipe_store_kv<D, DA>(dk, dv, acc_k, acc_v, b, k0 + kr0 + g, S, Hkv, kvh, t, scale, accumulate, c0);
}

// Grid (H, ceil(T / BM), B) with BM = 16 * MT * NW, block 32 * NW, dynamic shared memory
// (2 * BM + 4 * BN) * (D + 8) * sizeof(T) bytes. Warp w owns rows 16 * MT * w .. + 16 * MT - 1
// (MT m-tiles of 16 rows: every K/V fragment loaded from shared memory feeds MT mma).
template <typename T, int D, int NW, int MT, int BN, bool CAP, typename M>
__device__ __forceinline__ void bwd_pipe_dq(const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v, const T* __restrict__ do16,
                                            const float* __restrict__ lse, const float* __restrict__ delta,
                                            float* __restrict__ dq, int T_, int S, int H, int Hkv, float scale,
                                            float cap, M mask, int accumulate) {
  constexpr int BM = 16 * MT * NW, NT = 32 * NW, DP = D + 8, DPB = DP * 2, DC = D / 16, DT = D / 8, KT = BN / 8;
  static_assert(D % 16 == 0 && BN % 16 == 0, "tile shape");
  CP_DYN_SMEM(unsigned char, pipe_smem);
  const uint32_t q_a = cp_smem_u32(pipe_smem), do_a = q_a + BM * DPB, k_a = do_a + BM * DPB,
                 v_a = k_a + 2 * BN * DPB;
  // Query tiles along y in decreasing order: under a causal mask the last tiles see the most
  // keys, so the heaviest blocks are dispatched first (heads vary fastest, along x).
  const int b = blockIdx.z, h = blockIdx.x, kvh = h / (H / Hkv), m0 = (gridDim.y - 1 - blockIdx.y) * BM;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const uint32_t off_a = pipe_off_a(lane, DPB), off_b = pipe_off_b(lane, DPB);
  const float sl2 = scale * CP_LOG2E;
  const CpCap cc = CAP ? CpCap::of(scale, cap) : CpCap{};

  const size_t qb = ((size_t)b * T_ * H + h) * D, q_stride = (size_t)H * D;
  const size_t kv_base = ((size_t)b * S * Hkv + kvh) * D, kv_stride = (size_t)Hkv * D;
  const int last = min(m0 + BM, T_) - 1;
  const int s_end = mask.kend(last, S);
  const int k_first = M::BAND ? mask.kbegin(m0) / BN * BN : 0;  // band: first key tile
  const int n_it = (s_end - k_first + BN - 1) / BN;
  // A block whose rows see no key issues no copy (nothing in flight when its threads exit).
  if (n_it > 0) {
    pipe_load_tile<T, D, BM, NT>(q_a, q + qb, q_stride, m0, T_);
    pipe_load_tile<T, D, BM, NT>(do_a, do16 + qb, q_stride, m0, T_);
    pipe_load_tile<T, D, BN, NT>(k_a, k + kv_base, kv_stride, k_first, S);
    pipe_load_tile<T, D, BN, NT>(v_a, v + kv_base, kv_stride, k_first, S);
  }
  cp_async_commit();

  // Row r(mt, half) = m0 + 16 * (MT * warp + mt) + g + 8 * half of this lane.
  const int r0 = m0 + 16 * MT * warp + g;
  float l2[MT][2], dl[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = r0 + 16 * mt + 8 * hf;
      const size_t li = ((size_t)b * H + h) * T_ + r;
      l2[mt][hf] = pipe_lse2(lse, li, r < T_);
      dl[mt][hf] = r < T_ ? delta[li] : 0.f;
    }
  const long long qp0 = mask.qpos(m0);  // (band: unused)
  // Band: this lane's row bounds (rows past T take row T - 1's; their lse2 = +inf gives P = 0),
  // and the block's: keys [bk_lo, bk_hi) are seen by every row of the block.
  int blo[MT][2], bhi[MT][2], bk_lo = 0, bk_hi = 0;
  if constexpr (M::BAND) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = min(r0 + 16 * mt + 8 * hf, T_ - 1);
        blo[mt][hf] = mask.kbegin(r), bhi[mt][hf] = mask.kend(r, S);
      }
    bk_lo = mask.kbegin(last), bk_hi = mask.kend(m0, S);
  }
  // Band: keys [w_lo, w_hi) hold every key a row of this warp sees; the warp skips a key tile
  // outside them (in a block spanning several short documents, each warp visits only its own
  // documents' keys). A warp past T sees nothing.
  int w_lo = 0, w_hi = 0;
  if constexpr (M::BAND) {
    const int wf = m0 + 16 * MT * warp;
    if (wf < T_) w_lo = mask.kbegin(wf), w_hi = mask.kend(min(wf + 16 * MT, T_) - 1, S);
  }
  float acc[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.f;
  const uint32_t qw_a = q_a + 16 * MT * warp * DPB, dow_a = do_a + 16 * MT * warp * DPB;

  for (int it = 0; it < n_it; ++it) {
    const int buf = it & 1, k0 = k_first + it * BN;
    const bool more = it + 1 < n_it;
    if (more) {
      pipe_load_tile<T, D, BN, NT>(k_a + (buf ^ 1) * BN * DPB, k + kv_base, kv_stride, k0 + BN, S);
      pipe_load_tile<T, D, BN, NT>(v_a + (buf ^ 1) * BN * DPB, v + kv_base, kv_stride, k0 + BN, S);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    if (!M::BAND || (k0 < w_hi && k0 + BN > w_lo)) {  // warp-uniform
      const bool need_mask = M::BAND ? k0 + BN > S || bk_lo > k0 || bk_hi < k0 + BN
                                     : k0 + BN > S || (mask.causal && mask.kpos(min(k0 + BN, S) - 1) > qp0);
      const uint32_t kb_a = k_a + buf * BN * DPB, vb_a = v_a + buf * BN * DPB;
      // S = Q K^T: rows = this warp's 16 * MT queries, cols = BN keys.
      float s[MT][KT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < KT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < DC; ++kc) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) cp_ldsm_x4(qa[mt], qw_a + mt * 16 * DPB + kc * 32 + off_a);
#pragma unroll
        for (int np = 0; np < KT / 2; ++np) {
          uint32_t kb[4];
          cp_ldsm_x4(kb, kb_a + np * 16 * DPB + kc * 32 + off_b);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            cp_mma16816<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
            cp_mma16816<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
          }
        }
      }
      // P = exp2(S * scale * log2 e - lse2); keys past S and causally hidden pairs -> 0.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float p = CAP ? cp_exp2(cc.logit2(s[mt][nt][e]) - l2[mt][e >> 1]) : cp_exp2(fmaf(s[mt][nt][e], sl2, -l2[mt][e >> 1]));
            if (need_mask) {
              const int j = k0 + nt * 8 + 2 * t + (e & 1);
              if constexpr (M::BAND) {
                if (j >= S || j < blo[mt][e >> 1] || j >= bhi[mt][e >> 1]) p = 0.f;
              } else {
                if (j >= S || (mask.causal && mask.kpos(j) > mask.qpos(r0 + 16 * mt + 8 * (e >> 1)))) p = 0.f;
              }
            }
            s[mt][nt][e] = p;
          }
      // dP = dO V^T.
      float dp[MT][KT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < KT; ++nt) dp[mt][nt][0] = dp[mt][nt][1] = dp[mt][nt][2] = dp[mt][nt][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < DC; ++kc) {
        uint32_t oa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) cp_ldsm_x4(oa[mt], dow_a + mt * 16 * DPB + kc * 32 + off_a);
#pragma unroll
        for (int np = 0; np < KT / 2; ++np) {
          uint32_t vb[4];
          cp_ldsm_x4(vb, vb_a + np * 16 * DPB + kc * 32 + off_b);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            cp_mma16816<T>(dp[mt][2 * np], oa[mt], vb[0], vb[1]);
            cp_mma16816<T>(dp[mt][2 * np + 1], oa[mt], vb[2], vb[3]);
          }
        }
      }
      // dQ += dS K with dS = P (dP - delta): k = keys (16 per step), n = d.
#pragma unroll
      for (int kk = 0; kk < KT / 2; ++kk) {
        uint32_t da[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          float ds[2][4];
#pragma unroll
          for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              ds[u][e] = s[mt][2 * kk + u][e] * (dp[mt][2 * kk + u][e] - dl[mt][e >> 1]);
              if constexpr (CAP) ds[u][e] = cc.grad(ds[u][e], s[mt][2 * kk + u][e], l2[mt][e >> 1]);
            }
          da[mt][0] = cp_pack2<T>(ds[0][0], ds[0][1]);
          da[mt][1] = cp_pack2<T>(ds[0][2], ds[0][3]);
          da[mt][2] = cp_pack2<T>(ds[1][0], ds[1][1]);
          da[mt][3] = cp_pack2<T>(ds[1][2], ds[1][3]);
        }
#pragma unroll
        for (int dpi = 0; dpi < D / 16; ++dpi) {
          uint32_t kb[4];
          cp_ldsm_x4_trans(kb, kb_a + kk * 16 * DPB + dpi * 32 + off_a);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            cp_mma16816<T>(acc[mt][2 * dpi], da[mt], kb[0], kb[1]);
            cp_mma16816<T>(acc[mt][2 * dpi + 1], da[mt], kb[2], kb[3]);
          }
        }
      }
    }
    __syncthreads();  // buffer `buf` is free for the prefetch of the next iteration
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ra = r0 + 16 * mt, rb = ra + 8;
    const size_t gi_a = (((size_t)b * T_ + ra) * H + h) * D, gi_b = gi_a + (size_t)8 * H * D;
    pipe_store_rows<D>(dq, acc[mt], gi_a, gi_b, ra < T_, rb < T_, t, scale, accumulate);
  }
}

// delta[b, h, i] = sum_d dout * o (f32, from the unrounded dO) and do16 = dO rounded to TY.
// One warp per (b, i, h) row; grid (ceil(B*T*H / 4)), block 128; D a multiple of 4.
template <typename T>
__device__ __forceinline__ void bwd_pipe_prep(const float* __restrict__ o, const float* __restrict__ dout,
                                              float* __restrict__ delta, T* __restrict__ do16, int B, int T_,
                                              int H, int D) {
  const size_t row = (size_t)blockIdx.x * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= (size_t)B * T_ * H) return;
  const float4* o4 = reinterpret_cast<const float4*>(o + row * D);
  const float4* g4 = reinterpret_cast<const float4*>(dout + row * D);
  uint2* d4 = reinterpret_cast<uint2*>(do16 + row * D);
  float acc = 0.f;
  for (int c = lane; c < D / 4; c += 32) {
    const float4 a = o4[c], gg = g4[c];
    acc += a.x * gg.x + a.y * gg.y + a.z * gg.z + a.w * gg.w;
    d4[c] = make_uint2(cp_pack2<T>(gg.x, gg.y), cp_pack2<T>(gg.z, gg.w));
  }
  acc = cp_warp_sum(acc);
  if (lane == 0) {
    const int h = row % H;
    const size_t bi = row / H;
    const int i = bi % T_, b = bi / T_;
    delta[((size_t)b * H + h) * T_ + i] = acc;
  }
}

// PIPE_ARGS, PIPE_MASK: flash_bwd_pipe.cuh. Band entries: the mask arguments replaced by the band.
#define PIPE_BAND_ARGS                                                                            \
  const TY *q, const TY *k, const TY *v, const TY *dout16, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, CP_BAND_ARGS, int accumulate
// KIND pipe (uncapped, CAP false: `cap` ignored) or pipe_cap (the soft cap, Gemma 2): both take
// `float cap` after the other arguments (one Rust launcher for both).
#define PIPE_ENTRIES_K(NAME, D, KIND, CAP)                                                                  \
  extern "C" __global__ void __launch_bounds__(32 * PipeCfg<D>::KV_NW, 1)                                 \
      flash_bwd_##KIND##_dkdv_##NAME##_d##D(float* dk, float* dv, PIPE_ARGS, float cap) {                 \
    using C = PipeCfg<D>;                                                                                 \
    bwd_pipe_dkdv<TY, D, C::KV_NW, C::KV_BQ, C::KV_DA, CAP>(q, k, v, dout16, lse, delta, dk, dv, T_, S, H, Hkv, scale, \
                                             cap, PIPE_MASK, accumulate);                                 \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(32 * PipeCfg<D>::Q_NW, 1)                                  \
      flash_bwd_##KIND##_dq_##NAME##_d##D(float* dq, PIPE_ARGS, float cap) {                              \
    using C = PipeCfg<D>;                                                                                 \
    bwd_pipe_dq<TY, D, C::Q_NW, C::Q_MT, C::Q_BN, CAP>(q, k, v, dout16, lse, delta, dq, T_, S, H, Hkv, scale, \
                                                  cap, PIPE_MASK, accumulate);                            \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(32 * PipeCfg<D>::KV_NW, 1)                                 \
      flash_bwd_##KIND##_dkdv_band_##NAME##_d##D(float* dk, float* dv, PIPE_BAND_ARGS, float cap) {       \
    using C = PipeCfg<D>;                                                                                 \
    bwd_pipe_dkdv<TY, D, C::KV_NW, C::KV_BQ, C::KV_DA, CAP>(q, k, v, dout16, lse, delta, dk, dv, T_, S, H, Hkv, scale, \
                                             cap, CP_BAND_OF_BLOCK, accumulate);                          \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(32 * PipeCfg<D>::Q_NW, 1)                                  \
      flash_bwd_##KIND##_dq_band_##NAME##_d##D(float* dq, PIPE_BAND_ARGS, float cap) {                    \
    using C = PipeCfg<D>;                                                                                 \
    bwd_pipe_dq<TY, D, C::Q_NW, C::Q_MT, C::Q_BN, CAP>(q, k, v, dout16, lse, delta, dq, T_, S, H, Hkv, scale, \
                                                  cap, CP_BAND_OF_BLOCK, accumulate);                     \
  }
#define PIPE_ENTRIES_D(NAME, D) PIPE_ENTRIES_K(NAME, D, pipe, false) PIPE_ENTRIES_K(NAME, D, pipe_cap, true)
#define PIPE_ENTRIES(NAME)                                                                                \
  extern "C" __global__ void flash_bwd_pipe_prep_##NAME(const float* o, const float* dout, float* delta, \
                                                         TY* do16, int B, int T_, int H, int D) {        \
    bwd_pipe_prep<TY>(o, dout, delta, do16, B, T_, H, D);                                                 \
  }                                                                                                       \
  PIPE_ENTRIES_D(NAME, 16) PIPE_ENTRIES_D(NAME, 32) PIPE_ENTRIES_D(NAME, 64) PIPE_ENTRIES_D(NAME, 96) PIPE_ENTRIES_D(NAME, 128) \
  PIPE_ENTRIES_D(NAME, 256)

#define TY __half
PIPE_ENTRIES(f16)
#undef TY
#define TY __nv_bfloat16
PIPE_ENTRIES(bf16)
#undef TY
