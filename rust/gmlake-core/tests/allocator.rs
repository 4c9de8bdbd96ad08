//! Behaviour of the allocator on the simulated device: stitching, errors, streams, graph
//! pools, statistics, configuration, threads.

use gmlake_core::{
    Allocator, BlockState, Config, Error, GraphPoolId, SimDevice, StitchStrategy, TraceAction,
};
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

/// Ten 10 MiB blocks with every other one freed: 50 MiB free in five pieces, none of 20 MiB.
fn checkerboard(a: &Allocator<Arc<SimDevice>>, stream: u64) -> Vec<u64> {
    let ptrs: Vec<u64> = (0..10)
        .map(|_| a.allocate(10 * MIB, stream).unwrap())
        .collect();
    for p in ptrs.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    ptrs.into_iter().skip(1).step_by(2).collect()
}

#[test]
fn stitching_reuses_free_pages_instead_of_new_memory() {
    let (dev, a) = setup(1 << 30, Config::default());
    let _live = checkerboard(&a, 0);
    let before = dev.physical_bytes();
    let big = a.allocate(40 * MIB, 0).unwrap();
    assert_eq!(dev.physical_bytes(), before, "no new physical memory");
    let s = a.stats();
    assert!(s.stitches >= 1 && s.pages_stitched >= 15, "{s:?}");
    // The stitched range is fully mapped and usable.
    for off in (0..40 * MIB).step_by(PAGE as usize) {
        assert!(dev.translate(big + off).is_some());
    }
    let snap = a.snapshot();
    let blk = snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.address == big)
        .unwrap();
    assert!(blk.stitched && blk.state == BlockState::ActiveAllocated);
    a.verify().unwrap();
}

#[test]
fn vmm_defragment_off_never_stitches() {
    let cfg = Config {
        vmm_defragment: false,
        ..Config::default()
    };
    let (dev, a) = setup(1 << 30, cfg);
    let _live = checkerboard(&a, 0);
    let before = dev.physical_bytes();
    a.allocate(40 * MIB, 0).unwrap();
    assert_eq!(a.stats().stitches, 0);
    assert_eq!(dev.physical_bytes(), before + 40 * MIB);
}

#[test]
fn defrag_level_one_creates_first_and_stitches_at_the_limit() {
    let cfg = Config {
        defrag_level: 1,
        ..Config::default()
    };
    let (dev, a) = setup(110 * MIB, cfg);
    let _live = checkerboard(&a, 0);
    // 100 MiB held, 10 left on the device: creating fails, then it stitches.
    a.allocate(40 * MIB, 0).unwrap();
    assert!(a.stats().stitches >= 1);
    assert!(dev.physical_bytes() <= 110 * MIB);
    a.verify().unwrap();
}

#[test]
fn frag_limit_keeps_small_requests_from_stitching() {
    let cfg = Config {
        frag_limit: 64 * MIB,
        ..Config::default()
    };
    let (_dev, a) = setup(1 << 30, cfg);
    let _live = checkerboard(&a, 0);
    a.allocate(40 * MIB, 0).unwrap();
    assert_eq!(a.stats().stitches, 0);
}

