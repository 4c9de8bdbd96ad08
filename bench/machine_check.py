#!/usr/bin/env python3
"""How fast this machine is right now, to compare calls made on different machines (or on one
machine that slowed down): the host's single-thread speed (a pure-Python loop, what a
host-bound training step spends its time in) and, where a GPU is visible, each GPU's bf16
matrix-product rate. One JSON line on stdout, also appended to --out.

Why: the steps of DeepSpeed ZeRO-3 on four H200s were 2.5x longer in one call than in the
call before it on the same warm machine (docs/benchmarks.md, sixteenth session), and nothing
recorded said whether the host or the GPUs had slowed. Runs compare only within a call; this
line says whether two calls may be compared at all.

    python3 bench/machine_check.py [--out FILE]
"""

import argparse
import json
import os
import time


def host_loop_ms(n: int = 2_000_000, repeats: int = 3) -> float:
    """The fastest of `repeats` timings of a Python loop of n additions, in ms."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        s = 0
        for i in range(n):
            s += i
        best = min(best, (time.perf_counter() - t) * 1e3)
    return round(best, 2)


def gpu_tflops(dim: int = 8192, iters: int = 20) -> list:
    """bf16 dim^3 products per second on each visible GPU, in TFLOP/s (empty without CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for d in range(torch.cuda.device_count()):
        with torch.cuda.device(d):
            a = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                a @ b
            torch.cuda.synchronize()
            s = time.perf_counter() - t
            out.append(round(2 * dim**3 * iters / s / 1e12, 1))
            del a, b
            torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="append the JSON line to this file too")
    a = p.parse_args()
    rec = {
        "kind": "machine_check",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host_loop_ms": host_loop_ms(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "gpu_bf16_tflops": gpu_tflops(),
    }
    line = json.dumps(rec)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
