// Shared helpers of check_candle.cpp / check_candle_reduce.cpp (candle's kernels under the
// emulator through the shim's registry; see check_candle.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "emu.h"
#include "registry.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace cc {

using bf16 = __nv_bfloat16;
using f16 = __half;
using u32 = uint32_t;
using u8 = uint8_t;
using i64 = int64_t;

inline int n_pass = 0, n_fail = 0;

inline std::string sched_label;  // appended to check names when not the default schedule

inline void report(const std::string& name, bool ok, const std::string& detail = "") {
  std::printf("%s %s%s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), sched_label.c_str(), detail.empty() ? "" : "  ",
              detail.c_str());
  (ok ? n_pass : n_fail)++;
}

// ---- element conversions ----------------------------------------------------------------------
template <typename T> double to_d(T x) { return (double)x; }
template <> inline double to_d<bf16>(bf16 x) { return __bfloat162float(x); }
template <> inline double to_d<f16>(f16 x) { return __half2float(x); }
template <typename T> T from_d(double x) { return (T)x; }
template <> inline bf16 from_d<bf16>(double x) { return __float2bfloat16_rn((float)x); }
template <> inline f16 from_d<f16>(double x) { return __float2half_rn((float)x); }
template <typename T> double tol_of() { return std::is_integral<T>::value ? 0 : 1e-5; }
template <> inline double tol_of<bf16>() { return 1e-2; }
template <> inline double tol_of<f16>() { return 2e-3; }
template <> inline double tol_of<double>() { return 1e-12; }

// ---- "device" buffers: host memory ending right before a PROT_NONE page ------------------------
template <typename T> struct Buf {
  T* p = nullptr;
  size_t n = 0, map_bytes = 0;
  void* base = nullptr;
  explicit Buf(size_t n_) : n(n_) {
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    const size_t bytes = ((std::max<size_t>(n, 1) * sizeof(T)) + 15) / 16 * 16;
    map_bytes = (bytes + pg - 1) / pg * pg + pg;
    base = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) std::abort();
    mprotect(static_cast<char*>(base) + map_bytes - pg, pg, PROT_NONE);
    p = reinterpret_cast<T*>(static_cast<char*>(base) + map_bytes - pg - bytes);
    std::memset(static_cast<void*>(p), 0xff, bytes);  // NaN / garbage until written
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() { munmap(base, map_bytes); }
  T& operator[](size_t i) { return p[i]; }
};
template <typename T> Buf<T>* make_buf(const std::vector<T>& v) {
  auto* b = new Buf<T>(v.size());
  for (size_t i = 0; i < v.size(); ++i) b->p[i] = v[i];
  return b;
}

inline std::mt19937_64 rng(12345);
template <typename T> std::vector<T> rand_vec(size_t n, double lo = -2, double hi = 2) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<T> v(n);
  std::uniform_int_distribution<int> ui(0, 99);  // integers: 0..99 (no negative -> unsigned)
  for (auto& x : v) x = std::is_integral<T>::value ? (T)ui(rng) : from_d<T>(u(rng));
  return v;
}

// ---- kernelParams builder and launch ------------------------------------------------------------
struct Params {
  std::vector<std::unique_ptr<unsigned char[]>> store;
  std::vector<void*> ptrs;
  template <typename T> Params& a(T v) {
    store.emplace_back(new unsigned char[sizeof(T) < 16 ? 16 : sizeof(T)]);
    std::memcpy(store.back().get(), &v, sizeof(T));
    ptrs.push_back(store.back().get());
    return *this;
  }
};

// Launches `name` as cuLaunchKernel would; false (reported) if missing, wrong arity or failed.
inline bool run(const std::string& name, dim3 grid, dim3 block, size_t smem, Params& p) {
  size_t n = 0;
  cp_emu::Thunk t = cp_emu::find_kernel(name.c_str(), &n);
  if (!t) { report(name, false, "entry not registered"); return false; }
  if (n != p.ptrs.size()) {
    report(name, false, "has " + std::to_string(n) + " parameters, candle passes " + std::to_string(p.ptrs.size()));
    return false;
  }
  void** kp = p.ptrs.data();
  if (!cp_emu::launch(name.c_str(), grid, block, smem, [&] { t(kp); })) { report(name, false, "launch failed"); return false; }
  return true;
}
inline dim3 for_num_elems(size_t n) { return dim3((unsigned)((n + 1023) / 1024), 1, 1); }
inline const dim3 B1024(1024, 1, 1);

// max over i of |got - want| / max(1, |want|) (or / scale[i] when given) must be <= tol.
template <typename T>
void compare(const std::string& name, const T* got, const std::vector<double>& want, double tol,
             const std::vector<double>* scale = nullptr) {
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = to_d(got[i]), w = want[i];
    const double den = scale ? (*scale)[i] : std::max(1.0, std::fabs(w));
    double e = (std::isinf(w) && g == w) ? 0 : std::fabs(g - w) / den;
    if (std::isnan(e)) e = INFINITY;
    if (e > worst) worst = e, at = i;
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, "(%zu el, max rel err %.3g at %zu, tol %.0e)", want.size(), worst, at, tol);
  report(name, worst <= tol, buf);
}

// A strided view: dims + strides (candle's info layout) over a buffer of `span` elements.
struct View {
  std::vector<size_t> dims, strides;
  size_t numel() const { size_t n = 1; for (size_t d : dims) n *= d; return n; }
  size_t span() const { size_t s = 1; for (size_t i = 0; i < dims.size(); ++i) s += (dims[i] - 1) * strides[i]; return s; }
  size_t at(size_t i) const {  // element offset of logical index i (row-major)
    size_t off = 0;
    for (size_t d = dims.size(); d-- > 0;) off += (i % dims[d]) * strides[d], i /= dims[d];
    return off;
  }
  std::vector<size_t> info() const { std::vector<size_t> v = dims; v.insert(v.end(), strides.begin(), strides.end()); return v; }
};
inline View contiguous(std::vector<size_t> dims) {
  View v{dims, std::vector<size_t>(dims.size())};
  size_t s = 1;
  for (size_t d = dims.size(); d-- > 0;) v.strides[d] = s, s *= dims[d];
  return v;
}
inline View transposed(size_t r, size_t c) { return View{{r, c}, {1, r}}; }  // [r, c] view of a [c, r] buffer

void run_reduce_checks();  // check_candle_reduce.cpp: reduce.cu (incl. softmax, norms, rope), sort.cu
void run_bench();          // check_candle_reduce.cpp: timings of 1M-element launches

}  // namespace cc
