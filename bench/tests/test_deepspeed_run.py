"""bench/deepspeed/run.sh's budget (BUDGET_S), with a fake workload in a copy of its tree: a
run starts only when one as long as the last run of its strategy ends within the budget."""
import os
import shutil
import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]

FAKE_ZERO3 = """
import argparse, json, time
p = argparse.ArgumentParser()
p.add_argument("--allocator"); p.add_argument("--label"); p.add_argument("--strategy")
p.add_argument("--out"); p.add_argument("--model"); p.add_argument("--batch")
p.add_argument("--steps"); p.add_argument("--tag")
a = p.parse_args()
time.sleep({"A": 0, "B": 4, "C": 60}[a.strategy])
with open(a.out, "a") as f:
    f.write(json.dumps({"strategy": a.strategy, "label": a.label}) + "\\n")
"""


def fake_tree(tmp_path):
    root = tmp_path / "repo"
    (root / "bench" / "deepspeed").mkdir(parents=True)
    (root / "bench" / "workloads").mkdir()
    (root / "python" / "deepspeed").mkdir(parents=True)
    shutil.copy(BENCH / "deepspeed" / "run.sh", root / "bench" / "deepspeed" / "run.sh")
    (root / "bench" / "workloads" / "zero3.py").write_text(FAKE_ZERO3)
    (root / "bench" / "deepspeed" / "table.py").write_text("import sys; print('table of', sys.argv[1])\n")
    (root / "python" / "deepspeed" / "__init__.py").write_text("__version__ = 'fake'\n")
    (root / "lib.so").write_text("")
    return root


def test_a_run_that_would_pass_the_budget_is_skipped(tmp_path):
    root = fake_tree(tmp_path)
    env = dict(os.environ, OUT=str(tmp_path / "out"), STRATEGIES="A B", ALLOCATORS="native gmlake",
               SEARCH="0", BUDGET_S="7", NPROC="1")
    r = subprocess.run(["bash", str(root / "bench" / "deepspeed" / "run.sh"), str(root / "lib.so")],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = (tmp_path / "out" / "zero3" / "results.jsonl").read_text().splitlines()
    # A's runs take no time; B's first run (estimated as the longest so far: 0 s) starts and
    # takes 4 s, within the budget, so B's second would end past 7 s: skipped.
    assert len(runs) == 3, r.stdout
    assert r.stdout.count("skipped: such a run took") == 1, r.stdout
    assert "table of" in r.stdout


def test_a_run_longer_than_the_budget_is_stopped_at_its_end(tmp_path):
    # C's first run is estimated at 0 s and starts; it would take 60 s. It is stopped at the
    # budget's end (3 s), not at RUN_TIMEOUT, and the table is still written: on the GPU a
    # search that bisected further than the last one ran past the machine's time limit, which
    # killed the whole command before the table.
    root = fake_tree(tmp_path)
    env = dict(os.environ, OUT=str(tmp_path / "out"), STRATEGIES="C", ALLOCATORS="native",
               SEARCH="0", BUDGET_S="3", NPROC="1", RUN_TIMEOUT="300")
    r = subprocess.run(["bash", str(root / "bench" / "deepspeed" / "run.sh"), str(root / "lib.so")],
                       capture_output=True, text=True, timeout=40, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exited with 124" in r.stdout, r.stdout
    assert "table of" in r.stdout


def test_budget_must_be_whole_seconds(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), BUDGET_S="ten", STRATEGIES="", SEARCH="0")
    r = subprocess.run(["bash", str(BENCH / "deepspeed" / "run.sh"), "/nonexistent/lib.so"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "BUDGET_S must be a whole number" in r.stdout, r.stdout + r.stderr
