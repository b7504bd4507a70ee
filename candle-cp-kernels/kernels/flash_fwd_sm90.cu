// Flash-attention forward with log-sum-exp on Hopper warpgroup MMA (wgmma.mma_async), sm_90a only.
// EXPERIMENTAL and opt-in (`FwdImpl::Wgmma`, `CANDLE_CP_FLASH_IMPL=wgmma`): it has been compiled
// and assembled (ptxas sm_90a) and its indexing simulated (sim/fwd_wgmma_sim.py), but it had never
// run on a GPU when it was written. Rust caller: candle_cp_kernels::flash::fwd (src/flash.rs), and
// flash::fwd_fold (src/flash/fold.rs: folded into the ring's running state, CpFwdDst in common.cuh).
// Built by build.rs with -arch=compute_90a (PTX `.target sm_90a`); never compile it for compute_80.
//
// Same arguments and semantics as `flash_fwd_mma_*` (kernels/flash_fwd.cu): q [B, T, H, D],
// k/v [B, S, Hkv, D] contiguous f16/bf16, out f32 [B, T, H, D], lse f32 [B, H, T] (natural log),
// query head h reads KV head h / (H / Hkv), CpMask (common.cuh); a row that sees no key gets
// out = 0 and lse = -inf.
//
// Design ("FA3-lite"): block = 2 warpgroups (256 threads), BQ = 128 query rows, warpgroup w owns
// rows [64w, 64w + 64). Key tiles of BK = 128 keys. Per key tile j, each warpgroup runs
//   S_j = Q K_j^T : D/16 x wgmma m64n128k16, A = Q and B = K from shared memory (descriptors,
//                   K-major),
//   online softmax on the f32 accumulator fragment in registers (exp2 domain, f32 state),
//   O += P_j V_j  : BK/16 x wgmma m64nDk16, A = P from registers (the accumulator fragment
//                   re-packed to 16 bits), B = V from shared memory (MN-major: V is [key][d],
//                   imm-trans-b = 1),
// software-pipelined inside the warpgroup as in FlashAttention-3: iteration j issues S_j, then
// O += P_{j-1} V_{j-1}, waits for S_j only (wait_group 1), runs the softmax of tile j while the
// P V product is on the tensor cores, then waits for it (wait_group 0), rescales O and re-packs
// P_j. V therefore lags K by one tile; a final iteration j = n_tiles only drains P V.
// Copies: 16-byte cp.async with zero-fill past S/T. Iteration j copies K_{j+1} and V_j (double
// buffered, K and V stages separate); one __syncthreads per iteration, preceded in every thread by
// cp.async.wait_group 0 and fence.proxy.async.shared::cta (cp.async writes through the generic
// proxy, wgmma reads through the async proxy). The barrier also guarantees that both warpgroups
// retired the wgmma groups that read the stages about to be refilled (S_{j-1}: K stage (j+1)&1;
// P_{j-2} V_{j-2}: V stage j&1).
//
// Shared memory (dynamic, base rounded up to 1024 bytes): Q [BQ x D], K stages 0 and 1, V stages 0
// and 1 ([BK x D] each); every tile is stored in the 128-byte-swizzle canonical layout:
//   16-byte chunk c (elements 8c .. 8c+7) of row r of an R-row tile lives at byte
//     (c / 8) * R * 128 + r * 128 + ((c % 8) ^ (r % 8)) * 16
// i.e. column blocks of 64 elements (128 bytes per row), rows 128 bytes apart, 8-row groups 1024
// bytes apart, the chunk index XOR-ed with the row index mod 8 (Swizzle<3,4,3> on byte addresses).
// Descriptors (PTX ISA 9.7.15.5.1.2 "Matrix Descriptor Format" / "Canonical Layouts"; bits 0-13
// start address >> 4, 16-29 leading-dimension byte offset >> 4, 32-45 stride-dimension byte
// offset >> 4, 49-51 base offset (0: every tile starts on a 1024-byte boundary), 62-63 swizzle
// mode, 1 = 128-byte):
//   Q (A, K-major) : start = q + (kk/4)*BQ*128 + w*64*128 + (kk%4)*32, LBO = 16 (unused), SBO = 1024
//   K (B, K-major) : start = k + (kk/4)*BK*128 + (kk%4)*32,             LBO = 16 (unused), SBO = 1024
//   V (B, MN-major): start = v + kk*2048 (16 keys = two 8-row groups),   LBO = BK*128 (next 64 d
//                    values), SBO = 1024 (next 8 keys)
// where kk is the k-step of 16 elements. K-major SW128 canonical layout ((8,m),(T,2k)):((8T,SBO),(1,T)),
// MN-major SW128 ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)), T = 8 16-bit elements; advancing the start
// address by 32 bytes inside a 128-byte swizzled row selects the next 16 K elements because the
// swizzle is applied to the final address bits (tiles are 1024-byte aligned).
// Register fragments (PTX ISA "Matrix Fragments for wgmma.mma_async.m64nNk16"): thread = warp
// wr (0..3 in its warpgroup), lane = 4g + t; accumulator element 4i + e is row 16wr + g + 8(e/2),
// column 8i + 2t + (e%2); the A fragment register r (0..3) of k-step kk holds row 16wr + g + 8(r%2),
// columns 16kk + 2t + 8(r/2) + {0, 1} (low half first) — the mma.m16n8k16 layouts, so P is
// re-packed exactly as in the FlashAttention-2 kernels.
#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "flash_fwd_sm90.cu uses wgmma: compile it with -arch=compute_90a"
#endif

