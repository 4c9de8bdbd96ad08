"""The wheel build's checks (python/_build/gmlake_backend.py), without building: finding torch,
naming the wheel after torch and CUDA, and the errors for a missing torch or cargo."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

BACKEND = Path(__file__).resolve().parents[1] / "_build" / "gmlake_backend.py"
if not BACKEND.is_file():
    pytest.skip("the build backend is in the source tree (python/_build)", allow_module_level=True)
spec = importlib.util.spec_from_file_location("gmlake_backend_under_test", BACKEND)
backend = importlib.util.module_from_spec(spec)
spec.loader.exec_module(backend)


def fake_torch(root, version="2.11.0+cu130", cuda="'13.0'", headers=True):
    d = root / "torch"
    (d / "include" / "c10" / "cuda").mkdir(parents=True)
    if headers:
        (d / "include" / "c10" / "cuda" / "CUDACachingAllocator.h").write_text("")
    (d / "version.py").write_text(
        f"from typing import Optional\n__version__ = '{version}'\ncuda: Optional[str] = {cuda}\n")
    return d


def test_the_local_version_names_torch_and_cuda(tmp_path):
    info = backend.torch_info(fake_torch(tmp_path))
    assert info["local"] == "torch211.cu130"
    assert info["torch_major_minor"] == (2, 11) and info["cuda_version"] == "13.0"
    info = backend.torch_info(fake_torch(tmp_path / "b", "2.6.0+cu124", "'12.4'"))
    assert info["local"] == "torch26.cu124"


def test_a_cpu_torch_or_one_without_headers_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="built without CUDA"):
        backend.torch_info(fake_torch(tmp_path, "2.11.0+cpu", "None"))
    with pytest.raises(SystemExit, match="CUDACachingAllocator.h"):
        backend.torch_info(fake_torch(tmp_path / "b", headers=False))


def test_torch_dir_from_the_environment(tmp_path, monkeypatch):
    d = fake_torch(tmp_path)
    monkeypatch.setenv("GMLAKE_TORCH_DIR", str(d))
    assert backend.find_torch_dir().resolve() == d.resolve()
    monkeypatch.setenv("GMLAKE_TORCH_DIR", str(tmp_path / "nope"))
    with pytest.raises(SystemExit, match="is not a folder"):
        backend.find_torch_dir()


def test_torch_found_from_the_interpreter_running_pip(tmp_path, monkeypatch):
    # A torch on the interpreter's path is found without importing it (the fake one has no
    # __init__ code that would run).
    d = fake_torch(tmp_path)
    (d / "__init__.py").write_text("raise SystemExit('must not be imported')\n")
    monkeypatch.delenv("GMLAKE_TORCH_DIR", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert backend.find_torch_dir().resolve() == d.resolve()


def test_a_missing_torch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("GMLAKE_TORCH_DIR", raising=False)
    # An interpreter that finds no torch (-E too): python with an empty, isolated path.
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(backend.sys, "executable", str(fake_python))
    with pytest.raises(SystemExit) as e:
        backend.find_torch_dir()
    assert "torch not found" in str(e.value) and "--no-build-isolation" in str(e.value)


def test_a_missing_cargo_names_rustup(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("CARGO_HOME", raising=False)
    monkeypatch.delenv("GMLAKE_RUST_STATICLIB", raising=False)
    with pytest.raises(SystemExit) as e:
        backend.check_cargo()
    assert "cargo (Rust) not found" in str(e.value) and "rustup" in str(e.value)
    monkeypatch.setenv("GMLAKE_RUST_STATICLIB", "/prebuilt/libgmlake_ffi.a")
    backend.check_cargo()


def test_the_repository_root_is_checked(tmp_path, monkeypatch):
    assert (backend.repo_root() / "cpp" / "CMakeLists.txt").is_file()
    monkeypatch.setenv("GMLAKE_SOURCE_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="not from an sdist"):
        backend.repo_root()


def test_no_sdist():
    with pytest.raises(SystemExit, match="no sdist"):
        backend.build_sdist(os.devnull)
