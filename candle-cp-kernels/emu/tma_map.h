// The emulator's encoding of a TMA tensor map (CUtensorMap's 128 opaque bytes): what the host CUDA
// shim's cuTensorMapEncodeTiled (shim/driver.cpp) and the harness (check_flash.cpp) write and what
// cp_emu::tma_load (emu_async.cpp) reads. The checks follow the driver documentation of
// cuTensorMapEncodeTiled (CUDA 12/13 driver API, "Tensor Map Object Management"), restricted to
// what the emulator models: tiled mode, no interleave, element strides 1, 16-bit or 32-bit elements.
#pragma once
#include <cstdint>
#include <cstring>

namespace cp_tma {

constexpr uint64_t MAGIC = 0x544d41656d753031ull;  // "TMAemu01"

struct Desc {
  uint64_t magic;
  uint64_t base;        // global address
  uint64_t dims[5];     // elements per dimension, innermost first
  uint64_t strides[5];  // bytes between consecutive indices of each dimension (strides[0] = esize)
  uint32_t box[5];      // box (tile) size per dimension, in elements
  uint32_t rank, esize, swizzle;  // swizzle: 0 (none), 32, 64 or 128 bytes
};
static_assert(sizeof(Desc) <= 128, "a tensor map is 128 bytes");

// Writes the map into `map` (128 bytes); returns nullptr, or what is wrong (nothing written).
// strides: rank - 1 byte strides of dimensions 1.. (dimension 0 is contiguous).
inline const char* encode(void* map, uint32_t esize, uint32_t rank, const void* base, const uint64_t* dims,
                          const uint64_t* strides, const uint32_t* box, const uint32_t* elem_strides, uint32_t swizzle) {
  if (rank < 1 || rank > 5) return "tensor rank outside 1..5";
  if (esize != 2 && esize != 4) return "element type: the emulator models 16- and 32-bit elements";
  if (reinterpret_cast<uintptr_t>(base) % 16) return "global address not 16-byte aligned";
  if (swizzle != 0 && swizzle != 32 && swizzle != 64 && swizzle != 128) return "swizzle not none / 32 / 64 / 128 bytes";
  Desc d{};
  d.magic = MAGIC;
  d.base = reinterpret_cast<uint64_t>(base);
  d.rank = rank;
  d.esize = esize;
  d.swizzle = swizzle;
  d.strides[0] = esize;
  for (uint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (1ull << 32)) return "global dimension 0 or above 2^32";
    if (box[i] == 0 || box[i] > 256) return "box dimension 0 or above 256";
    if (elem_strides[i] != 1) return "element strides other than 1 (not modelled)";
    d.dims[i] = dims[i];
    d.box[i] = box[i];
    if (i > 0) {
      if (strides[i - 1] % 16 || strides[i - 1] >= (1ull << 40)) return "global stride not a multiple of 16 or >= 2^40";
      d.strides[i] = strides[i - 1];
    }
  }
  if (box[0] * esize % 16) return "inner box dimension in bytes not a multiple of 16";
  if (swizzle && box[0] * esize > swizzle) return "inner box dimension in bytes larger than the swizzle span";
  std::memset(map, 0, 128);
  std::memcpy(map, &d, sizeof d);
  return nullptr;
}

// Reads a map written by encode(); false if it is not one.
inline bool decode(const void* map, Desc* d) {
  std::memcpy(d, map, sizeof *d);
  return d->magic == MAGIC;
}

}  // namespace cp_tma
