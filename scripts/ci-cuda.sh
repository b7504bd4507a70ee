#!/usr/bin/env bash
# CUDA compile check for CI (no GPU needed). Called by .ci/run from the repository root of a
# fresh clone that has the read-only shared folder beside it (../shared).
#
#   1. nvcc 13.0.x from PyPI + link stubs: ../shared/cuda/setup.sh (installs into
#      $HOME/.cache/cuda-13.0-pip; nothing is written to ../shared). Needs `cargo fetch` first
#      so that it finds cudarc's sources for the stubs.
#   2. `cargo build --release` of every crate and binary with `cuda` (+ `nccl`), and of the
#      examples run below (the benchmark examples have no CUDA-only code; the test step built
#      them), in target/ (the cuda builds replace the CPU ones there): nvcc compiles
#      kernels/*.cu to PTX (candle-cp-kernels/build.rs), candle-kernels builds its own CUDA code
#      (its quantized-matmul library as unoptimised PTX: scripts/nvcc-ci.sh), and the binaries
#      link against the CUDA libraries (stubs from step 1).
#   3. ptxas (sm_80 and sm_90a; only sm_90a for `.target sm_90a` PTX) assembles our PTX, and its
#      ISA version must be <= 9.0 (what the GPU machine's CUDA 13.0 driver can JIT); no spills
#      in the kernels that must not spill, and the Rust launches match the kernels' parameters;
#      then candle-cp-kernels' unit tests (host code built with `cuda`).
#   4. the pure-Python simulations of the tensor-core kernels' fragment indexing
#      (candle-cp-kernels/sim/*.py, no GPU).
#   5. the kernel source itself, compiled as host C++ by g++ under a CUDA emulation and run on the
#      CPU against a float64 reference (candle-cp-kernels/emu/run.sh, 2 of its 6 thread-schedule
#      combinations: EMU_COMBOS below; no GPU).
#   6. the host CUDA shim (candle-cp-kernels/emu/shim/, docs/gpu.md): its self-tests, then the
#      `--features cuda,nccl` gpu_check binary of step 2, unmodified, on the CPU: candle's CUDA
#      backend, our launchers, our and candle's kernels (emulated), cuBLAS / cuRAND / NCCL
#      stand-ins; `--quick` set, every kernel family, virtual ranks, NCCL ranks on 4 devices
#      (and the flash, band (and random) sections on an emulated sm_80 and sm_86, `CPEMU_CC`);
#      then gpu_bench at a tiny size through scripts/gpu_table.py (the GPU check's bench steps),
#      the fine-tuning example on 2 shim "GPUs" against the CPU (f32 and bf16, 3 steps), and the
#      drop-in example on CUDA.
#   Steps 4, 5 and the shim's build and self-tests run in the background from the start, beside
#   the cargo build (they need no cargo output); step 6's gpu_check starts in the background as
#   soon as the build is done, beside step 3 and the other shim steps: on 2 cores the run is
#   bound by the total work.
#
# Env: CANDLE_CP_SHARED (default ../shared), CUDA_TARGET_DIR (default target), JOBS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
SHARED=${CANDLE_CP_SHARED:-../shared}
# (the README's test command built into target/ already: the dependencies the cuda feature does
# not touch, most of them, are reused from there)
export CARGO_TARGET_DIR=${CUDA_TARGET_DIR:-$PWD/target}
JOBS=${JOBS:-2}

cargo fetch --quiet
"$SHARED/cuda/setup.sh" | tail -1
# shellcheck disable=SC1091
. "$SHARED/cuda/env.sh"
echo "ci-cuda: nvcc ready after $(( $(date +%s) - start )) s"

