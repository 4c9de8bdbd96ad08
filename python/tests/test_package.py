"""Tests of the gmlake Python package that need neither a GPU nor torch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

PYDIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PYDIR))

import gmlake  # noqa: E402
from gmlake.__main__ import main  # noqa: E402


def test_conf_string_from_keywords():
    assert gmlake.conf_string() == ""
    assert gmlake.conf_string("fragLimit:2MiB") == "fragLimit:2MiB"
    s = gmlake.conf_string("a:1,", fragLimit="16MiB", vmmDefragment=True, defragLevel=0, autoGC=float("inf"), x=None)
    assert s == "a:1,fragLimit:16MiB,vmmDefragment:1,defragLevel:0,autoGC:inf"
    with pytest.raises(ValueError):
        gmlake.conf_string(fragLimit="1,2")


def test_library_path_reports_where_it_looked(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "libgmlake_torch.so"
    monkeypatch.setenv("GMLAKE_LIBRARY", str(missing))
    monkeypatch.setattr(gmlake, "_lib_path", None)
    with pytest.raises(RuntimeError) as e:
        gmlake.library_path()
    assert str(missing) in str(e.value) and "build-torch-ext.sh" in str(e.value)
    with pytest.raises(RuntimeError):
        gmlake.enable(fragLimit="1MiB")
    assert not gmlake.is_enabled()


def test_library_path_prefers_the_environment(monkeypatch, tmp_path):
    lib = tmp_path / "libgmlake_torch.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("GMLAKE_LIBRARY", str(lib))
    monkeypatch.setattr(gmlake, "_lib_path", None)
    assert gmlake.library_path() == str(lib)


def test_stats_need_the_allocator():
    if gmlake.is_enabled():
        pytest.skip("enabled in this process")
    with pytest.raises(RuntimeError, match="not enabled"):
        gmlake.stats()


def test_launcher_usage_and_errors(capsys):
    assert main(["--help"]) == 0
    assert "python -m gmlake" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["--bogus"]) == 2
    assert main(["--conf"]) == 2


def test_launcher_reports_a_missing_library(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    env = dict(os.environ, PYTHONPATH=str(PYDIR), GMLAKE_LIBRARY=str(tmp_path / "missing.so"))
    r = subprocess.run([sys.executable, "-m", "gmlake", str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 1
    assert "libgmlake_torch.so not found" in r.stderr
    assert "ran" not in r.stdout
