#!/usr/bin/env bash
# Builds libgmlake_torch.so (cpp/) against PyPI's torch wheel and CUDA runtime headers on a
# machine without a GPU, links it with -Wl,--no-undefined (a missing symbol fails the build),
# and runs the C++ tests that need no GPU (the bridge over a simulated device; the run-time
# install through torch's interface), then builds bench/latency.cpp against the same wheel.
# This is what CI runs to prove the C++ side builds.
#
#   scripts/build-torch-ext.sh [--out DIR]
#
# Downloads (cached under .artifacts/, ignored by git): torch==$TORCH_VERSION (cp312,
# manylinux_2_28, --no-deps; only torch/include, torch/lib/libc10*.so and torch/version.py are
# unpacked), nvidia-cuda-runtime==$CUDA_SERIES.* and nvidia-cuda-crt==$CUDA_SERIES.* (headers
# and libcudart). Installs cmake with apt-get when missing. Builds in build/torch-ext.
#
# --out DIR: also copy the library there, without debug info (for carrying to a GPU machine).
# Environment: TORCH_VERSION (2.11.0), CUDA_SERIES (13.0), GMLAKE_ARTIFACTS (.artifacts),
# BUILD_DIR (build/torch-ext), JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/build-args.sh
source scripts/lib/build-args.sh
BUILD_DIR="${BUILD_DIR:-$ROOT/build/torch-ext}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
OUT=""
build_args build-torch-ext 18 0 "$@"

# ---- tools
if ! command -v cmake >/dev/null 2>&1; then
  log "cmake not found: installing it with apt-get"
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get install -y -qq cmake >/dev/null 2>&1 || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq cmake >/dev/null; }
  fi
  command -v cmake >/dev/null 2>&1 || { echo "build-torch-ext: cmake is required" >&2; exit 1; }
fi
if ! command -v cargo >/dev/null 2>&1 && [ -f scripts/ensure-rust.sh ]; then
  # shellcheck source=scripts/ensure-rust.sh
  source scripts/ensure-rust.sh
fi
# shellcheck source=scripts/lib/wheels.sh
source scripts/lib/wheels.sh
# shellcheck source=scripts/lib/symbols.sh
source scripts/lib/symbols.sh

mkdir -p "$ART/dl"

# ---- torch (include/, lib/libc10*.so, version.py)
TORCH_ROOT="$ART/torch-$TORCH_VERSION"
TORCH_DIR="$TORCH_ROOT/torch"
if [ ! -f "$TORCH_DIR/include/c10/cuda/CUDACachingAllocator.h" ] || [ ! -f "$TORCH_DIR/lib/libc10_cuda.so" ] \
   || [ ! -f "$TORCH_DIR/version.py" ]; then
  whl=$(wheels_torch_wheel "$ART/dl" "$TORCH_VERSION")
  log "unpacking torch/include, torch/lib/libc10*.so, torch/version.py from $(basename "$whl")"
  rm -rf "$TORCH_ROOT.tmp"
  wheels_extract "$whl" "$TORCH_ROOT.tmp" 'torch/include/*' 'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so' 'torch/version.py'
  rm -rf "$TORCH_ROOT" && mv "$TORCH_ROOT.tmp" "$TORCH_ROOT"
fi

# ---- CUDA runtime headers and libcudart
CUDA_ROOT="$ART/cuda-$CUDA_SERIES"
CUDA_DIR="$CUDA_ROOT/nvidia/cu$CUDA_MAJOR"
if [ ! -f "$CUDA_DIR/include/cuda_runtime_api.h" ] || [ ! -f "$CUDA_DIR/include/crt/host_config.h" ]; then
  log "downloading nvidia-cuda-runtime==$CUDA_SERIES.* and nvidia-cuda-crt==$CUDA_SERIES.*"
  wheels_pip_download "$ART/dl" "nvidia-cuda-runtime==$CUDA_SERIES.*" "nvidia-cuda-crt==$CUDA_SERIES.*"
  rm -rf "$CUDA_ROOT.tmp"
  for w in "$ART"/dl/nvidia_cuda_runtime-"$CUDA_SERIES".*.whl "$ART"/dl/nvidia_cuda_crt-"$CUDA_SERIES".*.whl; do
    wheels_extract "$w" "$CUDA_ROOT.tmp" 'nvidia/*'
  done
  rm -rf "$CUDA_ROOT" && mv "$CUDA_ROOT.tmp" "$CUDA_ROOT"
fi
CUDART=$(ls "$CUDA_DIR"/lib/libcudart.so.* | head -1)

