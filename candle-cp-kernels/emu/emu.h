// Host (CPU) emulation of the CUDA features the candle-cp kernels use, so that the real kernel
// source (kernels/*.cu, compiled as C++ with -DCP_HOST_EMU) runs under g++ without a GPU.
// Included by kernels/common.cuh after the CUDA headers; see emu.cpp for the scheduler and
// docs/gpu.md ("CPU emulation of the kernel source") for what this proves and what it cannot.
//
// Execution model: a launch runs its blocks one at a time; the threads of a block are fibers
// (user-level contexts, one per CUDA thread) scheduled cooperatively on one OS thread. A fiber
// runs until it reaches a block barrier or a warp-collective op; which fiber runs next is the
// Schedule (lockstep with alternating thread order, warps running ahead, seeded random), and when
// a cp.async lands is the Landing mode (both below; the harness runs every check under several
// combinations). Barriers are exact: when no thread can make
// progress the launch fails with the barrier sites and arrival counts (a deadlock or divergent
// barrier on hardware). Warp-collective ops (shuffles, votes, mma.sync, ldmatrix) run once all
// 32 lanes of the warp have arrived at an op of the same kind.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <functional>
#include <type_traits>
#include <vector_types.h>

#ifndef CP_HOST_EMU
#error "emu.h is for the host emulation build (-DCP_HOST_EMU) only"
#endif

// ---- CUDA keywords --------------------------------------------------------------------------
// The CUDA headers (host compile) define __device__/__global__/__host__/__shared__ as nothing
// and __forceinline__/__align__ as GCC attributes. Static __shared__ arrays become function-scope
// statics (one block runs at a time, so they are per block in effect); the kernels name them in
// CP_EMU_POISON(...) right after the declaration, which fills them with 0xFF bytes (NaN) once
// per block, before the first thread of the block writes them.
#undef __shared__
#define __shared__ static
// __launch_bounds__: in run.sh's preprocessing pass (-DCP_EMU_LB_SCAN) a marker that emu/lb.py
// turns into a cp_emu::launch_bounds call at the top of the entry's body; else nothing.
#undef __launch_bounds__
#ifdef CP_EMU_LB_SCAN
#define __launch_bounds__(...) CP_EMU_LB_MARK(__VA_ARGS__)
#else
#define __launch_bounds__(...)
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __global__
#define __global__
#endif
#ifndef __host__
#define __host__
#endif

using std::max;
using std::min;

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

