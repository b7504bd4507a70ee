#!/usr/bin/env bash
# Launches a `--features cuda,nccl` binary as P processes on the host CUDA shim, one rank per
# process, as torchrun-like launchers do on GPUs: RANK=r, LOCAL_RANK=r (its device),
# WORLD_SIZE=P, the NCCL unique id through a fresh CANDLE_CP_NCCL_ID_FILE (NcclGroup::from_env;
# or, when the caller sets MASTER_ADDR / MASTER_PORT, through rank 0's TCP store),
# the shim's NCCL over the files transport (CPEMU_NCCL_TRANSPORT=files, see nccl.cpp).
# Output lines are prefixed with "[r] ". Waits for every rank; once one fails, the others get
# GRACE seconds to fail on their own (the transport reports a lost peer within ~0.1 s), then
# are killed. Exit status: 0 if every rank exited 0, else the first failing rank's status.
# Usage: candle-cp-kernels/emu/shim/launch.sh P BINARY [ARGS...]
# Env: EMU_SHIM_LIB (library dir, default target/emu-shim/lib from build.sh), CPEMU_DEVICES
# (default P), GRACE (default 30), CPEMU_NCCL_DIR, CPEMU_WAIT_TIMEOUT_S (passed through).
set -uo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 P BINARY [ARGS...]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
P=$1
shift
lib=${EMU_SHIM_LIB:-$root/target/emu-shim/lib}
[ -f "$lib/libnccl.so.2" ] || { echo "launch.sh: no $lib/libnccl.so.2 (run build.sh)" >&2; exit 2; }
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CPEMU_NCCL_TRANSPORT=files
export CPEMU_DEVICES=${CPEMU_DEVICES:-$P} WORLD_SIZE=$P
idfile=
if [ -z "${MASTER_ADDR:-}" ]; then  # (with MASTER_ADDR set the id goes over its TCP store)
  idfile=$(mktemp -u "${TMPDIR:-/tmp}/cpemu-launch-id.XXXXXX")
  export CANDLE_CP_NCCL_ID_FILE=$idfile
fi
declare -A rank_of
for ((r = 0; r < P; r++)); do
  RANK=$r LOCAL_RANK=$r "$@" > >(sed -u "s/^/[$r] /") 2>&1 &
  rank_of[$!]=$r
done
status=0
killer=
while [ ${#rank_of[@]} -gt 0 ]; do
  pid=
  if wait -n -p pid "${!rank_of[@]}"; then st=0; else st=$?; fi
  [ -n "$pid" ] || break
  r=${rank_of[$pid]}
  unset "rank_of[$pid]"
  [ "$st" = 0 ] && continue
  echo "launch.sh: rank $r exited with status $st" >&2
  [ $status = 0 ] && status=$st
  if [ -z "$killer" ] && [ ${#rank_of[@]} -gt 0 ]; then
    (sleep "${GRACE:-30}"; echo "launch.sh: killing the ranks still running after ${GRACE:-30} s" >&2; kill -9 "${!rank_of[@]}" 2>/dev/null) &
    killer=$!
  fi
done
[ -n "$killer" ] && kill "$killer" 2>/dev/null
wait
[ -n "$idfile" ] && rm -f "$idfile"
exit $status
