// libnccl.so.2 of the host CUDA shim (model: shim.h): NCCL 2.30's C API, ABI as cudarc 0.19.10
// binds it (nccl_abi.h), over one of two transports that CPEMU_NCCL_TRANSPORT selects at each
// init: `threads` (default): ranks are threads of this process, the unique id names a rendezvous
// inside it; `files`: ranks are processes (or threads) of one host that exchange data through
// files (last point below; nccl_files.cpp). State: nccl_state.h; matching and data movement of
// the threads transport: nccl_match.h; element arithmetic: nccl_reduce.h. Tests: test_nccl.sh.
// The points below hold for both transports, except where the last one says otherwise.
//
// - Init: ncclCommInitRank* joins a process-global rendezvous keyed by the id's 128 bytes
//   (duplicate rank, rank out of range, nranks differing from the first joiner's, a config
//   without NCCL_CONFIG_INITIALIZER's magic: ncclInvalidArgument). Blocking init waits for all
//   ranks at most cp_shim::wait_timeout_s() (CPEMU_WAIT_TIMEOUT_S), then withdraws, logs and
//   returns ncclSystemError with *comm = NULL; inside ncclGroupStart/End that wait happens at the
//   outermost ncclGroupEnd. Non-blocking init (config.blocking = 0) returns ncclInProgress (or
//   ncclSuccess if it completed the clique) and ncclCommGetAsyncError reports ncclInProgress
//   until every rank joined, for ever, as NCCL does: its caller bounds that wait (NcclGroup
//   polls to its timeout, then aborts). Two ranks on one device (the thread's current context,
//   cuCtxGetDevice; ncclCommInitAll: devlist) fail the init with ncclInvalidUsage like NCCL's
//   "Duplicate GPU", unless CPEMU_NCCL_SAME_DEVICE=1.
// - Operations are asynchronous: each makes a cp_shim::Work, pushed on its stream when posted,
//   at the call or, inside a group, at the outermost ncclGroupEnd (so a ring's send and recv
//   never wait for each other). Collectives match across ranks by a per-communicator sequence
//   number, send/recv by (src, dst, per-pair sequence). The rank whose post completes a match
//   moves the data (host memory, staged through a temporary so in-place variants work; reduction
//   order and precision: nccl_reduce.h) and completes every participant's Work. Calls return
//   ncclSuccess once posted, blocking or not.
// - A posted operation that fails sets the communicator's asynchronous error
//   (ncclCommGetAsyncError; its text: ncclGetLastError(comm)); later calls on that communicator
//   return the error. A mismatch (different kind, count, datatype, reduce op or root at one
//   sequence number; a send and its recv of different count or datatype) fails every pending
//   operation of the communicator with ncclInvalidUsage, poisons every rank and logs both sides:
//   real NCCL would hang or corrupt data there.
// - ncclCommAbort (never hangs) waits for a data movement in flight, completes this rank's
//   pending Works with ncclSystemError, and keeps the handle as a tombstone that refuses every
//   later call with ncclInvalidUsage (NCCL frees it; using it is undefined there). Peers,
//   CPEMU_NCCL_PEER_ABORT=error (default): their pending and later operations that need the
//   aborted rank complete at once with ncclRemoteError, which also becomes their asynchronous
//   error (their watchdog aborts on it); =hang: they stay pending like NCCL within a node (a
//   watchdog must time them out and abort). Operations not involving it (send/recv between
//   live ranks) proceed. ncclCommDestroy first waits (bounded) for this rank's pending work.
// - Files transport (CPEMU_NCCL_TRANSPORT=files; one process per GPU, as NcclGroup::from_env):
//   a communicator is the directory $CPEMU_NCCL_DIR (default ${TMPDIR:-/tmp}/cpemu-nccl-<uid>)
//   /<128-bit hash of the id>, shared by its ranks. Init: each rank publishes join.<r> (nranks,
//   device, pid, host); the communicator forms once all nranks exist (a duplicate rank, or nranks
//   differing from a published one: ncclInvalidArgument; a rank whose process exits first:
//   ncclRemoteError, unless =hang). ncclCommInitAll uses it too (its ranks are threads of this process). A
//   progress thread per communicator runs the posted units (one lone call, or one
//   communicator's calls at one outermost ncclGroupEnd) in posting order, as NCCL orders one
//   communicator's work: a unit writes its sends first (a send completes once its receiver has
//   consumed it), then completes its receives and its collectives (in order) as their inputs
//   appear; ungrouped send/recv that wait for each other therefore deadlock, as in NCCL, until
//   the caller's timeout. Each rank computes its own result from all ranks' parts in the order
//   and precision above (bit-identical to the threads transport). Buffers are read and written
//   when the unit runs (after the communicator's earlier units). A rank that aborts or destroys
//   publishes gone.<r>; a rank whose process exited (no such pid, or a zombie) counts as gone;
//   an operation that needs a part a gone rank never wrote fails as above (=hang: stays
//   pending). A mismatch is published as the file `poison`, which every rank's progress thread
//   and ncclCommGetAsyncError pick up. ncclCommAbort stops the progress thread (it looks every
//   2 ms at most) and never hangs; the last rank out (the others gone or exited) removes the
//   directory.
#include <chrono>
#include <random>
#include <unistd.h>

