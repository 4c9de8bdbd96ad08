"""Inference with growing KV caches: a Llama-style model (bf16, built from a config) serves one
request batch per step, batch size, prompt length and number of generated tokens drawn per
step; prefill, then greedy decoding one token at a time with transformers' DynamicCache, which
grows every layer's keys and values by concatenation per token."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "kv_infer"
DEFAULTS = {"steps": 5, "warmup": 2, "batch": 32, "cap_gib": 8.0, "search_steps": 2}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--hidden", type=int, default=2048)
    g.add_argument("--layers", type=int, default=12)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--intermediate", type=int, default=5632)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--prompt-min", type=int, default=128)
    g.add_argument("--prompt-max", type=int, default=1024)
    g.add_argument("--new-min", type=int, default=32)
    g.add_argument("--new-max", type=int, default=128)
    g.add_argument("--batch-min-frac", type=float, default=0.25,
                   help="a step serves U(batch*frac, batch) requests")


class KvInfer:
    def __init__(self, args, device):
        import torch

        from models import build_llama, count_params, llama_config

        if args.tiny:
            args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 4, 2, 128
            args.vocab, args.prompt_min, args.prompt_max, args.new_min, args.new_max = 512, 8, 32, 4, 8
        self.args, self.device = args, device
        cfg = llama_config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
        )
        cfg.use_cache = True
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = build_llama(cfg, dtype, device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.cache_class = None
        head_dim = args.hidden // args.heads
        self._info = dict(count_params(self.model), hidden=args.hidden, layers=args.layers,
                          heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate,
                          vocab=args.vocab, dtype=str(dtype).replace("torch.", ""),
                          kv_bytes_per_token=2 * args.layers * args.kv_heads * head_dim * (2 if dtype == torch.bfloat16 else 4),
                          attn=getattr(self.model.config, "_attn_implementation", None))

    def info(self):
        d = dict(self._info)
        d["cache_class"] = self.cache_class
        return d

    def sample(self, rng, batch, final_max=False):
        a = self.args
        if final_max:
            return {"batch": batch, "prompt": a.prompt_max, "new": a.new_max, "seed": rng.randrange(1 << 30)}
        lo = max(1, int(round(batch * a.batch_min_frac)))
        return {
            "batch": rng.randint(lo, max(lo, batch)),
            "prompt": rng.randint(a.prompt_min, a.prompt_max),
            "new": rng.randint(a.new_min, a.new_max),
            "seed": rng.randrange(1 << 30),
        }

    def work(self, batch, shape):
        return shape["batch"] * shape["new"]

    def step(self, batch, shape):
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(shape["seed"])
        b = shape["batch"]
        ids = torch.randint(0, self.args.vocab, (b, shape["prompt"]), device=self.device, generator=g)
        body, head = self.model.model, self.model.lm_head
        with torch.inference_mode():
            out = body(input_ids=ids, use_cache=True)
            cache = out.past_key_values
            self.cache_class = type(cache).__name__
            nxt = head(out.last_hidden_state[:, -1]).argmax(dim=-1, keepdim=True)
            del out, ids
            for _ in range(shape["new"] - 1):
                out = body(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                nxt = head(out.last_hidden_state[:, -1]).argmax(dim=-1, keepdim=True)
                del out
            del cache, nxt

    def reset(self):
        pass


def build(args, device):
    return KvInfer(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
