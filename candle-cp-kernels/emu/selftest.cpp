// Emulator self-tests: small kernels with the bugs the emulator claims to catch. Each check
// passes when the bug IS detected (poisoned data read, or the launch fails with a diagnosis);
// the positive controls must run clean. Compiled like a kernel file (common.cuh, CP_HOST_EMU).
#include "common.cuh"
#include "harness.h"
#include "wgmma.cuh"

namespace {

// cp.async into dynamic shared memory, then read it back; `wait` places the wait_group before
// the barrier (correct) or after the read (bug: the read sees the copy still in flight).
__global__ void st_cp_async(const float* src, float* out, bool wait) {
  CP_DYN_SMEM(unsigned char, smem);
  const int tid = threadIdx.x;
  cp_async16(cp_smem_u32(smem + 16 * tid), src + 4 * tid, true);
  cp_async_commit();
  if (wait) cp_async_wait<0>();
  __syncthreads();
  const float* s = reinterpret_cast<const float*>(smem);
  out[tid] = s[(4 * tid + 4) % (4 * blockDim.x)];
  if (!wait) cp_async_wait<0>();
}

// Static shared array written by each thread and read at the neighbour's slot; `barrier` false
// drops the __syncthreads between (bug).
__global__ void st_neighbour(float* out, bool barrier) {
  __shared__ float buf[128];
  CP_EMU_POISON(buf);
  const int tid = threadIdx.x;
  buf[tid] = (float)tid;
  if (barrier) __syncthreads();
  out[tid] = buf[(tid + 1) % 128];
}

// Prefetch into a buffer another warp still uses: each warp first stages data (write, read back)
// in the next warp's quarter of the buffer, then every thread refills its own 16 bytes with
// cp.async. `barrier_first` false issues the refill before the barrier that frees the buffer
// (bug): a skewed warp's staging then overwrites a copy that already landed. Under at-wait
// landing the staging write covers the poison and the copy lands later, so only at-issue (or
// random) landing exposes it.
__global__ void st_refill(const float* src, float* out, bool barrier_first) {
  CP_DYN_SMEM(unsigned char, smem);
  float* b = reinterpret_cast<float*>(smem);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int slot = ((warp + 1) % 4) * 128 + 4 * lane;
  b[slot] = (float)tid;
  __syncwarp();
  const float x = b[slot];
  if (barrier_first) __syncthreads();
  cp_async16(cp_smem_u32(smem + 16 * tid), src + 4 * tid, true);
  cp_async_commit();
  if (!barrier_first) __syncthreads();
  cp_async_wait<0>();
  __syncthreads();
  out[tid] = b[4 * tid] + (x == (float)tid ? 0.f : 1e6f);
}

// A kernel whose bound is below the block size the test launches it with.
__global__ void __launch_bounds__(64) st_bounded(float* out) { out[threadIdx.x] = 1.f; }

__global__ void st_divergent(float* out) {
  if (threadIdx.x < 64) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}

__global__ void st_barrier_after_exit(float* out) {
  if (threadIdx.x >= 96) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

__global__ void st_warp_missing_lane(float* out) {
  float x = (float)threadIdx.x;
  if (threadIdx.x % 32 != 5) x = cp_warp_sum(x);
  out[threadIdx.x] = x;
}

__global__ void st_ldsm_oob(float* out) {
  CP_DYN_SMEM(unsigned char, smem);
  uint32_t r[4];
  cp_ldsm_x4(r, cp_smem_u32(smem) + 16 * (threadIdx.x % 32) + 4096);
  out[threadIdx.x] = (float)r[0];
}

// One warpgroup: B [16 k x 64 n] (MN-major, 128-byte swizzle) by cp.async, A = all ones from
// registers, D = A B by wgmma (so D[m][n] = sum_k B[k][n]). mode 0: correct; 1: no
// fence.proxy.async between the copies and the wgmma (bug); 2: an accumulator register written
// before the wait_group (bug); 3: an A-fragment register read before the wait_group (bug: PTX
// leaves it undefined, the emulator hands out NaN).
__global__ void st_wgmma(const __half* b, float* out, int mode) {
  CP_DYN_SMEM_A(unsigned char, smem, 1024);
  const uint32_t base = (cp_smem_u32(smem) + 1023u) & ~1023u;
  const int tid = threadIdx.x;
  sw_load<16, 64, 128, __half>(base, b, 64, 0, 16, tid);
  cp_async_commit();
  cp_async_wait<0>();
  if (mode != 1) fence_proxy_async();
  __syncthreads();
  uint32_t a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};  // f16 1.0 pairs
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wg_fence();
  wg_rs<64, __half>(d, a, sw128_desc(base, 16 * 128, 1024), 0);
  wg_commit();
  if (mode == 2) d[3] = 1.f;
  float x = 0.f;
  if (mode == 3) {  // a[1]'s low half (1.0) minus 1
    const uint16_t lo = (uint16_t)(a[1] & 0xffffu);
    __half h;
    std::memcpy(static_cast<void*>(&h), &lo, 2);
    x = __half2float(h) - 1.f;
  }
  wg_wait<0>();
  for (int i = 0; i < 32; ++i) out[32 * tid + i] = d[i] + x;
}

bool any_nan(const Buf<float>& b) {
  for (size_t i = 0; i < b.n; ++i)
    if (std::isnan(b.p[i])) return true;
  return false;
}

void expect(const std::string& name, bool detected) {
  check(std::string("emu selftest: ") + name, detected ? 0.0 : 1.0, 0.0);
}

}  // namespace

