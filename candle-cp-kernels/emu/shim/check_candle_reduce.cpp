// check_candle part 2: candle's reduce.cu (fast reductions, softmax, rmsnorm, layernorm, rope) and
// sort.cu entries under the emulator, launched as candle-core (FastReduce, sort.rs) and candle-nn
// (ops.rs, rotary_emb.rs) launch them; plus --bench timings. See check_candle.cpp.
#include "check_candle.h"

#include <algorithm>
#include <chrono>
#include <numeric>

namespace cc {
namespace {

// FastReduce (candle-core): the reduced dims moved last; info = dims | strides; one block per
// output (block = next_pow2(min(1024, el_to_sum))), or fast_sum_small (256 threads, one per
// output) when summing <= 32 elements.
template <typename T, typename O>
void check_fast(const std::string& kind, const std::string& dt, const View& v, size_t el_to_sum, const std::string& tag) {
  const bool small = kind == "fast_sum" && el_to_sum <= 32;
  const std::string entry = (small ? std::string("fast_sum_small") : kind) + "_" + dt;
  const size_t src_el = v.numel(), dst_el = src_el / el_to_sum;
  std::vector<T> in = rand_vec<T>(v.span());
  if (kind.find("arg") != std::string::npos) {  // distinct values per output (exact in bf16): no ties
    std::vector<size_t> perm(el_to_sum);
    for (size_t o = 0; o < dst_el; ++o) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (size_t k = 0; k < el_to_sum; ++k) in[v.at(o * el_to_sum + k)] = from_d<T>(perm[k] * (std::is_integral<T>::value ? 1 : 0.5));
    }
  }
  std::unique_ptr<Buf<T>> bin(make_buf(in));
  std::unique_ptr<Buf<size_t>> info(make_buf(v.info()));
  Buf<O> out(dst_el);
  Params p;
  p.a(small ? dst_el : src_el).a(el_to_sum).a(v.dims.size()).a(info->p).a(bin->p).a(out.p);
  const size_t bd = small ? 256 : [](size_t n) { size_t b = 1; while (b < n) b <<= 1; return b; }(std::min<size_t>(1024, el_to_sum));
  const dim3 grid(small ? (unsigned)((dst_el + 255) / 256) : (unsigned)dst_el, 1, 1);
  if (!run(entry, grid, dim3((unsigned)bd, 1, 1), 0, p)) return;
  std::vector<double> want(dst_el), scale(dst_el, 1.0);
  for (size_t o = 0; o < dst_el; ++o) {
    double acc = kind == "fast_sum" ? 0 : to_d(in[v.at(o * el_to_sum)]);
    size_t arg = 0;
    for (size_t k = 0; k < el_to_sum; ++k) {
      const double x = to_d(in[v.at(o * el_to_sum + k)]);
      if (kind == "fast_sum") acc += x, scale[o] += std::fabs(x);
      else if ((kind == "fast_max" || kind == "fast_argmax") ? x > acc : x < acc) acc = x, arg = k;
    }
    want[o] = kind.find("arg") != std::string::npos ? (double)arg : to_d(from_d<O>(acc));
  }
  // sums: error relative to sum |x| (f16 accumulates in f16: ~log2(n) roundings of 2^-11)
  const double tol = kind == "fast_sum" && !std::is_integral<T>::value ? (std::is_same<T, double>::value ? 1e-14 : std::is_same<T, float>::value ? 1e-6 : 8e-3) : 0;
  compare(entry + " " + tag, out.p, want, tol, kind == "fast_sum" ? &scale : nullptr);
}

// SUM_OP (atomicAdd): info = dims | strides | sum dims | sum strides (contiguous output strides).
void check_sum_op() {
  const std::vector<size_t> dims = {4, 6, 5};
  View v = contiguous(dims);
  auto in = rand_vec<float>(v.numel());
  std::vector<size_t> ds = v.info();
  ds.push_back(6), ds.push_back(5);  // sum over dim 1 (size 6, stride 5)
  std::unique_ptr<Buf<float>> bin(make_buf(in));
  std::unique_ptr<Buf<size_t>> info(make_buf(ds));
  std::unique_ptr<Buf<float>> out(make_buf(std::vector<float>(20, 0.f)));
  Params p;
  p.a(v.numel()).a(dims.size()).a((size_t)1).a(info->p).a(bin->p).a(out->p);
  if (!run("sum_f32", for_num_elems(v.numel()), B1024, 0, p)) return;
  std::vector<double> want(20, 0);
  for (size_t i = 0; i < 4; ++i)
    for (size_t j = 0; j < 6; ++j)
      for (size_t k = 0; k < 5; ++k) want[i * 5 + k] += in[(i * 6 + j) * 5 + k];
  compare("sum_f32 (atomicAdd)", out->p, want, 1e-5);
}

// softmax (candle-nn softmax_last_dim): grid (rows), block (1, 32, 1); (src, dst, n_cols: i32).
template <typename T> void check_softmax(const std::string& entry, size_t rows, size_t cols, double tol) {
  auto in = rand_vec<T>(rows * cols, -4, 4);
  std::unique_ptr<Buf<T>> bin(make_buf(in));
  Buf<T> out(rows * cols);
  Params p;
  p.a(bin->p).a(out.p).a((int)cols);
  if (!run(entry, dim3((unsigned)rows, 1, 1), dim3(1, 32, 1), 0, p)) return;
  std::vector<double> want(rows * cols);
  for (size_t r = 0; r < rows; ++r) {
    double m = -INFINITY, s = 0;
    for (size_t c = 0; c < cols; ++c) m = std::max(m, to_d(in[r * cols + c]));
    for (size_t c = 0; c < cols; ++c) s += std::exp(to_d(in[r * cols + c]) - m);
    for (size_t c = 0; c < cols; ++c) want[r * cols + c] = std::exp(to_d(in[r * cols + c]) - m) / s;
  }
  compare(entry + " [" + std::to_string(rows) + "x" + std::to_string(cols) + "]", out.p, want, tol);
}

// rmsnorm / layernorm (candle-nn): grid (rows), block (32 if cols < 1024 else 1024);
// (src, dst, alpha, [beta,] n_cols: i32, block_size: i32, eps: f32).
template <typename T> void check_norm(bool layer, const std::string& entry, size_t rows, size_t cols, double tol) {
  auto in = rand_vec<T>(rows * cols, -3, 3), alpha = rand_vec<T>(cols, 0.5, 1.5), beta = rand_vec<T>(cols, -1, 1);
  std::unique_ptr<Buf<T>> bin(make_buf(in)), ba(make_buf(alpha)), bb(make_buf(beta));
  Buf<T> out(rows * cols);
  const int bs = cols < 1024 ? 32 : 1024;
  const float eps = 1e-5f;
  Params p;
  p.a(bin->p).a(out.p).a(ba->p);
  if (layer) p.a(bb->p);
  p.a((int)cols).a(bs).a(eps);
  if (!run(entry, dim3((unsigned)rows, 1, 1), dim3((unsigned)bs, 1, 1), 0, p)) return;
  std::vector<double> want(rows * cols);
  for (size_t r = 0; r < rows; ++r) {
    double mean = 0, sq = 0;
    for (size_t c = 0; c < cols; ++c) mean += to_d(in[r * cols + c]), sq += to_d(in[r * cols + c]) * to_d(in[r * cols + c]);
    mean /= cols, sq /= cols;
    const double scale = layer ? 1 / std::sqrt(sq - mean * mean + eps) : 1 / std::sqrt(sq + eps);
    for (size_t c = 0; c < cols; ++c) {
      const double x = to_d(in[r * cols + c]);
      want[r * cols + c] = layer ? (x - mean) * scale * to_d(alpha[c]) + to_d(beta[c]) : x * scale * to_d(alpha[c]);
    }
  }
  compare(entry + " [" + std::to_string(rows) + "x" + std::to_string(cols) + "] block " + std::to_string(bs), out.p, want, tol);
}

// rope variants (candle-nn rotary_emb.rs), launched over el / 2 threads. kind: "rope_i"
// (interleaved pairs), "rope" (halves), "rope_thd" (src [b, t, h, d]). cos/sin [t, d/2], or
// [b, t, d/2] with stride_b = h*t*d when per_batch.
template <typename T> void check_rope(const std::string& kind, const std::string& dt, bool per_batch, double tol) {
  const size_t b = 2, h = 3, t = 5, d = 8, el = b * h * t * d, half = d / 2;
  auto src = rand_vec<T>(el), cs = rand_vec<T>((per_batch ? b : 1) * t * half, -1, 1), sn = rand_vec<T>(cs.size(), -1, 1);
  std::unique_ptr<Buf<T>> bs(make_buf(src)), bc(make_buf(cs)), bn(make_buf(sn));
  Buf<T> out(el);
  const u32 stride_b = per_batch ? (u32)(h * t * d) : 0;
  Params p;
  p.a(bs->p).a(bc->p).a(bn->p).a(out.p);
  if (kind == "rope_i") p.a((u32)(b * h)).a((u32)(t * d)).a(stride_b);
  else if (kind == "rope") p.a((u32)(b * h)).a((u32)(t * d)).a((u32)d).a(stride_b);
  else p.a((u32)b).a((u32)t).a((u32)h).a((u32)d).a(stride_b);
  const std::string entry = kind + "_" + dt;
  if (!run(entry, for_num_elems(el / 2), B1024, 0, p)) return;
  std::vector<double> want(el);
  for (size_t ib = 0; ib < b; ++ib)
    for (size_t ih = 0; ih < h; ++ih)
      for (size_t it = 0; it < t; ++it)
        for (size_t i = 0; i < half; ++i) {
          const size_t row = kind == "rope_thd" ? ((ib * t + it) * h + ih) * d : ((ib * h + ih) * t + it) * d;
          const size_t i1 = row + (kind == "rope_i" ? 2 * i : i), i2 = kind == "rope_i" ? i1 + 1 : i1 + half;
          const size_t ci = (per_batch ? ib * t * half : 0) + it * half + i;
          const double x1 = to_d(src[i1]), x2 = to_d(src[i2]), c = to_d(cs[ci]), s = to_d(sn[ci]);
          want[i1] = x1 * c - x2 * s, want[i2] = x1 * s + x2 * c;
        }
  compare(entry + (per_batch ? " per-batch cos/sin" : ""), out.p, want, tol);
}

// asort (candle-core sort.rs): grid (rows), block min(ncols_pad, 1024), ncols_pad * 4 bytes of
// dynamic shared memory; (x, dst, ncols: i32, ncols_pad: i32). Distinct values (no ties).
template <typename T> void check_sort(const std::string& dt, bool asc, size_t rows, size_t cols) {
  std::vector<T> x(rows * cols);
  std::vector<size_t> perm(cols);
  for (size_t r = 0; r < rows; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (size_t c = 0; c < cols; ++c) x[r * cols + c] = from_d<T>(std::is_integral<T>::value ? (double)perm[c] : perm[c] * 0.5 - 7);
  }
  size_t pad = 1;
  while (pad < cols) pad <<= 1;
  std::unique_ptr<Buf<T>> bx(make_buf(x));
  Buf<u32> out(rows * cols);
  Params p;
  p.a(bx->p).a(out.p).a((int)cols).a((int)pad);
  const std::string entry = std::string(asc ? "asort_asc_" : "asort_desc_") + dt;
  if (!run(entry, dim3((unsigned)rows, 1, 1), dim3((unsigned)std::min<size_t>(pad, 1024), 1, 1), pad * 4, p)) return;
  std::vector<double> want(rows * cols);
  for (size_t r = 0; r < rows; ++r) {
    std::vector<u32> idx(cols);
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](u32 a, u32 b) {
      const double xa = to_d(x[r * cols + a]), xb = to_d(x[r * cols + b]);
      return asc ? xa < xb : xa > xb;
    });
    for (size_t c = 0; c < cols; ++c) want[r * cols + c] = idx[c];
  }
  compare(entry + " [" + std::to_string(rows) + "x" + std::to_string(cols) + "]", out.p, want, 0);
}

}  // namespace

