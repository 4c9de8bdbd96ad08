"""Memory debugging mode (issue 15, GMLAKE_CONF=debug:...): a kernel writing one element past a
tensor is caught in every configuration (large tensor: an illegal address at the guard page;
small tensor, or the rounding slack of a large one: a canary report naming the allocation and
its Python frame); a read after free sees the poison (or faults, when the freed range is held
unmapped in the quarantine); a short training run in debug mode has the same losses as
without it and no report; with the mode off nothing changes.

The overflowing write is a one-line Triton kernel (`tl.store(ptr + n, v)`) when Triton is
installed (it comes with PyPI's torch), else cudaMemsetAsync of the byte(s) past the end
through libcudart (ctypes).
"""

import math

import pytest

from harness import CASES, run_python, write_out

HELPERS = r"""
import ctypes

def cudart():
    torch.cuda.init()
    for line in open("/proc/self/maps"):
        if "libcudart.so" in line:
            return ctypes.CDLL(line.split()[-1])
    for n in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(n)
        except OSError:
            pass
    raise RuntimeError("libcudart not found")

RT = cudart()

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _poke(ptr, off, val):
        tl.store(ptr + off, val)

    HOW = "triton"
except Exception:
    HOW = "memset"

def poke_memset(t, index):
    addr = t.data_ptr() + index * t.element_size()
    s = torch.cuda.current_stream().cuda_stream
    rc = RT.cudaMemsetAsync(ctypes.c_void_p(addr), ctypes.c_int(0x40),
                            ctypes.c_size_t(t.element_size()), ctypes.c_void_p(s))
    if rc != 0:
        raise RuntimeError(f"cudaMemsetAsync returned {rc} (invalid address)")

def poke(t, index, value=7.0):
    # One element of t's dtype at t.data_ptr() + index * element_size, no bounds check.
    global HOW
    if HOW == "triton":
        try:
            _poke[(1,)](t, index, value)
            return
        except Exception as e:  # no compiler for Triton's launcher, ...
            print("triton unusable, falling back on cudaMemsetAsync:", e, flush=True)
            HOW = "memset"
    poke_memset(t, index)

def read_bytes(addr, n):
    buf = (ctypes.c_uint8 * n)()
    rc = RT.cudaMemcpy(buf, ctypes.c_void_p(addr), ctypes.c_size_t(n), ctypes.c_int(2))
    return rc, bytes(buf)
"""


def case(name, code, conf, **kw):
    return run_python(name, HELPERS + code, conf=conf, **kw)


def test_large_overflow_faults_at_the_guard():
    for conf, index_past in (("debug:guard", True), ("debug:guard_front", False)):
        r = case(
            "debug_guard_fault",
            f"""
x = torch.zeros((4 << 20) // 4, device="cuda")  # 4 MiB: its end is the guard page's start
st = gmlake.stats()
result(how=HOW, guarded=st["gmlake.debug_guarded"], guard_bytes=st["gmlake.debug_guard_bytes"],
       end_page_aligned=(x.data_ptr() + x.numel() * 4) % (2 << 20) == 0)
try:
    poke(x, x.numel() if {index_past} else -1)
    torch.cuda.synchronize()
    result(fault="")
except Exception as e:
    result(fault=str(e)[:300])
""",
            conf,
            expect_ok=False,
        )
        res = r.result
        assert res.get("guarded") == 1 and res.get("guard_bytes", 0) > 0, r.tail()
        assert res.get("end_page_aligned"), r.tail()
        fault = res.get("fault", "") + r.stderr
        assert "illegal" in fault.lower() or "invalid" in fault.lower() or r.returncode != 0, (
            f"{conf}: writing past the tensor did not fault\n{r.tail()}"
        )


def test_small_overflow_is_reported_with_its_frame():
    r = case(
        "debug_canary",
        """
def make_victim():
    return torch.zeros(250, device="cuda")  # 1000 bytes: shares its page with others

neighbours = [torch.ones(250, device="cuda") for _ in range(4)]
x = make_victim()
ptr = x.data_ptr()
poke(x, 250)  # one float past the end
del x
reports = gmlake.debug_report()
ok = torch.cuda.memory_stats()  # the process is healthy
# A clean tensor freed: no report.
y = torch.zeros(250, device="cuda")
y.add_(1)
del y
after = gmlake.debug_report()
result(how=HOW, ptr=ptr, reports=reports, n_after=len(after),
       canary_errors=gmlake.stats()["gmlake.debug_canary_errors"],
       neighbours_ok=all(bool((n == 1).all()) for n in neighbours))
""",
        "debug:canary",
    )
    res = r.result
    reports = res["reports"]
    assert len(reports) == 1, r.tail()
    rep = reports[0]
    assert rep["address"] == res["ptr"] and rep["requested"] == 1000 and rep["kind"] == "canary", rep
    assert rep["first_bad"] == 0 and rep["bad_bytes"] >= 1, rep
    names = [f.get("name") for f in rep["frames"]]
    assert "make_victim" in names, f"the report does not name the allocating frame: {rep}"
    assert res["n_after"] == 1 and res["canary_errors"] == 1 and res["neighbours_ok"], res
    assert "buffer overflow" in r.stderr, r.tail()


