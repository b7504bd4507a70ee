// grouped_gemm.cu (a mixture of experts' grouped products: forward with and without the experts'
// biases, dx, dW) under the emulator vs a float64 reference of the same sums over the rounded
// inputs, with the launch configuration of src/grouped_gemm.rs (the tile list of up to 64 rows per
// expert, 64 columns a block, 128 threads; tn: one grid layer per expert). Shapes: an expert past
// one row tile (70 rows), an expert without rows (its dW must be zeros), a small one; in and out
// that end inside a k step and a column tile, with 16-byte loads (vec, dims multiples of the
// vector) and element by element (odd dims; and vec = 0 on the aligned shape too); a bias on
// every column and on a column slice (a TP rank's).
#include "harness.h"

#include <algorithm>

#define GG_DECL(N, TY)                                                                                           \
  void grouped_gemm_nt_##N(const TY*, const TY*, const TY*, TY*, const unsigned*, const unsigned*, int, int, int, int, \
                           int);                                                                                 \
  void grouped_gemm_nn_##N(const TY*, const TY*, TY*, const unsigned*, const unsigned*, int, int, int);          \
  void grouped_gemm_tn_##N(const TY*, const TY*, TY*, const unsigned*, int, int, int);
extern "C" {
GG_DECL(f32, float)
GG_DECL(f16, __half)
GG_DECL(bf16, __nv_bfloat16)
}

