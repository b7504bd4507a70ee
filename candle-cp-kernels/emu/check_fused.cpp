// The fused backward with atomic dQ (kernels/flash_bwd_fused.cu, FwdImpl::AtomicDq) under the
// emulator vs a float64 reference: flash_bwd_pipe_prep_* (delta, 16-bit dO), then
// flash_bwd_fused_*, launched as src/flash/bwd_fused.rs does (dq zero-filled; grid
// (Hkv, ceil(S / 128), B), 256 threads); the same cases for the wgmma atomic-dQ kernel
// (flash_bwd_sm90.cu) and its warp-specialized twin (flash_bwd_sm90_ws.cu, 384 threads, plus cases
// whose Q / dO ring wraps). Also the accumulate flag: dq/dk/dv start from known
// values and must end at those values plus the gradients.
#include <random>

#include "harness.h"

#define FUSED_P(TY) float*, float*, float*, const TY*, const TY*, const TY*, const TY*, const float*, const float*, \
    int, int, int, int, int, float, int, long long, long long, long long, long long, int
extern "C" {
void flash_bwd_pipe_prep_f16(const float*, const float*, float*, __half*, int, int, int, int);
void flash_bwd_pipe_prep_bf16(const float*, const float*, float*, __nv_bfloat16*, int, int, int, int);
#define FUSED_DECL(N, TY) \
  void flash_bwd_fused_##N##_d16(FUSED_P(TY)); void flash_bwd_fused_##N##_d32(FUSED_P(TY)); \
  void flash_bwd_fused_##N##_d64(FUSED_P(TY)); void flash_bwd_fused_##N##_d128(FUSED_P(TY));
FUSED_DECL(f16, __half)
FUSED_DECL(bf16, __nv_bfloat16)
// kernels/flash_bwd_sm90.cu, FwdImpl::WgmmaAtomic (src/flash/bwd_sm90.rs): same parameters.
void flash_bwd_wgmma_atomic_f16_d64(FUSED_P(__half));
void flash_bwd_wgmma_atomic_f16_d128(FUSED_P(__half));
void flash_bwd_wgmma_atomic_bf16_d64(FUSED_P(__nv_bfloat16));
void flash_bwd_wgmma_atomic_bf16_d128(FUSED_P(__nv_bfloat16));
// kernels/flash_bwd_sm90_ws.cu, FwdImpl::WgmmaWs backward (src/flash/bwd_sm90_ws.rs): same parameters.
void flash_bwd_wgmma_ws_f16_d64(FUSED_P(__half));
void flash_bwd_wgmma_ws_f16_d128(FUSED_P(__half));
void flash_bwd_wgmma_ws_bf16_d64(FUSED_P(__nv_bfloat16));
void flash_bwd_wgmma_ws_bf16_d128(FUSED_P(__nv_bfloat16));
}

