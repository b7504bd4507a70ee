// Host CUDA shim, driver part: the libcuda (driver API) and libcudart entry points (device
// memory and copies: memory.cpp) that candle's
// CUDA backend and our launchers import, over host memory, with kernels run by the emulator
// (emu.h) from the registry (registry.h). Model and environment: shim.h. Rust callers: every
// `cuda_fwd` of candle-cp-ops / candle-cp-kernels and candle's own CUDA backend; the CPU
// references they are compared with are the CPU paths of the same ops (gpu_check, cuda tests).
//
// Environment: CPEMU_CC (90 or 80, default 90), CPEMU_DEVICES (default 1), CPEMU_SCHEDULE
// (lockstep | ascending | descending | random, default lockstep), CPEMU_WAIT_TIMEOUT_S (120),
// CPEMU_TRACE=1 (one line per launch with its time).
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "emu.h"
#include "registry.h"
#include "shim.h"
#include "tma_map.h"

namespace cp_shim {

void log(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "cpemu: %s\n", buf);
}

static int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

double wait_timeout_s() {
  static double t = [] {
    const char* v = std::getenv("CPEMU_WAIT_TIMEOUT_S");
    return v && *v ? std::atof(v) : 120.0;
  }();
  return t;
}
int device_count() {
  static int n = std::max(1, env_int("CPEMU_DEVICES", 1));
  return n;
}
int compute_capability() {
  static int cc = [] {
    const int c = env_int("CPEMU_CC", 90);
    return c == 80 || c == 86 ? c : 90;
  }();
  return cc;
}
// The emulated device's opt-in maximum of shared memory per block (sm_90: 232,448; sm_80:
// 166,912; sm_86, like sm_89 / sm_120: 101,376).
static int smem_optin() {
  const int cc = compute_capability();
  return (int)(cc == 90 ? cp_emu::SMEM_OPTIN_SM90 : cc == 86 ? cp_emu::SMEM_OPTIN_SM86 : cp_emu::SMEM_OPTIN_SM80);
}

std::mutex& launch_mutex() {
  static std::mutex m;  // the emulator runs one launch at a time
  return m;
}

// ---- streams and events -------------------------------------------------------------------------
struct Stream {
  std::mutex m;
  std::deque<WorkPtr> pending;
};
static Stream default_stream;
// nullptr, CU_STREAM_LEGACY (0x1) and CU_STREAM_PER_THREAD (0x2) are the default stream.
static Stream* stream_of(void* s) { return (uintptr_t)s > 2 ? static_cast<Stream*>(s) : &default_stream; }
static std::mutex streams_mutex;
static std::vector<Stream*> all_streams{&default_stream};

void stream_push(void* stream, WorkPtr w) {
  Stream* s = stream_of(stream);
  std::lock_guard<std::mutex> g(s->m);
  s->pending.push_back(std::move(w));
}

// Waits for every work in `ws` (bounded). Returns CU_OK or CU_LAUNCH_TIMEOUT.
static int wait_all(const std::vector<WorkPtr>& ws, const char* why) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_timeout_s());
  for (const WorkPtr& w : ws) {
    std::unique_lock<std::mutex> l(w->m);
    if (!w->cv.wait_until(l, deadline, [&] { return w->done; })) {
      log("%s: %s did not complete within %.0f s (CPEMU_WAIT_TIMEOUT_S): a peer never posted its part", why,
          w->what.c_str(), wait_timeout_s());
      return CU_LAUNCH_TIMEOUT;
    }
  }
  return CU_OK;
}

static std::vector<WorkPtr> snapshot(Stream* s) {
  std::lock_guard<std::mutex> g(s->m);
  while (!s->pending.empty() && s->pending.front()->is_done()) s->pending.pop_front();
  return {s->pending.begin(), s->pending.end()};
}

int stream_drain(void* stream) {
  Stream* s = stream_of(stream);
  const int r = wait_all(snapshot(s), "stream");
  if (r == CU_OK) snapshot(s);  // drop completed work
  return r;
}

