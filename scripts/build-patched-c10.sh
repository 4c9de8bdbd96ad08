#!/usr/bin/env bash
# Applies gmlake's patch to a PyTorch source tree and builds only c10 and c10_cuda from it, on a
# machine without a GPU or CUDA toolkit (CUDA headers and libcudart from PyPI's
# nvidia-cuda-runtime / nvidia-cuda-nvcc / nvidia-nvml-dev wheels, headers only), then checks the result:
#   - libc10_cuda.so exports the gmlake backend (and gmlake_c10_backend());
#   - no symbol of the Rust staticlib (or its cxx shims) is exported;
#   - libcuda is not in NEEDED, and every undefined symbol resolves (ldd -r);
#   - loaded without a GPU, the library picks gmlake by default, native with vmmDefragment=0
#     (and on 2.x: native / gmlake with PYTORCH_CUDA_ALLOC_CONF=backend:native / backend:gmlake,
#     and PyTorch's run-time settings parse accepts backend:gmlake);
#   - a C++ program linked against it (scripts/c10-only/probe.cpp) calls into the allocator
#     through PyTorch's API: init, statistics, emptyCache, an allocation that raises (no GPU).
# Then it builds the GPU test (scripts/c10-only/gpu_test.cpp) and stages what a GPU machine
# needs to run it, nothing else, in GMLAKE_ARTIFACTS/c10-gpu/VERSION/: libc10.so,
# libc10_cuda.so, the libcudart.so.N the build used, libraries of the system that libc10 needs
# (libcpuinfo.so.0 on 2.x) and gpu_test, stripped of debug information, RPATH $ORIGIN; run it
# there with scripts/c10-gpu-test.sh (docs/patched-builds.md, "On a GPU"). Here, without a GPU,
# the staged gpu_test must start and stop with its "no usable CUDA device" message, and pass
# every check over a fake CUDA runtime and driver on host memory (scripts/c10-only/fake_cuda.c).
#
#   scripts/build-patched-c10.sh VERSION SRC_DIR
#     VERSION: 1.13.1, 2.0.1, 2.1.2 or 2.6.0 (patches/pytorch-VERSION.patch)
#     SRC_DIR: the PyTorch source tree (patched in place; an already applied patch is kept)
#
# Environment: BUILD_DIR (build/c10-VERSION), JOBS (nproc), GMLAKE_ARTIFACTS (.artifacts),
# GMLAKE_CARGO_TARGET_DIR (build/c10-cargo, shared by the versions), CUDA_SERIES (the one the
# version's wheels use), NO_STAGE=1 (no gpu_test, no staging), NO_DRY_RUN=1 (no dry run of
# gpu_test over scripts/c10-only/fake_cuda.c, about a minute). Needs cmake, ninja (or make),
# g++, python3, cargo, patch, binutils, patchelf; on Debian also libfmt-dev, and
# nlohmann-json3-dev and libcpuinfo-dev for 2.x (installed with apt-get when missing). Writes a
# summary to BUILD_DIR/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ $# -ne 2 ]; then
  sed -n '2,31p' "$0"; exit 2
fi
VERSION="$1"
SRC="$(cd "$2" && pwd)"
PATCH="$ROOT/patches/pytorch-$VERSION.patch"
[ -f "$PATCH" ] || { echo "build-patched-c10: no $PATCH" >&2; exit 2; }
[ -f "$SRC/c10/cuda/CUDACachingAllocator.cpp" ] || { echo "build-patched-c10: $SRC is not a PyTorch tree" >&2; exit 2; }
ART="${GMLAKE_ARTIFACTS:-$ROOT/.artifacts}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/c10-$VERSION}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
export GMLAKE_CARGO_TARGET_DIR="${GMLAKE_CARGO_TARGET_DIR:-$ROOT/build/c10-cargo}"
case "$VERSION" in
  1.13.*|2.0.*) CUDA_SERIES="${CUDA_SERIES:-11.7}"; CU=cu11 ;;
  2.1.*) CUDA_SERIES="${CUDA_SERIES:-12.1}"; CU=cu12 ;;
  2.6.*) CUDA_SERIES="${CUDA_SERIES:-12.4}"; CU=cu12 ;;
  *) echo "build-patched-c10: unsupported version $VERSION" >&2; exit 2 ;;
