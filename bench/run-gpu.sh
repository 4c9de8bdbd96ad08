#!/usr/bin/env bash
# The GPU benchmark suite of issue 6, in one command, on a machine with one CUDA GPU:
#
#   PYTHONPATH=python bash bench/run-gpu.sh [path/to/libgmlake_torch.so]
#
# builds bench/latency.cpp, then runs, each in its own process and allocator after allocator
# (native, expandable segments, gmlake):
#   - the C++ latency benchmark (fixed sizes, random mixed pattern, stitch cost);
#   - every workload of bench/workloads (measured run + largest batch under a memory cap).
# Writes under ${OUT:-bench/out}: results.jsonl (every JSON record), run.log (everything
# printed), summary.txt (the closing tables). Turn the results into docs/benchmarks.md with
#   python3 bench/report.py bench/out/results.jsonl
#
# The library: the argument, else $GMLAKE_LIBRARY, else what `gmlake.library_path()` finds.
# Knobs (environment):
#   BENCH_BUDGET_S  total wall-time budget in seconds (default 450); a phase that would start
#                   with less than its minimum left is skipped and recorded as skipped
#   BENCH_QUICK=1   fewer steps, trials and latency iterations (a smoke run, ~3 minutes)
#   BENCH_WORKLOADS workloads to run (default: "llm_lora moe conv kv_infer fsdp_offload
#                   concat_cache stress")
#   BENCH_ALLOCATORS allocators, run in this order per workload (default: "native expandable
#                   gmlake native2"; native2 is native again, whose ratio to native is the noise;
#                   gmlake+key:value,... is gmlake with that GMLAKE_CONF, labelled so)
#   BENCH_ROUNDS    rounds (default 1): each workload runs its allocators
#                   N times, round after round, each round's order rotated by one (round 2
#                   starts with the second allocator; the largest-batch search in the first
#                   round only); report.py pools each allocator's ratio to native's run of
#                   the same round (geometric mean), then divides by the faster baseline's.
#                   One process's step times can sit 20-40% from another's of the same
#                   allocator on a shared host, so one round cannot show 2%. The latency
#                   benchmark runs in rounds too (rotated; after the first, the random mixed
#                   pattern only), its records marked `bench_round`
#   BENCH_LATENCY_BIN a built bench/latency to run instead of building one
#   BENCH_STEPS     measured steps of every workload (overrides the defaults and quick mode;
#                   a workload's timeout grows with it past the workload's default steps)
#   BENCH_NO_SEARCH=1 skip the largest-batch searches (step times and driver calls only)
#   BENCH_NO_LATENCY=1 / BENCH_NO_WORKLOADS=1  skip a part
#   GMLAKE_CONF     gmlake's configuration (passed through)
#   BENCH_COMMIT    the commit to record (where the copy has no .git)
#   VMM_PROBE       a build of rust/gmlake-cuda's vmm_probe example to run too (default:
#                   .artifacts/gpu/vmm_probe when it exists); output in vmm_probe.txt
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
RES=$OUT/results.jsonl
LOG=$OUT/run.log
SUMMARY=$OUT/summary.txt
: >"$RES"
: >"$LOG"
BUDGET=${BENCH_BUDGET_S:-450}
QUICK=${BENCH_QUICK:-0}
WORKLOADS=${BENCH_WORKLOADS:-llm_lora moe conv kv_infer fsdp_offload concat_cache stress}
ALLOCATORS=${BENCH_ALLOCATORS:-native expandable gmlake native2}
ROUNDS=${BENCH_ROUNDS:-1}
# shellcheck source=bench/rounds.sh
. bench/rounds.sh
check_rounds BENCH_ROUNDS "$ROUNDS"
PY=${PYTHON:-python3}
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (the machines' rule), also for NCCL in fsdp_offload.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF

log() { echo "[run-gpu $((SECONDS - T0))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
record() { echo "$1" >>"$RES"; }

lib=${1:-${GMLAKE_LIBRARY:-}}
if [ -z "$lib" ]; then
  lib=$("$PY" -c 'import gmlake; print(gmlake.library_path())' 2>>"$LOG") || lib=""
fi
if [ -n "$lib" ] && [ -f "$lib" ]; then
  lib=$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")
  export GMLAKE_LIBRARY=$lib
  log "gmlake library: $lib"
else
  log "WARNING: libgmlake_torch.so not found (argument, GMLAKE_LIBRARY, gmlake.library_path()): gmlake runs will fail"
  lib=""
fi

# ---- environment record
"$PY" - "$QUICK" "$BUDGET" "$*" >>"$RES" 2>>"$LOG" <<'PY'
import json, subprocess, sys, time, os, platform
rec = {"kind": "env", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "quick": sys.argv[1] == "1",
       "budget_s": int(sys.argv[2]), "args": sys.argv[3], "python": platform.python_version(),
       "host": platform.node(), "gmlake_library": os.environ.get("GMLAKE_LIBRARY", ""),
       "gmlake_conf": os.environ.get("GMLAKE_CONF", "")}
def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:
        return f"error: {e}"
q = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm",
        "--format=csv,noheader"])
