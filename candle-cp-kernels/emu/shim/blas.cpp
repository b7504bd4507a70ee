// libcublas stand-in of the host CUDA shim (shim.h): the GEMM entry points candle 0.11.1's CUDA
// backend and cudarc 0.19.10's safe wrappers call, computed with plain CPU loops.
//
// ABI: the declarations below mirror cudarc-0.19.10/src/cublas/sys/mod.rs (no cuBLAS header is
// used). Enums are passed as 32-bit integers (Rust `#[repr(u32)]` / `#[repr(i32)]`); every status
// returned is a value of cudarc's `cublasStatus_t` (another value would be undefined behaviour
// on the Rust side).
//
// Semantics (exactly cuBLAS's, column-major):
//   C_b = alpha * op(A_b) * op(B_b) + beta * C_b   for b in [0, batchCount),
//   op(A) is m x k, op(B) is k x n, C is m x n; X_b = X + b * strideX (elements, any sign);
//   op = N (as stored), T or C (transposed; C == T for real types).
// - alpha/beta are read through host pointers (the shim's device pointers are host addresses too,
//   so CUBLAS_POINTER_MODE_DEVICE works the same) as the compute type's scalar: float for
//   CUBLAS_COMPUTE_32F (+ _PEDANTIC, _FAST_16F, _FAST_16BF, _FAST_TF32), double for 64F, half for
//   16F. The typed entries (S/D/Hgemm) read float/double/half.
// - Products are accumulated in float (double for 64F; also float for COMPUTE_16F, which real
//   cuBLAS accumulates in half: the shim is more accurate there, never less). Operands are
//   converted to the accumulator type once per GEMM; the result is rounded once into Ctype.
// - beta == 0: C is not read (it may hold NaN garbage). alpha == 0 or k == 0: A and B are not
//   read and C = beta * C. m == 0, n == 0 or batchCount == 0: nothing is touched.
// - Arguments are validated like cuBLAS (negative sizes, lda/ldb/ldc smaller than the stored row
//   count, bad transpose op -> CUBLAS_STATUS_INVALID_VALUE; unsupported type combinations ->
//   CUBLAS_STATUS_NOT_SUPPORTED); every rejection is logged with its reason via cp_shim::log.
// - Stream order: before touching memory, the call drains the handle's stream
//   (cp_shim::stream_drain), then computes eagerly in the calling thread.
// Set CPEMU_BLAS_TRACE=1 to log every GEMM's arguments.
#include "half.h"
#include "shim.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

struct CUstream_st;
typedef CUstream_st* cudaStream_t;

extern "C" {

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16,
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2, CUBLAS_OP_CONJG = 3 } cublasOperation_t;

typedef enum {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_16BF = 14,
} cudaDataType;  // only the real types the shim implements; other values are rejected

typedef enum {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_64F_PEDANTIC = 71,
  CUBLAS_COMPUTE_32I = 72,
  CUBLAS_COMPUTE_32I_PEDANTIC = 73,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
} cublasComputeType_t;

typedef int cublasGemmAlgo_t;  // any value accepted (CUBLAS_GEMM_DEFAULT = -1, ..._TENSOR_OP = 99)
typedef int cublasMath_t;
typedef enum { CUBLAS_POINTER_MODE_HOST = 0, CUBLAS_POINTER_MODE_DEVICE = 1 } cublasPointerMode_t;

struct cublasContext;
typedef cublasContext* cublasHandle_t;
typedef uint16_t cp_half;  // IEEE binary16 bits (__half)

}  // extern "C"

struct cublasContext {
  uint64_t magic;
  cudaStream_t stream;
  cublasMath_t math_mode;
  cublasPointerMode_t pointer_mode;
  void* workspace;
  size_t workspace_bytes;
};

namespace {

using cp_shim::bf16_to_float;
using cp_shim::f16_to_float;
using cp_shim::float_to_bf16;
using cp_shim::float_to_f16;

constexpr uint64_t kMagic = 0x63707368696d424cull;  // "cpshimBL"

bool trace_on() {
  static const bool on = [] {
    const char* v = std::getenv("CPEMU_BLAS_TRACE");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return on;
}

bool valid(cublasHandle_t h) { return h != nullptr && h->magic == kMagic; }

// ---- element access by data type ------------------------------------------------------------
size_t type_size(int t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_64F: return 8;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    default: return 0;
  }
}

const char* type_name(int t) {
  switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_64F: return "CUDA_R_64F";
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    default: return "unsupported";
  }
}