struct Event {
  std::vector<WorkPtr> work;  // the stream's pending work when recorded
  std::chrono::steady_clock::time_point t{};
  bool recorded = false;
};

}  // namespace cp_shim

using namespace cp_shim;

// ---- contexts, modules, functions ---------------------------------------------------------------
namespace {
struct Ctx {
  int dev;
};
Ctx* primary_ctx(int dev) {
  static std::vector<Ctx> ctxs = [] {
    std::vector<Ctx> v(device_count());
    for (int i = 0; i < (int)v.size(); ++i) v[i].dev = i;
    return v;
  }();
  return &ctxs[dev];
}
thread_local Ctx* current = nullptr;
std::atomic<bool> initialized{false};
std::atomic<int> sticky{0};  // a failed launch poisons the "device", as an illegal address does

struct Func {
  std::string name;
  cp_emu::Thunk thunk;
  size_t n_params;
  int max_dyn_smem = 48 * 1024;
};
struct Module {
  std::mutex m;
  std::map<std::string, Func*> funcs;
};

bool trace() {
  static bool t = std::getenv("CPEMU_TRACE") && *std::getenv("CPEMU_TRACE") == '1';
  return t;
}

void setup_schedule() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* s = std::getenv("CPEMU_SCHEDULE");
    std::string v = s ? s : "lockstep";
    if (v == "ascending") cp_emu::set_schedule(cp_emu::Schedule::WarpsAscending);
    else if (v == "descending") cp_emu::set_schedule(cp_emu::Schedule::WarpsDescending);
    else if (v == "random") cp_emu::set_schedule(cp_emu::Schedule::Random, 1);
    else cp_emu::set_schedule(cp_emu::Schedule::Lockstep);
  });
}

}  // namespace

int cp_shim::ready() {
  if (!initialized) return CU_NOT_INITIALIZED;
  return sticky.load();
}

