// PTX-level warp ops of the host emulation (see emu.h): shfl / vote, mma.sync m16n8k16, ldmatrix x4,
// stmatrix x4, conflict-checked st.shared
// (wgmma and setmaxnreg: emu_wgmma.cpp). Each runs in the scheduler's context once all lanes of its
// warp posted it.
#include "emu_internal.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
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

// st.shared by the 32 lanes of warp l0 / 32 (cp_sts_cf): every lane the same width (2, 4 or 8 bytes),
// naturally aligned, inside shared memory. The request is served in phases, as the hardware does:
// one of 32 lanes for 2- and 4-byte stores, two half-warps for 8-byte ones. Within a phase, lanes
// writing the same 32-bit word share it; two different words in one of the 32 banks (4-byte words,
// bank = word address mod 32) are a bank conflict, and the phase takes as many wavefronts as its
// busiest bank has words. Any conflict fails the launch, naming the phase, the bank and two lanes.
static bool exec_sts(int l0, Fiber* L) {
  const int bytes = L[0].arg;
  for (int l = 0; l < 32; ++l) {
    if (L[l].arg != bytes || (bytes != 2 && bytes != 4 && bytes != 8)) {
      sched_fail("warp %d: st.shared of %d bytes by lane %d, %d bytes by lane 0 (cp_sts_cf: one width, 2, 4 or 8)",
                 l0 / 32, L[l].arg, l, bytes);
      return false;
    }
    if (L[l].addr % (uint32_t)bytes) {
      sched_fail("warp %d lane %d: st.shared.b%d at %u not %d-byte aligned", l0 / 32, l, 8 * bytes, L[l].addr, bytes);
      return false;
    }
    if (!smem_ptr(L[l].addr, (uint32_t)bytes)) return false;
  }
  const int per = bytes == 8 ? 16 : 32;  // lanes per phase
  for (int p0 = 0; p0 < 32; p0 += per) {
    int owner[32];   // a lane whose word lies in the bank, per bank (-1: none yet)
    uint32_t word[32];
    std::fill(owner, owner + 32, -1);
    for (int l = p0; l < p0 + per; ++l)
      for (uint32_t w = L[l].addr / 4; w <= (L[l].addr + (uint32_t)bytes - 1) / 4; ++w) {
        const uint32_t bank = w % 32;
        if (owner[bank] < 0) {
          owner[bank] = l, word[bank] = w;
        } else if (word[bank] != w) {
          sched_fail("warp %d: st.shared.b%d bank conflict in the phase of lanes %d..%d: bank %u holds word %u "
                     "(lane %d) and word %u (lane %d); the layout of this store is meant to be conflict-free",
                     l0 / 32, 8 * bytes, p0, p0 + per - 1, bank, word[bank] * 4, owner[bank], w * 4, l);
          return false;
        }
      }
  }
  for (int l = 0; l < 32; ++l) {
    const uint32_t w[2] = {L[l].val, L[l].b0};
    std::memcpy(smem_ptr(L[l].addr, (uint32_t)bytes), w, (size_t)bytes);
  }
  return true;
}