#[test]
fn strategies_choose_different_pieces() {
    // Free blocks A (4 MiB, 2 pages), B (8 MiB, 4 pages), C (16 MiB, 8 pages), freed in that
    // order between live 2 MiB blocks; then a 17 MiB request needs 9 pages (its last page is
    // half used, leaving a 1 MiB free piece). Which free pieces remain shows where each
    // strategy took its pages from.
    let remaining = |strategy| {
        let cfg = Config {
            stitch_strategy: strategy,
            ..Config::default()
        };
        let (_dev, a) = setup(1 << 30, cfg);
        let mut free = Vec::new();
        for s in [4 * MIB, 8 * MIB, 16 * MIB] {
            free.push(a.allocate(s, 0).unwrap());
            a.allocate(PAGE, 0).unwrap();
        }
        for p in free {
            a.free(p).unwrap();
        }
        a.allocate(17 * MIB, 0).unwrap();
        a.verify().unwrap();
        let mut sizes: Vec<u64> = a
            .snapshot()
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == BlockState::Inactive)
            .map(|b| b.size / MIB)
            .collect();
        sizes.sort();
        sizes
    };
    // Best fit: no block covers 9 pages, so the largest (C, 8) and then the smallest that
    // covers the last page (A).
    assert_eq!(remaining(StitchStrategy::BestFit), vec![1, 2, 8]);
    // GMLake's order: C, then the largest left (B).
    assert_eq!(remaining(StitchStrategy::LargestFirst), vec![1, 4, 6]);
    // Least recently freed first: A, B, then 3 pages of C.
    assert_eq!(remaining(StitchStrategy::Lru), vec![1, 10]);
}

#[test]
fn cache_hits_make_no_driver_call() {
    let (_dev, a) = setup(1 << 30, Config::default());
    for size in [512, 4096, MIB, 3 * MIB, 64 * MIB] {
        let p = a.allocate(size, 0).unwrap();
        a.free(p).unwrap();
        let before = a.stats().driver_calls.total();
        for _ in 0..100 {
            let q = a.allocate(size, 0).unwrap();
            assert_eq!(q, p, "same block again");
            a.free(q).unwrap();
        }
        assert_eq!(a.stats().driver_calls.total(), before, "size {size}");
    }
}

#[test]
fn zero_bytes_is_null_and_free_of_null_is_a_no_op() {
    let (_dev, a) = setup(1 << 30, Config::default());
    assert_eq!(a.allocate(0, 0).unwrap(), 0);
    a.free(0).unwrap();
    assert_eq!(a.stats().allocation.aggregate().current, 0);
}

#[test]
fn out_of_memory_reports_figures_and_leaves_the_allocator_usable() {
    let (_dev, a) = setup(64 * MIB, Config::default());
    let p = a.allocate(60 * MIB, 0).unwrap();
    match a.allocate(10 * MIB, 0) {
        Err(Error::OutOfMemory(info)) => {
            assert_eq!(info.requested, 10 * MIB);
            assert_eq!(info.reserved, 60 * MIB);
            assert_eq!(info.device_total, 64 * MIB);
            let msg = Error::OutOfMemory(info).to_string();
            assert!(msg.contains("Tried to allocate 10.00 MiB"), "{msg}");
        }
        other => panic!("expected OOM, got {other:?}"),
    }
    assert_eq!(a.stats().num_ooms, 1);
    assert!(a.stats().num_alloc_retries >= 1);
    a.free(p).unwrap();
    let q = a.allocate(62 * MIB, 0).unwrap();
    assert_ne!(q, 0);
    a.verify().unwrap();
}

#[test]
fn memory_fraction_and_limit_cap_reserved_memory() {
    let (dev, a) = setup(1 << 30, Config::default());
    a.set_memory_fraction(0.25).unwrap();
    assert!(matches!(
        a.allocate(300 * MIB, 0),
        Err(Error::OutOfMemory(_))
    ));
    assert_eq!(
        dev.physical_bytes(),
        0,
        "nothing kept after a failed request"
    );
    a.allocate(200 * MIB, 0).unwrap();
    a.set_limit(Some(100 * MIB));
    assert_eq!(a.limit(), Some(100 * MIB));
    assert!(a.set_memory_fraction(1.5).is_err());
    assert!(a.set_memory_fraction(-0.1).is_err());
}

#[test]
fn a_memory_fraction_of_zero_allows_nothing_new_as_pytorch() {
    let (_dev, a) = setup(1 << 30, Config::default());
    a.set_memory_fraction(0.0).unwrap();
    assert_eq!(a.memory_fraction(), Some(0.0));
    assert!(matches!(a.allocate(MIB, 0), Err(Error::OutOfMemory(_))));
    a.set_memory_fraction(1.0).unwrap();
    assert_eq!(a.memory_fraction(), None, "1 removes the cap, as PyTorch");
    let p = a.allocate(MIB, 0).unwrap();
    a.free(p).unwrap();
    a.verify().unwrap();
}

