// Multi-process tests of the shim's libnccl over the files transport (nccl_files.cpp): the
// parent writes a unique id to a file and launches P children (this binary, "child" mode), one
// rank each on its own device, as a launcher runs one process per GPU; each child checks its
// results against references computed locally and exits 0 (pass) or 1 (printing why); the
// parent checks every exit status, the time, and that the communicator's directory is gone.
// Scenarios: every collective kind and datatype + grouped ring send/recv in both orders + p2p
// all-to-all, blocking and non-blocking init, P = 2, 3, 4; a rank that calls ncclCommAbort; a
// rank killed by SIGKILL; a mismatched collective; a rank that never starts; two ranks on one
// device. Build/run: test_nccl.sh (sets CPEMU_NCCL_DIR, CPEMU_WAIT_TIMEOUT_S, CPEMU_DEVICES).
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <dirent.h>
#include <unistd.h>

#include "test_nccl.h"

namespace {

double T() { return cp_shim::wait_timeout_s(); }

ncclResult_t async_error(ncclComm_t c) {
  ncclResult_t st = ncclNumResults;
  ncclResult_t r = ncclCommGetAsyncError(c, &st);
  return r == ncclSuccess ? st : r;
}

// A non-integer input (exercises rounding: the result must equal cp_nccl::reduce bit for bit).
double frac_val(int rank, size_t i, int salt) { return static_cast<double>((rank * 131 + i * 17 + salt * 7) % 97) / 13.0 - 3.3; }

std::string collectives(int rank, int P, ncclComm_t c, void* s) {
  std::string e;
  auto st = [&] { return cudaStream_t(s); };
  // all-reduce: 12 datatypes x sum/prod/max/min, exact (small integers); all in flight, one sync
  std::vector<Buf> in, out;
  for (int k = 0; k < ncclNumTypes * 4; ++k) {
    in.emplace_back(N, k / 4);
    out.emplace_back(N, k / 4);
    in.back().fill(rank, k, N);
  }
  for (int k = 0; k < ncclNumTypes * 4; ++k)
    TRY(ncclAllReduce(in[k].p(), out[k].p(), N, ncclDataType_t(k / 4), ncclRedOp_t(k % 4), c, st()));
  // floats with non-integer inputs, sum and avg: bit-identical to cp_nccl::reduce in rank order
  const int fdt[] = {ncclFloat32, ncclFloat64, ncclFloat16, ncclBfloat16, ncclFloat8e4m3, ncclFloat8e5m2};
  std::vector<Buf> fin, fout;
  for (int k = 0; k < 12; ++k) {
    fin.emplace_back(N, fdt[k / 2]);
    fout.emplace_back(N, fdt[k / 2]);
    for (size_t i = 0; i < N; ++i) put(fin.back().p(), i, fdt[k / 2], frac_val(rank, i, k));
    TRY(ncclAllReduce(fin[k].p(), fout[k].p(), N, ncclDataType_t(fdt[k / 2]), k % 2 ? ncclAvg : ncclSum, c, st()));
  }
  // in-place all-reduce, all-gather, reduce-scatter (out-of-place and in-place), broadcast,
  // reduce, all-to-all
  Buf ip(N, ncclFloat32), ag(N * P, ncclBfloat16), agin(N, ncclBfloat16), rs(N * P, ncclInt32), rso(N, ncclInt32),
      rsi(N * P, ncclInt32), bc(N, ncclFloat64), bco(N, ncclFloat64), rd(N, ncclFloat32), rdo(N, ncclFloat32),
      a2a(N * P, ncclFloat32), a2ao(N * P, ncclFloat32);
  ip.fill(rank, 1, N);
  agin.fill(rank, 2, N);
  rs.fill(rank, 3, N * P);
  rsi.fill(rank, 3, N * P);
  bc.fill(rank, 4, N);
  rd.fill(rank, 5, N);
  a2a.fill(rank, 6, N * P);
  const int root = P - 1, rroot = P / 2;
  TRY(ncclAllReduce(ip.p(), ip.p(), N, ncclFloat32, ncclMax, c, st()));
  TRY(ncclAllGather(agin.p(), ag.p(), N, ncclBfloat16, c, st()));
  TRY(ncclReduceScatter(rs.p(), rso.p(), N, ncclInt32, ncclSum, c, st()));
  TRY(ncclReduceScatter(rsi.p(), rsi.p(rank * N), N, ncclInt32, ncclSum, c, st()));
  TRY(ncclBroadcast(bc.p(), bco.p(), N, ncclFloat64, root, c, st()));
  TRY(ncclReduce(rd.p(), rdo.p(), N, ncclFloat32, ncclSum, rroot, c, st()));
  TRY(ncclAlltoAll(a2a.p(), a2ao.p(), N, ncclFloat32, c, st()));
  TRY(cuStreamSynchronize(s));
  for (int k = 0; k < ncclNumTypes * 4 && e.empty(); ++k)
    expect(e, fmt("all-reduce %s %s", dtype_name(k / 4), op_name(k % 4)).c_str(), rank, out[k], 0, N,
           [&](size_t i) { return ref_reduce(P, i, k, k / 4, k % 4); });
  for (int k = 0; k < 12 && e.empty(); ++k) {
    const int dt = fdt[k / 2];
    std::vector<Buf> ins;
    std::vector<const void*> srcs;
    for (int r = 0; r < P; ++r) {
      ins.emplace_back(N, dt);
      for (size_t i = 0; i < N; ++i) put(ins.back().p(), i, dt, frac_val(r, i, k));
    }
    for (auto& b : ins) srcs.push_back(b.p());
    Buf ref(N, dt);
    cp_nccl::reduce(ref.p(), srcs.data(), P, N, dt, k % 2 ? ncclAvg : ncclSum);
    if (memcmp(ref.p(), fout[k].p(), N * dtype_size(dt)) != 0)
      e = fmt("all-reduce %s %s of non-integers differs from cp_nccl::reduce in rank order", dtype_name(dt), k % 2 ? "avg" : "sum");
  }
  expect(e, "in-place all-reduce max", rank, ip, 0, N, [&](size_t i) { return ref_reduce(P, i, 1, ncclFloat32, ncclMax); });
  for (int k = 0; k < P; ++k)
    expect(e, fmt("all-gather block %d", k).c_str(), rank, ag, k * N, N, [&](size_t i) { return val(k, i, 2, ncclBfloat16); });
  auto rs_want = [&](size_t i) { return ref_reduce(P, rank * N + i, 3, ncclInt32, ncclSum); };
  expect(e, "reduce-scatter", rank, rso, 0, N, rs_want);
  expect(e, "in-place reduce-scatter", rank, rsi, rank * N, N, rs_want);
  expect(e, "broadcast", rank, bco, 0, N, [&](size_t i) { return val(root, i, 4, ncclFloat64); });
  expect(e, "reduce", rank, rdo, 0, N, [&](size_t i) { return rank == rroot ? ref_reduce(P, i, 5, ncclFloat32, ncclSum) : 0.0; });
  for (int k = 0; k < P; ++k)
    expect(e, fmt("all-to-all block %d", k).c_str(), rank, a2ao, k * N, N, [&](size_t i) { return val(k, rank * N + i, 6, ncclFloat32); });
  return e;
}

// Ring: 3 rounds of one group {send to rank+1, recv from rank-1}; rounds alternate the order
// of the two calls (recv first on odd rounds); then all-to-all as one group of P sends + P recvs.
std::string p2p(int rank, int P, ncclComm_t c, void* s) {
  const int next = (rank + 1) % P, prev = (rank + P - 1) % P;
  std::vector<Buf> out, in;
  for (int r = 0; r < 3; ++r) out.emplace_back(N, ncclBfloat16), in.emplace_back(N, ncclBfloat16);
  for (int r = 0; r < 3; ++r) {
    out[r].fill(rank, 100 + r, N);
    TRY(ncclGroupStart());
    if (r % 2) TRY(ncclRecv(in[r].p(), N, ncclBfloat16, prev, c, cudaStream_t(s)));
    TRY(ncclSend(out[r].p(), N, ncclBfloat16, next, c, cudaStream_t(s)));
    if (!(r % 2)) TRY(ncclRecv(in[r].p(), N, ncclBfloat16, prev, c, cudaStream_t(s)));
    TRY(ncclGroupEnd());
  }
  Buf ao(N * P, ncclFloat32), ai(N * P, ncclFloat32);
  ao.fill(rank, 110, N * P);
  TRY(ncclGroupStart());
  for (int j = 0; j < P; ++j) TRY(ncclRecv(ai.p(j * N), N, ncclFloat32, j, c, cudaStream_t(s)));
  for (int j = 0; j < P; ++j) TRY(ncclSend(ao.p(j * N), N, ncclFloat32, j, c, cudaStream_t(s)));
  TRY(ncclGroupEnd());
  TRY(cuStreamSynchronize(s));
  std::string e;
  for (int r = 0; r < 3; ++r)
    expect(e, fmt("ring round %d", r).c_str(), rank, in[r], 0, N, [&](size_t i) { return val(prev, i, 100 + r, ncclBfloat16); });
  for (int j = 0; j < P; ++j)
    expect(e, fmt("p2p all-to-all block %d", j).c_str(), rank, ai, j * N, N, [&](size_t i) { return val(j, rank * N + i, 110, ncclFloat32); });
  return e;
}

std::string one_allreduce(int rank, int P, ncclComm_t c, void* s) {
  Buf in(N, ncclFloat32), out(N, ncclFloat32);
  in.fill(rank, 7, N);
  TRY(ncclAllReduce(in.p(), out.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)));
  TRY(cuStreamSynchronize(s));
  std::string e;
  expect(e, "all-reduce", rank, out, 0, N, [&](size_t i) { return ref_reduce(P, i, 7, ncclFloat32, ncclSum); });
  return e;
}

