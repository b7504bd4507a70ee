// IEEE half and bfloat16 <-> float conversions of the host CUDA shim (round to nearest even, NaN
// stays NaN), for the libraries that move 16-bit data without CUDA headers: blas.cpp (GEMM
// operands and results) and nccl_reduce.h (reductions). Checked by test_blas.sh (every rounding
// tie, subnormals, overflow) and test_nccl.sh (every finite code round-trips).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace cp_shim {

inline float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float f16_to_float(uint16_t h) {
  uint32_t s = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = float(m) * 0x1p-24f;  // zero or subnormal
    return s ? -v : v;
  }
  if (e == 31) return bits_f(s | 0x7f800000u | (m << 13));  // inf / nan
  return bits_f(s | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t float_to_f16(float f) {
  uint32_t x = f_bits(f);
  uint16_t s = uint16_t((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(s | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return uint16_t(s | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                                // below 2^-14: subnormal half
    float v = bits_f(ax) * 0x1p24f;                      // exact scaling
    return uint16_t(s | uint32_t(std::nearbyint(v)));    // default mode: nearest even
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return uint16_t(s | h);
}

inline float bf16_to_float(uint16_t b) { return bits_f(uint32_t(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = f_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet nan
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace cp_shim
