"""The two faults of issue 20, each run under PyTorch's native allocator and under gmlake with
the same expectation:

- an out-of-memory error raised while a CUDA graph is being captured must raise
  torch.OutOfMemoryError and leave the process (and the allocator) usable, as native does
  (PyTorch's test_cuda.py::test_graph_capture_oom asks for 2**40 floats inside
  `torch.cuda.graph`);
- sending CUDA tensors of different dtypes that share one allocation through
  torch.multiprocessing (PyTorch's test_multiprocessing.py::_test_mixed_types_cuda_sharing)
  must complete, here 50 times in one process after other IPC traffic.

A watchdog in the IPC case dumps every thread's Python stack (faulthandler) and, where
cuda-gdb is installed, the native stacks of the parent and its children before giving up, so a
hang names where it waits instead of only timing out.
"""

import os

import pytest

from harness import run_python

ALLOCATORS = ["native", "gmlake"]

CAPTURE_OOM = """
import gc
out = {"steps": []}
def step(name, fn):
    try:
        fn()
        out["steps"].append([name, "ok", ""])
    except torch.OutOfMemoryError as e:
        out["steps"].append([name, "oom", str(e)[:300]])
    except RuntimeError as e:
        out["steps"].append([name, "runtime", str(e)[:300]])

# A graph captured and replayed before: its private pool is alive during the OOM below.
static = torch.ones(1 << 20, device="cuda")
g0 = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    static.mul_(1)
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g0):
    y0 = static * 2
g0.replay()
torch.cuda.synchronize()

def pytorch_test():          # test_cuda.py::test_graph_capture_oom
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        torch.zeros(2**40, device="cuda")
def larger_than_device():    # 1.5x the device, a size the driver could reserve
    total = torch.cuda.get_device_properties(0).total_memory
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        torch.empty(int(1.5 * total), dtype=torch.uint8, device="cuda")
def filling():               # many 1 GiB blocks inside one capture until the device is full
    keep = []
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        for _ in range(200):
            keep.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
def relaxed_side_stream():   # capture_error_mode="relaxed" and a user stream
    st = torch.cuda.Stream()
    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=st, capture_error_mode="relaxed"):
        torch.zeros(2**40, device="cuda")

for name, fn in (("pytorch_test", pytorch_test), ("larger_than_device", larger_than_device),
                 ("filling", filling), ("relaxed_side_stream", relaxed_side_stream)):
    step(name, fn)
    gc.collect()
    torch.cuda.synchronize()
    print("after", name, out["steps"][-1][:2], flush=True)

# The process and the allocator go on: new tensors, a new capture and its replay, the old graph.
x = torch.full((1 << 28,), 2.0, device="cuda")
out["after_ok"] = bool((x * 2).sum().item() == 4.0 * (1 << 28))
g1 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g1):
    y1 = x * 3
g1.replay()
g0.replay()
torch.cuda.synchronize()
out["new_capture_ok"] = bool(y1[0].item() == 6.0) and bool(y0[0].item() == 2.0)
del g1, y1
torch.cuda.empty_cache()
out["num_ooms"] = torch.cuda.memory_stats().get("num_ooms", -1)
result(**out)
"""


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_oom_during_graph_capture_raises_and_the_process_goes_on(allocator):
    r = run_python(f"capture_oom_{allocator}", CAPTURE_OOM, allocator=allocator, timeout=400)
    res = r.result
    print(res)
    steps = {name: (kind, msg) for name, kind, msg in res["steps"]}
    for name, (kind, msg) in steps.items():
        assert kind == "oom", f"{name}: expected torch.OutOfMemoryError, got {kind}: {msg}"
        assert "out of memory" in msg, msg
    assert res["after_ok"] and res["new_capture_ok"], res
    assert res["num_ooms"] >= len(steps), res


