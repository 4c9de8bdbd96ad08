"""Several GPUs: one pool per device, copies between devices (with and without peer access),
NCCL collectives on stitched tensors, and DDP / FSDP training under torchrun with gmlake in
every rank, compared with PyTorch's native allocator rank by rank. Skipped with fewer than 2
GPUs. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0) in every process."""

import json
import os
import subprocess
from pathlib import Path
from textwrap import dedent

import pytest

from harness import CASES, OUT, PYTHON, REPO, run_python, write_out
from test_memory import PATTERN_HELPERS

NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def _gpus() -> int:
    try:
        r = subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120)
        return int(r.stdout.strip().splitlines()[-1])
    except Exception:
        return 0


pytestmark = pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")


def _torchrun(name, script, args, gmlake, tmp, steps=None, timeout=480, run="", trace=False):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = dict(NCCL_ENV)
    env["GMLAKE_DIST_RUN"] = run
    env["GMLAKE_DIST_TRACE"] = "1" if trace else ""
    if steps is not None:
        env["GMLAKE_DIST_STEPS"] = str(steps)
    target = (["-m", "gmlake", "--quiet"] if gmlake else []) + [str(CASES / script)] + args
    return run_python(name, prelude=False, python_args=launcher + target, env=env,
                      allocator="gmlake" if gmlake else "native", timeout=timeout)


def test_one_pool_per_device_and_copies_between_them():
    r = run_python(
        "multi_gpu_copies",
        PATTERN_HELPERS + dedent("""
        def stitched(n, dev):
            tmp = [torch.empty(8 * MiB, dtype=torch.uint8, device=dev) for _ in range(16)]
            keep = tmp[1::2]
            del tmp
            s0 = gmlake.stats(dev)["gmlake.stitches"]
            t = torch.empty(n, dtype=torch.uint8, device=dev)
            return t, keep, gmlake.stats(dev)["gmlake.stitches"] - s0

        n = 40 * MiB + 4096
        # Stitched blocks on both devices, mapped before any peer access exists.
        x0, k0, s0 = stitched(n, "cuda:0")
        x1, k1, s1 = stitched(n, "cuda:1")
        fill(x0, 1); fill(x1, 2)
        st0, st1 = gmlake.stats(0), gmlake.stats(1)
        separate = (st0["allocated_bytes.all.current"] >= n and st1["allocated_bytes.all.current"] >= n
                    and st0["reserved_bytes.all.current"] > 0 and st1["reserved_bytes.all.current"] > 0)
        can = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
        # Copies both ways (PyTorch enables peer access on the first one when it can).
        y1 = x0.to("cuda:1"); y0 = x1.to("cuda:0")
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        ok_before = check(y1, 1) and check(y0, 2)
        # Blocks mapped after peer access was granted, stitched again, and copies into them.
        z1, kz1, sz1 = stitched(n, "cuda:1")
        z0, kz0, sz0 = stitched(n, "cuda:0")
        z1.copy_(x0); z0.copy_(x1)
        w = torch.empty(n, dtype=torch.uint8, device="cuda:1"); w.copy_(z0)
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        ok_after = check(z1, 1) and check(z0, 2) and check(w, 2)
        # Non-contiguous copy across devices (a kernel reads the peer's memory).
        a = torch.randn(2048, 4096, device="cuda:0")
        b = a.t().to("cuda:1")
        ok_strided = bool(torch.equal(b.cpu(), a.t().cpu()))
        result(stitches=[s0, s1, sz0, sz1], separate=separate, peer_possible=can,
               ok_before=ok_before, ok_after=ok_after, ok_strided=ok_strided,
               devices=[gmlake.stats(d)["gmlake.stitches"] for d in (0, 1)])
        """),
        env=NCCL_ENV,
    )
    res = r.result
    assert all(s >= 1 for s in res["stitches"]), res
    assert res["separate"], res
    assert res["ok_before"] and res["ok_after"] and res["ok_strided"], res


def _peer_copy_binary():
    cands = [os.environ.get("GMLAKE_PEER_COPY_TEST", "")]
    cands += [str(p) for p in sorted(Path("/tmp").glob("gmlake-cmake.*/gmlake_peer_copy_test"))]
    cands += [str(REPO / ".artifacts/gpu/gmlake_peer_copy_test"), str(REPO / "build/torch-ext/gmlake_peer_copy_test")]
    return next((c for c in cands if c and os.path.isfile(c)), None)


