// Flash-attention backward on Hopper, warp-specialized (FlashAttention-3 backward structure), with
// dQ fused and summed with f32 atomics, sm_90a only. EXPERIMENTAL and opt-in (`FwdImpl::WgmmaWs`,
// `CANDLE_CP_FLASH_IMPL=wgmma-ws`): compiled and assembled (ptxas sm_90a) and run under the CPU
// emulator (candle-cp-kernels/emu, check_fused.cpp vs a float64 reference); it had never run on a
// GPU when it was written.
// Rust caller: candle_cp_kernels::flash::bwd_with -> src/flash/bwd_sm90_ws.rs, which runs
// flash_bwd_pipe_prep_* (delta = rowsum(dO * O), 16-bit dO; kernels/flash_bwd_pipe.cu) and then
// flash_bwd_wgmma_ws_* on a zero-filled dq. CPU reference: candle_cp_ops::attention::attention_bwd.
// Built by build.rs with -arch=compute_90a; never compile it for compute_80.
//
// Same arguments and semantics as flash_bwd_wgmma_atomic_* (kernels/flash_bwd_sm90.cu, whose header
// documents the math, the layouts, descriptors and fragments used here unchanged): q [B, T, H, D],
// k/v [B, S, Hkv, D] (f16/bf16), do16 [B, T, H, D] (dO rounded by the prep kernel), lse / delta f32
// [B, H, T] (lse = -inf: the row sees no key and contributes nothing), dq f32 [B, T, H, D] added to
// with red.global.add.v4.f32 (nondeterministic summation order), dk/dv f32 [B, S, Hkv, D] summed over
// the H / Hkv query heads of each KV head (accumulate != 0 adds into dk/dv). CpMask (common.cuh).
//
// Design: block = 3 warpgroups (384 threads), BN = 128 keys of one KV head, query tiles of BQ = 64
// rows of every query head of the group from CpMask::query_begin on (earlier tiles are fully masked
// and skipped), as the atomic kernel.
//   warpgroup 0 = producer (setmaxnreg.dec to WSB_PRODUCER_REGS): copies K and V of the block once
//     (in tile 0's commit group) and each query tile's Q and dO with 16-byte cp.async (zero-fill
//     past T / S; sw_load with ROLLED = true (wgmma.cuh): sw_load's layout with the row loop kept
//     rolled, which fits the producer's 24 registers) into a ring of NST stages, and writes the
//     tile's lse2 (lse * log2 e, +inf for a row past T or with lse = -inf: P = 0) and delta into
//     the stage's f32 vectors (threads < BQ, plain shared stores);
//   warpgroups 1, 2 = consumers (setmaxnreg.inc to WSB_CONSUMER_REGS): consumer c owns keys
//     [64c, 64c + 64) and keeps their dK and dV (64 x D f32 each) in registers across the query
//     loop; per tile it runs the atomic kernel's sequence: S^T = K_c Q^T and dP^T = V_c dO^T (two
//     groups), P^T (wait_group 1), dV += P^T dO, dS^T = P^T (dP^T - delta), dS^T stored transposed
//     into the 16-bit dS tile, dK += dS^T Q, then dQ = dS K (at D = 128 consumer c takes d columns
//     [64c, 64c + 64) over all 128 keys, so both consumers' dS halves must be in the tile: named
//     barrier 1 over the 256 consumer threads after fence.proxy.async; at D = 64 consumer c reads
//     only its own keys' dS and no barrier is needed), scaled and added into dq.
// Ring protocol (mbarriers in shared memory):
//   full[s] (count 128: every producer thread): a producer thread issues tile n's copies (one
//     cp.async group) and stores its lse2 / delta; after issuing tile n + LAG it retires tile n's
//     group (cp.async.wait_group LAG), runs fence.proxy.async (its generic-proxy writes become
//     visible to the async proxy that wgmma reads through) and arrives (release; covers the plain
//     lse2 / delta stores). A consumer waits on the phase parity (acquire) before tile n's wgmma.
//   empty[s] (count 256: every consumer thread): a consumer thread arrives after wait_group 0 has
//     retired every product of the tile (S^T, dP^T read Q / dO K-major, dV and dK read dO / Q
//     MN-major) and after its last read of the stage's lse2 / delta; the producer waits on it before
//     refilling the stage. Tile n lives in stage n % NST, fill n / NST: consumers wait full parity
//     (n / NST) & 1, the producer waits empty parity (n / NST - 1) & 1.
//   No deadlock while LAG <= NST - 1 (static_assert): the refill for tile n waits for the release of
//   tile n - NST, which the producer signalled after issuing tile n - NST + LAG < n.
//   NST = 3 at D = 128 (what fits in 227 KB with the double-buffered dS tile), 4 at D = 64; LAG = 1
//   (the copy of tile n is issued about NST - 1 tiles of consumer time before it is needed).
// dS tile: double-buffered (tile n uses buffer n & 1). At D = 128 consumer c rewrites buffer b in
//   tile n + 2 only after passing the barrier of tile n + 1, which the other consumer reaches only
//   after its wait_group 0 of tile n retired the dQ product that read buffer b.
// Shared memory (dynamic, base rounded up to 1024 bytes): K [BN x D], V [BN x D], Q stages
// 0 .. NST-1, dO stages 0 .. NST-1 ([BQ x D] each), dS buffers 0/1 [BQ x BN] (all 16-bit, SW128
// canonical layout), lse2 [NST][BQ], delta [NST][BQ] f32, then full[NST], empty[NST] (8 bytes
// each): WSB_SMEM(D).
#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "flash_bwd_sm90_ws.cu uses wgmma and setmaxnreg: compile it with -arch=compute_90a"
#endif

