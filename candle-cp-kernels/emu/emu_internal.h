// Internals shared by the emulator's scheduler (emu.cpp) and its PTX-level ops (emu_ops.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "emu.h"

#include <deque>
#include <map>
#include <vector>

namespace cp_emu {
namespace detail {

constexpr size_t STACK = 256 * 1024;
constexpr uint32_t STATIC_BASE = 0x40000000u;  // shared-window offset of the static section

struct Copy {
  unsigned char* dst;
  const unsigned char* src;
  bool valid;
  bool landed;
  int issuer = -1;  // thread
};

enum class St { Ready, Bar, Warp, Done };

struct Fiber {
  void* sp = nullptr;
  unsigned char* stack = nullptr;
  St st = St::Ready;
  const char* bar_file = nullptr;
  int bar_line = 0;
  // posted warp op
  WarpOp op{};
  unsigned mask = 0;
  uint32_t val = 0, res = 0, b0 = 0, b1 = 0, addr = 0;
  int arg = 0;
  bool flag = false;
  float* d = nullptr;
  const uint32_t* a = nullptr;
  uint64_t da = 0, db = 0;
  int wg_n = 0, wg_scale = 0, wg_trans = 0;
  bool wg_bf = false;
  uint32_t* r = nullptr;
  // cp.async state: indices into `copies` (this block's copies so far)
  std::vector<uint32_t> open;
  std::deque<std::vector<uint32_t>> groups;
  std::vector<uint32_t> unfenced;  // copies retired by a wait_group, not yet followed by fence.proxy.async
};

// One wgmma.mma_async of a warpgroup, as posted by its 128 threads. d: the threads' accumulator
// registers; acc: where the product reads C and writes D (d itself when run at issue, else the
// shadow copy below); av: the A fragments (register A) as they were at issue.
struct WgOp {
  bool bf = false;
  int n = 0, scale_d = 0, trans_b = 0;
  uint64_t da = 0, db = 0;
  bool rs = false;
  float* d[128];
  float* acc[128];
  const uint32_t* a[128];
  uint32_t av[128][4];
};
// Register operands of in-flight wgmma (deferred mode): PTX ISA (wgmma.wait_group) makes any access
// to the accumulator or A-fragment registers of a wgmma before the wait_group that retires it
// undefined, so the emulator fills them with NaN bits at issue (a read in flight sees NaN), keeps
// their values in a shadow, checks at retirement that the poison is untouched (a write in flight
// fails the launch) and only then writes the result / restores the A values. Accumulators chain
// across several in-flight wgmma (same registers, in issue order), as the ISA orders them.
struct AccShadow {
  std::vector<float> v;
  int pending = 0;
};
struct AShadow {
  uint32_t v[4];
  int pending = 0;
};
struct WgState {
  std::vector<WgOp> open;
  std::deque<std::vector<WgOp>> groups;
  std::map<float*, AccShadow> acc;
  std::map<const uint32_t*, AShadow> areg;
};

extern std::vector<Fiber> fib;     // the threads of the current block
extern std::vector<WgState> wgs;   // wgmma state per warpgroup of the current block
extern bool wgmma_at_issue;
extern int nthreads, cur;          // threads per block; running thread (-1: the scheduler)
extern bool in_fiber;

// True if the async proxy sees the dynamic shared-memory bytes [addr, addr + bytes) as they are
// (see the async-proxy view in emu.cpp); static shared memory is not modelled (always true).
bool async_view_ok(uint32_t addr, uint32_t bytes);
// Report a failure of the current launch from the scheduler's context.
void sched_fail(const char* fmt, ...);
const char* op_name(WarpOp op);
uint16_t ld16(const unsigned char* p);
float f16bits(uint16_t b, bool bf16);
// The calling thread posts `op` and yields until its warp (warpgroup) op has run.
void post_and_wait(WarpOp op, unsigned mask);
bool is_wg(WarpOp op);
// Runs the op posted by all lanes of warp [l0, l0 + n); false (after reporting) on a mismatch.
bool exec_warp(int l0, int n);
// Runs the complete warpgroup ops; *moved if any ran.
bool exec_warpgroups(bool* moved);
// The warpgroup op of threads [t0, t0 + 128) if all of them posted one (*moved then).
bool exec_warpgroup(int t0, bool* moved);

}  // namespace detail
}  // namespace cp_emu
