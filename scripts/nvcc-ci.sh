#!/usr/bin/env bash
# nvcc for the CI's compile check only: scripts/ci-cuda.sh points NVCC at a copy of this in a
# toolkit-shaped folder (bin/nvcc, include/ and lib64/ linked to the real toolkit's).
#
# candle-kernels' static library of quantized-matmul kernels (llama.cpp's MMQ and MMVQ and the
# MoE kernels: its src/mmq_gguf/, src/mmvq_gguf.cu, src/moe/) is compiled to unoptimised PTX
# (`-Xcicc -O0`, `code=compute_XX`) instead of optimised `sm_XX` machine code: about 11 s per
# file instead of 67 on the CI's 2 cores, 8 of the 15 minutes the cuda build took. Nothing in
# candle-cp calls those kernels, and the host CUDA shim runs kernels from their source, not from
# this library; the library still compiles and links. Every other compile (candle's PTX, and
# ours: candle-cp-kernels/build.rs) passes through unchanged. scripts/gpu-check.sh, which builds
# the binaries a GPU runs, does not use this.
#
# Env: CANDLE_CP_REAL_NVCC (the real nvcc, required).
set -euo pipefail
real=${CANDLE_CP_REAL_NVCC:?CANDLE_CP_REAL_NVCC must name the real nvcc}
quick=0
if [ "${CARGO_PKG_NAME:-}" = candle-kernels ]; then
  for a in "$@"; do
    case "$a" in
      src/mmq_gguf/*.cu | */src/mmq_gguf/*.cu | src/mmvq_gguf.cu | */src/mmvq_gguf.cu | src/moe/*.cu | */src/moe/*.cu) quick=1 ;;
    esac
  done
fi
if [ "$quick" = 0 ]; then
  exec "$real" "$@"
fi
args=()
for a in "$@"; do
  case "$a" in
    -gencode=arch=compute_*,code=sm_*)
      arch=${a#-gencode=arch=}
      arch=${arch%%,*}
      a="-gencode=arch=$arch,code=$arch"
      ;;
  esac
  args+=("$a")
done
exec "$real" "${args[@]}" -Xcicc -O0
