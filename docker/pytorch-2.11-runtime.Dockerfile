# syntax=docker/dockerfile:1
# PyTorch 2.11 (PyPI wheel, CUDA 13.0) with gmlake installed at run time: no PyTorch rebuild.
# The gmlake Python package and libgmlake_torch.so (built against the torch 2.11.0 wheel by
# scripts/build-torch-ext.sh, which also runs the C++ tests that need no GPU).
#
#   docker build -f docker/pytorch-2.11-runtime.Dockerfile -t gmlake/pytorch:2.11 .   (from the gmlake checkout)
#   docker run --gpus all --rm gmlake/pytorch:2.11 python -m gmlake train.py
#   docker run --gpus all --rm gmlake/pytorch:2.11 python -c \
#     "import torch, gmlake; gmlake.enable(); torch.zeros(1, device='cuda'); print(torch.cuda.get_allocator_backend())"
#
# Both stages use Ubuntu 24.04, so the library runs against the glibc it was linked with.
ARG RUNTIME_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# ---- build libgmlake_torch.so (needs no GPU and no CUDA toolkit: headers come from PyPI)
FROM ubuntu:24.04 AS build
ARG RUST_TOOLCHAIN=1.95.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
# (apt package versions are those of Ubuntu 24.04: not pinned one by one)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      binutils build-essential ca-certificates cmake curl python3 python3-pip unzip \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/root/.cargo/bin:$PATH
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
      | sh -s -- -y --profile minimal --default-toolchain "${RUST_TOOLCHAIN}"
COPY . /opt/gmlake
WORKDIR /opt/gmlake
# PIP_BREAK_SYSTEM_PACKAGES: the script only downloads wheels with pip (nothing is installed).
RUN PIP_BREAK_SYSTEM_PACKAGES=1 TORCH_VERSION=2.11.0 CUDA_SERIES=13.0 \
      bash scripts/build-torch-ext.sh --out /out

# ---- the runtime image
FROM ${RUNTIME_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
# (apt package versions are those of the base image's Ubuntu release: not pinned one by one)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir torch==2.11.0
COPY --from=build /opt/gmlake/python /opt/gmlake-python
COPY --from=build /out/libgmlake_torch.so /opt/gmlake-python/gmlake/
RUN pip install --no-cache-dir /opt/gmlake-python \
 && rm -rf /opt/gmlake-python \
 && python -m gmlake --check
CMD ["python"]
