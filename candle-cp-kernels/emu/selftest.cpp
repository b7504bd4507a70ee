// Emulator self-tests: small kernels with the bugs the emulator claims to catch. Each check
// passes when the bug IS detected (poisoned data read, or the launch fails with a diagnosis);
// the positive controls must run clean. Compiled like a kernel file (common.cuh, CP_HOST_EMU).
#include "common.cuh"
#include "harness.h"
#include "wgmma.cuh"
#include "mbarrier.cuh"

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

// ldmatrix .x4 with row r of matrix i at byte stride * r + 16 i: stride 144 (the pipelined kernels'
// padded rows at D = 64) puts each matrix's 8 rows in 8 bank quads; 128 puts them all in quad i.
__global__ void st_ldsm_stride(float* out, int stride) {
  CP_DYN_SMEM(unsigned char, smem);
  const int l = threadIdx.x;
  for (int i = l; i < 2048; i += 32) smem[i] = (unsigned char)i;
  __syncthreads();
  uint32_t r[4];
  cp_ldsm_x4(r, cp_smem_u32(smem) + (uint32_t)(stride * (l & 7) + 16 * (l >> 3)));
  out[l] = (float)(r[0] & 0xff);
}

// stmatrix .x4 .trans by one warp: register i of lane l holds fragment elements (row l / 4, cols
// 2 (l % 4), 2 (l % 4) + 1) of matrix i, valued 64 i + 8 row + col; row j of matrix i is stored at
// byte stride * j + 16 i. Read back: out[64 i + 8 j + k] = element k of stored row j of matrix i, which
// must be fragment (row k, col j): 64 i + 8 k + j. stride 144: 8 bank quads per matrix (clean); 128: one
// quad (a conflict); 0: all rows of a matrix at one address (two lanes store one row: an error).
__global__ void st_stsm(float* out, int stride) {
  CP_DYN_SMEM(unsigned char, smem);
  const int l = threadIdx.x, rr = l >> 2, cc = 2 * (l & 3);
  uint32_t r[4];
  for (int i = 0; i < 4; ++i) r[i] = (uint32_t)(64 * i + 8 * rr + cc) | ((uint32_t)(64 * i + 8 * rr + cc + 1) << 16);
  cp_stsm_x4_trans(cp_smem_u32(smem) + (uint32_t)(stride * (l & 7) + 16 * (l >> 3)), r);
  __syncthreads();
  for (int e = l; e < 256; e += 32) {
    const int i = e >> 6, j = (e >> 3) & 7, k = e & 7;
    uint16_t v;
    memcpy(&v, smem + stride * j + 16 * i + 2 * k, 2);
    out[e] = (float)v;
  }
}

