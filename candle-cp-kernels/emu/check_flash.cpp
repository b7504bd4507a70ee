// Flash-attention forward and backward kernels (flash_fwd.cu, flash_bwd.cu, flash_bwd_mma.cu,
// flash_bwd_pipe.cu) under the emulator vs a float64 reference with the CpMask semantics:
// query i at q_off + i * q_str, key j at k_off + j * k_str, visible iff !causal || kpos <= qpos;
// a row that sees no key has out 0, lse -inf and contributes nothing to the gradients.
#include <functional>
#include <map>
#include <memory>
#include <random>

#include "harness.h"
#include "tma_map.h"

// kernels/tma.cuh's tensor-map parameter (the same definition)
struct alignas(64) CpTmaMap {
  unsigned long long opaque[16];
};

#define FWD_HEAD(TY) const TY*, const TY*, const TY*, float*, float*, int, int, int, int, int, float
#define FWD_P(TY) FWD_HEAD(TY), int, long long, long long, long long, long long
// the Hopper forward entries: FWD_P + the destination (o_T, o_row0, o_merge; CpFwdDst)
#define FWDX_P(TY) FWD_P(TY), int, int, int
// flash_fwd.cu's entries (simple, mma, pipe): the logit soft cap after the scale
#define FWDC_P(TY) FWD_HEAD(TY), float, int, long long, long long, long long, long long, int, int, int
// flash_bwd.cu / flash_bwd_mma.cu: the soft cap after the scale too
#define BWD_P(TY) const TY*, const TY*, const TY*, const float*, const float*, const float*, int, int, int, int, int, float, float, int, long long, long long, long long, long long, int
#define PIPE_P(TY) const TY*, const TY*, const TY*, const TY*, const float*, const float*, int, int, int, int, int, float, int, long long, long long, long long, long long, int
// flash_bwd_pipe.cu's entries (pipe and pipe_cap): PIPE_P + the soft cap
#define PIPEC_P(TY) PIPE_P(TY), float
#define DECL_D(N, TY, D)                                                                    \
  void flash_fwd_simple_##N##_d##D(FWDC_P(TY));                                             \
  void flash_bwd_dkdv_##N##_d##D(float*, float*, BWD_P(TY));                                \
  void flash_bwd_dq_##N##_d##D(float*, BWD_P(TY));
#define DECL16_D(N, TY, D)                                                                  \
  void flash_fwd_mma_##N##_d##D(FWDC_P(TY));                                                \
  void flash_fwd_pipe_##N##_d##D(FWDC_P(TY));                                               \
  void flash_fwd_pipe_cap_##N##_d##D(FWDC_P(TY));                                           \
  void flash_bwd_mma_dkdv_##N##_d##D(float*, float*, BWD_P(TY));                            \
  void flash_bwd_mma_dq_##N##_d##D(float*, BWD_P(TY));                                      \
  void flash_bwd_pipe_dkdv_##N##_d##D(float*, float*, PIPEC_P(TY));                         \
  void flash_bwd_pipe_dq_##N##_d##D(float*, PIPEC_P(TY));                                   \
  void flash_bwd_pipe_cap_dkdv_##N##_d##D(float*, float*, PIPEC_P(TY));                     \
  void flash_bwd_pipe_cap_dq_##N##_d##D(float*, PIPEC_P(TY));
#define DECL(N, TY) DECL_D(N, TY, 16) DECL_D(N, TY, 32) DECL_D(N, TY, 64) DECL_D(N, TY, 96) DECL_D(N, TY, 128) DECL_D(N, TY, 256)
// head dim 256: the pipelined entries only (no mma kernels there; at 96 DECL16_D's, mma included)
#define DECLP_D(N, TY, D)                                                                   \
  void flash_fwd_pipe_##N##_d##D(FWDC_P(TY));                                               \
  void flash_fwd_pipe_cap_##N##_d##D(FWDC_P(TY));                                           \
  void flash_bwd_pipe_dkdv_##N##_d##D(float*, float*, PIPEC_P(TY));                         \
  void flash_bwd_pipe_dq_##N##_d##D(float*, PIPEC_P(TY));                                   \
  void flash_bwd_pipe_cap_dkdv_##N##_d##D(float*, float*, PIPEC_P(TY));                     \
  void flash_bwd_pipe_cap_dq_##N##_d##D(float*, PIPEC_P(TY));
#define DECL16(N, TY)                                                                       \
  DECL16_D(N, TY, 16) DECL16_D(N, TY, 32) DECL16_D(N, TY, 64) DECL16_D(N, TY, 128)           \
  DECL16_D(N, TY, 96) DECLP_D(N, TY, 256)                                                   \
  void flash_bwd_pipe_prep_##N(const float*, const float*, float*, TY*, int, int, int, int);
