// Helpers of the shim's libnccl tests (test_nccl.cpp, test_nccl_faults.cpp, test_nccl_group.cpp,
// test_nccl_procs.cpp).
#pragma once
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "nccl_abi.h"
#include "nccl_reduce.h"
#include "shim.h"

using namespace cp_nccl;

extern "C" {  // driver calls (driver.cpp, or test_stubs.cpp)
int cuInit(unsigned flags);
int cuStreamCreate(void** stream, unsigned flags);
int cuStreamSynchronize(void* stream);
int cuStreamQuery(void* stream);
int cuStreamDestroy_v2(void* stream);
int cuDevicePrimaryCtxRetain(void** ctx, int dev);
int cuCtxSetCurrent(void* ctx);
int cuEventCreate(void** event, unsigned flags);
int cuEventRecord(void* event, void* stream);
int cuEventSynchronize(void* event);
int cuEventDestroy_v2(void* event);
int cuStreamWaitEvent(void* stream, void* event, unsigned flags);
}

inline int g_failed = 0, g_passed = 0;  // shared by the test files

namespace {

const size_t N = 37;  // elements per rank (odd, not a multiple of anything)

void report(const std::string& name, const std::string& err) {
  if (err.empty()) {
    ++g_passed;
    printf("PASS %s\n", name.c_str());
  } else {
    ++g_failed;
    printf("FAIL %s: %s\n", name.c_str(), err.c_str());
  }
  fflush(stdout);
}

double secs_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char b[512];
  va_list ap;
  va_start(ap, f);
  vsnprintf(b, sizeof b, f, ap);
  va_end(ap);
  return b;
}

bool is_unsigned(int dt) { return dt == ncclUint8 || dt == ncclUint32 || dt == ncclUint64; }

// Input element i of `rank` (salt varies per test): an integer in [-2, 2] ([0, 4] unsigned).
double val(int rank, size_t i, int salt, int dt) {
  int v = static_cast<int>((rank * 5 + i * 3 + salt * 7 + (i * i) % 7) % 5) - 2;
  return is_unsigned(dt) ? v + 2 : v;
}

void put(void* b, size_t i, int dt, double v) {
  const auto iv = static_cast<int64_t>(v);
  switch (dt) {
    case ncclInt8: static_cast<int8_t*>(b)[i] = static_cast<int8_t>(iv); break;
    case ncclUint8: static_cast<uint8_t*>(b)[i] = static_cast<uint8_t>(iv); break;
    case ncclInt32: static_cast<int32_t*>(b)[i] = static_cast<int32_t>(iv); break;
    case ncclUint32: static_cast<uint32_t*>(b)[i] = static_cast<uint32_t>(iv); break;
    case ncclInt64: static_cast<int64_t*>(b)[i] = iv; break;
    case ncclUint64: static_cast<uint64_t*>(b)[i] = static_cast<uint64_t>(iv); break;
    case ncclFloat16: static_cast<uint16_t*>(b)[i] = float_to_f16(static_cast<float>(v)); break;
    case ncclFloat32: static_cast<float*>(b)[i] = static_cast<float>(v); break;
    case ncclFloat64: static_cast<double*>(b)[i] = v; break;
    case ncclBfloat16: static_cast<uint16_t*>(b)[i] = float_to_bf16(static_cast<float>(v)); break;
    case ncclFloat8e4m3: static_cast<uint8_t*>(b)[i] = float_to_e4m3(static_cast<float>(v)); break;
    case ncclFloat8e5m2: static_cast<uint8_t*>(b)[i] = float_to_e5m2(static_cast<float>(v)); break;
  }
}

double get(const void* b, size_t i, int dt) {
  switch (dt) {
    case ncclInt8: return static_cast<const int8_t*>(b)[i];
    case ncclUint8: return static_cast<const uint8_t*>(b)[i];
    case ncclInt32: return static_cast<const int32_t*>(b)[i];
    case ncclUint32: return static_cast<const uint32_t*>(b)[i];
    case ncclInt64: return static_cast<double>(static_cast<const int64_t*>(b)[i]);
    case ncclUint64: return static_cast<double>(static_cast<const uint64_t*>(b)[i]);
    case ncclFloat16: return f16_to_float(static_cast<const uint16_t*>(b)[i]);
    case ncclFloat32: return static_cast<const float*>(b)[i];
    case ncclFloat64: return static_cast<const double*>(b)[i];
    case ncclBfloat16: return bf16_to_float(static_cast<const uint16_t*>(b)[i]);
    case ncclFloat8e4m3: return e4m3_to_float(static_cast<const uint8_t*>(b)[i]);
    case ncclFloat8e5m2: return e5m2_to_float(static_cast<const uint8_t*>(b)[i]);
  }
  return NAN;
}