namespace {

template <typename TY> using FusedFn = void (*)(FUSED_P(TY));

// Which kernel: flash_bwd_fused_*, flash_bwd_wgmma_atomic_* or flash_bwd_wgmma_ws_* (D 64 / 128).
enum class Kind { Fused, WgAtomic, WgWs };

template <typename TY> FusedFn<TY> fused_fn(int d, Kind kind) {
  const bool bf = std::is_same<TY, __nv_bfloat16>::value;
  void* f = nullptr;
  if (kind == Kind::WgWs) {
    f = d == 64 ? (bf ? (void*)&flash_bwd_wgmma_ws_bf16_d64 : (void*)&flash_bwd_wgmma_ws_f16_d64)
                : (bf ? (void*)&flash_bwd_wgmma_ws_bf16_d128 : (void*)&flash_bwd_wgmma_ws_f16_d128);
    return reinterpret_cast<FusedFn<TY>>(f);
  }
  if (kind == Kind::WgAtomic) {
    f = d == 64 ? (bf ? (void*)&flash_bwd_wgmma_atomic_bf16_d64 : (void*)&flash_bwd_wgmma_atomic_f16_d64)
                : (bf ? (void*)&flash_bwd_wgmma_atomic_bf16_d128 : (void*)&flash_bwd_wgmma_atomic_f16_d128);
    return reinterpret_cast<FusedFn<TY>>(f);
  }
  switch (d) {
    case 16: f = bf ? (void*)&flash_bwd_fused_bf16_d16 : (void*)&flash_bwd_fused_f16_d16; break;
    case 32: f = bf ? (void*)&flash_bwd_fused_bf16_d32 : (void*)&flash_bwd_fused_f16_d32; break;
    case 64: f = bf ? (void*)&flash_bwd_fused_bf16_d64 : (void*)&flash_bwd_fused_f16_d64; break;
    default: f = bf ? (void*)&flash_bwd_fused_bf16_d128 : (void*)&flash_bwd_fused_f16_d128; break;
  }
  return reinterpret_cast<FusedFn<TY>>(f);
}

struct FCase {
  const char* label;
  int B, T, S, H, Hkv, D;
  int causal;
  long long qo, qs, ko, ks;
  bool accumulate;
  double shift;  // q += shift, k -= shift: every score strongly negative, lse << 0
  // The attention problem alone, for the shared float64 `reference`.
  Case attn() const { return Case{label, B, T, S, H, Hkv, D, causal, qo, qs, ko, ks}; }
};

unsigned cdiv(long a, long b) { return (unsigned)((a + b - 1) / b); }

template <typename TY> void run_fused(const FCase& c, uint64_t seed, Kind kind = Kind::Fused) {
  const int B = c.B, T = c.T, S = c.S, H = c.H, Hkv = c.Hkv, D = c.D;
  const bool bf = std::is_same<TY, __nv_bfloat16>::value, wg = kind == Kind::WgAtomic, ws = kind == Kind::WgWs;
  const char* kname = ws ? "flash_bwd_wgmma_ws" : wg ? "flash_bwd_wgmma_atomic" : "flash_bwd_fused";
  char tagc[200];
  std::snprintf(tagc, sizeof tagc, "%s %s %s d%d [b%d t%d s%d h%d kv%d]%s", kname, bf ? "bf16" : "f16", c.label, D, B, T,
                S, H, Hkv, c.accumulate ? " accumulate" : "");
  const std::string name = tagc;
  if (!wanted(name)) return;
  const size_t nq = (size_t)B * T * H * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * H * T;
  const float scale = 1.f / std::sqrt((float)D);
  Buf<TY> q(nq), k(nk), v(nk), do16(nq);
  auto qr = randn(nq, seed), kr = randn(nk, seed + 1);
  for (auto& x : qr) x += c.shift;
  for (auto& x : kr) x -= c.shift;
  const auto qd = fill(q, qr), kd = fill(k, kr), vd = fill(v, randn(nk, seed + 2));
  Buf<float> dout(nq), o32(nq), l32(nl), delta(nl), dq(nq), dk(nk), dv(nk);
  const auto dd = fill(dout, randn(nq, seed + 3));
  Ref ref = reference(c.attn(), qd, kd, vd, dd, (double)scale, 0.0);
  fill(o32, ref.out);
  fill(l32, ref.lse);
  // Initial outputs: zeros for dq (the launcher's zero fill); with `accumulate`, known values
  // that the kernel must add to (dk/dv otherwise start as NaN poison and must be overwritten).
  std::vector<double> dq0(nq, 0.0), dk0(nk), dv0(nk);
  if (c.accumulate) {
    dq0 = randn(nq, seed + 4);
    dk0 = randn(nk, seed + 5);
    dv0 = randn(nk, seed + 6);
    fill(dk, dk0);
    fill(dv, dv0);
    for (size_t e = 0; e < nk; ++e) ref.dk[e] += dk0[e], ref.dv[e] += dv0[e];
  }
  fill(dq, dq0);
  for (size_t e = 0; e < nq; ++e) ref.dq[e] += dq0[e];

  using PrepFn = void (*)(const float*, const float*, float*, TY*, int, int, int, int);
  PrepFn prep = bf ? (PrepFn)(void*)&flash_bwd_pipe_prep_bf16 : (PrepFn)(void*)&flash_bwd_pipe_prep_f16;
  bool ok = cp_emu::launch("flash_bwd_pipe_prep", dim3(cdiv((long)B * T * H, 4)), dim3(128), 0,
                           [&] { prep(o32.p, dout.p, delta.p, do16.p, B, T, H, D); });
  // FusedCfg (kernels/flash_bwd_fused.cu, src/flash/bwd_fused.rs): 8 warps x 16 keys, 64-row query tiles.
  const int bn = 128, bq = 64;
  size_t smem = (size_t)(2 * bn + 4 * bq) * (D + 8) * 2 + (size_t)bn * (bq + 8) * 2 + 4 * bq * 4;
  // WGMMA_BWD_SMEM_ATOMIC(D) (flash_bwd_sm90.cu, src/flash/bwd_sm90.rs): 128 keys, 64-row tiles.
  if (wg) smem = (size_t)(2 * bn + 4 * bq) * D * 2 + 4 * bq * 4 + 1024 + (size_t)bq * bn * 2;
  // WSB_SMEM(D) (flash_bwd_sm90_ws.cu, src/flash/bwd_sm90_ws.rs): K, V, NST stages of Q and dO, two
  // dS buffers, lse2 / delta [NST][64] f32, 2 NST mbarriers, 1024 alignment slack; 384 threads.
  const size_t nst = D == 128 ? 3 : 4;
  if (ws) smem = (2 * bn + 2 * nst * bq) * D * 2 + 2 * (size_t)bq * bn * 2 + 2 * nst * bq * 4 + 2 * nst * 8 + 1024;
  auto fn = fused_fn<TY>(D, kind);
  ok = ok && cp_emu::launch(kname, dim3(Hkv, cdiv(S, bn), B), dim3(ws ? 384 : 256), smem, [&] {
    fn(dq.p, dk.p, dv.p, q.p, k.p, v.p, do16.p, l32.p, delta.p, B, T, S, H, Hkv, scale, c.causal, c.qo, c.qs, c.ko, c.ks,
       c.accumulate ? 1 : 0);
  });
  check_launch(name, ok);
  if (!ok) return;
  const double tol = bf ? 3e-2 : 5e-3;
  check(name + " dq", rel_err(dq.to_f32(), ref.dq), tol);
  check(name + " dk", rel_err(dk.to_f32(), ref.dk), tol);
  check(name + " dv", rel_err(dv.to_f32(), ref.dv), tol);
}

}  // namespace

