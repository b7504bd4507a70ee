// Tests of the shim's libcublas / libcurand stand-ins (blas.cpp, rand.cpp) through their C ABI,
// against a naive double-precision reference written independently here. Run by test_blas.sh.
#include "shim.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

// ---- the ABI under test (as cudarc 0.19.10 declares it; enums as 32-bit ints) ----------------
extern "C" {
struct cublasContext;
typedef cublasContext* cublasHandle_t;
struct curandGenerator_st;
typedef curandGenerator_st* curandGenerator_t;
int cublasCreate_v2(cublasHandle_t*);
int cublasDestroy_v2(cublasHandle_t);
int cublasSetStream_v2(cublasHandle_t, void*);
int cublasGetStream_v2(cublasHandle_t, void**);
int cublasSetMathMode(cublasHandle_t, int);
int cublasSetWorkspace_v2(cublasHandle_t, void*, size_t);
int cublasGemmStridedBatchedEx(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int, long long,
                               const void*, int, int, long long, const void*, void*, int, int, long long, int, int, int);
int cublasGemmEx(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                 const void*, void*, int, int, int, int);
int cublasSgemmStridedBatched(cublasHandle_t, int, int, int, int, int, const float*, const float*, int, long long,
                              const float*, int, long long, const float*, float*, int, long long, int);
int cublasDgemmStridedBatched(cublasHandle_t, int, int, int, int, int, const double*, const double*, int, long long,
                              const double*, int, long long, const double*, double*, int, long long, int);
int cublasHgemmStridedBatched(cublasHandle_t, int, int, int, int, int, const uint16_t*, const uint16_t*, int,
                              long long, const uint16_t*, int, long long, const uint16_t*, uint16_t*, int, long long,
                              int);
int cublasSgemm_v2(cublasHandle_t, int, int, int, int, int, const float*, const float*, int, const float*, int,
                   const float*, float*, int);
int curandCreateGenerator(curandGenerator_t*, int);
int curandDestroyGenerator(curandGenerator_t);
int curandSetStream(curandGenerator_t, void*);
int curandSetPseudoRandomGeneratorSeed(curandGenerator_t, unsigned long long);
int curandGenerateUniform(curandGenerator_t, float*, size_t);
int curandGenerateUniformDouble(curandGenerator_t, double*, size_t);
int curandGenerateNormal(curandGenerator_t, float*, size_t, float, float);
int curandGenerateNormalDouble(curandGenerator_t, double*, size_t, double, double);
}

enum { R32F = 0, R64F = 1, R16F = 2, R16BF = 14, R8I = 3 };
enum { C16F = 64, C32F = 68, C64F = 70, C32I = 72, C32F_FAST_16F = 74, C32F_FAST_16BF = 75, C32F_FAST_TF32 = 77 };
enum { OP_N = 0, OP_T = 1, OP_C = 2 };
enum { OK = 0, NOT_INITIALIZED = 1, INVALID_VALUE = 7, NOT_SUPPORTED = 15 };
enum { RNG_DEFAULT = 100, RNG_QUASI_SOBOL32 = 201, LENGTH_NOT_MULTIPLE = 105, RNG_NOT_INITIALIZED = 101,
       RNG_TYPE_ERROR = 103 };

static int g_fail = 0, g_checks = 0;
#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    ++g_checks;                                                              \
    if (!(cond)) {                                                           \
      ++g_fail;                                                              \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);   \
      std::fprintf(stderr, __VA_ARGS__);                                     \
      std::fprintf(stderr, "\n");                                            \
    }                                                                        \
  } while (0)

