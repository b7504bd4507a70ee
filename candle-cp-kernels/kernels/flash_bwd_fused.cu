// Flash-attention backward, fused dK/dV/dQ kernel with atomic dQ (FlashAttention-2 style), opt-in:
// Rust caller candle_cp_kernels::flash::bwd_with -> src/flash/bwd_fused.rs for FwdImpl::AtomicDq
// (`CANDLE_CP_FLASH_IMPL=atomic`; `Auto` never picks it). CPU reference:
// candle_cp_ops::attention::attention_bwd. Emulated on the CPU by candle-cp-kernels/emu
// (check_fused.cpp) against a float64 reference.
//
// Contract: as flash_bwd_pipe.cu (whose prep kernel, flash_bwd_pipe_prep_*, supplies delta and the
//   16-bit dO): q [B, T, H, D], k/v [B, S, Hkv, D] (type TY); do16 [B, T, H, D] in TY; lse, delta
//   f32 [B, H, T] (lse of the *whole* attention of these rows; -inf marks a row that sees no key:
//   it contributes nothing). dk/dv f32 [B, S, Hkv, D] summed over the H / Hkv query heads of each
//   KV head, overwritten (accumulate == 0) or added to (accumulate != 0). dq f32 [B, T, H, D] is
//   ALWAYS added to with atomics: the caller zero-fills it unless it accumulates into an existing dq.
//   P and dS are rounded to TY before their products; the softmax scale multiplies dK and dQ.
//   NONDETERMINISTIC: the f32 additions into one dq element arrive from ceil(S / 128) blocks in
//   whatever order the hardware runs them, so dq may differ in the last bits from run to run
//   (dk/dv have one writer each and are deterministic).
//
// One block = BN = 16 * NW keys of one KV head (warp w owns keys 16w .. 16w+15 and their dK/dV rows
//   in registers, as the pipelined dK/dV kernel); it streams query tiles of BQ rows of every query
//   head of the group (Q and dO double-buffered with cp.async), from the first query that sees the
//   block's first key (CpMask::query_begin). Per query tile:
//   1. S^T = K Q^T, P^T = exp2(S^T scale log2 e - lse2) (masked pairs and keys past S -> 0);
//   2. dV += P^T dO (P^T in registers is the A operand; dO via ldmatrix.trans);
//   3. dP^T = V dO^T, dS^T = P^T (dP^T - delta), rounded to TY; written to shared memory
//      ([BN][BQ + 8], 16-bit) and used from registers for 4. dK += dS^T Q;
//   5. after a barrier, dQ_tile (BQ x D) = dS K over the block's BN keys, split over the warps in
//      items of 16 rows x CW columns (dS via ldmatrix.trans from the dS^T tile, K via
//      ldmatrix.trans); a warp stages its item (f32) in the now free Q/dO buffer of the tile and
//      adds it times scale into dq with cp_red_add_f32 (red.global.add.f32), each warp-wide red
//      covering 32 consecutive floats of one row (4 full 32-byte sectors; straight from the mma
//      fragments a red would touch 8 rows, 8 half-used sectors). Only __syncwarp around the
//      staging. Two block barriers per query tile: the one after the cp.async wait (it also
//      frees the other buffer, so the next tile's prefetch is issued right after it) and the
//      one that publishes dS^T.
//   Five matrix products per (query, key) pair, as FlashAttention-2 (the pipelined kernels run seven).
// Shared tiles: rows of D + 8 elements (conflict-free ldmatrix and cp.async, see flash_bwd_pipe.cu);
//   the dS^T tile has rows of BQ + 8 elements for the same reason (its 32-bit stores from the
//   fragments too). Registers (ptxas, sm_80 and sm_90a): 255 at D = 128 and 64, no spills.
#include "flash_bwd_pipe.cuh"  // shared with flash_bwd_pipe.cu: tile loads, dK/dV-side products, stores

// Tile shapes (kept in sync with `FusedCfg` in src/flash/bwd_fused.rs): NW warps x 16 keys per
// block, BQ-row query tiles. Dynamic shared memory (2 * BN + 4 * BQ) * (D + 8) * 2
// + BN * (BQ + 8) * 2 + 4 * BQ * 4 bytes: 158,720 at D = 128, 93,184 at D = 64.
template <int D> struct FusedCfg {
  static constexpr int NW = 8, BQ = 64;
};

