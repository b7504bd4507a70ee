// Fault and lifecycle tests of the shim's libnccl (see test_nccl.cpp): init paths, a rank that
// never joins, abort while a peer waits, mismatched operations, argument errors.
#include "test_nccl.h"

namespace {

ncclConfig_t nonblocking() {
  ncclConfig_t c{};
  c.size = sizeof c;
  c.magic = kNcclConfigMagic;
  c.version = kNcclVersionCode;
  c.blocking = 0;
  return c;
}

// Polls ncclCommGetAsyncError until it leaves ncclInProgress (at most 5 s); returns the state.
int poll_ready(ncclComm_t c) {
  auto t = std::chrono::steady_clock::now();
  ncclResult_t st = ncclInProgress;
  while (secs_since(t) < 5) {
    if (ncclCommGetAsyncError(c, &st) != ncclSuccess) return -1;
    if (st != ncclInProgress) break;
    std::this_thread::yield();
  }
  return st;
}

ncclResult_t async_error(ncclComm_t c) {
  ncclResult_t st = ncclNumResults;
  ncclResult_t r = ncclCommGetAsyncError(c, &st);
  return r == ncclSuccess ? st : r;
}

// Runs fn on every rank of `comms` (one thread each, own stream); first error.
std::string on_threads(const std::vector<ncclComm_t>& comms, const RankFn& fn) {
  const int P = static_cast<int>(comms.size());
  std::vector<std::string> errs(P);
  std::vector<std::thread> ts;
  for (int r = 0; r < P; ++r)
    ts.emplace_back([&, r] {
      void* s = new_stream();
      errs[r] = fn(r, P, comms[r], s);
      cuStreamDestroy_v2(s);
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (!e.empty()) return e;
  return "";
}

std::string destroy_all(const std::vector<ncclComm_t>& comms) {
  for (ncclComm_t c : comms)
    if (ncclCommDestroy(c) != ncclSuccess) return "ncclCommDestroy failed";
  return "";
}

std::vector<ncclComm_t> init_all(int P) {
  std::vector<ncclComm_t> comms(P);
  std::vector<int> devs(P);
  for (int i = 0; i < P; ++i) devs[i] = i;
  if (ncclCommInitAll(comms.data(), P, devs.data()) != ncclSuccess) comms.clear();
  return comms;
}

std::string sum_check(int rank, int P, ncclComm_t c, void* s) {
  Buf in(N, ncclFloat32), out(N, ncclFloat32);
  in.fill(rank, 7, N);
  TRY(ncclAllReduce(in.p(), out.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)));
  TRY(cuStreamSynchronize(s));
  std::string e;
  expect(e, "all-reduce after init", rank, out, 0, N, [&](size_t i) { return ref_reduce(P, i, 7, ncclFloat32, ncclSum); });
  return e;
}

}  // namespace

void test_init_paths() {
  {  // rank 0 joins alone first: InProgress until the others join
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    std::atomic<int> go{0};
    std::vector<std::string> errs(3);
    std::vector<ncclComm_t> comms(3);
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r)
      ts.emplace_back([&, r] {
        ncclConfig_t cfg = nonblocking();
        if (r > 0)
          while (!go.load()) std::this_thread::yield();
        int rc = ncclCommInitRankConfig(&comms[r], 3, id, r, &cfg);
        if (r == 0) {
          errs[r] = check_rc("first rank's non-blocking init", rc, ncclInProgress);
          if (errs[r].empty()) errs[r] = check_rc("ncclCommGetAsyncError before the others joined", async_error(comms[r]), ncclInProgress);
          go = 1;
        } else if (rc != ncclSuccess && rc != ncclInProgress) {
          errs[r] = check_rc("non-blocking init", rc);
        }
        if (errs[r].empty()) errs[r] = check_rc("polled init", poll_ready(comms[r]));
      });
    for (auto& t : ts) t.join();
    std::string e;
    for (auto& x : errs) e += x;
    if (e.empty()) e = on_threads(comms, sum_check);
    if (e.empty()) e = destroy_all(comms);
    report("non-blocking init (P=3): ncclInProgress until every rank joined, then usable", e);
  }
  for (bool blocking : {false, true}) {  // all ranks from one thread inside a group
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    std::vector<ncclComm_t> comms(3);
    std::string e;
    ncclGroupStart();
    for (int r = 0; r < 3; ++r) {
      ncclConfig_t cfg = nonblocking();
      int rc = blocking ? ncclCommInitRank(&comms[r], 3, id, r) : ncclCommInitRankConfig(&comms[r], 3, id, r, &cfg);
      if (rc != ncclSuccess && rc != ncclInProgress) e += check_rc("grouped init", rc);
    }
    e += check_rc("ncclGroupEnd", ncclGroupEnd());
    for (int r = 0; r < 3 && e.empty(); ++r) {
      int n = -1, me = -1;
      e += check_rc("state after the group", blocking ? async_error(comms[r]) : poll_ready(comms[r]));
      ncclCommCount(comms[r], &n);
      ncclCommUserRank(comms[r], &me);
      if (n != 3 || me != r) e += fmt("count %d rank %d, want 3 and %d", n, me, r);
    }
    if (e.empty()) e = on_threads(comms, sum_check);
    if (e.empty()) e = destroy_all(comms);
    report(blocking ? "grouped blocking ncclCommInitRank of 3 ranks from one thread" : "grouped non-blocking init of 3 ranks from one thread (NcclGroup::single_process)", e);
  }
  {
    auto comms = init_all(4);
    std::string e = comms.size() == 4 ? "" : "ncclCommInitAll failed";
    for (int r = 0; r < static_cast<int>(comms.size()); ++r) {
      int d = -1;
      ncclCommCuDevice(comms[r], &d);
      if (d != r) e += fmt("rank %d on device %d; ", r, d);
    }
    if (e.empty()) e = on_threads(comms, sum_check);
    if (e.empty()) e = destroy_all(comms);
    report("ncclCommInitAll(4): devices, all-reduce from 4 threads", e);
  }
}