MIXED_IPC = """
import faulthandler, shutil, signal, subprocess, threading
import torch.multiprocessing as mp

faulthandler.register(signal.SIGUSR1, all_threads=True)

def mixed_type_producer(queue, event):         # as in PyTorch's test_multiprocessing.py
    if os.environ.get("MIXED_CHILD_GMLAKE") == "1":
        gmlake.enable()
    for _ in range(10):
        float_tensor = torch.ones(2, 2).float().cuda()
        byte_tensor = torch.zeros(2, 2).byte().cuda()
        queue.put(float_tensor)
        queue.put(byte_tensor)
        event.wait()
        event.clear()

def send_and_delete(queue, event, count):
    for i in range(count):
        t = torch.full([5], i, device="cuda", dtype=torch.int)
        queue.put(t)
        del t
    event.wait()

def send_views(queue, event):                   # one storage seen as three dtypes
    base = torch.arange(4096, dtype=torch.uint8, device="cuda")
    queue.put([base, base.view(torch.float32)[10:20], base[128:1152].view(torch.int16)])
    event.wait()

def watchdog(deadline, label):
    def dump():
        print(f"WATCHDOG: {label} did not finish in {deadline}s; dumping stacks", flush=True)
        pids = [os.getpid()] + [c.pid for c in mp.active_children()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGUSR1)
            except Exception:
                pass
        time.sleep(2)
        gdb = shutil.which("cuda-gdb")
        for pid in pids:
            if gdb:
                try:
                    p = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                                       capture_output=True, text=True, timeout=90)
                    print(f"===== native stacks of {pid} =====\\n" + p.stdout[-20000:], flush=True)
                except Exception as e:
                    print(f"cuda-gdb on {pid}: {e}", flush=True)
        os._exit(3)
    t = threading.Timer(deadline, dump)
    t.daemon = True
    t.start()
    return t

if __name__ == "__main__":
    if os.environ.get("MIXED_PARENT_GMLAKE") == "1":
        gmlake.enable()
    ctx = mp.get_context("spawn")
    runs = int(os.environ.get("MIXED_RUNS", "50"))
    times = []
    # Other IPC traffic first, as in PyTorch's suite.
    w = watchdog(120, "warm-up traffic")
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_and_delete, args=(q, e, 5)); p.start()
    got = [q.get() for _ in range(5)]
    assert [int(t[0].item()) for t in got] == list(range(5))
    del got; e.set(); p.join(60)
    q, e = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_views, args=(q, e)); p.start()
    base, f, i16 = q.get()
    assert torch.equal(base.cpu(), torch.arange(4096, dtype=torch.uint8))
    assert torch.equal(f.cpu(), base.view(torch.float32)[10:20].cpu())
    assert torch.equal(i16.cpu(), base[128:1152].view(torch.int16).cpu())
    del base, f, i16; e.set(); p.join(60)
    torch.cuda.ipc_collect()
    w.cancel()
    all_ones = torch.ones(2, 2).float()
    all_zeros = torch.zeros(2, 2).byte()
    for run in range(runs):
        t0 = time.time()
        w = watchdog(90, f"mixed-dtype run {run}")
        queue, event = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=mixed_type_producer, args=(queue, event))
        p.start()
        for _ in range(10):
            float_tensor = queue.get(timeout=80)
            byte_tensor = queue.get(timeout=80)
            assert torch.equal(float_tensor.cpu(), all_ones)
            assert torch.equal(byte_tensor.cpu(), all_zeros)
            del float_tensor, byte_tensor
            event.set()
        time.sleep(0.2)
        p.join(80)
        assert p.exitcode == 0, f"producer of run {run} exited with {p.exitcode}"
        w.cancel()
        torch.cuda.ipc_collect()
        times.append(round(time.time() - t0, 2))
    result(runs=len(times), max_s=max(times), times=times,
           backend=torch.cuda.get_allocator_backend())
"""


@pytest.mark.parametrize("allocator", ALLOCATORS + ["launcher", "gmlake-parent", "gmlake-child"])
def test_mixed_dtype_ipc_sends_complete_50_times(allocator):
    """`launcher`: gmlake installed by `python -m gmlake` in the parent and, through its import
    hook, in every spawned producer (the way PyTorch's suite was run), not by enable().
    `gmlake-parent`: the receiver runs gmlake, the producers PyTorch's allocator (the receiver
    opens cudaMalloc handles); `gmlake-child`: the other way round."""
    default = {"native": "10", "gmlake": "50", "launcher": "50"}.get(allocator, "25")
    runs = os.environ.get("GMLAKE_MIXED_RUNS", default)
    launcher = allocator == "launcher"
    env = {"MIXED_RUNS": runs,
           "MIXED_PARENT_GMLAKE": "1" if allocator == "gmlake-parent" else "0",
           "MIXED_CHILD_GMLAKE": "1" if allocator == "gmlake-child" else "0"}
    base = "gmlake" if allocator == "gmlake" else "native"
    r = run_python(f"mixed_ipc_{allocator}", MIXED_IPC, allocator=base, timeout=580, env=env,
                   expect_ok=False, python_args=["-m", "gmlake", "--quiet"] if launcher else None)
    print(r.tail(8000))
    assert r.returncode == 0, f"mixed-dtype IPC ({allocator}) failed or hung:\n{r.tail(12000)}"
    assert r.result["runs"] == int(runs), r.result
    parent = "native" if allocator in ("native", "gmlake-child") else "gmlake"
    assert r.result["backend"] == parent, r.result