rec["nvidia_smi"] = q
parts = [p.strip() for p in q.splitlines()[0].split(",")] if q and not q.startswith("error") else []
if len(parts) >= 2:
    rec["gpu"], rec["driver"] = parts[0], parts[1]
commit = os.environ.get("BENCH_COMMIT") or sh(["git", "rev-parse", "HEAD"])
rec["git_commit"] = commit if commit and not commit.startswith("error") else None
if rec["git_commit"] and not os.environ.get("BENCH_COMMIT"):
    rec["git_dirty"] = bool(sh(["git", "status", "--porcelain", "--untracked-files=no"]))
try:
    import torch
    rec["torch"] = torch.__version__
    rec["cuda"] = torch.version.cuda
    rec["cudnn"] = torch.backends.cudnn.version()
except Exception as e:
    rec["torch_error"] = str(e)
for mod in ("transformers", "peft", "torchvision"):
    try:
        rec[mod] = __import__(mod).__version__
    except Exception as e:
        rec[mod] = f"missing: {e}"
try:
    import gmlake
    rec["gmlake_build"] = gmlake.build_info()
except Exception as e:
    rec["gmlake_build"] = f"error: {e}"
print(json.dumps(rec, sort_keys=True))
PY
log "environment: $(tail -n 1 "$RES" | cut -c1-400)"

# ---- C++ latency benchmark
lat_bin=build/bench/latency
if [ -n "${BENCH_LATENCY_BIN:-}" ]; then
  lat_bin=$BENCH_LATENCY_BIN
  log "latency benchmark: $lat_bin (BENCH_LATENCY_BIN, not built)"
elif [ "${BENCH_NO_LATENCY:-0}" != 1 ]; then
  log "building $lat_bin"
  if ! bash bench/build-latency.sh build/bench >>"$LOG" 2>&1; then
    log "ERROR: building the latency benchmark failed (see run.log)"
    record '{"kind":"skipped","what":"latency","why":"build failed"}'
    lat_bin=""
  fi
fi