// cp_sts_cf by one warp, read back after a barrier. mode 0: 8-byte stores, lane l at row l / 4 of a
// [8][64] f32 buffer, columns 2 (l % 4) + 8 (l / 4): each half-warp covers the 32 banks once (clean);
// 1: the same columns for every row (rows 256 bytes apart: 4-way in each half-warp, a conflict);
// 2: 2-byte stores, lanes 2i and 2i + 1 into the two halves of word i (shared words, clean).
__global__ void st_sts(float* out, int mode) {
  CP_DYN_SMEM(float, smem);
  const int l = threadIdx.x, g = l >> 2, t = l & 3;
  if (mode == 2) {
    cp_sts_cf(reinterpret_cast<uint16_t*>(smem) + l, (uint16_t)(l + 1));
  } else {
    float* p = smem + g * 64 + 2 * t + (mode == 0 ? 8 * g : 0);
    cp_sts_cf(p, make_float2((float)l, (float)-l));
  }
  __syncthreads();
  if (mode == 2)
    out[l] = (float)reinterpret_cast<const uint16_t*>(smem)[l];
  else
    out[l] = smem[g * 64 + 2 * t + (mode == 0 ? 8 * g : 0) + 1];
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

// The dS race of flash_bwd_sm90_ws.cu (D = 64): one warpgroup; B [16 k x 64 n] by cp.async (+ wait,
// fence, barrier), then each warp stores its 16 rows of A [64 x 16] (K-major, 128-byte swizzle) with
// plain stores and runs fence.proxy.async, and the warpgroup issues D = A B (wg_ss_tb), which reads
// the rows of all four warps. wgmma's .sync waits only for the issuing warp: mode 0 (bug) has no
// barrier between the other warps' stores and the wgmma; 1: a 128-thread named barrier; 2:
// __syncthreads; 3: barrier, then warp 0 overwrites B (+ fence) right after its own wait_group,
// while the other warps' parts may still read it (bug: WAR); 4: the same after a __syncthreads.
__global__ void st_wgmma_rows(const __half* b, float* out, int mode) {
  CP_DYN_SMEM_A(unsigned char, smem, 1024);
  const uint32_t s0 = cp_smem_u32(smem), base = (s0 + 1023u) & ~1023u, aa = base + 2048;
  const int tid = threadIdx.x, w = tid / 32, l = tid % 32;
  sw_load<16, 64, 128, __half>(base, b, 64, 0, 16, tid);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  const int r = 16 * w + l / 2;
  for (int k = 8 * (l % 2); k < 8 * (l % 2) + 8; ++k) {
    const uint32_t ad = aa + (uint32_t)((r / 8) * 1024 + (r % 8) * 128 + (k / 8) * 16 + (k % 8) * 2);
    const __half v = __float2half((float)((r + 3 * k) % 3 - 1));
    std::memcpy(smem + ((ad ^ (((ad >> 7) & 7) << 4)) - s0), &v, 2);
  }
  fence_proxy_async();
  if (mode == 1 || mode >= 3) cp_named_bar_sync(1, 128);
  if (mode == 2) __syncthreads();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wg_fence();
  wg_ss_tb<64, __half>(d, sw128_desc(aa, 16, 1024), sw128_desc(base, 16 * 128, 1024), 0);
  wg_commit();
  wg_wait<0>();
  if (mode == 4) __syncthreads();
  if (mode >= 3 && w == 0) {
    std::memset(smem + (base - s0) + 16 * l, 0, 16);
    fence_proxy_async();
  }
  for (int i = 0; i < 32; ++i) out[32 * tid + i] = d[i];
}

// Warp-specialized ring (mbarrier.cuh): warpgroup 0 produces RING_TILES tiles of 512 floats into a
// RING_STAGES-stage ring in dynamic shared memory (one 16-byte cp.async per thread and tile);
// warpgroups 1 and 2 consume them in ping-pong order (named barriers 1 and 2), logging whose turn
// it was, and copy every tile to `out`. full[s] counts the 128 producer arrivals, empty[s] the 256
// consumer arrivals. mode 0: cp.async.mbarrier.arrive.noinc; 1: wait_group + fence.proxy.async +
// plain arrive; 2: consumers read without waiting on full (bug); 3: producer refills without waiting
// on empty (bug); 4: producer's first wait on empty with parity 0 (bug: deadlock); 5: consumer 1 hands
// its last turn on too (bug: a bar.arrive nobody waits for, left mid-phase at exit). INC: the
// consumers' setmaxnreg.inc (232 fits __launch_bounds__(384, 1)'s 168 per thread after the producer's
// dec to 40; 240 does not: the inc waits forever).
constexpr int RING_STAGES = 3, RING_TILES = 8;
constexpr size_t RING_SMEM = RING_STAGES * 2048 + 64 + 4 * (2 * RING_TILES + 1);
template <int INC>
__global__ void __launch_bounds__(384, 1) st_ring(const float* src, float* out, int* order, int mode) {
  CP_DYN_SMEM(unsigned char, smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + RING_STAGES * 2048);
  uint64_t* empty = full + 4;
  int* log = reinterpret_cast<int*>(smem + RING_STAGES * 2048 + 64);  // log[0]: entries so far
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < RING_STAGES; ++s) {
      cp_mbar_init(&full[s], 128);
      cp_mbar_init(&empty[s], 256);
    }
    cp_mbar_init_fence();
    log[0] = 0;
  }
  __syncthreads();
  if (tid < 128) {
    cp_setmaxnreg_dec<40>();
    for (int it = 0; it < RING_TILES; ++it) {
      const int s = it % RING_STAGES, u = it / RING_STAGES;
      if (mode != 3) cp_mbar_wait(&empty[s], (u & 1) ^ (mode == 4 ? 0 : 1));
      cp_async16(cp_smem_u32(smem + s * 2048 + 16 * tid), src + it * 512 + 4 * tid, true);
      if (mode == 1) {
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();
        cp_mbar_arrive(&full[s]);
      } else {
        cp_mbar_arrive_cp_async(&full[s]);
      }
    }
  } else {
    cp_setmaxnreg_inc<INC>();
    const int wg = tid / 128 - 1, c = tid - 128;
    if (wg == 1) cp_named_bar_arrive(1, 256);  // consumer 0 goes first
    for (int it = 0; it < RING_TILES; ++it) {
      const int s = it % RING_STAGES, u = it / RING_STAGES;
      if (mode != 2) cp_mbar_wait(&full[s], u & 1);
      cp_named_bar_sync(1 + wg, 256);
      if (c % 128 == 0) log[1 + log[0]++] = wg;
      const float* st = reinterpret_cast<const float*>(smem + s * 2048);
      out[it * 512 + 2 * c] = st[2 * c];
      out[it * 512 + 2 * c + 1] = st[2 * c + 1];
      // consumer 1's last turn hands nothing on (balanced); mode 5 hands it on anyway (bug)
      if (wg == 0 || it + 1 < RING_TILES || mode == 5) cp_named_bar_arrive(2 - wg, 256);
      cp_mbar_arrive(&empty[s]);
    }
  }
  __syncthreads();
  if (tid < 2 * RING_TILES) order[tid] = log[1 + tid];
}

