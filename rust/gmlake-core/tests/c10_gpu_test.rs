//! The expectations `scripts/c10-only/gpu_test.cpp` (the in-tree route's GPU test) checks of
//! gmlake, on the simulated device with the default configuration: the same sequence of
//! requests, the same assertions. The GPU run adds the data round trips and PyTorch's API.

use gmlake_core::{Allocator, BlockState, Config, Error, SimDevice};
use std::sync::Arc;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// An H100 80GB as cudaMemGetInfo reports it.
const TOTAL: u64 = 79 * GIB + 300 * MIB;

fn allocated(a: &Allocator<Arc<SimDevice>>) -> i64 {
    a.stats().allocated_bytes.aggregate().current
}

fn reserved(a: &Allocator<Arc<SimDevice>>) -> i64 {
    a.stats().reserved_bytes.aggregate().current
}

/// Every live (pointer, size) lies in an allocated block of some segment of the snapshot.
fn in_snapshot(a: &Allocator<Arc<SimDevice>>, live: &[(u64, u64)]) {
    let snap = a.snapshot();
    for &(p, n) in live {
        let found = snap.segments.iter().any(|s| {
            p >= s.address
                && p < s.address + s.total_size
                && s.blocks.iter().any(|b| {
                    b.state == BlockState::ActiveAllocated
                        && p >= b.address
                        && p + n <= b.address + b.size
                })
        });
        assert!(found, "{p:#x} (+{n}) in no allocated block");
    }
}

#[test]
fn gpu_test_stages_hold_on_the_simulated_device() {
    let a = Allocator::new(Arc::new(SimDevice::new(TOTAL)), Config::default()).unwrap();
    let s2 = 7;

    // sizes
    let base = a.stats();
    assert_eq!(a.allocate(0, 0).unwrap(), 0);
    let sizes = [
        1,
        3,
        512,
        513,
        4 * KIB,
        64 * KIB,
        MIB - 1,
        MIB,
        MIB + 1,
        2 * MIB,
        2 * MIB + 1,
        3 * MIB + 5,
        8 * MIB,
        10 * MIB,
        10 * MIB + 1,
        20 * MIB + 7,
        64 * MIB,
        100 * MIB + 3,
        256 * MIB,
        GIB + 1,
    ];
    let mut live: Vec<(u64, u64)> = sizes
        .iter()
        .map(|&n| (a.allocate(n, 0).unwrap(), n))
        .collect();
    live.push((a.allocate(5 * MIB + 11, s2).unwrap(), 5 * MIB + 11));
    live.push((a.allocate(777, 0).unwrap(), 777));
    live.push((a.allocate(33 * MIB, 0).unwrap(), 33 * MIB));
    let asked: u64 = live.iter().map(|l| l.1).sum();
    assert!(live.iter().all(|l| l.0 % 256 == 0), "256-byte aligned");
    let mut sorted = live.clone();
    sorted.sort();
    assert!(
        sorted.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
        "disjoint"
    );
    let during = a.stats();
    assert!(
        during.allocated_bytes.aggregate().current - base.allocated_bytes.aggregate().current
            >= asked as i64
    );
    assert!(
        during.reserved_bytes.aggregate().current >= during.allocated_bytes.aggregate().current
    );
    assert!(
        during.allocation.aggregate().current - base.allocation.aggregate().current
            >= live.len() as i64
    );
    in_snapshot(&a, &live);
    for &(p, _) in &live {
        a.free(p).unwrap();
    }
    assert_eq!(allocated(&a), base.allocated_bytes.aggregate().current);

    // stitch: 17 blocks of 4 pages, every other one freed, then 3 x that
    a.empty_cache().unwrap();
    let block = 4 * a.page_size();
    let blocks: Vec<u64> = (0..17).map(|_| a.allocate(block, 0).unwrap()).collect();
    for p in blocks.iter().skip(1).step_by(2) {
        a.free(*p).unwrap();
    }
    let (r0, st0) = (reserved(&a), a.stats());
    assert!(a.cache_info().largest_free_block < 3 * block);
    let big = a.allocate(3 * block, 0).unwrap();
    let st1 = a.stats();
    assert!(st1.stitches > st0.stitches, "stitched");
    assert!(st1.pages_stitched > st0.pages_stitched);
    assert!(reserved(&a) <= r0, "reserved did not grow");
    let mut alive: Vec<(u64, u64)> = blocks.iter().step_by(2).map(|&p| (p, block)).collect();
    alive.push((big, 3 * block));
    in_snapshot(&a, &alive);
    a.free(big).unwrap();
    let big2 = a.allocate(3 * block, 0).unwrap();
    a.free(big2).unwrap();
    for p in blocks.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    a.empty_cache().unwrap();

    // record_stream (the simulated device completes work at once; the delay itself is
    // allocator.rs's record_stream_delays_reuse_until_the_event_completes)
    let p = a.allocate(8 * MIB, 0).unwrap();
    a.record_stream(p, s2).unwrap();
    a.free(p).unwrap();
    let q = a.allocate(8 * MIB, 0).unwrap();
    a.free(q).unwrap();

    // empty_cache
    let ps: Vec<u64> = (0..6)
        .map(|i| a.allocate(48 * MIB + i * MIB, 0).unwrap())
        .collect();
    let keep = a.allocate(3 * MIB, 0).unwrap();
    for p in ps {
        a.free(p).unwrap();
    }
    let (rb, ab) = (reserved(&a), allocated(&a));
    assert!(rb > ab, "cached free memory");
    a.empty_cache().unwrap();
    assert!(reserved(&a) < rb, "emptyCache lowered reserved");
    assert_eq!(allocated(&a), ab);
    assert!(reserved(&a) >= allocated(&a));
    a.free(keep).unwrap();
    a.empty_cache().unwrap();

    // oom: a 2 GiB cap, 4 GiB asked; then 512 MiB under the cap; then 4 GiB without it
    a.set_memory_fraction(2.0 * GIB as f64 / TOTAL as f64)
        .unwrap();
    let ooms = a.stats().num_ooms;
    match a.allocate(4 * GIB, 0) {
        Err(Error::OutOfMemory(info)) => {
            // (The C++ side raises c10::OutOfMemoryError with "CUDA out of memory. " before it.)
            let msg = Error::OutOfMemory(info).to_string();
            assert!(msg.contains("Tried to allocate 4.00 GiB"), "{msg}");
        }
        other => panic!("expected OOM, got {other:?}"),
    }
    assert!(a.stats().num_ooms > ooms);
    let small = a.allocate(512 * MIB, 0).unwrap();
    a.free(small).unwrap();
    a.set_memory_fraction(1.0).unwrap();
    let large = a.allocate(4 * GIB, 0).unwrap();
    a.free(large).unwrap();
    a.verify().unwrap();
}
