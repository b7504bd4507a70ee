// Scheduler of the host emulation (see emu.h; the warp ops are in emu_ops.cpp, wgmma in emu_wgmma.cpp,
// cp.async and the async-proxy view in emu_async.cpp, mbarriers / named barriers in emu_sync.cpp). One OS thread;
// the CUDA threads of a block are fibers switched by a 12-instruction x86-64 context switch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "emu.h"
#include "emu_internal.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cinttypes>
#include <deque>
#include <queue>
#include <random>
#include <string>
#include <vector>

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

extern "C" void cp_emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl cp_emu_switch
.type cp_emu_switch,@function
cp_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size cp_emu_switch, .-cp_emu_switch
)");


namespace cp_emu {
namespace detail {

std::vector<Fiber> fib;
std::vector<WgState> wgs;
bool wgmma_at_issue = false;

int nthreads = 0, cur = -1;
void* sched_sp = nullptr;
const std::function<void()>* body = nullptr;
bool failed = false;
bool in_fiber = false;
std::vector<unsigned char> dyn;
size_t dyn_size = 0;
std::vector<std::pair<const unsigned char*, size_t>> globals;
const char* launch_name = "";
long block_serial = 0;
Schedule sched = Schedule::Lockstep;
std::mt19937_64 sched_rng;
Landing landing = Landing::AtWait;
std::mt19937_64 land_rng;
// cp.async copies of the current block; Random landing: (due tick, copy) min-heap, ticks are
// fiber switches of the block
std::vector<Copy> copies;
std::priority_queue<Due, std::vector<Due>, std::greater<Due>> due;
uint64_t tick = 0;
std::vector<std::pair<unsigned char*, size_t>> statics;  // static __shared__ arrays seen so far
std::vector<long> statics_block;                           // block serial of their last poisoning
long bar0_gen = 0;  // completed block barriers
bool yield_warp = false;
std::vector<int> wg_regs;
long reg_pool = 0;
int reg_start = 0;

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::Shfl: return "shfl.sync.idx";
    case WarpOp::ShflXor: return "shfl.sync.bfly";
    case WarpOp::Any: return "vote.sync.any";
    case WarpOp::Ballot: return "vote.sync.ballot";
    case WarpOp::Sync: return "bar.warp.sync";
    case WarpOp::Mma16816Bf16: return "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32";
    case WarpOp::Mma16816F16: return "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32";
    case WarpOp::Ldsm4: return "ldmatrix.sync.aligned.m8n8.x4.shared.b16";
    case WarpOp::Ldsm4T: return "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16";
    case WarpOp::Stsm4: return "stmatrix.sync.aligned.m8n8.x4.shared.b16";
    case WarpOp::Stsm4T: return "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16";
    case WarpOp::Sts: return "st.shared (cp_sts_cf)";
    case WarpOp::WgFence: return "wgmma.fence.sync.aligned";
    case WarpOp::WgMma: return "wgmma.mma_async.sync.aligned";
    case WarpOp::WgCommit: return "wgmma.commit_group.sync.aligned";
    case WarpOp::WgWait: return "wgmma.wait_group.sync.aligned";
    case WarpOp::SetMaxNReg: return "setmaxnreg.sync.aligned.u32";
  }
  return "?";
}

void report(const char* fmt, va_list ap) {
  std::fprintf(stdout, "  EMU ERROR in %s block (%u,%u,%u)", launch_name, blockIdx.x, blockIdx.y, blockIdx.z);
  if (cur >= 0) std::fprintf(stdout, " thread %d", cur);
  std::fprintf(stdout, ": ");
  std::vfprintf(stdout, fmt, ap);
  std::fprintf(stdout, "\n");
}

void sched_fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int c = cur;
  cur = -1;
  report(fmt, ap);
  cur = c;
  va_end(ap);
  failed = true;
}

void yield_to_sched() { cp_emu_switch(&fib[cur].sp, sched_sp); }

void fiber_entry() {
  (*body)();
  Fiber& f = fib[cur];
  size_t pend = 0;
  for (uint32_t c : f.open) pend += !copies[c].tracked;
  for (auto& g : f.groups)
    for (uint32_t c : g) pend += !copies[c].tracked;
  if (pend) fail("thread exits with %zu cp.async copies neither waited for nor covered by an mbarrier arrive", pend);
  size_t bulk = f.bulk_open.size();
  for (auto& g : f.bulk_groups) bulk += g.size();
  if (bulk) fail("thread exits with %zu TMA reductions not retired by cp.async.bulk.wait_group.read", bulk);
  f.st = St::Done;
  yield_to_sched();
  std::abort();  // never resumed
}