namespace {

template <typename TY> struct GgFns {
  void (*nt)(const TY*, const TY*, const TY*, TY*, const unsigned*, const unsigned*, int, int, int, int, int);
  void (*nn)(const TY*, const TY*, TY*, const unsigned*, const unsigned*, int, int, int);
  void (*tn)(const TY*, const TY*, TY*, const unsigned*, int, int, int);
};

// max |a - b| / max(max |b|, 1e-30) over a buffer read as f32
template <typename TY> double rel(const Buf<TY>& a, const std::vector<double>& b) { return rel_err(a.to_f32(), b); }

template <typename TY> void check_grouped(const char* sfx, GgFns<TY> f, double tol, uint64_t seed) {
  struct Shape {
    int in, out;
    std::vector<unsigned> counts;
  };
  const Shape shapes[] = {{40, 72, {70, 0, 5}}, {13, 10, {3, 66, 0, 1}}};
  for (const Shape& sh : shapes) {
    const int E = (int)sh.counts.size(), I = sh.in, O = sh.out;
    std::vector<unsigned> offs(E + 1, 0);
    for (int e = 0; e < E; ++e) offs[e + 1] = offs[e] + sh.counts[e];
    const int M = (int)offs[E];
    // the tile list of src/grouped_gemm.rs: (expert, first row), 64 rows at most
    std::vector<unsigned> tiles;
    for (int e = 0; e < E; ++e)
      for (unsigned r = offs[e]; r < offs[e + 1]; r += 64) tiles.push_back((unsigned)e), tiles.push_back(r);
    const unsigned nt = (unsigned)tiles.size() / 2;
    Buf<unsigned> ob(offs.size()), tb(tiles.size());
    std::copy(offs.begin(), offs.end(), ob.p);
    std::copy(tiles.begin(), tiles.end(), tb.p);
    Buf<TY> xb((size_t)M * I), wb((size_t)E * O * I), dyb((size_t)M * O), bb((size_t)E * O);
    const auto x = fill(xb, randn((size_t)M * I, seed + 1));
    const auto w = fill(wb, randn((size_t)E * O * I, seed + 2));
    const auto dy = fill(dyb, randn((size_t)M * O, seed + 3));
    const auto bias = fill(bb, randn((size_t)E * O, seed + 4));
    auto expert = [&](int r) { return (int)(std::upper_bound(offs.begin(), offs.end(), (unsigned)r) - offs.begin()) - 1; };
    constexpr int VE = 16 / sizeof(TY);
    const bool can_vec = I % VE == 0 && O % VE == 0;
    for (int vec = can_vec ? 1 : 0; vec >= 0; --vec) {
      char tag[96];
      std::snprintf(tag, sizeof tag, "%s [M %d, in %d, out %d, E %d]%s", sfx, M, I, O, E, vec ? " vec" : "");
      // forward: no bias, a bias on every column, a bias on columns 3 .. 8
      for (int bias_case = 0; bias_case < 3; ++bias_case) {
        const int col0 = bias_case == 2 ? 3 : 0, nb = bias_case == 0 ? 0 : (bias_case == 1 ? O : std::min(5, O - 3));
        std::vector<double> want((size_t)M * O);
        for (int r = 0; r < M; ++r)
          for (int o = 0; o < O; ++o) {
            const int e = expert(r);
            double s = 0;
            for (int i = 0; i < I; ++i) s += x[(size_t)r * I + i] * w[((size_t)e * O + o) * I + i];
            if (o >= col0 && o < col0 + nb) s += bias[(size_t)e * nb + (o - col0)];
            want[(size_t)r * O + o] = s;
          }
        char name[160];
        std::snprintf(name, sizeof name, "grouped_gemm_nt_%s bias %d..%d", tag, col0, col0 + nb);
        if (wanted(name)) {
          Buf<TY> y((size_t)M * O);
          const TY* bp = nb ? bb.p : wb.p;
          bool ok = cp_emu::launch(name, dim3(nt, (O + 63) / 64), dim3(128), 0,
                                   [&] { f.nt(xb.p, wb.p, bp, y.p, ob.p, tb.p, O, I, col0, nb, vec); });
          check_launch(name, ok);
          if (ok) check(name, rel(y, want), tol);
        }
      }
      {
        std::vector<double> want((size_t)M * I, 0.0);
        for (int r = 0; r < M; ++r)
          for (int i = 0; i < I; ++i) {
            double s = 0;
            for (int o = 0; o < O; ++o) s += dy[(size_t)r * O + o] * w[((size_t)expert(r) * O + o) * I + i];
            want[(size_t)r * I + i] = s;
          }
        char name[160];
        std::snprintf(name, sizeof name, "grouped_gemm_nn_%s", tag);
        if (wanted(name)) {
          Buf<TY> dx((size_t)M * I);
          bool ok = cp_emu::launch(name, dim3(nt, (I + 63) / 64), dim3(128), 0, [&] { f.nn(dyb.p, wb.p, dx.p, ob.p, tb.p, I, O, vec); });
          check_launch(name, ok);
          if (ok) check(name, rel(dx, want), tol);
        }
      }
      {
        std::vector<double> want((size_t)E * O * I, 0.0);
        for (int r = 0; r < M; ++r)
          for (int o = 0; o < O; ++o)
            for (int i = 0; i < I; ++i) want[((size_t)expert(r) * O + o) * I + i] += dy[(size_t)r * O + o] * x[(size_t)r * I + i];
        char name[160];
        std::snprintf(name, sizeof name, "grouped_gemm_tn_%s", tag);
        if (wanted(name)) {
          Buf<TY> dw((size_t)E * O * I);
          bool ok = cp_emu::launch(name, dim3((I + 63) / 64, (O + 63) / 64, E), dim3(128), 0, [&] { f.tn(dyb.p, xb.p, dw.p, ob.p, O, I, vec); });
          check_launch(name, ok);
          if (ok) {
            // an expert without rows: exactly zero (written, not left poisoned)
            double bad_zero = 0;
            for (int e = 0; e < E; ++e)
              if (sh.counts[e] == 0)
                for (size_t j = 0; j < (size_t)O * I; ++j) bad_zero += to_d(dw.p[(size_t)e * O * I + j]) != 0.0;
            check(name, rel(dw, want) + bad_zero, tol);
          }
        }
      }
    }
  }
}

}  // namespace

void run_grouped_checks() {
  check_grouped<float>("f32", {grouped_gemm_nt_f32, grouped_gemm_nn_f32, grouped_gemm_tn_f32}, 1e-5, 81);
  check_grouped<__half>("f16", {grouped_gemm_nt_f16, grouped_gemm_nn_f16, grouped_gemm_tn_f16}, 1e-3, 82);
  check_grouped<__nv_bfloat16>("bf16", {grouped_gemm_nt_bf16, grouped_gemm_nn_bf16, grouped_gemm_tn_bf16}, 8e-3, 83);
}