#include "nccl_abi.h"
#include "nccl_files.h"
#include "nccl_match.h"
#include "nccl_reduce.h"
#include "nccl_state.h"
#include "shim.h"

extern "C" int cuCtxGetDevice(int* dev) __attribute__((weak));  // driver part, if linked

namespace {

using namespace cp_nccl;

// Marks `cl` formed: checks for two ranks on one device (NCCL's "Duplicate GPU").
void form(Clique& cl) {
  cl.formed = true;
  const char* same = getenv("CPEMU_NCCL_SAME_DEVICE");
  if (!(same && strcmp(same, "1") == 0)) {
    for (int a = 0; a < cl.nranks; ++a)
      for (int b = a + 1; b < cl.nranks; ++b)
        if (cl.comms[a]->dev >= 0 && cl.comms[a]->dev == cl.comms[b]->dev) {
          char w[256];
          snprintf(w, sizeof w, "init: duplicate GPU: ranks %d and %d of %d are both on device %d "
                   "(NCCL refuses this; CPEMU_NCCL_SAME_DEVICE=1 allows it)", a, b, cl.nranks, cl.comms[a]->dev);
          cp_shim::log("nccl: %s", w);
          cl.fail = ncclInvalidUsage;
          for (ncclComm* c : cl.comms) set_error(c, ncclInvalidUsage, w);
          a = b = cl.nranks;
        }
  }
  for (ncclComm* c : cl.comms) c->state.store(cl.fail == ncclSuccess ? kReady : kFailed);
  cl.cv.notify_all();
}

// The state of `c` after looking at its clique (an init in progress may have completed).
int refresh(ncclComm* c) {
  int s = c->state.load();
  if (s != kInit || c->fx) return s;
  std::lock_guard<std::mutex> g(c->cl->m);
  return c->state.load();
}

// Handle checks shared by every call: NULL / unknown (ncclInvalidArgument), aborted
// (ncclInvalidUsage). ncclSuccess otherwise.
int lookup(ncclComm* c, const char* fn) {
  if (!c) {
    set_last("%s: communicator is NULL", fn);
    return ncclInvalidArgument;
  }
  {
    std::lock_guard<std::mutex> g(G().mu);
    if (!G().live.count(c)) {
      set_last("%s: %p is not a live communicator (destroyed, or never created)", fn, static_cast<void*>(c));
      return ncclInvalidArgument;
    }
  }
  if (c->state.load() == kAborted) {
    set_last("%s: %s was aborted (ncclCommAbort); the handle must not be used", fn, label(c).c_str());
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

// lookup(), then: still initializing (ncclInvalidUsage) or an asynchronous error (that error).
int check_comm(ncclComm* c, const char* fn) {
  if (int r = lookup(c, fn)) return r;
  if (refresh(c) == kInit) {
    set_last("%s: %s is still initializing (poll ncclCommGetAsyncError until ncclSuccess)", fn, label(c).c_str());
    return ncclInvalidUsage;
  }
  if (int e = c->err.load()) {
    set_last("%s: %s has an asynchronous error (%d): %s", fn, label(c).c_str(), e, c->has_msg.load() ? c->msg : "");
    return e;
  }
  return ncclSuccess;
}

// Group state of the calling thread.
thread_local int t_depth = 0;
thread_local std::vector<Op> t_ops;
thread_local std::vector<std::pair<ncclComm*, ncclComm_t*>> t_inits;  // blocking inits to wait for

int enqueue(ncclComm* c, Kind kind, const void* send, void* recv, size_t count, int dt, int op, int root,
            int peer, cudaStream_t stream) {
  const char* fn = kKindName[kind];
  if (int r = check_comm(c, fn)) return r;
  const size_t sz = cp_nccl::dtype_size(dt);
  if (sz == 0) {
    set_last("%s: invalid datatype %d", fn, dt);
    return ncclInvalidArgument;
  }
  if ((kind == kAllReduce || kind == kReduceScatter || kind == kReduce) && (op < 0 || op >= ncclNumOps)) {
    set_last("%s: invalid reduction op %d", fn, op);
    return ncclInvalidArgument;
  }
  const bool p2p = kind == kSend || kind == kRecv;
  const bool rooted = kind == kBroadcast || kind == kReduce;
  if ((p2p && (peer < 0 || peer >= c->nranks)) || (rooted && (root < 0 || root >= c->nranks))) {
    set_last("%s: %s %d out of range for %s", fn, p2p ? "peer" : "root", p2p ? peer : root, label(c).c_str());
    return ncclInvalidArgument;
  }
  const bool needs_send = kind != kRecv && !(kind == kBroadcast && c->rank != root);
  const bool needs_recv = kind != kSend && !(kind == kReduce && c->rank != root);
  if (count && ((needs_send && !send) || (needs_recv && !recv))) {
    set_last("%s: NULL buffer with count %zu on %s", fn, count, label(c).c_str());
    return ncclInvalidArgument;
  }
  Op o{c, Entry{}, stream, 0, peer};
  o.e = Entry{c->rank, kind, send, recv, count, dt, op, root, std::make_shared<cp_shim::Work>()};
  o.seq = kind == kSend ? c->send_seq[peer]++ : kind == kRecv ? c->recv_seq[peer]++ : c->coll_seq++;
  char w[200];
  snprintf(w, sizeof w, "%s #%llu %s%s", fn, static_cast<unsigned long long>(o.seq), label(c).c_str(),
           p2p ? (std::string(kind == kSend ? " to peer " : " from peer ") + std::to_string(peer)).c_str() : "");
  o.e.work->what = w;
  if (t_depth > 0) {
    t_ops.push_back(std::move(o));
  } else if (c->fx) {
    std::vector<Op> unit{std::move(o)};
    files::post(unit);
  } else {
    post(o);
  }
  return ncclSuccess;
}

// Blocking wait for the clique of `c` to form (or fail), at most wait_timeout_s().
int wait_formed(ncclComm* c, const char* fn) {
  if (c->fx) return files::wait_formed(c, fn);
  Clique& cl = *c->cl;
  std::unique_lock<std::mutex> lk(cl.m);
  const double t = cp_shim::wait_timeout_s();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(t);
  if (!cl.cv.wait_until(lk, deadline, [&] { return cl.formed; })) {
    set_last("%s: %s: only %d of %d ranks joined within %.1f s (CPEMU_WAIT_TIMEOUT_S); giving up",
             fn, label(c).c_str(), cl.joined, cl.nranks, t);
    return ncclSystemError;
  }
  if (cl.fail) set_last("%s: %s: %s", fn, label(c).c_str(), c->msg);
  return cl.fail;
}

int init_rank(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, bool blocking, const char* fn) {
  if (!out) {
    set_last("%s: comm pointer is NULL", fn);
    return ncclInvalidArgument;
  }
  *out = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    set_last("%s: rank %d out of range for %d ranks", fn, rank, nranks);
    return ncclInvalidArgument;
  }
  int dev = -1;
  if (cuCtxGetDevice && cuCtxGetDevice(&dev) != 0) dev = -1;
  auto* c = new ncclComm;
  c->rank = rank;
  c->nranks = nranks;
  c->dev = dev;
  c->blocking = blocking;
  c->send_seq.assign(nranks, 0);
  c->recv_seq.assign(nranks, 0);
  if (const int tr = files::transport(); tr != 0) {
    int r = tr < 0 ? static_cast<int>(ncclInvalidArgument) : files::join(c, id, fn);
    if (tr < 0) set_last("%s: CPEMU_NCCL_TRANSPORT=%s: unknown transport (threads or files)", fn, getenv("CPEMU_NCCL_TRANSPORT"));
    if (r != ncclSuccess) {
      delete c;
      return r;
    }
    std::lock_guard<std::mutex> g0(G().mu);
    G().live.insert(c);
  } else {
    std::lock_guard<std::mutex> g0(G().mu);
    std::string key(id.internal, sizeof id.internal);
    auto& cl = G().rendezvous[key];
    if (!cl) {
      cl = std::make_shared<Clique>();
      cl->key = key;
      cl->nranks = nranks;
      cl->comms.assign(nranks, nullptr);
      cl->gone.assign(nranks, false);
    }
    std::lock_guard<std::mutex> g(cl->m);
    if (cl->nranks != nranks || cl->comms[rank]) {
      if (cl->nranks != nranks)
        set_last("%s: rank %d joins with %d ranks, but this id's communicator has %d", fn, rank, nranks, cl->nranks);
      else
        set_last("%s: rank %d of %d joined twice with the same id", fn, rank, nranks);
      delete c;
      return ncclInvalidArgument;
    }
    c->cl = cl;
    cl->comms[rank] = c;
    G().live.insert(c);
    if (++cl->joined == nranks) {
      form(*cl);
      G().rendezvous.erase(key);
    }
  }
  *out = c;
  if (!blocking) return refresh(c) == kInit ? ncclInProgress : c->err.load();
  if (t_depth > 0) {
    t_inits.emplace_back(c, out);
    return ncclSuccess;
  }
  int r = wait_formed(c, fn);
  if (r != ncclSuccess) {
    ncclCommAbort(c);  // (declared by the extern "C" section below)
    *out = nullptr;
  }
  return r;
}

// ncclCommInitAll over the files transport: ranks of this process that talk through files.
int init_all_files(ncclComm_t* comms, int ndev, const int* devlist) {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  std::vector<ncclComm*> cs;
  int res = ncclSuccess;
  for (int r = 0; r < ndev && res == ncclSuccess; ++r) {
    auto* c = new ncclComm;
    c->rank = r;
    c->nranks = ndev;
    c->dev = devlist ? devlist[r] : r;
    c->send_seq.assign(ndev, 0);
    c->recv_seq.assign(ndev, 0);
    if ((res = files::join(c, id, "ncclCommInitAll")) != ncclSuccess) {
      delete c;
      break;
    }
    std::lock_guard<std::mutex> g(G().mu);
    G().live.insert(c);
    cs.push_back(c);
  }
  for (size_t r = 0; r < cs.size() && res == ncclSuccess; ++r) res = wait_formed(cs[r], "ncclCommInitAll");
  for (int r = 0; r < ndev; ++r) comms[r] = res == ncclSuccess ? cs[r] : nullptr;
  if (res != ncclSuccess)
    for (ncclComm* c : cs) {
      ncclCommAbort(c);
      ncclCommDestroy(c);
    }
  return res;
}

}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (see ncclGetLastError / the cpemu log)";
    case ncclSystemError: return "unhandled system error (see ncclGetLastError / the cpemu log)";
    case ncclInternalError: return "internal error (see ncclGetLastError / the cpemu log)";
    case ncclInvalidArgument: return "invalid argument (see ncclGetLastError / the cpemu log)";
    case ncclInvalidUsage: return "invalid usage (see ncclGetLastError / the cpemu log)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclTimeout: return "NCCL operation timed out";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  if (comm) {
    std::lock_guard<std::mutex> g(G().mu);
    if (G().live.count(comm) && comm->has_msg.load()) return comm->msg;
  }
  return t_last;
}

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  *version = kNcclVersionCode;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) {
    set_last("ncclGetUniqueId: NULL id");
    return ncclInvalidArgument;
  }
  static std::atomic<uint64_t> serial{0};
  std::random_device rd;
  for (size_t i = 0; i < sizeof id->internal; i += 4) {
    uint32_t v = rd();
    memcpy(id->internal + i, &v, 4);
  }
  uint64_t head[3] = {0x64692d6c63636e43ull /* "Cnccl-id" */, serial.fetch_add(1) + 1,
                      static_cast<uint64_t>(getpid()) ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count())};
  memcpy(id->internal, head, sizeof head);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return static_cast<ncclResult_t>(init_rank(comm, nranks, id, rank, true, "ncclCommInitRank"));
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  bool blocking = true;
  if (config) {
    if (config->magic != kNcclConfigMagic) {
      set_last("ncclCommInitRankConfig: config not initialized with NCCL_CONFIG_INITIALIZER (magic 0x%x)", config->magic);
      if (comm) *comm = nullptr;
      return ncclInvalidArgument;
    }
    blocking = config->blocking == kNcclConfigUndefInt || config->blocking != 0;
  }
  return static_cast<ncclResult_t>(init_rank(comm, nranks, id, rank, blocking, "ncclCommInitRankConfig"));
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (!comms || ndev < 1) {
    set_last("ncclCommInitAll: invalid arguments (comms %p, ndev %d)", static_cast<void*>(comms), ndev);
    return ncclInvalidArgument;
  }
  if (files::transport() < 0) {
    set_last("ncclCommInitAll: CPEMU_NCCL_TRANSPORT=%s: unknown transport (threads or files)", getenv("CPEMU_NCCL_TRANSPORT"));
    return ncclInvalidArgument;
  }
  if (files::transport() == 1) return static_cast<ncclResult_t>(init_all_files(comms, ndev, devlist));
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  auto cl = std::make_shared<Clique>();
  cl->key.assign(id.internal, sizeof id.internal);
  cl->nranks = cl->joined = ndev;
  cl->gone.assign(ndev, false);
  for (int r = 0; r < ndev; ++r) {
    auto* c = new ncclComm;
    c->cl = cl;
    c->rank = r;
    c->nranks = ndev;
    c->dev = devlist ? devlist[r] : r;
    c->send_seq.assign(ndev, 0);
    c->recv_seq.assign(ndev, 0);
    cl->comms.push_back(c);
  }
  std::lock_guard<std::mutex> g0(G().mu);
  std::lock_guard<std::mutex> g(cl->m);
  form(*cl);
  if (cl->fail) {
    set_last("ncclCommInitAll: %s", cl->comms[0]->msg);
    for (ncclComm* c : cl->comms) delete c;
    for (int r = 0; r < ndev; ++r) comms[r] = nullptr;
    return static_cast<ncclResult_t>(cl->fail);
  }
  for (int r = 0; r < ndev; ++r) {
    G().live.insert(cl->comms[r]);
    comms[r] = cl->comms[r];
  }
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (int r = lookup(comm, "ncclCommGetAsyncError")) return static_cast<ncclResult_t>(r);
  if (!asyncError) return ncclInvalidArgument;
  if (comm->fx) files::check_poison(comm);
  *asyncError = static_cast<ncclResult_t>(refresh(comm) == kInit ? ncclInProgress : comm->err.load());
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  {
    std::lock_guard<std::mutex> g(G().mu);
    if (!G().live.count(comm)) {
      set_last("ncclCommAbort: %p is not a live communicator", static_cast<void*>(comm));
      return ncclInvalidArgument;
    }
  }
  if (comm->state.exchange(kAborted) == kAborted) return ncclSuccess;
  comm->fx ? files::leave(comm, "ncclCommAbort") : leave(comm, "ncclCommAbort");
  return ncclSuccess;
}

