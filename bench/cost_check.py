#!/usr/bin/env python3
"""Checks the replay's cost model (rust/gmlake-core/src/cost.rs) against the GPU: for each
gmlake run of a workload, the driver time the model estimates from the calls gmlake made in
the timed steps (`driver_calls_by_kind`, recorded by bench/workloads/common.py), against the
step time gmlake lost to the faster of native and expandable segments in the same file. For
bench/latency.cpp's random mixed pattern (`calls_timed.*` keys), the same for the timed
pairs: the time gmlake lost to native's fastest run.

    python3 bench/cost_check.py bench/out/bench/*.jsonl

The model's per-call figures are read from cost.rs, so the check follows the model."""
import json
import re
import statistics
import sys
from pathlib import Path

COST_RS = Path(__file__).resolve().parent.parent / "rust/gmlake-core/src/cost.rs"


def model(path=COST_RS):
    """The model as cost.rs states it: ({constant: (idle µs, busy µs)}, {constant: [call
    kinds it charges]}), the second read from `estimate_ms`'s list of parts, so that this
    check charges what the replay charges."""
    text = path.read_text()
    table = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"pub const (\w+): CallCost = c\(([\d.]+), ([\d.]+)\);", text)}
    start = text.index("let parts = [")
    parts = text[start:text.index("];", start)]
    kinds = {m.group(2): re.findall(r"calls\.(\w+)", m.group(1)) for m in re.finditer(
        r"\(\s*((?:calls\.\w+\s*\+?\s*)+),\s*(\w+),?\s*\)", parts)}
    missing = set(kinds) - set(table)
    if not kinds or missing:
        raise SystemExit(f"cannot read the model from {path} (no figure for {sorted(missing)})")
    return table, kinds


def costs(path=COST_RS):
    """{constant: (idle µs, busy µs)} from cost.rs."""
    return model(path)[0]


# Call kinds charged by each cost constant, as in cost.rs's estimate_ms.
KINDS = model()[1]
# Every call kind the model charges (stitching counters in the same records are not calls).
CALL_KINDS = {k for names in KINDS.values() for k in names}


def estimate_ms(kinds, table):
    """(idle, busy) milliseconds for calls by kind."""
    idle = busy = 0.0
    for const, names in KINDS.items():
        n = sum(kinds.get(k, 0) for k in names)
        idle += n * table[const][0]
        busy += n * table[const][1]
    return idle / 1000.0, busy / 1000.0


def latency_rows(recs, table):
    """Lines comparing gmlake's random mixed runs with the model (empty without any)."""
    mixed = [r for r in recs if r.get("kind") == "latency" and r.get("test") == "mixed"]
    base = [r["ns_per_pair"] for r in mixed if r.get("allocator") == "native"]
    out = []
    for r in mixed:
        kinds = {k[len("calls_timed."):]: v for k, v in r.items() if k.startswith("calls_timed.")}
        if not kinds or not base:
            continue
        pairs = r["ops_pairs"]
        idle, busy = estimate_ms(kinds, table)
        lost = (r["ns_per_pair"] - min(base)) * pairs / 1e6
        calls = sum(v for k, v in kinds.items() if k in CALL_KINDS)
        out.append(f"{'mixed':<14} {r.get('allocator', '?')[:28]:<28} {pairs:>8} {calls:>8} "
                   f"{lost:>10.2f} {idle:>10.2f} {busy:>10.2f} "
                   f"{(lost / idle if idle > 0 else float('nan')):>9.2f}")
    if out:
        out.insert(0, f"{'pattern':<14} {'run':<28} {'pairs':>8} {'calls':>8} {'lost ms':>10} "
                      f"{'model idle':>10} {'model busy':>10} {'lost/idle':>9}")
    return out


def main(paths):
    table = costs()
    rows = []
    recs = []
    for p in paths:
        for line in open(p):
            if line.strip():
                r = json.loads(line)
                recs.append(r)
                if r.get("median_step_s"):
                    rows.append(r)
    for line in latency_rows(recs, table):
        print(line)
    by_wl = {}
    for r in rows:
        by_wl.setdefault(r.get("workload", "?"), []).append(r)
    print(f"{'workload':<14} {'run':<28} {'steps':>5} {'calls/step':>10} {'lost ms/step':>12} "
          f"{'model idle':>10} {'model busy':>10} {'lost/busy':>9}")
    for wl, rs in by_wl.items():
        base = [r["median_step_s"] for r in rs
                if r.get("allocator", "").split()[0] in ("native", "native2", "expandable")]
        if not base:
            continue
        best = min(base)
        for r in rs:
            kinds = r.get("driver_calls_by_kind")
            steps = len(r.get("driver_calls_per_step") or [])
            if not kinds or not steps:
                continue
            idle, busy = estimate_ms(kinds, table)
            lost = (r["median_step_s"] - best) * 1e3
            per = statistics.fmean(r["driver_calls_per_step"])
            ratio = lost / (busy / steps) if busy > 0 else float("nan")
            print(f"{wl:<14} {r['allocator'][:28]:<28} {steps:>5} {per:>10.0f} {lost:>12.2f} "
                  f"{idle / steps:>10.2f} {busy / steps:>10.2f} {ratio:>9.2f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
