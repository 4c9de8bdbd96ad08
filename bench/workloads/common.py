"""Shared driver of the GPU workloads: allocator choice, timing, memory statistics, the
largest-batch search under a memory cap, and the JSON records.

A workload module defines ``NAME``, ``DEFAULTS`` (its defaults for the common flags),
``add_args(parser)`` and ``build(args, device)`` returning an object with:

- ``sample(rng, batch, final_max=False) -> dict``: the shapes of one step (drawn from
  ``rng``, a ``random.Random``; the same seed gives the same sequence for every allocator);
  ``final_max`` asks for the largest shapes the workload can draw.
- ``step(batch, shape)``: one training / inference step.
- ``reset()``: drops what a failed step may have left (gradients, caches).
- ``work(batch, shape) -> int`` (optional): tokens or images in the step.
- ``info() -> dict`` (optional): facts about the model (parameters, config).

Nothing here imports torch at module level, so ``--help`` works without torch or a GPU; the
allocator is set up (environment for expandable segments, ``gmlake.enable()``) before torch
initializes CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

ALLOCATORS = ("auto", "native", "expandable", "gmlake")
MiB = 1 << 20
GiB = 1 << 30


def base_parser(name: str, description: str, defaults: Dict[str, Any]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{name}.py",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("common")
    g.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                   help="auto: gmlake if already enabled (python -m gmlake), expandable if "
                        "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, else native")
    g.add_argument("--gmlake-conf", default="",
                   help="key:value,... passed to gmlake.enable() (with --allocator gmlake)")
    g.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the code")
    g.add_argument("--steps", type=int, default=defaults.get("steps", 10),
                   help="measured steps (after warm-up)")
    g.add_argument("--warmup", type=int, default=defaults.get("warmup", 3), help="warm-up steps")
    g.add_argument("--batch", type=int, default=defaults.get("batch", 4),
                   help="batch size of the measured run")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tiny", action="store_true", help="tiny model and shapes (smoke tests)")
    g.add_argument("--no-run", action="store_true", help="skip the measured run")
    g.add_argument("--search", action="store_true",
                   help="after the run, search the largest batch under --cap-gib")
    g.add_argument("--cap-gib", type=float, default=defaults.get("cap_gib", 8.0),
                   help="memory cap of the search, GiB (torch.cuda.set_per_process_memory_fraction)")
    g.add_argument("--search-start", type=int, default=defaults.get("search_start", 0),
                   help="first batch tried (0: --batch)")
    g.add_argument("--search-steps", type=int, default=defaults.get("search_steps", 3),
                   help="steps per trial (the last one at the largest shapes)")
    g.add_argument("--search-trials", type=int, default=defaults.get("search_trials", 10),
                   help="most trials")
    g.add_argument("--search-time", type=float, default=defaults.get("search_time", 60.0),
                   help="no new trial after this many seconds of search")
    g.add_argument("--search-resolution", type=float, default=0.0625,
                   help="stop bisecting when the bracket is at most this fraction of the "
                        "largest good batch (and at least 1)")
    g.add_argument("--fake-oom-above", type=int, default=0,
                   help="testing: raise OutOfMemoryError for batches above this (0: off)")
    g.add_argument("--out", default="", help="append the JSON records to this file too")
    g.add_argument("--record-trace", default="",
                   help="record the allocator's events (torch.cuda.memory._record_memory_history, "
                        "no stacks) from the model's build to the end of the measured run and "
                        "write them, in the layout of torch.cuda.memory._snapshot() with only "
                        "device_traces, to this pickle (.gz: gzip); gmlake replay reads it")
    g.add_argument("--profile-step", type=int, default=-1,
                   help="profile this measured step (0: the first) with torch.profiler (CPU and "
                        "CUDA activities): its chrome trace goes to OUT[.LABEL].stepN.trace.json.gz beside "
                        "--out, and the record's `profile` sums it up (per CUDA stream the time "
                        "busy with kernels, copies and memsets; the host's time in CUDA runtime "
                        "and driver calls by name; with gmlake and host_timing:1, its allocations "
                        "and frees of 50 us or more on a track of their own); the step is left "
                        "out of the timings")
    g.add_argument("--tag", default="", help="free text stored in the records")
    g.add_argument("--round", type=int, default=0,
                   help="which round of a benchmark call this run is (1, 2, ...; 0: no rounds): "
                        "bench/report.py pools each allocator's step ratios over the rounds")
    g.add_argument("--label", default="",
                   help="name recorded as the allocator (e.g. native2 for a second native run)")
    return p


# ---------------------------------------------------------------------------------------------
# Allocator


def _expandable_in_env() -> bool:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        v = os.environ.get(var, "")
        items = [i.strip().replace(" ", "") for i in v.split(",")]
        if any(i.lower() == "expandable_segments:true" for i in items):
            return True
    return False


def _gmlake_module():
    return sys.modules.get("gmlake")


def setup_allocator(requested: str, gmlake_conf: str, device: str) -> str:
    """Prepares the allocator before CUDA initializes; returns the allocator's name."""
    gm = _gmlake_module()
    already_gmlake = gm is not None and hasattr(gm, "is_enabled") and gm.is_enabled()
    name = requested
    if name == "auto":
        name = "gmlake" if already_gmlake else ("expandable" if _expandable_in_env() else "native")
    if name != "gmlake" and already_gmlake:
        raise SystemExit(f"--allocator {name}, but gmlake is already enabled (python -m gmlake)")
    if name == "native" and _expandable_in_env():
        raise SystemExit("--allocator native, but PYTORCH_CUDA_ALLOC_CONF asks for expandable segments")
    if name == "expandable" and not _expandable_in_env():
        cur = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = (cur + "," if cur else "") + "expandable_segments:True"
    if name == "gmlake" and _expandable_in_env():
        raise SystemExit("--allocator gmlake, but PYTORCH_CUDA_ALLOC_CONF asks for expandable segments")
    import torch  # noqa: F401  (after the environment is final)

    if name == "gmlake" and not already_gmlake and device.startswith("cuda"):
        import gmlake

        gmlake.enable(gmlake_conf or None)
    return name


