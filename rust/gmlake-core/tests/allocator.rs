//! Behaviour of the allocator that only the simulated device (or a hand-written device) can
//! show: out of memory at the device itself rather than at a limit, a device that refuses
//! everything, the type's thread-safety, which streams a wait before a release covers
//! (the simulated device's hazard log), a device whose memory is no multiple of the pages
//! after a page-size upgrade, and the upgrade's settings (off in debug mode, its page size
//! checked). Every device-independent behaviour test lives in
//! the contract suite (`gmlake_core::contract::allocator`, run by tests/contract.rs on the
//! simulated device, by gmlake-cuda on its mock driver and on a real GPU).

use gmlake_core::{Allocator, Config, Error, SimDevice};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

fn setup(capacity: u64, config: Config) -> (Arc<SimDevice>, Allocator<Arc<SimDevice>>) {
    let dev = Arc::new(SimDevice::new(capacity));
    let a = Allocator::new(dev.clone(), config).unwrap();
    (dev, a)
}

fn setup_async(capacity: u64, config: Config) -> (Arc<SimDevice>, Allocator<Arc<SimDevice>>) {
    let dev = Arc::new(SimDevice::new(capacity).asynchronous());
    let a = Allocator::new(dev.clone(), config).unwrap();
    (dev, a)
}

/// The contract's out-of-memory cases cap the allocator with a limit; here the device itself
/// runs out (its `create_physical` fails), with and without creating before stitching.
#[test]
fn out_of_memory_at_the_device_reports_figures_and_leaves_the_allocator_usable() {
    let (dev, a) = setup(64 * MIB, Config::default());
    let p = a.allocate(60 * MIB, 0).unwrap();
    match a.allocate(10 * MIB, 0) {
        Err(Error::OutOfMemory(info)) => {
            assert_eq!(info.requested, 10 * MIB);
            assert_eq!(info.reserved, 60 * MIB);
            assert_eq!(info.device_total, 64 * MIB);
            assert_eq!(info.device_free, 4 * MIB);
            assert_eq!(info.limit, None);
        }
        other => panic!("expected OOM, got {other:?}"),
    }
    assert_eq!(a.stats().num_ooms, 1);
    a.free(p).unwrap();
    assert_ne!(a.allocate(62 * MIB, 0).unwrap(), 0);
    a.verify().unwrap();

    // defragLevel 1: creating fails at the device, then it stitches.
    let cfg = Config {
        defrag_level: 1,
        ..Config::default()
    };
    let (dev2, a) = setup(110 * MIB, cfg);
    let live: Vec<u64> = (0..10).map(|_| a.allocate(10 * MIB, 0).unwrap()).collect();
    for p in live.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    a.allocate(40 * MIB, 0).unwrap();
    assert!(a.stats().stitches >= 1);
    assert!(dev2.physical_bytes() <= 110 * MIB);
    a.verify().unwrap();
    drop(dev);
}

#[test]
fn device_failure_is_an_error_not_a_panic() {
    // A device that refuses everything.
    struct Broken;
    impl gmlake_core::Device for Broken {
        fn granularity(&self) -> gmlake_core::DeviceResult<usize> {
            Ok(PAGE as usize)
        }
        fn total_memory(&self) -> gmlake_core::DeviceResult<usize> {
            Ok(1 << 30)
        }
        fn free_memory(&self) -> gmlake_core::DeviceResult<usize> {
            Ok(1 << 30)
        }
        fn create_physical(&self, _: usize) -> gmlake_core::DeviceResult<gmlake_core::PhysHandle> {
            Err(gmlake_core::DeviceError::Driver {
                call: "cuMemCreate",
                code: 999,
                message: "broken".into(),
            })
        }
        fn release_physical(&self, _: gmlake_core::PhysHandle) -> gmlake_core::DeviceResult<()> {
            Ok(())
        }
        fn reserve_va(&self, _: usize, _: usize) -> gmlake_core::DeviceResult<u64> {
            Ok(1 << 40)
        }
        fn free_va(&self, _: u64, _: usize) -> gmlake_core::DeviceResult<()> {
            Ok(())
        }
        fn map(
            &self,
            _: u64,
            _: usize,
            _: gmlake_core::PhysHandle,
        ) -> gmlake_core::DeviceResult<()> {
            Ok(())
        }
        fn unmap(&self, _: u64, _: usize) -> gmlake_core::DeviceResult<()> {
            Ok(())
        }
        fn set_access(&self, _: u64, _: usize) -> gmlake_core::DeviceResult<()> {
            Ok(())
        }
        fn create_event(&self) -> gmlake_core::DeviceResult<gmlake_core::EventHandle> {
            Ok(gmlake_core::EventHandle(1))
        }
        fn destroy_event(&self, _: gmlake_core::EventHandle) -> gmlake_core::DeviceResult<()> {
            Ok(())
        }
        fn record_event(
            &self,
            _: gmlake_core::EventHandle,
            _: u64,
        ) -> gmlake_core::DeviceResult<()> {
            Ok(())
        }
        fn query_event(&self, _: gmlake_core::EventHandle) -> gmlake_core::DeviceResult<bool> {
            Ok(true)
        }
        fn stream_wait_event(
            &self,
            _: u64,
            _: gmlake_core::EventHandle,
        ) -> gmlake_core::DeviceResult<()> {
            Err(gmlake_core::DeviceError::Unsupported("stream_wait_event"))
        }
        fn synchronize(&self) -> gmlake_core::DeviceResult<()> {
            Ok(())
        }
    }
    let a = Allocator::new(Broken, Config::default()).unwrap();
    match a.allocate(MIB, 0) {
        Err(Error::Device(e)) => assert!(e.to_string().contains("cuMemCreate")),
        other => panic!("expected a device error, got {other:?}"),
    }
}

