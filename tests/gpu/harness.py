"""Helpers of the GPU suite (see conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where the cases import gmlake from: the source tree, or an installed wheel's folder
# (GMLAKE_GPU_PYDIR; scripts/gpu-suite.sh sets it with GMLAKE_WHEEL).
PYDIR = Path(os.environ.get("GMLAKE_GPU_PYDIR") or REPO / "python")
CASES = Path(__file__).resolve().parent / "cases"
PYTHON = os.environ.get("GMLAKE_GPU_PYTHON", sys.executable)
OUT = Path(os.environ["GMLAKE_GPU_OUT"]) if os.environ.get("GMLAKE_GPU_OUT") else None

PRELUDE = """\
import json, os, sys, time
sys.path.insert(0, {pydir!r})
import torch
import gmlake
ALLOCATOR = os.environ.get("GMLAKE_TEST_ALLOCATOR", "gmlake")
if ALLOCATOR == "gmlake":
    gmlake.enable(os.environ.get("GMLAKE_TEST_CONF", ""))
MiB = 1 << 20
GiB = 1 << 30
def result(**kw):
    print("GMLAKE_RESULT " + json.dumps(kw), flush=True)
"""



def _log(name: str, text: str) -> None:
    if OUT is None:
        return
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "cases.log", "a") as f:
        f.write(f"\n===== {name} =====\n{text}\n")


class CaseResult:
    def __init__(self, returncode: int, stdout: str, stderr: str, seconds: float):
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.seconds = seconds
        self.results = []
        for line in stdout.splitlines():
            if line.startswith("GMLAKE_RESULT "):
                self.results.append(json.loads(line[len("GMLAKE_RESULT "):]))

    @property
    def result(self) -> dict:
        merged = {}
        for r in self.results:
            merged.update(r)
        return merged

    def tail(self, n: int = 4000) -> str:
        return f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"


def run_python(
    name: str,
    code: str | None = None,
    *,
    script: Path | None = None,
    args: list[str] | None = None,
    allocator: str = "gmlake",
    conf: str = "",
    env: dict | None = None,
    timeout: float = 300,
    prelude: bool = True,
    python_args: list[str] | None = None,
    wrapper: list[str] | None = None,
    expect_ok: bool = True,
) -> CaseResult:
    """Runs `code` (after the prelude), or `script`, or just `python_args`, in a fresh
    interpreter; fails the test (with the output) unless it exits with 0 (expect_ok)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(PYDIR) + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONUNBUFFERED"] = "1"
    e["GMLAKE_TEST_ALLOCATOR"] = allocator
    e["GMLAKE_TEST_CONF"] = conf
    e.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    e.pop("PYTORCH_ALLOC_CONF", None)
    if allocator == "expandable":
        e["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if env:
        e.update(env)
    if script is None and code is not None:
        tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gmlake_case_{name}_{os.getpid()}.py"
        body = textwrap.dedent(code)
        tmp.write_text((PRELUDE.format(pydir=str(PYDIR)) if prelude else "") + body)
        script = tmp
    target = [str(script)] if script is not None else []
    cmd = list(wrapper or []) + [PYTHON] + list(python_args or []) + target + list(args or [])
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout, cwd=str(REPO))
        r = CaseResult(p.returncode, p.stdout, p.stderr, time.time() - t0)
    except subprocess.TimeoutExpired as te:
        out = te.stdout.decode() if isinstance(te.stdout, bytes) else (te.stdout or "")
        err = te.stderr.decode() if isinstance(te.stderr, bytes) else (te.stderr or "")
        r = CaseResult(-9, out, err + f"\n[timeout after {timeout}s]", time.time() - t0)
    _log(f"{name} [{allocator}] rc={r.returncode} {r.seconds:.1f}s", r.tail(20000))
    if expect_ok:
        assert r.returncode == 0, f"case {name} ({allocator}) failed with {r.returncode}\n{r.tail()}"
    return r


def write_out(name: str, data) -> None:
    if OUT is None:
        return
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / name, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
