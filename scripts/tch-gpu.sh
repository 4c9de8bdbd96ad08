#!/usr/bin/env bash
# The tch example on a GPU machine with torch installed for python3 (torch 2.11) and no Rust:
# trains the same transformer, same seed, under PyTorch's native allocator and under gmlake,
# and checks that
#   - allocations went through gmlake (its counters moved; torch's CUDA allocator registry
#     pointed at gmlake's allocator),
#   - tensors held correct data (the data checks compared every tensor with the CPU's
#     expectation; checksums, losses and the logits of a fixed batch equal the native run's),
#   - an install after the first CUDA tensor is refused with a clear error.
# Logs and a summary go to $OUT (default target/tch-gpu).
#
#   scripts/tch-gpu.sh [BUNDLE]
#
# BUNDLE (default .artifacts/tch) holds tch-train and libgmlake_torch.so, built on a machine
# with Rust by `scripts/build-tch-example.sh --bundle`. Environment: STEPS (100), SEED (1234),
# EXTRA_ARGS (more tch-train options, for both runs), PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.."

BUNDLE="${1:-.artifacts/tch}"
OUT="${OUT:-$PWD/target/tch-gpu}"
STEPS="${STEPS:-100}"
SEED="${SEED:-1234}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
BIN="$BUNDLE/tch-train"
LIB="$(cd "$BUNDLE" 2>/dev/null && pwd)/libgmlake_torch.so"
for f in "$BIN" "$LIB"; do
  [ -f "$f" ] || { echo "tch-gpu: $f missing (build it with scripts/build-tch-example.sh --bundle)" >&2; exit 2; }
done
chmod +x "$BIN" 2>/dev/null || true

# The binary links libtorch*.so by name: point the loader at the installed torch's lib folder
# (its libtorch_cuda.so finds the CUDA libraries of the nvidia-* packages by its own RUNPATH).
TORCH_LIB=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))') \
  || { echo "tch-gpu: python3 cannot import torch" >&2; exit 2; }
TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)')
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset GMLAKE_LIBRARY PYTORCH_CUDA_ALLOC_CONF
echo "tch-gpu: torch $TORCH_VERSION at $TORCH_LIB; bundle $BUNDLE; out $OUT"
if ldd "$BIN" | grep -q 'not found'; then
  ldd "$BIN" | tee "$OUT/ldd.txt"
  echo "tch-gpu: $BIN has unresolved libraries (above)" >&2
  exit 2
fi

ARGS=(--steps "$STEPS" --seed "$SEED")
# shellcheck disable=SC2206
[ -n "${EXTRA_ARGS:-}" ] && ARGS+=($EXTRA_ARGS)

run() { # name, tch-train arguments...
  local name="$1"; shift
  local t0=$SECONDS
  "$BIN" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "tch-gpu: $name: exit $rc in $((SECONDS - t0)) s (log $OUT/$name.log)"
  tail -n 12 "$OUT/$name.log" | sed 's/^/    /'
  return $rc
}

run native --allocator native "${ARGS[@]}" --json "$OUT/native.json"; rc_native=$?
run gmlake --allocator gmlake --library "$LIB" "${ARGS[@]}" --json "$OUT/gmlake.json"; rc_gmlake=$?
run late --allocator gmlake --library "$LIB" --install-late; rc_late=$?

"$PYTHON" - "$OUT" "$rc_native" "$rc_gmlake" "$rc_late" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
out, rc_native, rc_gmlake, rc_late = sys.argv[1], *map(int, sys.argv[2:])
fails, warns, lines = [], [], []
def check(ok, what, warn_only=False):
    lines.append(f"{'ok  ' if ok else ('WARN' if warn_only else 'FAIL')} {what}")
    if not ok:
        (warns if warn_only else fails).append(what)
def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)
    except Exception as e:
        return None
