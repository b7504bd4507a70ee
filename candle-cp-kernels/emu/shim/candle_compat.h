// Compatibility header for compiling candle's own CUDA kernels (candle-kernels 0.11.1, *.cu in the
// cargo registry, compiled in place and unmodified) as host C++ under the emulator (emu.h) for the
// host CUDA shim (emu/shim/). Force-included (`g++ -include candle_compat.h`, see candle.sh) before
// each candle .cu file; nothing else includes it.
//
// What it changes:
// 1. Includes the CUDA half / bfloat16 / fp8 headers and <cuda/std/limits> with __CUDA_ARCH__
//    undefined (their host paths, which on CUDA 12.2+ include the 16-bit arithmetic operators),
//    then the emulator (emu.h).
// 2. Defines __CUDA_ARCH__ as 800 afterwards, so candle's own `#if __CUDA_ARCH__ >= 800` (bf16) and
//    `>= 530` (f16) entry blocks are compiled (fp8-only blocks `>= 890` stay off; the fp8 entries
//    inside the `>= 800` blocks compile and are untested).
// 3. `__shared__` becomes `thread_local` instead of emu.h's `static` (one copy per OS thread
//    instead of per process; either is right since the emulator runs one block at a time, and
//    the shim one launch at a time), because `thread_local` also admits sort.cu's
//    `extern __shared__ int dst_row[];` (dynamic shared memory), whose storage is the fixed array
//    `dst_row` below (the sm_90 opt-in maximum, 227 KB; candle launches asort with ncols_pad * 4
//    bytes; the launch's dynamic size is not checked against it). All candle shared arrays
//    together are ~430 KB of TLS, allocated per OS thread on its first candle launch. Unlike our
//    kernels, candle's shared arrays are not poisoned per block nor counted against the
//    emulator's shared-memory limit.
// 4. Supplies host versions of the device functions candle calls: half/bf16 math (hexp, hlog,
//    hsqrt, hsin, hcos), rsqrtf, normcdf(f), the __float_as_uint-style bit casts, atomics
//    (atomicAdd / atomicCAS / atomicMin / atomicMax), and warp shuffles of 16- and 64-bit values
//    (emu.h's shuffles are 32-bit). Atomics are plain read-modify-writes: the fibers of a block
//    run on one OS thread and switch only at barriers / warp ops, so no other CUDA thread can run
//    in between (blocks run one after another).
#pragma once
// 5. Type punning: candle's vectorized paths load a float4 and read it through __nv_bfloat16* /
//    __nv_bfloat162* (fine for nvcc, undefined for g++'s strict aliasing, which then reads stale
//    values at -O2). Every function of the file (this pragma survives preprocessing) is compiled
//    with -fno-strict-aliasing.
#pragma GCC optimize("no-strict-aliasing")
#ifdef __CUDA_ARCH__
#error "candle_compat.h must be included before __CUDA_ARCH__ is defined (host compile)"
#endif
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda/std/limits>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdint.h>
#include "emu.h"

using std::isnan;
using std::signbit;

// ---- 3. shared memory ------------------------------------------------------------------------
#undef __shared__
#define __shared__ thread_local
// Storage of sort.cu's `extern __shared__ int dst_row[];` (the only dynamic shared array among
// the candle files compiled for the shim).
// Dynamically initialized (cp_candle_zero() is not constexpr) so that g++ emits its TLS init
// function: g++ calls `_ZTH7dst_row` unconditionally from the block-scope `extern thread_local`
// declaration, which would be a call to address 0 for a constant-initialized variable.
inline int cp_candle_zero() { return 0; }
inline thread_local int dst_row[232448 / sizeof(int)] = {cp_candle_zero()};