// After a fault: `post` (an operation that needs the failed peer) completes within 2 s with
// `want`, which becomes the asynchronous error, whose text contains `needle`. (The call itself
// may already return `want`: this rank's progress thread may have seen the fault first.)
std::string expect_failure(ncclComm_t c, void* s, int want, const char* needle, const std::function<int()>& post) {
  auto t = std::chrono::steady_clock::now();
  const int rc = post();
  if (rc != want) TRY(rc);
  TRY(cuStreamSynchronize(s));
  const double took = secs_since(t);
  if (took > 2.0) return fmt("the failure took %.2f s (bound 2 s)", took);
  TRY_RC(async_error(c), want);
  if (!strstr(ncclGetLastError(c), needle)) return fmt("last error lacks '%s': %s", needle, ncclGetLastError(c));
  return "";
}

// Waits (at most 5 s) until ranks 0..n-1 reached this point (files next to the id file), so
// that no survivor of a fault tears down while another still waits for the fault's report.
void barrier(const std::string& idfile, int rank, int n) {
  FILE* f = fopen((idfile + ".done." + std::to_string(rank)).c_str(), "w");
  if (f) fclose(f);
  for (auto t = std::chrono::steady_clock::now(); secs_since(t) < 5; usleep(1000)) {
    int k = 0;
    while (k < n && access((idfile + ".done." + std::to_string(k)).c_str(), F_OK) == 0) ++k;
    if (k == n) return;
  }
}