#[test]
fn allocator_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Allocator<SimDevice>>();
}

/// Issue 20: waiting for the GPU before memory is released or moved (empty_cache, an
/// out-of-memory retry) waits for the streams that used the allocator's free memory, with
/// the lock held, never for the whole device: a stream busy with other work (a long kernel,
/// a collective waiting for a peer) is not waited for. Memory is still never released or
/// reused before the work of its own stream (and of record_stream's streams) completes: the
/// simulated device flags a release under queued work.
/// With `cross_stream_wait` (the default) the retry below needs no host wait: stream 2 waits
/// for stream 1 on the device instead; both ways, nothing races.
#[test]
fn waits_before_release_cover_the_allocators_streams_only() {
    for wait in [false, true] {
        waits_before_release(wait);
    }
}

fn waits_before_release(cross_stream_wait: bool) {
    let config = Config {
        cross_stream_wait,
        ..Config::default()
    };
    let (dev, a) = setup_async(64 * MIB, config);
    // A long kernel on stream 9 on memory that stays live.
    let busy = a.allocate(4 * MIB, 9).unwrap();
    dev.fill(busy, 4 * MIB, 1, 9).unwrap();
    // Work on stream 1, and on stream 3 through record_stream, then both blocks freed.
    let p = a.allocate(8 * MIB, 1).unwrap();
    dev.fill(p, 8 * MIB, 2, 1).unwrap();
    let q = a.allocate(8 * MIB, 1).unwrap();
    a.record_stream(q, 3).unwrap();
    dev.fill(q, 8 * MIB, 3, 3).unwrap();
    a.free(p).unwrap();
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
    assert_eq!(dev.queued_ops(), 1, "only stream 9's kernel is left");
    assert_eq!(a.stats().reserved_bytes.aggregate().current as u64, 4 * MIB);
    assert_eq!(a.stats().pending_frees, 0);

    // An out-of-memory retry on stream 2 takes stream 1's freed pages after waiting for
    // stream 1 only.
    let r = a.allocate(40 * MIB, 1).unwrap();
    dev.fill(r, 40 * MIB, 4, 1).unwrap();
    a.free(r).unwrap();
    let s0 = a.stats().num_sync_all_streams;
    let w0 = a.stats().driver_calls.stream_wait;
    let t = a.allocate(56 * MIB, 2).unwrap();
    dev.fill(t, 56 * MIB, 5, 2).unwrap();
    assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
    if cross_stream_wait {
        assert_eq!(a.stats().num_sync_all_streams, s0, "the host waited");
        assert!(
            a.stats().driver_calls.stream_wait > w0,
            "no device-side wait"
        );
    } else {
        assert!(a.stats().num_sync_all_streams > s0);
    }
    // Stream 2's own write (after stream 1's work, which it waited for, on the device or
    // through the host) runs; stream 9's kernel is still queued.
    dev.complete_stream(2);
    assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
    assert_eq!(dev.queued_ops(), 1, "stream 9 was not waited for");
    a.verify().unwrap();
    a.free(t).unwrap();
    a.free(busy).unwrap();
    dev.complete_all();
    a.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
}

