//! The host tier on a synthetic training job (issue 16): per layer a weight (used in forward
//! and backward) and an activation (made in forward, used in backward, in reverse order), for
//! a few steps, on the simulated device (asynchronous, contents checked), under a device
//! budget. Prints, per budget and policy, the bytes moved each way, misses (gets that waited
//! for a copy), evictions, prefetches and the allocator's peak reserved memory, next to the
//! peak without the tier (everything resident).
//!
//! `cargo run -p gmlake-core --example tier_fwd_bwd [layers] [steps]`

use gmlake_core::{
    Allocator, Config, EvictionPolicy, Lru, SimDevice, SizeLatencyAware, Tier, TierConfig,
    TierStats,
};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn wsize(i: u64) -> u64 {
    (1 + i % 3) * MIB
}

fn asize(i: u64) -> u64 {
    (2 + (i * 5) % 7) * MIB
}

/// Runs the job; returns the tier's statistics and the allocator's peak reserved bytes.
fn run(
    layers: u64,
    steps: u64,
    budget: Option<u64>,
    policy: Box<dyn EvictionPolicy>,
    prefetch: bool,
) -> (TierStats, i64) {
    let dev = Arc::new(SimDevice::new(1 << 34).asynchronous());
    let alloc = Arc::new(Allocator::new(dev.clone(), Config::default()).unwrap());
    let t = Tier::new(
        alloc.clone(),
        TierConfig {
            device_budget: budget,
            ..TierConfig::default()
        },
        policy,
    );
    let tick = |now: u64| {
        if prefetch {
            t.advance(now).unwrap()
        } else {
            t.poll().unwrap()
        }
    };
    let per_step = 4 * layers;
    let mut weights = Vec::new();
    for i in 0..layers {
        let (w, p) = t.create(wsize(i), 0).unwrap();
        dev.fill(p, wsize(i), 1000 + i, 0).unwrap();
        t.put(w, Some(i)).unwrap();
        weights.push(w);
    }
    for step in 0..steps {
        let base = step * per_step;
        let mut acts = Vec::new();
        for i in 0..layers {
            tick(base + i);
            let w = t.get(weights[i as usize], 0).unwrap();
            let (a, p) = t.create(asize(i), 0).unwrap();
            dev.fill(p, asize(i), step * 1000 + i, 0).unwrap();
            dev.complete_all();
            assert_eq!(
                dev.checksum(w.ptr, wsize(i)).unwrap(),
                SimDevice::fill_checksum(wsize(i), 1000 + i)
            );
            let bwd = base + 2 * layers - 1 - i;
            t.put(a, Some(bwd)).unwrap();
            t.put(weights[i as usize], Some(bwd)).unwrap();
            acts.push(a);
        }
        for i in (0..layers).rev() {
            tick(base + 2 * layers - 1 - i);
            let a = t.get(acts[i as usize], 0).unwrap();
            let w = t.get(weights[i as usize], 0).unwrap();
            dev.complete_all();
            assert_eq!(
                dev.checksum(a.ptr, asize(i)).unwrap(),
                SimDevice::fill_checksum(asize(i), step * 1000 + i)
            );
            assert_eq!(
                dev.checksum(w.ptr, wsize(i)).unwrap(),
                SimDevice::fill_checksum(wsize(i), 1000 + i)
            );
            t.free(acts[i as usize]).unwrap();
            t.put(weights[i as usize], Some(base + per_step + i))
                .unwrap();
        }
        t.verify().unwrap();
    }
    assert!(dev.hazards().is_empty(), "{:?}", dev.hazards());
    let peak = alloc.stats().reserved_bytes.aggregate().peak;
    (t.stats(), peak)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let layers: u64 = args.next().map_or(8, |a| a.parse().expect("layers"));
    let steps: u64 = args.next().map_or(3, |a| a.parse().expect("steps"));
    let (_, peak_all) = run(layers, steps, None, Box::new(Lru), false);
    let weights: u64 = (0..layers).map(wsize).sum();
    let acts: u64 = (0..layers).map(asize).sum();
    println!(
        "{layers} layers, {steps} steps: weights {} MiB, activations {} MiB; peak reserved \
         without a budget: {} MiB",
        weights / MIB,
        acts / MIB,
        peak_all / MIB as i64
    );
    println!(
        "{:>7} {:>6} {:>8} {:>9} {:>9} {:>7} {:>6} {:>10} {:>9}",
        "budget",
        "policy",
        "prefetch",
        "to host",
        "to dev",
        "misses",
        "evict",
        "prefetches",
        "peak res"
    );
    for budget in [weights + acts / 2, (weights + acts) / 2, weights + 8 * MIB] {
        for prefetch in [false, true] {
            for aware in [false, true] {
                let policy: Box<dyn EvictionPolicy> = if aware {
                    Box::new(SizeLatencyAware::default())
                } else {
                    Box::new(Lru)
                };
                let name = policy.name();
                let (s, peak) = run(layers, steps, Some(budget), policy, prefetch);
                println!(
                    "{:>7} {:>6} {:>8} {:>9} {:>9} {:>7} {:>6} {:>10} {:>9}",
                    budget / MIB,
                    name,
                    prefetch,
                    s.bytes_to_host / MIB,
                    s.bytes_to_device / MIB,
                    s.misses,
                    s.evictions,
                    s.prefetches,
                    peak / MIB as i64
                );
            }
        }
    }
}
