// NcclGroup's usage pattern on the shim's libnccl (see crates/candle-cp-comm/src/nccl/): one
// non-blocking communicator per device made from ONE thread inside a group (each init with its
// device's context current, as RawComm::init_all does), then one thread per rank with a compute
// and a communication stream joined by events, a watchdog thread per rank polling
// ncclCommGetAsyncError under the rank's lock, flat collectives and grouped send/recv, and
// teardown by ncclCommAbort (RawComm's Drop). Also: two ranks on one device are refused.
#include <mutex>

#include "test_nccl.h"

namespace {

ncclConfig_t nb_config() {
  ncclConfig_t c{};
  c.size = sizeof c;
  c.magic = kNcclConfigMagic;
  c.version = kNcclVersionCode;
  c.blocking = 0;
  return c;
}

// Grouped non-blocking init of ranks on `devs` from this thread; returns the polled states.
std::vector<int> grouped_init(const std::vector<int>& devs, std::vector<ncclComm_t>& comms) {
  const int P = static_cast<int>(devs.size());
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  comms.assign(P, nullptr);
  std::vector<ncclConfig_t> cfgs(P, nb_config());
  std::vector<int> st(P, -1);
  ncclGroupStart();
  for (int r = 0; r < P; ++r) {
    void* ctx = nullptr;
    cuDevicePrimaryCtxRetain(&ctx, devs[r]);
    cuCtxSetCurrent(ctx);
    int rc = ncclCommInitRankConfig(&comms[r], P, id, r, &cfgs[r]);
    if (rc != ncclSuccess && rc != ncclInProgress) st[r] = rc;
  }
  ncclGroupEnd();
  cuCtxSetCurrent(nullptr);
  for (int r = 0; r < P; ++r) {
    if (st[r] != -1) continue;
    auto t = std::chrono::steady_clock::now();
    ncclResult_t s = ncclInProgress;
    while (s == ncclInProgress && secs_since(t) < 5) ncclCommGetAsyncError(comms[r], &s);
    st[r] = s;
  }
  return st;
}

// One rank: K rounds of {all-gather joined to the compute stream, ring send/recv waited through
// an event}, checking data every round; a watchdog thread polls the async error meanwhile.
std::string rank_loop(int rank, int P, int dev, ncclComm_t comm) {
  void* ctx = nullptr;
  cuDevicePrimaryCtxRetain(&ctx, dev);
  cuCtxSetCurrent(ctx);
  void *compute = new_stream(), *cs = new_stream();
  std::mutex lock;  // RawComm's handle mutex: no two NCCL calls on one communicator overlap
  std::atomic<bool> stop{false};
  std::atomic<int> seen{ncclSuccess}, polls{0};
  std::thread watchdog([&] {
    while (!stop.load()) {
      {
        std::unique_lock<std::mutex> g(lock, std::try_to_lock);
        ncclResult_t s = ncclSuccess;
        if (g.owns_lock() && ncclCommGetAsyncError(comm, &s) == ncclSuccess && s != ncclSuccess) seen = s;
        ++polls;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  std::string e;
  const int next = (rank + 1) % P, prev = (rank + P - 1) % P;
  for (int k = 0; k < 20 && e.empty(); ++k) {
    Buf x(N, ncclBfloat16), g(N * P, ncclBfloat16), out(N, ncclFloat32), in(N, ncclFloat32);
    x.fill(rank, 200 + k, N);
    out.fill(rank, 300 + k, N);
    void *ev = nullptr, *ev2 = nullptr, *ev3 = nullptr;
    cuEventCreate(&ev, 0);
    cuEventCreate(&ev2, 0);
    cuEventCreate(&ev3, 0);
    cuEventRecord(ev, compute);  // enter: comm stream waits for compute
    cuStreamWaitEvent(cs, ev, 0);
    {
      std::lock_guard<std::mutex> g0(lock);
      e += check_rc("ncclAllGather", ncclAllGather(x.p(), g.p(), N, ncclBfloat16, comm, cudaStream_t(cs)));
    }
    cuEventRecord(ev2, cs);  // leave(join): compute waits for comm
    e += check_rc("cuStreamWaitEvent", cuStreamWaitEvent(compute, ev2, 0), 0);
    for (int j = 0; j < P && e.empty(); ++j)
      expect(e, fmt("round %d all-gather block %d", k, j).c_str(), rank, g, j * N, N, [&](size_t i) { return val(j, i, 200 + k, ncclBfloat16); });
    {
      std::lock_guard<std::mutex> g0(lock);
      ncclGroupStart();
      e += check_rc("ncclSend", ncclSend(out.p(), N, ncclFloat32, next, comm, cudaStream_t(cs)));
      e += check_rc("ncclRecv", ncclRecv(in.p(), N, ncclFloat32, prev, comm, cudaStream_t(cs)));
      e += check_rc("ncclGroupEnd", ncclGroupEnd());
    }
    cuEventRecord(ev3, cs);  // PendingRecv::wait
    e += check_rc("cuEventSynchronize", cuEventSynchronize(ev3), 0);
    expect(e, fmt("round %d ring recv", k).c_str(), rank, in, 0, N, [&](size_t i) { return val(prev, i, 300 + k, ncclFloat32); });
    cuEventDestroy_v2(ev);
    cuEventDestroy_v2(ev2);
    cuEventDestroy_v2(ev3);
  }
  e += check_rc("final cuStreamSynchronize", cuStreamSynchronize(cs), 0);
  for (auto t = std::chrono::steady_clock::now(); polls.load() < 3 && secs_since(t) < 2;) std::this_thread::yield();
  stop = true;
  watchdog.join();
  if (seen.load() != ncclSuccess) e += fmt(" watchdog saw async error %d;", seen.load());
  if (polls.load() < 3) e += " watchdog did not poll;";
  cuStreamDestroy_v2(compute);
  cuStreamDestroy_v2(cs);
  return e;
}

}  // namespace

void test_group_pattern() {
  const int P = 4;
  if (cp_shim::device_count() < P) {
    report("NcclGroup pattern", fmt("needs CPEMU_DEVICES >= %d (have %d)", P, cp_shim::device_count()));
    return;
  }
  {
    const char* same = getenv("CPEMU_NCCL_SAME_DEVICE");
    std::string saved = same ? same : "";
    unsetenv("CPEMU_NCCL_SAME_DEVICE");
    std::vector<ncclComm_t> comms;
    auto st = grouped_init({0, 1, 1}, comms);
    std::string e;
    for (int r = 0; r < 3; ++r) e += check_rc(fmt("rank %d state", r).c_str(), st[r], ncclInvalidUsage);
    if (!strstr(ncclGetLastError(comms[1]), "duplicate GPU")) e += fmt(" last error: %s", ncclGetLastError(comms[1]));
    for (ncclComm_t c : comms) e += check_rc("ncclCommAbort", ncclCommAbort(c));
    if (same) setenv("CPEMU_NCCL_SAME_DEVICE", saved.c_str(), 1);
    report("two ranks on one device (contexts of devices 0, 1, 1): init fails with ncclInvalidUsage", e);
  }
  std::vector<int> devs = {0, 1, 2, 3};
  std::vector<ncclComm_t> comms;
  auto st = grouped_init(devs, comms);
  std::string e;
  for (int r = 0; r < P; ++r) {
    int d = -1;
    e += check_rc(fmt("rank %d init", r).c_str(), st[r]);
    ncclCommCuDevice(comms[r], &d);
    if (d != devs[r]) e += fmt(" rank %d on device %d;", r, d);
  }
  if (e.empty()) {
    std::vector<std::string> errs(P);
    std::vector<std::thread> ts;
    for (int r = 0; r < P; ++r) ts.emplace_back([&, r] { errs[r] = rank_loop(r, P, devs[r], comms[r]); });
    for (auto& t : ts) t.join();
    for (auto& x : errs) e += x;
  }
  for (ncclComm_t c : comms) e += check_rc("ncclCommAbort at teardown", ncclCommAbort(c));
  report("NcclGroup pattern, 4 devices: grouped non-blocking init, comm/compute streams + events, watchdog, 20 rounds", e);
}
