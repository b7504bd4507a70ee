// Flash-attention forward with log-sum-exp on Hopper, warp-specialized (FlashAttention-3 structure),
// sm_90a only. EXPERIMENTAL and opt-in (`FwdImpl::WgmmaWs`, `CANDLE_CP_FLASH_IMPL=wgmma-ws`): compiled
// and assembled (ptxas sm_90a) and run under the CPU emulator (candle-cp-kernels/emu, check_flash.cpp
// vs a float64 reference); it had never run on a GPU when it was written.
// Rust caller: candle_cp_kernels::flash::fwd (src/flash.rs -> src/flash/sm90_ws.rs) and
// flash::fwd_fold (src/flash/fold.rs: folded into the ring's running state); CPU reference:
// candle_cp_ops::attention::attention_fwd. Built by build.rs with -arch=compute_90a; never compile it
// for compute_80.
//
// Same arguments and semantics as `flash_fwd_wgmma_*` (kernels/flash_fwd_sm90.cu): q [B, T, H, D],
// k/v [B, S, Hkv, D] contiguous f16/bf16, out f32 [B, T, H, D], lse f32 [B, H, T] (natural log),
// query head h reads KV head h / (H / Hkv), CpMask (common.cuh); a row that sees no key gets out = 0
// and lse = -inf. Last query tiles first; key tiles past the block's last visible key are skipped.
//
// Design: block = 3 warpgroups (384 threads), BQ = 128 query rows, BK = 128 keys per tile.
//   warpgroup 0 = producer (setmaxnreg.dec to WS_PRODUCER_REGS): copies Q once and the K / V tiles
//     with 16-byte cp.async (zero-fill past T / S) into a ring of NST stages of K and NST of V
//     (a K stage and a V stage are separate so that K_j can be released before P_j V_j ran);
//   warpgroups 1, 2 = consumers (setmaxnreg.inc to WS_CONSUMER_REGS): consumer c owns query rows
//     [64c, 64c + 64) of the tile and runs the math of flash_fwd_sm90.cu (S = Q K^T from shared
//     memory, online softmax in registers, O += P V with P from registers), including its
//     intra-warpgroup overlap: iteration j issues S_j, then P_{j-1} V_{j-1}, waits for S_j only and
//     runs the softmax of tile j while P V is on the tensor cores.
// Ring protocol (mbarriers in shared memory, one per stage and kind):
//   full_k[s] / full_v[s] (count 128: every producer thread): a producer thread issues its copies of
//     a tile (one cp.async group), later retires the group (cp.async.wait_group), runs
//     fence.proxy.async (its generic-proxy writes become visible to the async proxy that wgmma reads
//     through) and then arrives (release). A consumer waits on the phase parity (acquire) before
//     the wgmma that reads the stage. Q travels in K_0's group (full_k[0], first phase).
//   empty_k[s] / empty_v[s] (count 256: every consumer thread): a consumer thread arrives once the
//     wgmma group that read the stage has retired in it (wgmma.wait_group); the producer waits on
//     it before refilling the stage. Tile j lives in stage j % NST, fill number j / NST: consumers
//     wait full parity (j / NST) & 1, the producer waits empty parity (j / NST - 1) & 1.
//   The producer issues the copy operations K_0 (+Q), V_0, K_1, V_1, ... and signals operation n
//   after issuing operation n + LAG (so about LAG operations are in flight). Consumers release K_j
//   in iteration j (once S_j retired) and V_{j-1} at the end of iteration j; so refilling a stage
//   never waits for an operation the producer has not signalled yet as long as LAG <= 2 NST - 2
//   (static_assert). Ring depth: NST = 3 at D = 128 (Q 32 KB + 6 x 32 KB: what fits in 227 KB),
//   4 at D = 64; LAG = 2. Why (in units of one key tile's tensor-core time, consumer-bound): the
//   signal of K_j waits for the issue of K_{j+1}, i.e. for the release of K_{j+1-NST}, and the
//   signal of V_j for the release of V_{j+1-NST}, which both consumers give only once P V_{j+1-NST}
//   retired (about tile j+2-NST's end); K_j is needed at the start of iteration j and V_j at the
//   start of iteration j+1, so NST = 3 leaves a tile of slack for each, NST = 2 none for V (the
//   second consumer's release would gate the first consumer's next turn, undoing the ping-pong).
// Ping-pong (FlashAttention-3 "warp scheduler barriers"): named barriers 1 (consumer 0's turn) and
//   2 (consumer 1's turn), 256 threads each (the waiting warpgroup's bar.sync plus the other's
//   bar.arrive). A consumer issues its wgmma of an iteration (S_j and P_{j-1} V_{j-1}) inside its
//   turn and hands the turn to the other one, so one warpgroup's GEMMs run while the other does its
//   softmax. Consumer 1 arrives on barrier 1 once at the start (consumer 0 goes first) and skips the
//   arrive of its last turn, so every barrier phase has exactly one bar.sync warpgroup and one
//   bar.arrive warpgroup and nothing is left pending at exit. Both consumers run all n_tiles tiles
//   of the block (no per-warpgroup tile skipping: the turns must alternate), masked tiles add
//   exactly nothing.
// Iteration j = 0 multiplies P = 0 with V_0 (a finite tile: data or zero-fill) instead of taking a
// separate first-tile path (the loop body stays one straight sequence for ptxas, as in
// flash_fwd_sm90.cu); a last turn drains P_{n-1} V_{n-1}.
// Shared memory (dynamic, base rounded up to 1024): Q [BQ x D], K stages 0 .. NST-1, V stages
// 0 .. NST-1 ([BK x D] each, 128-byte-swizzled canonical layout, descriptors and register fragments
// as documented in flash_fwd_sm90.cu), then the 4 NST mbarriers (8 bytes each).
#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "flash_fwd_sm90_ws.cu uses wgmma and setmaxnreg: compile it with -arch=compute_90a"
#endif

