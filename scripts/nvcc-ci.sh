#!/usr/bin/env bash
# nvcc for the CI's compile check only: scripts/ci-cuda.sh points NVCC at a copy of this in a
# toolkit-shaped folder (bin/nvcc, include/ and lib64/ linked to the real toolkit's).
#
# Everything candle-kernels compiles (its PTX modules, and its static library of quantized-matmul
# kernels: llama.cpp's MMQ and MMVQ and the MoE kernels) becomes unoptimised PTX (`-Xcicc -O0`,
# `code=compute_XX` for `code=sm_XX`): its library took about 11 s per file instead of 67 on
# the CI's 2 cores, 8 of the 15 minutes the cuda build took, and its quantized.ptx 3 s instead
# of 38 (on the path to candle-core: candle-core compiles after candle-kernels' build script).
# Nothing in the CI runs candle's PTX or that library: the host CUDA shim runs kernels from
# their source, looked up by name; everything still compiles, and the binaries still link.
# Every other compile (ours: candle-cp-kernels/build.rs, at -O3, which ptxas checks) passes
# through unchanged. scripts/gpu-check.sh, which builds the binaries a GPU runs, does not use
# this. (The host side stays at the build's -O3: at -O0 the library's objects reference cudart's
# __cudaInitModule, which the host CUDA shim does not provide, and the binaries fail to load.)
#
# Env: CANDLE_CP_REAL_NVCC (the real nvcc, required).
set -euo pipefail
real=${CANDLE_CP_REAL_NVCC:?CANDLE_CP_REAL_NVCC must name the real nvcc}
quick=0
if [ "${CARGO_PKG_NAME:-}" = candle-kernels ]; then
  # (compiles only: its `--version`, `--list-gpu-code` and `--lib` calls pass through)
  for a in "$@"; do
    case "$a" in *.cu) quick=1 ;; esac
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
