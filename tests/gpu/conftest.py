"""GPU suite: every case runs in its own Python process, with gmlake installed before
anything touches CUDA (or, for comparisons, PyTorch's native allocator). Helpers: harness.py.

Environment:
  GMLAKE_LIBRARY      libgmlake_torch.so to test (default: gmlake.library_path()'s search)
  GMLAKE_GPU_OUT      folder for results and logs (scripts/gpu-suite.sh sets it to $OUT)
  GMLAKE_GPU_PYTHON   interpreter for the cases (default: this one)
"""

from __future__ import annotations

import subprocess

import pytest

from harness import PYTHON


def _gpu_available() -> bool:
    try:
        r = subprocess.run(
            [PYTHON, "-c", "import torch; print(torch.cuda.is_available())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return r.stdout.strip().endswith("True")
    except Exception:
        return False


_GPU = None


def pytest_collection_modifyitems(config, items):
    global _GPU
    if _GPU is None:
        _GPU = _gpu_available()
    if not _GPU:
        skip = pytest.mark.skip(reason="no CUDA GPU visible to torch")
        for item in items:
            item.add_marker(skip)


