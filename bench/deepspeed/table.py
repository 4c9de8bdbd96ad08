#!/usr/bin/env python3
"""The table of bench/deepspeed/run.sh's results: per strategy and allocator, peak active, peak
reserved, utilization, median step (and its ratio to the faster baseline), the losses (equal
across allocators?), and the largest LR batch under the cap.

With REPEAT > 1 (run.sh runs the allocator list that many times, interleaved) each row
gathers an allocator's runs: the step is the median of the runs' medians, with the spread
(fastest and slowest run) beside it, so that the noise between runs can be read next to the
differences between allocators; the utilization is the lowest of the runs and the peaks the
highest. The faster baseline is the faster of native (native2's runs counted with native's:
the faster of two runs of one allocator would be a biased pick) and expandable.

gmlake's rows also give its driver calls a step and, when it ran with `host_timing:1`
(`ALLOCATORS="gmlake+host_timing:1"`), the allocator's own time a step (allocations and frees,
driver calls included): the medians over the timed steps, then over the runs. That time is an
upper bound of what the allocator can add to a step, read in the job itself, and far less
noisy than the step: runs of one allocator differ by 10-30% on these jobs. The last column is
gmlake's slowest allocation or free of any timed step, split into the wait for the allocator's
lock, its driver calls and the slowest of them (the rest is the core's own work): one N run on
four H200s had a step in which two ranks each spent 628 ms in gmlake's calls.

The runs of one call move together (the host's speed drifts within a call by more than the
allocators differ), so each row also compares its allocator round by round: run k of an
allocator against run k of the baselines in the same results file (run.sh's k-th pass over the
allocator list), in every round where all the strategy's baselines ran: each run against the
geometric mean of the round's native runs (native, native2), the ratios pooled by geometric
mean, then over the faster baseline's pooled ratio (expandable segments' pooled the same way);
the column gives that, the range of the ratios to native and the number of rounds. (Until the
twenty-sixth session each round's ratio was to the faster baseline run of the round, which
reads every other allocator slower than it is: the faster of several noisy runs beats their
typical run.) In the eighteenth session LR's rounds ran gmlake at 0.87-1.07x, while native's
own runs spread over 1,545-2,390 ms.

Runs made with `EXTRA_ARGS="--profile-step N"` get a second table, one row per run and rank
(rank 0 from the results file, rank k from its `.rankK` sibling): the profiled step's wall
time, its busiest CUDA streams (busy time / span), the largest host calls and device
operations by time, and for gmlake with `host_timing:1` its allocations and frees of 50 µs or
more (count, total, largest; they are also on their own track of the step's trace), to compare
where each allocator's step goes."""

import glob
import os
import re
import statistics
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import report  # noqa: E402  (the bench's loader and formats)

BASELINES = ("native", "native2", "expandable")


def losses_note(ref, mine):
    if not ref or not mine:
        return "-"
    if ref == mine:
        return "yes"
    return f"no (max diff {max(abs(a - b) for a, b in zip(ref, mine)):.2e})"


def step(runs):
    """(median of the runs' median steps, fastest, slowest, runs) over the runs that ran."""
    steps = [r["median_step_s"] for r in runs if r.get("ok") and r.get("median_step_s")]
    return (statistics.median(steps), min(steps), max(steps), len(steps)) if steps else None


def pooled(runs):
    """(median of every measured step of the runs, steps) or None: with few runs of 5 steps
    each, a slow run moves the median of the runs' medians by its whole difference, where it
    moves the median of all steps by one step's."""
    steps = [t for r in runs if r.get("ok") for t in (r.get("step_times_s") or [])]
    return (statistics.median(steps), len(steps)) if steps else None


def per_step(runs, key):
    """The median over the runs of their `key` (a per-run median), or "-" when none has it."""
    vals = [r[key] for r in runs if r.get("ok") and r.get(key) is not None]
    if not vals:
        return "-"
    m = statistics.median(vals)
    return f"{m:,.0f}" if m >= 100 else f"{m:.1f}"


def largest_call(runs) -> str:
    """gmlake's slowest allocation or free over the runs' timed steps (`slow_calls_per_step`,
    with `host_timing:1`) and where its time went: the wait for the allocator's lock, the
    driver calls and the slowest of them; "-" without the figures."""
    big = [st["largest"] for r in runs if r.get("ok") for st in (r.get("slow_calls_per_step") or [])
           if st.get("largest")]
    if not big:
        return "-"
    b = max(big, key=lambda x: x["ms"])
    slowest = (f": {b['slowest_driver']} {b['slowest_driver_ms']:,.1f}"
               if b.get("slowest_driver") else "")
    return (f"{b['ms']:,.1f} ms {b['op']} (lock {b.get('lock_wait_ms', 0):,.1f}, "
            f"driver {b.get('driver_ms', 0):,.1f} in {b.get('driver_calls', 0)} calls{slowest})")