#[test]
fn roundup_power2_divisions_round_the_placed_size_not_the_request() {
    let mut cfg = Config::default();
    cfg.apply_conf("roundup_power2_divisions:4").unwrap();
    let (_dev, a) = setup(1 << 30, cfg);
    let n = 84 * MIB; // between 64 and 128 MiB: divisions of 16 MiB
    let p = a.allocate(n, 0).unwrap();
    let s = a.stats();
    assert_eq!(s.allocated_bytes.aggregate().current as u64, 96 * MIB);
    assert_eq!(s.requested_bytes.aggregate().current as u64, n);
    a.free(p).unwrap();
    // The caller's own rounding (allocate_rounded) wins.
    let q = a
        .allocate_rounded(MIB + 1, 2 * MIB, 0, gmlake_core::GraphPoolId::DEFAULT)
        .unwrap();
    assert_eq!(
        a.stats().allocated_bytes.aggregate().current as u64,
        2 * MIB
    );
    a.free(q).unwrap();
    a.verify().unwrap();
}

#[test]
fn cleared_stream_uses_free_at_once() {
    let (_dev, a) = setup(1 << 30, Config::default());
    let p = a.allocate(4 * MIB, 1).unwrap();
    a.record_stream(p, 2).unwrap();
    a.clear_stream_uses(p).unwrap();
    a.free(p).unwrap();
    // Reusable on its stream at once: same address.
    let q = a.allocate(4 * MIB, 1).unwrap();
    assert_eq!(p, q);
    a.free(q).unwrap();
    assert!(a.clear_stream_uses(0x1000).is_err());
}

#[test]
fn double_free_unknown_pointer_and_size_overflow_are_errors() {
    let (_dev, a) = setup(1 << 30, Config::default());
    let p = a.allocate(MIB, 0).unwrap();
    a.free(p).unwrap();
    assert_eq!(a.free(p), Err(Error::DoubleFree(p)));
    assert_eq!(a.free(0x1000), Err(Error::UnknownPointer(0x1000)));
    let q = a.allocate(4 * MIB, 0).unwrap();
    assert_eq!(
        a.free(q + 512),
        Err(Error::UnknownPointer(q + 512)),
        "interior pointer"
    );
    assert_eq!(
        a.record_stream(0x1000, 1),
        Err(Error::UnknownPointer(0x1000))
    );
    assert_eq!(a.allocate(u64::MAX, 0), Err(Error::SizeOverflow(u64::MAX)));
    assert!(a.release_pool(GraphPoolId::DEFAULT).is_err());
    a.verify().unwrap();
}

#[test]
fn invalid_page_size_names_the_key() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let cfg = Config {
        page_size: MIB,
        ..Config::default()
    };
    match Allocator::new(dev, cfg) {
        Err(Error::InvalidConfig { key, .. }) => assert_eq!(key, "page_size"),
        _ => panic!("expected InvalidConfig"),
    }
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
fn same_stream_reuse_is_immediate_other_streams_wait() {
    let (_dev, a) = setup_async(1 << 30, Config::default());
    let p = a.allocate(8 * MIB, 1).unwrap();
    a.free(p).unwrap();
    assert_eq!(
        a.allocate(8 * MIB, 1).unwrap(),
        p,
        "same stream reuses at once"
    );
    let q = a.allocate(8 * MIB, 2).unwrap();
    assert_ne!(q, p, "another stream gets other memory");
}

