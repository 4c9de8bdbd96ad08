"""Models built from configurations (no weights are downloaded)."""

from __future__ import annotations

from typing import Any, Dict


def config(cls, attn: str, **kw):
    """`cls(**kw)` (a transformers config) with attention implementation `attn` and no KV
    cache, also on transformers versions whose configs do not take `attn_implementation`."""
    try:
        cfg = cls(attn_implementation=attn, **kw)
    except TypeError:  # older transformers
        cfg = cls(**kw)
        cfg._attn_implementation = attn
    cfg.use_cache = False
    return cfg


def llama_config(**kw):
    from transformers import LlamaConfig

    kw.setdefault("tie_word_embeddings", False)
    kw.setdefault("max_position_embeddings", 4096)
    return config(LlamaConfig, "sdpa", **kw)


def build_llama(cfg, dtype, device):
    """LlamaForCausalLM with random weights, created directly in `dtype` on `device` (no fp32
    copy on the GPU first)."""
    import torch
    from transformers import LlamaForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype=dtype)


def count_params(model) -> Dict[str, Any]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": total, "trainable_params": trainable}


class CausalLMSteps:
    """The training step shared by the language-model workloads: random token ids of a
    sequence length drawn per step (seeded, so every allocator sees the same shapes), a
    forward with labels, backward, and an optimizer step. Subclasses set `args`, `device`,
    `model`, `opt` and `_info`."""

    def info(self):
        return self._info

    def sample(self, rng, batch, final_max=False):
        seq = self.args.seq_max if final_max else rng.randint(self.args.seq_min, self.args.seq_max)
        return {"seq": seq, "seed": rng.randrange(1 << 30)}

    def work(self, batch, shape):
        return batch * shape["seq"]

    def step(self, batch, shape):
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(shape["seed"])
        ids = torch.randint(0, self.args.vocab, (batch, shape["seq"]), device=self.device, generator=g)
        out = self.model(input_ids=ids, labels=ids)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