std::string child(const std::string& scenario, int P, int rank, const ncclUniqueId& id, const std::string& idfile) {
  void* ctx = nullptr;
  cuDevicePrimaryCtxRetain(&ctx, scenario == "dupdev" ? 0 : rank);
  cuCtxSetCurrent(ctx);
  ncclComm_t c = nullptr;
  auto t0 = std::chrono::steady_clock::now();
  if (scenario == "nonblocking") {
    ncclConfig_t cfg{};
    cfg.size = sizeof cfg, cfg.magic = kNcclConfigMagic, cfg.version = kNcclVersionCode, cfg.blocking = 0;
    int rc = ncclCommInitRankConfig(&c, P, id, rank, &cfg);
    if (rc != ncclSuccess && rc != ncclInProgress) return check_rc("non-blocking init", rc);
    ncclResult_t st = ncclInProgress;
    while (st == ncclInProgress && secs_since(t0) < 10) {
      TRY(ncclCommGetAsyncError(c, &st));
      usleep(200);
    }
    TRY_RC(st, ncclSuccess);
  } else {
    int rc = ncclCommInitRank(&c, P, id, rank);
    if (scenario == "missing") {  // rank P-1 never starts
      const double took = secs_since(t0);
      TRY_RC(rc, ncclSystemError);
      if (c) return "comm not NULL after a failed init";
      if (took < T() - 0.05 || took > T() + 2) return fmt("init failed after %.2f s, timeout %.2f s", took, T());
      return "";
    }
    if (scenario == "dupdev") {
      TRY_RC(rc, ncclInvalidUsage);
      if (!strstr(ncclGetLastError(nullptr), "duplicate GPU")) return fmt("last error: %s", ncclGetLastError(nullptr));
      return "";
    }
    TRY(rc);
  }
  int n = -1, me = -1;
  ncclCommCount(c, &n);
  ncclCommUserRank(c, &me);
  if (n != P || me != rank) return fmt("count %d rank %d, want %d and %d", n, me, P, rank);
  void* s = new_stream();
  std::string e = one_allreduce(rank, P, c, s);
  Buf a(N * 2, ncclFloat32), b(N * 2, ncclFloat32);
  const int victim = P - 1;
  if (e.empty() && (scenario == "blocking" || scenario == "nonblocking")) {
    e = collectives(rank, P, c, s);
    if (e.empty()) e = p2p(rank, P, c, s);
    if (e.empty()) e = one_allreduce(rank, P, c, s);
  } else if (e.empty() && scenario == "abort") {
    if (rank == victim) {
      TRY(ncclCommAbort(c));
      sleep(1);  // stay alive: the peers learn it from its gone file, not from its exit
      return "";
    }
    if (rank == 0)
      e = expect_failure(c, s, ncclRemoteError, "rank 2", [&] { return ncclRecv(a.p(), N, ncclFloat32, victim, c, cudaStream_t(s)); });
    else
      e = expect_failure(c, s, ncclRemoteError, "rank 2", [&] { return ncclAllReduce(a.p(), b.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)); });
  } else if (e.empty() && scenario == "kill") {
    if (rank == victim) raise(SIGKILL);
    if (rank == 0)
      e = expect_failure(c, s, ncclRemoteError, "died", [&] { return ncclRecv(a.p(), N, ncclFloat32, victim, c, cudaStream_t(s)); });
    else
      e = expect_failure(c, s, ncclRemoteError, "died", [&] { return ncclAllReduce(a.p(), b.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)); });
  } else if (e.empty() && scenario == "mismatch") {  // rank 1 all-reduces 2N elements, the others N
    e = expect_failure(c, s, ncclInvalidUsage, "mismatched", [&] {
      return ncclAllReduce(a.p(), b.p(), rank == 1 ? 2 * N : N, ncclFloat32, ncclSum, c, cudaStream_t(s));
    });
  }
  if (scenario == "noteardown") return e;  // exits with its communicator (and its files) live
  if (scenario == "abort" || scenario == "kill" || scenario == "mismatch") barrier(idfile, rank, scenario == "mismatch" ? P : P - 1);
  cuStreamDestroy_v2(s);
  // NcclGroup's teardown is ncclCommAbort; a healthy run destroys (which drains first)
  int rc = e.empty() && (scenario == "blocking" || scenario == "nonblocking") ? ncclCommDestroy(c) : ncclCommAbort(c);
  if (rc != ncclSuccess && e.empty()) e = check_rc("teardown", rc);
  return e;
}

