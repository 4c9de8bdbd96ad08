#!/usr/bin/env bash
# The contract suite (gmlake_core::contract: the device trait's driver rules, then the
# allocator's behaviour) on a real GPU, through gmlake-cuda's CudaDevice: the same cases the
# tests run on the simulated device and on the mock driver.
#
#   scripts/contract-gpu.sh [--device N] [--only SUBSTRING]... [--list]
#
# Runs, first found: $GMLAKE_CONTRACT_BIN, .artifacts/gpu/contract (scripts/gpu-suite.sh
# --prepare puts it there), $CARGO_TARGET_DIR or target/release/examples/contract; else builds it
# (cargo build --release -p gmlake-cuda --example contract) where cargo is. Prints one line per
# case and a summary; the log goes to $OUT/contract.log when OUT is set (else
# build/gpu-suite/contract.log). Exit status: the binary's (0 all passed, 1 a case failed, 2 no
# usable GPU or bad arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bin="${GMLAKE_CONTRACT_BIN:-}"
if [ -z "$bin" ]; then
  for c in "$ROOT/.artifacts/gpu/contract" "${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/contract"; do
    if [ -x "$c" ]; then bin="$c"; break; fi
  done
fi
if [ -z "$bin" ]; then
  if ! command -v cargo >/dev/null 2>&1; then
    echo "contract-gpu: no contract binary and no cargo: run scripts/gpu-suite.sh --prepare where Rust is, and carry .artifacts/gpu" >&2
    exit 2
  fi
  cargo build --release -p gmlake-cuda --example contract >&2 || exit 2
  bin="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/contract"
fi
LOG="${OUT:-$ROOT/build/gpu-suite}"
mkdir -p "$LOG"
echo "contract-gpu: $bin $*"
"$bin" "$@" 2>&1 | tee "$LOG/contract.log"
exit "${PIPESTATUS[0]}"
