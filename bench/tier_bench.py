#!/usr/bin/env python3
"""The host tier (issue 16) against the alternatives on a training job whose activations do
not fit under a memory cap (torch.cuda.set_per_process_memory_fraction).

Variants, each in its own process:
  native_nocap     PyTorch's allocator, no cap (the reference losses)
  native           PyTorch's allocator under the cap
  expandable       expandable_segments:True under the cap
  gmlake           gmlake alone under the cap
  tier_lru         gmlake + gmlake.tier.offload_activations, LRU policy
  tier_aware       gmlake + gmlake.tier.offload_activations, size/latency-aware policy
  save_on_cpu      PyTorch's allocator + torch.autograd.graph.save_on_cpu(pin_memory=True)

For each: at the fixed batch (--rows), ok or OOM, losses, median step time, bytes moved
between host and device per step (tier: its counters; save_on_cpu: the bytes its hooks
packed, both ways), peak reserved; then the largest batch of --search that runs a step.

    python3 bench/tier_bench.py [--rows 16384] [--cap-gib 4] [--budget-gib 1.5] [--out DIR]

Two jobs (--job):
  mlp     (default) an nn.Sequential MLP trained with autograd; the tier variants put the saved
          activations in the tier (offload_activations). Activations are needed again in the
          reverse order of their making, so least recently used is also needed last: LRU is
          Belady's choice here and the policies can only tie.
  params  the parameters live in the tier too, as when a model's weights are offloaded
          (ZeRO-Infinity, FSDP CPU offload): a ReLU MLP with a hand-written backward; each
          weight is got for its forward and its backward and put after each with the tick of
          its next use, each layer input is put after the forward with the tick of its
          backward. Weights updated at the end of backward are needed first in the next
          forward, while LRU evicts them first: the case the aware policy is for. Its
          save_on_cpu variant is the plain host offload of this job: every weight and layer
          input copied to pinned host memory after its use and back before the next (weights
          updated in place on the device, copied out after the update).

Writes one JSON line per variant to $OUT/tier_bench.jsonl (or --out) and prints a table.
Needs a CUDA GPU and libgmlake_torch.so (gmlake.library_path()). About 4-5 minutes on an
H100.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ["native_nocap", "native", "expandable", "gmlake", "tier_lru", "tier_aware", "save_on_cpu"]
GIB = 1 << 30


def child(args) -> dict:
    if args.job == "params":
        return child_params(args)
    sys.path.insert(0, str(REPO / "python"))
    import torch

    v = args.child
    gm = v.startswith("gmlake") or v.startswith("tier")
    if gm:
        import gmlake

        gmlake.enable()
        import gmlake.tier as tier
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(args.cap_gib * GIB)
    if v != "native_nocap":
        torch.cuda.set_per_process_memory_fraction(cap / total)
    if v.startswith("tier"):
        tier.configure(
            budget_bytes=int(args.budget_gib * GIB),
            policy=v.split("_", 1)[1],
            host_cache_bytes=int(args.host_cache_gib * GIB),
        )
    torch.manual_seed(0)
    width, depth = args.width, args.depth
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).cuda().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    moved = [0]

    def ctx():
        if v.startswith("tier"):
            return tier.offload_activations(min_bytes=1 << 20)
        if v == "save_on_cpu":
            inner = torch.autograd.graph.save_on_cpu(pin_memory=True)
            pack0, unpack0 = inner.pack_hook, inner.unpack_hook

            def pack(t):
                moved[0] += 2 * t.numel() * t.element_size()  # out now, back in backward
                return pack0(t)

            inner.pack_hook = pack
            return inner
        import contextlib

        return contextlib.nullcontext()

    def tier_bytes():
        if not v.startswith("tier"):
            return 0
        s = tier.stats()
        return s["bytes_to_host"] + s["bytes_to_device"]

    def step(rows, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(rows, width, device="cuda", generator=g, dtype=torch.bfloat16)
        y = torch.randn(rows, 1, device="cuda", generator=g, dtype=torch.bfloat16)
        with ctx():
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    out = {"variant": v, "cap": cap if v != "native_nocap" else None, "rows": args.rows,
           "width": width, "depth": depth, "device": torch.cuda.get_device_name(0)}
    if v.startswith("tier"):
        out["budget"] = int(args.budget_gib * GIB)
    losses, times, moved_steps = [], [], []
    try:
        for i in range(args.steps):
            torch.cuda.synchronize()
            m0, t0b = moved[0], tier_bytes()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            losses.append(step(args.rows, 100 + i))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            moved_steps.append(moved[0] - m0 + tier_bytes() - t0b)
        out.update(ok=True, losses=losses, step_s=statistics.median(times[1:]),
                   bytes_moved_per_step=int(statistics.median(moved_steps[1:])),
                   peak_reserved=torch.cuda.max_memory_reserved())
    except torch.cuda.OutOfMemoryError as e:
        out.update(ok=False, error="OOM", message=str(e)[:300], losses=losses)
    if v.startswith("tier"):
        out["tier"] = tier.stats()
    # Largest batch that runs one step (ascending; stops at the first failure).
    largest = 0
    for rows in args.search:
        try:
            torch.cuda.empty_cache()
            step(rows, 7)
            torch.cuda.synchronize()
            largest = rows
        except torch.cuda.OutOfMemoryError:
            break
    out["largest_rows"] = largest
    return out


def child_params(args) -> dict:
    """The params job (module docstring): one variant in this process."""
    sys.path.insert(0, str(REPO / "python"))
    import torch

    v = args.child
    if v.startswith("gmlake") or v.startswith("tier"):
        import gmlake

        gmlake.enable()
        import gmlake.tier as tier
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(args.cap_gib * GIB)
    if v != "native_nocap":
        torch.cuda.set_per_process_memory_fraction(cap / total)
    use_tier = v.startswith("tier")
    host = v == "save_on_cpu"
    if use_tier:
        tier.configure(budget_bytes=int(args.budget_gib * GIB), policy=v.split("_", 1)[1],
                       host_cache_bytes=int(args.host_cache_gib * GIB))
    d, depth, bf = args.width, args.depth, torch.bfloat16
    lr = 1e-3
    period = 2 * depth + 4  # ticks per step: forward i at 1 + i, backward i at depth + 2 + (depth - 1 - i)

    def fwd_tick(step, i):
        return step * period + 1 + i

    def bwd_tick(step, i):
        return step * period + depth + 2 + (depth - 1 - i)

    # Weights: made on the host from a seed (the same values in every variant), then placed.
    gen = torch.Generator().manual_seed(0)
    w_host = [(torch.randn(d, d, generator=gen) / d ** 0.5).to(bf) for _ in range(depth)]
    w_out = (torch.randn(d, 1, generator=gen) / d ** 0.5).cuda()
    moved = [0]
    if use_tier:
        hw = []
        for i, w in enumerate(w_host):
            t = w.cuda()
            hw.append(tier.put(t, next_use=fwd_tick(0, i)))
            del t
    elif host:
        hw = [w.pin_memory() for w in w_host]
    else:
        hw = [w.cuda() for w in w_host]
    del w_host

    def reput(t, old, next_use):
        h = tier.put(t, next_use=next_use)
        tier.free(old)
        return h

    def weight(i):
        if use_tier:
            return tier.get(hw[i])
        if host:
            moved[0] += hw[i].numel() * 2
            return hw[i].cuda(non_blocking=True)
        return hw[i]

    def done_with_weight(i, w, next_use, updated):
        if use_tier:
            hw[i] = reput(w, hw[i], next_use)
        elif host and updated:
            moved[0] += w.numel() * 2
            hw[i].copy_(w, non_blocking=True)

    def save(t, i, step):
        if use_tier:
            return tier.put(t, next_use=bwd_tick(step, i))
        if host:
            moved[0] += t.numel() * 2
            c = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            c.copy_(t, non_blocking=True)
            return c
        return t

    def load(saved):
        if use_tier:
            t = tier.get(saved)
            tier.free(saved)
            return t
        if host:
            moved[0] += saved.numel() * 2
            return saved.cuda(non_blocking=True)
        return saved

    def step_fn(rows, step, seed):
        nonlocal w_out
        g = torch.Generator(device="cuda").manual_seed(seed)
        h = torch.randn(rows, d, device="cuda", generator=g, dtype=bf)
        y = torch.randn(rows, 1, device="cuda", generator=g)
        saved = []
        for i in range(depth):
            if use_tier:
                tier.advance(fwd_tick(step, i))
            w = weight(i)
            z = h @ w
            done_with_weight(i, w, bwd_tick(step, i), False)
            del w
            saved.append(save(h, i, step))
            del h
            h = torch.relu(z)
            del z
        out = h.float() @ w_out
        loss = ((out - y) ** 2).mean()
        dout = 2 * (out - y) / out.numel()
        dh = (dout @ w_out.T).to(bf)
        w_out = w_out - lr * (h.float().T @ dout)
        a_next = h
        del h, out, dout
        for i in reversed(range(depth)):
            if use_tier:
                tier.advance(bwd_tick(step, i))
            dz = dh * (a_next > 0)
            del dh, a_next
            hi = load(saved[i])
            w = weight(i)
            dh = dz @ w.T
            w.sub_(lr * (hi.T @ dz))
            done_with_weight(i, w, fwd_tick(step + 1, i), True)
            del w, dz
            a_next = hi
            del hi
        del dh, a_next
        return loss.item()

    def tier_bytes():
        if not use_tier:
            return 0
        s = tier.stats()
        return s["bytes_to_host"] + s["bytes_to_device"]

    out = {"job": "params", "variant": v, "cap": cap if v != "native_nocap" else None, "rows": args.rows,
           "width": d, "depth": depth, "device": torch.cuda.get_device_name(0),
           "weights_bytes": depth * d * d * 2, "activation_bytes": (depth + 1) * args.rows * d * 2}
    if use_tier:
        out["budget"] = int(args.budget_gib * GIB)
    losses, times, moved_steps = [], [], []
    step = 0
    try:
        for i in range(args.steps):
            torch.cuda.synchronize()
            m0, t0b = moved[0], tier_bytes()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            losses.append(step_fn(args.rows, step, 100 + i))
            step += 1
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            moved_steps.append(moved[0] - m0 + tier_bytes() - t0b)
        out.update(ok=True, losses=losses, step_s=statistics.median(times[1:]),
                   bytes_moved_per_step=int(statistics.median(moved_steps[1:])),
                   peak_reserved=torch.cuda.max_memory_reserved())
    except torch.cuda.OutOfMemoryError as e:
        out.update(ok=False, error="OOM", message=str(e)[:300], losses=losses)
    if use_tier:
        out["tier"] = tier.stats()
    # Largest batch that runs one step (ascending; stops at the first failure).
    largest = 0
    for rows in args.search:
        try:
            torch.cuda.empty_cache()
            step_fn(rows, step, 7)
            step += 1
            torch.cuda.synchronize()
            largest = rows
        except torch.cuda.OutOfMemoryError:
            break
    out["largest_rows"] = largest
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--job", choices=["mlp", "params"], default="mlp",
                    help="mlp: activations in the tier; params: weights and activations (see above)")
    ap.add_argument("--rows", type=int, help="tokens per batch (mlp 16384, params 8192)")
    ap.add_argument("--search", type=int, nargs="+",
                    help="batches tried for the largest (mlp 4096-32768, params 1024-32768)")
    ap.add_argument("--width", type=int, help="mlp 4096, params 8192")
    ap.add_argument("--depth", type=int, help="mlp 16, params 12")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cap-gib", type=float, help="memory cap (mlp 4 GiB, params 2.5 GiB)")
    ap.add_argument("--budget-gib", type=float, default=1.5, help="tier device budget (1.5 GiB)")
    ap.add_argument("--host-cache-gib", type=float, default=8.0, help="tier pinned buffers kept")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    for key, mlp, params in (("rows", 16384, 8192), ("width", 4096, 8192), ("depth", 16, 12),
                             ("cap_gib", 4.0, 2.5),
                             ("search", [4096, 8192, 16384, 24576, 32768], [1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768])):
        if getattr(args, key) is None:
            setattr(args, key, params if args.job == "params" else mlp)
    if args.child:
        print("TIER_BENCH " + json.dumps(child(args)), flush=True)
        return 0

    rows = []
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    passthrough = ["--job", args.job, "--rows", str(args.rows), "--width", str(args.width), "--depth", str(args.depth),
                   "--steps", str(args.steps), "--cap-gib", str(args.cap_gib),
                   "--budget-gib", str(args.budget_gib), "--host-cache-gib", str(args.host_cache_gib),
                   "--search", *map(str, args.search)]
    for v in args.variants:
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)
        if v == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", v, *passthrough], env=env,
                               capture_output=True, text=True, timeout=args.timeout)
            lines = [l for l in p.stdout.splitlines() if l.startswith("TIER_BENCH ")]
            r = json.loads(lines[-1][len("TIER_BENCH "):]) if lines else {
                "variant": v, "ok": False, "error": f"exit {p.returncode}", "stderr": p.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            r = {"variant": v, "ok": False, "error": f"timeout {args.timeout}s"}
        r["wall_s"] = round(time.time() - t0, 1)
        rows.append(r)
        print(json.dumps(r)[:400], flush=True)
        if out_dir:
            with open(out_dir / "tier_bench.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
    ref = next((r for r in rows if r["variant"] == "native_nocap" and r.get("ok")), None)
    print(f"\n{'variant':>13} {'cap GiB':>7} {'fixed':>5} {'step ms':>8} {'moved GiB/step':>14} "
          f"{'peak res GiB':>12} {'largest rows':>12} {'losses = ref':>12}")
    for r in rows:
        same = ""
        if ref and r.get("ok") and r.get("losses"):
            same = str(all(abs(a - b) <= 1e-3 * max(1, abs(a)) for a, b in zip(ref["losses"], r["losses"])))
        cap = r.get("cap")
        print(f"{r['variant']:>13} {(cap / GIB if cap else 0):>7.1f} {('ok' if r.get('ok') else r.get('error', '?')):>5} "
              f"{r.get('step_s', float('nan')) * 1000:>8.1f} {r.get('bytes_moved_per_step', 0) / GIB:>14.2f} "
              f"{r.get('peak_reserved', 0) / GIB:>12.2f} {r.get('largest_rows', 0):>12} {same:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
