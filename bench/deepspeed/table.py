#!/usr/bin/env python3
"""The table of bench/deepspeed/run.sh's results: per strategy and allocator, peak active, peak
reserved, utilization, median step (and its ratio to the faster of native and expandable), the
losses (equal across allocators?), and the largest LR batch under the cap."""

import json
import sys
from collections import OrderedDict

GIB = 1 << 30


def main(path: str) -> int:
    runs, search = OrderedDict(), {}
    for line in open(path):
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("kind") == "workload":
            runs[(r.get("tag", ""), r["allocator"])] = r
        elif r.get("kind") == "max_batch":
            search[r["allocator"]] = r
    print("| strategy | allocator | peak active | peak reserved | utilization | median step | vs best of native/expandable | losses equal native's |")
    print("|---|---|---|---|---|---|---|---|")
    for (tag, alloc), r in runs.items():
        strat = tag.replace("zero3-", "")
        best = [runs[(tag, a)].get("median_step_s") for a in ("native", "expandable") if (tag, a) in runs]
        best = min([b for b in best if b], default=None)
        ref = runs.get((tag, "native"), {}).get("model", {}).get("losses")
        mine = r.get("model", {}).get("losses")
        same = "-" if not ref or not mine else ("yes" if ref == mine else
                                               f"no (max diff {max(abs(a - b) for a, b in zip(ref, mine)):.2e})")
        if not r.get("ok"):
            print(f"| {strat} | {alloc} | {r.get('error', 'failed')[:60]} | | | | | |")
            continue
        act, res = r.get("peak_active_bytes", 0), r.get("peak_reserved_bytes", 0)
        m = r.get("median_step_s")
        print(f"| {strat} | {alloc} | {act / GIB:.2f} GiB | {res / GIB:.2f} GiB | {act / res if res else 0:.3f} | "
              f"{m * 1e3:.0f} ms | {m / best if best and m else 0:.3f} | {same} |")
    if search:
        print()
        print("| allocator | largest LR batch under the cap |")
        print("|---|---|")
        for a, r in search.items():
            note = "" if r.get("search_complete") else f" (>=; stopped: {r.get('stopped')})"
            print(f"| {a} | {r.get('max_batch', '?')}{note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