void run_reduce_checks() {
  const View c5x3000 = contiguous({5, 3000}), t5x300 = transposed(5, 300), c4x2001 = contiguous({4, 2001});
  const View dim0{{7, 40}, {1, 7}};          // a [40, 7] buffer reduced over dim 0
  const View small{{300, 8}, {1, 300}};      // [8, 300] buffer reduced over dim 0: 8 per output
  check_fast<float, float>("fast_sum", "f32", c5x3000, 3000, "contiguous");
  check_fast<float, float>("fast_sum", "f32", t5x300, 300, "strided");
  check_fast<float, float>("fast_sum", "f32", dim0, 40, "over dim 0");
  check_fast<bf16, bf16>("fast_sum", "bf16", c4x2001, 2001, "contiguous");
  check_fast<bf16, bf16>("fast_sum", "bf16", t5x300, 300, "strided");
  check_fast<f16, f16>("fast_sum", "f16", c4x2001, 2001, "contiguous");
  check_fast<double, double>("fast_sum", "f64", t5x300, 300, "strided");
  check_fast<u32, u32>("fast_sum", "u32", c4x2001, 2001, "contiguous");
  check_fast<float, float>("fast_sum", "f32", small, 8, "small");
  check_fast<bf16, bf16>("fast_sum", "bf16", small, 8, "small");
  check_fast<float, float>("fast_max", "f32", c5x3000, 3000, "contiguous");
  check_fast<float, float>("fast_min", "f32", t5x300, 300, "strided");
  check_fast<bf16, bf16>("fast_max", "bf16", c4x2001, 2001, "contiguous");
  check_fast<f16, f16>("fast_min", "f16", dim0, 40, "over dim 0");
  check_fast<double, double>("fast_max", "f64", t5x300, 300, "strided");
  check_fast<u32, u32>("fast_max", "u32", c4x2001, 2001, "contiguous");
  check_fast<i64, i64>("fast_min", "i64", dim0, 40, "over dim 0");
  check_fast<float, u32>("fast_argmax", "f32", c5x3000, 3000, "contiguous");
  check_fast<float, u32>("fast_argmin", "f32", t5x300, 300, "strided");
  check_fast<bf16, u32>("fast_argmax", "bf16", contiguous({3, 200}), 200, "contiguous");
  check_fast<u32, u32>("fast_argmax", "u32", contiguous({3, 200}), 200, "contiguous");
  check_fast<double, u32>("fast_argmin", "f64", contiguous({6, 77}), 77, "contiguous");
  check_sum_op();
  check_softmax<float>("softmax_f32", 7, 300, 1e-5);
  check_softmax<double>("softmax_f64", 3, 1000, 1e-12);
  check_softmax<bf16>("softmax_bf16", 5, 260, 2e-2);
  check_softmax<f16>("softmax_f16", 5, 260, 3e-3);
  check_norm<float>(false, "rmsnorm_f32", 5, 300, 1e-5);
  check_norm<float>(false, "rmsnorm_f32", 3, 2048, 1e-5);
  check_norm<bf16>(false, "rmsnorm_bf16", 3, 1536, 2e-2);
  check_norm<f16>(false, "rmsnorm_f16", 4, 100, 3e-3);
  check_norm<double>(false, "rmsnorm_f64", 2, 1024, 1e-6);
  check_norm<float>(true, "layernorm_f32", 5, 300, 1e-4);
  check_norm<float>(true, "layernorm_f32", 3, 1100, 1e-4);
  check_norm<bf16>(true, "layernorm_bf16", 3, 2048, 3e-2);
  for (const char* k : {"rope_i", "rope", "rope_thd"}) {
    check_rope<float>(k, "f32", false, 1e-5);
    check_rope<float>(k, "f32", true, 1e-5);
    check_rope<bf16>(k, "bf16", false, 3e-2);
  }
  check_rope<f16>("rope", "f16", true, 4e-3);
  check_rope<double>("rope_thd", "f64", false, 1e-12);
  check_sort<float>("f32", true, 3, 100);
  check_sort<float>("f32", false, 2, 1500);
  check_sort<bf16>("bf16", true, 2, 200);
  check_sort<u32>("u32", false, 3, 64);
}

