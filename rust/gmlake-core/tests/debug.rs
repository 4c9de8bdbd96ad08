//! The memory debugging mode on the simulated device: placement rules of guard pages (the
//! guard page is never mapped, a guarded block ends where its mapped pages end, the stats
//! count guard bytes), the quarantine, canary padding, and that the mode off changes nothing.

use gmlake_core::{Allocator, Config, Error, SimDevice};
use proptest::prelude::*;
use std::sync::Arc;

const PAGE: u64 = 2 << 20;

fn conf(text: &str) -> Config {
    let mut c = Config::default();
    c.apply_conf(text).unwrap();
    c
}

fn round(n: u64) -> u64 {
    n.div_ceil(512) * 512
}

/// A guarded live block: mapped to its end, the page after it unmapped, and (front) the page
/// before its first page unmapped.
fn check_guarded(dev: &SimDevice, ptr: u64, size: u64, front: bool) -> Result<(), String> {
    let end = ptr + round(size);
    if !ptr.is_multiple_of(512) {
        return Err(format!("{ptr:#x} is not 512-byte aligned"));
    }
    if !end.is_multiple_of(PAGE) {
        return Err(format!(
            "block {ptr:#x}+{size} does not end on a page boundary"
        ));
    }
    let mut va = ptr;
    while va < end {
        if dev.translate(va).is_none() {
            return Err(format!("byte {va:#x} of {ptr:#x} is not mapped"));
        }
        va = (va / PAGE + 1) * PAGE;
    }
    if dev.translate(end - 1).is_none() {
        return Err(format!("last byte of {ptr:#x} is not mapped"));
    }
    if dev.translate(end).is_some() || dev.translate(end + PAGE - 1).is_some() {
        return Err(format!("the guard page after {ptr:#x} is mapped"));
    }
    if front {
        let first = ptr / PAGE * PAGE;
        if dev.translate(first - 1).is_some() || dev.translate(first - PAGE).is_some() {
            return Err(format!("the guard page before {ptr:#x} is mapped"));
        }
    }
    Ok(())
}

#[test]
fn guarded_blocks_end_at_an_unmapped_page() {
    let dev = Arc::new(SimDevice::new(64 * PAGE));
    let a = Allocator::new(dev.clone(), conf("debug:guard")).unwrap();
    let sizes = [PAGE, PAGE + 1, 3 * PAGE + 700, 5 * PAGE - 512, 10 << 20];
    let mut ptrs = Vec::new();
    for &s in &sizes {
        let p = a.allocate(s, 7).unwrap();
        check_guarded(&dev, p, s, false).unwrap();
        let info = a.allocation(p + s - 1).unwrap();
        assert_eq!((info.ptr, info.size, info.requested), (p, round(s), s));
        ptrs.push(p);
        a.verify().unwrap();
    }
    // Below the threshold (one page): the arenas, no guard.
    let small = a.allocate(4096, 7).unwrap();
    assert_eq!(a.allocation(small).unwrap().size, 4096);
    let st = a.stats();
    assert_eq!(st.debug_guarded, sizes.len() as u64);
    assert_eq!(st.debug_guard_bytes, sizes.len() as u64 * PAGE);
    let pages: u64 = sizes.iter().map(|s| s.div_ceil(PAGE)).sum();
    assert_eq!(st.debug_pages, pages);
    assert_eq!(
        st.allocated_bytes.aggregate().current as u64,
        sizes.iter().map(|&s| round(s)).sum::<u64>() + 4096
    );
    // Freed: unmapped at once on a device whose events complete at once; no quarantine, so
    // the reservation goes too.
    let reservations = dev.live_reservations();
    a.free(ptrs[0]).unwrap();
    assert!(dev.translate(ptrs[0]).is_none());
    assert_eq!(dev.live_reservations(), reservations - 1);
    assert!(matches!(
        a.free(ptrs[0]),
        Err(Error::UnknownPointer(_) | Error::DoubleFree(_))
    ));
    a.verify().unwrap();
    for p in ptrs.drain(1..) {
        a.free(p).unwrap();
    }
    a.free(small).unwrap();
    a.empty_cache().unwrap();
    a.verify().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
    assert_eq!(dev.live_mappings(), 0);
}