#[test]
fn record_stream_delays_reuse_until_the_event_completes() {
    let (dev, a) = setup_async(1 << 30, Config::default());
    let p = a.allocate(8 * MIB, 1).unwrap();
    a.record_stream(p, 2).unwrap();
    a.free(p).unwrap();
    assert_eq!(a.stats().pending_frees, 1);
    let q = a.allocate(8 * MIB, 1).unwrap();
    assert_ne!(q, p, "reused while stream 2 may still read it");
    dev.complete_all();
    let r = a.allocate(8 * MIB, 1).unwrap();
    assert_eq!(r, p, "reused once stream 2 is done");
    assert_eq!(a.stats().pending_frees, 0);
    a.verify().unwrap();
}

#[test]
fn pages_of_another_stream_are_stitched_only_after_its_fence() {
    // Stream 1 frees 40 MiB; stream 2 needs 40 MiB on a device with room for 60 MiB.
    let (dev, a) = setup_async(60 * MIB, Config::default());
    let p = a.allocate(40 * MIB, 1).unwrap();
    a.free(p).unwrap();
    // While stream 1's work may be in flight its pages cannot move: the allocator must
    // synchronise (counted) before it takes them.
    a.allocate(40 * MIB, 2).unwrap();
    let s = a.stats();
    assert!(s.num_sync_all_streams >= 1, "{s:?}");
    assert!(s.stitches >= 1);
    assert!(dev.physical_bytes() <= 60 * MIB);
    a.verify().unwrap();

    // With room to spare, a pending fence means new memory rather than a wait.
    let (dev, a) = setup_async(1 << 30, Config::default());
    let p = a.allocate(40 * MIB, 1).unwrap();
    a.free(p).unwrap();
    a.allocate(40 * MIB, 2).unwrap();
    assert_eq!(a.stats().num_sync_all_streams, 0);
    assert_eq!(a.stats().stitches, 0);
    // Once stream 1's fence completes its pages are stitched across streams.
    dev.complete_all();
    let before = dev.physical_bytes();
    a.allocate(40 * MIB, 2).unwrap();
    assert_eq!(dev.physical_bytes(), before, "{:?}", a.stats());
    assert!(a.stats().stitches >= 1);
}

#[test]
fn retired_mappings_wait_for_their_event() {
    // max_aliases 0: old mappings of stitched pages are not kept, only retired.
    let config = Config {
        max_aliases: 0.0,
        ..Config::default()
    };
    let (dev, a) = setup_async(1 << 30, config);
    let _live = checkerboard(&a, 0);
    a.allocate(40 * MIB, 0).unwrap();
    let s = a.stats();
    assert!(
        s.retired_bytes > 0,
        "old mappings kept while kernels may use them"
    );
    let mappings = dev.live_mappings();
    dev.complete_all();
    // A slow path that stitches nothing (stream 9's fence is not complete) processes the
    // completed retirements.
    a.allocate(64 * MIB, 9).unwrap();
    assert_eq!(a.stats().retired_bytes, 0);
    assert!(dev.live_mappings() < mappings + 32);
    a.verify().unwrap();
}

/// One "training step": ten 10 MiB tensors, every other one freed, a 40 MiB one that no
/// hole fits, then everything freed. Returns the driver calls the step made.
fn periodic_step(a: &Allocator<Arc<SimDevice>>, dev: &SimDevice) -> u64 {
    let before = dev.calls().total();
    let small: Vec<u64> = (0..10).map(|_| a.allocate(10 * MIB, 0).unwrap()).collect();
    for p in small.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    let big = a.allocate(40 * MIB, 0).unwrap();
    let mid = a.allocate(6 * MIB, 0).unwrap();
    for p in small.iter().skip(1).step_by(2) {
        a.free(*p).unwrap();
    }
    a.free(mid).unwrap();
    a.free(big).unwrap();
    a.verify().unwrap();
    dev.calls().total() - before
}

