// Checks candle's own CUDA kernels (candle-kernels 0.11.1, compiled as host C++ under the emulator
// with candle_compat.h, see candle.sh) through the shim's kernel registry: each check looks an
// entry up by name (cp_emu::find_kernel), builds the driver's kernelParams exactly as candle's Rust
// side pushes the arguments (candle-core cuda_backend/mod.rs, sort.rs; candle-nn ops.rs,
// rotary_emb.rs), launches with candle's grid / block / shared memory and compares with a plain
// C++ reference; reduce.cu / sort.cu entries (barriers, shuffles) under every emulator schedule.
// Built and run by check_candle.sh. Usage: check_candle [ENTRY_LIST] [--bench]
// (ENTRY_LIST: one entry name per line, every one must be registered).
#include "check_candle.h"

#include <fstream>

namespace {
using namespace cc;

// ---- elementwise families ---------------------------------------------------------------------
// Unary-shaped entries (numel, num_dims, info|null, inp, out), e.g. cast_*, ucopy_*, uexp_*.
template <typename S, typename D, typename F>
void check_map(const std::string& entry, const View& v, bool strided, F ref, double tol = -1) {
  auto in = rand_vec<S>(v.span());
  std::unique_ptr<Buf<S>> bin(make_buf(in));
  Buf<D> out(v.numel());
  std::unique_ptr<Buf<size_t>> info(make_buf(v.info()));
  Params p;
  p.a(v.numel()).a(v.dims.size()).a(strided ? info->p : (size_t*)nullptr).a(bin->p).a(out.p);
  if (!run(entry, for_num_elems(v.numel()), B1024, 0, p)) return;
  std::vector<double> want(v.numel());
  for (size_t i = 0; i < v.numel(); ++i) want[i] = to_d(from_d<D>(ref(to_d(in[strided ? v.at(i) : i]))));
  compare(entry + (strided ? " strided" : " contiguous"), out.p, want, tol < 0 ? tol_of<D>() : tol);
}

template <typename T> void check_affine(const std::string& entry, bool strided) {
  View v = strided ? transposed(19, 57) : contiguous({3, 1000});
  auto in = rand_vec<T>(v.span(), 0, 9);
  std::unique_ptr<Buf<T>> bin(make_buf(in));
  Buf<T> out(v.numel());
  std::unique_ptr<Buf<size_t>> info(make_buf(v.info()));
  const T mul = from_d<T>(3), add = from_d<T>(2);
  Params p;
  p.a(v.numel()).a(v.dims.size()).a(strided ? info->p : (size_t*)nullptr).a(bin->p).a(out.p).a(mul).a(add);
  if (!run(entry, for_num_elems(v.numel()), B1024, 0, p)) return;
  std::vector<double> want(v.numel());
  for (size_t i = 0; i < v.numel(); ++i) want[i] = to_d(from_d<T>(to_d(in[strided ? v.at(i) : i]) * 3 + 2));
  compare(entry + (strided ? " strided" : " contiguous"), out.p, want, tol_of<T>());
}

// Unary with a parameter before the pointers (uelu / upowf): (numel, num_dims, info, param, inp, out).
void check_powf() {
  const size_t n = 2500;
  auto in = rand_vec<float>(n, 0.1, 3);
  std::unique_ptr<Buf<float>> bin(make_buf(in));
  Buf<float> out(n);
  Params p;
  p.a(n).a((size_t)1).a((size_t*)nullptr).a(1.5f).a(bin->p).a(out.p);
  if (!run("upowf_f32", for_num_elems(n), B1024, 0, p)) return;
  std::vector<double> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = std::pow((double)in[i], 1.5);
  compare("upowf_f32 contiguous", out.p, want, 1e-5);
}

// Binary: (numel, num_dims, dims_and_strides|null, lhs, rhs, out); rhs broadcast when `bcast`.
template <typename T, typename O, typename F> void check_binary(const std::string& entry, bool bcast, F ref) {
  const std::vector<size_t> dims = {4, 33, 40};
  View l = contiguous(dims), r = bcast ? View{dims, {0, 1, 0}} : contiguous(dims);  // rhs [1, 33, 1]
  auto lhs = rand_vec<T>(l.span(), 1, 9), rhs = rand_vec<T>(r.span(), 1, 9);
  std::unique_ptr<Buf<T>> bl(make_buf(lhs)), br(make_buf(rhs));
  Buf<O> out(l.numel());
  std::vector<size_t> ds = dims;
  ds.insert(ds.end(), l.strides.begin(), l.strides.end());
  ds.insert(ds.end(), r.strides.begin(), r.strides.end());
  std::unique_ptr<Buf<size_t>> info(make_buf(ds));
  Params p;
  p.a(l.numel()).a(dims.size()).a(bcast ? info->p : (size_t*)nullptr).a(bl->p).a(br->p).a(out.p);
  if (!run(entry, for_num_elems(l.numel()), B1024, 0, p)) return;
  std::vector<double> want(l.numel());
  for (size_t i = 0; i < l.numel(); ++i) want[i] = to_d(from_d<O>(ref(to_d(lhs[i]), to_d(rhs[r.at(i)]))));
  compare(entry + (bcast ? " broadcast" : " contiguous"), out.p, want, tol_of<O>());
}

// const_set: (numel, num_dims, info|null, value, out) writes out[strided_i].
template <typename T> void check_const_set(const std::string& entry, bool strided) {
  View v = strided ? transposed(30, 41) : contiguous({1234});
  Buf<T> out(v.span());
  for (size_t i = 0; i < v.span(); ++i) out[i] = from_d<T>(-1);
  std::unique_ptr<Buf<size_t>> info(make_buf(v.info()));
  Params p;
  p.a(v.numel()).a(v.dims.size()).a(strided ? info->p : (size_t*)nullptr).a(from_d<T>(7.5)).a(out.p);
  if (!run(entry, for_num_elems(v.numel()), B1024, 0, p)) return;
  std::vector<double> want(v.span(), to_d(from_d<T>(7.5)));
  compare(entry + (strided ? " strided" : " contiguous"), out.p, want, 0);
}

// fill_*: (buf, value, numel).
template <typename T> void check_fill(const std::string& entry) {
  const size_t n = 2100;
  Buf<T> out(n);
  Params p;
  p.a(out.p).a(from_d<T>(-3.25)).a(n);
  if (!run(entry, for_num_elems(n), B1024, 0, p)) return;
  compare(entry, out.p, std::vector<double>(n, to_d(from_d<T>(-3.25))), 0);
}

// copy2d: (src, dst, d1, d2, src_s, dst_s) as u32 scalars.
template <typename T> void check_copy2d(const std::string& entry) {
  const u32 d1 = 37, d2 = 45, src_s = 50, dst_s = 61;
  auto src = rand_vec<T>(d1 * src_s);
  std::unique_ptr<Buf<T>> bs(make_buf(src));
  std::vector<T> dst0(d1 * dst_s, from_d<T>(-5));
  std::unique_ptr<Buf<T>> bd(make_buf(dst0));
  Params p;
  p.a(bs->p).a(bd->p).a(d1).a(d2).a(src_s).a(dst_s);
  if (!run(entry, for_num_elems(d1 * d2), B1024, 0, p)) return;
  std::vector<double> want(d1 * dst_s, -5);
  for (u32 i = 0; i < d1; ++i)
    for (u32 j = 0; j < d2; ++j) want[i * dst_s + j] = to_d(src[i * src_s + j]);
  compare(entry, bd->p, want, 0);
}

// where: (numel, num_dims, info = dims|ids strides|t strides|f strides, ids, t, f, out).
template <typename I, typename T> void check_where(const std::string& entry) {
  const std::vector<size_t> dims = {6, 70, 5};
  View vi = View{dims, {0, 5, 1}}, vt = contiguous(dims), vf = View{dims, {1, 0, 0}};  // ids [1,70,5], f [6,1,1]
  std::vector<I> ids(vi.span());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = (I)((i * 7) % 3 == 0);
  auto t = rand_vec<T>(vt.span()), f = rand_vec<T>(vf.span());
  std::unique_ptr<Buf<I>> bi(make_buf(ids));
  std::unique_ptr<Buf<T>> bt(make_buf(t)), bf(make_buf(f));
  Buf<T> out(vt.numel());
  std::vector<size_t> ds = dims;
  for (const View* v : {&vi, &vt, &vf}) ds.insert(ds.end(), v->strides.begin(), v->strides.end());
  std::unique_ptr<Buf<size_t>> info(make_buf(ds));
  Params p;
  p.a(vt.numel()).a(dims.size()).a(info->p).a(bi->p).a(bt->p).a(bf->p).a(out.p);
  if (!run(entry, for_num_elems(vt.numel()), B1024, 0, p)) return;
  std::vector<double> want(vt.numel());
  for (size_t i = 0; i < vt.numel(); ++i) want[i] = ids[vi.at(i)] ? to_d(t[vt.at(i)]) : to_d(f[vf.at(i)]);
  compare(entry + " broadcast", out.p, want, 0);
}

// index_select: (numel, num_dims, info = ids dims|strides, ids, inp, out, left, src_dim, ids_dim, right).
template <typename I, typename T> void check_index_select(const std::string& entry) {
  const size_t left = 3, src_dim = 50, right = 17, n_ids = 40;
  std::vector<I> ids(n_ids);
  for (size_t i = 0; i < n_ids; ++i) ids[i] = (I)((i * 13 + 5) % src_dim);
  auto inp = rand_vec<T>(left * src_dim * right);
  std::unique_ptr<Buf<I>> bi(make_buf(ids));
  std::unique_ptr<Buf<T>> bin(make_buf(inp));
  const size_t numel = left * n_ids * right;
  Buf<T> out(numel);
  std::unique_ptr<Buf<size_t>> info(make_buf(std::vector<size_t>{n_ids, 1}));
  Params p;
  p.a(numel).a((size_t)1).a(info->p).a(bi->p).a(bin->p).a(out.p).a(left).a(src_dim).a(n_ids).a(right);
  if (!run(entry, for_num_elems(numel), B1024, 0, p)) return;
  std::vector<double> want(numel);
  for (size_t l = 0; l < left; ++l)
    for (size_t k = 0; k < n_ids; ++k)
      for (size_t r = 0; r < right; ++r) want[(l * n_ids + k) * right + r] = to_d(inp[(l * src_dim + ids[k]) * right + r]);
  compare(entry, out.p, want, 0);
}

// index_add: (ids, ids_dim, src, dst, left, src_dim, dst_dim, right); launched over left*right.
template <typename I, typename T> void check_index_add(const std::string& entry) {
  const size_t left = 4, src_dim = 30, dst_dim = 9, right = 300;
  std::vector<I> ids(src_dim);
  for (size_t i = 0; i < src_dim; ++i) ids[i] = (I)((i * 5) % dst_dim);
  auto src = rand_vec<T>(left * src_dim * right), dst = rand_vec<T>(left * dst_dim * right);
  std::unique_ptr<Buf<I>> bi(make_buf(ids));
  std::unique_ptr<Buf<T>> bs(make_buf(src)), bd(make_buf(dst));
  Params p;
  p.a(bi->p).a(src_dim).a(bs->p).a(bd->p).a(left).a(src_dim).a(dst_dim).a(right);
  if (!run(entry, for_num_elems(left * right), B1024, 0, p)) return;
  std::vector<double> want(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) want[i] = to_d(dst[i]);
  for (size_t l = 0; l < left; ++l)
    for (size_t j = 0; j < src_dim; ++j)
      for (size_t r = 0; r < right; ++r) want[(l * dst_dim + ids[j]) * right + r] += to_d(src[(l * src_dim + j) * right + r]);
  compare(entry, bd->p, want, tol_of<T>() * 10);
}

}  // namespace