// Waits (bounded) until this rank's posted operations have completed (either transport).
static int drain_own(ncclComm* c, const char* fn) {
  std::vector<WorkPtr> ws;
  if (c->fx) {
    ws = files::pending(c);
  } else {
    std::lock_guard<std::mutex> g(c->cl->m);
    for (auto& kv : c->cl->coll)
      for (Entry& e : kv.second)
        if (e.rank == c->rank) ws.push_back(e.work);
    for (auto& kv : c->cl->p2p)
      if (kv.second[0].rank == c->rank) ws.push_back(kv.second[0].work);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(cp_shim::wait_timeout_s());
  for (WorkPtr& w : ws) {
    std::unique_lock<std::mutex> lk(w->m);
    if (!w->cv.wait_until(lk, deadline, [&] { return w->done; })) {
      set_last("%s: %s: %s did not complete within CPEMU_WAIT_TIMEOUT_S", fn, label(c).c_str(), w->what.c_str());
      return ncclSystemError;
    }
  }
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (int r = check_comm(comm, "ncclCommFinalize")) return static_cast<ncclResult_t>(r);
  return static_cast<ncclResult_t>(drain_own(comm, "ncclCommFinalize"));
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  {
    std::lock_guard<std::mutex> g(G().mu);
    if (!G().live.count(comm)) {
      set_last("ncclCommDestroy: %p is not a live communicator", static_cast<void*>(comm));
      return ncclInvalidArgument;
    }
  }
  if (refresh(comm) == kReady && comm->err.load() == ncclSuccess) drain_own(comm, "ncclCommDestroy");
  if (comm->state.exchange(kAborted) != kAborted) comm->fx ? files::leave(comm, "ncclCommDestroy") : leave(comm, "ncclCommDestroy");
  {
    std::lock_guard<std::mutex> g(G().mu);
    G().live.erase(comm);
  }
  if (comm->fx) files::release(comm);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (lookup(comm, "ncclCommCount") || !count) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (lookup(comm, "ncclCommUserRank") || !rank) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (lookup(comm, "ncclCommCuDevice") || !device) return ncclInvalidArgument;
  *device = comm->dev < 0 ? 0 : comm->dev;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++t_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_depth == 0) {
    set_last("ncclGroupEnd: no matching ncclGroupStart");
    return ncclInvalidUsage;
  }
  if (--t_depth > 0) return ncclSuccess;
  std::vector<Op> ops;
  ops.swap(t_ops);
  std::vector<std::vector<Op>> units;  // files transport: one unit per communicator, in order
  for (Op& o : ops) {
    if (!o.comm->fx) {
      post(o);
      continue;
    }
    auto u = std::find_if(units.begin(), units.end(), [&](const std::vector<Op>& x) { return x[0].comm == o.comm; });
    if (u == units.end()) u = units.emplace(units.end());
    u->push_back(std::move(o));
  }
  for (auto& u : units) files::post(u);
  std::vector<std::pair<ncclComm*, ncclComm_t*>> inits;
  inits.swap(t_inits);
  int res = ncclSuccess;
  for (auto& [c, out] : inits) {
    int r = wait_formed(c, "ncclGroupEnd (blocking init)");
    if (r != ncclSuccess) {
      ncclCommAbort(c);
      *out = nullptr;
      if (res == ncclSuccess) res = r;
    }
  }
  return static_cast<ncclResult_t>(res);
}

#define CP_BY_VALUE(kind, send, recv, count, dt, op, root, peer) \
  static_cast<ncclResult_t>(enqueue(comm, kind, send, recv, count, dt, op, root, peer, stream))

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  return CP_BY_VALUE(kAllReduce, sendbuff, recvbuff, count, datatype, op, 0, 0);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return CP_BY_VALUE(kReduce, sendbuff, recvbuff, count, datatype, op, root, 0);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return CP_BY_VALUE(kAllGather, sendbuff, recvbuff, sendcount, datatype, 0, 0, 0);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return CP_BY_VALUE(kReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, 0);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return CP_BY_VALUE(kBroadcast, sendbuff, recvbuff, count, datatype, 0, root, 0);
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  return CP_BY_VALUE(kBroadcast, buff, buff, count, datatype, 0, root, 0);
}

ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                          cudaStream_t stream) {
  return CP_BY_VALUE(kAllToAll, sendbuff, recvbuff, count, datatype, 0, 0, 0);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return CP_BY_VALUE(kSend, sendbuff, nullptr, count, datatype, 0, 0, peer);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return CP_BY_VALUE(kRecv, nullptr, recvbuff, count, datatype, 0, 0, peer);
}

}  // extern "C"
