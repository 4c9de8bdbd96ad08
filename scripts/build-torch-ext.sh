#!/usr/bin/env bash
# Builds libgmlake_torch.so (cpp/) against PyPI's torch wheel and CUDA runtime headers on a
# machine without a GPU, links it with -Wl,--no-undefined (a missing symbol fails the build),
# and runs the C++ tests that need no GPU (the bridge over a simulated device; the run-time
# install through torch's interface). This is what CI runs to prove the C++ side builds.
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
ROOT=$PWD

TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
CUDA_SERIES="${CUDA_SERIES:-13.0}"
CUDA_MAJOR="${CUDA_SERIES%%.*}"
ART="${GMLAKE_ARTIFACTS:-$ROOT/.artifacts}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/torch-ext}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#--out=}"; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "build-torch-ext: unknown argument $1" >&2; exit 2 ;;
  esac
done

log() { printf '[build-torch-ext] %s\n' "$*"; }

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
command -v unzip >/dev/null 2>&1 || UNZIP_PY=1

# Extracts members matching the patterns from a wheel (a zip) into a folder.
extract() { # wheel dest pattern...
  local whl="$1" dest="$2"; shift 2
  mkdir -p "$dest"
  if [ -z "${UNZIP_PY:-}" ]; then
    unzip -q -o "$whl" "$@" -d "$dest"
  else
    python3 - "$whl" "$dest" "$@" <<'EOF'
import fnmatch, sys, zipfile
whl, dest, pats = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if any(fnmatch.fnmatch(n, p) for p in pats):
            z.extract(n, dest)
EOF
  fi
}

pip_download() { # requirement...
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$ART/dl" "$@"
}

mkdir -p "$ART/dl"

# ---- torch (include/, lib/libc10*.so, version.py)
TORCH_ROOT="$ART/torch-$TORCH_VERSION"
TORCH_DIR="$TORCH_ROOT/torch"
if [ ! -f "$TORCH_DIR/include/c10/cuda/CUDACachingAllocator.h" ] || [ ! -f "$TORCH_DIR/lib/libc10_cuda.so" ] \
   || [ ! -f "$TORCH_DIR/version.py" ]; then
  whl=$(ls "$ART"/dl/torch-"$TORCH_VERSION"-cp312-*manylinux*x86_64.whl 2>/dev/null | head -1 || true)
  if [ -z "$whl" ]; then
    log "downloading torch==$TORCH_VERSION (cp312, manylinux_2_28; ~530 MB, cached in $ART/dl)"
    pip_download "torch==$TORCH_VERSION"
    whl=$(ls "$ART"/dl/torch-"$TORCH_VERSION"-cp312-*manylinux*x86_64.whl | head -1)
  fi
  log "unpacking torch/include, torch/lib/libc10*.so, torch/version.py from $(basename "$whl")"
  rm -rf "$TORCH_ROOT.tmp"
  extract "$whl" "$TORCH_ROOT.tmp" 'torch/include/*' 'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so' 'torch/version.py'
  rm -rf "$TORCH_ROOT" && mv "$TORCH_ROOT.tmp" "$TORCH_ROOT"
fi

# ---- CUDA runtime headers and libcudart
CUDA_ROOT="$ART/cuda-$CUDA_SERIES"
CUDA_DIR="$CUDA_ROOT/nvidia/cu$CUDA_MAJOR"
if [ ! -f "$CUDA_DIR/include/cuda_runtime_api.h" ] || [ ! -f "$CUDA_DIR/include/crt/host_config.h" ]; then
  log "downloading nvidia-cuda-runtime==$CUDA_SERIES.* and nvidia-cuda-crt==$CUDA_SERIES.*"
  pip_download "nvidia-cuda-runtime==$CUDA_SERIES.*" "nvidia-cuda-crt==$CUDA_SERIES.*"
  rm -rf "$CUDA_ROOT.tmp"
  for w in "$ART"/dl/nvidia_cuda_runtime-"$CUDA_SERIES".*.whl "$ART"/dl/nvidia_cuda_crt-"$CUDA_SERIES".*.whl; do
    extract "$w" "$CUDA_ROOT.tmp" 'nvidia/*'
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

# The library exports its C API and nothing else; it needs no libcuda.
exported=$(nm -D --defined-only "$LIB" | awk '{print $3}' | sort | tr '\n' ' ')
for sym in gmlake_install gmlake_install_checked gmlake_is_installed gmlake_last_error gmlake_stats_json; do
  case " $exported " in *" $sym "*) ;; *) echo "build-torch-ext: $sym is not exported" >&2; exit 1 ;; esac
done
# (and torch's CUDAAllocatorConfig instance, a GNU unique symbol bound to libc10_cuda's:
# see cpp/gmlake_torch.map)
if nm -D --defined-only "$LIB" | awk '{print $3}' | grep -v '^gmlake_' \
    | grep -qv 'CUDAAllocatorConfig8instanceEvE10s_instance$'; then
  echo "build-torch-ext: unexpected exported symbols: $exported" >&2; exit 1
fi
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
if readelf -d "$LIB" | grep -q 'libcuda\.so'; then
  echo "build-torch-ext: libgmlake_torch.so must not link libcuda (it is loaded at run time)" >&2; exit 1
fi
log "ok: $LIB ($(du -h "$LIB" | cut -f1)); needs: $(readelf -d "$LIB" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"

if [ -n "$OUT" ]; then
  mkdir -p "$OUT"
  objcopy --strip-debug "$LIB" "$OUT/libgmlake_torch.so"
  log "copied to $OUT/libgmlake_torch.so ($(du -h "$OUT/libgmlake_torch.so" | cut -f1))"
fi
