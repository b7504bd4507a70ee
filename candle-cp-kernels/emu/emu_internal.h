// Internals shared by the emulator's scheduler (emu.cpp) and its PTX-level ops (emu_ops.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "emu.h"

#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <queue>
#include <string>
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
  int issuer = -1;       // thread
  bool tracked = false;  // covered by a cp.async.mbarrier.arrive (retired by it at thread exit)
};

// Ready: runnable; Bar: at __syncthreads; Warp: posted a warp / warpgroup op; MBar: blocked in an
// mbarrier wait (wait_addr, wait_parity); NBar: blocked in bar.sync of named barrier nbar_id.
enum class St { Ready, Bar, Warp, MBar, NBar, Done };
using CopySet = std::shared_ptr<std::vector<uint32_t>>;

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
  const void* site = nullptr;  // wgmma: return address of cp_emu::wg_mma (its call site in the kernel)
  uint32_t* r = nullptr;
  // cp.async state: indices into `copies` (this block's copies so far)
  std::vector<uint32_t> open;
  std::deque<std::vector<uint32_t>> groups;
  std::vector<uint32_t> unfenced;  // copies retired by a wait_group, not yet followed by fence.proxy.async
  // mbarriers / named barriers
  uint32_t wait_addr = 0, wait_parity = 0;
  int nbar_id = 0;
  long bar0_seen = 0;              // block-barrier generation this thread last passed
  std::vector<uint32_t> untracked;  // copies issued since its last cp.async.mbarrier.arrive
  std::vector<CopySet> acquired;    // copies handed over by completed mbarrier phases it waited for
  // bulk async-groups (TMA reductions, emu_async.cpp): indices of its open and committed ones
  std::vector<uint32_t> bulk_open;
  std::deque<std::vector<uint32_t>> bulk_groups;
};