extern "C" {

typedef unsigned long long CUdeviceptr_t;

int cuInit(unsigned) {
  initialized = true;
  static std::once_flag once;
  std::call_once(once, [] {
    log("host CUDA shim: %d device(s), compute capability %d.%d, kernels run by the CPU emulator",
        device_count(), compute_capability() / 10, compute_capability() % 10);
  });
  return CU_OK;
}

int cuDriverGetVersion(int* v) {
  if (!v) return CU_INVALID_VALUE;
  *v = 13000;
  return CU_OK;
}

int cuDeviceGetCount(int* n) {
  if (!initialized) return CU_NOT_INITIALIZED;
  *n = device_count();
  return CU_OK;
}

int cuDeviceGet(int* dev, int ordinal) {
  if (!initialized) return CU_NOT_INITIALIZED;
  if (ordinal < 0 || ordinal >= device_count()) return CU_INVALID_DEVICE;
  *dev = ordinal;
  return CU_OK;
}

int cuDeviceGetName(char* name, int len, int dev) {
  if (dev < 0 || dev >= device_count()) return CU_INVALID_DEVICE;
  std::snprintf(name, (size_t)len, "candle-cp host CUDA shim (sm_%d)", compute_capability());
  return CU_OK;
}

int cuDeviceTotalMem_v2(size_t* bytes, int dev) {
  if (dev < 0 || dev >= device_count()) return CU_INVALID_DEVICE;
  *bytes = (size_t)16 << 30;
  return CU_OK;
}

int cuMemGetInfo_v2(size_t* free_b, size_t* total) {
  *free_b = (size_t)15 << 30;
  *total = (size_t)16 << 30;
  return CU_OK;
}

int cuDeviceGetAttribute(int* pi, int attrib, int dev) {
  if (!initialized) return CU_NOT_INITIALIZED;
  if (dev < 0 || dev >= device_count()) return CU_INVALID_DEVICE;
  const bool h = compute_capability() == 90;
  int v;
  switch (attrib) {
    case 1: v = 1024; break;                      // MAX_THREADS_PER_BLOCK
    case 2: v = 1024; break;                      // MAX_BLOCK_DIM_X
    case 3: v = 1024; break;                      // MAX_BLOCK_DIM_Y
    case 4: v = 64; break;                        // MAX_BLOCK_DIM_Z
    case 5: v = 2147483647; break;                // MAX_GRID_DIM_X
    case 6: v = 65535; break;                     // MAX_GRID_DIM_Y
    case 7: v = 65535; break;                     // MAX_GRID_DIM_Z
    case 8: v = 48 * 1024; break;                 // MAX_SHARED_MEMORY_PER_BLOCK
    case 10: v = 32; break;                       // WARP_SIZE
    case 12: v = 65536; break;                    // MAX_REGISTERS_PER_BLOCK
    case 13: v = h ? 1980000 : 1410000; break;    // CLOCK_RATE (kHz)
    case 16: v = h ? 132 : 108; break;            // MULTIPROCESSOR_COUNT
    case 39: v = 2048; break;                     // MAX_THREADS_PER_MULTIPROCESSOR
    case 41: v = 1; break;                        // UNIFIED_ADDRESSING
    case 75: v = compute_capability() / 10; break;  // COMPUTE_CAPABILITY_MAJOR
    case 76: v = compute_capability() % 10; break;  // COMPUTE_CAPABILITY_MINOR
    case 81: v = h ? 233472 : compute_capability() == 86 ? 102400 : 167936; break;  // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    case 82: v = 65536; break;                    // MAX_REGISTERS_PER_MULTIPROCESSOR
    case 97: v = smem_optin(); break;             // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    case 115: v = 0; break;                       // MEMORY_POOLS_SUPPORTED: plain cuMemAlloc
    default: v = 0; break;
  }
  *pi = v;
  return CU_OK;
}

int cuDevicePrimaryCtxRetain(void** pctx, int dev) {
  if (!initialized) return CU_NOT_INITIALIZED;
  if (dev < 0 || dev >= device_count()) return CU_INVALID_DEVICE;
  *pctx = primary_ctx(dev);
  return CU_OK;
}
int cuDevicePrimaryCtxRelease_v2(int dev) { return dev >= 0 && dev < device_count() ? CU_OK : CU_INVALID_DEVICE; }
int cuCtxDestroy_v2(void*) { return CU_OK; }
int cuCtxSetCurrent(void* ctx) {
  current = static_cast<Ctx*>(ctx);
  return CU_OK;
}
int cuCtxGetCurrent(void** pctx) {
  *pctx = current;
  return CU_OK;
}
int cuCtxPushCurrent_v2(void* ctx) { return cuCtxSetCurrent(ctx); }
int cuCtxPopCurrent_v2(void** pctx) {
  if (pctx) *pctx = current;
  return CU_OK;
}
int cuCtxGetDevice(int* dev) {
  if (!current) return CU_INVALID_CONTEXT;
  *dev = current->dev;
  return CU_OK;
}
int cuCtxSynchronize() {
  std::vector<Stream*> ss;
  {
    std::lock_guard<std::mutex> g(streams_mutex);
    ss = all_streams;
  }
  for (Stream* s : ss) {
    const int r = stream_drain(s == &default_stream ? nullptr : s);  // (stream_of maps nullptr back)
    if (r) return r;
  }
  return ready();
}

int cuGetErrorString(int e, const char** s) {
  switch (e) {
    case CU_OK: *s = "no error"; break;
    case CU_INVALID_VALUE: *s = "invalid argument"; break;
    case CU_OUT_OF_MEMORY: *s = "out of memory"; break;
    case CU_NOT_INITIALIZED: *s = "initialization error"; break;
    case CU_INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case CU_INVALID_CONTEXT: *s = "invalid device context"; break;
    case CU_INVALID_IMAGE: *s = "device kernel image is invalid"; break;
    case CU_INVALID_HANDLE: *s = "invalid resource handle"; break;
    case CU_NOT_FOUND: *s = "named symbol not found (host CUDA shim: kernel not emulated)"; break;
    case CU_NOT_READY: *s = "device not ready"; break;
    case CU_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered (host CUDA shim: emulated kernel failed)"; break;
    case CU_LAUNCH_OUT_OF_RESOURCES: *s = "too many resources requested for launch"; break;
    case CU_LAUNCH_TIMEOUT: *s = "the launch timed out and was terminated (host CUDA shim: bounded wait expired)"; break;
    case CU_NOT_SUPPORTED: *s = "operation not supported (host CUDA shim)"; break;
    default: *s = "unknown error"; return CU_INVALID_VALUE;
  }
  return CU_OK;
}
int cuGetErrorName(int e, const char** s) { return cuGetErrorString(e, s); }

// ---- streams and events ------------------------------------------------------------------------------
int cuStreamCreate(void** s, unsigned) {
  auto st = new Stream();
  {
    std::lock_guard<std::mutex> g(streams_mutex);
    all_streams.push_back(st);
  }
  *s = st;
  return CU_OK;
}
int cuStreamCreateWithPriority(void** s, unsigned f, int) { return cuStreamCreate(s, f); }
int cuStreamDestroy_v2(void* s) {
  if ((uintptr_t)s <= 2) return CU_INVALID_HANDLE;
  stream_drain(s);
  {
    std::lock_guard<std::mutex> g(streams_mutex);
    for (size_t i = 0; i < all_streams.size(); ++i)
      if (all_streams[i] == s) {
        all_streams.erase(all_streams.begin() + (long)i);
        break;
      }
  }
  delete static_cast<Stream*>(s);
  return CU_OK;
}
int cuStreamSynchronize(void* s) {
  if (int r = stream_drain(s)) return r;
  return ready();
}
int cuStreamQuery(void* s) {
  for (const WorkPtr& w : snapshot(stream_of(s)))
    if (!w->is_done()) return CU_NOT_READY;
  return ready();
}
int cuStreamIsCapturing(void*, int* status) {
  *status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  return CU_OK;
}
int cuEventCreate(void** e, unsigned) {
  *e = new Event();
  return CU_OK;
}
int cuEventDestroy_v2(void* e) {
  delete static_cast<Event*>(e);
  return CU_OK;
}
int cuEventRecord(void* e, void* s) {
  if (!e) return CU_INVALID_HANDLE;
  auto ev = static_cast<Event*>(e);
  ev->work = snapshot(stream_of(s));
  ev->t = std::chrono::steady_clock::now();
  ev->recorded = true;
  return CU_OK;
}
int cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
int cuEventQuery(void* e) {
  if (!e) return CU_INVALID_HANDLE;
  for (const WorkPtr& w : static_cast<Event*>(e)->work)
    if (!w->is_done()) return CU_NOT_READY;
  return ready();
}
int cuEventSynchronize(void* e) {
  if (!e) return CU_INVALID_HANDLE;
  if (int r = wait_all(static_cast<Event*>(e)->work, "cuEventSynchronize")) return r;
  return ready();
}
int cuEventElapsedTime(float* ms, void* a, void* b) {
  auto ea = static_cast<Event*>(a), eb = static_cast<Event*>(b);
  if (!ea || !eb || !ea->recorded || !eb->recorded) return CU_INVALID_HANDLE;
  *ms = std::chrono::duration<float, std::milli>(eb->t - ea->t).count();
  return CU_OK;
}
int cuStreamWaitEvent(void* s, void* e, unsigned) {
  if (!e) return CU_INVALID_HANDLE;
  (void)s;  // eager streams: waiting on the host orders everything `s` does next after the event
  return wait_all(static_cast<Event*>(e)->work, "cuStreamWaitEvent");
}

// ---- modules and launches ----------------------------------------------------------------------------
int cuModuleLoadData(void** m, const void* image) {
  if (int r = ready()) return r;
  if (!image) return CU_INVALID_VALUE;
  *m = new Module();
  return CU_OK;
}
int cuModuleLoadDataEx(void** m, const void* image, unsigned, void*, void*) { return cuModuleLoadData(m, image); }
int cuModuleLoad(void** m, const char* fname) {
  if (int r = ready()) return r;
  if (!fname) return CU_INVALID_VALUE;
  *m = new Module();
  return CU_OK;
}
int cuModuleUnload(void* m) {
  auto mod = static_cast<Module*>(m);
  if (!mod) return CU_INVALID_HANDLE;
  for (auto& kv : mod->funcs) delete kv.second;
  delete mod;
  return CU_OK;
}
int cuModuleGetFunction(void** f, void* m, const char* name) {
  auto mod = static_cast<Module*>(m);
  if (!mod || !name) return CU_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mod->m);
  auto it = mod->funcs.find(name);
  if (it == mod->funcs.end()) {
    size_t n = 0;
    cp_emu::Thunk t = cp_emu::find_kernel(name, &n);
    if (!t) {
      log("cuModuleGetFunction(%s): no such kernel in the shim (not compiled for emulation)", name);
      return CU_NOT_FOUND;
    }
    it = mod->funcs.emplace(name, new Func{name, t, n}).first;
  }
  *f = it->second;
  return CU_OK;
}
// TMA tensor maps (src/flash/tma.rs for the flash_fwd_wgmma_tma* entries): written in the emulator's
// encoding (emu/tma_map.h; the kernels' cp.async.bulk.tensor reads it), after the driver's checks
// (tiled mode, no interleave, OOB fill none / NaN, any L2 promotion). Element types: the driver's
// CU_TENSOR_MAP_DATA_TYPE_* values of 16-bit (FLOAT16 6, BFLOAT16 9, UINT16 1) and 32-bit (UINT32 2,
// INT32 3, FLOAT32 7) elements; swizzle 0..3 = none, 32, 64, 128 bytes.
int cuTensorMapEncodeTiled(void* map, int dtype, unsigned rank, void* addr, const unsigned long long* dims,
                           const unsigned long long* strides, const unsigned* box, const unsigned* elem_strides,
                           int interleave, int swizzle, int l2, int oob) {
  (void)l2;
  unsigned esize = 0;
  switch (dtype) {
    case 1: case 6: case 9: esize = 2; break;
    case 2: case 3: case 7: esize = 4; break;
    default: break;
  }
  const char* err = nullptr;
  if (!map || !addr || !dims || !box || !elem_strides || (rank > 1 && !strides)) err = "a null pointer argument";
  else if (esize == 0) err = "data type not modelled by the shim (16- and 32-bit types only)";
  else if (interleave != 0) err = "interleaved layouts are not modelled by the shim";
  else if (swizzle < 0 || swizzle > 3) err = "swizzle outside CU_TENSOR_MAP_SWIZZLE_NONE..128B";
  else if (oob != 0 && oob != 1) err = "OOB fill not NONE / NAN_REQUEST_ZERO_FMA";
  else if (oob == 1) err = "OOB fill NAN_REQUEST_ZERO_FMA is not modelled by the shim (zeros only)";
  else
    err = cp_tma::encode(map, esize, rank, addr, reinterpret_cast<const uint64_t*>(dims),
                         reinterpret_cast<const uint64_t*>(strides), box, elem_strides, swizzle ? 16u << swizzle : 0u);
  if (err) {
    log("cuTensorMapEncodeTiled: %s", err);
    return CU_INVALID_VALUE;
  }
  return CU_OK;
}