void test_missing_rank() {
  const double T = cp_shim::wait_timeout_s();
  {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    ncclComm_t c = reinterpret_cast<ncclComm_t>(1);
    auto t = std::chrono::steady_clock::now();
    std::string e = check_rc("blocking init without rank 1", ncclCommInitRank(&c, 2, id, 0), ncclSystemError);
    double took = secs_since(t);
    if (c) e += " comm not NULL;";
    if (took < T - 0.05 || took > T + 2) e += fmt(" took %.2f s, timeout %.2f s", took, T);
    if (!strstr(ncclGetLastError(nullptr), "joined")) e += fmt(" last error: %s", ncclGetLastError(nullptr));
    report(fmt("blocking init, rank 1 never joins: ncclSystemError after CPEMU_WAIT_TIMEOUT_S (%.1f s)", T), e);
  }
  {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    ncclComm_t c = nullptr;
    ncclGroupStart();
    std::string e = check_rc("grouped blocking init", ncclCommInitRank(&c, 2, id, 0));
    auto t = std::chrono::steady_clock::now();
    e += check_rc("ncclGroupEnd without rank 1", ncclGroupEnd(), ncclSystemError);
    if (c) e += " comm not NULL;";
    if (secs_since(t) > T + 2) e += " took too long";
    report("grouped blocking init, rank 1 never joins: ncclGroupEnd fails after the timeout", e);
  }
  {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    ncclComm_t c = nullptr;
    ncclConfig_t cfg = nonblocking();
    std::string e = check_rc("non-blocking init without rank 1", ncclCommInitRankConfig(&c, 2, id, 0, &cfg), ncclInProgress);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    e += check_rc("async error after 0.3 s", async_error(c), ncclInProgress);
    auto t = std::chrono::steady_clock::now();
    e += check_rc("ncclCommAbort", ncclCommAbort(c));
    if (secs_since(t) > 0.5) e += " abort took too long";
    e += check_rc("ncclCommGetAsyncError after abort", ncclCommGetAsyncError(c, nullptr), ncclInvalidUsage);
    report("non-blocking init, rank 1 never joins: stays ncclInProgress, abort returns at once", e);
  }
}