def _top(items, n=3):
    return "; ".join(f"{name[:40]} {ms:.1f} ms x{k}" for name, ms, k in (items or [])[:n]) or "-"


def profile_rows(path: str):
    """One row per profiled run and rank (see the module's doc)."""
    files = [(0, path)] + sorted(
        (int(m.group(1)), f) for f in glob.glob(glob.escape(path) + ".rank*")
        if (m := re.search(r"\.rank(\d+)$", f)))
    rows = []
    for rank, f in files:
        for r in report.load([f]):
            p = r.get("profile") if r.get("kind") == "workload" else None
            if not p:
                continue
            streams = sorted((p.get("streams") or {}).items(), key=lambda kv: -kv[1]["busy_ms"])
            busy = "; ".join(f"{sid}: {v['busy_ms']:.0f}/{v['span_ms']:.0f} ms ({v['ops']})"
                             for sid, v in streams[:3]) or "-"
            slow = p.get("gmlake_slow_calls")
            slow = (f"{slow['count']}, {slow['ms']:.1f} ms (largest {slow['largest_ms']:.1f})"
                    if slow else "-")
            rows.append([r.get("tag", "").replace("zero3-", ""), r["allocator"], str(rank),
                         str(p.get("step", "?")), f"{p.get('wall_ms', 0):.0f} ms", busy,
                         _top(p.get("host_calls")), _top(p.get("device_ops")), slow])
    return rows


def paired(runs, tag, groups) -> str:
    """Round by round: each run's median step over the geometric mean of the native runs
    (native, native2) of the same round, in rounds where every baseline of the strategy ran;
    the geometric mean of those ratios over the faster baseline's (native's is 1 by
    construction, expandable segments' pooled the same way), with the range of the ratios to
    native and their count; "-" where no round qualifies. Rounds are (results file, pass) as
    `main` numbers them. The faster baseline is picked after pooling, not round by round:
    the faster of several noisy runs beats each one's typical run, and picking it per round
    read every other allocator slower than it is (docs/benchmarks.md, twenty-sixth
    session)."""
    bases = [a for a in BASELINES if (tag, a) in groups]
    natives = [a for a in bases if a.startswith("native")]
    if not natives:
        return "-"

    def steps(a, rnd):
        return [b["median_step_s"] for b in groups[(tag, a)]
                if b.get("_round") == rnd and b.get("ok") and b.get("median_step_s")]

    def reference(rnd):
        if any(not steps(a, rnd) for a in bases):
            return None
        return statistics.geometric_mean([x for a in natives for x in steps(a, rnd)])

    def ratios_of(rs):
        refs = [(r, reference(r["_round"])) for r in rs
                if r.get("ok") and r.get("median_step_s") and "_round" in r]
        return [r["median_step_s"] / ref for r, ref in refs if ref]

    ratios = ratios_of(runs)
    summary = report.paired_ratios(ratios)
    if summary is None:
        return "-"
    # Native's pooled ratio is 1 (its runs are the reference); the others' are pooled alike.
    pooled_others = [report.paired_ratios(ratios_of(groups[(tag, a)])) for a in bases if a not in natives]
    best = min([1.0] + [p[0] for p in pooled_others if p])
    g, lo, hi = summary
    return f"{g / best:.3f} ({lo:.3f}-{hi:.3f}, {len(ratios)})"


def machine_rows(paths) -> list:
    """bench/machine_check.py's lines that run.sh wrote beside the results (machine.jsonl,
    before and after each call's runs): the host's and GPUs' speed, so that tables of two calls
    are compared only where the machine ran at the same speed (one four-GPU call ran every job
    2.5x slower than the call before it)."""
    files = []
    for path in paths:
        p = os.path.join(os.path.dirname(os.path.abspath(path)), "machine.jsonl")
        if os.path.exists(p) and p not in files:
            files.append(p)
    rows = []
    for r in report.load(files) if files else []:
        if r.get("kind") != "machine_check":
            continue
        g = r.get("gpu_bf16_tflops") or []
        rows.append([r.get("time", "?"), f"{r.get('host_loop_ms', 0):.1f}",
                     f"{r.get('load_avg_1m', 0):.2f}",
                     f"{min(g):.0f}-{max(g):.0f} ({len(g)} GPUs)" if g else "-"])
    return rows