// The row addresses of an ldmatrix / stmatrix .m8n8 .x4 (PTX ISA): lanes 8i .. 8i+7 supply rows
// 0..7 of matrix i, 16 bytes each, 16-byte aligned, inside shared memory. The hardware serves one
// matrix per phase: its 8 rows (4 banks each) must lie in 8 different bank quads, or be the same
// address (a shared row: allowed for loads; for stores two lanes would write one row, an error),
// else a bank conflict fails the launch.
static bool matrix_rows(int l0, Fiber* L, unsigned char* (&rows)[4][8], bool store) {
  for (int l = 0; l < 32; ++l) {
    const uint32_t ad = L[l].addr;
    if (ad % 16) {
      sched_fail("warp %d lane %d: %s row address %u not 16-byte aligned", l0 / 32, l, op_name(L[0].op), ad);
      return false;
    }
    unsigned char* p = smem_ptr(ad, 16);
    if (!p) return false;
    rows[l >> 3][l & 7] = p;
  }
  for (int i = 0; i < 4; ++i)
    for (int a = 0; a < 8; ++a)
      for (int b2 = 0; b2 < a; ++b2) {
        const uint32_t x = L[8 * i + a].addr, y = L[8 * i + b2].addr;
        if (store && x == y) {
          sched_fail("warp %d: %s matrix %d: rows %d and %d both at shared %u", l0 / 32, op_name(L[0].op), i, b2, a, x);
          return false;
        }
        if (x != y && (x / 16) % 8 == (y / 16) % 8) {
          sched_fail("warp %d: %s bank conflict in matrix %d: rows at shared %u (lane %d) and %u (lane %d) "
                     "use the same 4 banks", l0 / 32, op_name(L[0].op), i, y, 8 * i + b2, x, 8 * i + a);
          return false;
        }
      }
  return true;
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
    case WarpOp::Ldsm4T:
    case WarpOp::Stsm4:
    case WarpOp::Stsm4T: {
      // PTX ISA, ldmatrix / stmatrix (sm_90) .m8n8 .x4: register i of lane l holds the elements
      // (row l/4, cols 2(l%4), 2(l%4)+1) of matrix i, or of its transpose with .trans (then column
      // l/4 of rows 2(l%4), 2(l%4)+1), low half first; ldmatrix loads them, stmatrix stores them.
      const bool store = L[0].op == WarpOp::Stsm4 || L[0].op == WarpOp::Stsm4T;
      const bool tr = L[0].op == WarpOp::Ldsm4T || L[0].op == WarpOp::Stsm4T;
      unsigned char* rows[4][8];
      if (!matrix_rows(l0, L, rows, store)) return false;
      for (int l = 0; l < 32; ++l) {
        const int rr = l >> 2, cc = 2 * (l & 3);
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h) {
            unsigned char* e = tr ? rows[i][cc + h] + 2 * rr : rows[i][rr] + 2 * (cc + h);
            if (store) {
              const uint16_t v = (uint16_t)(L[l].a[i] >> (16 * h));
              std::memcpy(e, &v, 2);
            } else {
              const uint32_t v = ld16(e);
              L[l].r[i] = h ? (L[l].r[i] | v << 16) : v;
            }
          }
      }
      break;
    }
    case WarpOp::Sts:
      if (!exec_sts(l0, L)) return false;
      break;
    case WarpOp::WgFence:
    case WarpOp::WgMma:
    case WarpOp::WgCommit:
    case WarpOp::WgWait:
      if (!exec_wg_warp(l0)) return false;
      break;
    default:  // setmaxnreg: exec_warpgroup
      sched_fail("warp %d: %s reached the warp-level executor", l0 / 32, op_name(L[0].op));
      return false;
  }
  for (int l = 0; l < n; ++l) L[l].st = St::Ready;
  return true;
}

bool is_wg(WarpOp op) { return op == WarpOp::SetMaxNReg; }

bool warp_op_ready(int l0) { return fib[l0].op != WarpOp::WgWait || wg_wait_ready(l0); }

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

void warp_sts(uint32_t addr, const uint32_t* words, int bytes) {
  Fiber& f = fib[cur];
  f.addr = addr;
  f.val = words[0];
  f.b0 = words[1];
  f.arg = bytes;
  post_and_wait(WarpOp::Sts, 0xffffffffu);
}

void warp_stsm_x4(bool trans, const uint32_t* r, uint32_t addr) {
  Fiber& f = fib[cur];
  f.a = r;
  f.addr = addr;
  post_and_wait(trans ? WarpOp::Stsm4T : WarpOp::Stsm4, 0xffffffffu);
}

void warp_ldsm_x4(bool trans, uint32_t* r, uint32_t addr) {
  Fiber& f = fib[cur];
  f.r = r;
  f.addr = addr;
  post_and_wait(trans ? WarpOp::Ldsm4T : WarpOp::Ldsm4, 0xffffffffu);
}

}  // namespace cp_emu
