// cp.async (16-byte copies, landing modes) and the async-proxy view of dynamic shared memory of the
// host emulation (see emu.h); the scheduler that lands Random copies is in emu.cpp.
#include "emu_internal.h"

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

void cp_async16(uint32_t dst, const void* src, bool valid) {
  unsigned char* d = smem_ptr(dst, 16);
  if (dst % 16 || reinterpret_cast<uintptr_t>(src) % 16)
    fail("cp.async 16: addresses not 16-byte aligned (shared %u, global %p)", dst, src);
  auto s = static_cast<const unsigned char*>(src);
  if (valid && !globals.empty()) {
    bool ok = false;
    for (auto& g : globals) ok |= s >= g.first && s + 16 <= g.first + g.second;
    if (!ok) fail("cp.async reads global %p (16 bytes) outside every buffer of the launch", src);
  }
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
