"""Behaviours that PyTorch's users, tools and tests rely on (issue 20), each checked in a fresh
process under PyTorch's native allocator and under gmlake, expecting the same outcome: every
case prints allocator-independent facts (values, booleans, counts) and the two runs must print
the same. Where gmlake differs on purpose, the case leaves that fact out and docs/pytorch.md
("Differences from PyTorch's allocator") says why.

Cases (each also runnable alone: pytest tests/gpu/test_parity.py -k <name>):
- fraction_api: get/set_per_process_memory_fraction (1.0 unset, 0.5, 0.0 refuses every
  allocation, invalid values);
- fraction_conf_*: PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:<f> reported back and
  enforced; invalid values fail at CUDA initialization with a ValueError;
- alloc_conf_keys: every key of PyTorch's allocator settings accepted at start and at run
  time; unknown keys refused;
- roundup: roundup_power2_divisions (single value and list syntax, changed at run time) rounds
  the allocated bytes as native does, the requested bytes untouched (PyTorch's
  test_allocator_settings);
- mempool_nested: nested use_mem_pool blocks route each allocation to the innermost pool, and
  the outer pool again once the inner block exits;
- mempool_no_split: MemPool(no_split=True) accepted; allocations in it share no page;
- small_raw_alloc: caching_allocator_alloc of a few bytes and its delete leave the same
  statistics as native (nothing split, nothing allocated);
- stat_consistency: memory_stats agree with memory_snapshot (PyTorch's
  _check_memory_stat_consistency) along a sequence of allocations and frees;
- memory_stats_generator: PyTorch's memory-stats generator (allocated/reserved monotonicity,
  peaks and their reset, num_sync_all_streams +1 per empty_cache, device counters), on two
  GPUs interleaved when there are two;
- sync_counts_multi_gpu: num_sync_all_streams counts every empty_cache on every initialized
  device (2+ GPUs; skipped, identically, on one);
- graph_reclaim_*: memory freed during a capture with several streams is reused in the same
  capture as native (plain side-stream frees; record_stream'ed blocks with
  graph_capture_record_stream_reuse once the streams are joined, and not without it);
- checkpoint_middle / checkpoint_thread: CUDA graph trees' pool checkpoints
  (_cuda_getCheckpointState / _cuda_setCheckpointPoolState) leave blocks in the middle of a
  segment, and blocks allocated into the pool from another thread, as they were (PyTorch's
  TestBlockStateAbsorption).
"""

import pytest

from harness import run_python, write_out

HELPERS = """
import threading
def int8_cuda(n):
    return torch.ones([n], device="cuda", dtype=torch.uint8)
def cudagraphify(fn, inputs, pool=None):
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs)
    stream.synchronize()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, pool=pool):
        outputs = fn(*inputs)
    return graph, outputs
def pool_segments(pool_id):
    return [s for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] == pool_id]
def pool_ranges(pool):
    return [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]
def in_ranges(ptr, ranges):
    return any(a <= ptr < b for a, b in ranges)
def allocated_blocks(segments):
    return sum(1 for s in segments for b in s["blocks"] if b["state"] == "active_allocated")
def checkpoint_diffs(before, after):
    # PyTorch's TestBlockStateAbsorption.checkCheckpointedState, as a list of differences.
    diffs = []
    by_addr = {s["address"]: s for s in after}
    for b in before:
        a = by_addr.get(b["address"])
        if a is None:
            diffs.append(f"segment {b['address']:#x} gone")
            continue
        for f in ("device", "total_size", "allocated_size", "active_size", "segment_type",
                  "segment_pool_id"):
            if b[f] != a[f]:
                diffs.append(f"segment {b['address']:#x} {f}: {b[f]} -> {a[f]}")
        if len(b["blocks"]) != len(a["blocks"]):
            diffs.append(f"segment {b['address']:#x} blocks: {len(b['blocks'])} -> {len(a['blocks'])}")
        for x, y in zip(b["blocks"], a["blocks"]):
            for f in ("size", "state"):
                if x[f] != y[f]:
                    diffs.append(f"segment {b['address']:#x} block {f}: {x[f]} -> {y[f]}")
    return diffs
def set_checkpoint(device, state, stale=(), keep=()):
    torch._C._cuda_setCheckpointPoolState(
        device, state, [t.untyped_storage()._cdata for t in stale],
        [t.untyped_storage()._cdata for t in keep])
"""