// ---- 4. device functions ---------------------------------------------------------------------
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float normcdff(float x) { return 0.5f * std::erfc(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * std::erfc(-x * 0.70710678118654752440); }

inline unsigned int __float_as_uint(float x) { unsigned int u; std::memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned int u) { float x; std::memcpy(&x, &u, 4); return x; }
inline int __float_as_int(float x) { int u; std::memcpy(&u, &x, 4); return u; }
inline float __int_as_float(int u) { float x; std::memcpy(&x, &u, 4); return x; }
inline long long __double_as_longlong(double x) { long long u; std::memcpy(&u, &x, 8); return u; }
inline double __longlong_as_double(long long u) { double x; std::memcpy(&x, &u, 8); return x; }

#define CP_CANDLE_HALF_MATH(T, TO_F, FROM_F)                      \
  inline T hexp(T a) { return FROM_F(std::exp(TO_F(a))); }        \
  inline T hlog(T a) { return FROM_F(std::log(TO_F(a))); }        \
  inline T hsqrt(T a) { return FROM_F(std::sqrt(TO_F(a))); }      \
  inline T hsin(T a) { return FROM_F(std::sin(TO_F(a))); }        \
  inline T hcos(T a) { return FROM_F(std::cos(TO_F(a))); }
CP_CANDLE_HALF_MATH(__half, __half2float, __float2half)
CP_CANDLE_HALF_MATH(__nv_bfloat16, __bfloat162float, __float2bfloat16)
#undef CP_CANDLE_HALF_MATH

// Atomics: return the old value, like CUDA's.
template <typename T> inline T cp_candle_atomic_add(T* p, T v) { T old = *p; *p = old + v; return old; }
inline float atomicAdd(float* p, float v) { return cp_candle_atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return cp_candle_atomic_add(p, v); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return cp_candle_atomic_add(p, v); }
inline int atomicAdd(int* p, int v) { return cp_candle_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return cp_candle_atomic_add(p, v); }
inline __half atomicAdd(__half* p, __half v) { return cp_candle_atomic_add(p, v); }
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) { return cp_candle_atomic_add(p, v); }
template <typename T> inline T cp_candle_atomic_cas(T* p, T compare, T v) {
  T old = *p;
  if (old == compare) *p = v;
  return old;
}
inline unsigned short atomicCAS(unsigned short* p, unsigned short c, unsigned short v) { return cp_candle_atomic_cas(p, c, v); }
inline unsigned int atomicCAS(unsigned int* p, unsigned int c, unsigned int v) { return cp_candle_atomic_cas(p, c, v); }
inline int atomicCAS(int* p, int c, int v) { return cp_candle_atomic_cas(p, c, v); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c, unsigned long long v) {
  return cp_candle_atomic_cas(p, c, v);
}
#define CP_CANDLE_ATOMIC_MINMAX(T)                                                   \
  inline T atomicMin(T* p, T v) { T old = *p; if (v < old) *p = v; return old; }     \
  inline T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }
CP_CANDLE_ATOMIC_MINMAX(int)
CP_CANDLE_ATOMIC_MINMAX(unsigned int)
CP_CANDLE_ATOMIC_MINMAX(long long)
CP_CANDLE_ATOMIC_MINMAX(unsigned long long)
#undef CP_CANDLE_ATOMIC_MINMAX

// Warp shuffles of 16- and 64-bit values (exact-match overloads, preferred over emu.h's 32-bit
// templates). A 64-bit value moves as two 32-bit shuffles, as nvcc lowers it.
template <typename T> inline T cp_candle_shfl16(::cp_emu::WarpOp op, unsigned mask, T v, int arg) {
  static_assert(sizeof(T) == 2, "16-bit type");
  uint16_t h;
  std::memcpy(&h, static_cast<const void*>(&v), 2);
  uint16_t r = (uint16_t)::cp_emu::warp_u32(op, mask, h, arg);
  T out;
  std::memcpy(static_cast<void*>(&out), &r, 2);
  return out;
}
template <typename T> inline T cp_candle_shfl64(::cp_emu::WarpOp op, unsigned mask, T v, int arg) {
  static_assert(sizeof(T) == 8, "64-bit type");
  uint64_t u;
  std::memcpy(&u, &v, 8);
  uint64_t lo = ::cp_emu::warp_u32(op, mask, (uint32_t)u, arg);
  uint64_t hi = ::cp_emu::warp_u32(op, mask, (uint32_t)(u >> 32), arg);
  u = lo | (hi << 32);
  T out;
  std::memcpy(&out, &u, 8);
  return out;
}
#define CP_CANDLE_SHFL(T, IMPL)                                                                                 \
  inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {                                 \
    (void)width;                                                                                                \
    return IMPL(::cp_emu::WarpOp::ShflXor, mask, v, lane_mask);                                                 \
  }                                                                                                             \
  inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {                                           \
    (void)width;                                                                                                \
    return IMPL(::cp_emu::WarpOp::Shfl, mask, v, src);                                                          \
  }
CP_CANDLE_SHFL(__half, cp_candle_shfl16)
CP_CANDLE_SHFL(__nv_bfloat16, cp_candle_shfl16)
CP_CANDLE_SHFL(double, cp_candle_shfl64)
CP_CANDLE_SHFL(long long, cp_candle_shfl64)
CP_CANDLE_SHFL(long, cp_candle_shfl64)
CP_CANDLE_SHFL(unsigned long long, cp_candle_shfl64)
CP_CANDLE_SHFL(unsigned long, cp_candle_shfl64)
#undef CP_CANDLE_SHFL

// candle's sources compare signed with unsigned indices throughout (-Wall); this pragma stays in
// the preprocessed file, so the compile step needs no extra flag.
#pragma GCC diagnostic ignored "-Wsign-compare"

// ---- 2. candle's arch-gated entry blocks on ---------------------------------------------------
#define __CUDA_ARCH__ 800
