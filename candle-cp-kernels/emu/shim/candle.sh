# Bash fragment (source it; needs CUDA_ROOT, e.g. from ../shared/cuda/env.sh): which of candle's
# own CUDA kernel sources (candle-kernels 0.11.1, compiled in place from the cargo registry,
# unmodified) the host CUDA shim builds, and the extra g++ flags they need for the PREPROCESSING
# step (`g++ $common "${candle_flags[@]}" -x c++ -E FILE`). The compile step of the preprocessed
# file needs nothing extra: candle_compat.h is inlined by then, and its warning pragmas with it.
# Defines: candle_dir (the crate's src/), candle_srcs (full paths), candle_flags.
# Left out: conv.cu, quantized.cu, mmvq_gguf.cu, moe/, mmq_gguf/ (not needed by candle-cp).
_candle_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
candle_dir=
for _d in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-kernels-0.11.1/src; do
  [ -f "$_d/reduce.cu" ] && candle_dir=$_d
done
unset _d
if [ -z "$candle_dir" ]; then
  echo "candle.sh: candle-kernels-0.11.1 not found under ${CARGO_HOME:-$HOME/.cargo}/registry/src (run cargo fetch)" >&2
  return 1 2>/dev/null || exit 1
fi
if [ -z "${CUDA_ROOT:-}" ] || [ ! -d "$CUDA_ROOT/include/cccl" ]; then
  echo "candle.sh: CUDA_ROOT ('${CUDA_ROOT:-}') has no include/cccl (reduce.cu needs <cuda/std/limits>)" >&2
  return 1 2>/dev/null || exit 1
fi
candle_srcs=()
for _f in affine binary cast fill indexing reduce sort ternary unary; do candle_srcs+=("$candle_dir/$_f.cu"); done
unset _f
# -include: the compat header (host CUDA headers first, then __CUDA_ARCH__=800, device-function
# stand-ins; see its head comment). cccl: <cuda/std/limits> (reduce.cu).
candle_flags=(-include "$_candle_here/candle_compat.h" -I"$CUDA_ROOT/include/cccl")
unset _candle_here
