#!/usr/bin/env bash
# The main job, no GPU needed: build `gmlake` and replay a bundled real PyTorch trace (an
# 8-expert MoE training job recorded on an H100) through the allocator on a simulated device,
# printing the memory it saves against PyTorch's native allocator.
# Extra arguments go to `gmlake replay` (e.g. --plot moe.svg, --capacity 12GiB, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/ensure-rust.sh
source scripts/ensure-rust.sh
cargo build --release --locked -p gmlake-cli
exec target/release/gmlake replay tests/traces/moe-3steps-real.pickle tests/traces/gpt-ckpt.pickle "$@"
