// The probe kernels (kernels/probe.cu, kernels/probe_sm90.cu) under the emulator, launched as
// src/probe.rs does, with the inputs of src/probe_map.rs: every dumped register must hold what the
// documented layouts predict (the emulator implements our reading of the PTX ISA, so all pass
// here; on a GPU the Rust side explains mismatches). The comparison is exact (error = number of
// wrong values). Negative checks: the same dumps against a deliberately corrupted layout (rows
// g <-> g + 8 of the mma / wgmma accumulators, .trans flipped for ldmatrix, zero-fill ignored for
// cp.async) must report mismatches, so a wrong layout cannot pass unnoticed.
#include "harness.h"

#include <functional>

extern "C" {
void probe_mma16816_bf16(const __nv_bfloat16*, const __nv_bfloat16*, float*);
void probe_mma16816_f16(const __half*, const __half*, float*);
void probe_ldsm(unsigned int*);
void probe_cp_async(const unsigned int*, unsigned int*, unsigned int*);
#define PROBE_WG_DECL(N, TY)                                               \
  void probe_wgmma_ss_n64_##N(const TY*, const TY*, float*);               \
  void probe_wgmma_ss_n128_##N(const TY*, const TY*, float*);              \
  void probe_wgmma_rs_n64_##N(const float*, const TY*, float*);            \
  void probe_wgmma_rs_n128_##N(const float*, const TY*, float*);           \
  void probe_wgmma_sstb_n64_##N(const TY*, const TY*, float*);
PROBE_WG_DECL(bf16, __nv_bfloat16)
PROBE_WG_DECL(f16, __half)
}
// kernels/tma.cuh's tensor-map parameter; emu_tma_map (check_flash.cpp): src/flash/tma.rs's maps
struct alignas(64) CpTmaMap {
  unsigned long long opaque[16];
};
CpTmaMap emu_tma_map(const void* p, int B, int L, int Hh, int D, int rows);
extern "C" void probe_tma(unsigned int*, unsigned int*, int, int, int, int, CpTmaMap);
CpTmaMap emu_tma_map_dq(const float* p, int B, int T, int H, int D);
extern "C" void probe_tma_red(int, int, int, int, CpTmaMap);
extern "C" void probe_stsm_ds(unsigned int*);

namespace {

// Reports a positive check (err = wrong values, must be 0) and its negative (the corrupted layout
// must give at least one wrong value: err 1 when it does not).
void report(const std::string& name, long wrong, long wrong_corrupt) {
  check(name, (double)wrong, 0.0);
  check(name + " (negative: corrupted layout detected)", wrong_corrupt > 0 ? 0.0 : 1.0, 0.0);
}

// ---- mma16816: probe_map::mma_inputs / mma_d_coord
template <typename TY> void check_mma(const char* sfx, void (*fn)(const TY*, const TY*, float*)) {
  const std::string name = std::string("probe_mma16816_") + sfx;
  if (!wanted(name)) return;
  Buf<TY> a(3 * 256), b(3 * 128);
  Buf<float> out(3 * 128);
  std::vector<double> A(3 * 256), B(3 * 128);
  for (int p = 0; p < 3; ++p) {
    for (int e = 0; e < 256; ++e) A[p * 256 + e] = p < 2 ? e + 1 : (e / 16 == e % 16);
    for (int e = 0; e < 128; ++e) {
      const int k = e / 8, n = e % 8;
      B[p * 128 + e] = p == 0 ? (k == n) : p == 1 ? (k == n + 8) : e + 1;
    }
  }
  fill(a, A);
  fill(b, B);
  const bool ok = cp_emu::launch(name.c_str(), dim3(3), dim3(32), 0, [&] { fn(a.p, b.p, out.p); });
  check_launch(name, ok);
  if (!ok) return;
  auto wrong = [&](int flip) {
    long w = 0;
    for (int p = 0; p < 3; ++p)
      for (int lane = 0; lane < 32; ++lane)
        for (int r = 0; r < 4; ++r) {
          const int m = (lane / 4 + 8 * (r / 2)) ^ flip, n = 2 * (lane % 4) + r % 2;
          double v = 0;
          for (int k = 0; k < 16; ++k) v += A[p * 256 + 16 * m + k] * B[p * 128 + 8 * k + n];
          w += out.p[(p * 32 + lane) * 4 + r] != v;
        }
    return w;
  };
  report(name, wrong(0), wrong(8));
}

// ---- ldmatrix: probe_map::ldsm_coord
void check_ldsm() {
  const std::string name = "probe_ldsm";
  if (!wanted(name)) return;
  Buf<unsigned int> out(4 * 128);
  const bool ok = cp_emu::launch(name.c_str(), dim3(1), dim3(32), 768, [&] { probe_ldsm(out.p); });
  check_launch(name, ok);
  if (!ok) return;
  const char* vn[4] = {"x4 pipe_off_a", "x4.trans pipe_off_a", "x4 pipe_off_b", "x4.trans pipe_off_b"};
  for (int v = 0; v < 4; ++v) {
    auto wrong = [&](bool flip) {
      long w = 0;
      const bool trans = (v & 1) != flip, off_b = v >= 2;
      for (int lane = 0; lane < 32; ++lane)
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h) {
            const int r0 = off_b ? 8 * (i >> 1) : 8 * (i & 1), c0 = off_b ? 8 * (i & 1) : 8 * (i >> 1);
            const int x = lane / 4, y = 2 * (lane % 4) + h;
            const int r = trans ? r0 + y : r0 + x, c = trans ? c0 + x : c0 + y;
            w += ((out.p[(v * 32 + lane) * 4 + i] >> (16 * h)) & 0xFFFFu) != (unsigned)((r << 8) | c);
          }
      return w;
    };
    report(name + " " + vn[v], wrong(false), wrong(true));
  }
}

