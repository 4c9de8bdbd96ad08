"""LLM fine-tuning: a Llama-style model (~1B parameters, bf16, built from a config), peft LoRA
adapters, gradient checkpointing, sequence length drawn per step, AdamW on the adapters."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import models  # noqa: E402

NAME = "llm_lora"
DEFAULTS = {"steps": 10, "warmup": 3, "batch": 4, "cap_gib": 20.0, "search_steps": 3}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--hidden", type=int, default=2048)
    g.add_argument("--layers", type=int, default=16)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--intermediate", type=int, default=5632)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--seq-min", type=int, default=256)
    g.add_argument("--seq-max", type=int, default=2048)
    g.add_argument("--lora-r", type=int, default=16)
    g.add_argument("--no-checkpointing", action="store_true")


class LlmLora(models.CausalLMSteps):
    def __init__(self, args, device):
        import torch
        from peft import LoraConfig, get_peft_model

        from models import build_llama, count_params, llama_config

        if args.tiny:
            args.hidden, args.layers, args.heads, args.intermediate = 64, 2, 4, 128
            args.vocab, args.seq_min, args.seq_max = 512, 16, 64
        self.args, self.device = args, device
        cfg = llama_config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
        )
        model = build_llama(cfg, torch.bfloat16, device)
        if not args.no_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lcfg = LoraConfig(
            r=args.lora_r,
            lora_alpha=2 * args.lora_r,
            lora_dropout=0.05,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(model, lcfg)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4)
        self._info = dict(count_params(self.model), hidden=args.hidden, layers=args.layers,
                          heads=args.heads, intermediate=args.intermediate, vocab=args.vocab,
                          dtype="bfloat16", lora_r=args.lora_r,
                          attn=getattr(model.config, "_attn_implementation", None),
                          checkpointing=not args.no_checkpointing)

    def reset(self):
        self.opt.zero_grad(set_to_none=True)


def build(args, device):
    return LlmLora(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