std::string read_id(const std::string& file, ncclUniqueId& id) {
  FILE* f = fopen(file.c_str(), "rb");
  if (!f) return "cannot open the id file " + file;
  size_t n = fread(&id, 1, sizeof id, f);
  fclose(f);
  return n == sizeof id ? "" : "short id file " + file;
}

int count_entries(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* x = readdir(d)) n += strcmp(x->d_name, ".") && strcmp(x->d_name, "..");
    closedir(d);
  }
  return n;
}

// Launches `launched` of P ranks, reaps them as they exit (so a killed one is not left a
// zombie), and checks the statuses (bound: 60 s) and that `left` directories remain.
void scenario(const std::string& base, const std::string& name, int P, int launched, int left = 0) {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  const std::string idfile = base + ".id";
  FILE* f = fopen(idfile.c_str(), "wb");
  fwrite(&id, 1, sizeof id, f);
  fclose(f);
  const int before = count_entries(base);
  auto t0 = std::chrono::steady_clock::now();
  std::map<pid_t, int> ranks;
  for (int r = 0; r < launched; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      std::string a1 = std::to_string(P), a2 = std::to_string(r);
      execl("/proc/self/exe", "test_nccl_procs", "child", name.c_str(), a1.c_str(), a2.c_str(), idfile.c_str(), nullptr);
      _exit(127);
    }
    ranks[pid] = r;
  }
  std::string e;
  while (!ranks.empty()) {
    int st = 0;
    pid_t pid = waitpid(-1, &st, WNOHANG);
    if (pid <= 0) {
      if (secs_since(t0) > 60) {
        for (auto& [p, r] : ranks) kill(p, SIGKILL), e += fmt(" rank %d hung;", r);
        while (waitpid(-1, &st, 0) > 0) {}
        break;
      }
      usleep(2000);
      continue;
    }
    const int r = ranks[pid];
    ranks.erase(pid);
    const bool victim = name == "kill" && r == P - 1;
    if (victim ? !(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) : !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
      e += fmt(" rank %d: %s %d;", r, WIFEXITED(st) ? "exit" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
  }
  const double took = secs_since(t0);
  unlink(idfile.c_str());
  for (int r = 0; r < P; ++r) unlink((idfile + ".done." + std::to_string(r)).c_str());
  if (count_entries(base) - before > left)
    e += fmt(" %d new entries left in %s, want %d (the last rank out removes its directory);", count_entries(base) - before, base.c_str(), left);
  report(fmt("processes: %s, %d of %d ranks launched (%.2f s)", name.c_str(), launched, P, took), e);
}

}  // namespace

