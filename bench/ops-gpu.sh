#!/usr/bin/env bash
# The allocator alone on recorded jobs (docs/benchmarks.md, "The allocator's own time on
# recorded jobs"): bench/latency.cpp --ops over operation lists, each allocator in its own
# process, interleaved per list: native, expandable, gmlake, native again.
#
#   bash bench/ops-gpu.sh --prepare [DIR]        # here (needs cargo): one list per bundled trace
#   bash bench/ops-gpu.sh DIR LIB [LIST...]      # on the GPU machine (no Rust needed there)
#
# --prepare writes DIR/NAME.ops (default .artifacts/ops) from every tests/traces/*.pickle* with
# `gmlake ops`; carry DIR with the library. The run builds build/bench/latency, writes
# $OUT/bench/ops.jsonl (one record per run, the file emptied first) and prints a table: ns per operation in each list's
# second half (its steady state), gmlake's driver calls there, then the whole list repeated.
# Environment: GMLAKE_CONF (gmlake's settings, e.g. page_size:8MiB), OPS_PASSES (default 3),
# OPS_ROUNDS (default 1): rounds of the whole interleaved order; with more than one, a last
# table gives each allocator's median over its runs (a single run of a short list moves by
# 20-30% on the GPU machine's host). OPS_LIB_B: a second gmlake library (another build, to
# compare two versions of the core in one call), run right after the first as `gmlake-b`.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --prepare ]; then
  dir=${2:-.artifacts/ops}
  mkdir -p "$dir"
  cargo build --release -q -p gmlake-cli || exit 1
  for t in tests/traces/*.pickle*; do
    name=$(basename "$t"); name=${name%%.pickle*}
    target/release/gmlake ops "$t" --out "$dir/$name.ops" || exit 1
  done
  exit 0
fi
[ $# -ge 2 ] || { sed -n 2,13p "$0" >&2; exit 2; }
dir=$1
[ -f "$2" ] || { echo "ops-gpu: no library at $2" >&2; exit 2; }
lib=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
shift 2
lib_b=""
if [ -n "${OPS_LIB_B:-}" ]; then
  [ -f "$OPS_LIB_B" ] || { echo "ops-gpu: no library at OPS_LIB_B=$OPS_LIB_B" >&2; exit 2; }
  lib_b=$(cd "$(dirname "$OPS_LIB_B")" && pwd)/$(basename "$OPS_LIB_B")
fi
lists=("$@")
if [ ${#lists[@]} -eq 0 ]; then
  for f in "$dir"/*.ops; do lists+=("$(basename "$f" .ops)"); done
fi
[ ${#lists[@]} -gt 0 ] || { echo "ops-gpu: no .ops file in $dir (bash bench/ops-gpu.sh --prepare)" >&2; exit 2; }
O=${OUT:-bench/out}/bench
mkdir -p "$O"
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
bash bench/build-latency.sh build/bench >"$O/ops-build.log" 2>&1 || { tail -20 "$O/ops-build.log"; exit 1; }
: >"$O/ops.jsonl"  # latency appends: this run's records only
for ((round = 1; round <= ${OPS_ROUNDS:-1}; round++)); do
  for name in "${lists[@]}"; do
    if [ ! -f "$dir/$name.ops" ]; then
      [ "$round" = 1 ] && echo "ops-gpu: no list $dir/$name.ops" >&2
      continue
    fi
    for a in native expandable gmlake ${lib_b:+gmlake-b} native; do
      env_=()
      [ "$a" = expandable ] && env_=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
      alloc=$a l=$lib out="$O/ops.jsonl"
      # The second library's records are written apart and appended relabelled.
      [ "$a" = gmlake-b ] && { alloc=gmlake l=$lib_b out="$O/ops-b.tmp"; : >"$out"; }
      env "${env_[@]}" timeout -k 5 120 build/bench/latency --allocator "$alloc" --lib "$l" \
        ${GMLAKE_CONF:+--conf "$GMLAKE_CONF"} --ops "$dir/$name.ops" --ops-passes "${OPS_PASSES:-3}" \
        --out "$out" >/dev/null 2>>"$O/ops.log" || echo "$name/$a exited with $?"
      if [ "$a" = gmlake-b ]; then
        python3 -c 'import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); r["allocator"] = "gmlake-b"; print(json.dumps(r))' "$out" >>"$O/ops.jsonl"
      fi
    done
  done
done
python3 - "$O/ops.jsonl" <<'PY'
import json, statistics, sys
runs = {}
print(f"{'list':<22} {'allocator':<11} {'ns/op':>8} {'calls':>7} {'util':>6}  repeated passes ns/op (calls)")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("test") != "ops":
        continue
    calls = sum(v for k, v in r.items() if k.startswith("calls_timed.") and k.split(".")[1] in
                ("map", "unmap", "set_access", "create_physical", "release_physical"))
    calls = calls if r["allocator"].startswith("gmlake") else "-"
    rep = ", ".join(f"{x:.0f}" for x in r.get("repeat_ns_per_op", []))
    rc = r.get("repeat_driver_calls", -1)
    print(f"{r['ops_file'][:-4]:<22} {r['allocator']:<11} {r['ns_per_op']:>8.0f} {calls:>7} "
          f"{r['utilization']:>6.3f}  {rep}" + (f" ({rc})" if rc >= 0 else ""))
    runs.setdefault((r["ops_file"][:-4], r["allocator"]), []).append(r["ns_per_op"])
if any(len(v) > 2 for v in runs.values()):
    print(f"\n{'list':<22} {'allocator':<11} {'median ns/op':>12} {'runs':>5}  gmlake / faster baseline")
    for (name, a), v in runs.items():
        base = [statistics.median(runs[(name, b)]) for b in ("native", "expandable") if (name, b) in runs]
        ratio = f"{statistics.median(v) / min(base):.2f}" if a.startswith("gmlake") and base else ""
        print(f"{name:<22} {a:<11} {statistics.median(v):>12.0f} {len(v):>5}  {ratio}")
PY
