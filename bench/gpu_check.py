#!/usr/bin/env python3
"""Does the replay predict the GPU? (issue 13)

For each workload, a native allocator trace recorded on the GPU (`--record-trace`) and the GPU
figures of the same job run under native, gmlake (and expandable segments), this replays the
trace through `gmlake replay --json` and sets its prediction against the GPU: peak reserved
and utilization under gmlake, native's peak reserved (the trace's own figure), and gmlake's
driver calls. It exits 1 when gmlake's predicted peak reserved is off by more than the
tolerance (2%: issue 13's bar) for any workload, 2 on bad input.

    python3 bench/gpu_check.py tests/traces/fsdp-offload.pickle.gz tests/traces/zero3-lr-rank0.pickle.gz
    python3 bench/gpu_check.py $OUT/fsdp-native.pickle.gz=$OUT/fsdp.jsonl     # straight from a run

Each argument is TRACE[=GPU]. GPU is a `.gpu.json` (tests/traces' format: {"runs": {allocator:
record}}) or a results `.jsonl` written by bench/workloads (one record per run, by "allocator";
the last run of each allocator counts, and a `gmlake+host_timing:1` run stands for gmlake's
where there is none; `runs.jsonl#TAG` keeps the records of that tag, e.g.
`$OUT/zero3/results.jsonl#zero3-LR` for one strategy of bench/deepspeed/run.sh); without it,
TRACE's name with `.gpu.json` in place of `.pickle[.gz]` is used. `--set key=value` passes allocator settings to the replay (the GPU run
must have used the same).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import report  # noqa: E402  (the bench's loader and number formats)


class BadInput(Exception):
    pass


def default_gpu_path(trace: Path) -> Path:
    name = trace.name
    for ext in (".pickle.gz", ".pickle"):
        if name.endswith(ext):
            return trace.with_name(name[: -len(ext)] + ".gpu.json")
    raise BadInput(f"{trace}: not a .pickle or .pickle.gz trace; name its GPU figures as TRACE=GPU")


def load_gpu(path: Path, tag: str = "") -> Dict[str, dict]:
    """GPU records by allocator (of `tag` only, when given)."""
    if not path.is_file():
        raise BadInput(f"{path}: cannot read the GPU figures (no such file)")
    if path.suffix == ".jsonl":
        runs = {r.get("label") or r["allocator"]: r for r in report.load([str(path)])
                if r.get("kind", "workload") == "workload" and r.get("ok", True) and "allocator" in r
                and (not tag or r.get("tag") == tag)}
        if tag and not runs:
            raise BadInput(f"{path}: no successful run tagged {tag!r}")
        return runs
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(d, dict) or not isinstance(d.get("runs"), dict):
        raise BadInput(f"{path}: no \"runs\" object (allocator -> GPU figures)")
    return d["runs"]


def find_gmlake(given: Optional[str]) -> str:
    if given:
        return given
    for p in (ROOT / "target/release/gmlake", ROOT / "target/debug/gmlake"):
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    raise BadInput("no gmlake binary: build it (cargo build --release -p gmlake-cli) or pass --gmlake")


def replay(gmlake: str, trace: Path, args: List[str]) -> dict:
    """`args`: the replay's options (`--set KEY=VALUE`, `--busy-side-streams`)."""
    cmd = [gmlake, "replay", "--json", *args, str(trace)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not rows:
        raise BadInput(f"{trace}: gmlake replay failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    # The device the job ran on is the one with the most events (rank 0's trace has one).
    return max(rows, key=lambda x: x.get("events", 0))


def rel(pred: Optional[float], gpu: Optional[float]) -> Optional[float]:
    if pred is None or not gpu:
        return None
    return (pred - gpu) / gpu


def check(trace: Path, gpu: str, gmlake: str, args: List[str]) -> dict:
    path, _, tag = gpu.partition("#")
    gpu_path = Path(path)
    if tag and gpu_path.suffix != ".jsonl":
        raise BadInput(f"{gpu}: #TAG applies to a results .jsonl only")
    runs = load_gpu(gpu_path, tag)
    # A run whose label names gmlake's decisions (`gmlake+host_timing:1`) stands for gmlake's
    # where there is no plain one.
    g = runs.get("gmlake") or next(
        (r for a, r in runs.items() if report.decision_label(a) == "gmlake"), None)
    if g is None:
        raise BadInput(f"{gpu_path}: no gmlake run (allocators there: {', '.join(runs) or 'none'})")
    if not g.get("peak_reserved_bytes"):
        raise BadInput(f"{gpu_path}: the gmlake run has no peak_reserved_bytes")
    row = replay(gmlake, trace, args)
    n = runs.get("native", {})
    gpu_calls = g.get("driver_calls")
    if isinstance(gpu_calls, dict):
        gpu_calls = gpu_calls.get("total")
    elif gpu_calls is None and isinstance(g.get("gmlake"), dict):
        gpu_calls = g["gmlake"].get("driver_calls")
    pred_calls = row.get("driver_calls", {}).get("total")
    return {
        "workload": trace.name,
        "gpu_reserved": g.get("peak_reserved_bytes"),
        "replay_reserved": row.get("peak_reserved_bytes"),
        "reserved_diff": rel(row.get("peak_reserved_bytes"), g.get("peak_reserved_bytes")),
        "gpu_util": g.get("utilization"),
        "replay_util": row.get("utilization"),
        "gpu_native_reserved": n.get("peak_reserved_bytes"),
        "trace_native_reserved": row.get("native_peak_reserved_bytes"),
        "native_diff": rel(row.get("native_peak_reserved_bytes"), n.get("peak_reserved_bytes")),
        "gpu_calls": gpu_calls,
        "replay_calls": pred_calls,
        "calls_diff": rel(pred_calls, gpu_calls),
    }


def pair(gpu, predicted, fmt) -> str:
    """"GPU / prediction", in report.py's number formats ("—" where there is none)."""
    return f"{fmt(gpu)} / {fmt(predicted)}"


def error(x: Optional[float]) -> str:
    return f"({report.fnum(x, '{:+.1%}')})"


def count(x: Optional[int]) -> str:
    return report.fnum(x, "{:,}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pairs", nargs="+", metavar="TRACE[=GPU]")
    ap.add_argument("--gmlake", help="the gmlake binary (default: target/release, then target/debug)")
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="largest relative error of the predicted peak reserved (default 0.02)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings")
    ap.add_argument("--busy-side-streams", action="store_true",
                    help="replay with side streams busy when the allocator looks (gmlake replay's "
                         "option: right for jobs that keep collectives queued, such as FSDP2)")
    ap.add_argument("--json", action="store_true", help="one JSON object per workload")
    a = ap.parse_args(argv)
    if not 0 < a.tolerance < 1:
        print(f"gpu_check: --tolerance must be in (0, 1), got {a.tolerance}", file=sys.stderr)
        return 2
    try:
        gmlake = find_gmlake(a.gmlake)
        results = []
        for p in a.pairs:
            t, _, g = p.partition("=")
            trace = Path(t)
            args = [x for s in a.settings for x in ("--set", s)]
            args += ["--busy-side-streams"] if a.busy_side_streams else []
            results.append(check(trace, g or str(default_gpu_path(trace)), gmlake, args))
    except BadInput as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    off = [r for r in results if abs(r["reserved_diff"]) > a.tolerance]
    if a.json:
        for r in results:
            print(json.dumps(dict(r, within_tolerance=r not in off)))
    else:
        rows = [[r["workload"],
                 f"{pair(r['gpu_reserved'], r['replay_reserved'], report.gib)} {error(r['reserved_diff'])}",
                 pair(r["gpu_util"], r["replay_util"], report.fnum),
                 f"{pair(r['gpu_native_reserved'], r['trace_native_reserved'], report.gib)} "
                 f"{error(r['native_diff'])}",
                 f"{pair(r['gpu_calls'], r['replay_calls'], count)} {error(r['calls_diff'])}"]
                for r in results]
        print("\n".join(report.table(
            ["workload", "gmlake reserved: GPU / replay (error)", "utilization: GPU / replay",
             "native reserved: GPU / trace (error)", "gmlake driver calls: GPU / replay (error)"], rows)))
        for r in off:
            print(f"\n{r['workload']}: the predicted peak reserved is off by more than "
                  f"{a.tolerance * 100:.1f}%", file=sys.stderr)
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
