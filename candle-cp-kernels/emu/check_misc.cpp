// merge.cu (ring-step merge, final cast) and layout.cu (zigzag / striped shard and unshard,
// all-to-all pack / unpack) under the emulator vs plain C++ references with the launch
// configurations of src/merge.rs and src/layout.rs; then self-tests showing that the emulator
// itself catches the bug classes it claims to (a check that cannot fail proves nothing).
#include "harness.h"

#include <algorithm>

#define LAYOUT_DECL(N, TY)                                                                                \
  void seq_permute_##N(const TY*, TY*, int, long long, long long, long long, long long, long long,       \
                       long long, long long);                                                             \
  void a2a_pack_##N(const TY*, TY*, long long, long long, long long);                                     \
  void a2a_unpack_##N(const TY*, TY*, long long, long long, long long);
#define MERGE_DECL(N, TY)                                                                                 \
  void merge_step_##N(const float*, const float*, const TY*, const float*, float*, float*, int, int, int, int); \
  void merge_rows_inplace_##N(float*, const TY*, const float*, int, int, int, int, int, int);                 \
  void add_rows_inplace_##N(float*, const TY*, int, int, int, int, int, long long);                           \
  void cast_out_##N(const float*, TY*, size_t);
extern "C" {
LAYOUT_DECL(f32, float)
LAYOUT_DECL(f16, __half)
LAYOUT_DECL(bf16, __nv_bfloat16)
LAYOUT_DECL(u32, unsigned int)
LAYOUT_DECL(u8, unsigned char)
MERGE_DECL(f32, float)
MERGE_DECL(f16, __half)
MERGE_DECL(bf16, __nv_bfloat16)
}

namespace {

unsigned grid_stride_blocks(size_t n) { return (unsigned)std::min<size_t>(std::max<size_t>((n + 255) / 256, 1), 65535); }

// ---------------------------------------------------------------- merge
// merge_rows_inplace_*: blocks of n rows folded into rows [row0, row0 + n) of a state of T rows
// held in one buffer (out [B, T, H, D], then lse [B, H, T]), in place, as src/merge.rs launches it
// (grid ceil(B*n*H / 4), block 128): two overlapping segments after a full one, -inf rows on one
// side, both sides and neither; rows outside every segment must keep their bits.
template <typename TY>
void check_merge_rows(const char* sfx, void (*k)(float*, const TY*, const float*, int, int, int, int, int, int),
                      uint64_t seed) {
  const int B = 2, T = 41, H = 3, D = 40;
  const std::string name = std::string("merge_rows_inplace_") + sfx + " [b2 t41 h3 d40, rows 0+41, 6+20, 19+15]";
  if (!wanted(name)) return;
  const size_t no = (size_t)B * T * H * D, nl = (size_t)B * H * T;
  Buf<float> st(no + nl);
  std::vector<double> ref = fill(st, randn(no + nl, seed));
  for (size_t i = 0; i < nl; ++i) {
    double& l = ref[no + i];
    l = i % 9 == 4 ? -INFINITY : 3 * l;
    if (l == -INFINITY)  // a row that saw no key so far holds out 0 (as the ring's state does)
      for (int d = 0; d < D; ++d) {
        const size_t b = i / ((size_t)H * T), h = i / T % H, t = i % T;
        ref[((b * T + t) * H + h) * D + d] = 0;
      }
  }
  ref = fill(st, ref);
  const int segs[3][2] = {{0, T}, {6, 20}, {19, 15}};
  bool ok = true;
  for (int sg = 0; sg < 3 && ok; ++sg) {
    const int row0 = segs[sg][0], n = segs[sg][1];
    Buf<TY> bo((size_t)B * n * H * D);
    Buf<float> bl((size_t)B * H * n);
    auto bod = fill(bo, randn(bo.n, seed + 10 + sg));
    auto bld = randn(bl.n, seed + 20 + sg);
    for (size_t i = 0; i < bl.n; ++i) {
      bld[i] *= 3;
      if (i % 5 == (size_t)(2 + sg)) bld[i] = -INFINITY;
    }
    bld = fill(bl, bld);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < H; ++h) {
          const size_t li = no + ((size_t)b * H + h) * T + row0 + i, lb_i = ((size_t)b * H + h) * n + i;
          const double la = ref[li], lb = bld[lb_i], mx = std::max(la, lb);
          if (mx == -INFINITY) continue;
          const double l = mx + std::log(std::exp(la - mx) + std::exp(lb - mx));
          const double wa = std::exp(la - l), wb = std::exp(lb - l);
          ref[li] = l;
          const size_t ao = (((size_t)b * T + row0 + i) * H + h) * D, bo_ = (((size_t)b * n + i) * H + h) * D;
          for (int d = 0; d < D; ++d) ref[ao + d] = wa * ref[ao + d] + wb * bod[bo_ + d];
        }
    ok = cp_emu::launch(name.c_str(), dim3((unsigned)((B * n * H + 3) / 4)), dim3(128), 0,
                        [&] { k(st.p, bo.p, bl.p, B, T, row0, n, H, D); });
  }
  check_launch(name, ok);
  if (!ok) return;
  const std::vector<float> got = st.to_f32();
  const std::vector<double> ro(ref.begin(), ref.begin() + no), rl(ref.begin() + no, ref.end());
  check(name + " out", max_abs(std::vector<float>(got.begin(), got.begin() + no), ro), 1e-5);
  check(name + " lse", max_abs(std::vector<float>(got.begin() + no, got.end()), rl), 1e-5);
}

