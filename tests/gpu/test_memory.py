"""Allocation correctness: many sizes, stitched blocks, statistics, empty_cache, OOM,
record_stream."""

import re
from textwrap import dedent

from harness import run_python, write_out

# Writes a distinct pattern into every tensor, then checks them all (an overlap between live
# blocks, or a page mapped at the wrong place, shows as a mismatch).
PATTERN_HELPERS = """
def pattern(n, seed, device="cuda"):
    # Random bytes repeated with a period that divides no page size: a page mapped at the
    # wrong place, or bytes of another tensor, do not match. Drawn on the CPU, so the same
    # seed gives the same bytes on every device.
    g = torch.Generator()
    g.manual_seed(seed)
    period = 65537 + (seed % 1000) * 26
    base = torch.randint(0, 256, (period,), generator=g, dtype=torch.uint8).to(device)
    return base.repeat(-(-n // period))[:n]

def fill(t, seed):
    t.copy_(pattern(t.numel(), seed, t.device))

def check(t, seed):
    return bool(torch.equal(t, pattern(t.numel(), seed, t.device)))
"""


def test_many_sizes_written_and_verified():
    r = run_python(
        "many_sizes",
        PATTERN_HELPERS
        + dedent("""
        import random
        rng = random.Random(1234)
        sizes = [0, 1, 7, 511, 512, 513, 4095, 4096, 65537, MiB - 1, MiB, MiB + 1, 2 * MiB,
                 2 * MiB + 3, 3 * MiB, 10 * MiB, 20 * MiB + 123, 64 * MiB, 100 * MiB + 1,
                 512 * MiB, GiB, 3 * GiB + 17]
        sizes += [int(2 ** rng.uniform(0, 26)) for _ in range(300)]
        live = {}
        misaligned = 0
        for i, n in enumerate(sizes):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            if n and t.data_ptr() % 512:
                misaligned += 1
            fill(t, i)
            live[i] = t
        bad = [i for i, t in live.items() if not check(t, i)]
        # Free every other one, allocate a second round (reusing and stitching freed memory),
        # check everything again.
        for i in list(live)[::2]:
            del live[i]
        for j in range(300):
            n = int(2 ** rng.uniform(0, 27))
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            fill(t, 10000 + j)
            live[10000 + j] = t
        bad += [i for i, t in live.items() if not check(t, i)]
        # Other dtypes and shapes through kernels.
        a = torch.randn(1023, 517, device="cuda", dtype=torch.float32)
        b = torch.randn(517, 333, device="cuda", dtype=torch.float32)
        mm_err = float(((a @ b).cpu().double() - a.cpu().double() @ b.cpu().double()).abs().max())
        torch.cuda.synchronize()
        s = gmlake.stats()
        result(bad=bad, misaligned=misaligned, mm_err=mm_err, stitches=s["gmlake.stitches"],
               live=len(live), allocated=s["allocated_bytes.all.current"],
               reserved=s["reserved_bytes.all.current"])
        """),
    )
    res = r.result
    print(res)
    assert res["bad"] == [], f"corrupted tensors: {res['bad'][:20]}"
    assert res["misaligned"] == 0
    assert res["mm_err"] < 1e-2


