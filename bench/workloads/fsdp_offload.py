"""ZeRO-3-like training: FSDP2 fully_shard with CPUOffloadPolicy (parameters, gradients and
optimizer state on the host, AdamW stepping on the CPU), one rank, bf16 compute, a Llama-style
model of ~170M parameters, sequence length drawn per step."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import models  # noqa: E402

NAME = "fsdp_offload"
DEFAULTS = {"steps": 6, "warmup": 2, "batch": 8, "cap_gib": 12.0, "search_steps": 3}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--intermediate", type=int, default=2816)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--seq-min", type=int, default=128)
    g.add_argument("--seq-max", type=int, default=1024)
    g.add_argument("--backend", default="",
                   help="process group backend (default: nccl on cuda, gloo on cpu)")
    g.add_argument("--no-offload", action="store_true", help="keep everything on the GPU")


class FsdpOffload(models.CausalLMSteps):
    def __init__(self, args, device):
        import tempfile

        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from models import build_llama, count_params, llama_config

        if args.tiny:
            args.hidden, args.layers, args.heads, args.intermediate = 64, 2, 4, 128
            args.vocab, args.seq_min, args.seq_max = 512, 16, 64
        self.args, self.device = args, device
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        cuda = device.startswith("cuda")
        backend = args.backend or ("nccl" if cuda else "gloo")
        self._tmp = tempfile.mkdtemp(prefix="gmlake-bench-pg-")
        kw = {}
        if cuda:
            torch.cuda.set_device(0)
            kw["device_id"] = torch.device("cuda", 0)
        dist.init_process_group(backend=backend, init_method=f"file://{self._tmp}/store",
                                rank=0, world_size=1, **kw)
        cfg = llama_config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
        )
        offload = cuda and not args.no_offload
        # Parameters in fp32 on the host (offload) or on the GPU; compute in bf16.
        model = build_llama(cfg, torch.float32, "cpu" if offload else device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
        kw = {}
        if mp is not None:
            kw["mp_policy"] = mp
        if offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.train()
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self._info = dict(count_params(model), hidden=args.hidden, layers=args.layers,
                          heads=args.heads, intermediate=args.intermediate, vocab=args.vocab,
                          param_dtype="float32", compute_dtype="bfloat16" if cuda else "float32",
                          offload=offload, backend=backend, world_size=1)

    def reset(self):
        from torch.distributed.fsdp import FSDPModule

        self.opt.zero_grad(set_to_none=True)
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                try:
                    m.reshard()
                except Exception:
                    pass

    def close(self):
        import shutil

        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._tmp, ignore_errors=True)


def build(args, device):
    return FsdpOffload(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
