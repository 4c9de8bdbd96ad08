"""bench/step_profile.py's argument handling (no GPU, no torch: what runs before torch is
imported).

Run: python3 -m pytest -q bench/tests
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, str(BENCH / "step_profile.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_no_workload_prints_the_usage():
    r = run()
    assert r.returncode == 2
    assert "bench/step_profile.py WORKLOAD" in r.stderr


def test_an_unknown_workload_is_named():
    r = run("no_such_workload", "--allocator", "native")
    assert r.returncode == 2
    assert "no workload 'no_such_workload'" in r.stderr


def test_every_workload_module_has_what_the_profile_reads():
    # The profile builds a workload through the same module attributes as bench/run-gpu.sh's
    # runs (NAME, DEFAULTS, add_args, build); a workload without them would fail on the GPU.
    text = {p.stem: p.read_text() for p in (BENCH / "workloads").glob("*.py")
            if p.stem not in ("common", "models")}
    assert {"moe", "concat_cache", "llm_lora", "stress"} <= set(text)
    for name, src in text.items():
        for attr in ("NAME = ", "DEFAULTS = ", "def add_args(", "def build("):
            assert attr in src, f"{name}.py lacks {attr.strip()}"
