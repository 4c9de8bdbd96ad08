//! Bridge tests over the simulated device (no GPU needed).

use super::*;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn sim(capacity: u64, conf: &str) -> Box<Gmlake> {
    new_simulated_allocator(capacity, 0, conf).expect("simulated allocator")
}

#[test]
fn a_panic_becomes_an_error() {
    let r: Result<(), String> = guard("test", || panic!("boom {}", 42));
    let e = r.unwrap_err();
    assert!(
        e.contains("panic") && e.contains("test") && e.contains("boom 42"),
        "{e}"
    );
    let r: Result<(), String> = guard("test", || std::panic::panic_any(7u32));
    assert!(r.unwrap_err().contains("unknown panic payload"));
}

#[test]
fn invalid_conf_names_key_and_value() {
    let e = check_conf("defragLevel:high").unwrap_err();
    assert!(e.contains("defragLevel") && e.contains("high"), "{e}");
    let e = check_conf("nonsense:1").unwrap_err();
    assert!(e.contains("nonsense"), "{e}");
    let e = new_simulated_allocator(GIB, 0, "fragLimit").err().unwrap();
    assert!(e.contains("fragLimit"), "{e}");
    let ok = check_conf("stitch_strategy:lru,fragLimit:2MiB").unwrap();
    let get = |k: &str| ok.iter().find(|kv| kv.key == k).map(|kv| kv.value.clone());
    assert_eq!(get("stitch_strategy").as_deref(), Some("lru"));
    assert_eq!(get("fragLimit").as_deref(), Some("2097152"));
}

#[test]
fn bad_granularity_is_an_error() {
    assert!(new_simulated_allocator(GIB, 3 * MIB, "").is_err());
}