// "env SCENARIO": started by a launcher (launch.sh) with RANK, WORLD_SIZE and
// CANDLE_CP_NCCL_ID_FILE, as NcclGroup::from_env is: rank 0 makes the id and publishes it in
// that file (rename), the others wait for it (10 s).
std::string env_id(int rank, const char* file, ncclUniqueId& id) {
  if (!file) return "CANDLE_CP_NCCL_ID_FILE is not set";
  if (rank == 0) {
    ncclGetUniqueId(&id);
    const std::string tmp = std::string(file) + ".tmp" + std::to_string(getpid());
    FILE* f = fopen(tmp.c_str(), "wb");
    if (!f || fwrite(&id, 1, sizeof id, f) != sizeof id || fclose(f) != 0 || rename(tmp.c_str(), file) != 0) return "cannot write " + tmp;
    return "";
  }
  for (auto t = std::chrono::steady_clock::now(); secs_since(t) < 10; usleep(1000))
    if (read_id(file, id).empty()) return "";
  return std::string("no id in ") + file + " after 10 s";
}

int main(int argc, char** argv) {
  const bool env = argc == 3 && !strcmp(argv[1], "env");
  if ((argc == 6 && !strcmp(argv[1], "child")) || env) {
    cuInit(0);
    const int P = atoi(env ? getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : "0" : argv[3]);
    const int rank = atoi(env ? getenv("RANK") ? getenv("RANK") : "-1" : argv[4]);
    const char* idfile = env ? getenv("CANDLE_CP_NCCL_ID_FILE") : argv[5];
    ncclUniqueId id;
    std::string e = env ? env_id(rank, idfile, id) : read_id(idfile, id);
    if (e.empty()) e = child(argv[2], P, rank, id, idfile);
    if (!e.empty()) fprintf(stderr, "child %s rank %d of %d (pid %d): FAIL: %s\n", argv[2], rank, P, getpid(), e.c_str());
    if (e.empty() && env) printf("PASS launched rank %d of %d: %s\n", rank, P, argv[2]);
    fflush(stdout);
    _exit(e.empty() ? 0 : 1);
  }
  setenv("CPEMU_NCCL_TRANSPORT", "files", 1);
  const char* d = getenv("CPEMU_NCCL_DIR");
  std::string base = d && *d ? d : fmt("/tmp/cpemu-nccl-procs-%d", getpid());
  setenv("CPEMU_NCCL_DIR", base.c_str(), 1);
  mkdir(base.c_str(), 0700);
  for (const char* mode : {"blocking", "nonblocking"})
    for (int P = 2; P <= 4; ++P) scenario(base, mode, P, P);
  scenario(base, "abort", 3, 3);
  scenario(base, "kill", 3, 3);
  scenario(base, "mismatch", 3, 3);
  scenario(base, "missing", 3, 2);
  scenario(base, "dupdev", 2, 2);
  const int n0 = count_entries(base);
  scenario(base, "noteardown", 2, 2, 1);
  const int n1 = count_entries(base);
  scenario(base, "blocking", 2, 2);
  report("processes: the next init removes the directory of ranks that exited without teardown",
         n1 == n0 + 1 && count_entries(base) == n0 ? "" : fmt("entries in %s: %d, %d after the exit, %d after the next init", base.c_str(), n0, n1, count_entries(base)));
  printf("%s: %d passed, %d failed\n", g_failed ? "FAIL" : "PASS", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