n, g = load("native"), load("gmlake")
check(rc_native == 0 and n is not None, f"native run completed (exit {rc_native})")
check(rc_gmlake == 0 and g is not None, f"gmlake run completed (exit {rc_gmlake})")
late = open(os.path.join(out, "late.log")).read() if os.path.exists(os.path.join(out, "late.log")) else ""
check(rc_late == 0 and "refused as expected" in late and "gmlake_tch::install()" in late,
      "install after the first CUDA tensor is refused with Error::TooLate and a clear message")
if n and g:
    gm = g.get("gmlake") or {}
    check("gmlake" in g["torch_allocator_type"].lower(),
          f"torch's CUDA allocator in the gmlake run is gmlake's ({g['torch_allocator_type']})")
    check("gmlake" not in n["torch_allocator_type"].lower(),
          f"torch's CUDA allocator in the native run is native ({n['torch_allocator_type']})")
    check(gm.get("allocations", 0) > 0, f"gmlake counted allocations ({gm.get('allocations')})")
    check(gm.get("reserved_peak", 0) > 0, f"gmlake reserved memory (peak {gm.get('reserved_peak')} B)")
    check(gm.get("counters_agree_with_torch", False),
          "torch's counters (c10 allocator registry) equal gmlake's own", warn_only=True)
    check(gm.get("stitches_after_first_check", 0) > 0,
          f"the data check's large tensors were stitched from freed pages "
          f"({gm.get('stitches_after_first_check')} stitches; {gm.get('stitches')} in the whole run)",
          warn_only=True)
    check(n["data_check_ok"] and g["data_check_ok"],
          "data checks: every tensor equals the CPU's expectation under both allocators")
    check(n["data_checksum"] == g["data_checksum"], f"data checksums equal ({g['data_checksum']})")
    if n["logits_hash"] == g["logits_hash"]:
        check(True, f"logits of a fixed batch after training: bitwise equal (hash {g['logits_hash']})")
    else:
        rel = abs(n["logits_sum"] - g["logits_sum"]) / max(1e-12, abs(n["logits_sum"]))
        check(rel < 1e-4, f"logits differ bitwise; sums {n['logits_sum']} vs {g['logits_sum']} (rel {rel:.2e})",
              warn_only=rel < 1e-4)
    ln, lg = n["losses"], g["losses"]
    if ln == lg:
        check(True, f"losses of all {len(lg)} steps identical (last {lg[-1]:.6f}, first {lg[0]:.6f})")
    else:
        rel = max(abs(a - b) / max(1e-12, abs(a)) for a, b in zip(ln, lg)) if len(ln) == len(lg) else 1.0
        check(rel < 1e-4, f"losses differ (max rel {rel:.2e})", warn_only=rel < 1e-4)
    tn, tg = n["torch"], g["torch"]
    gib = lambda b: b / 2**30
    lines.append("")
    lines.append(f"{'allocator':<8} {'peak active':>12} {'peak reserved':>14} {'util.':>6} "
                 f"{'device allocs':>13} {'ooms':>5} {'ms/step':>8} {'reserved after empty_cache':>27}")
    for name, r, t in (("native", n, tn), ("gmlake", g, tg)):
        lines.append(f"{name:<8} {gib(t['active_peak']):>9.3f} GiB {gib(t['reserved_peak']):>10.3f} GiB "
                     f"{t['utilization']:>6.3f} {t['num_device_alloc']:>13} {t['num_ooms']:>5} "
                     f"{1e3 * r['train_seconds'] / max(1, r['steps']):>8.1f} "
                     f"{gib(t['reserved_after_empty_cache']):>23.3f} GiB")
    if tn["reserved_peak"] > 0:
        lines.append(f"gmlake reserved {100 * (1 - tg['reserved_peak'] / tn['reserved_peak']):.1f}% less at the peak; "
                     f"stitches {gm.get('stitches')}, pages stitched {gm.get('pages_stitched')}, "
                     f"driver calls {gm.get('driver_calls')}; empty_cache via {g['emptied_by']}")
lines.append("")
lines.append("tch-gpu: " + ("FAILED: " + "; ".join(fails) if fails else "PASSED")
             + (f" ({len(warns)} warning(s))" if warns else ""))
print("\n".join(lines))
sys.exit(1 if fails else 0)
EOF