void test_abort() {
  {  // rank 1 waits in an all-reduce, rank 0 has an unmatched send, then aborts
    auto comms = init_all(2);
    std::atomic<int> posted{0};
    std::string e = on_threads(comms, [&](int rank, int, ncclComm_t c, void* s) -> std::string {
      Buf in(N, ncclFloat32), out(N, ncclFloat32);
      in.fill(rank, 3, N);
      if (rank == 1) {
        TRY(ncclAllReduce(in.p(), out.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)));
        posted = 1;
        auto t = std::chrono::steady_clock::now();
        TRY(cuStreamSynchronize(s));
        if (secs_since(t) > 2) return "peer's wait took too long";
        TRY_RC(async_error(c), ncclRemoteError);
        if (!strstr(ncclGetLastError(c), "rank 0")) return fmt("peer's last error: %s", ncclGetLastError(c));
        TRY_RC(ncclAllReduce(in.p(), out.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)), ncclRemoteError);
        for (size_t i = 0; i < N; ++i)
          if (get(out.p(), i, ncclFloat32) != 0) return "peer's output written";
        return "";
      }
      TRY(ncclSend(in.p(), N, ncclFloat32, 1, c, cudaStream_t(s)));
      while (!posted.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      auto t = std::chrono::steady_clock::now();
      TRY(ncclCommAbort(c));
      TRY(cuStreamSynchronize(s));
      if (secs_since(t) > 0.5) return "abort + own sync took too long";
      TRY_RC(ncclAllReduce(in.p(), out.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)), ncclInvalidUsage);
      TRY_RC(ncclCommGetAsyncError(c, nullptr), ncclInvalidUsage);
      TRY(ncclCommAbort(c));
      return "";
    });
    if (e.empty()) e = destroy_all(comms);
    report("abort while a peer waits: own pending send and peer's all-reduce complete with errors", e);
  }
  {  // rank 0 aborts first; ranks 1, 2 can still exchange, collectives fail at once
    auto comms = init_all(3);
    ncclCommAbort(comms[0]);
    std::vector<ncclComm_t> rest(comms.begin() + 1, comms.end());
    std::string e = on_threads(rest, [&](int r, int, ncclComm_t c, void* s) -> std::string {
      Buf a(N, ncclFloat32), b(N, ncclFloat32);
      a.fill(r + 1, 4, N);
      TRY(r == 0 ? ncclSend(a.p(), N, ncclFloat32, 2, c, cudaStream_t(s)) : ncclRecv(b.p(), N, ncclFloat32, 1, c, cudaStream_t(s)));
      TRY(cuStreamSynchronize(s));
      std::string e2;
      if (r == 1) expect(e2, "send/recv between live ranks", 2, b, 0, N, [&](size_t i) { return val(1, i, 4, ncclFloat32); });
      TRY(ncclAllReduce(a.p(), b.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)));
      TRY(cuStreamSynchronize(s));
      TRY_RC(async_error(c), ncclRemoteError);
      return e2;
    });
    if (e.empty()) e = destroy_all(comms);
    report("after rank 0 aborted: send/recv between live ranks works, a collective fails at once", e);
  }
  {  // CPEMU_NCCL_PEER_ABORT=hang: NCCL's own behaviour within a node
    setenv("CPEMU_NCCL_PEER_ABORT", "hang", 1);
    auto comms = init_all(2);
    std::atomic<int> posted{0}, aborted{0};
    std::string e = on_threads(comms, [&](int rank, int, ncclComm_t c, void* s) -> std::string {
      Buf in(N, ncclFloat32), out(N, ncclFloat32);
      if (rank == 0) {
        while (!posted.load()) std::this_thread::yield();
        TRY(ncclCommAbort(c));
        aborted = 1;
        return "";
      }
      TRY(ncclAllReduce(in.p(), out.p(), N, ncclFloat32, ncclSum, c, cudaStream_t(s)));
      posted = 1;
      while (!aborted.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      TRY_RC(cuStreamQuery(s), cp_shim::CU_NOT_READY);
      TRY_RC(async_error(c), ncclSuccess);
      auto t = std::chrono::steady_clock::now();
      TRY(ncclCommAbort(c));
      TRY(cuStreamSynchronize(s));
      if (secs_since(t) > 0.5) return "own abort did not release the wait";
      return "";
    });
    unsetenv("CPEMU_NCCL_PEER_ABORT");
    if (e.empty()) e = destroy_all(comms);
    report("CPEMU_NCCL_PEER_ABORT=hang: peer's work stays pending until the peer aborts", e);
  }
}