void init_fiber(Fiber& f) {
  if (!f.stack) f.stack = static_cast<unsigned char*>(std::aligned_alloc(64, STACK));
  // Stack top: [ret addr = fiber_entry] at a 16-byte aligned slot, 6 callee-saved registers below.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + STACK - 64) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  sp[1] = nullptr;
  sp[0] = reinterpret_cast<void*>(&fiber_entry);
  for (int i = 1; i <= 6; ++i) sp[-i] = nullptr;
  f.sp = sp - 6;
  f.st = St::Ready;
  f.open.clear();
  f.groups.clear();
  f.unfenced.clear();
  f.untracked.clear();
  f.acquired.clear();
  f.bulk_open.clear();
  f.bulk_groups.clear();
  f.bar0_seen = 0;
}

void set_thread(int i) {
  cur = i;
  threadIdx.x = i % blockDim.x;
  threadIdx.y = (i / blockDim.x) % blockDim.y;
  threadIdx.z = i / (blockDim.x * blockDim.y);
}


void post_and_wait(WarpOp op, unsigned mask) {
  Fiber& f = fib[cur];
  f.op = op;
  f.mask = mask;
  f.st = St::Warp;
  yield_to_sched();
}

void land(Copy& c) {
  if (c.landed) return;
  if (c.valid)
    std::memcpy(c.dst, c.src, 16);
  else
    std::memset(c.dst, 0, 16);
  c.landed = true;
}

// Random landing: log-uniform delay in fiber switches
uint64_t random_delay() {
  const double span = std::log((double)nthreads * 4096.0);
  return (uint64_t)std::exp(std::uniform_real_distribution<double>(0.0, span)(land_rng)) - 1;
}

// Runs thread i until it yields; false if it failed. Random landing: copies that fall due land.
bool run_fiber(int i) {
  set_thread(i);
  in_fiber = true;
  cp_emu_switch(&sched_sp, fib[i].sp);
  in_fiber = false;
  cur = -1;
  ++tick;
  while (!due.empty() && due.top().first <= tick) {
    const uint32_t c = due.top().second;
    due.pop();
    if (c & ARRIVE)
      fire(c & ~ARRIVE);
    else
      land(copies[c]);
  }
  return !failed;
}

// Runs the ready lanes of warp [l0, l0 + n) once (order by `pass`), then its warp op if all lanes
// posted one. *moved: something ran. False on failure.
bool step_warp(int l0, int n, long pass, bool* moved) {
  for (int k = 0; k < n; ++k) {
    const int i = l0 + ((pass & 1) ? n - 1 - k : k);
    if (fib[i].st != St::Ready) continue;
    *moved = true;
    if (!run_fiber(i)) return false;
  }
  int at = 0;
  for (int l = 0; l < n; ++l) at += fib[l0 + l].st == St::Warp;
  if (at == n && !is_wg(fib[l0].op) && warp_op_ready(l0)) {
    *moved = true;
    return exec_warp(l0, n);
  }
  return true;
}

