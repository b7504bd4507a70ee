// Minimal stand-ins for the driver part of the host CUDA shim (driver.cpp), for building
// test_nccl WITHOUT driver.cpp: only what nccl.cpp uses (stream_push, stream_drain,
// wait_timeout_s, log, device_count) and the stream calls test_nccl.cpp makes. Never part of the
// shim library; test_nccl.sh links it only while driver.cpp does not exist.
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <vector>

#include "shim.h"

namespace cp_shim {
std::mutex g_mu;
std::map<void*, std::deque<WorkPtr>> g_streams;

void stream_push(void* stream, WorkPtr w) {
  std::lock_guard<std::mutex> g(g_mu);
  g_streams[stream].push_back(std::move(w));
}

int stream_drain(void* stream) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_timeout_s());
  for (;;) {
    WorkPtr w;
    {
      std::lock_guard<std::mutex> g(g_mu);
      auto& q = g_streams[stream];
      while (!q.empty() && q.front()->is_done()) q.pop_front();
      if (q.empty()) return CU_OK;
      w = q.front();
    }
    std::unique_lock<std::mutex> lk(w->m);
    if (!w->cv.wait_until(lk, deadline, [&] { return w->done; })) {
      log("stream %p: %s did not complete within %.1f s", stream, w->what.c_str(), wait_timeout_s());
      return CU_LAUNCH_TIMEOUT;
    }
  }
}

double wait_timeout_s() {
  const char* v = getenv("CPEMU_WAIT_TIMEOUT_S");
  return v ? atof(v) : 120.0;
}

int device_count() {
  const char* v = getenv("CPEMU_DEVICES");
  return v ? atoi(v) : 1;
}

int compute_capability() { return 90; }

void* dev_alloc(size_t bytes) { return malloc(bytes ? bytes : 1); }
void dev_free(void* p) { free(p); }

void log(const char* fmt, ...) {
  char b[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(b, sizeof b, fmt, ap);
  va_end(ap);
  fprintf(stderr, "cpemu: %s\n", b);
}

}  // namespace cp_shim

// The driver calls the tests use: streams are distinct handles, an event is the snapshot of its
// stream's pending work, a context is a device number (current per thread).
namespace {
struct StubEvent {
  std::vector<cp_shim::WorkPtr> work;
};
thread_local int t_dev = -1;
int wait_works(const std::vector<cp_shim::WorkPtr>& ws) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(cp_shim::wait_timeout_s());
  for (auto& w : ws) {
    std::unique_lock<std::mutex> lk(w->m);
    if (!w->cv.wait_until(lk, deadline, [&] { return w->done; })) return cp_shim::CU_LAUNCH_TIMEOUT;
  }
  return cp_shim::CU_OK;
}
}  // namespace

extern "C" {
int cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  *ctx = reinterpret_cast<void*>(static_cast<intptr_t>(dev) + 16);
  return 0;
}
int cuCtxSetCurrent(void* ctx) {
  t_dev = ctx ? static_cast<int>(reinterpret_cast<intptr_t>(ctx) - 16) : -1;
  return 0;
}
int cuCtxGetDevice(int* dev) {
  if (t_dev < 0) return cp_shim::CU_INVALID_CONTEXT;
  *dev = t_dev;
  return 0;
}
int cuEventCreate(void** e, unsigned) {
  *e = new StubEvent;
  return 0;
}
int cuEventDestroy_v2(void* e) {
  delete static_cast<StubEvent*>(e);
  return 0;
}
int cuEventRecord(void* e, void* s) {
  std::lock_guard<std::mutex> g(cp_shim::g_mu);
  auto& q = cp_shim::g_streams[s];
  static_cast<StubEvent*>(e)->work.assign(q.begin(), q.end());
  return 0;
}
int cuEventQuery(void* e) {
  for (auto& w : static_cast<StubEvent*>(e)->work)
    if (!w->is_done()) return cp_shim::CU_NOT_READY;
  return 0;
}
int cuEventSynchronize(void* e) { return wait_works(static_cast<StubEvent*>(e)->work); }
int cuStreamWaitEvent(void*, void* e, unsigned) { return wait_works(static_cast<StubEvent*>(e)->work); }
int cuInit(unsigned) { return 0; }
int cuStreamCreate(void** s, unsigned) {
  *s = new char;
  return 0;
}
int cuStreamSynchronize(void* s) { return cp_shim::stream_drain(s); }
int cuStreamQuery(void* s) {
  std::lock_guard<std::mutex> g(cp_shim::g_mu);
  for (auto& w : cp_shim::g_streams[s])
    if (!w->is_done()) return cp_shim::CU_NOT_READY;
  return cp_shim::CU_OK;
}
int cuStreamDestroy_v2(void* s) {
  cp_shim::stream_drain(s);
  {
    std::lock_guard<std::mutex> g(cp_shim::g_mu);
    cp_shim::g_streams.erase(s);
  }
  delete static_cast<char*>(s);
  return 0;
}
}
