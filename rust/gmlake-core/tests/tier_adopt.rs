//! The host tier taking over the client's allocations (`Tier::adopt`, the PyTorch path:
//! a tensor's storage handed to the tier) and shedding put tensors over the budget.

use gmlake_core::{
    Allocator, Config, Error, Lru, SimDevice, SizeLatencyAware, TensorState, Tier, TierConfig,
};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn tier(dev: SimDevice, budget: Option<u64>) -> Tier<Arc<SimDevice>> {
    let alloc = Allocator::new(Arc::new(dev), Config::default()).unwrap();
    Tier::new(
        Arc::new(alloc),
        TierConfig {
            device_budget: budget,
            ..TierConfig::default()
        },
        Box::new(Lru),
    )
}

fn check(t: &Tier<Arc<SimDevice>>) {
    t.verify().unwrap();
    t.allocator().verify().unwrap();
    let d = t.allocator().device();
    assert!(d.hazards().is_empty(), "{:?}", d.hazards());
}

#[test]
fn adopted_allocation_round_trips_through_the_host() {
    let t = tier(SimDevice::new(1 << 30), Some(4 * MIB));
    let a = t.allocator().clone();
    let p = a.allocate(3 * MIB + 100, 7).unwrap();
    a.device().fill(p, 3 * MIB, 5, 7).unwrap();
    let id = t.adopt(p, 3 * MIB + 100, 7).unwrap();
    assert_eq!(t.state(id), Some(TensorState::Resident));
    assert_eq!(t.stats().adopts, 1);
    check(&t);
    // A second allocation adopted and put: 6 MiB > 4 MiB, the put one goes out.
    let q = a.allocate(3 * MIB, 7).unwrap();
    let id2 = t.adopt(q, 3 * MIB, 7).unwrap();
    check(&t);
    t.put(id, Some(10)).unwrap();
    t.poll().unwrap();
    assert_eq!(t.state(id), Some(TensorState::Evicted));
    assert!(
        a.allocation(p).is_none(),
        "the tier freed the adopted block"
    );
    check(&t);
    t.put(id2, None).unwrap();
    let f = t.get(id, 7).unwrap();
    assert!(!f.hit);
    assert_eq!(
        a.device().checksum(f.ptr, 3 * MIB).unwrap(),
        SimDevice::fill_checksum(3 * MIB, 5)
    );
    check(&t);
    t.free(id).unwrap();
    t.free(id2).unwrap();
    t.flush().unwrap();
    check(&t);
    assert_eq!(t.stats().device_bytes, 0);
    assert_eq!(a.device().host_buffers(), (0, 0));
}

#[test]
fn adopt_refuses_what_is_not_an_allocation_start_or_held_already() {
    let t = tier(SimDevice::new(1 << 30), None);
    let a = t.allocator().clone();
    let p = a.allocate(2 * MIB, 0).unwrap();
    assert!(matches!(
        t.adopt(p + 512, 512, 0),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(
        t.adopt(p, 4 * MIB, 0),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(
        t.adopt(0xdead_0000, 512, 0),
        Err(Error::UnknownPointer(_))
    ));
    assert!(matches!(t.adopt(p, 0, 0), Err(Error::InvalidState(_))));
    let id = t.adopt(p, 2 * MIB, 0).unwrap();
    assert!(matches!(
        t.adopt(p, 2 * MIB, 0),
        Err(Error::InvalidState(_))
    ));
    t.free(id).unwrap();
    assert!(a.allocation(p).is_none());
    check(&t);
}

#[test]
fn asynchronous_evictions_of_adopted_memory_shed_without_waiting() {
    let t = tier(SimDevice::new(1 << 30).asynchronous(), Some(2 * MIB));
    let a = t.allocator().clone();
    let mut ids = Vec::new();
    for i in 0..6u64 {
        let p = a.allocate(MIB, 0).unwrap();
        a.device().fill(p, MIB, i, 0).unwrap();
        let id = t.adopt(p, MIB, 0).unwrap();
        t.put(id, Some(100 - i)).unwrap();
        ids.push(id);
        check(&t);
    }
    assert_eq!(t.stats().waits, 0, "adopt and put never wait");
    assert!(t.stats().evictions >= 4);
    a.device().complete_all();
    t.poll().unwrap();
    check(&t);
    assert!(t.stats().device_bytes <= 2 * MIB);
    // Backward: reverse order, each comes back intact.
    t.reconfigure(
        TierConfig {
            device_budget: Some(2 * MIB),
            ..TierConfig::default()
        },
        Box::new(SizeLatencyAware::default()),
    )
    .unwrap();
    assert_eq!(t.policy_name(), "aware");
    for (i, &id) in ids.iter().enumerate().rev() {
        let f = t.get(id, 0).unwrap();
        a.device().complete_all();
        assert_eq!(
            a.device().checksum(f.ptr, MIB).unwrap(),
            SimDevice::fill_checksum(MIB, i as u64)
        );
        t.free(id).unwrap();
        check(&t);
    }
    t.flush().unwrap();
    assert_eq!(t.stats().device_bytes, 0);
}

#[test]
fn eager_free_gives_the_block_back_when_the_copy_is_queued() {
    let alloc = Allocator::new(
        Arc::new(SimDevice::new(1 << 30).asynchronous()),
        Config::default(),
    )
    .unwrap();
    let t = Tier::new(
        Arc::new(alloc),
        TierConfig {
            device_budget: Some(4 * MIB),
            eager_free: true,
            ..TierConfig::default()
        },
        Box::new(Lru),
    );
    let a = t.allocator().clone();
    let p = a.allocate(3 * MIB, 1).unwrap();
    a.device().fill(p, 3 * MIB, 9, 1).unwrap();
    let id = t.adopt(p, 3 * MIB, 1).unwrap();
    t.put(id, None).unwrap();
    t.offload(id).unwrap();
    // Nothing completed yet, and the block is back in the allocator already.
    assert_eq!(t.state(id), Some(TensorState::Evicted));
    assert!(a.allocation(p).is_none());
    assert_eq!(t.stats().device_bytes, 0);
    check(&t);
    // Reused on the same stream: ordered after the copy out.
    let q = a.allocate(3 * MIB, 1).unwrap();
    a.device().fill(q, 3 * MIB, 10, 1).unwrap();
    check(&t);
    // Back on another stream: waits for the copy out first.
    let waits = t.stats().waits;
    let f = t.get(id, 2).unwrap();
    assert_eq!(t.stats().waits, waits + 1);
    a.device().complete_all();
    assert_eq!(
        a.device().checksum(f.ptr, 3 * MIB).unwrap(),
        SimDevice::fill_checksum(3 * MIB, 9)
    );
    assert_eq!(
        a.device().checksum(q, 3 * MIB).unwrap(),
        SimDevice::fill_checksum(3 * MIB, 10)
    );
    t.free(id).unwrap();
    a.free(q).unwrap();
    t.flush().unwrap();
    check(&t);
    assert_eq!(a.device().host_buffers(), (0, 0));
}
