#!/usr/bin/env bash
# Issue 12, random regimes: the page size as the lever (fewer, larger handles), measured on the
# GPU. The stress workload (random 1-512 MiB tensors, random lifetimes) and the latency
# benchmark's random mixed pattern, each allocator in its own process, interleaved: native,
# expandable, gmlake at the default 2 MiB pages and at larger pages, native again.
#   bash bench/pagesize-gpu.sh .artifacts/gpu/libgmlake_torch.so
# Writes $OUT/bench/pagesize.jsonl (workload records) and $OUT/bench/latency-pagesize.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
lib=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
O=${OUT:-bench/out}/bench
mkdir -p "$O"
export PYTHONPATH=python PYTHONUNBUFFERED=1 GMLAKE_LIBRARY="$lib"
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
STEPS=${BENCH_STEPS:-15}
# gmlake settings tried besides the defaults (GMLAKE_CONF syntax, space-separated lists):
CONFS=${PAGESIZE_CONFS:-"page_size:16MiB page_size:32MiB page_size:16MiB,util_target:0.95"}
LAT_CONFS=${PAGESIZE_LAT_CONFS:-"page_size:4MiB page_size:8MiB page_size:16MiB"}
run() { # allocator label conf
  local a=$1 label=$2 conf=${3:-}
  local env_=()
  [ "$a" = expandable ] && env_=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
  env "${env_[@]}" timeout -k 5 240 python3 bench/workloads/stress.py --allocator "$a" ${conf:+--gmlake-conf "$conf"} \
    --label "$label" --steps "$STEPS" --out "$O/pagesize.jsonl" >>"$O/pagesize.log" 2>&1 || echo "stress/$label exited with $?"
}
echo "== stress ($STEPS measured steps)"
run native native
run expandable expandable
run gmlake gmlake
for c in $CONFS; do run gmlake "gmlake $c" "$c"; done
run native native2
python3 - "$O/pagesize.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r.get("kind", "run") == "run" or "median_step_s" in r]
base = min((r["median_step_s"] for r in rows if r.get("allocator") in ("native", "expandable") and r.get("median_step_s")), default=None)
print(f"{'allocator':>42} {'median ms':>9} {'vs best':>7} {'util':>6} {'calls/step med':>14} {'mean':>8}")
for r in rows:
    m = r.get("median_step_s")
    if not m:
        print(f"{r.get('allocator', '?'):>42} failed: {str(r)[:200]}")
        continue
    print(f"{r['allocator']:>42} {m * 1e3:>9.1f} {m / base if base else 0:>7.2f} {r.get('utilization') or 0:>6.3f} "
          f"{r.get('median_driver_calls_per_step', '-'):>14} {r.get('mean_driver_calls_per_step', 0) or 0:>8.0f}")
PY
echo "== latency, random mixed pattern (200k operations, 10k live)"
if bash bench/build-latency.sh build/bench >"$O/latency-build.log" 2>&1; then
  L="$O/latency-pagesize.jsonl"
  lat() { timeout -k 5 90 build/bench/latency "$@" --no-fixed --no-stitch --mixed-ops 200000 --out "$L" >>"$O/latency-pagesize.log" 2>&1 || echo "latency $* exited with $?"; }
  lat --allocator native
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lat --allocator expandable
  lat --allocator gmlake --lib "$lib" --conf ""
  for c in $LAT_CONFS; do lat --allocator gmlake --lib "$lib" --conf "$c"; done
  lat --allocator native
  LAT_CONFS="$LAT_CONFS" python3 - "$L" <<'PY'
import json, os, sys
labels = ["native", "expandable", "gmlake"] + ["gmlake " + c for c in os.environ["LAT_CONFS"].split()] + ["native2"]
rows = [json.loads(l) for l in open(sys.argv[1]) if '"mixed"' in l]
for label, r in zip(labels, rows):
    util = r["peak_active_bytes"] / max(r["peak_reserved_bytes"], 1)
    print(f"{label:>24} {r['ns_per_op']:>8.0f} ns/op  alloc p50 {r['alloc_p50_ns']:>7.0f} p99 {r['alloc_p99_ns']:>8.0f}  "
          f"device allocs {r['device_allocs_timed']:>5}  stitches {r['stitches_timed']:>5}  util {util:.3f}")
PY
else
  tail -5 "$O/latency-build.log"
fi