CASES = {}

CASES["fraction_api"] = """
out = {"unset": torch.cuda.get_per_process_memory_fraction()}
x = torch.ones(1024, device="cuda")
out["max_split_size"] = torch.cuda.memory_stats()["max_split_size"]
for bad in (-0.1, 2.0):
    try:
        torch.cuda.set_per_process_memory_fraction(bad)
        out[f"set_{bad}"] = "accepted"
    except (ValueError, RuntimeError) as e:
        out[f"set_{bad}"] = type(e).__name__
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.empty_cache()
torch.cuda.set_per_process_memory_fraction(0.5)
out["half"] = torch.cuda.get_per_process_memory_fraction()
try:
    torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
    out["over_half"] = "allocated"
except torch.OutOfMemoryError:
    out["over_half"] = "oom"
y = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
out["under_half"] = "allocated"
del y
torch.cuda.empty_cache()
torch.cuda.set_per_process_memory_fraction(0.0)
out["zero"] = torch.cuda.get_per_process_memory_fraction()
try:
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    out["zero_alloc"] = "allocated"
except torch.OutOfMemoryError:
    out["zero_alloc"] = "oom"
torch.cuda.set_per_process_memory_fraction(1.0)
out["one"] = torch.cuda.get_per_process_memory_fraction()
x.fill_(2)
out["still_usable"] = bool((x == 2).all().item())
result(**out)
"""

FRACTION_CONF = """
out = {"fraction": torch.cuda.memory.get_per_process_memory_fraction(torch.cuda.current_device())}
total = torch.cuda.get_device_properties(0).total_memory
for share in (0.3, 0.6):
    try:
        t = torch.empty(int(total * share), dtype=torch.uint8, device="cuda")
        out[f"alloc_{share}"] = "allocated"
        del t
    except torch.OutOfMemoryError:
        out[f"alloc_{share}"] = "oom"
    torch.cuda.empty_cache()
result(**out)
"""

CASES["alloc_conf_keys"] = """
out = {}
x = torch.randn(1 << 20, device="cuda")
out["start_ok"] = bool(torch.isfinite(x).all().item())
for setting in ("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]", "max_split_size_mb:40",
                "garbage_collection_threshold:0.6", "expandable_segments:False",
                "release_lock_on_cudamalloc:True", "pinned_use_cuda_host_register:True",
                "pinned_num_register_threads:4", "graph_capture_record_stream_reuse:True",
                "per_process_memory_fraction:0.9", "foo:1", "roundup_power2_divisions:3"):
    try:
        torch.cuda.memory._set_allocator_settings(setting)
        y = torch.randn(3 << 20, device="cuda") + 1
        torch.cuda.synchronize()
        out[setting] = "ok"
    except (RuntimeError, ValueError) as e:
        out[setting] = type(e).__name__
pinned = torch.empty(1 << 20, pin_memory=True)
pinned.fill_(3)
out["pinned"] = float(pinned.cuda().sum().item())
result(**out)
"""

