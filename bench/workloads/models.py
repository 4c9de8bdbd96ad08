"""Models built from configurations (no weights are downloaded)."""

from __future__ import annotations

from typing import Any, Dict


def llama_config(**kw):
    from transformers import LlamaConfig

    kw.setdefault("tie_word_embeddings", False)
    kw.setdefault("max_position_embeddings", 4096)
    try:
        cfg = LlamaConfig(attn_implementation="sdpa", **kw)
    except TypeError:  # older transformers
        cfg = LlamaConfig(**kw)
        cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


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