#[test]
fn kept_aliases_cut_the_driver_calls_of_periodic_steps() {
    let run = |config: Config| {
        let (dev, a) = setup(1 << 30, config);
        let warm: Vec<u64> = (0..8).map(|_| periodic_step(&a, &dev)).collect();
        assert!(warm[0] > 0);
        let reserved = dev.physical_bytes();
        let later: u64 = (0..40).map(|_| periodic_step(&a, &dev)).sum();
        assert_eq!(
            dev.physical_bytes(),
            reserved,
            "no memory grows after warm-up"
        );
        (a, dev, later)
    };
    // Without kept aliases every step stitches anew.
    let (_, _, without) = run(Config {
        max_aliases: 0.0,
        ..Config::default()
    });
    assert!(without >= 40 * 20, "{without}");
    // With them most steps find a stitched range of an earlier step (which holes this
    // pattern frees rotates with the free lists' order, so a few new ranges are made).
    let (a, dev, with) = run(Config::default());
    assert!(
        with * 2 < without,
        "{with} calls with kept aliases, {without} without"
    );
    let s = a.stats();
    assert!(s.stitch_reuses > 0, "{s:?}");
    // Aliases hold no memory and empty_cache unmaps every one of them.
    a.empty_cache().unwrap();
    assert_eq!(dev.live_mappings(), 0);
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn a_freed_stitched_range_is_reused_with_no_driver_call() {
    let (dev, a) = setup(1 << 30, Config::default());
    let live = checkerboard(&a, 0);
    let big = a.allocate(40 * MIB, 0).unwrap();
    a.free(big).unwrap();
    // The freed range serves the holes' sizes, then the stitched size again: no driver call.
    let calls = dev.calls().total();
    for _ in 0..10 {
        let holes: Vec<u64> = (0..4).map(|_| a.allocate(10 * MIB, 0).unwrap()).collect();
        for h in &holes {
            a.free(*h).unwrap();
        }
        let again = a.allocate(40 * MIB, 0).unwrap();
        a.free(again).unwrap();
        a.verify().unwrap();
    }
    assert_eq!(dev.calls().total(), calls, "{:?}", a.stats());
    drop(live);
}

#[test]
fn aliases_beyond_the_bound_are_unmapped() {
    let config = Config {
        max_aliases: 0.0,
        ..Config::default()
    };
    let (dev, a) = setup(1 << 30, config);
    let _live = checkerboard(&a, 0);
    let mappings = dev.live_mappings();
    a.allocate(40 * MIB, 0).unwrap();
    a.allocate(MIB * 2, 5).unwrap(); // a slow path processes the completed retirements
    let s = a.stats();
    assert_eq!(s.aliased_bytes, 0, "{s:?}");
    assert!(s.alias_evictions >= 15, "{s:?}");
    assert!(dev.live_mappings() <= mappings + 2);
    a.verify().unwrap();
}

#[test]
fn graph_pools_keep_their_pages() {
    let (dev, a) = setup(1 << 30, Config::default());
    let pool = GraphPoolId(1, 0);
    a.begin_allocate_to_pool(pool);
    let g = a.allocate_in(40 * MIB, 7, pool).unwrap();
    a.end_allocate_to_pool(pool);
    a.free(g).unwrap();
    // The default pool neither reuses nor stitches the pool's free pages.
    let d = a.allocate(40 * MIB, 7).unwrap();
    assert_ne!(d, g);
    assert_eq!(a.stats().stitches, 0);
    a.free(d).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(
        dev.physical_bytes(),
        40 * MIB,
        "the pool's pages stay for replays"
    );
    // The same pool reuses its block.
    assert_eq!(a.allocate_in(40 * MIB, 7, pool).unwrap(), g);
    a.free(g).unwrap();
    a.release_pool(pool).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
    a.verify().unwrap();
}

#[test]
fn stats_follow_allocations_and_resets() {
    let (dev, a) = setup(1 << 30, Config::default());
    let small = a.allocate(1000, 0).unwrap();
    let large = a.allocate(5 * MIB + 1, 0).unwrap();
    let s = a.stats();
    assert_eq!(s.allocation.aggregate().current, 2);
    assert_eq!(s.allocation.0[1].current, 1);
    assert_eq!(s.allocation.0[2].current, 1);
    assert_eq!(
        s.allocated_bytes.aggregate().current as u64,
        1024 + 5 * MIB + 512
    );
    assert_eq!(
        s.requested_bytes.aggregate().current as u64,
        1000 + 5 * MIB + 1
    );
    assert_eq!(
        s.reserved_bytes.aggregate().current as u64,
        dev.physical_bytes()
    );
    assert_eq!(
        s.segment.aggregate().current as u64,
        dev.physical_bytes() / PAGE
    );
    assert_eq!(s.num_device_alloc as u64, dev.physical_bytes() / PAGE);
    a.free(small).unwrap();
    a.free(large).unwrap();
    let s = a.stats();
    assert_eq!(s.allocation.aggregate().peak, 2);
    assert_eq!(s.active_bytes.aggregate().current, 0);
    // Everything free: cached runs, none split (as PyTorch's unsplit free segments).
    assert_eq!(s.inactive_split_bytes.aggregate().current, 0);
    assert!(s.inactive_split_bytes.aggregate().peak > 0);
    a.reset_peak_stats();
    assert_eq!(a.stats().allocation.aggregate().peak, 0);
    let created = a.stats().num_device_alloc;
    a.reset_accumulated_stats();
    assert_eq!(a.stats().allocation.aggregate().allocated, 0);
    assert_eq!(a.stats().num_device_alloc, 0);
    a.empty_cache().unwrap();
    let s = a.stats();
    assert_eq!(s.reserved_bytes.aggregate().current, 0);
    assert_eq!(s.num_device_free, created);
    assert_eq!(a.cache_info().cached_free_bytes, 0);
}

#[test]
fn allocation_lookup_and_history() {
    let (_dev, a) = setup(1 << 30, Config::default());
    a.set_history(100);
    let p = a.allocate(3 * MIB, 5).unwrap();
    let info = a.allocation(p + 1234).unwrap();
    assert_eq!((info.ptr, info.size, info.stream), (p, 3 * MIB, 5));
    assert_eq!(a.pages_of(p).unwrap().len(), 2);
    a.free(p).unwrap();
    assert!(a.allocation(p).is_none());
    let actions: Vec<TraceAction> = a.take_history().iter().map(|e| e.action).collect();
    assert_eq!(
        actions,
        vec![
            TraceAction::SegmentMap,
            TraceAction::Alloc,
            TraceAction::FreeRequested,
            TraceAction::FreeCompleted
        ]
    );
}

#[test]
fn auto_gc_bounds_cached_memory_after_stitches() {
    // The same sequence with and without autoGC: a checkerboard leaves five free 10 MiB
    // blocks; a 12 MiB request stitches pages from two of them, leaving four blocks with
    // whole pages cached. With autoGC at 0 bytes the stitch retires every cached interior
    // page, of every block, for release; the next slow path (another stream, so it stitches
    // nothing) unmaps and releases them.
    let run = |auto_gc| {
        let cfg = Config {
            auto_gc_bytes: auto_gc,
            ..Config::default()
        };
        let (dev, a) = setup(1 << 30, cfg);
        let _live = checkerboard(&a, 0);
        a.allocate(12 * MIB, 0).unwrap();
        a.allocate(PAGE, 9).unwrap();
        a.verify().unwrap();
        let s = a.stats();
        assert!(s.stitches >= 1);
        (s.num_device_free, s.cached_bytes, dev.physical_bytes())
    };
    let (freed_off, cached_off, held_off) = run(None);
    let (freed_on, cached_on, held_on) = run(Some(0));
    assert_eq!(freed_off, 0, "without autoGC nothing is released");
    assert!(freed_on > 0, "autoGC released pages");
    assert!(cached_on < cached_off, "{cached_on} < {cached_off}");
    assert!(
        cached_on < PAGE * 8,
        "only partial pages stay cached: {cached_on}"
    );
    assert!(held_on < held_off, "{held_on} < {held_off}");
}

#[test]
fn many_threads_share_one_allocator() {
    let (dev, a) = setup(8 << 30, Config::default());
    let a = Arc::new(a);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut seed = t * 7919 + 1;
                let mut live = Vec::new();
                for _ in 0..5000 {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    if live.len() < 50 && (seed >> 33) % 3 != 0 {
                        let size = 512 + (seed >> 20) % (24 * MIB);
                        live.push(a.allocate(size, t % 2).unwrap());
                    } else if let Some(p) = live.pop() {
                        a.free(p).unwrap();
                    }
                }
                for p in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    a.verify().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
    assert_eq!(dev.live_mappings(), 0);
}

#[test]
fn allocator_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Allocator<SimDevice>>();
}