extern "C" {
DECL(f32, float)
DECL(f16, __half)
DECL(bf16, __nv_bfloat16)
DECL16(f16, __half)
DECL16(bf16, __nv_bfloat16)
void flash_bwd_delta_f32(const float*, const float*, float*, int, int, int, int);
void flash_fwd_wgmma_f16_d64(FWDX_P(__half));
void flash_fwd_wgmma_f16_d128(FWDX_P(__half));
void flash_fwd_wgmma_bf16_d64(FWDX_P(__nv_bfloat16));
void flash_fwd_wgmma_bf16_d128(FWDX_P(__nv_bfloat16));
void flash_fwd_wgmma_ws_f16_d64(FWDX_P(__half));
void flash_fwd_wgmma_ws_f16_d128(FWDX_P(__half));
void flash_fwd_wgmma_ws_bf16_d64(FWDX_P(__nv_bfloat16));
void flash_fwd_wgmma_ws_bf16_d128(FWDX_P(__nv_bfloat16));
void flash_fwd_wgmma_tma_f16_d64(FWDX_P(__half), CpTmaMap, CpTmaMap, CpTmaMap);
void flash_fwd_wgmma_tma_f16_d128(FWDX_P(__half), CpTmaMap, CpTmaMap, CpTmaMap);
void flash_fwd_wgmma_tma_bf16_d64(FWDX_P(__nv_bfloat16), CpTmaMap, CpTmaMap, CpTmaMap);
void flash_fwd_wgmma_tma_bf16_d128(FWDX_P(__nv_bfloat16), CpTmaMap, CpTmaMap, CpTmaMap);
void flash_fwd_wgmma_tma_wide_f16_d128(FWDX_P(__half), CpTmaMap, CpTmaMap, CpTmaMap);
void flash_fwd_wgmma_tma_wide_bf16_d128(FWDX_P(__nv_bfloat16), CpTmaMap, CpTmaMap, CpTmaMap);
void flash_bwd_wgmma_dkdv_f16_d64(float*, float*, PIPE_P(__half));
void flash_bwd_wgmma_dkdv_f16_d128(float*, float*, PIPE_P(__half));
void flash_bwd_wgmma_dkdv_bf16_d64(float*, float*, PIPE_P(__nv_bfloat16));
void flash_bwd_wgmma_dkdv_bf16_d128(float*, float*, PIPE_P(__nv_bfloat16));
void flash_bwd_wgmma_dq_f16_d64(float*, PIPE_P(__half));
void flash_bwd_wgmma_dq_f16_d128(float*, PIPE_P(__half));
void flash_bwd_wgmma_dq_bf16_d64(float*, PIPE_P(__nv_bfloat16));
void flash_bwd_wgmma_dq_bf16_d128(float*, PIPE_P(__nv_bfloat16));
void flash_bwd_wgmma_tma_f16_d64(float*, float*, float*, PIPE_P(__half), CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap);
void flash_bwd_wgmma_tma_f16_d128(float*, float*, float*, PIPE_P(__half), CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap);
void flash_bwd_wgmma_tma_bf16_d64(float*, float*, float*, PIPE_P(__nv_bfloat16), CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap);
void flash_bwd_wgmma_tma_bf16_d128(float*, float*, float*, PIPE_P(__nv_bfloat16), CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap);
void flash_bwd_wgmma_ws_f16_d64(float*, float*, float*, PIPE_P(__half));
void flash_bwd_wgmma_ws_f16_d128(float*, float*, float*, PIPE_P(__half));
void flash_bwd_wgmma_ws_bf16_d64(float*, float*, float*, PIPE_P(__nv_bfloat16));
void flash_bwd_wgmma_ws_bf16_d128(float*, float*, float*, PIPE_P(__nv_bfloat16));
}

