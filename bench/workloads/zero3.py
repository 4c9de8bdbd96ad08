"""DeepSpeed ZeRO-3 fine-tuning of an OPT causal LM built from a config (GMLake's headline
setting, issue 17): strategies N (none), R (recomputation: gradient checkpointing), LR (peft
LoRA + R), RO (R + ZeRO-3 parameter and optimizer offload to the CPU) and LRO; sequence length
drawn per step; bf16; deterministic (no dropout, seeded shapes and data).

One process per GPU: plain `python` for one GPU (it sets up a world of one), `torchrun
--nproc-per-node N [-m gmlake]` for several (every rank allocates through the allocator under
test; rank 0 writes the record, the others write to --out.rankN).

DeepSpeed is imported from the environment (bench/deepspeed/README.md says how to install it on
a machine with no network). No DeepSpeed op is compiled: the optimizer is torch's AdamW (on the
GPU, or on the CPU with offload: `zero_force_ds_cpu_optimizer` off)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import models  # noqa: E402

NAME = "zero3"
DEFAULTS = {"steps": 6, "warmup": 2, "batch": 8, "cap_gib": 40.0, "search_steps": 2}
STRATEGIES = ("N", "R", "LR", "RO", "LRO")
# OPT configurations (facebook/opt-*'s shapes; weights are random).
OPT_SIZES = {
    "opt-125m": dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12),
    "opt-350m": dict(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16),
    "opt-1.3b": dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32),
    "opt-2.7b": dict(hidden_size=2560, num_hidden_layers=32, ffn_dim=10240, num_attention_heads=32),
    "opt-6.7b": dict(hidden_size=4096, num_hidden_layers=32, ffn_dim=16384, num_attention_heads=32),
}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--model", choices=sorted(OPT_SIZES), default="opt-1.3b")
    g.add_argument("--strategy", choices=STRATEGIES, default="LR")
    g.add_argument("--seq-min", type=int, default=128)
    g.add_argument("--seq-max", type=int, default=1024)
    g.add_argument("--lora-r", type=int, default=16)
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--host-delay-us", type=int, default=0,
                   help="spin the host this many microseconds before every decoder layer's "
                        "forward (and its recomputation): host time added at known points, to "
                        "see how much of it the step absorbs (against an allocator's own time)")
    g.add_argument("--init-on", choices=("gpu", "cpu"), default="gpu",
                   help="where the random weights are drawn (gpu: seconds; cpu: a minute for 1.3B, "
                        "torchrun gives each rank one CPU thread); the model goes to DeepSpeed on the host")


def build_model(cls, cfg, device, seed):
    """The model on the host with seeded random weights. With a device, the weights are drawn
    there (Philox, fast) and copied to the host; every allocation of that is freed and the
    cache emptied and the peaks reset before DeepSpeed starts, so no allocator keeps it."""
    import torch

    if device is None:
        return cls(cfg)
    with torch.device("meta"):
        model = cls(cfg)
    if any(True for _ in model.buffers()):
        return cls(cfg)  # buffers would have no values after to_empty: draw on the host
    model = model.to_empty(device=device)
    model.tie_weights()
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    std = getattr(cfg, "init_std", 0.02)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.normal_(0.0, std, generator=g)
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.zero_()
                if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()
            elif isinstance(m, torch.nn.LayerNorm):
                if m.weight is not None:
                    m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()
    model = model.to("cpu")
    model.tie_weights()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return model


def _init_dist():
    """A world of one when not launched by torchrun / deepspeed."""
    import random

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(random.Random(os.getpid()).randint(20000, 40000)))
    for k in ("NCCL_NVLS_ENABLE",):
        os.environ.setdefault(k, "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    import deepspeed
    import torch

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    deepspeed.init_distributed(dist_backend="nccl")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local


class Zero3:
    def __init__(self, args, device):
        import time

        import deepspeed
        import torch
        from transformers import OPTConfig, OPTForCausalLM

        t0 = time.perf_counter()

        if args.tiny:
            args.model, args.seq_min, args.seq_max = "opt-125m", 32, 64
        self.args = args
        self.rank, self.world, local = _init_dist()
        self.device = f"cuda:{local}"
        if self.rank != 0 and args.out:
            args.out = f"{args.out}.rank{self.rank}"
        if self.rank != 0 and getattr(args, "record_trace", ""):
            args.record_trace = args.record_trace.replace(".pickle", f".rank{self.rank}.pickle")
        s = args.strategy
        lora, recompute, offload = "L" in s, "R" in s, "O" in s
        kw = dict(vocab_size=50272, max_position_embeddings=2048, dropout=0.0,
                  attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                  word_embed_proj_dim=OPT_SIZES[args.model]["hidden_size"], **OPT_SIZES[args.model])
        cfg = models.config(OPTConfig, "eager", **kw)
        self.vocab = cfg.vocab_size
        zero = {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_param_persistence_threshold": 10000,
        }
        if offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": zero,
            "zero_force_ds_cpu_optimizer": False,
            "gradient_clipping": 1.0,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        # Deterministic: the same losses under every allocator (CUBLAS_WORKSPACE_CONFIG is set
        # by bench/deepspeed/run.sh before CUDA starts; eager attention, no dropout).
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(args.seed)
        # The model is built whole on the host in bf16 (as weights loaded from a checkpoint
        # would be) and DeepSpeed partitions it at initialize: peft wraps modules after
        # construction, and transformers' weight init indexes rows of the embedding, which a
        # model built under zero.Init has partitioned away.
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            self.init_on = args.init_on
            try:
                model = build_model(OPTForCausalLM, cfg, self.device if args.init_on == "gpu" else None, args.seed)
            except Exception as e:  # noqa: BLE001 - any failure there: draw on the host instead
                print(f"[zero3] drawing the weights on the GPU failed ({type(e).__name__}: {e}); "
                      "drawing them on the host", file=sys.stderr)
                self.init_on = "cpu"
                model = OPTForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
        if recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
                task_type="CAUSAL_LM"))
            if recompute:
                model.enable_input_require_grads()
        self.delay_calls = 0
        if args.host_delay_us > 0:
            delay = args.host_delay_us / 1e6

            def spin(_module, _inputs):
                self.delay_calls += 1
                end = time.perf_counter() + delay
                while time.perf_counter() < end:
                    pass

            for m in model.modules():
                if type(m).__name__ == "OPTDecoderLayer":
                    m.register_forward_pre_hook(spin)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr)
        t1 = time.perf_counter()
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        t2 = time.perf_counter()
        self.engine.train()
        self.losses = []
        total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        self._info = {"model": args.model, "strategy": s, "params": total,
                      "trainable_params": trainable, "world_size": self.world,
                      "deepspeed": deepspeed.__version__, "zero": zero,
                      "init_on": self.init_on, "build_s": round(t1 - t0, 1), "deepspeed_init_s": round(t2 - t1, 1)}

    def info(self):
        return dict(self._info, losses=self.losses, host_delay_us=self.args.host_delay_us,
                    host_delay_calls=self.delay_calls)

    def sample(self, rng, batch, final_max=False):
        seq = self.args.seq_max if final_max else rng.randint(self.args.seq_min, self.args.seq_max)
        return {"seq": seq, "seed": rng.randrange(1 << 30)}

    def work(self, batch, shape):
        return batch * shape["seq"] * self.world

    def step(self, batch, shape):
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(shape["seed"] + self.rank)
        ids = torch.randint(0, self.vocab, (batch, shape["seq"]), device=self.device, generator=g)
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()
        self.losses.append(round(float(loss.detach().float().item()), 6))

    def reset(self):
        pass

    def close(self):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def build(args, device):
    return Zero3(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