#include "mbarrier.cuh"  // mbarriers, named barriers, setmaxnreg
#include "tma.cuh"       // TMA tile loads (the _tma_ entries)
#include "flash_sm90.cuh"  // S^T / dP^T issue, P^T, dS^T, transposed dS store, dK / dV store
#include "wgmma.cuh"     // wgmma wrappers, descriptors, swizzled tile loads

// Register budget: 128 * (WSB_PRODUCER_REGS + 2 * WSB_CONSUMER_REGS) <= 65536.
#define WSB_PRODUCER_REGS 24
#define WSB_CONSUMER_REGS 240
static_assert(128 * (WSB_PRODUCER_REGS + 2 * WSB_CONSUMER_REGS) <= 65536, "register file");

// p[0..3] += v on four consecutive global f32 (16-byte aligned), atomically per element, without
// returning the old values: one red.global.add.v4.f32 (sm_90, PTX 8.1) instead of four scalar reds.
// Host emulation: plain adds (cp_red_add_f32 in common.cuh explains why that is atomic there).
__device__ __forceinline__ void wsb_red_add_v4(float* p, float4 v) {
#ifdef CP_HOST_EMU
  p[0] += v.x;
  p[1] += v.y;
  p[2] += v.z;
  p[3] += v.w;
#else
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#endif
}

