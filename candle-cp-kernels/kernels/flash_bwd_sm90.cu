// Flash-attention backward on Hopper warpgroup MMA (wgmma.mma_async), sm_90a only: the dK/dV
// kernel (this header), its atomic-dQ variant (below) and the dQ kernel (comment at bwd_wgmma_dq).
// EXPERIMENTAL and opt-in (`FwdImpl::Wgmma`, `CANDLE_CP_FLASH_IMPL=wgmma`): compiled and assembled
// (ptxas sm_90a) and run under the CPU emulator (emu/run.sh), never on a GPU when it was written.
// Rust caller: candle_cp_kernels::flash::bwd_with -> src/flash/bwd_sm90.rs, which runs
// flash_bwd_pipe_prep_* (delta, 16-bit dO; kernels/flash_bwd_pipe.cu), then flash_bwd_wgmma_dkdv_*
// and flash_bwd_wgmma_dq_* (deterministic); for FwdImpl::WgmmaAtomic the prep kernel and
// flash_bwd_wgmma_atomic_* only.
// CPU reference: candle_cp_ops::attention::attention_bwd. Built by build.rs with -arch=compute_90a.
//
// Same arguments and semantics as flash_bwd_pipe_dkdv_* (kernels/flash_bwd_pipe.cu, PIPE_ARGS):
// q [B, T, H, D], k/v [B, S, Hkv, D] (f16/bf16); do16 [B, T, H, D] (dO rounded to TY by the prep
// kernel); lse, delta f32 [B, H, T] (lse of the whole attention of the rows, -inf: the row sees no
// key and contributes nothing); dk/dv f32 [B, S, Hkv, D], summed over the H / Hkv query heads of
// each KV head (query head h reads KV head h / (H / Hkv)); accumulate != 0 adds into dk/dv. P and
// dS are rounded to TY before their products; dS is unscaled, the softmax scale multiplies dK once
// at the end. CpMask (common.cuh): full, causal with offsets and strides.
//
// Design (FlashAttention-3 style dK/dV): block = 2 warpgroups (256 threads), BN = 128 keys of one
// KV head; warpgroup w owns keys [64w, 64w + 64) and keeps their dK and dV (64 x D f32 each) in
// registers as wgmma accumulators. K and V of the block stay in shared memory; the block streams
// query tiles of BQ = 64 rows of every query head of the group, from the first query that sees the
// block's first key (CpMask::query_begin; earlier tiles are fully masked and skipped). Per tile,
// each warpgroup runs
//   S^T  = K_w Q^T   : D/16 x wgmma m64n64k16, A = K (smem, K-major), B = Q (smem, K-major)
//   dP^T = V_w dO^T  : D/16 x wgmma m64n64k16, A = V, B = dO (both K-major)
//   P^T  = exp2(S^T * scale * log2 e - lse2[query])   (column-wise lse; hidden pairs -> 0)
//   dV  += P^T dO    : BQ/16 x wgmma m64nDk16, A = P^T from registers (accumulator re-packed to
//                      16 bits), B = dO from smem MN-major (imm-trans-b = 1, as V in the forward)
//   dS^T = P^T (dP^T - delta[query])
//   dK  += dS^T Q    : BQ/16 x wgmma m64nDk16, A = dS^T from registers, B = Q MN-major.
// Overlap inside the warpgroup: S^T and dP^T are committed as two groups; wait_group 1 retires S^T
// and P^T is computed while dP^T runs; dV += P^T dO is committed and wait_group 1 retires dP^T, so
// dS^T is computed while the dV product runs; dK += dS^T Q is committed and wait_group 0 ends the
// tile (every branch retires what it commits).
// Copies: 16-byte cp.async with zero-fill past T/S into the 128-byte-swizzle canonical layout
// (sw_load, wgmma.cuh; layout and descriptor fields: flash_fwd_sm90.cu). Q and dO are double
// buffered: iteration it waits for its tile (cp.async.wait_group 0, fence.proxy.async, one
// __syncthreads), then prefetches tile it + 1 into the other buffer, which both warpgroups finished
// reading in iteration it - 1 (they retired all its wgmma groups before the barrier). lse2 / delta
// of tile it + 1 are loaded into registers by threads tid < BQ and stored to their shared buffer at
// the end of iteration it.
// Descriptors (SW128; kk = k-step of 16 elements):
//   K, V (A, K-major): start = kv + (kk/4)*BN*128 + w*64*128 + (kk%4)*32, LBO 16 (unused), SBO 1024
//   Q, dO (B, K-major): start = q + (kk/4)*BQ*128 + (kk%4)*32,            LBO 16 (unused), SBO 1024
//   dO, Q (B, MN-major, k-step kk = queries 16kk ..): start = q + kk*2048, LBO = BQ*128 (next 64 d),
//                                                     SBO = 1024 (next 8 queries)
// Fragments: accumulator element 4i + e of thread (warp wr of its warpgroup, lane 4g + t) is row
// (key) 16wr + g + 8(e/2), column 8i + 2t + (e%2) (query for S^T/dP^T, d for dK/dV).
// Ragged edges: query rows past T are zero-filled and get lse2 = +inf (P = 0) and delta 0, so
// they add nothing; keys past S are zero-filled and feed only dK/dV rows that are never stored.
// A row with lse = -inf gets lse2 = +inf as well.
//
// Shared memory (dynamic, base rounded up to 1024 bytes): K [BN x D], V [BN x D], Q stages 0/1,
// dO stages 0/1 ([BQ x D] each), then lse2 [2][BQ] and delta [2][BQ] f32: WGMMA_BWD_SMEM(D).
//
// Atomic-dQ variant (ATOMIC = true, flash_bwd_wgmma_atomic_*; FwdImpl::WgmmaAtomic, opt-in): the
// same kernel also computes dQ, so the dQ kernel is not run (5 products per (query,
// key) pair instead of 7). Before dK += dS^T Q is issued (its A-fragment registers may not be read
// while it runs), each thread stores its rounded dS^T values transposed into a 16-bit dS tile
// [BQ x BN] (SW128 K-major, 64 rows; the keys of warpgroup w are column block w; placed after
// the dO stages: WGMMA_BWD_SMEM_ATOMIC(D)); after dK is issued, fence.proxy.async and a
// block barrier publish it to the async proxy; then dQ = dS K: KS x wgmma m64n64k16 (wg_ss_tb,
// A = dS K-major, B = K MN-major with imm-trans-b). At D = 128 warpgroup w computes d columns
// [64w, 64w + 64) over all 128 keys (KS = 8, B start + w * BN * 128), at D = 64 all d columns over
// its own 64 keys (KS = 4, A start + w * BQ * 128, B start + w * 64 * 128). The f32 result times
// scale is added into dq (zero-filled, or accumulated, by the caller) with red.global.add.f32: a
// nondeterministic summation order. The dS tile is rewritten only after the next tile's barrier,
// when both warpgroups retired this tile's dQ products. Keys past S are masked explicitly
// (P = 0): their dS feeds dQ, and exp2(-lse2) of a zero key overflows to inf when lse << 0.
#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "flash_bwd_sm90.cu uses wgmma: compile it with -arch=compute_90a"
#endif