#include "flash_sm90.cuh"  // softmax step, rescale + P re-pack, O / lse store
#include "wgmma.cuh"  // wgmma wrappers, descriptors, swizzled tile loads (shared with flash_bwd_sm90.cu)

// ---- kernel body ----------------------------------------------------------------------------------
// M: CpMask, or CpBand (the `_band_` entries: key tiles from the one holding lo of the block's first
// row, kb; K/V pointers, S and every bound shifted by kb; rows past T take row T - 1's bounds and
// are not stored; flash_fwd_sm90_ws.cu's band entries do the same).
template <typename T, int D, int BK, typename M>
__device__ __forceinline__ void fwd_wgmma(const T* __restrict__ q, const T* __restrict__ k,
                                          const T* __restrict__ v, CpFwdDst dst, int B, int T_, int S, int H,
                                          int Hkv, float scale, M mask) {
  constexpr int NWG = 2, NTH = 128 * NWG, BQ = 64 * NWG, NS = BK / 2, NO = D / 2;
  constexpr uint32_t Q_BYTES = BQ * D * 2, KV_BYTES = BK * D * 2;
  static_assert(D % 64 == 0 && BK % 64 == 0, "128-byte swizzle needs 64-element column blocks");
  CP_DYN_SMEM_A(unsigned char, wg_smem, 1024);
  const uint32_t q_sa = (cp_smem_u32(wg_smem) + 1023u) & ~1023u;
  // K stages 0, 1, then V stages 0, 1, each KV_BYTES.
  const uint32_t kv_sa = q_sa + Q_BYTES;
  auto k_st = [&](int st) { return kv_sa + (uint32_t)st * KV_BYTES; };
  auto v_st = [&](int st) { return kv_sa + (uint32_t)(2 + st) * KV_BYTES; };
  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / Hkv);
  const int tid = threadIdx.x, wg = tid >> 7, wr = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // Last query tiles first: under a causal mask they have the most keys.
  const int row0 = (gridDim.x - 1 - blockIdx.x) * BQ, wrow0 = row0 + wg * 64;
  const int ra = wrow0 + wr * 16 + g, rb = ra + 8;
  const float sl2 = scale * CP_LOG2E;

  // Keys [0, n_tiles * BK) cover every key some row of the block sees; [0, w_end) those of this
  // warpgroup; keys [0, w_full) are visible to every row of the warpgroup (to its first row).
  // Band: row i sees keys [lo_a / lo_b, lim_a / lim_b) relative to kb; w_lo = lo of the
  // warpgroup's last row.
  const int kb = M::BAND ? mask.kbegin(row0) / BK * BK : 0;  // row0 < T_ (grid ceil(T / BQ))
  int n_tiles, w_end, w_full, lim_a, lim_b, lo_a = 0, lo_b = 0, w_lo = 0;
  if constexpr (M::BAND) {
    n_tiles = (mask.kend(min(row0 + BQ, T_) - 1, S) - kb + BK - 1) / BK;
    const Sm90BandRows r = sm90_band_rows(mask, kb, wrow0, ra, rb, T_, S);
    w_end = r.w_end, w_full = r.w_full, lim_a = r.lim_a, lim_b = r.lim_b, lo_a = r.lo_a, lo_b = r.lo_b, w_lo = r.w_lo;
  } else {
    n_tiles = (mask.key_end(mask.qpos(min(row0 + BQ, T_) - 1), S) + BK - 1) / BK;
    w_end = wrow0 < T_ ? mask.key_end(mask.qpos(min(wrow0 + 64, T_) - 1), S) : 0;
    w_full = mask.key_end(mask.qpos(wrow0), S);
    // Row i sees exactly keys [0, key_end(qpos(i))) (positions increase with the index).
    lim_a = mask.key_end(mask.qpos(ra), S), lim_b = mask.key_end(mask.qpos(rb), S);
  }

  const size_t kv_rs = (size_t)Hkv * D;
  const T* kg = k + ((size_t)b * S * Hkv + kvh) * D + (size_t)kb * kv_rs;
  const T* vg = v + ((size_t)b * S * Hkv + kvh) * D + (size_t)kb * kv_rs;
  const int s_rel = S - kb;  // keys left from kb (zero fill past them)

  float o[NO];
