#!/usr/bin/env bash
# Builds and runs the tests of the shim's libnccl (nccl.cpp, nccl_files.cpp; tests test_nccl.cpp,
# test_nccl_faults.cpp, test_nccl_group.cpp): ranks as threads, P = 1..4, collectives and
# send/recv against references, init paths, missing rank, abort, mismatch, argument errors,
# NcclGroup's stream/event/watchdog pattern; each binary runs twice, over the threads transport
# (default) and over the files transport (CPEMU_NCCL_TRANSPORT=files). test_nccl_procs.cpp:
# ranks as processes (files transport), P = 2..4, faults (abort, SIGKILL, mismatch, missing
# rank, duplicate device, exit without teardown); with the library, also through launch.sh. About 4 s per build and 3 s per files run, one compile job.
# Two builds: (1) with test_stubs.cpp (minimal stand-ins for the driver part; never part of the
# library), always; (2) with the driver part of the built shim library ($EMU_SHIM_LIB, default
# target/emu-shim/lib, from build.sh) when it exists (CPEMU_TEST_STUBS=1 skips it): this
# checkout's nccl.cpp is linked into the test binary, so its definitions take precedence over
# the library's copy. No GPU, no CUDA headers needed.
# Usage: candle-cp-kernels/emu/shim/test_nccl.sh   Env: OUT (build dir, default
# target/emu-shim/test-nccl; the files runs use $OUT/nccl-dir as CPEMU_NCCL_DIR), CXX (g++),
# CPEMU_WAIT_TIMEOUT_S (default 1.5 here: the missing-rank tests wait that long twice),
# CPEMU_DEVICES (default 4 here: the NcclGroup pattern test needs 4).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${OUT:-$root/target/emu-shim/test-nccl}
CXX=${CXX:-g++}
mkdir -p "$out"
flags=(-std=c++17 -O1 -g1 -pthread -Wall -Wextra -Wno-unused-function -I"$here")
build() {  # build NAME SRC... [-- LINKFLAGS...]: objects (rebuilt when a source or header changed), binary
  local name=$1 s o dep fresh objs=() link=()
  shift
  while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then shift; link=("$@"); break; fi
    s=$1; shift
    o="$out/$(basename "$s" .cpp).o"
    objs+=("$o")
    fresh=1
    for dep in "$s" "$here"/nccl*.h "$here"/test_nccl.h "$here"/shim.h; do [ "$dep" -nt "$o" ] && fresh=0; done
    [ -f "$o" ] && [ $fresh = 1 ] || "$CXX" "${flags[@]}" -c "$s" -o "$o"
  done
  "$CXX" -pthread "${objs[@]}" "${link[@]}" -o "$out/$name"
}
export CPEMU_WAIT_TIMEOUT_S=${CPEMU_WAIT_TIMEOUT_S:-1.5} CPEMU_DEVICES=${CPEMU_DEVICES:-4}
run() {  # run BINARY [TRANSPORT]
  local t0 status=0 tr=${2:-threads}
  rm -rf "$out/nccl-dir"
  t0=$(date +%s.%N)
  CPEMU_NCCL_TRANSPORT=$tr CPEMU_NCCL_DIR="$out/nccl-dir" timeout 300 "$out/$1" || status=$?
  echo "test_nccl ($1, $tr transport): exit $status after $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
  return $status
}
status=0
common=("$here/nccl.cpp" "$here/nccl_files.cpp" "$here/test_nccl.cpp" "$here/test_nccl_faults.cpp" "$here/test_nccl_group.cpp")
procs=("$here/nccl.cpp" "$here/nccl_files.cpp" "$here/test_nccl_procs.cpp")
echo "== test_nccl (stubs: nccl.cpp + test_stubs.cpp)"
build test_nccl_stubs "${common[@]}" "$here/test_stubs.cpp"
run test_nccl_stubs || status=1
run test_nccl_stubs files || status=1
build test_nccl_procs_stubs "${procs[@]}" "$here/test_stubs.cpp"
run test_nccl_procs_stubs files || status=1
lib=${EMU_SHIM_LIB:-$root/target/emu-shim/lib}
if [ -z "${CPEMU_TEST_STUBS:-}" ] && [ -f "$lib/libcpemu.so" ]; then
  # this nccl.cpp, with the driver part (streams, events) of the built shim library
  echo "== test_nccl (driver of $lib/libcpemu.so; nccl.cpp of this checkout)"
  build test_nccl_lib "${common[@]}" -- -L"$lib" -lcpemu -Wl,-rpath,"$lib"
  run test_nccl_lib || status=1
  run test_nccl_lib files || status=1
  build test_nccl_procs_lib "${procs[@]}" -- -L"$lib" -lcpemu -Wl,-rpath,"$lib"
  run test_nccl_procs_lib files || status=1
  # launch.sh (one process per rank, id through CANDLE_CP_NCCL_ID_FILE): 3 healthy ranks pass;
  # rank 2 killed by SIGKILL: the launcher reports its status 137, the 2 others pass (they get
  # ncclRemoteError within 2 s)
  for want in 0:3:blocking 137:2:kill; do
    IFS=: read -r wexit wpass scen <<<"$want"
    rm -rf "$out/launch" && mkdir -p "$out/launch"
    t0=$(date +%s.%N)
    got=0
    TMPDIR="$out/launch" CPEMU_NCCL_DIR="$out/launch/nccl" EMU_SHIM_LIB="$lib" GRACE=10 timeout 120 \
      "$here/launch.sh" 3 "$out/test_nccl_procs_lib" env "$scen" >"$out/launch.log" 2>&1 || got=$?
    cat "$out/launch.log"
    passed=$(grep -c "PASS launched" "$out/launch.log")
    echo "test_nccl (launch.sh 3 test_nccl_procs_lib env $scen): exit $got, $passed ranks passed (want $wexit, $wpass)" \
      "after $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
    [ "$got:$passed" = "$wexit:$wpass" ] || status=1
  done
else
  echo "== test_nccl (library): skipped, no $lib/libcpemu.so (build it with build.sh)"
fi
exit $status