#include "flash_sm90.cuh"  // S^T / dP^T issue, P^T, dS^T, transposed dS store, dK / dV store
#include "wgmma.cuh"  // wgmma wrappers, descriptors, swizzled tile loads (shared with flash_fwd_sm90.cu)

// M: CpMask, or CpBand (the `_band_` entries: the query rows [qbegin(k0), qend(k0 + BN)) that see a
// key of the block; per-element band tests in tiles some row does not see whole).
template <typename T, int D, bool ATOMIC, typename M>
__device__ __forceinline__ void bwd_wgmma_dkdv(float* __restrict__ dq, const T* __restrict__ q, const T* __restrict__ k,
                                               const T* __restrict__ v, const T* __restrict__ do16,
                                               const float* __restrict__ lse, const float* __restrict__ delta,
                                               float* __restrict__ dk, float* __restrict__ dv, int T_, int S,
                                               int H, int Hkv, float scale, M mask, int accumulate) {
  constexpr int NWG = 2, NTH = 128 * NWG, BN = 64 * NWG, BQ = 64, NS = BQ / 2, NA = D / 2;
  constexpr uint32_t KV_BYTES = BN * D * 2, Q_BYTES = BQ * D * 2, DS_BYTES = ATOMIC ? BQ * BN * 2 : 0;
  static_assert(D % 64 == 0, "128-byte swizzle needs 64-element column blocks");
  CP_DYN_SMEM_A(unsigned char, wg_smem, 1024);
  const uint32_t k_sa = (cp_smem_u32(wg_smem) + 1023u) & ~1023u, v_sa = k_sa + KV_BYTES;
  auto q_st = [&](int st) { return v_sa + KV_BYTES + (uint32_t)st * Q_BYTES; };
  auto do_st = [&](int st) { return v_sa + KV_BYTES + (uint32_t)(2 + st) * Q_BYTES; };
  // ATOMIC: the dS tile [BQ x BN] (A of dQ = dS K) right after the dO stages; then lse2 [2][BQ]
  // and delta [2][BQ].
  const uint32_t ds_sa = do_st(2);
  auto smem_ptr = [&](uint32_t a) { return wg_smem + (a - cp_smem_u32(wg_smem)); };
  float* ls_s = reinterpret_cast<float*>(smem_ptr(ds_sa + DS_BYTES));
  float* dl_s = ls_s + 2 * BQ;
  // Key tiles along y, in increasing order: under a causal mask the first tiles see the most
  // queries, so the heaviest blocks are dispatched first (heads vary fastest, along x).
  const int b = blockIdx.z, kvh = blockIdx.x, k0 = blockIdx.y * BN, G = H / Hkv;
  const int tid = threadIdx.x, wg = tid >> 7, wr = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const float sl2 = scale * CP_LOG2E;

  const size_t kv_rs = (size_t)Hkv * D, q_rs = (size_t)H * D;
  const size_t kv_base = ((size_t)b * S * Hkv + kvh) * D;
  int i_begin, i_end;
  if constexpr (M::BAND)
    i_begin = mask.qbegin(k0, T_), i_end = mask.qend(min(k0 + BN, S), T_);
  else
    i_begin = mask.query_begin(mask.kpos(k0), T_), i_end = T_;
  const int n_qt = (i_end - i_begin + BQ - 1) / BQ, n_it = G * n_qt;  // G * n_qt < 2^31: checked by the launcher
  // Tile `it`: query head kvh * G + it / n_qt, rows i_begin + (it % n_qt) * BQ ..
  auto issue = [&](int it, int st, float& l2, float& dl) {
    const int hq = kvh * G + it / n_qt, i0 = i_begin + (it % n_qt) * BQ;
    const size_t qb = ((size_t)b * T_ * H + hq) * D;
    sw_load<BQ, D, NTH>(q_st(st), q + qb, q_rs, i0, T_, tid);
    sw_load<BQ, D, NTH>(do_st(st), do16 + qb, q_rs, i0, T_, tid);
    if (tid < BQ) {
      const int i = i0 + tid;
      const size_t li = ((size_t)b * H + hq) * T_ + i;
      const float l = i < T_ ? lse[li] : -INFINITY;
      l2 = l == -INFINITY ? INFINITY : l * CP_LOG2E;  // +inf: P = 0 for the row
      dl = i < T_ ? delta[li] : 0.f;
    }
  };
  // A block with no query tile (every query precedes its keys) issues no copy at all.
  if (n_it > 0) {
    sw_load<BN, D, NTH>(k_sa, k + kv_base, kv_rs, k0, S, tid);
    sw_load<BN, D, NTH>(v_sa, v + kv_base, kv_rs, k0, S, tid);
    float l2 = 0.f, dl = 0.f;
    issue(0, 0, l2, dl);
    if (tid < BQ) ls_s[tid] = l2, dl_s[tid] = dl;
    cp_async_commit();
  }
  float acc_k[NA], acc_v[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) acc_k[i] = acc_v[i] = 0.f;
  // This thread's two key rows (accumulator rows g and g + 8 of its warp).
  const int ja = k0 + wg * 64 + wr * 16 + g;
  const long long kp_a = mask.kpos(ja), kp_b = mask.kpos(ja + 8);
  const long long kp_last = mask.kpos(min(k0 + BN, S) - 1);
  // ATOMIC: keys past S must get P = 0 (their dS feeds dQ; exp2(-lse2) may overflow to inf).
  const bool ragged = ATOMIC && k0 + BN > S, kok_a = ja < S, kok_b = ja + 8 < S;
  // Band: the query rows that see key ja / ja + 8 (bwd_sm90_key_rows).
  int qa_lo = 0, qa_hi = 0, qb_lo = 0, qb_hi = 0;
  if constexpr (M::BAND) {
    bwd_sm90_key_rows(mask, ja, S, T_, qa_lo, qa_hi);
    bwd_sm90_key_rows(mask, ja + 8, S, T_, qb_lo, qb_hi);
  }

  for (int it = 0; it < n_it; ++it) {
    const int st = it & 1;
    cp_async_wait<0>();
    fence_proxy_async();
    // Tile it (and K, V) visible to the async proxy and to every thread; both warpgroups retired
    // the wgmma groups of iteration it - 1, which read stage st ^ 1 (refilled below).
    __syncthreads();
    const bool more = it + 1 < n_it;
    float nl = 0.f, nd = 0.f;
    if (more) issue(it + 1, st ^ 1, nl, nd);
    cp_async_commit();

    const int i0 = i_begin + (it % n_qt) * BQ;
    // (band: some row of the tile does not see all of the block's keys)
    const bool need_mask = M::BAND ? mask.tile_partial(i0, min(i0 + BQ, T_), k0, k0 + BN, S)
                                   : mask.causal && kp_last > mask.qpos(i0);
    const uint32_t qa = q_st(st), da = do_st(st);
    const float* ls = ls_s + st * BQ;
    const float* dls = dl_s + st * BQ;
    float s[NS], dp[NS];
    uint32_t pa[BQ / 16][4];
#pragma unroll
    for (int i = 0; i < NS; ++i) s[i] = dp[i] = 0.f;
    reg_fence(s);
    reg_fence(dp);
    wg_fence();
    // S^T = K_w Q^T, then dP^T = V_w dO^T: two groups.
    bwd_sm90_issue_s_dp<T, D, BN, BQ>(s, dp, k_sa, v_sa, qa, da, wg);
    wg_wait<1>();  // groups retire in order: S^T is done, dP^T may still run
    reg_fence(s);
    // P^T = exp2(S^T * sl2 - lse2) (element 4i + e: key row a/b, query i0 + 8i + 2t + (e & 1)),
    // re-packed as A fragments (k-step kk: queries 16kk .. 16kk + 15 = blocks 2kk, 2kk + 1).
    if constexpr (M::BAND) {
      bwd_sm90_p_band(s, ls, sl2, t, i0, need_mask, qa_lo, qa_hi, qb_lo, qb_hi, ragged, kok_a, kok_b);
    } else {
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
    acc_to_a<T>(pa, s);
    reg_fence(pa);
    reg_fence(acc_v);
    wg_fence();
    // dV += P^T dO: B = dO MN-major (k = queries, n = d).
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk)
      wg_rs<D, T>(acc_v, pa[kk], sw128_desc(da + (uint32_t)(kk * 2048), BQ * 128, 1024), 1);
    wg_commit();
    wg_wait<1>();  // dP^T done, dV += P^T dO may still run
    reg_fence(dp);
    // dS^T = P^T (dP^T - delta), re-packed as A fragments.
    uint32_t dsa[BQ / 16][4];
    bwd_sm90_ds(dp, s, dls, t);
    acc_to_a<T>(dsa, dp);
    if constexpr (ATOMIC) {
      // dS^T (the rounded values of dsa) into the dS tile, transposed: dS [query][key] in the
      // SW128 K-major layout (64 rows; keys of warpgroup w = column block w). Before dK += dS^T Q
      // is issued: dsa are that wgmma's A-fragment registers, which PTX forbids accessing (even
      // reading) until the wait_group that retires it (FlashAttention-3 stores dS first, too).
      bwd_sm90_ds_store<BQ>(dsa, ds_sa, wg, wr, lane);
    }
    reg_fence(dsa);
    reg_fence(acc_k);
    wg_fence();
    // dK += dS^T Q: B = Q MN-major.
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk)
      wg_rs<D, T>(acc_k, dsa[kk], sw128_desc(qa + (uint32_t)(kk * 2048), BQ * 128, 1024), 1);
    wg_commit();
    if constexpr (ATOMIC) {
      fence_proxy_async();
      __syncthreads();  // the whole dS tile (both warpgroups) visible to the async proxy
      // dQ partial = dS K (64 queries x 64 d): at D = 128 warpgroup w takes d [64w, 64w + 64) over
      // all 128 keys; at D = 64 all d over its own 64 keys (both warpgroups add into dQ).
      constexpr int KS = D == 128 ? BN / 16 : 4;
      const uint32_t a0 = D == 128 ? 0u : (uint32_t)(wg * BQ * 128);
      const uint32_t b0 = D == 128 ? (uint32_t)(wg * BN * 128) : (uint32_t)(wg * 64 * 128);
      float dqa[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) dqa[i] = 0.f;
      reg_fence(dqa);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
        wg_ss_tb<64, T>(dqa, sw128_desc(ds_sa + a0 + (uint32_t)((kk >> 2) * BQ * 128 + (kk & 3) * 32), 16, 1024),
                        sw128_desc(k_sa + b0 + (uint32_t)(kk * 2048), BN * 128, 1024), 1);
      wg_commit();
      wg_wait<0>();
      reg_fence(dqa);
      // dQ += scale * partial: element 4i + e is query row 16wr + g + 8(e/2), d = dc0 + 8i + 2t + (e & 1).
      const int hq = kvh * G + it / n_qt, dc0 = D == 128 ? wg * 64 : 0;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = i0 + wr * 16 + g + 8 * half;
        if (i >= T_) continue;
        float* dqr = dq + (((size_t)b * T_ + i) * H + hq) * D + dc0 + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          cp_red_add_f32(dqr + 8 * j, dqa[4 * j + 2 * half] * scale);
          cp_red_add_f32(dqr + 8 * j + 1, dqa[4 * j + 2 * half + 1] * scale);
        }
      }
    }
    wg_wait<0>();  // every product of this tile retired: stage st may be refilled after the barrier
    reg_fence(acc_v);
    reg_fence(acc_k);
    reg_fence(pa);
    reg_fence(dsa);
    // Nobody reads stage st ^ 1 of lse2 / delta any more (iteration it - 1 ended before the barrier).
    if (more && tid < BQ) ls_s[(st ^ 1) * BQ + tid] = nl, dl_s[(st ^ 1) * BQ + tid] = nd;
  }
  // Store dK (times scale) and dV rows ja, ja + 8: element 4i + e is row (e < 2 ? ja : ja + 8),
  // d = 8i + 2t + (e & 1).
  bwd_sm90_store_dkdv<D>(acc_k, acc_v, dk, dv, b, S, Hkv, kvh, ja, t, scale, accumulate);
}