int main(int argc, char** argv) {
  bool bench = false;
  const char* list = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--bench") == 0) bench = true;
    else list = argv[i];
  }
  if (list) {  // every entry reg.py found must be registered
    std::ifstream f(list);
    std::string name;
    size_t total = 0, missing = 0;
    while (std::getline(f, name))
      if (!name.empty()) ++total, missing += cp_emu::find_kernel(name.c_str(), nullptr) == nullptr;
    report("registry: " + std::to_string(total) + " entries from reg.py --list", total > 0 && missing == 0,
           std::to_string(missing) + " missing");
  }
  // cast (cast_bf16_f32 / cast_f32_bf16 have vectorized contiguous paths; numel 3000 = tail too)
  const View c3000 = contiguous({3, 1000}), t = transposed(23, 61);
  auto id = [](double x) { return x; };
  check_map<bf16, float>("cast_bf16_f32", c3000, false, id);
  check_map<bf16, float>("cast_bf16_f32", t, true, id);
  check_map<float, bf16>("cast_f32_bf16", c3000, false, id);
  check_map<float, bf16>("cast_f32_bf16", t, true, id);
  check_map<f16, float>("cast_f16_f32", c3000, false, id);
  check_map<float, f16>("cast_f32_f16", t, true, id);
  check_map<bf16, f16>("cast_bf16_f16", c3000, false, id);
  check_map<float, double>("cast_f32_f64", t, true, id);
  check_map<double, float>("cast_f64_f32", c3000, false, id);
  check_map<u32, float>("cast_u32_f32", c3000, false, id);
  check_map<float, i64>("cast_f32_i64", c3000, false, [](double x) { return std::trunc(x); });
  check_map<u8, bf16>("cast_u8_bf16", c3000, false, id);
  // copies
  check_map<float, float>("ucopy_f32", t, true, id);
  check_map<bf16, bf16>("ucopy_bf16", c3000, false, id);
  check_map<bf16, bf16>("ucopy_bf16", t, true, id);
  check_map<f16, f16>("ucopy_f16", t, true, id);
  check_map<double, double>("ucopy_f64", t, true, id);
  check_map<u32, u32>("ucopy_u32", t, true, id);
  check_map<i64, i64>("ucopy_i64", t, true, id);
  // unary
  auto ex = [](double x) { return std::exp(x); };
  auto silu = [](double x) { return x / (1 + std::exp(-x)); };
  auto gelu = [](double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); };
  check_map<float, float>("uexp_f32", c3000, false, ex);
  check_map<double, double>("uexp_f64", t, true, ex);
  check_map<bf16, bf16>("uexp_bf16", t, true, ex, 2e-2);
  check_map<f16, f16>("uexp_f16", c3000, false, ex, 4e-3);
  check_map<float, float>("uneg_f32", t, true, [](double x) { return -x; });
  check_map<bf16, bf16>("uneg_bf16", c3000, false, [](double x) { return -x; });
  check_map<float, float>("usqr_f32", c3000, false, [](double x) { return x * x; });
  check_map<bf16, bf16>("usqr_bf16", t, true, [](double x) { return x * x; }, 2e-2);
  check_map<float, float>("usilu_f32", c3000, false, silu);
  check_map<bf16, bf16>("usilu_bf16", c3000, false, silu);  // vectorized path
  check_map<bf16, bf16>("usilu_bf16", t, true, silu);
  check_map<f16, f16>("usilu_f16", c3000, false, silu, 4e-3);
  check_map<float, float>("ugelu_f32", c3000, false, gelu);
  check_map<float, float>("urecip_f32", c3000, false, [](double x) { return 1 / x; }, 1e-4);
  check_map<float, float>("unormcdf_f32", c3000, false, [](double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); });
  check_powf();
  // affine
  check_affine<float>("affine_f32", false);
  check_affine<float>("affine_f32", true);
  check_affine<bf16>("affine_bf16", false);
  check_affine<f16>("affine_f16", true);
  check_affine<double>("affine_f64", true);
  check_affine<u32>("affine_u32", false);
  check_affine<i64>("affine_i64", true);
  // binary (badd/bmul f32 and bf16 have vectorized contiguous paths)
  auto add = [](double a, double b) { return a + b; };
  auto mul = [](double a, double b) { return a * b; };
  check_binary<float, float>("badd_f32", false, add);
  check_binary<float, float>("badd_f32", true, add);
  check_binary<float, float>("bmul_f32", true, mul);
  check_binary<bf16, bf16>("badd_bf16", false, add);
  check_binary<bf16, bf16>("bmul_bf16", false, mul);
  check_binary<bf16, bf16>("bmul_bf16", true, mul);
  check_binary<f16, f16>("badd_f16", true, add);
  check_binary<double, double>("bdiv_f64", true, [](double a, double b) { return a / b; });
  check_binary<u32, u32>("bsub_u32", false, [](double a, double b) { return (double)(u32)((u32)a - (u32)b); });
  check_binary<i64, i64>("bmul_i64", true, mul);
  check_binary<bf16, bf16>("bmaximum_bf16", true, [](double a, double b) { return std::max(a, b); });
  check_binary<float, u8>("lt_f32", true, [](double a, double b) { return (double)(a < b); });
  check_binary<bf16, u8>("ge_bf16", false, [](double a, double b) { return (double)(a >= b); });
  // fill / copy2d
  check_const_set<float>("const_set_f32", false);
  check_const_set<float>("const_set_f32", true);
  check_const_set<bf16>("const_set_bf16", true);
  check_const_set<f16>("const_set_f16", false);
  check_const_set<u32>("const_set_u32", true);
  check_fill<float>("fill_f32");
  check_fill<bf16>("fill_bf16");
  check_fill<i64>("fill_i64");
  check_copy2d<float>("copy2d_f32");
  check_copy2d<bf16>("copy2d_bf16");
  check_copy2d<i64>("copy2d_i64");
  // ternary / indexing
  check_where<u8, float>("where_u8_f32");
  check_where<u32, bf16>("where_u32_bf16");
  check_where<i64, double>("where_i64_f64");
  check_index_select<u32, float>("is_u32_f32");
  check_index_select<i64, bf16>("is_i64_bf16");
  check_index_select<u8, f16>("is_u8_f16");
  check_index_add<u32, float>("ia_u32_f32");
  check_index_add<i64, bf16>("ia_i64_bf16");
  // the entries with barriers / warp shuffles under every thread schedule of the emulator
  // (lockstep, one warp at a time ascending / descending, seeded random; emu.h)
  const std::pair<cp_emu::Schedule, const char*> schedules[] = {
      {cp_emu::Schedule::Lockstep, ""}, {cp_emu::Schedule::WarpsAscending, " [warps ascending]"},
      {cp_emu::Schedule::WarpsDescending, " [warps descending]"}, {cp_emu::Schedule::Random, " [random schedule]"}};
  for (const auto& [sched, label] : schedules) {
    cp_emu::set_schedule(sched, 7);
    sched_label = label;
    rng.seed(777);  // the same data under every schedule
    run_reduce_checks();
  }
  cp_emu::set_schedule(cp_emu::Schedule::Lockstep);
  sched_label.clear();
  if (bench) run_bench();
  std::printf("check_candle: %d passed, %d failed\n", n_pass, n_fail);
  return n_fail ? 1 : 0;
}
