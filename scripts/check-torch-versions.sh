#!/usr/bin/env bash
# Compiles gmlake's C++ allocator (cpp/) against the headers of older PyTorch releases, and
# links it against their libc10 / libc10_cuda, on a machine without a GPU. This is the CI check
# that cpp/version_compat.h's adapters (cpp/compat/torch_*.h) match each version's interface.
#
#   scripts/check-torch-versions.sh [VERSION...]      (default: 1.13.1 2.0.1 2.1.2 2.6.0)
#
# Per version, from PyPI (cached under .artifacts/torch-headers and .artifacts/cuda-*; ~15 MB
# each, fetched with HTTP range requests by scripts/wheel-extract.py, not the whole wheel):
# torch's torch/include, torch/version.py, torch/lib/libc10.so and libc10_cuda.so; CUDA runtime
# headers and libcudart (nvidia-cuda-runtime-cu11 / -cu12) and crt/ headers (nvidia-cuda-nvcc).
# Then per version it configures cpp/CMakeLists.txt with -DGMLAKE_VERSION_CHECK=ON (every
# compile flag comes from there: the wheels' C++ ABI, -O1, warnings as errors; torch < 2.2 gets
# cpp/compat/legacy on the include path) in BUILD_DIR/VERSION and builds:
#   2.x:  libgmlake_torch.so (gmlake::Impl and its units, cpp/gmlake_torch.cpp: the run-time
#         install, cpp/tier.cpp), linked with -Wl,--no-undefined against the wheel's libc10 /
#         libc10_cuda and the Rust staticlib (built once with the wheels' ABI, cached in build/);
#   all:  gmlake_in_tree_check: the in-tree sources, cpp/compat/c10_backend.cpp on 2.x,
#         gmlake::Impl and cpp/compat/torch_1_13.cpp on 1.13 (no link: they replace functions of
#         libc10_cuda and call the ones a patched build renames); gmlake_gpu_test_check:
#         scripts/c10-only/gpu_test.cpp, the in-tree route's GPU test (no link: it needs a
#         patched build's libc10_cuda; scripts/build-patched-c10.sh links and stages it).
#
# Environment: GMLAKE_ARTIFACTS (.artifacts), BUILD_DIR (build/check-torch-versions), JOBS
# (nproc), CXX (the compiler CMake uses), NO_LINK=1 (objects only; no libgmlake_torch.so).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ART="${GMLAKE_ARTIFACTS:-$ROOT/.artifacts}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/check-torch-versions}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(1.13.1 2.0.1 2.1.2 2.6.0)
start=$SECONDS
log() { printf '[check-torch-versions %3ss] %s\n' "$((SECONDS - start))" "$*"; }
# shellcheck source=scripts/lib/wheels.sh
source scripts/lib/wheels.sh
# shellcheck source=scripts/lib/symbols.sh
source scripts/lib/symbols.sh

cuda_of() { # torch version -> "series cu"
  case "$1" in
    1.13.*|2.0.*) echo "11.7 cu11" ;;
    2.1.*) echo "12.1 cu12" ;;
    2.6.*) echo "12.4 cu12" ;;
    *) echo "check-torch-versions: no CUDA series known for torch $1" >&2; return 1 ;;
  esac
}

# ---- downloads (headers and the two c10 libraries only)
for v in "${VERSIONS[@]}"; do
  read -r series cu < <(cuda_of "$v")
  T="$ART/torch-headers/$v"
  if [ ! -f "$T/torch/include/c10/cuda/CUDACachingAllocator.h" ] || [ ! -f "$T/torch/version.py" ] \
     || [ ! -f "$T/torch/lib/libc10_cuda.so" ]; then
    log "fetching torch==$v: torch/include, torch/version.py, torch/lib/libc10{,_cuda}.so"
    rm -rf "$T.tmp"
    wheels_fetch "torch==$v" "$T.tmp" 'torch/include/*' 'torch/version.py' \
      'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so'
    rm -rf "$T" && mv "$T.tmp" "$T"
  fi
  C="$ART/cuda-$series"
  wheels_cuda_headers "$series" "$cu" "$C"