esac
MINOR="${VERSION%.*}"

log() { printf '[build-patched-c10 %s] %s\n' "$VERSION" "$*"; }
SUMMARY=()
note() { log "$*"; SUMMARY+=("$*"); }
fail() { echo "[build-patched-c10 $VERSION] FAIL: $*" >&2; exit 1; }

# ---- tools
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v patch >/dev/null || need_apt+=(patch)
command -v patchelf >/dev/null || need_apt+=(patchelf)
# c10 includes fmt (header-only) on every version, 1.13 included.
[ -f /usr/include/fmt/format.h ] || need_apt+=(libfmt-dev)
if [ "${MINOR%%.*}" = 2 ]; then
  [ -f /usr/include/nlohmann/json.hpp ] || need_apt+=(nlohmann-json3-dev)
  [ -f /usr/include/cpuinfo.h ] || need_apt+=(libcpuinfo-dev)
fi
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  log "installing ${need_apt[*]} with apt-get"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null; }
fi
if ! command -v cargo >/dev/null 2>&1; then
  # shellcheck source=scripts/ensure-rust.sh
  source scripts/ensure-rust.sh
fi
GEN=Ninja; command -v ninja >/dev/null || GEN="Unix Makefiles"
# shellcheck source=scripts/lib/wheels.sh
source scripts/lib/wheels.sh
# shellcheck source=scripts/lib/symbols.sh
source scripts/lib/symbols.sh

# ---- CUDA headers (runtime + crt from nvcc) and libcudart, from PyPI
CUDA_ROOT="$ART/cuda-$CUDA_SERIES"
wheels_cuda_headers "$CUDA_SERIES" "$CU" "$CUDA_ROOT"
CUDA_INC="$CUDA_ROOT/nvidia/cuda_runtime/include;$CUDA_ROOT/nvidia/cuda_nvcc/include"
if [ "$CU" = cu12 ]; then
  # c10/cuda/driver_api.h (2.1+) includes nvml.h (PyPI nvidia-nvml-dev).
  if [ ! -f "$CUDA_ROOT/nvidia/nvml_dev/include/nvml.h" ]; then
    wheels_fetch "nvidia-nvml-dev-$CU==$CUDA_SERIES.*" "$CUDA_ROOT" 'nvidia/*/include/*'
  fi
  CUDA_INC="$CUDA_INC;$CUDA_ROOT/nvidia/nvml_dev/include"
fi
CUDART=$(ls "$CUDA_ROOT"/nvidia/cuda_runtime/lib/libcudart.so.* | head -1)

# ---- patch
if patch -p1 -R --dry-run -s -f -d "$SRC" < "$PATCH" >/dev/null 2>&1; then
  note "patch: $(basename "$PATCH") already applied to $SRC"
else
  patch -p1 --forward -s -d "$SRC" < "$PATCH" || fail "$(basename "$PATCH") does not apply to $SRC"
  added=$(( $(grep -c '^+' "$PATCH") - $(grep -c '^+++ ' "$PATCH") ))
  removed=$(( $(grep -c '^-' "$PATCH") - $(grep -c '^--- ' "$PATCH") ))
  note "patch: applied $(basename "$PATCH") to $SRC ($added lines added, $removed removed)"
fi

# ---- configure and build c10 + c10_cuda
T0=$(date +%s)
cmake -S scripts/c10-only -B "$BUILD_DIR" -G "$GEN" -DCMAKE_BUILD_TYPE=Release \
  -DPYTORCH_SRC="$SRC" -DCUDA_INCLUDE_DIRS="$CUDA_INC" -DCUDART_LIBRARY="$CUDART" \
  -DGMLAKE_SOURCE_DIR="$ROOT" -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$BUILD_DIR/lib" \
  > "$BUILD_DIR.configure.log" 2>&1 || { tail -40 "$BUILD_DIR.configure.log"; fail "cmake configure"; }
