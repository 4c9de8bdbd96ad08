"""bench/report.py on synthetic records (no torch, no GPU), and the workloads' command lines.

Run: python3 -m pytest -q bench/tests
"""

from __future__ import annotations

import ast
import json
import os
import py_compile
import subprocess
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
import report  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
WORKLOADS = ["llm_lora", "fsdp_offload", "moe", "conv", "kv_infer", "concat_cache", "stress", "zero3",
             "kernels"]


def synthetic(gmlake_util=0.99, gmlake_ratio=1.005, fail_kv_expandable=False):
    """Records shaped like run-gpu.sh's (numbers made up for the test)."""
    recs = [{"kind": "env", "gpu": "FAKE GPU 80GB", "driver": "999.1", "torch": "2.11.0+cu130", "cuda": "13.0",
             "date": "2026-01-01 00:00:00 UTC", "git_commit": "0123456789abcdef", "git_dirty": False,
             "quick": False, "transformers": "5.17.0", "peft": "0.21.2", "torchvision": "0.26.0"}]
    for i, w in enumerate(WORKLOADS):
        for a in ("native", "expandable", "gmlake"):
            if fail_kv_expandable and w == "kv_infer" and a == "expandable":
                recs.append({"kind": "failed", "what": "workload", "workload": w, "allocator": a, "rc": 124})
                continue
            active = (4 + i) * GiB
            util = {"native": 0.80, "expandable": 0.90, "gmlake": gmlake_util}[a]
            step = {"native": 0.100, "expandable": 0.104, "gmlake": 0.100 * gmlake_ratio}[a]
            recs.append({
                "kind": "workload", "workload": w, "allocator": a, "ok": True, "batch": 4, "steps": 10,
                "warmup": 3, "median_step_s": step, "peak_active_bytes": active,
                "peak_reserved_bytes": int(active / util), "utilization": util, "num_ooms": 0,
                "model": {"params": 1_000_000_000, "trainable_params": 10_000_000},
                "config": {"seq_min": 256, "seq_max": 2048, "seq": 1024, "fill_min": 0.25, "skew_max": 3.0,
                           "sizes": "160,224", "batch_min_frac": 0.25, "prompt_min": 128, "prompt_max": 1024,
                           "new_min": 32, "new_max": 128},
                "gpu": "FAKE GPU 80GB", "torch": "2.11.0+cu130", "backend": "gmlake" if a == "gmlake" else "native",
                "expandable_segments_seen": a == "expandable",
                "gmlake": {"stitches": 12, "pages_stitched": 340} if a == "gmlake" else None,
            })
            mb = {"native": 8, "expandable": 9, "gmlake": 10}[a]
            recs.append({"kind": "max_batch", "workload": w, "allocator": a, "cap_bytes": 8 * GiB,
                         "max_batch": mb, "first_failed_batch": mb + 1, "search_complete": True,
                         "stopped": "bracketed", "cap_enforced": True, "search_steps": 3,
                         "trials": [{"batch": mb, "ok": True}, {"batch": mb + 1, "ok": False, "oom": True}]})
    for a, base in (("native", 800.0), ("expandable", 500.0), ("gmlake", 150.0)):
        s = 512
        while s <= GiB:
            recs.append({"kind": "latency", "allocator": a, "test": "fixed", "size": s, "ns_per_pair": base,
                         "iters": 100000})
            s *= 4
        recs.append({"kind": "latency", "allocator": a, "test": "fixed", "size": GiB, "ns_per_pair": base + 10})
        recs.append({"kind": "latency", "allocator": a, "test": "mixed", "live": 10000, "min_size": 512,
                     "max_size": 32 << 20, "ops_pairs": 1000000, "warm_pairs": 200000,
                     "ns_per_op": base * 1.2, "alloc_p50_ns": base, "alloc_p99_ns": base * 3,
                     "alloc_max_ns": 90000.0, "device_allocs_timed": 3, "peak_reserved_bytes": 40 * GiB,
                     "peak_active_bytes": 31 * GiB})
        for m, k in ((1, 256), (4, 64)):
            for r in range(3):
                recs.append({"kind": "stitch", "allocator": a, "test": "stitch_round", "pages_per_block": m,
                             "blocks": k, "round": r, "us": 400.0 if a == "gmlake" else 900.0,
                             "pages_stitched": 128 if a == "gmlake" else -1})
            recs.append({"kind": "stitch", "allocator": a, "test": "stitch", "pages_per_block": m, "blocks": k,
                         "request_pages": k // 2 * m, "us_median": 400.0 if a == "gmlake" else 900.0,
                         "us_per_page_stitched_median": 3.125 if a == "gmlake" else None,
                         "pages_stitched_total": 384 if a == "gmlake" else 0, "rounds": 3})
    return recs


def write(tmp_path, recs):
    p = tmp_path / "results.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs) + "not json\n")
    return p


def test_report_writes_tables_and_keeps_the_rest(tmp_path):
    res = write(tmp_path, synthetic())
    md = tmp_path / "docs" / "benchmarks.md"
    md.parent.mkdir()
    md.write_text("# Benchmarks\n\nCore figures stay here.\n")
    assert report.main([str(res), "--md", str(md), "--img-dir", str(tmp_path / "docs" / "img")]) == 0
    text = md.read_text()
    assert "Core figures stay here." in text
    assert "FAKE GPU 80GB" in text and "999.1" in text and "2.11.0+cu130" in text and "2026-01-01" in text
    assert "bash bench/run-gpu.sh" in text and "bench/report.py" in text
    for w in WORKLOADS:
        assert f"### {w}" in text
    # gmlake row of llm_lora: 4 GiB active, utilization 0.99, step ratio 1.005 vs native's 0.100.
    row = next(line for line in text.splitlines() if line.startswith("| gmlake | 4.00 GiB"))
    assert "| 0.990 |" in row and "1.005×" in row and "| 10 |" in row
    assert "| 1 GiB | 810 | 510 | 160 |" in text
    assert "3.12 µs" in text  # stitch cost 400 µs / 128 pages
    # Targets all met in this synthetic run.
    targets = text[text.index("### Targets"):text.index("### llm_lora")]
    assert "**no**" not in targets
    # Regenerating replaces the section instead of appending a second one.
    report.main([str(res), "--md", str(md), "--img-dir", str(tmp_path / "docs" / "img")])
    text2 = md.read_text()
    assert text2.count("gpu-bench:begin") == 1 and text2.count("gpu-bench:end") == 1
    assert "Core figures stay here." in text2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib not installed: plots not checked")
    imgs = sorted(os.listdir(tmp_path / "docs" / "img"))
    assert imgs == ["gpu-latency.png", "gpu-max-batch.png", "gpu-memory.png", "gpu-step-time.png"]
    assert "](img/gpu-memory.png)" in text2


def test_missed_targets_and_failures_are_shown(tmp_path):
    res = write(tmp_path, synthetic(gmlake_util=0.95, gmlake_ratio=1.05, fail_kv_expandable=True))
    md = tmp_path / "b.md"
    report.main([str(res), "--md", str(md), "--no-plots"])
    text = md.read_text()
    targets = text[text.index("### Targets"):text.index("### llm_lora")]
    assert "lowest 0.950" in targets and "worst 1.050×" in targets
    assert targets.count("**no**") == 2
    kv = text[text.index("### kv_infer"):]
    assert "timed out" in kv
    assert "plots skipped" in text


def test_summary_prints_without_writing(tmp_path, capsys):
    res = write(tmp_path, synthetic(fail_kv_expandable=True))
    assert report.main(["--summary", str(res)]) == 0
    out = capsys.readouterr().out
    assert "llm_lora" in out and "latency ns/pair" in out and "stitch" in out and "targets:" in out
    assert "failed: workload kv_infer expandable" in out
    assert not (tmp_path / "docs").exists()


def test_later_records_win(tmp_path):
    recs = synthetic()
    recs.append({"kind": "latency", "allocator": "gmlake", "test": "mixed", "live": 10000, "min_size": 512,
                 "max_size": 1 << 25, "ops_pairs": 1, "warm_pairs": 1, "ns_per_op": 999.0})
    res = report.Results(recs)
    assert res.one("latency", allocator="gmlake", test="mixed")["ns_per_op"] == 999.0


