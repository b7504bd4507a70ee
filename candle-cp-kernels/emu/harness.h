// Shared helpers of the emulator harness (harness.cpp, check_flash.cpp, check_misc.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "emu.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

void check(const std::string& name, double err, double tol);
void check_launch(const std::string& name, bool ok);
bool wanted(const std::string& name);
// true in the worker that runs the first combination (the self-tests run there only)
bool selftests_here();
void* guarded_alloc(size_t bytes);
void guarded_free(void* p, size_t bytes);
// max |a - b| (equal infinities count as 0; NaN in a fails)
double max_abs(const std::vector<float>& a, const std::vector<double>& b);
// max |a - b| / max |b|
double rel_err(const std::vector<float>& a, const std::vector<double>& b);
std::vector<double> randn(size_t n, uint64_t seed);
// The forward's fold mode (flash_fwd.cu CpFwdDst, o_merge = 1: the ring's running state): `run`
// launches the forward of a [B, T, H, D] call with (out, lse, o_T, o_row0, o_merge) into a state
// of T + 7 rows at row 3 that holds a previous partial result (random out / lse, some rows -inf
// with out 0); checks the rows against the float64 LSE merge of that state with (ref_out,
// ref_lse), and that rows outside 3 .. 3 + T are untouched. tol: the forward's out tolerance.
void check_fold(const std::string& name, int B, int T, int H, int D, const std::vector<double>& ref_out,
                const std::vector<double>& ref_lse, double tol, uint64_t seed,
                const std::function<bool(float*, float*, int, int, int)>& run);
void run_flash_checks();
void run_misc_checks();
void run_fused_checks();  // check_fused.cpp (flash_bwd_fused.cu)
void run_probe_checks();  // check_probe.cpp (probe.cu, probe_sm90.cu)
void run_band_checks();   // check_band.cpp (the `_band_` entries: band masks)
void run_quant_checks();  // check_quant.cpp (quant.cu: int8 / NF4 dequantization)
void run_moe_checks();    // check_moe.cpp (moe.cu: top-K routing)
void run_grouped_checks();  // check_grouped.cpp (grouped_gemm.cu: the experts' grouped products)
void run_dropout_checks();  // check_dropout.cpp (dropout.cu: keep masks)

// Element conversions.
template <typename T> inline T to_t(double x);
template <> inline float to_t<float>(double x) { return (float)x; }
template <> inline __half to_t<__half>(double x) { return __float2half_rn((float)x); }
template <> inline __nv_bfloat16 to_t<__nv_bfloat16>(double x) { return __float2bfloat16_rn((float)x); }
inline double to_d(float x) { return x; }
inline double to_d(__half x) { return __half2float(x); }
inline double to_d(__nv_bfloat16 x) { return __bfloat162float(x); }

// A kernel argument buffer in guarded host memory, poisoned with 0xFF bytes (NaN for floats).
template <typename T> struct Buf {
  T* p = nullptr;
  size_t n = 0;
  explicit Buf(size_t n_) : n(n_) {
    p = static_cast<T*>(guarded_alloc(std::max<size_t>(n, 1) * sizeof(T)));
    std::memset((void*)p, 0xff, std::max<size_t>(n, 1) * sizeof(T));
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() { guarded_free(p, std::max<size_t>(n, 1) * sizeof(T)); }
  std::vector<float> to_f32() const {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = (float)to_d(p[i]);
    return v;
  }
};

// Rounds doubles to T, stores them in a Buf and returns the rounded values as doubles.
template <typename T> std::vector<double> fill(Buf<T>& b, const std::vector<double>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    b.p[i] = to_t<T>(x[i]);
    r[i] = to_d(b.p[i]);
  }
  return r;
}

// One attention problem with CpMask semantics (query i at qo + i*qs, key j at ko + j*ks).
struct Case {
  const char* label;
  int B, T, S, H, Hkv, D;
  int causal;
  long long qo, qs, ko, ks;
  std::string tag() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s d%d [b%d t%d s%d h%d kv%d]", label, D, B, T, S, H, Hkv);
    return buf;
  }
  bool vis(long i, long j) const { return !causal || ko + j * ks <= qo + i * qs; }
};


// float64 reference results of one Case.
struct Ref {
  std::vector<double> out, lse, dq, dk, dv, delta;
};

// float64 attention forward + backward (the backward from this forward's out / lse);
// defined in check_flash.cpp, used by every flash check.
Ref reference(const Case& c, const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
              const std::vector<double>& dout, double scale, double cap = 0.0);

// Dynamic shared memory of a CUDA-core kernel launch at head dim D (src/flash/core.rs
// `core_smem`, kernels/common.cuh `cp_core_smem`): 0 while the kernel's floats fit the 48 KiB
// of static shared memory (D <= 128), else all of them. kind: 0 forward (80 D + 32 floats),
// 1 dK/dV (80 D + 576), 2 dQ (80 D + 64).
inline size_t core_smem(int kind, int D) {
  const size_t floats = (size_t)80 * D + (kind == 0 ? 32 : kind == 1 ? 576 : 64);
  return floats * 4 <= 48 * 1024 ? 0 : floats * 4;
}