void run_selftests() {
  // Each planted bug runs under the schedule / landing it needs (the same in every combination).
  if (!selftests_here() || !wanted("emu selftest")) return;
  const cp_emu::Schedule sched0 = cp_emu::schedule();
  const cp_emu::Landing land0 = cp_emu::cp_async_landing();
  cp_emu::set_schedule(cp_emu::Schedule::Lockstep);
  cp_emu::set_cp_async_landing(cp_emu::Landing::AtWait);
  std::printf("emu selftest: the EMU ERROR lines below are expected (bugs planted on purpose)\n");
  Buf<float> src(512), out(128);
  for (int i = 0; i < 512; ++i) src.p[i] = (float)i;
  bool ok = cp_emu::launch("st_cp_async(wait)", dim3(1), dim3(128), 2048, [&] { st_cp_async(src.p, out.p, true); });
  bool clean = ok && !any_nan(out);
  for (int i = 0; i < 128 && clean; ++i) clean = out.p[i] == (float)((4 * i + 4) % 512);
  expect("cp.async waited before the barrier reads the copied data (control)", clean);
  ok = cp_emu::launch("st_cp_async(no wait)", dim3(1), dim3(128), 2048, [&] { st_cp_async(src.p, out.p, false); });
  expect("read of a cp.async destination before wait_group sees poison", ok && any_nan(out));
  ok = cp_emu::launch("st_neighbour(barrier)", dim3(2), dim3(128), 0, [&] { st_neighbour(out.p, true); });
  expect("shared write, barrier, neighbour read (control)", ok && !any_nan(out) && out.p[127] == 0.f);
  ok = cp_emu::launch("st_neighbour(no barrier)", dim3(2), dim3(128), 0, [&] { st_neighbour(out.p, false); });
  expect("missing barrier between shared write and neighbour read sees poison", ok && any_nan(out));
  expect("divergent __syncthreads (two sites) fails the launch",
         !cp_emu::launch("st_divergent", dim3(1), dim3(128), 0, [&] { st_divergent(out.p); }));
  expect("__syncthreads after some threads exited fails the launch",
         !cp_emu::launch("st_barrier_after_exit", dim3(1), dim3(128), 0, [&] { st_barrier_after_exit(out.p); }));
  expect("shuffle with a lane missing fails the launch (deadlock)",
         !cp_emu::launch("st_warp_missing_lane", dim3(1), dim3(64), 0, [&] { st_warp_missing_lane(out.p); }));
  expect("ldmatrix outside dynamic shared memory fails the launch",
         !cp_emu::launch("st_ldsm_oob", dim3(1), dim3(32), 4096, [&] { st_ldsm_oob(out.p); }));
  const std::pair<cp_emu::Schedule, const char*> skews[] = {{cp_emu::Schedule::WarpsAscending, "warps-asc"},
                                                            {cp_emu::Schedule::WarpsDescending, "warps-desc"}};
  const std::pair<cp_emu::Landing, const char*> lands[] = {{cp_emu::Landing::AtIssue, "at-issue"},
                                                           {cp_emu::Landing::Random, "random:1"}};
  for (auto& sk : skews)
    for (auto& ld : lands) {
      cp_emu::set_schedule(sk.first);
      cp_emu::set_cp_async_landing(ld.first, 1);
      const std::string mode = std::string(" (") + sk.second + "/" + ld.second + ")";
      for (bool first : {true, false}) {
        ok = cp_emu::launch("st_refill", dim3(1), dim3(128), 2048, [&] { st_refill(src.p, out.p, first); });
        bool right = ok;
        for (int i = 0; i < 128 && right; ++i) right = out.p[i] == (float)(4 * i);
        expect(first ? "refill after the barrier that frees the buffer (control)" + mode
                     : "cp.async refill issued before the barrier that frees the buffer is caught" + mode,
               first ? right : !right);
      }
    }
  cp_emu::set_schedule(cp_emu::Schedule::Lockstep);
  cp_emu::set_cp_async_landing(cp_emu::Landing::AtWait);
  {
    // wgmma register operands and the async proxy (deferred wgmma, as in every combination but warps-asc)
    cp_emu::set_wgmma_at_issue(false);
    Buf<__half> bh(16 * 64);
    Buf<float> dw(128 * 32);
    for (int i = 0; i < 16 * 64; ++i) bh.p[i] = __float2half((float)((i * 7) % 5));
    auto right = [&] {
      for (int tid = 0; tid < 128; ++tid)
        for (int i = 0; i < 32; ++i) {
          const int n = 8 * (i / 4) + 2 * (tid % 4) + (i % 2);
          float want = 0.f;
          for (int k = 0; k < 16; ++k) want += (float)((k * 64 + n) * 7 % 5);
          if (dw.p[32 * tid + i] != want) return false;
        }
      return true;
    };
    ok = cp_emu::launch("st_wgmma", dim3(1), dim3(128), 16 * 128 + 1024, [&] { st_wgmma(bh.p, dw.p, 0); });
    expect("wgmma after cp.async.wait_group + fence.proxy.async + barrier, D = A B (control)", ok && right());
    expect("wgmma reading cp.async data without fence.proxy.async fails the launch",
           !cp_emu::launch("st_wgmma", dim3(1), dim3(128), 16 * 128 + 1024, [&] { st_wgmma(bh.p, dw.p, 1); }));
    expect("accumulator register written before the wait_group fails the launch",
           !cp_emu::launch("st_wgmma", dim3(1), dim3(128), 16 * 128 + 1024, [&] { st_wgmma(bh.p, dw.p, 2); }));
    ok = cp_emu::launch("st_wgmma", dim3(1), dim3(128), 16 * 128 + 1024, [&] { st_wgmma(bh.p, dw.p, 3); });
    expect("A-fragment register read before the wait_group sees NaN", ok && any_nan(dw));
    cp_emu::set_wgmma_at_issue(sched0 == cp_emu::Schedule::WarpsAscending);  // as the harness sets it
  }
  expect("block of 128 threads for __launch_bounds__(64) fails the launch",
         !cp_emu::launch("st_bounded", dim3(1), dim3(128), 0, [&] { st_bounded(out.p); }));
  expect("block of 64 threads for __launch_bounds__(64) runs (control)",
         cp_emu::launch("st_bounded", dim3(1), dim3(64), 0, [&] { st_bounded(out.p); }));
  expect("166,913 bytes of shared memory (over sm_80's opt-in limit) fail the launch",
         !cp_emu::launch("st_smem_big", dim3(1), dim3(32), cp_emu::SMEM_OPTIN_SM80 + 1, [&] { out.p[threadIdx.x] = 0.f; }));
  expect("232,448 bytes of shared memory for a wgmma (sm_90) entry run (control)",
         cp_emu::launch("st_smem_big_wgmma", dim3(1), dim3(32), cp_emu::SMEM_OPTIN_SM90, [&] { out.p[threadIdx.x] = 0.f; }));
  expect("232,449 bytes of shared memory for a wgmma (sm_90) entry fail the launch",
         !cp_emu::launch("st_smem_big_wgmma", dim3(1), dim3(32), cp_emu::SMEM_OPTIN_SM90 + 1, [&] { out.p[threadIdx.x] = 0.f; }));
  cp_emu::set_schedule(sched0);
  cp_emu::set_cp_async_landing(land0);
}