CASES["roundup"] = """
# PyTorch's test_allocator_settings, the part that needs no expandable segments. CUDA is
# initialized first, as in PyTorch's suite (native's memory_stats() is {} before).
torch.cuda.init()
def power2_div(size, div_factor):
    pow2 = 1
    while pow2 < size:
        pow2 = pow2 * 2
    if pow2 == size:
        return pow2
    step = pow2 / 2 / div_factor
    ret = pow2 / 2
    while ret < size:
        ret = ret + step
    return ret
out = {}
torch.cuda.memory.empty_cache()
key_allocated = "active_bytes.all.allocated"
key_requested = "requested_bytes.all.allocated"
nelems = 21 * 1024 * 1024
nbytes = 4 * nelems
nelems_big = 100 * 1024 * 1024
nbytes_big = 4 * nelems_big
start_mem = torch.cuda.memory_stats()[key_allocated]
torch.cuda.memory._set_allocator_settings("")
x = torch.rand(nelems, device="cuda")
reg_mem = torch.cuda.memory_stats()[key_allocated]
start_requested = torch.cuda.memory_stats()[key_requested]
torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")
y = torch.rand(nelems, device="cuda")
pow2_div4_mem = torch.cuda.memory_stats()[key_allocated]
current_requested = torch.cuda.memory_stats()[key_requested]
out["plain"] = reg_mem - start_mem == nbytes
out["div4"] = pow2_div4_mem - reg_mem == power2_div(nbytes, 4)
out["div4_requested"] = current_requested - start_requested == nbytes
torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.5")
torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.5,max_split_size_mb:40")
torch.cuda.memory.empty_cache()
start_mem = torch.cuda.memory_stats()[key_allocated]
z = torch.rand(nelems, device="cuda")
reg_mem = torch.cuda.memory_stats()[key_allocated]
out["reset"] = reg_mem - start_mem == nbytes
torch.cuda.memory.empty_cache()
torch.cuda.memory._set_allocator_settings(
    "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
start_mem = torch.cuda.memory_stats()[key_allocated]
w = torch.rand(nelems, device="cuda")
out["list_div8"] = torch.cuda.memory_stats()[key_allocated] - start_mem == power2_div(nbytes, 8)
torch.cuda.memory.empty_cache()
start_mem = torch.cuda.memory_stats()[key_allocated]
v = torch.rand(nelems_big, device="cuda")
out["list_div2_big"] = torch.cuda.memory_stats()[key_allocated] - start_mem == power2_div(nbytes_big, 2)
out["values_ok"] = bool((v >= 0).all().item() and (w <= 1).all().item())
result(**out)
"""

CASES["mempool_nested"] = """
out = {}
p1, p2, p3 = torch.cuda.MemPool(), torch.cuda.MemPool(), torch.cuda.MemPool()
size = 3 << 20
with torch.cuda.use_mem_pool(p1):
    a = torch.empty(size, dtype=torch.uint8, device="cuda")
    with torch.cuda.use_mem_pool(p2):
        b = torch.empty(size, dtype=torch.uint8, device="cuda")
        with torch.cuda.use_mem_pool(p3):
            c = torch.empty(size, dtype=torch.uint8, device="cuda")
        d = torch.empty(size, dtype=torch.uint8, device="cuda")   # p2 again
    e = torch.empty(size, dtype=torch.uint8, device="cuda")       # p1 again
    with torch.cuda.use_mem_pool(p3):
        f = torch.empty(1000, dtype=torch.uint8, device="cuda")   # p3, small
    g = torch.empty(1000, dtype=torch.uint8, device="cuda")       # p1, small
h = torch.empty(size, dtype=torch.uint8, device="cuda")           # default pool
ranges = {n: pool_ranges(p) for n, p in (("p1", p1), ("p2", p2), ("p3", p3))}
where = {}
for name, t in (("a", a), ("b", b), ("c", c), ("d", d), ("e", e), ("f", f), ("g", g), ("h", h)):
    owners = [n for n, r in ranges.items() if in_ranges(t.data_ptr(), r)]
    where[name] = owners[0] if len(owners) == 1 else ("default" if not owners else "+".join(owners))
out["where"] = where
out["allocated"] = {n: allocated_blocks(p.snapshot()) for n, p in (("p1", p1), ("p2", p2), ("p3", p3))}
out["use_counts"] = [p1.use_count(), p2.use_count(), p3.use_count()]
del a, b, c, d, e, f, g
result(**out)
"""

