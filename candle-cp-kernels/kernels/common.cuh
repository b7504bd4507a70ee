// Shared helpers for the candle-cp kernels: dtype conversions, warp reductions, tensor-core MMA.
// Included by every .cu file of candle-cp-kernels; not a kernel itself.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
// CP_HOST_EMU: the kernels compiled as host C++ by g++ and run on the CPU under the emulation in
// candle-cp-kernels/emu (emu.h); every inline asm below has a host implementation there.
#ifdef CP_HOST_EMU
#include "emu.h"
#endif

#define CP_FULL_MASK 0xffffffffu
#define CP_LOG2E 1.4426950408889634f
#define CP_LN2 0.6931471805599453f

// ---- dtype conversions --------------------------------------------------------------------
__device__ __forceinline__ float cp_to_f32(float x) { return x; }
__device__ __forceinline__ float cp_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float cp_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T cp_from_f32(float x);
template <> __device__ __forceinline__ float cp_from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half cp_from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 cp_from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats -> one 32-bit register holding two 16-bit values, the first in the low half
// (the element with the lower column index, as mma.sync expects).
template <typename T> __device__ __forceinline__ uint32_t cp_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t cp_pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;  // memcpy, not a uint32_t* into v (strict aliasing)
  memcpy(&u, static_cast<const void*>(&v), 4);
  return u;
}
template <> __device__ __forceinline__ uint32_t cp_pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;  // memcpy, not a uint32_t* into v (strict aliasing)
  memcpy(&u, static_cast<const void*>(&v), 4);
  return u;
}

// ---- warp reductions ------------------------------------------------------------------------
__device__ __forceinline__ float cp_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(CP_FULL_MASK, x, o);
  return x;
}
__device__ __forceinline__ float cp_warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(CP_FULL_MASK, x, o));
  return x;
}
// Reductions over the 4 lanes of an MMA quad (lanes 4g .. 4g+3 share a row).
__device__ __forceinline__ float cp_quad_sum(float x) {
  x += __shfl_xor_sync(CP_FULL_MASK, x, 1);
  x += __shfl_xor_sync(CP_FULL_MASK, x, 2);
  return x;
}
__device__ __forceinline__ float cp_quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(CP_FULL_MASK, x, 1));
  x = fmaxf(x, __shfl_xor_sync(CP_FULL_MASK, x, 2));
  return x;
}

// ---- masks ------------------------------------------------------------------------------------
// Mirror of `candle_cp_ops::attention::Mask`: query row i sits at global position
// q_off + i * q_str, key row j at k_off + j * k_str; causal means key pos <= query pos.
struct CpMask {
  int causal;
  long long q_off, q_str, k_off, k_str;
  __device__ __forceinline__ long long qpos(long long i) const { return q_off + i * q_str; }
  __device__ __forceinline__ long long kpos(long long j) const { return k_off + j * k_str; }
  __device__ __forceinline__ bool visible(long long i, long long j) const {
    return !causal || kpos(j) <= qpos(i);
  }
  // Number of leading keys (of s) that any query at position <= qp_max can see.
  __device__ __forceinline__ int key_end(long long qp_max, int s) const {
    if (!causal) return s;
    if (qp_max < k_off) return 0;
    long long n = (qp_max - k_off) / k_str + 1;
    return n < (long long)s ? (int)n : s;
  }
  // First query row (of t) whose position is >= kp_min (rows before it see no key at >= kp_min).
  __device__ __forceinline__ int query_begin(long long kp_min, int t) const {
    if (!causal || kp_min <= q_off) return 0;
    long long n = (kp_min - q_off + q_str - 1) / q_str;
    return n < (long long)t ? (int)n : t;
  }
  // The band interface of the kernels templated on the mask type (CpBand below; for CpMask these
  // are the expressions above, so a CpMask instantiation compiles to the same code as before).
  static constexpr bool BAND = false;
  __device__ __forceinline__ int kbegin(int) const { return 0; }
  __device__ __forceinline__ int kend(int i, int s) const { return key_end(qpos(i), s); }
  // (CpBand's tile test; the kernels use it only where M::BAND)
  __device__ __forceinline__ bool tile_partial(int, int, int, int, int) const { return true; }
  __device__ __forceinline__ int qbegin(int k0, int t) const { return query_begin(kpos(k0), t); }
  __device__ __forceinline__ int qend(int, int t) const { return t; }
};