bool run_block() {
  for (int i = 0; i < nthreads; ++i) init_fiber(fib[i]);
  if (dyn_size) std::memset(dyn.data(), 0xff, dyn_size);
  async_reset();
  ++block_serial;
  copies.clear();
  due = {};
  tick = 0;
  sync_reset();
  bar0_gen = 0;
  reg_pool = 0;
  reg_start = 0;
  wg_regs.assign((size_t)(nthreads + 127) / 128, 0);
  wgs.assign((size_t)(nthreads + 127) / 128, WgState{});
  const int nwarps = (nthreads + 31) / 32;
  std::vector<char> paused((size_t)nwarps, 0);  // warps-asc/-desc: see run_warp below
  for (long round = 0;; ++round) {
    bool progress = false;
    if (sched == Schedule::Lockstep) {
      // every ready thread once (block order forward / reverse by round), then complete warp ops
      for (int k = 0; k < nthreads; ++k) {
        const int i = (round & 1) ? nthreads - 1 - k : k;
        if (fib[i].st != St::Ready) continue;
        progress = true;
        if (!run_fiber(i)) return false;
      }
      for (int l0 = 0; l0 < nthreads; l0 += 32) {
        const int n = std::min(32, nthreads - l0);
        int at = 0;
        for (int l = 0; l < n; ++l) at += fib[l0 + l].st == St::Warp;
        if (at == n && !is_wg(fib[l0].op) && warp_op_ready(l0)) {
          if (!exec_warp(l0, n)) return false;
          progress = true;
        }
      }
      if (!exec_warpgroups(&progress)) return false;
    } else if (sched == Schedule::Random) {
      // nwarps times: a random warp runs up to a log-uniform number of steps (1 .. 4096)
      for (int w = 0; w < nwarps; ++w) {
        const int l0 = 32 * (int)(sched_rng() % (uint64_t)nwarps), n = std::min(32, nthreads - l0);
        const long steps = (long)std::exp(std::uniform_real_distribution<double>(0.0, std::log(4096.0))(sched_rng));
        yield_warp = false;
        for (long pass = 0; pass < steps && !yield_warp; ++pass) {
          bool moved = false;
          if (!step_warp(l0, n, (long)(sched_rng() & 1), &moved)) return false;
          if (!moved) break;
          progress = true;
        }
      }
      // none of the drawn warps could move: give every warp a turn before concluding anything
      for (int l0 = 0; l0 < nthreads && !progress; l0 += 32) {
        bool moved = false;
        if (!step_warp(l0, std::min(32, nthreads - l0), round, &moved)) return false;
        progress |= moved;
      }
      if (!exec_warpgroups(&progress)) return false;
    } else {
      // each warp in turn runs as far as it can (to a block barrier): maximal skew between warps.
      // Blocks of whole warpgroups: once the 4 warps of a warpgroup had their turn, the warpgroup
      // runs on (its warps again, while one of their wgmma.wait_group became ready, or a setmaxnreg
      // ran) as far as it can before the next warpgroup moves, so warpgroups skew as far as the
      // block barriers allow too (a wgmma reading shared memory another warpgroup has not written
      // yet is exposed). wgmma ops are per warp (emu_wgmma.cpp): a warp runs on past its issue, so
      // it reaches a wgmma before the next warp's stores (a missing barrier between them shows).
      // A warp that arrived on an mbarrier (or woke another warp's thread at a named barrier)
      // pauses there; when no other warp can move, the paused warp latest in the order
      // (warps-asc: the highest) goes on, one at a time. So under warps-asc the warps above run
      // as far as they can between two arrivals of a warp below: a producer in warpgroup 0 stays
      // one hand-over ahead of its consumers (a consumer that skips a wait reads a stage not
      // filled, or not fenced, yet); under warps-desc the consumers stay behind their producer
      // (a refill that skips the empty wait overwrites a stage still in use).
      auto run_warp = [&](int l0, bool* any) {
        const int n = std::min(32, nthreads - l0);
        yield_warp = false;
        for (long pass = round; !paused[l0 / 32]; ++pass) {
          bool moved = false;
          if (!step_warp(l0, n, pass, &moved)) return false;
          if (!moved) break;
          progress = *any = true;
          if (yield_warp) paused[l0 / 32] = 1;
        }
        return true;
      };
      const bool asc = sched == Schedule::WarpsAscending;
      for (int w = 0; w < nwarps; ++w) {
        const int wi = asc ? w : nwarps - 1 - w;
        bool moved = false;
        if (!run_warp(32 * wi, &moved)) return false;
        if (nthreads % 128 == 0 && wi % 4 == (asc ? 3 : 0)) {
          const int t0 = wi / 4 * 128;
          for (;;) {  // on while a warpgroup op ran or a warp's wgmma.wait_group became ready
            moved = false;
            if (!exec_warpgroup(t0, &moved)) return false;
            for (int l0 = t0; l0 < t0 + 128 && !moved; l0 += 32)
              moved = fib[l0].st == St::Warp && fib[l0].op == WarpOp::WgWait && fib[l0 + 31].st == St::Warp &&
                      wg_wait_ready(l0);
            if (!moved) break;
            progress = true;
            for (int k = 0; k < 4; ++k)
              if (!run_warp(t0 + 32 * (asc ? k : 3 - k), &moved)) return false;
          }
        }
      }
      if (!exec_warpgroups(&progress)) return false;
      if (!progress) {  // nothing else can move: the most favoured paused warp goes on
        for (int w = 0; w < nwarps && !progress; ++w) {
          const int wi = asc ? nwarps - 1 - w : w;
          if (paused[wi]) paused[wi] = 0, progress = true;
        }
      }
    }
    int done = 0, bar = 0, warp = 0;
    for (int i = 0; i < nthreads; ++i) {
      done += fib[i].st == St::Done;
      bar += fib[i].st == St::Bar;
      warp += fib[i].st == St::Warp;
    }
    if (done == nthreads) {
      for (size_t w = 0; w < wgs.size(); ++w) {
        const size_t pend = wg_pending(wgs[w]);
        if (pend) {
          sched_fail("warpgroup %zu exits with %zu wgmma ops not waited for", w, pend);
          return false;
        }
      }
      const std::string left = nbar_leftover();
      if (!left.empty()) {
        sched_fail("block exits with a named barrier mid-phase (arrivals that never balance): %s", left.c_str());
        return false;
      }
      return true;
    }
    if (progress) continue;
    if (bar + done == nthreads) {
      // Every live thread waits at a block barrier: it must be the same barrier, and no thread
      // of the block may have exited (a barrier in code that not all threads reach: undefined
      // behaviour in CUDA, a hang on some GPUs).
      if (done) {
        int first = 0;
        while (fib[first].st != St::Bar) ++first;
        sched_fail("barrier at %s:%d reached by %d of %d threads; the other %d exited", fib[first].bar_file,
                   fib[first].bar_line, bar, nthreads, done);
        return false;
      }
      int first = -1;
      for (int i = 0; i < nthreads; ++i) {
        if (fib[i].st != St::Bar) continue;
        if (first < 0) first = i;
        if (fib[i].bar_line != fib[first].bar_line || std::strcmp(fib[i].bar_file, fib[first].bar_file) != 0) {
          sched_fail("divergent barrier: thread %d at %s:%d, thread %d at %s:%d", first, fib[first].bar_file,
                     fib[first].bar_line, i, fib[i].bar_file, fib[i].bar_line);
          return false;
        }
      }
      ++bar0_gen;
      for (int i = 0; i < nthreads; ++i)
        if (fib[i].st == St::Bar) fib[i].st = St::Ready, fib[i].bar0_seen = bar0_gen;
      continue;
    }
    if (flush_async()) continue;  // the copies / arrivals everyone waits for complete meanwhile
    // No thread can move: deadlock (a barrier some threads never reach, or an incomplete warp).
    std::string what;
    for (int i = 0; i < nthreads; ++i)
      if (fib[i].st == St::Bar) {
        what = std::string("; barrier at ") + fib[i].bar_file + ":" + std::to_string(fib[i].bar_line);
        break;
      }
    for (int l0 = 0; l0 < nthreads; l0 += 32) {
      int at = 0, ex = 0;
      const int n = std::min(32, nthreads - l0);
      for (int l = 0; l < n; ++l) at += fib[l0 + l].st == St::Warp, ex += fib[l0 + l].st == St::Done;
      if (at) {
        int first = l0;
        while (fib[first].st != St::Warp) ++first;
        what += "; warp " + std::to_string(l0 / 32) + ": " + std::to_string(at) + " of " + std::to_string(n) +
                " lanes at " + op_name(fib[first].op) + ", " + std::to_string(ex) + " exited";
      }
    }
    what += blocked_waits();
    sched_fail("deadlock/divergent barrier: %d of %d threads arrived at a block barrier, %d at warp ops, %d blocked in "
               "mbarrier / named-barrier waits, %d exited%s",
               bar, nthreads, warp, nthreads - bar - warp - done, done, what.c_str());
    return false;
  }
}

}  // namespace detail