#include "mbarrier.cuh"  // mbarriers, named barriers, setmaxnreg
#include "tma.cuh"       // TMA tile loads (the _tma_ entries)
#include "flash_sm90.cuh"  // softmax step, rescale + P re-pack, O / lse store
#include "wgmma.cuh"     // wgmma wrappers, descriptors, swizzled tile loads

// Register budget. setmaxnreg only moves registers within the block's pool (PTX ISA, setmaxnreg: "A
// pool of available registers is maintained per-CTA"; ".inc blocks the execution until enough
// registers are available in the CTA's register pool"), i.e. what the block was launched with: 384
// threads x 168 (ptxas "Used 168 registers" for __launch_bounds__(384, 1): 65536 / 384 rounded down
// to a multiple of 8) = 64,512, not 65,536. (Audit fix: the bound was 65,536, which admits splits,
// e.g. 48 / 232, whose setmaxnreg.inc would wait forever on hardware.)
#define WS_PRODUCER_REGS 40
#define WS_CONSUMER_REGS 232
#define WS_LAUNCH_REGS (65536 / 384 / 8 * 8)
static_assert(128 * (WS_PRODUCER_REGS + 2 * WS_CONSUMER_REGS) <= 384 * WS_LAUNCH_REGS, "setmaxnreg pool");