#[test]
fn front_guard_and_threshold() {
    let dev = Arc::new(SimDevice::new(64 * PAGE));
    let a = Allocator::new(dev.clone(), conf("debug:guard_front,debug_guard_min:4096")).unwrap();
    for s in [4096, 100_000, PAGE + 3] {
        let p = a.allocate(s, 1).unwrap();
        check_guarded(&dev, p, s, true).unwrap();
    }
    assert_eq!(a.stats().debug_guard_bytes, 3 * 2 * PAGE);
    a.verify().unwrap();
    // Below the threshold: not guarded.
    let p = a.allocate(1000, 1).unwrap();
    assert_eq!(a.stats().debug_guarded, 3);
    a.free(p).unwrap();
}

#[test]
fn freed_guarded_range_waits_for_its_streams() {
    let dev = Arc::new(SimDevice::new(64 * PAGE).asynchronous());
    let a = Allocator::new(dev.clone(), conf("debug:guard")).unwrap();
    let p = a.allocate(3 * PAGE, 1).unwrap();
    a.record_stream(p, 2).unwrap();
    a.free(p).unwrap();
    // Kernels may still use it: mapped until the events complete.
    assert!(dev.translate(p).is_some());
    assert_eq!(a.stats().active.aggregate().current, 1);
    a.verify().unwrap();
    dev.complete_all();
    let q = a.allocate(1000, 1).unwrap(); // any call progresses the quarantine
    assert!(dev.translate(p).is_none());
    assert_eq!(a.stats().active.aggregate().current, 1);
    a.free(q).unwrap();
    a.verify().unwrap();
    // Its pages are reused by the next guarded range, with no new physical memory.
    let before = dev.physical_bytes();
    let r = a.allocate(2 * PAGE, 1).unwrap();
    assert_eq!(dev.physical_bytes(), before);
    a.free(r).unwrap();
}

#[test]
fn quarantine_holds_freed_blocks_back() {
    let dev = Arc::new(SimDevice::new(64 * PAGE));
    let a = Allocator::new(dev.clone(), conf("debug:guard+poison,debug_quarantine:3")).unwrap();
    // Small blocks: not reused while held.
    let p = a.allocate(1024, 0).unwrap();
    a.free(p).unwrap();
    assert!(matches!(a.free(p), Err(Error::DoubleFree(_))));
    let q = a.allocate(1024, 0).unwrap();
    assert_ne!(p, q, "a quarantined block is not handed out again");
    let st = a.stats();
    assert_eq!(
        (st.debug_quarantine_blocks, st.debug_quarantine_bytes),
        (1, 1024)
    );
    // A large one: unmapped at once, its addresses kept reserved while held.
    let g = a.allocate(PAGE, 0).unwrap();
    let reservations = dev.live_reservations();
    a.free(g).unwrap();
    assert!(dev.translate(g).is_none());
    assert_eq!(dev.live_reservations(), reservations);
    assert_eq!(a.stats().debug_quarantine_blocks, 2);
    a.verify().unwrap();
    // Three more frees: the first two leave the quarantine.
    for _ in 0..3 {
        let x = a.allocate(4096, 0).unwrap();
        a.free(x).unwrap();
        a.verify().unwrap();
    }
    let st = a.stats();
    assert_eq!(st.debug_quarantine_blocks, 3);
    assert!(dev.live_reservations() < reservations);
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().debug_quarantine_blocks, 0);
    a.verify().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn quarantine_by_bytes() {
    let dev = Arc::new(SimDevice::new(64 * PAGE));
    let a = Allocator::new(dev, conf("debug:quarantine,debug_quarantine:8KiB")).unwrap();
    for _ in 0..10 {
        let x = a.allocate(4096, 0).unwrap();
        a.free(x).unwrap();
        assert!(a.stats().debug_quarantine_bytes <= 8192 + 4096);
    }
    a.verify().unwrap();
}

