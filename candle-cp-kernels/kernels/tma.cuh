// Hopper (sm_90) tensor memory accelerator (TMA): tile loads from global to shared memory described
// by a tensor map (CUtensorMap, made on the host by cuTensorMapEncodeTiled) and completed on an
// mbarrier through its transaction count. Include only from files compiled with -arch=compute_90a.
// Used by the TMA entries of kernels/flash_fwd_sm90_ws.cu (`flash_fwd_wgmma_tma_*`, launcher
// src/flash/sm90_ws.rs, which encodes the maps in src/flash/tma.rs).
//
// Under CP_HOST_EMU (candle-cp-kernels/emu) the map holds the emulator's own encoding
// (emu/tma_map.h, written by its cuTensorMapEncodeTiled) and each wrapper has a host implementation
// (emu.h, "TMA"): the load lands (per landing mode) into shared memory with the 128-byte swizzle of
// the hardware, zero-filled out of bounds, visible to the async proxy, then completes its bytes on
// the mbarrier.
//
// Protocol of one stage (one elected producer thread; the consumers as with cp.async stages):
//   producer: cp_mbar_wait(&empty[s], ...); cp_mbar_arrive_expect_tx(&full[s], BYTES);
//             cp_tma_load_4d(dst, &map, c0, c1, c2, c3, &full[s]) ...;  // BYTES in all
//   consumer: cp_mbar_wait(&full[s], parity); wgmma reading the stage ...;
// full[s] is initialised with count 1: its phase completes once the arrival is in and every byte
// the arrival announced has landed. TMA writes through the async proxy, so the consumers need no
// fence.proxy.async before their wgmma.
#pragma once
#include "mbarrier.cuh"

// A tensor map as a kernel parameter (`const __grid_constant__ CpTmaMap`): CUtensorMap's 128 bytes,
// 64-byte aligned. The device code only takes its address.
struct alignas(64) CpTmaMap {
  unsigned long long opaque[16];
};

#ifdef CP_HOST_EMU
#define CP_GRID_CONSTANT
#else
#define CP_GRID_CONSTANT __grid_constant__
#endif

// One arrival on `bar` that also adds `bytes` to its transaction count: the phase completes once
// the arrivals are in and that many bytes (of TMA loads naming `bar`) have landed.
__device__ __forceinline__ void cp_mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef CP_HOST_EMU
  cp_emu::mbar_arrive_expect_tx(bar, bytes);
#else
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(cp_smem_u32(bar)), "r"(bytes)
               : "memory");
#endif
}

// Prefetches the tensor map `map` (a kernel-parameter address) into the cache the TMA unit reads its
// descriptors from, so the first load does not wait for it (FlashAttention-3 / CUTLASS do this once
// per kernel in the producer). No effect on results.
__device__ __forceinline__ void cp_tma_prefetch_map(const CpTmaMap* map) {
#ifdef CP_HOST_EMU
  cp_emu::tma_prefetch_map(map->opaque);
#else
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

// Loads the box of `map` at element coordinates (c0 innermost, .., c3) into shared memory at `dst`
// (128-byte aligned; 1024 for the 128-byte swizzle to follow the layout of wgmma.cuh) and completes
// its bytes on `bar`. Out-of-bounds elements are filled with zeros. Issued by one thread.
__device__ __forceinline__ void cp_tma_load_4d(uint32_t dst, const CpTmaMap* map, int c0, int c1, int c2, int c3,
                                               uint64_t* bar) {
#ifdef CP_HOST_EMU
  cp_emu::tma_load(dst, map->opaque, c0, c1, c2, c3, bar);
#else
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(cp_smem_u32(bar))
      : "memory");
#endif
}
