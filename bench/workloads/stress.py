"""Random tensors with random lifetimes (no steady state): a pool of live tensors of 1-512 MiB
(log-uniform sizes); each operation frees a random live tensor or allocates a new one (and
writes it), keeping the live total under a budget. A step is a fixed number of operations."""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "stress"
DEFAULTS = {"steps": 20, "warmup": 3, "batch": 30, "cap_gib": 40.0, "search_steps": 2}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--ops", type=int, default=200, help="operations per step")
    g.add_argument("--min-mib", type=float, default=1.0)
    g.add_argument("--max-mib", type=float, default=512.0)
    g.add_argument("--free-prob", type=float, default=0.5,
                   help="chance that an operation frees (when something is live)")


class Stress:
    """`batch` is the live budget in GiB."""

    def __init__(self, args, device):
        if args.tiny:
            args.ops, args.min_mib, args.max_mib = 20, 0.01, 1.0
        self.args, self.device = args, device
        self.live = []
        self.live_bytes = 0

    def info(self):
        a = self.args
        return {"ops": a.ops, "min_mib": a.min_mib, "max_mib": a.max_mib}

    def sample(self, rng, batch, final_max=False):
        a = self.args
        lo, hi = math.log(a.min_mib), math.log(a.max_mib)
        ops = []
        for _ in range(a.ops):
            size = int(math.exp(hi if final_max else rng.uniform(lo, hi)) * (1 << 20))
            ops.append((rng.random(), rng.random(), max(size, 512)))
        return {"ops": ops, "budget": int(batch * (1 << 30) if not self.args.tiny else batch << 20)}

    def work(self, batch, shape):
        return len(shape["ops"])

    def step(self, batch, shape):
        import torch

        budget = shape["budget"]
        for pick, coin, size in shape["ops"]:
            must_free = self.live_bytes + size > budget
            if self.live and (coin < self.args.free_prob or must_free):
                t = self.live.pop(int(pick * len(self.live)) % len(self.live))
                self.live_bytes -= t.numel()
                del t
                if must_free:
                    continue
            if self.live_bytes + size <= budget:
                t = torch.empty(size, dtype=torch.uint8, device=self.device)
                t[:1] = 1  # touch it: a kernel on the stream, as real work would
                self.live.append(t)
                self.live_bytes += size

    def reset(self):
        self.live = []
        self.live_bytes = 0


def build(args, device):
    return Stress(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