using namespace detail;

void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report(fmt, ap);
  va_end(ap);
  failed = true;
  yield_to_sched();
  std::abort();
}

void poison_shared_once(void* p, size_t bytes) {
  auto c = static_cast<unsigned char*>(p);
  size_t i = 0;
  while (i < statics.size() && statics[i].first != c) ++i;
  if (i == statics.size()) {
    statics.push_back({c, bytes});
    statics_block.push_back(-1);
  }
  if (statics_block[i] != block_serial) {
    std::memset(c, 0xff, bytes);
    statics_block[i] = block_serial;
  }
}

void set_schedule(Schedule s, uint64_t seed) {
  sched = s;
  sched_rng.seed(seed);
}
Schedule schedule() { return sched; }
void set_cp_async_landing(Landing l, uint64_t seed) {
  landing = l;
  land_rng.seed(seed);
}
Landing cp_async_landing() { return landing; }

void launch_bounds(const char* entry, int max_threads, int min_blocks) {
  if (nthreads > max_threads) fail("%s: block of %d threads exceeds its __launch_bounds__(%d)", entry, nthreads, max_threads);
  if (!reg_start && max_threads > 0) {  // registers per thread ptxas gives an entry using setmaxnreg
    reg_start = (int)std::min<long>(256, 65536L / ((long)max_threads * std::max(min_blocks, 1)) / 8 * 8);
    reg_pool = (long)reg_start * nthreads;
    for (int& r : wg_regs) r = reg_start;
  }
}