// ---- cp.async: probe_map::cp_async_src / cp_async_checks
void check_cp_async() {
  const std::string name = "probe_cp_async";
  if (!wanted(name)) return;
  Buf<unsigned int> src(512), out(512), early(64);
  for (unsigned e = 0; e < 512; ++e) src.p[e] = 0xC0DE0000u | ((e / 4) << 4) | (e % 4);
  const bool ok = cp_emu::launch(name.c_str(), dim3(1), dim3(64), 2048, [&] { probe_cp_async(src.p, out.p, early.p); });
  check_launch(name, ok);
  if (!ok) return;
  auto wrong = [&](bool ignore_zfill) {
    long w = 0;
    for (int j = 0; j < 128; ++j) {
      const int i = j % 64;
      const bool valid = ignore_zfill || (j < 64 ? i % 4 != 3 : i % 5 != 0);
      for (int x = 0; x < 4; ++x) w += out.p[j * 4 + x] != (valid ? src.p[j * 4 + x] : 0u);
    }
    for (int i = 0; i < 64; ++i) w += early.p[i] != 1u;
    return w;
  };
  report(name, wrong(false), wrong(true));
}

// ---- wgmma: probe_map::wg_a / wg_b / wg_inputs / wg_acc_coord / wg_check
double wg_a(int p, int m, int k) { return k % 16 != m % 16 ? 0 : p == 0 ? m + 1 : p == 2 ? k / 16 + 1 : 1; }
double wg_b(int p, int k, int n) { return p == 1 ? n + 1 : p == 3 ? k + 1 : 1; }