lat_args=()
[ "$QUICK" = 1 ] && lat_args+=(--quick)
run_latency() { # allocator round
  local a=$1 round=$2 t rc=0 rfield="" flags=()
  # With rounds, the records of a run say its round as `bench_round` (the stitch test's
  # records have a `round` of their own), and rounds after the first time only the random
  # mixed pattern: the test whose allocators differ by far less than one run's noise.
  [ "$ROUNDS" -gt 1 ] && rfield=",\"bench_round\":$round"
  [ "$round" -gt 1 ] && flags+=(--no-fixed --no-stitch)
  t=$(left)
  if [ "$t" -lt 40 ]; then
    log "skipping latency/$a: ${t}s left"
    record "{\"kind\":\"skipped\",\"what\":\"latency\",\"allocator\":\"$a\",\"why\":\"budget\"$rfield}"
    return
  fi
  [ "$t" -gt 120 ] && t=120
  log "latency/$a$([ "$ROUNDS" -gt 1 ] && echo " round $round/$ROUNDS") (timeout ${t}s)"
  local part=$OUT/latency.part.jsonl
  : >"$part"
  case $a in
  native | native2) timeout -k 5 "$t" "$lat_bin" --allocator native --out "$part" ${lat_args[@]+"${lat_args[@]}"} \
    ${flags[@]+"${flags[@]}"} >>"$LOG" 2>&1 || rc=$? ;;
  expandable) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 "$t" "$lat_bin" --allocator expandable \
    --out "$part" ${lat_args[@]+"${lat_args[@]}"} ${flags[@]+"${flags[@]}"} >>"$LOG" 2>&1 || rc=$? ;;
  gmlake) timeout -k 5 "$t" "$lat_bin" --allocator gmlake --lib "$lib" --conf "" --out "$part" ${lat_args[@]+"${lat_args[@]}"} \
    ${flags[@]+"${flags[@]}"} >>"$LOG" 2>&1 || rc=$? ;;
  *) log "latency: no run for allocator $a"; rc=2 ;;
  esac
  if [ "$ROUNDS" -gt 1 ]; then
    mark_round "$round" "$part" >>"$RES"
  else
    cat "$part" >>"$RES"
  fi
  rm -f "$part"
  if [ "$rc" != 0 ]; then
    log "latency/$a exited with $rc"
    record "{\"kind\":\"failed\",\"what\":\"latency\",\"allocator\":\"$a\",\"rc\":$rc$rfield}"
  fi
}
if [ -n "$lat_bin" ] && [ "${BENCH_NO_LATENCY:-0}" != 1 ]; then
  # native2 is native's second workload run; a gmlake+key:value label has no latency run (the
  # binary's records name the allocator only), as before rounds.
  lat_order=()
  for a in $ALLOCATORS; do
    case $a in native2 | gmlake+*) ;; *) lat_order+=("$a") ;; esac
  done
  for round in $(seq 1 "$ROUNDS"); do
    for a in $(rotated "$round" "${lat_order[@]}"); do run_latency "$a" "$round"; done
  done
fi

# ---- raw driver costs: rust/gmlake-cuda's vmm_probe example, when a build of it was carried
# (cargo build --release -p gmlake-cuda --example vmm_probe; copy to .artifacts/gpu/).
probe=${VMM_PROBE:-.artifacts/gpu/vmm_probe}
if [ -x "$probe" ] && [ "$(left)" -gt 60 ]; then
  log "vmm_probe ($probe) -> $OUT/vmm_probe.txt"
  timeout -k 5 60 "$probe" >"$OUT/vmm_probe.txt" 2>&1 || log "vmm_probe exited with $?"
  cat "$OUT/vmm_probe.txt" >>"$LOG"
fi

# ---- workloads
# Per workload: process timeout (s), search time (s), minimum time worth starting (s), extra flags.
wl_timeout() { case $1 in llm_lora) echo 100 ;; kv_infer) echo 80 ;; fsdp_offload) echo 90 ;; *) echo 60 ;; esac; }
wl_search() { case $1 in llm_lora) echo 30 ;; kv_infer) echo 20 ;; fsdp_offload) echo 25 ;; *) echo 20 ;; esac; }
wl_quick_flags() {
  case $1 in
  llm_lora) echo "--steps 5 --warmup 2 --search-trials 5" ;;
  kv_infer) echo "--steps 3 --warmup 1 --search-trials 4 --layers 6 --new-min 8 --new-max 24" ;;
  fsdp_offload) echo "--steps 3 --warmup 1 --search-trials 4" ;;
  *) echo "--steps 5 --warmup 2 --search-trials 5" ;;
  esac
}

