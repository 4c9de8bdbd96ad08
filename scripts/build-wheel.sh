#!/usr/bin/env bash
# Builds the gmlake wheel (pip wheel ./python: the Rust staticlib and libgmlake_torch.so through
# scikit-build-core and cpp/CMakeLists.txt) against PyPI's torch wheel and CUDA runtime headers
# on a machine without a GPU, as CI does (pip runs in a virtual environment whose
# site-packages holds the unpacked torch/ and nvidia/cu13/, found as an installed torch is), and with --test installs it into a clean virtual
# environment and runs the Python package tests from the installed package (outside the
# source tree, no PYTHONPATH). torch there is a stub: the CUDA torch and its nvidia wheels are
# several GB; the installed library is still loaded, against the unpacked torch libraries.
#
#   scripts/build-wheel.sh [--test] [--out DIR]
#
# The torch and CUDA files are the ones scripts/build-torch-ext.sh downloads and unpacks into
# .artifacts/ (it is run first when they are missing). The wheel goes to DIR (default
# .artifacts/wheel), with a prometheus-client wheel and scripts/gpu-wheel-test.sh: carried to
# a GPU machine, `bash .artifacts/wheel/gpu-wheel-test.sh` tests it there. pip builds it in
# an isolated environment (scikit-build-core from PyPI); GMLAKE_NO_BUILD_ISOLATION=1 builds
# with the scikit-build-core installed instead.
# Environment: TORCH_VERSION (2.11.0), CUDA_SERIES (13.0), GMLAKE_ARTIFACTS (.artifacts).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/build-args.sh
source scripts/lib/build-args.sh
OUT="$ART/wheel"
TEST=0
build_args build-wheel 17 1 "$@"
if ! command -v cargo >/dev/null 2>&1; then
  # shellcheck source=scripts/ensure-rust.sh
  source scripts/ensure-rust.sh
fi

TORCH_DIR="$ART/torch-$TORCH_VERSION/torch"
CUDA_DIR="$ART/cuda-$CUDA_SERIES/nvidia/cu$CUDA_MAJOR"
if [ ! -f "$TORCH_DIR/include/c10/cuda/CUDACachingAllocator.h" ] || [ ! -f "$TORCH_DIR/version.py" ] \
   || [ ! -f "$CUDA_DIR/include/cuda_runtime_api.h" ]; then
  log "torch $TORCH_VERSION / CUDA $CUDA_SERIES files missing: scripts/build-torch-ext.sh fetches them"
  bash scripts/build-torch-ext.sh
fi

# ---- the wheel, built as a user does: pip in a virtual environment whose site-packages holds
# torch (the unpacked wheel's torch/, linked) and PyPI's CUDA runtime beside it (nvidia/cu13),
# so the build finds both from the interpreter running pip (nothing passed to it).
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/build-venv"
site=$("$tmp/build-venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ln -s "$TORCH_DIR" "$site/torch"
mkdir -p "$site/nvidia"
ln -s "$CUDA_DIR" "$site/nvidia/cu$CUDA_MAJOR"
iso=()
if [ "${GMLAKE_NO_BUILD_ISOLATION:-0}" = 1 ]; then
  iso=(--no-build-isolation)
  "$tmp/build-venv/bin/python" -m pip install -q "scikit-build-core>=0.10"
fi
log "pip wheel ./python ${iso[*]} in a venv with torch $TORCH_VERSION (from $TORCH_DIR)"
(unset GMLAKE_TORCH_DIR CMAKE_ARGS; "$tmp/build-venv/bin/python" -m pip wheel ./python "${iso[@]}" --no-deps -q -w "$tmp")
whl=$(ls "$tmp"/gmlake-*.whl)
name=$(basename "$whl")
case "$name" in
  gmlake-*+torch*.cu*-py3-none-linux_x86_64.whl) ;;
  *) echo "build-wheel: unexpected wheel name $name" >&2; exit 1 ;;
esac
rm -f "$OUT"/gmlake-*.whl
cp "$whl" "$OUT/"
whl="$OUT/$name"
log "ok: $whl ($(du -h "$whl" | cut -f1))"
# For the GPU machine (no network): the metrics extra's wheel and the test script beside it
# (scripts/gpu-wheel-test.sh; carry the folder).
python3 -m pip download -q --no-deps --only-binary=:all: -d "$OUT" "prometheus-client>=0.17" >/dev/null 2>&1 \
  || log "note: prometheus-client not downloaded (no network?)"
cp scripts/gpu-wheel-test.sh "$OUT/"
python3 -m zipfile -l "$whl" | awk 'NR > 1 {print "  " $1}'

[ "$TEST" = 1 ] || exit 0

# ---- installed into a clean virtual environment, tested from there
venv="$tmp/venv"
log "installing $name[metrics] and pytest into a clean venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "$whl[metrics]" pytest
version=${name#gmlake-}; version=${version%%-py3-*}
run_dir="$tmp/run"
mkdir -p "$run_dir"
cp -r python/tests "$run_dir/tests"
log "python tests of the installed package ($version), from $run_dir"
(cd "$run_dir" && env -u PYTHONPATH GMLAKE_TEST_INSTALLED=1 GMLAKE_TEST_EXPECT_VERSION="$version" \
   GMLAKE_TEST_TORCH_LIBS="$TORCH_DIR/lib:$CUDA_DIR/lib" \
   "$venv/bin/python" -m pytest -q -p no:cacheprovider tests)
# The launcher of the installed package, as a user runs it.
(cd "$run_dir" && env -u PYTHONPATH "$venv/bin/python" -m gmlake --version)
(cd "$run_dir" && env -u PYTHONPATH "$venv/bin/gmlake-run" --help >/dev/null)
log "ok: installed wheel tested"
