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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--rows", type=int, default=16384, help="tokens per batch (default 16384)")
    ap.add_argument("--search", type=int, nargs="+", default=[4096, 8192, 16384, 24576, 32768])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cap-gib", type=float, default=4.0, help="memory cap (default 4 GiB)")
    ap.add_argument("--budget-gib", type=float, default=1.5, help="tier device budget")
    ap.add_argument("--host-cache-gib", type=float, default=8.0, help="tier pinned buffers kept")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if args.child:
        print("TIER_BENCH " + json.dumps(child(args)), flush=True)
        return 0

    rows = []
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    passthrough = ["--rows", str(args.rows), "--width", str(args.width), "--depth", str(args.depth),
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