// ---- dQ kernel --------------------------------------------------------------------------------------
// flash_bwd_wgmma_dq_*: dQ of BM = 128 query rows of one head per block (warpgroup w: rows
// [64w, 64w + 64), dQ 64 x D f32 in registers), streaming key tiles of BK = 128 up to the last key
// any row of the block sees; the forward's structure with dQ in place of O:
//   S  = Q_w K_j^T  : D/16 x wgmma m64n128k16 (A = Q, B = K, both K-major from shared memory)
//   dP = dO_w V_j^T : D/16 x wgmma m64n128k16 (A = dO, B = V)
//   P  = exp2(S * scale * log2 e - lse2[row]); keys past the row's last visible key (causal) or
//        past S -> 0 (lse2 = +inf for rows past T or with lse = -inf)
//   dS = P (dP - delta[row]);  dQ += dS K_j : BK/16 x wgmma m64nDk16, A = dS from registers,
//        B = K MN-major (imm-trans-b), as P V in the forward.
// S and dP are two groups: wait_group 1 retires S and P is computed while dP runs. Q and dO are
// loaded once; K and V double-buffered (tile j + 1 copied after the barrier of iteration j, into
// the stage both warpgroups finished in iteration j - 1). A warpgroup skips the key tiles past its
// own last visible key (warpgroup-uniform; every branch retires what it commits). lse2 and delta
// of a thread's two rows stay in registers. Deterministic: one writer per dQ element, scale
// applied at the store, accumulate != 0 adds into dq. Grid (H, ceil(T / 128), B), last query tiles
// first (the heaviest under a causal mask); shared memory WGMMA_DQ_SMEM(D).
// M: CpMask, or CpBand (the `_band_` entries: key tiles from the one holding lo of the block's first
// row, kb; K/V pointers, S and every bound shifted by kb, as in the band forward).
template <typename T, int D, typename M>
__device__ __forceinline__ void bwd_wgmma_dq(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ do16,
                                             const float* __restrict__ lse, const float* __restrict__ delta,
                                             float* __restrict__ dq, int T_, int S, int H, int Hkv, float scale,
                                             M mask, int accumulate) {
  constexpr int NWG = 2, NTH = 128 * NWG, BM = 64 * NWG, BK = 128, NS = BK / 2, NA = D / 2;
  constexpr uint32_t QM_BYTES = BM * D * 2, KV_BYTES = BK * D * 2;
  static_assert(D % 64 == 0, "128-byte swizzle needs 64-element column blocks");
  CP_DYN_SMEM_A(unsigned char, wg_smem, 1024);
  const uint32_t q_sa = (cp_smem_u32(wg_smem) + 1023u) & ~1023u, do_sa = q_sa + QM_BYTES, kv_sa = do_sa + QM_BYTES;
  auto k_st = [&](int st) { return kv_sa + (uint32_t)st * KV_BYTES; };
  auto v_st = [&](int st) { return kv_sa + (uint32_t)(2 + st) * KV_BYTES; };
  const int b = blockIdx.z, h = blockIdx.x, kvh = h / (H / Hkv);
  const int tid = threadIdx.x, wg = tid >> 7, wr = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row0 = (gridDim.y - 1 - blockIdx.y) * BM, wrow0 = row0 + wg * 64;
  const int ra = wrow0 + wr * 16 + g, rb = ra + 8;
  const float sl2 = scale * CP_LOG2E;
  // Keys [0, n_tiles * BK) cover every key a row of the block sees; [0, w_end) those of this
  // warpgroup; [0, w_full) are seen by every row of the warpgroup; row r sees [0, key_end(qpos(r))).
  // Band: row r sees [lo_a / lo_b, lim_a / lim_b) relative to kb; w_lo = lo of the warpgroup's last row.
  const int kb = M::BAND ? mask.kbegin(row0) / BK * BK : 0;  // row0 < T_ (grid ceil(T / BM))
  int n_tiles, w_end, w_full, lim_a, lim_b, lo_a = 0, lo_b = 0, w_lo = 0;
  if constexpr (M::BAND) {
    n_tiles = (mask.kend(min(row0 + BM, T_) - 1, S) - kb + BK - 1) / BK;
    const Sm90BandRows r = sm90_band_rows(mask, kb, wrow0, ra, rb, T_, S);
    w_end = r.w_end, w_full = r.w_full, lim_a = r.lim_a, lim_b = r.lim_b, lo_a = r.lo_a, lo_b = r.lo_b, w_lo = r.w_lo;
  } else {
    n_tiles = (mask.key_end(mask.qpos(min(row0 + BM, T_) - 1), S) + BK - 1) / BK;
    w_end = wrow0 < T_ ? mask.key_end(mask.qpos(min(wrow0 + 64, T_) - 1), S) : 0;
    w_full = mask.key_end(mask.qpos(wrow0), S);
    lim_a = mask.key_end(mask.qpos(ra), S), lim_b = mask.key_end(mask.qpos(rb), S);
  }
  const int n_act = (w_end + BK - 1) / BK;
  float l2[2], dl[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = hf ? rb : ra;
    const size_t li = ((size_t)b * H + h) * T_ + r;
    const float l = r < T_ ? lse[li] : -INFINITY;
    l2[hf] = l == -INFINITY ? INFINITY : l * CP_LOG2E;  // +inf: P = 0 for the row
    dl[hf] = r < T_ ? delta[li] : 0.f;
  }
  const size_t kv_rs = (size_t)Hkv * D, q_rs = (size_t)H * D;
  const T* kg = k + ((size_t)b * S * Hkv + kvh) * D + (size_t)kb * kv_rs;
  const T* vg = v + ((size_t)b * S * Hkv + kvh) * D + (size_t)kb * kv_rs;
  const int s_rel = S - kb;  // keys left from kb (zero fill past them)
  // A block whose rows see no key issues no copy (nothing in flight when its threads exit).
  if (n_tiles > 0) {
    const size_t qb = ((size_t)b * T_ * H + h) * D;
    sw_load<BM, D, NTH>(q_sa, q + qb, q_rs, row0, T_, tid);
    sw_load<BM, D, NTH>(do_sa, do16 + qb, q_rs, row0, T_, tid);
    sw_load<BK, D, NTH>(k_st(0), kg, kv_rs, 0, s_rel, tid);
    sw_load<BK, D, NTH>(v_st(0), vg, kv_rs, 0, s_rel, tid);
    cp_async_commit();
  }
  float acc[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) acc[i] = 0.f;

  for (int j = 0; j < n_tiles; ++j) {
    const int st = j & 1;
    cp_async_wait<0>();
    fence_proxy_async();
    // K_j, V_j (and Q, dO) visible to the async proxy; both warpgroups retired the products of
    // iteration j - 1, which read stage st ^ 1 (refilled below).
    __syncthreads();
    if (j + 1 < n_tiles) {
      sw_load<BK, D, NTH>(k_st(st ^ 1), kg, kv_rs, (j + 1) * BK, s_rel, tid);
      sw_load<BK, D, NTH>(v_st(st ^ 1), vg, kv_rs, (j + 1) * BK, s_rel, tid);
    }
    cp_async_commit();
    if (j < n_act) {  // warpgroup-uniform
      float s[NS], dp[NS];
#pragma unroll
      for (int i = 0; i < NS; ++i) s[i] = dp[i] = 0.f;
      reg_fence(s);
      reg_fence(dp);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t qo = (uint32_t)((kk >> 2) * BM * 128 + wg * 64 * 128 + (kk & 3) * 32);
        const uint32_t ko = (uint32_t)((kk >> 2) * BK * 128 + (kk & 3) * 32);
        wg_ss<BK, T>(s, sw128_desc(q_sa + qo, 16, 1024), sw128_desc(k_st(st) + ko, 16, 1024), 1);
      }
      wg_commit();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t qo = (uint32_t)((kk >> 2) * BM * 128 + wg * 64 * 128 + (kk & 3) * 32);
        const uint32_t ko = (uint32_t)((kk >> 2) * BK * 128 + (kk & 3) * 32);
        wg_ss<BK, T>(dp, sw128_desc(do_sa + qo, 16, 1024), sw128_desc(v_st(st) + ko, 16, 1024), 1);
      }
      wg_commit();
      wg_wait<1>();  // S done, dP may still run
      reg_fence(s);
      // P (element 4i + e: row e < 2 ? a : b, key j * BK + 8i + 2t + (e & 1)).
      const int k0 = j * BK;
      const bool full_tile = k0 + BK <= w_full && (!M::BAND || w_lo <= k0);
      const int ca = lim_a - k0 - 2 * t, cb = lim_b - k0 - 2 * t;
      // band: key c (relative to k0 + 2t) is visible iff la <= c < ca (one unsigned compare)
      const int la = lo_a - k0 - 2 * t, lb = lo_b - k0 - 2 * t;
#pragma unroll
      for (int i = 0; i < NS / 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = cp_exp2(fmaf(s[4 * i + e], sl2, -l2[e >> 1]));
          if constexpr (M::BAND) {
            const int l0 = e < 2 ? la : lb;
            if (!full_tile && (unsigned)(8 * i + (e & 1) - l0) >= (unsigned)((e < 2 ? ca : cb) - l0)) p = 0.f;
          } else {
            if (!full_tile && 8 * i + (e & 1) >= (e < 2 ? ca : cb)) p = 0.f;
          }
          s[4 * i + e] = p;
        }
      wg_wait<0>();  // dP done
      reg_fence(dp);
      // dS = P (dP - delta), re-packed as A fragments (k-step kk: keys 16kk .. 16kk + 15).
      uint32_t dsa[BK / 16][4];
#pragma unroll
      for (int i = 0; i < NS; ++i) dp[i] = s[i] * (dp[i] - dl[(i >> 1) & 1]);
      acc_to_a<T>(dsa, dp);
      reg_fence(dsa);
      reg_fence(acc);
      wg_fence();
      // dQ += dS K_j: B = K MN-major (k = keys, n = d).
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wg_rs<D, T>(acc, dsa[kk], sw128_desc(k_st(st) + (uint32_t)(kk * 2048), BK * 128, 1024), 1);
      wg_commit();
      wg_wait<0>();  // stage st may be refilled after the next barrier
      reg_fence(acc);
      reg_fence(dsa);
    }
  }
  // dQ * scale, rows ra / rb: element 4i + e is row (e < 2 ? ra : rb), d = 8i + 2t + (e & 1).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half ? rb : ra;
    if (r >= T_) continue;
    float* p = dq + (((size_t)b * T_ + r) * H + h) * D + 2 * t;
