#!/usr/bin/env bash
# Issue 17: DeepSpeed ZeRO-3 fine-tuning (bench/workloads/zero3.py) under native, expandable
# segments and gmlake, for the strategies N, R, LR, RO, LRO; then the largest LR batch under a
# memory cap. One process per GPU (torchrun when NPROC > 1).
#
#   bash bench/deepspeed/run.sh .artifacts/gpu/libgmlake_torch.so
#
# Environment: NPROC (GPUs, default 1), MODEL (default opt-1.3b), BATCH (8), STEPS (6),
# STRATEGIES ("N R LR RO LRO"; set but empty: none, e.g. for the batch search alone), ALLOCATORS ("native expandable gmlake native2"; an entry
# gmlake+key:value,... runs gmlake with that GMLAKE_CONF, e.g. gmlake+page_size:8MiB),
# REPEAT (1: how many times each strategy runs the allocator list, in order, e.g. native
# expandable gmlake native2 native expandable gmlake native2: the table gives each allocator's
# median over its runs and their spread, so that the noise can be judged),
# SEARCH (1: search the largest LR batch; CAP_GIB, default 40; SEARCH_ALLOCATORS, default
# "native expandable gmlake", e.g. gmlake alone where the others' batches are known: the
# search depends on memory only, not on time), DS_WHEELS (a folder of wheels
# to install DeepSpeed and its missing dependencies from, without network; default
# .artifacts/ds, made by bench/deepspeed/wheels.sh), TRACE_STRATEGIES (strategies whose native
# run records its allocator trace, for `gmlake replay`: $OUT/zero3/zero3-S-native.pickle.gz),
# BUDGET_S (0: none; else a run starts only if one as long as the last run of its strategy, or
# of the search, else the longest so far, ends within BUDGET_S seconds of the start, and a run
# that takes longer than that is stopped at BUDGET_S: set it under the machine's time limit so
# that the table is still written),
# MACHINE_CHECK (1: time the host's Python loop and each GPU's bf16 matrix product before and
# after the runs, bench/machine_check.py, into $OUT/zero3/machine.jsonl: whether two calls'
# steps may be compared at all), EXTRA_ARGS (more arguments for every run of
# bench/workloads/zero3.py, e.g. "--profile-step 2": a GPU timeline of the third measured step
# on every rank, beside results.jsonl).
# Results: $OUT/zero3/results.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
lib=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
O=${OUT:-bench/out}/zero3
mkdir -p "$O"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 GMLAKE_LIBRARY="$lib"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8   # deterministic cuBLAS: equal losses across allocators
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
NPROC=${NPROC:-1}
MODEL=${MODEL:-opt-1.3b}
BATCH=${BATCH:-8}
STEPS=${STEPS:-6}
STRATEGIES=${STRATEGIES-"N R LR RO LRO"}   # unset: all five; set empty: none
ALLOCATORS=${ALLOCATORS:-"native expandable gmlake native2"}
REPEAT=${REPEAT:-1}
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || { echo "REPEAT must be a positive integer, got '$REPEAT'"; exit 2; }
BUDGET_S=${BUDGET_S:-0}
[[ "$BUDGET_S" =~ ^[0-9]+$ ]] || { echo "BUDGET_S must be a whole number of seconds, got '$BUDGET_S'"; exit 2; }
wheels=${DS_WHEELS:-.artifacts/ds}
if ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links "$wheels" deepspeed >"$O/install.log" 2>&1 \
    || { echo "cannot install deepspeed from $wheels (see $O/install.log)"; tail -5 "$O/install.log"; exit 2; }
