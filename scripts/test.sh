#!/usr/bin/env bash
# The test command (CI runs it through .ci/run): formatting, lints, every Rust test
# (property tests with 10,000 random sequences), and the C++ allocator compiled and linked
# against PyPI's torch 2.11.0 wheel and CUDA 13 headers, and against the headers of torch
# 1.13.1, 2.0.1, 2.1.2 and 2.6.0 (downloaded on first use), the Python wheel (built with pip
# against the torch 2.11.0 wheel, installed in a clean venv, its tests run from there), and
# the tch example.
# SKIP_TORCH_BUILD=1 skips the C++ build (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/ensure-rust.sh
source scripts/ensure-rust.sh
export GMLAKE_PROPTEST_CASES="${GMLAKE_PROPTEST_CASES:-10000}"
start=$SECONDS
step() { printf '\n== %s (%ss)\n' "$1" "$((SECONDS - start))"; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --locked --workspace --all-targets -- -D warnings
step "cargo test (property tests: $GMLAKE_PROPTEST_CASES sequences)"
cargo test --locked --workspace 2>&1 | tee target/test.log
if [ -x scripts/build-torch-ext.sh ] && [ "${SKIP_TORCH_BUILD:-0}" != 1 ]; then
  step "C++ allocator against the torch 2.11.0 wheel"
  bash scripts/build-torch-ext.sh
fi
if [ -x scripts/build-wheel.sh ] && [ "${SKIP_TORCH_BUILD:-0}" != 1 ]; then
  step "Python wheel (pip wheel ./python) against the torch 2.11.0 wheel, installed in a clean venv and tested there"
  bash scripts/build-wheel.sh --test
fi
if [ -f scripts/check-torch-versions.sh ] && [ "${SKIP_TORCH_BUILD:-0}" != 1 ]; then
  step "C++ allocator against torch 1.13.1, 2.0.1, 2.1.2 and 2.6.0 headers and libraries"
  bash scripts/check-torch-versions.sh
fi
if [ -x scripts/build-tch-example.sh ] && [ "${SKIP_TORCH_BUILD:-0}" != 1 ]; then
  step "tch example against the torch 2.11.0 wheel"
  bash scripts/build-tch-example.sh
fi
step "python tests (no GPU: bench report, package, metrics, wheel build checks; source tree)"
pydirs=()
for d in bench/tests python/tests; do [ -d "$d" ] && pydirs+=("$d"); done
if [ ${#pydirs[@]} -gt 0 ]; then
  if python3 -m pytest --version >/dev/null 2>&1; then
    python3 -m pytest -q "${pydirs[@]}"
  else
    echo "pytest missing: python3 -m pip install pytest" >&2
    exit 1
  fi
fi
# One closing line with the totals of every cargo test binary.
awk '/^test result:/ {p+=$4; f+=$6; i+=$8} END {printf "\nrust: %d passed, %d failed, %d skipped\n", p, f, i}' target/test.log
step "done"