#[test]
fn allocate_free_and_stats() {
    let a = sim(GIB, "");
    assert_eq!(a.backend_name(), "simulated");
    let r = a.allocate(3 * MIB, 0);
    assert_eq!(r.status, AllocStatus::Allocated, "{}", r.message);
    assert_ne!(r.ptr, 0);
    let s = a.stats().unwrap();
    assert!(s.allocated_bytes[0].current >= (3 * MIB) as i64);
    assert_eq!(s.requested_bytes[0].current, (3 * MIB) as i64);
    let info = a.allocation(r.ptr + 17).unwrap();
    assert!(info.found && info.ptr == r.ptr && info.size >= 3 * MIB);
    assert_eq!(a.free_ptr(r.ptr).status, FreeStatus::Done);
    assert_eq!(
        a.free_ptr(r.ptr).status,
        FreeStatus::DoubleFree,
        "double free is reported, not thrown"
    );
    assert_eq!(
        a.free_ptr(0xdead_0000).status,
        FreeStatus::UnknownPointer,
        "foreign pointers are told apart"
    );
    assert_eq!(
        a.record_stream(0xdead_0000, 5).status,
        FreeStatus::UnknownPointer
    );
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes[0].current, 0);
    assert_eq!(
        a.reserved_bytes().unwrap(),
        s.reserved_bytes[0].current as u64
    );
    assert!(s.driver_calls_total > 0);
    assert_eq!(s.driver_calls.len(), 12);
    let j = a.stats_json().unwrap();
    assert!(j.contains("\"gmlake.stitches\":"), "{j}");
    // The freed memory is cached: a largest free mapped block exists, within the cache.
    let largest: u64 = j
        .split("\"gmlake.largest_free_block\":")
        .nth(1)
        .and_then(|t| t.split([',', '}']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no gmlake.largest_free_block in {j}"));
    assert!(
        largest > 0 && largest <= a.stats().unwrap().counter("cached_bytes"),
        "{j}"
    );
    a.empty_cache().unwrap();
    assert_eq!(a.stats().unwrap().reserved_bytes[0].current, 0);
}

#[test]
fn out_of_memory_is_told_apart() {
    let a = sim(64 * MIB, "");
    let r = a.allocate(GIB, 0);
    assert_eq!(r.status, AllocStatus::OutOfMemory, "{}", r.message);
    assert_eq!(r.requested, GIB);
    assert!(r.device_total >= 64 * MIB);
    assert!(!r.message.is_empty());
    // The allocator keeps working after an OOM.
    let r = a.allocate(8 * MIB, 0);
    assert_eq!(r.status, AllocStatus::Allocated, "{}", r.message);
    assert_eq!(a.stats().unwrap().num_ooms, 1);
}

#[test]
fn stitching_shows_in_stats_and_snapshot() {
    let a = sim(64 * MIB, "");
    // Fill the device with 2 MiB blocks, free every other one, then ask for more than any
    // free block: only a stitch can serve it.
    let mut ptrs = Vec::new();
    loop {
        let r = a.allocate(2 * MIB, 0);
        if r.status != AllocStatus::Allocated {
            break;
        }
        ptrs.push(r.ptr);
    }
    assert!(ptrs.len() >= 8);
    for p in ptrs.iter().step_by(2) {
        assert_eq!(a.free_ptr(*p).status, FreeStatus::Done);
    }
    let r = a.allocate(6 * MIB, 0);
    assert_eq!(r.status, AllocStatus::Allocated, "{}", r.message);
    let s = a.stats().unwrap();
    assert!(s.counter("stitches") >= 1, "a stitch served the request");
    let snap = a.snapshot().unwrap();
    assert!(snap.segments.iter().any(|s| s.stitched));
    assert!(a.snapshot_json().unwrap().contains("\"stitched\":true"));
}

#[test]
fn graph_pools_and_captures() {
    let a = sim(GIB, "");
    a.begin_capture(1, 0).unwrap();
    let r = a.allocate_in_pool(4 * MIB, 9, 1, 0);
    assert_eq!(r.status, AllocStatus::Allocated, "{}", r.message);
    let info = a.allocation(r.ptr).unwrap();
    assert_eq!((info.pool_first, info.pool_second), (1, 0));
    assert_eq!(a.free_ptr(r.ptr).status, FreeStatus::Done);
    a.end_capture(1, 0).unwrap();
    assert!(a.end_capture(1, 0).is_err(), "unbalanced end");
    a.release_pool(1, 0).unwrap();
}

#[test]
fn history_round_trip() {
    let a = sim(GIB, "");
    a.set_history(1000).unwrap();
    let r = a.allocate(MIB, 3);
    a.free_ptr(r.ptr);
    let h = a.take_history().unwrap();
    assert!(h
        .iter()
        .any(|e| e.action == ffi::TraceAction::ALLOC && e.addr == r.ptr && e.stream == 3));
    assert!(h
        .iter()
        .any(|e| e.action == ffi::TraceAction::FREE_REQUESTED && e.addr == r.ptr));
    assert!(a.take_history().unwrap().is_empty());
}

#[test]
fn simulated_device_has_no_peers() {
    let a = sim(GIB, "");
    assert!(a.add_peer(1).unwrap_err().contains("no peers"));
}

#[test]
fn memory_fraction_round_trip() {
    let a = sim(GIB, "");
    assert!(a.memory_fraction().unwrap() < 0.0);
    a.set_memory_fraction(0.5).unwrap();
    assert_eq!(a.memory_fraction().unwrap(), 0.5);
    assert!(a.set_memory_fraction(1.5).is_err());
    a.set_memory_fraction(0.0).unwrap();
    assert_eq!(a.memory_fraction().unwrap(), 0.0);
}

#[test]
fn allocate_rounded_places_the_rounded_size() {
    let a = sim(GIB, "");
    let r = a.allocate_rounded(1000, 4096, 7, 0, 0, false);
    assert_eq!(r.status, AllocStatus::Allocated, "{}", r.message);
    let rec = a.allocation(r.ptr).unwrap();
    assert_eq!((rec.size, rec.requested), (4096, 1000));
    assert_eq!(a.free_ptr(r.ptr).status, FreeStatus::Done);
    a.begin_capture(5, 0).unwrap();
    let r = a.allocate_rounded(1000, 2 << 20, 7, 5, 0, true);
    assert_eq!(r.status, AllocStatus::Allocated, "{}", r.message);
    let rec = a.allocation(r.ptr).unwrap();
    assert_eq!((rec.size, rec.pool_first), (2 << 20, 5));
    a.record_stream(r.ptr, 9);
    assert_eq!(a.stream_uses(r.ptr), vec![9]);
    assert_eq!(a.clear_stream_uses(r.ptr).status, FreeStatus::Done);
    assert!(a.stream_uses(r.ptr).is_empty());
    assert_eq!(a.free_ptr(r.ptr).status, FreeStatus::Done);
    a.end_capture(5, 0).unwrap();
}

#[test]
fn a_freed_pool_block_is_recreated_at_its_address() {
    let a = sim(GIB, "");
    a.begin_capture(3, 0).unwrap();
    let r = a.allocate_in_pool(MIB, 7, 3, 0);
    assert_eq!(r.status, AllocStatus::Allocated, "{}", r.message);
    let keep = a.allocate_in_pool(MIB, 7, 3, 0);
    assert_eq!(a.free_ptr(r.ptr).status, FreeStatus::Done);
    a.end_capture(3, 0).unwrap();
    a.allocate_at(r.ptr, MIB, MIB, 7, 3, 0).unwrap();
    let info = a.allocation(r.ptr).unwrap();
    assert!(info.found && info.size == MIB && (info.pool_first, info.pool_second) == (3, 0));
    let e = a.allocate_at(keep.ptr, MIB, MIB, 7, 3, 0).unwrap_err();
    assert!(!e.is_empty());
}

#[test]
fn ipc_share_open_close_through_the_bridge() {
    let a = sim(GIB, "");
    let pad = a.allocate(MIB, 0);
    let r = a.allocate(5 * MIB, 0);
    assert_eq!(
        (pad.status, r.status),
        (AllocStatus::Allocated, AllocStatus::Allocated)
    );
    let share = a.share_ipc(r.ptr).unwrap();
    assert_eq!(
        ipc_handle_kind(&share.handle).unwrap(),
        IpcHandleKind::Pages
    );
    assert_eq!(share.offset, r.ptr % (2 * MIB));
    // The simulated device is one GPU: opening the handle maps the same pages again.
    let base = a.open_ipc(&share.handle).unwrap();
    assert_eq!(base % (2 * MIB), 0);
    let s = a.stats().unwrap();
    assert_eq!((s.counter("ipc_shares"), s.counter("ipc_imports")), (1, 1));
    assert_eq!(s.counter("ipc_imported_bytes"), 6 * MIB);
    assert!(a
        .stats_json()
        .unwrap()
        .contains("\"gmlake.ipc_imported_bytes\":6291456"));
    a.close_ipc(base, 0).unwrap();
    assert!(a
        .close_ipc(base, 0)
        .unwrap_err()
        .contains("not allocated by gmlake"));
    assert_eq!(a.stats().unwrap().counter("ipc_imports"), 0);
}

#[test]
fn bad_ipc_handles_are_errors() {
    let a = sim(GIB, "");
    assert!(ipc_handle_kind(&[]).unwrap_err().contains("empty"));
    assert!(ipc_handle_kind(&[2, b'z'])
        .unwrap_err()
        .contains("unknown handle type"));
    let mut c = vec![2u8, b'c'];
    c.extend([0u8; 64]);
    assert_eq!(ipc_handle_kind(&c).unwrap(), IpcHandleKind::CudaMalloc);
    assert!(a.open_ipc(&c).unwrap_err().contains("cudaIpcOpenMemHandle"));
    let e = a
        .open_ipc(&gmlake_core::ipc::encode_pages(1, 2 * MIB, &[77]))
        .unwrap_err();
    assert!(e.contains("77"), "{e}");
    assert!(a
        .share_ipc(0xdead000)
        .unwrap_err()
        .contains("not allocated by gmlake"));
    assert_eq!(a.stats().unwrap().counter("ipc_imports"), 0);
}

#[test]
fn stats_json_says_whether_the_allocator_exists() {
    let empty = empty_stats_json();
    assert!(empty.contains("\"gmlake.initialized\":0"), "{empty}");
    assert!(empty.contains("\"gmlake.stitches\":0"), "{empty}");
    assert!(empty.contains("\"gmlake.largest_free_block\":0"), "{empty}");
    let live = sim(GIB, "").stats_json().unwrap();
    assert!(live.contains("\"gmlake.initialized\":1"), "{live}");
}

/// The keys of a flat JSON object as this crate writes it.
fn json_keys(j: &str) -> Vec<String> {
    let mut keys: Vec<String> = j
        .split(['{', ','])
        .filter_map(|part| part.trim().strip_prefix('"')?.split_once("\":"))
        .map(|(k, _)| k.to_string())
        .collect();
    keys.sort();
    keys
}

/// python/tests/data/stats-sim.json (what the metrics tests feed their stub) has the keys of
/// the real statistics: when they change, regenerate it with
/// `GMLAKE_UPDATE_FIXTURES=1 cargo test -p gmlake-ffi the_python_stats_fixture` (16
/// allocations of 24 MiB, every other one freed, then 100 MiB, on a simulated 1 GiB device).
#[test]
fn the_python_stats_fixture_has_the_real_keys() {
    let fixture = include_str!("../../../python/tests/data/stats-sim.json");
    let a = sim(GIB, "");
    let mut ptrs = vec![];
    for _ in 0..16 {
        ptrs.push(a.allocate(24 * MIB, 0).ptr);
    }
    for p in ptrs.iter().step_by(2) {
        assert_eq!(a.free_ptr(*p).status, FreeStatus::Done);
    }
    assert_eq!(a.allocate(100 * MIB, 0).status, AllocStatus::Allocated);
    let live = a.stats_json().unwrap();
    if std::env::var_os("GMLAKE_UPDATE_FIXTURES").is_some() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../python/tests/data/stats-sim.json"
        );
        std::fs::write(path, format!("{live}\n")).unwrap();
        return;
    }
    assert!(json_keys(fixture).len() > 100, "{fixture}");
    assert_eq!(json_keys(fixture), json_keys(&live));
    assert!(live.contains("\"gmlake.stitches\":1"), "{live}");
}