def test_stitched_block_data_round_trip():
    r = run_python(
        "stitch",
        PATTERN_HELPERS
        + dedent("""
        page = None
        blk = 64 * MiB
        ts = [torch.empty(blk, dtype=torch.uint8, device="cuda") for _ in range(16)]
        for i, t in enumerate(ts):
            fill(t, i)
        keep = {i: t for i, t in enumerate(ts) if i % 2 == 1}
        del ts, t
        torch.cuda.synchronize()
        s0 = gmlake.stats()
        page = s0["gmlake.page_size"]
        # Eight free 64 MiB holes: a 256 MiB request fits none of them; gmlake stitches their
        # pages into one new range before asking the device for memory.
        big = torch.empty(4 * blk, dtype=torch.uint8, device="cuda")
        s1 = gmlake.stats()
        stitched = s1["gmlake.stitches"] - s0["gmlake.stitches"]
        pages = s1["gmlake.pages_stitched"] - s0["gmlake.pages_stitched"]
        new_physical = s1["gmlake.driver_calls.create_physical"] - s0["gmlake.driver_calls.create_physical"]
        # Data round trip through the stitched range...
        fill(big, 777)
        torch.cuda.synchronize()
        whole_ok = check(big, 777)
        # ...and through views that start on every page (each reads one physical page
        # through its new mapping).
        ref = pattern(big.numel(), 777)
        rows = big.view(-1, page).eq(ref.view(-1, page)).all(dim=1)
        pages_ok = bool(rows.all())
        per_page = []
        for off in range(0, big.numel(), 16 * page):
            v = big[off:off + page]
            per_page.append(bool(torch.equal(v, ref[off:off + page])))
        # Kernels through the stitched memory: a matmul on a float view against fresh memory.
        f = big.view(torch.float32)[: 2048 * 2048].view(2048, 2048)
        f.copy_(torch.randn(2048, 2048, device="cuda"))
        g = f.clone()
        mm_same = bool(torch.equal(f @ f, g @ g))
        # The live neighbours were not touched by the stitch.
        neighbours_ok = all(check(t, i) for i, t in keep.items())
        # Snapshots show the stitched range.
        gsnap = gmlake.snapshot()
        stitched_segments = [sg for sg in gsnap["segments"] if sg["stitched"]]
        big_ptr = big.data_ptr()
        in_stitched = any(sg["address"] <= big_ptr < sg["address"] + sg["total_size"] for sg in stitched_segments)
        tsnap = torch.cuda.memory._snapshot()
        found = False
        for seg in tsnap["segments"]:
            addr = seg["address"]
            for b in seg["blocks"]:
                if addr == big_ptr and b["state"] == "active_allocated" and b["size"] >= 4 * blk:
                    found = True
                addr += b["size"]
        # Free everything: memory goes back to the device.
        del big, f, g, keep, ref, rows, v
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps a workspace allocated
        torch.cuda.empty_cache()
        s2 = gmlake.stats()
        result(stitched=stitched, pages=pages, new_physical=new_physical, whole_ok=whole_ok,
               pages_ok=pages_ok, per_page=per_page, mm_same=mm_same, neighbours_ok=neighbours_ok,
               in_stitched=in_stitched, torch_snapshot_has_block=found, page=page,
               reserved_after=s2["reserved_bytes.all.current"],
               allocated_after=s2["allocated_bytes.all.current"])
        """),
    )
    res = r.result
    print({k: v for k, v in res.items() if k != "per_page"})
    assert res["stitched"] >= 1, "no stitch happened"
    assert res["pages"] >= 1
    assert res["whole_ok"] and res["pages_ok"] and all(res["per_page"])
    assert res["mm_same"]
    assert res["neighbours_ok"], "a live block changed when its neighbours were stitched"
    assert res["in_stitched"], "gmlake.snapshot() does not mark the stitched range"
    assert res["torch_snapshot_has_block"], "torch.cuda.memory._snapshot() lacks the stitched block"
    assert res["allocated_after"] == 0
    assert res["reserved_after"] == 0, "empty_cache left physical memory reserved"


