#!/usr/bin/env bash
# The wheel on the GPU machine (torch 2.11 installed, no network, no Rust): installs the wheel
# built by scripts/build-wheel.sh (carried in .artifacts/wheel/) with
# `pip install --no-deps --target`, checks that Python imports gmlake from there (not from the
# source tree), runs a short training job under `python -m gmlake --metrics-port PORT`, scrapes
# http://127.0.0.1:PORT/metrics every 2 s while it runs, and checks the key metrics are there
# and nonzero; also that a second server on the same port is a clear error.
#
#   scripts/gpu-wheel-test.sh [WHEEL]
#
# Run from the repository root (it uses tests/gpu/cases/train_lora.py); a copy of this script
# in .artifacts/wheel/ works too. Environment: OUT (logs; default build/gpu-wheel-test), PYTHON (python3), GMLAKE_METRICS_PORT
# (9400), GMLAKE_TRAIN_STEPS (60), GMLAKE_SITE (/tmp/gmlake-site). prometheus-client is taken
# from the environment, else from a wheel beside gmlake's in .artifacts/wheel/.
# Writes to $OUT: pip.log, import.log, train.log, scrape-*.txt, check.log, second-server.log,
# summary.txt. Exit status 0 when every check passed.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# The repository: the current folder when it is one (the script may be run from a copy in
# .artifacts/wheel/), else the script's parent.
if [ -f tests/gpu/cases/train_lora.py ]; then ROOT=$PWD; else ROOT="$(cd "$HERE/.." && pwd)"; fi
cd "$ROOT"
OUT="${OUT:-$ROOT/build/gpu-wheel-test}"
PY="${PYTHON:-python3}"
PORT="${GMLAKE_METRICS_PORT:-9400}"
SITE="${GMLAKE_SITE:-/tmp/gmlake-site}"
export GMLAKE_TRAIN_STEPS="${GMLAKE_TRAIN_STEPS:-60}"
mkdir -p "$OUT"
log() { printf '[gpu-wheel-test] %s\n' "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"
fail=0

WHEEL="${1:-$(ls "$ROOT"/.artifacts/wheel/gmlake-*.whl "$HERE"/gmlake-*.whl 2>/dev/null | head -1)}"
if [ -z "$WHEEL" ] || [ ! -f "$WHEEL" ]; then
  log "FAIL: no wheel (carry .artifacts/wheel/ built by scripts/build-wheel.sh)"; exit 1
fi
log "wheel: $(basename "$WHEEL")"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/[gpu-wheel-test] gpu: /' | tee -a "$OUT/summary.txt"
"$PY" -c "import torch; print('[gpu-wheel-test] torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1 | tee -a "$OUT/summary.txt"

# ---- install
rm -rf "$SITE"
pkgs=("$WHEEL")
if ! "$PY" -c "import prometheus_client" 2>/dev/null; then
  prom=$(ls "$(dirname "$WHEEL")"/prometheus_client-*.whl 2>/dev/null | head -1)
  if [ -n "$prom" ]; then pkgs+=("$prom"); else log "prometheus-client missing and not carried"; fi
fi
if ! "$PY" -m pip install --no-deps --no-index --target "$SITE" "${pkgs[@]}" >"$OUT/pip.log" 2>&1; then
  # No pip there: a wheel is a zip; unpacked into the folder it imports the same.
  log "pip install failed (pip.log): unpacking the wheels instead"
  rm -rf "$SITE"
  "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" "$SITE" "${pkgs[@]}" \
    || { log "FAIL: cannot install the wheel into $SITE"; exit 1; }
fi
log "installed into $SITE: $(ls "$SITE" | tr '\n' ' ')"

# Everything below runs outside the source tree, with only the installed package on the path.
RUN="$(mktemp -d)"
cp tests/gpu/cases/train_lora.py "$RUN/train.py"
cd "$RUN"
export PYTHONPATH="$SITE"
unset GMLAKE_LIBRARY
export GMLAKE_PYTHON_DIR=/nonexistent   # train_lora.py's source-tree path: not used
if ! "$PY" - >"$OUT/import.log" 2>&1 <<PYEOF
import gmlake, json
print("file", gmlake.__file__)
print("version", gmlake.__version__)
print("library", gmlake.library_path())
assert gmlake.__file__.startswith("$SITE"), gmlake.__file__
assert gmlake.library_path().startswith("$SITE"), gmlake.library_path()
print("build_info", json.dumps(gmlake.build_info()))
PYEOF
then
  log "FAIL: import from $SITE (import.log)"; cat "$OUT/import.log"; fail=1
else
  sed 's/^/[gpu-wheel-test] /' "$OUT/import.log" | tee -a "$OUT/summary.txt"
fi

# ---- the training run with the endpoint, scraped while it runs
log "python -m gmlake --metrics-port $PORT train.py (GMLAKE_TRAIN_STEPS=$GMLAKE_TRAIN_STEPS)"
"$PY" -m gmlake --metrics-port "$PORT" train.py >"$OUT/train.log" 2>&1 &
pid=$!
"$PY" - "$PORT" "$pid" "$OUT" >"$OUT/check.log" 2>&1 <<'PYEOF'
import os, re, subprocess, sys, time, urllib.request
port, pid, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
url = f"http://127.0.0.1:{port}/metrics"
D0 = 'device="0"'

def alive():
    try:
        os.kill(pid, 0)
        return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False

def parse(text):
    vals = {}
    for line in text.splitlines():
        m = re.match(r'^(\w+)\{([^}]*)\} (\S+)$', line)
        if m:
            vals[(m.group(1), m.group(2))] = float(m.group(3))
    return vals

scrapes, second_done = [], False
t0 = time.time()
while alive() and time.time() - t0 < 540:
    try:
        s = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        ms = (time.perf_counter() - s) * 1e3
    except OSError:
        time.sleep(0.5)
        continue
    n = len(scrapes)
    open(f"{out}/scrape-{n:03d}.txt", "w").write(text)
    v = parse(text)
    scrapes.append((time.time() - t0, ms, v))
    reserved = v.get(("gmlake_reserved_bytes", D0), 0)
    active = v.get(("gmlake_active_bytes", D0), 0)
    stitches = v.get(("gmlake_stitches_total", D0), 0)
    print(f"scrape {n} at {time.time() - t0:.1f}s in {ms:.1f} ms: reserved {reserved:.0f} "
          f"active {active:.0f} stitches {stitches:.0f}", flush=True)
    if n == 1 and not second_done:
        # A second server on the same port: a clear error, exit status 1.
        second_done = True
        open("/tmp/gmlake-noop.py", "w").write("print('noop ran')\n")
        r = subprocess.run([sys.executable, "-m", "gmlake", "--metrics-port", str(port), "/tmp/gmlake-noop.py"],
                           capture_output=True, text=True, timeout=300)
        open(f"{out}/second-server.log", "w").write(f"rc={r.returncode}\n{r.stdout}\n{r.stderr}")
        ok = r.returncode == 1 and "in use" in r.stderr and "noop ran" not in r.stdout
        print(f"second server on port {port}: rc={r.returncode}, clear error: {ok}", flush=True)
        if not ok:
            print("CHECK FAILED: second server", flush=True)
    time.sleep(2)

print(f"{len(scrapes)} scrapes during the run")
fails = []
if len(scrapes) < 3:
    fails.append(f"only {len(scrapes)} scrapes during the run")
# The scrape with the most reserved memory (mid-training).
best = max(scrapes, key=lambda s: s[2].get(("gmlake_reserved_bytes", D0), 0)) if scrapes else (0, 0, {})
v = best[2]
def val(name, labels=D0):
    return v.get((name, labels))
for name in ["gmlake_reserved_bytes", "gmlake_active_bytes", "gmlake_allocated_bytes",
             "gmlake_reserved_peak_bytes", "gmlake_device_total_bytes", "gmlake_initialized"]:
    x = val(name)
    print(f"{name} = {x}")
    if not x:
        fails.append(f"{name} missing or zero")
x = val("gmlake_driver_calls_total", 'device="0",kind="map"')
print(f"gmlake_driver_calls_total{{kind=map}} = {x}")
if not x:
    fails.append("driver map calls missing or zero")
for name in ["gmlake_cached_bytes", "gmlake_largest_free_block_bytes", "gmlake_fragmentation_ratio",
             "gmlake_free_fragmentation_ratio", "gmlake_stitches_total", "gmlake_pages_stitched_total",
             "gmlake_ooms_total", "gmlake_alloc_retries_total", "gmlake_stats_error"]:
    x = val(name)
    print(f"{name} = {x}")
    if x is None:
        fails.append(f"{name} missing")
fr = val("gmlake_fragmentation_ratio")
if fr is not None and not 0 <= fr <= 1:
    fails.append(f"fragmentation ratio {fr} outside [0, 1]")
if val("gmlake_stats_error"):
    fails.append("stats error reported")
ms = sorted(s[1] for s in scrapes)
if ms:
    print(f"scrape time: median {ms[len(ms) // 2]:.1f} ms, max {ms[-1]:.1f} ms")
for f in fails:
    print("CHECK FAILED:", f)
sys.exit(1 if fails else 0)
PYEOF
check_rc=$?
wait "$pid"; train_rc=$?
cat "$OUT/check.log" | sed 's/^/[gpu-wheel-test] /' | tee -a "$OUT/summary.txt" >/dev/null
tail -n 30 "$OUT/check.log"
grep -h "GMLAKE_RESULT\|\[gmlake\]" "$OUT/train.log" | cut -c1-400 | sed 's/^/[gpu-wheel-test] train: /' | tee -a "$OUT/summary.txt"
[ "$train_rc" = 0 ] || { log "FAIL: training exited $train_rc (train.log)"; tail -n 30 "$OUT/train.log"; fail=1; }
[ "$check_rc" = 0 ] || { log "FAIL: metric checks (check.log)"; fail=1; }
grep -q "CHECK FAILED: second server" "$OUT/check.log" && { log "FAIL: second server"; fail=1; }
rm -rf "$RUN"
if [ "$fail" = 0 ]; then log "PASS"; else log "FAIL"; fi
exit "$fail"