template <typename TY> void check_wgmma(const char* form, int N, const char* sfx, const std::function<void(const TY*, const float*, const TY*, float*)>& fn) {
  const std::string name = std::string("probe_wgmma_") + form + "_n" + std::to_string(N) + "_" + sfx;
  if (!wanted(name)) return;
  const bool kmajor_b = std::string(form) == "ss";
  const int P = 4, M = 128, K = 128, KS = 8, NTH = 256;
  Buf<TY> a16(P * M * K), b(P * K * N);
  Buf<float> a32(P * M * K), out((size_t)P * KS * NTH * N / 2);
  std::vector<double> A(P * M * K), B(P * K * N);
  for (int p = 0; p < P; ++p) {
    for (int e = 0; e < M * K; ++e) A[p * M * K + e] = wg_a(p, e / K, e % K);
    for (int e = 0; e < K * N; ++e) B[p * K * N + e] = kmajor_b ? wg_b(p, e % K, e / K) : wg_b(p, e / N, e % N);
  }
  fill(a16, A);
  fill(a32, A);
  fill(b, B);
  const size_t smem = (size_t)(M + N) * K * 2 + 1024;  // PROBE_WG_SMEM(N)
  const bool ok = cp_emu::launch(name.c_str(), dim3(P), dim3(NTH), smem, [&] { fn(a16.p, a32.p, b.p, out.p); });
  check_launch(name, ok);
  if (!ok) return;
  auto wrong = [&](int flip) {
    long w = 0;
    for (int p = 0; p < P; ++p)
      for (int kk = 0; kk < KS; ++kk)
        for (int tid = 0; tid < NTH; ++tid)
          for (int reg = 0; reg < N / 2; ++reg) {
            const int wg = tid / 128, wr = (tid / 32) % 4, g = (tid % 32) / 4, t = tid % 4, i = reg / 4, e = reg % 4;
            const int m = (64 * wg + 16 * wr + g + 8 * (e / 2)) ^ flip, n = 8 * i + 2 * t + e % 2;
            const double v = p == 0 ? m + 1 : p == 1 ? n + 1 : p == 2 ? kk + 1 : 16 * kk + m % 16 + 1;
            w += out.p[(((size_t)p * KS + kk) * NTH + tid) * (N / 2) + reg] != v;
          }
    return w;
  };
  report(name, wrong(0), wrong(8));
}