# ---- configure, build, test
log "torch $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$TORCH_DIR/version.py") at $TORCH_DIR"
cmake -S cpp -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTORCH_DIR="$TORCH_DIR" -DCUDA_INCLUDE_DIR="$CUDA_DIR/include" -DCUDART_LIBRARY="$CUDART" \
  -DGMLAKE_NO_UNDEFINED=ON >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
LIB="$BUILD_DIR/libgmlake_torch.so"
(cd "$BUILD_DIR" && ctest --output-on-failure)

# The library exports its C API and nothing else (and torch's CUDAAllocatorConfig instance, a
# GNU unique symbol bound to libc10_cuda's: see cpp/gmlake_torch.map); it needs no libcuda.
missing=$(symbols_missing "$LIB" gmlake_install gmlake_install_checked gmlake_is_installed gmlake_last_error gmlake_stats_json)
[ -z "$missing" ] || { echo "build-torch-ext: not exported: $missing" >&2; exit 1; }
bad=$(symbols_unexpected "$LIB")
[ -z "$bad" ] || { echo "build-torch-ext: unexpected exported symbols: $bad" >&2; exit 1; }
# gmlake reads PyTorch's CUDAAllocatorConfig through libc10_cuda's instance (a GNU unique
# symbol, cpp/gmlake_torch.map), so settings changed at run time are seen: check the binding.
if command -v python3 >/dev/null 2>&1; then
  LD_LIBRARY_PATH="$TORCH_DIR/lib:$(dirname "$CUDART")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python3 - "$LIB" <<'EOF'
import ctypes, os, sys
mode = os.RTLD_LAZY | os.RTLD_LOCAL
ctypes.CDLL("libc10.so", mode=mode)
c10_cuda = ctypes.CDLL("libc10_cuda.so", mode=mode)
ours = ctypes.CDLL(sys.argv[1], mode=mode)
name = "_ZZN3c104cuda20CUDACachingAllocator19CUDAAllocatorConfig8instanceEvE10s_instance"
try:
    theirs = ctypes.addressof(ctypes.c_void_p.in_dll(c10_cuda, name))
except ValueError:
    sys.exit(0)  # this torch keeps the instance elsewhere: nothing to bind
mine = ctypes.addressof(ctypes.c_void_p.in_dll(ours, name))
if mine != theirs:
    sys.exit("build-torch-ext: libgmlake_torch.so does not share libc10_cuda's CUDAAllocatorConfig instance")
print("[build-torch-ext] shares libc10_cuda's CUDAAllocatorConfig instance")
EOF
fi
if symbols_links_libcuda "$LIB"; then
  echo "build-torch-ext: libgmlake_torch.so must not link libcuda (it is loaded at run time)" >&2; exit 1
fi
log "ok: $LIB ($(du -h "$LIB" | cut -f1)); needs: $(symbols_needed "$LIB")"

# The allocator benchmark (bench/latency.cpp) builds and links against the same wheel, and
# starts (its usage needs no GPU).
TORCH_DIR="$TORCH_DIR" CUDA_INCLUDE="$CUDA_DIR/include" CUDART="$CUDART" \
  bash bench/build-latency.sh "$BUILD_DIR/bench" >/dev/null 2>"$BUILD_DIR/latency-build.log" ||
  { cat "$BUILD_DIR/latency-build.log" >&2; echo "build-torch-ext: bench/latency.cpp does not build" >&2; exit 1; }
"$BUILD_DIR/bench/latency" --help 2>&1 | grep -q -- "--ops FILE" ||
  { echo "build-torch-ext: build/bench/latency does not start" >&2; exit 1; }
# Its reader of operation lists: damaged lists refused, and one that `gmlake ops` writes read
# whole (when the CLI is built: cargo test builds it first in CI).
lists=()
gm=$(ls -t target/debug/gmlake target/release/gmlake 2>/dev/null | head -1 || true)
if [ -n "$gm" ] && "$gm" ops tests/traces/decode.pickle --out "$BUILD_DIR/decode.ops" >/dev/null; then
  lists+=("$BUILD_DIR/decode.ops")
fi
"$BUILD_DIR/bench/latency_ops_test" ${lists[@]+"${lists[@]}"} ||
  { echo "build-torch-ext: bench/tests/latency_ops_test failed" >&2; exit 1; }
log "ok: bench/latency.cpp builds and starts; its list reader passes its test"

if [ -n "$OUT" ]; then
  mkdir -p "$OUT"
  objcopy --strip-debug "$LIB" "$OUT/libgmlake_torch.so"
  log "copied to $OUT/libgmlake_torch.so ($(du -h "$OUT/libgmlake_torch.so" | cut -f1))"
fi
