# syntax=docker/dockerfile:1
# PyTorch 2.0.1 built from source with gmlake's allocator in libc10_cuda (patches/pytorch-2.0.1.patch).
#
#   docker build -f docker/pytorch-2.0.Dockerfile -t gmlake/pytorch:2.0.1 .        (from the gmlake checkout)
#   docker run --gpus all --rm gmlake/pytorch:2.0.1 python3 -c \
#     "import torch; torch.zeros(1, device='cuda'); print(torch.cuda.get_allocator_backend())"
#
# gmlake is the CUDA allocator by default; vmmDefragment=0 selects PyTorch's own; PYTORCH_CUDA_ALLOC_CONF=backend:gmlake|native|cudaMallocAsync chooses explicitly.
# The build takes hours and tens of GB of disk; MAX_JOBS limits its parallelism.
ARG CUDA_IMAGE=nvidia/cuda:11.7.1-cudnn8-devel-ubuntu20.04
FROM ${CUDA_IMAGE}

ARG PYTORCH_TAG=v2.0.1
ARG RUST_TOOLCHAIN=1.95.0
ARG TORCH_CUDA_ARCH_LIST="7.0;7.5;8.0;8.6+PTX"
ARG MAX_JOBS=8

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# Build tools (cmake and ninja from PyPI: PyTorch needs cmake >= 3.18, and an older one than
# 4.x for its third_party); Rust for gmlake's staticlib.
# (apt package versions are those of the base image's Ubuntu release: not pinned one by one)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential ca-certificates curl git patch python3-dev python3-pip python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:/root/.cargo/bin:$PATH
RUN pip install --no-cache-dir cmake==3.26.4 ninja==1.11.1.1 \
 && curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
      | sh -s -- -y --profile minimal --default-toolchain "${RUST_TOOLCHAIN}"

# PyTorch at the tag, with its submodules.
RUN git clone --depth 1 --branch "${PYTORCH_TAG}" --recursive --shallow-submodules \
      https://github.com/pytorch/pytorch /opt/pytorch
WORKDIR /opt/pytorch
RUN pip install --no-cache-dir -r requirements.txt

# gmlake (this checkout) and the patch.
COPY . /opt/gmlake
RUN patch -p1 < /opt/gmlake/patches/pytorch-2.0.1.patch

# Build and install. GMLAKE_SOURCE_DIR tells the patched c10/cuda/CMakeLists.txt where gmlake is.
ENV GMLAKE_SOURCE_DIR=/opt/gmlake \
    USE_CUDA=1 USE_CUDNN=1 BUILD_TEST=0 USE_MKLDNN=0 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} MAX_JOBS=${MAX_JOBS}
RUN python3 setup.py bdist_wheel \
 && pip install --no-cache-dir dist/torch-*.whl \
 && rm -rf build

# Checks that need no GPU: the allocator in use is gmlake, libcuda is not linked.
WORKDIR /
RUN python3 - <<'PY'
import ctypes, os, subprocess, torch
lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10_cuda.so")
c10_cuda = ctypes.CDLL(lib)
f = c10_cuda.gmlake_c10_backend
f.restype = ctypes.c_char_p
backend = f().decode()
assert hasattr(c10_cuda, "gmlake_c10_stats_json")   # exported, as build-patched-c10.sh checks
print("torch", torch.__version__, "CUDA allocator:", backend)
assert backend == "gmlake", backend
assert "libcuda.so" not in subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
PY

# The in-tree route's GPU test (scripts/c10-only/gpu_test.cpp, as scripts/build-patched-c10.sh
# builds it), linked against the installed torch's libc10 / libc10_cuda:
#   docker run --gpus all --rm gmlake/pytorch:2.0.1 /opt/gmlake-gpu-test/gpu_test
#   docker run --gpus all --rm -e vmmDefragment=0 gmlake/pytorch:2.0.1 /opt/gmlake-gpu-test/gpu_test
RUN TORCH_DIR="$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')" \
 && ABI="$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')" \
 && mkdir -p /opt/gmlake-gpu-test \
 && g++ -std=c++17 -O2 -D_GLIBCXX_USE_CXX11_ABI="${ABI}" -DGMLAKE_TEST_TORCH_NUM=200 \
      -DGMLAKE_TEST_TORCH_VERSION='"2.0.1"' -I"${TORCH_DIR}/include" -I/usr/local/cuda/include \
      /opt/gmlake/scripts/c10-only/gpu_test.cpp -o /opt/gmlake-gpu-test/gpu_test \
      -L"${TORCH_DIR}/lib" -lc10_cuda -lc10 -L/usr/local/cuda/lib64 -lcudart \
      -Wl,-rpath,"${TORCH_DIR}/lib:/usr/local/cuda/lib64" \
 && (/opt/gmlake-gpu-test/gpu_test || test $? = 2)