CASES["mempool_no_split"] = """
out = {}
try:
    pool = torch.cuda.MemPool(no_split=True)
    out["created"] = True
except Exception as e:
    out["created"] = f"{type(e).__name__}: {e}"[:200]
    result(**out)
    raise SystemExit(0)
ts = []
with torch.cuda.use_mem_pool(pool):
    for n in (1000, 5000, 3 << 20, 700):
        ts.append(torch.full((n,), 7, dtype=torch.uint8, device="cuda"))
out["values"] = [int(t.sum().item()) for t in ts]
# No two allocations share a 2 MiB page: native gives each its own segment (cudaMalloc),
# gmlake its own pages (its segments are runs of pages, which may hold several).
ptrs = sorted(t.data_ptr() for t in ts)
out["distinct_pages"] = len({p >> 21 for p in ptrs}) == len(ptrs)
out["allocated_in_pool"] = allocated_blocks(pool.snapshot())
del ts
result(**out)
"""

CASES["small_raw_alloc"] = """
keys = ["allocated_bytes.all.current", "active_bytes.all.current", "requested_bytes.all.current",
        "allocation.all.current", "active.all.current", "inactive_split.all.current",
        "inactive_split_bytes.all.current", "inactive_split_bytes.small_pool.current",
        "allocated_bytes.small_pool.current", "requested_bytes.small_pool.current"]
def snap():
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in keys}
out = {"before": snap()}
for n in (1, 100, 4096):
    p = torch.cuda.caching_allocator_alloc(n)
    out[f"alloc_{n}"] = snap()
    torch.cuda.caching_allocator_delete(p)
    out[f"freed_{n}"] = snap()
result(**out)
"""

CASES["stat_consistency"] = """
import collections
def check():
    # PyTorch's test_cuda.py _check_memory_stat_consistency: stats recounted from a snapshot.
    snapshot = torch.cuda.memory_snapshot()
    expected_each_device = collections.defaultdict(lambda: collections.defaultdict(int))
    for segment in snapshot:
        expandable = segment["is_expandable"]
        expected = expected_each_device[segment["device"]]
        pool_str = segment["segment_type"] + "_pool"
        if not expandable:
            expected["segment.all.current"] += 1
            expected["segment." + pool_str + ".current"] += 1
        for k, f in (("allocated_bytes", "allocated_size"), ("reserved_bytes", "total_size"),
                     ("active_bytes", "active_size"), ("requested_bytes", "requested_size")):
            expected[k + ".all.current"] += segment[f]
            expected[k + "." + pool_str + ".current"] += segment[f]
        sum_requested = 0
        is_split = len(segment["blocks"]) > 1
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                expected["allocation.all.current"] += 1
                expected["allocation." + pool_str + ".current"] += 1
            if block["state"].startswith("active_"):
                sum_requested += block["requested_size"]
                expected["active.all.current"] += 1
                expected["active." + pool_str + ".current"] += 1
            if block["state"] == "inactive" and is_split and not expandable:
                expected["inactive_split.all.current"] += 1
                expected["inactive_split." + pool_str + ".current"] += 1
                expected["inactive_split_bytes.all.current"] += block["size"]
                expected["inactive_split_bytes." + pool_str + ".current"] += block["size"]
        if sum_requested != segment["requested_size"]:
            mismatches.append(f"segment requested {segment['requested_size']} != {sum_requested}")
    for device, expected in expected_each_device.items():
        stats = torch.cuda.memory_stats(device)
        for k, v in expected.items():
            if v != stats[k]:
                mismatches.append(f"{step}: {k} snapshot {v} stats {stats[k]}")
mismatches = []
step = "start"
ts = []
torch.manual_seed(0)
devices = min(torch.cuda.device_count(), 2)
for step in range(60 * devices):
    if ts and torch.rand(1).item() < 0.4:
        ts.pop(int(torch.randint(len(ts), (1,)).item()))
    else:
        n = int(torch.randint(1, 5 << 20, (1,)).item()) if step % 3 else int(torch.randint(1, 4096, (1,)).item())
        ts.append(torch.empty(n, dtype=torch.uint8, device=f"cuda:{step % devices}"))
    check()
del ts
step = "freed"
check()
torch.cuda.empty_cache()
step = "emptied"
check()
result(mismatches=mismatches[:20], n_mismatches=len(mismatches))
"""