// ---- kernel body ----------------------------------------------------------------------------------
// M: CpMask, or CpBand (the `_band_` entries: key tiles from the one holding lo of the block's first
// row; K/V pointers, S and every bound shifted by that tile's start kb, as in flash_fwd.cu's
// fwd_pipe; rows past T take row T - 1's bounds and are not stored).
// TMA (the `_tma_` entries): the producer's loads are TMA tile loads through the tensor maps tq, tk, tv
// (kernel parameters: their addresses, never a local copy; q, k, v as [B, T or S, H or Hkv, D], box 64 x 1 x 128 x 1, 128-byte swizzle: one load per
// 64-column block of a tile, straight into the layout above; zeros out of bounds), issued by one
// thread: full_k / full_v get count 1 (that thread's arrive.expect_tx of the tile's bytes) and
// complete when the bytes landed; no copy lag, no fence.proxy.async (TMA writes through the async
// proxy). Otherwise (the maps unused) the cp.async producer below.
template <typename T, int D, int BK, int NST, int LAG, typename M, bool TMA = false>
__device__ __forceinline__ void fwd_wgmma_ws(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, CpFwdDst dst, int B, int T_, int S, int H,
                                             int Hkv, float scale, M mask, const CpTmaMap* tq = nullptr,
                                             const CpTmaMap* tk = nullptr, const CpTmaMap* tv = nullptr) {
  constexpr int BQ = 128, PTH = 128, NS = BK / 2, NO = D / 2;
  constexpr uint32_t Q_BYTES = BQ * D * 2, KV_BYTES = BK * D * 2;
  static_assert(D % 64 == 0 && BK % 16 == 0, "128-byte swizzle needs 64-element column blocks of d; keys go in 16-key k-steps");
  static_assert(NST >= 2 && LAG >= 1 && LAG <= 2 * NST - 2, "ring depth / copy lag (see the header)");
  CP_DYN_SMEM_A(unsigned char, ws_smem, 1024);
  const uint32_t base_sa = cp_smem_u32(ws_smem);
  const uint32_t q_sa = (base_sa + 1023u) & ~1023u;
  const uint32_t kv_sa = q_sa + Q_BYTES;
  auto k_st = [&](int st) { return kv_sa + (uint32_t)st * KV_BYTES; };
  auto v_st = [&](int st) { return kv_sa + (uint32_t)(NST + st) * KV_BYTES; };
  // full_k[NST], full_v[NST], empty_k[NST], empty_v[NST]
  uint64_t* bars = reinterpret_cast<uint64_t*>(ws_smem + (q_sa + Q_BYTES + 2 * NST * KV_BYTES - base_sa));
  uint64_t* full_k = bars;
  uint64_t* full_v = bars + NST;
  uint64_t* empty_k = bars + 2 * NST;
  uint64_t* empty_v = bars + 3 * NST;

  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / Hkv);
  const int tid = threadIdx.x, wg = tid >> 7;
  // Last query tiles first: under a causal mask they have the most keys.
  const int row0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  // Keys [0, n_tiles * BK) cover every key some row of the block sees (uniform in the block).
  // Band: keys relative to kb (0 without a band).
  const int kb = M::BAND ? mask.kbegin(row0) / BK * BK : 0;  // row0 < T_ (grid ceil(T / BQ))
  int n_tiles;
  if constexpr (M::BAND)
    n_tiles = (mask.kend(min(row0 + BQ, T_) - 1, S) - kb + BK - 1) / BK;
  else
    n_tiles = (mask.key_end(mask.qpos(min(row0 + BQ, T_) - 1), S) + BK - 1) / BK;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < NST; ++s) {
      cp_mbar_init(&full_k[s], TMA ? 1 : PTH);
      cp_mbar_init(&full_v[s], TMA ? 1 : PTH);
      cp_mbar_init(&empty_k[s], 2 * 128);
      cp_mbar_init(&empty_v[s], 2 * 128);
    }
    cp_mbar_init_fence();
  }
  __syncthreads();  // the last block-wide barrier: the warpgroups go their own ways below

  if (wg == 0) {
    // ---- producer ----------------------------------------------------------------------------
    cp_setmaxnreg_dec<WS_PRODUCER_REGS>();
    if constexpr (TMA) {
      // One thread issues every load (Q with K_0); the rest of the warpgroup is done.
      if (tid == 0) {
        cp_tma_prefetch_map(tq);
        cp_tma_prefetch_map(tk);
        cp_tma_prefetch_map(tv);
        for (int n = 0; n < 2 * n_tiles; ++n) {
          const int j = n >> 1, st = j % NST;
          const bool isv = n & 1;
          uint64_t* full = isv ? &full_v[st] : &full_k[st];
          if (j >= NST) cp_mbar_wait(isv ? &empty_v[st] : &empty_k[st], (uint32_t)((j / NST - 1) & 1));
          cp_mbar_arrive_expect_tx(full, KV_BYTES + (n == 0 ? Q_BYTES : 0u));
          if (n == 0) {
#pragma unroll
            for (int c = 0; c < D / 64; ++c) cp_tma_load_4d(q_sa + (uint32_t)c * BQ * 128, tq, 64 * c, h, row0, b, full);
          }
          const uint32_t dst = isv ? v_st(st) : k_st(st);
#pragma unroll
          for (int c = 0; c < D / 64; ++c)
            cp_tma_load_4d(dst + (uint32_t)c * BK * 128, isv ? tv : tk, 64 * c, kvh, kb + j * BK, b, full);
        }
      }
      return;
    }
    const size_t kv_rs = (size_t)Hkv * D;
    const T* kg = k + ((size_t)b * S * Hkv + kvh) * D + (size_t)kb * kv_rs;
    const T* vg = v + ((size_t)b * S * Hkv + kvh) * D + (size_t)kb * kv_rs;
    const int s_rel = S - kb;  // keys left from kb (zero fill past them)
    const int n_ops = 2 * n_tiles;  // K_0 (+Q), V_0, K_1, V_1, ...
    // Signal operation m (its group retired and fenced in this thread).
    auto signal = [&](int m) {
      const int j = m >> 1;
      cp_mbar_arrive((m & 1) ? &full_v[j % NST] : &full_k[j % NST]);
    };
    // Q joins the first commit group (K_0's).
    if (n_ops > 0) sw_load<BQ, D, PTH>(q_sa, q + ((size_t)b * T_ * H + h) * D, (size_t)H * D, row0, T_, tid);
    for (int n = 0; n < n_ops; ++n) {
      const int j = n >> 1, st = j % NST;
      if (n & 1) {
        if (j >= NST) cp_mbar_wait(&empty_v[st], (uint32_t)((j / NST - 1) & 1));
        sw_load<BK, D, PTH>(v_st(st), vg, kv_rs, j * BK, s_rel, tid);
      } else {
        if (j >= NST) cp_mbar_wait(&empty_k[st], (uint32_t)((j / NST - 1) & 1));
        sw_load<BK, D, PTH>(k_st(st), kg, kv_rs, j * BK, s_rel, tid);
      }
      cp_async_commit();
      if (n >= LAG) {
        cp_async_wait<LAG>();  // operation n - LAG (and older) landed
        fence_proxy_async();
        signal(n - LAG);
      }
    }
    cp_async_wait<0>();
    fence_proxy_async();
    for (int m = max(0, n_ops - LAG); m < n_ops; ++m) signal(m);
    return;
  }

  // ---- consumers ---------------------------------------------------------------------------------
  cp_setmaxnreg_inc<WS_CONSUMER_REGS>();
  const int cw = wg - 1, ctid = tid - 128, wr = (ctid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wrow0 = row0 + cw * 64;
  const int ra = wrow0 + wr * 16 + g, rb = ra + 8;
  const float sl2 = scale * CP_LOG2E;
  // keys [0, w_full) are visible to every row of this warpgroup (to its first row); row i sees
  // exactly keys [0, key_end(qpos(i))) (positions increase with the index).
  // Band: row a / b sees keys [lo_a / lo_b, lim_a / lim_b) (relative to kb); w_lo = lo of the
  // warpgroup's last row.
  int w_full, lim_a, lim_b, lo_a = 0, lo_b = 0, w_lo = 0;
  if constexpr (M::BAND) {
    const Sm90BandRows r = sm90_band_rows(mask, kb, wrow0, ra, rb, T_, S);
    w_full = r.w_full, lim_a = r.lim_a, lim_b = r.lim_b, lo_a = r.lo_a, lo_b = r.lo_b, w_lo = r.w_lo;
  } else {
    w_full = mask.key_end(mask.qpos(wrow0), S);
    lim_a = mask.key_end(mask.qpos(ra), S), lim_b = mask.key_end(mask.qpos(rb), S);
  }

  float o[NO];
#pragma unroll
  for (int i = 0; i < NO; ++i) o[i] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  uint32_t pa[BK / 16][4];  // P of the previous tile as wgmma A fragments (k-step kk: keys 16kk ..)
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;

  // Ping-pong turns: named barrier 1 + cw is this consumer's, 2 - cw the other's.
  auto my_turn = [&] { cp_named_bar_sync(1 + cw, 256); };
  auto pass_turn = [&] { cp_named_bar_arrive(2 - cw, 256); };

  auto issue_s = [&](float (&s)[NS], uint32_t ka_st) { fwd_sm90_issue_s<T, D, BQ, BK>(s, q_sa, ka_st, cw); };
  auto issue_pv = [&](uint32_t va_st) { fwd_sm90_issue_pv<T, D, BK>(o, pa, va_st); };

  if (n_tiles > 0) {
    if (cw == 1) pass_turn();  // consumer 0 takes the first turn
    for (int j = 0; j < n_tiles; ++j) {
      const int st = j % NST, jv = j == 0 ? 0 : j - 1, sv = jv % NST;
      float s[NS], al_a, al_b;
#pragma unroll
      for (int i = 0; i < NS; ++i) s[i] = 0.f;
      // V_{j-1} (V_0 when j = 0), then K_j (and Q): the producer signals in that order anyway,
      // and no wait loop sits between the wgmma of the turn.
      cp_mbar_wait(&full_v[sv], (uint32_t)((jv / NST) & 1));
      cp_mbar_wait(&full_k[st], (uint32_t)((j / NST) & 1));
      my_turn();
      reg_fence(s);
      reg_fence(o);
      reg_fence(pa);
      wg_fence();
      issue_s(s, k_st(st));
      wg_commit();
      // j = 0: P = 0 (pa) times V_0 adds exactly 0; else P_{j-1} V_{j-1}.
      issue_pv(v_st(sv));  // in flight during the softmax below
      wg_commit();
      pass_turn();
      wg_wait<1>();  // groups retire in order: S_j is done, P V may still run
      cp_mbar_arrive(&empty_k[st]);
      reg_fence(s);
      fwd_sm90_softmax<BK, M::BAND>(s, j * BK, w_full, lim_a, lim_b, t, sl2, m_a, m_b, l_a, l_b, al_a, al_b, lo_a,
                                    lo_b, w_lo);
      wg_wait<0>();  // P_{j-1} V_{j-1} done: O and pa may be touched again, V stage free
      if (j > 0) cp_mbar_arrive(&empty_v[sv]);
      reg_fence(o);
      reg_fence(pa);
      fwd_sm90_rescale_pack<T>(o, pa, s, al_a, al_b);
    }
    // drain: O += P_{n-1} V_{n-1}; consumer 1's last turn hands nothing on (balanced barriers)
    const int jv = n_tiles - 1, sv = jv % NST;
    cp_mbar_wait(&full_v[sv], (uint32_t)((jv / NST) & 1));
    my_turn();
    reg_fence(o);
    reg_fence(pa);
    wg_fence();
    issue_pv(v_st(sv));
    wg_commit();
    if (cw == 0) pass_turn();
    wg_wait<0>();
    reg_fence(o);
  }

  fwd_sm90_store<D>(o, m_a, m_b, l_a, l_b, dst, b, h, H, T_, ra, t);
}