int cuFuncSetAttribute(void* f, int attrib, int value) {
  auto fn = static_cast<Func*>(f);
  if (!fn) return CU_INVALID_HANDLE;
  if (attrib == 8) {  // MAX_DYNAMIC_SHARED_SIZE_BYTES
    const int optin = smem_optin();
    if (value < 0 || value > optin) {
      log("cuFuncSetAttribute(%s, MAX_DYNAMIC_SHARED_SIZE_BYTES, %d): above the device's opt-in limit %d",
          fn->name.c_str(), value, optin);
      return CU_INVALID_VALUE;
    }
    fn->max_dyn_smem = value;
  }
  return CU_OK;
}
int cuFuncGetAttribute(int* v, int attrib, void* f) {
  auto fn = static_cast<Func*>(f);
  if (!fn) return CU_INVALID_HANDLE;
  switch (attrib) {
    case 0: *v = 1024; break;  // MAX_THREADS_PER_BLOCK
    case 8: *v = fn->max_dyn_smem; break;
    default: *v = 0;
  }
  return CU_OK;
}

int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned smem,
                   void* stream, void** params, void** extra) {
  if (int r = ready()) return r;
  auto fn = static_cast<Func*>(f);
  if (!fn) return CU_INVALID_HANDLE;
  if (extra) {
    log("cuLaunchKernel(%s): `extra` argument packing is not supported by the shim", fn->name.c_str());
    return CU_NOT_SUPPORTED;
  }
  const unsigned long threads = (unsigned long)bx * by * bz;
  if (!gx || !gy || !gz || !bx || !by || !bz || threads > 1024 || bz > 64 || gy > 65535 || gz > 65535) {
    log("cuLaunchKernel(%s): invalid configuration grid (%u,%u,%u) block (%u,%u,%u)", fn->name.c_str(), gx, gy, gz, bx, by,
        bz);
    return CU_INVALID_VALUE;
  }
  if ((int)smem > fn->max_dyn_smem) {
    log("cuLaunchKernel(%s): %u bytes of dynamic shared memory > the function's limit %d (set "
        "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first)",
        fn->name.c_str(), smem, fn->max_dyn_smem);
    return CU_INVALID_VALUE;
  }
  if (fn->n_params && !params) return CU_INVALID_VALUE;
  if (int r = stream_drain(stream)) return r;
  setup_schedule();
  std::lock_guard<std::mutex> g(launch_mutex());
  const auto t0 = std::chrono::steady_clock::now();
  const cp_emu::Thunk t = fn->thunk;
  // The emulated device's opt-in limit of shared memory per block: sm_90's / sm_86's on such a
  // device ("[sm_90]" / "[sm_86]" in the launch name, emu.h), else sm_80's (wgmma entries: sm_90's
  // whatever it is).
  const int cc = compute_capability();
  const std::string lname = fn->name + (cc == 90 ? " [sm_90]" : cc == 86 ? " [sm_86]" : "");
  const bool ok = cp_emu::launch(lname.c_str(), dim3(gx, gy, gz), dim3(bx, by, bz), smem, [&] { t(params); });
  if (trace())
    log("launch %s grid (%u,%u,%u) block (%u,%u,%u) smem %u: %s in %.1f ms", fn->name.c_str(), gx, gy, gz, bx, by, bz, smem,
        ok ? "ok" : "FAILED", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  if (!ok) {
    log("cuLaunchKernel(%s): the emulated kernel failed (see above); the context is now unusable, as after an "
        "illegal address on a GPU",
        fn->name.c_str());
    sticky = CU_ILLEGAL_ADDRESS;
    return CU_ILLEGAL_ADDRESS;
  }
  return CU_OK;
}

// ---- libcudart: candle links nvcc-compiled runtime-API kernels (MoE / GGUF) that register at
// start-up. Registration succeeds (nothing is kept); launching them is not supported.
static void* fatbin_handle = nullptr;
void** __cudaRegisterFatBinary(void*) { return &fatbin_handle; }
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char*, char*, const char*, int, void*, void*, void*, void*, int*) {}
void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}
unsigned __cudaPushCallConfiguration(dim3, dim3, size_t, void*) { return 0; }
int __cudaPopCallConfiguration(dim3*, dim3*, size_t*, void*) { return CU_NOT_SUPPORTED; }
int __cudaLaunchKernel_ptsz(const void*, dim3, dim3, void**, size_t, void*) {
  log("a runtime-API kernel (candle's MoE / GGUF kernels) was launched: not supported by the shim");
  return CU_NOT_SUPPORTED;
}
int __cudaGetKernel(void**, const void*) { return CU_NOT_SUPPORTED; }
int cudaFuncSetAttribute(const void*, int, int) { return CU_NOT_SUPPORTED; }
int cudaGetDevice(int* d) {
  *d = current ? current->dev : 0;
  return CU_OK;
}

}  // extern "C"