def main(*paths: str, merge: bool = False) -> int:
    """The tables of the results files `paths` (several calls' files read as one); `merge`
    joins the runs of native2 to native's, and those of a gmlake label with `host_timing:1` to
    the same label without it (`report.decision_label`)."""
    groups, search = OrderedDict(), {}
    passes = {}  # (file, tag, label as run) -> runs seen: the pass a run belongs to
    for i, path in enumerate(paths):
        for r in report.load([path]):
            if r.get("kind") == "workload":
                key = (i, r.get("tag", ""), r["allocator"])
                r["_round"] = (i, passes.get(key, 0))
                passes[key] = passes.get(key, 0) + 1
                a = report.decision_label(r["allocator"]) if merge else r["allocator"]
                groups.setdefault((r.get("tag", ""), a), []).append(r)
            elif r.get("kind") == "max_batch":
                search[r["allocator"]] = r

    rows = []
    for (tag, alloc), runs in groups.items():
        strat = tag.replace("zero3-", "")
        # The baselines' runs by allocator, native2's with native's: the faster of two runs of
        # one allocator is faster than its typical run, so native2 is not a baseline of its own.
        by_base: dict = {}
        for a in BASELINES:
            if (tag, a) in groups:
                by_base.setdefault("native" if a.startswith("native") else a, []).extend(groups[(tag, a)])
        base = [step(v) for v in by_base.values()]
        best = min((b[0] for b in base if b), default=None)
        base_all = [pooled(v) for v in by_base.values()]
        best_all = min((b[0] for b in base_all if b), default=None)
        ref = next((r.get("model", {}).get("losses") for r in groups.get((tag, "native"), [])
                    if r.get("ok")), None)
        ok = [r for r in runs if r.get("ok")]
        timed = step(ok)
        if timed is None:
            rows.append([strat, alloc, str(len(runs)), runs[0].get("error", "failed")[:60]] + [""] * 12)
            continue
        notes = {losses_note(ref, r.get("model", {}).get("losses")) for r in ok}
        same = "yes" if notes == {"yes"} else "; ".join(sorted(n for n in notes if n != "yes"))
        util = min((r["peak_active_bytes"] / r["peak_reserved_bytes"] for r in ok
                    if r.get("peak_reserved_bytes")), default=None)
        m, lo, hi, n = timed
        spread = f" ({lo * 1e3:.0f}-{hi * 1e3:.0f})" if n > 1 else ""
        all_steps = pooled(ok)
        failed = f" ({len(runs) - len(ok)} failed)" if len(ok) < len(runs) else ""
        rows.append([strat, alloc, f"{len(runs)}{failed}",
                     report.gib(max(r.get("peak_active_bytes", 0) for r in ok)),
                     report.gib(max(r.get("peak_reserved_bytes", 0) for r in ok)),
                     report.fnum(util), f"{m * 1e3:.0f} ms{spread}",
                     report.fnum(m / best if best else None),
                     f"{all_steps[0] * 1e3:.0f} ms ({all_steps[1]})" if all_steps else "-",
                     report.fnum(all_steps[0] / best_all if all_steps and best_all else None),
                     paired(ok, tag, groups) if alloc not in BASELINES else "-",
                     same,
                     per_step(ok, "median_driver_calls_per_step"),
                     per_step(ok, "median_vmm_calls_per_step"),
                     per_step(ok, "median_allocator_ms_per_step"), largest_call(ok)])
    print("\n".join(report.table(
        ["strategy", "allocator", "runs", "peak active", "peak reserved", "utilization",
         "median step (spread)", "vs faster baseline", "median of all steps (steps)",
         "vs faster baseline, all steps",
         "vs faster baseline, round by round (range against the round's native runs, rounds)",
         "losses equal native's",
         "driver calls a step", "of them VMM (map, unmap, access, create, release)",
         "allocator ms a step", "slowest gmlake call (where its time went)"], rows)))
    if search:
        print()
        print("\n".join(report.table(
            ["allocator", "largest LR batch under the cap"],
            [[a, f"{r.get('max_batch', '?')}"
                 + ("" if r.get("search_complete") else f" (>=; stopped: {r.get('stopped')})")]
             for a, r in search.items()])))
    checks = machine_rows(paths)
    if checks:
        print()
        print("\n".join(report.table(
            ["machine check", "host loop (ms)", "load (1 min)", "GPU bf16 TFLOP/s (slowest-fastest)"],
            checks)))
    prof = [row for path in paths for row in profile_rows(path)]
    if prof:
        print()
        print("\n".join(report.table(
            ["strategy", "allocator", "rank", "profiled step", "wall", "streams busy / span (ops)",
             "host calls", "device operations", "gmlake calls of 50 us or more"], prof)))
    return 0


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.jsonl files (several calls' read as one)")
    ap.add_argument("--merge", action="store_true",
                    help="join native2's runs to native's, and a gmlake label's runs with "
                         "host_timing:1 to those without it")
    a = ap.parse_args()
    sys.exit(main(*a.results, merge=a.merge))
