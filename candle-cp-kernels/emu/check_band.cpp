// Band-masked flash attention (the `_band_` entries of flash_fwd.cu, flash_bwd.cu,
// flash_bwd_pipe.cu and the Hopper kernels flash_{fwd,bwd}_sm90{,_ws}.cu, launched by src/flash/band.rs) under the emulator vs a float64 reference:
// query row i of batch row b sees the keys lo[b][i] <= j < hi[b][i] (lo, hi non-decreasing in i,
// lo <= hi <= S); a shared band (batch stride 0) or one band per batch row (stride T). A row with
// an empty interval has out 0, lse -inf and contributes nothing to the gradients.
// Cases: packed documents (causal and full), documents + sliding window, many short documents
// (with and without a window), a window over a ring step's keys, a batch-2 band with a different
// band per row, random bands with empty rows.
#include <algorithm>
#include <random>

#include "harness.h"

// kernels/tma.cuh's tensor-map parameter; emu_tma_map (check_flash.cpp): src/flash/tma.rs's maps
struct alignas(64) CpTmaMap {
  unsigned long long opaque[16];
};
CpTmaMap emu_tma_map(const void* p, int B, int L, int Hh, int D, int rows);
CpTmaMap emu_tma_map_dq(const float* p, int B, int T, int H, int D);

#define BAND_A const unsigned int*, const unsigned int*, long long
#define FWDB_P(TY) const TY*, const TY*, const TY*, float*, float*, int, int, int, int, int, float, BAND_A
// flash_fwd.cu's band entries: FWDB_P + the destination (o_T, o_row0, o_merge; CpFwdDst)
#define FWDXB_P(TY) FWDB_P(TY), int, int, int
// flash_fwd.cu's simple / pipe band entries: the logit soft cap after the scale
#define FWDCB_P(TY) const TY*, const TY*, const TY*, float*, float*, int, int, int, int, int, float, float, BAND_A, int, int, int
// flash_bwd.cu's band entries: the soft cap after the scale too
#define BWDB_P(TY) const TY*, const TY*, const TY*, const float*, const float*, const float*, int, int, int, int, int, float, float, BAND_A, int
// the pipelined backward takes dO rounded to TY (flash_bwd_pipe_prep_*)
#define PBWDB_P(TY) const TY*, const TY*, const TY*, const TY*, const float*, const float*, int, int, int, int, int, float, BAND_A, int
// flash_bwd_pipe.cu's band entries (pipe and pipe_cap): the soft cap last
#define PBWDBC_P(TY) PBWDB_P(TY), float
#define DECLB_D(N, TY, D)                                          \
  void flash_fwd_simple_band_##N##_d##D(FWDCB_P(TY));              \
  void flash_bwd_dkdv_band_##N##_d##D(float*, float*, BWDB_P(TY)); \
  void flash_bwd_dq_band_##N##_d##D(float*, BWDB_P(TY));
#define DECLB16_D(N, TY, D)                                             \
  void flash_fwd_pipe_band_##N##_d##D(FWDCB_P(TY));                     \
  void flash_fwd_pipe_cap_band_##N##_d##D(FWDCB_P(TY));                 \
  void flash_bwd_pipe_dkdv_band_##N##_d##D(float*, float*, PBWDBC_P(TY)); \
  void flash_bwd_pipe_dq_band_##N##_d##D(float*, PBWDBC_P(TY));           \
  void flash_bwd_pipe_cap_dkdv_band_##N##_d##D(float*, float*, PBWDBC_P(TY)); \
  void flash_bwd_pipe_cap_dq_band_##N##_d##D(float*, PBWDBC_P(TY));
#define DECLB(N, TY) DECLB_D(N, TY, 16) DECLB_D(N, TY, 32) DECLB_D(N, TY, 64) DECLB_D(N, TY, 96) DECLB_D(N, TY, 128) DECLB_D(N, TY, 256)
#define DECLB16(N, TY) DECLB16_D(N, TY, 16) DECLB16_D(N, TY, 32) DECLB16_D(N, TY, 64) DECLB16_D(N, TY, 96) DECLB16_D(N, TY, 128) DECLB16_D(N, TY, 256)
#define DECLWS_D(N, TY, D)                                                     \
  void flash_fwd_wgmma_ws_band_##N##_d##D(FWDXB_P(TY));                        \
  void flash_fwd_wgmma_tma_band_##N##_d##D(FWDXB_P(TY), CpTmaMap, CpTmaMap, CpTmaMap); \
  void flash_bwd_wgmma_tma_band_##N##_d##D(float*, float*, float*, PBWDB_P(TY), CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap); \
  void flash_bwd_wgmma_ws_band_##N##_d##D(float*, float*, float*, PBWDB_P(TY)); \
  void flash_fwd_wgmma_band_##N##_d##D(FWDXB_P(TY));                           \
  void flash_bwd_wgmma_atomic_band_##N##_d##D(float*, float*, float*, PBWDB_P(TY)); \
  void flash_bwd_wgmma_dkdv_band_##N##_d##D(float*, float*, PBWDB_P(TY));     \
  void flash_bwd_wgmma_dq_band_##N##_d##D(float*, PBWDB_P(TY));
