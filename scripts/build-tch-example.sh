#!/usr/bin/env bash
# Builds the tch example (examples/tch-train: a transformer trained with tch under gmlake or
# the native allocator) against PyPI's torch wheel, on a machine without a GPU, and checks
# that the binary keeps libtorch_cuda.so linked. CI runs it to prove the tch side builds.
#
#   scripts/build-tch-example.sh [--bundle [DIR]] [--skip-lib-test] [--skip-smoke]
#
# Downloads (cached under .artifacts/, ignored by git): torch==$TORCH_VERSION (cp312,
# manylinux_2_28, --no-deps; the wheel is shared with scripts/build-torch-ext.sh), unpacked to
# .artifacts/libtorch-$TORCH_VERSION/torch (include/, lib/, version.py). Builds in
# target/tch-train with LIBTORCH=<that>/torch LIBTORCH_CXX11_ABI=1.
#
# Then a smoke test without a GPU (unless --skip-smoke): the example built with the feature
# no-cuda-link (libc10_cuda.so linked, libtorch_cuda.so not: it runs where CUDA's libraries
# are missing, given libcudart and libcupti, downloaded from PyPI's nvidia-cuda-runtime and
# nvidia-cuda-cupti 13.0 wheels, 12 MB) trains a tiny model on the CPU for 3 steps under
# --allocator native, and, when libgmlake_torch.so is built (build/torch-ext, by
# scripts/build-torch-ext.sh), under --allocator gmlake: gmlake installs into the tch
# process's libc10_cuda and becomes torch's CUDA allocator; the losses must be identical.
# With that library, also runs gmlake-tch's test against it (install, accessors, errors)
# unless --skip-lib-test.
#
# --bundle [DIR]: also build libgmlake_torch.so (scripts/build-torch-ext.sh --out DIR) and copy
# the example binary there without debug info: DIR (default .artifacts/tch) is what
# scripts/tch-gpu.sh needs on the GPU machine.
# Environment: TORCH_VERSION (2.11.0), GMLAKE_ARTIFACTS (.artifacts), CARGO_BUILD_JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
ART="${GMLAKE_ARTIFACTS:-$ROOT/.artifacts}"
BUNDLE=""
LIB_TEST=1
SMOKE=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle)
      if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then BUNDLE="$2"; shift 2; else BUNDLE="$ART/tch"; shift; fi ;;
    --bundle=*) BUNDLE="${1#--bundle=}"; shift ;;
    --skip-lib-test) LIB_TEST=0; shift ;;
    --skip-smoke) SMOKE=0; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "build-tch-example: unknown argument $1" >&2; exit 2 ;;
  esac
done

start=$SECONDS
log() { printf '[build-tch-example %ss] %s\n' "$((SECONDS - start))" "$*"; }

# shellcheck source=scripts/lib/wheels.sh
source scripts/lib/wheels.sh
# shellcheck source=scripts/lib/symbols.sh
source scripts/lib/symbols.sh

if ! command -v cargo >/dev/null 2>&1 && [ -f scripts/ensure-rust.sh ]; then
  # shellcheck source=scripts/ensure-rust.sh
  source scripts/ensure-rust.sh
fi

# ---- torch: include/, lib/ (libtorch*, libc10*), version.py
LT_ROOT="$ART/libtorch-$TORCH_VERSION"
LIBTORCH_DIR="$LT_ROOT/torch"
if [ ! -f "$LT_ROOT/.complete" ]; then
  whl=$(wheels_torch_wheel "$ART/dl" "$TORCH_VERSION")
  log "unpacking torch/include, torch/lib, torch/version.py from $(basename "$whl")"
  rm -rf "$LT_ROOT.tmp"
  wheels_extract "$whl" "$LT_ROOT.tmp" 'torch/include/*' 'torch/version.py' 'torch/lib/*.so*' '!torch/lib/*torch_python*'
  touch "$LT_ROOT.tmp/.complete"
  rm -rf "$LT_ROOT" && mv "$LT_ROOT.tmp" "$LT_ROOT"
fi
log "torch $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$LIBTORCH_DIR/version.py") at $LIBTORCH_DIR"

# ---- the example
export LIBTORCH="$LIBTORCH_DIR" LIBTORCH_CXX11_ABI=1
export CARGO_TARGET_DIR="$ROOT/target/tch-train"
log "cargo build --release (examples/tch-train; torch-sys compiles libtorch's C API: minutes)"
(cd examples/tch-train && cargo build --release --locked)
log "cargo fmt --check, cargo clippy -D warnings (examples/tch-train)"
(cd examples/tch-train && cargo fmt -- --check && cargo clippy --release --locked -q -- -D warnings)
BIN="$CARGO_TARGET_DIR/release/tch-train"
needed=$(symbols_needed "$BIN")
case " $needed " in
  *" libtorch_cuda.so "*) ;;
  *) echo "build-tch-example: $BIN does not link libtorch_cuda.so (needs: $needed)" >&2; exit 1 ;;