// M: CpMask, or CpBand (the `_band_` entries: the query rows [qbegin(k0), qend(k0 + BN)) that see
// a key of the block, and per-element band tests in tiles some row does not see whole).
// TMA (the `_tma_` entries): K, V, Q and dO arrive by TMA tile loads through the tensor maps tm[0..3]
// = q, dO (box 64 x 1 x 64 x 1), k, v (box 64 x 1 x 128 x 1), [B, T or S, H or Hkv, D] innermost
// first, 128-byte swizzle, zeros out of bounds (kernel-parameter addresses, never a local copy).
// dQ leaves through tm[4] (f32 [B, T, H, D], box 32 x 1 x 64 x 1, 128-byte swizzle) as
// FlashAttention-3 does it: each consumer writes its scaled 64 x 64 partial into its own shared
// buffer (DQB_BYTES: two swizzled 32-column boxes, stored without bank conflicts), fences, syncs its
// warpgroup (named barrier 5 + cw) and one thread adds the buffer into dq with two TMA reductions
// (one per box, rows past T skipped); before the buffer is rewritten that thread waits for the
// reductions to have read it (cp.async.bulk.wait_group.read) and the warpgroup syncs again.
// The producer threads < BQ still write the stage's lse2 / delta; full[s] gets count BQ: thread 0
// arrives with expect_tx of the stage's bytes (and K / V's with tile 0) and issues the loads, threads
// 1 .. BQ - 1 arrive after their stores. No copy lag, no fence.proxy.async (TMA writes through the
// async proxy; the lse2 / delta stores are read by generic loads after the acquire).
template <typename T, int D, int NST, int LAG, typename M, bool TMA = false>
__device__ __forceinline__ void bwd_wgmma_ws(float* __restrict__ dq, const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ do16,
                                             const float* __restrict__ lse, const float* __restrict__ delta,
                                             float* __restrict__ dk, float* __restrict__ dv, int T_, int S, int H,
                                             int Hkv, float scale, M mask, int accumulate,
                                             const CpTmaMap* const* tm = nullptr) {
  constexpr int BN = 128, BQ = 64, PTH = 128, NS = BQ / 2, NA = D / 2;
  constexpr uint32_t KV_BYTES = BN * D * 2, Q_BYTES = BQ * D * 2, DS_BYTES = BQ * BN * 2;
  static_assert(D % 64 == 0, "128-byte swizzle needs 64-element column blocks");
  static_assert(NST >= 2 && LAG >= 1 && LAG <= NST - 1, "ring depth / copy lag (see the header)");
  CP_DYN_SMEM_A(unsigned char, ws_smem, 1024);
  const uint32_t base_sa = cp_smem_u32(ws_smem);
  const uint32_t k_sa = (base_sa + 1023u) & ~1023u, v_sa = k_sa + KV_BYTES;
  auto q_st = [&](int st) { return v_sa + KV_BYTES + (uint32_t)st * Q_BYTES; };
  auto do_st = [&](int st) { return v_sa + KV_BYTES + (uint32_t)(NST + st) * Q_BYTES; };
  const uint32_t ds_sa = do_st(NST);  // dS buffers 0 / 1
  constexpr uint32_t DQB_BYTES = BQ * 64 * 4;         // TMA: a consumer's dQ partial, f32 [2][BQ][32] (swizzled)
  const uint32_t dqb_sa = ds_sa + 2 * DS_BYTES;       // TMA: dQ buffers 0 / 1 (one per consumer)
  auto smem_ptr = [&](uint32_t a) { return ws_smem + (a - base_sa); };
  float* ls_s = reinterpret_cast<float*>(smem_ptr(dqb_sa + (TMA ? 2 * DQB_BYTES : 0u)));  // lse2 [NST][BQ]
  float* dl_s = ls_s + NST * BQ;                                            // delta [NST][BQ]
  uint64_t* full = reinterpret_cast<uint64_t*>(dl_s + NST * BQ);
  uint64_t* empty = full + NST;

  // Key tiles along y, in increasing order (the heaviest blocks under a causal mask first).
  const int b = blockIdx.z, kvh = blockIdx.x, k0 = blockIdx.y * BN, G = H / Hkv;
  const int tid = threadIdx.x, wg = tid >> 7;
  int i_begin, i_end;
  if constexpr (M::BAND)
    i_begin = mask.qbegin(k0, T_), i_end = mask.qend(min(k0 + BN, S), T_);
  else
    i_begin = mask.query_begin(mask.kpos(k0), T_), i_end = T_;
  const int n_qt = (i_end - i_begin + BQ - 1) / BQ, n_it = G * n_qt;  // G * n_qt < 2^31: checked by the launcher

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < NST; ++s) {
      cp_mbar_init(&full[s], TMA ? BQ : PTH);
      cp_mbar_init(&empty[s], 2 * 128);
    }
    cp_mbar_init_fence();
  }
  __syncthreads();  // the last block-wide barrier: the warpgroups go their own ways below

  if (wg == 0) {
    // ---- producer ----------------------------------------------------------------------------
    cp_setmaxnreg_dec<WSB_PRODUCER_REGS>();
    if constexpr (TMA) {
      if (tid == 0)
        for (int m = 0; m < 5; ++m) cp_tma_prefetch_map(tm[m]);
      if (tid < BQ) {
        for (int n = 0; n < n_it; ++n) {
          const int st = n % NST;
          if (n >= NST) cp_mbar_wait(&empty[st], (uint32_t)((n / NST - 1) & 1));
          const int hq = kvh * G + n / n_qt, i0 = i_begin + (n % n_qt) * BQ;
          const int i = i0 + tid;
          const size_t li = ((size_t)b * H + hq) * T_ + i;
          const float l = i < T_ ? lse[li] : -INFINITY;
          ls_s[st * BQ + tid] = l == -INFINITY ? INFINITY : l * CP_LOG2E;  // +inf: P = 0 for the row
          dl_s[st * BQ + tid] = i < T_ ? delta[li] : 0.f;
          if (tid == 0) {
            cp_mbar_arrive_expect_tx(&full[st], 2 * Q_BYTES + (n == 0 ? 2 * KV_BYTES : 0u));
#pragma unroll
            for (int c = 0; c < D / 64; ++c) {
              if (n == 0) {  // K and V of the block once, with tile 0
                cp_tma_load_4d(k_sa + (uint32_t)c * BN * 128, tm[2], 64 * c, kvh, k0, b, &full[st]);
                cp_tma_load_4d(v_sa + (uint32_t)c * BN * 128, tm[3], 64 * c, kvh, k0, b, &full[st]);
              }
              cp_tma_load_4d(q_st(st) + (uint32_t)c * BQ * 128, tm[0], 64 * c, hq, i0, b, &full[st]);
              cp_tma_load_4d(do_st(st) + (uint32_t)c * BQ * 128, tm[1], 64 * c, hq, i0, b, &full[st]);
            }
          } else {
            cp_mbar_arrive(&full[st]);
          }
        }
      }
      return;
    }
    const size_t kv_rs = (size_t)Hkv * D, q_rs = (size_t)H * D;
    // K and V join tile 0's commit group (a block without tiles copies nothing).
    if (n_it > 0) {
      const size_t kv_base = ((size_t)b * S * Hkv + kvh) * D;
      sw_load<BN, D, PTH, T, true>(k_sa, k + kv_base, kv_rs, k0, S, tid);
      sw_load<BN, D, PTH, T, true>(v_sa, v + kv_base, kv_rs, k0, S, tid);
    }
    for (int n = 0; n < n_it; ++n) {
      const int st = n % NST;
      if (n >= NST) cp_mbar_wait(&empty[st], (uint32_t)((n / NST - 1) & 1));
      // Tile n: query head kvh * G + n / n_qt, rows i_begin + (n % n_qt) * BQ ..
      const int hq = kvh * G + n / n_qt, i0 = i_begin + (n % n_qt) * BQ;
      const size_t qb = ((size_t)b * T_ * H + hq) * D;
      sw_load<BQ, D, PTH, T, true>(q_st(st), q + qb, q_rs, i0, T_, tid);
      sw_load<BQ, D, PTH, T, true>(do_st(st), do16 + qb, q_rs, i0, T_, tid);
      cp_async_commit();
      if (tid < BQ) {
        const int i = i0 + tid;
        const size_t li = ((size_t)b * H + hq) * T_ + i;
        const float l = i < T_ ? lse[li] : -INFINITY;
        ls_s[st * BQ + tid] = l == -INFINITY ? INFINITY : l * CP_LOG2E;  // +inf: P = 0 for the row
        dl_s[st * BQ + tid] = i < T_ ? delta[li] : 0.f;
      }
      if (n >= LAG) {
        cp_async_wait<LAG>();  // tile n - LAG (and older, K / V) landed
        fence_proxy_async();
        cp_mbar_arrive(&full[(n - LAG) % NST]);
      }
    }
    cp_async_wait<0>();
    fence_proxy_async();
    for (int m = max(0, n_it - LAG); m < n_it; ++m) cp_mbar_arrive(&full[m % NST]);
    return;
  }

  // ---- consumers ---------------------------------------------------------------------------------
  cp_setmaxnreg_inc<WSB_CONSUMER_REGS>();
  const int cw = wg - 1, wr = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const float sl2 = scale * CP_LOG2E;
  float acc_k[NA], acc_v[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) acc_k[i] = acc_v[i] = 0.f;
  // This thread's two key rows (accumulator rows g and g + 8 of its warp).
  const int ja = k0 + cw * 64 + wr * 16 + g;
  const long long kp_a = mask.kpos(ja), kp_b = mask.kpos(ja + 8);
  const long long kp_last = mask.kpos(min(k0 + BN, S) - 1);
  // Keys past S must get P = 0 (their dS feeds dQ; exp2(-lse2) may overflow to inf).
  const bool ragged = k0 + BN > S, kok_a = ja < S, kok_b = ja + 8 < S;
  // Band: the query rows that see key ja / ja + 8 (bwd_sm90_key_rows).
  int qa_lo = 0, qa_hi = 0, qb_lo = 0, qb_hi = 0;
  if constexpr (M::BAND) {
    bwd_sm90_key_rows(mask, ja, S, T_, qa_lo, qa_hi);
    bwd_sm90_key_rows(mask, ja + 8, S, T_, qb_lo, qb_hi);
  }

  for (int it = 0; it < n_it; ++it) {
    const int st = it % NST;
    const uint32_t dsb = ds_sa + (uint32_t)(it & 1) * DS_BYTES;
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
    cp_mbar_wait(&full[st], (uint32_t)((it / NST) & 1));  // tile it (and K, V) landed and fenced
    reg_fence(s);
    reg_fence(dp);
    wg_fence();
    // S^T = K_c Q^T, then dP^T = V_c dO^T: two groups.
    bwd_sm90_issue_s_dp<T, D, BN, BQ>(s, dp, k_sa, v_sa, qa, da, cw);
    wg_wait<1>();  // groups retire in order: S^T is done, dP^T may still run
    reg_fence(s);
    // P^T = exp2(S^T * sl2 - lse2) (element 4i + e: key row a/b, query i0 + 8i + 2t + (e & 1)),
    // re-packed as A fragments (k-step kk: queries 16kk .. 16kk + 15).
    if constexpr (M::BAND)
      bwd_sm90_p_band(s, ls, sl2, t, i0, need_mask, qa_lo, qa_hi, qb_lo, qb_hi, ragged, kok_a, kok_b);
    else
      bwd_sm90_p(s, ls, sl2, t, i0, mask, need_mask, kp_a, kp_b, ragged, kok_a, kok_b);
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
    // dS^T (the rounded values of dsa) into dS buffer it & 1, transposed: dS [query][key], SW128
    // K-major (64 rows; keys of consumer c = column block c). Before dK += dS^T Q is issued (dsa are
    // its A-fragment registers, not to be read while it runs).
    bwd_sm90_ds_store<BQ>(dsa, dsb, cw, wr, lane);
    reg_fence(dsa);
    reg_fence(acc_k);
    wg_fence();
    // dK += dS^T Q: B = Q MN-major.
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk)
      wg_rs<D, T>(acc_k, dsa[kk], sw128_desc(qa + (uint32_t)(kk * 2048), BQ * 128, 1024), 1);
    wg_commit();
    fence_proxy_async();  // this thread's dS stores visible to the async proxy
    // The dQ wgmma below reads dS rows written by every warp of the warpgroup (D = 64) or of both
    // consumers (D = 128): wgmma's .sync orders only the issuing warp, so a barrier over the
    // writers comes first (FlashAttention-3 syncs its MMA threads here too). D = 128: named
    // barrier 1, the 256 consumer threads; D = 64: barrier 2 + cw, this consumer's 128 threads.
    // It also keeps the dS buffer written at tile it + 2 from being refilled while a warp of
    // tile it may still read it (every writer passed tile it + 1's barrier after its wait_group 0).
    if constexpr (D == 128) cp_named_bar_sync(1, 256);
    else cp_named_bar_sync(2 + cw, 128);
    // dQ partial = dS K (64 queries x 64 d): at D = 128 consumer c takes d [64c, 64c + 64) over all
    // 128 keys; at D = 64 all d over its own 64 keys (both consumers add into dQ).
    constexpr int KS = D == 128 ? BN / 16 : 4;
    const uint32_t a0 = D == 128 ? 0u : (uint32_t)(cw * BQ * 128);
    const uint32_t b0 = D == 128 ? (uint32_t)(cw * BN * 128) : (uint32_t)(cw * 64 * 128);
    float dqa[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dqa[i] = 0.f;
    reg_fence(dqa);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
      wg_ss_tb<64, T>(dqa, sw128_desc(dsb + a0 + (uint32_t)((kk >> 2) * BQ * 128 + (kk & 3) * 32), 16, 1024),
                      sw128_desc(k_sa + b0 + (uint32_t)(kk * 2048), BN * 128, 1024), 1);
    wg_commit();
    wg_wait<0>();  // every product of this tile retired: Q / dO / lse2 / delta of stage st are free
    reg_fence(acc_v);
    reg_fence(acc_k);
    reg_fence(pa);
    reg_fence(dsa);
    reg_fence(dqa);
    cp_mbar_arrive(&empty[st]);
    // dQ += scale * partial: element 4j + e is query row 16wr + g + 8(e/2), d = dc0 + 8j + 2t + (e & 1).
    // Lanes t and t ^ 1 swap a pair so that each holds 4 consecutive d of one row (even t: row a,
    // d = dc0 + 8j + 2t .. + 3; odd t: row b, d = dc0 + 8j + 2t - 2 .. + 1): one v4 reduction each.
    const int hq = kvh * G + it / n_qt, dc0 = D == 128 ? cw * 64 : 0;
    if constexpr (TMA) {
      const uint32_t dqb = dqb_sa + (uint32_t)cw * DQB_BYTES;
      if ((tid & 127) == 0) cp_bulk_wait_read<0>();  // the last reduction from this buffer has read it
      cp_named_bar_sync(5 + cw, 128);
      // The buffer is tm[4]'s two boxes, columns [0, 32) then [32, 64), each [BQ][32] f32 with the
      // 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r & 7)). Step j stores columns
      // 8j' + 2t, + 1 of rows r = 16wr + g + 8hh, with j' = j for even g and j ^ 2 for odd g (same
      // box): the 16 lanes of a half-warp then cover the 32 banks once (cp_sts_cf checks it under
      // the emulator); with j' = j for all, rows g and g ^ 1 would share banks (2-way; the
      // row-major [BQ][64] buffer before this was 4-way).
      const bool odd_g = g & 1;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int jx = j ^ 2, jj = odd_g ? jx : j, r = wr * 16 + g + 8 * hh, cc = (8 * jj + 2 * t) & 31;
          const float x0 = odd_g ? dqa[4 * jx + 2 * hh] : dqa[4 * j + 2 * hh];
          const float x1 = odd_g ? dqa[4 * jx + 2 * hh + 1] : dqa[4 * j + 2 * hh + 1];
          const uint32_t a = dqb + (uint32_t)((j >> 2) * BQ * 128) + cp_sw128_f32_off(r, cc);
          cp_sts_cf(smem_ptr(a), make_float2(x0 * scale, x1 * scale));
        }
      fence_proxy_async();  // the stores visible to the async proxy the reduction reads through
      cp_named_bar_sync(5 + cw, 128);
      if ((tid & 127) == 0) {
        cp_tma_reduce_add_4d(tm[4], dc0, hq, i0, b, dqb);
        cp_tma_reduce_add_4d(tm[4], dc0 + 32, hq, i0, b, dqb + DQB_BYTES / 2);
        cp_bulk_commit();
      }
      continue;
    }
    const bool odd = t & 1;
    const int row = i0 + wr * 16 + g + (odd ? 8 : 0);
    float* dqr = dq + (((size_t)b * T_ + row) * H + hq) * D + dc0 + 4 * (t >> 1);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x0 = dqa[4 * j] * scale, x1 = dqa[4 * j + 1] * scale;
      const float y0 = dqa[4 * j + 2] * scale, y1 = dqa[4 * j + 3] * scale;
      const float r0 = __shfl_xor_sync(0xffffffffu, odd ? x0 : y0, 1);
      const float r1 = __shfl_xor_sync(0xffffffffu, odd ? x1 : y1, 1);
      if (row < T_) wsb_red_add_v4(dqr + 8 * j, odd ? make_float4(r0, r1, y0, y1) : make_float4(x0, x1, r0, r1));
    }
  }
  if constexpr (TMA)
    if ((tid & 127) == 0) cp_bulk_wait_read<0>();  // the buffer is read before the block may exit
  // Store dK (times scale) and dV rows ja, ja + 8: element 4i + e is row (e < 2 ? ja : ja + 8),
  // d = 8i + 2t + (e & 1).
  bwd_sm90_store_dkdv<D>(acc_k, acc_v, dk, dv, b, S, Hkv, kvh, ja, t, scale, accumulate);
}

