//! The driver-share watch (`driver_share_notice`): a job that keeps paying for driver calls
//! is told once, with the settings that trade; a job whose driver calls stop after its
//! warm-up is never told; the watch changes no decision.

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

#[test]
fn a_job_that_keeps_mapping_is_told_once_with_the_settings() {
    let a = allocator(Duration::from_micros(300), "");
    random_until_notice(&a, Duration::from_secs(20));
    assert!(a.has_notices(), "no notice after 20 s of random lifetimes");
    let notices = a.take_notices();
    assert_eq!(notices.len(), 1, "{notices:?}");
    let n = &notices[0];
    assert!(n.contains("CUDA driver calls took"), "{n}");
    // A page near the job's mean large block (2-34 MiB here): 8, 16 or 32 MiB.
    assert!(
        ["page_size:8MiB,", "page_size:16MiB,", "page_size:32MiB,"]
            .iter()
            .any(|p| n.contains(p)),
        "{n}"
    );
    assert!(n.contains("util_target:0.96"), "{n}");
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
    // Told once: more of the same queues nothing.
    random_until_notice(&a, Duration::from_millis(200));
    assert!(a.take_notices().is_empty(), "told twice");
    a.verify().unwrap();
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

/// The watch reports; it decides nothing: the same sequence places every block at the same
/// address with it on and off, and makes the same driver calls.
#[test]
fn the_watch_changes_no_decision() {
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
    let (on, calls_on, told) = run("driver_share_notice:0.01");
    let (off, calls_off, _) = run("driver_share_notice:off");
    assert_eq!(told, 1, "the low threshold was crossed");
    assert_eq!(on, off);
    assert_eq!(calls_on, calls_off);
}
