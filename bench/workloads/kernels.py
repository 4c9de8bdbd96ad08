"""Memory-bound kernels over a large working set allocated once: does the way an allocator maps
memory change how fast kernels run over it? PyTorch's native allocator hands out cudaMalloc
segments; expandable segments and gmlake map physical handles with the CUDA VMM API (20 MiB
handles for expandable segments, gmlake's pages of 2 MiB and up). A kernel that touches many
pages at random misses the GPU's TLB more where the mapping is finer, if the MMU maps
cudaMalloc memory with larger entries.

The working set (`batch` GiB) is allocated at the first step and kept: one flat tensor of
`--gather-gib` GiB for random reads, the rest in tensors of `--chunk-mib` MiB (as a model's
parameters and optimizer state). A step streams over every chunk (`add_`: one read and one
write of each byte) and gathers `--gather-n` random 4-byte elements of the flat tensor
(`index_select` into a buffer kept from step to step). After the first step no step allocates,
so the step time compares the kernels alone; the record's `model` gives the two parts'
medians (CUDA events), `stream_ms` and `gather_ms`."""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "kernels"
DEFAULTS = {"steps": 20, "warmup": 3, "batch": 40, "cap_gib": 60.0, "search_steps": 2}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--chunk-mib", type=float, default=512.0,
                   help="size of each streamed tensor")
    g.add_argument("--gather-gib", type=float, default=16.0,
                   help="size of the flat tensor read at random (part of the working set)")
    g.add_argument("--gather-n", type=int, default=1 << 25,
                   help="random elements gathered a step")
    g.add_argument("--part", choices=("both", "stream", "gather"), default="both",
                   help="which kernels a step runs")


class Kernels:
    """`batch` is the working set in GiB (MiB with --tiny)."""

    def __init__(self, args, device):
        if args.tiny:
            args.chunk_mib, args.gather_gib, args.gather_n = 1.0, 4.0 / 1024, 4096
        if args.chunk_mib <= 0 or args.gather_gib <= 0 or args.gather_n <= 0:
            raise SystemExit("kernels: --chunk-mib, --gather-gib and --gather-n must be positive")
        self.args, self.device = args, device
        self.batch = None
        self.chunks, self.flat, self.idx, self.out = [], None, None, None
        self.stream_ms, self.gather_ms = [], []

    def info(self):
        a = self.args
        med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
        return {"chunk_mib": a.chunk_mib, "gather_gib": a.gather_gib, "gather_n": a.gather_n,
                "part": a.part, "chunks": len(self.chunks),
                "stream_ms": med(self.stream_ms), "gather_ms": med(self.gather_ms)}

    def sample(self, rng, batch, final_max=False):
        return {}

    def work(self, batch, shape):
        return self.set_bytes(batch)

    def set_bytes(self, batch):
        unit = (1 << 20) if self.args.tiny else (1 << 30)
        return int(batch * unit)

    def setup(self, batch):
        import torch

        self.reset()
        total = self.set_bytes(batch)
        flat_bytes = min(int(self.args.gather_gib * (1 << 30)), total)
        self.flat = torch.ones(max(flat_bytes // 4, 1), dtype=torch.float32, device=self.device)
        chunk = max(int(self.args.chunk_mib * (1 << 20)) // 4, 1)
        left = (total - flat_bytes) // 4
        while left > 0:
            n = min(chunk, left)
            self.chunks.append(torch.zeros(n, dtype=torch.float32, device=self.device))
            left -= n
        g = torch.Generator(device="cpu").manual_seed(self.args.seed)
        idx = torch.randint(0, self.flat.numel(), (self.args.gather_n,), generator=g)
        self.idx = idx.to(self.device)
        self.out = torch.empty(self.args.gather_n, dtype=torch.float32, device=self.device)
        self.batch = batch

    def timed(self, fn, into):
        import torch

        if not str(self.device).startswith("cuda"):
            fn()
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        into.append(start.elapsed_time(end))

    def step(self, batch, shape):
        import torch

        if self.batch != batch:
            self.setup(batch)
        if self.args.part in ("both", "stream"):
            self.timed(self.stream, self.stream_ms)
        if self.args.part in ("both", "gather"):
            self.timed(lambda: torch.index_select(self.flat, 0, self.idx, out=self.out),
                       self.gather_ms)

    def stream(self):
        for c in self.chunks:
            c.add_(1.0)

    def reset(self):
        self.chunks, self.flat, self.idx, self.out = [], None, None, None
        self.batch = None


def build(args, device):
    return Kernels(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