// ---- entry points ---------------------------------------------------------------------------------
// flash_bwd_wgmma_ws_{f16,bf16}_d{64,128}(float* dq, float* dk, float* dv, PIPE_ARGS): grid (Hkv,
// ceil(S / 128), B), block 384, dynamic shared memory WSB_SMEM(D) bytes (the launcher raises the
// limit); dq zero-filled (or accumulated) by the caller. src/flash/bwd_sm90_ws.rs mirrors these.
#define WSB_BN 128
#define WSB_BQ 64
#define WSB_NST(D) ((D) == 128 ? 3 : 4)
#define WSB_LAG 1
#define WSB_SMEM(D)                                                                                 \
  ((2 * WSB_BN + 2 * WSB_NST(D) * WSB_BQ) * (D) * 2 + 2 * WSB_BQ * WSB_BN * 2 + 2 * WSB_NST(D) * WSB_BQ * 4 + \
   2 * WSB_NST(D) * 8 + 1024)
#define PIPE_ARGS                                                                                 \
  const TY *q, const TY *k, const TY *v, const TY *dout16, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, int causal, long long q_off,            \
      long long q_str, long long k_off, long long k_str, int accumulate
// TMA entries flash_bwd_wgmma_tma{,_band}_*: the same arguments followed by the tensor maps of q, dO
// (box 64 x 1 x 64 x 1), k and v (box 64 x 1 x 128 x 1) and dq (f32, box 32 x 1 x 64 x 1, 128-byte
// swizzle) (src/flash/tma.rs), __grid_constant__; dynamic shared memory WSB_SMEM_TMA(D) (two dQ
// buffers more).
#define WSB_SMEM_TMA(D) (WSB_SMEM(D) + 2 * WSB_BQ * 64 * 4)
#define TMA_BWD_MAPS                                                                              \
  const CP_GRID_CONSTANT CpTmaMap tm_q, const CP_GRID_CONSTANT CpTmaMap tm_do,                    \
      const CP_GRID_CONSTANT CpTmaMap tm_k, const CP_GRID_CONSTANT CpTmaMap tm_v,                 \
      const CP_GRID_CONSTANT CpTmaMap tm_dq