def test_memcpy_async_with_and_without_peer_access():
    exe = _peer_copy_binary()
    if exe is None:
        pytest.skip("gmlake_peer_copy_test not built (scripts/gpu-suite.sh --prepare builds it)")
    import torch  # noqa: F401  (only to find torch's libraries)

    lib = os.environ.get("GMLAKE_LIBRARY") or str(REPO / ".artifacts/gpu/libgmlake_torch.so")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    env = dict(os.environ, **NCCL_ENV)
    env["LD_LIBRARY_PATH"] = torch_lib + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    p = subprocess.run([exe, lib], capture_output=True, text=True, env=env, timeout=300)
    out = p.stdout + p.stderr
    if OUT is not None:
        (OUT / "peer_copy_test.log").write_text(out)
    assert p.returncode == 0, out
    assert "PASS" in out, out


def test_nccl_collectives_on_stitched_tensors(tmp_path):
    _torchrun("nccl_collectives", "dist_collectives.py", [str(tmp_path)], True, tmp_path)
    ranks = [json.loads((tmp_path / f"coll-rank{r}.json").read_text()) for r in range(2)]
    for res in ranks:
        assert res["stitched"], res
        assert res["checks"] and all(res["checks"].values()), res
        assert res["nccl_nvls_enable"] == "0"
    write_out("nccl_collectives.json", ranks)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_training_matches_native_in_every_rank(mode, tmp_path):
    """Native twice (the control: is the run deterministic?), then gmlake in every rank."""
    steps = int(os.environ.get("GMLAKE_DIST_STEPS", "200"))
    # GMLAKE_DIST_TRACE=1: the first native run records each rank's allocator trace, and the
    # traces go to the suite's output (for `gmlake replay` and bench/gpu_check.py).
    # GMLAKE_DIST_TRACE=all: the gmlake run records its own trace too (its segment_map events
    # say which stream's arena grew, and when).
    trace = bool(os.environ.get("GMLAKE_DIST_TRACE"))
    trace_gmlake = os.environ.get("GMLAKE_DIST_TRACE") == "all"
    _torchrun(f"{mode}_native", "dist_train.py", [mode, str(tmp_path)], False, tmp_path, steps,
              trace=trace)
    _torchrun(f"{mode}_native_again", "dist_train.py", [mode, str(tmp_path)], False, tmp_path, steps,
              run="-again")
    _torchrun(f"{mode}_gmlake", "dist_train.py", [mode, str(tmp_path)], True, tmp_path, steps,
              trace=trace_gmlake)

    def diff(a, b):
        return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))

    def sampled_peaks(run):
        # Peak reserved after warm-up's 10 steps, at the middle and at the end.
        return [run["peak_reserved_by_step"][i] for i in (9, steps // 2, steps - 1) if i < steps]

    rows = []
    for r in range(2):
        nat = json.loads((tmp_path / f"{mode}-native-rank{r}.json").read_text())
        again = json.loads((tmp_path / f"{mode}-native-again-rank{r}.json").read_text())
        gml = json.loads((tmp_path / f"{mode}-gmlake-rank{r}.json").read_text())
        assert gml["allocator"] == "gmlake" and nat["allocator"] == "native"
        assert len(gml["losses"]) == len(nat["losses"]) == steps
        equal = sum(a == b for a, b in zip(gml["losses"], nat["losses"]))
        rows.append(dict(rank=r, steps=steps, equal_losses=equal, max_loss_diff=diff(gml, nat),
                         native_control_diff=diff(again, nat),
                         native_util=nat["utilization"], gmlake_util=gml["utilization"],
                         native_peak_reserved=nat["peak_reserved"], gmlake_peak_reserved=gml["peak_reserved"],
                         native_peak_allocated=nat["peak_allocated"], gmlake_peak_allocated=gml["peak_allocated"],
                         native_step_ms=nat["median_step_ms"], gmlake_step_ms=gml["median_step_ms"],
                         native_again_step_ms=again["median_step_ms"],
                         stitches=gml.get("gmlake.stitches"),
                         gmlake_after_warmup_per_step=gml.get("after_warmup_per_step"),
                         gmlake_stream_waits=gml.get("gmlake.driver_calls.stream_wait"),
                         gmlake_retries=gml.get("num_alloc_retries"),
                         gmlake_peak_reserved_steps=sampled_peaks(gml),
                         native_peak_reserved_steps=sampled_peaks(nat)))
    write_out(f"dist_{mode}.json", rows)
    if trace and OUT is not None:
        for r in range(2):
            for alloc in ["native"] + (["gmlake"] if trace_gmlake else []):
                src = tmp_path / f"{mode}-{alloc}-rank{r}.pickle.gz"
                assert src.stat().st_size > 0, src
                (OUT / src.name).write_bytes(src.read_bytes())
    for row in rows:
        # Same seeds, same data, same deterministic kernels: the losses must not depend on the
        # allocator, any more than on running again.
        assert row["max_loss_diff"] <= row["native_control_diff"] + 1e-6, row
        assert row["gmlake_util"] >= row["native_util"] - 0.01, row
