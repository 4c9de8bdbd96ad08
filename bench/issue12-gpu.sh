#!/usr/bin/env bash
# One GPU call for issue 12's measurements: the allocation-heavy workloads interleaved
# (native, expandable, gmlake, native2; BENCH_ROUNDS for rounds), the latency benchmark's
# random mixed pattern per allocator in LATENCY_ROUNDS rotated rounds (default 3), and the
# cost of the debug mode on the LoRA job. Writes under $OUT/bench.
#   bash bench/issue12-gpu.sh .artifacts/gpu/libgmlake_torch.so
set -uo pipefail
cd "$(dirname "$0")/.."
lib=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
# shellcheck source=bench/rounds.sh
. bench/rounds.sh
check_rounds LATENCY_ROUNDS "${LATENCY_ROUNDS:-3}"
O=${OUT:-bench/out}/bench
mkdir -p "$O"
export PYTHONPATH=python PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=$O BENCH_NO_LATENCY=1 BENCH_NO_SEARCH=1 BENCH_STEPS=${BENCH_STEPS:-15} \
  BENCH_WORKLOADS=${BENCH_WORKLOADS:-"stress llm_lora"} BENCH_BUDGET_S=${BENCH_BUDGET_S:-300} \
  bash bench/run-gpu.sh "$lib" 2>&1 | tail -25
echo "== latency, random mixed pattern (200k operations, 10k live), ${LATENCY_ROUNDS:-3} rounds rotated"
if bash bench/build-latency.sh build/bench >"$O/latency-build.log" 2>&1; then
  # Rounds rotated (one run's ns per pair moves by 20-60% on a shared host): each round's
  # records marked `bench_round`, pooled by bench/report.py (each round against native's).
  : >"$O/latency.jsonl"
  for round in $(seq 1 "${LATENCY_ROUNDS:-3}"); do
    for a in $(rotated "$round" native expandable gmlake); do
      part=$O/latency.part.jsonl
      : >"$part"
      case $a in
        native) env -u PYTORCH_CUDA_ALLOC_CONF timeout 60 build/bench/latency --allocator native --no-fixed --no-stitch --mixed-ops 200000 --out "$part" ;;
        expandable) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 60 build/bench/latency --allocator expandable --no-fixed --no-stitch --mixed-ops 200000 --out "$part" ;;
        gmlake) timeout 60 build/bench/latency --allocator gmlake --lib "$lib" --conf "" --no-fixed --no-stitch --mixed-ops 200000 --out "$part" ;;
      esac >>"$O/latency.log" 2>&1 || echo "latency/$a exited with $?"
      mark_round "$round" "$part" >>"$O/latency.jsonl"
      rm -f "$part"
    done
  done
  python3 bench/report.py --summary "$O/latency.jsonl" | sed -n '/^mixed/,/^$/p'
else
  tail -5 "$O/latency-build.log"
fi
echo "== debug mode cost on llm_lora (debug:all against plain, 4 steps after 1 warm-up)"
for conf in "" "debug:all"; do
  timeout 150 python3 bench/workloads/llm_lora.py --allocator gmlake --gmlake-conf "$conf" --steps 4 --warmup 1 \
    --label "gmlake${conf:+ $conf}" --out "$O/debug.jsonl" >>"$O/debug.log" 2>&1 || echo "debug run '$conf' exited with $?"
done
python3 - "$O/debug.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(f"{r['allocator']:>18}: ok={r.get('ok')} median_step={r.get('median_step_s', 0) * 1e3:.1f} ms "
          f"peak_reserved={r.get('peak_reserved_bytes', 0) / 2**30:.2f} GiB util={r.get('utilization') or 0:.3f}")
PY
