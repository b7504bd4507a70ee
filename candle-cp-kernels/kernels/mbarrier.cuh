// Hopper (sm_90) CTA-level synchronisation for warp-specialized kernels: mbarriers in shared
// memory (init, arrive, cp.async-tracked arrive, phase-parity wait), named barriers 1..15
// (bar.sync / bar.arrive) and warpgroup register reallocation (setmaxnreg). Include only from
// files compiled with -arch=compute_90a (setmaxnreg needs sm_90a; try_wait and the .release /
// .acquire qualifiers need sm_90).
//
// Under CP_HOST_EMU (candle-cp-kernels/emu) each wrapper has a host implementation (emu.h,
// "mbarriers, named barriers, setmaxnreg"): mbarrier phases are exact (a wait blocks the thread
// until the phase with its parity has completed; a deadlock fails the launch), a
// cp.async-tracked arrival fires when the thread's earlier copies land (per landing mode), and
// wgmma still needs a fence.proxy.async between the copies landing and the wgmma (see emu.h).
//
// The usual ring (stage s, use u = it / STAGES, so the parity of use u is u & 1):
//   init (one thread): cp_mbar_init(&full[s], P); cp_mbar_init(&empty[s], C); cp_mbar_init_fence();
//   __syncthreads();
//   producer thread:   cp_mbar_wait(&empty[s], (u & 1) ^ 1);  // the first use passes at once
//                      cp_async16(...) ...; cp_mbar_arrive_cp_async(&full[s]);
//   consumer thread:   cp_mbar_wait(&full[s], u & 1); fence_proxy_async(); read / wgmma ...;
//                      cp_mbar_arrive(&empty[s]);   // after the last read (wgmma retired)
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#error "mbarrier.cuh uses mbarrier.try_wait (sm_90) and setmaxnreg (sm_90a): compile with -arch=compute_90a"
#endif

// Initialise the mbarrier at `bar` (64-bit, 8-byte aligned, in shared memory) for `count`
// arrivals per phase (1 .. 2^20 - 1); phase 0 in progress. One thread; publish with
// cp_mbar_init_fence() and a __syncthreads() before any other thread uses it.
__device__ __forceinline__ void cp_mbar_init(uint64_t* bar, uint32_t count) {
#ifdef CP_HOST_EMU
  cp_emu::mbar_init(bar, count);
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(cp_smem_u32(bar)), "r"(count) : "memory");
#endif
}

// Makes this thread's earlier mbarrier inits visible (to the async proxy and the cluster).
__device__ __forceinline__ void cp_mbar_init_fence() {
#ifdef CP_HOST_EMU
  cp_emu::mbar_init_fence();
#else
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival on the current phase, release semantics at CTA scope (this thread's earlier
// shared-memory writes are visible to a thread whose wait observes the phase completion).
__device__ __forceinline__ void cp_mbar_arrive(uint64_t* bar) {
#ifdef CP_HOST_EMU
  cp_emu::mbar_arrive(bar);
#else
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(cp_smem_u32(bar)) : "memory");
#endif
}

// One arrival (counted in the init count: .noinc) that happens once every cp.async this thread
// issued before it has completed; the thread does not wait for the copies.
__device__ __forceinline__ void cp_mbar_arrive_cp_async(uint64_t* bar) {
#ifdef CP_HOST_EMU
  cp_emu::mbar_arrive_cp_async(bar);
#else
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(cp_smem_u32(bar)) : "memory");
#endif
}

// Blocks until the phase with parity `parity` (0 or 1) has completed, i.e. while the current
// phase has that parity; acquire semantics at CTA scope. A fresh barrier (phase 0 in progress)
// passes parity 1 at once.
__device__ __forceinline__ void cp_mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef CP_HOST_EMU
  cp_emu::mbar_wait(bar, parity);
#else
  const uint32_t addr = cp_smem_u32(bar);
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// Named barrier `id` (1..15; 0 is __syncthreads') for `nthreads` threads (a multiple of 32,
// whole warps): sync arrives and waits for the barrier to complete, arrive only counts.
__device__ __forceinline__ void cp_named_bar_sync(int id, int nthreads) {
#ifdef CP_HOST_EMU
  cp_emu::named_bar_sync(id, nthreads);
#else
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
#endif
}
__device__ __forceinline__ void cp_named_bar_arrive(int id, int nthreads) {
#ifdef CP_HOST_EMU
  cp_emu::named_bar_arrive(id, nthreads);
#else
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
#endif
}

// Per-thread register budget of the calling warpgroup raised (inc) / lowered (dec) to R
// (a multiple of 8 in [24, 256]); all 128 threads of the warpgroup execute the same one.
// inc blocks until the block's register pool has R per thread free for the warpgroup.
template <int R> __device__ __forceinline__ void cp_setmaxnreg_inc() {
  static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg: R must be a multiple of 8 in [24, 256]");
#ifdef CP_HOST_EMU
  cp_emu::setmaxnreg(true, R);
#else
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}
template <int R> __device__ __forceinline__ void cp_setmaxnreg_dec() {
  static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg: R must be a multiple of 8 in [24, 256]");
#ifdef CP_HOST_EMU
  cp_emu::setmaxnreg(false, R);
#else
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}