void test_mismatch() {
  using Post = std::function<int(int rank, ncclComm_t c, void* s, Buf& a, Buf& b)>;
  auto run = [](const char* name, const Post& post) {
    auto comms = init_all(2);
    std::string e = on_threads(comms, [&](int rank, int, ncclComm_t c, void* s) -> std::string {
      Buf a(4 * N, ncclFloat32), b(4 * N, ncclFloat32);
      TRY(post(rank, c, s, a, b));
      auto t = std::chrono::steady_clock::now();
      TRY(cuStreamSynchronize(s));
      if (secs_since(t) > 2) return "sync took too long";
      TRY_RC(async_error(c), ncclInvalidUsage);
      if (!strstr(ncclGetLastError(c), "mismatched")) return fmt("last error: %s", ncclGetLastError(c));
      return "";
    });
    if (e.empty()) e = destroy_all(comms);
    report(fmt("mismatch detected, both ranks fail with ncclInvalidUsage: %s", name), e);
  };
  auto st = [](void* s) { return cudaStream_t(s); };
  run("all-reduce count 8 vs 4", [&](int r, ncclComm_t c, void* s, Buf& a, Buf& b) {
    return ncclAllReduce(a.p(), b.p(), r ? 4 : 8, ncclFloat32, ncclSum, c, st(s));
  });
  run("all-reduce f32 vs bf16", [&](int r, ncclComm_t c, void* s, Buf& a, Buf& b) {
    return ncclAllReduce(a.p(), b.p(), N, r ? ncclBfloat16 : ncclFloat32, ncclSum, c, st(s));
  });
  run("all-reduce sum vs max", [&](int r, ncclComm_t c, void* s, Buf& a, Buf& b) {
    return ncclAllReduce(a.p(), b.p(), N, ncclFloat32, r ? ncclMax : ncclSum, c, st(s));
  });
  run("broadcast root 0 vs 1", [&](int r, ncclComm_t c, void* s, Buf& a, Buf& b) {
    return ncclBroadcast(a.p(), b.p(), N, ncclFloat32, r, c, st(s));
  });
  run("all-reduce + all-reduce vs all-gather (the 2nd op fails too)", [&](int r, ncclComm_t c, void* s, Buf& a, Buf& b) -> int {
    if (r == 1) return ncclAllGather(a.p(), b.p(), N, ncclFloat32, c, st(s));
    int x = ncclAllReduce(a.p(), b.p(), N, ncclFloat32, ncclSum, c, st(s));
    if (x) return x;
    x = ncclAllReduce(a.p(), b.p(), N, ncclFloat32, ncclSum, c, st(s));  // refused if rank 1 came first
    return x == ncclInvalidUsage ? 0 : x;
  });
  run("send 8 vs recv 4", [&](int r, ncclComm_t c, void* s, Buf& a, Buf&) {
    return r ? ncclRecv(a.p(), 4, ncclFloat32, 0, c, st(s)) : ncclSend(a.p(), 8, ncclFloat32, 1, c, st(s));
  });
}

