#!/usr/bin/env bash
# One FSDP2 CPU-offload run (bench/workloads/fsdp_offload.py) per allocator, same seed and
# shapes: native with its allocator trace recorded (for `gmlake replay`), then gmlake and
# expandable segments, so that the replay's prediction can be set against the GPU's figures
# of the same job (issue 13). Records go to $OUT/fsdp.jsonl, output to $OUT/fsdp.log,
# the trace to $OUT/fsdp-native.pickle.gz.
#   bench/fsdp-trace.sh [libgmlake_torch.so]      env: FSDP_STEPS (12), FSDP_WARMUP (2)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
[ -n "${1:-}" ] && export GMLAKE_LIBRARY="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
args=(--steps "${FSDP_STEPS:-12}" --warmup "${FSDP_WARMUP:-2}" --out "$OUT/fsdp.jsonl")
rc=0
for a in native gmlake expandable; do
  extra=()
  [ "$a" = native ] && extra=(--record-trace "$OUT/fsdp-native.pickle.gz")
  echo "== fsdp_offload under $a"
  echo "== $a" >>"$OUT/fsdp.log"
  python3 bench/workloads/fsdp_offload.py --allocator "$a" "${args[@]}" "${extra[@]}" \
    > "$OUT/fsdp-run.log" 2>&1 || { rc=1; tail -20 "$OUT/fsdp-run.log"; }
  cat "$OUT/fsdp-run.log" >>"$OUT/fsdp.log"; rm -f "$OUT/fsdp-run.log"
done
python3 - "$OUT/fsdp.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    g = r.get("gmlake", {})
    print(f"{r['allocator']:>10}: ok={r.get('ok')} util={r.get('utilization') or 0:.3f} "
          f"peak_active={r.get('peak_active_bytes', 0) / 2**30:.2f} GiB "
          f"peak_reserved={r.get('peak_reserved_bytes', 0) / 2**30:.2f} GiB "
          f"median_step={r.get('median_step_s', 0) * 1e3:.1f} ms trace_events={r.get('trace_events', '-')} "
          f"stitches={g.get('stitches', '-')} calls/step={r.get('median_driver_calls_per_step', '-')}")
PY
exit $rc