// ---- reference number formats (independent of blas.cpp: frexp/ldexp rounding) ---------------
// Rounds x to p significant bits (min normal exponent emin; below it the quantum is fixed),
// ties to even; overflow beyond `maxv` gives inf.
static double round_sig(double x, int p, int emin, double maxv) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e;
  std::frexp(x, &e);
  int lead = std::max(e - 1, emin);
  double q = std::ldexp(1.0, lead - (p - 1));
  double r = std::nearbyint(x / q) * q;
  if (std::fabs(r) > maxv) return std::copysign(INFINITY, x);
  return r;
}
static double rnd(int t, double x) {
  switch (t) {
    case R16F: return round_sig(x, 11, -14, 65504.0);
    case R16BF: return round_sig(x, 8, -126, 3.3895313892515355e38);
    case R32F: return double(float(x));
    default: return x;
  }
}
static size_t tsize(int t) { return t == R64F ? 8 : t == R32F ? 4 : 2; }
// Encodes a value exactly representable in t.
static void put(void* buf, int t, size_t i, double v) {
  if (t == R64F) { static_cast<double*>(buf)[i] = v; return; }
  if (t == R32F) { static_cast<float*>(buf)[i] = float(v); return; }
  uint16_t bits;
  if (t == R16BF) {
    float f = float(v);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = uint16_t(u >> 16);
  } else {
    _Float16 h = (_Float16)v;  // exact (v is representable)
    std::memcpy(&bits, &h, 2);
  }
  static_cast<uint16_t*>(buf)[i] = bits;
}
static double get(const void* buf, int t, size_t i) {
  if (t == R64F) return static_cast<const double*>(buf)[i];
  if (t == R32F) return static_cast<const float*>(buf)[i];
  uint16_t bits = static_cast<const uint16_t*>(buf)[i];
  if (t == R16BF) {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return double(float(h));
}
static void put_nan(void* buf, int t, size_t i) { put(buf, t, i, NAN); }
static bool same_bits(const void* a, const void* b, int t, size_t i) {
  return std::memcmp(static_cast<const char*>(a) + i * tsize(t), static_cast<const char*>(b) + i * tsize(t),
                     tsize(t)) == 0;
}

struct Lcg {
  uint64_t s;
  double next() {  // in [-1, 1)
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return double(int64_t(s >> 11) - (int64_t(1) << 52)) / double(int64_t(1) << 52);
  }
};

// ---- GEMM vs reference -------------------------------------------------------------------------
enum Entry { EX, GEMMEX, SGEMM_SB, DGEMM_SB, HGEMM_SB, SGEMM };
static const char* entry_name(Entry e) {
  const char* n[] = {"GemmStridedBatchedEx", "GemmEx", "SgemmStridedBatched", "DgemmStridedBatched",
                     "HgemmStridedBatched", "Sgemm_v2"};
  return n[e];
}

struct Case {
  Entry entry;
  int ab_type, c_type, compute;
  int ta, tb, m, n, k, batch;
  int pad_ld;                // lda/ldb/ldc = rows + pad_ld
  long long pad_stride;      // stride = ld * cols + pad_stride
  double alpha, beta;
  bool broadcast_a = false;  // strideA = 0
};

// Calls the entry under test; alpha/beta passed as the compute type's scalar.
static int call(cublasHandle_t h, const Case& c, const void* A, int lda, long long sa, const void* B, int ldb,
                long long sb, void* C, int ldc, long long sc) {
  float af = float(c.alpha), bf = float(c.beta);
  double ad = c.alpha, bd = c.beta;
  uint16_t ah, bh;
  put(&ah, R16F, 0, c.alpha);
  put(&bh, R16F, 0, c.beta);
  const void *al = &af, *be = &bf;
  if (c.compute == C64F) al = &ad, be = &bd;
  if (c.compute == C16F) al = &ah, be = &bh;
  switch (c.entry) {
    case EX:
      return cublasGemmStridedBatchedEx(h, c.ta, c.tb, c.m, c.n, c.k, al, A, c.ab_type, lda, sa, B, c.ab_type, ldb,
                                        sb, be, C, c.c_type, ldc, sc, c.batch, c.compute, 99);
    case GEMMEX:
      return cublasGemmEx(h, c.ta, c.tb, c.m, c.n, c.k, al, A, c.ab_type, lda, B, c.ab_type, ldb, be, C, c.c_type,
                          ldc, c.compute, -1);
    case SGEMM_SB:
      return cublasSgemmStridedBatched(h, c.ta, c.tb, c.m, c.n, c.k, &af, (const float*)A, lda, sa, (const float*)B,
                                       ldb, sb, &bf, (float*)C, ldc, sc, c.batch);
    case DGEMM_SB:
      return cublasDgemmStridedBatched(h, c.ta, c.tb, c.m, c.n, c.k, &ad, (const double*)A, lda, sa,
                                       (const double*)B, ldb, sb, &bd, (double*)C, ldc, sc, c.batch);
    case HGEMM_SB:
      return cublasHgemmStridedBatched(h, c.ta, c.tb, c.m, c.n, c.k, &ah, (const uint16_t*)A, lda, sa,
                                       (const uint16_t*)B, ldb, sb, &bh, (uint16_t*)C, ldc, sc, c.batch);
    case SGEMM:
      return cublasSgemm_v2(h, c.ta, c.tb, c.m, c.n, c.k, &af, (const float*)A, lda, (const float*)B, ldb, &bf,
                            (float*)C, ldc);
  }
  return -1;
}

// Runs one case and compares every element of C (inside: reference; outside the m x n windows:
// bit-identical to before). Returns the max error / tolerance ratio.
static double run_case(cublasHandle_t h, const Case& c, uint64_t seed) {
  const int ra = c.ta == OP_N ? c.m : c.k, ca = c.ta == OP_N ? c.k : c.m;
  const int rb = c.tb == OP_N ? c.k : c.n, cb = c.tb == OP_N ? c.n : c.k;
  const int lda = std::max(ra, 1) + c.pad_ld, ldb = std::max(rb, 1) + c.pad_ld, ldc = std::max(c.m, 1) + c.pad_ld;
  const long long sa = c.broadcast_a ? 0 : (long long)lda * ca + c.pad_stride;
  const long long sb = (long long)ldb * cb + c.pad_stride, sc = (long long)ldc * c.n + c.pad_stride;
  const size_t na = size_t(sa * (c.batch - 1) + (long long)lda * ca), nb = size_t(sb * (c.batch - 1) + (long long)ldb * cb);
  const size_t nc = size_t(sc * (c.batch - 1) + (long long)ldc * c.n);
  std::vector<char> A(na * tsize(c.ab_type) + 8), B(nb * tsize(c.ab_type) + 8), C(nc * tsize(c.c_type) + 8);
  Lcg r{seed};
  for (size_t i = 0; i < na; ++i) put(A.data(), c.ab_type, i, rnd(c.ab_type, r.next()));
  for (size_t i = 0; i < nb; ++i) put(B.data(), c.ab_type, i, rnd(c.ab_type, r.next()));
  for (size_t i = 0; i < nc; ++i) {
    if (c.beta == 0) put_nan(C.data(), c.c_type, i);  // beta == 0 must not read C
    else put(C.data(), c.c_type, i, rnd(c.c_type, r.next()));
  }
  std::vector<char> C0 = C;
  int st = call(h, c, A.data(), lda, sa, B.data(), ldb, sb, C.data(), ldc, sc);
  CHECK(st == OK, "%s status %d", entry_name(c.entry), st);
  // tolerances: accumulation (float or double) over k terms + one rounding into Ctype
  const double eps_acc = c.compute == C64F ? 0x1p-52 : 0x1p-23;
  const double eps_out = c.c_type == R16F ? 0x1p-11 : c.c_type == R16BF ? 0x1p-8 : c.c_type == R32F ? 0x1p-24 : 0x1p-53;
  std::vector<bool> inside(nc, false);
  double worst = 0;
  for (int b = 0; b < c.batch; ++b)
    for (int j = 0; j < c.n; ++j)
      for (int i = 0; i < c.m; ++i) {
        double s = 0, sabs = 0;
        for (int p = 0; p < c.k; ++p) {
          size_t ia = size_t(sa * b) + (c.ta == OP_N ? size_t(i) + size_t(p) * lda : size_t(p) + size_t(i) * lda);
          size_t ib = size_t(sb * b) + (c.tb == OP_N ? size_t(p) + size_t(j) * ldb : size_t(j) + size_t(p) * ldb);
          double t = get(A.data(), c.ab_type, ia) * get(B.data(), c.ab_type, ib);
          s += t;
          sabs += std::fabs(t);
        }
        size_t ic = size_t(sc * b) + size_t(i) + size_t(j) * ldc;
        inside[ic] = true;
        double cold = c.beta == 0 ? 0 : get(C0.data(), c.c_type, ic);
        double ref = c.alpha * s + c.beta * cold;
        double tol = eps_out * std::fabs(ref) + 2 * c.k * eps_acc * (std::fabs(c.alpha) * sabs + std::fabs(c.beta * cold)) +
                     (c.c_type == R16F ? 0x1p-24 : 0) + 1e-300;
        double got = get(C.data(), c.c_type, ic);
        double ratio = std::fabs(got - ref) / tol;
        if (!(ratio <= 1.0)) {
          CHECK(ratio <= 1.0, "%s ab=%d c=%d compute=%d op=%d%d m=%d n=%d k=%d batch=%d: C[b=%d,i=%d,j=%d]=%.9g ref %.9g",
                entry_name(c.entry), c.ab_type, c.c_type, c.compute, c.ta, c.tb, c.m, c.n, c.k, c.batch, b, i, j, got,
                ref);
          return 1e9;
        }
        worst = std::max(worst, ratio);
      }
  for (size_t i = 0; i < nc; ++i)
    if (!inside[i] && !same_bits(C.data(), C0.data(), c.c_type, i)) {
      CHECK(false, "%s: element %zu outside the C windows was written", entry_name(c.entry), i);
      return 1e9;
    }
  ++g_checks;
  return worst;
}

struct Combo {
  Entry entry;
  int ab, c, compute;
};

static void test_gemm_combos(cublasHandle_t h) {
  const Combo combos[] = {
      {EX, R32F, R32F, C32F},          {EX, R32F, R32F, C32F_FAST_TF32}, {EX, R16F, R16F, C32F},
      {EX, R16F, R16F, C16F},          {EX, R16BF, R16BF, C32F},         {EX, R16BF, R16BF, C32F_FAST_16BF},
      {EX, R16F, R32F, C32F},          {EX, R16BF, R32F, C32F},          {EX, R64F, R64F, C64F},
      {EX, R32F, R32F, C32F_FAST_16F}, {GEMMEX, R16BF, R16BF, C32F},     {GEMMEX, R16F, R16F, C32F},
      {SGEMM_SB, R32F, R32F, C32F},    {DGEMM_SB, R64F, R64F, C64F},     {HGEMM_SB, R16F, R16F, C16F},
      {SGEMM, R32F, R32F, C32F},
  };
  const int ops[] = {OP_N, OP_T, OP_C};
  int cases = 0;
  double worst = 0;
  uint64_t seed = 1;
  for (const Combo& co : combos) {
    const bool batched = co.entry == EX || co.entry == SGEMM_SB || co.entry == DGEMM_SB || co.entry == HGEMM_SB;
    for (int ta : ops)
      for (int tb : ops)
        for (int variant = 0; variant < 4; ++variant) {
          Case c{co.entry, co.ab, co.c, co.compute, ta, tb, 5, 7, 9, batched ? 3 : 1, 0, 0, 1.0, 0.0};
          if (variant == 1) c.pad_ld = 3, c.pad_stride = 5, c.m = 6, c.n = 4, c.k = 13;        // ld > rows, gaps
          if (variant == 2) c.pad_ld = 1, c.pad_stride = 2, c.alpha = 1.5, c.beta = 1.0;       // accumulate
          if (variant == 3) c.m = 1, c.n = 3, c.k = 1, c.alpha = -0.5, c.beta = -0.5, c.pad_ld = 2;  // degenerate
          worst = std::max(worst, run_case(h, c, seed++));
          ++cases;
        }
  }
  std::printf("ok gemm_combos: %d cases (16 type/entry combos x 9 transposes x 4 shapes), worst err/tol %.3f\n",
              cases, worst);
}

static void test_gemm_special(cublasHandle_t h) {
  double worst = 0;
  // broadcast A (strideA = 0), as candle passes for a rhs broadcast over the batch
  Case c{EX, R32F, R32F, C32F, OP_N, OP_N, 8, 6, 10, 4, 0, 0, 1.0, 0.0, true};
  worst = std::max(worst, run_case(h, c, 77));
  // alpha = 0 and k = 0: C = beta * C without reading A / B
  for (int k : {0, 5}) {
    Case z{EX, R16BF, R16BF, C32F, OP_N, OP_T, 4, 3, k, 2, 1, 0, 0.0, 0.5};
    worst = std::max(worst, run_case(h, z, 78 + k));
    z.beta = 0;  // NaN C, beta 0 -> exact zeros
    worst = std::max(worst, run_case(h, z, 90 + k));
  }
  // alpha = 0 with NaN-filled A, B: must not be read
  {
    float A[6], B[6], C[4] = {1, 2, 3, 4};
    for (float& v : A) v = NAN;
    for (float& v : B) v = NAN;
    float al = 0, be = 2;
    int st = cublasSgemm_v2(h, OP_N, OP_N, 2, 2, 3, &al, A, 2, B, 3, &be, C, 2);
    CHECK(st == OK && C[0] == 2 && C[3] == 8, "alpha=0: status %d C=%g..%g", st, C[0], C[3]);
  }
  // empty problems touch nothing
  {
    float C[4];
    for (float& v : C) v = 7;
    float al = 1, be = 0;
    CHECK(cublasSgemm_v2(h, OP_N, OP_N, 0, 2, 3, &al, nullptr, 1, nullptr, 3, &be, C, 1) == OK, "m=0");
    CHECK(cublasSgemmStridedBatched(h, OP_N, OP_N, 2, 2, 2, &al, nullptr, 2, 4, nullptr, 2, 4, &be, C, 2, 4, 0) == OK,
          "batch=0");
    CHECK(C[0] == 7 && C[3] == 7, "empty problem wrote C");
  }
  std::printf("ok gemm_special: broadcast strideA=0, alpha=0, k=0, empty problems (worst err/tol %.3f)\n", worst);
}

// Products of two 16-bit values are exact in float, so C = a * b (k = 1) must equal the
// reference rounding of the exact product: checks round-to-nearest-even, subnormals, overflow.
static void test_rounding(cublasHandle_t h) {
  Lcg r{12345};
  int n = 0, ties = 0;
  for (int t : {R16F, R16BF}) {
    const int N = 4000;
    std::vector<uint16_t> A(N), B(N), C(N);
    std::vector<double> va(N), vb(N);
    for (int i = 0; i < N; ++i) {
      int ea = int(std::floor((r.next() + 1) * 12)) - 12, eb = int(std::floor((r.next() + 1) * 12)) - 12;
      if (i % 50 == 0) ea = 8, eb = 8;    // overflow to inf in half
      if (i % 50 == 1) ea = -13, eb = -6;  // subnormal half
      va[i] = rnd(t, std::ldexp(r.next(), ea));
      vb[i] = rnd(t, std::ldexp(r.next(), eb));
      if (i % 10 == 2) {  // a in [1, 4/3) with an odd last bit, b = 1.5: a * b is exactly halfway
        const int p = t == R16F ? 11 : 8;
        const double u = std::ldexp(1.0, 1 - p);
        va[i] = 1 + (2 * std::floor((r.next() + 1) / 2 * (1 / (3 * u) - 1) / 2) + 1) * u;
        vb[i] = i % 20 == 2 ? 1.5 : -1.5;
      }
      put(A.data(), t, i, va[i]);
      put(B.data(), t, i, vb[i]);
    }
    // N independent 1x1x1 products as a batch
    float al = 1, be = 0;
    int st = cublasGemmStridedBatchedEx(h, OP_N, OP_N, 1, 1, 1, &al, A.data(), t, 1, 1, B.data(), t, 1, 1, &be,
                                        C.data(), t, 1, 1, N, C32F, 99);
    CHECK(st == OK, "rounding status %d", st);
    for (int i = 0; i < N; ++i) {
      double want = rnd(t, va[i] * vb[i]), got = get(C.data(), t, i);
      const double q = std::ldexp(1.0, std::max(std::ilogb(va[i] * vb[i]), t == R16F ? -14 : -126) - (t == R16F ? 10 : 7));
      if (va[i] * vb[i] != 0 && std::fabs(std::fmod(va[i] * vb[i], q)) == q / 2) ++ties;
      if (!(got == want)) {
        CHECK(got == want, "type %d: %.9g * %.9g -> %.9g, want %.9g", t, va[i], vb[i], got, want);
        break;
      }
      ++n;
    }
  }
  CHECK(ties >= 400, "only %d ties", ties);
  std::printf("ok rounding: %d exact products rounded to f16/bf16 (%d ties, subnormals, overflow)\n", n, ties);
}

// The exact arguments candle 0.11.1 passes for lhs [B,M,K] x rhs [B,K,N] (row-major, contiguous):
// cuBLAS computes C^T = rhs^T lhs^T in column-major: transa=N (or T for rhs = W.t()), transb=N,
// m=N, n=M, k=K, A=rhs lda=N (K if transposed), B=lhs ldb=K, ldc=N, strides K*N, M*K, M*N.
static void test_candle_patterns(cublasHandle_t h) {
  const int Bt = 3, M = 5, K = 6, N = 4;
  for (int t : {R16BF, R16F, R32F}) {
    for (bool rhs_t : {false, true}) {
      std::vector<uint16_t> l16(Bt * M * K), r16(Bt * K * N), o16(Bt * M * N);
      std::vector<float> l32(Bt * M * K), r32(Bt * K * N), o32(Bt * M * N);
      void *lhs = t == R32F ? (void*)l32.data() : l16.data(), *rhs = t == R32F ? (void*)r32.data() : r16.data();
      void* out = t == R32F ? (void*)o32.data() : o16.data();
      Lcg r{uint64_t(t * 10 + rhs_t)};
      std::vector<double> L(Bt * M * K), R(Bt * K * N);  // logical row-major values
      for (int i = 0; i < Bt * M * K; ++i) put(lhs, t, i, L[i] = rnd(t, r.next()));
      for (int b = 0; b < Bt; ++b)
        for (int kk = 0; kk < K; ++kk)
          for (int j = 0; j < N; ++j) {
            double v = rnd(t, r.next());
            R[(b * K + kk) * N + j] = v;
            // rhs_t: rhs is the transpose view of a contiguous [B,N,K] tensor
            put(rhs, t, rhs_t ? (b * N + j) * K + kk : (b * K + kk) * N + j, v);
          }
      for (int i = 0; i < Bt * M * N; ++i) put_nan(out, t, i);
      float al = 1, be = 0;
      int st = cublasGemmStridedBatchedEx(h, rhs_t ? OP_T : OP_N, OP_N, N, M, K, &al, rhs, t, rhs_t ? K : N,
                                          (long long)K * N, lhs, t, K, (long long)M * K, &be, out, t, N,
                                          (long long)M * N, Bt, C32F, 99);
      CHECK(st == OK, "candle pattern status %d", st);
      double eps = t == R16F ? 0x1p-10 : t == R16BF ? 0x1p-7 : 0x1p-20;
      for (int b = 0; b < Bt; ++b)
        for (int i = 0; i < M; ++i)
          for (int j = 0; j < N; ++j) {
            double s = 0;
            for (int kk = 0; kk < K; ++kk) s += L[(b * M + i) * K + kk] * R[(b * K + kk) * N + j];
            double got = get(out, t, (b * M + i) * N + j);
            CHECK(std::fabs(got - s) <= eps * (1 + std::fabs(s)), "candle type %d rhs_t %d [%d,%d,%d] %g vs %g", t,
                  rhs_t, b, i, j, got, s);
          }
    }
  }
  std::printf("ok candle_patterns: row-major [3,5,6]x[3,6,4] (rhs plain and transposed) in bf16/f16/f32\n");
}

static void test_errors(cublasHandle_t h) {
  float A[64] = {}, B[64] = {}, C[64], al = 1, be = 0;
  for (float& v : C) v = 3;
  auto ex = [&](int ta, int tb, int m, int n, int k, int lda, int ldb, int ldc, int batch, int at = R32F,
                int bt = R32F, int ct = R32F, int comp = C32F, const void* alpha = nullptr) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha ? alpha : &al, A, at, lda, 16, B, bt, ldb, 16, &be, C,
                                      ct, ldc, 16, batch, comp, 99);
  };
  CHECK(ex(OP_N, OP_N, -1, 2, 2, 2, 2, 2, 1) == INVALID_VALUE, "m<0");
  CHECK(ex(OP_N, OP_N, 2, -1, 2, 2, 2, 2, 1) == INVALID_VALUE, "n<0");
  CHECK(ex(OP_N, OP_N, 2, 2, -1, 2, 2, 2, 1) == INVALID_VALUE, "k<0");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, -1) == INVALID_VALUE, "batch<0");
  CHECK(ex(OP_N, OP_N, 4, 2, 2, 3, 2, 4, 1) == INVALID_VALUE, "lda < m (N)");
  CHECK(ex(OP_T, OP_N, 2, 2, 4, 3, 4, 2, 1) == INVALID_VALUE, "lda < k (T)");
  CHECK(ex(OP_T, OP_N, 4, 2, 2, 2, 2, 4, 1) == OK, "lda = k (T) is valid");
  CHECK(ex(OP_N, OP_N, 2, 2, 4, 2, 3, 2, 1) == INVALID_VALUE, "ldb < k (N)");
  CHECK(ex(OP_N, OP_T, 2, 4, 2, 2, 3, 2, 1) == INVALID_VALUE, "ldb < n (T)");
  CHECK(ex(OP_N, OP_N, 4, 2, 2, 4, 2, 3, 1) == INVALID_VALUE, "ldc < m");
  CHECK(ex(OP_N, OP_N, 0, 2, 2, 0, 2, 1, 1) == INVALID_VALUE, "lda = 0 < 1");
  CHECK(ex(3, OP_N, 2, 2, 2, 2, 2, 2, 1) == INVALID_VALUE, "transa 3");
  CHECK(ex(OP_N, 9, 2, 2, 2, 2, 2, 2, 1) == INVALID_VALUE, "transb 9");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, 1, R8I, R8I, R32F) == NOT_SUPPORTED, "int8");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, 1, R16F, R16BF, R16F) == NOT_SUPPORTED, "Atype != Btype");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, 1, R64F, R64F, R64F, C32F) == NOT_SUPPORTED, "64F data, 32F compute");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, 1, R32F, R32F, R32F, C64F) == NOT_SUPPORTED, "32F data, 64F compute");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, 1, R16BF, R16BF, R16BF, C16F) == NOT_SUPPORTED, "bf16, 16F compute");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, 1, R16BF, R16BF, R16F, C32F) == NOT_SUPPORTED, "bf16 in, f16 out");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, 1, R32F, R32F, R32F, C32I) == NOT_SUPPORTED, "compute 32I");
  CHECK(ex(OP_N, OP_N, 2, 2, 2, 2, 2, 2, 1, R32F, R32F, R32F, 12345) == NOT_SUPPORTED, "compute garbage");
  CHECK(cublasSgemm_v2(h, OP_N, OP_N, 2, 2, 2, nullptr, A, 2, B, 2, &be, C, 2) == INVALID_VALUE, "alpha null");
  CHECK(cublasSgemm_v2(nullptr, OP_N, OP_N, 2, 2, 2, &al, A, 2, B, 2, &be, C, 2) == NOT_INITIALIZED, "null handle");
  bool untouched = true;
  // only the one valid call above ("lda = k (T)", m=4 n=2 ldc=4) may have written C[0..8) (zeros)
  for (int i = 0; i < 64; ++i) untouched = untouched && (C[i] == 3 || (i < 8 && C[i] == 0));
  CHECK(untouched, "a rejected call wrote C");
  void* s = nullptr;
  CHECK(cublasSetStream_v2(h, (void*)0x1234) == OK && cublasGetStream_v2(h, &s) == OK && s == (void*)0x1234,
        "stream round trip");
  CHECK(cublasSetStream_v2(h, nullptr) == OK, "reset stream");
  CHECK(cublasSetMathMode(h, 1) == OK && cublasSetWorkspace_v2(h, nullptr, 0) == OK, "math mode / workspace");
  std::printf("ok errors: invalid sizes, leading dims, ops, types, null pointers/handle rejected, C untouched\n");
}

