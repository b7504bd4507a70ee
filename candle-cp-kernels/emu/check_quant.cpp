// quant.cu (dequantization of int8 / NF4 frozen weights) under the emulator vs a plain C++
// transcription of its CPU reference, candle_cp_nn::quant::QuantWeight::dequantize_host (one f32
// multiply per element, then one round to nearest even into the output type), bit for bit, with
// the launch configuration of src/quant.rs (grid-stride blocks of 256) and with a grid of 2
// blocks (the grid-stride loop); groups of 2, 6 and 64 (a pair never straddles a group).
#include "harness.h"

#include <algorithm>

#define QUANT_DECL(N, TY)                                                                          \
  void dequant_int8_##N(const uint8_t*, const float*, TY*, long long, long long);                  \
  void dequant_nf4_##N(const uint8_t*, const float*, TY*, long long, long long);
extern "C" {
QUANT_DECL(f32, float)
QUANT_DECL(f16, __half)
QUANT_DECL(bf16, __nv_bfloat16)
}

namespace {

// candle_cp_nn::quant::NF4_LEVELS, as written there.
const float NF4[16] = {-1.0f, -0.696192800f, -0.525073050f, -0.394917500f, -0.284441380f, -0.184773430f, -0.091050036f, 0.0f,
                       0.079580300f, 0.160930200f, 0.246112300f, 0.337915240f, 0.440709830f, 0.562617000f, 0.722956840f, 1.0f};

template <typename TY> using DequantFn = void (*)(const uint8_t*, const float*, TY*, long long, long long);

template <typename TY> bool same_bits(const TY* a, const std::vector<TY>& b) {
  return std::memcmp((const void*)a, (const void*)b.data(), b.size() * sizeof(TY)) == 0;
}

template <typename TY> void check_dequant(const char* sfx, DequantFn<TY> int8, DequantFn<TY> nf4, uint64_t seed) {
  struct Shape {
    long o, i, g;
  };
  for (const Shape sh : {Shape{5, 12, 2}, Shape{7, 48, 6}, Shape{3, 640, 64}}) {
    const long n = sh.o * sh.i;
    for (int kind = 0; kind < 2; ++kind) {
      const long ncodes = kind ? n / 2 : n;
      // random codes (every byte value) and scales (signs, a zero scale, a large one)
      std::vector<uint8_t> codes(ncodes);
      uint64_t s = seed * 0x9E3779B97F4A7C15ull + (uint64_t)(n + kind);
      for (auto& c : codes) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        c = (uint8_t)(s >> 24);
      }
      const auto sr = randn(n / sh.g, seed + (uint64_t)n + kind);
      std::vector<float> scales(sr.begin(), sr.end());
      scales[0] = 0.f;
      if (scales.size() > 2) scales[2] = 3.0e4f;
      std::vector<TY> ref(n);
      for (long e = 0; e < n; ++e) {
        const float sc = scales[e / sh.g];
        const float w = kind ? NF4[(codes[e / 2] >> (4 * (e % 2))) & 15] * sc : ((float)codes[e] - 128.0f) * sc;
        ref[e] = to_t<TY>(w);
      }
      Buf<uint8_t> cb(ncodes);
      Buf<float> sb(scales.size());
      std::memcpy(cb.p, codes.data(), codes.size());
      std::memcpy(sb.p, scales.data(), scales.size() * sizeof(float));
      const long pairs = n / 2;
      const unsigned full = (unsigned)std::min<long>(std::max<long>((pairs + 255) / 256, 1), 65535);
      for (unsigned grid : {full, 2u}) {
        char name[128];
        std::snprintf(name, sizeof name, "dequant_%s_%s [%ld, %ld] g%ld grid %u", kind ? "nf4" : "int8", sfx, sh.o, sh.i, sh.g, grid);
        if (!wanted(name)) continue;
        Buf<TY> out(n);
        DequantFn<TY> k = kind ? nf4 : int8;
        bool ok = cp_emu::launch(name, dim3(grid), dim3(256), 0, [&] { k(cb.p, sb.p, out.p, pairs, sh.g); });
        check_launch(name, ok);
        if (ok) check(name, same_bits(out.p, ref) ? 0.0 : 1.0, 0.0);
      }
    }
  }
}

}  // namespace

void run_quant_checks() {
  check_dequant<float>("f32", dequant_int8_f32, dequant_nf4_f32, 61);
  check_dequant<__half>("f16", dequant_int8_f16, dequant_nf4_f16, 62);
  check_dequant<__nv_bfloat16>("bf16", dequant_int8_bf16, dequant_nf4_bf16, 63);
}
