// Files transport of the shim's libnccl (interface: nccl_files.h; semantics: nccl.cpp, "Files
// transport"). Directory layout, all files published atomically (written under a temporary
// name, then rename()d, or link()ed where the first writer must win):
//   join.<r>              rank r joined: "<nranks> <device> <pid> <host>" (link: EEXIST = duplicate)
//   gone.<r>              rank r left (ncclCommAbort / ncclCommDestroy): why
//   poison                first mismatch found by any rank: its message (link)
//   coll.<seq>.<r>        rank r's part of collective #seq: Hdr + payload
//   p2p.<src>.<dst>.<seq> send #seq from src to dst: Hdr + payload; the receiver unlinks it
// One progress thread per communicator completes the init, then the posted units in order.
#include <dirent.h>

#include <deque>

#include "nccl_files.h"
#include "nccl_files_io.h"
#include "nccl_reduce.h"

namespace cp_nccl {

struct FilesComm {
  ncclComm* c = nullptr;
  std::string dir;
  int rank = 0, P = 0;
  std::mutex m;                 // guards q, works; cv: units posted, stop, init done
  std::condition_variable cv;
  std::deque<std::vector<Op>> q;
  std::vector<WorkPtr> works;   // posted and maybe not complete (drain)
  std::atomic<bool> stop{false}, formed{false}, decided{false};  // decided: formed or failed
  std::atomic<int> joined{0};
  std::thread th;
  // progress thread only (and join(), before the thread starts)
  struct Peer { int pid = 0; std::string host, why; bool gone = false; };
  std::vector<Peer> peers;
  std::vector<Op> sends;        // written, not consumed by the receiver yet
  bool poisoned = false;
  std::chrono::steady_clock::time_point next_health{}, next_pids{};
};

namespace files {
namespace {

using Clock = std::chrono::steady_clock;

enum { kWait, kDone };

std::string path(const FilesComm* f, const std::string& name) { return f->dir + "/" + name; }

bool read_join(const FilesComm* f, int k, JoinInfo& j) { return read_join_file(path(f, "join." + std::to_string(k)), j); }

bool same_device_ok() {
  const char* same = getenv("CPEMU_NCCL_SAME_DEVICE");
  return same && strcmp(same, "1") == 0;
}

void notify_init(FilesComm* f) {
  { std::lock_guard<std::mutex> g(f->m); }
  f->cv.notify_all();
}

void init_failed(FilesComm* f, int code, const std::string& w) {
  cp_shim::log("nccl: %s: %s", label(f->c).c_str(), w.c_str());
  set_error(f->c, code, w);  // (before the state: a poller that sees kFailed reads the error)
  int expect = kInit;
  f->c->state.compare_exchange_strong(expect, kFailed);
  f->decided = true;
  notify_init(f);
}

// One look at the join files: true once the init is decided (formed, or failed).
bool try_form(FilesComm* f) {
  const int P = f->P;
  const std::string me = host_name();
  std::vector<int> devs(P, -1);
  int present = 0, dead = -1;
  for (int k = 0; k < P; ++k) {
    JoinInfo j;
    if (!read_join(f, k, j)) continue;
    ++present;
    if (j.nranks != P) {
      init_failed(f, ncclInvalidArgument, "init: rank " + std::to_string(k) + " joined this id with " + std::to_string(j.nranks) +
                  " ranks, rank " + std::to_string(f->rank) + " with " + std::to_string(P));
      return true;
    }
    devs[k] = j.dev;
    f->peers[k].pid = j.pid;
    f->peers[k].host = j.host;
    if (k != f->rank && j.host == me && !peer_abort_hangs() && pid_dead(j.pid)) dead = k;
  }
  f->joined = present;
  if (present < P && dead >= 0) {  // (once all joined, the init is decided as if it lived)
    init_failed(f, ncclRemoteError, "init: rank " + std::to_string(dead) + " (pid " + std::to_string(f->peers[dead].pid) +
                ") joined, then exited before every rank joined");
    return true;
  }
  if (present < P) return false;
  if (!same_device_ok())
    for (int a = 0; a < P; ++a)
      for (int b = a + 1; b < P; ++b)
        if (devs[a] >= 0 && devs[a] == devs[b]) {
          char w[256];
          snprintf(w, sizeof w, "init: duplicate GPU: ranks %d and %d of %d are both on device %d "
                   "(NCCL refuses this; CPEMU_NCCL_SAME_DEVICE=1 allows it)", a, b, P, devs[a]);
          init_failed(f, ncclInvalidUsage, w);
          return true;
        }
  int expect = kInit;
  if (f->c->state.compare_exchange_strong(expect, kReady)) f->formed = true;
  f->decided = true;
  notify_init(f);
  return true;
}

void complete_all(std::vector<Op>& ops, int code) {
  for (Op& o : ops) o.e.work->complete(code);
}

// Fails `o` with `code` (also the asynchronous error of this rank, text `w`).
void fail(FilesComm* f, Op& o, int code, const std::string& w) {
  set_error(f->c, code, w);
  o.e.work->complete(code);
}

// A mismatch or a peer's poison file: every pending operation of this rank fails.
void poison(FilesComm* f, const std::string& w, bool found_here) {
  if (f->poisoned) return;
  f->poisoned = true;
  if (found_here) {
    publish(f->dir, path(f, "poison"), w.data(), w.size(), nullptr, 0, true);
    cp_shim::log("nccl: %s", w.c_str());
  } else {
    cp_shim::log("nccl: %s: poisoned by a peer: %s", label(f->c).c_str(), w.c_str());
  }
  set_error(f->c, ncclInvalidUsage, w);
  complete_all(f->sends, ncclInvalidUsage);
  f->sends.clear();
  std::deque<std::vector<Op>> q;
  {
    std::lock_guard<std::mutex> g(f->m);
    q.swap(f->q);
  }
  for (auto& u : q) complete_all(u, ncclInvalidUsage);
}

// Looks for a poison file and for peers that left or died (rate-limited unless `force`).
void health(FilesComm* f, bool force) {
  const auto now = Clock::now();
  if (!force && now < f->next_health) return;
  f->next_health = now + std::chrono::milliseconds(5);
  std::string t;
  if (!f->poisoned && read_text(path(f, "poison"), t)) poison(f, t, false);
  if (peer_abort_hangs()) return;
  const bool pids = now >= f->next_pids;
  if (pids) f->next_pids = now + std::chrono::milliseconds(50);
  static const std::string me = host_name();
  for (int k = 0; k < f->P; ++k) {
    auto& p = f->peers[k];
    if (k == f->rank || p.gone) continue;
    if (read_text(path(f, "gone." + std::to_string(k)), t)) {
      p.gone = true;
      p.why = "left the communicator (" + t + ")";
    } else if (pids && p.host == me && pid_dead(p.pid)) {
      p.gone = true;
      p.why = "died (its process " + std::to_string(p.pid) + " exited without leaving the communicator)";
    }
  }
}

// For an input of `o` from rank k that is not there (file `p`): kDone after failing `o` with
// ncclRemoteError if k is gone for good, else kWait.
int missing(FilesComm* f, Op& o, int k, const std::string& p) {
  if (!f->peers[k].gone || exists(p)) return kWait;
  char w[512];
  snprintf(w, sizeof w, "%s of %s: rank %d of %d %s while this operation needed it", kKindName[o.e.kind],
           label(f->c).c_str(), k, f->P, f->peers[k].why.c_str());
  cp_shim::log("nccl: %s", w);
  fail(f, o, ncclRemoteError, w);
  return kDone;
}

void send_now(FilesComm* f, Op& o) {
  const Entry& e = o.e;
  if (f->peers[o.peer].gone) {
    missing(f, o, o.peer, "");
    return;
  }
  Hdr h{};
  memcpy(h.magic, kMagic, sizeof h.magic);
  h.kind = e.kind, h.dt = e.dt, h.rank = e.rank, h.count = e.count, h.seq = o.seq;
  h.bytes = e.count * dtype_size(e.dt);
  if (int err = publish(f->dir, path(f, p2p_name(f->rank, o.peer, o.seq)), &h, sizeof h, e.send, h.bytes, false)) {
    fail(f, o, ncclSystemError, std::string("ncclSend: writing its file in ") + f->dir + ": " + strerror(err));
    return;
  }
  f->sends.push_back(o);
}

// Completes the sends whose file the receiver consumed (or whose receiver is gone).
void poll_sends(FilesComm* f) {
  for (size_t i = 0; i < f->sends.size();) {
    Op& o = f->sends[i];
    const std::string p = path(f, p2p_name(f->rank, o.peer, o.seq));
    if (!exists(p)) {
      o.e.work->complete(ncclSuccess);
    } else if (missing(f, o, o.peer, "") == kWait) {
      ++i;
      continue;
    }
    f->sends.erase(f->sends.begin() + static_cast<long>(i));
  }
}

Entry entry_of(const Hdr& h) {
  Entry e;
  e.rank = h.rank, e.kind = static_cast<Kind>(h.kind), e.count = h.count, e.dt = h.dt, e.op = h.op, e.root = h.root;
  return e;
}

int try_recv(FilesComm* f, Op& o) {
  Entry& e = o.e;
  const std::string p = path(f, p2p_name(o.peer, f->rank, o.seq));
  Hdr h;
  int fd = open_part(p, h);
  if (fd == -1) return missing(f, o, o.peer, p);
  if (fd == -2) {
    fail(f, o, ncclSystemError, "ncclRecv: " + p + " is not a message of this shim");
    return kDone;
  }
  if (h.count != e.count || h.dt != e.dt) {
    close(fd);
    std::string w = "mismatched send/recv #" + std::to_string(o.seq) + " between ranks " + std::to_string(o.peer) +
                    " -> " + std::to_string(f->rank) + ": " + describe(entry_of(h)) + " vs " + describe(e) +
                    "; every rank's communicator is poisoned";
    poison(f, w, true);
    e.work->complete(ncclInvalidUsage);
    return kDone;
  }
  bool ok = h.bytes == 0 || read_at(fd, e.recv, h.bytes, sizeof h);
  close(fd);
  if (!ok) {
    fail(f, o, ncclSystemError, "ncclRecv: short file " + p);
    return kDone;
  }
  unlink(p.c_str());
  e.work->complete(ncclSuccess);
  return kDone;
}

// The active collective of the unit in progress: which ranks' parts were read, and what of them.
struct Coll {
  bool written = false;
  std::vector<char> have;
  std::vector<std::vector<char>> data;
};

// Bytes of rank k's payload in collective `e` of P ranks, and the part of it rank `me` reads.
size_t payload(const Entry& e, int P, int k) {
  const size_t b = e.count * dtype_size(e.dt);
  switch (e.kind) {
    case kReduceScatter:
    case kAllToAll: return b * P;
    case kBroadcast: return k == e.root ? b : 0;
    default: return b;
  }
}
void needed(const Entry& e, int me, int k, size_t& off, size_t& len) {
  const size_t b = e.count * dtype_size(e.dt);
  off = 0, len = b;
  if (e.kind == kReduceScatter || e.kind == kAllToAll) off = me * b;
  if ((e.kind == kBroadcast && k != e.root) || (e.kind == kReduce && me != e.root)) len = 0;
}

// This rank's result of a collective whose parts (own: e.send; others: cs.data) are all here.
void finish_coll(FilesComm* f, Entry& e, Coll& cs) {
  const int P = f->P, me = f->rank;
  const size_t sz = dtype_size(e.dt), n = e.count, b = n * sz;
  if (b == 0) return;
  std::vector<const void*> srcs(P);
  for (int k = 0; k < P; ++k) srcs[k] = k == me ? static_cast<const char*>(e.send) + ((e.kind == kReduceScatter || e.kind == kAllToAll) ? me * b : 0)
                                                 : static_cast<const void*>(cs.data[k].data());
  std::vector<char> tmp;
  switch (e.kind) {
    case kAllReduce:
    case kReduce:
    case kReduceScatter:
      if (e.kind == kReduce && me != e.root) return;
      tmp.resize(b);
      reduce(tmp.data(), srcs.data(), P, n, e.dt, e.op);
      break;
    case kAllGather:
    case kAllToAll:
      tmp.resize(b * P);
      for (int k = 0; k < P; ++k) memcpy(tmp.data() + k * b, srcs[k], b);
      break;
    case kBroadcast:
      tmp.assign(static_cast<const char*>(srcs[e.root]), static_cast<const char*>(srcs[e.root]) + b);
      break;
    default:
      return;
  }
  memmove(e.recv, tmp.data(), tmp.size());
}

int try_coll(FilesComm* f, Op& o, Coll& cs) {
  Entry& e = o.e;
  const int P = f->P, me = f->rank;
  if (!cs.written) {
    Hdr h{};
    memcpy(h.magic, kMagic, sizeof h.magic);
    h.kind = e.kind, h.dt = e.dt, h.op = e.op, h.root = e.root, h.rank = me, h.count = e.count, h.seq = o.seq;
    h.bytes = payload(e, P, me);
    if (int err = publish(f->dir, path(f, coll_name(o.seq, me)), &h, sizeof h, e.send, h.bytes, false)) {
      fail(f, o, ncclSystemError, std::string(kKindName[e.kind]) + ": writing its file in " + f->dir + ": " + strerror(err));
      return kDone;
    }
    cs.written = true;
    cs.have.assign(P, 0);
    cs.have[me] = 1;
    cs.data.assign(P, {});
  }
  bool all = true;
  for (int k = 0; k < P; ++k) {
    if (cs.have[k]) continue;
    const std::string p = path(f, coll_name(o.seq, k));
    Hdr h;
    int fd = open_part(p, h);
    if (fd == -1) {
      if (missing(f, o, k, p) == kDone) return kDone;
      all = false;
      continue;
    }
    if (fd == -2) {
      fail(f, o, ncclSystemError, std::string(kKindName[e.kind]) + ": " + p + " is not a part of this shim");
      return kDone;
    }
    const Entry other = entry_of(h);
    if (!same_collective(other, e)) {
      close(fd);
      poison(f, "mismatched collective #" + std::to_string(o.seq) + " on a communicator of " + std::to_string(P) +
                    " ranks: " + describe(other) + " vs " + describe(e) +
                    " (real NCCL would hang or corrupt data); every rank's communicator is poisoned", true);
      e.work->complete(ncclInvalidUsage);
      return kDone;
    }
    size_t off, len;
    needed(e, me, k, off, len);
    cs.data[k].resize(len);
    bool ok = h.bytes == payload(e, P, k) && (len == 0 || read_at(fd, cs.data[k].data(), len, static_cast<off_t>(sizeof h + off)));
    close(fd);
    if (!ok) {
      fail(f, o, ncclSystemError, std::string(kKindName[e.kind]) + ": short part " + p);
      return kDone;
    }
    cs.have[k] = 1;
  }
  if (!all) return kWait;
  finish_coll(f, e, cs);
  e.work->complete(ncclSuccess);
  // every peer wrote its part of #seq, so it finished #seq-1 (it read this rank's part of it)
  if (o.seq > 0) unlink(path(f, coll_name(o.seq - 1, me)).c_str());
  return kDone;
}

// One unit: its sends first, then its receives and collectives (collectives in order) as their
// inputs appear.
void process(FilesComm* f, std::vector<Op>& unit) {
  health(f, true);
  if (f->poisoned) return complete_all(unit, ncclInvalidUsage);
  std::vector<Op*> todo;
  for (Op& o : unit)
    if (o.e.kind == kSend)
      send_now(f, o);
    else
      todo.push_back(&o);
  Coll cs;
  Backoff b;
  while (!todo.empty()) {
    if (f->stop || f->poisoned) {
      for (Op* o : todo) o->e.work->complete(f->stop ? ncclSystemError : ncclInvalidUsage);
      return;
    }
    bool moved = false;
    bool coll_seen = false;
    for (size_t i = 0; i < todo.size();) {
      Op& o = *todo[i];
      const bool is_coll = o.e.kind != kRecv;
      int r = kWait;
      if (!is_coll) r = try_recv(f, o);
      else if (!coll_seen) r = try_coll(f, o, cs);
      coll_seen |= is_coll;
      if (r == kWait) {
        ++i;
        continue;
      }
      moved = true;
      if (is_coll) cs = Coll{}, coll_seen = false;
      todo.erase(todo.begin() + static_cast<long>(i));
      if (f->poisoned) break;
    }
    poll_sends(f);
    health(f, false);
    if (moved) b.reset(); else b.sleep();
  }
}

void drop_queue(FilesComm* f, int code) {
  std::deque<std::vector<Op>> q;
  {
    std::lock_guard<std::mutex> g(f->m);
    q.swap(f->q);
  }
  for (auto& u : q) complete_all(u, code);
}

void run(FilesComm* f) {
  Backoff b;
  while (!f->stop && f->c->state.load() == kInit && !try_form(f)) b.sleep();
  b.reset();
  while (!f->stop) {
    std::vector<Op> unit;
    {
      std::unique_lock<std::mutex> lk(f->m);
      if (f->q.empty() && f->sends.empty()) f->cv.wait(lk, [&] { return f->stop || !f->q.empty(); });
      else if (f->q.empty()) f->cv.wait_for(lk, std::chrono::microseconds(b.us));
      if (f->stop) break;
      if (!f->q.empty()) {
        unit = std::move(f->q.front());
        f->q.pop_front();
      }
    }
    if (!unit.empty()) {
      process(f, unit);
      b.reset();
    } else if (!f->sends.empty()) {
      health(f, false);
      size_t before = f->sends.size();
      poll_sends(f);
      if (f->sends.size() < before) b.reset(); else b.us = std::min(b.us * 2, 2000);
    }
  }
  complete_all(f->sends, ncclSystemError);
  f->sends.clear();
  drop_queue(f, ncclSystemError);
}

// Removes the directory if every rank that joined has left or exited.
void last_out(FilesComm* f) {
  const std::string me = host_name();
  for (int k = 0; k < f->P; ++k) {
    JoinInfo j;
    if (!read_join(f, k, j) || exists(path(f, "gone." + std::to_string(k)))) continue;
    if (j.host == me && pid_dead(j.pid)) continue;
    return;
  }
  if (DIR* d = opendir(f->dir.c_str())) {
    while (dirent* x = readdir(d))
      if (strcmp(x->d_name, ".") && strcmp(x->d_name, "..")) unlink(path(f, x->d_name).c_str());
    closedir(d);
  }
  rmdir(f->dir.c_str());
}

}  // namespace

int transport() {
  const char* v = getenv("CPEMU_NCCL_TRANSPORT");
  if (!v || !*v || strcmp(v, "threads") == 0) return 0;
  return strcmp(v, "files") == 0 ? 1 : -1;
}

int join(ncclComm* c, const ncclUniqueId& id, const char* fn) {
  std::string base;
  if (const char* d = getenv("CPEMU_NCCL_DIR"); d && *d) {
    base = d;
  } else {
    const char* t = getenv("TMPDIR");
    base = std::string(t && *t ? t : "/tmp") + "/cpemu-nccl-" + std::to_string(getuid());
  }
  for (size_t k = base.find('/', 1); k != std::string::npos; k = base.find('/', k + 1)) mkdir(base.substr(0, k).c_str(), 0700);
  mkdir(base.c_str(), 0700);  // (mkdir -p)
  auto f = std::make_unique<FilesComm>();
  f->c = c;
  f->rank = c->rank;
  f->P = c->nranks;
  f->dir = base + "/" + hex_of(id);
  sweep(base, hex_of(id));
  f->peers.resize(f->P);
  if (mkdir(f->dir.c_str(), 0700) != 0 && errno != EEXIST) {
    set_last("%s: cannot create %s: %s (CPEMU_NCCL_DIR)", fn, f->dir.c_str(), strerror(errno));
    return ncclSystemError;
  }
  for (int k = 0; k < f->P; ++k) {  // refuse a wrong nranks before publishing anything
    JoinInfo j;
    if (read_join(f.get(), k, j) && j.nranks != f->P) {
      set_last("%s: rank %d joins with %d ranks, but rank %d of this id's communicator has %d", fn, c->rank, f->P, k, j.nranks);
      return ncclInvalidArgument;
    }
  }
  char info[400];
  snprintf(info, sizeof info, "%d %d %d %s\n", c->nranks, c->dev, static_cast<int>(getpid()), host_name().c_str());
  const std::string mine = std::to_string(c->rank);
  if (!exists(path(f.get(), "join." + mine))) unlink(path(f.get(), "gone." + mine).c_str());  // (it withdrew before)
  int err = publish(f->dir, path(f.get(), "join." + mine), info, strlen(info), nullptr, 0, true);
  if (err == EEXIST) {
    set_last("%s: rank %d of %d joined twice with the same id", fn, c->rank, c->nranks);
    return ncclInvalidArgument;
  }
  if (err) {
    set_last("%s: cannot write the join file in %s: %s", fn, f->dir.c_str(), strerror(err));
    return ncclSystemError;
  }
  FilesComm* p = f.release();
  c->fx = p;
  try_form(p);
  p->th = std::thread(run, p);
  return ncclSuccess;
}

int wait_formed(ncclComm* c, const char* fn) {
  FilesComm* f = c->fx;
  std::unique_lock<std::mutex> lk(f->m);
  const double t = cp_shim::wait_timeout_s();
  const auto deadline = Clock::now() + std::chrono::duration<double>(t);
  if (!f->cv.wait_until(lk, deadline, [&] { return c->state.load() != kInit; })) {
    set_last("%s: %s: only %d of %d ranks joined within %.1f s (CPEMU_WAIT_TIMEOUT_S; files transport, %s); giving up",
             fn, label(c).c_str(), f->joined.load(), c->nranks, t, f->dir.c_str());
    return ncclSystemError;
  }
  if (c->state.load() == kReady) return ncclSuccess;
  set_last("%s: %s: %s", fn, label(c).c_str(), c->msg);
  return c->err.load() ? c->err.load() : ncclInvalidUsage;
}

void post(std::vector<Op>& unit) {
  ncclComm* c = unit[0].comm;
  FilesComm* f = c->fx;
  for (Op& o : unit) cp_shim::stream_push(o.stream, o.e.work);
  std::lock_guard<std::mutex> g(f->m);
  const int code = c->state.load() == kAborted || f->stop ? ncclInvalidUsage : c->err.load();
  if (code) return complete_all(unit, code);
  auto& w = f->works;
  w.erase(std::remove_if(w.begin(), w.end(), [](const WorkPtr& x) { return x->is_done(); }), w.end());
  for (Op& o : unit) w.push_back(o.e.work);
  f->q.push_back(std::move(unit));
  f->cv.notify_all();
}

std::vector<WorkPtr> pending(ncclComm* c) {
  std::lock_guard<std::mutex> g(c->fx->m);
  return c->fx->works;
}

void check_poison(ncclComm* c) {
  std::string t;
  if (c->fx && c->fx->formed && c->err.load() == ncclSuccess && read_text(path(c->fx, "poison"), t)) set_error(c, ncclInvalidUsage, t);
}

void leave(ncclComm* c, const char* why) {
  FilesComm* f = c->fx;
  {
    std::lock_guard<std::mutex> g(f->m);
    f->stop = true;
  }
  f->cv.notify_all();
  if (f->th.joinable()) f->th.join();  // (it polls `stop` at least every 2 ms)
  drop_queue(f, ncclSystemError);
  const std::string me = std::to_string(f->rank);
  if (!f->decided) unlink(path(f, "join." + me).c_str());  // withdraws from an init in progress
  publish(f->dir, path(f, "gone." + me), why, strlen(why), nullptr, 0, false);
  last_out(f);
}

void release(ncclComm* c) {
  delete c->fx;
  c->fx = nullptr;
}

}  // namespace files
}  // namespace cp_nccl