#define WGMMA_WS_BWD(NAME, D)                                                                         \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_bwd_wgmma_ws_##NAME##_d##D(             \
      float* dq, float* dk, float* dv, PIPE_ARGS) {                                                   \
    bwd_wgmma_ws<TY, D, WSB_NST(D), WSB_LAG>(dq, q, k, v, dout16, lse, delta, dk, dv, T_, S, H, Hkv,  \
                                             scale, CpMask{causal, q_off, q_str, k_off, k_str},       \
                                             accumulate);                                             \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_bwd_wgmma_tma_##NAME##_d##D(            \
      float* dq, float* dk, float* dv, PIPE_ARGS, TMA_BWD_MAPS) {                                     \
    const CpTmaMap* tm[5] = {&tm_q, &tm_do, &tm_k, &tm_v, &tm_dq};                                            \
    bwd_wgmma_ws<TY, D, WSB_NST(D), WSB_LAG, CpMask, true>(dq, q, k, v, dout16, lse, delta, dk, dv, T_, S, \
        H, Hkv, scale, CpMask{causal, q_off, q_str, k_off, k_str}, accumulate, tm);                  \
  }
// Band entries flash_bwd_wgmma_ws_band_*: the mask arguments replaced by the band (CP_BAND_ARGS,
// common.cuh; launcher src/flash/band.rs -> bwd_sm90_ws.rs, CPU reference
// candle_cp_ops::attention::attention_bwd_band).
#define PIPE_BAND_ARGS                                                                            \
  const TY *q, const TY *k, const TY *v, const TY *dout16, const float *lse, const float *delta, \
      int B, int T_, int S, int H, int Hkv, float scale, CP_BAND_ARGS, int accumulate