// A GEMM / generate on a stream must wait for the stream's pending work (shim.h stream order):
// a Work pushed on the legacy default stream completes 100 ms later, after rewriting the input.
static void test_stream_order(cublasHandle_t h) {
  float A[4] = {1, 1, 1, 1}, B[4] = {1, 0, 0, 1}, C[4], al = 1, be = 0;
  auto w = std::make_shared<cp_shim::Work>();
  w->what = "test work";
  cp_shim::stream_push(nullptr, w);
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    A[0] = 5;  // visible only if the GEMM waited
    w->complete(0);
  });
  int st = cublasSgemm_v2(h, OP_N, OP_N, 2, 2, 2, &al, A, 2, B, 2, &be, C, 2);
  t.join();
  CHECK(st == OK && C[0] == 5, "gemm did not wait for the stream's pending work: C[0]=%g", C[0]);

  curandGenerator_t g;
  CHECK(curandCreateGenerator(&g, RNG_DEFAULT) == OK, "create");
  CHECK(curandSetStream(g, nullptr) == OK, "set stream");
  float out[2] = {-1, -1};
  auto w2 = std::make_shared<cp_shim::Work>();
  cp_shim::stream_push(nullptr, w2);
  std::thread t2([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    out[0] = out[1] = -7;  // the generator must overwrite this
    w2->complete(0);
  });
  st = curandGenerateUniform(g, out, 2);
  t2.join();
  CHECK(st == OK && out[0] > 0 && out[1] > 0, "curand did not wait: %g %g", out[0], out[1]);
  curandDestroyGenerator(g);
  std::printf("ok stream_order: cuBLAS and cuRAND drain the stream's pending work before touching memory\n");
}

