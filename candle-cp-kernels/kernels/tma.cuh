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

// Byte offset of f32 element (r, c), c < 32, in a box of 32-column (128-byte) rows as a map with the
// 128-byte swizzle lays it out in shared memory (box 1024-byte aligned): 16-byte chunk c / 4 of row
// r at chunk (c / 4) ^ (r % 8). The `_tma_` backward's dQ buffer (flash_bwd_sm90_ws.cu) and
// probe_tma_red (probe_sm90.cu) store through it.
__device__ __forceinline__ uint32_t cp_sw128_f32_off(int r, int c) {
  return (uint32_t)(r * 128 + ((((c >> 2) ^ r) & 7) << 4) + (c & 3) * 4);
}

// ---- TMA reductions to global memory (the dQ of flash_bwd_sm90_ws.cu's `_tma_` entries) ----------
// Adds the box of `map` at (c0, .., c3) from shared memory at `src` (laid out as a load of the box
// would write it: with our f32 dq maps' 128-byte swizzle, 1024-byte aligned, 16-byte chunk c of
// 128-byte row r at chunk c ^ (r & 7)) into global memory, element by element
// (`.add`, atomic per element); elements outside the tensor are skipped. Issued by one thread; it
// joins the thread's open bulk async-group. The writers of `src` must have run fence.proxy.async
// (their stores, then a barrier, then this) and must not rewrite `src` before the issuing thread's
// cp_bulk_wait_read says the read is done.
__device__ __forceinline__ void cp_tma_reduce_add_4d(const CpTmaMap* map, int c0, int c1, int c2, int c3, uint32_t src) {
#ifdef CP_HOST_EMU
  cp_emu::tma_reduce_add(map->opaque, c0, c1, c2, c3, src);
#else
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
#endif
}

// Commits this thread's open bulk async operations (the reductions above) as one bulk async-group.
__device__ __forceinline__ void cp_bulk_commit() {
#ifdef CP_HOST_EMU
  cp_emu::bulk_commit();
#else
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's bulk async-groups have not finished READING their shared
// memory sources (their global writes may still be in flight); the sources of the others may be
// rewritten (after a barrier that tells the writers).
template <int N> __device__ __forceinline__ void cp_bulk_wait_read() {
#ifdef CP_HOST_EMU
  cp_emu::bulk_wait_read(N);
#else
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