fi
python3 -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__)" 2>&1 | grep -v "^\[" | tail -1
machine_check() { # the host's and GPUs' speed now (bench/machine_check.py), before and after the runs
  [ "${MACHINE_CHECK:-1}" = 1 ] && [ -f bench/machine_check.py ] || return 0
  # Not past the budget: the table comes first.
  [ "$BUDGET_S" -gt 0 ] && [ $((SECONDS + 20)) -gt "$BUDGET_S" ] && [ "$1" = after ] && return 0
  echo "   machine $1: $(python3 bench/machine_check.py --out "$O/machine.jsonl" 2>&1 | tail -1)"
}
machine_check before
launch() { # allocator, then the workload's arguments
  local a=$1; shift
  local label=$a env_=() alloc=$a pre=()
  [ "$a" = native2 ] && alloc=native
  [ "$a" = expandable ] && env_=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
  if [[ "$a" == gmlake+* ]]; then  # gmlake+key:value,...: gmlake with that GMLAKE_CONF
    alloc=gmlake
    env_=(GMLAKE_CONF="${a#gmlake+}")
  fi
  if [ "$NPROC" -gt 1 ]; then
    pre=(torchrun --standalone --nproc-per-node "$NPROC")
    [ "$alloc" = gmlake ] && pre+=(-m gmlake)
    pre+=(bench/workloads/zero3.py)
  else
    pre=(python3 bench/workloads/zero3.py)
  fi
  # A run never outlives BUDGET_S: a run longer than the last of its kind (a search that
  # bisects further, a slower machine) is stopped at the budget's end, so the table is still
  # written before the machine's time limit ends the whole command.
  local limit=${RUN_TIMEOUT:-300}
  if [ "$BUDGET_S" -gt 0 ]; then
    local left=$((BUDGET_S - SECONDS))
    [ "$left" -lt "$limit" ] && limit=$((left > 1 ? left : 1))
  fi
  env "${env_[@]}" timeout -k 10 "$limit" "${pre[@]}" --allocator "$alloc" --label "$label" "$@"
}
declare -A took=()   # strategy (or "search") -> seconds its last run took
longest=0
fits() { # $1: a key of `took`. Whether a run as long as its last one (else the longest so far) ends within BUDGET_S.
  [ "$BUDGET_S" -gt 0 ] || return 0
  local est=${took[$1]:-$longest}
  [ $((SECONDS + est)) -le "$BUDGET_S" ] && return 0
  echo "   skipped: such a run took ${est} s, and $((BUDGET_S - SECONDS)) s of BUDGET_S=$BUDGET_S are left"
  return 1
}
ran() { # $1: key, $2: start
  took[$1]=$((SECONDS - $2))
  [ "${took[$1]}" -gt "$longest" ] && longest=${took[$1]}
  echo "   took ${took[$1]} s"
}
for s in $STRATEGIES; do
  for rep in $(seq 1 "$REPEAT"); do
    for a in $ALLOCATORS; do
      echo "== $s / $a (run $rep of $REPEAT)"
      fits "$s" || continue
      trace=()   # native's first run records the trace
      [ "$a" = native ] && [ "$rep" = 1 ] && [[ " ${TRACE_STRATEGIES:-} " == *" $s "* ]] \
        && trace=(--record-trace "$O/zero3-$s-native.pickle.gz")
      t0=$SECONDS
      launch "$a" "${trace[@]}" --strategy "$s" --model "$MODEL" --batch "$BATCH" --steps "$STEPS" --tag "zero3-$s" \
        --out "$O/results.jsonl" ${EXTRA_ARGS:-} >>"$O/run.log" 2>&1 || echo "   exited with $?"
      ran "$s" "$t0"
    done
  done
done
if [ "${SEARCH:-1}" = 1 ]; then
  for a in ${SEARCH_ALLOCATORS:-native expandable gmlake}; do
    echo "== largest LR batch under ${CAP_GIB:-40} GiB / $a"
    [ -n "${took[search]:-}" ] || took[search]=$((longest + ${SEARCH_TIME:-150}))
    fits search || continue
    t0=$SECONDS
    launch "$a" --strategy LR --model "$MODEL" --batch "$BATCH" --no-run --search --cap-gib "${CAP_GIB:-40}" \
      --search-time "${SEARCH_TIME:-150}" --tag zero3-LR-search --out "$O/results.jsonl" >>"$O/run.log" 2>&1 || echo "   exited with $?"
    ran search "$t0"
  done
fi
machine_check after
python3 bench/deepspeed/table.py "$O/results.jsonl" | tee "$O/table.md"
