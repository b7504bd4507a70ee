// Test-only stand-ins for the parts of driver.cpp that blas.cpp / rand.cpp use (shim.h):
// stream_push, stream_drain (waits for the pushed work, 10 s bound), log. Linked by test_blas.sh
// only when driver.cpp is absent; never part of the shim library.
#include "shim.h"

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <map>

namespace cp_shim {
namespace {
std::mutex g_m;
std::map<void*, std::vector<WorkPtr>> g_pending;
}  // namespace

void stream_push(void* stream, WorkPtr w) {
  std::lock_guard<std::mutex> g(g_m);
  g_pending[stream].push_back(std::move(w));
}

int stream_drain(void* stream) {
  std::vector<WorkPtr> works;
  {
    std::lock_guard<std::mutex> g(g_m);
    works.swap(g_pending[stream]);
  }
  for (auto& w : works) {
    std::unique_lock<std::mutex> l(w->m);
    if (!w->cv.wait_for(l, std::chrono::seconds(10), [&] { return w->done; })) return CU_LAUNCH_TIMEOUT;
  }
  return CU_OK;
}

void log(const char* fmt, ...) {
  std::fprintf(stderr, "cpemu: ");
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
}

}  // namespace cp_shim
