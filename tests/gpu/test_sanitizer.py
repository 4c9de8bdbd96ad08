"""compute-sanitizer memcheck over a subset (tests/gpu/cases/sanitizer_subset.py): clean."""

import os
import re
import shutil

import pytest

from harness import CASES, run_python


def _sanitizer():
    for c in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer"):
        if c and os.path.exists(c):
            return c
    return None


def test_memcheck_clean():
    tool = _sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found")
    r = run_python(
        "sanitizer",
        script=CASES / "sanitizer_subset.py",
        wrapper=[tool, "--tool", "memcheck", "--leak-check", "no", "--error-exitcode", "13",
                 "--print-limit", "50"],
        env={"CUDA_MODULE_LOADING": "LAZY"},
        timeout=300,
        expect_ok=False,
    )
    text = r.stdout + r.stderr
    m = re.search(r"ERROR SUMMARY: (\d+) error", text)
    print(text[-3000:])
    assert "sanitizer workload done" in text, r.tail()
    assert m is not None, "no ERROR SUMMARY in compute-sanitizer's output"
    assert int(m.group(1)) == 0, f"memcheck found {m.group(1)} error(s)"
    assert r.returncode == 0, r.tail()