extern "C" {
DECLWS_D(f16, __half, 64) DECLWS_D(f16, __half, 128) DECLWS_D(bf16, __nv_bfloat16, 64) DECLWS_D(bf16, __nv_bfloat16, 128)
DECLB(f32, float)
DECLB(f16, __half)
DECLB(bf16, __nv_bfloat16)
DECLB16(f16, __half)
DECLB16(bf16, __nv_bfloat16)
void flash_bwd_delta_f32(const float*, const float*, float*, int, int, int, int);
void flash_bwd_pipe_prep_f16(const float*, const float*, float*, __half*, int, int, int, int);
void flash_bwd_pipe_prep_bf16(const float*, const float*, float*, __nv_bfloat16*, int, int, int, int);
}

namespace {

template <typename TY> using FwdB = void (*)(FWDCB_P(TY));
template <typename TY> using DkdvB = void (*)(float*, float*, BWDB_P(TY));
template <typename TY> using DqB = void (*)(float*, BWDB_P(TY));
template <typename TY> using PDkdvB = void (*)(float*, float*, PBWDBC_P(TY));
template <typename TY> using PDqB = void (*)(float*, PBWDBC_P(TY));

// Entry points by (family, D): family 0 = simple (CUDA cores), 1 = pipe (tensor cores).
#define PICK(PRE, N, D)                                                                                           \
  (D == 16 ? (void*)&PRE##N##_d16 : D == 32 ? (void*)&PRE##N##_d32 : D == 64 ? (void*)&PRE##N##_d64 : D == 96 ? (void*)&PRE##N##_d96 \
   : D == 128 ? (void*)&PRE##N##_d128 : (void*)&PRE##N##_d256)
#define PICK_CORE(PRE, N, D) PICK(PRE, N, D)
template <typename TY> struct Ents;
// (void*: the pipelined backward entries take dO as TY, see PBWDB_P)
// fwdc: the pipelined forward's soft-capped band entries (flash_fwd_pipe_cap_band_*)
template <> struct Ents<float> {
  static void* fwd(bool, int D) { return PICK_CORE(flash_fwd_simple_band_, f32, D); }
  static void* fwdc(int D) { return PICK_CORE(flash_fwd_simple_band_, f32, D); }  // (never called: no f32 pipe)
  static void* dkdvc(int D) { return PICK_CORE(flash_bwd_dkdv_band_, f32, D); }     // (never called)
  static void* dqc(int D) { return PICK_CORE(flash_bwd_dq_band_, f32, D); }         // (never called)
  static void* dkdv(bool, int D) { return PICK_CORE(flash_bwd_dkdv_band_, f32, D); }
  static void* dq(bool, int D) { return PICK_CORE(flash_bwd_dq_band_, f32, D); }
};
template <> struct Ents<__half> {
  static void* fwd(bool p, int D) { return p ? PICK(flash_fwd_pipe_band_, f16, D) : PICK_CORE(flash_fwd_simple_band_, f16, D); }
  static void* fwdc(int D) { return PICK(flash_fwd_pipe_cap_band_, f16, D); }
  static void* dkdvc(int D) { return PICK(flash_bwd_pipe_cap_dkdv_band_, f16, D); }
  static void* dqc(int D) { return PICK(flash_bwd_pipe_cap_dq_band_, f16, D); }
  static void* dkdv(bool p, int D) { return p ? PICK(flash_bwd_pipe_dkdv_band_, f16, D) : PICK_CORE(flash_bwd_dkdv_band_, f16, D); }
  static void* dq(bool p, int D) { return p ? PICK(flash_bwd_pipe_dq_band_, f16, D) : PICK_CORE(flash_bwd_dq_band_, f16, D); }
};
template <> struct Ents<__nv_bfloat16> {
  static void* fwd(bool p, int D) { return p ? PICK(flash_fwd_pipe_band_, bf16, D) : PICK_CORE(flash_fwd_simple_band_, bf16, D); }
  static void* fwdc(int D) { return PICK(flash_fwd_pipe_cap_band_, bf16, D); }
  static void* dkdvc(int D) { return PICK(flash_bwd_pipe_cap_dkdv_band_, bf16, D); }
  static void* dqc(int D) { return PICK(flash_bwd_pipe_cap_dq_band_, bf16, D); }
  static void* dkdv(bool p, int D) { return p ? PICK(flash_bwd_pipe_dkdv_band_, bf16, D) : PICK_CORE(flash_bwd_dkdv_band_, bf16, D); }
  static void* dq(bool p, int D) { return p ? PICK(flash_bwd_pipe_dq_band_, bf16, D) : PICK_CORE(flash_bwd_dq_band_, bf16, D); }
};

// One band problem: bounds [nb][T] (nb = 1: shared by every batch row, else B).
struct BandCase {
  std::string label;
  int B, T, S, H, Hkv, D;
  int nb;
  std::vector<unsigned> lo, hi;
  bool vis(int b, int i, int j) const {
    const size_t x = (size_t)(nb == 1 ? 0 : b) * T + i;
    return (int)lo[x] <= j && j < (int)hi[x];
  }
  std::string tag() const {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s d%d [b%d t%d s%d h%d kv%d band%d]", label.c_str(), D, B, T, S, H, Hkv, nb);
    return buf;
  }
};

// Band of queries at positions q0 + i against keys at k0 + j (i < T, j < S) under causal / full,
// an optional window (0: none) and documents given by their start positions (empty: none).
void band_of_positions(int T, int S, long q0, long k0, bool causal, long window, const std::vector<long>& doc_starts,
                       std::vector<unsigned>& lo, std::vector<unsigned>& hi) {
  for (int i = 0; i < T; ++i) {
    const long qp = q0 + i;
    long first = 0, last = causal ? qp : (long)1 << 40;
    if (window > 0) first = std::max(first, qp + 1 - window);
    if (!doc_starts.empty()) {
      auto it = std::upper_bound(doc_starts.begin(), doc_starts.end(), qp);
      const long a = *(it - 1), e = it == doc_starts.end() ? (long)1 << 40 : *it;
      first = std::max(first, a);
      last = std::min(last, e - 1);
    }
    long a = std::clamp(first - k0, 0L, (long)S), b = std::clamp(last + 1 - k0, 0L, (long)S);
    lo.push_back((unsigned)a);
    hi.push_back((unsigned)std::max(a, b));
  }
}

// Start positions of packed documents of 8..90 tokens (seeded) covering [0, T).
std::vector<long> random_doc_starts(long T, uint64_t seed) {
  std::vector<long> starts{0};
  std::mt19937_64 rng(seed);
  while (starts.back() < T) starts.push_back(starts.back() + 8 + (long)(rng() % 83));
  starts.pop_back();
  return starts;
}

// Random monotone band with runs of empty rows (lo == hi), rows that see everything up to S,
// and intervals that start and end mid-tile.
void band_random(int T, int S, std::mt19937_64& rng, std::vector<unsigned>& lo, std::vector<unsigned>& hi) {
  unsigned a = 0, b = 0;
  for (int i = 0; i < T; ++i) {
    const int r = (int)(rng() % 10);
    if (r < 3) a = std::min<unsigned>(S, a + (unsigned)(rng() % 9));
    if (r < 7) b = std::min<unsigned>(S, b + (unsigned)(rng() % 7));
    if (r == 9) a = b;  // empty row
    b = std::max(a, b);
    if (i % 37 == 36) b = (unsigned)S;  // a row that sees the rest
    lo.push_back(a);
    hi.push_back(b);
  }
}

// cap > 0: logits cap * tanh(scale * q.k / cap) (Gemma 2's soft cap), as check_flash.cpp's reference
Ref band_reference(const BandCase& c, const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                   const std::vector<double>& dout, double scale, double cap = 0.0) {
  const int B = c.B, T = c.T, S = c.S, H = c.H, Hkv = c.Hkv, D = c.D, G = H / Hkv;
  Ref r;
  r.out.assign((size_t)B * T * H * D, 0.0);
  r.dq.assign((size_t)B * T * H * D, 0.0);
  r.dk.assign((size_t)B * S * Hkv * D, 0.0);
  r.dv.assign((size_t)B * S * Hkv * D, 0.0);
  r.lse.assign((size_t)B * H * T, -INFINITY);
  r.delta.assign((size_t)B * H * T, 0.0);
  std::vector<double> s(S), p(S);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i) {
        const int kvh = h / G;
        const double* qi = &q[(((size_t)b * T + i) * H + h) * D];
        auto kj = [&](const std::vector<double>& x, int j) { return &x[(((size_t)b * S + j) * Hkv + kvh) * D]; };
        double m = -INFINITY;
        for (int j = 0; j < S; ++j) {
          if (!c.vis(b, i, j)) continue;
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += qi[d] * kj(k, j)[d];
          s[j] = cap > 0 ? cap * std::tanh(acc * scale / cap) : acc * scale;
          m = std::max(m, s[j]);
        }
        if (m == -INFINITY) continue;
        double l = 0;
        for (int j = 0; j < S; ++j) l += c.vis(b, i, j) ? std::exp(s[j] - m) : 0.0;
        const double lse = m + std::log(l);
        r.lse[((size_t)b * H + h) * T + i] = lse;
        double* oi = &r.out[(((size_t)b * T + i) * H + h) * D];
        for (int j = 0; j < S; ++j) {
          p[j] = c.vis(b, i, j) ? std::exp(s[j] - lse) : 0.0;
          for (int d = 0; d < D; ++d) oi[d] += p[j] * kj(v, j)[d];
        }
        const double* gi = &dout[(((size_t)b * T + i) * H + h) * D];
        double delta = 0;
        for (int d = 0; d < D; ++d) delta += gi[d] * oi[d];
        r.delta[((size_t)b * H + h) * T + i] = delta;
        double* dqi = &r.dq[(((size_t)b * T + i) * H + h) * D];
        for (int j = 0; j < S; ++j) {
          if (!c.vis(b, i, j)) continue;
          double dp = 0;
          for (int d = 0; d < D; ++d) dp += gi[d] * kj(v, j)[d];
          const double ds = p[j] * (dp - delta) * scale * (cap > 0 ? 1 - (s[j] / cap) * (s[j] / cap) : 1.0);
          double* dkj = &r.dk[(((size_t)b * S + j) * Hkv + kvh) * D];
          double* dvj = &r.dv[(((size_t)b * S + j) * Hkv + kvh) * D];
          for (int d = 0; d < D; ++d) {
            dqi[d] += ds * kj(k, j)[d];
            dkj[d] += ds * qi[d];
            dvj[d] += p[j] * gi[d];
          }
        }
      }
  return r;
}

unsigned cdivb(long a, long b) { return (unsigned)((a + b - 1) / b); }

template <typename T> const char* sfxb();
template <> const char* sfxb<float>() { return "f32"; }
template <> const char* sfxb<__half>() { return "f16"; }
template <> const char* sfxb<__nv_bfloat16>() { return "bf16"; }

// Forward and backward of one case with the simple (pipe = false) or pipelined kernels, launched
// as src/flash/band.rs does (grids, blocks, dynamic shared memory).
// cap > 0: the logit soft cap (the simple kernels and the pipelined forward; q and k times `amp`).
template <typename TY> void run_band(const BandCase& c, bool pipe, uint64_t seed, float cap = 0.f, double amp = 1.0) {
  const int B = c.B, T = c.T, S = c.S, H = c.H, Hkv = c.Hkv, D = c.D;
  const size_t nq = (size_t)B * T * H * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * H * T;
  const float scale = 1.f / std::sqrt((float)D);
  Buf<TY> q(nq), k(nk), v(nk);
  auto amped = [amp](std::vector<double> x) {
    for (auto& e : x) e *= amp;
    return x;
  };
  const auto qd = fill(q, amped(randn(nq, seed))), kd = fill(k, amped(randn(nk, seed + 1))), vd = fill(v, randn(nk, seed + 2));
  Buf<float> dout(nq), o32(nq), l32(nl);
  const auto dd = fill(dout, randn(nq, seed + 3));
  Buf<unsigned> lo(c.lo.size()), hi(c.hi.size());
  std::copy(c.lo.begin(), c.lo.end(), lo.p);
  std::copy(c.hi.begin(), c.hi.end(), hi.p);
  const long long bstride = c.nb == 1 ? 0 : T;
  const Ref ref = band_reference(c, qd, kd, vd, dd, (double)scale, (double)cap);
  fill(o32, ref.out);
  fill(l32, ref.lse);
  const bool bf = std::is_same<TY, __nv_bfloat16>::value;
  const std::string tag = std::string(pipe ? "pipe " : "simple ") + sfxb<TY>() + " " + c.tag() + (cap > 0 ? " softcap" : "");

  std::string name = "flash_fwd_band " + tag;
  if (wanted(name)) {
    Buf<float> out(nq), lse(nl);
    // pipe_band_smem (src/flash/band.rs): pipe_config's (PIPES: BQ 128, BK 64; BQ 64, BK 32 at d
    // 256) + 2 BQ ints (lim_s, lo_s), none at d 256 (both in the Q rows' padding)
    const unsigned rows = pipe ? (D == 256 ? 64 : 128) : 16;
    const size_t pbk = D == 256 || (cap > 0 && D == 128) ? 32 : 64;  // (PIPES_CAP: d128 at 32 capped)
    const size_t smem = pipe ? (rows + 4 * pbk) * (D + 8) * 2 + (D == 256 ? 0 : 2 * rows * 4) : core_smem(0, D);
    auto fn = reinterpret_cast<FwdB<TY>>(cap > 0 && pipe ? Ents<TY>::fwdc(D) : Ents<TY>::fwd(pipe, D));
    bool ok = cp_emu::launch(name.c_str(), dim3(cdivb(T, rows), H, B), dim3(128), smem, [&] {
      fn(q.p, k.p, v.p, out.p, lse.p, B, T, S, H, Hkv, scale, cap, lo.p, hi.p, bstride, T, 0, 0);
    });
    check_launch(name, ok);
    const double tol = !pipe ? 2e-5 : bf ? 2e-2 : 4e-3;
    if (ok) {
      check(name + " out", max_abs(out.to_f32(), ref.out), tol);
      check(name + " lse", max_abs(lse.to_f32(), ref.lse), !pipe ? 2e-5 : 1e-3);
      check_fold(name, B, T, H, D, ref.out, ref.lse, tol, seed + 7, [&](float* so, float* sl, int R, int r0, int mg) {
        return cp_emu::launch(name.c_str(), dim3(cdivb(T, rows), H, B), dim3(128), smem, [&] {
          fn(q.p, k.p, v.p, so, sl, B, T, S, H, Hkv, scale, cap, lo.p, hi.p, bstride, R, r0, mg);
        });
      });
    }
  }
  name = "flash_bwd_band " + tag;
  if (!wanted(name)) return;
  Buf<float> dq(nq), dk(nk), dv(nk), delta(nl);
  bool ok;
  if (!pipe) {
    auto dkdv = reinterpret_cast<DkdvB<TY>>(Ents<TY>::dkdv(false, D));
    auto dqf = reinterpret_cast<DqB<TY>>(Ents<TY>::dq(false, D));
    ok = cp_emu::launch("flash_bwd_delta_f32", dim3(cdivb((long)B * T * H, 4)), dim3(128), 0,
                        [&] { flash_bwd_delta_f32(o32.p, dout.p, delta.p, B, T, H, D); }) &&
         cp_emu::launch("flash_bwd_dkdv_band", dim3(cdivb(S, 32), Hkv, B), dim3(128), core_smem(1, D), [&] {
           dkdv(dk.p, dv.p, q.p, k.p, v.p, dout.p, l32.p, delta.p, B, T, S, H, Hkv, scale, cap, lo.p, hi.p, bstride, 0);
         }) &&
         cp_emu::launch("flash_bwd_dq_band", dim3(cdivb(T, 8), H, B), dim3(128), core_smem(2, D), [&] {
           dqf(dq.p, q.p, k.p, v.p, dout.p, l32.p, delta.p, B, T, S, H, Hkv, scale, cap, lo.p, hi.p, bstride, 0);
         });
  } else {
    // PipeCfg::of (src/flash/bwd_pipe.rs); dK/dV grid x = Hkv * D / kv_da; d96 takes d128's tiles
    const bool wide_q = D == 96 || D >= 128;
    const int kv_nw = 8, kv_bq = D == 256 ? 32 : 64, kv_da = D == 256 ? 128 : D, q_nw = wide_q ? 8 : 4, q_mt = wide_q ? 1 : 2,
              q_bn = D == 128 || D == 96 ? 64 : 32;
    const int bn = 16 * kv_nw, bm = 16 * q_mt * q_nw, row = (D + 8) * 2;
    const size_t smem_kv = (size_t)(2 * bn + 4 * kv_bq) * row + 4 * kv_bq * 4, smem_q = (size_t)(2 * bm + 4 * q_bn) * row;
    Buf<TY> do16(nq);
    // (a soft cap: the capped entries, flash_bwd_pipe_cap_*)
    auto dkdv = reinterpret_cast<PDkdvB<TY>>(cap > 0 ? Ents<TY>::dkdvc(D) : Ents<TY>::dkdv(true, D));
    auto dqf = reinterpret_cast<PDqB<TY>>(cap > 0 ? Ents<TY>::dqc(D) : Ents<TY>::dq(true, D));
    using PrepFn = void (*)(const float*, const float*, float*, TY*, int, int, int, int);
    PrepFn prep = bf ? (PrepFn)(void*)&flash_bwd_pipe_prep_bf16 : (PrepFn)(void*)&flash_bwd_pipe_prep_f16;
    ok = cp_emu::launch("flash_bwd_pipe_prep", dim3(cdivb((long)B * T * H, 4)), dim3(128), 0,
                        [&] { prep(o32.p, dout.p, delta.p, do16.p, B, T, H, D); }) &&
         // (d 256: 203,264 / 202,752 bytes, launched on Hopper only: bwd_pipe::fits)
         cp_emu::launch(D == 256 ? "flash_bwd_pipe_dkdv_band [sm_90]" : "flash_bwd_pipe_dkdv_band", dim3(Hkv * (D / kv_da), cdivb(S, bn), B),
                        dim3(32 * kv_nw), smem_kv, [&] {
           dkdv(dk.p, dv.p, q.p, k.p, v.p, (const TY*)do16.p, l32.p, delta.p, B, T, S, H, Hkv, scale, lo.p, hi.p, bstride, 0, cap);
         }) &&
         cp_emu::launch(D == 256 ? "flash_bwd_pipe_dq_band [sm_90]" : "flash_bwd_pipe_dq_band", dim3(H, cdivb(T, bm), B), dim3(32 * q_nw), smem_q, [&] {
           dqf(dq.p, q.p, k.p, v.p, (const TY*)do16.p, l32.p, delta.p, B, T, S, H, Hkv, scale, lo.p, hi.p, bstride, 0, cap);
         });
  }
  check_launch(name, ok);
  if (!ok) return;
  check(name + " delta", max_abs(delta.to_f32(), ref.delta), 1e-4 * std::sqrt((double)D));
  const double tol = !pipe ? 1e-4 : bf ? 3e-2 : 5e-3;
  check(name + " dq", rel_err(dq.to_f32(), ref.dq), tol);
  check(name + " dk", rel_err(dk.to_f32(), ref.dk), tol);
  check(name + " dv", rel_err(dv.to_f32(), ref.dv), tol);
}

// The Hopper kernels under a band (D 64 / 128), launched as src/flash/band.rs does. Family fam:
//   0 "wgmma": forward flash_fwd_wgmma_band_* (flash_fwd_sm90.cu; grid (ceil(T / 128), H, B), block
//     256, WGMMA_SMEM(D)); backward prep, flash_bwd_wgmma_dkdv_band_* (grid (Hkv, ceil(S / 128), B),
//     WGMMA_BWD_SMEM(D)) and flash_bwd_wgmma_dq_band_* (grid (H, ceil(T / 128), B), WGMMA_DQ_SMEM(D));
//   1 "wgmma_atomic": backward prep, flash_bwd_wgmma_atomic_band_* (WGMMA_BWD_SMEM_ATOMIC(D), dq
//     zero-filled; its forward is fam 0's);
//   2 "wgmma_ws": forward flash_fwd_wgmma_ws_band_* (flash_fwd_sm90_ws.cu; block 384, WS_SMEM(D));
//     backward prep, flash_bwd_wgmma_ws_band_* (flash_bwd_sm90_ws.cu; grid (Hkv, ceil(S / 128), B),
//     block 384, WSB_SMEM(D), dq zero-filled);
//   3 "wgmma_tma": fam 2 with TMA loads: flash_fwd_wgmma_tma_band_* and flash_bwd_wgmma_tma_band_*
//     (tensor maps as src/flash/tma.rs makes them).
#define PICK_D(PRE, N, D) (D == 128 ? (void*)&PRE##N##_d128 : (void*)&PRE##N##_d64)
#define PICK_T(PRE, D) (bf ? PICK_D(PRE, bf16, D) : PICK_D(PRE, f16, D))
template <typename TY> void run_band_sm90(const BandCase& c, uint64_t seed, int fam) {
  const int B = c.B, T = c.T, S = c.S, H = c.H, Hkv = c.Hkv, D = c.D;
  const size_t nq = (size_t)B * T * H * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * H * T;
  const float scale = 1.f / std::sqrt((float)D);
  const bool bf = std::is_same<TY, __nv_bfloat16>::value;
  const char* fname = fam == 0 ? "wgmma " : fam == 1 ? "wgmma_atomic " : fam == 2 ? "wgmma_ws " : "wgmma_tma ";
  const std::string name = std::string("flash_fwd_band ") + fname + sfxb<TY>() + " " + c.tag();
  const std::string bname = std::string("flash_bwd_band ") + fname + sfxb<TY>() + " " + c.tag();
  const bool fwd = fam != 1 && wanted(name);
  if (!fwd && !wanted(bname)) return;
  Buf<TY> q(nq), k(nk), v(nk);
  const auto qd = fill(q, randn(nq, seed)), kd = fill(k, randn(nk, seed + 1)), vd = fill(v, randn(nk, seed + 2));
  Buf<float> dout(nq), o32(nq), l32(nl);
  const auto dd = fill(dout, randn(nq, seed + 3));
  const Ref ref = band_reference(c, qd, kd, vd, dd, (double)scale);
  fill(o32, ref.out);
  fill(l32, ref.lse);
  Buf<unsigned> lo(c.lo.size()), hi(c.hi.size());
  std::copy(c.lo.begin(), c.lo.end(), lo.p);
  std::copy(c.hi.begin(), c.hi.end(), hi.p);
  const long long bstride = c.nb == 1 ? 0 : T;
  const int nst = D == 128 ? 3 : 4;
  if (fwd) {
    Buf<float> out(nq), lse(nl);
    const bool ws = fam >= 2;
    const size_t smem = ws ? (size_t)(128 + 2 * nst * 128) * D * 2 + 1024 + 4 * nst * 8  // WS_SMEM(D)
                           : (size_t)(128 + 4 * 128) * D * 2 + 1024;                     // WGMMA_SMEM(D)
    auto fn = reinterpret_cast<void (*)(FWDXB_P(TY))>(fam == 2 ? PICK_T(flash_fwd_wgmma_ws_band_, D)
                                                               : PICK_T(flash_fwd_wgmma_band_, D));
    using FwdTma = void (*)(FWDXB_P(TY), CpTmaMap, CpTmaMap, CpTmaMap);
    auto ft = reinterpret_cast<FwdTma>(PICK_T(flash_fwd_wgmma_tma_band_, D));
    // (o, l, o_T, o_row0, o_merge): the plain result, or folded into a state (check_fold)
    auto run = [&](float* o, float* l, int oT, int orow0, int merge) {
      return cp_emu::launch(name.c_str(), dim3(cdivb(T, 128), H, B), dim3(ws ? 384 : 256), smem, [&] {
        if (fam == 3)
          ft(q.p, k.p, v.p, o, l, B, T, S, H, Hkv, scale, lo.p, hi.p, bstride, oT, orow0, merge, emu_tma_map(q.p, B, T, H, D, 128),
             emu_tma_map(k.p, B, S, Hkv, D, 128), emu_tma_map(v.p, B, S, Hkv, D, 128));
        else
          fn(q.p, k.p, v.p, o, l, B, T, S, H, Hkv, scale, lo.p, hi.p, bstride, oT, orow0, merge);
      });
    };
    const bool ok = run(out.p, lse.p, T, 0, 0);
    check_launch(name, ok);
    if (ok) {
      check(name + " out", max_abs(out.to_f32(), ref.out), bf ? 2e-2 : 4e-3);
      check(name + " lse", max_abs(lse.to_f32(), ref.lse), 1e-3);
      check_fold(name, B, T, H, D, ref.out, ref.lse, bf ? 2e-2 : 4e-3, seed + 7, run);
    }
  }
  if (!wanted(bname)) return;
  Buf<float> dq(nq), dk(nk), dv(nk), delta(nl);
  std::fill(dq.p, dq.p + nq, 0.f);
  Buf<TY> do16(nq);
  using PrepFn = void (*)(const float*, const float*, float*, TY*, int, int, int, int);
  PrepFn prep = bf ? (PrepFn)(void*)&flash_bwd_pipe_prep_bf16 : (PrepFn)(void*)&flash_bwd_pipe_prep_f16;
  using Bwd3 = void (*)(float*, float*, float*, PBWDB_P(TY));  // dq, dk, dv (atomic, ws)
  using Bwd2 = void (*)(float*, float*, PBWDB_P(TY));         // dk, dv
  using Bwd1 = void (*)(float*, PBWDB_P(TY));                 // dq
  const dim3 kv_grid(Hkv, cdivb(S, 128), B), q_grid(H, cdivb(T, 128), B);
  const size_t kv_smem = (size_t)(2 * 128 + 4 * 64) * D * 2 + 4 * 64 * 4 + 1024;  // WGMMA_BWD_SMEM(D)
  bool ok = cp_emu::launch("flash_bwd_pipe_prep", dim3(cdivb((long)B * T * H, 4)), dim3(128), 0,
                           [&] { prep(o32.p, dout.p, delta.p, do16.p, B, T, H, D); });
  const TY* d16 = do16.p;
  if (ok && fam == 0) {
    auto kvf = reinterpret_cast<Bwd2>(PICK_T(flash_bwd_wgmma_dkdv_band_, D));
    auto dqf = reinterpret_cast<Bwd1>(PICK_T(flash_bwd_wgmma_dq_band_, D));
    const size_t q_smem = (size_t)(2 * 128 + 4 * 128) * D * 2 + 1024;  // WGMMA_DQ_SMEM(D)
    ok = cp_emu::launch(bname.c_str(), kv_grid, dim3(256), kv_smem, [&] {
           kvf(dk.p, dv.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, lo.p, hi.p, bstride, 0);
         }) &&
         cp_emu::launch(bname.c_str(), q_grid, dim3(256), q_smem, [&] {
           dqf(dq.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, lo.p, hi.p, bstride, 0);
         });
  } else if (ok) {
    auto f3 = reinterpret_cast<Bwd3>(fam == 1 ? PICK_T(flash_bwd_wgmma_atomic_band_, D) : PICK_T(flash_bwd_wgmma_ws_band_, D));
    const size_t smem = fam == 1 ? kv_smem + 64 * 128 * 2  // WGMMA_BWD_SMEM_ATOMIC(D)
                                 : (size_t)(2 * 128 + 2 * nst * 64) * D * 2 + 2 * 64 * 128 * 2 + 2 * nst * 64 * 4 + 2 * nst * 8 + 1024 +
                                       (fam == 3 ? 2 * 64 * 64 * 4 : 0);  // WSB_SMEM(D), WSB_SMEM_TMA(D)
    using Bwd3Tma = void (*)(float*, float*, float*, PBWDB_P(TY), CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap);
    auto ft = reinterpret_cast<Bwd3Tma>(PICK_T(flash_bwd_wgmma_tma_band_, D));
    ok = cp_emu::launch(bname.c_str(), kv_grid, dim3(fam == 1 ? 256 : 384), smem, [&] {
      if (fam == 3)
        ft(dq.p, dk.p, dv.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, lo.p, hi.p, bstride, 0,
           emu_tma_map(q.p, B, T, H, D, 64), emu_tma_map(d16, B, T, H, D, 64), emu_tma_map(k.p, B, S, Hkv, D, 128),
           emu_tma_map(v.p, B, S, Hkv, D, 128), emu_tma_map_dq(dq.p, B, T, H, D));
      else
        f3(dq.p, dk.p, dv.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, lo.p, hi.p, bstride, 0);
    });
  }
  check_launch(bname, ok);
  if (!ok) return;
  const double tol = bf ? 3e-2 : 5e-3;
  check(bname + " dq", rel_err(dq.to_f32(), ref.dq), tol);
  check(bname + " dk", rel_err(dk.to_f32(), ref.dk), tol);
  check(bname + " dv", rel_err(dv.to_f32(), ref.dv), tol);
}

// Simple with f32 (and a 16-bit type), pipe with f16 and bf16; the Hopper families (wgmma,
// wgmma_atomic, wgmma_ws, wgmma_tma) with f16 and bf16 at D 64 / 128.
void run_all(const BandCase& c, uint64_t& seed) {
  if (c.D == 96 || c.D == 256) {  // the CUDA-core and pipelined kernels alone
    run_band<float>(c, false, seed++);
    run_band<__nv_bfloat16>(c, false, seed++);
    run_band<__nv_bfloat16>(c, true, seed++);
    run_band<__half>(c, true, seed++);
    return;
  }
  if (c.D <= 64) run_band<float>(c, false, seed++);
  run_band<__nv_bfloat16>(c, false, seed++);
  run_band<__nv_bfloat16>(c, true, seed++);
  run_band<__half>(c, true, seed++);
  if (c.D == 64 || c.D == 128)
    for (int fam = 0; fam < 4; ++fam) {
      run_band_sm90<__nv_bfloat16>(c, seed++, fam);
      run_band_sm90<__half>(c, seed++, fam);
    }
}

}  // namespace

