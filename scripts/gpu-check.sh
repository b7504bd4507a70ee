#!/usr/bin/env bash
# GPU check in two parts (see docs/gpu.md).
#
#   scripts/gpu-check.sh build   # here, no GPU: build gpu_check + gpu_bench with --features
#                                # cuda,nccl, strip + xz them into target-gpu-stage/
#   scripts/gpu-check.sh run     # on the GPU machine (no Rust there): every kernel vs the CPU
#                                # path + oracle cases + ring/Ulysses on virtual ranks, then the
#                                # TFLOP/s benchmark beside PyTorch SDPA; results in $OUT/gpu-check
#
# With the device tool: run `build` here, then
#   run(command="scripts/gpu-check.sh run", carry=["target-gpu-stage"], timeout_s=570)
# Part 2 fits in 8 minutes at worst (every step at its timeout): checks <= 240 s (+20 s after an
# oracle failure), benchmarks <= 155 s, SDPA <= 65 s; about 3 minutes when all goes well.
# (The device tool's 570 s call limit leaves 90 s for unpacking and the machine file.)
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-target-gpu-stage}

build() {
  local shared=${CANDLE_CP_SHARED:-../shared}
  cargo fetch --quiet
  "$shared/cuda/setup.sh" | tail -1
  # shellcheck disable=SC1091
  . "$shared/cuda/env.sh"
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-cuda}
  cargo build --release -j "${JOBS:-2}" -p candle-cp-examples --features candle-cp-examples/nccl \
    --example gpu_check --example gpu_bench
  rm -rf "$STAGE"
  mkdir -p "$STAGE"
  for b in gpu_check gpu_bench; do
    cp "$CARGO_TARGET_DIR/release/examples/$b" "$STAGE/$b"
    strip "$STAGE/$b"
    xz -T2 -6 -f "$STAGE/$b"   # ~50 MB -> a few MB each; unpacked by `run`
  done
  local bytes
  bytes=$(du -sb "$STAGE" | cut -f1)
  ls -la "$STAGE"
  [ "$bytes" -le $((64 * 1024 * 1024)) ] || { echo "gpu-check: $STAGE is $bytes bytes > 64 MiB"; exit 1; }
  echo "gpu-check: staged $bytes bytes in $STAGE (carry it to the GPU machine)"
}

run() {
  local out=${OUT:-$PWD/gpu-out}/gpu-check
  mkdir -p "$out"
  local bin
  bin=$(mktemp -d)
  for b in gpu_check gpu_bench; do
    python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
      "$STAGE/$b.xz" "$bin/$b"
    chmod +x "$bin/$b"
  done
  # Runtime libraries (cudart, cublas, curand, nccl) come from the Python nvidia packages.
  local nv libs=""
  nv=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || true)
  if [ -n "$nv" ]; then
    for d in $(find "$nv/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null); do libs="$libs:$d"; done
  fi
  has_lib() { local d; for d in ${libs//:/ }; do [ -e "$d/$1" ] && return 0; done; return 1; }
  for so in libnccl.so.2 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13; do
    has_lib "$so" && continue
    d=$( (find / -name "$so" -not -path "/proc/*" 2>/dev/null || true) | head -1 | xargs -r dirname)
    if [ -n "$d" ]; then libs="$libs:$d"; else echo "gpu-check: WARNING: $so not found"; fi
  done
  export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The kernels ship as PTX: the driver JIT-compiles each module at its first load. Keep those
  # results for the later steps (separate processes) in a cache big enough for all of them.
  export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/candle-cp-cuda-cache} CUDA_CACHE_MAXSIZE=4294967296
  mkdir -p "$CUDA_CACHE_PATH"
  # One machine file: the device tool returns at most 8 files from $OUT.
  local machine="$out/machine.txt"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee "$machine"
  nvidia-smi 2>&1 | tee -a "$machine" | head -15 || true
  ldd "$bin/gpu_check" 2>&1 | tee -a "$machine"
  if ldd "$bin/gpu_check" | grep -q "not found"; then echo "gpu-check: WARNING: missing libraries (see ldd above)"; fi

  local rc=0
  # Each step is its own process: a kernel that faults poisons its CUDA context, and must not
  # take the other checks or the other kernel family's numbers with it.
  echo "== 1/5 correctness: every kernel vs the CPU path (simple, mma), merge, layout"
  timeout 70 "$bin/gpu_check" --impls simple,mma --sections flash,flash-large,merge,layout 2>&1 \
    | tee "$out/check.log" || rc=1
  echo "== 2/5 correctness: pipelined kernels (the default for f16/bf16) and the fused atomic-dQ backward vs the CPU path"
  timeout 40 "$bin/gpu_check" --impls pipelined,atomic --sections flash,flash-large 2>&1 \
    | tee "$out/check-pipelined.log" || rc=1
  echo "== 3/5 correctness: experimental Hopper wgmma forward and backward (wgmma dK/dV; wgmma-atomic: fused dQ) vs the CPU path"
  timeout 45 "$bin/gpu_check" --impls wgmma,wgmma-atomic --sections flash,flash-large 2>&1 \
    | tee "$out/check-wgmma.log" || rc=1
  echo "== 4/5 correctness: oracle cases + ring/all-gather/Ulysses, tiny Llama on every layout (virtual ranks), NCCL"
  if ! timeout 85 "$bin/gpu_check" --oracle tests/data/oracle/attn --sections oracle,llama,nccl 2>&1 \
    | tee "$out/check-oracle.log"; then
    rc=1
    echo "-- again with the plain mma kernels (tells kernel bugs from ring bugs)"
    CANDLE_CP_FLASH_IMPL=mma timeout 20 "$bin/gpu_check" --oracle tests/data/oracle/attn --sections oracle \
      2>&1 | tee -a "$out/check-oracle.log" | tail -3 || true
  fi
  echo "== 5/5 benchmarks: candle-cp kernels (bf16, D = 128), then PyTorch SDPA on the same GPU"
  : > "$out/bench.jsonl"
  local imp ring limit mem
  for imp in pipelined wgmma,wgmma-atomic atomic; do
    ring=0 limit=40 mem=0
    [ "$imp" = pipelined ] && ring=4 limit=65
    [ "$imp" = wgmma,wgmma-atomic ] && limit=50
    [ "$imp" = atomic ] && mem=1   # + the memory-bound kernels (merge, cast, layout) in GB/s
    timeout "$limit" "$bin/gpu_bench" --t 4096,8192,16384,32768 --heads 16 --d 128 --iters 3 \
      --impl "$imp" --ring-t 16384 --ring-p "$ring" --mem "$mem" --budget-s $((limit - 10)) 2>&1 | tee -a "$out/bench.jsonl" || rc=1
  done
  timeout 65 python3 scripts/sdpa_bench.py --t 4096,8192,16384,32768 --heads 16 --d 128 --iters 3 \
    2>&1 | tee "$out/sdpa.jsonl" || rc=1
  python3 scripts/gpu_table.py "$out/bench.jsonl" "$out/sdpa.jsonl" | tee "$out/table.md" || rc=1
  grep -h "^gpu_check:" "$out"/check*.log || true
  echo "gpu-check: results in $out (rc $rc)"
  return $rc
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
