// Dequantization of a quantized frozen weight (a LoRA run's base, QLoRA-style): int8 or 4-bit
// NormalFloat (NF4) codes with one f32 scale per group of `g` consecutive elements of a row, to
// f32 / f16 / bf16 in one pass.
// Rust caller: candle_cp_kernels::quant::dequantize (src/quant.rs), the CUDA path of
//   candle_cp_nn::quant::QuantWeight::dequantize.
// CPU reference: candle_cp_nn::quant::QuantWeight::dequantize_host, bit for bit (one f32 multiply,
//   then one round to nearest even into the output type); emu/check_quant.cpp, gpu_check --sections quant.
//
//   int8: w[e] = (code[e] - 128) * s[e / g]                  codes [n] u8
//   nf4:  w[e] = NF4[nibble (e % 2) of code[e / 2]] * s[e / g]  codes [n / 2] u8, element 2j in the low nibble
//
// One thread per pair of elements (2j, 2j + 1): g is even, so a pair shares its scale, an NF4 pair
// is one code byte, and the pair is stored as one 2-element vector (the output is a fresh buffer,
// aligned). Grid-stride loop over the n / 2 pairs. The 16 NF4 levels sit in shared memory: a warp's
// lookups hit at most 16 words in 16 banks (no conflict), where a __constant__ table would
// serialize a warp over its distinct indices.
#include "common.cuh"

// The NF4 levels, exactly the f32 values of candle_cp_nn::quant::NF4_LEVELS.
__device__ __forceinline__ float cp_nf4_level(int k) {
  switch (k) {
    case 0: return -1.0f;
    case 1: return -0.6961928f;
    case 2: return -0.52507305f;
    case 3: return -0.3949175f;
    case 4: return -0.28444138f;
    case 5: return -0.18477343f;
    case 6: return -0.091050036f;
    case 7: return 0.0f;
    case 8: return 0.0795803f;
    case 9: return 0.1609302f;
    case 10: return 0.2461123f;
    case 11: return 0.33791524f;
    case 12: return 0.44070983f;
    case 13: return 0.562617f;
    case 14: return 0.72295684f;
    default: return 1.0f;
  }
}

__device__ __forceinline__ void cp_store2(float* out, size_t j, float a, float b) {
  reinterpret_cast<float2*>(out)[j] = make_float2(a, b);
}
__device__ __forceinline__ void cp_store2(__half* out, size_t j, float a, float b) {
  reinterpret_cast<__half2*>(out)[j] = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void cp_store2(__nv_bfloat16* out, size_t j, float a, float b) {
  reinterpret_cast<__nv_bfloat162*>(out)[j] = __floats2bfloat162_rn(a, b);
}

// NF4 = 0: int8 codes; 1: NF4 codes. pairs = n / 2; g = the group (even). Blocks of at least 16
// threads (the level table is filled by the first 16).
template <int NF4, typename T>
__device__ __forceinline__ void dequant(const uint8_t* codes, const float* scales, T* out, long long pairs,
                                        long long g) {
  __shared__ float lv[16];
  if (NF4) {
    if (threadIdx.x < 16) lv[threadIdx.x] = cp_nf4_level(threadIdx.x);
    __syncthreads();
  }
  const long long half_g = g / 2;
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < pairs; j += (long long)gridDim.x * blockDim.x) {
    const float s = scales[j / half_g];
    float a, b;
    if (NF4) {
      const unsigned c = codes[j];
      a = lv[c & 15u] * s;
      b = lv[c >> 4] * s;
    } else {
      a = ((float)codes[2 * j] - 128.0f) * s;
      b = ((float)codes[2 * j + 1] - 128.0f) * s;
    }
    cp_store2(out, (size_t)j, a, b);
  }
}

// dequant_{int8,nf4}_{f32,f16,bf16}(codes, scales, out, pairs, g).
// Launch: grid (min(ceil(pairs / 256), 65535)), block 256 (the loop covers any grid).
#define DEQUANT_ENTRY(KIND, NF4, NAME, TY)                                                                  \
  extern "C" __global__ void                                                                                 \
      dequant_##KIND##_##NAME(const uint8_t* codes, const float* scales, TY* out, long long pairs, long long g) { \
    dequant<NF4, TY>(codes, scales, out, pairs, g);                                                        \
  }
DEQUANT_ENTRY(int8, 0, f32, float)
DEQUANT_ENTRY(int8, 0, f16, __half)
DEQUANT_ENTRY(int8, 0, bf16, __nv_bfloat16)
DEQUANT_ENTRY(nf4, 1, f32, float)
DEQUANT_ENTRY(nf4, 1, f16, __half)
DEQUANT_ENTRY(nf4, 1, bf16, __nv_bfloat16)