// add_rows_inplace_*: blocks added to rows of one plane of acc [P, B, R, H*D] f32 as src/merge.rs
// launches it (grid-stride, block 256, a grid smaller than the work so the stride loop runs):
// overlapping blocks on both planes; every other element keeps its bits.
template <typename TY>
void check_add_rows(const char* sfx, void (*k)(float*, const TY*, int, int, int, int, int, long long), uint64_t seed) {
  const int P = 2, B = 2, R = 23, H = 3, D = 20;
  const long long hd = (long long)H * D;
  const std::string name = std::string("add_rows_inplace_") + sfx + " [p2 b2 r23 h3 d20, 4 blocks]";
  if (!wanted(name)) return;
  Buf<float> acc((size_t)P * B * R * hd);
  std::vector<double> ref = fill(acc, randn(acc.n, seed));
  const int blocks[4][3] = {{0, 3, 11}, {0, 9, 14}, {1, 0, 23}, {0, 3, 2}};  // plane, row0, n
  bool ok = true;
  for (int k_ = 0; k_ < 4 && ok; ++k_) {
    const int plane = blocks[k_][0], row0 = blocks[k_][1], n = blocks[k_][2];
    Buf<TY> x((size_t)B * n * hd);
    auto xd = fill(x, randn(x.n, seed + 1 + k_));
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < n; ++i)
        for (long long c = 0; c < hd; ++c)
          ref[(((size_t)plane * B + b) * R + row0 + i) * hd + c] += xd[((size_t)b * n + i) * hd + c];
    ok = cp_emu::launch(name.c_str(), dim3(3), dim3(256), 0, [&] { k(acc.p, x.p, B, R, plane, row0, n, hd); });
  }
  check_launch(name, ok);
  if (ok) check(name, max_abs(acc.to_f32(), ref), 1e-5);
}

template <typename TY>
void check_merge(const char* sfx, void (*step)(const float*, const float*, const TY*, const float*, float*, float*, int, int, int, int),
                 void (*cast)(const float*, TY*, size_t), bool alias, uint64_t seed) {
  const int B = 2, T = 37, H = 3, D = 48;
  const size_t no = (size_t)B * T * H * D, nl = (size_t)B * H * T;
  const std::string name = std::string("merge_step_") + sfx + (alias ? " (in place)" : "") + " [b2 t37 h3 d48]";
  if (!wanted(name)) return;
  Buf<float> ao(no), al(nl), bl(nl), no_(no), nl_(nl);
  Buf<TY> bo(no);
  auto aod = fill(ao, randn(no, seed)), bod = fill(bo, randn(no, seed + 1));
  auto ald = randn(nl, seed + 2), bld = randn(nl, seed + 3);
  for (size_t i = 0; i < nl; ++i) {  // -inf on one side, both sides, neither
    if (i % 7 == 1) ald[i] = -INFINITY;
    if (i % 5 == 2) bld[i] = -INFINITY;
    if (i % 11 == 3) ald[i] = bld[i] = -INFINITY;
    ald[i] *= 3, bld[i] *= 3;
  }
  ald = fill(al, ald);
  bld = fill(bl, bld);
  std::vector<double> ro(no), rl(nl);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < T; ++i)
      for (int h = 0; h < H; ++h) {
        const size_t li = ((size_t)b * H + h) * T + i, row = ((size_t)b * T + i) * H + h;
        const double la = ald[li], lb = bld[li], mx = std::max(la, lb);
        double wa = 0, wb = 0, l = -INFINITY;
        if (mx != -INFINITY) {
          l = mx + std::log(std::exp(la - mx) + std::exp(lb - mx));
          wa = std::exp(la - l), wb = std::exp(lb - l);
        }
        rl[li] = l;
        for (int d = 0; d < D; ++d) ro[row * D + d] = wa * aod[row * D + d] + wb * bod[row * D + d];
      }
  float* out_o = alias ? ao.p : no_.p;
  float* out_l = alias ? al.p : nl_.p;
  bool ok = cp_emu::launch(name.c_str(), dim3((unsigned)((B * T * H + 3) / 4)), dim3(128), 0,
                           [&] { step(ao.p, al.p, bo.p, bl.p, out_o, out_l, B, T, H, D); });
  check_launch(name, ok);
  if (!ok) return;
  check(name + " out", max_abs((alias ? ao : no_).to_f32(), ro), 1e-5);
  check(name + " lse", max_abs((alias ? al : nl_).to_f32(), rl), 1e-5);
  // final cast, exact rounding to nearest even
  const std::string cname = std::string("cast_out_") + sfx + " [n " + std::to_string(no) + "]";
  Buf<TY> co(no);
  const Buf<float>& src = alias ? ao : no_;
  ok = cp_emu::launch(cname.c_str(), dim3(grid_stride_blocks(no)), dim3(256), 0, [&] { cast(src.p, co.p, no); });
  check_launch(cname, ok);
  if (!ok) return;
  std::vector<double> rc(no);
  for (size_t e = 0; e < no; ++e) rc[e] = to_d(to_t<TY>(src.p[e]));
  check(cname, max_abs(co.to_f32(), rc), 0.0);
}

