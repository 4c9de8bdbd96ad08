//! Property tests of the host tier: random create / put / get / free / offload / fill /
//! advance / completion sequences on a small simulated device (asynchronous mostly), with and without a
//! device budget and with either policy, checking after every step that
//! - the tier's invariants hold (`Tier::verify`: states, accounting, budget) and the
//!   allocator's too;
//! - the simulated device saw no data race and no memory freed under a copy (its hazards);
//!
//! whenever the device completes its work, that every tensor the client holds has the contents
//! it last wrote (checksums survive any number of round trips to the host); and at the end,
//! after getting and checking every tensor and freeing them all, that no pinned buffer and no
//! device byte is left.
//!
//! `GMLAKE_TIER_PROPTEST_CASES` sets the number of sequences (default 300).

use gmlake_core::{
    Allocator, Config, Error, EvictionPolicy, Lru, SimDevice, SizeLatencyAware, TensorId, Tier,
    TierConfig,
};
use proptest::prelude::*;
use std::sync::Arc;

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
enum Op {
    Create {
        size: u64,
        stream: u64,
    },
    Put {
        i: usize,
        next: Option<u64>,
    },
    Get {
        i: usize,
        stream: u64,
    },
    Fill(usize),
    Free(usize),
    Offload(usize),
    Advance(u64),
    Complete,
    /// The client allocates and hands the allocation to the tier (`Tier::adopt`).
    Adopt {
        size: u64,
        stream: u64,
    },
    /// The client's allocation ran out of memory: the tier gives room back.
    Relieve(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u64..(1 << 20), 0u64..2).prop_map(|(size, stream)| Op::Create { size, stream }),
        3 => ((1u64 << 20)..(8 << 20), 0u64..2).prop_map(|(size, stream)| Op::Create { size, stream }),
        6 => (any::<usize>(), prop::option::of(0u64..40)).prop_map(|(i, next)| Op::Put { i, next }),
        5 => (any::<usize>(), 0u64..2).prop_map(|(i, stream)| Op::Get { i, stream }),
        2 => any::<usize>().prop_map(Op::Fill),
        1 => any::<usize>().prop_map(Op::Free),
        3 => any::<usize>().prop_map(Op::Offload),
        3 => (0u64..6).prop_map(Op::Advance),
        2 => Just(Op::Complete),
        2 => ((1u64 << 10)..(6 << 20), 0u64..2).prop_map(|(size, stream)| Op::Adopt { size, stream }),
        1 => (1u64..(8 << 20)).prop_map(Op::Relieve),
    ]
}

/// What the client knows of a tensor.
struct Model {
    id: TensorId,
    bytes: u64,
    seed: u64,
    /// Held by the client (created or got, not put since): its pointer and stream.
    held: Option<(u64, u64)>,
    /// The stream of the tensor's last create or get (its copies are queued there).
    stream: u64,
}