static void test_perf(cublasHandle_t h) {
  // candle's [64,2048] x [2048,128]: m=128, n=64, k=2048 in cuBLAS terms; check a sample of C
  const int M = 64, K = 2048, N = 128;
  for (int t : {R32F, R16BF}) {
    std::vector<char> L(M * K * tsize(t)), R(K * N * tsize(t)), O(M * N * tsize(t));
    Lcg r{99};
    for (int i = 0; i < M * K; ++i) put(L.data(), t, i, rnd(t, r.next()));
    for (int i = 0; i < K * N; ++i) put(R.data(), t, i, rnd(t, r.next()));
    float al = 1, be = 0;
    auto t0 = std::chrono::steady_clock::now();
    int st = cublasGemmStridedBatchedEx(h, OP_N, OP_N, N, M, K, &al, R.data(), t, N, K * N, L.data(), t, K, M * K,
                                        &be, O.data(), t, N, M * N, 1, C32F, 99);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    CHECK(st == OK, "perf status %d", st);
    for (int s = 0; s < 64; ++s) {
      int i = (s * 37) % M, j = (s * 53) % N;
      double ref = 0, sabs = 0;
      for (int kk = 0; kk < K; ++kk) {
        double p = get(L.data(), t, i * K + kk) * get(R.data(), t, kk * N + j);
        ref += p;
        sabs += std::fabs(p);
      }
      double got = get(O.data(), t, i * N + j);
      double tol = (t == R16BF ? 0x1p-8 : 0x1p-24) * std::fabs(ref) + K * 0x1p-23 * sabs;
      CHECK(std::fabs(got - ref) <= tol, "perf sample [%d,%d] %g vs %g", i, j, got, ref);
    }
    std::printf("ok perf: [64,2048]x[2048,128] %s in %.1f ms\n", t == R32F ? "f32" : "bf16", ms);
  }
}

