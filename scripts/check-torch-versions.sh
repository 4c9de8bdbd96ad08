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
# Then, with -D_GLIBCXX_USE_CXX11_ABI=0 (PyPI wheels <= 2.6):
#   2.x:  compiles cpp/gmlake_impl.cpp, cpp/gmlake_torch.cpp (the run-time install), cpp/tier.cpp and
#         cpp/compat/c10_backend.cpp (the in-tree backend) to objects, and links
#         libgmlake_torch.so with -Wl,--no-undefined against the wheel's libc10 / libc10_cuda
#         and the Rust staticlib (built once with the wheel's ABI, cached in build/);
#   1.13: compiles cpp/gmlake_impl.cpp and cpp/compat/torch_1_13.cpp (no link: they replace
#         functions of libc10_cuda and call the ones a patched build renames);
#   all:  compiles scripts/c10-only/gpu_test.cpp, the in-tree route's GPU test (no link: it
#         needs a patched build's libc10_cuda; scripts/build-patched-c10.sh links and stages it).
# torch < 2.2 gets cpp/compat/legacy on the include path.
#
# Environment: GMLAKE_ARTIFACTS (.artifacts), BUILD_DIR (build/check-torch-versions), JOBS
# (nproc), CXX (g++), NO_LINK=1 (objects only; no Rust build).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ART="${GMLAKE_ARTIFACTS:-$ROOT/.artifacts}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/check-torch-versions}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
CXX="${CXX:-g++}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(1.13.1 2.0.1 2.1.2 2.6.0)
start=$SECONDS
log() { printf '[check-torch-versions %3ss] %s\n' "$((SECONDS - start))" "$*"; }

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
    python3 scripts/wheel-extract.py "torch==$v" "$T.tmp" 'torch/include/*' 'torch/version.py' \
      'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so'
    rm -rf "$T" && mv "$T.tmp" "$T"
  fi
  C="$ART/cuda-$series"
  if [ ! -f "$C/nvidia/cuda_runtime/include/cuda_runtime_api.h" ] \
     || [ ! -f "$C/nvidia/cuda_nvcc/include/crt/host_config.h" ]; then
    log "fetching nvidia-cuda-runtime-$cu==$series.* and nvidia-cuda-nvcc-$cu==$series.* headers"
    python3 scripts/wheel-extract.py "nvidia-cuda-runtime-$cu==$series.*" "$C" 'nvidia/*'
    python3 scripts/wheel-extract.py "nvidia-cuda-nvcc-$cu==$series.*" "$C" 'nvidia/cuda_nvcc/include/*'
  fi
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

# ---- compile (in parallel) and link per version
jobs_file="$BUILD_DIR/jobs.txt"
: > "$jobs_file"
for v in "${VERSIONS[@]}"; do
  read -r series cu < <(cuda_of "$v")
  T="$ART/torch-headers/$v/torch"
  C="$ART/cuda-$series/nvidia"
  mm=$(echo "$v" | awk -F. '{print $1 * 100 + $2}')
  inc=(-I"$ROOT/cpp" -I"$BRIDGE" -I"$T/include" -I"$T/include/torch/csrc/api/include"
       -isystem "$C/cuda_runtime/include" -isystem "$C/cuda_nvcc/include")
  [ "$mm" -ge 202 ] || inc+=(-I"$ROOT/cpp/compat/legacy")
  if [ "$mm" -lt 200 ]; then
    srcs=(cpp/gmlake_impl.cpp cpp/compat/torch_1_13.cpp)
  else
    srcs=(cpp/gmlake_impl.cpp cpp/gmlake_torch.cpp cpp/compat/c10_backend.cpp cpp/tier.cpp)
  fi
  mkdir -p "$BUILD_DIR/$v"
  for s in "${srcs[@]}"; do
    o="$BUILD_DIR/$v/$(basename "${s%.cpp}").o"
    # C10_CUDA_BUILD_MAIN_LIB: the in-tree sources are compiled as part of libc10_cuda.
    extra=""
    case "$s" in */c10_backend.cpp|*/torch_1_13.cpp) extra="-DC10_CUDA_BUILD_MAIN_LIB" ;; esac
    printf '%s\n' "$v|$s|$CXX -std=c++17 -O1 -fPIC -D_GLIBCXX_USE_CXX11_ABI=0 -fvisibility=hidden -fvisibility-inlines-hidden -Wall -Wextra -Wno-unused-parameter -Wno-deprecated-declarations -Werror $extra ${inc[*]} -c $ROOT/$s -o $o" >> "$jobs_file"
  done
  printf '%s\n' "$v|scripts/c10-only/gpu_test.cpp|$CXX -std=c++17 -O1 -D_GLIBCXX_USE_CXX11_ABI=0 -Wall -Wextra -Wno-unused-parameter -Wno-deprecated-declarations -Werror -DGMLAKE_TEST_TORCH_NUM=$mm -I$T/include -isystem $C/cuda_runtime/include -isystem $C/cuda_nvcc/include -c $ROOT/scripts/c10-only/gpu_test.cpp -o $BUILD_DIR/$v/gpu_test.o" >> "$jobs_file"
done
log "compiling $(wc -l < "$jobs_file") translation units (${VERSIONS[*]}; -j$JOBS)"
failed=0
# shellcheck disable=SC2016
xargs -P "$JOBS" -d '\n' -n 1 bash -c '
  IFS="|" read -r v s cmd <<< "$1"
  if out=$(eval "$cmd" 2>&1); then echo "  ok   torch $v  $s"; else echo "  FAIL torch $v  $s"; echo "$out" | head -30; exit 1; fi
' _ < "$jobs_file" || failed=1
[ "$failed" = 0 ] || { log "FAIL: compile errors"; exit 1; }

if [ "${NO_LINK:-0}" != 1 ]; then
  for v in "${VERSIONS[@]}"; do
    mm=$(echo "$v" | awk -F. '{print $1 * 100 + $2}')
    [ "$mm" -ge 200 ] || continue
    read -r series cu < <(cuda_of "$v")
    T="$ART/torch-headers/$v/torch"
    CUDART=$(ls "$ART/cuda-$series"/nvidia/cuda_runtime/lib/libcudart.so.* | head -1)
    out="$BUILD_DIR/$v/libgmlake_torch.so"
    "$CXX" -shared -o "$out" "$BUILD_DIR/$v/gmlake_impl.o" "$BUILD_DIR/$v/gmlake_torch.o" "$BUILD_DIR/$v/tier.o" "$FFI_LIB" \
      -L"$T/lib" -lc10_cuda -lc10 "$CUDART" -lpthread -ldl -lm -lrt -lutil -lgcc_s \
      -Wl,--no-undefined -Wl,--exclude-libs,ALL "-Wl,--version-script=$ROOT/cpp/gmlake_torch.map"
    if readelf -d "$out" | grep -q 'libcuda\.so'; then
      log "FAIL: torch $v: libgmlake_torch.so links libcuda"; exit 1
    fi
    # (torch's CUDAAllocatorConfig instance may be exported: a GNU unique symbol, cpp/gmlake_torch.map)
    bad=$(nm -D --defined-only "$out" | awk '{print $3}' | grep -v '^gmlake_' \
      | grep -v 'CUDAAllocatorConfig8instanceEvE10s_instance$' || true)
    [ -z "$bad" ] || { log "FAIL: torch $v: unexpected exports: $bad"; exit 1; }
    log "linked torch $v: $(basename "$out") with -Wl,--no-undefined against torch $v's libc10 / libc10_cuda ($(du -h "$out" | cut -f1))"
  done
fi
log "OK: ${VERSIONS[*]}"
