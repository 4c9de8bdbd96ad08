"""A small workload for compute-sanitizer memcheck: allocations of several sizes written and
read, a forced stitch with kernels through the stitched range, record_stream, a CUDA graph,
frees and empty_cache. Tensors stay small (memcheck instruments every access)."""

import os
import sys

sys.path.insert(0, os.environ.get("GMLAKE_PYTHON_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "..", "python")))

import torch  # noqa: E402

import gmlake  # noqa: E402

gmlake.enable(os.environ.get("GMLAKE_TEST_CONF", ""))
MiB = 1 << 20

ts = [torch.full((n,), i % 200, dtype=torch.uint8, device="cuda") for i, n in enumerate((1, 513, 4096, MiB + 1, 3 * MiB))]
assert all(bool((t == i % 200).all()) for i, t in enumerate(ts))

blocks = [torch.full((4 * MiB,), i, dtype=torch.uint8, device="cuda") for i in range(8)]
del blocks[::2]
big = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
big.fill_(7)
assert int(big.sum()) == 7 * 12 * MiB
assert all(bool((b == 2 * i + 1).all()) for i, b in enumerate(blocks))
assert gmlake.stats()["gmlake.stitches"] >= 1, "no stitch in the sanitizer workload"

side = torch.cuda.Stream()
x = torch.ones(MiB, device="cuda")
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    y = x * 2
x.record_stream(side)
del x
z = torch.zeros(MiB, device="cuda")
torch.cuda.synchronize()
assert bool((y == 2).all())

static = torch.randn(64, 64, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    (static @ static).relu()
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    out = (static @ static).relu()
g.replay()
torch.cuda.synchronize()
assert torch.allclose(out, (static @ static).relu())

del ts, blocks, big, y, z, g, out
torch.cuda.synchronize()
torch.cuda.empty_cache()
print("sanitizer workload done", gmlake.stats()["gmlake.stitches"], "stitches")
