"""Run-time install: gmlake becomes torch's CUDA allocator, refusals are clear, the launcher
runs a program unchanged."""

import json
from pathlib import Path

from harness import run_python


def test_installed_as_torch_allocator():
    r = run_python(
        "installed",
        """
        assert gmlake.is_enabled()
        x = torch.ones(1000, device="cuda")
        y = (x * 3).sum().item()
        backend = torch.cuda.get_allocator_backend()
        acc = None
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_allocated"):
            acc = torch.accelerator.memory_allocated()
        result(backend=backend, y=y, allocated=torch.cuda.memory_allocated(),
               accelerator_allocated=acc, settings=gmlake.settings(), build=gmlake.build_info(),
               library=gmlake.library_path())
        """,
        conf="fragLimit:1MiB",
    )
    res = r.result
    print(res)
    assert res["backend"] == "gmlake"
    assert res["y"] == 3000.0
    assert res["allocated"] >= 4000
    if res["accelerator_allocated"] is not None:
        # c10::SetAllocator(kCUDA) was called: torch.accelerator sees gmlake's statistics.
        assert res["accelerator_allocated"] == res["allocated"]
    assert res["settings"].startswith("backend:gmlake") and "fragLimit:1048576" in res["settings"]


def test_refused_after_cuda_init():
    r = run_python(
        "refused_after_init",
        """
        torch.zeros(1, device="cuda")
        try:
            gmlake.enable()
            result(raised=False)
        except RuntimeError as e:
            result(raised=True, message=str(e), enabled=gmlake.is_enabled(),
                   backend=torch.cuda.get_allocator_backend())
        """,
        allocator="native",
    )
    res = r.result
    assert res["raised"], res
    assert "already initialized" in res["message"], res["message"]
    assert not res["enabled"] and res["backend"] == "native"


def test_invalid_configuration_names_key_and_value():
    r = run_python(
        "invalid_conf",
        """
        msgs = []
        for kw in ({"fragLimit": "lots"}, {"defragLevel": "high"}, {"nonsense": 1}):
            try:
                gmlake.enable(**kw)
                msgs.append(None)
            except RuntimeError as e:
                msgs.append(str(e))
        # Not installed by the failures: a valid configuration still installs.
        gmlake.enable(reuseLimit=10)
        torch.ones(1, device="cuda")
        result(msgs=msgs, backend=torch.cuda.get_allocator_backend())
        """,
        allocator="native",
    )
    res = r.result
    m = res["msgs"]
    assert m[0] and "fragLimit" in m[0] and "lots" in m[0], m
    assert m[1] and "defragLevel" in m[1] and "high" in m[1], m
    assert m[2] and "nonsense" in m[2], m
    assert res["backend"] == "gmlake"


def test_environment_configuration_error_is_clear():
    r = run_python(
        "env_conf_error",
        """
        try:
            gmlake.enable()
            result(raised=False)
        except RuntimeError as e:
            result(raised=True, message=str(e))
        """,
        allocator="native",
        env={"GMLAKE_CONF": "stitch_strategy:sideways"},
    )
    res = r.result
    assert res["raised"] and "stitch_strategy" in res["message"] and "sideways" in res["message"], res


def test_launcher_runs_script_unchanged(tmp_path: Path):
    script = tmp_path / "user_script.py"
    script.write_text(
        "import sys, json, torch\n"
        "x = torch.randn(256, 256, device='cuda')\n"
        "y = (x @ x).sum().item()\n"
        "import gmlake\n"
        "print('USER', json.dumps({'name': __name__, 'argv': sys.argv, "
        "'backend': torch.cuda.get_allocator_backend(), 'settings': gmlake.settings(), "
        "'path0': sys.path[0]}))\n"
        "sys.exit(3 if sys.argv[-1] == 'exit3' else 0)\n"
    )
    r = run_python(
        "launcher",
        python_args=["-m", "gmlake", str(script), "a", "--flag", "b"],
        env={"GMLAKE_CONF": "fragLimit:2MiB"},
        allocator="native",
    )
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("USER ")][0]
    info = json.loads(line[5:])
    assert info["name"] == "__main__"
    assert info["argv"] == [str(script), "a", "--flag", "b"]
    assert info["backend"] == "gmlake"
    assert "fragLimit:2097152" in info["settings"]
    assert info["path0"] == str(tmp_path)
    # The script's exit code is the launcher's.
    r = run_python(
        "launcher_exit",
        python_args=["-m", "gmlake", "--quiet", str(script), "exit3"],
        allocator="native",
        expect_ok=False,
    )
    assert r.returncode == 3, r.tail()