/// Stream 1's 16 MiB range, written and freed; stream 2 takes its pages (behind a
/// device-side wait) into a new range and writes them, and stream 1's range is kept as
/// aliases of them. Returns (stream 1's range, stream 2's, still live).
fn range_taken_by_stream_2(dev: &SimDevice, a: &Allocator<Arc<SimDevice>>) -> (u64, u64) {
    let p = a.allocate(16 * MIB, 1).unwrap();
    dev.fill(p, 16 * MIB, 1, 1).unwrap();
    a.free(p).unwrap();
    let q = a.allocate(16 * MIB, 2).unwrap();
    assert_ne!(q, p, "stream 2 took stream 1's range");
    dev.fill(q, 16 * MIB, 2, 2).unwrap();
    (p, q)
}

/// `range_taken_by_stream_2`, with stream 2's range freed: stream 1's kept range rests on
/// free pages of stream 2. Returns stream 1's range.
fn kept_range_of_freed_pages(dev: &SimDevice, a: &Allocator<Arc<SimDevice>>) -> u64 {
    let (p, q) = range_taken_by_stream_2(dev, a);
    a.free(q).unwrap();
    p
}

/// After stream 1 asked again for the range `kept_range_of_freed_pages` kept, (kept, got):
/// with the option `on`, it got the kept range back with no map and the option's counter
/// (`taken`) says so once; without, a new range of 8 maps. Then frees everything.
fn check_kept_range_reuse(
    dev: &SimDevice,
    a: &Allocator<Arc<SimDevice>>,
    on: bool,
    (p, r): (u64, u64),
    maps: u64,
    taken: u64,
) {
    let s = a.stats();
    if on {
        assert_eq!(r, p, "the kept range was not taken back");
        assert_eq!(s.driver_calls.map, maps);
        assert_eq!(taken, 1);
    } else {
        assert_ne!(r, p);
        assert_eq!(s.driver_calls.map, maps + 8);
        assert_eq!(taken, 0);
    }
    a.verify().unwrap();
    a.free(r).unwrap();
    dev.complete_all();
    a.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
}

/// `reuse_fenced_blocks`: a stream whose kept range's pages rest in another stream's free
/// block, whose work is done but not yet fenced, brings the fences up to date when its scan
/// finds nothing and takes the range back as it is (no map); without it the miss stitches
/// those same pages at a new address. (A device whose events complete when queried: the
/// property tests check, on the asynchronous one, that nothing races.)
#[test]
fn reuse_fenced_blocks_takes_a_kept_range_back_once_its_pages_are_fenced() {
    for on in [false, true] {
        let cfg = Config {
            reuse_fenced_blocks: on,
            ..Config::default()
        };
        let (dev, a) = setup(256 * MIB, cfg);
        let p = kept_range_of_freed_pages(&dev, &a);
        // Stream 2's work is done; no fence of stream 2 has seen it yet.
        let maps = a.stats().driver_calls.map;
        let r = a.allocate(16 * MIB, 1).unwrap();
        dev.fill(r, 16 * MIB, 3, 1).unwrap();
        assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
        let taken = a.stats().reuses_fenced_blocks;
        check_kept_range_reuse(&dev, &a, on, (p, r), maps, taken);
    }
}

