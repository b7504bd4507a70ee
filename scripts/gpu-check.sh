#!/usr/bin/env bash
# GPU check in two parts (see docs/gpu.md).
#
#   scripts/gpu-check.sh build   # here, no GPU: build gpu_check, gpu_bench, finetune_llama with --features
#                                # cuda,nccl, strip + xz them into target-gpu-stage/
#   scripts/gpu-check.sh preflight  # here, no GPU: the staged binaries on the CPU under the
#                                # host CUDA shim (candle-cp-kernels/emu/shim/): probes, every
#                                # kernel family on small cases, NCCL, gpu_bench at a tiny size
#                                # (~2 min), so a GPU's minutes are not spent on a broken stage
#   scripts/gpu-check.sh run     # on the GPU machine (no Rust there): every kernel vs the CPU
#                                # path + oracle cases + ring/Ulysses on virtual ranks, then the
#                                # TFLOP/s benchmark beside PyTorch SDPA; results in $OUT/gpu-check
#
# With the device tool: run `build` and `preflight` here, then
#   run(command="scripts/gpu-check.sh run", carry=["target-gpu-stage"], timeout_s=570)
# Part 2 fits in 8 minutes at worst: every step runs under one 480 s budget (GPU_CHECK_BUDGET_S),
# with time kept back for the benchmarks and SDPA; about 3 minutes when all goes well, and what is
# left goes to the end-to-end fine-tune (step 6) and compute-sanitizer (step 7).
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
    --example gpu_check --example gpu_bench --example finetune_llama
  rm -rf "$STAGE"
  mkdir -p "$STAGE"
  for b in gpu_check gpu_bench finetune_llama; do
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

# sanitize SANITIZER TOOL LIMIT LOG -- CMD...: CMD under compute-sanitizer's TOOL (memcheck,
# racecheck, synccheck), only our kernels instrumented (their names start with flash_), its report
# appended to LOG without gpu_check's PASS lines, and one verdict line. Returns 1 if the tool
# reported an error (or CMD failed under it), 0 if it was clean, could not check this device
# (gVisor machines refuse it) or was stopped at LIMIT (what it reported by then is in LOG and in
# the verdict).
sanitize() {
  local san=$1 tool=$2 lim=$3 log=$4; shift 5
  local tmp code=0 found warned summary verdict
  tmp=$(mktemp)
  local s0=$SECONDS filter=(--kernel-name kns=flash_)
  timeout -k 10 "$lim" "$san" --tool "$tool" "${filter[@]}" --error-exitcode 3 --print-limit 20 "$@" \
    >"$tmp" 2>&1 || code=$?
  if [ "$code" != 0 ] && grep -q -i -E 'unrecognized|unknown option|invalid (option|value)' "$tmp" \
     && ! grep -q '^gpu_check:' "$tmp"; then
    # a tool version that does not take the kernel filter: once more, every kernel instrumented
    grep -v '^PASS' "$tmp" >>"$log" || true
    echo "gpu-check: compute-sanitizer $tool refused its options (above); again without the kernel filter" | tee -a "$log"
    code=0
    timeout -k 10 "$((lim - (SECONDS - s0) > 5 ? lim - (SECONDS - s0) : 5))" "$san" --tool "$tool" --error-exitcode 3 \
      --print-limit 20 "$@" >"$tmp" 2>&1 || code=$?
  fi
  grep -v '^PASS' "$tmp" >>"$log" || true
  # error records: memcheck "Invalid __global__ read ...", racecheck "Error: Race reported ...",
  # synccheck "Barrier error detected ..."; the summaries count them when the run ends
  found=$(grep -c -E '^========= +(Invalid|Error|Barrier error|Program hit)' "$tmp" || true)
  warned=$(grep -c -E '^========= +Warning' "$tmp" || true)  # racecheck's lesser hazards
  summary=$(grep -E '^========= +[A-Z]+ SUMMARY' "$tmp" | tail -1 | sed 's/^========= *//' || true)
  if grep -q -i -E 'device not supported|not supported on this' "$tmp"; then  # nothing instrumented ran
    verdict="unavailable here ($(grep -m1 -i 'not supported' "$tmp" | sed 's/^========= *//'))"; code=0
  elif [ "$code" = 124 ] || [ "$code" = 137 ]; then
    verdict="stopped at its ${lim} s limit: $found error records by then"; [ "$found" = 0 ] && code=0 || code=3
  elif [ "$code" = 0 ] && [ "$found" = 0 ]; then
    verdict="clean (${summary:-no summary}; $warned warning records)"
  else
    verdict="FOUND $found error records, exit $code (${summary:-no summary}; the records are in $log)"; code=3
  fi
  rm -f "$tmp"
  echo "gpu-check: compute-sanitizer $tool: $verdict" | tee -a "$log"
  [ "$code" = 0 ]
}