void run_fused_checks() {
  // label, B, T, S, H, Hkv, D, causal, q_off, q_str, k_off, k_str, accumulate
  const std::vector<FCase> cases = {
      {"full", 1, 40, 40, 2, 2, 64, 0, 0, 1, 0, 1, false},
      {"causal gqa2:1", 1, 70, 70, 2, 1, 32, 1, 0, 1, 0, 1, false},
      {"causal q after k (q_off 64)", 1, 48, 64, 1, 1, 64, 1, 64, 1, 0, 1, false},
      {"causal rows fully masked (k_off 20)", 2, 50, 40, 1, 1, 16, 1, 0, 1, 20, 1, false},
      {"striped stride 4", 1, 64, 64, 2, 2, 32, 1, 1, 4, 2, 4, false},
      {"ragged causal gqa4:2 (q_off 133)", 1, 200, 333, 4, 2, 16, 1, 133, 1, 0, 1, false},
      {"ragged full", 1, 150, 300, 1, 1, 16, 0, 0, 1, 0, 1, false},
      {"causal mqa4:1", 1, 48, 48, 4, 1, 32, 1, 0, 1, 0, 1, false},
      {"causal q_off 30", 1, 96, 160, 2, 1, 64, 1, 30, 1, 0, 1, false},
      {"full", 1, 80, 144, 1, 1, 128, 0, 0, 1, 0, 1, false},
      {"causal multi-tile", 1, 300, 300, 1, 1, 128, 1, 0, 1, 0, 1, false},
      {"causal gqa2:1", 1, 70, 150, 2, 1, 64, 1, 80, 1, 0, 1, true},
      {"full", 2, 33, 140, 2, 2, 128, 0, 0, 1, 0, 1, true},
      // lse ~ -100: exp(-lse) of a zero-filled key past S overflows f32 (must be masked, not 0 * inf)
      {"ragged full, scores ~ -100", 1, 40, 100, 1, 1, 16, 0, 0, 1, 0, 1, false, 5.0},
  };
  uint64_t seed = 900;
  for (const FCase& c : cases) {
    run_fused<__nv_bfloat16>(c, seed++);
    run_fused<__half>(c, seed++);
  }
  // The wgmma atomic-dQ variant: D = 64 / 128 cases, incl. rows with no key, a key block no query
  // sees, ragged S with scores ~ -100 (keys past S must be masked), GQA, accumulate.
  const std::vector<FCase> wcases = {
      {"full", 1, 40, 40, 2, 2, 64, 0, 0, 1, 0, 1, false},
      {"causal q_off 30", 1, 96, 160, 2, 1, 64, 1, 30, 1, 0, 1, false},
      {"causal strided, rows fully masked", 2, 70, 150, 4, 2, 64, 1, 0, 2, 20, 3, true},
      {"causal multi-tile", 1, 300, 300, 1, 1, 128, 1, 0, 1, 0, 1, false},
      {"full gqa3:1", 2, 33, 140, 3, 1, 128, 0, 0, 1, 0, 1, true},
      {"ragged full, scores ~ -100", 1, 40, 100, 1, 1, 64, 0, 0, 1, 0, 1, false, 5.0},
  };
  for (const FCase& c : wcases) {
    run_fused<__nv_bfloat16>(c, seed, Kind::WgAtomic);
    run_fused<__nv_bfloat16>(c, seed++, Kind::WgWs);
    run_fused<__half>(c, seed, Kind::WgAtomic);
    run_fused<__half>(c, seed++, Kind::WgWs);
  }
  // The warp-specialized variant: enough query tiles per key block that its Q / dO ring (4 stages
  // at d64, 3 at d128) wraps several times (mbarrier phase parities 0, 1, 0, ...) and the dS
  // buffers alternate, GQA across the wrap, a block whose keys no query sees, ragged T / S.
  const std::vector<FCase> ws_cases = {
      {"ws ring wraps, causal gqa2:1", 1, 520, 200, 2, 1, 64, 1, 0, 1, 0, 1, false},
      {"ws ring wraps, full gqa3:1", 1, 330, 140, 3, 1, 128, 0, 0, 1, 0, 1, true},
      {"ws ring wraps, causal strided k_off 300", 2, 450, 260, 2, 2, 128, 1, 0, 2, 300, 3, false},
  };
  for (const FCase& c : ws_cases) {
    run_fused<__nv_bfloat16>(c, seed++, Kind::WgWs);
    run_fused<__half>(c, seed++, Kind::WgWs);
  }
  // Seeded sweep of small shapes and masks: T, S from 1 to 160, offsets, strides 1..4, GQA.
  static char labels[8][64];
  std::mt19937_64 rng(11);
  for (int n = 0; n < 8; ++n) {
    auto u = [&](int lo, int hi) { return lo + (int)(rng() % (uint64_t)(hi - lo + 1)); };
    const int hkv = u(1, 2), g = u(1, 3);
    FCase c{labels[n], u(1, 2), u(1, 160), u(1, 160), hkv * g, hkv, n % 2 ? 32 : 16, u(0, 3) != 0,
            u(0, 150), u(1, 4), u(0, 150), u(1, 4), n % 4 == 3, 0.0};
    std::snprintf(labels[n], sizeof labels[n], "sweep%d %s q%lld+%lld k%lld+%lld", n, c.causal ? "causal" : "full", c.qo,
                  c.qs, c.ko, c.ks);
    if (n % 2)
      run_fused<__half>(c, seed++);
    else
      run_fused<__nv_bfloat16>(c, seed++);
  }
}