shim_dir="$CARGO_TARGET_DIR/emu-shim"
shim_log="$shim_dir/ci.log"
mkdir -p "$shim_dir"
# Background jobs, started before the cargo build (they need only the CUDA headers, g++ and
# python; the 2 cores stay busy through the build's serial stretches): the pure-Python
# simulations, the kernel source under the CPU emulation, and the host CUDA shim's build and
# self-tests. Each writes its log; bg_wait NAME fails the run with that log if the job failed.
bg_pids=()
bg_start() {  # bg_start NAME CMD...
  local name=$1
  shift
  ( "$@" ) >"$shim_dir/bg-$name.log" 2>&1 &
  bg_pids+=("$!")
  eval "bg_pid_${name//-/_}=$!"
}
bg_wait() {  # bg_wait NAME: wait for it; on failure show its log and stop
  local name=$1 pid st=0
  eval "pid=\$bg_pid_${name//-/_}"
  wait "$pid" || st=$?
  if [ "$st" != 0 ]; then grep -v '^PASS' "$shim_dir/bg-$name.log" | tail -60; echo "ci-cuda: $name failed (log: $shim_dir/bg-$name.log)"; exit 1; fi
}
trap 'for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
sims() {
  for sim in candle-cp-kernels/sim/fwd_mma_sim.py candle-cp-kernels/sim/fwd_pipe_sim.py candle-cp-kernels/sim/bwd_mma_sim.py candle-cp-kernels/sim/bwd_pipe_sim.py candle-cp-kernels/sim/fwd_wgmma_sim.py candle-cp-kernels/sim/band_work.py; do
    python3 "$sim" > /dev/null || { echo "ci-cuda: $sim failed"; python3 "$sim"; return 1; }
  done
  python3 candle-cp-kernels/emu/mutate.py --check || { echo "ci-cuda: update candle-cp-kernels/emu/mutate.py"; return 1; }
}
bg_start sims sims
# (EMU_COMBOS: 2 of the harness's 6 thread-schedule / cp.async-landing combinations: wgmma
# at issue with skewed warps (the harness's self-tests run in the first), random schedule and
# landing. The baseline, lockstep/at-wait, is the schedule the shim's gpu_check runs every
# kernel family under below; run.sh without EMU_COMBOS runs all 6, as anyone changing a
# kernel should)
EMU_COMBOS=${EMU_COMBOS-warps-asc/at-issue,random:2/random:2}
bg_start emu env EMU_BUILD="$CARGO_TARGET_DIR/emu" EMU_COMBOS="$EMU_COMBOS" candle-cp-kernels/emu/run.sh
shim_selftests() {
  env EMU_SHIM_BUILD="$shim_dir" JOBS="$JOBS" candle-cp-kernels/emu/shim/build.sh >"$shim_dir/build.log" 2>&1 || { cat "$shim_dir/build.log"; return 1; }
  local l
  l=$(tail -1 "$shim_dir/build.log")
  env EMU_BUILD="$shim_dir" JOBS="$JOBS" candle-cp-kernels/emu/shim/check_candle.sh >"$shim_dir/check_candle.log" 2>&1 || { cat "$shim_dir/check_candle.log"; return 1; }
  echo "candle's kernels under the shim: $(grep -c '^PASS' "$shim_dir/check_candle.log") checks passed"
  env OUT_DIR="$shim_dir/test-blas" EMU_SHIM_LIB="$l" candle-cp-kernels/emu/shim/test_blas.sh || return 1
  env OUT="$shim_dir/test-nccl" EMU_SHIM_LIB="$l" candle-cp-kernels/emu/shim/test_nccl.sh || return 1
  echo "$l" >"$shim_dir/lib.path"
}
bg_start shim-selftests shim_selftests

# The cuda build. NVCC: scripts/nvcc-ci.sh (candle-kernels' quantized-matmul library as
# unoptimised PTX; everything else, our kernels included, compiled as usual) in a folder shaped
# like the toolkit, since candle's build finds include/ and lib64/ beside nvcc's bin/.
ci_tk="$CARGO_TARGET_DIR/nvcc-ci"
mkdir -p "$ci_tk/bin"
cp scripts/nvcc-ci.sh "$ci_tk/bin/nvcc"
chmod +x "$ci_tk/bin/nvcc"
ln -sfn "$CUDA_ROOT/include" "$ci_tk/include"
ln -sfn "$CUDA_ROOT/lib64" "$ci_tk/lib64"
CANDLE_CP_REAL_NVCC="$CUDA_ROOT/bin/nvcc" NVCC="$ci_tk/bin/nvcc" cargo build --release -j "$JOBS" \
  -p candle-cp-kernels -p candle-cp-comm -p candle-cp-ops -p candle-cp-nn -p candle-cp-llama \
  -p candle-cp-cli -p candle-cp-examples \
  --features candle-cp-examples/nccl,candle-cp-cli/cuda \
  --lib --bins --example gpu_check --example gpu_bench --example finetune_llama --example drop_in --example generate
echo "ci-cuda: cargo build (cuda, nccl) done after $(( $(date +%s) - start )) s"

bg_wait shim-selftests
lib=$(cat "$shim_dir/lib.path")
echo "ci-cuda: $(grep "^candle's kernels" "$shim_dir/bg-shim-selftests.log") (shim self-tests done after $(( $(date +%s) - start )) s)"
# gpu_check (one core) in the background from here on, beside ptxas and the shim steps below
# (the other core)
gpu_checks() {
  env CPEMU_DEVICES=4 LD_LIBRARY_PATH="$lib" timeout 1200 "$CARGO_TARGET_DIR/release/examples/gpu_check" --quick \
    --impls simple,mma,pipelined,atomic,wgmma,wgmma-atomic,wgmma-ws,wgmma-tma,wgmma-tma-wide --sections probe,flash,views,merge,layout,quant,moe,dropout,band,oracle,packed,window,decode,random,llama,nccl,nccl-ranks \
    >"$shim_dir/gpu_check.log" 2>&1 || { grep -v '^PASS' "$shim_dir/gpu_check.log" | tail -60; echo "gpu_check failed"; return 1; }
  # the random configurations again on the warp-specialized TMA kernels (Auto picks pipelined)
  env CANDLE_CP_FLASH_IMPL=wgmma-tma LD_LIBRARY_PATH="$lib" timeout 300 "$CARGO_TARGET_DIR/release/examples/gpu_check" --quick --sections random \
    >"$shim_dir/gpu_check_random.log" 2>&1 || { grep -v '^PASS' "$shim_dir/gpu_check_random.log" | tail -60; echo "gpu_check --sections random on wgmma-tma failed"; return 1; }
  # an emulated sm_80 (A100: 166,912 bytes of shared memory per block) and sm_86 (A10, L40S,
  # RTX 4090 / 5090: 101,376): Auto's choices there (sm_80, head dim 256: the pipelined forward,
  # the CUDA-core backward; sm_86: the mma kernels up to 128, the pipelined forward and the
  # CUDA-core backward at 256) and the refusals of explicit families, which name the sizes
  env CPEMU_CC=80 CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 300 "$CARGO_TARGET_DIR/release/examples/gpu_check" --quick \
    --impls auto,simple,mma,pipelined,atomic --sections flash,band,random \
    >"$shim_dir/gpu_check_sm80.log" 2>&1 || { grep -v '^PASS' "$shim_dir/gpu_check_sm80.log" | tail -60; echo "gpu_check on an emulated sm_80 failed"; return 1; }
  env CPEMU_CC=86 CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 300 "$CARGO_TARGET_DIR/release/examples/gpu_check" --quick \
    --impls auto,simple,mma,pipelined --sections flash,band \
    >"$shim_dir/gpu_check_sm86.log" 2>&1 || { grep -v '^PASS' "$shim_dir/gpu_check_sm86.log" | tail -60; echo "gpu_check on an emulated sm_86 failed"; return 1; }
}
t_shim=$(date +%s)
bg_start gpu-check gpu_checks

