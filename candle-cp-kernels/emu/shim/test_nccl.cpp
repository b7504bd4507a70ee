// Tests of the shim's libnccl (nccl.cpp): ranks are threads of this process. Every collective
// and send/recv pattern is checked element by element against a reference computed here in
// double (inputs are small integers, so every datatype represents the exact result), for
// P = 1..4; then init (blocking, non-blocking, grouped, missing rank), abort, mismatch and
// argument errors. Prints PASS/FAIL per check; exit status 1 on any failure. test_nccl.sh runs
// it once per transport (CPEMU_NCCL_TRANSPORT unset = threads, then files: the same checks, the
// ranks still threads, their operations going through files; plus a check that no directory
// is left behind). Build/run: test_nccl.sh (CPEMU_WAIT_TIMEOUT_S bounds the missing-rank wait).
#include <dirent.h>

#include "test_nccl.h"

namespace {

void test_codecs() {
  std::string e;
  const struct { float f; uint32_t h; } f16[] = {{1.f, 0x3c00}, {-2.f, 0xc000}, {65504.f, 0x7bff}, {65520.f, 0x7c00},
                                               {5.960464477539063e-08f, 0x0001}, {-0.f, 0x8000}, {0.333251953125f, 0x3555}};
  for (auto& c : f16)
    if (float_to_f16(c.f) != c.h) e += fmt("f16(%g) = 0x%x want 0x%x; ", c.f, float_to_f16(c.f), c.h);
  const struct { float f; uint32_t h; } bf[] = {{1.f, 0x3f80}, {-2.f, 0xc000}, {1.00390625f, 0x3f80}, {1.01171875f, 0x3f82}};
  for (auto& c : bf)
    if (float_to_bf16(c.f) != c.h) e += fmt("bf16(%g) = 0x%x want 0x%x; ", c.f, float_to_bf16(c.f), c.h);
  const struct { float f; uint32_t h; } e4[] = {{1.f, 0x38}, {448.f, 0x7e}, {1000.f, 0x7e}, {-448.f, 0xfe}, {0.001953125f, 0x01}, {17.f, 0x58}};
  for (auto& c : e4)
    if (float_to_e4m3(c.f) != c.h) e += fmt("e4m3(%g) = 0x%x want 0x%x; ", c.f, float_to_e4m3(c.f), c.h);
  const struct { float f; uint32_t h; } e5[] = {{1.f, 0x3c}, {57344.f, 0x7b}, {1e6f, 0x7b}, {1.52587890625e-05f, 0x01}};
  for (auto& c : e5)
    if (float_to_e5m2(c.f) != c.h) e += fmt("e5m2(%g) = 0x%x want 0x%x; ", c.f, float_to_e5m2(c.f), c.h);
  for (uint32_t c = 0; c < 65536 && e.size() < 400; ++c) {  // every finite code round-trips
    float f = f16_to_float(static_cast<uint16_t>(c));
    if (std::isfinite(f) && float_to_f16(f) != c) e += fmt("f16 code 0x%x -> %g -> 0x%x; ", c, f, float_to_f16(f));
    if (c < 256) {
      float a = e4m3_to_float(static_cast<uint8_t>(c)), b = e5m2_to_float(static_cast<uint8_t>(c));
      if (std::isfinite(a) && float_to_e4m3(a) != c) e += fmt("e4m3 code 0x%x -> %g; ", c, a);
      if (std::isfinite(b) && float_to_e5m2(b) != c) e += fmt("e5m2 code 0x%x -> %g; ", c, b);
    }
  }
  report("codecs: f16/bf16/fp8 conversions (known values, round trip of every finite code)", e);
}

std::string sync(void* s) { return check_rc("cuStreamSynchronize", cuStreamSynchronize(s), 0); }

// all-reduce: every datatype x sum/prod/max/min (exact); 48 operations in flight, one sync.
std::string allreduce_all(int rank, int P, ncclComm_t c, void* s) {
  std::vector<Buf> in, out;
  for (int dt = 0; dt < ncclNumTypes; ++dt)
    for (int op = 0; op < 4; ++op) {
      in.emplace_back(N, dt);
      out.emplace_back(N, dt);
      in.back().fill(rank, dt * 4 + op, N);
    }
  for (int k = 0; k < ncclNumTypes * 4; ++k)
    TRY(ncclAllReduce(in[k].p(), out[k].p(), N, ncclDataType_t(k / 4), ncclRedOp_t(k % 4), c, cudaStream_t(s)));
  TRY(cuStreamSynchronize(s));
  std::string e;
  for (int k = 0; k < ncclNumTypes * 4 && e.empty(); ++k) {
    const int dt = k / 4, op = k % 4;
    expect(e, fmt("%s %s", dtype_name(dt), op_name(op)).c_str(), rank, out[k], 0, N, [&](size_t i) { return ref_reduce(P, i, k, dt, op); });
  }
  return e;
}

// avg (f32, f64, f16, bf16) and in-place sum/max (f32, bf16, f64).
std::string allreduce_avg_inplace(int rank, int P, ncclComm_t c, void* s) {
  const int dts[] = {ncclFloat32, ncclFloat64, ncclFloat16, ncclBfloat16};
  const double tol[] = {1e-6, 1e-12, 1e-3, 8e-3};
  std::string e;
  for (int k = 0; k < 4 && e.empty(); ++k) {
    Buf in(N, dts[k]), out(N, dts[k]);
    in.fill(rank, 50 + k, N);
    TRY(ncclAllReduce(in.p(), out.p(), N, ncclDataType_t(dts[k]), ncclAvg, c, cudaStream_t(s)));
    TRY(cuStreamSynchronize(s));
    expect(e, fmt("avg %s", dtype_name(dts[k])).c_str(), rank, out, 0, N, [&](size_t i) { return ref_reduce(P, i, 50 + k, dts[k], ncclAvg); }, tol[k]);
  }
  for (int k = 0; k < 3 && e.empty(); ++k)
    for (int op : {ncclSum, ncclMax}) {
      Buf b(N, dts[k == 2 ? 3 : k]);
      b.fill(rank, 60 + k + op, N);
      TRY(ncclAllReduce(b.p(), b.p(), N, ncclDataType_t(b.dt), ncclRedOp_t(op), c, cudaStream_t(s)));
      TRY(cuStreamSynchronize(s));
      expect(e, fmt("in-place %s %s", dtype_name(b.dt), op_name(op)).c_str(), rank, b, 0, N, [&](size_t i) { return ref_reduce(P, i, 60 + k + op, b.dt, op); });
    }
  return e;
}

std::string allgather(int rank, int P, ncclComm_t c, void* s) {
  std::string e;
  for (int dt : {ncclFloat32, ncclBfloat16, ncclInt64}) {
    Buf in(N, dt), out(N * P, dt), inplace(N * P, dt);
    in.fill(rank, dt, N);
    inplace.fill(rank, dt, N, rank * N);
    TRY(ncclAllGather(in.p(), out.p(), N, ncclDataType_t(dt), c, cudaStream_t(s)));
    TRY(ncclAllGather(inplace.p(rank * N), inplace.p(), N, ncclDataType_t(dt), c, cudaStream_t(s)));
    TRY(cuStreamSynchronize(s));
    for (int k = 0; k < P; ++k) {
      expect(e, fmt("%s block %d", dtype_name(dt), k).c_str(), rank, out, k * N, N, [&](size_t i) { return val(k, i, dt, dt); });
      expect(e, fmt("in-place %s block %d", dtype_name(dt), k).c_str(), rank, inplace, k * N, N, [&](size_t i) { return val(k, i, dt, dt); });
    }
  }
  return e;
}

std::string reduce_scatter(int rank, int P, ncclComm_t c, void* s) {
  std::string e;
  for (auto [dt, op] : {std::pair{ncclFloat32, ncclSum}, std::pair{ncclBfloat16, ncclMax}, std::pair{ncclInt32, ncclSum}}) {
    Buf in(N * P, dt), out(N, dt), inplace(N * P, dt);
    in.fill(rank, 70 + dt, N * P);
    inplace.fill(rank, 70 + dt, N * P);
    TRY(ncclReduceScatter(in.p(), out.p(), N, ncclDataType_t(dt), op, c, cudaStream_t(s)));
    TRY(ncclReduceScatter(inplace.p(), inplace.p(rank * N), N, ncclDataType_t(dt), op, c, cudaStream_t(s)));
    TRY(cuStreamSynchronize(s));
    auto want = [&](size_t i) { return ref_reduce(P, rank * N + i, 70 + dt, dt, op); };
    expect(e, fmt("%s %s", dtype_name(dt), op_name(op)).c_str(), rank, out, 0, N, want);
    expect(e, fmt("in-place %s %s", dtype_name(dt), op_name(op)).c_str(), rank, inplace, rank * N, N, want);
  }
  return e;
}

// broadcast from the last rank, ncclBcast (in place) from rank 0, reduce (sum) to rank P/2.
std::string broadcast_reduce(int rank, int P, ncclComm_t c, void* s) {
  std::string e;
  const int root = P - 1, rroot = P / 2;
  Buf in(N, ncclFloat64), out(N, ncclFloat64), bc(N, ncclFloat16), rin(N, ncclFloat32), rout(N, ncclFloat32);
  in.fill(rank, 80, N);
  bc.fill(rank, 81, N);
  rin.fill(rank, 82, N);
  TRY(ncclBroadcast(in.p(), out.p(), N, ncclFloat64, root, c, cudaStream_t(s)));
  TRY(ncclBcast(bc.p(), N, ncclFloat16, 0, c, cudaStream_t(s)));
  TRY(ncclReduce(rin.p(), rout.p(), N, ncclFloat32, ncclSum, rroot, c, cudaStream_t(s)));
  TRY(cuStreamSynchronize(s));
  expect(e, "broadcast", rank, out, 0, N, [&](size_t i) { return val(root, i, 80, ncclFloat64); });
  expect(e, "ncclBcast", rank, bc, 0, N, [&](size_t i) { return val(0, i, 81, ncclFloat16); });
  expect(e, "reduce", rank, rout, 0, N, [&](size_t i) { return rank == rroot ? ref_reduce(P, i, 82, ncclFloat32, ncclSum) : 0.0; });
  return e;
}

std::string alltoall(int rank, int P, ncclComm_t c, void* s) {
  std::string e;
  Buf in(N * P, ncclFloat32), out(N * P, ncclFloat32);
  in.fill(rank, 90, N * P);
  TRY(ncclAlltoAll(in.p(), out.p(), N, ncclFloat32, c, cudaStream_t(s)));
  TRY(cuStreamSynchronize(s));
  for (int k = 0; k < P; ++k)
    expect(e, fmt("block from rank %d", k).c_str(), rank, out, k * N, N, [&](size_t i) { return val(k, rank * N + i, 90, ncclFloat32); });
  return e;
}

void test_collectives(int P) {
  const std::pair<const char*, RankFn> cases[] = {
      {"all-reduce: 12 datatypes x sum/prod/max/min", allreduce_all},
      {"all-reduce: avg f32/f64/f16/bf16, in-place sum/max f32/f64/bf16", allreduce_avg_inplace},
      {"all-gather: f32/bf16/i64, out-of-place and in-place", allgather},
      {"reduce-scatter: f32 sum, bf16 max, i32 sum, out-of-place and in-place", reduce_scatter},
      {"broadcast (root P-1), ncclBcast in place, reduce to root P/2", broadcast_reduce},
      {"ncclAlltoAll f32", alltoall},
  };
  for (auto& [name, fn] : cases) report(fmt("P=%d %s", P, name), run_ranks(P, fn));
}

// Ring: 3 rounds, each one group {send to rank+1, recv from rank-1}, one sync at the end.
std::string ring(int rank, int P, ncclComm_t c, void* s) {
  std::vector<Buf> out, in;
  const int next = (rank + 1) % P, prev = (rank + P - 1) % P;
  for (int round = 0; round < 3; ++round) {
    out.emplace_back(N, ncclBfloat16);
    in.emplace_back(N, ncclBfloat16);
  }
  for (int round = 0; round < 3; ++round) {
    out[round].fill(rank, 100 + round, N);
    TRY(ncclGroupStart());
    TRY(ncclSend(out[round].p(), N, ncclBfloat16, next, c, cudaStream_t(s)));
    TRY(ncclRecv(in[round].p(), N, ncclBfloat16, prev, c, cudaStream_t(s)));
    TRY(ncclGroupEnd());
  }
  TRY(cuStreamSynchronize(s));
  std::string e;
  for (int round = 0; round < 3; ++round)
    expect(e, fmt("round %d", round).c_str(), rank, in[round], 0, N, [&](size_t i) { return val(prev, i, 100 + round, ncclBfloat16); });
  return e;
}

// All-to-all as one group of P sends and P receives (what NcclGroup::all_to_all does).
std::string a2a_p2p(int rank, int P, ncclComm_t c, void* s) {
  Buf out(N * P, ncclFloat32), in(N * P, ncclFloat32);
  out.fill(rank, 110, N * P);
  TRY(ncclGroupStart());
  for (int j = 0; j < P; ++j) TRY(ncclSend(out.p(j * N), N, ncclFloat32, j, c, cudaStream_t(s)));
  for (int j = 0; j < P; ++j) TRY(ncclRecv(in.p(j * N), N, ncclFloat32, j, c, cudaStream_t(s)));
  TRY(ncclGroupEnd());
  TRY(cuStreamSynchronize(s));
  std::string e;
  for (int j = 0; j < P; ++j)
    expect(e, fmt("block from %d", j).c_str(), rank, in, j * N, N, [&](size_t i) { return val(j, rank * N + i, 110, ncclFloat32); });
  return e;
}

void test_p2p(int P) {
  report(fmt("P=%d grouped ring send/recv, 3 rounds", P), run_ranks(P, ring));
  report(fmt("P=%d all-to-all as grouped send/recv", P), run_ranks(P, a2a_p2p));
}

}  // namespace