// ---- entry points ---------------------------------------------------------------------------------
// flash_fwd_wgmma_ws_{bf16,f16}_d{64,128}: grid (ceil(T / 128), H, B), block 384, dynamic shared
// memory WS_SMEM(D) bytes (above 48 KB: the launcher raises the limit). src/flash/sm90_ws.rs mirrors
// these numbers.
#define WS_BQ 128
#define WS_BK 128
#define WS_NST(D) ((D) == 128 ? 3 : 4)
#define WS_LAG 2
#define WS_SMEM(D) ((WS_BQ + 2 * WS_NST(D) * WS_BK) * (D) * 2 + 1024 + 4 * WS_NST(D) * 8)
#define FWD_ARGS                                                                              \
  const TY *q, const TY *k, const TY *v, float *out, float *lse, int B, int T_, int S, int H, \
      int Hkv, float scale, int causal, long long q_off, long long q_str, long long k_off,    \
      long long k_str, int o_T, int o_row0, int o_merge
// Band entries flash_fwd_wgmma_ws_band_*: the mask arguments replaced by the band (CP_BAND_ARGS,
// common.cuh; launcher src/flash/band.rs, CPU reference candle_cp_ops::attention::attention_fwd_band).
#define FWD_BAND_ARGS                                                                         \
  const TY *q, const TY *k, const TY *v, float *out, float *lse, int B, int T_, int S, int H, \
      int Hkv, float scale, CP_BAND_ARGS, int o_T, int o_row0, int o_merge
