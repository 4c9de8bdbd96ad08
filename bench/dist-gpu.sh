#!/usr/bin/env bash
# DDP and FSDP2 on two GPUs (tests/gpu/cases/dist_train.py under torchrun), each allocator in
# its own run, interleaved per job: native, gmlake, native again (the noise). Prints, per rank:
# utilization, median step time, peak reserved, gmlake's driver calls a step after warm-up,
# its stream waits and alias evictions, and the last loss (equal across allocators).
#
#   bash bench/dist-gpu.sh [path/to/libgmlake_torch.so]
#
# Knobs: STEPS (default 200), MODES (default "fsdp ddp"), GMLAKE_CONF (gmlake's configuration,
# passed through), CONFS ("conf1;conf2": several gmlake runs per job, one per configuration,
# in place of one with GMLAKE_CONF), REPEAT (default 1: passes through the list per job; the
# summary, bench/dist_summary.py, compares each gmlake run with the faster native run of its
# own pass). Writes under ${OUT:-bench/out/dist}: one JSON per run and rank, the runs' logs,
# times.txt and summary.txt. NCCL's NVLink multicast stays off.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GMLAKE_DIST_STEPS=${STEPS:-200} PYTHONPATH=$PWD/python
export GMLAKE_LIBRARY=${1:-${GMLAKE_LIBRARY:-$PWD/.artifacts/gpu/libgmlake_torch.so}}
OUT=${OUT:-bench/out/dist}
mkdir -p "$OUT"
: >"$OUT/times.txt"
run() { # mode name gmlake? [conf]
  local mode=$1 name=$2 t0=$SECONDS
  local extra=()
  [ "$3" = 1 ] && extra=(-m gmlake --quiet)
  GMLAKE_CONF="${4:-${GMLAKE_CONF:-}}" GMLAKE_DIST_RUN="-$name" timeout 600 python3 -m torch.distributed.run \
    --standalone --nproc-per-node 2 "${extra[@]}" tests/gpu/cases/dist_train.py "$mode" "$OUT" \
    >"$OUT/$mode-$name.log" 2>&1
  echo "$mode $name rc=$? $((SECONDS - t0)) s" >>"$OUT/times.txt"
}
REPEAT=${REPEAT:-1}
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || { echo "REPEAT must be a positive integer, got '$REPEAT'"; exit 2; }
for mode in ${MODES:-fsdp ddp}; do
  for ((pass = 1; pass <= REPEAT; pass++)); do
    sfx=""
    [ "$pass" -gt 1 ] && sfx="-p$pass"
    run "$mode" "native$sfx" 0
    if [ -n "${CONFS:-}" ]; then
      # The added ';' keeps a last empty entry (the defaults): read drops one trailing empty field.
      IFS=';' read -ra confs <<<"$CONFS;"
      i=0
      for c in "${confs[@]}"; do run "$mode" "g$i$sfx" 1 "$c"; i=$((i + 1)); done
    else
      run "$mode" "g$sfx" 1
    fi
    run "$mode" "native2$sfx" 0
  done
done
python3 bench/dist_summary.py "$OUT" | tee "$OUT/summary.txt"
cat "$OUT/times.txt"