def allocator_facts(name: str, device: str) -> Dict[str, Any]:
    """What the process really runs with (checked, not assumed)."""
    import torch

    out: Dict[str, Any] = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    if not device.startswith("cuda"):
        return out
    try:
        out["backend"] = torch.cuda.get_allocator_backend()
    except Exception as e:  # pragma: no cover - depends on torch
        out["backend"] = f"error: {e}"
    if name == "gmlake":
        gm = _gmlake_module()
        out["gmlake_enabled"] = bool(gm is not None and gm.is_enabled())
        try:
            out["gmlake_settings"] = gm.settings()
            out["gmlake_library"] = gm.library_path()
        except Exception as e:
            out["gmlake_settings"] = f"error: {e}"
    else:
        try:
            segs = torch.cuda.memory._snapshot().get("segments", [])
            out["segments"] = len(segs)
            out["expandable_segments_seen"] = any(s.get("is_expandable", False) for s in segs)
        except Exception as e:
            out["snapshot_error"] = str(e)
    return out


def env_facts(device: str) -> Dict[str, Any]:
    import torch

    out: Dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = p.name
        out["gpu_total_bytes"] = p.total_memory
    return out


# ---------------------------------------------------------------------------------------------
# Measurement helpers


def is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and (
        "out of memory" in msg.lower()
        or "CUBLAS_STATUS_ALLOC_FAILED" in msg
        or "CUDNN_STATUS_ALLOC_FAILED" in msg
        or "CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous" in msg
    )


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def memory_record(device: str) -> Dict[str, Any]:
    import torch

    if not device.startswith("cuda"):
        return {}
    s = torch.cuda.memory_stats()
    g = lambda k: int(s.get(k, 0))  # noqa: E731
    rec = {
        "peak_allocated_bytes": g("allocated_bytes.all.peak"),
        "peak_active_bytes": g("active_bytes.all.peak"),
        "peak_reserved_bytes": g("reserved_bytes.all.peak"),
        "peak_requested_bytes": g("requested_bytes.all.peak"),
        "end_allocated_bytes": g("allocated_bytes.all.current"),
        "end_reserved_bytes": g("reserved_bytes.all.current"),
        "num_alloc_retries": g("num_alloc_retries"),
        "num_ooms": g("num_ooms"),
        "num_device_alloc": g("num_device_alloc"),
        "num_device_free": g("num_device_free"),
        "max_memory_allocated": int(torch.cuda.max_memory_allocated()),
        "max_memory_reserved": int(torch.cuda.max_memory_reserved()),
    }
    pr = rec["peak_reserved_bytes"]
    rec["utilization"] = (rec["peak_active_bytes"] / pr) if pr else None
    try:
        free, total = torch.cuda.mem_get_info()
        rec["end_device_used_bytes"] = int(total - free)
    except Exception:
        pass
    gm = _gmlake_module()
    if gm is not None and gm.is_enabled():
        try:
            rec["gmlake"] = {k[len("gmlake."):]: v for k, v in gm.stats().items() if k.startswith("gmlake.")}
        except Exception as e:
            rec["gmlake"] = {"error": str(e)}
    return rec