template <class Acc>
inline Acc load(const void* p, int t, long long i) {
  switch (t) {
    case CUDA_R_32F: return Acc(static_cast<const float*>(p)[i]);
    case CUDA_R_64F: return Acc(static_cast<const double*>(p)[i]);
    case CUDA_R_16F: return Acc(f16_to_float(static_cast<const uint16_t*>(p)[i]));
    default: return Acc(bf16_to_float(static_cast<const uint16_t*>(p)[i]));
  }
}

template <class Acc>
inline void store(void* p, int t, long long i, Acc v) {
  switch (t) {
    case CUDA_R_32F: static_cast<float*>(p)[i] = float(v); break;
    case CUDA_R_64F: static_cast<double*>(p)[i] = double(v); break;
    case CUDA_R_16F: static_cast<uint16_t*>(p)[i] = float_to_f16(float(v)); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_bf16(float(v)); break;
  }
}

// Packs op(X) (rows x cols, stored column-major with leading dimension ld, transposed when
// `trans`) into dst, column-major with leading dimension `rows`: dst[c * rows + r] = op(X)(r, c).
template <class Acc, class T, class Cvt>
void pack_typed(const T* x, bool trans, int rows, int cols, int ld, Acc* dst, Cvt cvt) {
  if (!trans) {
    for (int c = 0; c < cols; ++c) {
      const T* col = x + (long long)c * ld;
      Acc* d = dst + (size_t)c * rows;
      for (int r = 0; r < rows; ++r) d[r] = Acc(cvt(col[r]));
    }
  } else {  // op(X)(r, c) = X(c, r) = x[c + r * ld]: read rows of op(X) contiguously
    for (int r = 0; r < rows; ++r) {
      const T* src = x + (long long)r * ld;
      for (int c = 0; c < cols; ++c) dst[(size_t)c * rows + r] = Acc(cvt(src[c]));
    }
  }
}

template <class Acc>
void pack(const void* x, int t, bool trans, int rows, int cols, int ld, Acc* dst) {
  switch (t) {
    case CUDA_R_32F:
      pack_typed(static_cast<const float*>(x), trans, rows, cols, ld, dst, [](float v) { return v; });
      break;
    case CUDA_R_64F:
      pack_typed(static_cast<const double*>(x), trans, rows, cols, ld, dst, [](double v) { return v; });
      break;
    case CUDA_R_16F:
      pack_typed(static_cast<const uint16_t*>(x), trans, rows, cols, ld, dst, f16_to_float);
      break;
    default:
      pack_typed(static_cast<const uint16_t*>(x), trans, rows, cols, ld, dst, bf16_to_float);
      break;
  }
}

struct Gemm {
  const char* fn;
  int transa, transb, m, n, k;
  const void* A;
  int atype, lda;
  long long stride_a;
  const void* B;
  int btype, ldb;
  long long stride_b;
  void* C;
  int ctype, ldc;
  long long stride_c;
  int batch;
};

inline const void* offset(const void* p, long long elems, int t) {
  return static_cast<const char*>(p) + elems * (long long)type_size(t);
}

// Runs a validated GEMM with accumulator type Acc.
template <class Acc>
void run(const Gemm& g, Acc alpha, Acc beta) {
  const bool ta = g.transa != CUBLAS_OP_N, tb = g.transb != CUBLAS_OP_N;
  const int m = g.m, n = g.n, k = g.k;
  const bool use_ab = alpha != Acc(0) && k > 0;
  std::vector<Acc> a, b, acc((size_t)m);
  if (use_ab) {
    a.resize((size_t)m * k);
    b.resize((size_t)k * n);
  }
  for (int bi = 0; bi < g.batch; ++bi) {
    void* c = const_cast<void*>(offset(g.C, bi * g.stride_c, g.ctype));
    if (use_ab) {
      pack(offset(g.A, bi * g.stride_a, g.atype), g.atype, ta, m, k, g.lda, a.data());  // a[p*m+i]
      pack(offset(g.B, bi * g.stride_b, g.btype), g.btype, tb, k, n, g.ldb, b.data());  // b[j*k+p]
    }
    for (int j = 0; j < n; ++j) {
      const long long cj = (long long)j * g.ldc;
      Acc* __restrict__ s = acc.data();
      for (int i = 0; i < m; ++i) s[i] = Acc(0);
      if (use_ab) {
        const Acc* bj = b.data() + (size_t)j * k;
        for (int p = 0; p < k; ++p) {
          const Acc bv = bj[p];
          const Acc* __restrict__ ap = a.data() + (size_t)p * m;
          for (int i = 0; i < m; ++i) s[i] += ap[i] * bv;
        }
      }
      if (beta == Acc(0)) {
        for (int i = 0; i < m; ++i) store<Acc>(c, g.ctype, cj + i, alpha * s[i]);
      } else {
        for (int i = 0; i < m; ++i)
          store<Acc>(c, g.ctype, cj + i, alpha * s[i] + beta * load<Acc>(c, g.ctype, cj + i));
      }
    }
  }
}

