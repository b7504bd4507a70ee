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
// 32 lanes of the warp have arrived at an op of the same kind. A thread waiting on an mbarrier
// phase or a named barrier (sm_90 warp specialization, below) is blocked, not spinning: no
// schedule runs it until an arrival completes what it waits for.
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
enum class WarpOp : int { Shfl, ShflXor, Any, Ballot, Sync, Mma16816Bf16, Mma16816F16, Ldsm4, Ldsm4T, Stsm4, Stsm4T, Sts,
                          WgFence, WgMma, WgCommit, WgWait, SetMaxNReg };
uint32_t warp_u32(WarpOp op, unsigned mask, uint32_t value, int arg);
void warp_mma16816(bool bf16, float* d, const uint32_t* a, uint32_t b0, uint32_t b1);
void warp_ldsm_x4(bool trans, uint32_t* r, uint32_t addr);
// stmatrix .m8n8 .x4 (.trans) .b16 (sm_90, cp_stsm_x4_trans in wgmma.cuh): the inverse of ldmatrix;
// fails the launch on a bank conflict or on two rows of one matrix at the same address.
void warp_stsm_x4(bool trans, const uint32_t* r, uint32_t addr);
// Shared store of `bytes` (2, 4 or 8) bytes from words[] at `addr` by every lane of the warp
// (cp_sts_cf): fails the launch on a bank conflict in a phase of the request (see common.cuh).
void warp_sts(uint32_t addr, const uint32_t* words, int bytes);

// wgmma ops (sm_90a): wgmma.fence, wgmma.mma_async m64nNk16 (f32 accumulate; A from shared memory
// by descriptor (K-major) or from registers `a` (4 per thread); B from shared memory by descriptor,
// K-major or MN-major with trans_b = 1; 128-byte swizzle descriptors only), commit_group and
// wait_group N. Each is warp-synchronous, as in the PTX ISA (.sync waits for the issuing WARP's lanes;
// .aligned: every warp of the warpgroup executes the same sequence, with uniform descriptors): a warp
// runs on after issuing its part and commits / waits on its own groups; a wait_group blocks until
// every warp of the warpgroup issued the wgmma it retires. The product is computed once all four warps
// issued it: at the last issue when set_wgmma_at_issue(true), else (deferred) at the first wait_group
// that retires it. Accumulator and A-fragment registers of a wgmma hold NaN bits from its warp's
// issue to that warp's retiring wait_group (a write to them in flight fails the launch): a kernel that
// touches D or A between issue and wait, or refills a stage a pending wgmma still reads, is wrong
// under one of the two modes. Shared-memory operands must be visible to the async proxy
// (fence_proxy_async) and must not change in the async-proxy view between the FIRST warp's issue
// and the reads (the product, and every warp's retiring wait_group): the emulator snapshots the
// bytes the descriptors address at the first issue; a difference fails the launch naming the
// wgmma's file:line, the operand and the shared offset (a store by another warp without a barrier
// before the wgmma, RAW across warps, or a refill while it may still read, WAR).
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
// fence.proxy.async.shared::cta: this thread's retired cp.async copies, the landed copies handed to it
// by the mbarrier phases it waited for (below), and every plain shared-memory store so far become
// visible to the async proxy (wgmma operands); see the async-proxy view in emu.cpp.
void fence_proxy_async();