CASES["memory_stats_generator"] = """
# PyTorch's _test_memory_stats_generator (test_cuda.py / test_cuda_multigpu.py), its
# assertions collected as a list of failures; on two GPUs interleaved as
# test_memory_stats_multigpu does. CUDA is initialized first, as in PyTorch's suite (native
# refuses reset_peak_memory_stats before).
torch.cuda.init()
failures = []
def expect(cond, what):
    if not cond:
        failures.append(what)
def generator(device, N=35):
    m0 = torch.cuda.memory_allocated(device)
    last_m = [m0]
    max_m = [torch.cuda.max_memory_allocated(device)]
    last_r = [torch.cuda.memory_reserved(device)]
    max_r = [torch.cuda.max_memory_reserved(device)]
    def alloc(*size):
        with torch.cuda.device(device):
            return torch.empty(*size, device="cuda")
    def assert_change(comp=1, empty_cache=False, reset_peak=False, tag=""):
        new_m = torch.cuda.memory_allocated(device)
        new_max_m = torch.cuda.max_memory_allocated(device)
        if comp > 0:
            expect(new_m > last_m[0], f"{device} {tag} allocated grows")
        elif comp < 0:
            expect(new_m < last_m[0], f"{device} {tag} allocated shrinks")
        else:
            expect(new_m == last_m[0], f"{device} {tag} allocated same")
        expect(new_m <= new_max_m and new_max_m >= max_m[0], f"{device} {tag} peak allocated")
        last_m[0], max_m[0] = new_m, new_max_m
        new_r = torch.cuda.memory_reserved(device)
        new_max_r = torch.cuda.max_memory_reserved(device)
        expect(new_r <= new_max_r and new_max_r >= max_r[0], f"{device} {tag} peak reserved")
        last_r[0], max_r[0] = new_r, new_max_r
        if empty_cache:
            st = torch.cuda.memory_stats(device)
            n_sync_1 = st.get("num_sync_all_streams", -1)
            n_alloc_1 = st.get("num_device_alloc", -1)
            n_free_1 = st.get("num_device_free", -1)
            expect(n_sync_1 >= 0 and n_free_1 >= 0, f"{device} {tag} counters present")
            expect(n_alloc_1 >= (0 if new_m == 0 else 1), f"{device} {tag} num_device_alloc")
            torch.cuda.empty_cache()
            st = torch.cuda.memory_stats(device)
            expect(n_sync_1 + 1 == st.get("num_sync_all_streams", -1),
                   f"{device} {tag} num_sync_all_streams +1 per empty_cache")
            expect(st.get("num_device_alloc", -1) >= n_alloc_1, f"{device} {tag} num_device_alloc grows")
            expect(st.get("num_device_free", -1) >= n_free_1, f"{device} {tag} num_device_free grows")
            new_r = torch.cuda.memory_reserved(device)
            new_max_r = torch.cuda.max_memory_reserved(device)
            expect(new_r <= last_r[0] and new_max_r == max_r[0], f"{device} {tag} reserved after empty_cache")
            last_r[0] = new_r
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
            expect(torch.cuda.memory_allocated(device) == last_m[0], f"{device} {tag} reset allocated")
            expect(torch.cuda.max_memory_allocated(device) == last_m[0], f"{device} {tag} reset peak")
            max_m[0] = last_m[0]
            expect(torch.cuda.memory_reserved(device) == last_r[0], f"{device} {tag} reset reserved")
            expect(torch.cuda.max_memory_reserved(device) == last_r[0], f"{device} {tag} reset peak reserved")
            max_r[0] = last_r[0]
    assert_change(0, tag="start")
    assert_change(0, reset_peak=True, tag="reset0")
    assert_change(0, empty_cache=True, tag="empty0")
    yield
    tensors1 = [alloc(1), alloc(10, 20), alloc(200, 300, 2000)]
    m1 = torch.cuda.memory_allocated(device)
    assert_change(1, tag="t1")
    yield
    tensors2 = []
    for i in range(1, int(N / 2) + 1):
        tensors2.append(alloc(i, i * 4))
        assert_change(1, tag=f"small{i}")
        yield
    for i in range(5, int(N / 2) + 5):
        tensors2.append(alloc(i, i * 7, i * 9, i * 11))
        assert_change(1, reset_peak=(i % 2 == 0), tag=f"large{i}")
        yield
    tensors2.append(alloc(0, 0, 0))
    assert_change(0, tag="empty tensor")
    yield
    permute = [tensors2[i] for i in torch.randperm(len(tensors2))]
    del tensors2
    assert_change(0, tag="permute")
    yield
    tensors2 = permute
    del permute
    assert_change(0, reset_peak=True, tag="permuted")
    yield
    for i in range(int(N / 2)):
        x = tensors2[i].numel()
        del tensors2[i]
        assert_change(-x, tag=f"del{i}")
        yield
    for i in range(2, int(2 * N / 3) + 2):
        tensors2.append(alloc(i, i * 3, i * 8))
        assert_change(1, tag=f"again{i}")
        yield
    del tensors2
    assert_change(-1, reset_peak=True, tag="del tensors2")
    assert_change(0, tag="after del")
    expect(torch.cuda.memory_allocated(device) == m1, f"{device} back to m1")
    yield
    del tensors1
    assert_change(-1, reset_peak=True, tag="del tensors1")
    expect(torch.cuda.memory_allocated(device) == m0, f"{device} back to m0")
    assert_change(0, empty_cache=True, tag="final empty")
    assert_change(0, reset_peak=True, tag="final reset")
torch.manual_seed(0)
gens = [generator(d) for d in range(min(torch.cuda.device_count(), 2))]
done = [False] * len(gens)
while not all(done):
    for i, g in enumerate(gens):
        if not done[i]:
            try:
                next(g)
            except StopIteration:
                done[i] = True
result(failures=failures[:30], n_failures=len(failures), devices=len(gens))
"""