const char* op_name(int op) {
  switch (op) {
    case CUBLAS_OP_N: return "N";
    case CUBLAS_OP_T: return "T";
    case CUBLAS_OP_C: return "C";
    default: return "?";
  }
}

// cuBLAS's argument checks; returns SUCCESS or the status to report (after logging why).
cublasStatus_t validate(cublasHandle_t h, const Gemm& g, const void* alpha, const void* beta) {
  if (!valid(h)) {
    cp_shim::log("%s: invalid cuBLAS handle %p -> CUBLAS_STATUS_NOT_INITIALIZED", g.fn, (void*)h);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  auto bad = [&](const char* why, long long a, long long b) {
    cp_shim::log("%s: %s (%lld vs %lld) -> CUBLAS_STATUS_INVALID_VALUE", g.fn, why, a, b);
    return CUBLAS_STATUS_INVALID_VALUE;
  };
  auto op_ok = [](int op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; };
  if (!op_ok(g.transa)) return bad("transa is not N, T or C", g.transa, 0);
  if (!op_ok(g.transb)) return bad("transb is not N, T or C", g.transb, 0);
  if (g.m < 0) return bad("m < 0", g.m, 0);
  if (g.n < 0) return bad("n < 0", g.n, 0);
  if (g.k < 0) return bad("k < 0", g.k, 0);
  if (g.batch < 0) return bad("batchCount < 0", g.batch, 0);
  const int rows_a = g.transa == CUBLAS_OP_N ? g.m : g.k;
  const int rows_b = g.transb == CUBLAS_OP_N ? g.k : g.n;
  if (g.lda < (rows_a > 1 ? rows_a : 1)) return bad("lda < max(1, rows of stored A)", g.lda, rows_a);
  if (g.ldb < (rows_b > 1 ? rows_b : 1)) return bad("ldb < max(1, rows of stored B)", g.ldb, rows_b);
  if (g.ldc < (g.m > 1 ? g.m : 1)) return bad("ldc < max(1, m)", g.ldc, g.m);
  if (alpha == nullptr || beta == nullptr) return bad("alpha or beta is a null pointer", 0, 0);
  const bool empty = g.m == 0 || g.n == 0 || g.batch == 0;
  if (!empty && g.C == nullptr) return bad("C is a null pointer", 0, 0);
  if (!empty && g.k > 0 && (g.A == nullptr || g.B == nullptr)) return bad("A or B is a null pointer", 0, 0);
  return CUBLAS_STATUS_SUCCESS;
}

// Type check, stream drain, dispatch on the compute type.
cublasStatus_t gemm(cublasHandle_t h, const Gemm& g, const void* alpha, const void* beta, int compute) {
  cublasStatus_t st = validate(h, g, alpha, beta);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (trace_on())
    cp_shim::log("%s: op=%s%s m=%d n=%d k=%d A=%s lda=%d sA=%lld B=%s ldb=%d sB=%lld C=%s ldc=%d sC=%lld batch=%d compute=%d",
                 g.fn, op_name(g.transa), op_name(g.transb), g.m, g.n, g.k, type_name(g.atype), g.lda,
                 g.stride_a, type_name(g.btype), g.ldb, g.stride_b, type_name(g.ctype), g.ldc, g.stride_c,
                 g.batch, compute);
  auto unsupported = [&](const char* why) {
    cp_shim::log("%s: unsupported combination Atype=%d(%s) Btype=%d(%s) Ctype=%d(%s) computeType=%d: %s -> CUBLAS_STATUS_NOT_SUPPORTED",
                 g.fn, g.atype, type_name(g.atype), g.btype, type_name(g.btype), g.ctype, type_name(g.ctype),
                 compute, why);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  };
  for (int t : {g.atype, g.btype, g.ctype})
    if (type_size(t) == 0) return unsupported("the shim implements CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF");
  if (g.atype != g.btype) return unsupported("Atype != Btype");
  enum { K16F, K32F, K64F } kind;
  switch (compute) {
    case CUBLAS_COMPUTE_16F:
    case CUBLAS_COMPUTE_16F_PEDANTIC: kind = K16F; break;
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32: kind = K32F; break;
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC: kind = K64F; break;
    default: return unsupported("computeType is not 16F, 32F (any variant) or 64F");
  }
  if (kind == K64F && (g.atype != CUDA_R_64F || g.ctype != CUDA_R_64F))
    return unsupported("CUBLAS_COMPUTE_64F needs A, B, C of CUDA_R_64F");
  if (kind != K64F && (g.atype == CUDA_R_64F || g.ctype == CUDA_R_64F))
    return unsupported("CUDA_R_64F data needs CUBLAS_COMPUTE_64F");
  if (kind == K16F && (g.atype != CUDA_R_16F || g.ctype != CUDA_R_16F))
    return unsupported("CUBLAS_COMPUTE_16F needs A, B, C of CUDA_R_16F");
  if (kind == K32F && g.ctype != g.atype && g.ctype != CUDA_R_32F)
    return unsupported("with CUBLAS_COMPUTE_32F, Ctype must equal Atype or be CUDA_R_32F");

  if (int rc = cp_shim::stream_drain(static_cast<void*>(h->stream)); rc != cp_shim::CU_OK) {
    cp_shim::log("%s: waiting for the pending work of stream %p failed (CUresult %d) -> CUBLAS_STATUS_EXECUTION_FAILED",
                 g.fn, (void*)h->stream, rc);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;
  try {
    switch (kind) {
      case K64F: run<double>(g, *static_cast<const double*>(alpha), *static_cast<const double*>(beta)); break;
      case K32F: run<float>(g, *static_cast<const float*>(alpha), *static_cast<const float*>(beta)); break;
      case K16F:
        run<float>(g, f16_to_float(*static_cast<const uint16_t*>(alpha)),
                   f16_to_float(*static_cast<const uint16_t*>(beta)));
        break;
    }
  } catch (const std::bad_alloc&) {
    cp_shim::log("%s: out of host memory for the operand buffers (m=%d n=%d k=%d) -> CUBLAS_STATUS_ALLOC_FAILED",
                 g.fn, g.m, g.n, g.k);
    return CUBLAS_STATUS_ALLOC_FAILED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

Gemm make(const char* fn, int ta, int tb, int m, int n, int k, const void* A, int at, int lda, long long sa,
          const void* B, int bt, int ldb, long long sb, void* C, int ct, int ldc, long long sc, int batch) {
  return Gemm{fn, ta, tb, m, n, k, A, at, lda, sa, B, bt, ldb, sb, C, ct, ldc, sc, batch};
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) {
    cp_shim::log("cublasCreate_v2: handle is a null pointer -> CUBLAS_STATUS_INVALID_VALUE");
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  auto* h = new (std::nothrow) cublasContext{kMagic, nullptr, 0, CUBLAS_POINTER_MODE_HOST, nullptr, 0};
  if (h == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (!valid(handle)) {
    cp_shim::log("cublasDestroy_v2: invalid cuBLAS handle %p -> CUBLAS_STATUS_NOT_INITIALIZED", (void*)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  handle->magic = 0;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (!valid(handle)) {
    cp_shim::log("cublasSetStream_v2: invalid cuBLAS handle %p -> CUBLAS_STATUS_NOT_INITIALIZED", (void*)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
  if (!valid(handle)) {
    cp_shim::log("cublasGetStream_v2: invalid cuBLAS handle %p -> CUBLAS_STATUS_NOT_INITIALIZED", (void*)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!valid(handle)) {
    cp_shim::log("cublasSetMathMode: invalid cuBLAS handle %p -> CUBLAS_STATUS_NOT_INITIALIZED", (void*)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  handle->math_mode = mode;  // recorded only: the shim always computes in full precision
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  if (!valid(handle)) {
    cp_shim::log("cublasSetWorkspace_v2: invalid cuBLAS handle %p -> CUBLAS_STATUS_NOT_INITIALIZED", (void*)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  handle->workspace = workspace;  // unused by the shim
  handle->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (!valid(handle)) {
    cp_shim::log("cublasSetPointerMode_v2: invalid cuBLAS handle %p -> CUBLAS_STATUS_NOT_INITIALIZED", (void*)handle);
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) {
    cp_shim::log("cublasSetPointerMode_v2: mode %d is not HOST or DEVICE -> CUBLAS_STATUS_INVALID_VALUE", (int)mode);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->pointer_mode = mode;  // both read alpha/beta through the pointer (host addresses)
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t /*algo*/) {
  return gemm(handle,
              make("cublasGemmStridedBatchedEx", transa, transb, m, n, k, A, Atype, lda, strideA, B, Btype, ldb,
                   strideB, C, Ctype, ldc, strideC, batchCount),
              alpha, beta, computeType);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t /*algo*/) {
  return gemm(handle,
              make("cublasGemmEx", transa, transb, m, n, k, A, Atype, lda, 0, B, Btype, ldb, 0, C, Ctype, ldc, 0, 1),
              alpha, beta, computeType);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const float* alpha, const float* A, int lda,
                                         long long strideA, const float* B, int ldb, long long strideB,
                                         const float* beta, float* C, int ldc, long long strideC, int batchCount) {
  return gemm(handle,
              make("cublasSgemmStridedBatched", transa, transb, m, n, k, A, CUDA_R_32F, lda, strideA, B, CUDA_R_32F,
                   ldb, strideB, C, CUDA_R_32F, ldc, strideC, batchCount),
              alpha, beta, CUBLAS_COMPUTE_32F);
}

cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const double* alpha, const double* A, int lda,
                                         long long strideA, const double* B, int ldb, long long strideB,
                                         const double* beta, double* C, int ldc, long long strideC, int batchCount) {
  return gemm(handle,
              make("cublasDgemmStridedBatched", transa, transb, m, n, k, A, CUDA_R_64F, lda, strideA, B, CUDA_R_64F,
                   ldb, strideB, C, CUDA_R_64F, ldc, strideC, batchCount),
              alpha, beta, CUBLAS_COMPUTE_64F);
}

cublasStatus_t cublasHgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const cp_half* alpha, const cp_half* A, int lda,
                                         long long strideA, const cp_half* B, int ldb, long long strideB,
                                         const cp_half* beta, cp_half* C, int ldc, long long strideC, int batchCount) {
  return gemm(handle,
              make("cublasHgemmStridedBatched", transa, transb, m, n, k, A, CUDA_R_16F, lda, strideA, B, CUDA_R_16F,
                   ldb, strideB, C, CUDA_R_16F, ldc, strideC, batchCount),
              alpha, beta, CUBLAS_COMPUTE_16F);
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
  return gemm(handle,
              make("cublasSgemm_v2", transa, transb, m, n, k, A, CUDA_R_32F, lda, 0, B, CUDA_R_32F, ldb, 0, C,
                   CUDA_R_32F, ldc, 0, 1),
              alpha, beta, CUBLAS_COMPUTE_32F);
}

cublasStatus_t cublasDgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const double* alpha, const double* A, int lda, const double* B, int ldb,
                              const double* beta, double* C, int ldc) {
  return gemm(handle,
              make("cublasDgemm_v2", transa, transb, m, n, k, A, CUDA_R_64F, lda, 0, B, CUDA_R_64F, ldb, 0, C,
                   CUDA_R_64F, ldc, 0, 1),
              alpha, beta, CUBLAS_COMPUTE_64F);
}

cublasStatus_t cublasHgemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                           int k, const cp_half* alpha, const cp_half* A, int lda, const cp_half* B, int ldb,
                           const cp_half* beta, cp_half* C, int ldc) {
  return gemm(handle,
              make("cublasHgemm", transa, transb, m, n, k, A, CUDA_R_16F, lda, 0, B, CUDA_R_16F, ldb, 0, C,
                   CUDA_R_16F, ldc, 0, 1),
              alpha, beta, CUBLAS_COMPUTE_16F);
}

}  // extern "C"