#pragma unroll
  for (int i = 0; i < NO; ++i) o[i] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;

  if (n_tiles > 0) {
    sw_load<BQ, D, NTH>(q_sa, q + ((size_t)b * T_ * H + h) * D, (size_t)H * D, row0, T_, tid);
    sw_load<BK, D, NTH>(k_st(0), kg, kv_rs, 0, s_rel, tid);
    sw_load<BK, D, NTH>(v_st(1), vg, kv_rs, 0, 0, tid);  // zeros (see the first iteration)
    cp_async_commit();
  }
  // This warpgroup computes tiles [0, n_act): some of its rows see a key of each of them.
  const int n_act = (w_end + BK - 1) / BK;
  uint32_t pa[BK / 16][4];  // P of the previous tile as wgmma A fragments (k-step kk: keys 16kk ..)
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;

  // S = Q K^T (64 x BK per warpgroup) from K stage ka: D/16 wgmma, not committed.
  auto issue_s = [&](float (&s)[NS], uint32_t ka_st) { fwd_sm90_issue_s<T, D, BQ, BK>(s, q_sa, ka_st, wg); };
  // O += P V (64 x D per warpgroup) with P = pa, V from stage va: BK/16 wgmma, not committed.
  auto issue_pv = [&](uint32_t va_st) { fwd_sm90_issue_pv<T, D, BK>(o, pa, va_st); };

  // Iteration j: S_j = Q K_j^T and, overlapping the softmax of tile j, O += P_{j-1} V_{j-1}.
  // V lags K by one tile; iteration n_tiles only drains P V of the last tile. Each branch below
  // retires every wgmma group it commits (ptxas serializes wgmma whose groups span divergent paths).
  for (int j = 0; j <= n_tiles; ++j) {
    cp_async_wait<0>();
    fence_proxy_async();
    // K_j, V_{j-1} (and Q) visible to the async proxy; both warpgroups are done with S_{j-1}
    // (K stage (j+1)&1) and with P_{j-2} V_{j-2} (V stage j&1), which the copies below refill.
    __syncthreads();
    if (j + 1 < n_tiles) sw_load<BK, D, NTH>(k_st((j + 1) & 1), kg, kv_rs, (j + 1) * BK, s_rel, tid);
    if (j < n_tiles) sw_load<BK, D, NTH>(v_st(j & 1), vg, kv_rs, j * BK, s_rel, tid);
    cp_async_commit();
    // warpgroup-uniform branches
    if (j < n_act) {
      float s[NS], al_a, al_b;
#pragma unroll
      for (int i = 0; i < NS; ++i) s[i] = 0.f;
      reg_fence(s);
      reg_fence(o);
      reg_fence(pa);
      wg_fence();
      issue_s(s, k_st(j & 1));
      wg_commit();
      // j = 0: P_{-1} = 0 (pa) times V stage 1, zero-filled by the prologue: adds exactly 0. (A
      // separate first-tile path without this product makes ptxas serialize every wgmma, C7520.)
      issue_pv(v_st((j - 1) & 1));  // in flight during the softmax below
      wg_commit();
      wg_wait<1>();  // groups retire in order: S_j is done, P V may still run
      reg_fence(s);
      fwd_sm90_softmax<BK, M::BAND>(s, j * BK, w_full, lim_a, lim_b, t, sl2, m_a, m_b, l_a, l_b, al_a, al_b, lo_a,
                                    lo_b, w_lo);
      wg_wait<0>();  // P_{j-1} V_{j-1} done: O and pa may be touched again
      reg_fence(o);
      reg_fence(pa);
      fwd_sm90_rescale_pack<T>(o, pa, s, al_a, al_b);
    } else if (j == n_act && j >= 1) {  // drain: O += P V of this warpgroup's last tile
      reg_fence(o);
      reg_fence(pa);
      wg_fence();
      issue_pv(v_st((j - 1) & 1));
      wg_commit();
      wg_wait<0>();
      reg_fence(o);
    }
  }

  fwd_sm90_store<D>(o, m_a, m_b, l_a, l_b, dst, b, h, H, T_, ra, t);
}

