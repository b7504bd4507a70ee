// cp.async (16-byte copies, landing modes) and the async-proxy view of dynamic shared memory of the
// host emulation (see emu.h); the scheduler that lands Random copies is in emu.cpp.
#include "emu_internal.h"
#include "tma_map.h"

#include <algorithm>
#include <cstring>

namespace cp_emu {
namespace detail {

// Async proxy (PTX ISA 9.7.15.4 / 9.7.9.25.2 and 8.6): wgmma.mma_async reads shared memory through
// the async proxy; cp.async is a weak generic-proxy memory operation; fence.proxy.async orders the
// executing thread's prior generic writes before later async-proxy accesses (a barrier then extends
// that to the other threads). aview is what the async proxy may see of dynamic shared memory: a
// landed cp.async enters it when its issuing thread runs fence.proxy.async after the
// cp.async.wait_group that retired it; plain st.shared writes (not tracked per thread) enter it at
// any thread's fence.proxy.async (only ranges no cp.async of this block wrote). A wgmma operand byte
// where shared memory and aview differ fails the launch (emu_wgmma.cpp): a write not fenced yet, or
// one racing with the wgmma (a refill of a stage it may still read).
std::vector<unsigned char> aview;
std::vector<int32_t> gran_copy;                // per 16-byte granule of dyn: last cp.async into it, -1: none
std::vector<std::pair<size_t, size_t>> plain;  // (offset, bytes) of dyn no cp.async of this block wrote
bool plain_dirty = true;

void async_reset() {
  aview.assign(dyn.begin(), dyn.begin() + (long)dyn_size);
  gran_copy.assign(dyn_size / 16 + 1, -1);
  plain_dirty = true;
}

}  // namespace detail

using namespace detail;

// Whether [p, p + bytes) lies inside one of the launch's tracked global buffers (true when none is tracked).
static bool in_globals(const unsigned char* p, size_t bytes) {
  if (globals.empty()) return true;
  for (auto& g : globals)
    if (p >= g.first && p + bytes <= g.first + g.second) return true;
  return false;
}

void cp_async16(uint32_t dst, const void* src, bool valid) {
  unsigned char* d = smem_ptr(dst, 16);
  if (dst % 16 || reinterpret_cast<uintptr_t>(src) % 16)
    fail("cp.async 16: addresses not 16-byte aligned (shared %u, global %p)", dst, src);
  auto s = static_cast<const unsigned char*>(src);
  if (valid && !in_globals(s, 16)) fail("cp.async reads global %p (16 bytes) outside every buffer of the launch", src);
  const uint32_t idx = (uint32_t)copies.size();
  copies.push_back({d, s, valid, false, cur});
  fib[cur].open.push_back(idx);
  fib[cur].untracked.push_back(idx);
  if (dst < dyn_size) {
    plain_dirty |= gran_copy[dst / 16] < 0;
    gran_copy[dst / 16] = (int32_t)idx;
  }
  if (landing == Landing::AtIssue) {
    land(copies[idx]);
    return;
  }
  std::memset(d, 0xff, 16);  // contents undefined until it lands
  if (landing == Landing::Random) {
    due.push({tick + random_delay(), idx});
  }
}

void cp_async_commit() {
  Fiber& f = fib[cur];
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

void cp_async_wait(int n) {
  Fiber& f = fib[cur];
  while ((int)f.groups.size() > n) {
    for (uint32_t c : f.groups.front()) {
      land(copies[c]);
      f.unfenced.push_back(c);
    }
    f.groups.pop_front();
  }
}

void fence_proxy_async() {
  Fiber& f = fib[cur];
  for (uint32_t c : f.unfenced) {
    const unsigned char* d = copies[c].dst;
    if (d < dyn.data() || d >= dyn.data() + dyn_size) continue;  // static shared memory: not modelled
    const size_t off = (size_t)(d - dyn.data());
    if (gran_copy[off / 16] == (int32_t)c) std::memcpy(aview.data() + off, d, 16);  // not overwritten since
  }
  f.unfenced.clear();
  for (const CopySet& set : f.acquired)  // copies handed over by the mbarrier phases it waited for
    for (uint32_t c : *set) {
      const unsigned char* d = copies[c].dst;
      if (!copies[c].landed || d < dyn.data() || d >= dyn.data() + dyn_size) continue;
      const size_t off = (size_t)(d - dyn.data());
      if (gran_copy[off / 16] == (int32_t)c) std::memcpy(aview.data() + off, d, 16);
    }
  f.acquired.clear();
  if (plain_dirty) {
    plain.clear();
    for (size_t g = 0; g * 16 < dyn_size;) {
      size_t e = g;
      while (e * 16 < dyn_size && gran_copy[e] < 0) ++e;
      if (e > g) plain.push_back({g * 16, std::min(e * 16, dyn_size) - g * 16});
      g = e + 1;
    }
    plain_dirty = false;
  }
  for (const auto& r : plain) std::memcpy(aview.data() + r.first, dyn.data() + r.first, r.second);
}

// ---- TMA loads (tensor maps from tma_map.h) ------------------------------------------------------
namespace detail {
struct TmaLoad {
  uint32_t dst;
  cp_tma::Desc d;
  int c[4];
};
std::vector<TmaLoad> tmas;
struct TmaRed {
  cp_tma::Desc d;
  int c[4];
  uint32_t src;
  std::vector<unsigned char> snap;  // the source as it was at issue
};
std::vector<TmaRed> reds;
void tma_reset() {
  tmas.clear();
  reds.clear();
}

// Shared address of box byte `off` after the swizzle (on the absolute address, as the hardware
// does it: 16-byte chunk bits [4, 4 + log2(span / 16)) XOR address bits 7..).
static uint32_t tma_swizzle(uint32_t a, uint32_t span) {
  if (span == 0) return a;
  const uint32_t mask = span / 16 - 1;  // 128: 3 bits, 64: 2, 32: 1
  return a ^ (((a >> 7) & mask) << 4);
}

// Global address of box element e of a load at coordinates c; *in: inside the tensor (else zero-filled).
static uint64_t tma_src(const cp_tma::Desc& d, const int* c, uint64_t e, bool* in) {
  uint64_t addr = d.base;
  *in = true;
  for (uint32_t r = 0; r < d.rank; ++r) {
    const int64_t x = (int64_t)c[r] + (int64_t)(e % d.box[r]);
    e /= d.box[r];
    *in = *in && x >= 0 && (uint64_t)x < d.dims[r];
    addr += (uint64_t)x * d.strides[r];
  }
  return addr;
}
static uint64_t tma_elems(const cp_tma::Desc& d) {
  uint64_t n = 1;
  for (uint32_t r = 0; r < d.rank; ++r) n *= d.box[r];
  return n;
}
// Fails the launch (naming `op`) if an in-bounds element of the box at c is outside every tracked
// global buffer.
static void tma_check_globals(const cp_tma::Desc& d, const int* c, const char* op) {
  const uint64_t n = tma_elems(d);
  for (uint64_t e = 0; e < n && !globals.empty(); ++e) {
    bool in;
    const auto* g = reinterpret_cast<const unsigned char*>(tma_src(d, c, e, &in));
    if (in && !in_globals(g, d.esize))
      fail("%s: box element %llu at global %p is outside every buffer of the launch", op, (unsigned long long)e, (const void*)g);
  }
}

// The checks a TMA load and a TMA reduction share: `map` is one of tma_map.h's (rank <= 4), the
// shared box at `sa` (`what`: "destination" / "source") is aligned (1024 bytes with the 128-byte
// swizzle, so the pattern follows the absolute address as the kernels assume; else 128), a swizzled
// box's inner extent is the swizzle span (all the emulator models), the box lies inside dynamic
// shared memory and its in-bounds elements inside the launch's global buffers. Fails the launch
// naming `op`; returns the map's description.
static cp_tma::Desc tma_operands(const unsigned long long* map, uint32_t sa, const int* c, const char* op, const char* what) {
  cp_tma::Desc d;
  if (!cp_tma::decode(map, &d)) fail("%s: the tensor map was not made by cuTensorMapEncodeTiled (emu/tma_map.h)", op);
  if (d.rank > 4) fail("%s.4d: the tensor map has rank %u", op, d.rank);
  const uint32_t align = d.swizzle ? 8 * d.swizzle : 128;
  if (sa % align) fail("%s: shared %s %u not %u-byte aligned", op, what, sa, align);
  if (d.swizzle && d.box[0] * d.esize != d.swizzle)
    fail("%s: inner box extent %u bytes with a %u-byte swizzle (only equal is modelled)", op, d.box[0] * d.esize, d.swizzle);
  const uint64_t bytes = tma_elems(d) * d.esize;
  if ((size_t)sa + bytes > dyn_size)
    fail("%s: %s [%u, %llu) outside dynamic shared memory (%zu bytes)", op, what, sa, (unsigned long long)(sa + bytes), dyn_size);
  tma_check_globals(d, c, op);
  return d;
}

uint32_t tma_land(uint32_t i) {
  const TmaLoad& t = tmas[i];
  const uint32_t es = t.d.esize;
  const uint64_t n = tma_elems(t.d);
  for (uint64_t e = 0; e < n; ++e) {
    bool in;
    const uint64_t src = tma_src(t.d, t.c, e, &in);
    const uint32_t a = tma_swizzle(t.dst + (uint32_t)(e * es), t.d.swizzle);
    unsigned char* p = dyn.data() + a;
    if (in)
      std::memcpy(p, reinterpret_cast<const void*>(src), es);
    else
      std::memset(p, 0, es);
    std::memcpy(aview.data() + a, p, es);
  }
  return (uint32_t)(n * es);
}
}  // namespace detail

void tma_reduce_add(const unsigned long long* map, int c0, int c1, int c2, int c3, uint32_t src) {
  const int c[4] = {c0, c1, c2, c3};
  const cp_tma::Desc d = tma_operands(map, src, c, "cp.reduce.async.bulk.tensor", "source");
  if (d.esize != 4) fail("cp.reduce.async.bulk.tensor .add: only f32 maps are modelled");
  const uint64_t n = tma_elems(d);
  if (!async_view_ok(src, (uint32_t)(n * 4)))
    fail("cp.reduce.async.bulk.tensor: its source [%u, %llu) is not visible to the async proxy (the stores need a "
         "fence.proxy.async before the barrier that precedes the reduction)", src, (unsigned long long)(src + n * 4));
  TmaRed r{d, {c0, c1, c2, c3}, src, std::vector<unsigned char>(dyn.data() + src, dyn.data() + src + n * 4)};
  fib[cur].bulk_open.push_back((uint32_t)reds.size());
  reds.push_back(std::move(r));
  yield_to_sched();
}

void bulk_commit() {
  Fiber& f = fib[cur];
  f.bulk_groups.push_back(std::move(f.bulk_open));
  f.bulk_open.clear();
}

void bulk_wait_read(int n) {
  Fiber& f = fib[cur];
  while ((int)f.bulk_groups.size() > n) {
    for (uint32_t i : f.bulk_groups.front()) {
      const TmaRed& r = reds[i];
      if (std::memcmp(dyn.data() + r.src, r.snap.data(), r.snap.size()) != 0)
        fail("cp.async.bulk.wait_group.read: the source [%u, %zu) of a TMA reduction was rewritten before the wait "
             "that retires it", r.src, r.src + r.snap.size());
      for (uint64_t e = 0; e < r.snap.size() / 4; ++e) {
        bool in;
        const uint64_t dst = tma_src(r.d, r.c, e, &in);
        if (!in) continue;
        // box element e sits at the swizzled shared address (as a load would have put it there)
        float v;
        std::memcpy(&v, r.snap.data() + (tma_swizzle(r.src + (uint32_t)(e * 4), r.d.swizzle) - r.src), 4);
        *reinterpret_cast<float*>(dst) += v;
      }
    }
    f.bulk_groups.pop_front();
  }
  yield_to_sched();
}

void tma_prefetch_map(const unsigned long long* map) {
  cp_tma::Desc d;
  if (!cp_tma::decode(map, &d)) fail("prefetch.tensormap: not a tensor map made by cuTensorMapEncodeTiled (emu/tma_map.h)");
}

void tma_load(uint32_t dst, const unsigned long long* map, int c0, int c1, int c2, int c3, const void* bar) {
  const int c[4] = {c0, c1, c2, c3};
  const cp_tma::Desc d = tma_operands(map, dst, c, "cp.async.bulk.tensor", "destination");
  const uint64_t n = tma_elems(d);
  const uint32_t baddr = mbar_checked(bar, "cp.async.bulk.tensor (its mbarrier)");
  const uint32_t i = (uint32_t)tmas.size();
  tmas.push_back({dst, d, {c[0], c[1], c[2], c[3]}});
  if (landing != Landing::AtIssue) {  // contents undefined until it lands
    std::memset(dyn.data() + dst, 0xff, n * d.esize);
    std::memset(aview.data() + dst, 0xff, n * d.esize);
  }
  tma_arrival(baddr, i);
  yield_to_sched();
}

namespace detail {
bool async_view_ok(uint32_t addr, uint32_t bytes) {
  if (addr >= STATIC_BASE || (size_t)addr + bytes > dyn_size) return true;
  return std::memcmp(aview.data() + addr, dyn.data() + addr, bytes) == 0;
}
uint16_t async_ld16(uint32_t addr) {
  const unsigned char* p = addr < STATIC_BASE && (size_t)addr + 2 <= dyn_size ? aview.data() + addr : smem_ptr(addr, 2);
  return p ? ld16(p) : 0;
}
}  // namespace detail

}  // namespace cp_emu