run() {
  local out=${OUT:-$PWD/gpu-out}/gpu-check
  mkdir -p "$out"
  local bin
  bin=$(mktemp -d)
  for b in gpu_check gpu_bench finetune_llama; do
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
  ldd "$bin/gpu_check" 2>&1 | tee -a "$machine" || true
  if ldd "$bin/gpu_check" | grep -q "not found"; then echo "gpu-check: WARNING: missing libraries (see ldd above)"; fi

  local rc=0
  # One budget for all steps (the issue's 8 minutes): each step runs under min(its own limit, what
  # is left of the budget less a reserve for the steps after it that must still run); a step
  # with under 5 s left is skipped and says so. Steps with their own log stay separate processes:
  # a kernel that faults poisons its CUDA context (and a kernel that hangs is killed at its
  # limit) without taking the other checks or the other kernel families' numbers with it.
  local t0=$SECONDS budget=${GPU_CHECK_BUDGET_S:-480}
  # step LIMIT RESERVE LOG MODE -- cmd...: MODE "new" starts LOG, "add" appends to it.
  step() {
    local want=$1 reserve=$2 log=$3 mode=$4; shift 5
    local lim=$((budget - (SECONDS - t0) - reserve))
    [ "$lim" -gt "$want" ] && lim=$want
    if [ "$lim" -lt 5 ]; then
      echo "gpu-check: SKIPPED (budget: ${lim}s left for a ${want}s step): $*" | tee -a "$log"; rc=1; return 0
    fi
    local tee_args=()
    [ "$mode" = add ] && tee_args=(-a)
    timeout "$lim" "$@" 2>&1 | tee "${tee_args[@]}" "$log" || { echo "gpu-check: step failed or timed out (limit ${lim}s): $*" | tee -a "$log"; rc=1; }
  }
  # What must still run after the checks: benchmarks of the default and the Hopper kernels + SDPA.
  local keep=195
  echo "== 0/7 probes: each tensor-core primitive (mma.sync, ldmatrix, cp.async, wgmma) alone, with a diagnosis of any mismatch"
  step 20 $keep "$machine" add -- "$bin/gpu_check" --sections probe
  echo "== 1/7 correctness: every kernel vs the CPU path (simple, mma), merge, layout"
  step 70 $keep "$out/check.log" new -- "$bin/gpu_check" --impls simple,mma --sections flash,views,flash-large,merge,layout,quant,moe,dropout
  echo "== 2/7 correctness: pipelined kernels (the default for f16/bf16) and the fused atomic-dQ backward vs the CPU path"
  step 40 $keep "$out/check-pipelined.log" new -- "$bin/gpu_check" --impls pipelined,atomic --sections flash,views,flash-large
  echo "== 3/7 correctness: experimental Hopper kernels vs the CPU path: wgmma forward and backwards, then the warp-specialized forward and backward"
  step 45 $keep "$out/check-wgmma.log" new -- "$bin/gpu_check" --impls wgmma,wgmma-atomic --sections flash,views,flash-large
  step 45 $keep "$out/check-wgmma.log" add -- "$bin/gpu_check" --impls wgmma-ws --sections flash,views,flash-large
  step 50 $keep "$out/check-wgmma.log" add -- "$bin/gpu_check" --impls wgmma-tma,wgmma-tma-wide --sections flash,views,flash-large,band
  echo "== 4/7 correctness: oracle cases + ring/all-gather/Ulysses, tiny Llama on every layout (virtual ranks), NCCL"
  local before=$rc
  step 85 $keep "$out/check-oracle.log" new -- "$bin/gpu_check" --oracle tests/data/oracle/attn --sections oracle,llama,nccl
  if [ "$rc" != "$before" ]; then
    echo "-- again with the plain mma kernels (tells kernel bugs from ring bugs)"
    step 20 $keep "$out/check-oracle.log" add -- env CANDLE_CP_FLASH_IMPL=mma "$bin/gpu_check" --oracle tests/data/oracle/attn --sections oracle
  fi
  echo "-- masks: packed documents, sliding windows, decode against a sharded KV cache (virtual ranks), band masks, random configurations"
  step 60 $keep "$out/check-oracle.log" add -- "$bin/gpu_check" --oracle tests/data/oracle/attn --sections packed,window,decode,band,random
  echo "-- random configurations again on the warp-specialized TMA kernels (the Hopper family with band masks)"
  step 20 $keep "$out/check-oracle.log" add -- env CANDLE_CP_FLASH_IMPL=wgmma-tma "$bin/gpu_check" --sections random
  echo "== 5/7 benchmarks: candle-cp kernels (bf16, D = 128; D = 256 and 96: pipelined vs CUDA-core, and with Gemma 2's soft cap), then PyTorch SDPA on the same GPU"
  : > "$out/bench.jsonl"
  local item imp ring want mem moe reserve docs bwd auto window softcap d ts heads
  # (family, limit, reserve for what follows): each family its own process, so a hang or fault
  # in one leaves the others' numbers. (`families:d` items: at head dim d)
  for item in pipelined wgmma,wgmma-atomic wgmma-ws wgmma-tma wgmma-tma-wide atomic pipelined,simple:256 pipelined,simple:96; do
    imp=${item%%:*}
    ring=0 mem=0 moe=0 docs="" window="" softcap="" bwd=1 auto=() d=128 ts=4096,8192,16384,32768 heads=16
    case $item in
      pipelined) ring=4 docs=128,1024 window=1024 want=65 reserve=205 ;;  # reserve: 30 wgmma + 20 wgmma-ws + 20 wgmma-tma + 20 wide + 35 d256 + 20 d96 + 60 SDPA; docs: band vs per-document calls
      wgmma,wgmma-atomic) docs=128,1024 want=55 reserve=175 ;;  # docs: the wgmma band kernels
      wgmma-ws) docs=128,1024 want=50 reserve=155 ;;  # docs: its band kernels
      wgmma-tma) ring=4 docs=128,1024 want=55 reserve=135 auto=(CANDLE_CP_FLASH_IMPL=wgmma-tma) ;;  # the warp-specialized kernels with TMA loads; its ring steps, and the whole ring on them (Auto)
      wgmma-tma-wide) bwd=0 want=25 reserve=115 ;;  # its forward's 176-key tiles (full, causal); the backward is wgmma-tma's
      atomic) mem=1 moe=1 want=45 reserve=115 ;;  # + the memory-bound kernels (merge, cast, layout) in GB/s, and the experts' grouped products (kernel vs per-expert cuBLAS)
      pipelined,simple:256) d=256 ts=4096,16384 heads=8 softcap=50 want=35 reserve=80 ;;  # head dim 256 (Gemma 2 / 3): the pipelined kernels vs the CUDA-core ones, and Gemma 2's soft cap on each
      pipelined,simple:96) d=96 ts=4096,16384 heads=32 want=25 reserve=60 ;;  # head dim 96 (Phi-3-mini: 32 heads): the pipelined kernels vs the CUDA-core ones
    esac
    local lim=$((budget - (SECONDS - t0) - reserve))
    [ "$lim" -gt "$want" ] && lim=$want
    step "$want" "$reserve" "$out/bench.jsonl" add -- env "${auto[@]}" "$bin/gpu_bench" --t "$ts" --heads "$heads" --d "$d" --iters 3 \
      --impl "$imp" --bwd "$bwd" --ring-t 16384 --ring-p "$ring" --mem "$mem" --moe "$moe" ${docs:+--docs "$docs" --docs-t 16384} ${window:+--window "$window"} ${softcap:+--softcap "$softcap"} --budget-s $((lim > 20 ? lim - 10 : 10))
  done
  step 60 0 "$out/sdpa.jsonl" new -- python3 scripts/sdpa_bench.py --t 4096,8192,16384,32768 --heads 16 --d 128 --iters 3
  python3 scripts/gpu_table.py "$out/bench.jsonl" "$out/sdpa.jsonl" | tee "$out/table.md" || rc=1
  # Optional, with what is left of the budget: the main job end to end on the GPU (4 virtual
  # ranks, zigzag CP, bf16, T = 16k, layers recomputed, chunked loss, ZeRO-1, gradient sync overlapped): tokens/s and that it trains.
  if [ $((budget - (SECONDS - t0))) -ge 30 ]; then
    echo "== 6/7 end to end: finetune_llama on the GPU (4 virtual ranks, T = 16384, bf16, --recompute)" | tee -a "$out/check-oracle.log"
    step 90 0 "$out/check-oracle.log" add -- "$bin/finetune_llama" --device cuda --gpus 1 --dtype bf16 --seq-len 16384 \
      --cp 4 --hidden 1024 --layers 4 --heads 8 --kv-heads 4 --batch 1 --keys 64 --steps 4 --lr 1e-3 --save-every 0 \
      --recompute --overlap-grad-sync --zero1 --overlap-param-gather --out /tmp/candle-cp-ft
  else
    echo "gpu-check: end-to-end fine-tune skipped (budget spent)" | tee -a "$out/check-oracle.log"
  fi
  # Optional, with what is left: compute-sanitizer on the small flash cases of the default kernels
  # and of the warp-specialized ones (real concurrency, which the CPU emulation cannot give):
  # racecheck first (shared-memory hazards), then memcheck, then synccheck. It can check a
  # Firecracker machine, not a gVisor one (it refuses the device; the verdict says so).
  local san tool left
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
  echo "== 7/7 compute-sanitizer (racecheck, memcheck, synccheck) on the small flash cases, with what is left of the budget" | tee -a "$out/check.log"
  if [ -z "$san" ]; then
    echo "gpu-check: compute-sanitizer not found; step 7 skipped" | tee -a "$out/check.log"
  else
    for tool in racecheck memcheck synccheck; do
      left=$((budget - (SECONDS - t0)))
      if [ "$left" -lt 30 ]; then
        echo "gpu-check: compute-sanitizer $tool skipped (budget: ${left} s left)" | tee -a "$out/check.log"; continue
      fi
      sanitize "$san" "$tool" $((left < 150 ? left : 150)) "$out/check.log" -- \
        "$bin/gpu_check" --quick --impls pipelined,atomic,wgmma-ws,wgmma-tma --sections flash || rc=1
    done
  fi
  echo "gpu-check: $((SECONDS - t0)) s of the ${budget} s budget"
  grep -h -E "^gpu_check:|^gpu-check: compute-sanitizer" "$out"/check*.log || true
  echo "gpu-check: results in $out (rc $rc)"
  return $rc
}