CASES["sync_counts_multi_gpu"] = """
n = torch.cuda.device_count()
if n < 2:
    result(skipped=True)
    raise SystemExit(0)
def syncs():
    return [torch.cuda.memory_stats(d).get("num_sync_all_streams", -1) for d in range(n)]
out = {"start": syncs()}
torch.cuda.empty_cache()
out["after_empty_nothing_used"] = syncs()
with torch.cuda.device(1):
    x1 = torch.ones(1 << 20, device="cuda")
torch.cuda.empty_cache()
out["after_dev1"] = syncs()
x0 = torch.ones(1 << 20, device="cuda:0")
for _ in range(3):
    torch.cuda.empty_cache()
out["after_both"] = syncs()
torch.cuda.reset_accumulated_memory_stats(1)
out["after_reset1"] = syncs()
torch.cuda.empty_cache()
out["after_reset_empty"] = syncs()
result(**out)
"""

GRAPH_RECLAIM = """
out = {}
if os.environ.get("RECLAIM_REUSE") == "1":
    torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
torch.cuda.empty_cache()
size = 8 << 20
streams = [torch.cuda.Stream() for _ in range(NUM_STREAMS)]
cap = torch.cuda.Stream()
cap.wait_stream(torch.cuda.current_stream())
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=cap):
    x = torch.ones(size, dtype=torch.uint8, device="cuda")
    x_ptr = x.data_ptr()
    for s in streams:
        s.wait_stream(cap)
        with torch.cuda.stream(s):
            x.add_(1)
        if RECORD:
            x.record_stream(s)
    for s in streams:
        cap.wait_stream(s)
    del x
    y = torch.empty(size, dtype=torch.uint8, device="cuda")
    out["reused_on_capture_stream"] = y.data_ptr() == x_ptr
    # A block allocated and freed on a side stream is reused on that stream.
    s0 = streams[0]
    s0.wait_stream(cap)
    with torch.cuda.stream(s0):
        z = torch.empty(size, dtype=torch.uint8, device="cuda")
        z_ptr = z.data_ptr()
        z.fill_(1)
        del z
        w = torch.empty(size, dtype=torch.uint8, device="cuda")
        out["reused_on_side_stream"] = w.data_ptr() == z_ptr
        w.fill_(2)
    cap.wait_stream(s0)
    y.fill_(3)
g.replay()
torch.cuda.synchronize()
out["replayed"] = True
result(**out)
"""