def test_memory_stats_match_live_tensors():
    r = run_python(
        "stats",
        """
        def rnd(n):
            return (n + 511) // 512 * 512
        torch.cuda.init()
        base = torch.cuda.memory_stats()
        sizes = [1, 100, 512, 1000, 4096, MiB, MiB + 1, 5 * MiB, 33 * MiB + 7, 200 * MiB]
        ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        s = torch.cuda.memory_stats()
        d = lambda k: s[k] - base.get(k, 0)
        small = [n for n in sizes if n <= MiB]
        out = dict(
            alloc=d("allocation.all.current"),
            alloc_small=d("allocation.small_pool.current"),
            alloc_large=d("allocation.large_pool.current"),
            requested=d("requested_bytes.all.current"),
            allocated=d("allocated_bytes.all.current"),
            active=d("active_bytes.all.current"),
            reserved=s["reserved_bytes.all.current"],
            allocated_total=s["allocated_bytes.all.current"],
            memory_allocated=torch.cuda.memory_allocated(),
            memory_reserved=torch.cuda.memory_reserved(),
            max_allocated=torch.cuda.max_memory_allocated(),
            expect_requested=sum(sizes), expect_allocated=sum(rnd(n) for n in sizes),
            expect_small=len(small), expect_large=len(sizes) - len(small), n=len(sizes),
            keys_missing=[k for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                      "num_device_alloc", "num_device_free", "max_split_size",
                                      "oversize_allocations.current", "inactive_split_bytes.all.current",
                                      "segment.all.current") if k not in s],
        )
        del ts
        s2 = torch.cuda.memory_stats()
        out["alloc_after_free"] = s2["allocation.all.current"] - base.get("allocation.all.current", 0)
        out["allocated_after_free"] = s2["allocated_bytes.all.current"] - base.get("allocated_bytes.all.current", 0)
        out["freed_count"] = s2["allocation.all.freed"] - base.get("allocation.all.freed", 0)
        torch.cuda.reset_peak_memory_stats()
        out["peak_after_reset"] = torch.cuda.max_memory_allocated()
        out["current_after_reset"] = torch.cuda.memory_allocated()
        out["summary_ok"] = "gmlake" in torch.cuda.memory_summary() or len(torch.cuda.memory_summary()) > 100
        result(**out)
        """,
    )
    res = r.result
    print(res)
    assert res["keys_missing"] == []
    assert res["alloc"] == res["n"]
    assert res["alloc_small"] == res["expect_small"] and res["alloc_large"] == res["expect_large"]
    assert res["requested"] == res["expect_requested"]
    assert res["allocated"] == res["expect_allocated"]
    assert res["active"] >= res["allocated"]
    assert res["reserved"] >= res["allocated_total"]
    assert res["memory_allocated"] == res["allocated_total"]
    assert res["max_allocated"] >= res["allocated_total"]
    assert res["alloc_after_free"] == 0 and res["allocated_after_free"] == 0
    assert res["freed_count"] == res["n"]
    assert res["peak_after_reset"] == res["current_after_reset"]


def test_empty_cache_returns_physical_memory():
    r = run_python(
        "empty_cache",
        """
        torch.cuda.init()
        torch.cuda.synchronize()
        f0, total = torch.cuda.mem_get_info()
        ts = [torch.ones(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(16)]  # 4 GiB
        torch.cuda.synchronize()
        f1, _ = torch.cuda.mem_get_info()
        del ts
        torch.cuda.synchronize()
        f2, _ = torch.cuda.mem_get_info()
        reserved_cached = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        f3, _ = torch.cuda.mem_get_info()
        result(f0=f0, f1=f1, f2=f2, f3=f3, reserved_cached=reserved_cached,
               reserved_after=torch.cuda.memory_reserved())
        """,
    )
    res = r.result
    print(res)
    four = 4 << 30
    assert res["f0"] - res["f1"] >= 0.95 * four, "allocations did not take device memory"
    assert res["reserved_cached"] >= four, "freed memory should stay cached until empty_cache"
    assert res["f3"] - res["f2"] >= 0.95 * four, "empty_cache did not return the memory (cudaMemGetInfo)"
    assert res["reserved_after"] == 0