preflight() {
  local lib bin out=${OUT:-$PWD/gpu-out}/preflight
  lib=$(candle-cp-kernels/emu/shim/build.sh | tail -1)
  bin=$(mktemp -d)
  mkdir -p "$out"
  for b in gpu_check gpu_bench finetune_llama; do
    python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
      "$STAGE/$b.xz" "$bin/$b"
    chmod +x "$bin/$b"
  done
  export LD_LIBRARY_PATH="$lib" CPEMU_DEVICES=2
  "$bin/gpu_check" --quick --impls simple,mma,pipelined,atomic,wgmma,wgmma-atomic,wgmma-ws,wgmma-tma,wgmma-tma-wide \
    --sections probe,flash,views,merge,layout,quant,moe,dropout,band,oracle,packed,window,decode,random,nccl,nccl-ranks >"$out/check.log" 2>&1 \
    || { grep -v '^PASS' "$out/check.log" | tail -40; echo "gpu-check preflight: gpu_check failed ($out/check.log)"; return 1; }
  grep '^gpu_check:' "$out/check.log"
  "$bin/gpu_bench" --t 256 --heads 4 --d 128 --iters 1 --impl pipelined,wgmma,wgmma-atomic,wgmma-ws,wgmma-tma,wgmma-tma-wide,atomic \
    --ring-t 512 --ring-p 4 --mem 1 --docs 64 --docs-t 256 --window 33 --moe 2 --budget-s 200 >"$out/bench.jsonl" 2>"$out/bench.err" \
    || { tail -20 "$out/bench.err"; echo "gpu-check preflight: gpu_bench failed"; return 1; }
  # step 5's head-dim-256 line
  "$bin/gpu_bench" --t 128 --heads 2 --d 256 --iters 1 --impl pipelined,simple --bwd 1 --softcap 50 --ring-t 16384 --ring-p 0 --mem 0 --budget-s 60 \
    >>"$out/bench.jsonl" 2>>"$out/bench.err" || { tail -20 "$out/bench.err"; echo "gpu-check preflight: gpu_bench at d 256 failed"; return 1; }
  # and its head-dim-96 line
  "$bin/gpu_bench" --t 128 --heads 2 --d 96 --iters 1 --impl pipelined,simple --bwd 1 --ring-t 16384 --ring-p 0 --mem 0 --budget-s 60 \
    >>"$out/bench.jsonl" 2>>"$out/bench.err" || { tail -20 "$out/bench.err"; echo "gpu-check preflight: gpu_bench at d 96 failed"; return 1; }
  : >"$out/sdpa.jsonl"
  python3 scripts/gpu_table.py "$out/bench.jsonl" "$out/sdpa.jsonl" >/dev/null
  # step 6's command line at a tiny size
  "$bin/finetune_llama" --device cuda --gpus 1 --dtype bf16 --seq-len 256 --cp 4 --hidden 64 --layers 2 \
    --heads 4 --kv-heads 2 --batch 1 --keys 8 --steps 2 --lr 1e-3 --save-every 0 --recompute --overlap-grad-sync --zero1 --overlap-param-gather --out "$out/ft" \
    >"$out/ft.log" 2>&1 || { tail -20 "$out/ft.log"; echo "gpu-check preflight: finetune_llama failed"; return 1; }
  grep '^summary' "$out/ft.log"
  # step 7's wiring, with a stand-in for compute-sanitizer (it drops the tool's options, runs the
  # command, and prints what the real tool prints when it is clean, finds a race or refuses the device)
  local fake=$bin/fake-sanitizer
  cat >"$fake" <<'SH'
#!/usr/bin/env bash
while [ $# -gt 0 ]; do
  case $1 in
    --kernel-name) [ "${FAKE_SAN:-}" = nofilter ] && { echo "Unrecognized option: --kernel-name"; exit 1; }; shift 2 ;;
    --tool|--error-exitcode|--print-limit) shift 2 ;;
    *) break ;;
  esac