CASES["checkpoint_middle"] = """
out = {}
MIN_BLOCK_SIZE = 512
def run(fn, name):
    graph, outputs = cudagraphify(fn, [])
    pool_id = graph.pool()
    device = outputs[0].device.index
    before = pool_segments(pool_id)
    state = torch._C._cuda_getCheckpointState(device, pool_id)
    set_checkpoint(device, state)
    after = pool_segments(pool_id)
    out[name] = checkpoint_diffs(before, after)
    live = {o.data_ptr() for o in outputs}
    out[name + "_live"] = torch._C._cuda_checkPoolLiveAllocations(device, pool_id, live)
    return graph, outputs
def middle():
    small_buffers = [int8_cuda(MIN_BLOCK_SIZE) for _ in range(11)]
    return (small_buffers[5].add_(2),)
def multiple_middle():
    small_buffers = [int8_cuda(MIN_BLOCK_SIZE) for _ in range(11)]
    return small_buffers[5], small_buffers[8]
def contiguous():
    small_buffers = [int8_cuda(MIN_BLOCK_SIZE) for _ in range(11)]
    return small_buffers[5], small_buffers[6], small_buffers[7]
def large_middle():
    bufs = [int8_cuda(3 << 20) for _ in range(7)]
    return bufs[2], bufs[5]
keep = [run(f, n) for f, n in ((middle, "middle"), (multiple_middle, "multiple_middle"),
                                (contiguous, "contiguous"), (large_middle, "large_middle"))]
# PyTorch's test_tensor_dies_after_checkpoint: tensors that died after the checkpoint are
# live blocks again after the restore, freed by raw_delete.
def two():
    return int8_cuda(MIN_BLOCK_SIZE), int8_cuda(MIN_BLOCK_SIZE)
graph, outputs = cudagraphify(two, [])
pool_id = graph.pool()
device = outputs[0].device.index
segs = pool_segments(pool_id)
state = torch._C._cuda_getCheckpointState(device, pool_id)
ptrs = [o.data_ptr() for o in outputs]
del outputs
out["allocated_after_del"] = allocated_blocks(pool_segments(pool_id))
set_checkpoint(device, state)
out["allocated_after_restore"] = allocated_blocks(pool_segments(pool_id))
out["restore_diffs"] = checkpoint_diffs(segs, pool_segments(pool_id))
torch._C._cuda_cudaCachingAllocator_raw_delete(ptrs[0])
out["allocated_after_delete_1"] = allocated_blocks(pool_segments(pool_id))
torch._C._cuda_cudaCachingAllocator_raw_delete(ptrs[1])
out["allocated_after_delete_2"] = allocated_blocks(pool_segments(pool_id))
result(**out)
"""

