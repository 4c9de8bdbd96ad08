//! The driver-share watch (`driver_share_notice`, `driver_share_upgrade`): a job that keeps
//! paying for driver calls is told once, and its new memory gets pages near its mean large
//! tensor (or, without the upgrade, the notice suggests them); a job whose driver calls stop
//! after its warm-up is never told; with the upgrade off, the watch changes no decision.

use gmlake_core::{Allocator, Config, SimDevice};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// A device whose maps take `delay` each, as the driver's do.
fn allocator(delay: Duration, conf: &str) -> Allocator<SimDevice> {
    let mut cfg = Config::default();
    cfg.apply_conf(conf).unwrap();
    let a = Allocator::new(SimDevice::new(64 << 30).with_map_delay(delay), cfg).unwrap();
    a.set_driver_share_window(Duration::from_millis(20));
    a
}

/// xorshift: the same sequence every run.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// Random sizes (2-34 MiB) and lifetimes, 48 live blocks: misses map pages at every turn.
/// Runs until a notice is queued or `limit` has passed; returns the pairs made.
fn random_until_notice(a: &Allocator<SimDevice>, limit: Duration) -> usize {
    let mut next = rng(7);
    let mut live: Vec<u64> = (0..48)
        .map(|_| a.allocate((2 + next() % 32) * MIB + 512, 0).unwrap())
        .collect();
    let t0 = Instant::now();
    let mut pairs = 0;
    while t0.elapsed() < limit && !a.has_notices() {
        let j = (next() % live.len() as u64) as usize;
        a.free(live[j]).unwrap();
        live[j] = a.allocate((2 + next() % 32) * MIB + 512, 0).unwrap();
        pairs += 1;
    }
    for p in live {
        a.free(p).unwrap();
    }
    pairs
}

/// The page a notice gives or suggests, in bytes: the number after `marker`.
fn page_after(n: &str, marker: &str) -> u64 {
    let at = &n[n
        .find(marker)
        .unwrap_or_else(|| panic!("{marker:?} in {n}"))
        + marker.len()..];
    let digits: String = at.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse::<u64>().expect("a number") << 20
}

#[test]
fn a_job_that_keeps_mapping_is_told_once_and_gets_larger_pages() {
    let a = allocator(Duration::from_micros(300), "");
    random_until_notice(&a, Duration::from_secs(20));
    assert!(a.has_notices(), "no notice after 20 s of random lifetimes");
    let notices = a.take_notices();
    assert_eq!(notices.len(), 1, "{notices:?}");
    let n = &notices[0];
    assert!(n.contains("CUDA driver calls took"), "{n}");
    assert!(n.contains("driver_share_upgrade:off"), "{n}");
    // Twice the page first, the cap near the job's mean large block (2-34 MiB here): 8, 16
    // or 32 MiB.
    let page = page_after(n, "now gives new memory pages of ");
    assert_eq!(page, 4 * MIB, "{n}");
    let cap = page_after(n, "up to ");
    assert!([8 * MIB, 16 * MIB, 32 * MIB].contains(&cap), "{n}");
    assert_eq!(a.page_size(), 2 * MIB, "made at the next allocation");
    let p = a.allocate(5 * MIB, 0).unwrap();
    assert_eq!(
        a.page_size(),
        page,
        "new memory gets the page the notice named"
    );
    assert_eq!(a.stats().driver_share_upgrades, 1);
    assert_eq!(a.stats().page_upgrades, 1);
    a.free(p).unwrap();
    a.verify().unwrap();
    assert!(!a.has_notices(), "taken");
    assert!(a.take_notices().is_empty());
    let s = a.stats();
    assert_eq!(s.driver_share_notices, 1);
    assert!(
        s.driver_ns >= s.driver_calls.map * 300_000,
        "every map was timed: {} ns for {} maps",
        s.driver_ns,
        s.driver_calls.map
    );
    // Told once. A job that still pays at the new page doubles it, two windows a step, with a
    // line each time, and never past the page near the mean large tensor.
    for _ in 0..4 {
        random_until_notice(&a, Duration::from_millis(300));
        let p = a.allocate(5 * MIB, 0).unwrap();
        for m in a.take_notices() {
            assert!(
                m.starts_with("CUDA driver calls still took"),
                "told twice: {m}"
            );
            assert_eq!(
                page_after(&m, "new memory now gets pages of "),
                a.page_size(),
                "{m}"
            );
        }
        a.free(p).unwrap();
        a.verify().unwrap();
    }
    // The cap follows the mean as it is when the watch looks again; blocks here are at most
    // 34 MiB, so no page past 32 MiB.
    assert!(
        a.page_size() > page && a.page_size() <= 32 * MIB,
        "{} MiB after doubling from {} MiB (the first notice's cap {} MiB)",
        a.page_size() >> 20,
        page >> 20,
        cap >> 20
    );
    // The old generations go back as their blocks are freed: nothing is left once all are.
    a.empty_cache().unwrap();
    assert_eq!(a.reserved_bytes(), 0);
    assert_eq!(a.device().physical_bytes(), 0);
}