void run_band_checks() {
  uint64_t seed = 900;
  {  // packed documents, causal: one band over 4 documents (one of length 1)
    BandCase c{"docs causal", 1, 150, 150, 2, 1, 64, 1, {}, {}};
    band_of_positions(150, 150, 0, 0, true, 0, {0, 40, 41, 111}, c.lo, c.hi);
    run_all(c, seed);
  }
  {  // long packed documents, causal, d 64: query blocks of 128 whose keys start past 128 and 256
     // (the kernels' key offset kb > 0), a block spanning three documents
    BandCase c{"docs causal long", 1, 400, 400, 2, 1, 64, 1, {}, {}};
    band_of_positions(400, 400, 0, 0, true, 0, {0, 150, 290, 300}, c.lo, c.hi);
    run_all(c, seed);
  }
  {  // documents + sliding window 17, GQA 2:1
    BandCase c{"docs + window 17", 1, 200, 200, 4, 2, 32, 1, {}, {}};
    band_of_positions(200, 200, 0, 0, true, 17, {0, 70, 75, 160}, c.lo, c.hi);
    run_all(c, seed);
  }
  {  // ring step: 64 queries at 300.. against 192 keys at 100.., window 150 (both edges inside)
    BandCase c{"ring step window 150", 1, 64, 192, 1, 1, 128, 1, {}, {}};
    band_of_positions(64, 192, 300, 100, true, 150, {}, c.lo, c.hi);
    run_all(c, seed);
  }
  {  // batch 2, a different band per row: causal window 50 / full documents
    BandCase c{"batch-2 window | full docs", 2, 130, 130, 2, 2, 16, 2, {}, {}};
    band_of_positions(130, 130, 0, 0, true, 50, {}, c.lo, c.hi);
    band_of_positions(130, 130, 0, 0, false, 0, {0, 33, 97}, c.lo, c.hi);
    run_all(c, seed);
  }
  {  // many short packed documents (8..90 tokens), causal, d 128: every block and warp(group)
     // spans several documents; tiles a warp(group) sees in part, in one half or not at all
    BandCase c{"short docs causal", 1, 384, 384, 2, 1, 128, 1, {}, {}};
    band_of_positions(384, 384, 0, 0, true, 0, random_doc_starts(384, 13), c.lo, c.hi);
    run_all(c, seed);
  }
  {  // the same with a window of 24 keys, GQA 2:1, d 64
    BandCase c{"short docs + window 24", 1, 300, 300, 4, 2, 64, 1, {}, {}};
    band_of_positions(300, 300, 0, 0, true, 24, random_doc_starts(300, 14), c.lo, c.hi);
    run_all(c, seed);
  }
  {  // random bands with empty rows, batch 2 (per row), ragged T / S
    BandCase c{"random, empty rows", 2, 170, 201, 2, 1, 128, 2, {}, {}};
    std::mt19937_64 rng(11);
    band_random(170, 201, rng, c.lo, c.hi);
    band_random(170, 201, rng, c.lo, c.hi);
    run_all(c, seed);
  }
  {  // head dim 256 (Gemma 3's sliding layers): documents + window 20, GQA 2:1, and a ring step
     // whose window starts inside the keys
    BandCase c{"docs + window 20", 1, 70, 70, 2, 1, 256, 1, {}, {}};
    band_of_positions(70, 70, 0, 0, true, 20, {0, 30, 33}, c.lo, c.hi);
    run_all(c, seed);
    BandCase r{"ring step window 40", 1, 32, 64, 2, 2, 256, 1, {}, {}};
    band_of_positions(32, 64, 100, 50, true, 40, {}, r.lo, r.hi);
    run_all(r, seed);
  }
  {  // head dim 96 (Phi-3-mini's packed documents): 4 documents (one of length 1) over 2 blocks of
     // 128 query rows and 2 dK/dV blocks of 128 keys, GQA 3:1; and soft-capped (the capped entries)
    BandCase c{"docs causal", 1, 150, 150, 3, 1, 96, 1, {}, {}};
    band_of_positions(150, 150, 0, 0, true, 0, {0, 40, 41, 111}, c.lo, c.hi);
    run_all(c, seed);
    run_band<__nv_bfloat16>(c, true, seed++, 4.f, 3.0);
  }
  {  // shared random band over batch 2, leading empty rows, d 32
    BandCase c{"random shared, leading empty rows", 2, 77, 90, 3, 1, 32, 1, {}, {}};
    std::mt19937_64 rng(12);
    band_random(77, 90, rng, c.lo, c.hi);
    for (int i = 0; i < 9; ++i) c.lo[i] = c.hi[i] = 0;
    for (int i = 9; i < 77; ++i) c.hi[i] = std::max(c.hi[i], c.lo[i]);
    run_all(c, seed);
  }
  {  // logit soft cap (Gemma 2) under bands: documents + window (Gemma 2's sliding layers), d 64
     // and d 256, q and k at 3x the spread; the simple kernels both ways, the pipelined forward
    BandCase c{"docs + window 17", 1, 200, 200, 4, 2, 64, 1, {}, {}};
    band_of_positions(200, 200, 0, 0, true, 17, {0, 70, 75, 160}, c.lo, c.hi);
    BandCase r{"ring step window 40", 1, 32, 64, 2, 2, 256, 1, {}, {}};
    band_of_positions(32, 64, 100, 50, true, 40, {}, r.lo, r.hi);
    for (const BandCase* cp : {&c, &r}) {
      if (cp->D <= 64) run_band<float>(*cp, false, seed++, 4.f, 3.0);
      run_band<__nv_bfloat16>(*cp, false, seed++, 4.f, 3.0);
      run_band<__nv_bfloat16>(*cp, true, seed++, 4.f, 3.0);
      run_band<__half>(*cp, true, seed++, 4.f, 3.0);
    }
  }
}
