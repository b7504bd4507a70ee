#!/usr/bin/env bash
# Builds candle's own CUDA kernels (candle.sh: candle-kernels 0.11.1 from the cargo registry,
# compiled in place as host C++ with candle_compat.h and registered by reg.py), the emulator core,
# the shim's kernel registry and check_candle*.cpp into one executable, checks that reg.py finds
# the expected number of entries per file, and runs the checks (PASS/FAIL per check; exit status
# non-zero on any failure). No GPU needed.
# Usage: candle-cp-kernels/emu/shim/check_candle.sh [--bench]
# Env: EMU_BUILD (build dir, default <repo>/target/emu-shim; objects go to $EMU_BUILD/candle),
#      CXX (g++), JOBS (1: parallel compiles), EMU_OPT (-O2).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cd "$root"
if [ -z "${CUDA_ROOT:-}" ] && [ -f "${CANDLE_CP_SHARED:-../shared}/cuda/env.sh" ]; then
  # shellcheck disable=SC1091
  . "${CANDLE_CP_SHARED:-../shared}/cuda/env.sh" ""
fi
if [ -z "${CUDA_ROOT:-}" ] || [ ! -f "$CUDA_ROOT/include/cuda_bf16.h" ]; then
  echo "check_candle: CUDA headers not found (CUDA_ROOT='${CUDA_ROOT:-}'); run ../shared/cuda/setup.sh and source ../shared/cuda/env.sh" >&2
  exit 1
fi
# shellcheck disable=SC1091
. "$here/candle.sh"
CXX=${CXX:-g++}
JOBS=${JOBS:-1}
out=${EMU_BUILD:-$root/target/emu-shim}/candle
mkdir -p "$out"
common=(-std=c++17 "${EMU_OPT:--O2}" -g1 -pthread -fPIC -DCP_HOST_EMU -I"$CUDA_ROOT/include" -Icandle-cp-kernels/kernels
        -Icandle-cp-kernels/emu -Icandle-cp-kernels/emu/shim -Wall -Wno-unknown-pragmas -Wno-unused-function -Wno-unused-variable)
# entries per file that reg.py must find (candle-kernels 0.11.1 with __CUDA_ARCH__ 800: bf16, f16,
# f32, f64, u8, u32, i64 (+ i16/i32 affine, fp8 inside the >= 800 blocks); a change means the
# compat header lost or gained a block)
declare -A expect=([affine]=9 [binary]=96 [cast]=58 [fill]=24 [indexing]=105 [reduce]=71 [sort]=14 [ternary]=21 [unary]=99)
shim=candle-cp-kernels/emu/shim
emu=candle-cp-kernels/emu
deps=("$shim/candle_compat.h" "$emu/emu.h" "$shim/reg.py" "$shim/registry.h" "$shim/candle.sh")
newer() {  # newer OUT SRC...: OUT exists and is newer than every SRC
  local o=$1 s; shift
  [ -f "$o" ] || return 1
  for s in "$@"; do [ "$o" -nt "$s" ] || return 1; done
}
start=$(date +%s)
objs=()
pids=()
wait_slot() { while [ "${#pids[@]}" -ge "$JOBS" ]; do wait "${pids[0]}" || exit 1; pids=("${pids[@]:1}"); done; }
: >"$out/entries.txt"
fail=0
for s in "${candle_srcs[@]}"; do
  b=$(basename "$s" .cu)
  o="$out/candle_$b.o"
  objs+=("$o")
  if ! newer "$o.list" "$s" "${deps[@]}"; then
    "$CXX" "${common[@]}" "${candle_flags[@]}" -x c++ -E "$s" >"$o.ii"
    python3 "$shim/reg.py" --list <"$o.ii" >"$o.list"
  fi
  n=$(wc -l <"$o.list")
  if [ "$n" != "${expect[$b]}" ]; then echo "FAIL reg.py --list $b.cu: $n entries, expected ${expect[$b]}"; fail=1
  else echo "PASS reg.py --list $b.cu: $n entries"; fi
  cat "$o.list" >>"$out/entries.txt"
  newer "$o" "$o.list" && continue
  wait_slot
  # as build.sh does it: registrations by reg.py; candle's headers define non-inline helpers
  # (get_strided_index, ...) in every file, identical copies: weak symbols, the linker keeps one
  ( "$CXX" "${common[@]}" "${candle_flags[@]}" -include registry.h -x c++ -E "$s" | python3 "$shim/reg.py" >"$o.reg.ii" \
    && "$CXX" "${common[@]}" -Wno-all -x c++-cpp-output -c "$o.reg.ii" -o "$o" && objcopy --weaken "$o" ) &
  pids+=($!)
done
for s in "$emu/emu.cpp" "$emu/emu_ops.cpp" "$emu/emu_sync.cpp" "$emu/emu_wgmma.cpp" "$emu/emu_async.cpp" \
         "$shim/registry.cpp" "$shim/check_candle.cpp" "$shim/check_candle_reduce.cpp"; do
  o="$out/$(basename "$s" .cpp).o"
  objs+=("$o")
  newer "$o" "$s" "$emu/emu.h" "$emu/emu_internal.h" "$shim/registry.h" "$shim/check_candle.h" && continue
  wait_slot
  "$CXX" "${common[@]}" -x c++ -c "$s" -o "$o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || exit 1; done
"$CXX" -pthread "${objs[@]}" -o "$out/check_candle"
echo "check_candle: built in $(( $(date +%s) - start )) s"
"$out/check_candle" "$out/entries.txt" "$@" || fail=1
exit $fail
