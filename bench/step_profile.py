"""Where a workload's step time goes: per step, the wall time, the GPU's kernel time (CUPTI,
through torch.profiler) and the allocations made, under one allocator (with gmlake and
`--gmlake-conf host_timing:1`, also gmlake's own time in allocations and frees a timed step,
`median_allocator_ms`). Kernel time equal
across allocators means the GPU does the same work; a wall time several times the kernel time
means the step is host-bound, and then the allocator's share is its time per operation
(bench/latency.cpp --ops) times the operations a step, not the difference of step times.

    PYTHONPATH=python python3 bench/step_profile.py WORKLOAD --allocator A [workload options]

WORKLOAD is a module of bench/workloads (moe, concat_cache, ...). The measured steps alternate:
one timed by the wall clock, the next profiled (the profiler slows it; `common.profiled_step`,
whose device time, kernels, copies and memsets, is the kernel time here). Prints one JSON line.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads"))


def main(argv) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    import common

    try:
        mod = importlib.import_module(argv[0])
    except ImportError as e:
        print(f"step_profile: no workload {argv[0]!r} in bench/workloads ({e})", file=sys.stderr)
        return 2
    p = common.base_parser(mod.NAME, mod.__doc__ or mod.NAME, mod.DEFAULTS)
    mod.add_args(p)
    args = p.parse_args(argv[1:])
    name = common.setup_allocator(args.allocator, args.gmlake_conf, args.device)
    import torch

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    wl = mod.build(args, args.device)
    rng = random.Random(args.seed)
    shapes = [wl.sample(rng, args.batch) for _ in range(args.warmup + args.steps)]

    def allocations() -> int:
        return torch.cuda.memory_stats().get("allocation.all.allocated", 0)

    def allocator_ns() -> int | None:
        # gmlake's own time in allocations and frees so far, with `--gmlake-conf host_timing:1`.
        calls = common.driver_calls_by_kind()
        return None if calls is None else calls.get(common.HOST_NS)

    walls, allocs, kernel, alloc_ms = [], [], [], []
    for i, shape in enumerate(shapes):
        torch.cuda.synchronize()
        measured = i >= args.warmup
        if measured and (i - args.warmup) % 2 == 1:
            p = common.profiled_step(args, wl, args.batch, shape, args.device, i - args.warmup,
                                     write_trace=False)
            kernel.append(p["device_ms"])
            continue
        a0, n0 = allocations(), allocator_ns()
        t0 = time.perf_counter()
        wl.step(args.batch, shape)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if measured:
            walls.append(dt * 1e3)
            allocs.append(allocations() - a0)
            n1 = allocator_ns()
            if n0 is not None and n1 is not None:
                alloc_ms.append((n1 - n0) / 1e6)
    st = torch.cuda.memory_stats()
    rec = {
        "workload": mod.NAME, "allocator": name, "conf": args.gmlake_conf,
        "median_wall_ms": statistics.median(walls) if walls else None,
        "wall_ms": [round(w, 1) for w in walls],
        "median_kernel_ms": statistics.median(kernel) if kernel else None,
        "median_allocations": statistics.median(allocs) if allocs else None,
        "median_allocator_ms": statistics.median(alloc_ms) if alloc_ms else None,
        "utilization": st.get("active_bytes.all.peak", 0) / max(1, st.get("reserved_bytes.all.peak", 0)),
    }
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
