"""The installed wheel (GMLAKE_TEST_INSTALLED=1; skipped otherwise): its files, its version
tag, library_path(), and enable() refusing another torch. torch itself is a stub: these tests
need neither a GPU nor the CUDA torch. With GMLAKE_TEST_TORCH_LIBS (folders holding torch's
libc10*.so and libcudart, ':'-separated), the installed library is also loaded and asked
what it was built for."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if os.environ.get("GMLAKE_TEST_INSTALLED", "") in ("", "0"):
    pytest.skip("tests of the installed wheel (GMLAKE_TEST_INSTALLED=1)", allow_module_level=True)

import gmlake  # noqa: E402

PKG = Path(gmlake.__file__).resolve().parent
SRC = Path(__file__).resolve().parents[1]


def test_installed_files():
    assert SRC not in PKG.parents
    assert (PKG / "libgmlake_torch.so").is_file()
    assert (PKG / "metrics.py").is_file() and (PKG / "_autostart" / "sitecustomize.py").is_file()
    assert gmlake._build_info is not None


def test_version_names_torch_and_cuda():
    info = gmlake._build_info
    major, minor = info.TORCH_MAJOR_MINOR
    cuda = info.CUDA_VERSION.replace(".", "")
    assert gmlake.__version__.endswith(f"+torch{major}{minor}.cu{cuda}"), gmlake.__version__
    assert re.match(r"^\d+\.\d+\.\d+\+torch\d+\.cu\d+$", gmlake.__version__)
    expected = os.environ.get("GMLAKE_TEST_EXPECT_VERSION")
    if expected:
        assert gmlake.__version__ == expected
    from importlib.metadata import version

    assert version("gmlake") == gmlake.__version__


def test_library_path_is_next_to_the_module(monkeypatch):
    monkeypatch.delenv("GMLAKE_LIBRARY", raising=False)
    monkeypatch.setattr(gmlake, "_lib_path", None)
    assert gmlake.library_path() == str(PKG / "libgmlake_torch.so")


def _run_with_stub_torch(tmp_path, version, cuda, code, extra_env=None):
    stub = tmp_path / "stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "__init__.py").write_text(textwrap.dedent(f"""
        __version__ = {version!r}
        class version:
            cuda = {cuda!r}
        class _C:
            _GLIBCXX_USE_CXX11_ABI = True
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("GMLAKE_LIBRARY", "PYTHONPATH")}
    env["PYTHONPATH"] = str(stub)
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path))


def test_enable_refuses_another_torch(tmp_path):
    r = _run_with_stub_torch(tmp_path, "2.9.1+cu128", "12.8", "import gmlake; gmlake.enable()")
    assert r.returncode != 0
    info = gmlake._build_info
    built = "{}.{}".format(*info.TORCH_MAJOR_MINOR)
    assert f"built for torch {built} with CUDA {info.CUDA_VERSION}" in r.stderr, r.stderr
    assert "runs torch 2.9.1+cu128" in r.stderr, r.stderr


def test_launcher_refuses_another_torch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    r = _run_with_stub_torch(tmp_path, "2.9.1+cu128", "12.8",
                             f"import sys, runpy; sys.argv = ['gmlake', {str(script)!r}]; "
                             "runpy.run_module('gmlake', run_name='__main__')")
    assert r.returncode == 1 and "ran" not in r.stdout
    assert "runs torch 2.9.1+cu128" in r.stderr, r.stderr


def test_a_matching_torch_gets_past_the_version_check(tmp_path):
    info = gmlake._build_info
    r = _run_with_stub_torch(tmp_path, info.TORCH_VERSION, info.CUDA_VERSION,
                             "import gmlake, json; print(json.dumps(gmlake.build_info()))",
                             {"LD_LIBRARY_PATH": os.environ.get("GMLAKE_TEST_TORCH_LIBS", "")})
    assert "built for torch" not in r.stderr, r.stderr
    if not os.environ.get("GMLAKE_TEST_TORCH_LIBS"):
        # No torch libraries here: loading the library fails, with its path in the message.
        assert r.returncode != 0 and "cannot load" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    built = r.stdout.strip().splitlines()[-1]
    assert "{}.{}".format(*info.TORCH_MAJOR_MINOR) in built, built