// One wgmma.mma_async of a warpgroup (emu_wgmma.cpp), from the first warp's issue until every warp's
// wait_group retired it. d: the threads' accumulator registers; acc: where the product reads C and
// writes D (the shadows below); av: the A fragments (register A) as they were at issue. addrs: the
// shared addresses of the 16-bit operand elements it reads (A: the first n_a, then B); snap: their
// async-proxy view when the first warp issued it (must be unchanged when read and when retired).
struct WgOp {
  bool bf = false;
  int n = 0, scale_d = 0, trans_b = 0;
  uint64_t da = 0, db = 0;
  bool rs = false;
  int issued = 0, retired = 0;  // bit per warp of the warpgroup
  bool done = false;            // product computed
  int first_warp = -1, n_a = 0;
  long serial = 0;              // its index among the warpgroup's wgmma of this block
  const void* site = nullptr;   // return address of cp_emu::wg_mma in the first issuing warp's lane 0
  float* d[128];
  float* acc[128];
  const uint32_t* a[128];
  uint32_t av[128][4];
  std::vector<uint32_t> addrs;
  std::vector<uint16_t> snap;
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
// Per warpgroup: wgmma not yet retired by every warp (ops[i] has serial base + i); per warp (0..3):
// wgmma issued so far, its open (uncommitted) serials and its committed groups.
struct WgState {
  std::deque<WgOp> ops;
  long base = 0;
  long issued[4] = {0, 0, 0, 0};
  std::vector<long> open[4];
  std::deque<std::vector<long>> groups[4];
  std::map<float*, AccShadow> acc;
  std::map<const uint32_t*, AShadow> areg;
};

extern std::vector<Fiber> fib;     // the threads of the current block
extern std::vector<WgState> wgs;   // wgmma state per warpgroup of the current block
extern bool wgmma_at_issue;
// dynamic shared memory of the current block (dyn_size bytes used) and the launch's global buffers
extern std::vector<unsigned char> dyn;
extern size_t dyn_size;
extern std::vector<std::pair<const unsigned char*, size_t>> globals;
extern int nthreads, cur;          // threads per block; running thread (-1: the scheduler)
extern bool in_fiber;
// setmaxnreg accounting (see emu.h): registers per thread of each warpgroup (0: unknown) and the
// block's pool (0: no __launch_bounds__, not enforced)
extern std::vector<int> wg_regs;
extern long reg_pool;

// cp.async copies of the current block and the Random-landing heap (due tick, copy index; with ARRIVE
// set: a cp.async mbarrier arrival), ticks being fiber switches of the block (emu.cpp)
extern std::vector<Copy> copies;
using Due = std::pair<uint64_t, uint32_t>;
extern std::priority_queue<Due, std::vector<Due>, std::greater<Due>> due;
extern uint64_t tick;
extern Landing landing;
extern long bar0_gen;  // completed block barriers (__syncthreads) of the current block
// set by an mbarrier arrival, or a named-barrier arrival that woke a thread of another warp: under
// warps-asc/-desc the arriving warp then pauses until no other warp can move (emu.cpp, run_warp)
extern bool yield_warp;
extern int reg_start;  // registers per thread at entry (from __launch_bounds__), 0: unknown
constexpr uint32_t ARRIVE = 0x80000000u;
void land(Copy& c);
uint64_t random_delay();  // Random landing: a log-uniform delay in ticks
void yield_to_sched();
// mbarriers / named barriers (emu_sync.cpp): reset for a new block; fire cp.async arrival i; when
// nothing can move, complete every copy and arrival in flight (true if any); the blocked waits for
// a deadlock report
void sync_reset();
// TMA loads (emu_async.cpp): write load i's box into shared memory (both views), return its bytes;
// poison its destination at issue; clear the block's loads. Arrivals of kind TMA (emu_sync.cpp)
// call tma_land and complete the bytes on the mbarrier.
uint32_t tma_land(uint32_t i);
void tma_reset();
void mbar_complete_tx(uint32_t addr, uint32_t bytes);
// The shared offset of `bar`; fails the launch unless it is an initialised, aligned mbarrier.
uint32_t mbar_checked(const void* bar, const char* what);
uint32_t tma_arrival(uint32_t bar, uint32_t load);  // queue load `load`'s completion per landing mode

void fire(uint32_t i);
bool flush_async();
std::string blocked_waits();
std::string nbar_leftover();

// True if the async proxy sees the dynamic shared-memory bytes [addr, addr + bytes) as they are
// (see the async-proxy view in emu.cpp); static shared memory is not modelled (always true).
bool async_view_ok(uint32_t addr, uint32_t bytes);
// A new block: the async-proxy view starts as the (poisoned) dynamic shared memory (emu_async.cpp).
void async_reset();
// The 16-bit value at shared address addr as the async proxy sees it (static shared memory: as is).
uint16_t async_ld16(uint32_t addr);
// Report a failure of the current launch from the scheduler's context.
void sched_fail(const char* fmt, ...);
const char* op_name(WarpOp op);
uint16_t ld16(const unsigned char* p);
float f16bits(uint16_t b, bool bf16);
// The calling thread posts `op` and yields until its warp (warpgroup) op has run.
void post_and_wait(WarpOp op, unsigned mask);
// Warpgroup-collective op (setmaxnreg; the wgmma ops are warp-level, emu_wgmma.cpp).
bool is_wg(WarpOp op);
// Runs the op posted by all lanes of warp [l0, l0 + n); false (after reporting) on a mismatch.
bool exec_warp(int l0, int n);
// Whether the warp op posted by all lanes of warp l0 / 32 can run now (a wgmma.wait_group waits until
// every warp of its warpgroup issued the wgmma it retires).
bool warp_op_ready(int l0);
// emu_wgmma.cpp: the wgmma ops of warp l0 / 32 (fence, mma_async issue, commit, wait_group); whether
// its wait_group can run; wgmma issued and not retired by some warp of a warpgroup.
bool exec_wg_warp(int l0);
bool wg_wait_ready(int l0);
size_t wg_pending(const WgState& w);
// Runs the complete warpgroup ops; *moved if any ran.
bool exec_warpgroups(bool* moved);
// The warpgroup op of threads [t0, t0 + 128) if all of them posted one (*moved then).
bool exec_warpgroup(int t0, bool* moved);
// Registers the block would hold if warpgroup t0 / 128 ran its posted setmaxnreg.inc (0: no pool).
long regs_after_inc(int t0);

}  // namespace detail
}  // namespace cp_emu
