#!/usr/bin/env bash
# Builds the host CUDA shim: one shared library (libcpemu.so) holding the emulator, our kernels
# (kernels/*.cu) and candle's kernels compiled as host C++, a libcuda / libcudart driver stand-in,
# cuBLAS / cuRAND / NCCL stand-ins; plus the symlinks a `--features cuda` binary loads
# (libcuda.so.1, libcudart.so.13, libcublas.so.13, libcurand.so.10, libnccl.so.2).
# Usage: candle-cp-kernels/emu/shim/build.sh   -> prints the library directory (last line).
# Run a CUDA binary on the CPU: LD_LIBRARY_PATH=<that dir> target/.../gpu_check ...
# Env: EMU_SHIM_BUILD (build dir, default target/emu-shim), CXX, JOBS (2), EMU_OPT (-O2).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cd "$root"
if [ -z "${CUDA_ROOT:-}" ] && [ -f "${CANDLE_CP_SHARED:-../shared}/cuda/env.sh" ]; then
  # shellcheck disable=SC1091
  . "${CANDLE_CP_SHARED:-../shared}/cuda/env.sh" "" >/dev/null
fi
if [ -z "${CUDA_ROOT:-}" ] || [ ! -f "$CUDA_ROOT/include/cuda_bf16.h" ]; then
  echo "emu-shim: CUDA headers not found (CUDA_ROOT='${CUDA_ROOT:-}')" >&2
  exit 1
fi
CXX=${CXX:-g++}
JOBS=${JOBS:-2}
OPT=${EMU_OPT:--O2}
out=${EMU_SHIM_BUILD:-$root/target/emu-shim}
mkdir -p "$out/obj" "$out/lib"
k=candle-cp-kernels
flags=(-std=c++17 "$OPT" -g1 -pthread -fPIC -DCP_HOST_EMU -I"$CUDA_ROOT/include" -I$k/kernels -I$k/emu -I$k/emu/shim
       -Wall -Wno-psabi -Wno-unknown-pragmas -Wno-unused-function -Wno-unused-variable)
ours=(flash_fwd flash_fwd_sm90 flash_fwd_sm90_ws flash_bwd flash_bwd_mma flash_bwd_pipe flash_bwd_fused flash_bwd_sm90
      flash_bwd_sm90_ws merge layout quant moe grouped_gemm dropout probe probe_sm90)
core=(emu/emu.cpp emu/emu_ops.cpp emu/emu_sync.cpp emu/emu_wgmma.cpp emu/emu_async.cpp
      emu/shim/registry.cpp emu/shim/driver.cpp emu/shim/memory.cpp emu/shim/blas.cpp emu/shim/rand.cpp emu/shim/nccl.cpp emu/shim/nccl_files.cpp)
candle_srcs=()
candle_flags=()
if [ -f "$here/candle.sh" ]; then
  # shellcheck disable=SC1091
  . "$here/candle.sh"
fi
headers=("$k"/kernels/*.cuh "$k"/emu/*.h "$k"/emu/lb.py "$k"/emu/shim/*.h "$k"/emu/shim/reg.py "$here/build.sh")
fresh() {  # fresh OBJ SRC: the object is newer than its source and every header
  local o=$1 h
  [ -f "$o" ] && [ "$o" -nt "$2" ] || return 1
  for h in "${headers[@]}"; do [ "$o" -nt "$h" ] || return 1; done
}
start=$(date +%s)
objs=()
pids=()
spawn() { while [ "${#pids[@]}" -ge "$JOBS" ]; do wait "${pids[0]}" || exit 1; pids=("${pids[@]:1}"); done; "$@" & pids+=($!); }
# our kernel files are compiled with UBSan's alignment check: a misaligned typed global access
# (a uint4 / float2 / uint32_t load through a view whose offset breaks the vector alignment, a
# misaligned-address fault on a GPU) aborts with its source line (EMU_SHIM_UBSAN=0: off)
ubsan=()
[ "${EMU_SHIM_UBSAN:-1}" = 1 ] && ubsan=(-fsanitize=alignment -fno-sanitize-recover=alignment)
kernel_obj() {  # our kernel files: launch-bounds markers (lb.py), then registrations (reg.py)
  "$CXX" "${flags[@]}" -DCP_EMU_LB_SCAN -include registry.h -x c++ -E "$1" | python3 $k/emu/lb.py | python3 $k/emu/shim/reg.py >"$2.ii"
  "$CXX" "${flags[@]}" "${ubsan[@]}" -x c++-cpp-output -c "$2.ii" -o "$2"
}
candle_obj() {
  "$CXX" "${flags[@]}" "${candle_flags[@]}" -include registry.h -x c++ -E "$1" | python3 $k/emu/shim/reg.py >"$2.ii"
  "$CXX" "${flags[@]}" -Wno-all -x c++-cpp-output -c "$2.ii" -o "$2"
  # candle's headers define non-inline __device__ helpers (get_strided_index, ...) in every file
  # that includes them; the copies are identical, so let the linker keep one (weak symbols)
  objcopy --weaken "$2"
}
for f in "${ours[@]}"; do
  o="$out/obj/$f.o"; objs+=("$o")
  fresh "$o" "$k/kernels/$f.cu" || spawn kernel_obj "$k/kernels/$f.cu" "$o"
done
for s in "${candle_srcs[@]}"; do
  o="$out/obj/candle_$(basename "$s" .cu).o"; objs+=("$o")
  fresh "$o" "$s" || spawn candle_obj "$s" "$o"
done
for s in "${core[@]}"; do
  [ -f "$k/$s" ] || { echo "emu-shim: $k/$s missing, skipped" >&2; continue; }
  o="$out/obj/$(basename "$s" .cpp).o"; objs+=("$o")
  fresh "$o" "$k/$s" || spawn "$CXX" "${flags[@]}" -x c++ -c "$k/$s" -o "$o"
done
for p in "${pids[@]}"; do wait "$p" || exit 1; done
"$CXX" -shared -pthread "${ubsan[@]}" -Wl,-soname,libcuda.so.1 -Wl,--no-undefined -Wl,--version-script,$k/emu/shim/exports.map "${objs[@]}" ${EMU_SHIM_EXTRA_OBJS:-} -o "$out/lib/libcpemu.so"
for n in libcuda.so.1 libcuda.so libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnccl.so.2; do
  ln -sf libcpemu.so "$out/lib/$n"
done
echo "emu-shim: built in $(( $(date +%s) - start )) s" >&2
echo "$out/lib"