run_workload() { # workload allocator round
  local w=$1 a=$2 round=$3 t s rc=0 rfield=""
  # With rounds, a run's skipped or failed record says which round it was.
  [ "$ROUNDS" -gt 1 ] && rfield=",\"round\":$round"
  t=$(left)
  if [ "$t" -lt 30 ]; then
    log "skipping $w/$a: ${t}s left"
    record "{\"kind\":\"skipped\",\"what\":\"workload\",\"workload\":\"$w\",\"allocator\":\"$a\",\"why\":\"budget\"$rfield}"
    return
  fi
  local cap base
  cap=$(wl_timeout "$w")
  # The timeouts fit each workload's default steps: more steps (BENCH_STEPS) get more time in
  # proportion (kv_infer's 20 steps need about four times its 5).
  base=$(sed -n 's/^DEFAULTS = {"steps": \([0-9]*\).*/\1/p' "bench/workloads/$w.py")
  if [ -n "${BENCH_STEPS:-}" ] && [ -n "$base" ] && [ "$base" -gt 0 ] && [ "$BENCH_STEPS" -gt "$base" ]; then
    cap=$((cap * BENCH_STEPS / base))
  fi
  [ "$t" -gt "$cap" ] && t=$cap
  s=$(wl_search "$w")
  # Leave the search at most 60% of the process's time.
  [ "$s" -gt $((t * 6 / 10)) ] && s=$((t * 6 / 10))
  local flags=(--out "$RES" --tag "run-gpu")
  [ "$ROUNDS" -gt 1 ] && flags+=(--round "$round")
  [ "${BENCH_NO_SEARCH:-0}" = 1 ] || [ "$round" -gt 1 ] || flags+=(--search --search-time "$s")
  [ -n "${BENCH_STEPS:-}" ] && flags+=(--steps "$BENCH_STEPS")
  if [ "$QUICK" = 1 ]; then
    # shellcheck disable=SC2207
    flags+=($(wl_quick_flags "$w"))
  fi
  log "$w/$a$([ "$ROUNDS" -gt 1 ] && echo " round $round/$ROUNDS") (timeout ${t}s, search ${s}s)"
  local script=bench/workloads/$w.py
  case $a in
  native) timeout -k 10 "$t" "$PY" "$script" --allocator native "${flags[@]}" >>"$LOG" 2>&1 || rc=$? ;;
  native2) timeout -k 10 "$t" "$PY" "$script" --allocator native --label native2 "${flags[@]}" >>"$LOG" 2>&1 || rc=$? ;;
  expandable) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 "$t" "$PY" "$script" \
    --allocator expandable "${flags[@]}" >>"$LOG" 2>&1 || rc=$? ;;
  gmlake) timeout -k 10 "$t" "$PY" -m gmlake "$script" --allocator gmlake "${flags[@]}" >>"$LOG" 2>&1 || rc=$? ;;
  gmlake+*) GMLAKE_CONF="${a#gmlake+}" timeout -k 10 "$t" "$PY" -m gmlake "$script" --allocator gmlake \
    --label "$a" "${flags[@]}" >>"$LOG" 2>&1 || rc=$? ;;
  *) log "unknown allocator $a"; rc=2 ;;
  esac
  if [ "$rc" != 0 ]; then
    log "$w/$a exited with $rc$([ "$rc" = 124 ] && echo ' (timeout)')"
    record "{\"kind\":\"failed\",\"what\":\"workload\",\"workload\":\"$w\",\"allocator\":\"$a\",\"rc\":$rc$rfield}"
  fi
}
if [ "${BENCH_NO_WORKLOADS:-0}" != 1 ]; then
  for w in $WORKLOADS; do
    for round in $(seq 1 "$ROUNDS"); do
      # shellcheck disable=SC2086
      for a in $(rotated "$round" $ALLOCATORS); do run_workload "$w" "$a" "$round"; done
    done
  done
fi

log "done in $((SECONDS - T0))s; results: $RES ($(wc -l <"$RES") records)"
"$PY" bench/report.py --summary "$RES" >"$SUMMARY" 2>>"$LOG" || log "report.py --summary failed"
cat "$SUMMARY"