def test_out_of_memory_raises_and_process_recovers():
    r = run_python(
        "oom",
        """
        calls = []
        if hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
            torch._C._cuda_attach_out_of_memory_observer(lambda *a: calls.append(a))
        total = torch.cuda.get_device_properties(0).total_memory
        out = {}
        # 1. A request larger than the device.
        try:
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
            out["huge_raised"] = False
        except torch.OutOfMemoryError as e:
            out["huge_raised"] = True
            out["huge_msg"] = str(e)[:600]
        x = torch.ones(GiB, dtype=torch.uint8, device="cuda")
        out["after_huge_ok"] = bool(x.sum().item() == GiB)
        del x
        # 2. Fill up to a memory fraction, then recover.
        torch.cuda.set_per_process_memory_fraction(0.25)
        out["fraction"] = torch.cuda.get_per_process_memory_fraction() if hasattr(torch.cuda, "get_per_process_memory_fraction") else None
        chunks = []
        try:
            while len(chunks) < 1000:
                chunks.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
            out["fill_raised"] = False
        except torch.OutOfMemoryError as e:
            out["fill_raised"] = True
            out["fill_msg"] = str(e)[:600]
        out["chunks"] = len(chunks)
        out["expected_chunks"] = int(0.25 * total) // GiB
        del chunks[::2]
        y = torch.full((GiB,), 3, dtype=torch.uint8, device="cuda")
        out["after_fill_ok"] = bool((y == 3).all().item())
        del chunks, y
        torch.cuda.set_per_process_memory_fraction(1.0)
        z = torch.ones(4 * GiB, dtype=torch.uint8, device="cuda")
        out["after_reset_ok"] = bool(z.sum().item() == 4 * GiB)
        s = torch.cuda.memory_stats()
        out["num_ooms"] = s["num_ooms"]
        out["observer_calls"] = len(calls)
        result(**out)
        """,
    )
    res = r.result
    print(res)
    assert res["huge_raised"], "no torch.OutOfMemoryError for a request larger than the device"
    assert "gmlake" in res["huge_msg"] and "Tried to allocate" in res["huge_msg"], res["huge_msg"]
    # PyTorch's own sentence comes first, as native writes it (tools match on it).
    assert re.match(r"CUDA out of memory\. Tried to allocate [0-9.]+ [GMK]iB\. GPU [0-9]+ has a total "
                    r"capacity of [0-9.]+ GiB of which [0-9.]+ [GMK]iB is free\.", res["huge_msg"]), res["huge_msg"]
    assert res["after_huge_ok"]
    assert res["fill_raised"]
    assert res["expected_chunks"] - 2 <= res["chunks"] <= res["expected_chunks"] + 1, res
    assert res["after_fill_ok"] and res["after_reset_ok"]
    assert res["num_ooms"] >= 2
    assert res["observer_calls"] >= 2