// Grid (Hkv, ceil(S / BN), B), block 32 * NW, dynamic shared memory as FusedCfg says.
template <typename T, int D, int NW, int BQ>
__device__ __forceinline__ void bwd_fused(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                          const T* __restrict__ do16, const float* __restrict__ lse,
                                          const float* __restrict__ delta, float* __restrict__ dq,
                                          float* __restrict__ dk, float* __restrict__ dv, int T_, int S, int H,
                                          int Hkv, float scale, CpMask mask, int accumulate) {
  constexpr int BN = 16 * NW, NT = 32 * NW, DP = D + 8, DPB = DP * 2, DT = D / 8, QT = BQ / 8;
  constexpr int SPB = (BQ + 8) * 2;  // bytes per row of the dS^T tile
  // dQ work items: RG row groups of 16 query rows x NCW column chunks of CW columns.
  constexpr int RG = BQ / 16, CW0 = D * RG / NW, CW = CW0 < 16 ? 16 : CW0, NCW = D / CW, NI = RG * NCW, CT = CW / 8;
  // A warp stages its 16 x CW dQ item (f32, rows of SST floats) in the Q + dO buffer of the
  // current tile (free once every warp has passed the dS^T barrier), then adds it to dq row by row.
  constexpr int SST = CW + 4, SLOTS = NI < NW ? NI : NW;
  static_assert(D % 16 == 0 && BQ % 16 == 0 && BQ <= NT && D % CW == 0 && CW % 16 == 0, "tile shape");
  static_assert(SLOTS * 16 * SST * 4 <= 2 * BQ * DPB, "dQ staging must fit in one Q + dO buffer");
  CP_DYN_SMEM(unsigned char, fused_smem);
  // Layout: K, V, then per buffer (Q tile, dO tile), then dS^T, lse, delta.
  const uint32_t k_a = cp_smem_u32(fused_smem), v_a = k_a + BN * DPB, q_a = v_a + BN * DPB,
                 do_a = q_a + BQ * DPB, ds_a = q_a + 4 * BQ * DPB;
  unsigned char* ds_p = fused_smem + (2 * BN + 4 * BQ) * DPB;                         // [BN][BQ + 8] TY
  float* lse_s = reinterpret_cast<float*>(ds_p + BN * SPB);                            // [2][BQ]
  float* dl_s = lse_s + 2 * BQ;                                                       // [2][BQ]
  // Key tiles along y, in increasing order: under a causal mask the first tiles see the most
  // queries, so the heaviest blocks are dispatched first (heads vary fastest, along x).
  const int b = blockIdx.z, kvh = blockIdx.x, k0 = blockIdx.y * BN, G = H / Hkv;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const uint32_t off_a = pipe_off_a(lane, DPB), off_b = pipe_off_b(lane, DPB), off_s = pipe_off_b(lane, SPB);
  const float sl2 = scale * CP_LOG2E;

  const size_t kv_base = ((size_t)b * S * Hkv + kvh) * D, kv_stride = (size_t)Hkv * D, q_stride = (size_t)H * D;
  const int i_begin = mask.query_begin(mask.kpos(k0), T_);
  const int n_qt = (T_ - i_begin + BQ - 1) / BQ, n_it = G * n_qt;  // G * n_qt < 2^31: checked by the launcher
  // Tile `it`: query head kvh * G + it / n_qt, rows i_begin + (it % n_qt) * BQ ..
  auto issue = [&](int it, int buf, float& l2, float& dl) {
    pipe_issue_q<T, D, BQ, NT>(q_a + buf * 2 * BQ * DPB, do_a + buf * 2 * BQ * DPB, q, do16, lse, delta,
                               q_stride, b, kvh * G + it / n_qt, i_begin + (it % n_qt) * BQ, T_, H, l2, dl);
  };
  // A block with no query tile issues no copy; it still stores its (zero) dK/dV rows below.
  float acc_k[DT][4], acc_v[DT][4];
  pipe_kv_begin<T, D, BN, BQ, NT>(n_it, k_a, v_a, k, v, kv_base, kv_stride, k0, S, tid, lse_s, dl_s, issue, acc_k, acc_v);
  const int kr0 = warp * 16;
  const long long kp_last = mask.kpos(min(k0 + BN, S) - 1);
  const long long kp_a = mask.kpos(k0 + kr0 + g), kp_b = mask.kpos(k0 + kr0 + g + 8);
  const bool kok_a = k0 + kr0 + g < S, kok_b = k0 + kr0 + g + 8 < S;
  const bool ragged = k0 + BN > S;

  for (int it = 0; it < n_it; ++it) {
    const int buf = it & 1;
    const bool more = it + 1 < n_it;
    cp_async_wait<0>();  // tile `it` has landed (this thread's copies) ...
    __syncthreads();     // ... and everyone's; every warp is done with iteration it - 1, so
                         // buffer buf ^ 1 (its Q/dO, staging and lse/delta) and dS^T are free
    float nl = 0.f, nd = 0.f;
    if (more) issue(it + 1, buf ^ 1, nl, nd);  // lands while this tile is computed
    cp_async_commit();

    const int hq = kvh * G + it / n_qt, i0 = i_begin + (it % n_qt) * BQ;
    const bool causal_cut = mask.causal && kp_last > mask.qpos(i0);
    const uint32_t qb_a = q_a + buf * 2 * BQ * DPB, dob_a = do_a + buf * 2 * BQ * DPB;
    const float* ls = lse_s + buf * BQ;
    const float* dls = dl_s + buf * BQ;

    // S^T = K Q^T: rows = this warp's 16 keys, cols = BQ queries.
    float st[QT][4];
    pipe_rows_x_tile<T, D, QT>(st, k_a + kr0 * DPB, qb_a, off_a, off_b);
    // P^T = exp2(S^T * scale * log2 e - lse2); causally hidden pairs and keys past S -> 0 (a key
    // past S has a zero K row, but exp2(-lse2) of it can overflow and would poison dQ).
    pipe_pt<QT, true>(st, ls, t, sl2, mask, causal_cut, kp_a, kp_b, i0, ragged, kok_a, kok_b);
    // dV += P^T dO: k = queries (16 per step), n = d (two 8-column tiles per ldmatrix.trans).
#pragma unroll
    for (int kk = 0; kk < QT / 2; ++kk) {
      uint32_t pa[4];
      pipe_pack_a<T>(pa, st[2 * kk], st[2 * kk + 1]);
      pipe_acc_trans<T, D>(acc_v, pa, dob_a + kk * 16 * DPB, off_a);
    }
    // dP^T = V dO^T.
    float dpt[QT][4];
    pipe_rows_x_tile<T, D, QT>(dpt, v_a + kr0 * DPB, dob_a, off_a, off_b);
    // dS^T = P^T (dP^T - delta) (unscaled), rounded to TY: A fragments of dK += dS^T Q, and
    // stored to the shared dS^T tile (row = key kr0 + g (+8), columns = queries) for dQ.
    uint32_t dsa[QT / 2][4];
#pragma unroll
    for (int kk = 0; kk < QT / 2; ++kk) {
      float ds[2][4];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float2 d2 = *reinterpret_cast<const float2*>(dls + (2 * kk + u) * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[u][e] = st[2 * kk + u][e] * (dpt[2 * kk + u][e] - ((e & 1) ? d2.y : d2.x));
      }
      pipe_pack_a<T>(dsa[kk], ds[0], ds[1]);
      unsigned char* row_a = ds_p + (kr0 + g) * SPB + (16 * kk + 2 * t) * 2;
      *reinterpret_cast<uint32_t*>(row_a) = dsa[kk][0];
      *reinterpret_cast<uint32_t*>(row_a + 8 * SPB) = dsa[kk][1];
      *reinterpret_cast<uint32_t*>(row_a + 16) = dsa[kk][2];
      *reinterpret_cast<uint32_t*>(row_a + 8 * SPB + 16) = dsa[kk][3];
    }
    // dK += dS^T Q.
#pragma unroll
    for (int kk = 0; kk < QT / 2; ++kk) pipe_acc_trans<T, D>(acc_k, dsa[kk], qb_a + kk * 16 * DPB, off_a);
    __syncthreads();  // the whole dS^T tile is in shared memory; Q and dO of `buf` are free

    // dQ[i0 + 16 rg .., c0 ..] += scale * dS K over the block's BN keys, item by item.
    const size_t dq_base = ((size_t)b * T_ * H + hq) * D;
    float* stage = reinterpret_cast<float*>(fused_smem + 2 * BN * DPB + buf * 2 * BQ * DPB) + warp * 16 * SST;
    for (int item = warp; item < NI; item += NW) {
      const int rg = item / NCW, c0 = (item % NCW) * CW;
      float acc[CT][4];
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) acc[ct][0] = acc[ct][1] = acc[ct][2] = acc[ct][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t da[4];
        cp_ldsm_x4_trans(da, ds_a + kk * 16 * SPB + rg * 32 + off_s);
#pragma unroll
        for (int cp = 0; cp < CT / 2; ++cp) {
          uint32_t kb[4];
          cp_ldsm_x4_trans(kb, k_a + kk * 16 * DPB + (c0 + 16 * cp) * 2 + off_a);
          cp_mma16816<T>(acc[2 * cp], da, kb[0], kb[1]);
          cp_mma16816<T>(acc[2 * cp + 1], da, kb[2], kb[3]);
        }
      }
      // Stage the item, then add it to dq with each warp-wide red covering contiguous columns
      // of a row (full 32-byte sectors; from the fragments directly, 8 rows x 8 bytes each).
#pragma unroll
      for (int ct = 0; ct < CT; ++ct) {
        *reinterpret_cast<float2*>(stage + g * SST + ct * 8 + 2 * t) = make_float2(acc[ct][0], acc[ct][1]);
        *reinterpret_cast<float2*>(stage + (g + 8) * SST + ct * 8 + 2 * t) = make_float2(acc[ct][2], acc[ct][3]);
      }
      __syncwarp();
      // Lane -> (row lr + RPP * n, columns lc + 32 * cj): LPR lanes per row, RPP rows per pass.
      constexpr int LPR = CW < 32 ? CW : 32, RPP = 32 / LPR, CPL = CW / LPR;
      const int lr = lane / LPR, lc = lane % LPR, rows_left = T_ - (i0 + 16 * rg);
      size_t off = dq_base + (size_t)(i0 + 16 * rg + lr) * q_stride + c0 + lc;
#pragma unroll 2
      for (int r = lr; r < 16; r += RPP, off += RPP * q_stride) {
        if (r >= rows_left) break;
#pragma unroll
        for (int cj = 0; cj < CPL; ++cj) cp_red_add_f32(dq + off + 32 * cj, stage[r * SST + lc + 32 * cj] * scale);
      }
      __syncwarp();  // the staging slot is free for the warp's next item
    }
    if (more && tid < BQ) lse_s[(buf ^ 1) * BQ + tid] = nl, dl_s[(buf ^ 1) * BQ + tid] = nd;
  }
  pipe_store_kv<D>(dk, dv, acc_k, acc_v, b, k0 + kr0 + g, S, Hkv, kvh, t, scale, accumulate);
}

// PIPE_ARGS, PIPE_MASK: flash_bwd_pipe.cuh (the same parameters as the pipelined kernels).
#define FUSED_ENTRY_D(NAME, D)                                                                          \
  extern "C" __global__ void __launch_bounds__(32 * FusedCfg<D>::NW, 1)                                 \
      flash_bwd_fused_##NAME##_d##D(float* dq, float* dk, float* dv, PIPE_ARGS) {                       \
    using C = FusedCfg<D>;                                                                              \
    (void)B;                                                                                            \
    bwd_fused<TY, D, C::NW, C::BQ>(q, k, v, dout16, lse, delta, dq, dk, dv, T_, S, H, Hkv, scale,       \
                                   PIPE_MASK, accumulate);                                              \
  }
#define FUSED_ENTRIES(NAME) \
  FUSED_ENTRY_D(NAME, 16) FUSED_ENTRY_D(NAME, 32) FUSED_ENTRY_D(NAME, 64) FUSED_ENTRY_D(NAME, 128)

#define TY __half
FUSED_ENTRIES(f16)
#undef TY
#define TY __nv_bfloat16
FUSED_ENTRIES(bf16)
#undef TY