def start_trace(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=4_000_000)


def write_trace(device: str, path: str) -> Dict[str, Any]:
    """Writes the recorded events (no frames, no segments) and stops recording."""
    import gzip
    import pickle

    import torch

    if not device.startswith("cuda"):
        return {}
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = [[{k: ev.get(k) for k in ("action", "addr", "size", "stream", "time_us")} | {"frames": []}
               for ev in dev] for dev in snap.get("device_traces", [])]
    data = {"device_traces": traces, "segments": []}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        pickle.dump(data, f, protocol=4)
    return {"trace_path": path, "trace_events": sum(len(t) for t in traces)}


def emit(rec: Dict[str, Any], out: str) -> None:
    line = json.dumps(rec, sort_keys=True)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def _fake_oom(args, batch: int) -> None:
    if args.fake_oom_above and batch > args.fake_oom_above:
        import torch

        raise torch.OutOfMemoryError(f"fake out of memory (batch {batch} > {args.fake_oom_above})")


def cleanup(wl, device: str) -> None:
    import torch

    try:
        wl.reset()
    except Exception as e:  # pragma: no cover
        print(f"[bench] reset failed: {e}", file=sys.stderr)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def driver_calls_by_kind() -> Optional[Dict[str, int]]:
    """gmlake's driver calls so far, by kind ("total" for all; None with another allocator):
    one stats read."""
    gm = _gmlake_module()
    if gm is None or not gm.is_enabled():
        return None
    try:
        st = gm.stats()
    except Exception:
        return None
    out = {k[len("gmlake.driver_calls."):]: int(v) for k, v in st.items()
           if k.startswith("gmlake.driver_calls.")}
    out["total"] = int(st.get("gmlake.driver_calls", 0))
    # With `host_timing` on: the allocator's own time so far (not a call kind; run_steps
    # takes it out).
    if "gmlake.host_ns_alloc" in st:
        out[HOST_NS] = int(st["gmlake.host_ns_alloc"]) + int(st.get("gmlake.host_ns_free", 0))
    # The host time of the driver calls so far (every call timed; not a call kind either).
    if "gmlake.driver_ns" in st:
        out[DRIVER_NS] = int(st["gmlake.driver_ns"])
    return out


# The key of driver_calls_by_kind's result that holds the allocator's time in ns.
HOST_NS = "host_ns"
# The key that holds the host time of its driver calls in ns, measured (`gmlake.driver_ns`).
DRIVER_NS = "driver_ns"
NOT_KINDS = (HOST_NS, DRIVER_NS)

# The kinds of driver calls that map memory (virtual memory management): what gmlake adds to
# a job. The others (events: record, query, create, stream waits, synchronizes) are what any
# allocator makes for streams, native's included (`record_stream`'s events, `process_events`).
VMM_KINDS = ("create_physical", "release_physical", "reserve_va", "free_va", "map", "unmap",
             "set_access")


def vmm_calls(kinds: Dict[str, int]) -> int:
    """The VMM calls among `kinds` (driver_calls_by_kind's result, or a difference of two)."""
    return sum(int(kinds.get(k, 0)) for k in VMM_KINDS)