grep -E '^-- gmlake' "$BUILD_DIR.configure.log" | sed 's/^-- /[cmake] /' || true
cmake --build "$BUILD_DIR" --target c10_cuda -j "$JOBS" > "$BUILD_DIR.build.log" 2>&1 \
  || { grep -E 'error|Error' "$BUILD_DIR.build.log" | head -40; tail -20 "$BUILD_DIR.build.log"; fail "build (log: $BUILD_DIR.build.log)"; }
T1=$(date +%s)
LIB="$BUILD_DIR/lib/libc10_cuda.so"
[ -f "$LIB" ] || fail "no $LIB"
ntu=$(grep -cE '\[[0-9]+/[0-9]+\] Building CXX' "$BUILD_DIR.build.log" || true)
note "build: c10 + c10_cuda in $((T1 - T0)) s ($ntu C++ files compiled this run, -j$JOBS): $LIB ($(du -h "$LIB" | cut -f1))"

# ---- checks
exports=$(symbols_exported "$LIB" | c++filt)
backend=$(echo "$exports" | grep -E 'CUDACachingAllocator::Gmlake::|gmlake_c10_backend|gmlake_c10_stats_json' | sort)
[ -n "$backend" ] || fail "libc10_cuda.so exports no gmlake backend"
echo "$backend" | grep -q '^gmlake_c10_backend$' || fail "gmlake_c10_backend is not exported"
echo "$backend" | grep -q '^gmlake_c10_stats_json$' || fail "gmlake_c10_stats_json is not exported"
note "exports: $(echo "$backend" | tr '\n' ';' | sed 's/;$//; s/;/; /g')"
leaked=$( (echo "$exports" | grep -Ei 'rust|cxxbridge|gmlake_core|gmlake_cuda|gmlake_ffi|cudarc'; echo "$exports" | grep -E 'gmlake::') || true)
[ -z "$leaked" ] || { echo "$leaked" | head; fail "Rust / gmlake-internal symbols are exported"; }
inside=$(nm "$LIB" 2>/dev/null | grep -c -E 'cxxbridge1|rust_eh_personality|gmlake_core' || true)
[ "$inside" -gt 0 ] || fail "the Rust staticlib does not seem to be linked in (no cxxbridge/rust symbols in .symtab)"
note "hidden: 0 exported symbols from the Rust staticlib ($inside of its symbols in the static symbol table); $(symbols_exported "$LIB" | wc -l) exported symbols in all"
needed=$(symbols_needed "$LIB")
case " $needed " in *" libcuda.so"*) fail "libcuda is in NEEDED: $needed" ;; esac
note "NEEDED: $needed(no libcuda)"
undef=$(LD_LIBRARY_PATH="$BUILD_DIR/lib:$(dirname "$CUDART")" ldd -r "$LIB" 2>&1 | grep -E 'undefined symbol|not found' || true)
[ -z "$undef" ] || { echo "$undef" | head; fail "unresolved symbols"; }
note "ldd -r: every symbol resolves (against the built libc10.so and PyPI's libcudart)"

# Load it (no GPU needed: the backend is chosen by a static initializer at load time).
probe() { # env... -> backend name
  env "$@" LD_LIBRARY_PATH="$BUILD_DIR/lib:$(dirname "$CUDART")" python3 -c '
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
f = lib.gmlake_c10_backend
f.restype = ctypes.c_char_p
print(f().decode())' "$LIB"
}
expect() { # want label env...
  local want="$1" label="$2"; shift 2
  local got; got=$(probe "$@" 2>&1) || fail "loading $LIB: $got"
  [ "$got" = "$want" ] || fail "with $label: backend $got, expected $want"
  echo "$label -> $got"
}
U=(-u vmmDefragment -u PYTORCH_CUDA_ALLOC_CONF)
sel=$(expect gmlake "no settings" "${U[@]}")
sel+="; $(expect native "vmmDefragment=0" "${U[@]}" vmmDefragment=0)"
sel+="; $(expect gmlake "vmmDefragment=1" "${U[@]}" vmmDefragment=1)"
if [ "${MINOR%%.*}" = 2 ]; then
  sel+="; $(expect native "backend:native" "${U[@]}" PYTORCH_CUDA_ALLOC_CONF=backend:native)"
  sel+="; $(expect gmlake "vmmDefragment=0 backend:gmlake" "${U[@]}" vmmDefragment=0 PYTORCH_CUDA_ALLOC_CONF=backend:gmlake)"
  sel+="; $(expect cudaMallocAsync "backend:cudaMallocAsync" "${U[@]}" PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)"