#pragma unroll
    for (int i = 0; i < NA / 4; ++i) {
      float2 x = make_float2(acc[4 * i + 2 * half] * scale, acc[4 * i + 2 * half + 1] * scale);
      float2* pp = reinterpret_cast<float2*>(p + 8 * i);
      if (accumulate) {
        const float2 o = *pp;
        x.x += o.x, x.y += o.y;
      }
      *pp = x;
    }
  }
}

// ---- entry points ---------------------------------------------------------------------------------
// flash_bwd_wgmma_dkdv_{f16,bf16}_d{64,128}(float* dk, float* dv, PIPE_ARGS): grid (Hkv,
// ceil(S / 128), B), block 256, dynamic shared memory WGMMA_BWD_SMEM(D) bytes (the launcher raises
// the limit). src/flash/bwd_sm90.rs mirrors these numbers.
#define WGMMA_BWD_BN 128
#define WGMMA_BWD_BQ 64
#define WGMMA_BWD_SMEM(D) ((2 * WGMMA_BWD_BN + 4 * WGMMA_BWD_BQ) * (D) * 2 + 4 * WGMMA_BWD_BQ * 4 + 1024)
// flash_bwd_wgmma_atomic_{f16,bf16}_d{64,128}(float* dq, float* dk, float* dv, PIPE_ARGS): the same
// plus dQ (f32, zero-filled or accumulated by the caller) summed with red.global.add.f32; shared
// memory adds the dS tile.
#define WGMMA_BWD_SMEM_ATOMIC(D) (WGMMA_BWD_SMEM(D) + WGMMA_BWD_BQ * WGMMA_BWD_BN * 2)
// flash_bwd_wgmma_dq_{f16,bf16}_d{64,128}(float* dq, PIPE_ARGS): grid (H, ceil(T / 128), B), block
// 256, dynamic shared memory WGMMA_DQ_SMEM(D): Q and dO [128 x D], K and V stages 0/1 [128 x D].
#define WGMMA_DQ_BM 128
#define WGMMA_DQ_BK 128
#define WGMMA_DQ_SMEM(D) ((2 * WGMMA_DQ_BM + 4 * WGMMA_DQ_BK) * (D) * 2 + 1024)
#define PIPE_ARGS                                                                                 \
  const TY *q, const TY *k, const TY *v, const TY *dout16, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, int causal, long long q_off,            \
      long long q_str, long long k_off, long long k_str, int accumulate