// A host buffer of n elements of dt ("device memory" of the shim is host memory).
struct Buf {
  std::vector<char> b;
  int dt;
  Buf(size_t n, int dt_) : b(n * dtype_size(dt_) + 1, 0), dt(dt_) {}
  void* p(size_t off = 0) { return b.data() + off * dtype_size(dt); }
  void fill(int rank, int salt, size_t n, size_t off = 0) {
    for (size_t i = 0; i < n; ++i) put(p(), off + i, dt, val(rank, i, salt, dt));
  }
};

// Reference of op over ranks 0..P-1 of element i, rounded to dt like a stored result.
double ref_reduce(int P, size_t i, int salt, int dt, int op) {
  double a = val(0, i, salt, dt);
  for (int r = 1; r < P; ++r) {
    double b = val(r, i, salt, dt);
    a = op == ncclProd ? a * b : op == ncclMax ? std::max(a, b) : op == ncclMin ? std::min(a, b) : a + b;
  }
  if (op == ncclAvg) a /= P;
  std::vector<char> tmp(8);
  put(tmp.data(), 0, dt, a);
  return get(tmp.data(), 0, dt);
}

// Element-wise comparison; tol relative (0: exact).
void expect(std::string& err, const char* what, int rank, const Buf& got, size_t off, size_t n,
            const std::function<double(size_t)>& want, double tol = 0) {
  for (size_t i = 0; i < n && err.empty(); ++i) {
    double g = get(got.b.data(), off + i, got.dt), w = want(i);
    if (!(std::fabs(g - w) <= tol * std::fabs(w) + (tol > 0 ? tol : 0))) err = fmt("%s rank %d elem %zu: got %g, want %g", what, rank, i, g, w);
  }
}

std::string check_rc(const char* what, int rc, int want = ncclSuccess) {
  return rc == want ? "" : fmt("%s returned %d (%s), want %d", what, rc, ncclGetErrorString(static_cast<ncclResult_t>(rc)), want);
}

void* new_stream() {
  void* s = nullptr;
  if (cuStreamCreate(&s, 0) != 0) {
    fprintf(stderr, "cuStreamCreate failed\n");
    exit(2);
  }
  return s;
}

#define TRY_RC(call, want)                        \
  do {                                            \
    std::string e_ = check_rc(#call, (call), (want)); \
    if (!e_.empty()) return e_;                   \
  } while (0)

#define TRY(call)                                 \
  do {                                            \
    std::string e_ = check_rc(#call, (call));     \
    if (!e_.empty()) return e_;                   \
  } while (0)

using RankFn = std::function<std::string(int rank, int P, ncclComm_t comm, void* stream)>;

// Runs fn on P ranks (threads; communicator from a blocking ncclCommInitRank each), returns the
// first rank error. Destroys the communicators afterwards.
std::string run_ranks(int P, const RankFn& fn) {
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) return "ncclGetUniqueId failed";
  std::vector<std::string> errs(P);
  std::vector<std::thread> ts;
  for (int r = 0; r < P; ++r)
    ts.emplace_back([&, r] {
      ncclComm_t comm = nullptr;
      void* s = new_stream();
      errs[r] = check_rc("ncclCommInitRank", ncclCommInitRank(&comm, P, id, r));
      if (errs[r].empty()) errs[r] = fn(r, P, comm, s);
      if (comm && ncclCommDestroy(comm) != ncclSuccess && errs[r].empty()) errs[r] = "ncclCommDestroy failed";
      cuStreamDestroy_v2(s);
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (!e.empty()) return e;
  return "";
}

}  // namespace

// test_nccl_faults.cpp
void test_init_paths();
void test_missing_rank();
void test_abort();
void test_mismatch();
void test_arguments();
// test_nccl_group.cpp
void test_group_pattern();