// ---------------------------------------------------------------- layout
template <typename TY> using SeqFn = void (*)(const TY*, TY*, int, long long, long long, long long, long long, long long, long long, long long);
template <typename TY> using SwapFn = void (*)(const TY*, TY*, long long, long long, long long);

template <typename TY> std::vector<TY> rand_bits(size_t n, uint64_t seed) {
  std::vector<TY> v(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& x : v) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    std::memcpy((void*)&x, &s, sizeof(TY));
  }
  return v;
}

template <typename TY> bool same_bits(const TY* a, const std::vector<TY>& b) {
  return std::memcmp((const void*)a, (const void*)b.data(), b.size() * sizeof(TY)) == 0;
}

// Global row order of rank r's shard (independent of the kernel's formula).
std::vector<long> shard_rows(bool zigzag, long L, long P, long r) {
  std::vector<long> rows;
  if (zigzag) {
    const long c = L / (2 * P);
    for (long i = 0; i < c; ++i) rows.push_back(r * c + i);
    for (long i = 0; i < c; ++i) rows.push_back((2 * P - 1 - r) * c + i);
  } else {
    for (long i = r; i < L; i += P) rows.push_back(i);
  }
  return rows;
}

template <typename TY> void check_layout(const char* sfx, SeqFn<TY> seq, SwapFn<TY> pack, SwapFn<TY> unpack, uint64_t seed) {
  const long A = 3, L = 48, E = 5, P = 4;
  const auto x = rand_bits<TY>(A * L * E, seed);
  Buf<TY> src(A * L * E);
  std::memcpy((void*)src.p, x.data(), x.size() * sizeof(TY));
  for (int zig = 1; zig >= 0; --zig) {
    const char* lay = zig ? "zigzag" : "striped";
    std::vector<TY> all;  // shards concatenated in rank order, per a: [A, L, E]
    std::vector<std::vector<TY>> shards;
    bool ok_all = true;
    for (long r = 0; r < P; ++r) {
      const auto rows = shard_rows(zig, L, P, r);
      std::vector<TY> ref(A * (L / P) * E);
      for (long a = 0; a < A; ++a)
        for (size_t i = 0; i < rows.size(); ++i)
          for (long e = 0; e < E; ++e) ref[(a * (L / P) + i) * E + e] = x[(a * L + rows[i]) * E + e];
      shards.push_back(ref);
      const std::string name = std::string("seq_permute_") + sfx + " " + lay + " shard P4 r" + std::to_string(r);
      if (!wanted(name)) continue;
      Buf<TY> dst(ref.size());
      bool ok = cp_emu::launch(name.c_str(), dim3(grid_stride_blocks(ref.size())), dim3(256), 0,
                               [&] { seq(src.p, dst.p, zig ? 0 : 1, A, L, L / P, E, L, P, r); });
      check_launch(name, ok);
      if (ok) check(name, same_bits(dst.p, ref) ? 0.0 : 1.0, 0.0);
      ok_all &= ok;
    }
    // unshard: input [A, L, E] with the P shards concatenated along L
    std::vector<TY> cat(A * L * E);
    for (long a = 0; a < A; ++a)
      for (long r = 0; r < P; ++r)
        for (long i = 0; i < L / P; ++i)
          for (long e = 0; e < E; ++e) cat[(a * L + r * (L / P) + i) * E + e] = shards[r][(a * (L / P) + i) * E + e];
    const std::string name = std::string("seq_permute_") + sfx + " " + lay + " unshard P4";
    if (!wanted(name)) continue;
    Buf<TY> csrc(cat.size()), dst(cat.size());
    std::memcpy((void*)csrc.p, cat.data(), cat.size() * sizeof(TY));
    // grid of 2 blocks as well as the launcher's: exercises the grid-stride loop
    for (unsigned grid : {grid_stride_blocks(cat.size()), 2u}) {
      std::memset((void*)dst.p, 0xff, cat.size() * sizeof(TY));
      const std::string n2 = name + " grid " + std::to_string(grid);
      bool ok = cp_emu::launch(n2.c_str(), dim3(grid), dim3(256), 0, [&] { seq(csrc.p, dst.p, zig ? 2 : 3, A, L, L, E, L, P, 0); });
      check_launch(n2, ok);
      if (ok) check(n2, same_bits(dst.p, x) ? 0.0 : 1.0, 0.0);
    }
  }
  // all-to-all pack [A, P, M] -> [P, A, M] and unpack [P, A, M] -> [A, P, M]
  const long M = L / P * E;
  std::vector<TY> packed(A * P * M);
  for (long a = 0; a < A; ++a)
    for (long p = 0; p < P; ++p)
      for (long m = 0; m < M; ++m) packed[(p * A + a) * M + m] = x[(a * P + p) * M + m];
  std::string name = std::string("a2a_pack_") + sfx + " [A3 P4 M60]";
  if (wanted(name)) {
    Buf<TY> dst(packed.size());
    bool ok = cp_emu::launch(name.c_str(), dim3(grid_stride_blocks(packed.size())), dim3(256), 0, [&] { pack(src.p, dst.p, A, P, M); });
    check_launch(name, ok);
    if (ok) check(name, same_bits(dst.p, packed) ? 0.0 : 1.0, 0.0);
  }
  name = std::string("a2a_unpack_") + sfx + " [P4 A3 M60]";
  if (wanted(name)) {
    Buf<TY> psrc(packed.size()), dst(packed.size());
    std::memcpy((void*)psrc.p, packed.data(), packed.size() * sizeof(TY));
    bool ok = cp_emu::launch(name.c_str(), dim3(grid_stride_blocks(packed.size())), dim3(256), 0, [&] { unpack(psrc.p, dst.p, A, P, M); });
    check_launch(name, ok);
    if (ok) check(name, same_bits(dst.p, x) ? 0.0 : 1.0, 0.0);
  }
}

}  // namespace