def _merged_ms(intervals: List[tuple]) -> float:
    """Milliseconds covered by the union of (start, end) intervals in microseconds."""
    total, cur_s, cur_e = 0.0, None, None
    for st, en in sorted(intervals):
        if cur_e is None or st > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = st, en
        else:
            cur_e = max(cur_e, en)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3


def profile_summary(trace: Dict[str, Any], top: int = 10) -> Dict[str, Any]:
    """What a torch.profiler chrome trace of one step says about where its time went: per
    CUDA stream, the operations on the device (kernels, copies, memsets), the time they kept
    the stream busy (their union) and the span from the first start to the last end; and the
    host's time in CUDA runtime and driver calls, by name, largest first. A stream busy for
    much less than the step while the host waits points at device-side waits; kernels longer
    than another allocator's at the kernels (`device_ops`: device time by operation name,
    largest first; `device_ms`: all of it); host calls at the host."""
    streams: Dict[str, List[tuple]] = {}
    host: Dict[str, List[float]] = {}
    device: Dict[str, List[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat, ts, dur = e.get("cat", ""), float(e["ts"]), float(e.get("dur", 0))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            sid = str((e.get("args") or {}).get("stream", "?"))
            streams.setdefault(sid, []).append((ts, ts + dur))
            d = device.setdefault(e.get("name", "?"), [0.0, 0])
            d[0] += dur
            d[1] += 1
        elif cat in ("cuda_runtime", "cuda_driver"):
            h = host.setdefault(e.get("name", "?"), [0.0, 0])
            h[0] += dur
            h[1] += 1
    out_streams = {}
    for sid, iv in sorted(streams.items()):
        out_streams[sid] = {"ops": len(iv), "busy_ms": round(_merged_ms(iv), 3),
                            "span_ms": round((max(e for _, e in iv) - min(s for s, _ in iv)) / 1e3, 3)}
    def largest(d):
        return [[name, round(us / 1e3, 3), n]
                for name, (us, n) in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"streams": out_streams, "host_calls": largest(host), "device_ops": largest(device),
            "device_ms": round(sum(us for us, _ in device.values()) / 1e3, 3)}


def trace_path(out: str, label: str, n: int) -> str:
    """Where step `n`'s chrome trace goes: beside `out`, named by the run's label (several
    runs append to one results file), and numbered when that label ran before."""
    import re

    base = out + ("." + re.sub(r"[^A-Za-z0-9._-]+", "_", label) if label else "")
    path, k = f"{base}.step{n}.trace.json.gz", 1
    while os.path.exists(path):
        k += 1
        path = f"{base}-{k}.step{n}.trace.json.gz"
    return path


SLOW_CALLS_TID = 0x676D  # the track of gmlake's slow calls in a profiled step's trace


def records_slow_calls(snapshot: Dict[str, Any]) -> bool:
    """Whether gmlake keeps its slow calls (``host_timing:1`` in the snapshot's configuration):
    without it an empty list means nothing was recorded, not that nothing was slow."""
    return str((snapshot.get("config") or {}).get("host_timing", "0")) == "1"


def slow_calls_between(snapshot: Dict[str, Any], begin_ns: int, end_ns: int) -> List[dict]:
    """gmlake's slow calls (``host_timing``: allocations and frees of 50 µs or more, kept in
    ``gmlake.snapshot()["slow_calls"]``) that began within [begin_ns, end_ns] (Unix ns)."""
    return [c for c in snapshot.get("slow_calls", [])
            if begin_ns <= c.get("start_unix_ns", -1) <= end_ns]


def add_slow_calls(trace: Dict[str, Any], calls: List[dict], pid: int) -> int:
    """Puts gmlake's slow calls on a chrome trace's timeline, as one track of process `pid`
    (the profiler's ``ts`` is microseconds after ``baseTimeNanoseconds``, a Unix time). Returns
    how many were added: none when the trace has no base time."""
    base = trace.get("baseTimeNanoseconds")
    if base is None or not calls:
        return 0
    ev = trace.setdefault("traceEvents", [])
    ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": SLOW_CALLS_TID,
               "args": {"name": "gmlake: allocations and frees of 50 us or more"}})
    for c in calls:
        size = c.get("size", 0)
        name = f"gmlake {c.get('op', '?')}" + (f" {size / 2**20:.0f} MiB" if size else "")
        ev.append({"ph": "X", "cat": "gmlake", "name": name, "pid": pid, "tid": SLOW_CALLS_TID,
                   "ts": (c["start_unix_ns"] - base) / 1e3, "dur": c["ns"] / 1e3,
                   "args": {"bytes": size}})
    return len(calls)