/// `reuse_fenced_blocks` decides per block: stream 1's kept range rests in a block that stream 0
/// freed before a fence of stream 0 that has completed, but stream 0 freed another block
/// after that fence, so stream 0's arena as a whole may not give yet. With the option the
/// range is taken back as it is (no map); without, new pages are made (no device-side waits
/// here, `cross_stream_wait` off). On the asynchronous device, which flags any use of memory
/// that queued work of another stream may still touch: nothing races.
#[test]
fn reuse_fenced_blocks_takes_pages_of_blocks_freed_before_a_completed_fence() {
    for on in [false, true] {
        let cfg = Config {
            reuse_fenced_blocks: on,
            cross_stream_wait: false,
            ..Config::default()
        };
        let (dev, a) = setup_async(256 * MIB, cfg);
        let p = a.allocate(16 * MIB, 1).unwrap();
        dev.fill(p, 16 * MIB, 1, 1).unwrap();
        a.free(p).unwrap();
        // Stream 0 cannot take stream 1's pages yet: it makes pages (z, and x, which stays
        // live between z and q so that their frees do not coalesce), and a fence is recorded
        // on stream 1; once stream 1 is done, stream 0 takes p's pages into q.
        let z = a.allocate(2 * MIB, 0).unwrap();
        let x = a.allocate(2 * MIB, 0).unwrap();
        dev.complete_stream(1);
        let q = a.allocate(16 * MIB, 0).unwrap();
        assert!(z < x && x < q, "{z:#x} {x:#x} {q:#x}");
        assert_ne!(q, p);
        assert_eq!(a.stats().pages_stitched, 8, "q took p's pages");
        dev.fill(q, 16 * MIB, 2, 0).unwrap();
        dev.fill(z, 2 * MIB, 3, 0).unwrap();
        a.free(q).unwrap();
        // A miss on stream 1 records a fence on stream 0 (after q's free); stream 0 frees z
        // after it, and its work completes.
        let y = a.allocate(2 * MIB, 1).unwrap();
        a.free(z).unwrap();
        dev.complete_stream(0);
        let maps = a.stats().driver_calls.map;
        let r = a.allocate(16 * MIB, 1).unwrap();
        dev.fill(r, 16 * MIB, 4, 1).unwrap();
        assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
        let s = a.stats();
        if on {
            assert_eq!(r, p, "the kept range was not taken back");
            assert_eq!(s.driver_calls.map, maps);
            assert_eq!(s.reuses_fenced_blocks, 1);
        } else {
            assert_ne!(r, p);
            assert_eq!(s.driver_calls.map, maps + 8);
        }
        a.verify().unwrap();
        for b in [r, x, y] {
            a.free(b).unwrap();
        }
        dev.complete_all();
        a.empty_cache().unwrap();
        assert_eq!(dev.physical_bytes(), 0);
    }
}

/// `wait_to_reuse`: a stream whose kept range's pages are free on another stream, whose work
/// is still queued, waits for that stream on the device and takes the range back as it is
/// (no map), where otherwise it waits all the same and maps those pages at a new address.
/// Either way nothing races: stream 1's write comes after stream 2's on the device.
#[test]
fn wait_to_reuse_takes_a_kept_range_back_behind_a_device_wait() {
    for on in [false, true] {
        let cfg = Config {
            wait_to_reuse: on,
            ..Config::default()
        };
        let (dev, a) = setup_async(256 * MIB, cfg);
        let p = kept_range_of_freed_pages(&dev, &a);
        let maps = a.stats().driver_calls.map;
        let waits = a.stats().driver_calls.stream_wait;
        let r = a.allocate(16 * MIB, 1).unwrap();
        dev.fill(r, 16 * MIB, 3, 1).unwrap();
        assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
        let s = a.stats();
        assert!(s.driver_calls.stream_wait > waits, "no device-side wait");
        check_kept_range_reuse(&dev, &a, on, (p, r), maps, s.reuses_after_wait);
    }
}

/// After a page-size upgrade, new virtual chunks are whole pages of the new size even where
/// the device's memory (the default chunk size) is no multiple of it: on an H200 (143,771
/// MiB) a chunk sized in 2 MiB pages left an unmapped tail of a partial 8 MiB page.
#[test]
fn chunks_after_a_page_upgrade_are_whole_larger_pages() {
    let cfg = Config {
        page_upgrade_at: Some(4 * MIB),
        page_upgrade_size: 8 * MIB,
        page_upgrade_remap: 0.0,
        ..Config::default()
    };
    let (_dev, a) = setup(1024 * MIB + PAGE, cfg);
    let first = a.allocate(4 * MIB, 0).unwrap();
    let p = a.allocate(20 * MIB, 0).unwrap();
    assert_eq!(a.page_size(), 8 * MIB);
    assert_eq!(p % (8 * MIB), 0);
    a.verify().unwrap();
    a.free(first).unwrap();
    a.free(p).unwrap();
    a.verify().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.aggregate().current, 0);
}

