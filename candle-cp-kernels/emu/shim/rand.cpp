// libcurand stand-in of the host CUDA shim (shim.h): the host API generator calls candle 0.11.1's
// CUDA backend makes through cudarc 0.19.10 (CudaRng: create, set stream, seed, fill uniform /
// normal, destroy).
//
// ABI: the declarations below mirror cudarc-0.19.10/src/curand/sys/mod.rs (no cuRAND header is
// used); every status returned is a value of cudarc's `curandStatus_t`.
//
// The numbers are NOT real cuRAND's stream (XORWOW / Philox): a generator here is a counter-based
// splitmix64 sequence keyed by the seed. Output element i of a call is a pure function of
// (seed, offset + i), where offset counts the values generated since the seed was set, so the
// results are deterministic per seed and call sequence, independent of threads and streams.
// - Uniform (f32/f64): in (0, 1], like cuRAND (0 excluded, 1 included): (u + 1) * 2^-24 resp.
//   (u + 1) * 2^-53 from the top 24 resp. 53 bits of the 64-bit value.
// - Normal (f32/f64): Box-Muller on pairs of uniforms, mean + stddev * z; like cuRAND's pseudo
//   generators, n must be even (else CURAND_STATUS_LENGTH_NOT_MULTIPLE; candle rounds up).
// - Stream order: before writing the output, the call drains the generator's stream
//   (cp_shim::stream_drain), then fills it eagerly in the calling thread.
// Quasi-random generator types (Sobol) are not implemented: curandCreateGenerator returns
// CURAND_STATUS_TYPE_ERROR for them (logged).
#include "shim.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>

struct CUstream_st;
typedef CUstream_st* cudaStream_t;

extern "C" {

typedef enum {
  CURAND_STATUS_SUCCESS = 0,
  CURAND_STATUS_VERSION_MISMATCH = 100,
  CURAND_STATUS_NOT_INITIALIZED = 101,
  CURAND_STATUS_ALLOCATION_FAILED = 102,
  CURAND_STATUS_TYPE_ERROR = 103,
  CURAND_STATUS_OUT_OF_RANGE = 104,
  CURAND_STATUS_LENGTH_NOT_MULTIPLE = 105,
  CURAND_STATUS_DOUBLE_PRECISION_REQUIRED = 106,
  CURAND_STATUS_LAUNCH_FAILURE = 201,
  CURAND_STATUS_PREEXISTING_FAILURE = 202,
  CURAND_STATUS_INITIALIZATION_FAILED = 203,
  CURAND_STATUS_ARCH_MISMATCH = 204,
  CURAND_STATUS_INTERNAL_ERROR = 999,
} curandStatus_t;

typedef enum {
  CURAND_RNG_TEST = 0,
  CURAND_RNG_PSEUDO_DEFAULT = 100,
  CURAND_RNG_PSEUDO_XORWOW = 101,
  CURAND_RNG_PSEUDO_MRG32K3A = 121,
  CURAND_RNG_PSEUDO_MTGP32 = 141,
  CURAND_RNG_PSEUDO_MT19937 = 142,
  CURAND_RNG_PSEUDO_PHILOX4_32_10 = 161,
} curandRngType_t;

struct curandGenerator_st;
typedef curandGenerator_st* curandGenerator_t;

}  // extern "C"

struct curandGenerator_st {
  uint64_t magic;
  int rng_type;
  unsigned long long seed;
  unsigned long long offset;  // values generated since the seed was set (or curandSetGeneratorOffset)
  cudaStream_t stream;
};