def slow_calls_summary(calls: List[dict]) -> Dict[str, Any]:
    """Count, total and largest of gmlake's slow calls, in ms; where their time went (the
    allocator's lock waited for, driver calls: ``gmlake_core::calltime``; the rest is the
    core's own work); and the largest call with its own split and slowest driver call."""
    ms = [c["ns"] / 1e6 for c in calls]
    out = {"count": len(ms), "ms": round(sum(ms), 3), "largest_ms": round(max(ms, default=0), 3),
           "lock_wait_ms": round(sum(c.get("lock_wait_ns", 0) for c in calls) / 1e6, 3),
           "driver_ms": round(sum(c.get("driver_ns", 0) for c in calls) / 1e6, 3)}
    if calls:
        big = max(calls, key=lambda c: c["ns"])
        out["largest"] = {"op": big.get("op", "?"), "size": big.get("size", 0),
                          "ms": round(big["ns"] / 1e6, 3),
                          "lock_wait_ms": round(big.get("lock_wait_ns", 0) / 1e6, 3),
                          "driver_ms": round(big.get("driver_ns", 0) / 1e6, 3),
                          "driver_calls": big.get("driver_calls", 0),
                          "slowest_driver": big.get("slowest_driver", ""),
                          "slowest_driver_ms": round(big.get("slowest_driver_ns", 0) / 1e6, 3)}
    return out


def slow_calls_per_step(device: str, windows: List[Tuple[int, int]]) -> Optional[List[dict]]:
    """`slow_calls_summary` of each step in `windows` (its start and end, Unix ns), read from
    gmlake's snapshot once; None when gmlake does not keep its slow calls (not gmlake, or no
    ``host_timing:1``)."""
    try:
        import gmlake

        snap = gmlake.snapshot(device)
    except Exception:  # noqa: BLE001 - not gmlake, or no snapshot: nothing to split
        return None
    if not records_slow_calls(snap):
        return None
    return [slow_calls_summary(slow_calls_between(snap, b, e)) for b, e in windows]


def profiled_step(args, wl, batch: int, shape: dict, device: str, n: int,
                  write_trace: bool = True) -> Dict[str, Any]:
    """Runs step `n` under torch.profiler and sums it up (`profile_summary`); with
    `write_trace` and --out, writes its chrome trace beside --out."""
    import gzip
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(ProfilerActivity.CUDA)
    begin_ns = time.time_ns()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        wl.step(batch, shape)
        sync(device)
        wall = time.perf_counter() - t0
    end_ns = time.time_ns()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
    rec = {"step": n, "wall_ms": round(wall * 1e3, 3), "torch": torch.__version__}
    rec.update(profile_summary(trace))
    if getattr(args, "allocator", "") == "gmlake":
        # gmlake's driver calls are not in the profiler's trace (the driver is loaded at run
        # time): with host_timing, its slow calls go on a track of their own.
        import gmlake

        snap = gmlake.snapshot(device)
        if records_slow_calls(snap):
            calls = slow_calls_between(snap, begin_ns, end_ns)
            add_slow_calls(trace, calls, os.getpid())
            rec["gmlake_slow_calls"] = slow_calls_summary(calls)
    if write_trace and args.out:
        path = trace_path(args.out, getattr(args, "label", ""), n)
        with gzip.open(path, "wt") as f:
            json.dump(trace, f)
        rec["trace"] = path
    return rec


