// Host CUDA shim, device memory: allocations (guarded host memory, shim.h) and the driver's
// allocation, copy and memset entry points. Every copy / memset range must lie inside one live
// allocation (else CUDA_ERROR_INVALID_VALUE with a log line) and runs after the stream's pending
// work (stream order). Rust callers: cudarc's CudaSlice / CudaStream (candle's CUDA backend).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "emu.h"
#include "shim.h"

namespace cp_shim {

// ---- memory ------------------------------------------------------------------------------------
// A device allocation: whole pages plus one PROT_NONE page right after; the buffer starts 256-byte
// aligned as close to the guard page as alignment allows (cudaMalloc alignment is 256 bytes).
struct Alloc {
  unsigned char* base;
  size_t map_bytes;
  size_t bytes;
};
static std::mutex mem_mutex;
static std::map<uintptr_t, Alloc> allocs;  // by user address

void* dev_alloc(size_t bytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t n = std::max<size_t>(bytes, 1);
  const size_t data_pages = (n + 255 + page - 1) / page;
  const size_t map_bytes = (data_pages + 1) * page;
  void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  auto base = static_cast<unsigned char*>(m);
  mprotect(base + data_pages * page, page, PROT_NONE);
  unsigned char* user = base + ((data_pages * page - n) & ~(size_t)255);
  std::memset(user, 0xff, n);  // device memory is not zeroed: poison (NaN for floats)
  {
    std::lock_guard<std::mutex> g(mem_mutex);
    allocs[(uintptr_t)user] = Alloc{base, map_bytes, n};
  }
  {
    std::lock_guard<std::mutex> g(launch_mutex());
    cp_emu::track_global(user, n);
  }
  return user;
}

void dev_free(void* p) {
  if (!p) return;
  Alloc a;
  {
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = allocs.find((uintptr_t)p);
    if (it == allocs.end()) {
      log("free of %p: not an allocation of the shim", p);
      return;
    }
    a = it->second;
    allocs.erase(it);
  }
  {
    std::lock_guard<std::mutex> g(launch_mutex());
    cp_emu::untrack_global(p);
  }
  munmap(a.base, a.map_bytes);
}

// Whether [p, p + n) lies inside one live allocation.
bool dev_range_ok(uintptr_t p, size_t n) {
  std::lock_guard<std::mutex> g(mem_mutex);
  auto it = allocs.upper_bound(p);
  if (it == allocs.begin()) return false;
  --it;
  return p >= it->first && p + n <= it->first + it->second.bytes;
}

}  // namespace cp_shim

using namespace cp_shim;

extern "C" {

typedef unsigned long long CUdeviceptr_t;

// ---- memory ---------------------------------------------------------------------------------------
int cuMemAlloc_v2(CUdeviceptr_t* p, size_t bytes) {
  if (int r = ready()) return r;
  void* m = dev_alloc(bytes);
  if (!m) return CU_OUT_OF_MEMORY;
  *p = (CUdeviceptr_t)(uintptr_t)m;
  return CU_OK;
}
int cuMemAllocAsync(CUdeviceptr_t* p, size_t bytes, void* stream) {
  if (int r = stream_drain(stream)) return r;
  return cuMemAlloc_v2(p, bytes);
}
int cuMemFree_v2(CUdeviceptr_t p) {
  dev_free((void*)(uintptr_t)p);
  return CU_OK;
}
int cuMemFreeAsync(CUdeviceptr_t p, void* stream) {
  if (int r = stream_drain(stream)) return r;
  return cuMemFree_v2(p);
}
int cuMemAllocHost_v2(void** p, size_t bytes) {
  *p = std::malloc(std::max<size_t>(bytes, 1));
  return *p ? CU_OK : CU_OUT_OF_MEMORY;
}
int cuMemHostAlloc(void** p, size_t bytes, unsigned) { return cuMemAllocHost_v2(p, bytes); }
int cuMemFreeHost(void* p) {
  std::free(p);
  return CU_OK;
}

static int check_dev(CUdeviceptr_t p, size_t n, const char* what) {
  if (n == 0) return CU_OK;
  if (!dev_range_ok((uintptr_t)p, n)) {
    log("%s: device range [0x%llx, +%zu bytes) is not inside one live allocation", what, p, n);
    return CU_INVALID_VALUE;
  }
  return CU_OK;
}

int cuMemcpyHtoDAsync_v2(CUdeviceptr_t dst, const void* src, size_t n, void* stream) {
  if (int r = ready()) return r;
  if (int r = check_dev(dst, n, "cuMemcpyHtoDAsync")) return r;
  if (int r = stream_drain(stream)) return r;
  std::memcpy((void*)(uintptr_t)dst, src, n);
  return CU_OK;
}
int cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr_t src, size_t n, void* stream) {
  if (int r = ready()) return r;
  if (int r = check_dev(src, n, "cuMemcpyDtoHAsync")) return r;
  if (int r = stream_drain(stream)) return r;
  std::memcpy(dst, (const void*)(uintptr_t)src, n);
  return CU_OK;
}
int cuMemcpyDtoDAsync_v2(CUdeviceptr_t dst, CUdeviceptr_t src, size_t n, void* stream) {
  if (int r = ready()) return r;
  if (int r = check_dev(dst, n, "cuMemcpyDtoDAsync (dst)")) return r;
  if (int r = check_dev(src, n, "cuMemcpyDtoDAsync (src)")) return r;
  if (int r = stream_drain(stream)) return r;
  std::memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
  return CU_OK;
}
int cuMemcpyPeerAsync(CUdeviceptr_t dst, void*, CUdeviceptr_t src, void*, size_t n, void* stream) {
  return cuMemcpyDtoDAsync_v2(dst, src, n, stream);
}
int cuMemcpyHtoD_v2(CUdeviceptr_t dst, const void* src, size_t n) { return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr); }
int cuMemcpyDtoH_v2(void* dst, CUdeviceptr_t src, size_t n) { return cuMemcpyDtoHAsync_v2(dst, src, n, nullptr); }
int cuMemcpyDtoD_v2(CUdeviceptr_t dst, CUdeviceptr_t src, size_t n) { return cuMemcpyDtoDAsync_v2(dst, src, n, nullptr); }
int cuMemsetD8Async(CUdeviceptr_t dst, unsigned char v, size_t n, void* stream) {
  if (int r = ready()) return r;
  if (int r = check_dev(dst, n, "cuMemsetD8Async")) return r;
  if (int r = stream_drain(stream)) return r;
  std::memset((void*)(uintptr_t)dst, v, n);
  return CU_OK;
}
int cuMemsetD32Async(CUdeviceptr_t dst, unsigned v, size_t n, void* stream) {
  if (int r = ready()) return r;
  if (int r = check_dev(dst, n * 4, "cuMemsetD32Async")) return r;
  if (int r = stream_drain(stream)) return r;
  auto p = (unsigned*)(uintptr_t)dst;
  for (size_t i = 0; i < n; ++i) p[i] = v;
  return CU_OK;
}
int cuMemsetD8_v2(CUdeviceptr_t dst, unsigned char v, size_t n) { return cuMemsetD8Async(dst, v, n, nullptr); }

}  // extern "C"