namespace cp_emu {

// Fail the current launch (from inside a kernel thread): prints the message with the thread
// and block, abandons the block and marks the launch failed. Does not return to the caller.
[[noreturn]] void fail(const char* fmt, ...);

// Poison each array (0xFF bytes) the first time a thread of the current block gets here.
void poison_shared_once(void* p, size_t bytes);
template <typename... A> inline void poison_shared(A&... arrays) { (poison_shared_once((void*)&arrays, sizeof(arrays)), ...); }

// Dynamic shared memory of the current block (the launch's size, poisoned before each block).
unsigned char* dyn_smem();
// 32-bit shared-window address of a host pointer into shared memory (dynamic buffer or a
// static __shared__ array) and back; out-of-range addresses fail the launch.
uint32_t smem_addr(const void* p);
unsigned char* smem_ptr(uint32_t addr, uint32_t bytes);

// Block barrier (site recorded: two different __syncthreads() are a divergent barrier).
void syncthreads(const char* file, int line);

// Warp-collective ops. The calling lane posts its operands, waits until all 32 lanes of its
// warp posted the same op, and gets its result.
enum class WarpOp : int { Shfl, ShflXor, Any, Ballot, Sync, Mma16816Bf16, Mma16816F16, Ldsm4, Ldsm4T,
                          WgFence, WgMma, WgCommit, WgWait };
uint32_t warp_u32(WarpOp op, unsigned mask, uint32_t value, int arg);
void warp_mma16816(bool bf16, float* d, const uint32_t* a, uint32_t b0, uint32_t b1);
void warp_ldsm_x4(bool trans, uint32_t* r, uint32_t addr);

// Warpgroup-collective wgmma ops (sm_90a), run once all 128 threads of the warpgroup arrived:
// wgmma.fence, wgmma.mma_async m64nNk16 (f32 accumulate; A from shared memory by descriptor
// (K-major) or from registers `a` (4 per thread); B from shared memory by descriptor, K-major or
// MN-major with trans_b = 1; 128-byte swizzle descriptors only), commit_group and wait_group N.
// The product is deferred to the wait_group that retires its group (shared-memory operands read and
// D written then; its accumulator and A-fragment registers hold NaN bits in between, and a write to
// them in flight fails the launch), or done at issue when set_wgmma_at_issue(true): a kernel that
// touches D or A between issue and wait, or refills a stage a pending wgmma still reads, is wrong
// under one of the two. Shared-memory operands must be visible to the async proxy (fence_proxy_async).
void wg_fence();
void wg_mma(bool bf16, int n, float* d, const uint32_t* a, uint64_t da, uint64_t db, int scale_d, int trans_b);
void wg_commit();
void wg_wait(int n);
void set_wgmma_at_issue(bool at_issue);

// cp.async (16 bytes, .cg). When the copy writes its destination is the landing mode:
// AtWait: the destination is poisoned at issue and written at the cp.async.wait_group that
//   retires its group (all but the newest N committed groups of this thread): a read before the
//   wait (+ barrier) sees NaN.
// AtIssue: written at once when issued: a prefetch into a buffer another warp still reads (a
//   missing or misplaced barrier before the refill, write-after-read) overwrites that warp's data.
// Random: poisoned at issue; each 16-byte copy lands at a seeded random scheduling point between
//   its issue and the wait that retires it (log-uniform delay, in fiber switches), or at that wait.
enum class Landing { AtWait, AtIssue, Random };
void set_cp_async_landing(Landing l, uint64_t seed = 0);
Landing cp_async_landing();
void cp_async16(uint32_t dst, const void* src, bool valid);
void cp_async_commit();
void cp_async_wait(int n);
// fence.proxy.async.shared::cta: this thread's retired cp.async copies (and every plain shared-memory
// store so far) become visible to the async proxy (wgmma operands); see the async-proxy view in emu.cpp.
void fence_proxy_async();

// Thread scheduling between synchronization points. Lockstep: every ready thread once per round,
// block order alternating forward / reverse. WarpsAscending / WarpsDescending: one warp at a
// time runs as far as it can (up to a block barrier) before the next: the largest skew between
// warps, which exposes a missing barrier before a buffer is refilled (write-after-read).
// Random: seeded; repeatedly a random warp runs ahead a random (log-uniform) number of steps,
// a step being one turn of each of its ready lanes plus its warp op.
enum class Schedule { Lockstep, WarpsAscending, WarpsDescending, Random };
void set_schedule(Schedule s, uint64_t seed = 0);
Schedule schedule();

// Called by every thread at a kernel entry (the build inserts it after each entry's
// __launch_bounds__, see lb.py): the launch fails if the block has more threads than the bound.
void launch_bounds(const char* entry, int max_threads, int min_blocks = 0);
// Shared memory (dynamic + static) per block above the opt-in limit fails the launch:
// 227 KB (232,448 bytes, sm_90) for entries whose name contains "wgmma" (sm_90 only), else
// 163 KB (166,912 bytes, sm_80).
constexpr size_t SMEM_OPTIN_SM80 = 166912, SMEM_OPTIN_SM90 = 232448;

// Launch `body` (which calls the kernel entry point) on a grid of blocks. Returns false (and
// prints why) if a kernel thread failed: deadlock, divergent barrier, bad shared address,
// incomplete warp at a collective op, cp.async still pending at exit.
bool launch(const char* name, dim3 grid, dim3 block, size_t dyn_smem_bytes, const std::function<void()>& body);
// Global buffers the kernels may read through cp.async (bounds-checked when any is registered).
void track_global(const void* p, size_t bytes);
void untrack_global(const void* p);

}  // namespace cp_emu

// ---- CUDA intrinsics --------------------------------------------------------------------------
#define __syncthreads() ::cp_emu::syncthreads(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::cp_emu::warp_u32(::cp_emu::WarpOp::Sync, mask, 0, 0); }

template <typename T> inline T cp_emu_shfl(::cp_emu::WarpOp op, unsigned mask, T v, int arg) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = ::cp_emu::warp_u32(op, mask, u, arg);
  T r;
  std::memcpy(&r, &u, 4);
  return r;
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  (void)width;
  return cp_emu_shfl(::cp_emu::WarpOp::Shfl, mask, v, src);
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  (void)width;
  return cp_emu_shfl(::cp_emu::WarpOp::ShflXor, mask, v, lane_mask);
}
inline int __any_sync(unsigned mask, int pred) { return (int)::cp_emu::warp_u32(::cp_emu::WarpOp::Any, mask, pred != 0, 0); }
inline unsigned __ballot_sync(unsigned mask, int pred) { return ::cp_emu::warp_u32(::cp_emu::WarpOp::Ballot, mask, pred != 0, 0); }

inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