#[test]
fn debug_mode_through_the_bridge() {
    let off = sim(GIB, "");
    assert_eq!(off.debug_mode().unwrap(), 0);
    assert!(!off
        .config()
        .unwrap()
        .iter()
        .any(|kv| kv.key.starts_with("debug")));
    let e = check_conf("debug:guard+sparkles").unwrap_err();
    assert!(e.contains("debug") && e.contains("sparkles"), "{e}");
    let g = sim(GIB, "debug:guard+canary+poison");
    assert_eq!(g.debug_mode().unwrap(), 0b111);
    let big = g.allocate(4 * MIB + 100, 0);
    assert_eq!(big.status, AllocStatus::Allocated, "{}", big.message);
    let a = g.allocation(big.ptr + 10).unwrap();
    assert!(a.found && a.ptr == big.ptr && a.requested == 4 * MIB + 100);
    assert_eq!(
        (big.ptr + a.size) % (2 * MIB),
        0,
        "a guarded block ends at its mapped end"
    );
    let small = g.allocate(1000, 0);
    let a = g.allocation(small.ptr).unwrap();
    assert_eq!((a.size, a.requested), (1536, 1000), "padded for the canary");
    g.debug_canary_error("test report").unwrap();
    let json = g.stats_json().unwrap();
    for k in [
        "\"gmlake.debug_guarded\":1",
        "\"gmlake.debug_guard_bytes\":2097152",
        "\"gmlake.debug_canary_errors\":1",
    ] {
        assert!(json.contains(k), "{k} not in {json}");
    }
    assert_eq!(g.free_ptr(big.ptr).status, FreeStatus::Done);
    assert_eq!(g.free_ptr(small.ptr).status, FreeStatus::Done);
    let q = sim(GIB, "debug:all");
    assert_eq!(q.debug_mode().unwrap(), 0b1111);
    let kv = q.config().unwrap();
    let get = |k: &str| kv.iter().find(|kv| kv.key == k).map(|kv| kv.value.clone());
    assert_eq!(
        get("debug").as_deref(),
        Some("guard+canary+poison+quarantine")
    );
    assert_eq!(get("debug_quarantine").as_deref(), Some("256"));
}