void run_selftests();

void run_misc_checks() {
  check_merge<float>("f32", merge_step_f32, cast_out_f32, false, 41);
  check_merge<__half>("f16", merge_step_f16, cast_out_f16, true, 42);
  check_merge<__nv_bfloat16>("bf16", merge_step_bf16, cast_out_bf16, false, 43);
  check_merge<__nv_bfloat16>("bf16", merge_step_bf16, cast_out_bf16, true, 44);
  check_merge_rows<float>("f32", merge_rows_inplace_f32, 45);
  check_merge_rows<__half>("f16", merge_rows_inplace_f16, 46);
  check_merge_rows<__nv_bfloat16>("bf16", merge_rows_inplace_bf16, 47);
  check_add_rows<float>("f32", add_rows_inplace_f32, 48);
  check_add_rows<__half>("f16", add_rows_inplace_f16, 49);
  check_add_rows<__nv_bfloat16>("bf16", add_rows_inplace_bf16, 50);
  check_layout<float>("f32", seq_permute_f32, a2a_pack_f32, a2a_unpack_f32, 51);
  check_layout<__half>("f16", seq_permute_f16, a2a_pack_f16, a2a_unpack_f16, 52);
  check_layout<__nv_bfloat16>("bf16", seq_permute_bf16, a2a_pack_bf16, a2a_unpack_bf16, 53);
  check_layout<unsigned int>("u32", seq_permute_u32, a2a_pack_u32, a2a_unpack_u32, 54);
  check_layout<unsigned char>("u8", seq_permute_u8, a2a_pack_u8, a2a_unpack_u8, 55);
  run_selftests();
}