done
echo "========= COMPUTE-SANITIZER"
case ${FAKE_SAN:-clean} in
  unsupported) echo "========= Error: Device not supported. Please refer to the documentation"; exit 1 ;;
  race) "$@" >/dev/null; echo "========= Error: Race reported between Write access at flash_x+0x10"; echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"; exit 3 ;;
esac
"$@"; c=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $c
SH
  chmod +x "$fake"
  local cmd=("$bin/gpu_check" --quick --impls pipelined --sections merge)
  echo "gpu-check preflight: step 7's verdicts on a stand-in: clean, no kernel filter, refused device, a planted race, a failing command:"
  sanitize "$fake" racecheck 120 "$out/sanitize.log" -- "${cmd[@]}" \
    && FAKE_SAN=nofilter sanitize "$fake" racecheck 120 "$out/sanitize.log" -- "${cmd[@]}" \
    && FAKE_SAN=unsupported sanitize "$fake" racecheck 120 "$out/sanitize.log" -- "${cmd[@]}" \
    && ! FAKE_SAN=race sanitize "$fake" racecheck 120 "$out/sanitize.log" -- "${cmd[@]}" \
    && ! sanitize "$fake" memcheck 120 "$out/sanitize.log" -- "$bin/gpu_check" --impls no-such-family \
    || { tail -20 "$out/sanitize.log"; echo "gpu-check preflight: step 7's compute-sanitizer verdicts are wrong"; return 1; }
  echo "gpu-check preflight: the staged binaries run on the CPU under the host CUDA shim ($out)"
}

case "${1:-}" in
  build) build ;;
  preflight) preflight ;;
  run) run ;;
  *) echo "usage: $0 build|preflight|run" >&2; exit 2 ;;
esac