// Wall time of single launches at sizes candle workloads reach (printed, not checked).
void run_bench() {
  const size_t n = 1 << 20;
  auto time = [](const std::string& what, const std::string& entry, dim3 g, dim3 b, Params& p) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool ok = run(entry, g, b, 0, p);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("BENCH %-44s %9.1f ms%s\n", what.c_str(), ms, ok ? "" : " (failed)");
  };
  std::unique_ptr<Buf<float>> f(make_buf(rand_vec<float>(n)));
  std::unique_ptr<Buf<float>> f2(make_buf(rand_vec<float>(n)));
  Buf<bf16> h(n);
  Buf<float> o(n);
  {
    Params p;
    p.a(n).a((size_t)1).a((size_t*)nullptr).a(f->p).a(h.p);
    time("cast_f32_bf16 1M contiguous (1024 blocks)", "cast_f32_bf16", for_num_elems(n), B1024, p);
  }
  {
    Params p;
    p.a(n).a((size_t)1).a((size_t*)nullptr).a(h.p).a(o.p);
    time("cast_bf16_f32 1M contiguous", "cast_bf16_f32", for_num_elems(n), B1024, p);
  }
  {
    Params p;
    p.a((size_t)1000).a((size_t)1).a((size_t*)nullptr).a(h.p).a(o.p);
    time("cast_bf16_f32 1000 el (one 1024-thread block)", "cast_bf16_f32", for_num_elems(1000), B1024, p);
  }
  {
    View v = transposed(1024, 1024);
    std::unique_ptr<Buf<size_t>> info(make_buf(v.info()));
    Params p;
    p.a(n).a((size_t)2).a(info->p).a(f->p).a(o.p);
    time("ucopy_f32 1M strided (transpose)", "ucopy_f32", for_num_elems(n), B1024, p);
  }
  {
    Params p;
    p.a(n).a((size_t)1).a((size_t*)nullptr).a(f->p).a(f2->p).a(o.p);
    time("badd_f32 1M contiguous", "badd_f32", for_num_elems(n), B1024, p);
  }
  {
    Params p;
    p.a(f->p).a(o.p).a((int)1024);
    time("softmax_f32 [1024x1024] (block 1x32)", "softmax_f32", dim3(1024, 1, 1), dim3(1, 32, 1), p);
  }
  {
    Params p;
    p.a(f->p).a(o.p).a(f2->p).a((int)1024).a((int)1024).a(1e-5f);
    time("rmsnorm_f32 [1024x1024] (block 1024)", "rmsnorm_f32", dim3(1024, 1, 1), B1024, p);
  }
  {
    View v = contiguous({1024, 1024});
    std::unique_ptr<Buf<size_t>> info(make_buf(v.info()));
    Params p;
    p.a(n).a((size_t)1024).a((size_t)2).a(info->p).a(f->p).a(o.p);
    time("fast_sum_f32 [1024x1024] -> [1024]", "fast_sum_f32", dim3(1024, 1, 1), B1024, p);
  }
}

}  // namespace cc
