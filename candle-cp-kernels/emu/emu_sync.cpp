// mbarriers and named barriers of the host emulation (see emu.h, "mbarriers, named barriers,
// setmaxnreg"; setmaxnreg is a warpgroup op in emu_ops.cpp). A blocked wait is a fiber state
// (St::MBar / St::NBar) the scheduler (emu.cpp) skips until an arrival makes it ready again.
// Every mbarrier / named-barrier op is also a scheduling point: the thread yields (staying ready),
// so a producer hands over one stage per turn instead of running its whole ring in one go, and a
// consumer that skips a wait finds the stage not yet filled.
#include "emu_internal.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <string>

namespace cp_emu {
namespace detail {

// mbarriers of the current block (emu.h), by shared offset; sig: what mbar_init wrote into its 8 bytes
struct MBar {
  uint32_t count = 0, pending = 0;
  int64_t tx = 0;      // transaction count of the current phase (expect_tx adds, landed TMA bytes take)
  uint64_t phase = 0;  // completed phases
  int init_thread = -1;
  long init_gen = 0;   // block-barrier generation at init
  uint64_t sig = 0;
  CopySet rel, last;   // copies handed over by the arrivals of the current / last completed phase
};
std::map<uint32_t, MBar> mbars;
// cp.async.mbarrier.arrive.noinc arrivals not fired yet (AtWait: in `deferred`; Random: in `due`
// with ARRIVE set on the index)
struct AsyncArrive {
  uint32_t bar;
  int thread;
  std::vector<uint32_t> copies;
  bool done;
  int64_t tma = -1;  // >= 0: not a cp.async arrival but TMA load `tma` landing (complete_tx of its bytes)
};
std::vector<AsyncArrive> arrivals;
std::vector<uint32_t> deferred;
// named barriers 1..15: threads arrived in the current phase, their count, lanes per warp
struct NBar {
  int arrived = 0, expected = 0;
  std::vector<int> lanes;
};
NBar nbars[16];

// The phase completes once every arrival is in and its transaction count is back to 0; completing
// it wakes the threads waiting for its parity.
void mbar_try_complete(uint32_t addr, MBar& b) {
  if (b.pending || b.tx) return;
  ++b.phase;
  b.pending = b.count;
  b.last = std::move(b.rel);
  b.rel = nullptr;
  for (int i = 0; i < nthreads; ++i)
    if (fib[i].st == St::MBar && fib[i].wait_addr == addr && fib[i].wait_parity != (b.phase & 1)) {
      fib[i].st = St::Ready;
    }
}
// One arrival on barrier `addr` handing over `rel` (copies the waiters of this phase may fence).
void mbar_arrive_one(uint32_t addr, MBar& b, const std::vector<uint32_t>& rel) {
  if (!b.rel) b.rel = std::make_shared<std::vector<uint32_t>>();
  b.rel->insert(b.rel->end(), rel.begin(), rel.end());
  if (b.pending == 0)
    fail("mbarrier arrival at shared offset %u: all %u arrivals of the current phase are in (it waits for %lld "
         "transaction bytes)", addr, b.count, (long long)b.tx);
  --b.pending;
  mbar_try_complete(addr, b);
}

// An asynchronous arrival fires: a cp.async-tracked arrival's copies land, then it arrives; a TMA
// load lands, then completes its bytes.
void fire(uint32_t i) {
  AsyncArrive& a = arrivals[i];
  if (a.done) return;
  a.done = true;
  if (a.tma >= 0) {
    const uint32_t bytes = tma_land((uint32_t)a.tma);
    mbar_complete_tx(a.bar, bytes);
    return;
  }
  for (uint32_t c : a.copies) land(copies[c]);
  mbar_arrive_one(a.bar, mbars[a.bar], a.copies);
}

void mbar_complete_tx(uint32_t addr, uint32_t bytes) {
  MBar& b = mbars[addr];
  if (!b.rel) b.rel = std::make_shared<std::vector<uint32_t>>();
  b.tx -= bytes;
  mbar_try_complete(addr, b);
}

// Arrival i fires per landing mode: at once (AtIssue), when a waiter on its barrier would block
// (AtWait), or at a seeded later scheduling point (Random).
void queue_arrival(uint32_t i) {
  if (landing == Landing::AtIssue)
    fire(i);
  else if (landing == Landing::AtWait)
    deferred.push_back(i);
  else
    due.push({tick + random_delay(), i | ARRIVE});
}

uint32_t tma_arrival(uint32_t bar, uint32_t load) {
  const uint32_t i = (uint32_t)arrivals.size();
  arrivals.push_back({bar, cur, {}, false, (int64_t)load});
  queue_arrival(i);
  return i;
}

// AtWait: fires the deferred arrivals on `addr` (every barrier when addr == ~0u); true if any.
bool flush_deferred(uint32_t addr) {
  bool any = false;
  for (size_t k = 0; k < deferred.size();) {
    const uint32_t i = deferred[k];
    if (addr != ~0u && arrivals[i].bar != addr) {
      ++k;
      continue;
    }
    deferred.erase(deferred.begin() + (long)k);
    fire(i);
    any = true;
  }
  return any;
}

// Nothing else can move: everything asynchronous still in flight completes (true if anything did).
bool flush_async() {
  bool any = flush_deferred(~0u);
  for (; !due.empty(); due.pop(), any = true) {
    const uint32_t i = due.top().second;
    if (i & ARRIVE)
      fire(i & ~ARRIVE);
    else
      land(copies[i]);
  }
  return any;
}

void sync_reset() {
  mbars.clear();
  arrivals.clear();
  deferred.clear();
  tma_reset();
  for (NBar& b : nbars) b.arrived = 0;
}

// Named barriers left mid-phase when the whole block has exited (an unbalanced bar.arrive, e.g. a
// ping-pong hand-over nobody waits for): "" if none. Hardware resets barriers between blocks, but
// a count that does not balance means the kernel's turn logic is not what it says.
std::string nbar_leftover() {
  std::string what;
  char buf[160];
  for (int id = 1; id < 16; ++id)
    if (nbars[id].arrived) {
      std::snprintf(buf, sizeof buf, "%snamed barrier %d: %d of %d threads arrived", what.empty() ? "" : "; ", id,
                    nbars[id].arrived, nbars[id].expected);
      what += buf;
    }
  return what;
}

// The mbarrier, named-barrier and setmaxnreg waits of a deadlocked block, for the report.
std::string blocked_waits() {
  std::string what;
  char buf[256];
  std::map<std::pair<uint32_t, uint32_t>, std::pair<int, int>> mw;  // (offset, parity) -> (threads, first)
  int nw[16] = {0};
  for (int i = 0; i < nthreads; ++i) {
    if (fib[i].st == St::MBar) {
      auto& e = mw[{fib[i].wait_addr, fib[i].wait_parity}];
      if (!e.first++) e.second = i;
    }
    if (fib[i].st == St::NBar) nw[fib[i].nbar_id]++;
  }
  for (auto& e : mw) {
    const MBar& b = mbars[e.first.first];
    std::snprintf(buf, sizeof buf, "; %d threads (first %d) wait on the mbarrier at shared offset %u for parity %u "
                  "(%llu phases completed, %u of %u arrivals pending, %lld transaction bytes)", e.second.first,
                  e.second.second, e.first.first, e.first.second, (unsigned long long)b.phase, b.pending, b.count,
                  (long long)b.tx);
    what += buf;
  }
  for (int id = 1; id < 16; ++id)
    if (nw[id] || nbars[id].arrived) {
      std::snprintf(buf, sizeof buf, "; named barrier %d: %d of %d threads arrived, %d of them wait in bar.sync", id,
                    nbars[id].arrived, nbars[id].expected, nw[id]);
      what += buf;
    }
  for (int t0 = 0; t0 + 128 <= nthreads; t0 += 128) {
    const long need = regs_after_inc(t0);
    if (need > reg_pool && fib[t0].st == St::Warp) {
      std::snprintf(buf, sizeof buf, "; warpgroup %d waits in setmaxnreg.inc %d: the block would hold %ld registers, "
                    "its pool is %ld (%d per thread from __launch_bounds__)", t0 / 128, fib[t0].arg, need, reg_pool, reg_start);
      what += buf;
    }
  }
  return what;
}

MBar& mbar_get(uint32_t addr, const char* what) {
  auto it = mbars.find(addr);
  if (it == mbars.end()) fail("%s: shared offset %u holds no initialised mbarrier (no mbarrier.init in this block)", what, addr);
  MBar& b = it->second;
  if (std::memcmp(smem_ptr(addr, 8), &b.sig, 8) != 0)
    fail("%s: the mbarrier at shared offset %u was overwritten since its mbarrier.init (a store or cp.async into "
         "its 8 bytes)", what, addr);
  if (cur != b.init_thread && fib[cur].bar0_seen <= b.init_gen)
    fail("%s: the mbarrier at shared offset %u is used before a __syncthreads() published its mbarrier.init by "
         "thread %d", what, addr, b.init_thread);
  return b;
}
uint32_t mbar_addr(const void* bar, const char* what) {
  const uint32_t addr = smem_addr(bar);
  if (addr % 8) fail("%s: mbarrier address (shared offset %u) not 8-byte aligned", what, addr);
  smem_ptr(addr, 8);
  return addr;
}
uint32_t mbar_checked(const void* bar, const char* what) {
  const uint32_t addr = mbar_addr(bar, what);
  mbar_get(addr, what);
  return addr;
}
}  // namespace detail

using namespace detail;

void mbar_init(const void* bar, uint32_t count) {
  const uint32_t addr = mbar_addr(bar, "mbarrier.init");
  if (count == 0 || count >= (1u << 20)) fail("mbarrier.init at shared offset %u: count %u outside [1, 2^20 - 1]", addr, count);
  for (int i = 0; i < nthreads; ++i)
    if (fib[i].st == St::MBar && fib[i].wait_addr == addr)
      fail("mbarrier.init at shared offset %u while thread %d waits on it", addr, i);
  for (const AsyncArrive& a : arrivals)
    if (!a.done && a.bar == addr)
      fail("mbarrier.init at shared offset %u while a cp.async arrival of thread %d on it is in flight", addr, a.thread);
  MBar& b = mbars[addr];
  b = MBar{};
  b.count = b.pending = count;
  b.init_thread = cur;
  b.init_gen = bar0_gen;
  b.sig = 0x6d62617200000000ull ^ ((uint64_t)addr << 20) ^ count;  // "mbar", offset, count
  std::memcpy(smem_ptr(addr, 8), &b.sig, 8);
}

void mbar_init_fence() {}  // ordering only (cluster scope / async proxy); the CTA publishes by __syncthreads

// mbarrier.arrive (tx = 0) / mbarrier.arrive.expect_tx (tx bytes added first).
static void arrive_tx(const void* bar, uint32_t tx, const char* what) {
  const uint32_t addr = mbar_addr(bar, what);
  MBar& b = mbar_get(addr, what);
  if (tx >= (1u << 20)) fail("%s at shared offset %u: %u bytes (at most 2^20 - 1)", what, addr, tx);
  b.tx += tx;
  Fiber& f = fib[cur];
  std::vector<uint32_t> rel;
  rel.swap(f.unfenced);  // retired, unfenced copies: the waiters of this phase may fence them
  mbar_arrive_one(addr, b, rel);
  yield_warp = true;
  yield_to_sched();
}

void mbar_arrive(const void* bar) { arrive_tx(bar, 0, "mbarrier.arrive"); }
void mbar_arrive_expect_tx(const void* bar, uint32_t bytes) { arrive_tx(bar, bytes, "mbarrier.arrive.expect_tx"); }

void mbar_arrive_cp_async(const void* bar) {
  const uint32_t addr = mbar_addr(bar, "cp.async.mbarrier.arrive.noinc");
  mbar_get(addr, "cp.async.mbarrier.arrive.noinc");
  Fiber& f = fib[cur];
  const uint32_t i = (uint32_t)arrivals.size();
  arrivals.push_back({addr, cur, {}, false});
  arrivals.back().copies.swap(f.untracked);
  for (uint32_t c : arrivals.back().copies) copies[c].tracked = true;
  queue_arrival(i);
  yield_warp = true;
  yield_to_sched();
}

void mbar_wait(const void* bar, uint32_t parity) {
  const uint32_t addr = mbar_addr(bar, "mbarrier.try_wait.parity");
  if (parity > 1) fail("mbarrier.try_wait.parity on shared offset %u with parity %u (0 or 1)", addr, parity);
  Fiber& f = fib[cur];
  yield_to_sched();
  for (;;) {
    MBar& b = mbar_get(addr, "mbarrier.try_wait.parity");
    if ((b.phase & 1) != parity) {
      if (b.last && !b.last->empty()) f.acquired.push_back(b.last);
      return;
    }
    if (flush_deferred(addr)) continue;  // AtWait: the tracked copies land and arrive now
    f.st = St::MBar;
    f.wait_addr = addr;
    f.wait_parity = parity;
    yield_to_sched();
  }
}

namespace {
void named_bar(int id, int n, bool sync) {
  const char* op = sync ? "bar.sync" : "bar.arrive";
  if (id < 0 || id > 15) fail("%s %d: barrier id outside 0..15", op, id);
  if (n <= 0 || n % 32 || n > nthreads)
    fail("%s %d, %d: thread count not a multiple of 32 in [32, %d] (block size)", op, id, n, nthreads);
  if (id == 0) {
    if (!sync || n != nthreads)
      fail("%s 0, %d: barrier 0 is __syncthreads' barrier (only bar.sync 0 with the block size %d is modelled)", op, n, nthreads);
    syncthreads("bar.sync 0", 0);
    return;
  }
  NBar& b = nbars[id];
  if (b.arrived == 0) {
    b.expected = n;
    b.lanes.assign((size_t)(nthreads + 31) / 32, 0);
  } else if (n != b.expected) {
    fail("%s %d, %d: the threads already arrived in this phase of barrier %d gave the count %d", op, id, n, id, b.expected);
  }
  ++b.arrived;
  ++b.lanes[cur / 32];
  if (b.arrived == b.expected) {
    for (size_t w = 0; w < b.lanes.size(); ++w)
      if (b.lanes[w] != 0 && b.lanes[w] != 32)
        fail("named barrier %d completed (%d threads) with %d arrivals from warp %zu (bar.sync / bar.arrive are .aligned: "
             "all 32 lanes of a warp, once per phase)", id, n, b.lanes[w], w);
    b.arrived = 0;
    for (int i = 0; i < nthreads; ++i)
      if (fib[i].st == St::NBar && fib[i].nbar_id == id) {
        fib[i].st = St::Ready;
        yield_warp |= i / 32 != cur / 32;
      }
    yield_to_sched();
    return;
  }
  if (!sync) {
    yield_to_sched();
    return;
  }
  fib[cur].st = St::NBar;
  fib[cur].nbar_id = id;
  yield_to_sched();
}
}  // namespace
void named_bar_sync(int id, int nthreads) { named_bar(id, nthreads, true); }
void named_bar_arrive(int id, int nthreads) { named_bar(id, nthreads, false); }

}  // namespace cp_emu