def run_steps(args, wl, batch: int, shapes: List[dict], device: str, timed_from: int,
              calls_out: Optional[List[int]] = None,
              kinds_out: Optional[Dict[str, int]] = None,
              host_ms_out: Optional[List[float]] = None,
              profile_out: Optional[Dict[str, Any]] = None,
              vmm_out: Optional[List[int]] = None,
              windows_out: Optional[List[Tuple[int, int]]] = None,
              driver_ms_out: Optional[List[float]] = None) -> List[float]:
    """Runs the steps; times the ones from `timed_from`. With `calls_out`, appends gmlake's
    driver calls made by each timed step (read between steps, outside the timing); with
    `kinds_out`, adds them up by kind over the timed steps; with `vmm_out`, appends the VMM
    calls among them (`VMM_KINDS`) step by step; with `host_ms_out`, appends the
    milliseconds each timed step spent in gmlake's allocations and frees (`host_timing`);
    with `windows_out`, each timed step's start and end (Unix ns), to find its slow calls;
    with `driver_ms_out`, the milliseconds each timed step's driver calls took (measured).
    With `profile_out` and `--profile-step N`, the N-th timed step runs under torch.profiler
    (`profiled_step`), is not timed, and its summary goes to `profile_out`."""
    times = []
    prof_at = getattr(args, "profile_step", -1)
    prof_at = timed_from + prof_at if prof_at >= 0 and profile_out is not None else -1
    for i, shape in enumerate(shapes):
        _fake_oom(args, batch)
        sync(device)
        if i == prof_at:
            profile_out.update(profiled_step(args, wl, batch, shape, device, i - timed_from))
            continue
        before = driver_calls_by_kind() if calls_out is not None and i >= timed_from else None
        begin_ns = time.time_ns()
        t0 = time.perf_counter()
        wl.step(batch, shape)
        sync(device)
        dt = time.perf_counter() - t0
        if i >= timed_from:
            times.append(dt)
            if windows_out is not None:
                windows_out.append((begin_ns, time.time_ns()))
            if before is not None:
                after = driver_calls_by_kind()
                if after is not None:
                    calls_out.append(after["total"] - before["total"])
                    if vmm_out is not None:
                        vmm_out.append(vmm_calls(after) - vmm_calls(before))
                    if host_ms_out is not None and HOST_NS in after:
                        host_ms_out.append((after[HOST_NS] - before.get(HOST_NS, 0)) / 1e6)
                    if driver_ms_out is not None and DRIVER_NS in after:
                        driver_ms_out.append((after[DRIVER_NS] - before.get(DRIVER_NS, 0)) / 1e6)
                    if kinds_out is not None:
                        for k, v in after.items():
                            if k not in NOT_KINDS:
                                kinds_out[k] = kinds_out.get(k, 0) + v - before.get(k, 0)
    return times


