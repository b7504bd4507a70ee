// Emulator self-tests: small kernels with the bugs the emulator claims to catch. Each check
// passes when the bug IS detected (poisoned data read, or the launch fails with a diagnosis);
// the positive controls must run clean. Compiled like a kernel file (common.cuh, CP_HOST_EMU).
#include "common.cuh"
#include "harness.h"

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
  if (!wanted("emu selftest")) return;
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
}