// Mirror of `candle_cp_ops::attention::Band` for one batch row: query row i sees the key rows
// lo[i] <= j < hi[i] (local indices), both bounds non-decreasing in i, lo <= hi <= S. Built by the
// `*_band_*` entry points from band_lo / band_hi [batch, T] u32 and band_bstride (0: one band shared
// by every batch row, else T): lo = band_lo + blockIdx.z * band_bstride (blockIdx.z = batch row).
// Callers keep i < T (rows past T are clamped to T - 1 before a lookup).
struct CpBand {
  const unsigned int* lo;
  const unsigned int* hi;
  static constexpr bool BAND = true;
  // Stand-ins for CpMask's position members, so that code written for both types compiles (the
  // kernels use them only where !M::BAND).
  static constexpr int causal = 0;
  __device__ __forceinline__ long long qpos(long long) const { return 0; }
  __device__ __forceinline__ long long kpos(long long) const { return 0; }
  __device__ __forceinline__ int kbegin(int i) const { return (int)lo[i]; }
  __device__ __forceinline__ int kend(int i, int) const { return (int)hi[i]; }
  __device__ __forceinline__ bool visible(long long i, long long j) const {
    return (long long)lo[i] <= j && j < (long long)hi[i];
  }
  // First row (of t) with hi > k0: the rows before it see no key >= k0 (binary search).
  __device__ __forceinline__ int qbegin(int k0, int t) const {
    int a = 0, b = t;
    while (a < b) {
      const int m = (a + b) >> 1;
      if ((int)hi[m] > k0) b = m; else a = m + 1;
    }
    return a;
  }
  // Does some row of [i0, i1) (i0 < i1 <= t) not see all of the keys [k0, min(k1, S))? (Then a
  // tile of those rows against those keys needs the per-element test.)
  __device__ __forceinline__ bool tile_partial(int i0, int i1, int k0, int k1, int S) const {
    return (int)lo[i1 - 1] > k0 || (int)hi[i0] < min(k1, S);
  }
  // First row (of t) with lo >= k1: it and the rows after it see no key < k1.
  __device__ __forceinline__ int qend(int k1, int t) const {
    int a = 0, b = t;
    while (a < b) {
      const int m = (a + b) >> 1;
      if ((int)lo[m] >= k1) b = m; else a = m + 1;
    }
    return a;
  }
};
#define CP_BAND_ARGS const unsigned int *band_lo, const unsigned int *band_hi, long long band_bstride
#define CP_BAND_OF_BLOCK \
  CpBand{band_lo + (long long)blockIdx.z * band_bstride, band_hi + (long long)blockIdx.z * band_bstride}