// ---- entry points ---------------------------------------------------------------------------------
// flash_fwd_wgmma_{bf16,f16}_d{64,128}: grid (ceil(T / 128), H, B), block 256, dynamic shared memory
// WGMMA_SMEM(D) bytes (above 48 KB: the launcher raises the limit). src/flash/sm90.rs mirrors
// these numbers.
#define WGMMA_BQ 128
#define WGMMA_BK 128
#define WGMMA_SMEM(D) ((WGMMA_BQ + 4 * WGMMA_BK) * (D) * 2 + 1024)
#define FWD_ARGS                                                                              \
  const TY *q, const TY *k, const TY *v, float *out, float *lse, int B, int T_, int S, int H, \
      int Hkv, float scale, int causal, long long q_off, long long q_str, long long k_off,    \
      long long k_str, int o_T, int o_row0, int o_merge
// Band entries flash_fwd_wgmma_band_*: the mask arguments replaced by the band (CP_BAND_ARGS,
// common.cuh; launcher src/flash/band.rs -> sm90.rs, CPU reference attention_fwd_band).
#define FWD_BAND_ARGS                                                                         \
  const TY *q, const TY *k, const TY *v, float *out, float *lse, int B, int T_, int S, int H, \
      int Hkv, float scale, CP_BAND_ARGS, int o_T, int o_row0, int o_merge
// o_T, o_row0, o_merge (every entry): the destination rows / fold (CpFwdDst, common.cuh).
#define FWD_DST CpFwdDst{out, lse, o_T, o_row0, o_merge}
#define WGMMA(NAME, D)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256, 1) flash_fwd_wgmma_##NAME##_d##D(FWD_ARGS) {          \
    fwd_wgmma<TY, D, WGMMA_BK>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale,                                 \
                               CpMask{causal, q_off, q_str, k_off, k_str});                               \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(256, 1) flash_fwd_wgmma_band_##NAME##_d##D(FWD_BAND_ARGS) { \
    fwd_wgmma<TY, D, WGMMA_BK>(q, k, v, FWD_DST, B, T_, S, H, Hkv, scale, CP_BAND_OF_BLOCK);             \
  }
#define TY __half
WGMMA(f16, 64) WGMMA(f16, 128)
#undef TY
#define TY __nv_bfloat16
WGMMA(bf16, 64) WGMMA(bf16, 128)
#undef TY
