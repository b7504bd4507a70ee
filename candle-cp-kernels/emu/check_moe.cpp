// moe.cu (each token's top K experts) under the emulator vs a plain C++ transcription of its CPU
// reference, candle_cp_ops::moe::top_k_rows (by falling probability in f32's total order, ties
// by the lower index), with the launch configuration of src/moe.rs (one warp per row, 4 rows a
// block): E of 8 (Mixtral), 60, 128 (Qwen3-MoE), 1000 (past 32 per lane); K of 1, 2, 8 and E;
// rows with repeated values (ties), zeros and -0; rows that hold NaN or an infinity are not
// routed and must report their first such expert as E + e in slot 0.
#include "harness.h"

#include <algorithm>
#include <limits>
#include <numeric>

#define MOE_DECL(N, TY) void moe_top_k_##N(const TY*, uint32_t*, int, int, int);
extern "C" {
MOE_DECL(f32, float)
MOE_DECL(f16, __half)
MOE_DECL(bf16, __nv_bfloat16)
}

namespace {

// f32::total_cmp's order as an unsigned key (independent of the kernel's formula: the sign and
// magnitude compared explicitly)
bool total_less(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  ia ^= (int32_t)((uint32_t)(ia >> 31) >> 1);
  ib ^= (int32_t)((uint32_t)(ib >> 31) >> 1);
  return ia < ib;
}

template <typename TY> using TopKFn = void (*)(const TY*, uint32_t*, int, int, int);

template <typename TY> void check_top_k(const char* sfx, TopKFn<TY> k, uint64_t seed) {
  struct Shape {
    int n, e, k;
  };
  for (const Shape sh : {Shape{7, 8, 2}, Shape{5, 60, 8}, Shape{9, 128, 8}, Shape{6, 128, 1}, Shape{3, 1000, 8}, Shape{2, 8, 8}}) {
    const int N = sh.n, E = sh.e, K = sh.k;
    auto x = randn((size_t)N * E, seed + (uint64_t)E * 31 + K);
    // row 1: few distinct values (ties everywhere); row 2: zeros, -0 and one negative
    for (int e = 0; e < E; ++e) x[1 * E + e] = (double)((e * 7) % 3) * 0.25;
    if (N > 2) {
      for (int e = 0; e < E; ++e) x[2 * E + e] = e % 3 == 0 ? 0.0 : (e % 3 == 1 ? -0.0 : 0.5);
      x[2 * E + E / 2] = -1.0;
    }
    // last row: a NaN and (later) an infinity; the row before it (when N > 4): an infinity only
    const bool faults = N > 3;
    if (faults) {
      x[(size_t)(N - 1) * E + E - 1] = std::numeric_limits<double>::quiet_NaN();
      x[(size_t)(N - 1) * E + E / 3] = std::numeric_limits<double>::infinity();
      if (N > 4) x[(size_t)(N - 2) * E + 1] = -std::numeric_limits<double>::infinity();
    }
    Buf<TY> pb((size_t)N * E);
    const auto xr = fill(pb, x);  // the values as the kernel sees them
    std::vector<uint32_t> want((size_t)N * K);
    std::vector<bool> routed(N, true);
    for (int r = 0; r < N; ++r) {
      std::vector<float> row(E);
      for (int e = 0; e < E; ++e) row[e] = (float)xr[(size_t)r * E + e];
      int bad = -1;
      for (int e = 0; e < E && bad < 0; ++e)
        if (!std::isfinite(row[e])) bad = e;
      if (bad >= 0) {
        routed[r] = false;
        want[(size_t)r * K] = (uint32_t)(E + bad);
        continue;
      }
      std::vector<uint32_t> idx(E);
      std::iota(idx.begin(), idx.end(), 0u);
      std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return total_less(row[b], row[a]); });
      std::copy(idx.begin(), idx.begin() + K, want.begin() + (size_t)r * K);
    }
    char name[128];
    std::snprintf(name, sizeof name, "moe_top_k_%s [N %d, E %d] K %d", sfx, N, E, K);
    if (!wanted(name)) continue;
    Buf<uint32_t> out((size_t)N * K);
    bool ok = cp_emu::launch(name, dim3((N + 3) / 4), dim3(128), 0, [&] { k(pb.p, out.p, N, E, K); });
    check_launch(name, ok);
    if (!ok) continue;
    double wrong = 0;
    for (int r = 0; r < N; ++r)
      for (int s = 0; s < (routed[r] ? K : 1); ++s) wrong += out.p[(size_t)r * K + s] != want[(size_t)r * K + s];
    check(name, wrong, 0.0);
  }
}

}  // namespace

void run_moe_checks() {
  check_top_k<float>("f32", moe_top_k_f32, 71);
  check_top_k<__half>("f16", moe_top_k_f16, 72);
  check_top_k<__nv_bfloat16>("bf16", moe_top_k_bf16, 73);
}