// ---- tensor cores -----------------------------------------------------------------------------
// D = A * B + D for one m16n8k16 tile, f32 accumulate. Fragment layout (g = lane / 4, t = lane % 4):
//   a[0]: A[g][2t..2t+1]  a[1]: A[g+8][2t..2t+1]  a[2]: A[g][2t+8..]  a[3]: A[g+8][2t+8..]
//   b[0]: B[2t..2t+1][g]  b[1]: B[2t+8..2t+9][g]
//   d[0], d[1]: D[g][2t], D[g][2t+1]   d[2], d[3]: D[g+8][2t], D[g+8][2t+1]
template <typename T> __device__ __forceinline__ void cp_mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void cp_mma16816<__nv_bfloat16>(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
#ifdef CP_HOST_EMU
  cp_emu::warp_mma16816(true, d, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <> __device__ __forceinline__ void cp_mma16816<__half>(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
#ifdef CP_HOST_EMU
  cp_emu::warp_mma16816(false, d, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// tanh(x) = 1 - 2 / (e^{2x} + 1) with the fast exp: few registers (the pipelined forward's soft
// cap at 255 of them); absolute error ~1e-7 (saturates to +-1 exactly: e^{2x} -> inf or 0).
__device__ __forceinline__ float cp_tanh_fast(float x) { return 1.f - 2.f / (__expf(2.f * x) + 1.f); }

// ---- asynchronous copies, ldmatrix, fast exp2 (sm_80+) ----------------------------------------
// Shared-memory address (32-bit, .shared window) of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t cp_smem_u32(const void* p) {
#ifdef CP_HOST_EMU
  return cp_emu::smem_addr(p);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}
// 16-byte global -> shared copy that bypasses L1 (cp.async.cg). `valid == false` reads nothing
// and fills the 16 destination bytes with zeros (src-size 0); `src` must still be a mapped address.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
#ifdef CP_HOST_EMU
  cp_emu::cp_async16(dst, src, valid);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef CP_HOST_EMU
  cp_emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most N of this thread's committed groups are still in flight. Other threads'
// copies become visible only after a __syncthreads() that follows the wait.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#ifdef CP_HOST_EMU
  cp_emu::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// ldmatrix .x4: lanes 8i .. 8i+7 give the (16-byte) row addresses of 8x8 matrix i; register i of
// lane l receives row l/4, elements 2(l%4), 2(l%4)+1 of matrix i (of its transpose with _trans).
__device__ __forceinline__ void cp_ldsm_x4(uint32_t* r, uint32_t addr) {
#ifdef CP_HOST_EMU
  cp_emu::warp_ldsm_x4(false, r, addr);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_ldsm_x4_trans(uint32_t* r, uint32_t addr) {
#ifdef CP_HOST_EMU
  cp_emu::warp_ldsm_x4(true, r, addr);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}
// Shared-memory store of a layout meant to be free of bank conflicts: V has 2, 4 or 8 bytes, `p` is a
// generic pointer into shared memory, aligned to sizeof(V). Every lane of the warp makes the call
// (warp-uniform, not predicated). On the GPU a plain store. Under CP_HOST_EMU a warp op that fails
// the launch when a phase of the warp's request (all 32 lanes for 2- and 4-byte stores, each
// half-warp for 8-byte ones) puts two different 32-bit words in one bank, so the layout is checked
// wherever the emulator runs the kernel.
template <typename V> __device__ __forceinline__ void cp_sts_cf(void* p, V v) {
  static_assert(sizeof(V) == 2 || sizeof(V) == 4 || sizeof(V) == 8, "2, 4 or 8 bytes");
#ifdef CP_HOST_EMU
  uint32_t w[2] = {0u, 0u};
  memcpy(w, static_cast<const void*>(&v), sizeof(V));
  cp_emu::warp_sts(cp_emu::smem_addr(p), w, (int)sizeof(V));
#else
  *reinterpret_cast<V*>(p) = v;
#endif
}
// 2^x on the SFU (ex2.approx.ftz: max relative error ~2^-22; 2^-inf = +0).
__device__ __forceinline__ float cp_exp2(float x) {
#ifdef CP_HOST_EMU
  // .ftz: a subnormal input counts as 0 (2^0 = 1), a subnormal result flushes to +0.
  if (std::fabs(x) < 1.17549435e-38f) x = 0.f;
  float y = exp2f(x);
  return y < 1.17549435e-38f ? 0.f : y;
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// %ctaid.x / %nctaid.x read with volatile asm: the compiler cannot keep them live (or spilled)
// across a loop; it re-reads the special registers where they are needed.
__device__ __forceinline__ unsigned cp_ctaid_x() {
#ifdef CP_HOST_EMU
  return blockIdx.x;
#else
  unsigned r;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(r));
  return r;
#endif
}
__device__ __forceinline__ unsigned cp_nctaid_x() {
#ifdef CP_HOST_EMU
  return gridDim.x;
#else
  unsigned r;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(r));
  return r;
#endif
}

// Dynamic shared memory: `extern __shared__` under nvcc; the emulator's per-block buffer (poisoned
// with 0xFF before every block) on the host.
// CP_DYN_SMEM_A: the same with an explicit alignment (the emulator's shared window starts at 0).
#ifdef CP_HOST_EMU
#define CP_DYN_SMEM_A(TYPE, NAME, ALIGN) TYPE* NAME = reinterpret_cast<TYPE*>(cp_emu::dyn_smem())
#else
#define CP_DYN_SMEM_A(TYPE, NAME, ALIGN) extern __shared__ __align__(ALIGN) TYPE NAME[]
#endif
#define CP_DYN_SMEM(TYPE, NAME) CP_DYN_SMEM_A(TYPE, NAME, 16)
// Static __shared__ arrays of a kernel, named right after their declaration: the emulator fills
// them with 0xFF bytes (NaN) once per block, so a read of a never-written element shows; nothing
// under nvcc.
#ifdef CP_HOST_EMU
#define CP_EMU_POISON(...) cp_emu::poison_shared(__VA_ARGS__)
#else
#define CP_EMU_POISON(...)
#endif

// Shared memory of the CUDA-core kernels (flash_fwd.cu `fwd_simple`, flash_bwd.cu `bwd_dkdv` /
// `bwd_dq`): N floats. A static array while it fits the 48 KiB a block may declare statically
// (head dims up to 128); above that (head dim 256: about 82 KB) the launch's dynamic shared
// memory, which the Rust launcher sizes to N * 4 bytes (src/flash/core.rs `core_smem` mirrors
// the sizes; the emulator fails the launch when it is smaller).
#define CP_CORE_STATIC_SMEM (48 * 1024)
template <int N>
__device__ __forceinline__ float* cp_core_smem() {
  if constexpr ((size_t)N * 4 <= CP_CORE_STATIC_SMEM) {
    __shared__ __align__(16) float cp_core_static[N];
    CP_EMU_POISON(cp_core_static);
    return cp_core_static;
  } else {
#ifdef CP_HOST_EMU
    return reinterpret_cast<float*>(cp_emu::smem_ptr(0, (uint32_t)N * 4));
#else
    extern __shared__ __align__(16) float cp_core_dyn[];
    return cp_core_dyn;
#endif
  }
}

// *p += v on a global f32, atomically, without returning the old value (red.global.add.f32:
// the SM does not wait for the L2's reply). The order in which concurrent additions land is unspecified
// (f32 sums are then nondeterministic in their last bits). Host emulation: every CUDA thread of
// a launch runs on one OS thread (fibers, one block at a time), so a plain add is atomic there.
__device__ __forceinline__ void cp_red_add_f32(float* p, float v) {
#ifdef CP_HOST_EMU
  *p += v;
#else
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(v) : "memory");
#endif
}

// ---- forward destination (every flash forward entry: flash_fwd.cu, flash_fwd_sm90{,_ws}.cu) -------
// Where a forward writes (the entries' o_T, o_row0, o_merge): row i of the call is row o_row0 + i
// of out f32 [B, o_T, H, D] / lse f32 [B, H, o_T] (a plain call: o_T = T, o_row0 = 0). o_merge:
// fold the result into what the row holds through the log-sum-exp instead of overwriting it (the
// ring's running state: Rust caller src/flash/fold.rs; CPU reference: merge.cu's merge_rows and
// candle_cp_ops::cp::state::LocalState, the same formula), which saves the f32 partial result's
// write and read of a separate merge pass.
struct CpFwdDst {
  float* out;
  float* lse;
  int T, row0, merge;
  __device__ __forceinline__ float* out_row(int b, int i, int h, int H, int D) const {
    return out + (((size_t)b * T + row0 + i) * H + h) * D;
  }
  __device__ __forceinline__ float* lse_at(int b, int h, int H, int i) const { return lse + ((size_t)b * H + h) * T + row0 + i; }
};

// One row's fold: out <- wa * out_old + wb * out_new, lse <- lse (merge.cu's merge_rows: -inf
// safe, a row that saw no key on either side stays 0 / -inf). Without merge: wa = 0, wb = 1.
struct CpFold {
  float wa, wb, lse;
};
__device__ __forceinline__ CpFold cp_fold(bool merge, float old_lse, float new_lse) {
  if (!merge) return CpFold{0.f, 1.f, new_lse};
  const float mx = fmaxf(old_lse, new_lse);
  if (mx == -INFINITY) return CpFold{0.f, 0.f, -INFINITY};
  const float ea = __expf(old_lse - mx), eb = __expf(new_lse - mx), sum = ea + eb;
  return CpFold{ea / sum, eb / sum, mx + __logf(sum)};
}
// The stored value of one output element: the normalized `x` (merge: folded into `*p`).
__device__ __forceinline__ float cp_fold_val(bool merge, const CpFold& f, const float* p, float x) {
  return merge ? f.wa * *p + f.wb * x : x;
}

// The epilogue of the tensor-core forwards (mma, pipe, the Hopper kernels): rows ra and ra + 8 of
// a quad's C fragments; val(i, e) is element e of column pair i (e 0, 1: row ra, cols 8i + 2t, +1;
// e 2, 3: row ra + 8), normalized by inv_a / inv_b, stored or folded (CpFwdDst) with the rows'
// lse. Rows >= T_ are not written. One row at a time (fewer live registers: the pipelined d128
// kernels sit at 255).
template <int NI, typename F>
__device__ __forceinline__ void cp_fwd_store_quad(const CpFwdDst& dst, F val, float inv_a, float inv_b, float lse_a,
                                                  float lse_b, int b, int h, int H, int D, int ra, int T_, int t) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = ra + 8 * half;
    const bool valid = r < T_;
    const float inv = half ? inv_b : inv_a;
    float* lp = dst.lse_at(b, h, H, r);
    const CpFold f = cp_fold(dst.merge, dst.merge && valid ? *lp : -INFINITY, half ? lse_b : lse_a);
    float* orow = dst.out_row(b, r, h, H, D) + 2 * t;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      if (!valid) continue;
      float2* p = reinterpret_cast<float2*>(orow + i * 8);
      const float2 x = dst.merge ? *p : make_float2(0.f, 0.f);
      *p = make_float2(cp_fold_val(dst.merge, f, &x.x, val(i, 2 * half) * inv),
                       cp_fold_val(dst.merge, f, &x.y, val(i, 2 * half + 1) * inv));
    }
    if (dst.merge) __syncwarp();  // the quad's 4 lanes read the old lse before lane t = 0 replaces it
    if (t == 0 && valid) *lp = f.lse;
  }
}