#define WGMMA_WS_BWD_BAND(NAME, D)                                                                   \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_bwd_wgmma_ws_band_##NAME##_d##D(       \
      float* dq, float* dk, float* dv, PIPE_BAND_ARGS) {                                             \
    bwd_wgmma_ws<TY, D, WSB_NST(D), WSB_LAG>(dq, q, k, v, dout16, lse, delta, dk, dv, T_, S, H, Hkv, \
                                             scale, CP_BAND_OF_BLOCK, accumulate);                   \
  }                                                                                                  \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_bwd_wgmma_tma_band_##NAME##_d##D(      \
      float* dq, float* dk, float* dv, PIPE_BAND_ARGS, TMA_BWD_MAPS) {                               \
    const CpTmaMap* tm[5] = {&tm_q, &tm_do, &tm_k, &tm_v, &tm_dq};                                           \
    bwd_wgmma_ws<TY, D, WSB_NST(D), WSB_LAG, CpBand, true>(dq, q, k, v, dout16, lse, delta, dk, dv, T_, S, \
        H, Hkv, scale, CP_BAND_OF_BLOCK, accumulate, tm);                                           \
  }
#define TY __half
WGMMA_WS_BWD(f16, 64) WGMMA_WS_BWD(f16, 128)
WGMMA_WS_BWD_BAND(f16, 64) WGMMA_WS_BWD_BAND(f16, 128)
#undef TY
#define TY __nv_bfloat16
WGMMA_WS_BWD(bf16, 64) WGMMA_WS_BWD(bf16, 128)
WGMMA_WS_BWD_BAND(bf16, 64) WGMMA_WS_BWD_BAND(bf16, 128)
#undef TY