#[test]
fn a_pending_free_does_not_make_others_wait_when_memory_is_available() {
    let (_dev, a) = setup_async(80 << 30, Config::default());
    let _one = a.allocate(4, 1).unwrap();
    let x = a.allocate(256 * MIB, 1).unwrap();
    a.record_stream(x, 2).unwrap();
    a.free(x).unwrap();
    let z = a.allocate(256 * MIB, 1).unwrap();
    assert_ne!(z, x, "x may still be read by stream 2");
    let s = a.stats();
    assert_eq!(
        (s.num_alloc_retries, s.num_sync_all_streams),
        (0, 0),
        "{s:?}"
    );
}

#[test]
fn allocate_at_recreates_a_freed_block_of_a_graph_pool() {
    let (_dev, a) = setup(1 << 30, Config::default());
    let pool = GraphPoolId(3, 1);
    a.begin_allocate_to_pool(pool);
    let p = a.allocate_in(6 * MIB, 4, pool).unwrap();
    let q = a.allocate_in(64 << 10, 4, pool).unwrap();
    a.end_allocate_to_pool(pool);
    a.free(p).unwrap();
    a.free(q).unwrap();
    // Back at the checkpoint: both are live again, at their addresses.
    a.allocate_at(p, 6 * MIB, 6 * MIB, 4, pool).unwrap();
    a.allocate_at(q, 64 << 10, 1000, 4, pool).unwrap();
    assert_eq!(a.allocation(p).unwrap().size, 6 * MIB);
    assert_eq!(a.allocation(q).unwrap().requested, 1000);
    a.verify().unwrap();
    // Errors: live already, wrong pool, past the free block, unknown memory.
    assert!(matches!(
        a.allocate_at(p, 6 * MIB, 1, 4, pool),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(
        a.allocate_at(p, 6 * MIB, 1, 4, GraphPoolId::DEFAULT),
        Err(Error::InvalidState(_))
    ));
    a.free(p).unwrap();
    assert!(matches!(
        a.allocate_at(p, 1 << 29, 1, 4, pool),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(
        a.allocate_at(0x1000, MIB * 2, 1, 4, pool),
        Err(Error::InvalidState(_))
    ));
    // A part of a free block can be re-created too.
    a.allocate_at(p + 2 * MIB, 2 * MIB, 2 * MIB, 4, pool)
        .unwrap();
    a.verify().unwrap();
}

#[test]
fn inactive_split_counts_only_runs_with_an_active_block_as_pytorch() {
    let (_dev, a) = setup(1 << 30, Config::default());
    let p = a.allocate(1, 0).unwrap();
    let s = a.stats();
    // A 2 MiB page: 512 bytes live, the rest split off (PyTorch: the same).
    assert_eq!(s.inactive_split.aggregate().current, 1);
    assert_eq!(
        s.inactive_split_bytes.aggregate().current as u64,
        2 * MIB - 512
    );
    a.free(p).unwrap();
    let s = a.stats();
    // Freed: the page is one free run, cached but not split (PyTorch: 0).
    assert_eq!(s.inactive_split.aggregate().current, 0);
    assert_eq!(s.inactive_split_bytes.aggregate().current, 0);
    let q = a.allocate(MIB, 0).unwrap();
    assert_eq!(
        a.stats().inactive_split_bytes.aggregate().current as u64,
        MIB
    );
    a.free(q).unwrap();
    assert_eq!(a.stats().inactive_split_bytes.aggregate().current, 0);
    a.verify().unwrap();
}

/// PyTorch's `_check_memory_stat_consistency` for expandable segments (what gmlake's runs
/// are): the statistics equal what the snapshot adds up, per pool, along a random sequence
/// with stitches, frees and empty_cache.
#[test]
fn stats_equal_what_the_snapshot_adds_up() {
    let (_dev, a) = setup(1 << 30, Config::default());
    let mut seed = 12345u64;
    let mut rnd = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut live: Vec<u64> = Vec::new();
    let check = |a: &Allocator<Arc<SimDevice>>, step: usize| {
        let snap = a.snapshot();
        let s = a.stats();
        let mut sums = [[0i64; 6]; 3];
        for seg in &snap.segments {
            for i in [0, seg.pool as usize] {
                sums[i][0] += seg.total_size as i64;
                sums[i][1] += seg.allocated_size as i64;
                sums[i][2] += seg.active_size as i64;
                sums[i][3] += seg.requested_size as i64;
                for b in &seg.blocks {
                    if b.state == BlockState::ActiveAllocated {
                        sums[i][4] += 1;
                    }
                    if b.state != BlockState::Inactive {
                        sums[i][5] += 1;
                    }
                }
            }
        }
        for (i, sum) in sums.iter().enumerate() {
            let got = [
                s.reserved_bytes.0[i].current,
                s.allocated_bytes.0[i].current,
                s.active_bytes.0[i].current,
                s.requested_bytes.0[i].current,
                s.allocation.0[i].current,
                s.active.0[i].current,
            ];
            assert_eq!(&got, sum, "step {step}, pool {i}: stats vs snapshot");
        }
    };
    for step in 0..400 {
        if !live.is_empty() && rnd(10) < 4 {
            let p = live.swap_remove(rnd(live.len() as u64) as usize);
            a.free(p).unwrap();
        } else {
            let n = if step % 3 == 0 {
                1 + rnd(4096)
            } else {
                1 + rnd(24 * MIB)
            };
            match a.allocate(n, rnd(2)) {
                Ok(p) => live.push(p),
                Err(Error::OutOfMemory(_)) => {}
                Err(e) => panic!("{e}"),
            }
        }
        check(&a, step);
        if step % 97 == 96 {
            a.empty_cache().unwrap();
            check(&a, step);
        }
    }
    for p in live {
        a.free(p).unwrap();
    }
    check(&a, 400);
    a.verify().unwrap();
}

/// Issue 20: waiting for the GPU before memory is released or moved (empty_cache, an
/// out-of-memory retry) waits for the streams that used the allocator's free memory, with
/// the lock held, never for the whole device: a stream busy with other work (a long kernel,
/// a collective waiting for a peer) is not waited for. Memory is still never released or
/// reused before the work of its own stream (and of record_stream's streams) completes: the
/// simulated device flags a release under queued work.
#[test]
fn waits_before_release_cover_the_allocators_streams_only() {
    let (dev, a) = setup_async(64 * MIB, Config::default());
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
    let t = a.allocate(56 * MIB, 2).unwrap();
    assert!(a.stats().num_sync_all_streams > s0);
    assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
    assert_eq!(dev.queued_ops(), 1, "stream 9 was not waited for");
    a.verify().unwrap();
    a.free(t).unwrap();
    a.free(busy).unwrap();
    dev.complete_all();
    a.empty_cache().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
}