# ptxas -v once per (PTX file, arch); the spill checks below read the same output
ptxas_out="$CARGO_TARGET_DIR/ptxas-v"
rm -rf "$ptxas_out"; mkdir -p "$ptxas_out"
n=0
for ptx in "$CARGO_TARGET_DIR"/release/build/candle-cp-kernels-*/out/*.ptx; do
  [ -f "$ptx" ] || continue
  ver=$(grep -m1 '^\.version' "$ptx" | awk '{print $2}')
  awk -v v="$ver" 'BEGIN { exit !(v + 0 <= 9.0) }' || { echo "ci-cuda: $ptx has PTX ISA $ver > 9.0 (CUDA 13.0 driver cannot load it)"; exit 1; }
  # PTX built for compute_90a (.target sm_90a: wgmma) assembles only for sm_90a.
  archs="sm_80 sm_90a"
  if grep -q '^\.target sm_90a' "$ptx"; then archs=sm_90a; fi
  for arch in $archs; do
    v="$ptxas_out/$(basename "$ptx" .ptx).$arch.txt"
    ptxas -arch="$arch" -v -o /dev/null "$ptx" >"$v" 2>&1 || { cat "$v"; exit 1; }
    # C7520: ptxas serialized the wgmma pipeline (flash_fwd_sm90.cu / flash_fwd_sm90_ws.cu /
    # flash_bwd_sm90.cu / flash_bwd_sm90_ws.cu would lose their overlap).
    if grep -q C7520 "$v"; then echo "ci-cuda: $ptx: $(grep C7520 "$v")"; exit 1; fi
  done
  n=$((n + 1))
done
[ "$n" -ge 11 ] || { echo "ci-cuda: expected 11 PTX files from candle-cp-kernels, found $n"; exit 1; }
# the probe kernels (issue 6) must be among the PTX assembled above
for f in probe probe_sm90; do
  [ -f "$ptxas_out/$f.sm_90a.txt" ] || { echo "ci-cuda: $f.ptx (candle-cp-kernels/kernels/$f.cu) was not built"; exit 1; }
done
# the warp-specialized forward (flash_fwd_sm90_ws.cu) and backward (flash_bwd_sm90_ws.cu) were
# built and do not spill (setmaxnreg: forward producer 40 / consumers 232 registers, backward
# producer 24 / consumers 240; see docs/kernels-sm90.md); C7520 is checked in the loop above
for f in flash_fwd_sm90_ws flash_bwd_sm90_ws; do
  [ -f "$ptxas_out/$f.sm_90a.txt" ] || { echo "ci-cuda: $f.ptx was not built"; exit 1; }
  if grep -E '[1-9][0-9]* bytes spill' "$ptxas_out/$f.sm_90a.txt"; then echo "ci-cuda: $f.cu spills registers"; exit 1; fi
done
# the pipelined tensor-core kernels (flash_fwd_pipe_*, flash_bwd_pipe_*, band entries, head
# dim 256 and the soft-capped flash_*_pipe_cap_* entries included) do not spill on either arch
for f in flash_fwd flash_bwd_pipe; do
  for arch in sm_80 sm_90a; do
    [ -f "$ptxas_out/$f.$arch.txt" ] || { echo "ci-cuda: $f.ptx was not built"; exit 1; }
    spills=$(awk -v pre="^${f%_pipe}_pipe" '/Function properties for/ {f=$NF} / bytes spill stores/ && f ~ pre && $5 != "0" {print f}' "$ptxas_out/$f.$arch.txt")
    [ -z "$spills" ] || { echo "ci-cuda: $f.cu spills registers on $arch in: $spills"; exit 1; }
  done
done
# the experts' grouped products (grouped_gemm.cu) do not spill on either arch
for arch in sm_80 sm_90a; do
  [ -f "$ptxas_out/grouped_gemm.$arch.txt" ] || { echo "ci-cuda: grouped_gemm.ptx was not built"; exit 1; }
  if grep -E '[1-9][0-9]* bytes spill' "$ptxas_out/grouped_gemm.$arch.txt"; then echo "ci-cuda: grouped_gemm.cu spills registers on $arch"; exit 1; fi
done
python3 candle-cp-kernels/emu/check_launch_args.py --ptx-dir "$CARGO_TARGET_DIR/release/build" || { echo "ci-cuda: a Rust kernel launch does not match its kernel (candle-cp-kernels/emu/check_launch_args.py)"; exit 1; }
echo "ci-cuda: ptxas and the launch check done after $(( $(date +%s) - start )) s"
# the kernel crate's unit tests (launch numbers and head-dim tables in src/flash/core.rs, the probe
# maps: host code, no device): built beside the packages and features of the build above (so that
# every dependency resolves as there and is reused: only the test harnesses compile), then run
# (the shim's libraries for the CUDA ones it links)
CANDLE_CP_REAL_NVCC="$CUDA_ROOT/bin/nvcc" NVCC="$ci_tk/bin/nvcc" \
  cargo test --release -j "$JOBS" -p candle-cp-kernels -p candle-cp-examples -p candle-cp-cli \
  --features candle-cp-examples/nccl,candle-cp-cli/cuda,candle-cp-kernels/cuda --lib --no-run >"$shim_dir/kernels-unit.log" 2>&1 \
  || { tail -40 "$shim_dir/kernels-unit.log"; echo "ci-cuda: candle-cp-kernels' unit tests did not build"; exit 1; }
unit_bin=$(sed -n 's/.*Executable unittests src\/lib.rs (\(.*candle_cp_kernels-[0-9a-f]*\))$/\1/p' "$shim_dir/kernels-unit.log" | tail -1)
[ -n "$unit_bin" ] || { cat "$shim_dir/kernels-unit.log"; echo "ci-cuda: no unit-test binary of candle-cp-kernels"; exit 1; }
LD_LIBRARY_PATH="$lib" "$unit_bin" >>"$shim_dir/kernels-unit.log" 2>&1 \
  || { tail -40 "$shim_dir/kernels-unit.log"; echo "ci-cuda: candle-cp-kernels' unit tests failed"; exit 1; }
echo "ci-cuda: candle-cp-kernels unit tests: $(grep '^test result' "$shim_dir/kernels-unit.log") (after $(( $(date +%s) - start )) s)"
bg_wait sims
echo "ci-cuda: the fragment-indexing simulations match (candle-cp-kernels/sim/)"

step_times=""  # "name: seconds" of every shim step, printed at the end
shim_step() {  # shim_step NAME CMD...: run, keep the output in $shim_log, show it on failure
  local name=$1 t0
  shift
  t0=$(date +%s)
  "$@" >"$shim_log" 2>&1 || { grep -v '^PASS' "$shim_log" | tail -60; echo "ci-cuda: host CUDA shim: $name failed"; exit 1; }
  step_times+="${step_times:+, }$name $(( $(date +%s) - t0 )) s"
}
# the benchmark binary the GPU check runs (every kernel family, the zigzag ring steps, the
# memory-bound kernels) and its table, at a tiny size: that they run, not what they measure
shim_step gpu_bench env LD_LIBRARY_PATH="$lib" timeout 300 "$CARGO_TARGET_DIR/release/examples/gpu_bench" --t 256 --heads 4 --d 128 \
  --iters 1 --impl pipelined,wgmma,wgmma-atomic,wgmma-ws,wgmma-tma,wgmma-tma-wide,atomic --ring-t 512 --ring-p 4 --mem 1 --docs 64 --docs-t 256 --window 33 --moe 2 --budget-s 200
grep '^{' "$shim_log" >"$shim_dir/bench.jsonl"
rows=$(grep -c '"impl":"candle-cp"' "$shim_dir/bench.jsonl" || true)
[ "$rows" = 14 ] || { cat "$shim_log"; echo "ci-cuda: gpu_bench under the shim printed $rows kernel rows, expected 14 (7 families x causal, full)"; exit 1; }
band_rows=$(grep -c '"impl":"candle-cp-band"' "$shim_dir/bench.jsonl" || true)
[ "$band_rows" = 1 ] || { cat "$shim_log"; echo "ci-cuda: gpu_bench --docs under the shim printed $band_rows band rows, expected 1"; exit 1; }
halo_rows=$(grep -c '"impl":"candle-cp-halo".*"halo":true' "$shim_dir/bench.jsonl" || true)
[ "$halo_rows" = 1 ] || { cat "$shim_log"; echo "ci-cuda: gpu_bench --window under the shim printed $halo_rows halo rows, expected 1"; exit 1; }
grouped_rows=$(grep -c '"impl":"candle-cp-grouped"' "$shim_dir/bench.jsonl" || true)
[ "$grouped_rows" = 6 ] || { cat "$shim_log"; echo "ci-cuda: gpu_bench --moe 2 under the shim printed $grouped_rows grouped-product rows, expected 6 (2 token counts x 3 products)"; exit 1; }
: >"$shim_dir/sdpa.jsonl"
shim_step gpu_table.py python3 scripts/gpu_table.py "$shim_dir/bench.jsonl" "$shim_dir/sdpa.jsonl"
echo "ci-cuda: gpu_bench + gpu_table.py ran under the shim ($rows kernel rows; timings meaningless on the CPU)"
# training parity: the README's fine-tuning example, 3 steps of zigzag CP = 2, on 2 "GPUs" under
# the shim vs the CPU, f32 and bf16 (the cuda run takes the CUDA kernels, optimizer, checkpoint);
# in f32 also over NCCL: one process with a thread per GPU, and two launched processes (RANK,
# WORLD_SIZE, MASTER_ADDR/PORT; the shim's NCCL across processes: CPEMU_NCCL_TRANSPORT=files)
same_loss() {  # same_loss A.jsonl B.jsonl TOL LABEL: equal train (and held-out, if any) losses over 3 steps
  python3 - "$@" <<'PY' || exit 1
import json, sys
recs = [[json.loads(l) for l in open(f)] for f in sys.argv[1:3]]
tol = float(sys.argv[3])
pairs = [(x["train_loss"], y["train_loss"]) for x, y in zip(*recs)]
evals = [(x["eval_loss"], y["eval_loss"]) for x, y in zip(*recs) if x.get("eval_loss") is not None or y.get("eval_loss") is not None]
ok = len(recs[0]) == len(recs[1]) == 3 and all(x is not None and y is not None for x, y in evals)
diff = max(abs(x - y) for x, y in pairs + (evals if ok else [])) if ok else float("inf")
held = f", {len(evals)} held-out" if evals else ""
print(f"ci-cuda: finetune_llama, 3 steps{held}: {sys.argv[4]} vs cpu loss max |diff| {diff:.1e} (tol {tol:.0e})")
sys.exit(0 if diff <= tol else 1)
PY
}
ft_bin="$CARGO_TARGET_DIR/release/examples/finetune_llama"
for dt in f32 bf16; do
  ft=(--cp 2 --cp-kind zigzag --seq-len 128 --steps 3 --save-every 0 --dtype "$dt")
  tol=$([ "$dt" = f32 ] && echo 1e-5 || echo 2e-3)
  # (the cuda-built binary links libcuda even when it computes on the CPU)
  shim_step "finetune_llama cpu $dt" env LD_LIBRARY_PATH="$lib" "$ft_bin" --device cpu "${ft[@]}" --out "$shim_dir/ft-cpu-$dt"
  shim_step "finetune_llama cuda $dt" env CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
    "$ft_bin" --device cuda --gpus 2 "${ft[@]}" --out "$shim_dir/ft-cuda-$dt"
  same_loss "$shim_dir/ft-cpu-$dt/metrics.jsonl" "$shim_dir/ft-cuda-$dt/metrics.jsonl" "$tol" "CP 2 zigzag, cuda $dt (shim, thread ranks on 2 devices)"
done
# LoRA on every projection (the base frozen: plain tensors, no gradient), with LoRA dropout (its
# keep masks drawn on the device by kernels/dropout.cu, the host's bits): the same losses
ftl=(--cp 2 --cp-kind zigzag --seq-len 128 --steps 3 --save-every 0 --dtype f32 --lora 8,16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --lora-dropout 0.1)
shim_step "finetune_llama cpu lora" env LD_LIBRARY_PATH="$lib" "$ft_bin" --device cpu "${ftl[@]}" --out "$shim_dir/ft-cpu-lora"
shim_step "finetune_llama cuda lora" env CPEMU_TRACE=1 CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" --device cuda --gpus 2 "${ftl[@]}" --out "$shim_dir/ft-cuda-lora"
grep -q 'launch dropout_keep_f32 ' "$shim_log" || { grep -v '^PASS' "$shim_log" | tail -20; echo "ci-cuda: the LoRA fine-tune with dropout did not launch dropout_keep_f32 (kernels/dropout.cu)"; exit 1; }
same_loss "$shim_dir/ft-cpu-lora/metrics.jsonl" "$shim_dir/ft-cuda-lora/metrics.jsonl" 1e-5 "CP 2 zigzag, LoRA on every projection with dropout 0.1, cuda f32 (shim, thread ranks on 2 devices)"
# the same over an NF4 base (its codes dequantized on the device by kernels/quant.cu, layer by
# layer inside the recompute checkpoints; the trace must show that kernel)
ftq=("${ftl[@]}" --quantize-base nf4,16 --recompute)
shim_step "finetune_llama cpu qlora" env LD_LIBRARY_PATH="$lib" "$ft_bin" --device cpu "${ftq[@]}" --out "$shim_dir/ft-cpu-qlora"
shim_step "finetune_llama cuda qlora" env CPEMU_TRACE=1 CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" --device cuda --gpus 2 "${ftq[@]}" --out "$shim_dir/ft-cuda-qlora"
grep -q 'launch dequant_nf4_f32 ' "$shim_log" || { grep -v '^PASS' "$shim_log" | tail -20; echo "ci-cuda: the NF4 fine-tune did not launch dequant_nf4_f32 (kernels/quant.cu)"; exit 1; }
same_loss "$shim_dir/ft-cpu-qlora/metrics.jsonl" "$shim_dir/ft-cuda-qlora/metrics.jsonl" 1e-5 "CP 2 zigzag, LoRA over an NF4 base with recompute, cuda f32 (shim, thread ranks on 2 devices)"
# a mixture of experts (4, 2 per token) with LoRA on every expert's projections (stacked factors
# through grouped matmuls), expert parallelism over the 2 CP ranks, and LoRA dropout keyed on
# (token, expert), the keys sent with the rows: routed on the device, the same losses
ftm=(--cp 2 --cp-kind zigzag --ep 2 --moe 4,2 --seq-len 128 --steps 3 --save-every 0 --dtype f32 --lora 8,16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --lora-dropout 0.1)
shim_step "finetune_llama cpu moe lora" env LD_LIBRARY_PATH="$lib" "$ft_bin" --device cpu "${ftm[@]}" --out "$shim_dir/ft-cpu-moe-lora"
shim_step "finetune_llama cuda moe lora" env CPEMU_TRACE=1 CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" --device cuda --gpus 2 "${ftm[@]}" --out "$shim_dir/ft-cuda-moe-lora"
grep -q 'launch moe_top_k' "$shim_log" || { grep -v '^PASS' "$shim_log" | tail -20; echo "ci-cuda: the MoE LoRA fine-tune did not launch moe_top_k (kernels/moe.cu)"; exit 1; }
grep -q 'launch grouped_gemm_tn_f32' "$shim_log" || { grep -v '^PASS' "$shim_log" | tail -20; echo "ci-cuda: the MoE LoRA fine-tune did not launch grouped_gemm_tn_f32 (kernels/grouped_gemm.cu)"; exit 1; }
same_loss "$shim_dir/ft-cpu-moe-lora/metrics.jsonl" "$shim_dir/ft-cuda-moe-lora/metrics.jsonl" 1e-5 "CP 2 zigzag x EP 2, MoE with LoRA on every expert and dropout 0.1, cuda f32 (shim, thread ranks on 2 devices)"
# the same on the per-expert path (one cuBLAS GEMM per expert: what `auto` runs for many rows per expert)
shim_step "finetune_llama cuda moe lora per-expert" env CANDLE_CP_GROUPED_GEMM=per-expert CPEMU_TRACE=1 CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" --device cuda --gpus 2 "${ftm[@]}" --out "$shim_dir/ft-cuda-moe-lora-pe"
if grep -q 'launch grouped_gemm_' "$shim_log"; then echo "ci-cuda: CANDLE_CP_GROUPED_GEMM=per-expert still launched the grouped kernel"; exit 1; fi
same_loss "$shim_dir/ft-cpu-moe-lora/metrics.jsonl" "$shim_dir/ft-cuda-moe-lora-pe/metrics.jsonl" 1e-5 "the same on the per-expert path (CANDLE_CP_GROUPED_GEMM=per-expert)"
# DoRA on every projection with LoRA dropout 0.1 (training: the base on x plus (W' - W) on the
# dropped input, W' - W one graph node whose backward rebuilds W + sBA; the held-out pass at
# step 3: W' = m/|W + sBA| (W + sBA) in place of W), TP 2 + SP: the same losses
ftd=(--tp 2 --sp --seq-len 128 --steps 3 --save-every 0 --dtype f32 --lora 8,16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --dora --lora-dropout 0.1 --eval-every 3)
shim_step "finetune_llama cpu dora" env LD_LIBRARY_PATH="$lib" "$ft_bin" --device cpu "${ftd[@]}" --out "$shim_dir/ft-cpu-dora"
shim_step "finetune_llama cuda dora" env CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" --device cuda --gpus 2 "${ftd[@]}" --out "$shim_dir/ft-cuda-dora"
same_loss "$shim_dir/ft-cpu-dora/metrics.jsonl" "$shim_dir/ft-cuda-dora/metrics.jsonl" 1e-5 "TP 2 + SP, DoRA on every projection with dropout 0.1, cuda f32 (shim, thread ranks on 2 devices)"
# packed documents (blank-line separated paragraphs of a doc) with a sliding window of 40 on a
# contiguous ring of 4 ranks (shards of 64 tokens: the ring stops after one hop) on 2 devices
ftp=(--cp 4 --cp-kind ring --seq-len 256 --steps 3 --save-every 0 --dtype f32 --data docs/parallelism.md --pack-docs --sliding-window 40)
shim_step "finetune_llama cpu packed window" env LD_LIBRARY_PATH="$lib" "$ft_bin" --device cpu "${ftp[@]}" --out "$shim_dir/ft-cpu-packed"
shim_step "finetune_llama cuda packed window" env CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" --device cuda --gpus 2 "${ftp[@]}" --out "$shim_dir/ft-cuda-packed"
same_loss "$shim_dir/ft-cpu-packed/metrics.jsonl" "$shim_dir/ft-cuda-packed/metrics.jsonl" 1e-5 "CP 4 ring, packed documents + sliding window 40, cuda f32 (shim, thread ranks on 2 devices)"
# the same in bf16 with head dim 64 on the warp-specialized Hopper kernels with TMA loads
# (CANDLE_CP_FLASH_IMPL=wgmma-tma: every ring step's band runs flash_{fwd,bwd}_wgmma_tma_band_*;
# checked in the trace)
ftw=("${ftp[@]/f32/bf16}" --hidden 128 --heads 2 --kv-heads 1)
shim_step "finetune_llama cpu packed window bf16 d64" env LD_LIBRARY_PATH="$lib" "$ft_bin" --device cpu "${ftw[@]}" --out "$shim_dir/ft-cpu-packed-ws"
shim_step "finetune_llama cuda packed window wgmma-tma" env CANDLE_CP_FLASH_IMPL=wgmma-tma CPEMU_TRACE=1 CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" --device cuda --gpus 2 "${ftw[@]}" --out "$shim_dir/ft-cuda-packed-ws"
for kern in flash_fwd_wgmma_tma_band_bf16_d64 flash_bwd_wgmma_tma_band_bf16_d64; do
  grep -q "launch $kern " "$shim_log" || { echo "ci-cuda: the wgmma-tma fine-tune did not launch $kern"; exit 1; }
done
same_loss "$shim_dir/ft-cpu-packed-ws/metrics.jsonl" "$shim_dir/ft-cuda-packed-ws/metrics.jsonl" 2e-3 "CP 4 ring, packed documents + window 40, bf16 d64, cuda wgmma-tma band kernels (shim)"
# a Phi-4-mini-style model in bf16 with heads of 96 (Phi-3-mini's width): LongRoPE past its
# original length, RoPE on 3/4 of each head, zigzag CP 2: Auto runs the pipelined d96 kernels
# (checked in the trace)
ftf=(--phi3 --partial-rotary 0.75 --hidden 192 --heads 2 --kv-heads 1 --cp 2 --cp-kind zigzag --seq-len 128 --steps 3 --save-every 0 --dtype bf16)
shim_step "finetune_llama cpu phi3 bf16 d96" env LD_LIBRARY_PATH="$lib" "$ft_bin" --device cpu "${ftf[@]}" --out "$shim_dir/ft-cpu-phi3"
shim_step "finetune_llama cuda phi3 bf16 d96" env CPEMU_TRACE=1 CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" --device cuda --gpus 2 "${ftf[@]}" --out "$shim_dir/ft-cuda-phi3"
for kern in flash_fwd_pipe_bf16_d96 flash_bwd_pipe_dkdv_bf16_d96 flash_bwd_pipe_dq_bf16_d96; do
  grep -q "launch $kern " "$shim_log" || { echo "ci-cuda: the Phi-3 d96 fine-tune did not launch $kern"; exit 1; }
done
same_loss "$shim_dir/ft-cpu-phi3/metrics.jsonl" "$shim_dir/ft-cuda-phi3/metrics.jsonl" 2e-3 "CP 2 zigzag, Phi-4-mini-style (partial RoPE, LongRoPE) bf16 d96, cuda pipelined kernels (shim)"
ft=(--cp 2 --cp-kind zigzag --seq-len 128 --steps 3 --save-every 0 --dtype f32 --device cuda --comm nccl)
# (with --recompute: the layers rerun in backward, NCCL collectives included; with
# --overlap-grad-sync each layer's gradient all-reduce starts on a second communicator
# during the backward: all_reduce_start on the comm stream)
shim_step "finetune_llama nccl threads" env CPEMU_DEVICES=2 LD_LIBRARY_PATH="$lib" timeout 600 \
  "$ft_bin" "${ft[@]}" --gpus 2 --recompute --overlap-grad-sync --out "$shim_dir/ft-nccl"
same_loss "$shim_dir/ft-cpu-f32/metrics.jsonl" "$shim_dir/ft-nccl/metrics.jsonl" 1e-5 "CP 2 zigzag, cuda f32 (shim, NCCL ranks, one thread per device, --recompute --overlap-grad-sync)"
# two launched processes, one NCCL rank each (RANK/WORLD_SIZE/LOCAL_RANK, the id over a TCP
# store on MASTER_ADDR:MASTER_PORT, the shim's NCCL across processes): the same losses
port=$((20000 + RANDOM % 20000))
# (with --zero1: the optimizer state split over the two processes, gathered by NCCL; the
# first run reduce-scatters after the backward; the second is ZeRO-2 (f32 slices) with the
# reduce-scatters started during the backward, layer by layer: reduce_scatter_start on the
# comm stream of a second communicator; and the updated parameters' all-gathers started after
# the step and waited for layer by layer in the next forward: all_gather_start on a third)
shim_step "finetune_llama 2 processes" env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port EMU_SHIM_LIB="$lib" timeout 600 \
  candle-cp-kernels/emu/shim/launch.sh 2 "$ft_bin" "${ft[@]}" --zero1 --out "$shim_dir/ft-procs"
same_loss "$shim_dir/ft-cpu-f32/metrics.jsonl" "$shim_dir/ft-procs/metrics.jsonl" 1e-5 "CP 2 zigzag, cuda f32 (shim, 2 launched processes, NCCL over TCP rendezvous, --zero1)"
port=$((20000 + RANDOM % 20000))
shim_step "finetune_llama 2 processes overlap" env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port EMU_SHIM_LIB="$lib" timeout 600 \
  candle-cp-kernels/emu/shim/launch.sh 2 "$ft_bin" "${ft[@]}" --zero2 --recompute --overlap-grad-sync --overlap-param-gather --out "$shim_dir/ft-procs-overlap"
same_loss "$shim_dir/ft-cpu-f32/metrics.jsonl" "$shim_dir/ft-procs-overlap/metrics.jsonl" 1e-5 "CP 2 zigzag, cuda f32 (shim, 2 launched processes, --zero2 --recompute --overlap-grad-sync --overlap-param-gather)"
# a process killed mid-run: the survivor must fail, not hang, within a bounded time. With the
# shim's default the lost peer fails its collective (NCCL reports a remote error); with
# CPEMU_NCCL_PEER_ABORT=hang it stays pending, as within a node on GPUs, and NcclGroup's
# watchdog must time it out (--timeout 5) and abort.
kill_rank1() {  # kill_rank1 LABEL EXPECTED_TEXT MAX_SECONDS ENV...
  local label=$1 want=$2 max=$3 d="$shim_dir/ft-kill" p0 p1 st t0 dt
  shift 3
  rm -rf "$d"; mkdir -p "$d"
  port=$((20000 + RANDOM % 20000))
  for r in 0 1; do
    env "$@" RUST_BACKTRACE=0 LD_LIBRARY_PATH="$lib" CPEMU_DEVICES=2 CPEMU_NCCL_TRANSPORT=files RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$ft_bin" --cp 2 --seq-len 128 --steps 500 --save-every 0 \
      --device cuda --comm nccl --timeout 5 --out "$d/out" >"$d/r$r.log" 2>&1 &
    if [ $r = 0 ]; then p0=$!; else p1=$!; disown "$p1"; fi  # (disowned: no "Killed" job notice)
  done
  for _ in $(seq 1 600); do [ -s "$d/out/metrics.jsonl" ] && break; sleep 0.1; done
  t0=$(date +%s.%N)
  kill -9 "$p1"
  # (the processes run without `timeout`, which would put them in a child the kill misses:
  # bound the wait here, and kill a survivor that outlives it)
  for _ in $(seq 1 $((10 * (max + 10)))); do kill -0 "$p0" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$p0" 2>/dev/null || true
  st=0; wait "$p0" || st=$?
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
  if [ "$st" = 0 ] || ! grep -q "$want" "$d/r0.log" || ! awk -v x="$dt" -v m="$max" 'BEGIN { exit !(x <= m) }'; then
    tail -20 "$d/r0.log"; echo "ci-cuda: $label: expected rank 0 to fail with '$want' within $max s (exit $st after $dt s)"; exit 1
  fi
  echo "ci-cuda: finetune_llama, rank 1 of 2 processes killed ($label): rank 0 failed after $dt s: $(grep -o "$want" "$d/r0.log" | head -1)"
}
kill_rank1 "remote error" "rank 1 of 2 died" 20 CPEMU_NCCL_PEER_ABORT=error
kill_rank1 "peer hangs, watchdog" "did not complete within the timeout 5s" 30 CPEMU_NCCL_PEER_ABORT=hang
# the drop-in example (an existing candle model with our ops) on CUDA: ranks share one device
for l in zigzag ulysses "zigzag --recompute"; do
  # shellcheck disable=SC2086 # (word-split: the layout and an optional flag)
  shim_step "drop_in cuda $l" env LD_LIBRARY_PATH="$lib" timeout 300 "$CARGO_TARGET_DIR/release/examples/drop_in" --device cuda --cp 2 --seq 128 --layout $l
  echo "ci-cuda: drop_in --device cuda --layout $l under the shim: $(grep '^worst' "$shim_log")"
done
# generation with the KV cache sharded over 4 virtual ranks on CUDA (the example exits non-zero
# unless the tokens equal the single-device run's); a contiguous ring with a sliding window,
# and sampled tokens (the same seeded draws on every rank), too; and CP 2 x TP 2 + SP x DP 2
# (vocabulary-parallel embedding and head, each TP rank caching its KV head, DP rows)
for g in "--cp-kind zigzag" "--cp-kind ring --sliding-window 48" "--cp-kind allgather --temperature 0.9 --top-p 0.9 --sample-seed 3" "--cp 2 --tp 2 --sp --dp 2 --batch 2"; do
  # shellcheck disable=SC2086 # (word-split: the flags)
  shim_step "generate cuda $g" env LD_LIBRARY_PATH="$lib" timeout 300 "$CARGO_TARGET_DIR/release/examples/generate" --device cuda --prompt-len 256 --new-tokens 4 $g
  echo "ci-cuda: generate --device cuda $g under the shim: $(grep '^logits max' "$shim_log"); $(grep '^tokens:' "$shim_log")"
done
bg_wait gpu-check
echo "ci-cuda: $(grep '^gpu_check:' "$shim_dir/gpu_check.log") (the cuda binary on the CPU under the host CUDA shim; with the steps above beside it, $(( $(date +%s) - t_shim )) s)"
echo "ci-cuda: random configurations on the wgmma-tma kernels: $(grep '^gpu_check:' "$shim_dir/gpu_check_random.log")"
for cc in 80 86; do
  echo "ci-cuda: on an emulated sm_$cc (CPEMU_CC=$cc): $(grep '^gpu_check:' "$shim_dir/gpu_check_sm$cc.log") ($(grep -c 'refused on this device' "$shim_dir/gpu_check_sm$cc.log") refusals for want of shared memory)"
done
bg_wait emu
echo "ci-cuda: $(tail -1 "$shim_dir/bg-emu.log") (kernel source under CPU emulation, combinations $EMU_COMBOS; in the background since the build)"
echo "ci-cuda: shim steps: $step_times"
echo "ci-cuda: OK ($n PTX files, ISA <= 9.0, ptxas sm_80/sm_90a clean, simulations match, CUDA path under the shim) in $(( $(date +%s) - start )) s"