// ---- mbarriers, named barriers, setmaxnreg (sm_90; kernels/mbarrier.cuh) ----------------------
// mbarrier (PTX mbarrier.*; `bar` points into shared memory, 8-byte aligned): state kept in a side
// table keyed by its shared offset (count, pending arrivals, completed phases); mbar_init also writes
// a signature into the 8 bytes, and every later use fails the launch if they changed (a plain store
// or cp.async into the barrier). Failing the launch, naming the barrier's shared offset: use before
// mbarrier.init in this block; use by another thread before a __syncthreads() that follows the init
// (the init is published by the block barrier; fence.mbarrier_init is accepted and not required at
// CTA scope); re-init while a thread waits on it or a cp.async arrival on it is in flight; count 0;
// a wait parity other than 0 / 1.
// Arrival: pending - 1; at 0 the phase completes (the completed-phase count goes up, pending =
// count) and the threads waiting for that parity become runnable. mbar_wait(parity) returns at once
// if the current phase's parity differs from `parity` (the phase with that parity completed: a fresh
// barrier passes parity 1), else the thread blocks (no spinning) and re-checks when a phase
// completes, exactly like the try_wait loop (two phases completing before it runs again leave it
// blocked, as on hardware). A launch where no thread can move fails and lists the waits. Every
// mbarrier and named-barrier op is a scheduling point (the thread yields and stays runnable), so
// under lockstep a producer hands over one stage per turn rather than running ahead to its next
// blocking wait.
// cp.async.mbarrier.arrive.noinc: one arrival (counted in the init count) that fires once all the
// thread's copies issued before it landed. AtIssue: at once. AtWait: as late as possible: when some
// thread waits on that barrier and would otherwise block (the copies land, then the arrival), or
// when nothing else can move. Random: at a seeded random later scheduling point (its copies land
// then if they have not). Copies covered by such an arrival count as retired at thread exit (a thread
// may exit with them in flight); copies neither waited for nor covered still fail the launch.
// Async proxy: wgmma reading cp.async data needs a fence.proxy.async between the copies landing and
// the wgmma in the chain of synchronisation (PTX memory model: cp.async writes are generic-proxy
// weak writes, wgmma operand reads are async-proxy). The emulator accepts either (a) the producer:
// cp.async.wait_group, fence.proxy.async, then mbar_arrive; or (b) the consumer: mbar_wait (of the
// phase the copies' arrivals completed; plain arrivals hand over the arriver's retired, unfenced
// copies) followed by its own fence.proxy.async before the wgmma. Without either the wgmma fails the
// launch. (FlashAttention-3's paged-KV cp.async path relies on the mbarrier alone; the ISA does not
// promise that, so the emulator rejects it.)
void mbar_init(const void* bar, uint32_t count);
void mbar_init_fence();
void mbar_arrive(const void* bar);
void mbar_arrive_cp_async(const void* bar);
void mbar_wait(const void* bar, uint32_t parity);
// TMA (kernels/tma.cuh; cp.async.bulk.tensor tile loads into shared memory, completed on an
// mbarrier's transaction count). mbar_arrive_expect_tx: the barrier's transaction count goes up by
// `bytes`, then one arrival; a phase completes once its arrivals are in AND its transaction count is
// back to 0 (loads landing complete their bytes, and may do so before the expect_tx). tma_load: one
// thread loads the box of a tensor map (emu/tma_map.h's encoding, as the shim's
// cuTensorMapEncodeTiled writes it; rank <= 4 here) at coordinates c0..c3 into dynamic shared memory
// at `dst`, with the hardware's swizzle on the shared address (128 B: 16-byte chunk bits 4-6 XOR
// address bits 7-9) and zeros out of bounds, then completes box bytes on `bar`. Landing as for
// cp.async arrivals: AtIssue at once; AtWait when a thread waiting on `bar` would block (or nothing
// else can move); Random at a seeded later scheduling point. Until it lands the destination reads
// as 0xFF bytes in both the generic and the async-proxy view; when it lands both views get the data
// (TMA writes through the async proxy: no fence.proxy.async needed before a wgmma, and a refill
// while a wgmma may still read the stage changes its operands, which fails the launch). Failing the
// launch: not a map from tma_map.h, dst not 128-byte aligned (1024 with the 128-byte swizzle, so the
// pattern follows wgmma.cuh's canonical layout), dst outside dynamic shared memory, a swizzled box
// whose inner extent is not the swizzle span, a read outside every tracked global buffer, `bar` not
// an initialised mbarrier.
void mbar_arrive_expect_tx(const void* bar, uint32_t bytes);
void tma_load(uint32_t dst, const unsigned long long* map, int c0, int c1, int c2, int c3, const void* bar);
// prefetch.tensormap: no effect; fails the launch if `map` is not a tensor map from tma_map.h.
void tma_prefetch_map(const unsigned long long* map);
// TMA reduction (cp.reduce.async.bulk.tensor .add, f32 maps; with a swizzle, box element e is read
// from the swizzled address as a load would have written it, src aligned as for loads) and bulk async-groups
// (cp.async.bulk.commit_group / wait_group.read): tma_reduce_add joins the calling thread's open
// bulk group; at issue its source [src, src + box bytes) must be visible to the async proxy (the
// writers' fence.proxy.async before the barrier that precedes the issue) and is snapshotted;
// bulk_wait_read(n) retires all but the newest n committed groups: each retired reduction fails the
// launch if its source was rewritten since the issue, else adds the snapshot into global memory
// (elements outside the tensor skipped; global bounds checked). A thread that exits with a bulk
// operation not retired fails the launch.
void tma_reduce_add(const unsigned long long* map, int c0, int c1, int c2, int c3, uint32_t src);
void bulk_commit();
void bulk_wait_read(int n);
// Named barriers (bar.sync / bar.arrive id, n): id 1..15 (id 0 is __syncthreads' barrier: bar.sync
// 0 with n = block size acts as __syncthreads, anything else on 0 fails); n a multiple of 32 in
// [32, block size]. The barrier completes when n threads arrived (sync waits for that, arrive
// does not) and then resets. Failing the launch: id or n out of range, a thread arriving with a
// different n than the others of the current phase, a phase completing with a warp only partly
// arrived (bar is .aligned: the emulator counts threads but requires whole warps).
void named_bar_sync(int id, int nthreads);
void named_bar_arrive(int id, int nthreads);
// setmaxnreg.{inc,dec}.sync.aligned.u32 R: warpgroup-collective (all 128 threads, same direction and
// R, else the launch fails or deadlocks); R a multiple of 8 in [24, 256]; block size a multiple of
// 128. Register accounting when the entry has __launch_bounds__(T, B): each thread starts with
// floor(65536 / (T * max(B, 1)) / 8) * 8 registers (at most 256; what ptxas assigns an entry that
// uses setmaxnreg), the block's pool is that times the block size; inc below / dec above the
// warpgroup's current count fails; an inc that would take the block over its pool waits (for a dec
// of another warpgroup), a deadlock if none comes. Whether the code fits in R registers is not
// modelled (ptxas -v on the real build).
void setmaxnreg(bool inc, int regs);

