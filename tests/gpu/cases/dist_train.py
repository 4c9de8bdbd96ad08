"""DDP or FSDP2 training of a small transformer on 2+ GPUs (one process a GPU, torchrun),
with activation checkpointing and a sequence length drawn per step, for comparing
allocators rank by rank. Every rank writes <out>/<mode>-<allocator>-rank<r>.json: the loss of
every step, the median step time, peak allocated / reserved bytes and their ratio.

    torchrun --nproc-per-node 2 [-m gmlake] dist_train.py ddp|fsdp <out dir>

With GMLAKE_DIST_TRACE set, every rank records its allocator's events from the model's build to
the end (bench/workloads/common.py's recorder: no stacks) and writes them to
<out>/<mode>-<allocator>-rank<r>.pickle.gz, for `gmlake replay` and bench/gpu_check.py.

The allocator is whatever the process has: gmlake when started through `-m gmlake`.
Deterministic: fixed seeds, deterministic algorithms, no TF32, attention through SDPA's math
backend (cuDNN's and flash attention's backward passes are not deterministic); data drawn from
(seed, step, rank) only. Two runs with the same allocator give the same losses, so a run
under another allocator must too.
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
STEPS = int(os.environ.get("GMLAKE_DIST_STEPS", "200"))
RUN = os.environ.get("GMLAKE_DIST_RUN", "")  # tells repeated runs of one allocator apart
TRACE = bool(os.environ.get("GMLAKE_DIST_TRACE"))
WARMUP = 10
VOCAB, HIDDEN, LAYERS, HEADS, FFN = 16384, 768, 6, 12, 3072
BATCH, MIN_LEN, MAX_LEN = 8, 128, 1024

rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
os.makedirs(OUT, exist_ok=True)
torch.cuda.set_device(local)
device = torch.device("cuda", local)
dist.init_process_group("nccl", device_id=device)
torch.manual_seed(1234)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, FFN)
        self.down = torch.nn.Linear(FFN, HIDDEN)

    def _forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, HEADS, HIDDEN // HEADS).unbind(2)
        with sdpa_kernel(SDPBackend.MATH):
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, HIDDEN))
        return x + self.down(F.gelu(self.up(self.ln2(x))))

    def forward(self, x):
        return checkpoint(self._forward, x, use_reentrant=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


if TRACE:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                    "bench", "workloads"))
    from common import start_trace, write_trace

    start_trace(f"cuda:{local}")
model = Model().to(device)
if MODE == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
elif MODE == "fsdp":
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
else:
    raise SystemExit(f"unknown mode {MODE!r}")
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)


def gmlake_stats():
    """gmlake's counters (driver calls by kind, stitches, stream waits...), {} under native."""
    try:
        import gmlake

        if gmlake.is_enabled():
            return {k: v for k, v in gmlake.stats(device).items()
                    if (k.startswith("gmlake.") or k in ("num_alloc_retries", "num_ooms"))
                    and isinstance(v, (int, float))}
    except ImportError:
        pass
    return {}


losses, times, reserved = [], [], []
at_warmup = {}
for step in range(STEPS):
    if step == WARMUP:
        at_warmup = gmlake_stats()
    g = torch.Generator().manual_seed(100_000 * step + rank)
    n = int(torch.randint(MIN_LEN, MAX_LEN + 1, (1,), generator=g))
    tokens = torch.randint(0, VOCAB, (BATCH, n + 1), generator=g).to(device, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=(MODE == "ddp")):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    losses.append(float(loss.detach()))
    # Where the peak is reached (warm-up or later) tells a start-up cost from a steady-state one.
    reserved.append(torch.cuda.max_memory_reserved(device))

dist.barrier()
traced = {}
if TRACE:
    traced = write_trace(f"cuda:{local}", os.path.join(
        OUT, f"{MODE}-{torch.cuda.get_allocator_backend()}{RUN}-rank{rank}.pickle.gz"))
peak_alloc = torch.cuda.max_memory_allocated(device)
peak_res = torch.cuda.max_memory_reserved(device)
backend = torch.cuda.get_allocator_backend()
extra = gmlake_stats()
if extra and at_warmup and STEPS > WARMUP:
    # Counters of the steps after warm-up, per step: the steady state's driver work, and with
    # host_timing:1 the allocator's own time (gmlake.host_ns_alloc / host_ns_free).
    extra["after_warmup_per_step"] = {
        k: (extra[k] - at_warmup.get(k, 0)) / (STEPS - WARMUP) for k in extra
        if k.startswith(("gmlake.driver_calls", "gmlake.host_"))
        or k in ("gmlake.stitches", "gmlake.pages_stitched")}
res = dict(
    mode=MODE, rank=rank, world=world, allocator=backend, steps=STEPS, losses=losses,
    median_step_ms=1000 * statistics.median(times[WARMUP:]), peak_allocated=peak_alloc,
    peak_reserved=peak_res, utilization=peak_alloc / peak_res if peak_res else 0.0,
    nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
    gmlake_conf=os.environ.get("GMLAKE_CONF", "") if extra else "", **extra, **traced,
    peak_reserved_by_step=reserved,
)
with open(os.path.join(OUT, f"{MODE}-{backend}{RUN}-rank{rank}.json"), "w") as f:
    json.dump(res, f)
print(f"rank {rank} {MODE} {backend}: loss {losses[-1]:.4f} step {res['median_step_ms']:.1f} ms "
      f"util {res['utilization']:.3f}", flush=True)
dist.destroy_process_group()
