//! The host tier through the bridge, over the simulated device (no GPU needed).

use super::ffi::{AllocStatus, TierConf, TierState};
use super::*;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn conf(budget: Option<u64>, policy: &str) -> TierConf {
    TierConf {
        has_budget: budget.is_some(),
        budget: budget.unwrap_or(0),
        policy: policy.to_string(),
        ..TierConf::default()
    }
}

#[test]
fn adopt_put_get_free_through_the_bridge() {
    let a = new_simulated_allocator(GIB, 0, "").unwrap();
    let t = a.new_tier(&conf(Some(4 * MIB), "lru")).unwrap();
    // Two allocations made by the client (a tensor's storage), handed to the tier.
    let p = a.allocate(3 * MIB, 5);
    let q = a.allocate(3 * MIB, 5);
    assert_eq!(
        (p.status, q.status),
        (AllocStatus::Allocated, AllocStatus::Allocated)
    );
    let idp = t.adopt(p.ptr, 3 * MIB, 5).unwrap();
    let idq = t.adopt(q.ptr, 3 * MIB, 5).unwrap();
    assert_eq!(t.state(idp), TierState::Resident);
    t.put(idp, 7).unwrap();
    t.poll().unwrap();
    assert_eq!(t.state(idp), TierState::Evicted, "over the budget: evicted");
    assert!(!a.allocation(p.ptr).unwrap().found, "its block went back");
    t.put(idq, -1).unwrap();
    let f = t.get(idp, 5).unwrap();
    assert!(!f.hit);
    assert_eq!(t.state(idp), TierState::Resident);
    t.verify().unwrap();
    let s = t.stats();
    assert_eq!((s.adopts, s.puts, s.gets, s.misses), (2, 2, 1, 1));
    assert_eq!(s.policy, "lru");
    assert!(s.has_budget && s.budget == 4 * MIB);
    let js = t.stats_json();
    assert!(
        js.contains("\"adopts\":2") && js.contains("\"policy\":\"lru\""),
        "{js}"
    );
    t.free(idp).unwrap();
    t.free(idq).unwrap();
    t.flush().unwrap();
    t.verify().unwrap();
    assert_eq!(t.stats().device_bytes, 0);
    assert_eq!(t.state(idp), TierState::Unknown);
    // A freed id is an error, not a crash.
    let e = t.free(idp).unwrap_err();
    assert!(e.contains("unknown tier tensor"), "{e}");
}

#[test]
fn create_and_reconfigure_and_bad_settings() {
    let a = new_simulated_allocator(GIB, 0, "").unwrap();
    let e = a.new_tier(&conf(None, "fifo")).err().unwrap();
    assert!(e.contains("fifo"), "{e}");
    let mut c = conf(None, "");
    c.bandwidth = f64::NAN;
    assert!(a.new_tier(&c).is_err());
    let t = a.new_tier(&conf(None, "")).unwrap();
    assert_eq!(t.stats().policy, "aware");
    let f = t.create(MIB, 0).unwrap();
    assert_ne!(f.ptr, 0);
    assert_eq!(t.size(f.id), MIB);
    t.put(f.id, 3).unwrap();
    t.offload(f.id).unwrap();
    t.poll().unwrap();
    assert_eq!(t.state(f.id), TierState::Evicted);
    t.reconfigure(&conf(Some(8 * MIB), "lru")).unwrap();
    assert_eq!(t.stats().policy, "lru");
    t.advance(3).unwrap();
    t.poll().unwrap();
    assert_eq!(
        t.state(f.id),
        TierState::Put,
        "prefetched back near its next use"
    );
    let g = t.get(f.id, 9).unwrap();
    assert!(g.hit);
    t.free(f.id).unwrap();
    t.flush().unwrap();
    t.verify().unwrap();
    // Adopting what the allocator never handed out names the pointer.
    let e = t.adopt(0x1234_0000, 512, 0).unwrap_err();
    assert!(e.contains("0x12340000") || e.contains("unknown"), "{e}");
}

#[test]
fn relieve_evicts_put_tensors_and_gives_their_blocks_back() {
    let a = new_simulated_allocator(GIB, 0, "").unwrap();
    let t = a.new_tier(&conf(None, "aware")).unwrap();
    let p = a.allocate(8 * MIB, 0);
    let id = t.adopt(p.ptr, 8 * MIB, 0).unwrap();
    assert_eq!(t.relieve(MIB).unwrap(), 0, "nothing put: nothing to give");
    t.put(id, -1).unwrap();
    assert_eq!(t.relieve(MIB).unwrap(), 8 * MIB);
    assert_eq!(t.state(id), TierState::Evicted);
    t.verify().unwrap();
    t.free(id).unwrap();
}