def measured_run(args, wl, base: Dict[str, Any]) -> Dict[str, Any]:
    rng = random.Random(args.seed)
    shapes = [wl.sample(rng, args.batch) for _ in range(args.warmup + args.steps)]
    rec = dict(base, kind="workload", batch=args.batch, steps=args.steps, warmup=args.warmup)
    t0 = time.perf_counter()
    try:
        calls: List[int] = []
        kinds: Dict[str, int] = {}
        host_ms: List[float] = []
        prof: Dict[str, Any] = {}
        vmm: List[int] = []
        windows: List[Tuple[int, int]] = []
        driver_ms: List[float] = []
        times = run_steps(args, wl, args.batch, shapes, args.device, args.warmup, calls, kinds,
                          host_ms, prof, vmm, windows, driver_ms)
        if prof:
            rec["profile"] = prof
        if host_ms:
            # `host_timing`: the allocator's own time in each step, and its median; and each
            # step's slow calls (50 µs or more), with where their time went: one ZeRO-3 step
            # had two ranks spend 628 ms in gmlake's calls, and only the split says why.
            rec["allocator_ms_per_step"] = [round(x, 3) for x in host_ms]
            rec["median_allocator_ms_per_step"] = statistics.median(host_ms)
            per_step = slow_calls_per_step(args.device, windows)
            if per_step is not None:
                rec["slow_calls_per_step"] = per_step
        if calls:
            rec["driver_calls_per_step"] = calls
            # Over all timed steps, by kind: what the replay's cost model (cost.rs) is
            # checked against (bench/cost_check.py).
            rec["driver_calls_by_kind"] = kinds
            rec["median_driver_calls_per_step"] = statistics.median(calls)
            rec["mean_driver_calls_per_step"] = statistics.fmean(calls)
        if driver_ms:
            # What those calls took, measured (not the replay's cost model): the part of each
            # step that is the driver's.
            rec["driver_ms_per_step"] = [round(x, 3) for x in driver_ms]
            rec["median_driver_ms_per_step"] = statistics.median(driver_ms)
            rec["mean_driver_ms_per_step"] = statistics.fmean(driver_ms)
        if vmm:
            # Of those, the calls that map memory (the rest are stream events, which native's
            # allocator makes too).
            rec["vmm_calls_per_step"] = vmm
            rec["median_vmm_calls_per_step"] = statistics.median(vmm)
        rec["ok"] = True
    except Exception as e:
        rec["ok"] = False
        rec["oom"] = is_oom(e)
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        print(traceback.format_exc(), file=sys.stderr)
        times = []
    rec["run_s"] = time.perf_counter() - t0
    rec["step_times_s"] = [round(t, 6) for t in times]
    if times:
        rec["median_step_s"] = statistics.median(times)
        rec["mean_step_s"] = statistics.fmean(times)
        rec["min_step_s"] = min(times)
        rec["max_step_s"] = max(times)
        if hasattr(wl, "work"):
            work = sum(wl.work(args.batch, s) for s in shapes[args.warmup:])
            rec["work_per_s"] = work / sum(times)
    rec.update(memory_record(args.device))
    rec["shapes"] = shapes
    return rec