/// The bridge's own device stack (the capture-aware decorator over the device, as in a
/// PyTorch process) makes `cross_stream_wait` work: a miss on stream 2 that needs what stream 1
/// freed while stream 1's work is still queued waits for it on the device and takes its
/// pages, instead of creating memory. (The decorator once swallowed the call: every wait
/// failed on GPUs, and only this composition shows it without one.)
#[test]
fn cross_stream_waits_reach_the_device_through_the_bridge() {
    let run = |conf: &str| {
        let dev = SimDevice::new(GIB).pending_from(1);
        let a = backend::make_alloc(dev, config_from(conf).unwrap()).unwrap();
        let p = a.allocate(40 * MIB, 1).unwrap();
        a.free(p).unwrap();
        let before = a.reserved_bytes();
        a.allocate(40 * MIB, 2).unwrap();
        let s = a.stats();
        (
            a.reserved_bytes() - before,
            s.driver_calls.stream_wait,
            s.stream_waits_failed,
        )
    };
    assert_eq!(
        run(""),
        (0, 1, 0),
        "the default waits and takes stream 1's pages"
    );
    let (grown, waits, _) = run("cross_stream_wait:0");
    assert_eq!((grown, waits), (40 * MIB, 0), "without it, new memory");
}

#[test]
fn host_timing_counts_the_calls_it_times_and_is_absent_when_off() {
    let counter = |j: &str, k: &str| -> Option<u64> {
        let key = format!("\"gmlake.{k}\":");
        let at = j.find(&key)? + key.len();
        j[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let off = sim(GIB, "");
    let r = off.allocate(MIB, 0);
    off.free_ptr(r.ptr);
    assert_eq!(
        counter(&off.stats_json().unwrap(), "host_calls_alloc"),
        None
    );

    let a = sim(GIB, "host_timing:1");
    let ptrs: Vec<u64> = (0..5).map(|i| a.allocate((i + 1) * MIB, 0).ptr).collect();
    for &p in &ptrs[..3] {
        assert_eq!(a.free_ptr(p).status, FreeStatus::Done);
    }
    // A failed free is timed too: it is a call the job made.
    assert_eq!(a.free_ptr(0xdead_0000).status, FreeStatus::UnknownPointer);
    let j = a.stats_json().unwrap();
    assert_eq!(counter(&j, "host_calls_alloc"), Some(5), "{j}");
    assert_eq!(counter(&j, "host_calls_free"), Some(4), "{j}");
    // Creating and mapping pages takes time even on the simulated device.
    assert!(counter(&j, "host_ns_alloc").unwrap() > 0, "{j}");
    assert!(counter(&j, "host_ns_free").is_some(), "{j}");
}

/// `host_timing` keeps the calls that took 50 µs or more, with their start in Unix time, in
/// the snapshot (`slow_calls`), to place them on a profiler's timeline. A 16 GiB allocation
/// creates and maps 8,192 pages: slow even on the simulated device. Without `host_timing` the
/// list is empty.
#[test]
fn host_timing_keeps_slow_calls_with_their_start() {
    let unix_ns = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    };
    let off = sim(64 * GIB, "");
    off.allocate(16 * GIB, 0);
    assert!(off.snapshot_json().unwrap().contains("\"slow_calls\":[]"));

    let a = sim(64 * GIB, "host_timing:1");
    let before = unix_ns();
    let big = a.allocate(16 * GIB, 0);
    assert_eq!(big.status, AllocStatus::Allocated);
    let after = unix_ns();
    assert_eq!(a.free_ptr(big.ptr).status, FreeStatus::Done);
    let j = a.snapshot_json().unwrap();
    let at = j.find("\"slow_calls\":[").expect("slow_calls") + "\"slow_calls\":[".len();
    let list = &j[at..j[at..].find(']').unwrap() + at];
    let entries: Vec<&str> = list.split("},{").collect();
    let big_calls: Vec<&str> = entries
        .iter()
        .copied()
        .filter(|e| e.contains(&format!("\"size\":{}", 16 * GIB)))
        .collect();
    assert_eq!(big_calls.len(), 1, "one 16 GiB allocation: {list}");
    let e = big_calls[0];
    assert!(e.contains("\"op\":\"alloc\""), "{e}");
    let num = |k: &str| -> u64 {
        let key = format!("\"{k}\":");
        let at = e.find(&key).unwrap() + key.len();
        e[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (start, ns) = (num("start_unix_ns"), num("ns"));
    assert!(ns >= 50_000, "{e}");
    // The start comes from a clock read at creation plus a monotonic interval: within a
    // millisecond of the wall clock around the call.
    assert!(
        start + 1_000_000 >= before && start <= after + 1_000_000,
        "{start} not within [{before}, {after}]"
    );
    assert!(start + ns <= after + 1_000_000, "{e}");
    // Where its time went: its driver calls (8,192 pages created and mapped), all timed, the
    // slowest named; no wait for the lock (one thread).
    let (driver_ns, calls, slowest_ns) = (
        num("driver_ns"),
        num("driver_calls"),
        num("slowest_driver_ns"),
    );
    assert!(calls >= 2 * 8_192, "{e}");
    assert!(
        driver_ns > 0 && driver_ns <= ns && slowest_ns <= driver_ns,
        "{e}"
    );
    assert_eq!(num("lock_wait_ns"), 0, "{e}");
    assert!(
        e.contains("\"slowest_driver\":\"") && !e.contains("\"slowest_driver\":\"\""),
        "{e}"
    );
}

/// The core's notices (here the driver-share watch's, with a threshold any driver call
/// crosses) are taken by the allocation after which they were queued, and printed; the
/// allocation itself is unaffected.
#[test]
fn the_bridge_takes_the_cores_notices() {
    let a = sim(8 * GIB, "driver_share_notice:0.000001");
    a.alloc
        .set_driver_share_window(std::time::Duration::from_millis(2));
    let mut live: Vec<u64> = (0..32)
        .map(|i| a.allocate((3 + i % 7) * MIB + 512, 0).ptr)
        .collect();
    let t0 = std::time::Instant::now();
    let mut n = 0u64;
    while a.stats().unwrap().counter("driver_share_notices") == 0 {
        assert!(t0.elapsed().as_secs() < 20, "no notice after {n} pairs");
        let j = (n * 7919 % live.len() as u64) as usize;
        assert_eq!(a.free_ptr(live[j]).status, FreeStatus::Done);
        let r = a.allocate((2 + n * 31 % 29) * MIB + 512, 0);
        assert_eq!(r.status, AllocStatus::Allocated, "{}", r.message);
        live[j] = r.ptr;
        n += 1;
        // Misses are spread over the window.
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    // The notice was queued inside an allocation and taken before it returned.
    assert!(!a.alloc.has_notices());
    assert!(a.alloc.take_notices().is_empty());
    assert_eq!(a.stats().unwrap().counter("driver_share_notices"), 1);
    assert!(a.stats().unwrap().counter("driver_ns") > 0);
}
