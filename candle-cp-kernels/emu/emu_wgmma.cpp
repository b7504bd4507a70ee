// wgmma (sm_90a) of the host emulation (see emu.h): wgmma.fence / mma_async / commit_group /
// wait_group are warp-synchronous (.sync waits for the lanes of the issuing WARP only; .aligned
// requires the whole warpgroup to execute them), so a warp runs on after issuing its part. The
// product of a wgmma is computed once all four warps of its warpgroup issued it: at the last issue
// (at-issue mode) or at the first wait_group that retires it (deferred). Its shared-memory operands
// are snapshot (async-proxy view) when the FIRST warp issues it and must be unchanged whenever the
// emulator reads them (product) and at every warp's retiring wait_group: a change means a write
// after some warp issued the wgmma (a missing barrier between writers in other warps and the
// wgmma, or a refill while it may still read).
#include "emu_internal.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <unistd.h>
#include <string>

namespace cp_emu {
namespace detail {

// Matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading / stride
// dimension byte offsets, each >> 4 in 14 bits; bits 49-51 base offset; bits 62-63 swizzle mode.
// Only the 128-byte swizzle with base offset 0 is modelled.
static bool decode_desc(uint64_t desc, uint32_t* start, uint32_t* lbo, uint32_t* sbo) {
  *start = (uint32_t)(desc & 0x3FFF) << 4;
  *lbo = (uint32_t)((desc >> 16) & 0x3FFF) << 4;
  *sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
  if ((desc >> 62) != 1 || ((desc >> 49) & 7) != 0 || ((desc >> 46) & 7) != 0 || ((desc >> 52) & 0x3FF) != 0) {
    sched_fail("wgmma descriptor %016llx: only 128-byte swizzle, base offset 0 is modelled", (unsigned long long)desc);
    return false;
  }
  return true;
}
// 128-byte swizzle on the shared-window byte address (Swizzle<3,4,3>): bits [4,7) ^= bits [7,10).
static uint32_t swz128(uint32_t a) { return a ^ (((a >> 7) & 7) << 4); }

// Shared addresses of the 16-bit operand elements a wgmma reads, in the order run_wgmma uses them:
// A[r][k] (64 x 16, only when A comes from shared memory) then B^T[c][k] (n x 16). Canonical layouts
// with 128-byte swizzle (T = 8 16-bit elements): K-major ((8,m),(T,2k)):((8T,SBO),(1,T)); MN-major
// ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)).
static bool operand_addrs(WgOp& op) {
  uint32_t st, lbo, sbo;
  op.addrs.clear();
  op.n_a = 0;
  if (!op.rs) {
    if (!decode_desc(op.da, &st, &lbo, &sbo)) return false;
    for (int r = 0; r < 64; ++r)
      for (int k = 0; k < 16; ++k) op.addrs.push_back(swz128(st + (r / 8) * sbo + (r % 8) * 128 + (k / 8) * 16 + (k % 8) * 2));
    op.n_a = 64 * 16;
  }
  if (!decode_desc(op.db, &st, &lbo, &sbo)) return false;
  for (int c = 0; c < op.n; ++c)
    for (int k = 0; k < 16; ++k) {
      const uint32_t ad = op.trans_b ? st + (c % 8) * 2 + ((c / 8) % 8) * 16 + (c / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo
                                     : st + (c / 8) * sbo + (c % 8) * 128 + (k / 8) * 16 + (k % 8) * 2;
      op.addrs.push_back(swz128(ad));
    }
  for (uint32_t ad : op.addrs)
    if (!smem_ptr(ad, 2)) return false;
  return true;
}

// "file:line" of the kernel code that issued the wgmma (from its return address, when the binary has
// line tables and addr2line is installed), else the symbol + offset, else the address.
static std::string site_name(const void* ra) {
  char buf[512];
  Dl_info info{};
  if (!ra || !dladdr(ra, &info) || !info.dli_fbase) {
    std::snprintf(buf, sizeof buf, "%p", ra);
    return buf;
  }
  const uintptr_t off = (uintptr_t)ra - (uintptr_t)info.dli_fbase - 1;
  std::string out;
  std::snprintf(buf, sizeof buf, "addr2line -i -e /proc/%d/exe 0x%llx 2>/dev/null", (int)getpid(),
                (unsigned long long)off);
  if (FILE* p = popen(buf, "r")) {
    std::string last;
    while (std::fgets(buf, sizeof buf, p)) {  // -i: the innermost inlined frame first: the first outside wgmma.cuh
      std::string s(buf);
      while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
      const size_t d = s.find(" (discriminator");
      if (d != std::string::npos) s.resize(d);
      if (last.empty() && s.find("??") == std::string::npos && s.find("wgmma.cuh") == std::string::npos) last = s;
    }
    pclose(p);
    const size_t sl = last.rfind("candle-cp-kernels/");
    if (!last.empty()) return sl == std::string::npos ? last : last.substr(sl);
  }
  std::snprintf(buf, sizeof buf, "%s+0x%llx", info.dli_sname ? info.dli_sname : "?", (unsigned long long)off);
  return buf;
}

// The operands' async-proxy view still equals the snapshot taken at the first warp's issue; `when`
// names the point of the check. raw (at a retiring wait_group, after the product read them): shared
// memory itself too (a refill landed but not fenced yet); at the product, smem_f16 reports those.
static bool check_snapshot(const WgOp& op, int wg, const char* when, bool raw) {
  uint32_t first = ~0u;
  int which = 0, ndiff = 0;
  for (size_t i = 0; i < op.addrs.size(); ++i)
    if (async_ld16(op.addrs[i]) != op.snap[i] || (raw && ld16(smem_ptr(op.addrs[i], 2)) != op.snap[i])) {
      ++ndiff;
      if (op.addrs[i] < first) first = op.addrs[i], which = i < (size_t)op.n_a ? 'A' : 'B';
    }
  if (!ndiff) return true;
  sched_fail("wgmma at %s (warpgroup %d, its wgmma #%ld in this block): operand %c changed (async-proxy view or "
             "shared memory) at shared offset %u (%d of its %zu elements) between the first issue and %s; written after warp %d "
             "issued this wgmma: a missing barrier between the writers and the wgmma (RAW across warps), or a refill "
             "while it may still read (WAR)", site_name(op.site).c_str(), wg, op.serial, which, first, ndiff,
             op.addrs.size(), when, op.first_warp);
  return false;
}

static bool smem_f16(uint32_t addr, bool bf, float* out) {
  unsigned char* p = smem_ptr(addr, 2);
  if (!p) return false;
  if (!async_view_ok(addr, 2)) {
    sched_fail("wgmma reads shared address %u, written through the generic proxy (cp.async / st.shared) and not "
               "made visible to the async proxy: no cp.async.wait_group + fence.proxy.async by the writing thread "
               "(+ barrier) before the wgmma, or a write racing with the wgmma", addr);
    return false;
  }
  *out = f16bits(ld16(p), bf);
  return true;
}

// D[64 x N] (+)= A[64 x 16] B[16 x N] for the 128 threads of one warpgroup (operand addresses from
// operand_addrs). Fragments (m64nNk16): thread = warp wr, lane 4g + t; D register 4i + e =
// (16wr + g + 8(e >> 1), 8i + 2t + (e & 1)); A register r = (16wr + g + 8(r & 1), 2t + 8(r >> 1) + {0, 1}),
// low half first.
static bool run_wgmma(WgOp& op, int wg, const char* when) {
  static float A[64][16], Bt[256][16], Dm[64][256];
  if (!check_snapshot(op, wg, when, false)) return false;
  if (op.rs) {
    for (int tid = 0; tid < 128; ++tid) {
      const int wr = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
      for (int r = 0; r < 4; ++r) {
        const uint32_t reg = op.av[tid][r];
        const int row = 16 * wr + g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
        A[row][col] = f16bits((uint16_t)(reg & 0xffff), op.bf);
        A[row][col + 1] = f16bits((uint16_t)(reg >> 16), op.bf);
      }
    }
  } else {
    for (int i = 0; i < 64 * 16; ++i)
      if (!smem_f16(op.addrs[i], op.bf, &A[i / 16][i % 16])) return false;
  }
  for (int i = 0; i < op.n * 16; ++i)
    if (!smem_f16(op.addrs[op.n_a + i], op.bf, &Bt[i / 16][i % 16])) return false;
  for (int m = 0; m < 64; ++m)
    for (int c = 0; c < op.n; ++c) {
      double acc = 0;
      for (int k = 0; k < 16; ++k) acc += (double)A[m][k] * (double)Bt[c][k];
      Dm[m][c] = (float)acc;
    }
  for (int tid = 0; tid < 128; ++tid) {
    const int wr = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
    for (int idx = 0; idx < op.n / 2; ++idx) {
      const int i = idx / 4, e = idx % 4;
      const float v = Dm[16 * wr + g + 8 * (e >> 1)][8 * i + 2 * t + (e & 1)];
      op.acc[tid][idx] = op.scale_d ? op.acc[tid][idx] + v : v;
    }
  }
  op.done = true;
  return true;
}

constexpr uint32_t ACC_POISON = 0x7fbadbadu;  // f32 NaN
constexpr uint32_t A_POISON = 0xffffffffu;    // two f16 / bf16 NaN

// A warp issued its part of `op`: its lanes' register operands go into the warpgroup's shadows
// (WgState) and are poisoned until its retiring wait_group; op.acc points at the shadows.
static bool hold_registers(WgState& w, WgOp& op, int l0, int wg) {
  for (int l = l0 % 128; l < l0 % 128 + 32; ++l) {
    AccShadow& s = w.acc[op.d[l]];
    if (s.pending && (int)s.v.size() != op.n / 2) {
      sched_fail("warpgroup %d thread %d: wgmma accumulators shared by in-flight wgmma of different shapes", wg, l);
      return false;
    }
    if (s.pending++ == 0) {
      s.v.assign(op.d[l], op.d[l] + op.n / 2);
      for (int i = 0; i < op.n / 2; ++i) std::memcpy(&op.d[l][i], &ACC_POISON, 4);
    }
    op.acc[l] = s.v.data();
    if (!op.rs) continue;
    AShadow& a = w.areg[op.a[l]];
    if (a.pending++ == 0) {
      std::memcpy(a.v, op.a[l], sizeof a.v);
      uint32_t* ar = const_cast<uint32_t*>(op.a[l]);  // the kernel's own (non-const) fragment array
      for (int r = 0; r < 4; ++r) ar[r] = A_POISON;
    }
    std::memcpy(op.av[l], a.v, sizeof a.v);
  }
  return true;
}

// `op` retired for warp l0 / 32 (after run_wgmma): the last in-flight user of each of its lanes'
// register sets checks that nobody wrote it in flight, then writes the accumulators / restores A.
static bool release_registers(WgState& w, const WgOp& op, int l0, int wg) {
  for (int l = l0 % 128; l < l0 % 128 + 32; ++l) {
    auto it = w.acc.find(op.d[l]);
    if (it != w.acc.end() && --it->second.pending == 0) {
      const std::vector<float>& v = it->second.v;
      for (size_t i = 0; i < v.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, &op.d[l][i], 4);
        if (bits != ACC_POISON) {
          sched_fail("warpgroup %d thread %d: accumulator register %zu of a wgmma written before the wait_group "
                     "that retires it (PTX ISA: undefined)", wg, l, i);
          return false;
        }
      }
      std::copy(v.begin(), v.end(), op.d[l]);
      w.acc.erase(it);
    }
    if (!op.rs) continue;
    auto ia = w.areg.find(op.a[l]);
    if (ia != w.areg.end() && --ia->second.pending == 0) {
      uint32_t* ar = const_cast<uint32_t*>(op.a[l]);
      for (int r = 0; r < 4; ++r)
        if (ar[r] != A_POISON) {
          sched_fail("warpgroup %d thread %d: A-fragment register %d of a wgmma written before the wait_group "
                     "that retires it (PTX ISA: undefined)", wg, l, r);
          return false;
        }
      std::memcpy(ar, ia->second.v, sizeof ia->second.v);
      w.areg.erase(ia);
    }
  }
  return true;
}

// Warp l0 / 32 (all lanes posted wgmma.mma_async) issues its part of its next wgmma.
static bool issue(int l0) {
  const int wg = l0 / 128, wr = (l0 / 32) % 4;
  WgState& w = wgs[wg];
  Fiber* L = &fib[l0];
  for (int l = 1; l < 32; ++l) {
    const Fiber& f = L[l];
    if (f.wg_bf != L[0].wg_bf || f.wg_n != L[0].wg_n || f.wg_scale != L[0].wg_scale || f.wg_trans != L[0].wg_trans ||
        (f.a != nullptr) != (L[0].a != nullptr) || f.db != L[0].db || (!f.a && f.da != L[0].da)) {
      sched_fail("warp %d: wgmma operands differ between lane 0 and lane %d (descriptors must be uniform)", l0 / 32, l);
      return false;
    }
  }
  const long serial = w.issued[wr]++;
  if (serial - w.base == (long)w.ops.size()) {  // first warp to issue it: parameters, operand snapshot
    w.ops.emplace_back();
    WgOp& op = w.ops.back();
    op.bf = L[0].wg_bf, op.n = L[0].wg_n, op.scale_d = L[0].wg_scale, op.trans_b = L[0].wg_trans;
    op.da = L[0].da, op.db = L[0].db, op.rs = L[0].a != nullptr;
    op.serial = serial, op.first_warp = l0 / 32, op.site = L[0].site;
    if (!operand_addrs(op)) return false;
    op.snap.resize(op.addrs.size());
    for (size_t i = 0; i < op.addrs.size(); ++i) op.snap[i] = async_ld16(op.addrs[i]);
  }
  WgOp& op = w.ops[(size_t)(serial - w.base)];
  if (L[0].wg_bf != op.bf || L[0].wg_n != op.n || L[0].wg_scale != op.scale_d || L[0].wg_trans != op.trans_b ||
      (L[0].a != nullptr) != op.rs || L[0].db != op.db || (!op.rs && L[0].da != op.da)) {
    sched_fail("warpgroup %d: wgmma #%ld operands differ between warp %d and warp %d (descriptors must be uniform)", wg,
               serial, op.first_warp, l0 / 32);
    return false;
  }
  for (int l = 0; l < 32; ++l) {
    op.d[l0 % 128 + l] = L[l].d;
    op.a[l0 % 128 + l] = L[l].a;
  }
  if (!hold_registers(w, op, l0, wg)) return false;
  op.issued |= 1 << wr;
  w.open[wr].push_back(serial);
  if (op.issued == 0xF && wgmma_at_issue) return run_wgmma(op, wg, "its execution at the last warp's issue");
  return true;
}

// The groups wait_group(n) of warp l0 / 32 retires: their wgmma have been issued by every warp.
bool wg_wait_ready(int l0) {
  for (int l = 1; l < 32; ++l)
    if (fib[l0 + l].op != WarpOp::WgWait) return true;  // mismatch: exec_warp reports it
  const WgState& w = wgs[l0 / 128];
  const int wr = (l0 / 32) % 4;
  const auto& gs = w.groups[wr];
  for (size_t g = 0; (long)(gs.size() - g) > (long)fib[l0].arg; ++g)
    for (long s : gs[g])
      if (w.ops[(size_t)(s - w.base)].issued != 0xF) return false;
  return true;
}

static bool wait(int l0, int n) {
  const int wg = l0 / 128, wr = (l0 / 32) % 4;
  WgState& w = wgs[wg];
  while ((int)w.groups[wr].size() > n) {
    for (long s : w.groups[wr].front()) {
      for (long j = w.base; j <= s; ++j) {  // every earlier wgmma of the warpgroup first (accumulator chains)
        WgOp& e = w.ops[(size_t)(j - w.base)];
        if (!e.done && !run_wgmma(e, wg, "its execution at the first retiring wait_group")) return false;
      }
      WgOp& op = w.ops[(size_t)(s - w.base)];
      char when[64];
      std::snprintf(when, sizeof when, "the wait_group of warp %d that retires it", l0 / 32);
      if (!check_snapshot(op, wg, when, true) || !release_registers(w, op, l0, wg)) return false;
      op.retired |= 1 << wr;
    }
    w.groups[wr].pop_front();
  }
  while (!w.ops.empty() && w.ops.front().retired == 0xF) w.ops.pop_front(), ++w.base;
  return true;
}

// Warp-level part of the wgmma ops (all 32 lanes of warp l0 / 32 posted `op`).
bool exec_wg_warp(int l0) {
  Fiber* L = &fib[l0];
  const int wr = (l0 / 32) % 4;
  if (nthreads % 128) {
    sched_fail("warp %d: %s in a block of %d threads (not whole warpgroups)", l0 / 32, op_name(L[0].op), nthreads);
    return false;
  }
  WgState& w = wgs[l0 / 128];
  switch (L[0].op) {
    case WarpOp::WgMma: return issue(l0);
    case WarpOp::WgCommit:
      w.groups[wr].push_back(std::move(w.open[wr]));
      w.open[wr].clear();
      return true;
    case WarpOp::WgWait:
      for (int l = 1; l < 32; ++l)
        if (L[l].arg != L[0].arg) {
          sched_fail("warp %d: wgmma.wait_group %d in lane 0, %d in lane %d", l0 / 32, L[0].arg, L[l].arg, l);
          return false;
        }
      return wait(l0, L[0].arg);
    default: return true;  // wgmma.fence: ordering only
  }
}

size_t wg_pending(const WgState& w) {
  size_t n = 0;
  for (int k = 0; k < 4; ++k) {
    n += w.open[k].size();
    for (const auto& g : w.groups[k]) n += g.size();
  }
  return n;
}

// setmaxnreg (warpgroup-collective) posted by threads [t0, t0 + 128).
static bool exec_wg(int t0) {
  Fiber* L = &fib[t0];
  for (int l = 0; l < 128; ++l)
    if (L[l].op != L[0].op || L[l].arg != L[0].arg) {
      sched_fail("warpgroup %d: thread %d at %s, thread 0 at %s", t0 / 128, l, op_name(L[l].op), op_name(L[0].op));
      return false;
    }
  // arg: +R (inc) / -R (dec); the pool was checked by exec_warpgroup
  const int r = std::abs(L[0].arg), now = wg_regs[t0 / 128];
  if (now && (L[0].arg > 0 ? r < now : r > now)) {
    sched_fail("warpgroup %d: setmaxnreg.%s %d with %d registers per thread (PTX ISA: undefined)", t0 / 128,
               L[0].arg > 0 ? "inc" : "dec", r, now);
    return false;
  }
  wg_regs[t0 / 128] = r;
  for (int l = 0; l < 128; ++l) L[l].st = St::Ready;
  return true;
}

long regs_after_inc(int t0) {
  if (!reg_pool || fib[t0].op != WarpOp::SetMaxNReg || fib[t0].arg <= 0) return 0;
  long total = 0;
  for (int w = 0; w < (int)wg_regs.size(); ++w) total += 128L * (w == t0 / 128 ? fib[t0].arg : wg_regs[w]);
  return total;
}

bool exec_warpgroup(int t0, bool* moved) {
  int at = 0;
  for (int l = 0; l < 128; ++l) at += fib[t0 + l].st == St::Warp && is_wg(fib[t0 + l].op);
  if (at == 128) {
    if (regs_after_inc(t0) > reg_pool) return true;  // setmaxnreg.inc waits for registers (a dec elsewhere)
    *moved = true;
    if (!exec_wg(t0)) return false;
  }
  return true;
}

bool exec_warpgroups(bool* moved) {
  if (nthreads % 128) return true;
  for (int t0 = 0; t0 < nthreads; t0 += 128)
    if (!exec_warpgroup(t0, moved)) return false;
  return true;
}

}  // namespace detail

using namespace detail;

void wg_fence() { post_and_wait(WarpOp::WgFence, 0xffffffffu); }
void wg_commit() { post_and_wait(WarpOp::WgCommit, 0xffffffffu); }
void wg_wait(int n) {
  fib[cur].arg = n;
  post_and_wait(WarpOp::WgWait, 0xffffffffu);
}
__attribute__((noinline)) void wg_mma(bool bf16, int n, float* d, const uint32_t* a, uint64_t da, uint64_t db, int scale_d,
                                      int trans_b) {
  Fiber& f = fib[cur];
  f.wg_bf = bf16, f.wg_n = n, f.d = d, f.a = a, f.da = da, f.db = db, f.wg_scale = scale_d != 0, f.wg_trans = trans_b;
  f.site = __builtin_return_address(0);
  post_and_wait(WarpOp::WgMma, 0xffffffffu);
}
void set_wgmma_at_issue(bool at_issue) { wgmma_at_issue = at_issue; }

void setmaxnreg(bool inc, int regs) {
  if (regs % 8 || regs < 24 || regs > 256) fail("setmaxnreg.%s %d: not a multiple of 8 in [24, 256]", inc ? "inc" : "dec", regs);
  if (nthreads % 128) fail("setmaxnreg in a block of %d threads (not whole warpgroups)", nthreads);
  fib[cur].arg = inc ? regs : -regs;
  post_and_wait(WarpOp::SetMaxNReg, 0xffffffffu);
}

}  // namespace cp_emu