/// With `page_upgrade_size` 0 (the default) the upgrade sizes its page by the job's large
/// blocks: a tenth of their mean size when they were at their highest, from twice the page
/// to four times it. Jobs of 100 MiB tensors get 8 MiB pages, jobs of 20 MiB ones 4 MiB.
#[test]
fn the_automatic_upgrade_sizes_its_page_by_the_jobs_blocks() {
    for (block, want) in [
        (20 * MIB, 2 * PAGE),
        (40 * MIB, 2 * PAGE),
        (100 * MIB, 4 * PAGE),
        (600 * MIB, 4 * PAGE),
    ] {
        let cfg = Config {
            page_upgrade_at: Some(3 * block),
            page_upgrade_remap: 0.0,
            ..Config::default()
        };
        let (_dev, a) = setup(4096 * MIB, cfg);
        // The upgrade is decided at the allocation after the threshold is reached, from the
        // blocks live before it (three, so that a page sized by their sum would differ).
        let first: Vec<_> = (0..3).map(|_| a.allocate(block, 0).unwrap()).collect();
        assert_eq!(a.page_size(), PAGE);
        let p = a.allocate(block, 0).unwrap();
        assert_eq!(a.page_size(), want, "blocks of {} MiB", block / MIB);
        assert_eq!(a.stats().page_upgrades, 1);
        assert_eq!(p % want, 0);
        a.verify().unwrap();
        for q in first.into_iter().chain([p]) {
            a.free(q).unwrap();
        }
        a.verify().unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.stats().reserved_bytes.aggregate().current, 0);
    }
}

/// The memory debugging mode turns the page-size upgrade off (its guard pages assume one page
/// size): the job keeps its pages past the threshold.
#[test]
fn the_debug_mode_turns_the_page_upgrade_off() {
    let mut cfg = Config {
        page_upgrade_at: Some(4 * MIB),
        page_upgrade_remap: 0.0,
        ..Config::default()
    };
    cfg.set("debug", "all").unwrap();
    let (_dev, a) = setup(1 << 30, cfg);
    let p = a.allocate(16 * MIB, 0).unwrap();
    let q = a.allocate(16 * MIB, 0).unwrap();
    assert_eq!(a.page_size(), PAGE);
    assert_eq!(a.stats().page_upgrades, 0);
    a.free(p).unwrap();
    a.free(q).unwrap();
    a.verify().unwrap();
}

/// `page_upgrade_size` must be a larger page than the first one, and a multiple of the
/// device's granularity: otherwise `Allocator::new` names the key.
#[test]
fn a_page_upgrade_to_no_larger_page_names_the_key() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    for size in [PAGE, PAGE / 2] {
        let cfg = Config {
            page_upgrade_at: Some(1 << 30),
            page_upgrade_size: size,
            ..Config::default()
        };
        match Allocator::new(dev.clone(), cfg) {
            Err(e @ Error::InvalidConfig { .. }) => {
                assert!(e.to_string().contains("page_upgrade_size"), "{e}")
            }
            Err(e) => panic!("expected InvalidConfig, got {e}"),
            Ok(_) => panic!("page_upgrade_size {size} accepted"),
        }
    }
}

/// `host_timing`: every driver call an allocation or a free makes is timed for the calling
/// thread (`gmlake_core::calltime`), as many as the statistics count, and none without it; a
/// call made while another thread holds the lock notes its wait.
#[test]
fn host_timing_times_every_driver_call_of_a_call_and_the_wait_for_the_lock() {
    use gmlake_core::calltime;
    let total = |a: &Allocator<Arc<SimDevice>>| a.stats().driver_calls.total();
    let cfg = Config {
        host_timing: true,
        ..Config::default()
    };
    let (_, a) = setup(8 << 30, cfg);
    // New memory, new memory, a hit of the freed 100 MiB (no driver call).
    for (size, fresh) in [(3 * PAGE, true), (100 * MIB, true), (7 * MIB, false)] {
        let before = total(&a);
        calltime::reset();
        let p = a.allocate(size, 0).unwrap();
        let t = calltime::take();
        assert_eq!(t.driver_calls, total(&a) - before, "{size}: {t:?}");
        assert_eq!(t.driver_calls > 0, fresh, "{size}: {t:?}");
        assert_eq!(t.slowest_driver.is_empty(), !fresh, "{t:?}");
        assert!(
            t.slowest_driver_ns <= t.driver_ns && t.lock_wait_ns == 0,
            "{t:?}"
        );
        let before = total(&a);
        a.free(p).unwrap();
        assert_eq!(calltime::take().driver_calls, total(&a) - before);
    }
    let (_, off) = setup(8 << 30, Config::default());
    calltime::reset();
    off.allocate(100 * MIB, 0).unwrap();
    assert_eq!(calltime::take(), calltime::CallTime::ZERO);
    // Another thread holds the lock (a large allocation: thousands of pages created, then
    // released) while this one allocates: the wait is noted. Tried until the two overlap.
    let a = Arc::new(a);
    for _ in 0..200 {
        let other = a.clone();
        let holder = std::thread::spawn(move || {
            let p = other.allocate(6 << 30, 1).unwrap();
            other.free(p).unwrap();
            other.empty_cache().unwrap(); // the next try creates its pages again
        });
        std::thread::sleep(std::time::Duration::from_micros(200));
        calltime::reset();
        let p = a.allocate(MIB, 0).unwrap();
        let t = calltime::take();
        a.free(p).unwrap();
        holder.join().unwrap();
        if t.lock_wait_ns > 0 {
            return;
        }
    }
    panic!("no call waited for the lock in 200 tries");
}