unsigned char* dyn_smem() { return dyn.data(); }

uint32_t smem_addr(const void* p) {
  auto c = static_cast<const unsigned char*>(p);
  if (dyn_size && c >= dyn.data() && c <= dyn.data() + dyn_size) return (uint32_t)(c - dyn.data());
  for (size_t i = 0; i < statics.size(); ++i)
    if (c >= statics[i].first && c <= statics[i].first + statics[i].second)
      return STATIC_BASE + (uint32_t)(i << 20) + (uint32_t)(c - statics[i].first);
  fail("cvta.to.shared of %p: not a shared-memory address", p);
}

unsigned char* smem_ptr(uint32_t addr, uint32_t bytes) {
  if (addr < STATIC_BASE) {
    if ((size_t)addr + bytes <= dyn_size) return dyn.data() + addr;
  } else {
    const size_t i = (addr - STATIC_BASE) >> 20, off = (addr - STATIC_BASE) & 0xfffff;
    if (i < statics.size() && off + bytes <= statics[i].second) return statics[i].first + off;
  }
  if (in_fiber) fail("shared address %u (+%u bytes) outside shared memory (dynamic size %zu)", addr, bytes, dyn_size);
  sched_fail("shared address %u (+%u bytes) outside shared memory (dynamic size %zu)", addr, bytes, dyn_size);
  return nullptr;
}

void syncthreads(const char* file, int line) {
  Fiber& f = fib[cur];
  f.bar_file = file;
  f.bar_line = line;
  f.st = St::Bar;
  yield_to_sched();
}


void track_global(const void* p, size_t bytes) { globals.push_back({static_cast<const unsigned char*>(p), bytes}); }
void untrack_global(const void* p) {
  for (size_t i = 0; i < globals.size(); ++i)
    if (globals[i].first == p) {
      globals.erase(globals.begin() + i);
      return;
    }
}

bool launch(const char* name, dim3 grid, dim3 block, size_t dyn_smem_bytes, const std::function<void()>& b) {
  launch_name = name;
  nthreads = (int)(block.x * block.y * block.z);
  if ((int)fib.size() < nthreads) fib.resize(nthreads);
  if (dyn.size() < dyn_smem_bytes) dyn.resize(dyn_smem_bytes);
  dyn_size = dyn_smem_bytes;
  body = &b;
  failed = false;
  blockDim = block;
  gridDim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx.x = x, blockIdx.y = y, blockIdx.z = z;
        if (!run_block()) return false;
        if (x || y || z) continue;
        // shared memory per block (dynamic + the static arrays this block touched) vs the opt-in limit
        size_t bytes = dyn_smem_bytes;
        for (size_t i = 0; i < statics.size(); ++i)
          if (statics_block[i] == block_serial) bytes += statics[i].second;
        const bool sm90 = std::strstr(name, "wgmma") != nullptr || std::strstr(name, "[sm_90]") != nullptr;
        const bool sm86 = !sm90 && std::strstr(name, "[sm_86]") != nullptr;
        const size_t limit = sm90 ? SMEM_OPTIN_SM90 : sm86 ? SMEM_OPTIN_SM86 : SMEM_OPTIN_SM80;
        if (bytes > limit) {
          sched_fail("%zu bytes of shared memory per block exceed the %s opt-in limit (%zu bytes)", bytes,
                     sm90 ? "sm_90" : sm86 ? "sm_86" : "sm_80", limit);
          return false;
        }
      }
  return true;
}

}  // namespace cp_emu
