#!/usr/bin/env bash
# Runs the in-tree route's GPU test on a GPU machine, from what scripts/build-patched-c10.sh
# staged (no Rust, no torch, no network needed there: each version's folder holds its patched
# libc10.so / libc10_cuda.so, the libcudart it was built with and gpu_test, RPATH $ORIGIN).
#
#   scripts/c10-gpu-test.sh [DIR]        DIR: .artifacts/c10-gpu (holds 1.13.1/, 2.6.0/, ...)
#
# build-patched-c10.sh also copies this script into that folder, so the folder alone is enough:
#   bash .artifacts/c10-gpu/c10-gpu-test.sh          (DIR defaults to the script's own folder
#                                                     when it holds */gpu_test)
#
# Per version, gpu_test (scripts/c10-only/gpu_test.cpp) runs in a process of its own per setting:
#   default                          gmlake (stitch checked in gmlake's counters)
#   vmmDefragment=0                  PyTorch's native allocator (the control; gmlake-only checks
#                                    print "skip")
#   PYTORCH_CUDA_ALLOC_CONF=backend:native   (2.x) native
#   PYTORCH_CUDA_ALLOC_CONF=backend:gmlake   (2.x) gmlake, named explicitly
# Logs go to $OUT/c10-gpu-test/ when OUT is set (else to a temporary folder, printed), with
# summary.txt. Exit status: 0 when every run passed, 1 otherwise, 2 nothing to run.
# Environment: GPU_TEST_TIMEOUT (seconds per run, 600), CUDA_VISIBLE_DEVICES as usual.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ $# -ge 1 ]; then
  DIR="$1"
elif compgen -G "$HERE/*/gpu_test" >/dev/null; then
  DIR="$HERE"
else
  DIR="$HERE/../.artifacts/c10-gpu"
fi
[ -d "$DIR" ] || { echo "c10-gpu-test: no folder $DIR (build it with scripts/build-patched-c10.sh)" >&2; exit 2; }
DIR="$(cd "$DIR" && pwd)"
if [ -n "${OUT:-}" ]; then LOGS="$OUT/c10-gpu-test"; else LOGS="$(mktemp -d /tmp/c10-gpu-test.XXXXXX)"; fi
mkdir -p "$LOGS"
TIMEOUT="${GPU_TEST_TIMEOUT:-600}"
SUMMARY="$LOGS/summary.txt"

say() { echo "$*" | tee -a "$SUMMARY"; }
: > "$SUMMARY"
say "c10-gpu-test: $DIR on $(hostname) $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "system: $(uname -m), $(ldd --version 2>&1 | head -1), libstdc++ up to $(strings "$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')" 2>/dev/null | grep -o '^GLIBCXX_[0-9.]*' | sort -uV | tail -1)"
if command -v nvidia-smi >/dev/null 2>&1; then
  say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')"
fi

versions=()
for d in "$DIR"/*/; do
  [ -f "$d/gpu_test" ] && versions+=("$(basename "$d")")
done
[ ${#versions[@]} -gt 0 ] || { say "c10-gpu-test: no */gpu_test under $DIR"; exit 2; }

failed=0
ran=0
rows=()
for v in "${versions[@]}"; do
  V="$DIR/$v"
  if [ ! -x "$V/gpu_test" ]; then
    # (A copy that lost its modes, or a read-only one: run from a writable copy.)
    chmod +x "$V/gpu_test" 2>/dev/null || { T=$(mktemp -d) && cp -r "$V" "$T/" && V="$T/$v" && chmod +x "$V/gpu_test"; }
  fi
  say ""
  say "== torch $v ($(head -2 "$V/BUILD-INFO.txt" 2>/dev/null | tail -1))"
  # The folder must be enough: every library found there or in the system's C/C++ runtime.
  deps=$(env -u LD_LIBRARY_PATH ldd "$V/gpu_test" 2>&1)
  if echo "$deps" | grep -qE 'not found|version .* not found'; then
    say "FAIL torch $v: gpu_test cannot load here:"
    echo "$deps" | grep -E 'not found' | tee -a "$SUMMARY"
    say "  (needs: $(grep -E '^  lib|^  gpu_test' "$V/BUILD-INFO.txt" 2>/dev/null | awk '{print $2, $3}' | sort -uV | tail -1))"
    failed=$((failed + 1))
    ran=$((ran + 1))
    rows+=("$v|all|-|FAIL (cannot load)|-|-")
    continue
  fi
  settings=("default|gmlake|" "vmmDefragment=0|native|vmmDefragment=0")
  case "$v" in
    1.*) ;;
    *) settings+=("backend:native|native|PYTORCH_CUDA_ALLOC_CONF=backend:native"
                  "backend:gmlake|gmlake|PYTORCH_CUDA_ALLOC_CONF=backend:gmlake") ;;
  esac
  for s in "${settings[@]}"; do
    IFS='|' read -r label want envs <<< "$s"
    log="$LOGS/$v-${label//[:=]/-}.log"
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    (cd "$V" && env -u LD_LIBRARY_PATH -u vmmDefragment -u PYTORCH_CUDA_ALLOC_CONF $envs \
      timeout "$TIMEOUT" ./gpu_test --expect "$want") > "$log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}')
    ran=$((ran + 1))
    result=$(grep '^RESULT' "$log" | tail -1)
    counts=$(echo "$result" | sed -n 's/.*(\(.*\))$/\1/p')
    stitch=$(grep -m1 'gmlake: stitches [0-9]* -> ' "$log" | sed 's/^ *\. *gmlake: //' || true)
    if [ "$rc" = 0 ]; then
      status=PASS
    else
      status="FAIL (exit $rc)"
      [ "$rc" = 2 ] && status="FAIL (no usable GPU)"
      [ "$rc" = 124 ] && status="FAIL (timeout ${TIMEOUT}s)"
      failed=$((failed + 1))
    fi
    say "$(printf '%-6s %-16s %-7s %-18s %6ss  %s  %s' "$v" "$label" "$want" "$status" "$secs" "${counts:-no RESULT line}" "$stitch")"
    if [ "$rc" != 0 ]; then
      if [ -n "$result" ]; then
        grep -E '^FAIL|FAIL ' "$log" | head -20 | sed 's/^/    /' | tee -a "$SUMMARY"
      else
        tail -5 "$log" | sed 's/^/    /' | tee -a "$SUMMARY"
      fi
    fi
    rows+=("$v|$label|$want|$status|${secs}s|${stitch:--}")
  done
done

say ""
say "| torch | setting | backend | result | time | stitches (gmlake counters) |"
say "|---|---|---|---|---|---|"
for r in "${rows[@]}"; do
  IFS='|' read -r a b c d e f <<< "$r"
  say "| $a | $b | $c | $d | $e | $f |"
done
say ""
if [ "$failed" = 0 ]; then
  say "c10-gpu-test: OK: $ran runs passed (logs: $LOGS)"
  exit 0
fi
say "c10-gpu-test: FAIL: $failed of $ran runs failed (logs: $LOGS)"
exit 1