/// The miss log (`set_miss_log`): stream 1's kept range has all its pages live in a block of
/// stream 2, so stream 1's next request of that size takes no window and maps a new range;
/// the log names the kept range as the best window, its 8 pages busy, held by a live block of
/// another stream, and the request's bounds (a quarter of 8 pages may be replaced). Logging
/// changes no decision: the same address and the same driver calls with the log off.
#[test]
fn the_miss_log_names_what_holds_a_kept_windows_busy_pages() {
    let mut seen = Vec::new();
    for log in [false, true] {
        let (dev, a) = setup(256 * MIB, Config::default());
        if log {
            a.set_miss_log(16);
        }
        let (p, _q) = range_taken_by_stream_2(&dev, &a);
        let before = a.take_misses().len();
        let r = a.allocate(16 * MIB, 1).unwrap();
        assert_ne!(r, p, "the kept range's pages are live in q");
        let misses = a.take_misses();
        seen.push((r, a.stats().driver_calls.total()));
        if !log {
            assert!(
                misses.is_empty() && before == 0,
                "the log is off by default"
            );
            continue;
        }
        let m = misses.last().expect("the miss was logged");
        assert_eq!((m.stream, m.size), (1, 16 * MIB));
        assert_eq!(m.max_busy, 2, "{m:?}");
        let w = m.best.as_ref().expect("the kept range is the best window");
        assert_eq!(w.start, p);
        assert_eq!((w.lent_pages, w.busy), (8, 8), "{w:?}");
        assert_eq!(w.held_live_other_stream, 8, "{w:?}");
        assert_eq!(
            w.held_live_same_stream + w.held_free_unfenced + w.held_other,
            0,
            "{w:?}"
        );
        assert!(a.take_misses().is_empty(), "taking empties the log");
        a.set_miss_log(0);
        a.verify().unwrap();
    }
    assert_eq!(seen[0], seen[1], "the log changed a decision");
}

/// `stitch_tails_last`: a stitch that could take its pages from a run's tail (the free rest
/// after a live block) or from another free block takes them from the other block; at the
/// defaults best fit takes the tail, the smaller block that covers the need.
#[test]
fn stitch_tails_last_takes_pages_from_a_tail_only_when_nothing_else_will_do() {
    let source = |tails_last: bool| {
        let config = Config {
            stitch_tails_last: tails_last,
            ..Config::default()
        };
        let (_dev, a) = setup(1 << 40, config);
        // [head: 3 pages][live: 1][tail: 2][live: 1], then the head and the tail freed.
        let head = a.allocate(3 * PAGE, 0).unwrap();
        let first = a.allocate(PAGE, 0).unwrap();
        let tail = a.allocate(2 * PAGE, 0).unwrap();
        let _last = a.allocate(PAGE, 0).unwrap();
        assert_eq!((first, tail), (head + 3 * PAGE, head + 4 * PAGE));
        let handles = |p| -> Vec<_> { a.pages_of(p).unwrap().into_iter().map(|x| x.1).collect() };
        let (head_pages, tail_pages) = (handles(head), handles(tail));
        a.free(head).unwrap();
        a.free(tail).unwrap();
        // Another stream's first request has no memory of its own: two pages are stitched.
        let q = a.allocate(2 * PAGE, 1).unwrap();
        let got = handles(q);
        assert_eq!(got.len(), 2);
        if got.iter().all(|h| tail_pages.contains(h)) {
            "tail"
        } else if got.iter().all(|h| head_pages.contains(h)) {
            "head"
        } else {
            "mixed"
        }
    };
    assert_eq!(source(false), "tail", "best fit: the smaller block");
    assert_eq!(source(true), "head", "tails last");
}