def test_large_unaligned_overflow_hits_the_canary_before_the_guard():
    r = case(
        "debug_guard_canary",
        """
x = torch.zeros((4 << 20) // 4 + 25, device="cuda")  # 4 MiB + 100 bytes: 412 bytes of slack
poke(x, x.numel())
torch.cuda.synchronize()
del x
reports = gmlake.debug_report()
result(reports=reports, guarded=gmlake.stats()["gmlake.debug_guarded"])
""",
        "debug:guard+canary+poison",
    )
    reports = r.result["reports"]
    assert len(reports) == 1 and reports[0]["requested"] == (4 << 20) + 100, r.tail()


def test_read_after_free_sees_the_poison():
    r = case(
        "debug_poison",
        """
x = torch.ones(1 << 16, device="cuda")  # 256 KiB: an arena block
ptr = x.data_ptr()
del x
torch.cuda.synchronize()
rc, data = read_bytes(ptr, 4096)
y = torch.empty(1 << 16, device="cuda")  # the quarantine keeps the old block from reuse
result(rc=rc, all_ff=all(b == 0xFF for b in data), reused=y.data_ptr() == ptr,
       held=gmlake.stats()["gmlake.debug_quarantine_blocks"])
""",
        "debug:poison+quarantine",
    )
    res = r.result
    assert res["rc"] == 0 and res["all_ff"], r.tail()
    assert not res["reused"] and res["held"] >= 1, res


def test_read_after_free_of_a_guarded_tensor_faults():
    r = case(
        "debug_quarantine_unmapped",
        """
x = torch.ones((8 << 20) // 4, device="cuda")
ptr = x.data_ptr()
del x
torch.cuda.synchronize()
y = torch.empty(16, device="cuda")  # any call progresses the quarantine: the range is unmapped
st = gmlake.stats()
result(held=st["gmlake.debug_quarantine_blocks"], held_bytes=st["gmlake.debug_quarantine_bytes"])
try:
    rc, data = read_bytes(ptr, 4096)
    torch.cuda.synchronize()
    result(rc=rc)
except Exception as e:
    result(rc=-1, err=str(e)[:200])
""",
        "debug:all",
        expect_ok=False,
    )
    res = r.result
    assert res.get("held", 0) >= 1 and res.get("held_bytes", 0) >= 8 << 20, r.tail()
    # An error code, an exception, or the process killed: anything but reading the bytes.
    assert res.get("rc") not in (None, 0) or r.returncode != 0, (
        f"reading a freed guarded range did not fail\n{r.tail()}"
    )


def test_training_in_debug_mode_has_no_false_report():
    runs = {}
    for name, conf in (("plain", ""), ("debug", "debug:all")):
        r = run_python(
            f"train_debug_{name}",
            script=CASES / "train_lora.py",
            conf=conf,
            env={"GMLAKE_TRAIN_STEPS": "15"},
            timeout=400,
        )
        runs[name] = r.result
        assert runs[name].get("losses"), r.tail()
    plain, debug = runs["plain"], runs["debug"]
    summary = {
        name: {
            "median_step_ms": res["median_step_s"] * 1000,
            "peak_reserved_gib": res["peak_reserved"] / 2**30,
            **{k: v for k, v in res.items() if k.startswith("gmlake.debug")},
        }
        for name, res in runs.items()
    }
    write_out("debug_training.json", summary)
    print(summary)
    assert all(math.isfinite(x) for x in debug["losses"]), debug["losses"]
    assert debug["losses"] == pytest.approx(plain["losses"], rel=1e-3)
    assert debug.get("gmlake.debug_canary_errors") == 0, debug
    assert debug.get("debug_reports") == 0, debug


def test_mode_off_changes_nothing():
    code = """
keep = []
for i in range(300):
    keep.append(torch.empty((i * 7919) % (9 << 20) + 1, dtype=torch.uint8, device="cuda"))
    if i % 3 == 0:
        keep.pop((i * 31) % len(keep))
st = gmlake.stats()
kinds = ("create_physical", "release_physical", "reserve_va", "free_va", "map", "unmap", "set_access")
result(calls={k: st["gmlake.driver_calls." + k] for k in kinds},
       reserved=st["reserved_bytes.all.current"], debug=gmlake.settings())
"""
    a = case("debug_off_default", code, "").result
    b = case("debug_off_explicit", code, "debug:off").result
    assert a["calls"] == b["calls"] and a["reserved"] == b["reserved"]
    assert "debug" not in a["debug"] and "debug" not in b["debug"]