#[test]
fn canaries_pad_requests() {
    let dev = Arc::new(SimDevice::new(64 * PAGE));
    let a = Allocator::new(dev, conf("debug:guard+canary")).unwrap();
    for s in [1, 511, 512, 4096, 100_000] {
        let p = a.allocate(s, 0).unwrap();
        let info = a.allocation(p).unwrap();
        assert_eq!(info.requested, s);
        assert_eq!(info.size, round(s + 64));
        assert!(info.size - s >= 64);
    }
    // Guarded requests are not padded: their end abuts the guard.
    let p = a.allocate(PAGE, 0).unwrap();
    assert_eq!(a.allocation(p).unwrap().size, PAGE);
    a.debug_note_canary_error();
    assert_eq!(a.stats().debug_canary_errors, 1);
}

#[test]
fn oom_in_debug_mode_releases_the_quarantine() {
    let dev = Arc::new(SimDevice::new(8 * PAGE));
    let a = Allocator::new(dev, conf("debug:all")).unwrap();
    let mut n = 0;
    for _ in 0..40 {
        let p = a.allocate(3 * PAGE, 0).expect("the quarantine makes room");
        a.free(p).unwrap();
        n += 1;
    }
    assert_eq!(n, 40);
    a.verify().unwrap();
    let p = a.allocate(4 * PAGE, 0).unwrap();
    assert!(matches!(
        a.allocate(5 * PAGE, 0),
        Err(Error::OutOfMemory(_))
    ));
    a.free(p).unwrap();
    a.verify().unwrap();
}

#[test]
fn off_changes_nothing() {
    let run = |c: Config| {
        let dev = Arc::new(SimDevice::new(1024 * PAGE));
        let a = Allocator::new(dev.clone(), c).unwrap();
        let mut live = Vec::new();
        for i in 0..200u64 {
            let s = (i * 7919 % 50 + 1) * 100_003 % (6 * PAGE) + 1;
            live.push(a.allocate(s, i % 2).unwrap());
            if i % 3 == 0 {
                a.free(live.remove((i as usize * 31) % live.len())).unwrap();
            }
        }
        (dev.calls(), a.stats(), live)
    };
    let base = run(Config::default());
    let off = run(conf("debug:off,debug_quarantine:off"));
    assert_eq!(base.0, off.0);
    assert_eq!(
        base.1.clone().without_timing(),
        off.1.clone().without_timing()
    );
    assert_eq!(base.2, off.2);
    assert_eq!(base.1.debug_guarded + base.1.debug_quarantine_blocks, 0);
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64, u64),
    Free(usize),
    Record(usize, u64),
    Complete,
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..(1 << 20), 0u64..2).prop_map(|(s, t)| Op::Alloc(s, t)),
        3 => ((1u64 << 20)..(12 << 20), 0u64..2).prop_map(|(s, t)| Op::Alloc(s, t)),
        6 => any::<usize>().prop_map(Op::Free),
        1 => (any::<usize>(), 0u64..3).prop_map(|(i, s)| Op::Record(i, s)),
        2 => Just(Op::Complete),
        1 => Just(Op::EmptyCache),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("GMLAKE_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200)
    ))]

    #[test]
    fn debug_mode_keeps_every_invariant(
        mode in 0usize..4,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let text = [
            "debug:guard",
            "debug:guard_front+canary,debug_guard_min:64KiB",
            "debug:all,debug_quarantine:5",
            "debug:canary+quarantine,debug_quarantine:1MiB",
        ][mode];
        let front = mode == 1;
        let min = if mode == 1 { 64 << 10 } else { PAGE };
        let guard = mode != 3;
        let dev = Arc::new(SimDevice::new(48 * PAGE).asynchronous());
        let a = Allocator::new(dev.clone(), conf(text)).unwrap();
        let mut live: Vec<(u64, u64)> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(s, t) => match a.allocate(s, t) {
                    Ok(p) => live.push((p, s)),
                    Err(Error::OutOfMemory(_)) => {}
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                },
                Op::Free(i) if !live.is_empty() => {
                    let (p, _) = live.swap_remove(i % live.len());
                    a.free(p).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Op::Record(i, s) if !live.is_empty() => {
                    a.record_stream(live[i % live.len()].0, s)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Op::Complete => dev.complete_all(),
                Op::EmptyCache => a.empty_cache().map_err(|e| TestCaseError::fail(e.to_string()))?,
                _ => {}
            }
            a.verify().map_err(TestCaseError::fail)?;
            let mut sorted = live.clone();
            sorted.sort();
            for w in sorted.windows(2) {
                let end = w[0].0 + a.allocation(w[0].0).unwrap().size;
                prop_assert!(end <= w[1].0, "overlap");
            }
            for &(p, s) in &live {
                let info = a.allocation(p).unwrap();
                prop_assert_eq!(info.ptr, p);
                prop_assert!(info.size >= round(s));
                if guard && s >= min {
                    check_guarded(&dev, p, s, front).map_err(TestCaseError::fail)?;
                } else {
                    prop_assert!(dev.translate(p + s - 1).is_some());
                }
            }
            let st = a.stats();
            let guarded = live.iter().filter(|&&(_, s)| guard && s >= min).count() as u64;
            prop_assert_eq!(st.debug_guarded, guarded);
            prop_assert_eq!(st.debug_guard_bytes, guarded * PAGE * (1 + front as u64));
        }
        for (p, _) in live.drain(..) {
            a.free(p).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        a.empty_cache().map_err(|e| TestCaseError::fail(e.to_string()))?;
        a.verify().map_err(TestCaseError::fail)?;
        prop_assert_eq!(dev.physical_bytes(), 0);
        prop_assert_eq!(dev.live_mappings(), 0);
    }
}