void test_arguments() {
  std::string e;
  auto want = [&](const char* what, int rc, int w) { e += check_rc(what, rc, w).empty() ? "" : check_rc(what, rc, w) + "; "; };
  want("ncclGroupEnd without ncclGroupStart", ncclGroupEnd(), ncclInvalidUsage);
  ncclUniqueId id, id2;
  ncclGetUniqueId(&id);
  ncclGetUniqueId(&id2);
  if (memcmp(&id, &id2, sizeof id) == 0) e += "two unique ids are equal; ";
  ncclComm_t c = reinterpret_cast<ncclComm_t>(1), c2 = nullptr;
  want("rank 2 of 2", ncclCommInitRank(&c, 2, id, 2), ncclInvalidArgument);
  if (c) e += "comm not NULL after a failed init; ";
  want("nranks 0", ncclCommInitRank(&c, 0, id, 0), ncclInvalidArgument);
  {
    const char* tr = getenv("CPEMU_NCCL_TRANSPORT");
    const std::string saved = tr ? tr : "";
    setenv("CPEMU_NCCL_TRANSPORT", "pigeons", 1);
    c = reinterpret_cast<ncclComm_t>(1);
    want("CPEMU_NCCL_TRANSPORT=pigeons", ncclCommInitRank(&c, 1, id2, 0), ncclInvalidArgument);
    want("ncclCommInitAll, CPEMU_NCCL_TRANSPORT=pigeons", ncclCommInitAll(&c2, 1, nullptr), ncclInvalidArgument);
    if (c || c2) e += "comm not NULL after an unknown transport; ";
    tr ? setenv("CPEMU_NCCL_TRANSPORT", saved.c_str(), 1) : unsetenv("CPEMU_NCCL_TRANSPORT");
  }
  ncclConfig_t bad = nonblocking();
  bad.magic = 0;
  want("config without NCCL_CONFIG_INITIALIZER", ncclCommInitRankConfig(&c, 2, id, 0, &bad), ncclInvalidArgument);
  ncclConfig_t cfg = nonblocking();
  want("rank 0 of 2 (non-blocking)", ncclCommInitRankConfig(&c, 2, id, 0, &cfg), ncclInProgress);
  want("rank 0 of 2 again", ncclCommInitRankConfig(&c2, 2, id, 0, &cfg), ncclInvalidArgument);
  want("rank 1 of 3 on a 2-rank id", ncclCommInitRankConfig(&c2, 3, id, 1, &cfg), ncclInvalidArgument);
  Buf buf(N, ncclFloat32);
  want("all-reduce while initializing", ncclAllReduce(buf.p(), buf.p(), N, ncclFloat32, ncclSum, c, nullptr), ncclInvalidUsage);
  want("abort of the half-made communicator", ncclCommAbort(c), ncclSuccess);
  want("ncclCommAbort(NULL)", ncclCommAbort(nullptr), ncclSuccess);
  want("all-reduce on NULL", ncclAllReduce(buf.p(), buf.p(), N, ncclFloat32, ncclSum, nullptr, nullptr), ncclInvalidArgument);
  unsetenv("CPEMU_NCCL_SAME_DEVICE");
  std::vector<ncclComm_t> two(2);
  const int same[2] = {0, 0};
  want("ncclCommInitAll on one device twice", ncclCommInitAll(two.data(), 2, same), ncclInvalidUsage);
  if (!strstr(ncclGetLastError(nullptr), "duplicate GPU")) e += fmt("last error: %s; ", ncclGetLastError(nullptr));
  setenv("CPEMU_NCCL_SAME_DEVICE", "1", 1);
  want("ncclCommInitAll on one device twice, CPEMU_NCCL_SAME_DEVICE=1", ncclCommInitAll(two.data(), 2, same), ncclSuccess);
  std::vector<ncclComm_t> one = init_all(1);
  ncclComm_t k = one.empty() ? nullptr : one[0];
  void* s = new_stream();
  want("invalid datatype", ncclAllReduce(buf.p(), buf.p(), N, ncclDataType_t(12), ncclSum, k, cudaStream_t(s)), ncclInvalidArgument);
  want("invalid op", ncclAllReduce(buf.p(), buf.p(), N, ncclFloat32, ncclNumOps, k, cudaStream_t(s)), ncclInvalidArgument);
  want("peer out of range", ncclSend(buf.p(), N, ncclFloat32, 1, k, cudaStream_t(s)), ncclInvalidArgument);
  want("root out of range", ncclBroadcast(buf.p(), buf.p(), N, ncclFloat32, -1, k, cudaStream_t(s)), ncclInvalidArgument);
  want("NULL buffer", ncclAllGather(nullptr, buf.p(), N, ncclFloat32, k, cudaStream_t(s)), ncclInvalidArgument);
  want("count 0 with NULL buffers", ncclAllReduce(nullptr, nullptr, 0, ncclFloat32, ncclSum, k, cudaStream_t(s)), ncclSuccess);
  want("sync", cuStreamSynchronize(s), 0);
  want("ncclCommFinalize", ncclCommFinalize(k), ncclSuccess);
  want("ncclCommDestroy", ncclCommDestroy(k), ncclSuccess);
  want("all-reduce on a destroyed communicator", ncclAllReduce(buf.p(), buf.p(), N, ncclFloat32, ncclSum, k, cudaStream_t(s)), ncclInvalidArgument);
  cuStreamDestroy_v2(s);
  e += destroy_all(two);
  int v = 0;
  ncclGetVersion(&v);
  if (v != 23000) e += fmt("version %d; ", v);
  for (int a = 0; a < ncclNumResults; ++a)
    for (int b = 0; b < a; ++b)
      if (!strcmp(ncclGetErrorString(ncclResult_t(a)), ncclGetErrorString(ncclResult_t(b)))) e += fmt("error strings %d and %d equal; ", a, b);
  report("argument and usage errors, unique ids, version, error strings", e);
}