esac
log "ok: $BIN ($(du -h "$BIN" | cut -f1)); needs: $needed"

EXT_LIB="$ROOT/build/torch-ext/libgmlake_torch.so"

# ---- smoke test on the CPU
if [ "$SMOKE" = 1 ]; then
  SMOKE_LIBS="$ART/tch-smoke-libs"
  if [ ! -f "$SMOKE_LIBS/libcupti.so.13" ] || [ ! -f "$SMOKE_LIBS/libcudart.so.13" ]; then
    log "downloading nvidia-cuda-runtime and nvidia-cuda-cupti 13.0 (libcudart, libcupti: 12 MB)"
    wheels_pip_download "$ART/dl" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cupti==13.0.*"
    wheels_extract_files "$SMOKE_LIBS" libcudart.so.13 libcupti.so.13 -- \
      "$ART"/dl/nvidia_cuda_runtime-13.0.*.whl "$ART"/dl/nvidia_cuda_cupti-13.0.*.whl
  fi
  log "smoke test: tch-train built with no-cuda-link, 3 steps of a tiny model on the CPU"
  (cd examples/tch-train && cargo build --release --locked -q --features no-cuda-link)
  SMOKE_BIN="$CARGO_TARGET_DIR/release/tch-train-cpu"
  cp "$BIN" "$SMOKE_BIN"
  (cd examples/tch-train && cargo build --release --locked -q) # the CUDA binary back in place
  SMOKE_DIR="$CARGO_TARGET_DIR/smoke"
  mkdir -p "$SMOKE_DIR"
  tiny=(--cpu --steps 3 --layers 2 --d-model 64 --heads 4 --vocab 32 --min-seq 8 --max-seq 48 --tokens 256)
  LD_LIBRARY_PATH="$LIBTORCH_DIR/lib:$SMOKE_LIBS" "$SMOKE_BIN" --allocator native "${tiny[@]}" \
    --json "$SMOKE_DIR/native.json" | tee "$SMOKE_DIR/native.log"
  if [ -f "$EXT_LIB" ]; then
    LD_LIBRARY_PATH="$LIBTORCH_DIR/lib:$SMOKE_LIBS" "$SMOKE_BIN" --allocator gmlake --library "$EXT_LIB" \
      "${tiny[@]}" --json "$SMOKE_DIR/gmlake.json" | tee "$SMOKE_DIR/gmlake.log"
    grep -q '^gmlake: Installed from' "$SMOKE_DIR/gmlake.log" \
      || { echo "build-tch-example: smoke: gmlake was not installed" >&2; exit 1; }
    grep -q "torch's CUDA allocator is gmlake::" "$SMOKE_DIR/gmlake.log" \
      || { echo "build-tch-example: smoke: torch's CUDA allocator is not gmlake's" >&2; exit 1; }
    python3 - "$SMOKE_DIR" <<'EOF'
import json, sys
n, g = (json.load(open(f"{sys.argv[1]}/{k}.json")) for k in ("native", "gmlake"))
assert n["data_check_ok"] and g["data_check_ok"], "data check failed"
assert n["losses"] == g["losses"], f"losses differ: {n['losses']} vs {g['losses']}"
assert n["logits_hash"] == g["logits_hash"], "logits differ"
print(f"[build-tch-example] smoke: ok, identical losses {g['losses']}")
EOF
  else
    log "smoke: no $EXT_LIB (scripts/build-torch-ext.sh builds it): gmlake run skipped"
  fi
fi

# ---- gmlake-tch against the real library (no GPU needed)
CUDART_DIR=$(ls -d "$ART"/cuda-13.*/nvidia/cu13/lib 2>/dev/null | head -1 || true)
if [ "$LIB_TEST" = 1 ] && [ -f "$EXT_LIB" ] && [ -n "$CUDART_DIR" ]; then
  log "gmlake-tch's test against $EXT_LIB"
  unset CARGO_TARGET_DIR
  GMLAKE_TCH_TEST_LIBRARY="$EXT_LIB" GMLAKE_TCH_TEST_TORCH_LIB="$LIBTORCH_DIR/lib" \
    GMLAKE_TCH_TEST_CUDART="$CUDART_DIR" \
    cargo test --locked -p gmlake-tch --test real_library -- --nocapture
elif [ "$LIB_TEST" = 1 ]; then
  log "skipping gmlake-tch's real-library test (no $EXT_LIB or no CUDA runtime under $ART: run scripts/build-torch-ext.sh first)"
fi

# ---- the bundle for the GPU machine
if [ -n "$BUNDLE" ]; then
  mkdir -p "$BUNDLE"
  bash scripts/build-torch-ext.sh --out "$BUNDLE"
  objcopy --strip-debug "$BIN" "$BUNDLE/tch-train"
  log "bundle $BUNDLE: $(cd "$BUNDLE" && du -h tch-train libgmlake_torch.so | tr '\t\n' ' ')"
fi
log "done"
