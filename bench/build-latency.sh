#!/usr/bin/env bash
# Builds bench/latency.cpp against the installed torch (python3's) into ${1:-build/bench}/latency,
# and its reader's test (bench/tests/latency_ops_test.cpp, no GPU needed) beside it.
#   TORCH_DIR     torch package folder (default: asked from python3)
#   CUDA_INCLUDE  folder with cuda_runtime_api.h (default: CUDA_HOME/include, /usr/local/cuda/include,
#                 torch's nvidia/cu*/include)
#   CUDART        the CUDA runtime library torch uses (default: torch's nvidia/cu*/lib, then CUDA_HOME)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-build/bench}
mkdir -p "$dest"
PY=${PYTHON:-python3}
TORCH_DIR=${TORCH_DIR:-$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')}
site=$(dirname "$TORCH_DIR")
abi=$("$PY" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>/dev/null || echo 1)

first_existing() {
  for p in "$@"; do
    if [ -e "$p" ]; then
      echo "$p"
      return 0
    fi
  done
  return 1
}

if [ -z "${CUDA_INCLUDE:-}" ]; then
  # A toolkit's include folder first (complete: crt/host_config.h too), then pip's nvidia-cuda-runtime.
  hdr=$(first_existing "${CUDA_HOME:-/nonexistent}/include/crt/host_config.h" /usr/local/cuda/include/crt/host_config.h \
    "$site"/nvidia/cu*/include/crt/host_config.h "$site"/nvidia/cu*/include/cuda_runtime_api.h \
    "$site"/nvidia/cuda_runtime/include/cuda_runtime_api.h) ||
    { echo "build-latency: cuda_runtime_api.h not found; set CUDA_INCLUDE" >&2; exit 1; }
  CUDA_INCLUDE=$(dirname "$hdr")
  CUDA_INCLUDE=${CUDA_INCLUDE%/crt}
fi
extra_inc=()
# cuda_runtime_api.h may need crt/host_config.h from another folder (pip's nvidia-cuda-crt).
if [ ! -e "$CUDA_INCLUDE/crt/host_config.h" ]; then
  for d in /usr/local/cuda/include "${CUDA_HOME:-/nonexistent}/include"; do
    if [ -e "$d/crt/host_config.h" ]; then extra_inc+=("-I$d"); break; fi
  done
fi
if [ -z "${CUDART:-}" ]; then
  CUDART=$(first_existing "$site"/nvidia/cu*/lib/libcudart.so.* "$site"/nvidia/cuda_runtime/lib/libcudart.so.* \
    "${CUDA_HOME:-/nonexistent}"/lib64/libcudart.so.* /usr/local/cuda/lib64/libcudart.so.*) ||
    { echo "build-latency: libcudart.so.N not found; set CUDART" >&2; exit 1; }
fi
cudart_dir=$(dirname "$CUDART")
echo "build-latency: torch $TORCH_DIR (cxx11 abi $abi), CUDA headers $CUDA_INCLUDE, runtime $CUDART"
set -x
for src in bench/latency.cpp bench/tests/latency_ops_test.cpp; do
  out=$(basename "$src" .cpp)
  g++ -O2 -std=c++17 -Wall -Wno-unused-parameter -Wno-unused-function -D_GLIBCXX_USE_CXX11_ABI="$abi" \
    -isystem "$TORCH_DIR/include" -isystem "$CUDA_INCLUDE" ${extra_inc[@]+"${extra_inc[@]}"} \
    "$src" -o "$dest/$out" \
    -L"$TORCH_DIR/lib" -lc10_cuda -lc10 "$CUDART" -ldl \
    -Wl,-rpath,"$TORCH_DIR/lib:$cudart_dir"
done