#define WGMMA_BWD(NAME, D)                                                                           \
  extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd_wgmma_dkdv_##NAME##_d##D(          \
      float* dk, float* dv, PIPE_ARGS) {                                                             \
    bwd_wgmma_dkdv<TY, D, false>(nullptr, q, k, v, dout16, lse, delta, dk, dv, T_, S, H, Hkv, scale,  \
                                 CpMask{causal, q_off, q_str, k_off, k_str}, accumulate);            \
  }                                                                                                  \
  extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd_wgmma_atomic_##NAME##_d##D(        \
      float* dq, float* dk, float* dv, PIPE_ARGS) {                                                  \
    bwd_wgmma_dkdv<TY, D, true>(dq, q, k, v, dout16, lse, delta, dk, dv, T_, S, H, Hkv, scale,       \
                                CpMask{causal, q_off, q_str, k_off, k_str}, accumulate);             \
  }                                                                                                  \
  extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd_wgmma_dq_##NAME##_d##D(float* dq,  \
                                                                                     PIPE_ARGS) {   \
    bwd_wgmma_dq<TY, D>(q, k, v, dout16, lse, delta, dq, T_, S, H, Hkv, scale,                      \
                        CpMask{causal, q_off, q_str, k_off, k_str}, accumulate);                     \
  }
