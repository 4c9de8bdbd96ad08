"""torch.cuda.memory._record_memory_history / _snapshot / _dump_snapshot and memory_viz."""

from harness import run_python


def test_memory_history_snapshot_and_viz(tmp_path):
    dump = tmp_path / "snapshot.pickle"
    r = run_python(
        "history",
        f"""
        import pickle
        from torch.cuda import _memory_viz
        torch.cuda.memory._record_memory_history(max_entries=100000)
        def allocate_in_named_function():
            return [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 3 * MiB, 40 * MiB)]
        ts = allocate_in_named_function()
        del ts[1]
        # Force a stitch so that stitched segments appear in the snapshot.
        blocks = [torch.empty(32 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del blocks[::2]
        big = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        traces = snap["device_traces"][0]
        actions = sorted({{t["action"] for t in traces}})
        alloc_frames = [t for t in traces if t["action"] == "alloc" and t.get("frames")]
        named = any(any(f["name"] == "allocate_in_named_function" for f in t["frames"]) for t in alloc_frames)
        block_frames = 0
        stitched_ptr_in_segments = False
        for seg in snap["segments"]:
            addr = seg["address"]
            for b in seg["blocks"]:
                if b["state"] == "active_allocated" and b.get("frames"):
                    block_frames += 1
                if addr == big.data_ptr():
                    stitched_ptr_in_segments = True
                addr += b["size"]
        settings = snap.get("allocator_settings", {{}})
        torch.cuda.memory._dump_snapshot({str(dump)!r})
        with open({str(dump)!r}, "rb") as f:
            loaded = pickle.load(f)
        html_trace = _memory_viz.trace_plot(loaded)
        html_segments = _memory_viz.segment_plot(loaded)
        summary = _memory_viz.segsum(loaded)
        torch.cuda.memory._record_memory_history(enabled=None)
        after = torch.cuda.memory._snapshot()
        result(actions=actions, alloc_with_frames=len(alloc_frames), named=named,
               block_frames=block_frames, stitched_ptr_in_segments=stitched_ptr_in_segments,
               settings=str(settings.get("PYTORCH_CUDA_ALLOC_CONF", "")),
               html=len(html_trace) + len(html_segments), summary=len(summary),
               traces_after_disable=len(after["device_traces"][0]) if after["device_traces"] else 0,
               stitches=gmlake.stats()["gmlake.stitches"])
        """,
    )
    res = r.result
    print(res)
    assert {"alloc", "free_requested", "free_completed"} <= set(res["actions"]), res["actions"]
    assert {"segment_map", "segment_alloc"} & set(res["actions"]), res["actions"]
    assert res["alloc_with_frames"] > 0 and res["named"], "allocation traces lack Python frames"
    assert res["block_frames"] > 0, "live blocks lack their allocation frames"
    assert res["stitches"] >= 1 and res["stitched_ptr_in_segments"]
    assert res["settings"].startswith("backend:gmlake"), res["settings"]
    assert res["html"] > 1000 and res["summary"] > 0
    assert res["traces_after_disable"] == 0


def test_host_timing_says_where_a_slow_call_went():
    """`host_timing:1`: a slow allocation (4 GiB: 2,048 pages created and mapped) is kept in
    gmlake.snapshot()["slow_calls"] with where its time went: its driver calls, all timed, the
    slowest named by kind, and no wait for the lock (one thread)."""
    r = run_python(
        "host_timing_slow_call_split",
        """
        big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        calls = [c for c in gmlake.snapshot()["slow_calls"] if c["size"] == 4 << 30]
        result(calls=calls)
        """,
        conf="host_timing:1",
    )
    calls = r.result["calls"]
    print(calls)
    assert len(calls) == 1, calls
    c = calls[0]
    assert c["op"] == "alloc" and c["driver_calls"] >= 2 * 2048, c
    assert 0 < c["slowest_driver_ns"] <= c["driver_ns"] <= c["ns"], c
    assert c["slowest_driver"] in ("create_physical", "release_physical", "reserve_va", "free_va",
                                   "map", "unmap", "set_access", "create_event", "record_event",
                                   "query_event", "stream_wait", "synchronize"), c
    assert c["lock_wait_ns"] == 0, c