// mbarrier hand-over to a wgmma consumer: warpgroup 0 loads B [16 k x 64 n] (MN-major, 128-byte
// swizzle) by cp.async, warpgroup 1 waits on the full barrier and computes D = ones(64x16) B.
// mode 0: cp.async.mbarrier.arrive, consumer fence.proxy.async after its wait (correct); 1: producer
// wait_group + fence + arrive, no consumer fence (correct); 2: cp.async.mbarrier.arrive and no fence
// anywhere (bug: the async proxy may not see the copies).
__global__ void st_mbar_wgmma(const __half* b, float* out, int mode) {
  CP_DYN_SMEM_A(unsigned char, smem, 1024);
  const uint32_t base = (cp_smem_u32(smem) + 1023u) & ~1023u;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (base - cp_smem_u32(smem)) + 16 * 128);
  const int tid = threadIdx.x;
  if (tid == 0) cp_mbar_init(full, 128);
  __syncthreads();
  if (tid < 128) {
    sw_load<16, 64, 128, __half>(base, b, 64, 0, 16, tid);
    if (mode == 1) {
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async();
      cp_mbar_arrive(full);
    } else {
      cp_mbar_arrive_cp_async(full);
    }
    return;
  }
  cp_mbar_wait(full, 0);
  if (mode == 0) fence_proxy_async();
  uint32_t a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wg_fence();
  wg_rs<64, __half>(d, a, sw128_desc(base, 16 * 128, 1024), 0);
  wg_commit();
  wg_wait<0>();
  for (int i = 0; i < 32; ++i) out[32 * (tid - 128) + i] = d[i];
}

