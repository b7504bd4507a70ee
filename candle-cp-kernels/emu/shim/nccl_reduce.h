// Element arithmetic of the shim's libnccl (emu/shim/nccl.cpp): datatype sizes, the minifloat
// formats (f16, bf16, fp8 e4m3 / e5m2) through float, and the reductions sum / prod / max / min /
// avg over the ranks' buffers.
//
// Reduction order and precision (NCCL's own order is a ring/tree, not observable bit-exactly by
// our code): ranks 0..P-1 left to right, element by element; f32 and f64 accumulate in their own
// type, f16 / bf16 / fp8 in float, rounded once (round-to-nearest-even; fp8 saturating to the
// largest finite value like CUDA's __NV_SATFINITE, f16 overflowing to inf); integers wrap around
// (unsigned arithmetic). avg = sum / P (integers: truncating division of the wrapped sum).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "half.h"
#include "nccl_abi.h"

namespace cp_nccl {

// Bytes per element of `dt`, 0 for an invalid datatype.
inline size_t dtype_size(int dt) {
  static const size_t sz[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
  return (dt >= 0 && dt < ncclNumTypes) ? sz[dt] : 0;
}

inline const char* dtype_name(int dt) {
  static const char* n[ncclNumTypes] = {"int8", "uint8", "int32", "uint32", "int64", "uint64",
                                        "float16", "float32", "float64", "bfloat16", "fp8e4m3", "fp8e5m2"};
  return (dt >= 0 && dt < ncclNumTypes) ? n[dt] : "invalid";
}

inline const char* op_name(int op) {
  static const char* n[ncclNumOps] = {"sum", "prod", "max", "min", "avg"};
  return (op >= 0 && op < ncclNumOps) ? n[op] : "invalid";
}

// IEEE-like binary format with E exponent bits and M mantissa bits (bias 2^(E-1)-1), to float.
// `fn` (e4m3fn): no infinities, only the all-ones code is NaN.
inline float mini_decode(uint32_t c, int E, int M, bool fn) {
  const int bias = (1 << (E - 1)) - 1;
  const uint32_t emax = (1u << E) - 1, mmax = (1u << M) - 1;
  const uint32_t ex = (c >> M) & emax, man = c & mmax;
  const bool neg = (c >> (E + M)) & 1;
  float v;
  if (!fn && ex == emax) {
    v = man ? NAN : INFINITY;
  } else if (fn && ex == emax && man == mmax) {
    v = NAN;
  } else if (ex == 0) {
    v = std::ldexp(static_cast<float>(man), 1 - bias - M);
  } else {
    v = std::ldexp(static_cast<float>(man + (1u << M)), static_cast<int>(ex) - bias - M);
  }
  return neg ? -v : v;
}

// float to the format above, round to nearest even. Codes above `maxfinite` (and infinities)
// become `ovf` (inf for f16, the largest finite value for the saturating fp8 conversions).
inline uint32_t mini_encode(float x, int E, int M, uint32_t nan, uint32_t ovf, uint32_t maxfinite) {
  const uint32_t sign = std::signbit(x) ? (1u << (E + M)) : 0u;
  if (std::isnan(x)) return nan | sign;
  const float ax = std::fabs(x);
  if (std::isinf(ax)) return ovf | sign;
  if (ax == 0.0f) return sign;
  const int bias = (1 << (E - 1)) - 1, min_exp = 1 - bias;
  int e;
  std::frexp(ax, &e);
  int eu = e - 1;  // ax = 1.f * 2^eu
  uint32_t code;
  if (eu < min_exp) {  // subnormal (rounding up to 2^M lands on the smallest normal code)
    code = static_cast<uint32_t>(std::nearbyint(std::ldexp(ax, M - min_exp)));
  } else {
    double q = std::nearbyint(std::ldexp(static_cast<double>(ax), M - eu));
    if (q >= static_cast<double>(2u << M)) {
      q = static_cast<double>(1u << M);
      eu += 1;
    }
    const int64_t biased = static_cast<int64_t>(eu) + bias;
    if (biased >= static_cast<int64_t>((1u << E))) return ovf | sign;
    code = (static_cast<uint32_t>(biased) << M) | (static_cast<uint32_t>(q) - (1u << M));
  }
  if (code > maxfinite) code = ovf;
  return code | sign;
}

// f16 / bf16: the shim's shared conversions (half.h); the fp8 formats below use mini_*.
using cp_shim::bf16_to_float;
using cp_shim::f16_to_float;
using cp_shim::float_to_bf16;
using cp_shim::float_to_f16;
inline float e4m3_to_float(uint8_t c) { return mini_decode(c, 4, 3, true); }
inline uint8_t float_to_e4m3(float f) { return static_cast<uint8_t>(mini_encode(f, 4, 3, 0x7f, 0x7e, 0x7e)); }
inline float e5m2_to_float(uint8_t c) { return mini_decode(c, 5, 2, false); }
inline uint8_t float_to_e5m2(float f) { return static_cast<uint8_t>(mini_encode(f, 5, 2, 0x7f, 0x7b, 0x7b)); }

template <typename A>
inline A combine(A a, A b, int op) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    switch (op) {
      case ncclProd: return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
      case ncclMax: return a > b ? a : b;
      case ncclMin: return a < b ? a : b;
      default: return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));  // sum, avg
    }
  } else {
    switch (op) {
      case ncclProd: return a * b;
      case ncclMax: return std::fmax(a, b);
      case ncclMin: return std::fmin(a, b);
      default: return a + b;
    }
  }
}

