#!/usr/bin/env python3
"""The summary of bench/dist-gpu.sh's runs: one line per run and rank (utilization, median
step, peak reserved, gmlake's driver calls and own time a step after warm-up, stream waits,
alias evictions, last loss), then, per job and gmlake configuration, its step against the
native runs of the same pass through the allocator list (native, gmlake..., native again;
their geometric mean), pass by pass: the host's speed drifts between passes by more than the
allocators differ, so only runs of one pass are compared. (Until the twenty-sixth session it
was the faster native run of the pass, which reads every gmlake run slower than it is by
about half the spread between the two native runs.)

    python3 bench/dist_summary.py OUT_DIR

Files: MODE-BACKEND-NAME[-pN]-rankR.json (tests/gpu/cases/dist_train.py), NAME one of native,
native2, g, g0, g1...; -pN is the pass (REPEAT > 1), none for the first."""
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (the bench's shared formats)

NAME = re.compile(r"^(?P<mode>[a-z0-9]+)-(?P<backend>[a-zA-Z0-9_]+)-(?P<name>[a-z0-9]+)"
                  r"(?:-p(?P<pass>\d+))?-rank(?P<rank>\d+)\.json$")
CALL_KEYS = ("gmlake.driver_calls", "gmlake.driver_calls.map", "gmlake.driver_calls.unmap",
             "gmlake.driver_calls.set_access", "gmlake.driver_calls.create_physical",
             "gmlake.driver_calls.stream_wait")


def per_step(d):
    """Driver calls by kind and the allocator's own ms, a step after warm-up ({} for native)."""
    w = d.get("after_warmup_per_step") or {}
    out = {k.replace("gmlake.driver_calls.", "").replace("gmlake.", ""): round(v, 1)
           for k, v in w.items() if k in CALL_KEYS}
    host = w.get("gmlake.host_ns_alloc", 0) + w.get("gmlake.host_ns_free", 0)
    if host:
        out["allocator ms"] = round(host / 1e6, 2)
    return out


def load(folder):
    """[(mode, name, pass, rank, record)] of the run files in `folder`."""
    runs = []
    for f in sorted(glob.glob(os.path.join(folder, "*-rank*.json"))):
        m = NAME.match(os.path.basename(f))
        if not m:
            continue
        with open(f) as fh:
            d = json.load(fh)
        runs.append((m["mode"], m["name"], int(m["pass"] or 1), int(m["rank"]), d,
                     os.path.basename(f)))
    return runs


def run_lines(runs):
    for mode, name, p, rank, d, fname in runs:
        yield " ".join(str(x) for x in (
            fname, "util %.4f" % d["utilization"], "step %.1f ms" % d["median_step_ms"],
            "peak reserved %d" % d["peak_reserved"], "calls/step %s" % (per_step(d) or "-"),
            "waits", d.get("gmlake.driver_calls.stream_wait", "-"),
            "evictions", d.get("gmlake.alias_evictions", "-"), "loss", d["losses"][-1]))


def rounds(runs):
    """{(mode, name): {rank: [(pass, ratio)]}}: each gmlake run's median step over the
    geometric mean of the native runs (native, native2) of its pass and rank; passes without a
    native run are left out. The mean, not the faster: two runs of one allocator differ by
    noise alone, and the faster of them is faster than native's typical run, which read every
    other allocator slower than it is (docs/benchmarks.md, twenty-sixth session)."""
    steps = {}
    for mode, name, p, rank, d, _ in runs:
        if name.startswith("native"):
            steps.setdefault((mode, p, rank), []).append(d["median_step_ms"])
    native = {k: statistics.geometric_mean(v) for k, v in steps.items()}
    out = {}
    for mode, name, p, rank, d, _ in runs:
        if name.startswith("native") or (mode, p, rank) not in native:
            continue
        out.setdefault((mode, name), {}).setdefault(rank, []).append(
            (p, d["median_step_ms"] / native[(mode, p, rank)]))
    return out


def round_table(runs):
    """The pass-by-pass table (markdown lines), one row per job, gmlake run and rank; [] when
    no gmlake run has a native run in its pass."""
    r = rounds(runs)
    if not r:
        return []
    by = {(m, n, p, k): d for m, n, p, k, d, _ in runs}
    lines = ["| job | gmlake run | conf | rank | passes | step / native runs of the pass (their "
             "geometric mean; over the passes, geometric mean) | range | utilization | calls a step | "
             "allocator ms a step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, name), ranks in sorted(r.items()):
        for rank, ratios in sorted(ranks.items()):
            ratios = sorted(ratios)
            vals = [x for _, x in ratios]
            geo, lo, hi = report.paired_ratios(vals)
            recs = [by[(mode, name, p, rank)] for p, _ in ratios]
            steps = [per_step(d) for d in recs]
            calls = [s.get("driver_calls") for s in steps if s.get("driver_calls") is not None]
            ms = [s.get("allocator ms") for s in steps if s.get("allocator ms") is not None]
            conf = " / ".join(sorted({d.get("gmlake_conf", "") for d in recs})) or "-"
            lines.append("| %s | %s | %s | %d | %d | %.3f | %.3f-%.3f | %s | %s | %s |" % (
                mode, name, conf, rank, len(vals), geo, lo, hi,
                "-".join("%.3f" % x for x in sorted({min(d["utilization"] for d in recs),
                                                     max(d["utilization"] for d in recs)})),
                "-".join("%.0f" % x for x in sorted({min(calls), max(calls)})) if calls else "-",
                "-".join("%.1f" % x for x in sorted({min(ms), max(ms)})) if ms else "-"))
    return lines


def main(argv):
    if len(argv) != 2:
        print("usage: python3 bench/dist_summary.py OUT_DIR", file=sys.stderr)
        return 2
    runs = load(argv[1])
    if not runs:
        print(f"no run files (MODE-BACKEND-NAME-rankR.json) in {argv[1]}", file=sys.stderr)
        return 1
    for line in run_lines(runs):
        print(line)
    table = round_table(runs)
    if table:
        print()
        print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