int main() {
  cuInit(0);
  printf("transport: %s\n", getenv("CPEMU_NCCL_TRANSPORT") ? getenv("CPEMU_NCCL_TRANSPORT") : "threads (default)");
  setenv("CPEMU_NCCL_SAME_DEVICE", "1", 0);  // threads of one device: allowed unless a test says otherwise
  test_codecs();
  for (int P = 1; P <= 4; ++P) test_collectives(P);
  for (int P = 1; P <= 4; ++P) test_p2p(P);
  test_init_paths();
  test_missing_rank();
  test_abort();
  test_mismatch();
  test_arguments();
  test_group_pattern();
  const char* tr = getenv("CPEMU_NCCL_TRANSPORT");
  const char* dir = getenv("CPEMU_NCCL_DIR");
  if (tr && !strcmp(tr, "files") && dir && *dir) {  // every communicator above was destroyed or aborted
    int n = 0;
    if (DIR* d = opendir(dir)) {
      while (dirent* x = readdir(d)) n += strcmp(x->d_name, ".") && strcmp(x->d_name, "..");
      closedir(d);
    }
    report(fmt("files transport: the last rank out removed each communicator's directory from %s", dir), n ? fmt("%d entries left", n) : "");
  }
  printf("%s: %d passed, %d failed\n", g_failed ? "FAIL" : "PASS", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