// dst[i] = op over r of srcs[r][i], i < n, stored as T; A is the accumulation type.
template <typename T, typename A, typename Load, typename Store>
inline void reduce_typed(void* dst, const void* const* srcs, int nsrc, size_t n, int op, Load load, Store store) {
  T* d = static_cast<T*>(dst);
  for (size_t i = 0; i < n; ++i) {
    A a = load(static_cast<const T*>(srcs[0])[i]);
    for (int r = 1; r < nsrc; ++r) a = combine<A>(a, load(static_cast<const T*>(srcs[r])[i]), op);
    if (op == ncclAvg) a = static_cast<A>(a / static_cast<A>(nsrc));
    d[i] = store(a);
  }
}

// Reduces `nsrc` buffers of `n` elements of datatype `dt` with `op` into `dst` (which must not
// overlap any source). Returns false for an invalid datatype or op.
inline bool reduce(void* dst, const void* const* srcs, int nsrc, size_t n, int dt, int op) {
  if (op < 0 || op >= ncclNumOps || nsrc < 1) return false;
  auto id = [](auto v) { return v; };
  switch (dt) {
    case ncclInt8: reduce_typed<int8_t, int8_t>(dst, srcs, nsrc, n, op, id, id); return true;
    case ncclUint8: reduce_typed<uint8_t, uint8_t>(dst, srcs, nsrc, n, op, id, id); return true;
    case ncclInt32: reduce_typed<int32_t, int32_t>(dst, srcs, nsrc, n, op, id, id); return true;
    case ncclUint32: reduce_typed<uint32_t, uint32_t>(dst, srcs, nsrc, n, op, id, id); return true;
    case ncclInt64: reduce_typed<int64_t, int64_t>(dst, srcs, nsrc, n, op, id, id); return true;
    case ncclUint64: reduce_typed<uint64_t, uint64_t>(dst, srcs, nsrc, n, op, id, id); return true;
    case ncclFloat32: reduce_typed<float, float>(dst, srcs, nsrc, n, op, id, id); return true;
    case ncclFloat64: reduce_typed<double, double>(dst, srcs, nsrc, n, op, id, id); return true;
    case ncclFloat16: reduce_typed<uint16_t, float>(dst, srcs, nsrc, n, op, f16_to_float, float_to_f16); return true;
    case ncclBfloat16: reduce_typed<uint16_t, float>(dst, srcs, nsrc, n, op, bf16_to_float, float_to_bf16); return true;
    case ncclFloat8e4m3: reduce_typed<uint8_t, float>(dst, srcs, nsrc, n, op, e4m3_to_float, float_to_e4m3); return true;
    case ncclFloat8e5m2: reduce_typed<uint8_t, float>(dst, srcs, nsrc, n, op, e5m2_to_float, float_to_e5m2); return true;
    default: return false;
  }
}

}  // namespace cp_nccl
