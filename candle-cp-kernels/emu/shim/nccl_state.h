// Internal state of the shim's libnccl (nccl.cpp; see there for the semantics): operations,
// communicators (ncclComm) and the clique of ranks they share. Included by nccl.cpp only.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "nccl_abi.h"
#include "shim.h"

namespace cp_nccl {

using cp_shim::WorkPtr;

enum Kind { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kReduce, kAllToAll, kSend, kRecv };
inline const char* const kKindName[] = {"ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast",
                                        "ncclReduce",    "ncclAlltoAll",  "ncclSend",          "ncclRecv"};

// One rank's part of an operation. `count` is NCCL's count argument (per-rank send count for
// all-gather, per-rank receive count for reduce-scatter, per-peer count for all-to-all).
struct Entry {
  int rank = 0;
  Kind kind = kAllReduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  int dt = 0, op = 0, root = 0;
  WorkPtr work;
};

enum State { kInit, kReady, kFailed, kAborted };

struct Clique;
struct FilesComm;  // files transport (nccl_files.cpp)

inline thread_local char t_last[1024];  // ncclGetLastError when no communicator message applies

inline void set_last(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void set_last(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t_last, sizeof t_last, fmt, ap);
  va_end(ap);
  cp_shim::log("nccl: %s", t_last);
}

}  // namespace cp_nccl

// One rank of a communicator (the opaque type behind ncclComm_t).
struct ncclComm {
  std::shared_ptr<cp_nccl::Clique> cl;  // threads transport
  cp_nccl::FilesComm* fx = nullptr;     // files transport (then cl is null)
  int rank = 0, nranks = 0, dev = -1;
  bool blocking = true;
  std::atomic<int> state{cp_nccl::kInit};
  std::atomic<int> err{ncclSuccess};  // asynchronous error (first one wins)
  std::atomic<bool> has_msg{false};
  char msg[512] = {};
  uint64_t coll_seq = 0;                           // used by the owning thread only
  std::vector<uint64_t> send_seq, recv_seq;        // per peer, idem
};

namespace cp_nccl {

// The ranks of one communicator: rendezvous state and the operations posted but not matched yet.
struct Clique {
  std::mutex m;
  std::condition_variable cv;
  std::string key;
  int nranks = 0, joined = 0;
  bool formed = false;
  int fail = ncclSuccess;
  std::vector<ncclComm*> comms;  // null once a rank left (abort/destroy) or before it joined
  std::vector<bool> gone;
  std::map<uint64_t, std::vector<Entry>> coll;
  std::map<std::tuple<int, int, uint64_t>, std::vector<Entry>> p2p;
  int busy = 0;  // matched operations whose data movement is in flight (outside m)
};

// Process-wide state, never destroyed (threads such as NcclGroup's watchdog may still call in
// while the process exits). mu guards rendezvous and live, and is taken before any Clique::m.
struct Globals {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Clique>> rendezvous;  // cliques still forming, by id
  std::unordered_set<ncclComm*> live;                         // every handle ever returned, until destroyed
};
inline Globals& G() {
  static Globals* g = new Globals;
  return *g;
}

// First asynchronous error of `c` (caller holds c->cl->m or owns c exclusively).
inline void set_error(ncclComm* c, int code, const std::string& what) {
  int expected = ncclSuccess;
  if (!c || !c->err.compare_exchange_strong(expected, code)) return;
  snprintf(c->msg, sizeof c->msg, "%s", what.c_str());
  c->has_msg.store(true);
}

inline bool peer_abort_hangs() {
  const char* v = getenv("CPEMU_NCCL_PEER_ABORT");
  return v && strcmp(v, "hang") == 0;
}

inline std::string label(const ncclComm* c) {
  char b[96];
  snprintf(b, sizeof b, "rank %d of %d (comm %p)", c->rank, c->nranks, static_cast<const void*>(c));
  return b;
}

// Completes the Works of `es` with `code`, setting `what` as the async error of their ranks.
inline void fail_entries(Clique& cl, const std::vector<Entry>& es, int code, const std::string& what) {
  for (const Entry& e : es) {
    set_error(cl.comms[e.rank], code, what);
    e.work->complete(code);
  }
}

// A usage bug (mismatch): fails every pending operation of the communicator and sets `code` as
// the asynchronous error of every rank, so that no rank waits for the others (caller holds cl.m).
inline void poison(Clique& cl, int code, const std::string& what) {
  cp_shim::log("nccl: %s", what.c_str());
  for (ncclComm* p : cl.comms) set_error(p, code, what);
  for (auto& kv : cl.coll) fail_entries(cl, kv.second, code, what);
  for (auto& kv : cl.p2p) fail_entries(cl, kv.second, code, what);
  cl.coll.clear();
  cl.p2p.clear();
}

}  // namespace cp_nccl