// o_T, o_row0, o_merge (every entry): the destination rows / fold (CpFwdDst, common.cuh).
#define FWD_DST CpFwdDst{out, lse, o_T, o_row0, o_merge}
// TMA entries flash_fwd_wgmma_tma{,_band}_*: the same arguments followed by the tensor maps of q, k
// and v (src/flash/tma.rs: [B, T or S, H or Hkv, D] innermost first, box 64 x 1 x 128 x 1, 128-byte
// swizzle), passed by value as __grid_constant__ parameters.
#define TMA_MAPS \
  const CP_GRID_CONSTANT CpTmaMap tm_q, const CP_GRID_CONSTANT CpTmaMap tm_k, const CP_GRID_CONSTANT CpTmaMap tm_v
#define WGMMA_WS(NAME, D)                                                                                   \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_fwd_wgmma_ws_##NAME##_d##D(FWD_ARGS) {         \
    fwd_wgmma_ws<TY, D, WS_BK, WS_NST(D), WS_LAG>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale,             \
                                                    CpMask{causal, q_off, q_str, k_off, k_str});            \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_fwd_wgmma_ws_band_##NAME##_d##D(FWD_BAND_ARGS) { \
    fwd_wgmma_ws<TY, D, WS_BK, WS_NST(D), WS_LAG>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale, CP_BAND_OF_BLOCK); \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_fwd_wgmma_tma_##NAME##_d##D(FWD_ARGS, TMA_MAPS) { \
    fwd_wgmma_ws<TY, D, WS_BK, WS_NST(D), WS_LAG, CpMask, true>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale,  \
        CpMask{causal, q_off, q_str, k_off, k_str}, &tm_q, &tm_k, &tm_v);                                   \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                      \
      flash_fwd_wgmma_tma_band_##NAME##_d##D(FWD_BAND_ARGS, TMA_MAPS) {                                     \
    fwd_wgmma_ws<TY, D, WS_BK, WS_NST(D), WS_LAG, CpBand, true>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale,  \
        CP_BAND_OF_BLOCK, &tm_q, &tm_k, &tm_v);                                                             \
  }
