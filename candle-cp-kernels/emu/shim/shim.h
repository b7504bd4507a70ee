// Internal interface of the host CUDA shim (emu/shim/): a CPU stand-in for libcuda, libcudart,
// libcublas, libcurand and libnccl that runs the candle-cp CUDA path (Rust launchers, candle's
// CUDA backend, our kernels and candle's kernels compiled as host C++ under the emulator,
// NcclGroup) without a GPU. See docs/gpu.md ("The host CUDA shim") for what it proves.
//
// Model:
// - Device memory is host memory: a CUdeviceptr is a host address (guarded allocations, so a
//   kernel reading past a buffer faults). Every "device" of the shim shares it.
// - Streams are executed eagerly: a kernel launch, memset or memcpy runs to completion in the
//   calling thread before the call returns, after the stream's pending asynchronous work (below)
//   has completed (stream order).
// - Asynchronous work (NCCL operations) is a `Work` appended to a stream: it completes when its
//   peers have posted theirs (the last rank to post performs the data movement). Events recorded
//   on a stream capture the stream's pending work; querying / waiting on an event or stream
//   waits for exactly that work. Waits that block the host (a launch behind pending NCCL work,
//   cuStreamSynchronize, cuEventSynchronize, cuStreamWaitEvent) give up after
//   CPEMU_WAIT_TIMEOUT_S seconds (default 120) with an error instead of hanging.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cp_shim {

// Driver result codes used by the shim (values of CUresult).
enum : int {
  CU_OK = 0,
  CU_INVALID_VALUE = 1,
  CU_OUT_OF_MEMORY = 2,
  CU_NOT_INITIALIZED = 3,
  CU_INVALID_DEVICE = 101,
  CU_INVALID_CONTEXT = 201,
  CU_INVALID_IMAGE = 200,
  CU_INVALID_HANDLE = 400,
  CU_NOT_FOUND = 500,
  CU_NOT_READY = 600,
  CU_ILLEGAL_ADDRESS = 700,
  CU_LAUNCH_OUT_OF_RESOURCES = 701,
  CU_LAUNCH_TIMEOUT = 702,
  CU_NOT_SUPPORTED = 801,
  CU_UNKNOWN = 999,
};

// One asynchronous operation (an NCCL collective or send/recv of one rank).
struct Work {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  int status = 0;  // 0 = success; else an error code of the library that created it
  std::string what;  // for timeout messages, e.g. "ncclAllReduce rank 1 of 4 (comm 0x...)"
  void complete(int st) {
    {
      std::lock_guard<std::mutex> g(m);
      if (done) return;
      done = true;
      status = st;
    }
    cv.notify_all();
  }
  bool is_done() {
    std::lock_guard<std::mutex> g(m);
    return done;
  }
};
using WorkPtr = std::shared_ptr<Work>;

// Appends `w` to the pending work of `stream` (a CUstream handle; nullptr = the legacy default
// stream). Thread-safe. Called by nccl.cpp for every operation it enqueues.
void stream_push(void* stream, WorkPtr w);
// Waits (bounded, see above) until every pending work of `stream` has completed. Returns
// CU_OK, or CU_LAUNCH_TIMEOUT after printing which work did not complete. Work that completed
// with an error status leaves the stream usable (the library reports its own errors).
int stream_drain(void* stream);

// Seconds a host-blocking wait may last (CPEMU_WAIT_TIMEOUT_S, default 120).
double wait_timeout_s();

// The number of devices the shim reports (CPEMU_DEVICES, default 1) and the compute capability
// (CPEMU_CC, "90" default, or "80"), for libraries that need them.
int device_count();
int compute_capability();

// Guarded host allocation backing device memory (a PROT_NONE page right after the buffer;
// memory.cpp). dev_range_ok: whether [p, p + n) lies inside one live allocation.
void* dev_alloc(size_t bytes);
void dev_free(void* p);
bool dev_range_ok(uintptr_t p, size_t n);

// CU_OK once cuInit ran and no launch failed; else CU_NOT_INITIALIZED or the sticky launch error.
int ready();
// Held while the emulator runs a launch (one at a time) or its tracked-buffer list changes.
std::mutex& launch_mutex();

// The shim's diagnostic log (stderr, prefixed "cpemu: "). printf-style.
void log(const char* fmt, ...);

}  // namespace cp_shim
