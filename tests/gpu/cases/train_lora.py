"""A short LoRA fine-tuning loop with gradient checkpointing and varying sequence lengths,
for comparing allocators. Prints one GMLAKE_RESULT line (losses, median step time, peak
allocated / reserved bytes, utilization).

Run under the allocator chosen by the harness (GMLAKE_TEST_ALLOCATOR=native|expandable|gmlake).
No downloads: the model is built from a config with a fixed seed (transformers' Llama when
available, with peft's LoRA when available; otherwise a hand-written transformer and LoRA).
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, os.environ.get("GMLAKE_PYTHON_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "..", "python")))

import torch  # noqa: E402

ALLOCATOR = os.environ.get("GMLAKE_TEST_ALLOCATOR", "gmlake")
if ALLOCATOR == "gmlake":
    import gmlake

    gmlake.enable(os.environ.get("GMLAKE_TEST_CONF", ""))

STEPS = int(os.environ.get("GMLAKE_TRAIN_STEPS", "40"))
WARMUP = 5
SEED = 1234


def result(**kw):
    print("GMLAKE_RESULT " + json.dumps(kw), flush=True)


torch.manual_seed(SEED)
torch.cuda.manual_seed_all(SEED)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
device = torch.device("cuda")
dtype = torch.bfloat16

VOCAB, HIDDEN, LAYERS, HEADS, FFN, MAXLEN = 32000, 1024, 8, 16, 2816, 2048
impl = "hand-written"


class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, r=16, alpha=32):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(r, base.in_features, dtype=torch.float32) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, r, dtype=torch.float32))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + ((x.float() @ self.a.t()) @ self.b.t() * self.scale).to(x.dtype)


def build_model():
    global impl
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=MAXLEN,
            tie_word_embeddings=False, attn_implementation="eager",
        )
        model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
        model.config.use_cache = False
        try:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
            impl = "transformers-llama+peft"
        except Exception as e:  # peft missing or incompatible: hand-written LoRA
            print(f"peft unavailable ({e!r}); hand-written LoRA", file=sys.stderr)
            for p in model.parameters():
                p.requires_grad_(False)
            for layer in model.model.layers:
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name)).to(device))
            impl = "transformers-llama+handlora"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()

        def loss_fn(ids):
            return model(input_ids=ids, labels=ids).loss

        return model, loss_fn
    except ImportError:
        pass

    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(HIDDEN)
            self.qkv = LoRALinear(torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False))
            self.o = LoRALinear(torch.nn.Linear(HIDDEN, HIDDEN, bias=False))
            self.ln2 = torch.nn.LayerNorm(HIDDEN)
            self.up = torch.nn.Linear(HIDDEN, FFN, bias=False)
            self.down = torch.nn.Linear(FFN, HIDDEN, bias=False)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, HEADS, -1).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
            mask = torch.ones(T, T, device=x.device, dtype=torch.bool).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            x = x + self.o((att @ v).transpose(1, 2).reshape(B, T, HIDDEN))
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=False)
            return self.head(x)

    model = Model()
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith(".a") or n.endswith(".b"))
    model = model.to(device=device, dtype=dtype)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.a.data = m.a.data.float()
            m.b.data = m.b.data.float()

    def loss_fn(ids):
        logits = model(ids)
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))

    return model, loss_fn


model, loss_fn = build_model()
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-3)
gen = torch.Generator().manual_seed(SEED)
# Varying shapes: sequence lengths and batch sizes drawn per step (the allocator sees a new
# mix of sizes every step).
shapes = []
for _ in range(STEPS):
    seq = int(torch.randint(64, MAXLEN + 1, (1,), generator=gen))
    batch = max(1, 16384 // seq + int(torch.randint(-1, 2, (1,), generator=gen)))
    shapes.append((batch, seq))
batches = [torch.randint(0, VOCAB, s, generator=gen) for s in shapes]

losses, times = [], []
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
for step, ids in enumerate(batches):
    ids = ids.to(device)
    t0 = time.perf_counter()
    loss = loss_fn(ids)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())

stats = torch.cuda.memory_stats()
peak_alloc = stats["allocated_bytes.all.peak"]
peak_reserved = stats["reserved_bytes.all.peak"]
extra = {}
if ALLOCATOR == "gmlake":
    g = gmlake.stats()
    extra = {k: g[k] for k in ("gmlake.stitches", "gmlake.pages_stitched", "gmlake.driver_calls")}
    if any(g.get(k) for k in ("gmlake.debug_guarded", "gmlake.debug_pages")) or "debug" in os.environ.get("GMLAKE_TEST_CONF", ""):
        extra["debug_reports"] = len(gmlake.debug_report())
        g = gmlake.stats()
        extra.update({k: v for k, v in g.items() if k.startswith("gmlake.debug_")})
result(
    allocator=ALLOCATOR, impl=impl, losses=losses, shapes=shapes,
    median_step_s=statistics.median(times[WARMUP:]), mean_step_s=statistics.mean(times[WARMUP:]),
    peak_allocated=peak_alloc, peak_reserved=peak_reserved,
    utilization=peak_alloc / peak_reserved if peak_reserved else None,
    num_alloc_retries=stats.get("num_alloc_retries"), **extra,
)
