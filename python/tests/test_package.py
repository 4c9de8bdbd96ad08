"""Tests of the gmlake Python package that need neither a GPU nor torch.

With GMLAKE_TEST_INSTALLED=1 they test the installed package (run from outside the source
tree, no PYTHONPATH); otherwise the source tree's python/."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

PYDIR = Path(__file__).resolve().parents[1]
INSTALLED = os.environ.get("GMLAKE_TEST_INSTALLED", "") not in ("", "0")
if not INSTALLED:
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
    # PyTorch's list syntax keeps its commas inside brackets (the library splits around them).
    s = gmlake.conf_string(roundup_power2_divisions="[64:8,256:4,>:1]", fragLimit="2MiB")
    assert s == "roundup_power2_divisions:[64:8,256:4,>:1],fragLimit:2MiB"
    with pytest.raises(ValueError):
        gmlake.conf_string(roundup_power2_divisions="[64:8],[1:2]")


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
    env = dict(os.environ, GMLAKE_LIBRARY=str(tmp_path / "missing.so"))
    if not INSTALLED:
        env["PYTHONPATH"] = str(PYDIR)
    r = subprocess.run([sys.executable, "-m", "gmlake", str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 1
    assert "libgmlake_torch.so not found" in r.stderr
    assert "ran" not in r.stdout


def test_children_environment_puts_the_autostart_folder_first():
    from gmlake._autoenable import AUTOSTART_DIR, PACKAGE_PARENT, environment_for_children

    env = environment_for_children("fragLimit:2MiB", {"PYTHONPATH": "/a" + os.pathsep + "/b"})
    assert env["GMLAKE_AUTO_ENABLE"] == "fragLimit:2MiB"
    assert env["PYTHONPATH"].split(os.pathsep) == [AUTOSTART_DIR, PACKAGE_PARENT, "/a", "/b"]
    again = environment_for_children("", {"PYTHONPATH": env["PYTHONPATH"]})
    assert again["PYTHONPATH"] == env["PYTHONPATH"], "no duplicates when nested"


def _child(tmp_path, code, with_env=True):
    from gmlake._autoenable import environment_for_children

    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True, exist_ok=True)
    (fake / "torch" / "__init__.py").write_text("print('fake torch imported')\n")
    other = tmp_path / "other"
    other.mkdir(exist_ok=True)
    (other / "sitecustomize.py").write_text("print('other sitecustomize ran')\n")
    env = dict(os.environ)
    env.pop("GMLAKE_AUTO_ENABLE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(other)])
    env["GMLAKE_LIBRARY"] = str(tmp_path / "missing" / "libgmlake_torch.so")
    if with_env:
        env.update(environment_for_children("fragLimit:2MiB", env))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_children_install_gmlake_when_they_import_torch(tmp_path):
    # The fake torch has no CUDA and the library is missing: the install is attempted right
    # after `import torch` and fails with a message; the process goes on.
    r = _child(tmp_path, "import torch; print('after import')")
    assert r.returncode == 0, r.stderr
    assert "fake torch imported" in r.stdout and "after import" in r.stdout
    assert "other sitecustomize ran" in r.stdout, "another sitecustomize must still run"
    assert "gmlake: not installed in process" in r.stderr and "missing" in r.stderr, r.stderr
    # A child that never imports torch is left alone.
    r = _child(tmp_path, "print('no torch')")
    assert r.returncode == 0 and "not installed" not in r.stderr and "fake torch" not in r.stdout
    # Without the environment nothing is attempted.
    r = _child(tmp_path, "import torch", with_env=False)
    assert r.returncode == 0 and "gmlake" not in r.stderr


def test_launcher_no_children_flag_is_accepted(capsys):
    assert main(["--no-children"]) == 2  # no script: the usage
    assert "unknown option" not in capsys.readouterr().err
    assert main(["--no-such-flag"]) == 2
    assert "unknown option" in capsys.readouterr().err


def test_the_package_under_test_is_the_intended_one():
    here = Path(gmlake.__file__).resolve()
    if INSTALLED:
        assert PYDIR not in here.parents, f"{here} is the source tree, not the installed package"
    else:
        assert PYDIR in here.parents


def test_launcher_checks_the_metrics_port(capsys):
    assert main(["--metrics-port", "70000", "train.py"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["--metrics-port", "x", "train.py"]) == 2
    assert "invalid metrics port" in capsys.readouterr().err
    assert main(["--metrics-port"]) == 2
    assert main(["--version"]) == 0
    assert gmlake.__version__ in capsys.readouterr().out


def test_check_torch_names_both_versions(monkeypatch):
    from types import SimpleNamespace

    info = SimpleNamespace(__version__="0.1.0+torch211.cu130", TORCH_VERSION="2.11.0+cu130",
                           TORCH_MAJOR_MINOR=(2, 11), CUDA_VERSION="13.0")
    monkeypatch.setattr(gmlake, "_build_info", info)
    gmlake.check_torch("2.11.0+cu130", "13.0")
    gmlake.check_torch("2.11.1", "13.2")  # same minor, same CUDA major
    with pytest.raises(RuntimeError) as e:
        gmlake.check_torch("2.10.0+cu128", "12.8")
    msg = str(e.value)
    assert "built for torch 2.11 with CUDA 13.0" in msg and "runs torch 2.10.0+cu128" in msg, msg
    assert "--no-build-isolation" in msg
    with pytest.raises(RuntimeError, match="runs torch 2.11.0\\+cu126 with CUDA 12.6"):
        gmlake.check_torch("2.11.0+cu126", "12.6")
    with pytest.raises(RuntimeError, match="runs torch 2.11.0\\+cpu, built without CUDA"):
        gmlake.check_torch("2.11.0+cpu", None)
    monkeypatch.setattr(gmlake, "_build_info", None)
    gmlake.check_torch("1.0.0", None)  # a source checkout: the library checks itself


def test_enable_without_torch_says_so(monkeypatch, tmp_path):
    lib = tmp_path / "libgmlake_torch.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("GMLAKE_LIBRARY", str(lib))
    monkeypatch.setattr(gmlake, "_lib_path", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(RuntimeError, match="torch cannot be imported"):
        gmlake.enable()
    assert not gmlake.is_enabled()