#define REG_D(N, D) {"flash_fwd_simple_" #N "_d" #D, (void*)&flash_fwd_simple_##N##_d##D},  \
    {"flash_bwd_dkdv_" #N "_d" #D, (void*)&flash_bwd_dkdv_##N##_d##D},                     \
    {"flash_bwd_dq_" #N "_d" #D, (void*)&flash_bwd_dq_##N##_d##D},
#define REG16_D(N, D) {"flash_fwd_mma_" #N "_d" #D, (void*)&flash_fwd_mma_##N##_d##D},        \
    {"flash_fwd_pipe_" #N "_d" #D, (void*)&flash_fwd_pipe_##N##_d##D},                      \
    {"flash_fwd_pipe_cap_" #N "_d" #D, (void*)&flash_fwd_pipe_cap_##N##_d##D},              \
    {"flash_bwd_mma_dkdv_" #N "_d" #D, (void*)&flash_bwd_mma_dkdv_##N##_d##D},              \
    {"flash_bwd_mma_dq_" #N "_d" #D, (void*)&flash_bwd_mma_dq_##N##_d##D},                  \
    {"flash_bwd_pipe_dkdv_" #N "_d" #D, (void*)&flash_bwd_pipe_dkdv_##N##_d##D},            \
    {"flash_bwd_pipe_dq_" #N "_d" #D, (void*)&flash_bwd_pipe_dq_##N##_d##D},                \
    {"flash_bwd_pipe_cap_dkdv_" #N "_d" #D, (void*)&flash_bwd_pipe_cap_dkdv_##N##_d##D},    \
    {"flash_bwd_pipe_cap_dq_" #N "_d" #D, (void*)&flash_bwd_pipe_cap_dq_##N##_d##D},
#define REG(N) REG_D(N, 16) REG_D(N, 32) REG_D(N, 64) REG_D(N, 96) REG_D(N, 128) REG_D(N, 256)
#define REGP_D(N, D) {"flash_fwd_pipe_" #N "_d" #D, (void*)&flash_fwd_pipe_##N##_d##D},       \
    {"flash_fwd_pipe_cap_" #N "_d" #D, (void*)&flash_fwd_pipe_cap_##N##_d##D},              \
    {"flash_bwd_pipe_dkdv_" #N "_d" #D, (void*)&flash_bwd_pipe_dkdv_##N##_d##D},            \
    {"flash_bwd_pipe_dq_" #N "_d" #D, (void*)&flash_bwd_pipe_dq_##N##_d##D},                \
    {"flash_bwd_pipe_cap_dkdv_" #N "_d" #D, (void*)&flash_bwd_pipe_cap_dkdv_##N##_d##D},    \
    {"flash_bwd_pipe_cap_dq_" #N "_d" #D, (void*)&flash_bwd_pipe_cap_dq_##N##_d##D},
#define REG16(N) REG16_D(N, 16) REG16_D(N, 32) REG16_D(N, 64) REG16_D(N, 128) REG16_D(N, 96) REGP_D(N, 256)

// float64 attention forward + backward (the backward from this forward's out / lse).
Ref reference(const Case& c, const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
              const std::vector<double>& dout, double scale, double cap) {
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
          if (!c.vis(i, j)) continue;
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += qi[d] * kj(k, j)[d];
          s[j] = cap > 0 ? cap * std::tanh(acc * scale / cap) : acc * scale;
          m = std::max(m, s[j]);
        }
        if (m == -INFINITY) continue;
        double l = 0;
        for (int j = 0; j < S; ++j) l += c.vis(i, j) ? std::exp(s[j] - m) : 0.0;
        const double lse = m + std::log(l);
        r.lse[((size_t)b * H + h) * T + i] = lse;
        double* oi = &r.out[(((size_t)b * T + i) * H + h) * D];
        for (int j = 0; j < S; ++j) {
          p[j] = c.vis(i, j) ? std::exp(s[j] - lse) : 0.0;
          for (int d = 0; d < D; ++d) oi[d] += p[j] * kj(v, j)[d];
        }
        const double* gi = &dout[(((size_t)b * T + i) * H + h) * D];
        double delta = 0;
        for (int d = 0; d < D; ++d) delta += gi[d] * oi[d];
        r.delta[((size_t)b * H + h) * T + i] = delta;
        double* dqi = &r.dq[(((size_t)b * T + i) * H + h) * D];
        for (int j = 0; j < S; ++j) {
          if (!c.vis(i, j)) continue;
          double dp = 0;
          for (int d = 0; d < D; ++d) dp += gi[d] * kj(v, j)[d];
          // with a soft cap: times its derivative 1 - (s / cap)^2 at the capped logit s
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

namespace {

const std::map<std::string, void*> kTable = {REG(f32) REG(f16) REG(bf16) REG16(f16) REG16(bf16)
    {"flash_fwd_wgmma_f16_d64", (void*)&flash_fwd_wgmma_f16_d64}, {"flash_fwd_wgmma_f16_d128", (void*)&flash_fwd_wgmma_f16_d128},
    {"flash_fwd_wgmma_bf16_d64", (void*)&flash_fwd_wgmma_bf16_d64}, {"flash_fwd_wgmma_bf16_d128", (void*)&flash_fwd_wgmma_bf16_d128},
    {"flash_fwd_wgmma_ws_f16_d64", (void*)&flash_fwd_wgmma_ws_f16_d64}, {"flash_fwd_wgmma_ws_f16_d128", (void*)&flash_fwd_wgmma_ws_f16_d128},
    {"flash_fwd_wgmma_ws_bf16_d64", (void*)&flash_fwd_wgmma_ws_bf16_d64}, {"flash_fwd_wgmma_ws_bf16_d128", (void*)&flash_fwd_wgmma_ws_bf16_d128},
    {"flash_fwd_wgmma_tma_f16_d64", (void*)&flash_fwd_wgmma_tma_f16_d64}, {"flash_fwd_wgmma_tma_f16_d128", (void*)&flash_fwd_wgmma_tma_f16_d128},
    {"flash_fwd_wgmma_tma_bf16_d64", (void*)&flash_fwd_wgmma_tma_bf16_d64}, {"flash_fwd_wgmma_tma_bf16_d128", (void*)&flash_fwd_wgmma_tma_bf16_d128},
    {"flash_fwd_wgmma_tma_wide_f16_d128", (void*)&flash_fwd_wgmma_tma_wide_f16_d128},
    {"flash_fwd_wgmma_tma_wide_bf16_d128", (void*)&flash_fwd_wgmma_tma_wide_bf16_d128},
    {"flash_bwd_wgmma_dkdv_f16_d64", (void*)&flash_bwd_wgmma_dkdv_f16_d64}, {"flash_bwd_wgmma_dkdv_f16_d128", (void*)&flash_bwd_wgmma_dkdv_f16_d128},
    {"flash_bwd_wgmma_dkdv_bf16_d64", (void*)&flash_bwd_wgmma_dkdv_bf16_d64}, {"flash_bwd_wgmma_dkdv_bf16_d128", (void*)&flash_bwd_wgmma_dkdv_bf16_d128},
    {"flash_bwd_wgmma_dq_f16_d64", (void*)&flash_bwd_wgmma_dq_f16_d64}, {"flash_bwd_wgmma_dq_f16_d128", (void*)&flash_bwd_wgmma_dq_f16_d128},
    {"flash_bwd_wgmma_dq_bf16_d64", (void*)&flash_bwd_wgmma_dq_bf16_d64}, {"flash_bwd_wgmma_dq_bf16_d128", (void*)&flash_bwd_wgmma_dq_bf16_d128},
    {"flash_bwd_wgmma_tma_f16_d64", (void*)&flash_bwd_wgmma_tma_f16_d64}, {"flash_bwd_wgmma_tma_f16_d128", (void*)&flash_bwd_wgmma_tma_f16_d128},
    {"flash_bwd_wgmma_tma_bf16_d64", (void*)&flash_bwd_wgmma_tma_bf16_d64}, {"flash_bwd_wgmma_tma_bf16_d128", (void*)&flash_bwd_wgmma_tma_bf16_d128},
    {"flash_bwd_wgmma_ws_f16_d64", (void*)&flash_bwd_wgmma_ws_f16_d64}, {"flash_bwd_wgmma_ws_f16_d128", (void*)&flash_bwd_wgmma_ws_f16_d128},
    {"flash_bwd_wgmma_ws_bf16_d64", (void*)&flash_bwd_wgmma_ws_bf16_d64}, {"flash_bwd_wgmma_ws_bf16_d128", (void*)&flash_bwd_wgmma_ws_bf16_d128}};

void* lookup(const std::string& name) {
  auto it = kTable.find(name);
  if (it == kTable.end()) {
    std::printf("no kernel %s\n", name.c_str());
    std::exit(2);
  }
  return it->second;
}

template <typename TY> using FwdXFn = void (*)(FWDX_P(TY));
template <typename TY> using FwdCFn = void (*)(FWDC_P(TY));
template <typename TY> using FwdTmaFn = void (*)(FWDX_P(TY), CpTmaMap, CpTmaMap, CpTmaMap);
template <typename TY> using DkdvFn = void (*)(float*, float*, BWD_P(TY));
template <typename TY> using DqFn = void (*)(float*, BWD_P(TY));
template <typename TY> using PDkdvFn = void (*)(float*, float*, PIPE_P(TY));
template <typename TY> using PDqFn = void (*)(float*, PIPE_P(TY));
template <typename TY> using PDkdvCFn = void (*)(float*, float*, PIPEC_P(TY));
template <typename TY> using PDqCFn = void (*)(float*, PIPEC_P(TY));

template <typename T> const char* sfx();
template <> const char* sfx<float>() { return "f32"; }
template <> const char* sfx<__half>() { return "f16"; }
template <> const char* sfx<__nv_bfloat16>() { return "bf16"; }

unsigned cdiv(long a, long b) { return (unsigned)((a + b - 1) / b); }

// Wgmma: flash_fwd_sm90.cu forward; backward = pipe prep + flash_bwd_sm90.cu dK/dV and dQ
// (src/flash/bwd_sm90.rs); D 64 / 128 only. WgmmaWs: flash_fwd_sm90_ws.cu forward (warp-specialized,
// src/flash/sm90_ws.rs); backward = pipe prep + flash_bwd_sm90_ws.cu (src/flash/bwd_sm90_ws.rs: one
// kernel, dq zero-filled and added to with atomics). WgmmaTma: the TMA entries of flash_fwd_sm90_ws.cu
// and flash_bwd_sm90_ws.cu, with tensor maps made as src/flash/tma.rs makes them. WgmmaTmaWide: the
// wide-tile TMA forward (flash_fwd_wgmma_tma_wide_*, d 128 only: 176-key tiles, 2 stages, k / v maps
// with 176-row boxes); its backward is WgmmaTma's (not run again here).
enum class Impl { Simple, Mma, Pipe, Wgmma, WgmmaWs, WgmmaTma, WgmmaTmaWide };
const char* impl_name(Impl i) {
  return i == Impl::Simple ? "simple" : i == Impl::Mma ? "mma" : i == Impl::Pipe ? "pipe" : i == Impl::Wgmma ? "wgmma"
       : i == Impl::WgmmaWs ? "wgmma_ws" : i == Impl::WgmmaTma ? "wgmma_tma" : "wgmma_tma_wide";
}

}  // namespace

// The tensor map of a contiguous 16-bit [B, L, Hh, D] tensor as src/flash/tma.rs encodes it: dims
// innermost first (D, Hh, L, B), box 64 x 1 x rows x 1, 128-byte swizzle (check_band.cpp too).
CpTmaMap emu_tma_map(const void* p, int B, int L, int Hh, int D, int rows) {
  CpTmaMap m;
  const uint64_t dims[4] = {(uint64_t)D, (uint64_t)Hh, (uint64_t)L, (uint64_t)B};
  const uint64_t str[3] = {(uint64_t)D * 2, (uint64_t)Hh * D * 2, (uint64_t)L * Hh * D * 2};
  const uint32_t box[4] = {64, 1, (uint32_t)rows, 1}, es[4] = {1, 1, 1, 1};
  if (const char* err = cp_tma::encode(&m, 2, 4, p, dims, str, box, es, 128)) {
    std::printf("emu_tma_map: %s\n", err);
    std::exit(2);
  }
  return m;
}

// The dq map of the TMA backward as src/flash/tma.rs encodes it: f32 [B, T, H, D], box 32 x 1 x 64 x 1,
// 128-byte swizzle (check_band.cpp too).
CpTmaMap emu_tma_map_dq(const float* p, int B, int T, int H, int D) {
  CpTmaMap m;
  const uint64_t dims[4] = {(uint64_t)D, (uint64_t)H, (uint64_t)T, (uint64_t)B};
  const uint64_t str[3] = {(uint64_t)D * 4, (uint64_t)H * D * 4, (uint64_t)T * H * D * 4};
  const uint32_t box[4] = {32, 1, 64, 1}, es[4] = {1, 1, 1, 1};
  if (const char* err = cp_tma::encode(&m, 4, 4, p, dims, str, box, es, 128)) {
    std::printf("emu_tma_map_dq: %s\n", err);
    std::exit(2);
  }
  return m;
}

namespace {

// cap > 0: the logit soft cap (Gemma 2) of the simple / mma-less paths: flash_fwd.cu's simple and
// pipe entries and flash_bwd.cu's kernels (q and k scaled by `amp` so that the logits bend).
template <typename TY> void run_case(const Case& c, const std::vector<Impl>& impls, uint64_t seed, bool accum_checks = false,
                                     float cap = 0.f, double amp = 1.0) {
  const int B = c.B, T = c.T, S = c.S, H = c.H, Hkv = c.Hkv, D = c.D;
  const size_t nq = (size_t)B * T * H * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * H * T;
  const float scale = 1.f / std::sqrt((float)D);
  Buf<TY> q(nq), k(nk), v(nk);
  auto amped = [amp](std::vector<double> x) {
    for (auto& e : x) e *= amp;
    return x;
  };
  const auto qd = fill(q, amped(randn(nq, seed))), kd = fill(k, amped(randn(nk, seed + 1))), vd = fill(v, randn(nk, seed + 2));
  const auto dout_d = randn(nq, seed + 3);
  Buf<float> dout(nq), o32(nq), l32(nl);
  const auto dd = fill(dout, dout_d);
  const Ref ref = reference(c, qd, kd, vd, dd, (double)scale, (double)cap);
  fill(o32, ref.out);
  fill(l32, ref.lse);
  const std::string tag = std::string(sfx<TY>()) + " " + c.tag() + (cap > 0 ? " softcap " + std::to_string(cap).substr(0, 4) : "");
  const std::string dsfx = std::string(sfx<TY>()) + "_d" + std::to_string(D);
  const bool f16 = sizeof(TY) == 2, bf = std::is_same<TY, __nv_bfloat16>::value;

  for (Impl im : impls) {
    const bool wide = im == Impl::WgmmaTmaWide;
    const bool sm90 = im == Impl::Wgmma || im == Impl::WgmmaWs || im == Impl::WgmmaTma || wide;
    if (sm90 && (sizeof(TY) != 2 || (D != 64 && D != 128))) continue;
    if (wide && D != 128) continue;
    // ---- forward
    std::string name = std::string("flash_fwd_") + impl_name(im) + " " + tag;
    if (wanted(name)) {
      Buf<float> out(nq), lse(nl);
      const bool ws = im == Impl::WgmmaWs || im == Impl::WgmmaTma || wide;
      // pipe_config (src/flash.rs, PIPES): BQ 128 over BK 64 + BQ ints; BQ 64 over BK 32 at d 256,
      // the per-row key bounds in the Q rows' padding
      const unsigned pipe_rows = D == 256 ? 64 : 128;
      // (the soft-capped entries, PIPES_CAP: d128 over 32-key tiles too)
      const size_t pipe_bk = D == 256 || (cap > 0 && D == 128) ? 32 : 64;
      unsigned rows = im == Impl::Simple ? 16 : im == Impl::Mma ? 64 : im == Impl::Pipe ? pipe_rows : 128,
               threads = im == Impl::Wgmma ? 256 : ws ? 384 : 128;
      size_t smem = im == Impl::Pipe ? (pipe_rows + 4 * pipe_bk) * (D + 8) * 2 + (D == 256 ? 0 : pipe_rows * 4) : core_smem(0, D);
      if (im == Impl::Wgmma) smem = (size_t)(128 + 4 * 128) * D * 2 + 1024;  // WGMMA_SMEM(D), src/flash/sm90.rs
      const size_t nst = D == 128 ? 3 : 4;  // WS_NST(D)
      if (ws) smem = (128 + 2 * nst * 128) * D * 2 + 1024 + 4 * nst * 8;  // WS_SMEM(D), src/flash/sm90_ws.rs
      if (wide) smem = (128 + 2 * 2 * 176) * 128 * 2 + 1024 + 4 * 2 * 8;  // WS_WIDE_SMEM
      // (a soft cap: the pipelined forward's capped entries, flash_fwd_pipe_cap_*)
      void* fp = lookup(std::string("flash_fwd_") + impl_name(im) + (cap > 0 && im == Impl::Pipe ? "_cap_" : "_") + dsfx);
      auto fn = reinterpret_cast<FwdXFn<TY>>(fp);
      auto fnc = reinterpret_cast<FwdCFn<TY>>(fp);
      // (o, l, o_T, o_row0, o_merge): the plain result, or folded into a state (check_fold)
      auto run = [&](float* o, float* l, int oT, int orow0, int merge) {
        return cp_emu::launch(name.c_str(), dim3(cdiv(T, rows), H, B), dim3(threads), smem, [&] {
          if (im == Impl::WgmmaTma || wide) {
            const int kr = wide ? 176 : 128;  // key-tile rows of the k / v boxes
            reinterpret_cast<FwdTmaFn<TY>>(fn)(q.p, k.p, v.p, o, l, B, T, S, H, Hkv, scale, c.causal, c.qo, c.qs, c.ko, c.ks,
                                               oT, orow0, merge, emu_tma_map(q.p, B, T, H, D, 128),
                                               emu_tma_map(k.p, B, S, Hkv, D, kr), emu_tma_map(v.p, B, S, Hkv, D, kr));
          } else if (sm90) {
            fn(q.p, k.p, v.p, o, l, B, T, S, H, Hkv, scale, c.causal, c.qo, c.qs, c.ko, c.ks, oT, orow0, merge);
          } else {
            fnc(q.p, k.p, v.p, o, l, B, T, S, H, Hkv, scale, cap, c.causal, c.qo, c.qs, c.ko, c.ks, oT, orow0, merge);
          }
        });
      };
      bool ok = run(out.p, lse.p, T, 0, 0);
      check_launch(name, ok);
      const double tol = im == Impl::Simple ? 2e-5 : bf ? 2e-2 : 4e-3;
      if (ok) {
        check(name + " out", max_abs(out.to_f32(), ref.out), tol);
        check(name + " lse", max_abs(lse.to_f32(), ref.lse), im == Impl::Simple ? 2e-5 : 1e-3);
      }
      if (ok && accum_checks) check_fold(name, B, T, H, D, ref.out, ref.lse, tol, seed + 7, run);
    }
    // ---- backward (a soft cap: flash_bwd.cu's kernels and flash_bwd_pipe.cu's capped entries)
    name = std::string("flash_bwd_") + impl_name(im) + " " + tag;
    if (wide || !wanted(name) || (cap > 0 && im != Impl::Simple && im != Impl::Pipe)) continue;
    Buf<float> dq(nq), dk(nk), dv(nk), delta(nl);
    bool ok = true;
    std::function<bool(int)> grads;  // dK/dV then dQ kernels, `accumulate` as given
    const dim3 b128(128);
    if (im == Impl::Simple || im == Impl::Mma) {
      ok = cp_emu::launch("flash_bwd_delta_f32", dim3(cdiv((long)B * T * H, 4)), b128, 0,
                          [&] { flash_bwd_delta_f32(o32.p, dout.p, delta.p, B, T, H, D); });
      const std::string pre = im == Impl::Simple ? "flash_bwd_" : "flash_bwd_mma_";
      auto dkdv = reinterpret_cast<DkdvFn<TY>>(lookup(pre + "dkdv_" + dsfx));
      auto dqf = reinterpret_cast<DqFn<TY>>(lookup(pre + "dq_" + dsfx));
      grads = [&, pre, dkdv, dqf](int acc) {
        return cp_emu::launch((pre + "dkdv").c_str(), dim3(cdiv(S, 32), Hkv, B), dim3(im == Impl::Simple ? 128 : 64), im == Impl::Simple ? core_smem(1, D) : 0, [&] {
                 dkdv(dk.p, dv.p, q.p, k.p, v.p, dout.p, l32.p, delta.p, B, T, S, H, Hkv, scale, cap, c.causal, c.qo, c.qs, c.ko, c.ks, acc);
               }) &&
               cp_emu::launch((pre + "dq").c_str(), dim3(cdiv(T, im == Impl::Simple ? 8 : 64), H, B), dim3(128), im == Impl::Simple ? core_smem(2, D) : 0, [&] {
                 dqf(dq.p, q.p, k.p, v.p, dout.p, l32.p, delta.p, B, T, S, H, Hkv, scale, cap, c.causal, c.qo, c.qs, c.ko, c.ks, acc);
               });
      };
      ok = ok && grads(0);
    } else {
      // PipeCfg::of (src/flash/bwd_pipe.rs); dK/dV grid x = Hkv * D / kv_da; d96 takes d128's tiles
      const bool wide_q = D == 96 || D >= 128;
      const int kv_nw = 8, kv_bq = D == 256 ? 32 : 64, kv_da = D == 256 ? 128 : D, q_nw = wide_q ? 8 : 4, q_mt = wide_q ? 1 : 2,
                q_bn = D == 128 || D == 96 ? 64 : 32;
      const int bn = 16 * kv_nw, bm = 16 * q_mt * q_nw, row = (D + 8) * 2;
      const size_t smem_kv = (size_t)(2 * bn + 4 * kv_bq) * row + 4 * kv_bq * 4, smem_q = (size_t)(2 * bm + 4 * q_bn) * row;
      auto do16p = std::make_shared<Buf<TY>>(nq);
      Buf<TY>& do16 = *do16p;
      using PrepFn = void (*)(const float*, const float*, float*, TY*, int, int, int, int);
      PrepFn prep = bf ? (PrepFn)(void*)&flash_bwd_pipe_prep_bf16 : (PrepFn)(void*)&flash_bwd_pipe_prep_f16;
      ok = cp_emu::launch("flash_bwd_pipe_prep", dim3(cdiv((long)B * T * H, 4)), b128, 0,
                          [&] { prep(o32.p, dout.p, delta.p, do16.p, B, T, H, D); });
      if (ok) {
        std::vector<double> dr(nq);
        for (size_t e = 0; e < nq; ++e) dr[e] = to_d(to_t<TY>(dd[e]));
        check(name + " prep do16", max_abs(do16.to_f32(), dr), 0.0);
      }
      // WGMMA_BWD_* / WGMMA_DQ_* (flash_bwd_sm90.cu), src/flash/bwd_sm90.rs
      const bool wg = im == Impl::Wgmma;
      const std::string pk = cap > 0 ? "flash_bwd_pipe_cap_" : "flash_bwd_pipe_";
      const std::string kvname = wg ? "flash_bwd_wgmma_dkdv" : pk + "dkdv", qname = wg ? "flash_bwd_wgmma_dq" : pk + "dq";
      // (d 256: 203,264 / 202,752 bytes, launched on Hopper only: bwd_pipe::fits)
      const std::string lim = D == 256 ? " [sm_90]" : "";
      auto dkdv = reinterpret_cast<PDkdvFn<TY>>(lookup(kvname + "_" + dsfx));
      auto dqf = reinterpret_cast<PDqFn<TY>>(lookup(qname + "_" + dsfx));
      // (flash_bwd_pipe.cu's entries take the cap last)
      auto dkdvc = reinterpret_cast<PDkdvCFn<TY>>(lookup(kvname + "_" + dsfx));
      auto dqfc = reinterpret_cast<PDqCFn<TY>>(lookup(qname + "_" + dsfx));
      const int kv_bn = wg ? 128 : bn, kv_thr = wg ? 256 : 32 * kv_nw, q_bm = wg ? 128 : bm, q_thr = wg ? 256 : 32 * q_nw;
      const int kv_x = wg ? Hkv : Hkv * (D / kv_da);
      const size_t kv_smem = wg ? (size_t)(2 * 128 + 4 * 64) * D * 2 + 4 * 64 * 4 + 1024 : smem_kv;
      const size_t q_smem = wg ? (size_t)(2 * 128 + 4 * 128) * D * 2 + 1024 : smem_q;
      grads = [&, do16p, dkdv, dqf, dkdvc, dqfc, wg, kvname, qname, lim, kv_x, kv_bn, kv_thr, kv_smem, q_bm, q_thr, q_smem](int acc) {
        const TY* d16 = do16p->p;
        return cp_emu::launch((kvname + lim).c_str(), dim3(kv_x, cdiv(S, kv_bn), B), dim3(kv_thr), kv_smem, [&] {
                 if (wg)
                   dkdv(dk.p, dv.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, c.causal, c.qo, c.qs, c.ko, c.ks, acc);
                 else
                   dkdvc(dk.p, dv.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, c.causal, c.qo, c.qs, c.ko, c.ks, acc, cap);
               }) &&
               cp_emu::launch((qname + lim).c_str(), dim3(H, cdiv(T, q_bm), B), dim3(q_thr), q_smem, [&] {
                 if (wg)
                   dqf(dq.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, c.causal, c.qo, c.qs, c.ko, c.ks, acc);
                 else
                   dqfc(dq.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, c.causal, c.qo, c.qs, c.ko, c.ks, acc, cap);
               });
      };
      if (im == Impl::WgmmaWs || im == Impl::WgmmaTma) {
        // WSB_* (flash_bwd_sm90_ws.cu), src/flash/bwd_sm90_ws.rs: grid (Hkv, ceil(S / 128), B), 384
        // threads, WSB_SMEM(D); dq zero-filled by the launcher (accumulate: added to).
        using WsFn = void (*)(float*, float*, float*, PIPE_P(TY));
        using TmaFn = void (*)(float*, float*, float*, PIPE_P(TY), CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap, CpTmaMap);
        const bool tma = im == Impl::WgmmaTma;
        auto wsf = reinterpret_cast<WsFn>(lookup(std::string(tma ? "flash_bwd_wgmma_tma_" : "flash_bwd_wgmma_ws_") + dsfx));
        const size_t nst = D == 128 ? 3 : 4;
        // WSB_SMEM(D), or WSB_SMEM_TMA(D): two f32 [64][64] dQ buffers more
        const size_t ws_smem = (2 * 128 + 2 * nst * 64) * D * 2 + 2 * 64 * 128 * 2 + 2 * nst * 64 * 4 + 2 * nst * 8 + 1024 +
                               (tma ? 2 * 64 * 64 * 4 : 0);
        grads = [&, do16p, wsf, ws_smem, tma](int acc) {
          if (!acc) std::fill(dq.p, dq.p + nq, 0.f);
          const TY* d16 = do16p->p;
          return cp_emu::launch(tma ? "flash_bwd_wgmma_tma" : "flash_bwd_wgmma_ws", dim3(Hkv, cdiv(S, 128), B), dim3(384), ws_smem, [&] {
            if (tma)
              reinterpret_cast<TmaFn>(wsf)(dq.p, dk.p, dv.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, c.causal,
                                           c.qo, c.qs, c.ko, c.ks, acc, emu_tma_map(q.p, B, T, H, D, 64),
                                           emu_tma_map(d16, B, T, H, D, 64), emu_tma_map(k.p, B, S, Hkv, D, 128),
                                           emu_tma_map(v.p, B, S, Hkv, D, 128), emu_tma_map_dq(dq.p, B, T, H, D));
            else
              wsf(dq.p, dk.p, dv.p, q.p, k.p, v.p, d16, l32.p, delta.p, B, T, S, H, Hkv, scale, c.causal, c.qo, c.qs, c.ko, c.ks, acc);
          });
        };
      }
      ok = ok && grads(0);
    }
    check_launch(name, ok);
    if (!ok) continue;
    check(name + " delta", max_abs(delta.to_f32(), ref.delta), 1e-4 * std::sqrt((double)D));
    const double tol = im == Impl::Simple ? 1e-4 : bf ? 3e-2 : 5e-3;
    (void)f16;
    check(name + " dq", rel_err(dq.to_f32(), ref.dq), tol);
    check(name + " dk", rel_err(dk.to_f32(), ref.dk), tol);
    check(name + " dv", rel_err(dv.to_f32(), ref.dv), tol);
    // accumulate = 1 adds into dq/dk/dv (ring steps): a second run doubles them
    if (!accum_checks) continue;
    const std::string an = name + " accumulate";
    ok = grads(1);
    check_launch(an, ok);
    if (!ok) continue;
    auto twice = [](const std::vector<double>& x) {
      std::vector<double> y(x);
      for (auto& e : y) e *= 2;
      return y;
    };
    check(an + " dq", rel_err(dq.to_f32(), twice(ref.dq)), tol);
    check(an + " dk", rel_err(dk.to_f32(), twice(ref.dk)), tol);
    check(an + " dv", rel_err(dv.to_f32(), twice(ref.dv)), tol);
  }
}

}  // namespace

void run_flash_checks() {
  const std::vector<Impl> all = {Impl::Simple, Impl::Mma, Impl::Pipe, Impl::Wgmma, Impl::WgmmaWs, Impl::WgmmaTma, Impl::WgmmaTmaWide};
  // label, B, T, S, H, Hkv, D, causal, q_off, q_str, k_off, k_str
  const Case full{"full", 1, 40, 40, 2, 2, 64, 0, 0, 1, 0, 1};
  const Case causal{"causal gqa2:1", 1, 70, 70, 2, 1, 32, 1, 0, 1, 0, 1};
  const Case after{"causal q after k (q_off 64)", 1, 48, 64, 1, 1, 64, 1, 64, 1, 0, 1};
  const Case masked{"causal rows fully masked (k_off 20)", 2, 50, 40, 1, 1, 16, 1, 0, 1, 20, 1};
  const Case striped{"striped stride 4", 1, 64, 64, 2, 2, 32, 1, 1, 4, 2, 4};
  const Case ragged{"ragged causal gqa4:2 (q_off 133)", 1, 200, 333, 4, 2, 16, 1, 133, 1, 0, 1};
  const Case ragged_full{"ragged full", 1, 200, 333, 1, 1, 16, 0, 0, 1, 0, 1};
  const Case mqa{"causal mqa8:1", 1, 48, 48, 8, 1, 32, 1, 0, 1, 0, 1};
  const Case d128{"causal multi-tile", 1, 300, 300, 1, 1, 128, 1, 0, 1, 0, 1};
  const Case d128f{"full", 1, 80, 144, 1, 1, 128, 0, 0, 1, 0, 1};
  const Case off30{"causal q_off 30 (warp rows at a tile edge)", 1, 96, 128, 2, 1, 64, 1, 30, 1, 0, 1};
  const Case keys_after{"causal keys past every query (blocks without work)", 1, 40, 300, 2, 2, 32, 1, 0, 1, 0, 1};
  const std::vector<Case> cases = {full, causal, after, masked, striped, ragged, ragged_full, mqa, off30, d128f, d128, keys_after};
  uint64_t seed = 100;
  for (const Case& c : cases) {
    if (c.D <= 64) run_case<float>(c, {Impl::Simple}, seed++, &c == &cases[3]);
    run_case<__nv_bfloat16>(c, all, seed++, &c == &cases[2] || &c == &cases[5]);
    run_case<__half>(c, all, seed++, &c == &cases[3]);
  }
  // head dim 256 (Gemma 3): the CUDA-core kernels, with dynamic shared memory (their arrays
  // exceed the 48 KiB static limit), and the pipelined ones (64-row forward blocks over 32-key
  // tiles; dK/dV blocks of 128 of the 256 columns, grid x = 2 Hkv); two key tiles and a ragged
  // end, GQA, a ring block whose queries come after its keys, and fully masked rows; the
  // accumulate / fold runs on both.
  const Case d256{"causal gqa2:1 multi-tile", 1, 70, 70, 2, 1, 256, 1, 0, 1, 0, 1};
  const Case d256_after{"causal q after k (q_off 40), rows fully masked (k_off 50)", 2, 24, 40, 2, 2, 256, 1, 40, 1, 50, 1};
  const Case d256_full{"full t != s", 1, 17, 45, 1, 1, 256, 0, 0, 1, 0, 1};
  for (const Case* cp : {&d256, &d256_after, &d256_full}) {
    const Case& c = *cp;
    const bool acc = cp != &d256_full;
    run_case<float>(c, {Impl::Simple}, seed++, acc);
    run_case<__nv_bfloat16>(c, {Impl::Simple, Impl::Pipe}, seed++, acc);
    run_case<__half>(c, {Impl::Simple, Impl::Pipe}, seed++, acc);
  }
  // head dim 96 (Phi-3-mini): the CUDA-core kernels (static shared memory) and the pipelined ones
  // (the forward's rows of 12 16-byte chunks copied by 120 of its 128 threads; d128's backward
  // tiles): 2 forward and dQ blocks of 128 rows, 3 key tiles of 64 and 2 dK/dV blocks of 128 keys
  // with a ragged end and GQA; a ring block whose queries come after its keys with fully masked
  // rows; a soft-capped one (the capped entries); accumulate / fold runs.
  const Case d96{"causal gqa2:1 multi-tile", 1, 150, 150, 2, 1, 96, 1, 0, 1, 0, 1};
  const Case d96_after{"causal q after k (q_off 40), rows fully masked (k_off 50)", 2, 24, 40, 2, 2, 96, 1, 40, 1, 50, 1};
  const Case d96_full{"full t != s", 1, 17, 45, 1, 1, 96, 0, 0, 1, 0, 1};
  for (const Case* cp : {&d96, &d96_after, &d96_full}) {
    const bool acc = cp != &d96_full;
    run_case<float>(*cp, {Impl::Simple}, seed++, acc);
    run_case<__nv_bfloat16>(*cp, {Impl::Simple, Impl::Mma, Impl::Pipe}, seed++, acc);
    run_case<__half>(*cp, {Impl::Simple, Impl::Mma, Impl::Pipe}, seed++, acc);
  }
  run_case<__nv_bfloat16>(d96_after, {Impl::Simple, Impl::Pipe}, seed++, true, 5.f, 3.0);
  {  // pipelined d256 over several blocks each way: 3 forward blocks of 64 rows, 2 dK/dV key
     // blocks of 128 (2 column slices each), query tiles of 32, causal GQA 3:1 with a ragged end
    const Case d256_big{"pipe causal gqa3:1 ragged", 1, 150, 200, 3, 1, 256, 1, 50, 1, 0, 1};
    run_case<__nv_bfloat16>(d256_big, {Impl::Pipe}, seed++, true);
  }
  // wgmma (D 64 / 128 only): rows that see no key (lse -inf) with strides, key blocks that no
  // query sees, ragged T / S, GQA 3:1 over several 64-row tiles and 128-key blocks, a diagonal
  // just inside a key tile.
  const Case wg_masked{"wg causal strided, rows fully masked (k_off 20)", 2, 70, 150, 4, 2, 64, 1, 0, 2, 20, 3};
  const Case wg_gqa{"wg full gqa3:1 ragged", 1, 130, 200, 3, 1, 128, 0, 0, 1, 0, 1};
  run_case<__nv_bfloat16>(wg_masked, {Impl::Wgmma, Impl::WgmmaWs, Impl::WgmmaTma}, seed++, true);
  run_case<__half>(wg_gqa, {Impl::Wgmma, Impl::WgmmaWs, Impl::WgmmaTma, Impl::WgmmaTmaWide}, seed++);
  // a warpgroup's first row sees keys [0, 127): the diagonal one key before a 128-key tile edge
  const Case wg_edge{"wg causal q_off 62 (diagonal at a key-tile edge)", 1, 130, 200, 2, 1, 64, 1, 62, 1, 0, 1};
  run_case<__nv_bfloat16>(wg_edge, {Impl::Wgmma, Impl::WgmmaWs, Impl::WgmmaTma}, seed++);
  // Seeded sweep of small shapes and masks: T, S from 1 to 160, offsets, strides 1..4, GQA.
  static char labels[12][64];
  std::mt19937_64 rng(7);
  for (int n = 0; n < 12; ++n) {
    auto u = [&](int lo, int hi) { return lo + (int)(rng() % (uint64_t)(hi - lo + 1)); };
    const int hkv = u(1, 2), g = u(1, 3);
    Case c{labels[n], u(1, 2), u(1, 160), u(1, 160), hkv * g, hkv, n % 2 ? 32 : 16, u(0, 3) != 0,
           u(0, 150), u(1, 4), u(0, 150), u(1, 4)};
    std::snprintf(labels[n], sizeof labels[n], "sweep%d %s q%lld+%lld k%lld+%lld", n, c.causal ? "causal" : "full", c.qo, c.qs,
                  c.ko, c.ks);
    if (n % 2)
      run_case<__half>(c, all, seed++);
    else
      run_case<__nv_bfloat16>(c, all, seed++);
  }
  // warp-specialized forward: enough key tiles per block that its K / V ring (4 stages at d64, 3 at
  // d128) wraps twice (mbarrier phase parities 0, 1, 0), causal and full, ragged S, GQA 2:1.
  const Case ws_ring{"ws causal ring wraps (q_off 1100)", 1, 150, 1300, 2, 1, 64, 1, 1100, 1, 0, 1};
  const Case ws_ring_full{"ws full ring wraps", 1, 100, 1000, 1, 1, 128, 0, 0, 1, 0, 1};
  run_case<__nv_bfloat16>(ws_ring, {Impl::WgmmaWs, Impl::WgmmaTma}, seed++);
  run_case<__half>(ws_ring_full, {Impl::WgmmaWs, Impl::WgmmaTma, Impl::WgmmaTmaWide}, seed++);
  // wide-tile TMA forward (176-key tiles, 2 stages): diagonals one key before / at a 176-key tile
  // edge, a ring that wraps three times (7 tiles), ragged S, GQA 2:1, rows past T, fully masked rows.
  const Case wide_edge{"wide causal q_off 175 (diagonal at a 176-key tile edge)", 1, 200, 420, 2, 1, 128, 1, 175, 1, 0, 1};
  const Case wide_ring{"wide causal ring wraps (q_off 1100)", 1, 70, 1200, 2, 1, 128, 1, 1100, 1, 0, 1};
  const Case wide_masked{"wide causal strided, rows fully masked (k_off 20)", 2, 70, 150, 2, 2, 128, 1, 0, 2, 20, 3};
  run_case<__nv_bfloat16>(wide_edge, {Impl::WgmmaTmaWide}, seed++);
  run_case<__half>(wide_ring, {Impl::WgmmaTmaWide}, seed++);
  run_case<__nv_bfloat16>(wide_masked, {Impl::WgmmaTmaWide}, seed++, true);
  // Logit soft cap (Gemma 2): the CUDA-core forward and backward and the pipelined forward, q and
  // k at 3x the usual spread so that the cap bends most logits; causal GQA over several tiles,
  // rows fully masked, head dims 64 / 128 / 256, fold and accumulate runs.
  const Case cap_causal{"causal gqa2:1 multi-tile", 1, 150, 150, 2, 1, 64, 1, 0, 1, 0, 1};
  const Case cap_masked{"causal rows fully masked (k_off 20)", 2, 50, 40, 1, 1, 128, 1, 0, 1, 20, 1};
  const Case cap_d256{"causal q after k (q_off 40)", 1, 70, 110, 2, 2, 256, 1, 40, 1, 0, 1};
  for (const Case* cp : {&cap_causal, &cap_masked, &cap_d256}) {
    const float cap = cp == &cap_masked ? 2.f : 5.f;
    run_case<float>(*cp, {Impl::Simple}, seed++, true, cap, 3.0);
    run_case<__nv_bfloat16>(*cp, {Impl::Simple, Impl::Pipe}, seed++, true, cap, 3.0);
    run_case<__half>(*cp, {Impl::Simple, Impl::Pipe}, seed++, false, cap, 3.0);
  }
}