def search_max_batch(args, wl, base: Dict[str, Any], log: Callable[[str], None]) -> Dict[str, Any]:
    """Largest batch whose trial (search_steps steps, the last at the largest shapes) runs
    without OOM under the cap: doubling from the start batch, then bisection."""
    import torch

    cuda = args.device.startswith("cuda")
    cap = int(args.cap_gib * GiB)
    rec = dict(base, kind="max_batch", cap_bytes=cap, search_steps=args.search_steps)
    cleanup(wl, args.device)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, cap / total)
        torch.cuda.set_per_process_memory_fraction(fraction)
        rec["fraction"] = fraction
        rec["gpu_total_bytes"] = total
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            try:
                rec["fraction_read_back"] = getter()
            except Exception as e:
                rec["fraction_read_back"] = f"error: {e}"
        # Is the cap enforced? A tensor larger than the cap must fail.
        probe = None
        try:
            probe = torch.empty(cap + 64 * MiB, dtype=torch.uint8, device=args.device)
            rec["cap_enforced"] = False
        except Exception as e:
            rec["cap_enforced"] = is_oom(e)
            if not is_oom(e):
                rec["cap_probe_error"] = str(e)[:300]
        del probe
        cleanup(wl, args.device)
        # And a tensor that fits under the cap (with 512 MiB to spare) must succeed: the cap is
        # not lower than asked.
        below = cap - int(torch.cuda.memory_reserved()) - 512 * MiB
        if below > 0:
            try:
                probe = torch.empty(below, dtype=torch.uint8, device=args.device)
                rec["cap_below_ok"] = True
            except Exception as e:
                rec["cap_below_ok"] = False
                rec["cap_below_error"] = str(e)[:300]
            probe = None
            cleanup(wl, args.device)
        rec["reserved_at_start_bytes"] = int(torch.cuda.memory_reserved())
        rec["allocated_at_start_bytes"] = int(torch.cuda.memory_allocated())

    trials: List[Dict[str, Any]] = []
    good, bad = 0, None  # largest batch known to fit, smallest known not to
    start = args.search_start or args.batch
    t_start = time.perf_counter()
    hard_error = None

    def next_batch() -> Optional[int]:
        if bad is None:
            return start if not trials else good * 2
        if good == 0:
            b = bad // 2
            return b if b >= 1 else None
        if bad - good <= max(1, int(good * args.search_resolution)):
            return None
        return (good + bad) // 2

    while len(trials) < args.search_trials:
        if time.perf_counter() - t_start > args.search_time:
            rec["stopped"] = "time"
            break
        b = next_batch()
        if b is None:
            rec["stopped"] = "bracketed"
            break
        rng = random.Random(args.seed + 1)
        shapes = [wl.sample(rng, b) for _ in range(max(0, args.search_steps - 1))]
        shapes.append(wl.sample(rng, b, final_max=True))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trial: Dict[str, Any] = {"batch": b}
        try:
            run_steps(args, wl, b, shapes, args.device, len(shapes))
            trial["ok"] = True
        except Exception as e:
            trial["ok"] = False
            trial["oom"] = is_oom(e)
            trial["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if not trial["oom"]:
                hard_error = trial["error"]
                print(traceback.format_exc(), file=sys.stderr)
        trial["s"] = round(time.perf_counter() - t0, 3)
        if cuda:
            m = memory_record(args.device)
            trial["peak_active_bytes"] = m["peak_active_bytes"]
            trial["peak_reserved_bytes"] = m["peak_reserved_bytes"]
            trial["num_ooms"] = m["num_ooms"]
        cleanup(wl, args.device)
        trials.append(trial)
        log(f"[bench] {base['workload']}/{base['allocator']} trial batch={b}: "
            f"{'ok' if trial['ok'] else ('OOM' if trial.get('oom') else 'ERROR')} ({trial['s']} s)")
        if trial["ok"]:
            good = max(good, b)
        else:
            bad = b if bad is None else min(bad, b)
        if hard_error is not None:
            rec["stopped"] = "error"
            break
    else:
        rec["stopped"] = "trials"
    rec["max_batch"] = good
    rec["first_failed_batch"] = bad
    rec["search_complete"] = rec.get("stopped") == "bracketed"
    rec["search_s"] = time.perf_counter() - t_start
    rec["trials"] = trials
    if hard_error:
        rec["error"] = hard_error
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return rec


def main(module, argv=None) -> int:
    """Runs a workload module (a module, or its globals() as a dict)."""
    if isinstance(module, dict):
        module = argparse.Namespace(**module)
    p = base_parser(module.NAME, " ".join(module.__doc__.split()), module.DEFAULTS)
    module.add_args(p)
    args = p.parse_args(argv)
    if args.round < 0:
        p.error(f"--round must be 0 (no rounds) or a round's number, not {args.round}")
    if args.tiny:
        args.steps = min(args.steps, 3)
        args.warmup = min(args.warmup, 1)
    t_proc = time.perf_counter()
    name = setup_allocator(args.allocator, args.gmlake_conf, args.device)
    if args.label:
        name = args.label
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("[bench] CUDA is not available (use --device cpu for a smoke test)", file=sys.stderr)
        return 2
    base: Dict[str, Any] = {
        "workload": module.NAME,
        "allocator": name,
        "device": args.device,
        "seed": args.seed,
        "tag": args.tag,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.round > 0:
        base["round"] = args.round
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if args.record_trace:
        start_trace(args.device)
    t0 = time.perf_counter()
    wl = module.build(args, args.device)
    build_s = time.perf_counter() - t0
    base["build_s"] = round(build_s, 3)
    rc = 0
    if not args.no_run:
        rec = measured_run(args, wl, base)
        rec["model"] = wl.info() if hasattr(wl, "info") else {}
        rec["config"] = {k: v for k, v in vars(args).items() if k not in ("out",)}
        rec.update(env_facts(args.device))
        rec.update(allocator_facts(name, args.device))
        if args.record_trace:
            rec.update(write_trace(args.device, args.record_trace))
        rec["process_s"] = time.perf_counter() - t_proc
        emit(rec, args.out)
        if not rec["ok"]:
            rc = 1
    if args.search:
        rec = search_max_batch(args, wl, base, lambda s: print(s, file=sys.stderr, flush=True))
        rec.update(env_facts(args.device))
        rec["backend"] = allocator_facts(name, args.device).get("backend")
        rec["process_s"] = time.perf_counter() - t_proc
        emit(rec, args.out)
        if rec.get("error"):
            rc = 1
    if hasattr(wl, "close"):
        wl.close()
    return rc