// Wide-tile TMA entries flash_fwd_wgmma_tma_wide_{f16,bf16}_d128 (FwdImpl::WgmmaTmaWide; CpMask only,
// d = 128 only): key tiles of WS_WIDE_BK = 176 keys (FlashAttention-3's tile for d = 128 without a
// causal mask: 11 wgmma k-steps of P V and one m64n176k16 S product per 16 d, so the per-tile
// softmax, barrier and hand-over costs spread over 1.375x the keys) in a ring of WS_WIDE_NST = 2
// stages (Q 32 KB + 4 x 44 KB = 214,080 bytes; three stages do not fit). Same arguments and results as
// flash_fwd_wgmma_tma_*; the k / v maps have boxes of 176 rows (src/flash/sm90_ws.rs). Two stages
// suffice only because TMA needs no copy lag: V_j's load is issued once both consumers released
// V_{j-2} (end of iteration j-1) and must land by iteration j+1, one tile of tensor-core time later
// (with the cp.async producer's lag of 2, NST = 2 would leave none; see the header). Whether that
// slack covers the load on an H200, and whether the wider tile pays, is for gpu_bench to say.
#define WS_WIDE_BK 176
#define WS_WIDE_NST 2
#define WS_WIDE_SMEM ((WS_BQ + 2 * WS_WIDE_NST * WS_WIDE_BK) * 128 * 2 + 1024 + 4 * WS_WIDE_NST * 8)
#define WGMMA_TMA_WIDE(NAME)                                                                                     \
  extern "C" __global__ void __launch_bounds__(384, 1) flash_fwd_wgmma_tma_wide_##NAME##_d128(FWD_ARGS, TMA_MAPS) { \
    fwd_wgmma_ws<TY, 128, WS_WIDE_BK, WS_WIDE_NST, WS_LAG, CpMask, true>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale, \
        CpMask{causal, q_off, q_str, k_off, k_str}, &tm_q, &tm_k, &tm_v);                                          \
  }
#define TY __half
WGMMA_WS(f16, 64) WGMMA_WS(f16, 128) WGMMA_TMA_WIDE(f16)
#undef TY
#define TY __nv_bfloat16
WGMMA_WS(bf16, 64) WGMMA_WS(bf16, 128) WGMMA_TMA_WIDE(bf16)
#undef TY