// Named-barrier and setmaxnreg misuse (128 threads). mode 0: warps 0-1 bar.sync(1, 128), warps
// 2-3 bar.sync(1, 64) (count mismatch); 1: bar.sync(1, 96) by warps 0-1 and 16 lanes of warps 2-3
// (the count completes with partial warps); 2: setmaxnreg by warps 0-1 only (partial warpgroup);
// 3: bar.sync(16, 128) (id out of range); 4: correct (bar.arrive by warps 0-1, bar.sync by warps
// 2-3, then setmaxnreg.dec by all). mbarrier misuse (64 bytes of dynamic shared memory): 5: wait on
// a barrier never initialised; 6: an arrival by thread 33 before the __syncthreads that publishes
// thread 0's init; 7: a plain store into the barrier's 8 bytes; 8: correct (all 128 arrive, then
// all wait for parity 0).
__global__ void st_nbar(float* out, int mode) {
  const int tid = threadIdx.x, warp = tid / 32;
  if (mode == 0) cp_named_bar_sync(1, warp < 2 ? 128 : 64);
  if (mode == 1 && (tid % 32 < 16 || warp < 2)) cp_named_bar_sync(1, 96);
  if (mode == 2 && warp < 2) cp_setmaxnreg_dec<40>();
  if (mode == 3) cp_named_bar_sync(16, 128);
  if (mode == 4) {
    if (warp < 2)
      cp_named_bar_arrive(1, 128);
    else
      cp_named_bar_sync(1, 128);
    cp_setmaxnreg_dec<40>();
  }
  if (mode >= 5) {
    CP_DYN_SMEM(unsigned char, smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    if (mode == 5) cp_mbar_wait(bar, 0);
    if (tid == 0) cp_mbar_init(bar, 128);
    if (mode == 6 && tid == 33) cp_mbar_arrive(bar);
    __syncthreads();
    if (mode == 7 && tid == 1) smem[0] = (unsigned char)(smem[0] ^ 0x5a);
    __syncthreads();
    cp_mbar_arrive(bar);
    cp_mbar_wait(bar, 0);
  }
  out[tid] = 1.f;
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
  Buf<float> src(512), out(128), out_sm(256);
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
  ok = cp_emu::launch("st_ldsm_stride(144)", dim3(1), dim3(32), 2048, [&] { st_ldsm_stride(out.p, 144); });
  // lane l gets element (row l / 4, col 2 (l % 4)) of matrix 0: byte 144 (l / 4) + 4 (l % 4)
  bool loaded = ok;
  for (int l = 0; l < 32; ++l) loaded = loaded && out.p[l] == (float)((144 * (l >> 2) + 4 * (l & 3)) & 0xff);
  expect("ldmatrix rows in 8 bank quads per matrix load (control)", loaded);
  expect("ldmatrix with two rows of a matrix in one bank quad fails the launch (bank conflict)",
         !cp_emu::launch("st_ldsm_stride(128)", dim3(1), dim3(32), 2048, [&] { st_ldsm_stride(out.p, 128); }));
  ok = cp_emu::launch("st_stsm(144)", dim3(1), dim3(32), 2048, [&] { st_stsm(out_sm.p, 144); });
  bool transposed = ok;
  for (int e = 0; e < 256; ++e) transposed = transposed && out_sm.p[e] == (float)(64 * (e >> 6) + 8 * (e & 7) + ((e >> 3) & 7));
  expect("stmatrix .trans stores the transpose of each fragment matrix (control)", transposed);
  expect("stmatrix with two rows of a matrix in one bank quad fails the launch (bank conflict)",
         !cp_emu::launch("st_stsm(128)", dim3(1), dim3(32), 2048, [&] { st_stsm(out_sm.p, 128); }));
  expect("stmatrix with two rows of a matrix at one address fails the launch",
         !cp_emu::launch("st_stsm(0)", dim3(1), dim3(32), 2048, [&] { st_stsm(out_sm.p, 0); }));
  ok = cp_emu::launch("st_sts(clean)", dim3(1), dim3(32), 2048, [&] { st_sts(out.p, 0); });
  bool stored = ok;
  for (int l = 0; l < 32; ++l) stored = stored && out.p[l] == (float)-l;
  expect("conflict-free 8-byte cp_sts_cf stores land (control)", stored);
  expect("an 8-byte cp_sts_cf store with a bank conflict fails the launch",
         !cp_emu::launch("st_sts(conflict)", dim3(1), dim3(32), 2048, [&] { st_sts(out.p, 1); }));
  ok = cp_emu::launch("st_sts(shared words)", dim3(1), dim3(32), 2048, [&] { st_sts(out.p, 2); });
  stored = ok;
  for (int l = 0; l < 32; ++l) stored = stored && out.p[l] == (float)(l + 1);
  expect("2-byte cp_sts_cf stores sharing words are no conflict and land (control)", stored);
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
  {
    // wgmma's .sync orders only the issuing warp: another warp's rows stored after the first warp issued
    // the wgmma fail the launch (warps-asc / warps-desc run a warp to its wgmma before the next stores),
    // and so does a refill of an operand after one warp's wait_group while another warp has not retired it
    Buf<__half> bh(16 * 64);
    Buf<float> dw(128 * 32);
    for (int i = 0; i < 16 * 64; ++i) bh.p[i] = __float2half((float)((i * 7) % 5));
    auto right = [&] {
      for (int tid = 0; tid < 128; ++tid)
        for (int i = 0; i < 32; ++i) {
          const int m = 16 * (tid / 32) + (tid % 32) / 4 + 8 * ((i % 4) >> 1), n = 8 * (i / 4) + 2 * (tid % 4) + (i % 2);
          float want = 0.f;
          for (int k = 0; k < 16; ++k) want += (float)((m + 3 * k) % 3 - 1) * (float)((k * 64 + n) * 7 % 5);
          if (dw.p[32 * tid + i] != want) return false;
        }
      return true;
    };
    const size_t sm = 1024 + 2048 + 8192;
    using S = cp_emu::Schedule;
    const std::pair<S, const char*> sks[] = {{S::WarpsAscending, "warps-asc"}, {S::WarpsDescending, "warps-desc"},
                                             {S::Lockstep, "lockstep"}, {S::Random, "random:2"}};
    for (auto& sk : sks)
      for (bool at_issue : {true, false}) {
        cp_emu::set_schedule(sk.first, 2);
        cp_emu::set_wgmma_at_issue(at_issue);
        const std::string m = std::string(" (") + sk.second + (at_issue ? ", wgmma at issue)" : ", wgmma deferred)");
        ok = cp_emu::launch("st_wgmma_rows", dim3(1), dim3(128), sm, [&] { st_wgmma_rows(bh.p, dw.p, 1); });
        expect("warps' A rows, fence.proxy.async, 128-thread named barrier, wgmma (control)" + m, ok && right());
        ok = cp_emu::launch("st_wgmma_rows", dim3(1), dim3(128), sm, [&] { st_wgmma_rows(bh.p, dw.p, 2); });
        expect("warps' A rows, fence.proxy.async, __syncthreads, wgmma (control)" + m, ok && right());
        if (sk.first == S::WarpsAscending || sk.first == S::WarpsDescending)
          expect("wgmma reading A rows other warps store after its first warp issued it fails the launch" + m,
                 !cp_emu::launch("st_wgmma_rows", dim3(1), dim3(128), sm, [&] { st_wgmma_rows(bh.p, dw.p, 0); }));
        ok = cp_emu::launch("st_wgmma_rows", dim3(1), dim3(128), sm, [&] { st_wgmma_rows(bh.p, dw.p, 4); });
        expect("wait_group, __syncthreads, then warp 0 overwrites B (control)" + m, ok && right());
        if (sk.first == S::WarpsAscending)
          expect("warp 0 overwriting B after its own wait_group while other warps' parts may read it fails the launch" + m,
                 !cp_emu::launch("st_wgmma_rows", dim3(1), dim3(128), sm, [&] { st_wgmma_rows(bh.p, dw.p, 3); }));
      }
    cp_emu::set_schedule(S::Lockstep);
    cp_emu::set_wgmma_at_issue(sched0 == cp_emu::Schedule::WarpsAscending);
  }
  {
    // mbarrier ring + named barriers + setmaxnreg (mbarrier.cuh): the controls under every schedule and
    // landing, each planted bug under the mode that exposes it
    using S = cp_emu::Schedule;
    using L = cp_emu::Landing;
    Buf<float> rsrc(RING_TILES * 512), rout(RING_TILES * 512);
    Buf<int> order(2 * RING_TILES);
    for (int i = 0; i < RING_TILES * 512; ++i) rsrc.p[i] = (float)i;
    auto ring = [&](int mode, bool over) {
      std::memset((void*)rout.p, 0xff, rout.n * sizeof(float));
      std::memset((void*)order.p, 0xff, order.n * sizeof(int));
      return over ? cp_emu::launch("st_ring<240>", dim3(1), dim3(384), RING_SMEM, [&] { st_ring<240>(rsrc.p, rout.p, order.p, mode); })
                  : cp_emu::launch("st_ring<232>", dim3(1), dim3(384), RING_SMEM, [&] { st_ring<232>(rsrc.p, rout.p, order.p, mode); });
    };
    auto ring_right = [&] {
      for (int i = 0; i < RING_TILES * 512; ++i)
        if (rout.p[i] != (float)i) return false;
      for (int k = 0; k < 2 * RING_TILES; ++k)
        if (order.p[k] != k % 2) return false;
      return true;
    };
    const std::pair<S, const char*> scheds[] = {{S::Lockstep, "lockstep"}, {S::WarpsAscending, "warps-asc"},
                                                {S::WarpsDescending, "warps-desc"}, {S::Random, "random:5"}};
    const std::pair<L, const char*> landings[] = {{L::AtWait, "at-wait"}, {L::AtIssue, "at-issue"}, {L::Random, "random:5"}};
    for (int mode : {0, 1}) {
      std::string bad;
      for (auto& sc : scheds)
        for (auto& ld : landings) {
          cp_emu::set_schedule(sc.first, 5);
          cp_emu::set_cp_async_landing(ld.first, 5);
          if (!ring(mode, false) || !ring_right()) bad += std::string(" ") + sc.second + "/" + ld.second;
        }
      if (!bad.empty()) std::printf("  st_ring mode %d wrong under:%s\n", mode, bad.c_str());
      expect(mode == 0 ? "mbarrier ring with cp.async.mbarrier.arrive, ping-pong named barriers, setmaxnreg "
                         "(control, every schedule and landing)"
                       : "mbarrier ring with wait_group + fence.proxy.async + arrive (control, every schedule and landing)",
             bad.empty());
    }
    cp_emu::set_schedule(S::Lockstep);
    cp_emu::set_cp_async_landing(L::AtWait);
    ok = ring(2, false);
    expect("consumer reading a stage without waiting on its full mbarrier sees poison", ok && !ring_right());
    expect("producer first waiting on its empty mbarrier with parity 0 deadlocks (detected)", !ring(4, false));
    expect("setmaxnreg.inc over the block's register pool deadlocks (detected)", !ring(0, true));
    expect("a ping-pong hand-over nobody waits for (named barrier left mid-phase at exit) fails the launch", !ring(5, false));
    cp_emu::set_schedule(S::WarpsAscending);
    cp_emu::set_cp_async_landing(L::AtIssue);
    ok = ring(3, false);
    expect("producer refilling a stage without waiting on its empty mbarrier overwrites it (warps-asc/at-issue)",
           !ok || !ring_right());
    ok = ring(2, false);  // the producer (warpgroup 0) pauses at each arrival: consumers run ahead
    expect("consumer reading a stage without waiting on its full mbarrier is caught (warps-asc/at-issue)",
           !ok || !ring_right());
    cp_emu::set_schedule(S::WarpsDescending);
    ok = ring(3, false);  // the consumers pause at each arrival: the producer runs ahead
    expect("producer refilling a stage without waiting on its empty mbarrier overwrites it (warps-desc/at-issue)",
           !ok || !ring_right());
    Buf<__half> bh(16 * 64);
    Buf<float> dw(128 * 32);
    for (int i = 0; i < 16 * 64; ++i) bh.p[i] = __float2half((float)((i * 7) % 5));
    auto wg_right = [&] {
      for (int tid = 0; tid < 128; ++tid)
        for (int i = 0; i < 32; ++i) {
          const int n = 8 * (i / 4) + 2 * (tid % 4) + (i % 2);
          float want = 0.f;
          for (int k = 0; k < 16; ++k) want += (float)((k * 64 + n) * 7 % 5);
          if (dw.p[32 * tid + i] != want) return false;
        }
      return true;
    };
    const size_t wsm = 16 * 128 + 1024 + 16;
    for (auto& sl : {std::make_pair(S::Lockstep, L::AtWait), std::make_pair(S::WarpsAscending, L::AtIssue),
                     std::make_pair(S::Random, L::Random)}) {
      cp_emu::set_schedule(sl.first, 3);
      cp_emu::set_cp_async_landing(sl.second, 3);
      cp_emu::set_wgmma_at_issue(sl.first == S::WarpsAscending);
      const std::string m = sl.first == S::Lockstep ? " (lockstep/at-wait)" : sl.first == S::Random ? " (random:3/random:3)"
                                                                                                 : " (warps-asc/at-issue)";
      ok = cp_emu::launch("st_mbar_wgmma", dim3(1), dim3(256), wsm, [&] { st_mbar_wgmma(bh.p, dw.p, 0); });
      expect("wgmma after mbarrier wait + consumer fence.proxy.async (control)" + m, ok && wg_right());
      ok = cp_emu::launch("st_mbar_wgmma", dim3(1), dim3(256), wsm, [&] { st_mbar_wgmma(bh.p, dw.p, 1); });
      expect("wgmma after producer wait_group + fence.proxy.async + mbarrier arrive (control)" + m, ok && wg_right());
      expect("wgmma on cp.async data handed over by an mbarrier without any fence.proxy.async fails the launch" + m,
             !cp_emu::launch("st_mbar_wgmma", dim3(1), dim3(256), wsm, [&] { st_mbar_wgmma(bh.p, dw.p, 2); }));
    }
    cp_emu::set_schedule(S::Lockstep);
    cp_emu::set_cp_async_landing(L::AtWait);
    cp_emu::set_wgmma_at_issue(sched0 == cp_emu::Schedule::WarpsAscending);
    const char* nb[] = {"named barrier count mismatch fails the launch", "named barrier completed by partial warps fails the launch",
                        "setmaxnreg by a partial warpgroup fails the launch", "named barrier id 16 fails the launch"};
    for (int mode = 0; mode < 4; ++mode)
      expect(nb[mode], !cp_emu::launch("st_nbar", dim3(1), dim3(128), 0, [&] { st_nbar(out.p, mode); }));
    expect("bar.arrive / bar.sync split between warps, setmaxnreg by the whole warpgroup (control)",
           cp_emu::launch("st_nbar", dim3(1), dim3(128), 0, [&] { st_nbar(out.p, 4); }));
    const char* mb[] = {"wait on an uninitialised mbarrier fails the launch",
                        "mbarrier arrival before the __syncthreads publishing its init fails the launch",
                        "plain store into an mbarrier's 8 bytes fails the launch"};
    for (int mode = 5; mode < 8; ++mode)
      expect(mb[mode - 5], !cp_emu::launch("st_nbar", dim3(1), dim3(128), 64, [&] { st_nbar(out.p, mode); }));
    expect("mbarrier init, __syncthreads, 128 arrivals, wait for parity 0 (control)",
           cp_emu::launch("st_nbar", dim3(1), dim3(128), 64, [&] { st_nbar(out.p, 8); }));
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