namespace {

constexpr uint64_t kMagic = 0x63707368696d524eull;  // "cpshimRN"
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

bool valid(curandGenerator_t g) { return g != nullptr && g->magic == kMagic; }

// `valid`, else logs that `fn` got an invalid generator (the caller returns NOT_INITIALIZED).
bool valid_or_log(const char* fn, curandGenerator_t g) {
  if (valid(g)) return true;
  cp_shim::log("%s: invalid cuRAND generator %p -> CURAND_STATUS_NOT_INITIALIZED", fn, (void*)g);
  return false;
}

inline uint64_t mix(uint64_t z) {  // splitmix64 finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The 64-bit value at position `i` of the sequence of `key` (splitmix64 started at state key).
inline uint64_t value(uint64_t key, uint64_t i) { return mix(key + (i + 1) * kGolden); }

inline uint64_t key_of(unsigned long long seed) { return mix(seed ^ 0x5851f42d4c957f2dull); }

inline float uniform_f32(uint64_t v) { return float((v >> 40) + 1) * 0x1p-24f; }
inline double uniform_f64(uint64_t v) { return double((v >> 11) + 1) * 0x1p-53; }

// Common checks + stream drain. Returns SUCCESS or the status to report (after logging why).
curandStatus_t begin(const char* fn, curandGenerator_t g, const void* out, size_t n, bool pairs) {
  if (!valid_or_log(fn, g)) return CURAND_STATUS_NOT_INITIALIZED;
  if (pairs && n % 2 != 0) {
    cp_shim::log("%s: n = %zu is odd; pseudo-random normal generation needs an even count -> "
                 "CURAND_STATUS_LENGTH_NOT_MULTIPLE", fn, n);
    return CURAND_STATUS_LENGTH_NOT_MULTIPLE;
  }
  if (n > 0 && out == nullptr) {
    cp_shim::log("%s: output is a null pointer (n = %zu) -> CURAND_STATUS_LAUNCH_FAILURE", fn, n);
    return CURAND_STATUS_LAUNCH_FAILURE;
  }
  if (int rc = cp_shim::stream_drain(static_cast<void*>(g->stream)); rc != cp_shim::CU_OK) {
    cp_shim::log("%s: waiting for the pending work of stream %p failed (CUresult %d) -> CURAND_STATUS_LAUNCH_FAILURE",
                 fn, (void*)g->stream, rc);
    return CURAND_STATUS_LAUNCH_FAILURE;
  }
  return CURAND_STATUS_SUCCESS;
}

template <class T, class U>
void fill_uniform(curandGenerator_t g, T* out, size_t n, U u) {
  const uint64_t key = key_of(g->seed);
  for (size_t i = 0; i < n; ++i) out[i] = u(value(key, g->offset + i));
  g->offset += n;
}

template <class T>
void fill_normal(curandGenerator_t g, T* out, size_t n, double mean, double stddev) {
  const uint64_t key = key_of(g->seed);
  const double two_pi = 6.283185307179586476925286766559;
  for (size_t i = 0; i < n; i += 2) {
    double u1 = uniform_f64(value(key, g->offset + i));  // (0, 1]: log is finite
    double u2 = uniform_f64(value(key, g->offset + i + 1));
    double r = std::sqrt(-2.0 * std::log(u1)), t = two_pi * u2;
    out[i] = T(mean + stddev * r * std::cos(t));
    out[i + 1] = T(mean + stddev * r * std::sin(t));
  }
  g->offset += n;
}

}  // namespace

extern "C" {

curandStatus_t curandCreateGenerator(curandGenerator_t* generator, curandRngType_t rng_type) {
  if (generator == nullptr) {
    cp_shim::log("curandCreateGenerator: generator is a null pointer -> CURAND_STATUS_NOT_INITIALIZED");
    return CURAND_STATUS_NOT_INITIALIZED;
  }
  switch (rng_type) {
    case CURAND_RNG_PSEUDO_DEFAULT:
    case CURAND_RNG_PSEUDO_XORWOW:
    case CURAND_RNG_PSEUDO_MRG32K3A:
    case CURAND_RNG_PSEUDO_MTGP32:
    case CURAND_RNG_PSEUDO_MT19937:
    case CURAND_RNG_PSEUDO_PHILOX4_32_10: break;
    default:
      cp_shim::log("curandCreateGenerator: rng type %d is not a pseudo-random generator the shim implements -> "
                   "CURAND_STATUS_TYPE_ERROR", (int)rng_type);
      return CURAND_STATUS_TYPE_ERROR;
  }
  auto* g = new (std::nothrow) curandGenerator_st{kMagic, (int)rng_type, 0, 0, nullptr};
  if (g == nullptr) return CURAND_STATUS_ALLOCATION_FAILED;
  *generator = g;
  return CURAND_STATUS_SUCCESS;
}

curandStatus_t curandDestroyGenerator(curandGenerator_t generator) {
  if (!valid_or_log("curandDestroyGenerator", generator)) return CURAND_STATUS_NOT_INITIALIZED;
  generator->magic = 0;
  delete generator;
  return CURAND_STATUS_SUCCESS;
}

curandStatus_t curandSetStream(curandGenerator_t generator, cudaStream_t stream) {
  if (!valid_or_log("curandSetStream", generator)) return CURAND_STATUS_NOT_INITIALIZED;
  generator->stream = stream;
  return CURAND_STATUS_SUCCESS;
}

curandStatus_t curandSetPseudoRandomGeneratorSeed(curandGenerator_t generator, unsigned long long seed) {
  if (!valid_or_log("curandSetPseudoRandomGeneratorSeed", generator)) return CURAND_STATUS_NOT_INITIALIZED;
  generator->seed = seed;
  generator->offset = 0;  // a re-seeded generator restarts its sequence
  return CURAND_STATUS_SUCCESS;
}

curandStatus_t curandSetGeneratorOffset(curandGenerator_t generator, unsigned long long offset) {
  if (!valid_or_log("curandSetGeneratorOffset", generator)) return CURAND_STATUS_NOT_INITIALIZED;
  generator->offset = offset;
  return CURAND_STATUS_SUCCESS;
}

curandStatus_t curandGenerate(curandGenerator_t generator, unsigned int* out, size_t num) {
  curandStatus_t st = begin("curandGenerate", generator, out, num, false);
  if (st == CURAND_STATUS_SUCCESS) fill_uniform(generator, out, num, [](uint64_t v) { return (unsigned)(v >> 32); });
  return st;
}

curandStatus_t curandGenerateUniform(curandGenerator_t generator, float* out, size_t num) {
  curandStatus_t st = begin("curandGenerateUniform", generator, out, num, false);
  if (st == CURAND_STATUS_SUCCESS) fill_uniform(generator, out, num, uniform_f32);
  return st;
}

curandStatus_t curandGenerateUniformDouble(curandGenerator_t generator, double* out, size_t num) {
  curandStatus_t st = begin("curandGenerateUniformDouble", generator, out, num, false);
  if (st == CURAND_STATUS_SUCCESS) fill_uniform(generator, out, num, uniform_f64);
  return st;
}

curandStatus_t curandGenerateNormal(curandGenerator_t generator, float* out, size_t n, float mean, float stddev) {
  curandStatus_t st = begin("curandGenerateNormal", generator, out, n, true);
  if (st == CURAND_STATUS_SUCCESS) fill_normal(generator, out, n, mean, stddev);
  return st;
}

curandStatus_t curandGenerateNormalDouble(curandGenerator_t generator, double* out, size_t n, double mean,
                                          double stddev) {
  curandStatus_t st = begin("curandGenerateNormalDouble", generator, out, n, true);
  if (st == CURAND_STATUS_SUCCESS) fill_normal(generator, out, n, mean, stddev);
  return st;
}

curandStatus_t curandGenerateLogNormal(curandGenerator_t generator, float* out, size_t n, float mean, float stddev) {
  curandStatus_t st = begin("curandGenerateLogNormal", generator, out, n, true);
  if (st == CURAND_STATUS_SUCCESS) {
    fill_normal(generator, out, n, mean, stddev);
    for (size_t i = 0; i < n; ++i) out[i] = std::exp(out[i]);
  }
  return st;
}

curandStatus_t curandGenerateLogNormalDouble(curandGenerator_t generator, double* out, size_t n, double mean,
                                             double stddev) {
  curandStatus_t st = begin("curandGenerateLogNormalDouble", generator, out, n, true);
  if (st == CURAND_STATUS_SUCCESS) {
    fill_normal(generator, out, n, mean, stddev);
    for (size_t i = 0; i < n; ++i) out[i] = std::exp(out[i]);
  }
  return st;
}

}  // extern "C"
