// PTX-level warp and warpgroup ops of the host emulation (see emu.h): shfl / vote, mma.sync
// m16n8k16, ldmatrix x4, wgmma m64nNk16 with 128-byte-swizzle descriptors. Each runs in the
// scheduler's context once all lanes (threads) of its warp (warpgroup) posted it.
#include "emu_internal.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace cp_emu {
namespace detail {

uint16_t ld16(const unsigned char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
float f16bits(uint16_t b, bool bf16) {
  if (bf16) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half h;
  std::memcpy(static_cast<void*>(&h), &b, 2);
  return __half2float(h);
}

// Runs the op posted by all lanes of warp w (lanes l0 .. l0+n-1); false (after reporting) on a
// mismatch.
bool exec_warp(int l0, int n) {
  Fiber* L = &fib[l0];
  for (int l = 0; l < n; ++l) {
    if (L[l].op != L[0].op) {
      sched_fail("warp %d: lane %d at %s while lane 0 at %s", l0 / 32, l, op_name(L[l].op), op_name(L[0].op));
      return false;
    }
    if (L[l].mask != 0xffffffffu || n != 32) {
      sched_fail("warp %d: %s with member mask %08x over %d lanes (only full warps are modelled)", l0 / 32,
                 op_name(L[0].op), L[l].mask, n);
      return false;
    }
  }
  switch (L[0].op) {
    case WarpOp::Sync: break;
    case WarpOp::Shfl:
      for (int l = 0; l < 32; ++l) L[l].res = L[L[l].arg & 31].val;
      break;
    case WarpOp::ShflXor:
      for (int l = 0; l < 32; ++l) L[l].res = L[(l ^ L[l].arg) & 31].val;
      break;
    case WarpOp::Any:
    case WarpOp::Ballot: {
      uint32_t bits = 0;
      for (int l = 0; l < 32; ++l) bits |= (L[l].val ? 1u : 0u) << l;
      for (int l = 0; l < 32; ++l) L[l].res = L[0].op == WarpOp::Any ? (bits != 0) : bits;
      break;
    }
    case WarpOp::Mma16816Bf16:
    case WarpOp::Mma16816F16: {
      // PTX ISA, "Matrix Fragments for mma.m16n8k16" (.bf16/.f16 A row-major, B column-major,
      // f32 C/D): groupID g = lane >> 2, threadID_in_group t = lane % 4;
      //   a_i (i = 0..7, two per register): row g + 8 * ((i >> 1) & 1), col 2t + (i & 1) + 8 * (i >= 4)
      //   b_i (i = 0..3): row (k) 2t + (i & 1) + 8 * (i >= 2), col (n) g
      //   c_i (i = 0..3): row g + 8 * (i >= 2), col 2t + (i & 1)
      const bool bf = L[0].op == WarpOp::Mma16816Bf16;
      float A[16][16], B[16][8], C[16][8];
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 8; ++i) {
          uint32_t reg = L[l].a[i >> 1];
          uint16_t h = (i & 1) ? (uint16_t)(reg >> 16) : (uint16_t)(reg & 0xffff);
          A[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * (i >= 4)] = f16bits(h, bf);
        }
        for (int i = 0; i < 4; ++i) {
          uint32_t reg = i < 2 ? L[l].b0 : L[l].b1;
          uint16_t h = (i & 1) ? (uint16_t)(reg >> 16) : (uint16_t)(reg & 0xffff);
          B[2 * t + (i & 1) + 8 * (i >= 2)][g] = f16bits(h, bf);
        }
        for (int i = 0; i < 4; ++i) C[g + 8 * (i >= 2)][2 * t + (i & 1)] = L[l].d[i];
      }
      float Dm[16][8];
      for (int m = 0; m < 16; ++m)
        for (int nn = 0; nn < 8; ++nn) {
          double acc = C[m][nn];
          for (int k = 0; k < 16; ++k) acc += (double)A[m][k] * (double)B[k][nn];
          Dm[m][nn] = (float)acc;
        }
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) L[l].d[i] = Dm[g + 8 * (i >= 2)][2 * t + (i & 1)];
      }
      break;
    }
    case WarpOp::Ldsm4:
    case WarpOp::Ldsm4T: {
      // PTX ISA, ldmatrix .m8n8 .x4: lanes 8i .. 8i+7 supply the row addresses of matrix i
      // (16 bytes each, 16-byte aligned); lane l receives in register i the elements
      // (row l/4, cols 2(l%4), 2(l%4)+1) of matrix i, or of its transpose with .trans.
      const unsigned char* rows[4][8];
      for (int l = 0; l < 32; ++l) {
        uint32_t ad = L[l].addr;
        if (ad % 16) {
          sched_fail("warp %d lane %d: %s row address %u not 16-byte aligned", l0 / 32, l, op_name(L[0].op), ad);
          return false;
        }
        unsigned char* p = smem_ptr(ad, 16);
        if (!p) return false;
        rows[l >> 3][l & 7] = p;
      }
      const bool tr = L[0].op == WarpOp::Ldsm4T;
      for (int l = 0; l < 32; ++l) {
        const int rr = l >> 2, cc = 2 * (l & 3);
        for (int i = 0; i < 4; ++i) {
          uint16_t lo, hi;
          if (!tr) {
            lo = ld16(rows[i][rr] + 2 * cc);
            hi = ld16(rows[i][rr] + 2 * (cc + 1));
          } else {
            lo = ld16(rows[i][cc] + 2 * rr);
            hi = ld16(rows[i][cc + 1] + 2 * rr);
          }
          L[l].r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
      }
      break;
    }
    default:  // warpgroup ops: exec_wg
      sched_fail("warp %d: %s reached the warp-level executor", l0 / 32, op_name(L[0].op));
      return false;
  }
  for (int l = 0; l < n; ++l) L[l].st = St::Ready;
  return true;
}