done

# ---- the Rust side: cxx bridge headers (and the staticlib with the wheels' ABI, for linking)
mkdir -p "$BUILD_DIR"
CARGO_DIR="$BUILD_DIR/cargo-abi0"
if [ "${NO_LINK:-0}" != 1 ] || [ ! -f "$CARGO_DIR/cxxbridge/gmlake-ffi/src/lib.rs.h" ]; then
  if ! command -v cargo >/dev/null 2>&1; then
    # shellcheck source=scripts/ensure-rust.sh
    source scripts/ensure-rust.sh
  fi
  log "cargo build -p gmlake-ffi (release, _GLIBCXX_USE_CXX11_ABI=0, target dir $CARGO_DIR)"
  CARGO_TARGET_DIR="$CARGO_DIR" CXXFLAGS="${CXXFLAGS:-} -D_GLIBCXX_USE_CXX11_ABI=0" \
    cargo build --release --locked -q -p gmlake-ffi
fi
BRIDGE="$CARGO_DIR/cxxbridge"
FFI_LIB="$CARGO_DIR/release/libgmlake_ffi.a"

# ---- configure, compile and link per version: cpp/CMakeLists.txt with GMLAKE_VERSION_CHECK=ON
# holds every flag (C++ ABI, standard, include paths, cpp/compat/legacy, warnings as errors)
for v in "${VERSIONS[@]}"; do
  read -r series cu < <(cuda_of "$v")
  T="$ART/torch-headers/$v/torch"
  C="$ART/cuda-$series/nvidia"
  mm=$(echo "$v" | awk -F. '{print $1 * 100 + $2}')
  B="$BUILD_DIR/$v"
  CUDART=$(ls "$C"/cuda_runtime/lib/libcudart.so.* | head -1)
  cmake -S cpp -B "$B" -DGMLAKE_VERSION_CHECK=ON -DTORCH_DIR="$T" \
    -DCUDA_INCLUDE_DIR="$C/cuda_runtime/include" -DCUDA_CRT_INCLUDE_DIR="$C/cuda_nvcc/include" \
    -DCUDART_LIBRARY="$CUDART" -DGMLAKE_RUST_STATICLIB="$FFI_LIB" -DGMLAKE_CXXBRIDGE_DIR="$BRIDGE" \
    > "$B.configure.log" 2>&1 || { cat "$B.configure.log"; log "FAIL: torch $v: cmake configure"; exit 1; }
  targets=(gmlake_in_tree_check gmlake_gpu_test_check)
  if [ "$mm" -ge 200 ]; then
    if [ "${NO_LINK:-0}" = 1 ]; then targets+=(gmlake_torch_objects); else targets+=(gmlake_torch); fi
  fi
  log "torch $v: building ${targets[*]} (-j$JOBS)"
  if ! cmake --build "$B" -j "$JOBS" --target "${targets[@]}" > "$B.build.log" 2>&1; then
    grep -E 'error|Error' "$B.build.log" | head -30; log "FAIL: torch $v: compile errors (log: $B.build.log)"; exit 1
  fi
  [ "$mm" -ge 200 ] && [ "${NO_LINK:-0}" != 1 ] || continue
  out="$B/libgmlake_torch.so"
  if symbols_links_libcuda "$out"; then
    log "FAIL: torch $v: libgmlake_torch.so links libcuda"; exit 1
  fi
  bad=$(symbols_unexpected "$out")
  [ -z "$bad" ] || { log "FAIL: torch $v: unexpected exports: $bad"; exit 1; }
  log "linked torch $v: $(basename "$out") with -Wl,--no-undefined against torch $v's libc10 / libc10_cuda ($(du -h "$out" | cut -f1))"
done
log "OK: ${VERSIONS[*]}"
