// Sequence layout kernels: zigzag / striped shard and unshard, and the all-to-all pack/unpack.
// Rust caller: candle_cp_kernels::layout::{seq_permute, a2a_pack, a2a_unpack} (src/layout.rs),
//   CUDA path for the sharding layouts of candle_cp_ops::cp and the Ulysses all-to-all.
// CPU reference: the candle index_select / narrow+cat formulations in candle_cp_ops::cp (layouts)
//   and candle_cp_comm's ThreadGroup::all_to_all (chunk/concat), checked in examples/gpu_check.rs.
//
// seq_permute: dst [A, Nd, E] <- src [A, Ns, E] row by row along the middle (sequence) dim.
//   mode 0, zigzag shard:    dst = rank r's rows; sequence of length L split in 2P chunks of
//                            c = L / (2P); rank r holds chunks r and 2P-1-r (Nd = L / P).
//   mode 1, striped shard:   dst row i = global row i * P + r (Nd = L / P).
//   mode 2, zigzag unshard:  src = the P shards concatenated in rank order (Ns = L), dst = global.
//   mode 3, striped unshard: same for the striped layout.
// a2a_pack:   dst [P, A, M] <- src [A, P, M]  (chunk p of the split dim goes first: send buffer)
// a2a_unpack: dst [A, P, M] <- src [P, A, M]  (received chunks concatenated along the concat dim)
#include "common.cuh"

__device__ __forceinline__ long long seq_src_row(int mode, long long i, long long L, long long P, long long r) {
  long long n = L / P, c = L / (2 * P);
  switch (mode) {
    case 0: return i < c ? r * c + i : (2 * P - 1 - r) * c + (i - c);
    case 1: return i * P + r;
    case 2: {
      long long chunk = i / c, off = i % c;
      long long rank = chunk < P ? chunk : 2 * P - 1 - chunk;
      long long local = chunk < P ? off : c + off;
      return rank * n + local;
    }
    default: return (i % P) * n + i / P;
  }
}

template <typename T>
__device__ __forceinline__ void seq_permute(const T* src, T* dst, int mode, long long A, long long Ns,
                                            long long Nd, long long E, long long L, long long P, long long r) {
  size_t n = (size_t)A * Nd * E;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
    long long x = e % E, rest = e / E, i = rest % Nd, a = rest / Nd;
    long long si = seq_src_row(mode, i, L, P, r);
    dst[e] = src[((size_t)a * Ns + si) * E + x];
  }
}

// dst[i1][i0][m] = src[i0][i1][m] for src [N0, N1, M].
template <typename T>
__device__ __forceinline__ void swap01(const T* src, T* dst, long long N0, long long N1, long long M) {
  size_t n = (size_t)N0 * N1 * M;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
    long long m = e % M, rest = e / M, i0 = rest % N0, i1 = rest / N0;
    dst[e] = src[((size_t)i0 * N1 + i1) * M + m];
  }
}

// Launch: grid-stride, any grid; block 256.
#define LAYOUT_ENTRIES(NAME, TY)                                                                          \
  extern "C" __global__ void seq_permute_##NAME(const TY* src, TY* dst, int mode, long long A, long long Ns, \
                                                long long Nd, long long E, long long L, long long P,      \
                                                long long r) {                                            \
    seq_permute<TY>(src, dst, mode, A, Ns, Nd, E, L, P, r);                                               \
  }                                                                                                       \
  extern "C" __global__ void a2a_pack_##NAME(const TY* src, TY* dst, long long A, long long P, long long M) { \
    swap01<TY>(src, dst, A, P, M);                                                                        \
  }                                                                                                       \
  extern "C" __global__ void a2a_unpack_##NAME(const TY* src, TY* dst, long long A, long long P, long long M) { \
    swap01<TY>(src, dst, P, A, M);                                                                        \
  }
LAYOUT_ENTRIES(f32, float)
LAYOUT_ENTRIES(f16, __half)
LAYOUT_ENTRIES(bf16, __nv_bfloat16)
LAYOUT_ENTRIES(u32, unsigned int)
LAYOUT_ENTRIES(u8, unsigned char)
