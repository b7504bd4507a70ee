#!/usr/bin/env bash
# Builds the real kernel source (kernels/*.cu) as host C++ under the CUDA emulation in this folder
# and runs the harness (every kernel family vs a float64 reference). No GPU needed.
# Usage: candle-cp-kernels/emu/run.sh [check-name filter]   (from anywhere; needs ../shared/cuda
# set up as in scripts/ci-cuda.sh, or CUDA_ROOT pointing at a toolkit with cuda_bf16.h).
# Env: EMU_BUILD (build dir, default target/emu), CXX (g++), JOBS (2: compile jobs, and the
# harness's worker processes unless EMU_JOBS is set), EMU_OPT (-O2), EMU_COMBOS (comma-separated
# thread-schedule / cp.async-landing combinations to run, e.g. lockstep/at-wait,random:2/random:2;
# default all 6, see harness.cpp; CI runs 3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
if [ -z "${CUDA_ROOT:-}" ] && [ -f "${CANDLE_CP_SHARED:-../shared}/cuda/env.sh" ]; then
  # shellcheck disable=SC1091
  . "${CANDLE_CP_SHARED:-../shared}/cuda/env.sh" ""  # (its first argument is a root dir)
fi
if [ -z "${CUDA_ROOT:-}" ] || [ ! -f "$CUDA_ROOT/include/cuda_bf16.h" ]; then
  echo "emu: CUDA headers not found (CUDA_ROOT='${CUDA_ROOT:-}'); run ../shared/cuda/setup.sh and source ../shared/cuda/env.sh" >&2
  exit 1
fi
CXX=${CXX:-g++}
JOBS=${JOBS:-2}
OPT=${EMU_OPT:--O2}
out=${EMU_BUILD:-$root/target/emu}
mkdir -p "$out"
flags=(-std=c++17 "$OPT" -g1 -pthread -DCP_HOST_EMU -I"$CUDA_ROOT/include" -Icandle-cp-kernels/kernels -Icandle-cp-kernels/emu
       -Wall -Wno-psabi -Wno-unknown-pragmas -Wno-unused-function -Wno-unused-variable)
srcs=(kernels/flash_fwd.cu kernels/flash_fwd_sm90.cu kernels/flash_fwd_sm90_ws.cu kernels/flash_bwd_sm90.cu kernels/flash_bwd_sm90_ws.cu kernels/flash_bwd.cu kernels/flash_bwd_mma.cu kernels/flash_bwd_pipe.cu kernels/flash_bwd_fused.cu kernels/merge.cu
      kernels/layout.cu emu/emu.cpp emu/emu_ops.cpp emu/harness.cpp emu/check_flash.cpp emu/check_misc.cpp emu/check_fused.cpp emu/selftest.cpp
      kernels/probe.cu kernels/probe_sm90.cu emu/check_probe.cpp)
srcs+=(emu/emu_sync.cpp)  # mbarriers, named barriers (emu.h)
srcs+=(emu/emu_wgmma.cpp)  # wgmma, setmaxnreg (emu.h)
srcs+=(emu/emu_async.cpp)  # cp.async, async-proxy view (emu.h)
srcs+=(emu/check_band.cpp)  # band masks (the `_band_` entries)
srcs+=(kernels/quant.cu emu/check_quant.cpp)  # int8 / NF4 dequantization
srcs+=(kernels/moe.cu emu/check_moe.cpp)  # top-K routing
srcs+=(kernels/grouped_gemm.cu emu/check_grouped.cpp)  # the experts' grouped products
srcs+=(kernels/dropout.cu emu/check_dropout.cpp)  # dropout keep masks
start=$(date +%s)
objs=()
pids=()
for s in "${srcs[@]}"; do
  o="$out/$(basename "$s").o"
  objs+=("$o")
  # rebuild when the source or any header changed
  if [ "$o" -nt "candle-cp-kernels/$s" ] && [ "$o" -nt candle-cp-kernels/kernels/common.cuh ] && [ "$o" -nt candle-cp-kernels/kernels/flash_bwd_pipe.cuh ] && [ "$o" -nt candle-cp-kernels/kernels/wgmma.cuh ] && [ "$o" -nt candle-cp-kernels/kernels/mbarrier.cuh ] && [ "$o" -nt candle-cp-kernels/kernels/flash_sm90.cuh ] && [ "$o" -nt candle-cp-kernels/kernels/tma.cuh ] && [ "$o" -nt candle-cp-kernels/emu/tma_map.h ] \
     && [ "$o" -nt candle-cp-kernels/emu/emu.h ] && [ "$o" -nt candle-cp-kernels/emu/lb.py ] && [ "$o" -nt candle-cp-kernels/emu/emu_internal.h ] && [ "$o" -nt candle-cp-kernels/emu/harness.h ]; then continue; fi
  while [ "${#pids[@]}" -ge "$JOBS" ]; do wait "${pids[0]}" || exit 1; pids=("${pids[@]:1}"); done
  case "$s" in
    kernels/*|emu/selftest.cpp)
      # kernel files: preprocess with __launch_bounds__ as a marker, let lb.py insert the
      # block-size check at each entry, compile that (line markers keep diagnostics on the .cu)
      ( "$CXX" "${flags[@]}" -DCP_EMU_LB_SCAN -x c++ -E "candle-cp-kernels/$s" | python3 "$here/lb.py" >"$o.ii" \
        && "$CXX" "${flags[@]}" -x c++-cpp-output -c "$o.ii" -o "$o" ) &;;
    *) "$CXX" "${flags[@]}" -x c++ -c "candle-cp-kernels/$s" -o "$o" &;;
  esac
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || exit 1; done
"$CXX" -pthread "${objs[@]}" -o "$out/harness"
echo "emu: built in $(( $(date +%s) - start )) s"
EMU_JOBS=${EMU_JOBS:-$JOBS} exec "$out/harness" "$@"