/// With one page size (`page_upgrade_at:off`) or `driver_share_upgrade:off` the notice
/// suggests the page instead, and the page stays.
#[test]
fn without_the_upgrade_the_notice_suggests_the_page() {
    for conf in ["page_upgrade_at:off", "driver_share_upgrade:off"] {
        let a = allocator(Duration::from_micros(300), conf);
        random_until_notice(&a, Duration::from_secs(20));
        let n = a.take_notices().pop().expect("a notice");
        let page = page_after(&n, "GMLAKE_CONF=page_size:");
        assert!([8 * MIB, 16 * MIB, 32 * MIB].contains(&page), "{conf}: {n}");
        let p = a.allocate(5 * MIB, 0).unwrap();
        assert_eq!(a.page_size(), 2 * MIB, "{conf}");
        assert_eq!(a.stats().driver_share_upgrades, 0, "{conf}");
        a.free(p).unwrap();
    }
}

#[test]
fn driver_share_notice_off_never_tells() {
    let a = allocator(Duration::from_micros(300), "driver_share_notice:off");
    random_until_notice(&a, Duration::from_millis(300));
    assert!(!a.has_notices());
    assert!(a.take_notices().is_empty());
    assert_eq!(a.stats().driver_share_notices, 0);
}

/// A periodic job maps at its first steps, and then reuses its ranges: a window of heavy
/// mapping followed by quiet ones is not a job that keeps paying.
#[test]
fn a_steady_job_after_a_costly_warm_up_is_not_told() {
    let a = allocator(Duration::from_millis(2), "");
    let sizes = [24 * MIB + 512, 6 * MIB, 40 * MIB + 4096, 3 * MIB, 17 * MIB];
    let step = |a: &Allocator<SimDevice>| {
        let ptrs: Vec<u64> = sizes.iter().map(|&s| a.allocate(s, 0).unwrap()).collect();
        for p in ptrs {
            a.free(p).unwrap();
        }
    };
    // Warm-up: new memory, well over a quarter of the window in maps.
    let t0 = Instant::now();
    step(&a);
    assert!(a.stats().driver_calls.map > 0);
    let warm = t0.elapsed();
    assert!(
        warm >= Duration::from_millis(20),
        "the warm-up mapped for {warm:?}"
    );
    // Steady steps over several windows: no driver call.
    let calls = a.stats().driver_calls.total();
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_millis(120) {
        step(&a);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        a.stats().driver_calls.total(),
        calls,
        "the steady state calls the driver"
    );
    // A new shape at last: one miss, after a long quiet window.
    let p = a.allocate(90 * MIB, 0).unwrap();
    a.free(p).unwrap();
    assert!(!a.has_notices(), "{:?}", a.take_notices());
}

/// Without the upgrade the watch reports and decides nothing: the same sequence places every
/// block at the same address with it on and off, and makes the same driver calls.
#[test]
fn the_notice_alone_changes_no_decision() {
    let run = |conf: &str| {
        let a = allocator(Duration::from_micros(200), conf);
        let mut next = rng(11);
        let mut live: Vec<u64> = (0..32)
            .map(|_| a.allocate((1 + next() % 30) * MIB, 0).unwrap())
            .collect();
        let mut placed = Vec::new();
        for _ in 0..400 {
            let j = (next() % live.len() as u64) as usize;
            a.free(live[j]).unwrap();
            live[j] = a.allocate((1 + next() % 30) * MIB, 0).unwrap();
            placed.push(live[j]);
        }
        (
            placed,
            a.stats().driver_calls,
            a.stats().driver_share_notices,
        )
    };
    let (on, calls_on, told) = run("driver_share_notice:0.01,driver_share_upgrade:off");
    let (off, calls_off, _) = run("driver_share_notice:off");
    assert_eq!(told, 1, "the low threshold was crossed");
    assert_eq!(on, off);
    assert_eq!(calls_on, calls_off);
}

/// Generations follow one another (the watch may ask again at a larger page): blocks of three
/// page sizes live at once, each old generation drains as its blocks are freed, and every
/// invariant holds at every step; at the end nothing is left on the device.
#[test]
fn generations_of_three_page_sizes_drain_in_turn() {
    let a = Allocator::new(SimDevice::new(4 << 30), Config::default()).unwrap();
    let mut next = rng(3);
    let mut live: Vec<u64> = Vec::new();
    let mut step = |a: &Allocator<SimDevice>, live: &mut Vec<u64>, n: usize| {
        for _ in 0..n {
            if live.len() > 24 || (!live.is_empty() && next().is_multiple_of(3)) {
                let j = (next() % live.len() as u64) as usize;
                a.free(live.swap_remove(j)).unwrap();
            } else {
                live.push(a.allocate((next() % (20 * MIB)) + 4096, 0).unwrap());
            }
            a.verify().unwrap();
        }
    };
    step(&a, &mut live, 200);
    assert!(a.request_page_upgrade(8 * MIB));
    assert!(!a.request_page_upgrade(16 * MIB), "one at a time");
    step(&a, &mut live, 200);
    assert_eq!(a.page_size(), 8 * MIB);
    assert!(!a.request_page_upgrade(4 * MIB), "pages only grow");
    assert!(a.request_page_upgrade(32 * MIB));
    step(&a, &mut live, 300);
    assert_eq!(a.page_size(), 32 * MIB);
    let s = a.stats();
    assert_eq!(s.page_upgrades, 2);
    assert!(s.pages_drained > 0, "the old generations gave pages back");
    for p in live.drain(..) {
        a.free(p).unwrap();
        a.verify().unwrap();
    }
    a.empty_cache().unwrap();
    a.verify().unwrap();
    assert_eq!(a.reserved_bytes(), 0);
    assert_eq!(a.device().physical_bytes(), 0);
    assert_eq!(a.device().live_mappings(), 0);
}