bool is_wg(WarpOp op) { return op >= WarpOp::WgFence; }

// Matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading / stride
// dimension byte offsets, each >> 4 in 14 bits; bits 49-51 base offset; bits 62-63 swizzle mode.
// Only the 128-byte swizzle with base offset 0 is modelled.
bool decode_desc(uint64_t desc, uint32_t* start, uint32_t* lbo, uint32_t* sbo) {
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
uint32_t swz128(uint32_t a) { return a ^ (((a >> 7) & 7) << 4); }

bool smem_f16(uint32_t addr, bool bf, float* out) {
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

// D[64 x N] (+)= A[64 x 16] B[16 x N] for the 128 threads of one warpgroup. Canonical layouts with
// 128-byte swizzle (T = 8 16-bit elements): K-major ((8,m),(T,2k)):((8T,SBO),(1,T)); MN-major
// ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)). Fragments (m64nNk16): thread = warp wr, lane 4g + t;
// D register 4i + e = (16wr + g + 8(e >> 1), 8i + 2t + (e & 1)); A register r =
// (16wr + g + 8(r & 1), 2t + 8(r >> 1) + {0, 1}), low half first.
bool run_wgmma(const WgOp& op) {
  static float A[64][16], Bt[256][16], Dm[64][256];
  uint32_t st, lbo, sbo;
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
    if (!decode_desc(op.da, &st, &lbo, &sbo)) return false;
    for (int r = 0; r < 64; ++r)
      for (int k = 0; k < 16; ++k)
        if (!smem_f16(swz128(st + (r / 8) * sbo + (r % 8) * 128 + (k / 8) * 16 + (k % 8) * 2), op.bf, &A[r][k])) return false;
  }
  if (!decode_desc(op.db, &st, &lbo, &sbo)) return false;
  for (int c = 0; c < op.n; ++c)
    for (int k = 0; k < 16; ++k) {
      const uint32_t ad = op.trans_b ? st + (c % 8) * 2 + ((c / 8) % 8) * 16 + (c / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo
                                     : st + (c / 8) * sbo + (c % 8) * 128 + (k / 8) * 16 + (k % 8) * 2;
      if (!smem_f16(swz128(ad), op.bf, &Bt[c][k])) return false;
    }
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
  return true;
}

constexpr uint32_t ACC_POISON = 0x7fbadbadu;  // f32 NaN
constexpr uint32_t A_POISON = 0xffffffffu;    // two f16 / bf16 NaN

// Deferred wgmma issued: its register operands go into the warpgroup's shadows (WgState) and are
// poisoned until retirement; op.acc points at the shadow accumulators.
void hold_registers(WgState& w, WgOp& op) {
  for (int l = 0; l < 128; ++l) {
    AccShadow& s = w.acc[op.d[l]];
    if (s.pending++ == 0) {
      s.v.assign(op.d[l], op.d[l] + op.n / 2);
      for (int i = 0; i < op.n / 2; ++i) std::memcpy(&op.d[l][i], &ACC_POISON, 4);
    }  // (a chain of different shapes is rejected by the caller)
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
}

// Deferred wgmma retired (after run_wgmma): the last in-flight user of each register set checks
// that nobody wrote it in flight, then writes the accumulators / restores the A fragments.
bool release_registers(WgState& w, const WgOp& op, int t0) {
  for (int l = 0; l < 128; ++l) {
    auto it = w.acc.find(op.d[l]);
    if (it == w.acc.end()) continue;
    if (--it->second.pending == 0) {
      const std::vector<float>& v = it->second.v;
      for (size_t i = 0; i < v.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, &op.d[l][i], 4);
        if (bits != ACC_POISON) {
          sched_fail("warpgroup %d thread %d: accumulator register %zu of a wgmma written before the wait_group "
                     "that retires it (PTX ISA: undefined)", t0 / 128, l, i);
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
                     "that retires it (PTX ISA: undefined)", t0 / 128, l, r);
          return false;
        }
      std::memcpy(ar, ia->second.v, sizeof ia->second.v);
      w.areg.erase(ia);
    }
  }
  return true;
}

// Runs the warpgroup op posted by threads [t0, t0 + 128).
bool exec_wg(int t0) {
  Fiber* L = &fib[t0];
  for (int l = 0; l < 128; ++l)
    if (L[l].op != L[0].op || (L[0].op == WarpOp::WgWait && L[l].arg != L[0].arg)) {
      sched_fail("warpgroup %d: thread %d at %s, thread 0 at %s", t0 / 128, l, op_name(L[l].op), op_name(L[0].op));
      return false;
    }
  WgState& w = wgs[t0 / 128];
  switch (L[0].op) {
    case WarpOp::WgMma: {
      WgOp op;
      op.bf = L[0].wg_bf, op.n = L[0].wg_n, op.scale_d = L[0].wg_scale, op.trans_b = L[0].wg_trans;
      op.da = L[0].da, op.db = L[0].db, op.rs = L[0].a != nullptr;
      for (int l = 0; l < 128; ++l) {
        const Fiber& f = L[l];
        if (f.wg_bf != op.bf || f.wg_n != op.n || f.wg_scale != op.scale_d || f.wg_trans != op.trans_b ||
            (f.a != nullptr) != op.rs || f.db != op.db || (!op.rs && f.da != op.da)) {
          sched_fail("warpgroup %d: wgmma operands differ between thread 0 and thread %d (descriptors must be uniform)",
                     t0 / 128, l);
          return false;
        }
        op.d[l] = op.acc[l] = f.d;
        op.a[l] = f.a;
        if (op.rs) std::memcpy(op.av[l], f.a, sizeof op.av[l]);
      }
      if (wgmma_at_issue) {
        if (!run_wgmma(op)) return false;
      } else {
        for (int l = 0; l < 128; ++l) {
          auto it = w.acc.find(op.d[l]);
          if (it != w.acc.end() && (int)it->second.v.size() != op.n / 2) {
            sched_fail("warpgroup %d thread %d: wgmma accumulators shared by in-flight wgmma of different shapes",
                       t0 / 128, l);
            return false;
          }
        }
        hold_registers(w, op);
        w.open.push_back(op);
      }
      break;
    }
    case WarpOp::WgCommit:
      w.groups.push_back(std::move(w.open));
      w.open.clear();
      break;
    case WarpOp::WgWait:
      while ((int)w.groups.size() > L[0].arg) {
        for (const WgOp& op : w.groups.front())
          if (!run_wgmma(op) || !release_registers(w, op, t0)) return false;
        w.groups.pop_front();
      }
      break;
    default: break;  // fence: ordering only
  }
  for (int l = 0; l < 128; ++l) L[l].st = St::Ready;
  return true;
}

// Complete warpgroup ops (all 128 threads arrived); *moved if any ran.
bool exec_warpgroup(int t0, bool* moved) {
  int at = 0;
  for (int l = 0; l < 128; ++l) at += fib[t0 + l].st == St::Warp && is_wg(fib[t0 + l].op);
  if (at == 128) {
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

uint32_t warp_u32(WarpOp op, unsigned mask, uint32_t value, int arg) {
  Fiber& f = fib[cur];
  f.val = value;
  f.arg = arg;
  post_and_wait(op, mask);
  return fib[cur].res;
}

void warp_mma16816(bool bf16, float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  Fiber& f = fib[cur];
  f.d = d;
  f.a = a;
  f.b0 = b0;
  f.b1 = b1;
  post_and_wait(bf16 ? WarpOp::Mma16816Bf16 : WarpOp::Mma16816F16, 0xffffffffu);
}

void warp_ldsm_x4(bool trans, uint32_t* r, uint32_t addr) {
  Fiber& f = fib[cur];
  f.r = r;
  f.addr = addr;
  post_and_wait(trans ? WarpOp::Ldsm4T : WarpOp::Ldsm4, 0xffffffffu);
}

void wg_fence() { post_and_wait(WarpOp::WgFence, 0xffffffffu); }
void wg_commit() { post_and_wait(WarpOp::WgCommit, 0xffffffffu); }
void wg_wait(int n) {
  fib[cur].arg = n;
  post_and_wait(WarpOp::WgWait, 0xffffffffu);
}
void wg_mma(bool bf16, int n, float* d, const uint32_t* a, uint64_t da, uint64_t db, int scale_d, int trans_b) {
  Fiber& f = fib[cur];
  f.wg_bf = bf16, f.wg_n = n, f.d = d, f.a = a, f.da = da, f.db = db, f.wg_scale = scale_d != 0, f.wg_trans = trans_b;
  post_and_wait(WarpOp::WgMma, 0xffffffffu);
}
void set_wgmma_at_issue(bool at_issue) { wgmma_at_issue = at_issue; }

}  // namespace cp_emu