fi
note "backend chosen at load (dlopen, no GPU): $sel"

# Call into the allocator through PyTorch's API from a C++ program linked against the built
# libraries (scripts/c10-only/probe.cpp): init, statistics, emptyCache, and an allocation that
# must raise a c10::Error without a GPU; on 2.x also PyTorch's run-time parse of the settings
# (its check that backend: names the allocator in use) with backend:gmlake.
PROBE="$BUILD_DIR/probe"
IFS=';' read -r -a cinc <<< "$CUDA_INC"
pdef=(); [ "${MINOR%%.*}" = 2 ] || pdef=(-DGMLAKE_PROBE_TORCH1)
g++ -std=c++17 -O1 -w "${pdef[@]}" -I"$SRC" -I"$BUILD_DIR" "${cinc[@]/#/-I}" scripts/c10-only/probe.cpp -o "$PROBE" \
  -L"$BUILD_DIR/lib" -lc10_cuda -lc10 "$CUDART" -Wl,-rpath,"$BUILD_DIR/lib:$(dirname "$CUDART")" \
  || fail "probe.cpp does not build"
run_probe() { # want-backend env-and-args...
  local want="$1"; shift
  local out; out=$(env -u vmmDefragment -u PYTORCH_CUDA_ALLOC_CONF "$@" 2>&1) || fail "probe: $out"
  case "$out" in "backend=$want "*) ;; *) fail "probe: expected backend $want: $out" ;; esac
  case "$out" in *"raised c10::Error"*|*"(a GPU?)"*) ;; *) fail "probe: unexpected: $out" ;; esac
  echo "$out"
}
# (Assignments first: a failure inside $(...) then stops the script under set -e.)
r=$(run_probe gmlake "$PROBE"); note "probe (C++ through PyTorch's API): $r"
r=$(run_probe native vmmDefragment=0 "$PROBE"); note "probe, vmmDefragment=0: $r"
if [ "${MINOR%%.*}" = 2 ]; then
  r=$(run_probe gmlake PYTORCH_CUDA_ALLOC_CONF=backend:gmlake "$PROBE" backend:gmlake); note "probe, backend:gmlake: $r"
  r=$(run_probe gmlake "$PROBE" expandable_segments:False,backend:gmlake); note "probe, default + settings: $r"
fi