def test_record_stream_delays_reuse():
    # x is read on a side stream by a kernel queued behind ~1 s of kernels; x is freed on the
    # main stream right away and a same-size tensor is allocated and overwritten there. If
    # gmlake handed out x's memory before the side stream's work completed (checked
    # structurally: same address while the side stream is busy) the read could see the
    # overwrite (-7 * 2) instead of 2. Nothing between queuing the long kernel and the
    # allocation may wait for the GPU: statistics are read before (cuMemGetInfo was seen
    # waiting for the GPU to be idle), and z fits a cached block (no driver call).
    code = """
    N = 64 * MiB  # floats: 256 MiB
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    torch.ones(1, device="cuda")
    torch.cuda._sleep(1000)  # warm up the sleep kernel
    torch.cuda.synchronize()
    def stats():
        return gmlake.stats() if ALLOCATOR == "gmlake" else torch.cuda.memory_stats()
    def deltas(a, b):
        return {k: b[k] - a.get(k, 0) for k in b if (k.startswith("gmlake.driver_calls") or k.startswith("num_"))
                and isinstance(b[k], int) and b[k] != a.get(k)}
    x = torch.full((N,), 1.0, device="cuda")
    # Load every kernel used below before the long kernels run: with CUDA's lazy module
    # loading, the first launch of a kernel waits for the device, which let the side stream
    # finish before the allocation under test (seen on the H100). w stays alive so that it
    # leaves no free block behind.
    w = torch.empty(N, device="cuda")
    torch.mul(x, 2, out=w)
    w.fill_(-7.0)
    bool((w == 2).all().item()); bool((w == -14).any().item())
    torch.cuda.synchronize()
    # A cached block a little larger than x, so that z can be served without new physical
    # memory (creating and mapping memory was seen waiting for the GPU). A best fit that
    # ignored x's pending free would still pick x's exact-size block.
    spare = torch.empty(N + 512 * 1024, device="cuda")
    del spare
    s0 = stats()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        y = torch.empty(N, device="cuda")   # allocated before the long kernel is queued
        # Two ~0.5 s spins: one _sleep(2_000_000_000) was seen returning at once on the H100
        # (torch 2.11), apparently a 32-bit wrap of its cycle count; 1e9 does spin.
        torch.cuda._sleep(1_000_000_000)
        torch.cuda._sleep(1_000_000_000)
        torch.mul(x, 2, out=y)
    if RECORD:
        x.record_stream(side)
    xp = x.data_ptr()
    t0 = time.perf_counter()
    del x
    z = torch.empty(N, device="cuda")
    alloc_s = time.perf_counter() - t0
    side_busy = not side.query()
    zp = z.data_ptr()
    z.fill_(-7.0)
    torch.cuda.synchronize()
    main_deltas = deltas(s0, stats())
    ok = bool((y == 2).all().item())
    corrupted = bool((y == -14).any().item())
    del y, z, w
    torch.cuda.synchronize()
    # Diagnostics (reported, not asserted): does the host wait for a busy stream when
    # (a) an allocation needs new physical memory (cuMemCreate / cuMemMap / cuMemSetAccess),
    # (b) the device's free memory is read (cuMemGetInfo)?
    s1 = stats()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
    t1 = time.perf_counter()
    fresh = torch.empty(768 * MiB, dtype=torch.uint8, device="cuda")
    fresh_alloc_s = time.perf_counter() - t1
    busy_after_fresh = not side.query()
    t2 = time.perf_counter()
    torch.cuda.mem_get_info()
    mem_get_info_s = time.perf_counter() - t2
    busy_after_mem_get_info = not side.query()
    torch.cuda.synchronize()
    fresh_deltas = deltas(s1, stats())
    result(ok=ok, corrupted=corrupted, same_ptr=(zp == xp), side_busy_at_alloc=side_busy,
           early_reuse=(zp == xp) and side_busy, alloc_s=alloc_s, main_deltas=main_deltas,
           fresh_alloc_s=fresh_alloc_s, busy_after_fresh_alloc=busy_after_fresh,
           fresh_deltas=fresh_deltas, mem_get_info_s=mem_get_info_s,
           busy_after_mem_get_info=busy_after_mem_get_info)
    """
    r = run_python("record_stream", "RECORD = True\n" + dedent(code))
    res = r.result
    print("record_stream:", res)
    c = run_python("record_stream_control", "RECORD = False\n" + dedent(code)).result
    print("control without record_stream (informational):", c)
    write_out("record_stream.json", {"record_stream": res, "control": c})
    assert res["side_busy_at_alloc"], (
        f"the side stream was idle when z was allocated ({res['alloc_s']:.3f} s after the free; "
        f"stat deltas {res['main_deltas']}): something waited for the GPU, the check proves nothing")
    assert not res["early_reuse"], "x's memory was handed out while the side stream still used it"
    assert res["ok"] and not res["corrupted"], "memory reused before the side stream finished with it"
    if c["side_busy_at_alloc"] and c["same_ptr"]:
        print("control: without record_stream the memory is reused at once"
              + (" and the side stream read the overwrite" if c["corrupted"] else ""))