template <typename TY> void check_wgmma_all(const char* sfx) {
  using F = std::function<void(const TY*, const float*, const TY*, float*)>;
  const bool bf = std::is_same<TY, __nv_bfloat16>::value;
  // the entry points of probe_sm90.cu as (a16, a32, b, out) calls
#define PROBE_WG_CALLS(S)                                                                                       \
  check_wgmma<TY>("ss", 64, sfx, F([](const TY* a, const float*, const TY* b, float* o) { probe_wgmma_ss_n64_##S(a, b, o); }));    \
  check_wgmma<TY>("ss", 128, sfx, F([](const TY* a, const float*, const TY* b, float* o) { probe_wgmma_ss_n128_##S(a, b, o); }));  \
  check_wgmma<TY>("rs", 64, sfx, F([](const TY*, const float* a, const TY* b, float* o) { probe_wgmma_rs_n64_##S(a, b, o); }));    \
  check_wgmma<TY>("rs", 128, sfx, F([](const TY*, const float* a, const TY* b, float* o) { probe_wgmma_rs_n128_##S(a, b, o); }));  \
  check_wgmma<TY>("sstb", 64, sfx, F([](const TY* a, const float*, const TY* b, float* o) { probe_wgmma_sstb_n64_##S(a, b, o); }));
  if constexpr (std::is_same<TY, __nv_bfloat16>::value) {
    PROBE_WG_CALLS(bf16)
  } else {
    PROBE_WG_CALLS(f16)
  }
#undef PROBE_WG_CALLS
  (void)bf;
}

// ---- TMA: probe_map::tma_src / TMA_COORDS / tma_expected / tma_check
void check_tma() {
  const std::string name = "probe_tma";
  if (!wanted(name)) return;
  const int B = 2, L = 120, Hh = 2, D = 128, c0 = 64, c1 = 1, c2 = 20, c3 = 1;  // TMA_DIMS, TMA_COORDS
  Buf<uint16_t> src((size_t)B * L * Hh * D);
  for (int b = 0; b < B; ++b)
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < Hh; ++h)
        for (int d = 0; d < D; ++d) src.p[((b * L + l) * Hh + h) * D + d] = (uint16_t)(b << 15 | h << 14 | l << 7 | d);
  Buf<unsigned int> out(4096), done(128);
  const CpTmaMap map = emu_tma_map(src.p, B, L, Hh, D, 128);
  const bool ok = cp_emu::launch(name.c_str(), dim3(1), dim3(128), 64 * 2 * 128 + 1024 + 8,
                                 [&] { probe_tma(out.p, done.p, c0, c1, c2, c3, map); });
  check_launch(name, ok);
  if (!ok) return;
  auto wrong = [&](int swizzle_mask) {
    long w = 0;
    for (int r = 0; r < 128; ++r)
      for (int j = 0; j < 64; ++j) {
        const int c = (j / 8) ^ (r & swizzle_mask), l = c2 + r, d = c0 + 8 * c + j % 8;
        const unsigned want = l < L ? (unsigned)src.p[((c3 * L + l) * Hh + c1) * D + d] : 0u;
        const unsigned word = out.p[(r * 64 + j) / 2], got = j % 2 ? word >> 16 : word & 0xFFFFu;
        w += got != want;
      }
    for (int i = 0; i < 128; ++i) w += done.p[i] != 1u;
    return w;
  };
  report(name, wrong(7), wrong(0));
}

// ---- TMA reduction: probe_map::tma_red_init / TMA_RED_COORDS / tma_red_check
void check_tma_red() {
  const std::string name = "probe_tma_red";
  if (!wanted(name)) return;
  const int L = 40, Hh = 2, D = 64, c0 = 0, c1 = 1, c2 = 0, c3 = 0;  // TMA_RED_DIMS, TMA_RED_COORDS
  Buf<float> dq((size_t)L * Hh * D);
  auto init = [&](int l, int h, int d) { return (float)(10000 + 4096 * h + 64 * l + d); };
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < Hh; ++h)
      for (int d = 0; d < D; ++d) dq.p[(l * Hh + h) * D + d] = init(l, h, d);
  const CpTmaMap map = emu_tma_map_dq(dq.p, 1, L, Hh, D);
  const bool ok = cp_emu::launch(name.c_str(), dim3(1), dim3(128), 2 * 64 * 32 * 4 + 1024,
                                 [&] { probe_tma_red(c0, c1, c2, c3, map); });
  check_launch(name, ok);
  if (!ok) return;
  // read with a swizzle mask (7: the map's 128 bytes; 0: none), stored with 7: what lands at (l, d)
  auto wrong = [&](int mask) {
    long w = 0;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < Hh; ++h)
        for (int d = 0; d < D; ++d) {
          const int x = d / 32, c = d % 32, stored = ((c / 4) ^ (l & mask)) ^ (l & 7);
          const float add = h == c1 ? (float)(1 + 32 * x + 4 * stored + c % 4 + 64 * l) : 0.f;
          w += dq.p[(l * Hh + h) * D + d] != init(l, h, d) + add;
        }
    return w;
  };
  report(name, wrong(7), wrong(0));
}

// ---- stmatrix dS store: probe_map::stsm_frag / stsm_expected / stsm_check
void check_stsm() {
  const std::string name = "probe_stsm_ds";
  if (!wanted(name)) return;
  Buf<unsigned int> out(2 * 64 * 128 / 4);
  const bool ok = cp_emu::launch(name.c_str(), dim3(1), dim3(256), 2 * 64 * 128 + 1024, [&] { probe_stsm_ds(out.p); });
  check_launch(name, ok);
  if (!ok) return;
  // byte w * 8192 + q * 128 + 16 c + 2 j holds 0x8000 | q << 8 | key, key = 64 w + 8 ((c ^ q) % 8) + j
  // (swz = 0: the corrupted layout without the swizzle's XOR)
  auto wrong = [&](int swz) {
    long n = 0;
    for (int e = 0; e < 2 * 64 * 64; ++e) {
      const int w = e / 4096, q = (e / 64) % 64, c = (e / 8) % 8, j = e % 8;
      const unsigned key = (unsigned)(64 * w + 8 * ((c ^ (swz ? q : 0)) % 8) + j);
      const unsigned v = (out.p[e / 2] >> (16 * (e % 2))) & 0xFFFFu;
      n += v != (0x8000u | ((unsigned)q << 8) | key);
    }
    return n;
  };
  report(name, wrong(1), wrong(0));
}

}  // namespace

void run_probe_checks() {
  check_mma<__nv_bfloat16>("bf16", probe_mma16816_bf16);
  check_mma<__half>("f16", probe_mma16816_f16);
  check_ldsm();
  check_cp_async();
  check_tma();
  check_tma_red();
  check_stsm();
  check_wgmma_all<__nv_bfloat16>("bf16");
  check_wgmma_all<__half>("f16");
}
