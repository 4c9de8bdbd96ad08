"""Mixture of experts training: layers of 8 expert MLPs with top-2 routing, skewed and
changing per step (a random bias on the router logits, its strength drawn per step), a number
of tokens drawn per step; tokens are gathered per expert (sizes vary with the routing), bf16,
AdamW."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "moe"
DEFAULTS = {"steps": 10, "warmup": 3, "batch": 16, "cap_gib": 16.0, "search_steps": 3}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--dim", type=int, default=1024)
    g.add_argument("--ffn", type=int, default=4096)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--top-k", type=int, default=2)
    g.add_argument("--layers", type=int, default=6)
    g.add_argument("--seq", type=int, default=1024, help="tokens per batch element")
    g.add_argument("--fill-min", type=float, default=0.25,
                   help="a step has batch*seq*U(fill_min, 1) tokens")
    g.add_argument("--skew-max", type=float, default=3.0,
                   help="router bias ~ skew * N(0, 1) per expert, skew ~ U(0, skew_max) per step")


def _modules():
    import torch
    from torch import nn

    class Expert(nn.Module):
        def __init__(self, dim, ffn):
            super().__init__()
            self.w1 = nn.Linear(dim, ffn, bias=False)
            self.w3 = nn.Linear(dim, ffn, bias=False)
            self.w2 = nn.Linear(ffn, dim, bias=False)

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    class MoELayer(nn.Module):
        def __init__(self, dim, ffn, experts, top_k):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.router = nn.Linear(dim, experts, bias=False)
            self.experts = nn.ModuleList(Expert(dim, ffn) for _ in range(experts))
            self.top_k = top_k

        def forward(self, x, bias):
            h = self.norm(x)
            logits = self.router(h).float() + bias
            probs = logits.softmax(dim=-1)
            weight, chosen = probs.topk(self.top_k, dim=-1)
            weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
            flat = chosen.reshape(-1)
            token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
            w = weight.reshape(-1)
            out = torch.zeros_like(x)
            counts = []
            for e, expert in enumerate(self.experts):
                sel = (flat == e).nonzero().squeeze(1)
                counts.append(int(sel.numel()))
                if sel.numel() == 0:
                    continue
                tok = token[sel]
                y = expert(h[tok]) * w[sel].unsqueeze(1)
                out = out.index_add(0, tok, y)
            self.last_counts = counts
            return x + out

    class MoE(nn.Module):
        def __init__(self, dim, ffn, experts, top_k, layers):
            super().__init__()
            self.layers = nn.ModuleList(MoELayer(dim, ffn, experts, top_k) for _ in range(layers))

        def forward(self, x, biases):
            for layer, b in zip(self.layers, biases):
                x = layer(x, b)
            return x

    return MoE


class MoeWorkload:
    def __init__(self, args, device):
        import torch

        if args.tiny:
            args.dim, args.ffn, args.layers, args.seq = 32, 64, 2, 32
        self.args, self.device = args, device
        MoE = _modules()
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = MoE(args.dim, args.ffn, args.experts, args.top_k, args.layers)
        finally:
            torch.set_default_dtype(old)
        self.dtype = dtype
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.counts = []
        n = sum(p.numel() for p in self.model.parameters())
        self._info = dict(params=n, trainable_params=n, dim=args.dim, ffn=args.ffn,
                          experts=args.experts, top_k=args.top_k, layers=args.layers,
                          dtype=str(dtype).replace("torch.", ""))

    def info(self):
        return self._info

    def sample(self, rng, batch, final_max=False):
        a = self.args
        full = batch * a.seq
        tokens = full if final_max else max(1, int(full * rng.uniform(a.fill_min, 1.0)))
        skew = a.skew_max if final_max else rng.uniform(0.0, a.skew_max)
        return {"tokens": tokens, "skew": round(skew, 4), "seed": rng.randrange(1 << 30)}

    def work(self, batch, shape):
        return shape["tokens"]

    def step(self, batch, shape):
        import torch

        a = self.args
        g = torch.Generator(device=self.device)
        g.manual_seed(shape["seed"])
        x = torch.randn(shape["tokens"], a.dim, device=self.device, dtype=self.dtype, generator=g)
        biases = [shape["skew"] * torch.randn(a.experts, device=self.device, generator=g)
                  for _ in range(a.layers)]
        y = self.model(x, biases)
        loss = y.float().pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.counts = [layer.last_counts for layer in self.model.layers]

    def reset(self):
        self.opt.zero_grad(set_to_none=True)


def build(args, device):
    return MoeWorkload(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