/// Active bytes (PyTorch's `active_bytes`) never exceed reserved bytes in any debug mode, and
/// return to zero once everything is freed and the cache emptied.
#[test]
fn active_bytes_stay_within_reserved_in_debug_modes() {
    for mode in [
        "debug:all",
        "debug:guard",
        "debug:guard+quarantine",
        "debug:canary",
        "debug:quarantine",
        "debug:poison",
    ] {
        let dev = Arc::new(SimDevice::new(4096 * PAGE));
        let a = Allocator::new(dev.clone(), conf(mode)).unwrap();
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut live: Vec<u64> = Vec::new();
        for i in 0..4000u64 {
            if live.len() > 40 || (!live.is_empty() && next() % 3 == 0) {
                let k = (next() % live.len() as u64) as usize;
                a.free(live.swap_remove(k)).unwrap();
            } else {
                let size = match next() % 4 {
                    0 => 1 + next() % 4096,
                    1 => 1 + next() % (1 << 20),
                    2 => 1 + next() % (8 << 20),
                    _ => 1 + next() % (64 << 20),
                };
                let stream = next() % 2;
                live.push(a.allocate(size, stream).unwrap());
            }
            let s = a.stats();
            let active = s.active_bytes.aggregate().current;
            let reserved = s.reserved_bytes.aggregate().current;
            assert!(
                active <= reserved,
                "{mode}, step {i}: active {active} > reserved {reserved}"
            );
            assert!(active >= 0, "{mode}, step {i}: active {active}");
        }
        for p in live.drain(..) {
            a.free(p).unwrap();
        }
        a.empty_cache().unwrap();
        let s = a.stats();
        assert_eq!(
            s.active_bytes.aggregate().current,
            0,
            "{mode}: active after all frees"
        );
        a.verify().unwrap();
    }
}
