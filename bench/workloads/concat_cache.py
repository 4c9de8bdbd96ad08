"""Per-request caches grown by concatenation (decode-like): requests arrive and finish at random
times; each keeps one K/V-like tensor per layer that grows by torch.cat of one token slice per
decode iteration (the old tensor freed after the new one is made), so sizes grow by a little
every iteration and freed blocks never fit the next request exactly. A step is a fixed number
of decode iterations; a few hundred MiB live in all."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "concat_cache"
# 60 measured steps: the job's largest shapes come late (at seed 0 its peak active memory
# rises in steps 51-59), and a shorter run can look settled where this one does not
# (docs/benchmarks.md, "Misses that walk nothing, tails last by default").
DEFAULTS = {"steps": 60, "warmup": 5, "batch": 16, "cap_gib": 1.0, "search_steps": 2}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--token-bytes", type=int, default=16384,
                   help="bytes one token adds to one layer's cache (heads x head_dim x 2 x bf16)")
    g.add_argument("--iters", type=int, default=64, help="decode iterations per step")
    g.add_argument("--prompt-min", type=int, default=16)
    g.add_argument("--prompt-max", type=int, default=512)
    g.add_argument("--life-min", type=int, default=32, help="tokens a request generates, at least")
    g.add_argument("--life-max", type=int, default=384)


class ConcatCache:
    def __init__(self, args, device):
        if args.tiny:
            args.layers, args.token_bytes, args.iters = 2, 256, 8
            args.prompt_min, args.prompt_max, args.life_min, args.life_max = 2, 8, 2, 8
        self.args, self.device = args, device
        self.requests = []  # [remaining tokens, [cache per layer]]

    def info(self):
        a = self.args
        return {"layers": a.layers, "token_bytes": a.token_bytes, "iters": a.iters}

    def sample(self, rng, batch, final_max=False):
        # The arrivals of the step: (iteration, prompt tokens, tokens to generate).
        a = self.args
        n = batch if final_max else rng.randint(max(1, batch // 4), batch)
        arrivals = []
        for _ in range(n):
            arrivals.append((
                0 if final_max else rng.randrange(a.iters),
                a.prompt_max if final_max else rng.randint(a.prompt_min, a.prompt_max),
                a.life_max if final_max else rng.randint(a.life_min, a.life_max),
            ))
        arrivals.sort()
        return {"arrivals": arrivals, "max_live": batch}

    def work(self, batch, shape):
        return self.args.iters * max(1, len(self.requests))

    def step(self, batch, shape):
        import torch

        a = self.args
        dev = self.device
        width = a.token_bytes // 2  # bf16 elements per token and layer
        dtype = torch.bfloat16
        pending = list(shape["arrivals"])
        for it in range(a.iters):
            while pending and pending[0][0] <= it and len(self.requests) < shape["max_live"]:
                _, prompt, life = pending.pop(0)
                caches = [torch.randn(prompt, width, device=dev, dtype=dtype) for _ in range(a.layers)]
                self.requests.append([life, caches])
            for r in self.requests:
                for li in range(a.layers):
                    tok = torch.randn(1, width, device=dev, dtype=dtype)
                    r[1][li] = torch.cat([r[1][li], tok])  # the old cache is freed here
                r[0] -= 1
            self.requests = [r for r in self.requests if r[0] > 0]

    def reset(self):
        self.requests = []


def build(args, device):
    return ConcatCache(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
