// dropout.cu (dropout keep masks from counter-based streams) under the emulator vs a plain C++
// transcription of its CPU reference (candle_cp_nn::RngStreams::uniform_rows, then u >= p, times
// the scale, cast), bit for bit, with the launch configuration of src/dropout.rs (grid-stride
// blocks of 256) and a grid of 2 blocks; rows in any order (a zigzag shard's), a column window
// of a wider tensor (a row-parallel layer's input slice), p of 0.1, 0.5 and 0.9; the share kept
// must be near 1 - p (a hash that returned a constant would pass a bit-compare of a constant).
#include "harness.h"

#include <algorithm>

#define DROPOUT_DECL(N, TY)                                                                          \
  void dropout_keep_##N(const long long*, long long, unsigned long long, unsigned long long, long long, \
                        unsigned long long, float, float, TY*);
extern "C" {
DROPOUT_DECL(f32, float)
DROPOUT_DECL(f16, __half)
DROPOUT_DECL(bf16, __nv_bfloat16)
}

namespace {

// candle_cp_nn::dropout::splitmix64, as written there
uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename TY> using KeepFn = void (*)(const long long*, long long, unsigned long long, unsigned long long, long long,
                                               unsigned long long, float, float, TY*);

template <typename TY> void check_keep(const char* sfx, KeepFn<TY> k) {
  const uint64_t key = 0x1234'5678'9abc'def0ull;
  // a zigzag shard's rows of a 64-row sequence at P = 4, rank 1: chunks 1 and 6 of 8
  std::vector<long long> rows;
  for (long long i = 8; i < 16; ++i) rows.push_back(i);
  for (long long i = 48; i < 56; ++i) rows.push_back(i);
  struct Cols {
    uint64_t col0;
    long long cols;
    uint64_t total;
  };
  for (const Cols c : {Cols{0, 40, 40}, Cols{24, 24, 96}}) {
    for (float p : {0.1f, 0.5f, 0.9f}) {
      const float scale = (float)(1.0 / (1.0 - (double)p));
      const long long n = (long long)rows.size() * c.cols;
      std::vector<TY> ref(n);
      long long kept = 0;
      for (size_t r = 0; r < rows.size(); ++r)
        for (long long j = 0; j < c.cols; ++j) {
          const uint64_t g = (uint64_t)rows[r] * c.total + c.col0 + (uint64_t)j;
          const float u = (float)(splitmix64(key ^ splitmix64(g)) >> 40) * (1.0f / 16777216.0f);
          const bool keep = u >= p;
          kept += keep;
          ref[r * c.cols + j] = to_t<TY>(keep ? scale : 0.0f);
        }
      Buf<long long> rb(rows.size());
      std::memcpy(rb.p, rows.data(), rows.size() * sizeof(long long));
      const unsigned full = (unsigned)std::min<long long>(std::max<long long>((n + 255) / 256, 1), 65535);
      for (unsigned grid : {full, 2u}) {
        char name[160];
        std::snprintf(name, sizeof name, "dropout_keep_%s [%zu rows, cols %llu+%lld of %llu] p %.1f grid %u", sfx, rows.size(),
                      (unsigned long long)c.col0, c.cols, (unsigned long long)c.total, p, grid);
        if (!wanted(name)) continue;
        Buf<TY> out(n);
        bool ok = cp_emu::launch(name, dim3(grid), dim3(256), 0,
                                 [&] { k(rb.p, (long long)rows.size(), key, c.col0, c.cols, c.total, p, scale, out.p); });
        check_launch(name, ok);
        if (ok) check(name, std::memcmp((const void*)out.p, (const void*)ref.data(), n * sizeof(TY)) == 0 ? 0.0 : 1.0, 0.0);
      }
      char name[128];
      std::snprintf(name, sizeof name, "dropout reference kept share p %.1f vs 1 - p", p);
      if (wanted(name)) check(name, std::abs((double)kept / n - (1.0 - p)), 0.08);
    }
  }
}

}  // namespace

void run_dropout_checks() {
  check_keep<float>("f32", dropout_keep_f32);
  check_keep<__half>("f16", dropout_keep_f16);
  check_keep<__nv_bfloat16>("bf16", dropout_keep_bf16);
}