def test_empty_results(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text("")
    md = tmp_path / "b.md"
    assert report.main([str(p), "--md", str(md), "--no-plots"]) == 0
    assert "not measured" in md.read_text()


def test_python_files_compile(tmp_path):
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) >= 8
    for i, f in enumerate(files):
        py_compile.compile(str(f), doraise=True, cfile=str(tmp_path / f"{i}.pyc"))


@pytest.mark.parametrize("w", WORKLOADS)
def test_workload_help_needs_no_torch(w):
    r = subprocess.run([sys.executable, str(BENCH / "workloads" / f"{w}.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--allocator" in r.stdout and "--cap-gib" in r.stdout and "--search" in r.stdout


def test_run_script_syntax():
    for s in ("run-gpu.sh", "rounds.sh", "issue12-gpu.sh", "build-latency.sh", "ops-gpu.sh", "deepspeed/run.sh",
              "deepspeed/wheels.sh"):
        r = subprocess.run(["bash", "-n", str(BENCH / s)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("w", WORKLOADS)
def test_run_gpu_reads_each_workloads_default_steps(w):
    """run-gpu.sh scales a workload's timeout by BENCH_STEPS over its default steps, which it
    reads from the workload's DEFAULTS line with sed: the line must keep that shape."""
    script = (BENCH / "run-gpu.sh").read_text()
    pattern = script.split("base=$(sed -n '")[1].split("'")[0]
    r = subprocess.run(["sed", "-n", pattern, str(BENCH / "workloads" / f"{w}.py")],
                       capture_output=True, text=True, check=True)
    line = next(x for x in (BENCH / "workloads" / f"{w}.py").read_text().splitlines()
                if x.startswith("DEFAULTS = "))
    assert r.stdout.strip() == str(ast.literal_eval(line.split("=", 1)[1].strip())["steps"])


def test_search_on_cpu_with_fake_oom(tmp_path):
    """The run and the largest-batch search end to end on the CPU (skipped without torch)."""
    pytest.importorskip("torch")
    out = tmp_path / "r.jsonl"
    r = subprocess.run([sys.executable, str(BENCH / "workloads" / "moe.py"), "--device", "cpu", "--tiny",
                        "--batch", "4", "--steps", "2", "--warmup", "1", "--search", "--fake-oom-above", "13",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    run = next(x for x in recs if x["kind"] == "workload")
    assert run["ok"] and len(run["step_times_s"]) == 2 and run["allocator"] == "native"
    mb = next(x for x in recs if x["kind"] == "max_batch")
    assert mb["max_batch"] == 13 and mb["first_failed_batch"] == 14 and mb["search_complete"]
    assert [t["batch"] for t in mb["trials"]] == [4, 8, 16, 12, 14, 13]


def test_driver_calls_per_step_and_the_second_native_run_are_reported():
    recs = [{"kind": "env", "gpu": "FAKE", "driver": "1", "torch": "2.11.0", "date": "today"}]
    for a, step, calls in (("native", 0.100, None), ("expandable", 0.110, None),
                           ("gmlake", 0.101, [0, 2, 0]), ("native2", 0.097, None)):
        r = {"kind": "workload", "workload": "concat_cache", "allocator": a, "ok": True, "steps": 3,
             "warmup": 1, "median_step_s": step, "peak_active_bytes": GiB, "peak_reserved_bytes": GiB,
             "utilization": 1.0}
        if calls is not None:
            r["driver_calls_per_step"] = calls
            r["median_driver_calls_per_step"] = sorted(calls)[1]
            r["vmm_calls_per_step"] = [0, 1, 0]
            r["median_vmm_calls_per_step"] = 0
        recs.append(r)
    res = report.Results(recs)
    assert res.allocators() == ["native", "expandable", "gmlake", "native2"]
    ratios = report.step_ratios(res, "concat_cache")
    assert abs(ratios["gmlake"] - 1.01) < 1e-9 and abs(ratios["native2"] - 0.97) < 1e-9
    text = report.summary(res)
    line = next(x for x in text.splitlines() if x.startswith("concat_cache") and " gmlake " in x)
    assert "calls/vmm" in text and line.split()[7] == "0/0", line
    # The terminal summary counts the steps that mapped too.
    assert line.endswith("VMM calls in 1 of 3 steps, mean 0 a step"), line
    md = "\n".join(report.workload_lines(res))
    assert "driver calls per step" in md and "native2" in md
    assert "| 0 (0 VMM) |" in md, md
    # The median hides the steps that mapped: they are counted.
    assert "VMM calls in 1 of 3 steps, mean 0 a step" in md, md
    assert report.quiet_steps_note({"vmm_calls_per_step": [0, 0, 250, 2025]}) == \
        "VMM calls in 2 of 4 steps, mean 569 a step"
    # With the measured driver time a step (gmlake.driver_ns).
    assert report.quiet_steps_note({"vmm_calls_per_step": [0, 120, 0, 0],
                                    "driver_ms_per_step": [0.0, 4.5, 0.1, 0.2]}) == \
        "VMM calls in 1 of 4 steps, mean 30 a step, driver 1.2 ms a step (mean, max 4.5)"
    assert report.quiet_steps_note({"median_step_s": 0.1}) == ""
    assert report.quiet_steps_note(None) == ""
    # A record from before the VMM split (or a baseline) shows what it has.
    assert report.calls_cell({"median_driver_calls_per_step": 12}) == "12"
    assert report.calls_cell(None) == "—"


@pytest.mark.parametrize("w", ["concat_cache", "stress", "kernels"])
def test_new_workloads_run_on_cpu(tmp_path, w):
    """The issue-12 workloads' and the kernels probe's code end to end on the CPU (skipped
    without torch)."""
    pytest.importorskip("torch")
    out = tmp_path / "r.jsonl"
    r = subprocess.run([sys.executable, str(BENCH / "workloads" / f"{w}.py"), "--device", "cpu", "--tiny",
                        "--steps", "3", "--warmup", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    run = next(x for x in map(json.loads, out.read_text().splitlines()) if x["kind"] == "workload")
    assert run["ok"] and len(run["step_times_s"]) == 3
    if w == "kernels":
        # --tiny: a working set of 40 MiB, 4 of them read at random, the rest in 1 MiB chunks.
        assert run["model"]["chunks"] == 36, run["model"]


def _zero3_table(tmp_path, recs):
    """bench/deepspeed/table.py's output for these records, as lines."""
    sys.path.insert(0, str(BENCH / "deepspeed"))
    import contextlib
    import io

    import table
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert table.main(str(p)) == 0
    return buf.getvalue().splitlines()


def test_zero3_table(tmp_path):
    """bench/deepspeed/table.py: losses compared with native's, ratios to the faster baseline."""
    def run(a, step, losses, ok=True):
        return {"kind": "workload", "tag": "zero3-LR", "allocator": a, "ok": ok, "median_step_s": step,
                "peak_active_bytes": 9 * GiB, "peak_reserved_bytes": (10 if a != "gmlake" else 9.1) * GiB,
                "model": {"losses": losses}}
    recs = [run("native", 0.200, [1.0, 2.0]), run("expandable", 0.100, [1.0, 2.0]),
            run("gmlake", 0.101, [1.0, 2.5]),
            {"kind": "max_batch", "allocator": "gmlake", "max_batch": 24, "search_complete": True}]
    lines = _zero3_table(tmp_path, recs)
    g = next(x for x in lines if x.startswith("| LR | gmlake"))
    assert "0.989" in g and "1.010" in g and "no (max diff 5.00e-01)" in g, g
    assert any(x.startswith("| LR | expandable") for x in lines) and "| gmlake | 24 |" in lines


def test_zero3_table_gathers_repeated_runs(tmp_path):
    """REPEAT > 1: one row per allocator with the median of its runs and their spread; the
    faster baseline counts native2's runs with native's (picking the faster of the two would be
    biased); the lowest utilization of the runs is shown."""
    def run(a, step, reserved_gib):
        return {"kind": "workload", "tag": "zero3-R", "allocator": a, "ok": True, "median_step_s": step,
                "peak_active_bytes": 9 * GiB, "peak_reserved_bytes": reserved_gib * GiB,
                "model": {"losses": [1.0, 2.0]}}
    recs = [run("native", 0.300, 12), run("gmlake", 0.110, 9.1), run("native2", 0.100, 12),
            run("native", 0.120, 12), run("gmlake", 0.100, 9.5), run("native2", 0.200, 12),
            run("gmlake", 0.500, 9.1)]
    lines = _zero3_table(tmp_path, recs)
    assert len([x for x in lines if x.startswith("| R | ")]) == 3, lines
    g = next(x for x in lines if x.startswith("| R | gmlake"))
    # Median of 110, 100, 500 ms; the baseline is the median of all four native runs, native2's
    # with native's (300, 120, 100, 200: 160 ms), not native2's 150 ms against native's 210;
    # the utilization is the worst run's (9 / 9.5).
    assert "| 3 |" in g and "110 ms (100-500)" in g and "0.688" in g and "0.947" in g, g
    n2 = next(x for x in lines if x.startswith("| R | native2"))
    assert "150 ms (100-200)" in n2 and "| 0.938 |" in n2, n2


def test_zero3_table_gives_driver_calls_and_allocator_time(tmp_path):
    """gmlake's driver calls and (with host_timing) its own time a step: medians over its runs;
    "-" where a run did not record them (baselines, or gmlake without host_timing)."""
    def run(a, step, calls=None, ms=None):
        r = {"kind": "workload", "tag": "zero3-R", "allocator": a, "ok": True, "median_step_s": step,
             "peak_active_bytes": 9 * GiB, "peak_reserved_bytes": 10 * GiB, "model": {"losses": [1.0]}}
        if calls is not None:
            r["median_driver_calls_per_step"] = calls
            r["median_vmm_calls_per_step"] = calls // 20
        if ms is not None:
            r["median_allocator_ms_per_step"] = ms
        return r
    recs = [run("native", 0.5), run("gmlake+host_timing:1", 0.6, 2400, 80.0),
            run("gmlake+host_timing:1", 0.6, 2600, 100.5), run("gmlake+host_timing:1", 0.6, 5000, 60.0),
            run("gmlake", 0.6, 3000)]
    # The slowest call of any step of any run, with its split.
    def largest(ms, slowest):
        return {"largest": {"op": "alloc", "size": 1, "ms": ms, "lock_wait_ms": 0.5, "driver_ms": ms - 1,
                            "driver_calls": 12, "slowest_driver": slowest, "slowest_driver_ms": ms - 2}}
    recs[1]["slow_calls_per_step"] = [largest(3.0, "map"), {"count": 0}, largest(628.0, "unmap")]
    recs[2]["slow_calls_per_step"] = [largest(40.0, "create_physical")]
    lines = _zero3_table(tmp_path, recs)
    assert "driver calls a step" in lines[0] and "allocator ms a step" in lines[0], lines[0]
    assert "of them VMM" in lines[0] and "slowest gmlake call" in lines[0], lines[0]
    g = next(x for x in lines if x.startswith("| R | gmlake+host_timing:1"))
    assert g.rstrip().endswith(
        "| 2,600 | 130 | 80.0 | 628.0 ms alloc (lock 0.5, driver 627.0 in 12 calls: unmap 626.0) |"), g
    plain = next(x for x in lines if x.startswith("| R | gmlake |"))
    assert plain.rstrip().endswith("| 3,000 | 150 | - | - |"), plain
    n = next(x for x in lines if x.startswith("| R | native"))
    assert n.rstrip().endswith("| - | - | - | - |"), n


def test_zero3_table_lists_profiled_steps_per_rank(tmp_path):
    """--profile-step's summaries: a row per run and rank, rank k read from the .rankK file,
    the busiest streams first; no profile table when no run was profiled."""
    def run(a, busy):
        return {"kind": "workload", "tag": "zero3-R", "allocator": a, "ok": True, "median_step_s": 0.5,
                "peak_active_bytes": GiB, "peak_reserved_bytes": GiB, "model": {"losses": [1.0]},
                "profile": {"step": 2, "wall_ms": 812.4,
                            "streams": {"7": {"ops": 900, "busy_ms": busy, "span_ms": 800.0},
                                        "13": {"ops": 40, "busy_ms": 300.0, "span_ms": 790.0}},
                            "host_calls": [["cuMemMap", 12.5, 300], ["cudaLaunchKernel", 9.0, 900]],
                            "device_ops": [["ncclAllGather", 250.0, 40]],
                            "gmlake_slow_calls": {"count": 31, "ms": 95.25, "largest_ms": 12.5}}}
    (tmp_path / "r.jsonl.rank1").write_text(json.dumps(run("gmlake", 100.0)))
    lines = _zero3_table(tmp_path, [run("gmlake", 500.0)])
    rows = [x for x in lines if x.startswith("| R | gmlake | ") and "812 ms" in x]
    assert len(rows) == 2, lines
    assert "| 0 | 2 | 812 ms | 7: 500/800 ms (900); 13: 300/790 ms (40) |" in rows[0], rows[0]
    assert "| 1 | 2 | 812 ms | 13: 300/790 ms (40); 7: 100/800 ms (900) |" in rows[1], rows[1]
    assert "cuMemMap 12.5 ms x300" in rows[0] and "ncclAllGather 250.0 ms x40" in rows[0], rows[0]
    assert rows[0].endswith("| 31, 95.2 ms (largest 12.5) |"), rows[0]
    other = tmp_path / "plain"
    other.mkdir()
    plain = _zero3_table(other, [dict(run("gmlake", 1.0), profile=None)])
    assert not any("profiled step" in x for x in plain), plain


def test_zero3_run_names_a_bad_repeat(tmp_path):
    r = subprocess.run(["bash", str(BENCH / "deepspeed" / "run.sh"), "/nonexistent/libgmlake_torch.so"],
                       env=dict(os.environ, REPEAT="0", OUT=str(tmp_path)), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "REPEAT must be a positive integer, got '0'" in r.stdout, r.stdout + r.stderr


def _gpu_check():
    sys.path.insert(0, str(BENCH))
    import gpu_check
    return gpu_check


def test_gpu_check_sets_the_replay_against_the_gpu(tmp_path, capsys):
    """bench/gpu_check.py with a stand-in gmlake: errors computed against the GPU's figures,
    exit 1 past the tolerance, 2 on bad input (named)."""
    gc = _gpu_check()
    fake = tmp_path / "gmlake"
    row = {"events": 10, "peak_reserved_bytes": 103 * MiB, "utilization": 0.95,
           "native_peak_reserved_bytes": 150 * MiB, "driver_calls": {"total": 90}}
    fake.write_text("#!/bin/sh\necho '" + json.dumps(row) + "'\n")
    fake.chmod(0o755)
    trace = tmp_path / "job.pickle.gz"
    trace.write_bytes(b"")
    gpu = {"runs": {"gmlake": {"peak_reserved_bytes": 100 * MiB, "utilization": 0.98,
                               "driver_calls": {"total": 100}},
                    "native": {"peak_reserved_bytes": 150 * MiB}}}
    (tmp_path / "job.gpu.json").write_text(json.dumps(gpu))
    assert gc.main([str(trace), "--gmlake", str(fake), "--tolerance", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "(+3.0%)" in out and "0.980 / 0.950" in out and "100 / 90 (-10.0%)" in out, out
    assert gc.main([str(trace), "--gmlake", str(fake)]) == 1   # 3% > the default 2%
    assert "off by more than 2.0%" in capsys.readouterr().err
    # A results .jsonl from bench/workloads works as the GPU side too.
    res = tmp_path / "runs.jsonl"
    res.write_text("\n".join(json.dumps(dict(r, allocator=a, kind="workload", ok=True))
                             for a, r in gpu["runs"].items()))
    assert gc.main([f"{trace}={res}", "--gmlake", str(fake), "--tolerance", "0.05"]) == 0
    capsys.readouterr()
    # ...and `#TAG` picks one job of a file holding several (run.sh's strategies).
    other = dict(gpu["runs"]["gmlake"], peak_reserved_bytes=50 * MiB)
    res.write_text("\n".join([json.dumps(dict(r, allocator=a, kind="workload", ok=True, tag="zero3-LR"))
                              for a, r in gpu["runs"].items()]
                             + [json.dumps(dict(other, allocator="gmlake", kind="workload", ok=True,
                                                tag="zero3-N"))]))
    assert gc.main([f"{trace}={res}#zero3-LR", "--gmlake", str(fake), "--tolerance", "0.05"]) == 0
    assert "(+3.0%)" in capsys.readouterr().out
    assert gc.main([f"{trace}={res}#zero3-N", "--gmlake", str(fake), "--tolerance", "0.05"]) == 1
    capsys.readouterr()
    assert gc.main([f"{trace}={res}#zero3-R", "--gmlake", str(fake)]) == 2
    assert "no successful run tagged 'zero3-R'" in capsys.readouterr().err
    # A gmlake run with host_timing:1 (run.sh's `gmlake+host_timing:1`) is gmlake's when there
    # is no plain one, and a plain one comes first.
    timed = dict(gpu["runs"]["gmlake"], allocator="gmlake+host_timing:1", kind="workload", ok=True)
    res.write_text("\n".join([json.dumps(dict(gpu["runs"]["native"], allocator="native",
                                               kind="workload", ok=True)), json.dumps(timed)]))
    assert gc.main([f"{trace}={res}", "--gmlake", str(fake), "--tolerance", "0.05"]) == 0
    assert "(+3.0%)" in capsys.readouterr().out
    res.write_text("\n".join([json.dumps(timed), json.dumps(dict(other, allocator="gmlake",
                                                                 kind="workload", ok=True))]))
    assert gc.main([f"{trace}={res}", "--gmlake", str(fake), "--tolerance", "0.05"]) == 1
    capsys.readouterr()
    # Bad input: no gmlake run, unreadable figures, a bad tolerance.
    (tmp_path / "nog.gpu.json").write_text(json.dumps({"runs": {"native": {}}}))
    (tmp_path / "nog.pickle").write_bytes(b"")
    assert gc.main([str(tmp_path / "nog.pickle"), "--gmlake", str(fake)]) == 2
    assert "no gmlake run (allocators there: native)" in capsys.readouterr().err
    assert gc.main([f"{trace}={tmp_path / 'missing.gpu.json'}", "--gmlake", str(fake)]) == 2
    assert "cannot read the GPU figures" in capsys.readouterr().err
    assert gc.main([str(trace), "--gmlake", str(fake), "--tolerance", "2"]) == 2
    (tmp_path / "nores.gpu.json").write_text(json.dumps({"runs": {"gmlake": {"utilization": 0.9}}}))
    (tmp_path / "nores.pickle").write_bytes(b"")
    assert gc.main([str(tmp_path / "nores.pickle"), "--gmlake", str(fake)]) == 2
    assert "the gmlake run has no peak_reserved_bytes" in capsys.readouterr().err


def test_gpu_check_on_the_bundled_fsdp_trace(capsys):
    """The real replay of tests/traces/fsdp-offload.pickle.gz predicts the H100's peak reserved
    within 2% (the binary is built by cargo test before these tests run)."""
    gc = _gpu_check()
    try:
        gc.find_gmlake(None)
    except gc.BadInput as e:
        pytest.skip(str(e))
    trace = BENCH.parent / "tests" / "traces" / "fsdp-offload.pickle.gz"
    assert gc.main([str(trace), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.splitlines()[0])
    assert r["within_tolerance"] and abs(r["reserved_diff"]) <= 0.02, r


def test_the_allocators_own_time_is_shown_when_recorded():
    recs = synthetic()
    for r in recs:
        if r.get("kind") == "workload" and r["workload"] == "moe" and r["allocator"] == "gmlake":
            r["allocator_ms_per_step"] = [1.2, 1.5, 1.4]
            r["median_allocator_ms_per_step"] = 1.4
    md = "\n".join(report.workload_lines(report.Results(recs)))
    moe = md.split("### moe")[1].split("###")[0]
    assert "allocator 1.40 ms a step (median, host_timing)" in moe
    assert md.count("ms a step (median, host_timing)") == 1, "only where it was recorded"


def test_ops_gpu_refuses_missing_inputs_and_prints_its_table(tmp_path):
    """bench/ops-gpu.sh: usage without arguments, a missing library named, and its table read
    from latency --ops records (the part that runs after the GPU work)."""
    r = subprocess.run(["bash", str(BENCH / "ops-gpu.sh")], capture_output=True, text=True)
    assert r.returncode == 2 and "--prepare" in r.stderr
    r = subprocess.run(["bash", str(BENCH / "ops-gpu.sh"), str(tmp_path), str(tmp_path / "no.so")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no library at" in r.stderr
    (tmp_path / "a.so").write_bytes(b"")
    r = subprocess.run(["bash", str(BENCH / "ops-gpu.sh"), str(tmp_path), str(tmp_path / "a.so")],
                       capture_output=True, text=True,
                       env=dict(os.environ, OPS_LIB_B=str(tmp_path / "b.so")))
    assert r.returncode == 2 and "OPS_LIB_B" in r.stderr
    script = (BENCH / "ops-gpu.sh").read_text()
    table = script.split("python3 - \"$O/ops.jsonl\" <<'PY'\n")[1].split("\nPY\n")[0]
    recs = [
        {"kind": "latency", "test": "ops", "ops_file": "moe.ops", "allocator": "native",
         "ns_per_op": 500.0, "utilization": 0.67, "repeat_ns_per_op": [450.0], "repeat_driver_calls": -1},
        {"kind": "latency", "test": "ops", "ops_file": "moe.ops", "allocator": "gmlake",
         "ns_per_op": 800.0, "utilization": 0.92, "repeat_ns_per_op": [900.0], "repeat_driver_calls": 195,
         "calls_timed.map": 3, "calls_timed.set_access": 2, "calls_timed.record_event": 7,
         "counters_timed.pages_stitched": 3},
        {"kind": "latency", "test": "ops", "ops_file": "moe.ops", "allocator": "gmlake-b",
         "ns_per_op": 700.0, "utilization": 0.92, "repeat_ns_per_op": [], "repeat_driver_calls": -1,
         "calls_timed.map": 1},
        {"kind": "latency", "test": "mixed", "allocator": "native"},
    ]
    p = tmp_path / "ops.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = subprocess.run([sys.executable, "-c", table, str(p)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert rows[0][:4] == ["moe", "native", "500", "-"]
    # Driver calls: the mapping kinds only (events are not counted), and the repeat's calls.
    assert rows[1][:4] == ["moe", "gmlake", "800", "5"] and rows[1][-1] == "(195)"
    # A second library's runs (OPS_LIB_B) are read as gmlake's, under their own label.
    assert rows[2][:4] == ["moe", "gmlake-b", "700", "1"]
    assert len(rows) == 3


def _common():
    sys.path.insert(0, str(BENCH / "workloads"))
    import common
    return common


def test_profile_summary_of_a_trace():
    """--profile-step's summary: per stream the union of its device operations and their
    span; host runtime and driver calls by total time; other events ignored."""
    common = _common()

    def x(cat, name, ts, dur, stream=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
        if stream is not None:
            e["args"] = {"stream": stream}
        return e
    trace = {"traceEvents": [
        x("kernel", "gemm", 0, 100, 7), x("kernel", "add", 50, 100, 7),    # overlap: 150 us busy
        x("gpu_memcpy", "HtoD", 400, 100, 7),                            # + 100 us
        x("kernel", "nccl", 0, 1000, 13),
        x("cuda_runtime", "cudaLaunchKernel", 0, 5, None), x("cuda_runtime", "cudaLaunchKernel", 10, 5, None),
        x("cuda_driver", "cuMemMap", 20, 30, None),
        x("cpu_op", "aten::mm", 0, 999, None),
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3},
    ]}
    s = common.profile_summary(trace)
    assert s["streams"]["7"] == {"ops": 3, "busy_ms": 0.25, "span_ms": 0.5}, s
    assert s["streams"]["13"] == {"ops": 1, "busy_ms": 1.0, "span_ms": 1.0}, s
    assert s["host_calls"] == [["cuMemMap", 0.03, 1], ["cudaLaunchKernel", 0.01, 2]], s
    assert s["device_ops"][0] == ["nccl", 1.0, 1] and ["add", 0.1, 1] in s["device_ops"], s
    assert s["device_ms"] == 1.3, s
    assert common.profile_summary({}) == {"streams": {}, "host_calls": [], "device_ops": [],
                                          "device_ms": 0}


def test_trace_path_names_each_run(tmp_path):
    """Runs that append to one results file keep their own traces: named by label, numbered
    when the label ran before, the label made safe for a file name."""
    sys.path.insert(0, str(BENCH / "workloads"))
    import common
    out = str(tmp_path / "r.jsonl")
    first = common.trace_path(out, "gmlake+host_timing:1,cross_stream_wait:0", 2)
    assert first == out + ".gmlake_host_timing_1_cross_stream_wait_0.step2.trace.json.gz", first
    Path(first).write_text("x")
    again = common.trace_path(out, "gmlake+host_timing:1,cross_stream_wait:0", 2)
    assert again != first and again.endswith("-2.step2.trace.json.gz"), again
    assert common.trace_path(out, "", 0) == out + ".step0.trace.json.gz"


def test_slow_calls_go_on_the_timeline():
    """gmlake's slow calls (snapshot()["slow_calls"], Unix ns) are filtered to the profiled
    step and placed on the chrome trace, whose ts is microseconds after baseTimeNanoseconds."""
    sys.path.insert(0, str(BENCH / "workloads"))
    import common
    base = 1_790_000_000_000_000_000
    snap = {"slow_calls": [
        {"start_unix_ns": base + 5_000_000, "ns": 120_000, "op": "alloc", "size": 3 << 20},
        {"start_unix_ns": base + 9_000_000, "ns": 60_000, "op": "free", "size": 0},
        {"start_unix_ns": base + 90_000_000, "ns": 70_000, "op": "alloc", "size": 1 << 20},
    ]}
    calls = common.slow_calls_between(snap, base + 1_000_000, base + 10_000_000)
    assert [c["op"] for c in calls] == ["alloc", "free"]
    trace = {"baseTimeNanoseconds": base, "traceEvents": [{"ph": "X", "ts": 1.0, "dur": 2.0}]}
    assert common.add_slow_calls(trace, calls, pid=42) == 2
    added = [e for e in trace["traceEvents"] if e.get("cat") == "gmlake"]
    assert [(e["name"], e["ts"], e["dur"]) for e in added] == [
        ("gmlake alloc 3 MiB", 5000.0, 120.0), ("gmlake free", 9000.0, 60.0)]
    assert all(e["pid"] == 42 and e["tid"] == common.SLOW_CALLS_TID for e in added)
    assert common.add_slow_calls({"traceEvents": []}, calls, pid=42) == 0, "no base time"
    # Snapshots from before the split (no lock_wait_ns, driver_ns, ...) still sum up.
    old = common.slow_calls_summary(calls)
    assert {k: old[k] for k in ("count", "ms", "largest_ms", "lock_wait_ms", "driver_ms")} == {
        "count": 2, "ms": 0.18, "largest_ms": 0.12, "lock_wait_ms": 0, "driver_ms": 0}
    assert old["largest"]["op"] == "alloc" and old["largest"]["slowest_driver"] == ""
    assert common.slow_calls_summary([]) == {"count": 0, "ms": 0, "largest_ms": 0,
                                             "lock_wait_ms": 0, "driver_ms": 0}
    # Where the time went: lock waits and driver time summed, the largest call split.
    split = [dict(calls[0], lock_wait_ns=1_000, driver_ns=100_000, driver_calls=6,
                  slowest_driver="unmap", slowest_driver_ns=90_000),
             dict(calls[1], lock_wait_ns=50_000, driver_ns=0, driver_calls=0,
                  slowest_driver="", slowest_driver_ns=0)]
    assert common.slow_calls_summary(split) == {
        "count": 2, "ms": 0.18, "largest_ms": 0.12, "lock_wait_ms": 0.051, "driver_ms": 0.1,
        "largest": {"op": "alloc", "size": 3 << 20, "ms": 0.12, "lock_wait_ms": 0.001,
                    "driver_ms": 0.1, "driver_calls": 6, "slowest_driver": "unmap",
                    "slowest_driver_ms": 0.09}}
    # A run's steps, each with its own slow calls, read from one snapshot; none without
    # host_timing, or where gmlake is not there.
    import types
    fake = types.ModuleType("gmlake")
    fake.snapshot = lambda device: dict(snap, config={"host_timing": "1"})
    saved = sys.modules.get("gmlake")
    sys.modules["gmlake"] = fake
    try:
        steps = common.slow_calls_per_step("cuda", [(base, base + 10_000_000),
                                                    (base + 10_000_000, base + 100_000_000)])
        assert [x["count"] for x in steps] == [2, 1] and steps[1]["largest_ms"] == 0.07, steps
        fake.snapshot = lambda device: dict(snap, config={"host_timing": "0"})
        assert common.slow_calls_per_step("cuda", [(base, base + 1)]) is None
        def broken(device):
            raise RuntimeError("gmlake is not enabled in this process")
        fake.snapshot = broken
        assert common.slow_calls_per_step("cuda", [(base, base + 1)]) is None
    finally:
        if saved is None:
            del sys.modules["gmlake"]
        else:
            sys.modules["gmlake"] = saved
    # Only a snapshot taken with host_timing:1 has recorded them.
    assert common.records_slow_calls({"config": {"host_timing": "1"}})
    assert not common.records_slow_calls({"config": {"host_timing": "0"}})
    assert not common.records_slow_calls({})


def test_profile_step_on_cpu(tmp_path):
    """--profile-step end to end on the CPU (skipped without torch): the step is profiled,
    summed up in the record, its trace written beside --out, and left out of the timings."""
    pytest.importorskip("torch")
    out = tmp_path / "r.jsonl"
    r = subprocess.run([sys.executable, str(BENCH / "workloads" / "concat_cache.py"), "--device", "cpu",
                        "--tiny", "--steps", "3", "--warmup", "1", "--profile-step", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    run = next(x for x in map(json.loads, out.read_text().splitlines()) if x["kind"] == "workload")
    assert run["ok"] and len(run["step_times_s"]) == 2, run.get("step_times_s")
    p = run["profile"]
    assert p["step"] == 1 and p["wall_ms"] > 0 and p["streams"] == {}, p
    assert Path(p["trace"]).exists() and p["trace"].endswith(".step1.trace.json.gz")


def _two_steps(monkeypatch, counts, **outs):
    """run_steps over two no-op steps, gmlake's statistics read before and after each from
    `counts` (four dicts); returns the step times."""
    sys.path.insert(0, str(BENCH / "workloads"))
    import types

    import common
    counts = iter(counts)
    monkeypatch.setattr(common, "driver_calls_by_kind", lambda: next(counts))
    monkeypatch.setattr(common, "sync", lambda device: None)

    class Wl:
        def step(self, batch, shape):
            pass
    args = types.SimpleNamespace(fake_oom_above=0, profile_step=-1)
    return common.run_steps(args, Wl(), 1, [None, None], "cpu", 0, **outs)


def test_run_steps_splits_vmm_calls_from_event_calls(monkeypatch):
    """run_steps records, step by step, the VMM calls among gmlake's driver calls (what gmlake
    adds to a job; events are what native's allocator makes too)."""
    calls, kinds, vmm = [], {}, []
    times = _two_steps(monkeypatch, [
        {"total": 10, "map": 2, "unmap": 1, "query_event": 7},    # before step 1
        {"total": 30, "map": 6, "unmap": 1, "query_event": 23},   # after step 1: 4 VMM of 20
        {"total": 30, "map": 6, "unmap": 1, "query_event": 23},   # before step 2
        {"total": 35, "map": 6, "unmap": 1, "set_access": 0, "record_event": 5,
         "query_event": 23},                                       # after step 2: 0 of 5
    ], calls_out=calls, kinds_out=kinds, vmm_out=vmm)
    import common  # on the path since _two_steps
    assert len(times) == 2 and calls == [20, 5] and vmm == [4, 0]
    assert common.vmm_calls(kinds) == 4 and kinds["record_event"] == 5


def test_run_steps_records_the_measured_driver_time_of_each_step(monkeypatch):
    """run_steps turns gmlake.driver_ns (the host time of the driver calls, every call timed)
    into milliseconds a step, and keeps it out of the calls by kind."""
    calls, kinds, driver_ms = [], {}, []
    _two_steps(monkeypatch, [
        {"total": 10, "map": 2, "driver_ns": 1_000_000},            # before step 1
        {"total": 30, "map": 22, "driver_ns": 4_500_000},           # after: 3.5 ms
        {"total": 30, "map": 22, "driver_ns": 4_500_000},           # before step 2
        {"total": 30, "map": 22, "driver_ns": 4_500_000},           # after: none
    ], calls_out=calls, kinds_out=kinds, driver_ms_out=driver_ms)
    assert driver_ms == [3.5, 0.0] and calls == [20, 0]
    assert "driver_ns" not in kinds and kinds["map"] == 20


def test_zero3_table_shows_the_machine_checks(tmp_path):
    """run.sh's machine checks (machine.jsonl beside the results) get a table of their own:
    the host's loop time, the load and the slowest and fastest GPU; none without the file."""
    recs = [{"kind": "workload", "tag": "zero3-N", "allocator": "native", "ok": True, "median_step_s": 0.5,
             "peak_active_bytes": GiB, "peak_reserved_bytes": 2 * GiB, "model": {"losses": [1.0]}}]
    lines = _zero3_table(tmp_path, recs)
    assert not any("machine check" in x for x in lines), lines
    checks = [{"kind": "machine_check", "time": "2026-11-27T16:20:00", "host_loop_ms": 94.2,
               "load_avg_1m": 0.5, "gpu_bf16_tflops": [780.1, 612.0, 779.5, 781.0]},
              {"kind": "machine_check", "time": "2026-11-27T16:30:00", "host_loop_ms": 230.0,
               "load_avg_1m": 3.25, "gpu_bf16_tflops": []}]
    (tmp_path / "machine.jsonl").write_text("\n".join(json.dumps(c) for c in checks))
    lines = _zero3_table(tmp_path, recs)
    assert "| 2026-11-27T16:20:00 | 94.2 | 0.50 | 612-781 (4 GPUs) |" in lines, lines
    assert "| 2026-11-27T16:30:00 | 230.0 | 3.25 | - |" in lines, lines


def test_decision_label_drops_host_timing_only():
    """host_timing:1 changes no decision, so runs with it join those without; other settings
    keep their own label."""
    assert report.decision_label("native2") == "native"
    assert report.decision_label("gmlake+host_timing:1") == "gmlake"
    assert report.decision_label("gmlake+reuse_fenced_blocks:1,host_timing:1") == \
        "gmlake+reuse_fenced_blocks:1"
    assert report.decision_label("gmlake+host_timing:1,page_size:8MiB") == "gmlake+page_size:8MiB"
    assert report.decision_label("gmlake+host_timing:0") == "gmlake+host_timing:0"
    assert report.decision_label("expandable") == "expandable"


def test_zero3_table_compares_round_by_round(tmp_path):
    """Run k of gmlake against run k of the baselines in the same results file, the faster of
    them, in rounds where every baseline of the strategy ran: the geometric mean of the ratios,
    their range and count. A round without expandable segments (file b) is left out."""
    sys.path.insert(0, str(BENCH / "deepspeed"))
    import contextlib
    import io

    import table

    def run(a, s):
        return {"kind": "workload", "tag": "zero3-LR", "allocator": a, "ok": True,
                "median_step_s": s, "step_times_s": [s], "peak_active_bytes": 9 * GiB,
                "peak_reserved_bytes": 10 * GiB, "model": {"losses": [1.0]}}
    first = [run("native", 1.0), run("expandable", 1.2), run("gmlake", 0.9),
             run("native", 2.0), run("expandable", 2.1), run("gmlake", 2.2)]
    second = [run("native", 1.5), run("gmlake", 1.0)]
    p1, p2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    p1.write_text("\n".join(json.dumps(r) for r in first))
    p2.write_text("\n".join(json.dumps(r) for r in second))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert table.main(str(p1), str(p2)) == 0
    lines = buf.getvalue().splitlines()
    assert "round by round" in lines[0], lines[0]
    g = next(x for x in lines if x.startswith("| LR | gmlake |"))
    # 0.9 / 1.0 and 2.2 / 2.0: geometric mean sqrt(0.99) = 0.995.
    assert "0.995 (0.900-1.100, 2)" in g, g
    n = next(x for x in lines if x.startswith("| LR | native |"))
    assert "(0." not in n, n  # baselines get no round-by-round figure


def test_zero3_table_rounds_measure_against_the_native_runs_not_the_faster_one(tmp_path):
    """With native2 in the rounds, each gmlake run is measured against the geometric mean of
    its round's native runs, and the faster baseline is picked after pooling: the faster run of
    each round would read gmlake 1.087 here, where it runs as native's runs do."""
    sys.path.insert(0, str(BENCH / "deepspeed"))
    import contextlib
    import io

    import table

    def run(a, s):
        return {"kind": "workload", "tag": "zero3-LR", "allocator": a, "ok": True,
                "median_step_s": s, "step_times_s": [s], "peak_active_bytes": 9 * GiB,
                "peak_reserved_bytes": 10 * GiB, "model": {"losses": [1.0]}}
    recs = [run("native", 1.0), run("native2", 0.8), run("expandable", 1.2), run("gmlake", 0.9),
            run("native", 2.0), run("native2", 2.2), run("expandable", 2.1), run("gmlake", 2.1)]
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert table.main(str(p)) == 0
    g = next(x for x in buf.getvalue().splitlines() if x.startswith("| LR | gmlake |"))
    # 0.9 / sqrt(1.0 * 0.8) = 1.006 and 2.1 / sqrt(2.0 * 2.2) = 1.001; expandable pools to
    # 1.159, so native (1 by construction) is the faster baseline.
    assert "1.004 (1.001-1.006, 2)" in g, g


def test_zero3_table_pools_steps_and_merges_runs(tmp_path):
    """The median of every measured step beside the median of the runs' medians (one slow run
    moves the first by one step, the second by the whole run); with --merge, native2's runs join
    native's and gmlake+host_timing:1's join gmlake's (other gmlake settings stay apart); several
    calls' result files read as one."""
    sys.path.insert(0, str(BENCH / "deepspeed"))
    import contextlib
    import io

    import table

    def run(a, steps):
        return {"kind": "workload", "tag": "zero3-LR", "allocator": a, "ok": True,
                "median_step_s": sorted(steps)[len(steps) // 2], "step_times_s": steps,
                "peak_active_bytes": 9 * GiB, "peak_reserved_bytes": 10 * GiB, "model": {"losses": [1.0]}}
    first = [run("native", [1.0, 1.0, 1.0]), run("gmlake+host_timing:1", [1.1, 1.1, 1.1])]
    second = [run("native2", [2.0, 2.0, 2.0]), run("gmlake", [1.1, 1.1, 3.0]),
              run("gmlake+page_size:8MiB", [0.5, 0.5, 0.5])]
    p1, p2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    p1.write_text("\n".join(json.dumps(r) for r in first))
    p2.write_text("\n".join(json.dumps(r) for r in second))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert table.main(str(p1), str(p2), merge=True) == 0
    lines = buf.getvalue().splitlines()
    assert "median of all steps (steps)" in lines[0], lines[0]
    rows = [x for x in lines if x.startswith("| LR | ")]
    assert len(rows) == 3, rows  # native (2 runs), gmlake (2 runs), gmlake+page_size:8MiB
    n = next(x for x in rows if x.startswith("| LR | native |"))
    # Runs' medians 1.0 and 2.0: their median 1.5 s; all six steps' median 1.5 s too.
    assert "| 2 |" in n and "1500 ms (1000-2000)" in n and "1500 ms (6)" in n, n
    g = next(x for x in rows if x.startswith("| LR | gmlake |"))
    # Runs' medians 1.1 and 1.1; all steps 1.1 (x5) and 3.0: 1.1 s, 0.733 of native's 1.5 s.
    assert "| 2 |" in g and "1100 ms (1100-1100)" in g and "1100 ms (6)" in g, g
    assert g.count("0.733") == 2, g
    assert any(x.startswith("| LR | gmlake+page_size:8MiB |") for x in rows), rows
    # Without --merge each label keeps its row.
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert table.main(str(p1), str(p2)) == 0
    assert len([x for x in buf.getvalue().splitlines() if x.startswith("| LR | ")]) == 5


def test_paired_step_ratios_compare_each_step_with_the_same_step():
    """Step i is the same seeded work in every run: the paired ratio is the median of the
    step-by-step ratios to the faster baseline, where a run's median step would compare
    different steps (here gmlake's median step is 1.49x the faster baseline's median step,
    while all its steps but one are 1.1x the faster baseline's same step)."""
    shapes = [{"tokens": t} for t in (100, 400, 200, 800, 300)]
    native = [0.10, 0.40, 0.20, 0.80, 0.30]
    expandable = [0.12, 0.38, 0.22, 0.84, 0.28]
    best = [min(a, b) for a, b in zip(native, expandable)]
    gmlake = [1.1 * x for x in best]
    gmlake[2] = 0.45  # one step (of the median's size) much slower
    recs = [{"kind": "env", "gpu": "FAKE", "driver": "1", "torch": "2.11.0", "date": "today"}]
    for a, st in (("native", native), ("expandable", expandable), ("gmlake", gmlake),
                  ("native2", native[:4])):
        recs.append({"kind": "workload", "workload": "moe", "allocator": a, "ok": True, "steps": len(st),
                     "warmup": 1, "median_step_s": sorted(st)[len(st) // 2], "step_times_s": st,
                     "shapes": shapes[:len(st)], "peak_active_bytes": GiB, "peak_reserved_bytes": GiB,
                     "utilization": 1.0})
    res = report.Results(recs)
    paired = report.paired_step_ratios(res, "moe")
    assert abs(paired["gmlake"] - 1.1) < 1e-9, paired
    assert abs(paired["native"] - 1.0) < 1e-9 and paired["expandable"] >= 1.0, paired
    # A run of other steps (fewer here) is not paired; the plain ratio still shows.
    assert paired["native2"] is None
    assert abs(report.step_ratios(res, "moe")["gmlake"] - sorted(gmlake)[2] / 0.28) < 1e-9
    line = next(x for x in report.summary(res).splitlines() if x.startswith("moe") and " gmlake " in x)
    assert line.endswith("paired 1.100"), line
    md = "\n".join(report.workload_lines(res))
    assert "(paired 1.100×)" in md, md
    # Other shapes in a baseline: nothing is paired.
    recs[2] = dict(recs[2], shapes=[{"tokens": 1}] * 5)
    assert all(v is None for v in report.paired_step_ratios(report.Results(recs), "moe").values())


def test_paired_step_ratios_pick_the_faster_baseline_after_the_median():
    """Native and expandable segments take turns being faster, step by step, by the same
    factor, and gmlake runs exactly as native: the faster baseline of each step would read
    gmlake 1.25 in half the steps (median 1.125 here); against native, then over the faster
    baseline's median, it reads 1.000, as native does."""
    shapes = [{"tokens": t} for t in (100, 200, 300, 400)]
    native = [0.10, 0.20, 0.30, 0.40]
    expandable = [x * f for x, f in zip(native, (0.8, 1.25, 0.8, 1.25))]
    recs = [{"kind": "env", "gpu": "FAKE", "driver": "1", "torch": "2.11.0", "date": "today"}]
    for a, st in (("native", native), ("expandable", expandable), ("gmlake", list(native))):
        recs.append({"kind": "workload", "workload": "moe", "allocator": a, "ok": True, "steps": 4,
                     "warmup": 1, "median_step_s": statistics.median(st), "step_times_s": st,
                     "shapes": shapes, "peak_active_bytes": GiB, "peak_reserved_bytes": GiB,
                     "utilization": 1.0})
    paired = report.paired_step_ratios(report.Results(recs), "moe")
    assert abs(paired["gmlake"] - 1.0) < 1e-9 and abs(paired["native"] - 1.0) < 1e-9, paired
    assert abs(paired["expandable"] - (0.8 + 1.25) / 2) < 1e-9, paired  # median of 4 ratios
    per_step_min = statistics.median(g / min(n, e) for g, n, e in zip(native, native, expandable))
    assert abs(per_step_min - 1.125) < 1e-9


def _rounds_records(gmlake_by_round, native2_by_round=None, expandable_by_round=None):
    """A moe workload run in rounds: native's steps scale by a per-round host speed; the
    others' are their round's native steps times the given ratios (expandable 1.5 unless
    given)."""
    shapes = [{"tokens": t} for t in (100, 400, 200, 300)]
    recs = [{"kind": "env", "gpu": "FAKE", "driver": "1", "torch": "2.11.0", "date": "today"}]
    speeds = (1.0, 1.3, 0.8, 1.1)
    for rnd, g in enumerate(gmlake_by_round, 1):
        native = [speeds[rnd - 1] * x for x in (0.10, 0.40, 0.20, 0.30)]
        e = expandable_by_round[rnd - 1] if expandable_by_round else 1.5
        runs = [("native", native), ("expandable", [e * x for x in native])]
        if g is not None:
            runs.append(("gmlake", [g * x for x in native]))
        if native2_by_round:
            runs.append(("native2", [native2_by_round[rnd - 1] * x for x in native]))
        for a, st in runs:
            recs.append({"kind": "workload", "workload": "moe", "allocator": a, "ok": True, "round": rnd,
                         "steps": 4, "warmup": 1, "median_step_s": statistics.median(st), "step_times_s": st,
                         "shapes": shapes, "peak_active_bytes": GiB, "peak_reserved_bytes": GiB,
                         "utilization": 1.0})
    return recs


def test_rounds_are_kept_apart_and_pooled():
    """Runs in rounds (BENCH_ROUNDS) are compared with the reference baseline's run of their
    round and the ratios pooled by geometric mean: the host speed that moves every run of a
    round (here 0.8-1.3x) leaves the pooled ratio alone, while the last record alone would
    read only round 3."""
    res = report.Results(_rounds_records([0.9, 1.0, 1.2], native2_by_round=[1.1, 0.95, 1.0]))
    assert res.rounds("moe") == [1, 2, 3]
    assert res.run("moe", "gmlake")["round"] == 3 and res.run("moe", "gmlake", 1)["round"] == 1
    pooled = report.round_step_ratios(res, "moe")
    g, lo, hi, n, ref = pooled["gmlake"]
    assert abs(g - (0.9 * 1.0 * 1.2) ** (1 / 3)) < 1e-9 and (lo, hi, n, ref) == (0.9, 1.2, 3, "native"), pooled
    assert abs(pooled["native2"][0] - (1.1 * 0.95 * 1.0) ** (1 / 3)) < 1e-9
    assert abs(pooled["native"][0] - 1.0) < 1e-9 and abs(pooled["expandable"][0] - 1.5) < 1e-9
    line = next(x for x in report.summary(res).splitlines() if x.startswith("moe") and " gmlake " in x)
    assert "paired 1.200" in line and "3 rounds: 1.026 (native's 0.900-1.200)" in line, line
    md = "\n".join(report.workload_lines(res))
    assert "Rows: round 3 of 3" in md and "3 rounds: 1.026 (native's 0.900-1.200)" in md, md
    # The target reads the pooled ratio, not round 3's 1.2.
    target = next(x for x in report.targets_lines(res) if "median step time" in x)
    assert "worst 1.026×" in target, target


def test_rounds_pick_the_faster_baseline_after_pooling():
    """Expandable faster than native in alternate rounds by the same factor, gmlake exactly
    native: picking the faster baseline round by round would read gmlake 1.12 (and native
    itself 1.12); pooled first, both baselines are even and gmlake reads 1.000. Where the
    expandable runs are faster over the rounds, they are the measure."""
    swing = [0.8, 1.25, 0.8, 1.25]
    res = report.Results(_rounds_records([1.0] * 4, expandable_by_round=swing))
    pooled = report.round_step_ratios(res, "moe")
    assert abs(pooled["gmlake"][0] - 1.0) < 1e-9 and abs(pooled["native"][0] - 1.0) < 1e-9, pooled
    per_round_min = [report.step_ratios(res, "moe", x)["gmlake"] for x in (1, 2, 3, 4)]
    assert abs(statistics.median(per_round_min) - 1.125) < 1e-9, per_round_min
    res = report.Results(_rounds_records([1.0] * 3, expandable_by_round=[0.9, 0.9, 0.9]))
    pooled = report.round_step_ratios(res, "moe")
    assert abs(pooled["gmlake"][0] - 1 / 0.9) < 1e-9 and abs(pooled["expandable"][0] - 1.0) < 1e-9, pooled


def test_rounds_without_a_run_are_left_out_and_one_round_is_no_pool():
    """A round where gmlake has no run is left out of its pool; with one round left there is
    no pooled ratio (and without rounds, none either)."""
    res = report.Results(_rounds_records([0.9, None, 1.2]))
    g, lo, hi, n, _ = report.round_step_ratios(res, "moe")["gmlake"]
    assert n == 2 and abs(g - (0.9 * 1.2) ** 0.5) < 1e-9
    assert report.round_step_ratios(report.Results(_rounds_records([None, None, 1.2])), "moe")["gmlake"] is None
    plain = [dict(r) for r in _rounds_records([0.9]) if r.get("kind") == "env" or r.get("round") == 1]
    for r in plain:
        r.pop("round", None)
    res = report.Results(plain)
    assert res.rounds("moe") == [None] and report.round_step_ratios(res, "moe")["gmlake"] is None
    assert abs(report.step_ratios(res, "moe")["gmlake"] - 0.9) < 1e-9


def test_run_gpu_runs_rounds_in_order_and_searches_once(tmp_path):
    """run-gpu.sh with BENCH_ROUNDS=2: each workload runs its allocators in order, then again
    with the order rotated by one, passing --round; the largest-batch search runs in the
    first round only. A python stand-in
    records the workload processes' arguments (no GPU needed). A bad BENCH_ROUNDS is named."""
    log = tmp_path / "argv.log"
    fake = tmp_path / "py"
    # gmlake's run of moe's second round fails: its record names the round.
    fake.write_text("#!/bin/bash\n"
                    "case \"$*\" in *bench/workloads/*) echo \"$*\" >> " + str(log) + ";\n"
                    "  case \"$*\" in *'-m gmlake'*moe.py*'--round 2'*) exit 1;; esac; exit 0;; esac\n"
                    "exec " + sys.executable + " \"$@\"\n")
    fake.chmod(0o755)
    lib = tmp_path / "libgmlake_torch.so"
    lib.write_text("")
    env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / "out"), BENCH_NO_LATENCY="1",
               BENCH_WORKLOADS="moe conv", BENCH_ALLOCATORS="native gmlake", BENCH_ROUNDS="2",
               BENCH_BUDGET_S="600")
    r = subprocess.run(["bash", str(BENCH / "run-gpu.sh"), str(lib)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    runs = log.read_text().splitlines()
    got = [(x.split("bench/workloads/")[1].split(".py")[0], "gmlake" if "-m gmlake" in x else "native",
            x.split("--round ")[1].split()[0], "--search " in x) for x in runs]
    assert got == [("moe", "native", "1", True), ("moe", "gmlake", "1", True),
                   ("moe", "gmlake", "2", False), ("moe", "native", "2", False),
                   ("conv", "native", "1", True), ("conv", "gmlake", "1", True),
                   ("conv", "gmlake", "2", False), ("conv", "native", "2", False)], runs
    failed = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()
              if '"failed"' in x]
    assert [(f["workload"], f["allocator"], f["round"], f["rc"]) for f in failed] == [("moe", "gmlake", 2, 1)]
    line = next(x for x in (tmp_path / "out" / "summary.txt").read_text().splitlines()
                if x.startswith("moe") and " gmlake " in x)
    assert line.endswith("round 2: failed (exit 1)"), line
    bad = subprocess.run(["bash", str(BENCH / "run-gpu.sh"), str(lib)], env=dict(env, BENCH_ROUNDS="two"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "BENCH_ROUNDS" in bad.stderr and "'two'" in bad.stderr, bad.stderr


def test_round_is_recorded_and_a_negative_round_is_refused(tmp_path):
    """A negative --round is an error naming the option (before torch is imported); --round N
    goes into the records (with torch, on the CPU)."""
    bad = subprocess.run([sys.executable, str(BENCH / "workloads" / "moe.py"), "--device", "cpu", "--tiny",
                          "--round", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--round must be 0" in bad.stderr and "-1" in bad.stderr, bad.stderr
    pytest.importorskip("torch")
    out = tmp_path / "r.jsonl"
    r = subprocess.run([sys.executable, str(BENCH / "workloads" / "moe.py"), "--device", "cpu", "--tiny",
                        "--steps", "1", "--warmup", "1", "--round", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text().splitlines()[0])["round"] == 2


def test_mixed_pattern_rounds_are_pooled():
    """The latency benchmark's mixed pattern in rounds (`bench_round`): each round's ns per
    pair against native's of the same round, pooled, over the faster baseline's; the table
    rows are the last round's."""
    recs = [{"kind": "env", "gpu": "FAKE", "driver": "1", "torch": "2.11.0", "date": "today"}]
    for rnd, speed in ((1, 1.0), (2, 1.6), (3, 0.9)):
        for a, x in (("native", 1.0), ("expandable", 1.2), ("gmlake", 1.1 if rnd != 2 else 1.4)):
            recs.append({"kind": "latency", "allocator": a, "test": "mixed", "bench_round": rnd,
                         "ns_per_pair": 1000 * speed * x, "ns_per_op": 500 * speed * x, "live": 10,
                         "min_size": 512, "max_size": 1 << 20, "ops_pairs": 10, "warm_pairs": 2,
                         "peak_active_bytes": GiB, "peak_reserved_bytes": GiB})
    recs.append({"kind": "latency", "allocator": "native", "test": "fixed", "size": 512, "ns_per_pair": 300,
                 "bench_round": 1})
    res = report.Results(recs)
    pooled = report.mixed_round_ratios(res)
    g, lo, hi, n, ref = pooled["gmlake"]
    assert abs(g - (1.1 * 1.4 * 1.1) ** (1 / 3)) < 1e-9 and (n, ref) == (3, "native"), pooled
    assert abs(lo - 1.1) < 1e-9 and abs(hi - 1.4) < 1e-9
    assert abs(pooled["expandable"][0] - 1.2) < 1e-9 and abs(pooled["native"][0] - 1.0) < 1e-9
    assert res.one("latency", allocator="gmlake", test="mixed")["bench_round"] == 3
    text = report.summary(res)
    assert "mixed over rounds" in text and "gmlake      3 rounds: 1.192 (native's 1.100-1.400)" in text, text
    md = "\n".join(report.latency_lines(res))
    assert "gmlake 3 rounds: 1.192 (native's 1.100-1.400)" in md, md
    # Without the fixed-size test (bench/issue12-gpu.sh runs the mixed pattern alone) too.
    alone = report.summary(report.Results([r for r in recs if r.get("test") != "fixed"]))
    assert "mixed ns/op" in alone and "gmlake      3 rounds: 1.192" in alone, alone
    # One round: nothing pooled.
    assert report.mixed_round_ratios(report.Results([r for r in recs if r.get("bench_round") == 1])) == {}


def test_run_gpu_runs_the_latency_benchmark_in_rounds(tmp_path):
    """BENCH_ROUNDS=3 with a latency binary given (BENCH_LATENCY_BIN, a stand-in here): the
    allocators run rotated, native2 and gmlake+key:value labels not at all (nothing failed),
    rounds after the first with the mixed pattern only, and every record carries its
    `bench_round`."""
    log = tmp_path / "argv.log"
    fake = tmp_path / "latency"
    fake.write_text("#!/bin/bash\n"
                    "echo \"$*\" >> " + str(log) + "\n"
                    "out=''; a=''; while [ $# -gt 0 ]; do case $1 in --out) out=$2; shift;; "
                    "--allocator) a=$2; shift;; esac; shift; done\n"
                    "echo '{\"kind\":\"latency\",\"allocator\":\"'$a'\",\"test\":\"mixed\",\"ns_per_pair\":1000,"
                    "\"ns_per_op\":500}' >> \"$out\"\n")
    fake.chmod(0o755)
    lib = tmp_path / "libgmlake_torch.so"
    lib.write_text("")
    env = dict(os.environ, OUT=str(tmp_path / "out"), BENCH_NO_WORKLOADS="1", BENCH_LATENCY_BIN=str(fake),
               BENCH_ALLOCATORS="native expandable gmlake gmlake+page_size:16MiB native2", BENCH_ROUNDS="3",
               BENCH_BUDGET_S="600")
    r = subprocess.run(["bash", str(BENCH / "run-gpu.sh"), str(lib)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    runs = log.read_text().splitlines()
    got = [(x.split("--allocator ")[1].split()[0], "--no-fixed --no-stitch" in x) for x in runs]
    assert got == [("native", False), ("expandable", False), ("gmlake", False),
                   ("expandable", True), ("gmlake", True), ("native", True),
                   ("gmlake", True), ("native", True), ("expandable", True)], runs
    recs = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    lat = [(x["allocator"], x["bench_round"]) for x in recs if x.get("kind") == "latency"]
    assert lat == [("native", 1), ("expandable", 1), ("gmlake", 1), ("expandable", 2), ("gmlake", 2),
                   ("native", 2), ("gmlake", 3), ("native", 3), ("expandable", 3)], lat
    assert not [x for x in recs if x.get("kind") == "failed"], recs
