// Matching and data movement of the shim's libnccl (nccl.cpp; see there for the semantics):
// post() files one rank's operation into its clique and, when that completes a match, moves the
// data and completes every participant's Work; leave() takes a rank out (abort / destroy).
// Included by nccl.cpp only.
#pragma once
#include <algorithm>
#include <chrono>

#include "nccl_reduce.h"
#include "nccl_state.h"

namespace cp_nccl {

// Moves the data of a complete collective (es[r] = rank r's entry), then completes it.
inline void execute(std::vector<Entry>& es) {
  const Entry& a = es[0];
  const int P = static_cast<int>(es.size());
  const size_t sz = cp_nccl::dtype_size(a.dt), n = a.count, bytes = n * sz;
  std::vector<const void*> srcs(P);
  std::vector<char> tmp;
  switch (bytes ? a.kind : kSend) {  // (count 0: buffers may be NULL, nothing to move)
    case kAllReduce:
    case kReduce:
      tmp.resize(bytes);
      for (int r = 0; r < P; ++r) srcs[r] = es[r].send;
      cp_nccl::reduce(tmp.data(), srcs.data(), P, n, a.dt, a.op);
      for (int r = 0; r < P; ++r)
        if (a.kind == kAllReduce || r == a.root) memmove(es[r].recv, tmp.data(), bytes);
      break;
    case kReduceScatter:
      tmp.resize(bytes * P);
      for (int r = 0; r < P; ++r) srcs[r] = es[r].send;
      cp_nccl::reduce(tmp.data(), srcs.data(), P, n * P, a.dt, a.op);
      for (int r = 0; r < P; ++r) memmove(es[r].recv, tmp.data() + r * bytes, bytes);
      break;
    case kAllGather:
      tmp.resize(bytes * P);
      for (int r = 0; r < P; ++r) memmove(tmp.data() + r * bytes, es[r].send, bytes);
      for (int r = 0; r < P; ++r) memmove(es[r].recv, tmp.data(), bytes * P);
      break;
    case kBroadcast:
      tmp.assign(static_cast<const char*>(es[a.root].send), static_cast<const char*>(es[a.root].send) + bytes);
      for (int r = 0; r < P; ++r) memmove(es[r].recv, tmp.data(), bytes);
      break;
    case kAllToAll:  // recv_r[k] = send_k[r], blocks of `count`
      tmp.resize(bytes * P * P);
      for (int k = 0; k < P; ++k) memmove(tmp.data() + k * P * bytes, es[k].send, P * bytes);
      for (int r = 0; r < P; ++r)
        for (int k = 0; k < P; ++k) memmove(static_cast<char*>(es[r].recv) + k * bytes, tmp.data() + (k * P + r) * bytes, bytes);
      break;
    default:
      break;
  }
  for (Entry& e : es) e.work->complete(ncclSuccess);
}

inline std::string describe(const Entry& e) {
  char b[160];
  int n = snprintf(b, sizeof b, "%s(rank %d, count %zu, %s", kKindName[e.kind], e.rank, e.count, dtype_name(e.dt));
  if (e.kind == kAllReduce || e.kind == kReduceScatter || e.kind == kReduce) n += snprintf(b + n, sizeof b - n, ", %s", op_name(e.op));
  if (e.kind == kBroadcast || e.kind == kReduce) n += snprintf(b + n, sizeof b - n, ", root %d", e.root);
  snprintf(b + n, sizeof b - n, ")");
  return b;
}

inline bool same_collective(const Entry& a, const Entry& b) {
  if (a.kind != b.kind || a.count != b.count || a.dt != b.dt) return false;
  if ((a.kind == kAllReduce || a.kind == kReduceScatter || a.kind == kReduce) && a.op != b.op) return false;
  return !((a.kind == kBroadcast || a.kind == kReduce) && a.root != b.root);
}

// Ends one data movement counted in cl.busy (started under cl.m).
inline void idle(Clique& cl) {
  std::lock_guard<std::mutex> g(cl.m);
  --cl.busy;
  cl.cv.notify_all();
}

// One posted operation (made by an API call; posted now or at the outermost ncclGroupEnd).
struct Op {
  ncclComm* comm;
  Entry e;
  void* stream;
  uint64_t seq;
  int peer;  // send/recv only
};

inline void post(Op& op) {
  ncclComm* c = op.comm;
  Clique& cl = *c->cl;
  Entry& e = op.e;
  cp_shim::stream_push(op.stream, e.work);
  std::unique_lock<std::mutex> lk(cl.m);
  if (c->state.load() == kAborted || c->err.load() != ncclSuccess) {
    e.work->complete(c->state.load() == kAborted ? ncclInvalidUsage : c->err.load());
    return;
  }
  const bool p2p = e.kind == kSend || e.kind == kRecv;
  if (!peer_abort_hangs()) {
    for (int r = 0; r < cl.nranks; ++r)
      if (cl.gone[r] && (!p2p || r == op.peer)) {
        char w[256];
        snprintf(w, sizeof w, "%s of %s: rank %d left the communicator (ncclCommAbort/Destroy), the "
                 "operation can never complete", kKindName[e.kind], label(c).c_str(), r);
        cp_shim::log("nccl: %s", w);
        fail_entries(cl, {e}, ncclRemoteError, w);
        return;
      }
  }
  std::vector<Entry> ready;
  if (p2p) {
    const bool is_send = e.kind == kSend;
    auto key = std::make_tuple(is_send ? e.rank : op.peer, is_send ? op.peer : e.rank, op.seq);
    auto it = cl.p2p.find(key);
    if (it == cl.p2p.end()) {
      cl.p2p[key].push_back(e);
      return;
    }
    Entry other = it->second[0];
    cl.p2p.erase(it);
    if (other.count != e.count || other.dt != e.dt) {
      std::string w = "mismatched send/recv #" + std::to_string(op.seq) + " between ranks " +
                      std::to_string(std::get<0>(key)) + " -> " + std::to_string(std::get<1>(key)) + ": " +
                      describe(other) + " vs " + describe(e);
      fail_entries(cl, {other, e}, ncclInvalidUsage, w);
      poison(cl, ncclInvalidUsage, w + "; every rank's communicator is poisoned");
      return;
    }
    ++cl.busy;
    lk.unlock();
    const Entry& s = is_send ? e : other;
    const Entry& r = is_send ? other : e;
    if (s.count) memmove(r.recv, s.send, s.count * cp_nccl::dtype_size(s.dt));
    s.work->complete(ncclSuccess);
    r.work->complete(ncclSuccess);
    idle(cl);
    return;
  }
  auto& slot = cl.coll[op.seq];
  if (!slot.empty() && !same_collective(slot[0], e)) {
    std::string w = "mismatched collective #" + std::to_string(op.seq) + " on a communicator of " +
                    std::to_string(cl.nranks) + " ranks: " + describe(slot[0]) + " vs " + describe(e) +
                    " (real NCCL would hang or corrupt data); every rank's communicator is poisoned";
    slot.push_back(e);
    poison(cl, ncclInvalidUsage, w);
    return;
  }
  slot.push_back(e);
  if (static_cast<int>(slot.size()) < cl.nranks) return;
  ready.resize(cl.nranks);
  for (Entry& x : slot) ready[x.rank] = x;
  cl.coll.erase(op.seq);
  ++cl.busy;
  lk.unlock();
  execute(ready);
  idle(cl);
}

// Takes `c` out of its clique. Pending Works of this rank complete with ncclSystemError; in
// the default peer-abort mode, those of the peers that need this rank with ncclRemoteError.
inline void leave(ncclComm* c, const char* why) {
  Clique& cl = *c->cl;
  const int me = c->rank;
  {
    std::lock_guard<std::mutex> g0(G().mu);
    std::lock_guard<std::mutex> g(cl.m);
    if (!cl.formed) {  // (a clique never goes back to forming)
      cl.comms[me] = nullptr;
      if (--cl.joined == 0) {
        auto it = G().rendezvous.find(cl.key);
        if (it != G().rendezvous.end() && it->second.get() == &cl) G().rendezvous.erase(it);
      }
      return;
    }
  }
  std::unique_lock<std::mutex> lk(cl.m);
  // a data movement in flight may read or write this rank's buffers, which the caller may free
  // once we return: let it finish (it takes no lock until it is done)
  cl.cv.wait_for(lk, std::chrono::duration<double>(cp_shim::wait_timeout_s()), [&] { return cl.busy == 0; });
  char w[200];
  snprintf(w, sizeof w, "rank %d of %d left the communicator (%s) while this operation needed it", me, cl.nranks, why);
  const bool fail_peers = !peer_abort_hangs();
  cl.gone[me] = true;
  for (auto it = cl.coll.begin(); it != cl.coll.end();) {
    for (Entry& e : it->second)
      if (e.rank == me) e.work->complete(ncclSystemError);
    if (fail_peers) {
      std::vector<Entry> peers;
      for (Entry& e : it->second)
        if (e.rank != me) peers.push_back(e);
      fail_entries(cl, peers, ncclRemoteError, w);
    }
    if (fail_peers) {
      it = cl.coll.erase(it);
    } else {  // keep the peers' entries pending
      auto& v = it->second;
      v.erase(std::remove_if(v.begin(), v.end(), [&](const Entry& e) { return e.rank == me; }), v.end());
      it = v.empty() ? cl.coll.erase(it) : std::next(it);
    }
  }
  for (auto it = cl.p2p.begin(); it != cl.p2p.end();) {
    const bool mine = std::get<0>(it->first) == me || std::get<1>(it->first) == me;
    const Entry& e = it->second[0];
    if (mine && e.rank == me) {
      e.work->complete(ncclSystemError);
    } else if (mine && fail_peers) {
      fail_entries(cl, {e}, ncclRemoteError, w);
    } else {
      ++it;
      continue;
    }
    it = cl.p2p.erase(it);
  }
  cl.comms[me] = nullptr;
}

}  // namespace cp_nccl