// ---- cuRAND ------------------------------------------------------------------------------------
template <class T>
static void moments(const std::vector<T>& v, double& mean, double& sd) {
  double s = 0, s2 = 0;
  for (T x : v) s += x;
  mean = s / v.size();
  for (T x : v) s2 += (x - mean) * (x - mean);
  sd = std::sqrt(s2 / (v.size() - 1));
}

static void test_curand() {
  const size_t n = 1 << 20;
  curandGenerator_t g, g2;
  CHECK(curandCreateGenerator(&g, RNG_DEFAULT) == OK && curandSetPseudoRandomGeneratorSeed(g, 42) == OK, "create");
  CHECK(curandCreateGenerator(&g2, RNG_DEFAULT) == OK && curandSetPseudoRandomGeneratorSeed(g2, 42) == OK, "create2");
  // uniform f32 in (0, 1], moments of U(0,1)
  std::vector<float> u(n), u2(n);
  CHECK(curandGenerateUniform(g, u.data(), n) == OK, "uniform");
  bool in_range = true;
  for (float x : u) in_range = in_range && x > 0 && x <= 1;
  double m, sd;
  moments(u, m, sd);
  CHECK(in_range, "uniform f32 outside (0,1]");
  CHECK(std::fabs(m - 0.5) < 5 * std::sqrt(1.0 / 12 / n), "uniform mean %g", m);
  CHECK(std::fabs(sd - std::sqrt(1.0 / 12)) < 2e-3, "uniform sd %g", sd);
  // determinism: same seed, same call sequence (two halves == one call) -> same numbers
  CHECK(curandGenerateUniform(g2, u2.data(), n / 2) == OK && curandGenerateUniform(g2, u2.data() + n / 2, n / 2) == OK,
        "uniform halves");
  CHECK(u == u2, "same seed differs");
  CHECK(curandSetPseudoRandomGeneratorSeed(g2, 43) == OK && curandGenerateUniform(g2, u2.data(), n) == OK, "reseed");
  size_t same = 0;
  for (size_t i = 0; i < n; ++i) same += u[i] == u2[i];
  CHECK(same < n / 1000, "seeds 42 and 43 agree on %zu of %zu", same, n);
  CHECK(curandSetPseudoRandomGeneratorSeed(g2, 42) == OK && curandGenerateUniform(g2, u2.data(), n) == OK, "reseed");
  CHECK(u == u2, "re-seeding does not restart the sequence");
  // uniform f64
  std::vector<double> d(n);
  CHECK(curandGenerateUniformDouble(g, d.data(), n) == OK, "uniform double");
  in_range = true;
  for (double x : d) in_range = in_range && x > 0 && x <= 1;
  moments(d, m, sd);
  CHECK(in_range && std::fabs(m - 0.5) < 5 * std::sqrt(1.0 / 12 / n), "uniform double mean %g", m);
  // normal f32 / f64 with mean and stddev: moments and the 1-sigma mass
  std::vector<float> z(n);
  CHECK(curandGenerateNormal(g, z.data(), n, 2.0f, 3.0f) == OK, "normal");
  moments(z, m, sd);
  size_t within = 0;
  for (float x : z) within += std::fabs(x - 2.0) < 3.0;
  CHECK(std::fabs(m - 2) < 5 * 3 / std::sqrt(double(n)), "normal mean %g", m);
  CHECK(std::fabs(sd - 3) < 0.01, "normal sd %g", sd);
  CHECK(std::fabs(double(within) / n - 0.682689) < 0.003, "normal 1-sigma mass %g", double(within) / n);
  CHECK(curandGenerateNormalDouble(g, d.data(), n, -1.0, 0.5) == OK, "normal double");
  moments(d, m, sd);
  CHECK(std::fabs(m + 1) < 5 * 0.5 / std::sqrt(double(n)) && std::fabs(sd - 0.5) < 0.002, "normal double %g %g", m, sd);
  // errors
  CHECK(curandGenerateNormal(g, z.data(), 3, 0.f, 1.f) == LENGTH_NOT_MULTIPLE, "odd normal count");
  CHECK(curandGenerateUniform(nullptr, u.data(), 4) == RNG_NOT_INITIALIZED, "null generator");
  curandGenerator_t q = nullptr;
  CHECK(curandCreateGenerator(&q, RNG_QUASI_SOBOL32) == RNG_TYPE_ERROR, "quasi generator");
  CHECK(curandDestroyGenerator(g) == OK && curandDestroyGenerator(g2) == OK, "destroy");
  std::printf("ok curand: uniform (0,1] f32/f64, normal f32/f64 moments, determinism per seed, errors\n");
}

int main() {
  cublasHandle_t h;
  if (cublasCreate_v2(&h) != OK) return 1;
  test_gemm_combos(h);
  test_gemm_special(h);
  test_rounding(h);
  test_candle_patterns(h);
  test_errors(h);
  test_stream_order(h);
  test_perf(h);
  CHECK(cublasDestroy_v2(h) == OK, "destroy");
  test_curand();
  std::printf("%s: %d checks, %d failed\n", g_fail ? "FAILED" : "PASSED", g_checks, g_fail);
  return g_fail ? 1 : 0;
}
