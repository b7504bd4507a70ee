#!/usr/bin/env bash
# Builds and runs the tests of the shim's libcublas / libcurand stand-ins (blas.cpp, rand.cpp):
#   candle-cp-kernels/emu/shim/test_blas.sh        (from anywhere; one g++ job at a time)
# Two builds of the same test (test_blas.cpp), output in $OUT_DIR (default target/emu-shim/test-blas):
#  1. stubs: blas.cpp + rand.cpp + test_stubs_c.cpp (stream_push / stream_drain / log) - always;
#  2. lib:   linked against the built shim library (libcpemu.so from build.sh, with the
#            driver.cpp providing the stream model) when it exists in $EMU_SHIM_LIB (default
#            target/emu-shim/lib); skipped (said so) otherwise. CPEMU_TEST_STUBS=1 skips it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
out="${OUT_DIR:-$root/target/emu-shim/test-blas}"
lib="${EMU_SHIM_LIB:-$root/target/emu-shim/lib}"
mkdir -p "$out"
flags=(-std=c++17 -O2 -g -Wall -Wextra -pthread -I"$here")

echo "== test_blas (stubs: blas.cpp rand.cpp test_stubs_c.cpp)"
g++ "${flags[@]}" "$here/blas.cpp" "$here/rand.cpp" "$here/test_stubs_c.cpp" "$here/test_blas.cpp" -o "$out/test_blas_stubs"
"$out/test_blas_stubs"

if [[ -z "${CPEMU_TEST_STUBS:-}" && -f "$lib/libcpemu.so" ]]; then
  echo "== test_blas (library: $lib/libcpemu.so)"
  g++ "${flags[@]}" "$here/test_blas.cpp" -o "$out/test_blas_lib" -L"$lib" -lcpemu -Wl,-rpath,"$lib"
  "$out/test_blas_lib"
else
  echo "== test_blas (library): skipped, no $lib/libcpemu.so (build it with build.sh)"
fi