// Thread scheduling between synchronization points. Lockstep: every ready thread once per round,
// block order alternating forward / reverse. WarpsAscending / WarpsDescending: one warp at a
// time runs as far as it can (up to a block barrier) before the next: the largest skew between
// warps, which exposes a missing barrier before a buffer is refilled (write-after-read).
// Random: seeded; repeatedly a random warp runs ahead a random (log-uniform) number of steps,
// a step being one turn of each of its ready lanes plus its warp op (cut short by an mbarrier
// arrival). Warp specialization (mbarriers, named barriers): under WarpsAscending / Descending a
// warp that arrives on an mbarrier, or wakes another warp's thread at a named barrier, pauses
// there until no other warp can move; then the paused warps resume one at a time, the highest
// (ascending) / lowest (descending) first. Ascending thus keeps a producer in warpgroup 0 one
// hand-over ahead of its consumers (a consumer skipping a wait reads a stage not filled or
// fenced yet); descending keeps the consumers behind it (a refill skipping the empty wait hits a
// stage still in use).
enum class Schedule { Lockstep, WarpsAscending, WarpsDescending, Random };
void set_schedule(Schedule s, uint64_t seed = 0);
Schedule schedule();

// Called by every thread at a kernel entry (the build inserts it after each entry's
// __launch_bounds__, see lb.py): the launch fails if the block has more threads than the bound.
void launch_bounds(const char* entry, int max_threads, int min_blocks = 0);
// Shared memory (dynamic + static) per block above the opt-in limit fails the launch:
// 227 KB (232,448 bytes, sm_90) for launches whose name contains "wgmma" (sm_90 only) or
// "[sm_90]" (a launch the Rust side makes on Hopper only, e.g. the pipelined backward at head
// dim 256), 99 KB (101,376 bytes: sm_86 / sm_89 / sm_120) for "[sm_86]" (the host CUDA shim's
// emulated sm_86 device), else 163 KB (166,912 bytes, sm_80).
constexpr size_t SMEM_OPTIN_SM80 = 166912, SMEM_OPTIN_SM90 = 232448, SMEM_OPTIN_SM86 = 101376;

// Launch `body` (which calls the kernel entry point) on a grid of blocks. Returns false (and
// prints why) if a kernel thread failed: deadlock, divergent barrier, bad shared address,
// incomplete warp at a collective op, cp.async still pending at exit, mbarrier / named-barrier /
// setmaxnreg misuse (above). A deadlock report lists the blocked waits.
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
inline float __log2f(float x) { return std::log2(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