# ---- the GPU test and what a GPU machine needs to run it
if [ "${NO_STAGE:-0}" != 1 ]; then
  STAGE="$ART/c10-gpu/$VERSION"
  vnum=$(echo "$VERSION" | awk -F. '{print $1 * 100 + $2}')
  # DT_RPATH (not RUNPATH): it applies to the libraries' own dependencies as well.
  # shellcheck disable=SC2016
  g++ -std=c++17 -O2 -Wall -Wextra -Wno-unused-parameter -Wno-deprecated-declarations \
    -DGMLAKE_TEST_TORCH_NUM="$vnum" -DGMLAKE_TEST_TORCH_VERSION="\"$VERSION\"" \
    -I"$SRC" -I"$BUILD_DIR" "${cinc[@]/#/-I}" scripts/c10-only/gpu_test.cpp -o "$BUILD_DIR/gpu_test" \
    -L"$BUILD_DIR/lib" -lc10_cuda -lc10 "$CUDART" -Wl,--disable-new-dtags -Wl,-rpath,'$ORIGIN' \
    > "$BUILD_DIR.gpu_test.log" 2>&1 || { cat "$BUILD_DIR.gpu_test.log"; fail "gpu_test.cpp does not build"; }
  rm -rf "$STAGE.tmp" && mkdir -p "$STAGE.tmp"
  cp "$BUILD_DIR/lib/libc10.so" "$BUILD_DIR/lib/libc10_cuda.so" "$CUDART" "$BUILD_DIR/gpu_test" "$STAGE.tmp/"
  # Libraries libc10 needs beyond the C/C++ runtime (Debian's libcpuinfo on 2.x).
  extra=()
  for n in $(symbols_needed "$BUILD_DIR/lib/libc10.so"); do
    case "$n" in libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libstdc++.so*|libgcc_s.so*|ld-linux*|libc10*|libcudart*) continue ;; esac
    path=$(ldd "$BUILD_DIR/lib/libc10.so" | awk -v n="$n" '$1 == n {print $3}')
    [ -f "$path" ] || fail "libc10.so needs $n, not found"
    cp -L "$path" "$STAGE.tmp/$n"
    extra+=("$n")
  done
  for f in "$STAGE.tmp"/*; do
    chmod u+w "$f"
    strip --strip-debug "$f"
  done
  for f in "$STAGE.tmp"/*.so*; do
    # shellcheck disable=SC2016
    patchelf --set-rpath '$ORIGIN' "$f"
  done
  {
    echo "patched torch $VERSION: c10 + c10_cuda built by scripts/build-patched-c10.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "gmlake commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet HEAD -- cpp cmake rust patches scripts/c10-only 2>/dev/null || echo ' (+ uncommitted changes)')"
    echo "source: $SRC; CUDA runtime: PyPI nvidia-cuda-runtime-$CU $CUDA_SERIES.* ($(basename "$CUDART"))"
    echo "compiler: $(g++ --version | head -1); built against $(ldd --version | head -1)"
    echo "run: scripts/c10-gpu-test.sh $(dirname "$STAGE")   (or ./gpu_test in this folder)"
    echo "needs from the system: a CUDA driver (libcuda.so.1, loaded at run time), and:"
    for f in "$STAGE.tmp"/*; do
      printf '  %-18s %s %s\n' "$(basename "$f")" \
        "$(objdump -T "$f" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)" \
        "$(objdump -T "$f" | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)"
    done
    echo "sha256:"
    (cd "$STAGE.tmp" && sha256sum -- * | sed 's/^/  /')
  } > "$BUILD_DIR/BUILD-INFO.txt"
  mv "$BUILD_DIR/BUILD-INFO.txt" "$STAGE.tmp/"
  rm -rf "$STAGE" && mv "$STAGE.tmp" "$STAGE"
  # The runner beside the versions: the folder alone is what a GPU machine needs.
  cp scripts/c10-gpu-test.sh "$(dirname "$STAGE")/c10-gpu-test.sh"
  glibc=$(for f in "$STAGE"/*.so* "$STAGE/gpu_test"; do objdump -T "$f"; done | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
  glibcxx=$(for f in "$STAGE"/*.so* "$STAGE/gpu_test"; do objdump -T "$f"; done | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)
  staged=""
  for f in "$STAGE"/*; do [ "$(basename "$f")" = BUILD-INFO.txt ] || staged+="$(basename "$f") "; done
  note "gpu_test: built; staged in $STAGE: $staged($(du -sh "$STAGE" | cut -f1); ${extra[*]:-no extra system libraries}); needs $glibc, $glibcxx, RPATH \$ORIGIN"
  # Self-contained: every library resolves from the folder or the C/C++ runtime of the system.
  deps=$(env -u LD_LIBRARY_PATH ldd "$STAGE/gpu_test")
  if echo "$deps" | grep -q 'not found'; then echo "$deps"; fail "staged gpu_test: unresolved libraries"; fi
  outside=$(echo "$deps" | awk '$2 == "=>" {print $1 " " $3}' | grep -vE "^(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s)\.so" | grep -v " $STAGE/" || true)
  [ -z "$outside" ] || { echo "$outside"; fail "staged gpu_test loads libraries from outside its folder"; }
  # Without a GPU it must start and stop with a clear message (exit 2), naming the backend.
  gpu_run() { # want-backend env...
    local want="$1"; shift
    local out rc=0
    out=$(cd / && env -u LD_LIBRARY_PATH -u vmmDefragment -u PYTORCH_CUDA_ALLOC_CONF "$@" "$STAGE/gpu_test" 2>&1) || rc=$?
    if [ "$rc" = 2 ] && echo "$out" | grep -q "^FAIL: no usable CUDA device.*backend in the library: $want)"; then
      echo "$out" | grep '^FAIL: no usable' | sed 's/^FAIL: //'
    elif [ "$rc" = 0 ]; then
      echo "a GPU is here: gpu_test passed ($(echo "$out" | grep '^RESULT'))"
    else
      echo "$out" | tail -20; fail "staged gpu_test (${*:-default}): exit $rc"
    fi
  }
  # (Assignments first: a failure inside $(...) then stops the script under set -e.)
  r=$(gpu_run gmlake); note "staged gpu_test, no settings: $r"
  r=$(gpu_run native vmmDefragment=0); note "staged gpu_test, vmmDefragment=0: $r"
  if [ "${MINOR%%.*}" = 2 ]; then
    r=$(gpu_run native PYTORCH_CUDA_ALLOC_CONF=backend:native); note "staged gpu_test, backend:native: $r"
  fi

  # Dry run on the CPU: the staged gpu_test, libc10 and libc10_cuda over a fake CUDA runtime and
  # driver (scripts/c10-only/fake_cuda.c: host memory, memfd-backed virtual memory), every stage
  # and check, per backend setting. Catches what needs no GPU to go wrong (the API calls, the
  # test's own logic, gmlake's stitch through real page aliasing); says nothing of CUDA itself.
  if [ "${NO_DRY_RUN:-0}" != 1 ]; then
    DRY="$BUILD_DIR/dry"
    rm -rf "$DRY" && mkdir -p "$DRY"
    for f in "$STAGE"/*; do [ "$(basename "$f")" = BUILD-INFO.txt ] || cp "$f" "$DRY/"; done
    chmod -R u+w "$DRY"
    so=$(basename "$CUDART")
    echo "$so { global: *; };" > "$BUILD_DIR/fake_cuda.map"
    gcc -shared -fPIC -O1 -w "${cinc[@]/#/-I}" scripts/c10-only/fake_cuda.c -o "$DRY/$so" \
      -Wl,-soname,"$so" -Wl,--version-script="$BUILD_DIR/fake_cuda.map" -lpthread \
      || fail "scripts/c10-only/fake_cuda.c does not build"
    ln -sf "$so" "$DRY/libcuda.so.1"
    dry_run() { # label want env...
      local label="$1" want="$2"; shift 2
      local log="$BUILD_DIR/dry-${label//[:=]/-}.log" rc=0
      (cd "$DRY" && env -u LD_LIBRARY_PATH -u vmmDefragment -u PYTORCH_CUDA_ALLOC_CONF "$@" \
        timeout 900 ./gpu_test --expect "$want") > "$log" 2>&1 || rc=$?
      [ "$rc" = 0 ] || { grep -E 'FAIL|terminate|what\(\)' "$log" | head -20; tail -5 "$log"; fail "dry run ($label): exit $rc (log: $log)"; }
      grep '^RESULT' "$log" | sed 's/^RESULT //'
    }
    r=$(dry_run default gmlake); note "dry run (fake CUDA on the CPU), default: $r"
    r=$(dry_run vmmDefragment=0 native vmmDefragment=0); note "dry run, vmmDefragment=0: $r"
    if [ "${MINOR%%.*}" = 2 ]; then
      r=$(dry_run backend:native native PYTORCH_CUDA_ALLOC_CONF=backend:native); note "dry run, backend:native: $r"
    fi
  fi
fi

{
  echo "build-patched-c10 $VERSION $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(nproc) cores, $(g++ --version | head -1)"
  echo "source: $SRC"
  echo "CUDA headers/libcudart: PyPI nvidia-cuda-runtime-$CU $CUDA_SERIES.* ($(basename "$CUDART"))"
  printf '%s\n' "${SUMMARY[@]}"
} > "$BUILD_DIR/summary.txt"
log "OK (summary: $BUILD_DIR/summary.txt)"
