#!/usr/bin/env bash
# Builds the wheels bench/deepspeed/run.sh installs DeepSpeed from on a GPU machine with no
# network (on a machine with network; no GPU or torch needed): DeepSpeed 0.19.x as a pure
# Python wheel (no op pre-built: DS_BUILD_OPS=0; the benchmark compiles none) and its
# dependencies that a torch + transformers install may lack, for CPython 3.12 on x86-64.
#   bash bench/deepspeed/wheels.sh [.artifacts/ds]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.artifacts/ds}
ver=${DEEPSPEED_VERSION:-0.19.8}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "deepspeed==$ver" -d "$tmp"
tar xzf "$tmp"/deepspeed-*.tar.gz -C "$tmp"
python3 -m pip install -q wheel setuptools
(cd "$tmp"/deepspeed-"$ver" && DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation . -w "$OLDPWD/$out")
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d "$out" einops hjson msgpack py-cpuinfo "pydantic>=2" psutil tqdm
ls -la "$out"