CASES["checkpoint_thread"] = """
# PyTorch's test_allocate_in_thread_to_pool, with checkpoints: allocations made into the pool
# from another thread are live blocks of the pool, and a checkpoint keeps them as they are.
out = {}
LARGE_BUFFER = 16 << 20
def foo():
    return (torch.rand([4], device="cuda"),)
pool = torch.cuda.graph_pool_handle()
graph, outputs = cudagraphify(foo, [], pool=pool)
device = outputs[0].device.index
keep = []
def use_pool():
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool)
        try:
            for _ in range(3):
                keep.append(int8_cuda(LARGE_BUFFER))
            tmp = [int8_cuda(LARGE_BUFFER) for _ in range(4)]
            keep.append(int8_cuda(MIN := 512))
            del tmp
        finally:
            torch._C._cuda_endAllocateToPool(device, pool)
            torch._C._cuda_releasePool(device, pool)
    torch.cuda.synchronize()
def no_pool():
    for _ in range(10):
        (int8_cuda(LARGE_BUFFER) + int8_cuda(LARGE_BUFFER))
t1 = threading.Thread(target=use_pool)
t2 = threading.Thread(target=no_pool)
t1.start(); t2.start(); t1.join(); t2.join()
live = {o.data_ptr() for o in outputs} | {t.data_ptr() for t in keep}
out["live_in_pool"] = torch._C._cuda_checkPoolLiveAllocations(device, pool, live)
out["allocated_in_pool"] = allocated_blocks(pool_segments(pool))
before = pool_segments(pool)
state = torch._C._cuda_getCheckpointState(device, pool)
set_checkpoint(device, state)
out["diffs"] = checkpoint_diffs(before, pool_segments(pool))
out["live_after"] = torch._C._cuda_checkPoolLiveAllocations(device, pool, live)
del keep[:]
out["live_after_del"] = torch._C._cuda_checkPoolLiveAllocations(
    device, pool, {o.data_ptr() for o in outputs})
result(**out)
"""

RUNS = {name: (code, {}) for name, code in CASES.items()}
for f in ("0.0", "0.5", "1.0"):
    RUNS[f"fraction_conf_{f}"] = (FRACTION_CONF, {"PYTORCH_CUDA_ALLOC_CONF": f"per_process_memory_fraction:{f}"})
for f in ("-0.1", "1.1"):
    RUNS[f"fraction_conf_invalid_{f}"] = (FRACTION_CONF, {"PYTORCH_CUDA_ALLOC_CONF": f"per_process_memory_fraction:{f}"})
RUNS["alloc_conf_at_start"] = (
    "x = torch.randn(5 << 20, device='cuda'); result(ok=bool(torch.isfinite(x).all().item()))",
    {"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[64:8,>:2],max_split_size_mb:64,"
     "garbage_collection_threshold:0.7,expandable_segments:False,pinned_use_cuda_host_register:True,"
     "pinned_num_register_threads:2,release_lock_on_cudamalloc:True,"
     "graph_capture_record_stream_reuse:True,per_process_memory_fraction:0.95"})
for n in (2, 3):
    for record, reuse in ((False, False), (True, False), (True, True)):
        name = f"graph_reclaim_{n}_streams" + ("_record_stream" if record else "") + ("_reuse" if reuse else "")
        code = f"NUM_STREAMS = {n}\nRECORD = {record}\n" + GRAPH_RECLAIM
        RUNS[name] = (code, {"RECLAIM_REUSE": "1" if reuse else "0"})

# Facts that differ on purpose (docs/pytorch.md), removed before comparing.
IGNORE = {}


def _outcome(r):
    """What a run came to, without allocator-specific text."""
    if r.returncode != 0:
        err = r.stderr
        kind = next((k for k in ("ValueError", "OutOfMemoryError", "RuntimeError") if k in err), "other")
        return {"exit": "failed", "error": kind}
    res = dict(r.result)
    for k in IGNORE.get(r.name, ()):
        res.pop(k, None)
    return res


@pytest.mark.parametrize("case", sorted(RUNS))
def test_same_outcome_as_native(case):
    code, env = RUNS[case]
    outcomes = {}
    for allocator in ("native", "gmlake"):
        r = run_python(f"parity_{case}", HELPERS + code, allocator=allocator, env=env,
                       timeout=300, expect_ok=False)
        r.name = case
        if r.returncode != 0 and not case.startswith("fraction_conf_invalid"):
            pytest.fail(f"{case} under {allocator} failed:\n{r.tail()}")
        outcomes[allocator] = _outcome(r)
    write_out(f"parity_{case}.json", outcomes)
    assert outcomes["gmlake"] == outcomes["native"], (
        f"{case}: gmlake's outcome differs from native's\n"
        f"native: {outcomes['native']}\ngmlake: {outcomes['gmlake']}")