fn run(
    budget: Option<u64>,
    aware: bool,
    asynchronous: bool,
    host_cache: u64,
    eager_free: bool,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let dev = SimDevice::new(48 * MIB);
    let dev = Arc::new(if asynchronous {
        dev.asynchronous()
    } else {
        dev
    });
    let alloc = Arc::new(Allocator::new(dev.clone(), Config::default()).unwrap());
    let policy: Box<dyn EvictionPolicy> = if aware {
        Box::new(SizeLatencyAware::default())
    } else {
        Box::new(Lru)
    };
    let t = Tier::new(
        alloc.clone(),
        TierConfig {
            device_budget: budget,
            host_cache,
            eager_free,
            ..TierConfig::default()
        },
        policy,
    );
    let mut live: Vec<Model> = Vec::new();
    let mut now = 0u64;
    let mut seed = 1u64;
    let check_held = |live: &[Model]| -> Result<(), TestCaseError> {
        for m in live {
            if let Some((ptr, _)) = m.held {
                let got = dev
                    .checksum(ptr, m.bytes)
                    .map_err(|e| TestCaseError::fail(format!("tensor {:?}: {e}", m.id)))?;
                prop_assert_eq!(
                    got,
                    SimDevice::fill_checksum(m.bytes, m.seed),
                    "contents of tensor {:?}",
                    m.id
                );
            }
        }
        Ok(())
    };
    let oom_ok = |r: &Error| matches!(r, Error::OutOfMemory(_));
    for op in ops {
        match op {
            Op::Create { size, stream } => match t.create(size, stream) {
                Ok((id, ptr)) => {
                    let bytes = size.div_ceil(512) * 512;
                    seed += 1;
                    dev.fill(ptr, bytes, seed, stream).unwrap();
                    live.push(Model {
                        id,
                        bytes,
                        seed,
                        held: Some((ptr, stream)),
                        stream,
                    });
                }
                Err(e) => prop_assert!(oom_ok(&e), "create: {e}"),
            },
            Op::Adopt { size, stream } => {
                let bytes = size.div_ceil(512) * 512;
                match alloc.allocate(bytes, stream) {
                    Ok(ptr) => {
                        seed += 1;
                        dev.fill(ptr, bytes, seed, stream).unwrap();
                        let id = t.adopt(ptr, size, stream).unwrap();
                        live.push(Model {
                            id,
                            bytes,
                            seed,
                            held: Some((ptr, stream)),
                            stream,
                        });
                    }
                    Err(e) => prop_assert!(oom_ok(&e), "client allocation: {e}"),
                }
            }
            Op::Relieve(bytes) => {
                t.relieve(bytes).unwrap();
                for m in live.iter().filter(|m| m.held.is_none()) {
                    let st = t.state(m.id);
                    prop_assert!(st.is_some(), "tensor {:?} lost", m.id);
                }
            }
            Op::Put { i, next } if !live.is_empty() => {
                let n = live.len();
                let m = &mut live[i % n];
                let r = t.put(m.id, next.map(|d| now + d));
                if m.held.is_some() {
                    r.unwrap();
                    m.held = None;
                } else {
                    prop_assert!(r.is_err(), "put of a tensor not held");
                }
            }
            Op::Get { i, stream } if !live.is_empty() => {
                let n = live.len();
                let m = &mut live[i % n];
                if stream != m.stream {
                    // A correct client orders the old stream before the new one.
                    dev.complete_all();
                }
                match t.get(m.id, stream) {
                    Ok(f) => {
                        if let Some((_, copy_stream)) = f.event {
                            if copy_stream != stream {
                                dev.complete_all(); // waits for the event
                            }
                        }
                        m.held = Some((f.ptr, stream));
                        m.stream = stream;
                    }
                    Err(e) => prop_assert!(oom_ok(&e), "get: {e}"),
                }
            }
            Op::Fill(i) if !live.is_empty() => {
                let n = live.len();
                let m = &mut live[i % n];
                if let Some((ptr, stream)) = m.held {
                    seed += 1;
                    m.seed = seed;
                    dev.fill(ptr, m.bytes, seed, stream).unwrap();
                }
            }
            Op::Free(i) if !live.is_empty() => {
                let n = live.len();
                let m = live.swap_remove(i % n);
                t.free(m.id).unwrap();
            }
            Op::Offload(i) if !live.is_empty() => {
                let n = live.len();
                let m = &live[i % n];
                let r = t.offload(m.id);
                if m.held.is_none() {
                    // Put: offloaded, unless a copy back is still in flight.
                    prop_assert!(r.is_ok() || matches!(r, Err(Error::InvalidState(_))));
                } else {
                    prop_assert!(r.is_err());
                }
            }
            Op::Advance(d) => {
                now += d;
                t.advance(now).unwrap();
            }
            Op::Complete => {
                dev.complete_all();
                t.poll().unwrap();
                check_held(&live)?;
            }
            _ => {}
        }
        t.verify().map_err(TestCaseError::fail)?;
        alloc.verify().map_err(TestCaseError::fail)?;
        let hz = dev.hazards();
        prop_assert!(hz.is_empty(), "hazards: {:?}", hz);
    }
    // Every tensor comes back intact, one at a time.
    for m in &mut live {
        if m.held.is_some() {
            t.put(m.id, None).unwrap();
            m.held = None;
        }
    }
    for m in live.drain(..) {
        dev.complete_all();
        let f = t.get(m.id, m.stream).unwrap();
        dev.complete_all();
        prop_assert_eq!(
            dev.checksum(f.ptr, m.bytes).unwrap(),
            SimDevice::fill_checksum(m.bytes, m.seed),
            "final contents of {:?}",
            m.id
        );
        t.free(m.id).unwrap();
        t.verify().map_err(TestCaseError::fail)?;
    }
    t.flush().unwrap();
    prop_assert!(t.stats().host_cached_bytes <= host_cache);
    t.trim_host_cache().unwrap();
    let s = t.stats();
    if std::env::var("TIER_PROP_STATS").is_ok() {
        eprintln!("{s:?}");
    }
    prop_assert_eq!(s.device_bytes, 0);
    prop_assert_eq!(s.host_bytes, 0);
    prop_assert_eq!(dev.host_buffers(), (0, 0));
    if let Some(b) = budget {
        // Adopted memory exists before the tier sees it: only the tier's own may not exceed.
        if s.adopts == 0 {
            prop_assert!(s.peak_device_bytes <= b);
        }
    }
    prop_assert_eq!(alloc.stats().allocated_bytes.aggregate().current, 0);
    prop_assert!(dev.hazards().is_empty(), "hazards: {:?}", dev.hazards());
    Ok(())
}

/// Sequences to run: `GMLAKE_TIER_PROPTEST_CASES` (its own knob: a tier sequence costs
/// about 35 ms in a debug build, ten times an allocator sequence), else 300.
fn cases() -> u32 {
    std::env::var("GMLAKE_TIER_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn random_tier_sequences_keep_data_and_invariants(
        budget in prop::option::of((8u64..40).prop_map(|m| m * MIB)),
        aware in prop::bool::ANY,
        asynchronous in prop::bool::weighted(0.8),
        host_cache in prop_oneof![Just(0u64), Just(16 * MIB)],
        eager_free in prop::bool::ANY,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run(budget, aware, asynchronous, host_cache, eager_free, ops)?;
    }
}