// Band entries flash_bwd_wgmma_{dkdv,atomic,dq}_band_*: the mask arguments replaced by the band
// (CP_BAND_ARGS, common.cuh; launcher src/flash/band.rs -> bwd_sm90.rs, CPU reference
// candle_cp_ops::attention::attention_bwd_band).
#define PIPE_BAND_ARGS                                                                            \
  const TY *q, const TY *k, const TY *v, const TY *dout16, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, CP_BAND_ARGS, int accumulate
#define WGMMA_BWD_BAND(NAME, D)                                                                          \
  extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd_wgmma_dkdv_band_##NAME##_d##D(         \
      float* dk, float* dv, PIPE_BAND_ARGS) {                                                            \
    bwd_wgmma_dkdv<TY, D, false>(nullptr, q, k, v, dout16, lse, delta, dk, dv, T_, S, H, Hkv, scale,     \
                                 CP_BAND_OF_BLOCK, accumulate);                                          \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd_wgmma_atomic_band_##NAME##_d##D(       \
      float* dq, float* dk, float* dv, PIPE_BAND_ARGS) {                                                 \
    bwd_wgmma_dkdv<TY, D, true>(dq, q, k, v, dout16, lse, delta, dk, dv, T_, S, H, Hkv, scale,          \
                                CP_BAND_OF_BLOCK, accumulate);                                           \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd_wgmma_dq_band_##NAME##_d##D(float* dq, \
                                                                                         PIPE_BAND_ARGS) { \
    bwd_wgmma_dq<TY, D>(q, k, v, dout16, lse, delta, dq, T_, S, H, Hkv, scale, CP_BAND_OF_BLOCK, accumulate); \
  }
#define TY __half
WGMMA_BWD(f16, 64) WGMMA_BWD(f16, 128)
WGMMA_BWD_BAND(f16, 64) WGMMA_BWD_BAND(f16, 128)
#undef TY
#define TY __nv_bfloat16
WGMMA_BWD(bf16, 64) WGMMA_BWD(bf16, 128)
WGMMA_BWD_BAND(bf16, 64) WGMMA_BWD_BAND(bf16, 128)
#undef TY
